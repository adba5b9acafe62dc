/* The CUDA driver API calls kvd makes (the virtual-memory KV pool, page
 * handles exported to other processes), resolved at run time through the
 * runtime rather than linked: libcuda.so.1 comes with the NVIDIA driver,
 * not with the toolkit, and a kvd built with CUDA must still start (on the
 * cpu backend) on a machine without the driver. */
#pragma once

#include <cuda.h>
#include <stddef.h>

struct cuda_drv {
    CUresult (*Init)(unsigned int flags);
    CUresult (*GetErrorName)(CUresult error, const char **str);
    CUresult (*MemGetAllocationGranularity)(size_t *granularity, const CUmemAllocationProp *prop,
                                            CUmemAllocationGranularity_flags option);
    CUresult (*MemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags);
    CUresult (*MemAddressFree)(CUdeviceptr ptr, size_t size);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *handle, size_t size,
                          const CUmemAllocationProp *prop, unsigned long long flags);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle handle);
    CUresult (*MemMap)(CUdeviceptr ptr, size_t size, size_t offset,
                       CUmemGenericAllocationHandle handle, unsigned long long flags);
    CUresult (*MemUnmap)(CUdeviceptr ptr, size_t size);
    CUresult (*MemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                             size_t count);
    CUresult (*MemExportToShareableHandle)(void *shareable, CUmemGenericAllocationHandle handle,
                                           CUmemAllocationHandleType type,
                                           unsigned long long flags);
    CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle, void *shareable,
                                             CUmemAllocationHandleType type);
};

/* The driver's functions, every one present, after cuInit; NULL when they
 * cannot be had (no driver, an old driver), with the reason in err.
 * Resolved once per process (thread-safe); call after the runtime has a
 * device (cudaSetDevice). The CUDA emulator's build gets the emulator's. */
const struct cuda_drv *cuda_drv(char *err, size_t err_len);
