//! The backends of `nvfp4_matmul` (contract in `mod.rs`, dispatch rule in `weight_only.rs`).

use super::{Nvfp4Weight, GROUP};
use crate::device::{DeviceDesc, DeviceFamily};
use crate::registry::{Arch, DeviceMatch, Reason};
use crate::weight_only::{self, WeightOnlyBackend, WeightOnlyDispatchError, WeightShape};

/// `nvfp4_matmul`'s backends: glm5's CUDA kernels (sm_90 and sm_120 SASS) and the CPU reference.
pub fn backends() -> Vec<WeightOnlyBackend> {
    vec![
        WeightOnlyBackend {
            name: "nvfp4-w4a16-cuda",
            description: "glm5's W4A16 kernels: a mat-vec streaming the packed e2m1 bytes and e4m3 scales \
                          (dequantised in registers, f32 accumulation) up to MAX_ROWS rows; above, dequantise \
                          to the activations' dtype and use candle's matmul (sm_120's FP4 MMA not used yet)",
            devices: DeviceMatch::Cuda(
                [9, 12]
                    .into_iter()
                    .map(|major| Arch { major, minor: None })
                    .collect(),
            ),
            priority: vec![(DeviceFamily::Sm120, 0), (DeviceFamily::Sm90, 0)],
            // One lane reads one group: 8 packed bytes and its scale.
            shape_reasons: |shape| {
                if shape.block_in == GROUP && shape.in_dim.is_multiple_of(GROUP) {
                    vec![]
                } else {
                    vec![Reason::new(
                        "group size and in",
                        format!("{GROUP} and a multiple of {GROUP}"),
                        format!("{} and {}", shape.block_in, shape.in_dim),
                    )]
                }
            },
        },
        WeightOnlyBackend {
            name: "nvfp4-reference-cpu",
            description: "the reference: unpack and dequantise to f32, then candle's matmul",
            devices: DeviceMatch::Cpu,
            priority: vec![(DeviceFamily::Cpu, 0)],
            shape_reasons: |_| vec![],
        },
    ]
}

/// The backend for `w` on `device`.
pub fn dispatch(
    w: &Nvfp4Weight,
    device: &DeviceDesc,
) -> Result<WeightOnlyBackend, WeightOnlyDispatchError> {
    let (out_dim, in_dim) = w.dims().unwrap_or((0, 0));
    let shape = WeightShape {
        out_dim,
        in_dim,
        block_in: GROUP,
    };
    weight_only::dispatch("nvfp4_matmul", backends(), &shape, device)
}
