//! The runtime's error: every layer's typed error, plus what generation itself rejects.

/// Errors of the glm5 runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Config, checkpoint or forward-pass error of the model graph.
    #[error(transparent)]
    Model(#[from] glm5_models::ModelError),
    /// Download or cache error of the Hugging Face Hub layer.
    #[error(transparent)]
    Hub(Box<crate::hub::HubError>),
    /// tokenizer.json could not be loaded, or text could not be encoded/decoded.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// The chat template is missing or failed to render.
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    /// A sampling or stopping setting is out of range.
    #[error("invalid generation parameter: {0}")]
    InvalidParams(String),
    /// The probabilities of a step cannot be sampled from (negative, NaN, or all zero).
    #[error("cannot sample the next token: {0}")]
    Sampling(String),
    /// Generation was asked to continue an empty prompt.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt leaves no room in the context (or the KV cache) for a new token.
    #[error("the prompt has {prompt_tokens} tokens but the context holds {limit} (prompt plus at least one new token)")]
    PromptTooLong {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Tokens the context or cache can hold.
        limit: usize,
    },
    /// The model produced logits that are not numbers (NaN) or no finite maximum (+inf, or all -inf):
    /// sampling from them would print garbage.
    #[error("the model produced {what} logits at generation step {step} (position {position}); the weights or the computation are broken, so no token is sampled from them")]
    NonFiniteLogits {
        /// `NaN`, `+inf` or `only -inf`.
        what: &'static str,
        /// Tokens generated before (0: the logits of the prompt's prefill).
        step: usize,
        /// Position in the sequence of the token the logits are for.
        position: usize,
    },
    /// A model file other than config/weights/tokenizer (e.g. generation_config.json) is unusable.
    #[error("{path}: {reason}")]
    ModelFile {
        /// The file or directory at fault.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A device, layer map or backend option could not be understood.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A forced backend (`--backend`, `GLM5_BACKEND`) names no op or backend.
    #[error(transparent)]
    Backend(#[from] glm5_ops::DispatchError),
    /// A device could not be described (compute capability, memory).
    #[error(transparent)]
    Device(#[from] glm5_ops::DeviceError),
    /// The graph-build pass failed: the model does not fit, or an op has no valid backend.
    #[error(transparent)]
    Plan(Box<glm5_models::PlanError>),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

// Boxed: Hub and plan errors are large and rare, and `Result<_, Error>` should stay small on every call.
impl From<crate::hub::HubError> for Error {
    fn from(error: crate::hub::HubError) -> Self {
        Self::Hub(Box::new(error))
    }
}

impl From<glm5_models::PlanError> for Error {
    fn from(error: glm5_models::PlanError) -> Self {
        Self::Plan(Box::new(error))
    }
}

/// The runtime's result type.
pub type Result<T> = std::result::Result<T, Error>;
