//! `glm5-bench`: GPU benchmarks of glm5's kernels at GLM-5 shapes, against the candle-ops reference path
//! and against the device's own ceilings (device-to-device copy bandwidth and the mma.sync bf16 rate of a
//! register-only microkernel), all measured in the same run. Needs `--features cuda` and a GPU.
//!
//! `glm5-bench CONTEXT BATCH HEADS [KERNEL]` runs one sparse_mla shape only (one of its rows, named as in
//! the "kernel" column, with KERNEL), `glm5-bench indexer` the indexer rows
//! only, `glm5-bench indexer CONTEXT BATCH [QUERIES] [KERNEL]` one indexer shape (e.g. under a profiler),
//! KERNEL pinning its score kernel (`policy`, `per-query`, `grouped`, `mma.sync`).
//! `glm5-bench latency` prints what one dependent global load costs at a kernel's start (L2, L2 across
//! 2 MB pages, DRAM). `glm5-bench meetings` prints what a grid-wide meeting of all resident blocks costs
//! (flat counter, ticket and flag, clusters of 8 first). `glm5-bench slice LAYERS` builds the first LAYERS
//! layers of GLM-5 at their real sizes with random weights, on one GPU and split over two, and prints decode
//! tokens/s, the bytes moved between the GPUs per token and how far the two-GPU logits are from the one-GPU
//! ones.
//!
//! "wall" is the median of several rounds, each round `n` back-to-back calls then a device sync: it includes
//! the host's launch overhead, as an eager decode step pays it. "GPU" is the period of back-to-back calls
//! replayed from CUDA graphs (as a graph-captured decode step runs them): the device's time, launch gaps
//! included, host excluded (`graph_seconds`: the difference between graphs of `n` and 2`n` calls).
//! Throughput columns use the GPU time. sparse_mla rows name their kernel: "mma" is the mma.sync
//! launcher's own pick; with at most 8 heads also its head-tile kernel ("tiles") and its narrow kernel with
//! 2, 4 and 8 warps per block ("n2", "n4", "n8"); on an sm_90 GPU also wgmma where it serves (heads a
//! multiple of 64). "vs mma" is the "mma" row's GPU time over this row's. Inputs are random (never zeros).
//! Back-to-back calls on
//! the same inputs keep small problems' data in L2 (50 MB on an H200), which a decode step does not: it
//! visits a layer's cache once per token, after every other layer. "cold" times one call with the L2
//! emptied first (device time, CUDA events), and "%cold" is the copy-bandwidth share at that time. The
//! indexer's "scores" and "top-k" split a call's device time by CUDA events between the two stages
//! (`glm5::ops::time_stages`; the events keep the stages from overlapping, so they sum to a little more).

use std::time::Instant;

use glm5::candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use glm5::candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use glm5::candle_core::{DType, Device, Result, Tensor};
use glm5::ops::{
    dsa_indexer_paged, dsa_indexer_paged_device_visible, dsa_indexer_reference, quantize_fp8,
    set_narrow_heads, set_score_kernel, set_top_k_path, sparse_mla_paged_with,
    sparse_mla_reference, Bf16Kernel, IndexKeys, NarrowHeads, PagedIndexKeys, PagedLatentCache,
    ScoreKernel, TopKPath,
};

/// GLM-5's indexer: 32 heads of 128, FP8 keys of 128 bytes + an f32 scale.
const INDEX_HEADS: usize = 32;
const INDEX_DIM: usize = 128;
/// GLM-5's latent row and value widths, and its top-k.
const ROW_DIM: usize = 576;
const VALUE_DIM: usize = 512;
const TOP_K: usize = 2048;
const BLOCK_SIZE: usize = 64;

