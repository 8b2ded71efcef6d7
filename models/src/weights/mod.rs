//! Checkpoint access behind one "give me this tensor" trait, [`TensorSource`]:
//!
//! * [`safetensors`]: Hugging Face safetensors, one file or a sharded set named by
//!   `model.safetensors.index.json`, stored as f32, bf16 or f16, or quantised as block-scaled FP8 or NVFP4
//!   ([`crate::quantization`]; those matrices stay quantised: [`Matrix::Fp8Block`], [`Matrix::Nvfp4`]); and
//!   made-up random weights (bf16; [`random_q4k`]: random Q4_K blocks for the linear layers; [`random_iq`]:
//!   random i-quant blocks; [`random_quantized`]: random FP8 or NVFP4 weights).
//! * [`gguf`] / [`gguf_source`]: llama.cpp GGUF files (architecture `glm-dsa`), one file or split parts, whose
//!   quantised matrices stay quantised ([`Matrix::Quantized`], multiplied by candle's `QMatMul`; the i-quants,
//!   which candle lacks, as [`Matrix::GgufBlocks`], multiplied by `glm5_ops::gguf_matmul`).
//!
//! The model asks for every tensor by its Hugging Face checkpoint name with the shape the config implies; a
//! source that stores it under another name or layout (GGUF) translates. A missing or misshapen tensor is an
//! error naming it. Tensors the model does not ask for (the MTP layer) are never read.

pub mod gguf;
pub mod gguf_config;
pub mod gguf_source;
pub mod random_iq;
pub mod random_q4k;
pub mod random_quantized;
pub mod safetensors;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::config::Config;
use crate::error::Result;

/// A linear layer's `[out, in]` matrix as the source keeps it.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Plain values in the model dtype.
    Dense(Tensor),
    /// Quantised blocks (GGUF), multiplied without being expanded.
    Quantized(Arc<QTensor>),
    /// Block-scaled FP8 (`weight_scale_inv`), multiplied by `glm5_ops::fp8_matmul`.
    Fp8Block(glm5_ops::fp8_matmul::Fp8BlockWeight),
    /// NVFP4 (ModelOpt), multiplied by `glm5_ops::nvfp4_matmul`.
    Nvfp4(glm5_ops::nvfp4_matmul::Nvfp4Weight),
    /// GGUF blocks glm5 decodes itself (llama.cpp's i-quants, which candle cannot hold, and Q4_K), multiplied
    /// by `glm5_ops::gguf_matmul`.
    GgufBlocks(glm5_ops::gguf_matmul::GgufWeight),
}

/// Where weights come from: one implementation per checkpoint format.
pub trait TensorSource: Send + Sync {
    /// Whether the checkpoint holds `name` (a Hugging Face name).
    fn contains(&self, name: &str) -> bool;

    /// `name`, checked to have `shape`, as `dtype` on `device` (quantised tensors are expanded).
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor>;

    /// The `[out, in]` matrix of a bias-free linear layer: quantised sources keep it quantised.
    fn matrix(
        &self,
        name: &str,
        shape: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Matrix> {
        Ok(Matrix::Dense(self.tensor(name, &shape, dtype, device)?))
    }

    /// Bytes `name` takes on the device once loaded as `dtype` (its stored size if it stays quantised).
    fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        let _ = name;
        shape.iter().map(|&d| d as u64).product::<u64>() * dtype.size_in_bytes() as u64
    }

    /// The block type of the routed experts' projection `proj` (`gate_proj`, `up_proj`, `down_proj`) of the
    /// MoE block `prefix` (`model.layers.{i}.mlp`) when the source stores all experts as one quantised
    /// `[n_experts, out, in]` tensor (`shape`), as GGUF's `ffn_{gate,up,down}_exps` do; `None` otherwise.
    /// Reads headers only.
    fn stacked_experts_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgmlDType>> {
        let _ = (prefix, proj, shape);
        Ok(None)
    }

    /// The format of the routed experts' projection `proj` of the MoE block `prefix` when the source stores
    /// all experts as one `[n_experts, out, in]` tensor in GGUF blocks glm5 decodes itself (i-quants, K-quants);
    /// `None` otherwise. Reads headers only.
    fn stacked_gguf_block_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<glm5_ops::gguf_matmul::GgufFormat>> {
        let _ = (prefix, proj, shape);
        Ok(None)
    }

    /// That stacked tensor ([`Self::stacked_gguf_block_format`]), kept as its blocks on `device`; `None` otherwise.
    fn stacked_gguf_block_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<glm5_ops::moe::StackedGgufBlocks>> {
        let _ = (prefix, proj, shape, device);
        Ok(None)
    }

