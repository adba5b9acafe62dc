/* stats_snap: one reading of the numbers `stats` (ops_info.c) and /metrics
 * (metrics.c) report, taken under one kvmm lock so they add up, then
 * rendered by each without the lock. Tenants come a page at a time: live
 * kvmm tenant ids from a cursor, at most `max` of them. */
#ifndef KVD_STATS_SNAP_H
#define KVD_STATS_SNAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acct.h"
#include "kvmm.h"

/* The most tenants one stats reply carries (its default: tenants_max). */
#define STATS_SNAP_PAGE_MAX 1024u
#define STATS_SNAP_PAGE_DEFAULT 256u

struct stats_snap_tenant {
    uint32_t id;
    struct kvmm_tenant_stats ts;
    struct acct_tenant at; /* zeros without accounting */
};

struct stats_snap {
    struct kvmm_stats st;
    struct kvmm_disk_stats disk;     /* disk.on false without a disk tier */
    struct kvmm_remote_stats remote; /* remote.on false without a remote tier */
    struct stats_snap_tenant *t;     /* (n) owned, by tenant id */
    size_t n;
    size_t n_live; /* live tenants in all */
    bool more;     /* tenants past this page: the next starts at `next` */
    uint32_t next;
};

/* Reads mm (locking it) and acct (may be NULL). With only != NULL the page
 * is that one tenant; else live tenant ids >= from, at most max. 0 or
 * KVD_ENOMEM / a kvmm error. */
int stats_snap_fill(struct stats_snap *s, struct kvmm *mm, struct acct *acct, const uint32_t *only,
                    uint32_t from, size_t max);
void stats_snap_free(struct stats_snap *s);

#endif
