//! The mixture-of-experts block of a GLM-5 layer (`docs/architecture.md`, "Mixture of experts"): the
//! sigmoid router's choice and the chosen experts' SwiGLU MLPs, summed per token.
//!
//! # Contract
//!
//! **[`router_logits`]**: `x` `[T, H]` (any float dtype), `weight` `F32 [E, H]` → `F32 [T, E]`, the router's
//! `f32(x) · weightᵀ` summed in f32 (the summation order is the implementation's).
//!
//! **[`route`]**: `logits` `F32 [T, E]` (the router's `x · Wᵀ` in f32), `correction_bias` `F32 [E]`:
//!
//! ```text
//! score(e)  = sigmoid(logits[t, e])              choice(e) = score(e) + correction_bias[e]
//! group g   = experts g·E/G .. (g+1)·E/G; its score is the sum of its two best choices
//! kept      = the `topk_group` best groups;      allowed(e) = choice(e) if e's group is kept, else -inf
//! experts   = the `top_k` best allowed(e)        (equal values: the lower expert first)
//! gate(e)   = score(e) / (Σ score + 1e-20) if `normalise`, else score(e); times `scaling`
//! ```
//!
//! Returns [`Routes`]: `ids` `U32 [T, slots]` and `gates` `F32 [T, slots]`, the `top_k` experts in choice
//! order, then, when a `shared_expert` id is given, that id with gate 1 (the shared expert runs as one more
//! slot of every token).
//!
//! **[`experts`]**: `x` `[T, H]` (bf16 or f32), the routes, and the experts' weights stacked in `x`'s dtype:
//! `gate_up` `[E', 2I, H]` (expert `e`'s gate rows, then its up rows) and `down` `[E', H, I]`, `E'` covering
//! every id in the routes. Returns `[T, H]` in `x`'s dtype:
//!
//! ```text
//! h(t, s)   = round(round(silu(round(gate_e · x_t))) · round(up_e · x_t))      e = ids[t, s]
//! out[t]    = round(Σ_s gates[t, s] · (down_e · h(t, s)))                       (f32 sum in slot order)
//! ```
//!
//! where `round` is the rounding to `x`'s dtype that the model's own bf16 linears apply.
//!
//! # Implementations
//!
//! * [`router_logits`]: on CUDA, for bf16 or f32 `x` of at most [`ROUTER_MAX_TOKENS`] tokens (decode), one
//!   kernel (`moe_router_logits_*`) reads `x` as it is and the weight once; otherwise a cast and candle's
//!   matmul (cuBLAS on CUDA), which is also the reference.
//! * `reference.rs`: routing on the host, exactly as the CPU has always done it, and one chain of candle ops
//!   per chosen expert (gather its tokens, two matmuls, SiLU·up, down, gate, `index_add`). Any device.
//! * `cuda.rs` (kernels in `kernels/src/moe.cu`): routing, grouping by expert, the grouped gate/up and down
//!   mat-vecs and the per-token sum, five kernels and no host round trip. Each chosen expert's weights are
//!   read once per step however many tokens chose it. The mat-vecs are built for a few tokens per expert
//!   (decode: bf16/f32 experts below [`GROUPED_GEMM_MIN_TOKENS`] tokens, quantised ones up to
//!   [`MATVEC_MAX_TOKENS`]).
//! * `cuda_grouped_gemm.rs`: above that (prefill, and batched decode of bf16/f32 experts), cuBLAS's grouped
//!   GEMM: the routes read back once (the layer's one host round trip, which a step captured in a CUDA
//!   graph could not take: the mat-vecs would serve it), the tokens gathered by expert, one grouped call for
//!   gate/up and one for down over every active expert
//!   (tensor cores, f32 accumulation, each projection's output rounded to `x`'s dtype), the gated rows summed
//!   per token in slot order by the same kernel as the mat-vecs. [`experts_backend`] says which
//!   implementation a call gets and why; [`experts_with`] pins one (tests, `glm5-bench moe`).
//!
//! **[`experts_gguf`]**: the same experts with their weights kept in ggml blocks, one [`QTensor`] per
//! projection stacked as GGUF stores them: `gate` and `up` `[E, I, H]`, `down` `[E, H, I]`. `x` `[T, H]` in any
//! float dtype; returns `[T, H]` in `x`'s dtype. Computed in f32 from the dequantised weights, the activations
//! rounded as the kernel says (below):
//!
//! ```text
//! h(t, s)   = silu(gate_e · x_t) ⊙ (up_e · x_t)                                   e = ids[t, s]
//! out[t]    = Σ_s gates[t, s] · (down_e · h(t, s))                                 (f32, then x's dtype)
//! ```
//!
//! Implementations ([`GgufExpertsImpl`], `cuda_gguf.rs`), all candle-nn 0.11's GGUF MoE kernels, for the
//! block types in [`GGUF_EXPERT_FORMATS`] (Q8_0, Q2_K..Q6_K):
//! * `MatVec`: `candle_nn::moe::moe_gemm_gguf` with `is_prefill = false`: activations quantised to Q8_1, one
//!   warp per output row and assignment (the mat-vec `QMatMul` uses below 9 rows).
//! * `Wmma`: the same with `is_prefill = true`: activations and dequantised weights in bf16 on tensor cores,
//!   each expert's assignments in tiles of 32 rows.
//! * `Indexed`: `QTensor::indexed_moe_forward` (Q8_1 activations, no grouping); K-quants only, because that
//!   kernel strides between experts by 256-value blocks, which is wrong for Q8_0's blocks of 32.
//!
//! [`experts_gguf_reference`] dequantises the stacked weights to f32 and runs [`experts_reference`]: the
//! independent reference, on any device.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_gguf;
#[cfg(feature = "cuda")]
mod cuda_grouped_gemm;
pub mod quantized;
mod reference;

