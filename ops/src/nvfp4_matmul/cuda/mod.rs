//! `nvfp4_matmul` on CUDA: the mat-vec kernel for up to `MAX_ROWS` rows, dequantise-then-matmul above
//! (kernels in `kernels/src/weight_only_matmul.cu`).

use candle_core::Tensor;

use super::{Nvfp4Weight, MAX_ROWS};
use crate::cuda::device_address;
use crate::error::Result;
use crate::weight_only_cuda::{dequantize, matvec, WeightArgs, WEIGHT_ONLY};

/// `x` `[m, k]` (f32 or bf16, contiguous, on the weight's device) times `Wᵀ`, in `x`'s dtype.
pub(crate) fn nvfp4_matmul(x: &Tensor, w: &Nvfp4Weight) -> Result<Tensor> {
    w.check()?;
    let (n, k) = w.dims()?;
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
    let dense = dequantize(
        &WEIGHT_ONLY,
        "nvfp4_dequantize",
        x.dtype(),
        x,
        (n, k),
        n * k,
        &args,
        &[n as i32, k as i32],
    )?;
    Ok(x.matmul(&dense.t()?)?)
}
