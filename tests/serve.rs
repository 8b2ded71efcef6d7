//! `glm5 serve` against clients no one here wrote: the official `openai` Python package
//! (`tests/serve_openai.py`, `tests/serve_load.py`) and `curl`, on the embedded model on CPU. Expected outputs
//! come from the library alone (`Glm5::generate`, the tokenizer, `top_next_tokens`), never from the server.
//!
//! Needs `python3` with `openai` (`python3 -m pip install openai`) and `curl`; without them the tests fail
//! and say so.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use glm5::candle_core::{Device, Tensor};
use glm5::models::{PagedCacheOptions, PagedKvCache, SeqChunk};
use glm5::serve::{ModelInfo, ServeOptions, StepModel};
use glm5::{ChatOptions, FinishReason, GenerationParams, Glm5, LoadOptions, Message};
use serde_json::{json, Value};

const MODEL: &str = "glm5-tiny";

/// A `glm5 serve` process on a free loopback port; killed on drop.
struct Server {
    child: Child,
    url: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_glm5"))
            .args(["serve", "--port", "0"])
            .args(extra)
            .env("RUST_LOG", "glm5=info")
            .env_remove("GLM5_API_KEY")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("glm5 serve starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("glm5 serve did not start: {}", log.lock().unwrap()));
        Self {
            child,
            url: format!("http://{addr}"),
            log,
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Python that has `openai` (`$PYTHON`, as in .ci/run, else python3).
fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

fn require_python() {
    let ok = Command::new(python())
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "these tests drive the server with the official `openai` Python package: install it with \
         `python3 -m pip install openai` (CI's .ci/run does)"
    );
}

/// Runs a Python script under tests/ with a config file; fails the test with its output on failure.
fn run_python(script: &str, config: &Value) -> String {
    require_python();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(config).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let mut child = Command::new(python())
        .arg(&script)
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{} timed out", script.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (out, err) = (out_thread.join().unwrap(), err_thread.join().unwrap());
    assert!(
        status.success(),
        "{} failed:\n{out}\n{err}",
        script.display()
    );
    out
}

fn model() -> Glm5 {
    Glm5::embedded(&LoadOptions::default()).unwrap()
}

fn finish_name(reason: Option<&FinishReason>) -> &'static str {
    match reason {
        Some(FinishReason::MaxTokens | FinishReason::ContextFull) => "length",
        _ => "stop",
    }
}

/// Greedy continuation of `prompt` by the library: (text, prompt tokens, completion tokens, finish).
fn reference(model: &Glm5, prompt: &str, max_tokens: usize, stop: &[&str]) -> Value {
    let params = GenerationParams {
        max_new_tokens: max_tokens,
        temperature: 0.0,
        stop_strings: stop.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    library_reply(model, prompt, &params)
}

/// The library's continuation of `prompt` under `params`, as [`reference`] reports it.
fn library_reply(model: &Glm5, prompt: &str, params: &GenerationParams) -> Value {
    let mut generation = model.generate(prompt, params).unwrap();
    let text: String = generation.by_ref().map(|t| t.unwrap().text).collect();
    json!({
        "text": text,
        "prompt_tokens": generation.stats().prompt_tokens,
        "completion_tokens": generation.stats().generated_tokens,
        "finish_reason": finish_name(generation.finish_reason()),
    })
}

fn chat_prompt(model: &Glm5, messages: &[Message], thinking: bool) -> String {
    model
        .apply_chat_template(
            messages,
            &ChatOptions {
                add_generation_prompt: true,
                enable_thinking: thinking,
            },
        )
        .unwrap()
}

/// A model whose greedy reply to a prompt of `prompt_len` tokens is `script`, then end of sequence: the
/// embedded model runs (so the cache advances as in real use) and its logits are replaced.
struct Scripted {
    inner: Glm5,
    prompt_len: usize,
    script: Vec<u32>,
    eos: u32,
}

impl StepModel for Scripted {
    fn new_pool(&self, options: PagedCacheOptions) -> glm5::Result<PagedKvCache> {
        self.inner.new_pool(options)
    }

    fn synchronize(&self) -> glm5::Result<()> {
        self.inner.synchronize()
    }

    fn forward_batch(
        &self,
        batch: &[SeqChunk<'_>],
        pool: &mut PagedKvCache,
    ) -> glm5::Result<Tensor> {
        let vocab = self.inner.model().config().vocab_size;
        self.inner.model().forward_batch(batch, pool)?;
        let mut logits = vec![0f32; batch.len() * vocab];
        for (row, entry) in batch.iter().enumerate() {
            let end = entry.start_pos + entry.tokens.len();
            let next = end
                .checked_sub(self.prompt_len)
                .and_then(|k| self.script.get(k))
                .copied()
                .unwrap_or(self.eos);
            logits[row * vocab + next as usize] = 10.0;
        }
        Ok(Tensor::from_vec(
            logits,
            (batch.len(), vocab),
            &Device::Cpu,
        )?)
    }
}

/// Serves `model` in this process on a free port until the returned sender is dropped.
fn serve_in_process(model: Scripted, info: ModelInfo) -> (String, mpsc::Sender<()>) {
    let (addr_tx, addr_rx) = mpsc::channel::<SocketAddr>();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let options = ServeOptions {
            max_model_len: 1024,
            ..ServeOptions::new(([127, 0, 0, 1], 0).into(), MODEL)
        };
        let stop = async move {
            let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
        };
        runtime
            .block_on(glm5::serve::serve_model(
                model,
                info,
                options,
                move |addr| addr_tx.send(addr).unwrap(),
                stop,
            ))
            .unwrap();
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    (format!("http://{addr}"), stop_tx)
}

#[test]
fn openai_client_gets_the_librarys_tokens_tools_reasoning_and_errors() {
    require_python();
    let model = model();
    let server = Server::start(&["--max-seqs", "16"]);
    let limited = Server::start(&[
        "--api-key",
        "sekrit",
        "--max-seqs",
        "1",
        "--max-queue",
        "1",
        "--max-body-bytes",
        "4096",
        "--read-timeout",
        "1",
    ]);

    // Chat, thinking off: the reply is all `content`.
    let system = "You are terse.";
    let user = "Hello there, how are you?";
    let chat = chat_prompt(
        &model,
        &[Message::system(system), Message::user(user)],
        false,
    );
    let mut chat_expect = reference(&model, &chat, 12, &[]);
    chat_expect["messages"] =
        json!([{"role": "system", "content": system}, {"role": "user", "content": user}]);
    // Chat, thinking on: the reply starts inside <think>, so it is all `reasoning_content`.
    let thinking = chat_prompt(&model, &[Message::user(user)], true);
    let mut thinking_expect = reference(&model, &thinking, 10, &[]);
    thinking_expect["messages"] = json!([{"role": "user", "content": user}]);
    for expect in [&chat_expect, &thinking_expect] {
        let text = expect["text"].as_str().unwrap();
        assert!(
            !text.contains("<think>")
                && !text.contains("</think>")
                && !text.contains("<tool_call>"),
            "pick prompts whose greedy reply has no markup: {text:?}"
        );
    }

    // Completions: text, token counts, the first token's top-5 log-probabilities.
    let prompt = "The quick brown fox";
    let mut completion = reference(&model, prompt, 16, &[]);
    completion["prompt"] = prompt.into();
    completion["top5"] = model
        .top_next_tokens(prompt, 5)
        .unwrap()
        .into_iter()
        .map(|t| json!([t.text, t.probability.ln()]))
        .collect();
    // Stop strings: a piece from the middle of the greedy text cuts it there.
    let full = completion["text"].as_str().unwrap().to_string();
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    assert!(chars.len() > 8, "{full:?}");
    let stop = full[chars[5].0..chars[7].0].to_string();
    let mut stop_expect = reference(&model, prompt, 16, &[&stop]);
    stop_expect["stop"] = stop.clone().into();
    assert_eq!(
        stop_expect["text"].as_str().unwrap(),
        &full[..full.find(&stop).unwrap()]
    );

    // Several streams at once: each gets what it gets alone.
    let concurrent: Vec<Value> = (0..8)
        .map(|i| {
            let content = format!("Question number {i}: what is the weather like today?");
            let prompt = chat_prompt(&model, &[Message::user(&content)], false);
            let mut expect = reference(&model, &prompt, 20, &[]);
            expect["messages"] = json!([{"role": "user", "content": content}]);
            expect
        })
        .collect();

    // Tools go through the template: the prompt the server counts is the one the template renders.
    let template = glm5::chat::ChatTemplate::from_model_dir(model.dir()).unwrap();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]);
    let tool_messages = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let tool_round = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
    ]);
    let count = |messages: &Value| {
        let rendered =
            glm5::serve::openai::template_messages(messages.as_array().unwrap()).unwrap();
        let text = template
            .render_json(&rendered, Some(&tools), true, &Default::default())
            .unwrap();
        model.tokenizer().encode(&text).unwrap().len()
    };

    // A scripted reply with thinking and a tool call, through the whole server and the client's parser.
    let reasoning = "The user wants the weather.";
    let call_args = json!({"city": "Paris", "days": 3});
    let reply = format!(
        "{reasoning}</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    );
    let scripted_prompt_len = count(&tool_messages);
    let scripted = Scripted {
        script: model.tokenizer().encode(&reply).unwrap(),
        eos: model.eos_token_ids()[0],
        prompt_len: scripted_prompt_len,
        inner: glm5::Glm5::embedded(&LoadOptions::default()).unwrap(),
    };
    let info = ModelInfo::of(&scripted.inner);
    let (scripted_url, _stop_scripted) = serve_in_process(scripted, info);

    let long_prompt = "the quick brown fox jumps ".repeat(400);
    assert!(model.tokenizer().encode(&long_prompt).unwrap().len() > 1024);

    let config = json!({
        "base_url": format!("{}/v1", server.url),
        "limited_url": format!("{}/v1", limited.url),
        "scripted_url": format!("{scripted_url}/v1"),
        "api_key": "sekrit",
        "model": MODEL,
        "chat": chat_expect,
        "thinking": thinking_expect,
        "completion": completion,
        "stop": stop_expect,
        "concurrent": concurrent,
        "tools": tools,
        "tool_messages": tool_messages,
        "tool_messages_prompt_tokens": scripted_prompt_len,
        "tool_round": tool_round,
        "tool_round_prompt_tokens": count(&tool_round),
        "scripted": {"reasoning": reasoning, "content": "Let me check.",
            "calls": [["get_weather", call_args]]},
        "long_prompt": long_prompt,
        "max_model_len": 1024,
    });
    let out = run_python("serve_openai.py", &config);
    println!("{out}");
    let log = server.log();
    assert!(
        log.contains("request_id=") && log.contains("status=200"),
        "request log: {log}"
    );
    assert!(
        log.contains("client gone"),
        "a disconnect must stop its sequence: {log}"
    );
}

