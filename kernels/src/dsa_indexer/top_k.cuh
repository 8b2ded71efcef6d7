// The top-k stage as a chain of three kernels: candidates, exact threshold, ordered emit.
// Part of dsa_indexer.cu (included in order from there; not a translation unit of its own).
#pragma once

// ---------------------------------------------------------------------------------------------------------
// Top-k

// Scores first .. first + N of a row, 0 past n (rows start 16-byte aligned: the stride and `first` are
// multiples of 4).
template <int N>
__device__ __forceinline__ void load_scores(const float* row, int first, int n, float (&v)[N]) {
    static_assert(N % 4 == 0, "whole float4 loads");
    if (first + N <= n) {
#pragma unroll
        for (int j = 0; j < N; j += 4) {
            const float4 f = *reinterpret_cast<const float4*>(row + first + j);
            v[j] = f.x; v[j + 1] = f.y; v[j + 2] = f.z; v[j + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = first + j < n ? row[first + j] : 0.f;
    }
}

// Per (segment, token): the threshold bin from the row's histogram, the segment's count of scores above it
// and their bits in its mask, and its scores in that bin appended to the row's candidates with their positions.
__device__ void topk_candidates_impl(const DsaParams& p) {
    const int t = blockIdx.y, segment = blockIdx.x;
    const int n = visible_keys(p, t), K = p.K;
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (n <= K || segment * SEG >= n) return;
    int* hist = p.hist + (size_t)t * HIST_STRIDE;
    uint2* candidates = candidates_of(p, t);
    __shared__ int warp_sums[32];
    __shared__ int bin_s, remaining_s;
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the score kernel's writes
    // The segment's scores, read together with the bins (one memory latency, not two in a row).
    const int first = segment * SEG + threadIdx.x * SEG_ELEMS;
    float v[SEG_ELEMS];
    load_scores(p.scores + (size_t)t * p.score_stride, first, n, v);

    // The bin of the K-th largest score: thread i sums the 8 bins from the top's 8i-th down, read as two 16-byte
    // loads (as eight 4-byte loads 32 bytes apart across the warp, each instruction took 32 sectors).
    static_assert(HIST_BINS == 8 * SEG_THREADS && HIST_STRIDE % 4 == 0, "eight bins a thread, rows 16-byte aligned");
    const int4 upper = reinterpret_cast<const int4*>(hist)[(HIST_BINS - 8 * threadIdx.x) / 4 - 1];
    const int4 lower = reinterpret_cast<const int4*>(hist)[(HIST_BINS - 8 * threadIdx.x) / 4 - 2];
    const int counts[8] = {upper.w, upper.z, upper.y, upper.x, lower.w, lower.z, lower.y, lower.x};
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += counts[j];
    int total;
    int above = block_exclusive_scan<SEG_THREADS>(sum, warp_sums, total);
    if (above < K && above + sum >= K) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (above + counts[j] >= K) {
                bin_s = HIST_BINS - 1 - 8 * threadIdx.x - j;
                remaining_s = K - above;
                break;
            }
            above += counts[j];
        }
    }
    __syncthreads();
    const uint32_t bin = bin_s;
    if (segment == 0 && threadIdx.x == 0) {
        hist[SLOT_VALUE] = (int)(bin << (32 - HIST_BITS));
        hist[SLOT_COUNT] = remaining_s;
    }

    int above_here = 0, mine = 0;
    bool candidate[SEG_ELEMS];
    uint32_t mask_word = 0;  // lane j < SEG_ELEMS: the warp's mask word j (see `mask_word_index`)
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j) {
        const bool valid = first + j < n;
        const uint32_t u = ordered(v[j]), b = u >> (32 - HIST_BITS);
        const bool above = valid && b > bin;
        above_here += above;
        const uint32_t word = __ballot_sync(0xffffffff, above);
        if (lane == j) mask_word = word;
        candidate[j] = valid && b == bin;
        mine += candidate[j];
        if (candidate[j]) atomicAdd(hist + FINE_OFFSET + ((u >> FINE_SHIFT) & (FINE_BINS - 1)), 1);
    }
    static_assert(SEG_ELEMS <= 32 && SEG_WORDS == SEG_THREADS / 32 * SEG_ELEMS, "a warp's mask words");
    if (lane < SEG_ELEMS)
        segment_masks_of(p, t)[mask_word_index(segment, threadIdx.x / 32, lane)] = mask_word;
    // One scan for both counts (each under 2^16 per segment) and one atomic per block for its candidates,
    // which go out in position order.
    int packed_total;
    const int packed = block_exclusive_scan<SEG_THREADS>((above_here << 16) | mine, warp_sums, packed_total);
    __shared__ int base_s;
    if (threadIdx.x == 0) {
        base_s = atomicAdd(&hist[SLOT_CANDIDATES], packed_total & 0xffff);
        segment_counts_of(p, t)[segment] = packed_total >> 16;
    }
    __syncthreads();
    int slot = base_s + (packed & 0xffff);
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j)
        if (candidate[j]) candidates[slot++] = make_uint2(first + j, ordered(v[j]));
}

