//! `Config` parsing and validation, and checkpoint loading errors: every bad input is a typed error naming
//! its cause.

use std::path::{Path, PathBuf};

use glm5::candle_core::{DType, Device, Tensor};
use glm5::models::{Config, MlpKind, ModelError};
use glm5::{AttentionMode, Glm5ForCausalLM};

fn repo_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn glm5_json() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(repo_path("tests/assets/glm5_config.json")).unwrap(),
    )
    .unwrap()
}

/// GLM-5's config with `edit` applied.
fn parse_edited(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> glm5::models::Result<Config> {
    let mut value = glm5_json();
    edit(value.as_object_mut().unwrap());
    Config::from_json(&value.to_string())
}

#[test]
fn glm5_real_config_parses_to_the_spec_numbers() {
    let config = Config::from_file(repo_path("tests/assets/glm5_config.json")).unwrap();
    assert_eq!(config.num_hidden_layers, 78);
    assert_eq!(
        config
            .mlp_layer_types
            .iter()
            .filter(|k| **k == MlpKind::Dense)
            .count(),
        3
    );
    assert_eq!(config.mlp_layer_types[3], MlpKind::MoE);
    assert_eq!(config.latent_dim(), 576);
    assert_eq!(config.qk_head_dim(), 256);
    assert_eq!(config.softmax_scale(), 1.0 / 16.0);
    assert_eq!(config.index_weight_scale(), 1.0 / 64.0);
    assert_eq!(config.rope_theta, 1e6);
    assert_eq!(config.eos_token_ids, vec![154820, 154827, 154829]);
}

#[test]
fn hf_defaults_fill_absent_fields() {
    let config = Config::from_json(r#"{"model_type": "glm_moe_dsa"}"#).unwrap();
    let glm5 = Config::from_file(repo_path("tests/assets/glm5_config.json")).unwrap();
    assert_eq!(
        config,
        Config {
            eos_token_ids: vec![],
            // HF's config has no MTP field (it never loads the layer): none unless the config says so.
            num_nextn_predict_layers: 0,
            ..glm5
        }
    );
    let too_many = parse_edited(|c| {
        c.insert("num_nextn_predict_layers".into(), 1_000_000.into());
    })
    .unwrap_err();
    assert!(
        too_many.to_string().contains("num_nextn_predict_layers"),
        "{too_many}"
    );
}

#[test]
fn rope_theta_is_read_in_both_forms_and_dense_layers_from_either_key() {
    let legacy = parse_edited(|c| {
        c.remove("rope_parameters");
        c.insert("rope_theta".into(), 5000.0.into());
        c.insert(
            "mlp_layer_types".into(),
            serde_json::json!(["dense"; 1]
                .iter()
                .chain(["sparse"; 77].iter())
                .collect::<Vec<_>>()),
        );
    })
    .unwrap();
    assert_eq!(legacy.rope_theta, 5000.0);
    assert_eq!(
        legacy
            .mlp_layer_types
            .iter()
            .filter(|k| **k == MlpKind::Dense)
            .count(),
        1
    );
}

fn assert_invalid(result: glm5::models::Result<Config>, expected_field: &str) {
    match result {
        Err(ModelError::InvalidConfig { field, .. }) => assert_eq!(field, expected_field),
        other => panic!("expected InvalidConfig({expected_field}), got {other:?}"),
    }
}

#[test]
fn bad_fields_are_typed_errors() {
    assert!(matches!(
        parse_edited(|c| { c.insert("model_type".into(), "deepseek_v32".into()); }),
        Err(ModelError::WrongModelType { found }) if found == "deepseek_v32"
    ));
    assert!(matches!(
        parse_edited(|c| {
            c.remove("model_type");
        }),
        Err(ModelError::MissingField {
            field: "model_type"
        })
    ));
    assert_invalid(
        parse_edited(|c| {
            c.insert("index_topk".into(), 0.into());
        }),
        "index_topk",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert("n_group".into(), 3.into());
        }),
        "n_group",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert("n_group".into(), 4.into());
            c.insert("topk_group".into(), 5.into());
        }),
        "topk_group",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert("qk_rope_head_dim".into(), 192.into());
        }),
        "qk_rope_head_dim",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert("qk_rope_head_dim".into(), 63.into());
        }),
        "qk_rope_head_dim",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert("num_attention_heads".into(), 0.into());
        }),
        "num_attention_heads",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert("n_group".into(), 8.into());
            c.insert("topk_group".into(), 1.into());
            c.insert("num_experts_per_tok".into(), 40.into());
        }),
        "num_experts_per_tok",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert(
                "mlp_layer_types".into(),
                serde_json::json!(["dense", "sparse"]),
            );
        }),
        "mlp_layer_types",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert(
                "mlp_layer_types".into(),
                serde_json::json!(["dense"; 78].iter().map(|_| "mixed").collect::<Vec<_>>()),
            );
        }),
        "mlp_layer_types",
    );
    assert_invalid(
        parse_edited(|c| {
            c.insert("rms_norm_eps".into(), (-1.0).into());
        }),
        "rms_norm_eps",
    );
    assert!(matches!(
        parse_edited(|c| {
            c.insert("hidden_size".into(), "big".into());
        }),
        Err(ModelError::ConfigJson(_))
    ));
    assert!(matches!(
        Config::from_json("{not json"),
        Err(ModelError::ConfigJson(_))
    ));
    assert!(matches!(
        Config::from_file("/nonexistent/config.json"),
        Err(ModelError::Io { .. })
    ));
}

