// Mixture of experts on the device (contract: ops/src/moe/mod.rs), a chain of six kernels with no host
// round trip:
//
//   moe_router_logits_*  per (ROUTER_EXPERTS experts, ROUTER_TOKENS tokens), a block: the router's f32
//                      logits x · Wᵀ of a few tokens (decode), x in the model dtype widened as it is read.
//   moe_route          per token, a block: sigmoid scores, + correction bias for the choice, group limit
//                      (a group's score is the sum of its two best choices; the best `topk_group` groups
//                      stay), the `top_k` best allowed experts (equal values go to the lower expert), gates
//                      = the chosen experts' sigmoid scores, normalised (sum + 1e-20) and scaled, and, when
//                      the layer has one, the shared expert as one more slot with gate 1. The same float
//                      operations in the same order as the CPU reference, so the choice and gates agree
//                      bit for bit where the device's expf rounds as the host's (an ulp apart, two experts
//                      whose choices are that close may trade places).
//   moe_align          one block: the assignments (token, slot) grouped by expert, in ascending assignment
//                      order within an expert; each expert's offset; the list of experts with any token.
//   moe_gate_up_*      per (active expert, 8 intermediate features): a warp per feature streams the
//                      expert's gate and up rows once (16-byte loads) for all of the expert's tokens (8 at a
//                      time) and writes silu(gate)·up, rounded as the model dtype rounds it.
//   moe_down_*         per (active expert, 8 hidden rows): a warp per row, the same way, times the gate,
//                      one f32 row per assignment.
//   moe_combine_*      per token: the sum of its slots' rows in slot order, rounded to the model dtype.
//   moe_{gate_up,down}_t1_*  every mat-vec kernel again for one token per expert (batch-1 decode), without
//                      the other token slots' tests.
//
//   moe_{gate_up,down}_{fp8,nvfp4}_*  the same two mat-vecs over experts kept quantised (block-scaled FP8,
//                      NVFP4), dequantised in registers (decoders in weight_formats.cuh); each projection is
//                      stacked [E', rows, k] with its scales, its rows in `parts` separately quantised parts
//                      (gate_up: the gate rows, then the up rows).
//   moe_{gate_up,down}_<i-quant>_*  the same over GGUF i-quant experts as the file stacks them, [E, rows,
//                      row bytes] per projection (gate and up two tensors of one format; decoders in
//                      gguf_formats.cuh).
//   moe_{gate_up,down}_q4_k_mma_bf16  Q4_K experts with bf16 activations on the tensor cores (q4k_mma.cuh):
//                      per (active expert, 16 output rows), the block's warps splitting the rows' Q4_K
//                      blocks, the expert's tokens 8 at a time, or its one token as the one-row mat-vec.
//
// Decode reads each chosen expert's weights exactly once however many tokens chose it; the kernels are
// bandwidth-bound mat-vecs, meant for a few tokens per expert (decode of 1..64 sequences).

#include <cuda_bf16.h>
#include <stdint.h>

#include "bf16_mma.cuh"
#include "gguf_formats.cuh"
#include "q4k_mma.cuh"
#include "row_norm.cuh"
#include "weight_formats.cuh"

#define MOE_ROUTE_MAX_EXPERTS 1024
#define MOE_ROUTE_MAX_GROUPS 64
#define MOE_ROUTE_MAX_TOPK 64
#define MOE_WARPS 8
#define MOE_TOKENS_PER_PASS 8
#define ROUTER_THREADS GLM5_ROUTER_THREADS

namespace {

// The model dtype's rounding and stores (row_norm.cuh's).
using glm5::rows::round_to;
using glm5::rows::store;

// 16 bytes of T as floats: 8 bf16 or 4 f32.
template <typename T> struct Vec;
template <> struct Vec<__nv_bfloat16> {
    static constexpr int N = 8;
    __device__ __forceinline__ static void load(const __nv_bfloat16* p, float* out) {
        uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = __bfloat1622float2(pairs[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
};
template <> struct Vec<float> {
    static constexpr int N = 4;
    __device__ __forceinline__ static void load(const float* p, float* out) {
        float4 raw = __ldg(reinterpret_cast<const float4*>(p));
        out[0] = raw.x;
        out[1] = raw.y;
        out[2] = raw.z;
        out[3] = raw.w;
    }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// (value, index) order of the reference's top-k: larger value first, then lower index; index < 0 = none.
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
    if (i1 < 0) return false;
    if (i2 < 0) return true;
    return v1 > v2 || (v1 == v2 && i1 < i2);
}

}  // namespace

// logits[t, e] = Σ_c f32(x[t, c]) · w[e, c] for the block's ROUTER_EXPERTS experts and ROUTER_TOKENS tokens:
// each thread a strided share of the columns, 4 at a time (w as 16-byte vectors, x as 8- or 16-byte ones; the
// launcher checks hidden % 4 and the alignment), all its experts' loads of a pass issued together; then the
// block's sums by warp shuffles and shared memory, in a fixed order (the same logits every run). It replaces a
// cast of x to f32 and cuBLAS's f32 GEMM, two launches that took 13 us on an H100 where one pass over GLM-5's
// 6.3 MB router weight is 2.
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&out)[4]);
template <> __device__ __forceinline__ void load4(const float* p, float (&out)[4]) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
}
template <> __device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&out)[4]) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    out[0] = glm5::rows::bf16_low(v.x);
    out[1] = glm5::rows::bf16_high(v.x);
    out[2] = glm5::rows::bf16_low(v.y);
    out[3] = glm5::rows::bf16_high(v.y);
}

