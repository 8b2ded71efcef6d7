//! DSA lightning indexer: picks, for every query, the keys its sparse attention will read
//! (`docs/architecture.md`, "The lightning indexer").
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
//! f16 in registers, against Q in shared memory; [`ScoreKernel::MmaSync`] pins mma.sync), and a prefill chunk of
//! one sequence (a block table of one row) a grouped kernel: four queries per block, each key tile copied
//! and converted once for all four (one wgmma m64n128k16 per 16 dims), where `policy::score` finds it pays.
//! The score kernel also counts each row's scores by their top 11 bits. Top-k, spread over
//! segments of 2048 positions so that one query uses the whole GPU: each segment finds the bin of the
//! K-th score from those counts, lists its scores in that bin, counts them by their next 11 bits and
//! keeps a bit mask of its scores above the bin; one block per query finds the K-th value exactly among
//! the listed ones (the finer counts narrow it to the few scores sharing its top 22 bits, ranked by value
//! then position; a radix select where many share them; ties to the lower position) and gives each
//! segment its output offset, marking the listed scores it takes in their segments' masks; each segment
//! then writes its selected positions in order from its mask (the scores are read once, not twice).
//! Rows of up to 32,768 positions whose queries' clusters fit the GPU at once take the same steps in
//! one kernel instead (`policy::top_k`): a thread-block cluster of 8
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
//!
//! # Where things are
//!
//! * `reference.rs`: the plain reference (above), contiguous and paged.
//! * `limits.rs`: what the CUDA kernels serve; `entries.rs`: the registry entries.
//! * `policy.rs`: the launcher's choices (top-k path, emit kernel, grouped scores), pure and tested.
//! * `cuda/`: the launcher, by stage: `scores.rs`, `top_k.rs`, `tensor_map.rs` (TMA descriptors of the
//!   FP8 cache); the FP8 key quantiser's launcher is `index_keys/cuda.rs`; kernels in `kernels/src/dsa_indexer*.cu` and
//!   `kernels/src/dsa_indexer/`.

use candle_core::{DType, Tensor};

use crate::error::{check_float, check_same_dtype, check_shape, OpError, Result};
use crate::index_keys::{check_fp8, IndexKeys, KeyFormat};
use crate::registry::{CacheLayout, Kernel, Op, OpDispatch, OpSpec};

mod entries;
pub(crate) mod limits;
#[cfg(any(feature = "cuda", test))]
mod policy;
mod reference;

#[cfg(feature = "cuda")]
mod cuda;

pub(crate) use entries::registry_entries;

/// The registry over this op's entries that its public functions dispatch through.
static DISPATCH: OpDispatch = OpDispatch::new(registry_entries);
pub use reference::dsa_indexer_reference;

/// Upper bound on the elements of the f32 score tensor of one chunk of queries (the reference's
/// `[T_chunk, H_I, N]`, the CUDA path's `[T_chunk, N]`).
const MAX_CHUNK_ELEMS: usize = 64 << 20;

/// A paged indexer key cache (layout in the module docs).
pub struct PagedIndexKeys<'a> {
    /// Rows `[num_blocks, block_size, D]` (FP8 scales `[num_blocks, block_size]`).
    pub keys: IndexKeys<'a>,
    /// `I32 [B, max_blocks]`: the blocks of each sequence, in order.
    pub block_table: &'a Tensor,
    /// `I32 [T]`: the sequence of each query.
    pub token_seq: &'a Tensor,
}

/// Top-`top_k` key indices per query, `-1` padded (the contract is in the module docs), by the backend the
/// registry chooses for these inputs on their device. The model binds a backend chosen once per layer
/// instead.
pub fn dsa_indexer(
    q_index: &Tensor,
    head_weights: &Tensor,
    keys: &Tensor,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let keys = IndexKeys::Float(keys);
    check_inputs(q_index, head_weights, keys, visible_keys, top_k)?;
    let spec = spec(q_index, keys, top_k, CacheLayout::Contiguous)?;
    match DISPATCH.choose(&spec, q_index.device())?.1 {
        Kernel::DsaIndexer(f) => f(q_index, head_weights, keys, visible_keys, top_k),
        Kernel::SparseMla(_) => unreachable!("dispatch returns an entry of the op asked for"),
    }
}

