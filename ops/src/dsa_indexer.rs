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
//! Output: an `I32` tensor `[T, top_k]` on the inputs' device. Row `t` holds the SET of indices of
//! the `min(top_k, visible_keys[t])` highest scores over `s < visible_keys[t]`; among equal scores
//! (`-0.0` equals `0.0`) the lower index wins, so the set is deterministic. The remaining slots hold
//! `-1`. The order inside a row is the backend's: the reference lists by score descending (then
//! index), the CUDA kernel by ascending position; sparse attention does not depend on it.
//!
//! [`dsa_indexer_paged`] takes the keys from a paged cache instead: `[num_blocks, block_size, D]`
//! rows (float, or FP8 with one scale per key, see [`crate::index_keys`]), a block table per
//! sequence and the sequence of each query, position `s` of sequence `b` being row
//! `block_table[b][s / block_size]·block_size + s % block_size` (the latent cache's paging). A
//! sequence index outside the block table is an `IndexOutOfRange` error on the reference path; the
//! CUDA kernels do not read it back to the host and give that query no keys (a row of -1).
//!
//! [`dsa_indexer_paged_device_visible`] is the same over counts already on the device (`I32 [T]`) with a
//! host-side bound `max_visible`: nothing is uploaded per call, so a decode step can be captured in a
//! CUDA graph. A count above the bound is read as the bound, a negative one as 0 (on every backend).
//!
//! # CUDA kernels (`kernels/src/dsa_indexer.cu`)
//!
//! bf16 or FP8 keys with bf16 queries: scores by `mma.sync` over cp.async-pipelined key tiles (FP8
//! keys are exact in f16: the f16 mma runs on the raw e4m3 values against Q scaled by a power of two,
//! and the key's scale multiplies its score), `H_I <= 32` heads, `D` in {16, 32, 64, 128}; f32: an FMA
//! kernel. On Hopper, GLM-5's layout (FP8 keys of 128 in pages of 64, 17-32 heads) runs the same kernel with
//! warpgroup MMA instead (`kernels/src/dsa_indexer_sm90.cu`: a tile's 64 keys as wgmma's rows, converted to
//! f16 in registers, against Q in shared memory; `set_score_kernel` pins mma.sync), and a prefill chunk of
//! one sequence (a block table of one row) a grouped kernel: four queries per block, each key tile copied
//! and converted once for all four (one wgmma m64n128k16 per 16 dims), where `score_policy` finds it pays.
//! The score kernel also counts each row's scores by their top 11 bits. Top-k, spread over
//! segments of 2048 positions so that one query uses the whole GPU: each segment finds the bin of the
//! K-th score from those counts, lists its scores in that bin, counts them by their next 11 bits and
//! keeps a bit mask of its scores above the bin; one block per query finds the K-th value exactly among
//! the listed ones (the finer counts narrow it to the few scores sharing its top 22 bits, ranked by value
//! then position; a radix select where many share them; ties to the lower position) and gives each
//! segment its output offset, marking the listed scores it takes in their segments' masks; each segment
//! then writes its selected positions in order from its mask (the scores are read once, not twice).
//! Rows of up to 32,768 positions whose queries' clusters fit the GPU at once take the same steps in
//! one kernel instead (`top_k_policy`): a thread-block cluster of 8
//! blocks per query, each holding a share of the row's scores in registers, the blocks exchanging their
//! histograms, counts and the few scores sharing the K-th's top 22 bits by pushing them into each other's
//! shared memory (`st.async` on the receiver's mbarrier), with no kernel boundary or global-memory meeting
//! between the steps. Scores go to an f32 workspace `[T_chunk, N]`, the candidates (position and score
//! pairs) and the segments' counts, offsets and masks to a u32 one (`[T_chunk, ~2.03 N]`); queries go in
//! chunks that keep them under [`MAX_CHUNK_ELEMS`] elements (a long prefill never holds `[T, N]`). At
//! most 4,194,304 visible keys per query.
//! Other dtypes and shapes run the reference.
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
use crate::index_keys::{check_fp8, IndexKeys, KeyFormat};

/// Upper bound on the elements of the f32 score tensor of one chunk of queries (the reference's
/// `[T_chunk, H_I, N]`, the CUDA path's `[T_chunk, N]`).
const MAX_CHUNK_ELEMS: usize = 64 << 20;

