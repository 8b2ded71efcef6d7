// DSA lightning indexer over a paged key cache (contract: ops/src/dsa_indexer.rs): a score kernel, then the
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

typedef __nv_bfloat16 bf16;

// A CUtensorMap (the driver's opaque 128-byte tensor-map descriptor).
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

struct DsaParams {
    const void* q;            // [T, H, D] bf16 or f32
    const float* weights;     // [T, H]
    const void* keys;         // [rows, D] bf16, f32 or e4m3 bytes
    const float* key_scales;  // [rows] (FP8 layout)
    const int* block_table;   // [B, max_blocks]
    const int* token_seq;     // [T]
    const int* visible;       // [T]
    float* scores;            // [T, score_stride]
    int* hist;                // [T, HIST_STRIDE]: bin counts, then the SLOT_* values (zero between calls)
    uint32_t* work;           // [T, work_stride(p)]: candidate pairs, then per segment counts, offsets, masks
    int* indices;             // [T, K]
    int T, H, D, K, block_size, max_blocks, batch, score_stride, positions, segments;
    int cluster_topk;         // 1: the cluster top-k follows the score kernel (it may launch at the score kernel's start)
    TensorMap key_map;        // FP8 keys as a [rows, D] byte tensor, box [64 rows, D], 128-byte swizzle (TMA kernels)
};

constexpr int HIST_BITS = 11;
constexpr int HIST_BINS = 1 << HIST_BITS;
// After a row's bins: the candidate count (zero between calls), then the selection state the candidates
// kernel passes to the threshold kernel: the threshold bin's prefix and the count still to take from it.
// Then the fine histogram (zero between calls): the candidates' next 11 bits (20..10), by which the
// threshold kernel narrows the K-th largest to its top 22 bits before ranking the few candidates left.
constexpr int SLOT_CANDIDATES = HIST_BINS, SLOT_VALUE = HIST_BINS + 1, SLOT_COUNT = HIST_BINS + 2;
constexpr int FINE_BITS = 11, FINE_BINS = 1 << FINE_BITS, FINE_SHIFT = 32 - HIST_BITS - FINE_BITS;
constexpr int FINE_OFFSET = HIST_BINS + 4;
// Then, where the cluster top-k follows, the bins' sums by groups of 16 (group g: bins 16g .. 16g + 15), zero
// between calls, by which each warp of the cluster top-k finds the threshold bin alone (no block scan).
constexpr int GROUP_BINS = 16, HIST_GROUPS = HIST_BINS / GROUP_BINS, GROUP_OFFSET = FINE_OFFSET + FINE_BINS;
constexpr int HIST_STRIDE = GROUP_OFFSET + HIST_GROUPS;
constexpr int FINE_LIST = 256;  // candidates in the fine bin the threshold kernel ranks by comparison
constexpr int TILE_KEYS = 64;  // keys per shared-memory tile
constexpr int SCORE_WARPS = 4;
constexpr int SEG_THREADS = 256, SEG_ELEMS = 8, SEG = SEG_THREADS * SEG_ELEMS;  // positions per segment
constexpr int SEG_WORDS = SEG / 32;  // words of a segment's bit mask
constexpr int MAX_SEGMENTS = 2048;                                               // per row
constexpr int TOPK_THREADS = 512;
constexpr int FINE_PER_THREAD = FINE_BINS / TOPK_THREADS, SEGMENTS_PER_THREAD = MAX_SEGMENTS / TOPK_THREADS;
// Threshold-bin candidates the threshold kernel loads before it knows their count (a row's n / SPECULATIVE_SHARE,
// at most SPECULATIVE_CANDIDATES), and the most it holds in (dynamic) shared memory; more stay in global memory (L2).
constexpr int SPECULATIVE_SHARE = 16, SPECULATIVE_CANDIDATES = 4096, STAGED_CANDIDATES = 8192;

// Order-preserving integer of a score: a > b  <=>  ordered(a) > ordered(b); -0.0 and 0.0 map together.
__device__ __forceinline__ uint32_t ordered(float v) {
    const uint32_t bits = __float_as_uint(v + 0.0f);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// Keys token t may see: none when its sequence index is not a row of the block table; counts are clamped to
// 0 .. positions (the bound the workspace and the grid were sized for; counts on the device are not checked
// by the host). Both loads are issued together: as plain loads the compiler sank the count's into the
// branch on the sequence index, one memory latency after the other (seen in the score kernel's SASS).
__device__ __forceinline__ int load_now(const int* address) {
    int v;
    asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(address));
    return v;
}
__device__ __forceinline__ int visible_keys(const DsaParams& p, int t) {
    const int seq = load_now(p.token_seq + t), visible = load_now(p.visible + t);
    return seq >= 0 && seq < p.batch ? min(max(visible, 0), p.positions) : 0;
}

// Physical row of position s of the token's sequence.
__device__ __forceinline__ long long key_row(const DsaParams& p, int seq, int s) {
    const int2 page = page_of(s, p.block_size);
    return (long long)p.block_table[(size_t)seq * p.max_blocks + page.x] * p.block_size + page.y;
}

// Whether a score (its ordered bits and position) is among the K largest, given the K-th value and the last
// tied position taken: above the K-th, or equal to it no later than the last tied (ties go to lower positions).
__device__ __forceinline__ bool among_k(uint32_t value, uint32_t position, uint2 kth_tied) {
    return value > kth_tied.x || (value == kth_tied.x && position <= kth_tied.y);
}

// A row's work area (`WORK_PER_SEGMENT` in Rust sizes it): (position, ordered score) of each candidate, then
// per segment its count of scores above the threshold bin, then its output offset, then its bit mask of the
// selected positions (SEG_WORDS words a segment, see `mask_word_index`): those above the threshold bin set by the
// candidates kernel, the candidates taken by the threshold kernel.
constexpr int WORK_PER_SEGMENT = 2 + SEG_WORDS;
__device__ __forceinline__ size_t work_stride(const DsaParams& p) {
    return 2 * (size_t)p.score_stride + WORK_PER_SEGMENT * (size_t)p.segments;
}
__device__ __forceinline__ uint2* candidates_of(const DsaParams& p, int t) {
    return reinterpret_cast<uint2*>(p.work + t * work_stride(p));
}
__device__ __forceinline__ uint32_t* segment_counts_of(const DsaParams& p, int t) {
    return p.work + t * work_stride(p) + 2 * p.score_stride;
}
__device__ __forceinline__ uint32_t* segment_offsets_of(const DsaParams& p, int t) {
    return segment_counts_of(p, t) + p.segments;
}
__device__ __forceinline__ uint32_t* segment_masks_of(const DsaParams& p, int t) {
    return segment_counts_of(p, t) + 2 * p.segments;
}
// The row's masks: the j-th position of a segment's thread 32w + l (the top-k kernels' SEG_ELEMS consecutive
// positions a thread) is bit l of the segment's word SEG_ELEMS * w + j, so that a warp's ballot over one j is a
// word. `mask_word_index` is that word's index in the row's masks.
__device__ __forceinline__ uint32_t mask_word_index(uint32_t segment, uint32_t warp, uint32_t j) {
    return segment * SEG_WORDS + warp * SEG_ELEMS + j;
}
// A row position's word in the row's masks and its bit there.
__device__ __forceinline__ uint2 mask_bit(uint32_t position) {
    const uint32_t segment = position / SEG, thread = position % SEG / SEG_ELEMS, j = position % SEG_ELEMS;
    return make_uint2(mask_word_index(segment, thread / 32, j), 1u << (thread % 32));
}

// Inclusive prefix sum of `v` over the lanes of a full warp.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
        const int up = __shfl_up_sync(0xffffffff, v, o);
        if (lane >= o) v += up;
    }
    return v;
}

// Exclusive prefix sum of `flag` over a block of THREADS threads; returns it and sets `total`.
template <int THREADS>
__device__ __forceinline__ int block_exclusive_scan(int flag, int* warp_sums, int& total) {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int inclusive = warp_inclusive_sum(flag);
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    // Every thread adds up the warps' totals itself (their loads go out together): no second scan, no
    // second barrier before the result.
    int before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const int sum = warp_sums[w];
        before += w < warp ? sum : 0;
        total += sum;
    }
    __syncthreads();  // warp_sums is reused by the next scan
    return before + inclusive - flag;
}

// ---------------------------------------------------------------------------------------------------------
// Scores

template <int D, bool FP8, bool TMA = false>
struct KeyTile {
    // Padded rows (conflict-free fragment loads), or with TMA the swizzled 128-byte rows.
    static constexpr int ROW_BYTES = TMA ? D : FP8 ? D + 16 : (D + 8) * 2;
    static constexpr int CHUNKS = (FP8 ? D : 2 * D) / 16;  // 16-byte copies per key
    static constexpr int STAGES = FP8 ? 4 : 2;              // tiles in flight (46 / 44 KB with the bins)
};

// Physical rows of the 64 keys from position `base` (-1 past `visible`), one key per thread: resolved a
// pipeline step before their copy starts, so the block-table reads stay off the copy's critical path.
__device__ __forceinline__ void tile_rows(const DsaParams& p, int seq, int visible, int base, int* rows) {
    if (threadIdx.x < TILE_KEYS) {
        const int s = base + threadIdx.x;
        rows[threadIdx.x] = s < visible ? (int)key_row(p, seq, s) : -1;
    }
}

// Starts the copy of a tile's keys (zeros for row -1) into a stage. Thread t copies 16-byte piece t % CHUNKS
// of keys t / CHUNKS + j * (threads / CHUNKS): the piece and the keys are fixed per thread, so a copy costs
// a shared read of the row, one wide multiply-add and the cp.async.
template <int D, bool FP8>
__device__ __forceinline__ void load_tile(const DsaParams& p, const int* rows, uint8_t* stage, float* scales) {
    using Tile = KeyTile<D, FP8>;
    constexpr int THREADS = SCORE_WARPS * 32;
    constexpr int KEYS_PER_PASS = THREADS / Tile::CHUNKS > TILE_KEYS ? TILE_KEYS : THREADS / Tile::CHUNKS;
    constexpr int PASSES = TILE_KEYS / KEYS_PER_PASS;
    static_assert(THREADS % Tile::CHUNKS == 0 || Tile::CHUNKS % THREADS == 0, "pieces tile the block");
    const int c = threadIdx.x % Tile::CHUNKS, r0 = threadIdx.x / Tile::CHUNKS;
    if (r0 < KEYS_PER_PASS) {
        const uint8_t* keys = static_cast<const uint8_t*>(p.keys) + c * 16;
#pragma unroll
        for (int j = 0; j < PASSES; ++j) {
            const int r = r0 + j * KEYS_PER_PASS, row = rows[r];
            const uint8_t* src = keys + (size_t)(uint32_t)max(row, 0) * (Tile::CHUNKS * 16);
            cp_async_16(stage + r * Tile::ROW_BYTES + c * 16, src, row >= 0);
        }
    }
    if (FP8 && threadIdx.x < TILE_KEYS) {
        const int row = rows[threadIdx.x];
        cp_async_4(scales + threadIdx.x, p.key_scales + max(row, 0), row >= 0);
    }
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// The FP8 kernels' f16 A fragment of Q within one k16 step, times `scale`: from the lane's four bf16 (dims
// 4c..4c+3) of rows g and g + 8 of the 16-head tile.
__device__ __forceinline__ uint4 q_fragment_f16(uint2 row_g, uint2 row_g8, float scale) {
    const bf16* a = reinterpret_cast<const bf16*>(&row_g);
    const bf16* b = reinterpret_cast<const bf16*>(&row_g8);
    const auto pair = [scale](const bf16* x, int j) {
        return pack_f16(__bfloat162float(x[j]) * scale, __bfloat162float(x[j + 1]) * scale);
    };
    return make_uint4(pair(a, 0), pair(b, 0), pair(a, 2), pair(b, 2));
}

// The wgmma score kernels' B operand of Q: B row `row` holds one head's 128 dims as 16-byte pieces, piece P = 8
// values of its k16 step P / 2 in the order the key fragments hold dims (thread quad c: dims 4c, 4c+1 at wgmma's
// k 2c, 2c+1 and dims 4c+2, 4c+3 at k 2c+8, 2c+9): piece P takes dims 16(P/2) + 4c + 2(P%2) + {0,1}, c = 0..3,
// as f16 times `scale`. Piece P of row r sits in slab P / 8 (64 dims) at 16-byte column (P % 8) ^ (r % 8), the
// 128-byte swizzle. `q_b_piece` is piece `piece` of `head` (its bf16 dims) where `real`, else zero (a padding
// row); `q_b_piece_offset` its byte offset in its slab. The caller stores it: a helper storing through a pointer
// (or taking a null `head`) moved the grouped kernel's wgmma descriptors out of uniform registers (session 26).
__device__ __forceinline__ uint4 q_b_piece(bool real, const bf16* head, int piece, float scale) {
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (real) {
        const bf16* src = head + 16 * (piece / 2) + 2 * (piece % 2);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(src + 4 * c);
            v[c] = pack_f16(__low2float(pair) * scale, __high2float(pair) * scale);
        }
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ int q_b_piece_offset(int row, int piece) {
    return row * 128 + ((piece % 8) ^ (row % 8)) * 16;
}
// The byte offset of one f16 value, dim `dim` of row `row`, from the first slab (slabs `slab_bytes` apart), in
// `q_b_piece`'s order: d = 16a + 4c + 2b + e is value 2c + e of piece 2a + b.
__device__ __forceinline__ int q_b_dim_offset(int row, int dim, int slab_bytes) {
    const int piece = dim / 16 * 2 + dim % 4 / 2, value = dim % 16 / 4 * 2 + dim % 2;
    return piece / 8 * slab_bytes + q_b_piece_offset(row, piece) + value * 2;
}

// The largest |x| of eight packed bf16 and of the two in `amax`, as packed bf16: on the bits (without the
// sign they order as the magnitudes do), two 16-bit lanes at a time. A NaN orders above infinity here, where a
// float max would skip it: a token whose q holds a NaN gets the scale the NaN gives, not its finite values'.
__device__ __forceinline__ uint32_t abs_max_bf16x8(uint4 raw, uint32_t amax) {
    constexpr uint32_t MAGNITUDE = 0x7fff7fffu;
    amax = __vmaxu2(amax, __vmaxu2(raw.x & MAGNITUDE, raw.y & MAGNITUDE));
    return __vmaxu2(amax, __vmaxu2(raw.z & MAGNITUDE, raw.w & MAGNITUDE));
}

// The larger of the two packed bf16 magnitudes of abs_max_bf16x8, as a float.
__device__ __forceinline__ float larger_bf16(uint32_t pair) {
    return __uint_as_float(max(pair & 0xffffu, pair >> 16) << 16);
}

// The largest of every thread's `v` over a block of SCORE_WARPS warps (`warp_max`: one slot per warp; the
// caller's warp and lane).
__device__ __forceinline__ float block_max(float v, float* warp_max, int warp, int lane) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < SCORE_WARPS; ++w) v = fmaxf(v, warp_max[w]);
    return v;
}

