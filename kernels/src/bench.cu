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
