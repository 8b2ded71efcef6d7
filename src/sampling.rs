//! Picking next tokens from logits: repetition penalty, then temperature / top-k / top-p / min-p.
//!
//! The rules and their random draws are candle-transformers' `LogitsProcessor`'s, token for token for the
//! same seed (the tests compare them). What it lacks is why this is written here:
//! - Its top-p sorts the whole vocabulary for every token (GLM-5's 154,880 entries: milliseconds a token,
//!   the order of a whole decode step). Here only the candidates above a threshold are sorted, by a radix
//!   sort, the threshold lowered until the walk over them decides: the same tokens kept, in O(vocabulary).
//! - It reads one sequence's logits back at a time. [`sample_rows`] takes one step's logits of many
//!   sequences and reads them back once for the greedy rows and once for the sampled ones.
//! - Speculative decoding: [`Sampler::sample_draft`] decides whether a drafted token stands, keeping the
//!   distribution of the tokens exactly that of [`Sampler::sample`].

use candle_core::{DType, Tensor, D};
use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::generate::{argmax, argmax_rows, GenerationParams};

/// How the next token is drawn from the probabilities (after min-p), as `LogitsProcessor`'s `Sampling`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Rule {
    Greedy,
    All,
    TopK(usize),
    TopP(f32),
    TopKThenTopP(usize, f32),
}

/// Picks one sequence's next tokens: see the module.
pub struct Sampler {
    rule: Rule,
    temperature: f64,
    min_p: Option<f64>,
    repetition_penalty: f32,
    repeat_last_n: usize,
    presence_penalty: f32,
    frequency_penalty: f32,
    /// How often each token was generated, while a presence or frequency penalty needs it.
    generated: std::collections::HashMap<u32, u32>,
    rng: StdRng,
}

impl Sampler {
    /// A sampler for `params` (its seed starts the random generator).
    pub fn new(params: &GenerationParams) -> Self {
        let temperature = params.temperature;
        let rule = match (temperature > 0.0, params.top_k, params.top_p) {
            (false, _, _) => Rule::Greedy,
            (true, None, None) => Rule::All,
            (true, Some(k), None) => Rule::TopK(k),
            (true, None, Some(p)) => Rule::TopP(p as f32),
            (true, Some(k), Some(p)) => Rule::TopKThenTopP(k, p as f32),
        };
        // LogitsProcessor's TopP samples from everything where p is outside (0, 1); the top-k variant
        // walks whatever p it is given.
        let rule = match rule {
            Rule::TopP(p) if !(p > 0.0 && p < 1.0) => Rule::All,
            rule => rule,
        };
        Self {
            rule,
            temperature,
            min_p: params.min_p.filter(|_| temperature > 0.0),
            repetition_penalty: params.repetition_penalty,
            repeat_last_n: params.repeat_last_n,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            generated: std::collections::HashMap::new(),
            rng: StdRng::seed_from_u64(params.seed),
        }
    }

    fn penalises(&self) -> bool {
        self.repetition_penalty != 1.0 || self.counts_generated()
    }

