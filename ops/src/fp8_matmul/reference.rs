//! The plain references of `fp8_matmul` (module contract): W8A16, dequantise the weight block by block to
//! f32, then matmul; and W8A8 (the backend `fp8-w8a8-cublaslt-block`), the activations quantised to e4m3 per
//! token and 128 values first.

use std::sync::OnceLock;

use candle_core::{DType, Tensor};

use super::{w8a8_padded_rows, Fp8Activations, Fp8BlockWeight, W8A8_GROUP};
use crate::error::{OpError, Result};

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

/// A float matrix `[out, in]` quantised to block-scaled FP8 on the CPU, as the published FP8 checkpoints are:
/// per `block` tile the scale is `amax / 448` (1 for an all-zero tile), each value the e4m3 code of
/// `value / scale` ([`e4m3_satfinite`]). `scale_inv` holds the scales (the multiplier
/// [`dequantize`] applies). Row blocks are shared out over the CPU's threads. A non-finite value is an error
/// naming its position (its tile's scale would be meaningless).
pub fn quantize_block(w: &Tensor, block: [usize; 2]) -> Result<Fp8BlockWeight> {
    let (out, inp) = w.dims2()?;
    let [bo, bi] = block;
    if bo == 0 || bi == 0 {
        return Err(OpError::Unsupported(
            "fp8 quantisation: block sizes must be at least 1".into(),
        ));
    }
    let values: Vec<f32> = w
        .to_device(&candle_core::Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(OpError::Unsupported(format!(
            "fp8 quantisation: value {} at [{}, {}] is not finite",
            values[at],
            at / inp.max(1),
            at % inp.max(1)
        )));
    }
    let (row_blocks, col_blocks) = (out.div_ceil(bo), inp.div_ceil(bi));
    let mut codes = vec![0u8; out * inp];
    let mut scales = vec![0f32; row_blocks * col_blocks];
    // One row block: its tiles' scales, then its rows' codes.
    let quantize_rows = |rb: usize, codes: &mut [u8], scales: &mut [f32]| {
        let rows = rb * bo..((rb + 1) * bo).min(out);
        for (cb, scale) in scales.iter_mut().enumerate() {
            let cols = cb * bi..((cb + 1) * bi).min(inp);
            let amax = rows
                .clone()
                .flat_map(|r| values[r * inp + cols.start..r * inp + cols.end].iter())
                .fold(0f32, |m, v| m.max(v.abs()));
            *scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
        }
        for (i, r) in rows.enumerate() {
            for c in 0..inp {
                codes[i * inp + c] = e4m3_satfinite(values[r * inp + c] / scales[c / bi]);
            }
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = row_blocks.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (t, (codes, scales)) in codes
            .chunks_mut(per_thread * bo * inp)
            .zip(scales.chunks_mut(per_thread * col_blocks))
            .enumerate()
        {
            let quantize_rows = &quantize_rows;
            scope.spawn(move || {
                for (i, (codes, scales)) in codes
                    .chunks_mut(bo * inp)
                    .zip(scales.chunks_mut(col_blocks))
                    .enumerate()
                {
                    quantize_rows(t * per_thread + i, codes, scales);
                }
            });
        }
    });
    let cpu = candle_core::Device::Cpu;
    Ok(Fp8BlockWeight {
        weight: Tensor::from_vec(codes, (out, inp), &cpu)?,
        scale_inv: Tensor::from_vec(scales, (row_blocks, col_blocks), &cpu)?,
        block,
    })
}

/// `x · Wᵀ` for `x` `[rows, in]`, in f32.
pub fn fp8_matmul(x: &Tensor, w: &Fp8BlockWeight) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?.matmul(&dequantize(w)?.t()?)?)
}

// ---------------------------------------------------------------------------------------------------------
// W8A8: the computation of the backend `fp8-w8a8-cublaslt-block` (module contract, "W8A8"), written out.

/// e4m3's largest finite value: a group's largest activation maps to it.
pub const E4M3_MAX: f32 = 448.0;
/// The smallest activation scale: f32's smallest normal value (`2^-126`), so that a zero group (or one whose
/// `amax / 448` underflows) divides by no zero and no subnormal.
pub const MIN_ACTIVATION_SCALE: f32 = f32::MIN_POSITIVE;
/// e4m3's NaN code (`S.1111.111` with the sign clear), what a NaN activation becomes.
pub const E4M3_NAN: u8 = 0x7f;

