//! The engine: one thread owns the model and runs every admitted sequence, step by step.
//!
//! A step gives every running sequence one model call: the next chunk of its prompt (at most
//! `prefill_chunk` tokens, so one long prompt does not stall the decodes around it) or its last sampled
//! token. New requests are admitted between steps, while the number of running sequences is under
//! `max_seqs` and their KV reservations fit the KV budget; the rest wait in a FIFO queue. A sequence whose
//! client went away (its event channel closed) is stopped and its cache freed before the next step.
//!
//! KV caches are reserved in blocks of [`KV_BLOCK`] tokens (prompt plus `max_tokens`, rounded up, at most the
//! context). A finished sequence's cache is kept, with the tokens it holds, while the budget allows: a new
//! prompt that starts with those tokens reuses their KV rows (prefix caching, e.g. the next turn of a chat).
//!
//! The model is reached only through [`StepModel::forward_batch`], one call per step with every sequence's
//! input. Today it runs the sequences one after another (one `forward` each); a batched forward over a
//! paged cache replaces that one function without touching the scheduler.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use candle_core::{Tensor, D};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::Result;
use crate::generate::{take_text_before_stop, GenerationParams, Sampler};
use crate::tokenizer::{TokenStream, Tokenizer};
use crate::{FinishReason, Glm5ForCausalLM, KvCache};

use super::metrics::Metrics;

/// Tokens per KV block: the unit of reservation and of the `kv_blocks` metrics.
pub const KV_BLOCK: usize = 64;

/// One sequence's part of a step: `tokens` to append to `cache` at `start_pos`.
pub struct StepInput<'a> {
    /// New tokens (a prompt chunk, or the last sampled token).
    pub tokens: &'a [u32],
    /// Position of the first of them (the cache's length).
    pub start_pos: usize,
    /// The sequence's KV cache.
    pub cache: &'a mut KvCache,
}

