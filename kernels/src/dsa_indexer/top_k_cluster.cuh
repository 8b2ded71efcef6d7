// The top-k stage in one thread-block cluster per query.
// Part of dsa_indexer.cu (included in order from there; not a translation unit of its own).
#pragma once

// ---------------------------------------------------------------------------------------------------------
// Top-k in one thread-block cluster per token
//
// dsa_topk_cluster_e*: the three top-k kernels above in one launch, for rows of at most CLUSTER_BLOCKS *
// CLUSTER_THREADS * E positions. A token's CLUSTER_BLOCKS blocks form one cluster; block r holds positions
// [r * SPAN, (r + 1) * SPAN) in registers, E consecutive ones per thread. The blocks exchange counts by
// pushing them into each other's shared memory (`st.async`, completing on the receiver's mbarrier): no
// kernel boundary, no global-memory meeting, and no cluster barrier after the first (a cluster barrier that
// orders shared-memory writes is a GPU-scope memory barrier on sm_90).
//   1. every block finds the threshold bin from the row's histogram (as dsa_topk_candidates), marks its
//      scores above it, lists the scores in it (its candidates) and counts them by their next 11 bits (the
//      fine bins);
//   2. the blocks send each other how many scores they hold above the threshold bin and how many candidates,
//      then (where the cluster's candidates fit: at most GATHER_CAPACITY) their candidates, so that every
//      block holds all of them in block order;
//   3. each block alone: the candidates' fine histogram, the fine bin of the K-th largest, and the few
//      candidates sharing the K-th's top 22 bits ranked (higher value, then lower position: the K-th largest
//      and the last tied position taken);
//   4. every block marks its taken candidates and writes its selected positions in order after those of the
//      blocks before it (their counts above the threshold bin plus their taken candidates, which it holds).
// Where the candidates do not fit, or more than FINE_LIST share the K-th's top 22 bits, steps 3 and 4 go by
// exchanges instead (3'): block r receives slice r of every block's fine histogram, sums it and sends the sum
// to every block; the blocks send each other their counts and the scores sharing the K-th's top 22 bits (more
// than FINE_LIST take the same two steps over the last 10 bits, after which the scores equal to the K-th go to
// the lowest positions, block by block).
constexpr int CLUSTER_BLOCKS = 8, CLUSTER_THREADS = 512;
constexpr int FINE_SLICE = FINE_BINS / CLUSTER_BLOCKS;  // fine bins summed by each block
constexpr int LOW_BITS = FINE_SHIFT, LOW_BINS = 1 << LOW_BITS, LOW_SLICE = LOW_BINS / CLUSTER_BLOCKS;
static_assert(HIST_BINS == 4 * CLUSTER_THREADS && FINE_BINS == 4 * CLUSTER_THREADS && LOW_BINS == 2 * CLUSTER_THREADS,
              "four (low: two) bins per thread");
static_assert(FINE_SLICE == CLUSTER_THREADS / 2 && LOW_SLICE * CLUSTER_BLOCKS / 4 <= CLUSTER_THREADS,
              "one 16-byte push per thread");
// Threshold-bin candidates a block lists in shared memory (~4% of a row's scores; a block with more works
// from its registers instead).
constexpr int CLUSTER_CANDIDATES = 2048;
// The most candidates of a cluster that every block gathers (step 2); more take the histogram merge.
constexpr int GATHER_CAPACITY = 2048;

// What a block receives, each on its own mbarrier (`ClusterTopkShared::arrived`).
enum ClusterExchange {
    FINE_PARTS,      // slice `rank` of every block's fine histogram
    FINE_MERGED,     // the cluster's fine histogram, a slice from each block
    COUNTS,          // every block's (selected for sure, listed) counts
    LISTS,           // every block's listed scores, in block order
    LOW_PARTS,       // crowded fine bin: as FINE_PARTS for the last 10 bits
    LOW_MERGED,      // ... as FINE_MERGED
    CROWDED_COUNTS,  // ... every block's (selected for sure, equal to the K-th) counts
    GATHER_COUNTS,   // every block's (above the threshold bin, candidates) counts
    GATHERED,        // every block's candidates, in block order
    EXCHANGES
};

