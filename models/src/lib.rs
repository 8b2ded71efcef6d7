//! GLM-5 (`GlmMoeDsaForCausalLM`, `model_type: glm_moe_dsa`) on candle: the validated config, the
//! safetensors checkpoint reader, the sizes and plan (placement + backend dispatch) the graph is built
//! from, the module graph and its KV caches (one sequence's, and the paged pool of a batch).

pub mod cache;
pub mod config;
pub mod error;
pub mod glm5;
pub mod paged_cache;
pub mod plan;
pub mod profile;
pub mod quantization;
pub mod sizes;
mod units;
pub mod weights;

pub use cache::KvCache;
pub use config::{Config, MlpKind};
pub use error::{ModelError, Result};
pub use glm5::{DecodeGraphs, Glm5ForCausalLM, GraphStats, LayerBackends, MtpCache, RowOps};
pub use paged_cache::{PagedCacheOptions, PagedKvCache, SeqChunk, SeqId, DEFAULT_BLOCK_SIZE};
pub use plan::{
    fmt_bytes, AttentionMode, DeviceUsage, LayerPlan, OpPlan, Plan, PlanError, PlanOptions,
};
pub use quantization::Quantization;
pub use weights::{Checkpoint, Format, Matrix, TensorSource};
