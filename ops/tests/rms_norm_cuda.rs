//! The CUDA RMSNorm kernel against the reference (candle tensor ops, HF's order of roundings) on fresh random
//! rows, the output landing in memory filled with NaN just before. Needs a GPU: built with `--features cuda`.
#![cfg(feature = "cuda")]

#[allow(dead_code)]
mod common;

use candle_core::{DType, Device, Tensor};
use common::{rng, uniform};
use glm5_ops::rms_norm::{rms_norm, rms_norm_reference};

#[test]
fn rms_norm_on_gpu_equals_the_reference() {
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4603);
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols) in [(1, 6144), (3, 512), (7, 64), (2, 200), (5, 2048), (1, 1)] {
            let x = Tensor::from_vec(uniform(&mut r, rows * cols), (rows, cols), &Device::Cpu)
                .unwrap()
                .affine(3.0, 0.1)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_device(&gpu)
                .unwrap();
            let w = Tensor::from_vec(uniform(&mut r, cols), cols, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_device(&gpu)
                .unwrap();
            let nan = Tensor::full(f32::NAN, rows * cols * 2, &gpu).unwrap();
            gpu.synchronize().unwrap();
            drop(nan);
            let got = rms_norm(&x, &w, 1e-5)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let want = rms_norm_reference(&x, &w, 1e-5)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
            // f32: summation order only; bf16: at most one rounding step of either cast apart.
            let tolerance = if dtype == DType::F32 {
                1e-5
            } else {
                2.0f32.powi(-6)
            };
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= tolerance * w.abs().max(1e-3),
                    "{dtype:?} {rows}x{cols}: {g} vs {w}"
                );
            }
        }
    }
}
