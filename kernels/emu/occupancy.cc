// Occupancy for the emulation build (kvd_emu_occupancy.h): the resident
// blocks per multiprocessor of a kernel instance on the emulated compute
// capability, by the CUDA occupancy calculator's rules (registers allocated
// per warp in units of 256, shared memory per block rounded up to 128 bytes
// plus the 1 KiB the runtime reserves per block on sm_80 and later), from
// ptxas's counts for sm_90 in ptxas_sm90.inc.
#include <string.h>

#include <algorithm>

#include "emu_internal.h"
#include "kvd_emu_occupancy.h"

namespace
{

struct ptxas_row {
    const char *instance;
    int regs;
    size_t smem; // static shared memory, bytes
};

const ptxas_row g_ptxas[] = {
#define KVD_PTXAS(name, regs, smem) {name, regs, smem},
#include "ptxas_sm90.inc"
#undef KVD_PTXAS
};

// Per-multiprocessor limits of a compute capability.
struct sm_limits {
    int max_threads, max_blocks, max_warps;
    size_t smem; // usable by blocks, bytes
};

sm_limits limits_of(int major, int minor)
{
    if (major >= 9)
        return {2048, 32, 64, 233472}; // 228 KiB
    if (major == 8 && (minor == 0 || minor == 7))
        return {2048, 32, 64, 167936}; // 164 KiB
    if (major == 8 && minor == 9)
        return {1536, 24, 48, 102400}; // 100 KiB
    if (major == 8)
        return {1536, 16, 48, 102400};
    return {2048, 16, 64, 65536};
}

} // namespace

bool kvd_emu_ptxas_info(const char *instance, int *regs, size_t *static_smem)
{
    for (const ptxas_row &r : g_ptxas)
        if (!strcmp(r.instance, instance)) {
            *regs = r.regs;
            *static_smem = r.smem;
            return true;
        }
    return false;
}

cudaError_t kvd_emu_occupancy(int *blocks, const char *instance, int threads, size_t dyn_smem)
{
    int regs = 0;
    size_t smem = 0;
    if (!blocks || threads <= 0 || threads > 1024)
        return kvd_emu::set_error(cudaErrorInvalidValue);
    if (!kvd_emu_ptxas_info(instance, &regs, &smem)) {
        kvd_emu::report("occupancy of %s: no ptxas register count for it in "
                        "kernels/emu/ptxas_sm90.inc (regenerate it: tests/gpu/ptxas_report.sh "
                        "--table)",
                        instance);
        return kvd_emu::set_error(cudaErrorInvalidValue);
    }
    int major, minor;
    kvd_emu::device_cc(&major, &minor);
    const sm_limits lim = limits_of(major, minor);
    const int warps = (threads + 31) / 32;
    int n = lim.max_blocks;
    n = std::min(n, lim.max_warps / warps);
    n = std::min(n, lim.max_threads / (warps * 32));
    const int warp_regs = (regs * 32 + 255) / 256 * 256;
    n = std::min(n, 65536 / warp_regs / warps);
    const size_t block_smem = (smem + dyn_smem + 127) / 128 * 128 + (major >= 8 ? 1024 : 0);
    if (smem + dyn_smem > 0)
        n = std::min(n, (int)(lim.smem / block_smem));
    *blocks = n > 0 ? n : 0;
    return cudaSuccess;
}
