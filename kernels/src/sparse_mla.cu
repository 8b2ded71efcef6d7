// Sparse absorbed-MLA attention over a paged latent cache (contract: ops/src/sparse_mla.rs).
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

constexpr int BN = 32;       // keys per tile
constexpr int MAX_SPLITS = 128;  // most splits of the top-k the combine merges (the launcher caps it)
constexpr int ROW_PAD = 8;   // bf16 of padding per shared-memory row: 16 bytes keep ldmatrix conflict-free
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

constexpr int MAX_ROPE = 64;  // row width beyond the value columns the bf16 kernel holds (D <= DV + MAX_ROPE)
constexpr int LDS = BN + 8;   // f32 stride of a partial-score row: float2 stores of a half-warp hit 32 banks

// k16 steps of the row each of KW warps owns, for rows up to DV + MAX_ROPE wide.
__host__ __device__ constexpr int q_steps(int dv, int kw) { return ((dv + MAX_ROPE + 15) / 16 + kw - 1) / kw; }

// The flash-decoding merge inside a thread-block cluster: the cluster is the num_splits blocks of one
// (token, 16-head tile), each holding its normalised partial `part_s` [16][DV] and lse `part_lse_s` [16] in
// shared memory. Every block reads the splits' lse (distributed shared memory) and merges an interleaved
// share of the [16][DV] outputs: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max) (as
// sparse_mla_combine, without the partials' round trip through global memory and the second launch).
// `weights_s`: (MAX_CLUSTER + 2) * 16 floats of scratch.
// Most blocks per cluster the merge's scratch holds: at least the launcher's MAX_MERGE_CLUSTER
// (ops/src/sparse_mla.rs).
constexpr int MAX_CLUSTER = 16;
template <int DV, int THREADS>
__device__ __forceinline__ void combine_in_cluster(const SparseMlaParams& p, const float* part_s,
                                                   const float* part_lse_s, float* weights_s, int t, int h0) {
    const int splits = p.num_splits;
    float* total_s = weights_s + MAX_CLUSTER * 16;  // [16] sum of a row's weights
    float* max_s = total_s + 16;                    // [16] a row's largest lse
    cluster_sync();  // every split's partial is in its block's shared memory
    for (int i = threadIdx.x; i < splits * 16; i += THREADS)
        weights_s[i] = h0 + i % 16 < p.H ? ld_cluster_f32(cluster_map(part_lse_s + i % 16, i / 16)) : -INFINITY;
    __syncthreads();
    if (threadIdx.x < 16) {
        const int row = threadIdx.x;
        float m = -INFINITY, total = 0.f;
        for (int s = 0; s < splits; ++s) m = fmaxf(m, weights_s[s * 16 + row]);
        for (int s = 0; s < splits; ++s) {
            const float w = split_weight(weights_s[s * 16 + row], m);
            weights_s[s * 16 + row] = w;
            total += w;
        }
        total_s[row] = total;
        max_s[row] = m;
    }
    __syncthreads();
    const int rank = cluster_rank();
    constexpr int UNITS = 16 * DV / 4;  // float4 outputs of the head tile
    for (int u = rank * THREADS + threadIdx.x; u < UNITS; u += splits * THREADS) {
        const int row = u / (DV / 4), c4 = u % (DV / 4), head = h0 + row;
        if (head >= p.H) continue;
        const float* src = part_s + row * DV + 4 * c4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int s = 0; s < splits; ++s) {
            const float w = weights_s[s * 16 + row];
            const float4 v = ld_cluster_f32x4(cluster_map(src, s));
            acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
        }
        const float inv = total_s[row] > 0.f ? 1.f / total_s[row] : 0.f;
        bf16* out = static_cast<bf16*>(p.out) + ((size_t)t * p.H + head) * DV + 4 * c4;
        *reinterpret_cast<uint32_t*>(out) = pack_bf16(acc.x * inv, acc.y * inv);
        *reinterpret_cast<uint32_t*>(out + 2) = pack_bf16(acc.z * inv, acc.w * inv);
    }
    if (rank == 0 && threadIdx.x < 16 && h0 + (int)threadIdx.x < p.H)
        p.lse[(size_t)t * p.H + h0 + threadIdx.x] = merged_lse(max_s[threadIdx.x], total_s[threadIdx.x]);
    cluster_sync();  // no block leaves while another still reads its shared memory
}