    fn counts_generated(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// `token`, counted as generated where a presence or frequency penalty needs the counts.
    fn emit(&mut self, token: u32) -> u32 {
        if self.counts_generated() {
            *self.generated.entry(token).or_insert(0) += 1;
        }
        token
    }

    /// The next token given `logits` `[vocab]` and the tokens so far.
    pub fn sample(&mut self, logits: &Tensor, history: &[u32]) -> Result<u32> {
        let logits = self.penalised(logits, history)?;
        if self.rule == Rule::Greedy {
            let token = argmax(&logits)?;
            return Ok(self.emit(token));
        }
        let mut probs =
            candle_nn::ops::softmax_last_dim(&(logits / self.temperature)?)?.to_vec1::<f32>()?;
        let token = self.pick(&mut probs)?;
        Ok(self.emit(token))
    }

    /// The next token where speculative decoding drafted `draft` (its drafter chose it without sampling):
    /// `(token, whether it is the draft)`. Greedy: the argmax, the draft standing where it is that. Sampled:
    /// the draft stands with its probability `q` under this sampler's rules (temperature, min-p, top-k,
    /// top-p), else a token is drawn from the others in proportion to theirs. Each token `t` so comes out
    /// with probability `q` (`t` the draft) or `(1 - q) · p_t / (1 - q) = p_t`: the distribution
    /// [`Self::sample`] draws from (not its draws: the random stream is used differently).
    pub fn sample_draft(
        &mut self,
        logits: &Tensor,
        history: &[u32],
        draft: u32,
    ) -> Result<(u32, bool)> {
        let vocab = logits.dim(D::Minus1)?;
        if draft as usize >= vocab {
            return Err(Error::Sampling(format!(
                "draft token {draft} is outside the vocabulary of {vocab}"
            )));
        }
        let logits = self.penalised(logits, history)?;
        if self.rule == Rule::Greedy {
            let id = self.emit(argmax(&logits)?);
            return Ok((id, id == draft));
        }
        let mut weights =
            candle_nn::ops::softmax_last_dim(&(logits / self.temperature)?)?.to_vec1::<f32>()?;
        self.keep_candidates(&mut weights);
        let draft_weight = weights[draft as usize];
        let total: f64 = weights.iter().map(|&w| w as f64).sum();
        // NaN probabilities sum to NaN, which fails this too.
        if total.is_nan() || total <= 0.0 {
            return Err(Error::Sampling(format!(
                "no token has a positive probability (sum {total})"
            )));
        }
        if self.rng.random::<f64>() < draft_weight as f64 / total {
            return Ok((self.emit(draft), true));
        }
        weights[draft as usize] = 0.0;
        let token = self.multinomial(&weights)?;
        Ok((self.emit(token), false))
    }

    /// `logits` in f32 with the repetition penalty over the recent `history` applied, then the presence and
    /// frequency penalties over the generated tokens (OpenAI's: `logit − count · frequency − presence` for
    /// every token generated `count` > 0 times).
    fn penalised(&self, logits: &Tensor, history: &[u32]) -> Result<Tensor> {
        let logits = if self.repetition_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(self.repeat_last_n)..];
            candle_transformers::utils::apply_repeat_penalty(
                logits,
                self.repetition_penalty,
                recent,
            )?
        } else {
            logits.clone()
        };
        let logits = logits.to_dtype(DType::F32)?;
        if self.generated.is_empty() {
            return Ok(logits);
        }
        let vocab = logits.dim(D::Minus1)?;
        let (ids, penalties): (Vec<u32>, Vec<f32>) = self
            .generated
            .iter()
            .filter(|(&id, _)| (id as usize) < vocab)
            .map(|(&id, &count)| {
                (
                    id,
                    -(count as f32 * self.frequency_penalty + self.presence_penalty),
                )
            })
            .unzip();
        let device = logits.device();
        let ids = Tensor::from_vec(ids, penalties.len(), device)?;
        let penalties = Tensor::from_vec(penalties, ids.dims1()?, device)?;
        Ok(logits.index_add(&ids, &penalties, 0)?)
    }

    /// Zeroes the probabilities [`Self::pick`] never draws (min-p, then the rule's top-k / top-p), leaving
    /// the weights it draws the rest with.
    fn keep_candidates(&self, probs: &mut [f32]) {
        if let Some(min_p) = self.min_p {
            apply_min_p(probs, min_p);
        }
        let keep_only = |probs: &mut [f32], kept: &[usize], weights: &[f32]| {
            probs.iter_mut().for_each(|p| *p = 0.0);
            for (&i, &w) in kept.iter().zip(weights) {
                probs[i] = w;
            }
        };
        match self.rule {
            Rule::Greedy | Rule::All => {}
            Rule::TopP(p) => keep_top_p(probs, p),
            Rule::TopK(k) | Rule::TopKThenTopP(k, _) if k >= probs.len() => {
                if let Rule::TopKThenTopP(_, p) = self.rule {
                    keep_top_p(probs, p)
                }
            }
            Rule::TopK(k) => {
                let (indices, weights) = largest(probs, k);
                keep_only(probs, &indices, &weights);
            }
            Rule::TopKThenTopP(k, p) => {
                let (indices, mut weights) = largest(probs, k);
                let sum: f32 = weights.iter().sum();
                if p > 0.0 && p < sum {
                    keep_top_p(&mut weights, p);
                }
                keep_only(probs, &indices, &weights);
            }
        }
    }

    /// The next token from the softmax of the (penalised) logits over the temperature.
    fn pick(&mut self, probs: &mut [f32]) -> Result<u32> {
        if let Some(min_p) = self.min_p {
            apply_min_p(probs, min_p);
        }
        match self.rule {
            Rule::Greedy => unreachable!("greedy rows are picked by argmax"),
            Rule::All => self.multinomial(probs),
            Rule::TopP(p) => self.top_p(probs, p),
            Rule::TopK(k) if k >= probs.len() => self.multinomial(probs),
            Rule::TopKThenTopP(k, p) if k >= probs.len() => self.top_p(probs, p),
            Rule::TopK(k) => {
                let (indices, weights) = largest(probs, k);
                Ok(indices[self.multinomial(&weights)? as usize] as u32)
            }
            Rule::TopKThenTopP(k, p) => {
                let (indices, mut weights) = largest(probs, k);
                let sum: f32 = weights.iter().sum();
                let index = if p <= 0.0 || p >= sum {
                    self.multinomial(&weights)?
                } else {
                    self.top_p(&mut weights, p)?
                };
                Ok(indices[index as usize] as u32)
            }
        }
    }

    /// One draw of an index with probability proportional to its weight.
    fn multinomial(&mut self, weights: &[f32]) -> Result<u32> {
        let distribution = WeightedIndex::new(weights)
            .map_err(|e| Error::Sampling(format!("cannot sample these probabilities: {e}")))?;
        Ok(distribution.sample(&mut self.rng) as u32)
    }

    /// Nucleus sampling: [`keep_top_p`], then one draw over the kept tokens. Drawing over them alone (in
    /// index order) gives the draw over the whole vector with the rest zeroed: the running sums at the kept
    /// tokens are the same f32 values, since adding a zero changes none.
    fn top_p(&mut self, probs: &mut [f32], p: f32) -> Result<u32> {
        keep_top_p(probs, p);
        let kept: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] != 0.0).collect();
        if kept.is_empty() {
            return self.multinomial(probs); // its error: nothing to sample
        }
        let weights: Vec<f32> = kept.iter().map(|&i| probs[i]).collect();
        Ok(kept[self.multinomial(&weights)? as usize] as u32)
    }
}

