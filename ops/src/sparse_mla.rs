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

/// A paged latent cache: rows live in fixed-size blocks, and each sequence's block table maps its logical
/// positions to them (`row(seq, i) = blocks[block_table[seq, i / block_size], i % block_size]`).
pub struct PagedLatentCache<'a> {
    /// `[num_blocks, block_size, D]`.
    pub blocks: &'a Tensor,
    /// `I32 [B, max_blocks]`: the blocks of each sequence, in order.
    pub block_table: &'a Tensor,
    /// `I32 [B]`: tokens cached per sequence; positions at or beyond it are "no row".
    pub seq_lens: &'a Tensor,
    /// `I32 [T]`: the sequence of each query token.
    pub token_seq: &'a Tensor,
}

/// The bf16 CUDA kernel a call runs (f32 inputs always run the FMA kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// Warpgroup MMA where it serves the call, mma.sync otherwise.
    Fastest,
    /// `mma.sync` (sm_90 and sm_120): every shape the bf16 path takes.
    MmaSync,
    /// Warpgroup MMA (`wgmma`, sm_90 only): heads a multiple of 64, rows of 576 with 512 value columns
    /// (GLM-5's). Anything else is an [`OpError::Unsupported`] naming the cause.
    Wgmma,
}

/// Attention of every head over the selected latent rows: `(out, lse)` (contract in the module docs).
///
/// On a CUDA device with bf16 or f32 inputs this runs glm5's fastest kernel for the call (the cache as one
/// block of `N` rows); there, indices outside `-1..N` are not reported but read as "no row" (validating
/// them would cost a device-to-host copy per call).
pub fn sparse_mla(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if cuda::serves(q) {
        return contiguous_on_cuda(
            q,
            latent_cache,
            indices,
            value_dim,
            softmax_scale,
            Bf16Kernel::Fastest,
        );
    }
    sparse_mla_reference(q, latent_cache, indices, value_dim, softmax_scale)
}

/// glm5's mma.sync (bf16) and FMA (f32) CUDA kernels over contiguous rows (the cache as one block of `N`
/// rows): the function of the registry's `cuda-bf16-mma` and `cuda-f32-fma` entries. Without the `cuda`
/// feature it fails with [`OpError::Unsupported`].
pub fn sparse_mla_cuda(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    contiguous_on_cuda(
        q,
        latent_cache,
        indices,
        value_dim,
        softmax_scale,
        Bf16Kernel::MmaSync,
    )
}

/// glm5's warpgroup-MMA kernel (sm_90) over contiguous rows: the function of the registry's
/// `cuda-bf16-wgmma` entry (see [`Bf16Kernel::Wgmma`] for what it serves).
pub fn sparse_mla_cuda_wgmma(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    contiguous_on_cuda(
        q,
        latent_cache,
        indices,
        value_dim,
        softmax_scale,
        Bf16Kernel::Wgmma,
    )
}

/// The CUDA kernels over contiguous rows: the cache as one block of `N` rows.
fn contiguous_on_cuda(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
    kernel: Bf16Kernel,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        let [t_len, _, row_dim] = check_shape("q", q, [("T", None), ("H", None), ("D", None)])?;
        let [cache_len, _] = check_shape(
            "latent_cache",
            latent_cache,
            [("N", None), ("D", Some(row_dim))],
        )?;
        let device = q.device();
        let blocks = latent_cache.reshape((1, cache_len, row_dim))?;
        let block_table = Tensor::zeros((1, 1), DType::I32, device)?;
        let seq_lens = Tensor::new(&[cache_len as i32], device)?;
        let token_seq = Tensor::zeros(t_len, DType::I32, device)?;
        let cache = PagedLatentCache {
            blocks: &blocks,
            block_table: &block_table,
            seq_lens: &seq_lens,
            token_seq: &token_seq,
        };
        cuda::sparse_mla_paged(q, &cache, indices, value_dim, softmax_scale, kernel)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, latent_cache, indices, value_dim, softmax_scale, kernel);
        Err(OpError::Unsupported(
            "sparse_mla CUDA kernels: this glm5 was built without the cuda feature".into(),
        ))
    }
}

/// [`sparse_mla`] over a paged cache: `indices[t]` are logical positions of sequence `token_seq[t]`.
pub fn sparse_mla_paged(
    q: &Tensor,
    cache: &PagedLatentCache,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    sparse_mla_paged_with(
        q,
        cache,
        indices,
        value_dim,
        softmax_scale,
        Bf16Kernel::Fastest,
    )
}

