//! glm5's plain CUDA kernels run on the CPU by glm5-kernels' emulator (feature `emu`; semantics in
//! `kernels/emu/cuda_emu.h`) against the ops' CPU references, launched with the grids and arguments the ops'
//! launchers use: the weight-only mat-vecs and dequantisers (FP8, NVFP4, every i-quant; the general and the
//! one-row kernels), and the MoE chain (routing, grouping, the gate/up and down mat-vecs over bf16/f32, FP8,
//! NVFP4 and i-quant experts, their one-token kernels, the per-token sum). Their indexing, decoding and
//! reductions are so checked in every CPU test run; a GPU is still needed for what the emulator cannot show
//! (nvcc's code, the memory model, speed), by the `*_cuda.rs` tests with the same comparisons. Every output
//! lands in memory filled with NaN bytes, each buffer ends at an inaccessible page (an overrun faults).

#[allow(dead_code)]
mod common;

use std::ffi::c_void;

use candle_core::{DType, Device, Tensor};
use common::quantized::{experts as quantized_experts, iq_blocks, Format};
use common::{rng, uniform};
use glm5_kernels::emu::{launch, DeviceBuffer, LaunchConfig};
use glm5_kernels::interface::weight_only::{DEQUANTIZE_THREADS, MAX_ROWS, WARPS};
use glm5_ops::iq_matmul::{self, IqFormat, IqWeight};
use glm5_ops::moe::{experts_reference, route_reference, QuantizedExperts, RouteRule, Routes};
use glm5_ops::{fp8_matmul, nvfp4_matmul};
use half::bf16;

/// The bytes NaN-filled outputs start as (f32 0xffffffff and bf16 0xffff are NaNs).
const NAN_BYTE: u8 = 0xff;

type Ptr = *const c_void;
type MutPtr = *mut c_void;

// ---- activations in either dtype ----------------------------------------------------------------------

/// Activations or outputs on the "device", f32 or bf16.
enum Values {
    F32(DeviceBuffer<f32>),
    Bf16(DeviceBuffer<bf16>),
}

impl Values {
    /// `values` in `dtype` (bf16 rounds them).
    fn from_f32(values: &[f32], dtype: DType) -> Self {
        match dtype {
            DType::F32 => Values::F32(DeviceBuffer::from_slice(values)),
            DType::BF16 => Values::Bf16(DeviceBuffer::from_slice(
                &values
                    .iter()
                    .map(|&v| bf16::from_f32(v))
                    .collect::<Vec<_>>(),
            )),
            other => panic!("no emulated kernels for {other:?}"),
        }
    }

    fn nan(len: usize, dtype: DType) -> Self {
        match dtype {
            DType::F32 => Values::F32(DeviceBuffer::poisoned(len, NAN_BYTE)),
            DType::BF16 => Values::Bf16(DeviceBuffer::poisoned(len, NAN_BYTE)),
            other => panic!("no emulated kernels for {other:?}"),
        }
    }

    fn ptr(&self) -> Ptr {
        match self {
            Values::F32(b) => b.ptr() as Ptr,
            Values::Bf16(b) => b.ptr() as Ptr,
        }
    }

    fn mut_ptr(&self) -> MutPtr {
        match self {
            Values::F32(b) => b.mut_ptr() as MutPtr,
            Values::Bf16(b) => b.mut_ptr() as MutPtr,
        }
    }

    fn to_f32(&self) -> Vec<f32> {
        match self {
            Values::F32(b) => b.to_vec(),
            Values::Bf16(b) => b.to_vec().iter().map(|v| v.to_f32()).collect(),
        }
    }
}

/// Index of a kernel's dtype instance in the tables below.
fn dtype_index(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 0,
        DType::BF16 => 1,
        other => panic!("no emulated kernels for {other:?}"),
    }
}

