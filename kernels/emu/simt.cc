// The SIMT side of the emulator: kernel launches run on the launching host
// thread, one block at a time, one fiber per CUDA thread. A fiber runs until
// it reaches __syncthreads, a warp operation (shuffle, ballot, __syncwarp)
// or its end; the scheduler then runs the next one in the launch's order
// (forward, reverse or seeded random, over blocks, warps and lanes).
//
// Checks a GPU does not make (each a report, see docs/emulation.md):
//  - a barrier that not every thread of the block reaches, or that threads
//    reach at different __syncthreads;
//  - a warp operation whose mask leaves out the caller, names a lane that
//    exited or does not exist, or reads a lane outside the mask; lanes of
//    one mask that disagree on it;
//  - shared memory: a read of a byte no thread of the block wrote, and a
//    read or write of a byte another thread wrote (or read, for a write)
//    since the last barrier (a racecheck; atomics are exempt among
//    themselves);
//  - global memory (memcheck): an access outside every live device
//    allocation, or to pinned host memory, or a write to the launch's
//    parameters;
//  - with KVD_EMU_CHECK=order: every launch runs in forward, reverse and
//    random order and must leave identical bytes.
// The memory checks need the kernels compiled with the compiler's
// kernel-address instrumentation (KVD_EMU_MEMCHECK), which calls the
// __kvd_emu_*_noabort hooks at the end of this file on every load and store
// (the instrumentation's callback prefix is renamed from __asan_, so an
// ASan+UBSan build links the sanitizer runtime beside them).
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <random>
#include <unordered_set>
#include <vector>

#include "emu_internal.h"
#include "kvd_simt_mma.h"

#if defined(__SANITIZE_ADDRESS__)
#define KVD_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVD_EMU_ASAN 1
#endif
#endif
#ifdef KVD_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

thread_local const kvd_emu_thread_view *kvd_emu_view;

namespace kvd_emu
{
namespace
{

// ---- configuration ------------------------------------------------------------

enum order_kind { ORDER_FORWARD, ORDER_REVERSE, ORDER_RANDOM };

struct config {
    bool order_check = false;         // KVD_EMU_CHECK contains "order" (or set by the API)
    order_kind order = ORDER_FORWARD; // KVD_EMU_ORDER=forward|reverse|random
    uint64_t seed = 1;                // KVD_EMU_SEED
    config()
    {
        const char *c = getenv("KVD_EMU_CHECK");
        order_check = c && strstr(c, "order");
        const char *o = getenv("KVD_EMU_ORDER");
        if (o && !strcmp(o, "reverse"))
            order = ORDER_REVERSE;
        else if (o && !strcmp(o, "random"))
            order = ORDER_RANDOM;
        const char *s = getenv("KVD_EMU_SEED");
        if (s)
            seed = strtoull(s, nullptr, 0);
    }
};
config &cfg()
{
    static config c;
    return c;
}

#ifdef KVD_EMU_MEMCHECK
constexpr bool have_memcheck = true;
#else
constexpr bool have_memcheck = false;
#endif

// ---- fibers -------------------------------------------------------------------

constexpr unsigned MAX_THREADS = 1024;
#ifdef KVD_EMU_ASAN
constexpr size_t STACK_BYTES = 512u << 10;
#else
constexpr size_t STACK_BYTES = 256u << 10;
#endif
constexpr size_t STATIC_SMEM_MAX = 48u << 10;

void fiber_main();

#if defined(__x86_64__)
// Saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save, switches to `to`.
extern "C" void kvd_emu_ctx_switch(void **save, void *to);
extern "C" void kvd_emu_ctx_start();
asm(".text\n"
    ".globl kvd_emu_ctx_switch\n"
    ".type kvd_emu_ctx_switch,@function\n"
    "kvd_emu_ctx_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size kvd_emu_ctx_switch, .-kvd_emu_ctx_switch\n"
    ".globl kvd_emu_ctx_start\n"
    ".type kvd_emu_ctx_start,@function\n"
    "kvd_emu_ctx_start:\n"
    "  callq *%r12\n"
    "  ud2\n"
    ".size kvd_emu_ctx_start, .-kvd_emu_ctx_start\n");

struct fiber_ctx {
    void *sp;
};
void ctx_init(fiber_ctx *c, char *lo, size_t size)
{
    uintptr_t top = ((uintptr_t)lo + size) & ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)(top - 16); // after `ret` into ctx_start: 16-aligned
    *--sp = (uint64_t)(uintptr_t)kvd_emu_ctx_start;
    *--sp = 0;                               // rbp
    *--sp = 0;                               // rbx
    *--sp = (uint64_t)(uintptr_t)fiber_main; // r12
    *--sp = 0;                               // r13
    *--sp = 0;                               // r14
    *--sp = 0;                               // r15
    *--sp = 0x037f00001f80ull;               // MXCSR (low), x87 control word (high)
    c->sp = sp;
}
void ctx_switch(fiber_ctx *from, fiber_ctx *to)
{
    kvd_emu_ctx_switch(&from->sp, to->sp);
}
#else
struct fiber_ctx {
    ucontext_t uc;
};
void ctx_init(fiber_ctx *c, char *lo, size_t size)
{
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = lo;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, fiber_main, 0);
}
void ctx_switch(fiber_ctx *from, fiber_ctx *to)
{
    swapcontext(&from->uc, &to->uc);
}
#endif

