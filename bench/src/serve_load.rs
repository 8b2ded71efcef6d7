//! The load generator of `glm5-bench serve`: the real `glm5 serve` stack ([`glm5::serve::serve_model`] and
//! its routes, scheduler and paged KV pool) started in this process on a loopback port
//! ([`InProcessServer`]), and `streams` concurrent HTTP clients ([`LoadGenerator`]), each streaming
//! `/v1/completions` requests one after another. Measured at the client: time to first token, the gaps
//! between tokens, tokens/s; and at the server (`/metrics`): its step time.
//!
//! How tokens cross the API:
//! - Prompts are token ids (`"prompt": [ids]`, which OpenAI's completions API allows), drawn at random below
//!   the model's vocabulary, so every prompt has exactly `prompt_tokens` tokens whatever the tokenizer.
//! - Outputs go through the server's detokenizer as usual. The server is given [`word_tokenizer`]: one
//!   word per id of the model's vocabulary (`t0`, `t1`, ...; GLM-5's own tokenizer is not available offline
//!   and the embedded model's covers only its own small vocabulary). So every generated token is one
//!   non-empty server-sent event, and the text names the ids ([`word_ids`]).
//! - Every request is greedy (`temperature: 0`; or, with [`LoadSpec::sampled`], temperature 1 and top-p 0.95)
//!   with `ignore_eos` (vLLM's field, which `glm5 serve` honours) and no stop strings, so each one generates
//!   exactly `max_tokens` tokens whatever the weights.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use glm5::serve::{serve_model, ModelInfo, ServeError, ServeOptions, StepModel};
use glm5::tokenizer::{Tokenizer, TokenizerError};
use serde_json::{json, Value};

/// Why a load run could not be made (a single request's failure is not one: it is counted in the report).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A load that cannot run (no streams, no tokens, ...).
    #[error("invalid load: {0}")]
    Spec(String),
    /// The word-level tokenizer could not be built.
    #[error("cannot build the word-level tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    /// The server refused its options or could not start.
    #[error("the server did not start: {0}")]
    Serve(#[from] ServeError),
    /// The server's thread ended without a result (it panicked).
    #[error("the server's thread ended without a result")]
    ServerGone,
    /// A runtime or thread could not start.
    #[error("cannot start {what}: {source}")]
    Start {
        /// Which.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An HTTP exchange failed.
    #[error("HTTP: {0}")]
    Http(#[from] reqwest::Error),
    /// The server answered something other than a well-formed completion stream.
    #[error("{0}")]
    Response(String),
}

/// A tokenizer whose vocabulary is one word per id below `vocab_size` (`t0`, `t1`, ...): decoding joins the
/// words with spaces, so each generated token adds non-empty text (one streamed event per token) and the
/// text gives the ids back ([`word_ids`]).
pub fn word_tokenizer(vocab_size: usize) -> Result<Tokenizer, LoadError> {
    if vocab_size == 0 {
        return Err(LoadError::Spec("the vocabulary is empty".into()));
    }
    let vocab: serde_json::Map<String, Value> = (0..vocab_size)
        .map(|id| (format!("t{id}"), Value::from(id)))
        .collect();
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    });
    Ok(Tokenizer::from_json(&json.to_string())?)
}

/// The ids named by text that [`word_tokenizer`] decoded; `None` if a word is not one of its.
pub fn word_ids(text: &str) -> Option<Vec<u32>> {
    text.split_whitespace()
        .map(|word| word.strip_prefix('t')?.parse().ok())
        .collect()
}

/// `glm5 serve` (routes, scheduler, KV pool) running in this process, on its own thread and tokio runtime
/// as `glm5 serve` runs it; stopped (running requests finish within the options' grace) on
/// [`InProcessServer::stop`] or drop.
pub struct InProcessServer {
    url: String,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServeError>>>,
}

