//! GGUF metadata of llama.cpp's `glm-dsa` architecture → [`Config`].
//!
//! The keys are those llama.cpp's converter (`GlmMoeDsaModel`, a `DeepseekV2Model`) writes, each turned back
//! into the `config.json` field it came from; the result goes through [`Config::from_json`], so a GGUF model
//! is validated exactly as a Hugging Face one.
//!
//! | GGUF key (`glm-dsa.` prefix)              | config.json                          |
//! |-------------------------------------------|--------------------------------------|
//! | `block_count` − `nextn_predict_layers`    | `num_hidden_layers` (MTP blocks are appended) |
//! | `embedding_length`, `feed_forward_length` | `hidden_size`, `intermediate_size`   |
//! | `context_length`, `vocab_size`            | `max_position_embeddings`, `vocab_size` |
//! | `attention.head_count`                    | `num_attention_heads` (`head_count_kv` is 1: MLA as MQA) |
//! | `attention.q_lora_rank`, `kv_lora_rank`   | `q_lora_rank`, `kv_lora_rank`        |
//! | `rope.dimension_count`                    | `qk_rope_head_dim`                   |
//! | `attention.key_length_mla` − rope dims    | `qk_nope_head_dim`                   |
//! | `attention.value_length_mla`              | `v_head_dim`                         |
//! | `attention.layer_norm_rms_epsilon`        | `rms_norm_eps`                       |
//! | `rope.freq_base`                          | `rope_theta`                         |
//! | `attention.indexer.{head_count,key_length,top_k}` | `index_n_heads`, `index_head_dim`, `index_topk` |
//! | `attention.indexer.types` (true = full)   | `indexer_types`                      |
//! | `leading_dense_block_count`               | `first_k_dense_replace`              |
//! | `expert_{count,used_count,shared_count}`  | `n_routed_experts`, `num_experts_per_tok`, `n_shared_experts` |
//! | `expert_feed_forward_length`              | `moe_intermediate_size`              |
//! | `expert_group_count`, `expert_group_used_count` | `n_group`, `topk_group`        |
//! | `expert_weights_scale`, `expert_weights_norm` | `routed_scaling_factor`, `norm_topk_prob` (absent: false) |
//! | `expert_gating_func` (2 = sigmoid)        | `scoring_func`                       |
//! | `tokenizer.ggml.{eos,eot,eom}_token_id`   | `eos_token_id` (GLM-5 stops on all three) |
//! | no `output.weight` tensor                 | `tie_word_embeddings`                |

use serde_json::{json, Map, Value as Json};

use super::gguf::{metadata_err, GgufModel};
use crate::config::Config;
use crate::error::{ModelError, Result};

/// llama.cpp's architecture name for `GlmMoeDsaForCausalLM`.
pub const GGUF_ARCH: &str = "glm-dsa";

/// MTP (NextN) blocks appended after the main layers; glm5 does not run them yet.
pub fn nextn_layers(gguf: &GgufModel) -> Result<usize> {
    Ok(gguf
        .uint(&format!("{GGUF_ARCH}.nextn_predict_layers"))?
        .unwrap_or(0) as usize)
}

