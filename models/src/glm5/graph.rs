//! Decode steps replayed from CUDA graphs: one launch from the host per step instead of the hundreds the
//! step issues one by one (at batch 1 the host takes longer to issue them than the GPU to run them).
//!
//! [`Glm5ForCausalLM::forward_batch_graphed`] runs a decode step (one token per sequence) of `B` sequences
//! whose block tables fit `C` columns from a graph captured for `(B, C)`: `C` is the step's block count
//! rounded up to a power of two, so a growing sequence is captured again only when its blocks double. The
//! step's inputs (tokens, positions, block table, lengths, rows to write) are written into device tensors the
//! graph reads; the RoPE rows are gathered on the device; the indexer scores up to the `C` columns'
//! capacity and masks by each query's count; the logits land in a tensor made before the capture.
//!
//! A step the graphs cannot take runs eagerly through [`Glm5ForCausalLM::forward_batch`], and
//! [`DecodeGraphs::stats`] says why: prompt chunks in the step, the model over several GPUs, event tracking
//! on, dense attention, a layer bound to a reference backend, or experts that count their rows on the host
//! (the grouped GEMMs of larger batches). A capture the driver refuses is recorded per `(B, C)` with the
//! driver's reason, and that shape runs eagerly from then on.

use candle_core::{DType, Tensor};
use glm5_ops::step_graph::{self, StepGraph};
use glm5_ops::Op;

use super::attention::PagedStep;
use super::rope::Rope;
use super::{DeviceStep, FeedForward, Glm5ForCausalLM};
use crate::error::{ModelError, Result};
use crate::paged_cache::{PagedKvCache, SeqChunk, StepLayout};
use crate::plan::AttentionMode;

/// How many steps replayed a graph, captured one, or ran eagerly (and the last eager step's reason).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub replayed: usize,
    pub captured: usize,
    pub eager: usize,
    pub last_eager_reason: Option<String>,
}

/// The decode-step graphs of one model and one paged pool (module docs). Dropping it frees them.
pub struct DecodeGraphs {
    captured: Vec<CapturedDecode>,
    /// `(B, C)` shapes whose capture failed, with the reason: they run eagerly.
    refused: Vec<((usize, usize), String)>,
    /// RoPE tables of positions `0..len` on the model's device, grown as block capacities grow (each graph
    /// holds the table it reads).
    rope_table: Option<Rope>,
    /// The model's embeddings and the pool's first latent blocks the graphs were captured against: another
    /// model or pool drops them (the graphs address their memory).
    owner: Option<(Tensor, Tensor)>,
    max_graphs: usize,
    clock: u64,
    stats: GraphStats,
}

/// One captured step and the device tensors it reads and writes.
struct CapturedDecode {
    batch: usize,
    columns: usize,
    inputs: DecodeInputs,
    /// `F32 [B, vocab]`: the captured step's logits.
    logits: Tensor,
    graph: StepGraph,
    last_used: u64,
}

/// A decode step's inputs on the host, in the shapes a `(B, C)` graph reads.
struct DecodeValues {
    ids: Vec<u32>,
    positions: Vec<u32>,
    /// `[B, C]` row-major, padded with block 0 (never read: each query reads below its sequence's length).
    block_table: Vec<i32>,
    seq_lens: Vec<i32>,
    token_seq: Vec<i32>,
    write_rows: Vec<u32>,
    visible: Vec<i32>,
}

impl DecodeValues {
    fn of(batch: &[SeqChunk], step: &StepLayout, columns: usize) -> Self {
        let b = step.batch;
        let mut block_table = vec![0; b * columns];
        for (row, blocks) in step.block_table.chunks(step.max_blocks.max(1)).enumerate() {
            block_table[row * columns..row * columns + blocks.len()].copy_from_slice(blocks);
        }
        Self {
            ids: batch.iter().map(|e| e.tokens[0]).collect(),
            positions: step.positions.iter().map(|&p| p as u32).collect(),
            block_table,
            seq_lens: step.seq_lens.clone(),
            token_seq: step.token_seq.clone(),
            write_rows: step.write_rows.clone(),
            visible: step.positions.iter().map(|&p| p as i32 + 1).collect(),
        }
    }
}

