//! The launcher of `kernels/src/moe.cu` (kernel chain in that file's header).

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor};

use glm5_kernels::interface::moe::{
    route_shared_bytes, route_threads, ROUTER_EXPERTS, ROUTER_THREADS, ROUTER_TOKENS,
};
use glm5_kernels::interface::weight_only::{
    q4k_mma_warps, q4k_row_staged_bytes, tile_loop_blocks, DEFAULT_DYNAMIC_SHARED_BYTES,
    Q4K_MMA_ROW_TILE,
};

use super::quantized::{QuantizedExperts, StackedFp8, StackedNvfp4};
use super::{RouteRule, Routes};
use crate::cuda::{cuda_err, device_address, kernel, resident_blocks};
use crate::error::Result;
use crate::gguf_matmul::GgufFormat;

/// Warps per block of the mat-vec kernels (`MOE_WARPS`): each block covers this many output rows.
const MATVEC_WARPS: usize = 8;
/// Threads of the grouping kernel (one block).
const ALIGN_THREADS: u32 = 1024;

fn launch_config(grid: (u32, u32, u32), threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// `moe_router_logits_*` where its vector loads fit (`hidden` a multiple of 4, both rows' starts aligned);
/// `None` where they do not (the caller takes candle's matmul).
pub(super) fn router_logits(x: &Tensor, weight: &Tensor) -> Result<Option<Tensor>> {
    let (tokens, hidden) = x.dims2()?;
    let n_experts = weight.dim(0)?;
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    let (x_ptr, dev) = device_address(&x)?;
    let (w_ptr, _) = device_address(&weight)?;
    let x_alignment = 4 * x.dtype().size_in_bytes() as u64;
    if !hidden.is_multiple_of(4) || !x_ptr.is_multiple_of(x_alignment) || !w_ptr.is_multiple_of(16)
    {
        return Ok(None);
    }
    // SAFETY: the kernel writes every [tokens, n_experts] logit (its blocks tile both dims, one thread a logit).
    let logits = unsafe { Tensor::empty((tokens, n_experts), DType::F32, x.device())? };
    let (logits_ptr, _) = device_address(&logits)?;
    let name = crate::cuda::kernel_name("moe_router_logits", x.dtype())?;
    let func = kernel(&dev, "moe", glm5_kernels::MOE, &name)?;
    let grid = (
        n_experts.div_ceil(ROUTER_EXPERTS) as u32,
        tokens.div_ceil(ROUTER_TOKENS) as u32,
        1,
    );
    let (t, e, h) = (tokens as i32, n_experts as i32, hidden as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&x_ptr)
        .arg(&w_ptr)
        .arg(&t)
        .arg(&e)
        .arg(&h)
        .arg(&logits_ptr);
    // SAFETY: x [tokens, hidden] (bf16 or f32, 4-value aligned rows), the weight [n_experts, hidden] f32
    // (16-byte aligned rows) and the logits [tokens, n_experts] f32, contiguous and live until the stream runs
    // the launch, as moe_router_logits_* take them.
    unsafe { builder.launch(launch_config(grid, ROUTER_THREADS as u32, 0)) }.map_err(cuda_err)?;
    Ok(Some(logits))
}

pub(super) fn route(
    logits: &Tensor,
    correction_bias: &Tensor,
    rule: &RouteRule,
    shared_expert: Option<u32>,
) -> Result<Routes> {
    let (tokens, n_experts) = logits.dims2()?;
    let slots = rule.top_k + usize::from(shared_expert.is_some());
    let device = logits.device();
    let logits = logits.contiguous()?;
    let bias = correction_bias.contiguous()?;
    let ids = unsafe { Tensor::empty((tokens, slots), DType::U32, device)? };
    let gates = unsafe { Tensor::empty((tokens, slots), DType::F32, device)? };
    if tokens == 0 {
        return Ok(Routes { ids, gates });
    }
    let (logits_ptr, dev) = device_address(&logits)?;
    let (bias_ptr, _) = device_address(&bias)?;
    let (ids_ptr, _) = device_address(&ids)?;
    let (gates_ptr, _) = device_address(&gates)?;
    let func = kernel(&dev, "moe", glm5_kernels::MOE, "moe_route")?;
    let stream = dev.cuda_stream();
    let threads = route_threads(n_experts) as u32;
    let shared = route_shared_bytes(n_experts, rule.top_k) as u32;
    let (t, e, g, tg, k) = (
        tokens as i32,
        n_experts as i32,
        rule.n_group as i32,
        rule.topk_group as i32,
        rule.top_k as i32,
    );
    let normalise = i32::from(rule.normalise);
    let shared_id = shared_expert.map_or(-1, |s| s as i32);
    let mut builder = stream.launch_builder(&func);
    builder
        .arg(&logits_ptr)
        .arg(&bias_ptr)
        .arg(&t)
        .arg(&e)
        .arg(&g)
        .arg(&tg)
        .arg(&k)
        .arg(&normalise)
        .arg(&rule.scaling)
        .arg(&shared_id)
        .arg(&ids_ptr)
        .arg(&gates_ptr);
    unsafe { builder.launch(launch_config((tokens as u32, 1, 1), threads, shared)) }
        .map_err(cuda_err)?;
    Ok(Routes { ids, gates })
}

/// The assignments grouped by expert (`moe_align`): `sorted` `U32 [n_assign]` (assignment indices, by
/// expert, ascending within one), and in `meta` `I32`: `offsets` `[E+1]`, `active` `[E]`, `active_count`.
pub(super) struct Grouping {
    pub(super) sorted: Tensor,
    meta: Tensor,
    n_experts: usize,
}

impl Grouping {
    fn offsets(&self) -> Result<Tensor> {
        Ok(self.meta.narrow(0, 0, self.n_experts + 1)?)
    }
    fn active(&self) -> Result<Tensor> {
        Ok(self.meta.narrow(0, self.n_experts + 1, self.n_experts)?)
    }
    fn active_count(&self) -> Result<Tensor> {
        Ok(self.meta.narrow(0, 2 * self.n_experts + 1, 1)?)
    }
}

pub(super) fn group_by_expert(ids: &Tensor, n_experts: usize) -> Result<Grouping> {
    let n_assign = ids.elem_count();
    let device = ids.device();
    // Separate allocations: candle-nn's moe_gemm reads `sorted` from its allocation's start.
    let grouping = Grouping {
        sorted: unsafe { Tensor::empty(n_assign, DType::U32, device)? },
        meta: unsafe { Tensor::empty(2 * n_experts + 2, DType::I32, device)? },
        n_experts,
    };
    let (ids_ptr, dev) = device_address(ids)?;
    let (sorted_ptr, _) = device_address(&grouping.sorted)?;
    let (offsets_ptr, _) = device_address(&grouping.offsets()?)?;
    let (active_ptr, _) = device_address(&grouping.active()?)?;
    let (count_ptr, _) = device_address(&grouping.active_count()?)?;
    let (n_assign_arg, n_experts_arg) = (n_assign as i32, n_experts as i32);
    let align = kernel(&dev, "moe", glm5_kernels::MOE, "moe_align")?;
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&align);
    builder
        .arg(&ids_ptr)
        .arg(&n_assign_arg)
        .arg(&n_experts_arg)
        .arg(&offsets_ptr)
        .arg(&sorted_ptr)
        .arg(&active_ptr)
        .arg(&count_ptr);
    unsafe {
        builder.launch(launch_config(
            (1, 1, 1),
            ALIGN_THREADS,
            (n_experts * std::mem::size_of::<i32>()) as u32,
        ))
    }
    .map_err(cuda_err)?;
    Ok(grouping)
}