// Refines (prefix, mask, remaining) over 8-bit digits at `shifts` until the remaining-th largest value is
// exact: `remaining` of the values matching `prefix` under `mask` are still to be taken. Values come from
// `value(i)` for i < count.
template <typename Value>
__device__ void select_digits(Value value, int count, int first_shift, uint32_t& prefix, uint32_t& mask,
                              int& remaining, int* hist, uint32_t* prefix_s, int* remaining_s) {
    for (int shift = first_shift; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < count; i += blockDim.x) {
            const uint32_t u = value(i);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // the digit holding the remaining-th largest: lane l scans digits 255-8l down
            const int lane = threadIdx.x;
            int counts[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) sum += counts[j] = hist[255 - 8 * lane - j];
            int above = warp_inclusive_sum(sum) - sum;  // values in higher lanes' digits
            const bool here = above < remaining && above + sum >= remaining;
            const bool nowhere = __ballot_sync(0xffffffff, here) == 0;  // (cannot happen) then digit 0
            if (here || (nowhere && lane == 31)) {
                int j = 0;
                for (; j < 7 && above + counts[j] < remaining; ++j) above += counts[j];
                *prefix_s = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
                *remaining_s = remaining - above;
            }
        }
        __syncthreads();
        prefix = *prefix_s;
        remaining = *remaining_s;
        mask |= 255u << shift;
    }
}

struct ThresholdShared {
    int digits[256];
    uint32_t prefix;
    int remaining, equal;
    int selected[MAX_SEGMENTS];
    int warp_sums[32];
    int fine, fine_need, fine_count, listed;  // the fine bin, how many to take from it, its count
    uint32_t kth, last_tied;
    // Aligned: the rank loop reads the list in 16-byte pieces, which must not take in kth or last_tied (a
    // read of a word another thread writes, unused, but a hazard to racecheck).
    alignas(16) uint32_t list_values[FINE_LIST];
    alignas(16) uint32_t list_positions[FINE_LIST];
};