// Stacks for 1024 fibers, reserved once per host thread that launches, each
// with a guard page below it.
struct stack_pool {
    char *base = nullptr;
    size_t each = 0;
    ~stack_pool()
    {
        if (base)
            munmap(base, each * MAX_THREADS);
    }
    char *get(unsigned i)
    {
        if (!base) {
            size_t page = (size_t)sysconf(_SC_PAGESIZE);
            each = STACK_BYTES + page;
            void *p = mmap(nullptr, each * MAX_THREADS, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) {
                fprintf(stderr, "kvd-emu: cannot reserve fiber stacks: %s\n", strerror(errno));
                abort();
            }
            base = (char *)p;
            for (unsigned k = 0; k < MAX_THREADS; k++)
                mprotect(base + k * each, page, PROT_NONE);
        }
        return base + i * each + (each - STACK_BYTES);
    }
};

// ---- blocks -----------------------------------------------------------------

enum tstate { T_RUN, T_BARRIER, T_WARP, T_DONE };

struct sim_thread {
    kvd_emu_thread_view view;
    fiber_ctx ctx;
    char *stack_lo;
    tstate state;
    unsigned tid, warp, lane;
    const char *file; // where it waits (barrier or warp op)
    int line;
    int wkind, warg, wwidth;
    unsigned wmask;
    uint64_t wval, wres;
    void *asan_fake;
    bool pdl_waited; // passed cudaGridDependencySynchronize
};

// Shadow of one 4-byte word of shared memory for the racecheck (kernels
// share shared memory in words: two threads writing different bytes of one
// word would be reported).
struct shadow_cell {
    uint32_t w_ep, r_ep; // barrier interval of the last write / reads
    uint16_t w_tid, r_tid;
    uint16_t w_wgen; // the writer's warp's __syncwarp count at the write
    uint16_t r_warp; // the readers' warp in r_ep (WARP_MANY: more than one warp)
    uint16_t r_wgen; // that warp's __syncwarp count at the latest read
    uint8_t r_multi; // read by more than one thread in r_ep
    uint8_t pad;
};
constexpr uint16_t TID_ATOMIC = 0xffff;
constexpr uint16_t WARP_MANY = 0xffff;

struct store_rec {
    uintptr_t addr;
    size_t bytes;
    size_t off; // into the undo bytes
};

struct launch_state {
    const char *kernel;
    const kvd_emu_call *call;
    dim3 grid, block;
    unsigned n_threads, n_warps;
    uint64_t id;
    order_kind order;
    std::mt19937_64 rng;
    // the running block
    std::vector<sim_thread> *threads;
    sim_thread *cur = nullptr;
    fiber_ctx sched;
    void *sched_fake = nullptr;
    const void *sched_stack_lo = nullptr;
    size_t sched_stack_size = 0;
    std::vector<uint16_t> warp_gen;
    uint32_t ep0 = 0; // first barrier interval of the running block
    bool block_failed = false;
    // shared memory: static [0, static_used) then dynamic [STATIC_SMEM_MAX, +dyn)
    char *smem;
    size_t static_used = 0, dyn_bytes = 0;
    // programmatic dependent launch: this launch's global stores, and
    // those of the kernel before it (sorted, merged) when this one is PDL
    bool pdl = false;
    std::vector<store_rec> writes;
    bool writes_overflow = false;      // too many to keep: the next launch is not checked
    unsigned long long load_bytes = 0; // global loads of its threads (count_loads)
    const std::vector<store_rec> *prev_writes = nullptr;
    // findings
    unsigned reports = 0;
    bool log_stores = false;
    std::vector<store_rec> log;
    std::vector<unsigned char> undo;
    bool log_overflow = false;
};

struct thread_state {
    stack_pool stacks;
    std::vector<sim_thread> threads;
    std::vector<char> smem;          // STATIC_SMEM_MAX + the largest dynamic size
    std::vector<shadow_cell> shadow; // one per byte of smem
    uint32_t epoch = 1;
    launch_state *run = nullptr;
    uint64_t cached_gen = ~0ull;
    alloc_info cached{};
};
thread_local thread_state tls;
uint64_t launch_counter;
// The global stores of the last kernel launched, when nothing but kernels
// ran since (a PDL launch's prologue may overlap it); under the device lock.
std::vector<store_rec> g_prev_writes;
bool g_prev_valid;

// Sorted, with overlapping and adjacent ranges merged.
void merge_ranges(std::vector<store_rec> &v)
{
    std::sort(v.begin(), v.end(),
              [](const store_rec &a, const store_rec &b) { return a.addr < b.addr; });
    size_t o = 0;
    for (size_t i = 0; i < v.size(); i++) {
        if (o && v[i].addr <= v[o - 1].addr + v[o - 1].bytes) {
            uintptr_t end = std::max(v[o - 1].addr + v[o - 1].bytes, v[i].addr + v[i].bytes);
            v[o - 1].bytes = end - v[o - 1].addr;
        } else {
            v[o++] = v[i];
        }
    }
    v.resize(o);
}

bool overlaps(const std::vector<store_rec> &v, uintptr_t a, size_t n)
{
    auto it = std::upper_bound(v.begin(), v.end(), a,
                               [](uintptr_t x, const store_rec &r) { return x < r.addr; });
    if (it != v.begin() && std::prev(it)->addr + std::prev(it)->bytes > a)
        return true;
    return it != v.end() && it->addr < a + n;
}

constexpr unsigned MAX_REPORTS_PER_LAUNCH = 8;
constexpr size_t MAX_WRITE_RECS = (size_t)1 << 22;
constexpr size_t MAX_UNDO_BYTES = (size_t)1 << 30;

#define KREPORT(L, ...)                                                                            \
    do {                                                                                           \
        if ((L)->reports++ < MAX_REPORTS_PER_LAUNCH)                                               \
            report(__VA_ARGS__);                                                                   \
    } while (0)

const char *where(const sim_thread *t, char *buf, size_t len)
{
    snprintf(buf, len, "block (%u,%u,%u) thread (%u,%u,%u)", t->view.block_idx.x,
             t->view.block_idx.y, t->view.block_idx.z, t->view.thread_idx.x, t->view.thread_idx.y,
             t->view.thread_idx.z);
    return buf;
}

