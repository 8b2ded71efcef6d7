//! `glm5-bench fp8-prefill`: FP8 prefill of `--tokens` tokens (default 4096, bf16 activations) through each of
//! GLM-5's FP8 projections outside the routed experts (sizes from the published GLM-5-FP8 config), by each
//! prefill path of `fp8_matmul`, in TFLOP/s against the device's FP8 peak measured in the same run:
//!
//! * W8A8 (`fp8-w8a8-cublaslt-block`, pinned: the dispatch does not choose it yet): glm5's activation
//!   quantiser, then cuBLASLt's block-scaled FP8 GEMM; the GEMM alone and the quantiser alone as well;
//! * W8A16 (what the dispatch chooses today): the weight dequantised to bf16, then candle's bf16 matmul;
//! * the FP8 peak: a plain cuBLASLt FP8 GEMM with per-tensor scales at 8192³ (with and without cuBLASLt's
//!   fast accumulation; the faster is the peak), and the bf16 GEMM rate (cuBLAS 8192³) for scale.
//!
//! Times are `timing::median_seconds`: the median over rounds of back-to-back calls, each round closed by a
//! device sync (host launches included, as a prefill step pays them; at these sizes they are noise).
//! Random weights (finite e4m3 bytes, unit block scales) and activations. Where W8A8 cannot run (not sm_90,
//! or cuBLASLt older than 12.9) its columns say so and the rest is measured.

use glm5::candle_core::{DType, Device, Result, Tensor};
use glm5::ops::fp8_matmul::{self, Fp8BlockWeight, Fp8Prefill};

use crate::cuda;
use crate::matvec::e4m3;
use crate::timing::median_seconds;

/// Side of the square FP8 GEMM that measures the peak.
const PEAK_SIDE: usize = 8192;

/// The device's FP8 tensor-core rate in flop/s: cuBLASLt's FP8 GEMM with per-tensor scales at 8192³, without
/// and with fast accumulation; `(plain, fast)`.
pub fn fp8_peak(device: &Device) -> Result<(f64, f64)> {
    let n = PEAK_SIDE;
    let mut state = 0xf8_u64;
    let a = Tensor::from_vec(e4m3(&mut state, n * n), (n, n), device)?;
    let b = Tensor::from_vec(e4m3(&mut state, n * n), (n, n), device)?;
    let flops = 2.0 * (n as f64).powi(3);
    let mut rates = [0.0; 2];
    for (rate, fast) in rates.iter_mut().zip([false, true]) {
        let seconds = median_seconds(device, 5, 4, || {
            fp8_matmul::fp8_gemm_per_tensor(&a, &b, DType::BF16, fast)
                .map(drop)
                .map_err(cuda)
        })?;
        *rate = flops / seconds;
    }
    Ok((rates[0], rates[1]))
}

/// `(name, out, in, count)` of GLM-5's FP8 projections outside the routed experts, `count` the matrices of
/// that shape a layer multiplies by separately (gate_proj and up_proj are two).
fn shapes(config: &glm5::Config) -> Vec<(&'static str, usize, usize, usize)> {
    let h = config.hidden_size;
    let shared = config.moe_intermediate_size * config.n_shared_experts;
    vec![
        ("q_a_proj", config.q_lora_rank, h, 1),
        (
            "q_b_proj",
            config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim),
            config.q_lora_rank,
            1,
        ),
        (
            "kv_a_proj_with_mqa",
            config.kv_lora_rank + config.qk_rope_head_dim,
            h,
            1,
        ),
        (
            "o_proj",
            h,
            config.num_attention_heads * config.v_head_dim,
            1,
        ),
        ("shared expert gate_proj, up_proj (each)", shared, h, 2),
        ("shared expert down_proj", h, shared, 1),
        (
            "dense MLP gate_proj, up_proj (each)",
            config.intermediate_size,
            h,
            2,
        ),
        ("dense MLP down_proj", h, config.intermediate_size, 1),
    ]
}

