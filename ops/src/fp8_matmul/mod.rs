//! `fp8_matmul(x, w) -> y`: a linear layer whose weight stays in block-scaled FP8 (the layout of
//! `zai-org/GLM-5-FP8` and DeepSeek-V3), multiplied with the weight dequantised in the kernel (W8A16), or, for
//! prefill rows where the backend `fp8-w8a8-cublaslt-block` is chosen, with the activations quantised to FP8
//! per token too (W8A8) on the FP8 tensor cores through cuBLASLt.
//!
//! # Contract
//!
//! * `w` is [`Fp8BlockWeight`]: `weight` `U8 [out, in]`, the e4m3 (`float8_e4m3fn`) bit patterns as the
//!   checkpoint stores them, and `scale_inv` `F32 [ceil(out / block_out), ceil(in / block_in)]`, one
//!   multiplier per `block_out x block_in` block (a multiplier despite its name); the last block of a row or
//!   column may be partial (GLM-5's `kv_a_proj_with_mqa`: 576 rows, 4.5 blocks of 128). The weight stands
//!   for `W[r, c] = e4m3(weight[r, c]) · scale_inv[r / block_out, c / block_in]`, computed in f32.
//! * `x` is `[.., in]`, f32 or bf16 (f16 is converted to f32 first); `y = x · Wᵀ`, `[.., out]`, in `x`'s
//!   dtype, accumulated in f32.
//! * **W8A16** (every backend for decode rows; prefill rows wherever W8A8 is not chosen): the activations are
//!   not quantised. CPU: the reference ([`reference::dequantize`] to f32, then a matmul): correct, not fast.
//!   CUDA: rows `<= MAX_ROWS` run the mat-vec kernel, which streams the FP8 bytes once, dequantises in
//!   registers and accumulates in f32 (decode); more rows dequantise the whole matrix to `x`'s dtype in a
//!   transient device buffer and use candle's matmul (prefill).
//! * **W8A8** (backend [`W8A8_CUBLASLT_BLOCK`]: rows `> MAX_ROWS` on compute capability 9.0 with cuBLASLt
//!   12.9 or newer, for a weight of 128 x 128 blocks with `in` a multiple of 128 and `out` a multiple of 16,
//!   when the caller passes [`Fp8Prefill::W8a8Block`] to [`fp8_matmul_with`], as the model does where
//!   [`dispatch`] chooses it: first for prefill rows on sm_90, 2.6x W8A16 there): the activations are
//!   quantised to e4m3 per token and per 128 values of `in` (DeepSeek-V3's recipe, which GLM-5-FP8's
//!   `activation_scheme: dynamic` declares), so the result differs from W8A16 (and from decoding the same
//!   rows) by the activations' rounding. Exactly ([`reference::quantize_activations`] and
//!   [`reference::w8a8_product`] write it out):
//!   1. per token `r` of `x` (as f32) and group `b` of [`W8A8_GROUP`] consecutive values: `amax = max |x|`
//!      (NaN values ignored), scale `s[r, b] = max(amax / 448, 2^-126)`, and per value
//!      `code = e4m3(x / s[r, b])` rounded to nearest even, `±448` above (saturating), NaN to the NaN code
//!      `0x7f`; both divisions correctly rounded f32 ones. A zero group gets scale `2^-126` and zero codes.
//!   2. `y[r, n] = Σ_b s[r, b] · scale_inv[n / 128, b] · Σ_{k in b} e4m3(code[r, k]) · e4m3(weight[n, k])`,
//!      each product exact; the sums by cuBLASLt's block-scaled FP8 kernels: Hopper's FP8 tensor cores add
//!      a block's products with fewer bits than f32 (DeepSeek-V3 §3.3.2 measured about 14), the blocks are
//!      scaled and summed in f32; written in `x`'s dtype.
//!
//!   Why this rule: 448 maps a group's largest value to e4m3's largest; the floor `2^-126` keeps a zero group
//!   (or one whose `amax / 448` underflows) from dividing by zero or a subnormal; per token and 128 values
//!   because that is the granularity cuBLASLt's `VEC128_32F` scales take (and DeepSeek-V3 trained with), so
//!   one outlier token or channel group does not coarsen the others. Per activation the rounding error is at
//!   most half an e4m3 step: `max(2^-4 |x|, 2^-10 s)` (3 mantissa bits; the subnormal step `2^-9 s` below
//!   `2^-6 s`), which bounds the distance to W8A16 (`tests/fp8_w8a8.rs`). The quantiser is glm5's kernel
//!   (`kernels/src/fp8_quantize.cu`, equal to the reference bit for bit); the GEMM is cuBLASLt's
//!   (`cuda/cublaslt.rs` says how it is called and where the layouts come from). NVIDIA documents the
//!   128-element scaling modes for compute capability 9.0 only, hence the backend's devices.
//! * Which implementation runs is checked per weight when the graph is built ([`dispatch`]: one backend for
//!   decode rows and one for prefill rows; [`Fp8Prefill::of`] carries the prefill choice to the layer); a
//!   weight no backend serves on the device fails the build with every backend's reasons, and a W8A8 choice
//!   that cannot run (another device, another shape) is an error, never W8A16 in its place.

