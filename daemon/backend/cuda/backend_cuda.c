/* backend_cuda: the cuda implementation of the backend table (backend.h):
 * device selection, whole arenas (cudaMalloc, pinned cudaHostAlloc), the
 * elastic KV arenas (device: the driver's virtual-memory API, one reserved
 * range per pool into which pages are mapped and from which they are
 * unmapped; host: memfd pages pinned with cudaHostRegister), copies on a
 * dedicated stream that overlaps the compute stream, and the cuBLAS handle
 * the compute ops use. */
#include "backend_cuda.h"
#include "cuda_drv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "kvd/status.h"
#include "log.h"
#include "memfd_arena.h"

/* The cuBLAS workspace, owned by the device with the one handle that uses
 * it (never by a compute context: freeing one would pull it from under the
 * others, and from under the graphs they captured). */
#define BLAS_WS_BYTES (32u << 20)

/* The device each thread last entered; -1 before its first call. */
static _Thread_local int cuda_cur_device = -1;

struct cuda_backend {
    struct backend be; /* first: be->impl points back here */
    struct cuda_dev dev;
};

struct cuda_dev *cuda_backend_dev(struct backend *be)
{
    if (!be || !be->ops || be->ops->kind != BACKEND_CUDA)
        return NULL;
    return &((struct cuda_backend *)be->impl)->dev;
}

int cuda_fail(int cuda_err, const char *what)
{
    log_err("cuda: %s failed: %s (%s)", what, cudaGetErrorName((cudaError_t)cuda_err),
            cudaGetErrorString((cudaError_t)cuda_err));
    return cuda_err == cudaErrorMemoryAllocation ? KVD_ENOMEM : KVD_EINTERNAL;
}

int cublas_fail(int status, const char *what)
{
    log_err("cuda: %s failed: cuBLAS status %d", what, status);
    return status == CUBLAS_STATUS_ALLOC_FAILED ? KVD_ENOMEM : KVD_EINTERNAL;
}

int cuda_dev_enter(struct cuda_dev *dev)
{
    if (cuda_cur_device == dev->device)
        return 0;
    cudaError_t e = cudaSetDevice(dev->device);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaSetDevice");
    cuda_cur_device = dev->device;
    return 0;
}

static struct cuda_dev *dev_of(struct backend *be)
{
    return &((struct cuda_backend *)be->impl)->dev;
}

static int cuda_arena_alloc(struct backend *be, enum kvd_tier tier, size_t bytes, void **out)
{
    struct cuda_dev *dev = dev_of(be);
    void *p = NULL;
    cudaError_t e;

    *out = NULL;
    if (bytes == 0)
        return KVD_EBADREQ;
    if (fault_should_fail(tier == KVD_TIER_DEVICE ? FAULT_DEVICE_ALLOC : FAULT_HOST_ALLOC))
        return KVD_ENOMEM;
    if (cuda_dev_enter(dev))
        return KVD_EINTERNAL;
    if (tier == KVD_TIER_DEVICE) {
        e = cudaMalloc(&p, bytes);
        if (e != cudaSuccess)
            goto fail;
        /* The contract says zero-filled; finish before anyone reads it. */
        e = cudaMemset(p, 0, bytes);
        if (e == cudaSuccess)
            e = cudaDeviceSynchronize();
        if (e != cudaSuccess) {
            cudaFree(p);
            goto fail;
        }
    } else {
        /* Pinned, so swaps run as true asynchronous DMA at full PCIe rate. */
        e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
        if (e != cudaSuccess)
            goto fail;
        memset(p, 0, bytes);
    }
    *out = p;
    return 0;
fail:
    (void)cudaGetLastError(); /* clear the sticky-free error so later calls work */
    log_warn("cuda: %s arena of %zu bytes: %s", tier == KVD_TIER_DEVICE ? "device" : "host", bytes,
             cudaGetErrorString(e));
    return KVD_ENOMEM;
}

