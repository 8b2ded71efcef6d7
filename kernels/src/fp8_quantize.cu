// The activations' per-token FP8 quantiser of fp8_matmul's W8A8 prefill backend (`fp8-w8a8-cublaslt-block`;
// contract: glm5-ops fp8_matmul/mod.rs, "W8A8"; CPU reference: fp8_matmul/reference.rs,
// `quantize_activations`). Plain CUDA C++: no inline assembly, no asynchronous copies, only the fp8 / bf16
// conversion functions of the toolkit's headers.
//
//   fp8_quantize_rows_*  x [m, k] (f32 / bf16, k a multiple of GROUP = 128) to e4m3 codes and one f32 scale
//                        per token and group of 128 values along k, one warp per group:
//                          amax  = max |x| over the group (NaN values ignored, as fmaxf does),
//                          scale = max(amax / 448, 2^-126),
//                          code  = e4m3(x / scale), round to nearest even, saturating to +-448
//                                  (__NV_SATFINITE; a NaN gives the NaN code 0x7f),
//                        each division a correctly rounded f32 one (nvcc's default -prec-div=true). Rows
//                        m..m_pad (the padding to a multiple of ROW_MULTIPLE = 16 rows that cuBLASLt needs)
//                        get zero codes at scale 2^-126, as an all-zero group.
//
// Why these choices: 448 maps the group's largest value to e4m3's largest; the floor 2^-126 (f32's smallest
// normal value) keeps a zero group, or one of values so small that amax / 448 underflows, from dividing by
// zero or by a subnormal; division rather than a multiplication by 1/scale because it is what the CPU
// reference does in one correctly rounded step, so the two agree bit for bit.
//
// Output layout, as cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F takes the activations when they are
// its B operand (cuBLAS documentation, "128-element 1D and 128x128 2D Block Scaling For FP8 Data Types" →
// "Scaling factors layouts": for B the scaling factors are "N-major ... with shape N x L", L = ceil(K / 128),
// N-major meaning the N elements are contiguous): codes [m_pad, k] row-major (cuBLASLt's B is K x N
// column-major with ld = k: the same bytes), scales [k / 128, m_pad] with the tokens contiguous. Scale
// addresses must be 16-byte aligned: the launcher allocates them fresh.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "glm5_interface.h"

struct Fp8QuantizeParams {
    const void* x;    // [m, k] f32 or bf16
    uint8_t* codes;   // [m_pad, k]: e4m3 codes
    float* scales;    // [k / GROUP, m_pad]: one scale per token and group, the tokens contiguous
    int m, m_pad, k;
};
GLM5_CHECK_Fp8QuantizeParams();  // the layout of kernels/src/interface.rs

constexpr int GROUP = GLM5_FP8_QUANTIZE_GROUP;
constexpr int THREADS = GLM5_FP8_QUANTIZE_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int PER_LANE = GROUP / 32;
static_assert(GROUP % 32 == 0, "a warp per group, the same number of values per lane");
static_assert(THREADS % 32 == 0, "whole warps");

constexpr float E4M3_MAX = 448.0f;
constexpr float MIN_SCALE = 1.17549435e-38f;  // 2^-126

__device__ __forceinline__ float load(const float* x, int i) { return __ldg(x + i); }
__device__ __forceinline__ float load(const __nv_bfloat16* x, int i) { return __bfloat162float(__ldg(x + i)); }

template <typename T>
__device__ __forceinline__ void quantize_groups(const Fp8QuantizeParams& p) {
    const int lane = threadIdx.x % 32;
    const int groups_per_row = p.k / GROUP;
    const long long group = static_cast<long long>(blockIdx.x) * WARPS + threadIdx.x / 32;
    if (group >= static_cast<long long>(p.m_pad) * groups_per_row) return;  // the whole warp
    const int row = static_cast<int>(group / groups_per_row);
    const int g = static_cast<int>(group % groups_per_row);
    uint8_t* codes = p.codes + static_cast<size_t>(row) * p.k + static_cast<size_t>(g) * GROUP;
    float* scale_out = p.scales + static_cast<size_t>(g) * p.m_pad + row;
    if (row >= p.m) {
        // A padding row: an all-zero group.
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) codes[lane + 32 * j] = 0;
        if (lane == 0) *scale_out = MIN_SCALE;
        return;
    }
    const T* x = static_cast<const T*>(p.x) + static_cast<size_t>(row) * p.k + static_cast<size_t>(g) * GROUP;
    float v[PER_LANE];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        v[j] = load(x, lane + 32 * j);
        amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float scale = fmaxf(amax / E4M3_MAX, MIN_SCALE);
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        codes[lane + 32 * j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v[j] / scale, __NV_SATFINITE, __NV_E4M3));
    }
    if (lane == 0) *scale_out = scale;
}

extern "C" __global__ void __launch_bounds__(THREADS) fp8_quantize_rows_f32(const Fp8QuantizeParams p) {
    quantize_groups<float>(p);
}

extern "C" __global__ void __launch_bounds__(THREADS) fp8_quantize_rows_bf16(const Fp8QuantizeParams p) {
    quantize_groups<__nv_bfloat16>(p);
}
