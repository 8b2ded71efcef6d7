//! DSA lightning indexer: picks, for every query, the keys its sparse attention will read
//! (spec: glm5-architecture.md §4).
//!
//! # Contract
//!
//! Inputs:
//! * `q_index` `[T, H_I, D]`: index queries, RoPE already applied.
//! * `head_weights` `[T, H_I]`: per-head weights, already multiplied by the caller's scale.
//! * `keys` `[N, D]`: the layer's indexer key cache; row `s` is the key of position `s`.
//! * `visible_keys` (length `T`): query `t` sees keys `0..visible_keys[t]`. Causality is expressed
//!   only through this: in a prefill chunk starting at position `p` the caller passes `p + t + 1`.
//!
//! `q_index` and `keys` share one float dtype; `head_weights` may be any float dtype. The score
//!
//! ```text
//! score(t, s) = Σ_h head_weights[t, h] · relu(q_index[t, h, :] · keys[s, :])
//! ```
//!
//! is computed in f32 (inputs are upcast).
//!
//! Output: an `I32` tensor `[T, top_k]` on the inputs' device. Row `t` holds the indices of the
//! `min(top_k, visible_keys[t])` highest scores over `s < visible_keys[t]`, by score descending;
//! equal scores (`-0.0` equals `0.0`) are ordered by index ascending, so the lower index wins a tie
//! and the result is deterministic. The remaining slots hold `-1`.
//!
//! # Reference implementation
//!
//! Scores are computed with candle tensor ops (matmul, relu, broadcast_mul, sum), so they run on
//! any device; queries are processed in chunks so that the `[T_chunk, H_I, N]` f32 score tensor
//! stays within [`MAX_CHUNK_ELEMS`]. The selection is done on the host: each chunk's `[T_chunk, N]`
//! scores are copied back, the top `k` are found with `select_nth_unstable_by` under the ordering
//! (score descending, index ascending) and then sorted by it.

use std::cmp::Ordering;

use candle_core::{DType, Tensor, D};

use crate::error::{check_float, check_same_dtype, check_shape, OpError, Result};

/// Upper bound on the elements of the f32 `[T_chunk, H_I, N]` score tensor of one chunk.
const MAX_CHUNK_ELEMS: usize = 64 << 20;

/// dsa_indexer's backends in the registry (`registry.rs`): for now the candle-ops reference, on every device.
pub fn registry_entries() -> Vec<crate::registry::Entry> {
    use crate::device::DeviceFamily::{Cpu, OtherCuda, Sm120, Sm90};
    use crate::registry::{Entry, Kernel, Serves};
    vec![Entry {
        name: "reference",
        description: "candle tensor ops for the scores, host top-k (any device, slow)",
        kernel: Kernel::DsaIndexer(dsa_indexer),
        serves: Serves::anything(),
        extra_check: None,
        priority: vec![(Sm120, 100), (Sm90, 100), (OtherCuda, 100), (Cpu, 100)],
    }]
}

/// Top-`top_k` key indices per query, `-1` padded (the contract is in the module docs).
pub fn dsa_indexer(
    q_index: &Tensor,
    head_weights: &Tensor,
    keys: &Tensor,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let [t_len, heads, dim] = check_shape(
        "q_index",
        q_index,
        [("T", None), ("H_I", None), ("D", None)],
    )?;
    check_shape(
        "head_weights",
        head_weights,
        [("T", Some(t_len)), ("H_I", Some(heads))],
    )?;
    let [key_count, _] = check_shape("keys", keys, [("N", None), ("D", Some(dim))])?;
    check_float("q_index", q_index)?;
    check_float("head_weights", head_weights)?;
    check_same_dtype("keys", keys, "q_index", q_index)?;
    if visible_keys.len() != t_len {
        return Err(OpError::Shape {
            arg: "visible_keys",
            expected: format!("[T={t_len}]"),
            found: vec![visible_keys.len()],
        });
    }
    if let Some((row, &visible)) = visible_keys
        .iter()
        .enumerate()
        .find(|&(_, &v)| v > key_count)
    {
        return Err(OpError::VisibleKeysTooLong {
            row,
            visible,
            key_count,
        });
    }
    if top_k == 0 {
        return Err(OpError::ZeroTopK);
    }

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