/// curl, streaming and not: the same text as the library, `data: [DONE]` last.
/// With decode graphs on (the default), which on the CPU run every step eagerly (and /metrics counts them so).
#[test]
fn curl_streams_server_sent_events() {
    let model = model();
    let server = Server::start(&[]);
    let prompt = "Once upon a time";
    let expect = reference(&model, prompt, 10, &[]);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": true});
    let out = Command::new("curl")
        .args([
            "-sS",
            "-N",
            "--max-time",
            "60",
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(body.to_string())
        .arg(format!("{}/v1/completions", server.url))
        .output()
        .expect("curl is needed for this test");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, expect["text"].as_str().unwrap());

    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0});
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "60",
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(body.to_string())
        .arg(format!("{}/v1/completions", server.url))
        .output()
        .unwrap();
    let value: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(value["choices"][0]["text"], expect["text"]);
    assert_eq!(value["usage"]["prompt_tokens"], expect["prompt_tokens"]);
    assert_eq!(
        value["usage"]["completion_tokens"],
        expect["completion_tokens"]
    );

    let metrics = Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .arg(format!("{}/metrics", server.url))
        .output()
        .unwrap();
    let metrics = String::from_utf8(metrics.stdout).unwrap();
    for name in [
        "glm5_requests_total{outcome=\"success\"} 2",
        "glm5_queue_length 0",
        "glm5_step_seconds_count",
        "glm5_sample_seconds_count",
        "glm5_kv_blocks_in_use 0",
        "glm5_time_to_first_token_seconds_bucket",
    ] {
        assert!(
            metrics.contains(name),
            "{name} missing from /metrics:\n{metrics}"
        );
    }
    let generated = 2 * expect["completion_tokens"].as_u64().unwrap();
    assert!(
        metrics.contains(&format!("glm5_generation_tokens_total {generated}")),
        "{metrics}"
    );
    let value = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{metrics}"))
    };
    assert_eq!(
        value("glm5_engine_steps_by_path_total{path=\"eager\"}"),
        value("glm5_step_seconds_count"),
        "every step eager on the CPU:\n{metrics}"
    );
    assert_eq!(
        value("glm5_engine_steps_by_path_total{path=\"graph_replay\"}"),
        0
    );
    // Every step of these requests picks a token (no prompt is longer than a chunk).
    assert_eq!(
        value("glm5_sample_seconds_count"),
        value("glm5_step_seconds_count"),
        "{metrics}"
    );
}

