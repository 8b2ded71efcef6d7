//! The HTTP routes: OpenAI's chat and text completions (JSON or server-sent events), models, health and
//! metrics.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::metrics::Metrics;
use super::openai::{self, ChatRequest, CompletionRequest, Prompt};
use super::scheduler::{
    kv_reservation, Scheduler, SeqEvent, SeqRequest, SubmitError, TokenLogprobs,
};
use crate::chat::ChatTemplate;
use crate::reasoning::{prompt_opens_thinking, ReasoningSplitter};
use crate::tokenizer::Tokenizer;
use crate::tool_calls::{ToolCall, ToolCallParser, ToolEvent};
use crate::{FinishReason, GenerationParams};

/// What every handler shares.
pub struct AppState {
    /// The engine.
    pub scheduler: Scheduler,
    /// The model's tokenizer (prompts are tokenized on the request side).
    pub tokenizer: Tokenizer,
    /// The model's chat template.
    pub template: Option<ChatTemplate>,
    /// The name `/v1/models` lists and requests must use.
    pub model_name: String,
    /// Sampling defaults of the model (generation_config.json).
    pub defaults: GenerationParams,
    /// Required bearer token.
    pub api_key: Option<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// How long a request body may take to arrive.
    pub body_timeout: Duration,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Server start (the model's `created`).
    pub created: u64,
    /// Request id counter.
    pub next_id: AtomicU64,
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(fallback)
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(state)
}

async fn fallback(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.scheduler.is_accepting() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::unavailable().into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render(),
    )
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "glm5",
        "max_model_len": state.scheduler.config().max_model_len,
    }]}))
    .into_response()
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Constant-time comparison: the key's bytes do not leak through timing.
    let matches = given.is_some_and(|given| {
        given.len() == key.len()
            && given
                .bytes()
                .zip(key.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    if matches {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

/// Reads the body within the size and time limits and parses it as `T`.
async fn read_json<T: serde::de::DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, ApiError> {
    let declared = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > state.max_body_bytes as u64) {
        return Err(ApiError::too_large(state.max_body_bytes));
    }
    let bytes = match tokio::time::timeout(
        state.body_timeout,
        axum::body::to_bytes(body, state.max_body_bytes),
    )
    .await
    {
        Err(_) => return Err(ApiError::timeout()),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            return Err(if too_large {
                ApiError::too_large(state.max_body_bytes)
            } else {
                ApiError::bad_request(format!("cannot read the request body: {e}"))
            });
        }
        Ok(Ok(bytes)) => bytes,
    };
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("The request body is not a valid request: {e}")))
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(name) if name != state.model_name => {
            Err(ApiError::unknown_model(name, &state.model_name))
        }
        _ => Ok(()),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// One request's sequences, submitted: the receiver of all their events.
struct Submitted {
    id: String,
    events: mpsc::UnboundedReceiver<SeqEvent>,
    /// Per sequence: its prompt's token count.
    prompt_tokens: Vec<usize>,
    arrived: Instant,
}

/// How every sequence of a request runs.
struct SequenceSpec<'a> {
    params: &'a GenerationParams,
    max_tokens: Option<i64>,
    logprobs: Option<usize>,
    ignore_eos: bool,
}

fn submit(
    state: &AppState,
    id: String,
    prompts: Vec<Vec<u32>>,
    n: usize,
    spec: SequenceSpec<'_>,
    arrived: Instant,
) -> Result<Submitted, ApiError> {
    let config = state.scheduler.config();
    let (sender, events) = mpsc::unbounded_channel();
    let mut sequences = Vec::new();
    let mut prompt_tokens = Vec::new();
    for (p, prompt) in prompts.into_iter().enumerate() {
        let max_new = openai::max_new_tokens(spec.max_tokens, prompt.len(), config.max_model_len)?;
        let needed = kv_reservation(prompt.len(), max_new, config.max_model_len);
        if needed > config.kv_budget {
            return Err(ApiError::bad_request(format!(
                "the request needs {needed} tokens of KV cache but the server's budget is {} \
                 (--kv-budget); ask for fewer max_tokens",
                config.kv_budget
            )));
        }
        for j in 0..n {
            let mut params = spec.params.clone();
            params.max_new_tokens = max_new;
            params.seed = params.seed.wrapping_add(j as u64);
            prompt_tokens.push(prompt.len());
            sequences.push(SeqRequest {
                request_id: id.clone(),
                choice: p * n + j,
                prompt: prompt.clone(),
                params,
                logprobs: spec.logprobs,
                ignore_eos: spec.ignore_eos,
                events: sender.clone(),
            });
        }
    }
    state.scheduler.submit(sequences).map_err(|e| match e {
        SubmitError::QueueFull => ApiError::queue_full(),
        SubmitError::ShuttingDown => ApiError::unavailable(),
    })?;
    Ok(Submitted {
        id,
        events,
        prompt_tokens,
        arrived,
    })
}

