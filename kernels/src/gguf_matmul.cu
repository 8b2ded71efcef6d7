// Weight-only matmuls over the GGUF block formats glm5 decodes (llama.cpp's i-quants and K-quants):
// y[m, n] = sum_k x[m, k] * W[n, k], W kept as the GGUF file's blocks in global memory and decoded in
// registers, f32 accumulation (contract: glm5-ops gguf_matmul/mod.rs; decoders: gguf_formats.cuh).
//
//   gguf_matvec[_r1]_<format>_<dtype> rows m <= MAX_ROWS (_r1: m = 1, batch-1 decode, without the other row
//                                   slots' tests): a group of warps per output column n (ColumnSplit in
//                                   weight_formats.cuh); its threads decode the column's 16-value chunks
//                                   (`Chunks` in gguf_formats.cuh, several in flight) and multiply each with
//                                   all m activation rows, so every weight byte is read once.
//   q4k_mma_matvec{8,16}_bf16       Q4_K, bf16 rows m <= 8 / 16, on the tensor cores (below).
//   q4k_mma_matvec1_bf16            Q4_K, one bf16 row, on the tensor cores (q4k_mma::row, below).
//   gguf_dequantize_<format>_<dtype>  the whole W in the activations' dtype (one thread per sub-block), for
//                                   the many-row (prefill) path's matmul.

#include <cuda_bf16.h>
#include <stdint.h>

#include "glm5_interface.h"
#include "bf16_mma.cuh"
#include "gguf_formats.cuh"
#include "q4k_mma.cuh"
#include "weight_formats.cuh"

using namespace glm5;
using namespace glm5::gguf;

constexpr int MAX_ROWS = GLM5_WEIGHT_ONLY_MAX_ROWS;
constexpr int WARPS = GLM5_WEIGHT_ONLY_WARPS;
constexpr int DEQUANTIZE_THREADS = GLM5_WEIGHT_ONLY_DEQUANTIZE_THREADS;

template <Format F, int ROWS, typename T>
__device__ __forceinline__ void gguf_matvec(const T* __restrict__ x, const uint8_t* __restrict__ w, T* __restrict__ y,
                                          int m, int n, int k, int column_warps) {
    using C = Chunks<F>;
    const ColumnSplit at = column_split<WARPS>(column_warps);
    // A group past the last column reads nothing but still meets the barrier in store_split_rows.
    const int chunks = at.col < n ? k / 16 : 0;
    const uint8_t* row = w + static_cast<size_t>(at.col < n ? at.col : 0) * row_bytes<F>(k);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    for (int c0 = at.first; c0 < chunks; c0 += at.stride * C::UNROLL) {
        typename C::Chunk chunk[C::UNROLL];
#pragma unroll
        for (int u = 0; u < C::UNROLL; ++u) {
            const int c = c0 + at.stride * u;
            if (c < chunks) chunk[u] = C::load(row, c);
        }
#pragma unroll
        for (int u = 0; u < C::UNROLL; ++u) {
            const int c = c0 + at.stride * u;
            if (c < chunks) {
                // The chunk's values before their scale, which multiplies each row's sum of 16 products once.
                float wv[16];
                const float scale = C::decode(chunk[u], wv);
                accumulate<ROWS>(acc, wv, scale, x, m, k, 16 * c);
            }
        }
    }
    store_split_rows<WARPS>(acc, at, column_warps, y, m, n);
}

template <Format F, typename T>
__device__ __forceinline__ void gguf_dequantize(const uint8_t* __restrict__ w, T* __restrict__ out, int n, int k) {
    const int subs = k / 32;
    const size_t total = static_cast<size_t>(n) * subs;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int r = static_cast<int>(i / subs), sb = static_cast<int>(i % subs);
        int ib;
        const uint8_t* block = block_of<F>(w + static_cast<size_t>(r) * row_bytes<F>(k), sb, ib);
        float wv[32];
        decode<F>(block, ib, wv);
        store_values(out + static_cast<size_t>(r) * k + 32 * sb, wv);
    }
}

// ---- Q4_K on the tensor cores ---------------------------------------------------------------------------
//
// q4k_mma_matvec{8,16}_bf16: Q4_K times bf16 activations, m <= 8 or <= 16 rows (one or two mma N tiles), on the
// tensor cores (q4k_mma.cuh). A block of `blockDim.x / 32` warps owns 16 output rows; its warps split the
// rows' blocks (`accumulate_warp_blocks`) and meet in shared memory.

template <int TILES>
__device__ __forceinline__ void q4k_mma_matvec(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                                               __nv_bfloat16* __restrict__ y, int m, int n, int k) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int blocks = k / 256, row0 = blockIdx.x * 16;
    const uint8_t* rows[2];
    q4k_mma::tile_rows(w, row0, n, k, g, rows);
    const __nv_bfloat16* x_rows[TILES];
