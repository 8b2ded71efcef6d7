// DSA lightning indexer over a paged key cache (contract: ops/src/dsa_indexer.rs), in two kernels:
//
//   dsa_scores_*   score(t, s) = sum_h w[t,h] * relu(q[t,h,:] . key(s)) for every position s of the token's
//                  sequence, -inf at s >= visible[t]; one f32 row of `score_stride` per token.
//   dsa_topk       per token, the set of the min(K, visible) highest scores; equal scores go to the lower
//                  position; written in ascending position order, -1 padded.
//
// A token whose sequence index is outside the block table has no visible keys (all -1).
//
// key(s) = keys[block_table[seq][s / bs] * bs + s % bs] with seq = token_seq[t]. Key layouts: bf16 rows, f32
// rows, or FP8 e4m3 rows with one f32 scale per key (key = scale * e4m3). An e4m3 value is exact in bf16, and
// relu(scale * x) = scale * relu(x) for scale > 0, so the FP8 kernel runs the bf16 mma on the raw e4m3 values
// and multiplies each key's column of scores by its scale.
//
// bf16/FP8 scores (mma.sync.m16n8k16, f32 accumulate): a block of 4 warps takes one token and KEYS_PER_BLOCK
// positions; each warp holds the token's Q fragments (MT tiles of 16 heads x D) in registers and scores 16
// keys of each 64-key tile; the head sum is a shuffle reduction over the accumulator rows.
//
// Top-k: one block per token, an exact radix select on the order-preserving integer of each score. The
// score kernel already counts each row's scores by their top 11 bits (a 2048-bin histogram in global
// memory), so the top-k block knows the bin of the K-th largest score without reading the row; one pass
// gathers that bin's values into shared memory, three 8-bit digit passes over them find the K-th value
// exactly (over the row itself if the bin overflows shared memory), and one ordered pass keeps every score
// above it and the lowest positions among those equal to it. The histogram rows are zeroed again by the
// top-k block that read them, ready for the next call.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "mma.cuh"

typedef __nv_bfloat16 bf16;

struct DsaParams {
    const void* q;            // [T, H, D] bf16 or f32
    const float* weights;     // [T, H]
    const void* keys;         // [rows, D] bf16, f32 or e4m3 bytes
    const float* key_scales;  // [rows] (FP8 layout)
    const int* block_table;   // [B, max_blocks]
    const int* token_seq;     // [T]
    const int* visible;       // [T]
    float* scores;            // [T, score_stride]
    int* hist;                // [T, HIST_BINS] counts of each row's scores by top bits (zero between calls)
    int* indices;             // [T, K]
    int T, H, D, K, block_size, max_blocks, batch, score_stride, positions;  // positions: columns per row
};

constexpr int HIST_BITS = 11;
constexpr int HIST_BINS = 1 << HIST_BITS;
constexpr int TILE_KEYS = 64;                 // keys per shared-memory tile
constexpr int TILES_PER_BLOCK = 1;
constexpr int KEYS_PER_BLOCK = TILE_KEYS * TILES_PER_BLOCK;
constexpr int SCORE_WARPS = 4;
constexpr int KEY_PAD = 8;                    // bf16 of padding per key row: conflict-free ldmatrix

