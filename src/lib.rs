#![warn(missing_docs)]
//! glm5: GLM-5 (`GlmMoeDsaForCausalLM`) inference on candle.
//!
//! The layers, each knowing only the one below: `glm5-kernels` (CUDA sources) → `glm5-ops` (DSA indexer,
//! sparse MLA) → `glm5-models` (config, checkpoint, module graph, KV cache) → this crate (the runtime).

pub mod chat;
pub mod embedded;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod hub;
pub mod hub_gguf;
pub mod model;
pub mod plan_cli;
pub mod reasoning;
pub mod sampling;
pub mod serve;
pub mod tokenizer;
pub mod tool_calls;
pub mod viz;

pub use candle_core;
pub use candle_nn;
pub use glm5_models as models;
pub use glm5_ops as ops;

pub use chat::{ChatOptions, Message};
pub use error::{Error, Result};
pub use generate::{
    FinishReason, GeneratedToken, Generation, GenerationParams, GenerationStats, SequenceCache,
};
pub use glm5_models::{
    AttentionMode, Checkpoint, Config, DecodeGraphs, Glm5ForCausalLM, GraphStats, KvCache,
    ModelError, Plan, PlanOptions,
};
pub use glm5_ops::{DeviceDesc, KeyFormat, Op, Registry};
pub use model::{Glm5, LoadOptions, TokenProbability};
pub use viz::SelectionMap;
