// The CUDA runtime of the emulation build (include/cuda_runtime.h): device
// memory from the C allocator, registered so kernels and copies can be
// checked against it; synchronous streams and events; graph capture that
// records a stream's work and replays it with the same arguments; the
// capture rules of the real runtime (unsafe calls during a ThreadLocal or
// Global capture invalidate it, a stream joined through an event must be
// joined back). Misuse is reported (kvd_emu_errors) as well as returned.
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "emu_internal.h"

namespace kvd_emu
{
namespace
{

std::mutex g_mu;        // the registry, streams' capture state
std::mutex g_report_mu; // the reports (taken with or without g_mu held)
unsigned long g_errors;
char g_last_report[512];

struct alloc_rec {
    size_t bytes;
    alloc_kind kind;
    bool vmm;
    bool foreign; // registered (register_alloc), not this file's to free
};
std::map<uintptr_t, alloc_rec> g_allocs;
uint64_t g_alloc_gen = 1;
size_t g_device_used;
size_t g_device_total = (size_t)16 << 30;
std::map<const void *, int> g_func_smem;

thread_local cudaError_t tl_last = cudaSuccess;
thread_local work_mark tl_work = {nullptr, 0};

kvd_emu_counts g_counts; // under g_count_mu
std::mutex g_count_mu;
std::atomic<unsigned long long> g_prewait_bytes{0}; // count_prewait_load, lock-free
std::atomic<unsigned long long> g_mma_f16{0};       // count_mma_f16, lock-free
std::atomic<unsigned long long> g_load_bytes{0};    // count_loads, lock-free

struct capture;

} // namespace
} // namespace kvd_emu

struct CUstream_st {
    unsigned flags;
    std::shared_ptr<kvd_emu::capture> cap; // being captured into
    uint64_t seq;                          // operations run so far
    uint64_t synced;                       // of them, the host has waited for this many
};
struct CUevent_st {
    unsigned flags;
    bool recorded;
    double t_ms;
    std::shared_ptr<kvd_emu::capture> cap; // recorded inside a capture
    cudaStream_t stream;                   // where it was recorded
    uint64_t seq;                          // the stream's operations before it
};
struct CUgraph_st {
    std::vector<std::function<cudaError_t()>> nodes;
};
struct CUgraphExec_st {
    std::vector<std::function<cudaError_t()>> nodes;
};

