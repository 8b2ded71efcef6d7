//! Errors returned by the ops.
//!
//! Every bad input is reported as a typed variant that names the argument, what was expected
//! and what was found; failures inside candle are passed through as [`OpError::Candle`].

use candle_core::{DType, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// A tensor (or slice) has the wrong rank or a dimension that disagrees with another input.
    #[error("{arg}: expected shape {expected}, found {found:?}")]
    Shape {
        arg: &'static str,
        expected: String,
        found: Vec<usize>,
    },
    /// Two inputs that must share a dtype do not.
    #[error("{arg}: expected dtype {expected:?} (the dtype of {other}), found {found:?}")]
    DTypeMismatch {
        arg: &'static str,
        other: &'static str,
        expected: DType,
        found: DType,
    },
    /// An input that must hold floating-point values does not.
    #[error("{arg}: expected a floating-point dtype, found {found:?}")]
    NotFloat { arg: &'static str, found: DType },
    /// An index tensor has a dtype other than the one the op takes.
    #[error("{arg}: expected index dtype {expected:?}, found {found:?}")]
    IndexDType {
        arg: &'static str,
        expected: DType,
        found: DType,
    },
    /// An index is neither -1 nor a row of the cache.
    #[error("{arg}[{row}][{col}] = {value} is outside -1..{cache_len} (cache length {cache_len})")]
    IndexOutOfRange {
        arg: &'static str,
        row: usize,
        col: usize,
        value: i64,
        cache_len: usize,
    },
    /// `top_k` was 0.
    #[error("top_k must be at least 1")]
    ZeroTopK,
    /// A query claims to see more keys than there are.
    #[error("visible_keys[{row}] = {visible} exceeds the key count {key_count}")]
    VisibleKeysTooLong {
        row: usize,
        visible: usize,
        key_count: usize,
    },
    /// The value width asked of a latent row is wider than the row.
    #[error("value_dim = {value_dim} exceeds the latent row width D = {row_dim}")]
    ValueDimTooLarge { value_dim: usize, row_dim: usize },
    /// A backend cannot serve these shapes or dtypes (the message names the limit).
    #[error("{0}")]
    Unsupported(String),
    /// A cuBLAS(Lt) call failed: the call, the status it returned (e.g. `CUBLAS_STATUS_NOT_SUPPORTED`) and
    /// what was asked of it.
    #[error("{call} returned {status}: {context}")]
    Cublas {
        call: &'static str,
        status: String,
        context: String,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, OpError>;

/// Checks that `tensor` matches `pattern`, one `(name, size)` per dimension; `None` accepts any
/// size. Returns the dimensions.
pub(crate) fn check_shape<const R: usize>(
    arg: &'static str,
    tensor: &Tensor,
    pattern: [(&str, Option<usize>); R],
) -> Result<[usize; R]> {
    if let Ok(dims) = <[usize; R]>::try_from(tensor.dims()) {
        if dims
            .iter()
            .zip(&pattern)
            .all(|(&dim, &(_, size))| size.unwrap_or(dim) == dim)
        {
            return Ok(dims);
        }
    }
    let expected = pattern
        .iter()
        .map(|&(name, size)| match size {
            Some(s) => format!("{name}={s}"),
            None => name.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ");
    Err(OpError::Shape {
        arg,
        expected: format!("[{expected}]"),
        found: tensor.dims().to_vec(),
    })
}

/// Checks that `tensor` holds floating-point values.
pub(crate) fn check_float(arg: &'static str, tensor: &Tensor) -> Result<()> {
    match tensor.dtype() {
        DType::BF16 | DType::F16 | DType::F32 | DType::F64 => Ok(()),
        found => Err(OpError::NotFloat { arg, found }),
    }
}

/// Checks that `tensor` has the dtype of `reference` (named `other`).
pub(crate) fn check_same_dtype(
    arg: &'static str,
    tensor: &Tensor,
    other: &'static str,
    reference: &Tensor,
) -> Result<()> {
    if tensor.dtype() == reference.dtype() {
        return Ok(());
    }
    Err(OpError::DTypeMismatch {
        arg,
        other,
        expected: reference.dtype(),
        found: tensor.dtype(),
    })
}
