//! Several sequences in one forward over the paged KV pool (`forward_batch`), on the CPU in f32: prompt
//! chunks and decode tokens of sequences of different lengths share steps, and every sequence's logits equal
//! the same sequence run alone through `forward` over its own contiguous cache (itself checked against HF
//! transformers by tests/model_parity.rs; one sequence here is the fixture's own input, checked against HF's
//! logits directly). Blocks of 4 tokens, so sequences cross block boundaries mid-chunk.

use glm5::candle_core::{DType, Device, Tensor};
use glm5::models::{Checkpoint, PagedCacheOptions, PagedKvCache, SeqChunk, SeqId};
use glm5::{
    AttentionMode, Config, DecodeGraphs, DeviceDesc, Glm5ForCausalLM, KeyFormat, ModelError, Plan,
    PlanOptions, Registry,
};

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{fixture_dir, load_split, reference};

const BLOCK: usize = 4;

fn load(name: &str, mode: AttentionMode, keys: KeyFormat) -> Glm5ForCausalLM {
    let dir = fixture_dir(name);
    let config = Config::from_file(dir.join("config.json")).unwrap();
    let mut options = PlanOptions::new(DType::F32, mode);
    options.index_keys = keys;
    let plan = Plan::build(
        &config,
        vec![DeviceDesc::of(&Device::Cpu).unwrap()],
        &options,
        &Registry::builtin(),
    )
    .unwrap();
    Glm5ForCausalLM::load_planned(
        &config,
        &Checkpoint::open(&dir).unwrap(),
        plan,
        &[Device::Cpu],
    )
    .unwrap()
}

fn pool(model: &Glm5ForCausalLM, num_blocks: usize) -> PagedKvCache {
    model
        .new_paged_cache(PagedCacheOptions {
            num_blocks,
            block_size: BLOCK,
        })
        .unwrap()
}

/// Token ids in `0..vocab` from a fixed linear congruential generator (distinct per `seed`).
fn tokens(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32).unwrap().to_vec2().unwrap()
}

/// Every position's logits of `ids` run alone: one prefill over a contiguous cache.
fn alone(model: &Glm5ForCausalLM, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(ids.len()).unwrap();
    rows(&model.forward(ids, 0, &mut cache).unwrap())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs `schedule` (per step: `(sequence, tokens it feeds)`) over `pool` with `forward_batch_all`, checks
/// `forward_batch`'s last-token rows against it on a copy of every step, and returns each sequence's rows.
fn run_schedule(
    model: &Glm5ForCausalLM,
    pool: &mut PagedKvCache,
    seqs: &[Vec<u32>],
    schedule: &[Vec<(usize, usize)>],
) -> Vec<Vec<Vec<f32>>> {
    let ids: Vec<SeqId> = seqs.iter().map(|_| pool.add_sequence()).collect();
    let mut fed = vec![0usize; seqs.len()];
    let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); seqs.len()];
    for step in schedule {
        let batch: Vec<SeqChunk> = step
            .iter()
            .map(|&(s, n)| SeqChunk {
                seq: ids[s],
                tokens: &seqs[s][fed[s]..fed[s] + n],
                start_pos: fed[s],
            })
            .collect();
        let logits = rows(&model.forward_batch_all(&batch, pool).unwrap());
        let total: usize = step.iter().map(|&(_, n)| n).sum();
        assert_eq!(logits.len(), total);
        let mut at = 0;
        for &(s, n) in step {
            out[s].extend(logits[at..at + n].iter().cloned());
            at += n;
            fed[s] += n;
            assert_eq!(pool.seq_len(ids[s]).unwrap(), fed[s]);
            assert_eq!(
                pool.seq_blocks(ids[s]).unwrap(),
                fed[s].div_ceil(BLOCK),
                "blocks are taken as a sequence grows"
            );
        }
    }
    out
}

