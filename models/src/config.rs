//! The model's configuration: Hugging Face `config.json` of `model_type: glm_moe_dsa`, parsed and validated.
//!
//! Defaults are HF's (`GlmMoeDsaConfig`, i.e. GLM-5's own numbers) for every field that may be absent.
//! `rope_theta` is read from `rope_parameters.rope_theta` (transformers 5 form) or a top-level `rope_theta`;
//! the MLP kind per layer from `mlp_layer_types` or, failing that, `first_k_dense_replace`.

use std::io::Read;
use std::path::Path;

use serde::Deserialize;

use crate::error::{ModelError, Result};

/// Which feed-forward block a decoder layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    Dense,
    MoE,
}

/// A validated GLM-5 configuration. Every size the model uses comes from here.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    // MLA attention
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rope_theta: f64,
    // DSA lightning indexer
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    // Feed-forward
    pub mlp_layer_types: Vec<MlpKind>,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    /// Multi-token-prediction (MTP) layers stored after the decoder layers, as
    /// `model.layers.{num_hidden_layers + i}.*` [1]: a decoder block (MoE) that drafts the token after next
    /// for speculative decoding. glm5 drafts with the first; 0 where the checkpoint has none.
    pub num_nextn_predict_layers: usize,
    /// How the checkpoint stores its linear layers, if quantised (`quantization_config`, or the
    /// `hf_quant_config.json` beside `config.json`).
    pub quantization: Option<crate::quantization::Quantization>,
}

/// Upper bounds of the config's sizes, documented and enforced by [`Config::from_json`]: far above any GLM-5
/// (its own values in brackets), low enough that every size derived from them fits `u64` with room to spare
/// and that no field alone can ask for an absurd allocation. A value above its bound is an
/// [`ModelError::InvalidConfig`] naming the field and the bound.
pub mod limits {
    /// `vocab_size` [154,880].
    pub const VOCAB_SIZE: usize = 1 << 22;
    /// `hidden_size` [6,144].
    pub const HIDDEN_SIZE: usize = 1 << 16;
    /// `num_hidden_layers` [78].
    pub const NUM_HIDDEN_LAYERS: usize = 512;
    /// `max_position_embeddings` [202,752].
    pub const MAX_POSITION_EMBEDDINGS: usize = 1 << 24;
    /// `num_attention_heads` [64], `index_n_heads` [32].
    pub const HEADS: usize = 1024;
    /// `q_lora_rank` [2,048], `kv_lora_rank` [512].
    pub const LORA_RANK: usize = 1 << 16;
    /// `qk_nope_head_dim` [192], `qk_rope_head_dim` [64], `v_head_dim` [256], `index_head_dim` [128].
    pub const HEAD_DIM: usize = 4096;
    /// `index_topk` [2,048]: the indexer's selection per query is `tokens x index_topk`.
    pub const INDEX_TOPK: usize = 1 << 16;
    /// `intermediate_size` [12,288], `moe_intermediate_size` [2,048].
    pub const INTERMEDIATE_SIZE: usize = 1 << 20;
    /// `n_routed_experts` [256].
    pub const ROUTED_EXPERTS: usize = 1 << 12;
    /// `n_shared_experts` [1].
    pub const SHARED_EXPERTS: usize = 64;
    /// `num_nextn_predict_layers` [1].
    pub const NEXTN_LAYERS: usize = 64;
    /// Entries of `eos_token_id` [3].
    pub const EOS_TOKEN_IDS: usize = 1024;
    /// Parameters of the whole model [about 7.4e11]: 2^46, 70 trillion.
    pub const PARAMETERS: u64 = 1 << 46;
    /// Bytes of `config.json` [about 2 KB].
    pub const CONFIG_FILE_BYTES: u64 = 16 << 20;
}

