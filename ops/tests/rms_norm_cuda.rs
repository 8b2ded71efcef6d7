//! The CUDA row kernels against their references on fresh random rows: RMSNorm, SwiGLU, argmax and the fused
//! cache-row kernels (the MLA latent row, the indexer key); the references are candle tensor ops in HF's
//! order of roundings (argmax's a scan on the host), the output landing in memory filled with NaN just
//! before where the test says so. Needs a GPU: built with `--features cuda`.
#![cfg(feature = "cuda")]

#[allow(dead_code)]
mod common;

use candle_core::{DType, Device, Tensor};
use common::{poison, rng, uniform};
use glm5_ops::argmax::{argmax, argmax_reference};
use glm5_ops::rms_norm::{rms_norm, rms_norm_reference};
use glm5_ops::swiglu::{swiglu, swiglu_reference};

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
            poison(&gpu, 4 * rows * cols * 2);
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

/// The residual add and RMSNorm in one kernel against the two ops it replaces on the GPU (candle's add, then
/// glm5's RMSNorm kernel): bit for bit, into memory filled with NaN just before.
#[test]
fn add_rms_norm_on_gpu_equals_the_add_then_the_norm() {
    use glm5_ops::rms_norm::add_rms_norm;
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4604);
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols) in [(1, 6144), (3, 512), (7, 64), (2, 200), (1, 1)] {
            let x = on_gpu(uniform(&mut r, rows * cols), &[rows, cols], dtype, &gpu);
            let residual = on_gpu(
                uniform(&mut r, rows * cols)
                    .iter()
                    .map(|v| v * 8.0)
                    .collect(),
                &[rows, cols],
                dtype,
                &gpu,
            );
            let w = on_gpu(uniform(&mut r, cols), &[cols], dtype, &gpu);
            poison(&gpu, 4 * rows * cols * 4);
            let (sum, normed) = add_rms_norm(&x, &residual, &w, 1e-5).unwrap();
            let want_sum = (&x + &residual).unwrap();
            let want = rms_norm(&want_sum, &w, 1e-5).unwrap();
            for (what, got, want) in [("sum", &sum, &want_sum), ("norm", &normed, &want)] {
                let (got, want) = (host_f32(got), host_f32(want));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype:?} {rows}x{cols} {what} {i}: {g} vs {w}"
                    );
                }
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

/// `values` past the first `offset` as a `shape` tensor of `dtype` on `gpu`: a contiguous view that starts
/// `offset` values into its buffer (off a 16-byte boundary for an odd offset).
fn offset_view(
    values: Vec<f32>,
    offset: usize,
    shape: &[usize],
    dtype: DType,
    gpu: &Device,
) -> Tensor {
    let len = values.len();
    on_gpu(values, &[len], dtype, gpu)
        .narrow(0, offset, len - offset)
        .unwrap()
        .reshape(shape)
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

/// `got` against `want`, rows of `width` values (rows of NaN in both are cache rows left alone). Each value
/// within rounding of its own size and of its row's largest: RoPE's `x·cos − y·sin` can cancel to far below
/// its operands, whose rounding (bf16: the reference rounds after each op, the kernels once) sets the error.
fn assert_rows_close(got: &[f32], want: &[f32], width: usize, dtype: DType, what: &str) {
    let (own, of_row) = if dtype == DType::BF16 {
        (1.0 / 128.0, 1.0 / 128.0)
    } else {
        (1e-5, 1e-6)
    };
    for (row, (g, w)) in got.chunks(width).zip(want.chunks(width)).enumerate() {
        let largest = w
            .iter()
            .filter(|v| v.is_finite())
            .fold(0f32, |m, v| m.max(v.abs()));
        for (j, (g, w)) in g.iter().zip(w).enumerate() {
            let bound = own * w.abs() + of_row * largest;
            assert!(
                (w.is_nan() && g.is_nan()) || (g - w).abs() <= bound,
                "{what} value {}: {g} vs {w}",
                row * width + j
            );
        }
    }
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
                assert_rows_close(
                    &host_f32(&got),
                    &host_f32(&want),
                    width,
                    dtype,
                    &format!("{dtype:?} t={t} by_index={by_index}"),
                );
            }
        }
    }
}

