// Microkernels glm5-bench measures the device's ceilings with.
#include <stdint.h>

#include "mma.cuh"

// Register-only mma.sync.m16n8k16 bf16 loop with 8 independent accumulators per warp: the tensor-core rate
// the sparse_mla kernel can at best reach. Each warp does `iters` x 8 MMAs of 2*16*8*16 flops.
extern "C" __global__ void mma_bf16_peak(float* out, int iters) {
    const uint32_t lane = threadIdx.x % 32;
    uint32_t a[4] = {0x3f803f80u ^ lane, 0x3f803f80u, 0x3c003c00u, 0x3f803f80u};
    const uint32_t b0 = 0x3c003c00u ^ (lane << 3), b1 = 0x3c003c00u;
    float c[8][4] = {};
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            mma_bf16(c[j], a, b0, b1);
        }
    }
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// The row gather alone: what sparse_mla's memory side can at best reach. Block (split, token) of 256 threads
// streams `per_block` of the token's `k` rows of 1152 bytes (GLM-5's 576 bf16) through a ring of STAGES tiles
// of 32 rows, eight threads per row, exactly as the wgmma kernel copies them, and does nothing with them but
// fold one word per thread and tile into its output (so the copies are not dead).
template <int STAGES>
__device__ __forceinline__ void gather_rows_body(const uint8_t* kv, const int* rows, int k, int per_block,
                                                 unsigned* out) {
    constexpr int ROW_BYTES = 1152, TILE_ROWS = 32, TILE_BYTES = TILE_ROWS * ROW_BYTES;
    extern __shared__ __align__(16) uint8_t smem[];
    int* rows_s = reinterpret_cast<int*>(smem + STAGES * TILE_BYTES);
    const int first = blockIdx.x * per_block, count = min(per_block, k - first);
    const int tid = threadIdx.x, row_in_tile = tid / 8, piece = tid % 8, tiles = count / TILE_ROWS;
    for (int i = tid; i < count; i += blockDim.x) rows_s[i] = rows[(size_t)blockIdx.y * k + first + i];
    __syncthreads();
    auto load = [&](int tile) {
        if (tile < tiles) {
            const uint8_t* src = kv + (size_t)rows_s[tile * TILE_ROWS + row_in_tile] * ROW_BYTES + piece * 16;
            uint8_t* dst = smem + (tile % STAGES) * TILE_BYTES + row_in_tile * 128 + piece * 16;
#pragma unroll
            for (int s = 0; s < ROW_BYTES / 128; ++s) cp_async_16(dst + s * TILE_ROWS * 128, src + s * 128, true);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load(s);
    unsigned acc = 0;
    for (int tile = 0; tile < tiles; ++tile) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // the tile has landed for everyone; everyone is done with the previous one
        acc ^= *reinterpret_cast<const unsigned*>(smem + (tile % STAGES) * TILE_BYTES + tid * 16);
        load(tile + STAGES - 1);
    }
    out[((size_t)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + tid] = acc;
}
extern "C" __global__ void __launch_bounds__(256, 1)
    gather_rows_s4(const uint8_t* kv, const int* rows, int k, int per_block, unsigned* out) {
    gather_rows_body<4>(kv, rows, k, per_block, out);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    gather_rows_s6(const uint8_t* kv, const int* rows, int k, int per_block, unsigned* out) {
    gather_rows_body<6>(kv, rows, k, per_block, out);
}

// A plain streaming read: what one kernel needs to move the indexer's key bytes (no math, no selection).
// Two ranges of 16-byte words (the FP8 keys, then their scales); each thread keeps READ_UNROLL loads in
// flight per pass of its grid stride and folds them into one word of `out` (so the loads are not dead).
constexpr int READ_UNROLL = 4;
extern "C" __global__ void __launch_bounds__(256)
    read_bytes(const uint4* a, long long a_words, const uint4* b, long long b_words, unsigned* out) {
    const long long stride = (long long)gridDim.x * blockDim.x, total = a_words + b_words;
    unsigned acc = 0;
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += READ_UNROLL * stride) {
        uint4 v[READ_UNROLL];
#pragma unroll
        for (int u = 0; u < READ_UNROLL; ++u) {
            const long long j = i + u * stride;
            v[u] = j < a_words ? a[j] : j < total ? b[j - a_words] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < READ_UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// What one dependent global load costs when a kernel starts, as the attention kernels' blocks start: one block
// per SM, its thread 0 following `hops` links of `chain` (chain[i] is the next index) from index
// blockIdx.x * spacing. out[3 b] = ns from the block's first stamp to its first link's value (ptxas reads the
// memory descriptor's constant line before that stamp, so its miss is not counted), out[3 b + 1] = ns for the
// `hops` links after it, out[3 b + 2] = the last index (keeps the chain live). %globaltimer: 32 ns ticks here.
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
extern "C" __global__ void load_chain(const unsigned* chain, unsigned spacing, int hops, unsigned long long* out) {
    __shared__ unsigned sink;
    if (threadIdx.x != 0) return;
    // The value goes to shared memory before each stamp: the store waits for the load, the stamp for the store.
    const auto stamp_after = [&](unsigned value) {
        asm volatile("st.volatile.shared.u32 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(&sink)), "r"(value)
                     : "memory");
        return global_ns();
    };
    const unsigned long long start = global_ns();
    unsigned i = chain[(size_t)blockIdx.x * spacing];
    const unsigned long long first = stamp_after(i);
    for (int h = 0; h < hops; ++h) i = chain[i];
    const unsigned long long last = stamp_after(i);
    out[3 * blockIdx.x] = first - start;
    out[3 * blockIdx.x + 1] = last - first;
    out[3 * blockIdx.x + 2] = i;
}

// Grid-wide meetings: every block of a grid that is resident all at once arrives and waits for all the others,
// `rounds` times back to back after one meeting that lines the blocks up; block 0 stamps the rounds with the
// global timer (out[0]: ns for all rounds). What an exact top-k inside one score grid would pay per exchange.
// Before each meeting every block adds `payload` counts into a 256-bin histogram (one `red` each, its bins
// spread over the grid) and after it reads the histogram back, as a histogram exchange would.
//   flat:      thread 0 of every block adds 1 to a counter and polls it until it reaches the round's total.
//   ticket:    the same add returns the ticket; the last block sets a flag the others poll (a separate line,
//              so the polls do not compete with the adds).
//   cluster:   clusters of 8 meet by the cluster barrier first; one ticket a cluster; the cluster barrier again.
enum class Meeting { Flat, Ticket, Cluster };

__device__ __forceinline__ unsigned load_acquire(const unsigned* address) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(address) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(unsigned* address, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(address), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned add_acq_rel(unsigned* address, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(address), "r"(v) : "memory");
    return old;
}

template <Meeting M>
__device__ void meetings_body(unsigned* sync, int* hist, int payload, int rounds, unsigned long long* out) {
    constexpr unsigned CLUSTER = 8;
    const unsigned rank = M == Meeting::Cluster ? cluster_rank() : 0;
    const unsigned members = M == Meeting::Cluster ? gridDim.x / CLUSTER : gridDim.x;
    unsigned* counter = sync;
    unsigned* flag = sync + 32;  // its own 128-byte line
    unsigned long long start = 0;
    int sink = 0;
    for (int r = 0; r <= rounds; ++r) {
        if (r == 1 && blockIdx.x == 0 && threadIdx.x == 0) start = global_ns();
        int* bins = hist + (r & 1) * 256;
        for (int i = threadIdx.x; i < payload; i += blockDim.x) atomicAdd(&bins[(i + 37 * blockIdx.x) & 255], 1);
        if constexpr (M == Meeting::Cluster) cluster_sync();
        else __syncthreads();
        if (threadIdx.x == 0 && rank == 0) {
            const unsigned goal = members * (r + 1);
            if constexpr (M == Meeting::Flat) {
                add_acq_rel(counter, 1);
                while (load_acquire(counter) < goal) {
                }
            } else {
                if (add_acq_rel(counter, 1) == goal - 1) store_release(flag, r + 1);
                while (load_acquire(flag) < (unsigned)(r + 1)) {
                }
            }
        }
        if constexpr (M == Meeting::Cluster) cluster_sync();
        else __syncthreads();
        if (payload > 0) sink += bins[threadIdx.x & 255];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = global_ns() - start;
    if (sink == -1) out[1] = sink;  // keeps the reads
}
extern "C" __global__ void __launch_bounds__(256) meetings_flat(unsigned* sync, int* hist, int payload, int rounds,
                                                                unsigned long long* out) {
    meetings_body<Meeting::Flat>(sync, hist, payload, rounds, out);
}
extern "C" __global__ void __launch_bounds__(256) meetings_ticket(unsigned* sync, int* hist, int payload, int rounds,
                                                                  unsigned long long* out) {
    meetings_body<Meeting::Ticket>(sync, hist, payload, rounds, out);
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256)
    meetings_cluster(unsigned* sync, int* hist, int payload, int rounds, unsigned long long* out) {
    meetings_body<Meeting::Cluster>(sync, hist, payload, rounds, out);
}
