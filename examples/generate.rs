//! The Rust API in a few lines: load a model (the embedded tiny one, or a Hub id / directory given as the
//! first argument), run `forward`, then stream a chat answer.
//!
//! `cargo run --release --example generate [-- zai-org/GLM-5-FP8]`

use std::io::Write;

use glm5::{ChatOptions, GenerationParams, Glm5, LoadOptions, Message};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = LoadOptions::default();
    let model = match std::env::args().nth(1) {
        Some(id_or_dir) => Glm5::from_pretrained(&id_or_dir, &options)?,
        None => Glm5::embedded(&options)?,
    };

    // One forward pass: logits [tokens, vocab] for every position.
    let ids = model.tokenizer().encode("The capital of France is")?;
    let mut cache = model.new_cache(ids.len())?;
    let logits = model.forward(&ids, 0, &mut cache)?;
    println!("logits {:?} from {}", logits.dims(), model.label());

    // Streaming generation from a chat prompt.
    let prompt =
        model.apply_chat_template(&[Message::user("Say hello.")], &ChatOptions::default())?;
    let params = GenerationParams {
        max_new_tokens: 32,
        temperature: 0.7,
        top_p: Some(0.95),
        ..Default::default()
    };
    for token in model.generate(&prompt, &params)? {
        print!("{}", token?.text);
        std::io::stdout().flush().ok();
    }
    println!();
    Ok(())
}
