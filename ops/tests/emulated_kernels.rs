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
use common::quantized::{experts as quantized_experts, gguf_blocks, Format};
use common::{rng, uniform};
use glm5_kernels::emu::{launch, DeviceBuffer, LaunchConfig};
use glm5_kernels::interface::weight_only::{
    column_warps, q4k_mma_warps, q4k_row_staged_bytes, tile_loop_blocks, DEQUANTIZE_THREADS,
    MAX_ROWS, Q4K_MMA_ROW_TILE, WARPS,
};
use glm5_ops::gguf_matmul::{self, GgufFormat, GgufWeight};
use glm5_ops::moe::{experts_reference, route_reference, QuantizedExperts, Routes};
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

/// `t`'s values as f32, in order.
fn host_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

fn floats_of(t: &Tensor) -> DeviceBuffer<f32> {
    DeviceBuffer::from_slice(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
}

fn run<F: Fn()>(config: LaunchConfig, kernel: F) {
    launch(config, kernel).unwrap_or_else(|e| panic!("emulated launch failed: {e}"));
}

// ---- the weight-only kernels' launches, as `weight_only_cuda.rs` makes them ---------------------------

/// The launch of a mat-vec of `n` columns whose rows hold `chunks` chunks, and its `column_warps` argument.
fn matvec_config(n: usize, chunks: usize) -> (LaunchConfig, i32) {
    let warps = column_warps(chunks);
    (
        LaunchConfig::new(
            (n.div_ceil(WARPS / warps) as u32, 1, 1),
            (WARPS * 32) as u32,
        ),
        warps as i32,
    )
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
    (
        host_f32(&x.matmul(&w.t().unwrap()).unwrap()),
        host_f32(
            &x.abs()
                .unwrap()
                .matmul(&w.abs().unwrap().t().unwrap())
                .unwrap(),
        ),
    )
}

/// Random activations as the kernel reads them (bf16 rounded for bf16).
fn activations(seed: u64, len: usize, dtype: DType) -> Vec<f32> {
    activations_like(&uniform(&mut rng(seed), len), dtype)
}

/// `values` as a `dtype` tensor holds them (bf16 rounded).
fn activations_like(values: &[f32], dtype: DType) -> Vec<f32> {
    values
        .iter()
        .map(|&v| {
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

type IqMatvec = unsafe extern "C" fn(Ptr, *const u8, MutPtr, i32, i32, i32, i32);
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
                fn [<gguf_matvec_ $name _f32>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32, column_warps: i32);
                fn [<gguf_matvec_ $name _bf16>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32, column_warps: i32);
                fn [<gguf_matvec_r1_ $name _f32>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32, column_warps: i32);
                fn [<gguf_matvec_r1_ $name _bf16>](x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32, column_warps: i32);
                fn [<gguf_dequantize_ $name _f32>](w: *const u8, out: MutPtr, n: i32, k: i32);
                fn [<gguf_dequantize_ $name _bf16>](w: *const u8, out: MutPtr, n: i32, k: i32);
            )*
        }
        fn iq_kernels(format: GgufFormat) -> IqKernels {
            match format {
                $(GgufFormat::$variant => IqKernels {
                    matvec: [[<gguf_matvec_ $name _f32>], [<gguf_matvec_ $name _bf16>]],
                    matvec_r1: [[<gguf_matvec_r1_ $name _f32>], [<gguf_matvec_r1_ $name _bf16>]],
                    dequantize: [[<gguf_dequantize_ $name _f32>], [<gguf_dequantize_ $name _bf16>]],
                },)*
            }
        }
    }};
}

iq_kernels! {
    Iq2Xxs => iq2_xxs, Iq2Xs => iq2_xs, Iq2S => iq2_s, Iq3Xxs => iq3_xxs, Iq3S => iq3_s,
    Iq1S => iq1_s, Iq1M => iq1_m, Iq4Nl => iq4_nl, Iq4Xs => iq4_xs, Q4K => q4_k, Q6K => q6_k, Q2K => q2_k, Q3K => q3_k,
    Q5K => q5_k,
}

#[test]
fn gguf_block_kernels_equal_the_reference() {
    // 13 columns (not a multiple of a block's WARPS), and rows of fewer and of more sub-blocks than the 32
    // lanes of a warp, and long enough for 2 warps a column (4096: 128 sub-blocks).
    let n = 13;
    for (fi, format) in GgufFormat::ALL.into_iter().enumerate() {
        let kernels = iq_kernels(format);
        for k in [3 * 256, 5 * 256, 16 * 256] {
            let blocks = gguf_blocks(&mut rng(4700 + fi as u64), format, n, k);
            let w = GgufWeight::new(format, blocks.clone(), k).unwrap();
            let dense = gguf_matmul::reference::dequantize(&w).unwrap();
            let device_blocks = bytes_of(&blocks);
            check_weight_only_kernels(
                &format!("{format} k={k}"),
                (n, k),
                &dense,
                4710,
                &|dtype, out| {
                    let f = kernels.dequantize[dtype_index(dtype)];
                    run(dequantize_config(n * k / 32), || unsafe {
                        f(device_blocks.ptr(), out, n as i32, k as i32)
                    });
                },
                &|dtype, one_row, x, y, m| {
                    let d = dtype_index(dtype);
                    let f = if one_row {
                        kernels.matvec_r1[d]
                    } else {
                        kernels.matvec[d]
                    };
                    let (config, warps) = matvec_config(n, k / 16);
                    run(config, || unsafe {
                        f(
                            x,
                            device_blocks.ptr(),
                            y,
                            m as i32,
                            n as i32,
                            k as i32,
                            warps,
                        )
                    });
                },
            );
        }
    }
}

// ---- Q4_K on the tensor cores --------------------------------------------------------------------------

use glm5_kernels::interface::Q4kRowParams;

extern "C" {
    fn q4k_mma_matvec8_bf16(x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32);
    fn q4k_mma_matvec16_bf16(x: Ptr, w: *const u8, y: MutPtr, m: i32, n: i32, k: i32);
    fn q4k_mma_matvec1_bf16(p: Q4kRowParams);
}

#[test]
fn tile_loop_blocks_take_every_tile_in_one_wave() {
    // Every tile taken, no more blocks than the device holds (or than tiles), every block with a tile, and
    // the fewest tiles a block one wave allows.
    for resident in 1..40 {
        for tiles in 1..300 {
            let blocks = tile_loop_blocks(tiles, resident);
            let per_block = tiles.div_ceil(blocks);
            assert!(
                blocks <= resident.min(tiles),
                "{tiles} tiles on {resident}: {blocks}"
            );
            assert_eq!(
                per_block,
                tiles.div_ceil(resident),
                "{tiles} tiles on {resident}"
            );
            assert!(
                (blocks - 1) * per_block < tiles,
                "{tiles} tiles on {resident}: an idle block"
            );
        }
    }
    assert_eq!(
        tile_loop_blocks(7, 0),
        7,
        "no occupancy answer: a block a tile"
    );
}

#[test]
fn q4k_mma_matvec1_equals_the_reference() {
    // One activation row: 37 rows (a partial last tile of 16) and 117 (8 tiles); rows of 1 block (one warp), 5
    // (three warps, the first two blocks each, ahead of use) and 40 (the most warps, five blocks each); the
    // activations as the launcher stages them (k bf16 values of dynamic shared memory); a block a tile, and
    // on a device that holds three blocks at once (blocks of 3, 3 and 2 tiles).
    for (n, resident, k) in [
        (37, 64, 256),
        (37, 64, 5 * 256),
        (37, 64, 40 * 256),
        (117, 3, 5 * 256),
    ] {
        let blocks = gguf_blocks(&mut rng(4890 + k as u64), GgufFormat::Q4K, n, k);
        let w = GgufWeight::new(GgufFormat::Q4K, blocks.clone(), k).unwrap();
        let dense = gguf_matmul::reference::dequantize(&w).unwrap();
        let device_blocks = bytes_of(&blocks);
        let warps = q4k_mma_warps(k);
        let config = LaunchConfig {
            shared_bytes: q4k_row_staged_bytes(k),
            ..LaunchConfig::new(
                (
                    tile_loop_blocks(n.div_ceil(Q4K_MMA_ROW_TILE), resident) as u32,
                    1,
                    1,
                ),
                (warps * 32) as u32,
            )
        };
        let x = activations(4895 + k as u64, k, DType::BF16);
        let (want, magnitude) = reference_product(&common::q8_1_quantized(&x), (1, k), &dense);
        let device_x = Values::from_f32(&x, DType::BF16);
        let y = Values::nan(n, DType::BF16);
        run(config, || unsafe {
            q4k_mma_matvec1_bf16(Q4kRowParams {
                x: device_x.ptr() as u64,
                w: device_blocks.ptr() as u64,
                y: y.mut_ptr() as u64,
                n: n as i32,
                k: k as i32,
            })
        });
        assert_close(
            &format!("Q4_K one-row mma n={n} k={k}"),
            &y.to_f32(),
            &want,
            &magnitude,
            DType::BF16,
        );
    }
}

#[test]
fn q4k_mma_matvec_equals_the_reference() {
    // 37 rows (a partial last tile of 16); rows of 1 block (one warp), 5 (three warps, one with a partial
    // pair of blocks) and 40 (the most warps, five blocks each); every activation row count of both kernels.
    let n = 37;
    for k in [256, 5 * 256, 40 * 256] {
        let blocks = gguf_blocks(&mut rng(4790 + k as u64), GgufFormat::Q4K, n, k);
        let w = GgufWeight::new(GgufFormat::Q4K, blocks.clone(), k).unwrap();
        let dense = gguf_matmul::reference::dequantize(&w).unwrap();
        let device_blocks = bytes_of(&blocks);
        let warps = q4k_mma_warps(k);
        let config = LaunchConfig::new(
            (n.div_ceil(Q4K_MMA_ROW_TILE) as u32, 1, 1),
            (warps * 32) as u32,
        );
        for m in [1, 3, 8, 9, 16] {
            let x = activations(4795 + m as u64, m * k, DType::BF16);
            let (want, magnitude) = reference_product(&x, (m, k), &dense);
            let device_x = Values::from_f32(&x, DType::BF16);
            let y = Values::nan(m * n, DType::BF16);
            let f = if m <= 8 {
                q4k_mma_matvec8_bf16
            } else {
                q4k_mma_matvec16_bf16
            };
            run(config, || unsafe {
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
                &format!("Q4_K mma k={k} m={m}"),
                &y.to_f32(),
                &want,
                &magnitude,
                DType::BF16,
            );
        }
    }
}

// ---- FP8 and NVFP4 -------------------------------------------------------------------------------------

type Fp8Matvec =
    unsafe extern "C" fn(Ptr, *const u8, *const f32, MutPtr, i32, i32, i32, i32, i32, i32);
type Fp8Dequantize = unsafe extern "C" fn(*const u8, *const f32, MutPtr, i32, i32, i32, i32, i32);
type Nvfp4Matvec = unsafe extern "C" fn(Ptr, *const u8, *const u8, f32, MutPtr, i32, i32, i32, i32);
type Nvfp4Dequantize = unsafe extern "C" fn(*const u8, *const u8, f32, MutPtr, i32, i32, i32);

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
        column_warps: i32,
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
        column_warps: i32,
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
        column_warps: i32,
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
        column_warps: i32,
    );
    fn fp8_dequantize_f32(
        w: *const u8,
        s: *const f32,
        out: MutPtr,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
        vectors: i32,
    );
    fn fp8_dequantize_bf16(
        w: *const u8,
        s: *const f32,
        out: MutPtr,
        n: i32,
        k: i32,
        bn: i32,
        bk: i32,
        vectors: i32,
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
        column_warps: i32,
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
        column_warps: i32,
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
        column_warps: i32,
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
        column_warps: i32,
    );
    fn nvfp4_dequantize_f32(
        p: *const u8,
        s: *const u8,
        g: f32,
        out: MutPtr,
        n: i32,
        k: i32,
        v: i32,
    );
    fn nvfp4_dequantize_bf16(
        p: *const u8,
        s: *const u8,
        g: f32,
        out: MutPtr,
        n: i32,
        k: i32,
        v: i32,
    );
}