/// [`sparse_mla_paged`] with the bf16 CUDA kernel chosen by the caller (benchmarks, tests, a forced
/// backend); on other devices and dtypes `kernel` is ignored.
pub fn sparse_mla_paged_with(
    q: &Tensor,
    cache: &PagedLatentCache,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
    kernel: Bf16Kernel,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if cuda::serves(q) {
        return cuda::sparse_mla_paged(q, cache, indices, value_dim, softmax_scale, kernel);
    }
    // `kernel` only concerns the CUDA path.
    let _ = kernel;

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

/// The limits of `kernels/src/sparse_mla.cu`, compiled with or without the `cuda` feature: the launcher
/// obeys them and the registry validates against them (so a plan for an assumed GPU knows them too).
pub(crate) mod limits {
    /// Keys per tile of the bf16 kernel (`BN` in the .cu file).
    pub const TILE: usize = 32;
    pub const ROW_PAD: usize = 8;
    /// Most splits the combine kernel merges (`MAX_SPLITS` in the .cu file).
    pub const MAX_SPLITS: usize = 128;
    /// Tiles per split the registry's shared-memory check assumes; the launcher sizes the kernel's row table
    /// for each launch and goes beyond this (one split per query) where the device's shared memory allows.
    pub const MAX_TILES_PER_SPLIT: usize = 32;
    /// Value widths the bf16 kernel is instantiated for.
    pub const BF16_VALUE_DIMS: [usize; 6] = [16, 32, 64, 128, 256, 512];
    /// Row width the bf16 kernel holds beyond the value columns (`MAX_ROPE` in the .cu file).
    pub const MAX_ROPE: usize = 64;
    /// f32 stride of a partial-score row (`LDS` in the .cu file).
    pub const PARTIAL_SCORE_STRIDE: usize = TILE + 8;
    /// Latent row widths must be a multiple of this (16-byte loads).
    pub const ROW_MULTIPLE: usize = 8;
    /// Most top-k slots per query of the bf16 kernel.
    pub const BF16_MAX_TOP_K: usize = MAX_SPLITS * MAX_TILES_PER_SPLIT * TILE;

    /// Warps per 16-head tile of the bf16 kernel for a value width (`KW` of its entry points).
    pub fn warps_per_head_tile(value_dim: usize) -> usize {
        if value_dim == 16 {
            2
        } else {
            4
        }
    }

    /// Shared memory of the bf16 kernel with `head_tiles` tiles of 16 heads and rows of `row_dim` (mirrors the
    /// layout in the .cu file: two key tiles, Q unless it is staged in key tile 1, P, partial scores, row
    /// maxima and sums, the split's rows). GLM-5's rows with 16 heads and 32 tiles per split: 90880 B, within
    /// sm_120's 99 KB.
    pub fn bf16_shared_bytes(
        head_tiles: usize,
        warps_per_tile: usize,
        row_dim: usize,
        tiles_per_split: usize,
    ) -> usize {
        let ld = row_dim.div_ceil(16) * 16 + ROW_PAD;
        let heads = 16 * head_tiles;
        // Q has its own region only when it does not fit in key buffer 1 (more than TILE heads).
        let q_rows = if heads <= TILE { 0 } else { heads };
        (2 * TILE * ld + q_rows * ld + heads * (TILE + ROW_PAD)) * 2
            + head_tiles * warps_per_tile * 16 * (PARTIAL_SCORE_STRIDE + 2) * 4
            + tiles_per_split * TILE * 4
    }

    /// The wgmma kernel (`sparse_mla_sm90.cu`): heads per block, its row and value widths.
    pub const WGMMA_HEADS: usize = 64;
    pub const WGMMA_ROW_DIM: usize = 576;
    pub const WGMMA_VALUE_DIM: usize = 512;

    /// Key tiles in the wgmma kernel's ring (`STAGES` in the .cu file).
    pub const WGMMA_STAGES: usize = 5;

    /// Shared memory of the wgmma kernel (mirrors the .cu file): a ring of `WGMMA_STAGES` key tiles in
    /// 128-byte rows (Q is staged in two of them before it moves to registers), the S exchange of two
    /// warpgroups (16 f32 per thread), two tiles' P (64 x 32 bf16 each), the split's row table and tile masks,
    /// and 1 KB to align the start to the swizzle period. With 32 tiles per split: 214144 B (sm_90's opt-in
    /// limit: 232448).
    pub fn wgmma_shared_bytes(tiles_per_split: usize) -> usize {
        1024 + WGMMA_ROW_DIM * 2 * WGMMA_STAGES * TILE
            + 2 * 128 * 16 * 4
            + 2 * WGMMA_HEADS * TILE * 2
            + tiles_per_split * (TILE + 1) * 4
    }

    /// The narrow kernel (at most 8 heads, keys as the mma's rows): heads per block, keys per warp, the row
    /// and value widths it is instantiated for (GLM-5's), its warps per block and shared memory.
    #[cfg(any(feature = "cuda", test))]
    pub mod narrow {
        pub const NARROW_KEYS: usize = 16;
        pub const NARROW_WARPS: [usize; 3] = [8, 4, 2];
        #[cfg(feature = "cuda")]
        pub const NARROW_HEADS: usize = 8;
        #[cfg(feature = "cuda")]
        pub const NARROW_ROW_DIM: usize = 576;
        #[cfg(feature = "cuda")]
        pub const NARROW_VALUE_DIM: usize = 512;

        /// Shared memory with `warps` warps (mirrors the .cu file): each warp's 16 rows, Q's 8 rows, each
        /// warp's P^T fragments (32 lanes x 8 bytes) and its tile's head maxima and sums. 8 warps: 161408 B
        /// (one block per SM on the H200; sm_120's 99 KB take 4 warps).
        #[cfg(feature = "cuda")]
        pub fn narrow_shared_bytes(warps: usize) -> usize {
            let ld = NARROW_ROW_DIM.div_ceil(16) * 16 + super::ROW_PAD;
            (warps * NARROW_KEYS + NARROW_HEADS) * ld * 2
                + warps * 32 * 8
                + 2 * warps * NARROW_HEADS * 4
        }
    }

    /// Shared memory of the f32 kernel: the query row, value accumulators and reduction scratch.
    pub fn f32_shared_bytes(row_dim: usize, value_dim: usize) -> usize {
        (row_dim + 4 * value_dim + 8) * 4
    }
}

/// How the bf16 launchers divide each token's top-k among blocks and merge the parts (pure, so it is
/// tested without a GPU).
#[cfg(any(feature = "cuda", test))]
pub(crate) mod split_policy {
    use super::limits::{MAX_SPLITS, MAX_TILES_PER_SPLIT};

    /// Most splits merged in a thread-block cluster. On the H200 clusters of 2 merge faster than the
    /// combine kernel (B128/H16 102 -> 93 µs), of 4 as fast, of 16 2.5-3.5 µs slower, even as a first
    /// level before the combine (docs/perf.md, session 9).
    pub const MAX_MERGE_CLUSTER: usize = 4;

    /// Flash-decoding: split the top-k of `tiles` tiles when `blocks` blocks alone would leave SMs idle.
    /// The split minimises waves x (tiles per block + a block's fixed cost in tiles: Q, index and
    /// block-table loads, the epilogue) -- a last, partly filled wave costs a whole one -- preferring fewer
    /// splits (less to combine; one split needs no combine at all). `resident`: blocks the device runs at
    /// once. A block resolves its split's rows up front, so `fits(tiles per split)` says whether its row
    /// table fits in shared memory.
    pub fn tiles_per_split(
        tiles: usize,
        blocks: usize,
        resident: usize,
        block_cost: usize,
        fits: impl Fn(usize) -> bool,
    ) -> usize {
        (1..=tiles.min(MAX_SPLITS))
            .map(|splits| tiles.div_ceil(splits))
            .filter(|&per| fits(per))
            .min_by_key(|&per| {
                (blocks * tiles.div_ceil(per)).div_ceil(resident) * (per + block_cost)
            })
            .unwrap_or(MAX_TILES_PER_SPLIT)
    }

    /// Warps per block of the narrow kernel for `tokens` queries of `top_k` slots, or `None` where its grid
    /// (one split of 16 x warps keys per block, every row copied at once) would take more than one wave or
    /// more splits than the combine merges. `resident(warps)`: blocks of that size the device holds at once
    /// (0 where one does not fit). Of the sizes that fit, the one leaving the fewest keys on the busiest of
    /// the `sms` SMs (its copies are the block's time), then the fewest splits to merge, then the smallest.
    pub fn narrow_warps(
        tokens: usize,
        top_k: usize,
        sms: usize,
        resident: impl Fn(usize) -> usize,
    ) -> Option<usize> {
        use super::limits::narrow::{NARROW_KEYS, NARROW_WARPS};
        NARROW_WARPS
            .iter()
            .filter_map(|&warps| {
                let keys = NARROW_KEYS * warps;
                let splits = top_k.div_ceil(keys).max(1);
                let blocks = tokens * splits;
                (splits <= MAX_SPLITS && blocks <= resident(warps)).then(|| {
                    let busiest = blocks.div_ceil(sms) * keys.min(top_k);
                    (busiest, splits, warps)
                })
            })
            .min()
            .map(|(_, _, warps)| warps)
    }

    /// Whether a token's `splits` splits are few enough to merge in one thread-block cluster.
    pub fn cluster_may_merge(splits: usize) -> bool {
        (2..=MAX_MERGE_CLUSTER).contains(&splits)
    }

    /// Whether `blocks` clusters of `splits` blocks, `at_once` of which the device runs together, take no
    /// more waves than the same blocks launched alone (`resident` at once).
    pub fn cluster_keeps_waves(
        splits: usize,
        blocks: usize,
        resident: usize,
        at_once: usize,
    ) -> bool {
        at_once > 0 && blocks.div_ceil(at_once) <= (blocks * splits).div_ceil(resident)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// GLM-5's top-k 2048 = 64 tiles of 32 keys, 2 blocks per SM of the H200's 132, a block's fixed
        /// cost of 2 tiles, every split size fitting.
        fn glm5_split(blocks: usize) -> usize {
            tiles_per_split(64, blocks, 264, 2, |_| true)
        }

        #[test]
        fn small_batches_split_until_the_device_is_full() {
            // Batch 1: 64 one-tile blocks (1 + 2 tiles' time) beat 32 two-tile ones (2 + 2).
            assert_eq!(glm5_split(1), 1);
            // Batch 8: 32 splits = 256 blocks, one wave of two-tile blocks; 64 splits would need two waves.
            assert_eq!(glm5_split(8), 2);
            // Batch 64: 4 splits = 256 blocks of 16 tiles; 2 splits (128 blocks of 32) cost 34 > 18.
            assert_eq!(glm5_split(64), 16);
            // Batch 128: 2 splits = 256 blocks, one wave of 32 tiles (34) against one split's 66.
            assert_eq!(glm5_split(128), 32);
            // Batch 512: one split, two waves of 66 (132), against 2 splits' four waves of 34 (136).
            assert_eq!(glm5_split(512), 64);
        }

        #[test]
        fn split_size_respects_the_row_table() {
            // A row table of at most 8 tiles: batch 128 takes 8 splits of 8 tiles instead of 2 of 32.
            assert_eq!(tiles_per_split(64, 128, 264, 2, |per| per <= 8), 8);
            // Nothing fits: the largest split the registry assumes.
            assert_eq!(
                tiles_per_split(64, 1, 264, 2, |_| false),
                MAX_TILES_PER_SPLIT
            );
        }

        /// The H200: 132 SMs holding 1, 2 or 4 narrow blocks of 8, 4 or 2 warps each.
        fn h200_narrow(tokens: usize, top_k: usize) -> Option<usize> {
            narrow_warps(tokens, top_k, 132, |warps| 132 * 8 / warps)
        }

        #[test]
        fn narrow_blocks_fill_the_device_in_one_wave() {
            // Batch 8, top-k 2048: every size puts 128 keys on the busiest SM; 8 warps have the fewest splits.
            assert_eq!(h200_narrow(8, 2048), Some(8));
            // Batch 1: 64 blocks of 32 keys spread the rows over the most SMs.
            assert_eq!(h200_narrow(1, 2048), Some(2));
            // Batch 3: 96 blocks of 64 keys, as few on the busiest SM as 192 of 32 and half the splits.
            assert_eq!(h200_narrow(3, 2048), Some(4));
            // A short top-k: one split, no combine.
            assert_eq!(h200_narrow(8, 7), Some(2));
            // Batch 64 would take several waves; 24,576 slots more splits than the combine merges.
            assert_eq!(h200_narrow(64, 2048), None);
            assert_eq!(h200_narrow(1, 24576), None);
            // A size that does not fit the device is never picked.
            assert_eq!(
                narrow_warps(8, 2048, 132, |w| if w == 8 { 0 } else { 132 * 8 / w }),
                Some(4)
            );
        }

        #[test]
        fn clusters_merge_a_few_splits_without_adding_waves() {
            assert!(!cluster_may_merge(1));
            assert!(cluster_may_merge(2) && cluster_may_merge(MAX_MERGE_CLUSTER));
            assert!(!cluster_may_merge(MAX_MERGE_CLUSTER + 1));
            // 128 tokens x 2 splits: 256 blocks are one wave of 264; 132 clusters of 2 at once keep it one.
            assert!(cluster_keeps_waves(2, 128, 264, 132));
            // ... 60 clusters at once would take three waves.
            assert!(!cluster_keeps_waves(2, 128, 264, 60));
            // A size the device cannot form.
            assert!(!cluster_keeps_waves(2, 128, 264, 0));
        }
    }
}

/// Why a kernel that needs `needed` bytes of shared memory per block (described by `needs`) cannot run on
/// `device`; nothing on a CPU (the device match already rules a kernel out there).
fn shared_memory_reason(
    device: &crate::DeviceDesc,
    needed: usize,
    needs: String,
) -> Option<crate::registry::Reason> {
    match device.kind {
        crate::device::DeviceKind::Cuda {
            shared_memory_per_block,
            ..
        } if needed > shared_memory_per_block => Some(crate::registry::Reason::new(
            "shared memory per block",
            needs,
            format!("{shared_memory_per_block} B"),
        )),
        _ => None,
    }
}

/// sparse_mla's backends in the registry (`registry.rs`): glm5's bf16 tensor-core kernel and f32 kernel
/// (fatbin with SASS for sm_90 and sm_120 and compute_120 PTX: cc 9.0 and 12.x) and the candle-ops reference
/// (any device, slow).
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
            description: "glm5 CUDA kernel, bf16 mma.sync, top-k split with an lse combine",
            kernel: Kernel::SparseMla(sparse_mla_cuda),
            serves: Serves {
                devices: kernel_archs.clone(),
                dtypes: vec![DType::BF16],
                heads: Limit::Any,
                head_dims: Limit::MultipleOf(limits::ROW_MULTIPLE),
                value_dims: Limit::OneOf(limits::BF16_VALUE_DIMS.to_vec()),
                top_k: Limit::Range {
                    min: 1,
                    max: limits::BF16_MAX_TOP_K,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![crate::KeyFormat::Float],
            },
            extra_check: Some(|spec, device| {
                if device.is_cpu() {
                    return vec![]; // the device match already rejects it
                }
                let value_dim = spec.value_dim.unwrap_or(0);
                let mut reasons = vec![];
                if spec.head_dim > value_dim + limits::MAX_ROPE {
                    reasons.push(crate::registry::Reason::new(
                        "row width",
                        format!("≤ value width + {}", limits::MAX_ROPE),
                        format!("{} (value width {value_dim})", spec.head_dim),
                    ));
                }
                let needed = limits::bf16_shared_bytes(
                    1,
                    limits::warps_per_head_tile(value_dim),
                    spec.head_dim,
                    limits::MAX_TILES_PER_SPLIT,
                );
                reasons.extend(shared_memory_reason(
                    device,
                    needed,
                    format!("{needed} B for rows of {}", spec.head_dim),
                ));
                reasons
            }),
            priority: vec![(Sm120, 10), (Sm90, 10)],
        },
        Entry {
            name: "cuda-bf16-wgmma",
            description: "glm5 CUDA kernel, bf16 warpgroup MMA (Hopper only), 64-head groups over rows of 512 + 64",
            kernel: Kernel::SparseMla(sparse_mla_cuda_wgmma),
            serves: Serves {
                devices: DeviceMatch::Cuda(vec![Arch {
                    major: 9,
                    minor: Some(0),
                }]),
                dtypes: vec![DType::BF16],
                heads: Limit::MultipleOf(limits::WGMMA_HEADS),
                head_dims: Limit::OneOf(vec![limits::WGMMA_ROW_DIM]),
                value_dims: Limit::OneOf(vec![limits::WGMMA_VALUE_DIM]),
                top_k: Limit::Range {
                    min: 1,
                    max: limits::BF16_MAX_TOP_K,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![crate::KeyFormat::Float],
            },
            extra_check: Some(|_, device| {
                let needed = limits::wgmma_shared_bytes(limits::MAX_TILES_PER_SPLIT);
                shared_memory_reason(device, needed, format!("{needed} B")).into_iter().collect()
            }),
            priority: vec![(Sm90, 5)],
        },
        Entry {
            name: "cuda-f32-fma",
            description: "glm5 CUDA kernel, f32 FMA",
            kernel: Kernel::SparseMla(sparse_mla_cuda),
            serves: Serves {
                devices: kernel_archs,
                dtypes: vec![DType::F32],
                heads: Limit::Any,
                head_dims: Limit::MultipleOf(limits::ROW_MULTIPLE),
                value_dims: Limit::Any,
                top_k: Limit::Range {
                    min: 1,
                    max: i32::MAX as usize,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![crate::KeyFormat::Float],
            },
            extra_check: Some(|spec, device| {
                let needed = limits::f32_shared_bytes(spec.head_dim, spec.value_dim.unwrap_or(0));
                shared_memory_reason(device, needed, format!("{needed} B")).into_iter().collect()
            }),
            priority: vec![(Sm120, 20), (Sm90, 20)],
        },
        Entry {
            name: "reference",
            description: "candle tensor ops in f32, host-validated indices (any device, slow)",
            kernel: Kernel::SparseMla(sparse_mla_reference),
            serves: Serves::anything(),
            extra_check: None,
            priority: vec![(Sm120, 100), (Sm90, 100), (OtherCuda, 100), (Cpu, 100)],
        },
    ]
}

#[cfg(feature = "cuda")]
pub use cuda::{set_cluster_combine, set_narrow_heads, set_poison_outputs, NarrowHeads};

#[cfg(feature = "cuda")]
mod cuda {
    //! Launch of `kernels/src/sparse_mla.cu`: bf16 through the mma.sync kernel (split over the top-k and
    //! combined when the grid would otherwise be small), f32 through the FMA kernel.

    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId};
    use candle_core::{CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

    use super::{Bf16Kernel, PagedLatentCache};
    use crate::cuda::{
        cuda_err, device_address, device_info, kernel, launch_cluster, launch_dependent,
        resident_blocks, resident_clusters, DeviceInfo, PORTABLE_CLUSTER_BLOCKS,
        STATIC_SHARED_RESERVE,
    };
    const _: () = assert!(super::split_policy::MAX_MERGE_CLUSTER <= PORTABLE_CLUSTER_BLOCKS);
    use crate::error::{check_shape, OpError, Result};

    const MODULE: (&str, &[u8]) = ("sparse_mla", glm5_kernels::SPARSE_MLA);
    const WGMMA_MODULE: (&str, &[u8]) = ("sparse_mla_sm90", glm5_kernels::SPARSE_MLA_SM90);
    use super::limits::narrow::{
        narrow_shared_bytes, NARROW_HEADS, NARROW_KEYS, NARROW_ROW_DIM, NARROW_VALUE_DIM,
        NARROW_WARPS,
    };
    use super::limits::{
        bf16_shared_bytes, f32_shared_bytes, warps_per_head_tile, wgmma_shared_bytes,
        BF16_VALUE_DIMS, MAX_ROPE, MAX_SPLITS, MAX_TILES_PER_SPLIT, TILE, WGMMA_HEADS,
        WGMMA_ROW_DIM, WGMMA_VALUE_DIM,
    };
    use super::split_policy::{
        cluster_keeps_waves, cluster_may_merge, narrow_warps, tiles_per_split,
    };

    /// A block's fixed cost in tiles' time, for the split choice (measured on the H200: one-tile blocks take
    /// about three tiles' time).
    const BLOCK_COST_IN_TILES: usize = 2;
    /// The same for the wgmma kernel, whose blocks also load 64 heads of Q (two tiles' bytes).
    const WGMMA_BLOCK_COST_IN_TILES: usize = 3;
    /// Value widths with a 64-head instantiation.
    const WIDE_VALUE_DIMS: [usize; 3] = [128, 256, 512];

    /// Head tiles each warp of the bf16 kernel owns (`MW` of its entry points): two when a block has four,
    /// so that every key fragment read from shared memory feeds two mma.
    fn head_tiles_per_warp(head_tiles: usize) -> usize {
        if head_tiles == 4 {
            2
        } else {
            1
        }
    }
    /// Warps of the combine kernel and value columns per block (`COMBINE_GROUPS`, `COMBINE_COLUMNS` in the
    /// .cu file).
    const COMBINE_GROUPS: usize = 8;
    const COMBINE_COLUMNS: usize = 128;
    /// Most splits of the one-wait combine, and its warps per block (`COMBINE_CHUNK`, `COMBINE_ROW_WARPS`).
    const COMBINE_CHUNK: usize = 16;
    const COMBINE_ROW_WARPS: usize = 4;

    /// Which kernel takes bf16 calls of at most 8 heads over GLM-5's rows (tests and benchmarks pin one).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum NarrowHeads {
        /// The launcher's choice: the narrow kernel where its grid is one wave (`split_policy::narrow_warps`),
        /// else the head-tile kernel.
        Policy,
        /// The head-tile kernel always.
        Off,
        /// The narrow kernel with this many warps per block (2, 4 or 8) for every such call.
        Warps(usize),
    }

    /// `NarrowHeads` as one word: 0 policy, 1 off, else 2 + the warps.
    static NARROW_HEADS_CHOICE: AtomicUsize = AtomicUsize::new(0);

    /// Pins the kernel for bf16 calls of at most 8 heads over GLM-5's rows ([`NarrowHeads::Policy`]: the
    /// default). A block size without an instantiation fails the call with an error naming the sizes.
    pub fn set_narrow_heads(choice: NarrowHeads) {
        let word = match choice {
            NarrowHeads::Policy => 0,
            NarrowHeads::Off => 1,
            NarrowHeads::Warps(warps) => warps.saturating_add(2),
        };
        NARROW_HEADS_CHOICE.store(word, Ordering::Relaxed);
    }

    fn narrow_heads() -> NarrowHeads {
        match NARROW_HEADS_CHOICE.load(Ordering::Relaxed) {
            0 => NarrowHeads::Policy,
            1 => NarrowHeads::Off,
            word => NarrowHeads::Warps(word - 2),
        }
    }

    static POISON_OUTPUTS: AtomicBool = AtomicBool::new(false);
    static CLUSTER_COMBINE: AtomicBool = AtomicBool::new(true);

    /// Whether the mma.sync kernel may merge a token's splits inside a thread-block cluster (the default;
    /// tests turn it off to run the combine kernel instead).
    pub fn set_cluster_combine(on: bool) {
        CLUSTER_COMBINE.store(on, Ordering::Relaxed);
    }

    /// Tests: fill every output buffer with NaN bytes before the kernels run, so an element they forget
    /// to write shows up.
    pub fn set_poison_outputs(on: bool) {
        POISON_OUTPUTS.store(on, Ordering::Relaxed);
    }

    /// NaN-fills `bytes` at `ptr` when poisoning is on.
    fn poison(
        ptr: u64,
        bytes: usize,
        stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
    ) -> candle_core::Result<()> {
        if POISON_OUTPUTS.load(Ordering::Relaxed) {
            // SAFETY: `ptr` is a live allocation of at least `bytes` bytes on this stream's context.
            unsafe {
                candle_core::cuda_backend::cudarc::driver::result::memset_d8_async(
                    ptr,
                    0xFF,
                    bytes,
                    stream.cu_stream(),
                )
            }
            .map_err(cuda_err)?;
        }
        Ok(())
    }

    /// Whether this module serves `q`: a CUDA tensor of a dtype with a kernel.
    pub(super) fn serves(q: &Tensor) -> bool {
        q.device().is_cuda() && matches!(q.dtype(), DType::BF16 | DType::F32)
    }

    /// Mirrors `SparseMlaParams` in the .cu file.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Params {
        token_seq: u64,
        indices: u64,
        q: u64,
        kv: u64,
        k: i32,
        h: i32,
        block_size: i32,
        max_blocks: i32,
        seq_lens: u64,
        block_table: u64,
        out: u64,
        lse: u64,
        part_out: u64,
        part_lse: u64,
        tiles_per_split: i32,
        num_splits: i32,
        t: i32,
        dv: i32,
        d: i32,
        cluster_combine: i32,
        scale: f32,
    }
    // SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
    unsafe impl DeviceRepr for Params {}

    struct SparseMla {
        indices: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        token_seq: Tensor,
        value_dim: usize,
        scale: f32,
        kernel: Bf16Kernel,
        lse: Arc<Mutex<Option<CudaStorage>>>,
    }

    impl SparseMla {
        fn launch(
            &self,
            q: &CudaStorage,
            q_layout: &Layout,
            kv: &CudaStorage,
            kv_layout: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let dev: &CudaDevice = q.device();
            let stream = dev.cuda_stream();
            let (t_len, heads, row_dim) = q_layout.shape().dims3()?;
            let (_, block_size, _) = kv_layout.shape().dims3()?;
            let (_, max_blocks) = self.block_table.dims2()?;
            let k_len = self.indices.dim(1)?;
            let value_dim = self.value_dim;
            let (q_start, q_end) = q_layout
                .contiguous_offsets()
                .ok_or_else(|| cuda_err("q must be contiguous"))?;
            let (kv_start, kv_end) = kv_layout
                .contiguous_offsets()
                .ok_or_else(|| cuda_err("cache must be contiguous"))?;

            let mut params = Params {
                t: t_len as i32,
                h: heads as i32,
                d: row_dim as i32,
                dv: value_dim as i32,
                k: k_len as i32,
                block_size: block_size as i32,
                max_blocks: max_blocks as i32,
                scale: self.scale,
                block_table: device_address(&self.block_table)?.0,
                seq_lens: device_address(&self.seq_lens)?.0,
                token_seq: device_address(&self.token_seq)?.0,
                indices: device_address(&self.indices)?.0,
                ..Default::default()
            };
            let lse = unsafe { dev.alloc::<f32>(t_len * heads) }?;
            let lse_ptr = lse.device_ptr(&stream).0;
            params.lse = lse_ptr;
            poison(lse_ptr, t_len * heads * 4, &stream)?;

            let out = match q.dtype() {
                DType::BF16 => {
                    let q_slice = q.as_cuda_slice::<half::bf16>()?.slice(q_start..q_end);
                    let kv_slice = kv.as_cuda_slice::<half::bf16>()?.slice(kv_start..kv_end);
                    let q_ptr = q_slice.device_ptr(&stream).0;
                    let kv_ptr = kv_slice.device_ptr(&stream).0;
                    params.q = q_ptr;
                    params.kv = kv_ptr;
                    let out = unsafe { dev.alloc::<half::bf16>(t_len * heads * value_dim) }?;
                    let out_ptr = out.device_ptr(&stream).0;
                    params.out = out_ptr;
                    poison(out_ptr, t_len * heads * value_dim * 2, &stream)?;
                    launch_bf16(dev, &mut params, self.kernel)?;
                    CudaStorage::wrap_cuda_slice(out, dev.clone())
                }
                DType::F32 => {
                    let q_slice = q.as_cuda_slice::<f32>()?.slice(q_start..q_end);
                    let kv_slice = kv.as_cuda_slice::<f32>()?.slice(kv_start..kv_end);
                    let q_ptr = q_slice.device_ptr(&stream).0;
                    let kv_ptr = kv_slice.device_ptr(&stream).0;
                    params.q = q_ptr;
                    params.kv = kv_ptr;
                    let out = unsafe { dev.alloc::<f32>(t_len * heads * value_dim) }?;
                    let out_ptr = out.device_ptr(&stream).0;
                    params.out = out_ptr;
                    poison(out_ptr, t_len * heads * value_dim * 4, &stream)?;
                    params.num_splits = 1;
                    let func = kernel_fn(dev, MODULE, "sparse_mla_f32")?;
                    let smem = f32_shared_bytes(row_dim, value_dim);
                    let cfg = LaunchConfig {
                        grid_dim: (t_len as u32, heads as u32, 1),
                        block_dim: (128, 1, 1),
                        shared_mem_bytes: smem as u32,
                    };
                    let mut builder = stream.launch_builder(&func);
                    builder.arg(&params);
                    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
                    CudaStorage::wrap_cuda_slice(out, dev.clone())
                }
                other => candle_core::bail!("sparse_mla kernel: unsupported dtype {other:?}"),
            };
            *self.lse.lock().map_err(cuda_err)? =
                Some(CudaStorage::wrap_cuda_slice(lse, dev.clone()));
            Ok((out, Shape::from((t_len, heads, value_dim))))
        }
    }

    thread_local! {
        /// Split partials (f32 out, then lse) per device, kept between calls. Per thread because candle's
        /// CUDA device issues work on the per-thread default stream: one thread's launches are ordered.
        static SPLIT_WORKSPACE: RefCell<HashMap<DeviceId, CudaSlice<f32>>> = RefCell::new(HashMap::new());
    }

    /// Device pointer to at least `len` f32 of this thread's split workspace on `dev`.
    fn split_workspace(dev: &CudaDevice, len: usize) -> candle_core::Result<u64> {
        SPLIT_WORKSPACE.with(|cell| {
            let mut map = cell.borrow_mut();
            let stream = dev.cuda_stream();
            let slot = map.get(&dev.id()).filter(|s| s.len() >= len);
            if slot.is_none() {
                // SAFETY: every element the kernels read is written by the same launch first.
                let fresh = unsafe { dev.alloc::<f32>(len.next_power_of_two()) }?;
                map.insert(dev.id(), fresh);
            }
            let slice = map
                .get(&dev.id())
                .ok_or_else(|| cuda_err("split workspace missing"))?;
            let ptr = slice.device_ptr(&stream).0;
            Ok(ptr)
        })
    }

    /// Whether the wgmma kernel serves `heads` heads of rows `row_dim` / `value_dim` on a device of `info`
    /// (the reason when not).
    fn wgmma_unsupported(
        info: &DeviceInfo,
        heads: usize,
        row_dim: usize,
        value_dim: usize,
    ) -> Option<String> {
        if info.capability != (9, 0) {
            let (major, minor) = info.capability;
            return Some(format!(
                "it needs an sm_90 GPU, this one is sm_{major}{minor}"
            ));
        }
        if !heads.is_multiple_of(WGMMA_HEADS)
            || row_dim != WGMMA_ROW_DIM
            || value_dim != WGMMA_VALUE_DIM
        {
            return Some(format!(
                "it serves heads in multiples of {WGMMA_HEADS} over rows of {WGMMA_ROW_DIM} with {WGMMA_VALUE_DIM} value columns, got {heads} heads, rows of {row_dim}, {value_dim} value columns"
            ));
        }
        let needed = wgmma_shared_bytes(MAX_TILES_PER_SPLIT);
        if needed > info.max_shared_per_block {
            return Some(format!(
                "it needs {needed} B of shared memory per block, the device has {}",
                info.max_shared_per_block
            ));
        }
        None
    }

    /// How a launch splits each token's top-k: tiles per split, and whether the splits of a token merge
    /// inside a thread-block cluster (else through the combine kernel).
    #[derive(Clone, Copy, Debug)]
    struct Split {
        per: usize,
        cluster: bool,
    }

    /// Launches the bf16 kernel `kernel` picks (the split of the top-k, and the combine when there are
    /// several).
    fn launch_bf16(
        dev: &CudaDevice,
        params: &mut Params,
        kernel: Bf16Kernel,
    ) -> candle_core::Result<()> {
        let (t_len, heads, row_dim, k_len, value_dim) = (
            params.t as usize,
            params.h as usize,
            params.d as usize,
            params.k as usize,
            params.dv as usize,
        );
        let info = device_info(dev)?;
        let wgmma = match kernel {
            Bf16Kernel::Fastest => wgmma_unsupported(&info, heads, row_dim, value_dim).is_none(),
            Bf16Kernel::MmaSync => false,
            Bf16Kernel::Wgmma => true, // checked before the op was applied
        };
        let (max_smem, sms) = (info.max_shared_per_block - STATIC_SHARED_RESERVE, info.sms);
        let tiles = k_len.div_ceil(TILE).max(1);
        if wgmma {
            // One block of two warpgroups per SM (~169 KB of shared memory each, 255 registers per thread).
            let groups = heads / WGMMA_HEADS;
            let per = tiles_per_split(
                tiles,
                t_len * groups,
                sms,
                WGMMA_BLOCK_COST_IN_TILES,
                |per| wgmma_shared_bytes(per.max(MAX_TILES_PER_SPLIT)) <= max_smem,
            );
            let func = kernel_fn(dev, WGMMA_MODULE, "sparse_mla_wgmma_dv512_d576")?;
            let smem = wgmma_shared_bytes(per.max(MAX_TILES_PER_SPLIT));
            let split = Split {
                per,
                cluster: false,
            };
            return launch_split(dev, params, &func, (groups, 256, smem), tiles, split);
        }

        if heads <= NARROW_HEADS && row_dim == NARROW_ROW_DIM && value_dim == NARROW_VALUE_DIM {
            let warps = match narrow_heads() {
                NarrowHeads::Off => None,
                NarrowHeads::Warps(warps) => Some(warps),
                NarrowHeads::Policy => {
                    let mut resident = [0; NARROW_WARPS.len()];
                    for (slot, &warps) in resident.iter_mut().zip(&NARROW_WARPS) {
                        let smem = narrow_shared_bytes(warps);
                        if smem <= max_smem {
                            let name = narrow_name(warps);
                            *slot = resident_blocks(
                                dev,
                                MODULE.0,
                                MODULE.1,
                                &name,
                                32 * warps as u32,
                                smem as u32,
                            )?;
                        }
                    }
                    narrow_warps(t_len, k_len, sms, |warps| {
                        NARROW_WARPS
                            .iter()
                            .position(|&w| w == warps)
                            .map_or(0, |i| resident[i])
                    })
                }
            };
            if let Some(warps) = warps {
                let smem = narrow_shared_bytes(warps);
                if !NARROW_WARPS.contains(&warps) || smem > max_smem {
                    candle_core::bail!(
                        "sparse_mla narrow kernel: {warps} warps per block (instantiated: {NARROW_WARPS:?}) need {smem} B of shared memory, the device has {max_smem}"
                    );
                }
                let func = kernel_fn(dev, MODULE, &narrow_name(warps))?;
                let split = Split {
                    per: warps,
                    cluster: false,
                };
                let tiles = k_len.div_ceil(NARROW_KEYS).max(1);
                return launch_split(dev, params, &func, (1, 32 * warps, smem), tiles, split);
            }
        }

        let warps_per_tile = warps_per_head_tile(value_dim);
        // Many heads: four 16-head tiles per block share each key tile (a quarter of the key traffic).
        let head_tiles = if heads >= 64
            && WIDE_VALUE_DIMS.contains(&value_dim)
            && bf16_shared_bytes(4, warps_per_tile, row_dim, MAX_TILES_PER_SPLIT) <= max_smem
        {
            4
        } else {
            1
        };
        let smem_for = |tiles_per_split: usize| {
            bf16_shared_bytes(head_tiles, warps_per_tile, row_dim, tiles_per_split)
        };
        if smem_for(MAX_TILES_PER_SPLIT) > max_smem {
            candle_core::bail!(
                "sparse_mla: rows of {row_dim} need {} B of shared memory, the device has {max_smem}",
                smem_for(MAX_TILES_PER_SPLIT)
            );
        }
        let groups = heads.div_ceil(16 * head_tiles);
        let resident = if head_tiles == 1 { 2 * sms } else { sms };
        let per = tiles_per_split(
            tiles,
            t_len * groups,
            resident,
            BLOCK_COST_IN_TILES,
            |per| smem_for(per.max(MAX_TILES_PER_SPLIT)) <= max_smem,
        );
        // GLM-5's rows (512 + 64) have an instantiation with the width fixed at compile time.
        let name = if value_dim == 512 && row_dim == value_dim + MAX_ROPE {
            format!("sparse_mla_bf16_dv{value_dim}_d{row_dim}_hb{head_tiles}")
        } else {
            format!("sparse_mla_bf16_dv{value_dim}_hb{head_tiles}")
        };
        let func = kernel_fn(dev, MODULE, &name)?;
        let threads = head_tiles / head_tiles_per_warp(head_tiles) * warps_per_tile * 32;
        let smem = smem_for(per.max(MAX_TILES_PER_SPLIT));
        // With one head tile per block (the kernel's partial then fits its key buffers), a token's few
        // splits merge inside a thread-block cluster instead of through the combine kernel, where clusters
        // of that size take no more waves than the blocks alone. (Splitting into fewer, longer splits to make
        // clusters possible loses: a block's copies stream at a fraction of the device's bandwidth, so a
        // small batch needs blocks on every SM -- docs/perf.md, session 9.)
        let (blocks, splits) = (t_len * groups, tiles.div_ceil(per));
        let cluster = head_tiles == 1
            && cluster_may_merge(splits)
            && CLUSTER_COMBINE.load(Ordering::Relaxed)
            && {
                let at_once =
                    resident_clusters(dev, MODULE, &name, threads as u32, smem as u32, None)?;
                cluster_keeps_waves(splits, blocks, resident, at_once[splits])
            };
        launch_split(
            dev,
            params,
            &func,
            (groups, threads, smem),
            tiles,
            Split { per, cluster },
        )
    }

    /// The narrow kernel's entry point with `warps` warps per block.
    fn narrow_name(warps: usize) -> String {
        format!("sparse_mla_narrow_dv{NARROW_VALUE_DIM}_d{NARROW_ROW_DIM}_w{warps}")
    }

    /// Function `name` of one of this op's modules (`sparse_mla.cu` or `sparse_mla_sm90.cu`).
    fn kernel_fn(
        dev: &CudaDevice,
        (module, image): (&'static str, &'static [u8]),
        name: &str,
    ) -> candle_core::Result<CudaFunction> {
        kernel(dev, module, image, name)
    }

    /// Launches `func` over (splits, head groups, tokens) blocks of `threads` threads and `smem` bytes of
    /// shared memory, `split.per` of the `tiles` top-k tiles per split. Several splits merge in their
    /// cluster (`split.cluster`: one cluster per token and head group) or write f32 partials that the
    /// combine kernel (a programmatic dependent launch) merges.
    fn launch_split(
        dev: &CudaDevice,
        params: &mut Params,
        func: &CudaFunction,
        (groups, threads, smem): (usize, usize, usize),
        tiles: usize,
        split: Split,
    ) -> candle_core::Result<()> {
        let per = split.per;
        let stream = dev.cuda_stream();
        let (t_len, heads, value_dim) = (params.t as usize, params.h as usize, params.dv as usize);
        let splits = tiles.div_ceil(per);
        if splits > MAX_SPLITS {
            candle_core::bail!(
                "sparse_mla: top-k {} needs {splits} splits of {per} tiles, more than the {MAX_SPLITS} the combine merges",
                params.k
            );
        }
        params.num_splits = splits as i32;
        params.tiles_per_split = per as i32;
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, groups as u32, t_len as u32),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        if splits == 1 {
            let mut builder = stream.launch_builder(func);
            builder.arg(&*params);
            // SAFETY: `params` mirrors SparseMlaParams; every pointer in it is live for this call.
            return unsafe { builder.launch(cfg) }.map(|_| ()).map_err(cuda_err);
        }
        if split.cluster {
            params.cluster_combine = 1;
            // SAFETY: as above; the grid's x dimension is the cluster's size.
            return unsafe { launch_cluster(func, &stream, cfg, splits as u32, params) };
        }
        let partial_out = splits * t_len * heads * value_dim;
        let partial_lse = splits * t_len * heads;
        let workspace = split_workspace(dev, partial_out + partial_lse)?;
        params.part_out = workspace;
        params.part_lse = workspace + (partial_out * 4) as u64;
        poison(workspace, (partial_out + partial_lse) * 4, &stream)?;
        let mut builder = stream.launch_builder(func);
        builder.arg(&*params);
        // SAFETY: as above.
        unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
        // Up to 16 splits: one warp per 128 columns loads every partial at once; more: the block combine.
        let (name, columns, threads) = if splits <= COMBINE_CHUNK {
            (
                "sparse_mla_combine_rows_bf16",
                COMBINE_ROW_WARPS * COMBINE_COLUMNS,
                COMBINE_ROW_WARPS * 32,
            )
        } else {
            (
                "sparse_mla_combine_bf16",
                COMBINE_COLUMNS,
                COMBINE_GROUPS * 32,
            )
        };
        let combine = kernel_fn(dev, MODULE, name)?;
        let cfg = LaunchConfig {
            grid_dim: (
                (t_len * heads) as u32,
                value_dim.div_ceil(columns) as u32,
                1,
            ),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the combine kernel takes one `SparseMlaParams`, which `Params` mirrors.
        unsafe { launch_dependent(&combine, &stream, cfg, params) }
    }

    impl CustomOp2 for SparseMla {
        fn name(&self) -> &'static str {
            "sparse_mla"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("sparse_mla: the CUDA op got CPU tensors")
        }

        fn cuda_fwd(
            &self,
            q: &CudaStorage,
            q_layout: &Layout,
            kv: &CudaStorage,
            kv_layout: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            self.launch(q, q_layout, kv, kv_layout)
        }
    }

    /// Hands out the lse the attention launch left behind (a CustomOp has a single output).
    struct TakeLse {
        lse: Arc<Mutex<Option<CudaStorage>>>,
        shape: Shape,
    }

    impl CustomOp1 for TakeLse {
        fn name(&self) -> &'static str {
            "sparse_mla_lse"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("sparse_mla_lse: CUDA only")
        }

        fn cuda_fwd(
            &self,
            _: &CudaStorage,
            _: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let lse = self
                .lse
                .lock()
                .map_err(cuda_err)?
                .take()
                .ok_or_else(|| cuda_err("sparse_mla produced no lse"))?;
            Ok((lse, self.shape.clone()))
        }
    }

    pub(super) fn sparse_mla_paged(
        q: &Tensor,
        cache: &PagedLatentCache,
        indices: &Tensor,
        value_dim: usize,
        softmax_scale: f64,
        kernel: Bf16Kernel,
    ) -> Result<(Tensor, Tensor)> {
        let [t_len, heads, row_dim] = check_shape("q", q, [("T", None), ("H", None), ("D", None)])?;
        check_shape(
            "blocks",
            cache.blocks,
            [
                ("num_blocks", None),
                ("block_size", None),
                ("D", Some(row_dim)),
            ],
        )?;
        let [batch, _] = check_shape(
            "block_table",
            cache.block_table,
            [("B", None), ("max_blocks", None)],
        )?;
        check_shape("seq_lens", cache.seq_lens, [("B", Some(batch))])?;
        check_shape("token_seq", cache.token_seq, [("T", Some(t_len))])?;
        check_shape("indices", indices, [("T", Some(t_len)), ("K", None)])?;
        crate::error::check_same_dtype("blocks", cache.blocks, "q", q)?;
        for (arg, tensor) in [
            ("indices", indices),
            ("block_table", cache.block_table),
            ("seq_lens", cache.seq_lens),
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
        if value_dim > row_dim {
            return Err(OpError::ValueDimTooLarge { value_dim, row_dim });
        }
        if row_dim % 8 != 0
            || (q.dtype() == DType::BF16
                && (!BF16_VALUE_DIMS.contains(&value_dim) || row_dim > value_dim + MAX_ROPE))
        {
            return Err(OpError::Unsupported(format!(
                "sparse_mla CUDA kernel: row width {row_dim} must be a multiple of 8, and for bf16 the value width one of {BF16_VALUE_DIMS:?} with at most {MAX_ROPE} more columns in a row (got value width {value_dim})"
            )));
        }
        if kernel == Bf16Kernel::Wgmma && q.dtype() == DType::BF16 {
            let candle_core::Device::Cuda(dev) = q.device() else {
                return Err(OpError::Unsupported(
                    "sparse_mla wgmma kernel: not a CUDA device".into(),
                ));
            };
            if let Some(reason) = wgmma_unsupported(&device_info(dev)?, heads, row_dim, value_dim) {
                return Err(OpError::Unsupported(format!(
                    "sparse_mla wgmma kernel: {reason}"
                )));
            }
        }
        let lse = Arc::new(Mutex::new(None));
        let op = SparseMla {
            indices: indices.contiguous()?,
            block_table: cache.block_table.contiguous()?,
            seq_lens: cache.seq_lens.contiguous()?,
            token_seq: cache.token_seq.contiguous()?,
            value_dim,
            scale: softmax_scale as f32,
            kernel,
            lse: lse.clone(),
        };
        let out = q
            .contiguous()?
            .apply_op2_no_bwd(&cache.blocks.contiguous()?, &op)?;
        let lse = out.apply_op1_no_bwd(&TakeLse {
            lse,
            shape: Shape::from((t_len, heads)),
        })?;
        Ok((out, lse))
    }
}
