//! §3.3–3.4 MLA in its absorbed form and §4 the DSA lightning indexer.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;
use std::sync::atomic::{AtomicBool, Ordering};

use glm5_ops::absorbed_query::{
    absorbed_query, absorbed_query_one_token, absorbed_query_reference,
};
use glm5_ops::fp8_matmul::Fp8Prefill;
use glm5_ops::registry::{DsaIndexerFn, SparseMlaFn};
use glm5_ops::{
    dsa_indexer_paged_reference, dsa_indexer_paged_with, sparse_mla_paged_reference,
    sparse_mla_paged_with, DsaIndexerLaunch, Kernel, Op, PagedIndexKeys, PagedLatentCache,
    SparseMlaLaunch, VisibleKeys,
};

use super::linear::{Loader, Proj, RmsNorm};
use super::rope::Rope;
use crate::cache::{AttentionRows, CachedIndexKeys, KeyRows, LatentRows, LayerCache};
use crate::config::{Config, INDEX_KEY_NORM_EPS, LATENT_NORM_EPS};
use crate::error::{ModelError, Result};
use crate::paged_cache::PagedLayer;
use crate::plan::LayerPlan;
use crate::profile::{self, Part};

/// How attention's row-wise steps around its projections run (the latent and indexer-key cache rows, the
/// two queries' RoPE): glm5-ops' fused ops, one kernel each on CUDA (the default), or the candle-op chains
/// they replace, kept selectable to measure the difference in one run (`glm5-bench e2e`). Both compute the
/// same values (the fused kernels repeat the chains' roundings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowOps {
    #[default]
    Fused,
    CandleOps,
}

/// Where a layer's KV lives during one forward call, and what each query sees.
#[derive(Clone, Copy)]
pub(super) enum LayerKv<'a> {
    /// One sequence's contiguous cache; the call's tokens are positions `start_pos..`.
    Contiguous {
        cache: &'a LayerCache,
        start_pos: usize,
    },
    /// The paged pool's blocks of this layer, and the batch's layout on this layer's device.
    Paged {
        cache: &'a PagedLayer,
        step: &'a PagedStep,
    },
}

/// The latent rows attention reads: a contiguous cache's rows up to this call's last token, or a paged
/// layer's blocks and the batch's layout.
enum CachedLatent<'a> {
    Rows(Tensor),
    Paged(&'a PagedLayer, &'a PagedStep),
}

/// A batch's paged layout as tensors on one device (built once per device per forward).
pub(super) struct PagedStep {
    /// `I32 [B, max_blocks]`.
    pub block_table: Tensor,
    /// `I32 [B]`: tokens per sequence after this step.
    pub seq_lens: Tensor,
    /// `I32 [T]`: each token's batch entry.
    pub token_seq: Tensor,
    /// `U32 [T]`: the flattened-block row each token's KV is written to.
    pub write_rows: Tensor,
    /// `I32 [T]`: the keys each token's query sees (its position + 1).
    pub visible: Tensor,
    /// A bound on `visible`: the indexer scores up to this many positions per query (the largest count in
    /// an eager step; a captured step's block-table capacity, so that its launches fit every step it
    /// replays).
    pub max_visible: usize,
}

