//! The backend `nvfp4-w4a4-mma-sm120`: the activations quantised to NVFP4 by `nvfp4_quantize_rows_*`, then
//! the GEMM `nvfp4_mma_*` on sm_120a's block-scaled FP4 MMA (`kernels/src/nvfp4_mma_sm120a.cu`; the rule
//! in the module contract). Its kernels are sm_120a SASS only: on any other device this is an error naming
//! the device's architecture, never a fall back.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Tensor};
use glm5_kernels::interface::{nvfp4_mma, Nvfp4MmaParams, Nvfp4QuantizeParams};

use super::super::{Nvfp4Activations, Nvfp4Weight, W4A4_MMA_SM120};
use crate::cuda::{cuda_err, device_address, device_info, kernel, kernel_name};
use crate::error::{OpError, Result};

const MODULE: (&str, &[u8]) = ("nvfp4_mma_sm120a", glm5_kernels::NVFP4_MMA_SM120A);

/// Most grid rows of a launch (CUDA's limit on `gridDim.y`).
const MAX_GRID_Y: usize = 65535;

/// The kernels' parameter structs (`glm5_kernels::interface`, layouts checked against the CUDA side's at
/// build time), passed by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct QuantizeParams(Nvfp4QuantizeParams);
// SAFETY: plain-old-data with the C layout of the kernel's parameter struct (checked at build time).
unsafe impl DeviceRepr for QuantizeParams {}

#[repr(transparent)]
#[derive(Clone, Copy)]
struct MmaParams(Nvfp4MmaParams);
// SAFETY: as `QuantizeParams`.
unsafe impl DeviceRepr for MmaParams {}

/// An error unless `dev` is compute capability 12.0, the only one the sm_120a SASS runs on.
fn check_device(dev: &CudaDevice) -> Result<()> {
    let capability = device_info(dev)?.capability;
    if (capability.major, capability.minor) == (12, 0) {
        Ok(())
    } else {
        Err(OpError::Unsupported(format!(
            "nvfp4_matmul: the backend {W4A4_MMA_SM120} runs on sm_120 (compute capability 12.0) only, its \
             kernels being sm_120a SASS; this device is {capability}"
        )))
    }
}

fn to_i32(value: usize, what: &'static str) -> Result<i32> {
    i32::try_from(value).map_err(|_| OpError::Shape {
        arg: what,
        expected: "every dimension below 2^31".into(),
        found: vec![value],
    })
}

/// `x` `[m, k]` (f32 or bf16, contiguous, CUDA, `k` a multiple of 16) quantised by the W4A4 rule.
pub(super) fn quantize_activations(x: &Tensor) -> Result<Nvfp4Activations> {
    let (m, k) = x.dims2()?;
    if !k.is_multiple_of(nvfp4_mma::GROUP) {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[rows, in] with in a multiple of {}", nvfp4_mma::GROUP),
            found: x.dims().to_vec(),
        });
    }
    let name = kernel_name("nvfp4_quantize_rows", x.dtype())?;
    let (m_arg, k_arg) = (to_i32(m, "x rows")?, to_i32(k, "x columns")?);
    let codes = Tensor::zeros((m, k / 2), DType::U8, x.device())?;
    let scales = Tensor::zeros((m, k / nvfp4_mma::GROUP), DType::U8, x.device())?;
    let row_scales = Tensor::zeros(m, DType::F32, x.device())?;
    if m == 0 {
        return Ok(Nvfp4Activations {
            codes,
            scales,
            row_scales,
        });
    }
    // The kernel reads a group of 16 values as 16-byte vectors.
    let x = &if device_address(x)?.0 % 16 == 0 {
        x.clone()
    } else {
        x.copy()?
    };
    let (x_ptr, dev) = device_address(x)?;
    check_device(&dev)?;
    let params = QuantizeParams(Nvfp4QuantizeParams {
        x: x_ptr,
        codes: device_address(&codes)?.0,
        scales: device_address(&scales)?.0,
        row_scales: device_address(&row_scales)?.0,
        m: m_arg,
        k: k_arg,
    });
    let func = kernel(&dev, MODULE.0, MODULE.1, &name)?;
    let cfg = LaunchConfig {
        grid_dim: (m as u32, 1, 1),
        block_dim: (nvfp4_mma::QUANTIZE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&params);
    // SAFETY: the struct matches the kernel's parameter; x is [m, k] of the kernel's dtype, 16-byte aligned;
    // codes [m, k/2], scales [m, k/16] and row_scales [m] are fresh allocations of those sizes.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(Nvfp4Activations {
        codes,
        scales,
        row_scales,
    })
}

