/* kvmm_remote_impl: the memory manager's remote-tier state (struct kvmm_remote), shared by
 * kvmm_remote.c (write-through, connections), kvmm_remote_fetch.c (lookups) and
 * kvmm_remote_events.c (the values it announced as REMOTE KV events, until they are known
 * gone). Internal to daemon/mm. */
#ifndef KVD_KVMM_REMOTE_IMPL_H
#define KVD_KVMM_REMOTE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "kvmm_impl.h"
#include "redisconn.h"
#include "remote_value.h"

#define REST_NS 1000000000ull /* after a failed round */
#define QUEUE_MAX 65536       /* values waiting for the writer */
#define POOL_CONNS 64         /* idle connections kept for prefetch */
/* Values one lookup round asks for, at most (by value-bytes): one value of the default 4 MiB.
 * Rounds of 16 MiB (four such GETs pipelined) made redis-server spend 2-4 s of CPU per GB
 * against 0.2-0.9 s for one value per round (bench_remote restore). */
#define ROUND_BYTES (4u << 20)

struct rq_item {
    uint32_t id;
    uint32_t idx; /* chain index */
    struct blockkey key;
    bool tail;
};

/* A value this daemon wrote and announced (REMOTE BlockStored): its
 * blocks' published hashes and owners, by (namespace hash, naming key).
 * Open addressing with tombstones, under the kvmm lock. */
struct ann_blk {
    uint64_t pub;
    uint32_t tenant;
};
struct ann {
    uint64_t ns;
    struct blockkey key;
    uint64_t expires; /* monotonic ns; UINT64_MAX: no TTL */
    struct ann_blk *b;
    uint32_t n;
    uint8_t state; /* 0 empty, 1 used, 2 deleted */
};
/* Announced values in the order they expire (the TTL is one for all, so
 * write order); an entry whose value was written again since is stale. */
struct ann_due {
    uint64_t ns;
    struct blockkey key;
    uint64_t expires;
};
#define ANN_MAX (1u << 20) /* values remembered at most; more are not announced */
/* How many announced values hold a block, by (namespace hash, published
 * hash): values overlap (a chain's tails grow turn by turn, and a group
 * value holds its tails' blocks), and a router keeps REMOTE as a set, so
 * BlockStored goes out when the first value holding a block is announced
 * and BlockRemoved when the last one goes. tenant: the block's owner when
 * it was first announced (its removal is filtered as its store was).
 * Open addressing with tombstones, under the kvmm lock. */
struct ann_cnt {
    uint64_t ns, pub;
    uint32_t n, tenant;
    uint8_t state; /* 0 empty, 1 used, 2 deleted */
};

/* A connection and the stats of it already counted. */
struct rconn {
    struct redisconn *rc;
    struct redisconn_stats seen;
};

struct kvmm_remote {
    struct kvmm *mm;
    struct remote_fleet_key key;
    char url[1024];
    uint32_t timeout_ms, ttl_s, min_hits, k;
    size_t round_keys; /* values per lookup round: ROUND_BYTES / value-bytes, at least 1 */
    pthread_t thread;
    bool started;
    atomic_bool stop;
    pthread_mutex_t mu; /* the writer's wake, the idle connections */
    pthread_cond_t wake, idle;
    bool writing;
    struct rconn *conns[POOL_CONNS];
    size_t n_conns;
    _Atomic uint64_t rest_until; /* monotonic ns */
    /* Under the kvmm lock: */
    struct radix_node **nodes; /* (k) the writer's: a value's nodes */
    struct rq_item *q;
    size_t q_head, q_n, q_cap;
    struct ann *anns; /* (ann_cap, a power of two) */
    size_t ann_cap, ann_used, ann_live;
    struct ann_cnt *cnts; /* (cnt_cap, a power of two) */
    size_t cnt_cap, cnt_used, cnt_live;
    struct ann_due *due; /* FIFO: due[due_head, due_n) */
    size_t due_head, due_n, due_cap;
    /* The writer's: what the value being written will announce. */
    struct ann_blk *ev_b; /* (k) */
    uint32_t *ev_toks;    /* (k * block_tokens) */
    uint32_t ev_n;
    uint64_t ev_ns, ev_parent;
    bool ev_on, ev_has_parent;
    /* Counters (atomics: the writer and the workers count without the lock). */
    atomic_uint_fast64_t hits, misses, bytes_in, bytes_out, rounds, lat_sum, lat_last, errors,
        timeouts, skipped, auth_failures, mismatches, writes, write_skips, backoffs, connect_fails,
        reconnects, moved, ask, ev_stored, ev_removed;
};

/* kvmm_remote.c's, for kvmm_remote_fetch.c: */
uint64_t mm_remote_now_ns(void);
/* True (counted as skipped) while the tier rests after a failure. */
bool mm_remote_resting(struct kvmm_remote *r);
/* An idle connection, or a new one; NULL (counted, and the tier rests) when none opens. */
struct rconn *mm_remote_conn_take(struct kvmm_remote *r);
/* Gives c back after its rounds; rc: the last one's result (a failure makes the tier rest). */
void mm_remote_conn_give(struct kvmm_remote *r, struct rconn *c, int rc);
/* Lock held: the tenant is live and has remote on. */
bool mm_remote_tenant_on(const struct kvmm *mm, uint32_t tenant);

/* KV events of values (kvmm_remote_events.c), all with the kvmm lock held: */
/* A lookup found the value named (ns, key) missing or unusable: REMOTE BlockRemoved. */
void mm_remote_ann_lost(struct kvmm *mm, uint64_t ns, struct blockkey key);
/* Values whose TTL has passed: REMOTE BlockRemoved. */
void mm_remote_ann_expire(struct kvmm *mm);
/* The value just written (r->ev_*, named by key): REMOTE BlockStored for its blocks. */
void mm_remote_ann_written(struct kvmm *mm, struct blockkey key);
/* Frees what the announcements hold (at mm_remote_free). */
void mm_remote_ann_free(struct kvmm_remote *r);

#endif
