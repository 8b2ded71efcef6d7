// Decoders of the GGUF block formats glm5 decodes, llama.cpp's i-quants and K-quants: one 32-value sub-block
// of a block into floats, in ggml's f32 order (`dequantize_row_iq*`, `dequantize_row_q2_K` ... `_q6_K`), so every
// value equals the CPU reference's (glm5-ops gguf_matmul/reference.rs, which has the layout table). The lookup
// tables are generated from kernels/src/iq_grids.rs.
//
// I-quant blocks are 2-byte aligned at best (66, 74, ... bytes), so wider fields are read as u16 pairs; the
// mat-vecs read Q3_K's and Q6_K's (110, 210 bytes) in 16-bit words, Q2_K's (84) in 32-bit ones and Q4_K's and
// Q5_K's (144, 176) in 16-byte vectors (`check_alignment` in glm5-ops holds a weight's start to that).

#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "glm5_iq_grids.h"

namespace glm5 {
namespace gguf {

enum Format { IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, IQ4_NL, IQ4_XS, Q4_K, Q6_K, Q2_K, Q3_K, Q5_K };

constexpr float IQ1_DELTA = 0.125f;

template <Format F> struct Traits {
    static constexpr int VALUES = 256;
};
template <> struct Traits<IQ4_NL> {
    static constexpr int VALUES = 32;
};
#define GLM5_IQ_BYTES(F, B) \
    template <> struct Bytes<F> { static constexpr int value = B; };
template <Format F> struct Bytes;
GLM5_IQ_BYTES(IQ2_XXS, 66)
GLM5_IQ_BYTES(IQ2_XS, 74)
GLM5_IQ_BYTES(IQ2_S, 82)
GLM5_IQ_BYTES(IQ3_XXS, 98)
GLM5_IQ_BYTES(IQ3_S, 110)
GLM5_IQ_BYTES(IQ1_S, 50)
GLM5_IQ_BYTES(IQ1_M, 56)
GLM5_IQ_BYTES(IQ4_NL, 18)
GLM5_IQ_BYTES(IQ4_XS, 136)
GLM5_IQ_BYTES(Q4_K, 144)
GLM5_IQ_BYTES(Q6_K, 210)
GLM5_IQ_BYTES(Q2_K, 84)
GLM5_IQ_BYTES(Q3_K, 110)
GLM5_IQ_BYTES(Q5_K, 176)
#undef GLM5_IQ_BYTES

__device__ __forceinline__ uint16_t u16_at(const uint8_t* b, int at) {
    return static_cast<uint16_t>(__ldg(b + at)) | (static_cast<uint16_t>(__ldg(b + at + 1)) << 8);
}
__device__ __forceinline__ uint32_t u32_at(const uint8_t* b, int at) {
    return static_cast<uint32_t>(u16_at(b, at)) | (static_cast<uint32_t>(u16_at(b, at + 2)) << 16);
}
__device__ __forceinline__ float f16_at(const uint8_t* b, int at) {
    return __half2float(__ushort_as_half(u16_at(b, at)));
}
__device__ __forceinline__ uint32_t byte_of(uint64_t entry, int j) {
    return static_cast<uint32_t>(entry >> (8 * j)) & 0xff;
}
__device__ __forceinline__ float signed_byte_of(uint64_t entry, int j) {
    return static_cast<float>(static_cast<int8_t>(byte_of(entry, j)));
}
__device__ __forceinline__ float sign_of(uint32_t bits, int j) { return (bits >> j) & 1 ? -1.0f : 1.0f; }
/// Byte `k` of `w` as a float, exactly and without a conversion instruction (a quarter-rate unit): the byte as
/// the low mantissa byte of 2^23, minus 2^23.
__device__ __forceinline__ float byte_as_float(uint32_t w, int k) {
    return __uint_as_float(__byte_perm(w, 0x4b000000, 0x7540 + k)) - 8388608.0f;
}

/// Half `h` (values 16h .. 16h + 15) of sub-block `ib` (0..7; IQ4_NL: 0) of the block at `b`: its values
/// before their scale into `w` (small integers, or IQ1's grid values ± 1/8), and the half's scale as the return
/// value. `scale · w[j]` is the reference's value exactly (the other factor is ±1 or the reference multiplies in
/// that order), so a dot product can apply the scale once per 16 values.
template <Format F> __device__ __forceinline__ float decode_half(const uint8_t* b, int ib, int h, float (&w)[16]);

template <> __device__ __forceinline__ float decode_half<IQ2_XXS>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
    const uint8_t* q = b + 2 + 8 * ib;
    const uint32_t aux = u32_at(q, 4);
    const float db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.25f;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const int l = 2 * h + g;
        const uint64_t grid = GLM5_IQ2XXS_GRID[__ldg(q + l)];
        const uint32_t signs = GLM5_KSIGNS_IQ2XS[(aux >> (7 * l)) & 127];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * g + j] = static_cast<float>(byte_of(grid, j)) * sign_of(signs, j);
    }
    return db;
}

