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

// mma_bf16_16816, mma_s8_16832 and bf16x2_sub: the includer includes bf16_mma.cuh first (itself, so that the CPU emulator's
// include path puts its own versions in their place).
#include "glm5_interface.h"
#include "gguf_formats.cuh"
#include "row_norm.cuh"

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

// ---- One activation row ----------------------------------------------------------------------------------
//
// With one activation row (batch-1 decode; an expert chosen by one token) `accumulate` leaves 7 of the mma's 8
// columns empty and spends most of its instructions on each sub-block's scales. `row` spends the columns on the
// scales instead, on the int8 tensor cores (m16n8k32): the activations quantised per 32-value sub-block as
// llama.cpp's mat-vecs quantise them (its q8_1: d8 = max |x| / 127, q8 = round(x / d8)), a weight's nibble an
// int8 by one mask (the high nibbles a shift first): 3 instructions for 8 weights, where bf16 (128 + q under a
// bf16 exponent) took 7, and half the MMAs (sm_90 SASS: ~155 warp instructions a block of 16 rows, ~255 in bf16).
//
// Lane (g, t) decodes, of rows g and g + 8, sub-block pair t (the block's bytes 16 + 32t ..: values 64t ..
// 64t + 63, the low nibbles sub-block 2t, the high ones 2t + 1) into the A slots of segment t (k 4t .. 4t + 3 and
// 16 + 4t ..: 8 values a k-step), the low nibbles into accumulator `lo`, the high into `hi`; only lanes (t, t)
// and (t + 4, t) give the B operand their pair's int8 activations, so column c of a product is pair c % 4's sum
// alone, per row. After a block lane (g, t) holds the sums of sub-blocks 4(t % 2) .. 4(t % 2) + 3 of both its
// rows, and scales those of row g (t < 2) or g + 8 (t >= 2). Per sub-block j of a row, as llama.cpp's mat-vecs
// (the row times x as quantised, the mins with s_j = d8_j · Σ q8):
//
//   y[r] += d · Σ_j sc[r][j] · d8_j · Σ_l q[r][l] q8[l]  −  dmin · Σ_j m[r][j] · s_j
namespace row {

/// The shared memory `stage` fills for `k` activations: the int8 values, d8 and s a sub-block (f32), and 64
/// bytes of zeros (the B operand of the lanes that give none).
__host__ __device__ constexpr int staged_bytes(int k) { return k + 8 * (k / 32) + 64; }

__device__ __forceinline__ uint32_t pack4(int a, int b, int c, int d) {
    return (a & 0xff) | ((b & 0xff) << 8) | ((c & 0xff) << 16) | (static_cast<uint32_t>(d & 0xff) << 24);
}

/// The activation row `x` (`k` bf16 values, 16-byte aligned) quantised into shared memory at `staged` (16-byte
/// aligned, `staged_bytes(k)`) by the whole block, in order: sub-block s's 32 values at bytes 32s ...
__device__ __forceinline__ void stage(const __nv_bfloat16* x, uint8_t* staged, int k) {
    float* d8 = reinterpret_cast<float*>(staged + k);
    float* s = d8 + k / 32;
    // k / 8 is a multiple of 32 and blockDim.x of 32: a warp's lanes stay in the loop together; a sub-block is
    // four consecutive lanes' vectors.
    for (int i = threadIdx.x; i < k / 8; i += blockDim.x) {
        float f[8];
        rows::unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(x) + i), f);
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fmaxf(fabsf(f[2 * j]), fabsf(f[2 * j + 1])));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int q[8], sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            q[j] = __float2int_rn(f[j] * id);
            sum += q[j];
        }
        reinterpret_cast<uint2*>(staged)[i] = {pack4(q[0], q[1], q[2], q[3]), pack4(q[4], q[5], q[6], q[7])};
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (i % 4 == 0) {
            d8[i / 4] = d;
            s[i / 4] = d * static_cast<float>(sum);
        }
    }
    if (threadIdx.x < 4) reinterpret_cast<uint4*>(s + k / 32)[threadIdx.x] = {0, 0, 0, 0};
    __syncthreads();
}

