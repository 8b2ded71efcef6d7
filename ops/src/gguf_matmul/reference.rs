//! The i-quant formats, decoded on the CPU: ggml's block layouts (`block_iq*` in ggml-common.h) and its
//! dequantisation (`dequantize_row_iq*`), computed in f32 in the same order, so every value equals ggml's
//! and gguf-py's. A block of 256 values is 8 sub-blocks of 32 (IQ4_NL: one block of 32); each sub-block has
//! its own scale:
//!
//! | format | block bytes | layout (after the f16 super-scale `d`, except IQ1_M) | value |
//! |---|---|---|---|
//! | IQ2_XXS | 66 | per sub-block 8 bytes: 4 grid indices, then a u32 of 4 × 7 sign bits and a 4-bit scale `s` | `d·(0.5+s)/4 · grid · sign` |
//! | IQ2_XS | 74 | 32 u16: 9-bit grid index + 7 sign bits; 8 bytes of two 4-bit scales (one per 16 values) | as IQ2_XXS |
//! | IQ2_S | 82 | 32 index bytes, 32 sign bytes, 8 bytes of 2 high index bits ×4, 8 bytes of scale pairs | as IQ2_XXS |
//! | IQ3_XXS | 98 | 64 grid indices (4 values each), then per sub-block a u32 of signs and scale | `d·(0.5+s)/2 · grid · sign` |
//! | IQ3_S | 110 | 64 index bytes, 8 bytes of 9th index bits, 32 sign bytes, 4 bytes of scale pairs | `d·(1+2s) · grid · sign` |
//! | IQ1_S | 50 | 32 index bytes; per sub-block a u16: 3 high index bits ×4, 3-bit scale, delta sign | `d·(2s+1) · (grid ± 1/8)` |
//! | IQ1_M | 56 | 32 index bytes, 16 bytes of (3 high bits + delta sign) per index, 4 u16 of 3-bit scales whose top nibbles hold `d` | as IQ1_S, a scale per 16 values |
//! | IQ4_NL | 18 (32 values) | 16 bytes of 4-bit indices into 16 non-linear values | `d · kvalues[q]` |
//! | IQ4_XS | 136 | u16 of 2 high scale bits ×8, 4 bytes of low scale nibbles, 128 bytes of 4-bit indices | `d·(ls−32) · kvalues[q]` |
//!
//! | Q4_K (a K-quant) | 144 | f16 `dmin`, 12 bytes of 6-bit scales `sc` and mins `m` (`q4k_scale_min`), 128 bytes of 4-bit `q`: bytes 32j.. hold sub-block 2j in low nibbles, 2j+1 in high | `d·sc·q − dmin·m` |
//! | Q2_K | 84 | 16 bytes of 4-bit scale `sc` (low) and min `m` (high) per 16 values, 64 bytes of 2-bit `q` (value 128g + 32s + l is bits 2s of byte 32g + l), f16 `d`, `dmin` | `d·sc·q − dmin·m` |
//! | Q3_K | 110 | 32 bytes `hmask`, 64 bytes of 2-bit low `q` (as Q2_K), 12 bytes of 16 6-bit scales (`q3k_scale`), f16 `d`; value v's high bit is bit v / 32 of `hmask[v % 32]`, set meaning +0 and clear −4 | `d·(sc − 32)·(q − 4·!h)` |
//! | Q5_K | 176 | f16 `dmin`, 12 bytes of scales and mins as Q4_K's, 32 bytes `qh` (value v's fifth bit is bit v / 32 of `qh[v % 32]`), 128 bytes of 4-bit `q` as Q4_K's | `d·sc·q − dmin·m` |
//! | Q6_K (a K-quant) | 210 | `d` last: 128 bytes `ql` of low nibbles, 64 bytes `qh` of high bit pairs, 16 signed 8-bit scales `sc` (one per 16 values); per half of 128 values, value 32j + l (j < 4) is `ql[l + 32(j % 2)]`'s nibble j / 2 with bits 2j of `qh[l]` above it | `d·sc·(q − 32)` |
//!
//! Sign bits: IQ2_XXS, IQ2_XS and IQ3_XXS store 7 per 8 values (`KSIGNS_IQ2XS` supplies the 8th: the count of
//! negatives is even); IQ2_S and IQ3_S store all 8.

use candle_core::{DType, Device, Tensor};
use glm5_kernels::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};

