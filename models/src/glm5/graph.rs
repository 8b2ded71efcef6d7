//! Decode steps replayed from CUDA graphs: one launch from the host per step and device instead of the
//! hundreds the step issues one by one (at batch 1 the host takes longer to issue them than the GPU to run
//! them).
//!
//! [`Glm5ForCausalLM::forward_batch_graphed`] runs a decode step (one token per sequence) of `B` sequences
//! whose block tables fit `C` columns from graphs captured for `(R, C)`: `R` is the next capture size at or
//! above `B` (1, 2, 4, 8, 16, 24, 32, 48, ... 256), its rows past `B` repeating the last sequence (the same
//! token at the same position writes the same KV row with the same values; their logits are dropped), and
//! `C` is the step's block count rounded up to a power of two, so a growing sequence is captured again only
//! when its blocks double. Each
//! segment of the forward pass on one GPU (the embeddings, its layers, the head; several where the plan
//! places layers over several GPUs) is one graph; the host hands the hidden state from one segment's output
//! tensor to the next one's input tensor between replays, ordered by stream waits
//! (`glm5_ops::step_graph::copy_between`). The step's inputs (tokens, positions, block table, lengths, rows to
//! write) are written into device tensors on every device the graphs read them on; the RoPE rows are gathered
//! on the device; the indexer scores up to the `C` columns' capacity and masks by each query's count; the
//! logits land in a tensor made before the capture.
//!
//! A step the graphs cannot take runs eagerly through [`Glm5ForCausalLM::forward_batch`], and
//! [`DecodeGraphs::stats`] says why: prompt chunks in the step, a layer on the CPU, event tracking on, dense
//! attention, a layer bound to a reference backend, or experts that count their rows on the host (the grouped
//! GEMMs of larger batches). A capture the driver refuses is recorded per `(B, C)` with the driver's reason,
//! and that shape runs eagerly from then on.

use candle_core::{DType, Tensor};
use glm5_ops::step_graph::{self, StepGraph};
use glm5_ops::Op;

use super::attention::PagedStep;
use super::rope::Rope;
use super::{DeviceStep, FeedForward, Glm5ForCausalLM, Segment};
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
    /// Per plan device, RoPE tables of positions `0..len`, grown as block capacities grow (each graph holds
    /// the table it reads).
    rope_tables: Vec<Option<Rope>>,
    /// The model's embeddings and the pool's first latent blocks the graphs were captured against: another
    /// model or pool drops them (the graphs address their memory).
    owner: Option<(Tensor, Tensor)>,
    max_graphs: usize,
    clock: u64,
    stats: GraphStats,
}

/// One captured step: the tensors it reads and writes, and a graph per segment.
struct CapturedDecode {
    batch: usize,
    columns: usize,
    inputs: StepInputs,
    segments: Vec<CapturedSegment>,
    last_used: u64,
}

/// One segment's graph, the hidden state it reads (none for the first, which reads the token ids) and what
/// it writes: the hidden state `[B, hidden]`, or for the last, f32 logits `[B, vocab]`.
struct CapturedSegment {
    input: Option<Tensor>,
    output: Tensor,
    graph: StepGraph,
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
    /// The step's values for a `(rows, C)` graph: its `B` sequences, then `rows - B` copies of the last one
    /// (module docs: a padded row repeats the last sequence's token, so it writes the same KV row with the
    /// same values, and its logits are dropped).
    fn of(batch: &[SeqChunk], step: &StepLayout, columns: usize, rows: usize) -> Self {
        let b = step.batch;
        let mut block_table = vec![0; rows * columns];
        for (row, blocks) in step.block_table.chunks(step.max_blocks.max(1)).enumerate() {
            block_table[row * columns..row * columns + blocks.len()].copy_from_slice(blocks);
        }
        let last = b - 1;
        for row in b..rows {
            block_table.copy_within(last * columns..(last + 1) * columns, row * columns);
        }
        // Row r's value of a per-sequence list: its own, or the last sequence's for a padded row.
        let padded =
            |values: Vec<i64>| -> Vec<i64> { (0..rows).map(|r| values[r.min(last)]).collect() };
        let ids = padded(batch.iter().map(|e| e.tokens[0] as i64).collect());
        let positions = padded(step.positions.iter().map(|&p| p as i64).collect());
        let seq_lens = padded(step.seq_lens.iter().map(|&l| l as i64).collect());
        let write_rows = padded(step.write_rows.iter().map(|&r| r as i64).collect());
        Self {
            ids: ids.iter().map(|&v| v as u32).collect(),
            positions: positions.iter().map(|&p| p as u32).collect(),
            block_table,
            seq_lens: seq_lens.iter().map(|&l| l as i32).collect(),
            // One token a sequence: token r belongs to row r.
            token_seq: (0..rows as i32).collect(),
            write_rows: write_rows.iter().map(|&r| r as u32).collect(),
            visible: positions.iter().map(|&p| p as i32 + 1).collect(),
        }
    }
}