void asan_enter_fiber(launch_state *L, sim_thread *t)
{
#ifdef KVD_EMU_ASAN
    __sanitizer_start_switch_fiber(&L->sched_fake, t->stack_lo, STACK_BYTES);
#else
    (void)L;
    (void)t;
#endif
}
void asan_back_in_scheduler(launch_state *L)
{
#ifdef KVD_EMU_ASAN
    __sanitizer_finish_switch_fiber(L->sched_fake, nullptr, nullptr);
#else
    (void)L;
#endif
}
void asan_in_fiber(launch_state *L, sim_thread *t)
{
#ifdef KVD_EMU_ASAN
    __sanitizer_finish_switch_fiber(t->asan_fake, &L->sched_stack_lo, &L->sched_stack_size);
#else
    (void)L;
    (void)t;
#endif
}
void asan_leave_fiber(launch_state *L, sim_thread *t, bool exiting)
{
#ifdef KVD_EMU_ASAN
    __sanitizer_start_switch_fiber(exiting ? nullptr : &t->asan_fake, L->sched_stack_lo,
                                   L->sched_stack_size);
#else
    (void)L;
    (void)t;
    (void)exiting;
#endif
}

void resume(launch_state *L, sim_thread *t)
{
    L->cur = t;
    kvd_emu_view = &t->view;
    asan_enter_fiber(L, t);
    ctx_switch(&L->sched, &t->ctx);
    asan_back_in_scheduler(L);
    L->cur = nullptr;
    kvd_emu_view = nullptr;
}

// Back to the scheduler; returns when the scheduler resumes this thread.
void yield(launch_state *L, sim_thread *t)
{
    asan_leave_fiber(L, t, false);
    ctx_switch(&t->ctx, &L->sched);
    asan_in_fiber(L, t);
}

void fiber_main()
{
    launch_state *L = tls.run;
    sim_thread *t = L->cur;
    asan_in_fiber(L, t);
    L->call->run(L->call);
    t->state = T_DONE;
    asan_leave_fiber(L, t, true);
    ctx_switch(&t->ctx, &L->sched);
    abort(); // a finished fiber is never resumed
}

// ---- warp operations ----------------------------------------------------------

bool pow2(int w)
{
    return w > 0 && w <= 32 && (w & (w - 1)) == 0;
}

// The lane whose value `lane` receives, or -1 for its own value.
int shfl_source(const sim_thread *t)
{
    int lane = (int)t->lane, w = t->wwidth, seg = lane & ~(w - 1);
    switch (t->wkind) {
    case KVD_EMU_SHFL:
        return seg + (t->warg & (w - 1));
    case KVD_EMU_SHFL_XOR: {
        int s = lane ^ t->warg;
        return s >= seg + w ? -1 : s;
    }
    case KVD_EMU_SHFL_UP: {
        int s = lane - t->warg;
        return s < seg ? -1 : s;
    }
    case KVD_EMU_SHFL_DOWN: {
        int s = lane + t->warg;
        return s >= seg + w ? -1 : s;
    }
    default:
        return -1;
    }
}

const char *warp_op_name(int kind)
{
    switch (kind) {
    case KVD_EMU_SHFL:
        return "__shfl_sync";
    case KVD_EMU_SHFL_XOR:
        return "__shfl_xor_sync";
    case KVD_EMU_SHFL_UP:
        return "__shfl_up_sync";
    case KVD_EMU_SHFL_DOWN:
        return "__shfl_down_sync";
    case KVD_EMU_SYNCWARP:
        return "__syncwarp";
    case KVD_EMU_COLLECTIVE:
        return "a warp-wide matrix instruction (mma/ldmatrix)";
    default:
        return "__ballot_sync";
    }
}

// Completes a warp-wide instruction (kvd_simt_mma.h) once every lane of
// warp w is at it: the 32 lanes must be at the same instruction (source
// line and function), as PTX's .aligned requires.
bool run_collective(launch_state *L, unsigned w, const sim_thread *lead)
{
    std::vector<sim_thread> &th = *L->threads;
    const unsigned first = w * 32, n = std::min(32u, L->n_threads - first);
    for (unsigned i = 0; i < n; i++)
        if (th[first + i].state == T_RUN || th[first + i].state == T_BARRIER)
            return false; // not there yet, or a deadlock the scheduler reports
    const kvd_emu_collective *lc = (const kvd_emu_collective *)(uintptr_t)lead->wval;
    kvd_emu_collective *lanes[32];
    bool ok = n == 32;
    char buf[96];
    if (!ok)
        KREPORT(L, "%s: the warp-wide instruction at %s:%d needs 32 lanes; warp %u has %u",
                L->kernel, lead->file, lead->line, w, n);
    for (unsigned i = 0; ok && i < 32; i++) {
        sim_thread &o = th[first + i];
        lanes[i] = (kvd_emu_collective *)(uintptr_t)o.wval;
        if (o.state != T_WARP || o.wkind != KVD_EMU_COLLECTIVE || o.line != lead->line ||
            strcmp(o.file, lead->file) || lanes[i]->fn != lc->fn) {
            KREPORT(L,
                    "%s: lane %u of warp %u is not at the warp-wide instruction at %s:%d (%s): "
                    "every lane must execute the same one",
                    L->kernel, i, w, lead->file, lead->line,
                    o.state == T_DONE ? "it exited" : where(&o, buf, sizeof buf));
            ok = false;
        }
    }
    if (ok)
        lc->fn(lanes);
    for (unsigned i = 0; i < n; i++)
        if (th[first + i].state == T_WARP) {
            th[first + i].wres = 0;
            th[first + i].state = T_RUN;
        }
    return true;
}