/// SIGTERM: the request in flight finishes, new ones are refused, the process exits cleanly.
#[cfg(unix)]
#[test]
fn sigterm_finishes_running_requests_then_exits() {
    let mut server = Server::start(&["--shutdown-grace", "60"]);
    let body = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 400, "temperature": 0,
        "stream": true, "ignore_eos": true});
    let curl = Command::new("curl")
        .args([
            "-sS",
            "-N",
            "--max-time",
            "120",
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(body.to_string())
        .arg(format!("{}/v1/completions", server.url))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Let the request start.
    std::thread::sleep(Duration::from_millis(300));
    let kill = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = curl.wait_with_output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "the running stream must finish: {text}"
    );
    assert!(!text.contains("\"error\""), "{text}");
    assert_eq!(
        text.matches("\"finish_reason\":\"length\"").count(),
        1,
        "all 400 tokens, then a normal end: {text}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "glm5 serve did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}\n{}", server.log());
    assert!(server.log().contains("shutting down"), "{}", server.log());
}

/// A bounded load test on loopback: 64 concurrent streaming clients; every reply equals its solo greedy
/// reply; latency percentiles and throughput printed; RSS flat between two equal rounds.
#[test]
fn load_on_loopback_loses_and_corrupts_nothing() {
    let model = model();
    // The layers over two devices (both the CPU): each step in two micro-batches by default.
    let server = Server::start(&["--max-seqs", "32", "--devices", "cpu,cpu"]);
    let prompts: Vec<Value> = (0..8)
        .map(|i| {
            let content = format!("Tell me fact number {i} about the market.");
            let prompt = chat_prompt(&model, &[Message::user(&content)], false);
            let mut expect = reference(&model, &prompt, 16, &[]);
            expect["messages"] = json!([{"role": "user", "content": content}]);
            expect
        })
        .collect();
    let config = json!({
        "base_url": format!("{}/v1", server.url),
        "model": MODEL,
        "pid": server.child.id(),
        "clients": 64,
        "requests": 192,
        "prompts": prompts,
    });
    let out = run_python("serve_load.py", &config);
    println!("{out}");
    assert!(out.contains("lost 0, corrupted 0"), "{out}");
    assert!(server.log().contains("micro_batches=2"), "{}", server.log());
}

