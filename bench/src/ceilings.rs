//! The device's own ceilings, measured in the same run as the ops: copy bandwidth, the mma.sync bf16 rate,
//! and per shape the least time the op's memory traffic alone takes (microkernels of `kernels/src/bench.cu`).

use glm5::candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use glm5::candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use glm5::candle_core::{Device, Result};

use crate::indexer::IndexerProblem;
use crate::sparse_mla::{Decode, ROW_DIM};
use crate::timing::{graph_seconds, median_seconds};
use crate::{cuda, next};

/// Device-to-device copy bandwidth in bytes/s (read + write counted), from plain cuMemcpyDtoD of 512 MiB of
/// random words (candle's `copy`/`slice_set` run their own kernels and under-state it).
pub fn copy_bandwidth(device: &Device) -> Result<f64> {
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let n = 128 << 20;
    let mut state = 1u64;
    let host: Vec<u32> = (0..n).map(|_| next(&mut state) as u32).collect();
    let src = stream.clone_htod(&host).map_err(cuda)?;
    let mut dst = stream.alloc_zeros::<u32>(n).map_err(cuda)?;
    let seconds = median_seconds(device, 5, 10, || {
        stream.memcpy_dtod(&src, &mut dst).map_err(cuda)
    })?;
    Ok(2.0 * (n * 4) as f64 / seconds)
}

/// Microkernel `name` of bench.cu on `stream`'s device.
fn bench_kernel(stream: &CudaStream, name: &str) -> Result<CudaFunction> {
    stream
        .context()
        .load_module(Ptx::from_binary(glm5_kernels::BENCH.to_vec()))
        .map_err(cuda)?
        .load_function(name)
        .map_err(cuda)
}

/// The SMs of `stream`'s device.
fn sm_count(stream: &CudaStream) -> Result<usize> {
    use glm5::candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    let sms = stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(cuda)?;
    Ok(sms as usize)
}

/// mma.sync bf16 rate in flop/s from the `mma_bf16_peak` microkernel.
pub fn mma_peak(device: &Device) -> Result<f64> {
    mma_loop_peak(device, "mma_bf16_peak", 16.0)
}

/// The mma.sync e4m3 (FP8) rate (`mma_e4m3_peak` of bench.cu), flop/s.
pub fn mma_e4m3_peak(device: &Device) -> Result<f64> {
    mma_loop_peak(device, "mma_e4m3_peak", 32.0)
}

/// A register-only MMA loop of bench.cu: 8 MMAs of m16n8k`k` per warp and iteration.
fn mma_loop_peak(device: &Device, kernel: &str, k: f64) -> Result<f64> {
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let func = bench_kernel(&stream, kernel)?;
    let (blocks, threads, iters) = (132 * 16, 256u32, 4096i32);
    let out = stream
        .alloc_zeros::<f32>(blocks * threads as usize)
        .map_err(cuda)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let seconds = median_seconds(device, 5, 3, || {
        let mut launch = stream.launch_builder(&func);
        launch.arg(&out).arg(&iters);
        unsafe { launch.launch(cfg) }.map(|_| ()).map_err(cuda)
    })?;
    let flops = blocks as f64 * (threads / 32) as f64 * iters as f64 * 8.0 * (2.0 * 16.0 * 8.0 * k);
    Ok(flops / seconds)
}

/// The ceiling of sparse_mla's memory side for `problem`: GPU seconds of `gather_rows_s{4,6}` (bench.cu),
/// which copies every selected row into shared memory the way the wgmma kernel does and computes nothing.
/// Small batches split each token's rows over blocks (whole 32-row tiles) until two blocks per SM are busy.
pub fn gather_seconds(device: &Device, problem: &Decode) -> Result<Vec<(usize, f64)>> {
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let (batch, k) = problem.physical.dims2()?;
    let rows: Vec<i32> = problem.physical.flatten_all()?.to_vec1()?;
    let rows = stream.clone_htod(&rows).map_err(cuda)?;
    let sms = sm_count(&stream)?;
    let tiles = k.div_ceil(32);
    let splits = (2 * sms / batch).clamp(1, tiles);
    let per_block = tiles.div_ceil(splits) * 32;
    let splits = k.div_ceil(per_block);
    let out = stream
        .alloc_zeros::<u32>(batch * splits * 256)
        .map_err(cuda)?;
    let (storage, layout) = problem.blocks.storage_and_layout();
    let glm5::candle_core::Storage::Cuda(storage) = &*storage else {
        glm5::candle_core::bail!("the cache is not on the GPU")
    };
    let kv = storage
        .as_cuda_slice::<half::bf16>()?
        .slice(layout.start_offset()..);
    let (k, per_block_arg) = (k as i32, per_block as i32);
    let mut result = Vec::new();
    for stages in [4usize, 6] {
        let func = bench_kernel(&stream, &format!("gather_rows_s{stages}"))?;
        let smem = (stages * 32 * ROW_DIM * 2 + per_block * 4) as u32;
        func.set_attribute(
            glm5::candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(cuda)?;
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, batch as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem,
        };
        let seconds = graph_seconds(device, 20, || {
            let mut launch = stream.launch_builder(&func);
            launch
                .arg(&kv)
                .arg(&rows)
                .arg(&k)
                .arg(&per_block_arg)
                .arg(&out);
            // SAFETY: `kv` holds every row `rows` names; `out` has 256 words per block.
            unsafe { launch.launch(cfg) }.map(|_| ()).map_err(cuda)
        })?;
        result.push((stages, seconds));
    }
    Ok(result)
}

/// The indexer's key bytes (FP8 rows and their scales) read by one plain streaming kernel (`read_bytes`,
/// bench.cu), timed as the op's GPU column is: the least time any kernel needs to move what the op reads,
/// ramp-up and tail included. The fastest of a few grid sizes (blocks of 256 threads per SM), in seconds.
pub fn key_read_seconds(device: &Device, problem: &IndexerProblem) -> Result<f64> {
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let func = bench_kernel(&stream, "read_bytes")?;
    let (bytes, bytes_layout) = problem.bytes.storage_and_layout();
    let (scales, scales_layout) = problem.scales.storage_and_layout();
    let (glm5::candle_core::Storage::Cuda(bytes), glm5::candle_core::Storage::Cuda(scales)) =
        (&*bytes, &*scales)
    else {
        glm5::candle_core::bail!("the keys are not on the GPU")
    };
    let bytes = bytes
        .as_cuda_slice::<u8>()?
        .slice(bytes_layout.start_offset()..);
    let scales = scales
        .as_cuda_slice::<f32>()?
        .slice(scales_layout.start_offset()..);
    // (Both buffers are whole multiples of 16 bytes: 128-byte rows, 64 scales per page.)
    let a_words = (problem.bytes.elem_count() / 16) as i64;
    let b_words = (problem.scales.elem_count() * 4 / 16) as i64;
    let sms = sm_count(&stream)?;
    let mut best = f64::INFINITY;
    for blocks_per_sm in [4usize, 8, 16] {
        let blocks = sms * blocks_per_sm;
        let out = stream.alloc_zeros::<u32>(blocks * 256).map_err(cuda)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let seconds = graph_seconds(device, 20, || {
            let mut launch = stream.launch_builder(&func);
            launch
                .arg(&bytes)
                .arg(&a_words)
                .arg(&scales)
                .arg(&b_words)
                .arg(&out);
            // SAFETY: both ranges lie inside their buffers; `out` has a word per thread.
            unsafe { launch.launch(cfg) }.map(|_| ()).map_err(cuda)
        })?;
        best = best.min(seconds);
    }
    Ok(best)
}
