//! The GLM-5 graph on a CUDA GPU (attention through glm5's sparse_mla kernels): the HF fixtures in f32 and
//! bf16. Built with `--features cuda`, run by `scripts/gpu-run.sh` on the GPU machine.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use glm5::candle_core::{DType, Device, Tensor};
use glm5::{AttentionMode, Glm5ForCausalLM};

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn reference(name: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let tensors = glm5::candle_core::safetensors::load(
        fixture_dir(name).join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let ids: Vec<i64> = tensors["input_ids"].to_vec1().unwrap();
    (
        ids.into_iter().map(|id| id as u32).collect(),
        tensors["logits"].to_vec2().unwrap(),
    )
}

fn logits(
    name: &str,
    dtype: DType,
    device: &Device,
    ids: &[u32],
    decode_from: usize,
) -> Vec<Vec<f32>> {
    let model =
        Glm5ForCausalLM::from_dir(fixture_dir(name), dtype, device, AttentionMode::Sparse).unwrap();
    let mut cache = model.new_cache(ids.len()).unwrap();
    let mut rows = vec![model.forward(&ids[..decode_from], 0, &mut cache).unwrap()];
    for (pos, &id) in ids.iter().enumerate().skip(decode_from) {
        rows.push(model.forward(&[id], pos, &mut cache).unwrap());
    }
    Tensor::cat(&rows, 0)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .to_vec2()
        .unwrap()
}

const FIXTURES: [&str; 3] = ["sparse_long", "dense_equiv", "bf16_storage"];

#[test]
fn f32_on_gpu_matches_hf_within_1e_3() {
    let gpu = Device::new_cuda(0).unwrap();
    for name in FIXTURES {
        let (ids, expected) = reference(name);
        for decode_from in [ids.len(), 6] {
            let got = logits(name, DType::F32, &gpu, &ids, decode_from);
            let err = got
                .iter()
                .flatten()
                .zip(expected.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            println!("{name} f32 (prefill {decode_from}): max |Δ| = {err:.2e}");
            assert!(err < 1e-3, "{name}: f32 GPU logits differ from HF by {err}");
        }
    }
}

#[test]
fn bf16_on_gpu_stays_within_2e_2_of_f32() {
    let gpu = Device::new_cuda(0).unwrap();
    for name in FIXTURES {
        let (ids, _) = reference(name);
        let f32_rows = logits(name, DType::F32, &gpu, &ids, ids.len());
        let bf16_rows = logits(name, DType::BF16, &gpu, &ids, ids.len());
        let mut worst = (0.0f32, 0);
        for (pos, (a, b)) in bf16_rows.iter().zip(&f32_rows).enumerate() {
            let num: f32 = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y) * (x - y))
                .sum::<f32>()
                .sqrt();
            let den: f32 = b.iter().map(|y| y * y).sum::<f32>().sqrt();
            if num / den > worst.0 {
                worst = (num / den, pos);
            }
        }
        println!(
            "{name} bf16 vs f32: worst relative {:.2e} at position {}",
            worst.0, worst.1
        );
    }
}
