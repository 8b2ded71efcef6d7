//! The GLM-5 module graph (`GlmMoeDsaForCausalLM`), in the order of `docs/architecture.md`: §3.1 block
//! structure, §3.2 RoPE, §3.3–3.4 MLA in its absorbed form, §4 the DSA lightning indexer, §5 MoE routing.
//!
//! One sequence: `forward(input_ids, start_pos, &mut cache)` runs a prompt chunk or one decode token over a
//! contiguous [`KvCache`] and returns the logits of every position it was given. Several sequences:
//! `forward_batch(batch, &mut pool)` runs every entry's new tokens (prompt chunks and decode tokens mixed)
//! as one `[T_total, hidden]` pass over the paged pool ([`PagedKvCache`]), attention and indexer reading each
//! token's own sequence through its block table. Attention is always the absorbed (MQA) form over the latent
//! cache: `W_UK` is folded into the query, `W_UV` applied after, so prefill and decode share one path through
//! the `sparse_mla` op.

mod attention;
mod graph;
mod linear;
mod moe;
mod mtp;
mod rope;

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, DeviceLocation, Module, Tensor};
use candle_nn::Linear;
use glm5_ops::{DeviceDesc, DeviceKind, Op, Registry};

use crate::cache::KvCache;
use crate::config::{Config, MlpKind};
use crate::error::{ModelError, Result};
use crate::paged_cache::{PagedCacheOptions, PagedKvCache, SeqChunk, StepLayout};
pub use crate::plan::AttentionMode;
use crate::plan::{op_spec, LayerPlan, Plan, PlanOptions};
use crate::profile::{self, Part};
use crate::weights::Checkpoint;
pub use attention::RowOps;
use attention::{all_causal_positions, causal_positions_of, Attention, LayerKv, PagedStep};
pub use graph::{DecodeGraphs, GraphStats};
use linear::{Loader, Proj, RmsNorm};
use moe::{Mlp, MoE};
pub use mtp::MtpCache;
use mtp::MtpLayer;
use rope::Rope;

/// A run of the forward pass on one plan device: the embeddings (first segment), layers, the head (last).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    device: usize,
    embed: bool,
    layers: std::ops::Range<usize>,
    head: bool,
}

/// A step's layout as tensors on one device: RoPE tables, the dense selection (dense mode), block tables.
struct DeviceStep {
    rope: Rope,
    dense: Option<Tensor>,
    paged: PagedStep,
}

enum FeedForward {
    Dense(Mlp),
    MoE(MoE),
}

/// The residual stream between blocks: `sum`, and the last block's output where it is not yet added
/// (`pending`): the next norm adds it in its own launch (`RmsNorm::add_forward`), one launch less per block.
struct Residual {
    sum: Tensor,
    pending: Option<Tensor>,
}

impl Residual {
    fn new(x: Tensor) -> Self {
        Self {
            sum: x,
            pending: None,
        }
    }

    /// The stream, and `norm` of it.
    fn norm(&self, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
        match &self.pending {
            Some(pending) => norm.add_forward(&self.sum, pending),
            None => Ok((self.sum.clone(), norm.forward(&self.sum)?)),
        }
    }

    /// The stream as one tensor.
    fn resolve(self) -> Result<Tensor> {
        Ok(match self.pending {
            Some(pending) => (self.sum + pending)?,
            None => self.sum,
        })
    }

    /// The rows `rows` of the stream.
    fn index_select(&self, rows: &Tensor) -> Result<Self> {
        Ok(Self {
            sum: self.sum.index_select(rows, 0)?,
            pending: self
                .pending
                .as_ref()
                .map(|p| p.index_select(rows, 0))
                .transpose()?,
        })
    }
}

/// §3.1 one decoder block: `x += Attn(norm(x)); x += FFN(norm(x))`.
struct DecoderLayer {
    /// Index of its device in the plan.
    device: usize,
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

impl DecoderLayer {
    fn load(config: &Config, loader: &Loader, plan: &LayerPlan) -> Result<Self> {
        let layer = plan.layer;
        let prefix = format!("model.layers.{layer}");
        let mlp = match plan.mlp {
            MlpKind::Dense => FeedForward::Dense(Mlp::load(
                loader,
                &format!("{prefix}.mlp"),
                config.hidden_size,
                config.intermediate_size,
            )?),
            MlpKind::MoE => FeedForward::MoE(MoE::load(config, loader, &format!("{prefix}.mlp"))?),
        };
        Ok(Self {
            device: plan.device,
            input_layernorm: loader.rms_norm(
                &format!("{prefix}.input_layernorm"),
                config.hidden_size,
                config.rms_norm_eps,
            )?,
            self_attn: Attention::load(config, loader, &format!("{prefix}.self_attn"), plan)?,
            post_attention_layernorm: loader.rms_norm(
                &format!("{prefix}.post_attention_layernorm"),
                config.hidden_size,
                config.rms_norm_eps,
            )?,
            mlp,
        })
    }

