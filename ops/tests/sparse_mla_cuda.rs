//! The CUDA sparse_mla kernels against the CPU f32 reference, on fresh random inputs with poisoned outputs.
//! Needs a GPU: built with `--features cuda` and run by `scripts/gpu-run.sh` on the GPU machine.
//! `GLM5_QUICK=1` shrinks the grid (for compute-sanitizer runs).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use glm5_ops::{
    sparse_mla, sparse_mla_paged, sparse_mla_paged_with, DeviceDesc, DeviceFamily, Kernel,
    NarrowHeads, Op, OpError, PagedLatentCache, Registry, SparseMlaLaunch,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

fn quick() -> bool {
    std::env::var_os("GLM5_QUICK").is_some()
}

/// One decode-style problem: `batch` sequences, one query token each.
struct Problem {
    q: Vec<f32>,      // [T, H, D]
    blocks: Vec<f32>, // [num_blocks, block_size, D]
    block_table: Vec<i32>,
    max_blocks: usize,
    num_blocks: usize,
    seq_lens: Vec<i32>,
    token_seq: Vec<i32>,
    indices: Vec<i32>, // [T, K]
    t: usize,
    h: usize,
    d: usize,
    k: usize,
    block_size: usize,
}

fn normal(rng: &mut StdRng) -> f32 {
    let (u, v): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random_range(0.0..1.0));
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

/// Random lengths (some shorter than K), unique random positions per row, extra -1 entries.
fn problem(
    rng: &mut StdRng,
    batch: usize,
    tokens_per_seq: usize,
    h: usize,
    d: usize,
    k: usize,
    block_size: usize,
) -> Problem {
    let t = batch * tokens_per_seq;
    let seq_lens: Vec<usize> = (0..batch)
        .map(|_| rng.random_range(1..=(k + k / 2 + 3)))
        .collect();
    let max_blocks = seq_lens.iter().max().unwrap().div_ceil(block_size);
    let num_blocks: usize = seq_lens
        .iter()
        .map(|l| l.div_ceil(block_size))
        .sum::<usize>()
        + 3;
    let mut free: Vec<i32> = (0..num_blocks as i32).collect();
    free.shuffle(rng);
    let mut block_table = vec![0i32; batch * max_blocks];
    for (b, len) in seq_lens.iter().enumerate() {
        for j in 0..len.div_ceil(block_size) {
            block_table[b * max_blocks + j] = free.pop().unwrap();
        }
    }
    let token_seq: Vec<i32> = (0..t).map(|i| (i / tokens_per_seq) as i32).collect();
    let mut indices = Vec::with_capacity(t * k);
    for &seq in &token_seq {
        let len = seq_lens[seq as usize];
        let mut positions: Vec<i32> = (0..len as i32).collect();
        positions.shuffle(rng);
        positions.truncate(k);
        positions.resize(k, -1);
        for p in positions.iter_mut() {
            if rng.random_range(0.0..1.0) < 0.05 {
                *p = -1;
            }
        }
        positions.shuffle(rng);
        indices.extend(positions);
    }
    Problem {
        q: (0..t * h * d).map(|_| normal(rng)).collect(),
        blocks: (0..num_blocks * block_size * d)
            .map(|_| normal(rng))
            .collect(),
        block_table,
        max_blocks,
        num_blocks,
        seq_lens: seq_lens.iter().map(|&l| l as i32).collect(),
        token_seq,
        indices,
        t,
        h,
        d,
        k,
        block_size,
    }
}

/// Whether the GPU runs the wgmma kernel (an sm_90 part).
fn has_wgmma() -> bool {
    DeviceDesc::of(&gpu()).unwrap().family() == DeviceFamily::Sm90
}

/// The bf16 backends (registry entries) that serve `heads` heads of GLM-5's rows on this GPU.
fn kernels_for(heads: usize) -> Vec<&'static str> {
    if heads.is_multiple_of(64) && has_wgmma() {
        vec!["cuda-bf16-mma", "cuda-bf16-wgmma"]
    } else {
        vec!["cuda-bf16-mma"]
    }
}