namespace kvd_emu
{
namespace
{

struct capture {
    cudaStream_t origin;
    cudaStreamCaptureMode mode;
    std::thread::id owner;
    bool invalid = false;
    std::set<cudaStream_t> joined; // other streams pulled in, not yet joined back
    std::vector<std::function<cudaError_t()>> nodes;
};

// The capture the calling thread began (ThreadLocal or Global mode): it
// forbids "potentially unsafe" calls on this thread.
thread_local std::shared_ptr<capture> tl_capture;
int g_global_captures; // Global mode forbids them on every thread

double now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// The rule of the real runtime: while a capture in ThreadLocal or Global
// mode is under way, calls that may synchronize or allocate are refused
// and invalidate it.
cudaError_t unsafe_call(const char *api)
{
    std::shared_ptr<capture> c = tl_capture;
    bool global = false;
    {
        std::lock_guard<std::mutex> g(g_mu);
        global = g_global_captures > 0;
    }
    if (!c && !global)
        return cudaSuccess;
    if (c)
        c->invalid = true;
    report("%s called while a stream capture is under way: refused, and the capture is "
           "invalidated",
           api);
    return cudaErrorStreamCaptureUnsupported;
}

cudaError_t check_range(const void *p, size_t n, bool device, const char *api, const char *side)
{
    bool partial = false;
    alloc_info a = find_alloc(p, n, &partial);
    if (device && a.kind != ALLOC_DEVICE) {
        char buf[160];
        describe(p, buf, sizeof buf);
        report("%s: %s range [%p, +%zu) is not inside one device allocation (%s)", api, side, p, n,
               buf);
        return cudaErrorInvalidValue;
    }
    if (partial) {
        report("%s: %s range [%p, +%zu) runs past the end of its allocation", api, side, p, n);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

cudaError_t copy_checks(void *dst, const void *src, size_t n, cudaMemcpyKind kind, const char *api)
{
    if (!n)
        return cudaSuccess;
    if (!dst || !src) {
        report("%s: NULL pointer", api);
        return cudaErrorInvalidValue;
    }
    bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (kind == cudaMemcpyDefault) {
        dst_dev = find_alloc(dst, 1).kind == ALLOC_DEVICE;
        src_dev = find_alloc(src, 1).kind == ALLOC_DEVICE;
    } else if (kind != cudaMemcpyHostToHost && kind != cudaMemcpyHostToDevice &&
               kind != cudaMemcpyDeviceToHost && kind != cudaMemcpyDeviceToDevice) {
        report("%s: invalid copy kind %d", api, (int)kind);
        return cudaErrorInvalidValue;
    }
    cudaError_t e = check_range(dst, n, dst_dev, api, "destination");
    if (e == cudaSuccess)
        e = check_range(src, n, src_dev, api, "source");
    if (e == cudaSuccess && (char *)dst < (const char *)src + n &&
        (const char *)src < (char *)dst + n) {
        report("%s: source and destination overlap", api);
        e = cudaErrorInvalidValue;
    }
    return e;
}

cudaError_t do_alloc(void **p, size_t bytes, alloc_kind kind, const char *api)
{
    if (!p)
        return set_error(cudaErrorInvalidValue);
    *p = nullptr;
    cudaError_t e = unsafe_call(api);
    if (e != cudaSuccess)
        return set_error(e);
    if (!bytes)
        return cudaSuccess;     // the real runtime returns NULL for 0 bytes
    if (kind == ALLOC_DEVICE) { // reserved first, so racing threads cannot both fit
        std::lock_guard<std::mutex> g(g_mu);
        if (bytes > g_device_total || g_device_used > g_device_total - bytes)
            return set_error(cudaErrorMemoryAllocation);
        g_device_used += bytes;
    }
    void *m = nullptr;
    std::lock_guard<std::mutex> g(g_mu);
    if (posix_memalign(&m, 256, bytes)) {
        if (kind == ALLOC_DEVICE)
            g_device_used -= bytes;
        return set_error(cudaErrorMemoryAllocation);
    }
    g_allocs[(uintptr_t)m] = alloc_rec{bytes, kind, false, false};
    *p = m;
    return cudaSuccess;
}

cudaError_t do_free(void *p, alloc_kind kind, const char *api)
{
    if (!p)
        return cudaSuccess;
    cudaError_t e = unsafe_call(api);
    if (e != cudaSuccess)
        return set_error(e);
    std::lock_guard<std::recursive_mutex> dev(device_lock()); // waits for running work
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || it->second.kind != kind || it->second.foreign) {
        report("%s(%p): not a live %s allocation (double free, or the wrong free)", api, p,
               kind == ALLOC_DEVICE ? "device" : "pinned host");
        return set_error(cudaErrorInvalidValue);
    }
    if (kind == ALLOC_DEVICE)
        g_device_used -= it->second.bytes;
    g_allocs.erase(it);
    g_alloc_gen++;
    free(p);
    return cudaSuccess;
}

cudaStream_t legacy_stream()
{
    static CUstream_st s{0, nullptr, 0, 0};
    return &s;
}

std::set<cudaStream_t> g_streams; // created and not destroyed (under g_mu)

// Under g_mu: the host waited for everything stream s has run.
void synced_all(cudaStream_t s)
{
    s->synced = s->seq;
}

cudaStream_t resolve(cudaStream_t s)
{
    return s ? s : legacy_stream();
}

} // namespace

void report(const char *fmt, ...)
{
    char msg[sizeof g_last_report];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    unsigned long n;
    {
        std::lock_guard<std::mutex> g(g_report_mu);
        n = ++g_errors;
        memcpy(g_last_report, msg, sizeof msg);
    }
    if (n <= 200)
        fprintf(stderr, "kvd-emu: %s\n", msg);
    else if (n == 201)
        fprintf(stderr, "kvd-emu: further reports not printed\n");
    const char *a = getenv("KVD_EMU_ABORT");
    if (a && !strcmp(a, "1"))
        abort();
}

cudaError_t set_error(cudaError_t e)
{
    if (e != cudaSuccess)
        tl_last = e;
    return e;
}

std::recursive_mutex &device_lock()
{
    static std::recursive_mutex m;
    return m;
}

alloc_info find_alloc(const void *p, size_t n, bool *partial)
{
    if (partial)
        *partial = false;
    uintptr_t a = (uintptr_t)p;
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin())
        return alloc_info{0, 0, ALLOC_NONE, false};
    --it;
    if (a - it->first >= it->second.bytes)
        return alloc_info{0, 0, ALLOC_NONE, false};
    if (n > it->second.bytes - (a - it->first)) {
        if (partial)
            *partial = true;
        return alloc_info{0, 0, ALLOC_NONE, false};
    }
    return alloc_info{it->first, it->second.bytes, it->second.kind, it->second.vmm};
}

uint64_t alloc_generation()
{
    return __atomic_load_n(&g_alloc_gen, __ATOMIC_RELAXED);
}

void describe(const void *p, char *buf, size_t len)
{
    uintptr_t a = (uintptr_t)p;
    if (vmm_describe(a, buf, len)) // before g_mu: vmm.cc takes its lock, then g_mu
        return;
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.upper_bound(a);
    if (it != g_allocs.begin()) {
        auto prev = std::prev(it);
        uintptr_t off = a - prev->first;
        const char *k = prev->second.kind == ALLOC_DEVICE ? "device" : "pinned host";
        if (off < prev->second.bytes) {
            snprintf(buf, len, "byte %zu of a %zu-byte %s allocation at 0x%zx", (size_t)off,
                     prev->second.bytes, k, (size_t)prev->first);
            return;
        }
        snprintf(buf, len, "%zu bytes past the end of a %zu-byte %s allocation at 0x%zx",
                 (size_t)(off - prev->second.bytes), prev->second.bytes, k, (size_t)prev->first);
        return;
    }
    snprintf(buf, len, "outside every device allocation");
}

cudaError_t submit(cudaStream_t s, std::function<cudaError_t()> fn)
{
    s = resolve(s);
    uint64_t seq;
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (s->cap) {
            if (s->cap->invalid)
                return cudaErrorStreamCaptureInvalidated;
            s->cap->nodes.push_back(std::move(fn));
            return cudaSuccess;
        }
        seq = ++s->seq;
    }
    std::lock_guard<std::recursive_mutex> dev(device_lock());
    work_mark outer = tl_work;
    tl_work = work_mark{s, seq};
    cudaError_t e = fn();
    tl_work = outer;
    return e;
}

