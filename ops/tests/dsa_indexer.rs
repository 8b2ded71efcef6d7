//! `dsa_indexer` against nested loops over `Vec<f32>`.

mod common;

use candle_core::{DType, Tensor};
use common::{rng, tensor, uniform};
use glm5_ops::{dsa_indexer, OpError};
use rand::rngs::StdRng;
use rand::Rng;

/// `n` values `i / denom` with integer `i` in `-max..=max`: exact in bf16, and every score built
/// from them is exact in f32 whatever the summation order, so ties are real ties.
fn dyadic(rng: &mut StdRng, n: usize, max: i32, denom: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-max..=max) as f32 / denom)
        .collect()
}

/// One indexer problem, held as flat row-major vectors.
struct Case {
    t: usize,
    h: usize,
    n: usize,
    d: usize,
    q: Vec<f32>,
    w: Vec<f32>,
    keys: Vec<f32>,
    visible: Vec<usize>,
}

impl Case {
    /// A prefill chunk of `t` queries starting at position `start` (query i sees start + i + 1 keys).
    fn causal(
        t: usize,
        h: usize,
        n: usize,
        d: usize,
        start: usize,
        mut values: impl FnMut(usize) -> Vec<f32>,
    ) -> Self {
        Case {
            t,
            h,
            n,
            d,
            q: values(t * h * d),
            w: values(t * h),
            keys: values(n * d),
            visible: (0..t).map(|i| start + i + 1).collect(),
        }
    }

    fn run(&self, dtype: DType, weight_dtype: DType, top_k: usize) -> Vec<Vec<i32>> {
        let q = tensor(&self.q, &[self.t, self.h, self.d], dtype);
        let w = tensor(&self.w, &[self.t, self.h], weight_dtype);
        let keys = tensor(&self.keys, &[self.n, self.d], dtype);
        let out = dsa_indexer(&q, &w, &keys, &self.visible, top_k).expect("dsa_indexer");
        assert_eq!(out.dtype(), DType::I32);
        assert_eq!(out.dims(), &[self.t, top_k]);
        out.to_vec2().expect("I32 output")
    }

    /// The spec by loops: scores in f64, sorted by (score desc, index asc), padded with -1.
    fn reference(&self, top_k: usize) -> Vec<Vec<i32>> {
        let (h_n, d) = (self.h, self.d);
        (0..self.t)
            .map(|t| {
                let mut scored: Vec<(f64, usize)> = (0..self.visible[t])
                    .map(|s| {
                        let mut score = 0.0f64;
                        for h in 0..h_n {
                            let mut dot = 0.0f64;
                            for i in 0..d {
                                dot += self.q[(t * h_n + h) * d + i] as f64
                                    * self.keys[s * d + i] as f64;
                            }
                            score += self.w[t * h_n + h] as f64 * dot.max(0.0);
                        }
                        (score, s)
                    })
                    .collect();
                scored.sort_by(|a, b| b.0.partial_cmp(&a.0).expect("finite").then(a.1.cmp(&b.1)));
                let mut row: Vec<i32> = scored.iter().take(top_k).map(|&(_, s)| s as i32).collect();
                row.resize(top_k, -1);
                row
            })
            .collect()
    }
}

#[test]
fn matches_loops_on_dyadic_inputs() {
    // (T, H_I, N, D, start_pos, top_k)
    let shapes = [
        (5, 8, 5, 16, 0, 8),        // top_k > visible: -1 padding
        (4, 8, 20, 32, 16, 1),      // top_k == 1
        (7, 16, 40, 64, 33, 6),     // causal chunk in the middle of the cache
        (1, 32, 300, 128, 299, 64), // decode, GLM-5 head shape
        (6, 8, 12, 16, 3, 12),      // top_k == N
    ];
    let mut rng = rng(1);
    for (t, h, n, d, start, top_k) in shapes {
        let case = Case::causal(t, h, n, d, start, |len| dyadic(&mut rng, len, 3, 8.0));
        assert_eq!(
            case.run(DType::F32, DType::F32, top_k),
            case.reference(top_k),
            "T={t} H={h} N={n} D={d}"
        );
    }
}

#[test]
fn matches_loops_on_uniform_inputs() {
    let mut rng = rng(2);
    let case = Case::causal(6, 8, 50, 32, 44, |len| uniform(&mut rng, len));
    assert_eq!(case.run(DType::F32, DType::F32, 10), case.reference(10));
}

#[test]
fn visible_keys_may_vary_freely_per_row() {
    let mut rng = rng(3);
    let mut case = Case::causal(4, 8, 10, 8, 0, |len| dyadic(&mut rng, len, 3, 8.0));
    case.visible = vec![3, 10, 0, 7];
    let out = case.run(DType::F32, DType::F32, 5);
    assert_eq!(out[2], vec![-1; 5]);
    assert_eq!(out, case.reference(5));
}

#[test]
fn bf16_inputs_match_loops() {
    let mut rng = rng(4);
    let case = Case::causal(5, 16, 24, 64, 19, |len| dyadic(&mut rng, len, 3, 8.0));
    assert_eq!(case.run(DType::BF16, DType::BF16, 7), case.reference(7));
    assert_eq!(case.run(DType::BF16, DType::F32, 7), case.reference(7));
}

