//! The CUDA dsa_indexer kernels against an independent f32 computation on fresh random inputs, paged keys
//! in bf16 and FP8: the selected set must equal the reference's on every row whose K-th and (K+1)-th scores
//! are further apart than the kernel's rounding; rows that differ are printed with their gap.
//! Needs a GPU: built with `--features cuda` and run by `scripts/gpu-run.sh`. `GLM5_QUICK=1` shrinks the grid.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use glm5_ops::{
    dsa_indexer, dsa_indexer_paged, dsa_indexer_paged_device_visible, dsa_indexer_paged_with,
    quantize_fp8, DsaIndexerLaunch, IndexKeys, PagedIndexKeys, ScoreKernel, TopKPath, VisibleKeys,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 64;
const DIM: usize = 128;

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

fn quick() -> bool {
    std::env::var_os("GLM5_QUICK").is_some()
}

/// Rounds to bf16 and back (the kernel's input precision).
fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

/// Two sequences (a prefill chunk: one) of `n` keys in shuffled blocks and the queries of `token_seq`, query t
/// seeing `visible[t]`.
struct Problem {
    heads: usize,
    n: usize,
    q: Vec<f32>,           // [queries, H, D], bf16-exact
    w: Vec<f32>,           // [queries, H]
    keys: Vec<f32>,        // [num_blocks * BLOCK, D] f32
    block_table: Vec<i32>, // [sequences, max_blocks]
    max_blocks: usize,
    token_seq: Vec<i32>,
    visible: Vec<usize>,
}

impl Problem {
    /// Three queries: one per sequence seeing all `n`, and one of sequence 0 seeing `n - 1` (or 1).
    fn new(rng: &mut StdRng, heads: usize, n: usize) -> Self {
        Self::with_queries(rng, heads, n, vec![0, 1, 0], vec![n, n, (n - 1).max(1)])
    }

    /// A prefill chunk of `queries` tokens at the end of the one sequence's `n` keys (causal: query t sees
    /// `n - queries + 1 + t`); a block table of one row (the grouped prefill kernel's case).
    fn prefill_chunk(rng: &mut StdRng, heads: usize, n: usize, queries: usize) -> Self {
        let visible = (0..queries).map(|t| n - queries + 1 + t).collect();
        let mut p = Self::with_queries(rng, heads, n, vec![0; queries], visible);
        p.block_table.truncate(p.max_blocks);
        p
    }

    fn with_queries(
        rng: &mut StdRng,
        heads: usize,
        n: usize,
        token_seq: Vec<i32>,
        visible: Vec<usize>,
    ) -> Self {
        let tokens = token_seq.len();
        let max_blocks = n.div_ceil(BLOCK);
        let num_blocks = 2 * max_blocks;
        let mut order: Vec<i32> = (0..num_blocks as i32).collect();
        order.shuffle(rng);
        let keys: Vec<f32> = (0..num_blocks * BLOCK * DIM)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let q = bf16_round(
            &(0..tokens * heads * DIM)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect::<Vec<_>>(),
        );
        let w = (0..tokens * heads)
            .map(|_| rng.random_range(-0.5f32..1.0))
            .collect();
        Self {
            heads,
            n,
            q,
            w,
            keys,
            block_table: order,
            max_blocks,
            token_seq,
            visible,
        }
    }

    fn row(&self, t: usize, s: usize) -> usize {
        let seq = self.token_seq[t] as usize;
        self.block_table[seq * self.max_blocks + s / BLOCK] as usize * BLOCK + s % BLOCK
    }

    /// f32 scores of query `t` over its visible keys, keys given as f32 rows.
    fn scores(&self, t: usize, keys: &[f32]) -> Vec<f32> {
        (0..self.visible[t])
            .map(|s| {
                let k = &keys[self.row(t, s) * DIM..][..DIM];
                (0..self.heads)
                    .map(|h| {
                        let q = &self.q[(t * self.heads + h) * DIM..][..DIM];
                        let dot: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum();
                        self.w[t * self.heads + h] * dot.max(0.0)
                    })
                    .sum()
            })
            .collect()
    }
}

/// Positions by the reference's ordering: higher score first (-0.0 equal to 0.0), then lower position.
fn reference_order(scores: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| {
        (scores[b] + 0.0)
            .total_cmp(&(scores[a] + 0.0))
            .then(a.cmp(&b))
    });
    order
}

