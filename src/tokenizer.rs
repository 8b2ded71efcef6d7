//! Text ↔ token ids over a Hugging Face `tokenizer.json` (GLM-5: byte-level BPE), and an incremental
//! detokeniser for streaming output.
//!
//! GLM prompts get `[gMASK]<sop>` from the chat template, so [`Tokenizer::encode`] adds no special tokens of
//! its own (no BOS, no post-processor); special tokens written in the text are still recognised as such.

use std::path::{Path, PathBuf};

/// Why a tokenizer could not be loaded or could not encode/decode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` is missing, unreadable or not a valid tokenizer definition.
    #[error("cannot load tokenizer {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What the tokenizers crate reported.
        reason: String,
    },
    /// The tokenizer rejected the input text.
    #[error("cannot encode text: {0}")]
    Encode(String),
    /// The ids could not be turned back into text (e.g. an id outside the vocabulary).
    #[error("cannot decode token ids: {0}")]
    Decode(String),
}

/// Result of tokenizer operations.
pub type Result<T> = std::result::Result<T, TokenizerError>;

/// A Hugging Face tokenizer used the GLM way: no special tokens added on encode.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Self { inner })
    }

    /// Wraps an already built `tokenizers::Tokenizer`.
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Self { inner }
    }

    /// The underlying `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`. Adds no BOS/EOS, but special tokens written in `text` (e.g. `<|user|>`) map to
    /// their single ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// Text of `ids`, leaving out tokens marked special when `skip_special_tokens` is set.
    pub fn decode_with(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Id of a token string (a vocabulary entry or an added token such as `<|endoftext|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer can produce, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Incremental detokeniser: feed generated ids one by one, get text as soon as it is complete.
///
/// Decodes a sliding window of tokens and emits what it adds to the previously emitted prefix. While the
/// decoded window ends in U+FFFD (a multi-byte character split across byte-level tokens) nothing is emitted,
/// so every chunk is whole UTF-8 characters.
pub struct TokenStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl<'a> TokenStream<'a> {
    /// A stream that keeps special tokens in its output.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special_tokens: false,
        }
    }

    /// Sets whether tokens marked special are left out of the output.
    pub fn skip_special_tokens(mut self, skip: bool) -> Self {
        self.skip_special_tokens = skip;
        self
    }

    /// Every token pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Adds `token`; returns the newly completed text, or `None` while it is held back.
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        let prefix = self.decode(self.prefix_offset..self.read_offset)?;
        let text = self.decode(self.prefix_offset..self.tokens.len())?;
        if text.len() <= prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(new) = text.get(prefix.len()..) else {
            return Ok(None);
        };
        let new = new.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(Some(new))
    }

    /// Flushes the held-back remainder (possibly ending in U+FFFD if the stream stopped mid-character).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let prefix = self.decode(self.prefix_offset..self.read_offset)?;
        let text = self.decode(self.prefix_offset..self.tokens.len())?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(text
            .get(prefix.len()..)
            .filter(|rest| !rest.is_empty())
            .map(str::to_string))
    }

    fn decode(&self, range: std::ops::Range<usize>) -> Result<String> {
        self.tokenizer
            .decode_with(&self.tokens[range], self.skip_special_tokens)
    }
}