pub use quantized::{
    quantized_experts, quantized_experts_backend, quantized_experts_backend_at,
    quantized_experts_with, QuantizedExperts, StackedFp8, StackedGgufBlocks, StackedNvfp4,
};

/// Tokens up to which [`router_logits`] runs glm5's kernel on CUDA (decode); above, cuBLAS's GEMM.
pub const ROUTER_MAX_TOKENS: usize = 16;
/// Experts the routing kernel handles (one thread each).
pub const MAX_EXPERTS: usize = 1024;
/// Expert groups the routing kernel handles.
pub const MAX_GROUPS: usize = 64;
/// Experts per token the routing kernel handles.
pub const MAX_TOP_K: usize = 64;
/// Tokens per step up to which the device mat-vecs run quantised experts (and can run bf16/f32 ones). Above it
/// (prefill) each expert sees enough tokens that GEMMs win (see `docs/performance.md`).
pub const MATVEC_MAX_TOKENS: usize = 256;
/// Tokens per step from which bf16/f32 experts run as cuBLAS's grouped GEMM rather than the mat-vecs. At
/// GLM-5's sizes on the H200 (`glm5-bench moe`) the two are level at 8 tokens and the GEMM is ahead from 32
/// (3.4 vs 4.2 ms a layer; 64 tokens 4.6 vs 6.7 ms), though its routes come back to the host once a layer.
pub const GROUPED_GEMM_MIN_TOKENS: usize = 32;

/// The router's rule (§5, `noaux_tc`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteRule {
    pub n_group: usize,
    pub topk_group: usize,
    pub top_k: usize,
    pub normalise: bool,
    pub scaling: f32,
}

/// Each token's experts and gates (contract above).
#[derive(Debug, Clone)]
pub struct Routes {
    /// `U32 [T, slots]`.
    pub ids: Tensor,
    /// `F32 [T, slots]`.
    pub gates: Tensor,
}