fn bytes_of(t: &Tensor) -> DeviceBuffer<u8> {
    DeviceBuffer::from_slice(&t.flatten_all().unwrap().to_vec1::<u8>().unwrap())
}

fn floats_of(t: &Tensor) -> DeviceBuffer<f32> {
    DeviceBuffer::from_slice(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
}

fn run<F: Fn()>(config: LaunchConfig, kernel: F) {
    launch(config, kernel).unwrap_or_else(|e| panic!("emulated launch failed: {e}"));
}

// ---- the weight-only kernels' launches, as `weight_only_cuda.rs` makes them ---------------------------

fn matvec_config(n: usize) -> LaunchConfig {
    LaunchConfig::new((n.div_ceil(WARPS) as u32, 1, 1), (WARPS * 32) as u32)
}

fn dequantize_config(items: usize) -> LaunchConfig {
    LaunchConfig::new(
        (
            items.div_ceil(DEQUANTIZE_THREADS).clamp(1, 65535 * 8) as u32,
            1,
            1,
        ),
        DEQUANTIZE_THREADS as u32,
    )
}

/// `got` `[m, n]` against `want` (f32 reference) with `magnitude` = Σ_k |x|·|W| per output: f32 outputs
/// within 1e-5 of the magnitude (only the order of f32 sums differs), bf16 also within the output's rounding.
fn assert_close(what: &str, got: &[f32], want: &[f32], magnitude: &[f32], dtype: DType) {
    assert_eq!(got.len(), want.len());
    for (i, ((g, w), mag)) in got.iter().zip(want).zip(magnitude).enumerate() {
        let rounding = if dtype == DType::BF16 {
            w.abs() / 256.0
        } else {
            0.0
        };
        let bound = 1e-5 * mag + rounding;
        assert!(
            (g - w).abs() <= bound,
            "{what}: output {i}: {g} vs the reference's {w} (bound {bound:.3e})"
        );
    }
}

/// The reference `x · Wᵀ` and Σ|x|·|W|, from the dequantised `w` `[n, k]`.
fn reference_product(x: &[f32], (m, k): (usize, usize), w: &Tensor) -> (Vec<f32>, Vec<f32>) {
    let x = Tensor::from_slice(x, (m, k), &Device::Cpu).unwrap();
    let w = w.to_dtype(DType::F32).unwrap();
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (
        flat(x.matmul(&w.t().unwrap()).unwrap()),
        flat(
            x.abs()
                .unwrap()
                .matmul(&w.abs().unwrap().t().unwrap())
                .unwrap(),
        ),
    )
}

/// Random activations as the kernel reads them (bf16 rounded for bf16).
fn activations(seed: u64, len: usize, dtype: DType) -> Vec<f32> {
    uniform(&mut rng(seed), len)
        .into_iter()
        .map(|v| {
            if dtype == DType::BF16 {
                bf16::from_f32(v).to_f32()
            } else {
                v
            }
        })
        .collect()
}

/// The row counts each mat-vec is checked at: the one-row kernel (m = 1), and the general one at 1, a few
/// and MAX_ROWS rows.
fn row_counts() -> [(usize, bool); 4] {
    [(1, true), (1, false), (5, false), (MAX_ROWS, false)]
}

// ---- i-quants ------------------------------------------------------------------------------------------

type IqMatvec = unsafe extern "C" fn(Ptr, *const u8, MutPtr, i32, i32, i32);
type IqDequantize = unsafe extern "C" fn(*const u8, MutPtr, i32, i32);

struct IqKernels {
    matvec: [IqMatvec; 2],
    matvec_r1: [IqMatvec; 2],
    dequantize: [IqDequantize; 2],
}

macro_rules! iq_kernels {
    ($($variant:ident => $name:ident),* $(,)?) => { paste::paste! {
        extern "C" {
            $(
                fn [<iq_matvec_ $name _f32>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32);
                fn [<iq_matvec_ $name _bf16>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32);
                fn [<iq_matvec_r1_ $name _f32>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32);
                fn [<iq_matvec_r1_ $name _bf16>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32);
                fn [<iq_dequantize_ $name _f32>](w: *const u8, out: MutPtr, n: i32, k: i32);
                fn [<iq_dequantize_ $name _bf16>](w: *const u8, out: MutPtr, n: i32, k: i32);
            )*
        }
        fn iq_kernels(format: IqFormat) -> IqKernels {
            match format {
                $(IqFormat::$variant => IqKernels {
                    matvec: [[<iq_matvec_ $name _f32>], [<iq_matvec_ $name _bf16>]],
                    matvec_r1: [[<iq_matvec_r1_ $name _f32>], [<iq_matvec_r1_ $name _bf16>]],
                    dequantize: [[<iq_dequantize_ $name _f32>], [<iq_dequantize_ $name _bf16>]],
                },)*
            }
        }
    }};
}

iq_kernels! {
    Iq2Xxs => iq2_xxs, Iq2Xs => iq2_xs, Iq2S => iq2_s, Iq3Xxs => iq3_xxs, Iq3S => iq3_s,
    Iq1S => iq1_s, Iq1M => iq1_m, Iq4Nl => iq4_nl, Iq4Xs => iq4_xs,
}

#[test]
fn iq_kernels_equal_the_reference() {
    // 13 columns (not a multiple of a block's WARPS), and rows of fewer and of more sub-blocks than the 32
    // lanes of a warp.
    let n = 13;
    for (fi, format) in IqFormat::ALL.into_iter().enumerate() {
        let kernels = iq_kernels(format);
        for k in [3 * 256, 5 * 256] {
            let blocks = iq_blocks(&mut rng(4700 + fi as u64), format, n, k);
            let w = IqWeight::new(format, blocks.clone(), k).unwrap();
            let dense = iq_matmul::reference::dequantize(&w).unwrap();
            let dense_values = dense.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let device_blocks = bytes_of(&blocks);
            for dtype in [DType::F32, DType::BF16] {
                let d = dtype_index(dtype);
                // Dequantised: the reference's values bit for bit (bf16: their rounding).
                let out = Values::nan(n * k, dtype);
                let f = kernels.dequantize[d];
                run(dequantize_config(n * k / 32), || unsafe {
                    f(device_blocks.ptr(), out.mut_ptr(), n as i32, k as i32)
                });
                for (i, (g, w)) in out.to_f32().iter().zip(&dense_values).enumerate() {
                    let w = if dtype == DType::BF16 {
                        bf16::from_f32(*w).to_f32()
                    } else {
                        *w
                    };
                    assert!(
                        g.to_bits() == w.to_bits() || (*g == 0.0 && w == 0.0),
                        "{format} {dtype:?} k={k}: dequantised value {i} is {g}, the reference's {w}"
                    );
                }
                for (m, one_row) in row_counts() {
                    let x = activations(4710 + m as u64, m * k, dtype);
                    let (want, magnitude) = reference_product(&x, (m, k), &dense);
                    let device_x = Values::from_f32(&x, dtype);
                    let y = Values::nan(m * n, dtype);
                    let f = if one_row {
                        kernels.matvec_r1[d]
                    } else {
                        kernels.matvec[d]
                    };
                    run(matvec_config(n), || unsafe {
                        f(
                            device_x.ptr(),
                            device_blocks.ptr(),
                            y.mut_ptr(),
                            m as i32,
                            n as i32,
                            k as i32,
                        )
                    });
                    assert_close(
                        &format!("{format} {dtype:?} k={k} m={m} one_row={one_row}"),
                        &y.to_f32(),
                        &want,
                        &magnitude,
                        dtype,
                    );
                }
            }
        }
    }
}

// ---- FP8 and NVFP4 -------------------------------------------------------------------------------------

type Fp8Matvec = unsafe extern "C" fn(Ptr, *const u8, *const f32, MutPtr, i32, i32, i32, i32, i32);
type Fp8Dequantize = unsafe extern "C" fn(*const u8, *const f32, MutPtr, i32, i32, i32, i32);
type Nvfp4Matvec = unsafe extern "C" fn(Ptr, *const u8, *const u8, f32, MutPtr, i32, i32, i32);
type Nvfp4Dequantize = unsafe extern "C" fn(*const u8, *const u8, f32, MutPtr, i32, i32);

extern "C" {
    fn fp8_matvec_f32(
        x: Ptr,
        w: *const u8,
        s: *const f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
    );
    fn fp8_matvec_bf16(
        x: Ptr,
        w: *const u8,
        s: *const f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
    );
    fn fp8_matvec_r1_f32(
        x: Ptr,
        w: *const u8,
        s: *const f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
    );
    fn fp8_matvec_r1_bf16(
        x: Ptr,
        w: *const u8,
        s: *const f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
    );
    fn fp8_dequantize_f32(
        w: *const u8,
        s: *const f32,
        out: MutPtr,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
    );
    fn fp8_dequantize_bf16(
        w: *const u8,
        s: *const f32,
        out: MutPtr,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
    );
    fn nvfp4_matvec_f32(
        x: Ptr,
        p: *const u8,
        s: *const u8,
        g: f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
    );
    fn nvfp4_matvec_bf16(
        x: Ptr,
        p: *const u8,
        s: *const u8,
        g: f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
    );
    fn nvfp4_matvec_r1_f32(
        x: Ptr,
        p: *const u8,
        s: *const u8,
        g: f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
    );
    fn nvfp4_matvec_r1_bf16(
        x: Ptr,
        p: *const u8,
        s: *const u8,
        g: f32,
        y: MutPtr,
        m: i32,
        n: i32,
        k: i32,
    );
    fn nvfp4_dequantize_f32(p: *const u8, s: *const u8, g: f32, out: MutPtr, n: i32, k: i32);
    fn nvfp4_dequantize_bf16(p: *const u8, s: *const u8, g: f32, out: MutPtr, n: i32, k: i32);
}

const FP8_MATVEC: [Fp8Matvec; 2] = [fp8_matvec_f32, fp8_matvec_bf16];
const FP8_MATVEC_R1: [Fp8Matvec; 2] = [fp8_matvec_r1_f32, fp8_matvec_r1_bf16];
const FP8_DEQUANTIZE: [Fp8Dequantize; 2] = [fp8_dequantize_f32, fp8_dequantize_bf16];
const NVFP4_MATVEC: [Nvfp4Matvec; 2] = [nvfp4_matvec_f32, nvfp4_matvec_bf16];
const NVFP4_MATVEC_R1: [Nvfp4Matvec; 2] = [nvfp4_matvec_r1_f32, nvfp4_matvec_r1_bf16];
const NVFP4_DEQUANTIZE: [Nvfp4Dequantize; 2] = [nvfp4_dequantize_f32, nvfp4_dequantize_bf16];

/// The dequantised values equal `dense` (the reference's, in f32) bit for bit, or its bf16 rounding.
fn assert_dequantized(what: &str, got: &[f32], dense: &Tensor, dtype: DType) {
    let want = dense.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let w = if dtype == DType::BF16 {
            bf16::from_f32(*w).to_f32()
        } else {
            *w
        };
        assert!(
            g.to_bits() == w.to_bits() || (*g == 0.0 && w == 0.0),
            "{what}: dequantised value {i} is {g}, the reference's {w}"
        );
    }
}