/// Reads a UTF-8 text file glm5 was pointed at, bounded: only a regular file is opened (a FIFO, a device
/// such as `/dev/zero` or a directory is refused before it could block or stream without end), and one larger
/// than `limit` bytes is refused before it is read. The error names the limit; the caller names the file.
///
/// # Errors
///
/// [`std::io::ErrorKind::InvalidInput`] for a file that is not regular or too large, the read's own errors
/// otherwise (`InvalidData` for text that is not UTF-8).
pub fn read_text_file(path: &Path, limit: u64) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind};
    let too_large = |len: u64| {
        Error::new(
            ErrorKind::InvalidInput,
            format!("{len} bytes, more than the limit of {limit}"),
        )
    };
    let check = |meta: std::fs::Metadata| {
        if !meta.is_file() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "not a regular file (a FIFO, device or directory is refused)",
            ));
        }
        if meta.len() > limit {
            return Err(too_large(meta.len()));
        }
        Ok(())
    };
    check(std::fs::metadata(path)?)?;
    let file = std::fs::File::open(path)?;
    // Again on the open file: the path may have been swapped in between.
    check(file.metadata()?)?;
    let mut text = String::new();
    file.take(limit + 1).read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(too_large(text.len() as u64));
    }
    Ok(text)
}

/// Epsilon of `q_a_layernorm` and `kv_a_layernorm` in HF (the module default, not `rms_norm_eps`).
pub const LATENT_NORM_EPS: f64 = 1e-6;
/// Epsilon of the indexer's key LayerNorm.
pub const INDEX_KEY_NORM_EPS: f64 = 1e-6;

impl Config {
    /// Width of one query/key head: nope part then rope part.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim.saturating_add(self.qk_rope_head_dim)
    }

    /// Width of one latent cache row: `[c (kv_lora) | k_pe (rope)]`.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank.saturating_add(self.qk_rope_head_dim)
    }

    /// Softmax scale of the MLA attention, `qk_head_dim^-1/2` (GLM-5 uses no YaRN mscale).
    pub fn softmax_scale(&self) -> f64 {
        (self.qk_head_dim() as f64).powf(-0.5)
    }

    /// Scale folded into the indexer's per-head weights: `index_n_heads^-1/2 · index_head_dim^-1/2`.
    pub fn index_weight_scale(&self) -> f64 {
        ((self.index_n_heads * self.index_head_dim) as f64).powf(-0.5)
    }

    /// Reads and validates `config.json`; without a `quantization_config` there, the quantisation of a
    /// ModelOpt `hf_quant_config.json` beside it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text =
            read_text_file(path, limits::CONFIG_FILE_BYTES).map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        let mut config = Self::from_json(&text)?;
        if config.quantization.is_none() {
            if let Some(dir) = path.parent() {
                config.quantization = crate::quantization::Quantization::from_hf_quant_config(dir)?;
            }
        }
        Ok(config)
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text)?;
        raw.validate()
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RopeParameters {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
}

/// `config.json` as written, before defaults and checks.
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    eos_token_id: Option<OneOrMany>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    num_attention_heads: Option<usize>,
    /// Kept raw: `null` (no query compression) must be told apart from absent (the default).
    #[serde(default, deserialize_with = "present")]
    q_lora_rank: Option<serde_json::Value>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<serde_json::Value>,
    index_n_heads: Option<usize>,
    index_head_dim: Option<usize>,
    index_topk: Option<usize>,
    indexer_types: Option<Vec<String>>,
    mlp_layer_types: Option<Vec<String>>,
    first_k_dense_replace: Option<usize>,
    intermediate_size: Option<usize>,
    moe_intermediate_size: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    norm_topk_prob: Option<bool>,
    routed_scaling_factor: Option<f64>,
    num_nextn_predict_layers: Option<usize>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    quantization_config: Option<serde_json::Value>,
}

/// `Some(value)` whenever the key is present, `null` included (plain `Option` maps `null` to `None`).
fn present<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

