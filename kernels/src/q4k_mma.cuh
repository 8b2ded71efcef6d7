// Q4_K rows times bf16 activation rows on the tensor cores (mma.sync m16n8k16), shared by the weight-only
// mat-vec (gguf_matmul.cu) and the grouped experts (moe.cu).
//
// The FFMA mat-vecs spend ~6 instructions a Q4_K weight (nibble to float, d1·q − m1, the product, x to f32);
// here one mma multiplies 16 weight rows by 8 activation rows over 16 values, and decoding a weight costs
// ~1.5 instructions (its nibble placed in a bf16 128 + q by a byte permute and a mask, minus 128: exact);
// each sub-block's scales and the sums' scaling add ~30 a warp per 512 weights. Per
// 32-value sub-block s of a block, with q the 4-bit values, d1 = d·sc and m1 = dmin·m (ggml's order):
//
//   y[j][r] += d1[r][s] · Σ_l q[r][l] x[j][l]  −  m1[r][s] · Σ_l x[j][l]
//
// Both sums come from the tensor cores, exact products summed in f32: the first with A = q, the second with
// A = ones, so every C position holds its activation row's Σx where the first product's C lands.
//
// A warp owns 16 weight rows (the mma's M) and up to 8 activation rows (its N). Lane (g, t) (g = lane / 4,
// t = lane % 4) reads, per block, rows g and g + 8 (its A rows): the block's first 16 bytes (scales) and, per
// 64-value pair of sub-blocks, the 8 bytes holding values 8t .. 8t + 7 of both; and activation row g (its B
// column): values 8t .. 8t + 7 of each sub-block. The k order inside an mma is one permutation for A and B
// (slot 2t ↔ value 8t, 2t + 1 ↔ 8t + 1, 2t + 8 ↔ 8t + 2, 2t + 9 ↔ 8t + 3; the second mma's values + 4), so the
// products pair as they should. The C fragment lands as acc[i]: weight row g + 8·(i / 2), activation row
// 2t + i % 2.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

// mma_bf16_16816 and bf16x2_sub: the includer includes bf16_mma.cuh first (itself, so that the CPU emulator's
// include path puts its own versions in their place).
#include "glm5_interface.h"
#include "gguf_formats.cuh"

