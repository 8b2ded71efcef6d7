//! The limits of `kernels/src/sparse_mla.cu`, compiled with or without the `cuda` feature: the launcher
//! obeys them and the registry validates against them (so a plan for an assumed GPU knows them too). The
//! constants the CUDA side shares come from `glm5_kernels::interface`, which the kernels' build checks.

use glm5_kernels::interface::sparse_mla as cuda;

/// Keys per tile of the bf16 kernel (`BN` in the .cu file).
pub const TILE: usize = cuda::TILE;
pub const ROW_PAD: usize = cuda::ROW_PAD;
/// Most splits the combine kernel merges (`MAX_SPLITS` in the .cu file).
pub const MAX_SPLITS: usize = cuda::MAX_SPLITS;
/// Tiles per split the registry's shared-memory check assumes; the launcher sizes the kernel's row table
/// for each launch and goes beyond this (one split per query) where the device's shared memory allows.
pub const MAX_TILES_PER_SPLIT: usize = 32;
/// Value widths the bf16 kernel is instantiated for.
pub const BF16_VALUE_DIMS: [usize; 6] = [16, 32, 64, 128, 256, 512];
/// Row width the bf16 kernel holds beyond the value columns (`MAX_ROPE` in the .cu file).
pub const MAX_ROPE: usize = cuda::MAX_ROPE;
/// f32 stride of a partial-score row (`LDS` in the .cu file).
pub const PARTIAL_SCORE_STRIDE: usize = cuda::PARTIAL_SCORE_STRIDE;
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
pub const WGMMA_HEADS: usize = cuda::WGMMA_HEADS;
pub const WGMMA_ROW_DIM: usize = cuda::WGMMA_ROW_DIM;
pub const WGMMA_VALUE_DIM: usize = cuda::WGMMA_VALUE_DIM;

/// Key tiles in the wgmma kernel's ring (`STAGES` in the .cu file).
pub const WGMMA_STAGES: usize = cuda::WGMMA_STAGES;

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
    pub const NARROW_KEYS: usize = super::cuda::NARROW_KEYS;
    pub const NARROW_WARPS: [usize; 3] = [8, 4, 2];
    #[cfg(feature = "cuda")]
    pub const NARROW_HEADS: usize = super::cuda::NARROW_HEADS;
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
