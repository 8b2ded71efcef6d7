//! The graph-build pass: device placement, then backend dispatch per layer and op, giving a [`Plan`].
//!
//! # Contract
//!
//! [`Plan::build`] runs once, before any weight is read, from the config, the devices (real, or assumed for
//! a plan that is only printed) and [`PlanOptions`]:
//!
//! 1. **Placement.** Every decoder layer costs its weight bytes ([`crate::sizes`]) plus its KV cache for
//!    `options.context` tokens; the embeddings go with the first layer's device, the final norm and
//!    `lm_head` with the last one's (a tied `lm_head` on another device is a copy and counted there).
//!    With `options.layer_devices` the map is the user's; otherwise the layers are split in order into
//!    contiguous runs, each device filled up to its share of the total in proportion to its memory and never
//!    past its memory. A plan that does not fit fails with [`PlanError::DoesNotFit`], naming the device
//!    where placement ran out and the bytes missing. With `options.mtp` the first MTP layer (speculative
//!    decoding's draft block, [`Plan::mtp`]) goes with the head, whose `lm_head` it shares, and its weights
//!    and KV cache count there.
//! 2. **Dispatch.** For each layer and op, [`glm5_ops::Registry::dispatch`] on the layer's device with the
//!    [`OpSpec`] the config implies: the user's forced backend if it validates, else the first valid one by
//!    priority; no valid backend fails the build with every candidate's reasons. [`AttentionMode::Dense`]
//!    (only ever the user's explicit choice) skips the indexer and asks sparse_mla for every position the
//!    model can hold (`top_k = max_position_embeddings`).
//!
//! The plan carries, per layer: device, dtype, weight and cache bytes, and per op the chosen backend (bound
//! into the graph by `glm5.rs`; the forward pass selects nothing) with the reasons every other backend was
//! not chosen.

use glm5_ops::KeyFormat;
use std::collections::BTreeMap;

use candle_core::DType;
use glm5_ops::{CacheLayout, Choice, DeviceDesc, Op, OpSpec, Registry};

use crate::config::{Config, MlpKind};
pub use crate::error::PlanError;
use crate::sizes;
pub use crate::units::fmt_bytes;

/// Which positions each query attends to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionMode {
    /// DeepSeek Sparse Attention: the indexer's top-`index_topk` positions (the model as trained).
    #[default]
    Sparse,
    /// Every causal position, indexer skipped. Only for debugging and quality comparisons, never a fallback.
    Dense,
}

/// Tokens of KV cache a plan reserves per sequence when not told (clipped to the model's context).
pub const DEFAULT_PLAN_CONTEXT: usize = 8192;

/// What the user asks of the build.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// Weights, activations and KV cache dtype (the router stays f32).
    pub dtype: DType,
    pub attention: AttentionMode,
    /// Tokens of KV cache reserved per layer; `None`: [`DEFAULT_PLAN_CONTEXT`] or the model's context.
    pub context: Option<usize>,
    /// Backend forced per op (`--backend op=name`, `GLM5_BACKEND`, or set here).
    pub forced: BTreeMap<Op, String>,
    /// Device index (into the plan's devices) of every layer; `None`: automatic placement.
    pub layer_devices: Option<Vec<usize>>,
    /// How the indexer key cache stores keys (`--index-cache`).
    pub index_keys: KeyFormat,
    /// Load the first MTP layer as speculative decoding's draft (`--mtp`); the config must have one.
    pub mtp: bool,
    /// Quantise the checkpoint's unquantised projections to block-scaled FP8 at load (`--fp8-projections`,
    /// [`sizes::quantized_at_load`]).
    pub fp8_projections: bool,
}

impl PlanOptions {
    pub fn new(dtype: DType, attention: AttentionMode) -> Self {
        Self {
            dtype,
            attention,
            context: None,
            forced: BTreeMap::new(),
            layer_devices: None,
            index_keys: KeyFormat::Float,
            mtp: false,
            fp8_projections: false,
        }
    }
}

/// One op of one layer.
#[derive(Debug, Clone)]
pub struct OpPlan {
    pub op: Op,
    pub spec: OpSpec,
    /// `None`: the op does not run (the indexer in dense mode).
    pub choice: Option<Choice>,
}

