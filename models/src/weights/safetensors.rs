//! Hugging Face safetensors checkpoints (one file, or a sharded set named by `model.safetensors.index.json`,
//! stored as f32, bf16 or f16, or quantised: block-scaled FP8 and NVFP4, see [`crate::quantization`]), and
//! made-up random weights for benchmarks of real-size slices of GLM-5 without downloading 1.5 TB.
//!
//! A quantised checkpoint's linear layer is quantised where its scale tensor exists (FP8:
//! `<name>_scale_inv`; NVFP4: `<module>.weight_scale` and `.weight_scale_2`): [`TensorSource::matrix`] keeps
//! it quantised on the device, [`TensorSource::tensor`] expands it (attention's `kv_b_proj`, which the
//! absorbed MLA splits per head). Every scale is checked before use: a missing scale, one of the wrong
//! shape or dtype, or a non-finite or non-positive value is a [`ModelError::QuantizedTensor`] naming the
//! weight and the scale.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use glm5_ops::fp8_matmul::Fp8BlockWeight;
use glm5_ops::nvfp4_matmul::Nvfp4Weight;

use super::{Matrix, TensorSource};
use crate::error::{ModelError, Result, ScaleProblem};
use crate::quantization::Quantization;

/// A directory's safetensors files, memory-mapped.
pub struct SafetensorsSource {
    files: MmapedSafetensors,
    quantization: Option<Quantization>,
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
        Ok(Self {
            files,
            quantization: None,
        })
    }

    /// The same files read as `quantization` says (`None`: a plain checkpoint).
    pub fn with_quantization(mut self, quantization: Option<Quantization>) -> Self {
        self.quantization = quantization;
        self
    }

    fn view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        self.files.get(name).map_err(|_| ModelError::MissingTensor {
            name: name.to_string(),
        })
    }

    /// `name`'s quantised form if the checkpoint stores it quantised (`None`: a plain tensor), checked.
    fn quantized(&self, name: &str, shape: [usize; 2], device: &Device) -> Result<Option<Matrix>> {
        let Some(quantization) = &self.quantization else {
            return Ok(None);
        };
        let problem = |problem| ModelError::QuantizedTensor {
            tensor: name.to_string(),
            problem,
        };
        let [out, inp] = shape;
        match quantization {
            Quantization::Fp8Block { block, .. } => {
                let scale = format!("{name}_scale_inv");
                let view = self.view(name)?;
                let stored_fp8 = view.dtype() == St::F8_E4M3;
                if !self.contains(&scale) {
                    // An FP8 weight without its multipliers cannot be read; others stay plain.
                    return if stored_fp8 {
                        Err(problem(ScaleProblem::Missing { scale }))
                    } else {
                        Ok(None)
                    };
                }
                if !stored_fp8 {
                    return Err(problem(ScaleProblem::WeightDtype {
                        format: "block-scaled FP8",
                        expected: "F8_E4M3",
                        found: format!("{:?}", view.dtype()),
                    }));
                }
                check_shape(name, &view, &shape)?;
                let scale_inv = self.scale_f32(
                    name,
                    &scale,
                    &[out.div_ceil(block[0]), inp.div_ceil(block[1])],
                    device,
                )?;
                let weight = Tensor::from_raw_buffer(view.data(), DType::U8, &shape, device)?;
                Ok(Some(Matrix::Fp8Block(Fp8BlockWeight {
                    weight,
                    scale_inv,
                    block: *block,
                })))
            }
            Quantization::Nvfp4 { group_size, .. } => {
                let module = name.strip_suffix(".weight").unwrap_or(name);
                let (scale, global) = (
                    format!("{module}.weight_scale"),
                    format!("{module}.weight_scale_2"),
                );
                let view = self.view(name)?;
                let packed = view.dtype() == St::U8;
                if !self.contains(&scale) {
                    return if packed {
                        Err(problem(ScaleProblem::Missing { scale }))
                    } else {
                        Ok(None)
                    };
                }
                if !packed {
                    return Err(problem(ScaleProblem::WeightDtype {
                        format: "NVFP4",
                        expected: "U8 (two e2m1 values a byte)",
                        found: format!("{:?}", view.dtype()),
                    }));
                }
                let group = *group_size;
                if !inp.is_multiple_of(group) {
                    return Err(problem(ScaleProblem::Group { in_dim: inp, group }));
                }
                check_shape(name, &view, &[out, inp / 2])?;
                let scales = self.view(&scale)?;
                if scales.dtype() != St::F8_E4M3 {
                    return Err(problem(ScaleProblem::Dtype {
                        scale,
                        expected: "F8_E4M3",
                        found: format!("{:?}", scales.dtype()),
                    }));
                }
                if scales.shape() != [out, inp / group] {
                    return Err(problem(ScaleProblem::Shape {
                        scale,
                        expected: vec![out, inp / group],
                        found: scales.shape().to_vec(),
                    }));
                }
                if !self.contains(&global) {
                    return Err(problem(ScaleProblem::Missing { scale: global }));
                }
                let global_view = self.view(&global)?;
                if global_view.shape().iter().product::<usize>() != 1 {
                    return Err(problem(ScaleProblem::Shape {
                        scale: global,
                        expected: vec![],
                        found: global_view.shape().to_vec(),
                    }));
                }
                // ModelOpt writes f32; some exports keep it in bf16.
                if !matches!(global_view.dtype(), St::F32 | St::BF16) {
                    return Err(problem(ScaleProblem::Dtype {
                        scale: global,
                        expected: "F32 (or BF16)",
                        found: format!("{:?}", global_view.dtype()),
                    }));
                }
                let global_scale: f32 =
                    candle_core::safetensors::Load::load(&global_view, &Device::Cpu)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?[0];
                if !(global_scale.is_finite() && global_scale > 0.0) {
                    return Err(problem(ScaleProblem::Value {
                        scale: global,
                        value: global_scale,
                    }));
                }
                Ok(Some(Matrix::Nvfp4(Nvfp4Weight {
                    packed: Tensor::from_raw_buffer(
                        view.data(),
                        DType::U8,
                        &[out, inp / 2],
                        device,
                    )?,
                    scales: Tensor::from_raw_buffer(
                        scales.data(),
                        DType::U8,
                        &[out, inp / group],
                        device,
                    )?,
                    global_scale,
                })))
            }
        }
    }

    /// The F32 scale tensor `scale` of weight `name`, checked to have `shape` and finite positive values.
    fn scale_f32(
        &self,
        name: &str,
        scale: &str,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        let problem = |problem| ModelError::QuantizedTensor {
            tensor: name.to_string(),
            problem,
        };
        let view = self.view(scale)?;
        if view.dtype() != St::F32 {
            return Err(problem(ScaleProblem::Dtype {
                scale: scale.to_string(),
                expected: "F32",
                found: format!("{:?}", view.dtype()),
            }));
        }
        if view.shape() != shape {
            return Err(problem(ScaleProblem::Shape {
                scale: scale.to_string(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            }));
        }
        let values = candle_core::safetensors::Load::load(&view, &Device::Cpu)?;
        if let Some(&bad) = values
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .find(|v| !(v.is_finite() && **v > 0.0))
        {
            return Err(problem(ScaleProblem::Value {
                scale: scale.to_string(),
                value: bad,
            }));
        }
        Ok(values.to_device(device)?)
    }
}

