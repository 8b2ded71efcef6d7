// The emulator's versions of kernels/src/bf16_mma.cuh (its inline PTX), with the same signatures.
//
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, from the PTX ISA's fragment layouts (groupID
// g = lane / 4, threadID_in_group t = lane % 4), written here independently of the kernel; the low half of a
// register holds the lower index:
//   A 16 x 16: a0 = A[g][2t, 2t + 1], a1 = A[g + 8][2t, 2t + 1], a2 = A[g][2t + 8, 2t + 9], a3 = A[g + 8][2t + 8, ..].
//   B 16 x 8: b0 = B[2t, 2t + 1][g], b1 = B[2t + 8, 2t + 9][g].
//   C, D 16 x 8 f32: d0 = D[g][2t], d1 = D[g][2t + 1], d2 = D[g + 8][2t], d3 = D[g + 8][2t + 1].
// The products are exact in f32; the sum here runs in f32 in ascending k, which the tensor cores do not
// promise, so results agree with the GPU's to the f32 rounding of a 16-term sum, not bit for bit.
#pragma once

#include <string.h>

#include "cuda_emu.h"

inline float glm5_emu_bf16_half(uint32_t reg, unsigned half) {
    return glm5_emu_bits_to_float((half ? reg >> 16 : reg & 0xffff) << 16);
}

inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    struct Fragment {
        uint32_t a[4], b[2];
    };
    Fragment all[32];
    glm5_emu_gather_fragments(Fragment{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}}, all);
    auto a_at = [&](unsigned row, unsigned k) {
        const unsigned owner = 4 * (row % 8) + (k % 8) / 2;
        return glm5_emu_bf16_half(all[owner].a[row / 8 + 2 * (k / 8)], k % 2);
    };
    auto b_at = [&](unsigned k, unsigned col) {
        const unsigned owner = 4 * col + (k % 8) / 2;
        return glm5_emu_bf16_half(all[owner].b[k / 8], k % 2);
    };
    glm5_emu_mma_accumulate<16>(d, a_at, b_at);
}

inline uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
    uint32_t d = 0;
    for (unsigned half = 0; half < 2; ++half) {
        const __nv_bfloat16 v = __float2bfloat16(glm5_emu_bf16_half(a, half) - glm5_emu_bf16_half(b, half));
        d |= static_cast<uint32_t>(v.__x) << (16 * half);
    }
    return d;
}

template <uint32_t B, uint32_t C> inline uint32_t and_or(uint32_t a) { return (a & B) | C; }

// The emulator runs one launch at a time, in stream order: the previous grid has ended.
inline void wait_for_prior_grid() {}
inline void allow_dependent_grids() {}

inline void async_copy16(void* to, const void* from) { memcpy(to, from, 16); }
inline void async_copies_wait() {}

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 from the PTX ISA's layouts: a0 = A[g][4t .. 4t + 3],
// a1 = A[g + 8][4t ..], a2 = A[g][16 + 4t ..], a3 = A[g + 8][16 + 4t ..]; b0 = B[4t .. 4t + 3][g],
// b1 = B[16 + 4t ..][g]; byte i of a register is k = base + i. Exact (s32 sums).
inline void mma_s8_16832(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    struct Fragment {
        uint32_t a[4], b[2];
    };
    Fragment all[32];
    glm5_emu_gather_fragments(Fragment{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}}, all);
    auto byte = [](uint32_t reg, unsigned i) { return static_cast<int>(static_cast<int8_t>(reg >> (8 * i))); };
    auto a_at = [&](unsigned row, unsigned k) {
        return byte(all[4 * (row % 8) + (k % 16) / 4].a[row / 8 + 2 * (k / 16)], k % 4);
    };
    auto b_at = [&](unsigned k, unsigned col) { return byte(all[4 * col + (k % 16) / 4].b[k / 16], k % 4); };
    glm5_emu_mma_accumulate<32>(d, a_at, b_at);
}
