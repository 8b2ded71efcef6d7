//! Sparse absorbed MLA: every query head attends to the latent-cache rows the indexer selected
//! (spec: glm5-architecture.md §3.4 and §4).
//!
//! # Contract
//!
//! Absorbed MLA is MQA over a single latent head:
//! * `q` `[T, H, D]`: absorbed queries, `D = kv_lora + rope` (576 for GLM-5), any float dtype.
//! * `latent_cache` `[N, D]`, same dtype as `q`: row `s` is `[c_s | k_pe_s]` of position `s`.
//! * `indices` `I32 [T, K]`: the rows query `t` reads, in any order, `-1` meaning "no row"; every
//!   entry must lie in `-1..N`. Duplicates are not expected (a duplicated row is counted twice).
//! * `value_dim` (`kv_lora`, ≤ `D`): the value of a row is its first `value_dim` columns.
//!
//! For the valid entries `k` of row `t` (those with `indices[t, k] >= 0`), with `c = latent_cache`:
//!
//! ```text
//! score(t, h, k) = softmax_scale · q[t, h, :] · c[indices[t, k], :]
//! p(t, h, ·)     = softmax of score(t, h, ·) over the valid k
//! out[t, h, :]   = Σ_k p(t, h, k) · c[indices[t, k], ..value_dim]
//! lse[t, h]      = ln Σ_k exp(score(t, h, k))        (natural log, computed with the max)
//! ```
//!
//! A row with no valid index gets `out = 0` and `lse = -inf`. Causality is the caller's business:
//! it is whatever `indices` selects.
//!
//! Returns `(out [T, H, value_dim]` in `q`'s dtype, `lse [T, H]` f32`)`.
//!
//! # Reference implementation
//!
//! The indices are validated on the host. The computation is in f32 with candle tensor ops, so it
//! runs on any device: rows are gathered with `index_select` (`-1` read as row 0, its score then
//! masked to `-inf`), scored with a batched matmul and reduced with a max-shifted softmax. Queries
//! are processed in chunks so that the gathered `[T_chunk, K, D]` rows stay within
//! [`MAX_CHUNK_ELEMS`].

use candle_core::{DType, Tensor, D};

use crate::error::{check_float, check_same_dtype, check_shape, OpError, Result};

/// Upper bound on the elements of the gathered `[T_chunk, K, D]` rows of one chunk.
const MAX_CHUNK_ELEMS: usize = 64 << 20;

/// Attention of every head over the selected latent rows: `(out, lse)` (contract in the module docs).
pub fn sparse_mla(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    let [t_len, heads, row_dim] = check_shape("q", q, [("T", None), ("H", None), ("D", None)])?;
    let [cache_len, _] = check_shape(
        "latent_cache",
        latent_cache,
        [("N", None), ("D", Some(row_dim))],
    )?;
    check_float("q", q)?;
    check_same_dtype("latent_cache", latent_cache, "q", q)?;
    if value_dim > row_dim {
        return Err(OpError::ValueDimTooLarge { value_dim, row_dim });
    }
    if indices.dtype() != DType::I32 {
        return Err(OpError::IndexDType {
            arg: "indices",
            expected: DType::I32,
            found: indices.dtype(),
        });
    }
    let [_, k_len] = check_shape("indices", indices, [("T", Some(t_len)), ("K", None)])?;

    let host_indices = indices.flatten_all()?.to_vec1::<i32>()?;
    if let Some((at, &value)) = host_indices
        .iter()
        .enumerate()
        .find(|&(_, &i)| !(-1..cache_len as i64).contains(&i64::from(i)))
    {
        return Err(OpError::IndexOutOfRange {
            arg: "indices",
            row: at / k_len,
            col: at % k_len,
            value: value.into(),
            cache_len,
        });
    }

    let device = q.device();
    if host_indices.iter().all(|&i| i < 0) {
        let out = Tensor::zeros((t_len, heads, value_dim), q.dtype(), device)?;
        let lse = Tensor::full(f32::NEG_INFINITY, (t_len, heads), device)?;
        return Ok((out, lse));
    }

    // -1 reads row 0, and its score is masked to -inf.
    let rows: Vec<u32> = host_indices.iter().map(|&i| i.max(0) as u32).collect();
    let mask: Vec<f32> = host_indices
        .iter()
        .map(|&i| if i < 0 { f32::NEG_INFINITY } else { 0.0 })
        .collect();
    let rows = Tensor::from_vec(rows, t_len * k_len, device)?;
    let mask = Tensor::from_vec(mask, (t_len, 1, k_len), device)?;

    let chunk = (MAX_CHUNK_ELEMS / (k_len * row_dim).max(1)).max(1);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for start in (0..t_len).step_by(chunk) {
        let len = chunk.min(t_len - start);
        let q_f32 = q.narrow(0, start, len)?.to_dtype(DType::F32)?;
        let kv = latent_cache
            .index_select(&rows.narrow(0, start * k_len, len * k_len)?, 0)?
            .to_dtype(DType::F32)?
            .reshape((len, k_len, row_dim))?;
        let values = kv.narrow(D::Minus1, 0, value_dim)?.contiguous()?;
        let scores = (q_f32.matmul(&kv.t()?)? * softmax_scale)? // [len, H, K]
            .broadcast_add(&mask.narrow(0, start, len)?)?;
        // A row with no valid index has max -inf; clamping it keeps exp(score - max) at 0
        // instead of NaN, so its sum is 0, its lse -inf and its output 0.
        let max = scores.max_keepdim(D::Minus1)?.maximum(f32::MIN)?;
        let weights = scores.broadcast_sub(&max)?.exp()?;
        let sum = weights.sum_keepdim(D::Minus1)?; // [len, H, 1]
        outs.push(
            weights
                .matmul(&values)?
                .broadcast_div(&sum.maximum(f32::MIN_POSITIVE)?)?,
        );
        lses.push((max + sum.log()?)?.squeeze(D::Minus1)?);
    }
    Ok((
        Tensor::cat(&outs, 0)?.to_dtype(q.dtype())?,
        Tensor::cat(&lses, 0)?,
    ))
}
