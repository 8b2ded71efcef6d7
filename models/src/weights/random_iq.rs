//! Made-up weights in one of llama.cpp's i-quant formats, for timing i-quant GGUF files without one:
//! [`RandomIqSource`] is [`RandomSource`] with every matrix a llama.cpp quantisation stores quantised (the rule
//! of [`super::random_q4k`]: every linear layer but `lm_head`, rows of whole blocks) returned as random i-quant
//! blocks ([`Matrix::GgufBlocks`]), and the routed experts stacked `[E, out, in]` as GGUF stores them (each expert's
//! blocks from its own name, so the stacked tensor and the per-expert matrices agree).
//!
//! The blocks are random bytes with each block's f16 scale set so the values have about the source's standard
//! deviation (the format's value spread with a unit scale is measured once on random blocks). A function of the
//! seed and the tensor name.

use candle_core::{DType, Device, Tensor};
use glm5_ops::gguf_matmul::{reference, GgufFormat, GgufWeight};

use super::gguf_source::is_linear;
use super::random_q4k::{fill_experts, name_stream, quantised_in_q4k, splitmix};
use super::safetensors::RandomSource;
use super::{Matrix, TensorSource};
use crate::error::Result;

/// Random weights, linear layers as i-quant blocks of one format (module docs).
pub struct RandomIqSource {
    pub dense: RandomSource,
    pub format: GgufFormat,
    /// The f16 scale that gives values of about `dense.std`.
    scale: half::f16,
}

/// Writes the f16 super-scale `d` into one block (`GgufFormat::set_super_scale`), and `dmin` where the
/// format has one.
fn set_scale(format: GgufFormat, block: &mut [u8], d: half::f16) {
    let bits = d.to_bits();
    format.set_super_scale(block, bits);
    // dmin, the mins' scale (where the format has one): as `d`, so values d·sc·q − dmin·m take both signs.
    format.set_min_scale(block, bits);
}

/// `blocks` random blocks of `format` with scale `d`, for the tensor `name`.
fn random_blocks(
    format: GgufFormat,
    name: &str,
    seed: u64,
    d: half::f16,
    blocks: usize,
) -> Vec<u8> {
    let mut state = name_stream(seed, name);
    let mut bytes = vec![0u8; blocks * format.block_bytes()];
    for chunk in bytes.chunks_mut(8) {
        let word = splitmix(&mut state).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    for block in bytes.chunks_exact_mut(format.block_bytes()) {
        set_scale(format, block, d);
    }
    bytes
}

impl RandomIqSource {
    pub fn new(seed: u64, std: f64, format: GgufFormat) -> Self {
        // The values' RMS with a unit scale, over 64 random blocks.
        let unit = reference::dequantize_bytes(
            format,
            &random_blocks(format, "unit", seed, half::f16::ONE, 64),
        );
        let rms =
            (unit.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / unit.len() as f64).sqrt();
        Self {
            dense: RandomSource { seed, std },
            format,
            scale: half::f16::from_f64(std / rms.max(f64::MIN_POSITIVE)),
        }
    }

    fn quantised(&self, name: &str, in_dim: usize) -> bool {
        is_linear(name)
            && quantised_in_q4k(name)
            && in_dim.is_multiple_of(self.format.block_values())
    }
}

impl TensorSource for RandomIqSource {
    fn contains(&self, name: &str) -> bool {
        self.dense.contains(name)
    }

    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        self.dense.tensor(name, shape, dtype, device)
    }

    fn matrix(
        &self,
        name: &str,
        shape: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Matrix> {
        if !self.quantised(name, shape[1]) {
            return self.dense.matrix(name, shape, dtype, device);
        }
        let blocks = shape[0] * shape[1] / self.format.block_values();
        let bytes = random_blocks(self.format, name, self.dense.seed, self.scale, blocks);
        let row = self.format.row_bytes(shape[1]).expect("whole blocks");
        let tensor = Tensor::from_vec(bytes, (shape[0], row), &Device::Cpu)?.to_device(device)?;
        Ok(Matrix::GgufBlocks(GgufWeight::new(
            self.format,
            tensor,
            shape[1],
        )?))
    }

    fn stacked_gguf_block_format(
        &self,
        _prefix: &str,
        _proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgufFormat>> {
        Ok(self.format.row_bytes(shape[2]).map(|_| self.format))
    }

    fn stacked_gguf_block_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<glm5_ops::moe::StackedGgufBlocks>> {
        let [experts, out, inp] = shape;
        let Some(row) = self.format.row_bytes(inp) else {
            return Ok(None);
        };
        let per_expert = out * row;
        let (format, seed, scale) = (self.format, self.dense.seed, self.scale);
        let bytes = fill_experts(experts, per_expert, |e, expert_bytes| {
            let name = format!("{prefix}.experts.{e}.{proj}.weight");
            let blocks = out * inp / format.block_values();
            expert_bytes.copy_from_slice(&random_blocks(format, &name, seed, scale, blocks));
        });
        let blocks =
            Tensor::from_vec(bytes, (experts, out, row), &Device::Cpu)?.to_device(device)?;
        Ok(Some(glm5_ops::moe::StackedGgufBlocks::new(
            format, blocks, inp,
        )?))
    }

    fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        let elements = shape.iter().map(|&d| d as u64).product::<u64>();
        let row = shape.last().copied().unwrap_or(0);
        if self.quantised(name, row) {
            elements / self.format.block_values() as u64 * self.format.block_bytes() as u64
        } else {
            elements * dtype.size_in_bytes() as u64
        }
    }
}