impl OpPlan {
    /// The chosen backend's name, or why the op does not run.
    pub fn backend(&self) -> &'static str {
        match &self.choice {
            Some(choice) => choice.entry.name,
            None => "skipped (dense mode)",
        }
    }
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerPlan {
    pub layer: usize,
    /// Index into [`Plan::devices`].
    pub device: usize,
    pub mlp: MlpKind,
    pub dtype: DType,
    pub params: u64,
    pub weight_bytes: u64,
    /// KV-cache bytes per token of context (latent row + indexer key).
    pub cache_bytes_per_token: u64,
    /// sparse_mla then dsa_indexer.
    pub ops: Vec<OpPlan>,
}

impl LayerPlan {
    pub fn op(&self, op: Op) -> Option<&OpPlan> {
        self.ops.iter().find(|o| o.op == op)
    }
}

/// Bytes and layers of one device in a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceUsage {
    pub device: usize,
    pub layers: Vec<usize>,
    pub params: u64,
    pub weight_bytes: u64,
    pub cache_bytes_per_token: u64,
    /// KV cache for the plan's context.
    pub cache_bytes: u64,
    /// Memory left after weights and the context's KV cache.
    pub free_bytes: u64,
    /// Tokens of context the device's layers could cache in the memory the weights leave (`None`: no layers).
    pub max_context_tokens: Option<u64>,
}

/// Where every part of the model runs, and with which backends.
#[derive(Debug, Clone)]
pub struct Plan {
    pub devices: Vec<DeviceDesc>,
    pub dtype: DType,
    pub attention: AttentionMode,
    /// How the indexer key cache stores keys.
    pub index_keys: KeyFormat,
    /// Tokens of KV cache reserved.
    pub context: usize,
    pub embed_device: usize,
    pub embed_params: u64,
    pub embed_bytes: u64,
    pub head_device: usize,
    pub head_params: u64,
    /// Norm and lm_head (a tied head counts here only when it is a copy on another device).
    pub head_bytes: u64,
    pub layers: Vec<LayerPlan>,
    /// The first MTP layer (`model.layers.{num_hidden_layers}`), on the head's device, when asked for.
    pub mtp: Option<LayerPlan>,
    /// Whether the loader quantises unquantised projections to FP8 ([`PlanOptions::fp8_projections`]).
    pub fp8_projections: bool,
}

/// The spec one op of every layer asks for.
pub fn op_spec(
    config: &Config,
    op: Op,
    dtype: DType,
    attention: AttentionMode,
    index_keys: KeyFormat,
) -> OpSpec {
    match op {
        Op::SparseMla => OpSpec {
            op,
            dtype,
            heads: config.num_attention_heads,
            head_dim: config.latent_dim(),
            value_dim: Some(config.kv_lora_rank),
            top_k: match attention {
                AttentionMode::Sparse => config.index_topk,
                AttentionMode::Dense => config.max_position_embeddings,
            },
            layout: CacheLayout::Contiguous,
            key_format: KeyFormat::Float,
        },
        Op::DsaIndexer => OpSpec {
            op,
            dtype,
            heads: config.index_n_heads,
            head_dim: config.index_head_dim,
            value_dim: None,
            top_k: config.index_topk,
            layout: CacheLayout::Contiguous,
            key_format: index_keys,
        },
    }
}

impl Plan {
    /// Runs of consecutive layers on one device, in layer order: the stages a step passes through (1 when
    /// every layer is on one device).
    pub fn pipeline_stages(&self) -> usize {
        1 + self
            .layers
            .windows(2)
            .filter(|pair| pair[0].device != pair[1].device)
            .count()
    }

    /// Placement then dispatch (module docs).
    pub fn build(
        config: &Config,
        devices: Vec<DeviceDesc>,
        options: &PlanOptions,
        registry: &Registry,
    ) -> Result<Plan, PlanError> {
        Self::build_sized(config, devices, options, registry, &|t| {
            sizes::resident_bytes(config, t)
        })
    }

