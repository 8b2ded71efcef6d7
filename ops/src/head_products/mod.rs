//! `head_products`: one token's per-head products `x[h] · W[h]`: MLA's `W_UK` and `W_UV` at decode
//! (`docs/architecture.md`, §3.4).
//!
//! # Contract
//!
//! `x` `[H, K]` and `w` `[H, K, N]`, of one float dtype. The result, contiguous `[H, N]`:
//!
//! ```text
//! out[h] = x[h] · w[h]      (f32 sums, one rounding to the dtype)
//! ```
//!
//! `absorbed_query::absorbed_query_one_token` is the same product with the absorbed query's RoPE half
//! written after it, in one launch.
//!
//! # Implementations
//!
//! The reference: candle's batched matmul (on CUDA cuBLAS's batched GEMM, which at one row per head reads
//! the weights at 50-60% of copy on an H100). On CUDA for bf16 and f32 with `N` a multiple of 8 and `w`
//! 16-byte aligned, one kernel (`kernels/src/attention_rows.cu`) that streams `w` once: a block per
//! (64 columns, head), its warps splitting the rows.
//!
//! The model takes the kernel for `W_UK` only, inside `absorbed_query_one_token` (H100, in the decode step:
//! 8.1-8.4 µs where cuBLAS's product and the absorbed query's launch took 8.4 + 3.2). For `W_UV` cuBLAS is
//! faster (9.4 µs against the kernel's 11.2-11.7: a lane keeps one row's load in flight at a time, which
//! 16 rows a lane at GLM-5's 512 expose).

use candle_core::Tensor;

use crate::error::{check_same_dtype, check_shape, Result};

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

/// The products (contract above), by candle's matmul.
pub fn head_products_reference(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.unsqueeze(1)?.matmul(w)?.squeeze(1)?)
}

/// `x` `[H, K]` and `w` `[H, K, N]` checked against each other: returns `(H, K, N)`.
pub(crate) fn check_shapes(
    x_heads: usize,
    k: usize,
    x: &Tensor,
    w: &Tensor,
) -> Result<(usize, usize, usize)> {
    let [heads, rows, n] =
        check_shape("w", w, [("H", Some(x_heads)), ("K", Some(k)), ("N", None)])?;
    check_same_dtype("w", w, "x", x)?;
    Ok((heads, rows, n))
}

/// Whether the kernel serves these inputs (the module doc): a CUDA device, bf16 or f32, `N` a multiple of 8.
#[cfg(feature = "cuda")]
pub(crate) fn kernel_serves(x: &Tensor, n: usize) -> bool {
    x.device().is_cuda()
        && matches!(
            x.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F32
        )
        && n.is_multiple_of(8)
}

/// The products `[H, N]` (contract above).
pub fn head_products(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (heads, k) = x.dims2()?;
    let (_, _, n) = check_shapes(heads, k, x, w)?;
    #[cfg(feature = "cuda")]
    if kernel_serves(x, n) && heads > 0 && n > 0 {
        return cuda::head_products(x, w);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = n;
    head_products_reference(x, w)
}
