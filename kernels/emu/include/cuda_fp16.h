// Host versions of the parts of CUDA's cuda_fp16.h the emulated kernels use (emulator: ../cuda_emu.h).
// Conversions are exact or round to nearest even, as CUDA's.
#pragma once

#include <stdint.h>
#include <string.h>

#include "vector_types.h"

struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };

struct __half {
    unsigned short __x;
    __half() = default;
    __half(__half_raw raw) : __x(raw.x) {}
    operator __half_raw() const { return {__x}; }
};

struct alignas(4) __half2 {
    __half x, y;
    __half2() = default;
    __half2(__half2_raw raw) {
        x.__x = raw.x;
        y.__x = raw.y;
    }
};

inline float glm5_emu_bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
inline uint32_t glm5_emu_float_to_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return bits;
}

inline float __half2float(__half h) {
    const uint32_t sign = static_cast<uint32_t>(h.__x & 0x8000u) << 16;
    const uint32_t exponent = (h.__x >> 10) & 0x1fu, mantissa = h.__x & 0x3ffu;
    if (exponent == 0) {
        // Zero or subnormal: mantissa · 2^-24, exact in f32.
        const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31) return glm5_emu_bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    return glm5_emu_bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline __half __ushort_as_half(unsigned short bits) {
    __half h;
    h.__x = bits;
    return h;
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }

inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }

/// f32 to f16, round to nearest even, overflow to infinity.
inline __half __float2half(float f) {
    const uint32_t bits = glm5_emu_float_to_bits(f);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t abs = bits & 0x7fffffffu;
    if (abs >= 0x7f800000u) return __ushort_as_half(sign | (abs > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (abs >= 0x477ff000u) return __ushort_as_half(sign | 0x7c00);  // rounds to >= 65520: infinity
    if (abs < 0x38800000u) {
        // Subnormal half (or zero): the value in units of 2^-24, rounded to nearest even.
        const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
        const int shift = 126 - static_cast<int>(abs >> 23);  // 113 - exponent + 13
        if (shift > 24) return __ushort_as_half(sign);
        const uint32_t q = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
        const uint32_t rounded = q + ((rest > half || (rest == half && (q & 1))) ? 1 : 0);
        return __ushort_as_half(static_cast<uint16_t>(sign | rounded));
    }
    const uint32_t rebased = abs - (112u << 23);
    const uint32_t q = rebased >> 13, rest = rebased & 0x1fffu;
    const uint32_t rounded = q + ((rest > 0x1000u || (rest == 0x1000u && (q & 1))) ? 1 : 0);
    return __ushort_as_half(static_cast<uint16_t>(sign | rounded));
}
