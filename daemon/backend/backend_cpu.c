/* backend_cpu: the reference backend. Plain arenas are anonymous mappings
 * (huge pages when the kernel gives them, plain pages otherwise); paged
 * arenas (the KV pools, exportable by kv_export) are one reserved range
 * made of memfd pages, each its own file mapped MAP_SHARED, so a page can
 * be handed to another process by descriptor. Copies are memcpy, so
 * copy_async is synchronous and copy_wait has nothing to wait for. */
#include "backend.h"
#include "compute.h"
#include "fault.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

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

/* ---- paged arenas --------------------------------------------------------
 * One memfd per page (MFD_CLOEXEC, sealed against shrinking and growing, so
 * a client holding a writable descriptor cannot truncate it under kvd's own
 * mapping; mode 0400, so a client of another uid cannot reopen a read-only
 * descriptor read-write through /proc). kvd keeps every page's descriptor:
 * RLIMIT_NOFILE is raised to its hard limit and pages grow (by doubling)
 * until they fit in half of it. The arenas are found by address; callers
 * serialize (the kvmm lock). */
#define CPU_PAGE_TARGET (2u << 20)
#define CPU_OS_PAGE 4096u

struct cpu_paged {
    struct cpu_paged *next;
    char *base;
    size_t page_bytes, n_pages;
    int *fds; /* (n_pages) */
};

struct cpu_state {
    struct cpu_paged *paged;
    size_t fds_used; /* descriptors the paged arenas hold */
};

static size_t gcd_sz(size_t a, size_t b)
{
    while (b) {
        size_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Descriptors paged arenas may hold in all: half the (raised) limit. */
static size_t cpu_fd_budget(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return 512;
    if (rl.rlim_cur < rl.rlim_max) {
        struct rlimit up = rl;
        up.rlim_cur = rl.rlim_max == RLIM_INFINITY ? (rlim_t)1 << 20 : rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &up) == 0)
            rl = up;
    }
    if (rl.rlim_cur == RLIM_INFINITY)
        return (size_t)1 << 19;
    return (size_t)rl.rlim_cur / 2;
}