    /// [`Plan::build`] with each tensor costing `resident_bytes` (a checkpoint that keeps some tensors
    /// quantised, e.g. GGUF: `Checkpoint::resident_bytes`) instead of [`sizes::resident_bytes`] (its elements
    /// at `options.dtype`, or the config's quantised format).
    pub fn build_sized(
        config: &Config,
        devices: Vec<DeviceDesc>,
        options: &PlanOptions,
        registry: &Registry,
        resident_bytes: &dyn Fn(&sizes::TensorInfo) -> u64,
    ) -> Result<Plan, PlanError> {
        // Projections quantised at load cost their FP8 bytes.
        let resident = |t: &sizes::TensorInfo| {
            options
                .fp8_projections
                .then(|| sizes::fp8_at_load_bytes(config, t))
                .flatten()
                .unwrap_or_else(|| resident_bytes(t))
        };
        let bytes = |t: &[sizes::TensorInfo]| t.iter().map(resident).sum::<u64>();
        if devices.is_empty() {
            return Err(PlanError::NoDevices);
        }
        let max = config.max_position_embeddings;
        let context = options.context.unwrap_or(DEFAULT_PLAN_CONTEXT.min(max));
        if context == 0 || context > max {
            return Err(PlanError::Context { got: context, max });
        }
        let dtype = options.dtype;
        let n = config.num_hidden_layers;
        let layer_sizes: Vec<(u64, u64)> = (0..n)
            .map(|l| {
                let t = sizes::layer_tensors(config, l, dtype);
                (sizes::params(&t), bytes(&t))
            })
            .collect();
        let per_token = sizes::cache_bytes_per_token(config, dtype, options.index_keys);
        let embed = sizes::embedding_tensors(config, dtype);
        let head = sizes::head_tensors(config, dtype);
        let (embed_params, embed_bytes) = (sizes::params(&embed), bytes(&embed));
        let (mut head_params, mut head_bytes) = (sizes::params(&head), bytes(&head));
        let mtp_sizes = if options.mtp {
            if config.num_nextn_predict_layers == 0 {
                return Err(PlanError::NoMtpLayer);
            }
            let t = sizes::mtp_tensors(config, dtype);
            Some((sizes::params(&t), bytes(&t)))
        } else {
            None
        };
        // The MTP layer travels with the head: its weights and its own KV cache for the context.
        let mtp_cost = mtp_sizes.map_or(0, |(_, bytes)| bytes + per_token * context as u64);

        let layer_cost: Vec<u64> = layer_sizes
            .iter()
            .map(|&(_, bytes)| bytes + per_token * context as u64)
            .collect();
        let layer_devices = match &options.layer_devices {
            Some(map) => {
                if map.len() != n {
                    return Err(PlanError::LayerMapLength {
                        found: map.len(),
                        layers: n,
                    });
                }
                if let Some((layer, &device)) =
                    map.iter().enumerate().find(|(_, &d)| d >= devices.len())
                {
                    return Err(PlanError::LayerMapDevice {
                        layer,
                        device,
                        devices: devices.len(),
                    });
                }
                map.clone()
            }
            None => Vec::new(),
        };
        let first = layer_devices.first().copied().unwrap_or(0);
        let last = layer_devices.last().copied().unwrap_or(0);
        // A tied head shares the embedding tensor: it costs nothing unless it lands on another device.
        let tied_copy = config.tie_word_embeddings;
        if tied_copy {
            head_params += embed_params;
            head_bytes += embed_bytes;
        }

        // Items in graph order: embeddings, layers, head.
        let mut items: Vec<(String, u64)> = vec![("the embeddings".into(), embed_bytes)];
        items.extend(
            layer_cost
                .iter()
                .enumerate()
                .map(|(l, &c)| (format!("layer {l}"), c)),
        );
        let head_item = if options.mtp {
            "the final norm, lm_head and the MTP layer"
        } else {
            "the final norm and lm_head"
        };
        items.push((head_item.into(), head_bytes + mtp_cost));
        let weights_total: u64 = embed_bytes
            + head_bytes
            + mtp_sizes.map_or(0, |(_, bytes)| bytes)
            + layer_sizes.iter().map(|&(_, b)| b).sum::<u64>();
        let layers_with_cache = n as u64 + u64::from(options.mtp);
        let cache_total = per_token * context as u64 * layers_with_cache;
        let capacity: Vec<u64> = devices.iter().map(|d| d.memory_bytes).collect();
        let available: u64 = capacity.iter().fold(0u64, |a, &c| a.saturating_add(c));

        let assignment: Vec<usize> = if layer_devices.is_empty() {
            place(&items, &capacity, tied_copy).map_err(|(item, device, used)| {
                does_not_fit(
                    &items[item],
                    &devices[device],
                    used,
                    weights_total,
                    cache_total,
                    context,
                    available,
                )
            })?
        } else {
            let mut assignment = vec![first];
            assignment.extend(&layer_devices);
            assignment.push(last);
            assignment
        };
        let (embed_device, head_device) = (assignment[0], assignment[n + 1]);
        if tied_copy && head_device == embed_device {
            head_params -= embed_params;
            head_bytes -= embed_bytes;
            items[n + 1].1 = head_bytes + mtp_cost;
        }
        // Every device's total against its memory (catches user maps; automatic placement already fits).
        let mut used = vec![0u64; devices.len()];
        for (i, &d) in assignment.iter().enumerate() {
            used[d] += items[i].1;
            if used[d] > capacity[d] {
                return Err(does_not_fit(
                    &items[i],
                    &devices[d],
                    used[d] - items[i].1,
                    weights_total,
                    cache_total,
                    context,
                    available,
                ));
            }
        }

        let layer_plan =
            |layer: usize, device: usize, mlp: MlpKind, (params, weight_bytes): (u64, u64)| {
                let mut ops = Vec::new();
                for op in Op::ALL {
                    let spec = op_spec(config, op, dtype, options.attention, options.index_keys);
                    let choice =
                        if op == Op::DsaIndexer && options.attention == AttentionMode::Dense {
                            None
                        } else {
                            Some(
                                registry
                                    .dispatch(
                                        &spec,
                                        &devices[device],
                                        options.forced.get(&op).map(String::as_str),
                                    )
                                    .map_err(|source| PlanError::Dispatch { layer, source })?,
                            )
                        };
                    ops.push(OpPlan { op, spec, choice });
                }
                Ok(LayerPlan {
                    layer,
                    device,
                    mlp,
                    dtype,
                    params,
                    weight_bytes,
                    cache_bytes_per_token: per_token,
                    ops,
                })
            };
        let layers = layer_sizes
            .iter()
            .enumerate()
            .map(|(layer, &sizes)| {
                layer_plan(
                    layer,
                    assignment[layer + 1],
                    config.mlp_layer_types[layer],
                    sizes,
                )
            })
            .collect::<Result<Vec<_>, PlanError>>()?;
        let mtp = mtp_sizes
            .map(|sizes| layer_plan(n, head_device, MlpKind::MoE, sizes))
            .transpose()?;
        Ok(Plan {
            devices,
            dtype,
            attention: options.attention,
            index_keys: options.index_keys,
            context,
            embed_device,
            embed_params,
            embed_bytes,
            head_device,
            head_params,
            head_bytes,
            layers,
            mtp,
            fp8_projections: options.fp8_projections,
        })
    }

