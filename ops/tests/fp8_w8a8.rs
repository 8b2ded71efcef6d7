//! The W8A8 activation quantiser of `fp8_matmul` (module contract, "W8A8"; `reference::quantize_activations`)
//! against an independent, straightforward computation: the same rule with the e4m3 rounding done by brute
//! force (the nearest of every finite e4m3 value, ties to the even code), on fresh random tokens (seed
//! printed) whose groups span 2^-40..2^40 of each other, and on hand-worked groups: every e4m3 tie, zeros,
//! subnormal f32 inputs whose `amax / 448` underflows, f32::MAX, -0.0, non-finite values; then the layout
//! (scales token-contiguous, padding rows) and the W8A8 product's definition.

use candle_core::{DType, Device, Tensor};
use glm5_ops::fp8_matmul::reference::{
    self, e4m3_satfinite, e4m3_table, quantize_token, E4M3_MAX, E4M3_NAN, MIN_ACTIVATION_SCALE,
};
use glm5_ops::fp8_matmul::{self, Fp8BlockWeight, W8A8_GROUP, W8A8_ROW_MULTIPLE};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The e4m3 code nearest to `v`, ties to the even code, by trying every finite non-negative code, with
/// `v`'s sign; NaN to the NaN code.
fn nearest_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return E4M3_NAN;
    }
    let table = e4m3_table();
    let mut best = (0u8, f64::INFINITY);
    for code in 0u8..=0x7e {
        let d = (table[code as usize] as f64 - v.abs() as f64).abs();
        if d < best.1 || (d == best.1 && code % 2 == 0) {
            best = (code, d);
        }
    }
    best.0 | if v.is_sign_negative() { 0x80 } else { 0 }
}

/// The rule with the brute-force rounding: `(codes, scales)` of one token, one scale per group.
fn straightforward(x: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::new();
    let mut scales = Vec::new();
    for group in x.chunks(W8A8_GROUP) {
        let amax = group.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        let scale = (amax / 448.0).max(f32::MIN_POSITIVE);
        codes.extend(group.iter().map(|&v| nearest_e4m3(v / scale)));
        scales.push(scale);
    }
    (codes, scales)
}

fn quantized(x: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut codes = vec![0u8; x.len()];
    let mut scales = vec![0f32; x.len() / W8A8_GROUP];
    quantize_token(x, &mut codes, &mut scales, 1);
    (codes, scales)
}

fn check_token(x: &[f32], what: &str) {
    let (codes, scales) = quantized(x);
    let (want_codes, want_scales) = straightforward(x);
    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&scales), bits(&want_scales), "{what}: scales");
    assert_eq!(codes, want_codes, "{what}: codes");
}

#[test]
fn e4m3_rounding_matches_brute_force_on_every_code_and_midpoint() {
    let table = e4m3_table();
    assert_eq!(E4M3_MAX, table[0x7e]);
    for code in 0u8..=0x7e {
        let v = table[code as usize];
        for sign in [1.0f32, -1.0] {
            let signed = sign * v;
            assert_eq!(
                e4m3_satfinite(signed),
                nearest_e4m3(signed),
                "e4m3 value {signed}"
            );
        }
        let next = if code < 0x7e {
            table[code as usize + 1]
        } else {
            480.0 // the NaN code's would-be value: its midpoint 464 still rounds to 448
        };
        let mid = (v + next) / 2.0; // exact: both have few significant bits
        for probe in [mid, mid.next_down(), mid.next_up()] {
            for sign in [1.0f32, -1.0] {
                let p = sign * probe;
                assert_eq!(e4m3_satfinite(p), nearest_e4m3(p), "e4m3 near {p}");
            }
        }
        if code < 0x7e {
            assert_eq!(
                e4m3_satfinite(mid),
                if code % 2 == 0 { code } else { code + 1 },
                "tie at {mid}"
            );
        }
    }
    // Saturation, signed zeros, NaN, and below half the smallest subnormal.
    assert_eq!(e4m3_satfinite(f32::INFINITY), 0x7e);
    assert_eq!(e4m3_satfinite(-1e30), 0xfe);
    assert_eq!(e4m3_satfinite(-0.0), 0x80);
    assert_eq!(e4m3_satfinite(0.0), 0x00);
    assert_eq!(e4m3_satfinite(f32::NAN), E4M3_NAN);
    assert_eq!(e4m3_satfinite(2f32.powi(-10)), 0); // a tie of 0 and 2^-9: to 0
    assert_eq!(e4m3_satfinite(-2f32.powi(-10)), 0x80);
    assert_eq!(e4m3_satfinite(2f32.powi(-10).next_up()), 1);
}

