//! Launch of `kernels/src/dsa_indexer.cu` (and `dsa_indexer_sm90.cu`): the op's glue here (parameters,
//! workspace, chunks of queries, stage timing), the score stage in `scores.rs`, the top-k stage in
//! `top_k.rs`, the FP8 cache's TMA descriptors in `tensor_map.rs`.

mod scores;
mod tensor_map;
mod top_k;

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId};
use candle_core::{CustomOp1, DType, Layout, Shape, Tensor};
use glm5_kernels::interface::{DsaParams, TensorMap};

use super::limits::{MMA_HEAD_DIMS, MMA_MAX_HEADS};
use super::policy::emit::SEGMENT;
use super::{DsaIndexerLaunch, PagedIndexKeys, MAX_CHUNK_ELEMS};
use crate::cuda::{cuda_err, device_address};
use crate::error::{OpError, Result};
use crate::index_keys::IndexKeys;

const MODULE: &[u8] = glm5_kernels::DSA_INDEXER;
/// The wgmma score kernel (`dsa_indexer_sm90.cu`, sm_90a only).
const MODULE_SM90: &[u8] = glm5_kernels::DSA_INDEXER_SM90;
/// The kernels' launch shapes and workspace layout (`glm5_kernels::interface`, checked against the .cu
/// files at build time): keys per score tile, per-row histogram words, per-segment work words, threads of
/// the score, segment and threshold kernels, and the dynamic shared memory of the cluster top-k and the
/// grouped score kernel.
use glm5_kernels::interface::dsa_indexer::{
    CLUSTER_SHARED_BYTES, GROUP_SHARED_BYTES, HIST_STRIDE, STAGED_CANDIDATES, TILE_KEYS,
    WORK_PER_SEGMENT,
};
const SCORE_THREADS: u32 = glm5_kernels::interface::dsa_indexer::SCORE_THREADS as u32;
const SEGMENT_THREADS: u32 = glm5_kernels::interface::dsa_indexer::SEGMENT_THREADS as u32;
const TOPK_THREADS: u32 = glm5_kernels::interface::dsa_indexer::TOPK_THREADS as u32;
/// Dynamic shared memory of the threshold kernel: the staged candidates' values and positions.
const THRESHOLD_STAGE_BYTES: usize = 2 * STAGED_CANDIDATES * 4;

/// Whether the mma score kernels serve `heads` heads of width `head_dim`.
pub(super) fn mma_serves(heads: usize, head_dim: usize) -> bool {
    heads <= MMA_MAX_HEADS && MMA_HEAD_DIMS.contains(&head_dim)
}

/// Whether a kernel serves queries of `dtype` (FP8 keys count as bf16).
pub(super) fn serves(dtype: DType, heads: usize, head_dim: usize) -> bool {
    match dtype {
        DType::BF16 => mma_serves(heads, head_dim),
        DType::F32 => true,
        _ => false,
    }
}

/// The kernels' parameter struct (`glm5_kernels::interface`, whose layout `kernels/build.rs` checks against
/// the CUDA side's), passed by value.
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
pub(super) struct Params(DsaParams);
// SAFETY: plain-old-data with the C layout of the kernel's parameter struct (checked at build time).
unsafe impl DeviceRepr for Params {}

/// This thread's workspace on `dev`: scores `[chunk, stride]` f32, the per-row histograms and
/// slots `[chunk, HIST_STRIDE]` i32, which must be zero when a call starts (allocated zeroed; the
/// threshold kernel zeroes every row it reads), the top-k kernels' candidate (position, score)
/// pairs and per-segment counts, offsets and masks `[chunk, 2 * stride + WORK_PER_SEGMENT * segments]`
/// u32. Per thread because candle issues work on the per-thread default stream.
fn workspace(
    dev: &CudaDevice,
    scores: usize,
    hist: usize,
    work: usize,
) -> candle_core::Result<[u64; 3]> {
    type Buffers = (CudaSlice<f32>, CudaSlice<i32>, CudaSlice<u32>);
    thread_local! {
        static WORKSPACE: RefCell<HashMap<DeviceId, Buffers>> = RefCell::new(HashMap::new());
    }
    WORKSPACE.with(|cell| {
        let mut map = cell.borrow_mut();
        let stream = dev.cuda_stream();
        let fits = map
            .get(&dev.id())
            .is_some_and(|(s, h, w)| s.len() >= scores && h.len() >= hist && w.len() >= work);
        if !fits {
            // SAFETY: every score and work word the kernels read is written by the same call first.
            let fresh_scores = unsafe { dev.alloc::<f32>(scores.next_power_of_two()) }?;
            let fresh_hist = stream
                .alloc_zeros::<i32>(hist.next_power_of_two())
                .map_err(cuda_err)?;
            let fresh_work = unsafe { dev.alloc::<u32>(work.next_power_of_two()) }?;
            if let Some(outgrown) = map.insert(dev.id(), (fresh_scores, fresh_hist, fresh_work)) {
                crate::cuda::retire(outgrown);
            }
        }
        let (s, h, w) = map
            .get(&dev.id())
            .ok_or_else(|| cuda_err("dsa_indexer workspace missing"))?;
        let pointers = [
            s.device_ptr(&stream).0,
            h.device_ptr(&stream).0,
            w.device_ptr(&stream).0,
        ];
        Ok(pointers)
    })
}

