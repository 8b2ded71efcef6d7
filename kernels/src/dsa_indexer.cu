// DSA lightning indexer over a paged key cache (contract: ops/src/dsa_indexer/mod.rs): a score kernel, then the
// top-k as a chain of three kernels (any row length) or, for short rows, one kernel (dsa_topk_cluster_e*,
// below the chain's: the same three steps inside a thread-block cluster per token):
//
//   dsa_scores_*           score(t, s) = sum_h w[t,h] * relu(q[t,h,:] . key(s)) for every visible position s
//                          of the token's sequence (s < visible[t]), one f32 row of `score_stride` per token,
//                          and each row's 2048-bin histogram of its scores by their top 11 bits; nothing
//                          for a token with visible[t] <= K, which takes every position.
//   dsa_topk_candidates    per (segment of 2048 positions, token): the histogram's threshold bin (the bin of
//                          the K-th largest score), the segment's count of scores above that bin and their bits
//                          in its mask, and the (position, score) pairs of the scores in it, appended to the
//                          row's candidate list and counted in the row's fine histogram by their next 11 bits.
//   dsa_topk_threshold     per token: the exact K-th largest score and, when several scores equal it, the
//                          last position taken among them (equal scores go to the lower position): the fine
//                          histogram gives the K-th's top 22 bits, and the few candidates sharing them are
//                          ranked (radix select over the candidates when more than FINE_LIST do); then the
//                          candidates taken into their segments' masks, and each segment's output offset.
//   dsa_topk_emit          per (segment, token), a warp each: the segment's selected positions (its mask), in
//                          ascending order, at its offset; rows with visible <= K get 0..visible-1 and -1 padding.
//   dsa_topk_emit_block    the same, a block a segment: small grids of dense segments (the launcher's choice).
// The top-k kernels are programmatic dependent launches: each may start while its predecessor finishes and
// waits (griddepcontrol.wait) before reading what it wrote.
// The result is the set of the min(K, visible) highest scores, in ascending position order, -1 padded;
// it does not depend on the order in which blocks run. A token whose sequence index is outside the block
// table has no visible keys (all -1).
//
// key(s) = keys[block_table[seq][s / bs] * bs + s % bs] with seq = token_seq[t]. Key layouts: bf16 rows, f32
// rows, or FP8 e4m3 rows with one f32 scale per key (key = scale * e4m3).
//
// mma scores: a block of 4 warps takes one token and a strided share of its 64-key tiles, streamed through
// shared memory by a cp.async pipeline; each warp scores 16 keys of a tile with the token's Q fragments held
// in registers (MT tiles of 16 heads), and the head sum is a shuffle reduction over the accumulator rows.
// FP8 keys of width 128 in pages of a multiple of 64 keys (GLM-5's cache): a tile is 64 consecutive rows of
// one page, copied by one thread with one tensor-map copy (TMA, 128-byte swizzle: conflict-free fragment
// loads without padding) plus one bulk copy of its scales, completed on the stage's mbarrier; the other
// layouts copy 16-byte pieces per thread with cp.async.
// bf16 keys: bf16 mma.sync with ldmatrix fragments. FP8 keys: e4m3 is exact in f16, so the raw bytes become
// f16 fragments with one cvt per pair and run the f16 mma against Q in f16, Q being scaled by a power of two
// that keeps it inside f16's range (exact, undone on the score); relu(scale * x) = scale * relu(x) for
// scale > 0, so each key's scale multiplies its score. The FP8 fragments' k order is permuted (thread c holds
// dims 4c..4c+3 of each 16-dim step in both operands) so that one 32-bit shared load feeds both halves of
// a B fragment; the dot product does not care about the order of its terms.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <type_traits>

#include "mma.cuh"
#include "paged.cuh"
#ifdef DSA_INDEXER_WGMMA
#include "wgmma.cuh"
#endif
#include "glm5_interface.h"

// The stages, in the order they build on each other.
#include "dsa_indexer/common.cuh"
#include "dsa_indexer/scores.cuh"
#include "dsa_indexer/top_k.cuh"
#include "dsa_indexer/top_k_cluster.cuh"
#include "dsa_indexer/quantize.cuh"

// ---------------------------------------------------------------------------------------------------------
// Entry points