// The factor that brings Q into f16's range for the FP8 kernels (|q| * scale < 2^15 < 65504; a power of
// two, so exact) and the one that undoes it on a score: from the largest |q| of the token.
__device__ __forceinline__ float2 q_scales(float amax) {
    int e;
    frexpf(amax, &e);  // amax < 2^e
    return make_float2(ldexpf(1.f, 15 - e), ldexpf(1.f, e - 15));
}

// The TMA score kernels' tile rows: warp 0's lane j holds the first key row of tile 32c + j of chunk c in
// `rows_now` and of the next chunk in `rows_next`, read a chunk ahead (`first_row_of(i)`: tile i's, -1 past the
// block's tiles). Returns tile i's first row on every lane of warp 0, moving on to the next chunk at its start.
template <typename FirstRow>
__device__ __forceinline__ int tile_first_row(int i, int& rows_now, int& rows_next, const FirstRow& first_row_of) {
    if (i % 32 == 0 && i > 0) {
        rows_now = rows_next;
        rows_next = first_row_of(i + 32 + (int)(threadIdx.x % 32));
    }
    return __shfl_sync(0xffffffff, rows_now, i % 32);
}

// Starts the copy of a tile's 64 FP8 key rows of 128 bytes from `first_row` (TMA, 128-byte swizzled) and their
// scales into a stage, both completing on `full`; by one thread, the stage's earlier readers fenced first.
__device__ __forceinline__ void copy_key_tile(const DsaParams& p, uint8_t* stage, float* scales, uint64_t* full,
                                              int first_row) {
    fence_proxy_async_shared();
    mbarrier_arrive_expect_tx(full, TILE_KEYS * (128 + 4));
    tma_load_2d(stage, &p.key_map, 0, first_row, full);
    bulk_copy_to_shared(scales, p.key_scales + first_row, TILE_KEYS * 4, full);
}

// Merges a block's share of a row's histogram (`bins`, in shared memory) into the row's (`hist`): one global
// atomic per non-empty bin, not per key, and per non-empty group of bins where the cluster top-k follows. By every
// thread of a score block. Unrolled, so that a thread's shared loads go out together (a loop waited for each:
// ~0.4 µs at the end of every block).
__device__ __forceinline__ void merge_histogram(const int* bins, int* hist, bool cluster_topk) {
    static_assert(HIST_BINS % (SCORE_WARPS * 32) == 0, "whole passes over the bins");
#pragma unroll
    for (int j = 0; j < HIST_BINS / (SCORE_WARPS * 32); ++j) {
        const int i = threadIdx.x + j * SCORE_WARPS * 32, count = bins[i];
        if (count != 0) atomicAdd(&hist[i], count);
    }
    static_assert(HIST_GROUPS == SCORE_WARPS * 32, "one group per thread");
    if (cluster_topk) {  // group threadIdx.x, its bins read from a rotated start (2-way bank conflicts, not 16)
        int sum = 0;
#pragma unroll
        for (int j = 0; j < GROUP_BINS; ++j) sum += bins[GROUP_BINS * threadIdx.x + (j + threadIdx.x) % GROUP_BINS];
        if (sum != 0) atomicAdd(&hist[GROUP_OFFSET + threadIdx.x], sum);
    }
}

// One query's score of a key from its 32 heads' wgmma accumulators (`d`: 16 of them, columns 8j + 2c + {0, 1}
// for keys g and g + 8 of the warp's 16, the m64nNk16 layout), `w` the head weights of those columns:
// sum_h w[h] relu(S[key, h]) over this thread's 8 heads for key g (lo) and g + 8 (hi), then over the quad by a
// reduce-scatter (even lanes keep lo, odd hi) and the pair's sum: key g on even c, g + 8 on odd c.
__device__ __forceinline__ float wgmma_head_sum(const float* d, const float (&w)[4][2], int c) {
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            lo += w[j][e] * fmaxf(d[4 * j + e], 0.f);
            hi += w[j][e] * fmaxf(d[4 * j + 2 + e], 0.f);
        }
    const float sum = (c & 1 ? hi : lo) + __shfl_xor_sync(0xffffffff, c & 1 ? lo : hi, 1);
    return sum + __shfl_xor_sync(0xffffffff, sum, 2);
}

#ifdef DSA_INDEXER_WGMMA
// A lane's piece of its key row g (key0 + g of a TMA tile of 128-byte FP8 rows, 128-byte swizzled: step k's 16
// bytes at (k ^ g) * 16). Step k's piece is the returned offset ^ (k * 16); row g + 8 is 8 rows on.
__device__ __forceinline__ uint32_t key_a_piece(int key0, int g, int c) { return (key0 + g) * 128 + g * 16 + 4 * c; }

// wgmma's A fragment (f16) of k step `k` from the FP8 key rows g and g + 8 (`key_a_piece`): (row g: k 2c, 2c+1;
// row g+8: the same; row g: k 2c+8, 2c+9; row g+8: the same), as the mma.sync path's B fragments hold them.
__device__ __forceinline__ void key_a_fragment(const uint8_t* tile, uint32_t a_piece, int k, uint32_t (&a)[4]) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const uint32_t four = *reinterpret_cast<const uint32_t*>(tile + (a_piece ^ (k * 16)) + n * 8 * 128);
        e4m3x4_to_f16x2x2(four, a[n], a[2 + n]);
    }
}
#endif

// bf16 / FP8 scores. MT tiles of 16 heads (H <= 16 * MT), rows of D (a multiple of 16). TMA: FP8 rows of
// 128 in pages of a multiple of TILE_KEYS (the launcher checks), `p` a __grid_constant__ parameter.
// WG (sm_90a, dsa_indexer_sm90.cu): the TMA kernel with warpgroup MMA. The block's four warps are one
// warpgroup; a tile's 64 keys are wgmma's M (warp w: keys 16w..16w+15, the same rows as below), converted to f16
// in registers as the A operand, and the token's Q (32 heads, f16) is the B operand in shared memory: one
// wgmma m64n32k16 per 16 dims instead of eight mma.sync per warp, and no Q fragments in registers.
template <int D, int MT, bool FP8, bool TMA, bool WG = false>
__device__ __forceinline__ void scores_mma(const DsaParams& p) {
    static_assert(!TMA || (FP8 && D == 128), "TMA tiles: FP8 rows of 128 bytes (one swizzle span)");
    static_assert(!WG || (TMA && MT == 2 && SCORE_WARPS == 4), "wgmma: the TMA kernel, 32 heads, one warpgroup");
    using Tile = KeyTile<D, FP8, TMA>;
    constexpr int KSTEPS = D / 16;
    constexpr int STAGES = Tile::STAGES;
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    // The row's blocks along y, the tokens along x. Blocks are placed in x-major order and the last quarter of
    // the grid falls behind in its start-up (32K b8: first tiles ~1 µs after the first quarter's, four blocks
    // per SM), so each row's blocks span every start position, and its first blocks, the early ones, take the
    // row's remainder tiles (by the stride below). With a row's blocks along x, the last two rows started late
    // and ended last, holding up the top-k (32K b8 and 200K b8: -0.7 to -1.1 µs with this layout).
    const int block = blockIdx.y, blocks = gridDim.y;
    // The cluster top-k may launch at once: its blocks set up beside these (where they fit) and wait for this
    // grid. The chain's first kernel launches after the tile loops (launched early, its many blocks cost more
    // than they save: 128K b1 +1.5 µs).
    if (p.cluster_topk) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    // 1024-byte aligned stages: the 128-byte swizzle pattern repeats every 8 rows from the stage start.
    __shared__ __align__(1024) uint8_t stages[STAGES][TILE_KEYS * Tile::ROW_BYTES];
    __shared__ __align__(16) float scales[STAGES][TILE_KEYS];
    __shared__ int bins[HIST_BINS];  // this block's share of the row's histogram
    __shared__ int rows[STAGES][TILE_KEYS];  // tile i's rows in slot i % STAGES (not with TMA)
    __shared__ uint64_t full[STAGES];        // TMA: stage s holds its tile
    __shared__ uint64_t q_full;              // TMA: the token's Q is in the last stage
    // WG: Q as wgmma's B operand, [D / 64 slabs of 64 dims][MT * 16 heads][128 bytes], 128-byte swizzled.
    constexpr int B_ROWS = MT * 16, B_SLAB_BYTES = B_ROWS * 128;
    __shared__ __align__(1024) uint8_t q_b[WG ? D / 64 * B_SLAB_BYTES : 16];
    const auto tile_base = [&](int i) { return (block + i * blocks) * TILE_KEYS; };
    bf16* q_s = reinterpret_cast<bf16*>(stages[STAGES - 1]);  // Q's rows (see below)
    // TMA: warp 0 issues the tiles, in order. It holds their first rows in registers, 32 tiles per register
    // (lane j: tile 32c + j of chunk c), the next chunk's read 32 tiles before it is needed: no iteration
    // waits for a block-table read. The first 64 are read before the token's sequence is known, as
    // sequence t's (a decode batch's token t is its sequence t; bounded by the table, not by the count), and
    // Q's copy goes out with them: one memory latency before the tiles' copies, not two. A wrong guess reads
    // them again.
    // (The entries stay raw until the count's load has gone out: a row computed at once waits for its read.)
    const int guessed_seq = max(min(t, p.batch - 1), 0);
    const auto guessed_entry_of = [&](int i) {
        const int page = tile_base(i) / p.block_size;
        const bool in_table = p.batch > 0 && page < p.max_blocks;  // (a table of no rows: nothing to read)
        return in_table ? load_now(p.block_table + (size_t)guessed_seq * p.max_blocks + page) : -1;
    };
    int rows_now = -1, rows_next = -1;
    if constexpr (TMA) {
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) mbarrier_init(&full[s], 1);
            mbarrier_init(&q_full, 1);
            mbarrier_init_fence();
            static_assert(MT * 16 * D * 2 <= TILE_KEYS * Tile::ROW_BYTES, "Q's rows fit in a stage");
            mbarrier_arrive_expect_tx(&q_full, p.H * D * 2);
            bulk_copy_to_shared(q_s, static_cast<const bf16*>(p.q) + (size_t)t * p.H * D, p.H * D * 2, &q_full);
        }
        if (warp == 0) {
            rows_now = guessed_entry_of(lane);
            rows_next = guessed_entry_of(32 + lane);
        }
    }
    // The weights of this thread's head rows, read with the first loads (read after Q's fragments, they were
    // one more memory latency before the first tile). WG: of its accumulator columns, heads 8m + 2c + r.
    constexpr int W_ROWS = WG ? 4 : MT;
    float w_row[W_ROWS][2];
