/* memfd_arena: an elastic host-memory arena made of memfd pages, shared by
 * the cpu backend (both tiers) and the cuda backend's host tier. One
 * address range is reserved once (PROT_NONE); a page gets memory by
 * mapping a fresh memfd over its place (MAP_SHARED | MAP_FIXED) and gives
 * it back by mapping PROT_NONE anonymous memory over it, so the range
 * stays contiguous and reserved and slot s stays at base + s * unit. A
 * mapped page's descriptor can be handed to another process (kv_export).
 * Not thread-safe: the caller serializes (the kvmm lock). */
#ifndef KVD_MEMFD_ARENA_H
#define KVD_MEMFD_ARENA_H

#include <stdbool.h>
#include <stddef.h>

struct memfd_arena {
    struct memfd_arena *next; /* the backend's list, found by base */
    char *base;
    size_t page_bytes, n_pages;
    int *fds; /* (n_pages) the mapped pages' memfds, -1 where unmapped */
    size_t n_mapped;
    int tier; /* enum kvd_tier: the caller's, for fault injection */
};

/* The OS page: what page_bytes must be a multiple of. */
size_t memfd_arena_granularity(void);
/* Reserves n_pages pages of page_bytes (nothing mapped). 0, KVD_EBADREQ or
 * KVD_ENOMEM. RLIMIT_NOFILE is raised to its hard limit on first use: each
 * mapped page keeps one descriptor. */
int memfd_arena_reserve(size_t page_bytes, size_t n_pages, struct memfd_arena **out);
/* Maps a new zero-filled memfd at page `page`. 0, KVD_EBADREQ (not a page,
 * or mapped already) or KVD_ENOMEM (out of memory or descriptors). The
 * memfd is sealed against resizing and has mode 0400, so a holder of a
 * descriptor can neither truncate it under kvd nor reopen a read-only one
 * read-write through /proc. */
int memfd_arena_map(struct memfd_arena *a, size_t page);
/* Puts reserved, inaccessible memory back at page `page` and closes its
 * memfd (processes that hold a descriptor keep the memory). 0 or
 * KVD_EBADREQ (not mapped). */
int memfd_arena_unmap(struct memfd_arena *a, size_t page);
/* A new descriptor of mapped page `page`: a dup (writable), or a fresh
 * O_RDONLY open of the same memory that cannot be mapped writable. 0,
 * KVD_EBADREQ (not mapped), KVD_ENOMEM (out of descriptors) or
 * KVD_EINTERNAL. */
int memfd_arena_fd(struct memfd_arena *a, size_t page, bool writable, int *fd);
bool memfd_arena_mapped(const struct memfd_arena *a, size_t page);
/* Populates bytes at p (inside mapped pages) writable without writing them
 * (MADV_POPULATE_WRITE): the page faults a first touch would take, taken in
 * one call, several times cheaper per page on a virtual machine. Safe while
 * other threads copy into the same pages (nothing is written), harmless on
 * pages already resident. Does nothing where the kernel cannot (before
 * Linux 5.14: noted once, then not tried again). */
void memfd_arena_prefault(void *p, size_t bytes);
/* Unmaps everything and frees the range and a. */
void memfd_arena_release(struct memfd_arena *a);

#endif