#pragma unroll
    for (int j = 0; j < TILES; ++j) x_rows[j] = 8 * j + g < m ? x + static_cast<size_t>(8 * j + g) * k : nullptr;
    float acc[TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
    q4k_mma::accumulate_warp_blocks(rows, x_rows, warp, warps, blocks, t, acc);
    q4k_mma::sum_over_warps(acc);
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + g + 8 * (i / 2), xrow = 8 * j + 2 * t + i % 2;
            if (row < n && xrow < m) y[static_cast<size_t>(xrow) * n + row] = __float2bfloat16(acc[j][i]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(q4k_mma::MAX_WARPS * 32)
    q4k_mma_matvec8_bf16(const __nv_bfloat16* x, const uint8_t* w, __nv_bfloat16* y, int m, int n, int k) {
    q4k_mma_matvec<1>(x, w, y, m, n, k);
}
extern "C" __global__ void __launch_bounds__(q4k_mma::MAX_WARPS * 32)
    q4k_mma_matvec16_bf16(const __nv_bfloat16* x, const uint8_t* w, __nv_bfloat16* y, int m, int n, int k) {
    q4k_mma_matvec<2>(x, w, y, m, n, k);
}

// q4k_mma_matvec1_bf16: one bf16 activation row (q4k_mma::row), launched as a programmatic dependent of the
// step's previous kernel: a block of `blockDim.x / 32` warps owns 16 output rows at a time; its warps issue their
// first blocks' loads (weights only, so they overlap the previous kernel's tail), wait for that kernel (x is its
// output), stage x in shared memory (`row::staged_bytes(k)` of dynamic shared memory), split the rows' blocks
// and meet in shared memory. Past as many tiles as the device holds blocks (`tile_loop_blocks`), a block walks
// tiles `blockIdx.x`, `+ gridDim.x`, ...: x is staged once a block, and each warp issues its next tile's first
// loads before the warps meet. H100, GLM-5's dense gate/up [24576, 6144]: 38.4 -> 36.5 us against a block a
// tile. One block's loads in flight ahead of the one a warp multiplies: 78 registers, so three blocks of 8
// warps share a multiprocessor; two ahead take two blocks (the step's 24 mat-vecs 499 -> 529 us, H100).
constexpr int ROW_DEPTH = 1;

struct Q4kRowParams {
    const __nv_bfloat16* x;
    const uint8_t* w;
    __nv_bfloat16* y;
    int n, k;
};
GLM5_CHECK_Q4kRowParams();  // the layout of kernels/src/interface.rs

extern "C" __global__ void __launch_bounds__(q4k_mma::MAX_WARPS * 32) q4k_mma_matvec1_bf16(Q4kRowParams p) {
    extern __shared__ __align__(16) uint8_t staged[];
    allow_dependent_grids();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int tiles = (p.n + 15) / 16, blocks = p.k / 256;
    const uint8_t* rows[2];
    q4k_mma::tile_rows(p.w, blockIdx.x * 16, p.n, p.k, g, rows);
    q4k_mma::row::Stream<ROW_DEPTH> stream;
    stream.start(rows, warp, warps, blocks, t);
    wait_for_prior_grid();
    q4k_mma::row::stage(p.x, staged, p.k);
    // The tile is the block's alone, so every thread leaves the loop together (sum_over_warps' barriers).
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float acc = 0.0f;
        stream.run(staged, p.k, warp, warps, g, t, acc);
        if (tile + gridDim.x < tiles) {
            q4k_mma::tile_rows(p.w, (tile + gridDim.x) * 16, p.n, p.k, g, rows);
            stream.start(rows, warp, warps, blocks, t);
        }
        const float sum = q4k_mma::row::sum_over_warps(acc, 0, 1);
        const int out = tile * 16 + g + 8 * (t / 2);
        if (warp == 0 && t % 2 == 0 && out < p.n) p.y[out] = __float2bfloat16(sum);
    }
}

#define GGUF_KERNELS(NAME, F, SUFFIX, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        gguf_matvec_##NAME##_##SUFFIX(const T* x, const uint8_t* w, T* y, int m, int n, int k,                 \
                                    int column_warps) {                                                       \
        gguf_matvec<F, MAX_ROWS, T>(x, w, y, m, n, k, column_warps);                                            \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                  \
        gguf_matvec_r1_##NAME##_##SUFFIX(const T* x, const uint8_t* w, T* y, int m, int n, int k,              \
                                       int column_warps) {                                                    \
        gguf_matvec<F, 1, T>(x, w, y, m, n, k, column_warps);                                                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(DEQUANTIZE_THREADS)                                          \
        gguf_dequantize_##NAME##_##SUFFIX(const uint8_t* w, T* out, int n, int k) {                            \
        gguf_dequantize<F, T>(w, out, n, k);                                                                    \
    }

#define GGUF_FORMAT(NAME, F)                   \
    GGUF_KERNELS(NAME, F, f32, float)          \
    GGUF_KERNELS(NAME, F, bf16, __nv_bfloat16)

GGUF_FORMAT(iq2_xxs, IQ2_XXS)
GGUF_FORMAT(iq2_xs, IQ2_XS)
GGUF_FORMAT(iq2_s, IQ2_S)
GGUF_FORMAT(iq3_xxs, IQ3_XXS)
GGUF_FORMAT(iq3_s, IQ3_S)
GGUF_FORMAT(iq1_s, IQ1_S)
GGUF_FORMAT(iq1_m, IQ1_M)
GGUF_FORMAT(iq4_nl, IQ4_NL)
GGUF_FORMAT(iq4_xs, IQ4_XS)
GGUF_FORMAT(q4_k, Q4_K)
GGUF_FORMAT(q6_k, Q6_K)
GGUF_FORMAT(q2_k, Q2_K)
GGUF_FORMAT(q3_k, Q3_K)
GGUF_FORMAT(q5_k, Q5_K)
