//! Where a call's tokens go in a cache, and the candle-op write the fused cache-row ops use as their
//! reference path (`latent_rows`, `index_key_rows`).

use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};

/// Where a call's rows go in a cache of `N` rows.
#[derive(Debug, Clone, Copy)]
pub enum CacheRows<'a> {
    /// Rows `offset ..= offset + T - 1` (a contiguous cache).
    From(usize),
    /// Row `rows[t]` for token `t` (`U32 [T]`, on the cache's device, each `< N`; a paged cache).
    At(&'a Tensor),
}

impl CacheRows<'_> {
    /// The cache-row kernels' arguments `(rows, first_row)`: a null row list and the offset, or the rows'
    /// device address (with the contiguous copy it points into, to keep alive until the launch) and 0.
    #[cfg(feature = "cuda")]
    pub(crate) fn kernel_args(&self) -> Result<(u64, i32, Option<Tensor>)> {
        Ok(match *self {
            CacheRows::From(offset) => (0, offset as i32, None),
            CacheRows::At(rows) => {
                let rows = rows.contiguous()?;
                (crate::cuda::device_address(&rows)?.0, 0, Some(rows))
            }
        })
    }

    /// Checks `T` rows fit a cache of `slots` rows (`From`) or that the row list is `U32 [T]` (`At`).
    pub(crate) fn check(&self, t: usize, slots: usize, cache: &Tensor) -> Result<()> {
        match *self {
            CacheRows::From(offset) => {
                if offset.checked_add(t).is_none_or(|end| end > slots) {
                    return Err(OpError::Shape {
                        arg: "cache",
                        expected: format!("at least {} rows", offset.saturating_add(t)),
                        found: cache.dims().to_vec(),
                    });
                }
            }
            CacheRows::At(rows) => {
                if rows.dims() != [t] || rows.dtype() != DType::U32 {
                    return Err(OpError::Shape {
                        arg: "rows",
                        expected: format!("U32 [{t}]"),
                        found: rows.dims().to_vec(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// `cache[row of t] = values[t]` by candle ops: `cache` `[N, W]` and `values` `[T, W]`, or `[N]` and `[T]`.
pub fn write_rows(cache: &Tensor, values: &Tensor, rows: CacheRows<'_>) -> Result<()> {
    match rows {
        CacheRows::From(offset) => cache.slice_set(&values.contiguous()?, 0, offset)?,
        CacheRows::At(rows) => {
            let ids = match values.dims() {
                [_] => rows.clone(),
                &[t, width] => rows.unsqueeze(1)?.broadcast_as((t, width))?.contiguous()?,
                other => {
                    return Err(OpError::Shape {
                        arg: "values",
                        expected: "[T] or [T, W]".into(),
                        found: other.to_vec(),
                    })
                }
            };
            cache.scatter_set(&ids, &values.contiguous()?, 0)?;
        }
    }
    Ok(())
}