template <int DV, int HT, int KW, int MW, int FIXED_D>
__device__ __forceinline__ void sparse_mla_bf16_body(const SparseMlaParams& p) {
    constexpr int HB = 16 * HT;                 // heads per block
    constexpr int THREADS = HT / MW * KW * 32;  // MW head tiles per warp: each B fragment feeds MW mma
    constexpr int DV_W = DV / KW;               // value columns per warp
    constexpr int NT_O = DV_W / 8;              // n8 tiles of O per warp
    constexpr int KEYS_W = BN / KW;             // keys per warp in the softmax
    constexpr int NT_K = KEYS_W / 8;            // their n8 tiles
    constexpr int QS = q_steps(DV, KW);         // Q fragments per warp
    constexpr int LDP = BN + ROW_PAD;
    static_assert(DV % (8 * KW) == 0 && BN % (8 * KW) == 0, "warps must split keys and values into n8 tiles");
    static_assert(HT % MW == 0, "whole head tiles per warp");

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ht0 = warp / KW * MW, kw = warp % KW;  // this warp's head tiles: ht0 .. ht0 + MW - 1
    const int split = blockIdx.x, h0 = blockIdx.y * HB, t = blockIdx.z;
    // FIXED_D > 0: the row width is known at compile time (GLM-5's 576), so every shared-memory offset is an
    // immediate and no step needs a bounds test. FIXED_D == 0: any width the launcher admits.
    const int D = FIXED_D > 0 ? FIXED_D : p.D, ld = row_stride(D), chunks = D / 8, k_steps = (D + 15) / 16;

    // Q is staged in shared memory only until its fragments are in registers; when it fits (16 heads), in
    // key buffer 1, which keeps the block within sm_120's 99 KB.
    constexpr bool Q_ALIASED = HB <= BN;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* ks = reinterpret_cast<bf16*>(smem);                    // [2][BN][ld] key tiles
    bf16* qs = Q_ALIASED ? ks + BN * ld : ks + 2 * BN * ld;       // [HB][ld]
    bf16* ps = ks + 2 * BN * ld + (Q_ALIASED ? 0 : HB * ld);      // [HB][LDP] probabilities of a tile
    float* sp = reinterpret_cast<float*>(ps + HB * LDP);          // [HT][KW][16][LDS] partial scores
    float* max_s = sp + HT * KW * 16 * LDS;                       // [HT][KW][16] per-warp row maxima
    float* l_s = max_s + HT * KW * 16;                            // [HT][KW][16] per-warp row sums
    int* rows_s = reinterpret_cast<int*>(l_s + HT * KW * 16);     // physical row of every slot of the split
                                                                  // (the launcher sizes it)

    const int seq = p.token_seq[t];  // first used by resolve_split_rows: its latency hides behind Q's copies
    const int2 tiles = split_tiles(p, split, BN);
    const int tile_begin = tiles.x, tile_count = tiles.y;
    const bf16* kv = static_cast<const bf16*>(p.kv);

    // Q rows of this block's heads, zero beyond H and in the padding columns.
    const bf16* q = static_cast<const bf16*>(p.q) + (size_t)t * p.H * D;
    for (int i = threadIdx.x; i < HB * (ld / 8); i += THREADS) {
        const int r = i / (ld / 8), c = (i % (ld / 8)) * 8;
        const bool valid = c < D && h0 + r < p.H;
        cp_async_16(qs + r * ld + c, valid ? q + (size_t)(h0 + r) * D + c : q, valid);
    }
    cp_async_commit();
    // Padding columns of the key tiles are never written by the tile loads (buffer 1's, when it holds Q,
    // once Q has moved to registers).
    auto zero_padding = [&](bf16* buffer) {
        for (int i = threadIdx.x; i < BN * (ld - D); i += THREADS) {
            const int r = i / (ld - D), c = D + i % (ld - D);
            buffer[r * ld + c] = __float2bfloat16(0.f);
        }
    };
    zero_padding(ks);
    if constexpr (!Q_ALIASED) zero_padding(ks + BN * ld);
    // Every slot of the split resolved up front.
    resolve_split_rows<THREADS>(p, t, seq, tile_begin * BN, tile_count * BN, rows_s);
    __syncthreads();

    // One cp.async group per tile (empty past the split's end). A warp copies whole rows: lane c moves
    // 16-byte chunks c, c + 32, ... of the row, so no thread divides by the row width.
    auto load_tile = [&](int local_tile) {
        if (local_tile < tile_count) {
            bf16* dst = ks + (local_tile & 1) * BN * ld;
            const int* rows = rows_s + local_tile * BN;
            for (int r = warp; r < BN; r += THREADS / 32) {
                const long long row = rows[r];
                const bf16* src = row >= 0 ? kv + row * D : kv;
                for (int c = lane; c < chunks; c += 32) cp_async_16(dst + r * ld + c * 8, src + c * 8, row >= 0);
            }
        }
        cp_async_commit();
    };
    load_tile(0);
    if constexpr (!Q_ALIASED) load_tile(1);

    // This warp's Q fragments: k16 steps kw, kw + KW, ... of its heads. Held in registers for the whole
    // split with one head tile per block; with four (128 registers or fewer per thread) they would spill,
    // and Q has its own shared region anyway, so each step reads its fragment there.
    constexpr bool Q_IN_REGISTERS = HT == 1;
    static_assert(Q_IN_REGISTERS || !Q_ALIASED, "Q read per step needs its own shared region");
    if constexpr (Q_ALIASED) cp_async_wait<1>();
    else cp_async_wait<2>();
    __syncthreads();
    const auto q_fragment = [&](uint32_t (&fragment)[4], int ht, int step) {
        if (step < k_steps) ldmatrix_x4(fragment, qs + (ht * 16 + lane % 16) * ld + step * 16 + (lane / 16) * 8);
        else fragment[0] = fragment[1] = fragment[2] = fragment[3] = 0u;
    };
    uint32_t qa[Q_IN_REGISTERS ? QS : 1][4];
    if constexpr (Q_IN_REGISTERS) {
#pragma unroll
        for (int s = 0; s < QS; ++s) q_fragment(qa[s], ht0, kw + s * KW);
    }
    if constexpr (Q_ALIASED) {
        __syncthreads();  // every warp holds its fragments: buffer 1 is free for tile 1
        zero_padding(ks + BN * ld);
        load_tile(1);
    }

    // Per head tile of this warp: rows lane/4 and lane/4 + 8.
    float m_run[MW][2], l_run[MW][2], o_acc[MW][NT_O][4];
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) {
        m_run[mw][0] = m_run[mw][1] = -INFINITY;
        l_run[mw][0] = l_run[mw][1] = 0.f;
#pragma unroll
        for (int n = 0; n < NT_O; ++n) o_acc[mw][n][0] = o_acc[mw][n][1] = o_acc[mw][n][2] = o_acc[mw][n][3] = 0.f;
    }
    const float scale_log2 = p.scale * LOG2E;
    const int r0 = lane / 4;  // this thread's two rows of a 16-head tile: r0 and r0 + 8

    for (int local = 0; local < tile_count; ++local) {
        // This tile has landed (the first time, tile 1 of the prologue may still be in flight) ...
        if (local == 0) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // ... for every thread, and every warp is done with the previous tile
        // The previous tile's buffer is free: refill it with the tile after this one.
        if (local > 0) load_tile(local + 1);
        const bf16* kt = ks + (local & 1) * BN * ld;
        const int* rows = rows_s + local * BN;

        // Partial S over this warp's column steps, all BN keys: BN/8 independent accumulators per head tile,
        // each B fragment shared by the MW tiles.
        float s[MW][BN / 8][4] = {};
#pragma unroll
        for (int st = 0; st < QS; ++st) {
            const int step = kw + st * KW;
            if (step < k_steps) {
                uint32_t q_step[MW][4];
                if constexpr (!Q_IN_REGISTERS) {
#pragma unroll
                    for (int mw = 0; mw < MW; ++mw) q_fragment(q_step[mw], ht0 + mw, step);
                }
#pragma unroll
                for (int np = 0; np < BN / 16; ++np) {
                    uint32_t b[4];
                    ldmatrix_x4(b, kt + (np * 16 + lane % 8 + (lane / 16) * 8) * ld + step * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
                    for (int mw = 0; mw < MW; ++mw) {
                        const uint32_t(&a)[4] = Q_IN_REGISTERS ? qa[st] : q_step[mw];
                        mma_bf16(s[mw][2 * np], a, b[0], b[1]);
                        mma_bf16(s[mw][2 * np + 1], a, b[2], b[3]);
                    }
                }
            }
        }
#pragma unroll
        for (int mw = 0; mw < MW; ++mw) {
            float* sp_mine = sp + ((ht0 + mw) * KW + kw) * 16 * LDS;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                const int col = n * 8 + (lane % 4) * 2;
                *reinterpret_cast<float2*>(sp_mine + r0 * LDS + col) = make_float2(s[mw][n][0], s[mw][n][1]);
                *reinterpret_cast<float2*>(sp_mine + (r0 + 8) * LDS + col) = make_float2(s[mw][n][2], s[mw][n][3]);
            }
        }
        __syncthreads();

        // Scores of this warp's keys: the sum of the KW partials, masked, in the log2 domain.
        float sc[MW][NT_K][4];
#pragma unroll
        for (int mw = 0; mw < MW; ++mw) {
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < NT_K; ++n) {
                const int col = kw * KEYS_W + n * 8 + (lane % 4) * 2;
                float2 lo = make_float2(0.f, 0.f), hi = make_float2(0.f, 0.f);
#pragma unroll
                for (int j = 0; j < KW; ++j) {
                    const float* part = sp + ((ht0 + mw) * KW + j) * 16 * LDS;
                    const float2 a = *reinterpret_cast<const float2*>(part + r0 * LDS + col);
                    const float2 b = *reinterpret_cast<const float2*>(part + (r0 + 8) * LDS + col);
                    lo.x += a.x; lo.y += a.y; hi.x += b.x; hi.y += b.y;
                }
                const float v[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    sc[mw][n][j] = rows[col + (j & 1)] >= 0 ? v[j] * scale_log2 : -INFINITY;
                    mx[j / 2] = fmaxf(mx[j / 2], sc[mw][n][j]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
            }
            float* max_tile = max_s + (ht0 + mw) * KW * 16;
            if (lane % 4 == 0) {
                max_tile[kw * 16 + r0] = mx[0];
                max_tile[kw * 16 + r0 + 8] = mx[1];
            }
        }
        __syncthreads();
#pragma unroll
        for (int mw = 0; mw < MW; ++mw) {
            const float* max_tile = max_s + (ht0 + mw) * KW * 16;
            float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float m_tile = -INFINITY;
#pragma unroll
                for (int j = 0; j < KW; ++j) m_tile = fmaxf(m_tile, max_tile[j * 16 + r0 + r * 8]);
                const float m_new = fmaxf(m_run[mw][r], m_tile);
                alpha[r] = m_new == -INFINITY ? 1.f : exp2f(m_run[mw][r] - m_new);
                m_run[mw][r] = m_new;
            }
#pragma unroll
            for (int n = 0; n < NT_K; ++n) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    sc[mw][n][j] = sc[mw][n][j] == -INFINITY ? 0.f : exp2f(sc[mw][n][j] - m_run[mw][j / 2]);
                    sum[j / 2] += sc[mw][n][j];
                }
                const int col = kw * KEYS_W + n * 8 + (lane % 4) * 2;
                *reinterpret_cast<uint32_t*>(ps + ((ht0 + mw) * 16 + r0) * LDP + col) = pack_bf16(sc[mw][n][0], sc[mw][n][1]);
                *reinterpret_cast<uint32_t*>(ps + ((ht0 + mw) * 16 + r0 + 8) * LDP + col) = pack_bf16(sc[mw][n][2], sc[mw][n][3]);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                sum[r] += __shfl_xor_sync(0xffffffff, sum[r], 1);
                sum[r] += __shfl_xor_sync(0xffffffff, sum[r], 2);
                l_run[mw][r] = l_run[mw][r] * alpha[r] + sum[r];  // this warp's keys only; the KW shares add up at the end
            }
