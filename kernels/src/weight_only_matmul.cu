// Weight-only quantised matmuls: y[m, n] = sum_k x[m, k] * W[n, k], W kept quantised in global memory and
// dequantised in registers, f32 accumulation (contracts: glm5-ops fp8_matmul/mod.rs, nvfp4_matmul/mod.rs).
//
//   fp8_matvec_*    block-scaled FP8: w U8 [N, K] e4m3 bytes, scale_inv F32 [ceil(N/bn), ceil(K/bk)].
//   nvfp4_matvec_*  NVFP4: packed U8 [N, K/2] (even column in the low nibble), scales U8 [N, K/16] e4m3,
//                   one f32 global scale.
//   *_dequantize_*  the whole W in the activations' dtype, for the many-row (prefill) path's matmul.
//
// `*_matvec_r1_*` are the same kernels for one activation row (batch-1 decode): the general ones test each of
// their MAX_ROWS row slots per 16 weights, which for m = 1 costs more than the row's own arithmetic.
//
// Mat-vec: a group of warps per output column n (`column_warps` of them, more for longer rows: ColumnSplit in
// weight_formats.cuh), all m <= MAX_ROWS activation rows at once, so every weight byte is read once per
// launch. A thread takes 16 consecutive weights per chunk (one 16-byte FP8 load or one 8-byte NVFP4 group
// with its scale), which lie in one scale block (the launcher checks K % 16 == 0 and, for FP8,
// bk % 16 == 0); the group's consecutive threads read consecutive chunks, coalesced, and each loads several
// chunks before multiplying any. The group's sums meet in shared memory. x is read in 16-byte vectors through the cache (it is small and every
// warp reads all of it). The decoders are in weight_formats.cuh; NVFP4's looks each byte's two codes up in a
// 256-entry table of half2 patterns that every block fills in shared memory first (one load instead of the bit
// operations that took most of the loop's instructions).

#include <cuda_bf16.h>
#include <stdint.h>

#include "glm5_interface.h"
#include "weight_formats.cuh"

using namespace glm5;

constexpr int MAX_ROWS = GLM5_WEIGHT_ONLY_MAX_ROWS;
constexpr int WARPS = GLM5_WEIGHT_ONLY_WARPS;
constexpr int DEQUANTIZE_THREADS = GLM5_WEIGHT_ONLY_DEQUANTIZE_THREADS;
// 16-weight chunks a lane loads before it multiplies any: 64 bytes of weights in flight per lane, which is
// what keeps HBM busy (one load at a time per lane reaches ~20% of the copy bandwidth).
constexpr int FP8_UNROLL = 4;
constexpr int NVFP4_UNROLL = 8;

template <int ROWS, typename T>
__device__ __forceinline__ void fp8_matvec(const T* __restrict__ x, const uint8_t* __restrict__ w,
                                           const float* __restrict__ scale_inv, T* __restrict__ y, int m, int n,
                                           int k, int block_n, int block_k, int column_warps) {
    const ColumnSplit at = column_split<WARPS>(column_warps);
    // A group past the last column reads nothing but still meets the barrier in store_split_rows.
    const int chunks = at.col < n ? k / 16 : 0;
    const int col = at.col < n ? at.col : 0;
    const int scale_cols = (k + block_k - 1) / block_k;
    const float* scales = scale_inv + static_cast<size_t>(col / block_n) * scale_cols;
    const uint4* row = reinterpret_cast<const uint4*>(w + static_cast<size_t>(col) * k);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    for (int c0 = at.first; c0 < chunks; c0 += at.stride * FP8_UNROLL) {
        uint4 raw[FP8_UNROLL];
        float scale[FP8_UNROLL];
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            const int c = c0 + at.stride * u;
            if (c < chunks) {
                raw[u] = __ldg(row + c);
                scale[u] = __ldg(scales + c * 16 / block_k);
            }
        }
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            const int c = c0 + at.stride * u;
            if (c < chunks) {
                float wv[16];
                fp8x16_to_float(raw[u], wv);
                accumulate<ROWS>(acc, wv, scale[u], x, m, k, c * 16);
            }
        }
    }
    store_split_rows<WARPS>(acc, at, column_warps, y, m, n);
}