    /// Parameters the plan holds (a tied head counted once unless copied).
    pub fn params(&self) -> u64 {
        self.embed_params + self.head_params + self.all_layers().map(|l| l.params).sum::<u64>()
    }

    pub fn weight_bytes(&self) -> u64 {
        self.embed_bytes + self.head_bytes + self.all_layers().map(|l| l.weight_bytes).sum::<u64>()
    }

    /// KV-cache bytes per token over all layers (the MTP layer's included).
    pub fn cache_bytes_per_token(&self) -> u64 {
        self.all_layers().map(|l| l.cache_bytes_per_token).sum()
    }

    /// The decoder layers, then the MTP layer if the plan has one.
    pub fn all_layers(&self) -> impl Iterator<Item = &LayerPlan> {
        self.layers.iter().chain(&self.mtp)
    }

    /// Per device: layers, weights, cache, what is left and the context it could hold.
    pub fn device_usage(&self) -> Vec<DeviceUsage> {
        (0..self.devices.len())
            .map(|d| {
                let on: Vec<&LayerPlan> = self.all_layers().filter(|l| l.device == d).collect();
                let mut params: u64 = on.iter().map(|l| l.params).sum();
                let mut weight_bytes: u64 = on.iter().map(|l| l.weight_bytes).sum();
                if self.embed_device == d {
                    params += self.embed_params;
                    weight_bytes += self.embed_bytes;
                }
                if self.head_device == d {
                    params += self.head_params;
                    weight_bytes += self.head_bytes;
                }
                let per_token: u64 = on.iter().map(|l| l.cache_bytes_per_token).sum();
                let cache_bytes = per_token * self.context as u64;
                let capacity = self.devices[d].memory_bytes;
                DeviceUsage {
                    device: d,
                    layers: on.iter().map(|l| l.layer).collect(),
                    params,
                    weight_bytes,
                    cache_bytes_per_token: per_token,
                    cache_bytes,
                    free_bytes: capacity.saturating_sub(weight_bytes + cache_bytes),
                    max_context_tokens: (per_token > 0)
                        .then(|| capacity.saturating_sub(weight_bytes) / per_token),
                }
            })
            .collect()
    }