/// `body` posted to the server's `/v1/completions` by curl on a thread of its own (so that requests run at
/// once); the thread returns the JSON reply.
fn complete_in_thread(server: &Server, body: Value) -> std::thread::JoinHandle<Value> {
    let url = format!("{}/v1/completions", server.url);
    std::thread::spawn(move || {
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "120",
                "-H",
                "content-type: application/json",
                "-d",
            ])
            .arg(body.to_string())
            .arg(url)
            .output()
            .expect("curl is needed for this test");
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    })
}

/// A pool too small for the requests running at once: sequences are preempted (their blocks freed) and
/// recomputed later, yet every reply equals the library's solo greedy reply and nothing fails.
#[test]
fn preempted_sequences_resume_with_their_solo_tokens() {
    let model = model();
    let max_tokens = 90;
    // Prompts whose greedy reply runs to max_tokens, so every sequence grows into a second block.
    let expects: Vec<(String, Value)> = (0..40)
        .map(|i| format!("Item {i}: the story so far"))
        .map(|p| {
            let expect = reference(&model, &p, max_tokens, &[]);
            (p, expect)
        })
        .filter(|(_, e)| e["finish_reason"] == "length")
        .take(4)
        .collect();
    assert_eq!(
        expects.len(),
        4,
        "prompts whose greedy reply reaches max_tokens"
    );
    // Three blocks of 64 tokens: each sequence needs two by its end, so they cannot all keep theirs. Each
    // step in two micro-batches, as a placement over two devices would split it.
    let server = Server::start(&[
        "--kv-budget",
        "192",
        "--max-seqs",
        "4",
        "--micro-batches",
        "2",
    ]);
    let threads: Vec<_> = expects
        .iter()
        .map(|(prompt, _)| {
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
            complete_in_thread(&server, body)
        })
        .collect();
    for ((prompt, expect), thread) in expects.iter().zip(threads) {
        let value = thread.join().unwrap();
        assert_eq!(
            value["choices"][0]["text"], expect["text"],
            "{prompt}: {value}"
        );
        assert_eq!(
            value["usage"]["completion_tokens"], expect["completion_tokens"],
            "{prompt}"
        );
    }
    let metrics = Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .arg(format!("{}/metrics", server.url))
        .output()
        .unwrap();
    let metrics = String::from_utf8(metrics.stdout).unwrap();
    let preemptions: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("glm5_preemptions_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no glm5_preemptions_total in /metrics:\n{metrics}"));
    println!("preemptions: {preemptions}");
    assert!(
        preemptions >= 1,
        "the pool was too small not to preempt:\n{metrics}"
    );
    for line in [
        "glm5_kv_blocks_in_use 0",
        "glm5_kv_blocks_total 3",
        "glm5_kv_block_tokens 64",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    assert!(server.log().contains("preempted"), "{}", server.log());
}

