//! NVFP4 W4A4 (the `nvfp4-w4a4-mma-sm120` backend's numerics, `nvfp4_matmul` module contract) on the CPU:
//! the W4A4 reference lies within the derived bound (`common/w4a4_bound.rs`) of the W4A16 reference at
//! GLM-5's NVFP4 projection shapes (read from the NVFP4 export's config), on fresh random weights and
//! activations (with outlier channels, a zero row and a row whose blocks get subnormal e4m3 scales); the
//! seed is printed. The activation quantiser itself is checked in `ops/tests/nvfp4_w4a4.rs`.

use glm5::candle_core::{DType, Device, Tensor};
use glm5::ops::nvfp4_matmul::{self, reference, Nvfp4Weight, Prefill};
use glm5::Config;

#[path = "common/bound_tools.rs"]
mod bound_tools;
#[path = "common/w4a4_bound.rs"]
mod w4a4_bound;
use w4a4_bound::{against_bound, median, seed, w4a4_activations, w4a4_error_bound, Stream};

fn glm5_config() -> Config {
    Config::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/assets/glm5_nvfp4/config.json"
    ))
    .unwrap()
}

/// `(out, in)` of GLM-5's NVFP4 matrices: an expert's gate/up and down (also the shared expert's),
/// `q_a_proj` and `kv_a_proj_with_mqa` (576 rows: not a multiple of the GEMM's 128-column tile).
fn glm5_shapes(config: &Config) -> Vec<(usize, usize)> {
    vec![
        (config.moe_intermediate_size, config.hidden_size),
        (config.hidden_size, config.moe_intermediate_size),
        (config.q_lora_rank, config.hidden_size),
        (
            config.kv_lora_rank + config.qk_rope_head_dim,
            config.hidden_size,
        ),
    ]
}

/// A random NVFP4 weight on the CPU: random codes, e4m3 scales with exponent fields 4..=9, a global scale.
fn weight(rng: &mut Stream, n: usize, k: usize) -> Nvfp4Weight {
    let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.next() as u8).collect();
    let scales: Vec<u8> = (0..n * k / 16)
        .map(|_| (((4 + rng.next() % 6) as u8) << 3) | (rng.next() % 8) as u8)
        .collect();
    Nvfp4Weight {
        packed: Tensor::from_vec(packed, (n, k / 2), &Device::Cpu).unwrap(),
        scales: Tensor::from_vec(scales, (n, k / 16), &Device::Cpu).unwrap(),
        global_scale: 1e-4 + rng.uniform() * 1e-3,
    }
}

#[test]
fn w4a4_reference_is_within_the_derived_bound_of_w4a16() {
    let config = glm5_config();
    let seed = seed();
    println!("seed {seed}");
    let mut rng = Stream(seed);
    for (n, k) in glm5_shapes(&config) {
        let w = weight(&mut rng, n, k);
        for m in [17, 33] {
            let x = w4a4_activations(&mut rng, m, k);
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let w4a4 = reference::nvfp4_matmul_w4a4(&x, &w).unwrap();
                let w4a16 = reference::nvfp4_matmul(&x, &w).unwrap();
                let bound = w4a4_error_bound(&x, &w);
                let (worst, rows) = against_bound(&w4a4, &w4a16, &bound);
                // Rows 1 (zeros) and 2 (one huge value) aside: the ordinary rows' relative distance.
                let ordinary = median(&rows[3..]);
                println!(
                    "W4A4 vs W4A16 [{n}, {k}] x [{m}, {k}] ({dtype:?} inputs): worst |difference| / bound \
                     {worst:.3}; relative distance per row: median {ordinary:.3e}, zero row {:.1e}, \
                     outlier row {:.3e}",
                    rows[1], rows[2]
                );
                assert!(
                    worst <= 1.0,
                    "[{n},{k}] m={m}: W4A4 outside the derived bound ({worst})"
                );
                assert_eq!(rows[1], 0.0, "a zero row gives zeros");
                // The activations' quantisation is visible (W4A4 is not W4A16 by another name) and well
                // below the outputs' size.
                assert!(
                    ordinary > 1e-3 && ordinary < 0.25,
                    "[{n},{k}] m={m}: {ordinary}"
                );
            }
        }
    }
}

/// The op's own entry point: `Prefill::W4a4Sm120` on the CPU is an error once rows exceed MAX_ROWS (the
/// backend cannot run there), never W4A16 in its place; up to MAX_ROWS the decode backend runs.
#[test]
fn w4a4_on_the_cpu_is_an_error_not_a_fallback() {
    let config = glm5_config();
    let mut rng = Stream(seed());
    let (n, k) = (config.kv_lora_rank, config.q_lora_rank);
    let w = weight(&mut rng, n, k);
    let decode = w4a4_activations(&mut rng, nvfp4_matmul::MAX_ROWS, k);
    let got = nvfp4_matmul::nvfp4_matmul_with(&decode, &w, Prefill::W4a4Sm120).unwrap();
    let want = reference::nvfp4_matmul(&decode, &w).unwrap();
    let diff = (got - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0);
    let prefill = w4a4_activations(&mut rng, nvfp4_matmul::MAX_ROWS + 1, k);
    let err = nvfp4_matmul::nvfp4_matmul_with(&prefill, &w, Prefill::W4a4Sm120).unwrap_err();
    assert!(
        err.to_string().contains(nvfp4_matmul::W4A4_MMA_SM120),
        "{err}"
    );
}
