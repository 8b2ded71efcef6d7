// The bf16 head-tile kernel: tiles of 16 heads, a split of the top-k per block.
// Part of sparse_mla.cu (included in order from there; not a translation unit of its own).
#pragma once

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
