//! `iq_matmul` on CUDA: the mat-vec kernel for up to `MAX_ROWS` rows, dequantise-then-matmul above
//! (kernels in `kernels/src/iq_matmul.cu`).

use candle_core::{DType, Tensor};

use super::{IqWeight, MAX_ROWS};
use crate::cuda::device_address;
use crate::error::Result;
use crate::weight_only_cuda::{self, KernelFile, WeightArgs};

const FILE: KernelFile = KernelFile {
    module: "iq_matmul",
    fatbin: glm5_kernels::IQ_MATMUL,
    chunk_values: 32,
};

/// `iq_matvec_<format>` / `iq_dequantize_<format>`.
fn stem(kind: &str, w: &IqWeight) -> String {
    format!("iq_{kind}_{}", w.format.name().to_ascii_lowercase())
}

/// `x` `[m, k]` (f32 or bf16, contiguous, on the weight's device) times `Wᵀ`, in `x`'s dtype.
pub(crate) fn iq_matmul(x: &Tensor, w: &IqWeight) -> Result<Tensor> {
    w.check()?;
    let (n, _) = w.dims()?;
    if x.dim(0)? <= MAX_ROWS {
        let blocks = w.blocks.contiguous()?;
        let pointers = [device_address(&blocks)?.0];
        let args = WeightArgs {
            pointers: &pointers,
            scalar: None,
        };
        return weight_only_cuda::matvec(&FILE, &stem("matvec", w), x, n, &args, &[]);
    }
    let dense = dequantize(w, x.dtype())?;
    Ok(x.matmul(&dense.t()?)?)
}

/// The whole weight as `dtype` (f32 or bf16; f16 through f32).
pub(crate) fn dequantize(w: &IqWeight, dtype: DType) -> Result<Tensor> {
    let (n, k) = w.dims()?;
    let kernel_dtype = if dtype == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    let blocks = w.blocks.contiguous()?;
    let pointers = [device_address(&blocks)?.0];
    let args = WeightArgs {
        pointers: &pointers,
        scalar: None,
    };
    let subs = n * k / super::SUB_BLOCK;
    let dense = weight_only_cuda::dequantize(
        &FILE,
        &stem("dequantize", w),
        kernel_dtype,
        &w.blocks,
        (n, k),
        subs,
        &args,
        &[n as i32, k as i32],
    )?;
    Ok(dense.to_dtype(dtype)?)
}
