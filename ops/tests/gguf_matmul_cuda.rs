//! The i-quant CUDA kernels (mat-vec up to MAX_ROWS rows, dequantise above) against the CPU reference (itself
//! checked bit for bit against gguf-py in gguf_matmul.rs), on the fixture's random blocks of every format and on
//! random blocks at GLM-5's projection sizes; outputs land in memory filled with NaN just before. Needs a GPU:
//! built with `--features cuda` and run by `scripts/gpu-run.sh` on the GPU machine.
#![cfg(feature = "cuda")]

#[allow(dead_code)]
mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use common::quantized::gguf_blocks;
use common::{poison, q8_1_quantized, rng, uniform};
use glm5_ops::gguf_matmul::{self, reference, GgufFormat, GgufWeight, MAX_ROWS};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

fn fixture() -> std::collections::HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf/iq-blocks.safetensors");
    candle_core::safetensors::load(path, &Device::Cpu).expect("iq-blocks.safetensors")
}

/// The largest |got − want| over what rounding allows it (above 1: out of bounds), per output o of a row x:
/// the f32 sums' order, 1e-5·Σ_k |x_k·w_ok|; in bf16 also the output's rounding, u·|want_o|, and, above
/// MAX_ROWS, the weights rounded to bf16 for the matmul, u·Σ_k |x_k·w_ok| (u = 2^-8, bf16's unit roundoff).
/// Bounds of the sum of the products' magnitudes, not of |want_o| alone: a sum of cancelling products can be
/// far smaller than its terms.
fn worst_ratio(got: &Tensor, want: &Tensor, x: &Tensor, dense: &Tensor) -> f32 {
    let values = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let rows = x.dim(0).unwrap();
    let x = x.to_dtype(DType::F32).unwrap();
    let magnitudes = values(
        &x.abs()
            .unwrap()
            .matmul(&dense.abs().unwrap().t().unwrap())
            .unwrap(),
    );
    let (bf16, weights_rounded) = (got.dtype() == DType::BF16, rows > MAX_ROWS);
    let unit = 2f32.powi(-8);
    values(got)
        .iter()
        .zip(values(want))
        .zip(magnitudes)
        .map(|((g, w), m)| {
            let mut allowed = 1e-5 * m;
            if bf16 {
                allowed += unit * w.abs() + if weights_rounded { unit * m } else { 0.0 };
            }
            if g.is_finite() {
                (g - w).abs() / allowed.max(f32::MIN_POSITIVE)
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max)
}

/// One weight on the GPU against the CPU reference (bounds: [`worst_ratio`]), for mat-vec row counts and
/// the dequantise path.
fn check(format: GgufFormat, blocks: &Tensor, inp: usize, seed: u64) {
    let gpu = gpu();
    let cpu_w = GgufWeight::new(format, blocks.clone(), inp).unwrap();
    let gpu_w = GgufWeight::new(format, blocks.to_device(&gpu).unwrap(), inp).unwrap();
    assert_eq!(
        gguf_matmul::dispatch(&gpu_w, &glm5_ops::DeviceDesc::of(&gpu).unwrap())
            .unwrap()
            .decode
            .name,
        "gguf-w16-cuda"
    );
    // The GPU's decoded values are the reference's, bit for bit.
    poison(&gpu, blocks.elem_count() * 32);
    let dense = gguf_matmul::dequantize(&gpu_w, DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let want = reference::dequantize(&cpu_w).unwrap();
    let same = dense
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .zip(want.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .all(|(a, b)| a.to_bits() == b.to_bits() || (*a == 0.0 && b == 0.0));
    assert!(
        same,
        "{format}: GPU dequantised values differ from the reference"
    );
    let mut r = rng(seed);
    for rows in [1, 2, 5, MAX_ROWS, MAX_ROWS + 1, 40] {
        let x = Tensor::from_vec(uniform(&mut r, rows * inp), (rows, inp), &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let x = x.to_dtype(dtype).unwrap();
            // Q4_K times one bf16 row runs on the int8 tensor cores: x quantised as q8_1 (the contract).
            let x_f32 = x.to_dtype(DType::F32).unwrap();
            let x_f32 = if format == GgufFormat::Q4K && dtype == DType::BF16 && rows == 1 {
                let values = x_f32.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                Tensor::from_vec(q8_1_quantized(&values), (rows, inp), &Device::Cpu).unwrap()
            } else {
                x_f32
            };
            let want = gguf_matmul::gguf_matmul(&x_f32, &cpu_w).unwrap();
            poison(&gpu, rows * blocks.dim(0).unwrap() * 8);
            let got = gguf_matmul::gguf_matmul(&x.to_device(&gpu).unwrap(), &gpu_w).unwrap();
            assert_eq!(got.dtype(), dtype);
            let ratio = worst_ratio(&got.to_device(&Device::Cpu).unwrap(), &want, &x_f32, &dense);
            println!(
                "{format} [{}, {inp}] rows {rows} {dtype:?}: worst error {ratio:.2} of its bound",
                blocks.dim(0).unwrap()
            );
            assert!(
                ratio <= 1.0,
                "{format} rows {rows} {dtype:?}: {ratio:.3} of the bound"
            );
        }
    }
}

#[test]
fn every_format_on_the_gpu_matches_the_reference() {
    let fixture = fixture();
    for (i, format) in GgufFormat::ALL.into_iter().enumerate() {
        let blocks = fixture[&format!("{}.blocks", format.name())].clone();
        let inp = fixture[&format!("{}.values", format.name())]
            .dim(1)
            .unwrap();
        check(format, &blocks, inp, 100 + i as u64);
    }
}

#[test]
fn glm5_projection_sizes_match_the_reference() {
    // GLM-5's expert projections (hidden 6144 -> moe intermediate 2048, and back) in the formats published
    // mixes give experts, and an output width that is not a multiple of the block of warps.
    let mut seed = 900;
    for format in [
        GgufFormat::Iq2Xxs,
        GgufFormat::Iq2S,
        GgufFormat::Iq3S,
        GgufFormat::Iq4Xs,
        GgufFormat::Iq1M,
        GgufFormat::Q4K,
    ] {
        for (out, inp) in [(2048, 6144), (6144, 2048), (37, 512)] {
            seed += 1;
            check(
                format,
                &gguf_blocks(&mut rng(seed), format, out, inp),
                inp,
                seed,
            );
        }
    }
}