#pragma unroll
    for (int m = 0; m < W_ROWS; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int head = WG ? 8 * m + 2 * c + r : m * 16 + g + 8 * r;
            const int* weight = reinterpret_cast<const int*>(p.weights) + (size_t)t * p.H + head;
            w_row[m][r] = head < p.H ? __int_as_float(load_now(weight)) : 0.f;
        }
    const int visible = visible_keys(p, t), seq = p.token_seq[t];
    const int tiles = visible > p.K ? (visible + TILE_KEYS - 1) / TILE_KEYS : 0;  // visible <= K: all taken
    if (block >= tiles) {
        if (TMA && threadIdx.x == 0) mbarrier_wait(&q_full, 0);  // Q's copy into this block lands first
        return;
    }
    const int my_tiles = (tiles - block + blocks - 1) / blocks;  // tiles block + i * blocks
    const auto first_row_of = [&](int i) { return i < my_tiles ? (int)key_row(p, seq, tile_base(i)) : -1; };
    if (TMA && warp == 0) {
        if (seq == guessed_seq) {
            const auto row = [&](int entry, int i) {
                return i < my_tiles ? entry * p.block_size + tile_base(i) % p.block_size : -1;
            };
            rows_now = row(rows_now, lane);
            rows_next = row(rows_next, 32 + lane);
        } else {
            rows_now = first_row_of(lane);
            rows_next = first_row_of(32 + lane);
        }
    }
    // Tile i's copy into its stage (64 rows from the tile's first, and their scales), by warp 0's lane 0.
    const auto issue_tma = [&](int i) {
        const int stage = i % STAGES, first_row = tile_first_row(i, rows_now, rows_next, first_row_of);
        if (lane == 0) copy_key_tile(p, stages[stage], scales[stage], &full[stage], first_row);
    };

    // Q goes to the last stage, which the main loop first fills in its first iteration; its copy and the
    // first tiles' copies go out before anything else, so their latency hides the set-up below. Without TMA:
    // bf16 per Q row, padded (conflict-free ldmatrix); with TMA: the rows as they are, by one bulk copy.
    constexpr int QLD = D + 8;
    static_assert(TMA || MT * 16 * QLD * 2 <= TILE_KEYS * Tile::ROW_BYTES, "Q fits in a stage");
    if constexpr (!TMA) {
        const bf16* q = static_cast<const bf16*>(p.q) + (size_t)t * p.H * D;
        constexpr int PIECES = D / 8;  // 16-byte pieces per row
        for (int i = threadIdx.x; i < MT * 16 * PIECES; i += blockDim.x) {
            const int h = i / PIECES, piece = i % PIECES;
            cp_async_16(q_s + h * QLD + piece * 8, q + (size_t)min(h, p.H - 1) * D + piece * 8, h < p.H);
        }
        cp_async_commit();
    }
    if constexpr (!TMA) {
        for (int i = 0; i < STAGES; ++i)
            if (i < my_tiles) tile_rows(p, seq, visible, tile_base(i), rows[i]);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if constexpr (TMA) {
            if (i < my_tiles && warp == 0) issue_tma(i);
        } else {
            if (i < my_tiles) load_tile<D, FP8>(p, rows[i], stages[i], scales[i]);
            cp_async_commit();  // one group per stage, empty ones included, so the waits below count right
        }
    }
    for (int i = threadIdx.x; i < HIST_BINS; i += blockDim.x) bins[i] = 0;
    __shared__ float warp_amax[SCORE_WARPS];
    if constexpr (!TMA) cp_async_wait<STAGES - 1>();  // this thread's pieces of Q
    __syncthreads();  // everyone's

    float q_scale = 1.f, score_unscale = 1.f;
    if constexpr (FP8 && !TMA) {
        // The largest |q|, over the block: each thread its share of the staged rows (the padding rows are 0).
        uint32_t amax = 0;
        for (int i = threadIdx.x; i < MT * 16 * (D / 8); i += blockDim.x)
            amax = abs_max_bf16x8(*reinterpret_cast<const uint4*>(q_s + (i / (D / 8)) * QLD + (i % (D / 8)) * 8), amax);
        const float2 scales = q_scales(block_max(larger_bf16(amax), warp_amax, warp, lane));
        q_scale = scales.x;
        score_unscale = scales.y;
    }
    // A fragments of 16 heads x 16 dims. bf16: the mma's own layout (thread: dims 2c, 2c+1 and 2c+8, 2c+9).
    // f16: dims 4c..4c+3, matching the B fragments below.
    uint32_t qa[MT][KSTEPS][4];
    if constexpr (TMA) {
        // The token's Q as f16 fragments, scaled as dsa_scores_fp8 scales it (from the token's largest |q|):
        // each warp converts a quarter of them, then they go through the last stage to every warp.
        constexpr int FRAGS = MT * KSTEPS, PIECES = D / 8;  // fragments (m, k); 16-byte pieces per row
        static_assert(FRAGS % SCORE_WARPS == 0 && FRAGS * 32 * 16 <= TILE_KEYS * Tile::ROW_BYTES, "whole shares");
        mbarrier_wait(&q_full, 0);
        uint32_t amax = 0;
#pragma unroll
        for (int j = 0; j < MT * 16 * PIECES / (SCORE_WARPS * 32); ++j) {
            const int i = threadIdx.x + j * SCORE_WARPS * 32;
            if (i < p.H * PIECES) amax = abs_max_bf16x8(reinterpret_cast<const uint4*>(q_s)[i], amax);
        }
        const float2 scales = q_scales(block_max(larger_bf16(amax), warp_amax, warp, lane));
        score_unscale = scales.y;
        if constexpr (WG) {
            // Row h of B is head h (`q_b_piece`); heads past H: zero.
            constexpr int B_PIECES = B_ROWS * D / 8;
            static_assert(D == 128, "q_b_piece's rows");
#pragma unroll
            for (int j = 0; j < B_PIECES / (SCORE_WARPS * 32); ++j) {
                const int i = threadIdx.x + j * SCORE_WARPS * 32, h = i / (D / 8), piece = i % (D / 8);
                *reinterpret_cast<uint4*>(q_b + (piece / 8) * B_SLAB_BYTES + q_b_piece_offset(h, piece)) =
                    q_b_piece(h < p.H, q_s + h * D, piece, scales.x);
            }
            fence_proxy_async_shared();  // visible to wgmma's reads
        } else {
            uint4 mine[FRAGS / SCORE_WARPS];
#pragma unroll
            for (int j = 0; j < FRAGS / SCORE_WARPS; ++j) {
                const int mk = warp + j * SCORE_WARPS, m = mk / KSTEPS, k = mk % KSTEPS;
                const auto piece = [&](int head) {  // past H: 0, as the padding rows of the other kernels
                    return head < p.H ? *reinterpret_cast<const uint2*>(q_s + head * D + k * 16 + 4 * c)
                                      : make_uint2(0u, 0u);
                };
                mine[j] = q_fragment_f16(piece(m * 16 + g), piece(m * 16 + g + 8), scales.x);
            }
            __syncthreads();  // every warp has read Q: its fragments replace it
            uint4* frags = reinterpret_cast<uint4*>(stages[STAGES - 1]);
#pragma unroll
            for (int j = 0; j < FRAGS / SCORE_WARPS; ++j) frags[(warp + j * SCORE_WARPS) * 32 + lane] = mine[j];
            __syncthreads();
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int k = 0; k < KSTEPS; ++k) {
                    const uint4 f = frags[(m * KSTEPS + k) * 32 + lane];
                    qa[m][k][0] = f.x;
                    qa[m][k][1] = f.y;
                    qa[m][k][2] = f.z;
                    qa[m][k][3] = f.w;
                }
        }
    }
    if constexpr (!TMA) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
                if constexpr (FP8) {
                    const auto piece = [&](int head) {
                        return *reinterpret_cast<const uint2*>(q_s + head * QLD + k * 16 + 4 * c);
                    };
                    const uint4 f = q_fragment_f16(piece(m * 16 + g), piece(m * 16 + g + 8), q_scale);
                    qa[m][k][0] = f.x;
                    qa[m][k][1] = f.y;
                    qa[m][k][2] = f.z;
                    qa[m][k][3] = f.w;
                } else {
                    ldmatrix_x4(qa[m][k], q_s + (m * 16 + lane % 16) * QLD + k * 16 + (lane / 16) * 8);
                }
            }
        }
    }
    __syncthreads();  // every warp holds its Q fragments: the first iteration refills Q's stage
    float* score_row = p.scores + (size_t)t * p.score_stride;
    const int key0 = warp * 16;  // this warp's keys of each tile
    // The key whose score this lane ends with (n = lane bit 4, o = lane bit 3); lanes 4 apart hold the same
    // one, and those of even row groups store it. WG: key g (even c) or g + 8 (odd c) of the warp's 16, the
    // quad's lanes 0 and 1 store them.
    const bool upper_n = lane & 16, upper_o = lane & 8, stores_key = WG ? c < 2 : (lane & 4) == 0;
    const int my_key = WG ? key0 + g + (c & 1 ? 8 : 0) : key0 + (upper_n ? 8 : 0) + 2 * c + (upper_o ? 1 : 0);
#ifdef DSA_INDEXER_WGMMA
    // WG: tile i + 1's wgmma runs on the tensor cores under tile i's head sum (software pipelining: the loop
    // waits for each tile's bytes one iteration ahead). S^T = K Q^T: the warp's 16 keys (rows g, g + 8) x 32
    // heads (columns 8j + 2c + {0, 1}), the keys converted to f16 A fragments (`key_a_fragment`).
    uint32_t a[KSTEPS][4];
    // B's descriptor at k = 0, the other steps' offsets from it.
    static_assert(!WG || Tile::ROW_BYTES == 128, "wgmma keys are TMA tiles of 128-byte FP8 rows");
    const uint32_t a_piece = key_a_piece(key0, g, c);
    const uint64_t q_desc0 = wgmma_desc(smem_addr(q_b), 16, 1024);
    const auto issue_wgmma = [&](int i, float (&d)[16]) {
        const uint8_t* tile = stages[i % STAGES];
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) key_a_fragment(tile, a_piece, k, a[k]);
        const auto q_desc = [&](int k) { return wgmma_desc_advance(q_desc0, (k / 4) * B_SLAB_BYTES + (k % 4) * 32); };
        wgmma_fence();
        wgmma_m64n32k16_rs_f16_first(d, a[0], q_desc(0));
#pragma unroll
        for (int k = 1; k < KSTEPS; ++k) wgmma_m64n32k16_rs_f16(d, a[k], q_desc(k), 1);
        wgmma_commit();
    };
#endif
    // Tile i's scores. WG: its S in `d` (issued an iteration ago), tile i + 1's issued into `d_next`.
    const auto tile_step = [&](const int i, float (&d)[16], float (&d_next)[16]) {
        const int ahead = i + STAGES - 1;  // refills the stage consumed in iteration i - 1
        if constexpr (TMA) {
            if (ahead < my_tiles && warp == 0) issue_tma(ahead);
        } else {
            if (ahead < my_tiles) load_tile<D, FP8>(p, rows[ahead % STAGES], stages[ahead % STAGES], scales[ahead % STAGES]);
            cp_async_commit();
        }
        // The block-table entry of this thread's key in the tile copied next iteration: read now, stored as a
        // row after this tile's math, so its latency hides behind it (as far as the math lasts).
        const int next = tile_base(ahead + 1) + threadIdx.x;
        const bool resolve = !TMA && ahead + 1 < my_tiles && threadIdx.x < TILE_KEYS;
        const int2 next_page = page_of(next, p.block_size);
        const int page = resolve && next < visible ? p.block_table[(size_t)seq * p.max_blocks + next_page.x] : -1;
        if constexpr (TMA) {
            // This tile's bytes are in (for every waiter). WG: waited for before its wgmma, an iteration ago.
            if constexpr (!WG) mbarrier_wait(&full[i % STAGES], (i / STAGES) & 1);
        } else {
            cp_async_wait<STAGES - 1>();
            __syncthreads();
        }
        const uint8_t* tile = stages[i % STAGES];
        const int base = tile_base(i);

        float sum;
        if constexpr (WG) {
#ifdef DSA_INDEXER_WGMMA
            // Tile i's S, then tile i + 1's wgmma goes out: A's registers stay untouched until that wait.
            wgmma_wait<0>();
            wgmma_pin(d);
            wgmma_hold(a);
            if (i + 1 < my_tiles) {
                mbarrier_wait(&full[(i + 1) % STAGES], ((i + 1) / STAGES) & 1);
                issue_wgmma(i + 1, d_next);
            }
            sum = wgmma_head_sum(d, w_row, c);
#endif
        } else {
            // S = Q K^T for this warp's 16 keys: MT x 2 accumulators of 16 heads x 8 keys.
            float acc[MT][2][4] = {};
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
                if constexpr (FP8) {
#pragma unroll
                    for (int n = 0; n < 2; ++n) {
                        // Key key0 + n*8 + g, dims 16k + 4c ..: with the swizzle its 16-byte piece k sits at
                        // k ^ g.
                        const int piece = TMA ? (k ^ g) : k;
                        const uint32_t four = *reinterpret_cast<const uint32_t*>(
                            tile + (key0 + n * 8 + g) * Tile::ROW_BYTES + piece * 16 + 4 * c);
                        uint32_t b0, b1;
                        e4m3x4_to_f16x2x2(four, b0, b1);
#pragma unroll
                        for (int m = 0; m < MT; ++m) mma_f16(acc[m][n], qa[m][k], b0, b1);
                    }
                } else {
                    constexpr int LD = Tile::ROW_BYTES / 2;
                    uint32_t b[4];
                    ldmatrix_x4(b, reinterpret_cast<const bf16*>(tile) + (key0 + lane % 8 + (lane / 16) * 8) * LD +
                                       k * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        mma_bf16(acc[m][0], qa[m][k], b[0], b[1]);
                        mma_bf16(acc[m][1], qa[m][k], b[2], b[3]);
                    }
                }
            }
            // sum_h w[h] relu(S[h, key]): this thread's rows (col[n][o]: key n * 8 + 2c + o), then over the
            // warp's 8 row groups by a reduce-scatter: each exchange sends the partner the half it keeps, so four
            // shuffles (not twelve) leave every lane with the sum of key `my_key`.
            float col[2][2] = {};
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j) col[n][j & 1] += w_row[m][j / 2] * fmaxf(acc[m][n][j], 0.f);
            float keep[2];
#pragma unroll
            for (int o = 0; o < 2; ++o)
                keep[o] = (upper_n ? col[1][o] : col[0][o]) +
                          __shfl_xor_sync(0xffffffff, upper_n ? col[0][o] : col[1][o], 16);
            sum = (upper_o ? keep[1] : keep[0]) + __shfl_xor_sync(0xffffffff, upper_o ? keep[0] : keep[1], 8);
            sum += __shfl_xor_sync(0xffffffff, sum, 4);
        }
        const int s = base + my_key;
        if (stores_key && s < visible) {
            if constexpr (FP8) sum *= scales[i % STAGES][my_key] * score_unscale;
            score_row[s] = sum;
            atomicAdd(&bins[ordered(sum) >> (32 - HIST_BITS)], 1);
        }
        // Into the slot of tile i, whose copy went out long ago; read after the barrier below.
        if (resolve) rows[(ahead + 1) % STAGES][threadIdx.x] = page >= 0 ? page * p.block_size + next_page.y : -1;
        __syncthreads();  // the stage is refilled next iteration
    };
    // WG: two sets of accumulators in turn, so a wgmma in flight never shares registers with the S being summed
    // (with one set, the compiler copies the new S into the old one's registers and ptxas serialises the wgmma).
    float d0[16], d1[16];
    if constexpr (WG) {
#ifdef DSA_INDEXER_WGMMA
        mbarrier_wait(&full[0], 0);
        issue_wgmma(0, d0);
#endif
        for (int i = 0; i < my_tiles; i += 2) {
            tile_step(i, d0, d1);
            if (i + 1 < my_tiles) tile_step(i + 1, d1, d0);
        }
    } else {
        for (int i = 0; i < my_tiles; ++i) tile_step(i, d0, d1);
    }
    if (!p.cluster_topk) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    merge_histogram(bins, p.hist + (size_t)t * HIST_STRIDE, p.cluster_topk);
}

