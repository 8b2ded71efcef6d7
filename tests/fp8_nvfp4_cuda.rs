//! The W8A16 (block-scaled FP8) and W4A16 (NVFP4) CUDA kernels against the CPU reference on fresh random
//! weights and activations, every shape path (mat-vec up to MAX_ROWS rows, dequantise-then-matmul above,
//! partial scale blocks), f32 and bf16 activations; the kernels' outputs start as NaN, so a missed element
//! fails. Then the quantised fixtures on the GPU against their dequantised f32 copies. The NVFP4 W4A4
//! backend (`nvfp4-w4a4-mma-sm120`) against its CPU reference and the W4A16 bound, on sm_120 only: on any
//! other GPU that test says loudly that it did not check the kernels, and checks that asking for them is an
//! error. The FP8 W8A8 path (`fp8-w8a8-cublaslt-block`): its activation quantiser bit for bit against the CPU
//! reference on any GPU; on sm_90 its cuBLASLt GEMM exactly on inputs whose sums are exact in any order and
//! accumulator, and within derived tolerances of the CPU W8A8 and W8A16 references at GLM-5's shapes (on any
//! other GPU that test says loudly that it did not run, and checks that asking for it is an error). Built
//! with `--features cuda`, run on the GPU machine.
#![cfg(feature = "cuda")]

use glm5::candle_core::{DType, Device, Tensor};
use glm5::ops::fp8_matmul::{self, Fp8BlockWeight};
use glm5::ops::nvfp4_matmul::{self, Nvfp4Weight, Prefill};
use glm5::{AttentionMode, Config, DeviceDesc, Glm5ForCausalLM};

#[path = "common/bound_tools.rs"]
mod bound_tools;
#[path = "common/fixtures.rs"]
mod fixtures;
#[path = "common/w4a4_bound.rs"]
mod w4a4_bound;
#[path = "common/w8a8_bound.rs"]
mod w8a8_bound;
use fixtures::{decode_rows, fixture_dir, max_abs_diff, reference};
use w4a4_bound::{seed, w4a4_activations, Stream};

fn relative_error(got: &Tensor, want: &Tensor) -> f32 {
    let got = got
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let diff = (got - want)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    let norm = want
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    assert!(
        diff.is_finite(),
        "non-finite output (an element not written?)"
    );
    diff / norm
}

fn activations(rng: &mut Stream, m: usize, k: usize) -> Tensor {
    let x: Vec<f32> = (0..m * k).map(|_| rng.uniform() * 2.0 - 1.0).collect();
    Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap()
}

/// Shapes: GLM-5's kv_a_proj_with_mqa (576 rows: a partial 128-block), an expert's down_proj, odd sizes.
const FP8_SHAPES: [(usize, usize, [usize; 2]); 4] = [
    (576, 6144, [128, 128]),
    (6144, 2048, [128, 128]),
    (100, 48, [128, 128]),
    (37, 80, [16, 32]),
];
const ROWS: [usize; 6] = [1, 2, 7, 16, 17, 64];

#[test]
fn fp8_kernels_match_the_cpu_reference() {
    let gpu = Device::new_cuda(0).unwrap();
    let seed = seed();
    println!("seed {seed}");
    let mut rng = Stream(seed);
    for (n, k, block) in FP8_SHAPES {
        let scale_shape = (n.div_ceil(block[0]), k.div_ceil(block[1]));
        let scales: Vec<f32> = (0..scale_shape.0 * scale_shape.1)
            .map(|_| 1e-3 + rng.uniform() * 1e-2)
            .collect();
        let cpu = Fp8BlockWeight {
            weight: Tensor::from_vec(rng.e4m3(n * k, false), (n, k), &Device::Cpu).unwrap(),
            scale_inv: Tensor::from_vec(scales, scale_shape, &Device::Cpu).unwrap(),
            block,
        };
        let on_gpu = Fp8BlockWeight {
            weight: cpu.weight.to_device(&gpu).unwrap(),
            scale_inv: cpu.scale_inv.to_device(&gpu).unwrap(),
            block,
        };
        for m in ROWS {
            let x = activations(&mut rng, m, k);
            for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
                let x_dtype = x.to_dtype(dtype).unwrap();
                let want =
                    fp8_matmul::reference::fp8_matmul(&x_dtype.to_dtype(DType::F32).unwrap(), &cpu)
                        .unwrap();
                let got =
                    fp8_matmul::fp8_matmul(&x_dtype.to_device(&gpu).unwrap(), &on_gpu).unwrap();
                assert_eq!(got.dtype(), dtype);
                let err = relative_error(&got, &want);
                println!("fp8 [{n}, {k}] block {block:?} x [{m}, {k}] {dtype:?}: relative error {err:.2e}");
                assert!(err < tolerance, "fp8 [{n},{k}] m={m} {dtype:?}: {err}");
            }
        }
    }
}

