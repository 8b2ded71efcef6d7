// The parameters and row addressing shared by the sparse_mla kernels (sparse_mla.cu: mma.sync and f32;
// sparse_mla_sm90.cu: wgmma). Mirrored by `Params` in ops/src/sparse_mla.rs.
#pragma once

#include "paged.cuh"

struct SparseMlaParams {
    // What the kernels read before their first loads comes first: the first 48 bytes share a 64-byte line of
    // the constant bank with the memory descriptor every global access needs, and each line a block touches
    // before its first load is a constant-cache miss it waits for.
    const int* token_seq;    // [T]
    const int* indices;      // [T, K]
    const void* q;           // [T, H, D]
    const void* kv;          // [num_blocks * block_size, D]
    int K, H, block_size, max_blocks;
    const int* seq_lens;     // [B]
    const int* block_table;  // [B, max_blocks]
    void* out;               // [T, H, DV]          (num_splits == 1)
    float* lse;              // [T, H]              (num_splits == 1)
    float* part_out;         // [splits, T, H, DV]  (num_splits > 1, not combined in a cluster)
    float* part_lse;         // [splits, T, H]      (num_splits > 1, not combined in a cluster)
    int tiles_per_split, num_splits, T, DV, D;
    int cluster_combine;     // 1: a token's splits are one thread-block cluster and merge in shared memory
    float scale;             // softmax scale
};

// Physical row of logical position `idx` of sequence `seq`, or -1 when there is no such row. The block-table
// read is bounded by the table's own width, not by seq_len, so it need not wait for the length's load: one
// dependent global read fewer before the row copies can start.
__device__ __forceinline__ long long physical_row(const SparseMlaParams& p, int seq, int seq_len, int idx) {
    const bool in_table = idx >= 0 && idx < p.max_blocks * p.block_size;
    const int2 page = page_of(max(idx, 0), p.block_size);
    const int block = in_table ? p.block_table[(size_t)seq * p.max_blocks + page.x] : 0;
    if (!in_table || idx >= seq_len) return -1;
    return (long long)block * p.block_size + page.y;
}

// The tiles of `tile_keys` keys that split `split` covers: the first and how many (none past the top-k).
__device__ __forceinline__ int2 split_tiles(const SparseMlaParams& p, int split, int tile_keys) {
    const int n_tiles = (p.K + tile_keys - 1) / tile_keys;
    const int begin = split * p.tiles_per_split;
    return make_int2(begin, max(min(begin + p.tiles_per_split, n_tiles) - begin, 0));
}

// The physical row of every slot of a split of token t's top-k (`count` slots from `first`; past K: -1)
// into `rows`, by `threads` threads, with the loads' latencies overlapped: a thread issues its (up to) eight
// index loads, then the sequence length and the eight block-table loads together. `seq` (token_seq[t]) is
// loaded by the caller early and first used here. Two global latencies in a row instead of one dependent
// chain per slot (or token_seq -> seq_lens before anything else): at one wave of blocks they are the
// kernel's start-up time. The caller synchronises before reading `rows`.
template <int THREADS>
__device__ __forceinline__ void resolve_split_rows(const SparseMlaParams& p, int t, int seq, int first, int count,
                                                   int* rows) {
    constexpr int PER = 8;  // slots per thread and round
    const int* idx_row = p.indices + (size_t)t * p.K;
    for (int round = 0; round < count; round += THREADS * PER) {
        int idx[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int r = round + j * THREADS + threadIdx.x, slot = first + r;
            idx[j] = r < count && slot < p.K ? idx_row[slot] : -1;
        }
        // Pages first, then every block-table load (predicated, none inside a branch), then the rows.
        int2 page[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) page[j] = page_of(max(idx[j], 0), p.block_size);
        const int seq_len = p.seq_lens[seq];
        int block[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const bool in_table = idx[j] >= 0 && page[j].x < p.max_blocks;
            block[j] = in_table ? p.block_table[(size_t)seq * p.max_blocks + page[j].x] : -1;
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int r = round + j * THREADS + threadIdx.x;
            if (r < count) rows[r] = block[j] >= 0 && idx[j] < seq_len ? block[j] * p.block_size + page[j].y : -1;
        }
    }
}
