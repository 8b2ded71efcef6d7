//! The graph-build pass on GLM-5's real config (tests/assets/glm5_config.json) and tiny ones: sizes against
//! the spec's parameter counts and a real checkpoint's tensors, placement over assumed devices (fits, does
//! not fit and by how much), dispatch per layer, dense mode, forced backends and user layer maps.

use std::path::PathBuf;

use candle_core::DType;
use glm5_models::plan::op_spec;
use glm5_models::{sizes, AttentionMode, Config, MlpKind, Plan, PlanError, PlanOptions};
use glm5_ops::{DeviceDesc, DispatchError, KeyFormat, Op, Reason, Registry, Verdict};

const GIB: u64 = 1 << 30;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn glm5() -> Config {
    Config::from_file(root().join("tests/assets/glm5_config.json")).unwrap()
}

fn tiny() -> Config {
    Config::from_file(root().join("assets/tiny-glm5/config.json")).unwrap()
}

fn assumed(spec: &str, count: usize) -> Vec<DeviceDesc> {
    (0..count)
        .map(|i| DeviceDesc::assume(spec, i).unwrap())
        .collect()
}

fn bf16(attention: AttentionMode) -> PlanOptions {
    PlanOptions::new(DType::BF16, attention)
}

/// GLM-5's weights by the spec's closed forms (§1 "Derived numbers", §2 shapes), independent of `sizes`:
/// (parameters, bytes with the router in f32 and the rest at `bytes` each).
fn glm5_by_formula(c: &Config, bytes: u64) -> (u64, u64) {
    let (h, heads) = (c.hidden_size as u64, c.num_attention_heads as u64);
    let attention = c.q_lora_rank as u64 * h
        + c.q_lora_rank as u64
        + heads * 256 * c.q_lora_rank as u64
        + 576 * h
        + 512
        + heads * (192 + 256) * 512
        + h * heads * 256;
    let indexer = 32 * 128 * c.q_lora_rank as u64 + 128 * h + 2 * 128 + 32 * h;
    let norms = 2 * h;
    let dense = 3 * h * c.intermediate_size as u64;
    let experts = (256 + 1) * 3 * h * c.moe_intermediate_size as u64;
    let router = 256 * h + 256;
    let embed_head = 2 * c.vocab_size as u64 * h + h;
    let (mut params, mut total_bytes) = (embed_head, embed_head * bytes);
    for kind in &c.mlp_layer_types {
        let common = attention + indexer + norms;
        match kind {
            MlpKind::Dense => {
                params += common + dense;
                total_bytes += (common + dense) * bytes;
            }
            MlpKind::MoE => {
                params += common + experts + router;
                total_bytes += (common + experts) * bytes + router * 4;
            }
        }
    }
    (params, total_bytes)
}

#[test]
fn glm5_has_744b_parameters_and_the_spec_per_block_counts() {
    let c = glm5();
    let layer = |l| sizes::params(&sizes::layer_tensors(&c, l, DType::BF16));
    let embed = sizes::params(&sizes::embedding_tensors(&c, DType::BF16));
    let head = sizes::params(&sizes::head_tensors(&c, DType::BF16));
    let total: u64 = embed + head + (0..78).map(layer).sum::<u64>();
    // Spec §1: 743.9 B (rounded to 0.1 B); the TR says 744 B.
    assert!(
        (total as f64 - 743.9e9).abs() < 0.05e9,
        "GLM-5 has {total} parameters"
    );
    let (formula_params, formula_bytes) = glm5_by_formula(&c, 2);
    assert_eq!(total, formula_params);
    // Spec: attention 165.02 M + indexer 9.37 M + norms; dense MLP 226.49 M; MoE 9.703 B.
    let dense_layer = layer(0) as f64;
    let moe_layer = layer(3) as f64;
    let norms = 2.0 * 6144.0;
    assert!((dense_layer - norms - (165.02e6 + 9.37e6 + 226.49e6)).abs() < 0.02e6);
    assert!((moe_layer - norms - (165.02e6 + 9.37e6 + 9.703e9)).abs() < 1e6);
    // bf16 bytes: 2 per parameter but the f32 router (75 layers × (256 × 6144 + 256) × 2 extra bytes).
    let bytes: u64 = sizes::bytes(&sizes::embedding_tensors(&c, DType::BF16))
        + sizes::bytes(&sizes::head_tensors(&c, DType::BF16))
        + (0..78)
            .map(|l| sizes::bytes(&sizes::layer_tensors(&c, l, DType::BF16)))
            .sum::<u64>();
    assert_eq!(bytes, formula_bytes);
    assert_eq!(bytes, 2 * total + 75 * (256 * 6144 + 256) * 2);
    // KV cache per token per layer: 512 + 64 latent + 128 indexer key values at 2 bytes.
    assert_eq!(
        sizes::cache_bytes_per_token(&c, DType::BF16, KeyFormat::Float),
        1408
    );
    // FP8 indexer keys: 576 bf16 latent values + 128 bytes and an f32 scale.
    assert_eq!(
        sizes::cache_bytes_per_token(&c, DType::BF16, KeyFormat::Fp8E4m3),
        576 * 2 + 128 + 4
    );
}

