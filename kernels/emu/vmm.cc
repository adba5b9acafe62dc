// The CUDA virtual-memory API of the emulation build (include/cuda.h) on
// the CPU, with the driver's rules checked: a reservation is an address
// range (mmap'ed, inaccessible to the checks until something is mapped and
// its access set), a physical allocation is a memfd (so its POSIX export is
// a descriptor of the same memory, and an importer in another process maps
// what the exporter sees), a mapping is that memfd mapped MAP_FIXED into
// the range, and cuMemSetAccess registers it with the device-memory checks
// (cudart.cc). Each misuse is reported (kvd_emu_errors) and refused.
#include <cuda.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <mutex>

#include "emu_internal.h"

namespace kvd_emu
{
namespace
{

struct phys {
    int fd;
    size_t size;
    bool exportable; // created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    bool released;   // cuMemRelease was called
    bool imported;   // from another process's descriptor (not counted as this device's)
    int maps;        // live mappings of it
};

struct mapping {
    size_t size;
    CUmemGenericAllocationHandle h;
    bool access;                            // cuMemSetAccess gave the device access
    std::map<cudaStream_t, uint64_t> touch; // stream -> its last operation that used it
};

std::mutex g_vmm_mu; // everything below; taken before cudart.cc's lock, never after
std::map<CUmemGenericAllocationHandle, phys> g_phys;
std::map<uintptr_t, size_t> g_resv;  // base -> bytes
std::map<uintptr_t, mapping> g_maps; // base -> mapping
CUmemGenericAllocationHandle g_next_handle = 1;
size_t g_gran;
unsigned long long g_n_maps, g_n_unmaps;

size_t gran()
{
    if (!g_gran) {
        const char *e = getenv("KVD_EMU_VMM_GRANULARITY");
        char *end;
        unsigned long long v = e ? strtoull(e, &end, 0) : 0;
        if (e && (*end == 'M' || *end == 'm'))
            v <<= 20;
        else if (e && (*end == 'K' || *end == 'k'))
            v <<= 10;
        g_gran = v && (v & (v - 1)) == 0 && v % 4096 == 0 ? (size_t)v : (size_t)2 << 20;
    }
    return g_gran;
}

// The reservation holding [a, a + n) whole, or g_resv.end().
std::map<uintptr_t, size_t>::iterator resv_of(uintptr_t a, size_t n)
{
    auto it = g_resv.upper_bound(a);
    if (it == g_resv.begin())
        return g_resv.end();
    --it;
    if (a - it->first >= it->second || n > it->second - (a - it->first))
        return g_resv.end();
    return it;
}

// The mapping holding address a, or g_maps.end().
std::map<uintptr_t, mapping>::iterator map_at(uintptr_t a)
{
    auto it = g_maps.upper_bound(a);
    if (it == g_maps.begin())
        return g_maps.end();
    --it;
    return a - it->first < it->second.size ? it : g_maps.end();
}

// Whether [a, a + n) is covered exactly by whole mappings, back to back.
bool whole_mappings(uintptr_t a, size_t n)
{
    uintptr_t at = a;
    while (at < a + n) {
        auto it = g_maps.find(at);
        if (it == g_maps.end())
            return false;
        at += it->second.size;
    }
    return at == a + n && n > 0;
}

void phys_drop_if_unused(CUmemGenericAllocationHandle h)
{
    auto it = g_phys.find(h);
    if (it == g_phys.end() || !it->second.released || it->second.maps)
        return;
    close(it->second.fd);
    if (!it->second.imported)
        device_mem_give(it->second.size);
    g_phys.erase(it);
}

bool aligned(uint64_t v)
{
    return v % gran() == 0;
}

} // namespace

void vmm_touch(const void *p, size_t n)
{
    work_mark w = current_work();
    if (!w.s || !n)
        return;
    std::lock_guard<std::mutex> g(g_vmm_mu);
    for (uintptr_t a = (uintptr_t)p; a < (uintptr_t)p + n;) {
        auto it = map_at(a);
        if (it == g_maps.end())
            return;
        uint64_t &seq = it->second.touch[w.s];
        if (seq < w.seq)
            seq = w.seq;
        a = it->first + it->second.size;
    }
}

bool vmm_describe(uintptr_t a, char *buf, size_t len)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    auto m = map_at(a);
    if (m != g_maps.end()) {
        if (m->second.access)
            return false;
        snprintf(buf, len,
                 "byte %zu of a %zu-byte VMM mapping at 0x%zx whose access was never set "
                 "(cuMemSetAccess)",
                 (size_t)(a - m->first), m->second.size, (size_t)m->first);
        return true;
    }
    auto r = resv_of(a, 1);
    if (r == g_resv.end())
        return false;
    snprintf(buf, len, "byte %zu of a %zu-byte VMM reservation at 0x%zx, where nothing is mapped",
             (size_t)(a - r->first), r->second, (size_t)r->first);
    return true;
}

void vmm_forget_stream(cudaStream_t s)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    for (auto &m : g_maps)
        m.second.touch.erase(s);
}

} // namespace kvd_emu