// Completes the warp operation lanes of warp w wait at, when every lane of
// its mask has arrived. Returns whether it completed one.
bool try_warp(launch_state *L, unsigned w)
{
    std::vector<sim_thread> &th = *L->threads;
    unsigned first = w * 32, n = std::min(32u, L->n_threads - first);
    sim_thread *lead = nullptr, *coll = nullptr;
    for (unsigned i = 0; i < n && !lead; i++)
        if (th[first + i].state == T_WARP) {
            if (th[first + i].wkind != KVD_EMU_COLLECTIVE)
                lead = &th[first + i];
            else if (!coll)
                coll = &th[first + i];
        }
    if (!lead)
        return coll && run_collective(L, w, coll);
    unsigned mask = lead->wmask;
    char buf[96];
    for (unsigned i = 0; i < 32; i++) {
        if (!(mask >> i & 1))
            continue;
        if (i >= n) {
            KREPORT(L,
                    "%s: %s at %s:%d: mask 0x%08x names lane %u, which does not exist "
                    "(blocks of %u threads)",
                    L->kernel, warp_op_name(lead->wkind), lead->file, lead->line, mask, i,
                    L->n_threads);
            mask &= ~(1u << i);
            continue;
        }
        sim_thread &o = th[first + i];
        if (o.state == T_RUN)
            return false; // not there yet
        if (o.state == T_DONE) {
            KREPORT(L, "%s: %s at %s:%d (%s): lane %u of the mask exited without joining it",
                    L->kernel, warp_op_name(lead->wkind), lead->file, lead->line,
                    where(lead, buf, sizeof buf), i);
            mask &= ~(1u << i);
            continue;
        }
        if (o.state == T_BARRIER)
            return false; // a deadlock, found by the scheduler
        if (o.wkind == KVD_EMU_COLLECTIVE) {
            KREPORT(
                L, "%s: %s at %s:%d: lane %u of its mask waits at a warp-wide instruction (%s:%d)",
                L->kernel, warp_op_name(lead->wkind), lead->file, lead->line, i, o.file, o.line);
            mask &= ~(1u << i);
            continue;
        }
        if (o.wmask != lead->wmask) {
            KREPORT(L,
                    "%s: lanes of warp %u disagree on the mask: 0x%08x at %s:%d, 0x%08x at %s:%d",
                    L->kernel, w, lead->wmask, lead->file, lead->line, o.wmask, o.file, o.line);
        }
    }
    uint64_t ballot = 0;
    for (unsigned i = 0; i < n; i++) {
        sim_thread &o = th[first + i];
        if ((mask >> i & 1) && o.state == T_WARP && o.wkind == KVD_EMU_BALLOT && (o.wval & 1))
            ballot |= 1ull << i;
    }
    bool syncwarp = false;
    for (unsigned i = 0; i < n; i++) {
        sim_thread &o = th[first + i];
        if (!(mask >> i & 1) || o.state != T_WARP)
            continue;
        if (o.wkind == KVD_EMU_BALLOT) {
            o.wres = ballot;
        } else if (o.wkind == KVD_EMU_SYNCWARP) {
            syncwarp = true;
            o.wres = 0;
        } else {
            int s = shfl_source(&o);
            if (s < 0) {
                o.wres = o.wval;
            } else if (!(mask >> s & 1) || th[first + (unsigned)s].state != T_WARP) {
                KREPORT(L, "%s: %s at %s:%d (%s) reads lane %d, outside the mask 0x%08x", L->kernel,
                        warp_op_name(o.wkind), o.file, o.line, where(&o, buf, sizeof buf), s, mask);
                o.wres = o.wval;
            } else {
                o.wres = th[first + (unsigned)s].wval;
            }
        }
    }
    for (unsigned i = 0; i < n; i++)
        if ((mask >> i & 1) && th[first + i].state == T_WARP)
            th[first + i].state = T_RUN;
    if (syncwarp)
        L->warp_gen[w]++;
    return true;
}

// ---- one block ------------------------------------------------------------------

std::vector<unsigned> make_order(unsigned n, order_kind k, std::mt19937_64 &rng)
{
    std::vector<unsigned> v(n);
    for (unsigned i = 0; i < n; i++)
        v[i] = k == ORDER_REVERSE ? n - 1 - i : i;
    if (k == ORDER_RANDOM)
        std::shuffle(v.begin(), v.end(), rng);
    return v;
}

void describe_stuck(launch_state *L)
{
    std::vector<sim_thread> &th = *L->threads;
    unsigned at_barrier = 0, at_warp = 0, done = 0;
    const sim_thread *b = nullptr, *w = nullptr;
    for (unsigned i = 0; i < L->n_threads; i++) {
        const sim_thread &t = th[i];
        if (t.state == T_BARRIER) {
            at_barrier++;
            b = &t;
        } else if (t.state == T_WARP) {
            at_warp++;
            w = &t;
        } else if (t.state == T_DONE) {
            done++;
        }
    }
    KREPORT(L,
            "%s: block (%u,%u,%u) deadlocks: %u threads at __syncthreads (%s:%d), %u at a warp "
            "operation (%s:%d), %u exited",
            L->kernel, th[0].view.block_idx.x, th[0].view.block_idx.y, th[0].view.block_idx.z,
            at_barrier, b ? b->file : "-", b ? b->line : 0, at_warp, w ? w->file : "-",
            w ? w->line : 0, done);
}

