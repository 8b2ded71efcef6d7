//! `write_latent_rows`: the MLA latent rows of a call's tokens, computed from `kv_a_proj_with_mqa`'s output
//! and written into a latent cache (`docs/architecture.md`, §3.3).
//!
//! # Contract
//!
//! `kv_a` `[T, lora + R]`, `norm_weight` `[lora]` (`kv_a_layernorm`), `cos` and `sin` `[T, R / 2]` (RoPE at
//! each token's position), all of one float dtype; `cache` `[N, lora + R]` of that dtype, contiguous (a
//! contiguous cache, or a paged one's blocks viewed as rows). Token `t`'s row
//!
//! ```text
//! [ rms_norm(kv_a[t, ..lora], norm_weight, eps) | rope_i(kv_a[t, lora..], cos[t], sin[t]) ]
//! ```
//!
//! is written to cache row `offset + t` ([`CacheRows::From`]) or `rows[t]` ([`CacheRows::At`], `U32 [T]`,
//! each `< N`). `rms_norm` is [`crate::rms_norm`]'s; `rope_i` is candle-nn's interleaved RoPE: each pair
//! `(x0, x1)` becomes `(x0·c − x1·s, x0·s + x1·c)`, every product and sum rounded to the dtype.
//!
//! # Implementations
//!
//! The reference is [`latent_rows_reference`] (RMSNorm, candle-nn's `rope_i`, a concatenation) and candle's
//! `slice_set` / `scatter_set`: five launches on a GPU. On CUDA for bf16 and f32 one kernel
//! (`kernels/src/attention_rows.cu`), a block per token.

use candle_core::Tensor;

pub use crate::cache_rows::{write_rows, CacheRows};
use crate::error::{OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;

/// The latent rows `[T, lora + R]` (contract above), by candle ops.
pub fn latent_rows_reference(
    kv_a: &Tensor,
    norm_weight: &Tensor,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let lora = norm_weight.dim(0)?;
    let (t, width) = kv_a.dims2()?;
    let c = crate::rms_norm::rms_norm(&kv_a.narrow(1, 0, lora)?, norm_weight, eps)?;
    // rope_i takes [batch, heads, T, R]: the tokens as one head's sequence.
    let k_pe = kv_a
        .narrow(1, lora, width - lora)?
        .reshape((1, 1, t, width - lora))?
        .contiguous()?;
    let k_pe = candle_nn::rotary_emb::rope_i(&k_pe, cos, sin)?.reshape((t, width - lora))?;
    Ok(Tensor::cat(&[c, k_pe], 1)?)
}

/// Writes the latent rows of `kv_a`'s tokens into `cache` (contract above).
pub fn write_latent_rows(
    kv_a: &Tensor,
    norm_weight: &Tensor,
    eps: f64,
    (cos, sin): (&Tensor, &Tensor),
    cache: &Tensor,
    rows: CacheRows<'_>,
) -> Result<()> {
    check(kv_a, norm_weight, (cos, sin), cache, rows)?;
    if kv_a.dim(0)? == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if kv_a.device().is_cuda()
        && matches!(
            kv_a.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F32
        )
    {
        return cuda::write_latent_rows(kv_a, norm_weight, eps, (cos, sin), cache, rows);
    }
    let values = latent_rows_reference(kv_a, norm_weight, eps, cos, sin)?;
    write_rows(cache, &values, rows)
}

pub(crate) fn check(
    kv_a: &Tensor,
    norm_weight: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    cache: &Tensor,
    rows: CacheRows<'_>,
) -> Result<()> {
    let (t, width) = kv_a.dims2()?;
    let lora = norm_weight.dim(0)?;
    let rope = width.checked_sub(lora).filter(|r| r % 2 == 0);
    let Some(rope) = rope else {
        return Err(OpError::Shape {
            arg: "kv_a",
            expected: format!("[T, {lora} + an even RoPE width]"),
            found: kv_a.dims().to_vec(),
        });
    };
    for (arg, tensor) in [("cos", cos), ("sin", sin)] {
        if tensor.dims() != [t, rope / 2] {
            return Err(OpError::Shape {
                arg,
                expected: format!("[{t}, {}]", rope / 2),
                found: tensor.dims().to_vec(),
            });
        }
    }
    let (slots, cache_width) = cache.dims2()?;
    if cache_width != width || !cache.is_contiguous() {
        return Err(OpError::Shape {
            arg: "cache",
            expected: format!("contiguous [N, {width}]"),
            found: cache.dims().to_vec(),
        });
    }
    for (arg, tensor) in [
        ("norm_weight", norm_weight),
        ("cos", cos),
        ("sin", sin),
        ("cache", cache),
    ] {
        if tensor.dtype() != kv_a.dtype() {
            return Err(OpError::DTypeMismatch {
                arg,
                other: "kv_a",
                expected: kv_a.dtype(),
                found: tensor.dtype(),
            });
        }
    }
    rows.check(t, slots, cache)?;
    Ok(())
}
