// Host versions of the parts of CUDA's cuda_bf16.h the emulated kernels use (emulator: ../cuda_emu.h).
#pragma once

#include "cuda_fp16.h"

struct __nv_bfloat16 {
    unsigned short __x;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline float __bfloat162float(__nv_bfloat16 b) { return glm5_emu_bits_to_float(static_cast<uint32_t>(b.__x) << 16); }

/// Round to nearest even; NaN to CUDA's canonical 0x7fff.
inline __nv_bfloat16 __float2bfloat16(float f) {
    const uint32_t bits = glm5_emu_float_to_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
    return {static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

inline float2 __bfloat1622float2(__nv_bfloat162 b) { return {__bfloat162float(b.x), __bfloat162float(b.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float x, float y) { return {__float2bfloat16(x), __float2bfloat16(y)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return {__float2bfloat16(f.x), __float2bfloat16(f.y)}; }
