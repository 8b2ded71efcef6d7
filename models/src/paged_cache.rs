//! The paged KV pool: the caches of many sequences in fixed-size blocks, for batched forwards
//! ([`crate::Glm5ForCausalLM::forward_batch`]).
//!
//! Per layer, two block stores share one layout, `[num_blocks, block_size, ..]`:
//! - latent rows `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (`[c | k_pe]`, as in
//!   [`crate::KvCache`]);
//! - indexer keys `[num_blocks, block_size, index_head_dim]` in the model's dtype, or FP8 e4m3 bytes with
//!   scales `[num_blocks, block_size]` (quantised as they are written).
//!
//! Every sequence has ONE block table, shared by all layers and both stores: position `s` of a sequence is
//! row `s % block_size` of block `table[s / block_size]` everywhere. Blocks come from one free list as a
//! sequence grows (a block is taken when its first row is written) and go back when the last sequence
//! holding them is freed or truncated. A sequence may start as a [`PagedKvCache::fork`] of another's prefix:
//! it holds the same full blocks (counted per block), and since a sequence only writes past its length and a
//! shared block is full, no row of a shared block is ever written again (a truncation that would end inside
//! a shared block ends at its start instead). Asking for more blocks than are free is a [`ModelError::PoolExhausted`] error that
//! changes nothing; the caller decides what to free (a server preempts a sequence and recomputes it later).
//!
//! The stores are allocated once, for `num_blocks` blocks, when the pool is made
//! ([`crate::Glm5ForCausalLM::new_paged_cache`]).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use glm5_ops::cache_rows::CacheRows;
use glm5_ops::{IndexKeys, KeyFormat};

use crate::cache::{AttentionRows, LatentRows};
use crate::config::Config;
use crate::error::{ModelError, Result};

/// Tokens per block unless the caller says otherwise: GLM-5's page size, the tile of the CUDA indexer's
/// FP8 key copies (a page that is a multiple of it is copied by whole tiles).
pub const DEFAULT_BLOCK_SIZE: usize = 64;

/// A sequence of a [`PagedKvCache`] (ids are never reused within a pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(u64);

impl SeqId {
    /// The number behind the id (for logs).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The size of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedCacheOptions {
    /// Blocks in the pool (every layer has this many of each store).
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
}

impl PagedCacheOptions {
    /// Blocks of [`DEFAULT_BLOCK_SIZE`] tokens holding at least `tokens` tokens.
    pub fn for_tokens(tokens: usize) -> Self {
        Self {
            num_blocks: tokens.div_ceil(DEFAULT_BLOCK_SIZE),
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }

    /// Tokens the pool holds.
    pub fn tokens(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }
}

/// One sequence's part of a batched forward: `tokens` (a prompt chunk, or one decode token) at positions
/// `start_pos..`, where `start_pos` is what the pool holds of `seq`.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub start_pos: usize,
}

/// A layer's indexer key blocks, in the pool's key format.
enum PagedKeyStore {
    Float(Tensor),
    Fp8 { bytes: Tensor, scales: Tensor },
}

/// One layer's blocks.
pub(crate) struct PagedLayer {
    /// `[num_blocks, block_size, latent_dim]`.
    latent: Tensor,
    keys: PagedKeyStore,
}

impl PagedLayer {
    /// Latent blocks `[num_blocks, block_size, latent_dim]`.
    pub(crate) fn latent(&self) -> &Tensor {
        &self.latent
    }

