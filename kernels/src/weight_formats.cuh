// Decoding the quantised weight formats in registers, shared by the weight-only mat-vecs
// (weight_only_matmul.cu) and the grouped expert mat-vecs (moe.cu). Every decoder turns one vector load
// into 16 consecutive weights of a row, as f32, which all share one scale.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace glm5 {

/// Two e4m3 bytes (low byte first) as floats (one hardware conversion on sm_89+).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffff), __NV_E4M3);
    return __half22float2(__half2(h));
}

__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    return __half2float(__half(h));
}

/// One e2m1 code (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0) as a float: 0, 0.5, 1, 1.5, 2, 3,
/// 4, 6 and their negatives.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
    const uint32_t exponent = (code >> 1) & 3, mantissa = code & 1;
    const float magnitude =
        exponent ? __uint_as_float(((exponent + 126u) << 23) | (mantissa << 22)) : 0.5f * static_cast<float>(mantissa);
    return (code & 8) ? -magnitude : magnitude;
}

/// 16 e4m3 weights of one 16-byte load, in order.
__device__ __forceinline__ void fp8x16_to_float(const uint4& bytes, float (&w)[16]) {
    const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 lo = e4m3x2_to_float2(words[i]);
        const float2 hi = e4m3x2_to_float2(words[i] >> 16);
        w[4 * i] = lo.x;
        w[4 * i + 1] = lo.y;
        w[4 * i + 2] = hi.x;
        w[4 * i + 3] = hi.y;
    }
}

/// What `e2m1_pair_bits` leaves out: its values are the e2m1 values times 2^-14, so the scale they are
/// multiplied by must be multiplied by 2^14 (exact in f32).
constexpr float E2M1_HALF_BIAS = 16384.0f;

/// The half2 bit pattern of one byte's two e2m1 codes (the low nibble in the low half), values times 2^-14.
/// A code s·e1e0·m placed at a half's sign bit and at its exponent's two low bits and mantissa's top bit is
/// the half 2^(e-15)·(1 + m/2) (e = 0: the subnormal m·2^-15), i.e. the e2m1 value 2^(e-1)·(1 + m/2) (e = 0:
/// m/2) times 2^-14.
__device__ __forceinline__ uint32_t e2m1_pair_bits(uint32_t byte) {
    // Low nibble to bits 0-3, high nibble to bits 16-19: one code per half of a half2.
    const uint32_t spread = (byte | (byte << 12)) & 0x000f000f;
    return ((spread & 0x00070007) << 9) | ((spread & 0x00080008) << 12);
}

/// `table[b] = e2m1_pair_bits(b)` for every byte, filled by the block's threads (then `__syncthreads`).
__device__ __forceinline__ void fill_e2m1_pair_table(uint32_t* table) {
    for (uint32_t b = threadIdx.x; b < 256; b += blockDim.x) table[b] = e2m1_pair_bits(b);
}

/// 16 e2m1 codes of one 8-byte load (the even column in the low nibble) as their values times 2^-14, each
/// byte's pair looked up in a table of `e2m1_pair_bits` in shared memory: one load a byte instead of the bit
/// operations, which took most of a mat-vec's instructions.
__device__ __forceinline__ void e2m1x16_to_float(const uint2& bytes, const uint32_t* table, float (&w)[16]) {
    const uint32_t words[2] = {bytes.x, bytes.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t bits = table[__byte_perm(words[i], 0, 0x4440 + j)];
            const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&bits));
            w[8 * i + 2 * j] = pair.x;
            w[8 * i + 2 * j + 1] = pair.y;
        }
    }
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

