// Weight-only quantised matmuls: y[m, n] = sum_k x[m, k] * W[n, k], W kept quantised in global memory and
// dequantised in registers, f32 accumulation (contracts: glm5-ops fp8_matmul/mod.rs, nvfp4_matmul/mod.rs).
//
//   fp8_matvec_*    block-scaled FP8: w U8 [N, K] e4m3 bytes, scale_inv F32 [ceil(N/bn), ceil(K/bk)].
//   nvfp4_matvec_*  NVFP4: packed U8 [N, K/2] (even column in the low nibble), scales U8 [N, K/16] e4m3,
//                   one f32 global scale.
//   *_dequantize_*  the whole W in the activations' dtype, for the many-row (prefill) path's matmul.
//
// Mat-vec: one warp per output column n, all m <= MAX_ROWS activation rows at once, so every weight byte is
// read once per launch. A lane takes 16 consecutive weights per step (one 16-byte FP8 load or one 8-byte
// NVFP4 group with its scale), which lie in one scale block (the launcher checks K % 16 == 0 and, for FP8,
// bk % 16 == 0); the 32 lanes of a warp read 512 consecutive weights, coalesced. x is read through the
// cache (it is small and every warp reads all of it).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "glm5_interface.h"

constexpr int MAX_ROWS = GLM5_WEIGHT_ONLY_MAX_ROWS;
constexpr int WARPS = GLM5_WEIGHT_ONLY_WARPS;
constexpr int DEQUANTIZE_THREADS = GLM5_WEIGHT_ONLY_DEQUANTIZE_THREADS;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

/// Two e4m3 bytes (low byte first) as floats.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
    return __half22float2(__half2(h));
}

__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    return __half2float(__half(h));
}

/// e2m1 code (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0) to float: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
    const uint32_t exponent = (code >> 1) & 3, mantissa = code & 1;
    const float magnitude =
        exponent ? __uint_as_float(((exponent + 126u) << 23) | (mantissa << 22)) : 0.5f * static_cast<float>(mantissa);
    return (code & 8) ? -magnitude : magnitude;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

/// Sum over 16 weights `w` of w[j] * x[r, k0 + j] for every row r < m, added to acc[r] times `scale`.
template <typename T>
__device__ __forceinline__ void accumulate(float (&acc)[MAX_ROWS], const float (&w)[16], float scale, const T* x,
                                           int m, int k, int k0) {
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        if (r < m) {
            const T* xr = x + static_cast<size_t>(r) * k + k0;
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; ++j) dot = fmaf(w[j], to_float(xr[j]), dot);
            acc[r] = fmaf(dot, scale, acc[r]);
        }
    }
}

template <typename T>
__device__ __forceinline__ void store_rows(float (&acc)[MAX_ROWS], T* y, int m, int n, int col) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        if (r < m) {
            const float total = warp_sum(acc[r]);
            if (lane == 0) y[static_cast<size_t>(r) * n + col] = from_float<T>(total);
        }
    }
}

template <typename T>
__device__ __forceinline__ void fp8_matvec(const T* __restrict__ x, const uint8_t* __restrict__ w,
                                           const float* __restrict__ scale_inv, T* __restrict__ y, int m, int n,
                                           int k, int block_n, int block_k) {
    const int col = blockIdx.x * WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (col >= n) return;
    const int scale_cols = (k + block_k - 1) / block_k;
    const float* scales = scale_inv + static_cast<size_t>(col / block_n) * scale_cols;
    const uint8_t* row = w + static_cast<size_t>(col) * k;
    float acc[MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) acc[r] = 0.0f;
    for (int k0 = lane * 16; k0 < k; k0 += 32 * 16) {
        const uint4 bytes = __ldg(reinterpret_cast<const uint4*>(row + k0));
        const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
        float wv[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 lo = e4m3x2_to_float2(static_cast<uint16_t>(words[i] & 0xffff));
            const float2 hi = e4m3x2_to_float2(static_cast<uint16_t>(words[i] >> 16));
            wv[4 * i] = lo.x;
            wv[4 * i + 1] = lo.y;
            wv[4 * i + 2] = hi.x;
            wv[4 * i + 3] = hi.y;
        }
        accumulate(acc, wv, __ldg(scales + k0 / block_k), x, m, k, k0);
    }
    store_rows(acc, y, m, n, col);
}

template <typename T>
__device__ __forceinline__ void nvfp4_matvec(const T* __restrict__ x, const uint8_t* __restrict__ packed,
                                             const uint8_t* __restrict__ scales, float global_scale,
                                             T* __restrict__ y, int m, int n, int k) {
    const int col = blockIdx.x * WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (col >= n) return;
    const uint8_t* row = packed + static_cast<size_t>(col) * (k / 2);
    const uint8_t* row_scales = scales + static_cast<size_t>(col) * (k / 16);
    float acc[MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) acc[r] = 0.0f;
    for (int k0 = lane * 16; k0 < k; k0 += 32 * 16) {
        const uint2 bytes = __ldg(reinterpret_cast<const uint2*>(row + k0 / 2));
        const uint32_t words[2] = {bytes.x, bytes.y};
        float wv[16];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) wv[8 * i + j] = e2m1_to_float((words[i] >> (4 * j)) & 0xf);
        }
        // As the reference: (e2m1 * scale) * global, the first product exact in f32.
        accumulate(acc, wv, e4m3_to_float(__ldg(row_scales + k0 / 16)), x, m, k, k0);
    }
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) acc[r] *= global_scale;
    store_rows(acc, y, m, n, col);
}

template <typename T>
__device__ __forceinline__ void fp8_dequantize(const uint8_t* __restrict__ w, const float* __restrict__ scale_inv,
                                               T* __restrict__ out, int n, int k, int block_n, int block_k) {
    const int scale_cols = (k + block_k - 1) / block_k;
    const size_t total = static_cast<size_t>(n) * k;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int r = static_cast<int>(i / k), c = static_cast<int>(i % k);
        out[i] = from_float<T>(e4m3_to_float(w[i]) * scale_inv[(r / block_n) * scale_cols + c / block_k]);
    }
}

template <typename T>
__device__ __forceinline__ void nvfp4_dequantize(const uint8_t* __restrict__ packed,
                                                 const uint8_t* __restrict__ scales, float global_scale,
                                                 T* __restrict__ out, int n, int k) {
    const size_t total = static_cast<size_t>(n) * k;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
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
                            int block_n, int block_k) {                                                        \
        fp8_matvec<T>(x, w, scale_inv, y, m, n, k, block_n, block_k);                                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        nvfp4_matvec_##SUFFIX(const T* x, const uint8_t* packed, const uint8_t* scales, float global_scale,   \
                              T* y, int m, int n, int k) {                                                     \
        nvfp4_matvec<T>(x, packed, scales, global_scale, y, m, n, k);                                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DEQUANTIZE_THREADS)                                           \
        fp8_dequantize_##SUFFIX(const uint8_t* w, const float* scale_inv, T* out, int n, int k, int block_n,  \
                                int block_k) {                                                                 \
        fp8_dequantize<T>(w, scale_inv, out, n, k, block_n, block_k);                                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DEQUANTIZE_THREADS)                                           \
        nvfp4_dequantize_##SUFFIX(const uint8_t* packed, const uint8_t* scales, float global_scale, T* out,   \
                                  int n, int k) {                                                              \
        nvfp4_dequantize<T>(packed, scales, global_scale, out, n, k);                                          \
    }

WEIGHT_ONLY_KERNELS(f32, float)
WEIGHT_ONLY_KERNELS(bf16, __nv_bfloat16)
