// The score stage: key tiles, the mma.sync / wgmma / f32 score kernels and their histograms.
// Part of dsa_indexer.cu (included in order from there; not a translation unit of its own).
#pragma once

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
// (or taking a null `head`) moved the grouped kernel's wgmma descriptors out of uniform registers.
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
// thread of a score block. Unrolled, so that a thread's shared loads go out together (a loop waited for each,
// at the end of every block).
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
    // the grid falls behind in its start-up (four blocks per SM), so each row's blocks span every start
    // position, and its first blocks, the early ones, take the row's remainder tiles (by the stride below).
    // With a row's blocks along x, the last rows started late and ended last, holding up the top-k.
    const int block = blockIdx.y, blocks = gridDim.y;
    // The cluster top-k may launch at once: its blocks set up beside these (where they fit) and wait for this
    // grid. The chain's first kernel launches after the tile loops (launched early, its many blocks cost more
    // than they save).
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
static_assert(GROUP_TOKENS == GLM5_DSA_INDEXER_GROUP_TOKENS, "GROUP_TOKENS differs from interface.rs");
static_assert(GROUP_SHARED_BYTES == GLM5_DSA_INDEXER_GROUP_SHARED_BYTES, "GROUP_SHARED_BYTES differs from interface.rs");
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