// The K-th largest value (ordered) and the last position taken among the scores equal to it, by which the
// candidates taken join their segments' masks, and each segment's output offset, from the row's candidates
// (`value(i)`: candidate i's ordered score, `position(i)` its position), in sh.selected each segment's count of
// scores above the threshold bin, and the fine histogram's bins FINE_BINS - 1 - FINE_PER_THREAD * i - j in
// fine[j] of thread i.
template <typename Value, typename Position>
__device__ void threshold_over(const DsaParams& p, int t, int n, Value value, Position position_of, int count,
                               uint32_t prefix, int remaining, const int (&fine)[FINE_PER_THREAD],
                               ThresholdShared& sh) {
    int* digits = sh.digits;
    uint32_t& prefix_s = sh.prefix;
    int &remaining_s = sh.remaining, &equal_s = sh.equal;
    int* selected = sh.selected;
    int* warp_sums = sh.warp_sums;
    // The fine bin of the K-th largest (its bits 20..10) from the fine histogram, counted from the top.
    if (threadIdx.x == 0) {
        sh.listed = 0;
        sh.fine_count = FINE_LIST + 1;  // (no bin found: cannot happen) the radix select below
    }
    int fine_sum = 0;
#pragma unroll
    for (int j = 0; j < FINE_PER_THREAD; ++j) fine_sum += fine[j];
    int fine_total;
    int fine_above = block_exclusive_scan<TOPK_THREADS>(fine_sum, warp_sums, fine_total);
    if (fine_above < remaining && fine_above + fine_sum >= remaining) {
#pragma unroll
        for (int j = 0; j < FINE_PER_THREAD; ++j) {
            if (fine_above + fine[j] >= remaining) {
                sh.fine = FINE_BINS - 1 - FINE_PER_THREAD * threadIdx.x - j;
                sh.fine_need = remaining - fine_above;
                sh.fine_count = fine[j];
                break;
            }
            fine_above += fine[j];
        }
    }
    __syncthreads();
    uint2 kth_tied;  // the K-th value and the last tied position taken
    if (sh.fine_count <= FINE_LIST) {
        // Few candidates share the K-th's top 22 bits: rank them (higher value first, then lower position);
        // the one of rank fine_need - 1 is the last taken.
        const uint32_t top = (prefix >> FINE_SHIFT) | (uint32_t)sh.fine;
        for (int i = threadIdx.x; i < count; i += blockDim.x) {
            const uint32_t u = value(i);
            if (u >> FINE_SHIFT == top) {
                const int slot = atomicAdd(&sh.listed, 1);
                sh.list_values[slot] = u;
                sh.list_positions[slot] = position_of(i);
            }
        }
        __syncthreads();
        const int listed = sh.listed, need = sh.fine_need;
        if ((int)threadIdx.x < listed) {
            const uint32_t u = sh.list_values[threadIdx.x], position = sh.list_positions[threadIdx.x];
            int rank = 0;
            for (int j = 0; j < listed; ++j)
                rank += sh.list_values[j] > u || (sh.list_values[j] == u && sh.list_positions[j] < position);
            if (rank == need - 1) {
                sh.kth = u;
                sh.last_tied = position;
            }
        }
        __syncthreads();
        kth_tied = make_uint2(sh.kth, sh.last_tied);
    } else {
        // The remaining 21 bits, 8 at a time (the first digit overlaps 3 known bits, which all match).
        uint32_t mask = ~0u << (32 - HIST_BITS);
        select_digits(value, count, 16, prefix, mask, remaining, digits, &prefix_s, &remaining_s);
        const uint32_t kth = prefix;
        if (threadIdx.x == 0) equal_s = 0;
        __syncthreads();
        int equal = 0;
        for (int i = threadIdx.x; i < count; i += blockDim.x) equal += value(i) == kth;
        equal = __reduce_add_sync(0xffffffff, equal);  // one shared atomic per warp, not per thread
        if (threadIdx.x % 32 == 0) atomicAdd(&equal_s, equal);
        __syncthreads();
        // Among equal scores the lowest positions win: the remaining-th largest of ~position over them.
        uint32_t last_tied = 0xffffffffu;
        if (equal_s > remaining) {
            uint32_t position_prefix = 0, position_mask = 0;
            int take = remaining;
            select_digits([&](int i) { return value(i) == kth ? ~position_of(i) : 0u; }, count, 24, position_prefix,
                          position_mask, take, digits, &prefix_s, &remaining_s);
            last_tied = ~position_prefix;
        }
        kth_tied = make_uint2(kth, last_tied);
    }
    // Each segment's output count: its scores above the threshold bin (in `selected` already) plus its
    // candidates taken, which join those in its mask.
    const int segments = (n + SEG - 1) / SEG;
    uint32_t* masks = segment_masks_of(p, t);
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const uint32_t position = position_of(i);
        if (among_k(value(i), position, kth_tied)) {
            atomicAdd(&selected[position / SEG], 1);
            const uint2 bit = mask_bit(position);
            atomicOr(&masks[bit.x], bit.y);
        }
    }
    __syncthreads();
    const int s0 = SEGMENTS_PER_THREAD * threadIdx.x;  // this thread's consecutive segments
    int mine = 0;
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) mine += s0 + j < segments ? selected[s0 + j] : 0;
    int total;
    int offset = block_exclusive_scan<TOPK_THREADS>(mine, warp_sums, total);
    uint32_t* offsets = segment_offsets_of(p, t);
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) {
        if (s0 + j < segments) {
            offsets[s0 + j] = offset;
            offset += selected[s0 + j];
        }
    }
}

