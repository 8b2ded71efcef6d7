//! Made-up weights kept quantised, for timing quantised checkpoints without one: [`RandomQ4kSource`] is
//! [`RandomSource`] with every matrix a llama.cpp Q4_K_M file stores quantised returned as random but valid
//! Q4_K blocks (or, with [`RandomQ4kSource::q4_k_m`], Q4_K_M's own mix of Q4_K and Q6_K), and the routed
//! experts stacked `[E, out, in]` as GGUF stores them: as a GGUF file's tensors load ([`Matrix::GgufBlocks`],
//! glm5's kernels), or, with [`RandomQ4kSource::candle`], as candle's `QTensor`s ([`Matrix::Quantized`]:
//! `QMatMul` and candle-nn's GGUF MoE kernels), the peer the benches compare with.
//!
//! Which matrices: llama-quantize's rule as the fixtures show it (`tests/fixtures/gguf/types.txt`): every
//! linear weight (attention, indexer `wq_b`/`wk`/`weights_proj`, dense MLP, shared and routed experts) is
//! quantised; the router (`mlp.gate`, f32), norms, biases, the token embeddings and `kv_b` (both expanded by
//! glm5's GGUF loader) are not. A matrix whose rows are not whole 256-value blocks stays dense, as
//! llama-quantize falls back to another type there. All-Q4_K keeps `lm_head` in the model dtype; the Q4_K_M mix
//! stores it as Q6_K, and the `down_proj` of the dense MLP, the shared and the routed experts of every even
//! layer too (llama-quantize's `use_more_bits` picks about half of GLM-5's 78 layers; the fixtures' rule).
//!
//! The blocks are built directly, not quantised from floats (GLM-5 sizes are too large to quantise on the
//! host). Q4_K: per block `d` small and finite (`std / 258`, jittered: a block's values `d·sc·q − dmin·m` with
//! uniform 6-bit `sc`, `m` and 4-bit `q` have about that standard deviation), `dmin = 7.5·d` (centres them),
//! and random `scales` and `qs` bytes. Q6_K: random `ql`, `qh` and signed 8-bit scales, `d = std / 1365`
//! (jittered: `sc·(q − 32)` over uniform bytes has about that standard deviation). A function of the seed and
//! the tensor name (each routed expert's blocks from its own name, so the stacked tensor and the per-expert
//! matrices agree).

use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use glm5_ops::gguf_matmul::{GgufFormat, GgufWeight};
use glm5_ops::moe::StackedGgufBlocks;

use super::gguf_source::is_linear;
use super::safetensors::RandomSource;
use super::{Matrix, TensorSource};
use crate::error::Result;

/// Values per K-quant block, and Q4_K's bytes: `d`, `dmin` (f16), 12 bytes of 6-bit scales and mins, 128 of
/// nibbles.
const QK_K: usize = 256;
const Q4K_BLOCK_BYTES: usize = 144;

/// Random weights, linear layers as Q4_K blocks or Q4_K_M's mix (module docs).
pub struct RandomQ4kSource {
    pub dense: RandomSource,
    /// The blocks as candle's `QTensor`s instead of glm5's [`GgufWeight`]s.
    pub via_candle: bool,
    /// Q4_K_M's mix: Q6_K for `lm_head` and the even layers' `down_proj`s.
    pub q4_k_m: bool,
}

impl RandomQ4kSource {
    /// The blocks as a GGUF file's Q4_K tensors load: glm5's kernels multiply them.
    pub fn new(seed: u64, std: f64) -> Self {
        Self {
            dense: RandomSource { seed, std },
            via_candle: false,
            q4_k_m: false,
        }
    }

    /// The same blocks as candle's `QTensor`s.
    pub fn candle(seed: u64, std: f64) -> Self {
        Self {
            via_candle: true,
            ..Self::new(seed, std)
        }
    }

    /// Q4_K_M's mix of Q4_K and Q6_K (module docs), through glm5's kernels.
    pub fn q4_k_m(seed: u64, std: f64) -> Self {
        Self {
            q4_k_m: true,
            ..Self::new(seed, std)
        }
    }

