//! `write_index_key_rows`: the DSA indexer's keys of a call's tokens, computed from `wk`'s output and written
//! into a key cache (`docs/architecture.md`, §4).
//!
//! # Contract
//!
//! `k` `[T, D]` (`wk`'s output), `ln_weight` and `ln_bias` `[D]` (`k_norm`), `cos` and `sin` `[T, R / 2]`
//! (RoPE at each token's position, `R <= D`), all of one float dtype. Token `t`'s key
//!
//! ```text
//! key = [ rope_i(LN(k[t])[..R], cos[t], sin[t]) | LN(k[t])[R..] ]
//! ```
//!
//! with `LN` candle-nn's `layer_norm` (mean and variance in f32, the result rounded once to the dtype) and
//! `rope_i` as in `latent_rows`, goes to row `offset + t` or `rows[t]` ([`CacheRows`]) of `cache`: float keys
//! `[N, D]` of the dtype, or FP8 `bytes` `U8 [N, D]` and `scales` `F32 [N]` quantised as
//! [`crate::index_keys`] says.
//!
//! # Implementations
//!
//! The reference is [`index_key_rows_reference`] (`layer_norm`, `rope_i`, a concatenation), the FP8
//! quantiser where the cache is FP8, and candle's `slice_set` / `scatter_set`: up to eight launches on a GPU.
//! On CUDA for bf16 and f32 keys of up to [`MAX_CUDA_DIM`] values one kernel (`kernels/src/attention_rows.cu`), a
//! warp per token; wider keys take the reference path.

use candle_core::{DType, Tensor};

pub use crate::cache_rows::{write_rows, CacheRows};
use crate::error::{OpError, Result};
use crate::index_keys::{quantize_fp8, IndexKeys};

#[cfg(feature = "cuda")]
mod cuda;

/// The widest key the CUDA kernel takes (`MAX_PAIRS` pairs a lane in `attention_rows.cu`).
pub const MAX_CUDA_DIM: usize = 256;

/// The keys `[T, D]` in `k`'s dtype (contract above), by candle ops.
pub fn index_key_rows_reference(
    k: &Tensor,
    (ln_weight, ln_bias): (&Tensor, &Tensor),
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (t, dim) = k.dims2()?;
    let rope = 2 * cos.dim(1)?;
    let normed = candle_nn::ops::layer_norm(&k.contiguous()?, ln_weight, ln_bias, eps as f32)?;
    // rope_i takes [batch, heads, T, R]: the tokens as one head's sequence.
    let leading = normed
        .narrow(1, 0, rope)?
        .reshape((1, 1, t, rope))?
        .contiguous()?;
    let rotated = candle_nn::rotary_emb::rope_i(&leading, cos, sin)?.reshape((t, rope))?;
    if rope == dim {
        return Ok(rotated);
    }
    Ok(Tensor::cat(
        &[rotated, normed.narrow(1, rope, dim - rope)?],
        1,
    )?)
}

/// Writes the keys of `k`'s tokens into `cache` (contract above).
pub fn write_index_key_rows(
    k: &Tensor,
    layer_norm: (&Tensor, &Tensor),
    eps: f64,
    (cos, sin): (&Tensor, &Tensor),
    cache: IndexKeys<'_>,
    rows: CacheRows<'_>,
) -> Result<()> {
    check(k, layer_norm, (cos, sin), cache, rows)?;
    if k.dim(0)? == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if k.device().is_cuda()
        && matches!(k.dtype(), DType::BF16 | DType::F32)
        && k.dim(1)? <= MAX_CUDA_DIM
        && k.dim(1)? % 2 == 0
    {
        return cuda::write_index_key_rows(k, layer_norm, eps, (cos, sin), cache, rows);
    }
    let keys = index_key_rows_reference(k, layer_norm, eps, cos, sin)?;
    match cache {
        IndexKeys::Float(store) => write_rows(store, &keys, rows),
        IndexKeys::Fp8 { bytes, scales } => {
            let (new_bytes, new_scales) = quantize_fp8(&keys)?;
            write_rows(bytes, &new_bytes, rows)?;
            write_rows(scales, &new_scales, rows)
        }
    }
}

pub(crate) fn check(
    k: &Tensor,
    (ln_weight, ln_bias): (&Tensor, &Tensor),
    (cos, sin): (&Tensor, &Tensor),
    cache: IndexKeys<'_>,
    rows: CacheRows<'_>,
) -> Result<()> {
    let (t, dim) = k.dims2()?;
    let half = cos.dim(1).unwrap_or(0);
    if 2 * half > dim {
        return Err(OpError::Shape {
            arg: "cos",
            expected: format!("[{t}, R / 2] with R <= {dim}"),
            found: cos.dims().to_vec(),
        });
    }
    for (arg, tensor, expected) in [
        ("ln_weight", ln_weight, vec![dim]),
        ("ln_bias", ln_bias, vec![dim]),
        ("cos", cos, vec![t, half]),
        ("sin", sin, vec![t, half]),
    ] {
        if tensor.dims() != expected.as_slice() {
            return Err(OpError::Shape {
                arg,
                expected: format!("{expected:?}"),
                found: tensor.dims().to_vec(),
            });
        }
        if tensor.dtype() != k.dtype() {
            return Err(OpError::DTypeMismatch {
                arg,
                other: "k",
                expected: k.dtype(),
                found: tensor.dtype(),
            });
        }
    }
    let store = cache.values();
    let (slots, width) = store.dims2()?;
    let float_ok = matches!(cache, IndexKeys::Float(s) if s.dtype() == k.dtype());
    let fp8_ok = matches!(cache, IndexKeys::Fp8 { bytes, scales }
        if bytes.dtype() == DType::U8 && scales.dtype() == DType::F32 && scales.dims() == [slots]
            && scales.is_contiguous());
    if width != dim || !store.is_contiguous() || !(float_ok || fp8_ok) {
        return Err(OpError::Shape {
            arg: "cache",
            expected: format!(
                "contiguous keys [N, {dim}] of {:?}, or U8 [N, {dim}] bytes and F32 [N] scales",
                k.dtype()
            ),
            found: store.dims().to_vec(),
        });
    }
    rows.check(t, slots, store)
}
