// The row-wise steps of a layer's attention around its projections, one kernel each where candle's tensor
// ops take several (contracts: glm5-ops latent_rows, index_key_rows, absorbed_query, rope_leading).
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
//   absorbed_query_*  one block per (token, head): the absorbed MLA query [q_latent[h, t] | rope_i(q[t, h,
//                  nope..])] from W_UK's product (head-major) and q_b_proj's output (token-major).
//   rope_leading_*  one block per (token, head): rope_i on the first R values of x[t, h], the rest copied
//                  (the indexer's query).
//   attention_rows_*  latent_rows, index_key_rows and rope_leading of the same tokens in one launch (a decode
//                  step's three launches were three kernels' start-up latencies for a few KB of work).
//   head_products_*  one token's per-head products y[h] = x[h] · W[h] (W_UK, W_UV at decode), W streamed
//                  once: a block per (64 columns, head); with `rope` > 0 one more block a head writes
//                  rope_i(pe[h]) after the n columns (the absorbed query in the launch of W_UK's product).

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "glm5_interface.h"
#include "row_norm.cuh"

namespace {

using namespace glm5::rows;

/// rope_i of the pair (x0, x1) at table entry (c, s), each product rounded to T's dtype, into out[0], out[1].
template <typename T>
__device__ __forceinline__ void rope_pair(float x0, float x1, float c, float s, T* out) {
    store(out, round_to(x0 * c, out) - round_to(x1 * s, out));
    store(out + 1, round_to(x0 * s, out) + round_to(x1 * c, out));
}

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
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_pair(to_float(in[lora + 2 * i]), to_float(in[lora + 2 * i + 1]), to_float(cos[(size_t)t * half + i]),
                  to_float(sin[(size_t)t * half + i]), out + lora + 2 * i);
}

constexpr int MAX_PAIRS = 4;  // per lane: keys of up to 256 values (GLM-5's: 128)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