template <typename T>
__device__ void router_logits(const T* __restrict__ x, const float* __restrict__ w, int n_tokens, int n_experts,
                              int hidden, float* __restrict__ logits) {
    constexpr int E = GLM5_ROUTER_EXPERTS, TOKENS = GLM5_ROUTER_TOKENS;
    __shared__ float partial[ROUTER_THREADS / 32][E * TOKENS];
    const int e0 = blockIdx.x * E, t0 = blockIdx.y * TOKENS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float acc[E][TOKENS];
#pragma unroll
    for (int i = 0; i < E; ++i)
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) acc[i][j] = 0.0f;
    // Rows past the last expert or token read the last one (in bounds); their sums are not written.
    const float* rows[E];
#pragma unroll
    for (int i = 0; i < E; ++i) rows[i] = w + (size_t)min(e0 + i, n_experts - 1) * hidden;
    const T* xs[TOKENS];
#pragma unroll
    for (int j = 0; j < TOKENS; ++j) xs[j] = x + (size_t)min(t0 + j, n_tokens - 1) * hidden;
#pragma unroll 2
    for (int c = 4 * threadIdx.x; c < hidden; c += 4 * ROUTER_THREADS) {
        float wv[E][4], xv[TOKENS][4];
#pragma unroll
        for (int i = 0; i < E; ++i) load4(rows[i] + c, wv[i]);
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) load4(xs[j] + c, xv[j]);
#pragma unroll
        for (int i = 0; i < E; ++i)
#pragma unroll
            for (int j = 0; j < TOKENS; ++j)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[i][j] = fmaf(xv[j][v], wv[i][v], acc[i][j]);
    }
#pragma unroll
    for (int i = 0; i < E; ++i)
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) {
            const float sum = warp_sum(acc[i][j]);
            if (lane == 0) partial[warp][i * TOKENS + j] = sum;
        }
    __syncthreads();
    if (threadIdx.x < E * TOKENS) {
        const int i = threadIdx.x / TOKENS, j = threadIdx.x % TOKENS;
        float sum = 0.0f;
        for (int v = 0; v < ROUTER_THREADS / 32; ++v) sum += partial[v][threadIdx.x];
        if (e0 + i < n_experts && t0 + j < n_tokens) logits[(size_t)(t0 + j) * n_experts + e0 + i] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
    moe_router_logits_bf16(const __nv_bfloat16* x, const float* w, int n_tokens, int n_experts, int hidden,
                           float* logits) {
    router_logits(x, w, n_tokens, n_experts, hidden, logits);
}
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
    moe_router_logits_f32(const float* x, const float* w, int n_tokens, int n_experts, int hidden, float* logits) {
    router_logits(x, w, n_tokens, n_experts, hidden, logits);
}

extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                     int n_tokens, int n_experts, int n_group, int topk_group, int top_k,
                                     int normalise, float scaling, int shared_expert,
                                     uint32_t* __restrict__ ids, float* __restrict__ gates) {
    __shared__ float group_score[MOE_ROUTE_MAX_GROUPS];
    __shared__ unsigned char group_kept[MOE_ROUTE_MAX_GROUPS];
    __shared__ int picked[MOE_ROUTE_MAX_TOPK];
    // Dynamic shared memory (interface.rs route_shared_bytes): the experts' scores and choices, then each warp's
    // min(top_k, 32) candidates. Sized to the call, not to MOE_ROUTE_MAX_EXPERTS: 2.5 KB for GLM-5's 256
    // experts where fixed arrays took 17 KB.
    extern __shared__ float route_shared[];
    const int t = blockIdx.x;
    const int e = threadIdx.x;
    const int lane = e & 31, warp = e >> 5, warps = blockDim.x >> 5;
    const int per_warp = min(top_k, 32);
    float* score = route_shared;
    float* choice = score + n_experts;
    float* candidate_value = choice + n_experts;
    int* candidate_index = reinterpret_cast<int*>(candidate_value + warps * per_warp);
    if (t >= n_tokens) return;
    if (e < n_experts) {
        const float s = 1.0f / (1.0f + expf(-logits[(size_t)t * n_experts + e]));
        score[e] = s;
        choice[e] = s + bias[e];
    }
    __syncthreads();
    const int group_size = n_experts / n_group;
    // Every group kept (GLM-5: one group): the group stage chooses nothing. One thread walking a 256-expert
    // group took a third of the launch.
    const bool every_group = topk_group >= n_group;
    if (e < n_group && !every_group) {
        float first = -INFINITY, second = -INFINITY;
        for (int i = e * group_size; i < (e + 1) * group_size; ++i) {
            const float v = choice[i];
            if (v > first) {
                second = first;
                first = v;
            } else if (v > second) {
                second = v;
            }
        }
        group_score[e] = group_size >= 2 ? first + second : first;
    }
    __syncthreads();
    if (e == 0) {
        for (int g = 0; g < n_group; ++g) group_kept[g] = every_group;
        for (int r = 0; r < topk_group && !every_group; ++r) {
            int best = -1;
            for (int g = 0; g < n_group; ++g)
                if (!group_kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
            if (best >= 0) group_kept[best] = 1;
        }
    }
    __syncthreads();
    const float allowed = (e < n_experts && group_kept[e / group_size]) ? choice[e] : -INFINITY;
    // The top_k without a pick-by-pick loop: one warp alone runs a routing call's critical path, so its
    // length is the launch's time (ncu: 12 us for 8 picks of 256 by a block-wide or per-warp argmax per pick,
    // 5 us for one pick; a warp's dependent instructions, not barriers, set it). Each warp sorts its 32
    // experts (a bitonic network of shuffles) and offers its best min(top_k, 32) in order; each candidate's
    // rank is its place in its own list plus the candidates of the other lists that beat it, and the top_k
    // ranks are written in place.
    float v = allowed;
    int i = e < n_experts ? e : -1;
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            const float other_v = __shfl_xor_sync(0xffffffffu, v, j);
            const int other_i = __shfl_xor_sync(0xffffffffu, i, j);
            // The pair's lower lane keeps the better of the two where this run is sorted best first.
            const bool keep_better = ((lane & j) == 0) == ((lane & k) == 0);
            if (keep_better ? better(other_v, other_i, v, i) : better(v, i, other_v, other_i)) {
                v = other_v;
                i = other_i;
            }
        }
    }
    if (lane < per_warp) {
        candidate_value[warp * per_warp + lane] = v;
        candidate_index[warp * per_warp + lane] = i;
    }
    __syncthreads();
    const int candidates = warps * per_warp;  // <= blockDim.x: a thread each
    if (e < candidates) {
        const int mine = e / per_warp;
        const float cv = candidate_value[e];
        const int ci = candidate_index[e];
        if (ci >= 0) {
            int rank = e % per_warp;
            for (int w = 0; w < warps; ++w) {
                if (w == mine) continue;
                for (int c = 0; c < per_warp; ++c)
                    rank += better(candidate_value[w * per_warp + c], candidate_index[w * per_warp + c], cv, ci);
            }
            if (rank < top_k) picked[rank] = ci;
        }
    }
    __syncthreads();
    // Gates: every lane of warp 0 sums the scores in pick order (the reference's order: the same total in
    // each), then writes its picks.
    if (warp == 0) {
        const int slots = top_k + (shared_expert >= 0 ? 1 : 0);
        float total = 0.0f;
        for (int r = 0; r < top_k; ++r) total += score[picked[r]];
        total += 1e-20f;
        for (int r = lane; r < top_k; r += 32) {
            float g = score[picked[r]];
            if (normalise) g /= total;
            ids[(size_t)t * slots + r] = (uint32_t)picked[r];
            gates[(size_t)t * slots + r] = g * scaling;
        }
        if (shared_expert >= 0 && lane == 0) {
            ids[(size_t)t * slots + top_k] = (uint32_t)shared_expert;
            gates[(size_t)t * slots + top_k] = 1.0f;
        }
    }
}