#pragma unroll
            for (int n = 0; n < NT_O; ++n) {
                o_acc[mw][n][0] *= alpha[0];
                o_acc[mw][n][1] *= alpha[0];
                o_acc[mw][n][2] *= alpha[1];
                o_acc[mw][n][3] *= alpha[1];
            }
        }
        __syncthreads();  // P of all warps is complete

        // O[:, kw*DV_W : (kw+1)*DV_W] += P V over the tile's keys, each V fragment shared by the MW tiles.
        const int dv_base = kw * DV_W;
#pragma unroll
        for (int kk = 0; kk < BN; kk += 16) {
            uint32_t a[MW][4];
#pragma unroll
            for (int mw = 0; mw < MW; ++mw)
                ldmatrix_x4(a[mw], ps + ((ht0 + mw) * 16 + lane % 16) * LDP + kk + (lane / 16) * 8);
            const int key = kk + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
            for (int n = 0; n + 1 < NT_O; n += 2) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, kt + key * ld + dv_base + n * 8 + (lane / 16) * 8);
#pragma unroll
                for (int mw = 0; mw < MW; ++mw) {
                    mma_bf16(o_acc[mw][n], a[mw], b[0], b[1]);
                    mma_bf16(o_acc[mw][n + 1], a[mw], b[2], b[3]);
                }
            }
            if constexpr (NT_O % 2 == 1) {
                uint32_t b[2];
                ldmatrix_x2_trans(b, kt + key * ld + dv_base + (NT_O - 1) * 8);
#pragma unroll
                for (int mw = 0; mw < MW; ++mw) mma_bf16(o_acc[mw][NT_O - 1], a[mw], b[0], b[1]);
            }
        }
    }
    cp_async_wait<0>();  // nothing in flight at exit
    // The combine (launched as a programmatic dependent) may start its blocks now; it waits for this grid's
    // writes itself.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    // Epilogue: the KW warps' row sums, normalise, write out / partials. Merged in the cluster (one 16-head
    // tile per block): the partial and its lse go to this block's shared memory instead, the key buffers and
    // partial scores being free once every warp is past the barrier below.
    const bool in_cluster = HT == 1 && p.num_splits > 1 && p.cluster_combine;
    float* part_s = reinterpret_cast<float*>(smem);  // [16][DV] this split's partial (cluster merge)
    float* part_lse_s = sp;                          // [16]
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) {
        float* l_tile = l_s + (ht0 + mw) * KW * 16;
        if (lane % 4 == 0) {
            l_tile[kw * 16 + r0] = l_run[mw][0];
            l_tile[kw * 16 + r0 + 8] = l_run[mw][1];
        }
    }
    __syncthreads();
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) {
        const float* l_tile = l_s + (ht0 + mw) * KW * 16;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = (ht0 + mw) * 16 + r0 + r * 8, head = h0 + row;
            if (head >= p.H) continue;
            float l = 0.f;
#pragma unroll
            for (int j = 0; j < KW; ++j) l += l_tile[j * 16 + r0 + r * 8];
            const float inv_l = l > 0.f ? 1.f / l : 0.f;
            const size_t th = (size_t)t * p.H + head;
#pragma unroll
            for (int n = 0; n < NT_O; ++n) {
                const int col = kw * DV_W + n * 8 + (lane % 4) * 2;
                const float v0 = o_acc[mw][n][r * 2] * inv_l, v1 = o_acc[mw][n][r * 2 + 1] * inv_l;
                if (p.num_splits == 1) {
                    *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.out) + th * DV + col) = pack_bf16(v0, v1);
                } else if (in_cluster) {
                    *reinterpret_cast<float2*>(part_s + row * DV + col) = make_float2(v0, v1);
                } else {
                    float* dst = p.part_out + ((size_t)split * p.T * p.H + th) * DV + col;
                    *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
                }
            }
            if (kw == 0 && lane % 4 == 0) {
                const float lse = l > 0.f ? m_run[mw][r] * LN2 + logf(l) : -INFINITY;
                if (p.num_splits == 1) p.lse[th] = lse;
                else if (in_cluster) part_lse_s[row] = lse;
                else p.part_lse[(size_t)split * p.T * p.H + th] = lse;
            }
        }
    }
    if constexpr (HT == 1) {
        static_assert(KW * 16 * LDS >= 16 + (MAX_CLUSTER + 2) * 16,
                      "the merge's lse and weights fit in the partial scores' region");
        if (in_cluster) combine_in_cluster<DV, THREADS>(p, part_s, part_lse_s, sp + 16, t, h0);
    }
}