#[test]
fn hand_worked_groups() {
    let g = W8A8_GROUP;
    // Group 0: largest 448, so the scale is exactly 1 and the values sit on e4m3 ties (1.0625 between 1 and
    // 1.125: to 1; 1.1875 between 1.125 and 1.25: to 1.25; 2^-10 between 0 and 2^-9: to 0).
    let mut x = vec![0.0f32; 6 * g];
    x[0] = 448.0;
    x[1] = 1.0625;
    x[2] = 1.1875;
    x[3] = -2f32.powi(-10);
    x[4] = -0.0;
    // Group 1: all zeros. Group 2: subnormal f32 values, amax / 448 underflows below 2^-126.
    for (i, v) in x[2 * g..3 * g].iter_mut().enumerate() {
        *v = (i as f32) * 1e-42;
    }
    // Group 3: f32::MAX and its negation, no overflow. Group 4: a 2^40 spread inside the group.
    x[3 * g] = f32::MAX;
    x[3 * g + 1] = -f32::MAX;
    x[3 * g + 2] = 1.0;
    x[4 * g] = 2f32.powi(20);
    x[4 * g + 1] = 2f32.powi(-20);
    x[4 * g + 2] = -3.0;
    // Group 5: small ordinary values.
    for (i, v) in x[5 * g..].iter_mut().enumerate() {
        *v = (i as f32 - 60.0) * 1e-3;
    }
    let (codes, scales) = quantized(&x);
    assert_eq!(scales[0], 1.0);
    assert_eq!(&codes[..5], &[0x7e, 0x38, 0x3a, 0x80, 0x80]);
    assert_eq!(scales[1], MIN_ACTIVATION_SCALE);
    assert!(codes[g..2 * g].iter().all(|&c| c == 0));
    assert_eq!(scales[2], MIN_ACTIVATION_SCALE);
    assert!(codes[2 * g..3 * g]
        .iter()
        .all(|&c| c != E4M3_NAN && c & 0x80 == 0));
    assert!(scales[3].is_finite());
    assert_eq!((codes[3 * g], codes[3 * g + 1]), (0x7e, 0xfe));
    assert_eq!(codes[3 * g + 2], 0); // 1.0 against f32::MAX: far below the smallest step
    assert_eq!(codes[4 * g], 0x7e);
    for (i, what) in [
        (0, "ties"),
        (1, "zeros"),
        (2, "subnormal inputs"),
        (3, "f32::MAX"),
        (4, "wide group"),
        (5, "small values"),
    ] {
        check_token(&x[i * g..(i + 1) * g], what);
    }
    check_token(&x, "the whole token");

    // Non-finite inputs (the contract: NaN values are ignored by amax and become the NaN code; an
    // infinity makes the group's scale infinite, its finite values zero codes and itself NaN).
    let mut bad = vec![0.5f32; g];
    bad[7] = f32::NAN;
    let (codes, scales) = quantized(&bad);
    assert_eq!(scales[0], 0.5 / 448.0);
    assert_eq!(codes[7], E4M3_NAN);
    assert_eq!(codes[0], 0x7e);
    bad[7] = f32::NEG_INFINITY;
    let (codes, scales) = quantized(&bad);
    assert_eq!(scales[0], f32::INFINITY);
    assert_eq!((codes[0], codes[7]), (0, E4M3_NAN));
    check_token(&bad, "an infinity");
}

#[test]
fn random_tokens_match_the_straightforward_quantiser() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let k = 4 * W8A8_GROUP;
    for token in 0..400 {
        let mut x: Vec<f32> = Vec::with_capacity(k);
        for _ in 0..k / W8A8_GROUP {
            // Each group at its own magnitude, 2^-40..2^40, some all zero, some with zeros inside.
            let magnitude = 2f32.powi(rng.random_range(-40..=40));
            let zero_group = rng.random_range(0..10) == 0;
            for _ in 0..W8A8_GROUP {
                let v = if zero_group || rng.random_range(0..8) == 0 {
                    0.0
                } else {
                    rng.random_range(-1.0f32..1.0) * magnitude
                };
                x.push(v);
            }
        }
        check_token(&x, &format!("random token {token} (seed {seed})"));
    }
}

