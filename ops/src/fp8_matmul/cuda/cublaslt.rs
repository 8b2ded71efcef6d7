//! cuBLASLt's FP8 GEMMs, as candle already links the library (cudarc 0.19's `cublaslt` bindings): the
//! block-scaled GEMM of `fp8_matmul`'s W8A8 backend and a plain per-tensor-scaled one (the bench's FP8 rate).
//!
//! Why cuBLASLt rather than a kernel of glm5's own (the project's rule: dependencies first): since 12.9 it
//! runs DeepSeek-style block-scaled FP8, exactly GLM-5-FP8's format, on Hopper's FP8 tensor cores with the
//! scales applied inside the kernel, and candle already links it, so nothing is added to the build.
//!
//! # How the block-scaled GEMM is called, and where each fact comes from
//!
//! From NVIDIA's cuBLAS documentation (13.x), `cublasLtMatmul()`, "To use tensor- or block-scaled FP8
//! kernels": A transposed and B not ("TN") on Hopper, `CUBLAS_COMPUTE_32F`, scale type `CUDA_R_32F`, pointers
//! and matrix dimensions 16-byte aligned; with these scaling modes D is bf16, f16 or f32 (not FP8). Section
//! "128-element 1D and 128x128 2D Block Scaling For FP8 Data Types": supported on compute capability 9.0
//! ("Scaling Mode Support Overview"); (A, B) = (`BLK128x128_32F`, `VEC128_32F`) is a supported pair;
//! `D[i, j] = Σ_b scale_A[.., b] · scale_B[.., b] · Σ_{l in block b} A[i, l] · B[l, j]` with `L = ceil(K / 128)`
//! blocks along K. Its "Scaling factors layouts": scale addresses 16-byte aligned; M and N multiples of 4;
//! `VEC128_32F`: "N-major for B with shape N x L" (the N elements contiguous); `BLK128x128_32F`: "K-major and
//! the stride between the consecutive columns must be a multiple of 4 ... for A, the shape of the scaling
//! factors is L4 x ceil(M / 128)" with `L4` = L rounded up to a multiple of 4.
//!
//! cuBLAS is column-major, so the row-major `y [m, n] = x [m, k] · W [n, k]ᵀ` is the column-major
//! `D (n x m) = op(A) · B` with:
//!   * A = the weight's e4m3 bytes, stored as a K x n column-major matrix (ld = k: a row of W is a column),
//!     `TRANSA = T`; scales `BLK128x128_32F` = the checkpoint's `scale_inv [ceil(n / 128), L]` row-major
//!     with each row padded to `L4` floats (`L4 x ceil(n / 128)`, K-major);
//!   * B = the quantised activations, K x m_pad column-major (ld = k: `codes [m_pad, k]` row-major),
//!     `TRANSB = N`; scales `VEC128_32F` = `[L, m_pad]` with the tokens contiguous ("N-major", N x L);
//!   * C = D = y, n x m_pad column-major (ld = n: `y [m_pad, n]` row-major), beta = 0.
//!
//! Peers doing the same: PyTorch's `torch._scaled_mm` (`aten/src/ATen/native/cuda/ScaledBlas.cpp`) passes
//! the weight as cuBLAS's A with `'t'` and the activations as B with `'n'`, checks 1x128 scales as
//! `[M, K / 128]` with strides `(1, M)` and 128x128 scales as `[N / 128, K / 128]` with the row stride
//! rounded up to 4; NVIDIA's CUDALibrarySamples `LtBlk128x128Fp8Matmul` sets the same attributes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t;
use candle_core::cuda_backend::cudarc::cublaslt::sys::{
    self, cublasComputeType_t, cublasLtMatmulAlgo_t, cublasLtMatmulDescAttributes_t as Desc,
    cublasLtMatmulMatrixScale_t, cublasLtMatmulPreferenceAttributes_t as Pref, cublasStatus_t,
    cudaDataType,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::DType;

use crate::cuda::cuda_err;
use crate::error::{OpError, Result};

/// Workspace per device: NVIDIA's recommendation for Hopper (32 MiB; cudarc's `Workspace` uses the same).
const WORKSPACE_BYTES: usize = 32 << 20;

/// The version of the cuBLASLt library this process runs (major · 10000 + minor · 100 + patch).
pub(crate) fn version() -> usize {
    // SAFETY: a plain query of the library, no arguments, no device needed.
    unsafe { sys::cublasLtGetVersion() }
}

fn status_error(call: &'static str, status: cublasStatus_t, context: impl Into<String>) -> OpError {
    OpError::Cublas {
        call,
        status: format!("{status:?}"),
        context: context.into(),
    }
}

fn check(call: &'static str, status: cublasStatus_t, context: &dyn Fn() -> String) -> Result<()> {
    match status {
        cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        other => Err(status_error(call, other, context())),
    }
}

/// A cuBLASLt handle (not tied to a context, cuBLAS documentation "cublasLtHandle_t") with the device's
/// workspace and the algorithms chosen so far.
struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    algos: Mutex<HashMap<GemmKey, (cublasLtMatmulAlgo_t, usize)>>,
}