/// Four sequences of different lengths (none a multiple of the block): prefill chunks and decode tokens in
/// the same steps, sequences joining late.
fn mixed_schedule() -> (Vec<usize>, Vec<Vec<(usize, usize)>>) {
    let lengths = vec![19, 14, 11, 6];
    let schedule = vec![
        vec![(0, 7), (1, 5)],                 // two prefills
        vec![(0, 1), (1, 6), (2, 9)],         // a decode, a second chunk, a new prefill
        vec![(0, 1), (1, 1), (2, 1), (3, 3)], // decodes and a late prefill
        vec![(3, 1), (0, 5), (2, 1)],         // order changes; a chunk after decodes
        vec![(0, 1), (1, 1), (3, 1)],
        vec![(0, 1), (1, 1), (3, 1)],
        vec![(0, 3)],
    ];
    (lengths, schedule)
}

fn check_against_alone(model: &Glm5ForCausalLM, seqs: &[Vec<u32>], got: &[Vec<Vec<f32>>]) -> f32 {
    let mut worst = 0f32;
    for (s, ids) in seqs.iter().enumerate() {
        let want = alone(model, ids);
        assert_eq!(got[s].len(), ids.len(), "sequence {s} fed every token");
        for (pos, (g, w)) in got[s].iter().zip(&want).enumerate() {
            let d = max_diff(g, w);
            assert!(
                d < 1e-5,
                "sequence {s} position {pos}: max |batched - alone| = {d}"
            );
            worst = worst.max(d);
        }
    }
    worst
}

fn mixed_batches_equal_sequences_alone(name: &str, mode: AttentionMode, keys: KeyFormat) {
    let model = load(name, mode, keys);
    let vocab = model.config().vocab_size;
    let (lengths, schedule) = mixed_schedule();
    let seqs: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(i as u64 + 1, n, vocab))
        .collect();
    let blocks: usize = lengths.iter().map(|n| n.div_ceil(BLOCK)).sum();
    let mut pool = pool(&model, blocks);
    let got = run_schedule(&model, &mut pool, &seqs, &schedule);
    assert_eq!(pool.free_blocks(), 0, "the pool was sized exactly");
    let worst = check_against_alone(&model, &seqs, &got);
    println!("{name} {mode:?} {keys:?}: max |batched - alone| = {worst:e}");
}

#[test]
fn sparse_batches_equal_each_sequence_alone() {
    // index_topk 8: past 8 positions the indexer really selects, through the block tables.
    mixed_batches_equal_sequences_alone("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
}

#[test]
fn fp8_index_key_batches_equal_each_sequence_alone() {
    mixed_batches_equal_sequences_alone("sparse_long", AttentionMode::Sparse, KeyFormat::Fp8E4m3);
}

#[test]
fn dense_batches_equal_each_sequence_alone() {
    mixed_batches_equal_sequences_alone("dense_equiv", AttentionMode::Dense, KeyFormat::Float);
}

/// The fixture's own input, fed in chunks next to another sequence, against HF transformers' logits.
#[test]
fn batched_fixture_input_matches_hf() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    let (ids, hf) = reference("sparse_long");
    let other = tokens(42, 30, model.config().vocab_size);
    let seqs = vec![ids.clone(), other];
    let n = ids.len();
    let schedule = vec![
        vec![(0, 13), (1, 10)],
        vec![(1, 10), (0, 1)],
        vec![(0, n - 14), (1, 10)],
    ];
    let mut pool = pool(&model, 64);
    let got = run_schedule(&model, &mut pool, &seqs, &schedule);
    let hf = rows(&hf);
    for (pos, (g, w)) in got[0].iter().zip(&hf).enumerate() {
        let d = max_diff(g, w);
        assert!(d < 1e-4, "position {pos}: max |batched - HF| = {d}");
    }
    check_against_alone(&model, &seqs, &got);
}

/// `forward_batch` returns each entry's last row of `forward_batch_all`.
#[test]
fn last_token_logits_are_the_last_rows() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    let vocab = model.config().vocab_size;
    let seqs: Vec<Vec<u32>> = (0..3).map(|i| tokens(i + 7, 9, vocab)).collect();
    let chunks = [5usize, 1, 9];
    let run = |last_only: bool| -> Vec<Vec<f32>> {
        let mut pool = pool(&model, 16);
        let ids: Vec<SeqId> = seqs.iter().map(|_| pool.add_sequence()).collect();
        let batch: Vec<SeqChunk> = (0..3)
            .map(|s| SeqChunk {
                seq: ids[s],
                tokens: &seqs[s][..chunks[s]],
                start_pos: 0,
            })
            .collect();
        let logits = if last_only {
            model.forward_batch(&batch, &mut pool).unwrap()
        } else {
            model.forward_batch_all(&batch, &mut pool).unwrap()
        };
        rows(&logits)
    };
    let (last, all) = (run(true), run(false));
    assert_eq!(last.len(), 3);
    let mut end = 0;
    for (s, &n) in chunks.iter().enumerate() {
        end += n;
        assert_eq!(last[s], all[end - 1], "entry {s}");
    }
}