impl Routes {
    pub fn slots(&self) -> Result<usize> {
        Ok(self.ids.dim(1)?)
    }
}

/// Where [`experts`] runs for given inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertsBackend {
    /// The device mat-vec kernels (`kernels/src/moe.cu`).
    DeviceMatVec,
    /// cuBLAS's grouped GEMM, one call per projection for every active expert (`cuda_grouped_gemm.rs`).
    GroupedGemm,
    /// candle-nn's grouped WMMA GEMM (`moe_gemm`), bf16/f16.
    CandleMoeGemm,
    /// One chain of candle ops per expert; the reason the device kernels do not serve the call.
    Reference(String),
}

/// An implementation of [`experts`] pinned by the caller (tests, benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertsImpl {
    DeviceMatVec,
    GroupedGemm,
    /// The grouped GEMM's computation as batched GEMMs over buckets of experts of similar row counts
    /// (`cuda_grouped_gemm.rs`); pinned only until it has run against the reference and been timed.
    BucketedGemm,
    CandleMoeGemm,
    Reference,
}

fn check_rule(rule: &RouteRule, n_experts: usize) -> Result<()> {
    let bad = |what: String| Err(OpError::Unsupported(format!("moe route: {what}")));
    if rule.n_group == 0 || !n_experts.is_multiple_of(rule.n_group) {
        return bad(format!(
            "{n_experts} experts do not split into n_group = {} groups",
            rule.n_group
        ));
    }
    if rule.topk_group == 0 || rule.topk_group > rule.n_group {
        return bad(format!(
            "topk_group = {} must be in 1..={}",
            rule.topk_group, rule.n_group
        ));
    }
    if rule.top_k == 0 || rule.top_k > n_experts {
        return bad(format!("top_k = {} must be in 1..={n_experts}", rule.top_k));
    }
    Ok(())
}

/// The router's logits for every token (contract in the module docs).
pub fn router_logits(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let hidden = x.dims2()?.1;
    if weight.dtype() != DType::F32 {
        return Err(OpError::Unsupported(
            "moe router_logits: the weight must be f32".into(),
        ));
    }
    if weight.dims2()?.1 != hidden {
        return Err(OpError::Shape {
            arg: "weight",
            expected: format!("[E, {hidden}]"),
            found: weight.dims().to_vec(),
        });
    }
    crate::error::check_float("x", x)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && (1..=ROUTER_MAX_TOKENS).contains(&x.dim(0)?)
        && weight.dim(0)? > 0
    {
        if let Some(logits) = cuda::router_logits(x, weight)? {
            return Ok(logits);
        }
    }
    router_logits_reference(x, weight)
}

/// [`router_logits`] by a cast and candle's matmul, on any device.
pub fn router_logits_reference(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?.matmul(&weight.t()?)?)
}

/// The router's choice for every token (contract in the module docs).
pub fn route(
    logits: &Tensor,
    correction_bias: &Tensor,
    rule: &RouteRule,
    shared_expert: Option<u32>,
) -> Result<Routes> {
    let (_, n_experts) = logits.dims2()?;
    if logits.dtype() != DType::F32 || correction_bias.dtype() != DType::F32 {
        return Err(OpError::Unsupported(
            "moe route: logits and correction_bias must be f32".into(),
        ));
    }
    if correction_bias.dims() != [n_experts] {
        return Err(OpError::Shape {
            arg: "correction_bias",
            expected: format!("[{n_experts}]"),
            found: correction_bias.dims().to_vec(),
        });
    }
    check_rule(rule, n_experts)?;
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda()
        && n_experts <= MAX_EXPERTS
        && rule.n_group <= MAX_GROUPS
        && rule.top_k <= MAX_TOP_K
    {
        return cuda::route(logits, correction_bias, rule, shared_expert);
    }
    reference::route(logits, correction_bias, rule, shared_expert)
}

