//! `glm5-bench moe`: one GLM-5 MoE layer's experts (256 routed + the shared one as a slot, real sizes,
//! random bf16 weights) by each implementation of `glm5_ops::moe::experts`, at decode batches and prefill
//! lengths: µs per call, the bytes of the experts the routes touch over the measured copy bandwidth (the
//! floor), and for long inputs TFLOP/s against the bf16 GEMM rate measured in the same run.

use std::collections::HashSet;

use glm5::candle_core::{DType, Device, Result, Tensor};
use glm5::ops::moe::{experts_with, route, ExpertsImpl, RouteRule};

use crate::cuda;
use crate::timing::median_seconds;

pub fn moe_rows(device: &Device, copy: f64, gemm: f64) -> Result<()> {
    let config = glm5::Config::from_json(include_str!("../../tests/assets/glm5_config.json"))
        .map_err(cuda)?;
    let (hidden, inter, routed) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_routed_experts,
    );
    let stacked = routed + 1; // the shared expert as the last slot
    let rule = RouteRule {
        n_group: config.n_group,
        topk_group: config.topk_group,
        top_k: config.num_experts_per_tok,
        normalise: config.norm_topk_prob,
        scaling: config.routed_scaling_factor as f32,
    };
    // One expert at a time: candle's element-wise kernels index with 32 bits, and a whole stacked
    // projection has more than 2^32 elements.
    let stack = |rows: usize, cols: usize| -> Result<Tensor> {
        let experts = (0..stacked)
            .map(|_| Tensor::randn(0f32, 0.02, (rows, cols), device)?.to_dtype(DType::BF16))
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&experts, 0)
    };
    let gate_up = stack(2 * inter, hidden)?;
    let down = stack(hidden, inter)?;
    let bias = Tensor::zeros(routed, DType::F32, device)?;
    let expert_bytes = (3 * hidden * inter * 2) as f64;
    println!(
        "MoE experts, GLM-5 sizes: {routed} routed + 1 shared (a slot), hidden {hidden}, intermediate {inter}, top-{}; copy {:.0} GB/s, bf16 GEMM {:.0} TFLOP/s",
        rule.top_k,
        copy / 1e9,
        gemm / 1e12
    );
    println!("| tokens | experts touched | floor µs | mat-vec µs | cuBLAS grouped GEMM µs | bucketed batched GEMM µs | candle moe_gemm µs | per-expert chain µs | best / floor | TFLOP/s (best) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for tokens in [1usize, 8, 32, 64, 256, 1024, 4096] {
        let x = Tensor::randn(0f32, 1.0, (tokens, hidden), device)?.to_dtype(DType::BF16)?;
        let logits = Tensor::randn(0f32, 1.0, (tokens, routed), device)?;
        let routes = route(&logits, &bias, &rule, Some(routed as u32)).map_err(cuda)?;
        let touched: HashSet<u32> = routes
            .ids
            .flatten_all()?
            .to_vec1::<u32>()?
            .into_iter()
            .collect();
        let floor = touched.len() as f64 * expert_bytes / copy;
        let flops = 2.0 * (tokens * (rule.top_k + 1) * 3 * hidden * inter) as f64;
        let time = |which: ExpertsImpl| -> Result<Option<f64>> {
            if which == ExpertsImpl::DeviceMatVec && tokens > 1024 {
                return Ok(None); // CUDA-core FMAs at thousands of tokens: not a contender
            }
            let rounds = if tokens >= 1024 { 3 } else { 5 };
            Ok(Some(median_seconds(device, rounds, 3, || {
                experts_with(&x, &routes, &gate_up, &down, which)
                    .map(|_| ())
                    .map_err(cuda)
            })?))
        };
        let matvec = time(ExpertsImpl::DeviceMatVec)?;
        let grouped = time(ExpertsImpl::GroupedGemm)?;
        let bucketed = time(ExpertsImpl::BucketedGemm)?;
        let moe_gemm = time(ExpertsImpl::CandleMoeGemm)?;
        let chain = time(ExpertsImpl::Reference)?;
        let best = [matvec, grouped, bucketed, moe_gemm, chain]
            .into_iter()
            .flatten()
            .fold(f64::INFINITY, f64::min);
        let us = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{:.0}", t * 1e6));
        println!(
            "| {tokens} | {} | {:.0} | {} | {} | {} | {} | {} | {:.2}x | {:.0} |",
            touched.len(),
            floor * 1e6,
            us(matvec),
            us(grouped),
            us(bucketed),
            us(moe_gemm),
            us(chain),
            best / floor,
            flops / best / 1e12
        );
    }
    Ok(())
}