/// Token t's key, by the warp whose lane this is.
template <typename T>
__device__ void index_key_row(int t, int lane, const T* __restrict__ k, const T* __restrict__ ln_weight,
                              const T* __restrict__ ln_bias, float eps, const T* __restrict__ cos,
                              const T* __restrict__ sin, int dim, int rope, T* __restrict__ float_cache,
                              uint8_t* __restrict__ fp8_bytes, float* __restrict__ fp8_scales,
                              const uint32_t* __restrict__ rows, int first_row) {
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

template <typename T>
__device__ void absorbed_query(const T* __restrict__ q, const T* __restrict__ q_latent, const T* __restrict__ cos,
                               const T* __restrict__ sin, int tokens, int heads, int nope, int rope, int lora,
                               T* __restrict__ out) {
    const int t = blockIdx.x, h = blockIdx.y, half = rope / 2;
    const T* latent = q_latent + ((size_t)h * tokens + t) * lora;
    const T* pe = q + ((size_t)t * heads + h) * (nope + rope) + nope;
    T* dst = out + ((size_t)t * heads + h) * (lora + rope);
    for (int c = threadIdx.x; c < lora; c += blockDim.x) dst[c] = latent[c];
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_pair(to_float(pe[2 * i]), to_float(pe[2 * i + 1]), to_float(cos[(size_t)t * half + i]),
                  to_float(sin[(size_t)t * half + i]), dst + lora + 2 * i);
}

/// Token t's head h, by `threads` threads of which this is `thread`.
template <typename T>
__device__ void rope_leading(int t, int h, int thread, int threads, const T* __restrict__ x,
                             const T* __restrict__ cos, const T* __restrict__ sin, int heads, int dim, int rope,
                             T* __restrict__ out) {
    const int half = rope / 2;
    const T* src = x + ((size_t)t * heads + h) * dim;
    T* dst = out + ((size_t)t * heads + h) * dim;
    for (int i = thread; i < half; i += threads)
        rope_pair(to_float(src[2 * i]), to_float(src[2 * i + 1]), to_float(cos[(size_t)t * half + i]),
                  to_float(sin[(size_t)t * half + i]), dst + 2 * i);
    for (int c = rope + thread; c < dim; c += threads) dst[c] = src[c];
}

/// The three row steps of one call's tokens in one launch (the contract of glm5-ops attention_rows): a grid of
/// (T, 2 + ceil(H / W)) blocks of W warps. Block (t, 0) writes token t's latent row (the whole block, as
/// latent_rows_*), block (t, 1) its indexer key (warp 0, as index_key_rows_*), block (t, 2 + j) the RoPE of its
/// indexer query's heads W·j .. W·j + W − 1 (a warp a head, as rope_leading_*). One row list (or first row)
/// places both cache writes: a token's latent row and key share their position.
template <typename T>
__device__ void attention_rows(const T* __restrict__ kv_a, const T* __restrict__ norm_weight, float norm_eps,
                               T* __restrict__ latent_cache, int lora, const T* __restrict__ k,
                               const T* __restrict__ ln_weight, const T* __restrict__ ln_bias, float ln_eps,
                               T* __restrict__ float_keys, uint8_t* __restrict__ fp8_bytes,
                               float* __restrict__ fp8_scales, int key_dim, const T* __restrict__ q, int heads,
                               int q_dim, T* __restrict__ q_out, const T* __restrict__ cos,
                               const T* __restrict__ sin, int rope, const uint32_t* __restrict__ rows,
                               int first_row) {
    const int t = blockIdx.x, job = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (job == 0) {
        latent_rows(kv_a, norm_weight, norm_eps, cos, sin, latent_cache, rows, first_row, lora, rope);
    } else if (job == 1) {
        if (warp == 0)
            index_key_row(t, lane, k, ln_weight, ln_bias, ln_eps, cos, sin, key_dim, rope, float_keys, fp8_bytes,
                          fp8_scales, rows, first_row);
    } else {
        const int h = (job - 2) * (blockDim.x / 32) + warp;
        if (h < heads) rope_leading(t, h, lane, 32, q, cos, sin, heads, q_dim, rope, q_out);
    }
}

constexpr int PRODUCT_COLUMNS = GLM5_HEAD_PRODUCT_COLUMNS;  // a block's columns: 8 lanes of 8
constexpr int PRODUCT_MAX_WARPS = GLM5_HEAD_PRODUCT_WARPS;
static_assert(PRODUCT_COLUMNS == 64, "8 lanes of 8 columns");

/// The 8 values at `p` (16-byte aligned) as floats.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
    unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p)), v);
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + h);
        v[4 * h] = __uint_as_float(raw.x);
        v[4 * h + 1] = __uint_as_float(raw.y);
        v[4 * h + 2] = __uint_as_float(raw.z);
        v[4 * h + 3] = __uint_as_float(raw.w);
    }
}