const FP8_MATVEC: [Fp8Matvec; 2] = [fp8_matvec_f32, fp8_matvec_bf16];
const FP8_MATVEC_R1: [Fp8Matvec; 2] = [fp8_matvec_r1_f32, fp8_matvec_r1_bf16];
const FP8_DEQUANTIZE: [Fp8Dequantize; 2] = [fp8_dequantize_f32, fp8_dequantize_bf16];
const NVFP4_MATVEC: [Nvfp4Matvec; 2] = [nvfp4_matvec_f32, nvfp4_matvec_bf16];
const NVFP4_MATVEC_R1: [Nvfp4Matvec; 2] = [nvfp4_matvec_r1_f32, nvfp4_matvec_r1_bf16];
const NVFP4_DEQUANTIZE: [Nvfp4Dequantize; 2] = [nvfp4_dequantize_f32, nvfp4_dequantize_bf16];

/// One weight's kernels against the reference `dense` `[n, k]`, for f32 and bf16 activations: `dequantize`
/// launches the dequantiser of a dtype into the given output, which must equal `dense` bit for bit (bf16: its
/// rounding); `matvec(dtype, one_row, x, y, m)` launches the mat-vec (the one-row kernel when `one_row`) on
/// `m` rows, which must equal the reference product ([`assert_close`]) at every [`row_counts`] entry.
fn check_weight_only_kernels(
    what: &str,
    (n, k): (usize, usize),
    dense: &Tensor,
    seed: u64,
    dequantize: &dyn Fn(DType, MutPtr),
    matvec: &dyn Fn(DType, bool, Ptr, MutPtr, usize),
) {
    for dtype in [DType::F32, DType::BF16] {
        let out = Values::nan(n * k, dtype);
        dequantize(dtype, out.mut_ptr());
        assert_dequantized(&format!("{what} {dtype:?}"), &out.to_f32(), dense, dtype);
        for (m, one_row) in row_counts() {
            let x = activations(seed + m as u64, m * k, dtype);
            let (want, magnitude) = reference_product(&x, (m, k), dense);
            let device_x = Values::from_f32(&x, dtype);
            let y = Values::nan(m * n, dtype);
            matvec(dtype, one_row, device_x.ptr(), y.mut_ptr(), m);
            assert_close(
                &format!("{what} {dtype:?} m={m} one_row={one_row}"),
                &y.to_f32(),
                &want,
                &magnitude,
                dtype,
            );
        }
    }
}

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
    // small blocks that split a warp's 512 weights, and rows long enough for 2 and 4 warps a column (with
    // column counts that leave the last block's groups partly past n).
    for (seed, (n, k), block) in [
        (4720, (13, 656), [128, 128]),
        (4721, (21, 1056), [8, 32]),
        (4722, (37, 160), [16, 48]),
        (4723, (7, 2176), [128, 128]),
        (4724, (5, 4240), [128, 128]),
    ] {
        let w = common::quantized::fp8(&mut rng(seed), n, k, block);
        let dense = fp8_matmul::reference::dequantize(&w).unwrap();
        let (bytes, scales) = (bytes_of(&w.weight), floats_of(&w.scale_inv));
        let (bn, bk) = (block[0] as i32, block[1] as i32);
        check_weight_only_kernels(
            &format!("fp8 {block:?}"),
            (n, k),
            &dense,
            seed,
            &|dtype, out| {
                // 16 weights an item as the launcher runs these shapes (every one's runs lie in one scale
                // block), and one an item (its fallback) for every other shape.
                let f = FP8_DEQUANTIZE[dtype_index(dtype)];
                let vectors = seed % 2 == 0 && k % 16 == 0 && block[1] % 16 == 0;
                let items = if vectors { n * k / 16 } else { n * k };
                run(dequantize_config(items), || unsafe {
                    f(
                        bytes.ptr(),
                        scales.ptr(),
                        out,
                        n as i32,
                        k as i32,
                        bn,
                        bk,
                        i32::from(vectors),
                    )
                });
            },
            &|dtype, one_row, x, y, m| {
                let d = dtype_index(dtype);
                let f = if one_row {
                    FP8_MATVEC_R1[d]
                } else {
                    FP8_MATVEC[d]
                };
                let (config, warps) = matvec_config(n, k / 16);
                run(config, || unsafe {
                    f(
                        x,
                        bytes.ptr(),
                        scales.ptr(),
                        y,
                        m as i32,
                        n as i32,
                        k as i32,
                        bn,
                        bk,
                        warps,
                    )
                });
            },
        );
    }
}

#[test]
fn nvfp4_kernels_equal_the_reference() {
    // Rows of fewer 16-value groups than a warp has lanes (160), of one partial unrolled pass (1024), of
    // several (8224: 4 warps a column) and read by 2 warps a column (2080).
    for (seed, (n, k)) in [
        (4730, (13, 160)),
        (4731, (9, 1024)),
        (4732, (5, 8224)),
        (4733, (11, 2080)),
    ] {
        let w = common::quantized::nvfp4(&mut rng(seed), n, k);
        let dense = nvfp4_matmul::reference::dequantize(&w).unwrap();
        let (packed, scales) = (bytes_of(&w.packed), bytes_of(&w.scales));
        let global = w.global_scale;
        check_weight_only_kernels(
            &format!("nvfp4 k={k}"),
            (n, k),
            &dense,
            seed,
            &|dtype, out| {
                // A group an item as the launcher runs aligned weights, and one value an item (its fallback)
                // for every other shape.
                let f = NVFP4_DEQUANTIZE[dtype_index(dtype)];
                let vectors = seed % 2 == 0;
                let items = if vectors { n * k / 16 } else { n * k };
                run(dequantize_config(items), || unsafe {
                    f(
                        packed.ptr(),
                        scales.ptr(),
                        global,
                        out,
                        n as i32,
                        k as i32,
                        i32::from(vectors),
                    )
                });
            },
            &|dtype, one_row, x, y, m| {
                let d = dtype_index(dtype);
                let f = if one_row {
                    NVFP4_MATVEC_R1[d]
                } else {
                    NVFP4_MATVEC[d]
                };
                let (config, warps) = matvec_config(n, k / 16);
                run(config, || unsafe {
                    f(
                        x,
                        packed.ptr(),
                        scales.ptr(),
                        global,
                        y,
                        m as i32,
                        n as i32,
                        k as i32,
                        warps,
                    )
                });
            },
        );
    }
}

// ---- the MoE chain, as `moe/cuda.rs` launches it ---------------------------------------------------------

/// `MOE_WARPS`: output rows per block of the expert mat-vecs.
const MOE_WARPS: usize = 8;
/// Threads of `moe_align`'s one block.
const ALIGN_THREADS: u32 = 1024;

type I32s = *const i32;

extern "C" {
    fn moe_route(
        logits: *const f32,
        bias: *const f32,
        n_tokens: i32,
        n_experts: i32,
        n_group: i32,
        topk_group: i32,
        top_k: i32,
        normalise: i32,
        scaling: f32,
        shared_expert: i32,
        ids: *mut u32,
        gates: *mut f32,
    );
    fn moe_router_logits_f32(
        x: Ptr,
        w: *const f32,
        n_tokens: i32,
        n_experts: i32,
        hidden: i32,
        logits: *mut f32,
    );
    fn moe_router_logits_bf16(
        x: Ptr,
        w: *const f32,
        n_tokens: i32,
        n_experts: i32,
        hidden: i32,
        logits: *mut f32,
    );
    fn moe_align(
        ids: *const u32,
        n_assign: i32,
        n_experts: i32,
        offsets: *mut i32,
        sorted: *mut i32,
        active: *mut i32,
        active_count: *mut i32,
    );
    fn moe_combine_f32(y: *const f32, n_tokens: i32, slots: i32, hidden: i32, out: MutPtr);
    fn moe_combine_bf16(y: *const f32, n_tokens: i32, slots: i32, hidden: i32, out: MutPtr);
}

type DenseGateUp = unsafe extern "C" fn(Ptr, Ptr, I32s, I32s, I32s, I32s, i32, i32, i32, MutPtr);
type DenseDown =
    unsafe extern "C" fn(Ptr, Ptr, *const f32, I32s, I32s, I32s, I32s, i32, i32, *mut f32);
type Fp8GateUp = unsafe extern "C" fn(
    Ptr,
    *const u8,
    *const f32,
    i32,
    i32,
    I32s,
    I32s,
    I32s,
    I32s,
    i32,
    i32,
    i32,
    MutPtr,
);
type Fp8Down = unsafe extern "C" fn(
    Ptr,
    *const u8,
    *const f32,
    i32,
    i32,
    *const f32,
    I32s,
    I32s,
    I32s,
    I32s,
    i32,
    i32,
    *mut f32,
);
type Nvfp4GateUp = unsafe extern "C" fn(
    Ptr,
    *const u8,
    *const u8,
    *const f32,
    I32s,
    I32s,
    I32s,
    I32s,
    i32,
    i32,
    i32,
    MutPtr,
);
type Nvfp4Down = unsafe extern "C" fn(
    Ptr,
    *const u8,
    *const u8,
    *const f32,
    *const f32,
    I32s,
    I32s,
    I32s,
    I32s,
    i32,
    i32,
    *mut f32,
);
type IqGateUp =
    unsafe extern "C" fn(Ptr, *const u8, *const u8, I32s, I32s, I32s, I32s, i32, i32, i32, MutPtr);
type IqDown =
    unsafe extern "C" fn(Ptr, *const u8, *const f32, I32s, I32s, I32s, I32s, i32, i32, *mut f32);

/// Declares `moe_{gate_up,down}_[t1_]<stem><dtype>` for each listed stem and a table of them indexed
/// [one token][dtype].
macro_rules! moe_kernels {
    ($table:ident, $gate_up_ty:ty, $down_ty:ty, $($stem:ident)?, ($($gate_up_arg:ty),*), ($($down_arg:ty),*)) => {
        paste::paste! {
            extern "C" {
                fn [<moe_gate_up_ $($stem)? f32>]($(_: $gate_up_arg),*);
                fn [<moe_gate_up_ $($stem)? bf16>]($(_: $gate_up_arg),*);
                fn [<moe_gate_up_t1_ $($stem)? f32>]($(_: $gate_up_arg),*);
                fn [<moe_gate_up_t1_ $($stem)? bf16>]($(_: $gate_up_arg),*);
                fn [<moe_down_ $($stem)? f32>]($(_: $down_arg),*);
                fn [<moe_down_ $($stem)? bf16>]($(_: $down_arg),*);
                fn [<moe_down_t1_ $($stem)? f32>]($(_: $down_arg),*);
                fn [<moe_down_t1_ $($stem)? bf16>]($(_: $down_arg),*);
            }
            const [<$table _GATE_UP>]: [[$gate_up_ty; 2]; 2] = [
                [[<moe_gate_up_ $($stem)? f32>], [<moe_gate_up_ $($stem)? bf16>]],
                [[<moe_gate_up_t1_ $($stem)? f32>], [<moe_gate_up_t1_ $($stem)? bf16>]],
            ];
            const [<$table _DOWN>]: [[$down_ty; 2]; 2] = [
                [[<moe_down_ $($stem)? f32>], [<moe_down_ $($stem)? bf16>]],
                [[<moe_down_t1_ $($stem)? f32>], [<moe_down_t1_ $($stem)? bf16>]],
            ];
        }
    };
}

