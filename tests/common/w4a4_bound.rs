//! What the W4A4 tests share (`tests/nvfp4_w4a4.rs`, CPU references; `tests/fp8_nvfp4_cuda.rs`, the sm_120
//! kernel): a seeded random stream, test activations, and the derived bound on how far NVFP4 W4A4
//! (activations quantised, `nvfp4_matmul` module contract) may lie from W4A16 (activations exact).
//!
//! Per activation `x` in a block of unit `u = e4m3(s) · g` (its quantised value is `e2m1(code) · u` with
//! `code` the nearest e2m1 value to `|x| / u`, 6 above), the rounding error is at most half an e2m1 step at
//! `r = |x| / u`: 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6], i.e. `max(0.25, 0.25 r)`; above 6 (the block's
//! scale rounded down) it is `r - 6`. So `e = max(u / 4, |x| / 4, |x| - 6u)`, plus the f32 roundings of
//! `|x| / u` and of `s · g` (each relative 2^-24: `4 · 2^-24 (|x| + 6u)` covers them). Then
//! `|y4a4 - y4a16| <= Σ_k e_k |W[n, k]| + (2 γ_K + 4 · 2^-24) Σ_k (|x_k| + e_k) |W[n, k]|`, the second term
//! the two f32 sums in any order (`γ_K = K 2^-24 / (1 - K 2^-24)`), the weight's product with its global
//! scale and the two final scalings. Nothing here is fitted: the bound comes from the e2m1 grid.

use glm5::candle_core::{DType, Device, Tensor};
use glm5::ops::fp8_matmul::reference::e4m3_table;
use glm5::ops::nvfp4_matmul::{reference, Nvfp4Weight};

// The including test crate declares `bound_tools` (once, whichever bound files it takes).
pub use crate::bound_tools::{against_bound, median, seed, Stream, U};

/// Per output `[rows, out]` (f64, row-major): the bound on `|y4a4 - y4a16|` for `x` `[rows, in]` (f32
/// values, the activations as the op reads them) and the weight `w` (on the CPU).
pub fn w4a4_error_bound(x: &Tensor, w: &Nvfp4Weight) -> Vec<f64> {
    let (rows, k) = x.dims2().unwrap();
    let x32 = x.to_dtype(DType::F32).unwrap();
    let values: Vec<f32> = x32.flatten_all().unwrap().to_vec1().unwrap();
    let acts = reference::quantize_activations(&x32).unwrap();
    let scales: Vec<u8> = acts.scales.flatten_all().unwrap().to_vec1().unwrap();
    let g: Vec<f32> = acts.row_scales.to_vec1().unwrap();
    let table = e4m3_table();
    let weight: Vec<f32> = reference::dequantize(w)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let out = weight.len() / k;
    let gamma = k as f64 * U / (1.0 - k as f64 * U);
    let mut bound = Vec::with_capacity(rows * out);
    for r in 0..rows {
        let err: Vec<f64> = (0..k)
            .map(|c| {
                let x = values[r * k + c].abs() as f64;
                let unit = table[scales[r * k / 16 + c / 16] as usize] as f64 * g[r] as f64;
                (unit / 4.0).max(x / 4.0).max(x - 6.0 * unit) + 4.0 * U * (x + 6.0 * unit)
            })
            .collect();
        for n in 0..out {
            let wrow = &weight[n * k..(n + 1) * k];
            let (mut quantisation, mut magnitude) = (0.0f64, 0.0f64);
            for c in 0..k {
                let wv = wrow[c].abs() as f64;
                quantisation += err[c] * wv;
                magnitude += (values[r * k + c].abs() as f64 + err[c]) * wv;
            }
            bound.push(quantisation + (2.0 * gamma + 4.0 * U) * magnitude);
        }
    }
    bound
}

/// Activations like a transformer's: uniform in [-1, 1) with a few outlier channels 30x larger; row 1 all
/// zeros, row 2 with one value 10^5 times its row (most of its blocks get subnormal e4m3 scales).
pub fn w4a4_activations(rng: &mut Stream, m: usize, k: usize) -> Tensor {
    Tensor::from_vec(
        crate::bound_tools::outlier_activations(rng, m, k),
        (m, k),
        &Device::Cpu,
    )
    .unwrap()
}
