//! Sparse absorbed MLA: every query head attends to the latent-cache rows the indexer selected
//! (`docs/architecture.md`, "Sparse attention").
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
//! `MAX_CHUNK_ELEMS` (`reference.rs`).
//!
//! # Where things are
//!
//! * `reference.rs`: the plain reference (above), contiguous and paged.
//! * `limits.rs`: what the CUDA kernels serve (shared by the launcher and the registry, no GPU needed).
//! * `entries.rs`: the registry entries (capabilities and priorities of each backend).
//! * `policy.rs`: the launch policies (how a top-k is split over blocks, when the narrow kernel runs),
//!   pure functions tested on the CPU.
//! * `cuda/`: the launcher, by stage: `attention.rs` (which attention kernel, its split of the top-k)
//!   and `combine.rs` (merging the splits); kernels in `kernels/src/sparse_mla*.cu`.

use candle_core::Tensor;

use crate::error::{OpError, Result};
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
pub use reference::sparse_mla_reference;

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

/// Attention of every head over the selected latent rows: `(out, lse)` (contract in the module docs), by
/// the backend the registry chooses for these inputs on their device.
///
/// On a CUDA device glm5's kernels run the cache as one block of `N` rows; there, indices outside `-1..N`
/// are not reported but read as "no row" (validating them would cost a device-to-host copy per call).
pub fn sparse_mla(
    q: &Tensor,
    latent_cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    reference::check_args(q, latent_cache, indices, value_dim)?;
    let spec = spec(q, indices, value_dim, CacheLayout::Contiguous)?;
    match DISPATCH.choose(&spec, q.device())?.1 {
        Kernel::SparseMla(f) => f(q, latent_cache, indices, value_dim, softmax_scale),
        Kernel::DsaIndexer(_) => unreachable!("dispatch returns an entry of the op asked for"),
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
    crate::error::check_float("q", q)?;
    let block_size = cache.blocks.dims().get(1).copied().unwrap_or(0);
    let spec = spec(q, indices, value_dim, CacheLayout::Paged { block_size })?;
    match DISPATCH.choose(&spec, q.device())?.0 {
        "reference" => reference::paged(q, cache, indices, value_dim, softmax_scale),
        name => sparse_mla_paged_with(
            q,
            cache,
            indices,
            value_dim,
            softmax_scale,
            &SparseMlaLaunch::backend(name)?,
        ),
    }
}

/// [`sparse_mla_paged`] by the candle-ops reference on any device, whatever the registry would choose: logical
/// positions translated to physical rows on the host (out-of-range sequences, positions and blocks are
/// `IndexOutOfRange` errors), then [`sparse_mla_reference`]. What a plan that bound the reference runs.
pub fn sparse_mla_paged_reference(
    q: &Tensor,
    cache: &PagedLatentCache,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
) -> Result<(Tensor, Tensor)> {
    crate::error::check_float("q", q)?;
    reference::paged(q, cache, indices, value_dim, softmax_scale)
}

/// What a sparse_mla call asks of the registry.
fn spec(q: &Tensor, indices: &Tensor, value_dim: usize, layout: CacheLayout) -> Result<OpSpec> {
    let [_, heads, head_dim] =
        crate::error::check_shape("q", q, [("T", None), ("H", None), ("D", None)])?;
    let top_k = indices.dims().get(1).copied().unwrap_or(0);
    Ok(OpSpec {
        op: Op::SparseMla,
        dtype: q.dtype(),
        heads,
        head_dim,
        value_dim: Some(value_dim),
        top_k,
        layout,
        key_format: crate::KeyFormat::Float,
    })
}

/// Which kernel takes bf16 calls of at most 8 heads over GLM-5's rows (a [`SparseMlaLaunch`] choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NarrowHeads {
    /// The launch policy: the narrow kernel where its grid is one wave, else the head-tile kernel.
    Policy,
    /// The head-tile kernel always.
    Off,
    /// The narrow kernel with this many warps per block (2, 4 or 8) for every such call.
    Warps(usize),
}

/// The bf16 CUDA kernel of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bf16Kernel {
    /// Warpgroup MMA where it serves the call, mma.sync otherwise (the registry's order on sm_90).
    Fastest,
    /// `mma.sync` (sm_90 and sm_120): every shape the bf16 path takes.
    MmaSync,
    /// Warpgroup MMA (`wgmma`, sm_90 only): heads a multiple of 64, rows of 576 with 512 value columns
    /// (GLM-5's). Anything else is an [`OpError::Unsupported`] naming the cause.
    Wgmma,
}

