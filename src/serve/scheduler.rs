//! The engine: one thread owns the model and a paged KV pool, and runs every admitted sequence in one
//! batched forward per step (continuous batching).
//!
//! A step is one [`StepModel::forward_batch`] call over every running sequence: the next chunk of its prompt
//! (at most `prefill_chunk` tokens, so one long prompt does not stall the decodes around it) or its last
//! sampled token, all flattened into one pass over the pool. With the layers over several devices the step is
//! split into micro-batches (by default one per stage of the placement), every one issued before the first is
//! read back: the device holding the first layers starts the second micro-batch while the next device runs
//! the first, so the devices work at once instead of in turn. New requests are admitted between steps, so they
//! join the next one, while fewer than `max_seqs` run and the pool has the blocks their prompts need beyond
//! what the running prefills still need; the rest wait in a FIFO queue. A sequence whose client went away
//! (its event channel closed) is stopped and its blocks freed before the next step.
//!
//! Blocks are taken as sequences grow. When a step needs more than are free, blocks kept for prefix reuse are
//! dropped first (oldest first), then the most recently admitted running sequence is preempted: its blocks are
//! freed, it goes back to the head of the queue with its tokens, sampler and stream state, and when it is
//! admitted again its prompt and generated tokens are recomputed (prefilled) before it continues, so its
//! client sees one uninterrupted stream. Nothing fails for lack of blocks: a request that could never fit
//! the pool is refused with 400 before it is queued.
//!
//! A finished sequence's blocks are kept, with the tokens they hold, until the blocks are needed: a new
//! prompt that starts with those tokens takes the sequence over (prefix caching, e.g. the next turn of a
//! chat) and only the rest is prefilled. A prompt that starts with what a running sequence has computed (a
//! shared system prompt) shares its whole blocks instead ([`PagedKvCache::fork`]), where that holds more of
//! it; a preempted sequence resumes the same way.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use candle_core::{Tensor, D};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::Result;
use crate::generate::{take_text_before_stop, GenerationParams, Sampler};
use crate::models::{PagedCacheOptions, PagedKvCache, SeqChunk, SeqId, DEFAULT_BLOCK_SIZE};
use crate::sampling::sample_rows;
use crate::tokenizer::{TokenStream, Tokenizer};
use crate::{DecodeGraphs, FinishReason, Glm5ForCausalLM};

use super::metrics::Metrics;

/// Tokens per KV block of the server's pool: the unit of reservation and of the `kv_blocks` metrics.
pub const KV_BLOCK: usize = DEFAULT_BLOCK_SIZE;

/// What the scheduler needs of a model: a paged KV pool, and steps of several sequences over it.
pub trait StepModel {
    /// An empty pool of `options.num_blocks` blocks of `options.block_size` tokens.
    fn new_pool(&self, options: PagedCacheOptions) -> Result<PagedKvCache>;

