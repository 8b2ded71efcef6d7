//! The DSA indexer's key cache layouts and the FP8 write path.
//!
//! # Contract
//!
//! One key of `D` (config `index_head_dim`) values per token, stored either
//! * as floats (the model's dtype: bf16 or f32), or
//! * as FP8 e4m3 with one f32 scale per key, as DeepSeek-V3.2 and vLLM store it (`D + 4` bytes per token,
//!   132 for GLM-5): `scale = amax / 448` over the key's values (`1` for an all-zero key) and
//!   `byte[d] = e4m3(key[d] / scale)`, rounded to nearest even and saturated to ±448 ("satfinite"). The key
//!   the indexer reads back is `scale · e4m3_value(byte[d])`.
//!
//! Bytes live in a `U8` tensor, scales in an `F32` tensor with one entry per key. [`quantize_fp8`] runs on
//! the keys' device: the CPU through the `float8` crate's conversion, CUDA through glm5's kernel
//! (`__nv_cvt_float_to_fp8`); both round the same f32 quotient, so they agree bit for bit.

use candle_core::{DType, Tensor};

use crate::error::{check_float, check_shape, OpError, Result};

/// The FP8 quantiser's launcher (its kernel is in `kernels/src/dsa_indexer/quantize.cuh`).
#[cfg(feature = "cuda")]
mod cuda;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// How an indexer key cache stores its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyFormat {
    /// The model's float dtype.
    #[default]
    Float,
    /// FP8 e4m3 bytes and one f32 scale per key.
    Fp8E4m3,
}

impl KeyFormat {
    /// Bytes of one key of `dim` values, floats being `float_bytes` wide.
    pub fn key_bytes(self, dim: usize, float_bytes: usize) -> usize {
        match self {
            KeyFormat::Float => dim * float_bytes,
            KeyFormat::Fp8E4m3 => dim + 4,
        }
    }

    /// `float` or `fp8` (what the CLI takes).
    pub fn name(self) -> &'static str {
        match self {
            KeyFormat::Float => "float",
            KeyFormat::Fp8E4m3 => "fp8",
        }
    }

    /// The format named `name` (see [`KeyFormat::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        [KeyFormat::Float, KeyFormat::Fp8E4m3]
            .into_iter()
            .find(|f| f.name() == name)
    }
}

impl std::fmt::Display for KeyFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Keys of an indexer cache, in one of the two layouts (module docs).
#[derive(Clone, Copy)]
pub enum IndexKeys<'a> {
    /// Float keys `[.., D]`, the dtype of the queries.
    Float(&'a Tensor),
    /// FP8 keys: `bytes` `U8 [.., D]` and `scales` `F32 [..]` (one per key).
    Fp8 {
        bytes: &'a Tensor,
        scales: &'a Tensor,
    },
}

impl IndexKeys<'_> {
    /// The format of these keys.
    pub fn format(&self) -> KeyFormat {
        match self {
            IndexKeys::Float(_) => KeyFormat::Float,
            IndexKeys::Fp8 { .. } => KeyFormat::Fp8E4m3,
        }
    }

    /// The key tensor (float values or e4m3 bytes).
    pub fn values(&self) -> &Tensor {
        match self {
            IndexKeys::Float(keys) => keys,
            IndexKeys::Fp8 { bytes, .. } => bytes,
        }
    }

    /// The float keys `[.., D]` these stand for (FP8 dequantised), in f32.
    pub fn dequantize(&self) -> Result<Tensor> {
        match *self {
            IndexKeys::Float(keys) => Ok(keys.to_dtype(DType::F32)?),
            IndexKeys::Fp8 { bytes, scales } => {
                let dims = bytes.dims().to_vec();
                let values: Vec<f32> = bytes
                    .flatten_all()?
                    .to_vec1::<u8>()?
                    .into_iter()
                    .map(|b| float8::F8E4M3::from_bits(b).to_f32())
                    .collect();
                let values = Tensor::from_vec(values, dims, bytes.device())?;
                Ok(values.broadcast_mul(
                    &scales
                        .to_dtype(DType::F32)?
                        .unsqueeze(candle_core::D::Minus1)?,
                )?)
            }
        }
    }
}

/// Quantises float keys `[N, D]` to the FP8 layout: `(bytes U8 [N, D], scales F32 [N])` on their device.
pub fn quantize_fp8(keys: &Tensor) -> Result<(Tensor, Tensor)> {
    let [n, dim] = check_shape("keys", keys, [("N", None), ("D", None)])?;
    check_float("keys", keys)?;
    #[cfg(feature = "cuda")]
    if keys.device().is_cuda() {
        return cuda::quantize_fp8(keys, n, dim);
    }
    let rows = keys.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut bytes = Vec::with_capacity(n * dim);
    let mut scales = Vec::with_capacity(n);
    for row in rows {
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
        scales.push(scale);
        bytes.extend(
            row.iter()
                .map(|v| float8::F8E4M3::from_f32(v / scale).to_bits()),
        );
    }
    let device = keys.device();
    Ok((
        Tensor::from_vec(bytes, (n, dim), device)?,
        Tensor::from_vec(scales, n, device)?,
    ))
}

/// Checks that FP8 keys are `U8` with one `F32` scale per key.
pub(crate) fn check_fp8(bytes: &Tensor, scales: &Tensor) -> Result<()> {
    if bytes.dtype() != DType::U8 {
        return Err(OpError::Unsupported(format!(
            "FP8 index keys must be U8 bytes, found {:?}",
            bytes.dtype()
        )));
    }
    if scales.dtype() != DType::F32 {
        return Err(OpError::Unsupported(format!(
            "FP8 index key scales must be F32, found {:?}",
            scales.dtype()
        )));
    }
    let rows = &bytes.dims()[..bytes.rank().saturating_sub(1)];
    if scales.dims() != rows {
        return Err(OpError::Shape {
            arg: "key_scales",
            expected: format!("{rows:?} (one per key)"),
            found: scales.dims().to_vec(),
        });
    }
    Ok(())
}
