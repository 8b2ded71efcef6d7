//! Token generation: sampling settings, the sampler, stop conditions and the streaming token iterator.
//!
//! Prefill runs the whole prompt once; every decode step runs one token through the KV cache. Each step
//! yields the newly completed text (never half a UTF-8 character), holding back text that could still
//! become a stop string.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor, D};

use crate::error::{Error, Result};
use crate::models::{PagedCacheOptions, PagedKvCache, SeqChunk, SeqId, DEFAULT_BLOCK_SIZE};
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
    /// The tokens whose rows it holds, in order.
    pub tokens: Vec<u32>,
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
            tokens: Vec::new(),
        }
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

    /// Keeps the first `len` rows.
    fn truncate(&mut self, len: usize) -> Result<()> {
        match &mut self.kv {
            SequenceKv::Contiguous(cache) => cache.truncate(len),
            SequenceKv::Graphed(g) => g.pool.truncate_sequence(g.seq, len)?,
        }
        Ok(())
    }

    /// Appends `ids` at `start_pos..` and returns the logits after the last of them, `[vocab]`.
    fn forward_last(
        &mut self,
        model: &Glm5ForCausalLM,
        ids: &[u32],
        start_pos: usize,
    ) -> Result<Tensor> {
        let logits = match &mut self.kv {
            SequenceKv::Contiguous(cache) => {
                let logits = model.forward(ids, start_pos, cache)?;
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
        let reuse = shared.min(cache.len()).min(prompt.len() - 1);
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

    /// The generated token ids so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Hands the cache back (holding the prompt and the generated tokens) for a follow-up turn.
    pub fn into_sequence(self) -> SequenceCache {
        let cached = self.cache.len();
        let mut tokens = self.tokens;
        tokens.truncate(cached);
        SequenceCache {
            tokens,
            ..self.cache
        }
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
        let id = self.sampler.sample(&logits, &self.tokens)?;
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
            if self.cache.len() + 1 > self.cache.capacity() {
                self.finish = Some(FinishReason::ContextFull);
            } else {
                let logits = self
                    .cache
                    .forward_last(self.model, &[id], self.tokens.len() - 1)?;
                self.next_logits = Some(logits);
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
/// pick a meaningless token from them). Two reductions on the logits' device; one scalar each comes back.
pub fn check_logits(logits: &Tensor, step: usize, position: usize) -> Result<()> {
    let logits = logits.to_dtype(DType::F32)?;
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
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}