/// `glm5-bench moe-gguf`: one GLM-5 MoE layer's 256 routed experts as random Q4_K blocks stacked as GGUF
/// stores them (`glm5::models::weights::random_q4k`), by glm5's grouped kernels (`glm5_ops::moe::
/// quantized_experts`, how a GGUF file's Q4_K experts run) and by each of candle-nn's GGUF MoE kernels
/// (`glm5_ops::moe::experts_gguf_with`, the peer): µs per call against the floor of the Q4_K bytes of the
/// experts the routes touch. The shared expert is not in it (the model runs it as its own chain).
pub fn moe_gguf_rows(device: &Device, copy: f64) -> Result<()> {
    use glm5::models::weights::random_q4k::{q4k_bytes, RandomQ4kSource};
    use glm5::models::TensorSource;
    use glm5::ops::moe::{experts_gguf_with, GgufExpertsImpl, GGUF_MATVEC_MAX_TOKENS};

    let config = glm5::Config::from_json(include_str!("../../tests/assets/glm5_config.json"))
        .map_err(cuda)?;
    let (hidden, inter, routed) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_routed_experts,
    );
    let rule = RouteRule {
        n_group: config.n_group,
        topk_group: config.topk_group,
        top_k: config.num_experts_per_tok,
        normalise: config.norm_topk_prob,
        scaling: config.routed_scaling_factor as f32,
    };
    let source = RandomQ4kSource::candle(2026, 0.02);
    let load = |proj: &str, shape: [usize; 3]| -> Result<_> {
        source
            .stacked_experts("model.layers.3.mlp", proj, shape, device)
            .map_err(cuda)?
            .ok_or_else(|| cuda("rows are not whole Q4_K blocks"))
    };
    let gate = load("gate_proj", [routed, inter, hidden])?;
    let up = load("up_proj", [routed, inter, hidden])?;
    let down = load("down_proj", [routed, hidden, inter])?;
    // The same blocks as glm5's grouped kernels take them (a GGUF file's Q4_K experts).
    let ours = RandomQ4kSource::new(2026, 0.02);
    let load_ours = |proj: &str, shape: [usize; 3]| -> Result<_> {
        ours.stacked_gguf_block_experts("model.layers.3.mlp", proj, shape, device)
            .map_err(cuda)?
            .ok_or_else(|| cuda("rows are not whole Q4_K blocks"))
    };
    let glm5_experts = glm5::ops::moe::QuantizedExperts::GgufBlocks {
        gate: load_ours("gate_proj", [routed, inter, hidden])?,
        up: load_ours("up_proj", [routed, inter, hidden])?,
        down: load_ours("down_proj", [routed, hidden, inter])?,
    };
    let bias = Tensor::zeros(routed, DType::F32, device)?;
    let expert_bytes = q4k_bytes(3 * (hidden * inter) as u64) as f64;
    println!(
        "MoE experts, Q4_K, GLM-5 sizes: {routed} routed (no shared slot), hidden {hidden}, intermediate {inter}, top-{}; copy {:.0} GB/s; experts_gguf picks mat-vec up to {GGUF_MATVEC_MAX_TOKENS} tokens",
        rule.top_k,
        copy / 1e9
    );
    println!("| tokens | experts touched | floor µs | glm5 µs | candle mat-vec µs | WMMA µs | indexed µs | glm5 / floor | candle's best / floor |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for tokens in [1usize, 4, 8, 16, 32, 64, 256, 1024, 4096] {
        let x = Tensor::randn(0f32, 1.0, (tokens, hidden), device)?.to_dtype(DType::BF16)?;
        let logits = Tensor::randn(0f32, 1.0, (tokens, routed), device)?;
        let routes = route(&logits, &bias, &rule, None).map_err(cuda)?;
        let touched: HashSet<u32> = routes
            .ids
            .flatten_all()?
            .to_vec1::<u32>()?
            .into_iter()
            .collect();
        let floor = touched.len() as f64 * expert_bytes / copy;
        let time = |which: GgufExpertsImpl| -> Result<Option<f64>> {
            if which != GgufExpertsImpl::Wmma && tokens > 1024 {
                return Ok(None); // a mat-vec per assignment re-reads the weights: not a contender
            }
            let rounds = if tokens >= 1024 { 3 } else { 5 };
            Ok(Some(median_seconds(device, rounds, 3, || {
                experts_gguf_with(&x, &routes, &gate, &up, &down, which)
                    .map(|_| ())
                    .map_err(cuda)
            })?))
        };
        // glm5's grouped mat-vecs (decode's token counts; prefill dequantises and runs a grouped GEMM).
        let glm5_s = median_seconds(device, if tokens >= 1024 { 3 } else { 5 }, 3, || {
            glm5::ops::moe::quantized_experts(&x, &routes, &glm5_experts)
                .map(|_| ())
                .map_err(cuda)
        })?;
        let matvec = time(GgufExpertsImpl::MatVec)?;
        let wmma = time(GgufExpertsImpl::Wmma)?;
        let indexed = time(GgufExpertsImpl::Indexed)?;
        let best = [matvec, wmma, indexed]
            .into_iter()
            .flatten()
            .fold(f64::INFINITY, f64::min);
        let us = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{:.0}", t * 1e6));
        println!(
            "| {tokens} | {} | {:.0} | {:.0} | {} | {} | {} | {:.2}x | {:.2}x |",
            touched.len(),
            floor * 1e6,
            glm5_s * 1e6,
            us(matvec),
            us(wmma),
            us(indexed),
            glm5_s / floor,
            best / floor
        );
    }
    Ok(())
}
