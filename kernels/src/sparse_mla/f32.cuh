// The f32 FMA kernel.
// Part of sparse_mla.cu (included in order from there; not a translation unit of its own).
#pragma once

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
    for (int w = 0; w < WARPS; ++w) l_all += l_w[w] * split_weight(m_w[w], m_all);
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    const size_t th = (size_t)t * p.H + h;
    for (int d = threadIdx.x; d < DV; d += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < WARPS; ++w)
            if (m_w[w] != -INFINITY) acc += o_w[w * DV + d] * split_weight(m_w[w], m_all);
        static_cast<float*>(p.out)[th * DV + d] = acc * inv;
    }
    if (threadIdx.x == 0) p.lse[th] = merged_lse(m_all, l_all);
}
