// The rows a layer's attention writes into its caches each step, computed and written by one kernel where
// candle's tensor ops take several (contracts: glm5-ops latent_rows/mod.rs).
//
//   latent_rows_*  one block per token: the MLA latent row [rms_norm(kv_a[..lora]) | rope_i(kv_a[lora..])]
//                  into row rows[t] (or first_row + t) of the cache. RMSNorm as rms_norm.cu (row_norm.cuh);
//                  RoPE interleaved as candle's rope_i: (x0·c − x1·s, x0·s + x1·c), each product rounded to
//                  the dtype and the sum rounded by the store.
//   index_key_rows_*  one warp per token: the DSA indexer's key [rope_i(LN(k)[..R]) | LN(k)[R..]], LN being
//                  candle-nn's layer_norm with bias (mean and variance in f32 from Σx and Σx², rsqrt, one
//                  rounding to the dtype), written as floats or as FP8 e4m3 with one scale per key
//                  (index_keys' contract: scale = amax / 448, 1 for a zero key; bytes e4m3(x / scale),
//                  round to nearest even, saturating). Keys of at most 32 · 2 · MAX_PAIRS values.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "row_norm.cuh"

namespace {

using namespace glm5::rows;

template <typename T>
__device__ void latent_rows(const T* __restrict__ kv_a, const T* __restrict__ norm_weight, float eps,
                            const T* __restrict__ cos, const T* __restrict__ sin, T* __restrict__ cache,
                            const uint32_t* __restrict__ rows, int first_row, int lora, int rope) {
    const int t = blockIdx.x;
    const int width = lora + rope, half = rope / 2;
    const T* in = kv_a + (size_t)t * width;
    T* out = cache + (rows ? (size_t)rows[t] : (size_t)first_row + t) * width;
    const float inv_rms = block_inv_rms(in, lora, eps);
    for (int c = threadIdx.x; c < lora; c += blockDim.x)
        store(out + c, round_to(to_float(in[c]) * inv_rms, kv_a) * to_float(norm_weight[c]));
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float x0 = to_float(in[lora + 2 * i]), x1 = to_float(in[lora + 2 * i + 1]);
        const float c = to_float(cos[(size_t)t * half + i]), s = to_float(sin[(size_t)t * half + i]);
        store(out + lora + 2 * i, round_to(x0 * c, kv_a) - round_to(x1 * s, kv_a));
        store(out + lora + 2 * i + 1, round_to(x0 * s, kv_a) + round_to(x1 * c, kv_a));
    }
}

constexpr int MAX_PAIRS = 4;  // per lane: keys of up to 256 values (GLM-5's: 128)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

template <typename T>
__device__ void index_key_rows(const T* __restrict__ k, const T* __restrict__ ln_weight, const T* __restrict__ ln_bias,
                               float eps, const T* __restrict__ cos, const T* __restrict__ sin, int tokens, int dim,
                               int rope, T* __restrict__ float_cache, uint8_t* __restrict__ fp8_bytes,
                               float* __restrict__ fp8_scales, const uint32_t* __restrict__ rows, int first_row) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (t >= tokens) return;
    const T* x = k + (size_t)t * dim;
    float sum = 0.0f, sum2 = 0.0f;
    for (int d = lane; d < dim; d += 32) {
        const float v = to_float(x[d]);
        sum += v;
        sum2 += v * v;
    }
    sum = warp_sum(sum);
    sum2 = warp_sum(sum2);
    const float mean = sum / dim;
    const float var = sum2 / dim - mean * mean;
    const float inv_std = rsqrtf(var + eps);
    // Lane l holds pairs (2p, 2p + 1) for p = l, l + 32, ...: RoPE rotates within a pair.
    const int half = rope / 2, pairs = dim / 2;
    float v[2 * MAX_PAIRS];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < MAX_PAIRS; ++j) {
        const int p = lane + 32 * j;
        if (p < pairs) {
            float a[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = 2 * p + e;
                const float lhs = (to_float(x[d]) - mean) * inv_std;
                a[e] = round_to(lhs * to_float(ln_weight[d]) + to_float(ln_bias[d]), k);
            }
            if (p < half) {
                const float c = to_float(cos[(size_t)t * half + p]), s = to_float(sin[(size_t)t * half + p]);
                v[2 * j] = round_to(round_to(a[0] * c, k) - round_to(a[1] * s, k), k);
                v[2 * j + 1] = round_to(round_to(a[0] * s, k) + round_to(a[1] * c, k), k);
            } else {
                v[2 * j] = a[0];
                v[2 * j + 1] = a[1];
            }
            amax = fmaxf(amax, fmaxf(fabsf(v[2 * j]), fabsf(v[2 * j + 1])));
        }
    }
    const size_t row = rows ? (size_t)rows[t] : (size_t)first_row + t;
    if (float_cache) {
        T* out = float_cache + row * dim;
#pragma unroll
        for (int j = 0; j < MAX_PAIRS; ++j) {
            const int p = lane + 32 * j;
            if (p < pairs) {
                store(out + 2 * p, v[2 * j]);
                store(out + 2 * p + 1, v[2 * j + 1]);
            }
        }
        return;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    uint8_t* out = fp8_bytes + row * dim;
#pragma unroll
    for (int j = 0; j < MAX_PAIRS; ++j) {
        const int p = lane + 32 * j;
        if (p < pairs) {
            out[2 * p] = __nv_cvt_float_to_fp8(v[2 * j] / scale, __NV_SATFINITE, __NV_E4M3);
            out[2 * p + 1] = __nv_cvt_float_to_fp8(v[2 * j + 1] / scale, __NV_SATFINITE, __NV_E4M3);
        }
    }
    if (lane == 0) fp8_scales[row] = scale;
}

}  // namespace

#define CACHE_ROWS_KERNELS(SUFFIX, T)                                                                          \
    extern "C" __global__ void latent_rows_##SUFFIX(const T* kv_a, const T* norm_weight, float eps,         \
                                                    const T* cos, const T* sin, T* cache,                   \
                                                    const uint32_t* rows, int first_row, int lora,          \
                                                    int rope) {                                              \
        latent_rows(kv_a, norm_weight, eps, cos, sin, cache, rows, first_row, lora, rope);                  \
    }                                                                                                          \
    extern "C" __global__ void index_key_rows_##SUFFIX(                                                       \
        const T* k, const T* ln_weight, const T* ln_bias, float eps, const T* cos, const T* sin, int tokens,  \
        int dim, int rope, T* float_cache, uint8_t* fp8_bytes, float* fp8_scales, const uint32_t* rows,       \
        int first_row) {                                                                                       \
        index_key_rows(k, ln_weight, ln_bias, eps, cos, sin, tokens, dim, rope, float_cache, fp8_bytes,        \
                       fp8_scales, rows, first_row);                                                           \
    }

CACHE_ROWS_KERNELS(bf16, __nv_bfloat16)
CACHE_ROWS_KERNELS(f32, float)
