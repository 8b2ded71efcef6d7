//! `sparse_mla` against nested loops over `Vec<f32>`.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{rng, tensor, uniform};
use glm5_ops::{sparse_mla, OpError};
use rand::rngs::StdRng;
use rand::seq::{index::sample, SliceRandom};

/// `values` rounded to bf16 and back.
fn round_bf16(values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// One attention problem, held as flat row-major vectors.
struct Case {
    t: usize,
    h: usize,
    n: usize,
    d: usize,
    k: usize,
    value_dim: usize,
    scale: f64,
    q: Vec<f32>,
    cache: Vec<f32>,
    indices: Vec<i32>,
}

impl Case {
    /// Random q and cache; row t of `indices` holds `valid(t)` distinct random rows and -1 in the
    /// other slots, shuffled.
    fn random(
        rng: &mut StdRng,
        [t, h, n, d, k, value_dim]: [usize; 6],
        valid: impl Fn(usize) -> usize,
    ) -> Self {
        let mut indices = Vec::with_capacity(t * k);
        for row in 0..t {
            let mut slots: Vec<i32> = sample(rng, n, valid(row))
                .into_iter()
                .map(|s| s as i32)
                .collect();
            slots.resize(k, -1);
            slots.shuffle(rng);
            indices.extend(slots);
        }
        Case {
            t,
            h,
            n,
            d,
            k,
            value_dim,
            scale: 1.0 / (d as f64).sqrt(),
            q: uniform(rng, t * h * d),
            cache: uniform(rng, n * d),
            indices,
        }
    }

    fn run(&self, dtype: DType) -> (Vec<f32>, Vec<f32>) {
        let q = tensor(&self.q, &[self.t, self.h, self.d], dtype);
        let cache = tensor(&self.cache, &[self.n, self.d], dtype);
        let indices =
            Tensor::from_slice(&self.indices, (self.t, self.k), &Device::Cpu).expect("indices");
        let (out, lse) =
            sparse_mla(&q, &cache, &indices, self.value_dim, self.scale).expect("sparse_mla");
        assert_eq!(out.dims(), &[self.t, self.h, self.value_dim]);
        assert_eq!(out.dtype(), dtype);
        assert_eq!(lse.dims(), &[self.t, self.h]);
        assert_eq!(lse.dtype(), DType::F32);
        let flat = |x: Tensor| {
            x.to_dtype(DType::F32)
                .and_then(|x| x.flatten_all())
                .and_then(|x| x.to_vec1())
                .expect("f32")
        };
        (flat(out), flat(lse))
    }

    /// The spec by loops in f64, attending to the rows `rows(t)` yields.
    fn attend(&self, rows: impl Fn(usize) -> Vec<usize>) -> (Vec<f32>, Vec<f32>) {
        let (h_n, d, dv) = (self.h, self.d, self.value_dim);
        let mut out = vec![0.0f32; self.t * h_n * dv];
        let mut lse = vec![f32::NEG_INFINITY; self.t * h_n];
        for t in 0..self.t {
            let rows = rows(t);
            if rows.is_empty() {
                continue;
            }
            for h in 0..h_n {
                let q = &self.q[(t * h_n + h) * d..][..d];
                let scores: Vec<f64> = rows
                    .iter()
                    .map(|&s| {
                        self.scale
                            * (0..d)
                                .map(|i| q[i] as f64 * self.cache[s * d + i] as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                lse[t * h_n + h] = (max + sum.ln()) as f32;
                for i in 0..dv {
                    let v: f64 = rows
                        .iter()
                        .zip(&scores)
                        .map(|(&s, score)| (score - max).exp() / sum * self.cache[s * d + i] as f64)
                        .sum();
                    out[(t * h_n + h) * dv + i] = v as f32;
                }
            }
        }
        (out, lse)
    }

    /// The rows `indices` selects.
    fn reference(&self) -> (Vec<f32>, Vec<f32>) {
        self.attend(|t| {
            let row = &self.indices[t * self.k..][..self.k];
            row.iter()
                .filter(|&&i| i >= 0)
                .map(|&i| i as usize)
                .collect()
        })
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() }) // -inf == -inf
        .fold(0.0, f32::max)
}

#[test]
fn matches_loops_f32() {
    let mut rng = rng(11);
    // [T, H, N, D, K, value_dim]; K exceeds the valid rows of every query; query 1 has none.
    for shape in [
        [4, 8, 32, 64, 12, 48],
        [3, 16, 100, 576, 40, 512],
        [5, 2, 7, 16, 9, 16],
    ] {
        let n = shape[2];
        let case = Case::random(
            &mut rng,
            shape,
            |t| if t == 1 { 0 } else { (3 * t + 2).min(n) },
        );
        let (out, lse) = case.run(DType::F32);
        let (ref_out, ref_lse) = case.reference();
        assert!(
            max_abs_diff(&out, &ref_out) <= 1e-5,
            "out {shape:?}: {}",
            max_abs_diff(&out, &ref_out)
        );
        assert!(
            max_abs_diff(&lse, &ref_lse) <= 1e-5,
            "lse {shape:?}: {}",
            max_abs_diff(&lse, &ref_lse)
        );

        let (h, dv) = (shape[1], shape[5]);
        assert!(
            out[h * dv..2 * h * dv].iter().all(|&x| x == 0.0),
            "row without indices: out = 0"
        );
        assert!(
            lse[h..2 * h].iter().all(|&x| x == f32::NEG_INFINITY),
            "row without indices: lse = -inf"
        );
    }
}

#[test]
fn bf16_inputs_within_tolerance() {
    let mut rng = rng(12);
    let mut case = Case::random(&mut rng, [4, 8, 64, 576, 20, 512], |t| 5 * t + 1);
    case.scale = 0.0625;
    let (out, lse) = case.run(DType::BF16);
    case.q = round_bf16(&case.q);
    case.cache = round_bf16(&case.cache);
    let (ref_out, ref_lse) = case.reference();
    assert!(
        max_abs_diff(&out, &ref_out) <= 1e-2,
        "out: {}",
        max_abs_diff(&out, &ref_out)
    );
    assert!(
        max_abs_diff(&lse, &ref_lse) <= 1e-4,
        "lse: {}",
        max_abs_diff(&lse, &ref_lse)
    );
}

#[test]
fn no_valid_index_anywhere_gives_zeros_and_neg_inf() {
    for n in [0, 5] {
        let case = Case {
            t: 3,
            h: 4,
            n,
            d: 8,
            k: 6,
            value_dim: 4,
            scale: 0.3,
            q: uniform(&mut rng(13), 3 * 4 * 8),
            cache: uniform(&mut rng(14), n * 8),
            indices: vec![-1; 3 * 6],
        };
        let (out, lse) = case.run(DType::F32);
        assert!(out.iter().all(|&x| x == 0.0));
        assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    }
}

/// Selecting every position 0..=t is dense causal attention.
#[test]
fn all_causal_positions_equal_dense_causal_attention() {
    let (t, h, d, value_dim) = (9, 4, 40, 32);
    let mut rng = rng(15);
    let mut case = Case::random(&mut rng, [t, h, t, d, t + 3, value_dim], |_| 0);
    for row in 0..t {
        let slots = &mut case.indices[row * case.k..][..case.k];
        for (slot, s) in slots.iter_mut().zip(0..=row) {
            *slot = s as i32;
        }
        slots.shuffle(&mut rng);
    }
    let (out, lse) = case.run(DType::F32);
    let (dense_out, dense_lse) = case.attend(|t| (0..=t).collect());
    assert!(max_abs_diff(&out, &dense_out) <= 1e-5);
    assert!(max_abs_diff(&lse, &dense_lse) <= 1e-5);
}

/// With K = 2048 and D = 576 a chunk gathers 56 queries' rows, so 60 queries take two chunks.
#[test]
fn glm5_sized_rows_span_two_chunks() {
    let mut rng = rng(16);
    let case = Case::random(&mut rng, [60, 2, 3000, 576, 2048, 512], |t| 2048 - t);
    let (out, lse) = case.run(DType::F32);
    let (ref_out, ref_lse) = case.reference();
    assert!(
        max_abs_diff(&out, &ref_out) <= 1e-5,
        "out: {}",
        max_abs_diff(&out, &ref_out)
    );
    assert!(
        max_abs_diff(&lse, &ref_lse) <= 1e-5,
        "lse: {}",
        max_abs_diff(&lse, &ref_lse)
    );
}

#[test]
fn rejects_bad_input() {
    let q = tensor(&[0.5; 2 * 3 * 8], &[2, 3, 8], DType::F32);
    let cache = tensor(&[0.5; 5 * 8], &[5, 8], DType::F32);
    let indices = |v: &[i32]| Tensor::from_slice(v, (2, 2), &Device::Cpu).expect("indices");
    let good = indices(&[0, -1, 4, 2]);
    let err = |q: &Tensor, cache: &Tensor, indices: &Tensor, value_dim| {
        sparse_mla(q, cache, indices, value_dim, 1.0).expect_err("bad input must be rejected")
    };

    assert!(matches!(
        err(&q, &cache, &indices(&[0, 5, 1, 2]), 4),
        OpError::IndexOutOfRange {
            row: 0,
            col: 1,
            value: 5,
            cache_len: 5,
            ..
        }
    ));
    assert!(matches!(
        err(&q, &cache, &indices(&[0, 1, -2, 2]), 4),
        OpError::IndexOutOfRange {
            row: 1,
            col: 0,
            value: -2,
            cache_len: 5,
            ..
        }
    ));
    for dtype in [DType::I64, DType::U32, DType::F32] {
        assert!(matches!(
            err(&q, &cache, &good.to_dtype(dtype).expect("cast"), 4),
            OpError::IndexDType { expected: DType::I32, found, .. } if found == dtype
        ));
    }
    assert!(matches!(
        err(&q, &cache.narrow(1, 0, 6).expect("narrow"), &good, 4),
        OpError::Shape { arg: "latent_cache", ref expected, .. } if expected == "[N, D=8]"
    ));
    assert!(matches!(
        err(&q.flatten_from(1).expect("flatten"), &cache, &good, 4),
        OpError::Shape { arg: "q", .. }
    ));
    assert!(matches!(
        err(&q, &cache, &good.reshape(4).expect("reshape"), 4),
        OpError::Shape { arg: "indices", .. }
    ));
    assert!(matches!(
        err(&q, &cache.to_dtype(DType::BF16).expect("bf16"), &good, 4),
        OpError::DTypeMismatch {
            arg: "latent_cache",
            ..
        }
    ));
    assert!(matches!(
        err(&q, &cache, &good, 9),
        OpError::ValueDimTooLarge {
            value_dim: 9,
            row_dim: 8
        }
    ));
}