/// [`DecodeGraphs::capture_rows`].
fn graph_rows(batch: usize) -> usize {
    const SIZES: [usize; 13] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256];
    SIZES
        .into_iter()
        .find(|&size| size >= batch)
        .unwrap_or(batch)
}

/// A step's inputs on the devices that read them: the token ids on the embeddings' device, and the layout
/// on every device with layers.
struct StepInputs {
    ids: Tensor,
    /// Per plan device: `None` where no layer runs.
    layouts: Vec<Option<LayoutInputs>>,
}

impl StepInputs {
    /// The tensors of `values` on `model`'s devices, the RoPE rows gathered from `rope_tables`.
    fn new(
        model: &Glm5ForCausalLM,
        values: &DecodeValues,
        columns: usize,
        block_size: usize,
        rope_tables: &[Option<Rope>],
    ) -> Result<Self> {
        let b = values.ids.len();
        let mut layouts: Vec<Option<LayoutInputs>> =
            (0..model.devices.len()).map(|_| None).collect();
        for layer in &model.plan.layers {
            if layouts[layer.device].is_none() {
                let table = rope_tables[layer.device].clone().ok_or_else(|| {
                    ModelError::PlanDevices(format!(
                        "no RoPE table on plan device {}",
                        layer.device
                    ))
                })?;
                layouts[layer.device] = Some(LayoutInputs::new(
                    values,
                    columns,
                    block_size,
                    table,
                    &model.devices[layer.device],
                )?);
            }
        }
        Ok(Self {
            ids: Tensor::from_vec(values.ids.clone(), b, model.device())?,
            layouts,
        })
    }

    /// Refills every tensor in place, ordered before the next replay on each device's stream.
    fn write(&self, values: &DecodeValues) -> Result<()> {
        step_graph::write_from_host(&self.ids, &values.ids)?;
        for layout in self.layouts.iter().flatten() {
            layout.write(values)?;
        }
        Ok(())
    }

    /// Plan device `device`'s layout (device work only: what a capture records).
    fn device_step(&self, device: usize) -> Result<DeviceStep> {
        self.layouts
            .get(device)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                ModelError::PlanDevices(format!("no step inputs on plan device {device}"))
            })?
            .device_step()
    }
}

/// The layout tensors a device's graph reads its step from.
struct LayoutInputs {
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

impl LayoutInputs {
    fn new(
        values: &DecodeValues,
        columns: usize,
        block_size: usize,
        rope_table: Rope,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let b = values.ids.len();
        let v = values;
        Ok(Self {
            positions: Tensor::from_vec(v.positions.clone(), b, device)?,
            block_table: Tensor::from_vec(v.block_table.clone(), (b, columns), device)?,
            seq_lens: Tensor::from_vec(v.seq_lens.clone(), b, device)?,
            token_seq: Tensor::from_vec(v.token_seq.clone(), b, device)?,
            write_rows: Tensor::from_vec(v.write_rows.clone(), b, device)?,
            visible: Tensor::from_vec(v.visible.clone(), b, device)?,
            rope_table,
            max_visible: columns * block_size,
        })
    }

