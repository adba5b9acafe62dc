/* backend_cpu: the reference backend. Arenas are anonymous mappings (huge
 * pages when the kernel gives them, plain pages otherwise); copies are
 * memcpy, so copy_async is synchronous and copy_wait has nothing to wait for. */
#include "backend.h"
#include "compute.h"
#include "fault.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvd/status.h"

#define CPU_HUGE_PAGE (2u << 20) /* bytes; x86-64 and arm64 default huge page */

/* A mapping of `bytes` rounded up to whole huge pages when huge pages are
 * tried, so arena_free can unmap the same length it mapped. */
static size_t cpu_map_len(size_t bytes)
{
    if (bytes >= CPU_HUGE_PAGE)
        return (bytes + CPU_HUGE_PAGE - 1) / CPU_HUGE_PAGE * CPU_HUGE_PAGE;
    return bytes;
}

static int cpu_arena_alloc(struct backend *be, enum kvd_tier tier, size_t bytes, void **out)
{
    size_t len = cpu_map_len(bytes);
    void *p = MAP_FAILED;

    *out = NULL;
    if (bytes == 0)
        return KVD_EBADREQ;
    if (fault_should_fail(tier == KVD_TIER_DEVICE ? FAULT_DEVICE_ALLOC : FAULT_HOST_ALLOC))
        return KVD_ENOMEM;
#ifdef MAP_HUGETLB
    /* Reserved huge pages exist only where the admin configured them; the
     * fallback below is the common case. */
    if (len >= CPU_HUGE_PAGE)
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1,
                 0);
#endif
    if (p == MAP_FAILED) {
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return KVD_ENOMEM;
#ifdef MADV_HUGEPAGE
        if (len >= CPU_HUGE_PAGE)
            (void)madvise(p, len, MADV_HUGEPAGE); /* a hint: failure is harmless */
#endif
    }
    *out = p; /* anonymous mappings are zero-filled */
    return 0;
}

static void cpu_arena_free(struct backend *be, enum kvd_tier tier, void *p, size_t bytes)
{
    if (p)
        munmap(p, cpu_map_len(bytes));
}

static int cpu_copy(struct backend *be, void *dst, enum kvd_tier dst_tier, const void *src,
                    enum kvd_tier src_tier, size_t bytes)
{
    if (fault_should_fail(FAULT_COPY))
        return KVD_EINTERNAL;
    if (bytes)
        memmove(dst, src, bytes);
    return 0;
}

static int cpu_zero(struct backend *be, void *dst, enum kvd_tier tier, size_t bytes)
{
    if (fault_should_fail(FAULT_COPY))
        return KVD_EINTERNAL;
    if (bytes)
        memset(dst, 0, bytes);
    return 0;
}

static int cpu_copy_wait(struct backend *be)
{
    return 0;
}

static void cpu_destroy(struct backend *be)
{
    free(be);
}

static int cpu_mem_info(struct backend *be, size_t *free_b, size_t *total_b)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    (void)be;
    if (pages <= 0 || psz <= 0)
        return KVD_EUNSUPPORTED;
    *free_b = *total_b = (size_t)pages * (size_t)psz;
    return 0;
}

static const struct backend_ops cpu_ops = {
    .name = "cpu",
    .kind = BACKEND_CPU,
    .mem_info = cpu_mem_info,
    .arena_alloc = cpu_arena_alloc,
    .arena_free = cpu_arena_free,
    .copy = cpu_copy,
    .copy_async = cpu_copy,
    .copy_wait = cpu_copy_wait,
    .zero = cpu_zero,
    .destroy = cpu_destroy,
};

int backend_cpu_new(struct backend **out)
{
    struct backend *be = calloc(1, sizeof *be);

    *out = NULL;
    if (!be)
        return KVD_ENOMEM;
    be->ops = &cpu_ops;
    be->compute = compute_cpu_ops(); /* compute_cpu.c: the model's ops */
    *out = be;
    return 0;
}
