//! The OpenAI request bodies glm5 reads, and their checks and conversions: messages into the chat
//! template's input, sampling fields into [`GenerationParams`].

use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::GenerationParams;

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields common to both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    /// The model asked for.
    pub model: Option<String>,
    /// Most new tokens.
    pub max_tokens: Option<i64>,
    /// Softmax temperature (0: greedy).
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Top-k (0 or -1: off).
    pub top_k: Option<i64>,
    /// Min-p.
    pub min_p: Option<f64>,
    /// Sampler seed.
    pub seed: Option<i64>,
    /// Choices per prompt.
    pub n: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Extra stop token ids (vLLM's extension).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating past end-of-sequence tokens (vLLM's extension, for benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Repetition penalty (vLLM's extension; 1 = off).
    pub repetition_penalty: Option<f32>,
    /// Subtracted from the logits of tokens already generated, in [-2, 2] (OpenAI's).
    pub presence_penalty: Option<f64>,
    /// Subtracted from the logits of generated tokens once per time generated, in [-2, 2] (OpenAI's).
    pub frequency_penalty: Option<f64>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation (checked by [`template_messages`]).
    pub messages: Vec<Value>,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// The newer name of `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Return log-probabilities of the chosen tokens.
    #[serde(default)]
    pub logprobs: bool,
    /// And of this many alternatives (0-20).
    pub top_logprobs: Option<i64>,
    /// Tool definitions.
    pub tools: Option<Vec<Value>>,
    /// `auto` (default), `none`.
    pub tool_choice: Option<Value>,
    /// Extra chat-template variables (e.g. `enable_thinking`).
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// A string, strings, token ids, or lists of token ids.
    pub prompt: Value,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Log-probabilities of the chosen token and this many alternatives (0-20).
    pub logprobs: Option<i64>,
    /// Not supported.
    #[serde(default)]
    pub echo: bool,
    /// Not supported.
    pub suffix: Option<String>,
    /// Must equal `n` when given.
    pub best_of: Option<i64>,
}

/// The most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// The most log-probability alternatives.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Sampling fields over the model's defaults; `max_new_tokens` is left at `0` (set from the prompt later).
pub fn sampling_params(
    sampling: &Sampling,
    defaults: &GenerationParams,
) -> Result<GenerationParams, ApiError> {
    let top_k = match sampling.top_k {
        None => defaults.top_k,
        Some(-1 | 0) => None,
        Some(k) if k > 0 => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid_param(
                "top_k",
                format!("top_k must be -1 (off) or at least 1, got {k}"),
            ))
        }
    };
    for (name, value) in [
        ("presence_penalty", sampling.presence_penalty),
        ("frequency_penalty", sampling.frequency_penalty),
    ] {
        if value.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
            return Err(ApiError::invalid_param(
                name,
                format!(
                    "{name} must be in [-2, 2], got {}",
                    value.unwrap_or_default()
                ),
            ));
        }
    }
    let stop_strings = match &sampling.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(list)) => list.clone(),
    };
    if stop_strings.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid_param(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings"),
        ));
    }
    let seed = match sampling.seed {
        Some(seed) => seed as u64,
        None => random_seed(),
    };
    let params = GenerationParams {
        max_new_tokens: 0,
        temperature: sampling.temperature.unwrap_or(defaults.temperature),
        top_k,
        top_p: sampling.top_p.or(defaults.top_p).filter(|p| *p != 1.0),
        min_p: sampling.min_p.filter(|p| *p != 0.0),
        repetition_penalty: sampling.repetition_penalty.unwrap_or(1.0),
        presence_penalty: sampling.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: sampling.frequency_penalty.unwrap_or(0.0) as f32,
        seed,
        stop_token_ids: sampling.stop_token_ids.clone().unwrap_or_default(),
        stop_strings,
        ..defaults.clone()
    };
    params
        .validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(params)
}

/// `n` checked: 1 to `max`.
pub fn choices(n: Option<i64>, max: usize) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        n if n >= 1 && n as usize <= max => Ok(n as usize),
        n => Err(ApiError::invalid_param(
            "n",
            format!("n must be between 1 and {max} (the server's --max-seqs), got {n}"),
        )),
    }
}

/// `max_tokens` checked against the context: the tokens to allow after a prompt of `prompt_len`.
pub fn max_new_tokens(
    max_tokens: Option<i64>,
    prompt_len: usize,
    max_model_len: usize,
) -> Result<usize, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    match max_tokens {
        Some(m) if m < 1 => Err(ApiError::invalid_param(
            "max_tokens",
            format!("max_tokens must be at least 1, got {m}"),
        )),
        _ if prompt_len >= max_model_len => {
            Err(ApiError::context_length(prompt_len, 1, max_model_len))
        }
        Some(m) if prompt_len.saturating_add(m as usize) > max_model_len => Err(
            ApiError::context_length(prompt_len, m as usize, max_model_len),
        ),
        Some(m) => Ok(m as usize),
        None => Ok(max_model_len - prompt_len),
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    hasher.finish()
}

