//! `fp8_matmul` on CUDA: the mat-vec kernel for up to `MAX_ROWS` rows; above, dequantise-then-matmul
//! (W8A16, kernels in `kernels/src/weight_only_matmul.cu`) or, where the weight's prefill backend is
//! `fp8-w8a8-cublaslt-block`, the W8A8 path (`w8a8.rs`: `kernels/src/fp8_quantize.cu`, then cuBLASLt's
//! block-scaled FP8 GEMM, `cublaslt.rs`).

pub(crate) mod cublaslt;
pub(crate) mod w8a8;

use candle_core::Tensor;

use super::{Fp8Activations, Fp8BlockWeight, Fp8Prefill, MAX_ROWS};
use crate::cuda::device_address;
use crate::error::{OpError, Result};
use crate::weight_only_cuda::{dequantize, matvec, WeightArgs, WEIGHT_ONLY};

/// `x` `[m, k]` (f32 or bf16, contiguous, on the weight's device) times `Wᵀ`, in `x`'s dtype; rows above
/// `MAX_ROWS` by `prefill`.
pub(crate) fn fp8_matmul(x: &Tensor, w: &Fp8BlockWeight, prefill: Fp8Prefill) -> Result<Tensor> {
    w.check()?;
    let (n, k) = w.dims()?;
    if !k.is_multiple_of(16) || !w.block[1].is_multiple_of(16) {
        return Err(OpError::Unsupported(format!(
            "fp8_matmul on CUDA: in ({k}) and weight_block_size[1] ({}) must be multiples of 16",
            w.block[1]
        )));
    }
    let weight = w.weight.contiguous()?;
    let scales = w.scale_inv.contiguous()?;
    let pointers = [device_address(&weight)?.0, device_address(&scales)?.0];
    let args = WeightArgs {
        pointers: &pointers,
        scalar: None,
    };
    let (bn, bk) = (w.block[0] as i32, w.block[1] as i32);
    if x.dim(0)? <= MAX_ROWS {
        return matvec(&WEIGHT_ONLY, "fp8_matvec", x, n, &args, &[bn, bk]);
    }
    if prefill == Fp8Prefill::W8a8Block {
        return w8a8::matmul(&w8a8::quantize_activations(x)?, w, x.dtype());
    }
    let dense = dequantize_to(w, x.dtype())?;
    Ok(x.matmul(&dense.t()?)?)
}

/// The whole weight in `dtype` (f32 or bf16) on its device.
pub(crate) fn dequantize_to(w: &Fp8BlockWeight, dtype: candle_core::DType) -> Result<Tensor> {
    w.check()?;
    let (n, k) = w.dims()?;
    let weight = w.weight.contiguous()?;
    let scales = w.scale_inv.contiguous()?;
    let pointers = [device_address(&weight)?.0, device_address(&scales)?.0];
    let args = WeightArgs {
        pointers: &pointers,
        scalar: None,
    };
    let (bn, bk) = (w.block[0] as i32, w.block[1] as i32);
    // 16 weights a thread (one load, one scale, vector stores) where every run of 16 lies in one scale block
    // and starts 16-byte aligned.
    let vectors =
        k.is_multiple_of(16) && w.block[1].is_multiple_of(16) && pointers[0].is_multiple_of(16);
    dequantize(
        &WEIGHT_ONLY,
        "fp8_dequantize",
        dtype,
        &w.weight,
        (n, k),
        if vectors { n * k / 16 } else { n * k },
        &args,
        &[n as i32, k as i32, bn, bk, i32::from(vectors)],
    )
}

/// The W8A8 backend's activation quantiser.
pub(crate) fn quantize_activations(x: &Tensor) -> Result<Fp8Activations> {
    w8a8::quantize_activations(x)
}
