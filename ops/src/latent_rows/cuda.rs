//! The launcher of `latent_rows_*` in `kernels/src/attention_rows.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::Tensor;

use super::CacheRows;
use crate::cuda::{cuda_err, device_address, kernel, kernel_name};
use crate::error::Result;

/// Threads per token's block: two latent values each at GLM-5's 512.
const THREADS: u32 = 256;

/// The kernel's path of [`super::write_latent_rows`] (arguments checked there; `T > 0`).
pub(super) fn write_latent_rows(
    kv_a: &Tensor,
    norm_weight: &Tensor,
    eps: f64,
    (cos, sin): (&Tensor, &Tensor),
    cache: &Tensor,
    rows: CacheRows<'_>,
) -> Result<()> {
    let (t, width) = kv_a.dims2()?;
    let lora = norm_weight.dim(0)?;
    let (kv_a, norm_weight) = (kv_a.contiguous()?, norm_weight.contiguous()?);
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let (rows_ptr, first_row, _rows) = rows.kernel_args()?;
    let (kv_a_ptr, dev) = device_address(&kv_a)?;
    let (w_ptr, _) = device_address(&norm_weight)?;
    let (cos_ptr, _) = device_address(&cos)?;
    let (sin_ptr, _) = device_address(&sin)?;
    let (cache_ptr, _) = device_address(cache)?;
    let name = kernel_name("latent_rows", kv_a.dtype())?;
    let func = kernel(&dev, "attention_rows", glm5_kernels::ATTENTION_ROWS, &name)?;
    let stream = dev.cuda_stream();
    let (eps_arg, lora_arg, rope_arg) = (eps as f32, lora as i32, (width - lora) as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&kv_a_ptr)
        .arg(&w_ptr)
        .arg(&eps_arg)
        .arg(&cos_ptr)
        .arg(&sin_ptr)
        .arg(&cache_ptr)
        .arg(&rows_ptr)
        .arg(&first_row)
        .arg(&lora_arg)
        .arg(&rope_arg);
    let cfg = LaunchConfig {
        grid_dim: (t as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (attention_rows.cu); kv_a [T, width], the weight
    // [lora], cos/sin [T, rope/2] and rows [T] are contiguous live allocations of those sizes, and every row
    // the kernel writes is inside `cache` [N, width] (checked by the caller).
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(())
}
