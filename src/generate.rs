//! Token generation: sampling settings, the sampler, stop conditions and the streaming token iterator.
//!
//! Prefill runs the whole prompt once; every decode step runs one token through the KV cache. Each step
//! yields the newly completed text (never half a UTF-8 character), holding back text that could still
//! become a stop string.
//!
//! Speculative decoding (a sequence made by [`SequenceCache::speculative`], for a model loaded with its MTP
//! layer): before a decode step the MTP layer drafts the token after the next one, and the step runs both
//! (the next token and the draft) through the model at once. The next token is sampled as always, the draft
//! checked against it ([`Sampler::sample_draft`]): where it stands, the step's second row already holds the
//! logits after it, and the following token needs no model step of its own; where it does not, its KV row
//! is dropped. Greedy tokens are exactly those of plain decoding; sampled ones follow the same distribution.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::models::{
    MtpCache, PagedCacheOptions, PagedKvCache, SeqChunk, SeqId, DEFAULT_BLOCK_SIZE,
};
pub use crate::sampling::{apply_min_p, Sampler};
use crate::tokenizer::TokenStream;
use crate::{DecodeGraphs, Glm5ForCausalLM, GraphStats, KvCache};

/// How to pick each next token and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationParams {
    /// Most tokens to generate after the prompt.
    pub max_new_tokens: usize,
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f64>,
    /// Drop tokens whose probability is below `min_p` times the most likely token's.
    pub min_p: Option<f64>,
    /// Divide positive (multiply negative) logits of already seen tokens by this; `1.0` is off.
    pub repetition_penalty: f32,
    /// How many of the latest tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every token already generated (OpenAI's `presence_penalty`, in
    /// [-2, 2]; the prompt's tokens do not count, as vLLM counts them); `0.0` is off.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every generated token once per time it was generated (OpenAI's
    /// `frequency_penalty`, in [-2, 2]); `0.0` is off.
    pub frequency_penalty: f32,
    /// Seed of the sampler's random generator: the same seed gives the same tokens.
    pub seed: u64,
    /// Extra token ids that end generation (the model's eos ids always do).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the text stops before them.
    pub stop_strings: Vec<String>,
}

impl Default for GenerationParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 299_792_458,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

impl GenerationParams {
    /// Checks the values a user can get wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidParams(what));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad(format!("top_p must be in (0, 1], got {p}"));
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return bad(format!("min_p must be in [0, 1], got {p}"));
        }
        if self.top_k == Some(0) {
            return bad("top_k must be at least 1".into());
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return bad(format!("{name} must be in [-2, 2], got {value}"));
            }
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into());
        }
        Ok(())
    }
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token (its id).
    EndOfSequence(u32),
    /// The text reached a stop string (which is not part of the output).
    StopString(String),
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The KV cache is full.
    ContextFull,
}

/// One decoded step.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    /// The sampled token; `None` for the final flush of text held back until generation ended.
    pub id: Option<u32>,
    /// Text completed by this token (may be empty while a character or a possible stop string is pending).
    pub text: String,
}

/// Token counts and timings of one generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationStats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Time of the prefill.
    pub prompt_time: Duration,
    /// Tokens sampled after the prompt (stop tokens excluded).
    pub generated_tokens: usize,
    /// Time of sampling and decoding them.
    pub generation_time: Duration,
    /// Speculative decoding: tokens the MTP layer drafted and the model checked.
    pub draft_tokens: usize,
    /// Of those, the ones that stood (each saved a model step).
    pub accepted_draft_tokens: usize,
}

impl GenerationStats {
    /// Prefill speed.
    pub fn prompt_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    /// Decode speed.
    pub fn generation_tokens_per_second(&self) -> f64 {
        self.generated_tokens as f64 / self.generation_time.as_secs_f64().max(1e-9)
    }
}

/// A KV cache together with the tokens it holds, so a later prompt that starts with them reuses them: one
/// sequence's contiguous cache ([`Self::new`]), or a paged pool of its own whose decode steps are replayed
/// from CUDA graphs where the model allows ([`Self::graphed`]).
pub struct SequenceCache {
    kv: SequenceKv,
    /// The MTP layer's rows and inputs, for speculative decoding ([`Self::speculative`]).
    draft: Option<Drafter>,
    /// The tokens whose rows it holds, in order.
    pub tokens: Vec<u32>,
}

