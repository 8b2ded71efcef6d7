//! §3.1 the dense MLP and §5 the mixture of experts with its sigmoid router.

use candle_core::quantized::QTensor;
use candle_core::{DType, Module, Tensor};
use glm5_ops::gguf_matmul::{GgufFormat, GgufWeight};
use glm5_ops::moe::{self, RouteRule, Routes};

use super::linear::{op_error, Loader, Proj};
use crate::config::Config;
use crate::error::{ModelError, Result};

/// §3.1 `down(silu(gate(x)) ⊙ up(x))`: the dense MLP, each routed expert and the shared expert.
pub(super) struct Mlp {
    gate_up: GateUp,
    down_proj: Proj,
}

/// `gate_proj` and `up_proj`: two weights, or, when both are GGUF blocks of one format glm5 decodes
/// (K-quants, i-quants), one weight of the gate rows then the up rows (every row is its own blocks: no value changes),
/// multiplied in one launch and split after.
enum GateUp {
    Apart { gate: Proj, up: Proj },
    Stacked { proj: Proj, intermediate: usize },
}

impl Mlp {
    pub(super) fn load(
        loader: &Loader,
        prefix: &str,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self> {
        let gate = loader.linear(&format!("{prefix}.gate_proj"), hidden, intermediate)?;
        let up = loader.linear(&format!("{prefix}.up_proj"), hidden, intermediate)?;
        let gate_up = match (gate, up) {
            (Proj::GgufBlocks(g), Proj::GgufBlocks(u))
                if (g.format, g.in_dim) == (u.format, u.in_dim) =>
            {
                let what = format!("{prefix}.gate_proj + up_proj (stacked)");
                GateUp::Stacked {
                    proj: Proj::GgufBlocks(loader.stack_gguf_blocks(&[&g, &u], &what)?),
                    intermediate,
                }
            }
            (gate, up) => GateUp::Apart { gate, up },
        };
        Ok(Self {
            gate_up,
            down_proj: loader.linear(&format!("{prefix}.down_proj"), intermediate, hidden)?,
        })
    }
}

impl Mlp {
    /// Its weights as loaded: gate and up apart (None where they are stacked), down.
    fn parts(&self) -> Option<[&Proj; 3]> {
        match &self.gate_up {
            GateUp::Apart { gate, up } => Some([gate, up, &self.down_proj]),
            GateUp::Stacked { .. } => None,
        }
    }

    /// `[gate, up, down]` where all three are GGUF blocks glm5 decodes (views of a stacked gate/up).
    fn gguf_projections(&self) -> Result<Option<[GgufWeight; 3]>> {
        let Proj::GgufBlocks(down) = &self.down_proj else {
            return Ok(None);
        };
        let (gate, up) = match &self.gate_up {
            GateUp::Apart {
                gate: Proj::GgufBlocks(gate),
                up: Proj::GgufBlocks(up),
            } => (gate.clone(), up.clone()),
            GateUp::Stacked {
                proj: Proj::GgufBlocks(both),
                intermediate,
            } => {
                let rows = |start| {
                    GgufWeight::new(
                        both.format,
                        both.blocks.narrow(0, start, *intermediate)?,
                        both.in_dim,
                    )
                };
                (rows(0)?, rows(*intermediate)?)
            }
            _ => return Ok(None),
        };
        Ok(Some([gate, up, down.clone()]))
    }

    /// Whether any of its weights is in GGUF blocks glm5 decodes.
    fn has_gguf_blocks(&self) -> bool {
        match &self.gate_up {
            GateUp::Apart { gate, up } => [gate, up, &self.down_proj]
                .iter()
                .any(|p| matches!(p, Proj::GgufBlocks(_))),
            GateUp::Stacked { .. } => true,
        }
    }

    fn is_dense(&self) -> bool {
        self.parts()
            .is_some_and(|parts| parts.iter().all(|p| p.dense_weight().is_some()))
    }