/// Which implementation [`experts`] runs for `x` `[tokens, H]` and the stacked weights, and why.
pub fn experts_backend(x: &Tensor, gate_up: &Tensor, down: &Tensor) -> ExpertsBackend {
    experts_backend_at(x.dim(0).unwrap_or(0), x.dtype(), x.device(), gate_up, down)
}

/// [`experts_backend`] for `tokens` tokens of `dtype` on `device` (no activations needed: a plan asks
/// ahead of a step).
pub fn experts_backend_at(
    tokens: usize,
    dtype: DType,
    device: &candle_core::Device,
    gate_up: &Tensor,
    down: &Tensor,
) -> ExpertsBackend {
    let reason = |why: &str| ExpertsBackend::Reference(why.to_string());
    if !device.is_cuda() {
        return reason("not a CUDA device");
    }
    if !cfg!(feature = "cuda") {
        return reason("glm5 was built without the cuda feature");
    }
    if !matches!(dtype, DType::BF16 | DType::F32) {
        return reason("the device kernels take bf16 or f32");
    }
    if tokens >= GROUPED_GEMM_MIN_TOKENS {
        return ExpertsBackend::GroupedGemm;
    }
    let row_bytes = |t: &Tensor| t.dim(2).unwrap_or(0) * t.dtype().size_in_bytes();
    if row_bytes(gate_up) % 16 != 0 || row_bytes(down) % 16 != 0 {
        return reason("expert rows must be whole 16-byte vectors");
    }
    ExpertsBackend::DeviceMatVec
}

/// The routed experts' output for every token (contract in the module docs).
pub fn experts(x: &Tensor, routes: &Routes, gate_up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let (tokens, hidden) = x.dims2()?;
    let (n_experts, two_inter, gate_up_hidden) = gate_up.dims3()?;
    let inter = two_inter / 2;
    if gate_up_hidden != hidden || two_inter % 2 != 0 {
        return Err(OpError::Shape {
            arg: "gate_up",
            expected: format!("[E, 2·I, {hidden}]"),
            found: gate_up.dims().to_vec(),
        });
    }
    if down.dims() != [n_experts, hidden, inter] {
        return Err(OpError::Shape {
            arg: "down",
            expected: format!("[{n_experts}, {hidden}, {inter}]"),
            found: down.dims().to_vec(),
        });
    }
    if gate_up.dtype() != x.dtype() || down.dtype() != x.dtype() {
        return Err(OpError::DTypeMismatch {
            arg: "gate_up/down",
            other: "x",
            expected: x.dtype(),
            found: gate_up.dtype(),
        });
    }
    if routes.ids.dim(0)? != tokens || routes.gates.dims() != routes.ids.dims() {
        return Err(OpError::Shape {
            arg: "routes",
            expected: format!("ids and gates [{tokens}, slots]"),
            found: routes.ids.dims().to_vec(),
        });
    }
    match experts_backend(x, gate_up, down) {
        ExpertsBackend::DeviceMatVec => {
            experts_with(x, routes, gate_up, down, ExpertsImpl::DeviceMatVec)
        }
        ExpertsBackend::GroupedGemm => {
            experts_with(x, routes, gate_up, down, ExpertsImpl::GroupedGemm)
        }
        ExpertsBackend::CandleMoeGemm => {
            experts_with(x, routes, gate_up, down, ExpertsImpl::CandleMoeGemm)
        }
        ExpertsBackend::Reference(_) => reference::experts(x, routes, gate_up, down),
    }
}