pub fn fp8_prefill_rows(device: &Device, tokens: usize) -> Result<()> {
    let config = glm5::Config::from_json(include_str!("../../tests/assets/glm5_fp8/config.json"))
        .map_err(cuda)?;
    let block = match &config.quantization {
        Some(glm5::models::Quantization::Fp8Block { block, .. }) => *block,
        other => glm5::candle_core::bail!("the GLM-5-FP8 config has no FP8 block size: {other:?}"),
    };
    let desc = glm5::DeviceDesc::of(device).map_err(cuda)?;
    let version = fp8_matmul::cublaslt_version().unwrap_or(0);
    let version_text = format!(
        "{}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    let (plain, fast) = fp8_peak(device)?;
    let peak = plain.max(fast);
    let bf16 = crate::e2e::gemm_peak(device)?;
    println!(
        "device {desc}, cuBLASLt {version_text}: FP8 GEMM (cuBLASLt, per-tensor scales, {PEAK_SIDE}³) {:.0} TFLOP/s, \
         {:.0} with fast accumulation: FP8 peak {:.0} TFLOP/s; bf16 GEMM (cuBLAS {PEAK_SIDE}³) {:.0} TFLOP/s",
        plain / 1e12,
        fast / 1e12,
        peak / 1e12,
        bf16 / 1e12
    );
    // W8A8 runs where its backend validates for prefill rows (compute capability and cuBLASLt version).
    let w8a8_backend = fp8_matmul::backends()
        .into_iter()
        .find(|b| b.name == fp8_matmul::W8A8_CUBLASLT_BLOCK)
        .expect("the W8A8 backend is listed");
    println!(
        "FP8 prefill of {tokens} tokens (bf16 activations), GLM-5's FP8 projections ([out, in], {}x{} blocks): \
         TFLOP/s and % of the FP8 peak",
        block[0], block[1]
    );
    println!(
        "| projection | [out, in] | W8A8 quantise + GEMM | W8A8 GEMM alone | quantise alone ms | W8A16 dequantise + bf16 GEMM |"
    );
    println!("|---|---|---|---|---|---|");
    let mut state = 0x5eed_u64;
    let x = Tensor::randn(0f32, 1.0, (tokens, config.hidden_size), device)?;
    let (mut total_flops, mut total_w8a8, mut total_w8a16) = (0.0, 0.0, 0.0);
    let mut w8a8_everywhere = true;
    for (name, n, k, count) in shapes(&config) {
        let x = if k == config.hidden_size {
            x.clone()
        } else {
            Tensor::randn(0f32, 1.0, (tokens, k), device)?
        }
        .to_dtype(DType::BF16)?;
        let w = Fp8BlockWeight {
            weight: Tensor::from_vec(e4m3(&mut state, n * k), (n, k), device)?,
            scale_inv: Tensor::ones(
                (n.div_ceil(block[0]), k.div_ceil(block[1])),
                DType::F32,
                device,
            )?,
            block,
        };
        let flops = 2.0 * (tokens * n * k) as f64;
        let cell = |seconds: f64| {
            format!(
                "{:.3} ms, {:.0} TFLOP/s = {:.1}%",
                seconds * 1e3,
                flops / seconds / 1e12,
                100.0 * flops / seconds / peak
            )
        };
        let shape = glm5::ops::weight_only::WeightShape {
            out_dim: n,
            in_dim: k,
            block_in: block[1],
            block_out: block[0],
        };
        let w8a16 = median_seconds(device, 5, 5, || {
            fp8_matmul::fp8_matmul(&x, &w).map(drop).map_err(cuda)
        })?;
        let (w8a8_cells, w8a8) =
            match w8a8_backend.validate(&shape, &desc, glm5::ops::weight_only::Rows::Prefill) {
                Ok(()) => {
                    let whole = median_seconds(device, 5, 5, || {
                        fp8_matmul::fp8_matmul_with(&x, &w, Fp8Prefill::W8a8Block)
                            .map(drop)
                            .map_err(cuda)
                    })?;
                    let acts = fp8_matmul::quantize_activations(&x).map_err(cuda)?;
                    let gemm = median_seconds(device, 5, 5, || {
                        fp8_matmul::w8a8_matmul(&acts, &w, DType::BF16)
                            .map(drop)
                            .map_err(cuda)
                    })?;
                    let quantise = median_seconds(device, 5, 5, || {
                        fp8_matmul::quantize_activations(&x).map(drop).map_err(cuda)
                    })?;
                    (
                        format!("{} | {} | {:.3}", cell(whole), cell(gemm), quantise * 1e3),
                        Some(whole),
                    )
                }
                Err(reasons) => {
                    let list: Vec<String> = reasons.iter().map(ToString::to_string).collect();
                    (format!("not run: {} | | ", list.join("; ")), None)
                }
            };
        println!("| {name} | [{n}, {k}] | {w8a8_cells} | {} |", cell(w8a16));
        total_flops += count as f64 * flops;
        total_w8a16 += count as f64 * w8a16;
        match w8a8 {
            Some(seconds) => total_w8a8 += count as f64 * seconds,
            None => w8a8_everywhere = false,
        }
    }
    let rate = |seconds: f64| {
        format!(
            "{:.3} ms, {:.0} TFLOP/s = {:.1}% of the FP8 peak",
            seconds * 1e3,
            total_flops / seconds / 1e12,
            100.0 * total_flops / seconds / peak
        )
    };
    println!(
        "every projection above once (an attention block, a shared expert and a dense MLP): W8A16 {}; W8A8 {}",
        rate(total_w8a16),
        if w8a8_everywhere {
            rate(total_w8a8)
        } else {
            "not run on every projection".to_string()
        }
    );
    Ok(())
}