    fn write(&self, values: &DecodeValues) -> Result<()> {
        step_graph::write_from_host(&self.positions, &values.positions)?;
        step_graph::write_from_host(&self.block_table, &values.block_table)?;
        step_graph::write_from_host(&self.seq_lens, &values.seq_lens)?;
        step_graph::write_from_host(&self.token_seq, &values.token_seq)?;
        step_graph::write_from_host(&self.write_rows, &values.write_rows)?;
        step_graph::write_from_host(&self.visible, &values.visible)?;
        Ok(())
    }

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
            rope_tables: Vec::new(),
            owner: None,
            max_graphs: max_graphs.max(1),
            clock: 0,
            stats: GraphStats::default(),
        }
    }

    pub fn stats(&self) -> &GraphStats {
        &self.stats
    }

    /// The batch size a decode step of `batch` sequences is captured at: the next of a few sizes (as vLLM
    /// captures), so that batches that grow and shrink share graphs; the rows past `batch` repeat its last
    /// sequence. Past the largest size, the batch itself.
    pub fn capture_rows(batch: usize) -> usize {
        graph_rows(batch)
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
            self.rope_tables.clear();
            self.owner = Some((model.embed_tokens.clone(), first_blocks.clone()));
        }
        Ok(())
    }

    /// Per plan device with layers, RoPE tables of at least `positions` positions.
    fn rope_tables(
        &mut self,
        model: &Glm5ForCausalLM,
        positions: usize,
    ) -> Result<Vec<Option<Rope>>> {
        self.rope_tables.resize(model.devices.len(), None);
        for layer in &model.plan.layers {
            let table = &mut self.rope_tables[layer.device];
            if table.as_ref().is_none_or(|t| t.len() < positions) {
                *table = Some(Rope::at_positions(
                    &model.config,
                    0,
                    positions,
                    model.dtype,
                    &model.devices[layer.device],
                )?);
            }
        }
        Ok(self.rope_tables.clone())
    }
}