    /// `[2I, hidden]`: the gate rows, then the up rows (dense weights only).
    fn gate_up_rows(&self) -> Result<Tensor> {
        let (gate, up) = match &self.gate_up {
            GateUp::Apart { gate, up } => (gate.dense_weight(), up.dense_weight()),
            GateUp::Stacked { .. } => (None, None),
        };
        match (gate, up) {
            (Some(gate), Some(up)) => Ok(Tensor::cat(&[gate, up], 0)?),
            _ => Err(crate::error::ModelError::PlanDevices(
                "stacking a quantised expert".into(),
            )),
        }
    }

    /// `[hidden, I]` (dense weights only).
    fn down_rows(&self) -> Result<Tensor> {
        self.down_proj.dense_weight().cloned().ok_or_else(|| {
            crate::error::ModelError::PlanDevices("stacking a quantised expert".into())
        })
    }
}

/// Stacks the experts (`mlps`, the shared expert last where it is a slot) kept in one quantised format:
/// `None` when they are not all FP8 or all NVFP4, or their parts do not share one shape.
fn stack_quantized(mlps: &[&Mlp]) -> Option<moe::QuantizedExperts> {
    fn fp8(p: &Proj) -> Option<&glm5_ops::fp8_matmul::Fp8BlockWeight> {
        match p {
            Proj::Fp8Block(w, _) => Some(w),
            _ => None,
        }
    }
    fn nvfp4(p: &Proj) -> Option<&glm5_ops::nvfp4_matmul::Nvfp4Weight> {
        match p {
            Proj::Nvfp4(w, _) => Some(w),
            _ => None,
        }
    }
    if let Some(all) = mlps
        .iter()
        .map(|m| m.parts()?.map(fp8).into_iter().collect::<Option<Vec<_>>>())
        .collect::<Option<Vec<_>>>()
    {
        let gate_up: Vec<Vec<_>> = all.iter().map(|p| vec![p[0], p[1]]).collect();
        let down: Vec<Vec<_>> = all.iter().map(|p| vec![p[2]]).collect();
        return Some(moe::QuantizedExperts::Fp8 {
            gate_up: moe::StackedFp8::stack(&gate_up).ok()?,
            down: moe::StackedFp8::stack(&down).ok()?,
        });
    }
    let all = mlps
        .iter()
        .map(|m| {
            m.parts()?
                .map(nvfp4)
                .into_iter()
                .collect::<Option<Vec<_>>>()
        })
        .collect::<Option<Vec<_>>>()?;
    let gate_up: Vec<Vec<_>> = all.iter().map(|p| vec![p[0], p[1]]).collect();
    let down: Vec<Vec<_>> = all.iter().map(|p| vec![p[2]]).collect();
    // Every expert's projection has one shape on one device, so one dispatch: the first's prefill backend.
    let prefill = |p: &Proj| match p {
        Proj::Nvfp4(_, prefill) => *prefill,
        _ => glm5_ops::nvfp4_matmul::Prefill::W4a16,
    };
    let [first_gate, _, first_down] = mlps.first()?.parts()?;
    Some(moe::QuantizedExperts::Nvfp4 {
        gate_up: moe::StackedNvfp4::stack(&gate_up)
            .ok()?
            .with_prefill(prefill(first_gate)),
        down: moe::StackedNvfp4::stack(&down)
            .ok()?
            .with_prefill(prefill(first_down)),
    })
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let activated = match &self.gate_up {
            GateUp::Apart { gate, up } => {
                (candle_nn::ops::silu(&gate.forward(x)?)? * up.forward(x)?)?
            }
            // One launch for the activation and the product (glm5_ops::swiglu).
            GateUp::Stacked { proj, intermediate } => {
                glm5_ops::swiglu::swiglu(&proj.forward(x)?, *intermediate).map_err(op_error)?
            }
        };
        self.down_proj.forward(&activated)
    }
}

/// §5 Sigmoid router (`noaux_tc`) in f32: the correction bias steers selection only.
struct Router {
    /// `F32 [E, hidden]`.
    weight: Tensor,
    /// `F32 [E]`.
    correction_bias: Tensor,
    rule: RouteRule,
}

impl Router {
    /// Every token's experts and gates, on the hidden state's device (`glm5_ops::moe::route`).
    fn route(&self, hidden: &Tensor, shared_expert: Option<u32>) -> Result<Routes> {
        let logits = moe::router_logits(hidden, &self.weight)?;
        Ok(moe::route(
            &logits,
            &self.correction_bias,
            &self.rule,
            shared_expert,
        )?)
    }
}

