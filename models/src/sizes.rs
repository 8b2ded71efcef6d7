//! What the model holds in memory, from the config alone: the checkpoint tensors glm5 loads (names, shapes
//! and the dtype they are kept in, spec §2) and the KV-cache bytes per token. Placement sizes devices with
//! these numbers before any weight is read.
//!
//! Contract: [`layer_tensors`], [`embedding_tensors`], [`head_tensors`] and [`mtp_tensors`] list exactly the
//! tensors `glm5.rs` asks the checkpoint for (the MTP layer `model.layers.{num_hidden_layers}.*` only when
//! speculative decoding asks for it; its copies of the embeddings and lm_head are never read: it shares the
//! main model's),
//! with the router's `gate.weight` and `e_score_correction_bias` in f32 (the model routes in f32) and every
//! other tensor in the model dtype. `lm_head.weight` is listed unless the embeddings are tied.
//!
//! Every product and sum saturates instead of wrapping: a [`Config`] built by hand past
//! [`crate::config::limits`] gets sizes of `u64::MAX` / `usize::MAX`, which fit no device, never a small
//! number that would. (A config read by [`Config::from_json`] stays far below: its parameters are at most
//! [`crate::config::limits::PARAMETERS`].)

use candle_core::DType;
use glm5_ops::KeyFormat;

use crate::config::{Config, MlpKind};

/// One tensor as the model keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorInfo {
    fn new(name: String, shape: &[usize], dtype: DType) -> Self {
        Self {
            name,
            shape: shape.to_vec(),
            dtype,
        }
    }

    pub fn elements(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d as u64))
    }

    pub fn bytes(&self) -> u64 {
        self.elements()
            .saturating_mul(self.dtype.size_in_bytes() as u64)
    }
}

/// Sums of a tensor list.
pub fn params(tensors: &[TensorInfo]) -> u64 {
    tensors
        .iter()
        .fold(0u64, |n, t| n.saturating_add(t.elements()))
}

pub fn bytes(tensors: &[TensorInfo]) -> u64 {
    tensors
        .iter()
        .fold(0u64, |n, t| n.saturating_add(t.bytes()))
}

/// `model.embed_tokens.weight`.
pub fn embedding_tensors(config: &Config, dtype: DType) -> Vec<TensorInfo> {
    vec![TensorInfo::new(
        "model.embed_tokens.weight".into(),
        &[config.vocab_size, config.hidden_size],
        dtype,
    )]
}

/// `model.norm.weight` and, unless tied to the embeddings, `lm_head.weight`.
pub fn head_tensors(config: &Config, dtype: DType) -> Vec<TensorInfo> {
    let mut tensors = vec![TensorInfo::new(
        "model.norm.weight".into(),
        &[config.hidden_size],
        dtype,
    )];
    if !config.tie_word_embeddings {
        tensors.push(TensorInfo::new(
            "lm_head.weight".into(),
            &[config.vocab_size, config.hidden_size],
            dtype,
        ));
    }
    tensors
}

/// Every tensor of decoder layer `layer` (spec §2: attention, indexer, dense MLP or MoE, norms).
pub fn layer_tensors(config: &Config, layer: usize, dtype: DType) -> Vec<TensorInfo> {
    block_tensors(config, layer, config.mlp_layer_types[layer], dtype)
}

/// The first MTP layer's tensors (`model.layers.{num_hidden_layers}`): its decoder block (an MoE block), the
/// two input norms, `eh_proj` (`[hidden, 2·hidden]`) and its head's norm (`shared_head.norm`).
pub fn mtp_tensors(config: &Config, dtype: DType) -> Vec<TensorInfo> {
    let layer = config.num_hidden_layers;
    let h = config.hidden_size;
    let p = format!("model.layers.{layer}");
    let mut t = block_tensors(config, layer, MlpKind::MoE, dtype);
    for norm in ["enorm", "hnorm", "shared_head.norm"] {
        t.push(TensorInfo::new(format!("{p}.{norm}.weight"), &[h], dtype));
    }
    t.push(TensorInfo::new(
        format!("{p}.eh_proj.weight"),
        &[h, h.saturating_mul(2)],
        dtype,
    ));
    t
}

