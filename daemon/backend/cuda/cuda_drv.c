/* The driver API's entry points, asked of the CUDA runtime
 * (cudaGetDriverEntryPointByVersion) so that the binary does not link
 * libcuda.so.1 (cuda_drv.h says why); in the emulator's build, its own
 * functions. */
#include "cuda_drv.h"

#include <cuda_runtime.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>

static struct cuda_drv drv;
static char drv_err[160];
static bool drv_ok;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

#ifdef KVD_CUDA_EMULATE
static void resolve(void)
{
    drv = (struct cuda_drv){
        .Init = cuInit,
        .GetErrorName = cuGetErrorName,
        .MemGetAllocationGranularity = cuMemGetAllocationGranularity,
        .MemAddressReserve = cuMemAddressReserve,
        .MemAddressFree = cuMemAddressFree,
        .MemCreate = cuMemCreate,
        .MemRelease = cuMemRelease,
        .MemMap = cuMemMap,
        .MemUnmap = cuMemUnmap,
        .MemSetAccess = cuMemSetAccess,
        .MemExportToShareableHandle = cuMemExportToShareableHandle,
        .MemImportFromShareableHandle = cuMemImportFromShareableHandle,
    };
    drv_ok = drv.Init(0) == CUDA_SUCCESS;
    if (!drv_ok)
        snprintf(drv_err, sizeof drv_err, "cuInit failed");
}
#else
/* One entry point by its driver name, as the CUDA 12.0 ABI defines it. */
static bool entry(const char *name, void **fn)
{
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*fn) {
        snprintf(drv_err, sizeof drv_err, "the driver has no %s (%s)", name,
                 e != cudaSuccess ? cudaGetErrorString(e) : "symbol not found");
        return false;
    }
    return true;
}

static void resolve(void)
{
    struct {
        const char *name;
        void **fn;
    } const t[] = {
        {"cuInit", (void **)&drv.Init},
        {"cuGetErrorName", (void **)&drv.GetErrorName},
        {"cuMemGetAllocationGranularity", (void **)&drv.MemGetAllocationGranularity},
        {"cuMemAddressReserve", (void **)&drv.MemAddressReserve},
        {"cuMemAddressFree", (void **)&drv.MemAddressFree},
        {"cuMemCreate", (void **)&drv.MemCreate},
        {"cuMemRelease", (void **)&drv.MemRelease},
        {"cuMemMap", (void **)&drv.MemMap},
        {"cuMemUnmap", (void **)&drv.MemUnmap},
        {"cuMemSetAccess", (void **)&drv.MemSetAccess},
        {"cuMemExportToShareableHandle", (void **)&drv.MemExportToShareableHandle},
        {"cuMemImportFromShareableHandle", (void **)&drv.MemImportFromShareableHandle},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!entry(t[i].name, t[i].fn))
            return;
    drv_ok = drv.Init(0) == CUDA_SUCCESS;
    if (!drv_ok)
        snprintf(drv_err, sizeof drv_err, "cuInit failed");
}
#endif

const struct cuda_drv *cuda_drv(char *err, size_t err_len)
{
    pthread_once(&drv_once, resolve);
    if (!drv_ok && err && err_len)
        snprintf(err, err_len, "%s", drv_err);
    return drv_ok ? &drv : NULL;
}
