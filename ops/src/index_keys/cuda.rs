//! The FP8 key quantiser on the GPU (`dsa_quantize_fp8_*` of the indexer's module): float keys to e4m3 bytes
//! with one f32 scale per key.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor};

use crate::cuda::{cuda_err, device_address, kernel};
use crate::error::Result;

/// FP8 quantisation of `[n, dim]` float keys on the GPU (contract in `index_keys`).
pub(crate) fn quantize_fp8(keys: &Tensor, n: usize, dim: usize) -> Result<(Tensor, Tensor)> {
    let device = keys.device();
    let keys = match keys.dtype() {
        DType::BF16 | DType::F32 => keys.contiguous()?,
        _ => keys.to_dtype(DType::F32)?.contiguous()?,
    };
    let bytes = Tensor::zeros((n, dim), DType::U8, device)?;
    let scales = Tensor::zeros(n, DType::F32, device)?;
    let (rows, dev) = device_address(&keys)?;
    let (bytes_ptr, _) = device_address(&bytes)?;
    let (scales_ptr, _) = device_address(&scales)?;
    let name = if keys.dtype() == DType::BF16 {
        "dsa_quantize_fp8_bf16"
    } else {
        "dsa_quantize_fp8_f32"
    };
    let func = kernel(&dev, "dsa_indexer", glm5_kernels::DSA_INDEXER, name)?;
    let stream = dev.cuda_stream();
    let rows_per_block = 8usize;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(rows_per_block).max(1) as u32, 1, 1),
        block_dim: ((rows_per_block * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n_arg, dim_arg) = (n as i32, dim as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&rows)
        .arg(&bytes_ptr)
        .arg(&scales_ptr)
        .arg(&n_arg)
        .arg(&dim_arg);
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok((bytes, scales))
}