/// The experts by candle-nn's grouped GEMM (`moe_gemm`, WMMA tensor cores), bf16/f16 only: gate and up in
/// one GEMM over the stacked `[E', 2I, H]`, SiLU·up by candle ops, down with the gates applied, then the
/// per-token sum of the slots in f32.
pub(super) fn experts_moe_gemm(
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let (tokens, hidden) = x.dims2()?;
    let n_experts = gate_up.dim(0)?;
    let inter = gate_up.dim(1)? / 2;
    let slots = routes.slots()?;
    // moe_gemm reads every input from its allocation's start: fresh allocations where a view could be
    // offset (`Tensor::copy` keeps a view's offset; `force_contiguous` does not).
    let ids = routes.ids.flatten_all()?.force_contiguous()?;
    let gates = routes.gates.flatten_all()?.force_contiguous()?;
    let x = x.force_contiguous()?;
    let grouping = group_by_expert(&ids, n_experts)?;
    let gate_up_out = candle_nn::moe::moe_gemm(
        &x,
        &gate_up.contiguous()?,
        &None,
        &grouping.sorted,
        &ids,
        slots,
        true,
    )?;
    let h = crate::swiglu::swiglu(&gate_up_out, inter)?;
    let y = candle_nn::moe::moe_gemm(
        &h,
        &down.contiguous()?,
        &Some(gates),
        &grouping.sorted,
        &ids,
        slots,
        true,
    )?;
    Ok(y.reshape((tokens, slots, hidden))?
        .to_dtype(DType::F32)?
        .sum(1)?
        .to_dtype(x.dtype())?)
}

