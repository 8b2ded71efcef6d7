//! The index of the largest value along the last dim: greedy decoding's pick from the logits.
//!
//! # Contract
//!
//! `x` `[.., n]` (`n >= 1`) of a float dtype → `U32 [..]`: per row, the index of its largest value; among
//! equal values the lowest index; NaN ranks above every number (as `torch.argmax`).
//!
//! # Implementations
//!
//! The reference reads the rows back to the host (any device, any float dtype); on CUDA for bf16 and f32
//! (`kernels/src/argmax.cu`) a row's spans (one pass of a 256-thread block each) take a block each, many loads
//! in flight per thread, and a second kernel takes each row's best of its spans'; a row of one span takes
//! one block. Over GLM-5's 154,880 f32 logits on an H100: candle's argmax (one load in flight) 110.6 us, a
//! block a row 17.4 us, the spans 4.2 + 3.0 us.

use candle_core::{DType, Tensor, D};

use crate::error::{check_float, OpError, Result};

#[cfg(feature = "cuda")]
mod cuda;

/// Per row of `x`, the index of its largest value (contract above).
pub fn argmax(x: &Tensor) -> Result<Tensor> {
    check(x)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F32) {
        return cuda::argmax(x);
    }
    argmax_reference(x)
}

fn check(x: &Tensor) -> Result<()> {
    if x.rank() == 0 || x.dim(D::Minus1)? == 0 {
        return Err(OpError::Shape {
            arg: "x",
            expected: "[.., n] with n >= 1".into(),
            found: x.dims().to_vec(),
        });
    }
    check_float("x", x)
}

/// The reference: each row on the host, the contract's order, the result on `x`'s device.
pub fn argmax_reference(x: &Tensor) -> Result<Tensor> {
    check(x)?;
    let n = x.dim(D::Minus1)?;
    let leading = x.dims()[..x.rank() - 1].to_vec();
    let values: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let picks: Vec<u32> = values
        .chunks(n)
        .map(|row| {
            let mut at = 0;
            for (i, &v) in row.iter().enumerate().skip(1) {
                let best = row[at];
                let above = if v.is_nan() {
                    !best.is_nan()
                } else {
                    !best.is_nan() && v > best
                };
                if above {
                    at = i;
                }
            }
            at as u32
        })
        .collect();
    Ok(Tensor::from_vec(picks, leading, x.device())?)
}
