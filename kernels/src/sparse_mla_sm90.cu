// Sparse absorbed-MLA attention by warpgroup MMA (wgmma): sm_90a only (Hopper), compiled for nothing else.
// Same contract and parameters as the mma.sync kernel in sparse_mla.cu (ops/src/sparse_mla/mod.rs), for
// GLM-5's rows (576 = 512 value columns + 64 rope) and heads in groups of 64.
//
// One block of two warpgroups handles one token, 64 heads and a contiguous range of 32-key tiles (a split).
// Key tiles stream through a five-stage cp.async ring, their rows stored as nine 64-column slabs of 128-byte
// rows in the 128-byte swizzle wgmma reads (16-byte piece c of row r at piece c ^ (r % 8)). Q (64 x 576) is
// staged in the ring's last two stages only until each warp holds its fragments in registers (72 per thread):
//   S = Q K^T   each warpgroup takes every other one of the row's 36 k16 steps (wgmma m64n32k16, Q from
//               registers, K from shared memory); the halves meet in shared memory and both warpgroups hold S;
//   softmax     the same running maxima in both (identical inputs, identical results); warpgroup g
//               exponentiates only P's keys 16g..16g+15, writes them to shared memory (two P buffers, one per
//               tile in flight) and sums them into its half of l (the halves meet after the loop);
//   O += P V    warpgroup g accumulates value columns 256g..256g+255 (wgmma m64n256k16, P and V = the tile's
//               own rows read N-major, both from shared memory): 128 f32 accumulators per thread. It is issued
//               once the next tile's S halves have met, so the tensor cores run it under that tile's softmax.
//               P goes through shared memory because a running wgmma's register operands must not change and
//               a second set of P registers does not fit (ptxas then serialises every wgmma).
// The ring holds three tiles in flight, the tile in S and the tile in P V.
// Why: with mma.sync every warp stages its operands through registers (ldmatrix), and at 64 heads that
// shared-memory traffic, not the tensor cores, bounded the kernel; wgmma reads each operand once per
// warpgroup. Q in registers halves what S reads from shared memory and frees the room for the deeper ring.
// With several splits the block writes a normalised f32 partial and its lse, merged by sparse_mla.cu's combine
// kernel.

#include <cuda_bf16.h>
#include <stdint.h>

#include "mma.cuh"
#include "sparse_mla.cuh"
#include "wgmma.cuh"

namespace {

constexpr int D = GLM5_SPARSE_MLA_WGMMA_ROW_DIM, DV = GLM5_SPARSE_MLA_WGMMA_VALUE_DIM;            // row and value widths (GLM-5's kv_lora_rank + rope)
constexpr int HEADS = GLM5_SPARSE_MLA_WGMMA_HEADS;                   // heads per block: wgmma's M
constexpr int BN = GLM5_SPARSE_MLA_TILE;                      // keys per tile
constexpr int STAGES = GLM5_SPARSE_MLA_WGMMA_STAGES;                   // key tiles in the ring: 3 loading, 1 in S, 1 in P V
constexpr int SLABS = D / 64;               // 64-column (128-byte) slabs per row
constexpr int PIECES = D / 8;               // 16-byte pieces per row
constexpr int STEPS = D / 16;               // k16 steps of S
constexpr int STEPS_PER_GROUP = STEPS / 2;  // per warpgroup
constexpr int THREADS = 256;
constexpr int Q_BYTES = SLABS * HEADS * 128;
constexpr int TILE_BYTES = SLABS * BN * 128;
constexpr int EXCHANGE_BYTES = 2 * 128 * 16 * 4;  // each warpgroup's partial S, 16 floats per thread
constexpr int P_BYTES = HEADS * BN * 2;          // one tile's P (bf16), in unswizzled 8 x 16-byte core matrices
constexpr int P_STEP_BYTES = HEADS * 16 * 2;     // P's keys of one k16 step: 8 row groups of two core matrices
// A row's running maximum (log2 domain) is only raised when a tile's maximum exceeds it by more than this:
// probabilities stay below 2^8 (no overflow in bf16 or f32) and the rescale of O (128 multiplies per thread)
// is skipped for almost every tile. Exact: O, l and lse all use the same maximum.
constexpr float RESCALE_SLACK = 8.f;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
static_assert(D % 64 == 0 && STEPS % 4 == 0 && DV == 2 * 256, "two warpgroups of 256 value columns");
static_assert(THREADS == BN * 8 && PIECES == 8 * SLABS, "a tile copy: 8 threads per row, one piece per slab each");
static_assert(Q_BYTES == 2 * TILE_BYTES, "Q is staged in two key stages");

typedef __nv_bfloat16 bf16;

// 2^x without exp2f's care for denormal results (they flush to 0: probabilities below 2^-126 of the row's
// maximum, nothing the bf16 P can hold anyway).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace

// Shared memory: the key ring (Q in its last two stages at first), the S exchange, then the split's row table
// and each tile's mask of valid keys (sized by the launcher), from a 1024-byte boundary (the swizzle
// pattern's period).
extern "C" __global__ void __launch_bounds__(THREADS, 1) sparse_mla_wgmma_dv512_d576(const SparseMlaParams p) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* k_s = smem;
    uint8_t* q_s = k_s + (STAGES - 2) * TILE_BYTES;  // Q is staged in the last two stages until it is in registers
    float4* exchange = reinterpret_cast<float4*>(k_s + STAGES * TILE_BYTES);  // [group][4][128]
    uint8_t* p_s = k_s + STAGES * TILE_BYTES + EXCHANGE_BYTES;  // [2 tiles][2 k16 steps][8 row groups][2][128 B]
    int* rows_s = reinterpret_cast<int*>(p_s + 2 * P_BYTES);
    uint32_t* masks_s = reinterpret_cast<uint32_t*>(rows_s + p.tiles_per_split * BN);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int group = tid / 128, gtid = tid % 128, wg_warp = gtid / 32;  // warpgroup, its thread and warp
    const int split = blockIdx.x, h0 = blockIdx.y * HEADS, t = blockIdx.z;
    const int seq = p.token_seq[t];  // first used by resolve_split_rows: its latency hides behind Q's copies
    const int2 tiles = split_tiles(p, split, BN);
    const int tile_begin = tiles.x, tile_count = tiles.y;
    const bf16* kv = static_cast<const bf16*>(p.kv);

