//! `Checkpoint::random`: made-up weights of the shapes the model asks for (benchmarks of real-size slices).
//! They load through the normal path, give finite logits, and are a function of the seed and names only.

use glm5::candle_core::{DType, Device};
use glm5::models::Checkpoint;
use glm5::{AttentionMode, Config, DeviceDesc, Glm5ForCausalLM, Plan, PlanOptions, Registry};

fn logits(seed: u64) -> Vec<Vec<f32>> {
    let config = Config::from_json(glm5::embedded::CONFIG_JSON).unwrap();
    let plan = Plan::build(
        &config,
        vec![DeviceDesc::of(&Device::Cpu).unwrap()],
        &PlanOptions::new(DType::F32, AttentionMode::Sparse),
        &Registry::builtin(),
    )
    .unwrap();
    let model = Glm5ForCausalLM::load_planned(
        &config,
        &Checkpoint::random(seed, 0.02),
        plan,
        &[Device::Cpu],
    )
    .unwrap();
    let ids: Vec<u32> = (0..12)
        .map(|i| (i * 37 % config.vocab_size) as u32)
        .collect();
    let mut cache = model.new_cache(ids.len()).unwrap();
    model
        .forward(&ids, 0, &mut cache)
        .unwrap()
        .to_vec2()
        .unwrap()
}

#[test]
fn random_weights_load_run_and_repeat() {
    let first = logits(7);
    assert!(first.iter().flatten().all(|v| v.is_finite()));
    assert_eq!(first, logits(7), "same seed, same weights");
    assert_ne!(first, logits(8), "another seed, other weights");
    let checkpoint = Checkpoint::random(7, 0.02);
    assert!(checkpoint.dir().is_none() && checkpoint.contains("any.name"));
}
