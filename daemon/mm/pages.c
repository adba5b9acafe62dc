/* pages: the page budget (see pages.h): counters per tier and per tenant
 * under one mutex, and the list of pools to ask for pages back. */
#include "pages.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "kvd/status.h"

struct kvpages_tenant {
    char name[64]; /* "" while the slot is free */
    uint32_t refs;
    uint32_t pages[KVPAGES_TIERS];
    struct kvpages_limits lim;
};

struct kvpages {
    pthread_mutex_t mu;
    pthread_cond_t idle; /* a member's busy fell to 0 */
    struct backend *be;
    uint64_t page_bytes[KVPAGES_TIERS];
    uint32_t total[KVPAGES_TIERS], used[KVPAGES_TIERS];
    struct kvpages_tenant *t; /* (n_t) */
    uint32_t n_t;
    struct kvpages_member *members;
    uint32_t n_members, n_shared; /* all, and those in the even share */
    uint64_t next_id;             /* the next attached member's */
};

static uint64_t granularity(struct backend *be, enum kvd_tier t)
{
    size_t g = be->ops->arena_granularity ? be->ops->arena_granularity(be, t) : 0;
    return g ? g : 1;
}

/* The default page: 2 MiB, or for a small budget the largest power of two
 * that cuts it into KVPAGES_MIN_PAGES; never below the granularity. */
static uint64_t default_page(uint64_t bytes, uint64_t g)
{
    uint64_t p = KVPAGES_PAGE_TARGET;
    while (p > g && bytes / p < KVPAGES_MIN_PAGES)
        p >>= 1;
    return p < g ? g : (p + g - 1) / g * g;
}

uint64_t kvpages_default_page(struct backend *be, enum kvd_tier t, uint64_t bytes)
{
    return default_page(bytes, granularity(be, t));
}

int kvpages_new(struct backend *be, const struct kvpages_conf *c, struct kvpages **out,
                struct kvd_error *e)
{
    static const char *const names[KVPAGES_TIERS] = {"device", "host"};
    *out = NULL;
    if (!be || c->bytes[KVD_TIER_DEVICE] == 0)
        return kvd_error_set(e, KVD_EBADREQ, "the page budget needs device bytes");
    struct kvpages *pg = calloc(1, sizeof *pg);
    if (!pg)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    pg->be = be;
    for (int t = 0; t < KVPAGES_TIERS; t++) {
        uint64_t bytes = c->bytes[t], g = granularity(be, (enum kvd_tier)t), p = c->page_bytes[t];
        if (bytes == 0)
            continue;
        if (!c->exact[t])
            p = p ? (p + g - 1) / g * g : default_page(bytes, g);
        /* A budget is whole pages, rounded up (a budget under one
         * granule, as a small test daemon on a GPU asks, is one page). */
        if (p && bytes % p)
            bytes += p - bytes % p;
        if (p == 0 || bytes / p == 0 || bytes / p >= KVPAGES_NONE) {
            free(pg);
            return kvd_error_set(e, KVD_EBADREQ,
                                 "%s budget of %llu bytes: not a whole number of pages of %llu "
                                 "bytes between 1 and 2^32",
                                 names[t], (unsigned long long)bytes, (unsigned long long)p);
        }
        pg->page_bytes[t] = p;
        pg->total[t] = (uint32_t)(bytes / p);
    }
    pthread_mutex_init(&pg->mu, NULL);
    pthread_cond_init(&pg->idle, NULL);
    *out = pg;
    return 0;
}

void kvpages_free(struct kvpages *pg)
{
    if (!pg)
        return;
    pthread_cond_destroy(&pg->idle);
    pthread_mutex_destroy(&pg->mu);
    free(pg->t);
    free(pg);
}

struct backend *kvpages_backend(const struct kvpages *pg)
{
    return pg->be;
}

uint64_t kvpages_page_bytes(const struct kvpages *pg, enum kvd_tier t)
{
    return pg->page_bytes[t];
}

uint32_t kvpages_total(const struct kvpages *pg, enum kvd_tier t)
{
    return pg->total[t];
}

