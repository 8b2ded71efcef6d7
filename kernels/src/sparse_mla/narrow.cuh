// The narrow bf16 kernel: at most 8 heads, keys as the mma's rows.
// Part of sparse_mla.cu (included in order from there; not a translation unit of its own).
#pragma once

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
constexpr int NARROW_HEADS = GLM5_SPARSE_MLA_NARROW_HEADS;  // the mma's N: heads per block
constexpr int NARROW_KEYS = GLM5_SPARSE_MLA_NARROW_KEYS;  // the mma's M: keys per warp

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