impl InProcessServer {
    /// Starts serving `model` (described by `info`) with `options`; returns once it listens.
    pub fn start<M: StepModel + Send + 'static>(
        model: M,
        info: ModelInfo,
        options: ServeOptions,
    ) -> Result<Self, LoadError> {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel::<SocketAddr>();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("glm5-http")
            .build()
            .map_err(|source| LoadError::Start {
                what: "the server's runtime",
                source,
            })?;
        let thread = std::thread::Builder::new()
            .name("glm5-serve".into())
            .spawn(move || {
                // Resolves when `stop` is called or the handle dropped.
                let stop = async move {
                    let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
                };
                runtime.block_on(serve_model(
                    model,
                    info,
                    options,
                    move |addr| {
                        let _ = addr_tx.send(addr);
                    },
                    stop,
                ))
            })
            .map_err(|source| LoadError::Start {
                what: "the server's thread",
                source,
            })?;
        match addr_rx.recv() {
            Ok(addr) => Ok(Self {
                url: format!("http://{addr}"),
                stop: Some(stop_tx),
                thread: Some(thread),
            }),
            // The server returned before listening: its error says why.
            Err(_) => match thread.join() {
                Ok(Err(e)) => Err(e.into()),
                Ok(Ok(())) | Err(_) => Err(LoadError::ServerGone),
            },
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Stops accepting, lets running requests finish (within the shutdown grace) and waits for the server.
    pub fn stop(mut self) -> Result<(), LoadError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), LoadError> {
        drop(self.stop.take());
        match self.thread.take().map(std::thread::JoinHandle::join) {
            None => Ok(()),
            Some(Ok(result)) => Ok(result?),
            Some(Err(_)) => Err(LoadError::ServerGone),
        }
    }
}

impl Drop for InProcessServer {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// KV-cache tokens for `streams` sequences of `prompt_tokens + max_tokens` tokens each, in whole blocks of
/// the server's pool, so that no level waits for blocks or preempts.
pub fn kv_budget_for(streams: usize, prompt_tokens: usize, max_tokens: usize) -> usize {
    let block = glm5::serve::scheduler::KV_BLOCK;
    streams * (prompt_tokens + max_tokens).div_ceil(block) * block
}

/// The server's options for levels of up to `max_streams` clients: that many sequences at once, a context
/// of one request's tokens, a pool that holds them all ([`kv_budget_for`]), on a free loopback port.
pub fn serve_options(
    model_name: &str,
    max_streams: usize,
    prompt_tokens: usize,
    max_tokens: usize,
    prefill_chunk: usize,
) -> ServeOptions {
    ServeOptions {
        max_seqs: max_streams,
        max_model_len: prompt_tokens + max_tokens,
        kv_budget: Some(kv_budget_for(max_streams, prompt_tokens, max_tokens)),
        prefill_chunk,
        shutdown_grace: Duration::from_secs(5),
        ..ServeOptions::new(([127, 0, 0, 1], 0).into(), model_name)
    }
}

/// One load level: `streams` clients at once, each sending `requests_per_stream` requests one after another.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Concurrent clients.
    pub streams: usize,
    /// Requests each client sends, one after another.
    pub requests_per_stream: usize,
    /// Tokens of every prompt.
    pub prompt_tokens: usize,
    /// Tokens every request generates.
    pub max_tokens: usize,
    /// Prompt ids are drawn below this (the model's vocabulary).
    pub vocab_size: usize,
    /// The served model's name.
    pub model: String,
    /// Seed of the prompts (with the stream count, the stream and the request index).
    pub seed: u64,
    /// Requests sample at temperature 1 with top-p 0.95 (GLM-5's generation_config.json) instead of
    /// greedily: the server's sampling on the host is then part of every step.
    pub sampled: bool,
}