/// A random NVFP4 weight `[n, k]` (positive e4m3 group scales, a small global scale) on the CPU and the same
/// on `gpu`.
fn random_nvfp4(rng: &mut Stream, n: usize, k: usize, gpu: &Device) -> (Nvfp4Weight, Nvfp4Weight) {
    let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.next() as u8).collect();
    let cpu = Nvfp4Weight {
        packed: Tensor::from_vec(packed, (n, k / 2), &Device::Cpu).unwrap(),
        scales: Tensor::from_vec(rng.e4m3(n * k / 16, true), (n, k / 16), &Device::Cpu).unwrap(),
        global_scale: 1e-4 + rng.uniform() * 1e-3,
    };
    let on_gpu = Nvfp4Weight {
        packed: cpu.packed.to_device(gpu).unwrap(),
        scales: cpu.scales.to_device(gpu).unwrap(),
        global_scale: cpu.global_scale,
    };
    (cpu, on_gpu)
}

const NVFP4_SHAPES: [(usize, usize); 3] = [(2048, 6144), (6144, 2048), (24, 48)];

#[test]
fn nvfp4_kernels_match_the_cpu_reference() {
    let gpu = Device::new_cuda(0).unwrap();
    let seed = seed();
    println!("seed {seed}");
    let mut rng = Stream(seed);
    for (n, k) in NVFP4_SHAPES {
        let (cpu, on_gpu) = random_nvfp4(&mut rng, n, k, &gpu);
        for m in ROWS {
            let x = activations(&mut rng, m, k);
            for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
                let x_dtype = x.to_dtype(dtype).unwrap();
                let want = nvfp4_matmul::reference::nvfp4_matmul(
                    &x_dtype.to_dtype(DType::F32).unwrap(),
                    &cpu,
                )
                .unwrap();
                let got =
                    nvfp4_matmul::nvfp4_matmul(&x_dtype.to_device(&gpu).unwrap(), &on_gpu).unwrap();
                assert_eq!(got.dtype(), dtype);
                let err = relative_error(&got, &want);
                println!("nvfp4 [{n}, {k}] x [{m}, {k}] {dtype:?}: relative error {err:.2e}");
                assert!(err < tolerance, "nvfp4 [{n},{k}] m={m} {dtype:?}: {err}");
            }
        }
    }
}

/// Decode-shaped timing of the mat-vec kernels (batch 1, bf16) at GLM-5's projection shapes, printed for
/// the record: the bytes each must stream over its time, against a device copy measured here (read + write
/// over time, as the benchmarks measure it). Not an assertion: the bandwidth target belongs to
/// `glm5-bench e2e --weights fp8|nvfp4`.
#[test]
fn matvec_bandwidth_is_reported() {
    let gpu = Device::new_cuda(0).unwrap();
    let mut rng = Stream(seed());
    let time = |f: &dyn Fn()| {
        f();
        gpu.synchronize().unwrap();
        let start = std::time::Instant::now();
        for _ in 0..50 {
            f();
        }
        gpu.synchronize().unwrap();
        start.elapsed().as_secs_f64() / 50.0
    };
    let src = Tensor::zeros(512usize << 20, DType::U8, &gpu).unwrap();
    let copy = 2.0 * (512u64 << 20) as f64 / time(&|| drop(src.copy().unwrap()));
    println!("device copy: {:.0} GB/s", copy / 1e9);
    // q_b_proj, o_proj, an expert's gate_up (2I rows) and down.
    for (n, k) in [(16384, 2048), (6144, 16384), (4096, 6144), (6144, 2048)] {
        let x = activations(&mut rng, 1, k)
            .to_dtype(DType::BF16)
            .unwrap()
            .to_device(&gpu)
            .unwrap();
        let fp8 = Fp8BlockWeight {
            weight: Tensor::from_vec(rng.e4m3(n * k, false), (n, k), &gpu).unwrap(),
            scale_inv: Tensor::ones((n / 128, k / 128), DType::F32, &gpu).unwrap(),
            block: [128, 128],
        };
        let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.next() as u8).collect();
        let nvfp4 = Nvfp4Weight {
            packed: Tensor::from_vec(packed, (n, k / 2), &gpu).unwrap(),
            scales: Tensor::from_vec(rng.e4m3(n * k / 16, true), (n, k / 16), &gpu).unwrap(),
            global_scale: 1.0,
        };
        let fp8_bytes = (n * k + (n / 128) * (k / 128) * 4) as f64;
        let t = time(&|| drop(fp8_matmul::fp8_matmul(&x, &fp8).unwrap()));
        println!(
            "fp8 mat-vec [{n}, {k}]: {:.1} us, {:.0} GB/s = {:.0}% of copy",
            t * 1e6,
            fp8_bytes / t / 1e9,
            100.0 * fp8_bytes / t / copy
        );
        let nvfp4_bytes = (n * k / 2 + n * k / 16) as f64;
        let t = time(&|| drop(nvfp4_matmul::nvfp4_matmul(&x, &nvfp4).unwrap()));
        println!(
            "nvfp4 mat-vec [{n}, {k}]: {:.1} us, {:.0} GB/s = {:.0}% of copy",
            t * 1e6,
            nvfp4_bytes / t / 1e9,
            100.0 * nvfp4_bytes / t / copy
        );
    }
}