#[test]
fn layout_padding_and_dtypes() {
    let mut rng = StdRng::seed_from_u64(7);
    let (rows, k) = (W8A8_ROW_MULTIPLE + 3, 3 * W8A8_GROUP);
    let values: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    let x = Tensor::from_vec(values.clone(), (rows, k), &Device::Cpu).unwrap();
    let acts = reference::quantize_activations(&x).unwrap();
    let padded = fp8_matmul::w8a8_padded_rows(rows);
    assert_eq!(padded, 2 * W8A8_ROW_MULTIPLE);
    assert_eq!(acts.rows, rows);
    assert_eq!(acts.codes.dims(), [padded, k]);
    assert_eq!(acts.scales.dims(), [k / W8A8_GROUP, padded]);
    let codes: Vec<u8> = acts.codes.flatten_all().unwrap().to_vec1().unwrap();
    let scales: Vec<f32> = acts.scales.flatten_all().unwrap().to_vec1().unwrap();
    for r in 0..padded {
        let (want_codes, want_scales) = if r < rows {
            straightforward(&values[r * k..(r + 1) * k])
        } else {
            (vec![0; k], vec![MIN_ACTIVATION_SCALE; k / W8A8_GROUP])
        };
        assert_eq!(&codes[r * k..(r + 1) * k], &want_codes[..], "row {r}");
        for (b, want) in want_scales.iter().enumerate() {
            // Token-contiguous: group b's scales are one row of [L, rows_padded].
            assert_eq!(
                scales[b * padded + r].to_bits(),
                want.to_bits(),
                "row {r} group {b}"
            );
        }
    }
    // bf16 activations are quantised as their f32 values; the public entry point on the CPU is the reference.
    let x16 = x.to_dtype(DType::BF16).unwrap();
    let from_bf16 = fp8_matmul::quantize_activations(&x16).unwrap();
    let from_f32 = reference::quantize_activations(&x16.to_dtype(DType::F32).unwrap()).unwrap();
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    assert_eq!(bytes(&from_bf16.codes), bytes(&from_f32.codes));
    // in not a multiple of the group, or an integer x: typed errors.
    let narrow = Tensor::zeros((2, W8A8_GROUP + 16), DType::F32, &Device::Cpu).unwrap();
    assert!(fp8_matmul::quantize_activations(&narrow).is_err());
    let ints = Tensor::zeros((2, W8A8_GROUP), DType::U8, &Device::Cpu).unwrap();
    assert!(fp8_matmul::quantize_activations(&ints).is_err());
}

/// The W8A8 product is the dequantised activations times the dequantised weight; a zero row gives zeros,
/// and the W8A8 GEMM and the pinned prefill path are errors on the CPU.
#[test]
fn w8a8_product_definition_and_cpu_errors() {
    let mut rng = StdRng::seed_from_u64(11);
    let (rows, n, k) = (fp8_matmul::MAX_ROWS + 2, 48, 2 * W8A8_GROUP);
    let mut values: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    values[..k].fill(0.0);
    let x = Tensor::from_vec(values, (rows, k), &Device::Cpu).unwrap();
    let codes: Vec<u8> = (0..n * k)
        .map(|_| loop {
            let b: u8 = rng.random();
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect();
    let w = Fp8BlockWeight {
        weight: Tensor::from_vec(codes, (n, k), &Device::Cpu).unwrap(),
        scale_inv: Tensor::from_vec(vec![0.01f32, 0.02], (1, 2), &Device::Cpu).unwrap(),
        block: [W8A8_GROUP, W8A8_GROUP],
    };
    let acts = reference::quantize_activations(&x).unwrap();
    let y = reference::w8a8_product(&acts, &w).unwrap();
    let x_hat = reference::dequantize_activations(&acts).unwrap();
    assert_eq!(x_hat.dims(), [rows, k]);
    let want = x_hat
        .matmul(&reference::dequantize(&w).unwrap().t().unwrap())
        .unwrap();
    let diff = (y.clone() - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0);
    let first: Vec<f32> = y.get(0).unwrap().to_vec1().unwrap();
    assert!(first.iter().all(|&v| v == 0.0), "a zero row gives zeros");
    assert_eq!(
        reference::fp8_matmul_w8a8(&x, &w)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    let err = fp8_matmul::w8a8_matmul(&acts, &w, DType::F32).unwrap_err();
    assert!(err.to_string().contains("CUDA"), "{err}");
    let err = fp8_matmul::fp8_matmul_with(&x, &w, fp8_matmul::Fp8Prefill::W8a8Block).unwrap_err();
    assert!(
        err.to_string().contains(fp8_matmul::W8A8_CUBLASLT_BLOCK),
        "{err}"
    );
    // Decode rows stay W8A16 whatever the prefill path.
    let decode = x.narrow(0, 0, fp8_matmul::MAX_ROWS).unwrap();
    let pinned =
        fp8_matmul::fp8_matmul_with(&decode, &w, fp8_matmul::Fp8Prefill::W8a8Block).unwrap();
    let w8a16 = fp8_matmul::fp8_matmul(&decode, &w).unwrap();
    assert_eq!(
        pinned.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        w8a16.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
}
