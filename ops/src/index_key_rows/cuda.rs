//! The launcher of `index_key_rows_*` in `kernels/src/attention_rows.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::Tensor;

use super::CacheRows;
use crate::cuda::{cuda_err, device_address, kernel, kernel_name};
use crate::error::Result;
use crate::index_keys::IndexKeys;

/// Tokens per block: a warp each.
const TOKENS_PER_BLOCK: usize = 8;

/// The kernel's path of [`super::write_index_key_rows`] (arguments checked there; `T > 0`, `D` even and at
/// most `MAX_CUDA_DIM`).
pub(super) fn write_index_key_rows(
    k: &Tensor,
    (ln_weight, ln_bias): (&Tensor, &Tensor),
    eps: f64,
    (cos, sin): (&Tensor, &Tensor),
    cache: IndexKeys<'_>,
    rows: CacheRows<'_>,
) -> Result<()> {
    let (t, dim) = k.dims2()?;
    let rope = 2 * cos.dim(1)?;
    let k = k.contiguous()?;
    let (ln_weight, ln_bias) = (ln_weight.contiguous()?, ln_bias.contiguous()?);
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let (rows_ptr, first_row, _rows) = rows.kernel_args()?;
    let (float_ptr, bytes_ptr, scales_ptr) = match cache {
        IndexKeys::Float(store) => (device_address(store)?.0, 0u64, 0u64),
        IndexKeys::Fp8 { bytes, scales } => {
            (0u64, device_address(bytes)?.0, device_address(scales)?.0)
        }
    };
    let (k_ptr, dev) = device_address(&k)?;
    let (w_ptr, _) = device_address(&ln_weight)?;
    let (b_ptr, _) = device_address(&ln_bias)?;
    let (cos_ptr, _) = device_address(&cos)?;
    let (sin_ptr, _) = device_address(&sin)?;
    let name = kernel_name("index_key_rows", k.dtype())?;
    let func = kernel(&dev, "attention_rows", glm5_kernels::ATTENTION_ROWS, &name)?;
    let stream = dev.cuda_stream();
    let (eps_arg, t_arg, dim_arg, rope_arg) = (eps as f32, t as i32, dim as i32, rope as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&k_ptr)
        .arg(&w_ptr)
        .arg(&b_ptr)
        .arg(&eps_arg)
        .arg(&cos_ptr)
        .arg(&sin_ptr)
        .arg(&t_arg)
        .arg(&dim_arg)
        .arg(&rope_arg)
        .arg(&float_ptr)
        .arg(&bytes_ptr)
        .arg(&scales_ptr)
        .arg(&rows_ptr)
        .arg(&first_row);
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(TOKENS_PER_BLOCK) as u32, 1, 1),
        block_dim: ((TOKENS_PER_BLOCK * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (attention_rows.cu); k [T, D], the LayerNorm's weight and
    // bias [D], cos/sin [T, R/2] and rows [T] are contiguous live allocations of those sizes; exactly one of
    // the float cache and the FP8 pair is given, and every row the kernel writes is inside it (checked by the
    // caller).
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(())
}