fn new_id(state: &AppState, prefix: &str) -> String {
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{:x}{n:06x}", state.created & 0xffff_ffff)
}

/// Finishes a request's bookkeeping: metrics and the log line.
fn log_request(
    state: &AppState,
    endpoint: &str,
    id: &str,
    status: u16,
    arrived: Instant,
    usage: Option<(usize, usize)>,
) {
    state.metrics.count_request(status);
    let seconds = arrived.elapsed().as_secs_f64();
    if status == 200 {
        state.metrics.request_seconds.observe(seconds);
    }
    let (prompt_tokens, completion_tokens) = usage.unwrap_or_default();
    tracing::info!(
        request_id = id,
        endpoint,
        status,
        prompt_tokens,
        completion_tokens,
        ms = (seconds * 1000.0).round(),
        "request"
    );
}

// ----------------------------------------------------------------------------------------------------
// Per-choice output processing

/// What a choice's text turned into.
#[derive(Default)]
struct Delta {
    reasoning: String,
    content: String,
    calls: Vec<ToolCall>,
}

/// What one engine event means for one choice: new output, its log-probabilities, the finish reason.
struct Update<D> {
    choice: usize,
    delta: D,
    logprobs: Option<Value>,
    finish: Option<&'static str>,
}

/// One choice of a chat request: reasoning split, tool-call parsing, totals.
struct ChatChoice {
    splitter: ReasoningSplitter,
    tools: Option<ToolCallParser>,
    reasoning: String,
    content: String,
    calls: Vec<(String, ToolCall)>,
    logprobs: Vec<Value>,
    finish: Option<String>,
    saw_reasoning: bool,
}

impl ChatChoice {
    fn new(starts_in_reasoning: bool, tools: Option<Vec<Value>>) -> Self {
        Self {
            splitter: ReasoningSplitter::new(starts_in_reasoning),
            tools: tools.map(ToolCallParser::new),
            reasoning: String::new(),
            content: String::new(),
            calls: Vec::new(),
            logprobs: Vec::new(),
            finish: None,
            saw_reasoning: starts_in_reasoning,
        }
    }

    fn push(&mut self, text: &str, last: bool) -> Delta {
        let mut split = self.splitter.push(text);
        if last {
            let rest = self.splitter.finish();
            split.reasoning.push_str(&rest.reasoning);
            split.content.push_str(&rest.content);
        }
        if self.splitter.in_reasoning() || !split.reasoning.is_empty() {
            self.saw_reasoning = true;
        }
        let mut delta = Delta {
            reasoning: split.reasoning,
            ..Default::default()
        };
        match &mut self.tools {
            None => delta.content = split.content,
            Some(parser) => {
                let mut events = parser.push(&split.content);
                if last {
                    events.extend(parser.finish());
                }
                for event in events {
                    match event {
                        ToolEvent::Content(text) => delta.content.push_str(&text),
                        ToolEvent::Call(call) => delta.calls.push(call),
                    }
                }
            }
        }
        self.reasoning.push_str(&delta.reasoning);
        self.content.push_str(&delta.content);
        delta
    }
}

fn finish_reason(reason: &FinishReason, called_tools: bool) -> &'static str {
    match reason {
        FinishReason::EndOfSequence(_) | FinishReason::StopString(_) if called_tools => {
            "tool_calls"
        }
        FinishReason::EndOfSequence(_) | FinishReason::StopString(_) => "stop",
        FinishReason::MaxTokens | FinishReason::ContextFull => "length",
    }
}

fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id]).unwrap_or_default()
}