void register_alloc(uintptr_t base, size_t bytes, alloc_kind kind, bool vmm)
{
    std::lock_guard<std::mutex> g(g_mu);
    g_allocs[base] = alloc_rec{bytes, kind, vmm, true};
    g_alloc_gen++;
}

bool unregister_alloc(uintptr_t base)
{
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.find(base);
    if (it == g_allocs.end())
        return false;
    g_allocs.erase(it);
    g_alloc_gen++;
    return true;
}

bool device_mem_take(size_t bytes)
{
    std::lock_guard<std::mutex> g(g_mu);
    if (bytes > g_device_total || g_device_used > g_device_total - bytes)
        return false;
    g_device_used += bytes;
    return true;
}

void device_mem_give(size_t bytes)
{
    std::lock_guard<std::mutex> g(g_mu);
    g_device_used -= bytes < g_device_used ? bytes : g_device_used;
}

work_mark current_work()
{
    return tl_work;
}

bool work_done(cudaStream_t s, uint64_t seq)
{
    std::lock_guard<std::mutex> g(g_mu);
    if (s != legacy_stream() && !g_streams.count(s))
        return true;
    return s->synced >= seq;
}

void count_launch()
{
    std::lock_guard<std::mutex> g(g_count_mu);
    g_counts.launches++;
}

void count_prewait_load(size_t n)
{
    g_prewait_bytes.fetch_add(n, std::memory_order_relaxed);
}

void count_loads(unsigned long long n)
{
    g_load_bytes.fetch_add(n, std::memory_order_relaxed);
}

void count_mma_f16()
{
    g_mma_f16.fetch_add(1, std::memory_order_relaxed);
}

int g_cc_major = -1, g_cc_minor;