mod entries;
pub mod reference;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

pub use entries::{backends, dispatch, MIN_CUBLASLT_VERSION, W8A8_CUBLASLT_BLOCK};

use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};
use crate::weight_only::WeightOnlyChoice;

/// Rows of `x` the CUDA mat-vec kernel takes in one launch; more use the dequantise-then-matmul path.
pub const MAX_ROWS: usize = glm5_kernels::interface::weight_only::MAX_ROWS;

/// W8A8: activation values of one token sharing one f32 scale (cuBLASLt's `VEC128_32F` blocks), and the
/// weight block W8A8 needs (`BLK128x128_32F`).
pub const W8A8_GROUP: usize = glm5_kernels::interface::fp8_quantize::GROUP;

/// W8A8: quantised activations are padded with zero rows to a multiple of this many rows (cuBLASLt's
/// alignment; `glm5_kernels::interface::fp8_quantize::ROW_MULTIPLE`).
pub const W8A8_ROW_MULTIPLE: usize = glm5_kernels::interface::fp8_quantize::ROW_MULTIPLE;

/// A block-scaled FP8 weight (module contract).
#[derive(Debug, Clone)]
pub struct Fp8BlockWeight {
    /// `U8 [out, in]`: e4m3 bit patterns.
    pub weight: Tensor,
    /// `F32 [ceil(out / block[0]), ceil(in / block[1])]`.
    pub scale_inv: Tensor,
    /// `[block_out, block_in]` (`weight_block_size`).
    pub block: [usize; 2],
}

impl Fp8BlockWeight {
    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok(self.weight.dims2()?)
    }

    /// Checks the parts agree with each other (the loader checks them against the checkpoint first).
    pub fn check(&self) -> Result<()> {
        let (out, inp) = self.dims()?;
        if self.weight.dtype() != DType::U8 {
            return Err(OpError::Unsupported(format!(
                "fp8_matmul: weight must be U8 e4m3 bytes, found {:?}",
                self.weight.dtype()
            )));
        }
        if self.block[0] == 0 || self.block[1] == 0 {
            return Err(OpError::Unsupported(
                "fp8_matmul: block sizes must be at least 1".into(),
            ));
        }
        let expected = [out.div_ceil(self.block[0]), inp.div_ceil(self.block[1])];
        if self.scale_inv.dims() != expected || self.scale_inv.dtype() != DType::F32 {
            return Err(OpError::Shape {
                arg: "scale_inv",
                expected: format!("F32 {expected:?}"),
                found: self.scale_inv.dims().to_vec(),
            });
        }
        Ok(())
    }
}

/// How rows above [`MAX_ROWS`] are multiplied: the weight's prefill backend as [`dispatch`] chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Prefill {
    /// W8A16: dequantise the matrix, then a matmul (`fp8-w8a16-cuda`, `fp8-reference-cpu`).
    #[default]
    W8a16,
    /// W8A8 on the FP8 tensor cores through cuBLASLt's block-scaled GEMM ([`W8A8_CUBLASLT_BLOCK`]).
    W8a8Block,
}

impl Fp8Prefill {
    /// The prefill path of a weight's dispatched backends.
    pub fn of(choice: &WeightOnlyChoice) -> Self {
        if choice.prefill.name == W8A8_CUBLASLT_BLOCK {
            Fp8Prefill::W8a8Block
        } else {
            Fp8Prefill::W8a16
        }
    }
}

/// Activations quantised by the W8A8 rule (module contract), padded with zero rows to `rows_padded`, a
/// multiple of [`W8A8_ROW_MULTIPLE`], in the layout cuBLASLt's block-scaled GEMM reads.
#[derive(Debug, Clone)]
pub struct Fp8Activations {
    /// `U8 [rows_padded, in]`: e4m3 codes, rows `rows..` zero.
    pub codes: Tensor,
    /// `F32 [in / W8A8_GROUP, rows_padded]`: one scale per token and group, the tokens contiguous
    /// (`VEC128_32F` of cuBLASLt's B operand); `2^-126` for padding rows.
    pub scales: Tensor,
    /// Rows of `x` (the rest is padding).
    pub rows: usize,
}