// Order-preserving integer of a score: a > b  <=>  ordered(a) > ordered(b); -0.0 and 0.0 map together.
__device__ __forceinline__ uint32_t ordered(float v) {
    const uint32_t bits = __float_as_uint(v + 0.0f);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// Keys token t may see: none when its sequence index is not a row of the block table.
__device__ __forceinline__ int visible_keys(const DsaParams& p, int t) {
    const int seq = p.token_seq[t];
    return seq >= 0 && seq < p.batch ? p.visible[t] : 0;
}

// Physical row of position s of the token's sequence.
__device__ __forceinline__ long long key_row(const DsaParams& p, int seq, int s) {
    return (long long)p.block_table[(size_t)seq * p.max_blocks + s / p.block_size] * p.block_size + s % p.block_size;
}

// bf16 / FP8 scores. MT tiles of 16 heads (H <= 16 * MT), rows of D (a multiple of 16).
template <int D, int MT, bool FP8>
__device__ __forceinline__ void scores_mma(const DsaParams& p) {
    constexpr int LD = D + KEY_PAD;
    constexpr int KSTEPS = D / 16;
    const int t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first = blockIdx.x * KEYS_PER_BLOCK;
    const int visible = visible_keys(p, t);
    const int seq = p.token_seq[t];
    __shared__ __align__(16) bf16 qs[MT * 16 * LD];
    __shared__ __align__(16) bf16 ks[TILE_KEYS * LD];
    __shared__ float ws[MT * 16];
    __shared__ float scale_s[TILE_KEYS];
    __shared__ int bins[HIST_BINS];  // this block's share of the row's histogram
    for (int i = threadIdx.x; i < HIST_BINS; i += blockDim.x) bins[i] = 0;

    const bf16* q = static_cast<const bf16*>(p.q) + (size_t)t * p.H * D;
    for (int i = threadIdx.x; i < MT * 16 * (D / 8); i += blockDim.x) {
        const int h = i / (D / 8), c = (i % (D / 8)) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (h < p.H) v = *reinterpret_cast<const uint4*>(q + (size_t)h * D + c);
        *reinterpret_cast<uint4*>(qs + h * LD + c) = v;
    }
    for (int h = threadIdx.x; h < MT * 16; h += blockDim.x) ws[h] = h < p.H ? p.weights[(size_t)t * p.H + h] : 0.f;
    __syncthreads();
    uint32_t qa[MT][KSTEPS][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) ldmatrix_x4(qa[m][k], qs + (m * 16 + lane % 16) * LD + k * 16 + (lane / 16) * 8);
    float w_row[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        w_row[m][0] = ws[m * 16 + lane / 4];
        w_row[m][1] = ws[m * 16 + lane / 4 + 8];
    }

    for (int tile = 0; tile < TILES_PER_BLOCK; ++tile) {
        const int base = first + tile * TILE_KEYS;
        if (base >= p.positions) break;
        __syncthreads();  // the previous tile is consumed
        // Load 64 keys (zero past the visible range), as bf16.
        constexpr int CHUNK = FP8 ? 16 : 8;  // elements per 16-byte load
        for (int i = threadIdx.x; i < TILE_KEYS * (D / CHUNK); i += blockDim.x) {
            const int r = i / (D / CHUNK), c = (i % (D / CHUNK)) * CHUNK;
            const int s = base + r;
            bf16* dst = ks + r * LD + c;
            if (s < visible) {
                const long long row = key_row(p, seq, s);
                if constexpr (FP8) {
                    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(p.keys) + row * D + c);
                    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        __nv_fp8_e4m3 v;
                        v.__x = b[j];
                        dst[j] = __float2bfloat16(float(v));
                    }
                } else {
                    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.keys) + row * D + c);
                }
            } else {
#pragma unroll
                for (int j = 0; j < CHUNK; ++j) dst[j] = __float2bfloat16(0.f);
            }
        }
        if constexpr (FP8) {
            for (int r = threadIdx.x; r < TILE_KEYS; r += blockDim.x) {
                const int s = base + r;
                scale_s[r] = s < visible ? p.key_scales[key_row(p, seq, s)] : 0.f;
            }
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 keys: MT x 2 accumulators of 16 heads x 8 keys.
        float acc[MT][2][4] = {};
        const int key0 = warp * 16;
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            uint32_t b[4];
            ldmatrix_x4(b, ks + (key0 + lane % 8 + (lane / 16) * 8) * LD + k * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mma_bf16(acc[m][0], qa[m][k], b[0], b[1]);
                mma_bf16(acc[m][1], qa[m][k], b[2], b[3]);
            }
        }
        // sum_h w[h] relu(S[h, key]): this thread's rows, then across the 8 row groups of the warp.
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            float col[2] = {0.f, 0.f};
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j) col[j & 1] += w_row[m][j / 2] * fmaxf(acc[m][n][j], 0.f);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                col[c] += __shfl_xor_sync(0xffffffff, col[c], 4);
                col[c] += __shfl_xor_sync(0xffffffff, col[c], 8);
                col[c] += __shfl_xor_sync(0xffffffff, col[c], 16);
            }
            if (lane < 4) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int r = key0 + n * 8 + lane * 2 + c, s = base + r;
                    if (s < p.positions) {
                        float v = col[c];
                        if constexpr (FP8) v *= scale_s[r];
                        p.scores[(size_t)t * p.score_stride + s] = s < visible ? v : -INFINITY;
                        if (s < visible) atomicAdd(&bins[ordered(v) >> (32 - HIST_BITS)], 1);
                    }
                }
            }
        }
    }
    // Merge into the row's histogram: one global atomic per non-empty bin, not per key.
    __syncthreads();
    for (int i = threadIdx.x; i < HIST_BINS; i += blockDim.x)
        if (bins[i] != 0) atomicAdd(&p.hist[(size_t)t * HIST_BINS + i], bins[i]);
}