/// §4 The DSA lightning indexer: scores every visible past token for each query and keeps the top-k.
/// (`wk` and `weights_proj`, which project the layer's input, and `wq_b`, which projects `q_lora`, are
/// loaded with the attention's [`StackedProjections`].)
struct Indexer {
    /// `k_norm` (a LayerNorm with bias): weight and bias `[head_dim]`.
    k_norm: (Tensor, Tensor),
    n_heads: usize,
    head_dim: usize,
    /// Keys kept per query (`index_topk`).
    index_topk: usize,
    /// `weights_proj`'s factor (n_heads · head_dim)^-1/2, or `None` where it is a power of two (GLM-5: 1/64).
    /// The indexer returns the top-k positions by score, and a power-of-two factor on every head weight
    /// scales every score exactly (it moves exponents only), so the same positions come out without it:
    /// the kernels' own cast to f32 is then the step's one launch for the weights, where the cast and the
    /// multiply took two.
    weight_scale: Option<f64>,
    /// The backend the plan bound, and its name (the paged call picks its form by it); `None` when the
    /// indexer does not run (dense mode).
    kernel: Option<(DsaIndexerFn, &'static str)>,
}

impl Indexer {
    pub(super) fn load(
        config: &Config,
        loader: &Loader,
        prefix: &str,
        kernel: Option<(DsaIndexerFn, &'static str)>,
    ) -> Result<Self> {
        let (heads, dim) = (config.index_n_heads, config.index_head_dim);
        Ok(Self {
            k_norm: (
                loader.tensor(&format!("{prefix}.k_norm.weight"), &[dim])?,
                loader.tensor(&format!("{prefix}.k_norm.bias"), &[dim])?,
            ),
            n_heads: heads,
            head_dim: dim,
            index_topk: config.index_topk,
            weight_scale: Some(config.index_weight_scale()).filter(|s| !is_power_of_two(*s)),
            kernel,
        })
    }

    /// `wq_b`'s product of `q_lora` `[T, n_heads · head_dim]` as the heads `[T, n_heads, head_dim]` the
    /// query's RoPE takes.
    fn query_heads(&self, q: &Tensor) -> Result<Tensor> {
        Ok(q.reshape((q.dim(0)?, self.n_heads, self.head_dim))?)
    }

    /// What turns `wk`'s output into the cached keys `[RoPE(k_norm(k))[..R] | k_norm(k)[R..]]`.
    fn key_rows<'a>(&'a self, rope: &'a Rope, row_ops: RowOps) -> KeyRows<'a> {
        KeyRows {
            layer_norm: (&self.k_norm.0, &self.k_norm.1),
            eps: INDEX_KEY_NORM_EPS,
            rope: rope.tables(),
            row_ops,
        }
    }

    /// The selected positions `[T, index_topk]` (i32, -1 padded) for the rotated queries `q`
    /// `[T, n_heads, head_dim]` and `weights_proj`'s product `[T, n_heads]`, over `keys`, which already hold
    /// this call's keys.
    fn select(&self, q: &Tensor, weights: &Tensor, keys: IndexedKeys<'_>) -> Result<Tensor> {
        let t = q.dim(0)?;
        let head_weights = match self.weight_scale {
            Some(scale) => (weights.to_dtype(DType::F32)? * scale)?,
            None => weights.clone(),
        };
        let (kernel, backend) = self.kernel.ok_or_else(|| {
            ModelError::PlanDevices("the plan bound no dsa_indexer backend (dense mode)".into())
        })?;
        match keys {
            IndexedKeys::Contiguous { keys, start_pos } => {
                let visible: Vec<usize> = (1..=t).map(|i| start_pos + i).collect();
                Ok(kernel(
                    q,
                    &head_weights,
                    keys.view(),
                    &visible,
                    self.index_topk,
                )?)
            }
            IndexedKeys::Paged { cache, step } => {
                let paged = PagedIndexKeys {
                    keys: cache.index_keys(),
                    block_table: &step.block_table,
                    token_seq: &step.token_seq,
                };
                // The reference where the plan bound it, else glm5's CUDA launcher.
                Ok(if backend == "reference" {
                    let visible: Vec<usize> = step
                        .visible
                        .to_vec1::<i32>()?
                        .into_iter()
                        .map(|v| v as usize)
                        .collect();
                    dsa_indexer_paged_reference(
                        q,
                        &head_weights,
                        &paged,
                        &visible,
                        self.index_topk,
                    )?
                } else {
                    let visible = VisibleKeys::Device {
                        counts: &step.visible,
                        max_visible: step.max_visible,
                    };
                    dsa_indexer_paged_with(
                        q,
                        &head_weights,
                        &paged,
                        visible,
                        self.index_topk,
                        &DsaIndexerLaunch::default(),
                    )?
                })
            }
        }
    }
}

/// The indexer keys a call's queries score, this call's among them: a contiguous cache's keys up to the last
/// token (the call's tokens at positions `start_pos..`), or a paged layer's blocks and the batch's layout.
enum IndexedKeys<'a> {
    Contiguous {
        keys: CachedIndexKeys,
        start_pos: usize,
    },
    Paged {
        cache: &'a PagedLayer,
        step: &'a PagedStep,
    },
}

/// Whether `x` is 2^n (a positive normal f64 with an all-zero mantissa).
fn is_power_of_two(x: f64) -> bool {
    x.is_normal() && x > 0.0 && x.to_bits() & ((1 << 52) - 1) == 0
}

/// Projections of one input multiplied in groups whose rows are stacked into one matrix and split after the
/// product: fewer launches and longer weight streams per decode step (a decode step is bound by its
/// launches). The attention has two such sets: the layer input's `q_a_proj`, `kv_a_proj_with_mqa` and the
/// indexer's `wk` and `weights_proj`; and `q_lora`'s `q_b_proj` and the indexer's `wq_b` (sparse mode).
/// Dense ones (bf16, f16, f32, no bias; of one dtype) form one group. Block-scaled FP8 ones with one block
/// shape form another, their row blocks stacked with their scales: parts whose rows are whole blocks first,
/// then at most one whose last block is partial (`kv_a_proj_with_mqa`'s 576 rows), the stacked weight
/// dispatched as loaded ones are. GGUF blocks of one format glm5 decodes (`gguf_matmul`: Q4_K, i-quants) form
/// another, their rows stacked (every row is its own blocks). Other formats stay one projection each.
struct StackedProjections {
    groups: Vec<ProjectionGroup>,
    /// Products `forward` returns.
    count: usize,
}

/// One matrix and the parts of its output: `(which of the products, its width)`, in row order (a group of
/// one part takes the whole output; its width is not read).
struct ProjectionGroup {
    proj: Proj,
    parts: Vec<(usize, usize)>,
}

impl ProjectionGroup {
    fn single(which: usize, proj: Proj) -> Result<Self> {
        Ok(Self {
            proj,
            parts: vec![(which, 0)],
        })
    }
}

impl StackedProjections {
    /// `projections` of one input; `what` names them in errors.
    fn new(projections: Vec<Proj>, loader: &Loader, what: &str) -> Result<Self> {
        let count = projections.len();
        let mut singles: Vec<(usize, Proj)> = Vec::new();
        let (mut dense, mut fp8, mut blocks) = (Vec::new(), Vec::new(), Vec::new());
        for (which, proj) in projections.into_iter().enumerate() {
            match proj {
                Proj::Dense(linear) if linear.bias().is_none() => dense.push((which, linear)),
                Proj::Fp8Block(weight, prefill) => fp8.push((which, weight, prefill)),
                Proj::GgufBlocks(weight) => blocks.push((which, weight)),
                other => singles.push((which, other)),
            }
        }
        let mut groups = Vec::new();
        // Dense: one group per dtype and device (in practice one).
        while let Some((which, first)) = dense.pop() {
            let (dtype, device) = (first.weight().dtype(), first.weight().device().clone());
            let mut members = vec![(which, first)];
            let mut rest = Vec::new();
            for (w, l) in dense.drain(..) {
                if l.weight().dtype() == dtype && l.weight().device().same_device(&device) {
                    members.push((w, l));
                } else {
                    rest.push((w, l));
                }
            }
            dense = rest;
            members.sort_by_key(|(w, _)| *w);
            groups.push(Self::stack_dense(members)?);
        }
        // FP8: parts of one block shape and input width; whole row blocks first, one partial last.
        while let Some((which, weight, prefill)) = fp8.pop() {
            let key = (weight.block, weight.dims()?.1);
            let mut members = vec![(which, weight, prefill)];
            let mut rest = Vec::new();
            for (w, weight, prefill) in fp8.drain(..) {
                if (weight.block, weight.dims()?.1) == key {
                    members.push((w, weight, prefill));
                } else {
                    rest.push((w, weight, prefill));
                }
            }
            fp8 = rest;
            members.sort_by_key(|(w, weight, _)| {
                let rows = weight.dims().map_or(0, |d| d.0);
                (!rows.is_multiple_of(key.0[0]), *w)
            });
            // Past the first partial part, each further one stays alone.
            let whole = members
                .iter()
                .take_while(|(_, weight, _)| {
                    weight.dims().is_ok_and(|d| d.0.is_multiple_of(key.0[0]))
                })
                .count();
            let alone = members.split_off((whole + 1).min(members.len()));
            for (w, weight, prefill) in alone {
                groups.push(ProjectionGroup::single(w, Proj::Fp8Block(weight, prefill))?);
            }
            groups.extend(Self::stack_fp8(members, loader)?);
        }
        // GGUF blocks: one group per format and input width (in practice one).
        while let Some((which, first)) = blocks.pop() {
            let key = (first.format, first.in_dim);
            let mut members = vec![(which, first)];
            let mut rest = Vec::new();
            for (w, weight) in blocks.drain(..) {
                if (weight.format, weight.in_dim) == key {
                    members.push((w, weight));
                } else {
                    rest.push((w, weight));
                }
            }
            blocks = rest;
            members.sort_by_key(|(w, _)| *w);
            groups.push(Self::stack_blocks(members, loader, what)?);
        }
        for (which, proj) in singles {
            groups.push(ProjectionGroup::single(which, proj)?);
        }
        Ok(Self { groups, count })
    }