// SAFETY: the handle is an opaque pointer cuBLASLt allows to be used from any thread; the calls on it are
// serialised per device by the one stream candle launches on, and the workspace is only used on that stream.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

/// The cuBLASLt handle and workspace of `dev`, made on first use and kept for the process.
fn lt(dev: &CudaDevice) -> Result<Arc<Lt>> {
    static LT: OnceLock<Mutex<HashMap<DeviceId, Arc<Lt>>>> = OnceLock::new();
    let mut all = LT
        .get_or_init(Default::default)
        .lock()
        .map_err(|e| OpError::Candle(cuda_err(e)))?;
    if let Some(lt) = all.get(&dev.id()) {
        return Ok(lt.clone());
    }
    let stream = dev.cuda_stream();
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| OpError::Candle(cuda_err(e)))?;
    let mut handle = std::ptr::null_mut();
    // SAFETY: `handle` is a valid out pointer.
    check(
        "cublasLtCreate",
        unsafe { sys::cublasLtCreate(&mut handle) },
        &|| String::new(),
    )?;
    // SAFETY: only ever used as cuBLASLt's workspace, which needs no initial contents.
    let workspace =
        unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }.map_err(|e| OpError::Candle(cuda_err(e)))?;
    let lt = Arc::new(Lt {
        handle,
        workspace,
        algos: Mutex::new(HashMap::new()),
    });
    all.insert(dev.id(), lt.clone());
    Ok(lt)
}

/// The scaling of a GEMM's A and B.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Scaling {
    /// A: `BLK128x128_32F` at this device address, B: `VEC128_32F` at this one (module header).
    Blocks { a: u64, b: u64 },
    /// One scale of 1 each (`SCALAR_32F`, no pointer); optionally cuBLASLt's fast FP8 accumulation.
    PerTensor { fast_accumulation: bool },
}

/// One FP8 GEMM `D (n x m) = op(A) · B` in cuBLAS's column-major terms (module header): A `K x n` e4m3 at
/// `a` (TRANSA = T), B `K x m` e4m3 at `b`, D `n x m` at `d` in `out` (bf16 or f32), all leading dimensions
/// packed.
pub(crate) struct Gemm {
    pub n: usize,
    pub m: usize,
    pub k: usize,
    pub a: u64,
    pub b: u64,
    pub d: u64,
    pub out: DType,
    pub scaling: Scaling,
}

/// What an algorithm is chosen for: the shape, output type, scaling kind and the operands' alignments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GemmKey {
    n: usize,
    m: usize,
    k: usize,
    out: u8,
    blocks: bool,
    fast_accumulation: bool,
    alignments: [u32; 3],
}

/// The largest power of two (at most 256, cuBLASLt's default assumption) dividing `address`.
fn alignment(address: u64) -> u32 {
    (1u64 << address.trailing_zeros().min(8)) as u32
}