void kvpages_stats(struct kvpages *pg, struct kvpages_stats *st)
{
    memset(st, 0, sizeof *st);
    pthread_mutex_lock(&pg->mu);
    for (int t = 0; t < KVPAGES_TIERS; t++) {
        st->page_bytes[t] = pg->page_bytes[t];
        st->pages[t] = pg->total[t];
        st->used[t] = pg->used[t];
    }
    st->pools = pg->n_members;
    for (uint32_t i = 0; i < pg->n_t; i++)
        st->tenants += pg->t[i].name[0] != '\0';
    pthread_mutex_unlock(&pg->mu);
}

/* ---- tenants -------------------------------------------------------------- */

int kvpages_tenant_ref(struct kvpages *pg, const char *name, uint32_t *id)
{
    uint32_t free_slot = KVPAGES_NONE;
    pthread_mutex_lock(&pg->mu);
    for (uint32_t i = 0; i < pg->n_t; i++) {
        if (!strcmp(pg->t[i].name, name)) {
            pg->t[i].refs++;
            *id = i;
            pthread_mutex_unlock(&pg->mu);
            return 0;
        }
        if (!pg->t[i].name[0] && free_slot == KVPAGES_NONE)
            free_slot = i;
    }
    if (free_slot == KVPAGES_NONE) {
        struct kvpages_tenant *nt = fault_realloc(pg->t, sizeof *nt * (pg->n_t + 1));
        if (!nt) {
            pthread_mutex_unlock(&pg->mu);
            return KVD_ENOMEM;
        }
        pg->t = nt;
        free_slot = pg->n_t++;
    }
    struct kvpages_tenant *t = &pg->t[free_slot];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->refs = 1;
    *id = free_slot;
    pthread_mutex_unlock(&pg->mu);
    return 0;
}

void kvpages_tenant_unref(struct kvpages *pg, uint32_t id)
{
    pthread_mutex_lock(&pg->mu);
    if (id < pg->n_t && pg->t[id].refs && --pg->t[id].refs == 0 && !pg->t[id].pages[0] &&
        !pg->t[id].pages[1])
        pg->t[id].name[0] = '\0';
    pthread_mutex_unlock(&pg->mu);
}

int kvpages_tenant_set(struct kvpages *pg, uint32_t id, const struct kvpages_limits *l, char *err,
                       size_t errlen)
{
    uint64_t sum = l->reserved_device_bytes, cap;
    pthread_mutex_lock(&pg->mu);
    if (id >= pg->n_t) {
        pthread_mutex_unlock(&pg->mu);
        snprintf(err, errlen, "no tenant %u in the page budget", id);
        return KVD_ENOTFOUND;
    }
    for (uint32_t i = 0; i < pg->n_t; i++)
        if (i != id && pg->t[i].name[0])
            sum += pg->t[i].lim.reserved_device_bytes;
    cap = (uint64_t)pg->total[KVD_TIER_DEVICE] * pg->page_bytes[KVD_TIER_DEVICE];
    if (sum > cap) {
        snprintf(err, errlen,
                 "tenant '%s': reserved floors would total %llu device bytes, the budget has %llu",
                 pg->t[id].name, (unsigned long long)sum, (unsigned long long)cap);
        pthread_mutex_unlock(&pg->mu);
        return KVD_EBADREQ;
    }
    pg->t[id].lim = *l;
    pthread_mutex_unlock(&pg->mu);
    return 0;
}

void kvpages_tenant_limits(struct kvpages *pg, uint32_t id, struct kvpages_limits *l)
{
    pthread_mutex_lock(&pg->mu);
    if (id < pg->n_t)
        *l = pg->t[id].lim;
    else
        memset(l, 0, sizeof *l);
    pthread_mutex_unlock(&pg->mu);
}

uint32_t kvpages_tenant_pages(struct kvpages *pg, enum kvd_tier t, uint32_t id)
{
    pthread_mutex_lock(&pg->mu);
    uint32_t n = id < pg->n_t ? pg->t[id].pages[t] : 0;
    pthread_mutex_unlock(&pg->mu);
    return n;
}

/* Lock held. Whole pages of the quota: a quota below one page allows none. */
static uint32_t quota_left(const struct kvpages *pg, enum kvd_tier t, uint32_t id)
{
    if (id >= pg->n_t || pg->t[id].lim.max_bytes[t] == 0 || pg->page_bytes[t] == 0)
        return UINT32_MAX;
    uint64_t q = pg->t[id].lim.max_bytes[t] / pg->page_bytes[t];
    return q > pg->t[id].pages[t] ? (uint32_t)(q - pg->t[id].pages[t]) : 0;
}