template <int ROWS, typename T>
__device__ __forceinline__ void nvfp4_matvec(const T* __restrict__ x, const uint8_t* __restrict__ packed,
                                             const uint8_t* __restrict__ scales, float global_scale,
                                             T* __restrict__ y, int m, int n, int k, int column_warps) {
    __shared__ uint32_t e2m1_pairs[256];
    fill_e2m1_pair_table(e2m1_pairs);
    __syncthreads();
    const ColumnSplit at = column_split<WARPS>(column_warps);
    const int chunks = at.col < n ? k / 16 : 0;
    const int col = at.col < n ? at.col : 0;
    const uint2* row = reinterpret_cast<const uint2*>(packed + static_cast<size_t>(col) * (k / 2));
    const uint8_t* row_scales = scales + static_cast<size_t>(col) * (k / 16);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    for (int c0 = at.first; c0 < chunks; c0 += at.stride * NVFP4_UNROLL) {
        uint2 raw[NVFP4_UNROLL];
        uint8_t scale[NVFP4_UNROLL];
#pragma unroll
        for (int u = 0; u < NVFP4_UNROLL; ++u) {
            const int c = c0 + at.stride * u;
            if (c < chunks) {
                raw[u] = __ldg(row + c);
                scale[u] = __ldg(row_scales + c);
            }
        }
#pragma unroll
        for (int u = 0; u < NVFP4_UNROLL; ++u) {
            const int c = c0 + at.stride * u;
            if (c < chunks) {
                float wv[16];
                e2m1x16_to_float(raw[u], e2m1_pairs, wv);
                // As the reference: (e2m1 · scale) · global, the first product exact in f32.
                accumulate<ROWS>(acc, wv, e4m3_to_float(scale[u]) * E2M1_HALF_BIAS, x, m, k, c * 16);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] *= global_scale;
    store_split_rows<WARPS>(acc, at, column_warps, y, m, n);
}

/// Values a dequantise work item covers where the layout allows (`vectors`: 16 consecutive weights of one scale
/// block, one 16-byte FP8 load or one 8-byte NVFP4 group, stored as 16-byte vectors); else one value an item.
constexpr int DEQUANTIZE_RUN = 16;

template <typename T>
__device__ __forceinline__ void fp8_dequantize(const uint8_t* __restrict__ w, const float* __restrict__ scale_inv,
                                               T* __restrict__ out, int n, int k, int block_n, int block_k,
                                               int vectors) {
    const int scale_cols = (k + block_k - 1) / block_k;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (vectors) {
        // k and block_k multiples of 16, w 16-byte aligned (the launcher checks): a run is in one scale block.
        const int runs = k / DEQUANTIZE_RUN;
        const size_t total = static_cast<size_t>(n) * runs;
        for (size_t i = first; i < total; i += stride) {
            const int r = static_cast<int>(i / runs), c = static_cast<int>(i % runs) * DEQUANTIZE_RUN;
            const float scale = scale_inv[(r / block_n) * scale_cols + c / block_k];
            float v[DEQUANTIZE_RUN];
            fp8x16_to_float(*reinterpret_cast<const uint4*>(w + i * DEQUANTIZE_RUN), v);
#pragma unroll
            for (int j = 0; j < DEQUANTIZE_RUN; ++j) v[j] *= scale;
            store_values(out + i * DEQUANTIZE_RUN, v);
        }
        return;
    }
    const size_t total = static_cast<size_t>(n) * k;
    for (size_t i = first; i < total; i += stride) {
        const int r = static_cast<int>(i / k), c = static_cast<int>(i % k);
        out[i] = from_float<T>(e4m3_to_float(w[i]) * scale_inv[(r / block_n) * scale_cols + c / block_k]);
    }
}

/// A run is one 16-value group: 8 packed bytes (the even column in the low nibble) and its scale, the packed
/// bytes 8-byte aligned where `vectors` (the launcher checks).
template <typename T>
__device__ __forceinline__ void nvfp4_dequantize(const uint8_t* __restrict__ packed,
                                                 const uint8_t* __restrict__ scales, float global_scale,
                                                 T* __restrict__ out, int n, int k, int vectors) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (vectors) {
        const size_t total = static_cast<size_t>(n) * (k / DEQUANTIZE_RUN);
        for (size_t i = first; i < total; i += stride) {
            // Row-major groups: group i holds packed bytes 8i .. 8i + 7 and scale i.
            const uint2 bytes = *reinterpret_cast<const uint2*>(packed + i * (DEQUANTIZE_RUN / 2));
            const float scale = e4m3_to_float(scales[i]);
            const uint32_t words[2] = {bytes.x, bytes.y};
            float v[DEQUANTIZE_RUN];
#pragma unroll
            for (int j = 0; j < DEQUANTIZE_RUN; ++j) {
                const uint32_t byte = words[j / 8] >> (8 * (j % 8 / 2)) & 0xff;
                v[j] = e2m1_to_float(j % 2 == 0 ? (byte & 0xf) : (byte >> 4)) * scale * global_scale;
            }
            store_values(out + i * DEQUANTIZE_RUN, v);
        }
        return;
    }
    const size_t total = static_cast<size_t>(n) * k;
    for (size_t i = first; i < total; i += stride) {
        const int r = static_cast<int>(i / k), c = static_cast<int>(i % k);
        const uint8_t byte = packed[static_cast<size_t>(r) * (k / 2) + c / 2];
        const uint32_t code = (c % 2 == 0) ? (byte & 0xf) : (byte >> 4);
        const float scale = e4m3_to_float(scales[static_cast<size_t>(r) * (k / 16) + c / 16]);
        out[i] = from_float<T>(e2m1_to_float(code) * scale * global_scale);
    }
}

#define WEIGHT_ONLY_KERNELS(SUFFIX, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        fp8_matvec_##SUFFIX(const T* x, const uint8_t* w, const float* scale_inv, T* y, int m, int n, int k,  \
                            int block_n, int block_k, int column_warps) {                                      \
        fp8_matvec<MAX_ROWS, T>(x, w, scale_inv, y, m, n, k, block_n, block_k, column_warps);                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        fp8_matvec_r1_##SUFFIX(const T* x, const uint8_t* w, const float* scale_inv, T* y, int m, int n,      \
                               int k, int block_n, int block_k, int column_warps) {                            \
        fp8_matvec<1, T>(x, w, scale_inv, y, m, n, k, block_n, block_k, column_warps);                         \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        nvfp4_matvec_##SUFFIX(const T* x, const uint8_t* packed, const uint8_t* scales, float global_scale,   \
                              T* y, int m, int n, int k, int column_warps) {                                   \
        nvfp4_matvec<MAX_ROWS, T>(x, packed, scales, global_scale, y, m, n, k, column_warps);                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        nvfp4_matvec_r1_##SUFFIX(const T* x, const uint8_t* packed, const uint8_t* scales,                    \
                                 float global_scale, T* y, int m, int n, int k, int column_warps) {            \
        nvfp4_matvec<1, T>(x, packed, scales, global_scale, y, m, n, k, column_warps);                         \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DEQUANTIZE_THREADS)                                           \
        fp8_dequantize_##SUFFIX(const uint8_t* w, const float* scale_inv, T* out, int n, int k, int block_n,  \
                                int block_k, int vectors) {                                                    \
        fp8_dequantize<T>(w, scale_inv, out, n, k, block_n, block_k, vectors);                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DEQUANTIZE_THREADS)                                           \
        nvfp4_dequantize_##SUFFIX(const uint8_t* packed, const uint8_t* scales, float global_scale, T* out,   \
                                  int n, int k, int vectors) {                                                 \
        nvfp4_dequantize<T>(packed, scales, global_scale, out, n, k, vectors);                                 \
    }

WEIGHT_ONLY_KERNELS(f32, float)
WEIGHT_ONLY_KERNELS(bf16, __nv_bfloat16)
