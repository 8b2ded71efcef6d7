//! What the backend registry and the placement pass know about a device: its kind (CPU, or CUDA with a
//! compute capability), the memory glm5 may use on it and, for CUDA, the shared memory a kernel block may use.
//!
//! A [`DeviceDesc`] is either read from a real device ([`DeviceDesc::of`]) or *assumed* from a short
//! description (`sm_120:96GB`, `cpu:512GB`, [`DeviceDesc::assume`]) so that a plan can be made for hardware
//! this machine does not have. Assumed CUDA devices take the per-architecture shared-memory limit of
//! [`known_shared_memory`]; an assumed description never loads weights. This module only describes;
//! `probe.rs` asks real devices (through `cuda.rs` for CUDA ones).

use std::fmt;

/// Static shared memory glm5's kernels may declare besides the dynamic part: the dynamic limit a launch may
/// ask for is the device's opt-in limit less this.
pub const STATIC_SHARED_RESERVE: usize = 1024;

/// A CUDA compute capability, `major.minor` (sm_90 = 9.0, sm_120 = 12.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl ComputeCapability {
    /// Hopper (H100, H200).
    pub const SM90: Self = Self { major: 9, minor: 0 };
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// The groups a backend priority order is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceFamily {
    /// Blackwell workstation / consumer parts: RTX PRO 6000, RTX 5090 (cc 12.x).
    Sm120,
    /// Hopper: H100, H200 (cc 9.0).
    Sm90,
    /// Any other CUDA device.
    OtherCuda,
    Cpu,
}

impl DeviceFamily {
    pub const ALL: [DeviceFamily; 4] = [Self::Sm120, Self::Sm90, Self::OtherCuda, Self::Cpu];
}

impl fmt::Display for DeviceFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sm120 => "sm_120",
            Self::Sm90 => "sm_90",
            Self::OtherCuda => "other CUDA",
            Self::Cpu => "CPU",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda {
        ordinal: usize,
        capability: ComputeCapability,
        /// Dynamic shared memory one block may use (opt-in limit less [`STATIC_SHARED_RESERVE`]).
        shared_memory_per_block: usize,
    },
}

/// One device a plan places layers on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceDesc {
    /// `cpu` or `cuda:N` (assumed devices: `cuda:N` too, numbered in the order given).
    pub name: String,
    pub kind: DeviceKind,
    /// Bytes glm5 may fill with weights and KV cache on this device.
    pub memory_bytes: u64,
    /// Described from the command line rather than read from hardware: good for a plan, not for loading.
    pub assumed: bool,
}

/// Why a device description could not be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error("device {spec:?}: {reason}")]
    Invalid { spec: String, reason: String },
    #[error("{device}: {reason}")]
    Query { device: String, reason: String },
}

impl DeviceDesc {
    pub fn family(&self) -> DeviceFamily {
        match self.kind {
            DeviceKind::Cpu => DeviceFamily::Cpu,
            DeviceKind::Cuda { capability, .. } => match capability.major {
                12 => DeviceFamily::Sm120,
                9 if capability.minor == 0 => DeviceFamily::Sm90,
                _ => DeviceFamily::OtherCuda,
            },
        }
    }

    pub fn capability(&self) -> Option<ComputeCapability> {
        match self.kind {
            DeviceKind::Cuda { capability, .. } => Some(capability),
            DeviceKind::Cpu => None,
        }
    }

    pub fn is_cpu(&self) -> bool {
        self.kind == DeviceKind::Cpu
    }

    /// A CPU with `memory_bytes` usable.
    pub fn cpu(memory_bytes: u64) -> Self {
        Self {
            name: "cpu".into(),
            kind: DeviceKind::Cpu,
            memory_bytes,
            assumed: false,
        }
    }

    /// A CUDA device of compute capability `capability` with `memory_bytes` usable, numbered `ordinal`; its
    /// shared memory is the architecture's ([`known_shared_memory`]).
    pub fn assumed_cuda(ordinal: usize, capability: ComputeCapability, memory_bytes: u64) -> Self {
        Self {
            name: format!("cuda:{ordinal}"),
            kind: DeviceKind::Cuda {
                ordinal,
                capability,
                shared_memory_per_block: known_shared_memory(capability)
                    .saturating_sub(STATIC_SHARED_RESERVE),
            },
            memory_bytes,
            assumed: true,
        }
    }

    /// Parses `sm_120:96GB` (a CUDA device, numbered `ordinal`) or `cpu:512GB`; sizes as [`parse_bytes`].
    pub fn assume(spec: &str, ordinal: usize) -> Result<Self, DeviceError> {
        let invalid = |reason: &str| DeviceError::Invalid {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        let (kind, size) = spec
            .split_once(':')
            .ok_or_else(|| invalid("expected ARCH:SIZE, e.g. sm_120:96GB or cpu:512GB"))?;
        let memory_bytes = parse_bytes(size).ok_or_else(|| {
            invalid("the size must be a number with a unit: B, KB, MB, GB, TB (or KiB ... TiB)")
        })?;
        let kind = kind.trim().to_ascii_lowercase();
        if kind == "cpu" {
            return Ok(Self {
                assumed: true,
                ..Self::cpu(memory_bytes)
            });
        }
        let digits = kind
            .strip_prefix("sm_")
            .or_else(|| kind.strip_prefix("sm"))
            .filter(|d| (2..=3).contains(&d.len()) && d.chars().all(|c| c.is_ascii_digit()))
            .ok_or_else(|| {
                invalid("the architecture must be cpu or sm_XY (sm_75, sm_90, sm_120)")
            })?;
        let (major, minor) = digits.split_at(digits.len() - 1);
        let capability = ComputeCapability {
            major: major.parse().map_err(|_| invalid("bad architecture"))?,
            minor: minor.parse().map_err(|_| invalid("bad architecture"))?,
        };
        Ok(Self::assumed_cuda(ordinal, capability, memory_bytes))
    }
}

impl fmt::Display for DeviceDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Cpu => write!(f, "{}", self.name)?,
            DeviceKind::Cuda { capability, .. } => write!(f, "{} ({capability})", self.name)?,
        }
        if self.assumed {
            write!(f, " [assumed]")?;
        }
        Ok(())
    }
}

/// Opt-in shared memory per block by architecture (CUDA programming guide, "Compute Capabilities" table).
pub fn known_shared_memory(capability: ComputeCapability) -> usize {
    const KIB: usize = 1024;
    match (capability.major, capability.minor) {
        (7, 0) | (7, 2) => 96 * KIB,
        (7, 5) => 64 * KIB,
        (8, 0) | (8, 7) => 163 * KIB,
        (8, _) => 99 * KIB,
        (9, 0) | (10, _) => 227 * KIB,
        (12, _) => 99 * KIB,
        _ => 48 * KIB,
    }
}

/// A memory size → bytes: `96GB`, `1.5TB`, `80GiB`, `1024B`. Units are binary, `KB` = `KiB` = 1024 B and so
/// on, as memory is sold: a "96 GB" RTX PRO 6000 reports 97,887 MiB, a "141 GB" H200 143,771 MiB.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().ok()?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "b" => 1.0,
        "kb" | "k" | "kib" => 1024.0,
        "mb" | "m" | "mib" => 1024f64.powi(2),
        "gb" | "g" | "gib" => 1024f64.powi(3),
        "tb" | "t" | "tib" => 1024f64.powi(4),
        _ => return None,
    };
    let bytes = number * scale;
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes.round() as u64)
}
