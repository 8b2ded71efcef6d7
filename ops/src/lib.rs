//! The operations GLM-5 needs beyond stock candle: the DSA lightning indexer, which picks the
//! keys each query attends to, and sparse absorbed-MLA attention over those latent rows. Each op
//! lives in its own file whose doc comment is its contract; the bodies here are plain,
//! device-agnostic references built from candle tensor ops. The public functions are exactly what
//! the model calls. Every implementation of an op is an entry of the backend registry (`registry.rs`); the
//! model picks one per layer and op when its graph is built, from the device's description (`device.rs`).

#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
pub mod dsa_indexer;
pub mod error;
pub mod index_keys;
pub mod quantized_matmul;
pub mod registry;
pub mod sparse_mla;

pub use device::{ComputeCapability, DeviceDesc, DeviceError, DeviceFamily, DeviceKind};
pub use dsa_indexer::{
    dsa_indexer, dsa_indexer_cuda, dsa_indexer_paged, dsa_indexer_paged_device_visible,
    dsa_indexer_reference, PagedIndexKeys,
};
#[cfg(feature = "cuda")]
pub use dsa_indexer::{
    set_score_kernel, set_top_k_path, time_stages, ScoreKernel, StageTimes, TopKPath,
};
pub use error::{OpError, Result};
pub use index_keys::{quantize_fp8, IndexKeys, KeyFormat};
pub use registry::{
    CacheLayout, Choice, DispatchError, Entry, Kernel, Limit, Op, OpSpec, Reason, Registry,
    Rejection, Serves, Verdict,
};
#[cfg(feature = "cuda")]
pub use sparse_mla::{set_cluster_combine, set_narrow_heads, set_poison_outputs, NarrowHeads};
pub use sparse_mla::{
    sparse_mla, sparse_mla_cuda, sparse_mla_cuda_wgmma, sparse_mla_paged, sparse_mla_paged_with,
    sparse_mla_reference, Bf16Kernel, PagedLatentCache,
};