#[test]
fn unsupported_variants_say_so() {
    for edit in [
        |c: &mut serde_json::Map<_, _>| {
            c.insert("hidden_act".into(), "gelu".into());
        },
        |c: &mut serde_json::Map<_, _>| {
            c.insert("q_lora_rank".into(), serde_json::Value::Null);
        },
        |c: &mut serde_json::Map<_, _>| {
            c.insert(
                "rope_parameters".into(),
                serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            );
        },
        |c: &mut serde_json::Map<_, _>| {
            c.insert(
                "indexer_types".into(),
                serde_json::json!(["full", "shared"]),
            );
        },
        |c: &mut serde_json::Map<_, _>| {
            c.insert("attention_bias".into(), true.into());
        },
    ] {
        assert!(matches!(
            parse_edited(edit),
            Err(ModelError::Unsupported { .. })
        ));
    }
}

/// A copy of a fixture model directory in a temp dir, to break.
fn fixture_copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(repo_path("tests/fixtures").join(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn load(dir: &Path) -> glm5::models::Result<Glm5ForCausalLM> {
    Glm5ForCausalLM::from_dir(dir, DType::F32, &Device::Cpu, AttentionMode::Sparse)
}

/// Rewrites `model.safetensors` of `dir` with `edit` applied to its tensors.
fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut std::collections::HashMap<String, Tensor>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = glm5::candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut tensors);
    glm5::candle_core::safetensors::save(&tensors, &path).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = fixture_copy("sparse_long");
    let name = "model.layers.2.mlp.experts.5.up_proj.weight";
    rewrite_weights(dir.path(), |t| {
        t.remove(name);
    });
    match load(dir.path()) {
        Err(ModelError::MissingTensor { name: missing }) => assert_eq!(missing, name),
        other => panic!("expected MissingTensor, got {:?}", other.err()),
    }
}

#[test]
fn misshapen_tensor_names_expected_and_found_shapes() {
    let dir = fixture_copy("sparse_long");
    let name = "model.layers.1.self_attn.kv_b_proj.weight";
    rewrite_weights(dir.path(), |t| {
        t.insert(
            name.into(),
            Tensor::ones((7, 16), DType::F32, &Device::Cpu).unwrap(),
        );
    });
    match load(dir.path()) {
        Err(ModelError::TensorShape {
            name: bad,
            expected,
            found,
        }) => {
            assert_eq!(bad, name);
            assert_eq!(expected, vec![4 * (12 + 16), 16]);
            assert_eq!(found, vec![7, 16]);
        }
        other => panic!("expected TensorShape, got {:?}", other.err()),
    }
}

