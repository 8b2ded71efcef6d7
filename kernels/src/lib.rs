//! CUDA kernel blobs for glm5's custom ops.
//!
//! With the `cuda` feature, `build.rs` compiles every `src/*.cu` with nvcc into one fatbin (SASS for sm_90
//! and sm_120, compute_120 PTX for newer GPUs; `*_sm90.cu`: sm_90a only; `*_sm120a.cu`: sm_120a only) and this crate exposes each as a
//! `pub const` byte blob.
//! Without the feature only [`interface`] is here (the registry needs the kernels' limits on any machine),
//! so CPU builds need no CUDA toolchain.

pub mod interface;
pub mod iq_grids;

#[cfg(feature = "emu")]
pub mod emu;

/// `sparse_mla.cu`: sparse absorbed-MLA attention over a paged latent cache (bf16 mma.sync and f32 kernels).
#[cfg(feature = "cuda")]
pub const SPARSE_MLA: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sparse_mla.fatbin"));

/// `sparse_mla_sm90.cu`: the same attention by warpgroup MMA (wgmma), SASS for sm_90a only (Hopper).
#[cfg(feature = "cuda")]
pub const SPARSE_MLA_SM90: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/sparse_mla_sm90.fatbin"));

/// `dsa_indexer.cu`: DSA indexer scores (bf16/FP8 mma.sync, f32) and exact top-k over a paged key cache,
/// and the FP8 key quantiser.
#[cfg(feature = "cuda")]
pub const DSA_INDEXER: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/dsa_indexer.fatbin"));

/// `dsa_indexer_sm90.cu`: the indexer's TMA score kernel by warpgroup MMA (wgmma), SASS for sm_90a only.
#[cfg(feature = "cuda")]
pub const DSA_INDEXER_SM90: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/dsa_indexer_sm90.fatbin"));

/// `moe.cu`: the mixture of experts on the device: routing, grouping by expert, grouped gate/up and down
/// mat-vecs over stacked expert weights, and the per-token sum.
#[cfg(feature = "cuda")]
pub const MOE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/moe.fatbin"));

/// `rms_norm.cu`: RMSNorm as HF computes it, one launch per call.
#[cfg(feature = "cuda")]
pub const RMS_NORM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rms_norm.fatbin"));

/// `argmax.cu`: the index of each row's largest value, a block per row.
#[cfg(feature = "cuda")]
pub const ARGMAX: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/argmax.fatbin"));

/// `swiglu.cu`: SwiGLU of a stacked gate|up product, one launch per call.
#[cfg(feature = "cuda")]
pub const SWIGLU: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/swiglu.fatbin"));

/// `attention_rows.cu`: the rows attention writes into its caches (the MLA latent row), one kernel each.
#[cfg(feature = "cuda")]
pub const ATTENTION_ROWS: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/attention_rows.fatbin"));

/// `weight_only_matmul.cu`: the W8A16 (block-scaled FP8) and W4A16 (NVFP4) mat-vec and dequantise kernels.
#[cfg(feature = "cuda")]
pub const WEIGHT_ONLY_MATMUL: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/weight_only_matmul.fatbin"));

/// `gguf_matmul.cu`: mat-vec and dequantise kernels over the GGUF blocks glm5 decodes (llama.cpp's i-quants
/// IQ1_S ... IQ4_XS, and Q4_K, with its tensor-core mat-vec).
#[cfg(feature = "cuda")]
pub const GGUF_MATMUL: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/gguf_matmul.fatbin"));

/// `nvfp4_mma_sm120a.cu`: the NVFP4 W4A4 GEMM on the block-scaled FP4 tensor-core MMA and its activation
/// quantiser, SASS for sm_120a only (RTX PRO 6000 / RTX 5090).
#[cfg(feature = "cuda")]
pub const NVFP4_MMA_SM120A: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/nvfp4_mma_sm120a.fatbin"));

/// `bench.cu`: microkernels that measure the device's ceilings (the mma.sync bf16 rate).
#[cfg(feature = "cuda")]
pub const BENCH: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/bench.fatbin"));

/// `fp8_quantize.cu`: the W8A8 prefill path's activation quantiser (e4m3 codes and one f32 scale per token and
/// 128 values, in the layout cuBLASLt's block-scaled FP8 GEMM takes).
#[cfg(feature = "cuda")]
pub const FP8_QUANTIZE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fp8_quantize.fatbin"));
