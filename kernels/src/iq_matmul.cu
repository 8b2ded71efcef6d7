// Weight-only matmuls over llama.cpp's i-quant GGUF formats: y[m, n] = sum_k x[m, k] * W[n, k], W kept as the
// GGUF file's blocks in global memory and decoded in registers, f32 accumulation (contract: glm5-ops
// iq_matmul/mod.rs; decoders: iq_formats.cuh).
//
//   iq_matvec[_r1]_<format>_<dtype> rows m <= MAX_ROWS (_r1: m = 1, batch-1 decode, without the other row
//                                   slots' tests): one warp per output column n; lane l decodes the
//                                   32-value sub-blocks l, l + 32, ... of the column's row and multiplies
//                                   each with all m activation rows, so every weight byte is read once.
//   iq_dequantize_<format>_<dtype>  the whole W in the activations' dtype (one thread per sub-block), for
//                                   the many-row (prefill) path's matmul.

#include <cuda_bf16.h>
#include <stdint.h>

#include "glm5_interface.h"
#include "iq_formats.cuh"
#include "weight_formats.cuh"

using namespace glm5;
using namespace glm5::iq;

constexpr int MAX_ROWS = GLM5_WEIGHT_ONLY_MAX_ROWS;
constexpr int WARPS = GLM5_WEIGHT_ONLY_WARPS;
constexpr int DEQUANTIZE_THREADS = GLM5_WEIGHT_ONLY_DEQUANTIZE_THREADS;

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <Format F, int ROWS, typename T>
__device__ __forceinline__ void iq_matvec(const T* __restrict__ x, const uint8_t* __restrict__ w, T* __restrict__ y,
                                          int m, int n, int k) {
    const int col = blockIdx.x * WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (col >= n) return;
    const uint8_t* row = w + static_cast<size_t>(col) * row_bytes<F>(k);
    const int subs = k / 32;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    for (int sb = lane; sb < subs; sb += 32) {
        int ib;
        const uint8_t* block = block_of<F>(row, sb, ib);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // The half's values before their scale, which multiplies each row's sum of 16 products once.
            float wv[16];
            const float scale = decode_half<F>(block, ib, half, wv);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < m) {
                    float xv[16];
                    load16(x + static_cast<size_t>(r) * k + 32 * sb + 16 * half, xv);
                    acc[r] = fmaf(dot16(wv, xv), scale, acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r < m) {
            float total = acc[r];
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_xor_sync(0xffffffff, total, offset);
            if (lane == 0) y[static_cast<size_t>(r) * n + col] = from_float<T>(total);
        }
    }
}

template <Format F, typename T>
__device__ __forceinline__ void iq_dequantize(const uint8_t* __restrict__ w, T* __restrict__ out, int n, int k) {
    const int subs = k / 32;
    const size_t total = static_cast<size_t>(n) * subs;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int r = static_cast<int>(i / subs), sb = static_cast<int>(i % subs);
        int ib;
        const uint8_t* block = block_of<F>(w + static_cast<size_t>(r) * row_bytes<F>(k), sb, ib);
        float wv[32];
        decode<F>(block, ib, wv);
        T* o = out + static_cast<size_t>(r) * k + 32 * sb;
#pragma unroll
        for (int j = 0; j < 32; ++j) o[j] = from_float<T>(wv[j]);
    }
}

#define IQ_KERNELS(NAME, F, SUFFIX, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        iq_matvec_##NAME##_##SUFFIX(const T* x, const uint8_t* w, T* y, int m, int n, int k) {               \
        iq_matvec<F, MAX_ROWS, T>(x, w, y, m, n, k);                                                          \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        iq_matvec_r1_##NAME##_##SUFFIX(const T* x, const uint8_t* w, T* y, int m, int n, int k) {            \
        iq_matvec<F, 1, T>(x, w, y, m, n, k);                                                                 \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(DEQUANTIZE_THREADS)                                          \
        iq_dequantize_##NAME##_##SUFFIX(const uint8_t* w, T* out, int n, int k) {                            \
        iq_dequantize<F, T>(w, out, n, k);                                                                    \
    }

#define IQ_FORMAT(NAME, F)                   \
    IQ_KERNELS(NAME, F, f32, float)          \
    IQ_KERNELS(NAME, F, bf16, __nv_bfloat16)

IQ_FORMAT(iq2_xxs, IQ2_XXS)
IQ_FORMAT(iq2_xs, IQ2_XS)
IQ_FORMAT(iq2_s, IQ2_S)
IQ_FORMAT(iq3_xxs, IQ3_XXS)
IQ_FORMAT(iq3_s, IQ3_S)
IQ_FORMAT(iq1_s, IQ1_S)
IQ_FORMAT(iq1_m, IQ1_M)
IQ_FORMAT(iq4_nl, IQ4_NL)
IQ_FORMAT(iq4_xs, IQ4_XS)