/// One argument of a kernel launch: a device pointer or an `int`.
#[derive(Clone, Copy)]
enum Arg {
    Ptr(u64),
    Int(i32),
}

fn push_args<'a>(
    builder: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
    args: &'a [Arg],
) {
    for arg in args {
        match arg {
            Arg::Ptr(p) => builder.arg(p),
            Arg::Int(v) => builder.arg(v),
        };
    }
}

/// The experts' kernels `moe_gate_up_{stem}{suffix}` and `moe_down_{stem}{suffix}`, whose weight arguments
/// (`gate_up_args`, `down_args`) follow the activations, then routing, grouping and the per-token sum.
fn grouped_experts(
    x: &Tensor,
    routes: &Routes,
    dims: (usize, usize, usize),
    stem: &str,
    gate_up_args: &[Arg],
    down_args: &[Arg],
) -> Result<Tensor> {
    let kernel = || MatVec::WarpPerRow(stem.to_string());
    grouped_experts_with(
        x,
        routes,
        dims,
        (kernel(), kernel()),
        gate_up_args,
        down_args,
    )
}

/// Which grouped mat-vec kernel runs a projection, and its launch geometry.
enum MatVec {
    /// `moe_{gate_up,down}_[t1_]{stem}{suffix}`: a warp per output row, `MATVEC_WARPS` rows a block.
    WarpPerRow(String),
    /// `moe_{gate_up,down}_q4_k_mma_bf16`: 16 output rows a block of `warps` warps, `staged` bytes of dynamic
    /// shared memory (an expert's one-token row, `q4k_row_staged_bytes` of the projection's input length).
    Q4kMma { warps: usize, staged: usize },
}

impl MatVec {
    /// The kernel's name for `projection` ("gate_up" or "down"), with `t1_` for one token where it has one.
    fn name(&self, projection: &str, one_token: bool, suffix: &str) -> String {
        match self {
            MatVec::WarpPerRow(stem) => {
                let one = if one_token { "t1_" } else { "" };
                format!("moe_{projection}_{one}{stem}{suffix}")
            }
            MatVec::Q4kMma { .. } => format!("moe_{projection}_q4_k_mma_bf16"),
        }
    }

    /// (blocks along the output rows, threads a block, dynamic shared memory bytes) of kernel `name` for
    /// `rows` output rows of each of `experts` block rows. With one token (batch-1 decode: every expert's
    /// row one token's) the Q4_K kernels walk their tiles, each expert given no more blocks than its share of
    /// what the device holds at once (the row staged once a block, loads in flight across tiles:
    /// `tile_loop_blocks`). With more, a block a tile, for the scheduler to spread: an expert of several
    /// tokens takes the slower many-row path, and on a few blocks it became the launch's tail (H100, the Q4_K
    /// slice's batch-8 step 3.9 -> 5.0 ms).
    fn geometry(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        name: &str,
        rows: usize,
        (experts, one_token): (u32, bool),
    ) -> Result<(u32, u32, u32)> {
        Ok(match self {
            MatVec::WarpPerRow(_) => (
                rows.div_ceil(MATVEC_WARPS) as u32,
                (MATVEC_WARPS * 32) as u32,
                0,
            ),
            MatVec::Q4kMma { warps, staged } => {
                let (threads, shared) = ((warps * 32) as u32, *staged as u32);
                let tiles = rows.div_ceil(Q4K_MMA_ROW_TILE);
                let blocks = if one_token {
                    let resident =
                        resident_blocks(dev, "moe", glm5_kernels::MOE, name, threads, shared)?;
                    tile_loop_blocks(tiles, (resident / experts.max(1) as usize).max(1))
                } else {
                    tiles
                };
                (blocks as u32, threads, shared)
            }
        })
    }
}