/// `write_attention_rows` on the GPU (one kernel) against the three ops it stands for on the GPU
/// (`write_latent_rows`, `write_index_key_rows`, `rope_leading`: one kernel each, each tested against its
/// reference here), on the same inputs into caches of NaN (keys: float, or FP8 bytes of 0xff and NaN scales):
/// the same bits everywhere, by offset and by row index, at GLM-5's widths with 32 query heads (four blocks of
/// eight) and 13 (a part-filled block).
#[test]
fn attention_rows_on_gpu_equal_the_three_ops() {
    use glm5_ops::attention_rows::{write_attention_rows, IndexKeyStep, LatentRowsStep};
    use glm5_ops::cache_rows::CacheRows;
    use glm5_ops::index_key_rows::write_index_key_rows;
    use glm5_ops::latent_rows::write_latent_rows;
    use glm5_ops::rope_leading::rope_leading;
    use glm5_ops::IndexKeys;
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4970);
    let (lora, rope, key_dim, slots) = (512, 64, 128, 40);
    let width = lora + rope;
    for dtype in [DType::F32, DType::BF16] {
        for (t, heads) in [(1, 32), (5, 13)] {
            let kv_a = on_gpu(uniform(&mut r, t * width), &[t, width], dtype, &gpu);
            let norm_w = on_gpu(uniform(&mut r, lora), &[lora], dtype, &gpu);
            let k = on_gpu(uniform(&mut r, t * key_dim), &[t, key_dim], dtype, &gpu);
            let ln_w = on_gpu(uniform(&mut r, key_dim), &[key_dim], dtype, &gpu);
            let ln_b = on_gpu(uniform(&mut r, key_dim), &[key_dim], dtype, &gpu);
            let q = on_gpu(
                uniform(&mut r, t * heads * key_dim),
                &[t, heads, key_dim],
                dtype,
                &gpu,
            );
            let (cos, sin) = rope_tables(&mut r, t, rope / 2, dtype, &gpu);
            let rows: Vec<u32> = (0..t as u32).map(|i| (i * 7 + 3) % slots as u32).collect();
            let rows = Tensor::from_vec(rows, t, &gpu).unwrap();
            for (by_index, fp8) in [(false, false), (true, false), (false, true), (true, true)] {
                let place = if by_index {
                    CacheRows::At(&rows)
                } else {
                    CacheRows::From(slots - t)
                };
                // The latent cache, and the key caches: float keys, FP8 bytes and scales.
                let caches = || {
                    (
                        on_gpu(vec![f32::NAN; slots * width], &[slots, width], dtype, &gpu),
                        (
                            on_gpu(
                                vec![f32::NAN; slots * key_dim],
                                &[slots, key_dim],
                                dtype,
                                &gpu,
                            ),
                            Tensor::full(0xffu8, (slots, key_dim), &gpu).unwrap(),
                            Tensor::full(f32::NAN, slots, &gpu).unwrap(),
                        ),
                    )
                };
                fn view(keys: &(Tensor, Tensor, Tensor), fp8: bool) -> IndexKeys<'_> {
                    if fp8 {
                        IndexKeys::Fp8 {
                            bytes: &keys.1,
                            scales: &keys.2,
                        }
                    } else {
                        IndexKeys::Float(&keys.0)
                    }
                }
                let (want, got) = (caches(), caches());
                write_latent_rows(&kv_a, &norm_w, 1e-6, (&cos, &sin), &want.0, place).unwrap();
                let layer_norm = (&ln_w, &ln_b);
                write_index_key_rows(
                    &k,
                    layer_norm,
                    1e-6,
                    (&cos, &sin),
                    view(&want.1, fp8),
                    place,
                )
                .unwrap();
                let want_q = rope_leading(&q, &cos, &sin).unwrap();
                let latent = LatentRowsStep {
                    kv_a: &kv_a,
                    norm_weight: &norm_w,
                    eps: 1e-6,
                    cache: &got.0,
                };
                let key = IndexKeyStep {
                    k: &k,
                    layer_norm,
                    eps: 1e-6,
                    cache: view(&got.1, fp8),
                };
                let got_q = write_attention_rows(latent, key, &q, (&cos, &sin), place).unwrap();
                let what = format!("{dtype:?} t={t} heads={heads} by_index={by_index} fp8={fp8}");
                let bits = |x: &Tensor| host_f32(x).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let bytes = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                assert_eq!(bits(&got.0), bits(&want.0), "{what}: the latent cache");
                assert_eq!(bits(&got.1 .0), bits(&want.1 .0), "{what}: the float keys");
                assert_eq!(
                    bytes(&got.1 .1),
                    bytes(&want.1 .1),
                    "{what}: the FP8 key bytes"
                );
                assert_eq!(
                    bits(&got.1 .2),
                    bits(&want.1 .2),
                    "{what}: the FP8 key scales"
                );
                assert_eq!(bits(&got_q), bits(&want_q), "{what}: the rotated query");
                let written = host_f32(&want.0)
                    .chunks(width)
                    .filter(|row| !row[0].is_nan())
                    .count();
                assert_eq!(written, t, "{what}: latent rows written");
            }
        }
    }
}