/// The MTP draft's state of one sequence: its KV rows for positions `0..cache.len()`, and the main model's
/// hidden states of the next positions (`[1, hidden]` each, in order), whose rows the draft adds once the
/// token after each is known. Together they cover every position the main cache holds.
struct Drafter {
    cache: MtpCache,
    hidden: Vec<Tensor>,
}

enum SequenceKv {
    Contiguous(KvCache),
    Graphed(Box<GraphedSequence>),
}

/// A graphed sequence's pool, its id there, its graphs and its token limit.
struct GraphedSequence {
    pool: PagedKvCache,
    seq: SeqId,
    graphs: DecodeGraphs,
    capacity: usize,
}

impl SequenceCache {
    /// An empty sequence over `cache` (which is cleared).
    pub fn new(mut cache: KvCache) -> Self {
        cache.clear();
        Self {
            kv: SequenceKv::Contiguous(cache),
            draft: None,
            tokens: Vec::new(),
        }
    }

    /// An empty sequence of up to `capacity` tokens decoded speculatively with `model`'s MTP layer (module
    /// docs); the model must have been loaded with it ([`crate::LoadOptions::mtp`]).
    pub fn speculative(model: &Glm5ForCausalLM, capacity: usize) -> Result<Self> {
        Ok(Self {
            kv: SequenceKv::Contiguous(model.new_cache(capacity)?),
            draft: Some(Drafter {
                cache: model.new_mtp_cache(capacity)?,
                hidden: Vec::new(),
            }),
            tokens: Vec::new(),
        })
    }

    /// Whether its decode steps are speculative.
    pub fn is_speculative(&self) -> bool {
        self.draft.is_some()
    }

    /// An empty sequence of up to `capacity` tokens in a paged pool of its own on `model`'s devices, its
    /// decode steps through [`Glm5ForCausalLM::forward_batch_graphed`]: replayed from CUDA graphs where
    /// the model allows, else eager ([`Self::graph_stats`] says why).
    pub fn graphed(model: &Glm5ForCausalLM, capacity: usize) -> Result<Self> {
        let options = PagedCacheOptions {
            num_blocks: capacity.div_ceil(DEFAULT_BLOCK_SIZE).max(1),
            block_size: DEFAULT_BLOCK_SIZE,
        };
        let mut pool = model.new_paged_cache(options)?;
        let seq = pool.add_sequence();
        Ok(Self {
            kv: SequenceKv::Graphed(Box::new(GraphedSequence {
                pool,
                seq,
                graphs: DecodeGraphs::new(GRAPHS_PER_SEQUENCE),
                capacity,
            })),
            draft: None,
            tokens: Vec::new(),
        })
    }

    /// The most tokens it holds.
    pub fn capacity(&self) -> usize {
        match &self.kv {
            SequenceKv::Contiguous(cache) => cache.capacity(),
            SequenceKv::Graphed(g) => g.capacity,
        }
    }

    /// Tokens whose rows it holds.
    pub fn len(&self) -> usize {
        match &self.kv {
            SequenceKv::Contiguous(cache) => cache.len(),
            SequenceKv::Graphed(g) => g.pool.seq_len(g.seq).unwrap_or(0),
        }
    }

    /// Whether it holds no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How its steps ran (a graphed sequence's), `None` for a contiguous one.
    pub fn graph_stats(&self) -> Option<&GraphStats> {
        match &self.kv {
            SequenceKv::Contiguous(_) => None,
            SequenceKv::Graphed(g) => Some(g.graphs.stats()),
        }
    }

    /// Rows a prompt whose first `shared` tokens are `self.tokens`' can keep: those in the cache, and with
    /// a draft, only as far as its state stays whole (its row at `i` read the token at `i + 1`).
    fn reusable(&self, shared: usize) -> usize {
        let rows = shared.min(self.len());
        match &self.draft {
            None => rows,
            Some(draft) => {
                let drafted = draft.cache.len().min(shared.saturating_sub(1));
                // Rows dropped from the draft's cache need the main model's hidden states again.
                rows.min(match drafted < draft.cache.len() {
                    true => drafted,
                    false => drafted + draft.hidden.len(),
                })
            }
        }
    }

    /// Keeps the first `len` rows (the draft's state with them).
    fn truncate(&mut self, len: usize) -> Result<()> {
        match &mut self.kv {
            SequenceKv::Contiguous(cache) => cache.truncate(len),
            SequenceKv::Graphed(g) => g.pool.truncate_sequence(g.seq, len)?,
        }
        self.forget_draft_rows(len);
        Ok(())
    }

