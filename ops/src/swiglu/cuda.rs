//! The launcher of `kernels/src/swiglu.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{Tensor, D};

use crate::cuda::{cuda_err, device_address, kernel, kernel_name, rows_take_16_byte_vectors};
use crate::error::{OpError, Result};

const THREADS: usize = 256;

pub(super) fn swiglu(gate_up: &Tensor, inter: usize) -> Result<Tensor> {
    let gate_up = gate_up.contiguous()?;
    let mut dims = gate_up.dims().to_vec();
    let last = dims.len() - 1;
    dims[last] = inter;
    let rows = gate_up.elem_count() / gate_up.dim(D::Minus1)?.max(1);
    // SAFETY: the kernel writes every element (a grid-stride loop over all rows · inter values).
    let out = unsafe { Tensor::empty(dims, gate_up.dtype(), gate_up.device())? };
    if rows == 0 || inter == 0 {
        return Ok(out);
    }
    let (rows_arg, inter_arg) = match (i32::try_from(rows), i32::try_from(inter)) {
        (Ok(r), Ok(i)) => (r, i),
        _ => {
            return Err(OpError::Unsupported(format!(
                "swiglu: {rows} rows of {inter} values exceed the kernel's 32-bit sizes"
            )))
        }
    };
    let (in_ptr, dev) = device_address(&gate_up)?;
    let (out_ptr, _) = device_address(&out)?;
    let per_vector = 16 / gate_up.dtype().size_in_bytes();
    // The gate half's rows: `inter` values from the row start, every row 2 · inter apart.
    let vectors = i32::from(rows_take_16_byte_vectors(inter, gate_up.dtype(), in_ptr));
    let func = kernel(
        &dev,
        "swiglu",
        glm5_kernels::SWIGLU,
        &kernel_name("swiglu", gate_up.dtype())?,
    )?;
    let stream = dev.cuda_stream();
    let items = if vectors == 1 {
        rows * inter / per_vector
    } else {
        rows * inter
    };
    let cfg = LaunchConfig {
        grid_dim: (items.div_ceil(THREADS).clamp(1, 65535 * 8) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&in_ptr)
        .arg(&rows_arg)
        .arg(&inter_arg)
        .arg(&vectors)
        .arg(&out_ptr);
    // SAFETY: the arguments match swiglu.cu's kernels: `gate_up` [rows, 2·inter] and `out` [rows, inter] of
    // one dtype, contiguous, live until the stream runs the launch; `vectors` only where its alignment holds.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(out)
}
