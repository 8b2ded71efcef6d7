//! The launchers of the weight-only mat-vec and dequantise kernels, shared by `fp8_matmul` and `nvfp4_matmul`
//! (`weight_only_matmul.cu`) and `gguf_matmul` (`gguf_matmul.cu`) on CUDA.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor};
use glm5_kernels::interface::weight_only::{column_warps, DEQUANTIZE_THREADS, MAX_ROWS, WARPS};

use crate::cuda::{cuda_err, device_address, kernel, kernel_name};
use crate::error::Result;

/// A kernel file: its module name and fatbin, and the weights a mat-vec thread takes at a time (a chunk).
pub(crate) struct KernelFile {
    pub module: &'static str,
    pub fatbin: &'static [u8],
    pub chunk_values: usize,
}

/// `weight_only_matmul.cu`.
pub(crate) const WEIGHT_ONLY: KernelFile = KernelFile {
    module: "weight_only_matmul",
    fatbin: glm5_kernels::WEIGHT_ONLY_MATMUL,
    chunk_values: 16,
};

/// The weight's kernel arguments: its device pointers, then an optional f32 (NVFP4's global scale).
pub(crate) struct WeightArgs<'a> {
    pub pointers: &'a [u64],
    pub scalar: Option<&'a f32>,
}

/// Runs the mat-vec kernel `stem` of `file` for `x` `[m, k]` (`m <= MAX_ROWS`) into a new `[m, n]` tensor:
/// `(x, weight..., y, m, n, k, tail..., column_warps)`.
pub(crate) fn matvec(
    file: &KernelFile,
    stem: &str,
    x: &Tensor,
    n: usize,
    weight: &WeightArgs,
    tail: &[i32],
) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    debug_assert!(m <= MAX_ROWS);
    let x = &vector_aligned(x)?;
    // Every output is written by the kernel (one group of warps per column, all m rows): no fill, which would
    // cost two more launches per projection on the decode path.
    // SAFETY: `y` is only read after the kernel has written all of it.
    let y = unsafe { Tensor::empty((m, n), x.dtype(), x.device())? };
    let (x_ptr, dev) = device_address(x)?;
    let (y_ptr, _) = device_address(&y)?;
    // One row (batch-1 decode): the kernel built for one row (`*_matvec_r1_*`), without the other row
    // slots' tests, which cost more than that row's arithmetic.
    let stem = if m == 1 {
        stem.replacen("matvec", "matvec_r1", 1)
    } else {
        stem.to_string()
    };
    let func = kernel(
        &dev,
        file.module,
        file.fatbin,
        &kernel_name(&stem, x.dtype())?,
    )?;
    let stream = dev.cuda_stream();
    let column_warps = column_warps(k / file.chunk_values);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(WARPS / column_warps) as u32, 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (m_arg, n_arg, k_arg, warps_arg) = (m as i32, n as i32, k as i32, column_warps as i32);
    let mut builder = stream.launch_builder(&func);
    builder.arg(&x_ptr);
    push_weight(&mut builder, weight);
    builder.arg(&y_ptr).arg(&m_arg).arg(&n_arg).arg(&k_arg);
    for value in tail {
        builder.arg(value);
    }
    builder.arg(&warps_arg);
    // SAFETY: the arguments match the kernel's signature; every pointer is a live device allocation of the
    // size the kernel reads or writes (checked by the callers: x [m, k], the weight's parts, y [m, n]).
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(y)
}

/// `x` where its device address is 16-byte aligned, else a copy in a fresh allocation: the mat-vecs read
/// activations in 16-byte vectors, and a view may start mid-vector.
pub(crate) fn vector_aligned(x: &Tensor) -> Result<Tensor> {
    Ok(if device_address(x)?.0 % 16 == 0 {
        x.clone()
    } else {
        x.copy()?
    })
}

fn push_weight<'a>(
    builder: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
    weight: &WeightArgs<'a>,
) {
    for pointer in weight.pointers {
        builder.arg(pointer);
    }
    if let Some(scalar) = weight.scalar {
        builder.arg(scalar);
    }
}

/// Runs the dequantise kernel `stem` of `file` into a new `[n, k]` tensor of `dtype`, one thread per work
/// item (`items`: values or sub-blocks, as the kernel takes them): `(weight..., out, tail...)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dequantize(
    file: &KernelFile,
    stem: &str,
    dtype: DType,
    like: &Tensor,
    (n, k): (usize, usize),
    items: usize,
    weight: &WeightArgs,
    tail: &[i32],
) -> Result<Tensor> {
    // SAFETY: every element is written: each dequantise kernel strides its grid over all n · k values (or
    // their sub-blocks), whatever the block count. (Filling it first took two more launches and four times
    // the bytes the kernel writes: a prefill dequantises every active expert this way.)
    let out = unsafe { Tensor::empty((n, k), dtype, like.device())? };
    let (out_ptr, dev) = device_address(&out)?;
    let func = kernel(&dev, file.module, file.fatbin, &kernel_name(stem, dtype)?)?;
    let stream = dev.cuda_stream();
    let blocks = items.div_ceil(DEQUANTIZE_THREADS).clamp(1, 65535 * 8);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (DEQUANTIZE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut builder = stream.launch_builder(&func);
    push_weight(&mut builder, weight);
    builder.arg(&out_ptr);
    for value in tail {
        builder.arg(value);
    }
    // SAFETY: as in `matvec`: the arguments match the kernel, `out` is [n, k] of `dtype`.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(out)
}
