// Sparse absorbed-MLA attention over a paged latent cache (contract: ops/src/sparse_mla/mod.rs).
//
// For query token t (sequence seq = token_seq[t]) and head h:
//   score(k) = scale * q[t,h,:] . row(indices[t,k]),  row(i) = kv[block_table[seq][i / bs] * bs + i % bs]
//   out[t,h,:] = softmax_k(score) . row(indices[t,k])[:DV],  lse[t,h] = ln sum_k exp(score(k))
// Index -1 (or >= seq_lens[seq]) is "no row". Rows are D wide (D % 8 == 0); values are their first DV columns.
//
// bf16 kernel (mma.sync.m16n8k16, f32 accumulate; runs on sm_90 and sm_120): one block handles one token,
// HT tiles of 16 heads and a contiguous range of BN-key tiles (a "split"). It first resolves every slot of its
// split to a physical row (all index and block-table loads in flight together), then streams the tiles
// through a cp.async double buffer. Each group of MW 16-head tiles has KW warps, and they divide every step
// three ways (a warp does its share for all MW tiles, so every key or value fragment it reads from shared
// memory feeds MW mma):
//   S = Q K^T    by row width: warp kw owns every KW-th 16-column step of the row (Q fragments held in
//                registers for the whole split with one head tile per block, read from shared memory per
//                step with four, where registers are short); the KW partial scores meet in shared memory;
//   softmax      by keys: warp kw sums the partials of keys [kw*BN/KW, (kw+1)*BN/KW), the warps agree on
//                the row maxima through shared memory, and each writes its part of P (bf16);
//   O += P V     by value columns: warp kw accumulates columns [kw*DV/KW, (kw+1)*DV/KW).
// So a warp's registers hold a quarter of O (of each of its tiles). With several splits each block writes a
// normalised partial (f32) and its lse; sparse_mla_combine merges them (flash-decoding), or, when the
// launcher made a token's splits one thread-block cluster, they merge in distributed shared memory.
//
// Narrow kernel (at most 8 heads over GLM-5's rows, small batches): keys as the mma's rows, see below.
//
// f32 kernel: plain FMA, one block per (token, head), for full-precision runs.

#include <cuda_bf16.h>
#include <stdint.h>

#include "mma.cuh"
#include "sparse_mla.cuh"

typedef __nv_bfloat16 bf16;

constexpr int BN = GLM5_SPARSE_MLA_TILE;       // keys per tile
constexpr int MAX_SPLITS = GLM5_SPARSE_MLA_MAX_SPLITS;  // most splits of the top-k the combine merges (the launcher caps it)
constexpr int ROW_PAD = GLM5_SPARSE_MLA_ROW_PAD;   // bf16 of padding per shared-memory row: 16 bytes keep ldmatrix conflict-free
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// The log-sum-exp merge of splits (or warps) shared by every merge below: a part's weight relative to the
// largest lse, and the merged lse from that largest and the weights' total (no rows at all: -inf).
__device__ __forceinline__ float split_weight(float lse, float max_lse) {
    return max_lse == -INFINITY ? 0.f : expf(lse - max_lse);
}
__device__ __forceinline__ float merged_lse(float max_lse, float total) {
    return total > 0.f ? max_lse + logf(total) : -INFINITY;
}

// Dynamic shared memory of the bf16 kernel (mirrored by the launcher).
__host__ __device__ constexpr int row_stride(int d) { return (d + 15) / 16 * 16 + ROW_PAD; }

constexpr int MAX_ROPE = GLM5_SPARSE_MLA_MAX_ROPE;  // row width beyond the value columns the bf16 kernel holds (D <= DV + MAX_ROPE)
constexpr int LDS = BN + 8;   // f32 stride of a partial-score row: float2 stores of a half-warp hit 32 banks
static_assert(LDS == GLM5_SPARSE_MLA_PARTIAL_SCORE_STRIDE, "LDS differs from interface.rs");

// k16 steps of the row each of KW warps owns, for rows up to DV + MAX_ROPE wide.
__host__ __device__ constexpr int q_steps(int dv, int kw) { return ((dv + MAX_ROPE + 15) / 16 + kw - 1) / kw; }

// The kernels, each in its own file.
#include "sparse_mla/combine.cuh"
#include "sparse_mla/head_tiles.cuh"
#include "sparse_mla/f32.cuh"
#include "sparse_mla/narrow.cuh"

// Entry points, found by name from Rust: the bf16 kernel per value width and heads per block (16 * HT), for
// any row width and, for GLM-5's rows (512 + 64), with the width fixed at compile time. The value width fixes
// the warps per 16-head tile (KW = 4, or 2 for 16 columns); 64-head blocks give each warp two tiles (MW = 2).
#define SPARSE_MLA_BF16_ENTRY(DV, HT, KW, MW)                                                  \
    extern "C" __global__ void __launch_bounds__(HT / MW * KW * 32)                            \
        sparse_mla_bf16_dv##DV##_hb##HT(const SparseMlaParams p) { sparse_mla_bf16_body<DV, HT, KW, MW, 0>(p); }
#define SPARSE_MLA_BF16_FIXED_ENTRY(DV, D, HT, KW, MW)                                         \
    extern "C" __global__ void __launch_bounds__(HT / MW * KW * 32)                            \
        sparse_mla_bf16_dv##DV##_d##D##_hb##HT(const SparseMlaParams p) { sparse_mla_bf16_body<DV, HT, KW, MW, D>(p); }
SPARSE_MLA_BF16_ENTRY(16, 1, 2, 1)
SPARSE_MLA_BF16_ENTRY(32, 1, 4, 1)
SPARSE_MLA_BF16_ENTRY(64, 1, 4, 1)
SPARSE_MLA_BF16_ENTRY(128, 1, 4, 1)
SPARSE_MLA_BF16_ENTRY(256, 1, 4, 1)
SPARSE_MLA_BF16_ENTRY(512, 1, 4, 1)
SPARSE_MLA_BF16_ENTRY(128, 4, 4, 2)
SPARSE_MLA_BF16_ENTRY(256, 4, 4, 2)
SPARSE_MLA_BF16_ENTRY(512, 4, 4, 2)
SPARSE_MLA_BF16_FIXED_ENTRY(512, 576, 1, 4, 1)
SPARSE_MLA_BF16_FIXED_ENTRY(512, 576, 4, 4, 2)

// The narrow kernel for GLM-5's rows, with 2, 4 or 8 warps (32, 64 or 128 keys) per block.
#define SPARSE_MLA_NARROW_ENTRY(WARPS)                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)                                \
        sparse_mla_narrow_dv512_d576_w##WARPS(const SparseMlaParams p) { sparse_mla_narrow_body<512, 576, WARPS>(p); }
SPARSE_MLA_NARROW_ENTRY(2)
SPARSE_MLA_NARROW_ENTRY(4)
SPARSE_MLA_NARROW_ENTRY(8)

extern "C" __global__ void __launch_bounds__(COMBINE_GROUPS * 32) sparse_mla_combine_bf16(const SparseMlaParams p) {
    combine_impl(p);
}
extern "C" __global__ void __launch_bounds__(COMBINE_ROW_WARPS * 32) sparse_mla_combine_rows_bf16(const SparseMlaParams p) {
    combine_rows_impl(p);
}
extern "C" __global__ void __launch_bounds__(128) sparse_mla_f32(const SparseMlaParams p) { f32_impl(p); }
