//! Chat-template rendering and tokenizer behaviour on the embedded tiny model's files.

use std::path::PathBuf;

use glm5::chat::{ChatError, ChatOptions, ChatTemplate, Message};
use glm5::tokenizer::{TokenStream, Tokenizer};

fn asset_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-glm5")
}

fn template() -> ChatTemplate {
    ChatTemplate::from_model_dir(asset_dir()).expect("chat template loads")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(asset_dir().join("tokenizer.json")).expect("tokenizer loads")
}

fn no_prompt() -> ChatOptions {
    ChatOptions {
        add_generation_prompt: false,
        ..ChatOptions::default()
    }
}

#[test]
fn system_and_user_with_thinking() {
    let messages = [Message::system("You are terse."), Message::user("Hi!")];
    let text = template()
        .render(&messages, &ChatOptions::default())
        .unwrap();
    assert_eq!(
        text,
        "[gMASK]<sop><|system|>\nYou are terse.<|user|>\nHi!<|assistant|><think>"
    );
}

#[test]
fn thinking_off() {
    let options = ChatOptions {
        enable_thinking: false,
        ..ChatOptions::default()
    };
    let text = template()
        .render(&[Message::user("Hi!")], &options)
        .unwrap();
    assert_eq!(text, "[gMASK]<sop><|user|>\nHi!<|assistant|></think>");
}

#[test]
fn multi_turn_keeps_reasoning_only_after_last_user() {
    let messages = [
        Message::user("2+2?"),
        Message::assistant("4").with_reasoning("Add them."),
        Message::user("And 3+3?"),
        Message::assistant(" 6 ").with_reasoning(" Add again. "),
    ];
    let text = template().render(&messages, &no_prompt()).unwrap();
    assert_eq!(
        text,
        "[gMASK]<sop><|user|>\n2+2?<|assistant|></think>4<|user|>\nAnd 3+3?<|assistant|><think>Add again.</think>6"
    );
    // Reasoning inline in the content is split out the same way.
    let inline = [Message::user("Q"), Message::assistant("<think>R</think>A")];
    assert_eq!(
        template().render(&inline, &no_prompt()).unwrap(),
        "[gMASK]<sop><|user|>\nQ<|assistant|><think>R</think>A"
    );
}

#[test]
fn template_from_tokenizer_config() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "eos_token": {"content": "<|endoftext|>"},
        "bos_token": "<s>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role|upper }}]{{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}{{ {'a': [1, 'é']}|tojson }}{% endif %}{{ eos_token }}"},
        ],
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let text = ChatTemplate::from_model_dir(dir.path())
        .unwrap()
        .render(&[Message::user("  hello  ")], &ChatOptions::default())
        .unwrap();
    assert_eq!(text, "<s>[USER]hello\n{\"a\": [1, \"é\"]}<|endoftext|>");

    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{{ raise_exception('no ' ~ messages[0].role) }}"}"#,
    )
    .unwrap();
    let err = ChatTemplate::from_model_dir(dir.path())
        .unwrap()
        .render(&[Message::user("x")], &ChatOptions::default());
    assert!(
        matches!(&err, Err(ChatError::Render(e)) if format!("{e:#}").contains("no user")),
        "{err:?}"
    );
}

#[test]
fn missing_template_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        ChatTemplate::from_model_dir(dir.path()),
        Err(ChatError::MissingTemplate { .. })
    ));
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    assert!(matches!(
        ChatTemplate::from_model_dir(dir.path()),
        Err(ChatError::MissingTemplate { .. })
    ));
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    assert!(matches!(
        ChatTemplate::from_model_dir(dir.path()),
        Err(ChatError::Json { .. })
    ));
    assert!(matches!(
        ChatTemplate::new("{% if %}", None, None),
        Err(ChatError::Syntax { .. })
    ));
}

#[test]
fn round_trip_ascii_and_multibyte() {
    let tok = tokenizer();
    for text in [
        "Hello, how are you today?",
        "café é",
        "日本語のテキスト",
        "emoji 🦀👍🏽!",
        "  spaces\tand\nlines  ",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "ids {ids:?}");
    }
    // Common words are single tokens.
    assert_eq!(tok.encode(" the").unwrap().len(), 1);
}

#[test]
fn special_tokens_in_text_are_single_ids() {
    let tok = tokenizer();
    let ids = tok
        .encode("[gMASK]<sop><|user|>\nHi<|assistant|><think>")
        .unwrap();
    let id = |t: &str| tok.token_id(t).unwrap_or_else(|| panic!("{t} missing"));
    assert_eq!(&ids[..3], &[id("[gMASK]"), id("<sop>"), id("<|user|>")]);
    assert_eq!(&ids[ids.len() - 2..], &[id("<|assistant|>"), id("<think>")]);
    assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
    // No BOS/EOS is added.
    assert_eq!(tok.encode("x").unwrap().len(), 1);
    assert_eq!(tok.token_id("no such token"), None);
}

#[test]
fn token_stream_never_splits_characters() {
    let tok = tokenizer();
    let text = "Grüße, 日本語 🦀🦀 naïve café 👍🏽 done";
    let ids = tok.encode(text).unwrap();
    let decoded_singly: Vec<String> = ids.iter().map(|&i| tok.decode(&[i]).unwrap()).collect();
    assert!(
        decoded_singly.iter().any(|s| s.contains('\u{FFFD}')),
        "test needs characters split across tokens"
    );

    let mut stream = TokenStream::new(&tok);
    let mut out = String::new();
    for &id in &ids {
        if let Some(chunk) = stream.push(id).unwrap() {
            assert!(!chunk.contains('\u{FFFD}'), "chunk {chunk:?}");
            out.push_str(&chunk);
            assert!(text.starts_with(&out), "{out:?} is not a prefix");
        }
    }
    if let Some(rest) = stream.finish().unwrap() {
        out.push_str(&rest);
    }
    assert_eq!(out, text);
    assert_eq!(stream.finish().unwrap(), None);
}

#[test]
fn token_stream_flushes_incomplete_tail_and_can_skip_specials() {
    let tok = tokenizer();
    let ids = tok.encode("a🦀").unwrap();
    let mut stream = TokenStream::new(&tok);
    let mut out = String::new();
    for &id in &ids[..ids.len() - 1] {
        out.extend(stream.push(id).unwrap());
    }
    assert_eq!(out, "a", "the partial crab is held back");
    assert!(stream
        .finish()
        .unwrap()
        .is_some_and(|rest| rest.ends_with('\u{FFFD}')));

    let ids = tok.encode("<|assistant|>hi<|endoftext|>").unwrap();
    let mut stream = TokenStream::new(&tok).skip_special_tokens(true);
    let mut out = String::new();
    for &id in &ids {
        out.extend(stream.push(id).unwrap());
    }
    out.extend(stream.finish().unwrap());
    assert_eq!(out, "hi");
}