/// The routed experts' weights.
enum Experts {
    /// Dense weights stacked for `glm5_ops::moe::experts`: `gate_up` `[E', 2I, hidden]`, `down`
    /// `[E', hidden, I]`. When the shared expert has the routed experts' width it is stacked last (id E) and
    /// runs as one more slot of every token.
    Stacked {
        gate_up: Tensor,
        down: Tensor,
        shared_slot: Option<u32>,
    },
    /// Experts kept in block-scaled FP8 or NVFP4, stacked the same way (`glm5_ops::moe::quantized_experts`).
    Quantized {
        weights: moe::QuantizedExperts,
        shared_slot: Option<u32>,
    },
    /// Quantised experts (GGUF), multiplied one by one without being expanded (`per_expert_forward`): the CPU
    /// path, and CUDA's where candle-nn's GGUF MoE kernels do not take the experts (`why`).
    PerExpert {
        experts: Vec<Mlp>,
        why: &'static str,
    },
    /// Quantised experts as GGUF stores them, one `QTensor` per projection: `gate`, `up` `[E, I, hidden]`,
    /// `down` `[E, hidden, I]`, run by `glm5_ops::moe::experts_gguf` on CUDA (routes and grouping on the
    /// device, no host round trip).
    StackedGguf(Box<GgufExperts>),
}

/// See [`Experts::StackedGguf`] (boxed: three `QTensor`s would make every `Experts` large).
struct GgufExperts {
    gate: QTensor,
    up: QTensor,
    down: QTensor,
}

/// Why quantised experts run one by one (`experts_implementation`).
const PER_EXPERT: &str = "per-expert quantised";
const PER_EXPERT_GGUF_BLOCKS: &str =
    "per-expert glm5 block format (the grouped kernels take experts whose three projections are all in glm5's formats, gate and up in one: one gguf_matmul per chosen expert)";

const PER_EXPERT_UNSUPPORTED: &str = "per-expert quantised (block type or row width not taken by candle-nn's GGUF MoE kernels: Q8_0, Q2_K-Q6_K)";

