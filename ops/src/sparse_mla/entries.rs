//! sparse_mla's backends in the registry: what each serves (declared next to the function it runs, checked
//! by `Entry::validate`) and its rank per device family.

use candle_core::DType;

use super::{limits, sparse_mla_cuda, sparse_mla_cuda_wgmma, sparse_mla_reference};

/// Why a kernel that needs `needed` bytes of shared memory per block (described by `needs`) cannot run on
/// `device`; nothing on a CPU (the device match already rules a kernel out there).
fn shared_memory_reason(
    device: &crate::DeviceDesc,
    needed: usize,
    needs: String,
) -> Option<crate::registry::Reason> {
    match device.kind {
        crate::device::DeviceKind::Cuda {
            shared_memory_per_block,
            ..
        } if needed > shared_memory_per_block => Some(crate::registry::Reason::new(
            "shared memory per block",
            needs,
            format!("{shared_memory_per_block} B"),
        )),
        _ => None,
    }
}

/// sparse_mla's backends in the registry (`registry.rs`): glm5's bf16 tensor-core kernel and f32 kernel
/// (fatbin with SASS for sm_90 and sm_120 and compute_120 PTX: cc 9.0 and 12.x) and the candle-ops reference
/// (any device, slow).
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
            description: "glm5 CUDA kernel, bf16 mma.sync, top-k split with an lse combine",
            kernel: Kernel::SparseMla(sparse_mla_cuda),
            serves: Serves {
                devices: kernel_archs.clone(),
                dtypes: vec![DType::BF16],
                heads: Limit::Any,
                head_dims: Limit::MultipleOf(limits::ROW_MULTIPLE),
                value_dims: Limit::OneOf(limits::BF16_VALUE_DIMS.to_vec()),
                top_k: Limit::Range {
                    min: 1,
                    max: limits::BF16_MAX_TOP_K,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![crate::KeyFormat::Float],
            },
            extra_check: Some(|spec, device| {
                if device.is_cpu() {
                    return vec![]; // the device match already rejects it
                }
                let value_dim = spec.value_dim.unwrap_or(0);
                let mut reasons = vec![];
                if spec.head_dim > value_dim + limits::MAX_ROPE {
                    reasons.push(crate::registry::Reason::new(
                        "row width",
                        format!("≤ value width + {}", limits::MAX_ROPE),
                        format!("{} (value width {value_dim})", spec.head_dim),
                    ));
                }
                let needed = limits::bf16_shared_bytes(
                    1,
                    limits::warps_per_head_tile(value_dim),
                    spec.head_dim,
                    limits::MAX_TILES_PER_SPLIT,
                );
                reasons.extend(shared_memory_reason(
                    device,
                    needed,
                    format!("{needed} B for rows of {}", spec.head_dim),
                ));
                reasons
            }),
            priority: vec![(Sm120, 10), (Sm90, 10)],
        },
        Entry {
            name: "cuda-bf16-wgmma",
            description: "glm5 CUDA kernel, bf16 warpgroup MMA (Hopper only), 64-head groups over rows of 512 + 64",
            kernel: Kernel::SparseMla(sparse_mla_cuda_wgmma),
            serves: Serves {
                devices: DeviceMatch::Cuda(vec![Arch {
                    major: 9,
                    minor: Some(0),
                }]),
                dtypes: vec![DType::BF16],
                heads: Limit::MultipleOf(limits::WGMMA_HEADS),
                head_dims: Limit::OneOf(vec![limits::WGMMA_ROW_DIM]),
                value_dims: Limit::OneOf(vec![limits::WGMMA_VALUE_DIM]),
                top_k: Limit::Range {
                    min: 1,
                    max: limits::BF16_MAX_TOP_K,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![crate::KeyFormat::Float],
            },
            extra_check: Some(|_, device| {
                let needed = limits::wgmma_shared_bytes(limits::MAX_TILES_PER_SPLIT);
                shared_memory_reason(device, needed, format!("{needed} B")).into_iter().collect()
            }),
            priority: vec![(Sm90, 5)],
        },
        Entry {
            name: "cuda-f32-fma",
            description: "glm5 CUDA kernel, f32 FMA",
            kernel: Kernel::SparseMla(sparse_mla_cuda),
            serves: Serves {
                devices: kernel_archs,
                dtypes: vec![DType::F32],
                heads: Limit::Any,
                head_dims: Limit::MultipleOf(limits::ROW_MULTIPLE),
                value_dims: Limit::Any,
                top_k: Limit::Range {
                    min: 1,
                    max: i32::MAX as usize,
                },
                contiguous_cache: true,
                paged_block_sizes: Some(Limit::Any),
                key_formats: vec![crate::KeyFormat::Float],
            },
            extra_check: Some(|spec, device| {
                let needed = limits::f32_shared_bytes(spec.head_dim, spec.value_dim.unwrap_or(0));
                shared_memory_reason(device, needed, format!("{needed} B")).into_iter().collect()
            }),
            priority: vec![(Sm120, 20), (Sm90, 20)],
        },
        Entry {
            name: "reference",
            description: "candle tensor ops in f32, host-validated indices (any device, slow)",
            kernel: Kernel::SparseMla(sparse_mla_reference),
            serves: Serves::anything(),
            extra_check: None,
            priority: vec![(Sm120, 100), (Sm90, 100), (OtherCuda, 100), (Cpu, 100)],
        },
    ]
}
