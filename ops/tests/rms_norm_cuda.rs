//! The CUDA RMSNorm kernel and the fused cache-row kernels (the MLA latent row, the indexer key) against their
//! references (candle tensor ops, HF's order of roundings) on fresh random rows, the output landing in memory
//! filled with NaN just before. Needs a GPU: built with `--features cuda`.
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

/// `values` in `shape` as a `dtype` tensor on `gpu`.
fn on_gpu(values: Vec<f32>, shape: &[usize], dtype: DType, gpu: &Device) -> Tensor {
    Tensor::from_vec(values, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(gpu)
        .unwrap()
}

/// Random RoPE tables `(cos, sin)` `[t, half]` on `gpu`.
fn rope_tables(
    r: &mut rand::rngs::StdRng,
    t: usize,
    half: usize,
    dtype: DType,
    gpu: &Device,
) -> (Tensor, Tensor) {
    let angles = uniform(r, t * half);
    let table = |f: fn(f32) -> f32| {
        on_gpu(
            angles.iter().map(|a| f(a * 3.0)).collect(),
            &[t, half],
            dtype,
            gpu,
        )
    };
    (table(f32::cos), table(f32::sin))
}

/// `t`'s values as f32 on the host.
fn host_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `write_latent_rows` on the GPU (one kernel) against its reference on the GPU (RMSNorm, candle's `rope_i`,
/// a concatenation, a scatter), into caches of NaN rows, by offset and by row index, at GLM-5's widths.
#[test]
fn latent_rows_on_gpu_equal_the_reference() {
    use glm5_ops::latent_rows::{latent_rows_reference, write_latent_rows, write_rows, CacheRows};
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4813);
    let (lora, rope, slots) = (512, 64, 40);
    let width = lora + rope;
    for dtype in [DType::F32, DType::BF16] {
        for t in [1, 7, 33] {
            let kv_a = on_gpu(uniform(&mut r, t * width), &[t, width], dtype, &gpu);
            let weight = on_gpu(uniform(&mut r, lora), &[lora], dtype, &gpu);
            let (cos, sin) = rope_tables(&mut r, t, rope / 2, dtype, &gpu);
            let rows: Vec<u32> = (0..t as u32).map(|i| (i * 7 + 3) % slots as u32).collect();
            let rows = Tensor::from_vec(rows, t, &gpu).unwrap();
            for by_index in [false, true] {
                let place = if by_index {
                    CacheRows::At(&rows)
                } else {
                    CacheRows::From(slots - t)
                };
                let nan = || on_gpu(vec![f32::NAN; slots * width], &[slots, width], dtype, &gpu);
                let (got, want) = (nan(), nan());
                write_latent_rows(&kv_a, &weight, 1e-6, (&cos, &sin), &got, place).unwrap();
                let values = latent_rows_reference(&kv_a, &weight, 1e-6, &cos, &sin).unwrap();
                write_rows(&want, &values, place).unwrap();
                for (i, (g, w)) in host_f32(&got).iter().zip(host_f32(&want)).enumerate() {
                    let bound = if dtype == DType::BF16 {
                        w.abs() / 128.0
                    } else {
                        1e-5 * w.abs().max(1e-3)
                    };
                    assert!(
                        (w.is_nan() && g.is_nan()) || (g - w).abs() <= bound,
                        "{dtype:?} t={t} by_index={by_index} value {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// `write_index_key_rows` on the GPU (one kernel) against its reference on the GPU (candle-nn's layer_norm and
/// rope_i, index_keys' FP8 quantiser, scatters), float and FP8 caches, by offset and by row index, at GLM-5's
/// key width (128, RoPE on 64).
#[test]
fn index_key_rows_on_gpu_equal_the_reference() {
    use glm5_ops::index_key_rows::{
        index_key_rows_reference, write_index_key_rows, write_rows, CacheRows,
    };
    use glm5_ops::{quantize_fp8, IndexKeys};
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4824);
    let (dim, rope, slots) = (128, 64, 40);
    for dtype in [DType::F32, DType::BF16] {
        for t in [1, 9, 33] {
            let k = on_gpu(
                uniform(&mut r, t * dim)
                    .iter()
                    .map(|v| v * 4.0 + 0.5)
                    .collect(),
                &[t, dim],
                dtype,
                &gpu,
            );
            let w = on_gpu(uniform(&mut r, dim), &[dim], dtype, &gpu);
            let b = on_gpu(
                uniform(&mut r, dim).iter().map(|v| v * 0.1).collect(),
                &[dim],
                dtype,
                &gpu,
            );
            let (cos, sin) = rope_tables(&mut r, t, rope / 2, dtype, &gpu);
            let rows: Vec<u32> = (0..t as u32).map(|i| (i * 7 + 3) % slots as u32).collect();
            let rows = Tensor::from_vec(rows, t, &gpu).unwrap();
            let keys = index_key_rows_reference(&k, (&w, &b), 1e-6, &cos, &sin).unwrap();
            let (want_bytes, want_scales) = quantize_fp8(&keys).unwrap();
            for by_index in [false, true] {
                let place = if by_index {
                    CacheRows::At(&rows)
                } else {
                    CacheRows::From(slots - t)
                };
                // Float keys.
                let nan = || on_gpu(vec![f32::NAN; slots * dim], &[slots, dim], dtype, &gpu);
                let (got, want) = (nan(), nan());
                write_index_key_rows(
                    &k,
                    (&w, &b),
                    1e-6,
                    (&cos, &sin),
                    IndexKeys::Float(&got),
                    place,
                )
                .unwrap();
                write_rows(&want, &keys, place).unwrap();
                for (i, (g, v)) in host_f32(&got).iter().zip(host_f32(&want)).enumerate() {
                    let bound = if dtype == DType::BF16 {
                        v.abs() / 128.0
                    } else {
                        1e-5 * v.abs().max(1e-2)
                    };
                    assert!(
                        (v.is_nan() && g.is_nan()) || (g - v).abs() <= bound,
                        "{dtype:?} t={t} by_index={by_index} key value {i}: {g} vs {v}"
                    );
                }
                // FP8 keys: scales within f32 rounding, bytes at most one e4m3 step apart.
                let bytes = Tensor::full(0xffu8, (slots, dim), &gpu).unwrap();
                let scales = Tensor::full(f32::NAN, slots, &gpu).unwrap();
                let fp8 = IndexKeys::Fp8 {
                    bytes: &bytes,
                    scales: &scales,
                };
                write_index_key_rows(&k, (&w, &b), 1e-6, (&cos, &sin), fp8, place).unwrap();
                let want_b = Tensor::full(0xffu8, (slots, dim), &gpu).unwrap();
                let want_s = Tensor::full(f32::NAN, slots, &gpu).unwrap();
                write_rows(&want_b, &want_bytes, place).unwrap();
                write_rows(&want_s, &want_scales, place).unwrap();
                for (g, v) in host_f32(&scales).iter().zip(host_f32(&want_s)) {
                    assert!(
                        (v.is_nan() && g.is_nan()) || (g - v).abs() <= 1e-2 * v.abs(),
                        "{dtype:?} t={t}: scale {g} vs {v}"
                    );
                }
                let codes = |x: &Tensor| -> Vec<u8> { x.flatten_all().unwrap().to_vec1().unwrap() };
                for (g, v) in codes(&bytes).iter().zip(codes(&want_b)) {
                    let same_sign = (g ^ v) & 0x80 == 0 || (g & 0x7f == 0 && v & 0x7f == 0);
                    assert!(
                        same_sign && (g & 0x7f).abs_diff(v & 0x7f) <= 1,
                        "{dtype:?} t={t}: byte {g:#04x} vs {v:#04x}"
                    );
                }
            }
        }
    }
}

/// `absorbed_query` and `rope_leading` on the GPU (one kernel each) against their references on the GPU
/// (candle-nn's rope_i and a concatenation) at GLM-5's widths over 64 heads.
#[test]
fn query_kernels_on_gpu_equal_the_reference() {
    use glm5_ops::absorbed_query::{absorbed_query, absorbed_query_reference};
    use glm5_ops::rope_leading::{rope_leading, rope_leading_reference};
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4834);
    let (heads, nope, rope, lora, index_dim) = (64, 192, 64, 512, 128);
    for dtype in [DType::F32, DType::BF16] {
        for t in [1, 5, 33] {
            let q = on_gpu(
                uniform(&mut r, t * heads * (nope + rope)),
                &[t, heads, nope + rope],
                dtype,
                &gpu,
            );
            let q_latent = on_gpu(
                uniform(&mut r, heads * t * lora),
                &[heads, t, lora],
                dtype,
                &gpu,
            );
            let x = on_gpu(
                uniform(&mut r, t * heads * index_dim),
                &[t, heads, index_dim],
                dtype,
                &gpu,
            );
            let (cos, sin) = rope_tables(&mut r, t, rope / 2, dtype, &gpu);
            let pairs = [
                (
                    "absorbed query",
                    absorbed_query(&q, &q_latent, &cos, &sin).unwrap(),
                    absorbed_query_reference(&q, &q_latent, &cos, &sin).unwrap(),
                ),
                (
                    "leading RoPE",
                    rope_leading(&x, &cos, &sin).unwrap(),
                    rope_leading_reference(&x, &cos, &sin).unwrap(),
                ),
            ];
            for (what, got, want) in pairs {
                assert_eq!(got.dims(), want.dims(), "{what}");
                for (i, (g, w)) in host_f32(&got).iter().zip(host_f32(&want)).enumerate() {
                    let bound = if dtype == DType::BF16 {
                        w.abs() / 128.0
                    } else {
                        1e-5 * w.abs().max(1e-3)
                    };
                    assert!(
                        (g - w).abs() <= bound,
                        "{what} {dtype:?} t={t} value {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