/// The `k` largest probabilities and their indices, in `select_nth_unstable_by`'s order (as
/// `LogitsProcessor`'s top-k takes them, so that a draw over them picks the same token).
fn largest(probs: &[f32], k: usize) -> (Vec<usize>, Vec<f32>) {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    let (indices, _, _) = order.select_nth_unstable_by(k, |&i, &j| probs[j].total_cmp(&probs[i]));
    let weights = indices.iter().map(|&i| probs[i]).collect();
    (indices.to_vec(), weights)
}

/// Zeroes what `LogitsProcessor`'s top-p zeroes: walking the probabilities from the largest (equal ones in
/// index order), each is kept while the sum of those before it is below `top_p`. Only the candidates at or
/// above a threshold (a fraction of the largest probability) are sorted; when the walk runs past them
/// without reaching `top_p`, the threshold is lowered, down to zero (the whole vector).
pub fn keep_top_p(probs: &mut [f32], top_p: f32) {
    let largest = probs.iter().copied().max_by(f32::total_cmp).unwrap_or(0.0);
    for shift in [8, 16, 32, 64, i32::MAX] {
        let threshold = if shift == i32::MAX {
            0.0
        } else {
            largest * 2f32.powi(-shift)
        };
        let candidates = descending(probs, |p| p.total_cmp(&threshold).is_ge());
        let mut sum = 0.0f32;
        let mut kept = None;
        for (n, &i) in candidates.iter().enumerate() {
            if sum >= top_p {
                kept = Some(n);
                break;
            }
            sum += probs[i as usize];
        }
        // The walk over every candidate ended at or above top_p: the next (smaller) one would be dropped.
        if kept.is_none() && sum >= top_p {
            kept = Some(candidates.len());
        }
        let Some(kept) = kept.or((threshold == 0.0).then_some(candidates.len())) else {
            continue;
        };
        // The kept ones are exactly those ordered before the last kept one (value, then index).
        let Some(&last) = kept.checked_sub(1).map(|n| &candidates[n]) else {
            probs.iter_mut().for_each(|p| *p = 0.0);
            return;
        };
        let (last, last_value) = (last as usize, probs[last as usize]);
        for (i, p) in probs.iter_mut().enumerate() {
            let keep = match p.total_cmp(&last_value) {
                std::cmp::Ordering::Greater => true,
                std::cmp::Ordering::Equal => i <= last,
                std::cmp::Ordering::Less => false,
            };
            if !keep {
                *p = 0.0;
            }
        }
        return;
    }
}