    /// The stream after this block, its FFN's output left pending, and the attended positions.
    fn forward(
        &self,
        x: &Residual,
        rope: &Rope,
        kv: LayerKv<'_>,
        dense: Option<&Tensor>,
    ) -> Result<(Residual, Tensor)> {
        let (x, normed) = x.norm(&self.input_layernorm)?;
        let (attn, selected) = profile::time(Part::Attention, x.device(), || {
            self.self_attn.forward(&normed, rope, kv, dense)
        })?;
        let (x, h) = self.post_attention_layernorm.add_forward(&x, &attn)?;
        let ffn = match &self.mlp {
            FeedForward::Dense(mlp) => {
                profile::time(Part::DenseMlp, h.device(), || mlp.forward(&h))?
            }
            FeedForward::MoE(moe) => profile::time(Part::Moe, h.device(), || moe.forward(&h))?,
        };
        Ok((
            Residual {
                sum: x,
                pending: Some(ffn),
            },
            selected,
        ))
    }
}

/// The implementations one decoder layer (or the MTP layer) runs.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerBackends {
    pub layer: usize,
    pub mlp: MlpKind,
    pub attention: AttentionMode,
    pub dsa_indexer: &'static str,
    pub sparse_mla: &'static str,
    /// How the routed experts run (MoE layers), `-` for dense layers.
    pub experts: &'static str,
    pub device: String,
    pub dtype: DType,
}

impl std::fmt::Display for LayerBackends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "layer {:>3} | {:<6} {:?} {:?} | {:?} attention | dsa_indexer: {} | sparse_mla: {} | experts: {}",
            self.layer,
            self.device,
            self.dtype,
            self.mlp,
            self.attention,
            self.dsa_indexer,
            self.sparse_mla,
            self.experts
        )
    }
}

/// GLM-5 (`GlmMoeDsaForCausalLM`), its layers placed and its backends bound by a [`Plan`]: one sequence
/// over a [`KvCache`] ([`Self::forward`]), or a batch of sequences over a [`PagedKvCache`]
/// ([`Self::forward_batch`]).
pub struct Glm5ForCausalLM {
    config: Config,
    plan: Plan,
    /// The real device of every plan device.
    devices: Vec<Device>,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Proj,
    /// The MTP layer (speculative decoding's draft), when the plan asked for it.
    mtp: Option<MtpLayer>,
    mode: AttentionMode,
    dtype: DType,
    /// Hidden-state copies between plan devices so far.
    transfers: AtomicUsize,
}

/// Whether `device` is the one `desc` describes.
fn same_device(device: &Device, desc: &DeviceDesc) -> bool {
    match (device.location(), desc.kind) {
        (DeviceLocation::Cpu, DeviceKind::Cpu) => true,
        (DeviceLocation::Cuda { gpu_id }, DeviceKind::Cuda { ordinal, .. }) => gpu_id == ordinal,
        _ => false,
    }
}

/// `x` on `device`. Between two CUDA devices candle copies on the receiving device's stream; the copy is
/// ordered here by two stream waits instead of by cudarc's per-buffer event tracking (which glm5's CLI turns
/// off): the receiving stream first waits for the work queued on the source stream so far (which wrote `x`),
/// and the source stream then waits for the copy (`x`'s memory may be reused on it once `x` is dropped).
fn copy_to_device(x: &Tensor, device: &Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(from), Device::Cuda(to)) = (x.device(), device) {
        if !x.device().same_device(device) {
            use candle_core::cuda_backend::WrapErr;
            let (from, to) = (from.cuda_stream(), to.cuda_stream());
            to.join(&from).w()?;
            let copied = x.to_device(device)?;
            from.join(&to).w()?;
            return Ok(copied);
        }
    }
    Ok(x.to_device(device)?)
}