/// A freed sequence's blocks go back to the pool, and a new sequence written over them computes what it
/// computes alone; truncating a sequence frees its tail and it continues from there.
#[test]
fn ended_sequences_free_their_blocks_for_reuse() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    let vocab = model.config().vocab_size;
    let mut pool = pool(&model, 6);
    let first = tokens(3, 22, vocab);
    let a = pool.add_sequence();
    model
        .forward_batch(
            &[SeqChunk {
                seq: a,
                tokens: &first,
                start_pos: 0,
            }],
            &mut pool,
        )
        .unwrap();
    assert_eq!((pool.blocks_in_use(), pool.free_blocks()), (6, 0));
    assert_eq!(pool.free_sequence(a).unwrap(), 6);
    assert_eq!((pool.blocks_in_use(), pool.free_blocks()), (0, 6));
    assert!(matches!(
        pool.seq_len(a),
        Err(ModelError::UnknownSequence { .. })
    ));

    // Two sequences over the freed (dirty) blocks.
    let seqs = vec![tokens(4, 10, vocab), tokens(5, 9, vocab)];
    let schedule = vec![vec![(0, 6), (1, 4)], vec![(0, 4), (1, 5)]];
    let got = run_schedule(&model, &mut pool, &seqs, &schedule);
    assert_eq!(pool.blocks_in_use(), 3 + 3);
    check_against_alone(&model, &seqs, &got);

    // Truncate: keep 5 tokens of a new sequence, then continue it with other tokens.
    let mut pool = self::pool(&model, 8);
    let b = pool.add_sequence();
    let long = tokens(6, 13, vocab);
    model
        .forward_batch(
            &[SeqChunk {
                seq: b,
                tokens: &long,
                start_pos: 0,
            }],
            &mut pool,
        )
        .unwrap();
    assert_eq!(pool.seq_blocks(b).unwrap(), 4);
    pool.truncate_sequence(b, 5).unwrap();
    assert_eq!(
        (pool.seq_len(b).unwrap(), pool.seq_blocks(b).unwrap()),
        (5, 2)
    );
    assert_eq!(pool.free_blocks(), 6);
    let tail = tokens(7, 6, vocab);
    let next = [SeqChunk {
        seq: b,
        tokens: &tail,
        start_pos: 5,
    }];
    let got = rows(&model.forward_batch_all(&next, &mut pool).unwrap());
    let whole: Vec<u32> = long[..5].iter().chain(&tail).copied().collect();
    let want = alone(&model, &whole);
    for (i, g) in got.iter().enumerate() {
        let d = max_diff(g, &want[5 + i]);
        assert!(d < 1e-5, "position {}: {d}", 5 + i);
    }
}