uint32_t kvpages_quota_left(struct kvpages *pg, enum kvd_tier t, uint32_t id)
{
    pthread_mutex_lock(&pg->mu);
    uint32_t n = quota_left(pg, t, id);
    pthread_mutex_unlock(&pg->mu);
    return n;
}

uint32_t kvpages_above_floor(struct kvpages *pg, uint32_t id)
{
    uint32_t n = UINT32_MAX;
    pthread_mutex_lock(&pg->mu);
    if (id < pg->n_t && pg->t[id].lim.reserved_device_bytes) {
        uint64_t pb = pg->page_bytes[KVD_TIER_DEVICE];
        uint64_t floor = (pg->t[id].lim.reserved_device_bytes + pb - 1) / pb;
        uint32_t have = pg->t[id].pages[KVD_TIER_DEVICE];
        n = have > floor ? (uint32_t)(have - floor) : 0;
    }
    pthread_mutex_unlock(&pg->mu);
    return n;
}

/* ---- pages ---------------------------------------------------------------- */

uint32_t kvpages_free_pages(struct kvpages *pg, enum kvd_tier t)
{
    pthread_mutex_lock(&pg->mu);
    uint32_t n = pg->total[t] - pg->used[t];
    pthread_mutex_unlock(&pg->mu);
    return n;
}

void kvpages_grow(struct kvpages *pg, enum kvd_tier t, uint32_t n)
{
    pthread_mutex_lock(&pg->mu);
    pg->total[t] = n > UINT32_MAX - pg->total[t] ? UINT32_MAX : pg->total[t] + n;
    pthread_mutex_unlock(&pg->mu);
}

int kvpages_take(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n, bool quota)
{
    int rc = 0;
    pthread_mutex_lock(&pg->mu);
    if (quota && quota_left(pg, t, id) < n)
        rc = KVD_EQUOTA;
    else if (pg->total[t] - pg->used[t] < n)
        rc = KVD_ENOMEM;
    if (!rc) {
        pg->used[t] += n;
        if (id < pg->n_t)
            pg->t[id].pages[t] += n;
    }
    pthread_mutex_unlock(&pg->mu);
    return rc;
}

int kvpages_claim(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n, bool quota)
{
    int rc = 0;
    if (id == KVPAGES_NONE)
        return 0; /* nobody's to count */
    pthread_mutex_lock(&pg->mu);
    if (quota && quota_left(pg, t, id) < n)
        rc = KVD_EQUOTA;
    else if (id < pg->n_t)
        pg->t[id].pages[t] += n;
    pthread_mutex_unlock(&pg->mu);
    return rc;
}

void kvpages_unclaim(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n)
{
    if (id == KVPAGES_NONE)
        return;
    pthread_mutex_lock(&pg->mu);
    if (id < pg->n_t) {
        struct kvpages_tenant *tn = &pg->t[id];
        tn->pages[t] -= n < tn->pages[t] ? n : tn->pages[t];
        if (!tn->refs && !tn->pages[0] && !tn->pages[1])
            tn->name[0] = '\0';
    }
    pthread_mutex_unlock(&pg->mu);
}

void kvpages_give(struct kvpages *pg, enum kvd_tier t, uint32_t id, uint32_t n)
{
    pthread_mutex_lock(&pg->mu);
    pg->used[t] -= n < pg->used[t] ? n : pg->used[t];
    if (id < pg->n_t) {
        struct kvpages_tenant *tn = &pg->t[id];
        tn->pages[t] -= n < tn->pages[t] ? n : tn->pages[t];
        if (!tn->refs && !tn->pages[0] && !tn->pages[1])
            tn->name[0] = '\0';
    }
    pthread_mutex_unlock(&pg->mu);
}

/* ---- members -------------------------------------------------------------- */

void kvpages_attach(struct kvpages *pg, struct kvpages_member *m)
{
    pthread_mutex_lock(&pg->mu);
    m->busy = 0;
    m->id = ++pg->next_id; /* the list is in descending ids: attached at its head */
    m->next = pg->members;
    pg->members = m;
    pg->n_members++;
    pg->n_shared += !m->unshared;
    pthread_mutex_unlock(&pg->mu);
}

