//! The launcher of `kernels/src/argmax.cu`.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor, D};

use crate::cuda::{cuda_err, device_address, kernel, kernel_name, rows_take_16_byte_vectors};
use crate::error::{OpError, Result};

/// Threads of a block that takes a row whole (rows of one span).
const THREADS: u32 = 1024;
/// Threads of a span's block, and 16-byte vectors each of its threads loads: a span is one pass of them.
const SPAN_THREADS: usize = 256;
const SPAN_VECTORS: usize = 4;

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
    let stream = dev.cuda_stream();
    // A row's spans: one pass of a span block's threads each (in 16-byte vectors' worth of values).
    let span = SPAN_THREADS * SPAN_VECTORS * 16 / x.dtype().size_in_bytes();
    let spans = n.div_ceil(span);
    // (A row of more spans than a grid's second dimension takes, past 268M values, is taken whole too.)
    if spans == 1 || spans > u16::MAX as usize {
        let func = kernel(
            &dev,
            "argmax",
            glm5_kernels::ARGMAX,
            &kernel_name("argmax", x.dtype())?,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = stream.launch_builder(&func);
        builder.arg(&x_ptr).arg(&cols).arg(&vectors).arg(&out_ptr);
        // SAFETY: the arguments match argmax.cu's kernels: `x` [rows, n] contiguous, `out` [rows] u32, both
        // live until the stream runs the launch; `vectors` only where its alignment holds.
        unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
        return Ok(out);
    }
    // SAFETY: `argmax_span_*` writes every [row, span] slot of both.
    let best = unsafe { Tensor::empty((rows, spans), DType::F32, x.device())? };
    let at = unsafe { Tensor::empty((rows, spans), DType::U32, x.device())? };
    let (best_ptr, _) = device_address(&best)?;
    let (at_ptr, _) = device_address(&at)?;
    let (span_arg, spans_arg) = (span as i32, spans as i32);
    let span_fn = kernel(
        &dev,
        "argmax",
        glm5_kernels::ARGMAX,
        &kernel_name("argmax_span", x.dtype())?,
    )?;
    let mut builder = stream.launch_builder(&span_fn);
    builder
        .arg(&x_ptr)
        .arg(&cols)
        .arg(&vectors)
        .arg(&span_arg)
        .arg(&best_ptr)
        .arg(&at_ptr);
    let cfg = LaunchConfig {
        grid_dim: (grid, spans as u32, 1),
        block_dim: (SPAN_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `argmax_span_*`: `x` [rows, n] contiguous, `best` / `at` [rows, spans],
    // all live until the stream runs the launch; spans are multiples of the vector (`span` is), so `vectors`
    // holds for each.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    let spans_fn = kernel(&dev, "argmax", glm5_kernels::ARGMAX, "argmax_spans")?;
    let mut builder = stream.launch_builder(&spans_fn);
    builder
        .arg(&best_ptr)
        .arg(&at_ptr)
        .arg(&spans_arg)
        .arg(&out_ptr);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `best` / `at` [rows, spans] as written above, `out` [rows] u32.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(out)
}
