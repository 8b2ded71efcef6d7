//! The plain references of `nvfp4_matmul` (module contract): W4A16, unpack and dequantise the weight to
//! f32, then matmul; and W4A4 (the backend `nvfp4-w4a4-mma-sm120`), the activations quantised to NVFP4 row
//! by row, then the e2m1 · e4m3 products summed in f32.

use candle_core::{DType, Tensor};

use super::{Nvfp4Activations, Nvfp4Weight, GROUP};
use crate::error::{OpError, Result};
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

// ---------------------------------------------------------------------------------------------------------
// W4A4: the computation of the backend `nvfp4-w4a4-mma-sm120` (module contract, "W4A4"), written out.

/// e4m3's largest finite value.
pub const E4M3_MAX: f32 = 448.0;
/// e2m1's largest value.
pub const E2M1_MAX: f32 = 6.0;
/// The smallest row scale: f32's smallest normal value, so that a row of zeros (or of values below
/// `2688 · 2^-126`) divides by no zero and no subnormal.
pub const MIN_ROW_SCALE: f32 = f32::MIN_POSITIVE;

/// The e4m3 code nearest to `v`, ties to the even code, for `0 <= v <= 448` (subnormals included: steps of
/// 2^-9 below 2^-6).
pub fn e4m3_rne(v: f32) -> u8 {
    if v < MIN_E4M3_NORMAL {
        return (v * 512.0).round_ties_even() as u8;
    }
    let bits = v.to_bits();
    let mut exponent = (bits >> 23) as i32 - 127;
    let mantissa = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    let mut q = ((mantissa - 1.0) * 8.0).round_ties_even() as u32;
    if q == 8 {
        exponent += 1;
        q = 0;
    }
    ((((exponent + 7) as u32) << 3) | q) as u8
}

const MIN_E4M3_NORMAL: f32 = 1.0 / 64.0;

/// The e2m1 magnitude code (0..=7) nearest to `r >= 0` on {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even
/// code, 7 (6.0) above 6 (satfinite).
pub fn e2m1_rne(r: f32) -> u8 {
    match r {
        r if r <= 0.25 => 0,
        r if r < 0.75 => 1,
        r if r <= 1.25 => 2,
        r if r < 1.75 => 3,
        r if r <= 2.5 => 4,
        r if r < 3.5 => 5,
        r if r <= 5.0 => 6,
        _ => 7,
    }
}

/// Quantises one row of activations (`x.len()` a multiple of [`GROUP`]) into `codes` (`len / 2` bytes, the
/// even column in the low nibble) and `scales` (`len / 16` e4m3 bytes); returns the row scale `g`
/// (module contract, "W4A4": `g = max(amax / (6 · 448), 2^-126)`, NaN if the row holds a non-finite value).
pub fn quantize_row(x: &[f32], codes: &mut [u8], scales: &mut [u8]) -> f32 {
    let finite = x.iter().all(|v| v.is_finite());
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let g = if finite {
        (amax / (E2M1_MAX * E4M3_MAX)).max(MIN_ROW_SCALE)
    } else {
        f32::NAN
    };
    let block_unit = E2M1_MAX * g;
    let table = e4m3_table();
    for (b, block) in x.chunks_exact(GROUP).enumerate() {
        let bmax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = e4m3_rne((bmax / block_unit).min(E4M3_MAX));
        let unit = table[scale as usize] * g;
        for (j, &v) in block.iter().enumerate() {
            let magnitude = if unit > 0.0 {
                e2m1_rne(v.abs() / unit)
            } else {
                0
            };
            let code = magnitude | if v < 0.0 { 8 } else { 0 };
            let byte = &mut codes[(b * GROUP + j) / 2];
            if j % 2 == 0 {
                *byte = code;
            } else {
                *byte |= code << 4;
            }
        }
        scales[b] = scale;
    }
    g
}

