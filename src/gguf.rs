//! GGUF models in the runtime: telling a GGUF path from a Hugging Face one, and the tokenizer and chat
//! template a GGUF file carries in its metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
//!
//! The tokenizer is built by candle's `TokenizerFromGguf` (a byte-level BPE from `tokenizer.ggml.tokens`,
//! `merges` and the token types, special tokens marked), with the pre-tokenizer fixed where candle's choice
//! differs from the Hugging Face tokenizer the file was converted from: llama.cpp's `glm4`/`glm5` names
//! GLM's own split (candle only knows it as `llama3`), and `gpt-2`'s byte-level split adds no prefix space.
//! An unknown `tokenizer.ggml.pre` is an error, never a guess.

use std::path::Path;

use glm5_models::weights::gguf::GgufModel;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use crate::chat::ChatTemplate;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Whether `path` names a GGUF model: a `.gguf` file, or a directory with `.gguf` files and no
/// `config.json`.
pub fn is_gguf(path: &Path) -> bool {
    if path.is_file() || path.extension().is_some_and(|e| e == "gguf") {
        return path.extension().is_some_and(|e| e == "gguf");
    }
    path.is_dir()
        && !path.join("config.json").exists()
        && std::fs::read_dir(path).is_ok_and(|entries| {
            entries
                .filter_map(|e| e.ok())
                .any(|e| e.path().extension().is_some_and(|x| x == "gguf"))
        })
}

/// The tokenizer of a GGUF model, from its metadata.
pub fn tokenizer(model: &GgufModel) -> Result<Tokenizer, TokenizerError> {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::tokenizer::TokenizerFromGguf;
    let load_err = |reason: String| TokenizerError::Load {
        path: model.parts[0].clone(),
        reason,
    };
    let pre = match model.get("tokenizer.ggml.pre") {
        Some(Value::String(pre)) => pre.clone(),
        _ => "default".to_string(),
    };
    let mut content = model.content();
    // candle's pipeline per pre-tokenizer name; `None`: candle's default pipeline with GPT-2's own split.
    let candle_pre = match pre.as_str() {
        // llama.cpp's LLAMA_VOCAB_PRE_TYPE_CHATGLM4: the llama3 regex, then bytes without a prefix space.
        "glm4" | "glm5" | "chatglm-bpe" | "llama3" | "llama-bpe" | "smaug-bpe" => Some("llama3"),
        "qwen2" => Some("qwen2"),
        "gpt-2" | "default" => None,
        other => {
            return Err(load_err(format!(
                "tokenizer.ggml.pre {other:?} is a pre-tokenizer glm5 does not know (it knows glm4, glm5, \
                 llama3, qwen2 and gpt-2)"
            )))
        }
    };
    content.metadata.insert(
        "tokenizer.ggml.pre".into(),
        Value::String(candle_pre.unwrap_or("gpt2").into()),
    );
    // candle attaches a backtrace to its errors when RUST_BACKTRACE is set, and puts context on lines of its
    // own; the user gets one line.
    let mut inner = tokenizers::Tokenizer::from_gguf(&content).map_err(|e| {
        let text = match e {
            candle_core::Error::WithBacktrace { inner, .. } => inner.to_string(),
            e => e.to_string(),
        };
        load_err(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(": "),
        )
    })?;
    if candle_pre.is_none() {
        // GPT-2's tokenizer.json: ByteLevel(add_prefix_space = false, trim_offsets = true, use_regex = true);
        // candle's default adds a prefix space.
        let byte_level = ByteLevel::new(false, true, true);
        inner.with_pre_tokenizer(Some(byte_level));
        inner.with_decoder(Some(ByteLevel::default()));
    }
    Ok(Tokenizer::from_inner(inner))
}

/// The chat template in `tokenizer.chat_template`, with the bos/eos token strings of the metadata.
pub fn chat_template(model: &GgufModel) -> Option<Result<ChatTemplate, crate::chat::ChatError>> {
    use candle_core::quantized::gguf_file::Value;
    let source = match model.get("tokenizer.chat_template") {
        Some(Value::String(source)) => source.clone(),
        _ => return None,
    };
    let tokens = match model.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => Some(tokens),
        _ => None,
    };
    let token = |key: &str| -> Option<String> {
        let id = model.uint(key).ok().flatten()? as usize;
        match tokens?.get(id)? {
            Value::String(s) => Some(s.clone()),
            _ => None,
        }
    };
    Some(ChatTemplate::new(
        source,
        token("tokenizer.ggml.bos_token_id"),
        token("tokenizer.ggml.eos_token_id"),
    ))
}
