//! Routed experts kept quantised (block-scaled FP8 as `zai-org/GLM-5-FP8` ships them, NVFP4 as ModelOpt
//! exports them), stacked per projection so that one grouped launch serves every chosen expert.
//!
//! # Contract
//!
//! [`quantized_experts`] computes exactly what [`super::experts`] computes (module contract there), with
//! expert `e`'s matrices standing for their dequantised values (`fp8_matmul` / `nvfp4_matmul` contracts):
//! a projection is stacked as `[E', rows, k]`, its rows split into `parts` equal parts that were quantised
//! separately (gate_up: 2 parts, the gate rows then the up rows; down: 1 part), each part with its own
//! scales:
//!
//! * [`StackedFp8`]: `weight` `U8 [E', rows, k]` (e4m3 bytes), `scale_inv`
//!   `F32 [E', parts, ceil(rows/parts / block_out), ceil(k / block_in)]`.
//! * [`StackedNvfp4`]: `packed` `U8 [E', rows, k/2]`, `scales` `U8 [E', rows, k/16]` (e4m3),
//!   `global_scales` `F32 [E', parts]`; `prefill`: with [`Prefill::W4a4Sm120`] an expert's projection of
//!   more than `nvfp4_matmul::MAX_ROWS` tokens is W4A4 (its activations rounded to NVFP4 first,
//!   `nvfp4_matmul` contract) instead of the exact product above.
//! * [`StackedGgufBlocks`]: GGUF i-quant experts as the file stacks them, `blocks` `U8 [E, rows, row bytes]` (scales
//!   inside the blocks), one tensor per projection: [`QuantizedExperts::GgufBlocks`] keeps gate and up apart (two
//!   tensors of one format; down may have another).
//!
//! # Implementations
//!
//! * Reference (any device): the tokens of each chosen expert gathered on the host as in
//!   `reference::experts`, each projection by `fp8_matmul` / `nvfp4_matmul` on a view of the expert's part
//!   (so prefill on the GPU dequantises only the chosen experts, one at a time, and multiplies with cuBLAS;
//!   NVFP4 rows above `nvfp4_matmul::MAX_ROWS` by the stacked projection's [`StackedNvfp4::prefill`]
//!   backend, W4A4 on sm_120 where the experts' dispatch chose it).
//! * CUDA (`kernels/src/moe.cu`, `moe_{gate_up,down}_{fp8,nvfp4,<i-quant>}_*`): the routing, grouping and
//!   combine kernels of the dense experts, with the grouped mat-vecs dequantising in registers; no host round
//!   trip.

use candle_core::{DType, Tensor};

use super::{ExpertsBackend, ExpertsImpl, Routes, MATVEC_MAX_TOKENS};
use crate::error::{OpError, Result};
use crate::fp8_matmul::{fp8_matmul, Fp8BlockWeight};
use crate::gguf_matmul::{gguf_matmul, GgufFormat, GgufWeight};
use crate::nvfp4_matmul::{nvfp4_matmul_with, Nvfp4Weight, Prefill, GROUP};

/// A stacked block-scaled FP8 projection (module contract).
#[derive(Debug, Clone)]
pub struct StackedFp8 {
    pub weight: Tensor,
    pub scale_inv: Tensor,
    /// `[block_out, block_in]`.
    pub block: [usize; 2],
}

/// A stacked NVFP4 projection (module contract).
#[derive(Debug, Clone)]
pub struct StackedNvfp4 {
    pub packed: Tensor,
    pub scales: Tensor,
    pub global_scales: Tensor,
    /// `global_scales` on the host, `[E'][parts]`, for the reference.
    pub global_on_host: Vec<Vec<f32>>,
    /// How the reference path multiplies an expert's rows above `nvfp4_matmul::MAX_ROWS` (the experts'
    /// dispatched prefill backend; [`StackedNvfp4::stack`] sets W4A16).
    pub prefill: Prefill,
}

/// One projection of GGUF i-quant experts, stacked as the file stores it (module contract).
#[derive(Debug, Clone)]
pub struct StackedGgufBlocks {
    pub format: GgufFormat,
    /// `U8 [E, rows, row_bytes(k)]`.
    pub blocks: Tensor,
    /// Values per row.
    pub k: usize,
}