void cuda_dev_note_free(struct cuda_dev *dev)
{
    atomic_fetch_add(&dev->frees, 1);
}

static void cuda_arena_free(struct backend *be, enum kvd_tier tier, void *p, size_t bytes)
{
    if (!p || cuda_dev_enter(dev_of(be)))
        return;
    if (tier == KVD_TIER_DEVICE)
        cuda_dev_note_free(dev_of(be));
    cudaError_t e = tier == KVD_TIER_DEVICE ? cudaFree(p) : cudaFreeHost(p);
    if (e != cudaSuccess)
        cuda_fail(e, "arena free");
}

/* Queues a copy (or, src NULL, a zero-fill of dst) on the copy stream,
 * after every compute op issued so far (a block is never copied while a
 * kernel may still write it). cudaMemcpyDefault: unified addressing tells
 * device, pinned and plain host memory apart. */
static int copy_enqueue(struct cuda_dev *dev, void *dst, const void *src, size_t bytes)
{
    cudaError_t e = cudaSuccess;

    if (cuda_dev_enter(dev))
        return KVD_EINTERNAL;
    pthread_mutex_lock(&dev->mu);
    /* While a graph is being captured, recording an event on the compute
     * stream would pull the copy into the capture; the copy waits instead
     * for the mark recorded just before the capture began (the capture
     * itself executes nothing, but work issued before it, such as the
     * step's metadata uploads or a failed step's kernels, may still run).
     * The captured step is launched after cuda_dev_wait_copies, so it
     * waits for this copy (compute_cuda.c). */
    if (!dev->capturing)
        e = cudaEventRecord(dev->compute_mark, dev->compute);
    if (e == cudaSuccess)
        e = cudaStreamWaitEvent(dev->copy, dev->compute_mark, 0);
    if (e == cudaSuccess)
        e = src ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, dev->copy)
                : cudaMemsetAsync(dst, 0, bytes, dev->copy);
    if (e == cudaSuccess)
        e = cudaEventRecord(dev->copy_done, dev->copy);
    pthread_mutex_unlock(&dev->mu);
    return e == cudaSuccess ? 0 : cuda_fail(e, src ? "copy" : "zero-fill");
}

int cuda_dev_wait_copies(struct cuda_dev *dev)
{
    pthread_mutex_lock(&dev->mu);
    cudaError_t e = cudaStreamWaitEvent(dev->compute, dev->copy_done, 0);
    pthread_mutex_unlock(&dev->mu);
    return (int)e;
}

int cuda_dev_capture_begin(struct cuda_dev *dev)
{
    pthread_mutex_lock(&dev->mu);
    /* The mark copies queued during the capture wait for (copy_enqueue). */
    cudaError_t e = cudaEventRecord(dev->compute_mark, dev->compute);
    if (e == cudaSuccess)
        e = cudaStreamBeginCapture(dev->compute, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess)
        dev->capturing = true;
    pthread_mutex_unlock(&dev->mu);
    return (int)e;
}

int cuda_dev_capture_end(struct cuda_dev *dev, cudaGraph_t *graph)
{
    pthread_mutex_lock(&dev->mu);
    cudaError_t e = cudaStreamEndCapture(dev->compute, graph);
    dev->capturing = false;
    pthread_mutex_unlock(&dev->mu);
    return (int)e;
}

static int cuda_copy_async(struct backend *be, void *dst, enum kvd_tier dst_tier, const void *src,
                           enum kvd_tier src_tier, size_t bytes)
{
    if (bytes == 0)
        return 0;
    if (fault_should_fail(FAULT_COPY))
        return KVD_EINTERNAL;
    return copy_enqueue(dev_of(be), dst, src, bytes);
}

/* New KV blocks: a device memset on the copy stream instead of a copy from
 * a zeroed host buffer (which is pageable, so the runtime would stage it
 * and wait). Not waited for: every reader is ordered after it (copies run
 * in order on the copy stream; a step's work waits for copy_done first). */
