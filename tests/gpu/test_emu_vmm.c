/* The CUDA emulator's virtual-memory calls (KVD_CUDA=EMULATE builds only,
 * docs/emulation.md "The virtual-memory API"): each rule of the driver the
 * KV pools rely on is broken once and must be reported and refused, and
 * what is right must work: granularity, mapping an unreserved range or
 * over a mapping, device access before cuMemSetAccess, unmapping a range
 * still in use or not reserved, releasing a handle still mapped, freeing
 * a reservation still mapped, and POSIX-descriptor export and import
 * sharing the same memory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/gpu_fixture.h"

#define G ((size_t)2 << 20) /* the emulator's granularity (its default) */

static CUmemAllocationProp prop(bool exportable)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p.requestedHandleTypes =
        exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    return p;
}

static const CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0},
                                   CU_MEM_ACCESS_FLAGS_PROT_READWRITE};

/* The last call was reported once, saying `what`. */
static void reported(const char *what)
{
    unsigned long n = gpu_emu_reports();
    if (n != 1)
        fail_msg("%lu reports where one was expected (%s); the latest: %s", n, what,
                 kvd_emu_last_report());
    if (!strstr(kvd_emu_last_report(), what))
        fail_msg("the report '%s' does not say '%s'", kvd_emu_last_report(), what);
}

static CUmemGenericAllocationHandle create(bool exportable)
{
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp p = prop(exportable);
    assert_int_equal(cuMemCreate(&h, G, &p, 0), CUDA_SUCCESS);
    return h;
}

/* A reservation of n granules with handle h mapped (and its access set) at
 * granule `at`. */
static CUdeviceptr reserve(size_t n)
{
    CUdeviceptr p = 0;
    assert_int_equal(cuMemAddressReserve(&p, n * G, 0, 0, 0), CUDA_SUCCESS);
    assert_int_equal(p % G, 0);
    return p;
}

static void map_rw(CUdeviceptr at, CUmemGenericAllocationHandle h)
{
    assert_int_equal(cuMemMap(at, G, 0, h, 0), CUDA_SUCCESS);
    assert_int_equal(cuMemSetAccess(at, G, &rw, 1), CUDA_SUCCESS);
}