    /// Indexer key blocks as the paged indexer reads them.
    pub(crate) fn index_keys(&self) -> IndexKeys<'_> {
        match &self.keys {
            PagedKeyStore::Float(keys) => IndexKeys::Float(keys),
            PagedKeyStore::Fp8 { bytes, scales } => IndexKeys::Fp8 { bytes, scales },
        }
    }

    /// Computes the latent rows of `kv_a`'s tokens (`glm5_ops::latent_rows`) into physical rows `rows`
    /// (`U32 [T]`).
    pub(crate) fn write_latent(
        &self,
        kv_a: &Tensor,
        latent: LatentRows<'_>,
        rows: &Tensor,
    ) -> Result<()> {
        let dims = self.latent.dims();
        let flat = self.latent.reshape((dims[0] * dims[1], dims[2]))?;
        latent.write(kv_a, &flat, CacheRows::At(rows))
    }

    /// Writes the call's latent rows and indexer keys into physical rows `rows` (`U32 [T]`; see
    /// [`AttentionRows`]) and returns the rotated indexer query.
    pub(crate) fn write_rows(
        &self,
        attention: &AttentionRows<'_>,
        rows: &Tensor,
    ) -> Result<Tensor> {
        // The blocks viewed as rows: [blocks · block_size, W] latent rows and keys (and
        // [blocks · block_size] scales).
        let as_rows = |t: &Tensor| -> Result<Tensor> {
            let dims = t.dims();
            let slots = dims[0] * dims[1];
            Ok(match dims.len() {
                2 => t.reshape(slots)?,
                _ => t.reshape((slots, dims[2]))?,
            })
        };
        let latent = as_rows(&self.latent)?;
        let (first, second);
        let store = match &self.keys {
            PagedKeyStore::Float(store) => {
                first = as_rows(store)?;
                IndexKeys::Float(&first)
            }
            PagedKeyStore::Fp8 { bytes, scales } => {
                first = as_rows(bytes)?;
                second = as_rows(scales)?;
                IndexKeys::Fp8 {
                    bytes: &first,
                    scales: &second,
                }
            }
        };
        attention.write(&latent, store, CacheRows::At(rows))
    }
}

/// A sequence's blocks and length.
#[derive(Debug, Default)]
struct SeqBlocks {
    blocks: Vec<u32>,
    len: usize,
}

/// Where a batch's tokens go and what each of them sees (made by [`PagedKvCache::begin_step`], host side).
pub(crate) struct StepLayout {
    /// Sequences in the batch (`B`).
    pub batch: usize,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// `[B, max_blocks]` row-major: each entry's blocks after the step, padded with block 0 (never read:
    /// every position a query reads is below its sequence's length).
    pub block_table: Vec<i32>,
    /// `[B]`: tokens each sequence holds after the step.
    pub seq_lens: Vec<i32>,
    /// `[T]`: the batch entry of every token.
    pub token_seq: Vec<i32>,
    /// `[T]`: every token's position in its sequence.
    pub positions: Vec<usize>,
    /// `[T]`: the row of the flattened blocks `[num_blocks · block_size]` every token's KV is written to.
    pub write_rows: Vec<u32>,
    /// `[B]`: the index of each entry's last token among the batch's `T`.
    pub last_tokens: Vec<u32>,
    /// Per entry: its sequence, and its block count before the step (for a rollback).
    before: Vec<(SeqId, usize)>,
}

/// The KV cache of many sequences, in blocks (module docs). Create it with
/// [`crate::Glm5ForCausalLM::new_paged_cache`].
pub struct PagedKvCache {
    pub(crate) layers: Vec<PagedLayer>,
    block_size: usize,
    num_blocks: usize,
    /// Free blocks; the next one taken is the last.
    free: Vec<u32>,
    /// Per block, the sequences holding it (0 for a free block).
    holders: Vec<u32>,
    seqs: BTreeMap<SeqId, SeqBlocks>,
    next_id: u64,
}