template <> __device__ __forceinline__ float decode_half<IQ2_XS>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
    // One 4-bit scale per 16 values: the half's.
    const float db = d * (0.5f + static_cast<float>((__ldg(b + 66 + ib) >> (4 * h)) & 0xf)) * 0.25f;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const uint32_t q = u16_at(b, 2 + 2 * (4 * ib + 2 * h + g));
        const uint64_t grid = GLM5_IQ2XS_GRID[q & 511];
        const uint32_t signs = GLM5_KSIGNS_IQ2XS[q >> 9];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * g + j] = static_cast<float>(byte_of(grid, j)) * sign_of(signs, j);
    }
    return db;
}

template <> __device__ __forceinline__ float decode_half<IQ2_S>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
    const uint32_t qh = __ldg(b + 66 + ib);
    const float db = d * (0.5f + static_cast<float>((__ldg(b + 74 + ib) >> (4 * h)) & 0xf)) * 0.25f;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const int l = 2 * h + g;
        const uint32_t index = __ldg(b + 2 + 4 * ib + l) | (((qh >> (2 * l)) & 3) << 8);
        const uint64_t grid = GLM5_IQ2S_GRID[index];
        const uint32_t signs = __ldg(b + 34 + 4 * ib + l);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * g + j] = static_cast<float>(byte_of(grid, j)) * sign_of(signs, j);
    }
    return db;
}

template <> __device__ __forceinline__ float decode_half<IQ3_XXS>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
    const uint32_t aux = u32_at(b, 66 + 4 * ib);
    const float db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const int l = 2 * h + g;
        const uint32_t signs = GLM5_KSIGNS_IQ2XS[(aux >> (7 * l)) & 127];
        const uint64_t g1 = GLM5_IQ3XXS_GRID[__ldg(b + 2 + 8 * ib + 2 * l)];
        const uint64_t g2 = GLM5_IQ3XXS_GRID[__ldg(b + 2 + 8 * ib + 2 * l + 1)];
        const uint64_t grid = g1 | (g2 << 32);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * g + j] = static_cast<float>(byte_of(grid, j)) * sign_of(signs, j);
    }
    return db;
}

template <> __device__ __forceinline__ float decode_half<IQ3_S>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
    const uint32_t s = (__ldg(b + 106 + ib / 2) >> (4 * (ib % 2))) & 0xf;
    const float db = d * static_cast<float>(1 + 2 * s);
    const uint32_t qh = __ldg(b + 66 + ib);
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const int k = 4 * h + g;
        const uint32_t index = __ldg(b + 2 + 8 * ib + k) | (((qh >> k) & 1) << 8);
        const uint32_t grid = GLM5_IQ3S_GRID[index];
        const uint32_t signs = __ldg(b + 74 + 4 * ib + k / 2) >> (4 * (k % 2));
#pragma unroll
        for (int j = 0; j < 4; ++j) w[4 * g + j] = static_cast<float>(byte_of(grid, j)) * sign_of(signs, j);
    }
    return db;
}

template <> __device__ __forceinline__ float decode_half<IQ1_S>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
    const uint32_t qh = u16_at(b, 34 + 2 * ib);
    const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
    const float delta = (qh & 0x8000) ? -IQ1_DELTA : IQ1_DELTA;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const int l = 2 * h + g;
        const uint64_t grid = GLM5_IQ1S_GRID[__ldg(b + 2 + 4 * ib + l) | (((qh >> (3 * l)) & 7) << 8)];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * g + j] = signed_byte_of(grid, j) + delta;
    }
    return dl;
}