static void test_granularity(void **state)
{
    CUmemAllocationProp p = prop(false);
    size_t g = 0;
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr r = 0;
    assert_int_equal(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                     CUDA_SUCCESS);
    assert_int_equal(g, G);
    assert_int_equal(cuMemCreate(&h, G / 2, &p, 0), CUDA_ERROR_INVALID_VALUE);
    reported("granularity");
    assert_int_equal(cuMemAddressReserve(&r, G + 4096, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    reported("granularity");
    r = reserve(2);
    h = create(false);
    assert_int_equal(cuMemMap(r + 4096, G, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    reported("granularity");
    map_rw(r, h);
    assert_int_equal(cuMemUnmap(r, G / 2), CUDA_ERROR_INVALID_VALUE);
    reported("granularity");
    assert_int_equal(cuMemUnmap(r, G), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(h), CUDA_SUCCESS);
    assert_int_equal(cuMemAddressFree(r, 2 * G), CUDA_SUCCESS);
}

static void test_map_unreserved_or_mapped(void **state)
{
    CUdeviceptr r = reserve(2), gone = reserve(1);
    CUmemGenericAllocationHandle a = create(false), b = create(false);
    assert_int_equal(cuMemAddressFree(gone, G), CUDA_SUCCESS);
    assert_int_equal(cuMemMap(gone, G, 0, a, 0), CUDA_ERROR_INVALID_VALUE);
    reported("not inside one reservation");
    assert_int_equal(cuMemMap(r + G, 2 * G, 0, a, 0), CUDA_ERROR_INVALID_VALUE);
    gpu_emu_reports(); /* past the allocation and the reservation: either report */
    assert_int_equal(cuMemMap(r, G, 0, a, 0), CUDA_SUCCESS);
    assert_int_equal(cuMemMap(r, G, 0, b, 0), CUDA_ERROR_INVALID_VALUE);
    reported("overlaps the mapping");
    assert_int_equal(cuMemMap(r + G, G, 0, b, 0), CUDA_SUCCESS);
    assert_int_equal(cuMemSetAccess(r, 2 * G, &rw, 1), CUDA_SUCCESS); /* two mappings at once */
    assert_int_equal(cuMemUnmap(r, 2 * G), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(a), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(b), CUDA_SUCCESS);
    assert_int_equal(cuMemAddressFree(r, 2 * G), CUDA_SUCCESS);
}

static void test_access_before_set_access(void **state)
{
    CUdeviceptr r = reserve(2);
    CUmemGenericAllocationHandle h = create(false);
    unsigned char host[256];
    void *at = (void *)(uintptr_t)r;
    memset(host, 7, sizeof host);
    assert_int_equal(cuMemMap(r, G, 0, h, 0), CUDA_SUCCESS);
    assert_int_not_equal(cudaMemcpy(at, host, sizeof host, cudaMemcpyHostToDevice), cudaSuccess);
    reported("cuMemSetAccess");
    assert_int_not_equal(cudaMemset(at, 0, 64), cudaSuccess);
    reported("cuMemSetAccess");
    /* Nothing mapped at all: said so too. */
    assert_int_not_equal(cudaMemset((char *)at + G, 0, 64), cudaSuccess);
    reported("nothing is mapped");
    (void)cudaGetLastError();
    assert_int_equal(cuMemSetAccess(r + G, G, &rw, 1), CUDA_ERROR_INVALID_VALUE);
    reported("mapped (cuMemMap) first");
    assert_int_equal(cuMemSetAccess(r, G, &rw, 1), CUDA_SUCCESS);
    assert_int_equal(cudaMemcpy(at, host, sizeof host, cudaMemcpyHostToDevice), cudaSuccess);
    unsigned char back[256];
    assert_int_equal(cudaMemcpy(back, at, sizeof back, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_memory_equal(back, host, sizeof host);
    assert_int_equal(cuMemUnmap(r, G), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(h), CUDA_SUCCESS);
    assert_int_equal(cuMemAddressFree(r, 2 * G), CUDA_SUCCESS);
}

static void test_unmap_in_use(void **state)
{
    cudaStream_t s;
    cudaEvent_t ev;
    CUdeviceptr r = reserve(1);
    CUmemGenericAllocationHandle h = create(false);
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    map_rw(r, h);
    /* Work on a stream used it and nobody waited: on a GPU it may run still. */
    assert_int_equal(cudaMemsetAsync((void *)(uintptr_t)r, 1, 4096, s), cudaSuccess);
    assert_int_equal(cuMemUnmap(r, G), CUDA_ERROR_ILLEGAL_STATE);
    reported("still in use");
    /* An event recorded after it, waited for: done. */
    assert_int_equal(cudaEventRecord(ev, s), cudaSuccess);
    assert_int_equal(cudaEventSynchronize(ev), cudaSuccess);
    assert_int_equal(cuMemUnmap(r, G), CUDA_SUCCESS);
    /* Again, waited for through the stream. */
    map_rw(r, h);
    assert_int_equal(cudaMemsetAsync((void *)(uintptr_t)r, 2, 4096, s), cudaSuccess);
    assert_int_equal(cudaEventRecord(ev, s), cudaSuccess); /* recorded, not waited for */
    assert_int_equal(cuMemUnmap(r, G), CUDA_ERROR_ILLEGAL_STATE);
    reported("still in use");
    assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
    assert_int_equal(cuMemUnmap(r, G), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(h), CUDA_SUCCESS);
    assert_int_equal(cuMemAddressFree(r, G), CUDA_SUCCESS);
    cudaEventDestroy(ev);
    cudaStreamDestroy(s);
}

static void test_unmap_unreserved_or_partial(void **state)
{
    CUdeviceptr r = reserve(4), gone = reserve(1);
    CUmemGenericAllocationHandle h = create(false);
    assert_int_equal(cuMemAddressFree(gone, G), CUDA_SUCCESS);
    assert_int_equal(cuMemUnmap(gone, G), CUDA_ERROR_INVALID_VALUE);
    reported("not inside one reservation");
    assert_int_equal(cuMemUnmap(r, G), CUDA_ERROR_INVALID_VALUE); /* nothing mapped there */
    reported("not whole mappings");
    map_rw(r + G, h);
    assert_int_equal(cuMemUnmap(r + G, 2 * G), CUDA_ERROR_INVALID_VALUE); /* past it */
    reported("not whole mappings");
    assert_int_equal(cuMemAddressFree(r, 4 * G), CUDA_ERROR_INVALID_VALUE);
    reported("still mapped");
    assert_int_equal(cuMemAddressFree(r, 2 * G), CUDA_ERROR_INVALID_VALUE);
    reported("not a reservation");
    assert_int_equal(cuMemUnmap(r + G, G), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(h), CUDA_SUCCESS);
    assert_int_equal(cuMemAddressFree(r, 4 * G), CUDA_SUCCESS);
}

static void test_release_still_mapped(void **state)
{
    CUdeviceptr r = reserve(1);
    CUmemGenericAllocationHandle h = create(false);
    map_rw(r, h);
    assert_int_equal(cuMemRelease(h), CUDA_SUCCESS); /* legal CUDA: the memory lives on */
    reported("still mapped");
    assert_int_equal(cudaMemset((void *)(uintptr_t)r, 3, 64), cudaSuccess);
    assert_int_equal(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
    reported("not a live handle");
    assert_int_equal(cuMemMap(r, G, 0, h, 0), CUDA_ERROR_INVALID_HANDLE);
    reported("not live");
    struct kvd_emu_vmm_counts c;
    kvd_emu_vmm_get_counts(&c);
    assert_int_equal(c.mappings, 1);
    assert_int_equal(cuMemUnmap(r, G), CUDA_SUCCESS); /* frees it */
    kvd_emu_vmm_get_counts(&c);
    assert_int_equal(c.mappings, 0);
    assert_int_equal(cuMemAddressFree(r, G), CUDA_SUCCESS);
}

static void test_export_import(void **state)
{
    CUdeviceptr a = reserve(1), b = reserve(1);
    CUmemGenericAllocationHandle h = create(true), plain = create(false), in = 0;
    unsigned char pat[4096], back[4096];
    int fd = -1;
    for (size_t i = 0; i < sizeof pat; i++)
        pat[i] = (unsigned char)(i * 13 + 1);
    map_rw(a, h);
    assert_int_equal(cudaMemcpy((void *)(uintptr_t)a, pat, sizeof pat, cudaMemcpyHostToDevice),
                     cudaSuccess);
    assert_int_equal(
        cuMemExportToShareableHandle(&fd, plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        CUDA_ERROR_NOT_PERMITTED);
    reported("requestedHandleTypes");
    assert_int_equal(
        cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        CUDA_SUCCESS);
    assert_true(fd >= 0);
    /* What another process does: import, map into its own range, read. */
    assert_int_equal(cuMemImportFromShareableHandle(&in, (void *)(intptr_t)fd,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                     CUDA_SUCCESS);
    map_rw(b, in);
    assert_int_equal(cudaMemcpy(back, (void *)(uintptr_t)b, sizeof back, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    assert_memory_equal(back, pat, sizeof pat);
    /* The same memory both ways, and it outlives the exporter's handle. */
    assert_int_equal(cudaMemset((void *)(uintptr_t)b, 0x5a, 16), cudaSuccess);
    assert_int_equal(cudaMemcpy(back, (void *)(uintptr_t)a, 16, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    assert_int_equal(back[0], 0x5a);
    assert_int_equal(cuMemUnmap(a, G), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(h), CUDA_SUCCESS);
    assert_int_equal(cudaMemcpy(back, (void *)(uintptr_t)b, 32, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    assert_int_equal(back[15], 0x5a);
    assert_int_equal(back[16], pat[16]);
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    CUmemGenericAllocationHandle bad = 0;
    assert_int_equal(cuMemImportFromShareableHandle(&bad, (void *)(intptr_t)pfd[0],
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                     CUDA_ERROR_INVALID_VALUE);
    reported("not the descriptor of an exported allocation");
    close(pfd[0]);
    close(pfd[1]);
    assert_int_equal(cuMemUnmap(b, G), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(in), CUDA_SUCCESS);
    assert_int_equal(cuMemRelease(plain), CUDA_SUCCESS);
    assert_int_equal(cuMemAddressFree(a, G), CUDA_SUCCESS);
    assert_int_equal(cuMemAddressFree(b, G), CUDA_SUCCESS);
    close(fd);
}

static void test_device_memory_counted(void **state)
{
    size_t free0, free1, total;
    assert_int_equal(cudaMemGetInfo(&free0, &total), cudaSuccess);
    CUmemGenericAllocationHandle h = create(false);
    assert_int_equal(cudaMemGetInfo(&free1, &total), cudaSuccess);
    assert_int_equal(free0 - free1, G);
    assert_int_equal(cuMemRelease(h), CUDA_SUCCESS);
    assert_int_equal(cudaMemGetInfo(&free1, &total), cudaSuccess);
    assert_int_equal(free1, free0);
    /* More than the device has: out of memory, not a misuse. */
    CUmemAllocationProp p = prop(false);
    assert_int_equal(cuMemCreate(&h, (total / G + 1) * G, &p, 0), CUDA_ERROR_OUT_OF_MEMORY);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || cuInit(0) != CUDA_SUCCESS)
        return GPU_SKIP;
    gpu_emu_reports();
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_granularity),
        GPU_TEST(test_map_unreserved_or_mapped),
        GPU_TEST(test_access_before_set_access),
        GPU_TEST(test_unmap_in_use),
        GPU_TEST(test_unmap_unreserved_or_partial),
        GPU_TEST(test_release_still_mapped),
        GPU_TEST(test_export_import),
        GPU_TEST(test_device_memory_counted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