/// The routed experts' projections as a source stacks them: `(name, [E, out, in])`.
fn expert_projections(config: &Config) -> [(&'static str, [usize; 3]); 3] {
    let (e, hidden, inter) = (
        config.n_routed_experts,
        config.hidden_size,
        config.moe_intermediate_size,
    );
    [
        ("gate_proj", [e, inter, hidden]),
        ("up_proj", [e, inter, hidden]),
        ("down_proj", [e, hidden, inter]),
    ]
}

/// The routed experts as the source stacks them in GGUF blocks glm5 decodes (i-quants, K-quants), when gate
/// and up share a format (the grouped kernels' rule; published mixes do); `None` otherwise.
fn load_stacked_gguf_blocks(
    config: &Config,
    loader: &Loader,
    prefix: &str,
) -> Result<Option<moe::QuantizedExperts>> {
    let projections = expert_projections(config);
    // From the headers first: a layer mixing these formats with others (Q4_K gate/up, Q5_K down) reads none
    // of its experts here.
    let mut formats = Vec::with_capacity(projections.len());
    for (proj, shape) in projections {
        match loader
            .checkpoint
            .stacked_gguf_block_format(prefix, proj, shape)?
        {
            Some(format) => formats.push(format),
            None => return Ok(None),
        }
    }
    if formats[0] != formats[1] {
        return Ok(None);
    }
    let load = |(proj, shape): (&str, [usize; 3])| {
        loader
            .checkpoint
            .stacked_gguf_block_experts(prefix, proj, shape, loader.device)
    };
    let (Some(gate), Some(up), Some(down)) = (
        load(projections[0])?,
        load(projections[1])?,
        load(projections[2])?,
    ) else {
        return Ok(None);
    };
    // Each projection must have a gguf_matmul backend on this device, as each expert's would.
    for (proj, stacked) in [("gate_proj", &gate), ("up_proj", &up), ("down_proj", &down)] {
        let expert = glm5_ops::gguf_matmul::GgufWeight::new(
            stacked.format,
            stacked.blocks.get(0)?,
            stacked.k,
        )?;
        glm5_ops::gguf_matmul::dispatch(&expert, loader.desc).map_err(|source| {
            ModelError::WeightOnlyMatmul {
                tensor: format!("{prefix}.experts.*.{proj}.weight"),
                source: Box::new(source),
            }
        })?;
    }
    Ok(Some(moe::QuantizedExperts::GgufBlocks { gate, up, down }))
}

/// What [`load_stacked_gguf`] found.
enum StackedGguf {
    Loaded(Experts),
    /// Stored stacked and quantised, but not in a form candle-nn's kernels take: why.
    Unsupported(&'static str),
    /// Not on CUDA, or not stored stacked and quantised (safetensors, float GGUF).
    NotStacked,
}

/// The stacked GGUF experts of the MoE block `prefix` on a CUDA device (formats checked from the headers,
/// before any expert is read).
fn load_stacked_gguf(config: &Config, loader: &Loader, prefix: &str) -> Result<StackedGguf> {
    if !(loader.device.is_cuda() && cfg!(feature = "cuda")) {
        return Ok(StackedGguf::NotStacked);
    }
    let (hidden, inter) = (config.hidden_size, config.moe_intermediate_size);
    let projections = expert_projections(config);
    let mut formats = Vec::with_capacity(projections.len());
    for (proj, shape) in projections {
        match loader
            .checkpoint
            .stacked_experts_format(prefix, proj, shape)?
        {
            Some(format) => formats.push(format),
            None => return Ok(StackedGguf::NotStacked),
        }
    }
    if moe::gguf_experts_support([formats[0], formats[1], formats[2]], hidden, inter).is_err() {
        return Ok(StackedGguf::Unsupported(PER_EXPERT_UNSUPPORTED));
    }
    // The device must serve these formats at all (quantized_matmul's entries: compute capability, formats),
    // as each expert's QMatMul would have to.
    for ((proj, _), format) in projections.iter().zip(&formats) {
        glm5_ops::quantized_matmul::dispatch(*format, loader.desc).map_err(|source| {
            ModelError::QuantizedMatmul {
                tensor: format!("{prefix}.experts.*.{proj}.weight"),
                source: Box::new(source),
            }
        })?;
    }
    let load = |(proj, shape): (&str, [usize; 3])| -> Result<QTensor> {
        loader
            .checkpoint
            .stacked_experts(prefix, proj, shape, loader.device)?
            .ok_or_else(|| ModelError::MissingTensor {
                name: format!("{prefix}.experts.*.{proj}.weight (stacked)"),
            })
    };
    Ok(StackedGguf::Loaded(Experts::StackedGguf(Box::new(
        GgufExperts {
            gate: load(projections[0])?,
            up: load(projections[1])?,
            down: load(projections[2])?,
        },
    ))))
}

/// §5 Mixture of experts: routed experts weighted by the router, plus the unweighted shared expert.
pub(super) struct MoE {
    router: Router,
    experts: Experts,
    /// The shared expert when it is not a slot of the stacked experts.
    shared_expert: Option<Mlp>,
}

impl MoE {
    pub(super) fn load(config: &Config, loader: &Loader, prefix: &str) -> Result<Self> {
        let (hidden, n_experts) = (config.hidden_size, config.n_routed_experts);
        let router = Router {
            weight: loader.tensor_f32(&format!("{prefix}.gate.weight"), &[n_experts, hidden])?,
            correction_bias: loader.tensor_f32(
                &format!("{prefix}.gate.e_score_correction_bias"),
                &[n_experts],
            )?,
            rule: RouteRule {
                n_group: config.n_group,
                topk_group: config.topk_group,
                top_k: config.num_experts_per_tok,
                normalise: config.norm_topk_prob,
                scaling: config.routed_scaling_factor as f32,
            },
        };
        let shared = (config.n_shared_experts > 0)
            .then(|| {
                let width = config.moe_intermediate_size * config.n_shared_experts;
                Mlp::load(loader, &format!("{prefix}.shared_experts"), hidden, width)
            })
            .transpose()?;
        if let Some(mut weights) = load_stacked_gguf_blocks(config, loader, prefix)? {
            // The shared expert as one more slot (gate 1) where its projections are in the routed ones'
            // formats and shapes: its three mat-vecs, activation and sum join the experts' launches.
            let folded = match shared.as_ref().filter(|_| config.n_shared_experts == 1) {
                Some(mlp) => match mlp.gguf_projections()? {
                    Some(parts) => weights.push_gguf_expert(parts.each_ref())?,
                    None => false,
                },
                None => false,
            };
            return Ok(Self {
                router,
                experts: Experts::Quantized {
                    weights,
                    shared_slot: folded.then_some(n_experts as u32),
                },
                shared_expert: if folded { None } else { shared },
            });
        }
        let why = match load_stacked_gguf(config, loader, prefix)? {
            StackedGguf::Loaded(experts) => {
                return Ok(Self {
                    router,
                    experts,
                    shared_expert: shared,
                })
            }
            StackedGguf::Unsupported(why) => why,
            StackedGguf::NotStacked => PER_EXPERT,
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
        if !experts.iter().all(Mlp::is_dense) {
            // One format for every expert: stacked, the shared expert as a slot when it is stacked with
            // them (same format and width), else on its own.
            let routed: Vec<&Mlp> = experts.iter().collect();
            if let Some(shared_mlp) = shared.as_ref().filter(|_| config.n_shared_experts == 1) {
                let with_shared: Vec<&Mlp> = routed.iter().copied().chain([shared_mlp]).collect();
                if let Some(weights) = stack_quantized(&with_shared) {
                    return Ok(Self {
                        router,
                        experts: Experts::Quantized {
                            weights,
                            shared_slot: Some(n_experts as u32),
                        },
                        shared_expert: None,
                    });
                }
            }
            if let Some(weights) = stack_quantized(&routed) {
                return Ok(Self {
                    router,
                    experts: Experts::Quantized {
                        weights,
                        shared_slot: None,
                    },
                    shared_expert: shared,
                });
            }
            // On CUDA, say why glm5's grouped kernels did not take them; the CPU always runs them one by one.
            let why = if loader.device.is_cuda() && experts.iter().any(Mlp::has_gguf_blocks) {
                PER_EXPERT_GGUF_BLOCKS
            } else {
                why
            };
            return Ok(Self {
                router,
                experts: Experts::PerExpert { experts, why },
                shared_expert: shared,
            });
        }
        let fold_shared = shared
            .as_ref()
            .is_some_and(|s| s.is_dense() && config.n_shared_experts == 1);
        let mut stacked: Vec<&Mlp> = experts.iter().collect();
        if fold_shared {
            stacked.extend(shared.as_ref());
        }
        let gate_up = Tensor::stack(
            &stacked
                .iter()
                .map(|m| m.gate_up_rows())
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        let down = Tensor::stack(
            &stacked
                .iter()
                .map(|m| m.down_rows())
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        Ok(Self {
            router,
            experts: Experts::Stacked {
                gate_up,
                down,
                shared_slot: fold_shared.then_some(n_experts as u32),
            },
            shared_expert: if fold_shared { None } else { shared },
        })
    }

    pub(super) fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let mut out = match &self.experts {
            Experts::Stacked {
                gate_up,
                down,
                shared_slot,
            } => {
                let routes = self.router.route(hidden, *shared_slot)?;
                moe::experts(hidden, &routes, gate_up, down)?
            }
            Experts::Quantized {
                weights,
                shared_slot,
            } => {
                let routes = self.router.route(hidden, *shared_slot)?;
                moe::quantized_experts(hidden, &routes, weights)?
            }
            Experts::PerExpert { experts, .. } => {
                per_expert_forward(experts, hidden, &self.router.route(hidden, None)?)?
            }
            Experts::StackedGguf(experts) => {
                let routes = self.router.route(hidden, None)?;
                let GgufExperts { gate, up, down } = experts.as_ref();
                moe::experts_gguf(hidden, &routes, gate, up, down)?
            }
        };
        if let Some(shared) = &self.shared_expert {
            out = (out + shared.forward(hidden)?)?;
        }
        Ok(out)
    }

    /// Why a step of `tokens` tokens of `dtype` on `device` cannot be captured in a CUDA graph because of
    /// how its experts run (they read the routes or expert row counts on the host), or `None`.
    pub(super) fn capture_blocker(
        &self,
        tokens: usize,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Option<String> {
        let backend = match &self.experts {
            Experts::Stacked { gate_up, down, .. } => {
                moe::experts_backend_at(tokens, dtype, device, gate_up, down)
            }
            Experts::Quantized { weights, .. } => {
                moe::quantized_experts_backend_at(tokens, dtype, device, weights)
            }
            Experts::PerExpert { why, .. } => {
                return Some(format!(
                    "the experts run one by one ({why}), grouped by their routes on the host"
                ))
            }
            // moe_align groups the routes on the device for both GGUF kernels.
            Experts::StackedGguf(_) => return None,
        };
        match backend {
            moe::ExpertsBackend::DeviceMatVec => None,
            moe::ExpertsBackend::GroupedGemm | moe::ExpertsBackend::CandleMoeGemm => Some(format!(
                "the experts of {tokens} tokens run as a grouped GEMM, which counts each expert's rows on the host"
            )),
            moe::ExpertsBackend::Reference(why) => Some(format!(
                "the experts run by the reference ({why}), grouped by their routes on the host"
            )),
        }
    }

    /// How the experts run on `device` (`glm5_ops::moe::experts_backend` decides per call by token count).
    pub(super) fn experts_implementation(&self, device: &candle_core::Device) -> &'static str {
        match (&self.experts, device.is_cuda() && cfg!(feature = "cuda")) {
            (Experts::Stacked { .. }, true) => {
                "moe-matvec (few tokens), cuBLAS grouped GEMM (batched decode, prefill)"
            }
            (Experts::Stacked { .. }, false) => "per-expert reference",
            (Experts::Quantized { weights, .. }, true) => match weights {
                moe::QuantizedExperts::Fp8 { .. } => {
                    "moe-matvec fp8 (decode), dequantise + cuBLAS grouped GEMM (prefill)"
                }
                moe::QuantizedExperts::Nvfp4 { .. } => {
                    "moe-matvec nvfp4 (decode), dequantise + cuBLAS grouped GEMM (prefill)"
                }
                moe::QuantizedExperts::GgufBlocks { gate, down, .. }
                    if gate.format == GgufFormat::Q4K || down.format == GgufFormat::Q4K =>
                {
                    "moe-matvec GGUF blocks (decode; Q4_K with bf16 on the tensor cores, int8 with q8_1 rows at one token), dequantise + cuBLAS grouped GEMM (prefill)"
                }
                moe::QuantizedExperts::GgufBlocks { .. } => {
                    "moe-matvec GGUF blocks (decode), dequantise + cuBLAS grouped GEMM (prefill)"
                }
            },
            (Experts::Quantized { weights, .. }, false) => match weights {
                moe::QuantizedExperts::Fp8 { .. } => "per-expert fp8 reference",
                moe::QuantizedExperts::Nvfp4 { .. } => "per-expert nvfp4 reference",
                moe::QuantizedExperts::GgufBlocks { .. } => "per-expert GGUF-block reference",
            },
            (Experts::PerExpert { why, .. }, _) => why,
            (Experts::StackedGguf(_), _) => {
                "candle-nn GGUF MoE: mat-vec (decode, <= 8 tokens), WMMA (prefill)"
            }
        }
    }
}

/// Quantised experts: each chosen expert's chain of ops over the tokens that chose it.
fn per_expert_forward(experts: &[Mlp], hidden: &Tensor, routes: &Routes) -> Result<Tensor> {
    let ids: Vec<Vec<u32>> = routes.ids.to_vec2()?;
    let gates: Vec<Vec<f32>> = routes.gates.to_vec2()?;
    let mut tokens_of_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); experts.len()];
    for (token, (ids, gates)) in ids.iter().zip(&gates).enumerate() {
        for (&expert, &gate) in ids.iter().zip(gates) {
            if let Some(list) = tokens_of_expert.get_mut(expert as usize) {
                list.push((token as u32, gate));
            }
        }
    }
    // Every expert's tokens and gates go to the device in one copy each; each expert reads its slice.
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
    for (expert, assigned) in experts.iter().zip(&tokens_of_expert) {
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
    Ok(out)
}
