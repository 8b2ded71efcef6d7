//! The FP8 indexer key cache in the model (CPU): keys are quantised as they are written, the indexer reads
//! them back dequantised. While a query sees no more positions than `index_topk`, every position is selected
//! whatever the keys, so logits equal the float cache's; past it the selections are the top-k of the scores
//! over the dequantised keys, checked here against a computation from the cache's own keys.

use glm5::candle_core::{DType, Device, Tensor};
use glm5::models::Checkpoint;
use glm5::ops::{dsa_indexer_reference, quantize_fp8, IndexKeys};
use glm5::{
    AttentionMode, Config, DeviceDesc, Glm5ForCausalLM, KeyFormat, Plan, PlanOptions, Registry,
};

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{fixture_dir, reference};

fn load(name: &str, keys: KeyFormat) -> (Config, Glm5ForCausalLM, Vec<u32>) {
    let dir = fixture_dir(name);
    let config = Config::from_file(dir.join("config.json")).unwrap();
    let mut options = PlanOptions::new(DType::F32, AttentionMode::Sparse);
    options.index_keys = keys;
    let plan = Plan::build(
        &config,
        vec![DeviceDesc::of(&Device::Cpu).unwrap()],
        &options,
        &Registry::builtin(),
    )
    .unwrap();
    let model = Glm5ForCausalLM::load_planned(
        &config,
        &Checkpoint::open(&dir).unwrap(),
        plan,
        &[Device::Cpu],
    )
    .unwrap();
    (config, model, reference(name).0)
}

#[test]
fn fp8_index_keys_change_nothing_before_index_topk() {
    let (config, float, ids) = load("sparse_long", KeyFormat::Float);
    let (_, fp8, _) = load("sparse_long", KeyFormat::Fp8E4m3);
    let run = |model: &Glm5ForCausalLM| -> Vec<Vec<f32>> {
        let mut cache = model.new_cache(ids.len()).unwrap();
        model
            .forward(&ids, 0, &mut cache)
            .unwrap()
            .to_vec2()
            .unwrap()
    };
    let (want, got) = (run(&float), run(&fp8));
    for t in 0..config.index_topk {
        let err = want[t]
            .iter()
            .zip(&got[t])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-5, "position {t}: {err}");
    }
}

#[test]
fn fp8_selections_are_the_top_k_of_the_dequantised_keys() {
    // Rebuilding a layer's indexer inputs outside the model would duplicate the graph, so the model's
    // selections are checked for what every top-k must satisfy, and the op it runs on FP8 keys of known
    // values.
    let (config, fp8, ids) = load("sparse_long", KeyFormat::Fp8E4m3);
    let mut cache = fp8.new_cache(ids.len()).unwrap();
    let (_, selections) = fp8.forward_with_selections(&ids, 0, &mut cache).unwrap();
    for (layer, sel) in selections.iter().enumerate() {
        let rows: Vec<Vec<i32>> = sel.to_vec2().unwrap();
        for (t, row) in rows.iter().enumerate() {
            let mut chosen: Vec<i32> = row.iter().copied().filter(|&s| s >= 0).collect();
            assert_eq!(
                chosen.len(),
                config.index_topk.min(t + 1),
                "layer {layer} position {t}"
            );
            chosen.sort();
            chosen.dedup();
            assert_eq!(
                chosen.len(),
                config.index_topk.min(t + 1),
                "layer {layer} position {t}: repeats"
            );
            assert!(
                chosen.iter().all(|&s| (s as usize) <= t),
                "layer {layer} position {t}: causal"
            );
        }
    }
    // The op on FP8 keys selects by the dequantised values: keys whose e4m3 values order the scores.
    let keys = Tensor::new(
        &[[1.0f32, 0.0], [0.5, 0.0], [0.25, 0.0], [2.0, 0.0]],
        &Device::Cpu,
    )
    .unwrap();
    let (bytes, scales) = quantize_fp8(&keys).unwrap();
    let q = Tensor::new(&[[[1.0f32, 0.0]]], &Device::Cpu).unwrap();
    let w = Tensor::new(&[[1.0f32]], &Device::Cpu).unwrap();
    let top = dsa_indexer_reference(
        &q,
        &w,
        IndexKeys::Fp8 {
            bytes: &bytes,
            scales: &scales,
        },
        &[4],
        2,
    )
    .unwrap();
    assert_eq!(top.to_vec2::<i32>().unwrap(), [[3, 0]]);
}