moe_kernels!(DENSE, DenseGateUp, DenseDown, ,
    (Ptr, Ptr, I32s, I32s, I32s, I32s, i32, i32, i32, MutPtr),
    (Ptr, Ptr, *const f32, I32s, I32s, I32s, I32s, i32, i32, *mut f32));
moe_kernels!(
    FP8,
    Fp8GateUp,
    Fp8Down,
    fp8_,
    (
        Ptr,
        *const u8,
        *const f32,
        i32,
        i32,
        I32s,
        I32s,
        I32s,
        I32s,
        i32,
        i32,
        i32,
        MutPtr
    ),
    (
        Ptr,
        *const u8,
        *const f32,
        i32,
        i32,
        *const f32,
        I32s,
        I32s,
        I32s,
        I32s,
        i32,
        i32,
        *mut f32
    )
);
moe_kernels!(
    NVFP4,
    Nvfp4GateUp,
    Nvfp4Down,
    nvfp4_,
    (
        Ptr,
        *const u8,
        *const u8,
        *const f32,
        I32s,
        I32s,
        I32s,
        I32s,
        i32,
        i32,
        i32,
        MutPtr
    ),
    (
        Ptr,
        *const u8,
        *const u8,
        *const f32,
        *const f32,
        I32s,
        I32s,
        I32s,
        I32s,
        i32,
        i32,
        *mut f32
    )
);

macro_rules! moe_iq_kernels {
    ($($variant:ident => $stem:ident),* $(,)?) => { paste::paste! {
        $(
            moe_kernels!([<IQ_ $stem:upper>], IqGateUp, IqDown, [<$stem _>],
                (Ptr, *const u8, *const u8, I32s, I32s, I32s, I32s, i32, i32, i32, MutPtr),
                (Ptr, *const u8, *const f32, I32s, I32s, I32s, I32s, i32, i32, *mut f32));
        )*
        fn moe_iq_kernels(format: GgufFormat) -> ([[IqGateUp; 2]; 2], [[IqDown; 2]; 2]) {
            match format {
                $(GgufFormat::$variant => ([<IQ_ $stem:upper _GATE_UP>], [<IQ_ $stem:upper _DOWN>]),)*
            }
        }
    }};
}

extern "C" {
    fn moe_gate_up_q4_k_mma_bf16(
        x: Ptr,
        gate: *const u8,
        up: *const u8,
        sorted: I32s,
        offsets: I32s,
        active: I32s,
        active_count: I32s,
        slots: i32,
        hidden: i32,
        inter: i32,
        h: MutPtr,
    );
    fn moe_down_q4_k_mma_bf16(
        h: Ptr,
        down: *const u8,
        gates: *const f32,
        sorted: I32s,
        offsets: I32s,
        active: I32s,
        active_count: I32s,
        hidden: i32,
        inter: i32,
        y: *mut f32,
    );
}

moe_iq_kernels! {
    Iq2Xxs => iq2_xxs, Iq2Xs => iq2_xs, Iq2S => iq2_s, Iq3Xxs => iq3_xxs, Iq3S => iq3_s,
    Iq1S => iq1_s, Iq1M => iq1_m, Iq4Nl => iq4_nl, Iq4Xs => iq4_xs, Q4K => q4_k, Q6K => q6_k, Q2K => q2_k, Q3K => q3_k,
    Q5K => q5_k,
}

/// Stacked experts in emulated device memory, as `moe/cuda.rs` passes them.
enum DeviceExperts {
    Dense {
        gate_up: Values,
        down: Values,
    },
    Fp8 {
        gate_up: (DeviceBuffer<u8>, DeviceBuffer<f32>),
        down: (DeviceBuffer<u8>, DeviceBuffer<f32>),
        block: [i32; 2],
    },
    Nvfp4 {
        gate_up: (DeviceBuffer<u8>, DeviceBuffer<u8>, DeviceBuffer<f32>),
        down: (DeviceBuffer<u8>, DeviceBuffer<u8>, DeviceBuffer<f32>),
    },
    GgufBlocks {
        gate_up_format: GgufFormat,
        down_format: GgufFormat,
        gate: DeviceBuffer<u8>,
        up: DeviceBuffer<u8>,
        down: DeviceBuffer<u8>,
    },
}

impl DeviceExperts {
    fn quantized(weights: &QuantizedExperts) -> Self {
        match weights {
            QuantizedExperts::Fp8 { gate_up, down } => DeviceExperts::Fp8 {
                gate_up: (bytes_of(&gate_up.weight), floats_of(&gate_up.scale_inv)),
                down: (bytes_of(&down.weight), floats_of(&down.scale_inv)),
                block: [gate_up.block[0] as i32, gate_up.block[1] as i32],
            },
            QuantizedExperts::Nvfp4 { gate_up, down } => DeviceExperts::Nvfp4 {
                gate_up: (
                    bytes_of(&gate_up.packed),
                    bytes_of(&gate_up.scales),
                    floats_of(&gate_up.global_scales),
                ),
                down: (
                    bytes_of(&down.packed),
                    bytes_of(&down.scales),
                    floats_of(&down.global_scales),
                ),
            },
            QuantizedExperts::GgufBlocks { gate, up, down } => DeviceExperts::GgufBlocks {
                gate_up_format: gate.format,
                down_format: down.format,
                gate: bytes_of(&gate.blocks),
                up: bytes_of(&up.blocks),
                down: bytes_of(&down.blocks),
            },
        }
    }
}

/// The experts' output `[t, hidden]` by the emulated chain: align, gate/up, down (the `t1_` kernels for one
/// token), combine; `ids`/`gates` `[t, slots]`.
fn emulated_experts(
    x: &Values,
    (ids, gates): (&[u32], &[f32]),
    (t, slots): (usize, usize),
    (n_experts, hidden, inter): (usize, usize, usize),
    dtype: DType,
    experts: &DeviceExperts,
) -> Vec<f32> {
    let n_assign = t * slots;
    let (ids, gates) = (
        DeviceBuffer::from_slice(ids),
        DeviceBuffer::from_slice(gates),
    );
    let offsets = DeviceBuffer::<i32>::poisoned(n_experts + 1, NAN_BYTE);
    let sorted = DeviceBuffer::<i32>::poisoned(n_assign, NAN_BYTE);
    let active = DeviceBuffer::<i32>::poisoned(n_experts, NAN_BYTE);
    let count = DeviceBuffer::<i32>::poisoned(1, NAN_BYTE);
    run(
        LaunchConfig {
            grid: (1, 1, 1),
            block: (ALIGN_THREADS, 1, 1),
            shared_bytes: n_experts * 4,
        },
        || unsafe {
            moe_align(
                ids.ptr(),
                n_assign as i32,
                n_experts as i32,
                offsets.mut_ptr(),
                sorted.mut_ptr(),
                active.mut_ptr(),
                count.mut_ptr(),
            )
        },
    );
    let h = Values::nan(n_assign * inter, dtype);
    let y = DeviceBuffer::<f32>::poisoned(n_assign * hidden, NAN_BYTE);
    let (one, d) = (usize::from(t == 1), dtype_index(dtype));
    let blocks = n_experts.min(n_assign) as u32;
    let threads = (MOE_WARPS * 32) as u32;
    let gate_up_config = LaunchConfig::new((blocks, inter.div_ceil(MOE_WARPS) as u32, 1), threads);
    let down_config = LaunchConfig::new((blocks, hidden.div_ceil(MOE_WARPS) as u32, 1), threads);
    let grouping = (sorted.ptr(), offsets.ptr(), active.ptr(), count.ptr());
    let (s, hd, it) = (slots as i32, hidden as i32, inter as i32);
    match experts {
        DeviceExperts::Dense { gate_up, down } => {
            let (f, g) = (DENSE_GATE_UP[one][d], DENSE_DOWN[one][d]);
            run(gate_up_config, || unsafe {
                f(
                    x.ptr(),
                    gate_up.ptr(),
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    s,
                    hd,
                    it,
                    h.mut_ptr(),
                )
            });
            run(down_config, || unsafe {
                g(
                    h.ptr(),
                    down.ptr(),
                    gates.ptr(),
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    hd,
                    it,
                    y.mut_ptr(),
                )
            });
        }
        DeviceExperts::Fp8 {
            gate_up,
            down,
            block: [bn, bk],
        } => {
            let (f, g) = (FP8_GATE_UP[one][d], FP8_DOWN[one][d]);
            run(gate_up_config, || unsafe {
                f(
                    x.ptr(),
                    gate_up.0.ptr(),
                    gate_up.1.ptr(),
                    *bn,
                    *bk,
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    s,
                    hd,
                    it,
                    h.mut_ptr(),
                )
            });
            run(down_config, || unsafe {
                g(
                    h.ptr(),
                    down.0.ptr(),
                    down.1.ptr(),
                    *bn,
                    *bk,
                    gates.ptr(),
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    hd,
                    it,
                    y.mut_ptr(),
                )
            });
        }
        DeviceExperts::Nvfp4 { gate_up, down } => {
            let (f, g) = (NVFP4_GATE_UP[one][d], NVFP4_DOWN[one][d]);
            run(gate_up_config, || unsafe {
                f(
                    x.ptr(),
                    gate_up.0.ptr(),
                    gate_up.1.ptr(),
                    gate_up.2.ptr(),
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    s,
                    hd,
                    it,
                    h.mut_ptr(),
                )
            });
            run(down_config, || unsafe {
                g(
                    h.ptr(),
                    down.0.ptr(),
                    down.1.ptr(),
                    down.2.ptr(),
                    gates.ptr(),
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    hd,
                    it,
                    y.mut_ptr(),
                )
            });
        }
        DeviceExperts::GgufBlocks {
            gate_up_format,
            down_format,
            gate,
            up,
            down,
        } => {
            // Q4_K with bf16 activations: the tensor-core kernels, launched as moe/cuda.rs launches them on a
            // device that holds three of their blocks an expert at once (each block walks several tiles).
            let mma = |format: GgufFormat| format == GgufFormat::Q4K && dtype == DType::BF16;
            let mma_config = |rows: usize, k: usize| {
                let warps = q4k_mma_warps(k);
                let tiles = rows.div_ceil(Q4K_MMA_ROW_TILE);
                LaunchConfig {
                    shared_bytes: q4k_row_staged_bytes(k),
                    ..LaunchConfig::new(
                        (blocks, tile_loop_blocks(tiles, 3) as u32, 1),
                        (warps * 32) as u32,
                    )
                }
            };
            let (f, gate_up_config): (IqGateUp, _) = if mma(*gate_up_format) {
                (moe_gate_up_q4_k_mma_bf16, mma_config(inter, hidden))
            } else {
                (moe_iq_kernels(*gate_up_format).0[one][d], gate_up_config)
            };
            let (g, down_config): (IqDown, _) = if mma(*down_format) {
                (moe_down_q4_k_mma_bf16, mma_config(hidden, inter))
            } else {
                (moe_iq_kernels(*down_format).1[one][d], down_config)
            };
            run(gate_up_config, || unsafe {
                f(
                    x.ptr(),
                    gate.ptr(),
                    up.ptr(),
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    s,
                    hd,
                    it,
                    h.mut_ptr(),
                )
            });
            run(down_config, || unsafe {
                g(
                    h.ptr(),
                    down.ptr(),
                    gates.ptr(),
                    grouping.0,
                    grouping.1,
                    grouping.2,
                    grouping.3,
                    hd,
                    it,
                    y.mut_ptr(),
                )
            });
        }
    }
    let out = Values::nan(t * hidden, dtype);
    let combine = [moe_combine_f32, moe_combine_bf16][d];
    run(
        LaunchConfig::new(((t * hidden).div_ceil(256) as u32, 1, 1), 256),
        || unsafe {
            combine(
                y.ptr(),
                t as i32,
                slots as i32,
                hidden as i32,
                out.mut_ptr(),
            )
        },
    );
    out.to_f32()
}