void run_block(launch_state *L, uint3 bidx)
{
    std::vector<sim_thread> &th = *L->threads;
    const dim3 bd = L->block;
    for (unsigned i = 0; i < L->n_threads; i++) {
        sim_thread &t = th[i];
        t.view.thread_idx = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
        t.view.block_idx = bidx;
        t.view.block_dim = bd;
        t.view.grid_dim = L->grid;
        t.state = T_RUN;
        t.tid = i;
        t.warp = i / 32;
        t.lane = i % 32;
        t.asan_fake = nullptr;
        t.pdl_waited = false;
        t.stack_lo = tls.stacks.get(i);
        ctx_init(&t.ctx, t.stack_lo, STACK_BYTES);
    }
    // Fresh, poisoned shared memory (0xff bytes: NaN floats, -1 integers).
    memset(L->smem, 0xff, L->static_used);
    if (L->dyn_bytes)
        memset(L->smem + STATIC_SMEM_MAX, 0xff, L->dyn_bytes);
    L->ep0 = ++tls.epoch;
    std::fill(L->warp_gen.begin(), L->warp_gen.end(), 0);
    L->block_failed = false;

    std::vector<unsigned> warps = make_order(L->n_warps, L->order, L->rng);
    std::vector<std::vector<unsigned>> lanes(L->n_warps);
    for (unsigned w = 0; w < L->n_warps; w++)
        lanes[w] = make_order(std::min(32u, L->n_threads - w * 32), L->order, L->rng);

    char buf[96];
    for (;;) {
        bool progress = false;
        for (unsigned w : warps) {
            for (bool again = true; again;) {
                again = false;
                for (unsigned l : lanes[w]) {
                    sim_thread &t = th[w * 32 + l];
                    if (t.state != T_RUN)
                        continue;
                    resume(L, &t);
                    again = progress = true;
                }
                if (try_warp(L, w))
                    again = progress = true;
            }
        }
        unsigned done = 0, barrier = 0;
        const sim_thread *b0 = nullptr;
        for (unsigned i = 0; i < L->n_threads; i++) {
            const sim_thread &t = th[i];
            if (t.state == T_DONE)
                done++;
            else if (t.state == T_BARRIER && barrier++ == 0)
                b0 = &t;
        }
        if (done == L->n_threads)
            return;
        if (done + barrier == L->n_threads) {
            if (done)
                KREPORT(L,
                        "%s: __syncthreads at %s:%d reached by %u of the %u threads of block "
                        "(%u,%u,%u); the others exited (divergent barrier)",
                        L->kernel, b0->file, b0->line, barrier, L->n_threads, bidx.x, bidx.y,
                        bidx.z);
            for (unsigned i = 0; i < L->n_threads; i++) {
                const sim_thread &t = th[i];
                if (t.state != T_BARRIER)
                    continue;
                if (t.line != b0->line || strcmp(t.file, b0->file)) {
                    KREPORT(L,
                            "%s: threads of one block wait at different barriers: %s:%d (%s) "
                            "and %s:%d",
                            L->kernel, t.file, t.line, where(&t, buf, sizeof buf), b0->file,
                            b0->line);
                    break;
                }
            }
            ++tls.epoch;
            for (unsigned i = 0; i < L->n_threads; i++)
                if (th[i].state == T_BARRIER)
                    th[i].state = T_RUN;
            continue;
        }
        if (!progress) {
            describe_stuck(L);
            L->block_failed = true;
            return; // the fibers are abandoned; their stacks are reused
        }
    }
}

void run_grid(launch_state *L, order_kind order)
{
    L->order = order;
    L->rng.seed(cfg().seed * 0x9e3779b97f4a7c15ull + L->id);
    size_t nb = (size_t)L->grid.x * L->grid.y * L->grid.z;
    std::vector<size_t> blocks(nb);
    for (size_t i = 0; i < nb; i++)
        blocks[i] = order == ORDER_REVERSE ? nb - 1 - i : i;
    if (order == ORDER_RANDOM)
        std::shuffle(blocks.begin(), blocks.end(), L->rng);
    for (size_t b : blocks) {
        uint3 bidx{(unsigned)(b % L->grid.x), (unsigned)(b / L->grid.x % L->grid.y),
                   (unsigned)(b / ((size_t)L->grid.x * L->grid.y))};
        run_block(L, bidx);
    }
}

// ---- the order check ------------------------------------------------------------

void undo_log(launch_state *L)
{
    for (size_t i = L->log.size(); i-- > 0;)
        memcpy((void *)L->log[i].addr, &L->undo[L->log[i].off], L->log[i].bytes);
}

struct written {
    std::vector<store_rec> log;
    std::vector<unsigned char> final_bytes;
};

written capture_final(launch_state *L)
{
    written w;
    w.log = L->log;
    size_t total = 0;
    for (const store_rec &r : L->log)
        total += r.bytes;
    w.final_bytes.resize(total);
    size_t off = 0;
    for (store_rec &r : w.log) {
        memcpy(&w.final_bytes[off], (const void *)r.addr, r.bytes);
        r.off = off;
        off += r.bytes;
    }
    return w;
}

void compare_runs(launch_state *L, const written &first, const char *order_name)
{
    char where_buf[160];
    for (const store_rec &r : first.log) {
        if (memcmp((const void *)r.addr, &first.final_bytes[r.off], r.bytes)) {
            describe((const void *)r.addr, where_buf, sizeof where_buf);
            KREPORT(L,
                    "%s: the %s thread order leaves different bytes than the forward order "
                    "at %s (a race, or order-dependent arithmetic)",
                    L->kernel, order_name, where_buf);
            return;
        }
    }
    std::unordered_set<uintptr_t> a;
    for (const store_rec &r : first.log)
        a.insert(r.addr);
    for (const store_rec &r : L->log) {
        if (!a.count(r.addr)) {
            describe((const void *)r.addr, where_buf, sizeof where_buf);
            KREPORT(L, "%s: the %s thread order writes %s, which the forward order does not",
                    L->kernel, order_name, where_buf);
            return;
        }
    }
}

