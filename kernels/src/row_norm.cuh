// Per-row helpers shared by the row kernels (rms_norm.cu, attention_rows.cu, swiglu.cu, argmax.cu), the
// MoE router and the one-row Q4_K staging: the float view of a value (and of packed bf16), the model dtype's
// rounding, and a block's RMS of one row.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace glm5 {
namespace rows {

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

/// The bf16 in a 32-bit word's low / high half as a float (a bf16 is an f32's high half).
__device__ __forceinline__ float bf16_low(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_high(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }

/// The eight values of a 16-byte vector of bf16, in order.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = bf16_low(words[j]);
        f[2 * j + 1] = bf16_high(words[j]);
    }
}

__device__ __forceinline__ float round_to(float v, const __nv_bfloat16*) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ float round_to(float v, const float*) { return v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

/// The sum of every thread's `sum` over the block (every thread gets it). Uses 32 floats of shared memory and
/// two block barriers.
__device__ __forceinline__ float block_sum(float sum) {
    __shared__ float partial[32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        sum = lane < warps ? partial[lane] : 0.0f;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (lane == 0) partial[0] = sum;
    }
    __syncthreads();
    return partial[0];
}

/// 1 / sqrt(mean(row²) + eps) over `cols` values, the squares summed in f32 by the whole block (every thread
/// gets the result).
template <typename T>
__device__ __forceinline__ float block_inv_rms(const T* __restrict__ row, int cols, float eps) {
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = to_float(row[c]);
        sum = fmaf(v, v, sum);
    }
    return 1.0f / sqrtf(block_sum(sum) / cols + eps);
}

}  // namespace rows
}  // namespace glm5