/// Random routes: `slots` of the first `experts` experts per token (repeats allowed, as the kernels must take
/// them), gates in [0, 1).
fn random_routes(seed: u64, t: usize, slots: usize, experts: usize) -> (Vec<u32>, Vec<f32>) {
    use rand::Rng;
    let mut r = rng(seed);
    let ids = (0..t * slots)
        .map(|_| r.random_range(0..experts as u32))
        .collect();
    let gates = (0..t * slots).map(|_| r.random_range(0.0..1.0)).collect();
    (ids, gates)
}

/// The emulated chain with activations of each of `dtypes` against `experts_reference` in f32 on the dense
/// weights: within 1e-5 of the output's scale in f32, 2e-2 in bf16 (the kernels round h and the output to bf16
/// like the model), as on the GPU.
fn check_experts(
    what: &str,
    experts: &DeviceExperts,
    (gate_up, down): (&Tensor, &Tensor),
    (n_experts, hidden, inter): (usize, usize, usize),
    dtypes: &[DType],
    seed: u64,
) {
    for &dtype in dtypes {
        // One token (the `t1_` kernels), a few over every expert, and many over three experts, which then
        // take several passes of MOE_TOKENS_PER_PASS tokens (three, to keep the emulation short).
        for (t, slots, used) in [(1, 9, n_experts), (5, 3, n_experts), (9, 4, 3)] {
            let x = activations(seed + t as u64, t * hidden, dtype);
            let (ids, gates) = random_routes(seed + 100 + t as u64, t, slots, used);
            let routes = Routes {
                ids: Tensor::from_slice(&ids, (t, slots), &Device::Cpu).unwrap(),
                gates: Tensor::from_slice(&gates, (t, slots), &Device::Cpu).unwrap(),
            };
            let want = experts_reference(
                &Tensor::from_slice(&x, (t, hidden), &Device::Cpu).unwrap(),
                &routes,
                gate_up,
                down,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            let got = emulated_experts(
                &Values::from_f32(&x, dtype),
                (&ids, &gates),
                (t, slots),
                (n_experts, hidden, inter),
                dtype,
                experts,
            );
            let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let err = got
                .iter()
                .zip(&want)
                .map(|(g, w)| {
                    if g.is_finite() {
                        (g - w).abs()
                    } else {
                        f32::INFINITY
                    }
                })
                .fold(0.0f32, f32::max);
            let bound = if dtype == DType::F32 { 1e-5 } else { 2e-2 } * scale.max(1e-3);
            assert!(
                err <= bound,
                "{what} {dtype:?} t={t} slots={slots}: max |Δ| = {err:.3e} > {bound:.3e} (scale {scale:.3e})"
            );
        }
    }
}

#[test]
fn moe_router_logits_equal_the_reference() {
    use glm5_kernels::interface::moe::{ROUTER_EXPERTS, ROUTER_THREADS, ROUTER_TOKENS};
    use glm5_ops::moe::router_logits_reference;
    // Expert and token counts off the block's tiles; a width that is not a whole pass of the block's threads.
    let (n_experts, hidden) = (13, 4 * ROUTER_THREADS + 36);
    for dtype in [DType::F32, DType::BF16] {
        for t in [1, 5] {
            let x = uniform(&mut rng(4760 + t as u64), t * hidden);
            let w = uniform(&mut rng(4770 + t as u64), n_experts * hidden);
            let device_x = Values::from_f32(&x, dtype);
            let device_w = DeviceBuffer::from_slice(&w);
            let logits = DeviceBuffer::<f32>::poisoned(t * n_experts, NAN_BYTE);
            let kernel = match dtype {
                DType::F32 => moe_router_logits_f32,
                _ => moe_router_logits_bf16,
            };
            run(
                LaunchConfig::new(
                    (
                        n_experts.div_ceil(ROUTER_EXPERTS) as u32,
                        t.div_ceil(ROUTER_TOKENS) as u32,
                        1,
                    ),
                    ROUTER_THREADS as u32,
                ),
                || unsafe {
                    kernel(
                        device_x.ptr(),
                        device_w.ptr(),
                        t as i32,
                        n_experts as i32,
                        hidden as i32,
                        logits.mut_ptr(),
                    )
                },
            );
            // The reference from the values the kernel read (bf16 rounds x).
            let want = router_logits_reference(
                &Tensor::from_vec(device_x.to_f32(), (t, hidden), &Device::Cpu).unwrap(),
                &Tensor::from_slice(&w, (n_experts, hidden), &Device::Cpu).unwrap(),
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            // f32 sums in another order: within 1e-5 of the logits' scale (a wrong row or column is off by O(1)).
            let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            for (i, (g, w)) in logits.to_vec().iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * scale,
                    "{dtype:?} t={t} logit {i}: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn moe_route_equals_the_reference() {
    use glm5_kernels::interface::moe::{route_shared_bytes, route_threads};
    // Every rule of common::route_rules, with ties (the lower expert wins).
    let cases = common::route_rules();
    for (seed, (e, rule)) in cases.into_iter().enumerate() {
        for tied in [false, true] {
            let t = 7;
            let mut logits: Vec<f32> = uniform(&mut rng(4740 + seed as u64), t * e)
                .iter()
                .map(|x| x * 4.0)
                .collect();
            let mut bias: Vec<f32> = uniform(&mut rng(4750 + seed as u64), e)
                .iter()
                .map(|x| x * 0.05)
                .collect();
            if tied {
                logits
                    .iter_mut()
                    .for_each(|x| *x = (*x * 2.0).round() / 2.0);
                bias.iter_mut().for_each(|b| *b = 0.0);
            }
            for shared in [None, Some(e as u32)] {
                let want = route_reference(
                    &Tensor::from_slice(&logits, (t, e), &Device::Cpu).unwrap(),
                    &Tensor::from_slice(&bias, e, &Device::Cpu).unwrap(),
                    &rule,
                    shared,
                )
                .unwrap();
                let slots = rule.top_k + usize::from(shared.is_some());
                let (device_logits, device_bias) = (
                    DeviceBuffer::from_slice(&logits),
                    DeviceBuffer::from_slice(&bias),
                );
                let ids = DeviceBuffer::<u32>::poisoned(t * slots, NAN_BYTE);
                let gates = DeviceBuffer::<f32>::poisoned(t * slots, NAN_BYTE);
                run(
                    LaunchConfig {
                        shared_bytes: route_shared_bytes(e, rule.top_k),
                        ..LaunchConfig::new((t as u32, 1, 1), route_threads(e) as u32)
                    },
                    || unsafe {
                        moe_route(
                            device_logits.ptr(),
                            device_bias.ptr(),
                            t as i32,
                            e as i32,
                            rule.n_group as i32,
                            rule.topk_group as i32,
                            rule.top_k as i32,
                            i32::from(rule.normalise),
                            rule.scaling,
                            shared.map_or(-1, |s| s as i32),
                            ids.mut_ptr(),
                            gates.mut_ptr(),
                        )
                    },
                );
                let want_ids = want.ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
                assert_eq!(
                    ids.to_vec(),
                    want_ids,
                    "e={e} tied={tied} shared={shared:?}"
                );
                let want_gates = want.gates.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for (g, w) in gates.to_vec().iter().zip(&want_gates) {
                    assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "gate {g} vs {w}");
                }
            }
        }
    }
}

#[test]
fn moe_dense_experts_equal_the_reference() {
    // Widths that are not multiples of a block's 8 rows; 13 experts.
    let (n_experts, hidden, inter) = (13, 200, 40);
    let mut r = rng(4760);
    let gate_up = uniform(&mut r, n_experts * 2 * inter * hidden);
    let down = uniform(&mut r, n_experts * hidden * inter);
    for dtype in [DType::F32, DType::BF16] {
        let rounded = |v: &[f32]| activations_like(v, dtype);
        let (gu, dn) = (rounded(&gate_up), rounded(&down));
        let experts = DeviceExperts::Dense {
            gate_up: Values::from_f32(&gu, dtype),
            down: Values::from_f32(&dn, dtype),
        };
        let dense_gate_up =
            Tensor::from_slice(&gu, (n_experts, 2 * inter, hidden), &Device::Cpu).unwrap();
        let dense_down = Tensor::from_slice(&dn, (n_experts, hidden, inter), &Device::Cpu).unwrap();
        // The dense kernels take weights in the activations' dtype.
        check_experts(
            "dense experts",
            &experts,
            (&dense_gate_up, &dense_down),
            (n_experts, hidden, inter),
            &[dtype],
            4761,
        );
    }
}

#[test]
fn moe_quantized_experts_equal_the_reference() {
    let n_experts = 13;
    let iq = |gate_up, down| Format::GgufBlocks { gate_up, down };
    for (seed, (format, (hidden, inter))) in [
        (Format::Fp8 { block: [128, 128] }, (272, 48)),
        (Format::Fp8 { block: [16, 32] }, (272, 48)),
        (Format::Nvfp4, (272, 48)),
        (iq(GgufFormat::Iq3S, GgufFormat::Iq4Xs), (512, 256)),
        (iq(GgufFormat::Iq2Xxs, GgufFormat::Iq2S), (256, 512)),
        (iq(GgufFormat::Iq2Xs, GgufFormat::Iq3Xxs), (256, 256)),
        (iq(GgufFormat::Iq1S, GgufFormat::Iq1M), (256, 256)),
        (iq(GgufFormat::Iq4Nl, GgufFormat::Iq4Nl), (96, 160)),
        (iq(GgufFormat::Q4K, GgufFormat::Iq4Xs), (512, 768)),
        (iq(GgufFormat::Iq3S, GgufFormat::Q4K), (256, 256)),
        // Q4_K's tensor-core kernels with several warps: gate/up's three split between the two matrices (an odd
        // count), down's two.
        (iq(GgufFormat::Q4K, GgufFormat::Q4K), (1536, 1280)),
        // A Q4_K_M file's mix: Q4_K gate/up on the tensor cores (bf16), Q6_K down; UD-Q2_K_XL's Q2_K / Q3_K;
        // Q5_K_M's Q5_K.
        (iq(GgufFormat::Q4K, GgufFormat::Q6K), (512, 256)),
        (iq(GgufFormat::Q2K, GgufFormat::Q3K), (256, 512)),
        (iq(GgufFormat::Q5K, GgufFormat::Q5K), (256, 256)),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 4770 + 10 * seed as u64;
        let (weights, gate_up, down) = quantized_experts(
            &mut rng(seed),
            &format,
            (n_experts, hidden, inter),
            &Device::Cpu,
        );
        let label = match format {
            Format::Fp8 { block } => format!("FP8 {block:?}"),
            Format::Nvfp4 => "NVFP4".to_string(),
            Format::GgufBlocks { gate_up, down } => format!("{gate_up} gate/up, {down} down"),
        };
        check_experts(
            &format!("{label} experts"),
            &DeviceExperts::quantized(&weights),
            (&gate_up, &down),
            (n_experts, hidden, inter),
            &[DType::F32, DType::BF16],
            seed,
        );
    }
}

// ---- NVFP4 W4A4 on sm_120a's block-scaled FP4 MMA (nvfp4_mma_sm120a.cu) ---------------------------------

use glm5_kernels::interface::{nvfp4_mma, Nvfp4MmaParams, Nvfp4QuantizeParams};

extern "C" {
    fn nvfp4_quantize_rows_f32(p: Nvfp4QuantizeParams);
    fn nvfp4_quantize_rows_bf16(p: Nvfp4QuantizeParams);
    fn nvfp4_mma_f32(p: Nvfp4MmaParams);
    fn nvfp4_mma_bf16(p: Nvfp4MmaParams);
}

/// The W4A4 kernels, which no GPU here can run (sm_120a only), on the emulator with its own reading of the
/// MMA's fragment and scale layouts (`kernels/emu/include/fp4_mma_sm120a.cuh`): the quantiser equals the CPU
/// reference's codes and scales exactly; the GEMM equals the reference W4A4 product within the f32 reordering
/// bound the reference gives (and the output's bf16 rounding). Rows and columns past the 128 x 128 tiles and
/// a zero row and a row with a NaN included.
#[test]
fn nvfp4_w4a4_sm120_kernels_equal_the_reference() {
    for (seed, (m, n, k)) in [(4790, (130, 136, 256)), (4791, (7, 20, 384))] {
        let w = common::quantized::nvfp4(&mut rng(seed), n, k);
        let (packed, w_scales) = (bytes_of(&w.packed), bytes_of(&w.scales));
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let mut x = activations(seed + 1, m * k, dtype);
            x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
            if m > 4 {
                x[3 * k + 5] = f32::NAN;
            }
            let x_tensor = Tensor::from_slice(&x, (m, k), &Device::Cpu).unwrap();
            let want_acts = nvfp4_matmul::reference::quantize_activations(&x_tensor).unwrap();
            let device_x = Values::from_f32(&x, dtype);
            let codes = DeviceBuffer::<u8>::poisoned(m * k / 2, NAN_BYTE);
            let scales = DeviceBuffer::<u8>::poisoned(m * k / 16, NAN_BYTE);
            let row_scales = DeviceBuffer::<f32>::poisoned(m, NAN_BYTE);
            let quantize = [nvfp4_quantize_rows_f32, nvfp4_quantize_rows_bf16][d];
            let params = Nvfp4QuantizeParams {
                x: device_x.ptr() as u64,
                codes: codes.mut_ptr() as u64,
                scales: scales.mut_ptr() as u64,
                row_scales: row_scales.mut_ptr() as u64,
                m: m as i32,
                k: k as i32,
            };
            run(
                LaunchConfig::new((m as u32, 1, 1), nvfp4_mma::QUANTIZE_THREADS as u32),
                || unsafe { quantize(params) },
            );
            let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            assert_eq!(codes.to_vec(), bytes(&want_acts.codes), "{dtype:?} codes");
            assert_eq!(
                scales.to_vec(),
                bytes(&want_acts.scales),
                "{dtype:?} scales"
            );
            let want_rows = want_acts.row_scales.to_vec1::<f32>().unwrap();
            for (g, w) in row_scales.to_vec().iter().zip(&want_rows) {
                assert!(g.to_bits() == w.to_bits(), "{dtype:?} row scale {g} vs {w}");
            }

            let y = Values::nan(m * n, dtype);
            let mma = [nvfp4_mma_f32, nvfp4_mma_bf16][d];
            let params = Nvfp4MmaParams {
                a_codes: codes.ptr() as u64,
                a_scales: scales.ptr() as u64,
                a_row_scales: row_scales.ptr() as u64,
                b_packed: packed.ptr() as u64,
                b_scales: w_scales.ptr() as u64,
                y: y.mut_ptr() as u64,
                m: m as i32,
                n: n as i32,
                k: k as i32,
                b_global_scale: w.global_scale,
            };
            run(
                LaunchConfig::new(
                    (
                        n.div_ceil(nvfp4_mma::TILE_N) as u32,
                        m.div_ceil(nvfp4_mma::TILE_M) as u32,
                        1,
                    ),
                    nvfp4_mma::THREADS as u32,
                ),
                || unsafe { mma(params) },
            );
            let (want, magnitude) =
                nvfp4_matmul::reference::nvfp4_matmul_w4a4_with_magnitudes(&x_tensor, &w).unwrap();
            let (want, magnitude) = (host_f32(&want), host_f32(&magnitude));
            for (i, ((g, w), mag)) in y.to_f32().iter().zip(&want).zip(&magnitude).enumerate() {
                if w.is_nan() {
                    assert!(g.is_nan(), "{dtype:?} output {i}: {g}, the reference's NaN");
                    continue;
                }
                let rounding = if dtype == DType::BF16 {
                    w.abs() / 256.0
                } else {
                    0.0
                };
                let bound = 2.0 * (k - 1) as f32 * f32::EPSILON / 2.0 * mag + rounding;
                assert!(
                    (g - w).abs() <= bound,
                    "{dtype:?} m={m} n={n} k={k} output {i}: {g} vs the reference's {w} (bound {bound:.3e})"
                );
            }
        }
    }
}

// ---- the FP8 W8A8 activation quantiser (fp8_quantize.cu) -------------------------------------------------

use glm5_kernels::interface::{fp8_quantize, Fp8QuantizeParams};

extern "C" {
    fn fp8_quantize_rows_f32(p: Fp8QuantizeParams);
    fn fp8_quantize_rows_bf16(p: Fp8QuantizeParams);
}

/// The W8A8 quantiser as `fp8_matmul/cuda/w8a8.rs` launches it (a warp per token and 128 values, padding rows
/// included) equals the CPU reference bit for bit: codes and scales of every row, the padding rows' zeros
/// and 2^-126 scales, at a zero group, a huge and a subnormal group, -0.0 and NaN values.
#[test]
fn fp8_w8a8_quantiser_equals_the_reference() {
    let group = fp8_quantize::GROUP;
    for (seed, (m, k)) in [
        (4810, (19, 3 * group)),
        (4811, (1, group)),
        (4812, (33, 2 * group)),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let mut x = activations(seed, m * k, dtype);
            x[..group].iter_mut().for_each(|v| *v = 0.0);
            if m > 1 {
                x[k..k + group].iter_mut().for_each(|v| *v *= 1e30);
                // Subnormal in f32 (bf16 keeps f32's exponent range): amax / 448 underflows.
                x[2 * k - group..2 * k].iter_mut().for_each(|v| *v *= 1e-39);
                x[k + group] = -0.0;
                x[k + group + 1] = f32::NAN;
            }
            let x = activations_like(&x, dtype);
            let want = fp8_matmul::reference::quantize_activations(
                &Tensor::from_slice(&x, (m, k), &Device::Cpu).unwrap(),
            )
            .unwrap();
            let padded = fp8_matmul::w8a8_padded_rows(m);
            let device_x = Values::from_f32(&x, dtype);
            let codes = DeviceBuffer::<u8>::poisoned(padded * k, NAN_BYTE);
            let scales = DeviceBuffer::<f32>::poisoned((k / group) * padded, NAN_BYTE);
            let params = Fp8QuantizeParams {
                x: device_x.ptr() as u64,
                codes: codes.mut_ptr() as u64,
                scales: scales.mut_ptr() as u64,
                m: m as i32,
                m_pad: padded as i32,
                k: k as i32,
            };
            let quantize = [fp8_quantize_rows_f32, fp8_quantize_rows_bf16][d];
            let warps = fp8_quantize::THREADS / 32;
            run(
                LaunchConfig::new(
                    ((padded * (k / group)).div_ceil(warps) as u32, 1, 1),
                    fp8_quantize::THREADS as u32,
                ),
                || unsafe { quantize(params) },
            );
            let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            assert_eq!(codes.to_vec(), bytes(&want.codes), "{dtype:?} m={m} codes");
            let want_scales = want.scales.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (i, (g, w)) in scales.to_vec().iter().zip(&want_scales).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits(),
                    "{dtype:?} m={m} scale {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// `g` within one rounding of the reference `w` in `dtype` (bf16: 2⁻⁷ of it; f32: 1e-5 of it, at least of 1e-3).
fn within_a_rounding(g: f32, w: f32, dtype: DType) -> bool {
    let bound = if dtype == DType::BF16 {
        w.abs() / 128.0
    } else {
        1e-5 * w.abs().max(1e-3)
    };
    (g - w).abs() <= bound
}

// ---- RMSNorm ---------------------------------------------------------------------------------------------

extern "C" {
    fn rms_norm_f32(x: Ptr, w: Ptr, cols: i32, eps: f32, out: MutPtr);
    fn rms_norm_bf16(x: Ptr, w: Ptr, cols: i32, eps: f32, out: MutPtr);
    fn rms_norm_vectors_f32(x: Ptr, w: Ptr, cols: i32, eps: f32, out: MutPtr);
    fn rms_norm_vectors_bf16(x: Ptr, w: Ptr, cols: i32, eps: f32, out: MutPtr);
}

/// The row kernels' launches as `rms_norm/cuda.rs` makes them, for rows of `cols` values of `dtype`: the
/// scalar kernel (the row's width in threads up to 1024) and, where the width is whole 16-byte vectors, the
/// vector kernel (a thread per 4 vectors, whole warps); `(vectors, threads)` each.
fn row_norm_launches(cols: usize, dtype: DType) -> Vec<(bool, u32)> {
    let mut launches = vec![(false, (cols.div_ceil(32) * 32).clamp(32, 1024) as u32)];
    let per_vector = 16 / dtype.size_in_bytes();
    if cols.is_multiple_of(per_vector) {
        launches.push((
            true,
            ((cols / per_vector).div_ceil(4).div_ceil(32) * 32) as u32,
        ));
    }
    launches
}

/// RMSNorm as `rms_norm/cuda.rs` launches it (a block per row, the row's width in threads up to 1024), against
/// the reference: f32 within f32 rounding of the mean square's sum, bf16 within one bf16 rounding of each of
/// its two roundings. Widths below one warp, between warps and above 1024 threads.
#[test]
fn rms_norm_equals_the_reference() {
    let eps = 1e-5;
    for (seed, (rows, cols)) in [(4800, (3, 20)), (4801, (5, 200)), (4802, (2, 6144))] {
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let x = activations(seed, rows * cols, dtype);
            let w = activations(seed + 1, cols, dtype);
            let want = host_f32(
                &glm5_ops::rms_norm::rms_norm_reference(
                    &common::tensor(&x, &[rows, cols], dtype),
                    &common::tensor(&w, &[cols], dtype),
                    eps,
                )
                .unwrap(),
            );
            let (device_x, device_w) = (Values::from_f32(&x, dtype), Values::from_f32(&w, dtype));
            for (vectors, threads) in row_norm_launches(cols, dtype) {
                let out = Values::nan(rows * cols, dtype);
                let f = if vectors {
                    [rms_norm_vectors_f32, rms_norm_vectors_bf16][d]
                } else {
                    [rms_norm_f32, rms_norm_bf16][d]
                };
                run(LaunchConfig::new((rows as u32, 1, 1), threads), || unsafe {
                    f(
                        device_x.ptr(),
                        device_w.ptr(),
                        cols as i32,
                        eps as f32,
                        out.mut_ptr(),
                    )
                });
                for (i, (g, w)) in out.to_f32().iter().zip(&want).enumerate() {
                    assert!(
                        within_a_rounding(*g, *w, dtype),
                        "{dtype:?} {rows}x{cols} vectors={vectors} element {i}: {g} vs the reference's {w}"
                    );
                }
            }
        }
    }
}

extern "C" {
    fn add_rms_norm_f32(x: Ptr, r: Ptr, w: Ptr, cols: i32, eps: f32, sum: MutPtr, out: MutPtr);
    fn add_rms_norm_bf16(x: Ptr, r: Ptr, w: Ptr, cols: i32, eps: f32, sum: MutPtr, out: MutPtr);
    fn add_rms_norm_vectors_f32(
        x: Ptr,
        r: Ptr,
        w: Ptr,
        cols: i32,
        eps: f32,
        sum: MutPtr,
        out: MutPtr,
    );
    fn add_rms_norm_vectors_bf16(
        x: Ptr,
        r: Ptr,
        w: Ptr,
        cols: i32,
        eps: f32,
        sum: MutPtr,
        out: MutPtr,
    );
}

/// The residual add and RMSNorm in one kernel, launched as `rms_norm/cuda.rs` does, against the reference
/// (candle's add, then the norm's reference): the sum bit for bit, the norm within `rms_norm`'s bounds.
#[test]
fn add_rms_norm_equals_the_reference() {
    let eps = 1e-5;
    for (seed, (rows, cols)) in [(4810, (3, 20)), (4811, (5, 200)), (4812, (2, 6144))] {
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let x = activations(seed, rows * cols, dtype);
            let residual = activations(seed + 1, rows * cols, dtype);
            let w = activations(seed + 2, cols, dtype);
            let tensor = |v: &[f32], shape: &[usize]| common::tensor(v, shape, dtype);
            let (want_sum, want) = glm5_ops::rms_norm::add_rms_norm_reference(
                &tensor(&x, &[rows, cols]),
                &tensor(&residual, &[rows, cols]),
                &tensor(&w, &[cols]),
                eps,
            )
            .unwrap();
            let (want_sum, want) = (host_f32(&want_sum), host_f32(&want));
            let device = |v: &[f32]| Values::from_f32(v, dtype);
            let (device_x, device_r, device_w) = (device(&x), device(&residual), device(&w));
            for (vectors, threads) in row_norm_launches(cols, dtype) {
                let (sum, out) = (
                    Values::nan(rows * cols, dtype),
                    Values::nan(rows * cols, dtype),
                );
                let f = if vectors {
                    [add_rms_norm_vectors_f32, add_rms_norm_vectors_bf16][d]
                } else {
                    [add_rms_norm_f32, add_rms_norm_bf16][d]
                };
                run(LaunchConfig::new((rows as u32, 1, 1), threads), || unsafe {
                    f(
                        device_x.ptr(),
                        device_r.ptr(),
                        device_w.ptr(),
                        cols as i32,
                        eps as f32,
                        sum.mut_ptr(),
                        out.mut_ptr(),
                    )
                });
                for (i, (g, w)) in sum.to_f32().iter().zip(&want_sum).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype:?} {rows}x{cols} vectors={vectors} sum {i}: {g} vs {w}"
                    );
                }
                for (i, (g, w)) in out.to_f32().iter().zip(&want).enumerate() {
                    assert!(
                        within_a_rounding(*g, *w, dtype),
                        "{dtype:?} {rows}x{cols} vectors={vectors} element {i}: {g} vs the reference's {w}"
                    );
                }
            }
        }
    }
}