impl Glm5ForCausalLM {
    /// Builds the graph on one device from `checkpoint`, converting weights to `dtype` (the router stays
    /// f32): the plan is made here with the built-in registry (see [`Self::load_planned`]).
    pub fn load(
        config: &Config,
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
        mode: AttentionMode,
    ) -> Result<Self> {
        let plan = Plan::build(
            config,
            vec![DeviceDesc::of(device)?],
            &PlanOptions::new(dtype, mode),
            &Registry::builtin(),
        )?;
        Self::load_planned(config, checkpoint, plan, std::slice::from_ref(device))
    }

    /// Builds the graph as `plan` says: every layer on its device with the backends the plan chose bound in.
    /// `devices[i]` is the real device of `plan.devices[i]`; a plan made for assumed devices cannot be loaded.
    pub fn load_planned(
        config: &Config,
        checkpoint: &Checkpoint,
        plan: Plan,
        devices: &[Device],
    ) -> Result<Self> {
        if devices.len() != plan.devices.len() {
            return Err(ModelError::PlanDevices(format!(
                "the plan has {} devices, {} were given",
                plan.devices.len(),
                devices.len()
            )));
        }
        for (device, desc) in devices.iter().zip(&plan.devices) {
            if desc.assumed {
                return Err(ModelError::PlanDevices(format!(
                    "{desc} was described on the command line; such a plan can be printed, not loaded"
                )));
            }
            if !same_device(device, desc) {
                return Err(ModelError::PlanDevices(format!(
                    "the plan's {desc} was given as {device:?}"
                )));
            }
        }
        if plan.layers.len() != config.num_hidden_layers {
            return Err(ModelError::PlanDevices(format!(
                "the plan has {} layers, the config {}",
                plan.layers.len(),
                config.num_hidden_layers
            )));
        }
        let dtype = plan.dtype;
        let loaders: Vec<Loader> = devices
            .iter()
            .zip(&plan.devices)
            .map(|(device, desc)| Loader {
                checkpoint,
                dtype,
                device,
                desc,
                config,
                fp8_projections: plan.fp8_projections,
            })
            .collect();
        let (vocab, hidden) = (config.vocab_size, config.hidden_size);
        let embed_tokens =
            loaders[plan.embed_device].tensor("model.embed_tokens.weight", &[vocab, hidden])?;
        let head_loader = &loaders[plan.head_device];
        let lm_head = if config.tie_word_embeddings && !checkpoint.contains("lm_head.weight") {
            Proj::Dense(Linear::new(
                copy_to_device(&embed_tokens, head_loader.device)?,
                None,
            ))
        } else {
            head_loader.linear("lm_head", hidden, vocab)?
        };
        let layers = plan
            .layers
            .iter()
            .map(|layer| DecoderLayer::load(config, &loaders[layer.device], layer))
            .collect::<Result<Vec<_>>>()?;
        let mtp = plan
            .mtp
            .as_ref()
            .map(|layer| MtpLayer::load(config, &loaders[layer.device], layer))
            .transpose()?;
        Ok(Self {
            config: config.clone(),
            embed_tokens,
            layers,
            norm: head_loader.rms_norm("model.norm", hidden, config.rms_norm_eps)?,
            lm_head,
            mtp,
            mode: plan.attention,
            dtype,
            devices: devices.to_vec(),
            plan,
            transfers: AtomicUsize::new(0),
        })
    }

