// Warpgroup MMA (wgmma, sm_90a only): shared-memory matrix descriptors (128-byte-swizzled tiles, unswizzled
// core matrices) and the two shapes sparse_mla_sm90.cu uses (S: A in registers; P V: both operands in shared
// memory). A warpgroup is 4 consecutive warps; every wgmma is issued by all 128 threads. Accumulator fragments: warp w of the group holds rows 16w + lane/4 and 16w + lane/4 + 8, and
// for each 8-column block j the columns 8j + 2(lane%4) + {0, 1} (registers 4j..4j+3: row r cols 0, 1, then
// row r + 8); register A fragments follow mma.sync's m16n8k16 layout per warp.
#pragma once

#include <stdint.h>

// Descriptor of a 128-byte-swizzled matrix in shared memory (the swizzle pattern repeats every 1024 bytes
// from a 1024-byte boundary). `leading` / `stride` are the byte offsets between core-matrix groups: K-major,
// stride = between 8-row groups (leading unused); N-major, leading = between 64-column blocks and stride =
// between 8-row groups along K.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_address, uint32_t leading, uint32_t stride) {
    return (uint64_t)((smem_address & 0x3FFFF) >> 4) | (uint64_t)((leading & 0x3FFFF) >> 4) << 16 |
           (uint64_t)((stride & 0x3FFFF) >> 4) << 32 | (uint64_t)1 << 62;
}

// `desc` moved `bytes` further into shared memory: 32-bit arithmetic on the address field (a shared-memory
// address never carries out of it), so no 64-bit add sits between consecutive wgmma.
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)desc + (bytes >> 4));
}

// Descriptor of a matrix in shared memory without swizzle: 8-row x 16-byte core matrices, 128 contiguous
// bytes each; K-major, `leading` = between core matrices along K, `stride` = between 8-row groups.
__device__ __forceinline__ uint64_t wgmma_desc_interleave(uint32_t smem_address, uint32_t leading, uint32_t stride) {
    return (uint64_t)((smem_address & 0x3FFFF) >> 4) | (uint64_t)((leading & 0x3FFFF) >> 4) << 16 |
           (uint64_t)((stride & 0x3FFFF) >> 4) << 32;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma wait.
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Keeps a wgmma's register A operand alive (so in the same registers, unwritten) until a wait that covers it:
// without a use after the wait the compiler may hand those registers to other values while the wgmma reads them.
template <int N>
__device__ __forceinline__ void wgmma_hold(uint32_t (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// D(64x256, f32) += A(64x16, bf16, shared, K-major) * B(16x256, bf16, shared, N-major).
__device__ __forceinline__ void wgmma_m64n256k16_ss_tn(float (&d)[128], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "
        "%128, %129, p, 1, 1, 0, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(1));
}

// D(64x32, f32) (+)= A(64x16, registers) * B(16x32, shared, K-major), the operands bf16
// (`wgmma_m64n32k16_rs`, sparse_mla_sm90.cu) or f16 (`wgmma_m64n32k16_rs_f16`, dsa_indexer_sm90.cu: FP8 keys
// converted to f16 in registers, Q in f16). `*_first`: D = A * B, D's old values not an input (so the compiler
// need not keep or copy them: a copy into D's registers while an earlier wgmma group runs makes ptxas
// serialise the wgmma).
// (The macro's variable arguments: the accumulate flag's parameter, if any.)
#define WGMMA_M64N32K16_RS(NAME, TYPE, OUT, SCALE_D, ...)                                                      \
    __device__ __forceinline__ void NAME(float (&d)[16], const uint32_t (&a)[4], uint64_t b __VA_ARGS__) {     \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"                                             \
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                               \
                     " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n" \
                     : OUT(d[0]), OUT(d[1]), OUT(d[2]), OUT(d[3]), OUT(d[4]), OUT(d[5]), OUT(d[6]), OUT(d[7]),   \
                       OUT(d[8]), OUT(d[9]), OUT(d[10]), OUT(d[11]), OUT(d[12]), OUT(d[13]), OUT(d[14]),         \
                       OUT(d[15])                                                                              \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(SCALE_D));                      \
    }
WGMMA_M64N32K16_RS(wgmma_m64n32k16_rs, "bf16", "+f", accumulate, , int accumulate)
WGMMA_M64N32K16_RS(wgmma_m64n32k16_rs_f16, "f16", "+f", accumulate, , int accumulate)
WGMMA_M64N32K16_RS(wgmma_m64n32k16_rs_f16_first, "f16", "=f", 0)
#undef WGMMA_M64N32K16_RS

// D(64x136, f32) (+)= A(64x16, f16, registers) * B(16x136, f16, shared, K-major): the prefill score kernel's
// wgmma (dsa_indexer.cu, `scores_wgmma_group`: FP8 keys converted to f16 in registers against four queries'
// 32 heads and 2 columns of their weighted head sum). `*_first` as above.
#define WGMMA_M64N136K16_RS_F16(NAME, OUT, SCALE_D, ...)                                                       \
    __device__ __forceinline__ void NAME(float (&d)[68], const uint32_t (&a)[4], uint64_t b __VA_ARGS__) {     \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %73, 0;\n"                                            \
                     "wgmma.mma_async.sync.aligned.m64n136k16.f32.f16.f16 {"                                   \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67}, " \
                     "{%68,%69,%70,%71}, %72, p, 1, 1, 0;\n}\n"                                                \
                     : OUT(d[0]), OUT(d[1]), OUT(d[2]), OUT(d[3]), OUT(d[4]), OUT(d[5]), OUT(d[6]), OUT(d[7]), \
                       OUT(d[8]), OUT(d[9]), OUT(d[10]), OUT(d[11]), OUT(d[12]), OUT(d[13]), OUT(d[14]), OUT(d[15]), \
                       OUT(d[16]), OUT(d[17]), OUT(d[18]), OUT(d[19]), OUT(d[20]), OUT(d[21]), OUT(d[22]), OUT(d[23]), \
                       OUT(d[24]), OUT(d[25]), OUT(d[26]), OUT(d[27]), OUT(d[28]), OUT(d[29]), OUT(d[30]), OUT(d[31]), \
                       OUT(d[32]), OUT(d[33]), OUT(d[34]), OUT(d[35]), OUT(d[36]), OUT(d[37]), OUT(d[38]), OUT(d[39]), \
                       OUT(d[40]), OUT(d[41]), OUT(d[42]), OUT(d[43]), OUT(d[44]), OUT(d[45]), OUT(d[46]), OUT(d[47]), \
                       OUT(d[48]), OUT(d[49]), OUT(d[50]), OUT(d[51]), OUT(d[52]), OUT(d[53]), OUT(d[54]), OUT(d[55]), \
                       OUT(d[56]), OUT(d[57]), OUT(d[58]), OUT(d[59]), OUT(d[60]), OUT(d[61]), OUT(d[62]), OUT(d[63]), \
                       OUT(d[64]), OUT(d[65]), OUT(d[66]), OUT(d[67])                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(SCALE_D));                      \
    }
WGMMA_M64N136K16_RS_F16(wgmma_m64n136k16_rs_f16, "+f", accumulate, , int accumulate)
WGMMA_M64N136K16_RS_F16(wgmma_m64n136k16_rs_f16_first, "=f", 0)
#undef WGMMA_M64N136K16_RS_F16
