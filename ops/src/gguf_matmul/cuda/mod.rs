//! `gguf_matmul` on CUDA: the mat-vec kernel for up to `MAX_ROWS` rows, dequantise-then-matmul above
//! (kernels in `kernels/src/gguf_matmul.cu`).

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor};
use glm5_kernels::interface::weight_only::{
    q4k_mma_warps, q4k_row_staged_bytes, tile_loop_blocks, DEFAULT_DYNAMIC_SHARED_BYTES,
    Q4K_MMA_ROW_TILE,
};
use glm5_kernels::interface::Q4kRowParams;

use super::{GgufFormat, GgufWeight, MAX_ROWS};
use crate::cuda::{cuda_err, device_address, kernel, launch_dependent, resident_blocks};
use crate::error::{OpError, Result};
use crate::weight_only_cuda::{self, KernelFile, WeightArgs};

const FILE: KernelFile = KernelFile {
    module: "gguf_matmul",
    fatbin: glm5_kernels::GGUF_MATMUL,
    chunk_values: 16,
};

fn stem(kind: &str, w: &GgufWeight) -> String {
    super::kernel_stem(kind, w.format)
}

/// `x` `[m, k]` (f32 or bf16, contiguous, on the weight's device) times `Wᵀ`, in `x`'s dtype.
pub(crate) fn gguf_matmul(x: &Tensor, w: &GgufWeight) -> Result<Tensor> {
    gguf_matmul_with(x, w, true)
}

/// [`gguf_matmul`], the tensor-core kernels only where `tensor_cores`.
pub(crate) fn gguf_matmul_with(x: &Tensor, w: &GgufWeight, tensor_cores: bool) -> Result<Tensor> {
    w.check()?;
    let (n, _) = w.dims()?;
    let blocks = w.blocks.contiguous()?;
    check_alignment(w.format, &blocks)?;
    // Q4_K with bf16 rows: the tensor-core kernels, one row (batch-1 decode) on its own (`q4k_mma::row`: int8
    // MMAs on the row quantised as q8_1, the mma's columns carrying the sub-block scales; sm_90 SASS, ~155 warp
    // instructions per 16 rows of a block against ~630 for the several-row bf16 kernel with one row). A row too long to stage in the default shared
    // memory (k above ~39K, longer than any GLM-5 projection's) takes the FFMA mat-vec.
    if tensor_cores && w.format == GgufFormat::Q4K && x.dtype() == DType::BF16 {
        let (m, k) = x.dims2()?;
        if m == 1 && q4k_row_staged_bytes(k) <= DEFAULT_DYNAMIC_SHARED_BYTES {
            return q4k_mma_matvec1(x, &blocks, n);
        }
        if (2..=MAX_ROWS).contains(&m) {
            return q4k_mma_matvec(x, &blocks, n);
        }
    }
    if x.dim(0)? <= MAX_ROWS {
        let pointers = [device_address(&blocks)?.0];
        let args = WeightArgs {
            pointers: &pointers,
            scalar: None,
        };
        return weight_only_cuda::matvec(&FILE, &stem("matvec", w), x, n, &args, &[]);
    }
    let dense = dequantize(w, x.dtype())?;
    Ok(x.matmul(&dense.t()?)?)
}

/// The whole weight as `dtype` (f32 or bf16; f16 through f32).
pub(crate) fn dequantize(w: &GgufWeight, dtype: DType) -> Result<Tensor> {
    let (n, k) = w.dims()?;
    let kernel_dtype = if dtype == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    let blocks = w.blocks.contiguous()?;
    check_alignment(w.format, &blocks)?;
    let pointers = [device_address(&blocks)?.0];
    let args = WeightArgs {
        pointers: &pointers,
        scalar: None,
    };
    let subs = n * k / super::SUB_BLOCK;
    let dense = weight_only_cuda::dequantize(
        &FILE,
        &stem("dequantize", w),
        kernel_dtype,
        &w.blocks,
        (n, k),
        subs,
        &args,
        &[n as i32, k as i32],
    )?;
    Ok(dense.to_dtype(dtype)?)
}