/// What the scheduler needs of a model: logits after a step of several sequences.
pub trait StepModel {
    /// Logits `[vocab]` after the last token of every input, in input order. A sequence whose forward
    /// failed gets its error without failing the others.
    fn forward_batch(&self, inputs: &mut [StepInput<'_>]) -> Vec<Result<Tensor>>;

    /// An empty KV cache for `capacity` tokens.
    fn new_cache(&self, capacity: usize) -> Result<KvCache>;
}

impl StepModel for Glm5ForCausalLM {
    // One forward per sequence until the batched forward over a paged cache exists.
    fn forward_batch(&self, inputs: &mut [StepInput<'_>]) -> Vec<Result<Tensor>> {
        inputs
            .iter_mut()
            .map(|input| {
                let logits = self.forward(input.tokens, input.start_pos, input.cache)?;
                Ok(logits.get(logits.dim(0)? - 1)?)
            })
            .collect()
    }

    fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        Ok(Glm5ForCausalLM::new_cache(self, capacity)?)
    }
}

impl StepModel for crate::Glm5 {
    fn forward_batch(&self, inputs: &mut [StepInput<'_>]) -> Vec<Result<Tensor>> {
        self.model().forward_batch(inputs)
    }

    fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        crate::Glm5::new_cache(self, capacity)
    }
}

/// A token's log-probability and the most likely alternatives (ids, natural log).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// Log-probability of the chosen token.
    pub logprob: f32,
    /// The `top` most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine reports about one sequence.
#[derive(Debug, Clone)]
pub enum SeqEvent {
    /// A sampled token and the text it completed (possibly empty, or held back text released at the end).
    Token {
        /// Which choice of the request.
        choice: usize,
        /// The token; `None` for text flushed at the end.
        id: Option<u32>,
        /// Text to append.
        text: String,
        /// When asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// The sequence ended.
    Finished {
        /// Which choice.
        choice: usize,
        /// Why.
        reason: FinishReason,
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Prompt tokens whose KV came from a cached prefix.
        cached_tokens: usize,
        /// Tokens generated (stop tokens excluded).
        completion_tokens: usize,
    },
    /// The sequence failed (the model's error, as text).
    Failed {
        /// Which choice.
        choice: usize,
        /// What went wrong.
        message: String,
    },
}

/// One sequence to run.
pub struct SeqRequest {
    /// Request id, for logs.
    pub request_id: String,
    /// Which choice of the request this is.
    pub choice: usize,
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// Sampling and stopping (`max_new_tokens` already fits the context).
    pub params: GenerationParams,
    /// `Some(k)`: report the chosen token's log-probability and the `k` most likely ones.
    pub logprobs: Option<usize>,
    /// Do not stop at the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Where events go; closed when the client is gone.
    pub events: UnboundedSender<SeqEvent>,
}

impl SeqRequest {
    /// Tokens of KV cache the sequence may need.
    fn kv_needed(&self, max_model_len: usize) -> usize {
        kv_reservation(self.prompt.len(), self.params.max_new_tokens, max_model_len)
    }
}

/// KV tokens reserved for a prompt of `prompt_len` tokens and up to `max_new` new ones: whole blocks, at
/// most the context.
pub fn kv_reservation(prompt_len: usize, max_new: usize, max_model_len: usize) -> usize {
    let needed = prompt_len.saturating_add(max_new).min(max_model_len);
    needed
        .div_ceil(KV_BLOCK)
        .saturating_mul(KV_BLOCK)
        .min(max_model_len)
}

/// Scheduler limits.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Most sequences waiting for admission; more are refused (HTTP 429).
    pub max_queue: usize,
    /// Tokens of context per sequence (prompt plus output).
    pub max_model_len: usize,
    /// KV cache tokens over all sequences, running and kept for prefix reuse.
    pub kv_budget: usize,
    /// Most prompt tokens one sequence feeds in one step.
    pub prefill_chunk: usize,
    /// The model's end-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
}

/// Why a request was not queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// The waiting queue is full.
    QueueFull,
    /// The server is shutting down.
    ShuttingDown,
}

enum Message {
    Submit(Vec<SeqRequest>),
    CancelAll,
}

/// The request side's handle on the engine thread (cheap to clone).
#[derive(Clone)]
pub struct Scheduler {
    sender: mpsc::Sender<Message>,
    queued: Arc<AtomicUsize>,
    accepting: Arc<AtomicBool>,
    config: Arc<SchedulerConfig>,
}

impl Scheduler {
    /// Starts the engine thread over `model`; it runs until every handle is dropped.
    pub fn start<M: StepModel + Send + 'static>(
        model: M,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> (Self, std::thread::JoinHandle<()>) {
        let (sender, receiver) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let config = Arc::new(config);
        let engine = Engine {
            config: config.clone(),
            metrics,
            queued: queued.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("glm5-engine".into())
            .spawn(move || engine.run(&model, &tokenizer, receiver))
            .expect("spawn the engine thread");
        (
            Self {
                sender,
                queued,
                accepting: Arc::new(AtomicBool::new(true)),
                config,
            },
            thread,
        )
    }

    /// The limits it runs with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues the sequences of one request (all or none).
    pub fn submit(&self, sequences: Vec<SeqRequest>) -> std::result::Result<(), SubmitError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        let n = sequences.len();
        let before = self.queued.fetch_add(n, Ordering::SeqCst);
        if before + n > self.config.max_queue.max(n) {
            self.queued.fetch_sub(n, Ordering::SeqCst);
            return Err(SubmitError::QueueFull);
        }
        self.sender.send(Message::Submit(sequences)).map_err(|_| {
            self.queued.fetch_sub(n, Ordering::SeqCst);
            SubmitError::ShuttingDown
        })
    }

    /// Refuses new requests from now on.
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::SeqCst);
    }

    /// Whether new requests are accepted.
    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
    }

    /// Stops every running and waiting sequence (each gets a `Failed` event).
    pub fn cancel_all(&self) {
        let _ = self.sender.send(Message::CancelAll);
    }
}

struct Engine {
    config: Arc<SchedulerConfig>,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
}

/// A KV cache and the tokens whose rows it holds.
struct CachedSequence {
    cache: KvCache,
    tokens: Vec<u32>,
}