struct ClusterTopkShared {
    uint64_t arrived[EXCHANGES];
    alignas(16) int fine[FINE_BINS];                              // this block's fine histogram
    alignas(16) int low[LOW_BINS];                                // ... and low one (crowded)
    alignas(16) int fine_parts[CLUSTER_BLOCKS][FINE_SLICE];       // received
    alignas(16) int fine_merged[FINE_BINS];                       // the cluster's (merged, or from `gathered`)
    alignas(16) int fine_groups[FINE_BINS / GROUP_BINS];          // gathered: fine_merged's group sums
    alignas(16) int low_parts[CLUSTER_BLOCKS][LOW_SLICE];
    alignas(16) int low_merged[LOW_BINS];
    alignas(16) int2 counts[CLUSTER_BLOCKS];
    alignas(16) int2 crowded_counts[CLUSTER_BLOCKS];
    alignas(16) uint2 lists[FINE_LIST];                           // (value, position), block by block
    alignas(16) uint2 list[FINE_LIST];                            // this block's (gathered: the cluster's)
    alignas(16) uint2 gathered[GATHER_CAPACITY];                  // (value, position): the cluster's candidates
    alignas(16) int2 gather_counts[CLUSTER_BLOCKS];
    uint32_t candidate_values[CLUSTER_CANDIDATES], candidate_positions[CLUSTER_CANDIDATES];
    uint32_t taken[CLUSTER_THREADS][2];  // thread i's selected candidates, bit j % 32 of word j / 32 for its position j
    int candidates, listed;
    int block_taken[CLUSTER_BLOCKS];
    int warp_sums[32];
    int definite_sums[CLUSTER_THREADS / 32];  // each warp's scores selected for sure (or earlier blocks' taken)
    int3 located;
    uint32_t kth, last_tied;
};

// Sends 8 or 16 bytes into the same variable of block `rank`, completing them on that block's `bar`.
__device__ __forceinline__ void push_u32x2(const void* dst, uint2 v, const uint64_t* bar, uint32_t rank) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.u32 [%0], {%1, %2}, [%3];\n"
                 ::"r"(cluster_map(dst, rank)), "r"(v.x), "r"(v.y), "r"(cluster_map(bar, rank)) : "memory");
}
__device__ __forceinline__ void push_u32x4(const void* dst, uint4 v, const uint64_t* bar, uint32_t rank) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.u32 [%0], {%1, %2, %3, %4}, [%5];\n"
                 ::"r"(cluster_map(dst, rank)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_map(bar, rank))
                 : "memory");
}

// Step 2 (and its repeat over the low bits): block `rank` sends slice r of its histogram `local` (BINS bins)
// to block r's `parts`, sums the slices it receives (exchange `parts_exchange`) and sends the sum to every
// block's `merged` (exchange `merged_exchange`), where the whole histogram arrives.
template <int BINS>
__device__ __forceinline__ void cluster_merge(const int* local, int (*parts)[BINS / CLUSTER_BLOCKS], int* merged,
                                              uint64_t* arrived, uint32_t rank, int parts_exchange,
                                              int merged_exchange) {
    constexpr int SLICE = BINS / CLUSTER_BLOCKS, PIECES = SLICE / 4;  // 16-byte pieces per slice
    // This block's counts of every slice to the slice's owner (thread i: piece i % PIECES of slice i / PIECES).
    if (threadIdx.x < CLUSTER_BLOCKS * PIECES) {
        const int owner = threadIdx.x / PIECES, piece = threadIdx.x % PIECES;
        const int4 c = reinterpret_cast<const int4*>(local + owner * SLICE)[piece];
        push_u32x4(reinterpret_cast<const int4*>(parts[rank]) + piece, make_uint4(c.x, c.y, c.z, c.w),
                   &arrived[parts_exchange], owner);
    }
    mbarrier_wait(&arrived[parts_exchange], 0);
    // The sum of this block's slice, to every block (thread i: piece i % PIECES to block i / PIECES).
    if (threadIdx.x < CLUSTER_BLOCKS * PIECES) {
        const int to = threadIdx.x / PIECES, piece = threadIdx.x % PIECES;
        int4 sum = make_int4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < CLUSTER_BLOCKS; ++r) {
            const int4 c = reinterpret_cast<const int4*>(parts[r])[piece];
            sum.x += c.x; sum.y += c.y; sum.z += c.z; sum.w += c.w;
        }
        push_u32x4(reinterpret_cast<const int4*>(merged + rank * SLICE) + piece, make_uint4(sum.x, sum.y, sum.z, sum.w),
                   &arrived[merged_exchange], to);
    }
    mbarrier_wait(&arrived[merged_exchange], 0);
}

