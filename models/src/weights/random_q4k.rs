//! Made-up weights kept quantised, for timing quantised checkpoints without one: [`RandomQ4kSource`] is
//! [`RandomSource`] with every matrix a llama.cpp Q4_K_M file stores quantised returned as random but valid
//! Q4_K blocks, and the routed experts stacked `[E, out, in]` as GGUF stores them: as a GGUF file's Q4_K
//! tensors load ([`Matrix::GgufBlocks`], glm5's kernels), or, with [`RandomQ4kSource::candle`], as candle's `QTensor`s
//! ([`Matrix::Quantized`]: `QMatMul` and candle-nn's GGUF MoE kernels), the peer the benches compare with.
//!
//! Which matrices: llama-quantize's rule as the fixtures show it (`tests/fixtures/gguf/types.txt`): every
//! linear weight (attention, indexer `wq_b`/`wk`/`weights_proj`, dense MLP, shared and routed experts) is
//! quantised; the router (`mlp.gate`, f32), norms, biases, the token embeddings and `kv_b` (both expanded by
//! glm5's GGUF loader) are not. `lm_head` stays in the model dtype here (Q4_K_M stores it as Q6_K). A matrix
//! whose rows are not whole 256-value blocks stays dense, as llama-quantize falls back to another type there.
//!
//! The blocks are built directly, not quantised from floats (GLM-5 sizes are too large to quantise on the
//! host): per block `d` small and finite (`std / 258`, jittered: a block's values `d·sc·q − dmin·m` with
//! uniform 6-bit `sc`, `m` and 4-bit `q` have about that standard deviation), `dmin = 7.5·d` (centres them),
//! and random `scales` and `qs` bytes. A function of the seed and the tensor name (each routed expert's blocks
//! from its own name, so the stacked tensor and the per-expert matrices agree).

use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use glm5_ops::gguf_matmul::{GgufFormat, GgufWeight};
use glm5_ops::moe::StackedGgufBlocks;

use super::gguf_source::is_linear;
use super::safetensors::RandomSource;
use super::{Matrix, TensorSource};
use crate::error::Result;

/// Values per Q4_K block, and its bytes: `d`, `dmin` (f16), 12 bytes of 6-bit scales and mins, 128 of nibbles.
const QK_K: usize = 256;
const Q4K_BLOCK_BYTES: usize = 144;

/// Random weights, linear layers as Q4_K blocks (module docs).
pub struct RandomQ4kSource {
    pub dense: RandomSource,
    /// The blocks as candle's `QTensor`s instead of glm5's [`GgufWeight`]s.
    pub via_candle: bool,
}

impl RandomQ4kSource {
    /// The blocks as a GGUF file's Q4_K tensors load: glm5's kernels multiply them.
    pub fn new(seed: u64, std: f64) -> Self {
        Self {
            dense: RandomSource { seed, std },
            via_candle: false,
        }
    }

    /// The same blocks as candle's `QTensor`s.
    pub fn candle(seed: u64, std: f64) -> Self {
        Self {
            via_candle: true,
            ..Self::new(seed, std)
        }
    }
}

/// Whether a Q4_K_M file stores the linear layer `name` quantised (module docs).
pub fn quantised_in_q4k(name: &str) -> bool {
    name != "lm_head.weight"
}

/// Bytes of `elements` values in Q4_K.
pub fn q4k_bytes(elements: u64) -> u64 {
    elements / QK_K as u64 * Q4K_BLOCK_BYTES as u64
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

/// One matrix `[out, in]` of random Q4_K blocks.
fn q4k_matrix(name: &str, seed: u64, std: f64, shape: [usize; 2]) -> Vec<u8> {
    let mut bytes = Vec::new();
    q4k_blocks(name, seed, std, shape[0] * shape[1] / QK_K, &mut bytes);
    bytes
}

/// The routed experts' projection `proj` of `prefix`, `[E, out, in]`, each expert's blocks from its own name.
fn q4k_experts(
    prefix: &str,
    proj: &str,
    seed: u64,
    std: f64,
    [experts, out, inp]: [usize; 3],
) -> Vec<u8> {
    let per_expert = out * inp / QK_K * Q4K_BLOCK_BYTES;
    fill_experts(experts, per_expert, |e, expert_bytes| {
        let name = format!("{prefix}.experts.{e}.{proj}.weight");
        expert_bytes.copy_from_slice(&q4k_matrix(&name, seed, std, [out, inp]));
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
        if !quantised_in_q4k(name) || !shape[1].is_multiple_of(QK_K) {
            return self.dense.matrix(name, shape, dtype, device);
        }
        let bytes = q4k_matrix(name, self.dense.seed, self.dense.std, shape);
        if self.via_candle {
            return Ok(Matrix::Quantized(Arc::new(qtensor_from_ggml(
                GgmlDType::Q4K,
                &bytes,
                shape.to_vec(),
                device,
            )?)));
        }
        let row = GgufFormat::Q4K.row_bytes(shape[1]).expect("whole blocks");
        let blocks = Tensor::from_vec(bytes, (shape[0], row), &Device::Cpu)?.to_device(device)?;
        Ok(Matrix::GgufBlocks(GgufWeight::new(
            GgufFormat::Q4K,
            blocks,
            shape[1],
        )?))
    }

    fn resident_bytes(&self, name: &str, shape: &[usize], dtype: DType) -> u64 {
        let elements = shape.iter().map(|&d| d as u64).product::<u64>();
        let row = shape.last().copied().unwrap_or(0);
        if is_linear(name) && quantised_in_q4k(name) && row.is_multiple_of(QK_K) {
            q4k_bytes(elements)
        } else {
            elements * dtype.size_in_bytes() as u64
        }
    }

    fn stacked_experts_format(
        &self,
        _prefix: &str,
        _proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgmlDType>> {
        Ok((self.via_candle && shape[2].is_multiple_of(QK_K)).then_some(GgmlDType::Q4K))
    }

    fn stacked_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<QTensor>> {
        if self.stacked_experts_format(prefix, proj, shape)?.is_none() {
            return Ok(None);
        }
        let bytes = q4k_experts(prefix, proj, self.dense.seed, self.dense.std, shape);
        Ok(Some(qtensor_from_ggml(
            GgmlDType::Q4K,
            &bytes,
            shape.to_vec(),
            device,
        )?))
    }

    fn stacked_gguf_block_format(
        &self,
        _prefix: &str,
        _proj: &str,
        shape: [usize; 3],
    ) -> Result<Option<GgufFormat>> {
        Ok((!self.via_candle && shape[2].is_multiple_of(QK_K)).then_some(GgufFormat::Q4K))
    }

    fn stacked_gguf_block_experts(
        &self,
        prefix: &str,
        proj: &str,
        shape: [usize; 3],
        device: &Device,
    ) -> Result<Option<StackedGgufBlocks>> {
        if self
            .stacked_gguf_block_format(prefix, proj, shape)?
            .is_none()
        {
            return Ok(None);
        }
        let [experts, out, inp] = shape;
        let bytes = q4k_experts(prefix, proj, self.dense.seed, self.dense.std, shape);
        let row = GgufFormat::Q4K.row_bytes(inp).expect("whole blocks");
        let blocks =
            Tensor::from_vec(bytes, (experts, out, row), &Device::Cpu)?.to_device(device)?;
        Ok(Some(StackedGgufBlocks::new(GgufFormat::Q4K, blocks, inp)?))
    }
}
