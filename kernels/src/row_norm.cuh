// Per-row helpers shared by rms_norm.cu and attention_rows.cu: the float view of a value, the model dtype's
// rounding, and a block's RMS of one row.
#pragma once

#include <cuda_bf16.h>

namespace glm5 {
namespace rows {

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
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
