//! §3.2 RoPE tables for the positions of one forward call (one sequence's run, or a batch's tokens).

use candle_core::{DType, Device, Tensor};

use crate::config::Config;
use crate::error::Result;

/// §3.2 interleaved RoPE at the positions of one forward call: pairs `(x[2i], x[2i+1])` rotate by
/// `pos · θ^(-2i/R)`. Used on the MLA rope slice (last dims) and the indexer rope slice (first dims).
#[derive(Clone)]
pub(super) struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub(super) fn at_positions(
        config: &Config,
        start_pos: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let positions: Vec<usize> = (start_pos..start_pos + len).collect();
        Self::at(config, &positions, dtype, device)
    }

    /// The tables of any positions, one row per token (a batch of several sequences' tokens).
    pub(super) fn at(
        config: &Config,
        positions: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let len = positions.len();
        let half = config.qk_rope_head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                (1.0 / config
                    .rope_theta
                    .powf(2.0 * i as f64 / config.qk_rope_head_dim as f64)) as f32
            })
            .collect();
        let (mut cos, mut sin) = (
            Vec::with_capacity(len * half),
            Vec::with_capacity(len * half),
        );
        for &pos in positions {
            for f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (len, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (len, half), device)?.to_dtype(dtype)?;
        Ok(Self { cos, sin })
    }

    /// The rows of `table` (the tables of positions `0..len`, [`Self::at_positions`]) at `positions`
    /// (`U32 [T]` on the table's device): the tables [`Self::at`] makes, gathered on the device (a captured
    /// step reads its positions there).
    pub(super) fn gather(table: &Self, positions: &Tensor) -> Result<Self> {
        Ok(Self {
            cos: table.cos.index_select(positions, 0)?,
            sin: table.sin.index_select(positions, 0)?,
        })
    }

    /// Positions the tables hold.
    pub(super) fn len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The same tables on `device` (one copy per device the layers run on).
    pub(super) fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            cos: super::copy_to_device(&self.cos, device)?,
            sin: super::copy_to_device(&self.sin, device)?,
        })
    }

    /// `(cos, sin)`, each `[T, R / 2]`: row `t` for the call's token `t`.
    pub(super) fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }
}