#ifdef DSA_INDEXER_WGMMA
// Prefill scores by warpgroup MMA, GROUP_TOKENS consecutive queries per block: each key tile is copied and
// converted to f16 once for the group and multiplied against all its queries at once (S^T = K Q^T, one wgmma
// m64n136k16 per 16 dims: the tile's 64 keys x 4 queries' 32 heads and 2 columns each of u below), where the
// decode kernel (scores_mma<..., WG = true>) copies and converts every tile once per query with a quarter of
// the wgmma's width. The launcher's promise: a block table of one row, so every query with keys is sequence 0's (a
// query naming another sequence sees none, as in every kernel). Otherwise the decode kernel's contract and
// layouts: FP8 rows of 128 by TMA in pages of a multiple of TILE_KEYS, 17 to 32 heads, a query's Q scaled
// into f16's range by its own power of two, a row's tiles strided over its blocks (gridDim.y), scores and
// the row's histogram (and group sums) as the top-k expects them.
// The head sum without a relu per head: w relu(x) = w (x + |x|) / 2, and sum_h w_h x_h = u . k for
// u = sum_h w_h q_h, so score = (u . k + sum_h w_h |x_h|) / 2: one FFMA a head (|x| is an operand modifier)
// where max-then-FFMA took two, u . k coming from B's two extra columns a query (u as an f16 pair hi + lo, 22
// bits, scaled into f16's range by its own power of two). Its rounding is of the order of the per-head
// accumulators' own (f32 sums of the same products); an exact relu zero becomes +-that rounding.
constexpr int GROUP_TOKENS = 4, GROUP_HEADS = 32, GROUP_STAGES = 5;
constexpr int GROUP_U_PARTS = 2, GROUP_COLUMNS = GROUP_HEADS + GROUP_U_PARTS;  // B's columns a query
constexpr int GROUP_B_ROWS = GROUP_TOKENS * GROUP_COLUMNS, GROUP_SLAB_BYTES = GROUP_B_ROWS * 128;
struct GroupScoreShared {
    alignas(1024) uint8_t stages[GROUP_STAGES][TILE_KEYS * 128];
    // wgmma's B: [2 slabs of 64 dims][query j's column h at row 8 (h / 2) + 2j + h % 2][128 bytes], 128-byte
    // swizzled: the accumulator columns a lane holds (8m + 2c + {0, 1}) are then all of query c's. Columns
    // 0..31 are the heads, 32 and 33 u's hi and lo.
    alignas(1024) uint8_t q_b[128 / 64][GROUP_SLAB_BYTES];
    // Each query's share of its row's histogram; first the group's Q as it arrives (bf16 [query][head][dim]).
    alignas(16) int bins[GROUP_TOKENS][HIST_BINS];
    alignas(16) float scales[GROUP_STAGES][TILE_KEYS];
    uint64_t full[GROUP_STAGES], q_full;
    float warp_amax[SCORE_WARPS][GROUP_TOKENS], warp_umax[SCORE_WARPS][GROUP_TOKENS];
    float weights[GROUP_TOKENS * GROUP_HEADS];  // the group's head weights (for u)
};
// The launcher's dynamic shared memory for it (`GROUP_SHARED_BYTES` in Rust): the struct and the slack to
// align the dynamic base to 1024 bytes.
constexpr int GROUP_SHARED_BYTES = 112 * 1024;
static_assert(sizeof(GroupScoreShared) + 1024 <= GROUP_SHARED_BYTES, "the launcher's dynamic shared memory");
static_assert(GROUP_TOKENS * GROUP_HEADS * 128 * 2 <= sizeof(int) * GROUP_TOKENS * HIST_BINS, "Q fits in the bins");

// v[i] of a small array held in registers, by selects (indexing it with a runtime i would put it in local memory).
template <typename T, int N>
__device__ __forceinline__ T register_at(const T (&v)[N], int i) {
    T x = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j) x = i == j ? v[j] : x;
    return x;
}

__device__ void scores_wgmma_group(const DsaParams& p) {
    constexpr int D = 128, KSTEPS = D / 16, STAGES = GROUP_STAGES, G = GROUP_TOKENS;
    extern __shared__ uint8_t group_smem[];
    GroupScoreShared& sh = *reinterpret_cast<GroupScoreShared*>(
        group_smem + (((smem_addr(group_smem) + 1023u) & ~1023u) - smem_addr(group_smem)));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int t0 = blockIdx.x * G, block = blockIdx.y, blocks = gridDim.y;
    if (p.cluster_topk) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    // The group's queries (those past the chunk, or with no more visible keys than K, need no scores).
    constexpr int seq = 0;
    int visible[G], longest = 0;
#pragma unroll
    for (int j = 0; j < G; ++j) {
        visible[j] = t0 + j < p.T ? visible_keys(p, t0 + j) : 0;
        if (visible[j] <= p.K) visible[j] = 0;
        longest = max(longest, visible[j]);
    }
    const int tiles = (longest + TILE_KEYS - 1) / TILE_KEYS;
    if (block >= tiles) return;
    const int queries = min(G, p.T - t0);
    const int my_tiles = (tiles - block + blocks - 1) / blocks;  // tiles block + i * blocks
    const auto tile_base = [&](int i) { return (block + i * blocks) * TILE_KEYS; };
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbarrier_init(&sh.full[s], 1);
        mbarrier_init(&sh.q_full, 1);
        mbarrier_init_fence();
        mbarrier_arrive_expect_tx(&sh.q_full, queries * p.H * D * 2);
        bulk_copy_to_shared(sh.bins, static_cast<const bf16*>(p.q) + (size_t)t0 * p.H * D, queries * p.H * D * 2,
                            &sh.q_full);
    }
    // Lane c's query is query c of the group (B's column order): its visible keys; below, its head weights (halved).
    static_assert(G == 4 && GROUP_COLUMNS == 34, "a quad's four lanes hold the four queries' 34 columns each");
    const int visible_mine = register_at(visible, c);
    static_assert(GROUP_TOKENS * GROUP_HEADS <= SCORE_WARPS * 32, "a weight a thread");
    if (threadIdx.x < queries * p.H) sh.weights[threadIdx.x] = p.weights[(size_t)t0 * p.H + threadIdx.x];
    __syncthreads();  // the barriers are initialised, the weights stored
    float w_half[GROUP_HEADS];
#pragma unroll
    for (int h = 0; h < GROUP_HEADS; ++h) w_half[h] = c < queries && h < p.H ? 0.5f * sh.weights[c * p.H + h] : 0.f;
    // Warp 0 issues the tiles, their first rows read a chunk of 32 ahead (`tile_first_row`).
    const auto first_row_of = [&](int i) { return i < my_tiles ? (int)key_row(p, seq, tile_base(i)) : -1; };
    int rows_now = -1, rows_next = -1;
    if (warp == 0) {
        rows_now = first_row_of(lane);
        rows_next = first_row_of(32 + lane);
    }
    const auto issue_tma = [&](int i) {
        const int stage = i % STAGES, first_row = tile_first_row(i, rows_now, rows_next, first_row_of);
        if (lane == 0) copy_key_tile(p, sh.stages[stage], sh.scales[stage], &sh.full[stage], first_row);
    };
    // Every stage at once (Q waits in the bins); the loop refills each stage once its tile's A fragments are
    // read.
#pragma unroll
    for (int i = 0; i < STAGES; ++i)
        if (i < my_tiles && warp == 0) issue_tma(i);

    // Q into B (`q_b_piece`; query j's head h at row 8 (h / 2) + 2j + h % 2), each query scaled by its own power
    // of two from its largest |q|; u's hi and lo (columns 32, 33) scaled by theirs from its largest |u|.
    mbarrier_wait(&sh.q_full, 0);
    const bf16* q_s = reinterpret_cast<const bf16*>(sh.bins);
    constexpr int PIECES = D / 8;  // 16-byte pieces per head row
    static_assert(D == SCORE_WARPS * 32, "a thread's dim of u");
    float u[G];  // u[j] = sum_h w[j, h] q[j, h, dim], dim = threadIdx.x
#pragma unroll
    for (int j = 0; j < G; ++j) {
        uint32_t m = 0;
        u[j] = 0.f;
        if (j < queries) {
            for (int i = threadIdx.x; i < p.H * PIECES; i += SCORE_WARPS * 32)
                m = abs_max_bf16x8(reinterpret_cast<const uint4*>(q_s + (size_t)j * p.H * D)[i], m);
#pragma unroll
            for (int h = 0; h < GROUP_HEADS; ++h)
                if (h < p.H) u[j] += sh.weights[j * p.H + h] * __bfloat162float(q_s[(j * p.H + h) * D + threadIdx.x]);
        }
        float amax = larger_bf16(m), umax = fabsf(u[j]);
        for (int o = 16; o > 0; o /= 2) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
            umax = fmaxf(umax, __shfl_xor_sync(0xffffffff, umax, o));
        }
        if (lane == 0) {
            sh.warp_amax[warp][j] = amax;
            sh.warp_umax[warp][j] = umax;
        }
    }
    __syncthreads();
    float q_scale[G], score_unscale[G], u_to_x[G];  // u_to_x: from u . k's units to the heads' (x = q_scale q . k)
#pragma unroll
    for (int j = 0; j < G; ++j) {
        float m = 0.f, mu = 0.f;
#pragma unroll
        for (int w = 0; w < SCORE_WARPS; ++w) {
            m = fmaxf(m, sh.warp_amax[w][j]);
            mu = fmaxf(mu, sh.warp_umax[w][j]);
        }
        const float2 scales = q_scales(m), u_scales = q_scales(mu);
        q_scale[j] = scales.x;
        score_unscale[j] = scales.y;
        u_to_x[j] = scales.x * u_scales.y;
        // This thread's dim of u into columns 32 (hi) and 33 (lo), rows 128 + 2j + {0, 1}.
        const float scaled = u[j] * u_scales.x;
        const __half hi = __float2half_rn(scaled), lo = __float2half_rn(scaled - __half2float(hi));
        const int row = 8 * (GROUP_HEADS / 2) + 2 * j;
        *reinterpret_cast<__half*>(sh.q_b[0] + q_b_dim_offset(row, threadIdx.x, GROUP_SLAB_BYTES)) = hi;
        *reinterpret_cast<__half*>(sh.q_b[0] + q_b_dim_offset(row + 1, threadIdx.x, GROUP_SLAB_BYTES)) = lo;
    }
    // Lane c's: its score's unscale, and u . k's factor into the halved sum (0.5 u_to_x).
    const float unscale_mine = register_at(score_unscale, c), half_u_to_x_mine = 0.5f * register_at(u_to_x, c);
    for (int i = threadIdx.x; i < GROUP_TOKENS * GROUP_HEADS * PIECES; i += SCORE_WARPS * 32) {
        const int row = i / PIECES, piece = i % PIECES, j = row % 8 / 2, h = row / 8 * 2 + row % 2;
        *reinterpret_cast<uint4*>(sh.q_b[piece / 8] + q_b_piece_offset(row, piece)) =
            q_b_piece(j < queries && h < p.H, q_s + ((size_t)j * p.H + h) * D, piece, register_at(q_scale, j));
    }
    fence_proxy_async_shared();  // visible to wgmma's reads
    __syncthreads();             // every thread has read Q: its space becomes the bins
    for (int i = threadIdx.x; i < G * HIST_BINS; i += SCORE_WARPS * 32) (&sh.bins[0][0])[i] = 0;
    __syncthreads();

    const int key0 = warp * 16;
    // The lane's scores: its query's (c) of keys g and g + 8 of the warp's 16.
    float* score_row = p.scores + (size_t)(t0 + c) * p.score_stride;
    int* bins_mine = sh.bins[c];
    // A fragments in two halves of the k steps, each half's wgmma its own commit group: the next tile's first
    // half converts and goes out once this tile's first half is done, its second half once this tile's is, so
    // the tensor cores always hold a queued half (with one group a tile, the next tile's conversion waited for
    // the whole tile's wgmma).
    uint32_t a_lo[KSTEPS / 2][4], a_hi[KSTEPS / 2][4];
    // Two sets of accumulators in turn (see the decode kernel).
    float d0[GROUP_COLUMNS * 2], d1[GROUP_COLUMNS * 2];
    // B's descriptor at k = 0; the other k steps' are offsets from it (no descriptor rebuilt per wgmma).
    const uint64_t q_desc0 = wgmma_desc(smem_addr(sh.q_b), 16, 1024);
    const auto wait_tile = [&](int i) { mbarrier_wait(&sh.full[i % STAGES], (i / STAGES) & 1); };
    const uint32_t a_piece = key_a_piece(key0, g, c);
    // Half `half` of tile i's wgmma into `d`, its A fragments converted into `a`: one commit group.
    const auto issue_half = [&](int i, int half, uint32_t (&a)[KSTEPS / 2][4], float (&d)[GROUP_COLUMNS * 2]) {
        const uint8_t* tile = sh.stages[i % STAGES];
        const auto q_desc = [&](int k) {
            return wgmma_desc_advance(q_desc0, (k / 4) * GROUP_SLAB_BYTES + (k % 4) * 32);
        };
#pragma unroll
        for (int j = 0; j < KSTEPS / 2; ++j) key_a_fragment(tile, a_piece, half * KSTEPS / 2 + j, a[j]);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < KSTEPS / 2; ++j) {
            const int k = half * KSTEPS / 2 + j;
            if (k == 0) wgmma_m64n136k16_rs_f16_first(d, a[j], q_desc(k));
            else wgmma_m64n136k16_rs_f16(d, a[j], q_desc(k), 1);
        }
        wgmma_commit();
    };
    // The scales of the lane's keys (g, g + 8) in tile i, read with its A fragments: the stage is refilled
    // before the tile's head sum.
    const auto tile_scales = [&](int i) {
        return make_float2(sh.scales[i % STAGES][key0 + g], sh.scales[i % STAGES][key0 + g + 8]);
    };
    // Tile i's scores from `d` and `key_scales` (issued an iteration ago); tile i + 1's wgmma goes out into
    // `d_next` and `key_scales_next` first, unless `has_next` says tile i is the block's last (a compile-time
    // type: with the wait depth on a runtime branch, ptxas serialises every wgmma, C7514).
    const auto tile_step = [&](auto has_next, const int i, float (&d)[GROUP_COLUMNS * 2],
                               float (&d_next)[GROUP_COLUMNS * 2], float2& key_scales, float2& key_scales_next) {
        const int ahead = i + STAGES;  // refills tile i's stage: its A fragments were read in iteration i - 1
        if (ahead < my_tiles && warp == 0) issue_tma(ahead);
        constexpr bool next = decltype(has_next)::value;
        if constexpr (next) {
            wgmma_wait<1>();  // tile i's first half
            wgmma_hold(a_lo);
            wait_tile(i + 1);
            key_scales_next = tile_scales(i + 1);
            issue_half(i + 1, 0, a_lo, d_next);
            wgmma_wait<1>();  // tile i's second half
        } else {
            wgmma_wait<0>();
            wgmma_hold(a_lo);
        }
        wgmma_pin(d);
        wgmma_hold(a_hi);
        if constexpr (next) issue_half(i + 1, 1, a_hi, d_next);
        // (u . k + sum_h w[h] |S[key, h]|) / 2 over the lane's 32 heads (columns 8m + 2c + r: head 2m + r; u's
        // hi and lo at m = 16), for key g (lo) and g + 8 (hi), the head sums in four chains (by m % 2 and r) for
        // the dependent adds' latency (with two, the scores stage of a 32K prefill chunk took 2% longer).
        constexpr int U = 4 * (GROUP_HEADS / 2);  // u's accumulators: key g's hi, lo, then key g + 8's
        float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int m = 0; m < GROUP_HEADS / 2; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                lo[m % 2 * 2 + r] += w_half[2 * m + r] * fabsf(d[4 * m + r]);
                hi[m % 2 * 2 + r] += w_half[2 * m + r] * fabsf(d[4 * m + 2 + r]);
            }
        const float key_sum[2] = {fmaf(d[U] + d[U + 1], half_u_to_x_mine, (lo[0] + lo[1]) + (lo[2] + lo[3])),
                                  fmaf(d[U + 2] + d[U + 3], half_u_to_x_mine, (hi[0] + hi[1]) + (hi[2] + hi[3]))};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = key0 + g + 8 * half, s = tile_base(i) + key;
            if (s < visible_mine) {
                const float sum = key_sum[half] * ((half ? key_scales.y : key_scales.x) * unscale_mine);
                score_row[s] = sum;
                atomicAdd(&bins_mine[ordered(sum) >> (32 - HIST_BITS)], 1);
            }
        }
        __syncthreads();  // the stage is refilled next iteration
    };
    wait_tile(0);
    float2 key_scales0 = tile_scales(0), key_scales1;
    issue_half(0, 0, a_lo, d0);
    issue_half(0, 1, a_hi, d0);
    __syncthreads();  // every warp has read tile 0's stage before the first iteration refills it
    const std::true_type more;
    const std::false_type last;
    int i = 0;
    for (; i + 2 < my_tiles; i += 2) {
        tile_step(more, i, d0, d1, key_scales0, key_scales1);
        tile_step(more, i + 1, d1, d0, key_scales1, key_scales0);
    }
    if (i + 1 < my_tiles) {
        tile_step(more, i, d0, d1, key_scales0, key_scales1);
        tile_step(last, i + 1, d1, d0, key_scales1, key_scales0);
    } else {
        tile_step(last, i, d0, d1, key_scales0, key_scales1);
    }
    if (!p.cluster_topk) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    for (int j = 0; j < queries; ++j)
        merge_histogram(sh.bins[j], p.hist + (size_t)(t0 + j) * HIST_STRIDE, p.cluster_topk);
}
#endif