__device__ void topk_threshold_impl(const DsaParams& p) {
    const int t = blockIdx.x;
    const int n = visible_keys(p, t);
    int* hist = p.hist + (size_t)t * HIST_STRIDE;
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the candidates kernel's writes
    // Everything the select reads, issued together before the count is known (one memory latency, not
    // three in a row): the slots, each segment's count, and as many candidates as a row's list seldom exceeds,
    // n / SPECULATIVE_SHARE (the K-th score's bin holds ~4% of a row's positions), up to SPECULATIVE_CANDIDATES
    // (the workspace row holds `score_stride` >= n of them; those past the count go unused). A longer list loads
    // the rest, up to STAGED_CANDIDATES, once the count is known. (4096 whatever n: 64 MB a 32K prefill chunk,
    // the kernel DRAM-bound at 2.7 TB/s.)
    const uint2* candidates = candidates_of(p, t);
    const uint32_t* segment_counts = segment_counts_of(p, t);
    const int count = hist[SLOT_CANDIDATES];
    const uint32_t prefix = (uint32_t)hist[SLOT_VALUE];
    const int remaining = hist[SLOT_COUNT];
    const int segments = (n + SEG - 1) / SEG, loaded = n > p.K ? min(n / SPECULATIVE_SHARE, SPECULATIVE_CANDIDATES) : 0;
    constexpr int SPECULATIVE = SPECULATIVE_CANDIDATES / TOPK_THREADS, STAGED = STAGED_CANDIDATES / TOPK_THREADS;
    uint2 pairs[STAGED];
#pragma unroll
    for (int j = 0; j < SPECULATIVE; ++j) {
        const int i = threadIdx.x + j * TOPK_THREADS;
        if (i < loaded) pairs[j] = candidates[i];
    }
    uint32_t counts[SEGMENTS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) {
        const int s = threadIdx.x + j * TOPK_THREADS;
        counts[j] = n > p.K && s < segments ? segment_counts[s] : 0u;
    }
    // This thread's fine bins, FINE_BINS - 1 - FINE_PER_THREAD * i - j in fine[j].
    static_assert(FINE_PER_THREAD == 4, "one 16-byte load of fine bins per thread");
    int4* fine_bins = reinterpret_cast<int4*>(hist + FINE_OFFSET + FINE_BINS - FINE_PER_THREAD * (threadIdx.x + 1));
    const int4 fine_loaded = *fine_bins;
    const int fine[FINE_PER_THREAD] = {fine_loaded.w, fine_loaded.z, fine_loaded.y, fine_loaded.x};
    __syncthreads();  // every thread has read the slots before they are reset
    // The bins, the candidate count and the fine bins are zero again for the next call.
    for (int i = threadIdx.x; i <= SLOT_CANDIDATES; i += blockDim.x) hist[i] = 0;
    *fine_bins = make_int4(0, 0, 0, 0);
    if (n <= p.K) return;
    extern __shared__ uint32_t staged[];  // [STAGED_CANDIDATES] values, then as many positions (the launcher)
    uint32_t *values = staged, *positions = staged + STAGED_CANDIDATES;
    __shared__ ThresholdShared sh;
#pragma unroll
    for (int j = 0; j < SEGMENTS_PER_THREAD; ++j) sh.selected[threadIdx.x + j * TOPK_THREADS] = counts[j];
    if (count <= STAGED_CANDIDATES) {
        if (count > loaded) {  // (uniform over the block)
#pragma unroll
            for (int j = 0; j < STAGED; ++j) {
                const int i = threadIdx.x + j * TOPK_THREADS;
                if (i >= loaded && i < count) pairs[j] = candidates[i];
            }
        }
#pragma unroll
        for (int j = 0; j < STAGED; ++j) {  // pairs[j] was loaded for every i < count
            const int i = threadIdx.x + j * TOPK_THREADS;
            if (i < count) {
                positions[i] = pairs[j].x;
                values[i] = pairs[j].y;
            }
        }
        __syncthreads();
        threshold_over(p, t, n, [&](int i) { return values[i]; }, [&](int i) { return positions[i]; }, count, prefix,
                       remaining, fine, sh);
    } else {  // a crowded bin: its candidates stay in global memory (L2)
        threshold_over(p, t, n, [&](int i) { return candidates[i].y; }, [&](int i) { return candidates[i].x; }, count,
                       prefix, remaining, fine, sh);
    }
}

