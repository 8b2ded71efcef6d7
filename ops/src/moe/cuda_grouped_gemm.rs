//! The experts for many tokens (prefill) by cuBLAS's grouped GEMM (`cublasGemmGroupedBatchedEx`): one call
//! per projection for every active expert, instead of one chain of candle ops per expert.
//!
//! 1. The routes come to the host once (`T·slots` ids: the one sync of the layer) and are sorted by expert
//!    (ascending assignment order within one expert, as `moe_align` sorts them).
//! 2. The tokens' rows are gathered in that order; gate and up are one GEMM per expert over the stacked
//!    `[E', 2I, H]` (f32 accumulation, rounded to the model dtype); SiLU(gate)·up by candle ops; down is one
//!    GEMM per expert.
//! 3. Each row times its gate in f32, put back in assignment order, and summed per token in slot order by
//!    `moe_combine` (as the mat-vec path sums them).
//!
//! [`experts_bucketed_gemm`] is the same computation with the GEMMs issued another way: cuBLAS's grouped
//! GEMM takes one shape per expert and on the H200 runs GLM-5's 4096-token prefill at ~15% of the bf16 GEMM
//! rate (each expert's ~150 rows are a small GEMM). Here the active experts are bucketed by their row
//! count rounded up to a power of two, and each bucket is one `cublasGemmBatchedEx` of a single shape over
//! its experts, their rows padded to the bucket's count (at most twice the work, in a few large batched
//! calls). Padded rows read the rows after an expert's own (finite data) and land in rows nobody reads.
//!
//! Experts kept quantised ([`quantized_experts_grouped_gemm`]) run the same way, each active expert's
//! projections dequantised to the activations' dtype first, in chunks of experts whose dense weights fit
//! `DENSE_CHUNK_BYTES`: every weight is dequantised once (gate and up in a first pass, down in a second).

use candle_core::cuda_backend::cudarc::cublas::sys;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};

use super::quantized::{Projection, QuantizedExperts};
use super::Routes;
use crate::cuda::{cuda_err, device_address};
use crate::error::{OpError, Result};

/// Bytes of dequantised expert weights held at once by the quantised path.
const DENSE_CHUNK_BYTES: usize = 2 << 30;

/// One GEMM of the group: row-major `C[n_rows, out] = B[n_rows, k] · A[out, k]ᵀ` (A an expert's weight, B its
/// tokens' rows, C's rows `ldc` apart), as cuBLAS's column-major `C' = op_T(A') · B'`.
struct Problem {
    out: usize,
    n_rows: usize,
    k: usize,
    a: u64,
    b: u64,
    c: u64,
    ldc: usize,
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType_t> {
    match dtype {
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType_t::CUDA_R_16F),
        DType::F32 => Ok(sys::cudaDataType_t::CUDA_R_32F),
        other => Err(OpError::NotFloat {
            arg: "x",
            found: other,
        }),
    }
}

/// `v` as the `int` cuBLAS takes.
fn cublas_int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| OpError::Unsupported(format!("cuBLAS GEMM: size {v} exceeds i32")))
}

/// The device arrays of A, B and C addresses a pointer-array cuBLAS call reads, and their addresses. The
/// tensors must outlive the call (dropped after it, they are freed in stream order).
fn pointer_arrays(
    device: &Device,
    addresses: impl Iterator<Item = (u64, u64, u64)>,
) -> Result<([Tensor; 3], [u64; 3])> {
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for (pa, pb, pc) in addresses {
        a.push(pa as i64);
        b.push(pb as i64);
        c.push(pc as i64);
    }
    let upload = |v: Vec<i64>| -> Result<Tensor> {
        let n = v.len();
        Ok(Tensor::from_vec(v, n, device)?)
    };
    let arrays = [upload(a)?, upload(b)?, upload(c)?];
    let address = |t: &Tensor| -> Result<u64> { Ok(device_address(t)?.0) };
    let addresses = [
        address(&arrays[0])?,
        address(&arrays[1])?,
        address(&arrays[2])?,
    ];
    Ok((arrays, addresses))
}