/// The device tensors a graph reads its step from.
struct DecodeInputs {
    ids: Tensor,
    positions: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    token_seq: Tensor,
    write_rows: Tensor,
    visible: Tensor,
    rope_table: Rope,
    /// The indexer's bound: the `C` columns' capacity.
    max_visible: usize,
}

impl DecodeInputs {
    fn new(
        values: DecodeValues,
        columns: usize,
        block_size: usize,
        rope_table: Rope,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let b = values.ids.len();
        Ok(Self {
            ids: Tensor::from_vec(values.ids, b, device)?,
            positions: Tensor::from_vec(values.positions, b, device)?,
            block_table: Tensor::from_vec(values.block_table, (b, columns), device)?,
            seq_lens: Tensor::from_vec(values.seq_lens, b, device)?,
            token_seq: Tensor::from_vec(values.token_seq, b, device)?,
            write_rows: Tensor::from_vec(values.write_rows, b, device)?,
            visible: Tensor::from_vec(values.visible, b, device)?,
            rope_table,
            max_visible: columns * block_size,
        })
    }

    /// Refills the tensors in place, ordered before the next replay on the same stream.
    fn write(&self, values: &DecodeValues) -> Result<()> {
        step_graph::write_from_host(&self.ids, &values.ids)?;
        step_graph::write_from_host(&self.positions, &values.positions)?;
        step_graph::write_from_host(&self.block_table, &values.block_table)?;
        step_graph::write_from_host(&self.seq_lens, &values.seq_lens)?;
        step_graph::write_from_host(&self.token_seq, &values.token_seq)?;
        step_graph::write_from_host(&self.write_rows, &values.write_rows)?;
        step_graph::write_from_host(&self.visible, &values.visible)?;
        Ok(())
    }

    /// The step's layout read from these tensors (device work only: what a capture records).
    fn device_step(&self) -> Result<DeviceStep> {
        Ok(DeviceStep {
            rope: Rope::gather(&self.rope_table, &self.positions)?,
            dense: None,
            paged: PagedStep {
                block_table: self.block_table.clone(),
                seq_lens: self.seq_lens.clone(),
                token_seq: self.token_seq.clone(),
                write_rows: self.write_rows.clone(),
                visible: self.visible.clone(),
                max_visible: self.max_visible,
            },
        })
    }
}

impl DecodeGraphs {
    /// No graphs yet; at most `max_graphs` kept (the least recently used goes first), each holding the device
    /// memory of its step's intermediate tensors.
    pub fn new(max_graphs: usize) -> Self {
        Self {
            captured: Vec::new(),
            refused: Vec::new(),
            rope_table: None,
            owner: None,
            max_graphs: max_graphs.max(1),
            clock: 0,
            stats: GraphStats::default(),
        }
    }

    pub fn stats(&self) -> &GraphStats {
        &self.stats
    }

    /// Graphs held now.
    pub fn len(&self) -> usize {
        self.captured.len()
    }

    pub fn is_empty(&self) -> bool {
        self.captured.is_empty()
    }

    fn eager(&mut self, why: String) {
        self.stats.eager += 1;
        self.stats.last_eager_reason = Some(why);
    }

    /// Forgets the graphs when `model` or `pool` is not the one they were captured against.
    fn bind(&mut self, model: &Glm5ForCausalLM, pool: &PagedKvCache) -> Result<()> {
        let first_blocks = pool
            .layers
            .first()
            .ok_or_else(|| ModelError::CacheShape("a pool without layers".into()))?
            .latent();
        let same = self.owner.as_ref().is_some_and(|(embed, blocks)| {
            embed.id() == model.embed_tokens.id() && blocks.id() == first_blocks.id()
        });
        if !same {
            self.captured.clear();
            self.refused.clear();
            self.rope_table = None;
            self.owner = Some((model.embed_tokens.clone(), first_blocks.clone()));
        }
        Ok(())
    }