    /// Keeps the draft's state of the first `len` positions.
    fn forget_draft_rows(&mut self, len: usize) {
        if let Some(draft) = &mut self.draft {
            if len < draft.cache.len() {
                draft.cache.truncate(len);
                draft.hidden.clear();
            } else {
                draft.hidden.truncate(len - draft.cache.len());
            }
        }
    }

    /// Appends `ids` at `start_pos..` and returns the logits after the last of them, `[vocab]`.
    fn forward_last(
        &mut self,
        model: &Glm5ForCausalLM,
        ids: &[u32],
        start_pos: usize,
    ) -> Result<Tensor> {
        let logits = match &mut self.kv {
            SequenceKv::Contiguous(_) => {
                let logits = self.forward_rows(model, ids, start_pos)?;
                logits.get(logits.dim(0)? - 1)?
            }
            SequenceKv::Graphed(g) => {
                if start_pos + ids.len() > g.capacity {
                    return Err(glm5_models::ModelError::CacheFull {
                        needed: start_pos + ids.len(),
                        capacity: g.capacity,
                    }
                    .into());
                }
                let batch = [SeqChunk {
                    seq: g.seq,
                    tokens: ids,
                    start_pos,
                }];
                model
                    .forward_batch_graphed(&mut g.graphs, &batch, &mut g.pool)?
                    .squeeze(0)?
            }
        };
        Ok(logits)
    }

    /// Appends `ids` at `start_pos..` to a contiguous cache and returns the logits of every one of them,
    /// `[len, vocab]`; with a draft, their hidden states wait for it.
    fn forward_rows(
        &mut self,
        model: &Glm5ForCausalLM,
        ids: &[u32],
        start_pos: usize,
    ) -> Result<Tensor> {
        let SequenceKv::Contiguous(cache) = &mut self.kv else {
            return Err(Error::InvalidParams(
                "speculative decoding needs a contiguous KV cache, not a graphed sequence".into(),
            ));
        };
        let Some(draft) = &mut self.draft else {
            return Ok(model.forward(ids, start_pos, cache)?);
        };
        let (logits, hidden) = model.forward_with_hidden(ids, start_pos, cache)?;
        for row in 0..ids.len() {
            draft.hidden.push(hidden.narrow(0, row, 1)?);
        }
        Ok(logits)
    }

    /// The MTP layer's guess of the token after `tokens`' last (whose own row is not cached yet): its rows
    /// for the waiting hidden states run first, each with the token after its position. `None` without a
    /// draft or a waiting hidden state.
    fn draft(&mut self, model: &Glm5ForCausalLM, tokens: &[u32]) -> Result<Option<u32>> {
        let Some(draft) = &mut self.draft else {
            return Ok(None);
        };
        let start = draft.cache.len();
        let waiting = draft.hidden.len();
        if waiting == 0 || start + waiting >= tokens.len() {
            return Ok(None);
        }
        let hidden = Tensor::cat(&draft.hidden, 0)?;
        let next = &tokens[start + 1..start + waiting + 1];
        let logits = model.forward_mtp(next, &hidden, start, &mut draft.cache)?;
        draft.hidden.clear();
        Ok(Some(argmax(&logits.get(waiting - 1)?)?))
    }
}

/// Decode graphs a graphed sequence keeps (one per block-table width it grows through).
const GRAPHS_PER_SEQUENCE: usize = 8;

/// Streams generated tokens; created by [`crate::Glm5::generate`]. Iterate it, then read
/// [`Generation::finish_reason`] and [`Generation::stats`].
pub struct Generation<'a> {
    model: &'a Glm5ForCausalLM,
    /// The KV rows (its `tokens` unused while generating: they are `self.tokens`).
    cache: SequenceCache,
    tokens: Vec<u32>,
    prompt_len: usize,
    next_logits: Option<Tensor>,
    /// The token the MTP layer drafted for the next position, already run through the model after it, and
    /// the logits that run gave for the position after the draft.
    drafted: Option<(u32, Tensor)>,
    sampler: Sampler,
    stream: TokenStream<'a>,
    stop_ids: Vec<u32>,
    stop_strings: Vec<String>,
    max_new_tokens: usize,
    /// Decoded text not yet handed out because it may begin a stop string.
    held_text: String,
    finish: Option<FinishReason>,
    stats: GenerationStats,
}