/// [`grouped_experts`] with the gate/up and down kernels chosen apart.
fn grouped_experts_with(
    x: &Tensor,
    routes: &Routes,
    (n_experts, hidden, inter): (usize, usize, usize),
    (gate_up_kernel, down_kernel): (MatVec, MatVec),
    gate_up_args: &[Arg],
    down_args: &[Arg],
) -> Result<Tensor> {
    let tokens = x.dim(0)?;
    let slots = routes.slots()?;
    let n_assign = tokens * slots;
    let device = x.device();
    let suffix = if x.dtype() == DType::BF16 {
        "bf16"
    } else {
        "f32"
    };
    let x = x.contiguous()?;
    let ids = routes.ids.contiguous()?;
    let gates = routes.gates.contiguous()?;
    let out = unsafe { Tensor::empty((tokens, hidden), x.dtype(), device)? };
    if n_assign == 0 {
        return Ok(out);
    }
    let grouping = group_by_expert(&ids, n_experts)?;
    let h = unsafe { Tensor::empty((n_assign, inter), x.dtype(), device)? };
    let y = unsafe { Tensor::empty((n_assign, hidden), DType::F32, device)? };

    let (x_ptr, dev) = device_address(&x)?;
    let grouping_args = [
        Arg::Ptr(device_address(&grouping.sorted)?.0),
        Arg::Ptr(device_address(&grouping.offsets()?)?.0),
        Arg::Ptr(device_address(&grouping.active()?)?.0),
        Arg::Ptr(device_address(&grouping.active_count()?)?.0),
    ];
    let (gates_ptr, _) = device_address(&gates)?;
    let (h_ptr, _) = device_address(&h)?;
    let (y_ptr, _) = device_address(&y)?;
    let stream = dev.cuda_stream();
    let slots_arg = slots as i32;
    let (hidden_arg, inter_arg) = (hidden as i32, inter as i32);
    // At most min(E, assignments) experts are active: one block row each, idle ones return at once.
    let expert_blocks = n_experts.min(n_assign) as u32;
    // One token (batch-1 decode): every expert has at most one assignment, so the kernels built for one
    // (`t1_`) skip the other token slots' tests.
    let one = tokens == 1;
    let gate_up_name = gate_up_kernel.name("gate_up", one, suffix);
    let gate_up_fn = kernel(&dev, "moe", glm5_kernels::MOE, &gate_up_name)?;
    let mut builder = stream.launch_builder(&gate_up_fn);
    builder.arg(&x_ptr);
    push_args(&mut builder, gate_up_args);
    push_args(&mut builder, &grouping_args);
    builder
        .arg(&slots_arg)
        .arg(&hidden_arg)
        .arg(&inter_arg)
        .arg(&h_ptr);
    let (row_blocks, threads, shared) =
        gate_up_kernel.geometry(&dev, &gate_up_name, inter, (expert_blocks, one))?;
    let grid = (expert_blocks, row_blocks, 1);
    // SAFETY: the arguments match the kernel's signature (moe.cu); x [T, H], h [T·slots, I], the weights
    // and the grouping are live device allocations of the sizes the kernel reads (checked by the callers).
    unsafe { builder.launch(launch_config(grid, threads, shared)) }.map_err(cuda_err)?;

    let down_name = down_kernel.name("down", one, suffix);
    let down_fn = kernel(&dev, "moe", glm5_kernels::MOE, &down_name)?;
    let mut builder = stream.launch_builder(&down_fn);
    builder.arg(&h_ptr);
    push_args(&mut builder, down_args);
    builder.arg(&gates_ptr);
    push_args(&mut builder, &grouping_args);
    builder.arg(&hidden_arg).arg(&inter_arg).arg(&y_ptr);
    let (row_blocks, threads, shared) =
        down_kernel.geometry(&dev, &down_name, hidden, (expert_blocks, one))?;
    let grid = (expert_blocks, row_blocks, 1);
    // SAFETY: as above; y is [T·slots, H] f32.
    unsafe { builder.launch(launch_config(grid, threads, shared)) }.map_err(cuda_err)?;

    combine(&y, tokens, slots, &out)?;
    Ok(out)
}

/// `out[t] = round(Σ_slot y[t·slots + slot])` (`moe_combine_*`): `y` `[T·slots, H]` f32 in assignment order,
/// `out` `[T, H]` in the model dtype (bf16 or f32), both contiguous.
pub(super) fn combine(y: &Tensor, tokens: usize, slots: usize, out: &Tensor) -> Result<()> {
    let hidden = out.dim(1)?;
    let suffix = match out.dtype() {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        other => {
            return Err(crate::error::OpError::NotFloat {
                arg: "x",
                found: other,
            })
        }
    };
    let (y_ptr, dev) = device_address(y)?;
    let (out_ptr, _) = device_address(out)?;
    let combine = kernel(
        &dev,
        "moe",
        glm5_kernels::MOE,
        &format!("moe_combine_{suffix}"),
    )?;
    let stream = dev.cuda_stream();
    let (tokens_arg, slots_arg, hidden_arg) = (tokens as i32, slots as i32, hidden as i32);
    let mut builder = stream.launch_builder(&combine);
    builder
        .arg(&y_ptr)
        .arg(&tokens_arg)
        .arg(&slots_arg)
        .arg(&hidden_arg)
        .arg(&out_ptr);
    let elements = tokens * hidden;
    // SAFETY: y [T·slots, H] f32 in, out [T, H] in its dtype, as the kernel reads and writes them.
    unsafe { builder.launch(launch_config((elements.div_ceil(256) as u32, 1, 1), 256, 0)) }
        .map_err(cuda_err)?;
    Ok(())
}