/// Q4_K times bf16 rows on the tensor cores (`q4k_mma_matvec{8,16}_bf16`): a block of warps per 16 output rows,
/// its warps splitting the row's 256-value blocks, about two blocks a warp (each warp keeps two in flight).
/// `blocks`: the weight's, contiguous and checked aligned (`check_alignment`), `n` rows.
fn q4k_mma_matvec(x: &Tensor, blocks: &Tensor, n: usize) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let x = &weight_only_cuda::vector_aligned(x)?;
    let (w_ptr, dev) = device_address(blocks)?;
    // SAFETY: every element is written by the kernel (each output row by its block's first warp).
    let y = unsafe { Tensor::empty((m, n), x.dtype(), x.device())? };
    let (x_ptr, _) = device_address(x)?;
    let (y_ptr, _) = device_address(&y)?;
    let name = if m <= 8 {
        "q4k_mma_matvec8_bf16"
    } else {
        "q4k_mma_matvec16_bf16"
    };
    let func = kernel(&dev, FILE.module, FILE.fatbin, name)?;
    let warps = q4k_mma_warps(k);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(Q4K_MMA_ROW_TILE) as u32, 1, 1),
        block_dim: ((warps * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (m_arg, n_arg, k_arg) = (m as i32, n as i32, k as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&x_ptr)
        .arg(&w_ptr)
        .arg(&y_ptr)
        .arg(&m_arg)
        .arg(&n_arg)
        .arg(&k_arg);
    // SAFETY: the arguments match the kernel's signature: x [m, k] bf16, the blocks [n, k / 256 · 144] bytes,
    // y [m, n] bf16, m <= 16.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(y)
}

/// Q4_K times one bf16 row on the int8 tensor cores (`q4k_mma_matvec1_bf16`): as `q4k_mma_matvec`, the row quantised (q8_1) into
/// shared memory (`q4k_row_staged_bytes(k)`, within the default limit: the caller checks), launched as a
/// programmatic dependent of the stream's previous kernel (its weight loads start during that kernel's tail),
/// in no more blocks than the device holds at once, each walking its share of the 16-row tiles
/// (`tile_loop_blocks`).
fn q4k_mma_matvec1(x: &Tensor, blocks: &Tensor, n: usize) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let x = &weight_only_cuda::vector_aligned(x)?;
    let (w, dev) = device_address(blocks)?;
    // SAFETY: every element is written by the kernel (each output row by a lane of its block's first warp).
    let y = unsafe { Tensor::empty((1, n), x.dtype(), x.device())? };
    let params = RowParams(Q4kRowParams {
        x: device_address(x)?.0,
        w,
        y: device_address(&y)?.0,
        n: n as i32,
        k: k as i32,
    });
    let name = "q4k_mma_matvec1_bf16";
    let func = kernel(&dev, FILE.module, FILE.fatbin, name)?;
    let threads = q4k_mma_warps(k) as u32 * 32;
    let shared = q4k_row_staged_bytes(k) as u32;
    let resident = resident_blocks(&dev, FILE.module, FILE.fatbin, name, threads, shared)?;
    let cfg = LaunchConfig {
        grid_dim: (
            tile_loop_blocks(n.div_ceil(Q4K_MMA_ROW_TILE), resident) as u32,
            1,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    };
    // SAFETY: the kernel takes one `Q4kRowParams` (layout checked at build time): x [1, k] bf16 (16-byte
    // aligned), the blocks [n, k / 256 · 144] bytes (checked aligned), y [1, n] bf16, all live until the
    // stream runs the launch; the shared memory is the kernel's staged_bytes(k).
    unsafe { launch_dependent(&func, &dev.cuda_stream(), cfg, &params) }?;
    Ok(y)
}

/// The one-row kernel's parameter struct, passed by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct RowParams(Q4kRowParams);
// SAFETY: plain-old-data with the C layout of the kernel's parameter struct (checked at build time).
unsafe impl DeviceRepr for RowParams {}

/// The kernels read Q4_K's and Q5_K's blocks in 16-byte vectors (144 and 176 bytes: every block of a 16-byte
/// aligned row is aligned), Q2_K's in 32-bit words (84 bytes), Q3_K's and Q6_K's in 16-bit ones (110, 210);
/// the i-quants byte by byte. A weight starting elsewhere (a view into other bytes) is a typed error, not a
/// fault.
pub(crate) fn check_alignment(format: GgufFormat, blocks: &Tensor) -> Result<()> {
    let alignment = match format {
        GgufFormat::Q4K | GgufFormat::Q5K => 16,
        GgufFormat::Q2K => 4,
        GgufFormat::Q3K | GgufFormat::Q6K => 2,
        _ => 1,
    };
    let (address, _) = device_address(blocks)?;
    if address % alignment != 0 {
        return Err(OpError::Unsupported(format!(
            "gguf_matmul: {format} blocks at device address {address:#x}, not {alignment}-byte aligned"
        )));
    }
    Ok(())
}