/// Chat `logprobs.content` entry.
fn chat_logprob(tokenizer: &Tokenizer, id: u32, lp: &TokenLogprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let token = token_text(tokenizer, id);
        json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
    };
    let mut value = entry(id, lp.logprob);
    value["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
    value
}

fn usage_json(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Token totals of a request.
#[derive(Default, Clone, Copy)]
struct Usage {
    prompt: usize,
    completion: usize,
    cached: usize,
}

impl Usage {
    fn json(&self) -> Value {
        usage_json(self.prompt, self.completion, self.cached)
    }
}

// ----------------------------------------------------------------------------------------------------
// Chat completions

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let arrived = Instant::now();
    let id = new_id(&state, "chatcmpl");
    match start_chat(&state, &headers, body, id.clone(), arrived).await {
        Ok(response) => response,
        Err(e) => {
            log_request(&state, "chat", &id, e.status.as_u16(), arrived, None);
            e.into_response()
        }
    }
}

struct ChatJob {
    submitted: Submitted,
    choices: Vec<ChatChoice>,
    logprobs: bool,
    include_usage: bool,
}

async fn start_chat(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    id: String,
    arrived: Instant,
) -> Result<Response, ApiError> {
    authorize(state, headers)?;
    let request: ChatRequest = read_json(state, headers, body).await?;
    check_model(state, request.sampling.model.as_deref())?;
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("the model has no chat template; use /v1/completions")
    })?;
    let messages = openai::template_messages(&request.messages)?;
    let tools = request.tools.clone().filter(|t| !t.is_empty());
    if let Some(tools) = &tools {
        openai::check_tools(tools)?;
    }
    let parse_tools = openai::parse_tools_for(request.tool_choice.as_ref())? && tools.is_some();
    let kwargs = request.chat_template_kwargs.clone().unwrap_or_default();
    let prompt = template
        .render_json(
            &messages,
            tools.as_ref().map(|t| json!(t)).as_ref(),
            true,
            &kwargs,
        )
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let ids = state
        .tokenizer
        .encode(&prompt)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let n = openai::choices(request.sampling.n, state.scheduler.config().max_seqs)?;
    let params = openai::sampling_params(&request.sampling, &state.defaults)?;
    let top_logprobs = match request.top_logprobs {
        Some(k) if !(0..=openai::MAX_TOP_LOGPROBS).contains(&k) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                format!(
                    "top_logprobs must be between 0 and {}",
                    openai::MAX_TOP_LOGPROBS
                ),
            ))
        }
        Some(_) if !request.logprobs => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        k => k.unwrap_or(0) as usize,
    };
    let logprobs = request.logprobs.then_some(top_logprobs);
    let max_tokens = request
        .max_completion_tokens
        .or(request.sampling.max_tokens);
    let submitted = submit(
        state,
        id,
        vec![ids],
        n,
        SequenceSpec {
            params: &params,
            max_tokens,
            logprobs,
            ignore_eos: request.sampling.ignore_eos,
        },
        arrived,
    )?;
    let opens_thinking = prompt_opens_thinking(&prompt);
    let choices = (0..n)
        .map(|_| ChatChoice::new(opens_thinking, tools.clone().filter(|_| parse_tools)))
        .collect();
    let job = ChatJob {
        submitted,
        choices,
        logprobs: request.logprobs,
        include_usage: request
            .sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    if request.sampling.stream {
        Ok(sse(chat_stream(state.clone(), job)))
    } else {
        chat_response(state, job).await
    }
}

