//! The backend `fp8-w8a8-cublaslt-block`: the activations quantised per token and 128 values by
//! `fp8_quantize_rows_*` (`kernels/src/fp8_quantize.cu`), then cuBLASLt's block-scaled FP8 GEMM
//! (`cublaslt.rs`: the call and the layouts' sources). On a device other than compute capability 9.0, or
//! with a cuBLASLt older than 12.9, this is an error naming what is missing, never a fall back.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Tensor};
use glm5_kernels::interface::{fp8_quantize, Fp8QuantizeParams};

use super::super::entries::{version_text, w8a8_shape_reasons};
use super::super::{
    w8a8_padded_rows, Fp8Activations, Fp8BlockWeight, MIN_CUBLASLT_VERSION, W8A8_CUBLASLT_BLOCK,
    W8A8_GROUP,
};
use super::cublaslt::{self, Gemm, Scaling};
use crate::cuda::{cuda_err, device_address, device_info, kernel};
use crate::error::{OpError, Result};

const MODULE: (&str, &[u8]) = ("fp8_quantize", glm5_kernels::FP8_QUANTIZE);

/// The kernel's parameter struct (`glm5_kernels::interface`, its layout checked against the CUDA side's at
/// build time), passed by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct QuantizeParams(Fp8QuantizeParams);
// SAFETY: plain-old-data with the C layout of the kernel's parameter struct (checked at build time).
unsafe impl DeviceRepr for QuantizeParams {}

fn to_i32(value: usize, what: &'static str) -> Result<i32> {
    i32::try_from(value).map_err(|_| OpError::Shape {
        arg: what,
        expected: "every dimension below 2^31".into(),
        found: vec![value],
    })
}

/// `x` `[m, k]` (f32 or bf16, contiguous, CUDA, `k` a multiple of 128) quantised by the W8A8 rule into
/// fresh (so 256-byte aligned) tensors padded to `w8a8_padded_rows(m)` rows.
pub(crate) fn quantize_activations(x: &Tensor) -> Result<Fp8Activations> {
    let (m, k) = x.dims2()?;
    let name = match x.dtype() {
        DType::F32 => "fp8_quantize_rows_f32",
        DType::BF16 => "fp8_quantize_rows_bf16",
        other => {
            return Err(OpError::NotFloat {
                arg: "x",
                found: other,
            })
        }
    };
    if !k.is_multiple_of(W8A8_GROUP) {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[rows, in] with in a multiple of {W8A8_GROUP}"),
            found: x.dims().to_vec(),
        });
    }
    let padded = w8a8_padded_rows(m);
    let groups = padded * (k / W8A8_GROUP);
    let (m_arg, padded_arg, k_arg) = (
        to_i32(m, "x rows")?,
        to_i32(padded, "x rows")?,
        to_i32(k, "x columns")?,
    );
    // Every element is written by the kernel (a warp per token and group, padding rows included).
    // SAFETY: neither is read before the kernel has written all of it.
    let codes = unsafe { Tensor::empty((padded, k), DType::U8, x.device())? };
    let scales = unsafe { Tensor::empty((k / W8A8_GROUP, padded), DType::F32, x.device())? };
    let acts = Fp8Activations {
        codes,
        scales,
        rows: m,
    };
    if groups == 0 {
        return Ok(acts);
    }
    let (x_ptr, dev) = device_address(x)?;
    let params = QuantizeParams(Fp8QuantizeParams {
        x: x_ptr,
        codes: device_address(&acts.codes)?.0,
        scales: device_address(&acts.scales)?.0,
        m: m_arg,
        m_pad: padded_arg,
        k: k_arg,
    });
    let warps = fp8_quantize::THREADS / 32;
    let blocks = u32::try_from(groups.div_ceil(warps)).map_err(|_| OpError::Shape {
        arg: "x",
        expected: "fewer than 2^32 blocks of 8 groups".into(),
        found: x.dims().to_vec(),
    })?;
    let func = kernel(&dev, MODULE.0, MODULE.1, name)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (fp8_quantize::THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&params);
    // SAFETY: the struct matches the kernel's parameter; x is [m, k] of the kernel's dtype, codes
    // [padded, k] and scales [k / 128, padded] fresh allocations of those sizes; the grid covers every
    // (row, group) pair once, and the kernel returns for warps past the last.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    Ok(acts)
}

/// An error unless `dev` is compute capability 9.0 and the process's cuBLASLt has the block-scaled FP8
/// modes (module contract).
fn check_device(dev: &CudaDevice) -> Result<()> {
    let capability = device_info(dev)?.capability;
    if (capability.major, capability.minor) != (9, 0) {
        return Err(OpError::Unsupported(format!(
            "fp8_matmul: the backend {W8A8_CUBLASLT_BLOCK} runs on compute capability 9.0 only (where NVIDIA \
             documents cuBLASLt's 128-element block-scaled FP8 modes); this device is {capability}"
        )));
    }
    let version = cublaslt::version();
    if version < MIN_CUBLASLT_VERSION {
        return Err(OpError::Unsupported(format!(
            "fp8_matmul: the backend {W8A8_CUBLASLT_BLOCK} needs cuBLASLt {} or newer; this process runs {}",
            version_text(MIN_CUBLASLT_VERSION),
            version_text(version)
        )));
    }
    Ok(())
}

/// `t` contiguous at a 16-byte aligned address (a copy when it is not), as cuBLASLt's FP8 operands and
/// scale tensors must be.
fn aligned16(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    Ok(if device_address(&t)?.0 % 16 == 0 {
        t
    } else {
        t.copy()?
    })
}