#[test]
fn fp8_kernels_equal_the_reference() {
    // GLM-5-FP8's 128x128 blocks with a partial last block row (13 of 128) and column (656 = 5 blocks + 16),
    // and small blocks that split a warp's 512 weights.
    for (seed, (n, k), block) in [
        (4720, (13, 656), [128, 128]),
        (4721, (21, 1056), [8, 32]),
        (4722, (37, 160), [16, 48]),
    ] {
        let w = common::quantized::fp8(&mut rng(seed), n, k, block);
        let dense = fp8_matmul::reference::dequantize(&w).unwrap();
        let (bytes, scales) = (bytes_of(&w.weight), floats_of(&w.scale_inv));
        let (bn, bk) = (block[0] as i32, block[1] as i32);
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let out = Values::nan(n * k, dtype);
            let f = FP8_DEQUANTIZE[d];
            run(dequantize_config(n * k), || unsafe {
                f(
                    bytes.ptr(),
                    scales.ptr(),
                    out.mut_ptr(),
                    n as i32,
                    k as i32,
                    bn,
                    bk,
                )
            });
            assert_dequantized(
                &format!("fp8 {block:?} {dtype:?}"),
                &out.to_f32(),
                &dense,
                dtype,
            );
            for (m, one_row) in row_counts() {
                let x = activations(seed + m as u64, m * k, dtype);
                let (want, magnitude) = reference_product(&x, (m, k), &dense);
                let device_x = Values::from_f32(&x, dtype);
                let y = Values::nan(m * n, dtype);
                let f = if one_row {
                    FP8_MATVEC_R1[d]
                } else {
                    FP8_MATVEC[d]
                };
                run(matvec_config(n), || unsafe {
                    f(
                        device_x.ptr(),
                        bytes.ptr(),
                        scales.ptr(),
                        y.mut_ptr(),
                        m as i32,
                        n as i32,
                        k as i32,
                        bn,
                        bk,
                    )
                });
                assert_close(
                    &format!("fp8 {block:?} {dtype:?} m={m} one_row={one_row}"),
                    &y.to_f32(),
                    &want,
                    &magnitude,
                    dtype,
                );
            }
        }
    }
}