#define DSA_SCORES_ENTRY(D, MT)                                                                          \
    extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32, 4) dsa_scores_bf16_d##D##_mt##MT(const DsaParams p) { \
        scores_mma<D, MT, false, false>(p);                                                              \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32, 4) dsa_scores_fp8_d##D##_mt##MT(const DsaParams p) {  \
        scores_mma<D, MT, true, false>(p);                                                               \
    }
// FP8 rows of 128 in pages of a multiple of 64 keys, tiles by TMA (the tensor map lives in the parameter).
#define DSA_SCORES_TMA_ENTRY(MT)                                                                         \
    extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32, 4)                                    \
        dsa_scores_fp8_tma_d128_mt##MT(const __grid_constant__ DsaParams p) {                            \
        scores_mma<128, MT, true, true>(p);                                                              \
    }
#ifdef DSA_INDEXER_WGMMA
// dsa_indexer_sm90.cu: only the wgmma score kernel (sm_90a).
extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32, 4)
    dsa_scores_fp8_wgmma_d128_mt2(const __grid_constant__ DsaParams p) {
    scores_mma<128, 2, true, true, true>(p);
}
// Prefill: four queries of one sequence per block (the launcher's choice where the block table has one row).
extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32, 2)
    dsa_scores_fp8_wgmma_g4_d128(const __grid_constant__ DsaParams p) {
    scores_wgmma_group(p);
}
#else
DSA_SCORES_ENTRY(16, 1)
DSA_SCORES_ENTRY(16, 2)
DSA_SCORES_ENTRY(32, 1)
DSA_SCORES_ENTRY(32, 2)
DSA_SCORES_ENTRY(64, 1)
DSA_SCORES_ENTRY(64, 2)
DSA_SCORES_ENTRY(128, 1)
DSA_SCORES_ENTRY(128, 2)
DSA_SCORES_TMA_ENTRY(1)
DSA_SCORES_TMA_ENTRY(2)

extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32) dsa_scores_f32(const DsaParams p) { scores_f32(p); }
extern "C" __global__ void __launch_bounds__(SEG_THREADS) dsa_topk_candidates(const DsaParams p) { topk_candidates_impl(p); }
extern "C" __global__ void __launch_bounds__(TOPK_THREADS, 1) dsa_topk_threshold(const DsaParams p) { topk_threshold_impl(p); }
extern "C" __global__ void __launch_bounds__(SEG_THREADS) dsa_topk_emit(const DsaParams p) { topk_emit_impl(p); }
extern "C" __global__ void __launch_bounds__(SEG_THREADS) dsa_topk_emit_block(const DsaParams p) {
    topk_emit_block_impl(p);
}
// The cluster top-k with E scores per thread: rows of up to CLUSTER_BLOCKS * CLUSTER_THREADS * E positions.
// Up to E = 8 (the rows the launcher gives it), at most 64 registers (the bounds of two blocks per SM): a block
// then fits on an SM beside two score blocks (2 x 128 threads x 124 registers), so the cluster can start (its
// barriers, its shared memory zeroed) while the score kernel still runs, instead of after its blocks leave.
#define DSA_TOPK_CLUSTER_ENTRY(E, MIN_BLOCKS)                                                                     \
    extern "C" __global__ void __cluster_dims__(CLUSTER_BLOCKS, 1, 1) __launch_bounds__(CLUSTER_THREADS, MIN_BLOCKS) \
        dsa_topk_cluster_e##E(const DsaParams p) {                                                                \
        topk_cluster_impl<E>(p);                                                                                  \
    }
DSA_TOPK_CLUSTER_ENTRY(4, 2)
DSA_TOPK_CLUSTER_ENTRY(8, 2)
DSA_TOPK_CLUSTER_ENTRY(16, 1)
DSA_TOPK_CLUSTER_ENTRY(32, 1)
DSA_TOPK_CLUSTER_ENTRY(64, 1)
extern "C" __global__ void dsa_quantize_fp8_bf16(const bf16* rows, uint8_t* bytes, float* scales, int n, int D) {
    quantize_fp8_impl(rows, bytes, scales, n, D);
}
extern "C" __global__ void dsa_quantize_fp8_f32(const float* rows, uint8_t* bytes, float* scales, int n, int D) {
    quantize_fp8_impl(rows, bytes, scales, n, D);
}
#endif  // DSA_INDEXER_WGMMA
