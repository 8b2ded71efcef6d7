// The emulator's scheduler (semantics in cuda_emu.h): each block's threads as contexts on the calling OS
// thread, switched only where a thread must wait for others (`__syncthreads`, a shuffle). A launch switches
// millions of times, so on x86-64 a context switch is the six callee-saved registers and the stack pointer
// (ucontext's swapcontext makes a signal-mask system call each time, ~50x slower); elsewhere ucontext.

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <vector>

#include "cuda_emu.h"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace {

#if defined(__x86_64__)
extern "C" void glm5_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl glm5_emu_switch
    .type glm5_emu_switch, @function
glm5_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size glm5_emu_switch, .-glm5_emu_switch
)");

struct Context {
    void* sp = nullptr;
};

/// A context that starts in `entry` (which must never return) on `stack`: the frame `glm5_emu_switch`
/// pops (six zero registers, then `entry` as the return address), with the stack aligned as after a call.
void start_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~static_cast<uintptr_t>(15);
    void** frame = reinterpret_cast<void**>(top);
    *--frame = nullptr;                           // entry's return address: never used
    *--frame = reinterpret_cast<void*>(entry);    // popped by `ret`
    for (int i = 0; i < 6; ++i) *--frame = nullptr;
    c.sp = frame;
}
void switch_context(Context& from, Context& to) { glm5_emu_switch(&from.sp, to.sp); }
#else
}  // namespace
#include <ucontext.h>
namespace {
struct Context {
    ucontext_t context;
};
void start_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
    getcontext(&c.context);
    c.context.uc_stack.ss_sp = stack;
    c.context.uc_stack.ss_size = bytes;
    c.context.uc_link = nullptr;
    makecontext(&c.context, entry, 0);
}
void switch_context(Context& from, Context& to) { swapcontext(&from.context, &to.context); }
#endif

// Deep enough for a kernel's unrolled locals and the Rust closure that calls it, in unoptimised builds too.
constexpr size_t STACK_BYTES = 128 * 1024;
// Each thread's stack starts (colour · index) % COLOUR_SPAN below its top: with every top the same distance
// apart, the threads' hot frames would all fall in the same cache sets and evict each other at every switch.
constexpr size_t COLOUR_STEP = 1088, COLOUR_SPAN = 32 * 1024;

enum class State { Runnable, AtBarrier, AtCollective, Done };

struct Thread {
    Context context;
    State state = State::Runnable;
    uint64_t barrier_generation = 0;  // the generation it waits to see end (AtBarrier)
    uint64_t collectives = 0;         // warp collectives it has entered
};

/// A warp's collectives (shuffles, gathers): the lanes enter them in the same order, so the n-th one
/// completes when every lane of its mask has entered it; `arrived` counts those of the open one.
struct Warp {
    uint64_t completed = 0;
    unsigned arrived = 0;
    // Two generations of the lanes' contributions (collective n uses slot n % 2: no lane can enter n + 2
    // before every lane has entered n + 1, after reading n).
    unsigned char slots[2][32][GLM5_EMU_GATHER_BYTES];
};

struct Launch {
    void (*thunk)(void*);
    void* context;
    std::vector<uint8_t> dynamic_shared;
    std::vector<Thread> threads;
    std::vector<char*> stacks;
    std::vector<Warp> warps;
    Context scheduler;
    Thread* current = nullptr;
    unsigned live = 0, arrived = 0;
    uint64_t barrier_generation = 0;
    // `__syncthreads_and`: the AND of the open barrier's predicates, and each generation's result (two
    // generations, as for the warps' slots).
    int barrier_and = 1;
    int barrier_and_result[2] = {1, 1};
};

thread_local Launch* launch = nullptr;

void yield() { switch_context(launch->current->context, launch->scheduler); }

void release_barrier_if_complete() {
    if (launch->arrived > 0 && launch->arrived == launch->live) {
        launch->barrier_and_result[launch->barrier_generation % 2] = launch->barrier_and;
        launch->barrier_and = 1;
        launch->arrived = 0;
        ++launch->barrier_generation;
    }
}

void thread_entry() {
    launch->thunk(launch->context);
    launch->current->state = State::Done;
    --launch->live;
    release_barrier_if_complete();
    yield();  // never resumed: a finished thread is never ready
    abort();
}