/// Runs the paged op on `device` with inputs rounded to `dtype` (`launch` on the GPU, the registry's choice
/// elsewhere); returns f32 host (out, lse).
fn run(
    p: &Problem,
    dtype: DType,
    dv: usize,
    scale: f64,
    device: &Device,
    launch: &SparseMlaLaunch,
) -> (Vec<f32>, Vec<f32>) {
    let f = |data: &[f32], shape: &[usize]| {
        Tensor::from_slice(data, shape, device)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    let i = |data: &[i32], shape: &[usize]| Tensor::from_slice(data, shape, device).unwrap();
    let q = f(&p.q, &[p.t, p.h, p.d]);
    let blocks = f(&p.blocks, &[p.num_blocks, p.block_size, p.d]);
    let block_table = i(&p.block_table, &[p.seq_lens.len(), p.max_blocks]);
    let seq_lens = i(&p.seq_lens, &[p.seq_lens.len()]);
    let token_seq = i(&p.token_seq, &[p.t]);
    let indices = i(&p.indices, &[p.t, p.k]);
    let cache = PagedLatentCache {
        blocks: &blocks,
        block_table: &block_table,
        seq_lens: &seq_lens,
        token_seq: &token_seq,
    };
    let (out, lse) = if device.is_cuda() {
        sparse_mla_paged_with(&q, &cache, &indices, dv, scale, launch).unwrap()
    } else {
        sparse_mla_paged(&q, &cache, &indices, dv, scale).unwrap()
    };
    (
        out.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap(),
        lse.flatten_all().unwrap().to_vec1().unwrap(),
    )
}

/// Rounds to `dtype` and back, so the CPU reference sees exactly the kernel's inputs.
fn rounded(p: &Problem, dtype: DType) -> Problem {
    let r = |v: &[f32]| {
        Tensor::from_slice(v, v.len(), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    Problem {
        q: r(&p.q),
        blocks: r(&p.blocks),
        block_table: p.block_table.clone(),
        seq_lens: p.seq_lens.clone(),
        token_seq: p.token_seq.clone(),
        indices: p.indices.clone(),
        ..*p
    }
}

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    assert!(
        got.iter().all(|v| v.is_finite()),
        "non-finite output (unwritten element?)"
    );
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num.sqrt() / den.sqrt().max(1e-30)) as f32
}

/// Max |Δlse| / max(1, |lse|), with -inf required exactly where the reference has it.
fn lse_error(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            if *b == f32::NEG_INFINITY {
                assert_eq!(*a, f32::NEG_INFINITY, "lse of an empty row must be -inf");
                0.0
            } else {
                (a - b).abs() / b.abs().max(1.0)
            }
        })
        .fold(0.0, f32::max)
}

fn check(p: &Problem, dtype: DType, dv: usize, label: &str) {
    check_kernel(p, dtype, dv, label, "cuda-bf16-mma");
}

/// `backend` on the GPU against the CPU f32 reference, outputs poisoned; the mma.sync launcher's head-tile kernel both with its
/// splits merged in a thread-block cluster (where its launcher picks that) and by the combine kernel, and for
/// at most 8 heads over GLM-5's rows its narrow kernel with each block size.
fn check_kernel(p: &Problem, dtype: DType, dv: usize, label: &str, backend: &str) {
    let scale = (p.d as f64).powf(-0.5);
    let (out_ref, lse_ref) = run(
        &rounded(p, dtype),
        DType::F32,
        dv,
        scale,
        &Device::Cpu,
        &SparseMlaLaunch::default(), // the CPU runs the registry's reference
    );
    let (tol_out, tol_lse) = if dtype == DType::BF16 {
        (1e-2, 1e-3)
    } else {
        (1e-5, 1e-5)
    };
    // (narrow kernel choice, cluster merge allowed): the mma.sync launcher's paths.
    let mut paths = vec![(NarrowHeads::Off, true)];
    if backend == "cuda-bf16-mma" {
        paths.push((NarrowHeads::Off, false));
        if dtype == DType::BF16 && p.h <= 8 && p.d == 576 && dv == 512 {
            for warps in [2, 4, 8] {
                if p.k.div_ceil(16 * warps) <= 128 {
                    paths.push((NarrowHeads::Warps(warps), true));
                }
            }
        }
    }
    for (narrow, cluster) in paths {
        let launch = SparseMlaLaunch::backend(backend)
            .unwrap()
            .narrow_heads(narrow)
            .cluster_combine(cluster)
            .poison_outputs(true);
        let (out, lse) = run(p, dtype, dv, scale, &gpu(), &launch);
        let (e_out, e_lse) = (relative_error(&out, &out_ref), lse_error(&lse, &lse_ref));
        let label = format!("{label} (narrow: {narrow:?}, cluster merge allowed: {cluster})");
        println!("{label}: out rel {e_out:.2e}, lse {e_lse:.2e}");
        assert!(e_out <= tol_out, "{label}: out relative error {e_out}");
        assert!(e_lse <= tol_lse, "{label}: lse error {e_lse}");
    }
}