// ---- the attention's cache rows (attention_rows.cu) ----------------------------------------------------------

extern "C" {
    fn latent_rows_f32(
        kv_a: Ptr,
        w: Ptr,
        eps: f32,
        cos: Ptr,
        sin: Ptr,
        cache: MutPtr,
        rows: *const u32,
        first_row: i32,
        lora: i32,
        rope: i32,
    );
    fn latent_rows_bf16(
        kv_a: Ptr,
        w: Ptr,
        eps: f32,
        cos: Ptr,
        sin: Ptr,
        cache: MutPtr,
        rows: *const u32,
        first_row: i32,
        lora: i32,
        rope: i32,
    );
}

/// The fused latent-row kernel as `latent_rows/cuda.rs` launches it (a block of 256 threads per token)
/// against the reference's rows written by candle ops, into a cache of NaN rows: by offset (a contiguous
/// cache) and by row index (a paged one, rows out of order). f32 within the RMS sum's reordering, bf16 within
/// one rounding; rows not written stay NaN.
#[test]
fn latent_rows_equal_the_reference() {
    use glm5_ops::latent_rows::{latent_rows_reference, write_rows, CacheRows};
    let (t, lora, rope, slots) = (5, 512, 64, 16);
    let width = lora + rope;
    for dtype in [DType::F32, DType::BF16] {
        let d = dtype_index(dtype);
        let kv_a = activations(4810, t * width, dtype);
        let weight = activations(4811, lora, dtype);
        let (cos, sin) = rope_tables(4812, t, rope / 2, dtype);
        let tensor = |v: &[f32], shape: &[usize]| common::tensor(v, shape, dtype);
        let want_rows = latent_rows_reference(
            &tensor(&kv_a, &[t, width]),
            &tensor(&weight, &[lora]),
            1e-6,
            &tensor(&cos, &[t, rope / 2]),
            &tensor(&sin, &[t, rope / 2]),
        )
        .unwrap();
        let indexed: Vec<u32> = vec![9, 2, 15, 0, 7];
        for by_index in [false, true] {
            let want_cache = tensor(&vec![f32::NAN; slots * width], &[slots, width]);
            let rows_tensor = Tensor::from_slice(&indexed, t, &Device::Cpu).unwrap();
            let placement = if by_index {
                CacheRows::At(&rows_tensor)
            } else {
                CacheRows::From(3)
            };
            write_rows(&want_cache, &want_rows, placement).unwrap();
            let want = host_f32(&want_cache);

            let (dx, dw) = (
                Values::from_f32(&kv_a, dtype),
                Values::from_f32(&weight, dtype),
            );
            let (dcos, dsin) = (Values::from_f32(&cos, dtype), Values::from_f32(&sin, dtype));
            let cache = Values::nan(slots * width, dtype);
            let rows = DeviceBuffer::from_slice(&indexed);
            let rows_ptr = if by_index {
                rows.ptr()
            } else {
                std::ptr::null()
            };
            let f = [latent_rows_f32, latent_rows_bf16][d];
            run(LaunchConfig::new((t as u32, 1, 1), 256), || unsafe {
                f(
                    dx.ptr(),
                    dw.ptr(),
                    1e-6,
                    dcos.ptr(),
                    dsin.ptr(),
                    cache.mut_ptr(),
                    rows_ptr,
                    3,
                    lora as i32,
                    rope as i32,
                )
            });
            for (i, (g, w)) in cache.to_f32().iter().zip(&want).enumerate() {
                assert!(
                    (w.is_nan() && g.is_nan()) || within_a_rounding(*g, *w, dtype),
                    "{dtype:?} by_index={by_index} cache value {i} (row {}): {g} vs the reference's {w}",
                    i / width
                );
            }
        }
    }
}