/// What a dsa_indexer call asks of the registry.
fn spec(q_index: &Tensor, keys: IndexKeys, top_k: usize, layout: CacheLayout) -> Result<OpSpec> {
    let (_, heads, head_dim) = q_index.dims3()?;
    Ok(OpSpec {
        op: Op::DsaIndexer,
        dtype: q_index.dtype(),
        heads,
        head_dim,
        value_dim: None,
        top_k,
        layout,
        key_format: match keys {
            IndexKeys::Float(_) => KeyFormat::Float,
            IndexKeys::Fp8 { .. } => KeyFormat::Fp8E4m3,
        },
    })
}

/// Whether the registry's choice for a paged call on the queries' device is one of glm5's CUDA backends
/// (else it is the reference).
fn paged_on_cuda(q_index: &Tensor, cache: &PagedIndexKeys, top_k: usize) -> Result<bool> {
    let block_size = cache.keys.values().dim(1)?;
    let spec = spec(
        q_index,
        cache.keys,
        top_k,
        CacheLayout::Paged { block_size },
    )?;
    Ok(DISPATCH.choose(&spec, q_index.device())?.0 != "reference")
}

/// [`dsa_indexer`] by glm5's CUDA kernels over contiguous float or FP8 keys `[N, D]` (the cache as
/// one block): the registry's `cuda-bf16-mma` and `cuda-f32-fma` entries. Inputs no kernel serves,
/// or a build without the `cuda` feature, give [`OpError::Unsupported`].
pub(crate) fn dsa_indexer_cuda(
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
        return cuda::dsa_indexer_paged(
            q_index,
            head_weights,
            &cache,
            visible_keys,
            top_k,
            &DsaIndexerLaunch::default(),
        );
    }
    let _ = kernel_dtype;
    Err(unsupported_on_cuda(q_index, t_len, heads, dim))
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

/// [`dsa_indexer`] over a paged key cache (layout in the module docs), by the registry's choice.
pub fn dsa_indexer_paged(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let [t_len, _, batch, capacity] = check_paged(q_index, head_weights, cache)?;
    check_request(t_len, visible_keys, capacity, top_k)?;
    if paged_on_cuda(q_index, cache, top_k)? {
        // A sequence index outside the block table is not reported here (that would cost a
        // device-to-host copy per call): the kernels give such a query no keys (all -1).
        let visible = VisibleKeys::Host(visible_keys);
        let launch = DsaIndexerLaunch::default();
        return dsa_indexer_paged_with(q_index, head_weights, cache, visible, top_k, &launch);
    }
    paged_reference_checked(q_index, head_weights, cache, visible_keys, top_k, batch)
}

/// [`dsa_indexer_paged`] by the candle-ops reference on any device, whatever the registry would choose (a
/// sequence index outside the block table is an `IndexOutOfRange` error). What a plan that bound the
/// reference runs.
pub fn dsa_indexer_paged_reference(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible_keys: &[usize],
    top_k: usize,
) -> Result<Tensor> {
    let [t_len, _, batch, capacity] = check_paged(q_index, head_weights, cache)?;
    check_request(t_len, visible_keys, capacity, top_k)?;
    paged_reference_checked(q_index, head_weights, cache, visible_keys, top_k, batch)
}

/// The paged reference after the shape checks: validates the sequence of every query, then scores.
fn paged_reference_checked(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible_keys: &[usize],
    top_k: usize,
    batch: usize,
) -> Result<Tensor> {
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
    reference::paged_reference(
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
    check_device_visible(q_index, head_weights, cache, visible, max_visible, top_k)?;
    if paged_on_cuda(q_index, cache, top_k)? {
        let visible = VisibleKeys::Device {
            counts: visible,
            max_visible,
        };
        let launch = DsaIndexerLaunch::default();
        return dsa_indexer_paged_with(q_index, head_weights, cache, visible, top_k, &launch);
    }
    let counts: Vec<usize> = visible
        .to_vec1::<i32>()?
        .into_iter()
        .map(|v| (v.max(0) as usize).min(max_visible))
        .collect();
    dsa_indexer_paged(q_index, head_weights, cache, &counts, top_k)
}

/// Checks [`dsa_indexer_paged_device_visible`]'s arguments.
fn check_device_visible(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible: &Tensor,
    max_visible: usize,
    top_k: usize,
) -> Result<()> {
    let [t_len, _, _, capacity] = check_paged(q_index, head_weights, cache)?;
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
    check_request(1, &[max_visible], capacity, top_k)
}

/// How many keys each query sees: counts on the host, or on the inputs' device bounded by `max_visible`
/// (see [`dsa_indexer_paged_device_visible`]).
#[derive(Clone, Copy, Debug)]
pub enum VisibleKeys<'a> {
    Host(&'a [usize]),
    Device {
        /// `I32 [T]`.
        counts: &'a Tensor,
        max_visible: usize,
    },
}

/// Which top-k the CUDA indexer runs after its scores (a [`DsaIndexerLaunch`] choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopKPath {
    /// The launch policy: the cluster top-k for rows of up to 32,768 positions whose queries' clusters
    /// the GPU runs at once, else the chain.
    Policy,
    /// Three kernels in a programmatic chain (candidates, exact threshold, ordered emit): any row length.
    Chain,
    /// One thread-block cluster per query (rows of at most 262,144 positions; longer rows take the
    /// chain).
    Cluster,
}

