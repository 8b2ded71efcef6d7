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
//! [`add_rms_norm`] is the decoder's residual add and the norm after it: `sum = round(x + residual)`, and
//! the RMSNorm of `sum`; it returns both.
//!
//! # Implementations
//!
//! The reference is candle tensor ops (nine of them, any device); on CUDA for bf16 and f32 one kernel
//! (`kernels/src/rms_norm.cu`), a block per row, and one for the add and the norm together; rows of whole
//! 16-byte vectors take them in vectors, four a thread (H100, GLM-5's 6144 bf16 values: the add and norm 6.7
//! -> 4.2 us a call, the norm alone 4.6 -> 3.5). A decode step
//! runs four RMSNorms and two residual adds per layer, so the launches saved are a visible share of the step.

use candle_core::{DType, Tensor, D};

use crate::error::{OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;

/// RMSNorm of every row of `x` (contract above).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    check_weight(x, weight)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F32) {
        return cuda::rms_norm(x, weight, eps);
    }
    rms_norm_reference(x, weight, eps)
}

/// `weight` is `[D]` in `x`'s dtype.
fn check_weight(x: &Tensor, weight: &Tensor) -> Result<()> {
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
    Ok(())
}

/// `(round(x + residual), rms_norm(round(x + residual)))` (contract above): `x` and `residual` of one shape
/// and dtype.
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    if residual.dims() != x.dims() {
        return Err(OpError::Shape {
            arg: "residual",
            expected: format!("{:?} (x's)", x.dims()),
            found: residual.dims().to_vec(),
        });
    }
    if residual.dtype() != x.dtype() {
        return Err(OpError::DTypeMismatch {
            arg: "residual",
            other: "x",
            expected: x.dtype(),
            found: residual.dtype(),
        });
    }
    check_weight(x, weight)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F32) {
        return cuda::add_rms_norm(x, residual, weight, eps);
    }
    add_rms_norm_reference(x, residual, weight, eps)
}

/// [`add_rms_norm`]'s reference (any device): candle's add, then [`rms_norm_reference`].
pub fn add_rms_norm_reference(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let sum = (x + residual)?;
    let normed = rms_norm_reference(&sum, weight, eps)?;
    Ok((sum, normed))
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