/// The quantised fixtures on the GPU (bf16 and f32 activations) against their dequantised f32 copies on the
/// CPU: the whole graph through the kernels, prefill (dequantise path) and decode (mat-vec).
#[test]
fn quantised_fixtures_on_gpu_match_the_dequantised_model() {
    let gpu = Device::new_cuda(0).unwrap();
    let (ids, _) = reference("dense_equiv");
    for case in ["fp8_block128", "fp8_block16", "nvfp4"] {
        let dir = fixture_dir("quantized").join(case);
        let want = decode_rows(
            &Glm5ForCausalLM::from_dir(
                dir.join("dequantized"),
                DType::F32,
                &Device::Cpu,
                AttentionMode::Sparse,
            )
            .unwrap(),
            &ids,
            ids.len() / 2,
        );
        let model =
            Glm5ForCausalLM::from_dir(&dir, DType::F32, &gpu, AttentionMode::Sparse).unwrap();
        let err = max_abs_diff(&decode_rows(&model, &ids, ids.len() / 2), &want);
        println!("{case} f32 on GPU: max |Δ| = {err:.2e}");
        assert!(err < 2e-3, "{case} f32: {err}");
        // bf16 activations, per position ‖Δ‖/‖f32‖ as model_cuda measures bf16. These tiny models use large
        // weights and drift a few per cent in bf16, so the bound is relative to what bf16 does to the same
        // weights unquantised (the dequantised model in bf16 on the GPU, dense kernels): the quantised kernels
        // must not drift further, beyond a margin. The NVFP4 fixture's routers have near-ties that bf16
        // rounding flips at one position (on the CPU's reference path as well: tests/fp8_nvfp4.rs), so the
        // worst position of each run is left out.
        let drift = |model: &Glm5ForCausalLM| {
            fixtures::second_worst_relative_l2(&decode_rows(model, &ids, ids.len() / 2), &want)
        };
        let quantized = drift(
            &Glm5ForCausalLM::from_dir(&dir, DType::BF16, &gpu, AttentionMode::Sparse).unwrap(),
        );
        let dense = drift(
            &Glm5ForCausalLM::from_dir(
                dir.join("dequantized"),
                DType::BF16,
                &gpu,
                AttentionMode::Sparse,
            )
            .unwrap(),
        );
        println!(
            "{case} bf16 on GPU, second-worst position's relative L2 against f32: quantised {quantized:.3}, \
             the dequantised weights in bf16 {dense:.3}"
        );
        assert!(
            quantized <= 1.25 * dense + 0.02,
            "{case} bf16: quantised {quantized} vs dense bf16 {dense}"
        );
    }
}

/// GEMM shapes `(out, in, rows)` for the W4A4 backend, from GLM-5's NVFP4 export config: an expert's
/// gate/up and down, `q_a_proj`, `kv_a_proj_with_mqa` (576 columns: a partial 128-tile), with row counts
/// that are not multiples of the 128-row tile; and two small odd ones (a single partial tile each way).
fn w4a4_shapes() -> Vec<(usize, usize, usize)> {
    let config = Config::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/assets/glm5_nvfp4/config.json"
    ))
    .unwrap();
    let group = nvfp4_matmul::GROUP;
    vec![
        (config.moe_intermediate_size, config.hidden_size, 17),
        (config.hidden_size, config.moe_intermediate_size, 130),
        (config.q_lora_rank, config.hidden_size, 64),
        (
            config.kv_lora_rank + config.qk_rope_head_dim,
            config.hidden_size,
            200,
        ),
        (100, 16 * group, 33),
        (8, 8 * group, 129),
    ]
}

