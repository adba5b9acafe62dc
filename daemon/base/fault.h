/* fault: fault-injection points for tests. With -DKVD_FAULT_INJECTION=1
 * (cmake -DKVD_FAULT_INJECTION=ON) chosen allocations and copies fail on
 * purpose, driven by the KVD_FAULTS environment variable or the test API
 * below; without it fault_should_fail() is the constant false and the
 * wrappers are plain malloc/calloc/realloc, so release builds pay nothing. */
#ifndef KVD_FAULT_H
#define KVD_FAULT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* Where a failure can be injected. The names are the KVD_FAULTS keys. */
enum fault_point {
    FAULT_DEVICE_ALLOC = 0, /* "device": backend arena_alloc of the device tier */
    FAULT_HOST_ALLOC,       /* "host": backend arena_alloc of the host tier */
    FAULT_COPY,             /* "copy": backend copy and copy_async (swaps, COW, kv I/O) */
    FAULT_ALLOC,            /* "alloc": malloc/calloc/realloc at the kvmm and server sites */
    FAULT_DISK_WRITE,       /* "diskwrite": a disk-tier block write fails with EIO */
    FAULT_DISK_NOSPC,       /* "disknospc": a disk-tier block write fails with ENOSPC */
    FAULT_DISK_TORN,        /* "disktorn": a block write stops halfway and reports success */
    FAULT_DISK_FSYNC,       /* "diskfsync": the disk tier's fdatasync fails */
    FAULT_DISK_READ,        /* "diskread": a disk-tier block read comes back short */
    FAULT_POINT_COUNT
};

/* How a point fails. Calls are counted per point from 1. */
enum fault_mode {
    FAULT_OFF = 0,
    FAULT_EVERY, /* every n-th call fails (n, 2n, 3n, ...) */
    FAULT_AFTER, /* every call after the first n fails */
    FAULT_NTH,   /* only call n fails */
    FAULT_PROB,  /* each call fails with probability n / 1000 (seeded, repeatable) */
};

#if defined(KVD_FAULT_INJECTION) && KVD_FAULT_INJECTION

/* True when this call at `p` must fail. Thread-safe. On first use it reads
 * KVD_FAULTS, a comma-separated list of point:mode=n, e.g.
 * "copy:every=7,alloc:after=100,device:nth=1,host:prob=50"; KVD_FAULTS_SEED
 * seeds prob. A malformed spec is reported on stderr and ignored. */
bool fault_should_fail(enum fault_point p);

/* Test API. fault_set replaces the point's rule and restarts its call
 * count; fault_reset turns every point off and zeroes the counters. */
void fault_set(enum fault_point p, enum fault_mode mode, uint64_t n);
void fault_reset(void);
/* Parses a KVD_FAULTS-style spec onto the current rules: 0, or -1 when it
 * is malformed (nothing applied). */
int fault_parse(const char *spec);
/* Calls seen and failures injected at p since its rule was set. */
uint64_t fault_calls(enum fault_point p);
uint64_t fault_injected(enum fault_point p);
/* The KVD_FAULTS name of a point ("device", "host", "copy", "alloc", "diskwrite", ...). */
const char *fault_point_name(enum fault_point p);

#define FAULT_ENABLED 1
#else
static inline bool fault_should_fail(enum fault_point p)
{
    (void)p;
    return false;
}
#define FAULT_ENABLED 0
#endif

/* Allocation wrappers for the FAULT_ALLOC sites: one-line changes at the
 * call sites, plain allocations in normal builds. */
static inline void *fault_malloc(size_t n)
{
    return fault_should_fail(FAULT_ALLOC) ? NULL : malloc(n);
}
static inline void *fault_calloc(size_t n, size_t size)
{
    return fault_should_fail(FAULT_ALLOC) ? NULL : calloc(n, size);
}
static inline void *fault_realloc(void *p, size_t n)
{
    return fault_should_fail(FAULT_ALLOC) ? NULL : realloc(p, n);
}

#endif
