// Sparse absorbed-MLA attention over a paged latent cache (contract: ops/src/sparse_mla.rs).
//
// For query token t (sequence seq = token_seq[t]) and head h:
//   score(k) = scale * q[t,h,:] . row(indices[t,k]),  row(i) = kv[block_table[seq][i / bs] * bs + i % bs]
//   out[t,h,:] = softmax_k(score) . row(indices[t,k])[:DV],  lse[t,h] = ln sum_k exp(score(k))
// Index -1 (or >= seq_lens[seq]) is "no row". Rows are D wide (D % 8 == 0); values are their first DV columns.
//
// bf16 kernel (mma.sync.m16n8k16, f32 accumulate; runs on sm_90 and sm_120): one block handles one token,
// a group of HB heads (16 or 64) and a contiguous range of BN-key tiles (a "split"). It first resolves every
// slot of its split to a physical row (all index and block-table loads in flight together), then streams
// the tiles through a cp.async double buffer. Each 16 heads have a warp pair: each warp scores half of the
// tile's keys (S = Q K^T), the pair agrees on the row maxima through shared memory, both write their part of
// P (bf16), and each accumulates half of the value columns (O += P V). With several splits each block writes
// a normalised partial (f32) and its lse; sparse_mla_combine merges them (flash-decoding).
//
// f32 kernel: plain FMA, one block per (token, head), for full-precision runs.

#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

struct SparseMlaParams {
    const void* q;           // [T, H, D]
    const void* kv;          // [num_blocks * block_size, D]
    const int* block_table;  // [B, max_blocks]
    const int* seq_lens;     // [B]
    const int* token_seq;    // [T]
    const int* indices;      // [T, K]
    void* out;               // [T, H, DV]          (num_splits == 1)
    float* lse;              // [T, H]              (num_splits == 1)
    float* part_out;         // [splits, T, H, DV]  (num_splits > 1)
    float* part_lse;         // [splits, T, H]      (num_splits > 1)
    int T, H, D, DV, K, block_size, max_blocks, num_splits, tiles_per_split;
    float scale;             // softmax scale
};

constexpr int BN = 32;       // keys per tile
constexpr int MAX_SPLITS = 128;  // most splits of the top-k the combine merges (the launcher caps it)
constexpr int MAX_TILES_PER_SPLIT = 32;  // slots resolved up front per block (the launcher caps it)
constexpr int ROW_PAD = 8;   // bf16 of padding per shared-memory row: 16 bytes keep ldmatrix conflict-free
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;  // 0 source bytes: the destination is zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

// c += a(16x16 bf16, row) * b(16x8 bf16, col), f32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Physical row of logical position `idx` of sequence `seq`, or -1 when there is no such row.
__device__ __forceinline__ long long physical_row(const SparseMlaParams& p, int seq, int seq_len, int idx) {
    if (idx < 0 || idx >= seq_len) return -1;
    const int block = p.block_table[(size_t)seq * p.max_blocks + idx / p.block_size];
    return (long long)block * p.block_size + idx % p.block_size;
}

// Dynamic shared memory of the bf16 kernel (mirrored by the launcher).
__host__ __device__ constexpr int row_stride(int d) { return (d + 15) / 16 * 16 + ROW_PAD; }

