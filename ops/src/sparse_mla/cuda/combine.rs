//! The combine stage: a launch of the attention kernel over its splits, and the merge of a token's splits
//! (inside its thread-block cluster, or by a combine kernel launched as a programmatic dependent).

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;

use super::{kernel_fn, poison, split_workspace, Params, MODULE};
use crate::cuda::{cuda_err, launch_cluster, launch_dependent};
use crate::sparse_mla::limits::MAX_SPLITS;
use crate::sparse_mla::SparseMlaLaunch;

/// Warps of the block combine and value columns per block; most splits of the one-wait combine, and its
/// warps per block.
use glm5_kernels::interface::sparse_mla::{
    COMBINE_CHUNK, COMBINE_COLUMNS, COMBINE_GROUPS, COMBINE_ROW_WARPS,
};

/// How a launch splits each token's top-k: tiles per split, and whether the splits of a token merge
/// inside a thread-block cluster (else through the combine kernel).
#[derive(Clone, Copy, Debug)]
pub(super) struct Split {
    pub per: usize,
    pub cluster: bool,
}

/// Launches `func` over (splits, head groups, tokens) blocks of `threads` threads and `smem` bytes of
/// shared memory, `split.per` of the `tiles` top-k tiles per split. Several splits merge in their
/// cluster (`split.cluster`: one cluster per token and head group) or write f32 partials that the
/// combine kernel (a programmatic dependent launch) merges.
pub(super) fn launch_split(
    dev: &CudaDevice,
    params: &mut Params,
    func: &CudaFunction,
    (groups, threads, smem): (usize, usize, usize),
    tiles: usize,
    split: Split,
    launch: &SparseMlaLaunch,
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
    poison(launch, workspace, (partial_out + partial_lse) * 4, &stream)?;
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
