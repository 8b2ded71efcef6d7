//! `absorbed_query`: MLA's absorbed query from its two halves (`docs/architecture.md`, §3.4).
//!
//! # Contract
//!
//! `q` `[T, H, nope + R]` (`q_b_proj`'s output per head), `q_latent` `[H, T, lora]` (`W_UKᵀ q_nope` per
//! head, head-major as the batched product leaves it), `cos` and `sin` `[T, R / 2]`, all of one float dtype.
//! The result, contiguous `[T, H, lora + R]`:
//!
//! ```text
//! out[t, h] = [ q_latent[h, t] | rope_i(q[t, h, nope..], cos[t], sin[t]) ]
//! ```
//!
//! with `rope_i` candle-nn's interleaved RoPE (each product and sum rounded to the dtype).
//!
//! # Implementations
//!
//! The reference: `rope_i` on the RoPE slice and a concatenation (three launches on a GPU). On CUDA for
//! bf16 and f32 one kernel (`kernels/src/attention_rows.cu`), a block per (token, head).
//!
//! # One token
//!
//! [`absorbed_query_one_token`] takes `W_UK` `[H, nope, lora]` in place of `q_latent` and forms the product
//! too: `absorbed_query(q, head_products(q[0, :, ..nope], W_UK) as [H, 1, lora], cos, sin)`. On CUDA (bf16
//! and f32, `lora` a multiple of 8) one launch of `head_products`' kernel, its RoPE half by one more block a
//! head; elsewhere the two ops.

use candle_core::Tensor;

use crate::error::{check_same_dtype, OpError, Result};
#[cfg(feature = "cuda")]
use crate::head_products::kernel_serves;
use crate::head_products::{check_shapes, head_products};

#[cfg(feature = "cuda")]
mod cuda;

/// `rope_i` of `x` `[T, H, R]` with tables `[T, R / 2]`: candle-nn's kernel on `[H, T, R]`, back as
/// `[T, H, R]` (a view).
pub(crate) fn rope_per_head(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let per_head = x.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
    let rotated = candle_nn::rotary_emb::rope_i(&per_head, cos, sin)?;
    Ok(rotated.squeeze(0)?.transpose(0, 1)?)
}

/// The absorbed query (contract above), by candle ops.
pub fn absorbed_query_reference(
    q: &Tensor,
    q_latent: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (_, _, width) = q.dims3()?;
    let rope = 2 * cos.dim(1)?;
    let q_pe = rope_per_head(&q.narrow(2, width - rope, rope)?, cos, sin)?;
    Ok(Tensor::cat(&[q_latent.transpose(0, 1)?, q_pe], 2)?.contiguous()?)
}

/// The absorbed query `[T, H, lora + R]` (contract above).
pub fn absorbed_query(q: &Tensor, q_latent: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, heads, _) = q.dims3()?;
    let (latent_heads, latent_t, _) = q_latent.dims3()?;
    if latent_heads != heads || latent_t != t {
        return Err(OpError::Shape {
            arg: "q_latent",
            expected: format!("[{heads}, {t}, lora]"),
            found: q_latent.dims().to_vec(),
        });
    }
    crate::rope_leading::check_tables("q", q, cos, sin)?;
    check_same_dtype("q_latent", q_latent, "q", q)?;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda()
        && t > 0
        && matches!(
            q.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F32
        )
    {
        return cuda::absorbed_query(q, q_latent, cos, sin);
    }
    absorbed_query_reference(q, q_latent, cos, sin)
}

/// The absorbed query `[1, H, lora + R]` of one token from `q` `[1, H, nope + R]` and `W_UK` `[H, nope, lora]`
/// (contract above, "One token").
pub fn absorbed_query_one_token(
    q: &Tensor,
    w_uk: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (t, heads, width) = q.dims3()?;
    let nope = w_uk.dim(1)?;
    if t != 1 || nope > width {
        return Err(OpError::Shape {
            arg: "q",
            expected: format!("[1, H, {nope} + R]"),
            found: q.dims().to_vec(),
        });
    }
    let (_, _, lora) = check_shapes(heads, nope, q, w_uk)?;
    let half = cos.dim(1)?;
    let rope = width - nope;
    for (arg, tensor) in [("cos", cos), ("sin", sin)] {
        if tensor.dims() != [1, half] || 2 * half != rope {
            return Err(OpError::Shape {
                arg,
                expected: format!("[1, {}]", rope / 2),
                found: tensor.dims().to_vec(),
            });
        }
        check_same_dtype(arg, tensor, "q", q)?;
    }
    #[cfg(feature = "cuda")]
    if kernel_serves(q, lora) && heads > 0 {
        return cuda::absorbed_query_one_token(q, w_uk, (nope, rope, lora), cos, sin);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = lora;
    let q_latent = head_products(&q.squeeze(0)?.narrow(1, 0, nope)?, w_uk)?;
    absorbed_query(q, &q_latent.unsqueeze(1)?, cos, sin)
}
