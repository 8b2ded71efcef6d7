//! A step's launches captured once into a CUDA graph and replayed: one launch from the host instead of the
//! hundreds a decode step issues one by one (the batch-1 step is bound by issuing them, not by the GPU).
//!
//! The contract of a capture:
//! - The captured work runs on the device's one stream, with cudarc's event tracking off (tracking makes
//!   every launch wait on events recorded outside the capture). The device must be the only one the work
//!   touches.
//! - Nothing in it reads back to the host or copies from host memory: inputs that change between replays
//!   live in device tensors made before the capture, which [`write_from_host`] refills before each replay.
//! - Every buffer a kernel keeps between calls (workspaces) exists before the capture at the size the
//!   captured work needs, and is never freed while a graph that uses it lives: run the same work once
//!   eagerly first, under a [`HostUploadCache`] (candle uploads a strided layout's dims and strides from
//!   the host at each launch otherwise; under the cache they come from device buffers the eager run
//!   filled).
//! - Tensors allocated inside the capture become the graph's own memory, allocated and freed by every
//!   replay; outputs must be copied into tensors made before the capture (and the captured ones dropped
//!   before the capture ends), or the next replay fails.
//!
//! Anything the driver refuses during the capture (a host read-back, a pageable copy, a synchronous
//! allocation) ends it with an error naming the call; the caller runs the step eagerly instead.

use candle_core::{Device, Tensor, WithDType};

use crate::error::{OpError, Result};

/// A captured step, replayed by [`StepGraph::replay`] on the stream it was captured from.
pub struct StepGraph {
    #[cfg(feature = "cuda")]
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

/// Why `device` cannot capture a step, or `None` where it can.
pub fn capture_blocker(device: &Device) -> Option<String> {
    if !device.is_cuda() {
        return Some(format!(
            "CUDA graphs need a CUDA device, not {:?}",
            device.location()
        ));
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return dev
            .is_event_tracking()
            .then(|| "cudarc's event tracking is on (glm5's CLI turns it off)".into());
    }
    Some("glm5 was built without the cuda feature".into())
}

/// candle's cache of host uploads for graph capture (`CudaDevice::enable_cuda_graph_htod_cache`), on while
/// this lives: candle's kernels on this thread then read the dims and strides of a strided layout (and small
/// host uploads) from device buffers cached by value, filled on first use, instead of copying them from the
/// host at each launch. Hold one over the eager run before a capture (which fills it) and over the capture
/// (which reads it; a miss there is an error naming it). A no-op on other devices.
pub struct HostUploadCache {
    _guard: Option<Box<dyn std::any::Any>>,
}

/// Turns on [`HostUploadCache`] for this thread on `device`.
pub fn host_upload_cache(device: &Device) -> HostUploadCache {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return HostUploadCache {
            _guard: Some(Box::new(dev.enable_cuda_graph_htod_cache())),
        };
    }
    let _ = device;
    HostUploadCache { _guard: None }
}

/// Captures what `work` issues on `device`'s stream into a graph (module contract). `work`'s value comes
/// back with the graph; the captured launches have not run yet (`replay` runs them).
pub fn capture<T>(device: &Device, work: impl FnOnce() -> Result<T>) -> Result<(StepGraph, T)> {
    if let Some(why) = capture_blocker(device) {
        return Err(OpError::Unsupported(format!("step graph: {why}")));
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let stream = dev.cuda_stream();
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            OpError::Unsupported(format!("step graph: {what}: {e}"))
        };
        // Thread-local mode: a call this thread makes that is unsafe during a capture (a synchronous
        // allocation, a host read-back) fails and names itself instead of being recorded wrongly.
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| fail("begin capture", &e))?;
        let value = work();
        // The capture ends either way, so the stream runs eagerly again after a failure.
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let value = value.map_err(|e| fail("the captured step failed", &e))?;
        let graph = ended.map_err(|e| fail("end capture", &e))?.ok_or_else(|| {
            OpError::Unsupported("step graph: the capture recorded nothing".into())
        })?;
        graph.upload().map_err(|e| fail("upload", &e))?;
        return Ok((StepGraph { graph }, value));
    }
    let _ = work;
    unreachable!("capture_blocker refuses every device but a CUDA one")
}