struct Running<'t> {
    request: SeqRequest,
    cache: KvCache,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    cached_tokens: usize,
    /// What the next step feeds.
    input: Vec<u32>,
    sampler: Sampler,
    stream: TokenStream<'t>,
    stop_ids: Vec<u32>,
    held_text: String,
    generated: usize,
    done: bool,
}

impl Engine {
    fn run(self, model: &dyn StepModel, tokenizer: &Tokenizer, receiver: mpsc::Receiver<Message>) {
        let mut waiting: VecDeque<SeqRequest> = VecDeque::new();
        let mut running: Vec<Running> = Vec::new();
        let mut idle: Vec<CachedSequence> = Vec::new(); // least recently used first
        let mut disconnected = false;
        loop {
            // Take new requests; block only when there is nothing else to do.
            if running.is_empty() && waiting.is_empty() {
                if disconnected {
                    return;
                }
                match receiver.recv() {
                    Ok(message) => self.handle(message, &mut waiting, &mut running),
                    Err(_) => return, // every handle is gone
                }
            }
            loop {
                match receiver.try_recv() {
                    Ok(message) => self.handle(message, &mut waiting, &mut running),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }

            // Forget requests whose client left while they waited.
            waiting.retain(|request| {
                let gone = request.events.is_closed();
                if gone {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                !gone
            });
            // Stop sequences whose client left.
            running.retain_mut(|seq| {
                if seq.request.events.is_closed() {
                    tracing::info!(request_id = %seq.request.request_id, choice = seq.request.choice,
                        generated = seq.generated, "client gone: sequence stopped");
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    self.metrics
                        .generation_tokens
                        .fetch_add(seq.generated as u64, Ordering::Relaxed);
                    seq.done = true;
                }
                !seq.done
            });
            self.admit(model, tokenizer, &mut waiting, &mut running, &mut idle);
            self.publish(&waiting, &running, &idle);
            if running.is_empty() {
                if !waiting.is_empty() {
                    // Cannot happen with a budget that fits one sequence; avoid a busy loop regardless.
                    std::thread::sleep(Duration::from_millis(1));
                }
                continue;
            }

            let started = Instant::now();
            let mut inputs: Vec<StepInput> = running
                .iter_mut()
                .map(|seq| StepInput {
                    start_pos: seq.cache.len(),
                    tokens: &seq.input,
                    cache: &mut seq.cache,
                })
                .collect();
            let outputs = model.forward_batch(&mut inputs);
            drop(inputs);
            for (seq, logits) in running.iter_mut().zip(outputs) {
                if let Err(e) = logits.and_then(|logits| seq.advance(logits, &self.config)) {
                    tracing::warn!(request_id = %seq.request.request_id, error = %e, "sequence failed");
                    fail(&seq.request, &e.to_string());
                    seq.done = true;
                }
            }
            let step = started.elapsed();
            self.metrics.observe_step(step);
            let mut kept = Vec::new();
            for seq in running.drain(..) {
                if seq.done {
                    self.metrics
                        .generation_tokens
                        .fetch_add(seq.generated as u64, Ordering::Relaxed);
                    let tokens = seq.tokens[..seq.cache.len()].to_vec();
                    idle.push(CachedSequence {
                        cache: seq.cache,
                        tokens,
                    });
                } else {
                    kept.push(seq);
                }
            }
            running = kept;
            // Idle caches beyond what running sequences leave free are dropped, oldest first.
            let in_use: usize = running.iter().map(|s| s.cache.capacity()).sum();
            let mut idle_total: usize = idle.iter().map(|c| c.cache.capacity()).sum();
            while !idle.is_empty()
                && (in_use + idle_total > self.config.kv_budget
                    || idle.len() > self.config.max_seqs)
            {
                idle_total -= idle.remove(0).cache.capacity();
            }
            self.publish(&waiting, &running, &idle);
        }
    }

    fn handle(
        &self,
        message: Message,
        waiting: &mut VecDeque<SeqRequest>,
        running: &mut Vec<Running>,
    ) {
        match message {
            Message::Submit(sequences) => waiting.extend(sequences),
            Message::CancelAll => {
                for request in waiting.drain(..) {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    fail(&request, "the server is shutting down");
                }
                for seq in running.drain(..) {
                    fail(&seq.request, "the server is shutting down");
                }
            }
        }
    }

    /// Moves waiting requests into `running` while sequence slots and KV budget allow (FIFO).
    fn admit<'t>(
        &self,
        model: &dyn StepModel,
        tokenizer: &'t Tokenizer,
        waiting: &mut VecDeque<SeqRequest>,
        running: &mut Vec<Running<'t>>,
        idle: &mut Vec<CachedSequence>,
    ) {
        while running.len() < self.config.max_seqs {
            let Some(request) = waiting.front() else {
                return;
            };
            let needed = request.kv_needed(self.config.max_model_len);
            // Best idle cache: big enough, longest shared prefix.
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, c)| c.cache.capacity() >= needed)
                .map(|(i, c)| (i, shared_prefix(&c.tokens, &request.prompt)))
                .max_by_key(|&(i, shared)| (shared, std::cmp::Reverse(idle[i].cache.capacity())));
            let in_use: usize = running.iter().map(|s| s.cache.capacity()).sum();
            let (cache, reuse) = match best {
                Some((i, shared)) => {
                    let CachedSequence { mut cache, .. } = idle.remove(i);
                    let reuse = shared.min(cache.len()).min(request.prompt.len() - 1);
                    cache.truncate(reuse);
                    (cache, reuse)
                }
                _ => {
                    // Make room by dropping idle caches, oldest first.
                    let mut idle_total: usize = idle.iter().map(|c| c.cache.capacity()).sum();
                    while in_use + idle_total + needed > self.config.kv_budget && !idle.is_empty() {
                        idle_total -= idle.remove(0).cache.capacity();
                    }
                    if in_use + needed > self.config.kv_budget {
                        return; // wait for running sequences to finish
                    }
                    match model.new_cache(needed) {
                        Ok(cache) => (cache, 0),
                        Err(e) => {
                            let request = waiting.pop_front().expect("front exists");
                            self.queued.fetch_sub(1, Ordering::SeqCst);
                            fail(&request, &format!("cannot allocate the KV cache: {e}"));
                            continue;
                        }
                    }
                }
            };
            let request = waiting.pop_front().expect("front exists");
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics
                .prompt_tokens
                .fetch_add(request.prompt.len() as u64, Ordering::Relaxed);
            tracing::debug!(request_id = %request.request_id, choice = request.choice,
                prompt_tokens = request.prompt.len(), reused = reuse, kv = cache.capacity(), "admitted");
            let mut stop_ids = if request.ignore_eos {
                Vec::new()
            } else {
                self.config.eos_token_ids.clone()
            };
            stop_ids.extend(&request.params.stop_token_ids);
            running.push(Running {
                sampler: Sampler::new(&request.params),
                stream: TokenStream::new(tokenizer),
                tokens: request.prompt.clone(),
                prompt_len: request.prompt.len(),
                cached_tokens: reuse,
                input: request.prompt[reuse..].to_vec(),
                stop_ids,
                held_text: String::new(),
                generated: 0,
                done: false,
                cache,
                request,
            });
            // The first chunk only: the rest of a long prompt is fed step by step.
            let seq = running.last_mut().expect("just pushed");
            seq.input.truncate(self.config.prefill_chunk);
        }
    }

    fn publish(
        &self,
        waiting: &VecDeque<SeqRequest>,
        running: &[Running],
        idle: &[CachedSequence],
    ) {
        let m = &self.metrics;
        m.waiting.store(waiting.len(), Ordering::Relaxed);
        m.running.store(running.len(), Ordering::Relaxed);
        m.kv_tokens_reserved.store(
            running.iter().map(|s| s.cache.capacity()).sum(),
            Ordering::Relaxed,
        );
        m.kv_tokens_used.store(
            running.iter().map(|s| s.cache.len()).sum(),
            Ordering::Relaxed,
        );
        m.kv_tokens_cached.store(
            idle.iter().map(|c| c.cache.capacity()).sum(),
            Ordering::Relaxed,
        );
    }
}

