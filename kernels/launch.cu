// Launch bookkeeping shared by every kernels/*.cu file: the per-thread count
// of kernel launches (kernels.h kvd_k_launches), which the cuda backend reads
// around a step to report how many kernels one decode step runs; whether
// launches use programmatic dependent launch (kvd_k_pdl_on).
#include <atomic>
#include <stdlib.h>
#include <string.h>

#include "kernel_util.cuh"

thread_local unsigned long long kvd_launch_count;

extern "C" unsigned long long kvd_k_launches(void)
{
    return kvd_launch_count;
}

// -1: not decided; then 0 or 1 (KVD_CUDA_PDL, kvd_k_set_pdl).
static std::atomic<int> g_pdl_wanted{-1};
// Per device (ordinals below 64): bit set = asked, bit in cc9 = sm_90+.
static std::atomic<unsigned long long> g_pdl_asked{0}, g_pdl_cc9{0};

extern "C" void kvd_k_set_pdl(int on)
{
    g_pdl_wanted.store(on ? 1 : 0);
}

extern "C" int kvd_k_pdl_on(void)
{
    int want = g_pdl_wanted.load(std::memory_order_relaxed);
    if (want < 0) {
        const char *e = getenv("KVD_CUDA_PDL");
        want = !(e && strcmp(e, "0") == 0);
        g_pdl_wanted.store(want);
    }
    if (!want)
        return 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return 0;
    }
    const unsigned long long bit = 1ull << dev;
    if (!(g_pdl_asked.load(std::memory_order_acquire) & bit)) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        if (major >= 9)
            g_pdl_cc9.fetch_or(bit);
        g_pdl_asked.fetch_or(bit, std::memory_order_release);
    }
    return (g_pdl_cc9.load(std::memory_order_relaxed) & bit) != 0;
}
