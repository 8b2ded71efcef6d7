//! Hugging Face safetensors checkpoints (one file, or a sharded set named by `model.safetensors.index.json`,
//! stored as f32, bf16 or f16), and made-up random weights for benchmarks of real-size slices of GLM-5
//! without downloading 1.5 TB.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::TensorSource;
use crate::error::{ModelError, Result};

/// A directory's safetensors files, memory-mapped.
pub struct SafetensorsSource {
    files: MmapedSafetensors,
}

/// Bytes of `model.safetensors.index.json` read at most (GLM-5's has about 7 MB).
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// A non-empty path of plain components only.
fn is_plain_relative(name: &str) -> bool {
    !name.is_empty()
        && !name.contains(['\\', ':'])
        && Path::new(name)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: std::collections::HashMap<String, String>,
}

impl SafetensorsSource {
    /// Opens `model.safetensors.index.json` and its shards if present, else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let dir = dir.to_path_buf();
        let index_path = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index_path.exists() {
            let text =
                crate::config::read_text_file(&index_path, MAX_INDEX_BYTES).map_err(|source| {
                    ModelError::Io {
                        path: index_path.clone(),
                        source,
                    }
                })?;
            let index: ShardIndex =
                serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint {
                    path: index_path.clone(),
                    reason: format!("not a valid safetensors index: {e}"),
                })?;
            let shards: BTreeSet<&String> = index.weight_map.values().collect();
            // The index may name only files inside the model directory: plain relative paths, as the Hub
            // download requires of the same names (no `..`, no absolute path, no drive prefix).
            if let Some(bad) = shards.iter().find(|name| !is_plain_relative(name)) {
                return Err(ModelError::Checkpoint {
                    path: index_path,
                    reason: format!("weight_map names the shard {bad:?}, which is not a plain path inside the model directory"),
                });
            }
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
        Ok(Self { files })
    }
}

impl TensorSource for SafetensorsSource {
    fn contains(&self, name: &str) -> bool {
        self.files.get(name).is_ok()
    }

    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
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

/// Made-up weights (see [`super::Checkpoint::random`]).
pub struct RandomSource {
    pub seed: u64,
    pub std: f64,
}

impl TensorSource for RandomSource {
    fn contains(&self, _name: &str) -> bool {
        true
    }

    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        random_tensor(name, shape, self.seed, self.std, dtype, device)
    }
}

/// A made-up tensor for [`RandomSource`].
fn random_tensor(
    name: &str,
    shape: &[usize],
    seed: u64,
    std: f64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    if name.ends_with("norm.weight") {
        return Ok(Tensor::ones(shape, dtype, device)?);
    }
    if name.ends_with("bias") {
        return Ok(Tensor::zeros(shape, dtype, device)?);
    }
    // FNV-1a of the name, mixed with the seed.
    let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    let mut state = seed ^ name_hash;
    if device.is_cuda() {
        device.set_seed(state)?;
        return Ok(Tensor::randn(0f32, std as f32, shape, device)?.to_dtype(dtype)?);
    }
    let count: usize = shape.iter().product();
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let values: Vec<f32> = (0..count)
        .map(|_| {
            // Box-Muller on two uniforms in (0, 1].
            let (u, v) = (1.0 - next(), next());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * std) as f32
        })
        .collect();
    Ok(Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?)
}
