//! Launch of `kernels/src/sparse_mla.cu` and `sparse_mla_sm90.cu`: the op's glue (checks, parameters,
//! outputs, workspace) here; which attention kernel runs and how it splits the top-k in `attention.rs`; the
//! merge of the splits in `combine.rs`. bf16 goes through the mma.sync (or wgmma) kernels, f32 through the
//! FMA kernel.

mod attention;
mod combine;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId};
use candle_core::{CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use super::limits::{f32_shared_bytes, BF16_VALUE_DIMS, MAX_ROPE};
use super::{Bf16Kernel, PagedLatentCache, SparseMlaLaunch};
use crate::cuda::{cuda_err, device_address, device_info, kernel};
use crate::error::{check_shape, OpError, Result};
use glm5_kernels::interface::SparseMlaParams;

const MODULE: (&str, &[u8]) = ("sparse_mla", glm5_kernels::SPARSE_MLA);
const WGMMA_MODULE: (&str, &[u8]) = ("sparse_mla_sm90", glm5_kernels::SPARSE_MLA_SM90);

/// NaN-fills `bytes` at `ptr` when the launch poisons its outputs.
fn poison(
    launch: &SparseMlaLaunch,
    ptr: u64,
    bytes: usize,
    stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> candle_core::Result<()> {
    if launch.poison_outputs {
        // SAFETY: `ptr` is a live allocation of at least `bytes` bytes on this stream's context.
        unsafe {
            candle_core::cuda_backend::cudarc::driver::result::memset_d8_async(
                ptr,
                0xFF,
                bytes,
                stream.cu_stream(),
            )
        }
        .map_err(cuda_err)?;
    }
    Ok(())
}

/// Whether this module serves `q`: a CUDA tensor of a dtype with a kernel.
pub(super) fn serves(q: &Tensor) -> bool {
    q.device().is_cuda() && matches!(q.dtype(), DType::BF16 | DType::F32)
}

/// The kernels' parameter struct (`glm5_kernels::interface`, whose layout `kernels/build.rs` checks against
/// the CUDA side's), passed by value.
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
struct Params(SparseMlaParams);
// SAFETY: plain-old-data with the C layout of the kernel's parameter struct (checked at build time).
unsafe impl DeviceRepr for Params {}

impl std::ops::Deref for Params {
    type Target = SparseMlaParams;
    fn deref(&self) -> &SparseMlaParams {
        &self.0
    }
}

/// Function `name` of one of this op's modules (`sparse_mla.cu` or `sparse_mla_sm90.cu`).
fn kernel_fn(
    dev: &CudaDevice,
    (module, image): (&'static str, &'static [u8]),
    name: &str,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaFunction> {
    kernel(dev, module, image, name)
}

impl std::ops::DerefMut for Params {
    fn deref_mut(&mut self) -> &mut SparseMlaParams {
        &mut self.0
    }
}

struct SparseMla {
    indices: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    token_seq: Tensor,
    value_dim: usize,
    scale: f32,
    launch: SparseMlaLaunch,
    lse: Arc<Mutex<Option<CudaStorage>>>,
}

impl SparseMla {
    fn launch(
        &self,
        q: &CudaStorage,
        q_layout: &Layout,
        kv: &CudaStorage,
        kv_layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev: &CudaDevice = q.device();
        let stream = dev.cuda_stream();
        let (t_len, heads, row_dim) = q_layout.shape().dims3()?;
        let (_, block_size, _) = kv_layout.shape().dims3()?;
        let (_, max_blocks) = self.block_table.dims2()?;
        let k_len = self.indices.dim(1)?;
        let value_dim = self.value_dim;
        let (q_start, q_end) = q_layout
            .contiguous_offsets()
            .ok_or_else(|| cuda_err("q must be contiguous"))?;
        let (kv_start, kv_end) = kv_layout
            .contiguous_offsets()
            .ok_or_else(|| cuda_err("cache must be contiguous"))?;

        let mut params = Params(SparseMlaParams {
            t: t_len as i32,
            h: heads as i32,
            d: row_dim as i32,
            dv: value_dim as i32,
            k: k_len as i32,
            block_size: block_size as i32,
            max_blocks: max_blocks as i32,
            scale: self.scale,
            block_table: device_address(&self.block_table)?.0,
            seq_lens: device_address(&self.seq_lens)?.0,
            token_seq: device_address(&self.token_seq)?.0,
            indices: device_address(&self.indices)?.0,
            ..Default::default()
        });
        let lse = unsafe { dev.alloc::<f32>(t_len * heads) }?;
        let lse_ptr = lse.device_ptr(&stream).0;
        params.lse = lse_ptr;
        poison(&self.launch, lse_ptr, t_len * heads * 4, &stream)?;

        let out = match q.dtype() {
            DType::BF16 => {
                let q_slice = q.as_cuda_slice::<half::bf16>()?.slice(q_start..q_end);
                let kv_slice = kv.as_cuda_slice::<half::bf16>()?.slice(kv_start..kv_end);
                let q_ptr = q_slice.device_ptr(&stream).0;
                let kv_ptr = kv_slice.device_ptr(&stream).0;
                params.q = q_ptr;
                params.kv = kv_ptr;
                let out = unsafe { dev.alloc::<half::bf16>(t_len * heads * value_dim) }?;
                let out_ptr = out.device_ptr(&stream).0;
                params.out = out_ptr;
                poison(
                    &self.launch,
                    out_ptr,
                    t_len * heads * value_dim * 2,
                    &stream,
                )?;
                attention::launch_bf16(dev, &mut params, &self.launch)?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }
            DType::F32 => {
                let q_slice = q.as_cuda_slice::<f32>()?.slice(q_start..q_end);
                let kv_slice = kv.as_cuda_slice::<f32>()?.slice(kv_start..kv_end);
                let q_ptr = q_slice.device_ptr(&stream).0;
                let kv_ptr = kv_slice.device_ptr(&stream).0;
                params.q = q_ptr;
                params.kv = kv_ptr;
                let out = unsafe { dev.alloc::<f32>(t_len * heads * value_dim) }?;
                let out_ptr = out.device_ptr(&stream).0;
                params.out = out_ptr;
                poison(
                    &self.launch,
                    out_ptr,
                    t_len * heads * value_dim * 4,
                    &stream,
                )?;
                params.num_splits = 1;
                let func = kernel(dev, MODULE.0, MODULE.1, "sparse_mla_f32")?;
                let smem = f32_shared_bytes(row_dim, value_dim);
                let cfg = LaunchConfig {
                    grid_dim: (t_len as u32, heads as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                let mut builder = stream.launch_builder(&func);
                builder.arg(&params);
                unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }
            other => candle_core::bail!("sparse_mla kernel: unsupported dtype {other:?}"),
        };
        *self.lse.lock().map_err(cuda_err)? = Some(CudaStorage::wrap_cuda_slice(lse, dev.clone()));
        Ok((out, Shape::from((t_len, heads, value_dim))))
    }
}

thread_local! {
    /// Split partials (f32 out, then lse) per device, kept between calls. Per thread because candle's
    /// CUDA device issues work on the per-thread default stream: one thread's launches are ordered.
    static SPLIT_WORKSPACE: RefCell<HashMap<DeviceId, CudaSlice<f32>>> = RefCell::new(HashMap::new());
}

/// Device pointer to at least `len` f32 of this thread's split workspace on `dev`.
fn split_workspace(dev: &CudaDevice, len: usize) -> candle_core::Result<u64> {
    SPLIT_WORKSPACE.with(|cell| {
        let mut map = cell.borrow_mut();
        let stream = dev.cuda_stream();
        let slot = map.get(&dev.id()).filter(|s| s.len() >= len);
        if slot.is_none() {
            // SAFETY: every element the kernels read is written by the same launch first.
            let fresh = unsafe { dev.alloc::<f32>(len.next_power_of_two()) }?;
            if let Some(outgrown) = map.insert(dev.id(), fresh) {
                crate::cuda::retire(outgrown);
            }
        }
        let slice = map
            .get(&dev.id())
            .ok_or_else(|| cuda_err("split workspace missing"))?;
        let ptr = slice.device_ptr(&stream).0;
        Ok(ptr)
    })
}

impl CustomOp2 for SparseMla {
    fn name(&self) -> &'static str {
        "sparse_mla"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("sparse_mla: the CUDA op got CPU tensors")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_layout: &Layout,
        kv: &CudaStorage,
        kv_layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.launch(q, q_layout, kv, kv_layout)
    }
}

/// Hands out the lse the attention launch left behind (a CustomOp has a single output).
struct TakeLse {
    lse: Arc<Mutex<Option<CudaStorage>>>,
    shape: Shape,
}

impl CustomOp1 for TakeLse {
    fn name(&self) -> &'static str {
        "sparse_mla_lse"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("sparse_mla_lse: CUDA only")
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let lse = self
            .lse
            .lock()
            .map_err(cuda_err)?
            .take()
            .ok_or_else(|| cuda_err("sparse_mla produced no lse"))?;
        Ok((lse, self.shape.clone()))
    }
}

pub(super) fn sparse_mla_paged(
    q: &Tensor,
    cache: &PagedLatentCache,
    indices: &Tensor,
    value_dim: usize,
    softmax_scale: f64,
    launch: &SparseMlaLaunch,
) -> Result<(Tensor, Tensor)> {
    let [t_len, heads, row_dim] = check_shape("q", q, [("T", None), ("H", None), ("D", None)])?;
    check_shape(
        "blocks",
        cache.blocks,
        [
            ("num_blocks", None),
            ("block_size", None),
            ("D", Some(row_dim)),
        ],
    )?;
    let [batch, _] = check_shape(
        "block_table",
        cache.block_table,
        [("B", None), ("max_blocks", None)],
    )?;
    check_shape("seq_lens", cache.seq_lens, [("B", Some(batch))])?;
    check_shape("token_seq", cache.token_seq, [("T", Some(t_len))])?;
    check_shape("indices", indices, [("T", Some(t_len)), ("K", None)])?;
    crate::error::check_same_dtype("blocks", cache.blocks, "q", q)?;
    for (arg, tensor) in [
        ("indices", indices),
        ("block_table", cache.block_table),
        ("seq_lens", cache.seq_lens),
        ("token_seq", cache.token_seq),
    ] {
        if tensor.dtype() != DType::I32 {
            return Err(OpError::IndexDType {
                arg,
                expected: DType::I32,
                found: tensor.dtype(),
            });
        }
    }
    if value_dim > row_dim {
        return Err(OpError::ValueDimTooLarge { value_dim, row_dim });
    }
    if row_dim % 8 != 0
        || (q.dtype() == DType::BF16
            && (!BF16_VALUE_DIMS.contains(&value_dim) || row_dim > value_dim + MAX_ROPE))
    {
        return Err(OpError::Unsupported(format!(
            "sparse_mla CUDA kernel: row width {row_dim} must be a multiple of 8, and for bf16 the value width one of {BF16_VALUE_DIMS:?} with at most {MAX_ROPE} more columns in a row (got value width {value_dim})"
        )));
    }
    if launch.kernel == Bf16Kernel::Wgmma && q.dtype() == DType::BF16 {
        let candle_core::Device::Cuda(dev) = q.device() else {
            return Err(OpError::Unsupported(
                "sparse_mla wgmma kernel: not a CUDA device".into(),
            ));
        };
        if let Some(reason) =
            attention::wgmma_unsupported(&device_info(dev)?, heads, row_dim, value_dim)
        {
            return Err(OpError::Unsupported(format!(
                "sparse_mla wgmma kernel: {reason}"
            )));
        }
    }
    let lse = Arc::new(Mutex::new(None));
    let op = SparseMla {
        indices: indices.contiguous()?,
        block_table: cache.block_table.contiguous()?,
        seq_lens: cache.seq_lens.contiguous()?,
        token_seq: cache.token_seq.contiguous()?,
        value_dim,
        scale: softmax_scale as f32,
        launch: *launch,
        lse: lse.clone(),
    };
    let out = q
        .contiguous()?
        .apply_op2_no_bwd(&cache.blocks.contiguous()?, &op)?;
    let lse = out.apply_op1_no_bwd(&TakeLse {
        lse,
        shape: Shape::from((t_len, heads)),
    })?;
    Ok((out, lse))
}
