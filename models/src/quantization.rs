//! The quantised safetensors formats glm5 loads, as their configs declare them:
//!
//! * block-scaled FP8 (`zai-org/GLM-5-FP8`, DeepSeek-V3 style): `config.json`'s `quantization_config` with
//!   `quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [bo, bi]`, `activation_scheme: "dynamic"` and
//!   optional `modules_to_not_convert`. A linear layer is FP8 where its `<name>.weight_scale_inv` exists.
//! * NVFP4 as NVIDIA ModelOpt exports it: `hf_quant_config.json`'s `quantization` (or `config.json`'s
//!   `quantization_config` with `quant_method: "modelopt"`) with `quant_algo: "NVFP4"`, `group_size: 16` and
//!   `exclude_modules` (or `ignore`). A linear layer is NVFP4 where its `<name>.weight_scale` exists.
//!
//! Anything else (another method, algorithm, element format, activation scheme or group size) is an error
//! naming the field. The module lists say which layers stay in bf16: the loader decides per tensor from the
//! checkpoint, `glm5 plan` (which sees only the config) from the lists and [`Quantization::quantizes`].

use std::path::Path;

use serde_json::Value;

use crate::error::{ModelError, Result};

/// A checkpoint's quantisation (module docs).
#[derive(Debug, Clone, PartialEq)]
pub enum Quantization {
    /// Block-scaled FP8 e4m3 weights, one f32 multiplier per `block[0] x block[1]` block.
    Fp8Block {
        block: [usize; 2],
        /// Module names or patterns kept unquantised.
        modules_to_not_convert: Vec<String>,
    },
    /// NVFP4: e2m1 weights, an e4m3 scale per `group_size` values and an f32 scale per tensor.
    Nvfp4 {
        group_size: usize,
        /// Module names or patterns kept unquantised.
        exclude_modules: Vec<String>,
    },
}

/// Bytes of `hf_quant_config.json` read at most.
const MAX_QUANT_CONFIG_BYTES: u64 = 16 << 20;

fn invalid(field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::QuantizationConfig {
        field: field.to_string(),
        reason: reason.into(),
    }
}

fn string_list(
    object: &serde_json::Map<String, Value>,
    key: &str,
    field: &str,
) -> Result<Vec<String>> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| invalid(field, format!("must be a list of strings, has {v}")))
            })
            .collect(),
        Some(other) => Err(invalid(
            field,
            format!("must be a list of strings, got {other}"),
        )),
    }
}