impl StackedGgufBlocks {
    /// Checks the bytes hold `[E, rows, k]` values of `format`.
    pub fn new(format: GgufFormat, blocks: Tensor, k: usize) -> Result<Self> {
        let stacked = Self { format, blocks, k };
        stacked.dims()?;
        Ok(stacked)
    }

    /// `(E, rows, k)`.
    pub fn dims(&self) -> Result<(usize, usize, usize)> {
        let (e, rows, bytes) = self.blocks.dims3()?;
        if self.blocks.dtype() != DType::U8 || self.format.row_bytes(self.k) != Some(bytes) {
            return Err(mismatch(
                "i-quant experts",
                format!(
                    "U8 [E, rows, {:?}] ({} values of {} per row)",
                    self.format.row_bytes(self.k),
                    self.k,
                    self.format
                ),
                self.blocks.dims(),
            ));
        }
        Ok((e, rows, self.k))
    }

    /// Whether `extra` can be one more of these experts: its format, rows, row length and device.
    fn takes(&self, extra: &GgufWeight) -> Result<bool> {
        let (_, rows, k) = self.dims()?;
        Ok(extra.format == self.format
            && extra.in_dim == k
            && extra.blocks.dim(0)? == rows
            && extra.blocks.device().same_device(self.blocks.device()))
    }

    /// Appends `extra` (checked by `takes`) as the last expert: the stack is copied once, one expert longer.
    fn push(&mut self, extra: &GgufWeight) -> Result<()> {
        let blocks = Tensor::cat(&[&self.blocks, &extra.blocks.unsqueeze(0)?], 0)?;
        *self = Self::new(self.format, blocks, self.k)?;
        Ok(())
    }

    /// Expert `e`'s matrix as a weight of its own (a view).
    fn expert(&self, e: usize) -> Result<GgufWeight> {
        GgufWeight::new(self.format, self.blocks.get(e)?, self.k)
    }
}

/// Both projections of the stacked experts in one format.
#[derive(Debug, Clone)]
pub enum QuantizedExperts {
    Fp8 {
        gate_up: StackedFp8,
        down: StackedFp8,
    },
    Nvfp4 {
        gate_up: StackedNvfp4,
        down: StackedNvfp4,
    },
    /// GGUF i-quants: gate and up of one format, down of any.
    GgufBlocks {
        gate: StackedGgufBlocks,
        up: StackedGgufBlocks,
        down: StackedGgufBlocks,
    },
}

fn mismatch(what: &str, expected: String, found: &[usize]) -> OpError {
    OpError::Shape {
        arg: "quantized experts",
        expected: format!("{what}: {expected}"),
        found: found.to_vec(),
    }
}

impl StackedFp8 {
    /// Stacks `experts[e][p]` (expert `e`'s part `p`, all parts of one shape and block size).
    pub fn stack(experts: &[Vec<&Fp8BlockWeight>]) -> Result<Self> {
        let first = experts
            .first()
            .and_then(|parts| parts.first())
            .ok_or_else(|| OpError::Unsupported("quantized experts: nothing to stack".into()))?;
        let (part_rows, k) = first.dims()?;
        let mut weights = Vec::with_capacity(experts.len());
        let mut scales = Vec::with_capacity(experts.len());
        for parts in experts {
            for part in parts {
                part.check()?;
                if part.dims()? != (part_rows, k) || part.block != first.block {
                    return Err(mismatch(
                        "every FP8 part",
                        format!("[{part_rows}, {k}] in blocks {:?}", first.block),
                        part.weight.dims(),
                    ));
                }
            }
            let rows: Vec<&Tensor> = parts.iter().map(|p| &p.weight).collect();
            weights.push(Tensor::cat(&rows, 0)?);
            let part_scales: Vec<&Tensor> = parts.iter().map(|p| &p.scale_inv).collect();
            scales.push(Tensor::stack(&part_scales, 0)?);
        }
        Ok(Self {
            weight: Tensor::stack(&weights, 0)?,
            scale_inv: Tensor::stack(&scales, 0)?,
            block: first.block,
        })
    }

    /// `(E', rows, k, parts)`.
    pub fn dims(&self) -> Result<(usize, usize, usize, usize)> {
        let (e, rows, k) = self.weight.dims3()?;
        Ok((e, rows, k, self.scale_inv.dim(1)?))
    }

