//! The quantised-matmul backends and the dispatch rule for them: the registry's contract (`registry.rs`)
//! with the weight's block format in place of the attention ops' shapes. Each backend declares the devices
//! and formats it serves; [`QuantizedBackend::validate`] answers with every reason it cannot serve a weight;
//! [`dispatch`] takes the first valid backend in the device family's priority order.

use candle_core::quantized::GgmlDType;

use super::CANDLE_FORMATS;
use crate::device::{DeviceDesc, DeviceFamily, DeviceKind};
use crate::registry::{Arch, DeviceMatch, Reason};

/// One implementation of `quantized_matmul`.
#[derive(Debug, Clone)]
pub struct QuantizedBackend {
    pub name: &'static str,
    pub description: &'static str,
    pub devices: DeviceMatch,
    pub formats: Vec<GgmlDType>,
    /// Rank per device family, lower first; a family not listed does not use it.
    pub priority: Vec<(DeviceFamily, u32)>,
}

impl QuantizedBackend {
    /// `Ok` if this backend multiplies by a `format` weight on `device`, else every reason it does not.
    pub fn validate(&self, format: GgmlDType, device: &DeviceDesc) -> Result<(), Vec<Reason>> {
        let mut reasons = Vec::new();
        match (&self.devices, device.kind) {
            (DeviceMatch::Any, _) | (DeviceMatch::Cpu, DeviceKind::Cpu) => {}
            (DeviceMatch::Cpu, DeviceKind::Cuda { .. }) => {
                reasons.push(Reason::new("device", "cpu", &device.name))
            }
            (DeviceMatch::Cuda(archs), DeviceKind::Cuda { capability, .. }) => {
                if !archs.iter().any(|a| {
                    a.major == capability.major && a.minor.is_none_or(|m| m == capability.minor)
                }) {
                    let list: Vec<String> = archs.iter().map(ToString::to_string).collect();
                    reasons.push(Reason::new(
                        "compute capability",
                        format!("∈ {{{}}}", list.join(",")),
                        format!("{}.{}", capability.major, capability.minor),
                    ));
                }
            }
            (DeviceMatch::Cuda(_), DeviceKind::Cpu) => {
                reasons.push(Reason::new("device", "CUDA", "cpu"))
            }
        }
        if !self.formats.contains(&format) {
            let names: Vec<String> = self.formats.iter().map(|f| format!("{f:?}")).collect();
            reasons.push(Reason::new(
                "weight format",
                format!("∈ {{{}}}", names.join(",")),
                format!("{format:?}"),
            ));
        }
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons)
        }
    }
}

/// glm5's quantised-matmul backends: candle's kernels on each device kind.
pub fn backends() -> Vec<QuantizedBackend> {
    vec![
        QuantizedBackend {
            name: "candle-qmatmul-cuda",
            description: "candle's CUDA quantised kernels: mat-vec (Q8_1 activations) up to 8 rows, MMQ above",
            devices: DeviceMatch::Cuda(
                [8, 9, 10, 12]
                    .into_iter()
                    .map(|major| Arch { major, minor: None })
                    .collect(),
            ),
            formats: CANDLE_FORMATS.to_vec(),
            priority: vec![
                (DeviceFamily::Sm120, 0),
                (DeviceFamily::Sm90, 0),
                (DeviceFamily::OtherCuda, 0),
            ],
        },
        QuantizedBackend {
            name: "candle-qmatmul-cpu",
            description: "candle's CPU quantised vec-dot (Q8_0/Q8_K activations)",
            devices: DeviceMatch::Cpu,
            formats: CANDLE_FORMATS.to_vec(),
            priority: vec![(DeviceFamily::Cpu, 0)],
        },
    ]
}

/// Why no backend multiplies by a weight: every backend's reasons.
#[derive(Debug, Clone, thiserror::Error)]
#[error("no quantized_matmul backend for {format:?} weights on {device}: {}", reasons_text(.rejections))]
pub struct QuantizedDispatchError {
    pub format: GgmlDType,
    pub device: String,
    pub rejections: Vec<(&'static str, Vec<Reason>)>,
}

fn reasons_text(rejections: &[(&'static str, Vec<Reason>)]) -> String {
    rejections
        .iter()
        .map(|(name, reasons)| {
            let list: Vec<String> = reasons.iter().map(ToString::to_string).collect();
            format!("{name}: {}", list.join("; "))
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The backend for a `format` weight on `device`: the first valid one in the family's priority order.
pub fn dispatch(
    format: GgmlDType,
    device: &DeviceDesc,
) -> Result<QuantizedBackend, QuantizedDispatchError> {
    let family = device.family();
    let mut all = backends();
    all.sort_by_key(|b| {
        b.priority
            .iter()
            .find(|(f, _)| *f == family)
            .map_or(u32::MAX, |&(_, rank)| rank)
    });
    let mut rejections = Vec::new();
    for backend in all {
        let listed = backend.priority.iter().any(|(f, _)| *f == family);
        match backend.validate(format, device) {
            Ok(()) if listed => return Ok(backend),
            Ok(()) => rejections.push((
                backend.name,
                vec![Reason::new(
                    "device family",
                    "listed in its priority",
                    format!("{family:?}"),
                )],
            )),
            Err(reasons) => rejections.push((backend.name, reasons)),
        }
    }
    Err(QuantizedDispatchError {
        format,
        device: device.name.clone(),
        rejections,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_candle_format_has_a_cpu_backend_and_others_get_reasons() {
        let cpu = DeviceDesc::cpu(1 << 30);
        for format in CANDLE_FORMATS {
            assert_eq!(dispatch(format, &cpu).unwrap().name, "candle-qmatmul-cpu");
        }
        let err = dispatch(GgmlDType::Q8_1, &cpu).unwrap_err();
        assert_eq!(err.rejections.len(), 2);
        assert!(err.to_string().contains("weight format"), "{err}");
        assert!(
            err.to_string()
                .contains("candle-qmatmul-cuda: needs device CUDA"),
            "{err}"
        );
    }

    #[test]
    fn cuda_devices_get_the_cuda_backend() {
        let h200 = DeviceDesc::assume("sm_90:141GB", 0).unwrap();
        let pro6000 = DeviceDesc::assume("sm_120:96GB", 0).unwrap();
        for device in [h200, pro6000] {
            assert_eq!(
                dispatch(GgmlDType::Q4K, &device).unwrap().name,
                "candle-qmatmul-cuda"
            );
        }
    }
}
