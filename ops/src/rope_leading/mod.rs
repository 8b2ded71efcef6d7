//! `rope_leading`: RoPE on the leading dims of each head's vector, the rest passed through (the DSA
//! indexer's query, `docs/architecture.md`, §4).
//!
//! # Contract
//!
//! `x` `[T, H, D]`, `cos` and `sin` `[T, R / 2]` with `R <= D`, of one float dtype. The result, contiguous
//! `[T, H, D]`: `out[t, h] = [ rope_i(x[t, h, ..R], cos[t], sin[t]) | x[t, h, R..] ]`, with `rope_i`
//! candle-nn's interleaved RoPE (each product and sum rounded to the dtype).
//!
//! # Implementations
//!
//! The reference: `rope_i` on the leading slice and a concatenation (three launches on a GPU). On CUDA for
//! bf16 and f32 one kernel (`kernels/src/attention_rows.cu`), a block per (token, head).

use candle_core::Tensor;

use crate::absorbed_query::rope_per_head;
use crate::error::{OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;

/// `x` with its leading dims rotated (contract above), by candle ops.
pub fn rope_leading_reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (_, _, dim) = x.dims3()?;
    let rope = 2 * cos.dim(1)?;
    let rotated = rope_per_head(&x.narrow(2, 0, rope)?, cos, sin)?;
    if rope == dim {
        return Ok(rotated.contiguous()?);
    }
    Ok(Tensor::cat(&[rotated, x.narrow(2, rope, dim - rope)?], 2)?.contiguous()?)
}

/// `x` with its leading dims rotated (contract above).
pub fn rope_leading(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    check_tables("x", x, cos, sin)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && x.dim(0)? > 0
        && matches!(
            x.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F32
        )
    {
        return cuda::rope_leading(x, cos, sin);
    }
    rope_leading_reference(x, cos, sin)
}

/// RoPE tables `cos`, `sin` `[T, R / 2]` for `x` `[T, H, D]` (named `other` in errors): `R <= D`, one dtype.
pub(crate) fn check_tables(
    other: &'static str,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<()> {
    let (t, _, dim) = x.dims3()?;
    let half = cos.dim(1)?;
    for (arg, tensor) in [("cos", cos), ("sin", sin)] {
        if tensor.dims() != [t, half] || 2 * half > dim {
            return Err(OpError::Shape {
                arg,
                expected: format!("[{t}, R / 2] with R <= {dim}"),
                found: tensor.dims().to_vec(),
            });
        }
        if tensor.dtype() != x.dtype() {
            return Err(OpError::DTypeMismatch {
                arg,
                other,
                expected: x.dtype(),
                found: tensor.dtype(),
            });
        }
    }
    Ok(())
}