thread_local! {
    /// Set inside `time_stages`: per launched chunk, events before the scores, between the stages and
    /// after the top-k.
    static STAGE_EVENTS: RefCell<Option<Vec<[CudaEvent; 3]>>> = const { RefCell::new(None) };
}

/// An event on `stream` when `time_stages` is recording on this thread.
fn stage_event(stream: &CudaStream) -> candle_core::Result<Option<CudaEvent>> {
    let recording = STAGE_EVENTS.with(|cell| cell.borrow().is_some());
    if !recording {
        return Ok(None);
    }
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    Ok(Some(stream.record_event(timing).map_err(cuda_err)?))
}

pub(super) fn time_stages<R>(f: impl FnOnce() -> R) -> Result<(R, super::StageTimes)> {
    STAGE_EVENTS.with(|cell| *cell.borrow_mut() = Some(Vec::new()));
    let result = f();
    let events = STAGE_EVENTS
        .with(|cell| cell.borrow_mut().take())
        .unwrap_or_default();
    let mut times = super::StageTimes::default();
    let elapsed = |from: &CudaEvent, to: &CudaEvent| -> Result<std::time::Duration> {
        let ms = from.elapsed_ms(to).map_err(cuda_err)?;
        Ok(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) / 1e3,
        ))
    };
    for [start, between, end] in &events {
        times.scores += elapsed(start, between)?;
        times.top_k += elapsed(between, end)?;
    }
    Ok((result, times))
}

