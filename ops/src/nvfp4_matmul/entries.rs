//! The backends of `nvfp4_matmul` (contract in `mod.rs`, dispatch rule in `weight_only.rs`).

use super::{Nvfp4Weight, GROUP};
use crate::device::{DeviceDesc, DeviceFamily};
use crate::registry::{Arch, DeviceMatch, Reason};
use crate::weight_only::{
    self, Rows, WeightOnlyBackend, WeightOnlyChoice, WeightOnlyDispatchError, WeightShape,
};
use glm5_kernels::interface::nvfp4_mma;

/// The W4A4 backend's name (prefill rows on sm_120).
pub const W4A4_MMA_SM120: &str = "nvfp4-w4a4-mma-sm120";

/// One lane of the mat-vec reads one group: 8 packed bytes and its scale.
fn w4a16_shape_reasons(shape: &WeightShape) -> Vec<Reason> {
    if shape.block_in == GROUP && shape.in_dim.is_multiple_of(GROUP) {
        vec![]
    } else {
        vec![Reason::new(
            "group size and in",
            format!("{GROUP} and a multiple of {GROUP}"),
            format!("{} and {}", shape.block_in, shape.in_dim),
        )]
    }
}

/// The GEMM takes K in tiles of `TILE_K` values (64 code bytes and 8 scale bytes a row, 8-byte aligned).
fn w4a4_shape_reasons(shape: &WeightShape) -> Vec<Reason> {
    let mut reasons = Vec::new();
    if shape.block_in != nvfp4_mma::GROUP {
        reasons.push(Reason::new("group size", nvfp4_mma::GROUP, shape.block_in));
    }
    if !shape.in_dim.is_multiple_of(nvfp4_mma::TILE_K) {
        reasons.push(Reason::new(
            "in",
            format!("a multiple of {}", nvfp4_mma::TILE_K),
            shape.in_dim,
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

/// `nvfp4_matmul`'s backends: glm5's CUDA kernels (W4A16 on sm_90 and sm_120; W4A4 for prefill rows on
/// sm_120) and the CPU reference.
pub fn backends() -> Vec<WeightOnlyBackend> {
    vec![
        WeightOnlyBackend {
            name: W4A4_MMA_SM120,
            description: "W4A4, which changes the numerics (module contract): the activations quantised on \
                          the GPU to NVFP4 (e2m1 codes, an e4m3 scale per 16 values, an f32 scale per row), \
                          then a tiled GEMM on sm_120a's block-scaled FP4 tensor-core MMA (mma.sync m16n8k64 \
                          kind::mxf4nvf4, ue4m3 scales per 16, f32 accumulation), both global scales applied \
                          after the sum; prefill rows only; sm_120a SASS only, not yet run on sm_120 hardware",
            devices: DeviceMatch::Cuda(vec![Arch {
                major: 12,
                minor: Some(0),
            }]),
            rows: &[Rows::Prefill],
            // Below W4A16 until it has run on sm_120 hardware: valid there, but chosen only when pinned
            // (`nvfp4_matmul_with(.., Prefill::W4a4Sm120)`).
            priority: vec![(DeviceFamily::Sm120, 1)],
            shape_reasons: w4a4_shape_reasons,
            runtime_reasons: |_| vec![],
        },
        WeightOnlyBackend {
            name: "nvfp4-w4a16-cuda",
            description: "glm5's W4A16 kernels: a mat-vec streaming the packed e2m1 bytes and e4m3 scales \
                          (dequantised in registers, f32 accumulation) up to MAX_ROWS rows; above, dequantise \
                          to the activations' dtype and use candle's matmul",
            devices: DeviceMatch::Cuda(
                [9, 12]
                    .into_iter()
                    .map(|major| Arch { major, minor: None })
                    .collect(),
            ),
            rows: &Rows::ALL,
            priority: vec![(DeviceFamily::Sm120, 0), (DeviceFamily::Sm90, 0)],
            shape_reasons: w4a16_shape_reasons,
            runtime_reasons: |_| vec![],
        },
        WeightOnlyBackend {
            name: "nvfp4-reference-cpu",
            description: "the reference: unpack and dequantise to f32, then candle's matmul",
            devices: DeviceMatch::Cpu,
            rows: &Rows::ALL,
            priority: vec![(DeviceFamily::Cpu, 0)],
            shape_reasons: |_| vec![],
            runtime_reasons: |_| vec![],
        },
    ]
}

/// The backends for `w` on `device`, one for decode rows and one for prefill rows ([`super::Prefill::of`]
/// tells `nvfp4_matmul_with` which prefill path that is).
pub fn dispatch(
    w: &Nvfp4Weight,
    device: &DeviceDesc,
) -> Result<WeightOnlyChoice, WeightOnlyDispatchError> {
    let (out_dim, in_dim) = w.dims().unwrap_or((0, 0));
    let shape = WeightShape {
        out_dim,
        in_dim,
        block_in: GROUP,
        block_out: 1,
    };
    weight_only::dispatch_rows("nvfp4_matmul", backends(), &shape, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight_only::dispatch as dispatch_for;

    fn shape(out_dim: usize, in_dim: usize) -> WeightShape {
        WeightShape {
            out_dim,
            in_dim,
            block_in: GROUP,
            block_out: 1,
        }
    }

    fn choose(device: &str, shape: &WeightShape, rows: Rows) -> Result<&'static str, String> {
        let device = DeviceDesc::assume(device, 0).expect("device description");
        dispatch_for("nvfp4_matmul", backends(), shape, &device, rows)
            .map(|b| b.name)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn w4a4_serves_prefill_rows_on_sm120_only() {
        let glm = shape(2048, 6144);
        // Valid for prefill on sm_120, but ranked below W4A16 until it has run on sm_120 hardware.
        let sm120 = DeviceDesc::assume("sm_120:96GB", 0).unwrap();
        assert!(backends()[0].validate(&glm, &sm120, Rows::Prefill).is_ok());
        assert_eq!(
            choose("sm_120:96GB", &glm, Rows::Prefill),
            Ok("nvfp4-w4a16-cuda")
        );
        assert_eq!(
            choose("sm_120:96GB", &glm, Rows::Decode),
            Ok("nvfp4-w4a16-cuda")
        );
        assert_eq!(
            choose("sm_90:141GB", &glm, Rows::Prefill),
            Ok("nvfp4-w4a16-cuda")
        );
        assert_eq!(
            choose("cpu:64GB", &glm, Rows::Prefill),
            Ok("nvfp4-reference-cpu")
        );
        // `in` not a multiple of the K tile: W4A16 serves it, and the reason names the tile.
        assert_eq!(
            choose("sm_120:96GB", &shape(24, 48), Rows::Prefill),
            Ok("nvfp4-w4a16-cuda")
        );
    }

    #[test]
    fn w4a4_rejections_name_the_arch_rows_and_tile() {
        let device = |spec: &str| DeviceDesc::assume(spec, 0).unwrap();
        let w4a4 = backends().remove(0);
        assert_eq!(w4a4.name, W4A4_MMA_SM120);
        let on_sm90 = w4a4
            .validate(&shape(2048, 6144), &device("sm_90:141GB"), Rows::Prefill)
            .unwrap_err();
        assert_eq!(on_sm90.len(), 1);
        let text = on_sm90[0].to_string();
        assert!(text.contains("12.0") && text.contains("9.0"), "{text}");
        let decode = w4a4
            .validate(&shape(2048, 6144), &device("sm_120:96GB"), Rows::Decode)
            .unwrap_err();
        assert!(decode[0].to_string().contains("prefill"), "{}", decode[0]);
        let narrow = w4a4
            .validate(&shape(24, 48), &device("sm_120:96GB"), Rows::Prefill)
            .unwrap_err();
        assert!(
            narrow[0]
                .to_string()
                .contains(&nvfp4_mma::TILE_K.to_string()),
            "{}",
            narrow[0]
        );
    }
}