// Writes first + i for each set bit i of `bits`, in ascending order, to dst[0], dst[1], ...
__device__ __forceinline__ void store_positions(int* dst, uint64_t bits, int first) {
    for (; bits != 0; bits &= bits - 1) *dst++ = first + __ffsll((long long)bits) - 1;
}

// Per (segment, token), one warp a segment (EMIT_SEGMENTS to a block of SEG_THREADS): the segment's selected
// positions (its mask, complete once the threshold kernel has added the candidates taken), in ascending order,
// at the segment's offset; the scores are not read again. Rows with visible <= K get 0..visible-1 and -1
// padding. A warp, not a block, per segment, and a lane 64 consecutive positions: four loads, one warp prefix sum
// and the stores, no block barrier: a block a segment runs many waves of blocks, each a chain of latencies.
// Small grids of dense rows take `topk_emit_block_impl` instead (the launcher's `policy::emit::by_blocks`).
constexpr int EMIT_SEGMENTS = SEG_THREADS / 32;
__device__ void topk_emit_impl(const DsaParams& p) {
    const int t = blockIdx.y, segment = blockIdx.x * EMIT_SEGMENTS + threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = visible_keys(p, t), K = p.K;
    int* out = p.indices + (size_t)t * K;
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the threshold kernel's writes
    if (n <= K) {  // every visible position, then -1
        for (int s = segment * SEG + lane; s < min((segment + 1) * SEG, K); s += 32) out[s] = s < n ? s : -1;
        return;
    }
    if (segment * SEG >= n) return;
    // Lane l takes the positions of the candidates kernel's threads 8l .. 8l + 7: bits 8 (l % 4) .. 8 (l % 4) + 7
    // of the 8 mask words of that kernel's warp l / 4 (`mask_word_index`: word j, bit i holds the j-th position
    // of thread i). Byte j of `take` is byte l % 4 of word j (bit s: thread 8l + s's position j); its 8 x 8 bit
    // transpose (Hacker's Delight 7-3) puts position j of thread 8l + s at bit 8s + j, in position order.
    static_assert(SEG_ELEMS == 8 && SEG_THREADS / 32 * 4 == 32 && SEG == 64 * 32, "a lane: 8 threads' 8 positions");
    const uint2* words = reinterpret_cast<const uint2*>(segment_masks_of(p, t) + mask_word_index(segment, lane / 4, 0));
    const uint2 w01 = words[0], w23 = words[1], w45 = words[2], w67 = words[3];
    const uint32_t pick = lane % 4 | (lane % 4 + 4) << 4;  // __byte_perm: byte l % 4 of x, then of y
    const uint32_t low = __byte_perm(__byte_perm(w01.x, w01.y, pick), __byte_perm(w23.x, w23.y, pick), 0x5410);
    const uint32_t high = __byte_perm(__byte_perm(w45.x, w45.y, pick), __byte_perm(w67.x, w67.y, pick), 0x5410);
    uint64_t take = (uint64_t)high << 32 | low, swap;
    swap = (take ^ take >> 7) & 0x00AA00AA00AA00AAull;
    take ^= swap ^ swap << 7;
    swap = (take ^ take >> 14) & 0x0000CCCC0000CCCCull;
    take ^= swap ^ swap << 14;
    swap = (take ^ take >> 28) & 0x00000000F0F0F0F0ull;
    take ^= swap ^ swap << 28;
    // Sparse segments (at most DIRECT_STORES selected: contexts of 16K and more) store each lane's run as it is, the
    // shortest latency. Denser ones stage it in shared memory, half a warp's runs at a time (at most 1024
    // positions), and the warp copies them out 32 consecutive slots a store: each lane storing its own ~16 scattered
    // slots made an 8K prefill chunk's top-k 25% slower on the H200.
    constexpr int DIRECT_STORES = 256;
    static_assert(DIRECT_STORES == GLM5_DSA_INDEXER_DIRECT_STORES, "DIRECT_STORES differs from interface.rs");
    const int count = __popcll(take), end = warp_inclusive_sum(count), total = __shfl_sync(0xffffffff, end, 31);
    const int first = segment * SEG + lane * 64;
    int* segment_out = out + segment_offsets_of(p, t)[segment];
    if (total <= DIRECT_STORES) {
        store_positions(segment_out + end - count, take, first);
        return;
    }
    __shared__ int staged[EMIT_SEGMENTS][SEG / 2];
    int* stage = staged[threadIdx.x / 32];
    for (int half = 0; half < 2; ++half) {
        const int base = __shfl_sync(0xffffffff, end - count, 16 * half);  // slots before this half's runs
        const int stop = __shfl_sync(0xffffffff, end, 16 * half + 15);
        if (lane / 16 == half) store_positions(stage + end - count - base, take, first);
        __syncwarp();
        for (int i = base + lane; i < stop; i += 32) segment_out[i] = stage[i - base];
        __syncwarp();  // the copy has read the stage before the next half overwrites it
    }
}