impl Running<'_> {
    /// After a step that fed `fed` tokens: continue the prefill, or sample, report and stop when due.
    fn advance(&mut self, logits: Tensor, config: &SchedulerConfig) -> Result<()> {
        let computed = self.cache.len();
        if computed < self.prompt_len {
            let end = (computed + config.prefill_chunk).min(self.prompt_len);
            self.input = self.tokens[computed..end].to_vec();
            return Ok(());
        }
        let log_softmax = match self.request.logprobs {
            Some(_) => Some(log_softmax(&logits)?),
            None => None,
        };
        let id = self.sampler.sample(&logits, &self.tokens)?;
        let logprobs = log_softmax.map(|lps| TokenLogprobs {
            logprob: lps[id as usize],
            top: top_k(&lps, self.request.logprobs.unwrap_or(0)),
        });
        if self.stop_ids.contains(&id) {
            return self.finish(FinishReason::EndOfSequence(id));
        }
        self.tokens.push(id);
        self.generated += 1;
        if let Some(text) = self.stream.push(id)? {
            self.held_text.push_str(&text);
        }
        match take_text_before_stop(&mut self.held_text, &self.request.params.stop_strings) {
            Err((text, stop)) => {
                self.emit(Some(id), text, logprobs);
                self.held_text.clear();
                return self.finish(FinishReason::StopString(stop));
            }
            Ok(text) => self.emit(Some(id), text, logprobs),
        }
        if self.generated >= self.request.params.max_new_tokens {
            return self.finish(FinishReason::MaxTokens);
        }
        if self.cache.len() + 1 > self.cache.capacity() {
            return self.finish(FinishReason::ContextFull);
        }
        self.input = vec![id];
        Ok(())
    }

    fn emit(&self, id: Option<u32>, text: String, logprobs: Option<TokenLogprobs>) {
        let _ = self.request.events.send(SeqEvent::Token {
            choice: self.request.choice,
            id,
            text,
            logprobs,
        });
    }

    fn finish(&mut self, reason: FinishReason) -> Result<()> {
        let mut rest = std::mem::take(&mut self.held_text);
        if !matches!(reason, FinishReason::StopString(_)) {
            if let Some(tail) = self.stream.finish()? {
                rest.push_str(&tail);
            }
        }
        if !rest.is_empty() {
            self.emit(None, rest, None);
        }
        let _ = self.request.events.send(SeqEvent::Finished {
            choice: self.request.choice,
            reason,
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.generated,
        });
        self.done = true;
        Ok(())
    }
}

