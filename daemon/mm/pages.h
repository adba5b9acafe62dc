/* pages: the page budget. KV memory on each tier (device, host) is cut into
 * fixed pages (page_bytes, a multiple of the backend's granularity: 2 MiB,
 * smaller for a small budget); one budget per daemon says how many pages
 * each tier may have in all, and every block pool attached to it (one kvmm
 * per model, whatever its block size) takes pages when it needs slots and
 * gives back the pages it empties. It also keeps, per tenant (by name),
 * the pages that tenant's blocks hold in all the pools together, and the
 * tenant's quotas and floor in bytes.
 * Thread-safe: one mutex of its own, taken inside a kvmm's lock and never
 * the other way round; it calls into a pool (reclaim) with it released. */
#ifndef KVD_PAGES_H
#define KVD_PAGES_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#define KVPAGES_NONE UINT32_MAX
#define KVPAGES_TIERS 2
/* The page a budget is cut into by default, and the fewest pages a small
 * budget is cut into: a budget under 64 default pages gets smaller pages
 * (a power of two of at least the backend's granularity), so that a small
 * daemon still has pages to give each tenant. */
#define KVPAGES_PAGE_TARGET ((uint64_t)2 << 20)
#define KVPAGES_MIN_PAGES 64u

struct kvd_error;

struct kvpages_conf {
    uint64_t bytes[KVPAGES_TIERS];      /* the budget per tier; host 0: no host tier */
    uint64_t page_bytes[KVPAGES_TIERS]; /* 0: the default (above); else rounded up to
                                           the backend's granularity */
    /* page_bytes as given, even where it is no multiple of the granularity
     * (a pool whose pages cannot be mapped one by one is then allocated
     * whole and cannot be exported): kvmm_new's own budget of one block
     * per page. */
    bool exact[KVPAGES_TIERS];
};

struct kvpages;

/* A budget on be (borrowed; it must outlive the budget), each tier's bytes
 * rounded up to whole pages. 0, KVD_EBADREQ (no device budget, or more
 * than 2^32 pages) with the message in e, or KVD_ENOMEM. */
int kvpages_new(struct backend *be, const struct kvpages_conf *c, struct kvpages **out,
                struct kvd_error *e);
/* The page a budget of `bytes` on tier t gets by default. */
uint64_t kvpages_default_page(struct backend *be, enum kvd_tier t, uint64_t bytes);
/* After every pool attached to it is gone. */
void kvpages_free(struct kvpages *pg);
/* What never changes after kvpages_new. */
struct backend *kvpages_backend(const struct kvpages *pg);
uint64_t kvpages_page_bytes(const struct kvpages *pg, enum kvd_tier t);
uint32_t kvpages_total(const struct kvpages *pg, enum kvd_tier t);

struct kvpages_stats {
    uint64_t page_bytes[KVPAGES_TIERS];
    uint32_t pages[KVPAGES_TIERS]; /* the budget */
    uint32_t used[KVPAGES_TIERS];  /* taken by pools */
    uint32_t pools, tenants;
};
void kvpages_stats(struct kvpages *pg, struct kvpages_stats *st);

/* ---- tenants: by name, across pools ----------------------------------------
 * Limits in bytes; 0 means none (no quota, no floor). A tenant's use is the
 * pages its blocks hold, whole pages, in every pool. */
struct kvpages_limits {
    uint64_t max_bytes[KVPAGES_TIERS];
    uint64_t reserved_device_bytes; /* floor: cached pages inside it are never
                                       evicted for another tenant */
};
/* The tenant named name, added on first use; every ref is dropped with
 * kvpages_tenant_unref (a kvmm holds one per tenant it knows). 0 or
 * KVD_ENOMEM. */
int kvpages_tenant_ref(struct kvpages *pg, const char *name, uint32_t *id);
void kvpages_tenant_unref(struct kvpages *pg, uint32_t id);
/* Sets the tenant's limits (the last setter wins: a daemon sets the same
 * in every pool). KVD_EBADREQ when the floors of all tenants would exceed
 * the device budget (nothing changes; the message in err). */
