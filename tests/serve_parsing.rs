//! Reasoning and tool-call parsing on text written by the embedded model's own chat template: a reply the
//! template renders for an assistant turn parses back into the same thinking, content and tool calls.

use glm5::chat::ChatTemplate;
use glm5::reasoning::{prompt_opens_thinking, split_reasoning, ReasoningSplitter};
use glm5::tool_calls::{parse_tool_calls, ToolCallParser, ToolEvent};
use serde_json::{json, Map, Value};

fn template() -> ChatTemplate {
    ChatTemplate::from_model_dir(glm5::embedded::materialize().unwrap()).unwrap()
}

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "detailed": {"type": "boolean"},
            "options": {"type": "object"}
        }, "required": ["city"]}
    }}])
}

fn calls() -> Vec<(&'static str, Value)> {
    vec![
        ("get_weather", json!({"city": "Paris", "days": 3})),
        // A string that reads as JSON stays a string: the schema says so.
        (
            "get_weather",
            json!({"city": "42", "detailed": true, "options": {"units": "metric", "list": [1, 2]}}),
        ),
    ]
}

fn assistant_turn(reasoning: &str, content: &str) -> Value {
    json!({
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": calls().iter().enumerate().map(|(i, (name, args))| json!({
            "id": format!("call_{i}"), "type": "function",
            "function": {"name": name, "arguments": args}
        })).collect::<Vec<_>>()
    })
}

/// The text the model would write after `prompt` for the assistant turn `turn`.
fn rendered_reply(turn: Value, kwargs: &Map<String, Value>) -> (String, String) {
    let template = template();
    let tools = tools();
    let user = json!({"role": "user", "content": "Weather in Paris and in 42?"});
    let prompt = template
        .render_json(&json!([user]), Some(&tools), true, kwargs)
        .unwrap();
    let full = template
        .render_json(&json!([user, turn]), Some(&tools), false, kwargs)
        .unwrap();
    // The generation prompt opens the assistant turn exactly as the full conversation has it.
    assert!(
        full.starts_with(&prompt),
        "prompt:\n{prompt}\nfull:\n{full}"
    );
    (prompt.clone(), full[prompt.len()..].to_string())
}

#[test]
fn tools_are_listed_in_the_prompt() {
    let prompt = template()
        .render_json(
            &json!([{"role": "user", "content": "hi"}]),
            Some(&tools()),
            true,
            &Map::new(),
        )
        .unwrap();
    let listed = prompt
        .split("<tools>\n")
        .nth(1)
        .and_then(|rest| rest.split("\n</tools>").next())
        .expect("a <tools> block");
    let listed: Value = serde_json::from_str(listed).unwrap();
    assert_eq!(listed, tools()[0], "{prompt}");
    assert!(
        prompt.contains("<tool_call>{function-name}<arg_key>"),
        "{prompt}"
    );
    assert!(prompt.ends_with("<|assistant|><think>"), "{prompt}");
}

#[test]
fn reasoning_content_and_tool_calls_round_trip_through_the_template() {
    let (prompt, reply) = rendered_reply(
        assistant_turn("The user wants two cities.", "Let me check."),
        &Map::new(),
    );
    assert!(prompt_opens_thinking(&prompt));
    let (reasoning, answer) = split_reasoning(&reply, true);
    assert_eq!(reasoning.as_deref(), Some("The user wants two cities."));
    let tools = tools();
    let (content, parsed) = parse_tool_calls(&answer, tools.as_array().unwrap());
    assert_eq!(content, "Let me check.");
    let parsed: Vec<(String, Value)> = parsed
        .into_iter()
        .map(|c| (c.name, serde_json::from_str(&c.arguments).unwrap()))
        .collect();
    let expected: Vec<(String, Value)> = calls()
        .into_iter()
        .map(|(n, a)| (n.to_string(), a))
        .collect();
    assert_eq!(parsed, expected);

    // Streamed one character at a time, the same result.
    let mut splitter = ReasoningSplitter::new(true);
    let mut parser = ToolCallParser::new(tools.as_array().unwrap().clone());
    let (mut streamed_reasoning, mut streamed_content, mut streamed_calls) =
        (String::new(), String::new(), vec![]);
    let answer_events = |text: &str, parser: &mut ToolCallParser, last: bool| {
        let mut events = parser.push(text);
        if last {
            events.extend(parser.finish());
        }
        events
    };
    let chars: Vec<char> = reply.chars().collect();
    for (i, c) in chars.iter().enumerate() {
        let last = i + 1 == chars.len();
        let mut split = splitter.push(&c.to_string());
        if last {
            let rest = splitter.finish();
            split.reasoning += &rest.reasoning;
            split.content += &rest.content;
        }
        streamed_reasoning += &split.reasoning;
        for event in answer_events(&split.content, &mut parser, last) {
            match event {
                ToolEvent::Content(text) => streamed_content += &text,
                ToolEvent::Call(call) => streamed_calls.push((
                    call.name,
                    serde_json::from_str::<Value>(&call.arguments).unwrap(),
                )),
            }
        }
    }
    assert_eq!(streamed_reasoning, "The user wants two cities.");
    assert_eq!(streamed_content, "Let me check.");
    assert_eq!(streamed_calls, expected);
}

#[test]
fn without_thinking_the_reply_is_all_answer() {
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), false.into());
    let template = template();
    let prompt = template
        .render_json(
            &json!([{"role": "user", "content": "hi"}]),
            None,
            true,
            &kwargs,
        )
        .unwrap();
    assert!(prompt.ends_with("<|assistant|></think>"), "{prompt}");
    assert!(!prompt_opens_thinking(&prompt));
    assert_eq!(
        split_reasoning("plain answer", false),
        (None, "plain answer".to_string())
    );
}

#[test]
fn tool_results_share_one_observation_turn() {
    let messages = json!([
        {"role": "user", "content": "Weather?"},
        assistant_turn("", ""),
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temperature\": 22}"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]);
    let prompt = template()
        .render_json(&messages, Some(&tools()), true, &Map::new())
        .unwrap();
    assert!(
        prompt.ends_with("</tool_call><|observation|><tool_response>{\"temperature\": 22}</tool_response><tool_response>sunny</tool_response><|assistant|><think>"),
        "{prompt}"
    );
}