static int cuda_zero(struct backend *be, void *dst, enum kvd_tier tier, size_t bytes)
{
    if (bytes == 0)
        return 0;
    if (fault_should_fail(FAULT_COPY))
        return KVD_EINTERNAL;
    if (tier != KVD_TIER_DEVICE) {
        memset(dst, 0, bytes);
        return 0;
    }
    return copy_enqueue(dev_of(be), dst, NULL, bytes);
}

static int cuda_copy_wait(struct backend *be)
{
    struct cuda_dev *dev = dev_of(be);
    if (cuda_dev_enter(dev))
        return KVD_EINTERNAL;
    /* copy_done was recorded after the last copy; the copy stream runs in
     * order, so it completing means every earlier copy completed. */
    cudaError_t e = cudaEventSynchronize(dev->copy_done);
    return e == cudaSuccess ? 0 : cuda_fail(e, "copy wait");
}

static int cuda_copy(struct backend *be, void *dst, enum kvd_tier dst_tier, const void *src,
                     enum kvd_tier src_tier, size_t bytes)
{
    if (bytes == 0)
        return 0;
    if (fault_should_fail(FAULT_COPY))
        return KVD_EINTERNAL;
    int rc = copy_enqueue(dev_of(be), dst, src, bytes);
    return rc ? rc : cuda_copy_wait(be);
}

/* ---- elastic arenas ----------------------------------------------------------
 * Device: one range reserved with cuMemAddressReserve; a page is a
 * cuMemCreate allocation (exportable as a POSIX descriptor where the driver
 * allows it) mapped with cuMemMap and given the device's access with
 * cuMemSetAccess, so slot s stays at base + s * block_bytes and the arena
 * grows and shrinks without a copy. Unmapping waits for the copy stream
 * first (a zero-fill or copy queued there may still be running); the
 * compute stream is waited for at the end of every step (compute_cuda.c),
 * and a page is unmapped only once every block in it is freed, which no
 * step still running can use (the slot rule, kvmm.h). Host: memfd pages
 * (memfd_arena.h), pinned with cudaHostRegister so swaps stay DMA. */
struct cuda_vrange {
    struct cuda_vrange *next;
    enum kvd_tier tier;
    char *base;
    size_t page_bytes, n_pages;
    CUmemGenericAllocationHandle *h; /* device: (n_pages), 0 where unmapped */
    bool *exportable;                /* device: (n_pages) */
    struct memfd_arena *host;        /* host tier */
};

/* The driver API, set once a backend opened a device (cuda_drv.h). */
static const struct cuda_drv *cu_drv;

static int cu_fail(CUresult r, const char *what)
{
    const char *name = NULL;
    if (cu_drv->GetErrorName(r, &name) != CUDA_SUCCESS || !name)
        name = "?";
    log_err("cuda: %s failed: %s", what, name);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? KVD_ENOMEM : KVD_EINTERNAL;
}

static CUmemAllocationProp vmm_prop(const struct cuda_dev *dev, bool exportable)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev->device;
    prop.requestedHandleTypes =
        exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    return prop;
}

static size_t cuda_arena_granularity(struct backend *be, enum kvd_tier tier)
{
    struct cuda_dev *dev = dev_of(be);
    if (tier == KVD_TIER_HOST)
        return memfd_arena_granularity();
    if (!dev->vmm_gran && cuda_dev_enter(dev) == 0) {
        CUmemAllocationProp prop = vmm_prop(dev, true);
        size_t g = 0;
        CUresult r =
            cu_drv->MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (r != CUDA_SUCCESS)
            cu_fail(r, "cuMemGetAllocationGranularity");
        else
            dev->vmm_gran = g;
    }
    return dev->vmm_gran;
}