/// [`experts`] by the implementation `which` (an error where it cannot run these inputs).
pub fn experts_with(
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
    which: ExpertsImpl,
) -> Result<Tensor> {
    match which {
        ExpertsImpl::Reference => reference::experts(x, routes, gate_up, down),
        #[cfg(feature = "cuda")]
        ExpertsImpl::DeviceMatVec if x.device().is_cuda() => {
            cuda::experts(x, routes, gate_up, down)
        }
        #[cfg(feature = "cuda")]
        ExpertsImpl::GroupedGemm
            if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F32) =>
        {
            cuda_grouped_gemm::experts_grouped_gemm(x, routes, gate_up, down)
        }
        #[cfg(feature = "cuda")]
        ExpertsImpl::BucketedGemm
            if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F32) =>
        {
            cuda_grouped_gemm::experts_bucketed_gemm(x, routes, gate_up, down)
        }
        #[cfg(feature = "cuda")]
        ExpertsImpl::CandleMoeGemm if x.device().is_cuda() && x.dtype() == DType::BF16 => {
            cuda::experts_moe_gemm(x, routes, gate_up, down)
        }
        other => Err(OpError::Unsupported(format!(
            "moe experts: {other:?} does not run {:?} on {:?}",
            x.dtype(),
            x.device().location()
        ))),
    }
}

/// The reference implementations, for tests and benchmarks to compare against on any device.
pub fn route_reference(
    logits: &Tensor,
    correction_bias: &Tensor,
    rule: &RouteRule,
    shared_expert: Option<u32>,
) -> Result<Routes> {
    check_rule(rule, logits.dim(1)?)?;
    reference::route(logits, correction_bias, rule, shared_expert)
}

/// See [`route_reference`].
pub fn experts_reference(
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    reference::experts(x, routes, gate_up, down)
}

/// Block types candle-nn 0.11's GGUF MoE kernels (`moe_gemm_gguf`, its prefill variant) take.
pub const GGUF_EXPERT_FORMATS: [GgmlDType; 6] = [
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Tokens per call up to which [`experts_gguf`] runs the mat-vec kernel; above, the WMMA one. 8 mirrors
/// candle's own `QMatMul` switch from mat-vec to MMQ; not measured for the MoE kernels (`glm5-bench moe`
/// times both).
pub const GGUF_MATVEC_MAX_TOKENS: usize = 8;

/// Dynamic shared memory a block of candle-nn's GGUF mat-vec MoE kernel may use without opting in (it stages
/// four weight rows, and does not opt in).
const GGUF_MATVEC_SHARED_LIMIT: usize = 48 * 1024;

/// An implementation of [`experts_gguf`] (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufExpertsImpl {
    MatVec,
    Wmma,
    Indexed,
}

/// Whether candle-nn's GGUF MoE kernels can run experts stored as `formats` (gate, up, down) of `hidden` and
/// `intermediate` widths; the reason when they cannot. The model keeps such experts one `QMatMul` per
/// expert.
pub fn gguf_experts_support(
    formats: [GgmlDType; 3],
    hidden: usize,
    intermediate: usize,
) -> std::result::Result<(), String> {
    for (name, format) in ["gate", "up", "down"].iter().zip(formats) {
        if !GGUF_EXPERT_FORMATS.contains(&format) {
            return Err(format!(
                "{name} experts are {format:?}: candle-nn's GGUF MoE kernels take Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"
            ));
        }
    }
    // (k, its format): gate and up read rows of `hidden`, down rows of `intermediate`.
    for (k, format) in [
        (hidden, formats[0]),
        (hidden, formats[1]),
        (intermediate, formats[2]),
    ] {
        if !k.is_multiple_of(8) || !k.is_multiple_of(format.block_size()) {
            return Err(format!(
                "rows of {k} values: the kernels need whole {:?} blocks and a multiple of 8",
                format
            ));
        }
        let shared = k / format.block_size() * format.type_size() * 4 + 1024;
        if shared > GGUF_MATVEC_SHARED_LIMIT {
            return Err(format!(
                "rows of {k} {format:?} values: the mat-vec kernel would need {shared} bytes of shared memory (limit {GGUF_MATVEC_SHARED_LIMIT})"
            ));
        }
    }
    Ok(())
}