/// dsa_indexer's backends in the registry (`registry.rs`): glm5's CUDA kernels (bf16 mma.sync scores for
/// up to 32 heads of width 16/32/64/128, an f32 FMA variant, exact radix top-k; fatbin for cc 9.0 and 12.x)
/// and the candle-ops reference (any device, slow).
pub fn registry_entries() -> Vec<crate::registry::Entry> {
    use crate::device::DeviceFamily::{Cpu, OtherCuda, Sm120, Sm90};
    use crate::registry::{Arch, DeviceMatch, Entry, Kernel, Limit, Serves};
    let kernel_archs = DeviceMatch::Cuda(vec![
        Arch {
            major: 9,
            minor: Some(0),
        },
        Arch {
            major: 12,
            minor: None,
        },
    ]);
    vec![
        Entry {
            name: "cuda-bf16-mma",
            description:
                "glm5 CUDA kernel: mma.sync scores over bf16 (or FP8) keys (wgmma on sm_90 for FP8 \
                          pages of 64 with 17-32 heads), exact radix top-k",
            kernel: Kernel::DsaIndexer(dsa_indexer_cuda),
            serves: Serves {
                devices: kernel_archs.clone(),
                dtypes: vec![DType::BF16],
                heads: Limit::Range {
                    min: 1,
                    max: limits::MMA_MAX_HEADS,
                },
                head_dims: Limit::OneOf(limits::MMA_HEAD_DIMS.to_vec()),
                value_dims: Limit::Any,
                top_k: Limit::Range {
                    min: 1,
                    max: i32::MAX as usize,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![KeyFormat::Float, KeyFormat::Fp8E4m3],
            },
            extra_check: None,
            priority: vec![(Sm120, 10), (Sm90, 10)],
        },
        Entry {
            name: "cuda-f32-fma",
            description: "glm5 CUDA kernel: f32 FMA scores, exact radix top-k",
            kernel: Kernel::DsaIndexer(dsa_indexer_cuda),
            serves: Serves {
                devices: kernel_archs,
                dtypes: vec![DType::F32],
                heads: Limit::Any,
                head_dims: Limit::Any,
                value_dims: Limit::Any,
                top_k: Limit::Range {
                    min: 1,
                    max: i32::MAX as usize,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                // FP8 keys are scored by the bf16 mma kernel.
                key_formats: vec![KeyFormat::Float],
            },
            extra_check: None,
            priority: vec![(Sm120, 20), (Sm90, 20)],
        },
        Entry {
            name: "reference",
            description: "candle tensor ops for the scores, host top-k (any device, slow)",
            kernel: Kernel::DsaIndexer(dsa_indexer_reference),
            serves: Serves::anything(),
            extra_check: None,
            priority: vec![(Sm120, 100), (Sm90, 100), (OtherCuda, 100), (Cpu, 100)],
        },
    ]
}

/// What the CUDA kernels serve (shared by the launcher and the registry, which must not need a GPU).
pub(crate) mod limits {
    /// Key widths the mma score kernels are instantiated for.
    pub const MMA_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
    /// Most heads the mma score kernels hold (two tiles of 16).
    pub const MMA_MAX_HEADS: usize = 32;
    /// Most keys one query may see on the CUDA kernels: 2048 top-k segments (`MAX_SEGMENTS`) of 2048.
    #[cfg(feature = "cuda")]
    pub const CUDA_MAX_VISIBLE_KEYS: usize = 2048 * 2048;
}

/// Which top-k the CUDA launcher runs after the scores (pure, so that CPU tests check it).
#[cfg(any(feature = "cuda", test))]
pub(crate) mod top_k_policy {
    /// Blocks per cluster and threads per block of the cluster top-k (`CLUSTER_BLOCKS`,
    /// `CLUSTER_THREADS` in the .cu file), and the scores per thread it is instantiated for.
    pub const CLUSTER_BLOCKS: usize = 8;
    pub const CLUSTER_THREADS: usize = 512;
    pub const CLUSTER_SCORES_PER_THREAD: [usize; 5] = [4, 8, 16, 32, 64];
    /// The most scores per thread the launcher's choice gives the cluster top-k: its eight blocks do a
    /// row's per-score work on eight SMs, which at 32 per thread (128K rows) costs more than the chain's
    /// two kernel boundaries save (H200, batch 1: 22.3 µs against 18.6; at 8 per thread, 32K rows:
    /// 13.3 against 14.0).
    pub const CHOSEN_MAX_SCORES_PER_THREAD: usize = 8;

    /// The cluster kernel's scores per thread for rows of up to `positions` (none past its longest row).
    pub fn scores_per_thread(positions: usize) -> Option<usize> {
        CLUSTER_SCORES_PER_THREAD
            .into_iter()
            .find(|e| CLUSTER_BLOCKS * CLUSTER_THREADS * e >= positions)
    }

    /// The launcher's choice for `tokens` rows of up to `positions` when the device runs `at_once`
    /// clusters together: the cluster top-k (its scores per thread) where rows are short enough and every
    /// token's cluster runs in one wave (a second wave costs more than the chain: 32K rows at batch 64,
    /// 116 µs against 99), else the chain (`None`).
    pub fn chosen(positions: usize, tokens: usize, at_once: usize) -> Option<usize> {
        scores_per_thread(positions)
            .filter(|&e| e <= CHOSEN_MAX_SCORES_PER_THREAD && tokens <= at_once)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn rows_up_to_the_longest_get_the_fewest_scores_per_thread_that_cover_them() {
            assert_eq!(scores_per_thread(1), Some(4));
            assert_eq!(scores_per_thread(16_384), Some(4));
            assert_eq!(scores_per_thread(16_385), Some(8));
            assert_eq!(scores_per_thread(131_072), Some(32));
            let longest = CLUSTER_BLOCKS * CLUSTER_THREADS * 64;
            assert_eq!(scores_per_thread(longest), Some(64));
            assert_eq!(scores_per_thread(longest + 1), None);
        }

        #[test]
        fn the_choice_takes_short_rows_in_one_wave_and_leaves_the_rest_to_the_chain() {
            assert_eq!(chosen(32_768, 8, 16), Some(8));
            assert_eq!(chosen(8192, 1, 16), Some(4));
            assert_eq!(chosen(32_768, 64, 16), None, "a second wave");
            assert_eq!(chosen(131_072, 1, 16), None, "32 scores per thread");
            assert_eq!(chosen(32_768, 1, 0), None, "no cluster fits the device");
        }
    }
}

/// Which emit kernel writes a chain top-k's rows (pure, so that CPU tests check it).
#[cfg(any(feature = "cuda", test))]
pub(crate) mod emit_policy {
    /// Positions per top-k segment (`SEG` in the .cu file).
    pub const SEGMENT: usize = 2048;
    /// Segments a block of the warp-a-segment emit (`EMIT_SEGMENTS` in the .cu file).
    pub const EMIT_SEGMENTS: usize = 8;
    /// Selected positions above which a segment is dense (`DIRECT_STORES` in the .cu file).
    pub const DIRECT_STORES: usize = 256;

    /// Whether the block-a-segment emit writes `rows` rows seeing up to `positions` positions each, top `k`: where
    /// the rows' segments are dense on average (more than DIRECT_STORES of a segment's positions selected) and the
    /// warp-a-segment emit's grid would not fill the `resident` blocks the device holds at once (decode steps at
    /// 2K-16K positions; a prefill chunk keeps the warp a segment, whose stores are coalesced).
    pub fn by_blocks(rows: usize, positions: usize, k: usize, resident: usize) -> bool {
        let dense = positions > k && positions * DIRECT_STORES <= k * SEGMENT;
        dense && rows * positions.div_ceil(SEGMENT).div_ceil(EMIT_SEGMENTS) < resident
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn blocks_a_segment_for_small_grids_of_dense_rows() {
            let h200 = 132 * 6; // the warp-a-segment emit: 6 blocks an SM
            assert!(by_blocks(64, 8192, 2048, h200), "8K batch 64");
            assert!(
                by_blocks(64, 16_384, 2048, h200),
                "16K batch 64: 256 a segment"
            );
            assert!(by_blocks(1, 2049, 2048, h200), "one row just past K");
            assert!(
                !by_blocks(64, 32_768, 2048, h200),
                "32K batch 64: sparse segments"
            );
            assert!(!by_blocks(64, 1024, 2048, h200), "rows that see at most K");
            assert!(
                !by_blocks(4096, 8192, 2048, h200),
                "an 8K prefill chunk fills the device"
            );
            assert!(
                by_blocks(512, 8192, 2048, h200),
                "a short prefill chunk does not"
            );
        }
    }
}

/// When the CUDA launcher scores a one-sequence call's queries in groups (pure, so that CPU tests check it).
#[cfg(any(feature = "cuda", test))]
pub(crate) mod score_policy {
    /// Queries per block of the grouped prefill score kernel (`GROUP_TOKENS` in the .cu file).
    pub const GROUP_TOKENS: usize = 4;
    /// The fewest tiles each grouped block must get, the grid filling the device, for the grouped kernel to
    /// pay for its longer start (four queries' Q, twice the histogram): H200, 8K rows x 64 queries (8 tiles a
    /// block) 28.9-29.1 µs against 27.6 per query; 32K x 16 (8) even; 32K x 64 and 128K x 16 (32) 20-21%
    /// faster, 128K x 4096 28%.
    pub const GROUP_MIN_TILES_PER_BLOCK: usize = 16;

    /// Whether `queries` queries of one sequence over rows of `tiles` key tiles go four to a block, the device
    /// holding `resident` grouped blocks at once.
    pub fn groups_queries(queries: usize, tiles: usize, resident: usize) -> bool {
        resident > 0
            && queries.div_ceil(GROUP_TOKENS) * tiles >= GROUP_MIN_TILES_PER_BLOCK * resident
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn groups_where_each_block_gets_sixteen_tiles() {
            let h200 = 264; // 132 SMs x 2 blocks
            assert!(!groups_queries(1, 2048, h200), "a decode step");
            assert!(!groups_queries(64, 128, h200), "8K x 64: 8 tiles a block");
            assert!(!groups_queries(16, 512, h200), "32K x 16: 8 tiles a block");
            assert!(groups_queries(64, 512, h200), "32K x 64");
            assert!(groups_queries(16, 2048, h200), "128K x 16");
            assert!(groups_queries(4096, 128, h200), "8K x 4096");
            assert!(!groups_queries(4096, 128, 0), "the kernel does not fit");
        }
    }
}

/// A paged indexer key cache (layout in the module docs).
pub struct PagedIndexKeys<'a> {
    /// Rows `[num_blocks, block_size, D]` (FP8 scales `[num_blocks, block_size]`).
    pub keys: IndexKeys<'a>,
    /// `I32 [B, max_blocks]`: the blocks of each sequence, in order.
    pub block_table: &'a Tensor,
    /// `I32 [T]`: the sequence of each query.
    pub token_seq: &'a Tensor,
}

/// Top-`top_k` key indices per query, `-1` padded (the contract is in the module docs): glm5's CUDA
/// kernel where one serves these inputs, the reference otherwise. The model binds a backend chosen by
/// the registry instead.
pub fn dsa_indexer(
    q_index: &Tensor,
    head_weights: &Tensor,
    keys: &Tensor,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    check_inputs(
        q_index,
        head_weights,
        IndexKeys::Float(keys),
        visible_keys,
        top_k,
    )?;
    #[cfg(feature = "cuda")]
    if q_index.device().is_cuda() && cuda::serves(q_index.dtype(), q_index.dim(1)?, q_index.dim(2)?)
    {
        return dsa_indexer_cuda(
            q_index,
            head_weights,
            IndexKeys::Float(keys),
            visible_keys,
            top_k,
        );
    }
    reference(q_index, head_weights, keys, visible_keys, top_k)
}

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

/// [`dsa_indexer`] by glm5's CUDA kernels over contiguous float or FP8 keys `[N, D]` (the cache as
/// one block): the registry's `cuda-bf16-mma` and `cuda-f32-fma` entries. Inputs no kernel serves,
/// or a build without the `cuda` feature, give [`OpError::Unsupported`].
pub fn dsa_indexer_cuda(
    q_index: &Tensor,
    head_weights: &Tensor,
    keys: IndexKeys,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let [t_len, heads, dim] = check_inputs(q_index, head_weights, keys, visible_keys, top_k)?;
    // FP8 keys are scored by the bf16 mma kernel.
    let kernel_dtype = match keys {
        IndexKeys::Float(_) => q_index.dtype(),
        IndexKeys::Fp8 { .. } => DType::BF16,
    };
    #[cfg(feature = "cuda")]
    if q_index.device().is_cuda() && cuda::serves(kernel_dtype, heads, dim) {
        // The contiguous cache as one block of `key_count` rows.
        let key_count = keys.values().dim(0)?;
        let device = q_index.device();
        let values = keys.values().reshape((1, key_count, dim))?;
        let scales;
        let block = match keys {
            IndexKeys::Float(_) => IndexKeys::Float(&values),
            IndexKeys::Fp8 { scales: s, .. } => {
                scales = s.reshape((1, key_count))?;
                IndexKeys::Fp8 {
                    bytes: &values,
                    scales: &scales,
                }
            }
        };
        let cache = PagedIndexKeys {
            keys: block,
            block_table: &Tensor::zeros((1, 1), DType::I32, device)?,
            token_seq: &Tensor::zeros(t_len, DType::I32, device)?,
        };
        return cuda::dsa_indexer_paged(q_index, head_weights, &cache, visible_keys, top_k);
    }
    let _ = kernel_dtype;
    Err(OpError::Unsupported(format!(
        "dsa_indexer CUDA kernels: need a CUDA device{} with bf16 queries of ≤ {} heads of width {:?}, or f32; got {:?} {:?}, {t_len} queries of {heads} heads of width {dim}",
        if cfg!(feature = "cuda") { "" } else { " and a glm5 built with the cuda feature" },
        limits::MMA_MAX_HEADS,
        limits::MMA_HEAD_DIMS,
        q_index.device().location(),
        q_index.dtype(),
    )))
}

/// Checks [`dsa_indexer`]'s arguments (float or FP8 keys `[N, D]`); returns `[T, H_I, D]`.
fn check_inputs(
    q_index: &Tensor,
    head_weights: &Tensor,
    keys: IndexKeys,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<[usize; 3]> {
    let [t_len, heads, dim] = check_queries(q_index, head_weights)?;
    let [key_count, _] = check_shape("keys", keys.values(), [("N", None), ("D", Some(dim))])?;
    check_key_format(keys, q_index)?;
    check_request(t_len, visible_keys, key_count, top_k)?;
    Ok([t_len, heads, dim])
}

/// Checks the queries `[T, H_I, D]` and their head weights `[T, H_I]`; returns `[T, H_I, D]`.
fn check_queries(q_index: &Tensor, head_weights: &Tensor) -> Result<[usize; 3]> {
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
    check_float("q_index", q_index)?;
    check_float("head_weights", head_weights)?;
    Ok([t_len, heads, dim])
}

/// Float keys share the queries' dtype; FP8 keys are U8 bytes with an F32 scale per key.
fn check_key_format(keys: IndexKeys, q_index: &Tensor) -> Result<()> {
    match keys {
        IndexKeys::Float(keys) => check_same_dtype("keys", keys, "q_index", q_index),
        IndexKeys::Fp8 { bytes, scales } => check_fp8(bytes, scales),
    }
}

/// One visible-key count per query, none beyond the `key_count` keys there are, and a top-k of at least 1.
fn check_request(
    t_len: usize,
    visible_keys: &[usize],
    key_count: usize,
    top_k: usize,
) -> Result<()> {
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
    Ok(())
}

/// The candle-ops scores and host top-k behind [`dsa_indexer`] (arguments checked).
fn reference(
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

/// Checks the queries and the paged cache; returns `[T, D, B, key capacity per sequence]`.
fn check_paged(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
) -> Result<[usize; 4]> {
    let [t_len, _, dim] = check_queries(q_index, head_weights)?;
    let [_, block_size, _] = check_shape(
        "keys",
        cache.keys.values(),
        [("num_blocks", None), ("block_size", None), ("D", Some(dim))],
    )?;
    check_key_format(cache.keys, q_index)?;
    let [batch, max_blocks] = check_shape(
        "block_table",
        cache.block_table,
        [("B", None), ("max_blocks", None)],
    )?;
    check_shape("token_seq", cache.token_seq, [("T", Some(t_len))])?;
    for (arg, tensor) in [
        ("block_table", cache.block_table),
        ("token_seq", cache.token_seq),
    ] {
        if tensor.dtype() != DType::I32 {
            return Err(OpError::IndexDType {
                arg,
                expected: DType::I32,
                found: tensor.dtype(),
            });
        }
    }
    Ok([t_len, dim, batch, max_blocks * block_size])
}

/// [`dsa_indexer`] over a paged key cache (layout in the module docs).
pub fn dsa_indexer_paged(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let [t_len, dim, batch, capacity] = check_paged(q_index, head_weights, cache)?;
    check_request(t_len, visible_keys, capacity, top_k)?;
    #[cfg(feature = "cuda")]
    if q_index.device().is_cuda() {
        let fp8 = matches!(cache.keys, IndexKeys::Fp8 { .. });
        let dtype = if fp8 { DType::BF16 } else { q_index.dtype() };
        if cuda::serves(dtype, q_index.dim(1)?, dim) {
            // A sequence index outside the block table is not reported here (that would cost a
            // device-to-host copy per call): the kernels give such a query no keys (all -1).
            return cuda::dsa_indexer_paged(q_index, head_weights, cache, visible_keys, top_k);
        }
    }
    let _ = dim; // read by the CUDA path only
    let token_seq = cache.token_seq.to_vec1::<i32>()?;
    if let Some((row, &seq)) = token_seq
        .iter()
        .enumerate()
        .find(|&(_, &b)| b < 0 || b as usize >= batch)
    {
        return Err(OpError::IndexOutOfRange {
            arg: "token_seq",
            row,
            col: 0,
            value: seq as i64,
            cache_len: batch,
        });
    }
    paged_reference(
        q_index,
        head_weights,
        cache,
        &token_seq,
        visible_keys,
        top_k,
    )
}

/// [`dsa_indexer_paged`] with the visible-key counts `visible` (`I32 [T]`) on the inputs' device and
/// `max_visible` bounding them (see the module docs): the CUDA kernels read the counts where they are.
pub fn dsa_indexer_paged_device_visible(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible: &Tensor,
    max_visible: usize,
    top_k: usize,
) -> Result<Tensor> {
    let [t_len, dim, _, capacity] = check_paged(q_index, head_weights, cache)?;
    check_shape("visible", visible, [("T", Some(t_len))])?;
    if visible.dtype() != DType::I32 {
        return Err(OpError::IndexDType {
            arg: "visible",
            expected: DType::I32,
            found: visible.dtype(),
        });
    }
    if !visible.device().same_device(q_index.device()) {
        return Err(OpError::Unsupported(format!(
            "dsa_indexer: visible is on {:?}, the queries on {:?}",
            visible.device().location(),
            q_index.device().location()
        )));
    }
    // The bound is checked as a count is: it must fit the cache.
    check_request(1, &[max_visible], capacity, top_k)?;
    #[cfg(feature = "cuda")]
    if q_index.device().is_cuda() {
        let fp8 = matches!(cache.keys, IndexKeys::Fp8 { .. });
        let dtype = if fp8 { DType::BF16 } else { q_index.dtype() };
        if cuda::serves(dtype, q_index.dim(1)?, dim) {
            return cuda::dsa_indexer_paged_visible(
                q_index,
                head_weights,
                cache,
                visible,
                max_visible,
                top_k,
            );
        }
    }
    let _ = dim; // read by the CUDA path only
    let counts: Vec<usize> = visible
        .to_vec1::<i32>()?
        .into_iter()
        .map(|v| (v.max(0) as usize).min(max_visible))
        .collect();
    dsa_indexer_paged(q_index, head_weights, cache, &counts, top_k)
}

/// Device time of the CUDA indexer's two stages, summed over calls (see [`time_stages`]).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    /// The score kernel (scores and their histogram).
    pub scores: std::time::Duration,
    /// The top-k kernels (candidates, exact threshold, ordered emit; or the cluster top-k).
    pub top_k: std::time::Duration,
}

/// Runs `f` and times, with CUDA events, the stages of every CUDA indexer call it makes on this thread;
/// returns `f`'s result and the summed stage times (zero when it made none). The events sit between the
/// stages, so the top-k no longer starts under the score kernel's tail (programmatic dependent launch):
/// the two sum to a little more than an un-timed call takes.
#[cfg(feature = "cuda")]
pub fn time_stages<R>(f: impl FnOnce() -> R) -> Result<(R, StageTimes)> {
    cuda::time_stages(f)
}

/// Which top-k the CUDA indexer runs after its scores (tests and benchmarks pin one).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopKPath {
    /// The launcher's choice: the cluster top-k for rows of up to 32,768 positions whose queries' clusters
    /// the GPU runs at once, else the chain.
    Policy,
    /// Three kernels in a programmatic chain (candidates, exact threshold, ordered emit): any row length.
    Chain,
    /// One thread-block cluster per query (rows of at most 262,144 positions; longer rows take the
    /// chain).
    Cluster,
}

/// Pins the CUDA indexer's top-k ([`TopKPath::Policy`]: the default).
#[cfg(feature = "cuda")]
pub fn set_top_k_path(path: TopKPath) {
    cuda::set_top_k_path(path)
}

/// Which score kernel the CUDA indexer runs for FP8 keys of 128 in pages of 64 with 17 to 32 heads
/// (GLM-5's cache; tests and benchmarks pin one). On Hopper the policy scores the queries of a one-sequence
/// prefill chunk four at a time (`dsa_scores_fp8_wgmma_g4_d128`, see `score_policy`).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreKernel {
    /// The launcher's choice: warpgroup MMA (wgmma) on Hopper (sm_90), mma.sync elsewhere.
    Policy,
    /// mma.sync on every GPU (sm_120's kernel, on Hopper too).
    MmaSync,
    /// The launcher's choice without the grouped prefill kernel: every query scored by a block of its own.
    PerQuery,
    /// The grouped prefill kernel wherever it runs (Hopper, a block table of one row), else the policy.
    Grouped,
}