// The bin of the remaining-th largest in a histogram of PER * CLUSTER_THREADS bins, counted from the top,
// from each thread's PER bins (counts[j]: bin BINS - 1 - PER * threadIdx.x - j): (bin, how many to take from
// it, its count), in every thread.
template <int PER>
__device__ int3 locate(const int (&counts)[PER], int remaining, ClusterTopkShared& sh) {
    constexpr int BINS = PER * CLUSTER_THREADS;
    int sum = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) sum += counts[j];
    int total;
    int above = block_exclusive_scan<CLUSTER_THREADS>(sum, sh.warp_sums, total);
    if (above < remaining && above + sum >= remaining) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            if (above + counts[j] >= remaining) {
                sh.located = make_int3(BINS - 1 - PER * threadIdx.x - j, remaining - above, counts[j]);
                break;
            }
            above += counts[j];
        }
    }
    __syncthreads();
    return sh.located;
}

// `locate` over a histogram in shared memory.
template <int PER>
__device__ int3 locate(const int* hist, int remaining, ClusterTopkShared& sh) {
    int counts[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) counts[j] = hist[PER * CLUSTER_THREADS - 1 - PER * threadIdx.x - j];
    return locate(counts, remaining, sh);
}

// `locate` by one warp alone, in every warp (no block barrier): the bin of the remaining-th largest in a
// histogram of HIST_BINS bins (global or shared memory) from its 16-bin group sums `groups`: a warp scan over
// the groups (four per lane, from the top), then one over the 16 bins of the group it falls in. `remaining`
// is at most the histogram's total (K below the visible count; the fine bins hold the threshold bin's
// candidates). Returns (bin, how many to take from it, its count).
__device__ __forceinline__ int3 locate_by_groups(const int* groups, const int* bins, int remaining) {
    const int lane = threadIdx.x % 32;
    const auto crossing = [&](int count, int& before) {  // first lane whose inclusive prefix reaches remaining
        const int inclusive = warp_inclusive_sum(count);
        const unsigned reached = __ballot_sync(0xffffffff, inclusive >= remaining);
        const int src = reached ? __ffs(reached) - 1 : 31;
        before = __shfl_sync(0xffffffff, inclusive - count, src);
        return src;
    };
    static_assert(HIST_GROUPS == 4 * 32 && GROUP_BINS <= 32, "four groups per lane, a group's bins in a warp");
    const int4 four = reinterpret_cast<const int4*>(groups)[HIST_GROUPS / 4 - 1 - lane];  // groups 127 - 4 lane - j
    int before;
    const int src = crossing(four.x + four.y + four.z + four.w, before);
    const int c[4] = {__shfl_sync(0xffffffff, four.w, src), __shfl_sync(0xffffffff, four.z, src),
                      __shfl_sync(0xffffffff, four.y, src), __shfl_sync(0xffffffff, four.x, src)};
    int group = HIST_GROUPS - 1 - 4 * src - 3;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        if (before + c[j] >= remaining) {
            group = HIST_GROUPS - 1 - 4 * src - j;
            break;
        }
        before += c[j];
    }
    remaining -= before;
    const int bin_here = group * GROUP_BINS + GROUP_BINS - 1 - lane;  // from the group's top
    const int count = lane < GROUP_BINS ? bins[bin_here] : 0;
    const int at = crossing(count, before);
    return make_int3(group * GROUP_BINS + GROUP_BINS - 1 - at, remaining - before, __shfl_sync(0xffffffff, count, at));
}

// The sum over the block of this thread's PER bins of `hist` above `bin` (the thread's bins as `locate`'s).
template <int PER>
__device__ __forceinline__ int count_above(const int* hist, int bin) {
    int above = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int b = PER * CLUSTER_THREADS - 1 - PER * threadIdx.x - j;
        if (b > bin) above += hist[b];
    }
    return above;
}