impl Quantization {
    /// The quantisation of a model directory: `config.json`'s `quantization_config`, else
    /// `hf_quant_config.json`'s `quantization`; `None` for a plain checkpoint (or no config at all).
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config = dir.join("config.json");
        if config.is_file() {
            let text =
                crate::config::read_text_file(&config, crate::config::limits::CONFIG_FILE_BYTES)
                    .map_err(|source| ModelError::Io {
                        path: config.clone(),
                        source,
                    })?;
            let value: Value = serde_json::from_str(&text)?;
            if let Some(q) = value.get("quantization_config").filter(|v| !v.is_null()) {
                return Self::from_quantization_config(q).map(Some);
            }
        }
        Self::from_hf_quant_config(dir)
    }

    /// `hf_quant_config.json` of `dir` (ModelOpt), if present.
    pub fn from_hf_quant_config(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("hf_quant_config.json");
        if !path.is_file() {
            return Ok(None);
        }
        let text =
            crate::config::read_text_file(&path, MAX_QUANT_CONFIG_BYTES).map_err(|source| {
                ModelError::Io {
                    path: path.clone(),
                    source,
                }
            })?;
        let value: Value = serde_json::from_str(&text)?;
        let quantization = value
            .get("quantization")
            .ok_or_else(|| invalid("hf_quant_config.json: quantization", "is missing"))?;
        Self::modelopt(quantization, "hf_quant_config.json: quantization").map(Some)
    }

    /// `config.json`'s `quantization_config`.
    pub fn from_quantization_config(q: &Value) -> Result<Self> {
        let field = "quantization_config";
        let object = q
            .as_object()
            .ok_or_else(|| invalid(field, format!("must be an object, got {q}")))?;
        match object.get("quant_method").and_then(Value::as_str) {
            Some("fp8") => Self::fp8(object),
            Some("modelopt") | Some("modelopt_fp4") => Self::modelopt(q, field),
            Some(other) => Err(invalid(
                "quantization_config.quant_method",
                format!("is {other:?}; glm5 loads \"fp8\" (block-scaled) and \"modelopt\" (NVFP4)"),
            )),
            None => Err(invalid("quantization_config.quant_method", "is missing")),
        }
    }

    fn fp8(object: &serde_json::Map<String, Value>) -> Result<Self> {
        let text = |key: &str| object.get(key).and_then(Value::as_str);
        if let Some(fmt) = text("fmt").filter(|f| *f != "e4m3") {
            return Err(invalid(
                "quantization_config.fmt",
                format!("is {fmt:?}; glm5 loads \"e4m3\""),
            ));
        }
        if let Some(scheme) = text("activation_scheme").filter(|s| *s != "dynamic") {
            return Err(invalid(
                "quantization_config.activation_scheme",
                format!("is {scheme:?}; glm5 loads \"dynamic\" (no activation scales in the checkpoint)"),
            ));
        }
        let field = "quantization_config.weight_block_size";
        let block = match object.get("weight_block_size") {
            Some(Value::Array(sizes)) if sizes.len() == 2 => {
                let size = |v: &Value| {
                    v.as_u64()
                        .filter(|&s| (1..=1 << 16).contains(&s))
                        .map(|s| s as usize)
                        .ok_or_else(|| invalid(field, format!("must hold two sizes in 1..=65536, has {v}")))
                };
                [size(&sizes[0])?, size(&sizes[1])?]
            }
            None | Some(Value::Null) => {
                return Err(invalid(
                    field,
                    "is missing: glm5 loads block-scaled FP8 only (per-tensor and per-channel FP8 are not supported)",
                ))
            }
            Some(other) => return Err(invalid(field, format!("must be [rows, columns], got {other}"))),
        };
        Ok(Quantization::Fp8Block {
            block,
            modules_to_not_convert: string_list(
                object,
                "modules_to_not_convert",
                "quantization_config.modules_to_not_convert",
            )?,
        })
    }

    fn modelopt(q: &Value, field: &str) -> Result<Self> {
        let object = q
            .as_object()
            .ok_or_else(|| invalid(field, format!("must be an object, got {q}")))?;
        match object.get("quant_algo").and_then(Value::as_str) {
            Some("NVFP4") => {}
            Some(other) => {
                return Err(invalid(
                    &format!("{field}.quant_algo"),
                    format!("is {other:?}; glm5 loads \"NVFP4\" ModelOpt checkpoints"),
                ))
            }
            None => return Err(invalid(&format!("{field}.quant_algo"), "is missing")),
        }
        let group_size = match object.get("group_size") {
            None | Some(Value::Null) => 16,
            Some(v) if v.as_u64() == Some(16) => 16,
            Some(other) => {
                return Err(invalid(
                    &format!("{field}.group_size"),
                    format!("is {other}; NVFP4 uses 16"),
                ))
            }
        };
        let key = if object.contains_key("exclude_modules") {
            "exclude_modules"
        } else {
            "ignore"
        };
        Ok(Quantization::Nvfp4 {
            group_size,
            exclude_modules: string_list(object, key, &format!("{field}.{key}"))?,
        })
    }

    /// The module patterns kept unquantised.
    pub fn excluded(&self) -> &[String] {
        match self {
            Quantization::Fp8Block {
                modules_to_not_convert,
                ..
            } => modules_to_not_convert,
            Quantization::Nvfp4 {
                exclude_modules, ..
            } => exclude_modules,
        }
    }

    /// Whether the published recipe quantises the `[out, in]` weight `name` (`<module>.weight`): every
    /// linear layer except the embeddings, `lm_head`, the router `mlp.gate`, the indexer's `weights_proj`
    /// and the modules the config excludes. `glm5 plan` sizes with this; the loader follows the checkpoint.
    pub fn quantizes(&self, name: &str) -> bool {
        let Some(module) = name.strip_suffix(".weight") else {
            return false;
        };
        let always_dense = module == "lm_head"
            || module.ends_with("embed_tokens")
            || module.ends_with("mlp.gate")
            || module.ends_with("weights_proj")
            || module.contains("norm");
        !always_dense && !self.excluded().iter().any(|p| module_matches(p, module))
    }

    /// Bytes the `[out, in]` weight takes quantised, its scales included.
    pub fn matrix_bytes(&self, out: usize, inp: usize) -> u64 {
        let (out, inp) = (out as u64, inp as u64);
        match self {
            Quantization::Fp8Block { block, .. } => out.saturating_mul(inp).saturating_add(
                out.div_ceil(block[0] as u64)
                    .saturating_mul(inp.div_ceil(block[1] as u64))
                    .saturating_mul(4),
            ),
            Quantization::Nvfp4 { group_size, .. } => {
                let values = out.saturating_mul(inp);
                values / 2 + values / *group_size as u64 + 4
            }
        }
    }

    /// A short name: `FP8 (128x128 blocks)`, `NVFP4`.
    pub fn describe(&self) -> String {
        match self {
            Quantization::Fp8Block { block, .. } => {
                format!("FP8 e4m3, {}x{} blocks", block[0], block[1])
            }
            Quantization::Nvfp4 { group_size, .. } => format!("NVFP4, groups of {group_size}"),
        }
    }
}

