//! The GLM-5 module graph (`GlmMoeDsaForCausalLM`), in the order of `docs/architecture.md`: §3.1 block
//! structure, §3.2 RoPE, §3.3–3.4 MLA in its absorbed form, §4 the DSA lightning indexer, §5 MoE routing.
//!
//! One sequence at a time: `forward(input_ids, start_pos, &mut cache)` runs a prompt chunk or one decode
//! token and returns the logits of every position it was given. Attention is always the absorbed (MQA) form
//! over the latent cache: `W_UK` is folded into the query, `W_UV` applied after, so prefill and decode share
//! one path through the `sparse_mla` op.

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, DeviceLocation, Module, Tensor, D};
use candle_nn::{LayerNorm, Linear};
use glm5_ops::registry::{DsaIndexerFn, SparseMlaFn};
use glm5_ops::{DeviceDesc, DeviceKind, Kernel, Op, Registry};

use crate::cache::{KvCache, LayerCache};
use crate::config::{Config, MlpKind, INDEX_KEY_NORM_EPS, LATENT_NORM_EPS};
use crate::error::{ModelError, Result};
pub use crate::plan::AttentionMode;
use crate::plan::{LayerPlan, Plan, PlanOptions};
use crate::weights::{Checkpoint, Matrix};

/// Fetches tensors by checkpoint name with the shapes the config implies.
struct Loader<'a> {
    checkpoint: &'a Checkpoint,
    dtype: DType,
    device: &'a Device,
    /// The plan's description of `device`: what quantised weights are dispatched on.
    desc: &'a DeviceDesc,
}

impl Loader<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.checkpoint.tensor(name, shape, self.dtype, self.device)
    }

    fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.checkpoint.tensor(name, shape, DType::F32, self.device)
    }

    /// A bias-free `nn.Linear` stored as `[out, in]`, quantised if the checkpoint keeps it so.
    fn linear(&self, prefix: &str, in_dim: usize, out_dim: usize) -> Result<Proj> {
        let name = format!("{prefix}.weight");
        Ok(
            match self
                .checkpoint
                .matrix(&name, [out_dim, in_dim], self.dtype, self.device)?
            {
                Matrix::Dense(weight) => Proj::Dense(Linear::new(weight, None)),
                Matrix::Quantized(weight) => {
                    // The weight's format must have a quantized_matmul backend on this device.
                    glm5_ops::quantized_matmul::dispatch(weight.dtype(), self.desc).map_err(
                        |source| ModelError::QuantizedMatmul {
                            tensor: name.clone(),
                            source: Box::new(source),
                        },
                    )?;
                    Proj::Quantized(QMatMul::from_arc(weight)?)
                }
            },
        )
    }

    fn rms_norm(&self, prefix: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: self.tensor(&format!("{prefix}.weight"), &[dim])?,
            eps,
        })
    }
}

/// A bias-free linear layer: a dense matrix, or quantised (GGUF) blocks multiplied by candle's `QMatMul`,
/// which runs its own kernels on the weights' device (CUDA mat-vec for a few rows, MMQ above; the CPU's
/// vec-dot) without expanding them. Input and output are in the model dtype; `QMatMul` computes in f32.
enum Proj {
    Dense(Linear),
    Quantized(QMatMul),
}

impl Module for Proj {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Proj::Dense(linear) => linear.forward(x),
            Proj::Quantized(weight) => glm5_ops::quantized_matmul::quantized_matmul(x, weight)
                .map_err(|e| match e {
                    glm5_ops::OpError::Candle(e) => e,
                    other => candle_core::Error::Msg(other.to_string()),
                }),
        }
    }
}

/// §3.1 RMSNorm as HF computes it: normalise in f32, cast back, then scale.
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x32 = x.to_dtype(DType::F32)?;
        let inv_rms = (x32.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        x32.broadcast_mul(&inv_rms)?
            .to_dtype(x.dtype())?
            .broadcast_mul(&self.weight)
    }
}