    /// GGUF-block parts of one format and input width, in output order, as one weight (rows are
    /// independent blocks: stacking them changes no value), dispatched as a loaded weight is.
    fn stack_blocks(
        members: Vec<(usize, glm5_ops::gguf_matmul::GgufWeight)>,
        loader: &Loader,
        what: &str,
    ) -> Result<ProjectionGroup> {
        if members.len() == 1 {
            let (which, weight) = members.into_iter().next().expect("one member");
            return ProjectionGroup::single(which, Proj::GgufBlocks(weight));
        }
        let mut parts = Vec::with_capacity(members.len());
        for (which, weight) in &members {
            parts.push((*which, weight.dims()?.0));
        }
        let weights: Vec<&glm5_ops::gguf_matmul::GgufWeight> =
            members.iter().map(|(_, w)| w).collect();
        let stacked = loader.stack_gguf_blocks(&weights, what)?;
        Ok(ProjectionGroup {
            proj: Proj::GgufBlocks(stacked),
            parts,
        })
    }

    /// Dense parts of one dtype and device, in output order, as one matrix.
    fn stack_dense(members: Vec<(usize, Linear)>) -> Result<ProjectionGroup> {
        if members.len() == 1 {
            let (which, linear) = members.into_iter().next().expect("one member");
            return ProjectionGroup::single(which, Proj::Dense(linear));
        }
        let mut parts = Vec::with_capacity(members.len());
        for (which, linear) in &members {
            parts.push((*which, linear.weight().dim(0)?));
        }
        let weights: Vec<&Tensor> = members.iter().map(|(_, l)| l.weight()).collect();
        Ok(ProjectionGroup {
            proj: Proj::Dense(Linear::new(Tensor::cat(&weights, 0)?, None)),
            parts,
        })
    }