    /// Expert `e`'s part `p` as a weight of its own (a view).
    fn part(&self, e: usize, p: usize) -> Result<Fp8BlockWeight> {
        let (_, rows, _, parts) = self.dims()?;
        let part_rows = rows / parts;
        Ok(Fp8BlockWeight {
            weight: self.weight.get(e)?.narrow(0, p * part_rows, part_rows)?,
            scale_inv: self.scale_inv.get(e)?.get(p)?,
            block: self.block,
        })
    }

    fn check(&self) -> Result<()> {
        let (e, rows, k, parts) = self.dims()?;
        let [bo, bi] = self.block;
        if self.weight.dtype() != DType::U8 || self.scale_inv.dtype() != DType::F32 {
            return Err(OpError::Unsupported(
                "quantized experts: FP8 weight must be U8 and scale_inv F32".into(),
            ));
        }
        if parts == 0 || !rows.is_multiple_of(parts) || bo == 0 || bi == 0 {
            return Err(mismatch(
                "FP8 rows in equal parts",
                format!("{rows} rows, {parts} parts, blocks {:?}", self.block),
                self.weight.dims(),
            ));
        }
        let expected = [e, parts, (rows / parts).div_ceil(bo), k.div_ceil(bi)];
        if self.scale_inv.dims() != expected {
            return Err(mismatch(
                "FP8 scale_inv",
                format!("{expected:?}"),
                self.scale_inv.dims(),
            ));
        }
        Ok(())
    }
}

impl StackedNvfp4 {
    /// Stacks `experts[e][p]` (expert `e`'s part `p`, all parts of one shape).
    pub fn stack(experts: &[Vec<&Nvfp4Weight>]) -> Result<Self> {
        let first = experts
            .first()
            .and_then(|parts| parts.first())
            .ok_or_else(|| OpError::Unsupported("quantized experts: nothing to stack".into()))?;
        let dims = first.dims()?;
        let (mut packed, mut scales, mut globals) = (Vec::new(), Vec::new(), Vec::new());
        for parts in experts {
            for part in parts {
                part.check()?;
                if part.dims()? != dims {
                    return Err(mismatch(
                        "every NVFP4 part",
                        format!("[{}, {}]", dims.0, dims.1),
                        part.packed.dims(),
                    ));
                }
            }
            packed.push(Tensor::cat(
                &parts.iter().map(|p| &p.packed).collect::<Vec<_>>(),
                0,
            )?);
            scales.push(Tensor::cat(
                &parts.iter().map(|p| &p.scales).collect::<Vec<_>>(),
                0,
            )?);
            globals.push(parts.iter().map(|p| p.global_scale).collect::<Vec<f32>>());
        }
        let device = first.packed.device();
        let (e, parts) = (globals.len(), globals[0].len());
        Ok(Self {
            packed: Tensor::stack(&packed, 0)?,
            scales: Tensor::stack(&scales, 0)?,
            global_scales: Tensor::from_vec(globals.concat(), (e, parts), device)?,
            global_on_host: globals,
            prefill: Prefill::W4a16,
        })
    }

    /// The same stack, its prefill rows by `prefill` (the experts' dispatched prefill backend).
    pub fn with_prefill(self, prefill: Prefill) -> Self {
        Self { prefill, ..self }
    }

    /// `(E', rows, k, parts)`.
    pub fn dims(&self) -> Result<(usize, usize, usize, usize)> {
        let (e, rows, half) = self.packed.dims3()?;
        Ok((e, rows, half * 2, self.global_scales.dim(1)?))
    }

    fn part(&self, e: usize, p: usize) -> Result<Nvfp4Weight> {
        let (_, rows, _, parts) = self.dims()?;
        let part_rows = rows / parts;
        Ok(Nvfp4Weight {
            packed: self.packed.get(e)?.narrow(0, p * part_rows, part_rows)?,
            scales: self.scales.get(e)?.narrow(0, p * part_rows, part_rows)?,
            global_scale: self.global_on_host[e][p],
        })
    }