/// Compares a kernel row with the reference scores: returns the number of positions that differ when the
/// boundary is a near-tie (printed), and panics when it is not.
fn check_row(label: &str, got: &[i32], scores: &[f32], k: usize) -> usize {
    let take = k.min(scores.len());
    let order = reference_order(scores);
    let mut want: Vec<i32> = order[..take].iter().map(|&s| s as i32).collect();
    want.sort();
    let mut selected: Vec<i32> = got.iter().copied().filter(|&s| s >= 0).collect();
    assert!(
        got[selected.len()..].iter().all(|&s| s == -1),
        "{label}: -1 only at the end: {got:?}"
    );
    let sorted = selected.windows(2).all(|w| w[0] < w[1]);
    assert!(sorted, "{label}: ascending positions without repeats");
    selected.sort();
    assert_eq!(selected.len(), take, "{label}: {take} selections");
    if selected == want {
        return 0;
    }
    // Near-tie: every key in one set but not the other must score within the rounding of the K-th score.
    let kth = scores[order[take - 1]];
    let scale = scores.iter().fold(0f32, |m, v| m.max(v.abs()));
    let tolerance = 2e-5 * scale;
    let missing: Vec<i32> = want
        .iter()
        .copied()
        .filter(|s| !selected.contains(s))
        .collect();
    for &s in missing
        .iter()
        .chain(selected.iter().filter(|s| !want.contains(s)))
    {
        let gap = (scores[s as usize] - kth).abs();
        assert!(
            gap <= tolerance,
            "{label}: position {s} (score {}) differs from the reference's set, {gap} from the K-th score {kth} (tolerance {tolerance})",
            scores[s as usize]
        );
    }
    println!(
        "{label}: {} positions differ, all within {tolerance} of the K-th score (near-tie)",
        missing.len()
    );
    missing.len()
}

/// A problem's inputs on a device: bf16 queries, the weights, block table and token sequences, and the keys
/// in pages of `BLOCK` (FP8 quantised on the device, or bf16).
struct OnDevice {
    q: Tensor,
    w: Tensor,
    table: Tensor,
    token_seq: Tensor,
    pages: Pages,
}

enum Pages {
    Fp8 { bytes: Tensor, scales: Tensor },
    Bf16(Tensor),
}

impl OnDevice {
    fn new(p: &Problem, fp8: bool, device: &Device) -> Self {
        let rows = p.keys.len() / DIM;
        let keys = Tensor::from_vec(p.keys.clone(), (rows, DIM), device).unwrap();
        let pages = if fp8 {
            let (bytes, scales) = quantize_fp8(&keys).unwrap();
            Pages::Fp8 {
                bytes: bytes.reshape((rows / BLOCK, BLOCK, DIM)).unwrap(),
                scales: scales.reshape((rows / BLOCK, BLOCK)).unwrap(),
            }
        } else {
            Pages::Bf16(
                keys.to_dtype(DType::BF16)
                    .unwrap()
                    .reshape((rows / BLOCK, BLOCK, DIM))
                    .unwrap(),
            )
        };
        let tokens = p.token_seq.len();
        Self {
            q: Tensor::from_vec(p.q.clone(), (tokens, p.heads, DIM), device)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
            w: Tensor::from_vec(p.w.clone(), (tokens, p.heads), device).unwrap(),
            table: Tensor::from_vec(
                p.block_table.clone(),
                (p.block_table.len() / p.max_blocks, p.max_blocks),
                device,
            )
            .unwrap(),
            token_seq: Tensor::from_vec(p.token_seq.clone(), tokens, device).unwrap(),
            pages,
        }
    }

    fn cache(&self) -> PagedIndexKeys<'_> {
        PagedIndexKeys {
            keys: match &self.pages {
                Pages::Fp8 { bytes, scales } => IndexKeys::Fp8 { bytes, scales },
                Pages::Bf16(blocks) => IndexKeys::Float(blocks),
            },
            block_table: &self.table,
            token_seq: &self.token_seq,
        }
    }
}

/// `f` once per top-k path; both must give the same rows (each is exact), which are returned.
fn on_both_top_k_paths(label: &str, f: impl Fn(TopKPath) -> Vec<Vec<i32>>) -> Vec<Vec<i32>> {
    let chain = f(TopKPath::Chain);
    let cluster = f(TopKPath::Cluster);
    for (t, (a, b)) in chain.iter().zip(&cluster).enumerate() {
        assert_eq!(
            a, b,
            "{label}: the cluster top-k differs from the chain at query {t}"
        );
    }
    cluster
}