extern "C" {
    fn index_key_rows_f32(
        k: Ptr,
        ln_weight: Ptr,
        ln_bias: Ptr,
        eps: f32,
        cos: Ptr,
        sin: Ptr,
        tokens: i32,
        dim: i32,
        rope: i32,
        float_cache: MutPtr,
        fp8_bytes: *mut u8,
        fp8_scales: *mut f32,
        rows: *const u32,
        first_row: i32,
    );
    fn index_key_rows_bf16(
        k: Ptr,
        ln_weight: Ptr,
        ln_bias: Ptr,
        eps: f32,
        cos: Ptr,
        sin: Ptr,
        tokens: i32,
        dim: i32,
        rope: i32,
        float_cache: MutPtr,
        fp8_bytes: *mut u8,
        fp8_scales: *mut f32,
        rows: *const u32,
        first_row: i32,
    );
}

/// The fused indexer-key kernel as `index_key_rows/cuda.rs` launches it (a warp per token, 8 a block) against
/// the reference (candle-nn's layer_norm and rope_i, then index_keys' quantiser) written by candle ops: float
/// caches within one rounding (bf16) or the variance's reordering (f32); FP8 caches' scales within f32
/// rounding and bytes at most one e4m3 step apart (a value the reference rounds on one side of a midpoint may
/// land on the other); keys of 128 values with RoPE on 64 (GLM-5) and of 64 all rotated; 11 tokens (two
/// blocks, the second part-filled); rows not written stay NaN / 0xff.
#[test]
fn index_key_rows_equal_the_reference() {
    use glm5_ops::index_key_rows::{index_key_rows_reference, write_rows, CacheRows};
    use glm5_ops::quantize_fp8;
    let (t, slots) = (11, 24);
    let indexed: Vec<u32> = (0..t as u32).map(|i| (i * 5 + 2) % slots as u32).collect();
    for (dim, rope) in [(128, 64), (64, 64)] {
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let k: Vec<f32> = activations(4820, t * dim, dtype)
                .iter()
                .map(|v| v * 4.0 + 0.5)
                .collect();
            let k = activations_like(&k, dtype);
            let ln_w = activations(4821, dim, dtype);
            let ln_b = activations_like(
                &activations(4822, dim, DType::F32)
                    .iter()
                    .map(|v| v * 0.1)
                    .collect::<Vec<_>>(),
                dtype,
            );
            let (cos, sin) = rope_tables(4823, t, rope / 2, dtype);
            let tensor = |v: &[f32], shape: &[usize]| common::tensor(v, shape, dtype);
            let keys = index_key_rows_reference(
                &tensor(&k, &[t, dim]),
                (&tensor(&ln_w, &[dim]), &tensor(&ln_b, &[dim])),
                1e-6,
                &tensor(&cos, &[t, rope / 2]),
                &tensor(&sin, &[t, rope / 2]),
            )
            .unwrap();
            let (want_bytes, want_scales) = quantize_fp8(&keys).unwrap();
            let rows_tensor = Tensor::from_slice(&indexed, t, &Device::Cpu).unwrap();
            let (dk, dw, db) = (
                Values::from_f32(&k, dtype),
                Values::from_f32(&ln_w, dtype),
                Values::from_f32(&ln_b, dtype),
            );
            let (dcos, dsin) = (Values::from_f32(&cos, dtype), Values::from_f32(&sin, dtype));
            let rows = DeviceBuffer::from_slice(&indexed);
            let f = [index_key_rows_f32, index_key_rows_bf16][d];
            for (by_index, fp8) in [(false, false), (true, false), (false, true), (true, true)] {
                let place = if by_index {
                    CacheRows::At(&rows_tensor)
                } else {
                    CacheRows::From(5)
                };
                let float_cache = Values::nan(slots * dim, dtype);
                let bytes = DeviceBuffer::<u8>::poisoned(slots * dim, 0xff);
                let scales = DeviceBuffer::<f32>::poisoned(slots, NAN_BYTE);
                let (float_ptr, bytes_ptr, scales_ptr) = if fp8 {
                    (std::ptr::null_mut(), bytes.mut_ptr(), scales.mut_ptr())
                } else {
                    (
                        float_cache.mut_ptr(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                };
                let rows_ptr = if by_index {
                    rows.ptr()
                } else {
                    std::ptr::null()
                };
                run(
                    LaunchConfig::new((t.div_ceil(8) as u32, 1, 1), 256),
                    || unsafe {
                        f(
                            dk.ptr(),
                            dw.ptr(),
                            db.ptr(),
                            1e-6,
                            dcos.ptr(),
                            dsin.ptr(),
                            t as i32,
                            dim as i32,
                            rope as i32,
                            float_ptr,
                            bytes_ptr,
                            scales_ptr,
                            rows_ptr,
                            5,
                        )
                    },
                );
                let what = format!("{dtype:?} D={dim} R={rope} by_index={by_index} fp8={fp8}");
                if !fp8 {
                    let want = tensor(&vec![f32::NAN; slots * dim], &[slots, dim]);
                    write_rows(&want, &keys, place).unwrap();
                    let want = host_f32(&want);
                    for (i, (g, w)) in float_cache.to_f32().iter().zip(&want).enumerate() {
                        let bound = if dtype == DType::BF16 {
                            w.abs() / 128.0
                        } else {
                            1e-5 * w.abs().max(1e-2)
                        };
                        assert!(
                            (w.is_nan() && g.is_nan()) || (g - w).abs() <= bound,
                            "{what}: key value {i}: {g} vs the reference's {w}"
                        );
                    }
                    continue;
                }
                let want_b = Tensor::full(0xffu8, (slots, dim), &Device::Cpu).unwrap();
                let want_s = Tensor::full(f32::NAN, slots, &Device::Cpu).unwrap();
                write_rows(&want_b, &want_bytes, place).unwrap();
                write_rows(&want_s, &want_scales, place).unwrap();
                let want_s = want_s.to_vec1::<f32>().unwrap();
                for (i, (g, w)) in scales.to_vec().iter().zip(&want_s).enumerate() {
                    assert!(
                        (w.is_nan() && g.is_nan()) || (g - w).abs() <= 1e-2 * w.abs(),
                        "{what}: scale {i}: {g} vs the reference's {w}"
                    );
                }
                let want_b = want_b.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                // e4m3 codes of one sign are ordered like their values: one step apart = codes differ by 1.
                for (i, (g, w)) in bytes.to_vec().iter().zip(&want_b).enumerate() {
                    let same_sign = (g ^ w) & 0x80 == 0 || (g & 0x7f == 0 && w & 0x7f == 0);
                    assert!(
                        same_sign && (g & 0x7f).abs_diff(w & 0x7f) <= 1,
                        "{what}: byte {i}: {g:#04x} vs the reference's {w:#04x}"
                    );
                }
            }
        }
    }
}

extern "C" {
    fn absorbed_query_f32(
        q: Ptr,
        q_latent: Ptr,
        cos: Ptr,
        sin: Ptr,
        tokens: i32,
        heads: i32,
        nope: i32,
        rope: i32,
        lora: i32,
        out: MutPtr,
    );
    fn absorbed_query_bf16(
        q: Ptr,
        q_latent: Ptr,
        cos: Ptr,
        sin: Ptr,
        tokens: i32,
        heads: i32,
        nope: i32,
        rope: i32,
        lora: i32,
        out: MutPtr,
    );
    fn rope_leading_f32(x: Ptr, cos: Ptr, sin: Ptr, heads: i32, dim: i32, rope: i32, out: MutPtr);
    fn rope_leading_bf16(x: Ptr, cos: Ptr, sin: Ptr, heads: i32, dim: i32, rope: i32, out: MutPtr);
}

/// Random RoPE tables `[t, half]` as the dtype holds them.
fn rope_tables(seed: u64, t: usize, half: usize, dtype: DType) -> (Vec<f32>, Vec<f32>) {
    let angles: Vec<f32> = activations(seed, t * half, DType::F32)
        .iter()
        .map(|a| a * 3.0)
        .collect();
    (
        activations_like(&angles.iter().map(|a| a.cos()).collect::<Vec<_>>(), dtype),
        activations_like(&angles.iter().map(|a| a.sin()).collect::<Vec<_>>(), dtype),
    )
}

/// The absorbed-query and leading-RoPE kernels as their launchers run them (a block per (token, head)),
/// against the references (candle-nn's rope_i and a concatenation): equal up to f32 rounding, or one bf16
/// rounding, at GLM-5's shapes (MLA: nope 192, RoPE 64, latent 512; indexer: 128 with RoPE on 64) over a
/// few heads.
#[test]
fn query_kernels_equal_the_reference() {
    use glm5_ops::absorbed_query::absorbed_query_reference;
    use glm5_ops::rope_leading::rope_leading_reference;
    let (t, heads) = (3, 5);
    for dtype in [DType::F32, DType::BF16] {
        let d = dtype_index(dtype);
        let tensor = |v: &[f32], shape: &[usize]| common::tensor(v, shape, dtype);
        let check = |what: &str, got: &[f32], want: &[f32]| {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let bound = if dtype == DType::BF16 {
                    w.abs() / 128.0
                } else {
                    1e-6 * w.abs().max(1e-3)
                };
                assert!(
                    (g - w).abs() <= bound,
                    "{what} {dtype:?} value {i}: {g} vs {w}"
                );
            }
        };
        // MLA's absorbed query.
        let (nope, rope, lora) = (192, 64, 512);
        let q = activations(4830, t * heads * (nope + rope), dtype);
        let q_latent = activations(4831, heads * t * lora, dtype);
        let (cos, sin) = rope_tables(4832, t, rope / 2, dtype);
        let want = absorbed_query_reference(
            &tensor(&q, &[t, heads, nope + rope]),
            &tensor(&q_latent, &[heads, t, lora]),
            &tensor(&cos, &[t, rope / 2]),
            &tensor(&sin, &[t, rope / 2]),
        )
        .unwrap();
        let (dq, dl) = (
            Values::from_f32(&q, dtype),
            Values::from_f32(&q_latent, dtype),
        );
        let (dcos, dsin) = (Values::from_f32(&cos, dtype), Values::from_f32(&sin, dtype));
        let out = Values::nan(t * heads * (lora + rope), dtype);
        let f = [absorbed_query_f32, absorbed_query_bf16][d];
        run(
            LaunchConfig::new((t as u32, heads as u32, 1), 128),
            || unsafe {
                f(
                    dq.ptr(),
                    dl.ptr(),
                    dcos.ptr(),
                    dsin.ptr(),
                    t as i32,
                    heads as i32,
                    nope as i32,
                    rope as i32,
                    lora as i32,
                    out.mut_ptr(),
                )
            },
        );
        check("absorbed query", &out.to_f32(), &host_f32(&want));
        // The indexer's query.
        let dim = 128;
        let x = activations(4833, t * heads * dim, dtype);
        let want = rope_leading_reference(
            &tensor(&x, &[t, heads, dim]),
            &tensor(&cos, &[t, rope / 2]),
            &tensor(&sin, &[t, rope / 2]),
        )
        .unwrap();
        let dx = Values::from_f32(&x, dtype);
        let out = Values::nan(t * heads * dim, dtype);
        let f = [rope_leading_f32, rope_leading_bf16][d];
        run(
            LaunchConfig::new((t as u32, heads as u32, 1), 32),
            || unsafe {
                f(
                    dx.ptr(),
                    dcos.ptr(),
                    dsin.ptr(),
                    heads as i32,
                    dim as i32,
                    rope as i32,
                    out.mut_ptr(),
                )
            },
        );
        check("leading RoPE", &out.to_f32(), &host_f32(&want));
    }
}

