//! `glm5-bench matvec`: one GLM-5 projection at batch 1 (one bf16 activation row) in each weight format glm5
//! multiplies by, the device time of one call with the L2 emptied first (`timing::cold_seconds`: the kernels
//! alone, no host overhead) and the host-timed eager call (`timing::median_seconds`), against the copy rate
//! over the bytes the weight takes. Random weights: the formats' byte patterns, scales kept finite.

use glm5::candle_core::quantized::QMatMul;
use glm5::candle_core::{DType, Device, Module, Result, Tensor};
use glm5::ops::fp8_matmul::{fp8_matmul, Fp8BlockWeight};
use glm5::ops::gguf_matmul::{gguf_matmul, gguf_matmul_on_cuda_cores, GgufFormat};
use glm5::ops::nvfp4_matmul::{nvfp4_matmul, Nvfp4Weight};

use crate::timing::{cold_seconds, median_seconds};
use crate::{cuda, next};

fn bytes(state: &mut u64, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        out.extend_from_slice(&next(state).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// e4m3 bytes that are finite and at most 1 in magnitude (exponent field below the bias).
pub(crate) fn e4m3(state: &mut u64, n: usize) -> Vec<u8> {
    bytes(state, n)
        .into_iter()
        .map(|b| b & 0b1011_1111)
        .collect()
}

pub fn matvec_rows(device: &Device, copy: f64) -> Result<()> {
    let config = glm5::Config::from_json(include_str!("../../tests/assets/glm5_config.json"))
        .map_err(cuda)?;
    let (h, i, q) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.q_lora_rank,
    );
    let heads_v = config.num_attention_heads * config.v_head_dim;
    // An expert's gate/up (2I x H) and down (H x I), q_a (q_lora x H), o_proj (H x heads·v).
    let shapes = [(2 * i, h), (h, i), (q, h), (h, heads_v)];
    let mut state = 0x5eed_u64;
    println!("weight mat-vecs at batch 1 (bf16 activations): device time of one call (L2 emptied first) and the host-timed eager call, GB/s and % of the copy rate over the weight's bytes");
    println!("| format | [out, in] | bytes | device us | GB/s | % of copy | eager us |");
    println!("|---|---|---|---|---|---|---|");
    for (n, k) in shapes {
        let x = Tensor::randn(0f32, 1.0, (1, k), device)?.to_dtype(DType::BF16)?;
        let row = |label: &str, weight_bytes: usize, f: &dyn Fn() -> Result<()>| -> Result<()> {
            let device_s = cold_seconds(device, 9, f)?;
            let eager_s = median_seconds(device, 5, 20, f)?;
            println!(
                "| {label} | [{n}, {k}] | {weight_bytes} | {:.1} | {:.0} | {:.0}% | {:.1} |",
                device_s * 1e6,
                weight_bytes as f64 / device_s / 1e9,
                100.0 * weight_bytes as f64 / device_s / copy,
                eager_s * 1e6
            );
            Ok(())
        };
        let dense = Tensor::randn(0f32, 0.02, (n, k), device)?.to_dtype(DType::BF16)?;
        row("bf16 (cuBLAS)", n * k * 2, &|| {
            x.matmul(&dense.t()?).map(drop)
        })?;
        let fp8 = Fp8BlockWeight {
            weight: Tensor::from_vec(e4m3(&mut state, n * k), (n, k), device)?,
            scale_inv: Tensor::ones((n.div_ceil(128), k.div_ceil(128)), DType::F32, device)?,
            block: [128, 128],
        };
        row(
            "FP8 (128x128)",
            n * k + n.div_ceil(128) * k.div_ceil(128) * 4,
            &|| fp8_matmul(&x, &fp8).map(drop).map_err(cuda),
        )?;
        let nvfp4 = Nvfp4Weight {
            packed: Tensor::from_vec(bytes(&mut state, n * k / 2), (n, k / 2), device)?,
            scales: Tensor::from_vec(e4m3(&mut state, n * k / 16), (n, k / 16), device)?,
            global_scale: 1.0,
        };
        row("NVFP4", n * k / 2 + n * k / 16, &|| {
            nvfp4_matmul(&x, &nvfp4).map(drop).map_err(cuda)
        })?;
        // The i-quants and Q4_K from the e2e bench's random sources (their blocks as the formats store them).
        let name = "model.layers.3.mlp.experts.0.gate_proj.weight";
        for format in [
            GgufFormat::Iq4Xs,
            GgufFormat::Iq3S,
            GgufFormat::Iq2S,
            GgufFormat::Iq2Xxs,
            GgufFormat::Iq1M,
        ] {
            let source = glm5::models::weights::random_iq::RandomIqSource::new(7, 0.02, format);
            if let glm5::models::Matrix::GgufBlocks(w) =
                glm5::models::TensorSource::matrix(&source, name, [n, k], DType::BF16, device)
                    .map_err(cuda)?
            {
                row(format.name(), w.blocks.elem_count(), &|| {
                    gguf_matmul(&x, &w).map(drop).map_err(cuda)
                })?;
            }
        }
        // Q4_K through glm5's kernels (with one row the tensor-core kernel, then the FFMA mat-vec it replaced),
        // then the same blocks through candle's QMatMul.
        let q4k = glm5::models::weights::random_q4k::RandomQ4kSource::new(7, 0.02);
        if let glm5::models::Matrix::GgufBlocks(w) =
            glm5::models::TensorSource::matrix(&q4k, name, [n, k], DType::BF16, device)
                .map_err(cuda)?
        {
            row("Q4_K (glm5)", w.blocks.elem_count(), &|| {
                gguf_matmul(&x, &w).map(drop).map_err(cuda)
            })?;
            row("Q4_K (glm5, FFMA)", w.blocks.elem_count(), &|| {
                gguf_matmul_on_cuda_cores(&x, &w).map(drop).map_err(cuda)
            })?;
        }
        let q4k = glm5::models::weights::random_q4k::RandomQ4kSource::candle(7, 0.02);
        if let glm5::models::Matrix::Quantized(w) =
            glm5::models::TensorSource::matrix(&q4k, name, [n, k], DType::BF16, device)
                .map_err(cuda)?
        {
            let qbytes = glm5::models::weights::random_q4k::q4k_bytes((n * k) as u64) as usize;
            let mm = QMatMul::from_arc(w)?;
            let xf = x.to_dtype(DType::F32)?;
            row("Q4_K (candle QMatMul)", qbytes, &|| {
                mm.forward(&xf).map(drop)
            })?;
        }
    }
    Ok(())
}