/// `value` in `1..=max`.
fn bounded(field: &'static str, value: usize, max: usize) -> Result<usize> {
    if value == 0 {
        return Err(invalid(field, "must be at least 1"));
    }
    if value > max {
        return Err(invalid(
            field,
            format!("is {value}, more than the limit of {max}"),
        ));
    }
    Ok(value)
}

impl RawConfig {
    fn validate(self) -> Result<Config> {
        match self.model_type.as_deref() {
            Some("glm_moe_dsa") => {}
            Some(other) => {
                return Err(ModelError::WrongModelType {
                    found: other.to_string(),
                })
            }
            None => {
                return Err(ModelError::MissingField {
                    field: "model_type",
                })
            }
        }
        let unsupported = |what: String| Err(ModelError::Unsupported { what });
        if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            return unsupported(format!("hidden_act {act:?} (GLM-5 uses \"silu\")"));
        }
        if self.attention_bias == Some(true) || self.mlp_bias == Some(true) {
            return unsupported("attention_bias/mlp_bias = true".into());
        }
        if let Some(f) = self.scoring_func.as_deref().filter(|f| *f != "sigmoid") {
            return unsupported(format!("scoring_func {f:?}"));
        }
        if let Some(m) = self.topk_method.as_deref().filter(|m| *m != "noaux_tc") {
            return unsupported(format!("topk_method {m:?}"));
        }
        if let Some(types) = &self.indexer_types {
            if let Some(t) = types.iter().find(|t| *t != "full") {
                return unsupported(format!(
                    "indexer_types {t:?} (IndexShare layers of GLM-5.2+)"
                ));
            }
        }
        let rope_type = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_type.clone());
        if let Some(t) = rope_type.as_deref().filter(|t| *t != "default") {
            return unsupported(format!("rope_type {t:?}"));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return unsupported("rope_scaling".into());
        }

        let num_hidden_layers = bounded(
            "num_hidden_layers",
            self.num_hidden_layers.unwrap_or(78),
            limits::NUM_HIDDEN_LAYERS,
        )?;
        let q_lora_rank = match &self.q_lora_rank {
            None => 2048,
            Some(serde_json::Value::Null) => {
                return unsupported(
                    "q_lora_rank = null (the DSA indexer reads the q_lora vector)".into(),
                )
            }
            Some(value) => match value.as_u64() {
                Some(rank) => bounded(
                    "q_lora_rank",
                    usize::try_from(rank).unwrap_or(usize::MAX),
                    limits::LORA_RANK,
                )?,
                None => {
                    return Err(invalid(
                        "q_lora_rank",
                        format!("must be a positive integer, got {value}"),
                    ))
                }
            },
        };
        let rope_theta = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(1_000_000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(invalid(
                "rope_theta",
                format!("must be a positive number, got {rope_theta}"),
            ));
        }
        let rms_norm_eps = self.rms_norm_eps.unwrap_or(1e-5);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(invalid(
                "rms_norm_eps",
                format!("must be positive, got {rms_norm_eps}"),
            ));
        }

        let mlp_layer_types = match self.mlp_layer_types {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "dense" => Ok(MlpKind::Dense),
                    "sparse" | "moe" => Ok(MlpKind::MoE),
                    other => Err(invalid(
                        "mlp_layer_types",
                        format!("has unknown entry {other:?}"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
            None => {
                let dense = self
                    .first_k_dense_replace
                    .unwrap_or(3)
                    .min(num_hidden_layers);
                (0..num_hidden_layers)
                    .map(|l| {
                        if l < dense {
                            MlpKind::Dense
                        } else {
                            MlpKind::MoE
                        }
                    })
                    .collect()
            }
        };
        if mlp_layer_types.len() != num_hidden_layers {
            return Err(invalid(
                "mlp_layer_types",
                format!(
                    "has {} entries for {num_hidden_layers} layers",
                    mlp_layer_types.len()
                ),
            ));
        }

        let config = Config {
            vocab_size: bounded(
                "vocab_size",
                self.vocab_size.unwrap_or(154_880),
                limits::VOCAB_SIZE,
            )?,
            hidden_size: bounded(
                "hidden_size",
                self.hidden_size.unwrap_or(6144),
                limits::HIDDEN_SIZE,
            )?,
            num_hidden_layers,
            rms_norm_eps,
            max_position_embeddings: bounded(
                "max_position_embeddings",
                self.max_position_embeddings.unwrap_or(202_752),
                limits::MAX_POSITION_EMBEDDINGS,
            )?,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            eos_token_ids: match self.eos_token_id {
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) if ids.len() > limits::EOS_TOKEN_IDS => {
                    return Err(invalid(
                        "eos_token_id",
                        format!(
                            "has {} entries, more than the limit of {}",
                            ids.len(),
                            limits::EOS_TOKEN_IDS
                        ),
                    ))
                }
                Some(OneOrMany::Many(ids)) => ids,
                None => vec![],
            },
            num_attention_heads: bounded(
                "num_attention_heads",
                self.num_attention_heads.unwrap_or(64),
                limits::HEADS,
            )?,
            q_lora_rank,
            kv_lora_rank: bounded(
                "kv_lora_rank",
                self.kv_lora_rank.unwrap_or(512),
                limits::LORA_RANK,
            )?,
            qk_nope_head_dim: bounded(
                "qk_nope_head_dim",
                self.qk_nope_head_dim.unwrap_or(192),
                limits::HEAD_DIM,
            )?,
            qk_rope_head_dim: bounded(
                "qk_rope_head_dim",
                self.qk_rope_head_dim.unwrap_or(64),
                limits::HEAD_DIM,
            )?,
            v_head_dim: bounded(
                "v_head_dim",
                self.v_head_dim.unwrap_or(256),
                limits::HEAD_DIM,
            )?,
            rope_theta,
            index_n_heads: bounded(
                "index_n_heads",
                self.index_n_heads.unwrap_or(32),
                limits::HEADS,
            )?,
            index_head_dim: bounded(
                "index_head_dim",
                self.index_head_dim.unwrap_or(128),
                limits::HEAD_DIM,
            )?,
            index_topk: bounded(
                "index_topk",
                self.index_topk.unwrap_or(2048),
                limits::INDEX_TOPK,
            )?,
            mlp_layer_types,
            intermediate_size: bounded(
                "intermediate_size",
                self.intermediate_size.unwrap_or(12288),
                limits::INTERMEDIATE_SIZE,
            )?,
            moe_intermediate_size: bounded(
                "moe_intermediate_size",
                self.moe_intermediate_size.unwrap_or(2048),
                limits::INTERMEDIATE_SIZE,
            )?,
            n_routed_experts: bounded(
                "n_routed_experts",
                self.n_routed_experts.unwrap_or(256),
                limits::ROUTED_EXPERTS,
            )?,
            n_shared_experts: match self.n_shared_experts.unwrap_or(1) {
                n if n > limits::SHARED_EXPERTS => {
                    return Err(invalid(
                        "n_shared_experts",
                        format!("is {n}, more than the limit of {}", limits::SHARED_EXPERTS),
                    ))
                }
                n => n,
            },
            num_experts_per_tok: bounded(
                "num_experts_per_tok",
                self.num_experts_per_tok.unwrap_or(8),
                limits::ROUTED_EXPERTS,
            )?,
            n_group: bounded("n_group", self.n_group.unwrap_or(1), limits::ROUTED_EXPERTS)?,
            topk_group: bounded(
                "topk_group",
                self.topk_group.unwrap_or(1),
                limits::ROUTED_EXPERTS,
            )?,
            norm_topk_prob: self.norm_topk_prob.unwrap_or(true),
            routed_scaling_factor: self.routed_scaling_factor.unwrap_or(2.5),
            num_nextn_predict_layers: match self.num_nextn_predict_layers.unwrap_or(0) {
                n if n > limits::NEXTN_LAYERS => {
                    return Err(invalid(
                        "num_nextn_predict_layers",
                        format!("is {n}, more than the limit of {}", limits::NEXTN_LAYERS),
                    ))
                }
                n => n,
            },
            quantization: self
                .quantization_config
                .as_ref()
                .filter(|q| !q.is_null())
                .map(crate::quantization::Quantization::from_quantization_config)
                .transpose()?,
        };
        config.check_consistency()?;
        Ok(config)
    }
}