fn check_gguf_experts(
    x: &Tensor,
    routes: &Routes,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
) -> Result<(usize, usize, usize)> {
    let (tokens, hidden) = x.dims2()?;
    let (n_experts, inter, gate_hidden) = gate.shape().dims3()?;
    if gate_hidden != hidden {
        return Err(OpError::Shape {
            arg: "gate",
            expected: format!("[E, I, {hidden}]"),
            found: gate.shape().dims().to_vec(),
        });
    }
    if up.shape().dims() != [n_experts, inter, hidden] {
        return Err(OpError::Shape {
            arg: "up",
            expected: format!("[{n_experts}, {inter}, {hidden}]"),
            found: up.shape().dims().to_vec(),
        });
    }
    if down.shape().dims() != [n_experts, hidden, inter] {
        return Err(OpError::Shape {
            arg: "down",
            expected: format!("[{n_experts}, {hidden}, {inter}]"),
            found: down.shape().dims().to_vec(),
        });
    }
    if routes.ids.dim(0)? != tokens || routes.gates.dims() != routes.ids.dims() {
        return Err(OpError::Shape {
            arg: "routes",
            expected: format!("ids and gates [{tokens}, slots]"),
            found: routes.ids.dims().to_vec(),
        });
    }
    if !x.dtype().is_float() {
        return Err(OpError::NotFloat {
            arg: "x",
            found: x.dtype(),
        });
    }
    Ok((tokens, hidden, inter))
}

/// The routed experts' output from GGUF-stacked weights (contract in the module docs): the mat-vec kernel up
/// to [`GGUF_MATVEC_MAX_TOKENS`] tokens, the WMMA kernel above. CUDA only (elsewhere the model runs each
/// expert's `QMatMul`); an error naming the reason where the kernels cannot run these weights.
pub fn experts_gguf(
    x: &Tensor,
    routes: &Routes,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
) -> Result<Tensor> {
    let which = if x.dim(0)? <= GGUF_MATVEC_MAX_TOKENS {
        GgufExpertsImpl::MatVec
    } else {
        GgufExpertsImpl::Wmma
    };
    experts_gguf_with(x, routes, gate, up, down, which)
}

/// [`experts_gguf`] by the implementation `which`.
pub fn experts_gguf_with(
    x: &Tensor,
    routes: &Routes,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    which: GgufExpertsImpl,
) -> Result<Tensor> {
    let (_, hidden, inter) = check_gguf_experts(x, routes, gate, up, down)?;
    gguf_experts_support([gate.dtype(), up.dtype(), down.dtype()], hidden, inter)
        .map_err(|why| OpError::Unsupported(format!("moe experts_gguf: {why}")))?;
    if which == GgufExpertsImpl::Indexed
        && [gate.dtype(), up.dtype(), down.dtype()].contains(&GgmlDType::Q8_0)
    {
        return Err(OpError::Unsupported(
            "moe experts_gguf: indexed_moe_forward strides Q8_0 experts wrongly (256-value blocks)"
                .into(),
        ));
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda_gguf::experts(x, routes, gate, up, down, which);
    }
    Err(OpError::Unsupported(format!(
        "moe experts_gguf: candle-nn's GGUF MoE kernels run on CUDA only, not {:?}",
        x.device().location()
    )))
}

/// The independent reference of [`experts_gguf`]: the stacked weights dequantised to f32 on `x`'s device,
/// then [`experts_reference`] in f32 (no activation rounding), cast to `x`'s dtype.
pub fn experts_gguf_reference(
    x: &Tensor,
    routes: &Routes,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
) -> Result<Tensor> {
    check_gguf_experts(x, routes, gate, up, down)?;
    let device = x.device();
    let gate_up = Tensor::cat(&[gate.dequantize(device)?, up.dequantize(device)?], 1)?;
    let down = down.dequantize(device)?;
    Ok(
        reference::experts(&x.to_dtype(DType::F32)?, routes, &gate_up, &down)?
            .to_dtype(x.dtype())?,
    )
}
