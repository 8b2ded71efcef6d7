//! GLM-5 (`GlmMoeDsaForCausalLM`, `model_type: glm_moe_dsa`) on candle: the validated config, the
//! safetensors checkpoint reader, the module graph and its KV cache.

pub mod cache;
pub mod config;
pub mod error;
pub mod glm5;
pub mod weights;

pub use cache::KvCache;
pub use config::{Config, MlpKind};
pub use error::{ModelError, Result};
pub use glm5::{AttentionMode, Glm5ForCausalLM, LayerBackends};
pub use weights::Checkpoint;