/// A launch configuration of `(x, y)` blocks of `threads` threads and `shared` bytes of dynamic shared memory.
fn launch_config((x, y): (usize, usize), threads: u32, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// Runs the score and top-k kernels; the index tensor is the op's output, the inputs ride along in it.
struct IndexerOp {
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    scales: Option<Tensor>,
    block_table: Tensor,
    token_seq: Tensor,
    visible: Tensor,
    positions: usize,
    top_k: usize,
    fp8: bool,
    launch: DsaIndexerLaunch,
}

impl IndexerOp {
    fn launch(&self, dev: &CudaDevice) -> candle_core::Result<CudaStorage> {
        let stream = dev.cuda_stream();
        let (t_len, heads, dim) = self.q.dims3()?;
        let (num_blocks, block_size, _) = self.keys.dims3()?;
        let (batch, max_blocks) = self.block_table.dims2()?;
        let indices = unsafe { dev.alloc::<i32>(t_len * self.top_k) }?;
        let indices_ptr = indices.device_ptr(&stream).0;
        let positions = self.positions.max(1);
        let segments = positions.div_ceil(SEGMENT);
        // Score rows start 16-byte aligned (the top-k kernels read them as float4).
        let stride = positions.next_multiple_of(4);
        let chunk = (MAX_CHUNK_ELEMS / stride).clamp(1, t_len.max(1));
        let work_stride = 2 * stride + WORK_PER_SEGMENT * segments;
        let [scores_ptr, hist_ptr, work_ptr] = workspace(
            dev,
            chunk * stride,
            chunk * HIST_STRIDE,
            chunk * work_stride,
        )?;
        let q_elem = self.q.dtype().size_in_bytes();
        let key_scales = match &self.scales {
            Some(s) => device_address(s)?.0,
            None => 0,
        };
        let keys = device_address(&self.keys)?.0;
        if keys % 16 != 0 || key_scales % 16 != 0 {
            candle_core::bail!("dsa_indexer: the key cache must start 16-byte aligned");
        }
        let shape = scores::ScoreShape {
            heads,
            dim,
            block_size,
            batch,
            fp8: self.fp8,
            dtype: self.q.dtype(),
            chunk,
            positions,
        };
        let score_stage = scores::ScoreStage::choose(dev, &shape, &self.launch)?;
        let top_k_stage = top_k::TopKStage::choose(dev, positions, chunk, &self.launch)?;
        let (q, weights, block_table, token_seq, visible) = (
            device_address(&self.q)?.0,
            device_address(&self.weights)?.0,
            device_address(&self.block_table)?.0,
            device_address(&self.token_seq)?.0,
            device_address(&self.visible)?.0,
        );
        let f32_scores = self.q.dtype() == DType::F32 && !self.fp8;
        if !f32_scores && q % 16 != 0 {
            // The mma score kernels copy Q in 16-byte pieces (TMA: one bulk copy per token).
            candle_core::bail!("dsa_indexer: q must start 16-byte aligned");
        }
        let key_map = if shape.tma() {
            tensor_map::fp8_key_map(keys, num_blocks * block_size, dim)?
        } else {
            TensorMap::default()
        };
        for start in (0..t_len).step_by(chunk) {
            let len = chunk.min(t_len - start);
            let params = Params(DsaParams {
                q: q + (start * heads * dim * q_elem) as u64,
                weights: weights + (start * heads * 4) as u64,
                keys,
                key_scales,
                block_table,
                token_seq: token_seq + (start * 4) as u64,
                visible: visible + (start * 4) as u64,
                scores: scores_ptr,
                hist: hist_ptr,
                work: work_ptr,
                indices: indices_ptr + (start * self.top_k * 4) as u64,
                t: len as i32,
                h: heads as i32,
                d: dim as i32,
                k: self.top_k as i32,
                block_size: block_size as i32,
                max_blocks: max_blocks as i32,
                batch: batch as i32,
                score_stride: stride as i32,
                positions: positions as i32,
                segments: segments as i32,
                cluster_topk: top_k_stage.is_cluster() as i32,
                key_map,
            });
            let before_scores = stage_event(&stream)?;
            score_stage.launch(&stream, &params, len, positions, heads, dim)?;
            let after_scores = stage_event(&stream)?;
            top_k_stage.launch(&stream, &params, len, positions, self.top_k)?;
            if let (Some(start), Some(between), Some(end)) =
                (before_scores, after_scores, stage_event(&stream)?)
            {
                STAGE_EVENTS.with(|cell| {
                    if let Some(events) = cell.borrow_mut().as_mut() {
                        events.push([start, between, end]);
                    }
                });
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(indices, dev.clone()))
    }
}

impl CustomOp1 for IndexerOp {
    fn name(&self) -> &'static str {
        "dsa_indexer"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("dsa_indexer: the CUDA op got CPU tensors")
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let t_len = self.q.dim(0)?;
        Ok((
            self.launch(storage.device())?,
            Shape::from((t_len, self.top_k)),
        ))
    }
}

pub(super) fn dsa_indexer_paged(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible_keys: &[usize],
    top_k: usize,
    launch: &DsaIndexerLaunch,
) -> Result<Tensor> {
    let positions = visible_keys.iter().copied().max().unwrap_or(0);
    let visible: Vec<i32> = visible_keys.iter().map(|&v| v as i32).collect();
    let visible = Tensor::from_vec(visible, visible_keys.len(), q_index.device())?;
    dsa_indexer_paged_visible(
        q_index,
        head_weights,
        cache,
        &visible,
        positions,
        top_k,
        launch,
    )
}

/// The kernels over counts on the device, `positions` bounding them (the kernels clamp to it).
pub(super) fn dsa_indexer_paged_visible(
    q_index: &Tensor,
    head_weights: &Tensor,
    cache: &PagedIndexKeys,
    visible: &Tensor,
    positions: usize,
    top_k: usize,
    launch: &DsaIndexerLaunch,
) -> Result<Tensor> {
    if positions > super::limits::CUDA_MAX_VISIBLE_KEYS {
        return Err(OpError::Unsupported(format!(
            "dsa_indexer: the CUDA kernels serve at most {} visible keys per query, got {positions}",
            super::limits::CUDA_MAX_VISIBLE_KEYS
        )));
    }
    let (fp8, keys, scales) = match cache.keys {
        IndexKeys::Float(keys) => (false, keys.contiguous()?, None),
        IndexKeys::Fp8 { bytes, scales } => (true, bytes.contiguous()?, Some(scales.contiguous()?)),
    };
    // FP8 keys are scored by the bf16 mma kernel.
    let q = if fp8 {
        q_index.to_dtype(DType::BF16)?
    } else {
        q_index.clone()
    };
    let op = IndexerOp {
        q: q.contiguous()?,
        weights: head_weights.to_dtype(DType::F32)?.contiguous()?,
        keys,
        scales,
        block_table: cache.block_table.contiguous()?,
        token_seq: cache.token_seq.contiguous()?,
        visible: visible.contiguous()?,
        positions,
        top_k,
        fp8,
        launch: *launch,
    };
    Ok(op.q.apply_op1_no_bwd(&op)?)
}