/// `x` `[rows, in]` (f32 or bf16, `in` a multiple of 16) quantised to NVFP4 row by row ([`quantize_row`]),
/// on the CPU.
pub fn quantize_activations(x: &Tensor) -> Result<Nvfp4Activations> {
    let (rows, inp) = x.dims2()?;
    if !inp.is_multiple_of(GROUP) {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[rows, in] with in a multiple of {GROUP}"),
            found: x.dims().to_vec(),
        });
    }
    let values: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut codes = vec![0u8; rows * inp / 2];
    let mut scales = vec![0u8; rows * inp / GROUP];
    let mut row_scales = Vec::with_capacity(rows);
    for r in 0..rows {
        row_scales.push(quantize_row(
            &values[r * inp..(r + 1) * inp],
            &mut codes[r * inp / 2..(r + 1) * inp / 2],
            &mut scales[r * inp / GROUP..(r + 1) * inp / GROUP],
        ));
    }
    let device = x.device();
    Ok(Nvfp4Activations {
        codes: Tensor::from_vec(codes, (rows, inp / 2), device)?,
        scales: Tensor::from_vec(scales, (rows, inp / GROUP), device)?,
        row_scales: Tensor::from_vec(row_scales, rows, device)?,
    })
}

/// `e2m1(code) · e4m3(scale)` for every value of `[rows, in]` codes and `[rows, in / 16]` scales: exact in
/// f32 (a 2-bit times a 4-bit significand).
fn scaled_codes(codes: &[u8], scales: &[u8], rows: usize, inp: usize) -> Vec<f32> {
    let table = e4m3_table();
    let mut values = Vec::with_capacity(rows * inp);
    for r in 0..rows {
        for c in 0..inp {
            let byte = codes[r * inp / 2 + c / 2];
            let code = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            values
                .push(E2M1[code as usize] * table[scales[r * (inp / GROUP) + c / GROUP] as usize]);
        }
    }
    values
}

/// The W4A4 product and, per output, the same sum over the products' magnitudes (for error bounds): both
/// f32 `[rows, out]`.
fn w4a4(x: &Tensor, w: &Nvfp4Weight) -> Result<(Tensor, Tensor)> {
    w.check()?;
    let (out, inp) = w.dims()?;
    let (rows, x_in) = x.dims2()?;
    if x_in != inp {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[rows, {inp}]"),
            found: x.dims().to_vec(),
        });
    }
    let acts = quantize_activations(x)?;
    let a = scaled_codes(
        &acts.codes.flatten_all()?.to_vec1::<u8>()?,
        &acts.scales.flatten_all()?.to_vec1::<u8>()?,
        rows,
        inp,
    );
    let g: Vec<f32> = acts.row_scales.to_vec1()?;
    let b = scaled_codes(
        &w.packed.flatten_all()?.to_vec1::<u8>()?,
        &w.scales.flatten_all()?.to_vec1::<u8>()?,
        out,
        inp,
    );
    let mut y = Vec::with_capacity(rows * out);
    let mut magnitude = Vec::with_capacity(rows * out);
    for r in 0..rows {
        let a_row = &a[r * inp..(r + 1) * inp];
        for n in 0..out {
            let b_row = &b[n * inp..(n + 1) * inp];
            let (mut acc, mut abs) = (0.0f32, 0.0f32);
            for (p, q) in a_row.iter().zip(b_row) {
                acc += p * q;
                abs += (p * q).abs();
            }
            y.push(acc * g[r] * w.global_scale);
            magnitude.push(abs * g[r] * w.global_scale.abs());
        }
    }
    let device = x.device();
    Ok((
        Tensor::from_vec(y, (rows, out), device)?,
        Tensor::from_vec(magnitude, (rows, out), device)?,
    ))
}

/// W4A4 `x · Wᵀ` for `x` `[rows, in]`, f32 `[rows, out]` (module contract, "W4A4"): `x` quantised by
/// [`quantize_activations`]; each product `(e2m1(a) · e4m3(sa)) · (e2m1(w) · e4m3(sw))` (exact in f32)
/// summed in f32 in order of `k`; the sum times the row scale, then times the weight's global scale.
pub fn nvfp4_matmul_w4a4(x: &Tensor, w: &Nvfp4Weight) -> Result<Tensor> {
    Ok(w4a4(x, w)?.0)
}

/// [`nvfp4_matmul_w4a4`] and, per output, `(Σ_k |products|) · g · |global_scale|`: what an f32 sum in
/// another order can differ by is at most `2 (in - 1) 2^-24` times it.
pub fn nvfp4_matmul_w4a4_with_magnitudes(x: &Tensor, w: &Nvfp4Weight) -> Result<(Tensor, Tensor)> {
    w4a4(x, w)
}
