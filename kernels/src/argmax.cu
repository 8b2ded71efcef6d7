// The index of each row's largest value (contract: ops/src/argmax/mod.rs): a block per row, every thread's
// loads issued before it compares any (four 16-byte vectors a pass), then the block's best by warp shuffles
// and shared memory. candle's argmax walks a 154,880-value logits row with one load in flight per thread:
// 110.6 us on an H100 (ncu), 5% of a Q4_K slice's decode step; this one 17.6 us.

#include <cuda_bf16.h>
#include <stdint.h>

#include "row_norm.cuh"

namespace {

using namespace glm5::rows;

constexpr int VECTORS_PER_PASS = 4;

/// (v, i) ranks above (best, at): larger, NaN above every number, the lower index among equals.
__device__ __forceinline__ bool better(float v, int i, float best, int at) {
    if (isnan(v)) return !isnan(best) || i < at;
    if (isnan(best)) return false;
    return v > best || (v == best && i < at);
}

template <typename T>
__device__ void argmax_row(const T* __restrict__ x, int cols, int vectors, uint32_t* __restrict__ out) {
    constexpr int VECTOR = 16 / sizeof(T);
    const T* row = x + static_cast<size_t>(blockIdx.x) * cols;
    float best = -INFINITY;
    int at = INT32_MAX;
    if (vectors) {
        const int count = cols / VECTOR;
        for (int first = threadIdx.x; first < count; first += VECTORS_PER_PASS * blockDim.x) {
            uint4 loaded[VECTORS_PER_PASS];
#pragma unroll
            for (int p = 0; p < VECTORS_PER_PASS; ++p) {
                const int v = first + p * blockDim.x;
                if (v < count) loaded[p] = *reinterpret_cast<const uint4*>(row + static_cast<size_t>(v) * VECTOR);
            }
#pragma unroll
            for (int p = 0; p < VECTORS_PER_PASS; ++p) {
                const int v = first + p * blockDim.x;
                if (v >= count) break;
                T values[VECTOR];
                memcpy(values, &loaded[p], sizeof(values));
#pragma unroll
                for (int j = 0; j < VECTOR; ++j) {
                    const float value = to_float(values[j]);
                    if (better(value, v * VECTOR + j, best, at)) {
                        best = value;
                        at = v * VECTOR + j;
                    }
                }
            }
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float value = to_float(row[c]);
            if (better(value, c, best, at)) {
                best = value;
                at = c;
            }
        }
    }
    __shared__ float warp_best[32];
    __shared__ int warp_at[32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_at = __shfl_xor_sync(0xffffffffu, at, offset);
        if (better(other, other_at, best, at)) {
            best = other;
            at = other_at;
        }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_best[warp] = best;
        warp_at[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w)
            if (better(warp_best[w], warp_at[w], best, at)) {
                best = warp_best[w];
                at = warp_at[w];
            }
        out[blockIdx.x] = static_cast<uint32_t>(at);
    }
}

}  // namespace

extern "C" __global__ void argmax_bf16(const __nv_bfloat16* x, int cols, int vectors, uint32_t* out) {
    argmax_row(x, cols, vectors, out);
}
extern "C" __global__ void argmax_f32(const float* x, int cols, int vectors, uint32_t* out) {
    argmax_row(x, cols, vectors, out);
}
