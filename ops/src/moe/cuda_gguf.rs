//! GGUF-stacked experts on candle-nn 0.11's GGUF MoE kernels (`candle-kernels` `moe/moe_gguf.cu`,
//! `moe/moe_wmma_gguf.cu`, and `quantized.cu`'s `indexed_moe_forward_*`). The routes stay on the device:
//! `moe_align` (`cuda.rs`) groups the assignments by expert, which is the sorted list the kernels expect.

use candle_core::quantized::QTensor;
use candle_core::{DType, Tensor};

use super::cuda::group_by_expert;
use super::{GgufExpertsImpl, Routes};
use crate::error::Result;

/// A copy in its own allocation: the candle-nn kernels read their inputs from the start of the allocation
/// and ignore the layout's offset (`Tensor::copy` keeps the offset, `force_contiguous` does not).
fn fresh(t: &Tensor) -> Result<Tensor> {
    Ok(t.force_contiguous()?)
}

/// `x` as f32 in its own allocation (the mat-vec kernels quantise f32 activations to Q8_1).
fn fresh_f32(x: &Tensor) -> Result<Tensor> {
    if x.dtype() == DType::F32 {
        fresh(x)
    } else {
        // A dtype conversion writes a new contiguous allocation.
        Ok(x.to_dtype(DType::F32)?)
    }
}

pub(super) fn experts(
    x: &Tensor,
    routes: &Routes,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    which: GgufExpertsImpl,
) -> Result<Tensor> {
    let (tokens, hidden) = x.dims2()?;
    let slots = routes.slots()?;
    if tokens * slots == 0 {
        return Ok(Tensor::zeros((tokens, hidden), x.dtype(), x.device())?);
    }
    let y = match which {
        GgufExpertsImpl::Indexed => indexed(x, routes, gate, up, down)?,
        GgufExpertsImpl::MatVec => moe_gemm(x, routes, gate, up, down, false)?,
        GgufExpertsImpl::Wmma => moe_gemm(x, routes, gate, up, down, true)?,
    };
    // y: f32 [tokens, slots, hidden], each slot already times its gate; the sum in f32, in slot order.
    Ok(y.sum(1)?.to_dtype(x.dtype())?)
}

/// `moe_gemm_gguf`: gate and up over the sorted assignments (output row = assignment), SiLU·up in f32, down
/// with the gates applied in the kernel.
fn moe_gemm(
    x: &Tensor,
    routes: &Routes,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    prefill: bool,
) -> Result<Tensor> {
    let (tokens, hidden) = x.dims2()?;
    let slots = routes.slots()?;
    let n_experts = gate.shape().dims3()?.0;
    let ids = fresh(&routes.ids.flatten_all()?)?;
    let gates = fresh(&routes.gates.flatten_all()?)?;
    let x = fresh_f32(x)?;
    let grouping = group_by_expert(&ids, n_experts)?;
    // The mat-vec kernel reads `expert_ids[m]` as the expert of sorted row m (the WMMA kernel only counts
    // them): the experts in sorted order, in their own allocation.
    let sorted_experts = ids.index_select(&grouping.sorted, 0)?;
    // The WMMA kernel's operand type: bf16 (candle-kernels builds it for sm_80 and later).
    let wmma = DType::BF16;
    let run = |input: &Tensor, weights: &QTensor, gates: &Option<Tensor>| {
        candle_nn::moe::moe_gemm_gguf(
            input,
            weights,
            gates,
            &grouping.sorted,
            &sorted_experts,
            slots,
            prefill,
            wmma,
        )
    };
    let g = run(&x, gate, &None)?;
    let u = run(&x, up, &None)?;
    let h = (g.silu()? * u)?;
    let y = run(&h, down, &Some(gates))?;
    Ok(y.reshape((tokens, slots, hidden))?)
}

/// `QTensor::indexed_moe_forward`: no grouping; gate/up read `x` `[T, 1, H]` per (token, slot), down reads
/// `h` `[T, slots, I]`; the gates are applied after.
fn indexed(
    x: &Tensor,
    routes: &Routes,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
) -> Result<Tensor> {
    let (tokens, hidden) = x.dims2()?;
    let ids = fresh(&routes.ids)?;
    let x = fresh_f32(&x.reshape((tokens, 1, hidden))?)?;
    let g = gate.indexed_moe_forward(&x, &ids)?;
    let u = up.indexed_moe_forward(&x, &ids)?;
    // A product of two tensors is a new allocation.
    let h = (g.silu()? * u)?;
    let y = down.indexed_moe_forward(&h, &ids)?;
    Ok(y.broadcast_mul(&routes.gates.unsqueeze(2)?)?)
}
