// The index of each row's largest value (contract: ops/src/argmax/mod.rs). A row's values are split into
// spans, a block each (`argmax_span_*`): every thread's loads issued before it compares any (four 16-byte
// vectors a pass), then the block's best by warp shuffles and shared memory; `argmax_spans` then takes each
// row's best of its spans' (a warp a row). A row of one span takes one block and one launch (`argmax_*`).
// candle's argmax walks a 154,880-value logits row with one load in flight per thread: 110.6 us on an H100
// (ncu); a block a row, 17.6 us (17.2 on an H200), its one multiprocessor's loads the limit; spans of a pass
// of 256 threads spread the row over 38 (f32) blocks.

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

/// The warp's best (value, index) pair, in every lane.
__device__ __forceinline__ void warp_best(float& best, int& at) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_at = __shfl_xor_sync(0xffffffffu, at, offset);
        if (better(other, other_at, best, at)) {
            best = other;
            at = other_at;
        }
    }
}

/// The best (value, index) of `row[begin, end)` into thread 0's `best` / `at` (every thread calls it). With
/// `vectors`, `begin` and `end` are multiples of the 16-byte vector's values and the row 16-byte aligned.
template <typename T>
__device__ void block_best(const T* __restrict__ row, int begin, int end, int vectors, float& best, int& at) {
    constexpr int VECTOR = 16 / sizeof(T);
    best = -INFINITY;
    at = INT32_MAX;
    if (vectors) {
        const int count = end / VECTOR;
        for (int first = begin / VECTOR + threadIdx.x; first < count; first += VECTORS_PER_PASS * blockDim.x) {
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
        for (int c = begin + threadIdx.x; c < end; c += blockDim.x) {
            const float value = to_float(row[c]);
            if (better(value, c, best, at)) {
                best = value;
                at = c;
            }
        }
    }
    __shared__ float warp_best_value[32];
    __shared__ int warp_at[32];
    warp_best(best, at);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_best_value[warp] = best;
        warp_at[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w)
            if (better(warp_best_value[w], warp_at[w], best, at)) {
                best = warp_best_value[w];
                at = warp_at[w];
            }
    }
}

/// Row `blockIdx.x` whole.
template <typename T>
__device__ void argmax_row(const T* __restrict__ x, int cols, int vectors, uint32_t* __restrict__ out) {
    float best;
    int at;
    block_best(x + static_cast<size_t>(blockIdx.x) * cols, 0, cols, vectors, best, at);
    if (threadIdx.x == 0) out[blockIdx.x] = static_cast<uint32_t>(at);
}

/// Span `blockIdx.y` (`span` values, the last one shorter) of row `blockIdx.x`: its best value and index at
/// [row, span] of `best` / `at` (`gridDim.y` spans a row).
template <typename T>
__device__ void argmax_span(const T* __restrict__ x, int cols, int vectors, int span, float* __restrict__ best,
                            uint32_t* __restrict__ at) {
    const int begin = blockIdx.y * span, end = min(cols, begin + span);
    float value;
    int index;
    block_best(x + static_cast<size_t>(blockIdx.x) * cols, begin, end, vectors, value, index);
    if (threadIdx.x == 0) {
        const size_t slot = static_cast<size_t>(blockIdx.x) * gridDim.y + blockIdx.y;
        best[slot] = value;
        at[slot] = static_cast<uint32_t>(index);
    }
}

}  // namespace

extern "C" __global__ void argmax_bf16(const __nv_bfloat16* x, int cols, int vectors, uint32_t* out) {
    argmax_row(x, cols, vectors, out);
}
extern "C" __global__ void argmax_f32(const float* x, int cols, int vectors, uint32_t* out) {
    argmax_row(x, cols, vectors, out);
}

extern "C" __global__ void argmax_span_bf16(const __nv_bfloat16* x, int cols, int vectors, int span, float* best,
                                            uint32_t* at) {
    argmax_span(x, cols, vectors, span, best, at);
}
extern "C" __global__ void argmax_span_f32(const float* x, int cols, int vectors, int span, float* best,
                                           uint32_t* at) {
    argmax_span(x, cols, vectors, span, best, at);
}

/// Row `blockIdx.x`'s best of its `spans` spans' (`argmax_span_*`'s output), by one warp; spans hold their
/// first values' indices in order, so the lowest index among equals is still the first span's.
extern "C" __global__ void argmax_spans(const float* __restrict__ best, const uint32_t* __restrict__ at, int spans,
                                        uint32_t* __restrict__ out) {
    const size_t row = static_cast<size_t>(blockIdx.x) * spans;
    float value = -INFINITY;
    int index = INT32_MAX;
    for (int s = threadIdx.x; s < spans; s += 32)
        if (better(best[row + s], static_cast<int>(at[row + s]), value, index)) {
            value = best[row + s];
            index = static_cast<int>(at[row + s]);
        }
    warp_best(value, index);
    if (threadIdx.x == 0) out[blockIdx.x] = static_cast<uint32_t>(index);
}
