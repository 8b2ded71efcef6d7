// Host versions of the parts of CUDA's cuda_fp8.h the emulated kernels use (emulator: ../cuda_emu.h): e4m3
// (OCP "fn": no infinities, S.1111.111 is NaN, largest finite 448) and e5m2.
#pragma once

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_fp16.h"

[[noreturn]] inline void glm5_emu_unsupported(const char* what) {
    fprintf(stderr, "CUDA emulator: %s is not emulated\n", what);
    abort();
}

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t kind) {
    if (kind == __NV_E5M2) return {static_cast<unsigned short>(x << 8)};
    const unsigned short sign = static_cast<unsigned short>((x & 0x80u) << 8);
    const unsigned exponent = (x >> 3) & 0xfu, mantissa = x & 7u;
    if (exponent == 15 && mantissa == 7) return {static_cast<unsigned short>(sign | 0x7fff)};
    if (exponent == 0) {
        if (mantissa == 0) return {sign};
        // mantissa · 2^-9 with its leading bit at 2^p: the half 2^(p-9) · (1 + rest / 2^p).
        const unsigned p = mantissa >= 4 ? 2 : mantissa >= 2 ? 1 : 0;
        const unsigned rest = mantissa - (1u << p);
        return {static_cast<unsigned short>(sign | ((p + 6) << 10) | (rest << (10 - p)))};
    }
    return {static_cast<unsigned short>(sign | ((exponent + 8) << 10) | (mantissa << 7))};
}

inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t kind) {
    return {__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(x & 0xff), kind).x,
            __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(x >> 8), kind).x};
}

/// f32 to e4m3, round to nearest even; beyond 448 saturates (`__NV_SATFINITE`) or gives NaN.
inline __nv_fp8_storage_t glm5_emu_float_to_e4m3(float f, __nv_saturation_t saturate) {
    if (isnan(f)) return 0x7f;
    const unsigned char sign = signbit(f) ? 0x80 : 0;
    const double a = fabs(static_cast<double>(f));
    // The step between e4m3 values around a: 2^-9 below 2^-6 (subnormals), else 2^(exponent - 3).
    int exponent;
    frexp(a, &exponent);  // a = frac · 2^exponent, frac in [0.5, 1)
    const int e = exponent - 1 < -6 ? -6 : exponent - 1;
    const double step = ldexp(1.0, e - 3);
    const double q = nearbyint(a / step) * step;  // the default rounding mode: to nearest even
    if (q > 448.0) return saturate == __NV_SATFINITE ? (sign | 0x7e) : 0x7f;
    if (q < ldexp(1.0, -6)) return sign | static_cast<unsigned char>(q / ldexp(1.0, -9));
    int qe;
    const double qf = frexp(q, &qe);  // q = qf · 2^qe
    const unsigned mantissa = static_cast<unsigned>((qf * 2.0 - 1.0) * 8.0);
    return sign | static_cast<unsigned char>(((qe - 1 + 7) << 3) | mantissa);
}

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float f, __nv_saturation_t saturate,
                                               __nv_fp8_interpretation_t kind) {
    if (kind != __NV_E4M3) glm5_emu_unsupported("__nv_cvt_float_to_fp8 to e5m2");
    return glm5_emu_float_to_e4m3(f, saturate);
}