/// The config of a `glm-dsa` GGUF model.
pub fn config_from_gguf(gguf: &GgufModel) -> Result<Config> {
    let arch = gguf.string("general.architecture")?;
    if arch != GGUF_ARCH {
        return Err(ModelError::WrongModelType {
            found: format!("{arch} (GGUF general.architecture; glm5 reads \"{GGUF_ARCH}\")"),
        });
    }
    let key = |name: &str| format!("{GGUF_ARCH}.{name}");
    let need = |name: &str| -> Result<u64> {
        gguf.uint(&key(name))?
            .ok_or_else(|| metadata_err(&key(name), "missing".into()).into())
    };
    let mut raw = Map::new();
    raw.insert("model_type".into(), json!("glm_moe_dsa"));
    let mut put = |field: &str, value: Json| {
        raw.insert(field.into(), value);
    };

    let blocks = need("block_count")?;
    let nextn = nextn_layers(gguf)? as u64;
    let layers = blocks
        .checked_sub(nextn)
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            metadata_err(
                &key("nextn_predict_layers"),
                format!("{nextn} NextN layers leave none of the {blocks} blocks"),
            )
        })?;
    put("num_hidden_layers", json!(layers));
    put("num_nextn_predict_layers", json!(nextn));
    put("hidden_size", json!(need("embedding_length")?));
    put("intermediate_size", json!(need("feed_forward_length")?));
    put("max_position_embeddings", json!(need("context_length")?));
    let vocab = match gguf.uint(&key("vocab_size"))? {
        Some(v) => v,
        None => gguf
            .tensor_info("token_embd.weight")?
            .dims
            .get(1)
            .copied()
            .unwrap_or(0),
    };
    put("vocab_size", json!(vocab));
    put("num_attention_heads", json!(need("attention.head_count")?));
    put("q_lora_rank", json!(need("attention.q_lora_rank")?));
    put("kv_lora_rank", json!(need("attention.kv_lora_rank")?));
    let rope = need("rope.dimension_count")?;
    put("qk_rope_head_dim", json!(rope));
    let key_length = need("attention.key_length_mla")?;
    let nope = key_length.checked_sub(rope).ok_or_else(|| {
        metadata_err(
            &key("attention.key_length_mla"),
            format!("{key_length} is less than the {rope} rope dims"),
        )
    })?;
    put("qk_nope_head_dim", json!(nope));
    put("v_head_dim", json!(need("attention.value_length_mla")?));
    if let Some(eps) = gguf.float(&key("attention.layer_norm_rms_epsilon"))? {
        put("rms_norm_eps", json!(eps));
    }
    if let Some(theta) = gguf.float(&key("rope.freq_base"))? {
        put(
            "rope_parameters",
            json!({"rope_theta": theta, "rope_type": "default"}),
        );
    }
    if gguf.get(&key("rope.scaling.type")).is_some() {
        put("rope_scaling", json!({"from_gguf": true}));
    }
    put(
        "index_n_heads",
        json!(need("attention.indexer.head_count")?),
    );
    put(
        "index_head_dim",
        json!(need("attention.indexer.key_length")?),
    );
    put("index_topk", json!(need("attention.indexer.top_k")?));
    if let Some(candle_core::quantized::gguf_file::Value::Array(types)) =
        gguf.get(&key("attention.indexer.types"))
    {
        let names: Vec<&str> = types
            .iter()
            .map(|t| match t.to_bool() {
                Ok(true) => "full",
                _ => "shared",
            })
            .collect();
        // One entry per block, MTP blocks included: keep the main layers'.
        put(
            "indexer_types",
            json!(names.iter().take(layers as usize).collect::<Vec<_>>()),
        );
    }
    if let Some(dense) = gguf.uint(&key("leading_dense_block_count"))? {
        put("first_k_dense_replace", json!(dense));
    }
    put("n_routed_experts", json!(need("expert_count")?));
    put("num_experts_per_tok", json!(need("expert_used_count")?));
    put(
        "n_shared_experts",
        json!(gguf.uint(&key("expert_shared_count"))?.unwrap_or(0)),
    );
    put(
        "moe_intermediate_size",
        json!(need("expert_feed_forward_length")?),
    );
    if let Some(groups) = gguf.uint(&key("expert_group_count"))? {
        put("n_group", json!(groups));
    }
    if let Some(used) = gguf.uint(&key("expert_group_used_count"))? {
        put("topk_group", json!(used));
    }
    if let Some(scale) = gguf.float(&key("expert_weights_scale"))? {
        put("routed_scaling_factor", json!(scale));
    }
    // The converter writes the key only when norm_topk_prob is true.
    put(
        "norm_topk_prob",
        json!(gguf.bool(&key("expert_weights_norm"))?.unwrap_or(false)),
    );
    match gguf.uint(&key("expert_gating_func"))? {
        None | Some(2) => put("scoring_func", json!("sigmoid")),
        Some(1) => put("scoring_func", json!("softmax")),
        Some(other) => put("scoring_func", json!(format!("gating function {other}"))),
    }
    let mut eos = Vec::new();
    for name in ["eos", "eot", "eom"] {
        if let Some(id) = gguf.uint(&format!("tokenizer.ggml.{name}_token_id"))? {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    put("eos_token_id", json!(eos));
    put(
        "tie_word_embeddings",
        json!(!gguf.tensors.contains_key("output.weight")),
    );
    Config::from_json(&Json::Object(raw).to_string())
}
