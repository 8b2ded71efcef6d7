//! The launcher of `attention_rows_*` in `kernels/src/attention_rows.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::Tensor;

use super::{IndexKeyStep, LatentRowsStep};
use crate::cache_rows::CacheRows;
use crate::cuda::{cuda_err, device_address, kernel, kernel_name};
use crate::error::Result;
use crate::index_keys::IndexKeys;

/// Warps a block: the latent row's block (two values a thread at GLM-5's 512), and the query heads a block
/// rotates (a warp each).
const WARPS: usize = 8;

/// The kernel's path of [`super::write_attention_rows`] (arguments checked there; `T > 0`, the key width even
/// and at most `MAX_CUDA_DIM`).
pub(super) fn write_attention_rows(
    latent: LatentRowsStep<'_>,
    key: IndexKeyStep<'_>,
    index_q: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    rows: CacheRows<'_>,
) -> Result<Tensor> {
    let (t, heads, q_dim) = index_q.dims3()?;
    let lora = latent.norm_weight.dim(0)?;
    let key_dim = key.k.dim(1)?;
    let rope = 2 * cos.dim(1)?;
    let contiguous = |x: &Tensor| x.contiguous();
    let (kv_a, norm_weight) = (contiguous(latent.kv_a)?, contiguous(latent.norm_weight)?);
    let (k, ln_weight, ln_bias) = (
        contiguous(key.k)?,
        contiguous(key.layer_norm.0)?,
        contiguous(key.layer_norm.1)?,
    );
    let (q, cos, sin) = (contiguous(index_q)?, contiguous(cos)?, contiguous(sin)?);
    // SAFETY: every element is written by the kernel before anything reads `q_out`.
    let q_out = unsafe { Tensor::empty((t, heads, q_dim), q.dtype(), q.device())? };
    let (rows_ptr, first_row, _rows) = rows.kernel_args()?;
    let (float_keys, fp8_bytes, fp8_scales) = match key.cache {
        IndexKeys::Float(store) => (device_address(store)?.0, 0u64, 0u64),
        IndexKeys::Fp8 { bytes, scales } => {
            (0u64, device_address(bytes)?.0, device_address(scales)?.0)
        }
    };
    let (kv_a_ptr, dev) = device_address(&kv_a)?;
    let (norm_ptr, _) = device_address(&norm_weight)?;
    let (latent_ptr, _) = device_address(latent.cache)?;
    let (k_ptr, _) = device_address(&k)?;
    let (ln_w_ptr, _) = device_address(&ln_weight)?;
    let (ln_b_ptr, _) = device_address(&ln_bias)?;
    let (q_ptr, _) = device_address(&q)?;
    let (q_out_ptr, _) = device_address(&q_out)?;
    let (cos_ptr, _) = device_address(&cos)?;
    let (sin_ptr, _) = device_address(&sin)?;
    let name = kernel_name("attention_rows", q.dtype())?;
    let func = kernel(&dev, "attention_rows", glm5_kernels::ATTENTION_ROWS, &name)?;
    let stream = dev.cuda_stream();
    let (norm_eps, ln_eps) = (latent.eps as f32, key.eps as f32);
    let (lora_arg, key_dim_arg, heads_arg, q_dim_arg, rope_arg) = (
        lora as i32,
        key_dim as i32,
        heads as i32,
        q_dim as i32,
        rope as i32,
    );
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&kv_a_ptr)
        .arg(&norm_ptr)
        .arg(&norm_eps)
        .arg(&latent_ptr)
        .arg(&lora_arg)
        .arg(&k_ptr)
        .arg(&ln_w_ptr)
        .arg(&ln_b_ptr)
        .arg(&ln_eps)
        .arg(&float_keys)
        .arg(&fp8_bytes)
        .arg(&fp8_scales)
        .arg(&key_dim_arg)
        .arg(&q_ptr)
        .arg(&heads_arg)
        .arg(&q_dim_arg)
        .arg(&q_out_ptr)
        .arg(&cos_ptr)
        .arg(&sin_ptr)
        .arg(&rope_arg)
        .arg(&rows_ptr)
        .arg(&first_row);
    let cfg = LaunchConfig {
        grid_dim: (t as u32, (2 + heads.div_ceil(WARPS)) as u32, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (attention_rows.cu); kv_a [T, lora + R], the norm
    // weight [lora], k [T, D], the LayerNorm's weight and bias [D], q and q_out [T, H, Dq], cos/sin [T, R/2]
    // and rows [T] are contiguous live allocations of those sizes (the copies made here live to the end of
    // this function, after the launch is queued); exactly one of the float key cache and the FP8 pair is
    // given, and every row the kernel writes is inside the latent and key caches (checked by the caller).
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(q_out)
}
