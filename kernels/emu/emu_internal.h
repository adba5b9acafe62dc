// Shared inside the emulator (kernels/emu/*.cc): fault reports, the device
// memory registry, the one-op-at-a-time device lock, stream submission.
#ifndef KVD_EMU_INTERNAL_H
#define KVD_EMU_INTERNAL_H

#include <cuda_runtime.h>

#include <functional>
#include <mutex>

namespace kvd_emu
{

// Prints "kvd-emu: <message>" (the first few hundred), counts it in
// kvd_emu_errors(), aborts when KVD_EMU_ABORT=1.
void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// Sets the calling thread's last error (cudaGetLastError) and returns e.
cudaError_t set_error(cudaError_t e);

// Device work runs one operation at a time, like one GPU with one engine,
// whichever host thread issues it.
std::recursive_mutex &device_lock();

// Live allocations. kind: device (cudaMalloc) or pinned host.
enum alloc_kind { ALLOC_NONE = 0, ALLOC_DEVICE = 1, ALLOC_HOST = 2 };
struct alloc_info {
    uintptr_t base;
    size_t bytes;
    alloc_kind kind;
    bool vmm; // a cuMemMap mapping with access set (vmm.cc)
};
// The live allocation holding [p, p + n) whole (kind ALLOC_NONE if none);
// *partial set when p is inside one that [p, p+n) runs past.
alloc_info find_alloc(const void *p, size_t n, bool *partial = nullptr);
// Bumped by every free: lets callers cache a lookup.
uint64_t alloc_generation();
// A one-line description of where p is ("12 bytes into a 4096-byte device
// allocation at 0x..", or "outside every allocation").
void describe(const void *p, char *buf, size_t len);

// Runs fn on stream s now, or records it when s is being captured.
cudaError_t submit(cudaStream_t s, std::function<cudaError_t()> fn);

// Allocations made outside cudart.cc: VMM mappings once their access is
// set (vmm.cc), host ranges cudaHostRegister pins. unregister: false when
// none starts at base.
void register_alloc(uintptr_t base, size_t bytes, alloc_kind kind, bool vmm);
bool unregister_alloc(uintptr_t base);
// The device memory cudaMemGetInfo reports, shared with cuMemCreate.
bool device_mem_take(size_t bytes);
void device_mem_give(size_t bytes);

// Which stream operation runs on this thread now (s NULL outside one), and
// whether the host has waited for operation seq of stream s (a
// cudaStreamSynchronize, a cudaEventSynchronize of an event recorded after
// it, cudaDeviceSynchronize; a destroyed stream counts as waited for).
struct work_mark {
    cudaStream_t s;
    uint64_t seq;
};
work_mark current_work();
bool work_done(cudaStream_t s, uint64_t seq);

// The VMM side (vmm.cc). vmm_touch: the running stream operation used
// [p, p + n); vmm_describe: a one-line description of an address inside a
// reservation with nothing mapped, or a mapping without access (false for
// others); vmm_forget_stream: s is gone.
void vmm_touch(const void *p, size_t n);
bool vmm_describe(uintptr_t a, char *buf, size_t len);
void vmm_forget_stream(cudaStream_t s);

// The emulated compute capability (KVD_EMU_CC, default 9.0) and the
// largest dynamic shared memory a kernel may opt in to on it.
void device_cc(int *major, int *minor);
size_t smem_optin_max();
// The attribute cudaFuncSetAttribute set for a kernel (0 if none).
int func_max_dyn_smem(const void *fn);

// The counters kvd_emu_get_counts reports (cudart.cc), bumped as work executes.
void count_launch();
// Bytes a PDL launch's threads loaded from global memory before their
// cudaGridDependencySynchronize (instrumented builds).
void count_prewait_load(size_t n);
// One warp-wide f16/bf16 mma.sync executed (mma.cc), lock-free.
void count_mma_f16();
// Bytes a launch's threads loaded from global memory (instrumented builds),
// added once per launch.
void count_loads(unsigned long long n);

// Kernel launches (simt.cc). pdl: launched with programmatic stream
// serialization (KVD_LAUNCH_PDL): until its threads pass
// cudaGridDependencySynchronize they must not write global memory nor read
// what the kernel before it wrote, which may still be running.
cudaError_t run_launch(const char *name, const void *fn, dim3 grid, dim3 block, size_t smem,
                       const kvd_emu_call *call, bool pdl);
// A device operation other than a kernel launch executed (a copy, a memset,
// a GEMM): the next kernel cannot overlap the one before it.
void note_device_op();

} // namespace kvd_emu

#endif