using namespace kvd_emu;

extern "C" {

void kvd_emu_vmm_set_granularity(size_t bytes)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    g_gran = bytes;
}

void kvd_emu_vmm_get_counts(struct kvd_emu_vmm_counts *out)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    out->reservations = g_resv.size();
    out->handles = 0;
    for (auto &p : g_phys)
        out->handles += !p.second.released;
    out->mappings = g_maps.size();
    out->maps = g_n_maps;
    out->unmaps = g_n_unmaps;
}

CUresult cuInit(unsigned int flags)
{
    return flags ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    if (!device || ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **str)
{
    switch (error) {
#define N(x)                                                                                       \
    case x:                                                                                        \
        *str = #x;                                                                                 \
        return CUDA_SUCCESS;
        N(CUDA_SUCCESS)
        N(CUDA_ERROR_INVALID_VALUE)
        N(CUDA_ERROR_OUT_OF_MEMORY)
        N(CUDA_ERROR_NOT_INITIALIZED)
        N(CUDA_ERROR_INVALID_DEVICE)
        N(CUDA_ERROR_INVALID_HANDLE)
        N(CUDA_ERROR_ILLEGAL_STATE)
        N(CUDA_ERROR_NOT_PERMITTED)
        N(CUDA_ERROR_NOT_SUPPORTED)
        N(CUDA_ERROR_UNKNOWN)
#undef N
    }
    *str = "CUDA_ERROR_UNKNOWN";
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **str)
{
    return cuGetErrorName(error, str);
}

static bool prop_ok(const CUmemAllocationProp *prop, const char *api)
{
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id != 0) {
        report("%s: the allocation properties must be pinned memory on device 0", api);
        return false;
    }
    return true;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option)
{
    if (!granularity || !prop_ok(prop, "cuMemGetAllocationGranularity") ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_vmm_mu);
    *granularity = gran();
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    (void)addr; // a hint: the emulator places ranges where mmap does
    std::lock_guard<std::mutex> g(g_vmm_mu);
    if (!ptr || flags) {
        report("cuMemAddressReserve: %s", !ptr ? "NULL pointer" : "flags must be 0");
        return CUDA_ERROR_INVALID_VALUE;
    }
    *ptr = 0;
    if (!size || !aligned(size) ||
        (alignment && (!aligned(alignment) || alignment & (alignment - 1)))) {
        report("cuMemAddressReserve: %zu bytes aligned to %zu: both must be multiples of the "
               "allocation granularity (%zu), the alignment a power of two",
               size, alignment, gran());
        return CUDA_ERROR_INVALID_VALUE;
    }
    size_t al = alignment > gran() ? alignment : gran();
    // Accessible memory behind the range, so that a stray access the checks
    // report does not also crash the test that made it.
    char *r = (char *)mmap(nullptr, size + al, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)r + al - 1) / al * al;
    if (base > (uintptr_t)r)
        munmap(r, base - (uintptr_t)r);
    if ((uintptr_t)r + size + al > base + size)
        munmap((char *)base + size, (uintptr_t)r + size + al - (base + size));
    g_resv[base] = size;
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    auto it = g_resv.find((uintptr_t)ptr);
    if (it == g_resv.end() || it->second != size) {
        report("cuMemAddressFree(0x%llx, %zu): not a reservation (free the whole range "
               "cuMemAddressReserve returned)",
               ptr, size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto m = g_maps.lower_bound((uintptr_t)ptr);
    if (m != g_maps.end() && m->first < (uintptr_t)ptr + size) {
        report("cuMemAddressFree(0x%llx, %zu): 0x%zx is still mapped (cuMemUnmap it first)", ptr,
               size, (size_t)m->first);
        return CUDA_ERROR_INVALID_VALUE;
    }
    munmap((void *)(uintptr_t)ptr, size);
    g_resv.erase(it);
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags)
{
    if (!handle || flags || !prop_ok(prop, "cuMemCreate"))
        return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_vmm_mu);
    *handle = 0;
    if (!size || !aligned(size)) {
        report("cuMemCreate: %zu bytes is not a multiple of the allocation granularity (%zu)", size,
               gran());
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE &&
        prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (!device_mem_take(size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    int fd = memfd_create("kvd-emu-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0)
            close(fd);
        device_mem_give(size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUmemGenericAllocationHandle h = g_next_handle++;
    g_phys[h] =
        phys{fd,    size,  prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
             false, false, 0};
    *handle = h;
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    auto it = g_phys.find(handle);
    if (it == g_phys.end() || it->second.released) {
        report("cuMemRelease(%llu): not a live handle (released twice, or never created)", handle);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (it->second.maps)
        // CUDA keeps the memory until the last mapping goes; kvd's backend
        // unmaps before it releases, so this is lost bookkeeping.
        report("cuMemRelease(%llu): the handle is still mapped %d time(s) (unmap it first)", handle,
               it->second.maps);
    it->second.released = true;
    phys_drop_if_unused(handle);
    return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    uintptr_t a = (uintptr_t)ptr;
    auto it = g_phys.find(handle);
    if (it == g_phys.end() || it->second.released) {
        report("cuMemMap(0x%llx): handle %llu is not live", ptr, handle);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (flags || !size || !aligned(a) || !aligned(size) || !aligned(offset) ||
        offset > it->second.size || size > it->second.size - offset) {
        report("cuMemMap(0x%llx, %zu, offset %zu): address, size and offset must be multiples of "
               "the allocation granularity (%zu) within the %zu-byte allocation, flags 0",
               ptr, size, offset, gran(), it->second.size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (resv_of(a, size) == g_resv.end()) {
        report("cuMemMap(0x%llx, %zu): the range is not inside one reservation "
               "(cuMemAddressReserve)",
               ptr, size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto m = g_maps.lower_bound(a);
    bool over = m != g_maps.end() && m->first < a + size;
    if (!over && m != g_maps.begin()) {
        --m;
        over = a - m->first < m->second.size;
    }
    if (over) {
        report("cuMemMap(0x%llx, %zu): the range overlaps the mapping at 0x%zx (unmap it first)",
               ptr, size, (size_t)m->first);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (mmap((void *)a, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, it->second.fd,
             (off_t)offset) == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g_maps[a] = mapping{size, handle, false, {}};
    it->second.maps++;
    g_n_maps++;
    return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    uintptr_t a = (uintptr_t)ptr;
    if (!desc || count != 1 || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        desc->location.id != 0) {
        report("cuMemSetAccess(0x%llx): one descriptor for device 0 is expected", ptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!aligned(a) || !aligned(size) || !whole_mappings(a, size)) {
        report("cuMemSetAccess(0x%llx, %zu): the range must be whole mappings, mapped "
               "(cuMemMap) first",
               ptr, size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    bool on = desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ||
              desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READ;
    for (uintptr_t at = a; at < a + size;) {
        mapping &m = g_maps[at];
        if (on && !m.access)
            register_alloc(at, m.size, ALLOC_DEVICE, true);
        else if (!on && m.access)
            unregister_alloc(at);
        m.access = on;
        at += m.size;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    uintptr_t a = (uintptr_t)ptr;
    if (!aligned(a) || !aligned(size) || !size) {
        report("cuMemUnmap(0x%llx, %zu): address and size must be multiples of the allocation "
               "granularity (%zu)",
               ptr, size, gran());
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (resv_of(a, size) == g_resv.end()) {
        report("cuMemUnmap(0x%llx, %zu): the range is not inside one reservation", ptr, size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!whole_mappings(a, size)) {
        report("cuMemUnmap(0x%llx, %zu): the range is not whole mappings (part of one, or "
               "nothing mapped)",
               ptr, size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    // In use: device work that used it and that the host has not waited
    // for may still run on a GPU (here it ran at once: this is the order
    // a GPU needs).
    for (uintptr_t at = a; at < a + size; at += g_maps[at].size)
        for (auto &t : g_maps[at].touch)
            if (!work_done(t.first, t.second)) {
                report("cuMemUnmap(0x%llx, %zu): still in use: operation %llu of stream %p used "
                       "0x%zx and the host has not waited for it (synchronize the stream, or an "
                       "event recorded after it, first)",
                       ptr, size, (unsigned long long)t.second, (void *)t.first, (size_t)at);
                return CUDA_ERROR_ILLEGAL_STATE;
            }
    for (uintptr_t at = a; at < a + size;) {
        auto m = g_maps.find(at);
        size_t n = m->second.size;
        CUmemGenericAllocationHandle h = m->second.h;
        if (m->second.access)
            unregister_alloc(at);
        // Back to plain reserved memory, in one step.
        mmap((void *)at, n, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        g_maps.erase(m);
        g_phys[h].maps--;
        phys_drop_if_unused(h);
        g_n_unmaps++;
        at += n;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType,
                                      unsigned long long flags)
{
    std::lock_guard<std::mutex> g(g_vmm_mu);
    auto it = g_phys.find(handle);
    if (!shareableHandle || flags || it == g_phys.end() || it->second.released) {
        report("cuMemExportToShareableHandle(%llu): not a live handle", handle);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (!it->second.exportable) {
        report("cuMemExportToShareableHandle(%llu): the allocation was not created with "
               "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes",
               handle);
        return CUDA_ERROR_NOT_PERMITTED;
    }
    int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)shareableHandle = fd;
    return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        CUmemAllocationHandleType shHandleType)
{
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    *handle = 0;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    int fd = (int)(intptr_t)osHandle;
    struct stat sb;
    std::lock_guard<std::mutex> g(g_vmm_mu);
    if (fd < 0 || fstat(fd, &sb) != 0 || sb.st_size <= 0 || !aligned((uint64_t)sb.st_size)) {
        report("cuMemImportFromShareableHandle(%d): not the descriptor of an exported allocation",
               fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUmemGenericAllocationHandle h = g_next_handle++;
    g_phys[h] = phys{own, (size_t)sb.st_size, false, false, true, 0};
    *handle = h;
    return CUDA_SUCCESS;
}

} // extern "C"
