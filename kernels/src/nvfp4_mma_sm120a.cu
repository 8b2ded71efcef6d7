// NVFP4 x NVFP4 (W4A4) GEMM on sm_120a's block-scaled FP4 tensor-core MMA, for nvfp4_matmul's prefill rows
// (contract: glm5-ops nvfp4_matmul/mod.rs, "W4A4"; CPU reference: nvfp4_matmul/reference.rs). Compiled for
// sm_120a only (kernels/build.rs: `*_sm120a.cu`): `mma ... kind::mxf4nvf4` exists on sm_120a / sm_121a only.
//
//   nvfp4_quantize_rows_*  the activations x [M, K] (f32 / bf16) to NVFP4, one block per row:
//                          row scale g = max(amax_row / (6 * 448), 2^-126) (f32),
//                          block scale s = e4m3_rne(min(amax_16 / (6 * g), 448)),
//                          code = e2m1_rne_satfinite(|x| / (s * g)) with x's sign,
//                          every operation a correctly rounded f32 one, as the CPU reference does it.
//   nvfp4_mma_*            y[m, n] = ((sum_k e2m1(a) * sa * e2m1(w) * sw) * g[m]) * global_w, f32 accumulation
//                          in the tensor cores, written in the activations' dtype.
//
// GEMM structure: a 128 x 128 output tile per block of 8 warps (2 x 4, each 64 x 32: 4 x 4 MMAs of
// m16n8k64), K in steps of 128 values (64 bytes of codes and 8 scale bytes per row), double-buffered in
// shared memory by cp.async (zero-filled past M and N). Rows of codes are padded to 80 bytes so that the
// fragment loads (8 rows x 4 words per instruction) hit 32 distinct banks.
//
// Fragment layouts of mma.m16n8k64 with e2m1 (PTX ISA, "Matrix fragments for mma.m16n8k64"; groupID =
// lane / 4, tig = lane % 4): A (16 x 64, row-major) a0: row groupID, k 8*tig..8*tig+7 (8 nibbles, the
// lowest nibble the lowest k), a1: row groupID + 8, a2/a3: the same rows at k + 32. B (64 x 8, "col", stored
// as [N, K] like the weight) b0: column groupID, k 8*tig.., b1: k + 32. C/D: c0, c1 row groupID, columns
// 2*tig, 2*tig + 1; c2, c3 row groupID + 8. Scales (.scale_vec::4X, ue4m3): a 32-bit register holds one row's
// (column's) four scales, byte j for k 16j..16j+15; byte-id must be 0. With thread-id-a = 0 lanes with
// lane % 4 == 0 give row groupID's scales and lane % 4 == 1 row groupID + 8's; with thread-id-b = 0 lane
// % 4 == 0 gives column groupID's. Every lane here loads the scales of the row (column) it stands for in
// that mapping, so the selectors only pick which copies are read.

#include <cuda_bf16.h>
#include <stdint.h>

#include "fp4_mma_sm120a.cuh"
#include "glm5_interface.h"
#include "weight_formats.cuh"

using namespace glm5;

struct Nvfp4QuantizeParams {
    const void* x;        // [m, k] f32 or bf16, 16-byte aligned
    uint8_t* codes;       // [m, k / 2]: two e2m1 codes a byte, the even column in the low nibble
    uint8_t* scales;      // [m, k / 16]: e4m3 block scales
    float* row_scales;    // [m]: g (NaN for a row holding a non-finite value)
    int m, k;
};
GLM5_CHECK_Nvfp4QuantizeParams();  // the layout of kernels/src/interface.rs

struct Nvfp4MmaParams {
    const uint8_t* a_codes;     // [m, k / 2]
    const uint8_t* a_scales;    // [m, k / 16]
    const float* a_row_scales;  // [m]
    const uint8_t* b_packed;    // [n, k / 2]: the weight's packed e2m1 codes
    const uint8_t* b_scales;    // [n, k / 16]: the weight's e4m3 scales
    void* y;                    // [m, n] f32 or bf16
    int m, n, k;
    float b_global_scale;       // weight_scale_2
};
GLM5_CHECK_Nvfp4MmaParams();

constexpr int GROUP = GLM5_NVFP4_MMA_GROUP;
constexpr int QUANTIZE_THREADS = GLM5_NVFP4_MMA_QUANTIZE_THREADS;
constexpr int BM = GLM5_NVFP4_MMA_TILE_M;
constexpr int BN = GLM5_NVFP4_MMA_TILE_N;
constexpr int BK = GLM5_NVFP4_MMA_TILE_K;
constexpr int THREADS = GLM5_NVFP4_MMA_THREADS;
static_assert(GROUP == 16, "scale_vec::4X: four scales per 64 values");
static_assert(BK == 128, "two m16n8k64 steps per K tile");