template <> __device__ __forceinline__ float decode_half<IQ1_M>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    uint32_t sc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[i] = u16_at(b, 48 + 2 * i);
    const uint16_t d_bits = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) |
                                                  ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    const float d = __half2float(__ushort_as_half(d_bits));
    const int s = 2 * ib + h;
    const float dl = d * static_cast<float>(2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int i = 4 * ib + 2 * h + q;
        const uint32_t nibble = (__ldg(b + 32 + i / 2) >> (4 * (i % 2))) & 0xf;
        const float delta = (nibble & 8) ? -IQ1_DELTA : IQ1_DELTA;
        const uint64_t grid = GLM5_IQ1S_GRID[__ldg(b + i) | ((nibble & 7) << 8)];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * q + j] = signed_byte_of(grid, j) + delta;
    }
    return dl;
}

// IQ4: the first half is the 16 bytes' low nibbles, the second their high nibbles.
template <> __device__ __forceinline__ float decode_half<IQ4_NL>(const uint8_t* b, int, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j] = static_cast<float>(GLM5_KVALUES_IQ4NL[(__ldg(b + 2 + j) >> (4 * h)) & 0xf]);
    return d;
}

template <> __device__ __forceinline__ float decode_half<IQ4_XS>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const float d = f16_at(b, 0);
    const uint32_t scales_h = u16_at(b, 2);
    const uint32_t ls = ((__ldg(b + 4 + ib / 2) >> (4 * (ib % 2))) & 0xf) | (((scales_h >> (2 * ib)) & 3) << 4);
    const float dl = d * static_cast<float>(static_cast<int>(ls) - 32);
#pragma unroll
    for (int j = 0; j < 16; ++j)
        w[j] = static_cast<float>(GLM5_KVALUES_IQ4NL[(__ldg(b + 8 + 16 * ib + j) >> (4 * h)) & 0xf]);
    return dl;
}

// Q4_K (ggml's block_q4_K, a K-quant: 144 bytes, so every block of a row of whole blocks is 16-byte aligned):
// f16 `d` and `dmin`, 12 bytes of the 8 sub-blocks' 6-bit scales `sc` and mins `m`, then 128 bytes of 4-bit
// values: bytes 32j .. 32j + 31 hold sub-block 2j in their low nibbles and 2j + 1 in their high ones. A value
// is d1·q − m1 with d1 = d·sc and m1 = dmin·m, so the decoder gives the values themselves (scale 1).

/// What one 16-value chunk of a Q4_K block reads: the block's first 16 bytes (scales) and the 16 bytes holding
/// its values.
struct Q4kChunk {
    uint4 head;
    uint4 qs;
    int sub;
};

/// Sub-block `sub`'s d1 = d·sc and m1 = dmin·m from the block's first 16 bytes `head` (ggml's order).
__device__ __forceinline__ void q4k_scale_min(const uint4& head, int sub, float& d1, float& m1) {
    const float d = __half2float(__ushort_as_half(static_cast<uint16_t>(head.x & 0xffff)));
    const float dmin = __half2float(__ushort_as_half(static_cast<uint16_t>(head.x >> 16)));
    // ggml's get_scale_min_k4: sub-blocks 0-3 take the low 6 bits of scale bytes t and t + 4; 4-7 a nibble of
    // byte t + 8 each, with the top 2 bits of bytes t and t + 4 (t = sub % 4).
    const int t = 8 * (sub & 3);
    const uint32_t a = (head.y >> t) & 0xff, b = (head.z >> t) & 0xff, e = (head.w >> t) & 0xff;
    const uint32_t sc = sub < 4 ? a & 63 : (e & 0xf) | ((a >> 6) << 4);
    const uint32_t m = sub < 4 ? b & 63 : (e >> 4) | ((b >> 6) << 4);
    d1 = d * static_cast<float>(sc);
    m1 = dmin * static_cast<float>(m);
}