/// A fork shares the whole blocks of another sequence's prefix: forks continuing it with their own tokens
/// (in one step, alongside the source's own continuation) compute what each whole sequence computes alone;
/// a shared block goes back to the pool only when its last holder lets go, and a truncation that would end
/// inside a shared block ends at its start.
#[test]
fn forks_share_whole_prefix_blocks_until_the_last_holder_lets_go() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    let vocab = model.config().vocab_size;
    let mut pool = pool(&model, 16);
    let prefix = tokens(11, 14, vocab); // 3 whole blocks of 4 and 2 tokens
    let a = pool.add_sequence();
    model
        .forward_batch(
            &[SeqChunk {
                seq: a,
                tokens: &prefix,
                start_pos: 0,
            }],
            &mut pool,
        )
        .unwrap();
    assert_eq!(pool.blocks_in_use(), 4);
    // Forks of 14 and of 9 tokens hold the whole blocks: 12 and 8 tokens.
    let (b, c) = (pool.fork(a, 14).unwrap(), pool.fork(a, 9).unwrap());
    assert_eq!(
        (pool.seq_len(b).unwrap(), pool.seq_blocks(b).unwrap()),
        (12, 3)
    );
    assert_eq!(
        (pool.seq_len(c).unwrap(), pool.seq_blocks(c).unwrap()),
        (8, 2)
    );
    assert_eq!(pool.blocks_in_use(), 4, "a fork takes no block");
    assert_eq!(pool.exclusive_blocks(a).unwrap(), 1);
    assert_eq!(pool.exclusive_blocks(c).unwrap(), 0);
    // One step: the source goes on with its own tokens, each fork from its length with others.
    let (tail_a, tail_b, tail_c) = (
        tokens(12, 5, vocab),
        tokens(13, 6, vocab),
        tokens(14, 7, vocab),
    );
    let step = [
        SeqChunk {
            seq: a,
            tokens: &tail_a,
            start_pos: 14,
        },
        SeqChunk {
            seq: b,
            tokens: &tail_b,
            start_pos: 12,
        },
        SeqChunk {
            seq: c,
            tokens: &tail_c,
            start_pos: 8,
        },
    ];
    let got = rows(&model.forward_batch_all(&step, &mut pool).unwrap());
    let mut at = 0;
    for (start, tail) in [(14, &tail_a), (12, &tail_b), (8, &tail_c)] {
        let whole: Vec<u32> = prefix[..start].iter().chain(tail.iter()).copied().collect();
        let want = alone(&model, &whole);
        for (i, g) in got[at..at + tail.len()].iter().enumerate() {
            let d = max_diff(g, &want[start + i]);
            assert!(
                d < 1e-5,
                "sequence from {start}, position {}: {d}",
                start + i
            );
        }
        at += tail.len();
    }
    // a: 19 tokens in 5 blocks (2 its own); b: 18 in 5 (2 its own); c: 15 in 4 (2 its own).
    assert_eq!(pool.blocks_in_use(), 3 + 2 + 2 + 2);
    // Freeing the source keeps the blocks the forks hold.
    assert_eq!(pool.free_sequence(a).unwrap(), 5);
    assert_eq!(pool.blocks_in_use(), 3 + 2 + 2);
    // b ends inside its own block: kept as asked. c would end inside a block b holds too: at its start.
    pool.truncate_sequence(b, 13).unwrap();
    assert_eq!(
        (pool.seq_len(b).unwrap(), pool.seq_blocks(b).unwrap()),
        (13, 4)
    );
    pool.truncate_sequence(c, 6).unwrap();
    assert_eq!(
        (pool.seq_len(c).unwrap(), pool.seq_blocks(c).unwrap()),
        (4, 1)
    );
    // c goes on from 4: what it computes is the whole sequence's, and b's rows are untouched.
    let tail = tokens(15, 3, vocab);
    let more = [SeqChunk {
        seq: c,
        tokens: &tail,
        start_pos: 4,
    }];
    let got = rows(&model.forward_batch_all(&more, &mut pool).unwrap());
    let whole: Vec<u32> = prefix[..4].iter().chain(&tail).copied().collect();
    let want = alone(&model, &whole);
    for (i, g) in got.iter().enumerate() {
        assert!(max_diff(g, &want[4 + i]) < 1e-5, "position {}", 4 + i);
    }
    let next = tokens(16, 2, vocab);
    let more = [SeqChunk {
        seq: b,
        tokens: &next,
        start_pos: 13,
    }];
    let got = rows(&model.forward_batch_all(&more, &mut pool).unwrap());
    let whole: Vec<u32> = prefix[..12]
        .iter()
        .chain(&tail_b[..1])
        .chain(&next)
        .copied()
        .collect();
    let want = alone(&model, &whole);
    for (i, g) in got.iter().enumerate() {
        assert!(max_diff(g, &want[13 + i]) < 1e-5, "b position {}", 13 + i);
    }
    pool.free_sequence(b).unwrap();
    pool.free_sequence(c).unwrap();
    assert_eq!((pool.blocks_in_use(), pool.free_blocks()), (0, 16));
    assert!(matches!(
        pool.fork(a, 4),
        Err(ModelError::UnknownSequence { .. })
    ));
}