/// `f` once per score kernel `p` can run on (on Hopper the policy's choice and the pinned mma.sync kernel,
/// and where the block table has one row, the grouped kernel's promise, the per-query wgmma and the grouped
/// kernels pinned too; elsewhere mma.sync each time), with the pin and its label.
fn on_every_score_kernel(p: &Problem, mut f: impl FnMut(ScoreKernel, &str)) {
    let one_row_table = p.block_table.len() == p.max_blocks;
    let pins: &[(ScoreKernel, &str)] = if one_row_table {
        &[
            (ScoreKernel::Policy, "policy"),
            (ScoreKernel::PerQuery, "per query"),
            (ScoreKernel::Grouped, "grouped"),
            (ScoreKernel::MmaSync, "mma.sync"),
        ]
    } else {
        &[
            (ScoreKernel::Policy, "policy"),
            (ScoreKernel::MmaSync, "mma.sync"),
        ]
    };
    for &(kernel, label) in pins {
        f(kernel, label);
    }
}

/// The rows of `p` on the GPU by the policy's score kernel, over both top-k paths.
fn run(p: &Problem, fp8: bool, k: usize, device: &Device) -> Vec<Vec<i32>> {
    run_with(p, fp8, k, device, ScoreKernel::Policy)
}

/// The rows of `p` on the GPU with the score kernel `score`, over both top-k paths.
fn run_with(
    p: &Problem,
    fp8: bool,
    k: usize,
    device: &Device,
    score: ScoreKernel,
) -> Vec<Vec<i32>> {
    let inputs = OnDevice::new(p, fp8, device);
    on_both_top_k_paths(&format!("n {} K {k} fp8 {fp8}", p.n), |path| {
        let launch = DsaIndexerLaunch {
            top_k_path: path,
            score_kernel: score,
        };
        let visible = VisibleKeys::Host(&p.visible);
        dsa_indexer_paged_with(&inputs.q, &inputs.w, &inputs.cache(), visible, k, &launch)
            .unwrap()
            .to_vec2::<i32>()
            .unwrap()
    })
}

/// `DsaIndexerLaunch` with the top-k path pinned, the policy's score kernel.
fn path_only(path: TopKPath) -> DsaIndexerLaunch {
    DsaIndexerLaunch {
        top_k_path: path,
        score_kernel: ScoreKernel::Policy,
    }
}

#[test]
fn fp8_quantisation_on_the_gpu_matches_the_cpu_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(5);
    let values: Vec<f32> = (0..1000 * DIM)
        .map(|_| rng.random_range(-4.0f32..4.0) * rng.random_range(0.0f32..1.0))
        .collect();
    let cpu = Tensor::from_vec(values, (1000, DIM), &Device::Cpu).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let cpu = cpu.to_dtype(dtype).unwrap();
        let (cpu_bytes, cpu_scales) = quantize_fp8(&cpu).unwrap();
        let (gpu_bytes, gpu_scales) = quantize_fp8(&cpu.to_device(&gpu()).unwrap()).unwrap();
        assert_eq!(
            gpu_bytes.to_vec2::<u8>().unwrap(),
            cpu_bytes.to_vec2::<u8>().unwrap(),
            "{dtype:?}"
        );
        assert_eq!(
            gpu_scales.to_vec1::<f32>().unwrap(),
            cpu_scales.to_vec1::<f32>().unwrap(),
            "{dtype:?}"
        );
    }
}

#[test]
fn selected_sets_match_the_reference_over_the_grid() {
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(2026);
    let lengths: &[usize] = if quick() {
        &[1, 100, 2049, 40_000]
    } else {
        &[1, 100, 2048, 2049, 32_768, 40_000, 131_072]
    };
    let (mut rows, mut differing_rows) = (0, 0);
    for &heads in &[8usize, 32] {
        for &n in lengths {
            let p = Problem::new(&mut rng, heads, n);
            let bf16_keys = bf16_round(&p.keys);
            for fp8 in [false, true] {
                // The reference reads what the kernel reads: bf16 keys, or the dequantised FP8 keys.
                let keys = if fp8 {
                    dequantized_fp8(&p.keys)
                } else {
                    bf16_keys.clone()
                };
                let scores: Vec<Vec<f32>> = (0..3).map(|t| p.scores(t, &keys)).collect();
                for &k in &[1usize, 64, 2048] {
                    on_every_score_kernel(&p, |score, kernel| {
                        let got = run_with(&p, fp8, k, &device, score);
                        for t in 0..3 {
                            let label = format!(
                                "H{heads} n{n} K{k} {} {kernel} query {t}",
                                if fp8 { "fp8" } else { "bf16" }
                            );
                            rows += 1;
                            differing_rows +=
                                usize::from(check_row(&label, &got[t], &scores[t], k) > 0);
                        }
                    });
                }
            }
        }
    }
    println!("{rows} rows, {differing_rows} differ only at near-ties");
}

