//! `nvfp4_matmul(x, w) -> y`: a linear layer whose weight stays in NVFP4 as NVIDIA ModelOpt exports it,
//! multiplied with the weight dequantised in the kernel (W4A16), or, for prefill rows on sm_120 where the
//! backend `nvfp4-w4a4-mma-sm120` is chosen, with the activations quantised to NVFP4 too (W4A4) on the
//! block-scaled FP4 tensor cores.
//!
//! # Contract
//!
//! * `w` is [`Nvfp4Weight`]: `packed` `U8 [out, in / 2]`, two e2m1 (`float4_e2m1fn`) codes per byte, the
//!   even column in the low nibble and the odd column in the high nibble; `scales` `U8 [out, in / 16]`, the
//!   e4m3 bit patterns of one scale per 16 consecutive values of a row; `global_scale`, the f32
//!   `weight_scale_2`. The weight stands for
//!   `W[r, c] = (e2m1(code[r, c]) · e4m3(scales[r, c / 16])) · global_scale`, computed in f32 in that order.
//!   `in` is a multiple of 16. ModelOpt's `input_scale` (a static activation scale) is not used.
//! * `x` is `[.., in]`, f32 or bf16 (f16 is converted to f32 first); `y = x · Wᵀ`, `[.., out]`, in `x`'s
//!   dtype, accumulated in f32.
//! * **W4A16** (every backend for decode rows, and for prefill rows on the CPU, sm_90 and wherever W4A4 is
//!   not chosen): activations are not quantised. CPU: the reference ([`reference::dequantize`] to f32, then
//!   a matmul). CUDA: rows `<= MAX_ROWS` run the mat-vec kernel (the packed bytes and scales are streamed
//!   once and dequantised in registers); more rows dequantise the whole matrix to `x`'s dtype in a transient
//!   buffer and use candle's matmul.
//! * **W4A4** (backend `nvfp4-w4a4-mma-sm120`: rows `> MAX_ROWS` on compute capability 12.0 only, when the
//!   caller passes [`Prefill::W4a4Sm120`] to [`nvfp4_matmul_with`]; [`dispatch`] ranks it after W4A16 until it
//!   has run on sm_120 hardware, so today only a caller that pins it runs it):
//!   the activations are quantised to NVFP4, so the result differs from W4A16 (and from decode of the same
//!   rows) by the activations' rounding. Exactly (every step a correctly rounded f32 operation;
//!   [`reference::nvfp4_matmul_w4a4`] writes it out):
//!   1. per row `r` of `x` (as f32): `amax = max |x[r, c]|`, row scale
//!      `g[r] = max(amax / (6 · 448), 2^-126)` (NaN if the row holds a non-finite value: its outputs are NaN);
//!   2. per 16 consecutive values: `s = e4m3_rne(min(amax16 / (6 · g[r]), 448))`, the nearest e4m3 value,
//!      ties to even, subnormals included (0 when `amax16 / (6 · g[r]) <= 2^-10`);
//!   3. per value: `code = e2m1_rne(|x| / (s · g[r]))` with `x`'s sign, the nearest of
//!      {0, 0.5, 1, 1.5, 2, 3, 4, 6} ties to the even code, 6 above (0 when `s = 0`);
//!   4. `y[r, n] = ((Σ_k (e2m1(a) · s_a) · (e2m1(w) · s_w)) · g[r]) · global_scale`: each product exact in
//!      f32, the sum in f32 in the tensor cores' order (unspecified, so results differ from the reference's
//!      in-order sum by at most `2 (in - 1) 2^-24 Σ_k |products|`).
//!
//!   Why this rule: `6 · 448` maps the row's largest value to the largest e2m1 value times the largest e4m3
//!   scale, so no block scale saturates and the largest blocks keep e4m3's full precision (ModelOpt's
//!   NVFP4 recipe, with `amax` measured per row instead of calibrated per tensor). Per row rather than per
//!   tensor because the scale is computed where the row is quantised (no pass over the whole tensor first)
//!   and one token's outlier does not push every other token's block scales into e4m3's subnormals; it is
//!   still one f32 per output row, applied after the sum. Blocks far below their row's largest (under
//!   `amax / 28672`) get subnormal e4m3 scales and lose precision: the format's limit. The error against
//!   W4A16: per value at most `max(|x|/4, s·g/4, |x| - 6·s·g)` (half an e2m1 step; the last term only when
//!   `s` rounded down), so `|y4a4 - y4a16| <= Σ_k that · |W[n, k]|` plus both sums' f32 rounding
//!   (`tests/nvfp4_w4a4.rs`). Its kernels (`kernels/src/nvfp4_mma_sm120a.cu`) are sm_120a SASS only;
//!   correctness on sm_120 hardware has not been run yet (`tests/fp8_nvfp4_cuda.rs` checks it there and
//!   says so when the GPU is not sm_120). `in` must be a multiple of
//!   `glm5_kernels::interface::nvfp4_mma::TILE_K` (128).
//! * Which implementation runs is checked per weight when the graph is built ([`dispatch`]: one backend for
//!   decode rows and one for prefill rows); a W4A4 choice that cannot run (another device, another `in`) is
//!   an error, never a fall back to W4A16.

