//! One batched decode scenario over two pools of the same model: one run by `forward_batch` (the reference),
//! the other by a decode path under test (graphs, or the graphs' layout run eagerly). Prompts of different
//! lengths, then decode steps of three sequences that cross block boundaries (and so block-table
//! capacities), then steps of two of them (another batch size). Tokens are fixed ahead, so both pools see
//! the same inputs whatever the logits.

use glm5::candle_core::{DType, Tensor};
use glm5::models::{PagedCacheOptions, PagedKvCache, SeqChunk};
use glm5::{DecodeGraphs, Glm5ForCausalLM};

/// The decode path under test.
pub enum DecodePath<'a> {
    /// `forward_batch_graphed` (prompt steps go through it too).
    Graphed(&'a mut DecodeGraphs),
    /// `forward_batch_graph_layout` with at least this many block-table columns and rows.
    Layout { columns: usize, rows: usize },
}

/// Prompt lengths, then the decode steps: three sequences, then the first and last.
pub const PROMPTS: [usize; 3] = [5, 9, 2];
pub const STEPS_OF_THREE: usize = 12;
pub const STEPS_OF_TWO: usize = 4;

/// The decode steps' batches, in order: the sequences each step feeds.
pub fn decode_batches() -> Vec<Vec<usize>> {
    let mut steps = vec![vec![0, 1, 2]; STEPS_OF_THREE];
    steps.extend(vec![vec![0, 2]; STEPS_OF_TWO]);
    steps
}

/// The `(rows, block-table columns)` shapes the decode steps are captured at: each step's batch at its
/// capture size (`DecodeGraphs::capture_rows`), and its sequences' lengths after it in blocks of
/// `block_size`, rounded up to a power of two.
pub fn decode_shapes(block_size: usize) -> Vec<(usize, usize)> {
    let mut lens = PROMPTS.to_vec();
    decode_batches()
        .iter()
        .map(|seqs| {
            for &s in seqs {
                lens[s] += 1;
            }
            let blocks = seqs
                .iter()
                .map(|&s| lens[s].div_ceil(block_size))
                .max()
                .unwrap();
            (
                DecodeGraphs::capture_rows(seqs.len()),
                blocks.next_power_of_two(),
            )
        })
        .collect()
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32).unwrap().to_vec2().unwrap()
}

/// Runs the scenario; returns the largest |Δ| of any decode step's logit against the reference's, over
/// the reference's largest |logit| (a relative error).
pub fn decode_both_ways(
    model: &Glm5ForCausalLM,
    block_size: usize,
    mut path: DecodePath<'_>,
) -> f32 {
    let vocab = model.config().vocab_size as u32;
    let total =
        PROMPTS.iter().sum::<usize>() + decode_batches().iter().map(Vec::len).sum::<usize>();
    let options = PagedCacheOptions {
        num_blocks: total.div_ceil(block_size) + PROMPTS.len(),
        block_size,
    };
    let new_pool = || -> PagedKvCache { model.new_paged_cache(options).unwrap() };
    let (mut reference, mut tested) = (new_pool(), new_pool());
    let ids: Vec<_> = PROMPTS
        .iter()
        .map(|_| {
            let a = reference.add_sequence();
            assert_eq!(tested.add_sequence(), a);
            a
        })
        .collect();
    // Every sequence's tokens, prompt and decode, fixed ahead.
    let seqs: Vec<Vec<u32>> = (0..PROMPTS.len() as u32)
        .map(|s| {
            (0..total as u32)
                .map(|i| (i * 37 + s * 101 + 7) % vocab)
                .collect()
        })
        .collect();
    let mut lens = vec![0usize; PROMPTS.len()];
    let chunk = |s: usize, n: usize, lens: &[usize]| SeqChunk {
        seq: ids[s],
        tokens: &seqs[s][lens[s]..lens[s] + n],
        start_pos: lens[s],
    };
    let prompts: Vec<SeqChunk> = PROMPTS
        .iter()
        .enumerate()
        .map(|(s, &n)| chunk(s, n, &lens))
        .collect();
    model.forward_batch(&prompts, &mut reference).unwrap();
    match &mut path {
        DecodePath::Graphed(graphs) => {
            model
                .forward_batch_graphed(graphs, &prompts, &mut tested)
                .unwrap();
        }
        DecodePath::Layout { .. } => {
            model.forward_batch(&prompts, &mut tested).unwrap();
        }
    }
    for (s, &n) in PROMPTS.iter().enumerate() {
        lens[s] += n;
    }
    let mut worst: f32 = 0.0;
    for seqs_now in decode_batches() {
        let batch: Vec<SeqChunk> = seqs_now.iter().map(|&s| chunk(s, 1, &lens)).collect();
        let want = rows(&model.forward_batch(&batch, &mut reference).unwrap());
        let got = rows(&match &mut path {
            DecodePath::Graphed(graphs) => model
                .forward_batch_graphed(graphs, &batch, &mut tested)
                .unwrap(),
            DecodePath::Layout { columns, rows } => model
                .forward_batch_graph_layout(&batch, &mut tested, *columns, *rows)
                .unwrap(),
        });
        assert_eq!(got.len(), batch.len());
        let scale = want
            .iter()
            .flatten()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        for (g, w) in got.iter().zip(&want) {
            assert!(g.iter().all(|v| v.is_finite()), "non-finite logits");
            let diff = g
                .iter()
                .zip(w)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff / scale);
        }
        for &s in &seqs_now {
            lens[s] += 1;
            assert_eq!(tested.seq_len(ids[s]).unwrap(), lens[s]);
        }
    }
    worst
}