void kvpages_detach(struct kvpages *pg, struct kvpages_member *m)
{
    pthread_mutex_lock(&pg->mu);
    for (struct kvpages_member **pp = &pg->members; *pp; pp = &(*pp)->next)
        if (*pp == m) {
            *pp = m->next;
            pg->n_members--;
            pg->n_shared -= !m->unshared;
            break;
        }
    while (m->busy) /* a reclaim in another thread is inside m */
        pthread_cond_wait(&pg->idle, &pg->mu);
    pthread_mutex_unlock(&pg->mu);
}

/* Lock held. The member a reclaim asks after the one of id last_id (the
 * first: UINT64_MAX): the first in the list below it, not self, with the
 * callback asked for (own: reclaim_own). NULL when none is left. */
static struct kvpages_member *next_member(struct kvpages *pg, const struct kvpages_member *self,
                                          uint64_t last_id, bool own)
{
    struct kvpages_member *m = pg->members;
    while (m && (m->id >= last_id || m == self || !(own ? m->reclaim_own : m->reclaim)))
        m = m->next;
    return m;
}

uint32_t kvpages_reclaim(struct kvpages *pg, struct kvpages_member *self, enum kvd_tier t,
                         uint32_t tenant, uint32_t n)
{
    pthread_mutex_lock(&pg->mu);
    /* Each member asked once, in the list's order: the next one is found
     * again from the head every time (the list may change while the lock
     * is released) as the first below the last one's id. What this call
     * asked is its own (last_id), so a reclaim in another thread, or one
     * nested in a member's callback, never makes it ask a member again. A
     * member is busy while it is asked, so kvpages_detach (and its pool's
     * free) waits for it. */
    uint64_t last_id = UINT64_MAX;
    uint64_t goal = (uint64_t)pg->total[t] - pg->used[t] + n;
    while ((uint64_t)pg->total[t] - pg->used[t] < goal) {
        struct kvpages_member *m = next_member(pg, self, last_id, false);
        if (!m)
            break;
        uint32_t want = (uint32_t)(goal - (pg->total[t] - pg->used[t]));
        last_id = m->id;
        m->busy++;
        pthread_mutex_unlock(&pg->mu);
        (void)m->reclaim(m->ctx, t, tenant, want);
        pthread_mutex_lock(&pg->mu);
        if (--m->busy == 0)
            pthread_cond_broadcast(&pg->idle);
    }
    uint32_t free_now = pg->total[t] - pg->used[t];
    pthread_mutex_unlock(&pg->mu);
    return free_now;
}

uint32_t kvpages_reclaim_own(struct kvpages *pg, struct kvpages_member *self, enum kvd_tier t,
                             uint32_t tenant, uint32_t n)
{
    pthread_mutex_lock(&pg->mu);
    if (tenant >= pg->n_t || !pg->t[tenant].name[0]) {
        pthread_mutex_unlock(&pg->mu);
        return 0;
    }
    uint64_t last_id = UINT64_MAX; /* as kvpages_reclaim */
    uint32_t before = pg->t[tenant].pages[t];
    while (before - pg->t[tenant].pages[t] < n && pg->t[tenant].pages[t] > 0) {
        struct kvpages_member *m = next_member(pg, self, last_id, true);
        if (!m)
            break;
        uint32_t want = n - (before - pg->t[tenant].pages[t]);
        last_id = m->id;
        m->busy++;
        pthread_mutex_unlock(&pg->mu);
        (void)m->reclaim_own(m->ctx, t, tenant, want);
        pthread_mutex_lock(&pg->mu);
        if (--m->busy == 0)
            pthread_cond_broadcast(&pg->idle);
    }
    uint32_t now = pg->t[tenant].pages[t];
    pthread_mutex_unlock(&pg->mu);
    return before > now ? before - now : 0;
}

uint32_t kvpages_share(struct kvpages *pg, enum kvd_tier t)
{
    pthread_mutex_lock(&pg->mu);
    uint32_t n = pg->total[t] / (pg->n_shared ? pg->n_shared : 1);
    pthread_mutex_unlock(&pg->mu);
    return n;
}