impl Fp8Activations {
    /// Rows including the padding.
    pub fn rows_padded(&self) -> Result<usize> {
        Ok(self.codes.dim(0)?)
    }
}

/// `rows` rounded up to a multiple of [`W8A8_ROW_MULTIPLE`]: the rows of quantised activations.
pub fn w8a8_padded_rows(rows: usize) -> usize {
    rows.div_ceil(W8A8_ROW_MULTIPLE) * W8A8_ROW_MULTIPLE
}

/// `x` `[rows, in]` (f32 or bf16, `in` a multiple of [`W8A8_GROUP`]) quantised by the W8A8 rule where it
/// lies: the CPU reference, or on CUDA glm5's quantiser kernel.
pub fn quantize_activations(x: &Tensor) -> Result<Fp8Activations> {
    if !matches!(x.dtype(), DType::F32 | DType::BF16) {
        return Err(OpError::NotFloat {
            arg: "x",
            found: x.dtype(),
        });
    }
    let (_, k) = x.dims2()?;
    if !k.is_multiple_of(W8A8_GROUP) {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[rows, in] with in a multiple of {W8A8_GROUP}"),
            found: x.dims().to_vec(),
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
                "fp8_matmul on CUDA needs the `cuda` feature".into(),
            ))
        }
    } else {
        reference::quantize_activations(x)
    }
}

/// The W8A8 GEMM alone: quantised activations times `Wᵀ` by cuBLASLt's block-scaled FP8 GEMM, `[rows, out]`
/// in `dtype` (f32 or bf16). CUDA only (on the CPU: [`reference::w8a8_product`]).
pub fn w8a8_matmul(acts: &Fp8Activations, w: &Fp8BlockWeight, dtype: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if acts.codes.device().is_cuda() {
        return cuda::w8a8::matmul(acts, w, dtype);
    }
    let _ = (w, dtype);
    Err(OpError::Unsupported(format!(
        "fp8_matmul: the W8A8 GEMM ({W8A8_CUBLASLT_BLOCK}) runs on CUDA only; these activations are on {:?} \
         (the CPU computes it as reference::w8a8_product)",
        acts.codes.device().location()
    )))
}

/// `x · Wᵀ` in `x`'s dtype, W8A16 for every row count (see the module contract).
pub fn fp8_matmul(x: &Tensor, w: &Fp8BlockWeight) -> Result<Tensor> {
    fp8_matmul_with(x, w, Fp8Prefill::W8a16)
}

/// `x · Wᵀ` in `x`'s dtype, rows above [`MAX_ROWS`] by `prefill` (the weight's [`dispatch`]ed prefill
/// backend: [`Fp8Prefill::of`]). W8A8 where it cannot run is an error.
pub fn fp8_matmul_with(x: &Tensor, w: &Fp8BlockWeight, prefill: Fp8Prefill) -> Result<Tensor> {
    crate::weight_only::apply("fp8_matmul", x, w.dims()?, |x2| {
        #[cfg(feature = "cuda")]
        if x2.device().is_cuda() {
            return cuda::fp8_matmul(&x2.contiguous()?, w, prefill);
        }
        if prefill == Fp8Prefill::W8a8Block && x2.dim(0)? > MAX_ROWS {
            return Err(OpError::Unsupported(format!(
                "fp8_matmul: the prefill backend {W8A8_CUBLASLT_BLOCK} runs on CUDA sm_90 only; x is on the CPU"
            )));
        }
        reference::fp8_matmul(x2, w)
    })
}

/// The version of the cuBLASLt library this process runs (`cublasLtGetVersion`: major · 10000 + minor · 100
/// + patch), `None` without the `cuda` feature.
pub fn cublaslt_version() -> Option<usize> {
    #[cfg(feature = "cuda")]
    {
        Some(cuda::cublaslt::version())
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// A plain FP8 GEMM by cuBLASLt with per-tensor scales of 1 (`CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F`):
/// `a` `U8 [m, k]` and `b` `U8 [n, k]` e4m3 bytes on one CUDA device, `a · bᵀ` as `[m, n]` in `dtype` (bf16 or
/// f32); `fast_accumulation` sets `CUBLASLT_MATMUL_DESC_FAST_ACCUM`. For measuring the device's FP8
/// tensor-core rate (`glm5-bench fp8-prefill`), not a path of the model.
#[cfg(feature = "cuda")]
pub fn fp8_gemm_per_tensor(
    a: &Tensor,
    b: &Tensor,
    dtype: DType,
    fast_accumulation: bool,
) -> Result<Tensor> {
    cuda::w8a8::per_tensor_gemm(a, b, dtype, fast_accumulation)
}
