//! The runtime's error: every layer's typed error, plus what generation itself rejects.

/// Errors of the glm5 runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] glm5_models::ModelError),
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    #[error("invalid generation parameter: {0}")]
    InvalidParams(String),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt_tokens} tokens but the context holds {limit} (prompt plus at least one new token)")]
    PromptTooLong { prompt_tokens: usize, limit: usize },
    #[error("{path}: {reason}")]
    ModelFile { path: std::path::PathBuf, reason: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
