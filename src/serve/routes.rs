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
// One path for both endpoints. What differs is the prompt (built by `start_chat` / `start_completion`) and
// how a choice's text becomes JSON ([`Shape`]); event handling, usage, streaming and the response
// envelope are shared.

/// What a choice needs from its request to shape its output.
struct ChoiceContext<'a> {
    tokenizer: &'a Tokenizer,
    request_id: &'a str,
    index: usize,
}

/// How one choice turns the engine's text into an endpoint's JSON: chat (reasoning, tool calls,
/// `message` / `delta`) or text completions (`text`).
trait Shape: Send + 'static {
    /// The endpoint's name in logs.
    const ENDPOINT: &'static str;
    /// `object` of the non-streamed response.
    const OBJECT: &'static str;
    /// `object` of a streamed chunk.
    const CHUNK_OBJECT: &'static str;
    /// What one event added to the choice's output.
    type Delta;

    /// Takes a token's text, and its log-probabilities when the request asked for them; returns the new
    /// output and the streamed chunk's `logprobs`.
    fn token(
        &mut self,
        cx: &ChoiceContext,
        text: &str,
        logprobs: Option<(u32, &TokenLogprobs)>,
    ) -> (Self::Delta, Option<Value>);
    /// Flushes what the choice held back; returns it and the `finish_reason`.
    fn finish(&mut self, cx: &ChoiceContext, reason: &FinishReason) -> (Self::Delta, &'static str);
    /// The `choices` entries of the chunks streamed for one event, one chunk each (none: nothing to send).
    fn chunk_choices(
        &mut self,
        index: usize,
        delta: Self::Delta,
        logprobs: Option<Value>,
        finish: Option<&'static str>,
    ) -> Vec<Value>;
    /// The choice in the non-streamed response.
    fn response_choice(&self, index: usize, logprobs: bool) -> Value;
}

/// A submitted request's choices and what it asked for.
struct Job<S> {
    submitted: Submitted,
    /// Choices per prompt.
    n: usize,
    choices: Vec<S>,
    logprobs: bool,
    include_usage: bool,
}

/// A request ready to answer: its job, streamed or not.
struct Started<S> {
    job: Job<S>,
    stream: bool,
}

impl<S: Shape> Started<S> {
    /// The job of a request's submitted sequences: `n` choices per prompt, each made by `choice`.
    fn new(
        submitted: Submitted,
        n: usize,
        logprobs: bool,
        sampling: &openai::Sampling,
        choice: impl Fn() -> S,
    ) -> Self {
        let choices = submitted.prompt_tokens.iter().map(|_| choice()).collect();
        Self {
            job: Job {
                submitted,
                n,
                choices,
                logprobs,
                include_usage: sampling
                    .stream_options
                    .as_ref()
                    .is_some_and(|o| o.include_usage),
            },
            stream: sampling.stream,
        }
    }
}

/// Answers a started request (server-sent events or one JSON object), or its error.
async fn answer<S: Shape>(
    state: &Arc<AppState>,
    started: Result<Started<S>, ApiError>,
    id: &str,
    arrived: Instant,
) -> Response {
    let response = match started {
        Ok(Started { job, stream: true }) => Ok(sse(event_stream(state.clone(), job))),
        Ok(Started { job, stream: false }) => respond(state, job).await,
        Err(e) => Err(e),
    };
    response.unwrap_or_else(|e| {
        log_request(state, S::ENDPOINT, id, e.status.as_u16(), arrived, None);
        e.into_response()
    })
}

/// Totals of a request as its events arrive.
#[derive(Default)]
struct Progress {
    usage: Usage,
    first_token: bool,
    finished: usize,
}

/// What one engine event did to one choice.
struct Update<D> {
    choice: usize,
    delta: D,
    logprobs: Option<Value>,
    finish: Option<&'static str>,
}