/// The e4m3 code of `v`: round to nearest even (subnormals included), `±448` for `|v| >= 448`
/// (saturating), NaN to [`E4M3_NAN`], the sign kept (so `-0.0` and negative values that round to zero give
/// `0x80`). What `__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)` computes.
pub fn e4m3_satfinite(v: f32) -> u8 {
    if v.is_nan() {
        return E4M3_NAN;
    }
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    crate::nvfp4_matmul::reference::e4m3_rne(v.abs().min(E4M3_MAX)) | sign
}

/// Quantises one token `x` (`len` a multiple of [`W8A8_GROUP`]) into `codes` (`len` bytes) and one scale per
/// group, written to `scales[b * stride]` for group `b` (module contract, "W8A8", step 1).
pub fn quantize_token(x: &[f32], codes: &mut [u8], scales: &mut [f32], stride: usize) {
    for (b, (group, out)) in x
        .chunks_exact(W8A8_GROUP)
        .zip(codes.chunks_exact_mut(W8A8_GROUP))
        .enumerate()
    {
        let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = (amax / E4M3_MAX).max(MIN_ACTIVATION_SCALE);
        for (code, &v) in out.iter_mut().zip(group) {
            *code = e4m3_satfinite(v / scale);
        }
        scales[b * stride] = scale;
    }
}

/// `x` `[rows, in]` (f32 or bf16 values, `in` a multiple of [`W8A8_GROUP`]) quantised by the W8A8 rule, on
/// the CPU, in the layout the CUDA kernel writes ([`Fp8Activations`]).
pub fn quantize_activations(x: &Tensor) -> Result<Fp8Activations> {
    let (rows, k) = x.dims2()?;
    if !k.is_multiple_of(W8A8_GROUP) {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[rows, in] with in a multiple of {W8A8_GROUP}"),
            found: x.dims().to_vec(),
        });
    }
    let padded = w8a8_padded_rows(rows);
    let values: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut codes = vec![0u8; padded * k];
    let mut scales = vec![MIN_ACTIVATION_SCALE; (k / W8A8_GROUP) * padded];
    for r in 0..rows {
        quantize_token(
            &values[r * k..(r + 1) * k],
            &mut codes[r * k..(r + 1) * k],
            &mut scales[r..],
            padded,
        );
    }
    let device = x.device();
    Ok(Fp8Activations {
        codes: Tensor::from_vec(codes, (padded, k), device)?,
        scales: Tensor::from_vec(scales, (k / W8A8_GROUP, padded), device)?,
        rows,
    })
}

/// The quantised activations' values `e4m3(code) · scale` as f32 `[rows, in]` (padding rows left out).
pub fn dequantize_activations(acts: &Fp8Activations) -> Result<Tensor> {
    let (padded, k) = acts.codes.dims2()?;
    let codes: Vec<u8> = acts.codes.flatten_all()?.to_vec1()?;
    let scales: Vec<f32> = acts.scales.flatten_all()?.to_vec1()?;
    let table = e4m3_table();
    let mut values = Vec::with_capacity(acts.rows * k);
    for r in 0..acts.rows {
        values.extend(
            codes[r * k..(r + 1) * k]
                .iter()
                .enumerate()
                .map(|(c, &q)| table[q as usize] * scales[(c / W8A8_GROUP) * padded + r]),
        );
    }
    Ok(Tensor::from_vec(
        values,
        (acts.rows, k),
        acts.codes.device(),
    )?)
}

/// The W8A8 product of quantised activations and `w` (module contract, "W8A8", step 2) as f32
/// `[rows, out]`: the dequantised values multiplied in f32 (each product of an e4m3 code pair is exact; the
/// sums in candle's order).
pub fn w8a8_product(acts: &Fp8Activations, w: &Fp8BlockWeight) -> Result<Tensor> {
    Ok(dequantize_activations(acts)?.matmul(&dequantize(w)?.t()?)?)
}

/// W8A8 `x · Wᵀ` for `x` `[rows, in]`, in f32: [`quantize_activations`], then [`w8a8_product`].
pub fn fp8_matmul_w8a8(x: &Tensor, w: &Fp8BlockWeight) -> Result<Tensor> {
    w8a8_product(&quantize_activations(x)?, w)
}