/// Half `h` of sub-block `sub` of the Q4_K block at `b`: two 16-byte loads.
__device__ __forceinline__ Q4kChunk q4k_load(const uint8_t* b, int sub, int h) {
    const uint4* v = reinterpret_cast<const uint4*>(b);
    return {__ldg(v), __ldg(v + 1 + 2 * (sub / 2) + h), sub};
}

/// The chunk's values: `EXACT` in ggml's f32 operations (d1·q rounded, then − m1), else d1·q − m1 in one fma
/// (the mat-vecs: one instruction a value fewer, within an ulp of the value).
template <bool EXACT> __device__ __forceinline__ void q4k_values(const Q4kChunk& c, float (&w)[16]) {
    float d1, m1;
    q4k_scale_min(c.head, c.sub, d1, m1);
    const uint32_t words[4] = {c.qs.x, c.qs.y, c.qs.z, c.qs.w};
    const int shift = 4 * (c.sub & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t nibbles = (words[i] >> shift) & 0x0f0f0f0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float q = byte_as_float(nibbles, j);
            w[4 * i + j] = EXACT ? __fsub_rn(__fmul_rn(d1, q), m1) : fmaf(d1, q, -m1);
        }
    }
}

template <> __device__ __forceinline__ float decode_half<Q4_K>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    q4k_values<true>(q4k_load(b, ib, h), w);
    return 1.0f;
}

/// Sub-block `ib` (0..7; IQ4_NL: 0) of the block at `b` into `w`.
// Q6_K (ggml's block_q6_K, 210 bytes: a row's blocks are 2-byte aligned, read in 16-bit loads): 128 bytes `ql`
// of low nibbles, 64 bytes `qh` of high bit pairs, 16 signed 8-bit scales (one per 16 values), f16 `d` last.
// Sub-block ib (32 values) is quarter j = ib % 4 of half ib / 4: its value l is ql[64·half + 32·(j % 2) + l]'s
// nibble j / 2 with qh[32·half + l]'s bits 2j .. 2j + 1 above it, minus 32; values 16h .. 16h + 15 have scale
// d·sc[8·half + 2j + h] (ggml's order: d·sc, then times the value).

/// What one 16-value chunk of a Q6_K block reads: 16 bytes of `ql`, 16 of `qh` (as 16-bit words), its scale
/// byte and the block's `d`.
struct Q6kChunk {
    uint16_t ql[8], qh[8];
    uint16_t d;
    uint8_t sc;
    int j;
};

/// Half `h` of sub-block `ib` of the Q6_K block at `b`.
__device__ __forceinline__ Q6kChunk q6k_load(const uint8_t* b, int ib, int h) {
    const int half = ib / 4, j = ib % 4;
    const uint16_t* ql = reinterpret_cast<const uint16_t*>(b + 64 * half + 32 * (j % 2) + 16 * h);
    const uint16_t* qh = reinterpret_cast<const uint16_t*>(b + 128 + 32 * half + 16 * h);
    Q6kChunk c;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        c.ql[i] = __ldg(ql + i);
        c.qh[i] = __ldg(qh + i);
    }
    c.d = __ldg(reinterpret_cast<const uint16_t*>(b + 208));
    c.sc = __ldg(b + 192 + 8 * half + 2 * j + h);
    c.j = j;
    return c;
}

/// The chunk's 16 values q − 32 before their scale, and the scale d·sc.
__device__ __forceinline__ float q6k_values(const Q6kChunk& c, float (&w)[16]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t low = static_cast<uint32_t>(c.ql[2 * i]) | (static_cast<uint32_t>(c.ql[2 * i + 1]) << 16);
        const uint32_t high = static_cast<uint32_t>(c.qh[2 * i]) | (static_cast<uint32_t>(c.qh[2 * i + 1]) << 16);
        const uint32_t q = ((low >> (4 * (c.j / 2))) & 0x0f0f0f0f) | (((high >> (2 * c.j)) & 0x03030303) << 4);
#pragma unroll
        for (int k = 0; k < 4; ++k)
            // Byte k as the low mantissa byte of 2^23, minus 2^23 + 32: q − 32 exactly.
            w[4 * i + k] = __uint_as_float(__byte_perm(q, 0x4b000000, 0x7540 + k)) - 8388640.0f;
    }
    return __half2float(__ushort_as_half(c.d)) * static_cast<float>(static_cast<int8_t>(c.sc));
}