/// Applies one event to the job; the delta of a choice when there is something to send.
fn chat_event(
    state: &AppState,
    job: &mut ChatJob,
    event: SeqEvent,
    usage: &mut Usage,
    first_token: &mut bool,
) -> Result<Update<Delta>, ApiError> {
    match event {
        SeqEvent::Token {
            choice,
            id,
            text,
            logprobs,
        } => {
            if id.is_some() && !*first_token {
                *first_token = true;
                state
                    .metrics
                    .ttft_seconds
                    .observe(job.submitted.arrived.elapsed().as_secs_f64());
            }
            let c = &mut job.choices[choice];
            let delta = c.push(&text, false);
            let lp = match (id, &logprobs) {
                (Some(id), Some(lp)) if job.logprobs => {
                    let entry = chat_logprob(&state.tokenizer, id, lp);
                    c.logprobs.push(entry.clone());
                    Some(entry)
                }
                _ => None,
            };
            Ok(Update {
                choice,
                delta,
                logprobs: lp,
                finish: None,
            })
        }
        SeqEvent::Finished {
            choice,
            reason,
            prompt_tokens,
            cached_tokens,
            completion_tokens,
        } => {
            let _ = prompt_tokens; // counted once per prompt by `prompt_usage`
            usage.completion += completion_tokens;
            if choice == 0 {
                usage.cached = cached_tokens;
            }
            let c = &mut job.choices[choice];
            let delta = c.push("", true);
            let called = !c.calls.is_empty() || !delta.calls.is_empty();
            let reason = finish_reason(&reason, called);
            c.finish = Some(reason.to_string());
            Ok(Update {
                choice,
                delta,
                logprobs: None,
                finish: Some(reason),
            })
        }
        SeqEvent::Failed { message, .. } => Err(ApiError::internal(message)),
    }
}

/// Counts a request's prompt tokens once per prompt (choices of one prompt share it).
fn prompt_usage(submitted: &Submitted, n: usize, usage: &mut Usage) {
    usage.prompt = submitted.prompt_tokens.iter().step_by(n.max(1)).sum();
}

async fn chat_response(state: &Arc<AppState>, mut job: ChatJob) -> Result<Response, ApiError> {
    let mut usage = Usage::default();
    let mut first = false;
    let n = job.choices.len();
    let mut finished = 0;
    while finished < n {
        let Some(event) = job.submitted.events.recv().await else {
            return Err(ApiError::internal("the engine stopped"));
        };
        let update = chat_event(state, &mut job, event, &mut usage, &mut first)?;
        let c = &mut job.choices[update.choice];
        for call in update.delta.calls {
            c.calls.push((
                call_id(&job.submitted.id, update.choice, c.calls.len()),
                call,
            ));
        }
        if update.finish.is_some() {
            finished += 1;
        }
    }
    prompt_usage(&job.submitted, n, &mut usage);
    let choices: Vec<Value> = job
        .choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let mut message = Map::new();
            message.insert("role".into(), "assistant".into());
            let content = if c.calls.is_empty() {
                Value::from(c.content.clone())
            } else {
                Some(c.content.trim())
                    .filter(|t| !t.is_empty())
                    .map_or(Value::Null, Value::from)
            };
            message.insert("content".into(), content);
            if c.saw_reasoning {
                message.insert("reasoning_content".into(), c.reasoning.clone().into());
            }
            if !c.calls.is_empty() {
                message.insert(
                    "tool_calls".into(),
                    c.calls
                        .iter()
                        .map(|(id, call)| tool_call_json(id, call))
                        .collect(),
                );
            }
            let logprobs = if job.logprobs {
                json!({"content": c.logprobs})
            } else {
                Value::Null
            };
            json!({
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": c.finish,
            })
        })
        .collect();
    log_request(
        state,
        "chat",
        &job.submitted.id,
        200,
        job.submitted.arrived,
        Some((usage.prompt, usage.completion)),
    );
    Ok(Json(json!({
        "id": job.submitted.id,
        "object": "chat.completion",
        "created": unix_now(),
        "model": state.model_name,
        "choices": choices,
        "usage": usage.json(),
    }))
    .into_response())
}

fn call_id(request_id: &str, choice: usize, index: usize) -> String {
    format!(
        "call_{}_{choice}_{index}",
        request_id.trim_start_matches("chatcmpl-")
    )
}

fn tool_call_json(id: &str, call: &ToolCall) -> Value {
    json!({"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
}

fn sse<S>(stream: S) -> Response
where
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response()
}

/// State of a streamed chat request.
struct ChatStream {
    state: Arc<AppState>,
    job: ChatJob,
    pending: std::collections::VecDeque<Event>,
    usage: Usage,
    first: bool,
    finished: usize,
    done: bool,
    created: u64,
    /// Whether a choice's first chunk (with the role) went out.
    started: Vec<bool>,
}

fn chat_stream(
    state: Arc<AppState>,
    job: ChatJob,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let n = job.choices.len();
    let stream = ChatStream {
        state,
        job,
        pending: Default::default(),
        usage: Usage::default(),
        first: false,
        finished: 0,
        done: false,
        created: unix_now(),
        started: vec![false; n],
    };
    futures_util::stream::unfold(stream, |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok(event), s));
            }
            if s.done {
                return None;
            }
            s.next_events().await;
        }
    })
}

