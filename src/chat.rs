//! Chat prompts: a model's Hugging Face chat template (Jinja), rendered with minijinja the way
//! transformers renders it (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, a
//! Python-style `tojson`, and Python string/dict methods through minijinja-contrib's pycompat).
//!
//! A template is code from the model repo, so its work is bounded with minijinja's own controls: fuel (a
//! budget of instructions and bytes created, [`BASE_FUEL`] plus a share per byte of the conversation), a
//! recursion limit ([`RECURSION_LIMIT`]) and a cap on the rendered text ([`MAX_OUTPUT_BASE`] plus a multiple
//! of the conversation). Its files are read only when regular and below [`MAX_TEMPLATE_BYTES`] /
//! [`MAX_TOKENIZER_CONFIG_BYTES`].

use std::path::{Path, PathBuf};

use glm5_models::config::read_text_file;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};

/// Bytes of template text accepted (GLM-5's template has about 5 KB).
pub const MAX_TEMPLATE_BYTES: u64 = 4 << 20;
/// Bytes of `tokenizer_config.json` read at most (it may embed the template and every added token).
pub const MAX_TOKENIZER_CONFIG_BYTES: u64 = 256 << 20;
/// Fuel of a render before the conversation's share: about a million instructions (GLM-5's template uses
/// some thousands per message).
pub const BASE_FUEL: u64 = 1_000_000;
/// Fuel per byte of the conversation's text: a template may pass over each byte several times.
pub const FUEL_PER_INPUT_BYTE: u64 = 1;
/// Deepest macro/include recursion allowed (GLM-5's template recurses a few levels).
pub const RECURSION_LIMIT: usize = 100;
/// Rendered bytes allowed before the conversation's share ...
pub const MAX_OUTPUT_BASE: usize = 16 << 20;
/// ... plus this many per byte of the conversation.
pub const MAX_OUTPUT_PER_INPUT_BYTE: usize = 4;
/// Widest `tojson(indent=...)` accepted.
pub const MAX_JSON_INDENT: usize = 64;

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A template or config file exists but cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse failure.
        #[source]
        source: serde_json::Error,
    },
    /// Neither `chat_template.jinja` nor a `chat_template` entry of `tokenizer_config.json` exists.
    #[error("no chat template in {dir}: expected chat_template.jinja or a \"chat_template\" in tokenizer_config.json")]
    MissingTemplate {
        /// The model directory searched.
        dir: PathBuf,
    },
    /// The template text is not valid Jinja.
    #[error("chat template {name} does not parse: {source}")]
    Syntax {
        /// Where the template came from (`chat_template.jinja`, `tokenizer_config.json`, ...).
        name: String,
        /// minijinja's error, with the line.
        #[source]
        source: minijinja::Error,
    },
    /// The template text is larger than [`MAX_TEMPLATE_BYTES`].
    #[error("chat template {name} has {bytes} bytes, more than the limit of {MAX_TEMPLATE_BYTES}")]
    TooLarge {
        /// Where the template came from.
        name: String,
        /// Its size.
        bytes: usize,
    },
    /// Rendering failed: `raise_exception` called by the template, an error in it, or one of the limits
    /// (fuel, recursion, output size) reached, which the message names.
    #[error("chat template failed to render: {}", one_line(.0))]
    Render(#[source] minijinja::Error),
}

/// minijinja's message on one line: its detail can hold a template's own `raise_exception` text or quoted
/// template source, line breaks included, so control characters are escaped.
fn one_line(e: &minijinja::Error) -> String {
    e.to_string()
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// Result of chat-template operations.
pub type Result<T> = std::result::Result<T, ChatError>;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The visible text.
    pub content: String,
    /// An assistant turn's thinking, rendered inside `<think>…</think>` where the template keeps it.
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An assistant message without reasoning.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// Attaches the assistant's thinking.
    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning_content = Some(reasoning.into());
        self
    }

    fn to_value(&self) -> Value {
        let mut pairs = vec![
            ("role", Value::from(self.role.as_str())),
            ("content", Value::from(self.content.as_str())),
        ];
        if let Some(reasoning) = &self.reasoning_content {
            pairs.push(("reasoning_content", Value::from(reasoning.as_str())));
        }
        Value::from_pairs(pairs)
    }
}

/// Template switches passed as kwargs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatOptions {
    /// End the prompt with the assistant's turn header so the model answers next.
    pub add_generation_prompt: bool,
    /// Let the model think first (`<think>`), or skip thinking.
    pub enable_thinking: bool,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            enable_thinking: true,
        }
    }
}

