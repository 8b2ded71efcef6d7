//! Checkpoint access: Hugging Face safetensors, one file or a sharded set named by
//! `model.safetensors.index.json`, stored as f32, bf16 or f16.
//!
//! Every tensor is fetched by its checkpoint name with the shape the config implies; a missing or misshapen
//! tensor is an error naming it. Tensors the model does not ask for (e.g. the MTP layer
//! `model.layers.{num_hidden_layers}.*`) are never read.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use crate::error::{ModelError, Result};

/// The weight files of one model directory, memory-mapped.
pub struct Checkpoint {
    files: MmapedSafetensors,
    dir: PathBuf,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: std::collections::HashMap<String, String>,
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` and its shards if present, else `model.safetensors`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io {
                path: index_path.clone(),
                source,
            })?;
            let index: ShardIndex =
                serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint {
                    path: index_path.clone(),
                    reason: format!("not a valid safetensors index: {e}"),
                })?;
            let shards: BTreeSet<&String> = index.weight_map.values().collect();
            shards.into_iter().map(|name| dir.join(name)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        for path in &paths {
            if !path.is_file() {
                return Err(ModelError::Checkpoint {
                    path: path.clone(),
                    reason: "file not found".into(),
                });
            }
        }
        // SAFETY: the files are mapped read-only; glm5 never writes to a checkpoint while it is loaded.
        let files =
            unsafe { MmapedSafetensors::multi(&paths) }.map_err(|e| ModelError::Checkpoint {
                path: dir.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self { files, dir })
    }

    /// The directory the checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the checkpoint holds a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.files.get(name).is_ok()
    }

    /// Loads `name`, checks it has `shape`, and converts it to `dtype` on `device`.
    pub fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let view = self
            .files
            .get(name)
            .map_err(|_| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        if view.shape() != shape {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        use safetensors::Dtype as St;
        if !matches!(view.dtype(), St::F32 | St::BF16 | St::F16) {
            return Err(ModelError::TensorDtype {
                name: name.to_string(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
        let tensor = candle_core::safetensors::Load::load(&view, device)?;
        Ok(tensor.to_dtype(dtype)?)
    }
}
