//! The plain reference of sparse_mla (contract in `mod.rs`): f32 candle tensor ops on any device, indices
//! validated on the host. What the CPU runs, and the baseline the kernels are checked and timed against.

use candle_core::{DType, Tensor, D};

use super::PagedLatentCache;
use crate::error::{check_float, check_same_dtype, check_shape, OpError, Result};

/// Upper bound on the elements of the gathered `[T_chunk, K, D]` rows of one chunk.
const MAX_CHUNK_ELEMS: usize = 64 << 20;

/// The reference over a paged cache: logical positions translated to physical rows on the host, then
/// [`sparse_mla_reference`] over all rows.
pub(super) fn paged(
    q: &Tensor,
    cache: &PagedLatentCache,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    // Reference: translate logical positions to physical rows on the host, then attend over all rows.
    let [num_blocks, block_size, row_dim] = check_shape(
        "blocks",
        cache.blocks,
        [("num_blocks", None), ("block_size", None), ("D", None)],
    )?;
    let [batch, max_blocks] = check_shape(
        "block_table",
        cache.block_table,
        [("B", None), ("max_blocks", None)],
    )?;
    let [t_len, k_len] = check_shape("indices", indices, [("T", None), ("K", None)])?;
    check_shape("seq_lens", cache.seq_lens, [("B", Some(batch))])?;
    check_shape("token_seq", cache.token_seq, [("T", Some(t_len))])?;
    let table = cache.block_table.to_dtype(DType::I64)?.to_vec2::<i64>()?;
    let seq_lens = cache.seq_lens.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    let token_seq = cache.token_seq.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    let logical = indices.to_dtype(DType::I64)?.to_vec2::<i64>()?;
    let mut physical = Vec::with_capacity(t_len * k_len);
    for (t, row) in logical.iter().enumerate() {
        let seq = usize::try_from(token_seq[t])
            .ok()
            .filter(|&s| s < batch)
            .ok_or(OpError::IndexOutOfRange {
                arg: "token_seq",
                row: t,
                col: 0,
                value: token_seq[t],
                cache_len: batch,
            })?;
        for (col, &pos) in row.iter().enumerate() {
            let out_of_range = || OpError::IndexOutOfRange {
                arg: "indices",
                row: t,
                col,
                value: pos,
                cache_len: seq_lens[seq] as usize,
            };
            if pos < 0 {
                physical.push(-1);
                continue;
            }
            if pos >= seq_lens[seq] || pos as usize / block_size >= max_blocks {
                return Err(out_of_range());
            }
            let block = table[seq][pos as usize / block_size];
            if !(0..num_blocks as i64).contains(&block) {
                return Err(OpError::IndexOutOfRange {
                    arg: "block_table",
                    row: seq,
                    col: pos as usize / block_size,
                    value: block,
                    cache_len: num_blocks,
                });
            }
            physical.push((block as usize * block_size + pos as usize % block_size) as i32);
        }
    }
    let rows = cache.blocks.reshape((num_blocks * block_size, row_dim))?;
    let physical = Tensor::from_vec(physical, (t_len, k_len), q.device())?;
    sparse_mla_reference(q, &rows, &physical, value_dim, softmax_scale)
}

/// The plain reference over contiguous rows (see the module docs): what the CPU runs, and the baseline the
/// kernels are checked and timed against (it runs on any device).
pub fn sparse_mla_reference(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    let [t_len, heads, row_dim, cache_len, k_len] =
        check_args(q, latent_cache, indices, value_dim)?;

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

/// Checks the contiguous call's arguments (all but the indices' range, which needs them on the host);
/// returns `[T, H, D, N, K]`.
pub(super) fn check_args(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
) -> Result<[usize; 5]> {
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
    Ok([t_len, heads, row_dim, cache_len, k_len])
}
