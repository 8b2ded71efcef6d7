//! The KV cache of one sequence: per layer, the MLA latent rows and the DSA indexer keys.
//!
//! Row `s` of every layer's tensors belongs to token position `s`:
//! - latent `[capacity, kv_lora_rank + qk_rope_head_dim]`: `[c (RMS-normed latent) | k_pe (rotated)]`, the
//!   only thing absorbed MLA attention reads;
//! - index keys `[capacity, index_head_dim]`: the indexer's LayerNormed, rotated key, in the model's dtype,
//!   or as FP8 e4m3 bytes with one f32 scale per key (quantised as they are written; `glm5_ops::index_keys`).
//!
//! Storage is allocated once for `capacity` tokens; a forward that would go past it is a `CacheFull` error.

use candle_core::{DType, Device, Tensor};
use glm5_ops::attention_rows::{write_attention_rows, IndexKeyStep, LatentRowsStep};
use glm5_ops::cache_rows::{write_rows, CacheRows};
use glm5_ops::index_key_rows::{index_key_rows_reference, write_index_key_rows};
use glm5_ops::latent_rows::{latent_rows_reference, write_latent_rows};
use glm5_ops::rope_leading::rope_leading_reference;
use glm5_ops::{quantize_fp8, IndexKeys, KeyFormat};

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::glm5::RowOps;

/// What turns `kv_a_proj_with_mqa`'s output into latent rows: `kv_a_layernorm`'s weight and epsilon, and the
/// call's RoPE tables (`cos`, `sin`).
#[derive(Clone, Copy)]
pub(crate) struct LatentRows<'a> {
    pub norm_weight: &'a Tensor,
    pub eps: f64,
    pub rope: (&'a Tensor, &'a Tensor),
    pub row_ops: RowOps,
}

impl LatentRows<'_> {
    /// Writes `kv_a`'s latent rows into `cache` at `rows`: the fused op, or its candle-op reference.
    pub(crate) fn write(&self, kv_a: &Tensor, cache: &Tensor, rows: CacheRows<'_>) -> Result<()> {
        match self.row_ops {
            RowOps::Fused => {
                write_latent_rows(kv_a, self.norm_weight, self.eps, self.rope, cache, rows)?
            }
            RowOps::CandleOps => {
                let values = latent_rows_reference(
                    kv_a,
                    self.norm_weight,
                    self.eps,
                    self.rope.0,
                    self.rope.1,
                )?;
                write_rows(cache, &values, rows)?
            }
        }
        Ok(())
    }
}

/// What turns the indexer's `wk` output into keys: `k_norm`'s weight and bias, its epsilon, and the call's
/// RoPE tables (`cos`, `sin`).
#[derive(Clone, Copy)]
pub(crate) struct KeyRows<'a> {
    pub layer_norm: (&'a Tensor, &'a Tensor),
    pub eps: f64,
    pub rope: (&'a Tensor, &'a Tensor),
    pub row_ops: RowOps,
}

impl KeyRows<'_> {
    /// Writes `k`'s indexer keys into `cache` at `rows`: the fused op, or its candle-op reference.
    pub(crate) fn write(
        &self,
        k: &Tensor,
        cache: IndexKeys<'_>,
        rows: CacheRows<'_>,
    ) -> Result<()> {
        if self.row_ops == RowOps::Fused {
            write_index_key_rows(k, self.layer_norm, self.eps, self.rope, cache, rows)?;
            return Ok(());
        }
        let keys =
            index_key_rows_reference(k, self.layer_norm, self.eps, self.rope.0, self.rope.1)?;
        match cache {
            IndexKeys::Float(store) => write_rows(store, &keys, rows)?,
            IndexKeys::Fp8 { bytes, scales } => {
                let (new_bytes, new_scales) = quantize_fp8(&keys)?;
                write_rows(bytes, &new_bytes, rows)?;
                write_rows(scales, &new_scales, rows)?;
            }
        }
        Ok(())
    }
}

/// A call's inputs to the row steps that run together when the indexer runs: the latent rows from
/// `kv_a`, the indexer keys from `k` (both written at the call's rows), and the indexer query `index_q`
/// `[T, H, D]`, returned with RoPE on its leading dims.
pub(crate) struct AttentionRows<'a> {
    pub kv_a: &'a Tensor,
    pub latent: LatentRows<'a>,
    pub k: &'a Tensor,
    pub keys: KeyRows<'a>,
    pub index_q: &'a Tensor,
}

impl AttentionRows<'_> {
    /// Writes the rows into `latent_cache` and `key_cache` at `rows` and returns the rotated query:
    /// `glm5_ops::attention_rows` (one launch on CUDA), or the three steps' candle-op references.
    pub(crate) fn write(
        &self,
        latent_cache: &Tensor,
        key_cache: IndexKeys<'_>,
        rows: CacheRows<'_>,
    ) -> Result<Tensor> {
        let (cos, sin) = self.latent.rope;
        if self.latent.row_ops == RowOps::Fused {
            let latent = LatentRowsStep {
                kv_a: self.kv_a,
                norm_weight: self.latent.norm_weight,
                eps: self.latent.eps,
                cache: latent_cache,
            };
            let key = IndexKeyStep {
                k: self.k,
                layer_norm: self.keys.layer_norm,
                eps: self.keys.eps,
                cache: key_cache,
            };
            return Ok(write_attention_rows(
                latent,
                key,
                self.index_q,
                (cos, sin),
                rows,
            )?);
        }
        self.latent.write(self.kv_a, latent_cache, rows)?;
        self.keys.write(self.k, key_cache, rows)?;
        Ok(rope_leading_reference(self.index_q, cos, sin)?)
    }
}