    // Copies: thread t moves piece t % 8 of every 64-column slab of row t / 8 (of a key tile; of Q, rows t / 8
    // and t / 8 + 32): eight threads cover 128 contiguous bytes of a row, and both addresses advance by
    // immediates from slab to slab.
    const int copy_row = tid / 8, copy_piece = tid % 8;
    const int copy_offset = copy_row * 128 + ((copy_piece ^ (copy_row % 8)) * 16);
    const bf16* q = static_cast<const bf16*>(p.q) + ((size_t)t * p.H + h0) * D;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int slab = 0; slab < SLABS; ++slab)
            cp_async_16(q_s + slab * HEADS * 128 + half * 32 * 128 + copy_offset,
                        q + (size_t)(copy_row + 32 * half) * D + slab * 64 + copy_piece * 8, true);
    cp_async_commit();
    // Every slot of the split resolved up front.
    resolve_split_rows<THREADS>(p, t, seq, tile_begin * BN, tile_count * BN, rows_s);
    __syncthreads();

    // One cp.async group per tile (empty past the split's end); row -1 is zero-filled. The thread's row of
    // the tile is read ahead of the copy (`row_of`), off the copy's critical path.
    const auto row_of = [&](int local) { return local < tile_count ? rows_s[local * BN + copy_row] : -1; };
    auto load_tile = [&](int local, long long row) {
        if (local < tile_count) {
            const bf16* src = (row >= 0 ? kv + row * D : kv) + copy_piece * 8;
            uint8_t* dst = k_s + (local % STAGES) * TILE_BYTES + copy_offset;
#pragma unroll
            for (int slab = 0; slab < SLABS; ++slab) cp_async_16(dst + slab * BN * 128, src + slab * 64, row >= 0);
        }
        cp_async_commit();
    };
    // Tiles 0 to 2 now; Q occupies stages 3 and 4 until every warp holds its fragments.
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) load_tile(s, row_of(s));
    // Each tile's valid keys as a bit mask (read after the loop's first barrier).
    for (int tile = warp; tile < tile_count; tile += THREADS / 32) {
        const uint32_t valid = __ballot_sync(0xffffffff, rows_s[tile * BN + lane] >= 0);
        if (lane == 0) masks_s[tile] = valid;
    }

    // Warpgroup g takes the k16 steps 2i + g of S: its Q fragments (A in registers, mma.sync's m16k16 layout
    // per warp), and the key operand at slab i / 2, byte (i % 2) * 64 + g * 32 of the 128-byte rows.
    cp_async_wait<STAGES - 2>();  // Q (tiles 0 to 2 may still be in flight)
    __syncthreads();
    uint32_t qa[STEPS_PER_GROUP][4];
