//! RMSNorm as HF transformers computes it (`docs/architecture.md`, §3.1).
//!
//! # Contract
//!
//! `x` `[rows, D]` and `weight` `[D]` of one float dtype; for every row, in f32:
//!
//! ```text
//! out = round(round(x · 1/sqrt(mean(x²) + eps)) · weight)
//! ```
//!
//! where `round` is the rounding to the dtype (none in f32): the normalised row is cast back before the
//! weight multiplies it, as HF does.
//!
//! # Implementations
//!
//! The reference is candle tensor ops (nine of them, any device); on CUDA for bf16 and f32 one kernel
//! (`kernels/src/rms_norm.cu`), a block per row. A decode step runs four RMSNorms per layer, so the launches
//! saved are a visible share of the step.

use candle_core::{DType, Tensor, D};

use crate::error::{OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;

/// RMSNorm of every row of `x` (contract above).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let cols = x.dim(D::Minus1)?;
    if weight.dims() != [cols] {
        return Err(OpError::Shape {
            arg: "weight",
            expected: format!("[{cols}]"),
            found: weight.dims().to_vec(),
        });
    }
    if weight.dtype() != x.dtype() {
        return Err(OpError::DTypeMismatch {
            arg: "weight",
            other: "x",
            expected: x.dtype(),
            found: weight.dtype(),
        });
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F32) {
        return cuda::rms_norm(x, weight, eps);
    }
    rms_norm_reference(x, weight, eps)
}

/// The reference (any device).
pub fn rms_norm_reference(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let inv_rms = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    Ok(x32
        .broadcast_mul(&inv_rms)?
        .to_dtype(x.dtype())?
        .broadcast_mul(weight)?)
}
