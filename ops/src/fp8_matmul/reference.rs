//! The plain reference of `fp8_matmul`: dequantise the weight block by block to f32, then matmul.

use std::sync::OnceLock;

use candle_core::{DType, Tensor};

use super::Fp8BlockWeight;
use crate::error::Result;

/// The f32 value of every e4m3 (`float8_e4m3fn`) bit pattern (0x7f and 0xff are NaN).
pub fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| float8::F8E4M3::from_bits(b as u8).to_f32()))
}

/// `W` as f32 `[out, in]` on the weight's device: `e4m3(weight[r, c]) · scale_inv[r / bo, c / bi]`.
pub fn dequantize(w: &Fp8BlockWeight) -> Result<Tensor> {
    w.check()?;
    let (out, inp) = w.dims()?;
    let [bo, bi] = w.block;
    let bytes: Vec<u8> = w.weight.flatten_all()?.to_vec1()?;
    let scales: Vec<f32> = w.scale_inv.flatten_all()?.to_vec1()?;
    let scale_cols = inp.div_ceil(bi);
    let table = e4m3_table();
    let mut values = Vec::with_capacity(out * inp);
    for r in 0..out {
        let scale_row = &scales[(r / bo) * scale_cols..(r / bo + 1) * scale_cols];
        let row = &bytes[r * inp..(r + 1) * inp];
        values.extend(
            row.iter()
                .enumerate()
                .map(|(c, &b)| table[b as usize] * scale_row[c / bi]),
        );
    }
    Ok(Tensor::from_vec(values, (out, inp), w.weight.device())?)
}

/// `x · Wᵀ` for `x` `[rows, in]`, in f32.
pub fn fp8_matmul(x: &Tensor, w: &Fp8BlockWeight) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?.matmul(&dequantize(w)?.t()?)?)
}