template <int DV, int HB>
__device__ __forceinline__ void sparse_mla_bf16_body(const SparseMlaParams& p) {
    constexpr int PAIRS = HB / 16;  // warp pairs; each pair owns 16 heads
    constexpr int THREADS = PAIRS * 64;
    constexpr int DV_HALF = DV / 2;
    constexpr int NT_O = DV_HALF / 8;  // n8 tiles of O per warp
    constexpr int LDP = BN + ROW_PAD;
    static_assert(DV % 16 == 0, "value width must be a multiple of 16");

    // Warp `pair` and warp `pair + PAIRS` share 16 heads: each scores half of a tile's keys, both see the
    // whole P, and each accumulates half of the value columns.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int half = warp / PAIRS, head_tile = warp % PAIRS;
    const int dv_base = half * DV_HALF;
    const int split = blockIdx.x, h0 = blockIdx.y * HB, t = blockIdx.z;

    const int D = p.D, d_pad = (D + 15) / 16 * 16, ld = row_stride(D), chunks = D / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* qs = reinterpret_cast<bf16*>(smem);
    bf16* ks = qs + HB * ld;  // two buffers of BN rows
    bf16* ps = ks + 2 * BN * ld;
    float* max_s = reinterpret_cast<float*>(ps + HB * LDP);  // [2][HB] per-half row maxima of a tile
    float* l_s = max_s + 2 * HB;                                 // [2][HB] per-half row sums at the end
    int* rows_s = reinterpret_cast<int*>(l_s + 2 * HB);          // physical row of every slot of the split

    const int seq = p.token_seq[t];
    const int seq_len = p.seq_lens[seq];
    const int* idx_row = p.indices + (size_t)t * p.K;
    const int n_tiles = (p.K + BN - 1) / BN;
    const int tile_begin = split * p.tiles_per_split;
    const int tile_end = min(tile_begin + p.tiles_per_split, n_tiles);
    const int tile_count = max(tile_end - tile_begin, 0);
    const bf16* kv = static_cast<const bf16*>(p.kv);

    // Q rows of this head group, zero beyond H and in the padding columns.
    const bf16* q = static_cast<const bf16*>(p.q) + (size_t)t * p.H * D;
    for (int i = threadIdx.x; i < HB * (ld / 8); i += THREADS) {
        const int r = i / (ld / 8), c = (i % (ld / 8)) * 8;
        const bool valid = c < D && h0 + r < p.H;
        cp_async_16(qs + r * ld + c, valid ? q + (size_t)(h0 + r) * D + c : q, valid);
    }
    cp_async_commit();
    // Padding columns of the K buffers are never written by the tile loads.
    for (int i = threadIdx.x; i < 2 * BN * (ld - D); i += THREADS) {
        const int r = i / (ld - D), c = D + i % (ld - D);
        ks[r * ld + c] = __float2bfloat16(0.f);
    }
    // Resolve every slot of the split up front: the index and block-table loads are independent, so they
    // are all in flight at once instead of one dependent chain per tile.
    for (int r = threadIdx.x; r < tile_count * BN; r += THREADS) {
        const int slot = tile_begin * BN + r;
        rows_s[r] = slot < p.K ? (int)physical_row(p, seq, seq_len, idx_row[slot]) : -1;
    }
    __syncthreads();

    auto load_tile = [&](int local_tile, int buf) {
        bf16* dst = ks + buf * BN * ld;
        const int* rows = rows_s + local_tile * BN;
        for (int i = threadIdx.x; i < BN * chunks; i += THREADS) {
            const int r = i / chunks, c = (i % chunks) * 8;
            const long long row = rows[r];
            cp_async_16(dst + r * ld + c, row >= 0 ? kv + row * D + c : kv, row >= 0);
        }
    };

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows lane/4 and lane/4 + 8
    float o_acc[NT_O][4];
#pragma unroll
    for (int n = 0; n < NT_O; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.f;
    const float scale_log2 = p.scale * LOG2E;
    const int row0 = head_tile * 16 + lane / 4;  // this thread's two head rows: row0 and row0 + 8

    if (tile_count > 0) load_tile(0, 0);
    cp_async_commit();

    for (int local = 0; local < tile_count; ++local) {
        const int buf = local & 1;
        if (local + 1 < tile_count) {
            load_tile(local + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* kt = ks + buf * BN * ld;
        const int* rows = rows_s + local * BN;

        // S = Q K^T for this warp's 16 heads and 16 keys (two n8 tiles). Even and odd k-steps accumulate
        // separately: two independent mma chains instead of one long dependent one.
        float s[2][4] = {}, s_odd[2][4] = {};
        {
            const bf16* q_frag = qs + (head_tile * 16 + lane % 16) * ld + (lane / 16) * 8;
            const bf16* k_frag = kt + (half * 16 + lane % 8 + (lane / 16) * 8) * ld + ((lane / 8) % 2) * 8;
            int k0 = 0;
            for (; k0 + 32 <= d_pad; k0 += 32) {
                uint32_t a0[4], b0[4], a1[4], b1[4];
                ldmatrix_x4(a0, q_frag + k0);
                ldmatrix_x4(b0, k_frag + k0);
                ldmatrix_x4(a1, q_frag + k0 + 16);
                ldmatrix_x4(b1, k_frag + k0 + 16);
                mma_bf16(s[0], a0, b0[0], b0[1]);
                mma_bf16(s[1], a0, b0[2], b0[3]);
                mma_bf16(s_odd[0], a1, b1[0], b1[1]);
                mma_bf16(s_odd[1], a1, b1[2], b1[3]);
            }
            if (k0 < d_pad) {
                uint32_t a0[4], b0[4];
                ldmatrix_x4(a0, q_frag + k0);
                ldmatrix_x4(b0, k_frag + k0);
                mma_bf16(s[0], a0, b0[0], b0[1]);
                mma_bf16(s[1], a0, b0[2], b0[3]);
            }
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[n][j] += s_odd[n][j];
        }
        // Mask missing rows, scale into the log2 domain; row maxima over both halves of the tile.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int key = half * 16 + n * 8 + (lane % 4) * 2 + (j & 1);
                s[n][j] = rows[key] >= 0 ? s[n][j] * scale_log2 : -INFINITY;
                mx[j / 2] = fmaxf(mx[j / 2], s[n][j]);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
        }
        if (lane % 4 == 0) {
            max_s[half * HB + row0] = mx[0];
            max_s[half * HB + row0 + 8] = mx[1];
        }
        __syncthreads();
        float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_tile = fmaxf(mx[r], max_s[(1 - half) * HB + row0 + r * 8]);
            const float m_new = fmaxf(m_run[r], m_tile);
            alpha[r] = m_new == -INFINITY ? 1.f : exp2f(m_run[r] - m_new);
            m_run[r] = m_new;
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s[n][j] = s[n][j] == -INFINITY ? 0.f : exp2f(s[n][j] - m_run[j / 2]);
                sum[j / 2] += s[n][j];
            }
            const int col = half * 16 + n * 8 + (lane % 4) * 2;
            *reinterpret_cast<uint32_t*>(ps + row0 * LDP + col) = pack_bf16(s[n][0], s[n][1]);
            *reinterpret_cast<uint32_t*>(ps + (row0 + 8) * LDP + col) = pack_bf16(s[n][2], s[n][3]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            sum[r] += __shfl_xor_sync(0xffffffff, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffff, sum[r], 2);
            l_run[r] = l_run[r] * alpha[r] + sum[r];  // this half's share; halves add up at the end
        }
#pragma unroll
        for (int n = 0; n < NT_O; ++n) {
            o_acc[n][0] *= alpha[0];
            o_acc[n][1] *= alpha[0];
            o_acc[n][2] *= alpha[1];
            o_acc[n][3] *= alpha[1];
        }
        __syncthreads();  // P of both halves is complete

        // O[:, dv_base : dv_base + DV/2] += P V over the tile's 32 keys.
#pragma unroll
        for (int kk = 0; kk < BN; kk += 16) {
            uint32_t a[4];
            ldmatrix_x4(a, ps + (head_tile * 16 + lane % 16) * LDP + kk + (lane / 16) * 8);
            const int key = kk + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
            for (int n = 0; n + 1 < NT_O; n += 2) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, kt + key * ld + dv_base + n * 8 + (lane / 16) * 8);
                mma_bf16(o_acc[n], a, b[0], b[1]);
                mma_bf16(o_acc[n + 1], a, b[2], b[3]);
            }
            if constexpr (NT_O % 2 == 1) {
                uint32_t b[2];
                ldmatrix_x2_trans(b, kt + key * ld + dv_base + (NT_O - 1) * 8);
                mma_bf16(o_acc[NT_O - 1], a, b[0], b[1]);
            }
        }
        __syncthreads();  // the buffer, P and the maxima are free for the next tile
    }

    cp_async_wait<0>();  // nothing in flight at exit (an empty split still issued the Q copy)

    // Epilogue: both halves' row sums, normalise, write out / partials.
    if (lane % 4 == 0) {
        l_s[half * HB + row0] = l_run[0];
        l_s[half * HB + row0 + 8] = l_run[1];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8, head = h0 + row;
        if (head >= p.H) continue;
        const float l = l_s[row] + l_s[HB + row];
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
        const size_t th = (size_t)t * p.H + head;
#pragma unroll
        for (int n = 0; n < NT_O; ++n) {
            const int col = dv_base + n * 8 + (lane % 4) * 2;
            const float v0 = o_acc[n][r * 2] * inv_l, v1 = o_acc[n][r * 2 + 1] * inv_l;
            if (p.num_splits == 1) {
                *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.out) + th * DV + col) = pack_bf16(v0, v1);
            } else {
                float* dst = p.part_out + ((size_t)split * p.T * p.H + th) * DV + col;
                *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
            }
        }
        if (half == 0 && lane % 4 == 0) {
            const float lse = l > 0.f ? m_run[r] * LN2 + logf(l) : -INFINITY;
            if (p.num_splits == 1) p.lse[th] = lse;
            else p.part_lse[(size_t)split * p.T * p.H + th] = lse;
        }
    }
}

