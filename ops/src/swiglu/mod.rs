//! SwiGLU of a stacked gate|up product: the MLP's `silu(gate(x)) ⊙ up(x)` (`docs/architecture.md`, §3.1) where
//! gate and up were multiplied as one matrix.
//!
//! # Contract
//!
//! `gate_up` `[rows, 2·inter]` (any leading dims; gate's `inter` columns, then up's) of a float dtype; in f32,
//! for every row and column `c < inter`:
//!
//! ```text
//! out[c] = round(round(silu(gate_up[c])) · gate_up[inter + c]),   silu(g) = g / (1 + e^-g)
//! ```
//!
//! where `round` is the rounding to the dtype (none in f32), as torch computes `act_fn(gate) * up` in bf16:
//! the activation in f32, rounded once, then the product.
//!
//! # Implementations
//!
//! The reference is candle tensor ops (any device); on CUDA for bf16 and f32 one kernel
//! (`kernels/src/swiglu.cu`) where candle's ops take a silu over the strided gate half and a multiply by the
//! strided up half (at prefill sizes those strided kernels cost a visible share of an MLP).

use candle_core::{DType, Tensor, D};

use crate::error::{check_float, OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;

/// SwiGLU of `gate_up` (contract above): `[.., inter]`.
pub fn swiglu(gate_up: &Tensor, inter: usize) -> Result<Tensor> {
    check(gate_up, inter)?;
    #[cfg(feature = "cuda")]
    if gate_up.device().is_cuda() && matches!(gate_up.dtype(), DType::BF16 | DType::F32) {
        return cuda::swiglu(gate_up, inter);
    }
    swiglu_reference(gate_up, inter)
}

/// The last dim is `2 · inter` and the dtype a float.
fn check(gate_up: &Tensor, inter: usize) -> Result<()> {
    if gate_up.rank() == 0 || gate_up.dim(D::Minus1)? != 2 * inter {
        return Err(OpError::Shape {
            arg: "gate_up",
            expected: format!("[.., {}] (gate's {inter} columns, then up's)", 2 * inter),
            found: gate_up.dims().to_vec(),
        });
    }
    check_float("gate_up", gate_up)
}

/// The reference (any device): candle's silu in f32, rounded to the dtype, times up in f32, rounded.
pub fn swiglu_reference(gate_up: &Tensor, inter: usize) -> Result<Tensor> {
    check(gate_up, inter)?;
    let dtype = gate_up.dtype();
    let gate = gate_up.narrow(D::Minus1, 0, inter)?.to_dtype(DType::F32)?;
    let up = gate_up
        .narrow(D::Minus1, inter, inter)?
        .to_dtype(DType::F32)?;
    let activated = gate.silu()?.to_dtype(dtype)?.to_dtype(DType::F32)?;
    Ok((activated * up)?.to_dtype(dtype)?)
}