impl LoadSpec {
    /// The prompt of `stream`'s `index`-th request: distinct ids for every (seed, streams, stream, index),
    /// so that no prompt finds another's KV rows kept for prefix reuse.
    pub fn prompt(&self, stream: usize, index: usize) -> Vec<u32> {
        let mut state = self.seed
            ^ (self.streams as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ (stream as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
            ^ (index as u64).wrapping_mul(0x1656_67b1_9e37_79f9);
        (0..self.prompt_tokens)
            .map(|_| (splitmix(&mut state) % self.vocab_size.max(1) as u64) as u32)
            .collect()
    }

    /// A short round of the same concurrency (one request per client, two tokens, other prompts): what a
    /// level runs first, unmeasured, so that one-off costs of a batch size land outside it.
    pub fn warm_up(&self) -> Self {
        Self {
            requests_per_stream: 1,
            max_tokens: self.max_tokens.min(2),
            seed: self.seed ^ 0x5741_524d,
            ..self.clone()
        }
    }

    fn check(&self) -> Result<(), LoadError> {
        if self.streams == 0 || self.requests_per_stream == 0 {
            return Err(LoadError::Spec(
                "streams and requests per stream must be at least 1".into(),
            ));
        }
        if self.prompt_tokens == 0 || self.max_tokens == 0 || self.vocab_size == 0 {
            return Err(LoadError::Spec(
                "prompt tokens, max tokens and the vocabulary must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn body(&self, prompt: &[u32]) -> String {
        json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": if self.sampled { 1.0 } else { 0.0 },
            "top_p": if self.sampled { 0.95 } else { 1.0 },
            "seed": self.seed,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string()
    }
}

/// splitmix64: reproducible prompts without a rand dependency.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One streamed completion as its client saw it.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    /// The text of every event, concatenated.
    pub text: String,
    /// Events that carried text (one per token with [`word_tokenizer`]).
    pub text_events: usize,
    /// `usage.completion_tokens` of the last event.
    pub completion_tokens: Option<usize>,
    /// The choice's `finish_reason`.
    pub finish_reason: Option<String>,
    /// From sending the request to the first text event.
    pub time_to_first_token: Duration,
    /// Between consecutive text events.
    pub gaps: Vec<Duration>,
}

impl Completion {
    /// Tokens per second after the first: (text events - 1) over the time from the first to the last.
    pub fn decode_rate(&self) -> Option<f64> {
        let span: Duration = self.gaps.iter().sum();
        (!self.gaps.is_empty() && !span.is_zero())
            .then(|| self.gaps.len() as f64 / span.as_secs_f64())
    }
}

/// One request of a level and what came of it.
#[derive(Debug, Clone)]
pub struct RequestOutcome {
    /// Which client sent it.
    pub stream: usize,
    /// Its place in that client's sequence.
    pub index: usize,
    /// Its prompt ids.
    pub prompt: Vec<u32>,
    /// The completion, or why it failed.
    pub result: Result<Completion, String>,
}

/// The server's counters (`/metrics`) that a level reads before and after itself.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServerCounters {
    /// Engine steps run.
    pub steps: u64,
    /// Seconds the steps took, summed.
    pub step_seconds: f64,
    /// Of those, seconds of picking the next tokens on the host (after the device's work), summed.
    pub sample_seconds: f64,
    /// Tokens generated (counted when a sequence ends).
    pub generation_tokens: u64,
    /// Sequences preempted for lack of KV blocks.
    pub preemptions: u64,
    /// Sequences running.
    pub running: u64,
    /// Sequences waiting (preempted ones included).
    pub waiting: u64,
}

impl ServerCounters {
    /// Reads them from a Prometheus text exposition of `glm5 serve`.
    pub fn parse(text: &str) -> Result<Self, LoadError> {
        let value = |name: &str| -> Result<f64, LoadError> {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| LoadError::Response(format!("no {name} in /metrics")))
        };
        Ok(Self {
            steps: value("glm5_step_seconds_count")? as u64,
            step_seconds: value("glm5_step_seconds_sum")?,
            sample_seconds: value("glm5_sample_seconds_sum")?,
            generation_tokens: value("glm5_generation_tokens_total")? as u64,
            preemptions: value("glm5_preemptions_total")? as u64,
            running: value("glm5_running_sequences")? as u64,
            waiting: value("glm5_queue_length")? as u64,
        })
    }
}

/// What one level measured.
#[derive(Debug, Clone)]
pub struct LevelReport {
    /// The load.
    pub spec: LoadSpec,
    /// Every request, by client then index.
    pub outcomes: Vec<RequestOutcome>,
    /// From the first request sent to the last one finished.
    pub wall: Duration,
    /// The server's counters before the level.
    pub before: ServerCounters,
    /// And after it (once nothing runs).
    pub after: ServerCounters,
}

/// The `q`-quantile (nearest rank) of `values`; `None` when empty.
pub fn percentile(values: &[Duration], q: f64) -> Option<Duration> {
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied()
}

impl LevelReport {
    /// The requests that completed.
    pub fn completions(&self) -> impl Iterator<Item = &Completion> {
        self.outcomes.iter().filter_map(|o| o.result.as_ref().ok())
    }

    /// Requests that failed.
    pub fn failed(&self) -> usize {
        self.outcomes.iter().filter(|o| o.result.is_err()).count()
    }

    /// Tokens generated by the completed requests (their `usage`).
    pub fn generated_tokens(&self) -> usize {
        self.completions()
            .map(|c| c.completion_tokens.unwrap_or(0))
            .sum()
    }

    /// Generated tokens of all streams per second of the level's wall time (prefills included).
    pub fn tokens_per_second(&self) -> f64 {
        self.generated_tokens() as f64 / self.wall.as_secs_f64()
    }

    /// Mean over completed requests of their decode rate (tokens after the first per second).
    pub fn per_stream_tokens_per_second(&self) -> Option<f64> {
        let rates: Vec<f64> = self
            .completions()
            .filter_map(Completion::decode_rate)
            .collect();
        (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
    }

    /// Times to first token of the completed requests.
    pub fn time_to_first_token(&self) -> Vec<Duration> {
        self.completions().map(|c| c.time_to_first_token).collect()
    }

    /// Gaps between tokens of every completed request.
    pub fn inter_token(&self) -> Vec<Duration> {
        self.completions()
            .flat_map(|c| c.gaps.iter().copied())
            .collect()
    }

    /// Engine steps the level ran.
    pub fn server_steps(&self) -> u64 {
        self.after.steps.saturating_sub(self.before.steps)
    }

    /// Mean engine step time over the level (prefill steps included).
    pub fn server_step(&self) -> Option<Duration> {
        let steps = self.server_steps();
        (steps > 0).then(|| {
            Duration::from_secs_f64(
                (self.after.step_seconds - self.before.step_seconds).max(0.0) / steps as f64,
            )
        })
    }

    /// Mean host sampling time per engine step over the level (part of [`Self::server_step`]).
    pub fn server_sampling(&self) -> Option<Duration> {
        let steps = self.server_steps();
        (steps > 0).then(|| {
            Duration::from_secs_f64(
                (self.after.sample_seconds - self.before.sample_seconds).max(0.0) / steps as f64,
            )
        })
    }

    /// Tokens the server counted as generated over the level.
    pub fn server_generated_tokens(&self) -> u64 {
        self.after
            .generation_tokens
            .saturating_sub(self.before.generation_tokens)
    }

    /// Preemptions over the level.
    pub fn preemptions(&self) -> u64 {
        self.after
            .preemptions
            .saturating_sub(self.before.preemptions)
    }

    /// The header of [`LevelReport::markdown_row`]'s table.
    pub fn markdown_header() -> &'static str {
        "| streams | requests ok / failed | tok/s, all streams | tok/s per stream | TTFT p50 / p99 ms | inter-token p50 / p99 ms | server step ms (steps) | of which sampling ms | preemptions | all streams / batch-1 `forward` |\n|---|---|---|---|---|---|---|---|---|---|"
    }

    /// This level as a table row; `direct_step` is the batch-1 decode step measured through `forward`.
    pub fn markdown_row(&self, direct_step: Option<Duration>) -> String {
        let ms =
            |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.2}", d.as_secs_f64() * 1e3));
        let ttft = self.time_to_first_token();
        let itl = self.inter_token();
        let speedup = direct_step.map_or("-".into(), |d| {
            format!("{:.2}x", self.tokens_per_second() * d.as_secs_f64())
        });
        format!(
            "| {} | {} / {} | {:.1} | {} | {} / {} | {} / {} | {} ({}) | {} | {} | {} |",
            self.spec.streams,
            self.outcomes.len() - self.failed(),
            self.failed(),
            self.tokens_per_second(),
            self.per_stream_tokens_per_second()
                .map_or("-".into(), |r| format!("{r:.1}")),
            ms(percentile(&ttft, 0.5)),
            ms(percentile(&ttft, 0.99)),
            ms(percentile(&itl, 0.5)),
            ms(percentile(&itl, 0.99)),
            ms(self.server_step()),
            self.server_steps(),
            ms(self.server_sampling()),
            self.preemptions(),
            speedup,
        )
    }
}

/// HTTP clients against one server: runs load levels and reads the server's counters.
pub struct LoadGenerator {
    url: String,
    client: reqwest::Client,
    runtime: tokio::runtime::Runtime,
}

impl LoadGenerator {
    /// Clients of the server at `url` (`http://HOST:PORT`), on their own runtime.
    pub fn new(url: &str) -> Result<Self, LoadError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("glm5-load")
            .build()
            .map_err(|source| LoadError::Start {
                what: "the clients' runtime",
                source,
            })?;
        // Loopback only: a proxy from the environment must not be asked.
        let client = reqwest::Client::builder().no_proxy().build()?;
        Ok(Self {
            url: url.trim_end_matches('/').to_string(),
            client,
            runtime,
        })
    }