    fn check(&self) -> Result<()> {
        let (e, rows, k, parts) = self.dims()?;
        if self.packed.dtype() != DType::U8
            || self.scales.dtype() != DType::U8
            || self.global_scales.dtype() != DType::F32
        {
            return Err(OpError::Unsupported(
                "quantized experts: NVFP4 packed and scales must be U8, global scales F32".into(),
            ));
        }
        if parts == 0 || !rows.is_multiple_of(parts) || !k.is_multiple_of(GROUP) {
            return Err(mismatch(
                "NVFP4 rows in equal parts, k a multiple of 16",
                format!("{rows} rows, {parts} parts, k {k}"),
                self.packed.dims(),
            ));
        }
        if self.scales.dims() != [e, rows, k / GROUP]
            || self.global_on_host.len() != e
            || self.global_on_host.iter().any(|g| g.len() != parts)
        {
            return Err(mismatch(
                "NVFP4 scales",
                format!("[{e}, {rows}, {}] and {e}x{parts} global scales", k / GROUP),
                self.scales.dims(),
            ));
        }
        Ok(())
    }
}

impl QuantizedExperts {
    /// `(E', hidden, inter)`, after checking both projections agree.
    pub fn dims(&self) -> Result<(usize, usize, usize)> {
        if let QuantizedExperts::GgufBlocks { gate, up, down } = self {
            let (e, inter, hidden) = gate.dims()?;
            if up.dims()? != (e, inter, hidden)
                || down.dims()? != (e, hidden, inter)
                || up.format != gate.format
            {
                return Err(mismatch(
                    "i-quant gate and up [E, I, H] of one format, down [E, H, I]",
                    format!(
                        "gate {} [{e}, {inter}, {hidden}], up {}, down {}",
                        gate.format, up.format, down.format
                    ),
                    down.blocks.dims(),
                ));
            }
            return Ok((e, hidden, inter));
        }
        let ((e, two_inter, hidden, gate_up_parts), down) = match self {
            QuantizedExperts::Fp8 { gate_up, down } => {
                gate_up.check()?;
                down.check()?;
                (gate_up.dims()?, down.dims()?)
            }
            QuantizedExperts::Nvfp4 { gate_up, down } => {
                gate_up.check()?;
                down.check()?;
                (gate_up.dims()?, down.dims()?)
            }
            QuantizedExperts::GgufBlocks { .. } => unreachable!("returned above"),
        };
        let inter = two_inter / 2;
        if gate_up_parts != 2 || down != (e, hidden, inter, 1) {
            return Err(mismatch(
                "gate_up [E, 2I, H] in 2 parts, down [E, H, I] in 1",
                format!("down [{e}, {hidden}, {inter}]"),
                &[down.0, down.1, down.2],
            ));
        }
        Ok((e, hidden, inter))
    }

    /// Appends one expert of projections `[gate, up, down]` as the last of GGUF-block experts (the shared
    /// expert as a slot: its mat-vecs then run in the experts' launches) and returns true; false, changing
    /// nothing, where these are not GGUF blocks or a projection is not in its stack's format and shape. Each
    /// stack is copied once, one after the other: the load needs one projection's stack more, not three.
    pub fn push_gguf_expert(&mut self, [gate, up, down]: [&GgufWeight; 3]) -> Result<bool> {
        let QuantizedExperts::GgufBlocks {
            gate: gates,
            up: ups,
            down: downs,
        } = self
        else {
            return Ok(false);
        };
        if !(gates.takes(gate)? && ups.takes(up)? && downs.takes(down)?) {
            return Ok(false);
        }
        gates.push(gate)?;
        ups.push(up)?;
        downs.push(down)?;
        Ok(true)
    }