// f32 scores: plain FMA, one warp per key (full precision for f32 models).
__device__ void scores_f32(const DsaParams& p) {
    const int t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int visible = visible_keys(p, t), seq = p.token_seq[t], D = p.D;
    extern __shared__ float qf[];  // [H][D], then [H] weights
    const float* q = static_cast<const float*>(p.q) + (size_t)t * p.H * D;
    for (int i = threadIdx.x; i < p.H * D; i += blockDim.x) qf[i] = q[i];
    for (int h = threadIdx.x; h < p.H; h += blockDim.x) qf[p.H * D + h] = p.weights[(size_t)t * p.H + h];
    __syncthreads();
    const int last = min(blockIdx.x * KEYS_PER_BLOCK + KEYS_PER_BLOCK, p.positions);
    for (int s = blockIdx.x * KEYS_PER_BLOCK + warp; s < last; s += SCORE_WARPS) {
        float score = -INFINITY;
        if (s < visible) {
            const float* k = static_cast<const float*>(p.keys) + key_row(p, seq, s) * D;
            score = 0.f;
            for (int h = 0; h < p.H; ++h) {
                float dot = 0.f;
                for (int d = lane; d < D; d += 32) dot += qf[h * D + d] * k[d];
                for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
                score += qf[p.H * D + h] * fmaxf(dot, 0.f);
            }
        }
        if (lane == 0) {
            p.scores[(size_t)t * p.score_stride + s] = score;
            if (s < visible) atomicAdd(&p.hist[(size_t)t * HIST_BINS + (ordered(score) >> (32 - HIST_BITS))], 1);
        }
    }
}

constexpr int TOPK_THREADS = 1024;

// Exclusive prefix sum of `flag` over the block (TOPK_THREADS threads); returns it and sets `total`.
__device__ __forceinline__ int block_exclusive_scan(int flag, int* warp_sums, int& total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int inclusive = flag;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
        const int v = __shfl_up_sync(0xffffffff, inclusive, o);
        if (lane >= o) inclusive += v;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int w = warp_sums[lane];
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const int v = __shfl_up_sync(0xffffffff, w, o);
            if (lane >= o) w += v;
        }
        warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    total = warp_sums[31];
    const int before = warp == 0 ? 0 : warp_sums[warp - 1];
    __syncthreads();  // warp_sums is reused by the next scan
    return before + inclusive - flag;
}

constexpr int CANDIDATES = 8192;  // values of the threshold bin held in shared memory
constexpr int ELEMS = 16;          // consecutive scores per thread per step of a pass over the row

// Scores first .. first + ELEMS of a row (rows start 16-byte aligned: the stride is a multiple of 4).
__device__ __forceinline__ void load_scores(const float* row, int first, int n, float (&v)[ELEMS]) {
    if (first + ELEMS <= n) {
#pragma unroll
        for (int j = 0; j < ELEMS; j += 4) {
            const float4 f = *reinterpret_cast<const float4*>(row + first + j);
            v[j] = f.x; v[j + 1] = f.y; v[j + 2] = f.z; v[j + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < ELEMS; ++j) v[j] = first + j < n ? row[first + j] : 0.f;
    }
}

// Refines (prefix, mask, remaining) over 8-bit digits at `shifts` until the K-th largest value is exact:
// `remaining` of the values matching `prefix` under `mask` are still to be taken. Values come from
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
        if (threadIdx.x == 0) {
            int above = 0, digit = 255;
            for (; digit > 0; --digit) {
                if (above + hist[digit] >= remaining) break;
                above += hist[digit];
            }
            *prefix_s = prefix | ((uint32_t)digit << shift);
            *remaining_s = remaining - above;
        }
        __syncthreads();
        prefix = *prefix_s;
        remaining = *remaining_s;
        mask |= 255u << shift;
    }
}

