//! Placement and bound backends on the CPU: a model split over two plan devices (both the CPU) runs its
//! layer-boundary transfers and gives the single-device logits; a backend registered here is bound into the
//! graph and is what the forward pass calls; the runtime's option parsing (assumed devices, layer maps,
//! forced backends with GLM5_BACKEND under the CLI's).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use glm5::candle_core::{DType, Device, Tensor};
use glm5::models::Checkpoint;
use glm5::ops::registry::{Kernel, Serves};
use glm5::ops::{DeviceFamily, Entry};
use glm5::plan_cli::{forced_backends, parse_assumed, parse_layer_map};
use glm5::{
    AttentionMode, Config, DeviceDesc, Glm5, Glm5ForCausalLM, LoadOptions, Op, Plan, PlanOptions,
    Registry,
};

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{decode_rows, fixture_dir, load_split, max_abs_diff};

#[test]
fn a_model_split_over_two_devices_moves_hidden_states_and_matches_one_device() {
    for name in ["sparse_long", "dense_equiv"] {
        let dir = fixture_dir(name);
        let config = Config::from_file(dir.join("config.json")).unwrap();
        let n = config.num_hidden_layers;
        let ids: Vec<u32> = (0..20)
            .map(|i| (i * 7 + 3) % config.vocab_size as u32)
            .collect();
        let single =
            Glm5ForCausalLM::from_dir(&dir, DType::F32, &Device::Cpu, AttentionMode::Sparse)
                .unwrap();
        let expected = decode_rows(&single, &ids, 12);
        assert_eq!(single.transfers(), 0);

        // Layers 0..n/2 on plan device 0, the rest (and lm_head) on plan device 1: both the CPU.
        let split = load_split(name, &[Device::Cpu, Device::Cpu]);
        let got = decode_rows(&split, &ids, 12);
        let calls = 1 + ids.len() - 12;
        assert_eq!(
            split.transfers(),
            calls,
            "one boundary crossing per forward"
        );
        assert_eq!(max_abs_diff(&got, &expected), 0.0, "{name}");
        let backends = split.layer_backends();
        assert_eq!(backends.len(), n);
        assert!(backends.iter().all(|b| b.device == "cpu"));
    }
}

#[test]
fn a_plan_must_match_the_devices_it_is_loaded_on() {
    let dir = fixture_dir("sparse_long");
    let config = Config::from_file(dir.join("config.json")).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let options = PlanOptions::new(DType::F32, AttentionMode::Sparse);
    let registry = Registry::builtin();
    let assumed = Plan::build(
        &config,
        parse_assumed("cpu:8GB").unwrap(),
        &options,
        &registry,
    )
    .unwrap();
    let err = Glm5ForCausalLM::load_planned(&config, &checkpoint, assumed, &[Device::Cpu])
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("can be printed, not loaded"),
        "{err}"
    );
    let real = Plan::build(
        &config,
        vec![DeviceDesc::of(&Device::Cpu).unwrap()],
        &options,
        &registry,
    )
    .unwrap();
    let err = Glm5ForCausalLM::load_planned(&config, &checkpoint, real, &[])
        .err()
        .unwrap();
    assert!(err.to_string().contains("1 devices, 0 were given"), "{err}");
}

static FAKE_CALLS: AtomicUsize = AtomicUsize::new(0);

fn counting_sparse_mla(
    q: &Tensor,
    cache: &Tensor,
    indices: &Tensor,
    value_dim: usize,
    scale: f64,
) -> glm5::ops::Result<(Tensor, Tensor)> {
    FAKE_CALLS.fetch_add(1, Ordering::SeqCst);
    glm5::ops::sparse_mla_reference(q, cache, indices, value_dim, scale)
}