/// How glm5's CUDA launcher runs a sparse_mla call: the registry backend it runs and the choices its
/// launch policy makes unless they are pinned here (tests and benchmarks pin them; nothing else does).
/// `SparseMlaLaunch::default()` is the policy on every point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA launcher only
pub struct SparseMlaLaunch {
    pub(crate) kernel: Bf16Kernel,
    pub(crate) narrow_heads: NarrowHeads,
    pub(crate) cluster_combine: bool,
    pub(crate) poison_outputs: bool,
}

impl Default for SparseMlaLaunch {
    fn default() -> Self {
        Self {
            kernel: Bf16Kernel::Fastest,
            narrow_heads: NarrowHeads::Policy,
            cluster_combine: true,
            poison_outputs: false,
        }
    }
}

impl SparseMlaLaunch {
    /// The launch of the registry's CUDA backend `name` (`cuda-bf16-mma`, `cuda-bf16-wgmma`,
    /// `cuda-f32-fma`; f32 inputs always run the FMA kernel).
    pub fn backend(name: &str) -> Result<Self> {
        let kernel = match name {
            "cuda-bf16-mma" | "cuda-f32-fma" => Bf16Kernel::MmaSync,
            "cuda-bf16-wgmma" => Bf16Kernel::Wgmma,
            other => {
                return Err(OpError::Unsupported(format!(
                    "sparse_mla: {other:?} is not one of glm5's CUDA backends (cuda-bf16-mma, cuda-bf16-wgmma, cuda-f32-fma)"
                )))
            }
        };
        Ok(Self {
            kernel,
            ..Self::default()
        })
    }

    /// Pins the kernel of bf16 calls of at most 8 heads over GLM-5's rows (a block size without an
    /// instantiation fails the call with an error naming the sizes).
    pub fn narrow_heads(self, narrow_heads: NarrowHeads) -> Self {
        Self {
            narrow_heads,
            ..self
        }
    }

    /// Whether the mma.sync kernel may merge a token's splits inside a thread-block cluster (the default);
    /// `false` runs the combine kernel instead.
    pub fn cluster_combine(self, cluster_combine: bool) -> Self {
        Self {
            cluster_combine,
            ..self
        }
    }

    /// Fills every output buffer with NaN bytes before the kernels run, so that an element they forget to
    /// write shows up (tests).
    pub fn poison_outputs(self, poison_outputs: bool) -> Self {
        Self {
            poison_outputs,
            ..self
        }
    }
}

/// [`sparse_mla_paged`] by glm5's CUDA launcher as `launch` says (bf16 or f32 inputs on a CUDA device;
/// anything else is [`OpError::Unsupported`]).
pub fn sparse_mla_paged_with(
    q: &Tensor,
    cache: &PagedLatentCache,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
    launch: &SparseMlaLaunch,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if cuda::serves(q) {
        return cuda::sparse_mla_paged(q, cache, indices, value_dim, softmax_scale, launch);
    }
    let _ = (cache, indices, value_dim, softmax_scale, launch);
    Err(OpError::Unsupported(format!(
        "sparse_mla CUDA kernels: need {}bf16 or f32 inputs on a CUDA device, got {:?} on {:?}",
        if cfg!(feature = "cuda") {
            ""
        } else {
            "a glm5 built with the cuda feature and "
        },
        q.dtype(),
        q.device().location()
    )))
}

/// The registry's `cuda-bf16-mma` and `cuda-f32-fma` function: glm5's mma.sync (bf16) and FMA (f32)
/// kernels over contiguous rows (the cache as one block of `N` rows).
pub(crate) fn sparse_mla_cuda(
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

/// The registry's `cuda-bf16-wgmma` function: glm5's warpgroup-MMA kernel (sm_90) over contiguous rows.
pub(crate) fn sparse_mla_cuda_wgmma(
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
        use candle_core::DType;
        let [t_len, _, row_dim] =
            crate::error::check_shape("q", q, [("T", None), ("H", None), ("D", None)])?;
        let [cache_len, _] = crate::error::check_shape(
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
        let launch = SparseMlaLaunch {
            kernel,
            ..SparseMlaLaunch::default()
        };
        cuda::sparse_mla_paged(q, &cache, indices, value_dim, softmax_scale, &launch)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, latent_cache, indices, value_dim, softmax_scale, kernel);
        Err(OpError::Unsupported(
            "sparse_mla CUDA kernels: this glm5 was built without the cuda feature".into(),
        ))
    }
}
