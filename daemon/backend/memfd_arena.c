/* memfd_arena: elastic arenas of memfd pages (see memfd_arena.h). */
#include "memfd_arena.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvd/status.h"
#include "log.h"

#define MEMFD_OS_PAGE 4096u

size_t memfd_arena_granularity(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : MEMFD_OS_PAGE;
}

/* Each mapped page keeps a descriptor: the soft limit goes to the hard one
 * (once; kvd polls with epoll, never select). */
static void raise_nofile(void)
{
    static int done;
    struct rlimit rl;
    if (done++ || getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max)
        return;
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? (rlim_t)1 << 20 : rl.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &rl);
}

int memfd_arena_reserve(size_t page_bytes, size_t n_pages, struct memfd_arena **out)
{
    size_t g = memfd_arena_granularity();
    *out = NULL;
    if (page_bytes == 0 || n_pages == 0 || page_bytes % g || n_pages > SIZE_MAX / page_bytes)
        return KVD_EBADREQ;
    raise_nofile();
    struct memfd_arena *a = calloc(1, sizeof *a);
    if (!a)
        return KVD_ENOMEM;
    a->fds = malloc(sizeof *a->fds * n_pages);
    if (!a->fds) {
        free(a);
        return KVD_ENOMEM;
    }
    for (size_t i = 0; i < n_pages; i++)
        a->fds[i] = -1;
    /* Address space only: MAP_NORESERVE, no access, no memory behind it. */
    void *r = mmap(NULL, page_bytes * n_pages, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) {
        free(a->fds);
        free(a);
        return KVD_ENOMEM;
    }
    a->base = r;
    a->page_bytes = page_bytes;
    a->n_pages = n_pages;
    *out = a;
    return 0;
}

static int memfd_page(size_t bytes)
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

bool memfd_arena_mapped(const struct memfd_arena *a, size_t page)
{
    return page < a->n_pages && a->fds[page] >= 0;
}

int memfd_arena_map(struct memfd_arena *a, size_t page)
{
    if (page >= a->n_pages || a->fds[page] >= 0)
        return KVD_EBADREQ;
    char *at = a->base + page * a->page_bytes;
    int fd = memfd_page(a->page_bytes);
    if (fd < 0) {
        log_warn("memfd page of %zu bytes: %s", a->page_bytes, strerror(errno));
        return KVD_ENOMEM;
    }
    /* MAP_FIXED replaces the reservation in one step: the address is never
     * free for another mapping to land on. */
    if (mmap(at, a->page_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
        MAP_FAILED) {
        log_warn("mapping a %zu-byte memfd page: %s", a->page_bytes, strerror(errno));
        close(fd);
        return KVD_ENOMEM;
    }
#ifdef MADV_HUGEPAGE
    (void)madvise(at, a->page_bytes, MADV_HUGEPAGE); /* shmem THP, where the admin enabled it */
#endif
    a->fds[page] = fd;
    a->n_mapped++;
    return 0;
}

void memfd_arena_prefault(void *p, size_t bytes)
{
#ifdef MADV_POPULATE_WRITE
    static atomic_bool unsupported;
    if (bytes == 0 || atomic_load_explicit(&unsupported, memory_order_relaxed))
        return;
    if (madvise(p, bytes, MADV_POPULATE_WRITE) != 0 && errno == EINVAL &&
        !atomic_exchange(&unsupported, true))
        log_info("MADV_POPULATE_WRITE not supported (Linux < 5.14): fresh KV pages fault in on "
                 "first touch");
#else
    (void)p;
    (void)bytes;
#endif
}

int memfd_arena_unmap(struct memfd_arena *a, size_t page)
{
    if (!memfd_arena_mapped(a, page))
        return KVD_EBADREQ;
    char *at = a->base + page * a->page_bytes;
    /* Back to a reservation, again in one step (MAP_FIXED). */
    if (mmap(at, a->page_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
             -1, 0) == MAP_FAILED) {
        /* Out of mapping slots: the page stays mapped (and counted). */
        log_warn("unmapping a memfd page: %s", strerror(errno));
        return KVD_ENOMEM;
    }
    close(a->fds[page]);
    a->fds[page] = -1;
    a->n_mapped--;
    return 0;
}

int memfd_arena_fd(struct memfd_arena *a, size_t page, bool writable, int *fd)
{
    char path[64];
    *fd = -1;
    if (!memfd_arena_mapped(a, page))
        return KVD_EBADREQ;
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

void memfd_arena_release(struct memfd_arena *a)
{
    if (!a)
        return;
    for (size_t i = 0; i < a->n_pages; i++)
        if (a->fds[i] >= 0)
            close(a->fds[i]);
    if (a->base)
        munmap(a->base, a->page_bytes * a->n_pages);
    free(a->fds);
    free(a);
}
