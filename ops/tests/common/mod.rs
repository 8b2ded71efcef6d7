//! Helpers shared by the op tests: seeded random data and tensor construction.

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in [-1, 1).
pub fn uniform(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// Fills and frees `bytes` of NaN on `device`, so that the caching allocator's next allocations there start out
/// as NaN (the GPU tests' poisoned outputs).
#[allow(dead_code)] // each test binary uses part of it
pub fn poison(device: &Device, bytes: usize) {
    let nan = Tensor::full(f32::NAN, bytes / 4, device).unwrap();
    device.synchronize().unwrap();
    drop(nan);
}

/// A CPU tensor of `dtype` holding `data` (f32) in `shape`.
pub fn tensor(data: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_slice(data, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("test tensor")
}

/// Routing rules the route tests run, with their expert counts: GLM-5's (one group, 8 of 256, scaled 2.5), a
/// grouped one of DeepSeek-V3's shape, and 160 experts in 16 groups without normalisation.
#[allow(dead_code)] // each test binary uses part of it
pub fn route_rules() -> Vec<(usize, glm5_ops::moe::RouteRule)> {
    use glm5_ops::moe::RouteRule;
    vec![
        (
            256,
            RouteRule {
                n_group: 1,
                topk_group: 1,
                top_k: 8,
                normalise: true,
                scaling: 2.5,
            },
        ),
        (
            256,
            RouteRule {
                n_group: 8,
                topk_group: 4,
                top_k: 8,
                normalise: true,
                scaling: 2.5,
            },
        ),
        (
            160,
            RouteRule {
                n_group: 16,
                topk_group: 3,
                top_k: 6,
                normalise: false,
                scaling: 1.0,
            },
        ),
        // More picks than a warp has experts, the last warp part-filled.
        (
            100,
            RouteRule {
                n_group: 1,
                topk_group: 1,
                top_k: 40,
                normalise: true,
                scaling: 1.0,
            },
        ),
    ]
}

/// `x` as the one-row Q4_K CUDA kernel multiplies it (`gguf_matmul`'s contract): each 32 values quantised to int8
/// as llama.cpp's q8_1 (d = max |x| / 127, q = x / d rounded half to even), then d·q.
#[allow(dead_code)] // each test binary uses part of it
pub fn q8_1_quantized(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|sub| {
            let d = sub.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            sub.iter()
                .map(move |v| (v * id).round_ties_even() * d)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Random experts kept quantised, stacked, with their dequantised f32 copies (`gate_up` `[E, 2I, H]`,
/// `down` `[E, H, I]`), built on the CPU from random codes: FP8 e4m3 bytes (never the NaN codes 0x7f /
/// 0xff) under random block multipliers, or NVFP4 codes under random e4m3 group scales (exponents 5-8) and a
/// random global scale per part.
#[allow(dead_code)] // each test binary uses part of it
pub mod quantized {
    use super::*;
    use glm5_ops::fp8_matmul::{self, Fp8BlockWeight};
    use glm5_ops::gguf_matmul::{self, GgufFormat};
    use glm5_ops::moe::{QuantizedExperts, StackedFp8, StackedGgufBlocks, StackedNvfp4};
    use glm5_ops::nvfp4_matmul::{self, Nvfp4Weight};

    pub enum Format {
        Fp8 {
            block: [usize; 2],
        },
        Nvfp4,
        /// GGUF i-quants: gate and up in one format, down in another.
        GgufBlocks {
            gate_up: GgufFormat,
            down: GgufFormat,
        },
    }

    /// Random blocks of `format`, `U8 [rows, row bytes]` on the CPU, each block's f16 scale set (at byte 0, or
    /// over IQ1_M's sub-scale words) so values stay O(1e-1).
    pub fn gguf_blocks(rng: &mut StdRng, format: GgufFormat, rows: usize, k: usize) -> Tensor {
        let row = format.row_bytes(k).expect("whole blocks");
        let mut bytes: Vec<u8> = (0..rows * row).map(|_| rng.random()).collect();
        for block in bytes.chunks_exact_mut(format.block_bytes()) {
            let d = half::f16::from_f32(rng.random_range(0.5..1.5) / 256.0).to_bits();
            format.set_super_scale(block, d);
            // dmin (Q2_K, Q4_K, Q5_K): a min of up to 63·dmin against values up to 15·63·d.
            let dmin = half::f16::from_f32(rng.random_range(0.5..1.5) / 128.0).to_bits();
            format.set_min_scale(block, dmin);
        }
        Tensor::from_vec(bytes, (rows, row), &Device::Cpu).unwrap()
    }

    pub fn fp8(rng: &mut StdRng, out: usize, inp: usize, block: [usize; 2]) -> Fp8BlockWeight {
        let bytes: Vec<u8> = (0..out * inp)
            .map(|_| rng.random_range(0u8..0x7f) | if rng.random() { 0x80 } else { 0 })
            .collect();
        let blocks = (out.div_ceil(block[0]), inp.div_ceil(block[1]));
        let scales: Vec<f32> = (0..blocks.0 * blocks.1)
            .map(|_| rng.random_range(0.5..1.5) * 0.01)
            .collect();
        Fp8BlockWeight {
            weight: Tensor::from_vec(bytes, (out, inp), &Device::Cpu).unwrap(),
            scale_inv: Tensor::from_vec(scales, blocks, &Device::Cpu).unwrap(),
            block,
        }
    }

    pub fn nvfp4(rng: &mut StdRng, out: usize, inp: usize) -> Nvfp4Weight {
        let packed: Vec<u8> = (0..out * inp / 2).map(|_| rng.random()).collect();
        // e4m3 exponent field 5..=8: scales 2^-2 .. 2^1.9.
        let scales: Vec<u8> = (0..out * inp / 16)
            .map(|_| (rng.random_range(5u8..=8) << 3) | rng.random_range(0u8..8))
            .collect();
        Nvfp4Weight {
            packed: Tensor::from_vec(packed, (out, inp / 2), &Device::Cpu).unwrap(),
            scales: Tensor::from_vec(scales, (out, inp / 16), &Device::Cpu).unwrap(),
            global_scale: rng.random_range(0.5..1.5) * 0.01,
        }
    }

    /// `(stacked on `device`, dense f32 gate_up, dense f32 down)` for `n_experts` experts.
    pub fn experts(
        rng: &mut StdRng,
        format: &Format,
        (n_experts, hidden, inter): (usize, usize, usize),
        device: &Device,
    ) -> (QuantizedExperts, Tensor, Tensor) {
        let cat = |a: Tensor, b: Tensor| Tensor::cat(&[a, b], 0).unwrap();
        let stack = |v: Vec<Tensor>| Tensor::stack(&v, 0).unwrap();
        match format {
            Format::Fp8 { block } => {
                let parts: Vec<[Fp8BlockWeight; 3]> = (0..n_experts)
                    .map(|_| {
                        [
                            fp8(rng, inter, hidden, *block),
                            fp8(rng, inter, hidden, *block),
                            fp8(rng, hidden, inter, *block),
                        ]
                    })
                    .collect();
                let dense = |w: &Fp8BlockWeight| fp8_matmul::reference::dequantize(w).unwrap();
                let gate_up = stack(
                    parts
                        .iter()
                        .map(|p| cat(dense(&p[0]), dense(&p[1])))
                        .collect(),
                );
                let down = stack(parts.iter().map(|p| dense(&p[2])).collect());
                let moved: Vec<Vec<Fp8BlockWeight>> = parts
                    .iter()
                    .map(|p| {
                        p.iter()
                            .map(|w| Fp8BlockWeight {
                                weight: w.weight.to_device(device).unwrap(),
                                scale_inv: w.scale_inv.to_device(device).unwrap(),
                                block: w.block,
                            })
                            .collect()
                    })
                    .collect();
                let gu: Vec<Vec<&Fp8BlockWeight>> =
                    moved.iter().map(|p| vec![&p[0], &p[1]]).collect();
                let dn: Vec<Vec<&Fp8BlockWeight>> = moved.iter().map(|p| vec![&p[2]]).collect();
                let weights = QuantizedExperts::Fp8 {
                    gate_up: StackedFp8::stack(&gu).unwrap(),
                    down: StackedFp8::stack(&dn).unwrap(),
                };
                (weights, gate_up, down)
            }
            Format::Nvfp4 => {
                let parts: Vec<[Nvfp4Weight; 3]> = (0..n_experts)
                    .map(|_| {
                        [
                            nvfp4(rng, inter, hidden),
                            nvfp4(rng, inter, hidden),
                            nvfp4(rng, hidden, inter),
                        ]
                    })
                    .collect();
                let dense = |w: &Nvfp4Weight| nvfp4_matmul::reference::dequantize(w).unwrap();
                let gate_up = stack(
                    parts
                        .iter()
                        .map(|p| cat(dense(&p[0]), dense(&p[1])))
                        .collect(),
                );
                let down = stack(parts.iter().map(|p| dense(&p[2])).collect());
                let moved: Vec<Vec<Nvfp4Weight>> = parts
                    .iter()
                    .map(|p| {
                        p.iter()
                            .map(|w| Nvfp4Weight {
                                packed: w.packed.to_device(device).unwrap(),
                                scales: w.scales.to_device(device).unwrap(),
                                global_scale: w.global_scale,
                            })
                            .collect()
                    })
                    .collect();
                let gu: Vec<Vec<&Nvfp4Weight>> = moved.iter().map(|p| vec![&p[0], &p[1]]).collect();
                let dn: Vec<Vec<&Nvfp4Weight>> = moved.iter().map(|p| vec![&p[2]]).collect();
                let weights = QuantizedExperts::Nvfp4 {
                    gate_up: StackedNvfp4::stack(&gu).unwrap(),
                    down: StackedNvfp4::stack(&dn).unwrap(),
                };
                (weights, gate_up, down)
            }
            Format::GgufBlocks {
                gate_up: gu_format,
                down: down_format,
            } => {
                let mut stacked = |format: GgufFormat, rows: usize, k: usize| {
                    let blocks = gguf_blocks(rng, format, n_experts * rows, k);
                    let bytes = blocks.dim(1).unwrap();
                    StackedGgufBlocks::new(
                        format,
                        blocks.reshape((n_experts, rows, bytes)).unwrap(),
                        k,
                    )
                    .unwrap()
                };
                let (gate, up, down_w) = (
                    stacked(*gu_format, inter, hidden),
                    stacked(*gu_format, inter, hidden),
                    stacked(*down_format, hidden, inter),
                );
                let dense = |w: &StackedGgufBlocks, e: usize| {
                    let expert =
                        gguf_matmul::GgufWeight::new(w.format, w.blocks.get(e).unwrap(), w.k)
                            .unwrap();
                    gguf_matmul::reference::dequantize(&expert).unwrap()
                };
                let gate_up = stack(
                    (0..n_experts)
                        .map(|e| cat(dense(&gate, e), dense(&up, e)))
                        .collect(),
                );
                let down = stack((0..n_experts).map(|e| dense(&down_w, e)).collect());
                let moved = |w: StackedGgufBlocks| {
                    StackedGgufBlocks::new(w.format, w.blocks.to_device(device).unwrap(), w.k)
                        .unwrap()
                };
                let weights = QuantizedExperts::GgufBlocks {
                    gate: moved(gate),
                    up: moved(up),
                    down: moved(down_w),
                };
                (weights, gate_up, down)
            }
        }
    }
}
