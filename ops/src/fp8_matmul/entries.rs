//! The backends of `fp8_matmul` (contract in `mod.rs`, dispatch rule in `weight_only.rs`).

use super::{Fp8BlockWeight, W8A8_GROUP};
use crate::device::{DeviceDesc, DeviceFamily, DeviceKind};
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

/// The W8A8 backend's name (prefill rows on sm_90, cuBLASLt's block-scaled FP8 GEMM).
pub const W8A8_CUBLASLT_BLOCK: &str = "fp8-w8a8-cublaslt-block";

/// The first cuBLASLt with the 128-element block-scaled FP8 modes (`VEC128_32F`, `BLK128x128_32F`): 12.9, as
/// `cublasLtGetVersion` counts (major · 10000 + minor · 100 + patch).
pub const MIN_CUBLASLT_VERSION: usize = 120900;

/// `major.minor.patch` of a `cublasLtGetVersion` number.
pub(crate) fn version_text(version: usize) -> String {
    format!(
        "{}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    )
}

/// What cuBLASLt's block-scaled FP8 GEMM takes (cuBLAS documentation, `cublasLtMatmul()`: "To use tensor- or
/// block-scaled FP8 kernels", and "128-element 1D and 128x128 2D Block Scaling For FP8 Data Types"): the
/// weight's blocks are the 128 x 128 of `BLK128x128_32F`; `in` whole groups of the activations' 128-value
/// scales (glm5's quantiser takes whole groups); `out` (cuBLAS's M) a multiple of 4 for the scale layouts
/// and 16-byte aligned as an FP8 dimension, and its bf16 output rows 16-byte aligned: a multiple of 16
/// covers all three (PyTorch's `_scaled_mm` asks the same of its operands). A partial 128-row block at the
/// weight's edge (`kv_a_proj_with_mqa`'s 576 rows) is within the documented layout (`ceil(M / 128)` blocks).
pub(crate) fn w8a8_shape_reasons(shape: &WeightShape) -> Vec<Reason> {
    let mut reasons = Vec::new();
    if [shape.block_out, shape.block_in] != [W8A8_GROUP, W8A8_GROUP] {
        reasons.push(Reason::new(
            "weight_block_size",
            format!("[{W8A8_GROUP}, {W8A8_GROUP}] (cuBLASLt's BLK128x128_32F)"),
            format!("[{}, {}]", shape.block_out, shape.block_in),
        ));
    }
    if !shape.in_dim.is_multiple_of(W8A8_GROUP) {
        reasons.push(Reason::new(
            "in",
            format!("a multiple of {W8A8_GROUP} (whole activation groups)"),
            shape.in_dim,
        ));
    }
    if !shape.out_dim.is_multiple_of(16) {
        reasons.push(Reason::new(
            "out",
            "a multiple of 16 (cuBLASLt's FP8 alignment)",
            shape.out_dim,
        ));
    }
    if shape.in_dim > i32::MAX as usize || shape.out_dim > i32::MAX as usize {
        reasons.push(Reason::new(
            "out and in",
            "below 2^31",
            format!("{} and {}", shape.out_dim, shape.in_dim),
        ));
    }
    reasons
}

/// On a CUDA device of this process (not an assumed one, whose machine's library is unknown): the cuBLASLt
/// this process runs must have the 128-element block-scaled FP8 modes.
fn w8a8_runtime_reasons(device: &DeviceDesc) -> Vec<Reason> {
    if device.assumed || !matches!(device.kind, DeviceKind::Cuda { .. }) {
        return vec![];
    }
    match super::cublaslt_version() {
        Some(version) if version >= MIN_CUBLASLT_VERSION => vec![],
        Some(version) => vec![Reason::new(
            "cuBLASLt",
            format!(
                ">= {} (the 128-element block-scaled FP8 modes)",
                version_text(MIN_CUBLASLT_VERSION)
            ),
            version_text(version),
        )],
        None => vec![Reason::new(
            "cuBLASLt",
            "a build with the `cuda` feature",
            "none",
        )],
    }
}

/// `fp8_matmul`'s backends: glm5's CUDA kernels (sm_90 and sm_120 SASS), cuBLASLt's block-scaled FP8 GEMM
/// for prefill rows on sm_90 (W8A8), and the CPU reference.
pub fn backends() -> Vec<WeightOnlyBackend> {
    vec![
        WeightOnlyBackend {
            name: W8A8_CUBLASLT_BLOCK,
            description: "W8A8, which changes the numerics (module contract): the activations quantised on the \
                          GPU to e4m3 with an f32 scale per token and 128 values (glm5's kernel), then \
                          cuBLASLt's block-scaled FP8 GEMM on the FP8 tensor cores (VEC128_32F activation \
                          scales, the weight's 128x128 BLK128x128_32F scales, f32 block sums); prefill rows \
                          only; compute capability 9.0 only (where NVIDIA documents these scaling modes), \
                          cuBLASLt >= 12.9; on the H200 2.6x W8A16's prefill over GLM-5's FP8 projections \
                          (`glm5-bench fp8-prefill`)",
            devices: DeviceMatch::Cuda(vec![Arch {
                major: 9,
                minor: Some(0),
            }]),
            rows: &[Rows::Prefill],
            // First for prefill rows on sm_90: the FP8 tensor cores at 2.6x the dequantise + bf16 GEMM.
            priority: vec![(DeviceFamily::Sm90, 0)],
            shape_reasons: w8a8_shape_reasons,
            runtime_reasons: w8a8_runtime_reasons,
        },
        WeightOnlyBackend {
            name: "fp8-w8a16-cuda",
            description: "glm5's W8A16 kernels: a mat-vec streaming the FP8 bytes (dequantised in registers, f32 \
                          accumulation) up to MAX_ROWS rows; above, dequantise to the activations' dtype and \
                          use candle's matmul (bf16 or f32 tensor cores)",
            devices: DeviceMatch::Cuda(
                [9, 12]
                    .into_iter()
                    .map(|major| Arch { major, minor: None })
                    .collect(),
            ),
            rows: &Rows::ALL,
            priority: vec![(DeviceFamily::Sm120, 0), (DeviceFamily::Sm90, 1)],
            shape_reasons: cuda_shape_reasons,
            runtime_reasons: |_| vec![],
        },
        WeightOnlyBackend {
            name: "fp8-reference-cpu",
            description: "the reference: dequantise to f32 block by block, then candle's matmul",
            devices: DeviceMatch::Cpu,
            rows: &Rows::ALL,
            priority: vec![(DeviceFamily::Cpu, 0)],
            shape_reasons: |_| vec![],
            runtime_reasons: |_| vec![],
        },
    ]
}

/// The backends for `w` on `device`, one for decode rows and one for prefill rows ([`super::Fp8Prefill::of`]
/// tells `fp8_matmul_with` which prefill path that is).
pub fn dispatch(
    w: &Fp8BlockWeight,
    device: &DeviceDesc,
) -> Result<WeightOnlyChoice, WeightOnlyDispatchError> {
    let (out_dim, in_dim) = w.weight.dims2().unwrap_or((0, 0));
    let shape = WeightShape {
        out_dim,
        in_dim,
        block_in: w.block[1],
        block_out: w.block[0],
    };
    weight_only::dispatch_rows("fp8_matmul", backends(), &shape, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight_only::dispatch as dispatch_for;

    fn shape(out_dim: usize, in_dim: usize) -> WeightShape {
        WeightShape {
            out_dim,
            in_dim,
            block_in: W8A8_GROUP,
            block_out: W8A8_GROUP,
        }
    }

    fn choose(device: &str, shape: &WeightShape, rows: Rows) -> Result<&'static str, String> {
        let device = DeviceDesc::assume(device, 0).expect("device description");
        dispatch_for("fp8_matmul", backends(), shape, &device, rows)
            .map(|b| b.name)
            .map_err(|e| e.to_string())
    }

    fn w8a8() -> WeightOnlyBackend {
        let backend = backends().remove(0);
        assert_eq!(backend.name, W8A8_CUBLASLT_BLOCK);
        backend
    }

    #[test]
    fn w8a8_is_chosen_for_prefill_on_sm90_only() {
        // q_a_proj's shape ([q_lora_rank, hidden]); GLM-5's sizes are checked against the config in
        // tests/fp8_w8a8.rs.
        let glm = shape(2048, 6144);
        let sm90 = DeviceDesc::assume("sm_90:141GB", 0).unwrap();
        assert!(w8a8().validate(&glm, &sm90, Rows::Prefill).is_ok());
        assert_eq!(
            choose("sm_90:141GB", &glm, Rows::Prefill),
            Ok(W8A8_CUBLASLT_BLOCK)
        );
        assert_eq!(
            choose("sm_90:141GB", &glm, Rows::Decode),
            Ok("fp8-w8a16-cuda")
        );
        assert_eq!(
            choose("sm_120:96GB", &glm, Rows::Prefill),
            Ok("fp8-w8a16-cuda")
        );
        assert_eq!(
            choose("cpu:64GB", &glm, Rows::Prefill),
            Ok("fp8-reference-cpu")
        );
        // kv_a_proj_with_mqa: 576 rows, a partial block at the edge, within cuBLASLt's documented layout.
        assert!(w8a8()
            .validate(&shape(576, 6144), &sm90, Rows::Prefill)
            .is_ok());
    }

    #[test]
    fn w8a8_rejections_name_the_arch_rows_blocks_and_alignment() {
        let device = |spec: &str| DeviceDesc::assume(spec, 0).unwrap();
        let glm = shape(2048, 6144);
        for spec in ["sm_120:96GB", "sm_100:180GB"] {
            let reasons = w8a8()
                .validate(&glm, &device(spec), Rows::Prefill)
                .unwrap_err();
            assert_eq!(reasons.len(), 1, "{reasons:?}");
            let text = reasons[0].to_string();
            assert!(text.contains("9.0"), "{text}");
        }
        let decode = w8a8()
            .validate(&glm, &device("sm_90:141GB"), Rows::Decode)
            .unwrap_err();
        assert!(decode[0].to_string().contains("prefill"), "{}", decode[0]);
        let odd = WeightShape {
            out_dim: 100,
            in_dim: 48,
            block_in: 16,
            block_out: 32,
        };
        let reasons = w8a8()
            .validate(&odd, &device("sm_90:141GB"), Rows::Prefill)
            .unwrap_err();
        let text: Vec<String> = reasons.iter().map(ToString::to_string).collect();
        assert_eq!(text.len(), 3, "{text:?}");
        assert!(text[0].contains("weight_block_size") && text[0].contains("[32, 16]"));
        assert!(text[1].contains("in") && text[1].contains("48"));
        assert!(text[2].contains("out") && text[2].contains("100"));
        // An assumed device describes hardware, not this process's libraries: no cuBLASLt reason.
        assert!(w8a8_runtime_reasons(&device("sm_90:141GB")).is_empty());
    }

    #[test]
    fn version_text_reads_cublaslt_numbers() {
        assert_eq!(version_text(MIN_CUBLASLT_VERSION), "12.9.0");
        assert_eq!(version_text(130_002), "13.0.2");
    }
}