impl Glm5ForCausalLM {
    /// Why a decode step of `batch` sequences cannot be captured in a CUDA graph, or `None` where it can.
    pub fn decode_graph_blocker(&self, batch: usize) -> Option<String> {
        for segment in self.segments() {
            if let Some(why) = step_graph::capture_blocker(&self.devices[segment.device]) {
                return Some(why);
            }
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
                let device = &self.devices[plan.device];
                if let Some(why) = moe.capture_blocker(batch, self.dtype, device) {
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
        self.in_step(batch, pool, |step, pool| {
            self.run_graphed(graphs, batch, step, pool)
        })
    }

    /// A decode step run eagerly through the tensors a `(rows, C)` graph reads, `C` at least `min_columns`
    /// and `rows` the capture size of at least `min_rows` (the graph path's layout: padded rows and block
    /// tables, RoPE rows gathered on the device, the indexer bounded by the columns' capacity). It checks that layout on any device, the CPU included, where no
    /// graph is captured; the logits equal [`Self::forward_batch`]'s.
    #[doc(hidden)]
    pub fn forward_batch_graph_layout(
        &self,
        batch: &[SeqChunk],
        pool: &mut PagedKvCache,
        min_columns: usize,
        min_rows: usize,
    ) -> Result<Tensor> {
        if batch.iter().any(|e| e.tokens.len() != 1) {
            return Err(ModelError::CacheShape(
                "a graph's layout holds one token per sequence".into(),
            ));
        }
        self.in_step(batch, pool, |step, pool| {
            let columns = step.max_blocks.max(min_columns).next_power_of_two();
            let block_size = pool.block_size();
            let tables = DecodeGraphs::new(1).rope_tables(self, columns * block_size)?;
            let rows = graph_rows(batch.len().max(min_rows));
            let values = DecodeValues::of(batch, step, columns, rows);
            let inputs = StepInputs::new(self, &values, columns, block_size, &tables)?;
            let logits = self.forward_paged(&inputs.ids, pool, |d| inputs.device_step(d), None)?;
            Ok(logits.narrow(0, 0, batch.len())?)
        })
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
            true => self.decode_graph_blocker(graph_rows(batch.len())),
        };
        if let Some(why) = blocker {
            graphs.eager(why);
            return self.run_step(batch, step, pool, false);
        }
        graphs.bind(self, pool)?;
        let columns = step.max_blocks.next_power_of_two();
        let rows = graph_rows(batch.len());
        let key = (rows, columns);
        if let Some((_, why)) = graphs.refused.iter().find(|(k, _)| *k == key) {
            let why = why.clone();
            graphs.eager(why);
            return self.run_step(batch, step, pool, false);
        }
        graphs.clock += 1;
        let values = DecodeValues::of(batch, step, columns, rows);
        let real = |logits: Tensor| -> Result<Tensor> { Ok(logits.narrow(0, 0, batch.len())?) };
        if let Some(at) = graphs
            .captured
            .iter()
            .position(|g| (g.batch, g.columns) == key)
        {
            let replayed = {
                let graph = &mut graphs.captured[at];
                graph.last_used = graphs.clock;
                graph.replay(&values)
            };
            return match replayed {
                Ok(logits) => {
                    graphs.stats.replayed += 1;
                    real(logits)
                }
                Err(e) => {
                    // A failed replay wrote at most this step's KV rows, which the eager run writes
                    // again; this shape runs eagerly from now on.
                    graphs.captured.remove(at);
                    let why = format!("replaying the ({rows}, {columns}) graph failed: {e}");
                    graphs.refused.push((key, why.clone()));
                    graphs.eager(why);
                    self.run_step(batch, step, pool, false)
                }
            };
        }
        real(self.capture_decode(graphs, values, key, pool)?)
    }

    /// Captures the `(B, C)` step and returns its logits: run once eagerly over the graphs' tensors (which
    /// sizes every workspace the capture reads, fills candle's upload cache, and writes this step's KV rows),
    /// then each segment captured, and the chain replayed (writing the same rows again).
    fn capture_decode(
        &self,
        graphs: &mut DecodeGraphs,
        values: DecodeValues,
        (b, columns): (usize, usize),
        pool: &PagedKvCache,
    ) -> Result<Tensor> {
        let block_size = pool.block_size();
        let tables = graphs.rope_tables(self, columns * block_size)?;
        let inputs = StepInputs::new(self, &values, columns, block_size, &tables)?;
        let segments = self.segments();
        let last = segments.len() - 1;
        // Each segment's input (after the first) and output, made before any capture.
        let mut io = Vec::with_capacity(segments.len());
        for (i, segment) in segments.iter().enumerate() {
            let device = &self.devices[segment.device];
            let hidden = || Tensor::zeros((b, self.config.hidden_size), self.dtype, device);
            let input = if i == 0 { None } else { Some(hidden()?) };
            let output = match i == last {
                true => Tensor::zeros((b, self.config.vocab_size), DType::F32, device)?,
                false => hidden()?,
            };
            io.push((input, output));
        }
        // candle's layout uploads come from device buffers the eager run fills and the captures read.
        let _uploads: Vec<_> = segments
            .iter()
            .map(|s| step_graph::host_upload_cache(&self.devices[s.device]))
            .collect();
        let run = |i: usize, segment: &Segment| -> Result<Tensor> {
            let input = io[i].0.as_ref().unwrap_or(&inputs.ids);
            let step = match segment.layers.is_empty() {
                true => None,
                false => Some(inputs.device_step(segment.device)?),
            };
            self.run_segment(segment, input, pool, step.as_ref(), None)
        };
        // The eager run, through the same tensors the graphs use.
        for (i, segment) in segments.iter().enumerate() {
            if i > 0 {
                step_graph::copy_between(&io[i - 1].1, io[i].0.as_ref().expect("an input"))?;
            }
            io[i].1.slice_set(&run(i, segment)?, 0, 0)?;
        }
        let eager = io[last].1.copy()?;
        let mut captured = Vec::with_capacity(segments.len());
        for (i, segment) in segments.iter().enumerate() {
            let graph = step_graph::capture(&self.devices[segment.device], || {
                let out =
                    run(i, segment).map_err(|e| glm5_ops::OpError::Unsupported(e.to_string()))?;
                io[i].1.slice_set(&out, 0, 0)?;
                Ok(())
            });
            match graph {
                Ok((graph, ())) => captured.push(graph),
                Err(e) => {
                    // The eager run wrote this step's rows and its logits stand.
                    let why = format!("capturing the ({b}, {columns}) decode step failed: {e}");
                    graphs.refused.push(((b, columns), why.clone()));
                    graphs.eager(why);
                    return Ok(eager);
                }
            }
        }
        let step = CapturedDecode {
            batch: b,
            columns,
            inputs,
            segments: segments
                .into_iter()
                .zip(io)
                .zip(captured)
                .map(|((_, (input, output)), graph)| CapturedSegment {
                    input,
                    output,
                    graph,
                })
                .collect(),
            last_used: graphs.clock,
        };
        let out = match step.replay(&values) {
            Ok(out) => out,
            Err(e) => {
                let why = format!("replaying the ({b}, {columns}) graphs failed: {e}");
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
        graphs.captured.push(step);
        graphs.stats.captured += 1;
        Ok(out)
    }
}

impl CapturedDecode {
    /// Writes `values` into the step's tensors and replays the segments' graphs in order, each hidden state
    /// handed to the next segment's input; returns a copy of the logits.
    fn replay(&self, values: &DecodeValues) -> Result<Tensor> {
        self.inputs.write(values)?;
        for (i, segment) in self.segments.iter().enumerate() {
            if let Some(input) = &segment.input {
                step_graph::copy_between(&self.segments[i - 1].output, input)?;
            }
            segment.graph.replay()?;
        }
        let last = self
            .segments
            .last()
            .ok_or_else(|| ModelError::PlanDevices("a step without segments".into()))?;
        Ok(last.output.copy()?)
    }
}
