//! The backends of `gguf_matmul` (contract in `mod.rs`, dispatch rule in `weight_only.rs`).

use super::{GgufWeight, SUB_BLOCK};
use crate::device::{DeviceDesc, DeviceFamily};
use crate::registry::{Arch, DeviceMatch, Reason};
use crate::weight_only::{
    self, Rows, WeightOnlyBackend, WeightOnlyChoice, WeightOnlyDispatchError, WeightShape,
};

/// `gguf_matmul`'s backends: glm5's CUDA kernels (sm_90 and sm_120 SASS) and the CPU reference.
pub fn backends() -> Vec<WeightOnlyBackend> {
    vec![
        WeightOnlyBackend {
            name: "gguf-w16-cuda",
            description: "glm5's GGUF block kernels (i-quants, K-quants): a mat-vec decoding the blocks in \
                          registers (f32 accumulation) up to MAX_ROWS rows, Q4_K's 2..MAX_ROWS bf16 rows on \
                          the tensor cores and one bf16 row on the int8 ones (x quantised as q8_1); above, dequantise to the activations' dtype and use candle's \
                          matmul",
            devices: DeviceMatch::Cuda(
                [9, 12]
                    .into_iter()
                    .map(|major| Arch { major, minor: None })
                    .collect(),
            ),
            priority: vec![(DeviceFamily::Sm120, 0), (DeviceFamily::Sm90, 0)],
            rows: &Rows::ALL,
            // One lane decodes one 32-value sub-block; a row is whole blocks.
            shape_reasons: |shape| {
                if shape.in_dim.is_multiple_of(shape.block_in) && shape.block_in.is_multiple_of(SUB_BLOCK) {
                    vec![]
                } else {
                    vec![Reason::new(
                        "in",
                        format!("a multiple of the block ({})", shape.block_in),
                        shape.in_dim.to_string(),
                    )]
                }
            },
            runtime_reasons: |_| vec![],
        },
        WeightOnlyBackend {
            name: "gguf-reference-cpu",
            description: "the reference: decode to f32 as ggml does, then candle's matmul",
            devices: DeviceMatch::Cpu,
            priority: vec![(DeviceFamily::Cpu, 0)],
            rows: &Rows::ALL,
            shape_reasons: |_| vec![],
            runtime_reasons: |_| vec![],
        },
    ]
}

/// The backends for `w` on `device` (decode and prefill rows).
pub fn dispatch(
    w: &GgufWeight,
    device: &DeviceDesc,
) -> Result<WeightOnlyChoice, WeightOnlyDispatchError> {
    let (out_dim, in_dim) = w.dims().unwrap_or((0, 0));
    let shape = WeightShape {
        out_dim,
        in_dim,
        block_in: w.format.block_values(),
        block_out: 1,
    };
    weight_only::dispatch_rows("gguf_matmul", backends(), &shape, device)
}