fn host<T: glm5::candle_core::WithDType>(t: &Tensor) -> Vec<T> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The W4A4 GEMM on sm_120's block-scaled FP4 MMA: its activation quantiser bit for bit against the CPU
/// reference's; its output against the CPU W4A4 reference within what an f32 sum in another order can
/// differ by (`2 (in - 1) 2^-24 Σ|products|`, plus one bf16 rounding for bf16), and against the W4A16
/// reference within the derived bound; then a prefill-sized timing, printed.
#[test]
fn nvfp4_w4a4_sm120_matches_the_cpu_references() {
    let gpu = Device::new_cuda(0).unwrap();
    let desc = DeviceDesc::of(&gpu).unwrap();
    let capability = desc.capability().expect("a CUDA device");
    let seed = seed();
    println!("seed {seed}");
    let mut rng = Stream(seed);
    if (capability.major, capability.minor) != (12, 0) {
        println!(
            "NOT RUN: {} needs an sm_120 GPU (compute capability 12.0); this one is {capability}. The W4A4 \
             kernels were NOT checked here. Checked instead: asking for them on this GPU is an error.",
            nvfp4_matmul::W4A4_MMA_SM120
        );
        let (n, k) = (64, 8 * 16);
        let w = Nvfp4Weight {
            packed: Tensor::zeros((n, k / 2), DType::U8, &gpu).unwrap(),
            scales: Tensor::zeros((n, k / 16), DType::U8, &gpu).unwrap(),
            global_scale: 1.0,
        };
        let x = w4a4_activations(&mut rng, nvfp4_matmul::MAX_ROWS + 1, k)
            .to_device(&gpu)
            .unwrap();
        let err = nvfp4_matmul::nvfp4_matmul_with(&x, &w, Prefill::W4a4Sm120).unwrap_err();
        println!("  the error: {err}");
        assert!(err.to_string().contains("sm_120"), "{err}");
        assert!(nvfp4_matmul::quantize_activations(&x).is_err());
        return;
    }
    println!(
        "{}: running the W4A4 kernels on {capability}",
        nvfp4_matmul::W4A4_MMA_SM120
    );
    for (n, k, m) in w4a4_shapes() {
        let (cpu, on_gpu) = random_nvfp4(&mut rng, n, k, &gpu);
        let x = w4a4_activations(&mut rng, m, k);
        for dtype in [DType::F32, DType::BF16] {
            let x_dtype = x.to_dtype(dtype).unwrap();
            let x_read = x_dtype.to_dtype(DType::F32).unwrap();
            let x_gpu = x_dtype.to_device(&gpu).unwrap();

            let want = nvfp4_matmul::reference::quantize_activations(&x_read).unwrap();
            let got = nvfp4_matmul::quantize_activations(&x_gpu).unwrap();
            assert_eq!(
                host::<u8>(&got.codes),
                host::<u8>(&want.codes),
                "codes [{m}, {k}] {dtype:?}"
            );
            assert_eq!(
                host::<u8>(&got.scales),
                host::<u8>(&want.scales),
                "scales [{m}, {k}] {dtype:?}"
            );
            let (g_got, g_want) = (host::<f32>(&got.row_scales), host::<f32>(&want.row_scales));
            assert!(
                g_got
                    .iter()
                    .zip(&g_want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "row scales [{m}, {k}] {dtype:?}"
            );

            let y = nvfp4_matmul::nvfp4_matmul_with(&x_gpu, &on_gpu, Prefill::W4a4Sm120).unwrap();
            assert_eq!(y.dtype(), dtype);
            assert_eq!(y.dims(), [m, n]);
            let y_host = host::<f32>(&y.to_dtype(DType::F32).unwrap());
            let (reference, magnitude) =
                nvfp4_matmul::reference::nvfp4_matmul_w4a4_with_magnitudes(&x_read, &cpu).unwrap();
            let (reference, magnitude) = (host::<f32>(&reference), host::<f32>(&magnitude));
            let order = 2.0 * (k - 1) as f64 * w4a4_bound::U;
            let rounding = if dtype == DType::BF16 {
                1.0 / 256.0
            } else {
                0.0
            };
            let mut worst = 0.0f64;
            for i in 0..m * n {
                let d = (y_host[i] as f64 - reference[i] as f64).abs();
                let tolerance = order * magnitude[i] as f64 * (1.0 + rounding)
                    + rounding * (reference[i] as f64).abs()
                    + f32::MIN_POSITIVE as f64;
                assert!(
                    d <= tolerance,
                    "[{n}, {k}] x [{m}, {k}] {dtype:?}: y[{}, {}] = {} vs reference {} (tolerance {tolerance:e})",
                    i / n,
                    i % n,
                    y_host[i],
                    reference[i]
                );
                worst = worst.max(d / tolerance);
            }
            let w4a16 = nvfp4_matmul::reference::nvfp4_matmul(&x_read, &cpu).unwrap();
            let mut bound = w4a4_bound::w4a4_error_bound(&x_read, &cpu);
            if dtype == DType::BF16 {
                let w4a16_host = host::<f32>(&w4a16);
                for (b, v) in bound.iter_mut().zip(&w4a16_host) {
                    *b += rounding * 1.01 * (*b + (*v as f64).abs());
                }
            }
            let (against_w4a16, rows) = w4a4_bound::against_bound(&y, &w4a16, &bound);
            println!(
                "w4a4 [{n}, {k}] x [{m}, {k}] {dtype:?}: worst |y - reference| / tolerance {worst:.3}; \
                 vs W4A16: worst / bound {against_w4a16:.3}, median relative distance per row {:.3e}",
                w4a4_bound::median(&rows[3..])
            );
            assert!(
                against_w4a16 <= 1.0,
                "[{n},{k}] m={m} {dtype:?}: {against_w4a16}"
            );
        }
    }

    // Prefill-sized timing at an expert's gate/up shape (printed, not asserted).
    let (n, k, _) = w4a4_shapes()[0];
    let m = 4096;
    let w = Nvfp4Weight {
        packed: Tensor::zeros((n, k / 2), DType::U8, &gpu).unwrap(),
        scales: Tensor::zeros((n, k / 16), DType::U8, &gpu).unwrap(),
        global_scale: 1.0,
    };
    let x = Tensor::ones((m, k), DType::BF16, &gpu).unwrap();
    let run = || drop(nvfp4_matmul::nvfp4_matmul_with(&x, &w, Prefill::W4a4Sm120).unwrap());
    run();
    gpu.synchronize().unwrap();
    let start = std::time::Instant::now();
    let reps = 20;
    for _ in 0..reps {
        run();
    }
    gpu.synchronize().unwrap();
    let seconds = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "w4a4 [{n}, {k}] x [{m}, {k}] bf16 (quantise + GEMM): {:.3} ms, {:.1} TFLOP/s",
        seconds * 1e3,
        2.0 * (m * n * k) as f64 / seconds / 1e12
    );
}