    /// FP8 parts in row order (whole row blocks, then at most one partial): their bytes and scale rows
    /// stacked, dispatched as a loaded weight is. Kept apart where the stacked weight would take another
    /// prefill path than theirs.
    fn stack_fp8(
        members: Vec<(usize, glm5_ops::fp8_matmul::Fp8BlockWeight, Fp8Prefill)>,
        loader: &Loader,
    ) -> Result<Vec<ProjectionGroup>> {
        let apart = |members: Vec<(usize, glm5_ops::fp8_matmul::Fp8BlockWeight, Fp8Prefill)>| {
            members
                .into_iter()
                .map(|(which, weight, prefill)| {
                    ProjectionGroup::single(which, Proj::Fp8Block(weight, prefill))
                })
                .collect::<Result<Vec<_>>>()
        };
        if members.len() == 1 {
            return apart(members);
        }
        let mut parts = Vec::with_capacity(members.len());
        for (which, weight, _) in &members {
            parts.push((*which, weight.dims()?.0));
        }
        let bytes: Vec<&Tensor> = members.iter().map(|(_, w, _)| &w.weight).collect();
        let scales: Vec<&Tensor> = members.iter().map(|(_, w, _)| &w.scale_inv).collect();
        let stacked = glm5_ops::fp8_matmul::Fp8BlockWeight {
            weight: Tensor::cat(&bytes, 0)?,
            scale_inv: Tensor::cat(&scales, 0)?,
            block: members[0].1.block,
        };
        match glm5_ops::fp8_matmul::dispatch(&stacked, loader.desc) {
            Ok(chosen)
                if members
                    .iter()
                    .all(|(_, _, p)| *p == Fp8Prefill::of(&chosen)) =>
            {
                Ok(vec![ProjectionGroup {
                    proj: Proj::Fp8Block(stacked, Fp8Prefill::of(&chosen)),
                    parts,
                }])
            }
            _ => apart(members),
        }
    }

