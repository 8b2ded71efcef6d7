//! Weights as the graph reads them: the checkpoint loader, bias-free projections (dense or quantised) and
//! RMSNorm.

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;
use glm5_ops::DeviceDesc;

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::sizes::{quantized_at_load, FP8_AT_LOAD_BLOCK};
use crate::weights::{Checkpoint, Matrix};

/// Fetches tensors by checkpoint name with the shapes the config implies.
pub(super) struct Loader<'a> {
    pub(super) checkpoint: &'a Checkpoint,
    pub(super) dtype: DType,
    pub(super) device: &'a Device,
    /// The plan's description of `device`: what quantised weights are dispatched on.
    pub(super) desc: &'a DeviceDesc,
    pub(super) config: &'a Config,
    /// Quantise unquantised projections to FP8 as they are read ([`quantized_at_load`]).
    pub(super) fp8_projections: bool,
}

impl Loader<'_> {
    pub(super) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.checkpoint.tensor(name, shape, self.dtype, self.device)
    }

    pub(super) fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.checkpoint.tensor(name, shape, DType::F32, self.device)
    }

    /// A bias-free `nn.Linear` stored as `[out, in]`, quantised if the checkpoint keeps it so (or, with
    /// `fp8_projections`, if it is one of the projections FP8 takes at load).
    pub(super) fn linear(&self, prefix: &str, in_dim: usize, out_dim: usize) -> Result<Proj> {
        let name = format!("{prefix}.weight");
        Ok(match self.matrix(&name, [out_dim, in_dim])? {
            Matrix::Dense(weight) => Proj::Dense(Linear::new(weight, None)),
            Matrix::Quantized(weight) => {
                // The weight's format must have a quantized_matmul backend on this device.
                glm5_ops::quantized_matmul::dispatch(weight.dtype(), self.desc).map_err(
                    |source| ModelError::QuantizedMatmul {
                        tensor: name.clone(),
                        source: Box::new(source),
                    },
                )?;
                Proj::Quantized(QMatMul::from_arc(weight)?)
            }
            Matrix::Fp8Block(weight) => {
                let chosen = glm5_ops::fp8_matmul::dispatch(&weight, self.desc)
                    .map_err(|source| weight_only_error(&name, source))?;
                Proj::Fp8Block(weight, glm5_ops::fp8_matmul::Fp8Prefill::of(&chosen))
            }
            Matrix::Nvfp4(weight) => {
                let chosen = glm5_ops::nvfp4_matmul::dispatch(&weight, self.desc)
                    .map_err(|source| weight_only_error(&name, source))?;
                Proj::Nvfp4(weight, glm5_ops::nvfp4_matmul::Prefill::of(&chosen))
            }
            Matrix::GgufBlocks(weight) => {
                glm5_ops::gguf_matmul::dispatch(&weight, self.desc)
                    .map_err(|source| weight_only_error(&name, source))?;
                Proj::GgufBlocks(weight)
            }
        })
    }

    /// The `[out, in]` matrix `name` on the device: as the checkpoint keeps it, or quantised to FP8 here
    /// (on the CPU, from f32) where `fp8_projections` asks for it.
    fn matrix(&self, name: &str, shape: [usize; 2]) -> Result<Matrix> {
        if self.fp8_projections && quantized_at_load(self.config, name, shape) {
            if let Matrix::Dense(w) =
                self.checkpoint
                    .matrix(name, shape, DType::F32, &Device::Cpu)?
            {
                let q = glm5_ops::fp8_matmul::reference::quantize_block(&w, FP8_AT_LOAD_BLOCK)
                    .map_err(|source| ModelError::QuantizeAtLoad {
                        tensor: name.to_string(),
                        source: Box::new(source),
                    })?;
                return Ok(Matrix::Fp8Block(glm5_ops::fp8_matmul::Fp8BlockWeight {
                    weight: q.weight.to_device(self.device)?,
                    scale_inv: q.scale_inv.to_device(self.device)?,
                    block: q.block,
                }));
            }
        }
        self.checkpoint.matrix(name, shape, self.dtype, self.device)
    }

    /// `parts` (GGUF blocks of one format and input width) as one weight, their rows in order (every row is
    /// its own blocks: no value changes), dispatched as a loaded weight is; `what` names it in errors.
    pub(super) fn stack_gguf_blocks(
        &self,
        parts: &[&glm5_ops::gguf_matmul::GgufWeight],
        what: &str,
    ) -> Result<glm5_ops::gguf_matmul::GgufWeight> {
        let (format, in_dim) = match parts.first() {
            Some(first) => (first.format, first.in_dim),
            None => return Err(ModelError::PlanDevices(format!("{what}: nothing to stack"))),
        };
        let bytes: Vec<&Tensor> = parts.iter().map(|w| &w.blocks).collect();
        let stacked =
            glm5_ops::gguf_matmul::GgufWeight::new(format, Tensor::cat(&bytes, 0)?, in_dim)?;
        glm5_ops::gguf_matmul::dispatch(&stacked, self.desc)
            .map_err(|source| weight_only_error(what, source))?;
        Ok(stacked)
    }

    pub(super) fn rms_norm(&self, prefix: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: self.tensor(&format!("{prefix}.weight"), &[dim])?,
            eps,
        })
    }
}