void device_cc(int *major, int *minor)
{
    std::lock_guard<std::mutex> g(g_report_mu);
    if (g_cc_major < 0) {
        const char *c = getenv("KVD_EMU_CC");
        int a = 9, b = 0;
        if (c && sscanf(c, "%d.%d", &a, &b) < 1)
            a = 9;
        g_cc_minor = b;
        g_cc_major = a;
    }
    *major = g_cc_major;
    *minor = g_cc_minor;
}

size_t smem_optin_max()
{
    int ma, mi;
    device_cc(&ma, &mi);
    if (ma >= 9)
        return 232448; // 227 KiB
    if (ma == 8 && mi == 0)
        return 166912; // 163 KiB
    if (ma == 8 && mi == 7)
        return 166912;
    if (ma >= 8)
        return 101376; // 99 KiB (sm_86, sm_89)
    return 49152;
}

int func_max_dyn_smem(const void *fn)
{
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_func_smem.find(fn);
    return it == g_func_smem.end() ? 0 : it->second;
}

} // namespace kvd_emu

using namespace kvd_emu;

cudaError_t kvd_emu_func_set_attribute(const void *fn, enum cudaFuncAttribute attr, int value)
{
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
        (size_t)value > smem_optin_max())
        return set_error(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> g(g_mu);
    g_func_smem[fn] = value;
    return cudaSuccess;
}