    /// The products of `x` in the order of the projections given to `new`, each contiguous.
    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let mut out: Vec<Option<Tensor>> = vec![None; self.count];
        for group in &self.groups {
            let y = group.proj.forward(x)?;
            if let [(which, _)] = group.parts.as_slice() {
                out[*which] = Some(y);
                continue;
            }
            let mut start = 0;
            for &(which, width) in &group.parts {
                out[which] = Some(y.narrow(1, start, width)?.contiguous()?);
                start += width;
            }
        }
        out.into_iter()
            .map(|t| {
                t.ok_or_else(|| ModelError::PlanDevices("a stacked projection has no group".into()))
            })
            .collect()
    }
}

/// §3.3–3.4 Multi-head latent attention with the DSA restriction, computed in the absorbed form.
pub(super) struct Attention {
    /// The layer input's `[q_a_proj, kv_a_proj_with_mqa, indexer wk, indexer weights_proj]`.
    input_projections: StackedProjections,
    q_a_layernorm: RmsNorm,
    /// `q_lora`'s `[q_b_proj, indexer wq_b]` (`[q_b_proj]` in dense mode, where the indexer does not run).
    query_projections: StackedProjections,
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
    /// The sparse_mla backend the plan bound, and its name (the paged call picks its form by it).
    sparse_mla: (SparseMlaFn, &'static str),
    /// `RowOps::CandleOps` when set (`Glm5ForCausalLM::set_row_ops`); shared with the indexer.
    candle_row_ops: AtomicBool,
}

impl Attention {
    pub(super) fn set_row_ops(&self, row_ops: RowOps) {
        self.candle_row_ops
            .store(row_ops == RowOps::CandleOps, Ordering::Relaxed);
    }

    fn row_ops(&self) -> RowOps {
        if self.candle_row_ops.load(Ordering::Relaxed) {
            RowOps::CandleOps
        } else {
            RowOps::Fused
        }
    }

    pub(super) fn load(
        config: &Config,
        loader: &Loader,
        prefix: &str,
        layer: &LayerPlan,
    ) -> Result<Self> {
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
        let input_projections = StackedProjections::new(
            vec![
                loader.linear(
                    &format!("{prefix}.q_a_proj"),
                    config.hidden_size,
                    config.q_lora_rank,
                )?,
                loader.linear(
                    &format!("{prefix}.kv_a_proj_with_mqa"),
                    config.hidden_size,
                    config.latent_dim(),
                )?,
                loader.linear(
                    &format!("{prefix}.indexer.wk"),
                    config.hidden_size,
                    config.index_head_dim,
                )?,
                loader.linear(
                    &format!("{prefix}.indexer.weights_proj"),
                    config.hidden_size,
                    config.index_n_heads,
                )?,
            ],
            loader,
            "the attention's stacked input projections",
        )?;
        let mut queries = vec![loader.linear(
            &format!("{prefix}.q_b_proj"),
            config.q_lora_rank,
            heads * config.qk_head_dim(),
        )?];
        if dsa_indexer.is_some() {
            queries.push(loader.linear(
                &format!("{prefix}.indexer.wq_b"),
                config.q_lora_rank,
                config.index_n_heads * config.index_head_dim,
            )?);
        }
        let query_projections =
            StackedProjections::new(queries, loader, "q_b_proj stacked with the indexer's wq_b")?;
        Ok(Self {
            input_projections,
            q_a_layernorm: loader.rms_norm(
                &format!("{prefix}.q_a_layernorm"),
                config.q_lora_rank,
                LATENT_NORM_EPS,
            )?,
            query_projections,
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
            candle_row_ops: AtomicBool::new(false),
        })
    }

