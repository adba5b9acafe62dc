/* The CUDA runtime API of the emulation build (-DKVD_CUDA=EMULATE): the
 * subset kvd calls, implemented on the CPU by kernels/emu/cudart.cc. Device
 * memory is host memory from the C allocator (so ASan sees every device
 * buffer), streams and events are synchronous, a graph capture records the
 * stream's work and a replay re-issues it with the same argument values.
 * Included from C (the daemon's cuda backend) and from C++ (the kernels, where it
 * also brings in the SIMT device side, kvd_simt.h). Error numbers equal the
 * real runtime's. docs/emulation.md says what this mode checks and what it
 * cannot show. */
#ifndef KVD_EMU_CUDA_RUNTIME_H
#define KVD_EMU_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorLaunchFailure = 719,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureUnjoined = 904,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorStreamCaptureWrongThread = 908,
    cudaErrorNoDevice = 100,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
    cudaErrorUnknown = 999
} cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
};

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

#define cudaStreamDefault 0x00u
#define cudaStreamNonBlocking 0x01u
#define cudaEventDefault 0x00u
#define cudaEventBlockingSync 0x01u
#define cudaEventDisableTiming 0x02u
#define cudaHostAllocDefault 0x00u
#define cudaHostAllocPortable 0x01u
#define cudaHostRegisterDefault 0x00u
#define cudaHostRegisterPortable 0x01u

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    int warpSize;
    int maxThreadsPerBlock;
    int multiProcessorCount;
    int major, minor;
};

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);
/* The attributes kvd asks for (numbers as the real runtime's). */
enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMaxThreadsPerMultiProcessor = 39,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
    cudaDevAttrMaxRegistersPerMultiprocessor = 82
};
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);

cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
/* Pins [p, p + bytes) of host memory (cudaHostUnregister(p) undoes it). */
cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemset(void *p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph);

cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

/* The emulator's own controls and findings (tests; not part of CUDA). */
#define KVD_EMU 1
/* Kernel faults, races and API misuse reported so far (each also printed). */
unsigned long kvd_emu_errors(void);
/* The text of the latest report ("" before the first). */
const char *kvd_emu_last_report(void);
/* Bytes of device memory cudaMemGetInfo and cudaMalloc work within (also
 * KVD_EMU_DEVICE_MEM at start-up; default 16 GiB). */
void kvd_emu_set_device_mem(size_t bytes);
/* Device allocations currently live (leak checks). */
size_t kvd_emu_live_allocs(void);
/* The compute capability the device reports and its shared-memory limits
 * follow (also KVD_EMU_CC=M.m at start-up; default 9.0). */
void kvd_emu_set_cc(int major, int minor);
/* Runs every later launch in forward, reverse and random thread order and
 * reports when they leave different bytes (also KVD_EMU_CHECK=order).
 * Needs the instrumented build (KVD_EMU_MEMCHECK). */
void kvd_emu_set_order_check(int on);
/* What the device has executed so far (a graph's work counts each time it
 * is launched): kernel launches, copies from host memory to device memory
 * and their bytes, memsets and their bytes, and the bytes PDL launches
 * loaded from global memory before their cudaGridDependencySynchronize
 * (instrumented builds, KVD_EMU_MEMCHECK; each thread order of the order
 * check counts), and the warp-wide f16/bf16 mma.sync m16n8k16 instructions
 * executed (kvd_mma16816), and the bytes kernels loaded from global memory
 * (instrumented builds; each order of the order check counts). */
struct kvd_emu_counts {
    unsigned long long launches;
    unsigned long long h2d_copies, h2d_bytes;
    unsigned long long memsets, memset_bytes;
    unsigned long long prewait_load_bytes;
    unsigned long long mma_f16;
    unsigned long long load_bytes;
};
void kvd_emu_get_counts(struct kvd_emu_counts *out);

#ifdef __cplusplus
}
/* cudaFuncSetAttribute takes the kernel itself. */
cudaError_t kvd_emu_func_set_attribute(const void *fn, enum cudaFuncAttribute attr, int value);
template <class F>
static inline cudaError_t cudaFuncSetAttribute(F *fn, enum cudaFuncAttribute attr, int value)
{
    return kvd_emu_func_set_attribute((const void *)fn, attr, value);
}
#include "kvd_simt.h"
#endif

#endif