// f32 scores: plain FMA, one warp per key (full precision for f32 models); one 64-key tile per block, the tile
// along x (a row's tiles can outnumber gridDim.y's 65535), the token along y.
__device__ void scores_f32(const DsaParams& p) {
    const int t = blockIdx.y, tile = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int visible = visible_keys(p, t), seq = p.token_seq[t], D = p.D;
    if (visible <= p.K) return;  // every visible position is taken
    extern __shared__ float qf[];  // [H][D], then [H] weights
    const float* q = static_cast<const float*>(p.q) + (size_t)t * p.H * D;
    for (int i = threadIdx.x; i < p.H * D; i += blockDim.x) qf[i] = q[i];
    for (int h = threadIdx.x; h < p.H; h += blockDim.x) qf[p.H * D + h] = p.weights[(size_t)t * p.H + h];
    __syncthreads();
    const int last = min(tile * TILE_KEYS + TILE_KEYS, visible);
    for (int s = tile * TILE_KEYS + warp; s < last; s += SCORE_WARPS) {
        const float* k = static_cast<const float*>(p.keys) + key_row(p, seq, s) * D;
        float score = 0.f;
        for (int h = 0; h < p.H; ++h) {
            float dot = 0.f;
            for (int d = lane; d < D; d += 32) dot += qf[h * D + d] * k[d];
            for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
            score += qf[p.H * D + h] * fmaxf(dot, 0.f);
        }
        if (lane == 0) {
            p.scores[(size_t)t * p.score_stride + s] = score;
            const uint32_t bin = ordered(score) >> (32 - HIST_BITS);
            atomicAdd(&p.hist[(size_t)t * HIST_STRIDE + bin], 1);
            if (p.cluster_topk) atomicAdd(&p.hist[(size_t)t * HIST_STRIDE + GROUP_OFFSET + bin / GROUP_BINS], 1);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Top-k

// Scores first .. first + N of a row, 0 past n (rows start 16-byte aligned: the stride and `first` are
// multiples of 4).
template <int N>
__device__ __forceinline__ void load_scores(const float* row, int first, int n, float (&v)[N]) {
    static_assert(N % 4 == 0, "whole float4 loads");
    if (first + N <= n) {
#pragma unroll
        for (int j = 0; j < N; j += 4) {
            const float4 f = *reinterpret_cast<const float4*>(row + first + j);
            v[j] = f.x; v[j + 1] = f.y; v[j + 2] = f.z; v[j + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = first + j < n ? row[first + j] : 0.f;
    }
}

// Per (segment, token): the threshold bin from the row's histogram, the segment's count of scores above it
// and their bits in its mask, and its scores in that bin appended to the row's candidates with their positions.
__device__ void topk_candidates_impl(const DsaParams& p) {
    const int t = blockIdx.y, segment = blockIdx.x;
    const int n = visible_keys(p, t), K = p.K;
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (n <= K || segment * SEG >= n) return;
    int* hist = p.hist + (size_t)t * HIST_STRIDE;
    uint2* candidates = candidates_of(p, t);
    __shared__ int warp_sums[32];
    __shared__ int bin_s, remaining_s;
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the score kernel's writes
    // The segment's scores, read together with the bins (one memory latency, not two in a row).
    const int first = segment * SEG + threadIdx.x * SEG_ELEMS;
    float v[SEG_ELEMS];
    load_scores(p.scores + (size_t)t * p.score_stride, first, n, v);

    // The bin of the K-th largest score: thread i sums the 8 bins from the top's 8i-th down, read as two 16-byte
    // loads (as eight 4-byte loads 32 bytes apart across the warp, each instruction took 32 sectors).
    static_assert(HIST_BINS == 8 * SEG_THREADS && HIST_STRIDE % 4 == 0, "eight bins a thread, rows 16-byte aligned");
    const int4 upper = reinterpret_cast<const int4*>(hist)[(HIST_BINS - 8 * threadIdx.x) / 4 - 1];
    const int4 lower = reinterpret_cast<const int4*>(hist)[(HIST_BINS - 8 * threadIdx.x) / 4 - 2];
    const int counts[8] = {upper.w, upper.z, upper.y, upper.x, lower.w, lower.z, lower.y, lower.x};
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += counts[j];
    int total;
    int above = block_exclusive_scan<SEG_THREADS>(sum, warp_sums, total);
    if (above < K && above + sum >= K) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (above + counts[j] >= K) {
                bin_s = HIST_BINS - 1 - 8 * threadIdx.x - j;
                remaining_s = K - above;
                break;
            }
            above += counts[j];
        }
    }
    __syncthreads();
    const uint32_t bin = bin_s;
    if (segment == 0 && threadIdx.x == 0) {
        hist[SLOT_VALUE] = (int)(bin << (32 - HIST_BITS));
        hist[SLOT_COUNT] = remaining_s;
    }

    int above_here = 0, mine = 0;
    bool candidate[SEG_ELEMS];
    uint32_t mask_word = 0;  // lane j < SEG_ELEMS: the warp's mask word j (see `mask_word_index`)
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j) {
        const bool valid = first + j < n;
        const uint32_t u = ordered(v[j]), b = u >> (32 - HIST_BITS);
        const bool above = valid && b > bin;
        above_here += above;
        const uint32_t word = __ballot_sync(0xffffffff, above);
        if (lane == j) mask_word = word;
        candidate[j] = valid && b == bin;
        mine += candidate[j];
        if (candidate[j]) atomicAdd(hist + FINE_OFFSET + ((u >> FINE_SHIFT) & (FINE_BINS - 1)), 1);
    }
    static_assert(SEG_ELEMS <= 32 && SEG_WORDS == SEG_THREADS / 32 * SEG_ELEMS, "a warp's mask words");
    if (lane < SEG_ELEMS)
        segment_masks_of(p, t)[mask_word_index(segment, threadIdx.x / 32, lane)] = mask_word;
    // One scan for both counts (each under 2^16 per segment) and one atomic per block for its candidates,
    // which go out in position order.
    int packed_total;
    const int packed = block_exclusive_scan<SEG_THREADS>((above_here << 16) | mine, warp_sums, packed_total);
    __shared__ int base_s;
    if (threadIdx.x == 0) {
        base_s = atomicAdd(&hist[SLOT_CANDIDATES], packed_total & 0xffff);
        segment_counts_of(p, t)[segment] = packed_total >> 16;
    }
    __syncthreads();
    int slot = base_s + (packed & 0xffff);
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j)
        if (candidate[j]) candidates[slot++] = make_uint2(first + j, ordered(v[j]));
}

// Refines (prefix, mask, remaining) over 8-bit digits at `shifts` until the remaining-th largest value is
// exact: `remaining` of the values matching `prefix` under `mask` are still to be taken. Values come from
// `value(i)` for i < count.
template <typename Value>
__device__ void select_digits(Value value, int count, int first_shift, uint32_t& prefix, uint32_t& mask,
                              int& remaining, int* hist, uint32_t* prefix_s, int* remaining_s) {
    for (int shift = first_shift; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < count; i += blockDim.x) {
            const uint32_t u = value(i);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // the digit holding the remaining-th largest: lane l scans digits 255-8l down
            const int lane = threadIdx.x;
            int counts[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) sum += counts[j] = hist[255 - 8 * lane - j];
            int above = warp_inclusive_sum(sum) - sum;  // values in higher lanes' digits
            const bool here = above < remaining && above + sum >= remaining;
            const bool nowhere = __ballot_sync(0xffffffff, here) == 0;  // (cannot happen) then digit 0
            if (here || (nowhere && lane == 31)) {
                int j = 0;
                for (; j < 7 && above + counts[j] < remaining; ++j) above += counts[j];
                *prefix_s = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
                *remaining_s = remaining - above;
            }
        }
        __syncthreads();
        prefix = *prefix_s;
        remaining = *remaining_s;
        mask |= 255u << shift;
    }
}

struct ThresholdShared {
    int digits[256];
    uint32_t prefix;
    int remaining, equal;
    int selected[MAX_SEGMENTS];
    int warp_sums[32];
    int fine, fine_need, fine_count, listed;  // the fine bin, how many to take from it, its count
    uint32_t kth, last_tied;
    // Aligned: the rank loop reads the list in 16-byte pieces, which must not take in kth or last_tied (a
    // read of a word another thread writes, unused, but a hazard to racecheck).
    alignas(16) uint32_t list_values[FINE_LIST];
    alignas(16) uint32_t list_positions[FINE_LIST];
};

// The K-th largest value (ordered) and the last position taken among the scores equal to it, by which the
// candidates taken join their segments' masks, and each segment's output offset, from the row's candidates
// (`value(i)`: candidate i's ordered score, `position(i)` its position), in sh.selected each segment's count of
// scores above the threshold bin, and the fine histogram's bins FINE_BINS - 1 - FINE_PER_THREAD * i - j in
// fine[j] of thread i.
template <typename Value, typename Position>
__device__ void threshold_over(const DsaParams& p, int t, int n, Value value, Position position_of, int count,
                               uint32_t prefix, int remaining, const int (&fine)[FINE_PER_THREAD],
                               ThresholdShared& sh) {
    int* digits = sh.digits;
    uint32_t& prefix_s = sh.prefix;
    int &remaining_s = sh.remaining, &equal_s = sh.equal;
    int* selected = sh.selected;
    int* warp_sums = sh.warp_sums;
    // The fine bin of the K-th largest (its bits 20..10) from the fine histogram, counted from the top.
    if (threadIdx.x == 0) {
        sh.listed = 0;
        sh.fine_count = FINE_LIST + 1;  // (no bin found: cannot happen) the radix select below
    }
    int fine_sum = 0;
#pragma unroll
    for (int j = 0; j < FINE_PER_THREAD; ++j) fine_sum += fine[j];
    int fine_total;
    int fine_above = block_exclusive_scan<TOPK_THREADS>(fine_sum, warp_sums, fine_total);
    if (fine_above < remaining && fine_above + fine_sum >= remaining) {
#pragma unroll
        for (int j = 0; j < FINE_PER_THREAD; ++j) {
            if (fine_above + fine[j] >= remaining) {
                sh.fine = FINE_BINS - 1 - FINE_PER_THREAD * threadIdx.x - j;
                sh.fine_need = remaining - fine_above;
                sh.fine_count = fine[j];
                break;
            }
            fine_above += fine[j];
        }
    }
    __syncthreads();
    uint2 kth_tied;  // the K-th value and the last tied position taken
    if (sh.fine_count <= FINE_LIST) {
        // Few candidates share the K-th's top 22 bits: rank them (higher value first, then lower position);
        // the one of rank fine_need - 1 is the last taken.
        const uint32_t top = (prefix >> FINE_SHIFT) | (uint32_t)sh.fine;
        for (int i = threadIdx.x; i < count; i += blockDim.x) {
            const uint32_t u = value(i);
            if (u >> FINE_SHIFT == top) {
                const int slot = atomicAdd(&sh.listed, 1);
                sh.list_values[slot] = u;
                sh.list_positions[slot] = position_of(i);
            }
        }
        __syncthreads();
        const int listed = sh.listed, need = sh.fine_need;
        if ((int)threadIdx.x < listed) {
            const uint32_t u = sh.list_values[threadIdx.x], position = sh.list_positions[threadIdx.x];
            int rank = 0;
            for (int j = 0; j < listed; ++j)
                rank += sh.list_values[j] > u || (sh.list_values[j] == u && sh.list_positions[j] < position);
            if (rank == need - 1) {
                sh.kth = u;
                sh.last_tied = position;
            }
        }
        __syncthreads();
        kth_tied = make_uint2(sh.kth, sh.last_tied);
    } else {
        // The remaining 21 bits, 8 at a time (the first digit overlaps 3 known bits, which all match).
        uint32_t mask = ~0u << (32 - HIST_BITS);
        select_digits(value, count, 16, prefix, mask, remaining, digits, &prefix_s, &remaining_s);
        const uint32_t kth = prefix;
        if (threadIdx.x == 0) equal_s = 0;
        __syncthreads();
        int equal = 0;
        for (int i = threadIdx.x; i < count; i += blockDim.x) equal += value(i) == kth;
        equal = __reduce_add_sync(0xffffffff, equal);  // one shared atomic per warp, not per thread
        if (threadIdx.x % 32 == 0) atomicAdd(&equal_s, equal);
        __syncthreads();
        // Among equal scores the lowest positions win: the remaining-th largest of ~position over them.
        uint32_t last_tied = 0xffffffffu;
        if (equal_s > remaining) {
            uint32_t position_prefix = 0, position_mask = 0;
            int take = remaining;
            select_digits([&](int i) { return value(i) == kth ? ~position_of(i) : 0u; }, count, 24, position_prefix,
                          position_mask, take, digits, &prefix_s, &remaining_s);
            last_tied = ~position_prefix;
        }
        kth_tied = make_uint2(kth, last_tied);
    }
    // Each segment's output count: its scores above the threshold bin (in `selected` already) plus its
    // candidates taken, which join those in its mask.
    const int segments = (n + SEG - 1) / SEG;
    uint32_t* masks = segment_masks_of(p, t);
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const uint32_t position = position_of(i);
        if (among_k(value(i), position, kth_tied)) {
            atomicAdd(&selected[position / SEG], 1);
            const uint2 bit = mask_bit(position);
            atomicOr(&masks[bit.x], bit.y);
        }
    }
    __syncthreads();
    const int s0 = SEGMENTS_PER_THREAD * threadIdx.x;  // this thread's consecutive segments
    int mine = 0;
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) mine += s0 + j < segments ? selected[s0 + j] : 0;
    int total;
    int offset = block_exclusive_scan<TOPK_THREADS>(mine, warp_sums, total);
    uint32_t* offsets = segment_offsets_of(p, t);
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) {
        if (s0 + j < segments) {
            offsets[s0 + j] = offset;
            offset += selected[s0 + j];
        }
    }
}