    /// The format's name, as the experts' implementation is reported.
    pub fn format(&self) -> &'static str {
        match self {
            QuantizedExperts::Fp8 { .. } => "fp8",
            QuantizedExperts::Nvfp4 { .. } => "nvfp4",
            QuantizedExperts::GgufBlocks { .. } => "i-quant",
        }
    }

    /// Expert `e`'s projection `which` dequantised to `dtype` on its device (f32 or bf16; CUDA).
    #[cfg(feature = "cuda")]
    pub(super) fn dense(&self, e: usize, which: Projection, dtype: DType) -> Result<Tensor> {
        match self {
            QuantizedExperts::Fp8 { gate_up, down } => {
                let part = match which {
                    Projection::Gate => gate_up.part(e, 0)?,
                    Projection::Up => gate_up.part(e, 1)?,
                    Projection::Down => down.part(e, 0)?,
                };
                crate::fp8_matmul::cuda::dequantize_to(&part, dtype)
            }
            QuantizedExperts::Nvfp4 { gate_up, down } => {
                let part = match which {
                    Projection::Gate => gate_up.part(e, 0)?,
                    Projection::Up => gate_up.part(e, 1)?,
                    Projection::Down => down.part(e, 0)?,
                };
                crate::nvfp4_matmul::cuda::dequantize_to(&part, dtype)
            }
            QuantizedExperts::GgufBlocks { gate, up, down } => {
                let stacked = match which {
                    Projection::Gate => gate,
                    Projection::Up => up,
                    Projection::Down => down,
                };
                crate::gguf_matmul::cuda::dequantize(&stacked.expert(e)?, dtype)
            }
        }
    }

    /// Expert `e`'s gate, up and down projections.
    fn project(&self, e: usize, x: &Tensor, which: Projection) -> Result<Tensor> {
        match self {
            QuantizedExperts::Fp8 { gate_up, down } => match which {
                Projection::Gate => fp8_matmul(x, &gate_up.part(e, 0)?),
                Projection::Up => fp8_matmul(x, &gate_up.part(e, 1)?),
                Projection::Down => fp8_matmul(x, &down.part(e, 0)?),
            },
            QuantizedExperts::Nvfp4 { gate_up, down } => match which {
                Projection::Gate => nvfp4_matmul_with(x, &gate_up.part(e, 0)?, gate_up.prefill),
                Projection::Up => nvfp4_matmul_with(x, &gate_up.part(e, 1)?, gate_up.prefill),
                Projection::Down => nvfp4_matmul_with(x, &down.part(e, 0)?, down.prefill),
            },
            QuantizedExperts::GgufBlocks { gate, up, down } => match which {
                Projection::Gate => gguf_matmul(x, &gate.expert(e)?),
                Projection::Up => gguf_matmul(x, &up.expert(e)?),
                Projection::Down => gguf_matmul(x, &down.expert(e)?),
            },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Projection {
    Gate,
    Up,
    Down,
}

/// Which implementation [`quantized_experts`] runs for `x` `[tokens, H]`, and why.
pub fn quantized_experts_backend(x: &Tensor, weights: &QuantizedExperts) -> ExpertsBackend {
    quantized_experts_backend_at(x.dim(0).unwrap_or(0), x.dtype(), x.device(), weights)
}

/// [`quantized_experts_backend`] for `tokens` tokens of `dtype` on `device`.
pub fn quantized_experts_backend_at(
    tokens: usize,
    dtype: DType,
    device: &candle_core::Device,
    weights: &QuantizedExperts,
) -> ExpertsBackend {
    let reason = |why: String| ExpertsBackend::Reference(why);
    if !device.is_cuda() {
        return reason("not a CUDA device".into());
    }
    if !cfg!(feature = "cuda") {
        return reason("glm5 was built without the cuda feature".into());
    }
    if !matches!(dtype, DType::BF16 | DType::F32) {
        return reason("the device kernels take bf16 or f32".into());
    }
    let Ok((_, hidden, inter)) = weights.dims() else {
        return reason("inconsistent stacked experts".into());
    };
    if !hidden.is_multiple_of(16) || !inter.is_multiple_of(16) {
        return reason(format!(
            "hidden ({hidden}) and intermediate ({inter}) sizes must be multiples of 16"
        ));
    }
    if let QuantizedExperts::Fp8 { gate_up, down } = weights {
        if !gate_up.block[1].is_multiple_of(16) || !down.block[1].is_multiple_of(16) {
            return reason("FP8 weight_block_size[1] must be a multiple of 16".into());
        }
    }
    // (i-quant rows are whole blocks of 32 or 256 values, which `dims` checked.)
    if tokens > MATVEC_MAX_TOKENS {
        // Each active expert dequantised once (the same kernels), then tensor-core GEMMs over its tokens.
        ExpertsBackend::GroupedGemm
    } else {
        ExpertsBackend::DeviceMatVec
    }
}

/// The routed experts' output for every token (module contract).
pub fn quantized_experts(
    x: &Tensor,
    routes: &Routes,
    weights: &QuantizedExperts,
) -> Result<Tensor> {
    let which = match quantized_experts_backend(x, weights) {
        ExpertsBackend::DeviceMatVec => ExpertsImpl::DeviceMatVec,
        ExpertsBackend::GroupedGemm => ExpertsImpl::GroupedGemm,
        _ => ExpertsImpl::Reference,
    };
    quantized_experts_with(x, routes, weights, which)
}

/// [`quantized_experts`] by the implementation `which` (an error where it cannot run these inputs).
pub fn quantized_experts_with(
    x: &Tensor,
    routes: &Routes,
    weights: &QuantizedExperts,
    which: ExpertsImpl,
) -> Result<Tensor> {
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let dims @ (n_experts, hidden, _) = weights.dims()?;
    let tokens = x.dim(0)?;
    if x.dims() != [tokens, hidden] {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[tokens, {hidden}]"),
            found: x.dims().to_vec(),
        });
    }
    if routes.ids.dim(0)? != tokens || routes.gates.dims() != routes.ids.dims() {
        return Err(OpError::Shape {
            arg: "routes",
            expected: format!("ids and gates [{tokens}, slots]"),
            found: routes.ids.dims().to_vec(),
        });
    }
    match which {
        ExpertsImpl::Reference => reference(x, routes, weights, n_experts),
        #[cfg(feature = "cuda")]
        ExpertsImpl::DeviceMatVec if x.device().is_cuda() => {
            super::cuda::quantized_experts(x, routes, weights, dims)
        }
        #[cfg(feature = "cuda")]
        ExpertsImpl::GroupedGemm
            if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F32) =>
        {
            super::cuda_grouped_gemm::quantized_experts_grouped_gemm(x, routes, weights, dims)
        }
        other => Err(OpError::Unsupported(format!(
            "moe quantized experts: {other:?} does not run {:?} on {:?}",
            x.dtype(),
            x.device().location()
        ))),
    }
}

