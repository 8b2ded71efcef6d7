// The emulator's scheduler (semantics in cuda_emu.h): each block's threads as ucontext contexts on the
// calling OS thread, switched only where a thread must wait for others (`__syncthreads`, a shuffle).

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <vector>

#include "cuda_emu.h"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace {

// Deep enough for a kernel's unrolled locals and the Rust closure that calls it, in unoptimised builds too.
constexpr size_t STACK_BYTES = 256 * 1024;

enum class State { Runnable, AtBarrier, AtShuffle, Done };

struct Thread {
    ucontext_t context;
    State state = State::Runnable;
    uint64_t barrier_generation = 0;  // the generation it waits to see end (AtBarrier)
    uint64_t shuffles = 0;            // shuffles it has entered
    unsigned shuffle_mask = 0;        // the lanes its current shuffle waits for (AtShuffle)
};

struct Launch {
    void (*thunk)(void*);
    void* context;
    std::vector<uint8_t> dynamic_shared;
    std::vector<Thread> threads;
    std::vector<char*> stacks;
    // Per warp, two generations of 32 lanes' shuffle values (a lane's shuffle n uses slot n % 2: it cannot
    // reach n + 2 before every lane has read n).
    std::vector<uint64_t> shuffle_slots;
    ucontext_t scheduler;
    Thread* current = nullptr;
    unsigned live = 0, arrived = 0;
    uint64_t barrier_generation = 0;
};

thread_local Launch* launch = nullptr;

void yield() { swapcontext(&launch->current->context, &launch->scheduler); }

void release_barrier_if_complete() {
    if (launch->arrived > 0 && launch->arrived == launch->live) {
        launch->arrived = 0;
        ++launch->barrier_generation;
    }
}

void thread_entry() {
    launch->thunk(launch->context);
    launch->current->state = State::Done;
    --launch->live;
    release_barrier_if_complete();
    // Returning resumes uc_link, the scheduler.
}

bool ready(const Launch& l, size_t index) {
    const Thread& t = l.threads[index];
    switch (t.state) {
        case State::Runnable:
            return true;
        case State::AtBarrier:
            return l.barrier_generation != t.barrier_generation;
        case State::AtShuffle: {
            const size_t warp = index / 32;
            for (unsigned lane = 0; lane < 32; ++lane) {
                if (!(t.shuffle_mask >> lane & 1)) continue;
                const size_t other = warp * 32 + lane;
                if (other >= l.threads.size() || l.threads[other].shuffles < t.shuffles) return false;
            }
            return true;
        }
        case State::Done:
            return false;
    }
    return false;
}

}  // namespace

void __syncthreads() {
    Thread& t = *launch->current;
    t.state = State::AtBarrier;
    t.barrier_generation = launch->barrier_generation;
    ++launch->arrived;
    release_barrier_if_complete();
    yield();
}

uint64_t glm5_emu_shuffle_xor(uint64_t bits, unsigned mask, int lane_mask) {
    Thread& t = *launch->current;
    const size_t index = &t - launch->threads.data();
    const size_t warp = index / 32, lane = index % 32;
    uint64_t* slots = &launch->shuffle_slots[warp * 64 + (t.shuffles % 2) * 32];
    slots[lane] = bits;
    ++t.shuffles;
    t.state = State::AtShuffle;
    t.shuffle_mask = mask;
    yield();
    return slots[(lane ^ static_cast<size_t>(lane_mask)) % 32];
}

void* glm5_emu_dynamic_shared() { return launch->dynamic_shared.data(); }

/// Runs `thunk(context)` as every thread of a grid. Returns 0, or 1 with a message in `error` when no
/// thread of a block can go on (a barrier or shuffle that some thread never reaches).
extern "C" int glm5_emu_launch(const unsigned grid[3], const unsigned block[3], size_t shared_bytes,
                               void (*thunk)(void*), void* context, char* error, size_t error_bytes) {
    Launch l;
    l.thunk = thunk;
    l.context = context;
    l.dynamic_shared.assign(shared_bytes, 0xa5);  // poisoned: the kernel must write before it reads
    const size_t threads = static_cast<size_t>(block[0]) * block[1] * block[2];
    l.threads.resize(threads);
    l.shuffle_slots.assign((threads + 31) / 32 * 64, 0);
    l.stacks.resize(threads);
    for (char*& stack : l.stacks) stack = static_cast<char*>(malloc(STACK_BYTES));
    Launch* outer = launch;
    launch = &l;
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    int status = 0;
    for (unsigned bz = 0; bz < grid[2] && status == 0; ++bz)
        for (unsigned by = 0; by < grid[1] && status == 0; ++by)
            for (unsigned bx = 0; bx < grid[0] && status == 0; ++bx) {
                blockIdx = {bx, by, bz};
                l.live = static_cast<unsigned>(threads);
                l.arrived = 0;
                for (size_t i = 0; i < threads; ++i) {
                    Thread& t = l.threads[i];
                    t = Thread();
                    getcontext(&t.context);
                    t.context.uc_stack.ss_sp = l.stacks[i];
                    t.context.uc_stack.ss_size = STACK_BYTES;
                    t.context.uc_link = &l.scheduler;
                    makecontext(&t.context, thread_entry, 0);
                }
                for (;;) {
                    bool progressed = false, alive = false;
                    for (size_t i = 0; i < threads; ++i) {
                        if (l.threads[i].state == State::Done) continue;
                        alive = true;
                        if (!ready(l, i)) continue;
                        l.threads[i].state = State::Runnable;
                        l.current = &l.threads[i];
                        threadIdx = {static_cast<unsigned>(i % block[0]),
                                     static_cast<unsigned>(i / block[0] % block[1]),
                                     static_cast<unsigned>(i / (static_cast<size_t>(block[0]) * block[1]))};
                        swapcontext(&l.scheduler, &l.threads[i].context);
                        progressed = true;
                    }
                    if (!alive) break;
                    if (!progressed) {
                        size_t at_barrier = 0, at_shuffle = 0;
                        for (const Thread& t : l.threads) {
                            at_barrier += t.state == State::AtBarrier;
                            at_shuffle += t.state == State::AtShuffle;
                        }
                        snprintf(error, error_bytes,
                                 "block (%u, %u, %u) cannot go on: %zu threads wait at __syncthreads, %zu at a "
                                 "shuffle, %u of %zu still running",
                                 bx, by, bz, at_barrier, at_shuffle, l.live, threads);
                        status = 1;
                        break;
                    }
                }
            }
    for (char* stack : l.stacks) free(stack);
    launch = outer;
    return status;
}

/// `bytes` of memory whose end touches an inaccessible page, so a kernel reading or writing past it faults.
/// The start is 16-byte aligned (the kernels' widest loads); the bytes are filled with `poison`.
extern "C" void* glm5_emu_alloc(size_t bytes, unsigned char poison) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t padded = (bytes + 15) / 16 * 16;
    const size_t usable = (padded + page - 1) / page * page;
    char* base = static_cast<char*>(mmap(nullptr, usable + page, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) return nullptr;
    mprotect(base + usable, page, PROT_NONE);
    char* start = base + usable - padded;
    memset(start, poison, padded);
    return start;
}

extern "C" void glm5_emu_free(void* start, size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t padded = (bytes + 15) / 16 * 16;
    const size_t usable = (padded + page - 1) / page * page;
    munmap(static_cast<char*>(start) + padded - usable, usable + page);
}
