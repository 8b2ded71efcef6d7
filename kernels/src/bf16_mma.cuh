// The inline-PTX instructions of the Q4_K tensor-core mat-vec (q4k_mma.cuh): mma.sync m16n8k16 over bf16 with
// f32 accumulation, a bf16x2 subtraction, a three-input logic op, the programmatic dependent launch's
// grid-dependency controls and 16-byte asynchronous copies into shared memory. Kept apart so that the CPU emulator (kernels/emu) can put its own
// versions of these functions in their place (kernels/emu/include/bf16_mma.cuh) and run the rest as it is.
#pragma once

#include <stdint.h>

/// d += A · B for one m16n8k16 product (PTX fragment layouts: groupID g = lane / 4, t = lane % 4; A row-major,
/// a[0] = A[g][2t, 2t + 1], a[1] = A[g + 8][2t, 2t + 1], a[2] = A[g][2t + 8, 2t + 9], a[3] = A[g + 8][2t + 8, ..];
/// b[0] = B[2t, 2t + 1][g], b[1] = B[2t + 8, 2t + 9][g]; d[0..1] = D[g][2t, 2t + 1], d[2..3] = D[g + 8][..]).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// a − b for two bf16 in a register each (round to nearest).
__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/// (a & B) | C in one instruction (nvcc splits a mask and an or with two constants into two).
template <uint32_t B, uint32_t C> __device__ __forceinline__ uint32_t and_or(uint32_t a) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(a), "n"(B), "n"(C));
    return d;
}

/// A programmatic dependent launch's wait for the previous grid on the stream (its writes visible after it).
__device__ __forceinline__ void wait_for_prior_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

/// Lets the next grid on the stream, if launched as a programmatic dependent, be scheduled before this one ends.
__device__ __forceinline__ void allow_dependent_grids() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

/// Starts copying 16 bytes from global `from` to shared `to` (both 16-byte aligned) without holding registers:
/// a thread can have many in flight. They land by the thread's next `async_copies_wait`.
__device__ __forceinline__ void async_copy16(void* to, const void* from) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(to))),
                 "l"(from)
                 : "memory");
}

/// Waits for this thread's `async_copy16`s: their bytes are visible to it (to other threads after a barrier).
__device__ __forceinline__ void async_copies_wait() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

/// d += A · B for one m16n8k32 product of int8 (s32 sums; lane (g, t): a[0] = A[g][4t .. 4t + 3],
/// a[1] = A[g + 8][4t ..], a[2] = A[g][16 + 4t ..], a[3] = A[g + 8][16 + 4t ..], the lowest k in the low byte;
/// b[0] = B[4t .. 4t + 3][g], b[1] = B[16 + 4t ..][g]; d as mma_bf16_16816's).
__device__ __forceinline__ void mma_s8_16832(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