#[test]
fn a_power_of_two_on_every_head_weight_selects_the_same_positions() {
    // The model leaves GLM-5's 1/64 ((32 · 128)^-1/2) off the head weights: such a factor scales every
    // score exactly, ties included. Uniform values (near-ties everywhere) and dyadic ones (exact ties).
    let mut rng = rng(6);
    for dyadic_values in [false, true] {
        let mut case = Case::causal(3, 32, 200, 128, 197, |len| {
            if dyadic_values {
                dyadic(&mut rng, len, 3, 8.0)
            } else {
                uniform(&mut rng, len)
            }
        });
        for dtype in [DType::F32, DType::BF16] {
            let unscaled = case.run(dtype, dtype, 64);
            let w = case.w.clone();
            case.w = w.iter().map(|v| v / 64.0).collect();
            assert_eq!(
                case.run(dtype, dtype, 64),
                unscaled,
                "{dtype:?} dyadic={dyadic_values}"
            );
            case.w = w;
        }
    }
}

#[test]
fn ties_go_to_the_lower_index() {
    // Two heads reading dims 0 and 1; scores per key: 1, 2, 0, 2, 0, 2, 0.
    let keys = [
        [1., 0., 0., 0.],
        [2., 0., 0., 0.],
        [-1., -1., 0., 0.],
        [2., 0., 0., 0.], // duplicate of row 1
        [0., -5., 0., 0.],
        [0., 2., 0., 0.],
        [-3., 0., 0., 0.],
    ];
    let mut case = Case {
        t: 1,
        h: 2,
        n: keys.len(),
        d: 4,
        q: vec![1., 0., 0., 0., 0., 1., 0., 0.],
        w: vec![1., 1.],
        keys: keys.concat(),
        visible: vec![keys.len()],
    };
    assert_eq!(
        case.run(DType::F32, DType::F32, 8),
        vec![vec![1, 3, 5, 0, 2, 4, 6, -1]]
    );
    assert_eq!(case.run(DType::F32, DType::F32, 4), vec![vec![1, 3, 5, 0]]);

    // Negative weights: keys where both q·k <= 0 score exactly zero (as -0.0 or 0.0) and beat every
    // key with a positive q·k, which scores below zero.
    case.w = vec![-1., -0.5];
    assert_eq!(
        case.run(DType::F32, DType::F32, 7),
        vec![vec![2, 4, 6, 0, 5, 1, 3]]
    );
    assert_eq!(case.run(DType::F32, DType::F32, 7), case.reference(7));
}

#[test]
fn rejects_bad_input() {
    let q = tensor(&[0.5; 2 * 4 * 8], &[2, 4, 8], DType::F32);
    let w = tensor(&[0.5; 2 * 4], &[2, 4], DType::F32);
    let keys = tensor(&[0.5; 3 * 8], &[3, 8], DType::F32);
    let flat_q = q.flatten_from(1).expect("flatten");
    let narrow_keys = tensor(&[0.5; 3 * 6], &[3, 6], DType::F32);
    let bf16_keys = keys.to_dtype(DType::BF16).expect("bf16");
    let int_q = q.to_dtype(DType::I64).expect("i64");

    let err = |q: &Tensor, w: &Tensor, keys: &Tensor, visible: &[usize], top_k| {
        dsa_indexer(q, w, keys, visible, top_k).expect_err("bad input must be rejected")
    };
    assert!(matches!(
        err(&flat_q, &w, &keys, &[1, 2], 2),
        OpError::Shape { arg: "q_index", ref found, .. } if found == &[2, 32]
    ));
    assert!(matches!(
        err(&q, &w.narrow(1, 0, 3).expect("narrow"), &keys, &[1, 2], 2),
        OpError::Shape {
            arg: "head_weights",
            ..
        }
    ));
    assert!(matches!(
        err(&q, &w, &narrow_keys, &[1, 2], 2),
        OpError::Shape { arg: "keys", ref expected, .. } if expected == "[N, D=8]"
    ));
    assert!(matches!(
        err(&q, &w, &keys, &[1], 2),
        OpError::Shape {
            arg: "visible_keys",
            ..
        }
    ));
    assert!(matches!(
        err(&q, &w, &keys, &[1, 4], 2),
        OpError::VisibleKeysTooLong {
            row: 1,
            visible: 4,
            key_count: 3
        }
    ));
    assert!(matches!(err(&q, &w, &keys, &[1, 2], 0), OpError::ZeroTopK));
    assert!(matches!(
        err(&q, &w, &bf16_keys, &[1, 2], 2),
        OpError::DTypeMismatch {
            arg: "keys",
            expected: DType::F32,
            found: DType::BF16,
            ..
        }
    ));
    assert!(matches!(
        err(&int_q, &w, &keys, &[1, 2], 2),
        OpError::NotFloat { arg: "q_index", .. }
    ));
}

/// With H_I = 1 and 1.2M keys a chunk holds 55 queries (64Mi scores), so 60 queries take two.
#[test]
fn queries_span_two_chunks() {
    let (t, n) = (60, 1_200_000);
    let mut rng = rng(5);
    let case = Case::causal(t, 1, n, 8, n - t, |len| dyadic(&mut rng, len, 3, 4.0));
    assert_eq!(case.run(DType::F32, DType::F32, 16), case.reference(16));
}
