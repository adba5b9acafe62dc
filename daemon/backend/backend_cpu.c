/* backend_cpu: the reference backend. Plain arenas are anonymous mappings
 * (huge pages when the kernel gives them, plain pages otherwise); elastic
 * arenas (the KV pools, exportable by kv_export) are one reserved range
 * into which memfd pages are mapped and from which they are unmapped
 * (memfd_arena.h), so a page can be handed to another process by
 * descriptor. Copies are memcpy, so copy_async is synchronous and
 * copy_wait has nothing to wait for. */
#include "backend.h"
#include "compute.h"
#include "fault.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "log.h"
#include "memfd_arena.h"

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

/* ---- elastic arenas --------------------------------------------------------
 * memfd pages in a reserved range (memfd_arena.h), found by their base; the
 * callers serialize (the kvmm lock). */
struct cpu_state {
    struct memfd_arena *paged;
};

static struct memfd_arena *cpu_paged_find(struct cpu_state *st, const void *base,
                                          struct memfd_arena ***link)
{
    for (struct memfd_arena **pp = &st->paged; *pp; pp = &(*pp)->next)
        if ((*pp)->base == base) {
            if (link)
                *link = pp;
            return *pp;
        }
    return NULL;
}

static size_t cpu_arena_granularity(struct backend *be, enum kvd_tier tier)
{
    (void)be;
    (void)tier;
    return memfd_arena_granularity();
}

static int cpu_arena_reserve(struct backend *be, enum kvd_tier tier, size_t page_bytes,
                             size_t n_pages, void **base)
{
    struct cpu_state *st = be->impl;
    struct memfd_arena *a;
    *base = NULL;
    int rc = memfd_arena_reserve(page_bytes, n_pages, &a);
    if (rc)
        return rc;
    a->tier = (int)tier;
    a->next = st->paged;
    st->paged = a;
    *base = a->base;
    return 0;
}

static int cpu_arena_map(struct backend *be, void *base, size_t page)
{
    struct memfd_arena *a = cpu_paged_find(be->impl, base, NULL);
    if (!a)
        return KVD_EINTERNAL;
    if (fault_should_fail(a->tier == KVD_TIER_DEVICE ? FAULT_DEVICE_ALLOC : FAULT_HOST_ALLOC))
        return KVD_ENOMEM;
    return memfd_arena_map(a, page);
}

static int cpu_arena_unmap(struct backend *be, void *base, size_t page)
{
    struct memfd_arena *a = cpu_paged_find(be->impl, base, NULL);
    return a ? memfd_arena_unmap(a, page) : KVD_EINTERNAL;
}

static void cpu_arena_release(struct backend *be, void *base)
{
    struct memfd_arena **link, *a = cpu_paged_find(be->impl, base, &link);
    if (!a)
        return;
    *link = a->next;
    memfd_arena_release(a);
}

static int cpu_arena_page_fd(struct backend *be, void *base, size_t page, bool writable, int *fd,
                             enum backend_fd_kind *kind)
{
    struct memfd_arena *a = cpu_paged_find(be->impl, base, NULL);
    *fd = -1;
    *kind = BACKEND_FD_MEMFD;
    return a ? memfd_arena_fd(a, page, writable, fd) : KVD_EINTERNAL;
}

static void cpu_arena_free(struct backend *be, enum kvd_tier tier, void *p, size_t bytes)
{
    (void)be;
    (void)tier;
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

/* Both tiers are host memory (memfd pages, or one anonymous arena). */
static void cpu_prefault(struct backend *be, void *p, enum kvd_tier tier, size_t bytes)
{
    (void)be;
    (void)tier;
    memfd_arena_prefault(p, bytes);
}

static int cpu_copy_wait(struct backend *be)
{
    return 0;
}

static void cpu_destroy(struct backend *be)
{
    struct cpu_state *st = be->impl;
    while (st && st->paged) {
        struct memfd_arena *a = st->paged;
        st->paged = a->next;
        memfd_arena_release(a);
    }
    free(st);
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
    .arena_granularity = cpu_arena_granularity,
    .arena_reserve = cpu_arena_reserve,
    .arena_map = cpu_arena_map,
    .arena_unmap = cpu_arena_unmap,
    .arena_release = cpu_arena_release,
    .arena_page_fd = cpu_arena_page_fd,
    .page_fd_read_only = 1u << KVD_TIER_DEVICE | 1u << KVD_TIER_HOST,
    .zero = cpu_zero,
    .prefault = cpu_prefault,
    .destroy = cpu_destroy,
};

int backend_cpu_new(struct backend **out)
{
    struct backend *be = calloc(1, sizeof *be);

    *out = NULL;
    if (!be)
        return KVD_ENOMEM;
    be->impl = calloc(1, sizeof(struct cpu_state));
    if (!be->impl) {
        free(be);
        return KVD_ENOMEM;
    }
    be->ops = &cpu_ops;
    be->compute = compute_cpu_ops(); /* compute_cpu.c: the model's ops */
    *out = be;
    return 0;
}
