//! `glm5-bench slice LAYERS`: GLM-5's first LAYERS layers at their real sizes with random weights, on one
//! GPU and split over two: decode tokens/s, the bytes moved between the GPUs per token, and how far the
//! two-GPU logits are from the one-GPU ones.

use std::time::Instant;

use glm5::candle_core::{DType, Device, Result, Tensor};

use crate::{cuda, Greedy};

/// GLM-5's first `layers` layers at real sizes (the spec's config.json, per-layer lists cut to `layers`).
pub(crate) fn glm5_slice(layers: usize) -> Result<glm5::Config> {
    let mut json: serde_json::Value =
        serde_json::from_str(include_str!("../../tests/assets/glm5_config.json")).map_err(cuda)?;
    let full = json["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    if let Some(object) = json.as_object_mut() {
        for value in object.values_mut() {
            if let Some(list) = value.as_array_mut() {
                if list.len() == full {
                    list.truncate(layers);
                }
            }
        }
        object.insert("num_hidden_layers".into(), layers.into());
    }
    glm5::Config::from_json(&json.to_string()).map_err(cuda)
}

/// Decode on a GLM-5 slice with random weights: one GPU against the layers split over two.
pub fn slice_rows(layers: usize) -> Result<()> {
    use glm5::{
        AttentionMode, Checkpoint, DeviceDesc, Glm5ForCausalLM, Plan, PlanOptions, Registry,
    };
    let config = glm5_slice(layers)?;
    let gpus = [Device::new_cuda(0)?, Device::new_cuda(1)?];
    let (prompt, steps) = (32usize, 32usize);
    let ids: Vec<u32> = (0..prompt + steps)
        .map(|i| (i * 7919 % config.vocab_size) as u32)
        .collect();
    let mut results = Vec::new();
    // Two rounds, 1 GPU then 2 each time, keeping the second: the first pays one-off costs (module loads,
    // allocator growth, clocks ramping) that would otherwise land on whichever layout ran first.
    for (round, count) in [(0, 1usize), (0, 2), (1, 1), (1, 2)] {
        let mut options = PlanOptions::new(DType::BF16, AttentionMode::Sparse);
        options.layer_devices = Some(
            (0..layers)
                .map(|l| {
                    if count == 1 {
                        0
                    } else {
                        usize::from(l >= layers / 2)
                    }
                })
                .collect(),
        );
        options.context = Some(prompt + steps);
        let devices = &gpus[..count];
        let plan = Plan::build(
            &config,
            devices
                .iter()
                .map(|d| DeviceDesc::of(d).map_err(cuda))
                .collect::<Result<Vec<_>>>()?,
            &options,
            &Registry::builtin(),
        )
        .map_err(cuda)?;
        let model =
            Glm5ForCausalLM::load_planned(&config, &Checkpoint::random(2026, 0.02), plan, devices)
                .map_err(cuda)?;
        let mut cache = model.new_cache(prompt + steps).map_err(cuda)?;
        let mut rows = vec![model.forward(&ids[..prompt], 0, &mut cache).map_err(cuda)?];
        for d in &gpus[..count] {
            d.synchronize()?;
        }
        let start = Instant::now();
        for (pos, &id) in ids.iter().enumerate().skip(prompt) {
            let logits = model.forward(&[id], pos, &mut cache).map_err(cuda)?;
            logits.greedy()?; // a generation loop reads each token back
            rows.push(logits);
        }
        let rate = steps as f64 / start.elapsed().as_secs_f64();
        let logits: Vec<Vec<f32>> = Tensor::cat(&rows, 0)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2()?;
        let moved = model.transfers() * config.hidden_size * 2 / (1 + steps);
        if round == 1 {
            results.push((count, rate, logits, moved));
        }
    }
    println!();
    println!("GLM-5 slice: {layers} layers at real sizes, random bf16 weights, prompt {prompt}, {steps} decode steps");
    let reference = results[0].2.clone();
    for (count, rate, logits, moved) in &results {
        let worst = logits
            .iter()
            .zip(&reference)
            .map(|(g, w)| {
                let diff: f32 = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b) * (a - b))
                    .sum::<f32>()
                    .sqrt();
                diff / w
                    .iter()
                    .map(|b| b * b)
                    .sum::<f32>()
                    .sqrt()
                    .max(f32::MIN_POSITIVE)
            })
            .fold(0.0, f32::max);
        println!(
            "{count} GPU(s): decode {rate:.1} tok/s, {moved} B between GPUs per token, logits vs 1 GPU: max ‖Δ‖/‖ref‖ {worst:.2e}"
        );
    }
    Ok(())
}