    /// Reads `config.json` and the safetensors checkpoint of a model directory (one device).
    pub fn from_dir(
        dir: impl AsRef<std::path::Path>,
        dtype: DType,
        device: &Device,
        mode: AttentionMode,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Config::from_file(dir.join("config.json"))?;
        Self::load(&config, &Checkpoint::open(dir)?, dtype, device, mode)
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Placement and backends, per layer.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn mode(&self) -> AttentionMode {
        self.mode
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of the embeddings (where `forward` starts).
    pub fn device(&self) -> &Device {
        &self.devices[self.plan.embed_device]
    }

    /// The device `lm_head` runs on, where `forward` returns the logits.
    pub fn output_device(&self) -> &Device {
        &self.devices[self.plan.head_device]
    }

    /// Waits until the work this thread queued on the model's devices (its weights' uploads, a cache's
    /// allocation) is done. Another thread may then run the model on its own stream (candle gives each
    /// thread one), also on devices whose event tracking is off (`glm5 serve` does this before its engine
    /// thread takes the model).
    pub fn synchronize(&self) -> Result<()> {
        for device in &self.devices {
            device.synchronize()?;
        }
        Ok(())
    }

    /// Hidden-state copies between devices done by the forward passes so far (one per plan boundary per
    /// call).
    pub fn transfers(&self) -> usize {
        self.transfers.load(Ordering::Relaxed)
    }

    /// How every layer's attention runs its row-wise steps from now on ([`RowOps`]; fused by default).
    pub fn set_row_ops(&self, row_ops: RowOps) {
        for layer in &self.layers {
            layer.self_attn.set_row_ops(row_ops);
        }
    }

    /// What runs where, per layer (the MTP layer last, if loaded), as the plan bound it.
    pub fn layer_backends(&self) -> Vec<LayerBackends> {
        let built = self
            .layers
            .iter()
            .chain(self.mtp.as_ref().map(MtpLayer::block));
        self.plan
            .all_layers()
            .zip(built)
            .map(|(layer, built)| LayerBackends {
                layer: layer.layer,
                mlp: layer.mlp,
                attention: self.mode,
                dsa_indexer: layer.op(Op::DsaIndexer).map_or("-", |o| o.backend()),
                sparse_mla: layer.op(Op::SparseMla).map_or("-", |o| o.backend()),
                experts: match &built.mlp {
                    FeedForward::MoE(moe) => {
                        moe.experts_implementation(&self.devices[layer.device])
                    }
                    FeedForward::Dense(_) => "-",
                },
                device: self.plan.devices[layer.device].name.clone(),
                dtype: layer.dtype,
            })
            .collect()
    }

    /// An empty cache for up to `capacity` tokens of one sequence, each layer's rows on its device.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let layer_devices: Vec<&Device> = self
            .plan
            .layers
            .iter()
            .map(|l| &self.devices[l.device])
            .collect();
        KvCache::new(
            &self.config,
            capacity,
            self.dtype,
            self.plan.index_keys,
            &layer_devices,
        )
    }

    /// An empty paged pool of `options.num_blocks` blocks of `options.block_size` tokens for batched forwards
    /// ([`Self::forward_batch`]), each layer's blocks on its device. Fails with a typed error when a backend
    /// the plan bound cannot read blocks of that size, or when the blocks of a device would not fit its
    /// memory.
    pub fn new_paged_cache(&self, options: PagedCacheOptions) -> Result<PagedKvCache> {
        let per_token =
            crate::sizes::cache_bytes_per_token(&self.config, self.dtype, self.plan.index_keys);
        let block_tokens = options.num_blocks.saturating_mul(options.block_size) as u64;
        for (index, desc) in self.plan.devices.iter().enumerate() {
            let layers = self
                .plan
                .layers
                .iter()
                .filter(|l| l.device == index)
                .count() as u64;
            let bytes = block_tokens
                .saturating_mul(per_token)
                .saturating_mul(layers);
            if bytes > desc.memory_bytes {
                return Err(ModelError::PagedCache(format!(
                    "{} blocks of {} tokens take {} on {desc} ({layers} layers), which has {}",
                    options.num_blocks,
                    options.block_size,
                    crate::plan::fmt_bytes(bytes),
                    crate::plan::fmt_bytes(desc.memory_bytes)
                )));
            }
        }
        // The backends bound at load time must also read a paged cache of these blocks.
        let layout = glm5_ops::CacheLayout::Paged {
            block_size: options.block_size,
        };
        for layer in &self.plan.layers {
            for op in &layer.ops {
                let Some(choice) = &op.choice else { continue };
                let mut spec = op_spec(
                    &self.config,
                    op.op,
                    layer.dtype,
                    self.mode,
                    self.plan.index_keys,
                );
                spec.layout = layout;
                if let Err(reasons) = choice
                    .entry
                    .validate(&spec, &self.plan.devices[layer.device])
                {
                    let reasons: Vec<String> = reasons.iter().map(ToString::to_string).collect();
                    return Err(ModelError::PagedCache(format!(
                        "layer {}: the {} backend {} cannot read blocks of {} tokens: {}",
                        layer.layer,
                        op.op,
                        choice.entry.name,
                        options.block_size,
                        reasons.join("; ")
                    )));
                }
            }
        }
        let layer_devices: Vec<&Device> = self
            .plan
            .layers
            .iter()
            .map(|l| &self.devices[l.device])
            .collect();
        PagedKvCache::new(
            &self.config,
            options,
            self.dtype,
            self.plan.index_keys,
            &layer_devices,
        )
    }

    /// One step of several sequences: every entry's tokens (a prompt chunk or one decode token, at its
    /// sequence's next position) run as one `[T_total, hidden]` pass over `pool`, their KV appended to their
    /// sequences. Returns f32 logits `[batch.len(), vocab_size]` of each entry's last token, in batch order,
    /// on [`Self::output_device`].
    ///
    /// Typed errors, with nothing changed in the pool: an empty batch or entry, an unknown or repeated
    /// sequence, a `start_pos` that does not continue its sequence, a token outside the vocabulary, positions
    /// past the context, more new blocks than the pool has free ([`ModelError::PoolExhausted`]).
    pub fn forward_batch(&self, batch: &[SeqChunk], pool: &mut PagedKvCache) -> Result<Tensor> {
        self.run_batch(batch, pool, false)
    }

    /// [`Self::forward_batch`] returning the logits of every token, `[T_total, vocab_size]`: each entry's
    /// tokens in order, the entries in batch order.
    pub fn forward_batch_all(&self, batch: &[SeqChunk], pool: &mut PagedKvCache) -> Result<Tensor> {
        self.run_batch(batch, pool, true)
    }

    /// Runs `input_ids` at positions `start_pos..start_pos + len` (a prompt chunk or one decode token),
    /// appending them to `cache`, and returns f32 logits `[len, vocab_size]` on [`Self::output_device`].
    pub fn forward(
        &self,
        input_ids: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Ok(self.run(input_ids, start_pos, cache, None)?.0)
    }

    /// [`Self::forward`], also returning every layer's attended positions `[len, K]` (i32, -1 padded): the
    /// DSA indexer's top-k in sparse mode, all causal positions in dense mode.
    pub fn forward_with_selections(
        &self,
        input_ids: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut selections = Vec::with_capacity(self.layers.len());
        let (logits, _) = self.run(input_ids, start_pos, cache, Some(&mut selections))?;
        Ok((logits, selections))
    }

    /// Moves the hidden state to plan device `to` at a layer boundary.
    fn transfer(&self, x: &Tensor, to: usize) -> Result<Tensor> {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        copy_to_device(x, &self.devices[to])
    }

    /// Checks the entries' tokens and positions against the model, and `pool` against the model's layers.
    fn check_batch(&self, batch: &[SeqChunk], pool: &PagedKvCache) -> Result<()> {
        if pool.layers.len() != self.layers.len() {
            return Err(ModelError::CacheShape(format!(
                "{} layers in the pool, model has {}",
                pool.layers.len(),
                self.layers.len()
            )));
        }
        for (l, (layer, blocks)) in self.plan.layers.iter().zip(&pool.layers).enumerate() {
            let latent = blocks.latent();
            if latent.dim(2)? != self.config.latent_dim()
                || latent.dtype() != self.dtype
                || !same_device(latent.device(), &self.plan.devices[layer.device])
            {
                return Err(ModelError::CacheShape(format!(
                    "layer {l}: the pool's blocks are {:?} rows of {} on {:?}",
                    latent.dtype(),
                    latent.dim(2)?,
                    latent.device().location()
                )));
            }
        }
        for entry in batch {
            self.check_tokens(entry.tokens, entry.start_pos)?;
        }
        Ok(())
    }

    /// Checks `ids`, the tokens at positions `first..`: each in the vocabulary, all within the context.
    fn check_tokens(&self, ids: &[u32], first: usize) -> Result<()> {
        let vocab_size = self.config.vocab_size;
        if let Some((i, &token)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab_size)
        {
            return Err(ModelError::TokenOutOfRange {
                token,
                position: first + i,
                vocab_size,
            });
        }
        let (end, max_positions) = (
            first.saturating_add(ids.len()),
            self.config.max_position_embeddings,
        );
        if end > max_positions {
            return Err(ModelError::ContextOverflow {
                start: first,
                end,
                max_positions,
            });
        }
        Ok(())
    }

    fn run_batch(
        &self,
        batch: &[SeqChunk],
        pool: &mut PagedKvCache,
        all_logits: bool,
    ) -> Result<Tensor> {
        self.in_step(batch, pool, |step, pool| {
            self.run_step(batch, step, pool, all_logits)
        })
    }

    /// Checks `batch`, takes the blocks its tokens need from `pool`, runs `run` over its layout, and
    /// commits the step, or on error gives the blocks back (the pool as before).
    fn in_step(
        &self,
        batch: &[SeqChunk],
        pool: &mut PagedKvCache,
        run: impl FnOnce(&StepLayout, &PagedKvCache) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.check_batch(batch, pool)?;
        let step = pool.begin_step(batch)?;
        match run(&step, pool) {
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

    /// The batch's layout as tensors on plan device `device`: RoPE tables, dense selection, block tables.
    fn device_step(&self, step: &StepLayout, device: usize) -> Result<DeviceStep> {
        let device = &self.devices[device];
        let (batch, tokens) = (step.batch, step.positions.len());
        let rope = Rope::at(&self.config, &step.positions, self.dtype, device)?;
        let dense = match self.mode {
            AttentionMode::Sparse => None,
            AttentionMode::Dense => Some(causal_positions_of(&step.positions, device)?),
        };
        let visible: Vec<i32> = step.positions.iter().map(|&p| p as i32 + 1).collect();
        let paged = PagedStep {
            block_table: Tensor::from_slice(&step.block_table, (batch, step.max_blocks), device)?,
            seq_lens: Tensor::from_slice(&step.seq_lens, batch, device)?,
            token_seq: Tensor::from_slice(&step.token_seq, tokens, device)?,
            write_rows: Tensor::from_slice(&step.write_rows, tokens, device)?,
            visible: Tensor::from_vec(visible, tokens, device)?,
            max_visible: step.positions.iter().max().map_or(0, |p| p + 1),
        };
        Ok(DeviceStep { rope, dense, paged })
    }

    fn run_step(
        &self,
        batch: &[SeqChunk],
        step: &StepLayout,
        pool: &PagedKvCache,
        all_logits: bool,
    ) -> Result<Tensor> {
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|e| e.tokens.iter().copied())
            .collect();
        let ids = Tensor::from_vec(ids, step.positions.len(), self.device())?;
        let last = match all_logits {
            true => None,
            false => Some(Tensor::from_slice(
                &step.last_tokens,
                step.batch,
                self.output_device(),
            )?),
        };
        self.forward_paged(
            &ids,
            pool,
            |device| self.device_step(step, device),
            last.as_ref(),
        )
    }

    /// The layers over `pool` for the tokens `ids` (`U32 [T]` on [`Self::device`]), segment by segment
    /// ([`Self::segments`]), each device's layout made by `layout` when its first segment with layers needs
    /// it; f32 logits of the rows `last` picks (`U32` on [`Self::output_device`]), or of every token.
    fn forward_paged(
        &self,
        ids: &Tensor,
        pool: &PagedKvCache,
        mut layout: impl FnMut(usize) -> Result<DeviceStep>,
        last: Option<&Tensor>,
    ) -> Result<Tensor> {
        let mut per_device: Vec<Option<DeviceStep>> =
            (0..self.devices.len()).map(|_| None).collect();
        let mut x = ids.clone();
        for (i, segment) in self.segments().iter().enumerate() {
            if i > 0 {
                x = self.transfer(&x, segment.device)?;
            }
            if !segment.layers.is_empty() && per_device[segment.device].is_none() {
                per_device[segment.device] = Some(layout(segment.device)?);
            }
            let step = per_device[segment.device].as_ref();
            x = self.run_segment(segment, &x, pool, step, last)?;
        }
        Ok(x)
    }

    /// The forward pass as runs of work on one device, in order: the embeddings, the layers and the head,
    /// cut wherever the plan moves the hidden state to another device.
    fn segments(&self) -> Vec<Segment> {
        let mut segments = vec![Segment {
            device: self.plan.embed_device,
            embed: true,
            layers: 0..0,
            head: false,
        }];
        for (l, layer) in self.plan.layers.iter().enumerate() {
            let here = segments.last_mut().expect("the embeddings' segment");
            if layer.device == here.device {
                here.layers = if here.layers.is_empty() {
                    l..l + 1
                } else {
                    here.layers.start..l + 1
                };
            } else {
                segments.push(Segment {
                    device: layer.device,
                    embed: false,
                    layers: l..l + 1,
                    head: false,
                });
            }
        }
        let here = segments.last_mut().expect("the embeddings' segment");
        if here.device == self.plan.head_device {
            here.head = true;
        } else {
            segments.push(Segment {
                device: self.plan.head_device,
                embed: false,
                layers: 0..0,
                head: true,
            });
        }
        segments
    }

    /// One segment over `input`: the token ids where it starts with the embeddings, else the hidden state
    /// on its device; `step` is the device's layout where it has layers. Returns the hidden state, or where
    /// it ends with the head, f32 logits of the rows `last` picks (or of every token).
    fn run_segment(
        &self,
        segment: &Segment,
        input: &Tensor,
        pool: &PagedKvCache,
        step: Option<&DeviceStep>,
        last: Option<&Tensor>,
    ) -> Result<Tensor> {
        let mut x = Residual::new(match segment.embed {
            true => self.embed_tokens.index_select(input, 0)?,
            false => input.clone(),
        });
        for l in segment.layers.clone() {
            let step = step
                .ok_or_else(|| ModelError::PlanDevices(format!("no step layout for layer {l}")))?;
            let kv = LayerKv::Paged {
                cache: &pool.layers[l],
                step: &step.paged,
            };
            x = self.layers[l]
                .forward(&x, &step.rope, kv, step.dense.as_ref())?
                .0;
        }
        if !segment.head {
            return x.resolve();
        }
        if let Some(last) = last {
            x = x.index_select(last)?;
        }
        let (_, hidden) = x.norm(&self.norm)?;
        Ok(self.lm_head.forward(&hidden)?.to_dtype(DType::F32)?)
    }

    fn run(
        &self,
        input_ids: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
        mut selections: Option<&mut Vec<Tensor>>,
    ) -> Result<(Tensor, Tensor)> {
        let t = input_ids.len();
        if t == 0 {
            return Err(ModelError::EmptyInput);
        }
        self.check_tokens(input_ids, start_pos)?;
        if cache.layers.len() != self.layers.len() {
            return Err(ModelError::CacheShape(format!(
                "{} layers, model has {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        cache.check_append(start_pos, t)?;

        let first = self.plan.embed_device;
        let rope =
            Rope::at_positions(&self.config, start_pos, t, self.dtype, &self.devices[first])?;
        // Dense mode attends to every causal position in every layer: one selection for all of them.
        let dense = match self.mode {
            AttentionMode::Sparse => None,
            AttentionMode::Dense => Some(all_causal_positions(t, start_pos, &self.devices[first])?),
        };
        // RoPE tables and the dense selection, copied once to each device the layers use.
        let mut per_device: Vec<Option<(Rope, Option<Tensor>)>> = vec![None; self.devices.len()];
        per_device[first] = Some((rope.clone(), dense.clone()));
        let ids = Tensor::from_slice(input_ids, t, &self.devices[first])?;
        let mut x = Residual::new(self.embed_tokens.index_select(&ids, 0)?);
        let mut here = first;
        for (layer, layer_cache) in self.layers.iter().zip(&cache.layers) {
            if layer.device != here {
                x = Residual::new(self.transfer(&x.resolve()?, layer.device)?);
                here = layer.device;
            }
            if per_device[here].is_none() {
                let device = &self.devices[here];
                let dense_here = dense
                    .as_ref()
                    .map(|d| copy_to_device(d, device))
                    .transpose()?;
                per_device[here] = Some((rope.to_device(device)?, dense_here));
            }
            let (rope, dense) = per_device[here].as_ref().ok_or_else(|| {
                ModelError::PlanDevices(format!("no RoPE tables on plan device {here}"))
            })?;
            let kv = LayerKv::Contiguous {
                cache: layer_cache,
                start_pos,
            };
            let (next, selected) = layer.forward(&x, rope, kv, dense.as_ref())?;
            if let Some(selections) = selections.as_deref_mut() {
                selections.push(selected);
            }
            x = next;
        }
        if self.plan.head_device != here {
            x = Residual::new(self.transfer(&x.resolve()?, self.plan.head_device)?);
        }
        cache.advance(t);
        let (_, hidden) = x.norm(&self.norm)?;
        let logits = self.lm_head.forward(&hidden)?.to_dtype(DType::F32)?;
        Ok((logits, hidden))
    }
}
