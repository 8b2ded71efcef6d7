//! The launcher of `kernels/src/rms_norm.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor, D};

use crate::cuda::{cuda_err, device_address, kernel};
use crate::error::Result;

pub(super) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let x = x.contiguous()?;
    let weight = weight.contiguous()?;
    let out = unsafe { Tensor::empty(x.shape(), x.dtype(), x.device())? };
    if rows == 0 || cols == 0 {
        return Ok(out);
    }
    let (x_ptr, dev) = device_address(&x)?;
    let (w_ptr, _) = device_address(&weight)?;
    let (out_ptr, _) = device_address(&out)?;
    let name = if x.dtype() == DType::BF16 {
        "rms_norm_bf16"
    } else {
        "rms_norm_f32"
    };
    let func = kernel(&dev, "rms_norm", glm5_kernels::RMS_NORM, name)?;
    let stream = dev.cuda_stream();
    let (cols_arg, eps_arg) = (cols as i32, eps as f32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&x_ptr)
        .arg(&w_ptr)
        .arg(&cols_arg)
        .arg(&eps_arg)
        .arg(&out_ptr);
    // SAFETY: the arguments match the kernel's signature; x and out [rows, cols], weight [cols], one dtype.
    unsafe { builder.launch(row_blocks(rows, cols)) }.map_err(cuda_err)?;
    Ok(out)
}

/// `x + residual` and its RMSNorm in one launch (`add_rms_norm_*`), as `rms_norm`'s geometry.
pub(super) fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let (x, residual, weight) = (
        x.contiguous()?,
        residual.contiguous()?,
        weight.contiguous()?,
    );
    // SAFETY (both): every element is written by the kernel.
    let sum = unsafe { Tensor::empty(x.shape(), x.dtype(), x.device())? };
    let out = unsafe { Tensor::empty(x.shape(), x.dtype(), x.device())? };
    if rows == 0 || cols == 0 {
        return Ok((sum, out));
    }
    let (x_ptr, dev) = device_address(&x)?;
    let (r_ptr, _) = device_address(&residual)?;
    let (w_ptr, _) = device_address(&weight)?;
    let (sum_ptr, _) = device_address(&sum)?;
    let (out_ptr, _) = device_address(&out)?;
    let name = if x.dtype() == DType::BF16 {
        "add_rms_norm_bf16"
    } else {
        "add_rms_norm_f32"
    };
    let func = kernel(&dev, "rms_norm", glm5_kernels::RMS_NORM, name)?;
    let stream = dev.cuda_stream();
    let (cols_arg, eps_arg) = (cols as i32, eps as f32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&x_ptr)
        .arg(&r_ptr)
        .arg(&w_ptr)
        .arg(&cols_arg)
        .arg(&eps_arg)
        .arg(&sum_ptr)
        .arg(&out_ptr);
    // SAFETY: the arguments match the kernel's signature; x, residual, sum and out are [rows, cols] of one
    // dtype, weight [cols], all contiguous and live until the stream runs the launch.
    unsafe { builder.launch(row_blocks(rows, cols)) }.map_err(cuda_err)?;
    Ok((sum, out))
}

/// A block per row, the row's width in threads (whole warps, at most 1024).
fn row_blocks(rows: usize, cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: ((cols.div_ceil(32) * 32).clamp(32, 1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