// The sum of each thread's `mine` over the block, in every thread; its block barrier also completes the
// block's earlier shared-memory writes.
__device__ __forceinline__ int block_sum(int mine, ClusterTopkShared& sh) {
    mine = __reduce_add_sync(0xffffffff, mine);
    if (threadIdx.x % 32 == 0) sh.definite_sums[threadIdx.x / 32] = mine;
    __syncthreads();
    int sum = 0;
#pragma unroll
    for (int w = 0; w < CLUSTER_THREADS / 32; ++w) sum += sh.definite_sums[w];
    return sum;
}

// Sums each thread's `mine` over the block and sends (the sum, `second`) to entry `rank` of `counts` in every
// block, then waits for every block's (exchange `exchange`). `second` is read after the block barrier, so it may
// be a shared count the block's threads have just finished.
__device__ __forceinline__ void exchange_counts(int mine, const int& second, int2* counts, int exchange,
                                                uint32_t rank, ClusterTopkShared& sh) {
    const int sum = block_sum(mine, sh);
    if (threadIdx.x < CLUSTER_BLOCKS)
        push_u32x2(&counts[rank], make_uint2(sum, second), &sh.arrived[exchange], threadIdx.x);
    mbarrier_wait(&sh.arrived[exchange], 0);
}

// Sends this block's `mine` entries (`entry(i)`) to `dst[start + i]` in every block of the cluster and waits
// until the cluster's `total` entries have arrived in its own `dst` (exchange `exchange`).
template <typename Entry>
__device__ __forceinline__ void all_gather(uint2* dst, int start, int mine, int total, int exchange, Entry entry,
                                           ClusterTopkShared& sh) {
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(&sh.arrived[exchange], total * 8);
    for (int k = threadIdx.x; k < mine * CLUSTER_BLOCKS; k += CLUSTER_THREADS) {
        const int i = k % mine, to = k / mine;  // entry i to block `to`
        push_u32x2(&dst[start + i], entry(i), &sh.arrived[exchange], to);
    }
    mbarrier_wait(&sh.arrived[exchange], 0);
}

// The entry of rank `need - 1` among the first `count` of `list` (higher value first, then lower position):
// the K-th value and the last tied position taken, in every thread.
__device__ __forceinline__ uint2 rank_list(const uint2* list, int count, int need, ClusterTopkShared& sh) {
    if ((int)threadIdx.x < count) {
        const uint2 entry = list[threadIdx.x];
        int higher = 0;
        for (int j = 0; j < count; ++j) {
            const uint2 other = list[j];
            higher += other.x > entry.x || (other.x == entry.x && other.y < entry.y);
        }
        if (higher == need - 1) {
            sh.kth = entry.x;
            sh.last_tied = entry.y;
        }
    }
    __syncthreads();
    return make_uint2(sh.kth, sh.last_tied);
}

// The dynamic shared memory the launcher gives a cluster top-k block (`CLUSTER_SHARED_BYTES` in Rust).
constexpr int CLUSTER_SHARED_BYTES = 80 * 1024;
static_assert(sizeof(ClusterTopkShared) <= CLUSTER_SHARED_BYTES, "the launcher's dynamic shared memory");