/// Whether module `name` matches `pattern`: a glob (`*` any text, as ModelOpt's fnmatch patterns) when it
/// has a `*`, else the pattern naming the module or a dotted part of its name (as transformers'
/// `modules_to_not_convert`).
pub fn module_matches(pattern: &str, name: &str) -> bool {
    if pattern.contains('*') {
        return glob(pattern.as_bytes(), name.as_bytes());
    }
    name == pattern
        || name.ends_with(&format!(".{pattern}"))
        || name.starts_with(&format!("{pattern}."))
        || name.contains(&format!(".{pattern}."))
}

fn glob(pattern: &[u8], text: &[u8]) -> bool {
    match pattern.split_first() {
        None => text.is_empty(),
        Some((b'*', rest)) => (0..=text.len()).any(|i| glob(rest, &text[i..])),
        Some((&c, rest)) => text.first() == Some(&c) && glob(rest, &text[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_as_modelopt_and_transformers_write_them() {
        assert!(module_matches("lm_head", "lm_head"));
        assert!(module_matches(
            "*self_attn*",
            "model.layers.3.self_attn.q_a_proj"
        ));
        assert!(module_matches(
            "model.layers.*.mlp.gate",
            "model.layers.7.mlp.gate"
        ));
        assert!(!module_matches(
            "model.layers.*.mlp.gate",
            "model.layers.7.mlp.gate_proj"
        ));
        assert!(module_matches(
            "indexer",
            "model.layers.0.self_attn.indexer.wk"
        ));
        assert!(!module_matches("gate", "model.layers.0.mlp.gate_proj"));
    }

    #[test]
    fn unsupported_fields_are_named() {
        let err = |json: &str| {
            Quantization::from_quantization_config(&serde_json::from_str(json).unwrap())
                .unwrap_err()
                .to_string()
        };
        assert!(err(r#"{"quant_method":"gptq"}"#).contains("quantization_config.quant_method"));
        assert!(
            err(r#"{"quant_method":"fp8","fmt":"e5m2","weight_block_size":[128,128]}"#)
                .contains("quantization_config.fmt")
        );
        assert!(err(
            r#"{"quant_method":"fp8","activation_scheme":"static","weight_block_size":[128,128]}"#
        )
        .contains("quantization_config.activation_scheme"));
        assert!(err(r#"{"quant_method":"fp8"}"#).contains("weight_block_size"));
        assert!(err(r#"{"quant_method":"fp8","weight_block_size":[0,128]}"#)
            .contains("weight_block_size"));
        assert!(err(r#"{"quant_method":"modelopt","quant_algo":"FP8"}"#).contains("quant_algo"));
        assert!(
            err(r#"{"quant_method":"modelopt","quant_algo":"NVFP4","group_size":32}"#)
                .contains("group_size")
        );
    }

    #[test]
    fn glm5_fp8_sizes_its_blocks_with_the_partial_edge() {
        let q = Quantization::from_quantization_config(
            &serde_json::from_str(
                r#"{"quant_method":"fp8","fmt":"e4m3","activation_scheme":"dynamic","weight_block_size":[128,128]}"#,
            )
            .unwrap(),
        )
        .unwrap();
        // kv_a_proj_with_mqa: 576 rows = 4.5 blocks -> 5 scale rows; 6144 columns -> 48.
        assert_eq!(q.matrix_bytes(576, 6144), 576 * 6144 + 5 * 48 * 4);
        assert!(q.quantizes("model.layers.3.mlp.experts.0.up_proj.weight"));
        assert!(!q.quantizes("model.layers.3.mlp.gate.weight"));
        assert!(!q.quantizes("model.layers.3.self_attn.indexer.weights_proj.weight"));
        assert!(!q.quantizes("lm_head.weight"));
    }
}
