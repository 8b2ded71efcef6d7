//! What the weight-only quantised matmuls (`fp8_matmul`: W8A16, `nvfp4_matmul`: W4A16) share: their
//! backends' declarations and the dispatch rule, the registry's contract (`registry.rs`) with the weight's
//! shape and block sizes in place of the attention ops' shapes. Each backend declares the devices it runs
//! on and checks the weight's shape ([`WeightOnlyBackend::validate`] answers with every reason it cannot
//! serve it); [`dispatch`] takes the first valid backend in the device family's priority order. The model
//! dispatches once per weight when its graph is built, so an unservable weight fails the build naming the
//! tensor; nothing falls back to expanding the weight silently.
//!
//! A backend may serve only some row counts of the activations ([`Rows`]: decode's few rows, served by a
//! mat-vec, or prefill's many, served by a GEMM), so a weight gets one backend per row class
//! ([`dispatch_rows`]: both at once, each with its own reasons). A backend that changes the numerics (the
//! NVFP4 W4A4 GEMM quantises the activations) says so in its description and in its op's contract.

use candle_core::{DType, Tensor};

use crate::device::{DeviceDesc, DeviceFamily, DeviceKind};
use crate::error::OpError;
use crate::registry::{DeviceMatch, Reason};

/// The shape facts of one quantised weight a backend may limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightShape {
    /// Rows of `[out, in]`.
    pub out_dim: usize,
    /// Columns of `[out, in]` (the reduction).
    pub in_dim: usize,
    /// Values sharing one scale along `in` (FP8: `weight_block_size[1]`; NVFP4: the group size).
    pub block_in: usize,
    /// Rows sharing one scale along `out` (FP8: `weight_block_size[0]`; formats scaled per row: 1).
    pub block_out: usize,
}

/// The activation row counts a backend is chosen for: up to `MAX_ROWS` rows (`glm5_kernels::interface::
/// weight_only::MAX_ROWS`, the mat-vec's limit) or more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rows {
    /// Up to `MAX_ROWS` rows: decode.
    Decode,
    /// More than `MAX_ROWS` rows: prefill.
    Prefill,
}

impl Rows {
    /// Both classes, in dispatch order.
    pub const ALL: [Rows; 2] = [Rows::Decode, Rows::Prefill];

    /// The class of `rows` activation rows.
    pub fn of(rows: usize) -> Self {
        if rows <= glm5_kernels::interface::weight_only::MAX_ROWS {
            Rows::Decode
        } else {
            Rows::Prefill
        }
    }
}

impl std::fmt::Display for Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let max = glm5_kernels::interface::weight_only::MAX_ROWS;
        match self {
            Rows::Decode => write!(f, "decode (<= {max} rows)"),
            Rows::Prefill => write!(f, "prefill (> {max} rows)"),
        }
    }
}

/// One implementation of a weight-only matmul.
#[derive(Debug, Clone)]
pub struct WeightOnlyBackend {
    pub name: &'static str,
    pub description: &'static str,
    pub devices: DeviceMatch,
    /// The row classes it serves.
    pub rows: &'static [Rows],
    /// Rank per device family, lower first; a family not listed does not use it.
    pub priority: Vec<(DeviceFamily, u32)>,
    /// Every reason the backend cannot multiply by a weight of this shape (empty: it can).
    pub shape_reasons: fn(&WeightShape) -> Vec<Reason>,
    /// Every reason beyond the compute capability that the backend cannot run on this device from this
    /// process (e.g. the version of a library it calls); called for every device, empty where nothing more
    /// is needed.
    pub runtime_reasons: fn(&DeviceDesc) -> Vec<Reason>,
}

impl WeightOnlyBackend {
    /// `Ok` if this backend multiplies `rows` activation rows by a weight of `shape` on `device`, else every
    /// reason it does not.
    pub fn validate(
        &self,
        shape: &WeightShape,
        device: &DeviceDesc,
        rows: Rows,
    ) -> Result<(), Vec<Reason>> {
        let mut reasons = device_reasons(&self.devices, device);
        if !self.rows.contains(&rows) {
            let served: Vec<String> = self.rows.iter().map(ToString::to_string).collect();
            reasons.push(Reason::new("rows", served.join(" or "), rows));
        }
        reasons.extend((self.shape_reasons)(shape));
        reasons.extend((self.runtime_reasons)(device));
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons)
        }
    }
}

/// Why `devices` does not include `device` (empty if it does).
pub(crate) fn device_reasons(devices: &DeviceMatch, device: &DeviceDesc) -> Vec<Reason> {
    match (devices, device.kind) {
        (DeviceMatch::Any, _) | (DeviceMatch::Cpu, DeviceKind::Cpu) => vec![],
        (DeviceMatch::Cpu, DeviceKind::Cuda { .. }) => {
            vec![Reason::new("device", "cpu", &device.name)]
        }
        (DeviceMatch::Cuda(archs), DeviceKind::Cuda { capability, .. }) => {
            if archs.iter().any(|a| {
                a.major == capability.major && a.minor.is_none_or(|m| m == capability.minor)
            }) {
                vec![]
            } else {
                let list: Vec<String> = archs.iter().map(ToString::to_string).collect();
                vec![Reason::new(
                    "compute capability",
                    format!("∈ {{{}}}", list.join(",")),
                    format!("{}.{}", capability.major, capability.minor),
                )]
            }
        }
        (DeviceMatch::Cuda(_), DeviceKind::Cpu) => vec![Reason::new("device", "CUDA", "cpu")],
    }
}