__device__ void topk_threshold_impl(const DsaParams& p) {
    const int t = blockIdx.x;
    const int n = visible_keys(p, t);
    int* hist = p.hist + (size_t)t * HIST_STRIDE;
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the candidates kernel's writes
    // Everything the select reads, issued together before the count is known (one memory latency, not
    // three in a row): the slots, each segment's count, and as many candidates as a row's list seldom exceeds,
    // n / SPECULATIVE_SHARE (the K-th score's bin holds ~4% of a row's positions), up to SPECULATIVE_CANDIDATES
    // (the workspace row holds `score_stride` >= n of them; those past the count go unused). A longer list loads
    // the rest, up to STAGED_CANDIDATES, once the count is known. (4096 whatever n: 64 MB a 32K prefill chunk,
    // the kernel DRAM-bound at 2.7 TB/s.)
    const uint2* candidates = candidates_of(p, t);
    const uint32_t* segment_counts = segment_counts_of(p, t);
    const int count = hist[SLOT_CANDIDATES];
    const uint32_t prefix = (uint32_t)hist[SLOT_VALUE];
    const int remaining = hist[SLOT_COUNT];
    const int segments = (n + SEG - 1) / SEG, loaded = n > p.K ? min(n / SPECULATIVE_SHARE, SPECULATIVE_CANDIDATES) : 0;
    constexpr int SPECULATIVE = SPECULATIVE_CANDIDATES / TOPK_THREADS, STAGED = STAGED_CANDIDATES / TOPK_THREADS;
    uint2 pairs[STAGED];
#pragma unroll
    for (int j = 0; j < SPECULATIVE; ++j) {
        const int i = threadIdx.x + j * TOPK_THREADS;
        if (i < loaded) pairs[j] = candidates[i];
    }
    uint32_t counts[SEGMENTS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) {
        const int s = threadIdx.x + j * TOPK_THREADS;
        counts[j] = n > p.K && s < segments ? segment_counts[s] : 0u;
    }
    // This thread's fine bins, FINE_BINS - 1 - FINE_PER_THREAD * i - j in fine[j].
    static_assert(FINE_PER_THREAD == 4, "one 16-byte load of fine bins per thread");
    int4* fine_bins = reinterpret_cast<int4*>(hist + FINE_OFFSET + FINE_BINS - FINE_PER_THREAD * (threadIdx.x + 1));
    const int4 fine_loaded = *fine_bins;
    const int fine[FINE_PER_THREAD] = {fine_loaded.w, fine_loaded.z, fine_loaded.y, fine_loaded.x};
    __syncthreads();  // every thread has read the slots before they are reset
    // The bins, the candidate count and the fine bins are zero again for the next call.
    for (int i = threadIdx.x; i <= SLOT_CANDIDATES; i += blockDim.x) hist[i] = 0;
    *fine_bins = make_int4(0, 0, 0, 0);
    if (n <= p.K) return;
    extern __shared__ uint32_t staged[];  // [STAGED_CANDIDATES] values, then as many positions (the launcher)
    uint32_t *values = staged, *positions = staged + STAGED_CANDIDATES;
    __shared__ ThresholdShared sh;
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) sh.selected[threadIdx.x + j * TOPK_THREADS] = counts[j];
    if (count <= STAGED_CANDIDATES) {
        if (count > loaded) {  // (uniform over the block)
#pragma unroll
            for (int j = 0; j < STAGED; ++j) {
                const int i = threadIdx.x + j * TOPK_THREADS;
                if (i >= loaded && i < count) pairs[j] = candidates[i];
            }
        }
#pragma unroll
        for (int j = 0; j < STAGED; ++j) {  // pairs[j] was loaded for every i < count
            const int i = threadIdx.x + j * TOPK_THREADS;
            if (i < count) {
                positions[i] = pairs[j].x;
                values[i] = pairs[j].y;
            }
        }
        __syncthreads();
        threshold_over(p, t, n, [&](int i) { return values[i]; }, [&](int i) { return positions[i]; }, count, prefix,
                       remaining, fine, sh);
    } else {  // a crowded bin: its candidates stay in global memory (L2)
        threshold_over(p, t, n, [&](int i) { return candidates[i].y; }, [&](int i) { return candidates[i].x; }, count,
                       prefix, remaining, fine, sh);
    }
}

// Writes first + i for each set bit i of `bits`, in ascending order, to dst[0], dst[1], ...
__device__ __forceinline__ void store_positions(int* dst, uint64_t bits, int first) {
    for (; bits != 0; bits &= bits - 1) *dst++ = first + __ffsll((long long)bits) - 1;
}

// Per (segment, token), one warp a segment (EMIT_SEGMENTS to a block of SEG_THREADS): the segment's selected
// positions (its mask, complete once the threshold kernel has added the candidates taken), in ascending order,
// at the segment's offset; the scores are not read again. Rows with visible <= K get 0..visible-1 and -1
// padding. A warp, not a block, per segment, and a lane 64 consecutive positions: four loads, one warp prefix sum
// and the stores, no block barrier. On the H200 a block a segment took 80 µs for a 2048-row chunk of 32K rows (31
// waves of blocks, each a chain of latencies); a warp a segment takes ~45, and a 2048-token prefill 40% less.
// Small grids of dense rows take `topk_emit_block_impl` instead (the launcher's `emit_policy::by_blocks`).
constexpr int EMIT_SEGMENTS = SEG_THREADS / 32;
__device__ void topk_emit_impl(const DsaParams& p) {
    const int t = blockIdx.y, segment = blockIdx.x * EMIT_SEGMENTS + threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = visible_keys(p, t), K = p.K;
    int* out = p.indices + (size_t)t * K;
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the threshold kernel's writes
    if (n <= K) {  // every visible position, then -1
        for (int s = segment * SEG + lane; s < min((segment + 1) * SEG, K); s += 32) out[s] = s < n ? s : -1;
        return;
    }
    if (segment * SEG >= n) return;
    // Lane l takes the positions of the candidates kernel's threads 8l .. 8l + 7: bits 8 (l % 4) .. 8 (l % 4) + 7
    // of the 8 mask words of that kernel's warp l / 4 (`mask_word_index`: word j, bit i holds the j-th position
    // of thread i). Byte j of `take` is byte l % 4 of word j (bit s: thread 8l + s's position j); its 8 x 8 bit
    // transpose (Hacker's Delight 7-3) puts position j of thread 8l + s at bit 8s + j, in position order.
    static_assert(SEG_ELEMS == 8 && SEG_THREADS / 32 * 4 == 32 && SEG == 64 * 32, "a lane: 8 threads' 8 positions");
    const uint2* words = reinterpret_cast<const uint2*>(segment_masks_of(p, t) + mask_word_index(segment, lane / 4, 0));
    const uint2 w01 = words[0], w23 = words[1], w45 = words[2], w67 = words[3];
    const uint32_t pick = lane % 4 | (lane % 4 + 4) << 4;  // __byte_perm: byte l % 4 of x, then of y
    const uint32_t low = __byte_perm(__byte_perm(w01.x, w01.y, pick), __byte_perm(w23.x, w23.y, pick), 0x5410);
    const uint32_t high = __byte_perm(__byte_perm(w45.x, w45.y, pick), __byte_perm(w67.x, w67.y, pick), 0x5410);
    uint64_t take = (uint64_t)high << 32 | low, swap;
    swap = (take ^ take >> 7) & 0x00AA00AA00AA00AAull;
    take ^= swap ^ swap << 7;
    swap = (take ^ take >> 14) & 0x0000CCCC0000CCCCull;
    take ^= swap ^ swap << 14;
    swap = (take ^ take >> 28) & 0x00000000F0F0F0F0ull;
    take ^= swap ^ swap << 28;
    // Sparse segments (at most DIRECT_STORES selected: contexts of 16K and more) store each lane's run as it is, the
    // shortest latency. Denser ones stage it in shared memory, half a warp's runs at a time (at most 1024
    // positions), and the warp copies them out 32 consecutive slots a store: each lane storing its own ~16 scattered
    // slots made an 8K prefill chunk's top-k 25% slower on the H200.
    constexpr int DIRECT_STORES = 256;
    const int count = __popcll(take), end = warp_inclusive_sum(count), total = __shfl_sync(0xffffffff, end, 31);
    const int first = segment * SEG + lane * 64;
    int* segment_out = out + segment_offsets_of(p, t)[segment];
    if (total <= DIRECT_STORES) {
        store_positions(segment_out + end - count, take, first);
        return;
    }
    __shared__ int staged[EMIT_SEGMENTS][SEG / 2];
    int* stage = staged[threadIdx.x / 32];
    for (int half = 0; half < 2; ++half) {
        const int base = __shfl_sync(0xffffffff, end - count, 16 * half);  // slots before this half's runs
        const int stop = __shfl_sync(0xffffffff, end, 16 * half + 15);
        if (lane / 16 == half) store_positions(stage + end - count - base, take, first);
        __syncwarp();
        for (int i = base + lane; i < stop; i += 32) segment_out[i] = stage[i - base];
        __syncwarp();  // the copy has read the stage before the next half overwrites it
    }
}

// The same rows as `topk_emit_impl` from a block of SEG_THREADS a segment, a thread SEG_ELEMS consecutive positions
// and one block scan: eight times the warps a segment, for grids too small to fill the device whose segments are
// dense (decode at 2K-16K positions: there a warp a segment, each lane walking ~16 set bits serially, took 5.6-7.0
// µs an 8K batch-64 step on the H200, a block a segment 3.4-4.8; docs/perf.md, session 30).
__device__ void topk_emit_block_impl(const DsaParams& p) {
    const int t = blockIdx.y, segment = blockIdx.x;
    const int n = visible_keys(p, t), K = p.K;
    const int first = segment * SEG + threadIdx.x * SEG_ELEMS;
    int* out = p.indices + (size_t)t * K;
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the threshold kernel's writes
    if (n <= K) {  // every visible position, then -1
#pragma unroll
        for (int j = 0; j < SEG_ELEMS; ++j)
            if (first + j < K) out[first + j] = first + j < n ? first + j : -1;
        return;
    }
    if (segment * SEG >= n) return;
    __shared__ int warp_sums[32];
    const int offset = segment_offsets_of(p, t)[segment], lane = threadIdx.x % 32;
    const uint32_t* masks = segment_masks_of(p, t);
    // Lane j < SEG_ELEMS: the warp's mask word j.
    const uint32_t word = lane < SEG_ELEMS ? masks[mask_word_index(segment, threadIdx.x / 32, lane)] : 0u;
    uint32_t take = 0;  // bit j: this thread's j-th position
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j) take |= (__shfl_sync(0xffffffff, word, j) >> lane & 1u) << j;
    int total;
    int slot = offset + block_exclusive_scan<SEG_THREADS>(__popc(take), warp_sums, total);
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j)
        if (take >> j & 1u) out[slot++] = first + j;
}