#[test]
fn the_tensor_list_is_exactly_the_tiny_checkpoints() {
    let c = tiny();
    let bytes = std::fs::read(root().join("assets/tiny-glm5/model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut listed: Vec<(String, Vec<usize>)> = sizes::embedding_tensors(&c, DType::F32)
        .into_iter()
        .chain(sizes::head_tensors(&c, DType::F32))
        .chain((0..c.num_hidden_layers).flat_map(|l| sizes::layer_tensors(&c, l, DType::F32)))
        .chain(sizes::mtp_tensors(&c, DType::F32))
        .map(|t| (t.name, t.shape))
        .collect();
    let mut stored: Vec<(String, Vec<usize>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.shape().to_vec()))
        .collect();
    listed.sort();
    stored.sort();
    assert_eq!(listed, stored);
}

#[test]
fn the_mtp_layer_has_the_specs_size_and_goes_with_the_head() {
    let c = glm5();
    assert_eq!(c.num_nextn_predict_layers, 1);
    let mtp = sizes::mtp_tensors(&c, DType::BF16);
    // Spec: the MTP layer is an MoE block plus eh_proj (6144 x 12288) and three norms: 9.95 B.
    let moe_layer = sizes::params(&sizes::layer_tensors(&c, 3, DType::BF16));
    assert_eq!(sizes::params(&mtp), moe_layer + 6144 * 12288 + 3 * 6144);
    assert!((sizes::params(&mtp) as f64 - 9.95e9).abs() < 0.01e9);
    assert!(mtp.iter().all(|t| t.name.starts_with("model.layers.78.")));

    let devices = assumed("sm_120:96GB", 16);
    let without = Plan::build(
        &c,
        devices.clone(),
        &bf16(AttentionMode::Sparse),
        &Registry::builtin(),
    )
    .unwrap();
    let options = PlanOptions {
        mtp: true,
        ..bf16(AttentionMode::Sparse)
    };
    let with = Plan::build(&c, devices, &options, &Registry::builtin()).unwrap();
    let layer = with.mtp.as_ref().expect("the plan has the MTP layer");
    assert_eq!(
        (layer.layer, layer.device, layer.mlp),
        (78, with.head_device, MlpKind::MoE)
    );
    assert_eq!(layer.op(Op::SparseMla).unwrap().backend(), "cuda-bf16-mma");
    assert_eq!(
        with.weight_bytes(),
        without.weight_bytes() + sizes::bytes(&mtp)
    );
    assert_eq!(
        with.cache_bytes_per_token(),
        without.cache_bytes_per_token() + 1408
    );
    let head = &with.device_usage()[with.head_device];
    assert!(head.layers.contains(&78));
    assert!(head.weight_bytes + head.cache_bytes <= 96 * GIB);

    // A config without an MTP layer cannot give one.
    let mut none = c.clone();
    none.num_nextn_predict_layers = 0;
    let err = Plan::build(
        &none,
        assumed("sm_120:96GB", 16),
        &options,
        &Registry::builtin(),
    )
    .unwrap_err();
    assert!(matches!(err, PlanError::NoMtpLayer), "{err}");
}

#[test]
fn glm5_bf16_does_not_fit_8_rtx_pro_6000_and_says_by_how_much() {
    let c = glm5();
    let err = Plan::build(
        &c,
        assumed("sm_120:96GB", 8),
        &bf16(AttentionMode::Sparse),
        &Registry::builtin(),
    )
    .unwrap_err();
    let PlanError::DoesNotFit {
        needed,
        available,
        missing,
        weights,
        device,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    let (_, weight_bytes) = glm5_by_formula(&c, 2);
    let cache = 8192 * 78 * 1408;
    assert_eq!(*weights, weight_bytes);
    assert_eq!(*needed, weight_bytes + cache);
    assert_eq!(*available, 8 * 96 * GIB);
    assert_eq!(*missing, weight_bytes + cache - 8 * 96 * GIB);
    assert!(device.starts_with("cuda:7"), "{device}");
    assert!(err.to_string().contains(&format!("{missing} B missing")));
}

#[test]
fn glm5_bf16_fits_16_rtx_pro_6000_with_the_sparse_kernels() {
    let c = glm5();
    let devices = assumed("sm_120:96GB", 16);
    let plan = Plan::build(
        &c,
        devices.clone(),
        &bf16(AttentionMode::Sparse),
        &Registry::builtin(),
    )
    .unwrap();
    assert_eq!(plan.layers.len(), 78);
    assert_eq!(plan.context, 8192);
    let mut previous = 0;
    for l in &plan.layers {
        assert!(l.device >= previous, "layers run in device order");
        previous = l.device;
        assert_eq!(l.op(Op::SparseMla).unwrap().backend(), "cuda-bf16-mma");
        assert_eq!(l.op(Op::DsaIndexer).unwrap().backend(), "cuda-bf16-mma");
        assert_eq!(l.dtype, DType::BF16);
        assert_eq!(l.cache_bytes_per_token, 1408);
    }
    assert_eq!(plan.embed_device, 0);
    assert_eq!(plan.head_device, plan.layers[77].device);

    let (params, bytes) = glm5_by_formula(&c, 2);
    let usage = plan.device_usage();
    assert_eq!(usage.iter().map(|u| u.params).sum::<u64>(), params);
    assert_eq!(usage.iter().map(|u| u.weight_bytes).sum::<u64>(), bytes);
    assert!((bytes as f64 / params as f64 - 2.0).abs() < 1e-3);
    for u in &usage {
        let capacity = devices[u.device].memory_bytes;
        let per_token = u.layers.len() as u64 * 1408;
        assert!(u.weight_bytes + u.cache_bytes <= capacity, "{u:?}");
        assert_eq!(u.cache_bytes, per_token * 8192);
        assert_eq!(u.free_bytes, capacity - u.weight_bytes - u.cache_bytes);
        assert_eq!(
            u.max_context_tokens,
            (per_token > 0).then(|| (capacity - u.weight_bytes) / per_token)
        );
    }
    // Every device holds something: the split follows memory, not "fill the first ones".
    assert!(usage.iter().all(|u| !u.layers.is_empty()));
    assert_eq!(
        plan.boundaries().len(),
        15,
        "one hidden-state move per device change"
    );
}

#[test]
fn glm5_on_hopper_cpu_and_turing() {
    let c = glm5();
    let registry = Registry::builtin();
    let sm90 = Plan::build(
        &c,
        assumed("sm_90:141GB", 16),
        &bf16(AttentionMode::Sparse),
        &registry,
    )
    .unwrap();
    // GLM-5's 64 heads over rows of 512 + 64: the wgmma kernel on Hopper, mma.sync ranked below it.
    for layer in &sm90.layers {
        let choice = layer.op(Op::SparseMla).unwrap().choice.as_ref().unwrap();
        assert_eq!(choice.entry.name, "cuda-bf16-wgmma");
        assert!(choice.rejected.iter().any(|r| r.backend == "cuda-bf16-mma"
            && r.verdict
                == Verdict::Outranked {
                    by: "cuda-bf16-wgmma"
                }));
    }
    // Workstation Blackwell has no wgmma: mma.sync, and the reason the wgmma entry was not taken.
    let sm120 = Plan::build(
        &c,
        assumed("sm_120:96GB", 16),
        &bf16(AttentionMode::Sparse),
        &registry,
    )
    .unwrap();
    let choice = sm120.layers[3]
        .op(Op::SparseMla)
        .unwrap()
        .choice
        .as_ref()
        .unwrap();
    assert_eq!(choice.entry.name, "cuda-bf16-mma");
    assert!(choice
        .rejected
        .iter()
        .any(|r| r.backend == "cuda-bf16-wgmma"
            && r.verdict
                == Verdict::Invalid(vec![
                    Reason::new("compute capability", "∈ {9.0}", "12.0"),
                    Reason::new("shared memory per block", "214144 B", "100352 B"),
                ])));

    let cpu = Plan::build(
        &c,
        vec![DeviceDesc::cpu(4096 * GIB)],
        &PlanOptions::new(DType::F32, AttentionMode::Sparse),
        &registry,
    )
    .unwrap();
    assert_eq!(
        cpu.layers[5].op(Op::SparseMla).unwrap().backend(),
        "reference"
    );

    let turing = Plan::build(
        &c,
        assumed("sm_75:96GB", 16),
        &bf16(AttentionMode::Sparse),
        &registry,
    )
    .unwrap();
    let choice = turing.layers[0]
        .op(Op::SparseMla)
        .unwrap()
        .choice
        .as_ref()
        .unwrap();
    assert_eq!(choice.entry.name, "reference");
    for r in &choice.rejected {
        let Verdict::Invalid(reasons) = &r.verdict else {
            panic!("{r}")
        };
        let supported = if r.backend == "cuda-bf16-wgmma" {
            "∈ {9.0}"
        } else {
            "∈ {9.0,12.x}"
        };
        assert!(reasons.contains(&Reason::new("compute capability", supported, "7.5")));
    }
}

#[test]
fn dense_mode_is_explicit_skips_the_indexer_and_asks_for_every_position() {
    let c = glm5();
    let plan = Plan::build(
        &c,
        assumed("sm_120:96GB", 16),
        &bf16(AttentionMode::Dense),
        &Registry::builtin(),
    )
    .unwrap();
    assert_eq!(plan.attention, AttentionMode::Dense);
    let layer = &plan.layers[10];
    assert!(layer.op(Op::DsaIndexer).unwrap().choice.is_none());
    assert_eq!(
        layer.op(Op::DsaIndexer).unwrap().backend(),
        "skipped (dense mode)"
    );
    let mla = layer.op(Op::SparseMla).unwrap();
    assert_eq!(mla.spec.top_k, c.max_position_embeddings);
    // 202752 positions exceed the bf16 kernel's 131072 slots: the reference serves dense GLM-5.
    let choice = mla.choice.as_ref().unwrap();
    assert_eq!(choice.entry.name, "reference");
    assert!(choice.rejected.iter().any(|r| r.verdict
        == Verdict::Invalid(vec![Reason::new(
            "top-k",
            "in 1..=131072",
            c.max_position_embeddings
        )])));
    assert_eq!(
        op_spec(
            &c,
            Op::SparseMla,
            DType::BF16,
            AttentionMode::Sparse,
            KeyFormat::Float
        )
        .top_k,
        2048
    );
}

#[test]
fn a_forced_invalid_backend_fails_the_build_with_its_reasons() {
    let c = tiny();
    let mut options = bf16(AttentionMode::Sparse);
    options
        .forced
        .insert(Op::SparseMla, "cuda-f32-fma".to_string());
    let err = Plan::build(
        &c,
        assumed("sm_120:96GB", 1),
        &options,
        &Registry::builtin(),
    )
    .unwrap_err();
    let PlanError::Dispatch {
        layer: 0,
        source: DispatchError::ForcedInvalid { reasons, .. },
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(reasons, &[Reason::new("dtype", "∈ {f32}", "bf16")]);
    // A valid forced one is used on every layer.
    options.forced.insert(Op::SparseMla, "reference".into());
    let plan = Plan::build(
        &c,
        assumed("sm_120:96GB", 1),
        &options,
        &Registry::builtin(),
    )
    .unwrap();
    assert!(plan.layers.iter().all(|l| {
        let choice = l.op(Op::SparseMla).unwrap().choice.as_ref().unwrap();
        choice.forced && choice.entry.name == "reference"
    }));
}

#[test]
fn user_layer_maps_are_checked_against_each_devices_memory() {
    let c = tiny();
    let registry = Registry::builtin();
    let two = vec![DeviceDesc::cpu(GIB), DeviceDesc::cpu(GIB)];
    let mut options = PlanOptions::new(DType::F32, AttentionMode::Sparse);
    options.layer_devices = Some(vec![0, 1, 1]);
    let plan = Plan::build(&c, two.clone(), &options, &registry).unwrap();
    assert_eq!((plan.embed_device, plan.head_device), (0, 1));
    assert_eq!(plan.boundaries(), vec![(1, 0, 1)]);

    options.layer_devices = Some(vec![0, 2, 1]);
    assert!(matches!(
        Plan::build(&c, two.clone(), &options, &registry),
        Err(PlanError::LayerMapDevice {
            layer: 1,
            device: 2,
            ..
        })
    ));
    options.layer_devices = Some(vec![0, 1]);
    assert!(matches!(
        Plan::build(&c, two, &options, &registry),
        Err(PlanError::LayerMapLength { .. })
    ));

    // Device 1 is too small for layers 1 and 2: the error names it and the bytes missing there.
    let layer_bytes = |l| {
        sizes::bytes(&sizes::layer_tensors(&c, l, DType::F32))
            + sizes::cache_bytes_per_token(&c, DType::F32, KeyFormat::Float)
                * c.max_position_embeddings as u64
    };
    let small = layer_bytes(1) + 100;
    let devices = vec![DeviceDesc::cpu(GIB), DeviceDesc::cpu(small)];
    options.layer_devices = Some(vec![0, 1, 1]);
    let err = Plan::build(&c, devices, &options, &registry).unwrap_err();
    let PlanError::DoesNotFit {
        item,
        device_free,
        missing,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(item, "layer 2");
    assert_eq!(*device_free, 100);
    assert_eq!(*missing, layer_bytes(2) - 100);
}

#[test]
fn automatic_placement_spreads_a_tiny_model_by_memory() {
    let c = tiny();
    // Room for about two layers per device: three devices get every layer in order, head on the last.
    let per_layer = sizes::bytes(&sizes::layer_tensors(&c, 1, DType::F32))
        + sizes::cache_bytes_per_token(&c, DType::F32, KeyFormat::Float) * 1024;
    let devices = vec![DeviceDesc::cpu(2 * per_layer); 3];
    let plan = Plan::build(
        &c,
        devices,
        &PlanOptions::new(DType::F32, AttentionMode::Sparse),
        &Registry::builtin(),
    )
    .unwrap();
    let used: Vec<usize> = plan.layers.iter().map(|l| l.device).collect();
    assert!(used.windows(2).all(|w| w[0] <= w[1]), "{used:?}");
    for u in plan.device_usage() {
        assert!(u.weight_bytes + u.cache_bytes <= 2 * per_layer);
    }
    assert!(matches!(
        Plan::build(
            &c,
            vec![],
            &PlanOptions::new(DType::F32, AttentionMode::Sparse),
            &Registry::builtin()
        ),
        Err(PlanError::NoDevices)
    ));
}
