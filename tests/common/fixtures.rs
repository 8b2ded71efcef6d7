//! The HF transformers fixtures under tests/fixtures (made by make_fixtures.py): where they live and their
//! reference inputs and logits; and the prefill-then-decode run the model tests compare.

use std::path::PathBuf;

use glm5::candle_core::{DType, Device, Tensor};
use glm5::models::Checkpoint;
use glm5::{AttentionMode, Config, DeviceDesc, Glm5ForCausalLM, Plan, PlanOptions, Registry};

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// (input ids, HF reference logits `[T, vocab]` in f32).
#[allow(dead_code)] // tests/placement.rs runs the fixtures without their reference logits
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

/// Prefill of the first `split` ids, then one decode step per remaining id: every logit row, in f32 on the CPU.
#[allow(dead_code)] // not every test crate that includes this module runs a model
pub fn decode_rows(model: &Glm5ForCausalLM, ids: &[u32], split: usize) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(ids.len()).unwrap();
    let mut rows = vec![model.forward(&ids[..split], 0, &mut cache).unwrap()];
    for (pos, &id) in ids.iter().enumerate().skip(split) {
        rows.push(model.forward(&[id], pos, &mut cache).unwrap());
    }
    logit_rows(&rows)
}

/// Logit tensors of consecutive positions (any dtype and device), as f32 rows on the CPU.
#[allow(dead_code)] // not every test crate that includes this module runs a model
pub fn logit_rows(rows: &[Tensor]) -> Vec<Vec<f32>> {
    Tensor::cat(rows, 0)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .to_vec2()
        .unwrap()
}

/// Largest |a - b| over two equally shaped sets of rows.
#[allow(dead_code)] // not every test crate that includes this module compares rows
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// ‖got − want‖ / ‖want‖ of one row (L2 norms): the per-position error measure of the bf16 checks.
#[allow(dead_code)] // not every test crate that includes this module compares bf16 rows
pub fn relative_l2(got: &[f32], want: &[f32]) -> f32 {
    let diff: f32 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f32>()
        .sqrt();
    diff / want.iter().map(|b| b * b).sum::<f32>().sqrt()
}

/// The second largest per-row [`relative_l2`]: the worst row but one, for models whose routers have
/// near-ties that rounding flips at a single position.
#[allow(dead_code)] // not every test crate that includes this module compares bf16 rows
pub fn second_worst_relative_l2(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    let mut per: Vec<f32> = got
        .iter()
        .zip(want)
        .map(|(a, b)| relative_l2(a, b))
        .collect();
    per.sort_by(|a, b| b.total_cmp(a));
    per.get(1).or(per.first()).copied().unwrap_or(0.0)
}

/// The fixture `name` in f32 with sparse attention, its layers split over two plan devices: the first half
/// on `devices[0]` (with the embeddings), the rest and `lm_head` on `devices[1]`, one hidden-state hop at
/// layer n/2 (checked in the plan).
#[allow(dead_code)] // not every test crate that includes this module splits a model
pub fn load_split(name: &str, devices: &[Device; 2]) -> Glm5ForCausalLM {
    let dir = fixture_dir(name);
    let config = Config::from_file(dir.join("config.json")).unwrap();
    let n = config.num_hidden_layers;
    let mut options = PlanOptions::new(DType::F32, AttentionMode::Sparse);
    options.layer_devices = Some((0..n).map(|l| usize::from(l >= n / 2)).collect());
    let plan = Plan::build(
        &config,
        devices.iter().map(|d| DeviceDesc::of(d).unwrap()).collect(),
        &options,
        &Registry::builtin(),
    )
    .unwrap();
    assert_eq!(plan.boundaries(), vec![(n / 2, 0, 1)]);
    Glm5ForCausalLM::load_planned(&config, &Checkpoint::open(&dir).unwrap(), plan, devices).unwrap()
}
