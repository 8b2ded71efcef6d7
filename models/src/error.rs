//! Every way loading or running a model can fail, each naming its cause.

use std::path::PathBuf;

/// Errors from reading a config or checkpoint and from running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config.json is not valid JSON for glm_moe_dsa: {0}")]
    ConfigJson(#[from] serde_json::Error),
    #[error(
        "config.json has model_type {found:?}; glm5 runs \"glm_moe_dsa\" (GlmMoeDsaForCausalLM)"
    )]
    WrongModelType { found: String },
    #[error("config.json: `{field}` is missing")]
    MissingField { field: &'static str },
    #[error("config.json: `{field}` {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error("config.json: {what} is not supported by glm5 yet")]
    Unsupported { what: String },

    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error("checkpoint has no tensor `{name}`")]
    MissingTensor { name: String },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` is stored as {dtype}; glm5 loads f32, bf16 and f16 checkpoints")]
    TensorDtype { name: String, dtype: String },
    #[error(transparent)]
    Gguf(Box<crate::weights::gguf::GgufError>),
    #[error("tensor `{tensor}`: {source}")]
    QuantizedMatmul {
        tensor: String,
        #[source]
        source: Box<glm5_ops::quantized_matmul::QuantizedDispatchError>,
    },

    #[error(
        "token id {token} at position {position} is outside the vocabulary (size {vocab_size})"
    )]
    TokenOutOfRange {
        token: u32,
        position: usize,
        vocab_size: usize,
    },
    #[error("empty input: forward needs at least one token")]
    EmptyInput,
    #[error("positions {start}..{end} exceed the model's context of {max_positions} tokens")]
    ContextOverflow {
        start: usize,
        end: usize,
        max_positions: usize,
    },
    #[error("KV cache full: {needed} tokens needed, capacity {capacity}")]
    CacheFull { needed: usize, capacity: usize },
    #[error("start_pos {start_pos} does not continue the KV cache, which holds {cached} tokens")]
    CacheMismatch { start_pos: usize, cached: usize },
    #[error("KV cache was built for a different model: {0}")]
    CacheShape(String),

    #[error(transparent)]
    Plan(Box<crate::plan::PlanError>),
    #[error(transparent)]
    Device(#[from] glm5_ops::DeviceError),
    #[error("the plan does not match the model or devices: {0}")]
    PlanDevices(String),

    #[error(transparent)]
    Op(#[from] glm5_ops::OpError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

// Boxed, as the plan error below: a GGUF error names a file, a tensor and its dims.
impl From<crate::weights::gguf::GgufError> for ModelError {
    fn from(error: crate::weights::gguf::GgufError) -> Self {
        Self::Gguf(Box::new(error))
    }
}

// Boxed: a plan error is large and rare, and `Result<_, ModelError>` should stay small on every call.
impl From<crate::plan::PlanError> for ModelError {
    fn from(error: crate::plan::PlanError) -> Self {
        Self::Plan(Box::new(error))
    }
}