    /// The format the source stores the linear layer `name` in (rows of `row` values), `None` if dense.
    pub fn format_of(&self, name: &str, row: usize) -> Option<GgufFormat> {
        if !row.is_multiple_of(QK_K) {
            return None;
        }
        if !self.q4_k_m {
            return quantised_in_q4k(name).then_some(GgufFormat::Q4K);
        }
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        let even_down = name.contains("down_proj") && layer.is_some_and(|l| l.is_multiple_of(2));
        Some(if name == "lm_head.weight" || even_down {
            GgufFormat::Q6K
        } else {
            GgufFormat::Q4K
        })
    }
}

impl RandomQ4kSource {
    /// The format of the routed experts' projection `proj` of `prefix`, `[E, out, in]` (each expert's, as its
    /// matrix is stored), `None` if dense.
    fn experts_format(&self, prefix: &str, proj: &str, shape: [usize; 3]) -> Option<GgufFormat> {
        self.format_of(&format!("{prefix}.experts.0.{proj}.weight"), shape[2])
    }
}

/// Whether the all-Q4_K source stores the linear layer `name` quantised (module docs).
pub fn quantised_in_q4k(name: &str) -> bool {
    name != "lm_head.weight"
}

/// Bytes of `elements` values in Q4_K.
pub fn q4k_bytes(elements: u64) -> u64 {
    elements / QK_K as u64 * Q4K_BLOCK_BYTES as u64
}

/// candle's type of one of the formats this source writes.
fn ggml_dtype(format: GgufFormat) -> GgmlDType {
    match format {
        GgufFormat::Q6K => GgmlDType::Q6K,
        _ => GgmlDType::Q4K,
    }
}

/// The next value of a SplitMix64 stream (the random sources' generator: fast, and a function of the seed).
pub(crate) fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `experts` runs of `per_expert` bytes, run `e` filled by `fill(e, bytes)`, on the host's cores (GLM-5: a
/// stacked projection is up to 1.8 GB).
pub(crate) fn fill_experts(
    experts: usize,
    per_expert: usize,
    fill: impl Fn(usize, &mut [u8]) + Sync,
) -> Vec<u8> {
    let mut bytes = vec![0u8; experts * per_expert];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = experts.div_ceil(threads).max(1);
    let fill = &fill;
    std::thread::scope(|scope| {
        for (c, part) in bytes.chunks_mut((chunk * per_expert).max(1)).enumerate() {
            scope.spawn(move || {
                for (i, expert_bytes) in part.chunks_mut(per_expert.max(1)).enumerate() {
                    fill(c * chunk + i, expert_bytes);
                }
            });
        }
    });
    bytes
}

/// The random stream of tensor `name`: `seed` mixed with the name's FNV-1a hash.
pub(crate) fn name_stream(seed: u64, name: &str) -> u64 {
    let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    seed ^ name_hash
}