void start_log(launch_state *L)
{
    L->log.clear();
    L->undo.clear();
    L->log_overflow = false;
    L->log_stores = true;
}

void log_store(launch_state *L, uintptr_t a, size_t n)
{
    if (L->undo.size() + n > MAX_UNDO_BYTES) {
        L->log_overflow = true;
        return;
    }
    size_t off = L->undo.size();
    L->undo.resize(off + n);
    memcpy(&L->undo[off], (const void *)a, n);
    L->log.push_back(store_rec{a, n, off});
}

// ---- shared memory checks --------------------------------------------------------

void shared_access(launch_state *L, sim_thread *t, size_t off, size_t n, bool store, bool atomic)
{
    char buf[96];
    size_t limit = off >= STATIC_SMEM_MAX ? STATIC_SMEM_MAX + L->dyn_bytes : L->static_used;
    if (off + n > limit) {
        KREPORT(L, "%s: %s (%s): %s of %zu bytes at shared offset %zu, past the %zu bytes declared",
                L->kernel, t->file ? t->file : "kernel", where(t, buf, sizeof buf),
                store ? "write" : "read", n, off >= STATIC_SMEM_MAX ? off - STATIC_SMEM_MAX : off,
                off >= STATIC_SMEM_MAX ? L->dyn_bytes : L->static_used);
        return;
    }
    const uint32_t ep = tls.epoch;
    const uint16_t tid = atomic ? TID_ATOMIC : (uint16_t)t->tid;
    const uint16_t wgen = L->warp_gen[t->warp];
    for (size_t wi = off / 4; wi <= (off + n - 1) / 4; wi++) {
        shadow_cell &c = tls.shadow[wi];
        const size_t at = wi * 4; // the word's offset, for reports
        // A write by another lane of this warp before a __syncwarp both
        // have passed is ordered.
        bool w_other = c.w_ep == ep && c.w_tid != tid &&
                       !(c.w_tid != TID_ATOMIC && c.w_tid / 32 == t->warp && c.w_wgen != wgen);
        if (!store && !atomic) {
            if (c.w_ep < L->ep0) {
                KREPORT(L,
                        "%s: %s reads shared memory (offset %zu) that no thread of its block "
                        "wrote",
                        L->kernel, where(t, buf, sizeof buf), at);
                return;
            }
            if (w_other || (c.w_ep == ep && c.w_tid == TID_ATOMIC)) {
                KREPORT(L,
                        "%s: shared-memory race: %s reads offset %zu, written by thread %d "
                        "since the last barrier",
                        L->kernel, where(t, buf, sizeof buf), at,
                        c.w_tid == TID_ATOMIC ? -1 : (int)c.w_tid);
                return;
            }
            if (c.r_ep != ep) {
                c.r_ep = ep;
                c.r_tid = tid;
                c.r_multi = 0;
                c.r_warp = (uint16_t)t->warp;
            } else {
                if (c.r_tid != tid)
                    c.r_multi = 1;
                if (c.r_warp != t->warp)
                    c.r_warp = WARP_MANY;
            }
            c.r_wgen = wgen;
            continue;
        }
        bool atomics_only = atomic && c.w_ep == ep && c.w_tid == TID_ATOMIC;
        // Reads by lanes of this warp before a __syncwarp this lane has
        // passed too are ordered before the write.
        bool r_synced = c.r_warp == t->warp && c.r_wgen != wgen;
        if ((w_other && !atomics_only) ||
            (c.r_ep == ep && !r_synced && (c.r_tid != tid || c.r_multi || atomic))) {
            KREPORT(L,
                    "%s: shared-memory race: %s %s offset %zu, %s by another thread since "
                    "the last barrier",
                    L->kernel, where(t, buf, sizeof buf), atomic ? "atomically updates" : "writes",
                    at, w_other ? "written" : "read");
            return;
        }
        c.w_ep = ep;
        c.w_tid = tid;
        c.w_wgen = wgen;
    }
}

// Every load and store of the instrumented kernels comes here.
inline void access(const void *p, size_t n, bool store)
{
    launch_state *L = tls.run;
    if (!L || !L->cur)
        return; // host code of kernels/*.cu, or no kernel running
    sim_thread *t = L->cur;
    uintptr_t a = (uintptr_t)p;
    if (a - (uintptr_t)t->stack_lo < STACK_BYTES)
        return; // the thread's own locals
    uintptr_t s = (uintptr_t)L->smem;
    if (a - s < STATIC_SMEM_MAX + L->dyn_bytes) {
        shared_access(L, t, a - s, n, store, false);
        return;
    }
    char buf[96], wbuf[160];
    if (a - (uintptr_t)L->call < L->call->bytes) {
        if (store)
            KREPORT(L, "%s: %s writes the launch's parameters", L->kernel,
                    where(t, buf, sizeof buf));
        return;
    }
    uint64_t gen = alloc_generation();
    if (!(gen == tls.cached_gen && a >= tls.cached.base &&
          a + n <= tls.cached.base + tls.cached.bytes)) {
        alloc_info ai = find_alloc(p, n);
        if (ai.kind == ALLOC_NONE) {
            describe(p, wbuf, sizeof wbuf);
            KREPORT(L, "%s: %s: invalid global %s of %zu bytes at %p: %s", L->kernel,
                    where(t, buf, sizeof buf), store ? "write" : "read", n, p, wbuf);
            return;
        }
        if (ai.kind == ALLOC_HOST) {
            KREPORT(L,
                    "%s: %s: %s of pinned host memory at %p (kvd kernels use device memory "
                    "only)",
                    L->kernel, where(t, buf, sizeof buf), store ? "write" : "read", p);
            return;
        }
        if (ai.vmm)
            vmm_touch(p, n); // once per launch and mapping: the cache is reset per launch
        tls.cached = ai;
        tls.cached_gen = gen;
    }
    if (!store)
        L->load_bytes += n;
    if (L->pdl && !t->pdl_waited) {
        if (store)
            KREPORT(L,
                    "%s: %s writes global memory at %p before cudaGridDependencySynchronize "
                    "(launched with programmatic dependent launch, it may run while the kernel "
                    "before it does)",
                    L->kernel, where(t, buf, sizeof buf), p);
        else
            count_prewait_load(n);
        if (!store && L->prev_writes && overlaps(*L->prev_writes, a, n))
            KREPORT(L,
                    "%s: %s reads %zu bytes at %p, which the kernel before it writes, before "
                    "cudaGridDependencySynchronize (a premature read)",
                    L->kernel, where(t, buf, sizeof buf), n, p);
    }
    if (store) {
        if (L->writes.size() < MAX_WRITE_RECS)
            L->writes.push_back(store_rec{a, n, 0});
        else
            L->writes_overflow = true;
        if (L->log_stores)
            log_store(L, a, n);
    }
}

} // namespace

