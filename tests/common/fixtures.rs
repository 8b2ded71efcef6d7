//! The HF transformers fixtures under tests/fixtures (made by make_fixtures.py): where they live and their
//! reference inputs and logits.

use std::path::PathBuf;

use glm5::candle_core::{Device, Tensor};

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// (input ids, HF reference logits `[T, vocab]` in f32).
pub fn reference(name: &str) -> (Vec<u32>, Tensor) {
    let tensors = glm5::candle_core::safetensors::load(
        fixture_dir(name).join("reference.safetensors"),
        &Device::Cpu,
    )
    .expect("reference.safetensors");
    let ids: Vec<i64> = tensors["input_ids"].to_vec1().expect("input_ids");
    (
        ids.into_iter().map(|id| id as u32).collect(),
        tensors["logits"].clone(),
    )
}