/// §3.2 interleaved RoPE at the positions of one forward call: pairs `(x[2i], x[2i+1])` rotate by
/// `pos · θ^(-2i/R)`. Used on the MLA rope slice (last dims) and the indexer rope slice (first dims).
#[derive(Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn at_positions(
        config: &Config,
        start_pos: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let half = config.qk_rope_head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                (1.0 / config
                    .rope_theta
                    .powf(2.0 * i as f64 / config.qk_rope_head_dim as f64)) as f32
            })
            .collect();
        let (mut cos, mut sin) = (
            Vec::with_capacity(len * half),
            Vec::with_capacity(len * half),
        );
        for pos in start_pos..start_pos + len {
            for f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (len, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (len, half), device)?.to_dtype(dtype)?;
        Ok(Self { cos, sin })
    }

    /// The same tables on `device` (one copy per device the layers run on).
    fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            cos: self.cos.to_device(device)?,
            sin: self.sin.to_device(device)?,
        })
    }

    /// Rotates `x` of shape `[T, heads, R]`.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let per_head = x.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
        let rotated = candle_nn::rotary_emb::rope_i(&per_head, &self.cos, &self.sin)?;
        Ok(rotated.squeeze(0)?.transpose(0, 1)?)
    }
}

/// §4 The DSA lightning indexer: scores every visible past token for each query and keeps the top-k.
struct Indexer {
    wq_b: Proj,
    wk: Proj,
    k_norm: LayerNorm,
    weights_proj: Proj,
    n_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    /// Keys kept per query (`index_topk`).
    index_topk: usize,
    weight_scale: f64,
    /// The backend the plan bound; `None` when the indexer does not run (dense mode).
    kernel: Option<DsaIndexerFn>,
}

impl Indexer {
    fn load(
        config: &Config,
        loader: &Loader,
        prefix: &str,
        kernel: Option<DsaIndexerFn>,
    ) -> Result<Self> {
        let (heads, dim) = (config.index_n_heads, config.index_head_dim);
        Ok(Self {
            wq_b: loader.linear(&format!("{prefix}.wq_b"), config.q_lora_rank, heads * dim)?,
            wk: loader.linear(&format!("{prefix}.wk"), config.hidden_size, dim)?,
            k_norm: LayerNorm::new(
                loader.tensor(&format!("{prefix}.k_norm.weight"), &[dim])?,
                loader.tensor(&format!("{prefix}.k_norm.bias"), &[dim])?,
                INDEX_KEY_NORM_EPS,
            ),
            weights_proj: loader.linear(
                &format!("{prefix}.weights_proj"),
                config.hidden_size,
                heads,
            )?,
            n_heads: heads,
            head_dim: dim,
            rope_dim: config.qk_rope_head_dim,
            index_topk: config.index_topk,
            weight_scale: config.index_weight_scale(),
            kernel,
        })
    }

    /// RoPE on the first `rope_dim` dims of `x` `[T, heads, head_dim]`; the rest pass through.
    fn rotate_leading(&self, x: &Tensor, rope: &Rope) -> Result<Tensor> {
        let rotated = rope.apply(&x.narrow(2, 0, self.rope_dim)?)?;
        if self.rope_dim == self.head_dim {
            return Ok(rotated);
        }
        let pass = x.narrow(2, self.rope_dim, self.head_dim - self.rope_dim)?;
        Ok(Tensor::cat(&[rotated, pass], 2)?)
    }