impl<'a> Generation<'a> {
    /// Prefills `prompt`, reusing the part of `sequence` that it starts with.
    pub(crate) fn start(
        model: &'a Glm5ForCausalLM,
        sequence: SequenceCache,
        prompt: Vec<u32>,
        params: &GenerationParams,
        stream: TokenStream<'a>,
        eos_ids: &[u32],
    ) -> Result<Self> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let mut cache = sequence;
        let cached = std::mem::take(&mut cache.tokens);
        let limit = cache.capacity();
        if prompt.len() >= limit {
            return Err(Error::PromptTooLong {
                prompt_tokens: prompt.len(),
                limit,
            });
        }
        let started = Instant::now();
        // Reuse the cached prefix shared with the prompt; at least the last prompt token is recomputed.
        let shared = cached
            .iter()
            .zip(&prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let reuse = cache.reusable(shared).min(prompt.len() - 1);
        cache.truncate(reuse)?;
        tracing::debug!(
            prompt_tokens = prompt.len(),
            reused_from_cache = reuse,
            "prefill"
        );
        let last = cache.forward_last(model, &prompt[reuse..], reuse)?;
        let stats = GenerationStats {
            prompt_tokens: prompt.len(),
            prompt_time: started.elapsed(),
            ..Default::default()
        };
        let mut stop_ids = eos_ids.to_vec();
        stop_ids.extend(&params.stop_token_ids);
        Ok(Self {
            model,
            cache,
            prompt_len: prompt.len(),
            tokens: prompt,
            next_logits: Some(last),
            drafted: None,
            sampler: Sampler::new(params),
            stream,
            stop_ids,
            stop_strings: params.stop_strings.clone(),
            max_new_tokens: params.max_new_tokens,
            held_text: String::new(),
            finish: None,
            stats,
        })
    }

    /// Why generation ended (`None` while it is still running).
    pub fn finish_reason(&self) -> Option<&FinishReason> {
        self.finish.as_ref()
    }

    /// Token counts and timings so far.
    pub fn stats(&self) -> &GenerationStats {
        &self.stats
    }

    /// How its decode steps ran where the sequence replays CUDA graphs ([`SequenceCache::graph_stats`]).
    pub fn graph_stats(&self) -> Option<&GraphStats> {
        self.cache.graph_stats()
    }

    /// The generated token ids so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Hands the cache back (holding the prompt and the generated tokens) for a follow-up turn.
    pub fn into_sequence(self) -> SequenceCache {
        let mut cache = self.cache;
        let mut tokens = self.tokens;
        // A draft's row past the last token (generation ended before the draft was checked) goes.
        if let SequenceKv::Contiguous(kv) = &mut cache.kv {
            kv.truncate(tokens.len());
            cache.forget_draft_rows(tokens.len());
        }
        tokens.truncate(cache.len());
        SequenceCache { tokens, ..cache }
    }

    fn step(&mut self) -> Result<Option<GeneratedToken>> {
        let Some(logits) = self.next_logits.take() else {
            return Ok(None);
        };
        if self.generated().len() >= self.max_new_tokens {
            return self.end(FinishReason::MaxTokens);
        }
        let started = Instant::now();
        check_logits(&logits, self.generated().len(), self.tokens.len())?;
        let (id, after_draft) = match self.drafted.take() {
            Some((draft, after)) => {
                let (id, stands) = self.sampler.sample_draft(&logits, &self.tokens, draft)?;
                self.stats.draft_tokens += 1;
                self.stats.accepted_draft_tokens += usize::from(stands);
                (id, Some(after).filter(|_| stands))
            }
            None => (self.sampler.sample(&logits, &self.tokens)?, None),
        };
        if self.stop_ids.contains(&id) {
            self.stats.generation_time += started.elapsed();
            return self.end(FinishReason::EndOfSequence(id));
        }
        self.tokens.push(id);
        self.stats.generated_tokens += 1;
        if let Some(text) = self.stream.push(id)? {
            self.held_text.push_str(&text);
        }
        let text = match take_text_before_stop(&mut self.held_text, &self.stop_strings) {
            Ok(text) => text,
            Err(stop) => {
                self.stats.generation_time += started.elapsed();
                self.finish = Some(FinishReason::StopString(stop.1));
                return Ok(Some(GeneratedToken {
                    id: Some(id),
                    text: stop.0,
                }));
            }
        };
        if self.generated().len() < self.max_new_tokens {
            if let Some(after) = after_draft {
                // The draft stood: its row is cached and the step gave the logits after it.
                self.next_logits = Some(after);
            } else {
                self.decode(id)?;
            }
        } else {
            self.finish = Some(FinishReason::MaxTokens);
        }
        self.stats.generation_time += started.elapsed();
        let text = if self.finish.is_some() {
            text + &self.flush()?
        } else {
            text
        };
        Ok(Some(GeneratedToken { id: Some(id), text }))
    }