    /// RoPE tables of at least `positions` positions.
    fn rope_table(&mut self, model: &Glm5ForCausalLM, positions: usize) -> Result<Rope> {
        match &self.rope_table {
            Some(table) if table.len() >= positions => Ok(table.clone()),
            _ => {
                let table =
                    Rope::at_positions(&model.config, 0, positions, model.dtype, model.device())?;
                self.rope_table = Some(table.clone());
                Ok(table)
            }
        }
    }
}

impl Glm5ForCausalLM {
    /// Why a decode step of `batch` sequences cannot be captured in a CUDA graph, or `None` where it can.
    pub fn decode_graph_blocker(&self, batch: usize) -> Option<String> {
        if self.devices.len() > 1 {
            return Some(format!(
                "the layers run on {} GPUs (graphs are captured for a model on one GPU)",
                self.devices.len()
            ));
        }
        if let Some(why) = step_graph::capture_blocker(self.device()) {
            return Some(why);
        }
        if self.mode == AttentionMode::Dense {
            return Some("dense attention builds each step's causal selection on the host".into());
        }
        if crate::profile::is_active() {
            return Some("a profile is being recorded (its parts synchronise)".into());
        }
        for (plan, layer) in self.plan.layers.iter().zip(&self.layers) {
            for op in [Op::DsaIndexer, Op::SparseMla] {
                if plan.op(op).is_some_and(|o| o.backend() == "reference") {
                    return Some(format!(
                        "layer {}'s {op} runs the reference, which reads its indexes on the host",
                        plan.layer
                    ));
                }
            }
            if let FeedForward::MoE(moe) = &layer.mlp {
                if let Some(why) = moe.capture_blocker(batch, self.dtype, self.device()) {
                    return Some(format!("layer {}: {why}", plan.layer));
                }
            }
        }
        None
    }

    /// [`Self::forward_batch`] for a decode step from `graphs` (module docs): the same logits, `[B, vocab]`
    /// f32; a step the graphs cannot take runs eagerly (`graphs.stats()` says why).
    pub fn forward_batch_graphed(
        &self,
        graphs: &mut DecodeGraphs,
        batch: &[SeqChunk],
        pool: &mut PagedKvCache,
    ) -> Result<Tensor> {
        self.check_batch(batch, pool)?;
        let step = pool.begin_step(batch)?;
        match self.run_graphed(graphs, batch, &step, pool) {
            Ok(logits) => {
                pool.commit(&step);
                Ok(logits)
            }
            Err(e) => {
                pool.rollback(&step);
                Err(e)
            }
        }
    }

    /// A decode step run eagerly through the tensors a `(B, C)` graph reads, `C` at least `min_columns`
    /// (the graph path's layout: padded block tables, RoPE rows gathered on the device, the indexer
    /// bounded by the columns' capacity). It checks that layout on any device, the CPU included, where no
    /// graph is captured; the logits equal [`Self::forward_batch`]'s.
    #[doc(hidden)]
    pub fn forward_batch_graph_layout(
        &self,
        batch: &[SeqChunk],
        pool: &mut PagedKvCache,
        min_columns: usize,
    ) -> Result<Tensor> {
        if batch.iter().any(|e| e.tokens.len() != 1) {
            return Err(ModelError::CacheShape(
                "a graph's layout holds one token per sequence".into(),
            ));
        }
        self.check_batch(batch, pool)?;
        let step = pool.begin_step(batch)?;
        let columns = step.max_blocks.max(min_columns).next_power_of_two();
        let block_size = pool.block_size();
        let run = || -> Result<Tensor> {
            let table = Rope::at_positions(
                &self.config,
                0,
                columns * block_size,
                self.dtype,
                self.device(),
            )?;
            let values = DecodeValues::of(batch, &step, columns);
            let inputs = DecodeInputs::new(values, columns, block_size, table, self.device())?;
            self.forward_paged(&inputs.ids, pool, |_| inputs.device_step(), None)
        };
        match run() {
            Ok(logits) => {
                pool.commit(&step);
                Ok(logits)
            }
            Err(e) => {
                pool.rollback(&step);
                Err(e)
            }
        }
    }