impl Config {
    /// Parameters the checkpoint holds for what glm5 loads (as `sizes` counts them), in `u128` so that no
    /// combination of in-bounds fields can overflow while it is checked against [`limits::PARAMETERS`].
    pub fn parameter_count(&self) -> u128 {
        let n = |v: usize| v as u128;
        let (h, heads) = (n(self.hidden_size), n(self.num_attention_heads));
        let (q, kv) = (n(self.q_lora_rank), n(self.kv_lora_rank));
        let (ih, id) = (n(self.index_n_heads), n(self.index_head_dim));
        let attention = 2 * h
            + q * h
            + q
            + heads * n(self.qk_head_dim()) * q
            + n(self.latent_dim()) * h
            + kv
            + heads * n(self.qk_nope_head_dim + self.v_head_dim) * kv
            + h * heads * n(self.v_head_dim)
            + ih * id * q
            + id * h
            + 2 * id
            + ih * h;
        let experts = n(self.n_routed_experts);
        let moe_width = n(self.moe_intermediate_size);
        let layers: u128 = self
            .mlp_layer_types
            .iter()
            .map(|kind| {
                attention
                    + match kind {
                        MlpKind::Dense => 3 * n(self.intermediate_size) * h,
                        MlpKind::MoE => {
                            3 * moe_width * h * (experts + n(self.n_shared_experts))
                                + experts * h
                                + experts
                        }
                    }
            })
            .sum();
        let embeddings = n(self.vocab_size) * h;
        let head = h + if self.tie_word_embeddings {
            0
        } else {
            embeddings
        };
        embeddings + layers + head
    }