    /// Runs the newest token `id` (position `tokens.len() - 1`; a rejected draft's row after it dropped),
    /// with the MTP layer's draft after it where the sequence has one and room for both.
    fn decode(&mut self, id: u32) -> Result<()> {
        let position = self.tokens.len() - 1;
        if self.cache.len() > position {
            self.cache.truncate(position)?;
        }
        if position + 1 > self.cache.capacity() {
            self.finish = Some(FinishReason::ContextFull);
            return Ok(());
        }
        let room = position + 2 <= self.cache.capacity()
            && self.generated().len() + 1 < self.max_new_tokens;
        let draft = match room {
            true => self.cache.draft(self.model, &self.tokens)?,
            false => None,
        };
        match draft {
            Some(draft) => {
                let logits = self
                    .cache
                    .forward_rows(self.model, &[id, draft], position)?;
                self.next_logits = Some(logits.get(0)?);
                self.drafted = Some((draft, logits.get(1)?));
            }
            None => {
                self.next_logits = Some(self.cache.forward_last(self.model, &[id], position)?);
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<String> {
        let mut rest = std::mem::take(&mut self.held_text);
        if let Some(tail) = self.stream.finish()? {
            rest.push_str(&tail);
        }
        Ok(rest)
    }

    fn end(&mut self, reason: FinishReason) -> Result<Option<GeneratedToken>> {
        self.finish = Some(reason);
        let rest = self.flush()?;
        Ok((!rest.is_empty()).then_some(GeneratedToken {
            id: None,
            text: rest,
        }))
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<GeneratedToken>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finish.is_some() && self.next_logits.is_none() {
            return None;
        }
        self.step().transpose()
    }
}

/// Refuses logits `[vocab]` with a NaN or without a finite maximum (every sampler, greedy included, would
/// pick a meaningless token from them). One scalar comes back when the logits' sum is finite (then every
/// logit is), two more otherwise (some logits may be -inf where the maximum is finite: that passes).
pub fn check_logits(logits: &Tensor, step: usize, position: usize) -> Result<()> {
    let logits = logits.to_dtype(DType::F32)?;
    if logits.sum_all()?.to_scalar::<f32>()?.is_finite() {
        return Ok(());
    }
    let nan = logits.ne(&logits)?.max_all()?.to_scalar::<u8>()? != 0;
    let max = logits.max_all()?.to_scalar::<f32>()?;
    let what = if nan {
        "NaN"
    } else if max == f32::INFINITY {
        "+inf"
    } else if max == f32::NEG_INFINITY {
        "only -inf"
    } else {
        return Ok(());
    };
    Err(Error::NonFiniteLogits {
        what,
        step,
        position,
    })
}

/// Text that can be handed out: everything but a tail that may still grow into a stop string.
/// `Err((text before the stop string, the stop string))` once one is complete. Shared by [`Generation`] and
/// the server's scheduler.
pub(crate) fn take_text_before_stop(
    held: &mut String,
    stops: &[String],
) -> std::result::Result<String, (String, String)> {
    if let Some((at, stop)) = stops
        .iter()
        .filter_map(|s| held.find(s.as_str()).map(|at| (at, s.clone())))
        .min_by_key(|(at, _)| *at)
    {
        return Err((held[..at].to_string(), stop));
    }
    let keep = stops
        .iter()
        .flat_map(|s| s.char_indices().skip(1).map(|(i, _)| &s[..i]))
        .filter(|prefix| held.ends_with(prefix))
        .map(str::len)
        .max()
        .unwrap_or(0);
    let ready = held.len() - keep;
    Ok(held.drain(..ready).collect())
}

/// The argmax of `logits` `[vocab]` (what greedy sampling must return).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(argmax_rows(logits)?.to_scalar::<u32>()?)
}

/// Each row's argmax of `logits` `[.., vocab]`, on their device (`glm5_ops::argmax`: one launch on CUDA).
pub(crate) fn argmax_rows(logits: &Tensor) -> Result<Tensor> {
    Ok(crate::ops::argmax::argmax(logits).map_err(glm5_models::ModelError::from)?)
}