    /// The server's counters now.
    pub fn counters(&self) -> Result<ServerCounters, LoadError> {
        self.runtime.block_on(async {
            let text = self
                .client
                .get(format!("{}/metrics", self.url))
                .send()
                .await?
                .error_for_status()?
                .text()
                .await?;
            ServerCounters::parse(&text)
        })
    }

    /// The counters once no sequence runs or waits (the engine counts a sequence's tokens and its last
    /// step just after the client has its last event), waiting at most `limit`.
    pub fn settled_counters(&self, limit: Duration) -> Result<ServerCounters, LoadError> {
        let deadline = Instant::now() + limit;
        loop {
            let counters = self.counters()?;
            if (counters.running == 0 && counters.waiting == 0) || Instant::now() >= deadline {
                return Ok(counters);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Runs one level: `spec.streams` clients at once, each sending its requests one after another.
    pub fn run(&self, spec: &LoadSpec) -> Result<LevelReport, LoadError> {
        spec.check()?;
        let before = self.settled_counters(Duration::from_secs(10))?;
        let started = Instant::now();
        let outcomes = self.runtime.block_on(async {
            let clients: Vec<_> = (0..spec.streams)
                .map(|stream| {
                    let (client, url, spec) = (self.client.clone(), self.url.clone(), spec.clone());
                    tokio::spawn(async move {
                        let mut outcomes = Vec::with_capacity(spec.requests_per_stream);
                        for index in 0..spec.requests_per_stream {
                            let prompt = spec.prompt(stream, index);
                            let result = stream_completion(&client, &url, spec.body(&prompt))
                                .await
                                .map_err(|e| e.to_string());
                            outcomes.push(RequestOutcome {
                                stream,
                                index,
                                prompt,
                                result,
                            });
                        }
                        outcomes
                    })
                })
                .collect();
            let mut outcomes = Vec::new();
            for (stream, client) in clients.into_iter().enumerate() {
                match client.await {
                    Ok(mine) => outcomes.extend(mine),
                    // A client task that panicked: its requests count as failed.
                    Err(e) => {
                        outcomes.extend((0..spec.requests_per_stream).map(|index| RequestOutcome {
                            stream,
                            index,
                            prompt: spec.prompt(stream, index),
                            result: Err(format!("client task failed: {e}")),
                        }))
                    }
                }
            }
            outcomes
        });
        let wall = started.elapsed();
        let after = self.settled_counters(Duration::from_secs(10))?;
        Ok(LevelReport {
            spec: spec.clone(),
            outcomes,
            wall,
            before,
            after,
        })
    }
}

/// Sends one streamed completion request and reads its server-sent events to `[DONE]`.
async fn stream_completion(
    client: &reqwest::Client,
    url: &str,
    body: String,
) -> Result<Completion, LoadError> {
    let sent = Instant::now();
    let mut response = client
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(LoadError::Response(format!("HTTP {status}: {text}")));
    }
    let mut completion = Completion::default();
    let mut buffer = Vec::new();
    let mut last_text: Option<Instant> = None;
    while let Some(bytes) = response.chunk().await? {
        // Events that arrive in one read share its time: what a client sees.
        let now = Instant::now();
        buffer.extend_from_slice(&bytes);
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            for line in event.split(|&b| b == b'\n') {
                let Some(data) = line.strip_prefix(b"data:") else {
                    continue; // comments (keep-alives) and blank lines
                };
                let data = data.strip_prefix(b" ").unwrap_or(data);
                if data == b"[DONE]" {
                    return finished(completion);
                }
                let value: Value = serde_json::from_slice(data).map_err(|e| {
                    LoadError::Response(format!(
                        "an event is not JSON ({e}): {}",
                        String::from_utf8_lossy(data)
                    ))
                })?;
                if let Some(error) = value.get("error") {
                    return Err(LoadError::Response(format!("error event: {error}")));
                }
                if let Some(tokens) = value["usage"]["completion_tokens"].as_u64() {
                    completion.completion_tokens = Some(tokens as usize);
                }
                let Some(choice) = value["choices"].get(0) else {
                    continue;
                };
                if let Some(text) = choice["text"].as_str().filter(|t| !t.is_empty()) {
                    match last_text {
                        None => completion.time_to_first_token = now - sent,
                        Some(previous) => completion.gaps.push(now - previous),
                    }
                    last_text = Some(now);
                    completion.text_events += 1;
                    completion.text.push_str(text);
                }
                if let Some(reason) = choice["finish_reason"].as_str() {
                    completion.finish_reason = Some(reason.to_string());
                }
            }
        }
    }
    Err(LoadError::Response(
        "the stream ended before data: [DONE]".into(),
    ))
}

fn finished(completion: Completion) -> Result<Completion, LoadError> {
    if completion.finish_reason.is_none() {
        return Err(LoadError::Response(
            "the stream ended without a finish_reason".into(),
        ));
    }
    Ok(completion)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_tokenizer_round_trips_ids_one_word_per_token() {
        let tokenizer = word_tokenizer(1000).unwrap();
        assert_eq!(tokenizer.vocab_size(), 1000);
        let ids = [5u32, 999, 0, 17];
        let mut stream = glm5::tokenizer::TokenStream::new(&tokenizer);
        let pieces: Vec<String> = ids
            .iter()
            .map(|&id| stream.push(id).unwrap().unwrap())
            .collect();
        assert_eq!(pieces, ["t5", " t999", " t0", " t17"]);
        assert_eq!(word_ids(&pieces.concat()), Some(ids.to_vec()));
        assert_eq!(word_ids("t5 x7"), None);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&values, 0.5), Some(Duration::from_millis(50)));
        assert_eq!(percentile(&values, 0.99), Some(Duration::from_millis(99)));
        assert_eq!(
            percentile(&values[..1], 0.99),
            Some(Duration::from_millis(1))
        );
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn prompts_are_distinct_and_within_the_vocabulary() {
        let spec = LoadSpec {
            streams: 4,
            requests_per_stream: 2,
            prompt_tokens: 64,
            max_tokens: 8,
            vocab_size: 154_880,
            model: "m".into(),
            seed: 1,
            sampled: false,
        };
        let prompts: Vec<Vec<u32>> = (0..4)
            .flat_map(|s| (0..2).map(move |i| (s, i)))
            .map(|(s, i)| spec.prompt(s, i))
            .collect();
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(p.len(), 64);
            assert!(p.iter().all(|&id| (id as usize) < 154_880));
            assert!(
                prompts[..i].iter().all(|q| q[0] != p[0]),
                "first ids collide"
            );
        }
        assert_eq!(spec.prompt(3, 1), prompts[7]);
        assert_ne!(spec.warm_up().prompt(0, 0), prompts[0]);
    }

    #[test]
    fn counters_are_read_from_the_exposition() {
        let metrics = glm5::serve::metrics::Metrics::new(10, 64);
        metrics.observe_step(Duration::from_millis(3));
        metrics.observe_step(Duration::from_millis(5));
        metrics.sample_seconds.observe(0.002);
        metrics
            .generation_tokens
            .fetch_add(42, std::sync::atomic::Ordering::Relaxed);
        let counters = ServerCounters::parse(&metrics.render()).unwrap();
        assert_eq!(counters.steps, 2);
        assert!((counters.step_seconds - 0.008).abs() < 1e-9);
        assert!((counters.sample_seconds - 0.002).abs() < 1e-9);
        assert_eq!(counters.generation_tokens, 42);
        assert_eq!(
            (counters.preemptions, counters.running, counters.waiting),
            (0, 0, 0)
        );
        assert!(ServerCounters::parse("glm5_step_seconds_count 1").is_err());
    }
}