// Merges the splits of the bf16 kernel: out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max).
// One block of COMBINE_GROUPS warps per (token, head, 128 value columns): warp g merges splits g,
// g + COMBINE_GROUPS, ... (its loads independent, so they are in flight together), lane c four columns; the
// warps' sums meet in shared memory.
constexpr int COMBINE_GROUPS = 8;
constexpr int COMBINE_COLUMNS = 128;

__device__ void combine_impl(const SparseMlaParams& p) {
    // Launched as a programmatic dependent of the attention kernel: wait for its grid's writes.
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    const size_t th = blockIdx.x;
    const size_t stride = (size_t)p.T * p.H;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __shared__ float weights[MAX_SPLITS];
    __shared__ float total_s, max_s;
    __shared__ float4 sums[COMBINE_GROUPS][COMBINE_COLUMNS / 4];
    for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x) weights[s] = p.part_lse[s * stride + th];
    __syncthreads();
    if (warp == 0) {
        float m = -INFINITY;
        for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, weights[s]);
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        float total = 0.f;
        for (int s = lane; s < p.num_splits; s += 32) {
            const float w = split_weight(weights[s], m);
            weights[s] = w;
            total += w;
        }
        for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffff, total, o);
        if (lane == 0) {
            total_s = total;
            max_s = m;
        }
    }
    __syncthreads();
    const int c = blockIdx.y * (COMBINE_COLUMNS / 4) + lane;  // float4 column of this lane
    const bool active = 4 * c < p.DV;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active) {
#pragma unroll 8
        for (int s = warp; s < p.num_splits; s += COMBINE_GROUPS) {
            const float4 v = reinterpret_cast<const float4*>(p.part_out + (s * stride + th) * p.DV)[c];
            const float w = weights[s];
            acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
        }
    }
    sums[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && active) {
        for (int g = 1; g < COMBINE_GROUPS; ++g) {
            const float4 v = sums[g][lane];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        const float inv = total_s > 0.f ? 1.f / total_s : 0.f;
        bf16* out = static_cast<bf16*>(p.out) + th * p.DV;
        *reinterpret_cast<uint32_t*>(out + 4 * c) = pack_bf16(acc.x * inv, acc.y * inv);
        *reinterpret_cast<uint32_t*>(out + 4 * c + 2) = pack_bf16(acc.z * inv, acc.w * inv);
    }
    if (blockIdx.y == 0 && threadIdx.x == 0) p.lse[th] = merged_lse(max_s, total_s);
}