/// Which score kernel the CUDA indexer runs for FP8 keys of 128 in pages of 64 with 17 to 32 heads
/// (GLM-5's cache; a [`DsaIndexerLaunch`] choice). On Hopper the policy scores the queries of a
/// one-sequence prefill chunk four at a time (`dsa_scores_fp8_wgmma_g4_d128`, see `policy::score`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreKernel {
    /// The launch policy: warpgroup MMA (wgmma) on Hopper (sm_90), mma.sync elsewhere.
    Policy,
    /// mma.sync on every GPU (sm_120's kernel, on Hopper too).
    MmaSync,
    /// The policy without the grouped prefill kernel: every query scored by a block of its own.
    PerQuery,
    /// The grouped prefill kernel wherever it runs (Hopper, a block table of one row), else the policy.
    Grouped,
}

/// The choices glm5's CUDA indexer makes by its launch policy unless they are pinned here (tests and
/// benchmarks pin them; nothing else does). `DsaIndexerLaunch::default()` is the policy on every point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DsaIndexerLaunch {
    pub top_k_path: TopKPath,
    pub score_kernel: ScoreKernel,
}

impl Default for DsaIndexerLaunch {
    fn default() -> Self {
        Self {
            top_k_path: TopKPath::Policy,
            score_kernel: ScoreKernel::Policy,
        }
    }
}

/// [`dsa_indexer_paged`] by glm5's CUDA kernels as `launch` says: on a CUDA device, bf16 queries of at
/// most 32 heads of width 16/32/64/128 over bf16 or FP8 keys, or f32 queries and keys; anything else is
/// [`OpError::Unsupported`].
pub fn dsa_indexer_paged_with(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible: VisibleKeys,
    top_k: usize,
    launch: &DsaIndexerLaunch,
) -> Result<Tensor> {
    let [t_len, dim, _, capacity] = check_paged(q_index, head_weights, cache)?;
    match visible {
        VisibleKeys::Host(counts) => check_request(t_len, counts, capacity, top_k)?,
        VisibleKeys::Device {
            counts,
            max_visible,
        } => check_device_visible(q_index, head_weights, cache, counts, max_visible, top_k)?,
    }
    // FP8 keys are scored by the bf16 mma kernel.
    let fp8 = matches!(cache.keys, IndexKeys::Fp8 { .. });
    let dtype = if fp8 { DType::BF16 } else { q_index.dtype() };
    let heads = q_index.dim(1)?;
    #[cfg(feature = "cuda")]
    if q_index.device().is_cuda() && cuda::serves(dtype, heads, dim) {
        return match visible {
            VisibleKeys::Host(counts) => {
                cuda::dsa_indexer_paged(q_index, head_weights, cache, counts, top_k, launch)
            }
            VisibleKeys::Device {
                counts,
                max_visible,
            } => cuda::dsa_indexer_paged_visible(
                q_index,
                head_weights,
                cache,
                counts,
                max_visible,
                top_k,
                launch,
            ),
        };
    }
    let _ = (dtype, launch);
    Err(unsupported_on_cuda(q_index, t_len, heads, dim))
}

/// Why the CUDA kernels do not take these queries.
fn unsupported_on_cuda(q_index: &Tensor, t_len: usize, heads: usize, dim: usize) -> OpError {
    OpError::Unsupported(format!(
        "dsa_indexer CUDA kernels: need a CUDA device{} with bf16 queries of ≤ {} heads of width {:?}, or f32; got {:?} {:?}, {t_len} queries of {heads} heads of width {dim}",
        if cfg!(feature = "cuda") { "" } else { " and a glm5 built with the cuda feature" },
        limits::MMA_MAX_HEADS,
        limits::MMA_HEAD_DIMS,
        q_index.device().location(),
        q_index.dtype(),
    ))
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