#[test]
fn equal_scores_go_to_the_lower_position() {
    // Every key the same: all scores tie, so the first K positions are the set.
    let device = gpu();
    let (heads, n, k) = (8, 300, 64);
    let key: Vec<f32> = (0..DIM).map(|d| (d % 7) as f32 / 8.0).collect();
    let keys = Tensor::from_vec(key.repeat(n), (1, n, DIM), &device)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let q = Tensor::ones((2, heads, DIM), DType::BF16, &device).unwrap();
    let w = Tensor::ones((2, heads), DType::F32, &device).unwrap();
    let table = Tensor::zeros((1, 1), DType::I32, &device).unwrap();
    let seq = Tensor::zeros(2, DType::I32, &device).unwrap();
    let cache = PagedIndexKeys {
        keys: IndexKeys::Float(&keys),
        block_table: &table,
        token_seq: &seq,
    };
    let got = on_both_top_k_paths("all equal", |path| {
        let counts = [n, 40];
        let visible = VisibleKeys::Host(&counts);
        dsa_indexer_paged_with(&q, &w, &cache, visible, k, &path_only(path))
            .unwrap()
            .to_vec2::<i32>()
            .unwrap()
    });
    assert_eq!(got[0], (0..k as i32).collect::<Vec<_>>());
    let mut short: Vec<i32> = (0..40).collect();
    short.resize(k, -1);
    assert_eq!(got[1], short);
}

/// The keys the kernel reads after FP8 quantisation (on the CPU, bit-identical to the GPU's), as f32 rows.
fn dequantized_fp8(keys: &[f32]) -> Vec<f32> {
    let cpu = Tensor::from_vec(keys.to_vec(), (keys.len() / DIM, DIM), &Device::Cpu).unwrap();
    let (bytes, scales) = quantize_fp8(&cpu).unwrap();
    IndexKeys::Fp8 {
        bytes: &bytes,
        scales: &scales,
    }
    .dequantize()
    .unwrap()
    .flatten_all()
    .unwrap()
    .to_vec1::<f32>()
    .unwrap()
}

#[test]
fn repeated_fp8_keys_tie_to_the_lower_positions() {
    // FP8 keys in pages of 64 (the TMA score kernel) drawn from a few distinct vectors: each score value
    // repeats, and the K-th one is shared by many positions, of which the lowest are taken. 40 values (~125
    // copies each), 8 (~5000: more than the threshold kernel holds in shared memory) or one. The set must be
    // exactly the reference's (the distinct values lie far apart compared with the kernel's rounding).
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(23);
    for (distinct, n, k) in [
        (40, 5000, 2048),
        (40, 5000, 64),
        (8, 40_000, 2048),
        (1, 3000, 64),
    ] {
        let mut p = Problem::new(&mut rng, 32, n);
        let pool: Vec<Vec<f32>> = (0..distinct)
            .map(|_| (0..DIM).map(|_| rng.random_range(-1.0f32..1.0)).collect())
            .collect();
        for row in p.keys.chunks_mut(DIM) {
            row.copy_from_slice(&pool[rng.random_range(0..distinct)]);
        }
        let keys = dequantized_fp8(&p.keys);
        let got = run(&p, true, k, &device);
        for (t, row) in got.iter().enumerate() {
            let scores = p.scores(t, &keys);
            let order = reference_order(&scores);
            let mut want: Vec<i32> = order[..k.min(scores.len())]
                .iter()
                .map(|&s| s as i32)
                .collect();
            want.sort();
            want.resize(k, -1);
            assert_eq!(
                row, &want,
                "{distinct} distinct keys, n {n}, K {k}, query {t}"
            );
        }
    }
}