/// One chain of ops per chosen expert, as `reference::experts` with quantised projections.
fn reference(
    x: &Tensor,
    routes: &Routes,
    weights: &QuantizedExperts,
    n_experts: usize,
) -> Result<Tensor> {
    let ids: Vec<Vec<u32>> = routes.ids.to_vec2()?;
    let gates: Vec<Vec<f32>> = routes.gates.to_vec2()?;
    let mut tokens_of_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); n_experts];
    for (token, (ids, gates)) in ids.iter().zip(&gates).enumerate() {
        for (&expert, &gate) in ids.iter().zip(gates) {
            let list = tokens_of_expert.get_mut(expert as usize).ok_or_else(|| {
                OpError::Unsupported(format!(
                    "moe experts: token {token} is routed to expert {expert} of {n_experts}"
                ))
            })?;
            list.push((token as u32, gate));
        }
    }
    let assignments: Vec<&(u32, f32)> = tokens_of_expert.iter().flatten().collect();
    let all_rows = Tensor::from_vec(
        assignments.iter().map(|a| a.0).collect(),
        assignments.len(),
        x.device(),
    )?;
    let all_gates = Tensor::from_vec(
        assignments.iter().map(|a| a.1).collect(),
        (assignments.len(), 1),
        x.device(),
    )?
    .to_dtype(x.dtype())?;
    let mut out = x.zeros_like()?;
    let mut start = 0;
    for (expert, assigned) in tokens_of_expert.iter().enumerate() {
        if assigned.is_empty() {
            continue;
        }
        let rows = all_rows.narrow(0, start, assigned.len())?;
        let gates = all_gates.narrow(0, start, assigned.len())?;
        start += assigned.len();
        let xs = x.index_select(&rows, 0)?;
        let gate = weights.project(expert, &xs, Projection::Gate)?;
        let up = weights.project(expert, &xs, Projection::Up)?;
        let h = (gate.silu()? * up)?;
        let y = weights
            .project(expert, &h, Projection::Down)?
            .broadcast_mul(&gates)?;
        out = out.index_add(&rows, &y, 0)?;
    }
    Ok(out)
}
