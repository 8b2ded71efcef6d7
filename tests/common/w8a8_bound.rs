//! What the W8A8 tests share (`tests/fp8_w8a8.rs`, CPU references; `tests/fp8_nvfp4_cuda.rs`, the sm_90
//! path): GLM-5's FP8 projection shapes from the published config, test activations, and the derived bound
//! on how far FP8 W8A8 (activations quantised per token and 128 values, `fp8_matmul` module contract) may lie
//! from W8A16 (activations exact).
//!
//! Per activation `x` in a group of scale `s` (its code is `e4m3(fl(x / s))`, its value `fl(e4m3 · s)`): the
//! e4m3 rounding is at most half a step, `2^-4 |x / s|` above e4m3's smallest normal `2^-6` (3 mantissa bits)
//! and `2^-10` below it (subnormal steps of `2^-9`); saturation only trims what the f32 division rounded
//! above 448. With the two f32 roundings (relative `2^-24` each) that gives
//! `e = max(2^-4 |x|, 2^-10 s) + 4 · 2^-24 (|x| + 448 s)`. The two references use the same dequantised weight
//! `W`, so `|y8 - y16| <= Σ_k e_k |W[n, k]| + γ_K Σ_k (2 |x_k| + e_k) |W[n, k]|`, the second term both f32
//! sums in any order (`γ_K = K 2^-24 / (1 - K 2^-24)`). Nothing here is fitted: the bound comes from the e4m3
//! grid. The bound is computed with f64 matmuls (their own rounding, relative `K 2^-53`, is covered by a
//! factor `1 + 2^-30`).
#![allow(dead_code)] // each test binary uses part of it

use glm5::candle_core::{DType, Device, Tensor};
use glm5::ops::fp8_matmul::{reference, Fp8BlockWeight, W8A8_GROUP};
use glm5::Config;

// The including test crate declares `bound_tools` (once, whichever bound files it takes).
pub use crate::bound_tools::{against_bound, median, seed, Stream, U};

/// The published GLM-5-FP8 config (`tests/assets/glm5_fp8/config.json`): GLM-5's sizes and its
/// `weight_block_size`.
pub fn glm5_fp8_config() -> Config {
    Config::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/assets/glm5_fp8/config.json"
    ))
    .unwrap()
}

/// The config's `weight_block_size`.
pub fn fp8_block(config: &Config) -> [usize; 2] {
    match &config.quantization {
        Some(glm5::models::Quantization::Fp8Block { block, .. }) => *block,
        other => panic!("not an FP8 config: {other:?}"),
    }
}

/// `(name, out, in)` of GLM-5's FP8 projections outside the routed experts: `q_a_proj`, `q_b_proj`,
/// `kv_a_proj_with_mqa` (576 rows: a partial 128-block), `o_proj`, the shared expert's gate/up and down, and
/// the dense layers' MLP gate/up and down.
pub fn glm5_fp8_shapes(config: &Config) -> Vec<(&'static str, usize, usize)> {
    let h = config.hidden_size;
    let shared = config.moe_intermediate_size * config.n_shared_experts;
    vec![
        ("q_a_proj", config.q_lora_rank, h),
        (
            "q_b_proj",
            config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim),
            config.q_lora_rank,
        ),
        (
            "kv_a_proj_with_mqa",
            config.kv_lora_rank + config.qk_rope_head_dim,
            h,
        ),
        ("o_proj", h, config.num_attention_heads * config.v_head_dim),
        ("shared expert gate/up", shared, h),
        ("shared expert down", h, shared),
        ("dense MLP gate/up", config.intermediate_size, h),
        ("dense MLP down", h, config.intermediate_size),
    ]
}

/// A random FP8 weight `[n, k]` of 128 x 128 blocks on the CPU: random e4m3 codes, block multipliers in
/// [1e-3, 1.1e-2) (the checkpoint's range of `weight_scale_inv`).
pub fn random_fp8_weight(rng: &mut Stream, n: usize, k: usize) -> Fp8BlockWeight {
    let block = [W8A8_GROUP, W8A8_GROUP];
    let shape = (n.div_ceil(block[0]), k.div_ceil(block[1]));
    let scales: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| 1e-3 + rng.uniform() * 1e-2)
        .collect();
    Fp8BlockWeight {
        weight: Tensor::from_vec(rng.e4m3(n * k, false), (n, k), &Device::Cpu).unwrap(),
        scale_inv: Tensor::from_vec(scales, shape, &Device::Cpu).unwrap(),
        block,
    }
}

/// Activations like a transformer's: uniform in [-1, 1) with a few outlier channels 30x larger; row 1 all
/// zeros; row 2 with one value 10^5 times the rest and one group of values 10^-30 their size (a huge and a
/// tiny group).
pub fn w8a8_activations(rng: &mut Stream, m: usize, k: usize) -> Tensor {
    let mut x = crate::bound_tools::outlier_activations(rng, m, k);
    let tiny = 2 * k + (k / 2 / W8A8_GROUP) * W8A8_GROUP;
    for v in &mut x[tiny..tiny + W8A8_GROUP] {
        *v *= 1e-30;
    }
    Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap()
}

fn f64_abs(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F64).unwrap().abs().unwrap()
}

/// Per output `[rows, out]` (f64, row-major): the bound on `|y8 - y16|` for `x` `[rows, in]` (f32 values,
/// the activations as the op reads them) and the weight `w` (on the CPU).
pub fn w8a8_error_bound(x: &Tensor, w: &Fp8BlockWeight) -> Vec<f64> {
    let (rows, k) = x.dims2().unwrap();
    let x32 = x.to_dtype(DType::F32).unwrap();
    let values: Vec<f32> = x32.flatten_all().unwrap().to_vec1().unwrap();
    let acts = reference::quantize_activations(&x32).unwrap();
    let padded = acts.codes.dim(0).unwrap();
    let scales: Vec<f32> = acts.scales.flatten_all().unwrap().to_vec1().unwrap();
    let err: Vec<f64> = (0..rows * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            let x = values[i].abs() as f64;
            let s = scales[(c / W8A8_GROUP) * padded + r] as f64;
            (x / 16.0).max(s / 1024.0) + 4.0 * U * (x + 448.0 * s)
        })
        .collect();
    let err = Tensor::from_vec(err, (rows, k), &Device::Cpu).unwrap();
    let w_abs = f64_abs(&reference::dequantize(w).unwrap()).t().unwrap();
    let gamma = k as f64 * U / (1.0 - k as f64 * U);
    let quantisation = err.matmul(&w_abs).unwrap();
    let magnitude = ((f64_abs(&x32) * 2.0).unwrap() + &err)
        .unwrap()
        .matmul(&w_abs)
        .unwrap();
    let bound = (quantisation + (magnitude * gamma).unwrap()).unwrap();
    bound
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
        .into_iter()
        .map(|b| b * (1.0 + 2f64.powi(-30)))
        .collect()
}