static int cpu_memfd_page(size_t bytes)
{
    int fd = memfd_create("kvd-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)bytes) != 0 || fchmod(fd, 0400) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int cpu_map_page(char *at, size_t bytes, int fd)
{
    void *m = mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (m == MAP_FAILED)
        return -1;
#ifdef MADV_HUGEPAGE
    (void)madvise(at, bytes, MADV_HUGEPAGE); /* shmem THP, where the admin enabled it */
#endif
    return 0;
}

static void cpu_paged_release(struct cpu_state *st, struct cpu_paged *a)
{
    for (size_t i = 0; i < a->n_pages; i++)
        if (a->fds[i] >= 0) {
            close(a->fds[i]);
            st->fds_used--;
        }
    if (a->base)
        munmap(a->base, a->page_bytes * a->n_pages);
    free(a->fds);
    free(a);
}

static int cpu_arena_alloc_paged(struct backend *be, enum kvd_tier tier, size_t unit,
                                 size_t n_units, size_t *units_per_page, void **out)
{
    struct cpu_state *st = be->impl;
    size_t upp, n_pages, budget;
    struct cpu_paged *a;

    *out = NULL;
    if (unit == 0 || n_units == 0)
        return KVD_EBADREQ;
    if (fault_should_fail(tier == KVD_TIER_DEVICE ? FAULT_DEVICE_ALLOC : FAULT_HOST_ALLOC))
        return KVD_ENOMEM;
    /* The fewest units whose bytes are a whole number of OS pages, times
     * what fills about 2 MiB. */
    size_t step = CPU_OS_PAGE / gcd_sz(unit, CPU_OS_PAGE);
    upp = CPU_PAGE_TARGET / unit;
    upp = upp < step ? step : upp / step * step;
    budget = cpu_fd_budget();
    budget = budget > st->fds_used + 64 ? budget - st->fds_used - 64 : 1;
    for (;;) {
        n_pages = (n_units + upp - 1) / upp;
        if (n_pages <= budget || upp >= n_units)
            break;
        upp *= 2;
    }
    if (n_pages > budget)
        return KVD_ENOMEM;
    if (upp > SIZE_MAX / unit || n_pages > SIZE_MAX / (upp * unit))
        return KVD_EBADREQ;
    a = calloc(1, sizeof *a);
    if (!a)
        return KVD_ENOMEM;
    a->page_bytes = upp * unit;
    a->n_pages = n_pages;
    a->fds = malloc(sizeof *a->fds * n_pages);
    if (!a->fds) {
        free(a);
        return KVD_ENOMEM;
    }
    for (size_t i = 0; i < n_pages; i++)
        a->fds[i] = -1;
    void *r = mmap(NULL, a->page_bytes * n_pages, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) {
        free(a->fds);
        free(a);
        return KVD_ENOMEM;
    }
    a->base = r;
    for (size_t i = 0; i < n_pages; i++) {
        int fd = cpu_memfd_page(a->page_bytes);
        if (fd < 0 || cpu_map_page(a->base + i * a->page_bytes, a->page_bytes, fd) != 0) {
            log_err("cpu backend: memfd page %zu of %zu (%zu bytes): %s", i, n_pages, a->page_bytes,
                    strerror(errno));
            if (fd >= 0)
                close(fd);
            cpu_paged_release(st, a);
            return KVD_ENOMEM;
        }
        a->fds[i] = fd;
        st->fds_used++;
    }
    a->next = st->paged;
    st->paged = a;
    *units_per_page = upp;
    *out = a->base;
    return 0;
}

static struct cpu_paged *cpu_paged_find(struct cpu_state *st, const void *arena,
                                        struct cpu_paged ***link)
{
    for (struct cpu_paged **pp = &st->paged; *pp; pp = &(*pp)->next)
        if ((*pp)->base == arena) {
            if (link)
                *link = pp;
            return *pp;
        }
    return NULL;
}

static int cpu_arena_page_fd(struct backend *be, void *arena, size_t page, bool writable, int *fd)
{
    struct cpu_paged *a = cpu_paged_find(be->impl, arena, NULL);
    char path[64];

    *fd = -1;
    if (!a || page >= a->n_pages || a->fds[page] < 0)
        return KVD_EINTERNAL;
    if (writable) {
        *fd = fcntl(a->fds[page], F_DUPFD_CLOEXEC, 0);
    } else {
        /* A new open file of the same memory, read-only: mmap(PROT_WRITE,
         * MAP_SHARED) on it fails with EACCES, and so does mprotect. */
        snprintf(path, sizeof path, "/proc/self/fd/%d", a->fds[page]);
        *fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    if (*fd < 0)
        return errno == EMFILE || errno == ENFILE || errno == ENOMEM ? KVD_ENOMEM : KVD_EINTERNAL;
    return 0;
}

static int cpu_arena_page_renew(struct backend *be, void *arena, size_t page)
{
    struct cpu_paged *a = cpu_paged_find(be->impl, arena, NULL);
    int fd;

    if (!a || page >= a->n_pages)
        return KVD_EINTERNAL;
    fd = cpu_memfd_page(a->page_bytes);
    if (fd < 0)
        return KVD_ENOMEM;
    /* MAP_FIXED replaces the old mapping in one step: the address never
     * becomes unmapped. */
    if (cpu_map_page(a->base + page * a->page_bytes, a->page_bytes, fd) != 0) {
        close(fd);
        return KVD_ENOMEM;
    }
    close(a->fds[page]);
    a->fds[page] = fd;
    return 0;
}

static void cpu_arena_free(struct backend *be, enum kvd_tier tier, void *p, size_t bytes)
{
    struct cpu_paged **link, *a;
    if (!p)
        return;
    if ((a = cpu_paged_find(be->impl, p, &link))) {
        *link = a->next;
        cpu_paged_release(be->impl, a);
        return;
    }
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
    struct cpu_state *st = be->impl;
    while (st && st->paged) {
        struct cpu_paged *a = st->paged;
        st->paged = a->next;
        cpu_paged_release(st, a);
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
    .arena_alloc_paged = cpu_arena_alloc_paged,
    .arena_page_fd = cpu_arena_page_fd,
    .arena_page_renew = cpu_arena_page_renew,
    .zero = cpu_zero,
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
