//! `nvfp4_matmul(x, w) -> y`: a linear layer whose weight stays in NVFP4 as NVIDIA ModelOpt exports it,
//! multiplied with the weight dequantised in the kernel (W4A16).
//!
//! # Contract
//!
//! * `w` is [`Nvfp4Weight`]: `packed` `U8 [out, in / 2]`, two e2m1 (`float4_e2m1fn`) codes per byte, the
//!   even column in the low nibble and the odd column in the high nibble; `scales` `U8 [out, in / 16]`, the
//!   e4m3 bit patterns of one scale per 16 consecutive values of a row; `global_scale`, the f32
//!   `weight_scale_2`. The weight stands for
//!   `W[r, c] = (e2m1(code[r, c]) · e4m3(scales[r, c / 16])) · global_scale`, computed in f32 in that order.
//!   `in` is a multiple of 16. ModelOpt's `input_scale` (the activation scale of W4A4) is not used.
//! * `x` is `[.., in]`, f32 or bf16 (f16 is converted to f32 first); `y = x · Wᵀ`, `[.., out]`, in `x`'s
//!   dtype, accumulated in f32. Activations are not quantised.
//! * CPU: the reference ([`reference::dequantize`] to f32, then a matmul). CUDA: rows `<= MAX_ROWS` run the
//!   mat-vec kernel (the packed bytes and scales are streamed once and dequantised in registers); more rows
//!   dequantise the whole matrix to `x`'s dtype in a transient buffer and use candle's matmul. The native
//!   FP4 block-scaled MMA of sm_120 is not used yet.
//! * Which implementation runs is checked per weight when the graph is built ([`dispatch`]).

mod entries;
pub mod reference;

#[cfg(feature = "cuda")]
mod cuda;

pub use entries::{backends, dispatch};

use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};

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

/// `x · Wᵀ` in `x`'s dtype (see the module contract).
pub fn nvfp4_matmul(x: &Tensor, w: &Nvfp4Weight) -> Result<Tensor> {
    crate::weight_only::apply("nvfp4_matmul", x, w.dims()?, |x2| {
        #[cfg(feature = "cuda")]
        if x2.device().is_cuda() {
            return cuda::nvfp4_matmul(&x2.contiguous()?, w);
        }
        reference::nvfp4_matmul(x2, w)
    })
}