/// The weight's `scale_inv [ceil(n / 128), L]` with each row padded to `L4` (L rounded up to 4) floats: the
/// `BLK128x128_32F` layout (`cublaslt.rs`). Every GLM-5 matrix has L a multiple of 4: no copy then.
fn block_scales(w: &Fp8BlockWeight) -> Result<Tensor> {
    let (rows, l) = w.scale_inv.dims2()?;
    let l4 = l.div_ceil(4) * 4;
    if l4 == l {
        return aligned16(&w.scale_inv);
    }
    let pad = Tensor::zeros((rows, l4 - l), DType::F32, w.scale_inv.device())?;
    Ok(Tensor::cat(&[&w.scale_inv.contiguous()?, &pad], 1)?)
}

/// The W8A8 GEMM: `acts` (on the weight's device) times `Wᵀ`, `[acts.rows, n]` in `dtype` (f32 or bf16).
pub(crate) fn matmul(acts: &Fp8Activations, w: &Fp8BlockWeight, dtype: DType) -> Result<Tensor> {
    w.check()?;
    let (n, k) = w.dims()?;
    let (padded, k_acts) = acts.codes.dims2()?;
    if k_acts != k
        || acts.scales.dims() != [k / W8A8_GROUP, padded]
        || acts.codes.dtype() != DType::U8
        || acts.scales.dtype() != DType::F32
        || !padded.is_multiple_of(super::super::W8A8_ROW_MULTIPLE)
        || acts.rows > padded
    {
        return Err(OpError::Shape {
            arg: "activations",
            expected: format!(
                "U8 codes [rows padded to a multiple of {}, {k}] and F32 scales [{}, rows padded]",
                super::super::W8A8_ROW_MULTIPLE,
                k / W8A8_GROUP
            ),
            found: acts.codes.dims().to_vec(),
        });
    }
    let reasons = w8a8_shape_reasons(&crate::weight_only::WeightShape {
        out_dim: n,
        in_dim: k,
        block_in: w.block[1],
        block_out: w.block[0],
    });
    if !reasons.is_empty() {
        let list: Vec<String> = reasons.iter().map(ToString::to_string).collect();
        return Err(OpError::Unsupported(format!(
            "fp8_matmul: {W8A8_CUBLASLT_BLOCK} cannot multiply by a [{n}, {k}] weight of {:?} blocks: {}",
            w.block,
            list.join("; ")
        )));
    }
    if !matches!(dtype, DType::F32 | DType::BF16) {
        return Err(OpError::NotFloat {
            arg: "output",
            found: dtype,
        });
    }
    let device = acts.codes.device();
    if padded == 0 {
        return Ok(Tensor::zeros((0, n), dtype, device)?);
    }
    let weight = aligned16(&w.weight)?;
    let (weight_ptr, dev) = device_address(&weight)?;
    check_device(&dev)?;
    let w_scales = block_scales(w)?;
    let codes = aligned16(&acts.codes)?;
    let scales = aligned16(&acts.scales)?;
    // Every element of y is written by the GEMM.
    // SAFETY: `y` is only read after cuBLASLt has written all of it.
    let y = unsafe { Tensor::empty((padded, n), dtype, device)? };
    Gemm {
        n,
        m: padded,
        k,
        a: weight_ptr,
        b: device_address(&codes)?.0,
        d: device_address(&y)?.0,
        out: dtype,
        scaling: Scaling::Blocks {
            a: device_address(&w_scales)?.0,
            b: device_address(&scales)?.0,
        },
    }
    .run(&dev)?;
    // The padding rows' outputs (zeros) are the last rows: the first `rows` are a contiguous view.
    Ok(y.narrow(0, 0, acts.rows)?)
}

/// The plain FP8 GEMM with per-tensor scales of 1 (`fp8_gemm_per_tensor`): `a [m, k] · b [n, k]ᵀ`.
pub(crate) fn per_tensor_gemm(
    a: &Tensor,
    b: &Tensor,
    dtype: DType,
    fast_accumulation: bool,
) -> Result<Tensor> {
    let (m, k) = a.dims2()?;
    let (n, k_b) = b.dims2()?;
    if a.dtype() != DType::U8 || b.dtype() != DType::U8 || k_b != k {
        return Err(OpError::Shape {
            arg: "b",
            expected: format!("U8 [n, {k}] like a's U8 [{m}, {k}]"),
            found: b.dims().to_vec(),
        });
    }
    if !m.is_multiple_of(16) || !n.is_multiple_of(16) || !k.is_multiple_of(16) {
        return Err(OpError::Shape {
            arg: "a, b",
            expected: "every dimension a multiple of 16 (cuBLASLt's FP8 alignment)".into(),
            found: vec![m, n, k],
        });
    }
    let (a, b) = (aligned16(a)?, aligned16(b)?);
    let (a_ptr, dev) = device_address(&a)?;
    // SAFETY: `y` is only read after cuBLASLt has written all of it.
    let y = unsafe { Tensor::empty((m, n), dtype, a.device())? };
    // y [m, n] row-major = D (n x m) column-major = op(A) · B with A = b (TRANSA = T) and B = a.
    Gemm {
        n,
        m,
        k,
        a: device_address(&b)?.0,
        b: a_ptr,
        d: device_address(&y)?.0,
        out: dtype,
        scaling: Scaling::PerTensor { fast_accumulation },
    }
    .run(&dev)?;
    Ok(y)
}