use super::{GgufFormat, GgufWeight};
use crate::error::Result;

/// IQ1_S / IQ1_M's offset of every grid value, its sign stored per group.
const IQ1_DELTA: f32 = 0.125;

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Byte `j` of a packed grid entry.
fn grid_byte(entry: u64, j: usize) -> u8 {
    (entry >> (8 * j)) as u8
}

fn sign(bits: u32, j: usize) -> f32 {
    if bits >> j & 1 == 1 {
        -1.0
    } else {
        1.0
    }
}

/// Decodes one block of `format` (`format.block_bytes()` bytes) into `out` (`format.block_values()`).
pub fn decode_block(format: GgufFormat, b: &[u8], out: &mut [f32]) {
    debug_assert_eq!(b.len(), format.block_bytes());
    debug_assert_eq!(out.len(), format.block_values());
    match format {
        GgufFormat::Iq2Xxs => {
            let d = f16_at(b, 0);
            for ib in 0..8 {
                let q = &b[2 + 8 * ib..2 + 8 * ib + 8];
                let aux = u32_at(q, 4);
                let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
                for l in 0..4 {
                    let grid = IQ2XXS_GRID[q[l] as usize];
                    let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize] as u32;
                    for j in 0..8 {
                        out[32 * ib + 8 * l + j] = db * grid_byte(grid, j) as f32 * sign(signs, j);
                    }
                }
            }
        }
        GgufFormat::Iq2Xs => {
            let d = f16_at(b, 0);
            let scales = &b[66..74];
            for ib in 0..8 {
                for l in 0..4 {
                    let q = u16_at(b, 2 + 2 * (4 * ib + l)) as u32;
                    let s = (scales[ib] >> (4 * (l / 2)) & 0xf) as f32;
                    let db = d * (0.5 + s) * 0.25;
                    let grid = IQ2XS_GRID[(q & 511) as usize];
                    let signs = KSIGNS_IQ2XS[(q >> 9) as usize] as u32;
                    for j in 0..8 {
                        out[32 * ib + 8 * l + j] = db * grid_byte(grid, j) as f32 * sign(signs, j);
                    }
                }
            }
        }
        GgufFormat::Iq2S => {
            let d = f16_at(b, 0);
            let (qs, signs, qh, scales) = (&b[2..34], &b[34..66], &b[66..74], &b[74..82]);
            for ib in 0..8 {
                for l in 0..4 {
                    let s = (scales[ib] >> (4 * (l / 2)) & 0xf) as f32;
                    let db = d * (0.5 + s) * 0.25;
                    let index = qs[4 * ib + l] as usize | ((qh[ib] as usize >> (2 * l)) & 3) << 8;
                    let grid = IQ2S_GRID[index];
                    let bits = signs[4 * ib + l] as u32;
                    for j in 0..8 {
                        out[32 * ib + 8 * l + j] = db * grid_byte(grid, j) as f32 * sign(bits, j);
                    }
                }
            }
        }
        GgufFormat::Iq3Xxs => {
            let d = f16_at(b, 0);
            let qs = &b[2..66];
            for ib in 0..8 {
                let aux = u32_at(b, 66 + 4 * ib);
                let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
                for l in 0..4 {
                    let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize] as u32;
                    let g1 = IQ3XXS_GRID[qs[8 * ib + 2 * l] as usize] as u64;
                    let g2 = IQ3XXS_GRID[qs[8 * ib + 2 * l + 1] as usize] as u64;
                    for j in 0..8 {
                        let g = if j < 4 {
                            grid_byte(g1, j)
                        } else {
                            grid_byte(g2, j - 4)
                        };
                        out[32 * ib + 8 * l + j] = db * g as f32 * sign(signs, j);
                    }
                }
            }
        }
        GgufFormat::Iq3S => {
            let d = f16_at(b, 0);
            let (qs, qh, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
            for ib in 0..8 {
                let s = (scales[ib / 2] >> (4 * (ib % 2)) & 0xf) as u32;
                let db = d * (1 + 2 * s) as f32;
                for k in 0..8 {
                    let index = qs[8 * ib + k] as usize | ((qh[ib] as usize >> k) & 1) << 8;
                    let grid = IQ3S_GRID[index] as u64;
                    for j in 0..4 {
                        let v = 32 * ib + 4 * k + j;
                        out[v] = db * grid_byte(grid, j) as f32 * sign(signs[v / 8] as u32, v % 8);
                    }
                }
            }
        }
        GgufFormat::Iq1S => {
            let d = f16_at(b, 0);
            let qs = &b[2..34];
            for ib in 0..8 {
                let qh = u16_at(b, 34 + 2 * ib) as usize;
                let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
                let delta = if qh & 0x8000 != 0 {
                    -IQ1_DELTA
                } else {
                    IQ1_DELTA
                };
                for l in 0..4 {
                    let grid = IQ1S_GRID[qs[4 * ib + l] as usize | ((qh >> (3 * l)) & 7) << 8];
                    for j in 0..8 {
                        out[32 * ib + 8 * l + j] = dl * (grid_byte(grid, j) as i8 as f32 + delta);
                    }
                }
            }
        }
        GgufFormat::Iq1M => {
            let (qs, qh) = (&b[0..32], &b[32..48]);
            let sc = [u16_at(b, 48), u16_at(b, 50), u16_at(b, 52), u16_at(b, 54)];
            let d_bits = (sc[0] >> 12)
                | ((sc[1] >> 8) & 0x00f0)
                | ((sc[2] >> 4) & 0x0f00)
                | (sc[3] & 0xf000);
            let d = half::f16::from_bits(d_bits).to_f32();
            for ib in 0..8 {
                for h in 0..2 {
                    let s = 2 * ib + h;
                    let dl = d * (2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1) as f32;
                    for q in 0..2 {
                        let i = 4 * ib + 2 * h + q;
                        let nibble = (qh[i / 2] >> (4 * (i % 2))) & 0xf;
                        let delta = if nibble & 8 != 0 {
                            -IQ1_DELTA
                        } else {
                            IQ1_DELTA
                        };
                        let grid = IQ1S_GRID[qs[i] as usize | ((nibble & 7) as usize) << 8];
                        for j in 0..8 {
                            out[8 * i + j] = dl * (grid_byte(grid, j) as i8 as f32 + delta);
                        }
                    }
                }
            }
        }
        GgufFormat::Iq4Nl => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                out[j] = d * KVALUES_IQ4NL[(b[2 + j] & 0xf) as usize] as f32;
                out[j + 16] = d * KVALUES_IQ4NL[(b[2 + j] >> 4) as usize] as f32;
            }
        }
        GgufFormat::Iq4Xs => {
            let d = f16_at(b, 0);
            let scales_h = u16_at(b, 2) as u32;
            let (scales_l, qs) = (&b[4..8], &b[8..136]);
            for ib in 0..8 {
                let ls = (scales_l[ib / 2] as u32 >> (4 * (ib % 2)) & 0xf)
                    | ((scales_h >> (2 * ib)) & 3) << 4;
                let dl = d * (ls as i32 - 32) as f32;
                for j in 0..16 {
                    out[32 * ib + j] = dl * KVALUES_IQ4NL[(qs[16 * ib + j] & 0xf) as usize] as f32;
                    out[32 * ib + j + 16] =
                        dl * KVALUES_IQ4NL[(qs[16 * ib + j] >> 4) as usize] as f32;
                }
            }
        }
        GgufFormat::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (scales, qs) = (&b[4..16], &b[16..144]);
            for sub in 0..8 {
                let (sc, m) = q4k_scale_min(scales, sub);
                let (d1, m1) = (d * sc as f32, dmin * m as f32);
                let bytes = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
                for (l, &byte) in bytes.iter().enumerate() {
                    out[32 * sub + l] = d1 * (byte >> (4 * (sub % 2)) & 0xf) as f32 - m1;
                }
            }
        }
        GgufFormat::Q2K => {
            let (scales, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for (v, value) in out.iter_mut().enumerate() {
                let (g, s, l) = (v / 128, v % 128 / 32, v % 32);
                let q = (qs[32 * g + l] >> (2 * s) & 3) as f32;
                let sc = scales[v / 16];
                let (dl, ml) = (d * (sc & 0xf) as f32, dmin * (sc >> 4) as f32);
                *value = dl * q - ml;
            }
        }
        GgufFormat::Q3K => {
            let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = f16_at(b, 108);
            for (v, value) in out.iter_mut().enumerate() {
                let (g, s, l) = (v / 128, v % 128 / 32, v % 32);
                let low = (qs[32 * g + l] >> (2 * s) & 3) as i32;
                let high = (hmask[l] >> (v / 32) & 1) as i32;
                let dl = d * q3k_scale(scales, v / 16) as f32;
                *value = dl * (low - 4 * (1 - high)) as f32;
            }
        }
        GgufFormat::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
            for sub in 0..8 {
                let (sc, m) = q4k_scale_min(scales, sub);
                let (d1, m1) = (d * sc as f32, dmin * m as f32);
                for l in 0..32 {
                    let low = qs[32 * (sub / 2) + l] >> (4 * (sub % 2)) & 0xf;
                    let q = low | (qh[l] >> sub & 1) << 4;
                    out[32 * sub + l] = d1 * q as f32 - m1;
                }
            }
        }
        GgufFormat::Q6K => {
            let d = f16_at(b, 208);
            for half in 0..2 {
                let (ql, qh) = (
                    &b[64 * half..64 * half + 64],
                    &b[128 + 32 * half..160 + 32 * half],
                );
                let sc = &b[192 + 8 * half..200 + 8 * half];
                for j in 0..4 {
                    for l in 0..32 {
                        // ggml's order: (d · sc) · q.
                        let scale = d * (sc[l / 16 + 2 * j] as i8) as f32;
                        out[128 * half + 32 * j + l] = scale * q6k_value(ql, qh, j, l) as f32;
                    }
                }
            }
        }
    }
}

