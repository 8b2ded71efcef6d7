//! The plain reference of `nvfp4_matmul`: unpack and dequantise the weight to f32, then matmul.

use candle_core::{DType, Tensor};

use super::{Nvfp4Weight, GROUP};
use crate::error::Result;
use crate::fp8_matmul::reference::e4m3_table;

/// The value of every e2m1 code: sign bit 3, two exponent bits (bias 1), one mantissa bit.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `W` as f32 `[out, in]` on the weight's device (module contract).
pub fn dequantize(w: &Nvfp4Weight) -> Result<Tensor> {
    w.check()?;
    let (out, inp) = w.dims()?;
    let packed: Vec<u8> = w.packed.flatten_all()?.to_vec1()?;
    let scales: Vec<u8> = w.scales.flatten_all()?.to_vec1()?;
    let table = e4m3_table();
    let mut values = Vec::with_capacity(out * inp);
    for r in 0..out {
        for c in 0..inp {
            let byte = packed[r * inp / 2 + c / 2];
            let code = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            let scale = table[scales[r * (inp / GROUP) + c / GROUP] as usize];
            values.push(E2M1[code as usize] * scale * w.global_scale);
        }
    }
    Ok(Tensor::from_vec(values, (out, inp), w.packed.device())?)
}

/// `x · Wᵀ` for `x` `[rows, in]`, in f32.
pub fn nvfp4_matmul(x: &Tensor, w: &Nvfp4Weight) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?.matmul(&dequantize(w)?.t()?)?)
}
