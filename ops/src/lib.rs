//! The operations GLM-5 needs beyond stock candle: the DSA lightning indexer, which picks the keys each
//! query attends to, and sparse absorbed-MLA attention over those latent rows.
//!
//! Each op is a folder (`sparse_mla/`, `dsa_indexer/`, `moe/`): its contract and public functions in `mod.rs`,
//! the plain reference built from candle tensor ops in `reference.rs`, what its CUDA kernels serve in
//! `limits.rs`, its registry entries in `entries.rs`, the launcher's pure policies in `policy.rs` and the
//! CUDA launcher in `cuda/`. Every implementation of an op is an entry of the backend registry
//! (`registry.rs`, gathered in `builtin.rs`); the public functions run the registry's choice for the inputs'
//! device, and the model picks one per layer and op when its graph is built, from the device's description
//! (`device.rs`, read from hardware by `probe.rs`).
//!
//! The weight-only quantised matmuls (`fp8_matmul`: W8A16, `nvfp4_matmul`: W4A16, `gguf_matmul`: GGUF's
//! i-quants) and GGUF's `quantized_matmul` (candle's `QMatMul`) have their own small backend lists (`weight_only.rs`, `quantized_matmul/entries.rs`):
//! they are chosen per weight when the graph is built.
//!
//! `step_graph` captures a step's launches into a CUDA graph and refills its inputs in place between replays
//! (the model's decode graphs are built on it).
//!
//! Module dependencies run one way: `device` <- `cuda` (driver) <- `probe`; `registry` <- op folders <-
//! `builtin`.

pub mod absorbed_query;
pub mod argmax;
pub mod attention_rows;
mod builtin;
pub mod cache_rows;
#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
pub mod dsa_indexer;
pub mod error;
pub mod fp8_matmul;
pub mod gguf_matmul;
pub mod head_products;
pub mod index_key_rows;
pub mod index_keys;
pub mod latent_rows;
pub mod moe;
pub mod nvfp4_matmul;
mod probe;
pub mod quantized_matmul;
pub mod registry;
pub mod rms_norm;
pub mod rope_leading;
pub mod sparse_mla;
pub mod step_graph;
pub mod swiglu;
pub mod weight_only;
#[cfg(feature = "cuda")]
mod weight_only_cuda;

pub use device::{ComputeCapability, DeviceDesc, DeviceError, DeviceFamily, DeviceKind};
pub use dsa_indexer::{
    dsa_indexer, dsa_indexer_paged, dsa_indexer_paged_device_visible, dsa_indexer_paged_reference,
    dsa_indexer_paged_with, dsa_indexer_reference, DsaIndexerLaunch, PagedIndexKeys, ScoreKernel,
    TopKPath, VisibleKeys,
};
#[cfg(feature = "cuda")]
pub use dsa_indexer::{time_stages, StageTimes};
pub use error::{OpError, Result};
pub use index_keys::{quantize_fp8, IndexKeys, KeyFormat};
pub use registry::{
    CacheLayout, Choice, DispatchError, Entry, Kernel, Limit, Op, OpSpec, Reason, Registry,
    Rejection, Serves, Verdict,
};
pub use sparse_mla::{
    sparse_mla, sparse_mla_paged, sparse_mla_paged_reference, sparse_mla_paged_with,
    sparse_mla_reference, NarrowHeads, PagedLatentCache, SparseMlaLaunch,
};