constexpr int ROW_BYTES = BK / 2;             // codes of one row per K tile
constexpr int ROW_STRIDE = ROW_BYTES + 16;    // padded: conflict-free fragment loads
constexpr int SCALE_BYTES = BK / GROUP;       // scales of one row per K tile
constexpr int WARPS_M = 2, WARPS_N = 4;
constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
constexpr int MT = WM / 16, NT = WN / 8;
static_assert(WARPS_M * WARPS_N * 32 == THREADS, "one warp per warp tile");
static_assert(BM * ROW_BYTES / 16 == 2 * THREADS && BN * ROW_BYTES / 16 == 2 * THREADS, "two 16-byte copies each");
static_assert(BM + BN == THREADS, "one scale copy each");

constexpr float E4M3_MAX = 448.0f;
constexpr float E2M1_MAX = 6.0f;

// ---------------------------------------------------------------------------------------------------------
// Quantiser

/// The e4m3 code nearest to v (ties to the even code), for 0 <= v <= 448.
__device__ __forceinline__ uint32_t e4m3_rne(float v) {
    if (v < 0x1p-6f) return static_cast<uint32_t>(rintf(__fmul_rn(v, 512.0f)));  // subnormal: steps of 2^-9
    const uint32_t bits = __float_as_uint(v);
    int exponent = static_cast<int>(bits >> 23) - 127;
    const float mantissa = __uint_as_float((bits & 0x7fffffu) | 0x3f800000u);  // [1, 2)
    uint32_t q = static_cast<uint32_t>(rintf(__fmul_rn(__fsub_rn(mantissa, 1.0f), 8.0f)));
    if (q == 8) {
        exponent += 1;
        q = 0;
    }
    return (static_cast<uint32_t>(exponent + 7) << 3) | q;
}

/// The e2m1 magnitude code nearest to r >= 0 on {0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to the even code), 6 above
/// (satfinite).
__device__ __forceinline__ uint32_t e2m1_rne(float r) {
    if (r <= 0.25f) return 0;
    if (r < 0.75f) return 1;
    if (r <= 1.25f) return 2;
    if (r < 1.75f) return 3;
    if (r <= 2.5f) return 4;
    if (r < 3.5f) return 5;
    if (r <= 5.0f) return 6;
    return 7;
}

template <typename T>
__device__ __forceinline__ void quantize_rows(const Nvfp4QuantizeParams& p) {
    const int row = blockIdx.x;
    if (row >= p.m) return;
    const T* x = static_cast<const T*>(p.x) + static_cast<size_t>(row) * p.k;
    float amax = 0.0f;
    int finite = 1;
    for (int c = threadIdx.x; c < p.k; c += blockDim.x) {
        const float a = fabsf(to_float(x[c]));
        finite &= a <= 3.402823466e38f;  // false for inf and NaN
        amax = fmaxf(amax, a);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, offset));
    __shared__ float warp_max[QUANTIZE_THREADS / 32];
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
    const int all_finite = __syncthreads_and(finite);
    amax = 0.0f;
#pragma unroll
    for (int w = 0; w < QUANTIZE_THREADS / 32; ++w) amax = fmaxf(amax, warp_max[w]);
    float g = fmaxf(__fdiv_rn(amax, E2M1_MAX * E4M3_MAX), 0x1p-126f);
    if (!all_finite) g = __int_as_float(0x7fc00000);
    if (threadIdx.x == 0) p.row_scales[row] = g;
    const float block_unit = __fmul_rn(E2M1_MAX, g);
    const int groups = p.k / GROUP;
    for (int b = threadIdx.x; b < groups; b += blockDim.x) {
        float v[16];
        load16(x + b * GROUP, v);
        float bmax = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) bmax = fmaxf(bmax, fabsf(v[j]));
        const uint32_t scale = e4m3_rne(fminf(__fdiv_rn(bmax, block_unit), E4M3_MAX));
        const float unit = __fmul_rn(e4m3_to_float(static_cast<uint8_t>(scale)), g);
        uint32_t words[2] = {0, 0};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const uint32_t magnitude = unit > 0.0f ? e2m1_rne(__fdiv_rn(fabsf(v[j]), unit)) : 0u;
            const uint32_t code = magnitude | (v[j] < 0.0f ? 8u : 0u);
            words[j / 8] |= code << (4 * (j % 8));
        }
        *reinterpret_cast<uint2*>(p.codes + static_cast<size_t>(row) * (p.k / 2) + b * (GROUP / 2)) =
            make_uint2(words[0], words[1]);
        p.scales[static_cast<size_t>(row) * groups + b] = static_cast<uint8_t>(scale);
    }
}

// ---------------------------------------------------------------------------------------------------------
// GEMM

struct __align__(16) Stage {
    uint8_t a[BM * ROW_STRIDE];
    uint8_t b[BN * ROW_STRIDE];
    uint8_t sa[BM * SCALE_BYTES];
    uint8_t sb[BN * SCALE_BYTES];
};