extern "C" {

unsigned long kvd_emu_errors(void)
{
    std::lock_guard<std::mutex> g(g_report_mu);
    return g_errors;
}

const char *kvd_emu_last_report(void)
{
    std::lock_guard<std::mutex> g(g_report_mu);
    return g_last_report;
}

void kvd_emu_set_device_mem(size_t bytes)
{
    std::lock_guard<std::mutex> g(g_mu);
    g_device_total = bytes;
}

void kvd_emu_set_cc(int major, int minor)
{
    std::lock_guard<std::mutex> g(g_report_mu);
    g_cc_major = major;
    g_cc_minor = minor;
}

void kvd_emu_get_counts(struct kvd_emu_counts *out)
{
    std::lock_guard<std::mutex> g(g_count_mu);
    *out = g_counts;
    out->prewait_load_bytes = g_prewait_bytes.load(std::memory_order_relaxed);
    out->mma_f16 = g_mma_f16.load(std::memory_order_relaxed);
    out->load_bytes = g_load_bytes.load(std::memory_order_relaxed);
}

size_t kvd_emu_live_allocs(void)
{
    std::lock_guard<std::mutex> g(g_mu);
    return g_allocs.size();
}

// ---- device --------------------------------------------------------------------

static int device_env_init(void)
{
    const char *m = getenv("KVD_EMU_DEVICE_MEM");
    if (m) {
        char *end;
        unsigned long long v = strtoull(m, &end, 0);
        if (*end == 'G' || *end == 'g')
            v <<= 30;
        else if (*end == 'M' || *end == 'm')
            v <<= 20;
        if (v)
            kvd_emu_set_device_mem((size_t)v);
    }
    return 1;
}

cudaError_t cudaGetDeviceCount(int *count)
{
    static int once = device_env_init();
    (void)once;
    if (!count)
        return set_error(cudaErrorInvalidValue);
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    return device == 0 ? cudaSuccess : set_error(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDevice(int *device)
{
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    if (device != 0 || !prop)
        return set_error(cudaErrorInvalidDevice);
    int n = 0;
    cudaGetDeviceCount(&n);
    memset(prop, 0, sizeof *prop);
    device_cc(&prop->major, &prop->minor);
    snprintf(prop->name, sizeof prop->name, "kvd CUDA emulator (CPU, sm_%d%d)", prop->major,
             prop->minor);
    std::lock_guard<std::mutex> g(g_mu);
    prop->totalGlobalMem = g_device_total;
    prop->sharedMemPerBlock = 49152;
    prop->sharedMemPerBlockOptin = smem_optin_max();
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    const char *sms = getenv("KVD_EMU_SMS");
    prop->multiProcessorCount = sms && atoi(sms) > 0 ? atoi(sms) : 132;
    return cudaSuccess;
}

// Shared memory per multiprocessor by compute capability (the limits the
// occupancy calculation works within).
static size_t smem_per_sm()
{
    int major, minor;
    device_cc(&major, &minor);
    if (major >= 9)
        return 228u << 10;
    if (major == 8 && minor == 0)
        return 164u << 10;
    if (major == 8)
        return 100u << 10;
    return 64u << 10;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    struct cudaDeviceProp p;
    if (!value || cudaGetDeviceProperties(&p, device) != cudaSuccess)
        return set_error(cudaErrorInvalidValue);
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
        *value = p.maxThreadsPerBlock;
        break;
    case cudaDevAttrMultiProcessorCount:
        *value = p.multiProcessorCount;
        break;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
        *value = p.major == 8 && p.minor != 0 ? 1536 : 2048;
        break;
    case cudaDevAttrComputeCapabilityMajor:
        *value = p.major;
        break;
    case cudaDevAttrComputeCapabilityMinor:
        *value = p.minor;
        break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
        *value = (int)smem_per_sm();
        break;
    case cudaDevAttrMaxRegistersPerMultiprocessor:
        *value = 65536;
        break;
    default:
        return set_error(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void)
{
    cudaError_t e = unsafe_call("cudaDeviceSynchronize");
    if (e != cudaSuccess)
        return set_error(e);
    std::lock_guard<std::mutex> g(g_mu);
    synced_all(legacy_stream());
    for (cudaStream_t s : g_streams)
        if (!s->cap)
            synced_all(s);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    int n;
    cudaGetDeviceCount(&n);
    std::lock_guard<std::mutex> g(g_mu);
    *free_bytes = g_device_used < g_device_total ? g_device_total - g_device_used : 0;
    *total_bytes = g_device_total;
    return cudaSuccess;
}

// ---- errors ----------------------------------------------------------------------

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = tl_last;
    tl_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    return tl_last;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
#define N(x)                                                                                       \
    case x:                                                                                        \
        return #x;
        N(cudaSuccess)
        N(cudaErrorInvalidValue)
        N(cudaErrorMemoryAllocation)
        N(cudaErrorInitializationError)
        N(cudaErrorInvalidConfiguration)
        N(cudaErrorInvalidDevice)
        N(cudaErrorInvalidResourceHandle)
        N(cudaErrorNotReady)
        N(cudaErrorIllegalAddress)
        N(cudaErrorLaunchOutOfResources)
        N(cudaErrorLaunchFailure)
        N(cudaErrorStreamCaptureUnsupported)
        N(cudaErrorStreamCaptureInvalidated)
        N(cudaErrorStreamCaptureUnjoined)
        N(cudaErrorStreamCaptureImplicit)
        N(cudaErrorStreamCaptureWrongThread)
        N(cudaErrorNoDevice)
        N(cudaErrorHostMemoryAlreadyRegistered)
        N(cudaErrorHostMemoryNotRegistered)
        N(cudaErrorUnknown)
#undef N
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
        return "invalid resource handle";
    case cudaErrorLaunchFailure:
        return "unspecified launch failure (the emulator reported the kernel's fault)";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
        return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnjoined:
        return "capture contained a fork that was not joined to the primary stream";
    case cudaErrorStreamCaptureWrongThread:
        return "attempt to terminate a thread-local capture sequence from another thread";
    default:
        return cudaGetErrorName(e);
    }
}

// ---- memory -----------------------------------------------------------------------

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    return do_alloc(p, bytes, ALLOC_DEVICE, "cudaMalloc");
}

cudaError_t cudaFree(void *p)
{
    return do_free(p, ALLOC_DEVICE, "cudaFree");
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    return do_alloc(p, bytes, ALLOC_HOST, "cudaHostAlloc");
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    return do_alloc(p, bytes, ALLOC_HOST, "cudaMallocHost");
}

cudaError_t cudaFreeHost(void *p)
{
    return do_free(p, ALLOC_HOST, "cudaFreeHost");
}

cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags)
{
    (void)flags;
    if (!p || !bytes)
        return set_error(cudaErrorInvalidValue);
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = g_allocs.lower_bound((uintptr_t)p);
        bool overlap = it != g_allocs.end() && it->first < (uintptr_t)p + bytes;
        if (!overlap && it != g_allocs.begin()) {
            --it;
            overlap = (uintptr_t)p - it->first < it->second.bytes;
        }
        if (overlap) {
            report("cudaHostRegister(%p, %zu): the range overlaps a registered or device range", p,
                   bytes);
            return set_error(cudaErrorHostMemoryAlreadyRegistered);
        }
    }
    register_alloc((uintptr_t)p, bytes, ALLOC_HOST, false);
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *p)
{
    if (find_alloc(p, 1).kind != ALLOC_HOST || !unregister_alloc((uintptr_t)p)) {
        report("cudaHostUnregister(%p): not the start of a cudaHostRegister range", p);
        return set_error(cudaErrorHostMemoryNotRegistered);
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t stream)
{
    cudaError_t e = copy_checks(dst, src, bytes, kind, "cudaMemcpyAsync");
    if (e != cudaSuccess || !bytes)
        return set_error(e);
    return set_error(submit(stream, [dst, src, bytes, kind]() {
        // Checked again when replayed: the buffers may be gone by then.
        cudaError_t r = copy_checks(dst, src, bytes, kind, "cudaMemcpyAsync (replay)");
        note_device_op();
        if (r == cudaSuccess) {
            vmm_touch(dst, bytes);
            vmm_touch(src, bytes);
            memcpy(dst, src, bytes);
            if (find_alloc(dst, 1).kind == ALLOC_DEVICE &&
                find_alloc(src, 1).kind != ALLOC_DEVICE) {
                std::lock_guard<std::mutex> g(g_count_mu);
                g_counts.h2d_copies++;
                g_counts.h2d_bytes += bytes;
            }
        }
        return r;
    }));
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
    cudaError_t e = unsafe_call("cudaMemcpy");
    if (e != cudaSuccess)
        return set_error(e);
    e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
    std::lock_guard<std::mutex> g(g_mu); // synchronous on the legacy stream
    synced_all(legacy_stream());
    return e;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream)
{
    cudaError_t e =
        bytes ? check_range(p, bytes, true, "cudaMemsetAsync", "destination") : cudaSuccess;
    if (e != cudaSuccess || !bytes)
        return set_error(e);
    return set_error(submit(stream, [p, value, bytes]() {
        cudaError_t r = check_range(p, bytes, true, "cudaMemsetAsync (replay)", "destination");
        note_device_op();
        if (r == cudaSuccess) {
            vmm_touch(p, bytes);
            memset(p, value, bytes);
            std::lock_guard<std::mutex> g(g_count_mu);
            g_counts.memsets++;
            g_counts.memset_bytes += bytes;
        }
        return r;
    }));
}

cudaError_t cudaMemset(void *p, int value, size_t bytes)
{
    cudaError_t e = unsafe_call("cudaMemset");
    if (e != cudaSuccess)
        return set_error(e);
    e = cudaMemsetAsync(p, value, bytes, nullptr);
    std::lock_guard<std::mutex> g(g_mu);
    synced_all(legacy_stream());
    return e;
}

// ---- streams and events ---------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    *s = new CUstream_st{flags, nullptr, 0, 0};
    std::lock_guard<std::mutex> g(g_mu);
    g_streams.insert(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s)
        return set_error(cudaErrorInvalidResourceHandle);
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (s->cap) {
            report("cudaStreamDestroy of a stream that is being captured");
            s->cap->invalid = true;
        }
        g_streams.erase(s);
    }
    vmm_forget_stream(s);
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    s = resolve(s);
    bool capturing;
    {
        std::lock_guard<std::mutex> g(g_mu);
        capturing = s->cap != nullptr;
        if (capturing)
            s->cap->invalid = true;
    }
    if (capturing) {
        report("cudaStreamSynchronize on a stream that is being captured: the capture is "
               "invalidated");
        return set_error(cudaErrorStreamCaptureUnsupported);
    }
    cudaError_t e = unsafe_call("cudaStreamSynchronize");
    if (e != cudaSuccess)
        return set_error(e);
    std::lock_guard<std::mutex> g(g_mu);
    synced_all(s);
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    *e = new CUevent_st{flags, false, 0.0, nullptr, nullptr, 0};
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    if (!e)
        return set_error(cudaErrorInvalidResourceHandle);
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    if (!e)
        return set_error(cudaErrorInvalidResourceHandle);
    s = resolve(s);
    std::lock_guard<std::mutex> g(g_mu);
    e->recorded = true;
    e->stream = s;
    e->seq = s->seq;
    e->cap = s->cap; // an event recorded in a capture is a node of it
    if (!s->cap)
        e->t_ms = now_ms(); // streams are synchronous: everything before it is done
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    (void)flags;
    if (!e)
        return set_error(cudaErrorInvalidResourceHandle);
    s = resolve(s);
    std::lock_guard<std::mutex> g(g_mu);
    if (!e->cap)
        return cudaSuccess; // complete already
    if (!s->cap) {
        // Waiting on a captured event pulls s into the capture: its later
        // work is recorded, and it must be joined back before the end.
        s->cap = e->cap;
        e->cap->joined.insert(s);
    } else if (s->cap != e->cap) {
        report("cudaStreamWaitEvent joins two different captures");
        s->cap->invalid = e->cap->invalid = true;
        return set_error(cudaErrorStreamCaptureInvalidated);
    } else if (s == s->cap->origin) {
        s->cap->joined.erase(e->stream); // the forked stream is joined back
    }
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    if (!e)
        return set_error(cudaErrorInvalidResourceHandle);
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (e->cap) {
            e->cap->invalid = true;
            report("cudaEventSynchronize on an event recorded inside a capture");
            return set_error(cudaErrorStreamCaptureUnsupported);
        }
    }
    cudaError_t r = unsafe_call("cudaEventSynchronize");
    if (r != cudaSuccess)
        return set_error(r);
    std::lock_guard<std::mutex> g(g_mu);
    cudaStream_t s = e->stream;
    if (s && (s == legacy_stream() || g_streams.count(s)) && s->synced < e->seq)
        s->synced = e->seq;
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e)
{
    if (!e)
        return set_error(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    if (!start || !end || !start->recorded || !end->recorded ||
        (start->flags | end->flags) & cudaEventDisableTiming)
        return set_error(cudaErrorInvalidResourceHandle);
    *ms = (float)(end->t_ms - start->t_ms);
    return cudaSuccess;
}

// ---- graphs ------------------------------------------------------------------------------

cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode)
{
    if (!s) {
        report("cudaStreamBeginCapture on the legacy stream");
        return set_error(cudaErrorStreamCaptureUnsupported);
    }
    std::shared_ptr<capture> c = std::make_shared<capture>();
    c->origin = s;
    c->mode = mode;
    c->owner = std::this_thread::get_id();
    std::lock_guard<std::mutex> g(g_mu);
    if (s->cap)
        return set_error(cudaErrorStreamCaptureUnsupported);
    s->cap = c;
    if (mode != cudaStreamCaptureModeRelaxed)
        tl_capture = c;
    if (mode == cudaStreamCaptureModeGlobal)
        g_global_captures++;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph)
{
    *graph = nullptr;
    std::shared_ptr<capture> c;
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (!s || !s->cap || s->cap->origin != s)
            return set_error(cudaErrorInvalidValue);
        c = s->cap;
        if (c->mode != cudaStreamCaptureModeRelaxed && c->owner != std::this_thread::get_id())
            return set_error(cudaErrorStreamCaptureWrongThread);
        s->cap = nullptr;
        for (cudaStream_t j : c->joined)
            j->cap = nullptr;
        if (c->mode == cudaStreamCaptureModeGlobal)
            g_global_captures--;
    }
    if (tl_capture == c)
        tl_capture = nullptr;
    if (c->invalid)
        return set_error(cudaErrorStreamCaptureInvalidated);
    if (!c->joined.empty()) {
        report("cudaStreamEndCapture: %zu stream(s) joined the capture through an event and "
               "were not joined back",
               c->joined.size());
        return set_error(cudaErrorStreamCaptureUnjoined);
    }
    *graph = new CUgraph_st{std::move(c->nodes)};
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags)
{
    (void)flags;
    if (!graph)
        return set_error(cudaErrorInvalidValue);
    *exec = new CUgraphExec_st{graph->nodes};
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s)
{
    if (!exec)
        return set_error(cudaErrorInvalidResourceHandle);
    for (auto &n : exec->nodes) {
        std::function<cudaError_t()> f = n;
        cudaError_t e = submit(s, std::move(f));
        if (e != cudaSuccess)
            return set_error(e);
    }
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph)
{
    delete graph;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec)
{
    delete exec;
    return cudaSuccess;
}

} // extern "C"
