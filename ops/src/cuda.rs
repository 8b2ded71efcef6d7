//! glm5's CUDA modules: the fatbins of `glm5-kernels`, loaded once per device, with their functions and the
//! device attributes the launchers need cached (a launch should cost microseconds of host time).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{DType, Storage, Tensor};

use crate::device::ComputeCapability;

/// `stem_f32` or `stem_bf16`, the kernel of `stem` for activations of `dtype` (the kernels' naming).
pub(crate) fn kernel_name(stem: &str, dtype: DType) -> crate::error::Result<String> {
    match dtype {
        DType::F32 => Ok(format!("{stem}_f32")),
        DType::BF16 => Ok(format!("{stem}_bf16")),
        other => Err(crate::error::OpError::NotFloat {
            arg: "x",
            found: other,
        }),
    }
}

/// Whether rows of `width` values of `dtype`, the first starting at device `address`, can be read and written
/// in 16-byte vectors: every row a whole number of them and the first 16-byte aligned (the row kernels'
/// `vectors` argument).
pub(crate) fn rows_take_16_byte_vectors(width: usize, dtype: DType, address: u64) -> bool {
    width.is_multiple_of(16 / dtype.size_in_bytes()) && address.is_multiple_of(16)
}

pub(crate) fn cuda_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Cuda(e.to_string().into())
}

/// Device address of a contiguous CUDA tensor's first element (its layout offset applied), and its device.
pub(crate) fn device_address(tensor: &Tensor) -> candle_core::Result<(u64, CudaDevice)> {
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        candle_core::bail!("expected a CUDA tensor")
    };
    let (start, _) = layout
        .contiguous_offsets()
        .ok_or_else(|| cuda_err("tensor must be contiguous"))?;
    let dev = cuda.device().clone();
    let stream = dev.cuda_stream();
    let base = match cuda.dtype() {
        DType::U8 => cuda.as_cuda_slice::<u8>()?.device_ptr(&stream).0,
        DType::I32 => cuda.as_cuda_slice::<i32>()?.device_ptr(&stream).0,
        DType::U32 => cuda.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        DType::I64 => cuda.as_cuda_slice::<i64>()?.device_ptr(&stream).0,
        DType::F16 => cuda.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        DType::F32 => cuda.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::BF16 => cuda.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        other => candle_core::bail!("unexpected dtype {other:?}"),
    };
    Ok((base + (start * tensor.dtype().size_in_bytes()) as u64, dev))
}

/// Keeps a kernel's outgrown workspace alive for the rest of the thread instead of freeing it: a captured
/// step graph (`step_graph`) may still address it. Workspaces grow by powers of two, so what is kept stays
/// below the largest one.
pub(crate) fn retire<T: 'static>(buffer: T) {
    thread_local! {
        static RETIRED: std::cell::RefCell<Vec<Box<dyn std::any::Any>>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    RETIRED.with(|cell| cell.borrow_mut().push(Box::new(buffer)));
}

/// What the launchers need to know about a device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceInfo {
    pub sms: usize,
    pub max_shared_per_block: usize,
    pub capability: ComputeCapability,
}

