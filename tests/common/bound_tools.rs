//! What the derived-bound tests share (`w4a4_bound.rs`, `w8a8_bound.rs` re-export it; a test crate declares
//! it beside them): f32's unit roundoff, a seeded random stream, a fresh seed per run, and the comparison of
//! outputs against a per-output bound.
#![allow(dead_code)] // each test binary uses part of it

use glm5::candle_core::{DType, Device, Tensor};

/// f32's unit roundoff.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

/// splitmix64 stream: fresh values per seed.
pub struct Stream(pub u64);

impl Stream {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Random e4m3 bytes, NaN (0x7f, 0xff) excluded; `positive`: sign bit clear.
    pub fn e4m3(&mut self, n: usize, positive: bool) -> Vec<u8> {
        (0..n)
            .map(|_| loop {
                let b = self.next() as u8 & if positive { 0x7f } else { 0xff };
                if b & 0x7f != 0x7f {
                    break b;
                }
            })
            .collect()
    }
}

/// A fresh seed per run (print it: a failure reproduces with it).
pub fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// `max |got - want| / bound` over all outputs (`got`, `want` `[rows, out]`, any device), and per row the
/// relative distance `‖got_r - want_r‖ / ‖want_r‖` (the plain distance for a zero row).
pub fn against_bound(got: &Tensor, want: &Tensor, bound: &[f64]) -> (f64, Vec<f64>) {
    let out = want.dim(1).unwrap();
    let host = |t: &Tensor| -> Vec<f32> {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (got, want) = (host(got), host(want));
    assert_eq!(got.len(), bound.len());
    let mut worst = 0.0f64;
    let mut rows = Vec::new();
    for ((g, w), b) in got.chunks(out).zip(want.chunks(out)).zip(bound.chunks(out)) {
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for ((g, w), b) in g.iter().zip(w).zip(b) {
            let d = (*g as f64 - *w as f64).abs();
            assert!(d.is_finite(), "non-finite output {g} (reference {w})");
            worst = worst.max(d / b.max(f64::MIN_POSITIVE));
            diff += d * d;
            norm += (*w as f64) * (*w as f64);
        }
        rows.push(if norm > 0.0 {
            (diff / norm).sqrt()
        } else {
            diff.sqrt()
        });
    }
    (worst, rows)
}

/// The median of `values`.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Activations like a transformer's, `[m, k]` row-major: uniform in [-1, 1) with a few outlier channels 30x
/// larger; row 1 all zeros; row 2 with one value 10^5 times the rest. The W8A8 and W4A4 bounds start here.
pub fn outlier_activations(rng: &mut Stream, m: usize, k: usize) -> Vec<f32> {
    let outliers: Vec<usize> = (0..4).map(|_| (rng.next() % k as u64) as usize).collect();
    let mut x: Vec<f32> = (0..m * k)
        .map(|i| {
            let v = rng.uniform() * 2.0 - 1.0;
            if outliers.contains(&(i % k)) {
                v * 30.0
            } else {
                v
            }
        })
        .collect();
    x[k..2 * k].fill(0.0);
    x[2 * k + k / 3] = 1e5;
    x
}