    /// `hidden` `[T, hidden]` (the normed layer input), `q_lora` `[T, q_lora_rank]` (after q_a_layernorm).
    /// Returns the selected positions `[T, index_topk]` (i32, -1 padded) and caches this chunk's keys.
    fn forward(
        &self,
        hidden: &Tensor,
        q_lora: &Tensor,
        start_pos: usize,
        rope: &Rope,
        cache: &LayerCache,
    ) -> Result<Tensor> {
        let t = hidden.dim(0)?;
        let q = self
            .wq_b
            .forward(q_lora)?
            .reshape((t, self.n_heads, self.head_dim))?;
        let q = self.rotate_leading(&q, rope)?;
        let k = self
            .k_norm
            .forward(&self.wk.forward(hidden)?)?
            .unsqueeze(1)?;
        let k = self.rotate_leading(&k, rope)?.squeeze(1)?;
        let keys = cache.append_index_keys(&k, start_pos)?;
        let head_weights =
            (self.weights_proj.forward(hidden)?.to_dtype(DType::F32)? * self.weight_scale)?;
        let visible: Vec<usize> = (1..=t).map(|i| start_pos + i).collect();
        let kernel = self.kernel.ok_or_else(|| {
            ModelError::PlanDevices("the plan bound no dsa_indexer backend (dense mode)".into())
        })?;
        Ok(kernel(
            &q,
            &head_weights,
            keys.view(),
            &visible,
            self.index_topk,
        )?)
    }
}

/// §3.3–3.4 Multi-head latent attention with the DSA restriction, computed in the absorbed form.
struct Attention {
    q_a_proj: Proj,
    q_a_layernorm: RmsNorm,
    q_b_proj: Proj,
    kv_a_proj_with_mqa: Proj,
    kv_a_layernorm: RmsNorm,
    /// `W_UK` per head, `[heads, qk_nope_head_dim, kv_lora_rank]`: folded into the query.
    w_uk: Tensor,
    /// `W_UVᵀ` per head, `[heads, kv_lora_rank, v_head_dim]`: applied to the attended latent.
    w_uv_t: Tensor,
    o_proj: Proj,
    indexer: Indexer,
    heads: usize,
    nope_dim: usize,
    rope_dim: usize,
    kv_lora_rank: usize,
    v_head_dim: usize,
    softmax_scale: f64,
    /// The sparse_mla backend the plan bound.
    sparse_mla: SparseMlaFn,
}

impl Attention {
    fn load(config: &Config, loader: &Loader, prefix: &str, layer: &LayerPlan) -> Result<Self> {
        let (sparse_mla, dsa_indexer) = bound_kernels(layer)?;
        let heads = config.num_attention_heads;
        let (nope, v, lora) = (
            config.qk_nope_head_dim,
            config.v_head_dim,
            config.kv_lora_rank,
        );
        let kv_b = loader
            .tensor(
                &format!("{prefix}.kv_b_proj.weight"),
                &[heads * (nope + v), lora],
            )?
            .reshape((heads, nope + v, lora))?;
        Ok(Self {
            q_a_proj: loader.linear(
                &format!("{prefix}.q_a_proj"),
                config.hidden_size,
                config.q_lora_rank,
            )?,
            q_a_layernorm: loader.rms_norm(
                &format!("{prefix}.q_a_layernorm"),
                config.q_lora_rank,
                LATENT_NORM_EPS,
            )?,
            q_b_proj: loader.linear(
                &format!("{prefix}.q_b_proj"),
                config.q_lora_rank,
                heads * config.qk_head_dim(),
            )?,
            kv_a_proj_with_mqa: loader.linear(
                &format!("{prefix}.kv_a_proj_with_mqa"),
                config.hidden_size,
                config.latent_dim(),
            )?,
            kv_a_layernorm: loader.rms_norm(
                &format!("{prefix}.kv_a_layernorm"),
                lora,
                LATENT_NORM_EPS,
            )?,
            w_uk: kv_b.narrow(1, 0, nope)?.contiguous()?,
            w_uv_t: kv_b.narrow(1, nope, v)?.transpose(1, 2)?.contiguous()?,
            o_proj: loader.linear(&format!("{prefix}.o_proj"), heads * v, config.hidden_size)?,
            indexer: Indexer::load(config, loader, &format!("{prefix}.indexer"), dsa_indexer)?,
            heads,
            nope_dim: nope,
            rope_dim: config.qk_rope_head_dim,
            kv_lora_rank: lora,
            v_head_dim: v,
            softmax_scale: config.softmax_scale(),
            sparse_mla,
        })
    }