#[test]
fn a_backend_registered_by_the_user_is_bound_into_the_graph() {
    let mut registry = Registry::builtin();
    registry
        .register(Entry {
            name: "counting",
            description: "test: the reference, counting its calls",
            kernel: Kernel::SparseMla(counting_sparse_mla),
            serves: Serves::anything(),
            extra_check: None,
            priority: vec![(DeviceFamily::Cpu, 1)],
        })
        .unwrap();
    let model = Glm5::embedded(&LoadOptions {
        registry,
        ..Default::default()
    })
    .unwrap();
    let layers = model.model().config().num_hidden_layers;
    assert!(model
        .model()
        .layer_backends()
        .iter()
        .all(|b| b.sparse_mla == "counting"));
    let reference = Glm5::embedded(&LoadOptions::default()).unwrap();
    let ids = model.tokenizer().encode("Hello there").unwrap();
    let before = FAKE_CALLS.load(Ordering::SeqCst);
    let mut cache = model.new_cache(ids.len()).unwrap();
    let got: Vec<Vec<f32>> = model
        .forward(&ids, 0, &mut cache)
        .unwrap()
        .to_vec2()
        .unwrap();
    assert_eq!(FAKE_CALLS.load(Ordering::SeqCst) - before, layers);
    let mut cache = reference.new_cache(ids.len()).unwrap();
    let want: Vec<Vec<f32>> = reference
        .forward(&ids, 0, &mut cache)
        .unwrap()
        .to_vec2()
        .unwrap();
    assert_eq!(max_abs_diff(&got, &want), 0.0);

    // Forcing the built-in reference through the options wins over the fake's priority.
    let mut registry = Registry::builtin();
    registry
        .register(Entry {
            name: "counting",
            description: "test",
            kernel: Kernel::SparseMla(counting_sparse_mla),
            serves: Serves::anything(),
            extra_check: None,
            priority: vec![(DeviceFamily::Cpu, 1)],
        })
        .unwrap();
    let forced = Glm5::embedded(&LoadOptions {
        registry,
        backends: BTreeMap::from([(Op::SparseMla, "reference".to_string())]),
        ..Default::default()
    })
    .unwrap();
    assert!(forced
        .model()
        .layer_backends()
        .iter()
        .all(|b| b.sparse_mla == "reference"));
}

#[test]
fn forcing_an_invalid_backend_fails_the_load_with_reasons() {
    let err = Glm5::embedded(&LoadOptions {
        backends: BTreeMap::from([(Op::SparseMla, "cuda-bf16-mma".to_string())]),
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("forced backend cuda-bf16-mma cannot serve it on cpu")
            && err.contains("got cpu")
            && err.contains("needs dtype ∈ {bf16}, got f32"),
        "{err}"
    );
}

#[test]
fn dense_mode_is_labelled_in_the_plan() {
    let model = Glm5::embedded(&LoadOptions {
        attention: AttentionMode::Dense,
        ..Default::default()
    })
    .unwrap();
    let plan = model.model().plan();
    assert_eq!(plan.attention, AttentionMode::Dense);
    let text = glm5::plan_cli::render(plan, model.model().config(), "tiny", &Registry::builtin());
    assert!(text.contains("DENSE attention"), "{text}");
    assert!(text.contains("skipped (dense mode)"), "{text}");
}

#[test]
fn option_parsing() {
    let devices = parse_assumed("sm_120:96GB x2, cpu:64GB,sm_90:141GBx1").unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["cuda:0", "cuda:1", "cpu", "cuda:2"]);
    assert!(parse_assumed("sm_120:96GB x0").is_err());
    assert!(parse_assumed("").is_err());

    let names: Vec<String> = ["cuda:0", "cpu"].map(String::from).to_vec();
    assert_eq!(
        parse_layer_map("0-1=cuda:0,2=cpu,3=#1", &names, 4).unwrap(),
        [0, 0, 1, 1]
    );
    for bad in ["0-1=cuda:0", "0-3=cuda:9", "0-4=cpu", "2-1=cpu", "x=cpu"] {
        assert!(parse_layer_map(bad, &names, 4).is_err(), "{bad}");
    }

    let cli = BTreeMap::from([(Op::SparseMla, "reference".to_string())]);
    let forced = forced_backends(
        &cli,
        Some("sparse_mla=cuda-bf16-mma, dsa_indexer=reference"),
    )
    .unwrap();
    assert_eq!(forced[&Op::SparseMla], "reference", "the CLI wins");
    assert_eq!(forced[&Op::DsaIndexer], "reference");
    assert!(forced_backends(&BTreeMap::new(), Some("nonsense")).is_err());
}
