//! `glm5-bench sparse-mla`: sparse_mla decode rows at GLM-5's shapes, each kernel of the launcher against
//! the candle-ops reference and the device's ceilings.

use glm5::candle_core::{DType, Device, Result, Tensor};
use glm5::ops::{
    sparse_mla_paged_with, sparse_mla_reference, NarrowHeads, PagedLatentCache, SparseMlaLaunch,
};

use crate::ceilings::gather_seconds;
use crate::timing::{cold_seconds, graph_seconds, median_seconds};
use crate::{cuda, next, BLOCK_SIZE, TOP_K};

/// GLM-5's latent row and value widths.
pub const ROW_DIM: usize = 576;
pub const VALUE_DIM: usize = 512;

/// A decode batch over a paged cache: `batch` sequences of `context` tokens, one query token each, whose
/// top-k are `TOP_K` distinct random positions.
pub struct Decode {
    q: Tensor,
    pub blocks: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    token_seq: Tensor,
    indices: Tensor,
    /// The same selection as physical rows of `blocks`, for the reference path.
    pub physical: Tensor,
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

    fn kernel(&self, launch: &SparseMlaLaunch) -> Result<()> {
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
            launch,
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

/// sparse_mla rows: every context, batch and head count of the table (or `only` one), each kernel of the
/// launcher (`kernel_label`: one of them), against the reference and the ceilings.
pub fn sparse_mla_rows(
    device: &Device,
    copy: f64,
    peak: f64,
    only: Option<(usize, usize, usize)>,
    kernel_label: Option<&str>,
) -> Result<()> {
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
    let shapes: Vec<(usize, usize, usize)> = match only {
        Some(shape) => vec![shape],
        None => [32_768usize, 131_072]
            .iter()
            .flat_map(|&c| {
                [8usize, 16, 64]
                    .iter()
                    .flat_map(move |&h| [1usize, 8, 64, 128].map(|b| (c, b, h)))
            })
            .collect(),
    };
    let wgmma =
        glm5::ops::DeviceDesc::of(device).map_err(cuda)?.family() == glm5::ops::DeviceFamily::Sm90;
    for &(context, batch, heads) in &shapes {
        let problem = Decode::new(
            device,
            batch,
            heads,
            context,
            (context * 1000 + heads * 10 + batch) as u64,
        )?;
        let reference = median_seconds(device, 3, 2, || problem.reference())?;
        // Bytes the op must move: the selected rows, q, out, lse and the indices.
        let bytes = (batch * TOP_K * ROW_DIM * 2
            + batch * heads * (ROW_DIM + VALUE_DIM) * 2
            + batch * heads * 4
            + batch * TOP_K * 4) as f64;
        let flops = (batch * heads * TOP_K * 2 * (ROW_DIM + VALUE_DIM)) as f64;
        // (label, launch): the mma.sync launcher's pick first, then the alternatives.
        let mma = SparseMlaLaunch::backend("cuda-bf16-mma").map_err(cuda)?;
        let mut kernels = vec![("mma", mma)];
        if heads <= 8 {
            kernels.push(("tiles", mma.narrow_heads(NarrowHeads::Off)));
            for (label, warps) in [("n2", 2), ("n4", 4), ("n8", 8)] {
                if TOP_K.div_ceil(16 * warps) <= 128 {
                    kernels.push((label, mma.narrow_heads(NarrowHeads::Warps(warps))));
                }
            }
        }
        if wgmma && heads.is_multiple_of(64) {
            let wgmma = SparseMlaLaunch::backend("cuda-bf16-wgmma").map_err(cuda)?;
            kernels.push(("wgmma", wgmma));
        }
        // `glm5-bench sparse-mla CONTEXT BATCH HEADS --kernel LABEL`: that row only (e.g. under a profiler).
        if let Some(wanted) = kernel_label {
            kernels.retain(|(label, _)| *label == wanted);
        }
        let mut mma_gpu = None;
        for (label, launch) in kernels {
            let wall = median_seconds(device, 7, 20, || problem.kernel(&launch))?;
            let gpu = graph_seconds(device, 20, || problem.kernel(&launch))?;
            let cold = cold_seconds(device, 7, || problem.kernel(&launch))?;
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
        let gather = gather_seconds(device, &problem)?;
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
    Ok(())
}