// The same merge with one memory wait, for at most COMBINE_CHUNK splits (the launcher uses the combine above
// for more): a warp merges 128 value columns of one (token, head); lane s holds split s's lse, and every
// partial is loaded together with the lse before anything waits. No shared memory, no block barrier; blocks
// of COMBINE_ROW_WARPS warps (512 columns). On the H200 at B8/H8 (16 splits) the time the merge adds after
// the attention kernel went from 3.3 to 2.3 µs.
constexpr int COMBINE_CHUNK = 16;
constexpr int COMBINE_ROW_WARPS = 4;
__device__ void combine_rows_impl(const SparseMlaParams& p) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    const size_t th = blockIdx.x, stride = (size_t)p.T * p.H;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = (blockIdx.y * COMBINE_ROW_WARPS + warp) * 32 + lane;  // this lane's float4 of columns
    const bool active = 4 * c < p.DV;
    const int mine = lane % COMBINE_CHUNK;  // the split whose lse this lane holds
    const float lse = mine < p.num_splits ? p.part_lse[mine * stride + th] : -INFINITY;
    const float4* part = reinterpret_cast<const float4*>(p.part_out + th * p.DV) + c;  // split 0's
    const size_t split_stride = stride * p.DV / 4;                                       // float4 per split
    float4 v[COMBINE_CHUNK];
