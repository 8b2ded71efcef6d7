//! `glm5-bench indexer`: dsa_indexer rows over GLM-5's FP8 key cache, decode and prefill, against the
//! candle-ops reference and the device's ceilings.

use glm5::candle_core::{DType, Device, Result, Tensor};
use glm5::ops::{
    dsa_indexer_paged_with, dsa_indexer_reference, quantize_fp8, DsaIndexerLaunch, IndexKeys,
    PagedIndexKeys, ScoreKernel, TopKPath, VisibleKeys,
};

use crate::ceilings::key_read_seconds;
use crate::timing::{cold_seconds, graph_seconds, median_seconds};
use crate::{cuda, next, BLOCK_SIZE, TOP_K};

/// GLM-5's indexer: 32 heads of 128, FP8 keys of 128 bytes + an f32 scale.
const INDEX_HEADS: usize = 32;
const INDEX_DIM: usize = 128;

/// An indexer batch over a paged FP8 key cache: `batch` sequences of `context` keys, and `queries` query
/// tokens per sequence (1: decode; a prefill chunk: the last `queries` positions, causal).
pub struct IndexerProblem {
    /// The launch every call runs (the policy unless a score kernel is pinned).
    launch: DsaIndexerLaunch,
    q: Tensor,
    weights: Tensor,
    pub bytes: Tensor,
    pub scales: Tensor,
    block_table: Tensor,
    token_seq: Tensor,
    visible: Vec<usize>,
    /// The same counts on the device (`I32 [T]`): the graph-capturable call uploads nothing.
    visible_on_device: Tensor,
    /// Contiguous bf16 keys of sequence 0 (all sequences' keys for the reference path are alike in cost).
    reference_keys: Tensor,
}

impl IndexerProblem {
    fn new(
        device: &Device,
        launch: DsaIndexerLaunch,
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
            launch,
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
        let visible = VisibleKeys::Host(&self.visible);
        dsa_indexer_paged_with(
            &self.q,
            &self.weights,
            &self.cache(),
            visible,
            TOP_K,
            &self.launch,
        )
        .map(|_| ())
        .map_err(cuda)
    }

    /// The op over counts kept on the device (what a graph-captured decode step calls).
    fn kernel_on_device(&self) -> Result<()> {
        self.kernel_on_device_with(&self.launch)
    }

    /// [`Self::kernel_on_device`] with another launch (a top-k path pinned).
    fn kernel_on_device_with(&self, launch: &DsaIndexerLaunch) -> Result<()> {
        let visible = VisibleKeys::Device {
            counts: &self.visible_on_device,
            max_visible: self.visible.iter().copied().max().unwrap_or(0),
        };
        dsa_indexer_paged_with(
            &self.q,
            &self.weights,
            &self.cache(),
            visible,
            TOP_K,
            launch,
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
pub fn indexer_rows(
    device: &Device,
    copy: f64,
    peak: f64,
    only: Option<(usize, usize, usize)>,
    score_kernel: ScoreKernel,
) -> Result<()> {
    let launch = DsaIndexerLaunch {
        score_kernel,
        ..DsaIndexerLaunch::default()
    };
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
        let problem = IndexerProblem::new(
            device,
            launch,
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
        let pinned = |top_k_path| DsaIndexerLaunch {
            top_k_path,
            ..launch
        };
        let chain = graph_seconds(device, 20, || {
            problem.kernel_on_device_with(&pinned(TopKPath::Chain))
        })?;
        // ... and pinned to the cluster top-k, so that the policy's row-length bound can be checked
        // (rows it cannot take run the chain there too).
        let cluster = graph_seconds(device, 20, || {
            problem.kernel_on_device_with(&pinned(TopKPath::Cluster))
        })?;
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