#[test]
fn unsupported_tensor_dtype_is_named() {
    let dir = fixture_copy("sparse_long");
    let name = "model.norm.weight";
    rewrite_weights(dir.path(), |t| {
        t.insert(
            name.into(),
            Tensor::ones(64, DType::U8, &Device::Cpu).unwrap(),
        );
    });
    assert!(
        matches!(load(dir.path()), Err(ModelError::TensorDtype { name: bad, .. }) if bad == name)
    );
}

#[test]
fn missing_shard_or_checkpoint_is_an_error_naming_the_file() {
    let dir = fixture_copy("dense_equiv");
    std::fs::remove_file(dir.path().join("model-00002-of-00003.safetensors")).unwrap();
    match load(dir.path()) {
        Err(ModelError::Checkpoint { path, .. }) => {
            assert!(path.ends_with("model-00002-of-00003.safetensors"))
        }
        other => panic!("expected Checkpoint error, got {:?}", other.err()),
    }
    let dir = fixture_copy("sparse_long");
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"<html>500 Internal Server Error</html>",
    )
    .unwrap();
    assert!(matches!(
        load(dir.path()),
        Err(ModelError::Checkpoint { .. })
    ));
}

#[test]
fn mtp_layer_tensors_are_ignored() {
    let dir = fixture_copy("sparse_long");
    rewrite_weights(dir.path(), |t| {
        t.insert(
            "model.layers.4.eh_proj.weight".into(),
            Tensor::ones((64, 128), DType::F32, &Device::Cpu).unwrap(),
        );
        t.insert(
            "model.layers.4.enorm.weight".into(),
            Tensor::ones(64, DType::F32, &Device::Cpu).unwrap(),
        );
    });
    assert!(load(dir.path()).is_ok());
}

#[test]
fn bad_forward_inputs_are_typed_errors() {
    let model = load(&repo_path("tests/fixtures/sparse_long")).unwrap();
    let mut cache = model.new_cache(8).unwrap();
    assert!(matches!(
        model.forward(&[], 0, &mut cache),
        Err(ModelError::EmptyInput)
    ));
    assert!(matches!(
        model.forward(&[5, 256], 0, &mut cache),
        Err(ModelError::TokenOutOfRange {
            token: 256,
            position: 1,
            vocab_size: 256
        })
    ));
    assert!(matches!(
        model.forward(&[5; 9], 0, &mut cache),
        Err(ModelError::CacheFull {
            needed: 9,
            capacity: 8
        })
    ));
    assert!(matches!(
        model.forward(&[5], 3, &mut cache),
        Err(ModelError::CacheMismatch {
            start_pos: 3,
            cached: 0
        })
    ));
    model.forward(&[5; 8], 0, &mut cache).unwrap();
    assert!(matches!(
        model.forward(&[5], 8, &mut cache),
        Err(ModelError::CacheFull { .. })
    ));
    let mut long_cache = model.new_cache(256).unwrap();
    assert!(matches!(
        model.forward(&[5; 257], 0, &mut long_cache),
        Err(ModelError::ContextOverflow { .. })
    ));
    assert!(model.new_cache(257).is_err());
}

#[test]
fn f16_storage_loads_and_stays_close_to_the_f32_reference() {
    let dir = fixture_copy("sparse_long");
    rewrite_weights(dir.path(), |tensors| {
        for tensor in tensors.values_mut() {
            *tensor = tensor.to_dtype(DType::F16).unwrap();
        }
    });
    let model = load(dir.path()).unwrap();
    let reference = glm5::candle_core::safetensors::load(
        dir.path().join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let ids: Vec<u32> = reference["input_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .iter()
        .map(|&i| i as u32)
        .collect();
    let topk = model.config().index_topk;
    let mut cache = model.new_cache(topk).unwrap();
    let logits = model.forward(&ids[..topk], 0, &mut cache).unwrap();
    let expected = reference["logits"].narrow(0, 0, topk).unwrap();
    let err: f32 = (logits - expected)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!(
        err > 0.0 && err < 2e-2,
        "f16-rounded weights move the logits by {err}"
    );
}