/// Owns a matmul descriptor, three layouts and a preference, destroyed on drop.
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    pref: sys::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created by cuBLASLt below (or is null, which the destroy calls accept) and is
        // destroyed once; the statuses are of no use here.
        unsafe {
            sys::cublasLtMatmulPreferenceDestroy(self.pref);
            for layout in self.layouts {
                sys::cublasLtMatrixLayoutDestroy(layout);
            }
            sys::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

impl Gemm {
    fn context(&self) -> String {
        format!(
            "FP8 GEMM (column-major) n={} m={} k={}, D {:?}, {}",
            self.n,
            self.m,
            self.k,
            self.out,
            match self.scaling {
                Scaling::Blocks { .. } => "A BLK128x128_32F, B VEC128_32F".to_string(),
                Scaling::PerTensor { fast_accumulation } =>
                    format!("per-tensor scales, fast accumulation {fast_accumulation}"),
            }
        )
    }

    fn key(&self) -> Result<GemmKey> {
        let (blocks, fast_accumulation) = match self.scaling {
            Scaling::Blocks { .. } => (true, false),
            Scaling::PerTensor { fast_accumulation } => (false, fast_accumulation),
        };
        Ok(GemmKey {
            n: self.n,
            m: self.m,
            k: self.k,
            out: out_type(self.out)? as u8,
            blocks,
            fast_accumulation,
            alignments: [alignment(self.a), alignment(self.b), alignment(self.d)],
        })
    }

    /// The descriptors of this GEMM (module header) and its search preference.
    fn descriptors(&self) -> Result<Descriptors> {
        let context = || self.context();
        let mut d = Descriptors {
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
            pref: std::ptr::null_mut(),
        };
        // SAFETY: every call gets valid out pointers or the descriptors just created, and attribute buffers
        // of the size and type cuBLASLt documents for the attribute (i32 enums, 8-byte pointers).
        unsafe {
            check(
                "cublasLtMatmulDescCreate",
                sys::cublasLtMatmulDescCreate(
                    &mut d.desc,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cudaDataType::CUDA_R_32F,
                ),
                &context,
            )?;
            let set = |attr: Desc, value: *const c_void, size: usize| {
                check(
                    "cublasLtMatmulDescSetAttribute",
                    sys::cublasLtMatmulDescSetAttribute(d.desc, attr, value, size),
                    &|| format!("{attr:?}: {}", self.context()),
                )
            };
            let (transa, transb) = (
                cublasOperation_t::CUBLAS_OP_T as i32,
                cublasOperation_t::CUBLAS_OP_N as i32,
            );
            set(Desc::CUBLASLT_MATMUL_DESC_TRANSA, ptr(&transa), 4)?;
            set(Desc::CUBLASLT_MATMUL_DESC_TRANSB, ptr(&transb), 4)?;
            match self.scaling {
                Scaling::Blocks { a, b } => {
                    let a_mode =
                        cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                            as i32;
                    let b_mode =
                        cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as i32;
                    let (a_ptr, b_ptr) = (a as *const c_void, b as *const c_void);
                    set(Desc::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, ptr(&a_mode), 4)?;
                    set(Desc::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, ptr(&b_mode), 4)?;
                    set(Desc::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ptr(&a_ptr), 8)?;
                    set(Desc::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ptr(&b_ptr), 8)?;
                }
                Scaling::PerTensor { fast_accumulation } => {
                    let fast = i8::from(fast_accumulation);
                    set(Desc::CUBLASLT_MATMUL_DESC_FAST_ACCUM, ptr(&fast), 1)?;
                }
            }
            let out = out_type(self.out)?;
            let (n, m, k) = (self.n as u64, self.m as u64, self.k as u64);
            for (slot, (ty, rows, cols)) in [
                (cudaDataType::CUDA_R_8F_E4M3, k, n),
                (cudaDataType::CUDA_R_8F_E4M3, k, m),
                (out, n, m),
            ]
            .into_iter()
            .enumerate()
            {
                check(
                    "cublasLtMatrixLayoutCreate",
                    sys::cublasLtMatrixLayoutCreate(
                        &mut d.layouts[slot],
                        ty,
                        rows,
                        cols,
                        rows as i64,
                    ),
                    &context,
                )?;
            }
            check(
                "cublasLtMatmulPreferenceCreate",
                sys::cublasLtMatmulPreferenceCreate(&mut d.pref),
                &context,
            )?;
            let workspace = WORKSPACE_BYTES as u64;
            let pref = |attr: Pref, value: *const c_void, size: usize| {
                check(
                    "cublasLtMatmulPreferenceSetAttribute",
                    sys::cublasLtMatmulPreferenceSetAttribute(d.pref, attr, value, size),
                    &|| format!("{attr:?}: {}", self.context()),
                )
            };
            pref(
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                ptr(&workspace),
                8,
            )?;
            // The operands' real alignments, so that the heuristic picks no kernel assuming more.
            for (attr, address) in [
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, self.a),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, self.b),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, self.d),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, self.d),
            ] {
                let bytes = alignment(address);
                pref(attr, ptr(&bytes), 4)?;
            }
        }
        Ok(d)
    }

    /// Runs the GEMM on `dev`'s stream: the heuristic's first algorithm for this key (asked once per key
    /// and kept), then `cublasLtMatmul` with alpha 1, beta 0 and C = D.
    pub(crate) fn run(&self, dev: &CudaDevice) -> Result<()> {
        let lt = lt(dev)?;
        let stream = dev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| OpError::Candle(cuda_err(e)))?;
        let d = self.descriptors()?;
        let key = self.key()?;
        let cached = lt
            .algos
            .lock()
            .map_err(|e| OpError::Candle(cuda_err(e)))?
            .get(&key)
            .copied();
        let (algo, workspace_bytes) = match cached {
            Some(found) => found,
            None => {
                // SAFETY: all-zero is a valid bit pattern of the result struct (plain data), which cuBLASLt
                // overwrites for every result it returns.
                let mut result: sys::cublasLtMatmulHeuristicResult_t =
                    unsafe { std::mem::zeroed() };
                let mut count = 0;
                // SAFETY: the descriptors are live; `result` has room for the one result asked for.
                check(
                    "cublasLtMatmulAlgoGetHeuristic",
                    unsafe {
                        sys::cublasLtMatmulAlgoGetHeuristic(
                            lt.handle,
                            d.desc,
                            d.layouts[0],
                            d.layouts[1],
                            d.layouts[2],
                            d.layouts[2],
                            d.pref,
                            1,
                            &mut result,
                            &mut count,
                        )
                    },
                    &|| self.context(),
                )?;
                if count == 0 {
                    return Err(status_error(
                        "cublasLtMatmulAlgoGetHeuristic",
                        cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
                        format!("no algorithm for {}", self.context()),
                    ));
                }
                check(
                    "cublasLtMatmulAlgoGetHeuristic (result)",
                    result.state,
                    &|| self.context(),
                )?;
                let found = (result.algo, result.workspaceSize);
                lt.algos
                    .lock()
                    .map_err(|e| OpError::Candle(cuda_err(e)))?
                    .insert(key, found);
                found
            }
        };
        if workspace_bytes > WORKSPACE_BYTES {
            return Err(status_error(
                "cublasLtMatmulAlgoGetHeuristic",
                cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE,
                format!(
                    "the algorithm wants {workspace_bytes} bytes of workspace, {WORKSPACE_BYTES} given: {}",
                    self.context()
                ),
            ));
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let workspace = lt.workspace.device_ptr(&stream).0;
        // SAFETY: the descriptors describe the operands at `a`, `b` and `d`, which the callers keep alive
        // (and `d` writable) for the launch; the algorithm was chosen for these descriptors (the key holds
        // everything they depend on); the workspace is this device's, used only on its one stream.
        check(
            "cublasLtMatmul",
            unsafe {
                sys::cublasLtMatmul(
                    lt.handle,
                    d.desc,
                    ptr(&alpha),
                    self.a as *const c_void,
                    d.layouts[0],
                    self.b as *const c_void,
                    d.layouts[1],
                    ptr(&beta),
                    self.d as *const c_void,
                    d.layouts[2],
                    self.d as *mut c_void,
                    d.layouts[2],
                    &algo,
                    workspace as *mut c_void,
                    WORKSPACE_BYTES,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            },
            &|| self.context(),
        )
    }
}

fn ptr<T>(value: &T) -> *const c_void {
    (value as *const T).cast()
}

/// cuBLASLt's type of an output dtype (bf16 or f32).
fn out_type(dtype: DType) -> Result<cudaDataType> {
    match dtype {
        DType::BF16 => Ok(cudaDataType::CUDA_R_16BF),
        DType::F32 => Ok(cudaDataType::CUDA_R_32F),
        other => Err(OpError::NotFloat {
            arg: "FP8 GEMM output",
            found: other,
        }),
    }
}
