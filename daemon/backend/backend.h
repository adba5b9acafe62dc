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
    /* Exportable arenas (kv_export). Optional: NULL where the backend's
     * memory cannot be handed to another process by descriptor (cuda
     * without the VMM pool). arena_alloc_paged maps n_units units of `unit`
     * bytes as whole pages of *units_per_page units each (the backend picks
     * it: about 2 MiB, a multiple of the OS page size, few enough pages for
     * its descriptor budget), so no unit straddles two pages; the memory is
     * host-addressable and zero-filled, and arena_free frees it. */
    int (*arena_alloc_paged)(struct backend *be, enum kvd_tier tier, size_t unit, size_t n_units,
                             size_t *units_per_page, void **out);
    /* A new descriptor (the caller's to close) of page `page` of the paged
     * arena at `arena`: read-write, or read-only (one that cannot be mapped
     * writable). 0, KVD_ENOMEM (out of descriptors) or KVD_EINTERNAL. */
    int (*arena_page_fd)(struct backend *be, void *arena, size_t page, bool writable, int *fd);
    /* Gives page `page` fresh zeroed memory at the same address; the old
     * memory stays with whoever still maps it. Nothing may be using the
     * page's bytes meanwhile. 0 or KVD_ENOMEM. */
    int (*arena_page_renew)(struct backend *be, void *arena, size_t page);
    /* Zero-fills `bytes` at dst in tier `tier`, ordered like copy_async
     * (after the compute issued so far, before every later copy and the
     * next step's work): cuda a cudaMemsetAsync on the copy stream, cpu a
     * memset. Optional (NULL: callers copy from a zeroed buffer). Returns 0
     * or KVD_EINTERNAL. */
    int (*zero)(struct backend *be, void *dst, enum kvd_tier tier, size_t bytes);
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