extern "C" {
    fn attention_rows_f32(
        kv_a: Ptr,
        norm_weight: Ptr,
        norm_eps: f32,
        latent_cache: MutPtr,
        lora: i32,
        k: Ptr,
        ln_weight: Ptr,
        ln_bias: Ptr,
        ln_eps: f32,
        float_keys: MutPtr,
        fp8_bytes: *mut u8,
        fp8_scales: *mut f32,
        key_dim: i32,
        q: Ptr,
        heads: i32,
        q_dim: i32,
        q_out: MutPtr,
        cos: Ptr,
        sin: Ptr,
        rope: i32,
        rows: *const u32,
        first_row: i32,
    );
    fn attention_rows_bf16(
        kv_a: Ptr,
        norm_weight: Ptr,
        norm_eps: f32,
        latent_cache: MutPtr,
        lora: i32,
        k: Ptr,
        ln_weight: Ptr,
        ln_bias: Ptr,
        ln_eps: f32,
        float_keys: MutPtr,
        fp8_bytes: *mut u8,
        fp8_scales: *mut f32,
        key_dim: i32,
        q: Ptr,
        heads: i32,
        q_dim: i32,
        q_out: MutPtr,
        cos: Ptr,
        sin: Ptr,
        rope: i32,
        rows: *const u32,
        first_row: i32,
    );
}

/// The one-launch attention rows as `attention_rows/cuda.rs` launches them (8 warps a block; blocks per token:
/// the latent row, the key, and the query's heads 8 at a time) against the three kernels it replaces, each
/// checked against its reference above, on the same inputs into caches of poison: the same bits in the
/// latent cache, the key cache (float, or FP8 bytes and scales) and the rotated query. GLM-5's widths (latent
/// 512 + RoPE 64, keys and query heads 128 with RoPE on 64) with 11 query heads (a part-filled block), for
/// 3 tokens placed by offset and by row index.
#[test]
fn attention_rows_equal_the_three_kernels() {
    let (t, lora, rope, key_dim, heads, slots) = (3, 512, 64, 128, 11, 16);
    let width = lora + rope;
    let indexed: Vec<u32> = vec![13, 2, 7];
    for dtype in [DType::F32, DType::BF16] {
        let d = dtype_index(dtype);
        let values =
            |seed: u64, len: usize| Values::from_f32(&activations(seed, len, dtype), dtype);
        let (kv_a, norm_w) = (values(4960, t * width), values(4961, lora));
        let (k, ln_w, ln_b) = (
            values(4962, t * key_dim),
            values(4963, key_dim),
            values(4964, key_dim),
        );
        let q = values(4965, t * heads * key_dim);
        let (cos, sin) = rope_tables(4966, t, rope / 2, dtype);
        let (cos, sin) = (Values::from_f32(&cos, dtype), Values::from_f32(&sin, dtype));
        let rows = DeviceBuffer::from_slice(&indexed);
        for (by_index, fp8) in [(false, false), (true, false), (false, true), (true, true)] {
            let rows_ptr = if by_index {
                rows.ptr()
            } else {
                std::ptr::null()
            };
            // [0]: the three kernels; [1]: the one launch.
            let outputs: [_; 2] = std::array::from_fn(|_| {
                (
                    Values::nan(slots * width, dtype),
                    Values::nan(slots * key_dim, dtype),
                    DeviceBuffer::<u8>::poisoned(slots * key_dim, 0xff),
                    DeviceBuffer::<f32>::poisoned(slots, NAN_BYTE),
                    Values::nan(t * heads * key_dim, dtype),
                )
            });
            let key_pointers = |(_, floats, bytes, scales, _): &(
                Values,
                Values,
                DeviceBuffer<u8>,
                DeviceBuffer<f32>,
                Values,
            )| {
                if fp8 {
                    (std::ptr::null_mut(), bytes.mut_ptr(), scales.mut_ptr())
                } else {
                    (floats.mut_ptr(), std::ptr::null_mut(), std::ptr::null_mut())
                }
            };
            let (latent, _, _, _, q_out) = &outputs[0];
            let (float_keys, bytes, scales) = key_pointers(&outputs[0]);
            run(LaunchConfig::new((t as u32, 1, 1), 256), || unsafe {
                [latent_rows_f32, latent_rows_bf16][d](
                    kv_a.ptr(),
                    norm_w.ptr(),
                    1e-6,
                    cos.ptr(),
                    sin.ptr(),
                    latent.mut_ptr(),
                    rows_ptr,
                    4,
                    lora as i32,
                    rope as i32,
                )
            });
            run(LaunchConfig::new((1, 1, 1), 256), || unsafe {
                [index_key_rows_f32, index_key_rows_bf16][d](
                    k.ptr(),
                    ln_w.ptr(),
                    ln_b.ptr(),
                    1e-6,
                    cos.ptr(),
                    sin.ptr(),
                    t as i32,
                    key_dim as i32,
                    rope as i32,
                    float_keys,
                    bytes,
                    scales,
                    rows_ptr,
                    4,
                )
            });
            run(
                LaunchConfig::new((t as u32, heads as u32, 1), 32),
                || unsafe {
                    [rope_leading_f32, rope_leading_bf16][d](
                        q.ptr(),
                        cos.ptr(),
                        sin.ptr(),
                        heads as i32,
                        key_dim as i32,
                        rope as i32,
                        q_out.mut_ptr(),
                    )
                },
            );
            let (latent, _, _, _, q_out) = &outputs[1];
            let (float_keys, bytes, scales) = key_pointers(&outputs[1]);
            run(
                LaunchConfig::new((t as u32, (2 + heads.div_ceil(8)) as u32, 1), 256),
                || unsafe {
                    [attention_rows_f32, attention_rows_bf16][d](
                        kv_a.ptr(),
                        norm_w.ptr(),
                        1e-6,
                        latent.mut_ptr(),
                        lora as i32,
                        k.ptr(),
                        ln_w.ptr(),
                        ln_b.ptr(),
                        1e-6,
                        float_keys,
                        bytes,
                        scales,
                        key_dim as i32,
                        q.ptr(),
                        heads as i32,
                        key_dim as i32,
                        q_out.mut_ptr(),
                        cos.ptr(),
                        sin.ptr(),
                        rope as i32,
                        rows_ptr,
                        4,
                    )
                },
            );
            let what = format!("{dtype:?} by_index={by_index} fp8={fp8}");
            let bits = |v: &Values| v.to_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let scale_bits =
                |v: &DeviceBuffer<f32>| v.to_vec().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let [(l0, f0, b0, s0, q0), (l1, f1, b1, s1, q1)] = &outputs;
            assert_eq!(bits(l1), bits(l0), "{what}: the latent cache");
            assert_eq!(bits(f1), bits(f0), "{what}: the float key cache");
            assert_eq!(b1.to_vec(), b0.to_vec(), "{what}: the FP8 key bytes");
            assert_eq!(scale_bits(s1), scale_bits(s0), "{what}: the FP8 key scales");
            assert_eq!(bits(q1), bits(q0), "{what}: the rotated query");
            // The kernels wrote something: the rows placed (and only those) are no longer poison.
            let written = bits(l0)
                .chunks(width)
                .filter(|row| row.iter().all(|b| !f32::from_bits(*b).is_nan()))
                .count();
            assert_eq!(written, t, "{what}: latent rows written");
        }
    }
}