/// A compiled chat template plus the `bos_token`/`eos_token` strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Loads `dir/chat_template.jinja`, or else the `chat_template` of `dir/tokenizer_config.json` (a string,
    /// or a list of `{name, template}` where `default` wins); bos/eos strings come from the tokenizer config.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> =
            match read_text_file(&config_path, MAX_TOKENIZER_CONFIG_BYTES) {
                Ok(text) => {
                    Some(
                        serde_json::from_str(&text).map_err(|source| ChatError::Json {
                            path: config_path.clone(),
                            source,
                        })?,
                    )
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(source) => {
                    return Err(ChatError::Io {
                        path: config_path,
                        source,
                    })
                }
            };
        let jinja_path = dir.join("chat_template.jinja");
        let (name, source) = match read_text_file(&jinja_path, MAX_TEMPLATE_BYTES) {
            Ok(text) => (jinja_path.display().to_string(), text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let text = config
                    .as_ref()
                    .and_then(|c| template_from_config(c.get("chat_template")?))
                    .ok_or_else(|| ChatError::MissingTemplate {
                        dir: dir.to_path_buf(),
                    })?;
                (
                    format!("\"chat_template\" of {}", config_path.display()),
                    text,
                )
            }
            Err(source) => {
                return Err(ChatError::Io {
                    path: jinja_path,
                    source,
                })
            }
        };
        let token = |key: &str| config.as_ref().and_then(|c| token_string(c.get(key)?));
        Self::compile(&name, source, token("bos_token"), token("eos_token"))
    }

    /// Compiles template text; `bos_token`/`eos_token` are exposed to it under those names when given.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        Self::compile("(given as text)", source.into(), bos_token, eos_token)
    }

    fn compile(
        name: &str,
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        if source.len() as u64 > MAX_TEMPLATE_BYTES {
            return Err(ChatError::TooLarge {
                name: name.to_string(),
                bytes: source.len(),
            });
        }
        let syntax = |source| ChatError::Syntax {
            name: name.to_string(),
            source,
        };
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(syntax)?,
        );
        env.set_recursion_limit(RECURSION_LIMIT);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source).map_err(syntax)?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages` into the prompt text (no tools).
    pub fn render(&self, messages: &[Message], options: &ChatOptions) -> Result<String> {
        let mut ctx = vec![
            (
                "messages",
                Value::from(messages.iter().map(Message::to_value).collect::<Vec<_>>()),
            ),
            (
                "add_generation_prompt",
                Value::from(options.add_generation_prompt),
            ),
            ("enable_thinking", Value::from(options.enable_thinking)),
            ("tools", Value::from(())),
        ];
        if let Some(bos) = &self.bos_token {
            ctx.push(("bos_token", Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            ctx.push(("eos_token", Value::from(eos.as_str())));
        }
        let input: usize = messages
            .iter()
            .map(|m| {
                m.role.len() + m.content.len() + m.reasoning_content.as_ref().map_or(0, String::len)
            })
            .sum();
        self.render_bounded(Value::from_pairs(ctx), input)
    }

    /// Renders with the template's budget: fuel, recursion and output grow with `input`, the bytes of the
    /// conversation, so that a long but honest chat is never cut off by them.
    fn render_bounded(&self, ctx: Value, input: usize) -> Result<String> {
        let fuel = BASE_FUEL.saturating_add(FUEL_PER_INPUT_BYTE.saturating_mul(input as u64));
        let limit = MAX_OUTPUT_BASE.saturating_add(MAX_OUTPUT_PER_INPUT_BYTE.saturating_mul(input));
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let template = env.get_template(NAME).map_err(ChatError::Render)?;
        let mut out = BoundedOutput {
            text: Vec::new(),
            limit,
        };
        template
            .render_captured_to(ctx, &mut out)
            .map_err(|e| match e.kind() {
                ErrorKind::WriteFailure => ChatError::Render(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("the rendered prompt exceeds the limit of {limit} bytes ({MAX_OUTPUT_BASE} plus {MAX_OUTPUT_PER_INPUT_BYTE} per byte of the conversation)"),
                )),
                ErrorKind::OutOfFuel => ChatError::Render(minijinja::Error::new(
                    ErrorKind::OutOfFuel,
                    format!("the template used up its budget of {fuel} fuel ({BASE_FUEL} plus {FUEL_PER_INPUT_BYTE} per byte of the conversation): it loops or builds too much"),
                )),
                _ => ChatError::Render(e),
            })?;
        String::from_utf8(out.text).map_err(|e| {
            ChatError::Render(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("the rendered prompt is not UTF-8: {e}"),
            ))
        })
    }
}

/// The rendered text, refusing to grow past `limit` bytes.
struct BoundedOutput {
    text: Vec<u8>,
    limit: usize,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.limit {
            return Err(std::io::Error::other("output limit reached"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Renders messages given as JSON in OpenAI's shape (assistant `tool_calls` with object `arguments`,
    /// `tool` messages), offering `tools`; `kwargs` (e.g. `enable_thinking`) are set on top of
    /// `add_generation_prompt`, `enable_thinking` (default true), `tools` and the bos/eos strings.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx: std::collections::BTreeMap<String, Value> = [
            ("messages", json_value(messages)),
            ("tools", tools.map_or(Value::from(()), json_value)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("enable_thinking", Value::from(true)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(token) = token {
                ctx.insert(key.into(), Value::from(token.as_str()));
            }
        }
        for (key, value) in kwargs {
            ctx.insert(key.clone(), json_value(value));
        }
        // The same budget as `render`, over the JSON the template is given.
        let input = messages.to_string().len()
            + tools.map_or(0, |t| t.to_string().len())
            + serde_json::Value::Object(kwargs.clone()).to_string().len();
        self.render_bounded(Value::from_pairs(ctx), input)
    }
}

/// A JSON value as a template value (objects keep their key order).
fn json_value(value: &serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match value {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => n
            .as_i64()
            .map(Value::from)
            .or_else(|| n.as_u64().map(Value::from))
            .unwrap_or_else(|| Value::from(n.as_f64().unwrap_or(f64::NAN))),
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => items.iter().map(json_value).collect(),
        Json::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_value(v))))
        }
    }
}

/// `chat_template` as a string, or the `default` (else first) entry of a `[{name, template}]` list.
fn template_from_config(value: &serde_json::Value) -> Option<String> {
    if let Some(text) = value.as_str() {
        return Some(text.to_string());
    }
    let list = value.as_array()?;
    let template_of =
        |entry: &serde_json::Value| entry.get("template")?.as_str().map(str::to_string);
    list.iter()
        .find(|entry| entry.get("name").and_then(|n| n.as_str()) == Some("default"))
        .and_then(template_of)
        .or_else(|| list.iter().find_map(template_of))
}

/// A special token given as a string or as an added-token object `{"content": ...}`.
fn token_string(value: &serde_json::Value) -> Option<String> {
    value
        .as_str()
        .or_else(|| value.get("content")?.as_str())
        .map(str::to_string)
}

/// Python's `json.dumps` as transformers exposes it: `tojson(ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, no HTML escaping.
fn tojson(
    state: &State,
    value: &Value,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    if let Some(n) = indent.filter(|&n| n > MAX_JSON_INDENT) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson indent {n} is more than the limit of {MAX_JSON_INDENT}"),
        ));
    }
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "separators must be (item, key)",
            ))
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys,
    };
    let mut out = String::new();
    style.write(state, &mut out, value, 0)?;
    if ensure_ascii {
        out = out.chars().fold(String::new(), |mut s, c| {
            if c.is_ascii() {
                s.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    s.push_str(&format!("\\u{unit:04x}"));
                }
            }
            s
        });
    }
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn write(
        &self,
        state: &State,
        out: &mut String,
        value: &Value,
        depth: usize,
    ) -> std::result::Result<(), minijinja::Error> {
        // Paid as it is built (one fuel per 64 bytes, as minijinja charges), so that indentation of a
        // deep value cannot grow without bound; a value nested past the recursion limit is refused.
        if depth > RECURSION_LIMIT {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: value nested more than {RECURSION_LIMIT} levels deep"),
            ));
        }
        let before = out.len();
        self.write_value(state, out, value, depth)?;
        state.consume_fuel(((out.len() - before) / 64) as u64)
    }

    fn write_value(
        &self,
        state: &State,
        out: &mut String,
        value: &Value,
        depth: usize,
    ) -> std::result::Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&value.to_string()),
            ValueKind::String | ValueKind::Plain => out.push_str(&json_string(&value.to_string())),
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                let entries = keys
                    .into_iter()
                    .map(|k| Ok((k.clone(), value.get_item(&k)?)))
                    .collect::<std::result::Result<Vec<_>, minijinja::Error>>()?;
                self.container(out, ('{', '}'), entries, depth, |out, (k, v)| {
                    out.push_str(&json_string(&k.to_string()));
                    out.push_str(&self.key);
                    self.write(state, out, &v, depth + 1)
                })?;
            }
            _ => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(out, ('[', ']'), items, depth, |out, v| {
                    self.write(state, out, &v, depth + 1)
                })?;
            }
        }
        Ok(())
    }

    fn container<T>(
        &self,
        out: &mut String,
        (open, close): (char, char),
        items: Vec<T>,
        depth: usize,
        mut each: impl FnMut(&mut String, T) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        let empty = items.is_empty();
        for (i, item) in items.into_iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            if let Some(n) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * (depth + 1)));
            }
            each(out, item)?;
        }
        if let (Some(n), false) = (self.indent, empty) {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
        out.push(close);
        Ok(())
    }
}

fn json_string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}