    fn forward(
        &self,
        hidden: &Tensor,
        start_pos: usize,
        rope: &Rope,
        cache: &LayerCache,
        dense: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let t = hidden.dim(0)?;
        // Queries: q_lora (shared with the indexer) → per-head [nope | rope].
        let q_lora = self
            .q_a_layernorm
            .forward(&self.q_a_proj.forward(hidden)?)?;
        let q = self.q_b_proj.forward(&q_lora)?.reshape((
            t,
            self.heads,
            self.nope_dim + self.rope_dim,
        ))?;
        let q_nope = q.narrow(2, 0, self.nope_dim)?;
        let q_pe = rope.apply(&q.narrow(2, self.nope_dim, self.rope_dim)?)?;

        // This chunk's latent rows [c | k_pe] go into the cache; attention reads all cached rows.
        let kv = self.kv_a_proj_with_mqa.forward(hidden)?;
        let c = self
            .kv_a_layernorm
            .forward(&kv.narrow(1, 0, self.kv_lora_rank)?)?;
        let k_pe = rope
            .apply(
                &kv.narrow(1, self.kv_lora_rank, self.rope_dim)?
                    .unsqueeze(1)?,
            )?
            .squeeze(1)?;
        let latent = cache.append_latent(&Tensor::cat(&[c, k_pe], 1)?, start_pos)?;

        // Absorb W_UK: q̃_h = W_UK_hᵀ q_nope_h, so scores are 576-wide dots against the latent rows.
        let q_latent = q_nope
            .transpose(0, 1)?
            .contiguous()?
            .matmul(&self.w_uk)?
            .transpose(0, 1)?;
        let q_absorbed = Tensor::cat(&[q_latent, q_pe], 2)?.contiguous()?;

        let selected = match dense {
            None => self
                .indexer
                .forward(hidden, &q_lora, start_pos, rope, cache)?,
            Some(all_positions) => all_positions.clone(),
        };
        let (attended, _lse) = (self.sparse_mla)(
            &q_absorbed,
            &latent,
            &selected,
            self.kv_lora_rank,
            self.softmax_scale,
        )?;

        // Apply W_UV per head, then the output projection.
        let per_head = attended
            .transpose(0, 1)?
            .contiguous()?
            .matmul(&self.w_uv_t)?;
        let merged = per_head
            .transpose(0, 1)?
            .reshape((t, self.heads * self.v_head_dim))?;
        Ok((self.o_proj.forward(&merged)?, selected))
    }
}

/// The functions the plan chose for a layer: sparse_mla, and dsa_indexer unless it is skipped.
fn bound_kernels(layer: &LayerPlan) -> Result<(SparseMlaFn, Option<DsaIndexerFn>)> {
    let mismatch = |what: &str| ModelError::PlanDevices(format!("layer {}: {what}", layer.layer));
    let sparse_mla = match layer.op(Op::SparseMla).and_then(|o| o.choice.as_ref()) {
        Some(choice) => match choice.entry.kernel {
            Kernel::SparseMla(f) => f,
            _ => return Err(mismatch("the sparse_mla entry holds another op's kernel")),
        },
        None => return Err(mismatch("no sparse_mla backend in the plan")),
    };
    let dsa_indexer = match layer.op(Op::DsaIndexer).and_then(|o| o.choice.as_ref()) {
        Some(choice) => match choice.entry.kernel {
            Kernel::DsaIndexer(f) => Some(f),
            _ => return Err(mismatch("the dsa_indexer entry holds another op's kernel")),
        },
        None => None,
    };
    Ok((sparse_mla, dsa_indexer))
}

/// Dense mode's "selection": every position `0..=start_pos+i` for query `i`, -1 padded to a common width.
fn all_causal_positions(t: usize, start_pos: usize, device: &Device) -> Result<Tensor> {
    let width = start_pos + t;
    let rows: Vec<i32> = (0..t)
        .flat_map(|i| (0..width).map(move |s| if s <= start_pos + i { s as i32 } else { -1 }))
        .collect();
    Ok(Tensor::from_vec(rows, (t, width), device)?)
}

