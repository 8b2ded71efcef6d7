//! The launcher of `head_products_*` in `kernels/src/attention_rows.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::Tensor;
use glm5_kernels::interface::attention_rows::{HEAD_PRODUCT_COLUMNS, HEAD_PRODUCT_WARPS};

use crate::cuda::{cuda_err, device_address, kernel, kernel_name};
use crate::error::{OpError, Result};

/// The absorbed query's RoPE half, written after the product's columns (`absorbed_query_one_token`): the
/// per-head source rows at `pe` (stride `pe_stride` values), one token's `cos` and `sin` `[1, rope / 2]`.
pub(crate) struct RopeTail<'a> {
    pub pe: &'a Tensor,
    pub pe_offset: usize,
    pub pe_stride: usize,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub rope: usize,
}

/// `out[h, ..n] = x[h, ..k] · w[h]` for rows of `x` at `x_stride` values and of `out` at `out_stride` (both
/// contiguous tensors; `w` `[H, k, n]`), and with `tail` its RoPE half at `out[h, n..]`. `n` a multiple of 8.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    x: &Tensor,
    x_stride: usize,
    w: &Tensor,
    (heads, k, n): (usize, usize, usize),
    out: &Tensor,
    out_stride: usize,
    tail: Option<RopeTail<'_>>,
) -> Result<()> {
    let w = w.contiguous()?;
    let (x_ptr, dev) = device_address(x)?;
    let (w_ptr, _) = device_address(&w)?;
    let (out_ptr, _) = device_address(out)?;
    if !w_ptr.is_multiple_of(16) {
        return Err(OpError::Shape {
            arg: "w",
            expected: "a 16-byte aligned start".into(),
            found: w.dims().to_vec(),
        });
    }
    // The tables made contiguous live until the launch is queued.
    let tables = match &tail {
        Some(t) => Some((t.cos.contiguous()?, t.sin.contiguous()?)),
        None => None,
    };
    let (pe_ptr, cos_ptr, sin_ptr, pe_stride, rope) = match (&tail, &tables) {
        (Some(t), Some((cos, sin))) => {
            let (pe, _) = device_address(t.pe)?;
            let elem = t.pe.dtype().size_in_bytes() as u64;
            (
                pe + t.pe_offset as u64 * elem,
                device_address(cos)?.0,
                device_address(sin)?.0,
                t.pe_stride,
                t.rope,
            )
        }
        _ => (0, 0, 0, 0, 0),
    };
    let name = kernel_name("head_products", x.dtype())?;
    let func = kernel(&dev, "attention_rows", glm5_kernels::ATTENTION_ROWS, &name)?;
    let stream = dev.cuda_stream();
    let args = [x_stride, k, n, out_stride, pe_stride, rope].map(|v| v as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&x_ptr)
        .arg(&args[0])
        .arg(&w_ptr)
        .arg(&args[1])
        .arg(&args[2])
        .arg(&out_ptr)
        .arg(&args[3])
        .arg(&pe_ptr)
        .arg(&args[4])
        .arg(&cos_ptr)
        .arg(&sin_ptr)
        .arg(&args[5]);
    let column_blocks = n.div_ceil(HEAD_PRODUCT_COLUMNS) + usize::from(rope > 0);
    let cfg = LaunchConfig {
        grid_dim: (column_blocks as u32, heads as u32, 1),
        block_dim: ((HEAD_PRODUCT_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (attention_rows.cu); x holds `heads` rows of `k`
    // values at `x_stride`, w [heads, k, n] is contiguous and 16-byte aligned, out holds `heads` rows of
    // `n` (+ rope) values at `out_stride`, and with a tail pe holds `heads` rows of `rope` values at
    // `pe_stride` and cos/sin `rope / 2` each; all live allocations.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(())
}

/// The kernel's path of [`super::head_products`] (arguments checked there).
pub(super) fn head_products(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (heads, k) = x.dims2()?;
    let n = w.dim(2)?;
    let x = x.contiguous()?;
    // SAFETY: every element is written by the kernel before anything reads `out`.
    let out = unsafe { Tensor::empty((heads, n), x.dtype(), x.device())? };
    launch(&x, k, w, (heads, k, n), &out, n, None)?;
    Ok(out)
}