/* Takes the range of base off the list (NULL if none). */
static struct cuda_vrange *vrange_unlink(struct cuda_dev *dev, const void *base)
{
    struct cuda_vrange *found = NULL;
    pthread_mutex_lock(&dev->ranges_mu);
    for (struct cuda_vrange **pp = &dev->ranges; *pp; pp = &(*pp)->next)
        if ((*pp)->base == base) {
            found = *pp;
            *pp = found->next;
            break;
        }
    pthread_mutex_unlock(&dev->ranges_mu);
    return found;
}

static int cuda_arena_reserve(struct backend *be, enum kvd_tier tier, size_t page_bytes,
                              size_t n_pages, void **base)
{
    struct cuda_dev *dev = dev_of(be);
    struct cuda_vrange *v;
    int rc;

    *base = NULL;
    if (!page_bytes || !n_pages || n_pages > SIZE_MAX / page_bytes)
        return KVD_EBADREQ;
    if ((rc = cuda_dev_enter(dev)))
        return rc;
    if (!(v = calloc(1, sizeof *v)))
        return KVD_ENOMEM;
    v->tier = tier;
    v->page_bytes = page_bytes;
    v->n_pages = n_pages;
    if (tier == KVD_TIER_HOST) {
        if ((rc = memfd_arena_reserve(page_bytes, n_pages, &v->host))) {
            free(v);
            return rc;
        }
        v->host->tier = (int)tier;
        v->base = v->host->base;
    } else {
        size_t g = cuda_arena_granularity(be, tier);
        CUdeviceptr p = 0;
        CUresult r;
        if (!g || page_bytes % g)
            rc = KVD_EBADREQ;
        else if (!(v->h = calloc(n_pages, sizeof *v->h)) ||
                 !(v->exportable = calloc(n_pages, sizeof *v->exportable)))
            rc = KVD_ENOMEM;
        else if ((r = cu_drv->MemAddressReserve(&p, page_bytes * n_pages, 0, 0, 0)) != CUDA_SUCCESS)
            rc = cu_fail(r, "cuMemAddressReserve");
        if (rc) {
            free(v->h);
            free(v->exportable);
            free(v);
            return rc;
        }
        v->base = (char *)(uintptr_t)p;
    }
    pthread_mutex_lock(&dev->ranges_mu);
    v->next = dev->ranges;
    dev->ranges = v;
    pthread_mutex_unlock(&dev->ranges_mu);
    *base = v->base;
    return 0;
}

/* Finds the range of base (NULL if none); the range stays while its pool,
 * whose lock the caller holds, lives. */
static struct cuda_vrange *vrange_of(struct cuda_dev *dev, const void *base)
{
    struct cuda_vrange *v;
    pthread_mutex_lock(&dev->ranges_mu);
    for (v = dev->ranges; v && v->base != base; v = v->next)
        ;
    pthread_mutex_unlock(&dev->ranges_mu);
    return v;
}

/* Nothing queued on the copy stream can still touch a page after this. */
static int wait_copies(struct cuda_dev *dev)
{
    cudaError_t e = cudaEventSynchronize(dev->copy_done);
    return e == cudaSuccess ? 0 : cuda_fail(e, "waiting for the copy stream");
}

