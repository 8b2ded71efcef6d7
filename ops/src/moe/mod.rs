//! The mixture-of-experts block of a GLM-5 layer (`docs/architecture.md`, "Mixture of experts"): the
//! sigmoid router's choice and the chosen experts' SwiGLU MLPs, summed per token.
//!
//! # Contract
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
//! * `reference.rs`: routing on the host, exactly as the CPU has always done it, and one chain of candle ops
//!   per chosen expert (gather its tokens, two matmuls, SiLU·up, down, gate, `index_add`). Any device.
//! * `cuda.rs` (kernels in `kernels/src/moe.cu`): routing, grouping by expert, the grouped gate/up and down
//!   mat-vecs and the per-token sum, five kernels and no host round trip. Each chosen expert's weights are
//!   read once per step however many tokens chose it. The mat-vecs are built for a few tokens per expert
//!   (decode); [`experts_backend`] says which implementation a call gets and why.

use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;
pub mod quantized;
mod reference;

pub use quantized::{
    quantized_experts, quantized_experts_backend, quantized_experts_with, QuantizedExperts, StackedFp8,
    StackedNvfp4,
};

/// Experts the routing kernel handles (one thread each).
pub const MAX_EXPERTS: usize = 1024;
/// Expert groups the routing kernel handles.
pub const MAX_GROUPS: usize = 64;
/// Experts per token the routing kernel handles.
pub const MAX_TOP_K: usize = 64;
/// Tokens per step up to which the device mat-vecs run the experts. Above it (prefill) each expert sees
/// enough tokens that a GEMM per expert wins (see `docs/performance.md`).
pub const MATVEC_MAX_TOKENS: usize = 256;

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
    /// candle-nn's grouped WMMA GEMM (`moe_gemm`), bf16/f16.
    CandleMoeGemm,
    /// One chain of candle ops per expert; the reason the device kernels do not serve the call.
    Reference(String),
}

/// An implementation of [`experts`] pinned by the caller (tests, benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertsImpl {
    DeviceMatVec,
    CandleMoeGemm,
    Reference,
}

fn check_rule(rule: &RouteRule, n_experts: usize) -> Result<()> {
    let bad = |what: String| Err(OpError::Unsupported(format!("moe route: {what}")));
    if rule.n_group == 0 || n_experts % rule.n_group != 0 {
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
    let reason = |why: &str| ExpertsBackend::Reference(why.to_string());
    if !x.device().is_cuda() {
        return reason("not a CUDA device");
    }
    if !cfg!(feature = "cuda") {
        return reason("glm5 was built without the cuda feature");
    }
    let tokens = x.dim(0).unwrap_or(0);
    if tokens > MATVEC_MAX_TOKENS {
        return reason(&format!(
            "{tokens} tokens: above {MATVEC_MAX_TOKENS} the experts run as one GEMM chain per expert"
        ));
    }
    if !matches!(x.dtype(), DType::BF16 | DType::F32) {
        return reason("the device kernels take bf16 or f32");
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