#pragma unroll
    for (int i = 0; i < STEPS_PER_GROUP; ++i) {
        const int row = 16 * wg_warp + lane % 16, chunk = 2 * (2 * i + group) + lane / 16;
        ldmatrix_x4(qa[i], q_s + (chunk / 8) * HEADS * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) * 16));
    }
    __syncthreads();  // every warp holds its fragments: stages 3 and 4 are free for tiles 3 and 4
    const uint32_t k_base = smem_addr(k_s);
    const int g = lane / 4, c4 = lane % 4;  // accumulator rows 16 * wg_warp + g (+ 8), columns 2 * c4 (+ 1)
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    const float scale_log2 = p.scale * LOG2E;

    // O += P V of a tile runs on the tensor cores under the next tile's softmax: it is issued after that
    // tile's S exchange, and reads P from buffer tile % 2, which the softmax two tiles on rewrites only after
    // both warpgroups' S waits (behind the exchange barrier) covered it.
    const uint32_t p_base = smem_addr(p_s);
    // A rescale of O the softmax owes it (rows g and g + 8): applied only while no wgmma writes O, i.e. after
    // a wait that covers the last P V issued (a wgmma wait inside a branch some warps of the warpgroup skip
    // would break wgmma's warpgroup-uniform rules).
    float o_scale[2] = {1.f, 1.f};
    const auto rescale_o = [&]() {
        wgmma_pin(o);
        if (__any_sync(0xffffffff, o_scale[0] != 1.f || o_scale[1] != 1.f)) {
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j] *= o_scale[0];
                o[4 * j + 1] *= o_scale[0];
                o[4 * j + 2] *= o_scale[1];
                o[4 * j + 3] *= o_scale[1];
            }
        }
        o_scale[0] = o_scale[1] = 1.f;
    };
    const auto issue_pv = [&](int local) {
        const uint32_t tile = k_base + (local % STAGES) * TILE_BYTES;
        const uint32_t p_tile = p_base + (local % 2) * P_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const uint64_t a = wgmma_desc_interleave(p_tile + k * P_STEP_BYTES, 128, 256);
            const uint64_t b = wgmma_desc(tile + 4 * group * BN * 128 + k * 16 * 128, BN * 128, 1024);
            wgmma_m64n256k16_ss_tn(o, a, b);
        }
        wgmma_commit();
    };
    for (int local = 0; local < tile_count; ++local) {
        cp_async_wait<STAGES - 3>();  // this thread's pieces of tile `local` have landed
        fence_proxy_async_shared();   // ... and are visible to wgmma's reads
        __syncthreads();              // everyone's
        const uint32_t tile = k_base + (local % STAGES) * TILE_BYTES;
        const uint64_t k_desc = wgmma_desc(tile + group * 32, 16, 1024);
        const int ahead_row = row_of(local + STAGES - 2);
        const uint32_t valid = masks_s[local];  // read now, used by the softmax

        // This warpgroup's half of S (64 heads x 32 keys).
        float s[16] = {};
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < STEPS_PER_GROUP; ++i) {
            const uint32_t within = (i % 2) * 64;
            wgmma_m64n32k16_rs(s, qa[i], wgmma_desc_advance(k_desc, (i / 2) * BN * 128 + within), i > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();  // S, and P V of tile local - 2
        wgmma_pin(s);
        rescale_o();
        // The halves meet: each thread adds the other warpgroup's partial of the same 16 elements.
#pragma unroll
        for (int j = 0; j < 4; ++j)
            exchange[(group * 4 + j) * 128 + gtid] = make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 other = exchange[((1 - group) * 4 + j) * 128 + gtid];
            s[4 * j] += other.x;
            s[4 * j + 1] += other.y;
            s[4 * j + 2] += other.z;
            s[4 * j + 3] += other.w;
        }
        // Both warpgroups' S waits (behind the barrier above) covered P V of tile local - 2: its stage is free.
        load_tile(local + STAGES - 2, ahead_row);
        // O += P V of the previous tile: the softmax below writes neither its registers nor its stage (a raised
        // maximum's rescale of O waits for the next wait).
        if (local > 0) issue_pv(local - 1);

        // Online softmax over the tile's keys; key 8j + 2c4 + (e & 1) is element 4j + e (row + 8 for e >= 2).
        const bool all_valid = valid == 0xffffffffu;
        if (!all_valid) {
#pragma unroll
            for (int i = 0; i < 16; ++i)
                if (!((valid >> (8 * (i / 4) + 2 * c4 + (i & 1))) & 1)) s[i] = -INFINITY;
        }
        float m_tile[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 16; ++i) m_tile[(i / 2) % 2] = fmaxf(m_tile[(i / 2) % 2], s[i]);
        bool raise[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m_tile[r] = fmaxf(m_tile[r], __shfl_xor_sync(0xffffffff, m_tile[r], 1));
            m_tile[r] = fmaxf(m_tile[r], __shfl_xor_sync(0xffffffff, m_tile[r], 2));
            m_tile[r] *= scale_log2;
            raise[r] = m_tile[r] > m_run[r] + RESCALE_SLACK;
        }
        // A raised maximum rescales l now and O (with the P V in flight) once that P V has landed.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (raise[r]) {
                const float alpha = exp2_ftz(m_run[r] - m_tile[r]);
                m_run[r] = m_tile[r];
                l_run[r] *= alpha;
                o_scale[r] *= alpha;
            }
        }
        // p = 2^(score - m) of this warpgroup's keys only (16g..16g+15: elements 8g..8g+7, the k16 step of P it
        // writes); a masked key (or a row with nothing valid yet) has p = 0. l sums them: the warpgroups' halves
        // of l meet after the loop. (s's index stays static: the element is selected, not indexed by g.)
        float p[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = (i / 2) % 2;  // the same row for element i and 8 + i
            const float x = group ? s[8 + i] : s[i];
            const float v = exp2_ftz(fmaf(x, scale_log2, -m_run[r]));
            p[i] = all_valid || x != -INFINITY ? v : 0.f;
            l_run[r] += p[i];  // this thread's columns only
        }
        // This warpgroup's k16 step of P (keys 16g..16g+15), for P V after the next tile's S exchange: rows
        // 16 * wg_warp + g (+ 8) are row r of 8-row groups 2 * wg_warp (+ 1), keys 8h + 2c4 (+ 1) at byte 4c4
        // of core matrix h; the loop's next fence and barrier make it visible to both warpgroups' wgmma.
        {
            uint8_t* dst = p_s + (local % 2) * P_BYTES + group * P_STEP_BYTES + 2 * wg_warp * 256 + g * 16 + 4 * c4;
#pragma unroll
            for (int e = 0; e < 4; ++e)  // (row + 8 * (e % 2), core matrix e / 2)
                *reinterpret_cast<uint32_t*>(dst + (e % 2) * 256 + (e / 2) * 128) = pack_bf16(p[2 * e], p[2 * e + 1]);
        }
    }
    if (tile_count > 0) {
        wgmma_wait<0>();
        rescale_o();
        fence_proxy_async_shared();  // the last tile's P, for wgmma's reads
        __syncthreads();             // (every read of the S exchange is done)
        issue_pv(tile_count - 1);
        // The halves of l meet: the thread of the other warpgroup with the same index holds the same rows and
        // columns of the other keys.
        float* l_exchange = reinterpret_cast<float*>(exchange);  // [group][row half][128]
        l_exchange[(group * 2) * 128 + gtid] = l_run[0];
        l_exchange[(group * 2 + 1) * 128 + gtid] = l_run[1];
        __syncthreads();
        l_run[0] += l_exchange[((1 - group) * 2) * 128 + gtid];
        l_run[1] += l_exchange[((1 - group) * 2 + 1) * 128 + gtid];
    }
    wgmma_wait<0>();
    wgmma_pin(o);
    cp_async_wait<0>();  // nothing in flight at exit
    // The combine (a programmatic dependent) may start its blocks; it waits for this grid's writes itself.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    // Epilogue: the quad's row sums, normalise, write out (or the split's partial) and lse.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 1);
        l_run[r] += __shfl_xor_sync(0xffffffff, l_run[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int head = h0 + 16 * wg_warp + g + 8 * r;
        const float inv_l = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
        const size_t th = (size_t)t * p.H + head;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int col = 256 * group + 8 * j + 2 * c4;
            const float v0 = o[4 * j + 2 * r] * inv_l, v1 = o[4 * j + 2 * r + 1] * inv_l;
            if (p.num_splits == 1) {
                *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.out) + th * DV + col) = pack_bf16(v0, v1);
            } else {
                float* dst = p.part_out + ((size_t)split * p.T * p.H + th) * DV + col;
                *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
            }
        }
        if (group == 0 && c4 == 0) {
            const float lse = l_run[r] > 0.f ? m_run[r] * LN2 + logf(l_run[r]) : -INFINITY;
            if (p.num_splits == 1) p.lse[th] = lse;
            else p.part_lse[(size_t)split * p.T * p.H + th] = lse;
        }
    }
}