pub(crate) struct LayerCache {
    latent: Tensor,
    index_keys: IndexKeyStore,
}

/// A layer's indexer keys, in the cache's key format.
enum IndexKeyStore {
    Float(Tensor),
    Fp8 { bytes: Tensor, scales: Tensor },
}

/// The keys of positions `0..len` of a layer, as the indexer reads them.
pub(crate) enum CachedIndexKeys {
    Float(Tensor),
    Fp8 { bytes: Tensor, scales: Tensor },
}

impl CachedIndexKeys {
    pub(crate) fn view(&self) -> IndexKeys<'_> {
        match self {
            CachedIndexKeys::Float(keys) => IndexKeys::Float(keys),
            CachedIndexKeys::Fp8 { bytes, scales } => IndexKeys::Fp8 { bytes, scales },
        }
    }
}

impl LayerCache {
    /// Computes the latent rows of `kv_a`'s tokens (`glm5_ops::latent_rows`) into positions `offset..` and
    /// returns all latent rows up to and including them.
    pub(crate) fn append_latent(
        &self,
        kv_a: &Tensor,
        rows: LatentRows<'_>,
        offset: usize,
    ) -> Result<Tensor> {
        rows.write(kv_a, &self.latent, CacheRows::From(offset))?;
        Ok(self.latent.narrow(0, 0, offset + kv_a.dim(0)?)?)
    }

    /// Writes the call's latent rows and indexer keys into positions `offset..` (see [`AttentionRows`]) and
    /// returns all latent rows and keys up to and including them, and the rotated indexer query.
    pub(crate) fn append_rows(
        &self,
        rows: &AttentionRows<'_>,
        offset: usize,
    ) -> Result<(Tensor, CachedIndexKeys, Tensor)> {
        let len = offset + rows.kv_a.dim(0)?;
        let store = match &self.index_keys {
            IndexKeyStore::Float(store) => IndexKeys::Float(store),
            IndexKeyStore::Fp8 { bytes, scales } => IndexKeys::Fp8 { bytes, scales },
        };
        let index_q = rows.write(&self.latent, store, CacheRows::From(offset))?;
        let keys = match &self.index_keys {
            IndexKeyStore::Float(store) => CachedIndexKeys::Float(store.narrow(0, 0, len)?),
            IndexKeyStore::Fp8 { bytes, scales } => CachedIndexKeys::Fp8 {
                bytes: bytes.narrow(0, 0, len)?,
                scales: scales.narrow(0, 0, len)?,
            },
        };
        Ok((self.latent.narrow(0, 0, len)?, keys, index_q))
    }
}

/// The cache of one sequence for every layer. Create it with [`crate::Glm5ForCausalLM::new_cache`].
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Layer `l`'s rows live on `layer_devices[l]` (the plan's placement).
    pub(crate) fn new(
        config: &Config,
        capacity: usize,
        dtype: DType,
        index_keys: KeyFormat,
        layer_devices: &[&Device],
    ) -> Result<Self> {
        if layer_devices.len() != config.num_hidden_layers {
            return Err(ModelError::CacheShape(format!(
                "{} layer devices for {} layers",
                layer_devices.len(),
                config.num_hidden_layers
            )));
        }
        Self::of_layers(config, capacity, dtype, index_keys, layer_devices)
    }

    /// A cache of `layer_devices.len()` layers (the MTP layer's: one).
    pub(crate) fn of_layers(
        config: &Config,
        capacity: usize,
        dtype: DType,
        index_keys: KeyFormat,
        layer_devices: &[&Device],
    ) -> Result<Self> {
        if capacity == 0 || capacity > config.max_position_embeddings {
            return Err(ModelError::CacheShape(format!(
                "capacity {capacity} must be in 1..={} (max_position_embeddings)",
                config.max_position_embeddings
            )));
        }
        let layers = layer_devices
            .iter()
            .map(|&device| {
                Ok(LayerCache {
                    latent: Tensor::zeros((capacity, config.latent_dim()), dtype, device)?,
                    index_keys: match index_keys {
                        KeyFormat::Float => IndexKeyStore::Float(Tensor::zeros(
                            (capacity, config.index_head_dim),
                            dtype,
                            device,
                        )?),
                        KeyFormat::Fp8E4m3 => IndexKeyStore::Fp8 {
                            bytes: Tensor::zeros(
                                (capacity, config.index_head_dim),
                                DType::U8,
                                device,
                            )?,
                            scales: Tensor::zeros(capacity, DType::F32, device)?,
                        },
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            len: 0,
            capacity,
        })
    }

    /// Tokens cached so far (the next forward's `start_pos`).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every cached token (the storage is kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keeps only the first `len` tokens (e.g. the prompt prefix a new chat turn shares with the last).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Checks that `n_new` tokens starting at `start_pos` continue this cache and fit in it.
    pub(crate) fn check_append(&self, start_pos: usize, n_new: usize) -> Result<()> {
        if start_pos != self.len {
            return Err(ModelError::CacheMismatch {
                start_pos,
                cached: self.len,
            });
        }
        if start_pos + n_new > self.capacity {
            return Err(ModelError::CacheFull {
                needed: start_pos + n_new,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    pub(crate) fn advance(&mut self, n_new: usize) {
        self.len += n_new;
    }
}
