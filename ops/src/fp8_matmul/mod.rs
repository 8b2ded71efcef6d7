//! `fp8_matmul(x, w) -> y`: a linear layer whose weight stays in block-scaled FP8 (the layout of
//! `zai-org/GLM-5-FP8` and DeepSeek-V3), multiplied with the weight dequantised in the kernel (W8A16).
//!
//! # Contract
//!
//! * `w` is [`Fp8BlockWeight`]: `weight` `U8 [out, in]`, the e4m3 (`float8_e4m3fn`) bit patterns as the
//!   checkpoint stores them, and `scale_inv` `F32 [ceil(out / block_out), ceil(in / block_in)]`, one
//!   multiplier per `block_out x block_in` block (a multiplier despite its name); the last block of a row or
//!   column may be partial (GLM-5's `kv_a_proj_with_mqa`: 576 rows, 4.5 blocks of 128). The weight stands
//!   for `W[r, c] = e4m3(weight[r, c]) · scale_inv[r / block_out, c / block_in]`, computed in f32.
//! * `x` is `[.., in]`, f32 or bf16 (f16 is converted to f32 first); `y = x · Wᵀ`, `[.., out]`, in `x`'s
//!   dtype, accumulated in f32. Activations are not quantised (`activation_scheme: dynamic` per-token FP8
//!   activations are the prefill tensor-core path, not built yet).
//! * CPU: the reference ([`reference::dequantize`] to f32, then a matmul): correct, not fast. CUDA: rows
//!   `<= MAX_ROWS` run the mat-vec kernel, which streams the FP8 bytes once, dequantises in registers and
//!   accumulates in f32 (decode); more rows dequantise the whole matrix to `x`'s dtype in a transient device
//!   buffer and use candle's matmul (prefill; FP8 tensor cores are not used yet).
//! * Which implementation runs is checked per weight when the graph is built ([`dispatch`]); a weight no
//!   backend serves on the device fails the build with every backend's reasons.

mod entries;
pub mod reference;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

pub use entries::{backends, dispatch};

use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};

/// Rows of `x` the CUDA mat-vec kernel takes in one launch; more use the dequantise-then-matmul path.
pub const MAX_ROWS: usize = glm5_kernels::interface::weight_only::MAX_ROWS;

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

/// `x · Wᵀ` in `x`'s dtype (see the module contract).
pub fn fp8_matmul(x: &Tensor, w: &Fp8BlockWeight) -> Result<Tensor> {
    crate::weight_only::apply("fp8_matmul", x, w.dims()?, |x2| {
        #[cfg(feature = "cuda")]
        if x2.device().is_cuda() {
            return cuda::fp8_matmul(&x2.contiguous()?, w);
        }
        reference::fp8_matmul(x2, w)
    })
}
