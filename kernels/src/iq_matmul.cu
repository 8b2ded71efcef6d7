// Weight-only matmuls over llama.cpp's i-quant GGUF formats: y[m, n] = sum_k x[m, k] * W[n, k], W kept as the
// GGUF file's blocks in global memory and decoded in registers, f32 accumulation (contract: glm5-ops
// iq_matmul/mod.rs; decoders: iq_formats.cuh).
//
//   iq_matvec[_r1]_<format>_<dtype> rows m <= MAX_ROWS (_r1: m = 1, batch-1 decode, without the other row
//                                   slots' tests): a group of warps per output column n (ColumnSplit in
//                                   weight_formats.cuh); its threads decode the column's 32-value sub-blocks
//                                   in turn and multiply each with all m activation rows, so every weight
//                                   byte is read once.
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

template <Format F, int ROWS, typename T>
__device__ __forceinline__ void iq_matvec(const T* __restrict__ x, const uint8_t* __restrict__ w, T* __restrict__ y,
                                          int m, int n, int k, int column_warps) {
    const ColumnSplit at = column_split<WARPS>(column_warps);
    // A group past the last column reads nothing but still meets the barrier in store_split_rows.
    const int subs = at.col < n ? k / 32 : 0;
    const uint8_t* row = w + static_cast<size_t>(at.col < n ? at.col : 0) * row_bytes<F>(k);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    for (int sb = at.first; sb < subs; sb += at.stride) {
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
    store_split_rows<WARPS>(acc, at, column_warps, y, m, n);
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
        iq_matvec_##NAME##_##SUFFIX(const T* x, const uint8_t* w, T* y, int m, int n, int k,                 \
                                    int column_warps) {                                                       \
        iq_matvec<F, MAX_ROWS, T>(x, w, y, m, n, k, column_warps);                                            \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        iq_matvec_r1_##NAME##_##SUFFIX(const T* x, const uint8_t* w, T* y, int m, int n, int k,              \
                                       int column_warps) {                                                    \
        iq_matvec<F, 1, T>(x, w, y, m, n, k, column_warps);                                                   \
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
