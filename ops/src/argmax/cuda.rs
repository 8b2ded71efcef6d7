//! The launcher of `kernels/src/argmax.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor, D};

use crate::cuda::{cuda_err, device_address, kernel, kernel_name, rows_take_16_byte_vectors};
use crate::error::{OpError, Result};

const THREADS: u32 = 1024;

pub(super) fn argmax(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let n = x.dim(D::Minus1)?;
    let leading = x.dims()[..x.rank() - 1].to_vec();
    let rows = x.elem_count() / n;
    // SAFETY: the kernel writes one index per row, a block per row.
    let out = unsafe { Tensor::empty(leading, DType::U32, x.device())? };
    if rows == 0 {
        return Ok(out);
    }
    let (cols, grid) = match (i32::try_from(n), u32::try_from(rows)) {
        (Ok(cols), Ok(grid)) if grid <= i32::MAX as u32 => (cols, grid),
        _ => {
            return Err(OpError::Unsupported(format!(
                "argmax: {rows} rows of {n} values exceed the kernel's 32-bit sizes"
            )))
        }
    };
    let (x_ptr, dev) = device_address(&x)?;
    let (out_ptr, _) = device_address(&out)?;
    let vectors = i32::from(rows_take_16_byte_vectors(n, x.dtype(), x_ptr));
    let func = kernel(
        &dev,
        "argmax",
        glm5_kernels::ARGMAX,
        &kernel_name("argmax", x.dtype())?,
    )?;
    let stream = dev.cuda_stream();
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut builder = stream.launch_builder(&func);
    builder.arg(&x_ptr).arg(&cols).arg(&vectors).arg(&out_ptr);
    // SAFETY: the arguments match argmax.cu's kernels: `x` [rows, n] contiguous, `out` [rows] u32, both live
    // until the stream runs the launch; `vectors` only where its alignment holds.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(out)
}
