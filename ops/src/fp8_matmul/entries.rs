//! The backends of `fp8_matmul` (contract in `mod.rs`, dispatch rule in `weight_only.rs`).

use super::Fp8BlockWeight;
use crate::device::{DeviceDesc, DeviceFamily};
use crate::registry::{Arch, DeviceMatch, Reason};
use crate::weight_only::{
    self, Rows, WeightOnlyBackend, WeightOnlyChoice, WeightOnlyDispatchError, WeightShape,
};

/// The CUDA kernels read 16 weights per lane from one scale block, as one 16-byte load.
fn cuda_shape_reasons(shape: &WeightShape) -> Vec<Reason> {
    let mut reasons = Vec::new();
    if !shape.in_dim.is_multiple_of(16) {
        reasons.push(Reason::new("in", "a multiple of 16", shape.in_dim));
    }
    if !shape.block_in.is_multiple_of(16) {
        reasons.push(Reason::new(
            "weight_block_size[1]",
            "a multiple of 16",
            shape.block_in,
        ));
    }
    reasons
}

/// `fp8_matmul`'s backends: glm5's CUDA kernels (sm_90 and sm_120 SASS) and the CPU reference.
pub fn backends() -> Vec<WeightOnlyBackend> {
    vec![
        WeightOnlyBackend {
            name: "fp8-w8a16-cuda",
            description: "glm5's W8A16 kernels: a mat-vec streaming the FP8 bytes (dequantised in registers, f32 \
                          accumulation) up to MAX_ROWS rows; above, dequantise to the activations' dtype and \
                          use candle's matmul (FP8 tensor cores not used yet)",
            devices: DeviceMatch::Cuda(
                [9, 12]
                    .into_iter()
                    .map(|major| Arch { major, minor: None })
                    .collect(),
            ),
            rows: &Rows::ALL,
            priority: vec![(DeviceFamily::Sm120, 0), (DeviceFamily::Sm90, 0)],
            shape_reasons: cuda_shape_reasons,
        },
        WeightOnlyBackend {
            name: "fp8-reference-cpu",
            description: "the reference: dequantise to f32 block by block, then candle's matmul",
            devices: DeviceMatch::Cpu,
            rows: &Rows::ALL,
            priority: vec![(DeviceFamily::Cpu, 0)],
            shape_reasons: |_| vec![],
        },
    ]
}

/// The backends for `w` on `device` (decode and prefill rows).
pub fn dispatch(
    w: &Fp8BlockWeight,
    device: &DeviceDesc,
) -> Result<WeightOnlyChoice, WeightOnlyDispatchError> {
    let (out_dim, in_dim) = w.weight.dims2().unwrap_or((0, 0));
    let shape = WeightShape {
        out_dim,
        in_dim,
        block_in: w.block[1],
    };
    weight_only::dispatch_rows("fp8_matmul", backends(), &shape, device)
}