impl ChatStream {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Event {
        let mut body = json!({
            "id": self.job.submitted.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        });
        if self.job.include_usage {
            body["usage"] = usage.unwrap_or(Value::Null);
        }
        Event::default().data(body.to_string())
    }

    async fn next_events(&mut self) {
        let n = self.job.choices.len();
        let Some(event) = self.job.submitted.events.recv().await else {
            self.fail(ApiError::internal("the engine stopped"));
            return;
        };
        let result = chat_event(
            &self.state,
            &mut self.job,
            event,
            &mut self.usage,
            &mut self.first,
        );
        let Update {
            choice,
            delta,
            logprobs,
            finish: reason,
        } = match result {
            Err(e) => return self.fail(e),
            Ok(update) => update,
        };
        if !self.started[choice] {
            self.started[choice] = true;
            let role = json!([{"index": choice, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}]);
            let event = self.chunk(role, None);
            self.pending.push_back(event);
        }
        let mut d = Map::new();
        if !delta.reasoning.is_empty() {
            d.insert("reasoning_content".into(), delta.reasoning.into());
        }
        if !delta.content.is_empty() {
            d.insert("content".into(), delta.content.into());
        }
        if !delta.calls.is_empty() {
            let c = &mut self.job.choices[choice];
            let mut calls = Vec::new();
            for call in delta.calls {
                let index = c.calls.len();
                let id = call_id(&self.job.submitted.id, choice, index);
                let mut value = tool_call_json(&id, &call);
                value["index"] = index.into();
                calls.push(value);
                c.calls.push((id, call));
            }
            d.insert("tool_calls".into(), calls.into());
        }
        if !d.is_empty() || logprobs.is_some() || reason.is_some() {
            let choices = json!([{
                "index": choice,
                "delta": d,
                "logprobs": logprobs.map(|lp| json!({"content": [lp]})),
                "finish_reason": reason,
            }]);
            let event = self.chunk(choices, None);
            self.pending.push_back(event);
        }
        if reason.is_some() {
            self.finished += 1;
            if self.finished == n {
                prompt_usage(&self.job.submitted, n, &mut self.usage);
                if self.job.include_usage {
                    let event = self.chunk(json!([]), Some(self.usage.json()));
                    self.pending.push_back(event);
                }
                self.pending.push_back(Event::default().data("[DONE]"));
                self.done = true;
                log_request(
                    &self.state,
                    "chat",
                    &self.job.submitted.id,
                    200,
                    self.job.submitted.arrived,
                    Some((self.usage.prompt, self.usage.completion)),
                );
            }
        }
    }

    /// An error after the stream started: an error event, then the end.
    fn fail(&mut self, e: ApiError) {
        self.pending
            .push_back(Event::default().data(e.body().to_string()));
        self.pending.push_back(Event::default().data("[DONE]"));
        self.done = true;
        log_request(
            &self.state,
            "chat",
            &self.job.submitted.id,
            e.status.as_u16(),
            self.job.submitted.arrived,
            None,
        );
    }
}

// ----------------------------------------------------------------------------------------------------
// Text completions

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let arrived = Instant::now();
    let id = new_id(&state, "cmpl");
    match start_completion(&state, &headers, body, id.clone(), arrived).await {
        Ok(response) => response,
        Err(e) => {
            log_request(&state, "completions", &id, e.status.as_u16(), arrived, None);
            e.into_response()
        }
    }
}

