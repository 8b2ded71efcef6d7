//! What a real device is: [`DeviceDesc::of`] asks the driver (CUDA: `cuda.rs`) or the OS (CPU). Kept apart
//! from `device.rs`, which only describes devices, so that the description does not depend on the driver
//! layer that depends on it.

use crate::device::{DeviceDesc, DeviceError};

impl DeviceDesc {
    /// Describes a real candle device: its compute capability, shared memory and free memory (CUDA), or the
    /// available system memory (CPU, `MemAvailable` of /proc/meminfo; unknown elsewhere, taken as unlimited).
    pub fn of(device: &candle_core::Device) -> Result<Self, DeviceError> {
        match device {
            candle_core::Device::Cpu => {
                Ok(Self::cpu(available_system_memory().unwrap_or(u64::MAX)))
            }
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(cuda) => describe_cuda(cuda),
            other => Err(DeviceError::Query {
                device: format!("{other:?}"),
                reason: "glm5 places layers on the CPU and on CUDA devices only".into(),
            }),
        }
    }
}

/// The registry's description of a real CUDA device: compute capability, dynamic shared memory per block and
/// free memory (what placement may fill).
#[cfg(feature = "cuda")]
fn describe_cuda(dev: &candle_core::cuda_backend::CudaDevice) -> Result<DeviceDesc, DeviceError> {
    use crate::device::{DeviceKind, STATIC_SHARED_RESERVE};
    let context = dev.cuda_stream().context().clone();
    let name = format!("cuda:{}", context.ordinal());
    let query = |e: &dyn std::fmt::Display| DeviceError::Query {
        device: name.clone(),
        reason: e.to_string(),
    };
    let info = crate::cuda::device_info(dev).map_err(|e| query(&e))?;
    let (free, _total) = context.mem_get_info().map_err(|e| query(&e))?;
    Ok(DeviceDesc {
        kind: DeviceKind::Cuda {
            ordinal: context.ordinal(),
            capability: info.capability,
            shared_memory_per_block: info
                .max_shared_per_block
                .saturating_sub(STATIC_SHARED_RESERVE),
        },
        name,
        memory_bytes: free as u64,
        assumed: false,
    })
}

/// `MemAvailable` of /proc/meminfo in bytes (Linux).
fn available_system_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