/// The N values `v` rounded to T at `o` (16-byte aligned; N values of T a multiple of 16 bytes) in 16-byte
/// stores, for the dequantisers: a thread's scalar stores, each its own memory transaction at a stride of its
/// values from the next lane's, held the GGUF one near 30 GB/s.
template <typename T, int N> __device__ __forceinline__ void store_values(T* o, const float (&v)[N]) {
    constexpr int PER_VECTOR = 16 / sizeof(T);
    static_assert(N % PER_VECTOR == 0, "whole 16-byte vectors");
#pragma unroll
    for (int q = 0; q < N / PER_VECTOR; ++q) {
        T part[PER_VECTOR];
#pragma unroll
        for (int j = 0; j < PER_VECTOR; ++j) part[j] = from_float<T>(v[PER_VECTOR * q + j]);
        uint4 packed;
        memcpy(&packed, part, sizeof(packed));
        reinterpret_cast<uint4*>(o)[q] = packed;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

/// Where a thread of a weight-only mat-vec block works. The block's `WARPS` warps form groups of
/// `column_warps` (a power of two dividing `WARPS`, chosen by the launcher from the row's length), each group
/// one output column; the group's lanes take the column's chunks (16 or 32 weights) `first`, `first +
/// stride`, ... So a long row is read by several warps at once, and a launch has more, shorter-lived warps
/// than columns: more loads in flight, and a short last wave.
struct ColumnSplit {
    int col;     // the group's output column (may be >= n in the last block: then it reads nothing)
    int first;   // the thread's first chunk of the row
    int stride;  // chunks between its consecutive ones: 32 * column_warps
    int warp;
    int lane;
};

template <int WARPS>
__device__ __forceinline__ ColumnSplit column_split(int column_warps) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    return {static_cast<int>(blockIdx.x) * (WARPS / column_warps) + warp / column_warps,
            (warp % column_warps) * 32 + lane, 32 * column_warps, warp, lane};
}

/// y[r, col] = the sum of `acc[r]` over the thread's group, for every row r < m: each warp's sum by shuffles,
/// then the group's warps' in shared memory, written by the group's first warp (lane r for row r). Every
/// thread of the block calls it (it holds a barrier).
template <int WARPS, int ROWS, typename T>
__device__ __forceinline__ void store_split_rows(const float (&acc)[ROWS], const ColumnSplit& at, int column_warps,
                                                 T* y, int m, int n) {
    static_assert(ROWS <= 32, "one lane writes each row");
    __shared__ float partial[WARPS][ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r < m) {
            const float total = warp_sum(acc[r]);
            if (at.lane == 0) partial[at.warp][r] = total;
        }
    }
    __syncthreads();
    if (at.warp % column_warps == 0 && at.lane < m && at.col < n) {
        float sum = 0.0f;
        for (int w = 0; w < column_warps; ++w) sum += partial[at.warp + w][at.lane];
        y[static_cast<size_t>(at.lane) * n + at.col] = from_float<T>(sum);
    }
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

/// 16 consecutive activations (32-byte aligned for bf16, 64 for f32) as floats, in vector loads.
__device__ __forceinline__ void load16(const __nv_bfloat16* p, float (&v)[16]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + half);
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(pairs[i]);
            v[8 * half + 2 * i] = f.x;
            v[8 * half + 2 * i + 1] = f.y;
        }
    }
}
__device__ __forceinline__ void load16(const float* p, float (&v)[16]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float4 raw = __ldg(reinterpret_cast<const float4*>(p) + q);
        v[4 * q] = raw.x;
        v[4 * q + 1] = raw.y;
        v[4 * q + 2] = raw.z;
        v[4 * q + 3] = raw.w;
    }
}

__device__ __forceinline__ float dot16(const float (&w)[16], const float (&x)[16]) {
    float d = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) d = fmaf(w[j], x[j], d);
    return d;
}

/// acc[r] += scale · Σ_j w[j] · x[r, k0 + j] for every row r < m (m <= ROWS).
template <int ROWS, typename T>
__device__ __forceinline__ void accumulate(float (&acc)[ROWS], const float (&w)[16], float scale, const T* x,
                                           int m, int k, int k0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r < m) {
            float xv[16];
            load16(x + static_cast<size_t>(r) * k + k0, xv);
            acc[r] = fmaf(dot16(w, xv), scale, acc[r]);
        }
    }
}

}  // namespace glm5