extern "C" {
    fn head_products_f32(
        x: Ptr,
        x_stride: i32,
        w: Ptr,
        k: i32,
        n: i32,
        y: MutPtr,
        y_stride: i32,
        pe: Ptr,
        pe_stride: i32,
        cos: Ptr,
        sin: Ptr,
        rope: i32,
    );
    fn head_products_bf16(
        x: Ptr,
        x_stride: i32,
        w: Ptr,
        k: i32,
        n: i32,
        y: MutPtr,
        y_stride: i32,
        pe: Ptr,
        pe_stride: i32,
        cos: Ptr,
        sin: Ptr,
        rope: i32,
    );
}

/// The per-head products as `absorbed_query_one_token` launches them (x the rows of q at its head stride,
/// the RoPE half by one more block a head) and as `head_products` does (no RoPE): against the products in
/// f32 (candle's matmul) rounded once, and the RoPE half as `absorbed_query_reference`'s; within f32
/// summation of Σ|x·w| (the order differs) and in bf16 one rounding. GLM-5's W_UK and W_UV widths over 3
/// heads, and a shape with a partial column block and fewer rows than the block's warps take at once.
#[test]
fn head_products_equal_the_reference() {
    use glm5_kernels::interface::attention_rows::{HEAD_PRODUCT_COLUMNS, HEAD_PRODUCT_WARPS};
    use glm5_ops::absorbed_query::absorbed_query_reference;
    use glm5_ops::head_products::head_products_reference;
    for (seed, (heads, k, n, rope)) in [
        (4950, (3, 192, 512, 64)),
        (4951, (3, 512, 256, 0)),
        (4952, (2, 7, 24, 4)),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let width = k + rope;
            let q = activations(seed, heads * width, dtype);
            let w = activations(seed + 100, heads * k * n, dtype);
            let (cos, sin) = rope_tables(seed + 200, 1, rope / 2, dtype);
            let q_t = Tensor::from_slice(&q, (1, heads, width), &Device::Cpu).unwrap();
            let w_t = Tensor::from_slice(&w, (heads, k, n), &Device::Cpu).unwrap();
            let x_t = q_t.squeeze(0).unwrap().narrow(1, 0, k).unwrap();
            let product = head_products_reference(&x_t, &w_t)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want = if rope > 0 {
                let tensor = |v: &[f32], shape: &[usize]| common::tensor(v, shape, dtype);
                absorbed_query_reference(
                    &q_t.to_dtype(dtype).unwrap(),
                    &product.unsqueeze(1).unwrap(),
                    &tensor(&cos, &[1, rope / 2]),
                    &tensor(&sin, &[1, rope / 2]),
                )
                .unwrap()
            } else {
                product
            };
            let want = host_f32(&want);
            let (dq, dw) = (Values::from_f32(&q, dtype), Values::from_f32(&w, dtype));
            let (dcos, dsin) = (Values::from_f32(&cos, dtype), Values::from_f32(&sin, dtype));
            let out = Values::nan(heads * (n + rope), dtype);
            let f = [head_products_f32, head_products_bf16][d];
            let blocks = n.div_ceil(HEAD_PRODUCT_COLUMNS) + usize::from(rope > 0);
            run(
                LaunchConfig::new(
                    (blocks as u32, heads as u32, 1),
                    (HEAD_PRODUCT_WARPS * 32) as u32,
                ),
                || unsafe {
                    f(
                        dq.ptr(),
                        width as i32,
                        dw.ptr(),
                        k as i32,
                        n as i32,
                        out.mut_ptr(),
                        (n + rope) as i32,
                        dq.ptr().byte_add(k * dtype.size_in_bytes()),
                        width as i32,
                        dcos.ptr(),
                        dsin.ptr(),
                        rope as i32,
                    )
                },
            );
            let got = out.to_f32();
            let own = if dtype == DType::BF16 {
                1.0 / 128.0
            } else {
                0.0
            };
            for (i, (g, v)) in got.iter().zip(&want).enumerate() {
                let (h, c) = (i / (n + rope), i % (n + rope));
                let bound = if c < n {
                    let magnitude: f32 = (0..k)
                        .map(|r| (q[h * width + r] * w[(h * k + r) * n + c]).abs())
                        .sum();
                    k as f32 * f32::EPSILON * magnitude + own * v.abs()
                } else {
                    // RoPE: the same roundings as the reference's.
                    own * v.abs() + 1e-6
                };
                assert!(
                    (g - v).abs() <= bound,
                    "{dtype:?} [{heads}, {k}, {n}] head {h} column {c}: {g} vs {v}"
                );
            }
        }
    }
}

// ---- SwiGLU ----------------------------------------------------------------------------------------------

extern "C" {
    fn swiglu_f32(x: Ptr, rows: i32, inter: i32, vectors: i32, out: MutPtr);
    fn swiglu_bf16(x: Ptr, rows: i32, inter: i32, vectors: i32, out: MutPtr);
}

/// SwiGLU over stacked gate|up rows as `swiglu/cuda.rs` launches it (a grid-stride loop, 16-byte vectors
/// where the width allows, else single values), against the reference: the same f32 arithmetic on the host,
/// so equal bit for bit.
#[test]
fn swiglu_equals_the_reference() {
    for (seed, (rows, inter)) in [(4900, (3, 20)), (4901, (5, 64)), (4902, (2, 2048))] {
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let gate_up: Vec<f32> = activations(seed, rows * 2 * inter, dtype)
                .iter()
                .map(|v| 8.0 * v)
                .collect();
            let want = host_f32(
                &glm5_ops::swiglu::swiglu_reference(
                    &common::tensor(&gate_up, &[rows, 2 * inter], dtype),
                    inter,
                )
                .unwrap(),
            );
            let device_in = Values::from_f32(&gate_up, dtype);
            let per_vector = 16 / dtype.size_in_bytes();
            for vectors in [0, 1] {
                if vectors == 1 && inter % per_vector != 0 {
                    continue;
                }
                let out = Values::nan(rows * inter, dtype);
                let items = if vectors == 1 {
                    rows * inter / per_vector
                } else {
                    rows * inter
                };
                // Fewer blocks than items: the grid-stride loop's later passes run too.
                let blocks = items.div_ceil(256).div_ceil(2).max(1) as u32;
                let f = [swiglu_f32, swiglu_bf16][d];
                run(LaunchConfig::new((blocks, 1, 1), 256), || unsafe {
                    f(
                        device_in.ptr(),
                        rows as i32,
                        inter as i32,
                        vectors,
                        out.mut_ptr(),
                    )
                });
                for (i, (g, w)) in out.to_f32().iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype:?} {rows}x{inter} vectors={vectors} value {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

// ---- argmax ----------------------------------------------------------------------------------------------

extern "C" {
    fn argmax_f32(x: Ptr, cols: i32, vectors: i32, out: MutPtr);
    fn argmax_bf16(x: Ptr, cols: i32, vectors: i32, out: MutPtr);
    fn argmax_span_f32(x: Ptr, cols: i32, vectors: i32, span: i32, best: MutPtr, at: MutPtr);
    fn argmax_span_bf16(x: Ptr, cols: i32, vectors: i32, span: i32, best: MutPtr, at: MutPtr);
    fn argmax_spans(best: Ptr, at: Ptr, spans: i32, out: MutPtr);
}

/// The argmax kernel as `argmax/cuda.rs` launches it (a block of 1024 threads per row; 16-byte vectors where
/// the width allows, else single values) against the reference, on random rows with planted cases: the
/// maximum repeated (the lowest index wins), a NaN (it wins), every value -inf, a row of one value.
#[test]
fn argmax_equals_the_reference() {
    for (seed, (rows, cols)) in [
        (4950, (4, 5000)),
        (4951, (3, 37)),
        (4952, (2, 1)),
        (4953, (6, 4096)),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let d = dtype_index(dtype);
            let mut x = activations(seed, rows * cols, dtype);
            if cols > 8 {
                // Row 0: its maximum at two places; row 1: a NaN past a large value; row 2: all -inf.
                x[cols / 3] = 7.0;
                x[cols / 2] = 7.0;
                if rows > 2 {
                    x[cols + 1] = 9.0;
                    x[cols + cols - 2] = f32::NAN;
                    x[2 * cols..3 * cols].fill(f32::NEG_INFINITY);
                }
            }
            let want: Vec<u32> =
                glm5_ops::argmax::argmax_reference(&common::tensor(&x, &[rows, cols], dtype))
                    .unwrap()
                    .to_vec1()
                    .unwrap();
            if cols > 8 {
                assert_eq!(
                    want[0],
                    (cols / 3) as u32,
                    "the reference keeps the first maximum"
                );
            }
            let device_x = Values::from_f32(&x, dtype);
            let per_vector = 16 / dtype.size_in_bytes();
            for vectors in [0, 1] {
                if vectors == 1 && cols % per_vector != 0 {
                    continue;
                }
                let out: DeviceBuffer<u32> = DeviceBuffer::poisoned(rows, NAN_BYTE);
                let f = [argmax_f32, argmax_bf16][d];
                run(LaunchConfig::new((rows as u32, 1, 1), 1024), || unsafe {
                    f(
                        device_x.ptr(),
                        cols as i32,
                        vectors,
                        out.mut_ptr() as MutPtr,
                    )
                });
                assert_eq!(
                    out.to_vec(),
                    want,
                    "{dtype:?} {rows}x{cols} vectors={vectors}"
                );
                // Spans of 160 vectors' values (several a row, more than one pass of a warp each, the last
                // one short), then their best a row, as the launcher chains them for long rows.
                let span = 160 * per_vector;
                let spans = cols.div_ceil(span);
                let best: DeviceBuffer<f32> = DeviceBuffer::poisoned(rows * spans, NAN_BYTE);
                let at: DeviceBuffer<u32> = DeviceBuffer::poisoned(rows * spans, NAN_BYTE);
                let out: DeviceBuffer<u32> = DeviceBuffer::poisoned(rows, NAN_BYTE);
                let f = [argmax_span_f32, argmax_span_bf16][d];
                run(
                    LaunchConfig::new((rows as u32, spans as u32, 1), 32),
                    || unsafe {
                        f(
                            device_x.ptr(),
                            cols as i32,
                            vectors,
                            span as i32,
                            best.mut_ptr() as MutPtr,
                            at.mut_ptr() as MutPtr,
                        )
                    },
                );
                run(LaunchConfig::new((rows as u32, 1, 1), 32), || unsafe {
                    argmax_spans(
                        best.ptr() as Ptr,
                        at.ptr() as Ptr,
                        spans as i32,
                        out.mut_ptr() as MutPtr,
                    )
                });
                assert_eq!(
                    out.to_vec(),
                    want,
                    "{dtype:?} {rows}x{cols} vectors={vectors} in {spans} spans"
                );
            }
        }
    }
}