#[test]
fn nvfp4_kernels_equal_the_reference() {
    // Rows of fewer 16-value groups than a warp has lanes (160), of one partial unrolled pass (1024) and of
    // several (8224).
    for (seed, (n, k)) in [(4730, (13, 160)), (4731, (9, 1024)), (4732, (5, 8224))] {
        let w = common::quantized::nvfp4(&mut rng(seed), n, k);
        let dense = nvfp4_matmul::reference::dequantize(&w).unwrap();
        let (packed, scales) = (bytes_of(&w.packed), bytes_of(&w.scales));
        let global = w.global_scale;
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let out = Values::nan(n * k, dtype);
            let f = NVFP4_DEQUANTIZE[d];
            run(dequantize_config(n * k), || unsafe {
                f(
                    packed.ptr(),
                    scales.ptr(),
                    global,
                    out.mut_ptr(),
                    n as i32,
                    k as i32,
                )
            });
            assert_dequantized(
                &format!("nvfp4 k={k} {dtype:?}"),
                &out.to_f32(),
                &dense,
                dtype,
            );
            for (m, one_row) in row_counts() {
                let x = activations(seed + m as u64, m * k, dtype);
                let (want, magnitude) = reference_product(&x, (m, k), &dense);
                let device_x = Values::from_f32(&x, dtype);
                let y = Values::nan(m * n, dtype);
                let f = if one_row {
                    NVFP4_MATVEC_R1[d]
                } else {
                    NVFP4_MATVEC[d]
                };
                run(matvec_config(n), || unsafe {
                    f(
                        device_x.ptr(),
                        packed.ptr(),
                        scales.ptr(),
                        global,
                        y.mut_ptr(),
                        m as i32,
                        n as i32,
                        k as i32,
                    )
                });
                assert_close(
                    &format!("nvfp4 k={k} {dtype:?} m={m} one_row={one_row}"),
                    &y.to_f32(),
                    &want,
                    &magnitude,
                    dtype,
                );
            }
        }
    }
}
