//! GGUF routed experts kept stacked on the GPU on llama.cpp's Q8_0 and Q4_K_M fixtures (`tests/fixtures/gguf`):
//! candle-nn's GGUF MoE kernels (one `QTensor` per projection, through `glm5_ops::moe::experts_gguf`) each
//! against the experts computed in f32 from the same dequantised weights; the whole model on the GPU (Q8_0's
//! experts through candle-nn, Q4_K_M's Q4_K and Q6_K through glm5's own kernels) against the CPU's per-expert
//! path, decode and prefill; and every i-quant on glm5's kernels. Built with `--features cuda`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use glm5::candle_core::quantized::QTensor;
use glm5::candle_core::{DType, Device, Tensor};
use glm5::models::MlpKind;
use glm5::ops::moe::{
    experts_gguf_reference, experts_gguf_with, GgufExpertsImpl, Routes, GGUF_MATVEC_MAX_TOKENS,
};
use glm5::{AttentionMode, Checkpoint, Config, Glm5ForCausalLM};

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{decode_rows, relative_l2};

const FILES: [&str; 2] = ["wide-Q8_0.gguf", "wide-Q4_K_M.gguf"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

/// The first MoE layer's `mlp` prefix.
fn moe_prefix(config: &Config) -> String {
    let layer = config
        .mlp_layer_types
        .iter()
        .position(|k| *k == MlpKind::MoE)
        .expect("the fixture has a MoE layer");
    format!("model.layers.{layer}.mlp")
}

/// gate, up, down of the first MoE layer, stacked `[E, out, in]`, on `device`.
fn stacked(checkpoint: &Checkpoint, config: &Config, device: &Device) -> [QTensor; 3] {
    let (e, h, i) = (
        config.n_routed_experts,
        config.hidden_size,
        config.moe_intermediate_size,
    );
    let prefix = moe_prefix(config);
    let load = |proj: &str, shape: [usize; 3]| {
        checkpoint
            .stacked_experts(&prefix, proj, shape, device)
            .unwrap()
            .expect("the fixture's experts are stored quantised")
    };
    [
        load("gate_proj", [e, i, h]),
        load("up_proj", [e, i, h]),
        load("down_proj", [e, h, i]),
    ]
}

/// Every GGUF MoE kernel against the experts in f32 from the same dequantised weights (no activation
/// rounding), per token ‖Δ‖/‖reference‖ < 2e-2. What separates them is only the kernels' rounding of the
/// activations (Q8_1 blocks for the mat-vec kernels, bf16 for WMMA, which also rounds the weights to bf16),
/// about 0.5% per projection through gate/up then down; a wrong expert, row or block layout is off by ~100%.
/// 2e-2 is the bound docs/gguf.md holds each quantised projection to.
#[test]
fn each_gguf_moe_kernel_matches_the_dequantised_experts() {
    let gpu = Device::new_cuda(0).unwrap();
    for file in FILES {
        let (config, checkpoint) = Checkpoint::open_gguf(fixture(file)).unwrap();
        let [gate, up, down] = stacked(&checkpoint, &config, &gpu);
        let [gate_cpu, up_cpu, down_cpu] = stacked(&checkpoint, &config, &Device::Cpu);
        let (e, h, k) = (
            config.n_routed_experts,
            config.hidden_size,
            config.num_experts_per_tok,
        );
        // Decode sizes and a prefill above the mat-vec switch; several tokens share experts.
        for tokens in [1, 3, GGUF_MATVEC_MAX_TOKENS + 17] {
            let x: Vec<f32> = (0..tokens * h)
                .map(|j| ((j * 7919 % 1009) as f32 / 1009.0 - 0.5) * 2.0)
                .collect();
            let ids: Vec<u32> = (0..tokens * k)
                .map(|j| ((j / k * 3 + j % k) % e) as u32)
                .collect();
            let gates: Vec<f32> = (0..tokens * k)
                .map(|j| 0.25 + 0.5 * (j % k) as f32 / k as f32)
                .collect();
            let on = |device: &Device| {
                (
                    Tensor::from_vec(x.clone(), (tokens, h), device).unwrap(),
                    Routes {
                        ids: Tensor::from_vec(ids.clone(), (tokens, k), device).unwrap(),
                        gates: Tensor::from_vec(gates.clone(), (tokens, k), device).unwrap(),
                    },
                )
            };
            let (x_cpu, routes_cpu) = on(&Device::Cpu);
            let want: Vec<Vec<f32>> =
                experts_gguf_reference(&x_cpu, &routes_cpu, &gate_cpu, &up_cpu, &down_cpu)
                    .unwrap()
                    .to_vec2()
                    .unwrap();
            let (x_gpu, routes_gpu) = on(&gpu);
            let has_q8_0 = [&gate, &up, &down]
                .iter()
                .any(|q| q.dtype() == glm5::candle_core::quantized::GgmlDType::Q8_0);
            for which in [
                GgufExpertsImpl::MatVec,
                GgufExpertsImpl::Wmma,
                GgufExpertsImpl::Indexed,
            ] {
                let got = experts_gguf_with(&x_gpu, &routes_gpu, &gate, &up, &down, which);
                if which == GgufExpertsImpl::Indexed && has_q8_0 {
                    assert!(got.is_err(), "{file}: indexed_moe_forward must refuse Q8_0");
                    continue;
                }
                let got: Vec<Vec<f32>> = got
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| relative_l2(g, w))
                    .fold(0f32, f32::max);
                println!(
                    "{file}: {which:?}, {tokens} tokens: max ‖Δ‖/‖f32 reference‖ = {worst:.2e}"
                );
                assert!(
                    worst < 2e-2,
                    "{file}: {which:?} at {tokens} tokens is {worst} from the reference"
                );
            }
        }
    }
}