namespace glm5 {
namespace q4k_mma {

constexpr int BLOCK_BYTES = 144;
/// Most warps of a block (they split the rows' blocks between them).
constexpr int MAX_WARPS = GLM5_Q4K_MMA_MAX_WARPS;

/// What one lane reads of one Q4_K block of its two rows.
struct Block {
    uint4 head[2];
    uint2 bytes[2][4];
};

/// Block `b` of the lane's rows `rows[0]` (g) and `rows[1]` (g + 8): 16-byte scales, 8-byte value loads.
__device__ __forceinline__ Block load(const uint8_t* const (&rows)[2], int b, int t) {
    Block block;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint8_t* at = rows[r] + static_cast<size_t>(b) * BLOCK_BYTES;
        block.head[r] = __ldg(reinterpret_cast<const uint4*>(at));
#pragma unroll
        for (int pair = 0; pair < 4; ++pair)
            block.bytes[r][pair] = __ldg(reinterpret_cast<const uint2*>(at + 16 + 32 * pair + 8 * t));
    }
    return block;
}

/// The bf16 pairs (q[2i], q[2i + 1]), i = 0..3, of 8 bytes' low (`shift` 0) or high (4) nibbles: byte 2i to
/// the low half, byte 2i + 1 to the high half, masked to a nibble under the exponent of 128, minus 128.
__device__ __forceinline__ void bf16_pairs(const uint2& bytes, int shift, uint32_t (&pairs)[4]) {
    const uint32_t words[2] = {bytes.x, bytes.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t spread = __byte_perm(words[i / 2], 0, (i % 2) ? 0x4342 : 0x4140);
        pairs[i] = bf16x2_sub(((spread >> shift) & 0x000f000f) | 0x43004300, 0x43004300);
    }
}

/// acc += block `b` (loaded by `load`) times the 8 activation rows of the lane's quad group: `x_row` is the
/// lane's activation row g (its values `256·b ..` are read), null where that row does not exist.
__device__ __forceinline__ void accumulate(const Block& block, const __nv_bfloat16* x_row, int b, int t,
                                           float (&acc)[4]) {
    constexpr uint32_t ONE = 0x3f803f80;  // bf16 1.0 twice
    const uint32_t ones[4] = {ONE, ONE, ONE, ONE};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        uint32_t q[2][4];  // [row g, g + 8][pair]
#pragma unroll
        for (int r = 0; r < 2; ++r) bf16_pairs(block.bytes[r][s / 2], 4 * (s % 2), q[r]);
        const uint32_t a_lo[4] = {q[0][0], q[1][0], q[0][1], q[1][1]};
        const uint32_t a_hi[4] = {q[0][2], q[1][2], q[0][3], q[1][3]};
        uint4 xv = {0, 0, 0, 0};
        if (x_row != nullptr) xv = __ldg(reinterpret_cast<const uint4*>(x_row + 256 * b + 32 * s + 8 * t));
        const uint32_t b_lo[2] = {xv.x, xv.y}, b_hi[2] = {xv.z, xv.w};
        float qx[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_bf16_16816(qx, a_lo, b_lo);
        mma_bf16_16816(qx, a_hi, b_hi);
        mma_bf16_16816(sx, ones, b_lo);
        mma_bf16_16816(sx, ones, b_hi);
        float d1[2], m1[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) gguf::q4k_scale_min(block.head[r], s, d1[r], m1[r]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = fmaf(d1[i / 2], qx[i], fmaf(-m1[i / 2], sx[i], acc[i]));
    }
}

/// acc[j] += the warp's share of the rows' blocks (`warp`, `warp + warps`, ... below `blocks`) times the
/// activation rows `x_rows[j]` (the lane's, as `accumulate` takes them): two blocks' loads in flight, each
/// block decoded once for every j.
template <int N>
__device__ __forceinline__ void accumulate_warp_blocks(const uint8_t* const (&rows)[2],
                                                       const __nv_bfloat16* const (&x_rows)[N], int warp,
                                                       int warps, int blocks, int t, float (&acc)[N][4]) {
    constexpr int U = 2;
    for (int b0 = warp; b0 < blocks; b0 += warps * U) {
        Block block[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (b0 + u * warps < blocks) block[u] = load(rows, b0 + u * warps, t);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (b0 + u * warps < blocks)
#pragma unroll
                for (int j = 0; j < N; ++j) accumulate(block[u], x_rows[j], b0 + u * warps, t, acc[j]);
    }
}

/// The lane's two row pointers for the 16-row tile starting at `row0` of a [rows, k] Q4_K matrix at `w`
/// (rows past the last read the last; their sums are not written).
__device__ __forceinline__ void tile_rows(const uint8_t* w, int row0, int rows, int k, int g,
                                          const uint8_t* (&out)[2]) {
    const size_t stride = static_cast<size_t>(k / 256) * BLOCK_BYTES;
    out[0] = w + static_cast<size_t>(min(row0 + g, rows - 1)) * stride;
    out[1] = w + static_cast<size_t>(min(row0 + g + 8, rows - 1)) * stride;
}

/// Every warp's `acc` summed into warp 0's (the other warps' are left as they were). Every thread of the block
/// calls it; its shared buffer is free again when it returns.
template <int N> __device__ __forceinline__ void sum_over_warps(float (&acc)[N][4]) {
    __shared__ float partial[MAX_WARPS][N][4][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp][j][i][lane] = acc[j][i];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float sum = 0.0f;
                for (int v = 0; v < warps; ++v) sum += partial[v][j][i][lane];
                acc[j][i] = sum;
            }
        }
    }
    __syncthreads();
}

}  // namespace q4k_mma
}  // namespace glm5
