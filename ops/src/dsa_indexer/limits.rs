//! What the CUDA kernels serve (shared by the launcher and the registry, which must not need a GPU).

/// Key widths the mma score kernels are instantiated for.
pub const MMA_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
/// Most heads the mma score kernels hold (two tiles of 16).
pub const MMA_MAX_HEADS: usize = 32;
/// Most keys one query may see on the CUDA kernels: 2048 top-k segments (`MAX_SEGMENTS`) of 2048.
#[cfg(feature = "cuda")]
pub const CUDA_MAX_VISIBLE_KEYS: usize = glm5_kernels::interface::dsa_indexer::MAX_SEGMENTS
    * glm5_kernels::interface::dsa_indexer::SEGMENT;