    /// Attention over this call's tokens and the cached ones: writes the tokens' latent rows (and the
    /// indexer's keys) into `kv`, returns the output `[T, hidden]` and the attended positions `[T, K]`.
    pub(super) fn forward(
        &self,
        hidden: &Tensor,
        rope: &Rope,
        kv: LayerKv<'_>,
        dense: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let t = hidden.dim(0)?;
        // Queries: q_lora (shared with the indexer) → per-head [nope | rope].
        let [q_a, kv_a, index_k, index_weights]: [Tensor; 4] = self
            .input_projections
            .forward(hidden)?
            .try_into()
            .map_err(|_| ModelError::PlanDevices("four input projections".into()))?;
        let q_lora = self.q_a_layernorm.forward(&q_a)?;
        let queries = self.query_projections.forward(&q_lora)?;
        let q = queries[0].reshape((t, self.heads, self.nope_dim + self.rope_dim))?;

        // This call's latent rows [kv_a_layernorm(c) | RoPE(k_pe)] go into the cache; attention reads all
        // cached rows. Where the indexer runs, its keys and its query's RoPE are computed in the same op (one
        // launch where the fused ops run).
        let row_ops = self.row_ops();
        let rows = LatentRows {
            norm_weight: self.kv_a_layernorm.weight(),
            eps: self.kv_a_layernorm.eps(),
            rope: rope.tables(),
            row_ops,
        };
        let (latent, indexed) = match (dense, queries.get(1)) {
            (Some(_), _) => {
                let latent = match kv {
                    LayerKv::Contiguous { cache, start_pos } => {
                        CachedLatent::Rows(cache.append_latent(&kv_a, rows, start_pos)?)
                    }
                    LayerKv::Paged { cache, step } => {
                        cache.write_latent(&kv_a, rows, &step.write_rows)?;
                        CachedLatent::Paged(cache, step)
                    }
                };
                (latent, None)
            }
            (None, Some(index_q)) => {
                let index_q = self.indexer.query_heads(index_q)?;
                let attention_rows = AttentionRows {
                    kv_a: &kv_a,
                    latent: rows,
                    k: &index_k,
                    keys: self.indexer.key_rows(rope, row_ops),
                    index_q: &index_q,
                };
                match kv {
                    LayerKv::Contiguous { cache, start_pos } => {
                        let (latent, keys, index_q) =
                            cache.append_rows(&attention_rows, start_pos)?;
                        let keys = IndexedKeys::Contiguous { keys, start_pos };
                        (CachedLatent::Rows(latent), Some((index_q, keys)))
                    }
                    LayerKv::Paged { cache, step } => {
                        let index_q = cache.write_rows(&attention_rows, &step.write_rows)?;
                        let keys = IndexedKeys::Paged { cache, step };
                        (CachedLatent::Paged(cache, step), Some((index_q, keys)))
                    }
                }
            }
            (None, None) => {
                return Err(ModelError::PlanDevices(
                    "the plan bound no dsa_indexer backend (dense mode)".into(),
                ))
            }
        };

        // Absorb W_UK: q̃_h = W_UK_hᵀ q_nope_h, so scores are 576-wide dots against the latent rows; the
        // query is [q̃ | RoPE(q_pe)] per head (one fused op; at one token the product is in it too, streaming
        // W_UK once where cuBLAS's batched GEMM of one row a head read it at half of copy).
        let (cos, sin) = rope.tables();
        let q_absorbed = match row_ops {
            RowOps::Fused if t == 1 => absorbed_query_one_token(&q, &self.w_uk, cos, sin)?,
            _ => {
                let q_nope = q
                    .narrow(2, 0, self.nope_dim)?
                    .transpose(0, 1)?
                    .contiguous()?;
                let q_latent = q_nope.matmul(&self.w_uk)?;
                match row_ops {
                    RowOps::Fused => absorbed_query(&q, &q_latent, cos, sin)?,
                    RowOps::CandleOps => absorbed_query_reference(&q, &q_latent, cos, sin)?,
                }
            }
        };

        let selected = match indexed {
            Some((index_q, keys)) => profile::time(Part::Indexer, hidden.device(), || {
                self.indexer.select(&index_q, &index_weights, keys)
            })?,
            // `indexed` is made whenever `dense` is None.
            None => dense.cloned().ok_or_else(|| {
                ModelError::PlanDevices("neither indexer keys nor dense positions".into())
            })?,
        };
        let (sparse_mla, backend) = self.sparse_mla;
        let (attended, _lse) = match latent {
            CachedLatent::Paged(cache, step) => {
                let paged = PagedLatentCache {
                    blocks: cache.latent(),
                    block_table: &step.block_table,
                    seq_lens: &step.seq_lens,
                    token_seq: &step.token_seq,
                };
                // The reference where the plan bound it, else glm5's CUDA launcher for that backend.
                if backend == "reference" {
                    sparse_mla_paged_reference(
                        &q_absorbed,
                        &paged,
                        &selected,
                        self.kv_lora_rank,
                        self.softmax_scale,
                    )?
                } else {
                    sparse_mla_paged_with(
                        &q_absorbed,
                        &paged,
                        &selected,
                        self.kv_lora_rank,
                        self.softmax_scale,
                        &SparseMlaLaunch::backend(backend)?,
                    )?
                }
            }
            CachedLatent::Rows(latent) => sparse_mla(
                &q_absorbed,
                &latent,
                &selected,
                self.kv_lora_rank,
                self.softmax_scale,
            )?,
        };

        // Apply W_UV per head, then the output projection. One token: the head-major view is already a
        // matmul operand (cuBLAS outran glm5_ops::head_products here, its docs say by how much).
        let attended = attended.transpose(0, 1)?;
        let attended = if t == 1 {
            attended
        } else {
            attended.contiguous()?
        };
        let per_head = attended.matmul(&self.w_uv_t)?;
        let merged = per_head
            .transpose(0, 1)?
            .reshape((t, self.heads * self.v_head_dim))?;
        Ok((self.o_proj.forward(&merged)?, selected))
    }
}

/// The functions the plan chose for a layer: sparse_mla, and dsa_indexer unless it is skipped.
#[allow(clippy::type_complexity)]
fn bound_kernels(
    layer: &LayerPlan,
) -> Result<(
    (SparseMlaFn, &'static str),
    Option<(DsaIndexerFn, &'static str)>,
)> {
    let mismatch = |what: &str| ModelError::PlanDevices(format!("layer {}: {what}", layer.layer));
    let sparse_mla = match layer.op(Op::SparseMla).and_then(|o| o.choice.as_ref()) {
        Some(choice) => match choice.entry.kernel {
            Kernel::SparseMla(f) => (f, choice.entry.name),
            _ => return Err(mismatch("the sparse_mla entry holds another op's kernel")),
        },
        None => return Err(mismatch("no sparse_mla backend in the plan")),
    };
    let dsa_indexer = match layer.op(Op::DsaIndexer).and_then(|o| o.choice.as_ref()) {
        Some(choice) => match choice.entry.kernel {
            Kernel::DsaIndexer(f) => Some((f, choice.entry.name)),
            _ => return Err(mismatch("the dsa_indexer entry holds another op's kernel")),
        },
        None => None,
    };
    Ok((sparse_mla, dsa_indexer))
}

/// Dense mode's "selection": every position `0..=start_pos+i` for query `i`, -1 padded to a common width.
pub(super) fn all_causal_positions(t: usize, start_pos: usize, device: &Device) -> Result<Tensor> {
    let positions: Vec<usize> = (start_pos..start_pos + t).collect();
    causal_positions_of(&positions, device)
}

/// Dense mode's "selection" for tokens at `positions` (each in its own sequence): positions `0..=p` for a
/// token at `p`, -1 padded to a common width.
pub(super) fn causal_positions_of(positions: &[usize], device: &Device) -> Result<Tensor> {
    let width = positions.iter().max().map_or(0, |&p| p + 1);
    let rows: Vec<i32> = positions
        .iter()
        .flat_map(|&p| (0..width).map(move |s| if s <= p { s as i32 } else { -1 }))
        .collect();
    Ok(Tensor::from_vec(rows, (positions.len(), width), device)?)
}

#[cfg(test)]
mod tests {
    use super::is_power_of_two;

    #[test]
    fn glm5s_indexer_weight_factor_is_a_power_of_two_and_the_tiny_models_is_not() {
        assert!(is_power_of_two((32.0f64 * 128.0).powf(-0.5)));
        assert!(!is_power_of_two((8.0f64 * 16.0).powf(-0.5)));
        assert!(is_power_of_two(1.0));
        assert!(!is_power_of_two(0.0));
        assert!(!is_power_of_two(-0.25));
        assert!(!is_power_of_two(f64::MIN_POSITIVE / 4.0)); // subnormal
    }
}