    /// That stacked tensor, kept quantised on `device` (`None` where [`Self::stacked_experts_format`] is).
    fn stacked_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<QTensor>> {
        let _ = (prefix, proj, shape, device);
        Ok(None)
    }
}

/// The checkpoint format, as `glm5 plan` and errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Safetensors,
    Gguf,
    Random,
}

/// The weights of one model.
pub struct Checkpoint {
    source: Box<dyn TensorSource>,
    dir: Option<PathBuf>,
    format: Format,
}

impl Checkpoint {
    /// Opens a directory's safetensors: `model.safetensors.index.json` and its shards if present, else
    /// `model.safetensors`; quantised as the directory's `config.json` `quantization_config` (or
    /// `hf_quant_config.json`) says.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        Ok(Self {
            source: Box::new(
                safetensors::SafetensorsSource::open(&dir)?
                    .with_quantization(crate::quantization::Quantization::from_dir(&dir)?),
            ),
            dir: Some(dir),
            format: Format::Safetensors,
        })
    }

    /// Opens a GGUF model (a `.gguf` file, one part of a split set, or a directory holding one model) and
    /// reads its config from the metadata. Fails before any weight is read if a tensor the model uses has a
    /// type glm5 cannot compute with, naming the tensor and its type.
    pub fn open_gguf(path: impl AsRef<Path>) -> Result<(Config, Self)> {
        let path = path.as_ref();
        let source = gguf_source::GgufSource::open(path)?;
        let config = source.config().clone();
        let dir = path
            .is_dir()
            .then(|| path.to_path_buf())
            .or_else(|| path.parent().map(Path::to_path_buf));
        Ok((
            config,
            Self {
                source: Box::new(source),
                dir,
                format: Format::Gguf,
            },
        ))
    }

    /// Made-up weights of any shape asked for: norm weights 1, biases 0, everything else normal with
    /// standard deviation `std`, a function of `seed` and the tensor's name only (so two devices, or two
    /// loads, get the same values). On CUDA the values come from the device's generator, reseeded per
    /// tensor (this resets the device's seed); elsewhere from a splitmix64 stream.
    pub fn random(seed: u64, std: f64) -> Self {
        Self {
            source: Box::new(safetensors::RandomSource { seed, std }),
            dir: None,
            format: Format::Random,
        }
    }

    /// Made-up weights as [`Checkpoint::random`] makes them, except that the matrices `quantization`'s
    /// published recipe quantises are random FP8 or NVFP4 weights ([`random_quantized`]).
    pub fn random_quantized(
        seed: u64,
        std: f64,
        quantization: crate::quantization::Quantization,
    ) -> Self {
        Self {
            source: Box::new(random_quantized::RandomQuantizedSource {
                seed,
                std,
                quantization,
            }),
            dir: None,
            format: Format::Random,
        }
    }

    /// Any other source.
    pub fn from_source(source: Box<dyn TensorSource>, format: Format) -> Self {
        Self {
            source,
            dir: None,
            format,
        }
    }

    /// The directory the checkpoint was opened from (`None` for random weights).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// Whether the checkpoint holds a tensor of this name (random weights hold every name).
    pub fn contains(&self, name: &str) -> bool {
        self.source.contains(name)
    }

    /// Loads `name`, checks it has `shape`, and converts it to `dtype` on `device`.
    pub fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        self.source.tensor(name, shape, dtype, device)
    }

    /// A linear layer's `[out, in]` matrix, quantised if the checkpoint stores it so.
    pub fn matrix(
        &self,
        name: &str,
        shape: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Matrix> {
        self.source.matrix(name, shape, dtype, device)
    }

    /// Bytes `name` takes once loaded as `dtype`.
    pub fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        self.source.resident_bytes(name, shape, dtype)
    }

    /// See [`TensorSource::stacked_experts_format`].
    pub fn stacked_experts_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgmlDType>> {
        self.source.stacked_experts_format(prefix, proj, shape)
    }

    /// See [`TensorSource::stacked_experts`].
    pub fn stacked_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<QTensor>> {
        self.source.stacked_experts(prefix, proj, shape, device)
    }

    /// [`TensorSource::stacked_gguf_block_format`].
    pub fn stacked_gguf_block_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<glm5_ops::gguf_matmul::GgufFormat>> {
        self.source.stacked_gguf_block_format(prefix, proj, shape)
    }

    /// [`TensorSource::stacked_gguf_block_experts`].
    pub fn stacked_gguf_block_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<glm5_ops::moe::StackedGgufBlocks>> {
        self.source
            .stacked_gguf_block_experts(prefix, proj, shape, device)
    }
}
