//! The interface between glm5's Rust launchers and its CUDA kernels, in one place: the parameter structs
//! the kernels take by value and the constants both sides must agree on.
//!
//! This file is the single source. The launchers (`glm5-ops`) use it as the module
//! `glm5_kernels::interface`; `build.rs` includes it too and writes `glm5_interface.h` (into the build's
//! output folder, on nvcc's include path) with every constant as a `GLM5_*` macro and, per struct, a
//! `GLM5_CHECK_<Struct>()` macro of `static_assert`s on its size, alignment and every field's offset. Each
//! `.cu` file defines its constants from those macros or asserts that its own equal them, and invokes the
//! check after its struct's definition, so a struct or constant changed on one side only fails the build.

/// A `#[repr(C)]` struct whose field layout the CUDA side checks: each field names its CUDA spelling
/// after `=>`. Generates the struct and `FIELDS`, every field's CUDA name and byte offset in order.
macro_rules! c_struct {
    ($(#[$meta:meta])* pub struct $name:ident {
        $($(#[$field_meta:meta])* pub $field:ident: $ty:ty => $cuda:ident,)*
    }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name {
            $($(#[$field_meta])* pub $field: $ty,)*
        }

        impl $name {
            /// Every field's name in the CUDA struct and its byte offset, in declaration order.
            pub const FIELDS: &'static [(&'static str, usize)] =
                &[$((stringify!($cuda), core::mem::offset_of!($name, $field)),)*];
        }
    };
}

c_struct! {
    /// `SparseMlaParams` of `sparse_mla.cuh` (pointers as device addresses). What the kernels read before
    /// their first loads comes first: the first 48 bytes share a 64-byte line of the constant bank with the
    /// memory descriptor every global access needs.
    #[repr(C)]
    pub struct SparseMlaParams {
        /// `I32 [T]`.
        pub token_seq: u64 => token_seq,
        /// `I32 [T, K]`.
        pub indices: u64 => indices,
        /// `[T, H, D]`.
        pub q: u64 => q,
        /// `[num_blocks * block_size, D]`.
        pub kv: u64 => kv,
        pub k: i32 => K,
        pub h: i32 => H,
        pub block_size: i32 => block_size,
        pub max_blocks: i32 => max_blocks,
        /// `I32 [B]`.
        pub seq_lens: u64 => seq_lens,
        /// `I32 [B, max_blocks]`.
        pub block_table: u64 => block_table,
        /// `[T, H, DV]` (one split).
        pub out: u64 => out,
        /// `F32 [T, H]` (one split).
        pub lse: u64 => lse,
        /// `F32 [splits, T, H, DV]` (several splits, not merged in a cluster).
        pub part_out: u64 => part_out,
        /// `F32 [splits, T, H]`.
        pub part_lse: u64 => part_lse,
        pub tiles_per_split: i32 => tiles_per_split,
        pub num_splits: i32 => num_splits,
        pub t: i32 => T,
        pub dv: i32 => DV,
        pub d: i32 => D,
        /// 1: a token's splits are one thread-block cluster and merge in shared memory.
        pub cluster_combine: i32 => cluster_combine,
        /// Softmax scale.
        pub scale: f32 => scale,
    }
}

/// A `CUtensorMap` (`TensorMap` of `dsa_indexer.cu`): the driver's opaque 128-byte, 64-byte aligned
/// descriptor.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default)]
pub struct TensorMap(pub [u64; 16]);

c_struct! {
    /// `DsaParams` of `dsa_indexer.cu` (pointers as device addresses).
    #[repr(C)]
    pub struct DsaParams {
        /// `[T, H, D]` bf16 or f32.
        pub q: u64 => q,
        /// `F32 [T, H]`.
        pub weights: u64 => weights,
        /// `[rows, D]` bf16, f32 or e4m3 bytes.
        pub keys: u64 => keys,
        /// `F32 [rows]` (FP8 layout).
        pub key_scales: u64 => key_scales,
        pub block_table: u64 => block_table,
        pub token_seq: u64 => token_seq,
        pub visible: u64 => visible,
        /// Workspace: `F32 [T, score_stride]`.
        pub scores: u64 => scores,
        /// Workspace: `I32 [T, HIST_STRIDE]`, zero between calls.
        pub hist: u64 => hist,
        /// Workspace: candidate pairs, then per segment counts, offsets and masks.
        pub work: u64 => work,
        /// `I32 [T, K]`.
        pub indices: u64 => indices,
        pub t: i32 => T,
        pub h: i32 => H,
        pub d: i32 => D,
        pub k: i32 => K,
        pub block_size: i32 => block_size,
        pub max_blocks: i32 => max_blocks,
        pub batch: i32 => batch,
        pub score_stride: i32 => score_stride,
        pub positions: i32 => positions,
        pub segments: i32 => segments,
        /// 1: the cluster top-k follows the score kernel.
        pub cluster_topk: i32 => cluster_topk,
        /// The FP8 keys as a `[rows, D]` byte tensor (TMA kernels).
        pub key_map: TensorMap => key_map,
    }
}

c_struct! {
    /// `Nvfp4QuantizeParams` of `nvfp4_mma_sm120a.cu`: the activations' NVFP4 quantiser (pointers as device
    /// addresses).
    #[repr(C)]
    pub struct Nvfp4QuantizeParams {
        /// `[m, k]` f32 or bf16, 16-byte aligned.
        pub x: u64 => x,
        /// `U8 [m, k / 2]`: two e2m1 codes a byte, the even column in the low nibble.
        pub codes: u64 => codes,
        /// `U8 [m, k / 16]`: e4m3 block scales.
        pub scales: u64 => scales,
        /// `F32 [m]`: each row's global scale.
        pub row_scales: u64 => row_scales,
        pub m: i32 => m,
        pub k: i32 => k,
    }
}

c_struct! {
    /// `Nvfp4MmaParams` of `nvfp4_mma_sm120a.cu`: the W4A4 GEMM (pointers as device addresses).
    #[repr(C)]
    pub struct Nvfp4MmaParams {
        /// `U8 [m, k / 2]`, `U8 [m, k / 16]`, `F32 [m]`: the quantised activations.
        pub a_codes: u64 => a_codes,
        pub a_scales: u64 => a_scales,
        pub a_row_scales: u64 => a_row_scales,
        /// `U8 [n, k / 2]`, `U8 [n, k / 16]`: the weight's packed codes and e4m3 scales.
        pub b_packed: u64 => b_packed,
        pub b_scales: u64 => b_scales,
        /// `[m, n]` f32 or bf16.
        pub y: u64 => y,
        pub m: i32 => m,
        pub n: i32 => n,
        pub k: i32 => k,
        /// The weight's `weight_scale_2`.
        pub b_global_scale: f32 => b_global_scale,
    }
}

c_struct! {
    /// `Fp8QuantizeParams` of `fp8_quantize.cu`: the activations' per-token FP8 quantiser of the W8A8 prefill
    /// path (pointers as device addresses).
    #[repr(C)]
    pub struct Fp8QuantizeParams {
        /// `[m, k]` f32 or bf16.
        pub x: u64 => x,
        /// `U8 [m_pad, k]`: e4m3 codes (rows `m..m_pad` zeros).
        pub codes: u64 => codes,
        /// `F32 [k / GROUP, m_pad]`: one scale per token and group, the tokens contiguous.
        pub scales: u64 => scales,
        pub m: i32 => m,
        pub m_pad: i32 => m_pad,
        pub k: i32 => k,
    }
}

c_struct! {
    /// `Q4kRowParams` of `gguf_matmul.cu`: Q4_K times one bf16 activation row on the tensor cores
    /// (`q4k_mma_matvec1_bf16`, a programmatic dependent launch; pointers as device addresses).
    #[repr(C)]
    pub struct Q4kRowParams {
        /// `[1, k]` bf16, 16-byte aligned.
        pub x: u64 => x,
        /// `U8 [n, k / 256 · 144]`: the Q4_K blocks, 16-byte aligned.
        pub w: u64 => w,
        /// `[1, n]` bf16.
        pub y: u64 => y,
        pub n: i32 => n,
        pub k: i32 => k,
    }
}

/// The constants of `sparse_mla.cu` and `sparse_mla_sm90.cu` (`GLM5_SPARSE_MLA_*` in the header).
pub mod sparse_mla {
    /// Keys per tile (`BN`).
    pub const TILE: usize = 32;
    /// bf16 of padding per shared-memory row.
    pub const ROW_PAD: usize = 8;
    /// Most splits of a top-k the combine merges.
    pub const MAX_SPLITS: usize = 128;
    /// Row width the bf16 kernel holds beyond the value columns.
    pub const MAX_ROPE: usize = 64;
    /// f32 stride of a partial-score row (`LDS`).
    pub const PARTIAL_SCORE_STRIDE: usize = TILE + 8;
    /// The block combine: warps per block and value columns per block.
    pub const COMBINE_GROUPS: usize = 8;
    pub const COMBINE_COLUMNS: usize = 128;
    /// The one-wait combine: most splits and warps per block.
    pub const COMBINE_CHUNK: usize = 16;
    pub const COMBINE_ROW_WARPS: usize = 4;
    /// The narrow kernel: heads per block (the mma's N) and keys per warp (its M).
    pub const NARROW_HEADS: usize = 8;
    pub const NARROW_KEYS: usize = 16;
    /// The wgmma kernel: heads per block, row and value widths, key tiles in its ring.
    pub const WGMMA_HEADS: usize = 64;
    pub const WGMMA_ROW_DIM: usize = 576;
    pub const WGMMA_VALUE_DIM: usize = 512;
    pub const WGMMA_STAGES: usize = 5;
}

/// The constants of `dsa_indexer.cu` (`GLM5_DSA_INDEXER_*` in the header).
pub mod dsa_indexer {
    /// Keys per score tile.
    pub const TILE_KEYS: usize = 64;
    /// Threads of a score block (`SCORE_WARPS * 32`).
    pub const SCORE_THREADS: usize = 128;
    /// Per-row histogram words: 2048 bins, the top-k kernels' 4 slots, 2048 fine bins, 128 group sums.
    pub const HIST_STRIDE: usize = 2048 + 4 + 2048 + 128;
    /// Positions per top-k segment (`SEG`) and the threads of a segment's block (`SEG_THREADS`).
    pub const SEGMENT: usize = 2048;
    pub const SEGMENT_THREADS: usize = 256;
    /// Most segments per row.
    pub const MAX_SEGMENTS: usize = 2048;
    /// Words per segment of a row's top-k work area after its candidate pairs: the count above the
    /// threshold bin, the output offset and the bit mask of the selected positions.
    pub const WORK_PER_SEGMENT: usize = 2 + SEGMENT / 32;
    /// Threads of the threshold kernel.
    pub const TOPK_THREADS: usize = 512;
    /// Candidates the threshold kernel stages in shared memory (value and position each).
    pub const STAGED_CANDIDATES: usize = 8192;
    /// Segments a block of the warp-a-segment emit, and the selected positions above which a segment is
    /// dense.
    pub const EMIT_SEGMENTS: usize = 8;
    pub const DIRECT_STORES: usize = 256;
    /// The cluster top-k: blocks per cluster, threads per block, dynamic shared memory of a block.
    pub const CLUSTER_BLOCKS: usize = 8;
    pub const CLUSTER_THREADS: usize = 512;
    pub const CLUSTER_SHARED_BYTES: usize = 80 * 1024;
    /// The grouped prefill score kernel: queries per block, dynamic shared memory of a block.
    pub const GROUP_TOKENS: usize = 4;
    pub const GROUP_SHARED_BYTES: usize = 112 * 1024;
}

/// The constants of `weight_only_matmul.cu` (`GLM5_WEIGHT_ONLY_*` in the header): the FP8 (W8A16) and NVFP4
/// (W4A16) mat-vec kernels.
pub mod weight_only {
    /// Most activation rows one mat-vec launch takes (each warp keeps one f32 sum per row).
    pub const MAX_ROWS: usize = 16;
    /// Warps per block: groups of [`column_warps`] of them, each computing one output column.
    pub const WARPS: usize = 4;

    /// Warps reading one output column of a mat-vec whose rows hold `chunks_per_row` chunks (the weights a
    /// thread takes at a time): the most, a power of two up to [`WARPS`], that still give each thread at
    /// least two chunks. One warp per column leaves a long row's reads to 32 threads one after another, and
    /// the launch with a long last wave (GLM-5's [6144, 16384] FP8 mat-vec reached 41% of the copy rate so);
    /// splitting the row keeps more loads in flight with shorter-lived blocks.
    pub const fn column_warps(chunks_per_row: usize) -> usize {
        let mut warps = WARPS;
        while warps > 1 && chunks_per_row < 2 * 32 * warps {
            warps /= 2;
        }
        warps
    }
    /// Threads of the dequantise kernel's blocks.
    pub const DEQUANTIZE_THREADS: usize = 256;
    /// The Q4_K tensor-core mat-vec (`gguf_matmul.cu`): output rows per block (an mma's M), and the most warps
    /// splitting a block's rows along `in`.
    pub const Q4K_MMA_ROW_TILE: usize = 16;
    pub const Q4K_MMA_MAX_WARPS: usize = 8;
    /// Warps of a Q4_K tensor-core block over rows of `k` values: about two of the row's 256-value blocks a
    /// warp, at most `Q4K_MMA_MAX_WARPS`.
    pub const fn q4k_mma_warps(k: usize) -> usize {
        let warps = k / 256 / 2;
        if warps < 1 {
            1
        } else if warps > Q4K_MMA_MAX_WARPS {
            Q4K_MMA_MAX_WARPS
        } else {
            warps
        }
    }
    /// The dynamic shared memory of the one-row Q4_K kernels (`q4k_mma::row::staged_bytes` in `q4k_mma.cuh`)
    /// for `k` activations: the values quantised to int8, two f32 a 32-value sub-block (d8 and d8 · Σ q8),
    /// 64 bytes of zeros.
    pub const fn q4k_row_staged_bytes(k: usize) -> usize {
        k + 8 * (k / 32) + 64
    }
    /// Blocks of a launch that walks `tiles` tiles of output rows, a block taking tiles `blockIdx`, `+ grid`,
    /// ... (the one-row Q4_K kernels), on a device that holds `resident` of its blocks at once: a block a tile
    /// up to that, else as few tiles a block as one wave allows, the blocks given equal counts (1,536 tiles
    /// on 396 blocks: 384 blocks of 4, where 396 would leave a fifth pass to 348 of them).
    pub const fn tile_loop_blocks(tiles: usize, resident: usize) -> usize {
        if resident == 0 || tiles <= resident {
            return tiles;
        }
        tiles.div_ceil(tiles.div_ceil(resident))
    }
    /// Dynamic shared memory a launch may take without opting in (CUDA's default limit).
    pub const DEFAULT_DYNAMIC_SHARED_BYTES: usize = 48 * 1024;
}

/// The constants of `attention_rows.cu`'s `head_products_*` (`GLM5_HEAD_PRODUCT_*` in the header).
pub mod attention_rows {
    /// Columns of one block: 8 lanes of 8 values.
    pub const HEAD_PRODUCT_COLUMNS: usize = 64;
    /// Warps of its blocks (each takes 4 rows at a time).
    pub const HEAD_PRODUCT_WARPS: usize = 8;
}

/// The constants of `moe.cu`'s router kernel (`GLM5_ROUTER_*` in the header).
pub mod moe {
    /// Experts and tokens of one block of `moe_router_logits_*` (every thread keeps their product of f32 sums).
    pub const ROUTER_EXPERTS: usize = 2;
    pub const ROUTER_TOKENS: usize = 4;
    /// Threads of its blocks (`ROUTER_THREADS` in `moe.cu`).
    pub const ROUTER_THREADS: usize = 256;

    /// Threads of `moe_route`'s blocks for `n_experts` experts: one each, in whole warps.
    pub const fn route_threads(n_experts: usize) -> usize {
        n_experts.div_ceil(32) * 32
    }
    /// `moe_route`'s dynamic shared memory: a score and a choice per expert, and each warp's
    /// min(`top_k`, 32) candidates (value and index).
    pub const fn route_shared_bytes(n_experts: usize, top_k: usize) -> usize {
        let per_warp = if top_k < 32 { top_k } else { 32 };
        4 * (2 * n_experts + 2 * (route_threads(n_experts) / 32) * per_warp)
    }
}

/// The constants of `nvfp4_mma_sm120a.cu` (`GLM5_NVFP4_MMA_*` in the header): the W4A4 GEMM on sm_120a's
/// block-scaled FP4 MMA and its activation quantiser.
pub mod nvfp4_mma {
    /// Values sharing one e4m3 scale (activations and weight alike).
    pub const GROUP: usize = 16;
    /// Threads of the quantiser's blocks (one block per row).
    pub const QUANTIZE_THREADS: usize = 256;
    /// The GEMM's output tile per block: rows (M) and columns (N).
    pub const TILE_M: usize = 128;
    pub const TILE_N: usize = 128;
    /// Values of K per shared-memory stage: `k` must be a multiple of it.
    pub const TILE_K: usize = 128;
    /// Threads of a GEMM block (8 warps of 64 x 32 outputs).
    pub const THREADS: usize = 256;
}

/// The constants of `fp8_quantize.cu` (`GLM5_FP8_QUANTIZE_*` in the header): the W8A8 prefill path's
/// activation quantiser.
pub mod fp8_quantize {
    /// Values of a token sharing one f32 scale (cuBLASLt's `VEC128_32F` blocks along K).
    pub const GROUP: usize = 128;
    /// Threads of the quantiser's blocks (a warp per group).
    pub const THREADS: usize = 256;
    /// Activation rows are padded to a multiple of this: cuBLASLt's block-scaled FP8 GEMM needs M and N
    /// multiples of 4 (its scale layouts) and every FP8 matrix dimension 16-byte aligned; 16 rows of e4m3
    /// satisfy both.
    pub const ROW_MULTIPLE: usize = 16;
}

/// Every constant as `(header name, value)`, for `build.rs`.
pub const CONSTANTS: &[(&str, usize)] = &[
    (
        "GLM5_HEAD_PRODUCT_COLUMNS",
        attention_rows::HEAD_PRODUCT_COLUMNS,
    ),
    (
        "GLM5_HEAD_PRODUCT_WARPS",
        attention_rows::HEAD_PRODUCT_WARPS,
    ),
    ("GLM5_SPARSE_MLA_TILE", sparse_mla::TILE),
    ("GLM5_SPARSE_MLA_ROW_PAD", sparse_mla::ROW_PAD),
    ("GLM5_SPARSE_MLA_MAX_SPLITS", sparse_mla::MAX_SPLITS),
    ("GLM5_SPARSE_MLA_MAX_ROPE", sparse_mla::MAX_ROPE),
    (
        "GLM5_SPARSE_MLA_PARTIAL_SCORE_STRIDE",
        sparse_mla::PARTIAL_SCORE_STRIDE,
    ),
    ("GLM5_SPARSE_MLA_COMBINE_GROUPS", sparse_mla::COMBINE_GROUPS),
    (
        "GLM5_SPARSE_MLA_COMBINE_COLUMNS",
        sparse_mla::COMBINE_COLUMNS,
    ),
    ("GLM5_SPARSE_MLA_COMBINE_CHUNK", sparse_mla::COMBINE_CHUNK),
    (
        "GLM5_SPARSE_MLA_COMBINE_ROW_WARPS",
        sparse_mla::COMBINE_ROW_WARPS,
    ),
    ("GLM5_SPARSE_MLA_NARROW_HEADS", sparse_mla::NARROW_HEADS),
    ("GLM5_SPARSE_MLA_NARROW_KEYS", sparse_mla::NARROW_KEYS),
    ("GLM5_SPARSE_MLA_WGMMA_HEADS", sparse_mla::WGMMA_HEADS),
    ("GLM5_SPARSE_MLA_WGMMA_ROW_DIM", sparse_mla::WGMMA_ROW_DIM),
    (
        "GLM5_SPARSE_MLA_WGMMA_VALUE_DIM",
        sparse_mla::WGMMA_VALUE_DIM,
    ),
    ("GLM5_SPARSE_MLA_WGMMA_STAGES", sparse_mla::WGMMA_STAGES),
    ("GLM5_DSA_INDEXER_TILE_KEYS", dsa_indexer::TILE_KEYS),
    ("GLM5_DSA_INDEXER_SCORE_THREADS", dsa_indexer::SCORE_THREADS),
    ("GLM5_DSA_INDEXER_HIST_STRIDE", dsa_indexer::HIST_STRIDE),
    ("GLM5_DSA_INDEXER_SEGMENT", dsa_indexer::SEGMENT),
    (
        "GLM5_DSA_INDEXER_SEGMENT_THREADS",
        dsa_indexer::SEGMENT_THREADS,
    ),
    ("GLM5_DSA_INDEXER_MAX_SEGMENTS", dsa_indexer::MAX_SEGMENTS),
    (
        "GLM5_DSA_INDEXER_WORK_PER_SEGMENT",
        dsa_indexer::WORK_PER_SEGMENT,
    ),
    ("GLM5_DSA_INDEXER_TOPK_THREADS", dsa_indexer::TOPK_THREADS),
    (
        "GLM5_DSA_INDEXER_STAGED_CANDIDATES",
        dsa_indexer::STAGED_CANDIDATES,
    ),
    ("GLM5_DSA_INDEXER_EMIT_SEGMENTS", dsa_indexer::EMIT_SEGMENTS),
    ("GLM5_DSA_INDEXER_DIRECT_STORES", dsa_indexer::DIRECT_STORES),
    (
        "GLM5_DSA_INDEXER_CLUSTER_BLOCKS",
        dsa_indexer::CLUSTER_BLOCKS,
    ),
    (
        "GLM5_DSA_INDEXER_CLUSTER_THREADS",
        dsa_indexer::CLUSTER_THREADS,
    ),
    (
        "GLM5_DSA_INDEXER_CLUSTER_SHARED_BYTES",
        dsa_indexer::CLUSTER_SHARED_BYTES,
    ),
    ("GLM5_DSA_INDEXER_GROUP_TOKENS", dsa_indexer::GROUP_TOKENS),
    (
        "GLM5_DSA_INDEXER_GROUP_SHARED_BYTES",
        dsa_indexer::GROUP_SHARED_BYTES,
    ),
    ("GLM5_WEIGHT_ONLY_MAX_ROWS", weight_only::MAX_ROWS),
    ("GLM5_WEIGHT_ONLY_WARPS", weight_only::WARPS),
    ("GLM5_Q4K_MMA_MAX_WARPS", weight_only::Q4K_MMA_MAX_WARPS),
    (
        "GLM5_WEIGHT_ONLY_DEQUANTIZE_THREADS",
        weight_only::DEQUANTIZE_THREADS,
    ),
    ("GLM5_ROUTER_EXPERTS", moe::ROUTER_EXPERTS),
    ("GLM5_ROUTER_TOKENS", moe::ROUTER_TOKENS),
    ("GLM5_ROUTER_THREADS", moe::ROUTER_THREADS),
    ("GLM5_NVFP4_MMA_GROUP", nvfp4_mma::GROUP),
    (
        "GLM5_NVFP4_MMA_QUANTIZE_THREADS",
        nvfp4_mma::QUANTIZE_THREADS,
    ),
    ("GLM5_NVFP4_MMA_TILE_M", nvfp4_mma::TILE_M),
    ("GLM5_NVFP4_MMA_TILE_N", nvfp4_mma::TILE_N),
    ("GLM5_NVFP4_MMA_TILE_K", nvfp4_mma::TILE_K),
    ("GLM5_NVFP4_MMA_THREADS", nvfp4_mma::THREADS),
    ("GLM5_FP8_QUANTIZE_GROUP", fp8_quantize::GROUP),
    ("GLM5_FP8_QUANTIZE_THREADS", fp8_quantize::THREADS),
    ("GLM5_FP8_QUANTIZE_ROW_MULTIPLE", fp8_quantize::ROW_MULTIPLE),
];

/// The parameter structs as `(CUDA name, size, alignment, fields)`, for `build.rs`.
pub const STRUCTS: &[(&str, usize, usize, &[(&str, usize)])] = &[
    (
        "SparseMlaParams",
        core::mem::size_of::<SparseMlaParams>(),
        core::mem::align_of::<SparseMlaParams>(),
        SparseMlaParams::FIELDS,
    ),
    (
        "DsaParams",
        core::mem::size_of::<DsaParams>(),
        core::mem::align_of::<DsaParams>(),
        DsaParams::FIELDS,
    ),
    (
        "Nvfp4QuantizeParams",
        core::mem::size_of::<Nvfp4QuantizeParams>(),
        core::mem::align_of::<Nvfp4QuantizeParams>(),
        Nvfp4QuantizeParams::FIELDS,
    ),
    (
        "Nvfp4MmaParams",
        core::mem::size_of::<Nvfp4MmaParams>(),
        core::mem::align_of::<Nvfp4MmaParams>(),
        Nvfp4MmaParams::FIELDS,
    ),
    (
        "Fp8QuantizeParams",
        core::mem::size_of::<Fp8QuantizeParams>(),
        core::mem::align_of::<Fp8QuantizeParams>(),
        Fp8QuantizeParams::FIELDS,
    ),
    (
        "Q4kRowParams",
        core::mem::size_of::<Q4kRowParams>(),
        core::mem::align_of::<Q4kRowParams>(),
        Q4kRowParams::FIELDS,
    ),
];

// The Rust side's own check of what the CUDA side's layout is written for: pointers 8 bytes, the tensor map
// 128 bytes at 64-byte alignment.
const _: () = assert!(core::mem::size_of::<TensorMap>() == 128);
const _: () = assert!(core::mem::align_of::<TensorMap>() == 64);
const _: () = assert!(core::mem::size_of::<SparseMlaParams>() == 128);
const _: () = assert!(core::mem::size_of::<DsaParams>() == 320);
const _: () = assert!(core::mem::size_of::<Nvfp4QuantizeParams>() == 40);
const _: () = assert!(core::mem::size_of::<Nvfp4MmaParams>() == 64);
const _: () = assert!(core::mem::size_of::<Fp8QuantizeParams>() == 40);
