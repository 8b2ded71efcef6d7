//! Helpers shared by the op tests: seeded random data and tensor construction.

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in [-1, 1).
pub fn uniform(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// A CPU tensor of `dtype` holding `data` (f32) in `shape`.
pub fn tensor(data: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_slice(data, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("test tensor")
}