/// Applies one engine event to its choice.
fn apply_event<S: Shape>(
    state: &AppState,
    job: &mut Job<S>,
    progress: &mut Progress,
    event: SeqEvent,
) -> Result<Update<S::Delta>, ApiError> {
    match event {
        SeqEvent::Token {
            choice,
            id,
            text,
            logprobs,
        } => {
            if id.is_some() && !progress.first_token {
                progress.first_token = true;
                state
                    .metrics
                    .ttft_seconds
                    .observe(job.submitted.arrived.elapsed().as_secs_f64());
            }
            let cx = ChoiceContext {
                tokenizer: &state.tokenizer,
                request_id: &job.submitted.id,
                index: choice,
            };
            let token = match (id, &logprobs) {
                (Some(id), Some(lp)) if job.logprobs => Some((id, lp)),
                _ => None,
            };
            let (delta, logprobs) = job.choices[choice].token(&cx, &text, token);
            Ok(Update {
                choice,
                delta,
                logprobs,
                finish: None,
            })
        }
        SeqEvent::Finished {
            choice,
            reason,
            prompt_tokens: _, // counted once per prompt by `prompt_usage`
            cached_tokens,
            completion_tokens,
        } => {
            progress.usage.completion += completion_tokens;
            // Like its prompt tokens, a prompt's cached prefix counts once, not once per choice.
            if choice % job.n == 0 {
                progress.usage.cached += cached_tokens;
            }
            let cx = ChoiceContext {
                tokenizer: &state.tokenizer,
                request_id: &job.submitted.id,
                index: choice,
            };
            let (delta, reason) = job.choices[choice].finish(&cx, &reason);
            progress.finished += 1;
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

/// The non-streamed answer: waits for every choice to finish.
async fn respond<S: Shape>(state: &Arc<AppState>, mut job: Job<S>) -> Result<Response, ApiError> {
    let mut progress = Progress::default();
    while progress.finished < job.choices.len() {
        let Some(event) = job.submitted.events.recv().await else {
            return Err(ApiError::internal("the engine stopped"));
        };
        apply_event(state, &mut job, &mut progress, event)?;
    }
    let mut usage = progress.usage;
    prompt_usage(&job.submitted, job.n, &mut usage);
    let choices: Vec<Value> = job
        .choices
        .iter()
        .enumerate()
        .map(|(index, c)| c.response_choice(index, job.logprobs))
        .collect();
    log_request(
        state,
        S::ENDPOINT,
        &job.submitted.id,
        200,
        job.submitted.arrived,
        Some((usage.prompt, usage.completion)),
    );
    Ok(Json(json!({
        "id": job.submitted.id,
        "object": S::OBJECT,
        "created": unix_now(),
        "model": state.model_name,
        "choices": choices,
        "usage": usage.json(),
    }))
    .into_response())
}

fn sse<S>(stream: S) -> Response
where
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response()
}

/// State of a streamed request.
struct EventStream<S> {
    state: Arc<AppState>,
    job: Job<S>,
    progress: Progress,
    pending: std::collections::VecDeque<Event>,
    done: bool,
    created: u64,
}

/// The streamed answer: one chunk per piece of output, then usage (when asked for) and `[DONE]`.
fn event_stream<S: Shape>(
    state: Arc<AppState>,
    job: Job<S>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let stream = EventStream {
        state,
        job,
        progress: Progress::default(),
        pending: Default::default(),
        done: false,
        created: unix_now(),
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

impl<S: Shape> EventStream<S> {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Event {
        let mut body = json!({
            "id": self.job.submitted.id,
            "object": S::CHUNK_OBJECT,
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
        let Some(event) = self.job.submitted.events.recv().await else {
            return self.fail(ApiError::internal("the engine stopped"));
        };
        let update = match apply_event(&self.state, &mut self.job, &mut self.progress, event) {
            Err(e) => return self.fail(e),
            Ok(update) => update,
        };
        let entries = self.job.choices[update.choice].chunk_choices(
            update.choice,
            update.delta,
            update.logprobs,
            update.finish,
        );
        for entry in entries {
            let event = self.chunk(json!([entry]), None);
            self.pending.push_back(event);
        }
        if update.finish.is_some() && self.progress.finished == self.job.choices.len() {
            let mut usage = self.progress.usage;
            prompt_usage(&self.job.submitted, self.job.n, &mut usage);
            if self.job.include_usage {
                let event = self.chunk(json!([]), Some(usage.json()));
                self.pending.push_back(event);
            }
            self.pending.push_back(Event::default().data("[DONE]"));
            self.done = true;
            log_request(
                &self.state,
                S::ENDPOINT,
                &self.job.submitted.id,
                200,
                self.job.submitted.arrived,
                Some((usage.prompt, usage.completion)),
            );
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
            S::ENDPOINT,
            &self.job.submitted.id,
            e.status.as_u16(),
            self.job.submitted.arrived,
            None,
        );
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

/// `top_logprobs` (chat) or `logprobs` (text) checked against the limit.
fn top_logprobs(param: &str, k: Option<i64>) -> Result<Option<usize>, ApiError> {
    match k {
        Some(k) if !(0..=openai::MAX_TOP_LOGPROBS).contains(&k) => Err(ApiError::invalid_param(
            param,
            format!("{param} must be between 0 and {}", openai::MAX_TOP_LOGPROBS),
        )),
        k => Ok(k.map(|k| k as usize)),
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
    let started = start_chat(&state, &headers, body, id.clone(), arrived).await;
    answer(&state, started, &id, arrived).await
}

/// The chat prompt: the model's template over the messages and tools.
async fn start_chat(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    id: String,
    arrived: Instant,
) -> Result<Started<ChatChoice>, ApiError> {
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
    let top_logprobs = top_logprobs("top_logprobs", request.top_logprobs)?;
    if top_logprobs.is_some() && !request.logprobs {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
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
            logprobs: request.logprobs.then_some(top_logprobs.unwrap_or(0)),
            ignore_eos: request.sampling.ignore_eos,
        },
        arrived,
    )?;
    let opens_thinking = prompt_opens_thinking(&prompt);
    let tools = tools.filter(|_| parse_tools);
    Ok(Started::new(
        submitted,
        n,
        request.logprobs,
        &request.sampling,
        || ChatChoice::new(opens_thinking, tools.clone()),
    ))
}

/// What a chat choice's text turned into.
#[derive(Default)]
struct ChatDelta {
    reasoning: String,
    content: String,
    /// Indices of the tool calls it completed in [`ChatChoice::calls`].
    calls: Vec<usize>,
}

/// One choice of a chat request: reasoning split, tool-call parsing, totals.
struct ChatChoice {
    splitter: ReasoningSplitter,
    tools: Option<ToolCallParser>,
    reasoning: String,
    content: String,
    /// Tool calls with their ids.
    calls: Vec<(String, ToolCall)>,
    logprobs: Vec<Value>,
    finish: Option<&'static str>,
    saw_reasoning: bool,
    /// Whether the first streamed chunk (with the role) went out.
    started: bool,
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
            started: false,
        }
    }

    fn push(&mut self, cx: &ChoiceContext, text: &str, last: bool) -> ChatDelta {
        let mut split = self.splitter.push(text);
        if last {
            let rest = self.splitter.finish();
            split.reasoning.push_str(&rest.reasoning);
            split.content.push_str(&rest.content);
        }
        if self.splitter.in_reasoning() || !split.reasoning.is_empty() {
            self.saw_reasoning = true;
        }
        let mut delta = ChatDelta {
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
                        ToolEvent::Call(call) => {
                            let index = self.calls.len();
                            let id = call_id(cx.request_id, cx.index, index);
                            self.calls.push((id, call));
                            delta.calls.push(index);
                        }
                    }
                }
            }
        }
        self.reasoning.push_str(&delta.reasoning);
        self.content.push_str(&delta.content);
        delta
    }
}

impl Shape for ChatChoice {
    const ENDPOINT: &'static str = "chat";
    const OBJECT: &'static str = "chat.completion";
    const CHUNK_OBJECT: &'static str = "chat.completion.chunk";
    type Delta = ChatDelta;

    fn token(
        &mut self,
        cx: &ChoiceContext,
        text: &str,
        logprobs: Option<(u32, &TokenLogprobs)>,
    ) -> (ChatDelta, Option<Value>) {
        let delta = self.push(cx, text, false);
        let logprobs = logprobs.map(|(id, lp)| {
            let entry = chat_logprob(cx.tokenizer, id, lp);
            self.logprobs.push(entry.clone());
            json!({"content": [entry]})
        });
        (delta, logprobs)
    }

    fn finish(&mut self, cx: &ChoiceContext, reason: &FinishReason) -> (ChatDelta, &'static str) {
        let delta = self.push(cx, "", true);
        let reason = finish_reason(reason, !self.calls.is_empty());
        self.finish = Some(reason);
        (delta, reason)
    }

    fn chunk_choices(
        &mut self,
        index: usize,
        delta: ChatDelta,
        logprobs: Option<Value>,
        finish: Option<&'static str>,
    ) -> Vec<Value> {
        let mut entries = Vec::new();
        if !self.started {
            self.started = true;
            entries.push(
                json!({"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}),
            );
        }
        let mut d = Map::new();
        if !delta.reasoning.is_empty() {
            d.insert("reasoning_content".into(), delta.reasoning.into());
        }
        if !delta.content.is_empty() {
            d.insert("content".into(), delta.content.into());
        }
        if !delta.calls.is_empty() {
            let calls: Vec<Value> = delta
                .calls
                .iter()
                .map(|&i| {
                    let (id, call) = &self.calls[i];
                    let mut value = tool_call_json(id, call);
                    value["index"] = i.into();
                    value
                })
                .collect();
            d.insert("tool_calls".into(), calls.into());
        }
        if !d.is_empty() || logprobs.is_some() || finish.is_some() {
            entries.push(json!({
                "index": index,
                "delta": d,
                "logprobs": logprobs,
                "finish_reason": finish,
            }));
        }
        entries
    }

    fn response_choice(&self, index: usize, logprobs: bool) -> Value {
        let mut message = Map::new();
        message.insert("role".into(), "assistant".into());
        let content = if self.calls.is_empty() {
            Value::from(self.content.clone())
        } else {
            Some(self.content.trim())
                .filter(|t| !t.is_empty())
                .map_or(Value::Null, Value::from)
        };
        message.insert("content".into(), content);
        if self.saw_reasoning {
            message.insert("reasoning_content".into(), self.reasoning.clone().into());
        }
        if !self.calls.is_empty() {
            message.insert(
                "tool_calls".into(),
                self.calls
                    .iter()
                    .map(|(id, call)| tool_call_json(id, call))
                    .collect(),
            );
        }
        let logprobs = if logprobs {
            json!({"content": self.logprobs})
        } else {
            Value::Null
        };
        json!({
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self.finish,
        })
    }
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

fn call_id(request_id: &str, choice: usize, index: usize) -> String {
    format!(
        "call_{}_{choice}_{index}",
        request_id.trim_start_matches("chatcmpl-")
    )
}

fn tool_call_json(id: &str, call: &ToolCall) -> Value {
    json!({"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
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
    let started = start_completion(&state, &headers, body, id.clone(), arrived).await;
    answer(&state, started, &id, arrived).await
}

/// The text prompts: strings tokenized, or token ids as given.
async fn start_completion(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    id: String,
    arrived: Instant,
) -> Result<Started<TextChoice>, ApiError> {
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
    let logprobs = top_logprobs("logprobs", request.logprobs)?;
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
    Ok(Started::new(
        submitted,
        n,
        logprobs.is_some(),
        &request.sampling,
        TextChoice::default,
    ))
}

/// One choice of a text completion: its text and, when asked for, each token's log-probabilities.
#[derive(Default)]
struct TextChoice {
    text: String,
    finish: Option<&'static str>,
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl Shape for TextChoice {
    const ENDPOINT: &'static str = "completions";
    const OBJECT: &'static str = "text_completion";
    const CHUNK_OBJECT: &'static str = "text_completion";
    type Delta = String;

    fn token(
        &mut self,
        cx: &ChoiceContext,
        text: &str,
        logprobs: Option<(u32, &TokenLogprobs)>,
    ) -> (String, Option<Value>) {
        let offset = self.text.len();
        self.text.push_str(text);
        let logprobs = logprobs.map(|(id, lp)| {
            let token = token_text(cx.tokenizer, id);
            let top: Map<String, Value> = lp
                .top
                .iter()
                .map(|&(t, l)| (token_text(cx.tokenizer, t), Value::from(l)))
                .collect();
            self.tokens.push(token.clone());
            self.token_logprobs.push(lp.logprob);
            self.top_logprobs.push(Value::Object(top.clone()));
            self.text_offset.push(offset);
            json!({"tokens": [token], "token_logprobs": [lp.logprob],
                "top_logprobs": [top], "text_offset": [offset]})
        });
        (text.to_string(), logprobs)
    }

    fn finish(&mut self, _cx: &ChoiceContext, reason: &FinishReason) -> (String, &'static str) {
        let reason = finish_reason(reason, false);
        self.finish = Some(reason);
        (String::new(), reason)
    }

    fn chunk_choices(
        &mut self,
        index: usize,
        text: String,
        logprobs: Option<Value>,
        finish: Option<&'static str>,
    ) -> Vec<Value> {
        if text.is_empty() && logprobs.is_none() && finish.is_none() {
            return Vec::new();
        }
        vec![json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})]
    }

    fn response_choice(&self, index: usize, logprobs: bool) -> Value {
        let logprobs = if logprobs {
            json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset})
        } else {
            Value::Null
        };
        json!({
            "index": index,
            "text": self.text,
            "logprobs": logprobs,
            "finish_reason": self.finish,
        })
    }
}