#[test]
fn f32_kernel_and_contiguous_entry_point_match_the_cpu_reference() {
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(17);
    // The tiny test models' indexer: 16 heads of 16; a prefill of 37 queries over 37 keys (causal).
    let (t, heads, dim, k) = (37usize, 16usize, 16usize, 8usize);
    let q: Vec<f32> = (0..t * heads * dim)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let w: Vec<f32> = (0..t * heads)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let keys: Vec<f32> = (0..t * dim)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let visible: Vec<usize> = (1..=t).collect();
    let cpu =
        |v: &Vec<f32>, shape: &[usize]| Tensor::from_vec(v.clone(), shape, &Device::Cpu).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let (qc, kc) = (
            cpu(&q, &[t, heads, dim]).to_dtype(dtype).unwrap(),
            cpu(&keys, &[t, dim]).to_dtype(dtype).unwrap(),
        );
        let wc = cpu(&w, &[t, heads]);
        let want = dsa_indexer(&qc, &wc, &kc, &visible, k)
            .unwrap()
            .to_vec2::<i32>()
            .unwrap();
        let got = dsa_indexer(
            &qc.to_device(&device).unwrap(),
            &wc.to_device(&device).unwrap(),
            &kc.to_device(&device).unwrap(),
            &visible,
            k,
        )
        .unwrap()
        .to_vec2::<i32>()
        .unwrap();
        for (row, (g, w)) in got.iter().zip(&want).enumerate() {
            let (mut g, mut w) = (g.clone(), w.clone());
            g.sort();
            w.sort();
            assert_eq!(g, w, "{dtype:?} query {row}");
        }
    }
}

#[test]
fn a_prefill_chunk_selects_exactly_on_every_row() {
    // 48 causal queries at the end of a sequence: a few score blocks per query row, so each block walks many
    // tiles (with FP8 pages of 64, the TMA kernel's rows beyond its first tiles); every row's set exact.
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(23);
    let (n, queries, k) = (12_000, 48, 2048);
    let p = Problem::prefill_chunk(&mut rng, 32, n, queries);
    for fp8 in [true, false] {
        let keys = if fp8 {
            dequantized_fp8(&p.keys)
        } else {
            bf16_round(&p.keys)
        };
        let scores: Vec<Vec<f32>> = (0..queries).map(|t| p.scores(t, &keys)).collect();
        on_every_score_kernel(&p, |score, kernel| {
            let got = run_with(&p, fp8, k, &device, score);
            for (t, row) in got.iter().enumerate() {
                let label = format!("prefill n{n} fp8 {fp8} {kernel} query {t}");
                check_row(&label, row, &scores[t], k);
            }
        });
    }
}

#[test]
fn a_prefill_chunk_with_short_rows_a_foreign_query_and_a_partial_group() {
    // 45 causal queries (the last group of four holds one) over 2070 keys: the first 23 see at most K and take
    // every key, the others are selected; query 30 names a sequence the one-row block table does not have and
    // gets a row of -1. Groups mix all three kinds.
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(24);
    let (n, queries, k) = (2070, 45, 2048);
    let mut p = Problem::prefill_chunk(&mut rng, 32, n, queries);
    let foreign = 30;
    p.token_seq[foreign] = 1;
    let keys = dequantized_fp8(&p.keys);
    on_every_score_kernel(&p, |score, kernel| {
        let got = run_with(&p, true, k, &device, score);
        for (t, row) in got.iter().enumerate() {
            let label = format!("short prefill {kernel} query {t}");
            if t == foreign {
                assert_eq!(row, &vec![-1; k], "{label}");
            } else {
                check_row(&label, row, &p.scores(t, &keys), k);
            }
        }
    });
}

#[test]
fn a_long_prefill_chunk_of_dense_segments_selects_exactly() {
    // 1100 causal queries over 4000 keys, 8 heads: a long prefill chunk whose segments each hold more than 256 of
    // the K selected (the emit's staged stores). Every row's set exact, FP8 keys, the policy's score kernel.
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(29);
    let (n, queries, k) = (4000, 1100, 2048);
    let p = Problem::prefill_chunk(&mut rng, 8, n, queries);
    let keys = dequantized_fp8(&p.keys);
    for (t, row) in run(&p, true, k, &device).iter().enumerate() {
        check_row(
            &format!("long prefill query {t}"),
            row,
            &p.scores(t, &keys),
            k,
        );
    }
}