#pragma unroll
    for (int s = 0; s < COMBINE_CHUNK; ++s)
        v[s] = s < p.num_splits && active ? part[s * split_stride] : make_float4(0.f, 0.f, 0.f, 0.f);
    // Every load is issued before anything waits for one (the compiler would otherwise sink them into the sum
    // below: one memory wait per split).
    __syncwarp();
    float m = lse;
#pragma unroll
    for (int o = COMBINE_CHUNK / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    const float w_mine = split_weight(lse, m);
    float total = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < COMBINE_CHUNK; ++s) {
        const float w = __shfl_sync(0xffffffff, w_mine, s);
        total += w;
        acc.x += w * v[s].x; acc.y += w * v[s].y; acc.z += w * v[s].z; acc.w += w * v[s].w;
    }
    if (active) {
        const float inv = total > 0.f ? 1.f / total : 0.f;
        bf16* out = static_cast<bf16*>(p.out) + th * p.DV;
        *reinterpret_cast<uint32_t*>(out + 4 * c) = pack_bf16(acc.x * inv, acc.y * inv);
        *reinterpret_cast<uint32_t*>(out + 4 * c + 2) = pack_bf16(acc.z * inv, acc.w * inv);
    }
    if (c == 0) p.lse[th] = merged_lse(m, total);
}

// f32 kernel: one block of 4 warps per (token, head); each warp walks every 4th selected key with an online
// softmax, partial results merged in shared memory.
__device__ void f32_impl(const SparseMlaParams& p) {
    constexpr int WARPS = 4;
    const int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int D = p.D, DV = p.DV;
    extern __shared__ float sm[];
    float* qf = sm;                 // D
    float* o_w = qf + D;            // WARPS x DV
    float* m_w = o_w + WARPS * DV;  // WARPS
    float* l_w = m_w + WARPS;       // WARPS
    const float* q = static_cast<const float*>(p.q) + ((size_t)t * p.H + h) * D;
    const float* kv = static_cast<const float*>(p.kv);
    for (int d = threadIdx.x; d < D; d += blockDim.x) qf[d] = q[d];
    for (int d = lane; d < DV; d += 32) o_w[warp * DV + d] = 0.f;
    __syncthreads();
    const int seq = p.token_seq[t], seq_len = p.seq_lens[seq];
    float m = -INFINITY, l = 0.f;
    for (int k = warp; k < p.K; k += WARPS) {
        const long long row = physical_row(p, seq, seq_len, p.indices[(size_t)t * p.K + k]);
        if (row < 0) continue;
        const float* r = kv + row * D;
        float dot = 0.f;
        for (int d = lane; d < D; d += 32) dot += qf[d] * r[d];
        for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
        const float s = dot * p.scale, m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new), w = expf(s - m_new);
        l = l * alpha + w;
        m = m_new;
        for (int d = lane; d < DV; d += 32) o_w[warp * DV + d] = o_w[warp * DV + d] * alpha + w * r[d];
    }
    if (lane == 0) {
        m_w[warp] = m;
        l_w[warp] = l;
    }
    __syncthreads();
    float m_all = -INFINITY;
    for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, m_w[w]);
    float l_all = 0.f;
    for (int w = 0; w < WARPS; ++w) l_all += l_w[w] * split_weight(m_w[w], m_all);
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    const size_t th = (size_t)t * p.H + h;
    for (int d = threadIdx.x; d < DV; d += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < WARPS; ++w)
            if (m_w[w] != -INFINITY) acc += o_w[w * DV + d] * split_weight(m_w[w], m_all);
        static_cast<float*>(p.out)[th * DV + d] = acc * inv;
    }
    if (threadIdx.x == 0) p.lse[th] = merged_lse(m_all, l_all);
}

// Narrow kernel: at most 8 heads per token (GLM-5 with its 64 heads over 8 GPUs), keys as the mma's rows.
//
// The head-tile kernel above pads 8 heads to a 16-row tile and splits every key tile's scores across its
// warps by row width (three block barriers per tile). Here the product is transposed: S^T = K Q^T and
// O^T += V^T P^T by m16n8k16 with 16 keys as M and the 8 heads as N, so no mma is spent on padding, and a warp
// computes whole scores:
//   S^T          warp w: the 16 keys of its own tile against all 8 heads over the full row (4 mma chains);
//   softmax      over the block's WARPS tiles at once: the warps agree on each head's maximum through
//                shared memory; each turns its probabilities into P^T, the B operand of the value product, in
//                registers (`movmatrix`) and leaves it in shared memory (256 bytes);
//   O^T += V^T P^T  warp w: value columns [w*DV/WARPS, (w+1)*DV/WARPS) over all WARPS tiles.
// A block is one split of WARPS * 16 keys (one step: the launcher sizes the split so the grid is one wave),
// and every row of the split is copied at once at the start: a warp resolves and copies its own 16 rows, holds
// Q's fragments in registers while they land and computes its scores as soon as its own rows are in. The
// block meets twice after that (the maxima, then P^T); no exchange of partial scores. Several splits write
// f32 partials for sparse_mla_combine (or, with one split, the output).
constexpr int NARROW_HEADS = 8;  // the mma's N: heads per block
constexpr int NARROW_KEYS = 16;  // the mma's M: keys per warp

