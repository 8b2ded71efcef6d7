// RMSNorm as HF computes it (contract: ops/src/rms_norm/mod.rs), one block per row: the mean square in f32,
// `x · rsqrt(mean + eps)` rounded to the row's dtype, then times the weight and rounded again. One launch
// where candle's tensor ops take nine.

#include <cuda_bf16.h>

#include "row_norm.cuh"

namespace {

using namespace glm5::rows;

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ weight, int cols, float eps,
                         T* __restrict__ out) {
    const T* row = x + (size_t)blockIdx.x * cols;
    T* dst = out + (size_t)blockIdx.x * cols;
    const float inv_rms = block_inv_rms(row, cols, eps);
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
