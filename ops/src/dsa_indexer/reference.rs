//! The plain reference of dsa_indexer (contract in `mod.rs`): scores by candle tensor ops on any device
//! (queries in chunks so that the `[T_chunk, H_I, N]` f32 scores stay within `MAX_CHUNK_ELEMS`), top-k on
//! the host with `select_nth_unstable_by` under (score descending, index ascending), then sorted by it.

use std::cmp::Ordering;

use candle_core::{DType, Tensor, D};

use super::{check_inputs, PagedIndexKeys, MAX_CHUNK_ELEMS};
use crate::error::Result;
use crate::index_keys::IndexKeys;

/// [`dsa_indexer`] by the candle-ops reference on any device, over float or FP8 keys `[N, D]`
/// (FP8 keys dequantised, scores in f32): the registry's `reference` entry.
pub fn dsa_indexer_reference(
    q_index: &Tensor,
    head_weights: &Tensor,
    keys: IndexKeys,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    check_inputs(q_index, head_weights, keys, visible_keys, top_k)?;
    match keys {
        IndexKeys::Float(keys) => reference(q_index, head_weights, keys, visible_keys, top_k),
        IndexKeys::Fp8 { .. } => {
            let q_index = q_index.to_dtype(DType::F32)?;
            reference(
                &q_index,
                head_weights,
                &keys.dequantize()?,
                visible_keys,
                top_k,
            )
        }
    }
}

/// The candle-ops scores and host top-k behind [`dsa_indexer`] (arguments checked).
pub(super) fn reference(
    q_index: &Tensor,
    head_weights: &Tensor,
    keys: &Tensor,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let (t_len, heads, dim) = q_index.dims3()?;
    let mut selected = vec![-1i32; t_len * top_k];
    let max_visible = visible_keys.iter().copied().max().unwrap_or(0);
    if max_visible > 0 {
        // Keys no query can see are never scored.
        let keys = keys.narrow(0, 0, max_visible)?.to_dtype(DType::F32)?;
        let chunk = (MAX_CHUNK_ELEMS / (heads * max_visible).max(1)).max(1);
        for start in (0..t_len).step_by(chunk) {
            let len = chunk.min(t_len - start);
            let q = q_index.narrow(0, start, len)?.to_dtype(DType::F32)?;
            let w = head_weights.narrow(0, start, len)?.to_dtype(DType::F32)?;
            let scores = q
                .reshape((len * heads, dim))?
                .matmul(&keys.t()?)? // [len·H_I, N]: q_h · k_s
                .relu()?
                .reshape((len, heads, max_visible))?
                .broadcast_mul(&w.unsqueeze(D::Minus1)?)?
                .sum(1)? // [len, N]
                .to_vec2::<f32>()?;
            for (i, row) in scores.iter().enumerate() {
                let t = start + i;
                let top = top_indices(&row[..visible_keys[t]], top_k);
                selected[t * top_k..][..top.len()].copy_from_slice(&top);
            }
        }
    }
    Ok(Tensor::from_vec(
        selected,
        (t_len, top_k),
        q_index.device(),
    )?)
}

/// The reference over a paged cache: each query's visible keys gathered through the block table
/// (dequantised), then [`reference`].
pub(super) fn paged_reference(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    token_seq: &[i32],
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let device = q_index.device();
    let block_size = cache.keys.values().dim(1)?;
    let dim = cache.keys.values().dim(2)?;
    let rows = cache.keys.dequantize()?.reshape(((), dim))?;
    let block_table = cache.block_table.to_vec2::<i32>()?;
    let mut selected = Vec::with_capacity(token_seq.len());
    for (t, (&seq, &visible)) in token_seq.iter().zip(visible_keys).enumerate() {
        let physical: Vec<u32> = (0..visible)
            .map(|s| {
                (block_table[seq as usize][s / block_size] as usize * block_size + s % block_size)
                    as u32
            })
            .collect();
        let keys = if physical.is_empty() {
            Tensor::zeros((0, dim), DType::F32, device)?
        } else {
            rows.index_select(&Tensor::new(physical.as_slice(), device)?, 0)?
        };
        let q = q_index.narrow(0, t, 1)?.to_dtype(DType::F32)?;
        selected.push(reference(
            &q,
            &head_weights.narrow(0, t, 1)?,
            &keys,
            &[visible],
            top_k,
        )?);
    }
    Ok(Tensor::cat(&selected, 0)?)
}

/// Indices of the `min(k, scores.len())` highest scores, by score descending then index ascending.
fn top_indices(scores: &[f32], k: usize) -> Vec<i32> {
    // `+ 0.0` turns -0.0 into 0.0 so that the two tie.
    let by_rank = |&a: &usize, &b: &usize| -> Ordering {
        (scores[b] + 0.0)
            .total_cmp(&(scores[a] + 0.0))
            .then(a.cmp(&b))
    };
    let mut candidates: Vec<usize> = (0..scores.len()).collect();
    let k = k.min(candidates.len());
    if k < candidates.len() {
        candidates.select_nth_unstable_by(k, by_rank);
        candidates.truncate(k);
    }
    candidates.sort_unstable_by(by_rank);
    // Key positions index a tensor, so they fit in i32.
    candidates.into_iter().map(|s| s as i32).collect()
}