use safetensors::Dtype as St;

fn check_shape(
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
    shape: &[usize],
) -> Result<()> {
    if view.shape() != shape {
        return Err(ModelError::TensorShape {
            name: name.to_string(),
            expected: shape.to_vec(),
            found: view.shape().to_vec(),
        });
    }
    Ok(())
}

impl TensorSource for SafetensorsSource {
    fn contains(&self, name: &str) -> bool {
        self.files.get(name).is_ok()
    }

    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        // A quantised matrix asked for whole: expanded on the CPU by the ops' reference, then moved.
        if let &[out, inp] = shape {
            match self.quantized(name, [out, inp], &Device::Cpu)? {
                Some(Matrix::Fp8Block(w)) => {
                    return Ok(glm5_ops::fp8_matmul::reference::dequantize(&w)?
                        .to_dtype(dtype)?
                        .to_device(device)?)
                }
                Some(Matrix::Nvfp4(w)) => {
                    return Ok(glm5_ops::nvfp4_matmul::reference::dequantize(&w)?
                        .to_dtype(dtype)?
                        .to_device(device)?)
                }
                _ => {}
            }
        }
        let view = self.view(name)?;
        if view.shape() != shape {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        if !matches!(view.dtype(), St::F32 | St::BF16 | St::F16) {
            return Err(ModelError::TensorDtype {
                name: name.to_string(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
        let tensor = candle_core::safetensors::Load::load(&view, device)?;
        Ok(tensor.to_dtype(dtype)?)
    }

    fn matrix(
        &self,
        name: &str,
        shape: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Matrix> {
        match self.quantized(name, shape, device)? {
            Some(matrix) => Ok(matrix),
            None => Ok(Matrix::Dense(self.tensor(name, &shape, dtype, device)?)),
        }
    }

    fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        let plain = shape.iter().map(|&d| d as u64).product::<u64>() * dtype.size_in_bytes() as u64;
        match (&self.quantization, shape) {
            (Some(q), &[out, inp]) => {
                let module = name.strip_suffix(".weight").unwrap_or(name);
                let quantized = match q {
                    Quantization::Fp8Block { .. } => self.contains(&format!("{name}_scale_inv")),
                    Quantization::Nvfp4 { .. } => self.contains(&format!("{module}.weight_scale")),
                };
                if quantized {
                    q.matrix_bytes(out, inp)
                } else {
                    plain
                }
            }
            _ => plain,
        }
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
pub(super) fn random_tensor(
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
    let state = seed ^ name_hash;
    if device.is_cuda() {
        device.set_seed(state)?;
        return Ok(Tensor::randn(0f32, std as f32, shape, device)?.to_dtype(dtype)?);
    }
    let count: usize = shape.iter().product();
    // SplitMix64: the k-th draw (from 1) mixes `state + k * GAMMA`, so every value can be computed on its
    // own, and the CPU's threads fill their parts of the tensor with the values one sequence would draw.
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
    let uniform = |k: u64| {
        let mut z = state.wrapping_add(k.wrapping_mul(GAMMA));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut values = vec![0f32; count];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = count.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (t, part) in values.chunks_mut(per_thread).enumerate() {
            let uniform = &uniform;
            scope.spawn(move || {
                for (j, value) in part.iter_mut().enumerate() {
                    let k = (t * per_thread + j) as u64;
                    // Box-Muller on two uniforms in (0, 1]: draws 2k + 1 and 2k + 2.
                    let (u, v) = (1.0 - uniform(2 * k + 1), uniform(2 * k + 2));
                    *value =
                        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * std) as f32;
                }
            });
        }
    });
    Ok(Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?)
}