// ---- the launch ---------------------------------------------------------------

void note_device_op()
{
    g_prev_valid = false;
}

cudaError_t run_launch(const char *name, const void *fn, dim3 grid, dim3 block, size_t smem,
                       const kvd_emu_call *call, bool pdl)
{
    count_launch();
    unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
    if (!nt || nt > MAX_THREADS || block.z > 64 || !grid.x || !grid.y || !grid.z ||
        grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        report("%s: invalid launch configuration: grid (%u,%u,%u), block (%u,%u,%u)", name, grid.x,
               grid.y, grid.z, block.x, block.y, block.z);
        return cudaErrorInvalidConfiguration;
    }
    if (smem > STATIC_SMEM_MAX && (size_t)func_max_dyn_smem(fn) < smem) {
        report("%s: %zu bytes of dynamic shared memory without cudaFuncSetAttribute("
               "cudaFuncAttributeMaxDynamicSharedMemorySize) of at least that",
               name, smem);
        return cudaErrorInvalidValue;
    }
    if (smem > smem_optin_max()) {
        report("%s: %zu bytes of dynamic shared memory; this device allows %zu", name, smem,
               smem_optin_max());
        return cudaErrorInvalidValue;
    }
    if (tls.run) {
        report("%s: launched from inside a kernel (dynamic parallelism is not supported)", name);
        return cudaErrorLaunchFailure;
    }
    launch_state L;
    L.kernel = name;
    L.call = call;
    L.grid = grid;
    L.block = block;
    L.n_threads = (unsigned)nt;
    L.n_warps = (L.n_threads + 31) / 32;
    L.id = __atomic_add_fetch(&launch_counter, 1, __ATOMIC_RELAXED);
    L.warp_gen.assign(L.n_warps, 0);
    L.threads = &tls.threads;
    tls.threads.resize(MAX_THREADS);
    if (tls.smem.size() < STATIC_SMEM_MAX + smem) {
        tls.smem.resize(STATIC_SMEM_MAX + smem);
        tls.shadow.resize((STATIC_SMEM_MAX + smem) / 4 + 1);
    }
    if (tls.epoch > 0xf0000000u) { // the shadow's intervals would wrap: start over
        std::fill(tls.shadow.begin(), tls.shadow.end(), shadow_cell{});
        tls.epoch = 1;
    }
    L.smem = tls.smem.data();
    L.dyn_bytes = smem;
    int cc_major, cc_minor;
    device_cc(&cc_major, &cc_minor);
    L.pdl = pdl && cc_major >= 9; // the attribute is only set on sm_90 and later
    L.prev_writes = L.pdl && g_prev_valid ? &g_prev_writes : nullptr;
    unsigned before = 0;
    tls.run = &L;
    tls.cached_gen = 0; // look every allocation up again: VMM touches are per launch

    if (cfg().order_check && have_memcheck) {
        start_log(&L);
        run_grid(&L, ORDER_FORWARD);
        written first = capture_final(&L);
        bool ok = !L.log_overflow && !L.reports;
        for (order_kind o : {ORDER_REVERSE, ORDER_RANDOM}) {
            if (!ok)
                break;
            undo_log(&L);
            start_log(&L);
            run_grid(&L, o);
            before = L.reports;
            compare_runs(&L, first, o == ORDER_REVERSE ? "reverse" : "random");
            ok = L.reports == before && !L.log_overflow;
        }
    } else {
        run_grid(&L, cfg().order);
    }
    L.log_stores = false;
    tls.run = nullptr;
    count_loads(L.load_bytes);
    if (have_memcheck) { // what the next kernel's prologue must not read
        merge_ranges(L.writes);
        g_prev_writes.swap(L.writes);
        g_prev_valid = !L.writes_overflow;
    }
    return L.reports ? cudaErrorLaunchFailure : cudaSuccess;
}

} // namespace kvd_emu

using namespace kvd_emu;

extern "C" void kvd_emu_set_order_check(int on)
{
    std::lock_guard<std::recursive_mutex> dev(device_lock());
    cfg().order_check = on != 0;
}

// ---- the device-side entry points (kvd_simt.h) ----------------------------------

void kvd_emu_syncthreads(const char *file, int line)
{
    launch_state *L = tls.run;
    if (!L || !L->cur) {
        report("__syncthreads at %s:%d called outside a kernel", file, line);
        return;
    }
    sim_thread *t = L->cur;
    t->state = T_BARRIER;
    t->file = file;
    t->line = line;
    yield(L, t);
}

