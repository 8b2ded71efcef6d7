// RMSNorm as HF computes it (contract: ops/src/rms_norm/mod.rs), one block per row: the mean square in f32,
// `x · rsqrt(mean + eps)` rounded to the row's dtype, then times the weight and rounded again. One launch
// where candle's tensor ops take nine; `add_rms_norm_*` also does the residual add before it.

#include <cuda_bf16.h>

#include "row_norm.cuh"

namespace {

using namespace glm5::rows;

/// Values a thread holds in registers: a row up to HELD · blockDim.x wide (8192 at 1024 threads; GLM-5's
/// widths are 6144 and below) is read once, every load in flight before the first is used. The loops over
/// memory kept one load in flight a thread and read the row twice (H100, ncu: the residual add and norm 7.9 us
/// a call that way, 6.6 us this way; 12 calls a step of the 6-layer slice).
constexpr int HELD = 8;

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ weight, int cols, float eps,
                         T* __restrict__ out) {
    const T* row = x + (size_t)blockIdx.x * cols;
    T* dst = out + (size_t)blockIdx.x * cols;
    if (cols <= HELD * static_cast<int>(blockDim.x)) {
        float v[HELD];
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            v[j] = c < cols ? to_float(row[c]) : 0.0f;
        }
        // In the loop's order (a thread's columns ascending; the zeros past the row add nothing).
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < HELD; ++j) squares = fmaf(v[j], v[j], squares);
        const float inv_rms = 1.0f / sqrtf(block_sum(squares) / cols + eps);
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            if (c < cols) store(dst + c, round_to(v[j] * inv_rms, x) * to_float(weight[c]));
        }
        return;
    }
    const float inv_rms = block_inv_rms(row, cols, eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        store(dst + c, round_to(to_float(row[c]) * inv_rms, x) * to_float(weight[c]));
}

/// The residual sum `round(x + residual)` stored in `sum`, and its RMSNorm (as `rms_norm`) in `out`: the
/// decoder's residual add and the next norm in one launch. Past HELD values a thread, each thread recomputes
/// its sums for the second pass rather than reading back `sum` (other threads' stores to it are not ordered
/// before this block's reads).
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ weight,
                             int cols, float eps, T* __restrict__ sum, T* __restrict__ out) {
    const size_t row = (size_t)blockIdx.x * cols;
    if (cols <= HELD * static_cast<int>(blockDim.x)) {
        float v[HELD];
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            v[j] = c < cols ? round_to(to_float(x[row + c]) + to_float(residual[row + c]), x) : 0.0f;
        }
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            if (c < cols) store(sum + row + c, v[j]);
            squares = fmaf(v[j], v[j], squares);
        }
        const float inv_rms = 1.0f / sqrtf(block_sum(squares) / cols + eps);
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            if (c < cols) store(out + row + c, round_to(v[j] * inv_rms, x) * to_float(weight[c]));
        }
        return;
    }
    float squares = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = round_to(to_float(x[row + c]) + to_float(residual[row + c]), x);
        store(sum + row + c, v);
        squares = fmaf(v, v, squares);
    }
    const float inv_rms = 1.0f / sqrtf(block_sum(squares) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = round_to(to_float(x[row + c]) + to_float(residual[row + c]), x);
        store(out + row + c, round_to(v * inv_rms, x) * to_float(weight[c]));
    }
}

// ---- 16-byte vectors ----------------------------------------------------------------------------------
//
// Rows whose every pointer is 16-byte aligned and whose width is a whole number of 16-byte vectors: a thread
// holds up to HELD_VECTORS vectors of each input and of the weight, every load issued before the first is
// used (the weight's too, before the block's sum), and the launcher gives a block only the threads those
// need (192 for GLM-5's 6144 bf16 values, where a thread a value took 1024 and 8 scalar loads a thread).

constexpr int HELD_VECTORS = 4;

template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float (&out)[16 / sizeof(T)]) {
    T values[16 / sizeof(T)];
    memcpy(values, &v, sizeof(values));
#pragma unroll
    for (int e = 0; e < 16 / static_cast<int>(sizeof(T)); ++e) out[e] = to_float(values[e]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&in)[16 / sizeof(T)]) {
    T values[16 / sizeof(T)];
#pragma unroll
    for (int e = 0; e < 16 / static_cast<int>(sizeof(T)); ++e) store(values + e, in[e]);
    uint4 v;
    memcpy(&v, values, sizeof(v));
    return v;
}

/// The normalised row out of a thread's held vectors: `round(v · inv_rms) · w` per value, stored at `dst`'s
/// vectors `threadIdx.x + j · blockDim.x` (as held). `x` picks the rounding (the row's dtype).
template <typename T>
__device__ __forceinline__ void store_normed_vectors(const uint4 (&xs)[HELD_VECTORS], const uint4 (&ws)[HELD_VECTORS],
                                                     int vectors, float inv_rms, const T* x, uint4* __restrict__ dst) {
    constexpr int N = 16 / sizeof(T);
#pragma unroll
    for (int j = 0; j < HELD_VECTORS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < vectors) {
            float v[N], wv[N];
            unpack<T>(xs[j], v);
            unpack<T>(ws[j], wv);
#pragma unroll
            for (int e = 0; e < N; ++e) v[e] = round_to(v[e] * inv_rms, x) * wv[e];
            dst[i] = pack<T>(v);
        }
    }
}