    /// Layer indices after which the hidden state moves to another device: `(layer, from, to)`, where
    /// `layer` is the first layer on `to` (`num_hidden_layers` for the head).
    pub fn boundaries(&self) -> Vec<(usize, usize, usize)> {
        let mut here = self.embed_device;
        let mut out = Vec::new();
        for l in &self.layers {
            if l.device != here {
                out.push((l.layer, here, l.device));
                here = l.device;
            }
        }
        if self.head_device != here {
            out.push((self.layers.len(), here, self.head_device));
        }
        out
    }
}

fn does_not_fit(
    item: &(String, u64),
    device: &DeviceDesc,
    used: u64,
    weights: u64,
    cache: u64,
    context: usize,
    available: u64,
) -> PlanError {
    let needed = weights + cache;
    let device_free = device.memory_bytes.saturating_sub(used);
    PlanError::DoesNotFit {
        device: device.to_string(),
        item: item.0.clone(),
        item_bytes: item.1,
        device_free,
        device_capacity: device.memory_bytes,
        needed,
        weights,
        cache,
        context,
        available,
        missing: needed
            .saturating_sub(available)
            .max(item.1.saturating_sub(device_free)),
    }
}

/// Splits `items` (in order) into contiguous runs over the devices: device `i` takes items while they fit
/// in its memory and the running total stays within its share (in proportion to memory) of the whole; the
/// last device takes whatever fits. A tied head (`tied_copy`) costs nothing on the embeddings' device.
/// `Err((item, device, used))`: the first item that fits nowhere, the last device tried and its bytes used.
fn place(
    items: &[(String, u64)],
    capacity: &[u64],
    tied_copy: bool,
) -> Result<Vec<usize>, (usize, usize, u64)> {
    let total: f64 = items.iter().map(|i| i.1 as f64).sum();
    let memory: f64 = capacity.iter().map(|&c| c as f64).sum();
    let mut share_end = Vec::with_capacity(capacity.len());
    let mut running = 0.0;
    for &c in capacity {
        running += c as f64;
        share_end.push(total * running / memory.max(1.0));
    }
    let mut used = vec![0u64; capacity.len()];
    let mut assignment = Vec::with_capacity(items.len());
    let (mut device, mut placed) = (0usize, 0.0f64);
    for (i, (_, bytes)) in items.iter().enumerate() {
        let is_head = i + 1 == items.len();
        loop {
            let cost = if is_head && tied_copy && device == assignment[0] {
                0
            } else {
                *bytes
            };
            let fits = used[device] + cost <= capacity[device];
            let last = device + 1 == capacity.len();
            let within_share = used[device] == 0 || placed + cost as f64 / 2.0 <= share_end[device];
            if fits && (within_share || last) {
                used[device] += cost;
                placed += cost as f64;
                assignment.push(device);
                break;
            }
            if last {
                return Err((i, device, used[device]));
            }
            device += 1;
        }
    }
    Ok(assignment)
}