/// Why no backend of an op multiplies by a weight: every backend's reasons.
#[derive(Debug, Clone, thiserror::Error)]
#[error("no {op} backend for {rows} with a [{}, {}] weight (block {} along in) on {device}: {}",
    .shape.out_dim, .shape.in_dim, .shape.block_in, reasons_text(.rejections))]
pub struct WeightOnlyDispatchError {
    pub op: &'static str,
    pub shape: WeightShape,
    pub device: String,
    pub rows: Rows,
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

/// The backends chosen for one weight: one per row class.
#[derive(Debug, Clone)]
pub struct WeightOnlyChoice {
    pub decode: WeightOnlyBackend,
    pub prefill: WeightOnlyBackend,
}

impl WeightOnlyChoice {
    /// The backend for `rows`.
    pub fn for_rows(&self, rows: Rows) -> &WeightOnlyBackend {
        match rows {
            Rows::Decode => &self.decode,
            Rows::Prefill => &self.prefill,
        }
    }
}

/// The backends of `op` (among `backends`) for a weight of `shape` on `device`, one per row class
/// ([`dispatch`] each); an error if either class has none.
pub fn dispatch_rows(
    op: &'static str,
    backends: Vec<WeightOnlyBackend>,
    shape: &WeightShape,
    device: &DeviceDesc,
) -> Result<WeightOnlyChoice, WeightOnlyDispatchError> {
    Ok(WeightOnlyChoice {
        decode: dispatch(op, backends.clone(), shape, device, Rows::Decode)?,
        prefill: dispatch(op, backends, shape, device, Rows::Prefill)?,
    })
}

/// The backend of `op` (one of `backends`) for `rows` activation rows and a weight of `shape` on `device`:
/// the first valid one in the family's priority order.
pub fn dispatch(
    op: &'static str,
    mut backends: Vec<WeightOnlyBackend>,
    shape: &WeightShape,
    device: &DeviceDesc,
    rows: Rows,
) -> Result<WeightOnlyBackend, WeightOnlyDispatchError> {
    let family = device.family();
    let rank = |b: &WeightOnlyBackend| {
        b.priority
            .iter()
            .find(|(f, _)| *f == family)
            .map(|&(_, rank)| rank)
    };
    backends.sort_by_key(|b| rank(b).unwrap_or(u32::MAX));
    let mut rejections = Vec::new();
    for backend in backends {
        match (backend.validate(shape, device, rows), rank(&backend)) {
            (Ok(()), Some(_)) => return Ok(backend),
            (Ok(()), None) => rejections.push((
                backend.name,
                vec![Reason::new(
                    "device family",
                    "listed in its priority",
                    format!("{family:?}"),
                )],
            )),
            (Err(reasons), _) => rejections.push((backend.name, reasons)),
        }
    }
    Err(WeightOnlyDispatchError {
        op,
        shape: *shape,
        device: device.name.clone(),
        rows,
        rejections,
    })
}

/// What every weight-only matmul's public function does around its kernels: checks `x` is `[.., in]` for a
/// weight `[out, in]`, flattens it to `[rows, in]` in f32 or bf16 (f16 goes through f32), runs `product` on
/// that (which picks the device's kernels or the CPU reference) and gives `[.., out]` back in `x`'s dtype.
pub(crate) fn apply(
    op: &'static str,
    x: &Tensor,
    (out, inp): (usize, usize),
    product: impl FnOnce(&Tensor) -> crate::Result<Tensor>,
) -> crate::Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.last() != Some(&inp) {
        return Err(OpError::Shape {
            arg: "x",
            expected: format!("[.., {inp}]"),
            found: dims,
        });
    }
    if x.device().is_cuda() && !cfg!(feature = "cuda") {
        return Err(OpError::Unsupported(format!(
            "{op} on CUDA needs the `cuda` feature"
        )));
    }
    let rows = dims[..dims.len() - 1].iter().product::<usize>();
    let x2 = match x.dtype() {
        DType::F32 | DType::BF16 => x.reshape((rows, inp))?,
        DType::F16 => x.reshape((rows, inp))?.to_dtype(DType::F32)?,
        other => {
            return Err(OpError::NotFloat {
                arg: "x",
                found: other,
            })
        }
    };
    let y = product(&x2)?;
    let mut out_dims = dims;
    *out_dims.last_mut().expect("x has a last dim") = out;
    Ok(y.reshape(out_dims)?.to_dtype(x.dtype())?)
}