template <int DV, int D, int WARPS>
__device__ __forceinline__ void sparse_mla_narrow_body(const SparseMlaParams& p) {
    constexpr int LD = row_stride(D);  // bf16 per shared row: 16 bytes of padding keep ldmatrix conflict-free
    constexpr int THREADS = WARPS * 32;
    constexpr int K_STEPS = D / 16;
    constexpr int DV_W = DV / WARPS;   // value columns per warp
    constexpr int MT_O = DV_W / 16;    // m16 tiles of O^T per warp
    constexpr int CHUNKS = D / 8;      // 16-byte pieces of a row
    static_assert(D % 32 == 0 && DV % (16 * WARPS) == 0, "whole k16 step pairs and m16 value tiles per warp");

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* ks = reinterpret_cast<bf16*>(smem);                       // [WARPS][16][LD] each warp's keys
    bf16* qs = ks + WARPS * NARROW_KEYS * LD;                        // [8][LD]
    uint2* ps = reinterpret_cast<uint2*>(qs + NARROW_HEADS * LD);    // [WARPS][32] P^T as B fragments
    float* max_s = reinterpret_cast<float*>(ps + WARPS * 32);       // [WARPS][8] each tile's head maxima
    float* sum_s = max_s + WARPS * NARROW_HEADS;                    // [WARPS][8] each tile's head sums

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int split = blockIdx.x, t = blockIdx.z;
    const int seq = p.token_seq[t];
    const bf16* kv = static_cast<const bf16*>(p.kv);

    // This warp's keys: lane l copies rows l/8, l/8 + 4, l/8 + 8, l/8 + 12 (16-byte pieces l%8, l%8 + 8, ...:
    // four whole 128-byte lines per instruction, conflict-free in shared memory), so it resolves those four.
    // The index loads first, Q's copies under them, then the length and all block-table loads: two
    // latencies before the rows' copies, not one chain per key.
    const int first = (split * WARPS + warp) * NARROW_KEYS;
    const int* idx_row = p.indices + (size_t)t * p.K;
    int idx[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const int slot = first + 4 * g + lane / 8;
        idx[g] = slot < p.K ? idx_row[slot] : -1;
    }
    // Q: 8 rows, zero beyond H (cp.async group 0).
    const bf16* q = static_cast<const bf16*>(p.q) + (size_t)t * p.H * D;
    for (int i = threadIdx.x; i < NARROW_HEADS * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        cp_async_16(qs + r * LD + c, r < p.H ? q + (size_t)r * D + c : q, r < p.H);
    }
    cp_async_commit();
    const int seq_len = p.seq_lens[seq];
    long long row[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const int2 page = page_of(max(idx[g], 0), p.block_size);
        const bool in_table = idx[g] >= 0 && page.x < p.max_blocks;
        const int block = in_table ? p.block_table[(size_t)seq * p.max_blocks + page.x] : 0;
        row[g] = in_table && idx[g] < seq_len ? (long long)block * p.block_size + page.y : -1;
    }
    // The rows (group 1).
    bf16* kt = ks + warp * NARROW_KEYS * LD;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const bf16* src = row[g] >= 0 ? kv + row[g] * D : kv;
        bf16* dst = kt + (4 * g + lane / 8) * LD;
#pragma unroll
        for (int c = lane % 8; c < CHUNKS; c += 8) cp_async_16(dst + c * 8, src + c * 8, row[g] >= 0);
    }
    cp_async_commit();
    // Which of the warp's 16 keys have a row: bit k for key k (lane 8j resolved keys 4g + j).
    unsigned has_row = 0;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const unsigned votes = __ballot_sync(0xffffffff, row[g] >= 0);
#pragma unroll
        for (int j = 0; j < 4; ++j) has_row |= ((votes >> (8 * j)) & 1u) << (4 * g + j);
    }
    // Q's B fragments into registers while the rows are in flight (two k16 steps per ldmatrix).
    cp_async_wait<1>();
    __syncthreads();  // all of Q has landed
    uint32_t qb[K_STEPS / 2][4];
#pragma unroll
    for (int i = 0; i < K_STEPS / 2; ++i) ldmatrix_x4(qb[i], qs + (lane % 8) * LD + i * 32 + (lane / 8) * 8);
    // This warp's rows: its scores need nothing else, so no block barrier before them.
    cp_async_wait<0>();
    __syncwarp();

    // S^T (16 keys x 8 heads) over the full row: four independent chains of k16 steps.
    float s[4][4] = {};
