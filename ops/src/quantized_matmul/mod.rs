//! `quantized_matmul(x, w) -> y`: a linear layer whose weight stays in ggml's quantised blocks (GGUF).
//!
//! # Contract
//!
//! * `w` is `[out, in]`, stored in a ggml block format ([`GgmlDType`]: `in` a whole number of blocks), as
//!   candle's `QMatMul` holds it on the device; `x` is `[.., in]` in any float dtype.
//! * `y = x · wᵀ`, `[.., out]`, in `x`'s dtype. The product is computed by candle's quantised kernels in
//!   f32, with the activations quantised to 8-bit blocks as llama.cpp does (Q8_0 on the CPU, Q8_1 in the
//!   CUDA mat-vec and MMQ kernels).
//! * Which implementation runs is chosen per weight when the graph is built, from the weight's format and
//!   the device ([`dispatch`]); a format no backend serves on that device fails the build with every
//!   backend's reasons, naming the tensor. Nothing falls back to expanding the weight silently.

mod entries;

pub use entries::{backends, dispatch, QuantizedBackend, QuantizedDispatchError};

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Module, Tensor};

/// `x · wᵀ` in `x`'s dtype (see the module contract).
pub fn quantized_matmul(x: &Tensor, w: &QMatMul) -> crate::Result<Tensor> {
    Ok(w.forward(&x.to_dtype(DType::F32)?.contiguous()?)?
        .to_dtype(x.dtype())?)
}

/// The block formats candle's quantised kernels compute with.
pub const CANDLE_FORMATS: [GgmlDType; 10] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];
