//! A `glm-dsa` GGUF model as a [`TensorSource`]: Hugging Face names → llama.cpp's tensor names and layouts.
//!
//! Names and layouts are those of llama.cpp's converter (`convert_hf_to_gguf.py`, `DeepseekV2Model` and
//! `GlmMoeDsaModel`; names from gguf-py's `constants.py` and `tensor_mapping.py`):
//!
//! * per layer `blk.{i}.`: `attn_norm`, `ffn_norm`, `attn_q_a`, `attn_q_a_norm`, `attn_q_b`, `attn_kv_a_mqa`,
//!   `attn_kv_a_norm`, `attn_output`, `indexer.{attn_q_b, attn_k, k_norm, proj}`, `ffn_{gate,up,down}` (dense
//!   layers), `ffn_gate_inp` (router), `exp_probs_b.bias` (`e_score_correction_bias`),
//!   `ffn_{gate,up,down}_shexp`, and `ffn_{gate,up,down}_exps`: the routed experts stacked, torch shape
//!   `[n_experts, out, in]`, so expert `e` is one contiguous run of blocks.
//! * `kv_b_proj` is stored split for the absorbed form: `attn_k_b` is `W_UK` per head transposed, torch shape
//!   `[heads, kv_lora_rank, qk_nope_head_dim]`, and `attn_v_b` is `W_UV`, `[heads, v_head_dim, kv_lora_rank]`.
//!   [`GgufSource`] joins them back into `kv_b_proj` `[heads·(nope+v), kv_lora_rank]`.
//! * `token_embd`, `output_norm`, `output` (absent when tied).
//! * The MTP block, appended as `blk.{num_hidden_layers}` (`block_count` counts it, `nextn_predict_layers`
//!   says so): a decoder block under the names above plus `nextn.{eh_proj, enorm, hnorm,
//!   shared_head_norm}`; read only when the MTP layer is loaded. Its `nextn.embed_tokens` and
//!   `nextn.shared_head_head`, where a file has them, are never read (the layer uses the model's own).

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use glm5_ops::gguf_matmul::{self, GgufFormat, GgufWeight};

use super::gguf::{GgufError, GgufModel, GgufTensor};
use super::gguf_config::config_from_gguf;
use super::{Matrix, TensorSource};
use crate::config::Config;
use crate::error::{ModelError, Result};

/// Per-layer Hugging Face suffix → GGUF suffix.
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    (
        "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_mqa.weight",
    ),
    ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.indexer.wq_b.weight", "indexer.attn_q_b.weight"),
    ("self_attn.indexer.wk.weight", "indexer.attn_k.weight"),
    ("self_attn.indexer.k_norm.weight", "indexer.k_norm.weight"),
    ("self_attn.indexer.k_norm.bias", "indexer.k_norm.bias"),
    (
        "self_attn.indexer.weights_proj.weight",
        "indexer.proj.weight",
    ),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("mlp.gate.weight", "ffn_gate_inp.weight"),
    ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    (
        "mlp.shared_experts.gate_proj.weight",
        "ffn_gate_shexp.weight",
    ),
    ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
    (
        "mlp.shared_experts.down_proj.weight",
        "ffn_down_shexp.weight",
    ),
    // The MTP (NextN) block's own tensors, in `blk.{num_hidden_layers}`.
    ("eh_proj.weight", "nextn.eh_proj.weight"),
    ("enorm.weight", "nextn.enorm.weight"),
    ("hnorm.weight", "nextn.hnorm.weight"),
    ("shared_head.norm.weight", "nextn.shared_head_norm.weight"),
];

/// Where a Hugging Face tensor lives in the GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GgufLocation {
    /// One GGUF tensor, same values and shape.
    Tensor(String),
    /// Expert `expert` of a stacked `[n_experts, out, in]` tensor.
    Expert { name: String, expert: usize },
    /// `kv_b_proj`, joined from `attn_k_b` and `attn_v_b`.
    KvB { k_b: String, v_b: String },
}