/// Requests whose prompts start with what a running sequence has computed (a long shared system prompt) share
/// its whole blocks instead of recomputing them: their usage reports whole blocks of cached tokens, and their
/// replies equal the library's solo greedy replies, also while the sequence they share with goes on writing.
#[test]
fn prompts_sharing_a_running_prefix_share_its_blocks() {
    let model = model();
    let tokenizer = model.tokenizer();
    let system: String = (0..40)
        .map(|i| format!("Rule {i}: answer plainly. "))
        .collect();
    let prefix_tokens = tokenizer.encode(&system).unwrap().len();
    assert!(
        prefix_tokens > 2 * 64 && !prefix_tokens.is_multiple_of(64),
        "a prefix of several blocks, not whole ones: {prefix_tokens} tokens"
    );
    let server = Server::start(&["--max-seqs", "8"]);
    // The sequence the others share with: it runs (ignore_eos) long after they arrive.
    let first = complete_in_thread(
        &server,
        json!({"model": MODEL, "prompt": format!("{system}Story:"), "max_tokens": 500,
               "temperature": 0, "ignore_eos": true}),
    );
    // Until its prompt is computed (the running sequences' KV rows pass the prefix).
    let started = Instant::now();
    loop {
        let metrics = Command::new("curl")
            .args(["-sS", "--max-time", "10"])
            .arg(format!("{}/metrics", server.url))
            .output()
            .unwrap();
        let rows: usize = String::from_utf8_lossy(&metrics.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("glm5_kv_tokens_in_use "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if rows > prefix_tokens {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the first prompt was not computed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let prompts: Vec<String> = (0..3).map(|i| format!("{system}Question {i}:")).collect();
    let threads: Vec<_> = prompts
        .iter()
        .map(|p| {
            complete_in_thread(
                &server,
                json!({"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0}),
            )
        })
        .collect();
    for (prompt, thread) in prompts.iter().zip(threads) {
        let value = thread.join().unwrap();
        let expect = reference(&model, prompt, 12, &[]);
        assert_eq!(
            value["choices"][0]["text"], expect["text"],
            "{prompt}: {value}"
        );
        let cached = value["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            cached >= 128 && cached.is_multiple_of(64) && cached as usize <= prefix_tokens,
            "whole shared blocks of the {prefix_tokens}-token prefix: {value}"
        );
    }
    let first = first.join().unwrap();
    assert_eq!(first["usage"]["completion_tokens"], 500, "{first}");
}

/// Sampled requests running in one batch (greedy, top-p, top-k, plain temperature, presence and frequency
/// penalties, each with its seed) get
/// the tokens the library samples for each alone with the same settings: the server samples a step's
/// sequences together (one read-back for the greedy rows, one for the others) with the same draws; also with
/// each step split into three micro-batches.
#[test]
fn batched_sampled_replies_equal_the_librarys_seeded_ones() {
    for micro_batches in ["1", "3"] {
        batched_sampled_replies_with(&["--max-seqs", "8", "--micro-batches", micro_batches]);
    }
}

fn batched_sampled_replies_with(server_args: &[&str]) {
    let model = model();
    let max_tokens = 24;
    let settings = [
        json!({"temperature": 0}),
        json!({"temperature": 1.0, "top_p": 0.9, "seed": 11}),
        // top_p 1 is off (the server's default is the model's generation_config.json's 0.95).
        json!({"temperature": 0.7, "top_k": 5, "top_p": 1.0, "seed": 12}),
        json!({"temperature": 1.3, "top_p": 1.0, "seed": 13}),
        json!({"temperature": 0.9, "top_p": 0.6, "top_k": 40, "min_p": 0.05, "seed": 14}),
        json!({"temperature": 0.8, "top_p": 1.0, "presence_penalty": 0.7, "frequency_penalty": 0.4, "seed": 15}),
        json!({"temperature": 0, "frequency_penalty": 1.5}),
    ];
    let story = |i: usize| format!("Story {i}: once upon a time");
    let server = Server::start(server_args);
    let threads: Vec<_> = settings
        .iter()
        .enumerate()
        .map(|(i, setting)| {
            let mut body = json!({"model": MODEL, "prompt": story(i), "max_tokens": max_tokens});
            body.as_object_mut()
                .unwrap()
                .extend(setting.as_object().unwrap().clone());
            complete_in_thread(&server, body)
        })
        .collect();
    for (i, (setting, thread)) in settings.iter().zip(threads).enumerate() {
        let value = thread.join().unwrap();
        let number = |key: &str| setting.get(key).and_then(Value::as_f64);
        let params = GenerationParams {
            max_new_tokens: max_tokens,
            temperature: number("temperature").unwrap(),
            top_p: number("top_p").filter(|p| *p != 1.0),
            top_k: number("top_k").map(|k| k as usize),
            min_p: number("min_p"),
            presence_penalty: number("presence_penalty").unwrap_or(0.0) as f32,
            frequency_penalty: number("frequency_penalty").unwrap_or(0.0) as f32,
            seed: number("seed").map_or(0, |s| s as u64),
            ..Default::default()
        };
        let expect = library_reply(&model, &story(i), &params);
        assert_eq!(
            value["choices"][0]["text"], expect["text"],
            "{setting}: {value}"
        );
        assert_eq!(
            value["usage"]["completion_tokens"], expect["completion_tokens"],
            "{setting}"
        );
    }
}

/// Options that cannot work stop the server before it listens, with a message naming them.
#[test]
fn impossible_options_are_refused_by_name() {
    for (args, name) in [
        (["--micro-batches", "0"], "--micro-batches"),
        (["--max-seqs", "0"], "--max-seqs"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_glm5"))
            .args(["serve", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr.contains(name), "{args:?}: {stderr}");
        assert!(!stderr.contains("listening on"), "{args:?}: {stderr}");
    }
}
