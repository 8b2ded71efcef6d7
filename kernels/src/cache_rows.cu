// The rows a layer's attention writes into its caches each step, computed and written by one kernel where
// candle's tensor ops take several (contracts: glm5-ops latent_rows/mod.rs).
//
//   latent_rows_*  one block per token: the MLA latent row [rms_norm(kv_a[..lora]) | rope_i(kv_a[lora..])]
//                  into row rows[t] (or first_row + t) of the cache. RMSNorm as rms_norm.cu (row_norm.cuh);
//                  RoPE interleaved as candle's rope_i: (x0·c − x1·s, x0·s + x1·c), each product rounded to
//                  the dtype and the sum rounded by the store.

#include <cuda_bf16.h>
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

}  // namespace

#define CACHE_ROWS_KERNELS(SUFFIX, T)                                                                          \
    extern "C" __global__ void latent_rows_##SUFFIX(const T* kv_a, const T* norm_weight, float eps,         \
                                                    const T* cos, const T* sin, T* cache,                   \
                                                    const uint32_t* rows, int first_row, int lora,          \
                                                    int rope) {                                              \
        latent_rows(kv_a, norm_weight, eps, cos, sin, cache, rows, first_row, lora, rope);                  \
    }

CACHE_ROWS_KERNELS(bf16, __nv_bfloat16)
CACHE_ROWS_KERNELS(f32, float)