/// y[h, c] = Σ_r x[h, r] · w[h, r, c] for the block's 64 columns c of head h (x rows at `x_stride`, w [H, k, n]
/// contiguous with n % 8 == 0 and 16-byte aligned, y rows at `y_stride`): lane (r, c) of a warp takes row
/// 4 · warp + r (then + 4 · warps, ...) and columns 8c .. 8c + 7, one 16-byte load of bf16; f32 sums over the
/// row groups by shuffles, over the warps in shared memory, one rounding. The block past the columns (with
/// `rope` > 0) writes rope_i(pe[h][..rope]) at y[h, n ..] (cos and sin: one token's tables).
template <typename T>
__device__ void head_products(const T* __restrict__ x, int x_stride, const T* __restrict__ w, int k, int n,
                              T* __restrict__ y, int y_stride, const T* __restrict__ pe, int pe_stride,
                              const T* __restrict__ cos, const T* __restrict__ sin, int rope) {
    const int h = blockIdx.y, first = blockIdx.x * PRODUCT_COLUMNS;
    T* out = y + (size_t)h * y_stride;
    if (first >= n) {
        const T* src = pe + (size_t)h * pe_stride;
        for (int i = threadIdx.x; i < rope / 2; i += blockDim.x)
            rope_pair(to_float(src[2 * i]), to_float(src[2 * i + 1]), to_float(cos[i]), to_float(sin[i]),
                      out + n + 2 * i);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int group = lane / 8, column = first + 8 * (lane % 8);
    const T* xh = x + (size_t)h * x_stride;
    const T* wh = w + (size_t)h * k * n + column;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (column < n) {
#pragma unroll 4
        for (int r = 4 * warp + group; r < k; r += 4 * warps) {
            float v[8];
            load8(wh + (size_t)r * n, v);
            const float xr = to_float(xh[r]);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = fmaf(xr, v[j], acc[j]);
        }
    }
    __shared__ float partial[PRODUCT_MAX_WARPS][PRODUCT_COLUMNS];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 8);
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 16);
        if (group == 0) partial[warp][8 * lane + j] = acc[j];
    }
    __syncthreads();
    const int c = threadIdx.x;
    if (c < PRODUCT_COLUMNS && first + c < n) {
        float sum = 0.0f;
        for (int v = 0; v < warps; ++v) sum += partial[v][c];
        store(out + first + c, sum);
    }
}

}  // namespace

#define ATTENTION_ROWS_KERNELS(SUFFIX, T)                                                                          \
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
        const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                                       \
        if (t < tokens)                                                                                        \
            index_key_row(t, threadIdx.x % 32, k, ln_weight, ln_bias, eps, cos, sin, dim, rope, float_cache,   \
                          fp8_bytes, fp8_scales, rows, first_row);                                             \
    }                                                                                                          \
    extern "C" __global__ void absorbed_query_##SUFFIX(const T* q, const T* q_latent, const T* cos,           \
                                                       const T* sin, int tokens, int heads, int nope,          \
                                                       int rope, int lora, T* out) {                           \
        absorbed_query(q, q_latent, cos, sin, tokens, heads, nope, rope, lora, out);                           \
    }                                                                                                          \
    extern "C" __global__ void rope_leading_##SUFFIX(const T* x, const T* cos, const T* sin, int heads,       \
                                                     int dim, int rope, T* out) {                              \
        rope_leading(blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x, x, cos, sin, heads, dim, rope, out);     \
    }                                                                                                          \
    extern "C" __global__ void attention_rows_##SUFFIX(                                                       \
        const T* kv_a, const T* norm_weight, float norm_eps, T* latent_cache, int lora, const T* k,           \
        const T* ln_weight, const T* ln_bias, float ln_eps, T* float_keys, uint8_t* fp8_bytes,                \
        float* fp8_scales, int key_dim, const T* q, int heads, int q_dim, T* q_out, const T* cos,             \
        const T* sin, int rope, const uint32_t* rows, int first_row) {                                        \
        attention_rows(kv_a, norm_weight, norm_eps, latent_cache, lora, k, ln_weight, ln_bias, ln_eps,         \
                       float_keys, fp8_bytes, fp8_scales, key_dim, q, heads, q_dim, q_out, cos, sin, rope,     \
                       rows, first_row);                                                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(PRODUCT_MAX_WARPS * 32) head_products_##SUFFIX(              \
        const T* x, int x_stride, const T* w, int k, int n, T* y, int y_stride, const T* pe, int pe_stride,   \
        const T* cos, const T* sin, int rope) {                                                               \
        head_products(x, x_stride, w, k, n, y, y_stride, pe, pe_stride, cos, sin, rope);                      \
    }

ATTENTION_ROWS_KERNELS(bf16, __nv_bfloat16)
ATTENTION_ROWS_KERNELS(f32, float)
