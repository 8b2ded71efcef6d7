//! The launcher of `kernels/src/rms_norm.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor, D};

use crate::cuda::{cuda_err, device_address, kernel, rows_take_16_byte_vectors};
use crate::error::Result;

pub(super) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let [out] = launch_rows("rms_norm", [x], weight, eps)?;
    Ok(out)
}

/// `x + residual` and its RMSNorm in one launch (`add_rms_norm_*`): `(sum, norm)`.
pub(super) fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let [sum, out] = launch_rows("add_rms_norm", [x, residual], weight, eps)?;
    Ok((sum, out))
}

/// 16-byte vectors a thread of the `*_vectors_*` kernels holds (`HELD_VECTORS` in rms_norm.cu).
const HELD_VECTORS: usize = 4;

/// Kernel `{stem}_{bf16,f32}(inputs..., weight, cols, eps, outputs...)` over rows of `[rows, cols]` (the
/// inputs and `N` outputs of one shape and dtype, `weight` `[cols]`), a block per row: where every row of
/// every pointer takes 16-byte vectors, `{stem}_vectors_*` with a thread per `HELD_VECTORS` of them; else
/// the row's width in threads (whole warps, at most 1024).
fn launch_rows<const N: usize>(
    stem: &str,
    inputs: [&Tensor; N],
    weight: &Tensor,
    eps: f64,
) -> Result<[Tensor; N]> {
    let x = inputs[0];
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let inputs = inputs
        .iter()
        .map(|t| t.contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let weight = weight.contiguous()?;
    let mut made = Vec::with_capacity(N);
    for _ in 0..N {
        // SAFETY: every element is written by the kernel (a block per row, each row's every column).
        made.push(unsafe { Tensor::empty(x.shape(), x.dtype(), x.device())? });
    }
    let outputs: [Tensor; N] = made
        .try_into()
        .map_err(|_| candle_core::Error::Msg("rms_norm: output count".into()))?;
    if rows == 0 || cols == 0 {
        return Ok(outputs);
    }
    let (_, dev) = device_address(&weight)?;
    let mut pointers = Vec::with_capacity(2 * N + 1);
    for t in inputs.iter().chain([&weight]).chain(&outputs) {
        pointers.push(device_address(t)?.0);
    }
    let suffix = if x.dtype() == DType::BF16 {
        "bf16"
    } else {
        "f32"
    };
    let per_vector = 16 / x.dtype().size_in_bytes();
    let vectors = pointers
        .iter()
        .all(|&p| rows_take_16_byte_vectors(cols, x.dtype(), p))
        && cols / per_vector <= HELD_VECTORS * 1024;
    let (name, threads) = if vectors {
        let threads = (cols / per_vector).div_ceil(HELD_VECTORS).div_ceil(32) * 32;
        (format!("{stem}_vectors_{suffix}"), threads.max(32))
    } else {
        (
            format!("{stem}_{suffix}"),
            (cols.div_ceil(32) * 32).clamp(32, 1024),
        )
    };
    let func = kernel(&dev, "rms_norm", glm5_kernels::RMS_NORM, &name)?;
    let stream = dev.cuda_stream();
    let (cols_arg, eps_arg) = (cols as i32, eps as f32);
    let mut builder = stream.launch_builder(&func);
    for p in &pointers[..=N] {
        builder.arg(p);
    }
    builder.arg(&cols_arg).arg(&eps_arg);
    for p in &pointers[N + 1..] {
        builder.arg(p);
    }
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernels' signatures (rms_norm.cu): the inputs and outputs [rows, cols]
    // of one dtype, weight [cols], all contiguous and live until the stream runs the launch; the vector
    // kernels only where every pointer's rows take 16-byte vectors and a block's threads hold the row.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(outputs)
}