static int cuda_arena_map(struct backend *be, void *base, size_t page)
{
    struct cuda_dev *dev = dev_of(be);
    struct cuda_vrange *v = vrange_of(dev, base);
    int rc;

    if (!v || page >= v->n_pages)
        return KVD_EINTERNAL;
    if (fault_should_fail(v->tier == KVD_TIER_DEVICE ? FAULT_DEVICE_ALLOC : FAULT_HOST_ALLOC))
        return KVD_ENOMEM;
    if ((rc = cuda_dev_enter(dev)))
        return rc;
    char *at = v->base + page * v->page_bytes;
    if (v->tier == KVD_TIER_HOST) {
        if ((rc = memfd_arena_map(v->host, page)))
            return rc;
        cudaError_t e = cudaHostRegister(at, v->page_bytes, cudaHostRegisterPortable);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            memfd_arena_unmap(v->host, page);
            log_warn("cuda: pinning a %zu-byte host page: %s", v->page_bytes,
                     cudaGetErrorString(e));
            return KVD_ENOMEM;
        }
        return 0;
    }
    if (v->h[page])
        return KVD_EBADREQ;
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp prop = vmm_prop(dev, true);
    CUresult r = cu_drv->MemCreate(&h, v->page_bytes, &prop, 0);
    bool exportable = r == CUDA_SUCCESS;
    if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_VALUE) {
        /* No POSIX descriptors here: the page works, kv_export refuses it. */
        prop = vmm_prop(dev, false);
        r = cu_drv->MemCreate(&h, v->page_bytes, &prop, 0);
    }
    if (r != CUDA_SUCCESS) {
        if (r != CUDA_ERROR_OUT_OF_MEMORY)
            cu_fail(r, "cuMemCreate");
        return KVD_ENOMEM;
    }
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)at;
    CUmemAccessDesc ad;
    memset(&ad, 0, sizeof ad);
    ad.location = prop.location;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = cu_drv->MemMap(p, v->page_bytes, 0, h, 0)) != CUDA_SUCCESS) {
        cu_drv->MemRelease(h);
        return cu_fail(r, "cuMemMap");
    }
    if ((r = cu_drv->MemSetAccess(p, v->page_bytes, &ad, 1)) != CUDA_SUCCESS) {
        cu_drv->MemUnmap(p, v->page_bytes);
        cu_drv->MemRelease(h);
        return cu_fail(r, "cuMemSetAccess");
    }
    v->h[page] = h;
    v->exportable[page] = exportable;
    return 0;
}

static int vrange_unmap(struct cuda_dev *dev, struct cuda_vrange *v, size_t page)
{
    char *at = v->base + page * v->page_bytes;
    int rc;
    if ((rc = cuda_dev_enter(dev)) || (rc = wait_copies(dev)))
        return rc;
    if (v->tier == KVD_TIER_HOST) {
        if (!memfd_arena_mapped(v->host, page))
            return KVD_EBADREQ;
        cudaError_t e = cudaHostUnregister(at);
        if (e != cudaSuccess)
            return cuda_fail(e, "cudaHostUnregister");
        return memfd_arena_unmap(v->host, page);
    }
    if (!v->h[page])
        return KVD_EBADREQ;
    CUresult r = cu_drv->MemUnmap((CUdeviceptr)(uintptr_t)at, v->page_bytes);
    if (r != CUDA_SUCCESS)
        return cu_fail(r, "cuMemUnmap");
    r = cu_drv->MemRelease(v->h[page]);
    v->h[page] = 0;
    return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuMemRelease");
}

static int cuda_arena_unmap(struct backend *be, void *base, size_t page)
{
    struct cuda_dev *dev = dev_of(be);
    struct cuda_vrange *v = vrange_of(dev, base);
    return v && page < v->n_pages ? vrange_unmap(dev, v, page) : KVD_EINTERNAL;
}

static void cuda_arena_release(struct backend *be, void *base)
{
    struct cuda_dev *dev = dev_of(be);
    struct cuda_vrange *v = vrange_unlink(dev, base);
    if (!v)
        return;
    for (size_t i = 0; i < v->n_pages; i++)
        if (v->tier == KVD_TIER_HOST ? memfd_arena_mapped(v->host, i) : v->h[i] != 0)
            (void)vrange_unmap(dev, v, i);
    if (v->tier == KVD_TIER_HOST) {
        memfd_arena_release(v->host);
    } else {
        CUresult r =
            cu_drv->MemAddressFree((CUdeviceptr)(uintptr_t)v->base, v->page_bytes * v->n_pages);
        if (r != CUDA_SUCCESS)
            cu_fail(r, "cuMemAddressFree");
    }
    free(v->h);
    free(v->exportable);
    free(v);
}