/// Runs every problem (one group each: their row counts differ) on the device's stream.
fn grouped_gemm(
    dev: &CudaDevice,
    device: &Device,
    dtype: DType,
    problems: &[Problem],
) -> Result<()> {
    if problems.is_empty() {
        return Ok(());
    }
    let count = problems.len();
    let (mut m, mut n, mut k, mut lda, mut ldb, mut ldc) = (
        Vec::with_capacity(count),
        Vec::with_capacity(count),
        Vec::with_capacity(count),
        Vec::with_capacity(count),
        Vec::with_capacity(count),
        Vec::with_capacity(count),
    );
    for p in problems {
        m.push(cublas_int(p.out)?);
        n.push(cublas_int(p.n_rows)?);
        k.push(cublas_int(p.k)?);
        lda.push(cublas_int(p.k)?);
        ldb.push(cublas_int(p.k)?);
        ldc.push(cublas_int(p.ldc)?);
    }
    let trans_a = vec![sys::cublasOperation_t::CUBLAS_OP_T; count];
    let trans_b = vec![sys::cublasOperation_t::CUBLAS_OP_N; count];
    let alpha = vec![1.0f32; count];
    let beta = vec![0.0f32; count];
    let group_size = vec![1i32; count];
    // The matrix pointer arrays must be in device memory.
    let (_arrays, [a_arr, b_arr, c_arr]) =
        pointer_arrays(device, problems.iter().map(|p| (p.a, p.b, p.c)))?;
    let ty = data_type(dtype)?;
    let blas = dev.cublas_handle();
    // SAFETY: every array has `count` entries; each problem's A, B and C are live device allocations of at
    // least `out·k`, `n_rows·k` and `n_rows·out` elements of `dtype` (the caller's tensors), and the pointer
    // arrays are device memory holding those addresses; the handle is bound to the tensors' stream.
    let status = unsafe {
        sys::cublasGemmGroupedBatchedEx(
            *blas.handle(),
            trans_a.as_ptr(),
            trans_b.as_ptr(),
            m.as_ptr(),
            n.as_ptr(),
            k.as_ptr(),
            alpha.as_ptr().cast(),
            a_arr as *const *const std::ffi::c_void,
            ty,
            lda.as_ptr(),
            b_arr as *const *const std::ffi::c_void,
            ty,
            ldb.as_ptr(),
            beta.as_ptr().cast(),
            c_arr as *const *mut std::ffi::c_void,
            ty,
            ldc.as_ptr(),
            cublas_int(count)?,
            group_size.as_ptr(),
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(cuda_err(format!("cublasGemmGroupedBatchedEx: {status:?}")).into());
    }
    Ok(())
}

/// `count` GEMMs of one shape by `cublasGemmBatchedEx`: row-major `C_i[n_rows, out] = B_i[n_rows, k] · A_iᵀ`
/// for the addresses `(a, b, c)` of each (C's rows `ldc` apart), as [`grouped_gemm`] writes one problem.
fn batched_gemm(
    dev: &CudaDevice,
    device: &Device,
    dtype: DType,
    (out, n_rows, k, ldc): (usize, usize, usize, usize),
    addresses: &[(u64, u64, u64)],
) -> Result<()> {
    if addresses.is_empty() {
        return Ok(());
    }
    let (_arrays, [a_arr, b_arr, c_arr]) = pointer_arrays(device, addresses.iter().copied())?;
    let ty = data_type(dtype)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let blas = dev.cublas_handle();
    // SAFETY: the three pointer arrays are device memory of `addresses.len()` entries; each A, B and C is a
    // live device allocation of at least `out·k`, `n_rows·k` and `n_rows·ldc` elements of `dtype` (the
    // caller's tensors); the handle is bound to the tensors' stream.
    let status = unsafe {
        sys::cublasGemmBatchedEx(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            cublas_int(out)?,
            cublas_int(n_rows)?,
            cublas_int(k)?,
            (&alpha as *const f32).cast(),
            a_arr as *const *const std::ffi::c_void,
            ty,
            cublas_int(k)?,
            b_arr as *const *const std::ffi::c_void,
            ty,
            cublas_int(k)?,
            (&beta as *const f32).cast(),
            c_arr as *const *mut std::ffi::c_void,
            ty,
            cublas_int(ldc)?,
            cublas_int(addresses.len())?,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(cuda_err(format!("cublasGemmBatchedEx: {status:?}")).into());
    }
    Ok(())
}

/// The assignments grouped by expert on the host (the layer's one read-back), with the index tensors the
/// device steps need.
struct Grouped {
    /// Assignment `t·slots + s` of each sorted row.
    sorted: Tensor,
    /// Sorted row of each assignment.
    inverse: Tensor,
    /// Token of each sorted row.
    token: Tensor,
    /// `(expert, first sorted row, rows)` of each active expert, by expert.
    runs: Vec<(usize, usize, usize)>,
    n_assign: usize,
}

fn group(routes: &Routes, n_experts: usize, device: &Device) -> Result<Grouped> {
    let slots = routes.slots()?;
    let ids: Vec<u32> = routes.ids.flatten_all()?.to_vec1()?;
    if let Some(&bad) = ids.iter().find(|&&e| e as usize >= n_experts) {
        return Err(OpError::Unsupported(format!(
            "moe experts: an assignment routes to expert {bad} of {n_experts}"
        )));
    }
    // Ascending assignment order within one expert, as `moe_align` sorts them.
    let mut sorted: Vec<u32> = (0..ids.len() as u32).collect();
    sorted.sort_by_key(|&a| ids[a as usize]);
    let n_assign = sorted.len();
    let mut inverse = vec![0u32; n_assign];
    for (j, &a) in sorted.iter().enumerate() {
        inverse[a as usize] = j as u32;
    }
    let token: Vec<u32> = sorted.iter().map(|&a| a / slots as u32).collect();
    let mut runs = Vec::new();
    let mut start = 0;
    while start < n_assign {
        let expert = ids[sorted[start] as usize] as usize;
        let mut end = start;
        while end < n_assign && ids[sorted[end] as usize] as usize == expert {
            end += 1;
        }
        runs.push((expert, start, end - start));
        start = end;
    }
    let upload = |v: Vec<u32>| Tensor::from_vec(v, n_assign, device);
    Ok(Grouped {
        sorted: upload(sorted)?,
        inverse: upload(inverse)?,
        token: upload(token)?,
        runs,
        n_assign,
    })
}

/// `out[t] = Σ_s gates[t, s] · y[row of (t, s)]`: `y` `[n_assign, H]` in sorted order, in `dtype`.
fn combine(
    y: &Tensor,
    routes: &Routes,
    grouped: &Grouped,
    tokens: usize,
    dtype: DType,
) -> Result<Tensor> {
    let slots = routes.slots()?;
    let hidden = y.dim(1)?;
    let device = y.device();
    let gates = routes
        .gates
        .flatten_all()?
        .index_select(&grouped.sorted, 0)?
        .unsqueeze(1)?;
    let weighted = y.to_dtype(DType::F32)?.broadcast_mul(&gates)?;
    let by_assignment = weighted.index_select(&grouped.inverse, 0)?.contiguous()?;
    let out = unsafe { Tensor::empty((tokens, hidden), dtype, device)? };
    super::cuda::combine(&by_assignment, tokens, slots, &out)?;
    Ok(out)
}

/// The routed experts over the stacked `gate_up` `[E', 2I, H]` and `down` `[E', H, I]` (module docs), checked by
/// the caller; `x` `[T, H]` contiguous in the weights' dtype.
pub(super) fn experts_grouped_gemm(
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let (tokens, hidden) = x.dims2()?;
    let (n_experts, two_inter, _) = gate_up.dims3()?;
    let inter = two_inter / 2;
    let device = x.device();
    let dtype = x.dtype();
    let grouped = group(routes, n_experts, device)?;
    let n_assign = grouped.n_assign;
    let x = x.contiguous()?;
    let (gate_up, down) = (gate_up.contiguous()?, down.contiguous()?);
    let xs = x.index_select(&grouped.token, 0)?;
    let h = unsafe { Tensor::empty((n_assign, two_inter), dtype, device)? };
    let y = unsafe { Tensor::empty((n_assign, hidden), dtype, device)? };
    let (gate_up_ptr, dev) = device_address(&gate_up)?;
    let (down_ptr, _) = device_address(&down)?;
    let (xs_ptr, _) = device_address(&xs)?;
    let (h_ptr, _) = device_address(&h)?;
    let (y_ptr, _) = device_address(&y)?;
    let bytes = dtype.size_in_bytes() as u64;
    // One problem per run of sorted rows: its expert's [out, k] matrix of the stack at `weights` times the
    // run's k-wide rows at `input`, into its out-wide rows at `output`.
    let problems =
        |(out, k): (usize, usize), weights: u64, input: u64, output: u64| -> Vec<Problem> {
            grouped
                .runs
                .iter()
                .map(|&(e, first, rows)| Problem {
                    out,
                    n_rows: rows,
                    k,
                    a: weights + (e * out * k) as u64 * bytes,
                    b: input + (first * k) as u64 * bytes,
                    c: output + (first * out) as u64 * bytes,
                    ldc: out,
                })
                .collect()
        };
    let gate_up_problems = problems((two_inter, hidden), gate_up_ptr, xs_ptr, h_ptr);
    grouped_gemm(&dev, device, dtype, &gate_up_problems)?;
    let act = crate::swiglu::swiglu(&h, inter)?;
    let (act_ptr, _) = device_address(&act)?;
    let down_problems = problems((hidden, inter), down_ptr, act_ptr, y_ptr);
    grouped_gemm(&dev, device, dtype, &down_problems)?;
    combine(&y, routes, &grouped, tokens, dtype)
}

/// Rows an expert's GEMMs are padded to: its row count rounded up to a power of two (at least 16).
fn bucket_rows(rows: usize) -> usize {
    rows.next_power_of_two().max(16)
}

/// [`experts_grouped_gemm`]'s computation by batched GEMMs over buckets of experts (module docs).
pub(super) fn experts_bucketed_gemm(
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let (tokens, hidden) = x.dims2()?;
    let (n_experts, two_inter, _) = gate_up.dims3()?;
    let inter = two_inter / 2;
    let device = x.device();
    let dtype = x.dtype();
    let grouped = group(routes, n_experts, device)?;
    let n_assign = grouped.n_assign;
    // Each run's padded block: (expert, first sorted row, rows, padded rows, first padded row).
    let mut blocks = Vec::with_capacity(grouped.runs.len());
    let mut padded_total = 0;
    for &(e, first, rows) in &grouped.runs {
        let padded = bucket_rows(rows);
        blocks.push((e, first, rows, padded, padded_total));
        padded_total += padded;
    }
    let widest = blocks.iter().map(|b| b.3).max().unwrap_or(0);
    // The gathered rows in sorted order, then `widest` more (token 0's, finite) for the last blocks' padding.
    let token_ext = Tensor::cat(
        &[&grouped.token, &Tensor::zeros(widest, DType::U32, device)?],
        0,
    )?;
    let x = x.contiguous()?;
    let (gate_up, down) = (gate_up.contiguous()?, down.contiguous()?);
    let xs = x.index_select(&token_ext, 0)?;
    let h = unsafe { Tensor::empty((padded_total, two_inter), dtype, device)? };
    let y = unsafe { Tensor::empty((padded_total, hidden), dtype, device)? };
    let (gate_up_ptr, dev) = device_address(&gate_up)?;
    let (down_ptr, _) = device_address(&down)?;
    let (xs_ptr, _) = device_address(&xs)?;
    let (h_ptr, _) = device_address(&h)?;
    let (y_ptr, _) = device_address(&y)?;
    let bytes = dtype.size_in_bytes() as u64;
    let mut buckets: Vec<usize> = blocks.iter().map(|b| b.3).collect();
    buckets.sort_unstable();
    buckets.dedup();
    // One batched GEMM per bucket: each block's expert [out, k] matrix of the stack at `weights` times its
    // k-wide input rows at `input` (from the block's row `input_row` picks), into its padded out-wide rows at
    // `output`.
    let run_buckets = |(out, k): (usize, usize),
                       weights: u64,
                       input: u64,
                       input_row: fn(&(usize, usize, usize, usize, usize)) -> usize,
                       output: u64|
     -> Result<()> {
        for &padded in &buckets {
            let addresses: Vec<(u64, u64, u64)> = blocks
                .iter()
                .filter(|b| b.3 == padded)
                .map(|block| {
                    let (e, at) = (block.0, block.4);
                    (
                        weights + (e * out * k) as u64 * bytes,
                        input + (input_row(block) * k) as u64 * bytes,
                        output + (at * out) as u64 * bytes,
                    )
                })
                .collect();
            batched_gemm(&dev, device, dtype, (out, padded, k, out), &addresses)?;
        }
        Ok(())
    };
    // Gate and up read the gathered rows in sorted order (a block's first sorted row); down reads the
    // activations in the padded blocks' rows.
    run_buckets((two_inter, hidden), gate_up_ptr, xs_ptr, |b| b.1, h_ptr)?;
    let act = crate::swiglu::swiglu(&h, inter)?;
    let (act_ptr, _) = device_address(&act)?;
    run_buckets((hidden, inter), down_ptr, act_ptr, |b| b.4, y_ptr)?;
    // Each sorted row's output from its block.
    let mut from_block = vec![0u32; n_assign];
    for &(_, first, rows, _, at) in &blocks {
        for r in 0..rows {
            from_block[first + r] = (at + r) as u32;
        }
    }
    let y_sorted = y.index_select(&Tensor::from_vec(from_block, n_assign, device)?, 0)?;
    combine(&y_sorted, routes, &grouped, tokens, dtype)
}

/// The routed experts kept quantised (`dims` = (E', H, I), checked by the caller), each active expert's
/// projections dequantised to `x`'s dtype in chunks (module docs).
pub(super) fn quantized_experts_grouped_gemm(
    x: &Tensor,
    routes: &Routes,
    weights: &QuantizedExperts,
    (n_experts, hidden, inter): (usize, usize, usize),
) -> Result<Tensor> {
    let tokens = x.dim(0)?;
    let device = x.device();
    let dtype = x.dtype();
    let grouped = group(routes, n_experts, device)?;
    let n_assign = grouped.n_assign;
    let bytes = dtype.size_in_bytes();
    let xs = x.contiguous()?.index_select(&grouped.token, 0)?;
    let h = unsafe { Tensor::empty((n_assign, 2 * inter), dtype, device)? };
    let y = unsafe { Tensor::empty((n_assign, hidden), dtype, device)? };
    let (xs_ptr, dev) = device_address(&xs)?;
    let (h_ptr, _) = device_address(&h)?;
    let (y_ptr, _) = device_address(&y)?;
    let per_expert = 3 * hidden * inter * bytes;
    let chunk = (DENSE_CHUNK_BYTES / per_expert.max(1)).max(1);
    let b = bytes as u64;
    // Gate and up: each expert's two matrices into the two halves of its rows of h.
    for runs in grouped.runs.chunks(chunk) {
        let dense: Vec<(Tensor, Tensor)> = runs
            .iter()
            .map(|&(e, _, _)| {
                Ok((
                    weights.dense(e, Projection::Gate, dtype)?,
                    weights.dense(e, Projection::Up, dtype)?,
                ))
            })
            .collect::<Result<_>>()?;
        let mut problems = Vec::with_capacity(2 * runs.len());
        for (&(_, first, rows), (gate, up)) in runs.iter().zip(&dense) {
            for (matrix, half) in [(gate, 0), (up, inter)] {
                problems.push(Problem {
                    out: inter,
                    n_rows: rows,
                    k: hidden,
                    a: device_address(matrix)?.0,
                    b: xs_ptr + (first * hidden) as u64 * b,
                    c: h_ptr + (first * 2 * inter + half) as u64 * b,
                    ldc: 2 * inter,
                });
            }
        }
        grouped_gemm(&dev, device, dtype, &problems)?;
    }
    let act = crate::swiglu::swiglu(&h, inter)?;
    let (act_ptr, _) = device_address(&act)?;
    for runs in grouped.runs.chunks(chunk) {
        let dense: Vec<Tensor> = runs
            .iter()
            .map(|&(e, _, _)| weights.dense(e, Projection::Down, dtype))
            .collect::<Result<_>>()?;
        let problems = runs
            .iter()
            .zip(&dense)
            .map(|(&(_, first, rows), down)| {
                Ok(Problem {
                    out: hidden,
                    n_rows: rows,
                    k: inter,
                    a: device_address(down)?.0,
                    b: act_ptr + (first * inter) as u64 * b,
                    c: y_ptr + (first * hidden) as u64 * b,
                    ldc: hidden,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        grouped_gemm(&dev, device, dtype, &problems)?;
    }
    combine(&y, routes, &grouped, tokens, dtype)
}