/// Copies K tile `kt` of the block's rows of A and B (codes and scales) into `st` (zeros past m and n).
__device__ __forceinline__ void load_stage(Stage& st, const Nvfp4MmaParams& p, int m0, int n0, int kt) {
    const int tid = threadIdx.x;
    const size_t code_row = static_cast<size_t>(p.k) / 2, scale_row = static_cast<size_t>(p.k) / GROUP;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int chunk = tid + i * THREADS;
        const int r = chunk / (ROW_BYTES / 16), part = chunk % (ROW_BYTES / 16);
        const bool a_ok = m0 + r < p.m, b_ok = n0 + r < p.n;
        const size_t offset = static_cast<size_t>(kt) * ROW_BYTES + part * 16;
        cp_async16(st.a + r * ROW_STRIDE + part * 16, p.a_codes + (a_ok ? (m0 + r) * code_row + offset : 0), a_ok);
        cp_async16(st.b + r * ROW_STRIDE + part * 16, p.b_packed + (b_ok ? (n0 + r) * code_row + offset : 0), b_ok);
    }
    const size_t offset = static_cast<size_t>(kt) * SCALE_BYTES;
    if (tid < BM) {
        const bool ok = m0 + tid < p.m;
        cp_async8(st.sa + tid * SCALE_BYTES, p.a_scales + (ok ? (m0 + tid) * scale_row + offset : 0), ok);
    } else {
        const int r = tid - BM;
        const bool ok = n0 + r < p.n;
        cp_async8(st.sb + r * SCALE_BYTES, p.b_scales + (ok ? (n0 + r) * scale_row + offset : 0), ok);
    }
}

template <typename T>
__device__ __forceinline__ void nvfp4_mma(const Nvfp4MmaParams& p) {
    __shared__ Stage stages[2];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int group = lane / 4, tig = lane % 4;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int ktiles = p.k / BK;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

    load_stage(stages[0], p, m0, n0, 0);
    cp_async_commit();
    for (int kt = 0; kt < ktiles; ++kt) {
        if (kt + 1 < ktiles) {
            load_stage(stages[(kt + 1) & 1], p, m0, n0, kt + 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const Stage& st = stages[kt & 1];
#pragma unroll
        for (int ks = 0; ks < BK / 64; ++ks) {
            uint32_t af[MT][4], sfa[MT], bf[NT][2], sfb[NT];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r = wm * WM + i * 16 + group;
                const uint8_t* q = st.a + r * ROW_STRIDE + ks * 32 + tig * 4;
                af[i][0] = *reinterpret_cast<const uint32_t*>(q);
                af[i][1] = *reinterpret_cast<const uint32_t*>(q + 8 * ROW_STRIDE);
                af[i][2] = *reinterpret_cast<const uint32_t*>(q + 16);
                af[i][3] = *reinterpret_cast<const uint32_t*>(q + 8 * ROW_STRIDE + 16);
                sfa[i] = *reinterpret_cast<const uint32_t*>(st.sa + (r + 8 * (lane & 1)) * SCALE_BYTES + ks * 4);
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int c = wn * WN + j * 8 + group;
                const uint8_t* q = st.b + c * ROW_STRIDE + ks * 32 + tig * 4;
                bf[j][0] = *reinterpret_cast<const uint32_t*>(q);
                bf[j][1] = *reinterpret_cast<const uint32_t*>(q + 16);
                sfb[j] = *reinterpret_cast<const uint32_t*>(st.sb + c * SCALE_BYTES + ks * 4);
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) mma_fp4(acc[i][j], af[i], bf[j], sfa[i], sfb[j]);
        }
        __syncthreads();
    }

    T* y = static_cast<T*>(p.y);
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = m0 + wm * WM + i * 16 + group + 8 * half;
            if (row >= p.m) continue;
            const float g = p.a_row_scales[row];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int col = n0 + wn * WN + j * 8 + 2 * tig;
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (col + c < p.n) {
                        const float v = __fmul_rn(__fmul_rn(acc[i][j][2 * half + c], g), p.b_global_scale);
                        y[static_cast<size_t>(row) * p.n + col + c] = from_float<T>(v);
                    }
                }
            }
        }
    }
}

#define NVFP4_MMA_KERNELS(SUFFIX, T)                                                                           \
    extern "C" __global__ void __launch_bounds__(QUANTIZE_THREADS)                                             \
        nvfp4_quantize_rows_##SUFFIX(const Nvfp4QuantizeParams p) {                                            \
        quantize_rows<T>(p);                                                                                   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mma_##SUFFIX(const Nvfp4MmaParams p) {         \
        nvfp4_mma<T>(p);                                                                                       \
    }

NVFP4_MMA_KERNELS(f32, float)
NVFP4_MMA_KERNELS(bf16, __nv_bfloat16)