static int cuda_arena_page_fd(struct backend *be, void *base, size_t page, bool writable, int *fd,
                              enum backend_fd_kind *kind)
{
    struct cuda_dev *dev = dev_of(be);
    struct cuda_vrange *v = vrange_of(dev, base);
    *fd = -1;
    *kind = BACKEND_FD_MEMFD;
    if (!v || page >= v->n_pages)
        return KVD_EINTERNAL;
    if (v->tier == KVD_TIER_HOST)
        return memfd_arena_fd(v->host, page, writable, fd);
    *kind = BACKEND_FD_CUDA_VMM;
    /* A VMM handle grants whatever access its importer sets. */
    if (!writable || !v->h[page] || !v->exportable[page])
        return KVD_EUNSUPPORTED;
    int rc = cuda_dev_enter(dev);
    if (rc)
        return rc;
    CUresult r = cu_drv->MemExportToShareableHandle(fd, v->h[page],
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
        *fd = -1;
        return cu_fail(r, "cuMemExportToShareableHandle");
    }
    return 0;
}

static void cuda_dev_release(struct cuda_dev *dev)
{
    pthread_mutex_destroy(&dev->mu);
    pthread_mutex_destroy(&dev->ranges_mu);
    if (dev->blas)
        cublasDestroy(dev->blas);
    if (dev->blas_ws)
        cudaFree(dev->blas_ws);
    if (dev->copy_done)
        cudaEventDestroy(dev->copy_done);
    if (dev->compute_mark)
        cudaEventDestroy(dev->compute_mark);
    if (dev->copy)
        cudaStreamDestroy(dev->copy);
    if (dev->compute)
        cudaStreamDestroy(dev->compute);
}

static void cuda_destroy(struct backend *be)
{
    struct cuda_backend *cb = be->impl;
    if (cuda_dev_enter(&cb->dev) == 0) {
        cudaDeviceSynchronize();
        cuda_dev_release(&cb->dev);
    }
    free(cb);
}

static int cuda_mem_info(struct backend *be, size_t *free_b, size_t *total_b)
{
    if (cuda_dev_enter(dev_of(be)))
        return KVD_EINTERNAL;
    cudaError_t e = cudaMemGetInfo(free_b, total_b);
    return e == cudaSuccess ? 0 : cuda_fail(e, "cudaMemGetInfo");
}

static const struct backend_ops cuda_ops = {
    .name = "cuda",
    .kind = BACKEND_CUDA,
    .mem_info = cuda_mem_info,
    .arena_alloc = cuda_arena_alloc,
    .arena_free = cuda_arena_free,
    .copy = cuda_copy,
    .copy_async = cuda_copy_async,
    .copy_wait = cuda_copy_wait,
    .zero = cuda_zero,
    .arena_granularity = cuda_arena_granularity,
    .arena_reserve = cuda_arena_reserve,
    .arena_map = cuda_arena_map,
    .arena_unmap = cuda_arena_unmap,
    .arena_release = cuda_arena_release,
    .arena_page_fd = cuda_arena_page_fd,
    .page_fd_read_only = 1u << KVD_TIER_HOST,
    .destroy = cuda_destroy,
};