/// Asking for more blocks than are free is a typed error that changes nothing; freeing a sequence makes
/// room.
#[test]
fn pool_exhaustion_is_a_typed_error() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    let vocab = model.config().vocab_size;
    let mut pool = pool(&model, 3);
    let (a, b) = (pool.add_sequence(), pool.add_sequence());
    let ta = tokens(8, 10, vocab);
    let tb = tokens(9, 3, vocab);
    model
        .forward_batch(
            &[SeqChunk {
                seq: a,
                tokens: &ta,
                start_pos: 0,
            }],
            &mut pool,
        )
        .unwrap();
    assert_eq!(pool.free_blocks(), 0);
    // `a` still has room in its last block (10 of 12 rows), `b` needs a block: the whole batch fails.
    let batch = [
        SeqChunk {
            seq: a,
            tokens: &ta[..1],
            start_pos: 10,
        },
        SeqChunk {
            seq: b,
            tokens: &tb,
            start_pos: 0,
        },
    ];
    match model.forward_batch(&batch, &mut pool) {
        Err(ModelError::PoolExhausted {
            needed,
            free,
            block_size,
        }) => assert_eq!((needed, free, block_size), (1, 0, BLOCK)),
        other => panic!("expected PoolExhausted, got {other:?}"),
    }
    assert_eq!(pool.seq_len(a).unwrap(), 10, "nothing changed");
    assert_eq!(pool.seq_len(b).unwrap(), 0);
    assert_eq!(pool.blocks_in_use(), 3);
    // Within its last block `a` still decodes.
    model.forward_batch(&batch[..1], &mut pool).unwrap();
    assert_eq!(pool.seq_len(a).unwrap(), 11);
    pool.free_sequence(a).unwrap();
    model.forward_batch(&batch[1..], &mut pool).unwrap();
    assert_eq!(pool.blocks_in_use(), 1);
}

/// Every malformed batch is a typed error naming its cause, with the pool unchanged.
#[test]
fn bad_batches_are_typed_errors() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    let config = model.config().clone();
    let mut pool = pool(&model, 8);
    let (a, gone) = (pool.add_sequence(), pool.add_sequence());
    pool.free_sequence(gone).unwrap();
    let ok = [1u32, 2, 3];
    model
        .forward_batch(
            &[SeqChunk {
                seq: a,
                tokens: &ok,
                start_pos: 0,
            }],
            &mut pool,
        )
        .unwrap();
    let bad_token = [1u32, config.vocab_size as u32];
    let chunk = |seq, tokens, start_pos| SeqChunk {
        seq,
        tokens,
        start_pos,
    };
    let cases: Vec<(Vec<SeqChunk>, &str)> = vec![
        (vec![], "EmptyInput"),
        (vec![chunk(a, &ok[..0], 3)], "EmptyInput"),
        (vec![chunk(gone, &ok, 0)], "UnknownSequence"),
        (
            vec![chunk(a, &ok, 3), chunk(a, &ok, 3)],
            "DuplicateSequence",
        ),
        (vec![chunk(a, &ok, 2)], "SequenceMismatch"),
        (vec![chunk(a, &bad_token, 3)], "TokenOutOfRange"),
        (
            vec![chunk(a, &ok, config.max_position_embeddings - 1)],
            "ContextOverflow",
        ),
    ];
    for (batch, want) in cases {
        let err = model.forward_batch(&batch, &mut pool).unwrap_err();
        let name = format!("{err:?}");
        assert!(name.starts_with(want), "expected {want}, got {err}");
        assert!(!err.to_string().is_empty());
        assert_eq!(pool.seq_len(a).unwrap(), 3, "{want}: nothing changed");
        assert_eq!(pool.blocks_in_use(), 1, "{want}: nothing changed");
    }
    assert!(matches!(
        pool.free_sequence(gone),
        Err(ModelError::UnknownSequence { .. })
    ));
    // A pool made for another model.
    let other = load("dense_equiv", AttentionMode::Dense, KeyFormat::Float);
    let mut foreign = self::pool(&other, 4);
    let s = foreign.add_sequence();
    // dense_equiv has 3 layers, sparse_long 4.
    assert!(matches!(
        model.forward_batch(&[chunk(s, &ok, 0)], &mut foreign),
        Err(ModelError::CacheShape(_))
    ));
}