// Merges the splits of the bf16 kernel: weights exp(lse_s - max) over the normalised partials.
template <typename OutT>
__device__ __forceinline__ OutT from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16(v); }

template <typename OutT>
__device__ void combine_impl(const SparseMlaParams& p) {
    // Block (t*H + h, value chunk): the first warp turns the splits' lse into weights, then every thread
    // merges one value column over all splits.
    const size_t th = blockIdx.x;
    const size_t stride = (size_t)p.T * p.H;
    const int lane = threadIdx.x % 32;
    __shared__ float weights[MAX_SPLITS];
    __shared__ float total_s, max_s;
    for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x) weights[s] = p.part_lse[s * stride + th];
    __syncthreads();
    if (threadIdx.x < 32) {
        float m = -INFINITY;
        for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, weights[s]);
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        float total = 0.f;
        for (int s = lane; s < p.num_splits; s += 32) {
            const float w = m == -INFINITY ? 0.f : expf(weights[s] - m);
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
    const float inv = total_s > 0.f ? 1.f / total_s : 0.f;
    const int d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d < p.DV) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < p.num_splits; ++s) acc += weights[s] * p.part_out[(s * stride + th) * p.DV + d];
        static_cast<OutT*>(p.out)[th * p.DV + d] = from_float<OutT>(acc * inv);
    }
    if (blockIdx.y == 0 && threadIdx.x == 0) p.lse[th] = total_s > 0.f ? max_s + logf(total_s) : -INFINITY;
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
    for (int w = 0; w < WARPS; ++w) l_all += m_w[w] == -INFINITY ? 0.f : l_w[w] * expf(m_w[w] - m_all);
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    const size_t th = (size_t)t * p.H + h;
    for (int d = threadIdx.x; d < DV; d += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < WARPS; ++w)
            if (m_w[w] != -INFINITY) acc += o_w[w * DV + d] * expf(m_w[w] - m_all);
        static_cast<float*>(p.out)[th * DV + d] = acc * inv;
    }
    if (threadIdx.x == 0) p.lse[th] = l_all > 0.f ? m_all + logf(l_all) : -INFINITY;
}

