//! The embedded tiny model: written to disk once, loads through the normal path, runs.

use glm5::candle_core::{DType, Device};
use glm5::chat::{ChatOptions, ChatTemplate, Message};
use glm5::tokenizer::Tokenizer;
use glm5::{embedded, AttentionMode, Config, Glm5ForCausalLM};

#[test]
fn materialize_is_idempotent_and_restores_content() {
    let first = embedded::materialize().unwrap();
    let second = embedded::materialize().unwrap();
    assert_eq!(first, second);
    for (name, bytes) in embedded::FILES {
        assert_eq!(std::fs::read(first.join(name)).unwrap(), bytes, "{name}");
    }
    assert!(first
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("tiny-glm5-"));

    // A damaged file (one the other test does not read) is rewritten.
    let damaged = first.join("generation_config.json");
    std::fs::write(&damaged, b"garbage").unwrap();
    assert_eq!(embedded::materialize().unwrap(), first);
    assert_eq!(std::fs::read(&damaged).unwrap(), embedded::FILES[1].1);
}

#[test]
fn embedded_model_loads_and_runs() {
    let dir = embedded::materialize().unwrap();
    let config = Config::from_file(dir.join("config.json")).unwrap();
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert!(
        tokenizer.vocab_size() <= config.vocab_size,
        "{} > {}",
        tokenizer.vocab_size(),
        config.vocab_size
    );
    let eos = tokenizer.token_id("<|endoftext|>").unwrap();
    assert!(
        config.eos_token_ids.contains(&eos)
            && config
                .eos_token_ids
                .contains(&tokenizer.token_id("<|user|>").unwrap())
    );

    let prompt = ChatTemplate::from_model_dir(&dir)
        .unwrap()
        .render(
            &[
                Message::system("Be brief."),
                Message::user("Hello! What is the capital of France?"),
            ],
            &ChatOptions::default(),
        )
        .unwrap();
    let ids = tokenizer.encode(&prompt).unwrap();
    assert_eq!(
        &ids[..2],
        &[
            tokenizer.token_id("[gMASK]").unwrap(),
            tokenizer.token_id("<sop>").unwrap()
        ]
    );

    let model =
        Glm5ForCausalLM::from_dir(&dir, DType::F32, &Device::Cpu, AttentionMode::Sparse).unwrap();
    let mut cache = model.new_cache(ids.len() + 1).unwrap();
    let logits = model.forward(&ids, 0, &mut cache).unwrap();
    assert_eq!(logits.dims(), &[ids.len(), config.vocab_size]);
    let values: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    assert!(values.iter().all(|v| v.is_finite()));
    assert!(values.iter().any(|&v| v != 0.0));
}
