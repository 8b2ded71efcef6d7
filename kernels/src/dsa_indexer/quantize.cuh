// The FP8 key quantiser.
// Part of dsa_indexer.cu (included in order from there; not a translation unit of its own).
#pragma once

// Quantises float rows to e4m3 with one scale per row: scale = amax / 448 (1 for an all-zero row), byte =
// e4m3(x / scale), round to nearest even, saturating. One warp per row.
template <typename T>
__device__ void quantize_fp8_impl(const T* rows, uint8_t* bytes, float* scales, int n, int D) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* x = rows + (size_t)row * D;
    float amax = 0.f;
    for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(float(x[d])));
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    for (int d = lane; d < D; d += 32)
        bytes[(size_t)row * D + d] = __nv_cvt_float_to_fp8(float(x[d]) / scale, __NV_SATFINITE, __NV_E4M3);
    if (lane == 0) scales[row] = scale;
}