#pragma unroll
    for (int step = 0; step < K_STEPS; step += 2) {
        uint32_t a0[4], a1[4];
        ldmatrix_x4(a0, kt + (lane % 16) * LD + step * 16 + (lane / 16) * 8);
        ldmatrix_x4(a1, kt + (lane % 16) * LD + (step + 1) * 16 + (lane / 16) * 8);
        const int chain = (step / 2) % 2 * 2;
        mma_bf16(s[chain], a0, qb[step / 2][0], qb[step / 2][1]);
        mma_bf16(s[chain + 1], a1, qb[step / 2][2], qb[step / 2][3]);
    }
    // This thread's scores: keys lane/4 and lane/4 + 8, heads 2(lane%4) and 2(lane%4) + 1; log2 domain.
    const float scale_log2 = p.scale * LOG2E;
    const int k0 = lane / 4, hp = lane % 4;
    float sc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const bool valid = (has_row >> (k0 + (j / 2) * 8)) & 1u;
        sc[j] = valid ? (s[0][j] + s[1][j] + s[2][j] + s[3][j]) * scale_log2 : -INFINITY;
    }
    float mx[2] = {fmaxf(sc[0], sc[2]), fmaxf(sc[1], sc[3])};
#pragma unroll
    for (int o = 4; o < 32; o *= 2) {
        mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffff, mx[0], o));
        mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffff, mx[1], o));
    }
    if (lane < 4) {
        max_s[warp * NARROW_HEADS + 2 * hp] = mx[0];
        max_s[warp * NARROW_HEADS + 2 * hp + 1] = mx[1];
    }
    __syncthreads();  // every tile's maxima; every warp's rows have landed
    // The combine (a programmatic dependent) may start its blocks; it waits for this grid's writes itself.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    float m[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        m[0] = fmaxf(m[0], max_s[w * NARROW_HEADS + 2 * hp]);
        m[1] = fmaxf(m[1], max_s[w * NARROW_HEADS + 2 * hp + 1]);
    }
    float pr[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pr[j] = sc[j] == -INFINITY ? 0.f : exp2f(sc[j] - m[j % 2]);
    float sum[2] = {pr[0] + pr[2], pr[1] + pr[3]};
#pragma unroll
    for (int o = 4; o < 32; o *= 2) {
        sum[0] += __shfl_xor_sync(0xffffffff, sum[0], o);
        sum[1] += __shfl_xor_sync(0xffffffff, sum[1], o);
    }
    if (lane < 4) {
        sum_s[warp * NARROW_HEADS + 2 * hp] = sum[0];
        sum_s[warp * NARROW_HEADS + 2 * hp + 1] = sum[1];
    }
    // P^T's B fragments (keys x heads): the transposes of the accumulator's two 8-key halves.
    ps[warp * 32 + lane] = make_uint2(movmatrix_trans(pack_bf16(pr[0], pr[1])), movmatrix_trans(pack_bf16(pr[2], pr[3])));
    __syncthreads();  // every tile's P^T and sums

    // O^T[this warp's value columns] = V^T P^T over the block's WARPS tiles.
    const int dv0 = warp * DV_W;
    float o[MT_O][4] = {};
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const uint2 b = ps[w * 32 + lane];
        const bf16* vt = ks + w * NARROW_KEYS * LD + (lane % 8 + (lane / 16) * 8) * LD + dv0 + ((lane / 8) % 2) * 8;
#pragma unroll
        for (int mt = 0; mt < MT_O; ++mt) {
            uint32_t a[4];
            ldmatrix_x4_trans(a, vt + mt * 16);
            mma_bf16(o[mt], a, b.x, b.y);
        }
    }

    // Normalise; out (one split) or this split's f32 partial and lse.
    float total[2] = {0.f, 0.f};
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        total[0] += sum_s[w * NARROW_HEADS + 2 * hp];
        total[1] += sum_s[w * NARROW_HEADS + 2 * hp + 1];
    }
    const size_t th0 = (size_t)t * p.H;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int head = 2 * hp + i;
        if (head >= p.H) continue;
        const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;
#pragma unroll
        for (int mt = 0; mt < MT_O; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int col = dv0 + mt * 16 + k0 + 8 * r;
                const float v = o[mt][2 * r + i] * inv;
                if (p.num_splits == 1)
                    static_cast<bf16*>(p.out)[(th0 + head) * DV + col] = __float2bfloat16(v);
                else
                    p.part_out[((size_t)split * p.T * p.H + th0 + head) * DV + col] = v;
            }
        }
        if (warp == 0 && k0 == 0) {
            const float lse = total[i] > 0.f ? m[i] * LN2 + logf(total[i]) : -INFINITY;
            if (p.num_splits == 1) p.lse[th0 + head] = lse;
            else p.part_lse[(size_t)split * p.T * p.H + th0 + head] = lse;
        }
    }
}

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