fn fail(request: &SeqRequest, message: &str) {
    let _ = request.events.send(SeqEvent::Failed {
        choice: request.choice,
        message: message.to_string(),
    });
}

fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Log-softmax of `logits` `[vocab]`, in f32.
fn log_softmax(logits: &Tensor) -> Result<Vec<f32>> {
    let logits = logits.to_dtype(candle_core::DType::F32)?;
    Ok(candle_nn::ops::log_softmax(&logits, D::Minus1)?.to_vec1()?)
}

/// The `k` largest entries `(index, value)`, largest first, ties to the lower index.
fn top_k(values: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_unstable_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order
        .into_iter()
        .take(k)
        .map(|i| (i as u32, values[i]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_whole_blocks_within_the_context() {
        assert_eq!(kv_reservation(10, 5, 1024), KV_BLOCK);
        assert_eq!(kv_reservation(KV_BLOCK, 1, 1024), 2 * KV_BLOCK);
        assert_eq!(kv_reservation(1000, 1000, 1024), 1024);
    }

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let stops = vec!["END".to_string()];
        let mut held = "abcE".to_string();
        assert_eq!(take_text_before_stop(&mut held, &stops), Ok("abc".into()));
        assert_eq!(held, "E");
        held.push_str("NDx");
        assert_eq!(
            take_text_before_stop(&mut held, &stops),
            Err((String::new(), "END".into()))
        );
    }
}
