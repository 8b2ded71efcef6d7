//! Made-up weights in a quantised format, for benchmarks: the matrices a published checkpoint of that
//! format quantises ([`Quantization::quantizes`]) come as random FP8 or NVFP4 weights of the right layout,
//! everything else as [`super::safetensors::RandomSource`] makes it.
//!
//! The values are random but tame, so that a forward pass stays finite and the router's choice varies as
//! with real weights: FP8 codes of magnitude 0.5..3.75 with random signs (e4m3 exponents 6-8) under a block
//! multiplier of `std / 1.5`; NVFP4 codes uniform over all 16 e2m1 values, scales 0.5..0.94 (e4m3 exponent
//! 6) and a global scale of `std / 2`.

use candle_core::{DType, Device, Tensor};
use glm5_ops::fp8_matmul::Fp8BlockWeight;
use glm5_ops::nvfp4_matmul::Nvfp4Weight;

use super::safetensors::random_tensor;
use super::{Matrix, TensorSource};
use crate::error::Result;
use crate::quantization::Quantization;

/// Random weights quantised as `quantization` (module docs).
pub struct RandomQuantizedSource {
    pub seed: u64,
    pub std: f64,
    pub quantization: Quantization,
}

/// Uniform integers `offset .. offset + count` as f32, `shape`, from the device's generator.
fn uniform_codes(shape: &[usize], count: f64, offset: f64, device: &Device) -> Result<Tensor> {
    Ok((Tensor::rand(0f32, 1.0, shape, device)?
        .affine(count, 0.0)?
        .floor()?
        + offset)?
        .clamp(offset, offset + count - 1.0)?)
}

impl RandomQuantizedSource {
    fn seed_for(&self, name: &str, device: &Device) -> Result<()> {
        let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        device.set_seed(self.seed ^ name_hash)?;
        Ok(())
    }
}

impl TensorSource for RandomQuantizedSource {
    fn contains(&self, _name: &str) -> bool {
        true
    }

    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        random_tensor(name, shape, self.seed, self.std, dtype, device)
    }

    fn matrix(
        &self,
        name: &str,
        [out, inp]: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Matrix> {
        if !self.quantization.quantizes(name) {
            return Ok(Matrix::Dense(self.tensor(
                name,
                &[out, inp],
                dtype,
                device,
            )?));
        }
        self.seed_for(name, device)?;
        match &self.quantization {
            Quantization::Fp8Block { block, .. } => {
                let magnitude = uniform_codes(&[out, inp], 24.0, 48.0, device)?;
                let sign = uniform_codes(&[out, inp], 2.0, 0.0, device)?.affine(128.0, 0.0)?;
                let weight = (magnitude + sign)?.to_dtype(DType::U8)?;
                let blocks = [out.div_ceil(block[0]), inp.div_ceil(block[1])];
                let scale_inv = Tensor::full((self.std / 1.5) as f32, &blocks, device)?;
                Ok(Matrix::Fp8Block(Fp8BlockWeight {
                    weight,
                    scale_inv,
                    block: *block,
                }))
            }
            Quantization::Nvfp4 { group_size, .. } => {
                let packed =
                    uniform_codes(&[out, inp / 2], 256.0, 0.0, device)?.to_dtype(DType::U8)?;
                let scales = uniform_codes(&[out, inp / group_size], 8.0, 48.0, device)?
                    .to_dtype(DType::U8)?;
                Ok(Matrix::Nvfp4(Nvfp4Weight {
                    packed,
                    scales,
                    global_scale: (self.std / 2.0) as f32,
                }))
            }
        }
    }

    fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        match shape {
            &[out, inp] if self.quantization.quantizes(name) => {
                self.quantization.matrix_bytes(out, inp)
            }
            _ => shape.iter().map(|&d| d as u64).product::<u64>() * dtype.size_in_bytes() as u64,
        }
    }
}