template <> __device__ __forceinline__ float decode_half<Q6_K>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    return q6k_values(q6k_load(b, ib, h), w);
}

// Q2_K, Q3_K, Q5_K (ggml's block_q2_K / q3_K / q5_K: 84, 110 and 176 bytes), read byte by byte as the
// i-quants are. Sub-block ib (32 values) of a block of 256: for the 2-bit values of Q2_K and Q3_K, value
// 128g + 32s + l is bits 2s of byte 32g + l (g = ib / 4, s = ib % 4); each 16 values have their own scale.

// Q2_K: 16 bytes of scale (low nibble) and min (high) per 16 values, 64 bytes of 2-bit values, d, dmin.
// A value is (d·sc)·q − dmin·m, given whole (scale 1).
template <> __device__ __forceinline__ float decode_half<Q2_K>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const int g = ib / 4, s = ib % 4;
    const uint32_t sm = __ldg(b + 8 * g + 2 * s + h);
    const float dl = f16_at(b, 80) * static_cast<float>(sm & 0xf);
    const float ml = f16_at(b, 82) * static_cast<float>(sm >> 4);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float q = static_cast<float>((__ldg(b + 16 + 32 * g + 16 * h + j) >> (2 * s)) & 3);
        w[j] = __fsub_rn(__fmul_rn(dl, q), ml);
    }
    return 1.0f;
}

// Q5_K: d, dmin and 12 bytes of scales and mins as Q4_K's, 32 bytes of fifth bits (value v's is bit v / 32
// of byte v % 32), 128 bytes of 4-bit values as Q4_K's. A value is d1·q − m1 (d1 = d·sc, m1 = dmin·m).
template <> __device__ __forceinline__ float decode_half<Q5_K>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    const uint4 head = {u32_at(b, 0), u32_at(b, 4), u32_at(b, 8), u32_at(b, 12)};
    float d1, m1;
    q4k_scale_min(head, ib, d1, m1);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int l = 16 * h + j;
        const uint32_t low = (__ldg(b + 48 + 32 * (ib / 2) + l) >> (4 * (ib % 2))) & 0xf;
        const uint32_t fifth = (__ldg(b + 16 + l) >> ib) & 1;
        w[j] = __fsub_rn(__fmul_rn(d1, static_cast<float>(low | (fifth << 4))), m1);
    }
    return 1.0f;
}

template <Format F> __device__ __forceinline__ void decode(const uint8_t* b, int ib, float (&w)[32]) {
    float half_values[16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float scale = decode_half<F>(b, ib, h, half_values);
#pragma unroll
        for (int j = 0; j < 16; ++j) w[16 * h + j] = scale * half_values[j];
    }
}

/// Bytes of a row of `k` values.
template <Format F> __device__ __forceinline__ size_t row_bytes(int k) {
    return static_cast<size_t>(k / Traits<F>::VALUES) * Bytes<F>::value;
}

/// The block holding sub-block `sb` of a row, and the sub-block's index in it.
template <Format F> __device__ __forceinline__ const uint8_t* block_of(const uint8_t* row, int sb, int& ib) {
    constexpr int SUBS = Traits<F>::VALUES / 32;
    ib = sb % SUBS;
    return row + static_cast<size_t>(sb / SUBS) * Bytes<F>::value;
}

/// The 16-value chunks of a row, in value order (chunk c: half c % 2 of sub-block c / 2), as the mat-vecs
/// stream them: `load` issues a chunk's loads, so that `UNROLL` chunks are in flight before the first is
/// decoded; `decode` gives its values before their scale, and the scale (`decode_half`). The i-quants' loads
/// happen in `decode`, byte by byte (their blocks are 2-byte aligned at best).
template <Format F> struct Chunks {
    static constexpr int UNROLL = 2;
    struct Chunk {
        const uint8_t* block;
        int ib;
        int h;
    };
    static __device__ __forceinline__ Chunk load(const uint8_t* row, int c) {
        int ib;
        const uint8_t* block = block_of<F>(row, c / 2, ib);
        return {block, ib, c % 2};
    }
    static __device__ __forceinline__ float decode(const Chunk& chunk, float (&w)[16]) {
        return decode_half<F>(chunk.block, chunk.ib, chunk.h, w);
    }
};