/// Text of a message `content`: a string, null, or a list of `{"type": "text", "text": ...}` parts.
fn content_text(content: Option<&Value>, index: usize) -> Result<String, ApiError> {
    let bad = |what: &str| {
        ApiError::invalid_param(
            &format!("messages[{index}].content"),
            format!("messages[{index}].content {what}"),
        )
    };
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|part| match (part.get("type").and_then(Value::as_str), part.get("text")) {
                (Some("text"), Some(Value::String(text))) => Ok(text.as_str()),
                _ => Err(bad("has a part that is not {\"type\": \"text\", \"text\": ...} (only text is supported)")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|parts| parts.concat()),
        Some(_) => Err(bad("must be a string or a list of text parts")),
    }
}

/// OpenAI messages into what the chat template reads: roles checked (`developer` read as `system`), text
/// content, `reasoning_content`, and assistant `tool_calls` with their JSON `arguments` parsed into objects.
pub fn template_messages(messages: &[Value]) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let param = |field: &str| format!("messages[{i}].{field}");
        let role = match message.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(role @ ("system" | "user" | "assistant" | "tool")) => role,
            Some(other) => {
                return Err(ApiError::invalid_param(
                    &param("role"),
                    format!("unknown role `{other}` (system, developer, user, assistant, tool)"),
                ))
            }
            None => {
                return Err(ApiError::invalid_param(
                    &param("role"),
                    "every message needs a role",
                ))
            }
        };
        let mut entry = Map::new();
        entry.insert("role".into(), role.into());
        entry.insert(
            "content".into(),
            content_text(message.get("content"), i)?.into(),
        );
        let reasoning = message
            .get("reasoning_content")
            .or_else(|| message.get("reasoning"))
            .and_then(Value::as_str);
        if let (Some(reasoning), "assistant") = (reasoning, role) {
            entry.insert("reasoning_content".into(), reasoning.into());
        }
        if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
            let calls = calls
                .as_array()
                .filter(|_| role == "assistant")
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        &param("tool_calls"),
                        "tool_calls must be a list on an assistant message",
                    )
                })?;
            let mut rendered = Vec::new();
            for (j, call) in calls.iter().enumerate() {
                let bad = |what: &str| {
                    ApiError::invalid_param(
                        &format!("messages[{i}].tool_calls[{j}]"),
                        format!("messages[{i}].tool_calls[{j}] {what}"),
                    )
                };
                let function = call.get("function").ok_or_else(|| bad("has no function"))?;
                let name = function
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("has no function.name"))?;
                let arguments = match function.get("arguments") {
                    Some(Value::String(text)) => serde_json::from_str::<Value>(text)
                        .ok()
                        .filter(Value::is_object)
                        .ok_or_else(|| bad("function.arguments is not a JSON object"))?,
                    Some(object @ Value::Object(_)) => object.clone(),
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(_) => return Err(bad("function.arguments is not a JSON object")),
                };
                let mut f = Map::new();
                f.insert("name".into(), name.into());
                f.insert("arguments".into(), arguments);
                let mut c = Map::new();
                c.insert("id".into(), call.get("id").cloned().unwrap_or(Value::Null));
                c.insert("type".into(), "function".into());
                c.insert("function".into(), Value::Object(f));
                rendered.push(Value::Object(c));
            }
            entry.insert("tool_calls".into(), Value::Array(rendered));
        }
        for key in ["tool_call_id", "name"] {
            if let Some(value) = message.get(key).filter(|v| v.is_string()) {
                entry.insert(key.into(), value.clone());
            }
        }
        out.push(Value::Object(entry));
    }
    Ok(Value::Array(out))
}

/// Tool definitions checked: each `{"type": "function", "function": {"name": ...}}`.
pub fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        let ok = tool.get("type").and_then(Value::as_str) == Some("function")
            && tool
                .pointer("/function/name")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
        if !ok {
            return Err(ApiError::invalid_param(
                &format!("tools[{i}]"),
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        }
    }
    Ok(())
}

/// Whether tool calls are parsed for `tool_choice` (`auto` or absent: yes; `none`: no); others are refused.
pub fn parse_tools_for(tool_choice: Option<&Value>) -> Result<bool, ApiError> {
    match tool_choice {
        None | Some(Value::Null) => Ok(true),
        Some(Value::String(s)) if s == "auto" => Ok(true),
        Some(Value::String(s)) if s == "none" => Ok(false),
        Some(_) => Err(ApiError::invalid_param(
            "tool_choice",
            "only tool_choice \"auto\" and \"none\" are supported (forcing a call needs guided decoding)",
        )),
    }
}

/// Completion prompts: each as text or as token ids.
pub enum Prompt {
    /// Text, tokenized by the server.
    Text(String),
    /// Token ids as given.
    Ids(Vec<u32>),
}

/// `prompt` in any of its four shapes.
pub fn completion_prompts(prompt: &Value) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
        )
    };
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect()
    };
    let prompts = match prompt {
        Value::String(text) => vec![Prompt::Text(text.clone())],
        Value::Array(items) if items.is_empty() => return Err(bad()),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|s| Prompt::Text(s.as_str().unwrap_or_default().to_string()))
            .collect(),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            vec![Prompt::Ids(ids(items).ok_or_else(bad)?)]
        }
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Array(inner) => ids(inner).map(Prompt::Ids).ok_or_else(bad),
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    Ok(prompts)
}