int backend_cuda_new(int device, struct backend **out, struct kvd_error *err)
{
    struct cuda_backend *cb = NULL;
    struct cudaDeviceProp prop;
    int count = 0, rc = KVD_EUNSUPPORTED;
    cudaError_t e;

    *out = NULL;
    e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        kvd_error_set(err, KVD_EUNSUPPORTED,
                      "cuda backend unavailable: no usable CUDA device (%s: %s)",
                      cudaGetErrorName(e), cudaGetErrorString(e));
        (void)cudaGetLastError();
        return KVD_EUNSUPPORTED;
    }
    if (count == 0)
        return kvd_error_set(err, KVD_EUNSUPPORTED,
                             "cuda backend unavailable: no CUDA device present");
    if (device < 0 || device >= count)
        return kvd_error_set(err, KVD_EUNSUPPORTED,
                             "cuda backend unavailable: device %d does not exist (%d present)",
                             device, count);
    cb = calloc(1, sizeof *cb);
    if (!cb)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    cb->be.ops = &cuda_ops;
    cb->be.impl = cb;
    cb->dev.device = device;
    pthread_mutex_init(&cb->dev.mu, NULL);
    pthread_mutex_init(&cb->dev.ranges_mu, NULL);
    cuda_cur_device = -1; /* force cudaSetDevice below */
    rc = KVD_EINTERNAL;
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess)
        goto out_cuda;
    cuda_cur_device = device;
    /* The driver API (the VMM pool) next to the runtime, its entry points
     * asked of the runtime (cuda_drv.h: kvd does not link libcuda). */
    char drv_err[160];
    if (!(cu_drv = cuda_drv(drv_err, sizeof drv_err))) {
        log_err("cuda: the driver API: %s", drv_err);
        e = cudaErrorInitializationError;
        goto out_cuda;
    }
    snprintf(cb->dev.name, sizeof cb->dev.name, "%s", prop.name);
    cb->dev.n_sms = prop.multiProcessorCount;
    cb->dev.total_mem = prop.totalGlobalMem;
    /* The kernels need what sm_80 brought (bf16 conversions, up to 99 KiB
     * of shared memory per block for head_dim 256 prefill) and nothing
     * newer; the build carries SASS for 8.0/8.6/8.9/9.0 and PTX that newer
     * GPUs compile at load. */
    if (prop.major < 8) {
        rc = kvd_error_set(err, KVD_EUNSUPPORTED,
                           "cuda backend unavailable: device %d (%s) is compute capability %d.%d; "
                           "kvd's kernels need 8.0 or newer (Ampere, Ada, Hopper, Blackwell)",
                           device, prop.name, prop.major, prop.minor);
        goto out_free;
    }
    if ((e = cudaStreamCreateWithFlags(&cb->dev.compute, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&cb->dev.copy, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&cb->dev.compute_mark, cudaEventDisableTiming)) !=
            cudaSuccess ||
        (e = cudaEventCreateWithFlags(&cb->dev.copy_done, cudaEventDisableTiming)) != cudaSuccess)
        goto out_cuda;
    /* copy_done starts "complete": copy_wait before any copy returns at once. */
    if ((e = cudaEventRecord(cb->dev.copy_done, cb->dev.copy)) != cudaSuccess)
        goto out_cuda;
    if ((e = cudaMalloc(&cb->dev.blas_ws, BLAS_WS_BYTES)) != cudaSuccess)
        goto out_cuda;
    cublasStatus_t st = cublasCreate(&cb->dev.blas);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasSetStream(cb->dev.blas, cb->dev.compute);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasSetWorkspace(cb->dev.blas, cb->dev.blas_ws, BLAS_WS_BYTES);
    if (st != CUBLAS_STATUS_SUCCESS) {
        kvd_error_set(err, rc, "cuda backend: cuBLAS initialization failed (status %d)", (int)st);
        goto out_free;
    }
    cb->be.compute = compute_cuda_ops();
    log_info("cuda: device %d: %s, %d SMs, %.1f GiB", device, prop.name, prop.multiProcessorCount,
             (double)prop.totalGlobalMem / (1u << 30));
    *out = &cb->be;
    return 0;

out_cuda:
    kvd_error_set(err, rc, "cuda backend: device %d: %s (%s)", device, cudaGetErrorName(e),
                  cudaGetErrorString(e));
    (void)cudaGetLastError();
out_free:
    cuda_dev_release(&cb->dev);
    free(cb);
    return rc;
}
