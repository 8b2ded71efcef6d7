//! The launcher of `rope_leading_*` in `kernels/src/attention_rows.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::Tensor;

use crate::cuda::{cuda_err, device_address, kernel, kernel_name};
use crate::error::Result;

/// Threads per (token, head) block: one per RoPE pair at GLM-5's indexer (64 rotated of 128).
const THREADS: u32 = 32;

/// The kernel's path of [`super::rope_leading`] (arguments checked there; `T > 0`).
pub(super) fn rope_leading(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, heads, dim) = x.dims3()?;
    let rope = 2 * cos.dim(1)?;
    let x = x.contiguous()?;
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    // SAFETY: every element is written by the kernel before anything reads `out`.
    let out = unsafe { Tensor::empty((t, heads, dim), x.dtype(), x.device())? };
    let (x_ptr, dev) = device_address(&x)?;
    let (cos_ptr, _) = device_address(&cos)?;
    let (sin_ptr, _) = device_address(&sin)?;
    let (out_ptr, _) = device_address(&out)?;
    let name = kernel_name("rope_leading", x.dtype())?;
    let func = kernel(&dev, "attention_rows", glm5_kernels::ATTENTION_ROWS, &name)?;
    let stream = dev.cuda_stream();
    let (heads_arg, dim_arg, rope_arg) = (heads as i32, dim as i32, rope as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&x_ptr)
        .arg(&cos_ptr)
        .arg(&sin_ptr)
        .arg(&heads_arg)
        .arg(&dim_arg)
        .arg(&rope_arg)
        .arg(&out_ptr);
    let cfg = LaunchConfig {
        grid_dim: (t as u32, heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (attention_rows.cu); x and out [T, H, D] and cos/sin
    // [T, R/2] are contiguous live allocations of those sizes.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(out)
}
