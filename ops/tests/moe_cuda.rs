//! The CUDA MoE kernels (routing, grouping, grouped mat-vecs, per-token sum) against the CPU reference, on
//! fresh random inputs, their outputs landing in memory filled with NaN just before. Needs a GPU: built with
//! `--features cuda` and run by `scripts/gpu-run.sh` on the GPU machine.
#![cfg(feature = "cuda")]

#[allow(dead_code)]
mod common;

use candle_core::{DType, Device, Tensor};
use common::{poison, rng, uniform};
use glm5_ops::moe::{
    experts_backend, experts_reference, experts_with, route, route_reference, router_logits,
    router_logits_reference, ExpertsBackend, ExpertsImpl, Routes, GROUPED_GEMM_MIN_TOKENS,
    MATVEC_MAX_TOKENS, ROUTER_MAX_TOKENS,
};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

#[test]
fn route_on_gpu_equals_the_reference() {
    let gpu = gpu();
    let mut r = rng(4601);
    let cases = common::route_rules();
    for (e, rule) in cases {
        for t in [1, 7, 64, 300] {
            for tied in [false, true] {
                let mut logits: Vec<f32> = uniform(&mut r, t * e).iter().map(|x| x * 4.0).collect();
                let mut bias: Vec<f32> = uniform(&mut r, e).iter().map(|x| x * 0.05).collect();
                if tied {
                    logits
                        .iter_mut()
                        .for_each(|x| *x = (*x * 2.0).round() / 2.0);
                    bias.iter_mut().for_each(|b| *b = 0.0);
                }
                for shared in [None, Some(e as u32)] {
                    let cpu_logits = Tensor::from_slice(&logits, (t, e), &Device::Cpu).unwrap();
                    let cpu_bias = Tensor::from_slice(&bias, e, &Device::Cpu).unwrap();
                    let want = route_reference(&cpu_logits, &cpu_bias, &rule, shared).unwrap();
                    poison(&gpu, t * (rule.top_k + 1) * 8);
                    let got = route(
                        &cpu_logits.to_device(&gpu).unwrap(),
                        &cpu_bias.to_device(&gpu).unwrap(),
                        &rule,
                        shared,
                    )
                    .unwrap();
                    let (want_ids, got_ids): (Vec<Vec<u32>>, Vec<Vec<u32>>) =
                        (want.ids.to_vec2().unwrap(), got.ids.to_vec2().unwrap());
                    let want_gates: Vec<Vec<f32>> = want.gates.to_vec2().unwrap();
                    let got_gates: Vec<Vec<f32>> = got.gates.to_vec2().unwrap();
                    // The device's expf may round a sigmoid an ulp away from the host's: where two experts'
                    // choices are that close, their order (or which of them makes the cut) may differ. Every
                    // difference must be such a near-tie (an exact tie must go to the lower expert, as on the
                    // host); each expert's gate is the reference's.
                    let choice = |token: usize, id: u32| {
                        let id = id as usize;
                        1.0 / (1.0 + (-logits[token * e + id]).exp()) + bias[id]
                    };
                    for token in 0..t {
                        for (k, (&g, &w)) in got_ids[token].iter().zip(&want_ids[token]).enumerate()
                        {
                            if g != w {
                                assert!(
                                    (g as usize) < e
                                        && (w as usize) < e
                                        && (choice(token, g) - choice(token, w)).abs() <= 1e-6
                                        && choice(token, g) != choice(token, w),
                                    "e={e} t={t} tied={tied} {rule:?}: token {token} slot {k} chose {g} where \
                                     the reference chose {w}"
                                );
                            }
                            if let Some(at) = want_ids[token].iter().position(|&id| id == g) {
                                let (gate, want_gate) =
                                    (got_gates[token][k], want_gates[token][at]);
                                assert!(
                                    (gate - want_gate).abs() <= 1e-6 * want_gate.abs().max(1.0),
                                    "gate {gate} vs {want_gate}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn router_logits_on_gpu_equal_the_reference() {
    // GLM-5's router (256 experts over 6144 values) and one off the kernel's tiles; token counts up to and
    // past the kernel's; x starting one value into its buffer (16-byte loads no longer fit: candle's matmul).
    let gpu = gpu();
    let mut r = rng(4611);
    for (n_experts, hidden) in [(256, 6144), (13, 1060)] {
        for dtype in [DType::BF16, DType::F32] {
            for (t, offset) in [
                (1, 0),
                (5, 0),
                (ROUTER_MAX_TOKENS, 0),
                (ROUTER_MAX_TOKENS + 1, 0),
                (3, 1),
            ] {
                let x = Tensor::from_vec(
                    uniform(&mut r, t * hidden + offset),
                    t * hidden + offset,
                    &Device::Cpu,
                )
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
                let x = x
                    .narrow(0, offset, t * hidden)
                    .unwrap()
                    .reshape((t, hidden))
                    .unwrap();
                let w = Tensor::from_vec(
                    uniform(&mut r, n_experts * hidden),
                    (n_experts, hidden),
                    &Device::Cpu,
                )
                .unwrap();
                let want: Vec<f32> = router_logits_reference(&x, &w)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                poison(&gpu, t * n_experts * 4);
                let got: Vec<f32> =
                    router_logits(&x.to_device(&gpu).unwrap(), &w.to_device(&gpu).unwrap())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                // f32 sums in another order: within 1e-5 of the logits' scale.
                let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * scale,
                        "E={n_experts} H={hidden} {dtype:?} t={t} offset={offset} logit {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

fn random_routes(r: &mut rand::rngs::StdRng, t: usize, slots: usize, n_experts: usize) -> Routes {
    use rand::Rng;
    let ids: Vec<u32> = (0..t * slots)
        .map(|_| r.random_range(0..n_experts as u32))
        .collect();
    let gates: Vec<f32> = (0..t * slots).map(|_| r.random_range(0.0..1.0)).collect();
    Routes {
        ids: Tensor::from_slice(&ids, (t, slots), &Device::Cpu).unwrap(),
        gates: Tensor::from_slice(&gates, (t, slots), &Device::Cpu).unwrap(),
    }
}

/// `experts_with(which)` on the GPU, its output landing in NaN-filled memory, against the reference in f32 on
/// the CPU: within 1e-5 of the output's scale in f32, 2e-2 in bf16 (the kernels round h and the output to bf16
/// like the model).
fn check_on_gpu(
    gpu: &Device,
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
    which: ExpertsImpl,
) {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let want = experts_reference(&f32(x), routes, &f32(gate_up), &f32(down)).unwrap();
    let on_gpu = |t: &Tensor| t.to_device(gpu).unwrap();
    let (gx, gw, gd) = (on_gpu(x), on_gpu(gate_up), on_gpu(down));
    let groutes = Routes {
        ids: on_gpu(&routes.ids),
        gates: on_gpu(&routes.gates),
    };
    let (t, slots) = routes.ids.dims2().unwrap();
    poison(
        gpu,
        t * slots * (x.dim(1).unwrap() + gate_up.dim(1).unwrap()) * 8,
    );
    let got = f32(&experts_with(&gx, &groutes, &gw, &gd, which).unwrap())
        .to_device(&Device::Cpu)
        .unwrap();
    let max_abs = |t: Tensor| {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let scale = max_abs(want.clone());
    let err = max_abs((got - &want).unwrap());
    let dtype = x.dtype();
    let bound = if dtype == DType::F32 { 1e-5 } else { 2e-2 } * scale.max(1.0);
    println!("{which:?} {dtype:?} t={t} slots={slots}: max |Δ| = {err:.2e} (scale {scale:.2})");
    assert!(err <= bound, "{which:?} {dtype:?} t={t}: {err} > {bound}");
}

#[test]
fn experts_on_gpu_equal_the_reference() {
    let gpu = gpu();
    let mut r = rng(4602);
    // Hidden and intermediate widths that are not multiples of the blocks' 8 rows, 1..64 tokens.
    let (n_experts, hidden, inter) = (33, 200, 120);
    for dtype in [DType::F32, DType::BF16] {
        for (t, slots) in [(1, 9), (5, 3), (64, 9), (17, 1)] {
            let x = Tensor::from_vec(uniform(&mut r, t * hidden), (t, hidden), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let gate_up = Tensor::from_vec(
                uniform(&mut r, n_experts * 2 * inter * hidden),
                (n_experts, 2 * inter, hidden),
                &Device::Cpu,
            )
            .unwrap()
            .affine(0.1, 0.0)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
            let down = Tensor::from_vec(
                uniform(&mut r, n_experts * hidden * inter),
                (n_experts, hidden, inter),
                &Device::Cpu,
            )
            .unwrap()
            .affine(0.1, 0.0)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
            let routes = random_routes(&mut r, t, slots, n_experts);
            // What `experts_backend` chooses; the mat-vecs at every size (pinned), and from the switch both
            // GEMM forms.
            let on_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
            let grouped = t >= GROUPED_GEMM_MIN_TOKENS;
            assert_eq!(
                experts_backend(&on_gpu(&x), &on_gpu(&gate_up), &on_gpu(&down)),
                if grouped {
                    ExpertsBackend::GroupedGemm
                } else {
                    ExpertsBackend::DeviceMatVec
                }
            );
            let mut impls = vec![ExpertsImpl::DeviceMatVec];
            if grouped {
                impls.extend([ExpertsImpl::GroupedGemm, ExpertsImpl::BucketedGemm]);
            }
            for which in impls {
                check_on_gpu(&gpu, &x, &routes, &gate_up, &down, which);
            }
        }
    }
}

/// Prefill sizes (above MATVEC_MAX_TOKENS tokens) through cuBLAS's grouped GEMM (what `experts_backend` chooses
/// there), against the f32 reference on the CPU, with an expert chosen by no token and the shared expert as a
/// slot of every token.
#[test]
fn prefill_experts_by_grouped_gemm_equal_the_reference() {
    let gpu = gpu();
    let mut r = rng(4605);
    let (n_experts, hidden, inter) = (17, 192, 96);
    for dtype in [DType::F32, DType::BF16] {
        for (t, slots) in [(MATVEC_MAX_TOKENS + 1, 4), (600, 9)] {
            let mut weights = |rows: usize, k: usize| {
                Tensor::from_vec(
                    uniform(&mut r, n_experts * rows * k),
                    (n_experts, rows, k),
                    &Device::Cpu,
                )
                .unwrap()
                .affine(0.1, 0.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
            };
            let (gate_up, down) = (weights(2 * inter, hidden), weights(hidden, inter));
            let x = Tensor::from_vec(uniform(&mut r, t * hidden), (t, hidden), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            // Experts 0..n-3 routed (n-2 by no token), the shared expert (the last) in the final slot.
            let mut routes = random_routes(&mut r, t, slots - 1, n_experts - 2);
            let shared = Tensor::full(n_experts as u32 - 1, (t, 1), &Device::Cpu).unwrap();
            routes.ids = Tensor::cat(&[&routes.ids, &shared], 1).unwrap();
            routes.gates = Tensor::cat(
                &[
                    &routes.gates,
                    &Tensor::ones((t, 1), DType::F32, &Device::Cpu).unwrap(),
                ],
                1,
            )
            .unwrap();
            let on_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
            assert_eq!(
                experts_backend(&on_gpu(&x), &on_gpu(&gate_up), &on_gpu(&down)),
                ExpertsBackend::GroupedGemm
            );
            // The chosen grouped GEMM, and the same by batched GEMMs over buckets of experts (pinned).
            for which in [ExpertsImpl::GroupedGemm, ExpertsImpl::BucketedGemm] {
                check_on_gpu(&gpu, &x, &routes, &gate_up, &down, which);
            }
        }
    }
}

/// The grouped FP8 / NVFP4 / i-quant expert kernels against the dense reference on the dequantised weights
/// (CPU, f32), 1..64 tokens, widths whose chunk counts are not multiples of a warp, FP8 with partial edge
/// blocks, i-quants with gate/up and down in different formats; and a prefill of 300 tokens by the grouped
/// GEMM over the dequantised experts. Each size through the implementation `quantized_experts` chooses.
#[test]
fn quantized_experts_on_gpu_equal_the_reference() {
    use common::quantized::{experts as quantized, Format};
    use glm5_ops::gguf_matmul::GgufFormat;
    use glm5_ops::moe::{quantized_experts, quantized_experts_backend};
    let gpu = gpu();
    let mut r = rng(4903);
    let n_experts = 13;
    let iq = |gate_up, down| Format::GgufBlocks { gate_up, down };
    for (format, (hidden, inter)) in [
        (Format::Fp8 { block: [128, 128] }, (272, 48)),
        (Format::Fp8 { block: [16, 32] }, (272, 48)),
        (Format::Nvfp4, (272, 48)),
        (iq(GgufFormat::Iq3S, GgufFormat::Iq4Xs), (768, 256)),
        (iq(GgufFormat::Iq2Xxs, GgufFormat::Iq2S), (256, 512)),
        (iq(GgufFormat::Iq2Xs, GgufFormat::Iq3Xxs), (256, 256)),
        (iq(GgufFormat::Iq1S, GgufFormat::Iq1M), (512, 256)),
        (iq(GgufFormat::Iq4Nl, GgufFormat::Iq4Nl), (96, 160)),
        (iq(GgufFormat::Q4K, GgufFormat::Q4K), (768, 512)),
        (iq(GgufFormat::Iq3S, GgufFormat::Q4K), (256, 256)),
    ] {
        let (weights, gate_up, down) = quantized(&mut r, &format, (n_experts, hidden, inter), &gpu);
        for dtype in [DType::F32, DType::BF16] {
            // Decode sizes by the grouped mat-vecs, and a prefill by the grouped GEMM.
            for (t, slots, chosen) in [
                (1, 9, ExpertsBackend::DeviceMatVec),
                (5, 3, ExpertsBackend::DeviceMatVec),
                (64, 9, ExpertsBackend::DeviceMatVec),
                (17, 1, ExpertsBackend::DeviceMatVec),
                (MATVEC_MAX_TOKENS + 44, 9, ExpertsBackend::GroupedGemm),
            ] {
                let x = Tensor::from_vec(uniform(&mut r, t * hidden), (t, hidden), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let routes = random_routes(&mut r, t, slots, n_experts);
                let want =
                    experts_reference(&x.to_dtype(DType::F32).unwrap(), &routes, &gate_up, &down)
                        .unwrap();
                let gx = x.to_device(&gpu).unwrap();
                assert_eq!(quantized_experts_backend(&gx, &weights), chosen);
                let groutes = Routes {
                    ids: routes.ids.to_device(&gpu).unwrap(),
                    gates: routes.gates.to_device(&gpu).unwrap(),
                };
                poison(&gpu, t * slots * (hidden + inter) * 8);
                let got = quantized_experts(&gx, &groutes, &weights)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap();
                let scale = want
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let err = (got - &want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let bound = if dtype == DType::F32 { 1e-5 } else { 2e-2 } * scale.max(1e-3);
                println!(
                    "quantized {chosen:?} {dtype:?} t={t} slots={slots}: max |Δ| = {err:.2e} (scale {scale:.2e})"
                );
                assert!(err <= bound, "{dtype:?} t={t}: {err} > {bound}");
            }
        }
    }
}