/// Q6_K: sixteen 16-bit loads a chunk (with its scale and `d`), four chunks in flight.
template <> struct Chunks<Q6_K> {
    static constexpr int UNROLL = 4;
    using Chunk = Q6kChunk;
    static __device__ __forceinline__ Chunk load(const uint8_t* row, int c) {
        int ib;
        const uint8_t* block = block_of<Q6_K>(row, c / 2, ib);
        return q6k_load(block, ib, c % 2);
    }
    static __device__ __forceinline__ float decode(const Chunk& chunk, float (&w)[16]) {
        return q6k_values(chunk, w);
    }
};

/// Q2_K: a chunk's 16 bytes of 2-bit values as four 32-bit loads (its 84-byte blocks are 4-byte aligned),
/// its scale byte and the block's d and dmin; values (d·sc)·q − dmin·m in one fma each (the mat-vecs; within
/// an ulp of ggml's two roundings).
template <> struct Chunks<Q2_K> {
    static constexpr int UNROLL = 4;
    struct Chunk {
        uint32_t qs[4];
        uint32_t scales;  // d | dmin << 16 (f16 bits)
        uint32_t sm;
        int shift;
    };
    static __device__ __forceinline__ Chunk load(const uint8_t* row, int c) {
        int ib;
        const uint8_t* b = block_of<Q2_K>(row, c / 2, ib);
        const int g = ib / 4, s = ib % 4, h = c % 2;
        const uint32_t* qs = reinterpret_cast<const uint32_t*>(b + 16 + 32 * g + 16 * h);
        Chunk chunk;
#pragma unroll
        for (int i = 0; i < 4; ++i) chunk.qs[i] = __ldg(qs + i);
        chunk.scales = __ldg(reinterpret_cast<const uint32_t*>(b + 80));
        chunk.sm = __ldg(b + 8 * g + 2 * s + h);
        chunk.shift = 2 * s;
        return chunk;
    }
    static __device__ __forceinline__ float decode(const Chunk& c, float (&w)[16]) {
        const float dl = __half2float(__ushort_as_half(static_cast<uint16_t>(c.scales & 0xffff))) *
                         static_cast<float>(c.sm & 0xf);
        const float ml = __half2float(__ushort_as_half(static_cast<uint16_t>(c.scales >> 16))) *
                         static_cast<float>(c.sm >> 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t q = (c.qs[i] >> c.shift) & 0x03030303;
#pragma unroll
            for (int k = 0; k < 4; ++k) w[4 * i + k] = fmaf(dl, byte_as_float(q, k), -ml);
        }
        return 1.0f;
    }
};

/// Q3_K: a chunk's 16 bytes of low bits and 16 of high bits as 16-bit loads (its 110-byte blocks are 2-byte
/// aligned), its scale's two bytes and d; values q − 4·!h before the scale d·(sc − 32).
template <> struct Chunks<Q3_K> {
    static constexpr int UNROLL = 4;
    struct Chunk {
        uint16_t low[8], high[8];
        uint16_t d;
        uint8_t scale_low, scale_high;
        int ib, i;
    };
    static __device__ __forceinline__ Chunk load(const uint8_t* row, int c) {
        int ib;
        const uint8_t* b = block_of<Q3_K>(row, c / 2, ib);
        return at(b, ib, c % 2);
    }
    /// Half `h` of sub-block `ib` of the block at `b`.
    static __device__ __forceinline__ Chunk at(const uint8_t* b, int ib, int h) {
        const int g = ib / 4, i = 2 * ib + h;
        const uint16_t* low = reinterpret_cast<const uint16_t*>(b + 32 + 32 * g + 16 * h);
        const uint16_t* high = reinterpret_cast<const uint16_t*>(b + 16 * h);
        Chunk chunk;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            chunk.low[j] = __ldg(low + j);
            chunk.high[j] = __ldg(high + j);
        }
        chunk.d = __ldg(reinterpret_cast<const uint16_t*>(b + 108));
        chunk.scale_low = __ldg(b + 96 + i % 8);
        chunk.scale_high = __ldg(b + 104 + i % 4);
        chunk.ib = ib;
        chunk.i = i;
        return chunk;
    }
    static __device__ __forceinline__ float decode(const Chunk& c, float (&w)[16]) {
        const int s = c.ib % 4;
        const uint32_t sc = ((c.scale_low >> (4 * (c.i / 8))) & 0xf) | (((c.scale_high >> (2 * (c.i / 4))) & 3) << 4);
        const float dl = __half2float(__ushort_as_half(c.d)) * static_cast<float>(static_cast<int>(sc) - 32);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t low = static_cast<uint32_t>(c.low[2 * j]) | (static_cast<uint32_t>(c.low[2 * j + 1]) << 16);
            const uint32_t high =
                static_cast<uint32_t>(c.high[2 * j]) | (static_cast<uint32_t>(c.high[2 * j + 1]) << 16);
            // q + 4·h in 0..7 per byte, minus 4: q − 4·!h.
            const uint32_t q = ((low >> (2 * s)) & 0x03030303) | (((high >> c.ib) & 0x01010101) << 2);
#pragma unroll
            for (int k = 0; k < 4; ++k) w[4 * j + k] = byte_as_float(q, k) - 4.0f;
        }
        return dl;
    }
};