/// The GGUF location of Hugging Face tensor `name`, if glm5 knows it.
pub fn gguf_location(name: &str) -> Option<GgufLocation> {
    match name {
        "model.embed_tokens.weight" => {
            return Some(GgufLocation::Tensor("token_embd.weight".into()))
        }
        "model.norm.weight" => return Some(GgufLocation::Tensor("output_norm.weight".into())),
        "lm_head.weight" => return Some(GgufLocation::Tensor("output.weight".into())),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let blk = format!("blk.{layer}");
    if rest == "self_attn.kv_b_proj.weight" {
        return Some(GgufLocation::KvB {
            k_b: format!("{blk}.attn_k_b.weight"),
            v_b: format!("{blk}.attn_v_b.weight"),
        });
    }
    if let Some(expert) = rest.strip_prefix("mlp.experts.") {
        let (index, proj) = expert.split_once('.')?;
        let which = match proj {
            "gate_proj.weight" => "gate",
            "up_proj.weight" => "up",
            "down_proj.weight" => "down",
            _ => return None,
        };
        return Some(GgufLocation::Expert {
            name: format!("{blk}.ffn_{which}_exps.weight"),
            expert: index.parse().ok()?,
        });
    }
    LAYER_NAMES
        .iter()
        .find(|(hf, _)| *hf == rest)
        .map(|(_, gguf)| GgufLocation::Tensor(format!("{blk}.{gguf}")))
}

/// Whether the model multiplies by this tensor as a linear layer (so a quantised one stays quantised).
pub(crate) fn is_linear(name: &str) -> bool {
    name == "lm_head.weight"
        || (name.ends_with("_proj.weight") && !name.ends_with("kv_b_proj.weight"))
        || name.ends_with(".wq_b.weight")
        || name.ends_with(".wk.weight")
}

/// A GGUF model opened for loading, with its config.
pub struct GgufSource {
    model: GgufModel,
    config: Config,
}

impl GgufSource {
    /// Opens the model's file(s), reads the config and checks, before any weight is read, that every tensor
    /// the model uses has a type glm5 computes with.
    pub fn open(path: &Path) -> Result<Self> {
        let source = Self::new(GgufModel::open(path)?)?;
        source.check_types()?;
        Ok(source)
    }

    /// A model whose headers are read (the config checked, tensor types not: `glm5 plan` sizes files it
    /// cannot run too).
    pub fn new(model: GgufModel) -> Result<Self> {
        let config = config_from_gguf(&model)?;
        Ok(Self { model, config })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn model(&self) -> &GgufModel {
        &self.model
    }

    /// The first tensor the model reads whose type glm5 cannot compute with (candle's types and the
    /// i-quants), as an error naming it.
    pub fn check_types(&self) -> Result<()> {
        for tensor in self.model.tensors.values() {
            if self.is_mtp(&tensor.name) {
                continue;
            }
            if tensor.ggml_type.candle().is_none()
                && GgufFormat::from_ggml_id(tensor.ggml_type.id).is_none()
            {
                return Err(GgufError::UnsupportedType {
                    tensor: tensor.name.clone(),
                    type_name: tensor.ggml_type.name.into(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Tensors of the MTP (NextN) blocks after the main layers (loaded only with the MTP layer; their types
    /// are checked when they are read).
    pub fn is_mtp(&self, name: &str) -> bool {
        name.strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(layer, _)| layer.parse::<usize>().ok())
            .is_some_and(|layer| layer >= self.config.num_hidden_layers)
    }

    fn info(&self, hf_name: &str, gguf_name: &str) -> Result<&GgufTensor> {
        self.model
            .tensors
            .get(gguf_name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: format!("{gguf_name} (for {hf_name})"),
            })
    }

    fn shape_error(
        hf_name: &str,
        gguf_name: &str,
        expected: &[usize],
        found: Vec<usize>,
    ) -> ModelError {
        ModelError::TensorShape {
            name: format!("{gguf_name} (for {hf_name})"),
            expected: expected.to_vec(),
            found,
        }
    }

    /// The tensor (or expert slice) behind `location`, checked against the `[..]` shape the model expects.
    fn locate(&self, hf_name: &str, shape: &[usize]) -> Result<(&GgufTensor, Option<usize>)> {
        match gguf_location(hf_name) {
            Some(GgufLocation::Tensor(g)) => {
                let info = self.info(hf_name, &g)?;
                if info.shape() != shape {
                    return Err(Self::shape_error(hf_name, &g, shape, info.shape()));
                }
                Ok((info, None))
            }
            Some(GgufLocation::Expert { name, expert }) => {
                let info = self.info(hf_name, &name)?;
                let mut expected = vec![self.config.n_routed_experts];
                expected.extend_from_slice(shape);
                if info.shape() != expected {
                    return Err(Self::shape_error(hf_name, &name, &expected, info.shape()));
                }
                Ok((info, Some(expert)))
            }
            Some(GgufLocation::KvB { .. }) | None => Err(ModelError::MissingTensor {
                name: format!("{hf_name} (no single GGUF tensor holds it)"),
            }),
        }
    }

    /// The stacked `ffn_{gate,up,down}_exps` tensor behind `prefix.experts.*.proj`, checked to be
    /// `shape` `[n_experts, out, in]`; `None` when it is stored as floats (the model expands those).
    fn stacked_info(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<&GgufTensor>> {
        let hf_name = format!("{prefix}.experts.0.{proj}.weight");
        let Some(GgufLocation::Expert { name, .. }) = gguf_location(&hf_name) else {
            return Err(ModelError::MissingTensor {
                name: format!("{hf_name} (not a routed expert's projection)"),
            });
        };
        let info = self.info(&hf_name, &name)?;
        if info.shape() != shape {
            return Err(Self::shape_error(&hf_name, &name, &shape, info.shape()));
        }
        Ok((!info.ggml_type.is_float()).then_some(info))
    }

    /// `kv_b_proj` `[heads·(nope+v), lora]` from `attn_k_b` `[heads, lora, nope]` and `attn_v_b`
    /// `[heads, v, lora]`.
    fn kv_b(
        &self,
        hf_name: &str,
        k_b: &str,
        v_b: &str,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (heads, nope, v, lora) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let expected = [heads * (nope + v), lora];
        if shape != expected {
            return Err(Self::shape_error(hf_name, k_b, &expected, shape.to_vec()));
        }
        let load = |name: &str, want: [usize; 3]| -> Result<Tensor> {
            let info = self.info(hf_name, name)?;
            if info.shape() != want {
                return Err(Self::shape_error(hf_name, name, &want, info.shape()));
            }
            self.dense_f32(info, None, device)
        };
        let w_uk = load(k_b, [heads, lora, nope])?.transpose(1, 2)?;
        let w_uv = load(v_b, [heads, v, lora])?;
        Ok(Tensor::cat(&[w_uk, w_uv], 1)?.reshape((heads * (nope + v), lora))?)
    }

    /// The i-quant blocks of `info` (or of its item `slice`), `[rows, row bytes]` on `device`.
    fn iq_weight(
        &self,
        info: &GgufTensor,
        format: GgufFormat,
        slice: Option<usize>,
        device: &Device,
    ) -> Result<GgufWeight> {
        let in_dim = *info.dims.first().unwrap_or(&0) as usize;
        let row_bytes = format
            .row_bytes(in_dim)
            .filter(|&bytes| bytes > 0)
            .ok_or_else(|| GgufError::BadTensor {
                path: self.model.part_path(info).to_path_buf(),
                tensor: info.name.clone(),
                reason: format!("rows of {in_dim} values are not whole {format} blocks"),
            })?;
        let (skip, bytes, _) = self.model.item(info, slice)?;
        let data = self.model.read_bytes(info, skip, bytes)?;
        let rows = data.len() / row_bytes;
        let blocks = Tensor::from_vec(data, (rows, row_bytes), &Device::Cpu)?.to_device(device)?;
        Ok(
            GgufWeight::new(format, blocks, in_dim).map_err(|e| GgufError::BadTensor {
                path: self.model.part_path(info).to_path_buf(),
                tensor: info.name.clone(),
                reason: e.to_string(),
            })?,
        )
    }

    /// `info` (or its item `slice`) expanded to f32 on `device`, whatever its type.
    fn dense_f32(
        &self,
        info: &GgufTensor,
        slice: Option<usize>,
        device: &Device,
    ) -> Result<Tensor> {
        if let Some(format) = GgufFormat::from_ggml_id(info.ggml_type.id) {
            let w = self.iq_weight(info, format, slice, &Device::Cpu)?;
            let mut shape = info.shape();
            if slice.is_some() {
                shape.remove(0);
            }
            let values = gguf_matmul::reference::dequantize(&w)?;
            return Ok(values.reshape(shape)?.to_device(device)?);
        }
        Ok(self
            .model
            .qtensor(info, slice, device)?
            .dequantize(device)?)
    }
}

impl TensorSource for GgufSource {
    fn contains(&self, name: &str) -> bool {
        match gguf_location(name) {
            Some(GgufLocation::Tensor(g)) | Some(GgufLocation::Expert { name: g, .. }) => {
                self.model.tensors.contains_key(&g)
            }
            Some(GgufLocation::KvB { k_b, v_b }) => {
                self.model.tensors.contains_key(&k_b) && self.model.tensors.contains_key(&v_b)
            }
            None => false,
        }
    }

    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        if let Some(GgufLocation::KvB { k_b, v_b }) = gguf_location(name) {
            return Ok(self
                .kv_b(name, &k_b, &v_b, shape, device)?
                .to_dtype(dtype)?);
        }
        let (info, slice) = self.locate(name, shape)?;
        Ok(self.dense_f32(info, slice, device)?.to_dtype(dtype)?)
    }

    fn matrix(
        &self,
        name: &str,
        shape: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Matrix> {
        let (info, slice) = self.locate(name, &shape)?;
        if let Some(format) = GgufFormat::from_ggml_id(info.ggml_type.id) {
            return Ok(Matrix::GgufBlocks(
                self.iq_weight(info, format, slice, device)?,
            ));
        }
        if info.ggml_type.is_float() {
            let q = self.model.qtensor(info, slice, device)?;
            return Ok(Matrix::Dense(q.dequantize(device)?.to_dtype(dtype)?));
        }
        Ok(Matrix::Quantized(Arc::new(
            self.model.qtensor(info, slice, device)?,
        )))
    }

    fn stacked_experts_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgmlDType>> {
        Ok(self
            .stacked_info(prefix, proj, shape)?
            .and_then(|info| info.ggml_type.candle()))
    }

    fn stacked_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<QTensor>> {
        match self.stacked_info(prefix, proj, shape)? {
            Some(info) => Ok(Some(self.model.qtensor(info, None, device)?)),
            None => Ok(None),
        }
    }

    fn stacked_gguf_block_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgufFormat>> {
        Ok(self
            .stacked_info(prefix, proj, shape)?
            .and_then(|info| GgufFormat::from_ggml_id(info.ggml_type.id)))
    }

    fn stacked_gguf_block_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<glm5_ops::moe::StackedGgufBlocks>> {
        let Some(info) = self.stacked_info(prefix, proj, shape)? else {
            return Ok(None);
        };
        let Some(format) = GgufFormat::from_ggml_id(info.ggml_type.id) else {
            return Ok(None);
        };
        let [experts, rows, k] = shape;
        let w = self.iq_weight(info, format, None, device)?;
        let row_bytes = w.blocks.dim(1)?;
        let blocks = w.blocks.reshape((experts, rows, row_bytes))?;
        Ok(Some(glm5_ops::moe::StackedGgufBlocks::new(
            format, blocks, k,
        )?))
    }

    fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        let dense = shape.iter().map(|&d| d as u64).product::<u64>() * dtype.size_in_bytes() as u64;
        if !is_linear(name) {
            return dense;
        }
        match gguf_location(name) {
            Some(GgufLocation::Tensor(g)) => match self.model.tensors.get(&g) {
                Some(t) if !t.ggml_type.is_float() => t.bytes,
                _ => dense,
            },
            Some(GgufLocation::Expert { name: g, .. }) => match self.model.tensors.get(&g) {
                Some(t) if !t.ggml_type.is_float() => {
                    t.bytes / (*t.dims.last().unwrap_or(&1)).max(1)
                }
                _ => dense,
            },
            _ => dense,
        }
    }
}