/// Pins the CUDA indexer's score kernel ([`ScoreKernel::Policy`]: the default).
#[cfg(feature = "cuda")]
pub fn set_score_kernel(kernel: ScoreKernel) {
    cuda::set_score_kernel(kernel)
}

/// The reference over a paged cache: each query's visible keys gathered through the block table
/// (dequantised), then [`reference`].
fn paged_reference(
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

#[cfg(feature = "cuda")]
pub(crate) fn quantize_fp8_cuda(keys: &Tensor, n: usize, dim: usize) -> Result<(Tensor, Tensor)> {
    cuda::quantize_fp8(keys, n, dim)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Launch of `kernels/src/dsa_indexer.cu`.

    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        sys, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId};
    use candle_core::{CustomOp1, DType, Layout, Shape, Tensor};

    use super::top_k_policy::{self, CLUSTER_BLOCKS, CLUSTER_THREADS};
    use super::{PagedIndexKeys, ScoreKernel, TopKPath, MAX_CHUNK_ELEMS};
    use crate::cuda::{
        cuda_err, device_address, device_info, kernel, launch_dependent, resident_blocks,
        resident_clusters,
    };
    use crate::error::{OpError, Result};
    use crate::index_keys::IndexKeys;

    const MODULE: &[u8] = glm5_kernels::DSA_INDEXER;
    /// The wgmma score kernel (`dsa_indexer_sm90.cu`, sm_90a only).
    const MODULE_SM90: &[u8] = glm5_kernels::DSA_INDEXER_SM90;
    /// Keys per score tile (`TILE_KEYS` in the .cu file): the f32 kernel's block covers one.
    const TILE_KEYS: usize = 64;
    /// Per-row histogram words: 2048 bins, the top-k kernels' slots, 2048 fine bins and the bins' 128 group
    /// sums (`HIST_STRIDE` in the .cu file).
    const HIST_STRIDE: usize = 2048 + 4 + 2048 + 128;
    /// Per-segment words of a row's top-k work area after its candidate pairs (`WORK_PER_SEGMENT` in the .cu
    /// file): the count above the threshold bin, the output offset and the mask of the selected positions
    /// (a bit per position).
    const WORK_PER_SEGMENT: usize = 2 + SEGMENT / 32;
    const SCORE_THREADS: u32 = 128;
    const SEGMENT_THREADS: u32 = 256;
    const TOPK_THREADS: u32 = 512;
    /// Dynamic shared memory of the threshold kernel: up to 8192 staged candidates' values and positions
    /// (`STAGED_CANDIDATES` in the .cu file).
    const THRESHOLD_STAGE_BYTES: usize = 2 * 8192 * 4;
    /// Dynamic shared memory of a cluster top-k block (`CLUSTER_SHARED_BYTES` in the .cu file).
    const CLUSTER_SHARED_BYTES: usize = 80 * 1024;
    /// Dynamic shared memory of the grouped prefill score kernel (`GROUP_SHARED_BYTES` in the .cu file).
    const GROUP_SHARED_BYTES: usize = 112 * 1024;
    use super::emit_policy::{self, SEGMENT};
    use super::limits::{MMA_HEAD_DIMS, MMA_MAX_HEADS};
    use super::score_policy::{self, GROUP_TOKENS};

    /// Whether the mma score kernels serve `heads` heads of width `head_dim`.
    pub(super) fn mma_serves(heads: usize, head_dim: usize) -> bool {
        heads <= MMA_MAX_HEADS && MMA_HEAD_DIMS.contains(&head_dim)
    }

    /// Whether a kernel serves queries of `dtype` (FP8 keys count as bf16).
    pub(super) fn serves(dtype: DType, heads: usize, head_dim: usize) -> bool {
        match dtype {
            DType::BF16 => mma_serves(heads, head_dim),
            DType::F32 => true,
            _ => false,
        }
    }

    /// `TopKPath` as one word: 0 policy, 1 chain, 2 cluster.
    static TOP_K_PATH: AtomicUsize = AtomicUsize::new(0);

    pub(super) fn set_top_k_path(path: TopKPath) {
        let word = match path {
            TopKPath::Policy => 0,
            TopKPath::Chain => 1,
            TopKPath::Cluster => 2,
        };
        TOP_K_PATH.store(word, Ordering::Relaxed);
    }

    /// `ScoreKernel` as one word: 0 policy, 1 mma.sync, 2 per query, 3 grouped.
    static SCORE_KERNEL: AtomicUsize = AtomicUsize::new(0);

    pub(super) fn set_score_kernel(kernel: ScoreKernel) {
        let word = match kernel {
            ScoreKernel::Policy => 0,
            ScoreKernel::MmaSync => 1,
            ScoreKernel::PerQuery => 2,
            ScoreKernel::Grouped => 3,
        };
        SCORE_KERNEL.store(word, Ordering::Relaxed);
    }

    /// The cluster top-k's entry point with `e` scores per thread.
    fn cluster_kernel_name(e: usize) -> String {
        format!("dsa_topk_cluster_e{e}")
    }

    /// The cluster top-k's scores per thread for `tokens` rows of up to `positions`, where it takes them
    /// (the pin, else `top_k_policy::chosen`).
    fn cluster_scores_per_thread(
        dev: &CudaDevice,
        positions: usize,
        tokens: usize,
    ) -> candle_core::Result<Option<usize>> {
        Ok(match TOP_K_PATH.load(Ordering::Relaxed) {
            1 => None,
            2 => top_k_policy::scores_per_thread(positions),
            _ => match top_k_policy::scores_per_thread(positions) {
                Some(e) => {
                    let at_once = resident_clusters(
                        dev,
                        ("dsa_indexer", MODULE),
                        &cluster_kernel_name(e),
                        CLUSTER_THREADS as u32,
                        CLUSTER_SHARED_BYTES as u32,
                        Some(CLUSTER_BLOCKS),
                    )?[CLUSTER_BLOCKS];
                    top_k_policy::chosen(positions, tokens, at_once)
                }
                None => None,
            },
        })
    }

    /// Mirrors `DsaParams` in the .cu file.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Params {
        q: u64,
        weights: u64,
        keys: u64,
        key_scales: u64,
        block_table: u64,
        token_seq: u64,
        visible: u64,
        scores: u64,
        hist: u64,
        work: u64,
        indices: u64,
        t: i32,
        h: i32,
        d: i32,
        k: i32,
        block_size: i32,
        max_blocks: i32,
        batch: i32,
        score_stride: i32,
        positions: i32,
        segments: i32,
        cluster_topk: i32,
        key_map: TensorMap,
    }
    // SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
    unsafe impl DeviceRepr for Params {}

    /// A `CUtensorMap` (`TensorMap` in the .cu file): the driver's 128-byte, 64-byte aligned descriptor.
    #[repr(C, align(64))]
    #[derive(Clone, Copy, Default)]
    struct TensorMap([u64; 16]);

    /// Tensor maps already encoded on this thread, by (address, rows, width): a map is a pure function of
    /// the three (unified addressing makes addresses unique across devices), and a decode step asks for
    /// the same cache of every layer again. Cleared when it grows past `MAX_CACHED_MAPS`.
    const MAX_CACHED_MAPS: usize = 1024;
    thread_local! {
        static KEY_MAPS: RefCell<HashMap<(u64, usize, usize), TensorMap>> = RefCell::new(HashMap::new());
    }

    /// The FP8 key cache `[rows, dim]` as a TMA tensor (cached, see `KEY_MAPS`).
    fn fp8_key_map(keys: u64, rows: usize, dim: usize) -> candle_core::Result<TensorMap> {
        let key = (keys, rows, dim);
        if let Some(map) = KEY_MAPS.with(|cell| cell.borrow().get(&key).copied()) {
            return Ok(map);
        }
        let map = encode_fp8_key_map(keys, rows, dim)?;
        KEY_MAPS.with(|cell| {
            let mut maps = cell.borrow_mut();
            if maps.len() >= MAX_CACHED_MAPS {
                maps.clear();
            }
            maps.insert(key, map);
        });
        Ok(map)
    }

    /// The FP8 key cache `[rows, dim]` as a TMA tensor: boxes of `TILE_KEYS` rows, 128-byte swizzle (the
    /// layout `dsa_scores_fp8_tma_*` reads its fragments in).
    fn encode_fp8_key_map(keys: u64, rows: usize, dim: usize) -> candle_core::Result<TensorMap> {
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        let dims = [dim as u64, rows as u64];
        let strides = [dim as u64]; // bytes between rows (dimension 0 is implicitly contiguous)
        let boxes = [dim as u32, TILE_KEYS as u32];
        let element_strides = [1u32, 1];
        // SAFETY: every pointer argument points at a live local array of the rank the call is given.
        let result = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
                2,
                keys as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if result != sys::CUresult::CUDA_SUCCESS {
            candle_core::bail!(
                "dsa_indexer: cuTensorMapEncodeTiled failed for the FP8 key cache: {result:?}"
            );
        }
        Ok(TensorMap(map.opaque))
    }

    /// This thread's workspace on `dev`: scores `[chunk, stride]` f32, the per-row histograms and
    /// slots `[chunk, HIST_STRIDE]` i32, which must be zero when a call starts (allocated zeroed; the
    /// threshold kernel zeroes every row it reads), the top-k kernels' candidate (position, score)
    /// pairs and per-segment counts, offsets and masks `[chunk, 2 * stride + WORK_PER_SEGMENT * segments]`
    /// u32. Per thread because candle issues work on the per-thread default stream.
    fn workspace(
        dev: &CudaDevice,
        scores: usize,
        hist: usize,
        work: usize,
    ) -> candle_core::Result<[u64; 3]> {
        type Buffers = (CudaSlice<f32>, CudaSlice<i32>, CudaSlice<u32>);
        thread_local! {
            static WORKSPACE: RefCell<HashMap<DeviceId, Buffers>> = RefCell::new(HashMap::new());
        }
        WORKSPACE.with(|cell| {
            let mut map = cell.borrow_mut();
            let stream = dev.cuda_stream();
            let fits = map
                .get(&dev.id())
                .is_some_and(|(s, h, w)| s.len() >= scores && h.len() >= hist && w.len() >= work);
            if !fits {
                // SAFETY: every score and work word the kernels read is written by the same call first.
                let fresh_scores = unsafe { dev.alloc::<f32>(scores.next_power_of_two()) }?;
                let fresh_hist = stream
                    .alloc_zeros::<i32>(hist.next_power_of_two())
                    .map_err(cuda_err)?;
                let fresh_work = unsafe { dev.alloc::<u32>(work.next_power_of_two()) }?;
                map.insert(dev.id(), (fresh_scores, fresh_hist, fresh_work));
            }
            let (s, h, w) = map
                .get(&dev.id())
                .ok_or_else(|| cuda_err("dsa_indexer workspace missing"))?;
            let pointers = [
                s.device_ptr(&stream).0,
                h.device_ptr(&stream).0,
                w.device_ptr(&stream).0,
            ];
            Ok(pointers)
        })
    }

    thread_local! {
        /// Set inside `time_stages`: per launched chunk, events before the scores, between the stages and
        /// after the top-k.
        static STAGE_EVENTS: RefCell<Option<Vec<[CudaEvent; 3]>>> = const { RefCell::new(None) };
    }

    /// An event on `stream` when `time_stages` is recording on this thread.
    fn stage_event(stream: &CudaStream) -> candle_core::Result<Option<CudaEvent>> {
        let recording = STAGE_EVENTS.with(|cell| cell.borrow().is_some());
        if !recording {
            return Ok(None);
        }
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Some(stream.record_event(timing).map_err(cuda_err)?))
    }

    pub(super) fn time_stages<R>(f: impl FnOnce() -> R) -> Result<(R, super::StageTimes)> {
        STAGE_EVENTS.with(|cell| *cell.borrow_mut() = Some(Vec::new()));
        let result = f();
        let events = STAGE_EVENTS
            .with(|cell| cell.borrow_mut().take())
            .unwrap_or_default();
        let mut times = super::StageTimes::default();
        let elapsed = |from: &CudaEvent, to: &CudaEvent| -> Result<std::time::Duration> {
            let ms = from.elapsed_ms(to).map_err(cuda_err)?;
            Ok(std::time::Duration::from_secs_f64(
                f64::from(ms.max(0.0)) / 1e3,
            ))
        };
        for [start, between, end] in &events {
            times.scores += elapsed(start, between)?;
            times.top_k += elapsed(between, end)?;
        }
        Ok((result, times))
    }

    /// Runs the score and top-k kernels; the index tensor is the op's output, the inputs ride along in it.
    struct Indexer {
        q: Tensor,
        weights: Tensor,
        keys: Tensor,
        scales: Option<Tensor>,
        block_table: Tensor,
        token_seq: Tensor,
        visible: Tensor,
        positions: usize,
        top_k: usize,
        fp8: bool,
    }

    impl Indexer {
        fn launch(&self, dev: &CudaDevice) -> candle_core::Result<CudaStorage> {
            let stream = dev.cuda_stream();
            let (t_len, heads, dim) = self.q.dims3()?;
            let (num_blocks, block_size, _) = self.keys.dims3()?;
            let (batch, max_blocks) = self.block_table.dims2()?;
            let indices = unsafe { dev.alloc::<i32>(t_len * self.top_k) }?;
            let indices_ptr = indices.device_ptr(&stream).0;
            let positions = self.positions.max(1);
            let segments = positions.div_ceil(SEGMENT);
            // Score rows start 16-byte aligned (the top-k kernels read them as float4).
            let stride = positions.next_multiple_of(4);
            let chunk = (MAX_CHUNK_ELEMS / stride).clamp(1, t_len.max(1));
            let work_stride = 2 * stride + WORK_PER_SEGMENT * segments;
            let [scores_ptr, hist_ptr, work_ptr] = workspace(
                dev,
                chunk * stride,
                chunk * HIST_STRIDE,
                chunk * work_stride,
            )?;
            let q_elem = self.q.dtype().size_in_bytes();
            let key_scales = match &self.scales {
                Some(s) => device_address(s)?.0,
                None => 0,
            };
            let keys = device_address(&self.keys)?.0;
            if keys % 16 != 0 || key_scales % 16 != 0 {
                candle_core::bail!("dsa_indexer: the key cache must start 16-byte aligned");
            }
            // GLM-5's cache (FP8 rows of 128 in pages of 64): whole-tile copies by TMA.
            let tma = self.fp8 && dim == 128 && block_size % TILE_KEYS == 0;
            let name = match (self.fp8, self.q.dtype()) {
                (false, DType::F32) => "dsa_scores_f32".to_string(),
                (true, _) if tma => format!("dsa_scores_fp8_tma_d128_mt{}", heads.div_ceil(16)),
                (fp8, _) => format!(
                    "dsa_scores_{}_d{dim}_mt{}",
                    if fp8 { "fp8" } else { "bf16" },
                    heads.div_ceil(16)
                ),
            };
            // On Hopper, 17 to 32 heads (GLM-5's 32): the same TMA kernel by warpgroup MMA (unless pinned), and
            // for a prefill chunk of one sequence (a block table of one row: the grouped kernel's promise) the
            // grouped kernel, four queries a block, where `score_policy` takes it.
            let pin = SCORE_KERNEL.load(Ordering::Relaxed);
            let wgmma = tma
                && heads.div_ceil(16) == 2
                && pin != 1
                && device_info(dev)?.capability == (9, 0);
            const GROUPED_NAME: &str = "dsa_scores_fp8_wgmma_g4_d128";
            let grouped = wgmma
                && batch == 1
                && (pin == 3
                    || pin == 0 && {
                        let resident = resident_blocks(
                            dev,
                            "dsa_indexer_sm90",
                            MODULE_SM90,
                            GROUPED_NAME,
                            SCORE_THREADS,
                            GROUP_SHARED_BYTES as u32,
                        )?;
                        score_policy::groups_queries(chunk, positions.div_ceil(TILE_KEYS), resident)
                    });
            let (score_module, name) = if grouped {
                (("dsa_indexer_sm90", MODULE_SM90), GROUPED_NAME.to_string())
            } else if wgmma {
                (
                    ("dsa_indexer_sm90", MODULE_SM90),
                    "dsa_scores_fp8_wgmma_d128_mt2".to_string(),
                )
            } else {
                (("dsa_indexer", MODULE), name)
            };
            let group_smem = if grouped { GROUP_SHARED_BYTES } else { 0 };
            let scores_fn = kernel(dev, score_module.0, score_module.1, &name)?;
            let [candidates_fn, threshold_fn, emit_fn, emit_block_fn] = [
                "dsa_topk_candidates",
                "dsa_topk_threshold",
                "dsa_topk_emit",
                "dsa_topk_emit_block",
            ]
            .map(|name| kernel(dev, "dsa_indexer", MODULE, name));
            let (candidates_fn, threshold_fn, emit_fn, emit_block_fn) =
                (candidates_fn?, threshold_fn?, emit_fn?, emit_block_fn?);
            let emit_resident = resident_blocks(
                dev,
                "dsa_indexer",
                MODULE,
                "dsa_topk_emit",
                SEGMENT_THREADS,
                0,
            )?;
            let cluster_fn = cluster_scores_per_thread(dev, positions, chunk)?
                .map(|e| kernel(dev, "dsa_indexer", MODULE, &cluster_kernel_name(e)))
                .transpose()?;
            let f32_scores = self.q.dtype() == DType::F32 && !self.fp8;
            // mma score blocks stream a strided share of a row's tiles: as many blocks as the SMs hold.
            let resident = if f32_scores {
                0
            } else {
                resident_blocks(
                    dev,
                    score_module.0,
                    score_module.1,
                    &name,
                    SCORE_THREADS,
                    group_smem as u32,
                )?
            };
            let (q, weights, block_table, token_seq, visible) = (
                device_address(&self.q)?.0,
                device_address(&self.weights)?.0,
                device_address(&self.block_table)?.0,
                device_address(&self.token_seq)?.0,
                device_address(&self.visible)?.0,
            );
            if !f32_scores && q % 16 != 0 {
                // The mma score kernels copy Q in 16-byte pieces (TMA: one bulk copy per token).
                candle_core::bail!("dsa_indexer: q must start 16-byte aligned");
            }
            let key_map = if tma {
                fp8_key_map(keys, num_blocks * block_size, dim)?
            } else {
                TensorMap::default()
            };
            for start in (0..t_len).step_by(chunk) {
                let len = chunk.min(t_len - start);
                let params = Params {
                    q: q + (start * heads * dim * q_elem) as u64,
                    weights: weights + (start * heads * 4) as u64,
                    keys,
                    key_scales,
                    block_table,
                    token_seq: token_seq + (start * 4) as u64,
                    visible: visible + (start * 4) as u64,
                    scores: scores_ptr,
                    hist: hist_ptr,
                    work: work_ptr,
                    indices: indices_ptr + (start * self.top_k * 4) as u64,
                    t: len as i32,
                    h: heads as i32,
                    d: dim as i32,
                    k: self.top_k as i32,
                    block_size: block_size as i32,
                    max_blocks: max_blocks as i32,
                    batch: batch as i32,
                    score_stride: stride as i32,
                    positions: positions as i32,
                    segments: segments as i32,
                    cluster_topk: cluster_fn.is_some() as i32,
                    key_map,
                };
                let tiles = positions.div_ceil(TILE_KEYS);
                // Score blocks per row, and the rows along x: queries, or groups of queries.
                let rows = if grouped {
                    len.div_ceil(GROUP_TOKENS)
                } else {
                    len
                };
                let (score_blocks, score_smem) = if f32_scores {
                    (tiles, (heads * dim + heads) * 4)
                } else {
                    // Whole waves: rounding the blocks per token up would leave a second, nearly empty wave
                    // (64 tokens on 528 slots: 9 each = 576 blocks, the last 48 running alone). At least two
                    // tiles per block: every block copies and converts the token's Q, which one-tile blocks
                    // (32K, batch 1) would pay for a single tile (measured when a Q-preparing kernel came
                    // first: 17.2 µs against 15.7 with two).
                    (tiles.div_ceil(2).min(resident / rows).max(1), group_smem)
                };
                let config = |(x, y): (usize, usize), threads: u32, shared: usize| LaunchConfig {
                    grid_dim: (x as u32, y as u32, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: shared as u32,
                };
                let before_scores = stage_event(&stream)?;
                // The mma kernels: tokens along x, a row's blocks along y (see the kernel); the f32 kernel's one
                // block per tile: tiles along x (a row's 65,536 at the most visible keys exceed y's limit).
                let grid = if f32_scores {
                    (score_blocks, len)
                } else {
                    (rows, score_blocks)
                };
                let score_config = config(grid, SCORE_THREADS, score_smem);
                let mut builder = stream.launch_builder(&scores_fn);
                builder.arg(&params);
                // SAFETY: `params` mirrors DsaParams; every pointer in it is live for this call.
                unsafe { builder.launch(score_config) }.map_err(cuda_err)?;
                let after_scores = stage_event(&stream)?;
                // The top-k kernels start before their predecessor finishes (the cluster top-k as the score
                // kernel starts: `cluster_topk`) and wait for its writes.
                if let Some(cluster_fn) = &cluster_fn {
                    let cfg = config(
                        (CLUSTER_BLOCKS, len),
                        CLUSTER_THREADS as u32,
                        CLUSTER_SHARED_BYTES,
                    );
                    // SAFETY: as above (the kernel's cluster shape is fixed at compile time).
                    unsafe { launch_dependent(cluster_fn, &stream, cfg, &params) }?;
                } else {
                    // The emit's segments: a row's output slots (K) or its positions, whichever is more.
                    let emit_segments = positions.max(self.top_k).div_ceil(SEGMENT);
                    let (emit, emit_blocks) =
                        if emit_policy::by_blocks(len, positions, self.top_k, emit_resident) {
                            (&emit_block_fn, emit_segments)
                        } else {
                            (&emit_fn, emit_segments.div_ceil(emit_policy::EMIT_SEGMENTS))
                        };
                    let chain = [
                        (&candidates_fn, config((segments, len), SEGMENT_THREADS, 0)),
                        (
                            &threshold_fn,
                            config((len, 1), TOPK_THREADS, THRESHOLD_STAGE_BYTES),
                        ),
                        (emit, config((emit_blocks, len), SEGMENT_THREADS, 0)),
                    ];
                    for (function, cfg) in chain {
                        // SAFETY: as above; each top-k kernel takes one DsaParams.
                        unsafe { launch_dependent(function, &stream, cfg, &params) }?;
                    }
                }
                if let (Some(start), Some(between), Some(end)) =
                    (before_scores, after_scores, stage_event(&stream)?)
                {
                    STAGE_EVENTS.with(|cell| {
                        if let Some(events) = cell.borrow_mut().as_mut() {
                            events.push([start, between, end]);
                        }
                    });
                }
            }
            Ok(CudaStorage::wrap_cuda_slice(indices, dev.clone()))
        }
    }

    impl CustomOp1 for Indexer {
        fn name(&self) -> &'static str {
            "dsa_indexer"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("dsa_indexer: the CUDA op got CPU tensors")
        }

        fn cuda_fwd(
            &self,
            storage: &CudaStorage,
            _: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let t_len = self.q.dim(0)?;
            Ok((
                self.launch(storage.device())?,
                Shape::from((t_len, self.top_k)),
            ))
        }
    }

    pub(super) fn dsa_indexer_paged(
        q_index: &Tensor,
        head_weights: &Tensor,
        cache: &PagedIndexKeys,
        visible_keys: &[usize],
        top_k: usize,
    ) -> Result<Tensor> {
        let positions = visible_keys.iter().copied().max().unwrap_or(0);
        let visible: Vec<i32> = visible_keys.iter().map(|&v| v as i32).collect();
        let visible = Tensor::from_vec(visible, visible_keys.len(), q_index.device())?;
        dsa_indexer_paged_visible(q_index, head_weights, cache, &visible, positions, top_k)
    }

    /// The kernels over counts on the device, `positions` bounding them (the kernels clamp to it).
    pub(super) fn dsa_indexer_paged_visible(
        q_index: &Tensor,
        head_weights: &Tensor,
        cache: &PagedIndexKeys,
        visible: &Tensor,
        positions: usize,
        top_k: usize,
    ) -> Result<Tensor> {
        if positions > super::limits::CUDA_MAX_VISIBLE_KEYS {
            return Err(OpError::Unsupported(format!(
                "dsa_indexer: the CUDA kernels serve at most {} visible keys per query, got {positions}",
                super::limits::CUDA_MAX_VISIBLE_KEYS
            )));
        }
        let (fp8, keys, scales) = match cache.keys {
            IndexKeys::Float(keys) => (false, keys.contiguous()?, None),
            IndexKeys::Fp8 { bytes, scales } => {
                (true, bytes.contiguous()?, Some(scales.contiguous()?))
            }
        };
        // FP8 keys are scored by the bf16 mma kernel.
        let q = if fp8 {
            q_index.to_dtype(DType::BF16)?
        } else {
            q_index.clone()
        };
        let op = Indexer {
            q: q.contiguous()?,
            weights: head_weights.to_dtype(DType::F32)?.contiguous()?,
            keys,
            scales,
            block_table: cache.block_table.contiguous()?,
            token_seq: cache.token_seq.contiguous()?,
            visible: visible.contiguous()?,
            positions,
            top_k,
            fp8,
        };
        Ok(op.q.apply_op1_no_bwd(&op)?)
    }

    /// FP8 quantisation of `[n, dim]` float keys on the GPU (contract in `index_keys`).
    pub(super) fn quantize_fp8(keys: &Tensor, n: usize, dim: usize) -> Result<(Tensor, Tensor)> {
        let device = keys.device();
        let keys = match keys.dtype() {
            DType::BF16 | DType::F32 => keys.contiguous()?,
            _ => keys.to_dtype(DType::F32)?.contiguous()?,
        };
        let bytes = Tensor::zeros((n, dim), DType::U8, device)?;
        let scales = Tensor::zeros(n, DType::F32, device)?;
        let (rows, dev) = device_address(&keys)?;
        let (bytes_ptr, _) = device_address(&bytes)?;
        let (scales_ptr, _) = device_address(&scales)?;
        let name = if keys.dtype() == DType::BF16 {
            "dsa_quantize_fp8_bf16"
        } else {
            "dsa_quantize_fp8_f32"
        };
        let func = kernel(&dev, "dsa_indexer", MODULE, name)?;
        let stream = dev.cuda_stream();
        let rows_per_block = 8usize;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(rows_per_block).max(1) as u32, 1, 1),
            block_dim: ((rows_per_block * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_arg, dim_arg) = (n as i32, dim as i32);
        let mut builder = stream.launch_builder(&func);
        builder
            .arg(&rows)
            .arg(&bytes_ptr)
            .arg(&scales_ptr)
            .arg(&n_arg)
            .arg(&dim_arg);
        unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
        Ok((bytes, scales))
    }
}