fn weight_only_error(
    tensor: &str,
    source: glm5_ops::weight_only::WeightOnlyDispatchError,
) -> ModelError {
    ModelError::WeightOnlyMatmul {
        tensor: tensor.to_string(),
        source: Box::new(source),
    }
}

/// A bias-free linear layer: a dense matrix, quantised (GGUF) blocks multiplied by candle's `QMatMul`,
/// which runs its own kernels on the weights' device (CUDA mat-vec for a few rows, MMQ above; the CPU's
/// vec-dot) without expanding them, or a block-scaled FP8 / NVFP4 / GGUF i-quant weight multiplied by
/// glm5's weight-only ops (W8A16 / W4A16 / i-quants: dequantised in the kernel, f32 accumulation; an FP8 or
/// NVFP4 weight's prefill rows by the backend its dispatch chose). Input and output are in the model dtype;
/// the quantised kinds compute in f32.
pub(super) enum Proj {
    Dense(Linear),
    Quantized(QMatMul),
    Fp8Block(
        glm5_ops::fp8_matmul::Fp8BlockWeight,
        glm5_ops::fp8_matmul::Fp8Prefill,
    ),
    Nvfp4(
        glm5_ops::nvfp4_matmul::Nvfp4Weight,
        glm5_ops::nvfp4_matmul::Prefill,
    ),
    GgufBlocks(glm5_ops::gguf_matmul::GgufWeight),
}

pub(super) fn op_error(e: glm5_ops::OpError) -> candle_core::Error {
    match e {
        glm5_ops::OpError::Candle(e) => e,
        other => candle_core::Error::Msg(other.to_string()),
    }
}

impl Proj {
    /// The `[out, in]` matrix of a dense projection.
    pub(super) fn dense_weight(&self) -> Option<&Tensor> {
        match self {
            Proj::Dense(linear) => Some(linear.weight()),
            _ => None,
        }
    }
}

impl Module for Proj {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Proj::Dense(linear) => linear.forward(x),
            Proj::Quantized(weight) => {
                glm5_ops::quantized_matmul::quantized_matmul(x, weight).map_err(op_error)
            }
            Proj::Fp8Block(weight, prefill) => {
                glm5_ops::fp8_matmul::fp8_matmul_with(x, weight, *prefill).map_err(op_error)
            }
            Proj::Nvfp4(weight, prefill) => {
                glm5_ops::nvfp4_matmul::nvfp4_matmul_with(x, weight, *prefill).map_err(op_error)
            }
            Proj::GgufBlocks(weight) => {
                glm5_ops::gguf_matmul::gguf_matmul(x, weight).map_err(op_error)
            }
        }
    }
}

/// §3.1 RMSNorm as HF computes it: normalise in f32, cast back, then scale.
pub(super) struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub(super) fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub(super) fn eps(&self) -> f64 {
        self.eps
    }
}

impl RmsNorm {
    /// `(x + residual, norm(x + residual))`, the add and the norm in one launch on CUDA
    /// (`glm5_ops::rms_norm::add_rms_norm`).
    pub(super) fn add_forward(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(glm5_ops::rms_norm::add_rms_norm(
            x,
            residual,
            &self.weight,
            self.eps,
        )?)
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        glm5_ops::rms_norm::rms_norm(x, &self.weight, self.eps).map_err(op_error)
    }
}