/// The tensors of the decoder block stored as `model.layers.{layer}`, with `mlp` as its feed-forward.
fn block_tensors(
    config: &Config,
    layer: usize,
    mlp_kind: MlpKind,
    dtype: DType,
) -> Vec<TensorInfo> {
    let p = format!("model.layers.{layer}");
    let h = config.hidden_size;
    let heads = config.num_attention_heads;
    let mut t = Vec::new();
    let mut add =
        |name: String, shape: &[usize], dtype: DType| t.push(TensorInfo::new(name, shape, dtype));
    add(format!("{p}.input_layernorm.weight"), &[h], dtype);
    add(format!("{p}.post_attention_layernorm.weight"), &[h], dtype);
    let a = format!("{p}.self_attn");
    add(
        format!("{a}.q_a_proj.weight"),
        &[config.q_lora_rank, h],
        dtype,
    );
    add(
        format!("{a}.q_a_layernorm.weight"),
        &[config.q_lora_rank],
        dtype,
    );
    add(
        format!("{a}.q_b_proj.weight"),
        &[
            heads.saturating_mul(config.qk_head_dim()),
            config.q_lora_rank,
        ],
        dtype,
    );
    add(
        format!("{a}.kv_a_proj_with_mqa.weight"),
        &[config.latent_dim(), h],
        dtype,
    );
    add(
        format!("{a}.kv_a_layernorm.weight"),
        &[config.kv_lora_rank],
        dtype,
    );
    add(
        format!("{a}.kv_b_proj.weight"),
        &[
            heads.saturating_mul(config.qk_nope_head_dim.saturating_add(config.v_head_dim)),
            config.kv_lora_rank,
        ],
        dtype,
    );
    add(
        format!("{a}.o_proj.weight"),
        &[h, heads.saturating_mul(config.v_head_dim)],
        dtype,
    );
    let i = format!("{a}.indexer");
    let (ih, id) = (config.index_n_heads, config.index_head_dim);
    add(
        format!("{i}.wq_b.weight"),
        &[ih.saturating_mul(id), config.q_lora_rank],
        dtype,
    );
    add(format!("{i}.wk.weight"), &[id, h], dtype);
    add(format!("{i}.k_norm.weight"), &[id], dtype);
    add(format!("{i}.k_norm.bias"), &[id], dtype);
    add(format!("{i}.weights_proj.weight"), &[ih, h], dtype);
    let m = format!("{p}.mlp");
    let mut mlp = |prefix: &str, width: usize| {
        add(format!("{prefix}.gate_proj.weight"), &[width, h], dtype);
        add(format!("{prefix}.up_proj.weight"), &[width, h], dtype);
        add(format!("{prefix}.down_proj.weight"), &[h, width], dtype);
    };
    match mlp_kind {
        MlpKind::Dense => mlp(&m, config.intermediate_size),
        MlpKind::MoE => {
            for e in 0..config.n_routed_experts {
                mlp(&format!("{m}.experts.{e}"), config.moe_intermediate_size);
            }
            if config.n_shared_experts > 0 {
                mlp(
                    &format!("{m}.shared_experts"),
                    config
                        .moe_intermediate_size
                        .saturating_mul(config.n_shared_experts),
                );
            }
            add(
                format!("{m}.gate.weight"),
                &[config.n_routed_experts, h],
                DType::F32,
            );
            add(
                format!("{m}.gate.e_score_correction_bias"),
                &[config.n_routed_experts],
                DType::F32,
            );
        }
    }
    t
}

/// The FP8 block size of projections quantised at load ([`quantized_at_load`]): the published GLM-5-FP8's.
pub const FP8_AT_LOAD_BLOCK: [usize; 2] = [128, 128];

/// Whether `--fp8-projections` quantises the `[out, in]` weight `name` at load: a projection the loader reads
/// one at a time (attention, the indexer, the dense MLPs, the MTP layer's `eh_proj`; not the stacked experts,
/// nor `kv_b_proj`, which attention expands) that GLM-5-FP8's recipe quantises, that the checkpoint keeps
/// unquantised, and whose rows the FP8 kernels take (`in` a multiple of 16).
pub fn quantized_at_load(config: &Config, name: &str, shape: [usize; 2]) -> bool {
    fp8_at_load_recipe().quantizes(name)
        && !name.contains(".mlp.experts.")
        && !name.contains(".mlp.shared_experts.")
        && !name.ends_with("kv_b_proj.weight")
        && shape[1].is_multiple_of(16)
        && !config
            .quantization
            .as_ref()
            .is_some_and(|q| q.quantizes(name))
}

/// GLM-5-FP8's recipe, what FP8 at load follows.
fn fp8_at_load_recipe() -> crate::quantization::Quantization {
    crate::quantization::Quantization::Fp8Block {
        block: FP8_AT_LOAD_BLOCK,
        modules_to_not_convert: Vec::new(),
    }
}

/// Bytes `t` takes once loaded with `--fp8-projections` where it is one of the projections quantised at load
/// ([`quantized_at_load`]): its FP8 codes and block scales; `None` for any other tensor.
pub fn fp8_at_load_bytes(config: &Config, t: &TensorInfo) -> Option<u64> {
    match t.shape.as_slice() {
        &[out, inp] if quantized_at_load(config, &t.name, [out, inp]) => {
            Some(fp8_at_load_recipe().matrix_bytes(out, inp))
        }
        _ => None,
    }
}

/// Bytes `t` takes on the device once loaded: its elements at its dtype, or, in a quantised checkpoint, the
/// quantised bytes and scales of a matrix the format's recipe quantises
/// ([`crate::quantization::Quantization::quantizes`]). Attention's `kv_b_proj` counts at its dtype: the
/// loader expands it to split it per head.
pub fn resident_bytes(config: &Config, t: &TensorInfo) -> u64 {
    match (&config.quantization, t.shape.as_slice()) {
        (Some(q), &[out, inp]) if q.quantizes(&t.name) && !t.name.ends_with("kv_b_proj.weight") => {
            q.matrix_bytes(out, inp)
        }
        _ => t.bytes(),
    }
}

/// KV-cache bytes one token takes in one layer: the latent row `[c | k_pe]` (`kv_lora_rank +
/// qk_rope_head_dim`) at `cache_dtype` plus the indexer key (`index_head_dim`) in `key_format` (float:
/// `cache_dtype`; FP8: a byte per value and an f32 scale).
pub fn cache_bytes_per_token(config: &Config, cache_dtype: DType, key_format: KeyFormat) -> u64 {
    let float = cache_dtype.size_in_bytes() as u64;
    (config.latent_dim() as u64)
        .saturating_mul(float)
        .saturating_add(key_format.key_bytes(config.index_head_dim, float as usize) as u64)
}
