//! How the bench times a call: wall (host launches included), GPU (replayed from CUDA graphs) and cold
//! (the L2 emptied first).

use std::time::Instant;

use glm5::candle_core::{Device, Result};

use crate::cuda;

/// The middle value of `values` (the upper one of an even count), as every timing here reports.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub fn median_seconds(
    device: &Device,
    rounds: usize,
    calls: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    f()?; // warm-up: module load, allocator
    device.synchronize()?;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64() / calls as f64);
    }
    Ok(median(times))
}

/// Per-call device time of `f` replayed from a CUDA graph, as a graph-captured decode step runs it: graphs
/// of `calls` and of 2 x `calls` back-to-back calls, each replay timed by CUDA events around it (median of 7
/// each), and their difference over `calls`. That is the period of back-to-back calls on the device, launch
/// gaps included, while the fixed cost of a replay (the graph's launch, its first kernel's start, the host's
/// wait) cancels.
pub fn graph_seconds(
    device: &Device,
    calls: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    use glm5::candle_core::cuda_backend::cudarc::driver::sys;
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    f()?; // warm-up outside the capture: module load, workspaces
    device.synchronize()?;
    let mut capture = |n: usize| -> Result<_> {
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(cuda)?;
        let captured = (0..n).try_for_each(|_| f());
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(cuda)?;
        captured?;
        let graph = graph.ok_or_else(|| cuda("the capture recorded nothing"))?;
        graph.upload().map_err(cuda)?;
        Ok(graph)
    };
    let graphs = [capture(calls)?, capture(2 * calls)?];
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..8 {
        for (graph, times) in graphs.iter().zip(&mut times) {
            let start = stream.record_event(timing).map_err(cuda)?;
            graph.launch().map_err(cuda)?;
            let end = stream.record_event(timing).map_err(cuda)?;
            let ms = start.elapsed_ms(&end).map_err(cuda)?;
            if round > 0 {
                times.push(f64::from(ms) / 1e3); // (round 0 warms the replays up)
            }
        }
    }
    let [one, two] = times.map(median);
    Ok((two - one) / calls as f64)
}

/// Bytes written before each "cold" call: several times any GPU's L2.
const FLUSH_BYTES: usize = 256 << 20;

/// Device time of one call of `f` with the L2 emptied first (median of `rounds`): CUDA events around the
/// call, after a memset of `FLUSH_BYTES` that evicts the previous call's data. The memset runs long enough
/// for the host to queue the call's launches before the start event fires.
pub fn cold_seconds(
    device: &Device,
    rounds: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    use glm5::candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let mut flush = stream.alloc_zeros::<u8>(FLUSH_BYTES).map_err(cuda)?;
    f()?; // warm-up: module load, workspaces
    device.synchronize()?;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        stream.memset_zeros(&mut flush).map_err(cuda)?;
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = stream.record_event(timing).map_err(cuda)?;
        f()?;
        let end = stream.record_event(timing).map_err(cuda)?;
        times.push(f64::from(start.elapsed_ms(&end).map_err(cuda)?) / 1e3);
    }
    Ok(median(times))
}