// offsets [n_experts + 1], sorted [n_assign], active [n_experts], active_count [1]. Dynamic shared memory:
// n_experts ints. Ids outside 0..n_experts are counted nowhere (the launcher's ids come from moe_route).
extern "C" __global__ void moe_align(const uint32_t* __restrict__ ids, int n_assign, int n_experts,
                                     int* __restrict__ offsets, int* __restrict__ sorted,
                                     int* __restrict__ active, int* __restrict__ active_count) {
    extern __shared__ int count[];
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n_assign; a += blockDim.x) {
        const uint32_t e = ids[a];
        if (e < (uint32_t)n_experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    // Offsets and the active list by warp 0: each lane a run of consecutive experts, the runs' totals and
    // active counts scanned across the warp (one thread walking every expert took most of the launch).
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x, per_lane = (n_experts + 31) / 32;
        const int first = lane * per_lane, last = min(first + per_lane, n_experts);
        int rows = 0, busy = 0;
        for (int e = first; e < last; ++e) {
            rows += count[e];
            busy += count[e] > 0;
        }
        int rows_through = rows, busy_through = busy;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int r = __shfl_up_sync(0xffffffffu, rows_through, offset);
            const int b = __shfl_up_sync(0xffffffffu, busy_through, offset);
            if (lane >= offset) {
                rows_through += r;
                busy_through += b;
            }
        }
        int running = rows_through - rows, n_active = busy_through - busy;
        for (int e = first; e < last; ++e) {
            offsets[e] = running;
            if (count[e] > 0) active[n_active++] = e;
            const int start = running;
            running += count[e];
            count[e] = start;  // now the expert's next free position
        }
        if (lane == 31) {
            offsets[n_experts] = rows_through;
            *active_count = busy_through;
        }
    }
    __syncthreads();
    // Each expert's assignments in ascending order: one thread per expert walks the list.
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
        int next = count[e];
        if (next == offsets[e + 1]) continue;
        for (int a = 0; a < n_assign; ++a)
            if (ids[a] == (uint32_t)e) sorted[next++] = a;
    }
}

