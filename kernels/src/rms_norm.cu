// RMSNorm as HF computes it (contract: ops/src/rms_norm/mod.rs), one block per row: the mean square in f32,
// `x · rsqrt(mean + eps)` rounded to the row's dtype, then times the weight and rounded again. One launch
// where candle's tensor ops take nine.

#include <cuda_bf16.h>

namespace {

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float round_to(float v, const __nv_bfloat16*) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ float round_to(float v, const float*) { return v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ weight, int cols, float eps,
                         T* __restrict__ out) {
    __shared__ float partial[32];
    const T* row = x + (size_t)blockIdx.x * cols;
    T* dst = out + (size_t)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = to_float(row[c]);
        sum = fmaf(v, v, sum);
    }
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
    const float inv_rms = 1.0f / sqrtf(partial[0] / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        store(dst + c, round_to(to_float(row[c]) * inv_rms, x) * to_float(weight[c]));
}

}  // namespace

extern "C" __global__ void rms_norm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, int cols, float eps,
                                         __nv_bfloat16* out) {
    rms_norm(x, w, cols, eps, out);
}
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, int cols, float eps, float* out) {
    rms_norm(x, w, cols, eps, out);
}