template <int E>
__device__ void topk_cluster_impl(const DsaParams& p) {
    constexpr int SPAN = CLUSTER_THREADS * E;
    static_assert(E <= 64, "one 64-bit mask per thread");
    extern __shared__ __align__(16) unsigned char cluster_smem[];
    ClusterTopkShared& sh = *reinterpret_cast<ClusterTopkShared*>(cluster_smem);
    const int t = blockIdx.y;
    const uint32_t rank = cluster_rank();
    // The exchanges' barriers, each expecting its bytes from the cluster (LISTS: once the counts are in);
    // the other blocks may send as soon as the cluster barrier below has made them visible.
    if (threadIdx.x == 0) {
        constexpr int BYTES[EXCHANGES] = {FINE_SLICE * 4 * CLUSTER_BLOCKS, FINE_BINS * 4, 8 * CLUSTER_BLOCKS, 0,
                                          LOW_SLICE * 4 * CLUSTER_BLOCKS, LOW_BINS * 4, 8 * CLUSTER_BLOCKS,
                                          8 * CLUSTER_BLOCKS, 0};
        for (int x = 0; x < EXCHANGES; ++x) mbarrier_init(&sh.arrived[x], 1);
        for (int x = 0; x < EXCHANGES; ++x)
            if (x != LISTS && x != GATHERED) mbarrier_arrive_expect_tx(&sh.arrived[x], BYTES[x]);
    }
    cluster_arrive_after_mbarrier_init();
    const int n = visible_keys(p, t), K = p.K;
    int* out = p.indices + (size_t)t * K;
    for (int i = threadIdx.x; i < FINE_BINS; i += CLUSTER_THREADS) sh.fine[i] = 0;
    for (int i = threadIdx.x; i < LOW_BINS; i += CLUSTER_THREADS) sh.low[i] = 0;
    for (int i = threadIdx.x; i < FINE_BINS; i += CLUSTER_THREADS) sh.fine_merged[i] = 0;  // (gathered: counted here)
    for (int i = threadIdx.x; i < FINE_BINS / GROUP_BINS; i += CLUSTER_THREADS) sh.fine_groups[i] = 0;
    sh.taken[threadIdx.x][0] = sh.taken[threadIdx.x][1] = 0;
    if (threadIdx.x == 0) sh.candidates = sh.listed = 0;
    if (threadIdx.x < CLUSTER_BLOCKS) sh.block_taken[threadIdx.x] = 0;
    // The zeroed bins and counters before any warp counts into them (no block scan orders them later), while
    // the block waits for the score kernel anyway.
    __syncthreads();
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the score kernel's writes
    if (n <= K) {  // every visible position, then -1 (the same for every block of the cluster: none sends)
        for (int i = rank * CLUSTER_THREADS + threadIdx.x; i < K; i += CLUSTER_BLOCKS * CLUSTER_THREADS)
            out[i] = i < n ? i : -1;
        cluster_wait_arrivals();
        return;
    }
    int* hist = p.hist + (size_t)t * HIST_STRIDE;
    const int block_first = rank * SPAN, first = block_first + threadIdx.x * E;
    // The bins' lines into L1 (each warp's second look at the bins below is then a hit) and this thread's
    // scores, loaded together.
    static_assert(HIST_BINS * 4 / 128 <= CLUSTER_THREADS, "one line per thread");
    if (threadIdx.x < HIST_BINS * 4 / 128) prefetch_l1(hist + threadIdx.x * 32);
    float v[E];
    load_scores(p.scores + (size_t)t * p.score_stride, first, n, v);

    // 1. The threshold bin and how many to take from it (every warp alone, from the bins' group sums); the
    // scores above it (a bit per score in `selected`); the candidates, listed, and their fine histogram.
    const int3 coarse = locate_by_groups(hist + GROUP_OFFSET, hist, K);
    const uint32_t bin = coarse.x;
    const int remaining = coarse.y;
    uint32_t u[E];
    uint64_t selected = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        u[j] = ordered(v[j]);
        const bool valid = first + j < n;
        const uint32_t b = u[j] >> (32 - HIST_BITS);
        if (valid && b > bin) selected |= 1ull << j;
        if (valid && b == bin) {
            atomicAdd(&sh.fine[(u[j] >> FINE_SHIFT) & (FINE_BINS - 1)], 1);
            const int slot = atomicAdd(&sh.candidates, 1);
            if (slot < CLUSTER_CANDIDATES) {
                sh.candidate_values[slot] = u[j];
                sh.candidate_positions[slot] = first + j;
            }
        }
    }
    int definite = __popcll(selected);
    cluster_wait_arrivals();  // every block's barriers are set up

    // 2. Every block's counts (scores above the threshold bin, candidates) to every block; then, where the
    // cluster's candidates fit, every block's candidates to every block (in block order).
    // (Its block barrier also completes the block's candidate list and fine histogram.)
    exchange_counts(definite, sh.candidates, sh.gather_counts, GATHER_COUNTS, rank, sh);
    if (rank == 0) {  // every block has read the row's bins and groups (before sending its counts): zero them
        for (int i = threadIdx.x; i < HIST_BINS; i += CLUSTER_THREADS) hist[i] = 0;
        if (threadIdx.x < HIST_GROUPS) hist[GROUP_OFFSET + threadIdx.x] = 0;
    }
    int gathered = 0, my_start = 0;
    bool listed = true;  // every block's candidates are in its list
    for (int b = 0; b < CLUSTER_BLOCKS; ++b) {
        if (b == (int)rank) my_start = gathered;
        gathered += sh.gather_counts[b].y;
        listed &= sh.gather_counts[b].y <= CLUSTER_CANDIDATES;
    }
    const int mine = sh.candidates;
    int offset = 0;
    bool selected_by_gathering = false;
    if (listed && gathered <= GATHER_CAPACITY) {  // (uniform over the cluster)
        all_gather(sh.gathered, my_start, mine, gathered, GATHERED,
                   [&](int i) { return make_uint2(sh.candidate_values[i], sh.candidate_positions[i]); }, sh);
        // 3. Locally: the candidates' fine histogram, the fine bin of the K-th largest, and (when few share it)
        // the K-th value and the last tied position by ranking them.
        for (int i = threadIdx.x; i < gathered; i += CLUSTER_THREADS) {
            const uint32_t fine_bin = (sh.gathered[i].x >> FINE_SHIFT) & (FINE_BINS - 1);
            atomicAdd(&sh.fine_merged[fine_bin], 1);
            atomicAdd(&sh.fine_groups[fine_bin / GROUP_BINS], 1);
        }
        __syncthreads();
        static_assert(FINE_BINS == HIST_BINS, "locate_by_groups takes HIST_BINS bins: the fine ones must match");
        const int3 fine = locate_by_groups(sh.fine_groups, sh.fine_merged, remaining);
        if (fine.z <= FINE_LIST) {  // (uniform: every block holds the same candidates)
            const uint32_t top22 = bin << FINE_BITS | (uint32_t)fine.x;
            for (int i = threadIdx.x; i < gathered; i += CLUSTER_THREADS) {
                const uint2 entry = sh.gathered[i];
                if (entry.x >> FINE_SHIFT == top22) sh.list[atomicAdd(&sh.listed, 1)] = entry;
            }
            __syncthreads();
            const uint2 kth_tied = rank_list(sh.list, sh.listed, fine.y, sh);
            // 4. The taken candidates: this block's marked, the earlier blocks' counted for its offset.
            int taken_before = 0;
            for (int i = threadIdx.x; i < my_start + mine; i += CLUSTER_THREADS) {
                const uint2 entry = sh.gathered[i];
                if (among_k(entry.x, entry.y, kth_tied)) {
                    if (i < my_start) {
                        ++taken_before;
                    } else {
                        const int position = entry.y - block_first, j = position % E;
                        atomicOr(&sh.taken[position / E][j / 32], 1u << (j % 32));
                    }
                }
            }
            offset = block_sum(taken_before, sh);  // (its barrier also completes the marks)
            for (int b = 0; b < (int)rank; ++b) offset += sh.gather_counts[b].x;
            selected_by_gathering = true;
        }
    }
    if (!selected_by_gathering) {
        // 3'. The cluster's fine histogram, in every block; the fine bin of the K-th largest.
        cluster_merge<FINE_BINS>(sh.fine, sh.fine_parts, sh.fine_merged, sh.arrived, rank, FINE_PARTS, FINE_MERGED);
        const int3 fine = locate<4>(sh.fine_merged, remaining, sh);
        const uint32_t top22 = bin << FINE_BITS | (uint32_t)fine.x;
        definite += count_above<4>(sh.fine, fine.x);
        // The block's candidates: from its list, or from its registers where the list overflowed.
        const int candidates = sh.candidates;
        const auto for_each_candidate = [&](auto&& f) {
            if (candidates <= CLUSTER_CANDIDATES) {
                for (int i = threadIdx.x; i < candidates; i += CLUSTER_THREADS)
                    f(sh.candidate_values[i], sh.candidate_positions[i]);
            } else {
#pragma unroll
                for (int j = 0; j < E; ++j)
                    if (first + j < n && u[j] >> (32 - HIST_BITS) == bin) f(u[j], (uint32_t)(first + j));
            }
        };
        if (fine.z <= FINE_LIST) {  // (uniform over the cluster)
            // The cluster's scores sharing the K-th's top 22 bits, in every block.
            for_each_candidate([&](uint32_t value, uint32_t position) {
                if (value >> FINE_SHIFT == top22) sh.list[atomicAdd(&sh.listed, 1)] = make_uint2(value, position);
            });
            exchange_counts(definite, sh.listed, sh.counts, COUNTS, rank, sh);
            int listed = 0, before = 0;  // the cluster's, and the blocks' before this one
            for (int b = 0; b < CLUSTER_BLOCKS; ++b) {
                if (b == (int)rank) before = listed;
                listed += sh.counts[b].y;
            }
            all_gather(sh.lists, before, sh.listed, listed, LISTS, [&](int i) { return sh.list[i]; }, sh);
            // Rank them.
            const uint2 kth_tied = rank_list(sh.lists, listed, fine.y, sh);
            if ((int)threadIdx.x < listed) {  // entry i came from the block whose share of the list holds i
                const uint2 entry = sh.lists[threadIdx.x];
                if (among_k(entry.x, entry.y, kth_tied)) {
                    int source = 0;
                    for (int b = 0, end = 0; b < CLUSTER_BLOCKS; ++b) {
                        end += sh.counts[b].y;
                        if ((int)threadIdx.x >= end) source = b + 1;
                    }
                    atomicAdd(&sh.block_taken[source], 1);
                }
            }
            // The block's candidates taken: above the fine bin, or in it and ranked within the K.
            for_each_candidate([&](uint32_t value, uint32_t position) {
                if (among_k(value, position, kth_tied)) {
                    const int i = position - block_first;
                    const int j = i % E;  // 32-bit words: a 64-bit shared atomicOr is a compare-and-swap loop
                    atomicOr(&sh.taken[i / E][j / 32], 1u << (j % 32));
                }
            });
            __syncthreads();
            for (int b = 0; b < (int)rank; ++b) offset += sh.counts[b].x + sh.block_taken[b];
        } else {
            // A crowded fine bin: the same over the last 10 bits, then the scores equal to the K-th by
            // position, block by block (from the registers: the candidates' list is not in position order).
            for_each_candidate([&](uint32_t value, uint32_t) {
                if (value >> FINE_SHIFT == top22) atomicAdd(&sh.low[value & (LOW_BINS - 1)], 1);
            });
            __syncthreads();
            cluster_merge<LOW_BINS>(sh.low, sh.low_parts, sh.low_merged, sh.arrived, rank, LOW_PARTS, LOW_MERGED);
            const int3 low = locate<2>(sh.low_merged, fine.y, sh);
            const uint32_t kth = top22 << LOW_BITS | (uint32_t)low.x;
            definite += count_above<2>(sh.low, low.x);
            int equal = 0;
#pragma unroll
            for (int j = 0; j < E; ++j) equal += first + j < n && u[j] == kth;
            int block_equal;
            int equal_before = block_exclusive_scan<CLUSTER_THREADS>(equal, sh.warp_sums, block_equal);
            exchange_counts(definite, block_equal, sh.crowded_counts, CROWDED_COUNTS, rank, sh);
            // The low.y equal scores taken go to the lowest positions: the blocks' in order.
            int equal_seen = 0, take_equal = 0;
            for (int b = 0; b < CLUSTER_BLOCKS; ++b) {
                const int taken = min(max(low.y - equal_seen, 0), sh.crowded_counts[b].y);
                if (b < (int)rank) offset += sh.crowded_counts[b].x + taken;
                if (b == (int)rank) take_equal = taken;
                equal_seen += sh.crowded_counts[b].y;
            }
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const bool in_bin = first + j < n && u[j] >> (32 - HIST_BITS) == bin;
                if (in_bin && (u[j] > kth || (u[j] == kth && equal_before++ < take_equal))) selected |= 1ull << j;
            }
        }

    }

    // This block's selected positions, in order, after the blocks before it.
    selected |= (uint64_t)sh.taken[threadIdx.x][1] << 32 | sh.taken[threadIdx.x][0];
    int block_total;
    int slot = offset + block_exclusive_scan<CLUSTER_THREADS>(__popcll(selected), sh.warp_sums, block_total);
    for (; selected != 0; selected &= selected - 1) out[slot++] = first + __ffsll(selected) - 1;
}
static_assert(CLUSTER_BLOCKS == GLM5_DSA_INDEXER_CLUSTER_BLOCKS, "CLUSTER_BLOCKS differs from interface.rs");
static_assert(CLUSTER_THREADS == GLM5_DSA_INDEXER_CLUSTER_THREADS, "CLUSTER_THREADS differs from interface.rs");
static_assert(CLUSTER_SHARED_BYTES == GLM5_DSA_INDEXER_CLUSTER_SHARED_BYTES, "CLUSTER_SHARED_BYTES differs from interface.rs");