pub(super) fn experts(
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let (_, hidden) = x.dims2()?;
    let (n_experts, two_inter, _) = gate_up.dims3()?;
    let (gate_up, down) = (gate_up.contiguous()?, down.contiguous()?);
    grouped_experts(
        x,
        routes,
        (n_experts, hidden, two_inter / 2),
        "",
        &[Arg::Ptr(device_address(&gate_up)?.0)],
        &[Arg::Ptr(device_address(&down)?.0)],
    )
}

/// The stacked quantised experts (`super::quantized`), checked by the caller: `dims` = (E', H, I).
pub(super) fn quantized_experts(
    x: &Tensor,
    routes: &Routes,
    weights: &QuantizedExperts,
    dims: (usize, usize, usize),
) -> Result<Tensor> {
    match weights {
        QuantizedExperts::Fp8 { gate_up, down } => {
            let args = |w: &StackedFp8| -> Result<Vec<Arg>> {
                Ok(vec![
                    Arg::Ptr(device_address(&w.weight)?.0),
                    Arg::Ptr(device_address(&w.scale_inv)?.0),
                    Arg::Int(w.block[0] as i32),
                    Arg::Int(w.block[1] as i32),
                ])
            };
            grouped_experts(x, routes, dims, "fp8_", &args(gate_up)?, &args(down)?)
        }
        QuantizedExperts::Nvfp4 { gate_up, down } => {
            let args = |w: &StackedNvfp4| -> Result<Vec<Arg>> {
                Ok(vec![
                    Arg::Ptr(device_address(&w.packed)?.0),
                    Arg::Ptr(device_address(&w.scales)?.0),
                    Arg::Ptr(device_address(&w.global_scales)?.0),
                ])
            };
            grouped_experts(x, routes, dims, "nvfp4_", &args(gate_up)?, &args(down)?)
        }
        QuantizedExperts::GgufBlocks { gate, up, down } => {
            // One kernel name per format pair: gate/up's format for moe_gate_up_*, down's for moe_down_*;
            // Q4_K with bf16 activations on the tensor cores (`*_q4_k_mma_bf16`: an expert of one token on the
            // int8 ones, its row quantised as q8_1, as gguf_matmul's one-row kernel).
            let (gate_blocks, up_blocks, down_blocks) = (
                gate.blocks.contiguous()?,
                up.blocks.contiguous()?,
                down.blocks.contiguous()?,
            );
            for (format, blocks) in [
                (gate.format, &gate_blocks),
                (up.format, &up_blocks),
                (down.format, &down_blocks),
            ] {
                crate::gguf_matmul::cuda::check_alignment(format, blocks)?;
            }
            // (An input row too long to stage in the default shared memory, longer than any GLM-5 expert's,
            // takes the FFMA kernels.)
            let kernel_of = |format: GgufFormat, k: usize| {
                let staged = q4k_row_staged_bytes(k);
                if format == GgufFormat::Q4K
                    && x.dtype() == DType::BF16
                    && staged <= DEFAULT_DYNAMIC_SHARED_BYTES
                {
                    MatVec::Q4kMma {
                        warps: q4k_mma_warps(k),
                        staged,
                    }
                } else {
                    MatVec::WarpPerRow(format!("{}_", format.name().to_ascii_lowercase()))
                }
            };
            let (_, hidden, inter) = dims;
            grouped_experts_with(
                x,
                routes,
                dims,
                (
                    kernel_of(gate.format, hidden),
                    kernel_of(down.format, inter),
                ),
                &[
                    Arg::Ptr(device_address(&gate_blocks)?.0),
                    Arg::Ptr(device_address(&up_blocks)?.0),
                ],
                &[Arg::Ptr(device_address(&down_blocks)?.0)],
            )
        }
    }
}