// The same rows as `topk_emit_impl` from a block of SEG_THREADS a segment, a thread SEG_ELEMS consecutive positions
// and one block scan: eight times the warps a segment, for grids too small to fill the device whose segments are
// dense (decode at 2K-16K positions, where a warp a segment has each lane walk ~16 set bits serially).
__device__ void topk_emit_block_impl(const DsaParams& p) {
    const int t = blockIdx.y, segment = blockIdx.x;
    const int n = visible_keys(p, t), K = p.K;
    const int first = segment * SEG + threadIdx.x * SEG_ELEMS;
    int* out = p.indices + (size_t)t * K;
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the threshold kernel's writes
    if (n <= K) {  // every visible position, then -1
#pragma unroll
        for (int j = 0; j < SEG_ELEMS; ++j)
            if (first + j < K) out[first + j] = first + j < n ? first + j : -1;
        return;
    }
    if (segment * SEG >= n) return;
    __shared__ int warp_sums[32];
    const int offset = segment_offsets_of(p, t)[segment], lane = threadIdx.x % 32;
    const uint32_t* masks = segment_masks_of(p, t);
    // Lane j < SEG_ELEMS: the warp's mask word j.
    const uint32_t word = lane < SEG_ELEMS ? masks[mask_word_index(segment, threadIdx.x / 32, lane)] : 0u;
    uint32_t take = 0;  // bit j: this thread's j-th position
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j) take |= (__shfl_sync(0xffffffff, word, j) >> lane & 1u) << j;
    int total;
    int slot = offset + block_exclusive_scan<SEG_THREADS>(__popc(take), warp_sums, total);
#pragma unroll
    for (int j = 0; j < SEG_ELEMS; ++j)
        if (take >> j & 1u) out[slot++] = first + j;
}

static_assert(EMIT_SEGMENTS == GLM5_DSA_INDEXER_EMIT_SEGMENTS, "EMIT_SEGMENTS differs from interface.rs");