__device__ void topk_impl(const DsaParams& p) {
    const int t = blockIdx.x;
    const int n = visible_keys(p, t), K = p.K;
    const float* row = p.scores + (size_t)t * p.score_stride;
    int* hist_row = p.hist + (size_t)t * HIST_BINS;
    int* out = p.indices + (size_t)t * K;
    __shared__ int bins[HIST_BINS];
    __shared__ uint32_t candidates[CANDIDATES];
    __shared__ int warp_sums[32];
    __shared__ uint32_t prefix_s;
    __shared__ int remaining_s, candidate_count;

    for (int i = threadIdx.x; i < HIST_BINS; i += blockDim.x) {
        bins[i] = hist_row[i];
        hist_row[i] = 0;  // ready for the next call
    }
    if (n <= K) {  // every visible position
        for (int i = threadIdx.x; i < K; i += blockDim.x) out[i] = i < n ? i : -1;
        return;
    }
    if (threadIdx.x == 0) candidate_count = 0;
    __syncthreads();
    // The bin of the K-th largest score: thread i owns bins 2i and 2i + 1 counted from the top.
    static_assert(HIST_BINS == 2 * TOPK_THREADS, "two bins per thread");
    const int high = HIST_BINS - 1 - 2 * threadIdx.x, low = high - 1;
    int pair_total;
    const int above_pair = block_exclusive_scan(bins[high] + bins[low], warp_sums, pair_total);
    if (above_pair < K && above_pair + bins[high] + bins[low] >= K) {
        const bool in_high = above_pair + bins[high] >= K;
        prefix_s = (uint32_t)(in_high ? high : low) << (32 - HIST_BITS);
        remaining_s = K - (in_high ? above_pair : above_pair + bins[high]);
    }
    __syncthreads();
    uint32_t prefix = prefix_s, mask = ~0u << (32 - HIST_BITS);
    int remaining = remaining_s;
    // Gather the threshold bin's values (every thread ELEMS consecutive scores per step, loads in flight
    // together).
    for (int base = 0; base < n; base += TOPK_THREADS * ELEMS) {
        float v[ELEMS];
        load_scores(row, base + threadIdx.x * ELEMS, n, v);
#pragma unroll
        for (int j = 0; j < ELEMS; ++j) {
            const uint32_t u = ordered(v[j]);
            if (base + threadIdx.x * ELEMS + j < n && (u & mask) == prefix) {
                const int slot = atomicAdd(&candidate_count, 1);
                if (slot < CANDIDATES) candidates[slot] = u;
            }
        }
    }
    __syncthreads();
    const int count = candidate_count;
    // The remaining 21 bits, 8 at a time (the first digit overlaps 3 known bits, which all match).
    if (count <= CANDIDATES) {
        select_digits([&](int i) { return candidates[i]; }, count, 16, prefix, mask, remaining, bins, &prefix_s,
                      &remaining_s);
    } else {
        select_digits([&](int i) { return ordered(row[i]); }, n, 16, prefix, mask, remaining, bins, &prefix_s,
                      &remaining_s);
    }
    // prefix = the K-th largest value; take everything above it and the first `remaining` equal to it, in
    // position order.
    int written = 0, equal_taken = 0;
    for (int base = 0; base < n; base += TOPK_THREADS * ELEMS) {
        const int first = base + threadIdx.x * ELEMS;  // this thread's positions: first .. first + ELEMS
        float v[ELEMS];
        load_scores(row, first, n, v);
        uint32_t u[ELEMS];
        int equal_here = 0;
#pragma unroll
        for (int j = 0; j < ELEMS; ++j) {
            u[j] = first + j < n ? ordered(v[j]) : 0u;
            equal_here += first + j < n && u[j] == prefix;
        }
        int equal_total;
        int equal_rank = equal_taken + block_exclusive_scan(equal_here, warp_sums, equal_total);
        bool take[ELEMS];
        int take_here = 0;
#pragma unroll
        for (int j = 0; j < ELEMS; ++j) {
            const bool valid = first + j < n;
            const bool equal = valid && u[j] == prefix;
            take[j] = (valid && u[j] > prefix) || (equal && equal_rank < remaining);
            equal_rank += equal;
            take_here += take[j];
        }
        int take_total;
        int slot = written + block_exclusive_scan(take_here, warp_sums, take_total);
#pragma unroll
        for (int j = 0; j < ELEMS; ++j)
            if (take[j]) out[slot++] = first + j;
        written += take_total;
        equal_taken += equal_total;
    }
    for (int i = written + threadIdx.x; i < K; i += blockDim.x) out[i] = -1;
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
    extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32) dsa_scores_bf16_d##D##_mt##MT(const DsaParams p) { \
        scores_mma<D, MT, false>(p);                                                                     \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32) dsa_scores_fp8_d##D##_mt##MT(const DsaParams p) {  \
        scores_mma<D, MT, true>(p);                                                                      \
    }
DSA_SCORES_ENTRY(16, 1)
DSA_SCORES_ENTRY(16, 2)
DSA_SCORES_ENTRY(32, 1)
DSA_SCORES_ENTRY(32, 2)
DSA_SCORES_ENTRY(64, 1)
DSA_SCORES_ENTRY(64, 2)
DSA_SCORES_ENTRY(128, 1)
DSA_SCORES_ENTRY(128, 2)

extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32) dsa_scores_f32(const DsaParams p) { scores_f32(p); }
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) dsa_topk(const DsaParams p) { topk_impl(p); }
extern "C" __global__ void dsa_quantize_fp8_bf16(const bf16* rows, uint8_t* bytes, float* scales, int n, int D) {
    quantize_fp8_impl(rows, bytes, scales, n, D);
}
extern "C" __global__ void dsa_quantize_fp8_f32(const float* rows, uint8_t* bytes, float* scales, int n, int D) {
    quantize_fp8_impl(rows, bytes, scales, n, D);
}
