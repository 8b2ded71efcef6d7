// The emulator's versions of kernels/src/fp4_mma_sm120a.cuh (its inline PTX), with the same signatures.
//
// cp.async: the copy happens at once (zero-filled when not valid), so commit and wait have nothing left to do.
//
// mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3 with
// scale selectors {byte-id 0, thread-id 0}, from the PTX ISA's fragment layouts (groupID g = lane / 4,
// threadID_in_group t = lane % 4), written here independently of the kernel:
//   A 16 x 64 e2m1, 8 codes a register, the lowest nibble the lowest k: a0 = A[g][8t .. 8t + 7],
//     a1 = A[g + 8][8t ..], a2 = A[g][32 + 8t ..], a3 = A[g + 8][32 + 8t ..].
//   B 64 x 8: b0 = B[8t .. 8t + 7][g], b1 = B[32 + 8t ..][g].
//   C, D 16 x 8 f32: d0 = D[g][2t], d1 = D[g][2t + 1], d2 = D[g + 8][2t], d3 = D[g + 8][2t + 1].
//   Scales, ue4m3, byte j for k 16j .. 16j + 15: row g's from lane 4g, row g + 8's from lane 4g + 1 (thread
//     id 0 picks the first pair of each quad); column g's from lane 4g.
//   D = C + Σ_k (A · scale_A)[m][k] (B · scale_B)[k][n]. The products are exact in f32; the sum here runs
//   in f32 in ascending k, which the tensor cores do not promise, so results agree with the GPU's to the
//   f32 rounding of a 64-term sum, not bit for bit.
#pragma once

#include <string.h>

#include "cuda_emu.h"

inline void cp_async16(void* smem, const void* gmem, bool valid) {
    if (valid) {
        memcpy(smem, gmem, 16);
    } else {
        memset(smem, 0, 16);
    }
}

inline void cp_async8(void* smem, const void* gmem, bool valid) {
    if (valid) {
        memcpy(smem, gmem, 8);
    } else {
        memset(smem, 0, 8);
    }
}

inline void cp_async_commit() {}

template <int N> inline void cp_async_wait() {}

inline float glm5_emu_e2m1(uint32_t code) {
    static const float magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return (code & 8) ? -magnitude[code & 7] : magnitude[code & 7];
}

inline float glm5_emu_ue4m3(uint32_t byte) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte & 0x7f), __NV_E4M3)));
}

inline void mma_fp4(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
    struct Fragment {
        uint32_t a[4], b[2], sfa, sfb;
    };
    Fragment all[32];
    glm5_emu_gather_fragments(Fragment{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, sfa, sfb}, all);
    auto a_at = [&](unsigned row, unsigned k) {
        const uint32_t reg = all[4 * (row % 8) + (k % 32) / 8].a[row / 8 + 2 * (k / 32)];
        const uint32_t scale = all[4 * (row % 8) + row / 8].sfa >> (8 * (k / 16));
        return glm5_emu_e2m1(reg >> (4 * (k % 8))) * glm5_emu_ue4m3(scale & 0xff);
    };
    auto b_at = [&](unsigned k, unsigned col) {
        const uint32_t reg = all[4 * col + (k % 32) / 8].b[k / 32];
        const uint32_t scale = all[4 * col].sfb >> (8 * (k / 16));
        return glm5_emu_e2m1(reg >> (4 * (k % 8))) * glm5_emu_ue4m3(scale & 0xff);
    };
    glm5_emu_mma_accumulate<64>(d, a_at, b_at);
}
