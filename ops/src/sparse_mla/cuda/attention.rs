//! The attention stage: which bf16 kernel a call runs (wgmma, the narrow kernel, the head-tile kernel),
//! with how many head tiles per block and how its top-k is split over blocks (`super::super::policy`).

use candle_core::cuda_backend::CudaDevice;

use super::combine::{launch_split, Split};
use super::{kernel_fn, Params, MODULE, WGMMA_MODULE};
use crate::cuda::{
    device_info, resident_blocks, resident_clusters, DeviceInfo, PORTABLE_CLUSTER_BLOCKS,
};
use crate::device::{ComputeCapability, STATIC_SHARED_RESERVE};
use crate::sparse_mla::limits::narrow::{
    narrow_shared_bytes, NARROW_HEADS, NARROW_KEYS, NARROW_ROW_DIM, NARROW_VALUE_DIM, NARROW_WARPS,
};
use crate::sparse_mla::limits::{
    bf16_shared_bytes, warps_per_head_tile, wgmma_shared_bytes, MAX_ROPE, MAX_TILES_PER_SPLIT,
    TILE, WGMMA_HEADS, WGMMA_ROW_DIM, WGMMA_VALUE_DIM,
};
use crate::sparse_mla::policy::{
    cluster_keeps_waves, cluster_may_merge, narrow_warps, tiles_per_split, MAX_MERGE_CLUSTER,
};
use crate::sparse_mla::{Bf16Kernel, NarrowHeads, SparseMlaLaunch};

const _: () = assert!(MAX_MERGE_CLUSTER <= PORTABLE_CLUSTER_BLOCKS);

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

/// Whether the wgmma kernel serves `heads` heads of rows `row_dim` / `value_dim` on a device of `info`
/// (the reason when not).
pub(super) fn wgmma_unsupported(
    info: &DeviceInfo,
    heads: usize,
    row_dim: usize,
    value_dim: usize,
) -> Option<String> {
    if info.capability != ComputeCapability::SM90 {
        return Some(format!(
            "it needs an sm_90 GPU, this one is {}",
            info.capability
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

/// Launches the bf16 kernel `kernel` picks (the split of the top-k, and the combine when there are
/// several).
pub(super) fn launch_bf16(
    dev: &CudaDevice,
    params: &mut Params,
    launch: &SparseMlaLaunch,
) -> candle_core::Result<()> {
    let (t_len, heads, row_dim, k_len, value_dim) = (
        params.t as usize,
        params.h as usize,
        params.d as usize,
        params.k as usize,
        params.dv as usize,
    );
    let info = device_info(dev)?;
    let wgmma = match launch.kernel {
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
        return launch_split(
            dev,
            params,
            &func,
            (groups, 256, smem),
            tiles,
            split,
            launch,
        );
    }

    if heads <= NARROW_HEADS && row_dim == NARROW_ROW_DIM && value_dim == NARROW_VALUE_DIM {
        let warps = match launch.narrow_heads {
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
            return launch_split(
                dev,
                params,
                &func,
                (1, 32 * warps, smem),
                tiles,
                split,
                launch,
            );
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
    // small batch needs blocks on every SM.)
    let (blocks, splits) = (t_len * groups, tiles.div_ceil(per));
    let cluster = head_tiles == 1 && cluster_may_merge(splits) && launch.cluster_combine && {
        let at_once = resident_clusters(dev, MODULE, &name, threads as u32, smem as u32, None)?;
        cluster_keeps_waves(splits, blocks, resident, at_once[splits])
    };
    launch_split(
        dev,
        params,
        &func,
        (groups, threads, smem),
        tiles,
        Split { per, cluster },
        launch,
    )
}

/// The narrow kernel's entry point with `warps` warps per block.
fn narrow_name(warps: usize) -> String {
    format!("sparse_mla_narrow_dv{NARROW_VALUE_DIM}_d{NARROW_ROW_DIM}_w{warps}")
}