#[test]
fn bf16_kernel_matches_the_cpu_reference_over_the_grid() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let (heads, ks, batches, block_sizes): (&[usize], &[usize], &[usize], &[usize]) = if quick() {
        (&[8, 64], &[7, 300], &[1, 3], &[16])
    } else {
        (
            &[1, 8, 16, 64, 128],
            &[1, 7, 64, 2048, 3000],
            &[1, 3, 64],
            &[1, 16, 64],
        )
    };
    for &h in heads {
        for &k in ks {
            for &batch in batches {
                for &bs in block_sizes {
                    let p = problem(&mut rng, batch, 1, h, 576, k, bs);
                    for kernel in kernels_for(h) {
                        check_kernel(
                            &p,
                            DType::BF16,
                            512,
                            &format!("bf16 {kernel} H{h} K{k} B{batch} bs{bs}"),
                            kernel,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn prefill_tokens_and_small_models() {
    let mut rng = StdRng::seed_from_u64(7);
    // Several query tokens of one sequence, each with its own index row.
    let p = problem(&mut rng, 1, 37, 16, 576, 96, 16);
    check(&p, DType::BF16, 512, "prefill bf16 T37");
    // The tiny test models' widths: D = 24, value 16.
    for (h, d, dv) in [(4, 24, 16), (8, 40, 32), (3, 72, 64)] {
        let p = problem(&mut rng, 3, 5, h, d, 40, 4);
        check(&p, DType::BF16, dv, &format!("bf16 H{h} D{d} DV{dv}"));
        check(&p, DType::F32, dv, &format!("f32 H{h} D{d} DV{dv}"));
    }
}

#[test]
fn f32_kernel_matches_the_cpu_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    for (h, k, batch, bs) in [(8, 64, 3, 16), (64, 2048, 2, 64), (1, 7, 1, 1)] {
        let p = problem(&mut rng, batch, 1, h, 576, k, bs);
        check(
            &p,
            DType::F32,
            512,
            &format!("f32 H{h} K{k} B{batch} bs{bs}"),
        );
    }
}

#[test]
fn contiguous_cache_entry_point_uses_the_kernel() {
    contiguous_entry_point_matches_the_cpu(16, sparse_mla);
}

#[test]
fn wgmma_registry_entry_over_a_contiguous_cache() {
    // The function the `cuda-bf16-wgmma` entry binds into the model graph (GLM-5's 64 heads).
    if has_wgmma() {
        let registry = Registry::builtin();
        let Some(Kernel::SparseMla(wgmma)) = registry
            .get(Op::SparseMla, "cuda-bf16-wgmma")
            .map(|e| e.kernel)
        else {
            panic!("the registry has a cuda-bf16-wgmma sparse_mla entry")
        };
        contiguous_entry_point_matches_the_cpu(64, wgmma);
    }
}

type SparseMlaFn = fn(&Tensor, &Tensor, &Tensor, usize, f64) -> glm5_ops::Result<(Tensor, Tensor)>;

/// `entry` on the GPU against `sparse_mla` on the CPU over one contiguous cache of 300 rows.
fn contiguous_entry_point_matches_the_cpu(h: usize, entry: SparseMlaFn) {
    let mut rng = StdRng::seed_from_u64(3);
    let (t, d, n, k) = (5, 576, 300, 64);
    let q: Vec<f32> = (0..t * h * d).map(|_| normal(&mut rng)).collect();
    let cache: Vec<f32> = (0..n * d).map(|_| normal(&mut rng)).collect();
    let indices: Vec<i32> = (0..t * k)
        .map(|_| {
            if rng.random_range(0..10) == 0 {
                -1
            } else {
                rng.random_range(0..n as i32)
            }
        })
        .collect();
    let run_on = |device: &Device| {
        let q = Tensor::from_slice(&q, (t, h, d), device)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let cache = Tensor::from_slice(&cache, (n, d), device)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let indices = Tensor::from_slice(&indices, (t, k), device).unwrap();
        let run = if device.is_cuda() { entry } else { sparse_mla };
        let (out, _) = run(&q, &cache, &indices, 512, 0.05).unwrap();
        out.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let err = relative_error(&run_on(&gpu()), &run_on(&Device::Cpu));
    assert!(err <= 1e-2, "relative error {err}");
}

#[test]
fn wgmma_kernel_prefill_and_what_it_does_not_serve() {
    if !has_wgmma() {
        return; // sm_120 and others: no wgmma (the CPU suite checks the registry's verdict)
    }
    let mut rng = StdRng::seed_from_u64(9);
    // Many query tokens of two sequences (prefill), 128 heads = two 64-head groups.
    let p = problem(&mut rng, 2, 21, 128, 576, 200, 64);
    check_kernel(
        &p,
        DType::BF16,
        512,
        "wgmma prefill T42 H128",
        "cuda-bf16-wgmma",
    );
    // Heads not a multiple of 64, or other row widths: a typed error naming the cause, never a wrong answer.
    for (h, d, dv) in [(16, 576, 512), (64, 288, 256)] {
        let p = problem(&mut rng, 1, 1, h, d, 16, 16);
        let device = gpu();
        let q = Tensor::from_slice(&p.q, (p.t, h, d), &device)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let blocks = Tensor::from_slice(&p.blocks, (p.num_blocks, p.block_size, d), &device)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let i = |data: &[i32], shape: &[usize]| Tensor::from_slice(data, shape, &device).unwrap();
        let (table, lens, seqs) = (
            i(&p.block_table, &[1, p.max_blocks]),
            i(&p.seq_lens, &[1]),
            i(&p.token_seq, &[1]),
        );
        let cache = PagedLatentCache {
            blocks: &blocks,
            block_table: &table,
            seq_lens: &lens,
            token_seq: &seqs,
        };
        let indices = i(&p.indices, &[1, p.k]);
        let wgmma = SparseMlaLaunch::backend("cuda-bf16-wgmma").unwrap();
        let err = sparse_mla_paged_with(&q, &cache, &indices, dv, 0.1, &wgmma).unwrap_err();
        assert!(
            matches!(&err, OpError::Unsupported(m) if m.contains("multiples of 64")),
            "{err}"
        );
    }
}