/// Q3_K's signed 6-bit scale `i` (of 16) from its 12 bytes: the low nibble of byte `i % 8` (shifted by 4 for
/// `i >= 8`) with 2 bits of byte `8 + i % 4` (bits `2·(i / 4)`) above it, minus 32.
fn q3k_scale(scales: &[u8], i: usize) -> i32 {
    let low = scales[i % 8] >> (4 * (i / 8)) & 0xf;
    let high = scales[8 + i % 4] >> (2 * (i / 4)) & 3;
    (low | high << 4) as i32 - 32
}

/// Q6_K's 6-bit value `l + 32j` (j < 4) of the 128-value half whose 64 `ql` and 32 `qh` bytes are given (ggml's
/// `dequantize_row_q6_K`), minus 32.
fn q6k_value(ql: &[u8], qh: &[u8], j: usize, l: usize) -> i32 {
    let low = ql[l + 32 * (j % 2)] >> (4 * (j / 2)) & 0xf;
    let high = qh[l] >> (2 * j) & 3;
    (low | high << 4) as i32 - 32
}

/// Q4_K's scale and min of sub-block `sub` (ggml's `get_scale_min_k4`): 6 bits each, sub-blocks 0-3 in the low
/// bits of bytes `sub` and `sub + 4`, 4-7 in a nibble of byte `sub + 4` with the top bits of bytes `sub - 4` and
/// `sub`.
fn q4k_scale_min(q: &[u8], sub: usize) -> (u8, u8) {
    if sub < 4 {
        (q[sub] & 63, q[sub + 4] & 63)
    } else {
        (
            (q[sub + 4] & 0xf) | (q[sub - 4] >> 6) << 4,
            (q[sub + 4] >> 4) | (q[sub] >> 6) << 4,
        )
    }
}

/// Decodes `bytes` (whole blocks of `format`) into f32 values.
pub fn dequantize_bytes(format: GgufFormat, bytes: &[u8]) -> Vec<f32> {
    let (bb, bv) = (format.block_bytes(), format.block_values());
    let mut out = vec![0f32; bytes.len() / bb * bv];
    for (block, values) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bv)) {
        decode_block(format, block, values);
    }
    out
}

/// The whole weight in f32, `[out, in]`, on the CPU.
pub fn dequantize(w: &GgufWeight) -> Result<Tensor> {
    w.check()?;
    let (out, inp) = w.dims()?;
    let bytes = w
        .blocks
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<u8>()?;
    Ok(Tensor::from_vec(
        dequantize_bytes(w.format, &bytes),
        (out, inp),
        &Device::Cpu,
    )?)
}

/// `x` `[m, in]` times `Wᵀ` in f32 on the CPU.
pub fn gguf_matmul(x: &Tensor, w: &GgufWeight) -> Result<Tensor> {
    let dense = dequantize(w)?.to_device(x.device())?;
    Ok(x.to_dtype(DType::F32)?.matmul(&dense.t()?)?)
}