/// The GGUF fixture `file` loaded on the CPU and on the GPU (f32, sparse attention), with its config.
fn cpu_and_gpu(file: &str, gpu: &Device) -> (Config, Glm5ForCausalLM, Glm5ForCausalLM) {
    let (config, checkpoint) = Checkpoint::open_gguf(fixture(file)).unwrap();
    let load = |device: &Device| {
        Glm5ForCausalLM::load(
            &config,
            &checkpoint,
            DType::F32,
            device,
            AttentionMode::Sparse,
        )
        .unwrap()
    };
    let (cpu, on_gpu) = (load(&Device::Cpu), load(gpu));
    (config, cpu, on_gpu)
}

/// Per position before `index_topk`, ‖GPU − CPU‖ / ‖CPU‖ of the logits of 24 ids (`stride` spreads them over
/// the vocabulary): prefill of the first `split` ids, then one decode step per remaining id.
fn gpu_vs_cpu(
    config: &Config,
    cpu: &Glm5ForCausalLM,
    gpu: &Glm5ForCausalLM,
    stride: u32,
    split: usize,
) -> Vec<f32> {
    let ids: Vec<u32> = (0..24u32)
        .map(|i| (i * stride + 5) % config.vocab_size as u32)
        .collect();
    let split = split.min(ids.len());
    let first = ids.len().min(config.index_topk);
    let (want, got) = (decode_rows(cpu, &ids, split), decode_rows(gpu, &ids, split));
    (0..first).map(|p| relative_l2(&got[p], &want[p])).collect()
}

/// The model with its experts stacked on the GPU against the CPU's per-expert path, f32 activations, per
/// position ‖Δ‖/‖CPU‖ < 5e-2 (decode) / 1e-1 (prefill) over the positions before index_topk (after it a
/// flipped DSA selection changes a row outright): decode (one token, then one per step: the mat-vec kernel)
/// and a 24-token prefill (the WMMA kernel). Both sides round the activations, differently: the GPU's kernels
/// to Q8_1 (mat-vec) or bf16 (WMMA), the CPU's `QMatMul` to Q8_0/Q8_K; tests/model_cuda.rs holds the
/// per-expert GPU path to 5e-2 on these files for that reason.
#[test]
fn stacked_gguf_experts_on_gpu_match_the_cpu_per_expert_path() {
    let gpu = Device::new_cuda(0).unwrap();
    for file in FILES {
        let (config, cpu, on_gpu) = cpu_and_gpu(file, &gpu);
        // Q8_0 experts through candle-nn's kernels; Q4_K_M's (Q4_K, Q6_K) through glm5's own.
        let expected = if file.contains("Q8_0") {
            ["per-expert quantised", "candle-nn GGUF MoE"]
        } else {
            ["per-expert GGUF-block reference", "moe-matvec GGUF blocks"]
        };
        for (model, expected) in [(&cpu, expected[0]), (&on_gpu, expected[1])] {
            for layer in model.layer_backends() {
                if layer.mlp == MlpKind::MoE {
                    assert!(
                        layer.experts.starts_with(expected),
                        "{file}: layer {} runs its experts as {:?}",
                        layer.layer,
                        layer.experts
                    );
                }
            }
        }
        let first = config.index_topk.min(24);
        for (what, split) in [("decode", 1), ("prefill", usize::MAX)] {
            let per = gpu_vs_cpu(&config, &cpu, &on_gpu, 37, split);
            let mut sorted = per.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            println!("{file} {what}: GPU stacked vs CPU per-expert, positions < {first}: ‖Δ‖/‖CPU‖ {per:.3?}");
            // A router near-tie that the two sides' different activation rounding flips moves one position
            // further (as on the quantised safetensors fixtures); a layout error would move every position
            // by ~100%. The prefill's WMMA kernel rounds the activations to bf16 where the CPU's QMatMul
            // quantises them to Q8_K: on Q4_K_M that moves every position 3.5-6.7e-2 on the H200.
            let bound = if what == "prefill" { 0.1 } else { 5e-2 };
            assert!(
                sorted[0] < 0.15 && sorted.get(1).copied().unwrap_or(0.0) < bound,
                "{file} {what}: GPU logits differ from the CPU's by {per:?}"
            );
        }
    }
}

/// llama.cpp's i-quant formats (every one in wide-IQ.gguf, whose CPU logits equal gguf-py's dequantised
/// model exactly: tests/gguf.rs) on the GPU through glm5's own kernels: the same weights in f32, so the GPU
/// logits equal the CPU's up to the order of f32 sums (decode: the mat-vec kernels, the experts' grouped;
/// prefill of 24 tokens: dequantise + matmul).
#[test]
fn i_quant_gguf_on_gpu_matches_the_cpu() {
    let gpu = Device::new_cuda(0).unwrap();
    let (config, cpu, on_gpu) = cpu_and_gpu("wide-IQ.gguf", &gpu);
    // Gate and up share a format (IQ3_S, down IQ4_XS, as published mixes): the grouped kernels run them.
    for layer in on_gpu.layer_backends() {
        if layer.mlp == MlpKind::MoE {
            assert!(
                layer.experts.starts_with("moe-matvec GGUF blocks"),
                "{:?}",
                layer.experts
            );
        }
    }
    let first = config.index_topk.min(24);
    for (what, split) in [("decode", 1), ("prefill", usize::MAX)] {
        let per = gpu_vs_cpu(&config, &cpu, &on_gpu, 53, split);
        println!("wide-IQ {what}: GPU vs CPU, positions < {first}: ‖Δ‖/‖CPU‖ {per:.3?}");
        assert!(per.iter().all(|&e| e < 1e-4), "wide-IQ {what}: {per:?}");
    }
}
