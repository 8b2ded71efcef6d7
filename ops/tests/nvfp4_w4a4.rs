//! The W4A4 activation quantiser of `nvfp4_matmul` (module contract, "W4A4"; `reference::quantize_row`)
//! against an independent, straightforward computation: the same rule with the roundings done by brute
//! force (the nearest of every e4m3 / e2m1 value, ties to the even code), on fresh random rows (seed
//! printed) whose blocks span 2^-40..2^40 of each other, and on hand-worked rows: every e2m1 tie, e4m3
//! subnormal scales and their ties, blocks rounding to a zero scale, zeros, f32::MAX, a non-finite value.

use candle_core::{DType, Device, Tensor};
use glm5_ops::fp8_matmul::reference::e4m3_table;
use glm5_ops::nvfp4_matmul::reference::{
    self, e2m1_rne, e4m3_rne, quantize_row, E2M1, E2M1_MAX, E4M3_MAX, MIN_ROW_SCALE,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The e4m3 code nearest to `v`, ties to the even code, by trying every finite non-negative code.
fn nearest_e4m3(v: f32) -> u8 {
    let table = e4m3_table();
    let mut best = (0u8, f64::INFINITY);
    for code in 0u8..=0x7e {
        let d = (table[code as usize] as f64 - v as f64).abs();
        if d < best.1 || (d == best.1 && code % 2 == 0) {
            best = (code, d);
        }
    }
    best.0
}

/// The e2m1 magnitude code nearest to `r`, ties to the even code, by trying all eight.
fn nearest_e2m1(r: f32) -> u8 {
    let mut best = (0u8, f64::INFINITY);
    for code in 0u8..8 {
        let d = (E2M1[code as usize] as f64 - r as f64).abs();
        if d < best.1 || (d == best.1 && code % 2 == 0) {
            best = (code, d);
        }
    }
    best.0
}

/// The quantiser's rule (module contract), with the brute-force roundings: `(codes, one per value
/// unpacked; scales; row scale)`.
fn straightforward(x: &[f32]) -> (Vec<u8>, Vec<u8>, f32) {
    let amax = x.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    let g = if x.iter().all(|v| v.is_finite()) {
        (amax / 2688.0).max(f32::MIN_POSITIVE)
    } else {
        f32::NAN
    };
    let mut codes = Vec::new();
    let mut scales = Vec::new();
    for block in x.chunks(16) {
        let bmax = block.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        let scale = nearest_e4m3((bmax / (6.0 * g)).min(448.0));
        let unit = e4m3_table()[scale as usize] * g;
        for &v in block {
            let magnitude = if unit > 0.0 {
                nearest_e2m1(v.abs() / unit)
            } else {
                0
            };
            codes.push(magnitude | if v < 0.0 { 8 } else { 0 });
        }
        scales.push(scale);
    }
    (codes, scales, g)
}

/// `quantize_row`'s output with the codes unpacked.
fn quantized(x: &[f32]) -> (Vec<u8>, Vec<u8>, f32) {
    let mut packed = vec![0u8; x.len() / 2];
    let mut scales = vec![0u8; x.len() / 16];
    let g = quantize_row(x, &mut packed, &mut scales);
    let codes = packed.iter().flat_map(|b| [b & 0x0f, b >> 4]).collect();
    (codes, scales, g)
}

fn check_row(x: &[f32], what: &str) {
    let (codes, scales, g) = quantized(x);
    let (want_codes, want_scales, want_g) = straightforward(x);
    assert_eq!(
        g.to_bits(),
        want_g.to_bits(),
        "{what}: row scale {g} vs {want_g}"
    );
    assert_eq!(scales, want_scales, "{what}: block scales");
    assert_eq!(codes, want_codes, "{what}: codes");
}

#[test]
fn roundings_match_brute_force_on_every_code_and_midpoint() {
    let table = e4m3_table();
    for code in 0u8..=0x7e {
        let v = table[code as usize];
        assert_eq!(e4m3_rne(v), code, "e4m3 value {v}");
        if code < 0x7e {
            let next = table[code as usize + 1];
            let mid = (v + next) / 2.0; // exact: both have few significant bits
            assert_eq!(e4m3_rne(mid), nearest_e4m3(mid), "e4m3 midpoint {mid}");
            assert_eq!(e4m3_rne(mid), if code % 2 == 0 { code } else { code + 1 });
            for probe in [mid.next_down(), mid.next_up()] {
                assert_eq!(e4m3_rne(probe), nearest_e4m3(probe), "e4m3 near {probe}");
            }
        }
    }
    for code in 0u8..8 {
        let v = E2M1[code as usize];
        assert_eq!(e2m1_rne(v), code);
        if code < 7 {
            let mid = (v + E2M1[code as usize + 1]) / 2.0;
            assert_eq!(e2m1_rne(mid), if code % 2 == 0 { code } else { code + 1 });
            for probe in [mid, mid.next_down(), mid.next_up()] {
                assert_eq!(e2m1_rne(probe), nearest_e2m1(probe), "e2m1 near {probe}");
            }
        }
    }
    assert_eq!(e2m1_rne(6.5), 7);
    assert_eq!(e2m1_rne(1e30), 7);
}

#[test]
fn hand_worked_rows() {
    assert_eq!(E2M1_MAX * E4M3_MAX, 2688.0);
    // g = 1: the first block's 2688 is the row's largest (its scale 448, code 0x7e); the second's largest
    // is 6 (scale 1.0 = 0x38, unit 1), so its values sit on every e2m1 tie.
    let mut row = vec![0.0f32; 128];
    row[0] = 2688.0;
    let ties = [
        6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
        0.0,
    ];
    row[16..32].copy_from_slice(&ties);
    // Blocks whose scale is an e4m3 subnormal or rounds to 0: largest value 6 * v for the unrounded scale v.
    row[32] = 6.0 * 2f32.powi(-8); // v = 2^-8: subnormal code 2
    row[48] = 6.0 * 1.5 * 2f32.powi(-9); // v = 1.5 * 2^-9: a tie of codes 1 and 2, to 2
    row[64] = 6.0 * 2f32.powi(-10); // v = 2^-10: a tie of codes 0 and 1, to 0: the block is all zeros
    row[65] = -1e-6;
    row[80] = 6.0 * 2f32.powi(-11); // v < 2^-10: scale 0
    row[96] = 6.0 * 3.0 * 2f32.powi(-9); // v = 3 * 2^-9: code 3, unit 3 * 2^-9
    row[97] = 6.0 * 3.0 * 2f32.powi(-9) / 4.0; // 1.5 units: code 3
    let (codes, scales, g) = quantized(&row);
    assert_eq!(g, 1.0);
    assert_eq!(scales, [0x7e, 0x38, 2, 2, 0, 0, 3, 0]);
    assert_eq!(codes[0], 7);
    assert_eq!(
        &codes[16..32],
        &[7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    );
    assert_eq!(codes[32], 7);
    assert_eq!(codes[48], 6); // 4.5 units (the scale rounded up): to 4
    assert!(codes[64..96].iter().all(|&c| c == 0 || c == 8), "{codes:?}");
    assert_eq!((codes[96], codes[97]), (7, 3));
    check_row(&row, "hand-worked row");

    // Zeros: the smallest row scale, zero scales and codes.
    let zeros = vec![0.0f32; 64];
    let (codes, scales, g) = quantized(&zeros);
    assert_eq!(g, MIN_ROW_SCALE);
    assert!(codes.iter().all(|&c| c == 0) && scales.iter().all(|&s| s == 0));

    // The largest finite magnitudes: scale 448, codes +-6, nothing overflows.
    let mut big = vec![1.0f32; 32];
    big[3] = f32::MAX;
    big[20] = -f32::MAX;
    let (codes, scales, g) = quantized(&big);
    assert!(g.is_finite());
    assert_eq!(scales, [0x7e, 0x7e]);
    assert_eq!((codes[3], codes[20]), (7, 15));
    check_row(&big, "f32::MAX row");

    // Subnormal f32 inputs: the row scale stops at 2^-126.
    let tiny: Vec<f32> = (0..32).map(|i| (i as f32) * 1e-42).collect();
    assert_eq!(quantized(&tiny).2, MIN_ROW_SCALE);
    check_row(&tiny, "subnormal row");

    // A non-finite value makes the row scale NaN (the row's outputs NaN).
    let mut bad = vec![0.5f32; 32];
    bad[7] = f32::INFINITY;
    assert!(quantized(&bad).2.is_nan());
    bad[7] = f32::NAN;
    assert!(quantized(&bad).2.is_nan());
}

#[test]
fn random_rows_match_the_straightforward_quantiser() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let k = 256;
    for row in 0..400 {
        let mut x: Vec<f32> = Vec::with_capacity(k);
        for _ in 0..k / 16 {
            // Each block at its own magnitude, 2^-40..2^40, some all zero, some with zeros inside.
            let magnitude = 2f32.powi(rng.random_range(-40..=40));
            let zero_block = rng.random_range(0..10) == 0;
            for _ in 0..16 {
                let v = if zero_block || rng.random_range(0..8) == 0 {
                    0.0
                } else {
                    rng.random_range(-1.0f32..1.0) * magnitude
                };
                x.push(v);
            }
        }
        check_row(&x, &format!("random row {row}"));
        // Through bf16, as the bf16 kernels read it.
        let through_bf16: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        check_row(&through_bf16, &format!("random row {row} in bf16"));
    }
}

#[test]
fn tensor_entry_point_quantises_row_by_row() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    let (rows, k) = (5, 64);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-3.0..3.0)).collect();
    let t = Tensor::from_vec(x.clone(), (rows, k), &Device::Cpu).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let acts =
            glm5_ops::nvfp4_matmul::quantize_activations(&t.to_dtype(dtype).unwrap()).unwrap();
        assert_eq!(acts.codes.dims(), [rows, k / 2]);
        assert_eq!(acts.scales.dims(), [rows, k / 16]);
        let codes: Vec<u8> = acts.codes.flatten_all().unwrap().to_vec1().unwrap();
        let scales: Vec<u8> = acts.scales.flatten_all().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = acts.row_scales.to_vec1().unwrap();
        let as_read: Vec<f32> = t
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for r in 0..rows {
            let (want_codes, want_scales, want_g) = straightforward(&as_read[r * k..(r + 1) * k]);
            let got_codes: Vec<u8> = codes[r * k / 2..(r + 1) * k / 2]
                .iter()
                .flat_map(|b| [b & 0x0f, b >> 4])
                .collect();
            assert_eq!(got_codes, want_codes);
            assert_eq!(&scales[r * k / 16..(r + 1) * k / 16], &want_scales[..]);
            assert_eq!(g[r], want_g);
        }
    }
    let odd = Tensor::zeros((2, 24), DType::F32, &Device::Cpu).unwrap();
    assert!(reference::quantize_activations(&odd).is_err());
}