/// The indices of the `probs` that `keep` keeps, largest first, equal ones in index order: the order of a
/// stable sort by `total_cmp`, by a radix sort (three passes of 11 bits over a key that orders as
/// `total_cmp` does). GLM-5's flat distributions keep most of its 154,880 entries, which a comparison
/// sort took milliseconds a token over.
fn descending(probs: &[f32], keep: impl Fn(f32) -> bool) -> Vec<u32> {
    // total_cmp's order as unsigned integers: negative values' magnitude bits flipped, the sign bit set
    // for non-negative ones; then complemented for largest first.
    let key = |p: f32| {
        let bits = p.to_bits();
        let ordered = if bits >> 31 == 1 {
            !bits
        } else {
            bits | 1 << 31
        };
        !ordered
    };
    let mut items: Vec<(u32, u32)> = probs
        .iter()
        .enumerate()
        .filter(|(_, &p)| keep(p))
        .map(|(i, &p)| (key(p), i as u32))
        .collect();
    let mut spare = vec![(0u32, 0u32); items.len()];
    const DIGIT: u32 = 11;
    for pass in 0..3 {
        let shift = pass * DIGIT;
        let digit = |k: u32| ((k >> shift) & ((1 << DIGIT) - 1)) as usize;
        let mut starts = vec![0usize; 1 << DIGIT];
        for &(k, _) in &items {
            starts[digit(k)] += 1;
        }
        let mut next = 0;
        for start in starts.iter_mut() {
            let count = *start;
            *start = next;
            next += count;
        }
        // In input order within a digit: stable, so index order survives among equal keys.
        for &item in &items {
            let d = digit(item.0);
            spare[starts[d]] = item;
            starts[d] += 1;
        }
        std::mem::swap(&mut items, &mut spare);
    }
    items.into_iter().map(|(_, i)| i).collect()
}

/// Zeroes every probability below `min_p` times the largest one.
pub fn apply_min_p(probs: &mut [f32], min_p: f64) {
    let max = probs.iter().copied().fold(0.0f32, f32::max);
    let threshold = (max as f64 * min_p) as f32;
    probs
        .iter_mut()
        .filter(|p| **p < threshold)
        .for_each(|p| *p = 0.0);
}