uint64_t kvd_emu_warp_op(int kind, unsigned mask, int arg, int width, uint64_t bits,
                         const char *file, int line)
{
    launch_state *L = tls.run;
    if (!L || !L->cur) {
        report("%s at %s:%d called outside a kernel", warp_op_name(kind), file, line);
        return bits;
    }
    sim_thread *t = L->cur;
    char buf[96];
    if (!(mask >> t->lane & 1))
        KREPORT(L, "%s: %s at %s:%d (%s): the mask 0x%08x leaves out the calling lane %u",
                L->kernel, warp_op_name(kind), file, line, where(t, buf, sizeof buf), mask,
                t->lane);
    if (!pow2(width)) {
        KREPORT(L, "%s: %s at %s:%d: width %d is not a power of two up to 32", L->kernel,
                warp_op_name(kind), file, line, width);
        width = 32;
    }
    t->state = T_WARP;
    t->wkind = kind;
    t->wmask = mask | (1u << t->lane);
    t->warg = arg;
    t->wwidth = width;
    t->wval = bits;
    t->file = file;
    t->line = line;
    yield(L, t);
    return t->wres;
}

void *kvd_emu_shared(kvd_emu_shared_key *key, size_t bytes, size_t align)
{
    launch_state *L = tls.run;
    if (!L) {
        report("shared memory declared outside a kernel");
        abort();
    }
    if (key->launch != L->id) {
        // First use in this launch: the next free offset. Later blocks of
        // the launch find the same one.
        size_t off = (L->static_used + align - 1) & ~(align - 1);
        if (off + bytes > STATIC_SMEM_MAX) {
            report("%s: %zu bytes of static shared memory (at most %zu)", L->kernel, off + bytes,
                   STATIC_SMEM_MAX);
            abort(); // nvcc refuses to compile this: a bug in kernels/, not input
        }
        memset(L->smem + off, 0xff, bytes);
        L->static_used = off + bytes;
        key->launch = L->id;
        key->offset = off;
    }
    return L->smem + key->offset;
}

void kvd_emu_device_fault(const char *what)
{
    launch_state *L = tls.run;
    if (!L || !L->cur) {
        report("%s (outside a kernel)", what);
        return;
    }
    char buf[96];
    KREPORT(L, "%s: %s: %s", L->kernel, where(L->cur, buf, sizeof buf), what);
}

bool kvd_emu_in_shared(const void *p, size_t n)
{
    launch_state *L = tls.run;
    if (!L)
        return false;
    uintptr_t a = (uintptr_t)p, s = (uintptr_t)L->smem;
    if (a - s >= STATIC_SMEM_MAX + L->dyn_bytes)
        return false;
    size_t off = a - s,
           limit = off >= STATIC_SMEM_MAX ? STATIC_SMEM_MAX + L->dyn_bytes : L->static_used;
    return off + n <= limit;
}

void *kvd_emu_dyn_shared()
{
    launch_state *L = tls.run;
    return L ? L->smem + STATIC_SMEM_MAX : nullptr;
}

void kvd_emu_note_atomic(const void *p, size_t bytes)
{
    launch_state *L = tls.run;
    if (!L || !L->cur)
        return;
    uintptr_t a = (uintptr_t)p, s = (uintptr_t)L->smem;
    if (a - s < STATIC_SMEM_MAX + L->dyn_bytes)
        shared_access(L, L->cur, a - s, bytes, true, true);
    else
        access(p, bytes, true);
}

cudaError_t kvd_emu_launch(const char *name, const void *fn, dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, kvd_emu_call *call, bool pdl)
{
    if (!call)
        return set_error(cudaErrorMemoryAllocation);
    // Shared by the submitted work (and any graph that records it).
    std::shared_ptr<kvd_emu_call> owned(call, [](kvd_emu_call *c) { c->destroy(c); });
    return set_error(submit(stream, [name, fn, grid, block, smem, owned, pdl]() {
        return run_launch(name, fn, grid, block, smem, owned.get(), pdl);
    }));
}

void kvd_emu_pdl_wait()
{
    launch_state *L = tls.run;
    if (L && L->cur)
        L->cur->pdl_waited = true;
}

void kvd_emu_pdl_trigger()
{
    launch_state *L = tls.run;
    if (!L || !L->cur || !L->pdl || L->cur->pdl_waited)
        return;
    char buf[96];
    KREPORT(L,
            "%s: %s triggers its dependents before cudaGridDependencySynchronize (their "
            "prologues could then overlap the kernel before this one)",
            L->kernel, where(L->cur, buf, sizeof buf));
}

// ---- the instrumentation hooks ---------------------------------------------------
#ifdef KVD_EMU_MEMCHECK
extern "C" {
#define KVD_EMU_HOOKS(n)                                                                           \
    void __kvd_emu_load##n##_noabort(void *p)                                                      \
    {                                                                                              \
        access(p, n, false);                                                                       \
    }                                                                                              \
    void __kvd_emu_store##n##_noabort(void *p)                                                     \
    {                                                                                              \
        access(p, n, true);                                                                        \
    }
KVD_EMU_HOOKS(1)
KVD_EMU_HOOKS(2)
KVD_EMU_HOOKS(4)
KVD_EMU_HOOKS(8)
KVD_EMU_HOOKS(16)
void __kvd_emu_loadN_noabort(void *p, size_t n)
{
    access(p, n, false);
}
void __kvd_emu_storeN_noabort(void *p, size_t n)
{
    access(p, n, true);
}
// The instrumentation calls this before every noreturn call; in an ASan
// build the sanitizer runtime has it (and must: it unpoisons the stack),
// also where this file is built without ASan (KVD_EMU_ASAN_RUNTIME).
#if !defined(KVD_EMU_ASAN) && !defined(KVD_EMU_ASAN_RUNTIME)
void __asan_handle_no_return(void) {}
#endif
}
#endif