// h[a, n] = round(round(silu(round(gate_e[n] · x[a / slots]))) · round(up_e[n] · x[a / slots])) for the
// assignments a of expert e. weights: [n_experts, 2·inter, hidden] (gate rows then up rows).
template <int TOKENS, typename T>
__device__ void gate_up(const T* __restrict__ x, const T* __restrict__ weights,
                        const int* __restrict__ sorted, const int* __restrict__ offsets,
                        const int* __restrict__ active, const int* __restrict__ active_count, int slots,
                        int hidden, int inter, T* __restrict__ h) {
    if ((int)blockIdx.x >= *active_count) return;
    const int expert = active[blockIdx.x];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.y * MOE_WARPS + warp;
    if (n >= inter) return;
    constexpr int V = Vec<T>::N;
    const T* gate_row = weights + ((size_t)expert * 2 * inter + n) * hidden;
    const T* up_row = gate_row + (size_t)inter * hidden;
    const int begin = offsets[expert], end = offsets[expert + 1];
    for (int m0 = begin; m0 < end; m0 += TOKENS) {
        const int m = min(TOKENS, end - m0);
        const T* rows[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j)
            rows[j] = x + (size_t)(sorted[m0 + min(j, m - 1)] / slots) * hidden;
        float acc_gate[TOKENS], acc_up[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) acc_gate[j] = acc_up[j] = 0.0f;
#pragma unroll 2
        for (int k = lane * V; k < hidden; k += 32 * V) {
            float g[V], u[V];
            Vec<T>::load(gate_row + k, g);
            Vec<T>::load(up_row + k, u);
#pragma unroll
            for (int j = 0; j < TOKENS; ++j) {
                if (j < m) {
                    float xv[V];
                    Vec<T>::load(rows[j] + k, xv);
#pragma unroll
                    for (int i = 0; i < V; ++i) {
                        acc_gate[j] = fmaf(g[i], xv[i], acc_gate[j]);
                        acc_up[j] = fmaf(u[i], xv[i], acc_up[j]);
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) {
            if (j < m) {
                const float gate = round_to(warp_sum(acc_gate[j]), x);
                const float up = round_to(warp_sum(acc_up[j]), x);
                const float act = round_to(gate / (1.0f + expf(-gate)), x);
                if (lane == 0) store(h + (size_t)sorted[m0 + j] * inter + n, act * up);
            }
        }
    }
}

// y[a, r] = gate[a] · (down_e[r] · h[a]) in f32 for the assignments a of expert e. down: [n_experts,
// hidden, inter].
template <int TOKENS, typename T>
__device__ void down(const T* __restrict__ h, const T* __restrict__ weights, const float* __restrict__ gates,
                     const int* __restrict__ sorted, const int* __restrict__ offsets,
                     const int* __restrict__ active, const int* __restrict__ active_count, int hidden,
                     int inter, float* __restrict__ y) {
    if ((int)blockIdx.x >= *active_count) return;
    const int expert = active[blockIdx.x];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.y * MOE_WARPS + warp;
    if (r >= hidden) return;
    constexpr int V = Vec<T>::N;
    const T* row = weights + ((size_t)expert * hidden + r) * inter;
    const int begin = offsets[expert], end = offsets[expert + 1];
    for (int m0 = begin; m0 < end; m0 += TOKENS) {
        const int m = min(TOKENS, end - m0);
        const T* rows[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j)
            rows[j] = h + (size_t)sorted[m0 + min(j, m - 1)] * inter;
        float acc[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) acc[j] = 0.0f;
#pragma unroll 2
        for (int k = lane * V; k < inter; k += 32 * V) {
            float w[V];
            Vec<T>::load(row + k, w);
#pragma unroll
            for (int j = 0; j < TOKENS; ++j) {
                if (j < m) {
                    float hv[V];
                    Vec<T>::load(rows[j] + k, hv);
#pragma unroll
                    for (int i = 0; i < V; ++i) acc[j] = fmaf(w[i], hv[i], acc[j]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) {
            if (j < m) {
                const float sum = warp_sum(acc[j]);
                const int a = sorted[m0 + j];
                if (lane == 0) y[(size_t)a * hidden + r] = gates[a] * sum;
            }
        }
    }
}

// out[t, r] = round(Σ_slot y[t·slots + slot, r]), slots in order.
template <typename T>
__device__ void combine(const float* __restrict__ y, int n_tokens, int slots, int hidden, T* __restrict__ out) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tokens * hidden) return;
    const size_t t = i / hidden, r = i % hidden;
    float sum = 0.0f;
    for (int s = 0; s < slots; ++s) sum += y[(t * slots + s) * hidden + r];
    store(out + i, sum);
}

#define MOE_INSTANCES(SUFFIX, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_##SUFFIX(                       \
        const T* x, const T* w, const int* sorted, const int* offsets, const int* active,                    \
        const int* active_count, int slots, int hidden, int inter, T* h) {                                   \
        gate_up<MOE_TOKENS_PER_PASS, T>(x, w, sorted, offsets, active, active_count, slots, hidden, inter, h); \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_t1_##SUFFIX(                    \
        const T* x, const T* w, const int* sorted, const int* offsets, const int* active,                    \
        const int* active_count, int slots, int hidden, int inter, T* h) {                                   \
        gate_up<1, T>(x, w, sorted, offsets, active, active_count, slots, hidden, inter, h);                 \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_##SUFFIX(                          \
        const T* h, const T* w, const float* gates, const int* sorted, const int* offsets, const int* active, \
        const int* active_count, int hidden, int inter, float* y) {                                          \
        down<MOE_TOKENS_PER_PASS, T>(h, w, gates, sorted, offsets, active, active_count, hidden, inter, y);  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_t1_##SUFFIX(                       \
        const T* h, const T* w, const float* gates, const int* sorted, const int* offsets, const int* active, \
        const int* active_count, int hidden, int inter, float* y) {                                          \
        down<1, T>(h, w, gates, sorted, offsets, active, active_count, hidden, inter, y);                    \
    }                                                                                                         \
    extern "C" __global__ void moe_combine_##SUFFIX(const float* y, int n_tokens, int slots, int hidden,     \
                                                    T* out) {                                                \
        combine<T>(y, n_tokens, slots, hidden, out);                                                         \
    }

MOE_INSTANCES(bf16, __nv_bfloat16)
MOE_INSTANCES(f32, float)

// ---- Experts kept quantised -------------------------------------------------------------------------------

namespace {

// One row of a stacked quantised projection, read in chunks of 16 weights sharing one scale: `load` issues
// the chunk's loads, `decode` turns them into floats and the chunk's scale; `row_scale` multiplies the
// row's finished sum. Row `row` of expert `expert` lies in part row / (rows / parts).
struct Fp8Row {
    struct Chunk {
        uint4 bytes;
        float scale;
    };
    static constexpr int UNROLL = 2;
    const uint4* bytes;
    const float* scales;
    int block_k;
    float row_scale;

    __device__ Fp8Row(const uint8_t* w, const float* scale_inv, int block_n, int block_k_, int expert, int rows,
                      int parts, int row, int k) {
        const int part_rows = rows / parts, part = row / part_rows, r = row % part_rows;
        const int scale_rows = (part_rows + block_n - 1) / block_n, scale_cols = (k + block_k_ - 1) / block_k_;
        bytes = reinterpret_cast<const uint4*>(w + ((size_t)expert * rows + row) * k);
        scales = scale_inv + (((size_t)expert * parts + part) * scale_rows + r / block_n) * scale_cols;
        block_k = block_k_;
        row_scale = 1.0f;
    }
    __device__ __forceinline__ Chunk load(int c) const { return {__ldg(bytes + c), __ldg(scales + c * 16 / block_k)}; }
    __device__ __forceinline__ float decode(const Chunk& chunk, float (&w)[16]) const {
        glm5::fp8x16_to_float(chunk.bytes, w);
        return chunk.scale;
    }
};

struct Nvfp4Row {
    struct Chunk {
        uint2 bytes;
        uint8_t scale;
    };
    static constexpr int UNROLL = 4;
    const uint2* bytes;
    const uint8_t* scales;
    /// `e2m1_pair_bits` of every byte, in the block's shared memory (`fill_e2m1_pair_table`).
    const uint32_t* pairs;
    float row_scale;

    __device__ Nvfp4Row(const uint8_t* packed, const uint8_t* scale_bytes, const float* global,
                        const uint32_t* pair_table, int expert, int rows, int parts, int row, int k) {
        const int part = row / (rows / parts);
        bytes = reinterpret_cast<const uint2*>(packed + ((size_t)expert * rows + row) * (k / 2));
        scales = scale_bytes + ((size_t)expert * rows + row) * (k / 16);
        pairs = pair_table;
        row_scale = global[(size_t)expert * parts + part];
    }
    __device__ __forceinline__ Chunk load(int c) const { return {__ldg(bytes + c), __ldg(scales + c)}; }
    // As the reference, (e2m1 · scale) · global: the decoded values carry 2^-14, their scale 2^14.
    __device__ __forceinline__ float decode(const Chunk& chunk, float (&w)[16]) const {
        glm5::e2m1x16_to_float(chunk.bytes, pairs, w);
        return glm5::e4m3_to_float(chunk.scale) * glm5::E2M1_HALF_BIAS;
    }
};

// A row of a stacked GGUF block-format projection [E, rows, row bytes], in its 16-value chunks (`Chunks` in
// gguf_formats.cuh: the chunk's scale is inside the block).
template <glm5::gguf::Format F>
struct GgufRow {
    using Chunk = typename glm5::gguf::Chunks<F>::Chunk;
    static constexpr int UNROLL = glm5::gguf::Chunks<F>::UNROLL;
    const uint8_t* row;
    float row_scale;

    __device__ GgufRow(const uint8_t* blocks, int expert, int rows, int r, int k) {
        row = blocks + ((size_t)expert * rows + r) * glm5::gguf::row_bytes<F>(k);
        row_scale = 1.0f;
    }
    __device__ __forceinline__ Chunk load(int c) const { return glm5::gguf::Chunks<F>::load(row, c); }
    __device__ __forceinline__ float decode(const Chunk& chunk, float (&w)[16]) const {
        return glm5::gguf::Chunks<F>::decode(chunk, w);
    }
};

// gate_up over quantised weights: h as in `gate_up` (k = hidden).
template <int TOKENS, typename T, typename Row>
__device__ void gate_up_quantized(const T* __restrict__ x, const Row& gate_row, const Row& up_row, int expert,
                                  const int* __restrict__ sorted, const int* __restrict__ offsets, int slots,
                                  int hidden, int inter, int n, T* __restrict__ h) {
    const int lane = threadIdx.x & 31;
    constexpr int U = Row::UNROLL;
    const int chunks = hidden / 16;
    const int begin = offsets[expert], end = offsets[expert + 1];
    for (int m0 = begin; m0 < end; m0 += TOKENS) {
        const int m = min(TOKENS, end - m0);
        const T* rows[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j)
            rows[j] = x + (size_t)(sorted[m0 + min(j, m - 1)] / slots) * hidden;
        float acc_gate[TOKENS], acc_up[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) acc_gate[j] = acc_up[j] = 0.0f;
        for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
            typename Row::Chunk g[U], u[U];
#pragma unroll
            for (int i = 0; i < U; ++i) {
                if (c0 + 32 * i < chunks) {
                    g[i] = gate_row.load(c0 + 32 * i);
                    u[i] = up_row.load(c0 + 32 * i);
                }
            }
#pragma unroll
            for (int i = 0; i < U; ++i) {
                const int c = c0 + 32 * i;
                if (c < chunks) {
                    float wg[16], wu[16];
                    const float sg = gate_row.decode(g[i], wg), su = up_row.decode(u[i], wu);
#pragma unroll
                    for (int j = 0; j < TOKENS; ++j) {
                        if (j < m) {
                            float xv[16];
                            glm5::load16(rows[j] + c * 16, xv);
                            acc_gate[j] = fmaf(glm5::dot16(wg, xv), sg, acc_gate[j]);
                            acc_up[j] = fmaf(glm5::dot16(wu, xv), su, acc_up[j]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) {
            if (j < m) {
                const float gate = round_to(warp_sum(acc_gate[j]) * gate_row.row_scale, x);
                const float up = round_to(warp_sum(acc_up[j]) * up_row.row_scale, x);
                const float act = round_to(gate / (1.0f + expf(-gate)), x);
                if (lane == 0) store(h + (size_t)sorted[m0 + j] * inter + n, act * up);
            }
        }
    }
}

// down over quantised weights: y as in `down` (k = inter).
template <int TOKENS, typename T, typename Row>
__device__ void down_quantized(const T* __restrict__ h, const Row& row, int expert, const float* __restrict__ gates,
                               const int* __restrict__ sorted, const int* __restrict__ offsets, int hidden,
                               int inter, int r, float* __restrict__ y) {
    const int lane = threadIdx.x & 31;
    constexpr int U = Row::UNROLL;
    const int chunks = inter / 16;
    const int begin = offsets[expert], end = offsets[expert + 1];
    for (int m0 = begin; m0 < end; m0 += TOKENS) {
        const int m = min(TOKENS, end - m0);
        const T* rows[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j)
            rows[j] = h + (size_t)sorted[m0 + min(j, m - 1)] * inter;
        float acc[TOKENS];
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) acc[j] = 0.0f;
        for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
            typename Row::Chunk w[U];
#pragma unroll
            for (int i = 0; i < U; ++i)
                if (c0 + 32 * i < chunks) w[i] = row.load(c0 + 32 * i);
#pragma unroll
            for (int i = 0; i < U; ++i) {
                const int c = c0 + 32 * i;
                if (c < chunks) {
                    float wv[16];
                    const float s = row.decode(w[i], wv);
#pragma unroll
                    for (int j = 0; j < TOKENS; ++j) {
                        if (j < m) {
                            float hv[16];
                            glm5::load16(rows[j] + c * 16, hv);
                            acc[j] = fmaf(glm5::dot16(wv, hv), s, acc[j]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < TOKENS; ++j) {
            if (j < m) {
                const float sum = warp_sum(acc[j]) * row.row_scale;
                const int a = sorted[m0 + j];
                if (lane == 0) y[(size_t)a * hidden + r] = gates[a] * sum;
            }
        }
    }
}

}  // namespace

// The grid as the dense kernels': (active expert, 8 output rows per block); idle blocks return at once.
#define MOE_QUANTIZED_PROLOGUE(OUT_ROWS)                                                                      \
    if ((int)blockIdx.x >= *active_count) return;                                                           \
    const int expert = active[blockIdx.x];                                                                  \
    const int out_row = blockIdx.y * MOE_WARPS + (threadIdx.x >> 5);                                        \
    if (out_row >= (OUT_ROWS)) return;

#define MOE_QUANTIZED_KERNELS(TAG, TOKENS, SUFFIX, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_##TAG##fp8_##SUFFIX(                   \
        const T* x, const uint8_t* w, const float* scale_inv, int block_n, int block_k, const int* sorted,   \
        const int* offsets, const int* active, const int* active_count, int slots, int hidden, int inter,    \
        T* h) {                                                                                              \
        MOE_QUANTIZED_PROLOGUE(inter)                                                                        \
        const Fp8Row gate_row(w, scale_inv, block_n, block_k, expert, 2 * inter, 2, out_row, hidden);        \
        const Fp8Row up_row(w, scale_inv, block_n, block_k, expert, 2 * inter, 2, inter + out_row, hidden);  \
        gate_up_quantized<TOKENS, T>(x, gate_row, up_row, expert, sorted, offsets, slots, hidden, inter, out_row, h); \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_##TAG##fp8_##SUFFIX(                      \
        const T* h, const uint8_t* w, const float* scale_inv, int block_n, int block_k, const float* gates,  \
        const int* sorted, const int* offsets, const int* active, const int* active_count, int hidden,       \
        int inter, float* y) {                                                                               \
        MOE_QUANTIZED_PROLOGUE(hidden)                                                                       \
        const Fp8Row row(w, scale_inv, block_n, block_k, expert, hidden, 1, out_row, inter);                 \
        down_quantized<TOKENS, T>(h, row, expert, gates, sorted, offsets, hidden, inter, out_row, y);                \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_##TAG##nvfp4_##SUFFIX(                 \
        const T* x, const uint8_t* packed, const uint8_t* scales, const float* global, const int* sorted,    \
        const int* offsets, const int* active, const int* active_count, int slots, int hidden, int inter,    \
        T* h) {                                                                                              \
        __shared__ uint32_t pairs[256];                                                                      \
        glm5::fill_e2m1_pair_table(pairs);                                                                   \
        __syncthreads();                                                                                     \
        MOE_QUANTIZED_PROLOGUE(inter)                                                                        \
        const Nvfp4Row gate_row(packed, scales, global, pairs, expert, 2 * inter, 2, out_row, hidden);       \
        const Nvfp4Row up_row(packed, scales, global, pairs, expert, 2 * inter, 2, inter + out_row, hidden); \
        gate_up_quantized<TOKENS, T>(x, gate_row, up_row, expert, sorted, offsets, slots, hidden, inter, out_row, h); \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_##TAG##nvfp4_##SUFFIX(                    \
        const T* h, const uint8_t* packed, const uint8_t* scales, const float* global, const float* gates,   \
        const int* sorted, const int* offsets, const int* active, const int* active_count, int hidden,       \
        int inter, float* y) {                                                                               \
        __shared__ uint32_t pairs[256];                                                                      \
        glm5::fill_e2m1_pair_table(pairs);                                                                   \
        __syncthreads();                                                                                     \
        MOE_QUANTIZED_PROLOGUE(hidden)                                                                       \
        const Nvfp4Row row(packed, scales, global, pairs, expert, hidden, 1, out_row, inter);                \
        down_quantized<TOKENS, T>(h, row, expert, gates, sorted, offsets, hidden, inter, out_row, y);                \
    }

// Each kernel twice: for any number of tokens per expert, and `t1_` for one token (batch-1 decode), without the
// other token slots' tests.
#define MOE_QUANTIZED_INSTANCES(SUFFIX, T)                          \
    MOE_QUANTIZED_KERNELS(, MOE_TOKENS_PER_PASS, SUFFIX, T)         \
    MOE_QUANTIZED_KERNELS(t1_, 1, SUFFIX, T)

MOE_QUANTIZED_INSTANCES(bf16, __nv_bfloat16)
MOE_QUANTIZED_INSTANCES(f32, float)

#define MOE_GGUF_INSTANCES(TAG, TOKENS, NAME, F, SUFFIX, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_##TAG##NAME##_##SUFFIX(              \
        const T* x, const uint8_t* gate, const uint8_t* up, const int* sorted, const int* offsets,           \
        const int* active, const int* active_count, int slots, int hidden, int inter, T* h) {                \
        MOE_QUANTIZED_PROLOGUE(inter)                                                                        \
        const GgufRow<glm5::gguf::F> gate_row(gate, expert, inter, out_row, hidden);                             \
        const GgufRow<glm5::gguf::F> up_row(up, expert, inter, out_row, hidden);                                 \
        gate_up_quantized<TOKENS, T>(x, gate_row, up_row, expert, sorted, offsets, slots, hidden, inter, out_row, h); \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_##TAG##NAME##_##SUFFIX(                 \
        const T* h, const uint8_t* down, const float* gates, const int* sorted, const int* offsets,          \
        const int* active, const int* active_count, int hidden, int inter, float* y) {                       \
        MOE_QUANTIZED_PROLOGUE(hidden)                                                                       \
        const GgufRow<glm5::gguf::F> row(down, expert, hidden, out_row, inter);                                  \
        down_quantized<TOKENS, T>(h, row, expert, gates, sorted, offsets, hidden, inter, out_row, y);                \
    }

#define MOE_GGUF_FORMAT(NAME, F)                                              \
    MOE_GGUF_INSTANCES(, MOE_TOKENS_PER_PASS, NAME, F, bf16, __nv_bfloat16)   \
    MOE_GGUF_INSTANCES(, MOE_TOKENS_PER_PASS, NAME, F, f32, float)            \
    MOE_GGUF_INSTANCES(t1_, 1, NAME, F, bf16, __nv_bfloat16)                  \
    MOE_GGUF_INSTANCES(t1_, 1, NAME, F, f32, float)

MOE_GGUF_FORMAT(iq2_xxs, IQ2_XXS)
MOE_GGUF_FORMAT(iq2_xs, IQ2_XS)
MOE_GGUF_FORMAT(iq2_s, IQ2_S)
MOE_GGUF_FORMAT(iq3_xxs, IQ3_XXS)
MOE_GGUF_FORMAT(iq3_s, IQ3_S)
MOE_GGUF_FORMAT(iq1_s, IQ1_S)
MOE_GGUF_FORMAT(iq1_m, IQ1_M)
MOE_GGUF_FORMAT(iq4_nl, IQ4_NL)
MOE_GGUF_FORMAT(iq4_xs, IQ4_XS)
MOE_GGUF_FORMAT(q4_k, Q4_K)
MOE_GGUF_FORMAT(q6_k, Q6_K)
MOE_GGUF_FORMAT(q2_k, Q2_K)
MOE_GGUF_FORMAT(q3_k, Q3_K)
MOE_GGUF_FORMAT(q5_k, Q5_K)

// ---- Q4_K experts on the tensor cores (bf16) ---------------------------------------------------------------
//
// An expert with one token (every chosen expert at batch-1 decode, most at a few sequences) takes the one-row
// kernels' path (q4k_mma::row, int8 MMAs): its activation row quantised as q8_1 into the launch's dynamic shared
// memory (`row::staged_bytes` of the row: the launcher always gives it), the warps splitting the row's blocks;
// gate/up's warps split between the two matrices (even warps gate, odd up; one warp does both in turn).
// Several tokens take `accumulate`, 8 at a time. A block walks the expert's 16-row tiles `blockIdx.y`,
// `+ gridDim.y`, ...: at one token the launcher gives each expert its share of the blocks the device holds at
// once (`tile_loop_blocks`), so the row is staged once a block and each warp issues its next tile's first
// loads before the warps meet, as the one-row mat-vec (gguf_matmul.cu) does (H100, the Q4_K slice's three
// gate/up launches 190 -> 174 us a step); with more tokens, a block a tile.

constexpr int Q4K_ROW_DEPTH = 2;

extern "C" __global__ void __launch_bounds__(glm5::q4k_mma::MAX_WARPS * 32) moe_gate_up_q4_k_mma_bf16(
    const __nv_bfloat16* x, const uint8_t* gate, const uint8_t* up, const int* sorted, const int* offsets,
    const int* active, const int* active_count, int slots, int hidden, int inter, __nv_bfloat16* h) {
    namespace q = glm5::q4k_mma;
    if ((int)blockIdx.x >= *active_count) return;
    const int expert = active[blockIdx.x];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32, g = lane / 4, t = lane % 4;
    const int tiles = (inter + 15) / 16, blocks = hidden / 256;
    const size_t expert_bytes = (size_t)inter * blocks * q::BLOCK_BYTES;
    const uint8_t* const gate_w = gate + expert * expert_bytes;
    const uint8_t* const up_w = up + expert * expert_bytes;
    const int begin = offsets[expert], end = offsets[expert + 1];
    // (Every loop below runs over the block's own tiles, so every thread leaves it together: the barriers.)
    if (end - begin == 1) {
        extern __shared__ __align__(16) uint8_t staged[];
        // Warp w streams matrix w % 2 (gate, up) over its blocks w / 2, w / 2 + warps / 2, ...; a lone warp
        // both, gate then up, before the next tile.
        const bool split = warps >= 2;
        const int pairs = split ? warps / 2 + (warp % 2 == 0 ? warps % 2 : 0) : 1;
        const int first = split ? warp / 2 : 0;
        const uint8_t* rows[2];
        q::tile_rows(split && warp % 2 ? up_w : gate_w, blockIdx.y * 16, inter, hidden, g, rows);
        q::row::Stream<Q4K_ROW_DEPTH> stream;
        stream.start(rows, first, pairs, blocks, t);
        q::row::stage(x + (size_t)(sorted[begin] / slots) * hidden, staged, hidden);
        for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
            float acc[2] = {0.0f, 0.0f};  // gate, up
            for (int p = 0; p < (split ? 1 : 2); ++p) {
                const int matrix = split ? warp % 2 : p;
                stream.run(staged, hidden, first, pairs, g, t, acc[matrix]);
                // The next rows this warp streams: the lone warp's up rows of this tile after its gate rows,
                // its gate rows of the block's next tile after its up rows; a split warp's matrix, next tile.
                const bool then_up = !split && p == 0;
                const int next = then_up ? tile : tile + gridDim.y;
                const bool next_up = split ? matrix == 1 : then_up;
                if (next < tiles) {
                    q::tile_rows(next_up ? up_w : gate_w, next * 16, inter, hidden, g, rows);
                    stream.start(rows, first, pairs, blocks, t);
                }
            }
            const int stride = split ? 2 : 1;
            const float gate_v = round_to(q::row::sum_over_warps(acc[0], 0, stride), x);
            const float up_v = round_to(q::row::sum_over_warps(acc[1], split ? 1 : 0, stride), x);
            const int row = tile * 16 + g + 8 * (t / 2);
            if (warp == 0 && t % 2 == 0 && row < inter) {
                // As gate_up_quantized: each projection rounded, silu(gate) rounded, the product stored.
                const float act = round_to(gate_v / (1.0f + expf(-gate_v)), x);
                store(h + (size_t)sorted[begin] * inter + row, act * up_v);
            }
        }
        return;
    }
    for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
        const uint8_t *gate_rows[2], *up_rows[2];
        q::tile_rows(gate_w, tile * 16, inter, hidden, g, gate_rows);
        q::tile_rows(up_w, tile * 16, inter, hidden, g, up_rows);
        for (int m0 = begin; m0 < end; m0 += 8) {
            const int m = min(8, end - m0);
            const __nv_bfloat16* x_row = g < m ? x + (size_t)(sorted[m0 + g] / slots) * hidden : nullptr;
            float acc[2][4] = {};  // gate, up
            for (int b = warp; b < blocks; b += warps) {
                const q::Block gate_block = q::load(gate_rows, b, t), up_block = q::load(up_rows, b, t);
                q::accumulate(gate_block, x_row, b, t, acc[0]);
                q::accumulate(up_block, x_row, b, t, acc[1]);
            }
            q::sum_over_warps(acc);
            if (warp == 0) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = tile * 16 + g + 8 * (i / 2), j = 2 * t + i % 2;
                    if (row < inter && j < m) {
                        // As gate_up_quantized: each projection rounded, silu(gate) rounded, the product stored.
                        const float gate_v = round_to(acc[0][i], x), up_v = round_to(acc[1][i], x);
                        const float act = round_to(gate_v / (1.0f + expf(-gate_v)), x);
                        store(h + (size_t)sorted[m0 + j] * inter + row, act * up_v);
                    }
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(glm5::q4k_mma::MAX_WARPS * 32) moe_down_q4_k_mma_bf16(
    const __nv_bfloat16* h, const uint8_t* down, const float* gates, const int* sorted, const int* offsets,
    const int* active, const int* active_count, int hidden, int inter, float* y) {
    namespace q = glm5::q4k_mma;
    if ((int)blockIdx.x >= *active_count) return;
    const int expert = active[blockIdx.x];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32, g = lane / 4, t = lane % 4;
    const int tiles = (hidden + 15) / 16, blocks = inter / 256;
    const uint8_t* const down_w = down + expert * (size_t)hidden * blocks * q::BLOCK_BYTES;
    const int begin = offsets[expert], end = offsets[expert + 1];
    const uint8_t* rows[2];
    if (end - begin == 1) {
        extern __shared__ __align__(16) uint8_t staged[];
        q::tile_rows(down_w, blockIdx.y * 16, hidden, inter, g, rows);
        q::row::Stream<Q4K_ROW_DEPTH> stream;
        stream.start(rows, warp, warps, blocks, t);
        const int a = sorted[begin];
        q::row::stage(h + (size_t)a * inter, staged, inter);
        for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
            float acc = 0.0f;
            stream.run(staged, inter, warp, warps, g, t, acc);
            if (tile + gridDim.y < tiles) {
                q::tile_rows(down_w, (tile + gridDim.y) * 16, hidden, inter, g, rows);
                stream.start(rows, warp, warps, blocks, t);
            }
            const float sum = q::row::sum_over_warps(acc, 0, 1);
            const int row = tile * 16 + g + 8 * (t / 2);
            if (warp == 0 && t % 2 == 0 && row < hidden) y[(size_t)a * hidden + row] = gates[a] * sum;
        }
        return;
    }
    for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
        q::tile_rows(down_w, tile * 16, hidden, inter, g, rows);
        for (int m0 = begin; m0 < end; m0 += 8) {
            const int m = min(8, end - m0);
            const __nv_bfloat16* const x_rows[1] = {g < m ? h + (size_t)sorted[m0 + g] * inter : nullptr};
            float acc[1][4] = {};
            q::accumulate_warp_blocks(rows, x_rows, warp, warps, blocks, t, acc);
            q::sum_over_warps(acc);
            if (warp == 0) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = tile * 16 + g + 8 * (i / 2), j = 2 * t + i % 2;
                    if (row < hidden && j < m) {
                        const int a = sorted[m0 + j];
                        y[(size_t)a * hidden + row] = gates[a] * acc[0][i];
                    }
                }
            }
        }
    }
}