/// The middle value of `values` (the upper one of an even count), as every timing here reports.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn median_seconds(
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
/// wait) cancels; one graph's wall time over its calls (up to session 19) charged each call a share of it:
/// a fifth for the indexer's 5-call graphs, a twentieth for sparse_mla's 20.
fn graph_seconds(device: &Device, calls: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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
/// (~80 µs) for the host to queue the call's launches before the start event fires.
fn cold_seconds(device: &Device, rounds: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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

/// Device-to-device copy bandwidth in bytes/s (read + write counted), from plain cuMemcpyDtoD of 512 MiB of
/// random words (candle's `copy`/`slice_set` run their own kernels and under-state it).
fn copy_bandwidth(device: &Device) -> Result<f64> {
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
fn mma_peak(device: &Device) -> Result<f64> {
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let func = bench_kernel(&stream, "mma_bf16_peak")?;
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
    let flops =
        blocks as f64 * (threads / 32) as f64 * iters as f64 * 8.0 * (2.0 * 16.0 * 8.0 * 16.0);
    Ok(flops / seconds)
}

/// The ceiling of sparse_mla's memory side for `problem`: GPU seconds of `gather_rows_s{4,6}` (bench.cu),
/// which copies every selected row into shared memory the way the wgmma kernel does and computes nothing.
/// Small batches split each token's rows over blocks (whole 32-row tiles) until two blocks per SM are busy.
fn gather_seconds(device: &Device, problem: &Decode) -> Result<Vec<(usize, f64)>> {
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
fn key_read_seconds(device: &Device, problem: &Indexer) -> Result<f64> {
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

/// `glm5-bench latency`: what one dependent global load costs at a kernel's start, from the `load_chain`
/// microkernel (bench.cu, one block per SM following a chain of links): from L2 (a 64 KB chain of 128-byte
/// links), from L2 with one link per 2 MB page of a 512 MB chain (a TLB miss where its pages are not in the
/// TLBs, as the cache's rows are spread over its pages), and that chain again after the L2 is flushed. Each
/// warm row is the second of two launches. Prints ns, median and largest over the blocks.
fn latency_rows(device: &Device) -> Result<()> {
    const HOPS: i32 = 64;
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let func = bench_kernel(&stream, "load_chain")?;
    let sms = sm_count(&stream)?;
    // One cycle through every `stride`-th word of `words`, in random order: chain[slot] = the next slot.
    let chain = |words: usize, stride: usize| -> Result<_> {
        let slots = words / stride;
        if slots < sms {
            glm5::candle_core::bail!(
                "a chain of {slots} links cannot start {sms} blocks on links of their own"
            )
        }
        let mut order: Vec<usize> = (0..slots).collect();
        let mut state = 7u64;
        for i in (1..slots).rev() {
            order.swap(i, (next(&mut state) % (i as u64 + 1)) as usize);
        }
        let mut host = vec![0u32; words];
        for w in 0..slots {
            host[order[w] * stride] = (order[(w + 1) % slots] * stride) as u32;
        }
        stream.clone_htod(&host).map_err(cuda)
    };
    let (line, page) = (128 / 4, (2 << 20) / 4);
    let lines = chain((64 << 10) / 4, line)?;
    let pages = chain((512 << 20) / 4, page)?;
    let flush_src = stream.alloc_zeros::<u8>(256 << 20).map_err(cuda)?;
    let mut flush_dst = stream.alloc_zeros::<u8>(256 << 20).map_err(cuda)?;
    let out = stream.alloc_zeros::<u64>(3 * sms).map_err(cuda)?;
    let cfg = LaunchConfig {
        grid_dim: (sms as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let median_max = |v: Vec<f64>| {
        let largest = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (median(v), largest)
    };
    println!("dependent-load latency at a kernel's start ({sms} blocks, ns: median / largest over the blocks)");
    println!(
        "{:<44} {:>15} {:>15}",
        "chain", "first load", "each later link"
    );
    for (name, chain, stride, flush) in [
        ("L2, 128-byte links (64 KB)", &lines, line, false),
        ("L2, a link per 2 MB page (512 MB)", &pages, page, false),
        ("L2 flushed first, a link per 2 MB page", &pages, page, true),
    ] {
        let spacing = stride as u32;
        let mut times = Vec::new();
        for launch_index in 0..2 {
            if flush && launch_index == 1 {
                stream
                    .memcpy_dtod(&flush_src, &mut flush_dst)
                    .map_err(cuda)?;
            }
            let mut launch = stream.launch_builder(&func);
            launch.arg(chain).arg(&spacing).arg(&HOPS).arg(&out);
            // SAFETY: every block's links stay inside `chain`; `out` holds three words per block.
            unsafe { launch.launch(cfg) }.map_err(cuda)?;
            stream.synchronize().map_err(cuda)?;
            times = stream.clone_dtoh(&out).map_err(cuda)?;
        }
        let first = median_max(times.chunks(3).map(|c| c[0] as f64).collect());
        let link = median_max(times.chunks(3).map(|c| c[1] as f64 / HOPS as f64).collect());
        println!(
            "{name:<44} {:>7.0} / {:<5.0} {:>7.0} / {:<5.0}",
            first.0, first.1, link.0, link.1
        );
    }
    Ok(())
}

/// What a grid-wide meeting costs (bench.cu's `meetings_*`): every block of a resident grid arrives and waits
/// for all, 200 times back to back; ns per meeting (median of 5 launches), with and without a 256-count
/// histogram exchange around each.
fn meeting_rows(device: &Device) -> Result<()> {
    const ROUNDS: i32 = 200;
    let Device::Cuda(dev) = device else {
        glm5::candle_core::bail!("needs a CUDA device")
    };
    let stream = dev.cuda_stream();
    let sms = sm_count(&stream)?;
    let hist = stream.alloc_zeros::<i32>(512).map_err(cuda)?;
    let out = stream.alloc_zeros::<u64>(2).map_err(cuda)?;
    println!("grid-wide meetings ({ROUNDS} back to back; ns a meeting, median of 5 launches)");
    println!(
        "{:<10} {:>7} {:>12} {:>14}",
        "kind", "blocks", "no payload", "256 counts"
    );
    let clusters = sms / 8 * 8;
    for (kind, blocks) in [
        ("flat", sms),
        ("ticket", sms),
        ("flat", clusters),
        ("ticket", clusters),
        ("cluster", clusters),
        ("flat", 2 * sms),
        ("ticket", 2 * sms),
    ] {
        let func = bench_kernel(&stream, &format!("meetings_{kind}"))?;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut row = Vec::new();
        for payload in [0i32, 256] {
            let mut times = Vec::new();
            for _ in 0..5 {
                let sync = stream.alloc_zeros::<u32>(64).map_err(cuda)?;
                let mut launch = stream.launch_builder(&func);
                launch
                    .arg(&sync)
                    .arg(&hist)
                    .arg(&payload)
                    .arg(&ROUNDS)
                    .arg(&out);
                // SAFETY: `sync` holds the counter and the flag (words 0 and 32), `hist` 2 x 256 bins, `out`
                // two words; every block is resident at once (256 threads, no shared memory, <= 2 per SM).
                unsafe { launch.launch(cfg) }.map_err(cuda)?;
                stream.synchronize().map_err(cuda)?;
                times.push(stream.clone_dtoh(&out).map_err(cuda)?[0] as f64 / ROUNDS as f64);
            }
            row.push(median(times));
        }
        println!("{kind:<10} {blocks:>7} {:>12.0} {:>14.0}", row[0], row[1]);
    }
    Ok(())
}

fn cuda(e: impl std::fmt::Display) -> glm5::candle_core::Error {
    glm5::candle_core::Error::Cuda(e.to_string().into())
}

/// A decode batch over a paged cache: `batch` sequences of `context` tokens, one query token each, whose
/// top-k are `TOP_K` distinct random positions.
struct Decode {
    q: Tensor,
    blocks: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    token_seq: Tensor,
    indices: Tensor,
    /// The same selection as physical rows of `blocks`, for the reference path.
    physical: Tensor,
}

/// splitmix64: reproducible indices without a rand dependency.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Decode {
    fn new(device: &Device, batch: usize, heads: usize, context: usize, seed: u64) -> Result<Self> {
        let blocks_per_seq = context.div_ceil(BLOCK_SIZE);
        let num_blocks = batch * blocks_per_seq;
        let blocks = Tensor::zeros((num_blocks, BLOCK_SIZE, ROW_DIM), DType::BF16, device)?;
        let chunk = 4096.min(num_blocks);
        for start in (0..num_blocks).step_by(chunk) {
            let len = chunk.min(num_blocks - start);
            let random = Tensor::randn(0f32, 1f32, (len, BLOCK_SIZE, ROW_DIM), device)?
                .to_dtype(DType::BF16)?;
            blocks.slice_set(&random, 0, start)?;
        }
        let mut state = seed;
        // Physical blocks shuffled across sequences, as a paged allocator leaves them.
        let mut order: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (next(&mut state) % (i as u64 + 1)) as usize);
        }
        let (mut indices, mut physical) = (
            Vec::with_capacity(batch * TOP_K),
            Vec::with_capacity(batch * TOP_K),
        );
        for b in 0..batch {
            let mut chosen = std::collections::HashSet::with_capacity(TOP_K);
            while chosen.len() < TOP_K.min(context) {
                chosen.insert((next(&mut state) % context as u64) as i32);
            }
            for &pos in &chosen {
                indices.push(pos);
                let block = order[b * blocks_per_seq + pos as usize / BLOCK_SIZE];
                physical.push(block * BLOCK_SIZE as i32 + pos % BLOCK_SIZE as i32);
            }
        }
        Ok(Self {
            q: Tensor::randn(0f32, 1f32, (batch, heads, ROW_DIM), device)?.to_dtype(DType::BF16)?,
            blocks,
            block_table: Tensor::from_vec(order, (batch, blocks_per_seq), device)?,
            seq_lens: Tensor::from_vec(vec![context as i32; batch], batch, device)?,
            token_seq: Tensor::from_vec((0..batch as i32).collect(), batch, device)?,
            indices: Tensor::from_vec(indices, (batch, TOP_K), device)?,
            physical: Tensor::from_vec(physical, (batch, TOP_K), device)?,
        })
    }

    fn kernel(&self, kernel: Bf16Kernel) -> Result<()> {
        let cache = PagedLatentCache {
            blocks: &self.blocks,
            block_table: &self.block_table,
            seq_lens: &self.seq_lens,
            token_seq: &self.token_seq,
        };
        sparse_mla_paged_with(
            &self.q,
            &cache,
            &self.indices,
            VALUE_DIM,
            1.0 / 16.0,
            kernel,
        )
        .map(|_| ())
        .map_err(cuda)
    }

    fn reference(&self) -> Result<()> {
        let rows = self.blocks.flatten_to(1)?;
        sparse_mla_reference(&self.q, &rows, &self.physical, VALUE_DIM, 1.0 / 16.0)
            .map(|_| ())
            .map_err(cuda)
    }
}

/// An indexer batch over a paged FP8 key cache: `batch` sequences of `context` keys, and `queries` query
/// tokens per sequence (1: decode; a prefill chunk: the last `queries` positions, causal).
struct Indexer {
    q: Tensor,
    weights: Tensor,
    bytes: Tensor,
    scales: Tensor,
    block_table: Tensor,
    token_seq: Tensor,
    visible: Vec<usize>,
    /// The same counts on the device (`I32 [T]`): the graph-capturable call uploads nothing.
    visible_on_device: Tensor,
    /// Contiguous bf16 keys of sequence 0 (all sequences' keys for the reference path are alike in cost).
    reference_keys: Tensor,
}

impl Indexer {
    fn new(
        device: &Device,
        batch: usize,
        queries: usize,
        context: usize,
        seed: u64,
    ) -> Result<Self> {
        let blocks_per_seq = context.div_ceil(BLOCK_SIZE);
        let num_blocks = batch * blocks_per_seq;
        let keys = Tensor::randn(0f32, 1f32, (num_blocks * BLOCK_SIZE, INDEX_DIM), device)?;
        let (bytes, scales) = quantize_fp8(&keys).map_err(cuda)?;
        let mut state = seed;
        let mut order: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (next(&mut state) % (i as u64 + 1)) as usize);
        }
        let t = batch * queries;
        let visible: Vec<usize> = (0..t)
            .map(|i| context - queries + i % queries + 1)
            .collect();
        let visible_on_device = Tensor::from_vec(
            visible.iter().map(|&v| v as i32).collect::<Vec<_>>(),
            t,
            device,
        )?;
        Ok(Self {
            q: Tensor::randn(0f32, 1f32, (t, INDEX_HEADS, INDEX_DIM), device)?
                .to_dtype(DType::BF16)?,
            weights: Tensor::randn(0f32, 1f32, (t, INDEX_HEADS), device)?,
            bytes: bytes.reshape((num_blocks, BLOCK_SIZE, INDEX_DIM))?,
            scales: scales.reshape((num_blocks, BLOCK_SIZE))?,
            block_table: Tensor::from_vec(order, (batch, blocks_per_seq), device)?,
            token_seq: Tensor::from_vec(
                (0..t as i32).map(|i| i / queries as i32).collect(),
                t,
                device,
            )?,
            visible,
            visible_on_device,
            reference_keys: keys.narrow(0, 0, context)?.to_dtype(DType::BF16)?,
        })
    }

    fn cache(&self) -> PagedIndexKeys<'_> {
        PagedIndexKeys {
            keys: IndexKeys::Fp8 {
                bytes: &self.bytes,
                scales: &self.scales,
            },
            block_table: &self.block_table,
            token_seq: &self.token_seq,
        }
    }

    /// The op as an eager decode step calls it: counts from the host, uploaded per call.
    fn kernel(&self) -> Result<()> {
        dsa_indexer_paged(&self.q, &self.weights, &self.cache(), &self.visible, TOP_K)
            .map(|_| ())
            .map_err(cuda)
    }

    /// The op over counts kept on the device (what a graph-captured decode step calls).
    fn kernel_on_device(&self) -> Result<()> {
        let bound = self.visible.iter().copied().max().unwrap_or(0);
        dsa_indexer_paged_device_visible(
            &self.q,
            &self.weights,
            &self.cache(),
            &self.visible_on_device,
            bound,
            TOP_K,
        )
        .map(|_| ())
        .map_err(cuda)
    }

    fn reference(&self) -> Result<()> {
        dsa_indexer_reference(
            &self.q,
            &self.weights,
            IndexKeys::Float(&self.reference_keys),
            &self.visible,
            TOP_K,
        )
        .map(|_| ())
        .map_err(cuda)
    }
}

/// Indexer rows: decode at batch 1/8/64 and a 4096-token prefill chunk, per context.
/// `only`: one row (context, batch, queries per sequence) instead.
fn indexer_rows(
    device: &Device,
    copy: f64,
    peak: f64,
    only: Option<(usize, usize, usize)>,
) -> Result<()> {
    println!();
    println!(
        "dsa_indexer, FP8 keys ({INDEX_DIM} B + f32 scale), {INDEX_HEADS} heads, top-k {TOP_K}, paged (block {BLOCK_SIZE})"
    );
    println!(
        "{:>7} {:>5} {:>7} | {:>8} {:>8} {:>8} {:>10} {:>8} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>6} {:>8} | {:>10} {:>8}",
        "context",
        "batch",
        "queries",
        "wall µs",
        "GPU µs",
        "chain µs",
        "cluster µs",
        "scores",
        "top-k",
        "cold µs",
        "%cold",
        "GB/s",
        "%copy",
        "TFLOP/s",
        "%mma",
        "floor µs",
        "ref µs",
        "speedup"
    );
    let shapes: Vec<(usize, usize, usize)> = match only {
        Some(shape) => vec![shape],
        None => [8192usize, 32_768, 131_072, 200_000]
            .iter()
            .flat_map(|&c| [(c, 1, 1), (c, 8, 1), (c, 64, 1), (c, 1, 4096)])
            .collect(),
    };
    for (context, batch, queries) in shapes {
        let problem = Indexer::new(
            device,
            batch,
            queries,
            context,
            (context * 10 + batch) as u64,
        )?;
        // Wall: the eager call (counts uploaded each time). GPU: the call over device-resident counts,
        // replayed from a CUDA graph (device time, host excluded).
        let rounds = if queries > 1 { 3 } else { 7 };
        let wall = median_seconds(device, rounds, 5, || problem.kernel())?;
        let gpu = graph_seconds(device, 20, || problem.kernel_on_device())?;
        // The same with the top-k pinned to the three-kernel chain (the policy takes the cluster top-k
        // wherever a row fits it).
        set_top_k_path(TopKPath::Chain);
        let chain = graph_seconds(device, 20, || problem.kernel_on_device());
        // ... and pinned to the cluster top-k, so that the policy's row-length bound can be checked
        // (rows it cannot take run the chain there too).
        set_top_k_path(TopKPath::Cluster);
        let cluster = graph_seconds(device, 20, || problem.kernel_on_device());
        set_top_k_path(TopKPath::Policy);
        let (chain, cluster) = (chain?, cluster?);
        let cold = cold_seconds(device, rounds, || problem.kernel())?;
        // The split: CUDA events between the stages (which keeps them from overlapping).
        let split_calls = 5;
        let (timed, split) = glm5::ops::time_stages(|| {
            (0..split_calls).try_for_each(|_| problem.kernel_on_device())
        })
        .map_err(cuda)?;
        timed?;
        // Decode reads every key of every sequence once; a prefill chunk re-reads the sequence per query
        // from L2 but moves it from memory once.
        let bytes = (batch * context * (INDEX_DIM + 4)
            + batch * queries * INDEX_HEADS * (INDEX_DIM * 2 + 4)
            + batch * queries * TOP_K * 4) as f64;
        let scored: usize = problem.visible.iter().sum();
        let flops = (scored * INDEX_HEADS * INDEX_DIM * 2) as f64;
        // The candle-ops reference on every row: one timed call where a call takes seconds (batch 64 and
        // prefill chunks: the scores of up to 4096 queries go to the host for the selection).
        let reference_rounds = if queries == 1 && batch <= 8 { 3 } else { 1 };
        let reference = median_seconds(device, reference_rounds, 1, || problem.reference())?;
        println!(
            "{:>7} {:>5} {:>7} | {:>8.1} {:>8.1} {:>8.1} {:>10.1} {:>8.1} {:>8.1} {:>8.1} {:>5.1}% {:>8.0} {:>5.1}% {:>8.1} {:>5.1}% {:>8.2} | {:>10} {:>8}",
            context,
            batch,
            queries,
            wall * 1e6,
            gpu * 1e6,
            chain * 1e6,
            cluster * 1e6,
            split.scores.as_secs_f64() * 1e6 / split_calls as f64,
            split.top_k.as_secs_f64() * 1e6 / split_calls as f64,
            cold * 1e6,
            100.0 * bytes / cold / copy,
            bytes / gpu / 1e9,
            100.0 * bytes / gpu / copy,
            flops / gpu / 1e12,
            100.0 * flops / gpu / peak,
            bytes / copy * 1e6,
            format!("{:.1}", reference * 1e6),
            format!("{:.1}x", reference / wall),
        );
        let read = key_read_seconds(device, &problem)?;
        let key_bytes = (batch * context * (INDEX_DIM + 4)) as f64;
        println!(
            "{:>21} | the keys read alone (one streaming kernel, no math, no top-k): {:.1} µs ({:.1}% of copy); the op's GPU µs over it: {:.2}x",
            "",
            read * 1e6,
            100.0 * key_bytes / read / copy,
            gpu / read
        );
    }
    Ok(())
}

/// GLM-5's first `layers` layers at real sizes (the spec's config.json, per-layer lists cut to `layers`).
fn glm5_slice(layers: usize) -> Result<glm5::Config> {
    let mut json: serde_json::Value =
        serde_json::from_str(include_str!("../../tests/assets/glm5_config.json")).map_err(cuda)?;
    let full = json["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    if let Some(object) = json.as_object_mut() {
        for value in object.values_mut() {
            if let Some(list) = value.as_array_mut() {
                if list.len() == full {
                    list.truncate(layers);
                }
            }
        }
        object.insert("num_hidden_layers".into(), layers.into());
    }
    glm5::Config::from_json(&json.to_string()).map_err(cuda)
}

/// Decode on a GLM-5 slice with random weights: one GPU against the layers split over two.
fn slice_rows(layers: usize) -> Result<()> {
    use glm5::{
        AttentionMode, Checkpoint, DeviceDesc, Glm5ForCausalLM, Plan, PlanOptions, Registry,
    };
    let config = glm5_slice(layers)?;
    let gpus = [Device::new_cuda(0)?, Device::new_cuda(1)?];
    let (prompt, steps) = (32usize, 32usize);
    let ids: Vec<u32> = (0..prompt + steps)
        .map(|i| (i * 7919 % config.vocab_size) as u32)
        .collect();
    let mut results = Vec::new();
    // Two rounds, 1 GPU then 2 each time, keeping the second: the first pays one-off costs (module loads,
    // allocator growth, clocks ramping) that would otherwise land on whichever layout ran first.
    for (round, count) in [(0, 1usize), (0, 2), (1, 1), (1, 2)] {
        let mut options = PlanOptions::new(DType::BF16, AttentionMode::Sparse);
        options.layer_devices = Some(
            (0..layers)
                .map(|l| {
                    if count == 1 {
                        0
                    } else {
                        usize::from(l >= layers / 2)
                    }
                })
                .collect(),
        );
        options.context = Some(prompt + steps);
        let devices = &gpus[..count];
        let plan = Plan::build(
            &config,
            devices
                .iter()
                .map(|d| DeviceDesc::of(d).map_err(cuda))
                .collect::<Result<Vec<_>>>()?,
            &options,
            &Registry::builtin(),
        )
        .map_err(cuda)?;
        let model =
            Glm5ForCausalLM::load_planned(&config, &Checkpoint::random(2026, 0.02), plan, devices)
                .map_err(cuda)?;
        let mut cache = model.new_cache(prompt + steps).map_err(cuda)?;
        let mut rows = vec![model.forward(&ids[..prompt], 0, &mut cache).map_err(cuda)?];
        for d in &gpus[..count] {
            d.synchronize()?;
        }
        let start = Instant::now();
        for (pos, &id) in ids.iter().enumerate().skip(prompt) {
            let logits = model.forward(&[id], pos, &mut cache).map_err(cuda)?;
            logits.argmax(1)?.to_vec1::<u32>()?; // a generation loop reads each token back
            rows.push(logits);
        }
        let rate = steps as f64 / start.elapsed().as_secs_f64();
        let logits: Vec<Vec<f32>> = Tensor::cat(&rows, 0)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2()?;
        let moved = model.transfers() * config.hidden_size * 2 / (1 + steps);
        if round == 1 {
            results.push((count, rate, logits, moved));
        }
    }
    println!();
    println!("GLM-5 slice: {layers} layers at real sizes, random bf16 weights, prompt {prompt}, {steps} decode steps");
    let reference = results[0].2.clone();
    for (count, rate, logits, moved) in &results {
        let worst = logits
            .iter()
            .zip(&reference)
            .map(|(g, w)| {
                let diff: f32 = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b) * (a - b))
                    .sum::<f32>()
                    .sqrt();
                diff / w
                    .iter()
                    .map(|b| b * b)
                    .sum::<f32>()
                    .sqrt()
                    .max(f32::MIN_POSITIVE)
            })
            .fold(0.0, f32::max);
        println!(
            "{count} GPU(s): decode {rate:.1} tok/s, {moved} B between GPUs per token, logits vs 1 GPU: max ‖Δ‖/‖ref‖ {worst:.2e}"
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let device = Device::new_cuda(0)?;
    // One stream: cross-stream event tracking would add driver calls to every launch.
    if let Device::Cuda(dev) = &device {
        // SAFETY: everything here runs on the device's single stream.
        unsafe { dev.disable_event_tracking() };
    }
    let copy = copy_bandwidth(&device)?;
    let peak = mma_peak(&device)?;
    println!(
        "device copy bandwidth: {:.0} GB/s   mma.sync bf16 peak: {:.0} TFLOP/s",
        copy / 1e9,
        peak / 1e12
    );
    let args: Vec<String> = std::env::args().skip(1).collect();
    let only: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if args.first().map(String::as_str) == Some("slice") {
        let [layers] = only[..] else {
            glm5::candle_core::bail!("usage: glm5-bench slice LAYERS")
        };
        return slice_rows(layers);
    }
    if args.first().map(String::as_str) == Some("latency") {
        return latency_rows(&device);
    }
    if args.first().map(String::as_str) == Some("meetings") {
        return meeting_rows(&device);
    }
    if args.first().map(String::as_str) == Some("indexer") {
        let pinned = args.iter().skip(1).find(|a| a.parse::<usize>().is_err());
        if let Some(name) = pinned {
            let kernel = match name.as_str() {
                "policy" => ScoreKernel::Policy,
                "per-query" => ScoreKernel::PerQuery,
                "grouped" => ScoreKernel::Grouped,
                "mma.sync" => ScoreKernel::MmaSync,
                _ => glm5::candle_core::bail!("unknown score kernel {name:?}"),
            };
            println!("score kernel pinned: {kernel:?}");
            set_score_kernel(kernel);
        }
        let shape = match only[..] {
            [] => None,
            [context, batch] => Some((context, batch, 1)),
            [context, batch, queries] => Some((context, batch, queries)),
            _ => glm5::candle_core::bail!(
                "usage: glm5-bench indexer [CONTEXT BATCH [QUERIES]] [KERNEL]"
            ),
        };
        return indexer_rows(&device, copy, peak, shape);
    }
    println!();
    println!("sparse_mla decode, bf16, D {ROW_DIM}/{VALUE_DIM}, top-k {TOP_K}, paged (block {BLOCK_SIZE})");
    println!(
        "{:>7} {:>5} {:>4} {:>6} | {:>8} {:>7} {:>7} {:>6} {:>8} {:>7} {:>8} {:>6} {:>8} | {:>10} {:>8} {:>7}",
        "context",
        "batch",
        "H",
        "kernel",
        "wall µs",
        "GPU µs",
        "cold µs",
        "%cold",
        "GB/s",
        "%copy",
        "TFLOP/s",
        "%mma",
        "floor µs",
        "ref µs",
        "speedup",
        "vs mma"
    );
    let shapes: Vec<(usize, usize, usize)> = match only[..] {
        [context, batch, heads] => vec![(context, batch, heads)],
        _ => [32_768usize, 131_072]
            .iter()
            .flat_map(|&c| {
                [8usize, 16, 64]
                    .iter()
                    .flat_map(move |&h| [1usize, 8, 64, 128].map(|b| (c, b, h)))
            })
            .collect(),
    };
    let wgmma =
        glm5::ops::DeviceDesc::of(&device).map_err(cuda)?.family() == glm5::ops::DeviceFamily::Sm90;
    for &(context, batch, heads) in &shapes {
        let problem = Decode::new(
            &device,
            batch,
            heads,
            context,
            (context * 1000 + heads * 10 + batch) as u64,
        )?;
        let reference = median_seconds(&device, 3, 2, || problem.reference())?;
        // Bytes the op must move: the selected rows, q, out, lse and the indices.
        let bytes = (batch * TOP_K * ROW_DIM * 2
            + batch * heads * (ROW_DIM + VALUE_DIM) * 2
            + batch * heads * 4
            + batch * TOP_K * 4) as f64;
        let flops = (batch * heads * TOP_K * 2 * (ROW_DIM + VALUE_DIM)) as f64;
        // (label, kernel, narrow-kernel choice): the launcher's pick first, then the alternatives.
        let mut kernels = vec![("mma", Bf16Kernel::MmaSync, NarrowHeads::Policy)];
        if heads <= 8 {
            kernels.push(("tiles", Bf16Kernel::MmaSync, NarrowHeads::Off));
            for (label, warps) in [("n2", 2), ("n4", 4), ("n8", 8)] {
                if TOP_K.div_ceil(16 * warps) <= 128 {
                    kernels.push((label, Bf16Kernel::MmaSync, NarrowHeads::Warps(warps)));
                }
            }
        }
        if wgmma && heads.is_multiple_of(64) {
            kernels.push(("wgmma", Bf16Kernel::Wgmma, NarrowHeads::Policy));
        }
        // `glm5-bench CONTEXT BATCH HEADS LABEL`: that row only (e.g. under a profiler).
        if let [_, _, _, wanted] = &args[..] {
            kernels.retain(|(label, ..)| label == wanted);
        }
        let mut mma_gpu = None;
        for (label, kernel, narrow) in kernels {
            set_narrow_heads(narrow);
            let wall = median_seconds(&device, 7, 20, || problem.kernel(kernel))?;
            let gpu = graph_seconds(&device, 20, || problem.kernel(kernel))?;
            let cold = cold_seconds(&device, 7, || problem.kernel(kernel))?;
            set_narrow_heads(NarrowHeads::Policy);
            let mma = *mma_gpu.get_or_insert(gpu);
            println!(
                "{:>7} {:>5} {:>4} {:>6} | {:>8.1} {:>7.1} {:>7.1} {:>5.1}% {:>8.0} {:>6.1}% {:>8.1} {:>5.1}% {:>8.2} | {:>10.1} {:>7.1}x {:>6.2}x",
                context,
                batch,
                heads,
                label,
                wall * 1e6,
                gpu * 1e6,
                cold * 1e6,
                100.0 * bytes / cold / copy,
                bytes / gpu / 1e9,
                100.0 * bytes / gpu / copy,
                flops / gpu / 1e12,
                100.0 * flops / gpu / peak,
                bytes / copy * 1e6,
                reference * 1e6,
                reference / wall,
                mma / gpu,
            );
        }
        let gather = gather_seconds(&device, &problem)?;
        let rows_bytes = (batch * TOP_K * ROW_DIM * 2) as f64;
        println!(
            "{:>26} | the selected rows' gather alone (same copies, no math): {}",
            "",
            gather
                .iter()
                .map(|(stages, s)| format!(
                    "{stages} stages {:.1} µs ({:.1}% of copy)",
                    s * 1e6,
                    100.0 * rows_bytes / s / copy
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if only.is_empty() {
        indexer_rows(&device, copy, peak, None)?;
    }
    Ok(())
}
