//! Every way loading or running a model can fail, each naming its cause.

use std::path::PathBuf;

use glm5_ops::DispatchError;

use crate::units::fmt_bytes;

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
    #[error("quantisation config: `{field}` {reason}")]
    QuantizationConfig { field: String, reason: String },
    #[error("tensor `{tensor}`: {problem}")]
    QuantizedTensor {
        tensor: String,
        problem: ScaleProblem,
    },

    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error("checkpoint has no tensor `{name}`")]
    MissingTensor { name: String },
    #[error("tensor `{tensor}` cannot be quantised to FP8 at load: {source}")]
    QuantizeAtLoad {
        tensor: String,
        #[source]
        source: Box<glm5_ops::OpError>,
    },
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
    WeightOnlyMatmul {
        tensor: String,
        #[source]
        source: Box<glm5_ops::weight_only::WeightOnlyDispatchError>,
    },
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
    #[error("the model was loaded without its MTP layer (load it with PlanOptions::mtp / --mtp)")]
    NoMtpLayer,
    #[error(
        "the MTP layer takes one hidden state per token: {tokens} tokens, hidden states {hidden:?}"
    )]
    MtpInput { tokens: usize, hidden: Vec<usize> },
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
    #[error("paged KV pool: {0}")]
    PagedCache(String),
    #[error("sequence #{seq} is not in the KV pool (never added, or already freed)")]
    UnknownSequence { seq: u64 },
    #[error("sequence #{seq} appears more than once in one batch")]
    DuplicateSequence { seq: u64 },
    #[error("sequence #{seq}: start_pos {start_pos} does not continue its {cached} cached tokens")]
    SequenceMismatch {
        seq: u64,
        start_pos: usize,
        cached: usize,
    },
    #[error(
        "KV pool exhausted: the batch needs {needed} more blocks of {block_size} tokens, {free} are free"
    )]
    PoolExhausted {
        needed: usize,
        free: usize,
        block_size: usize,
    },

    #[error(transparent)]
    Plan(Box<PlanError>),
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

/// What is wrong with a quantised weight's scales (or the weight itself) in an FP8 or NVFP4 checkpoint.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScaleProblem {
    #[error("its scale `{scale}` is missing")]
    Missing { scale: String },
    #[error("its scale `{scale}` has shape {found:?}, expected {expected:?}")]
    Shape {
        scale: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("its scale `{scale}` is stored as {found}, expected {expected}")]
    Dtype {
        scale: String,
        expected: &'static str,
        found: String,
    },
    #[error("its scale `{scale}` holds {value}, not a finite positive number")]
    Value { scale: String, value: f32 },
    #[error("the weight is stored as {found}, expected {expected} for {format}")]
    WeightDtype {
        format: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("in = {in_dim} is not a multiple of the group size {group}")]
    Group { in_dim: usize, group: usize },
}

// Boxed, as the plan error below: a GGUF error names a file, a tensor and its dims.
impl From<crate::weights::gguf::GgufError> for ModelError {
    fn from(error: crate::weights::gguf::GgufError) -> Self {
        Self::Gguf(Box::new(error))
    }
}

// Boxed: a plan error is large and rare, and `Result<_, ModelError>` should stay small on every call.
impl From<PlanError> for ModelError {
    fn from(error: PlanError) -> Self {
        Self::Plan(Box::new(error))
    }
}

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("a plan needs at least one device")]
    NoDevices,
    #[error("speculative decoding with MTP needs the checkpoint's MTP layer, and this config has none (num_nextn_predict_layers is 0)")]
    NoMtpLayer,
    #[error("the layer map has {found} entries for {layers} layers")]
    LayerMapLength { found: usize, layers: usize },
    #[error(
        "the layer map puts layer {layer} on device #{device}, but there are {devices} devices"
    )]
    LayerMapDevice {
        layer: usize,
        device: usize,
        devices: usize,
    },
    #[error("context must be in 1..={max} tokens (max_position_embeddings), got {got}")]
    Context { got: usize, max: usize },
    #[error(
        "the model does not fit: {item} ({}) has no room on {device} ({} left of {}); the plan needs {} \
         (weights {} = {weights} B, KV cache for {context} tokens {}) and the devices hold {} = {available} B: \
         {} = {missing} B missing",
        fmt_bytes(*item_bytes), fmt_bytes(*device_free), fmt_bytes(*device_capacity), fmt_bytes(*needed),
        fmt_bytes(*weights), fmt_bytes(*cache), fmt_bytes(*available), fmt_bytes(*missing)
    )]
    DoesNotFit {
        device: String,
        item: String,
        item_bytes: u64,
        device_free: u64,
        device_capacity: u64,
        needed: u64,
        weights: u64,
        cache: u64,
        context: usize,
        available: u64,
        /// Bytes beyond what the devices hold (at least the item's shortfall on the device named).
        missing: u64,
    },
    #[error("layer {layer}: {source}")]
    Dispatch {
        layer: usize,
        #[source]
        source: DispatchError,
    },
}