// Entry points, found by name from Rust. The bf16 kernel is instantiated per value width and head group.
#define SPARSE_MLA_BF16_ENTRY(DV, HB)                                                          \
    extern "C" __global__ void __launch_bounds__(HB / 16 * 64)                                 \
        sparse_mla_bf16_dv##DV##_hb##HB(const SparseMlaParams p) { sparse_mla_bf16_body<DV, HB>(p); }
SPARSE_MLA_BF16_ENTRY(16, 16)
SPARSE_MLA_BF16_ENTRY(32, 16)
SPARSE_MLA_BF16_ENTRY(64, 16)
SPARSE_MLA_BF16_ENTRY(128, 16)
SPARSE_MLA_BF16_ENTRY(256, 16)
SPARSE_MLA_BF16_ENTRY(512, 16)
SPARSE_MLA_BF16_ENTRY(16, 64)
SPARSE_MLA_BF16_ENTRY(32, 64)
SPARSE_MLA_BF16_ENTRY(64, 64)
SPARSE_MLA_BF16_ENTRY(128, 64)
SPARSE_MLA_BF16_ENTRY(256, 64)
SPARSE_MLA_BF16_ENTRY(512, 64)

extern "C" __global__ void sparse_mla_combine_bf16(const SparseMlaParams p) { combine_impl<bf16>(p); }
extern "C" __global__ void __launch_bounds__(128) sparse_mla_f32(const SparseMlaParams p) { f32_impl(p); }
