//! GLM tool calls in model output, turned into OpenAI `tool_calls`.
//!
//! GLM-4.7 and GLM-5 write a call as
//! `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>` (GLM-4.5 puts newlines
//! between the parts, which are accepted too). A value is JSON unless the tool's schema declares that
//! argument a string, in which case it is taken as written; a value that is not valid JSON is a string. The
//! arguments become a JSON object text, as OpenAI's `function.arguments`. This is the format vLLM's `glm47`
//! tool parser reads, written from its description; the chat template writes calls back the same way.

use serde_json::{Map, Value};

/// Opens a call.
pub const CALL_START: &str = "<tool_call>";
/// Closes a call.
pub const CALL_END: &str = "</tool_call>";
const KEY_START: &str = "<arg_key>";
const KEY_END: &str = "</arg_key>";
const VALUE_START: &str = "<arg_value>";
const VALUE_END: &str = "</arg_value>";

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON object as text.
    pub arguments: String,
}

/// Parses the inside of one `<tool_call>...</tool_call>`; `None` when it has no name or malformed pairs.
/// `tools` are the request's tool definitions (OpenAI shape), used for the argument types.
pub fn parse_call(inner: &str, tools: &[Value]) -> Option<ToolCall> {
    let name_end = inner.find(KEY_START).unwrap_or(inner.len());
    let name = inner[..name_end].trim();
    if name.is_empty() || name.contains('<') {
        return None;
    }
    let mut arguments = Map::new();
    let mut rest = inner[name_end..].trim();
    while !rest.is_empty() {
        let after_key = rest.strip_prefix(KEY_START)?;
        let key_end = after_key.find(KEY_END)?;
        let key = after_key[..key_end].trim();
        let after = after_key[key_end + KEY_END.len()..].trim_start();
        let after_value = after.strip_prefix(VALUE_START)?;
        let value_end = after_value.find(VALUE_END)?;
        let raw = &after_value[..value_end];
        let value = if argument_is_string(tools, name, key) {
            Value::String(raw.to_string())
        } else {
            serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
        };
        arguments.insert(key.to_string(), value);
        rest = after_value[value_end + VALUE_END.len()..].trim();
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(arguments).to_string(),
    })
}

/// Whether `tools` declares argument `key` of function `name` with `"type": "string"`.
fn argument_is_string(tools: &[Value], name: &str, key: &str) -> bool {
    tools
        .iter()
        .filter_map(|tool| tool.get("function").or(Some(tool)))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|f| {
            f.pointer(&format!(
                "/parameters/properties/{}/type",
                escape_pointer(key)
            ))
        })
        .and_then(Value::as_str)
        == Some("string")
}

fn escape_pointer(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// What a piece of streamed answer text turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Ordinary answer text.
    Content(String),
    /// A complete call.
    Call(ToolCall),
}

/// Streaming parser: push answer text as it arrives; text outside calls comes out as soon as it cannot be
/// the start of `<tool_call>`, each call when its `</tool_call>` arrives. A call that does not parse, or is
/// still open when the reply ends, is handed back as text (nothing the model wrote is lost).
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    tools: Vec<Value>,
    buffer: String,
    in_call: bool,
}

impl ToolCallParser {
    /// A parser for a request offering `tools`.
    pub fn new(tools: Vec<Value>) -> Self {
        Self {
            tools,
            buffer: String::new(),
            in_call: false,
        }
    }

    /// Events for `text` (appended to what came before).
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buffer.push_str(text);
        let mut events = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.buffer.find(CALL_END) else {
                    return events;
                };
                let inner = &self.buffer[CALL_START.len()..end];
                match parse_call(inner, &self.tools) {
                    Some(call) => events.push(ToolEvent::Call(call)),
                    None => push_content(&mut events, &self.buffer[..end + CALL_END.len()]),
                }
                self.buffer.drain(..end + CALL_END.len());
                self.in_call = false;
                continue;
            }
            if let Some(start) = self.buffer.find(CALL_START) {
                push_content(&mut events, &self.buffer[..start]);
                self.buffer.drain(..start);
                self.in_call = true;
                continue;
            }
            let keep = crate::reasoning::partial_suffix(&self.buffer, CALL_START);
            let ready = self.buffer.len() - keep;
            push_content(&mut events, &self.buffer[..ready]);
            self.buffer.drain(..ready);
            return events;
        }
    }

    /// Flushes held-back text at the end of the reply.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        self.in_call = false;
        let mut events = Vec::new();
        push_content(&mut events, &std::mem::take(&mut self.buffer));
        events
    }
}

fn push_content(events: &mut Vec<ToolEvent>, text: &str) {
    if !text.is_empty() {
        events.push(ToolEvent::Content(text.to_string()));
    }
}

/// The whole answer at once: the text outside calls, and the calls in order.
pub fn parse_tool_calls(answer: &str, tools: &[Value]) -> (String, Vec<ToolCall>) {
    let mut parser = ToolCallParser::new(tools.to_vec());
    let mut content = String::new();
    let mut calls = Vec::new();
    for event in parser.push(answer).into_iter().chain(parser.finish()) {
        match event {
            ToolEvent::Content(text) => content.push_str(&text),
            ToolEvent::Call(call) => calls.push(call),
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather_tool() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
        ]
    }

    #[test]
    fn parses_glm47_and_glm45_layouts_with_schema_types() {
        let tools = weather_tool();
        let glm47 = "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>";
        let (content, calls) = parse_tool_calls(glm47, &tools);
        assert_eq!(content, "Checking.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "42", "days": 3}));

        let glm45 = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>";
        let (_, calls) = parse_tool_calls(glm45, &tools);
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
    }

    #[test]
    fn streaming_holds_partial_tags_and_returns_broken_calls_as_text() {
        let mut parser = ToolCallParser::new(weather_tool());
        let mut events = Vec::new();
        for piece in [
            "Hi <tool",
            "_call>get_weather<arg_key>city</arg_key><arg_value>Oslo",
            "</arg_value></tool_call> bye",
        ] {
            events.extend(parser.push(piece));
        }
        events.extend(parser.finish());
        assert_eq!(events[0], ToolEvent::Content("Hi ".into()));
        assert!(matches!(&events[1], ToolEvent::Call(c) if c.arguments == r#"{"city":"Oslo"}"#));
        assert_eq!(events[2], ToolEvent::Content(" bye".into()));

        let (content, calls) = parse_tool_calls("<tool_call><arg_key>x</arg_key></tool_call>", &[]);
        assert!(calls.is_empty());
        assert_eq!(content, "<tool_call><arg_key>x</arg_key></tool_call>");
        let (content, calls) = parse_tool_calls("a<tool_call>f<arg_key>x", &[]);
        assert!(calls.is_empty());
        assert_eq!(content, "a<tool_call>f<arg_key>x");
    }
}
