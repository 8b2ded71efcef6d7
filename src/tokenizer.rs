//! Text ↔ token ids over a Hugging Face `tokenizer.json` (GLM-5: byte-level BPE), and an incremental
//! detokeniser for streaming output.
//!
//! GLM prompts get `[gMASK]<sop>` from the chat template, so [`Tokenizer::encode`] adds no special tokens of
//! its own (no BOS, no post-processor); special tokens written in the text are still recognised as such.

use std::path::{Path, PathBuf};

use glm5_models::config::read_text_file;

/// Bytes of `tokenizer.json` read at most (GLM-5's has about 20 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// Text longer than this many bytes per token of room is refused before it is tokenised: tokenising costs
/// about a hundred bytes of memory per byte of text, and no tokenizer of a model glm5 runs covers more than
/// a few dozen bytes with one token on average.
pub const MAX_BYTES_PER_TOKEN: usize = 256;

/// Why a tokenizer could not be loaded or could not encode/decode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` is missing, unreadable or not a valid tokenizer definition.
    #[error("cannot load tokenizer {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What the tokenizers crate reported.
        reason: String,
    },
    /// The tokenizer rejected the input text.
    #[error("cannot encode text: {0}")]
    Encode(String),
    /// The ids could not be turned back into text (e.g. an id outside the vocabulary).
    #[error("cannot decode token ids: {0}")]
    Decode(String),
    /// The text has so many bytes that it cannot fit the room left for it ([`MAX_BYTES_PER_TOKEN`]);
    /// refused before it is tokenised.
    #[error("{what} has {bytes} bytes, more than {MAX_BYTES_PER_TOKEN} per token of the {limit} tokens of room")]
    TooLong {
        /// What was being encoded (e.g. "the chat turn").
        what: String,
        /// Its size in bytes.
        bytes: usize,
        /// Tokens of room.
        limit: usize,
    },
}

/// Result of tokenizer operations.
pub type Result<T> = std::result::Result<T, TokenizerError>;

/// A Hugging Face tokenizer used the GLM way: no special tokens added on encode.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let load = |reason: String| TokenizerError::Load {
            path: path.to_path_buf(),
            reason,
        };
        let text = read_text_file(path, MAX_TOKENIZER_BYTES).map_err(|e| load(e.to_string()))?;
        parse(&text).map(|inner| Self { inner }).map_err(load)
    }

    /// Parses the text of a `tokenizer.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        parse(text)
            .map(|inner| Self { inner })
            .map_err(|reason| TokenizerError::Load {
                path: PathBuf::from("tokenizer.json"),
                reason,
            })
    }

    /// Wraps an already built `tokenizers::Tokenizer`.
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Self { inner }
    }

    /// The underlying `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`. Adds no BOS/EOS, but special tokens written in `text` (e.g. `<|user|>`) map to
    /// their single ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of `text` (as [`Tokenizer::encode`]), unless it is longer than `limit *
    /// MAX_BYTES_PER_TOKEN` bytes: then it is refused before it is tokenised, so that a huge input costs no
    /// memory. The caller compares the count of the result with `limit`; `what` names the text in the error.
    pub fn encode_bounded(&self, text: &str, limit: usize, what: &str) -> Result<Vec<u32>> {
        if text.len() > limit.saturating_mul(MAX_BYTES_PER_TOKEN) {
            return Err(TokenizerError::TooLong {
                what: what.to_string(),
                bytes: text.len(),
                limit,
            });
        }
        self.encode(text)
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// Text of `ids`, leaving out tokens marked special when `skip_special_tokens` is set.
    pub fn decode_with(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Id of a token string (a vocabulary entry or an added token such as `<|endoftext|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer can produce, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// A `tokenizer.json` text as a tokenizer, never a panic. tokenizers 0.23 panics on some malformed files
/// instead of returning an error: a JSON syntax error inside the decoder (`expect("Helper")`), a BPE merge
/// longer than every vocabulary entry (an out-of-range slice in `BpeBuilder::build`). The JSON is parsed on
/// its own first and the merges are checked, which rules both out; anything else it panics on is caught and
/// returned as the error.
fn parse(text: &str) -> std::result::Result<tokenizers::Tokenizer, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    check_merges(&value["model"])?;
    std::panic::catch_unwind(|| serde_json::from_value(value))
        .map_err(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            format!("the tokenizers crate failed on it: {message}")
        })?
        .map_err(|e| e.to_string())
}

/// Every BPE merge `a b` must not be longer than the longest vocabulary entry (tokenizers sizes a buffer by
/// that entry and slices past it otherwise).
fn check_merges(model: &serde_json::Value) -> std::result::Result<(), String> {
    let (Some(vocab), Some(merges)) = (model["vocab"].as_object(), model["merges"].as_array())
    else {
        return Ok(());
    };
    let longest = vocab.keys().map(String::len).max().unwrap_or(0);
    for merge in merges {
        let len = match merge {
            serde_json::Value::String(pair) => pair.len().saturating_sub(1),
            serde_json::Value::Array(pair) => {
                pair.iter().filter_map(|p| p.as_str()).map(str::len).sum()
            }
            _ => continue,
        };
        if len > longest {
            return Err(format!(
                "model.merges: {merge} makes a token of {len} bytes, longer than every vocabulary entry ({longest})"
            ));
        }
    }
    Ok(())
}

/// Incremental detokeniser: feed generated ids one by one, get text as soon as it is complete.
///
/// Decodes a sliding window of tokens and emits what it adds to the previously emitted prefix. While the
/// decoded window ends in U+FFFD (a multi-byte character split across byte-level tokens) nothing is emitted,
/// so every chunk is whole UTF-8 characters.
pub struct TokenStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl<'a> TokenStream<'a> {
    /// A stream that keeps special tokens in its output.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special_tokens: false,
        }
    }

    /// Sets whether tokens marked special are left out of the output.
    pub fn skip_special_tokens(mut self, skip: bool) -> Self {
        self.skip_special_tokens = skip;
        self
    }

    /// Every token pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Adds `token`; returns the newly completed text, or `None` while it is held back.
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        let prefix = self.decode(self.prefix_offset..self.read_offset)?;
        let text = self.decode(self.prefix_offset..self.tokens.len())?;
        if text.len() <= prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(new) = text.get(prefix.len()..) else {
            return Ok(None);
        };
        let new = new.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(Some(new))
    }

    /// Flushes the held-back remainder (possibly ending in U+FFFD if the stream stopped mid-character).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let prefix = self.decode(self.prefix_offset..self.read_offset)?;
        let text = self.decode(self.prefix_offset..self.tokens.len())?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(text
            .get(prefix.len()..)
            .filter(|rest| !rest.is_empty())
            .map(str::to_string))
    }

    fn decode(&self, range: std::ops::Range<usize>) -> Result<String> {
        self.tokenizer
            .decode_with(&self.tokens[range], self.skip_special_tokens)
    }
}