/// The next tokens of several sequences from one step's `logits` `[batch, vocab]`: `samplers[j]` after
/// `histories[j]` from row `rows[j]`. The same tokens as [`Sampler::sample`] row by row, but the greedy rows'
/// argmax and the sampled rows' probabilities each come back in one read (rows with a repetition penalty
/// still go one at a time). The outer error is a failed read of the step; a row that cannot be sampled (NaN
/// probabilities) fails alone.
pub fn sample_rows(
    samplers: &mut [&mut Sampler],
    logits: &Tensor,
    rows: &[usize],
    histories: &[&[u32]],
) -> Result<Vec<Result<u32>>> {
    let batch = logits.dim(0)?;
    if samplers.len() != rows.len() || histories.len() != rows.len() {
        return Err(Error::Sampling(format!(
            "{} rows for {} samplers and {} histories",
            rows.len(),
            samplers.len(),
            histories.len()
        )));
    }
    if let Some(&row) = rows.iter().find(|&&row| row >= batch) {
        return Err(Error::Sampling(format!(
            "row {row} of a step of {batch} rows"
        )));
    }
    let mut ids: Vec<Result<u32>> = rows.iter().map(|_| Ok(0)).collect();
    // Indices into `samplers` (and `ids`), by how they sample.
    let (mut greedy, mut sampled) = (Vec::new(), Vec::new());
    for (r, sampler) in samplers.iter_mut().enumerate() {
        if sampler.penalises() {
            ids[r] = sampler.sample(&logits.get(rows[r])?, histories[r]);
        } else if sampler.rule == Rule::Greedy {
            greedy.push(r);
        } else {
            sampled.push(r);
        }
    }
    // The logits rows of `picked`, selected on the device unless they are the whole step in order.
    let select = |picked: &[usize]| -> Result<Tensor> {
        let in_order =
            picked.len() == batch && picked.iter().enumerate().all(|(j, &r)| rows[r] == j);
        let logits = if in_order {
            logits.clone()
        } else {
            let index: Vec<u32> = picked.iter().map(|&r| rows[r] as u32).collect();
            logits.index_select(&Tensor::new(index.as_slice(), logits.device())?, 0)?
        };
        Ok(logits.to_dtype(DType::F32)?)
    };
    if !greedy.is_empty() {
        let picked = argmax_rows(&select(&greedy)?)?.to_vec1::<u32>()?;
        for (&r, id) in greedy.iter().zip(picked) {
            ids[r] = Ok(id);
        }
    }
    if !sampled.is_empty() {
        // Each row over its own temperature, as `logits / temperature` (one f32 product per value).
        let inverse: Vec<f32> = sampled
            .iter()
            .map(|&r| (1.0 / samplers[r].temperature) as f32)
            .collect();
        let inverse = Tensor::from_vec(inverse, (sampled.len(), 1), logits.device())?;
        let scaled = select(&sampled)?.broadcast_mul(&inverse)?;
        let vocab = scaled.dim(1)?;
        let mut probs = candle_nn::ops::softmax_last_dim(&scaled)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        // Each sampled row with its sampler and its id's slot, in `sampled`'s (ascending) order.
        let mut jobs: Vec<(&mut Sampler, &mut [f32], &mut Result<u32>)> = samplers
            .iter_mut()
            .zip(ids.iter_mut())
            .enumerate()
            .filter(|(r, _)| sampled.binary_search(r).is_ok())
            .zip(probs.chunks_mut(vocab))
            .map(|((_, (sampler, id)), row)| (&mut **sampler, row, id))
            .collect();
        // Rows over the CPU's threads: a flat distribution's nucleus is most of the vocabulary, a
        // millisecond or more a row.
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(jobs.len());
        let pick_all = |chunk: &mut [(&mut Sampler, &mut [f32], &mut Result<u32>)]| {
            for (sampler, row, id) in chunk.iter_mut() {
                **id = sampler.pick(row);
            }
        };
        if threads <= 1 {
            pick_all(&mut jobs);
        } else {
            let per_thread = jobs.len().div_ceil(threads);
            std::thread::scope(|scope| {
                for chunk in jobs.chunks_mut(per_thread) {
                    scope.spawn(move || pick_all(chunk));
                }
            });
        }
    }
    Ok(ids)
}