struct CompletionChoice {
    text: String,
    finish: Option<&'static str>,
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

struct CompletionJob {
    submitted: Submitted,
    n: usize,
    choices: Vec<CompletionChoice>,
    logprobs: bool,
    include_usage: bool,
}

async fn start_completion(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    id: String,
    arrived: Instant,
) -> Result<Response, ApiError> {
    authorize(state, headers)?;
    let request: CompletionRequest = read_json(state, headers, body).await?;
    check_model(state, request.sampling.model.as_deref())?;
    if request.echo {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let n = openai::choices(request.sampling.n, state.scheduler.config().max_seqs)?;
    if request.best_of.is_some_and(|b| b != n as i64) {
        return Err(ApiError::invalid_param(
            "best_of",
            "best_of must equal n when given",
        ));
    }
    let vocab = state.tokenizer.vocab_size();
    let prompts = openai::completion_prompts(&request.prompt)?
        .into_iter()
        .map(|prompt| match prompt {
            Prompt::Text(text) => state
                .tokenizer
                .encode(&text)
                .map_err(|e| ApiError::bad_request(e.to_string())),
            Prompt::Ids(ids) if ids.iter().all(|&id| (id as usize) < vocab) => Ok(ids),
            Prompt::Ids(_) => Err(ApiError::invalid_param(
                "prompt",
                format!("token ids must be below the vocabulary size {vocab}"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if prompts.len() * n > state.scheduler.config().max_seqs {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "{} prompts x n={n} is more than the server's --max-seqs {}",
                prompts.len(),
                state.scheduler.config().max_seqs
            ),
        ));
    }
    let params = openai::sampling_params(&request.sampling, &state.defaults)?;
    let logprobs = match request.logprobs {
        Some(k) if !(0..=openai::MAX_TOP_LOGPROBS).contains(&k) => {
            return Err(ApiError::invalid_param(
                "logprobs",
                format!(
                    "logprobs must be between 0 and {}",
                    openai::MAX_TOP_LOGPROBS
                ),
            ))
        }
        k => k.map(|k| k as usize),
    };
    let count = prompts.len() * n;
    let submitted = submit(
        state,
        id,
        prompts,
        n,
        SequenceSpec {
            params: &params,
            max_tokens: request.sampling.max_tokens,
            logprobs,
            ignore_eos: request.sampling.ignore_eos,
        },
        arrived,
    )?;
    let job = CompletionJob {
        submitted,
        n,
        choices: (0..count)
            .map(|_| CompletionChoice {
                text: String::new(),
                finish: None,
                tokens: Vec::new(),
                token_logprobs: Vec::new(),
                top_logprobs: Vec::new(),
                text_offset: Vec::new(),
            })
            .collect(),
        logprobs: logprobs.is_some(),
        include_usage: request
            .sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    if request.sampling.stream {
        Ok(sse(completion_stream(state.clone(), job)))
    } else {
        completion_response(state, job).await
    }
}

/// Applies one event; returns `(choice, new text, logprobs of this token, finish reason)`.
fn completion_event(
    state: &AppState,
    job: &mut CompletionJob,
    event: SeqEvent,
    usage: &mut Usage,
    first_token: &mut bool,
) -> Result<Update<String>, ApiError> {
    match event {
        SeqEvent::Token {
            choice,
            id,
            text,
            logprobs,
        } => {
            if id.is_some() && !*first_token {
                *first_token = true;
                state
                    .metrics
                    .ttft_seconds
                    .observe(job.submitted.arrived.elapsed().as_secs_f64());
            }
            let c = &mut job.choices[choice];
            let offset = c.text.len();
            c.text.push_str(&text);
            let lp = match (id, logprobs) {
                (Some(id), Some(lp)) if job.logprobs => {
                    let token = token_text(&state.tokenizer, id);
                    let top: Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|&(t, l)| (token_text(&state.tokenizer, t), Value::from(l)))
                        .collect();
                    c.tokens.push(token.clone());
                    c.token_logprobs.push(lp.logprob);
                    c.top_logprobs.push(Value::Object(top.clone()));
                    c.text_offset.push(offset);
                    Some(json!({"tokens": [token], "token_logprobs": [lp.logprob],
                        "top_logprobs": [top], "text_offset": [offset]}))
                }
                _ => None,
            };
            Ok(Update {
                choice,
                delta: text,
                logprobs: lp,
                finish: None,
            })
        }
        SeqEvent::Finished {
            choice,
            reason,
            prompt_tokens: _,
            cached_tokens,
            completion_tokens,
        } => {
            usage.completion += completion_tokens;
            if choice % job.n == 0 {
                usage.cached += cached_tokens;
            }
            let reason = finish_reason(&reason, false);
            job.choices[choice].finish = Some(reason);
            Ok(Update {
                choice,
                delta: String::new(),
                logprobs: None,
                finish: Some(reason),
            })
        }
        SeqEvent::Failed { message, .. } => Err(ApiError::internal(message)),
    }
}

async fn completion_response(
    state: &Arc<AppState>,
    mut job: CompletionJob,
) -> Result<Response, ApiError> {
    let mut usage = Usage::default();
    let mut first = false;
    let mut finished = 0;
    while finished < job.choices.len() {
        let Some(event) = job.submitted.events.recv().await else {
            return Err(ApiError::internal("the engine stopped"));
        };
        if completion_event(state, &mut job, event, &mut usage, &mut first)?
            .finish
            .is_some()
        {
            finished += 1;
        }
    }
    prompt_usage(&job.submitted, job.n, &mut usage);
    let choices: Vec<Value> = job
        .choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let logprobs = if job.logprobs {
                json!({"tokens": c.tokens, "token_logprobs": c.token_logprobs,
                    "top_logprobs": c.top_logprobs, "text_offset": c.text_offset})
            } else {
                Value::Null
            };
            json!({
                "index": index,
                "text": c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish,
            })
        })
        .collect();
    log_request(
        state,
        "completions",
        &job.submitted.id,
        200,
        job.submitted.arrived,
        Some((usage.prompt, usage.completion)),
    );
    Ok(Json(json!({
        "id": job.submitted.id,
        "object": "text_completion",
        "created": unix_now(),
        "model": state.model_name,
        "choices": choices,
        "usage": usage.json(),
    }))
    .into_response())
}

fn completion_stream(
    state: Arc<AppState>,
    job: CompletionJob,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    struct S {
        state: Arc<AppState>,
        job: CompletionJob,
        usage: Usage,
        first: bool,
        finished: usize,
        pending: std::collections::VecDeque<Event>,
        done: bool,
        created: u64,
    }
    let s = S {
        state,
        job,
        usage: Usage::default(),
        first: false,
        finished: 0,
        pending: Default::default(),
        done: false,
        created: unix_now(),
    };
    futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok(event), s));
            }
            if s.done {
                return None;
            }
            let chunk = |s: &S, choices: Value, usage: Option<Value>| {
                let mut body = json!({
                    "id": s.job.submitted.id,
                    "object": "text_completion",
                    "created": s.created,
                    "model": s.state.model_name,
                    "choices": choices,
                });
                if s.job.include_usage {
                    body["usage"] = usage.unwrap_or(Value::Null);
                }
                Event::default().data(body.to_string())
            };
            let Some(event) = s.job.submitted.events.recv().await else {
                s.pending.push_back(
                    Event::default()
                        .data(ApiError::internal("the engine stopped").body().to_string()),
                );
                s.pending.push_back(Event::default().data("[DONE]"));
                s.done = true;
                continue;
            };
            let (mut state_usage, mut first) = (s.usage, s.first);
            let result =
                completion_event(&s.state, &mut s.job, event, &mut state_usage, &mut first);
            s.usage = state_usage;
            s.first = first;
            match result {
                Err(e) => {
                    s.pending
                        .push_back(Event::default().data(e.body().to_string()));
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.done = true;
                    log_request(
                        &s.state,
                        "completions",
                        &s.job.submitted.id,
                        e.status.as_u16(),
                        s.job.submitted.arrived,
                        None,
                    );
                }
                Ok(Update {
                    choice,
                    delta: text,
                    logprobs,
                    finish: reason,
                }) => {
                    if !text.is_empty() || logprobs.is_some() || reason.is_some() {
                        let event = chunk(
                            &s,
                            json!([{"index": choice, "text": text, "logprobs": logprobs,
                                "finish_reason": reason}]),
                            None,
                        );
                        s.pending.push_back(event);
                    }
                    if reason.is_some() {
                        s.finished += 1;
                        if s.finished == s.job.choices.len() {
                            let mut usage = s.usage;
                            prompt_usage(&s.job.submitted, s.job.n, &mut usage);
                            s.usage = usage;
                            if s.job.include_usage {
                                let event = chunk(&s, json!([]), Some(s.usage.json()));
                                s.pending.push_back(event);
                            }
                            s.pending.push_back(Event::default().data("[DONE]"));
                            s.done = true;
                            log_request(
                                &s.state,
                                "completions",
                                &s.job.submitted.id,
                                200,
                                s.job.submitted.arrived,
                                Some((s.usage.prompt, s.usage.completion)),
                            );
                        }
                    }
                }
            }
        }
    })
}
