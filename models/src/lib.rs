//! GLM-5 (`GlmMoeDsaForCausalLM`, `model_type: glm_moe_dsa`) on candle: the validated config, the
//! safetensors checkpoint reader, the sizes and plan (placement + backend dispatch) the graph is built
//! from, the module graph and its KV cache.

pub mod cache;
pub mod config;
pub mod error;
pub mod glm5;
pub mod plan;
pub mod quantization;
pub mod sizes;
mod units;
pub mod weights;

pub use cache::KvCache;
pub use config::{Config, MlpKind};
pub use error::{ModelError, Result};
pub use glm5::{Glm5ForCausalLM, LayerBackends};
pub use plan::{
    fmt_bytes, AttentionMode, DeviceUsage, LayerPlan, OpPlan, Plan, PlanError, PlanOptions,
};
pub use quantization::Quantization;
pub use weights::{Checkpoint, Format, Matrix, TensorSource};