impl StepGraph {
    /// Runs the captured launches again, after the work already queued on their stream.
    pub fn replay(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        return self
            .graph
            .launch()
            .map_err(|e| OpError::Unsupported(format!("step graph: replay: {e}")));
        #[cfg(not(feature = "cuda"))]
        unreachable!("no StepGraph exists without the cuda feature")
    }
}

/// Writes `values` into `dst` in place, after the work already queued on its device's stream (a step's
/// inputs before a replay). `dst` must be a contiguous CUDA tensor of `T` with `values.len()` elements.
pub fn write_from_host<T: WithDType>(dst: &Tensor, values: &[T]) -> Result<()> {
    if dst.dtype() != T::DTYPE {
        return Err(OpError::DTypeMismatch {
            arg: "dst",
            other: "values",
            expected: T::DTYPE,
            found: dst.dtype(),
        });
    }
    if dst.elem_count() != values.len() || !dst.is_contiguous() {
        return Err(OpError::Shape {
            arg: "dst",
            expected: format!("{} contiguous elements", values.len()),
            found: dst.dims().to_vec(),
        });
    }
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() {
        let (address, dev) = crate::cuda::device_address(dst)?;
        let stream = dev.cuda_stream();
        let write = || -> std::result::Result<(), candle_core::cuda_backend::cudarc::driver::DriverError> {
            stream.context().bind_to_thread()?;
            // SAFETY: `address` starts `dst`'s `values.len()` elements of `T` (checked above); the copy is
            // ordered on the stream every reader of `dst` uses, and a pageable source is staged before the
            // call returns.
            unsafe {
                candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async(
                    address,
                    values,
                    stream.cu_stream(),
                )
            }
        };
        return write().map_err(|e| OpError::Unsupported(format!("write_from_host: {e}")));
    }
    Err(OpError::Unsupported(format!(
        "write_from_host writes CUDA tensors, not {:?} ones",
        dst.device().location()
    )))
}

/// Copies `src` into `dst` in place, both contiguous CUDA tensors of one dtype and element count, on `dst`'s
/// device's stream, ordered both ways when they are on two devices: `dst`'s stream first waits for the work
/// queued on `src`'s (which wrote `src`), and `src`'s then waits for the copy (before it writes `src` again).
/// How a graphed step hands its hidden state from one device's graph to the next.
pub fn copy_between(src: &Tensor, dst: &Tensor) -> Result<()> {
    if src.dtype() != dst.dtype() {
        return Err(OpError::DTypeMismatch {
            arg: "dst",
            other: "src",
            expected: src.dtype(),
            found: dst.dtype(),
        });
    }
    if src.elem_count() != dst.elem_count() || !src.is_contiguous() || !dst.is_contiguous() {
        return Err(OpError::Shape {
            arg: "dst",
            expected: format!("{} contiguous elements like src", src.elem_count()),
            found: dst.dims().to_vec(),
        });
    }
    #[cfg(feature = "cuda")]
    if src.device().is_cuda() && dst.device().is_cuda() {
        use candle_core::cuda_backend::cudarc::driver::{result, DriverError};
        let (from, from_dev) = crate::cuda::device_address(src)?;
        let (to, to_dev) = crate::cuda::device_address(dst)?;
        let bytes = src.elem_count() * src.dtype().size_in_bytes();
        let (from_stream, to_stream) = (from_dev.cuda_stream(), to_dev.cuda_stream());
        let two_devices = !src.device().same_device(dst.device());
        let copy = || -> std::result::Result<(), DriverError> {
            if two_devices {
                to_stream.join(&from_stream)?;
            }
            to_stream.context().bind_to_thread()?;
            // SAFETY: both ranges are `bytes` long within their tensors (checked above), and the copy is
            // ordered after `src`'s writer and before `src`'s next writer by the waits around it.
            unsafe { result::memcpy_dtod_async(to, from, bytes, to_stream.cu_stream()) }?;
            if two_devices {
                from_stream.join(&to_stream)?;
            }
            Ok(())
        };
        return copy().map_err(|e| OpError::Unsupported(format!("copy_between: {e}")));
    }
    Err(OpError::Unsupported(format!(
        "copy_between copies between CUDA tensors, not {:?} and {:?}",
        src.device().location(),
        dst.device().location()
    )))
}