mod entries;
pub mod reference;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

pub use entries::{backends, dispatch, W4A4_MMA_SM120};

use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};
use crate::weight_only::WeightOnlyChoice;

/// Values sharing one e4m3 scale.
pub const GROUP: usize = 16;

/// Rows of `x` the CUDA mat-vec kernel takes in one launch.
pub const MAX_ROWS: usize = glm5_kernels::interface::weight_only::MAX_ROWS;

/// An NVFP4 weight (module contract).
#[derive(Debug, Clone)]
pub struct Nvfp4Weight {
    /// `U8 [out, in / 2]`.
    pub packed: Tensor,
    /// `U8 [out, in / 16]`: e4m3 bit patterns.
    pub scales: Tensor,
    /// `weight_scale_2`.
    pub global_scale: f32,
}

impl Nvfp4Weight {
    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        let (out, half) = self.packed.dims2()?;
        Ok((out, half * 2))
    }

    /// Checks the parts agree with each other (the loader checks them against the checkpoint first).
    pub fn check(&self) -> Result<()> {
        let (out, inp) = self.dims()?;
        if self.packed.dtype() != DType::U8 || self.scales.dtype() != DType::U8 {
            return Err(OpError::Unsupported(
                "nvfp4_matmul: packed values and scales must be U8".into(),
            ));
        }
        if !inp.is_multiple_of(GROUP) || self.scales.dims() != [out, inp / GROUP] {
            return Err(OpError::Shape {
                arg: "scales",
                expected: format!(
                    "U8 [{out}, {}] (in = {inp} a multiple of {GROUP})",
                    inp / GROUP
                ),
                found: self.scales.dims().to_vec(),
            });
        }
        Ok(())
    }
}

/// How rows above [`MAX_ROWS`] are multiplied: the weight's prefill backend as [`dispatch`] chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefill {
    /// W4A16: dequantise the matrix, then a matmul (`nvfp4-w4a16-cuda`, `nvfp4-reference-cpu`).
    #[default]
    W4a16,
    /// W4A4 on sm_120's block-scaled FP4 MMA ([`W4A4_MMA_SM120`]).
    W4a4Sm120,
}

impl Prefill {
    /// The prefill path of a weight's dispatched backends.
    pub fn of(choice: &WeightOnlyChoice) -> Self {
        if choice.prefill.name == W4A4_MMA_SM120 {
            Prefill::W4a4Sm120
        } else {
            Prefill::W4a16
        }
    }
}

/// Activations quantised to NVFP4 by the W4A4 rule (module contract): `codes` `U8 [rows, in / 2]` (the even
/// column in the low nibble), `scales` `U8 [rows, in / 16]` (e4m3), `row_scales` `F32 [rows]`.
#[derive(Debug, Clone)]
pub struct Nvfp4Activations {
    pub codes: Tensor,
    pub scales: Tensor,
    pub row_scales: Tensor,
}

/// `x` `[rows, in]` (f32 or bf16) quantised by the W4A4 rule (module contract) where it lies: the CPU
/// reference, or on CUDA the W4A4 backend's quantiser kernel (sm_120 only; elsewhere an error).
pub fn quantize_activations(x: &Tensor) -> Result<Nvfp4Activations> {
    if !matches!(x.dtype(), DType::F32 | DType::BF16) {
        return Err(OpError::NotFloat {
            arg: "x",
            found: x.dtype(),
        });
    }
    if x.device().is_cuda() {
        #[cfg(feature = "cuda")]
        {
            cuda::quantize_activations(&x.contiguous()?)
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(OpError::Unsupported(
                "nvfp4_matmul on CUDA needs the `cuda` feature".into(),
            ))
        }
    } else {
        reference::quantize_activations(x)
    }
}

/// `x · Wᵀ` in `x`'s dtype, W4A16 for every row count (see the module contract).
pub fn nvfp4_matmul(x: &Tensor, w: &Nvfp4Weight) -> Result<Tensor> {
    nvfp4_matmul_with(x, w, Prefill::W4a16)
}

/// `x · Wᵀ` in `x`'s dtype, rows above [`MAX_ROWS`] by `prefill` (the weight's [`dispatch`]ed prefill
/// backend: [`Prefill::of`]). W4A4 where it cannot run is an error.
pub fn nvfp4_matmul_with(x: &Tensor, w: &Nvfp4Weight, prefill: Prefill) -> Result<Tensor> {
    crate::weight_only::apply("nvfp4_matmul", x, w.dims()?, |x2| {
        #[cfg(feature = "cuda")]
        if x2.device().is_cuda() {
            return cuda::nvfp4_matmul(&x2.contiguous()?, w, prefill);
        }
        if prefill == Prefill::W4a4Sm120 && x2.dim(0)? > MAX_ROWS {
            return Err(OpError::Unsupported(format!(
                "nvfp4_matmul: the prefill backend {W4A4_MMA_SM120} runs on CUDA sm_120 only; x is on the CPU"
            )));
        }
        reference::nvfp4_matmul(x2, w)
    })
}