impl PagedKvCache {
    /// Layer `l`'s blocks live on `layer_devices[l]` (the plan's placement).
    pub(crate) fn new(
        config: &Config,
        options: PagedCacheOptions,
        dtype: DType,
        key_format: KeyFormat,
        layer_devices: &[&Device],
    ) -> Result<Self> {
        let PagedCacheOptions {
            num_blocks,
            block_size,
        } = options;
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::PagedCache(format!(
                "{num_blocks} blocks of {block_size} tokens: both must be at least 1"
            )));
        }
        // The kernels address rows of the flattened blocks, and positions, with 32-bit signed integers.
        if num_blocks
            .checked_mul(block_size)
            .is_none_or(|rows| rows > i32::MAX as usize)
        {
            return Err(ModelError::PagedCache(format!(
                "{num_blocks} blocks of {block_size} tokens exceed the {} rows the kernels can address",
                i32::MAX
            )));
        }
        if layer_devices.len() != config.num_hidden_layers {
            return Err(ModelError::CacheShape(format!(
                "{} layer devices for {} layers",
                layer_devices.len(),
                config.num_hidden_layers
            )));
        }
        let layers = layer_devices
            .iter()
            .map(|&device| {
                let rows = (num_blocks, block_size);
                let keys = match key_format {
                    KeyFormat::Float => PagedKeyStore::Float(Tensor::zeros(
                        (num_blocks, block_size, config.index_head_dim),
                        dtype,
                        device,
                    )?),
                    KeyFormat::Fp8E4m3 => PagedKeyStore::Fp8 {
                        bytes: Tensor::zeros(
                            (num_blocks, block_size, config.index_head_dim),
                            DType::U8,
                            device,
                        )?,
                        scales: Tensor::zeros(rows, DType::F32, device)?,
                    },
                };
                Ok(PagedLayer {
                    latent: Tensor::zeros(
                        (num_blocks, block_size, config.latent_dim()),
                        dtype,
                        device,
                    )?,
                    keys,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            block_size,
            num_blocks,
            free: (0..num_blocks as u32).rev().collect(),
            holders: vec![0; num_blocks],
            seqs: BTreeMap::new(),
            next_id: 0,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by sequences (a shared block once).
    pub fn blocks_in_use(&self) -> usize {
        self.num_blocks - self.free.len()
    }

    /// Blocks the sequences `seqs` hold, a block two of them share once (unknown ids hold none).
    pub fn distinct_blocks(&self, seqs: impl IntoIterator<Item = SeqId>) -> usize {
        let mut blocks: Vec<u32> = seqs
            .into_iter()
            .filter_map(|seq| self.seqs.get(&seq))
            .flat_map(|s| s.blocks.iter().copied())
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        blocks.len()
    }

    /// Blocks of `seq` that no other sequence holds: what freeing it gives back.
    pub fn exclusive_blocks(&self, seq: SeqId) -> Result<usize> {
        Ok(self
            .get(seq)?
            .blocks
            .iter()
            .filter(|&&b| self.holders[b as usize] == 1)
            .count())
    }

    /// A new sequence holding the whole blocks of `from`'s first `len` tokens (at most its length), shared
    /// with it: the new sequence's length is those blocks' tokens, a multiple of the block size, and its
    /// forwards continue from there.
    pub fn fork(&mut self, from: SeqId, len: usize) -> Result<SeqId> {
        let source = self.get(from)?;
        let whole = len.min(source.len) / self.block_size;
        let blocks = source.blocks[..whole].to_vec();
        for &b in &blocks {
            self.holders[b as usize] += 1;
        }
        let id = self.add_sequence();
        let s = self.seqs.get_mut(&id).expect("just added");
        s.len = whole * self.block_size;
        s.blocks = blocks;
        Ok(id)
    }

    /// `blocks` given up by one holder: each goes back to the free list when it was the last.
    fn release(&mut self, blocks: Vec<u32>) {
        for b in blocks.into_iter().rev() {
            let holders = &mut self.holders[b as usize];
            *holders -= 1;
            if *holders == 0 {
                self.free.push(b);
            }
        }
    }

    /// Blocks that `tokens` tokens occupy.
    pub fn blocks_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Sequences in the pool.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// A new, empty sequence (it holds no block until its first forward).
    pub fn add_sequence(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, SeqBlocks::default());
        id
    }

    fn get(&self, seq: SeqId) -> Result<&SeqBlocks> {
        self.seqs
            .get(&seq)
            .ok_or(ModelError::UnknownSequence { seq: seq.get() })
    }

    /// Tokens cached for `seq` (its next forward's `start_pos`).
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.get(seq)?.len)
    }

    /// Blocks `seq` holds.
    pub fn seq_blocks(&self, seq: SeqId) -> Result<usize> {
        Ok(self.get(seq)?.blocks.len())
    }

    /// Blocks `seq` must take to append `new_tokens` tokens.
    pub fn blocks_to_append(&self, seq: SeqId, new_tokens: usize) -> Result<usize> {
        let s = self.get(seq)?;
        Ok(self
            .blocks_for_tokens(s.len + new_tokens)
            .saturating_sub(s.blocks.len()))
    }

    /// Ends `seq`: it gives up its blocks (those no other sequence holds go back to the pool). Returns how
    /// many it held.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<usize> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(ModelError::UnknownSequence { seq: seq.get() })?;
        let n = s.blocks.len();
        self.release(s.blocks);
        Ok(n)
    }

    /// Keeps only the first `len` tokens of `seq` (e.g. a prompt prefix a new request shares), giving up the
    /// blocks past them; where `len` ends inside a block other sequences hold too, at that block's start
    /// (the sequence will write past its length). A `len` beyond the sequence changes nothing.
    pub fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let block_size = self.block_size;
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(ModelError::UnknownSequence { seq: seq.get() })?;
        let mut len = s.len.min(len);
        if len % block_size != 0 && self.holders[s.blocks[len / block_size] as usize] > 1 {
            len -= len % block_size;
        }
        s.len = len;
        let freed = s.blocks.split_off(len.div_ceil(block_size));
        self.release(freed);
        Ok(())
    }

    /// Checks `batch` against the pool and takes the blocks its tokens need (all or none): each entry a
    /// known sequence, at most once, with at least one token, starting where the sequence ends. Nothing
    /// changes on error. The caller writes the rows, then [`Self::commit`]s or [`Self::rollback`]s.
    pub(crate) fn begin_step(&mut self, batch: &[SeqChunk]) -> Result<StepLayout> {
        if batch.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let mut needed = 0usize;
        for (i, entry) in batch.iter().enumerate() {
            let s = self.get(entry.seq)?;
            if batch[..i].iter().any(|e| e.seq == entry.seq) {
                return Err(ModelError::DuplicateSequence {
                    seq: entry.seq.get(),
                });
            }
            if entry.tokens.is_empty() {
                return Err(ModelError::EmptyInput);
            }
            if entry.start_pos != s.len {
                return Err(ModelError::SequenceMismatch {
                    seq: entry.seq.get(),
                    start_pos: entry.start_pos,
                    cached: s.len,
                });
            }
            needed += self.blocks_to_append(entry.seq, entry.tokens.len())?;
        }
        if needed > self.free.len() {
            return Err(ModelError::PoolExhausted {
                needed,
                free: self.free.len(),
                block_size: self.block_size,
            });
        }
        let mut before = Vec::with_capacity(batch.len());
        for entry in batch {
            let end = entry.start_pos + entry.tokens.len();
            let want = end.div_ceil(self.block_size);
            let s = self.seqs.get_mut(&entry.seq).expect("checked above");
            before.push((entry.seq, s.blocks.len()));
            while s.blocks.len() < want {
                let b = self.free.pop().expect("counted above");
                self.holders[b as usize] = 1;
                s.blocks.push(b);
            }
        }
        let max_blocks = batch
            .iter()
            .map(|e| self.seqs[&e.seq].blocks.len())
            .max()
            .unwrap_or(0);
        let total: usize = batch.iter().map(|e| e.tokens.len()).sum();
        let mut layout = StepLayout {
            batch: batch.len(),
            max_blocks,
            block_table: vec![0; batch.len() * max_blocks],
            seq_lens: Vec::with_capacity(batch.len()),
            token_seq: Vec::with_capacity(total),
            positions: Vec::with_capacity(total),
            write_rows: Vec::with_capacity(total),
            last_tokens: Vec::with_capacity(batch.len()),
            before,
        };
        for (b, entry) in batch.iter().enumerate() {
            let blocks = &self.seqs[&entry.seq].blocks;
            for (slot, &block) in blocks.iter().enumerate() {
                layout.block_table[b * max_blocks + slot] = block as i32;
            }
            let end = entry.start_pos + entry.tokens.len();
            layout.seq_lens.push(end as i32);
            for pos in entry.start_pos..end {
                let block = blocks[pos / self.block_size] as usize;
                layout.token_seq.push(b as i32);
                layout.positions.push(pos);
                layout
                    .write_rows
                    .push((block * self.block_size + pos % self.block_size) as u32);
            }
            layout.last_tokens.push(layout.positions.len() as u32 - 1);
        }
        Ok(layout)
    }

    /// The step's rows are written: its sequences now hold them.
    pub(crate) fn commit(&mut self, step: &StepLayout) {
        for ((seq, _), &len) in step.before.iter().zip(&step.seq_lens) {
            if let Some(s) = self.seqs.get_mut(seq) {
                s.len = len as usize;
            }
        }
    }

    /// The step failed: the blocks it took go back (rows written into them are never read).
    pub(crate) fn rollback(&mut self, step: &StepLayout) {
        for &(seq, blocks) in &step.before {
            if let Some(s) = self.seqs.get_mut(&seq) {
                let taken = s.blocks.split_off(blocks);
                self.release(taken);
            }
        }
    }
}