/// `blocks` random Q4_K blocks for the tensor `name`, appended to `out`.
fn q4k_blocks(name: &str, seed: u64, std: f64, blocks: usize, out: &mut Vec<u8>) {
    let mut state = name_stream(seed, name);
    let base = std / 258.0;
    out.reserve(blocks * Q4K_BLOCK_BYTES);
    for _ in 0..blocks {
        let jitter = 0.75 + 0.5 * (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
        let d = half::f16::from_f64(base * jitter);
        let dmin = half::f16::from_f64(base * jitter * 7.5);
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        out.extend_from_slice(&dmin.to_bits().to_le_bytes());
        // 140 random bytes: 12 of scales and mins, 128 of 4-bit values (17 words + 4 bytes).
        for _ in 0..17 {
            out.extend_from_slice(&splitmix(&mut state).to_le_bytes());
        }
        out.extend_from_slice(&splitmix(&mut state).to_le_bytes()[..4]);
    }
}

/// `blocks` random Q6_K blocks for the tensor `name`, appended to `out`: 192 bytes of `ql` and `qh`, 16 signed
/// scales, `d` last.
fn q6k_blocks(name: &str, seed: u64, std: f64, blocks: usize, out: &mut Vec<u8>) {
    let mut state = name_stream(seed, name);
    let base = std / 1365.0;
    out.reserve(blocks * GgufFormat::Q6K.block_bytes());
    for _ in 0..blocks {
        let jitter = 0.75 + 0.5 * (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
        for _ in 0..26 {
            out.extend_from_slice(&splitmix(&mut state).to_le_bytes());
        }
        out.extend_from_slice(&half::f16::from_f64(base * jitter).to_bits().to_le_bytes());
    }
}

/// One matrix `[out, in]` of random blocks of `format` (Q4_K or Q6_K).
fn random_matrix(
    format: GgufFormat,
    name: &str,
    seed: u64,
    std: f64,
    shape: [usize; 2],
) -> Vec<u8> {
    let mut bytes = Vec::new();
    let blocks = shape[0] * shape[1] / QK_K;
    match format {
        GgufFormat::Q6K => q6k_blocks(name, seed, std, blocks, &mut bytes),
        _ => q4k_blocks(name, seed, std, blocks, &mut bytes),
    }
    bytes
}

/// The routed experts' projection `proj` of `prefix`, `[E, out, in]` in `format`, each expert's blocks from
/// its own name.
fn random_experts(
    format: GgufFormat,
    prefix: &str,
    proj: &str,
    seed: u64,
    std: f64,
    [experts, out, inp]: [usize; 3],
) -> Vec<u8> {
    let per_expert = out * inp / QK_K * format.block_bytes();
    fill_experts(experts, per_expert, |e, expert_bytes| {
        let name = format!("{prefix}.experts.{e}.{proj}.weight");
        expert_bytes.copy_from_slice(&random_matrix(format, &name, seed, std, [out, inp]));
    })
}

impl TensorSource for RandomQ4kSource {
    fn contains(&self, name: &str) -> bool {
        self.dense.contains(name)
    }

    fn tensor(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        self.dense.tensor(name, shape, dtype, device)
    }

    fn matrix(
        &self,
        name: &str,
        shape: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Matrix> {
        let Some(format) = self.format_of(name, shape[1]) else {
            return self.dense.matrix(name, shape, dtype, device);
        };
        let bytes = random_matrix(format, name, self.dense.seed, self.dense.std, shape);
        if self.via_candle {
            return Ok(Matrix::Quantized(Arc::new(qtensor_from_ggml(
                ggml_dtype(format),
                &bytes,
                shape.to_vec(),
                device,
            )?)));
        }
        let row = format.row_bytes(shape[1]).expect("whole blocks");
        let blocks = Tensor::from_vec(bytes, (shape[0], row), &Device::Cpu)?.to_device(device)?;
        Ok(Matrix::GgufBlocks(GgufWeight::new(
            format, blocks, shape[1],
        )?))
    }

    fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        let elements = shape.iter().map(|&d| d as u64).product::<u64>();
        let row = shape.last().copied().unwrap_or(0);
        match self.format_of(name, row) {
            Some(format) if is_linear(name) => elements / QK_K as u64 * format.block_bytes() as u64,
            _ => elements * dtype.size_in_bytes() as u64,
        }
    }

    fn stacked_experts_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgmlDType>> {
        Ok(self
            .via_candle
            .then(|| self.experts_format(prefix, proj, shape))
            .flatten()
            .map(ggml_dtype))
    }

    fn stacked_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<QTensor>> {
        let Some(format) = self
            .via_candle
            .then(|| self.experts_format(prefix, proj, shape))
            .flatten()
        else {
            return Ok(None);
        };
        let bytes = random_experts(format, prefix, proj, self.dense.seed, self.dense.std, shape);
        Ok(Some(qtensor_from_ggml(
            ggml_dtype(format),
            &bytes,
            shape.to_vec(),
            device,
        )?))
    }

    fn stacked_gguf_block_format(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgufFormat>> {
        Ok((!self.via_candle)
            .then(|| self.experts_format(prefix, proj, shape))
            .flatten())
    }

    fn stacked_gguf_block_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<StackedGgufBlocks>> {
        let Some(format) = self.stacked_gguf_block_format(prefix, proj, shape)? else {
            return Ok(None);
        };
        let [experts, out, inp] = shape;
        let bytes = random_experts(format, prefix, proj, self.dense.seed, self.dense.std, shape);
        let row = format.row_bytes(inp).expect("whole blocks");
        let blocks =
            Tensor::from_vec(bytes, (experts, out, row), &Device::Cpu)?.to_device(device)?;
        Ok(Some(StackedGgufBlocks::new(format, blocks, inp)?))
    }
}