// ---------------------------------------------------------------------------------------------------------
// Top-k in one thread-block cluster per token
//
// dsa_topk_cluster_e*: the three top-k kernels above in one launch, for rows of at most CLUSTER_BLOCKS *
// CLUSTER_THREADS * E positions. A token's CLUSTER_BLOCKS blocks form one cluster; block r holds positions
// [r * SPAN, (r + 1) * SPAN) in registers, E consecutive ones per thread. The blocks exchange counts by
// pushing them into each other's shared memory (`st.async`, completing on the receiver's mbarrier): no
// kernel boundary, no global-memory meeting, and no cluster barrier after the first (a cluster barrier that
// orders shared-memory writes is a GPU-scope memory barrier on sm_90).
//   1. every block finds the threshold bin from the row's histogram (as dsa_topk_candidates), marks its
//      scores above it, lists the scores in it (its candidates) and counts them by their next 11 bits (the
//      fine bins);
//   2. the blocks send each other how many scores they hold above the threshold bin and how many candidates,
//      then (where the cluster's candidates fit: at most GATHER_CAPACITY) their candidates, so that every
//      block holds all of them in block order;
//   3. each block alone: the candidates' fine histogram, the fine bin of the K-th largest, and the few
//      candidates sharing the K-th's top 22 bits ranked (higher value, then lower position: the K-th largest
//      and the last tied position taken);
//   4. every block marks its taken candidates and writes its selected positions in order after those of the
//      blocks before it (their counts above the threshold bin plus their taken candidates, which it holds).
// Where the candidates do not fit, or more than FINE_LIST share the K-th's top 22 bits, steps 3 and 4 go by
// exchanges instead (3'): block r receives slice r of every block's fine histogram, sums it and sends the sum
// to every block; the blocks send each other their counts and the scores sharing the K-th's top 22 bits (more
// than FINE_LIST take the same two steps over the last 10 bits, after which the scores equal to the K-th go to
// the lowest positions, block by block).
constexpr int CLUSTER_BLOCKS = 8, CLUSTER_THREADS = 512;
constexpr int FINE_SLICE = FINE_BINS / CLUSTER_BLOCKS;  // fine bins summed by each block
constexpr int LOW_BITS = FINE_SHIFT, LOW_BINS = 1 << LOW_BITS, LOW_SLICE = LOW_BINS / CLUSTER_BLOCKS;
static_assert(HIST_BINS == 4 * CLUSTER_THREADS && FINE_BINS == 4 * CLUSTER_THREADS && LOW_BINS == 2 * CLUSTER_THREADS,
              "four (low: two) bins per thread");
static_assert(FINE_SLICE == CLUSTER_THREADS / 2 && LOW_SLICE * CLUSTER_BLOCKS / 4 <= CLUSTER_THREADS,
              "one 16-byte push per thread");
// Threshold-bin candidates a block lists in shared memory (~4% of a row's scores; a block with more works
// from its registers instead).
constexpr int CLUSTER_CANDIDATES = 2048;
// The most candidates of a cluster that every block gathers (step 2); more take the histogram merge.
constexpr int GATHER_CAPACITY = 2048;

// What a block receives, each on its own mbarrier (`ClusterTopkShared::arrived`).
enum ClusterExchange {
    FINE_PARTS,      // slice `rank` of every block's fine histogram
    FINE_MERGED,     // the cluster's fine histogram, a slice from each block
    COUNTS,          // every block's (selected for sure, listed) counts
    LISTS,           // every block's listed scores, in block order
    LOW_PARTS,       // crowded fine bin: as FINE_PARTS for the last 10 bits
    LOW_MERGED,      // ... as FINE_MERGED
    CROWDED_COUNTS,  // ... every block's (selected for sure, equal to the K-th) counts
    GATHER_COUNTS,   // every block's (above the threshold bin, candidates) counts
    GATHERED,        // every block's candidates, in block order
    EXCHANGES
};

struct ClusterTopkShared {
    uint64_t arrived[EXCHANGES];
    alignas(16) int fine[FINE_BINS];                              // this block's fine histogram
    alignas(16) int low[LOW_BINS];                                // ... and low one (crowded)
    alignas(16) int fine_parts[CLUSTER_BLOCKS][FINE_SLICE];       // received
    alignas(16) int fine_merged[FINE_BINS];                       // the cluster's (merged, or from `gathered`)
    alignas(16) int fine_groups[FINE_BINS / GROUP_BINS];          // gathered: fine_merged's group sums
    alignas(16) int low_parts[CLUSTER_BLOCKS][LOW_SLICE];
    alignas(16) int low_merged[LOW_BINS];
    alignas(16) int2 counts[CLUSTER_BLOCKS];
    alignas(16) int2 crowded_counts[CLUSTER_BLOCKS];
    alignas(16) uint2 lists[FINE_LIST];                           // (value, position), block by block
    alignas(16) uint2 list[FINE_LIST];                            // this block's (gathered: the cluster's)
    alignas(16) uint2 gathered[GATHER_CAPACITY];                  // (value, position): the cluster's candidates
    alignas(16) int2 gather_counts[CLUSTER_BLOCKS];
    uint32_t candidate_values[CLUSTER_CANDIDATES], candidate_positions[CLUSTER_CANDIDATES];
    uint32_t taken[CLUSTER_THREADS][2];  // thread i's selected candidates, bit j % 32 of word j / 32 for its position j
    int candidates, listed;
    int block_taken[CLUSTER_BLOCKS];
    int warp_sums[32];
    int definite_sums[CLUSTER_THREADS / 32];  // each warp's scores selected for sure (or earlier blocks' taken)
    int3 located;
    uint32_t kth, last_tied;
};

// Sends 8 or 16 bytes into the same variable of block `rank`, completing them on that block's `bar`.
__device__ __forceinline__ void push_u32x2(const void* dst, uint2 v, const uint64_t* bar, uint32_t rank) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.u32 [%0], {%1, %2}, [%3];\n"
                 ::"r"(cluster_map(dst, rank)), "r"(v.x), "r"(v.y), "r"(cluster_map(bar, rank)) : "memory");
}
__device__ __forceinline__ void push_u32x4(const void* dst, uint4 v, const uint64_t* bar, uint32_t rank) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.u32 [%0], {%1, %2, %3, %4}, [%5];\n"
                 ::"r"(cluster_map(dst, rank)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_map(bar, rank))
                 : "memory");
}

// Step 2 (and its repeat over the low bits): block `rank` sends slice r of its histogram `local` (BINS bins)
// to block r's `parts`, sums the slices it receives (exchange `parts_exchange`) and sends the sum to every
// block's `merged` (exchange `merged_exchange`), where the whole histogram arrives.
template <int BINS>
__device__ __forceinline__ void cluster_merge(const int* local, int (*parts)[BINS / CLUSTER_BLOCKS], int* merged,
                                              uint64_t* arrived, uint32_t rank, int parts_exchange,
                                              int merged_exchange) {
    constexpr int SLICE = BINS / CLUSTER_BLOCKS, PIECES = SLICE / 4;  // 16-byte pieces per slice
    // This block's counts of every slice to the slice's owner (thread i: piece i % PIECES of slice i / PIECES).
    if (threadIdx.x < CLUSTER_BLOCKS * PIECES) {
        const int owner = threadIdx.x / PIECES, piece = threadIdx.x % PIECES;
        const int4 c = reinterpret_cast<const int4*>(local + owner * SLICE)[piece];
        push_u32x4(reinterpret_cast<const int4*>(parts[rank]) + piece, make_uint4(c.x, c.y, c.z, c.w),
                   &arrived[parts_exchange], owner);
    }
    mbarrier_wait(&arrived[parts_exchange], 0);
    // The sum of this block's slice, to every block (thread i: piece i % PIECES to block i / PIECES).
    if (threadIdx.x < CLUSTER_BLOCKS * PIECES) {
        const int to = threadIdx.x / PIECES, piece = threadIdx.x % PIECES;
        int4 sum = make_int4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < CLUSTER_BLOCKS; ++r) {
            const int4 c = reinterpret_cast<const int4*>(parts[r])[piece];
            sum.x += c.x; sum.y += c.y; sum.z += c.z; sum.w += c.w;
        }
        push_u32x4(reinterpret_cast<const int4*>(merged + rank * SLICE) + piece, make_uint4(sum.x, sum.y, sum.z, sum.w),
                   &arrived[merged_exchange], to);
    }
    mbarrier_wait(&arrived[merged_exchange], 0);
}

// The bin of the remaining-th largest in a histogram of PER * CLUSTER_THREADS bins, counted from the top,
// from each thread's PER bins (counts[j]: bin BINS - 1 - PER * threadIdx.x - j): (bin, how many to take from
// it, its count), in every thread.
template <int PER>
__device__ int3 locate(const int (&counts)[PER], int remaining, ClusterTopkShared& sh) {
    constexpr int BINS = PER * CLUSTER_THREADS;
    int sum = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) sum += counts[j];
    int total;
    int above = block_exclusive_scan<CLUSTER_THREADS>(sum, sh.warp_sums, total);
    if (above < remaining && above + sum >= remaining) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            if (above + counts[j] >= remaining) {
                sh.located = make_int3(BINS - 1 - PER * threadIdx.x - j, remaining - above, counts[j]);
                break;
            }
            above += counts[j];
        }
    }
    __syncthreads();
    return sh.located;
}

// `locate` over a histogram in shared memory.
template <int PER>
__device__ int3 locate(const int* hist, int remaining, ClusterTopkShared& sh) {
    int counts[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) counts[j] = hist[PER * CLUSTER_THREADS - 1 - PER * threadIdx.x - j];
    return locate(counts, remaining, sh);
}

// `locate` by one warp alone, in every warp (no block barrier): the bin of the remaining-th largest in a
// histogram of HIST_BINS bins (global or shared memory) from its 16-bin group sums `groups`: a warp scan over
// the groups (four per lane, from the top), then one over the 16 bins of the group it falls in. `remaining`
// is at most the histogram's total (K below the visible count; the fine bins hold the threshold bin's
// candidates). Returns (bin, how many to take from it, its count).
__device__ __forceinline__ int3 locate_by_groups(const int* groups, const int* bins, int remaining) {
    const int lane = threadIdx.x % 32;
    const auto crossing = [&](int count, int& before) {  // first lane whose inclusive prefix reaches remaining
        const int inclusive = warp_inclusive_sum(count);
        const unsigned reached = __ballot_sync(0xffffffff, inclusive >= remaining);
        const int src = reached ? __ffs(reached) - 1 : 31;
        before = __shfl_sync(0xffffffff, inclusive - count, src);
        return src;
    };
    static_assert(HIST_GROUPS == 4 * 32 && GROUP_BINS <= 32, "four groups per lane, a group's bins in a warp");
    const int4 four = reinterpret_cast<const int4*>(groups)[HIST_GROUPS / 4 - 1 - lane];  // groups 127 - 4 lane - j
    int before;
    const int src = crossing(four.x + four.y + four.z + four.w, before);
    const int c[4] = {__shfl_sync(0xffffffff, four.w, src), __shfl_sync(0xffffffff, four.z, src),
                      __shfl_sync(0xffffffff, four.y, src), __shfl_sync(0xffffffff, four.x, src)};
    int group = HIST_GROUPS - 1 - 4 * src - 3;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        if (before + c[j] >= remaining) {
            group = HIST_GROUPS - 1 - 4 * src - j;
            break;
        }
        before += c[j];
    }
    remaining -= before;
    const int bin_here = group * GROUP_BINS + GROUP_BINS - 1 - lane;  // from the group's top
    const int count = lane < GROUP_BINS ? bins[bin_here] : 0;
    const int at = crossing(count, before);
    return make_int3(group * GROUP_BINS + GROUP_BINS - 1 - at, remaining - before, __shfl_sync(0xffffffff, count, at));
}

// The sum over the block of this thread's PER bins of `hist` above `bin` (the thread's bins as `locate`'s).
template <int PER>
__device__ __forceinline__ int count_above(const int* hist, int bin) {
    int above = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int b = PER * CLUSTER_THREADS - 1 - PER * threadIdx.x - j;
        if (b > bin) above += hist[b];
    }
    return above;
}

// The sum of each thread's `mine` over the block, in every thread; its block barrier also completes the
// block's earlier shared-memory writes.
__device__ __forceinline__ int block_sum(int mine, ClusterTopkShared& sh) {
    mine = __reduce_add_sync(0xffffffff, mine);
    if (threadIdx.x % 32 == 0) sh.definite_sums[threadIdx.x / 32] = mine;
    __syncthreads();
    int sum = 0;
#pragma unroll
    for (int w = 0; w < CLUSTER_THREADS / 32; ++w) sum += sh.definite_sums[w];
    return sum;
}

// Sums each thread's `mine` over the block and sends (the sum, `second`) to entry `rank` of `counts` in every
// block, then waits for every block's (exchange `exchange`). `second` is read after the block barrier, so it may
// be a shared count the block's threads have just finished.
__device__ __forceinline__ void exchange_counts(int mine, const int& second, int2* counts, int exchange,
                                                uint32_t rank, ClusterTopkShared& sh) {
    const int sum = block_sum(mine, sh);
    if (threadIdx.x < CLUSTER_BLOCKS)
        push_u32x2(&counts[rank], make_uint2(sum, second), &sh.arrived[exchange], threadIdx.x);
    mbarrier_wait(&sh.arrived[exchange], 0);
}

// Sends this block's `mine` entries (`entry(i)`) to `dst[start + i]` in every block of the cluster and waits
// until the cluster's `total` entries have arrived in its own `dst` (exchange `exchange`).
template <typename Entry>
__device__ __forceinline__ void all_gather(uint2* dst, int start, int mine, int total, int exchange, Entry entry,
                                           ClusterTopkShared& sh) {
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(&sh.arrived[exchange], total * 8);
    for (int k = threadIdx.x; k < mine * CLUSTER_BLOCKS; k += CLUSTER_THREADS) {
        const int i = k % mine, to = k / mine;  // entry i to block `to`
        push_u32x2(&dst[start + i], entry(i), &sh.arrived[exchange], to);
    }
    mbarrier_wait(&sh.arrived[exchange], 0);
}

// The entry of rank `need - 1` among the first `count` of `list` (higher value first, then lower position):
// the K-th value and the last tied position taken, in every thread.
__device__ __forceinline__ uint2 rank_list(const uint2* list, int count, int need, ClusterTopkShared& sh) {
    if ((int)threadIdx.x < count) {
        const uint2 entry = list[threadIdx.x];
        int higher = 0;
        for (int j = 0; j < count; ++j) {
            const uint2 other = list[j];
            higher += other.x > entry.x || (other.x == entry.x && other.y < entry.y);
        }
        if (higher == need - 1) {
            sh.kth = entry.x;
            sh.last_tied = entry.y;
        }
    }
    __syncthreads();
    return make_uint2(sh.kth, sh.last_tied);
}

// The dynamic shared memory the launcher gives a cluster top-k block (`CLUSTER_SHARED_BYTES` in Rust).
constexpr int CLUSTER_SHARED_BYTES = 80 * 1024;
static_assert(sizeof(ClusterTopkShared) <= CLUSTER_SHARED_BYTES, "the launcher's dynamic shared memory");