/// Pool sizes are checked before anything is allocated.
#[test]
fn pool_sizes_are_checked() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    for (num_blocks, block_size) in [(0, 4), (4, 0), (usize::MAX / 2, 64), (1 << 40, 1)] {
        match model.new_paged_cache(PagedCacheOptions {
            num_blocks,
            block_size,
        }) {
            Err(ModelError::PagedCache(message)) => println!("{message}"),
            other => panic!(
                "{num_blocks} x {block_size}: expected PagedCache, got {other:?}",
                other = other.map(|_| ())
            ),
        }
    }
    let options = PagedCacheOptions::for_tokens(100);
    assert_eq!(options.block_size, glm5::models::DEFAULT_BLOCK_SIZE);
    assert!(options.tokens() >= 100 && options.tokens() < 100 + options.block_size);
}

#[path = "common/decode_steps.rs"]
mod decode_steps;
use decode_steps::{decode_both_ways, decode_shapes, DecodePath};

/// The inputs a decode graph reads (rows padded to the capture size with copies of the last sequence, block
/// tables padded to a power-of-two width, RoPE rows gathered on the device, the indexer bounded by the
/// table's capacity), run eagerly: the same logits as `forward_batch`, at the sizes the graphs pick and at
/// much larger ones.
#[test]
fn graph_layout_decode_equals_forward_batch() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    for (columns, rows) in [(1, 1), (16, 1), (1, 8)] {
        let err = decode_both_ways(&model, BLOCK, DecodePath::Layout { columns, rows });
        assert!(
            err <= 1e-5,
            "{columns} columns, {rows} rows: relative error {err}"
        );
    }
}

/// On the CPU no step is captured: every step runs eagerly, with the same logits, and the stats say so and
/// why.
#[test]
fn graphed_decode_on_the_cpu_runs_eagerly_and_says_why() {
    let model = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    assert!(model
        .decode_graph_blocker(1)
        .is_some_and(|why| why.contains("CUDA device")));
    let mut graphs = DecodeGraphs::new(4);
    let err = decode_both_ways(&model, BLOCK, DecodePath::Graphed(&mut graphs));
    assert_eq!(err, 0.0, "the eager fallback is forward_batch itself");
    let stats = graphs.stats();
    assert_eq!((stats.captured, stats.replayed), (0, 0));
    assert_eq!(stats.eager, 1 + decode_shapes(BLOCK).len(), "every step");
    assert!(stats
        .last_eager_reason
        .as_deref()
        .is_some_and(|why| why.contains("CUDA device")));
    assert!(graphs.is_empty());
}

/// A model whose layers are placed on two plan devices (both the CPU): `forward_batch` equals the one-device
/// model's, and the graphs' layout, made on each device its layers use, equals its `forward_batch`.
#[test]
fn split_model_batches_and_graph_layout_equal_one_device() {
    let single = load("sparse_long", AttentionMode::Sparse, KeyFormat::Float);
    let split = load_split("sparse_long", &[Device::Cpu, Device::Cpu]);
    // Prompt chunks of different lengths in one step, then a decode step of both.
    let vocab = single.config().vocab_size;
    let seqs = vec![tokens(1, 7, vocab), tokens(2, 3, vocab)];
    let schedule = vec![vec![(0, 6), (1, 2)], vec![(0, 1), (1, 1)]];
    let want = run_schedule(&single, &mut pool(&single, 8), &seqs, &schedule);
    let got = run_schedule(&split, &mut pool(&split, 8), &seqs, &schedule);
    assert_eq!(got.concat().len(), want.concat().len());
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        assert_eq!(max_diff(g, w), 0.0, "split vs one device");
    }
    assert_eq!(split.transfers(), 2, "one hop a step");
    let err = decode_both_ways(
        &split,
        BLOCK,
        DecodePath::Layout {
            columns: 1,
            rows: 1,
        },
    );
    assert!(
        err <= 1e-5,
        "split model, graph layout: relative error {err}"
    );
}