bool ready(const Launch& l, size_t index) {
    const Thread& t = l.threads[index];
    switch (t.state) {
        case State::Runnable:
            return true;
        case State::AtBarrier:
            return l.barrier_generation != t.barrier_generation;
        case State::AtCollective:
            return l.warps[index / 32].completed >= t.collectives;
        case State::Done:
            return false;
    }
    return false;
}

}  // namespace

int __syncthreads_and(int predicate) {
    Thread& t = *launch->current;
    t.state = State::AtBarrier;
    t.barrier_generation = launch->barrier_generation;
    launch->barrier_and &= predicate != 0;
    ++launch->arrived;
    release_barrier_if_complete();
    yield();
    return launch->barrier_and_result[t.barrier_generation % 2];
}

void __syncthreads() { __syncthreads_and(1); }

namespace {
/// Enters the calling lane's next warp collective with `bytes` of its own, waits for every lane of `mask`,
/// and returns the collective's 32 contributions.
const unsigned char (*warp_collective(const void* mine, size_t bytes, unsigned mask))[GLM5_EMU_GATHER_BYTES] {
    if (bytes > GLM5_EMU_GATHER_BYTES) glm5_emu_unsupported("a warp collective of more than 64 bytes a lane");
    Thread& t = *launch->current;
    const size_t index = &t - launch->threads.data();
    Warp& warp = launch->warps[index / 32];
    unsigned char(*slots)[GLM5_EMU_GATHER_BYTES] = warp.slots[t.collectives % 2];
    memcpy(slots[index % 32], mine, bytes);
    ++t.collectives;
    if (++warp.arrived == static_cast<unsigned>(__builtin_popcount(mask))) {
        warp.arrived = 0;
        ++warp.completed;
    }
    t.state = State::AtCollective;
    yield();
    return slots;
}
}  // namespace

uint64_t glm5_emu_shuffle_xor(uint64_t bits, unsigned mask, int lane_mask) {
    const size_t lane = static_cast<size_t>(launch->current - launch->threads.data()) % 32;
    uint64_t partner;
    memcpy(&partner, warp_collective(&bits, 8, mask)[(lane ^ static_cast<size_t>(lane_mask)) % 32], 8);
    return partner;
}

void glm5_emu_warp_gather(const void* mine, size_t bytes, void* all) {
    const unsigned char(*slots)[GLM5_EMU_GATHER_BYTES] = warp_collective(mine, bytes, 0xffffffffu);
    for (int lane = 0; lane < 32; ++lane) memcpy(static_cast<char*>(all) + lane * bytes, slots[lane], bytes);
}

void* glm5_emu_dynamic_shared() { return launch->dynamic_shared.data(); }

/// Runs `thunk(context)` as every thread of a grid. Returns 0, or 1 with a message in `error` when no
/// thread of a block can go on (a barrier or shuffle that some thread never reaches).
extern "C" int glm5_emu_launch(const unsigned grid[3], const unsigned block[3], size_t shared_bytes,
                               void (*thunk)(void*), void* context, char* error, size_t error_bytes) {
    Launch l;
    l.thunk = thunk;
    l.context = context;
    // Poisoned: the kernel must write before it reads (0x7f7f.. is ~3.4e38 as f32 and as bf16, NaN as f16).
    l.dynamic_shared.assign(shared_bytes, 0x7f);
    const size_t threads = static_cast<size_t>(block[0]) * block[1] * block[2];
    l.threads.resize(threads);

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
                l.warps.assign((threads + 31) / 32, Warp());
                l.arrived = 0;
                for (size_t i = 0; i < threads; ++i) {
                    Thread& t = l.threads[i];
                    t = Thread();
                    start_context(t.context, l.stacks[i], STACK_BYTES - (COLOUR_STEP * i) % COLOUR_SPAN,
                                  thread_entry);
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
                        switch_context(l.scheduler, l.threads[i].context);
                        progressed = true;
                    }
                    if (!alive) break;
                    if (!progressed) {
                        size_t at_barrier = 0, at_collective = 0;
                        for (const Thread& t : l.threads) {
                            at_barrier += t.state == State::AtBarrier;
                            at_collective += t.state == State::AtCollective;
                        }
                        snprintf(error, error_bytes,
                                 "block (%u, %u, %u) cannot go on: %zu threads wait at __syncthreads, %zu at a "
                                 "shuffle, %u of %zu still running",
                                 bx, by, bz, at_barrier, at_collective, l.live, threads);
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
