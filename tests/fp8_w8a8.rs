//! FP8 W8A8 (the `fp8-w8a8-cublaslt-block` backend's numerics, `fp8_matmul` module contract) on the CPU:
//! the W8A8 reference lies within the derived bound (`common/w8a8_bound.rs`) of the W8A16 reference at
//! GLM-5's FP8 projection shapes (read from the published FP8 config), on fresh random weights and
//! activations (with outlier channels, a zero row, a huge and a tiny group); the seed is printed. Then the
//! dispatch and `glm5 plan`: the backend is chosen for prefill rows on sm_90 (W8A16 for decode rows), and
//! rejected elsewhere with its reasons. The quantiser itself is checked in `ops/tests/fp8_w8a8.rs`.

use glm5::candle_core::{DType, Tensor};
use glm5::ops::fp8_matmul::{self, reference, Fp8Prefill, W8A8_GROUP};
use glm5::ops::weight_only::Rows;
use glm5::DeviceDesc;

#[path = "common/bound_tools.rs"]
mod bound_tools;
#[path = "common/w8a8_bound.rs"]
mod w8a8_bound;
use w8a8_bound::{
    against_bound, fp8_block, glm5_fp8_config, glm5_fp8_shapes, median, random_fp8_weight, seed,
    w8a8_activations, w8a8_error_bound, Stream,
};

/// Output rows checked per projection: the bound is per output, so the first rows of a matrix stand for it
/// (the reduction, `in`, is always whole); `kv_a_proj_with_mqa`'s 576 rows are all taken (its partial block).
const MAX_OUT_ROWS: usize = 1024;

#[test]
fn w8a8_reference_is_within_the_derived_bound_of_w8a16() {
    let config = glm5_fp8_config();
    let block = fp8_block(&config);
    assert_eq!(
        block,
        [W8A8_GROUP, W8A8_GROUP],
        "GLM-5-FP8's weight_block_size"
    );
    let seed = seed();
    println!("seed {seed}");
    let mut rng = Stream(seed);
    for (name, out, k) in glm5_fp8_shapes(&config) {
        let n = out.min(MAX_OUT_ROWS);
        let w = random_fp8_weight(&mut rng, n, k);
        for m in [fp8_matmul::MAX_ROWS + 1, 33] {
            let x = w8a8_activations(&mut rng, m, k);
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let w8a8 = reference::fp8_matmul_w8a8(&x, &w).unwrap();
                let w8a16 = reference::fp8_matmul(&x, &w).unwrap();
                let bound = w8a8_error_bound(&x, &w);
                let (worst, rows) = against_bound(&w8a8, &w8a16, &bound);
                // Rows 1 (zeros) and 2 (a huge and a tiny group) aside: the ordinary rows' relative distance.
                let ordinary = median(&rows[3..]);
                println!(
                    "W8A8 vs W8A16 {name} [{out}, {k}] (rows ..{n}) x [{m}, {k}] ({dtype:?} inputs): worst |difference| / bound \
                     {worst:.3}; relative distance per row: median {ordinary:.3e}, zero row {:.1e}, huge/tiny \
                     row {:.3e}",
                    rows[1], rows[2]
                );
                assert!(
                    worst <= 1.0,
                    "{name} [{n},{k}] m={m}: W8A8 outside the derived bound ({worst})"
                );
                assert_eq!(rows[1], 0.0, "a zero row gives zeros");
                // The activations' rounding is visible (W8A8 is not W8A16 by another name) and small next to
                // the outputs: e4m3 keeps 3 mantissa bits.
                assert!(
                    ordinary > 1e-3 && ordinary < 0.1,
                    "{name} [{n},{k}] m={m}: {ordinary}"
                );
            }
        }
    }
}

/// The dispatch of every GLM-5 FP8 projection: W8A8 is chosen for its prefill rows on sm_90 (the shapes and
/// the 128x128 blocks fit cuBLASLt's block-scaled GEMM), W8A16 for its decode rows; on sm_120 and sm_100 W8A8
/// is rejected for its compute capability.
#[test]
fn dispatch_chooses_w8a8_for_prefill_on_sm90_with_reasons_elsewhere() {
    let config = glm5_fp8_config();
    let block = fp8_block(&config);
    let sm90 = DeviceDesc::assume("sm_90:141GB", 0).unwrap();
    for (name, n, k) in glm5_fp8_shapes(&config) {
        let w = fp8_matmul::Fp8BlockWeight {
            weight: Tensor::zeros((n, k), DType::U8, &glm5::candle_core::Device::Cpu).unwrap(),
            scale_inv: Tensor::zeros(
                (n.div_ceil(block[0]), k.div_ceil(block[1])),
                DType::F32,
                &glm5::candle_core::Device::Cpu,
            )
            .unwrap(),
            block,
        };
        let choice = fp8_matmul::dispatch(&w, &sm90).unwrap();
        assert_eq!(choice.decode.name, "fp8-w8a16-cuda", "{name}");
        assert_eq!(
            choice.prefill.name,
            fp8_matmul::W8A8_CUBLASLT_BLOCK,
            "{name}"
        );
        assert_eq!(Fp8Prefill::of(&choice), Fp8Prefill::W8a8Block);
        let w8a8 = fp8_matmul::backends()
            .into_iter()
            .find(|b| b.name == fp8_matmul::W8A8_CUBLASLT_BLOCK)
            .unwrap();
        let shape = glm5::ops::weight_only::WeightShape {
            out_dim: n,
            in_dim: k,
            block_in: block[1],
            block_out: block[0],
        };
        assert!(
            w8a8.validate(&shape, &sm90, Rows::Prefill).is_ok(),
            "{name} [{n}, {k}]"
        );
        for other in ["sm_120:96GB", "sm_100:180GB"] {
            let reasons = w8a8
                .validate(
                    &shape,
                    &DeviceDesc::assume(other, 0).unwrap(),
                    Rows::Prefill,
                )
                .unwrap_err();
            assert!(reasons[0].to_string().contains("compute capability"));
        }
    }
}

fn glm5_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_glm5"))
        .args(args)
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .expect("runs")
}

/// `glm5 plan` on the GLM-5-FP8 config names the FP8 backends per device: on sm_90 W8A16 for decode rows and
/// W8A8 for prefill rows (W8A16 ranked below there), on sm_120 W8A16 for both with W8A8 rejected for its
/// compute capability.
#[test]
fn plan_names_the_fp8_backends() {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/assets/glm5_fp8/config.json"
    );
    for (assume, chosen, not_chosen) in [
        (
            "sm_90:141GB x8",
            "decode fp8-w8a16-cuda, prefill fp8-w8a8-cublaslt-block",
            "fp8-w8a16-cuda for prefill (> 16 rows): ranked below",
        ),
        (
            "sm_120:96GB x16",
            "decode fp8-w8a16-cuda, prefill fp8-w8a16-cuda",
            "fp8-w8a8-cublaslt-block",
        ),
    ] {
        let out = glm5_cli(&["plan", "--model", config, "--assume", assume]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| {
                l.trim_start()
                    .starts_with("FP8 (128x128 blocks) on cuda:0,")
            })
            .unwrap_or_else(|| panic!("no FP8 line in\n{text}"));
        assert!(line.contains(chosen), "{assume}: {line}");
        assert!(line.contains(not_chosen), "{assume}: {line}");
        if assume.starts_with("sm_120") {
            assert!(line.contains("compute capability ∈ {9.0}"), "{line}");
        }
    }
}