/// `rms_norm` over vectors (the rounding order the same; the squares summed in another order).
template <typename T>
__device__ void rms_norm_vectors(const T* __restrict__ x, const T* __restrict__ weight, int cols, float eps,
                                 T* __restrict__ out) {
    constexpr int N = 16 / sizeof(T);
    const int vectors = cols / N;
    const uint4* row = reinterpret_cast<const uint4*>(x + (size_t)blockIdx.x * cols);
    const uint4* w = reinterpret_cast<const uint4*>(weight);
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)blockIdx.x * cols);
    uint4 xs[HELD_VECTORS], ws[HELD_VECTORS];
#pragma unroll
    for (int j = 0; j < HELD_VECTORS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < vectors) {
            xs[j] = row[i];
            ws[j] = __ldg(w + i);
        }
    }
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < HELD_VECTORS; ++j) {
        if (threadIdx.x + j * blockDim.x < vectors) {
            float v[N];
            unpack<T>(xs[j], v);
#pragma unroll
            for (int e = 0; e < N; ++e) squares = fmaf(v[e], v[e], squares);
        }
    }
    const float inv_rms = 1.0f / sqrtf(block_sum(squares) / cols + eps);
    store_normed_vectors(xs, ws, vectors, inv_rms, x, dst);
}

/// `add_rms_norm` over vectors.
template <typename T>
__device__ void add_rms_norm_vectors(const T* __restrict__ x, const T* __restrict__ residual,
                                     const T* __restrict__ weight, int cols, float eps, T* __restrict__ sum,
                                     T* __restrict__ out) {
    constexpr int N = 16 / sizeof(T);
    const int vectors = cols / N;
    const size_t row = (size_t)blockIdx.x * vectors;
    const uint4* xv = reinterpret_cast<const uint4*>(x) + row;
    const uint4* rv = reinterpret_cast<const uint4*>(residual) + row;
    const uint4* w = reinterpret_cast<const uint4*>(weight);
    uint4 xs[HELD_VECTORS], rs[HELD_VECTORS], ws[HELD_VECTORS];
#pragma unroll
    for (int j = 0; j < HELD_VECTORS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < vectors) {
            xs[j] = xv[i];
            rs[j] = rv[i];
            ws[j] = __ldg(w + i);
        }
    }
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < HELD_VECTORS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < vectors) {
            float a[N], b[N];
            unpack<T>(xs[j], a);
            unpack<T>(rs[j], b);
#pragma unroll
            for (int e = 0; e < N; ++e) {
                a[e] = round_to(a[e] + b[e], x);
                squares = fmaf(a[e], a[e], squares);
            }
            xs[j] = pack<T>(a);  // the rounded sum, exact in T
            reinterpret_cast<uint4*>(sum)[row + i] = xs[j];
        }
    }
    const float inv_rms = 1.0f / sqrtf(block_sum(squares) / cols + eps);
    store_normed_vectors(xs, ws, vectors, inv_rms, x, reinterpret_cast<uint4*>(out) + row);
}

}  // namespace

extern "C" __global__ void add_rms_norm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* residual,
                                             const __nv_bfloat16* w, int cols, float eps, __nv_bfloat16* sum,
                                             __nv_bfloat16* out) {
    add_rms_norm(x, residual, w, cols, eps, sum, out);
}
extern "C" __global__ void add_rms_norm_f32(const float* x, const float* residual, const float* w, int cols,
                                            float eps, float* sum, float* out) {
    add_rms_norm(x, residual, w, cols, eps, sum, out);
}

extern "C" __global__ void rms_norm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, int cols, float eps,
                                         __nv_bfloat16* out) {
    rms_norm(x, w, cols, eps, out);
}
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, int cols, float eps, float* out) {
    rms_norm(x, w, cols, eps, out);
}

extern "C" __global__ void add_rms_norm_vectors_bf16(const __nv_bfloat16* x, const __nv_bfloat16* residual,
                                                     const __nv_bfloat16* w, int cols, float eps,
                                                     __nv_bfloat16* sum, __nv_bfloat16* out) {
    add_rms_norm_vectors(x, residual, w, cols, eps, sum, out);
}
extern "C" __global__ void add_rms_norm_vectors_f32(const float* x, const float* residual, const float* w, int cols,
                                                    float eps, float* sum, float* out) {
    add_rms_norm_vectors(x, residual, w, cols, eps, sum, out);
}
extern "C" __global__ void rms_norm_vectors_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, int cols, float eps,
                                                 __nv_bfloat16* out) {
    rms_norm_vectors(x, w, cols, eps, out);
}
extern "C" __global__ void rms_norm_vectors_f32(const float* x, const float* w, int cols, float eps, float* out) {
    rms_norm_vectors(x, w, cols, eps, out);
}
