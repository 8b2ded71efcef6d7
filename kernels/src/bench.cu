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

// The same loop with mma.sync.m16n8k32 e4m3 (FP8, sm_89+): the legacy tensor-core FP8 rate. Each warp does
// `iters` x 8 MMAs of 2*16*8*32 flops. (Hopper's full FP8 rate needs wgmma; this is the mma.sync path.)
extern "C" __global__ void mma_e4m3_peak(float* out, int iters) {
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t a0 = 0x38383838u ^ lane, a1 = 0x38383838u, a2 = 0x30303030u, a3 = 0x38383838u;
    const uint32_t b0 = 0x30303030u ^ (lane << 3), b1 = 0x38383838u;
    float c[8][4] = {};
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            asm volatile(
                "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                "{%0,%1,%2,%3};\n"
                : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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