template <int E>
__device__ void topk_cluster_impl(const DsaParams& p) {
    constexpr int SPAN = CLUSTER_THREADS * E;
    static_assert(E <= 64, "one 64-bit mask per thread");
    extern __shared__ __align__(16) unsigned char cluster_smem[];
    ClusterTopkShared& sh = *reinterpret_cast<ClusterTopkShared*>(cluster_smem);
    const int t = blockIdx.y;
    const uint32_t rank = cluster_rank();
    // The exchanges' barriers, each expecting its bytes from the cluster (LISTS: once the counts are in);
    // the other blocks may send as soon as the cluster barrier below has made them visible.
    if (threadIdx.x == 0) {
        constexpr int BYTES[EXCHANGES] = {FINE_SLICE * 4 * CLUSTER_BLOCKS, FINE_BINS * 4, 8 * CLUSTER_BLOCKS, 0,
                                          LOW_SLICE * 4 * CLUSTER_BLOCKS, LOW_BINS * 4, 8 * CLUSTER_BLOCKS,
                                          8 * CLUSTER_BLOCKS, 0};
        for (int x = 0; x < EXCHANGES; ++x) mbarrier_init(&sh.arrived[x], 1);
        for (int x = 0; x < EXCHANGES; ++x)
            if (x != LISTS && x != GATHERED) mbarrier_arrive_expect_tx(&sh.arrived[x], BYTES[x]);
    }
    cluster_arrive_after_mbarrier_init();
    const int n = visible_keys(p, t), K = p.K;
    int* out = p.indices + (size_t)t * K;
    for (int i = threadIdx.x; i < FINE_BINS; i += CLUSTER_THREADS) sh.fine[i] = 0;
    for (int i = threadIdx.x; i < LOW_BINS; i += CLUSTER_THREADS) sh.low[i] = 0;
    for (int i = threadIdx.x; i < FINE_BINS; i += CLUSTER_THREADS) sh.fine_merged[i] = 0;  // (gathered: counted here)
    for (int i = threadIdx.x; i < FINE_BINS / GROUP_BINS; i += CLUSTER_THREADS) sh.fine_groups[i] = 0;
    sh.taken[threadIdx.x][0] = sh.taken[threadIdx.x][1] = 0;
    if (threadIdx.x == 0) sh.candidates = sh.listed = 0;
    if (threadIdx.x < CLUSTER_BLOCKS) sh.block_taken[threadIdx.x] = 0;
    // The zeroed bins and counters before any warp counts into them (no block scan orders them later), while
    // the block waits for the score kernel anyway.
    __syncthreads();
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the score kernel's writes
    if (n <= K) {  // every visible position, then -1 (the same for every block of the cluster: none sends)
        for (int i = rank * CLUSTER_THREADS + threadIdx.x; i < K; i += CLUSTER_BLOCKS * CLUSTER_THREADS)
            out[i] = i < n ? i : -1;
        cluster_wait_arrivals();
        return;
    }
    int* hist = p.hist + (size_t)t * HIST_STRIDE;
    const int block_first = rank * SPAN, first = block_first + threadIdx.x * E;
    // The bins' lines into L1 (each warp's second look at the bins below is then a hit) and this thread's
    // scores, loaded together.
    static_assert(HIST_BINS * 4 / 128 <= CLUSTER_THREADS, "one line per thread");
    if (threadIdx.x < HIST_BINS * 4 / 128) prefetch_l1(hist + threadIdx.x * 32);
    float v[E];
    load_scores(p.scores + (size_t)t * p.score_stride, first, n, v);

    // 1. The threshold bin and how many to take from it (every warp alone, from the bins' group sums); the
    // scores above it (a bit per score in `selected`); the candidates, listed, and their fine histogram.
    const int3 coarse = locate_by_groups(hist + GROUP_OFFSET, hist, K);
    const uint32_t bin = coarse.x;
    const int remaining = coarse.y;
    uint32_t u[E];
    uint64_t selected = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        u[j] = ordered(v[j]);
        const bool valid = first + j < n;
        const uint32_t b = u[j] >> (32 - HIST_BITS);
        if (valid && b > bin) selected |= 1ull << j;
        if (valid && b == bin) {
            atomicAdd(&sh.fine[(u[j] >> FINE_SHIFT) & (FINE_BINS - 1)], 1);
            const int slot = atomicAdd(&sh.candidates, 1);
            if (slot < CLUSTER_CANDIDATES) {
                sh.candidate_values[slot] = u[j];
                sh.candidate_positions[slot] = first + j;
            }
        }
    }
    int definite = __popcll(selected);
    cluster_wait_arrivals();  // every block's barriers are set up

    // 2. Every block's counts (scores above the threshold bin, candidates) to every block; then, where the
    // cluster's candidates fit, every block's candidates to every block (in block order).
    // (Its block barrier also completes the block's candidate list and fine histogram.)
    exchange_counts(definite, sh.candidates, sh.gather_counts, GATHER_COUNTS, rank, sh);
    if (rank == 0) {  // every block has read the row's bins and groups (before sending its counts): zero them
        for (int i = threadIdx.x; i < HIST_BINS; i += CLUSTER_THREADS) hist[i] = 0;
        if (threadIdx.x < HIST_GROUPS) hist[GROUP_OFFSET + threadIdx.x] = 0;
    }
    int gathered = 0, my_start = 0;
    bool listed = true;  // every block's candidates are in its list
    for (int b = 0; b < CLUSTER_BLOCKS; ++b) {
        if (b == (int)rank) my_start = gathered;
        gathered += sh.gather_counts[b].y;
        listed &= sh.gather_counts[b].y <= CLUSTER_CANDIDATES;
    }
    const int mine = sh.candidates;
    int offset = 0;
    bool selected_by_gathering = false;
    if (listed && gathered <= GATHER_CAPACITY) {  // (uniform over the cluster)
        all_gather(sh.gathered, my_start, mine, gathered, GATHERED,
                   [&](int i) { return make_uint2(sh.candidate_values[i], sh.candidate_positions[i]); }, sh);
        // 3. Locally: the candidates' fine histogram, the fine bin of the K-th largest, and (when few share it)
        // the K-th value and the last tied position by ranking them.
        for (int i = threadIdx.x; i < gathered; i += CLUSTER_THREADS) {
            const uint32_t fine_bin = (sh.gathered[i].x >> FINE_SHIFT) & (FINE_BINS - 1);
            atomicAdd(&sh.fine_merged[fine_bin], 1);
            atomicAdd(&sh.fine_groups[fine_bin / GROUP_BINS], 1);
        }
        __syncthreads();
        static_assert(FINE_BINS == HIST_BINS, "locate_by_groups takes HIST_BINS bins: the fine ones must match");
        const int3 fine = locate_by_groups(sh.fine_groups, sh.fine_merged, remaining);
        if (fine.z <= FINE_LIST) {  // (uniform: every block holds the same candidates)
            const uint32_t top22 = bin << FINE_BITS | (uint32_t)fine.x;
            for (int i = threadIdx.x; i < gathered; i += CLUSTER_THREADS) {
                const uint2 entry = sh.gathered[i];
                if (entry.x >> FINE_SHIFT == top22) sh.list[atomicAdd(&sh.listed, 1)] = entry;
            }
            __syncthreads();
            const uint2 kth_tied = rank_list(sh.list, sh.listed, fine.y, sh);
            // 4. The taken candidates: this block's marked, the earlier blocks' counted for its offset.
            int taken_before = 0;
            for (int i = threadIdx.x; i < my_start + mine; i += CLUSTER_THREADS) {
                const uint2 entry = sh.gathered[i];
                if (among_k(entry.x, entry.y, kth_tied)) {
                    if (i < my_start) {
                        ++taken_before;
                    } else {
                        const int position = entry.y - block_first, j = position % E;
                        atomicOr(&sh.taken[position / E][j / 32], 1u << (j % 32));
                    }
                }
            }
            offset = block_sum(taken_before, sh);  // (its barrier also completes the marks)
            for (int b = 0; b < (int)rank; ++b) offset += sh.gather_counts[b].x;
            selected_by_gathering = true;
        }
    }
    if (!selected_by_gathering) {
        // 3'. The cluster's fine histogram, in every block; the fine bin of the K-th largest.
        cluster_merge<FINE_BINS>(sh.fine, sh.fine_parts, sh.fine_merged, sh.arrived, rank, FINE_PARTS, FINE_MERGED);
        const int3 fine = locate<4>(sh.fine_merged, remaining, sh);
        const uint32_t top22 = bin << FINE_BITS | (uint32_t)fine.x;
        definite += count_above<4>(sh.fine, fine.x);
        // The block's candidates: from its list, or from its registers where the list overflowed.
        const int candidates = sh.candidates;
        const auto for_each_candidate = [&](auto&& f) {
            if (candidates <= CLUSTER_CANDIDATES) {
                for (int i = threadIdx.x; i < candidates; i += CLUSTER_THREADS)
                    f(sh.candidate_values[i], sh.candidate_positions[i]);
            } else {
#pragma unroll
                for (int j = 0; j < E; ++j)
                    if (first + j < n && u[j] >> (32 - HIST_BITS) == bin) f(u[j], (uint32_t)(first + j));
            }
        };
        if (fine.z <= FINE_LIST) {  // (uniform over the cluster)
            // The cluster's scores sharing the K-th's top 22 bits, in every block.
            for_each_candidate([&](uint32_t value, uint32_t position) {
                if (value >> FINE_SHIFT == top22) sh.list[atomicAdd(&sh.listed, 1)] = make_uint2(value, position);
            });
            exchange_counts(definite, sh.listed, sh.counts, COUNTS, rank, sh);
            int listed = 0, before = 0;  // the cluster's, and the blocks' before this one
            for (int b = 0; b < CLUSTER_BLOCKS; ++b) {
                if (b == (int)rank) before = listed;
                listed += sh.counts[b].y;
            }
            all_gather(sh.lists, before, sh.listed, listed, LISTS, [&](int i) { return sh.list[i]; }, sh);
            // Rank them.
            const uint2 kth_tied = rank_list(sh.lists, listed, fine.y, sh);
            if ((int)threadIdx.x < listed) {  // entry i came from the block whose share of the list holds i
                const uint2 entry = sh.lists[threadIdx.x];
                if (among_k(entry.x, entry.y, kth_tied)) {
                    int source = 0;
                    for (int b = 0, end = 0; b < CLUSTER_BLOCKS; ++b) {
                        end += sh.counts[b].y;
                        if ((int)threadIdx.x >= end) source = b + 1;
                    }
                    atomicAdd(&sh.block_taken[source], 1);
                }
            }
            // The block's candidates taken: above the fine bin, or in it and ranked within the K.
            for_each_candidate([&](uint32_t value, uint32_t position) {
                if (among_k(value, position, kth_tied)) {
                    const int i = position - block_first;
                    const int j = i % E;  // 32-bit words: a 64-bit shared atomicOr is a compare-and-swap loop
                    atomicOr(&sh.taken[i / E][j / 32], 1u << (j % 32));
                }
            });
            __syncthreads();
            for (int b = 0; b < (int)rank; ++b) offset += sh.counts[b].x + sh.block_taken[b];
        } else {
            // A crowded fine bin: the same over the last 10 bits, then the scores equal to the K-th by
            // position, block by block (from the registers: the candidates' list is not in position order).
            for_each_candidate([&](uint32_t value, uint32_t) {
                if (value >> FINE_SHIFT == top22) atomicAdd(&sh.low[value & (LOW_BINS - 1)], 1);
            });
            __syncthreads();
            cluster_merge<LOW_BINS>(sh.low, sh.low_parts, sh.low_merged, sh.arrived, rank, LOW_PARTS, LOW_MERGED);
            const int3 low = locate<2>(sh.low_merged, fine.y, sh);
            const uint32_t kth = top22 << LOW_BITS | (uint32_t)low.x;
            definite += count_above<2>(sh.low, low.x);
            int equal = 0;
#pragma unroll
            for (int j = 0; j < E; ++j) equal += first + j < n && u[j] == kth;
            int block_equal;
            int equal_before = block_exclusive_scan<CLUSTER_THREADS>(equal, sh.warp_sums, block_equal);
            exchange_counts(definite, block_equal, sh.crowded_counts, CROWDED_COUNTS, rank, sh);
            // The low.y equal scores taken go to the lowest positions: the blocks' in order.
            int equal_seen = 0, take_equal = 0;
            for (int b = 0; b < CLUSTER_BLOCKS; ++b) {
                const int taken = min(max(low.y - equal_seen, 0), sh.crowded_counts[b].y);
                if (b < (int)rank) offset += sh.crowded_counts[b].x + taken;
                if (b == (int)rank) take_equal = taken;
                equal_seen += sh.crowded_counts[b].y;
            }
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const bool in_bin = first + j < n && u[j] >> (32 - HIST_BITS) == bin;
                if (in_bin && (u[j] > kth || (u[j] == kth && equal_before++ < take_equal))) selected |= 1ull << j;
            }
        }

    }

    // This block's selected positions, in order, after the blocks before it.
    selected |= (uint64_t)sh.taken[threadIdx.x][1] << 32 | sh.taken[threadIdx.x][0];
    int block_total;
    int slot = offset + block_exclusive_scan<CLUSTER_THREADS>(__popcll(selected), sh.warp_sums, block_total);
    for (; selected != 0; selected &= selected - 1) out[slot++] = first + __ffsll(selected) - 1;
}

// Quantises float rows to e4m3 with one scale per row: scale = amax / 448 (1 for an all-zero row), byte =
// e4m3(x / scale), round to nearest even, saturating. One warp per row.
template <typename T>
__device__ void quantize_fp8_impl(const T* rows, uint8_t* bytes, float* scales, int n, int D) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* x = rows + (size_t)row * D;
    float amax = 0.f;
    for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(float(x[d])));
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    for (int d = lane; d < D; d += 32)
        bytes[(size_t)row * D + d] = __nv_cvt_float_to_fp8(float(x[d]) / scale, __NV_SATFINITE, __NV_E4M3);
    if (lane == 0) scales[row] = scale;
}

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
