/* kvmm_impl: the kvmm struct and the helpers shared by kvmm.c,
 * kvmm_alloc.c, kvmm_seq.c and kvmm_check.c. Not for other modules: they use
 * kvmm.h. Every function here expects the caller to hold mm->lock. */
#ifndef KVD_KVMM_INTERNAL_H
#define KVD_KVMM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "kvmm.h"
#include "pages.h"
#include "pool.h"
#include "radix.h"
#include "seq.h"
#include "tenant.h"

/* The hit bonus per doubling of a block's hits (radix.hit_scale), in device
 * pools' worth of clock ticks. The clock ticks about three times per block
 * a request uses (its allocation or its match, and its release), so one
 * pool's worth of ticks is about a third of a turnover of the pool, and 8
 * pools about 2-3 turnovers: a block hit once outlives a block used once
 * at the same time by that much. bench_evict measured 1, 2, 8, 16, 32 and
 * 64: 8 to 16 gave the best hit rates across pool sizes (docs/performance.md). */
#define KVMM_HIT_SCALE_POOLS 8u

struct kvmm {
    pthread_mutex_t lock;
    /* Lock checks (KVD_LOCK_CHECKS builds): the thread holding lock, as
     * mm_thread_self() gives it; 0 when nobody does. */
    _Atomic uintptr_t holder;
    struct kv_geom geom;
    size_t block_bytes, token_bytes;
    struct backend *be;           /* not owned */
    struct pool pool;             /* on the page budget (cfg.pages, or its own) */
    struct kvpages_member member; /* in the budget: other pools ask it for pages */
    struct radix radix;
    struct tenant_table tt;
    struct seq_table st;
    uint64_t clock; /* lru stamps: +1 per use */
    enum kvmm_evict_policy evict_policy;
    unsigned char *staging;   /* (block_bytes) owned: bounce buffer for partial block access */
    unsigned char *zeros;     /* (block_bytes) owned: zeros for new blocks */
    struct kvmm_stats ctr;    /* the counters (totals are computed on demand) */
    struct blockkey root_key; /* chain(-1) of the model and geometry */
    uint8_t fingerprint[16];  /* the model's (root_key's); zeros until known */
    struct kvmm_disk *disk;   /* the disk tier's side (kvmm_disk.c); NULL without one */
    struct kvmm_sessions *sessions; /* named sessions (kvmm_session.c); NULL without a disk tier */
    struct kvmm_events_sink events; /* events.block NULL: none attached */
    uint64_t pub_root;              /* root of the published hashes */
    bool events_quiet;              /* kvmm_clear: one AllBlocksCleared instead */
    struct kvmm_remote *remote;     /* the remote tier's side (kvmm_remote.c); NULL without one */
    struct mm_export *exports;      /* live exports (kvmm_export.c), newest first */
    uint64_t next_export;           /* export ids: +1 each */
    uint32_t n_exports;
    char err[320];
};

/* The kvmm lock without waiting (another pool's reclaim): true when taken. */
bool mm_trylock(struct kvmm *mm);
/* The budget's reclaim callback (kvpages_member): up to n budget pages of
 * tier t given back, evicting whole pages that budget tenant bt may take. */
uint32_t mm_reclaim(void *ctx, enum kvd_tier t, uint32_t bt, uint32_t n);
/* kvpages_member.reclaim_own: up to n budget pages of tenant bt's own cache
 * here, evicted (trylock, as mm_reclaim). */
uint32_t mm_reclaim_own(void *ctx, enum kvd_tier t, uint32_t bt, uint32_t n);

/* Ends every export of owner (kvmm_close_owner); frees them all (kvmm_free). */
void mm_exports_close_owner(struct kvmm *mm, kvmm_owner owner);
void mm_exports_free(struct kvmm *mm);

/* The lock rule, checked (KVD_LOCK_CHECKS: Debug and sanitizer builds):
 * MM_ASSERT_LOCKED(mm) opens every kvmm_* entry point and aborts, naming
 * the function, unless the calling thread holds mm->lock. A thread is known
 * by the address of a thread-local byte: one TLS address computation and a
 * relaxed load per call. Other builds compile it away. */
#ifdef KVD_LOCK_CHECKS
extern _Thread_local char mm_thread_tag;
static inline uintptr_t mm_thread_self(void)
{
    return (uintptr_t)&mm_thread_tag;
}
_Noreturn void mm_lock_violation(const char *fn, const char *what);
#define MM_ASSERT_LOCKED(mm)                                                                       \
    do {                                                                                           \
        if (atomic_load_explicit(&(mm)->holder, memory_order_relaxed) != mm_thread_self())         \
            mm_lock_violation(__func__, "without holding kvmm_lock");                              \
    } while (0)
/* And its converse where disk I/O starts: never with the lock held. */
#define MM_ASSERT_UNLOCKED(mm)                                                                     \
    do {                                                                                           \
        if (atomic_load_explicit(&(mm)->holder, memory_order_relaxed) == mm_thread_self())         \
            mm_lock_violation(__func__, "holding kvmm_lock across disk I/O");                      \
    } while (0)