/// §3.1 `down(silu(gate(x)) ⊙ up(x))`: the dense MLP, each routed expert and the shared expert.
struct Mlp {
    gate_proj: Proj,
    up_proj: Proj,
    down_proj: Proj,
}

impl Mlp {
    fn load(loader: &Loader, prefix: &str, hidden: usize, intermediate: usize) -> Result<Self> {
        Ok(Self {
            gate_proj: loader.linear(&format!("{prefix}.gate_proj"), hidden, intermediate)?,
            up_proj: loader.linear(&format!("{prefix}.up_proj"), hidden, intermediate)?,
            down_proj: loader.linear(&format!("{prefix}.down_proj"), intermediate, hidden)?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gated =
            (candle_nn::ops::silu(&self.gate_proj.forward(x)?)? * self.up_proj.forward(x)?)?;
        self.down_proj.forward(&gated)
    }
}

/// §5 Sigmoid router (`noaux_tc`) in f32: the correction bias steers selection only.
struct Router {
    weight: Tensor,
    correction_bias: Vec<f32>,
    n_group: usize,
    topk_group: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    experts_per_token: usize,
    norm_topk_prob: bool,
    scaling: f32,
}

impl Router {
    /// For every token, its experts and their gate weights.
    fn route(&self, hidden: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let scores =
            candle_nn::ops::sigmoid(&hidden.to_dtype(DType::F32)?.matmul(&self.weight.t()?)?)?;
        let scores: Vec<Vec<f32>> = scores.to_vec2()?;
        Ok(scores.iter().map(|s| self.route_token(s)).collect())
    }

    fn route_token(&self, scores: &[f32]) -> Vec<(usize, f32)> {
        let choice: Vec<f32> = scores
            .iter()
            .zip(&self.correction_bias)
            .map(|(s, b)| s + b)
            .collect();
        // Group limiting: a group's score is the sum of its two best choice scores; keep topk_group groups.
        let group_size = choice.len() / self.n_group;
        let group_score = |g: usize| {
            let mut members: Vec<f32> = choice[g * group_size..(g + 1) * group_size].to_vec();
            members.sort_by(|a, b| b.total_cmp(a));
            members.iter().take(2).sum::<f32>()
        };
        let kept_groups = top_indices(
            &(0..self.n_group).map(group_score).collect::<Vec<_>>(),
            self.topk_group,
        );
        let allowed: Vec<f32> = choice
            .iter()
            .enumerate()
            .map(|(e, &c)| {
                if kept_groups.contains(&(e / group_size)) {
                    c
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let experts = top_indices(&allowed, self.experts_per_token);
        let mut gates: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
        if self.norm_topk_prob {
            let total = gates.iter().sum::<f32>() + 1e-20;
            gates.iter_mut().for_each(|g| *g /= total);
        }
        experts
            .into_iter()
            .zip(gates.into_iter().map(|g| g * self.scaling))
            .collect()
    }
}

/// Indices of the `k` largest values, ties toward the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// §5 Mixture of experts: routed experts weighted by the router, plus the unweighted shared expert.
struct MoE {
    router: Router,
    experts: Vec<Mlp>,
    shared_experts: Option<Mlp>,
}

impl MoE {
    fn load(config: &Config, loader: &Loader, prefix: &str) -> Result<Self> {
        let (hidden, n_experts) = (config.hidden_size, config.n_routed_experts);
        let router = Router {
            weight: loader.tensor_f32(&format!("{prefix}.gate.weight"), &[n_experts, hidden])?,
            correction_bias: loader
                .tensor_f32(
                    &format!("{prefix}.gate.e_score_correction_bias"),
                    &[n_experts],
                )?
                .to_vec1()?,
            n_group: config.n_group,
            topk_group: config.topk_group,
            experts_per_token: config.num_experts_per_tok,
            norm_topk_prob: config.norm_topk_prob,
            scaling: config.routed_scaling_factor as f32,
        };
        let experts = (0..n_experts)
            .map(|e| {
                Mlp::load(
                    loader,
                    &format!("{prefix}.experts.{e}"),
                    hidden,
                    config.moe_intermediate_size,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let shared_experts = (config.n_shared_experts > 0)
            .then(|| {
                let width = config.moe_intermediate_size * config.n_shared_experts;
                Mlp::load(loader, &format!("{prefix}.shared_experts"), hidden, width)
            })
            .transpose()?;
        Ok(Self {
            router,
            experts,
            shared_experts,
        })
    }

    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let routes = self.router.route(hidden)?;
        let mut tokens_of_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); self.experts.len()];
        for (token, choices) in routes.iter().enumerate() {
            for &(expert, gate) in choices {
                tokens_of_expert[expert].push((token as u32, gate));
            }
        }
        // Every expert's tokens and gates go to the device in one copy each (a copy per expert costs a
        // host-to-device transfer apiece: 16 per MoE layer at GLM-5's 8 experts per token); each expert
        // reads its slice.
        let assignments: Vec<&(u32, f32)> = tokens_of_expert.iter().flatten().collect();
        let all_rows = Tensor::from_vec(
            assignments.iter().map(|a| a.0).collect(),
            assignments.len(),
            hidden.device(),
        )?;
        let all_gates = Tensor::from_vec(
            assignments.iter().map(|a| a.1).collect(),
            (assignments.len(), 1),
            hidden.device(),
        )?
        .to_dtype(hidden.dtype())?;
        let mut out = hidden.zeros_like()?;
        let mut start = 0;
        for (expert, assigned) in self.experts.iter().zip(&tokens_of_expert) {
            if assigned.is_empty() {
                continue;
            }
            let rows = all_rows.narrow(0, start, assigned.len())?;
            let gates = all_gates.narrow(0, start, assigned.len())?;
            start += assigned.len();
            let y = expert
                .forward(&hidden.index_select(&rows, 0)?)?
                .broadcast_mul(&gates)?;
            out = out.index_add(&rows, &y, 0)?;
        }
        if let Some(shared) = &self.shared_experts {
            out = (out + shared.forward(hidden)?)?;
        }
        Ok(out)
    }
}

enum FeedForward {
    Dense(Mlp),
    MoE(MoE),
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
        let mlp = match config.mlp_layer_types[layer] {
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

    fn forward(
        &self,
        x: &Tensor,
        start_pos: usize,
        rope: &Rope,
        cache: &LayerCache,
        dense: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (attn, selected) = self.self_attn.forward(
            &self.input_layernorm.forward(x)?,
            start_pos,
            rope,
            cache,
            dense,
        )?;
        let x = (x + attn)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        let ffn = match &self.mlp {
            FeedForward::Dense(mlp) => mlp.forward(&h)?,
            FeedForward::MoE(moe) => moe.forward(&h)?,
        };
        Ok(((x + ffn)?, selected))
    }
}

/// The implementations one decoder layer runs.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerBackends {
    pub layer: usize,
    pub mlp: MlpKind,
    pub attention: AttentionMode,
    pub dsa_indexer: &'static str,
    pub sparse_mla: &'static str,
    pub device: String,
    pub dtype: DType,
}

impl std::fmt::Display for LayerBackends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "layer {:>3} | {:<6} {:?} {:?} | {:?} attention | dsa_indexer: {} | sparse_mla: {}",
            self.layer,
            self.device,
            self.dtype,
            self.mlp,
            self.attention,
            self.dsa_indexer,
            self.sparse_mla
        )
    }
}

/// GLM-5 (`GlmMoeDsaForCausalLM`) for one sequence at a time, its layers placed and its backends bound by
/// a [`Plan`].
pub struct Glm5ForCausalLM {
    config: Config,
    plan: Plan,
    /// The real device of every plan device.
    devices: Vec<Device>,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Proj,
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
            })
            .collect();
        let (vocab, hidden) = (config.vocab_size, config.hidden_size);
        let embed_tokens =
            loaders[plan.embed_device].tensor("model.embed_tokens.weight", &[vocab, hidden])?;
        let head_loader = &loaders[plan.head_device];
        let lm_head = if config.tie_word_embeddings && !checkpoint.contains("lm_head.weight") {
            Proj::Dense(Linear::new(
                embed_tokens.to_device(head_loader.device)?,
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
        Ok(Self {
            config: config.clone(),
            embed_tokens,
            layers,
            norm: head_loader.rms_norm("model.norm", hidden, config.rms_norm_eps)?,
            lm_head,
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

    /// Hidden-state copies between devices done by the forward passes so far (one per plan boundary per
    /// call).
    pub fn transfers(&self) -> usize {
        self.transfers.load(Ordering::Relaxed)
    }

    /// What runs where, per layer, as the plan bound it.
    pub fn layer_backends(&self) -> Vec<LayerBackends> {
        self.plan
            .layers
            .iter()
            .map(|layer| LayerBackends {
                layer: layer.layer,
                mlp: layer.mlp,
                attention: self.mode,
                dsa_indexer: layer.op(Op::DsaIndexer).map_or("-", |o| o.backend()),
                sparse_mla: layer.op(Op::SparseMla).map_or("-", |o| o.backend()),
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

    /// Runs `input_ids` at positions `start_pos..start_pos + len` (a prompt chunk or one decode token),
    /// appending them to `cache`, and returns f32 logits `[len, vocab_size]` on [`Self::output_device`].
    pub fn forward(
        &self,
        input_ids: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.run(input_ids, start_pos, cache, None)
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
        let logits = self.run(input_ids, start_pos, cache, Some(&mut selections))?;
        Ok((logits, selections))
    }

    /// Moves the hidden state to plan device `to` at a layer boundary.
    fn transfer(&self, x: &Tensor, to: usize) -> Result<Tensor> {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        Ok(x.to_device(&self.devices[to])?)
    }

    fn run(
        &self,
        input_ids: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
        mut selections: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let t = input_ids.len();
        if t == 0 {
            return Err(ModelError::EmptyInput);
        }
        if let Some((position, &token)) = input_ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= self.config.vocab_size)
        {
            return Err(ModelError::TokenOutOfRange {
                token,
                position: start_pos + position,
                vocab_size: self.config.vocab_size,
            });
        }
        let max_positions = self.config.max_position_embeddings;
        if start_pos + t > max_positions {
            return Err(ModelError::ContextOverflow {
                start: start_pos,
                end: start_pos + t,
                max_positions,
            });
        }
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
        let mut x = self.embed_tokens.index_select(&ids, 0)?;
        let mut here = first;
        for (layer, layer_cache) in self.layers.iter().zip(&cache.layers) {
            if layer.device != here {
                x = self.transfer(&x, layer.device)?;
                here = layer.device;
            }
            if per_device[here].is_none() {
                let device = &self.devices[here];
                let dense_here = dense.as_ref().map(|d| d.to_device(device)).transpose()?;
                per_device[here] = Some((rope.to_device(device)?, dense_here));
            }
            let (rope, dense) = per_device[here].as_ref().ok_or_else(|| {
                ModelError::PlanDevices(format!("no RoPE tables on plan device {here}"))
            })?;
            let (next, selected) =
                layer.forward(&x, start_pos, rope, layer_cache, dense.as_ref())?;
            if let Some(selections) = selections.as_deref_mut() {
                selections.push(selected);
            }
            x = next;
        }
        if self.plan.head_device != here {
            x = self.transfer(&x, self.plan.head_device)?;
        }
        cache.advance(t);
        Ok(self
            .lm_head
            .forward(&self.norm.forward(&x)?)?
            .to_dtype(DType::F32)?)
    }
}