// Q3_K: 32 bytes of high bits (value v's is bit v / 32 of byte v % 32: set +0, clear −4), 64 bytes of 2-bit
// values, 12 bytes of 16 6-bit scales (scale i: the nibble of byte i % 8 at bit 4·(i / 8), with bits
// 2·(i / 4) of byte 8 + i % 4 above it, minus 32), d. A value is (d·(sc − 32))·q: the mat-vec's chunk, which
// rounds nothing before the scale, is the dequantiser too.
template <> __device__ __forceinline__ float decode_half<Q3_K>(const uint8_t* b, int ib, int h, float (&w)[16]) {
    return Chunks<Q3_K>::decode(Chunks<Q3_K>::at(b, ib, h), w);
}

/// Q5_K: three 16-byte loads a chunk (its 176-byte blocks are 16-byte aligned): the head (d, dmin, scales), the
/// 16 bytes of low nibbles and the 16 of fifth bits; values d1·q − m1 in one fma each.
template <> struct Chunks<Q5_K> {
    static constexpr int UNROLL = 4;
    struct Chunk {
        uint4 head, qs, qh;
        int ib;
    };
    static __device__ __forceinline__ Chunk load(const uint8_t* row, int c) {
        int ib;
        const uint8_t* b = block_of<Q5_K>(row, c / 2, ib);
        const uint4* v = reinterpret_cast<const uint4*>(b);
        const int h = c % 2;
        return {__ldg(v), __ldg(v + 3 + 2 * (ib / 2) + h), __ldg(v + 1 + h), ib};
    }
    static __device__ __forceinline__ float decode(const Chunk& c, float (&w)[16]) {
        float d1, m1;
        q4k_scale_min(c.head, c.ib, d1, m1);
        const uint32_t qs[4] = {c.qs.x, c.qs.y, c.qs.z, c.qs.w}, qh[4] = {c.qh.x, c.qh.y, c.qh.z, c.qh.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t q = ((qs[i] >> (4 * (c.ib % 2))) & 0x0f0f0f0f) | (((qh[i] >> c.ib) & 0x01010101) << 4);
#pragma unroll
            for (int k = 0; k < 4; ++k) w[4 * i + k] = fmaf(d1, byte_as_float(q, k), -m1);
        }
        return 1.0f;
    }
};

/// Q4_K: two 16-byte loads a chunk, four chunks in flight (64 bytes a lane, as the FP8 mat-vec).
template <> struct Chunks<Q4_K> {
    static constexpr int UNROLL = 4;
    using Chunk = Q4kChunk;
    static __device__ __forceinline__ Chunk load(const uint8_t* row, int c) {
        int ib;
        const uint8_t* block = block_of<Q4_K>(row, c / 2, ib);
        return q4k_load(block, ib, c % 2);
    }
    static __device__ __forceinline__ float decode(const Chunk& chunk, float (&w)[16]) {
        q4k_values<false>(chunk, w);
        return 1.0f;
    }
};

}  // namespace gguf
}  // namespace glm5