#else
#define MM_ASSERT_LOCKED(mm) ((void)(mm))
#define MM_ASSERT_UNLOCKED(mm) ((void)(mm))
#endif

/* Records a message and returns code (the message of kvmm_errmsg). */
int mm_fail(struct kvmm *mm, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* References with the tree's heaps kept right: mm_ref pins (leaves the
 * eviction heaps), mm_unref frees at zero with the owner's accounting, or
 * stamps the block as just used. */
void mm_ref(struct kvmm *mm, uint32_t id);
void mm_unref(struct kvmm *mm, uint32_t id);

/* The page owner of (tenant, ns) in the pool (pool_owner, with the
 * tenant's budget id); POOL_NONE when out of memory. */
uint32_t mm_owner(struct kvmm *mm, uint32_t tenant, uint32_t ns);
/* Device blocks tenant could get now in its own namespace: free slots in
 * its pages, its cached blocks there, and whole pages: free in the budget
 * or full of cache that eviction may take by the floor rule. */
size_t mm_device_headroom(struct kvmm *mm, uint32_t tenant);
/* Makes room for n new blocks of (tenant, ns) on tier: the tenant's quotas
 * (blocks in this pool, bytes across the budget; evicting its own cache
 * first), then slots in its pages, mapping pages from the budget and
 * evicting by the floor rule (whole pages of others, single blocks of its
 * own), then asking the budget's other pools. 0, KVD_EQUOTA or KVD_ENOMEM
 * with the message set; nothing is evicted when it cannot succeed. */
int mm_room_new(struct kvmm *mm, enum kvd_tier tier, uint32_t tenant, uint32_t ns, size_t n);
/* Room on tier `to` for the n blocks ids (in their owners' pages), for
 * asker (the floor rule; KVMM_NO_TENANT: anyone's cache). Host: the
 * owners' host quotas are checked. 0, KVD_EQUOTA or KVD_ENOMEM. */
int mm_room_move(struct kvmm *mm, enum kvd_tier to, const uint32_t *ids, size_t n, uint32_t asker);
/* n new device blocks of (tenant, ns), refcount 1, zero-filled. All or nothing. */
int mm_alloc_device(struct kvmm *mm, uint32_t tenant, uint32_t ns, size_t n, uint32_t *ids);
/* Room for the host copies of ids (mm_room_move to the host). */
int mm_room_host(struct kvmm *mm, const uint32_t *ids, size_t n);
/* Tier move with accounting, stats and tree updates (see hosttier_move). */
int mm_move(struct kvmm *mm, const uint32_t *ids, size_t n, enum kvd_tier to, size_t *bad);
/* Eviction order across tenants (the evict policy, weights): whether
 * cached node a goes before b. */
bool mm_evicts_before(const struct kvmm *mm, const struct radix_node *a,
                      const struct radix_node *b);
/* Drops cached leaf n from the tree (and its block, unless a sequence
 * holds it). */
void mm_drop_node(struct kvmm *mm, struct radix_node *n);
/* Evicts cached device node v (no device children): to the host when it
 * can take it, else dropped (exact: v with its subtree; else v if a leaf,
 * or another childless leaf of its owner). false when nothing went. */
bool mm_evict_device_node(struct kvmm *mm, struct radix_node *v, bool exact);
/* Evicts one cached device block chosen for `tenant` by the floor rule
 * (KVMM_NO_TENANT: any tenant). false when nothing could be evicted. */
bool mm_evict_device_one(struct kvmm *mm, uint32_t tenant);
/* Drops the first host-tier cache leaf in eviction order (of tenant, or of
 * any tenant with KVMM_NO_TENANT). false when there is none. */
bool mm_drop_host_one(struct kvmm *mm, uint32_t tenant);
/* Removes node and everything below it from the tree, dropping the tree's
 * references (sequences keep theirs). */
void mm_drop_subtree(struct kvmm *mm, struct radix_node *node);

/* The disk tier's hooks (kvmm_disk.c), no-ops without a tier. mm_keyed:
 * node's block just entered the tree: it gets its key, and is queued for
 * the writer. mm_disk_dropping: node's block is about to leave the tree:
 * when it was never written, a copy of it is queued instead. */
void mm_keyed(struct kvmm *mm, struct radix_node *node);
void mm_disk_dropping(struct kvmm *mm, struct radix_node *node);
void mm_disk_free(struct kvmm *mm);
/* KV events (kvmm.c): node's block entered the tree or moved into a
 * medium (stored) / is leaving one (removed). No-ops without a sink or
 * for a tenant with events off. mm_pub_set gives node's block its
 * published hash (from its parent's). */
void mm_pub_set(struct kvmm *mm, struct radix_node *node);
void mm_ev_stored(struct kvmm *mm, const struct radix_node *node, enum kvmm_medium medium);
void mm_ev_removed(struct kvmm *mm, const struct radix_node *node, enum kvmm_medium medium);
static inline enum kvmm_medium mm_tier_medium(uint8_t tier)
{
    return tier == KVD_TIER_DEVICE ? KVMM_MEDIUM_GPU : KVMM_MEDIUM_CPU;
}