    fn run_graphed(
        &self,
        graphs: &mut DecodeGraphs,
        batch: &[SeqChunk],
        step: &StepLayout,
        pool: &PagedKvCache,
    ) -> Result<Tensor> {
        let blocker = match batch.iter().all(|e| e.tokens.len() == 1) {
            false => {
                Some("the step has prompt chunks (graphs are captured for decode steps)".into())
            }
            true => self.decode_graph_blocker(batch.len()),
        };
        if let Some(why) = blocker {
            graphs.eager(why);
            return self.run_step(batch, step, pool, false);
        }
        graphs.bind(self, pool)?;
        let columns = step.max_blocks.next_power_of_two();
        let key = (batch.len(), columns);
        if let Some((_, why)) = graphs.refused.iter().find(|(k, _)| *k == key) {
            let why = why.clone();
            graphs.eager(why);
            return self.run_step(batch, step, pool, false);
        }
        graphs.clock += 1;
        let values = DecodeValues::of(batch, step, columns);
        if let Some(at) = graphs
            .captured
            .iter()
            .position(|g| (g.batch, g.columns) == key)
        {
            let replayed = {
                let graph = &mut graphs.captured[at];
                graph.last_used = graphs.clock;
                graph
                    .inputs
                    .write(&values)
                    .and_then(|()| Ok(graph.graph.replay()?))
                    .and_then(|()| Ok(graph.logits.copy()?))
            };
            return match replayed {
                Ok(logits) => {
                    graphs.stats.replayed += 1;
                    Ok(logits)
                }
                Err(e) => {
                    // The replay ran nothing: this shape runs eagerly from now on.
                    graphs.captured.remove(at);
                    let why = format!(
                        "replaying the ({}, {columns}) graph failed: {e}",
                        batch.len()
                    );
                    graphs.refused.push((key, why.clone()));
                    graphs.eager(why);
                    self.run_step(batch, step, pool, false)
                }
            };
        }
        self.capture_decode(graphs, values, key, pool)
    }

    /// Captures the `(B, C)` step and returns its logits: run once eagerly over the graph's input tensors
    /// (which sizes every workspace the capture reads, fills candle's upload cache, and writes this step's KV
    /// rows), then captured and replayed (writing the same rows again).
    fn capture_decode(
        &self,
        graphs: &mut DecodeGraphs,
        values: DecodeValues,
        (b, columns): (usize, usize),
        pool: &PagedKvCache,
    ) -> Result<Tensor> {
        let device = self.device();
        let block_size = pool.block_size();
        let rope_table = graphs.rope_table(self, columns * block_size)?;
        let inputs = DecodeInputs::new(values, columns, block_size, rope_table, device)?;
        let logits = Tensor::zeros((b, self.config.vocab_size), DType::F32, device)?;
        // candle's layout uploads come from device buffers the eager run fills and the capture reads.
        let _uploads = step_graph::host_upload_cache(device);
        let eager = self.forward_paged(&inputs.ids, pool, |_| inputs.device_step(), None)?;
        let captured = step_graph::capture(device, || {
            let step = self
                .forward_paged(&inputs.ids, pool, |_| inputs.device_step(), None)
                .map_err(|e| glm5_ops::OpError::Unsupported(e.to_string()))?;
            logits.slice_set(&step, 0, 0)?;
            Ok(())
        });
        let graph = match captured.and_then(|(graph, ())| graph.replay().map(|()| graph)) {
            Ok(graph) => graph,
            Err(e) => {
                // The eager run wrote this step's rows and its logits stand.
                let why = format!("capturing the ({b}, {columns}) decode step failed: {e}");
                graphs.refused.push(((b, columns), why.clone()));
                graphs.eager(why);
                return Ok(eager);
            }
        };
        if graphs.captured.len() >= graphs.max_graphs {
            if let Some(oldest) = graphs
                .captured
                .iter()
                .enumerate()
                .min_by_key(|(_, g)| g.last_used)
                .map(|(i, _)| i)
            {
                graphs.captured.remove(oldest);
            }
        }
        let out = logits.copy()?;
        graphs.captured.push(CapturedDecode {
            batch: b,
            columns,
            inputs,
            logits,
            graph,
            last_used: graphs.clock,
        });
        graphs.stats.captured += 1;
        Ok(out)
    }
}