/// `write_index_key_rows` on the GPU (one kernel) against its reference on the GPU (candle-nn's layer_norm and
/// rope_i, index_keys' FP8 quantiser, scatters), float and FP8 caches, by offset and by row index, at GLM-5's
/// key width (128, RoPE on 64).
#[test]
fn index_key_rows_on_gpu_equal_the_reference() {
    use glm5_ops::fp8_matmul::reference::e4m3_table;
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
                assert_rows_close(
                    &host_f32(&got),
                    &host_f32(&want),
                    dim,
                    dtype,
                    &format!("{dtype:?} t={t} by_index={by_index} key"),
                );
                // FP8 keys: scales within 1%; the decoded keys (code · scale) one e4m3 step apart (a key on a
                // rounding boundary), plus in bf16 the keys' own difference (the float check's row term).
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
                let (got_s, want_s) = (host_f32(&scales), host_f32(&want_s));
                for (g, v) in got_s.iter().zip(&want_s) {
                    assert!(
                        (v.is_nan() && g.is_nan()) || (g - v).abs() <= 1e-2 * v.abs(),
                        "{dtype:?} t={t}: scale {g} vs {v}"
                    );
                }
                let decoded = |x: &Tensor, scales: &[f32]| -> Vec<f32> {
                    let codes: Vec<u8> = x.flatten_all().unwrap().to_vec1().unwrap();
                    let table = e4m3_table();
                    codes
                        .iter()
                        .enumerate()
                        .map(|(i, &c)| table[c as usize] * scales[i / dim])
                        .collect()
                };
                let (got, want) = (decoded(&bytes, &got_s), decoded(&want_b, &want_s));
                let of_row = if dtype == DType::BF16 {
                    1.0 / 128.0
                } else {
                    1e-6
                };
                for (row, (g, v)) in got.chunks(dim).zip(want.chunks(dim)).enumerate() {
                    if want_s[row].is_nan() {
                        // A row the write leaves alone: still the 0xff (NaN) fill.
                        assert!(
                            g.iter().all(|x| x.is_nan()),
                            "{dtype:?} t={t}: row {row} written"
                        );
                        continue;
                    }
                    let largest = v.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for (j, (g, v)) in g.iter().zip(v).enumerate() {
                        // One step: 2^-3 of a normal value, 2^-9 of the scale below the normals.
                        let step = (v.abs() / 8.0).max(want_s[row] * 2f32.powi(-9));
                        assert!(
                            (g - v).abs() <= step + of_row * largest,
                            "{dtype:?} t={t} by_index={by_index} FP8 key {}: {g} vs {v}",
                            row * dim + j
                        );
                    }
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
                let width = *want.dims().last().unwrap();
                assert_rows_close(
                    &host_f32(&got),
                    &host_f32(&want),
                    width,
                    dtype,
                    &format!("{what} {dtype:?} t={t}"),
                );
            }
        }
    }
}

