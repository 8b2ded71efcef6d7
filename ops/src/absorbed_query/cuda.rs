//! The launcher of `absorbed_query_*` in `kernels/src/attention_rows.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::Tensor;

use crate::cuda::{cuda_err, device_address, kernel, kernel_name};
use crate::error::Result;
use crate::head_products::cuda::{launch, RopeTail};

/// Threads per (token, head) block: four latent values each at GLM-5's 512.
const THREADS: u32 = 128;

/// The kernel's path of [`super::absorbed_query`] (arguments checked there; `T > 0`).
pub(super) fn absorbed_query(
    q: &Tensor,
    q_latent: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (t, heads, width) = q.dims3()?;
    let lora = q_latent.dim(2)?;
    let rope = 2 * cos.dim(1)?;
    let (q, q_latent) = (q.contiguous()?, q_latent.contiguous()?);
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    // SAFETY: every element is written by the kernel before anything reads `out`.
    let out = unsafe { Tensor::empty((t, heads, lora + rope), q.dtype(), q.device())? };
    let (q_ptr, dev) = device_address(&q)?;
    let (latent_ptr, _) = device_address(&q_latent)?;
    let (cos_ptr, _) = device_address(&cos)?;
    let (sin_ptr, _) = device_address(&sin)?;
    let (out_ptr, _) = device_address(&out)?;
    let name = kernel_name("absorbed_query", q.dtype())?;
    let func = kernel(&dev, "attention_rows", glm5_kernels::ATTENTION_ROWS, &name)?;
    let stream = dev.cuda_stream();
    let (t_arg, heads_arg) = (t as i32, heads as i32);
    let (nope_arg, rope_arg, lora_arg) = ((width - rope) as i32, rope as i32, lora as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&q_ptr)
        .arg(&latent_ptr)
        .arg(&cos_ptr)
        .arg(&sin_ptr)
        .arg(&t_arg)
        .arg(&heads_arg)
        .arg(&nope_arg)
        .arg(&rope_arg)
        .arg(&lora_arg)
        .arg(&out_ptr);
    let cfg = LaunchConfig {
        grid_dim: (t as u32, heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (attention_rows.cu); q [T, H, nope + R], q_latent
    // [H, T, lora], cos/sin [T, R/2] and out [T, H, lora + R] are contiguous live allocations of those sizes.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(out)
}

/// The kernel's path of [`super::absorbed_query_one_token`] (arguments checked there): `head_products`' kernel
/// writes each head's `lora` product values and, from one more block a head, its RoPE half.
pub(super) fn absorbed_query_one_token(
    q: &Tensor,
    w_uk: &Tensor,
    (nope, rope, lora): (usize, usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let heads = q.dim(1)?;
    let q = q.contiguous()?;
    // SAFETY: every element is written by the kernel (the product's columns and the RoPE half) before
    // anything reads `out`.
    let out = unsafe { Tensor::empty((1, heads, lora + rope), q.dtype(), q.device())? };
    let tail = RopeTail {
        pe: &q,
        pe_offset: nope,
        pe_stride: nope + rope,
        cos,
        sin,
        rope,
    };
    launch(
        &q,
        nope + rope,
        w_uk,
        (heads, nope, lora),
        &out,
        lora + rope,
        Some(tail),
    )?;
    Ok(out)
}
