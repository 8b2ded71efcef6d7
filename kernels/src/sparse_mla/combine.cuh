// The merge of a token's splits: inside its thread-block cluster (called by the head-tile kernel), or by
// a combine kernel over the f32 partials.
// Part of sparse_mla.cu (included in order from there; not a translation unit of its own).
#pragma once

// The flash-decoding merge inside a thread-block cluster: the cluster is the num_splits blocks of one
// (token, 16-head tile), each holding its normalised partial `part_s` [16][DV] and lse `part_lse_s` [16] in
// shared memory. Every block reads the splits' lse (distributed shared memory) and merges an interleaved
// share of the [16][DV] outputs: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max) (as
// sparse_mla_combine, without the partials' round trip through global memory and the second launch).
// `weights_s`: (MAX_CLUSTER + 2) * 16 floats of scratch.
// Most blocks per cluster the merge's scratch holds: at least the launcher's MAX_MERGE_CLUSTER
// (ops/src/sparse_mla/mod.rs).
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

// Merges the splits of the bf16 kernel: out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max).
// One block of COMBINE_GROUPS warps per (token, head, 128 value columns): warp g merges splits g,
// g + COMBINE_GROUPS, ... (its loads independent, so they are in flight together), lane c four columns; the
// warps' sums meet in shared memory.
constexpr int COMBINE_GROUPS = GLM5_SPARSE_MLA_COMBINE_GROUPS;
constexpr int COMBINE_COLUMNS = GLM5_SPARSE_MLA_COMBINE_COLUMNS;

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
// of COMBINE_ROW_WARPS warps (512 columns): it shortens the time the merge adds after the attention kernel.
constexpr int COMBINE_CHUNK = GLM5_SPARSE_MLA_COMBINE_CHUNK;
constexpr int COMBINE_ROW_WARPS = GLM5_SPARSE_MLA_COMBINE_ROW_WARPS;
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