// ---------------------------------------------------------------------------------------------------------
// FP8 W8A8 (`fp8-w8a8-cublaslt-block`)

/// Fills and frees device buffers of the sizes the W8A8 path allocates next (codes, scales, output) with
/// 0xff bytes (NaN scales and outputs, the e4m3 code 0xff): the memory pool usually hands them back to
/// the kernels, so an element they fail to write shows up as a mismatch or a NaN.
fn poison_w8a8(gpu: &Device, rows_padded: usize, n: usize, k: usize) {
    for bytes in [
        rows_padded * k,
        4 * rows_padded * (k / fp8_matmul::W8A8_GROUP),
        4 * rows_padded * n,
    ] {
        if bytes > 0 {
            drop(Tensor::full(0xffu8, bytes, gpu).unwrap());
        }
    }
    gpu.synchronize().unwrap();
}

/// `acts`' codes and scales on the host, all padded rows included.
fn host_acts(acts: &fp8_matmul::Fp8Activations) -> (Vec<u8>, Vec<u32>) {
    let scales: Vec<f32> = host(&acts.scales);
    (
        host::<u8>(&acts.codes),
        scales.iter().map(|s| s.to_bits()).collect(),
    )
}

/// Activations for the quantiser: `w8a8_activations` (outliers, a zero row, a huge and a tiny group) with,
/// in row 3, groups at 10^30 and 10^-40 (subnormal f32: amax / 448 underflows) and -0.0 values.
fn quantiser_activations(rng: &mut w8a8_bound::Stream, m: usize, k: usize) -> Tensor {
    let group = fp8_matmul::W8A8_GROUP;
    let mut x: Vec<f32> = w8a8_bound::w8a8_activations(rng, m, k)
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let row3 = &mut x[3 * k..4 * k];
    for v in &mut row3[..group] {
        *v *= 1e30;
    }
    for v in &mut row3[group..2 * group] {
        *v *= 1e-40;
    }
    for v in row3[2 * group..3 * group].iter_mut().step_by(3) {
        *v = -0.0;
    }
    Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap()
}

/// The W8A8 activation quantiser (`kernels/src/fp8_quantize.cu`, sm_90 and sm_120 SASS) bit for bit against
/// the CPU reference: codes and scales of every row, padding rows included, f32 and bf16 inputs, at GLM-5's
/// widths and an odd row count.
#[test]
fn fp8_w8a8_quantiser_matches_the_cpu_reference() {
    let gpu = Device::new_cuda(0).unwrap();
    let seed = w8a8_bound::seed();
    println!("seed {seed}");
    let mut rng = w8a8_bound::Stream(seed);
    let config = w8a8_bound::glm5_fp8_config();
    let quick = std::env::var_os("GLM5_QUICK").is_some();
    let tokens = if quick { 333 } else { 4096 };
    for (m, k) in [
        (333, config.hidden_size),
        (fp8_matmul::MAX_ROWS + 1, config.q_lora_rank),
        (tokens, config.num_attention_heads * config.v_head_dim),
    ] {
        let x = quantiser_activations(&mut rng, m, k);
        for dtype in [DType::F32, DType::BF16] {
            let x_dtype = x.to_dtype(dtype).unwrap();
            let want =
                fp8_matmul::reference::quantize_activations(&x_dtype.to_dtype(DType::F32).unwrap())
                    .unwrap();
            let x_gpu = x_dtype.to_device(&gpu).unwrap();
            poison_w8a8(&gpu, fp8_matmul::w8a8_padded_rows(m), 0, k);
            let got = fp8_matmul::quantize_activations(&x_gpu).unwrap();
            assert_eq!(got.rows, m);
            assert_eq!(got.codes.dims(), want.codes.dims());
            assert_eq!(got.scales.dims(), want.scales.dims());
            let ((got_codes, got_scales), (want_codes, want_scales)) =
                (host_acts(&got), host_acts(&want));
            let first = |a: &[u8], b: &[u8]| a.iter().zip(b).position(|(x, y)| x != y);
            assert!(
                got_codes == want_codes,
                "codes [{m}, {k}] {dtype:?}: first difference at byte {:?}",
                first(&got_codes, &want_codes)
            );
            assert!(
                got_scales == want_scales,
                "scales [{m}, {k}] {dtype:?}: first difference at {:?}",
                got_scales
                    .iter()
                    .zip(&want_scales)
                    .position(|(a, b)| a != b)
            );
            println!(
                "w8a8 quantiser [{m}, {k}] {dtype:?}: codes and scales equal the CPU reference's"
            );
        }
    }
}

