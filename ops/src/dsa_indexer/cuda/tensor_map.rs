//! TMA descriptors of the FP8 key cache: the score kernels copy whole key tiles with one tensor copy each.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::cuda_backend::cudarc::driver::sys;
use glm5_kernels::interface::TensorMap;

use super::TILE_KEYS;

/// Tensor maps already encoded on this thread, by (address, rows, width): a map is a pure function of
/// the three (unified addressing makes addresses unique across devices), and a decode step asks for
/// the same cache of every layer again. Cleared when it grows past `MAX_CACHED_MAPS`.
const MAX_CACHED_MAPS: usize = 1024;
thread_local! {
    static KEY_MAPS: RefCell<HashMap<(u64, usize, usize), TensorMap>> = RefCell::new(HashMap::new());
}

/// The FP8 key cache `[rows, dim]` as a TMA tensor (cached, see `KEY_MAPS`).
pub(super) fn fp8_key_map(keys: u64, rows: usize, dim: usize) -> candle_core::Result<TensorMap> {
    let key = (keys, rows, dim);
    if let Some(map) = KEY_MAPS.with(|cell| cell.borrow().get(&key).copied()) {
        return Ok(map);
    }
    let map = encode_fp8_key_map(keys, rows, dim)?;
    KEY_MAPS.with(|cell| {
        let mut maps = cell.borrow_mut();
        if maps.len() >= MAX_CACHED_MAPS {
            maps.clear();
        }
        maps.insert(key, map);
    });
    Ok(map)
}

/// The FP8 key cache `[rows, dim]` as a TMA tensor: boxes of `TILE_KEYS` rows, 128-byte swizzle (the
/// layout `dsa_scores_fp8_tma_*` reads its fragments in).
fn encode_fp8_key_map(keys: u64, rows: usize, dim: usize) -> candle_core::Result<TensorMap> {
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let dims = [dim as u64, rows as u64];
    let strides = [dim as u64]; // bytes between rows (dimension 0 is implicitly contiguous)
    let boxes = [dim as u32, TILE_KEYS as u32];
    let element_strides = [1u32, 1];
    // SAFETY: every pointer argument points at a live local array of the rank the call is given.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            2,
            keys as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        candle_core::bail!(
            "dsa_indexer: cuTensorMapEncodeTiled failed for the FP8 key cache: {result:?}"
        );
    }
    Ok(TensorMap(map.opaque))
}
