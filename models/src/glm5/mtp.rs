//! Multi-token prediction (MTP): the checkpoint's draft layer `model.layers.{num_hidden_layers}`, which
//! predicts the token after next for speculative decoding (DeepSeek-V3's MTP module, as vLLM and SGLang
//! run GLM-5's; docs/architecture.md §6).
//!
//! For position `i` it takes the main model's hidden state there (`h_i`, the final norm's output: what
//! `lm_head` reads) and the embedding of the token at `i + 1`, and returns logits for the token at `i + 2`:
//!
//! ```text
//! x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])      (embedding first; at position 0 it is zeroed)
//! x = decoder block(x)                                   (MLA + DSA indexer + MoE, its own KV rows at i)
//! logits = lm_head(shared_head.norm(x))                  (the main model's embeddings and lm_head)
//! ```
//!
//! The block keeps its own KV rows, one per position, in an [`MtpCache`].

use candle_core::{DType, Device, Module, Tensor, D};

use super::{
    all_causal_positions, copy_to_device, DecoderLayer, Glm5ForCausalLM, LayerKv, Residual, Rope,
};
use super::{Loader, Proj, RmsNorm};
use crate::cache::KvCache;
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::plan::{AttentionMode, LayerPlan};

/// The MTP layer's weights (module docs).
pub(super) struct MtpLayer {
    enorm: RmsNorm,
    hnorm: RmsNorm,
    eh_proj: Proj,
    block: DecoderLayer,
    head_norm: RmsNorm,
}

impl MtpLayer {
    pub(super) fn load(config: &Config, loader: &Loader, plan: &LayerPlan) -> Result<Self> {
        let prefix = format!("model.layers.{}", plan.layer);
        let (h, eps) = (config.hidden_size, config.rms_norm_eps);
        Ok(Self {
            enorm: loader.rms_norm(&format!("{prefix}.enorm"), h, eps)?,
            hnorm: loader.rms_norm(&format!("{prefix}.hnorm"), h, eps)?,
            eh_proj: loader.linear(&format!("{prefix}.eh_proj"), 2 * h, h)?,
            block: DecoderLayer::load(config, loader, plan)?,
            head_norm: loader.rms_norm(&format!("{prefix}.shared_head.norm"), h, eps)?,
        })
    }

    pub(super) fn block(&self) -> &DecoderLayer {
        &self.block
    }
}

/// The MTP layer's KV rows of one sequence: row `i` is written by the draft at position `i`. Create it
/// with [`Glm5ForCausalLM::new_mtp_cache`].
pub struct MtpCache {
    cache: KvCache,
}

impl MtpCache {
    /// Positions cached so far (the next [`Glm5ForCausalLM::forward_mtp`]'s `start_pos`).
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Keeps only the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.cache.truncate(len)
    }
}

impl Glm5ForCausalLM {
    /// Whether the model was loaded with its MTP layer ([`crate::PlanOptions::mtp`]).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// An empty MTP cache for up to `capacity` positions of one sequence, on the head's device.
    pub fn new_mtp_cache(&self, capacity: usize) -> Result<MtpCache> {
        if self.mtp.is_none() {
            return Err(ModelError::NoMtpLayer);
        }
        let device = &self.devices[self.plan.head_device];
        Ok(MtpCache {
            cache: KvCache::of_layers(
                &self.config,
                capacity,
                self.dtype,
                self.plan.index_keys,
                &[device],
            )?,
        })
    }

    /// [`Self::forward`], also returning the hidden states `lm_head` read (the final norm's output,
    /// `[len, hidden]` in the model dtype on [`Self::output_device`]): what [`Self::forward_mtp`] takes.
    pub fn forward_with_hidden(
        &self,
        input_ids: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        self.run(input_ids, start_pos, cache, None)
    }

    /// The MTP layer at positions `start_pos..start_pos + len` (module docs): row `i` takes `hidden[i]`,
    /// the main model's hidden state at position `start_pos + i` ([`Self::forward_with_hidden`]), and
    /// `next_ids[i]`, the token at position `start_pos + i + 1`; returns f32 logits `[len, vocab_size]` of
    /// the tokens at `start_pos + i + 2`, on [`Self::output_device`]. The rows are appended to `cache`.
    pub fn forward_mtp(
        &self,
        next_ids: &[u32],
        hidden: &Tensor,
        start_pos: usize,
        cache: &mut MtpCache,
    ) -> Result<Tensor> {
        let mtp = self.mtp.as_ref().ok_or(ModelError::NoMtpLayer)?;
        let t = next_ids.len();
        if t == 0 {
            return Err(ModelError::EmptyInput);
        }
        if hidden.dims() != [t, self.config.hidden_size] {
            return Err(ModelError::MtpInput {
                tokens: t,
                hidden: hidden.dims().to_vec(),
            });
        }
        // The draft at position p reads the token at p + 1.
        self.check_tokens(next_ids, start_pos + 1)?;
        cache.cache.check_append(start_pos, t)?;

        let device: &Device = &self.devices[self.plan.head_device];
        let ids = Tensor::from_slice(next_ids, t, self.device())?;
        let mut embedded = copy_to_device(&self.embed_tokens.index_select(&ids, 0)?, device)?;
        if start_pos == 0 {
            // vLLM's MTP zeroes the embedding at position 0 (nothing precedes it in training).
            let zero = Tensor::zeros((1, self.config.hidden_size), embedded.dtype(), device)?;
            embedded = Tensor::cat(&[&zero, &embedded.narrow(0, 1, t - 1)?], 0)?;
        }
        let hidden = copy_to_device(&hidden.to_dtype(self.dtype)?, device)?;
        let joined = Tensor::cat(
            &[mtp.enorm.forward(&embedded)?, mtp.hnorm.forward(&hidden)?],
            D::Minus1,
        )?;
        let x = mtp.eh_proj.forward(&joined)?;
        let rope = Rope::at_positions(&self.config, start_pos, t, self.dtype, device)?;
        let dense = match self.mode {
            AttentionMode::Sparse => None,
            AttentionMode::Dense => Some(all_causal_positions(t, start_pos, device)?),
        };
        let kv = LayerKv::Contiguous {
            cache: &cache.cache.layers[0],
            start_pos,
        };
        let (x, _) = mtp
            .block
            .forward(&Residual::new(x), &rope, kv, dense.as_ref())?;
        cache.cache.advance(t);
        let (_, hidden) = x.norm(&mtp.head_norm)?;
        Ok(self.lm_head.forward(&hidden)?.to_dtype(DType::F32)?)
    }
}