#[test]
fn glm5_decode_rows_select_exactly() {
    // GLM-5's decode shapes (FP8 keys in pages of 64, 32 heads; the TMA score kernel, wgmma on Hopper): 128K and
    // 200K at batch 1 (the chain top-k by policy) and 32K at batch 8 (the cluster top-k), visible counts a little
    // apart. Both top-k paths give the same rows, and they hold the reference's set.
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(77);
    let shapes: &[(usize, usize)] = if quick() {
        &[(131_072, 1)]
    } else {
        &[(131_072, 1), (200_000, 1), (32_768, 8)]
    };
    for &(n, batch) in shapes {
        let token_seq = (0..batch as i32).map(|b| b % 2).collect();
        let visible = (0..batch).map(|b| n - 7 * b).collect();
        let p = Problem::with_queries(&mut rng, 32, n, token_seq, visible);
        let keys = dequantized_fp8(&p.keys);
        for (t, row) in run(&p, true, 2048, &device).iter().enumerate() {
            check_row(
                &format!("decode n {n} batch {batch} query {t}"),
                row,
                &p.scores(t, &keys),
                2048,
            );
        }
    }
}

#[test]
fn a_crowded_threshold_bin_and_a_foreign_sequence() {
    // 20000 or 40000 equal scores: the K-th score's bin holds more values than shared memory does, so the
    // exact selection runs over the row; the set is still the lowest K positions. A query whose sequence
    // index is outside the block table sees no keys.
    let device = gpu();
    for n in [20_000, 40_000] {
        crowded_bin_case(&device, n);
    }
}

fn crowded_bin_case(device: &Device, n: usize) {
    let (heads, k) = (8, 2048);
    let key: Vec<f32> = (0..DIM).map(|d| ((d % 5) as f32 - 2.0) / 4.0).collect();
    let keys = Tensor::from_vec(key.repeat(n), (1, n, DIM), device)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let q = Tensor::ones((2, heads, DIM), DType::BF16, device).unwrap();
    let w = Tensor::ones((2, heads), DType::F32, device).unwrap();
    let table = Tensor::zeros((1, 1), DType::I32, device).unwrap();
    let seq = Tensor::new(&[0i32, 3], device).unwrap();
    let cache = PagedIndexKeys {
        keys: IndexKeys::Float(&keys),
        block_table: &table,
        token_seq: &seq,
    };
    let got = on_both_top_k_paths(&format!("crowded, n {n}"), |path| {
        let counts = [n, n];
        let visible = VisibleKeys::Host(&counts);
        dsa_indexer_paged_with(&q, &w, &cache, visible, k, &path_only(path))
            .unwrap()
            .to_vec2::<i32>()
            .unwrap()
    });
    assert_eq!(got[0], (0..k as i32).collect::<Vec<_>>());
    assert_eq!(got[1], vec![-1; k]);
}

#[test]
fn device_visible_counts_select_what_host_counts_select() {
    // Counts already on the GPU (no upload per call) give the host-count call's rows exactly, a count above
    // the bound being read as the bound; FP8 cache in pages of 64 (the TMA score kernel).
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(21);
    let n = 40_000;
    let p = Problem::new(&mut rng, 32, n);
    let inputs = OnDevice::new(&p, true, &device);
    let (q, w, cache) = (&inputs.q, &inputs.w, inputs.cache());
    let bound = n - 10;
    let counts = [p.visible[0] as i32, i32::MAX, 1500];
    let on_device = Tensor::new(&counts, &device).unwrap();
    let got = dsa_indexer_paged_device_visible(q, w, &cache, &on_device, bound, 2048).unwrap();
    let host: Vec<usize> = counts.iter().map(|&c| (c as usize).min(bound)).collect();
    let want = dsa_indexer_paged(q, w, &cache, &host, 2048).unwrap();
    assert_eq!(
        got.to_vec2::<i32>().unwrap(),
        want.to_vec2::<i32>().unwrap()
    );
}

#[test]
fn stage_times_cover_each_call_and_nothing_else() {
    // time_stages sees the indexer calls of its closure (both stages timed, their sum no longer than the
    // closure's host time, which waits for the results), and nothing outside one.
    let device = gpu();
    let mut rng = StdRng::seed_from_u64(22);
    let p = Problem::new(&mut rng, 32, 40_000);
    let started = std::time::Instant::now();
    let (rows, times) = glm5_ops::time_stages(|| run(&p, true, 2048, &device)).unwrap();
    let elapsed = started.elapsed();
    assert_eq!(rows.len(), 3);
    assert!(times.scores > std::time::Duration::ZERO, "{times:?}");
    assert!(times.top_k > std::time::Duration::ZERO, "{times:?}");
    assert!(
        times.scores + times.top_k <= elapsed,
        "{times:?} vs {elapsed:?}"
    );
    let (_, none) = glm5_ops::time_stages(|| ()).unwrap();
    assert_eq!(none, glm5_ops::StageTimes::default());
}