    /// One step: every entry's tokens appended to its sequence in `pool`, in one forward. Returns the
    /// logits `[batch.len(), vocab]` after each entry's last token, in batch order. On error nothing has
    /// changed in the pool.
    fn forward_batch(&self, batch: &[SeqChunk<'_>], pool: &mut PagedKvCache) -> Result<Tensor>;

    /// [`Self::forward_batch`] through decode-step graphs where the model can replay one
    /// ([`Glm5ForCausalLM::forward_batch_graphed`]); the default runs every step eagerly.
    fn forward_batch_graphed(
        &self,
        graphs: &mut DecodeGraphs,
        batch: &[SeqChunk<'_>],
        pool: &mut PagedKvCache,
    ) -> Result<Tensor> {
        let _ = graphs;
        self.forward_batch(batch, pool)
    }

    /// Waits for the device work the calling thread queued (the weights, the pool), before the engine
    /// thread's stream uses them ([`Glm5ForCausalLM::synchronize`]).
    fn synchronize(&self) -> Result<()>;

    /// The stages of the model's placement a step passes through one after another (runs of layers on one
    /// device; [`crate::Plan::pipeline_stages`]): the default number of micro-batches a step is split
    /// into ([`SchedulerConfig::micro_batches`]).
    fn pipeline_stages(&self) -> usize {
        1
    }
}

impl StepModel for Glm5ForCausalLM {
    fn new_pool(&self, options: PagedCacheOptions) -> Result<PagedKvCache> {
        Ok(self.new_paged_cache(options)?)
    }

    fn forward_batch(&self, batch: &[SeqChunk<'_>], pool: &mut PagedKvCache) -> Result<Tensor> {
        Ok(Glm5ForCausalLM::forward_batch(self, batch, pool)?)
    }

    fn forward_batch_graphed(
        &self,
        graphs: &mut DecodeGraphs,
        batch: &[SeqChunk<'_>],
        pool: &mut PagedKvCache,
    ) -> Result<Tensor> {
        Ok(Glm5ForCausalLM::forward_batch_graphed(
            self, graphs, batch, pool,
        )?)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(Glm5ForCausalLM::synchronize(self)?)
    }

    fn pipeline_stages(&self) -> usize {
        self.plan().pipeline_stages()
    }
}

impl StepModel for crate::Glm5 {
    fn new_pool(&self, options: PagedCacheOptions) -> Result<PagedKvCache> {
        self.model().new_pool(options)
    }

    fn forward_batch(&self, batch: &[SeqChunk<'_>], pool: &mut PagedKvCache) -> Result<Tensor> {
        StepModel::forward_batch(self.model(), batch, pool)
    }

    fn forward_batch_graphed(
        &self,
        graphs: &mut DecodeGraphs,
        batch: &[SeqChunk<'_>],
        pool: &mut PagedKvCache,
    ) -> Result<Tensor> {
        StepModel::forward_batch_graphed(self.model(), graphs, batch, pool)
    }

    fn pipeline_stages(&self) -> usize {
        StepModel::pipeline_stages(self.model())
    }

    fn synchronize(&self) -> Result<()> {
        StepModel::synchronize(self.model())
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
    /// KV cache tokens of the pool (its blocks times their size), over all sequences: running, and kept for
    /// prefix reuse.
    pub kv_budget: usize,
    /// Most prompt tokens one sequence feeds in one step.
    pub prefill_chunk: usize,
    /// The model's end-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
    /// Decode steps through [`StepModel::forward_batch_graphed`] (CUDA graphs where the model can).
    pub cuda_graphs: bool,
    /// Forward calls a step's running sequences are split into, all issued before any is read back (1: one
    /// call). With the layers over several devices, the devices then work on different micro-batches at
    /// once instead of one after another.
    pub micro_batches: usize,
}

/// Decode-step graphs the engine keeps: one per (capture size, block-table width) it meets, the least
/// recently used dropped first.
const MAX_DECODE_GRAPHS: usize = 32;

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
    /// Starts the engine thread over `model` and its KV `pool` (from [`StepModel::new_pool`]); it runs
    /// until every handle is dropped.
    pub fn start<M: StepModel + Send + 'static>(
        model: M,
        pool: PagedKvCache,
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
            .spawn(move || engine.run(&model, pool, &tokenizer, receiver))
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

/// A finished sequence whose blocks are kept for prefix reuse, and the tokens they hold.
struct Idle {
    seq: SeqId,
    tokens: Vec<u32>,
}

/// How a new (or resumed) sequence starts from what the pool holds ([`State::prefix_reuse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reuse {
    /// Take the kept sequence over, truncated to its first `n` tokens.
    TakeOver(SeqId, usize),
    /// Fork the running sequence's first `n` tokens (whole blocks, shared).
    Fork(SeqId, usize),
    /// Start empty.
    Nothing,
}

impl Reuse {
    /// The kept sequence it takes over (not to be evicted to make room for it).
    fn kept(self) -> Option<SeqId> {
        match self {
            Reuse::TakeOver(seq, _) => Some(seq),
            _ => None,
        }
    }
}

struct Running<'t> {
    request: SeqRequest,
    /// Its sequence in the pool.
    seq: SeqId,
    /// Prompt then generated tokens. The pool holds the KV of a prefix of them; each step feeds the next
    /// ones (a prompt chunk, a recomputation after preemption, or the last sampled token).
    tokens: Vec<u32>,
    prompt_len: usize,
    cached_tokens: usize,
    /// Order of first admission: the latest is preempted first, and preempted sequences resume in it.
    admitted: u64,
    sampler: Sampler,
    stream: TokenStream<'t>,
    stop_ids: Vec<u32>,
    held_text: String,
    generated: usize,
    done: bool,
}

/// The engine's sequences, in the pool and out of it.
struct State<'t> {
    pool: PagedKvCache,
    waiting: VecDeque<SeqRequest>,
    /// Preempted sequences (holding no blocks), in admission order; resumed before new requests.
    preempted: VecDeque<Running<'t>>,
    running: Vec<Running<'t>>,
    /// Finished sequences kept for prefix reuse, least recently finished first.
    idle: VecDeque<Idle>,
    admissions: u64,
    /// Decode-step graphs, when the config asks for them.
    graphs: Option<DecodeGraphs>,
}

impl State<'_> {
    /// Frees a sequence's blocks (every id here came from this pool and is freed once).
    fn free(&mut self, seq: SeqId) {
        let _ = self.pool.free_sequence(seq);
    }

    /// Frees the oldest idle sequence other than `keep`; false when there is none.
    fn drop_oldest_idle(&mut self, keep: Option<SeqId>) -> bool {
        match self.idle.iter().position(|i| Some(i.seq) != keep) {
            Some(at) => {
                let idle = self.idle.remove(at).expect("position is in range");
                self.free(idle.seq);
                true
            }
            None => false,
        }
    }

    /// Where a sequence of `tokens` starts in the pool (module docs): the kept sequence whose computed
    /// tokens share the longest prefix with them, taken over, or a fork of the whole blocks a running
    /// sequence shares with them where that holds more; at least `tokens`' last is always computed, for its
    /// logits.
    fn prefix_reuse(&self, tokens: &[u32]) -> Reuse {
        let limit = tokens.len().saturating_sub(1);
        let shared = |seq: SeqId, held: &[u32]| {
            let computed = self.pool.seq_len(seq).unwrap_or(0).min(held.len());
            shared_prefix(&held[..computed], tokens).min(limit)
        };
        // The most recent kept sequence on ties (the queue's end).
        let idle = self
            .idle
            .iter()
            .map(|i| (i.seq, shared(i.seq, &i.tokens)))
            .filter(|&(_, n)| n > 0)
            .fold(None, |best: Option<(SeqId, usize)>, c| match best {
                Some(b) if b.1 > c.1 => Some(b),
                _ => Some(c),
            });
        let block = self.pool.block_size();
        let running = self
            .running
            .iter()
            .map(|r| (r.seq, shared(r.seq, &r.tokens) / block * block))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n);
        match (idle, running) {
            (Some((seq, n)), Some((_, whole))) if n >= whole => Reuse::TakeOver(seq, n),
            (Some((seq, n)), None) => Reuse::TakeOver(seq, n),
            (_, Some((seq, whole))) => Reuse::Fork(seq, whole),
            (None, None) => Reuse::Nothing,
        }
    }

    /// Blocks a sequence of `tokens` tokens must take beyond what `reuse` gives it.
    fn blocks_beyond(&self, tokens: usize, reuse: Reuse) -> usize {
        let held = match reuse {
            Reuse::TakeOver(_, n) => self.pool.blocks_for_tokens(n),
            Reuse::Fork(_, n) => n / self.pool.block_size(),
            Reuse::Nothing => 0,
        };
        self.pool.blocks_for_tokens(tokens).saturating_sub(held)
    }

    /// The sequence `reuse` says, and the tokens of its prompt it already holds.
    fn start_sequence(&mut self, reuse: Reuse) -> (SeqId, usize) {
        let started = match reuse {
            Reuse::TakeOver(seq, n) => {
                self.idle.retain(|idle| idle.seq != seq);
                self.pool.truncate_sequence(seq, n).map(|()| seq)
            }
            Reuse::Fork(seq, n) => self.pool.fork(seq, n),
            Reuse::Nothing => Ok(self.pool.add_sequence()),
        };
        let seq = started.unwrap_or_else(|_| self.pool.add_sequence());
        (seq, self.pool.seq_len(seq).unwrap_or(0))
    }

    /// Blocks the running sequences still need to hold all their tokens (unfinished prefills).
    fn running_shortfall(&self) -> usize {
        self.running
            .iter()
            .map(|r| {
                let held = self.pool.seq_len(r.seq).unwrap_or(0);
                self.pool
                    .blocks_to_append(r.seq, r.tokens.len().saturating_sub(held))
                    .unwrap_or(0)
            })
            .sum()
    }

    /// Frees idle blocks (oldest first, never `keep`'s) until `need` blocks plus what the running prefills
    /// still need are free; false, with nothing freed, when even all of them would not be enough.
    fn reserve(&mut self, need: usize, keep: Option<SeqId>) -> bool {
        let want = need + self.running_shortfall();
        // What freeing them gives back: the blocks no other sequence holds (an underestimate where idle
        // sequences share blocks only among themselves, so a reservation that passes holds).
        let evictable: usize = self
            .idle
            .iter()
            .filter(|i| Some(i.seq) != keep)
            .map(|i| self.pool.exclusive_blocks(i.seq).unwrap_or(0))
            .sum();
        if self.pool.free_blocks() + evictable < want {
            return false;
        }
        while self.pool.free_blocks() < want && self.drop_oldest_idle(keep) {}
        true
    }
}

impl Engine {
    fn run(
        self,
        model: &dyn StepModel,
        pool: PagedKvCache,
        tokenizer: &Tokenizer,
        receiver: mpsc::Receiver<Message>,
    ) {
        let mut state = State {
            pool,
            waiting: VecDeque::new(),
            preempted: VecDeque::new(),
            running: Vec::new(),
            idle: VecDeque::new(),
            admissions: 0,
            graphs: self
                .config
                .cuda_graphs
                .then(|| DecodeGraphs::new(MAX_DECODE_GRAPHS)),
        };
        let mut disconnected = false;
        loop {
            // Take new requests; block only when there is nothing else to do.
            if state.running.is_empty() && state.waiting.is_empty() && state.preempted.is_empty() {
                if disconnected {
                    return;
                }
                match receiver.recv() {
                    Ok(message) => self.handle(message, &mut state),
                    Err(_) => return, // every handle is gone
                }
            }
            loop {
                match receiver.try_recv() {
                    Ok(message) => self.handle(message, &mut state),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            self.drop_disconnected(&mut state);
            self.admit(tokenizer, &mut state);
            self.publish(&state);
            if state.running.is_empty() {
                if !state.waiting.is_empty() || !state.preempted.is_empty() {
                    // Cannot happen with a pool that holds one sequence; avoid a busy loop regardless.
                    std::thread::sleep(Duration::from_millis(1));
                }
                continue;
            }

            let started = Instant::now();
            self.make_room(&mut state);
            self.step(model, &mut state);
            self.metrics.observe_step(started.elapsed());

            let mut kept = Vec::new();
            for seq in std::mem::take(&mut state.running) {
                if !seq.done {
                    kept.push(seq);
                    continue;
                }
                self.metrics
                    .generation_tokens
                    .fetch_add(seq.generated as u64, Ordering::Relaxed);
                let held = state.pool.seq_len(seq.seq).unwrap_or(0);
                state.idle.push_back(Idle {
                    seq: seq.seq,
                    tokens: seq.tokens[..held.min(seq.tokens.len())].to_vec(),
                });
            }
            state.running = kept;
            while state.idle.len() > self.config.max_seqs && state.drop_oldest_idle(None) {}
            self.publish(&state);
        }
    }

    fn handle(&self, message: Message, state: &mut State) {
        match message {
            Message::Submit(sequences) => state.waiting.extend(sequences),
            Message::CancelAll => {
                for request in std::mem::take(&mut state.waiting) {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    fail(&request, "the server is shutting down");
                }
                let running = std::mem::take(&mut state.running);
                let preempted = std::mem::take(&mut state.preempted);
                for seq in running.into_iter().chain(preempted) {
                    fail(&seq.request, "the server is shutting down");
                    state.free(seq.seq);
                }
            }
        }
    }

    /// Forgets waiting requests, and stops sequences, whose client left (freeing their blocks).
    fn drop_disconnected(&self, state: &mut State) {
        state.waiting.retain(|request| {
            let gone = request.events.is_closed();
            if gone {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        let connected = |seq: &Running| !seq.request.events.is_closed();
        let (running, mut gone): (Vec<_>, Vec<_>) = std::mem::take(&mut state.running)
            .into_iter()
            .partition(connected);
        let (preempted, gone_preempted): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut state.preempted)
                .into_iter()
                .partition(connected);
        state.running = running;
        state.preempted = preempted;
        gone.extend(gone_preempted);
        for seq in gone {
            tracing::info!(request_id = %seq.request.request_id, choice = seq.request.choice,
                generated = seq.generated, "client gone: sequence stopped");
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            self.metrics
                .generation_tokens
                .fetch_add(seq.generated as u64, Ordering::Relaxed);
            state.free(seq.seq);
        }
    }

    /// Moves preempted sequences, then waiting requests, into `running` (FIFO) while sequence slots allow
    /// and the pool has the blocks their tokens need beyond what the running prefills still need.
    fn admit<'t>(&self, tokenizer: &'t Tokenizer, state: &mut State<'t>) {
        while state.running.len() < self.config.max_seqs {
            if let Some(seq) = state.preempted.front() {
                // It recomputes what no other sequence holds of its tokens.
                let reuse = state.prefix_reuse(&seq.tokens);
                let need = state.blocks_beyond(seq.tokens.len(), reuse);
                if !state.reserve(need, reuse.kept()) {
                    return;
                }
                let mut seq = state.preempted.pop_front().expect("front exists");
                state.free(seq.seq);
                (seq.seq, _) = state.start_sequence(reuse);
                tracing::debug!(request_id = %seq.request.request_id, choice = seq.request.choice,
                    tokens = seq.tokens.len(), "resumed after preemption: recomputing its KV");
                state.running.push(seq);
                continue;
            }
            let Some(request) = state.waiting.front() else {
                return;
            };
            // What a kept or running sequence holds of the prompt is not recomputed.
            let reuse = state.prefix_reuse(&request.prompt);
            let need = state.blocks_beyond(request.prompt.len(), reuse);
            if !state.reserve(need, reuse.kept()) {
                return; // wait for running sequences to finish
            }
            let (seq, reused) = state.start_sequence(reuse);
            let request = state.waiting.pop_front().expect("front exists");
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics
                .prompt_tokens
                .fetch_add(request.prompt.len() as u64, Ordering::Relaxed);
            tracing::debug!(request_id = %request.request_id, choice = request.choice,
                prompt_tokens = request.prompt.len(), reused, "admitted");
            let mut stop_ids = if request.ignore_eos {
                Vec::new()
            } else {
                self.config.eos_token_ids.clone()
            };
            stop_ids.extend(&request.params.stop_token_ids);
            state.admissions += 1;
            state.running.push(Running {
                sampler: Sampler::new(&request.params),
                stream: TokenStream::new(tokenizer),
                tokens: request.prompt.clone(),
                prompt_len: request.prompt.len(),
                cached_tokens: reused,
                admitted: state.admissions,
                stop_ids,
                held_text: String::new(),
                generated: 0,
                done: false,
                seq,
                request,
            });
        }
    }

    /// Frees blocks until every running sequence's next input fits: idle sequences first (oldest first),
    /// then the most recently admitted running sequence is preempted (its blocks freed, itself queued to
    /// resume first). A lone sequence always fits: a request that could not is refused before it is queued.
    fn make_room(&self, state: &mut State) {
        loop {
            let needed: usize = state
                .running
                .iter()
                .map(|seq| {
                    let (_, n) = seq.next_input(&state.pool, self.config.prefill_chunk);
                    state.pool.blocks_to_append(seq.seq, n).unwrap_or(0)
                })
                .sum();
            if needed <= state.pool.free_blocks() {
                return;
            }
            if state.drop_oldest_idle(None) {
                continue;
            }
            if state.running.len() <= 1 {
                return;
            }
            let latest = (0..state.running.len())
                .max_by_key(|&i| state.running[i].admitted)
                .expect("at least two run");
            let mut seq = state.running.remove(latest);
            state.free(seq.seq);
            seq.seq = state.pool.add_sequence();
            tracing::info!(request_id = %seq.request.request_id, choice = seq.request.choice,
                tokens = seq.tokens.len(), "preempted: KV blocks ran out; it will be recomputed");
            self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
            let at = state
                .preempted
                .iter()
                .position(|p| p.admitted > seq.admitted)
                .unwrap_or(state.preempted.len());
            state.preempted.insert(at, seq);
        }
    }

    /// One batched forward over every running sequence's next input, then sampling where a sequence's
    /// tokens are all computed. A step that fails is retried one sequence at a time, so that only the
    /// sequence at fault fails (a failed forward changes nothing in the pool).
    fn step(&self, model: &dyn StepModel, state: &mut State) {
        let State {
            pool,
            running,
            graphs,
            ..
        } = state;
        let chunk = self.config.prefill_chunk;
        let inputs: Vec<(usize, usize)> =
            running.iter().map(|s| s.next_input(pool, chunk)).collect();
        let batch: Vec<SeqChunk> = running
            .iter()
            .zip(&inputs)
            .map(|(seq, &(start, n))| SeqChunk {
                seq: seq.seq,
                tokens: &seq.tokens[start..start + n],
                start_pos: start,
            })
            .collect();
        // Every micro-batch's forward is queued before any is read back: the devices' streams order the work,
        // so a device that finished its layers of one micro-batch goes on with the next.
        let groups = micro_batches(batch.len(), self.config.micro_batches);
        let mut stepped: Vec<Result<Tensor>> = Vec::with_capacity(groups.len());
        for group in &groups {
            let part = &batch[group.clone()];
            stepped.push(match graphs.as_mut() {
                Some(graphs) => {
                    let stepped = model.forward_batch_graphed(graphs, part, pool);
                    self.metrics.observe_graphs(graphs.stats());
                    stepped
                }
                None => model.forward_batch(part, pool),
            });
        }
        let mut outputs: Vec<Result<Tensor>> = Vec::with_capacity(batch.len());
        let mut picks: Vec<Option<Result<u32>>> = Vec::with_capacity(batch.len());
        let mut failed: Vec<(usize, SeqChunk)> = Vec::new();
        for (group, stepped) in groups.iter().zip(&stepped) {
            if let Err(e) = stepped {
                tracing::warn!(error = %e, sequences = group.len(),
                    "batched step failed: running its sequences one at a time");
                for i in group.clone() {
                    failed.push((i, batch[i]));
                }
            }
        }
        // A failed micro-batch's sequences, one at a time (before the others' logits are read, while `batch`
        // still borrows the running sequences' tokens).
        let mut alone: Vec<(usize, Result<Tensor>)> = failed
            .iter()
            .map(|(i, one)| {
                let logits = model
                    .forward_batch(std::slice::from_ref(one), pool)
                    .and_then(|l| Ok(l.get(0)?));
                (*i, logits)
            })
            .collect();
        drop(batch);
        for (group, stepped) in groups.into_iter().zip(stepped) {
            match stepped {
                Ok(logits) => {
                    // Timed from the end of the device's work (the read-back would wait for it anyway).
                    let _ = logits.device().synchronize();
                    let sampling = Instant::now();
                    picks.extend(sample_ready(&mut running[group.clone()], pool, &logits));
                    self.metrics
                        .sample_seconds
                        .observe(sampling.elapsed().as_secs_f64());
                    outputs.extend((0..group.len()).map(|i| Ok(logits.get(i)?)));
                }
                Err(_) => {
                    for i in group {
                        let at = alone.iter().position(|(j, _)| *j == i).expect("ran alone");
                        outputs.push(alone.swap_remove(at).1);
                        picks.push(None);
                    }
                }
            }
        }
        for ((seq, logits), pick) in running.iter_mut().zip(outputs).zip(picks) {
            if let Err(e) = logits.and_then(|logits| seq.advance(logits, pick, pool, &self.config))
            {
                tracing::warn!(request_id = %seq.request.request_id, error = %e, "sequence failed");
                fail(&seq.request, &e.to_string());
                seq.done = true;
            }
        }
    }

    fn publish(&self, state: &State) {
        let m = &self.metrics;
        let pool = &state.pool;
        m.waiting.store(
            state.waiting.len() + state.preempted.len(),
            Ordering::Relaxed,
        );
        m.running.store(state.running.len(), Ordering::Relaxed);
        // Blocks the running sequences hold (a shared one once); the kept ones hold the rest.
        let in_use = pool.distinct_blocks(state.running.iter().map(|s| s.seq));
        m.kv_blocks_in_use.store(in_use, Ordering::Relaxed);
        m.kv_tokens_used.store(
            state
                .running
                .iter()
                .map(|s| pool.seq_len(s.seq).unwrap_or(0))
                .sum(),
            Ordering::Relaxed,
        );
        m.kv_blocks_cached
            .store(pool.blocks_in_use() - in_use, Ordering::Relaxed);
    }
}

impl Running<'_> {
    /// Where the next step starts for this sequence and how many tokens it feeds: the tokens the pool
    /// does not hold yet, at most `chunk` of them.
    fn next_input(&self, pool: &PagedKvCache, chunk: usize) -> (usize, usize) {
        let computed = pool.seq_len(self.seq).unwrap_or(0).min(self.tokens.len());
        (computed, (self.tokens.len() - computed).min(chunk))
    }

    /// Whether the pool holds all its tokens, so that the step's logits give its next one.
    fn samples(&self, pool: &PagedKvCache) -> bool {
        pool.seq_len(self.seq)
            .is_ok_and(|computed| computed >= self.tokens.len())
    }

    /// After a step: nothing more while tokens remain to be computed (a prompt, or a recomputation after
    /// preemption); otherwise take the token sampled with the step's other sequences (`pick`), or sample
    /// one from `logits`, report, and stop when due.
    fn advance(
        &mut self,
        logits: Tensor,
        pick: Option<Result<u32>>,
        pool: &PagedKvCache,
        config: &SchedulerConfig,
    ) -> Result<()> {
        if pool.seq_len(self.seq)? < self.tokens.len() {
            return Ok(());
        }
        let log_softmax = match self.request.logprobs {
            Some(_) => Some(log_softmax(&logits)?),
            None => None,
        };
        let id = match pick {
            Some(id) => id?,
            None => self.sampler.sample(&logits, &self.tokens)?,
        };
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
        // The new token is fed at position `tokens.len() - 1`, which must be within the context.
        if self.tokens.len() > config.max_model_len {
            return self.finish(FinishReason::ContextFull);
        }
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

/// `count` sequences split into at most `micro_batches` runs of consecutive ones, as even as can be (the
/// first ones a sequence longer).
fn micro_batches(count: usize, micro_batches: usize) -> Vec<std::ops::Range<usize>> {
    let parts = micro_batches.clamp(1, count.max(1));
    let (size, longer) = (count / parts, count % parts);
    let mut start = 0;
    (0..parts)
        .map(|p| {
            let end = start + size + usize::from(p < longer);
            let range = start..end;
            start = end;
            range
        })
        .filter(|r| !r.is_empty())
        .collect()
}

/// The next tokens of the sequences a step completed, sampled together from the step's `logits` (one
/// read-back for the greedy rows, one for the sampled ones: `sample_rows`); `None` for the others, and for
/// all of them if the read fails (each then samples on its own and fails alone).
fn sample_ready(
    running: &mut [Running<'_>],
    pool: &PagedKvCache,
    logits: &Tensor,
) -> Vec<Option<Result<u32>>> {
    let mut picks: Vec<Option<Result<u32>>> = (0..running.len()).map(|_| None).collect();
    let ready: Vec<usize> = (0..running.len())
        .filter(|&r| running[r].samples(pool))
        .collect();
    if ready.is_empty() {
        return picks;
    }
    let (mut samplers, histories): (Vec<&mut Sampler>, Vec<&[u32]>) = running
        .iter_mut()
        .enumerate()
        .filter(|(r, _)| ready.binary_search(r).is_ok())
        .map(|(_, seq)| (&mut seq.sampler, seq.tokens.as_slice()))
        .unzip();
    match sample_rows(&mut samplers, logits, &ready, &histories) {
        Ok(ids) => {
            for (&r, id) in ready.iter().zip(ids) {
                picks[r] = Some(id);
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "sampling the step's sequences together failed: each samples alone")
        }
    }
    picks
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
    fn micro_batches_cover_the_step_in_order_as_even_as_can_be() {
        let sizes = |count, parts| -> Vec<usize> {
            let groups = micro_batches(count, parts);
            // Consecutive, from 0 to count, none empty.
            let mut next = 0;
            for group in &groups {
                assert_eq!(group.start, next, "{groups:?}");
                assert!(!group.is_empty(), "{groups:?}");
                next = group.end;
            }
            assert_eq!(next, count, "{groups:?}");
            groups.iter().map(|g| g.len()).collect()
        };
        assert_eq!(sizes(10, 1), [10]);
        assert_eq!(sizes(10, 4), [3, 3, 2, 2]);
        assert_eq!(sizes(3, 8), [1, 1, 1]);
        assert_eq!(sizes(64, 8), [8; 8]);
        assert_eq!(sizes(5, 0), [5]);
        assert!(micro_batches(0, 4).is_empty());
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
