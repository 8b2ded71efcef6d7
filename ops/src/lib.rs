//! The operations GLM-5 needs beyond stock candle: the DSA lightning indexer, which picks the
//! keys each query attends to, and sparse absorbed-MLA attention over those latent rows. Each op
//! lives in its own file whose doc comment is its contract; the bodies here are plain,
//! device-agnostic references built from candle tensor ops. The public functions are exactly what
//! the model calls, so a faster backend (a CUDA `CustomOp`, coming later) replaces a body without
//! touching the model.

#[cfg(feature = "cuda")]
mod cuda;
pub mod dsa_indexer;
pub mod error;
pub mod index_keys;
pub mod sparse_mla;

pub use dsa_indexer::{dsa_indexer, dsa_indexer_backend, dsa_indexer_paged, PagedIndexKeys};
pub use index_keys::{quantize_fp8, IndexKeys};
pub use error::{OpError, Result};
#[cfg(feature = "cuda")]
pub use sparse_mla::set_poison_outputs;
pub use sparse_mla::{
    sparse_mla, sparse_mla_backend, sparse_mla_paged, sparse_mla_reference, PagedLatentCache,
};