/// e4m3 codes of values in {0, ±0.5, ±1, ±1.5, ±2} and power-of-two scales 2^-1..2^1: every product and
/// every partial sum of a W8A8 GEMM over them is a multiple of 2^-6 below 2^18 (at most 128 blocks of 128):
/// exact in f32 and in an FP8 accumulator of 13 or more bits, in any order.
fn exact_codes(rng: &mut w8a8_bound::Stream, n: usize) -> Vec<u8> {
    const VALUES: [f32; 9] = [0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0];
    (0..n)
        .map(|_| fp8_matmul::reference::e4m3_satfinite(VALUES[(rng.next() % 9) as usize]))
        .collect()
}

fn exact_scales(rng: &mut w8a8_bound::Stream, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| [0.5, 1.0, 2.0][(rng.next() % 3) as usize])
        .collect()
}

/// cuBLASLt's block-scaled FP8 GEMM (W8A8) on sm_90:
/// 1. exactly (f32 output bit for bit, bf16 within its rounding) on inputs whose every sum is exact whatever
///    the order and the FP8 accumulator's width (`exact_codes`): the codes', scales' and output's layouts;
/// 2. on random inputs at GLM-5's shapes (4096 tokens x hidden 6144 -> q_lora 2048, kv_a_proj's 576 rows with
///    a partial block, an odd 333 rows) against the CPU W8A8 product of the GPU's own quantised activations.
///    Tolerance per output: Hopper's FP8 tensor cores add a block's products with fewer bits than f32
///    (DeepSeek-V3 §3.3.2: about 14), so an f32 summation-order bound does not hold inside a block; with an
///    accumulator of 14 bits rounding at each of a block's 128 additions the error is at most
///    `128 · 2^-13 = 2^-6` of the block's `Σ|products|`; the blocks' f32 sum and the reference's add
///    `(γ_L + γ_K) Σ|p|`, a bf16 output half an ulp (2^-8) of the value. That worst case is loose, so the
///    relative L2 error of every 128 x 128 output tile must also stay below 1% (rounding alone gives about
///    10^-3; a wrong scale layout or block mapping gives O(1));
/// 3. the whole path `fp8_matmul_with(.., W8a8Block)` within the derived bound of W8A16 plus that
///    accumulator term; then a prefill-sized timing, printed.
#[test]
fn fp8_w8a8_sm90_matches_the_cpu_references() {
    let gpu = Device::new_cuda(0).unwrap();
    let desc = DeviceDesc::of(&gpu).unwrap();
    let capability = desc.capability().expect("a CUDA device");
    let seed = w8a8_bound::seed();
    println!("seed {seed}");
    let mut rng = w8a8_bound::Stream(seed);
    let config = w8a8_bound::glm5_fp8_config();
    let group = fp8_matmul::W8A8_GROUP;
    let version = fp8_matmul::cublaslt_version().unwrap();
    println!(
        "cuBLASLt {}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    if (capability.major, capability.minor) != (9, 0) {
        println!(
            "NOT RUN: {} needs an sm_90 GPU (compute capability 9.0, where NVIDIA documents cuBLASLt's \
             128-element block-scaled FP8 modes); this one is {capability}. The W8A8 GEMM was NOT checked \
             here. Checked instead: asking for it on this GPU is an error.",
            fp8_matmul::W8A8_CUBLASLT_BLOCK
        );
        let (n, k) = (64, 2 * group);
        let w = Fp8BlockWeight {
            weight: Tensor::zeros((n, k), DType::U8, &gpu).unwrap(),
            scale_inv: Tensor::ones((1, 2), DType::F32, &gpu).unwrap(),
            block: [group, group],
        };
        let x = Tensor::ones((fp8_matmul::MAX_ROWS + 1, k), DType::BF16, &gpu).unwrap();
        let err =
            fp8_matmul::fp8_matmul_with(&x, &w, fp8_matmul::Fp8Prefill::W8a8Block).unwrap_err();
        println!("  the error: {err}");
        assert!(err.to_string().contains("9.0"), "{err}");
        return;
    }
    assert!(
        version >= fp8_matmul::MIN_CUBLASLT_VERSION,
        "cuBLASLt {version} predates the block-scaled FP8 modes"
    );
    let quick = std::env::var_os("GLM5_QUICK").is_some();
    let tokens = if quick { 333 } else { 4096 };
    let h = config.hidden_size;
    let kv_a = config.kv_lora_rank + config.qk_rope_head_dim;
    let o_in = config.num_attention_heads * config.v_head_dim;

    // 1. Exact sums: codes, scales and output layouts.
    for (n, k, m) in [(kv_a, h, 333), (config.q_lora_rank, h, 64), (h, o_in, 48)] {
        let padded = fp8_matmul::w8a8_padded_rows(m);
        let mut codes = exact_codes(&mut rng, padded * k);
        codes[m * k..].fill(0); // padding rows are zeros
        let acts_cpu = fp8_matmul::Fp8Activations {
            codes: Tensor::from_vec(codes, (padded, k), &Device::Cpu).unwrap(),
            scales: Tensor::from_vec(
                exact_scales(&mut rng, (k / group) * padded),
                (k / group, padded),
                &Device::Cpu,
            )
            .unwrap(),
            rows: m,
        };
        let w_cpu = Fp8BlockWeight {
            weight: Tensor::from_vec(exact_codes(&mut rng, n * k), (n, k), &Device::Cpu).unwrap(),
            scale_inv: Tensor::from_vec(
                exact_scales(&mut rng, n.div_ceil(group) * (k / group)),
                (n.div_ceil(group), k / group),
                &Device::Cpu,
            )
            .unwrap(),
            block: [group, group],
        };
        let acts_gpu = fp8_matmul::Fp8Activations {
            codes: acts_cpu.codes.to_device(&gpu).unwrap(),
            scales: acts_cpu.scales.to_device(&gpu).unwrap(),
            rows: m,
        };
        let w_gpu = Fp8BlockWeight {
            weight: w_cpu.weight.to_device(&gpu).unwrap(),
            scale_inv: w_cpu.scale_inv.to_device(&gpu).unwrap(),
            block: w_cpu.block,
        };
        let want = host::<f32>(&fp8_matmul::reference::w8a8_product(&acts_cpu, &w_cpu).unwrap());
        poison_w8a8(&gpu, padded, n, k);
        let got = fp8_matmul::w8a8_matmul(&acts_gpu, &w_gpu, DType::F32).unwrap();
        assert_eq!(got.dims(), [m, n]);
        let got = host::<f32>(&got);
        let wrong = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert!(
            wrong == 0,
            "exact W8A8 [{n}, {k}] x [{m}, {k}] f32: {wrong} outputs differ; first at {:?}: {:?}",
            got.iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits()),
            got.iter()
                .zip(&want)
                .find(|(a, b)| a.to_bits() != b.to_bits())
        );
        poison_w8a8(&gpu, padded, n, k);
        let got16 = fp8_matmul::w8a8_matmul(&acts_gpu, &w_gpu, DType::BF16).unwrap();
        let got16 = host::<f32>(&got16.to_dtype(DType::F32).unwrap());
        let (mut rounded_alike, mut one_ulp) = (0usize, 0usize);
        for (g, w) in got16.iter().zip(&want) {
            let nearest = half::bf16::from_f32(*w).to_f32();
            if g.to_bits() == nearest.to_bits() {
                rounded_alike += 1;
            } else {
                // Another rounding of the exact f32 value: the other bf16 neighbour.
                let ulp = (half::bf16::from_f32(*w).to_f32() - *w).abs() * 2.0 + f32::MIN_POSITIVE;
                assert!(
                    (g - w).abs() <= ulp.max(w.abs() / 128.0),
                    "exact W8A8 [{n}, {k}] bf16: {g} for {w}"
                );
                one_ulp += 1;
            }
        }
        println!(
            "w8a8 exact [{n}, {k}] x [{m}, {k}]: f32 bit for bit; bf16 {rounded_alike} rounded to nearest even, \
             {one_ulp} to the other neighbour"
        );
    }

    // 2. and 3. Random inputs at GLM-5's shapes.
    for (n, k, m) in [
        (config.q_lora_rank, h, tokens),
        (kv_a, h, 333),
        (config.q_lora_rank, h, 333),
    ] {
        let w_cpu = w8a8_bound::random_fp8_weight(&mut rng, n, k);
        let w_gpu = Fp8BlockWeight {
            weight: w_cpu.weight.to_device(&gpu).unwrap(),
            scale_inv: w_cpu.scale_inv.to_device(&gpu).unwrap(),
            block: w_cpu.block,
        };
        let x = w8a8_bound::w8a8_activations(&mut rng, m, k);
        let w_abs = fp8_matmul::reference::dequantize(&w_cpu)
            .unwrap()
            .abs()
            .unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let x_dtype = x.to_dtype(dtype).unwrap();
            let x_read = x_dtype.to_dtype(DType::F32).unwrap();
            let x_gpu = x_dtype.to_device(&gpu).unwrap();
            let acts = fp8_matmul::quantize_activations(&x_gpu).unwrap();
            let acts_host = fp8_matmul::Fp8Activations {
                codes: acts.codes.to_device(&Device::Cpu).unwrap(),
                scales: acts.scales.to_device(&Device::Cpu).unwrap(),
                rows: m,
            };
            let reference =
                host::<f32>(&fp8_matmul::reference::w8a8_product(&acts_host, &w_cpu).unwrap());
            let x_hat = fp8_matmul::reference::dequantize_activations(&acts_host).unwrap();
            let magnitude = host::<f32>(&x_hat.abs().unwrap().matmul(&w_abs.t().unwrap()).unwrap());
            poison_w8a8(&gpu, acts.rows_padded().unwrap(), n, k);
            let y = fp8_matmul::w8a8_matmul(&acts, &w_gpu, dtype).unwrap();
            assert_eq!((y.dims(), y.dtype()), (&[m, n][..], dtype));
            let y = host::<f32>(&y.to_dtype(DType::F32).unwrap());
            let gamma =
                |len: usize| len as f64 * w8a8_bound::U / (1.0 - len as f64 * w8a8_bound::U);
            let output_rounding = if dtype == DType::BF16 {
                2f64.powi(-8)
            } else {
                0.0
            };
            let accumulation = 2f64.powi(-6) + gamma(k / group) + gamma(k);
            let mut worst = 0.0f64;
            for i in 0..m * n {
                let d = (y[i] as f64 - reference[i] as f64).abs();
                let tolerance = accumulation * magnitude[i] as f64 * (1.0 + output_rounding)
                    + output_rounding * (reference[i] as f64).abs()
                    + f32::MIN_POSITIVE as f64;
                assert!(
                    d <= tolerance,
                    "W8A8 GEMM [{n}, {k}] x [{m}, {k}] {dtype:?}: y[{}, {}] = {} vs reference {} (tolerance {tolerance:e})",
                    i / n,
                    i % n,
                    y[i],
                    reference[i]
                );
                worst = worst.max(d / tolerance);
            }
            // Relative L2 per 128 x 128 output tile.
            let mut worst_tile = (0.0f64, 0, 0);
            for r0 in (0..m).step_by(group) {
                for c0 in (0..n).step_by(group) {
                    let (mut diff, mut norm) = (0.0f64, 0.0f64);
                    for r in r0..(r0 + group).min(m) {
                        for c in c0..(c0 + group).min(n) {
                            let (g, w) = (y[r * n + c] as f64, reference[r * n + c] as f64);
                            diff += (g - w) * (g - w);
                            norm += w * w;
                        }
                    }
                    let relative = if norm > 0.0 {
                        (diff / norm).sqrt()
                    } else {
                        diff.sqrt()
                    };
                    if relative > worst_tile.0 {
                        worst_tile = (relative, r0, c0);
                    }
                }
            }
            println!(
                "w8a8 GEMM [{n}, {k}] x [{m}, {k}] {dtype:?}: worst |y - reference| / tolerance {worst:.3}, worst \
                 tile relative L2 {:.2e} (rows {}.., columns {}..)",
                worst_tile.0, worst_tile.1, worst_tile.2
            );
            assert!(
                worst_tile.0 < 1e-2,
                "[{n},{k}] m={m} {dtype:?}: tile {worst_tile:?}"
            );

            // 3. The whole path against W8A16.
            poison_w8a8(&gpu, acts.rows_padded().unwrap(), n, k);
            let full =
                fp8_matmul::fp8_matmul_with(&x_gpu, &w_gpu, fp8_matmul::Fp8Prefill::W8a8Block)
                    .unwrap();
            assert_eq!((full.dims(), full.dtype()), (&[m, n][..], dtype));
            let w8a16 = fp8_matmul::reference::fp8_matmul(&x_read, &w_cpu).unwrap();
            let w8a16_host = host::<f32>(&w8a16);
            let mut bound = w8a8_bound::w8a8_error_bound(&x_read, &w_cpu);
            for ((b, mag), v) in bound.iter_mut().zip(&magnitude).zip(&w8a16_host) {
                *b += accumulation * *mag as f64;
                *b += output_rounding * 1.01 * (*b + (*v as f64).abs());
            }
            let (against_w8a16, rows) = w8a8_bound::against_bound(&full, &w8a16, &bound);
            println!(
                "w8a8 path [{n}, {k}] x [{m}, {k}] {dtype:?}: vs W8A16 worst / bound {against_w8a16:.3}, median \
                 relative distance per row {:.3e}",
                w8a8_bound::median(&rows[3..])
            );
            assert!(
                against_w8a16 <= 1.0,
                "[{n},{k}] m={m} {dtype:?}: {against_w8a16}"
            );
            assert_eq!(rows[1], 0.0, "a zero row gives zeros");
        }
    }

    // Prefill-sized timing at q_a_proj's shape (printed, not asserted; glm5-bench fp8-prefill has the table).
    let (n, k, m) = (config.q_lora_rank, h, tokens);
    let w = w8a8_bound::random_fp8_weight(&mut rng, n, k);
    let w = Fp8BlockWeight {
        weight: w.weight.to_device(&gpu).unwrap(),
        scale_inv: w.scale_inv.to_device(&gpu).unwrap(),
        block: w.block,
    };
    let x = Tensor::randn(0f32, 1.0, (m, k), &gpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let time = |f: &dyn Fn()| {
        f();
        gpu.synchronize().unwrap();
        let start = std::time::Instant::now();
        let reps = 20;
        for _ in 0..reps {
            f();
        }
        gpu.synchronize().unwrap();
        start.elapsed().as_secs_f64() / reps as f64
    };
    let flops = 2.0 * (m * n * k) as f64;
    let w8a8 = time(&|| {
        drop(fp8_matmul::fp8_matmul_with(&x, &w, fp8_matmul::Fp8Prefill::W8a8Block).unwrap())
    });
    let w8a16 = time(&|| drop(fp8_matmul::fp8_matmul(&x, &w).unwrap()));
    println!(
        "[{n}, {k}] x [{m}, {k}] bf16: W8A8 (quantise + cuBLASLt GEMM) {:.3} ms = {:.0} TFLOP/s; W8A16 \
         (dequantise + bf16 GEMM) {:.3} ms = {:.0} TFLOP/s",
        w8a8 * 1e3,
        flops / w8a8 / 1e12,
        w8a16 * 1e3,
        flops / w8a16 / 1e12
    );
}