/// W4A4 `x · Wᵀ` for `x` `[m, k]` (f32 or bf16, contiguous, on the weight's device), in `x`'s dtype.
pub(super) fn matmul(x: &Tensor, w: &Nvfp4Weight) -> Result<Tensor> {
    let (n, k) = w.dims()?;
    let (m, _) = x.dims2()?;
    if !k.is_multiple_of(nvfp4_mma::TILE_K) {
        return Err(OpError::Shape {
            arg: "weight",
            expected: format!(
                "[out, in] with in a multiple of {} for {W4A4_MMA_SM120}",
                nvfp4_mma::TILE_K
            ),
            found: vec![n, k],
        });
    }
    if m.div_ceil(nvfp4_mma::TILE_M) > MAX_GRID_Y {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!(
                "at most {} rows for {W4A4_MMA_SM120}",
                MAX_GRID_Y * nvfp4_mma::TILE_M
            ),
            found: x.dims().to_vec(),
        });
    }
    let name = kernel_name("nvfp4_mma", x.dtype())?;
    let (m_arg, n_arg, k_arg) = (
        to_i32(m, "x rows")?,
        to_i32(n, "weight rows")?,
        to_i32(k, "x columns")?,
    );
    let acts = quantize_activations(x)?;
    // The GEMM copies the weight's rows in 16-byte (codes) and 8-byte (scales) pieces: a view starting
    // mid-piece is copied to a fresh allocation.
    let aligned = |t: &Tensor, bytes: u64| -> Result<Tensor> {
        let t = t.contiguous()?;
        Ok(if device_address(&t)?.0 % bytes == 0 {
            t
        } else {
            t.copy()?
        })
    };
    let packed = aligned(&w.packed, 16)?;
    let scales = aligned(&w.scales, 8)?;
    let (packed_ptr, dev) = device_address(&packed)?;
    check_device(&dev)?;
    // Every element of y is written by the kernel (each in-range (row, column) once).
    // SAFETY: `y` is only read after the kernel has written all of it.
    let y = unsafe { Tensor::empty((m, n), x.dtype(), x.device())? };
    let params = MmaParams(Nvfp4MmaParams {
        a_codes: device_address(&acts.codes)?.0,
        a_scales: device_address(&acts.scales)?.0,
        a_row_scales: device_address(&acts.row_scales)?.0,
        b_packed: packed_ptr,
        b_scales: device_address(&scales)?.0,
        y: device_address(&y)?.0,
        m: m_arg,
        n: n_arg,
        k: k_arg,
        b_global_scale: w.global_scale,
    });
    let func = kernel(&dev, MODULE.0, MODULE.1, &name)?;
    let cfg = LaunchConfig {
        grid_dim: (
            n.div_ceil(nvfp4_mma::TILE_N) as u32,
            m.div_ceil(nvfp4_mma::TILE_M) as u32,
            1,
        ),
        block_dim: (nvfp4_mma::THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&params);
    // SAFETY: the struct matches the kernel's parameter; the activations' codes [m, k/2], scales [m, k/16]
    // and row scales [m], the weight's packed [n, k/2] and scales [n, k/16] (checked by `w.check()` in the
    // caller) and y [m, n] in x's dtype are live allocations of those sizes; k is a multiple of TILE_K.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(y)
}