/// What one lane reads of one Q4_K block of its two rows: sub-block pair t's 32 bytes of both, and the 16-byte
/// head (d, dmin, scales) of the row it scales (g for t < 2, g + 8 for t >= 2).
struct Block {
    uint4 qs[2][2];
    uint4 head;
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/// acc += block `b`'s part of the lane's row (g for t < 2, g + 8 for t >= 2) times the activations `staged` by
/// `stage` (the whole row): sub-blocks 4(t % 2) .. 4(t % 2) + 3. `mine`: the lane gives its activations to the
/// B operand (g % 4 == t).
__device__ __forceinline__ void accumulate(const Block& block, const uint8_t* staged, int k, bool mine, int b,
                                           int t, float& acc) {
    constexpr uint32_t NIBBLES = 0x0f0f0f0f;
    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
    // Sub-block 2t's 32 int8 values then 2t + 1's, or the zeros after the scales.
    const uint4* pair = mine ? reinterpret_cast<const uint4*>(staged + 256 * b + 64 * t)
                             : reinterpret_cast<const uint4*>(staged + k + 8 * (k / 32));
    const uint4 even[2] = {pair[0], pair[1]}, odd[2] = {pair[2], pair[3]};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        // Values 8m .. 8m + 3 (A slots 4t ..) and 8m + 4 .. 8m + 7 (16 + 4t ..) of both sub-blocks.
        const int i = 2 * (m % 2);
        const uint32_t w[2][2] = {{word(block.qs[0][m / 2], i), word(block.qs[0][m / 2], i + 1)},
                                  {word(block.qs[1][m / 2], i), word(block.qs[1][m / 2], i + 1)}};
        const uint32_t a_lo[4] = {w[0][0] & NIBBLES, w[1][0] & NIBBLES, w[0][1] & NIBBLES, w[1][1] & NIBBLES};
        const uint32_t a_hi[4] = {(w[0][0] >> 4) & NIBBLES, (w[1][0] >> 4) & NIBBLES, (w[0][1] >> 4) & NIBBLES,
                                  (w[1][1] >> 4) & NIBBLES};
        const uint32_t b_lo[2] = {word(even[m / 2], i), word(even[m / 2], i + 1)};
        const uint32_t b_hi[2] = {word(odd[m / 2], i), word(odd[m / 2], i + 1)};
        mma_s8_16832(lo, a_lo, b_lo);
        mma_s8_16832(hi, a_hi, b_hi);
    }
    const int half = t % 2;
    const float* d8_all = reinterpret_cast<const float*>(staged + k);
    const float4 d8v = reinterpret_cast<const float4*>(d8_all)[2 * b + half];
    const float4 sv = reinterpret_cast<const float4*>(d8_all + k / 32)[2 * b + half];
    const float d8[4] = {d8v.x, d8v.y, d8v.z, d8v.w}, s[4] = {sv.x, sv.y, sv.z, sv.w};
    const bool upper = t >= 2;
    const int sums[4] = {upper ? lo[2] : lo[0], upper ? hi[2] : hi[0], upper ? lo[3] : lo[1], upper ? hi[3] : hi[1]};
    const uint4& head = block.head;
    const float d = __half2float(__ushort_as_half(static_cast<uint16_t>(head.x & 0xffff)));
    const float dmin = __half2float(__ushort_as_half(static_cast<uint16_t>(head.x >> 16)));
    const uint32_t sc = half == 0 ? head.y & 0x3f3f3f3f : (head.w & 0x0f0f0f0f) | ((head.y >> 2) & 0x30303030);
    const uint32_t mn =
        half == 0 ? head.z & 0x3f3f3f3f : ((head.w >> 4) & 0x0f0f0f0f) | ((head.z >> 2) & 0x30303030);
    float scaled = 0.0f, mins = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        scaled = fmaf(gguf::byte_as_float(sc, j), d8[j] * static_cast<float>(sums[j]), scaled);
        mins = fmaf(gguf::byte_as_float(mn, j), s[j], mins);
    }
    acc = fmaf(d, scaled, fmaf(-dmin, mins, acc));
}

/// acc += the warp's share of the lane's row's blocks (`warp`, `warp + warps`, ... below `k / 256`) times the
/// staged activations, each block's loads issued DEPTH blocks ahead of its use into a ring of DEPTH + 1
/// (`start` issues the first DEPTH, before the activations are staged). The quad's sums meet: row g's lands in
/// lane (g, 0), row g + 8's in lane (g, 2).
template <int DEPTH> struct Stream {
    static constexpr int RING = DEPTH + 1;
    Block ring[RING];
    // The lane's addresses in block 0 of its rows (`start` sets them a tile): pair t's bytes of rows g and g + 8,
    // the head of the row it scales; a block is BLOCK_BYTES on (not recomputed from the rows a block).
    const uint8_t* qs[2];
    const uint8_t* head;

    __device__ __forceinline__ Block load_block(int b) const {
        const size_t at = static_cast<size_t>(b) * BLOCK_BYTES;
        Block block;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            block.qs[r][0] = __ldg(reinterpret_cast<const uint4*>(qs[r] + at));
            block.qs[r][1] = __ldg(reinterpret_cast<const uint4*>(qs[r] + at) + 1);
        }
        block.head = __ldg(reinterpret_cast<const uint4*>(head + at));
        return block;
    }

    __device__ __forceinline__ void start(const uint8_t* const (&rows)[2], int warp, int warps, int blocks, int t) {
        qs[0] = rows[0] + 16 + 32 * t;
        qs[1] = rows[1] + 16 + 32 * t;
        head = t >= 2 ? rows[1] : rows[0];
#pragma unroll
        for (int d = 0; d < DEPTH; ++d)
            if (warp + d * warps < blocks) ring[d] = load_block(warp + d * warps);
    }

    __device__ __forceinline__ void run(const uint8_t* staged, int k, int warp, int warps, int g, int t, float& acc) {
        const int blocks = k / 256;
        const bool mine = g % 4 == t;
        for (int b0 = warp; b0 < blocks; b0 += RING * warps) {
#pragma unroll
            for (int d = 0; d < RING; ++d) {
                const int b = b0 + d * warps;
                if (b < blocks) {
                    if (b + DEPTH * warps < blocks) ring[(d + DEPTH) % RING] = load_block(b + DEPTH * warps);
                    accumulate(ring[d], staged, k, mine, b, t, acc);
                }
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    }
};

/// Each warp's one-row sums (`Stream::run`'s) added over the warps whose index has parity `parity` (every warp
/// when `stride` is 1): lanes (g, 0) / (g, 2) get rows g / g + 8. Every thread calls it; its shared buffer is
/// free again when it returns.
__device__ __forceinline__ float sum_over_warps(float acc, int parity, int stride) {
    __shared__ float partial[MAX_WARPS][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    partial[warp][lane] = acc;
    __syncthreads();
    float sum = 0.0f;
    for (int v = parity; v < warps; v += stride) sum += partial[v][lane];
    __syncthreads();
    return sum;
}

}  // namespace row

}  // namespace q4k_mma
}  // namespace glm5