/* For kvmm_session.c: the tier, and a tree block's bytes into dst (lock
 * held; false when a host copy fails its checksum or the copy fails). */
struct disktier *mm_disk_tier(struct kvmm *mm);
bool mm_disk_copy_out(struct kvmm *mm, uint32_t id, void *dst);
/* Loads DIR/sessions (at kvmm_disk_open) and frees them (at close). */
int mm_sessions_load(struct kvmm *mm, const char *dir, struct kvd_error *e);
void mm_sessions_free(struct kvmm *mm);
uint64_t mm_sessions_count(struct kvmm *mm);
/* The tree's key of a node: its block's key, chain(-1) for a root. */
struct blockkey mm_node_key(const struct kvmm *mm, const struct radix_node *node);
/* Room for n new host-tier blocks of (tenant, ns) (its quotas, slots),
 * dropping host cache. 0, KVD_EQUOTA or KVD_ENOMEM. */
int mm_room_host_new(struct kvmm *mm, uint32_t tenant, uint32_t ns, size_t n);
/* Restores (kvmm_disk.c, shared with kvmm_remote.c): whether ns is a live
 * namespace; how many whole blocks of tokens (nb at most) the tree holds and
 * the key of the last (chain(-1) for none); the node of block b-1 (the root
 * for b = 0, NULL when the tree no longer holds b blocks; scratch holds b);
 * and block `key` (its bytes at data) entering the tree under parent as an
 * unreferenced cached block of tenant, on the host tier when there is one
 * (false when there is no room). from_disk: it is on disk already; else it
 * came from the remote tier, which needs it no more, and is queued for the
 * disk. */
bool mm_ns_ok(const struct kvmm *mm, uint32_t ns);
size_t mm_cached_prefix(struct kvmm *mm, uint32_t ns, const uint32_t *tokens, size_t nb,
                        struct radix_node **scratch, struct blockkey *key);
struct radix_node *mm_parent_of(struct kvmm *mm, uint32_t ns, const uint32_t *tokens, size_t b,
                                struct radix_node **scratch);
/* A block being restored from the disk or the remote tier, in three steps
 * so that its bytes can be copied with the kvmm lock released:
 * mm_restore_take (lock held) allocates it, mm_restore_fill (lock released,
 * or held) copies the bytes in, mm_restore_enter (lock held) puts it into
 * the tree, or mm_restore_drop frees it. Between take and enter/drop the
 * block has one reference, the restore's (pool_block.restoring), and is in
 * no tree or sequence: nothing else reads, writes or moves it. */
struct mm_restoring {
    uint32_t id;
    enum kvd_tier tier;
    void *dst;         /* its bytes in the arena */
    uint64_t checksum; /* host tier: of the bytes filled in */
    void *fresh;       /* the new page it lies in, prefaulted by the fill; NULL: none */
    size_t fresh_bytes;
};
/* Device when prefer_device and the device pool has free slots beyond a
 * margin (a sixteenth of the pool, left for the running sequences' growth)
 * within the tenant's device quota: nothing is evicted or moved for it.
 * Else a new host block (host cache dropped for room), or with no host
 * tier a device block (device cache evicted for room). */
bool mm_restore_take(struct kvmm *mm, uint32_t tenant, uint32_t ns, bool prefer_device,
                     struct mm_restoring *r);
bool mm_restore_fill(struct kvmm *mm, struct mm_restoring *r, const void *data);
/* The fill's first part: populates r's fresh page, if any (lock released). */
void mm_restore_prefault(struct kvmm *mm, struct mm_restoring *r);
bool mm_restore_enter(struct kvmm *mm, struct mm_restoring *r, struct radix_node *parent,
                      const uint32_t *toks, struct blockkey key, bool from_disk);
void mm_restore_drop(struct kvmm *mm, struct mm_restoring *r);
/* The three steps under the lock, into a host block (device without one). */
bool mm_restore_block(struct kvmm *mm, uint32_t tenant, uint32_t ns, struct radix_node *parent,
                      const uint32_t *toks, struct blockkey key, const void *data, bool from_disk);
/* The remote tier's hooks (kvmm_remote.c), no-ops without one. The block
 * of node, chain index idx: mm_remote_used after it entered the tree or its
 * hits grew (its group's value may be due), mm_remote_chain_end where a
 * commit or a match ended at it (a tail value may be due). */
void mm_remote_used(struct kvmm *mm, struct radix_node *node, size_t idx);
void mm_remote_chain_end(struct kvmm *mm, struct radix_node *node, size_t idx);
void mm_remote_free(struct kvmm *mm);
/* Lock held: AllBlocksCleared went out: the remote tier forgets the values
 * it announced (they stay in Redis; a router forgets them). */
void mm_remote_cleared(struct kvmm *mm);

#endif
