// SwiGLU of a stacked gate|up product (contract: ops/src/swiglu/mod.rs): out[r][c] = round(round(silu(g)) · u)
// with g = in[r][c] and u = in[r][inter + c], in f32 as torch computes it (silu rounded once, then the
// product). One launch where candle's ops took a silu over the strided gate half and a multiply by the
// strided up half: over a 4096-token prefill's [tokens · 9, 2 · 2048] expert product that was ~1.2 ms a layer.

#include <cuda_bf16.h>
#include <stdint.h>

#include "row_norm.cuh"

namespace {

using namespace glm5::rows;

template <typename T>
__device__ __forceinline__ float swiglu_value(T gate, T up) {
    const float g = to_float(gate);
    return round_to(g / (1.0f + expf(-g)), static_cast<const T*>(nullptr)) * to_float(up);
}

/// Grid-stride over the output: 16 bytes a step where `vectors` (the launcher checks that `inter` is a
/// multiple of the values in 16 bytes and `in` is 16-byte aligned), else one value.
template <typename T>
__device__ void swiglu(const T* __restrict__ in, int rows, int inter, int vectors, T* __restrict__ out) {
    constexpr int VECTOR = 16 / sizeof(T);
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (vectors) {
        const int per_row = inter / VECTOR;
        const size_t total = static_cast<size_t>(rows) * per_row;
        for (size_t i = first; i < total; i += stride) {
            const int r = static_cast<int>(i / per_row), c = static_cast<int>(i % per_row) * VECTOR;
            const T* row = in + static_cast<size_t>(r) * 2 * inter;
            const uint4 gate = *reinterpret_cast<const uint4*>(row + c);
            const uint4 up = *reinterpret_cast<const uint4*>(row + inter + c);
            T g[VECTOR], u[VECTOR], o[VECTOR];
            memcpy(g, &gate, sizeof(gate));
            memcpy(u, &up, sizeof(up));
#pragma unroll
            for (int j = 0; j < VECTOR; ++j) store(o + j, swiglu_value(g[j], u[j]));
            uint4 packed;
            memcpy(&packed, o, sizeof(packed));
            *reinterpret_cast<uint4*>(out + static_cast<size_t>(r) * inter + c) = packed;
        }
    } else {
        const size_t total = static_cast<size_t>(rows) * inter;
        for (size_t i = first; i < total; i += stride) {
            const int r = static_cast<int>(i / inter), c = static_cast<int>(i % inter);
            const T* row = in + static_cast<size_t>(r) * 2 * inter;
            store(out + i, swiglu_value(row[c], row[inter + c]));
        }
    }
}

}  // namespace

extern "C" __global__ void swiglu_bf16(const __nv_bfloat16* in, int rows, int inter, int vectors, __nv_bfloat16* out) {
    swiglu(in, rows, inter, vectors, out);
}
extern "C" __global__ void swiglu_f32(const float* in, int rows, int inter, int vectors, float* out) {
    swiglu(in, rows, inter, vectors, out);
}
