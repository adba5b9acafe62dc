/* disktier_impl: what disktier.c (files, index, writes, eviction) and disktier_read.c (batched,
 * checked reads) share: the file layout, the in-memory index and the helpers both use. Not
 * for other modules: disktier.h is the tier's API. */
#ifndef KVD_DISKTIER_IMPL_H
#define KVD_DISKTIER_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>
#include <xxhash.h>

#include "disktier.h"
#include "workpool.h"

#ifdef KVD_HAVE_URING
#include <liburing.h>
#define DISKTIER_RINGS 8 /* rings kept for reuse (one per concurrent batch) */
#endif

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the disk format is little-endian");

#define PAGE 4096u
#define FILE_MAGIC "KVDDISK1"
#define FILE_VERSION 1u
#define REC_MAGIC 0x4b565252u        /* "RRVK" */
#define SLOT_MAGIC 0x4b56444c4f54ull /* "TOLDVK" */
#define REC_VALID 1u
#define CHUNK_RECS 65536u

/* Both files start with this (padded to PAGE). */
struct file_hdr {
    char magic[8];
    uint32_t version, kind; /* 0 blocks.kvd, 1 index.kvd */
    uint64_t slot_bytes, n_slots, block_bytes;
    uint32_t block_tokens, hdr_bytes;
    uint64_t uuid; /* random per format: ties the index to its block file */
    uint64_t sum;  /* XXH3-64 of the fields above */
};

struct disk_rec {
    uint32_t magic, flags;
    uint64_t ns, key_lo, key_hi;
    uint64_t data_sum;
    uint64_t stamp;   /* write order (LRU order after a restart) */
    uint64_t expires; /* session pin: never evicted before (unix s); 0 none */
    uint64_t sum;     /* XXH3-64 of the 56 bytes above */
};
_Static_assert(sizeof(struct disk_rec) == 64, "index records are 64 bytes");

struct slot_hdr {
    uint64_t magic;
    uint32_t version, block_tokens;
    uint64_t block_bytes, ns, key_lo, key_hi, data_sum, uuid;
    char ns_name[DISKTIER_NS_NAME];
    uint64_t sum; /* XXH3-64 of this header (sum = 0) and the token ids after it */
};

enum slot_state { SLOT_FREE = 0, SLOT_VALID, SLOT_WRITING };

/* In memory only. Eviction (disktier_evict_policy): a VALID slot is on the use list, most
 * recently used first; a full tier looks at its least recently used end, where a slot with
 * credit left is given another turn (moved to the front, one credit spent) instead of being
 * evicted (GCLOCK). Credit comes from the tenant's weight (weight - 1 when written) and from
 * hits (weight more at each doubling of them: restores from disk, and the block's hits in
 * memory, told by disktier_touch). */
struct slot {
    uint32_t prev, next; /* use list (VALID) or free list (FREE, next only) */
    uint32_t readers;    /* pins of lookups not yet read */
    uint32_t hits;       /* reuses known: disk restores and memory hits (saturating) */
    uint8_t state;
    uint8_t weight; /* the owner tenant's weight (1..255), 1 when unknown (loaded) */
    uint8_t credit; /* turns it may still be passed over at eviction */
};

struct disktier {
    pthread_mutex_t mu;
    int data_fd, index_fd, lock_fd;
    bool direct;
    char dir[4096];
    size_t block_bytes, hdr_bytes, slot_bytes;
    uint32_t block_tokens;
    uint64_t n_slots, uuid, seed, stamp;
    struct disk_rec *recs; /* (n_slots) what index.kvd holds */
    struct slot *slots;    /* (n_slots) */
    uint32_t *table;       /* (cap) slot + 1, 0 empty; linear probing */
    uint64_t cap;
    uint32_t lru_head, lru_tail, free_head; /* head: most recent */
    uint32_t *unsynced;                     /* slots written since the last good sync */
    size_t n_unsynced, cap_unsynced;
    struct disktier_drop *drops; /* the drop log: ring of drops_cap, drops_n from drops_head */
    size_t drops_cap, drops_head, drops_n;
    struct disktier_stats st;
    bool lru; /* plain LRU eviction: credits are not used */
#ifdef KVD_HAVE_URING
    bool uring_ok;                          /* the kernel gave a ring at open */
    struct io_uring *rings[DISKTIER_RINGS]; /* idle rings, for the next batches */
    size_t n_rings;
#endif
};

/* The tier's mutex. The executor can wait for it (an eviction touches the
 * tier under the kvmm lock), so a prefetch worker that runs SCHED_IDLE holds
 * it at its nice value (workpool_hold_begin). */
static inline void dt_lock(struct disktier *dt)
{
    workpool_mutex_lock(&dt->mu);
}

static inline void dt_unlock(struct disktier *dt)
{
    workpool_mutex_unlock(&dt->mu);
}

static inline uint64_t dt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t dt_data_sum(const void *data, size_t n, uint64_t key_lo)
{
    return XXH3_64bits_withSeed(data, n, key_lo);
}

static inline bool dt_rec_is(const struct disk_rec *r, uint64_t ns, struct blockkey k)
{
    return r->ns == ns && r->key_lo == k.lo && r->key_hi == k.hi;
}

static inline off_t dt_slot_off(const struct disktier *dt, uint32_t s)
{
    return (off_t)PAGE + (off_t)s * (off_t)dt->slot_bytes;
}

/* The index (disktier.c), all under mu: */
uint64_t dt_round_up(uint64_t v, uint64_t a);
uint64_t dt_rec_sum(const struct disk_rec *r);
/* The table position of (ns, k): its entry, or the empty one where it would go. */
uint64_t dt_table_find(const struct disktier *dt, uint64_t ns, struct blockkey k);
void dt_table_add(struct disktier *dt, uint32_t slot);
void dt_lru_unlink(struct disktier *dt, uint32_t s);
void dt_lru_push_front(struct disktier *dt, uint32_t s);
void dt_free_push(struct disktier *dt, uint32_t s);
/* Writes slot s's record (buffered; disktier_sync makes it durable): 0 or -1. */
int dt_rec_write(struct disktier *dt, uint32_t s);

/* The slot header's checksum: over the header (sum taken as 0) and the token ids that follow
 * it in the slot. */
uint64_t dt_slot_hdr_sum(struct slot_hdr *h, uint32_t n_tokens);
/* Under mu: a VALID slot leaves the index (its record is invalidated) and goes to the free
 * list. */
void dt_slot_drop(struct disktier *dt, uint32_t s);
/* Under mu: VALID slot s served a read: one more hit, and it is the most recently used. */
void dt_slot_read_hit(struct disktier *dt, uint32_t s);

#endif