/// `head_products` and `absorbed_query_one_token` on the GPU (one kernel) against their references (cuBLAS's
/// batched matmul; the absorbed query's RoPE half as `absorbed_query_reference`), their outputs landing in
/// NaN: MLA's W_UK and W_UV at GLM-5's widths over 64 heads, and small odd shapes (a partial column block,
/// rows fewer than a block's warps take). A product within f32 summation of Σ|x·w| (the order differs), and
/// in bf16 one rounding of its own size too.
#[test]
fn head_products_on_gpu_equal_the_reference() {
    use glm5_ops::absorbed_query::{absorbed_query_one_token, absorbed_query_reference};
    use glm5_ops::head_products::{head_products, head_products_reference};
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4850);
    for dtype in [DType::F32, DType::BF16] {
        let own = if dtype == DType::BF16 {
            1.0 / 128.0
        } else {
            0.0
        };
        for (heads, k, n, rope) in [
            (64, 192, 512, 64),
            (64, 512, 256, 0),
            (3, 7, 24, 4),
            (2, 40, 8, 0),
        ] {
            let x_host = uniform(&mut r, heads * (k + rope));
            let w_host = uniform(&mut r, heads * k * n);
            let q = on_gpu(x_host, &[1, heads, k + rope], dtype, &gpu);
            let w = on_gpu(w_host, &[heads, k, n], dtype, &gpu);
            let x = q
                .squeeze(0)
                .unwrap()
                .narrow(1, 0, k)
                .unwrap()
                .contiguous()
                .unwrap();
            // Σ_r |x[h, r] · w[h, r, c]| from the values as the dtype holds them.
            let (xs, ws) = (host_f32(&x), host_f32(&w));
            let magnitude: Vec<f32> = (0..heads * n)
                .map(|i| {
                    let (h, c) = (i / n, i % n);
                    (0..k)
                        .map(|row| (xs[h * k + row] * ws[(h * k + row) * n + c]).abs())
                        .sum()
                })
                .collect();
            // Values of heads `first..` in order.
            let check = |what: &str, got: &[f32], want: &[f32], first: usize| {
                for (i, (g, v)) in got.iter().zip(want).enumerate() {
                    let bound = k as f32 * f32::EPSILON * magnitude[first * n + i] + own * v.abs();
                    assert!(
                        (g - v).abs() <= bound,
                        "{what} {dtype:?} [{heads}, {k}, {n}] value {i} of head {first}..: {g} vs {v}"
                    );
                }
            };
            poison(&gpu, 4 * heads * (n + rope));
            let got = head_products(&x, &w).unwrap();
            let want = head_products_reference(&x, &w).unwrap();
            assert_eq!(got.dims(), [heads, n]);
            check("head products", &host_f32(&got), &host_f32(&want), 0);
            if rope == 0 {
                continue;
            }
            let (cos, sin) = rope_tables(&mut r, 1, rope / 2, dtype, &gpu);
            poison(&gpu, 4 * heads * (n + rope));
            let got = absorbed_query_one_token(&q, &w, &cos, &sin).unwrap();
            let want =
                absorbed_query_reference(&q, &want.unsqueeze(1).unwrap(), &cos, &sin).unwrap();
            assert_eq!(got.dims(), [1, heads, n + rope]);
            let (got, want) = (host_f32(&got), host_f32(&want));
            for h in 0..heads {
                let row = h * (n + rope);
                let (g, v) = (&got[row..row + n + rope], &want[row..row + n + rope]);
                check("absorbed query's product", &g[..n], &v[..n], h);
                assert_rows_close(&g[n..], &v[n..], rope, dtype, "absorbed query's RoPE half");
            }
        }
    }
}

/// SwiGLU over stacked gate|up rows against its reference (candle's f32 silu, rounded, times up): 16-byte
/// vectors where the width and the start allow, single values where they do not (a width off the vector
/// size, a view starting one value in).
#[test]
fn swiglu_on_gpu_equals_the_reference() {
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4640);
    for dtype in [DType::F32, DType::BF16] {
        for (rows, inter, offset) in [
            (1, 12288, 0),
            (37, 2048, 0),
            (3, 20, 0),
            (2, 6, 0),
            (4, 2048, 1),
        ] {
            let values = uniform(&mut r, rows * 2 * inter + offset);
            let values = values.into_iter().map(|v| 8.0 * v).collect();
            let gate_up = offset_view(values, offset, &[rows, 2 * inter], dtype, &gpu);
            poison(&gpu, 4 * rows * inter * 2);
            let got = swiglu(&gate_up, inter).unwrap();
            assert_eq!(got.dims(), [rows, inter]);
            let want = swiglu_reference(&gate_up.to_device(&Device::Cpu).unwrap(), inter).unwrap();
            let (got, want) = (host_f32(&got), host_f32(&want));
            // The GPU's expf and the CPU's exp may differ in the last f32 place, which a bf16 rounding can
            // carry to one step of either rounding.
            let tolerance = if dtype == DType::F32 {
                1e-6
            } else {
                2.0f32.powi(-7)
            };
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= tolerance * w.abs().max(1e-3),
                    "{dtype:?} {rows}x{inter} (offset {offset}) value {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// argmax over rows against its reference (the host's scan), the maximum planted twice in one row (the lower
/// index wins) and a NaN in another (it wins); GLM-5's vocabulary width, widths off the vector size, and a
/// view starting one value in (single loads).
#[test]
fn argmax_on_gpu_equals_the_reference() {
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let mut r = rng(4660);
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols, offset) in [(1, 154880, 0), (5, 4099, 0), (3, 8, 0), (2, 1000, 1)] {
            let len = rows * cols + offset;
            let mut values = uniform(&mut r, len);
            values[offset + cols / 3] = 5.0;
            values[offset + cols / 2] = 5.0;
            if rows > 1 {
                values[offset + cols + cols / 4] = f32::NAN;
            }
            let x = offset_view(values, offset, &[rows, cols], dtype, &gpu);
            let got: Vec<u32> = argmax(&x).unwrap().to_vec1().unwrap();
            let want: Vec<u32> = argmax_reference(&x.to_device(&Device::Cpu).unwrap())
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(got, want, "{dtype:?} {rows}x{cols} (offset {offset})");
            assert_eq!(want[0], (cols / 3) as u32);
            if rows > 1 {
                assert_eq!(want[1], (cols / 4) as u32);
            }
        }
    }
}
