// A CPU emulator for glm5's plain CUDA kernels: the ones written in CUDA C++ alone (no inline PTX, no tensor
// cores, no async copies), so that their indexing, decoding and reductions run in the CPU test suite against
// the ops' CPU references. kernels/build.rs (feature `emu`) compiles such a .cu file as C++ with this header
// first and `include/` ahead of the CUDA headers; the Rust side (kernels/src/emu.rs) launches a kernel as a
// closure that calls its `extern "C"` function.
//
// Semantics: every block runs alone, its threads as cooperative contexts on one OS thread (so `__shared__`
// is one `static thread_local` per launch thread). `__syncthreads` waits for every thread of the block that
// has not exited; `__shfl_xor_sync` (and an emulated warp-wide instruction such as an MMA) for every lane in
// its mask, each lane's n-th warp collective pairing with its partners' n-th. A barrier no thread can pass (a lane that exited or went another way) ends the launch with
// an error rather than a hang. Arithmetic is the host's: f32 as IEEE, `fmaf` fused, but no contraction of
// `a * b + c` into an FMA as nvcc does, so sums may differ from the GPU's in the last bits.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_fp8.h"
#include "vector_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __align__(n) alignas(n)

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

/// Bytes a lane may contribute to one warp collective.
#define GLM5_EMU_GATHER_BYTES 64

void __syncthreads();
int __syncthreads_and(int predicate);
uint64_t glm5_emu_shuffle_xor(uint64_t bits, unsigned mask, int lane_mask);
/// A warp collective for emulated warp-wide instructions (an MMA): every lane of the warp contributes `bytes`
/// (<= GLM5_EMU_GATHER_BYTES) and receives all 32 contributions, lane by lane, in `all`.
void glm5_emu_warp_gather(const void* mine, size_t bytes, void* all);
/// The launch's dynamic shared memory (`extern __shared__ T name[]`, which build.rs rewrites to a call).
void* glm5_emu_dynamic_shared();

template <typename T> T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    if (width != 32) glm5_emu_unsupported("__shfl_xor_sync with width != 32");
    uint64_t bits = 0;
    memcpy(&bits, &value, sizeof(T));
    bits = glm5_emu_shuffle_xor(bits, mask, lane_mask);
    memcpy(&value, &bits, sizeof(T));
    return value;
}

/// Lane l gets lane l - delta's value, or keeps its own below delta (full warps only).
template <typename T> T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    if (width != 32 || mask != 0xffffffffu) glm5_emu_unsupported("__shfl_up_sync of part of a warp");
    T all[32];
    glm5_emu_warp_gather(&value, sizeof(T), all);
    const unsigned lane = threadIdx.x % 32;
    return lane >= delta ? all[lane - delta] : value;
}

/// Waits for every lane of the warp (full warps only): a collective that moves nothing.
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) glm5_emu_unsupported("__syncwarp of part of a warp");
    char nothing[1];
    glm5_emu_warp_gather(nothing, 0, nothing);
}

/// Every lane's MMA operands (`mine`: this lane's fragment registers), by lane: what an emulated mma.sync
/// reads its A and B elements from.
template <typename Fragment> inline void glm5_emu_gather_fragments(const Fragment& mine, Fragment (&all)[32]) {
    glm5_emu_warp_gather(&mine, sizeof(Fragment), all);
}

/// An m16n8 MMA's accumulation into this lane's four C/D elements (PTX layout: d[2·half + c] is
/// D[g + 8·half][2t + c], g = lane / 4, t = lane % 4): d += Σ_k A[row][k] · B[k][col] over `K` in ascending k,
/// A and B read through `a_at(row, k)` and `b_at(k, col)` (each format's fragment layout).
template <unsigned K, typename Acc, typename AAt, typename BAt>
inline void glm5_emu_mma_accumulate(Acc (&d)[4], AAt a_at, BAt b_at) {
    const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (unsigned half = 0; half < 2; ++half) {
        for (unsigned c = 0; c < 2; ++c) {
            const unsigned row = g + 8 * half, col = 2 * t + c;
            Acc sum = 0;
            for (unsigned k = 0; k < K; ++k) sum += a_at(row, k) * b_at(k, col);
            d[2 * half + c] += sum;
        }
    }
}

template <typename T> inline T __ldg(const T* p) { return *p; }

/// Byte `s` nibble i (low 3 bits) of {y, x} (x bytes 0-3, y 4-7) into byte i; nibble bit 3 replicates the
/// chosen byte's sign.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t both = (static_cast<uint64_t>(y) << 32) | x;
    unsigned out = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned selector = (s >> (4 * i)) & 0xf;
        unsigned byte = static_cast<unsigned>(both >> (8 * (selector & 7))) & 0xff;
        if (selector & 8) byte = (byte & 0x80) ? 0xff : 0;
        out |= byte << (8 * i);
    }
    return out;
}

// Correctly rounded f32 operations (the host's are: SSE arithmetic, no contraction into FMAs).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
/// Round to nearest even (the host's default rounding mode).
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }

inline float __uint_as_float(unsigned v) { return glm5_emu_bits_to_float(v); }
inline unsigned __float_as_uint(float f) { return glm5_emu_float_to_bits(f); }
inline float __int_as_float(int v) { return glm5_emu_bits_to_float(static_cast<uint32_t>(v)); }
inline int __float_as_int(float f) { return static_cast<int>(glm5_emu_float_to_bits(f)); }

// One OS thread runs the whole launch and switches only at barriers, so atomics are plain.
template <typename T> inline T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <typename T> inline T atomicMax(T* p, T v) {
    const T old = *p;
    if (v > old) *p = v;
    return old;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