int kvpages_tenant_set(struct kvpages *pg, uint32_t id, const struct kvpages_limits *l, char *err,
                       size_t errlen);
void kvpages_tenant_limits(struct kvpages *pg, uint32_t id, struct kvpages_limits *l);
/* Pages the tenant holds on tier t, all pools. */
uint32_t kvpages_tenant_pages(struct kvpages *pg, enum kvd_tier t, uint32_t id);
/* Pages tenant id may still take on tier t under its byte quota
 * (UINT32_MAX: no quota; KVPAGES_NONE: no tenant, no quota). */
uint32_t kvpages_quota_left(struct kvpages *pg, enum kvd_tier t, uint32_t id);
/* Device pages the tenant holds above its floor (UINT32_MAX: no floor). */
uint32_t kvpages_above_floor(struct kvpages *pg, uint32_t id);

/* ---- pages --------------------------------------------------------------- */
uint32_t kvpages_free_pages(struct kvpages *pg, enum kvd_tier t);
/* Adds n pages to tier t's budget: for a budget sized from what the models
 * need (no device-bytes), when a load finds it needs more than estimated. */
void kvpages_grow(struct kvpages *pg, enum kvd_tier t, uint32_t n);
/* A pool's even share of tier t: its pages over the pools attached (those
 * attached unshared not counted). */
uint32_t kvpages_share(struct kvpages *pg, enum kvd_tier t);
/* Takes n pages of tier t for tenant id (KVPAGES_NONE: nobody's), checking
 * its byte quota when quota: 0, KVD_EQUOTA or KVD_ENOMEM (the budget has
 * fewer than n free). */
int kvpages_take(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n, bool quota);
void kvpages_give(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n);
/* A pool's spare pages (pool.h) stay taken but are nobody's: claim moves
 * n taken pages to tenant id (its quota checked when quota: 0 or
 * KVD_EQUOTA), unclaim back to nobody. */
int kvpages_claim(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n, bool quota);
void kvpages_unclaim(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n);

/* ---- pools: asking the others for pages ------------------------------------
 * A pool attaches itself with a reclaim callback: called (with no budget
 * lock held) to free up to n pages of tier t that tenant (KVPAGES_NONE:
 * anyone) may take, by evicting cached blocks by the floor rule; it must
 * not wait for the pool's lock (trylock) and returns the pages it gave
 * back. */
struct kvpages_member {
    uint32_t (*reclaim)(void *ctx, enum kvd_tier t, uint32_t tenant, uint32_t n);
    /* The same for tenant's own cache alone (its byte quota is reached in
     * another pool): up to n of its pages of tier t given back. NULL:
     * never asked. */
    uint32_t (*reclaim_own)(void *ctx, enum kvd_tier t, uint32_t tenant, uint32_t n);
    void *ctx;
    /* Left out of the even share (kvpages_share): a pool that serves
     * another (a model's draft) and must not shrink the models' shares. */
    bool unshared;
    /* the budget's */
    struct kvpages_member *next;
    uint32_t busy; /* reclaims in progress (detach waits for 0) */
    uint64_t id;   /* from kvpages_attach: the budget's members in order */
};
void kvpages_attach(struct kvpages *pg, struct kvpages_member *m);
void kvpages_detach(struct kvpages *pg, struct kvpages_member *m);
/* Asks every member but self, in turn, until n more pages of tier t are
 * free in the budget or every member was asked. Returns the budget's free
 * pages. */
uint32_t kvpages_reclaim(struct kvpages *pg, struct kvpages_member *self, enum kvd_tier t,
                         uint32_t tenant, uint32_t n);
/* Asks every member but self, in turn, to evict tenant's own cached pages
 * of tier t until the tenant holds n fewer pages or every member was asked
 * (a tenant at its byte quota makes room from its cache in other pools).
 * Returns how many fewer pages it holds. */
uint32_t kvpages_reclaim_own(struct kvpages *pg, struct kvpages_member *self, enum kvd_tier t,
                             uint32_t tenant, uint32_t n);

#endif
