//! dsa_indexer's backends in the registry: what each serves and its rank per device family.

use candle_core::DType;

use super::{dsa_indexer_cuda, dsa_indexer_reference, limits};
use crate::index_keys::KeyFormat;

/// dsa_indexer's backends in the registry (`registry.rs`): glm5's CUDA kernels (bf16 mma.sync scores for
/// up to 32 heads of width 16/32/64/128, an f32 FMA variant, exact radix top-k; fatbin for cc 9.0 and 12.x)
/// and the candle-ops reference (any device, slow).
pub(crate) fn registry_entries() -> Vec<crate::registry::Entry> {
    use crate::device::DeviceFamily::{Cpu, OtherCuda, Sm120, Sm90};
    use crate::registry::{Arch, DeviceMatch, Entry, Kernel, Limit, Serves};
    let kernel_archs = DeviceMatch::Cuda(vec![
        Arch {
            major: 9,
            minor: Some(0),
        },
        Arch {
            major: 12,
            minor: None,
        },
    ]);
    vec![
        Entry {
            name: "cuda-bf16-mma",
            description:
                "glm5 CUDA kernel: mma.sync scores over bf16 (or FP8) keys (wgmma on sm_90 for FP8 \
                          pages of 64 with 17-32 heads), exact radix top-k",
            kernel: Kernel::DsaIndexer(dsa_indexer_cuda),
            serves: Serves {
                devices: kernel_archs.clone(),
                dtypes: vec![DType::BF16],
                heads: Limit::Range {
                    min: 1,
                    max: limits::MMA_MAX_HEADS,
                },
                head_dims: Limit::OneOf(limits::MMA_HEAD_DIMS.to_vec()),
                value_dims: Limit::Any,
                top_k: Limit::Range {
                    min: 1,
                    max: i32::MAX as usize,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![KeyFormat::Float, KeyFormat::Fp8E4m3],
            },
            extra_check: None,
            priority: vec![(Sm120, 10), (Sm90, 10)],
        },
        Entry {
            name: "cuda-f32-fma",
            description: "glm5 CUDA kernel: f32 FMA scores, exact radix top-k",
            kernel: Kernel::DsaIndexer(dsa_indexer_cuda),
            serves: Serves {
                devices: kernel_archs,
                dtypes: vec![DType::F32],
                heads: Limit::Any,
                head_dims: Limit::Any,
                value_dims: Limit::Any,
                top_k: Limit::Range {
                    min: 1,
                    max: i32::MAX as usize,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                // FP8 keys are scored by the bf16 mma kernel.
                key_formats: vec![KeyFormat::Float],
            },
            extra_check: None,
            priority: vec![(Sm120, 20), (Sm90, 20)],
        },
        Entry {
            name: "reference",
            description: "candle tensor ops for the scores, host top-k (any device, slow)",
            kernel: Kernel::DsaIndexer(dsa_indexer_reference),
            serves: Serves::anything(),
            extra_check: None,
            priority: vec![(Sm120, 100), (Sm90, 100), (OtherCuda, 100), (Cpu, 100)],
        },
    ]
}
