//! The i-quant CUDA kernels (mat-vec up to MAX_ROWS rows, dequantise above) against the CPU reference (itself
//! checked bit for bit against gguf-py in iq_matmul.rs), on the fixture's random blocks of every format and on
//! random blocks at GLM-5's projection sizes; outputs land in memory filled with NaN just before. Needs a GPU:
//! built with `--features cuda` and run by `scripts/gpu-run.sh` on the GPU machine.
#![cfg(feature = "cuda")]

#[allow(dead_code)]
mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use common::quantized::iq_blocks;
use common::{rng, uniform};
use glm5_ops::iq_matmul::{self, reference, IqFormat, IqWeight, MAX_ROWS};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

fn poison(device: &Device, bytes: usize) {
    let nan = Tensor::full(f32::NAN, bytes / 4, device).unwrap();
    device.synchronize().unwrap();
    drop(nan);
}

fn fixture() -> std::collections::HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf/iq-blocks.safetensors");
    candle_core::safetensors::load(path, &Device::Cpu).expect("iq-blocks.safetensors")
}

/// Largest per-row ‖got − want‖ / ‖want‖.
fn worst_row_error(got: &Tensor, want: &Tensor) -> f32 {
    let got = got.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    let want = want.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    got.iter()
        .zip(&want)
        .map(|(g, w)| {
            let diff: f32 = g.iter().zip(w).map(|(a, b)| (a - b) * (a - b)).sum();
            if g.iter().any(|v| !v.is_finite()) {
                return f32::INFINITY;
            }
            diff.sqrt() / w.iter().map(|b| b * b).sum::<f32>().sqrt()
        })
        .fold(0.0, f32::max)
}

/// One weight on the GPU against the CPU reference: f32 activations within 1e-5 (only the order of the f32
/// sums differs), bf16 within 1e-2 (the bf16 output's rounding, 2^-9, and above MAX_ROWS the weights rounded
/// to bf16 for the matmul), for mat-vec row counts and the dequantise path.
fn check(format: IqFormat, blocks: &Tensor, inp: usize, seed: u64) {
    let gpu = gpu();
    let cpu_w = IqWeight::new(format, blocks.clone(), inp).unwrap();
    let gpu_w = IqWeight::new(format, blocks.to_device(&gpu).unwrap(), inp).unwrap();
    assert_eq!(
        iq_matmul::dispatch(&gpu_w, &glm5_ops::DeviceDesc::of(&gpu).unwrap())
            .unwrap()
            .decode
            .name,
        "iq-w16-cuda"
    );
    // The GPU's decoded values are the reference's, bit for bit.
    poison(&gpu, blocks.elem_count() * 32);
    let dense = iq_matmul::dequantize(&gpu_w, DType::F32)
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
            let want = iq_matmul::iq_matmul(&x.to_dtype(DType::F32).unwrap(), &cpu_w).unwrap();
            poison(&gpu, rows * blocks.dim(0).unwrap() * 8);
            let got = iq_matmul::iq_matmul(&x.to_device(&gpu).unwrap(), &gpu_w).unwrap();
            assert_eq!(got.dtype(), dtype);
            let err = worst_row_error(&got.to_device(&Device::Cpu).unwrap(), &want);
            let bound = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            println!(
                "{format} [{}, {inp}] rows {rows} {dtype:?}: worst row error {err:.2e}",
                blocks.dim(0).unwrap()
            );
            assert!(
                err <= bound,
                "{format} rows {rows} {dtype:?}: {err:.3e} > {bound:e}"
            );
        }
    }
}

#[test]
fn every_format_on_the_gpu_matches_the_reference() {
    let fixture = fixture();
    for (i, format) in IqFormat::ALL.into_iter().enumerate() {
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
        IqFormat::Iq2Xxs,
        IqFormat::Iq2S,
        IqFormat::Iq3S,
        IqFormat::Iq4Xs,
        IqFormat::Iq1M,
    ] {
        for (out, inp) in [(2048, 6144), (6144, 2048), (37, 512)] {
            seed += 1;
            check(
                format,
                &iq_blocks(&mut rng(seed), format, out, inp),
                inp,
                seed,
            );
        }
    }
}
