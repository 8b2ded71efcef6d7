//! Layers placed across two GPUs (`cuda:0`, `cuda:1`): the HF fixtures give the logits of one GPU, in f32
//! (within 1e-3) and bf16 (within 2e-2 relative per position); decode tokens/s for 1 vs 2 GPUs and the bytes
//! moved between them per token are printed. Needs two GPUs: run by `scripts/gpu-run.sh multi-gpu` on the
//! `nvidia-h200-x2` machine (it fails, saying so, on fewer).
#![cfg(feature = "cuda")]

use std::time::Instant;

use glm5::candle_core::{DType, Device};
use glm5::models::Checkpoint;
use glm5::{AttentionMode, Config, DeviceDesc, Glm5ForCausalLM, Plan, PlanOptions, Registry};

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{fixture_dir, logit_rows, max_abs_diff, reference, relative_l2};

/// The model with layer `l` on `devices[layer_device(l)]`.
fn planned(
    name: &str,
    dtype: DType,
    devices: &[Device],
    layer_device: impl Fn(usize) -> usize,
) -> Glm5ForCausalLM {
    let dir = fixture_dir(name);
    let config = Config::from_file(dir.join("config.json")).unwrap();
    let mut options = PlanOptions::new(dtype, AttentionMode::Sparse);
    options.layer_devices = Some((0..config.num_hidden_layers).map(layer_device).collect());
    let plan = Plan::build(
        &config,
        devices.iter().map(|d| DeviceDesc::of(d).unwrap()).collect(),
        &options,
        &Registry::builtin(),
    )
    .unwrap();
    Glm5ForCausalLM::load_planned(&config, &Checkpoint::open(&dir).unwrap(), plan, devices).unwrap()
}

/// Prefill of the first 6 tokens, then one-token decode steps; logits rows and decode tokens/s.
fn run(model: &Glm5ForCausalLM, ids: &[u32]) -> (Vec<Vec<f32>>, f64) {
    let mut cache = model.new_cache(ids.len()).unwrap();
    let mut rows = vec![model.forward(&ids[..6], 0, &mut cache).unwrap()];
    let start = Instant::now();
    for (pos, &id) in ids.iter().enumerate().skip(6) {
        rows.push(model.forward(&[id], pos, &mut cache).unwrap());
    }
    let rate = (ids.len() - 6) as f64 / start.elapsed().as_secs_f64();
    (logit_rows(&rows), rate)
}

#[test]
fn layers_split_over_two_gpus_match_one_gpu() {
    let count =
        glm5::candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().unwrap();
    assert!(count >= 2, "this test needs two GPUs, found {count}");
    let gpus = [Device::new_cuda(0).unwrap(), Device::new_cuda(1).unwrap()];
    for name in ["sparse_long", "dense_equiv", "bf16_storage"] {
        let (ids, _) = reference(name);
        let config = Config::from_file(fixture_dir(name).join("config.json")).unwrap();
        let n = config.num_hidden_layers;
        for dtype in [DType::F32, DType::BF16] {
            let one = planned(name, dtype, &gpus[..1], |_| 0);
            let two = planned(name, dtype, &gpus, |l| usize::from(l >= n / 2));
            let (want, one_rate) = run(&one, &ids);
            let (got, two_rate) = run(&two, &ids);
            // One boundary per forward call: the prefill and each decode step.
            assert_eq!(two.transfers(), 1 + ids.len() - 6, "{name}");
            let worst = if dtype == DType::F32 {
                max_abs_diff(&got, &want)
            } else {
                got.iter()
                    .zip(&want)
                    .map(|(g, w)| relative_l2(g, w))
                    .fold(0.0, f32::max)
            };
            let bytes_per_token = config.hidden_size * dtype.size_in_bytes();
            println!(
                "{name} {dtype:?}: 2 GPUs vs 1: {} {worst:.2e}; decode {one_rate:.0} tok/s on 1 GPU, {two_rate:.0} tok/s on 2; {bytes_per_token} B moved between GPUs per token",
                if dtype == DType::F32 { "max |Δ|" } else { "max ‖Δ‖/‖ref‖" }
            );
            let limit = if dtype == DType::F32 { 1e-3 } else { 2e-2 };
            assert!(worst <= limit, "{name} {dtype:?}: {worst} > {limit}");
        }
    }
}
