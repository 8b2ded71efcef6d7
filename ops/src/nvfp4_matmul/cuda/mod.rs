//! `nvfp4_matmul` on CUDA: the mat-vec kernel for up to `MAX_ROWS` rows; above, dequantise-then-matmul
//! (W4A16, kernels in `kernels/src/weight_only_matmul.cu`) or, where the weight's prefill backend is
//! `nvfp4-w4a4-mma-sm120`, the W4A4 GEMM (`w4a4.rs`, `kernels/src/nvfp4_mma_sm120a.cu`).

mod w4a4;

use candle_core::Tensor;

use super::{Nvfp4Activations, Nvfp4Weight, Prefill, MAX_ROWS};
use crate::cuda::device_address;
use crate::error::Result;
use crate::weight_only_cuda::{dequantize, matvec, WeightArgs, WEIGHT_ONLY};

/// `x` `[m, k]` (f32 or bf16, contiguous, on the weight's device) times `Wᵀ`, in `x`'s dtype; rows above
/// `MAX_ROWS` by `prefill`.
pub(crate) fn nvfp4_matmul(x: &Tensor, w: &Nvfp4Weight, prefill: Prefill) -> Result<Tensor> {
    w.check()?;
    let (n, _) = w.dims()?;
    let packed = w.packed.contiguous()?;
    let scales = w.scales.contiguous()?;
    let pointers = [device_address(&packed)?.0, device_address(&scales)?.0];
    let args = WeightArgs {
        pointers: &pointers,
        scalar: Some(&w.global_scale),
    };
    if x.dim(0)? <= MAX_ROWS {
        return matvec(&WEIGHT_ONLY, "nvfp4_matvec", x, n, &args, &[]);
    }
    if prefill == Prefill::W4a4Sm120 {
        return w4a4::matmul(x, w);
    }
    let dense = dequantize_to(w, x.dtype())?;
    Ok(x.matmul(&dense.t()?)?)
}

/// The whole weight in `dtype` (f32 or bf16) on its device (W4A16's values).
pub(crate) fn dequantize_to(w: &Nvfp4Weight, dtype: candle_core::DType) -> Result<Tensor> {
    w.check()?;
    let (n, k) = w.dims()?;
    let packed = w.packed.contiguous()?;
    let scales = w.scales.contiguous()?;
    let pointers = [device_address(&packed)?.0, device_address(&scales)?.0];
    let args = WeightArgs {
        pointers: &pointers,
        scalar: Some(&w.global_scale),
    };
    // A 16-value group a thread (one 8-byte load, vector stores) where the packed bytes start 8-byte aligned.
    let vectors = k.is_multiple_of(16) && pointers[0].is_multiple_of(8);
    dequantize(
        &WEIGHT_ONLY,
        "nvfp4_dequantize",
        dtype,
        &w.packed,
        (n, k),
        if vectors { n * k / 16 } else { n * k },
        &args,
        &[n as i32, k as i32, i32::from(vectors)],
    )
}

/// The W4A4 backend's activation quantiser (sm_120 only).
pub(crate) fn quantize_activations(x: &Tensor) -> Result<Nvfp4Activations> {
    w4a4::quantize_activations(x)
}