/// Functions and their resident-block counts are keyed by device and module, then by name, so a lookup on
/// the launch path borrows the name instead of allocating a key.
#[derive(Default)]
struct Loaded {
    modules: HashMap<(DeviceId, &'static str), Arc<CudaModule>>,
    functions: HashMap<(DeviceId, &'static str), HashMap<String, CudaFunction>>,
    /// `resident_blocks`' answers, by function name, then (threads, dynamic shared memory).
    resident: HashMap<(DeviceId, &'static str), HashMap<String, BlocksByShape>>,
    /// `resident_clusters`' answers, by function name, then (threads, dynamic shared memory).
    clusters: HashMap<(DeviceId, &'static str), HashMap<String, ClustersBySize>>,
    devices: HashMap<DeviceId, DeviceInfo>,
}

/// Blocks at once, by (threads, dynamic shared memory) of a launch.
type BlocksByShape = HashMap<(u32, u32), usize>;

/// Clusters at once per cluster size, by (threads, dynamic shared memory) of a launch.
type ClustersBySize = HashMap<(u32, u32), Vec<usize>>;

fn loaded() -> &'static Mutex<Loaded> {
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// `f` on the cache, under its lock (released when `f` returns).
fn with_loaded<T>(f: impl FnOnce(&mut Loaded) -> T) -> candle_core::Result<T> {
    Ok(f(&mut *loaded().lock().map_err(cuda_err)?))
}

/// SM count, the opt-in shared memory limit and the compute capability of `dev`.
pub(crate) fn device_info(dev: &CudaDevice) -> candle_core::Result<DeviceInfo> {
    let mut loaded = loaded().lock().map_err(cuda_err)?;
    if let Some(info) = loaded.devices.get(&dev.id()) {
        return Ok(*info);
    }
    let context = dev.cuda_stream().context().clone();
    let attribute = |a| context.attribute(a).map(|v| v as usize).map_err(cuda_err);
    let info = DeviceInfo {
        sms: attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        max_shared_per_block: attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        capability: ComputeCapability {
            major: attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?
                as u32,
            minor: attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?
                as u32,
        },
    };
    loaded.devices.insert(dev.id(), info);
    Ok(info)
}

/// Modules whose kernels prefer the largest shared-memory carveout (the rest keep the driver's choice). The
/// indexer is a chain of programmatic dependents (Q prep, scores, candidates, threshold, emit) with different
/// shared-memory needs; with one carveout for all of them a decode step is faster on the H200, likely
/// because an SM no longer changes its L1/shared split between them before a dependent's blocks can be
/// placed. sparse_mla gains nothing from it.
const MAX_SHARED_CARVEOUT: &[&str] = &["dsa_indexer"];

/// Function `name` of module `module` (fatbin `image`) on `dev`. On first use the module is loaded and the
/// function allowed the device's opt-in shared memory less its own static shared memory (and, for the
/// modules of `MAX_SHARED_CARVEOUT`, the largest carveout).
pub(crate) fn kernel(
    dev: &CudaDevice,
    module: &'static str,
    image: &'static [u8],
    name: &str,
) -> candle_core::Result<CudaFunction> {
    if let Some(function) =
        with_loaded(|l| l.functions.get(&(dev.id(), module))?.get(name).cloned())?
    {
        return Ok(function);
    }
    let info = device_info(dev)?;
    let mut loaded = loaded().lock().map_err(cuda_err)?;
    let cuda_module = match loaded.modules.get(&(dev.id(), module)) {
        Some(m) => m.clone(),
        None => {
            let m = dev
                .cuda_stream()
                .context()
                .load_module(Ptx::from_binary(image.to_vec()))
                .map_err(cuda_err)?;
            loaded.modules.insert((dev.id(), module), m.clone());
            m
        }
    };
    let function = cuda_module
        .load_function(name)
        .map_err(|e| cuda_err(format!("kernel {name} of {module}: {e}")))?;
    let static_shared = function
        .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        .map_err(cuda_err)? as usize;
    function
        .set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            info.max_shared_per_block.saturating_sub(static_shared) as i32,
        )
        .map_err(cuda_err)?;
    if MAX_SHARED_CARVEOUT.contains(&module) {
        function
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .map_err(cuda_err)?;
    }
    loaded
        .functions
        .entry((dev.id(), module))
        .or_default()
        .insert(name.to_string(), function.clone());
    Ok(function)
}

/// How many blocks of `threads` threads and `shared_bytes` of dynamic shared memory of function `name` the
/// whole device holds at once (0 where one does not fit), from the driver's occupancy calculator; cached like
/// the functions, by launch shape.
pub(crate) fn resident_blocks(
    dev: &CudaDevice,
    module: &'static str,
    image: &'static [u8],
    name: &str,
    threads: u32,
    shared_bytes: u32,
) -> candle_core::Result<usize> {
    let key = (threads, shared_bytes);
    if let Some(blocks) = with_loaded(|l| {
        l.resident
            .get(&(dev.id(), module))?
            .get(name)?
            .get(&key)
            .copied()
    })? {
        return Ok(blocks);
    }
    let per_sm = kernel(dev, module, image, name)?
        .occupancy_max_active_blocks_per_multiprocessor(threads, shared_bytes as usize, None)
        .map_err(cuda_err)? as usize;
    let blocks = device_info(dev)?.sms * per_sm;
    with_loaded(|l| {
        let by_name = l.resident.entry((dev.id(), module)).or_default();
        by_name
            .entry(name.to_string())
            .or_default()
            .insert(key, blocks)
    })?;
    Ok(blocks)
}

/// The largest thread-block cluster every cluster-capable device supports (the portable size); the
/// launchers ask for no more, so no function needs the non-portable opt-in.
pub(crate) const PORTABLE_CLUSTER_BLOCKS: usize = 8;

/// For each cluster size c in 0..=PORTABLE_CLUSTER_BLOCKS, how many clusters of c blocks of function `name`
/// (`threads` threads, `smem` bytes of dynamic shared memory) the device runs at once, from the driver's
/// occupancy calculator: 0 where it cannot form them (and for c < 2). A function whose cluster shape is
/// fixed at compile time gives that size as `fixed` (the driver rejects the others as an error, which
/// compute-sanitizer reports). Cached like the functions.
pub(crate) fn resident_clusters(
    dev: &CudaDevice,
    (module, image): (&'static str, &'static [u8]),
    name: &str,
    threads: u32,
    smem: u32,
    fixed: Option<usize>,
) -> candle_core::Result<Vec<usize>> {
    let key = (threads, smem);
    if let Some(counts) = with_loaded(|l| {
        l.clusters
            .get(&(dev.id(), module))?
            .get(name)?
            .get(&key)
            .cloned()
    })? {
        return Ok(counts);
    }
    let func = kernel(dev, module, image, name)?;
    let stream = dev.cuda_stream();
    let mut counts = vec![0; PORTABLE_CLUSTER_BLOCKS + 1];
    stream.context().bind_to_thread().map_err(cuda_err)?;
    for (size, count) in counts.iter_mut().enumerate().skip(2) {
        if fixed.is_some_and(|fixed| fixed != size) {
            continue;
        }
        let mut attribute = cluster_attribute(size as u32);
        let cfg = LaunchConfig {
            grid_dim: (size as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let config = driver_config(&cfg, &stream, &mut attribute);
        let mut clusters: std::ffi::c_int = 0;
        // SAFETY: `config` and its one attribute live across the call; `func` is a loaded function.
        let status = unsafe {
            sys::cuOccupancyMaxActiveClusters(&mut clusters, func.cu_function(), &config)
        };
        // An error (no cluster support) means this size cannot be used.
        *count = if status.result().is_ok() {
            clusters.max(0) as usize
        } else {
            0
        };
    }
    with_loaded(|l| {
        let by_name = l.clusters.entry((dev.id(), module)).or_default();
        by_name
            .entry(name.to_string())
            .or_default()
            .insert(key, counts.clone())
    })?;
    Ok(counts)
}

/// The driver's form of `cfg` on `stream` with one launch attribute (which must outlive the result's use).
fn driver_config(
    cfg: &LaunchConfig,
    stream: &CudaStream,
    attribute: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: attribute,
        numAttrs: 1,
    }
}

/// The launch attribute that groups blocks along x into clusters of `blocks`.
fn cluster_attribute(blocks: u32) -> sys::CUlaunchAttribute {
    // SAFETY: an all-zero launch attribute is valid; the id and its value are set right after.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attribute.value.clusterDim.x = blocks;
    attribute.value.clusterDim.y = 1;
    attribute.value.clusterDim.z = 1;
    attribute
}

/// Launches `func` as a programmatic dependent of the previous launch on `stream`: its blocks may be
/// scheduled while that kernel's last blocks finish, hiding the launch gap; the kernel waits for the
/// previous grid's writes itself (`griddepcontrol.wait`).
///
/// # Safety
/// `func` takes exactly one parameter, a struct that `P` mirrors, and every pointer in `params` stays
/// valid until the stream has run the launch.
pub(crate) unsafe fn launch_dependent<P: DeviceRepr>(
    func: &CudaFunction,
    stream: &CudaStream,
    cfg: LaunchConfig,
    params: &P,
) -> candle_core::Result<()> {
    // SAFETY: an all-zero launch attribute is valid; the id and its value are set right after.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    // SAFETY: the caller's contract above.
    unsafe { launch_with(func, stream, cfg, attribute, params) }
}

/// Launches `func` with its blocks grouped along x into thread-block clusters of `blocks` (the grid's x
/// dimension a multiple of it; a size `resident_clusters` found schedulable).
///
/// # Safety
/// As `launch_dependent`.
pub(crate) unsafe fn launch_cluster<P: DeviceRepr>(
    func: &CudaFunction,
    stream: &CudaStream,
    cfg: LaunchConfig,
    blocks: u32,
    params: &P,
) -> candle_core::Result<()> {
    // SAFETY: the caller's contract above.
    unsafe { launch_with(func, stream, cfg, cluster_attribute(blocks), params) }
}

/// `cuLaunchKernelEx` of `func` with one launch attribute and one parameter struct.
///
/// # Safety
/// As `launch_dependent`.
unsafe fn launch_with<P: DeviceRepr>(
    func: &CudaFunction,
    stream: &CudaStream,
    cfg: LaunchConfig,
    mut attribute: sys::CUlaunchAttribute,
    params: &P,
) -> candle_core::Result<()> {
    let config = driver_config(&cfg, stream, &mut attribute);
    let mut args = [params as *const P as *mut std::ffi::c_void];
    stream.context().bind_to_thread().map_err(cuda_err)?;
    // SAFETY: the caller's contract above.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(cuda_err)
}
