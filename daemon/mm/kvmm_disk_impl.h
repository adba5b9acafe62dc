/* kvmm_disk_impl: the memory manager's disk-tier state (struct kvmm_disk), shared by
 * kvmm_disk.c (write-behind, detach, open and flush, DISK events) and kvmm_restore.c
 * (restores: the steps both lower tiers use, and the disk prefetch's windows). Internal to
 * daemon/mm. */
#ifndef KVD_KVMM_DISK_IMPL_H
#define KVD_KVMM_DISK_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "disktier.h"
#include "kvmm_impl.h"

/* A restore reads at most this many bytes of slots in one batch (and
 * holds that much buffer per prefetch in flight). */
#define KVMM_RESTORE_WINDOW_BYTES (8u << 20)
#define KVMM_RESTORE_WINDOW_MAX 256u
/* The writer writes at most this many bytes of slots (and blocks) per batch. */
#define KVMM_WB_BATCH_BYTES (8u << 20)
#define KVMM_WB_BATCH_MAX 256u

struct rwin;
struct wb_item {
    uint32_t id;
    struct blockkey key;
};

/* What a DISK BlockStored says of a block (KV events), taken while it is
 * in the tree. */
struct ev_block {
    bool on; /* events were attached */
    bool has_parent;
    uint32_t tenant;
    uint64_t pub, parent;
};

struct detached {
    char ns_name[DISKTIER_NS_NAME];
    struct blockkey key;
    uint32_t hits, weight; /* for the tier's eviction order (disktier_touch) */
    uint32_t *tokens;
    void *buf; /* disktier_buf_new, data filled */
    struct ev_block ev;
};

/* The blocks written to disk while events were attached, by (namespace
 * hash, key): their published hash and owner, so that a drop the tier logs
 * becomes a DISK BlockRemoved. Open addressing with tombstones. */
struct pub_ent {
    uint64_t ns;
    struct blockkey key;
    uint64_t pub;
    uint32_t tenant;
    uint8_t state; /* 0 empty, 1 used, 2 deleted */
};

struct kvmm_disk {
    struct kvmm *mm;
    struct disktier *dt;
    uint32_t writeback_ms;
    pthread_t thread;
    bool started;
    atomic_bool stop;
    pthread_mutex_t mu; /* guards the flush counters; the writer waits on wake */
    pthread_cond_t wake, flushed;
    uint64_t flush_req, flush_done;
    atomic_uint_fast64_t written;
    void *wbuf;                     /* the writer's slot buffers: wb_n of them, */
    void *wbufs[KVMM_WB_BATCH_MAX]; /*   at wbuf + i * slot_bytes */
    uint32_t *wtokens;              /* wb_n * block_tokens */
    size_t wb_n;
    /* Under the kvmm lock: */
    struct wb_item *q; /* FIFO: q[q_head, q_n) */
    size_t q_head, q_n, q_cap;
    struct detached *dq;
    size_t dq_n, dq_cap;
    uint64_t detached_bytes, detach_max;
    uint64_t detach_skips, restored, restore_fails;
    uint64_t restores, restore_ns, restore_last_ns; /* prefetches that restored blocks */
    uint64_t restore_cpu_ns[KVMM_RESTORE_CPU_N];    /* the prefetching threads' CPU, by step */
    size_t wb_inflight;   /* taken by the writer, not yet synced (counted as queued) */
    struct rwin *wins;    /* under mu: idle restore windows */
    struct pub_ent *pubs; /* (pubs_cap, a power of two) */
    size_t pubs_cap, pubs_used, pubs_live;
};

/* Lock held: queues block id (key) for the writer; false when out of memory. */
bool mm_disk_q_push(struct kvmm_disk *d, uint32_t id, struct blockkey key);
uint64_t mm_ns_hash(const struct kvmm *mm, uint32_t ns);
/* Frees the idle restore windows (at mm_disk_free). */
void mm_disk_wins_free(struct kvmm_disk *d);

#endif
