/* The backend: where KV arenas live and how bytes move between the tiers.
 * Two implementations share this table: cpu (backend_cpu.c, the reference)
 * and cuda (backend_cuda.c). The model's compute operations live in their own
 * table (compute.h), reached through `compute`; the memory manager only needs
 * this part. */
#ifndef KVD_BACKEND_H
#define KVD_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kvd_tier { KVD_TIER_DEVICE = 0, KVD_TIER_HOST = 1 };

struct backend;
struct compute_ops; /* compute.h */
struct kvd_error;   /* kvd/status.h */

/* What a page descriptor (arena_page_fd) is: a memfd the client mmaps, or
 * the POSIX file descriptor of a CUDA VMM allocation the client imports
 * with cuMemImportFromShareableHandle. */
enum backend_fd_kind { BACKEND_FD_MEMFD = 0, BACKEND_FD_CUDA_VMM = 1 };

/* Which implementation a backend is: branch on this, never on the name. */
enum backend_kind { BACKEND_CPU = 0, BACKEND_CUDA = 1 };

struct backend_ops {
    const char *name; /* "cpu" or "cuda": for people (logs, hello, stats) */
    enum backend_kind kind;
    /* The memory the device arena is carved from, in bytes: cuda the GPU's
     * free and total memory, cpu the machine's physical memory (free =
     * total). Returns 0, or an enum kvd_err when it cannot tell. */
    int (*mem_info)(struct backend *be, size_t *free_b, size_t *total_b);
    /* Arena memory. Device: cudaMalloc on cuda, plain/huge-page memory on
     * cpu. Host: cudaHostAlloc (pinned) on cuda, plain memory on cpu.
     * Returns 0 or KVD_ENOMEM; *out is zero-filled memory of `bytes`. */
    int (*arena_alloc)(struct backend *be, enum kvd_tier tier, size_t bytes, void **out);
    void (*arena_free)(struct backend *be, enum kvd_tier tier, void *p, size_t bytes);
    /* Synchronous copy of `bytes` between any two tiers (or host-side plain
     * memory, tier KVD_TIER_HOST). Returns 0 or KVD_EINTERNAL. */
    int (*copy)(struct backend *be, void *dst, enum kvd_tier dst_tier, const void *src,
                enum kvd_tier src_tier, size_t bytes);
    /* Asynchronous copy on the backend's copy stream; completion is awaited
     * with wait(). The cpu backend may copy synchronously. Optional (NULL:
     * callers use copy). */
    int (*copy_async)(struct backend *be, void *dst, enum kvd_tier dst_tier, const void *src,
                      enum kvd_tier src_tier, size_t bytes);
    int (*copy_wait)(struct backend *be); /* waits for every copy_async issued so far */
    /* Elastic arenas: the KV pools (docs/architecture.md "Pages"). Optional:
     * NULL where the backend only has whole arenas (arena_alloc); the pools
     * are then one arena allocated up front and cannot be exported.
     * arena_granularity: the bytes a page must be a whole multiple of (cpu:
     * the OS page; cuda device: cuMemGetAllocationGranularity).
     * arena_reserve: an address range of n_pages pages of page_bytes (a
     * multiple of the granularity) with no memory behind it.
     * arena_map: page `page` gets fresh memory (cpu: zero-filled; cuda:
     * whatever the driver gives), addressable at base + page * page_bytes
     * from the backend's copies and kernels (device tier) or from the host
     * (host tier). 0 or KVD_ENOMEM.
     * arena_unmap: the page's memory goes back (whoever holds a descriptor
     * of it keeps its own reference) and the addresses stay reserved; first
     * waits until no copy or kernel queued so far can still touch it.
     * arena_release: unmaps what is mapped and frees the range.
     * arena_page_fd: a new descriptor (the caller's to close) of mapped page
     * `page`: a memfd (read-write, or a read-only open that cannot be mapped
     * writable), or on the cuda device tier the POSIX descriptor of the
     * page's VMM allocation (cuMemExportToShareableHandle), which is never
     * read-only: *kind says which. 0, KVD_ENOMEM (out of descriptors),
     * KVD_EUNSUPPORTED (a read-only descriptor asked where there is none)
     * or KVD_EINTERNAL. */
    size_t (*arena_granularity)(struct backend *be, enum kvd_tier tier);
    int (*arena_reserve)(struct backend *be, enum kvd_tier tier, size_t page_bytes, size_t n_pages,
                         void **base);
    int (*arena_map)(struct backend *be, void *base, size_t page);
    int (*arena_unmap)(struct backend *be, void *base, size_t page);
    void (*arena_release)(struct backend *be, void *base);
    int (*arena_page_fd)(struct backend *be, void *base, size_t page, bool writable, int *fd,
                         enum backend_fd_kind *kind);
    /* Bit t set: arena_page_fd can give tier t's pages read-only. */
    uint8_t page_fd_read_only;
    /* Zero-fills `bytes` at dst in tier `tier`, ordered like copy_async
     * (after the compute issued so far, before every later copy and the
     * next step's work): cuda a cudaMemsetAsync on the copy stream, cpu a
     * memset. Optional (NULL: callers copy from a zeroed buffer). Returns 0
     * or KVD_EINTERNAL. */
    int (*zero)(struct backend *be, void *dst, enum kvd_tier tier, size_t bytes);
    /* Memory a tier just took into use (a freshly mapped page) made resident
     * and mapped writable ahead of the copies into it, in one call: a first
     * touch of fresh host memory otherwise takes a page fault per 4 KiB page
     * inside the copy (cpu: madvise MADV_POPULATE_WRITE). The bytes do not
     * change; a hint: where the kernel cannot (before Linux 5.14) the copies
     * take the faults as before. Optional (NULL: nothing to do; cuda, whose
     * host pages are populated when it pins them at arena_map). */
    void (*prefault)(struct backend *be, void *p, enum kvd_tier tier, size_t bytes);
    void (*destroy)(struct backend *be);
};

struct backend {
    const struct backend_ops *ops;
    const struct compute_ops *compute; /* NULL until the executor's ops exist */
    void *impl;                        /* the implementation's private state */
};

/* Constructors. backend_cpu_new never fails except on ENOMEM.
 * backend_cuda_new returns KVD_EUNSUPPORTED when built without CUDA or when
 * no device is present (err's message says which); err may be NULL. */
int backend_cpu_new(struct backend **out);
int backend_cuda_new(int device, struct backend **out, struct kvd_error *err);
void backend_free(struct backend *be);

#endif