    /// Cross-field rules: every one names the field it rejects.
    fn check_consistency(&self) -> Result<()> {
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(invalid(
                "qk_rope_head_dim",
                format!("must be even for RoPE pairs, got {}", self.qk_rope_head_dim),
            ));
        }
        if self.qk_rope_head_dim > self.index_head_dim {
            return Err(invalid(
                "qk_rope_head_dim",
                format!("({}) exceeds index_head_dim ({}): the indexer rotates its first qk_rope_head_dim dims",
                    self.qk_rope_head_dim, self.index_head_dim),
            ));
        }
        if !self.n_routed_experts.is_multiple_of(self.n_group) {
            return Err(invalid(
                "n_group",
                format!(
                    "({}) does not divide n_routed_experts ({})",
                    self.n_group, self.n_routed_experts
                ),
            ));
        }
        if self.topk_group > self.n_group {
            return Err(invalid(
                "topk_group",
                format!("({}) exceeds n_group ({})", self.topk_group, self.n_group),
            ));
        }
        let reachable = self.topk_group * (self.n_routed_experts / self.n_group);
        if self.num_experts_per_tok > reachable {
            return Err(invalid(
                "num_experts_per_tok",
                format!(
                    "({}) exceeds the {reachable} experts in topk_group groups",
                    self.num_experts_per_tok
                ),
            ));
        }
        let parameters = self.parameter_count();
        if parameters > u128::from(limits::PARAMETERS) {
            return Err(invalid(
                "(all sizes together)",
                format!(
                    "describe {parameters} parameters, more than the limit of {}",
                    limits::PARAMETERS
                ),
            ));
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return Err(invalid(
                "routed_scaling_factor",
                format!("must be positive, got {}", self.routed_scaling_factor),
            ));
        }
        Ok(())
    }
}
