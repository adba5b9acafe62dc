/* tenancy: peers, tokens and sub-tenants to registered tenants, the tenant
 * table and its admission counts (see tenancy.h).
 *
 * The table is an array of entries (a freed sub-tenant's slot is reused)
 * with two indexes: a chained hash of the names, and kvmm tenant id ->
 * entry (kvmm ids are small and dense: it reuses a removed tenant's id).
 * Each front end keeps its sub-tenants on a list, most recently used
 * first; freeing looks from the list's tail. */
#include "tenancy.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "acct.h"
#include "fault.h"
#include "log.h"

#define NONE UINT32_MAX

struct entry {
    char name[KVD_MAX_NAME + 1]; /* "" in a free slot */
    uint32_t id, ns;             /* kvmm tenant and its namespace */
    size_t n_pending;            /* requests in flight */
    uint32_t hnext;              /* next entry of the name's hash chain */
    bool sub;                    /* a front end's sub-tenant (may be freed) */
    uint32_t parent;             /* sub: its front end's entry */
    uint32_t prev, next;         /* sub: neighbours on the parent's list */
    uint32_t head, tail;         /* front end: its sub-tenants, most recent first */
    uint32_t n_subs;             /* front end: how many */
};

struct tenancy {
    struct kvmm *mm; /* the first pool: it assigns the ids */
    /* The other models' kvmms (not owned): every tenant is registered in
     * each under the same id (kvmm_tenant_set_at). */
    struct kvmm **pools;
    size_t n_pools;
    struct acct *acct;
    uint32_t max_sub, max_queued;
    struct entry *v; /* (n) slots */
    uint32_t n, cap;
    uint32_t *free_slots; /* (n_free) */
    uint32_t n_free;
    uint32_t *buckets; /* (n_buckets, a power of two) entry heads */
    uint32_t n_buckets;
    uint32_t *by_id; /* (cap_id) kvmm tenant id -> entry */
    uint32_t cap_id;
    size_t n_live, n_sub;
    uint64_t n_freed, n_refused;
};

static uint32_t name_hash(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

int tenancy_new(struct kvmm *mm, uint32_t max_sub, uint32_t max_queued, struct tenancy **out)
{
    struct tenancy *t = calloc(1, sizeof(*t));
    if (!t)
        return KVD_ENOMEM;
    t->mm = mm;
    t->max_sub = max_sub ? max_sub : 1;
    t->max_queued = max_queued;
    t->n_buckets = 64;
    t->buckets = malloc(t->n_buckets * sizeof(*t->buckets));
    if (!t->buckets) {
        free(t);
        return KVD_ENOMEM;
    }
    memset(t->buckets, 0xff, t->n_buckets * sizeof(*t->buckets));
    *out = t;
    return 0;
}

int tenancy_add_pool(struct tenancy *t, struct kvmm *mm)
{
    struct kvmm **p = realloc(t->pools, (t->n_pools + 1) * sizeof(*p));
    if (!p)
        return KVD_ENOMEM;
    t->pools = p;
    t->pools[t->n_pools++] = mm;
    return 0;
}

/* The tenant's limits in another pool: its floor only where the pool can
 * hold it (a smaller model's arena may not), said once in the log. */
static int pool_set(struct kvmm *mm, const struct kvmm_tenant_conf *conf, uint32_t id)
{
    int rc = kvmm_tenant_set_at(mm, conf, id);
    if (rc == KVD_EBADREQ && conf->reserved_device_blocks) {
        struct kvmm_tenant_conf c = *conf;
        log_warn("tenant %s: %s; no floor in that model's pool", conf->name, kvmm_errmsg(mm));
        c.reserved_device_blocks = 0;
        rc = kvmm_tenant_set_at(mm, &c, id);
    }
    return rc;
}

/* Registers tenant id (conf) in every other pool. Caller holds the first
 * pool's lock (the order: the first pool, then the others). */
static int pools_set(struct tenancy *t, const struct kvmm_tenant_conf *conf, uint32_t id,
                     struct kvd_error *e)
{
    for (size_t i = 0; i < t->n_pools; i++) {
        kvmm_lock(t->pools[i]);
        int rc = pool_set(t->pools[i], conf, id);
        if (rc)
            kvd_error_set(e, rc, "tenant '%s': %s", conf->name, kvmm_errmsg(t->pools[i]));
        kvmm_unlock(t->pools[i]);
        if (rc)
            return rc;
    }
    return 0;
}

void tenancy_free(struct tenancy *t)
{
    if (!t)
        return;
    free(t->pools);
    free(t->v);
    free(t->free_slots);
    free(t->buckets);
    free(t->by_id);
    free(t);
}

void tenancy_set_acct(struct tenancy *t, struct acct *acct)
{
    t->acct = acct;
}

/* ---- indexes ------------------------------------------------------------ */

static uint32_t find_name(const struct tenancy *t, const char *name)
{
    for (uint32_t i = t->buckets[name_hash(name) & (t->n_buckets - 1)]; i != NONE;
         i = t->v[i].hnext)
        if (!strcmp(t->v[i].name, name))
            return i;
    return NONE;
}

static uint32_t find_id(const struct tenancy *t, uint32_t id)
{
    return id < t->cap_id ? t->by_id[id] : NONE;
}

/* Doubles the buckets when the chains would average over one entry. */
static int grow_buckets(struct tenancy *t)
{
    if (t->n_live < t->n_buckets)
        return 0;
    uint32_t nb = t->n_buckets * 2;
    uint32_t *b = fault_malloc(nb * sizeof(*b));
    if (!b)
        return KVD_ENOMEM;
    memset(b, 0xff, nb * sizeof(*b));
    for (uint32_t i = 0; i < t->n; i++) {
        if (!t->v[i].name[0])
            continue;
        uint32_t h = name_hash(t->v[i].name) & (nb - 1);
        t->v[i].hnext = b[h];
        b[h] = i;
    }
    free(t->buckets);
    t->buckets = b;
    t->n_buckets = nb;
    return 0;
}

/* Room for one more entry and for kvmm id `id` in by_id. */
static int reserve(struct tenancy *t, uint32_t id)
{
    if (grow_buckets(t))
        return KVD_ENOMEM;
    if (id >= t->cap_id) {
        uint32_t nc = t->cap_id ? t->cap_id : 64;
        while (nc <= id)
            nc *= 2;
        uint32_t *b = fault_realloc(t->by_id, nc * sizeof(*b));
        if (!b)
            return KVD_ENOMEM;
        memset(b + t->cap_id, 0xff, (nc - t->cap_id) * sizeof(*b));
        t->by_id = b;
        t->cap_id = nc;
    }
    if (!t->n_free && t->n == t->cap) {
        uint32_t nc = t->cap ? t->cap * 2 : 64;
        struct entry *v = fault_realloc(t->v, nc * sizeof(*v));
        if (!v)
            return KVD_ENOMEM;
        t->v = v;
        uint32_t *f = fault_realloc(t->free_slots, nc * sizeof(*f));
        if (!f)
            return KVD_ENOMEM;
        t->free_slots = f;
        t->cap = nc;
    }
    return 0;
}

/* Adds an entry (reserve() first: it cannot fail). */
static uint32_t entry_add(struct tenancy *t, const char *name, uint32_t id, uint32_t ns)
{
    uint32_t i = t->n_free ? t->free_slots[--t->n_free] : t->n++;
    struct entry *en = &t->v[i];
    memset(en, 0, sizeof(*en));
    snprintf(en->name, sizeof(en->name), "%s", name);
    en->id = id;
    en->ns = ns;
    en->parent = en->prev = en->next = en->head = en->tail = NONE;
    uint32_t h = name_hash(name) & (t->n_buckets - 1);
    en->hnext = t->buckets[h];
    t->buckets[h] = i;
    t->by_id[id] = i;
    t->n_live++;
    return i;
}

/* ---- a front end's list of sub-tenants --------------------------------- */

static void sub_unlink(struct tenancy *t, uint32_t i)
{
    struct entry *en = &t->v[i], *p = &t->v[en->parent];
    if (en->prev != NONE)
        t->v[en->prev].next = en->next;
    else
        p->head = en->next;
    if (en->next != NONE)
        t->v[en->next].prev = en->prev;
    else
        p->tail = en->prev;
    en->prev = en->next = NONE;
}

static void sub_push_front(struct tenancy *t, uint32_t i)
{
    struct entry *en = &t->v[i], *p = &t->v[en->parent];
    en->prev = NONE;
    en->next = p->head;
    if (p->head != NONE)
        t->v[p->head].prev = i;
    else
        p->tail = i;
    p->head = i;
}

/* Removes sub-tenant entry i from every index and frees its slot. */
static void entry_remove(struct tenancy *t, uint32_t i)
{
    struct entry *en = &t->v[i];
    uint32_t *pp = &t->buckets[name_hash(en->name) & (t->n_buckets - 1)];
    while (*pp != i)
        pp = &t->v[*pp].hnext;
    *pp = en->hnext;
    sub_unlink(t, i);
    t->v[en->parent].n_subs--;
    t->by_id[en->id] = NONE;
    en->name[0] = '\0';
    t->free_slots[t->n_free++] = i;
    t->n_live--;
    t->n_sub--;
}

/* Frees the least recently used idle sub-tenant of front end p: true when
 * one went. Caller holds the kvmm lock. */
static bool free_idle_sub(struct tenancy *t, uint32_t p)
{
    for (uint32_t i = t->v[p].tail; i != NONE; i = t->v[i].prev) {
        if (t->v[i].n_pending)
            continue;
        uint32_t id = t->v[i].id;
        /* the other pools first: a pool that refuses (an open sequence
         * there) gets back the ones already removed, and the id stays */
        size_t k = 0;
        for (; k < t->n_pools; k++) {
            kvmm_lock(t->pools[k]);
            int rc = kvmm_tenant_remove(t->pools[k], id);
            kvmm_unlock(t->pools[k]);
            if (rc)
                break;
        }
        if (k < t->n_pools || kvmm_tenant_remove(t->mm, id) != 0) {
            struct kvmm_tenant_stats ts;
            if (kvmm_tenant_stats(t->mm, id, &ts) == 0)
                while (k-- > 0) {
                    kvmm_lock(t->pools[k]);
                    pool_set(t->pools[k], &ts.conf, id);
                    kvmm_unlock(t->pools[k]);
                }
            continue;
        }
        if (t->acct)
            acct_tenant_retire(t->acct, id);
        log_debug("tenancy: freed idle sub-tenant %s", t->v[i].name);
        entry_remove(t, i);
        t->n_freed++;
        return true;
    }
    return false;
}

/* ---- resolving ---------------------------------------------------------- */

int tenancy_peer_cred(int fd, struct tenancy_cred *cred, struct kvd_error *e)
{
    struct ucred uc;
    socklen_t len = sizeof(uc);
    if (fd < 0 || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &len) != 0)
        return kvd_error_set(e, KVD_EPERM, "cannot identify the peer (SO_PEERCRED: %s)",
                             fd < 0 ? "no socket" : strerror(errno));
    cred->uid = uc.uid;
    cred->gid = uc.gid;
    cred->pid = uc.pid;
    return 0;
}

int tenancy_resolve_peer(const struct config *cfg, uid_t uid, gid_t gid, struct config_identity *id,
                         struct kvd_error *e)
{
    if (config_resolve(cfg, uid, gid, id) != 0)
        return kvd_error_set(e, KVD_EPERM, "uid %u is not allowed by the configuration",
                             (unsigned)uid);
    return 0;
}

int tenancy_resolve_token(const struct config *cfg, const char *tok, struct config_identity *id,
                          struct kvd_error *e)
{
    if (!tok || config_resolve_token(cfg, tok, id) != 0)
        return kvd_error_set(e, KVD_EPERM,
                             "%s: over TCP, send 'Authorization: Bearer TOKEN' with a token "
                             "of the [http] section of kvd's configuration",
                             tok ? "unknown bearer token" : "no bearer token");
    return 0;
}

int tenancy_resolve_sub(const struct config *cfg, uid_t uid, const char *parent, const char *sub,
                        size_t len, const char *what, struct config_identity *id,
                        struct kvd_error *e)
{
    struct kvd_error sub_err;
    if (!config_is_frontend(cfg, uid))
        return kvd_error_set(e, KVD_EPERM,
                             "%s: uid %u is not a trusted front end ([front-end] uids)", what,
                             (unsigned)uid);
    if (config_resolve_sub(cfg, parent, sub, len, id, &sub_err))
        return kvd_error_set(e, sub_err.code, "%s: %s", what, sub_err.message);
    return 0;
}

/* ---- registering -------------------------------------------------------- */

static void who_fill(const struct entry *en, struct tenancy_who *who)
{
    who->tenant = en->id;
    who->ns = en->ns;
    snprintf(who->name, sizeof(who->name), "%s", en->name);
}

/* The kvmm tenant of conf, and a new entry for it; parent NONE for a
 * peer's or token's tenant. Caller holds the kvmm lock. */
static int add_locked(struct tenancy *t, const struct kvmm_tenant_conf *conf, uint32_t parent,
                      uint32_t *out, struct kvd_error *e)
{
    uint32_t id, ns;
    int rc = kvmm_tenant_set(t->mm, conf, &id);
    if (rc == 0)
        rc = kvmm_tenant_namespace(t->mm, id, &ns);
    if (rc)
        return kvd_error_set(e, rc, "tenant '%s': %s", conf->name, kvmm_errmsg(t->mm));
    if (find_id(t, id) != NONE) /* kvmm knew the name under another entry: cannot be */
        return kvd_error_set(e, KVD_EINTERNAL, "tenant '%s': kvmm id %u registered twice",
                             conf->name, id);
    if (reserve(t, id) != 0)
        return kvd_error_set(e, KVD_ENOMEM, "tenant '%s': out of memory registering it",
                             conf->name);
    if ((rc = pools_set(t, conf, id, e)) != 0)
        return rc;
    uint32_t i = entry_add(t, conf->name, id, ns);
    if (parent != NONE) {
        t->v[i].sub = true;
        t->v[i].parent = parent;
        t->v[parent].n_subs++;
        sub_push_front(t, i);
        t->n_sub++;
    }
    *out = i;
    return 0;
}

int tenancy_register(struct tenancy *t, const struct config_identity *id, struct tenancy_who *who,
                     struct kvd_error *e)
{
    uint32_t i = find_name(t, id->conf.name);
    if (i != NONE) {
        /* A sub-tenant's name now a peer's or token's tenant: kept for good. */
        if (t->v[i].sub) {
            sub_unlink(t, i);
            t->v[t->v[i].parent].n_subs--;
            t->v[i].sub = false;
            t->v[i].parent = NONE;
            t->n_sub--;
        }
        who_fill(&t->v[i], who);
        return 0;
    }
    kvmm_lock(t->mm);
    int rc = add_locked(t, &id->conf, NONE, &i, e);
    kvmm_unlock(t->mm);
    if (rc == 0)
        who_fill(&t->v[i], who);
    return rc;
}

int tenancy_register_sub(struct tenancy *t, const char *parent, const struct config_identity *id,
                         struct tenancy_who *who, struct kvd_error *e)
{
    uint32_t p = find_name(t, parent);
    if (p == NONE || t->v[p].sub)
        return kvd_error_set(e, KVD_EINTERNAL, "front end '%s' is not registered", parent);
    uint32_t i = find_name(t, id->conf.name);
    if (i != NONE) {
        if (t->v[i].sub && t->v[i].parent == p) {
            sub_unlink(t, i);
            sub_push_front(t, i);
        }
        who_fill(&t->v[i], who);
        return 0;
    }
    int rc = 0;
    kvmm_lock(t->mm);
    if (t->v[p].n_subs >= t->max_sub && !free_idle_sub(t, p)) {
        t->n_refused++;
        rc = kvd_error_set(e, KVD_EQUOTA,
                           "front end '%s' has %u sub-tenants in use (requests in flight, open "
                           "sequences or blocks), the limit (max-sub-tenants); '%s' is refused",
                           parent, t->v[p].n_subs, id->conf.name);
    }
    if (rc == 0)
        rc = add_locked(t, &id->conf, p, &i, e);
    kvmm_unlock(t->mm);
    if (rc == 0)
        who_fill(&t->v[i], who);
    return rc;
}

/* ---- admission ---------------------------------------------------------- */

void tenancy_pending(struct tenancy *t, uint32_t tenant, long delta)
{
    uint32_t i = find_id(t, tenant);
    if (i != NONE)
        t->v[i].n_pending += (size_t)delta;
}

int tenancy_admit(const struct tenancy *t, uint32_t tenant, uint32_t n, struct kvd_error *e)
{
    uint32_t i = find_id(t, tenant);
    if (i != NONE && t->v[i].n_pending + n > t->max_queued)
        return kvd_error_set(e, KVD_EBUSY,
                             "tenant '%s' has %zu generates in flight, the limit "
                             "(max-queued-per-tenant = %u)",
                             t->v[i].name, t->v[i].n_pending, t->max_queued);
    return 0;
}

/* ---- SIGHUP ------------------------------------------------------------- */

void tenancy_reload(struct tenancy *t, const struct config *cfg)
{
    kvmm_lock(t->mm);
    for (uint32_t i = 0; i < t->n; i++) {
        const struct entry *en = &t->v[i];
        if (!en->name[0])
            continue;
        struct kvmm_tenant_conf conf = cfg->defaults;
        for (size_t j = 0; j < cfg->n_tenants; j++)
            if (!strcmp(cfg->tenants[j].conf.name, en->name))
                conf = cfg->tenants[j].conf;
        snprintf(conf.name, sizeof(conf.name), "%s", en->name);
        uint32_t id;
        struct kvd_error e;
        if (kvmm_tenant_set(t->mm, &conf, &id) != 0)
            log_err("SIGHUP: tenant %s: %s", conf.name, kvmm_errmsg(t->mm));
        else if (pools_set(t, &conf, id, &e) != 0)
            log_err("SIGHUP: %s", e.message);
    }
    kvmm_unlock(t->mm);
}

/* ---- reading ------------------------------------------------------------ */

void tenancy_counts(const struct tenancy *t, struct tenancy_counts *out)
{
    out->tenants = t->n_live;
    out->sub_tenants = t->n_sub;
    out->subs_freed = t->n_freed;
    out->subs_refused = t->n_refused;
}

size_t tenancy_in_flight(const struct tenancy *t, uint32_t tenant)
{
    uint32_t i = find_id(t, tenant);
    return i == NONE ? 0 : t->v[i].n_pending;
}

size_t tenancy_sub_count(const struct tenancy *t, const char *name)
{
    uint32_t i = find_name(t, name);
    return i == NONE ? 0 : t->v[i].n_subs;
}

bool tenancy_lookup(const struct tenancy *t, const char *name, uint32_t *tenant)
{
    uint32_t i = find_name(t, name);
    if (i != NONE && tenant)
        *tenant = t->v[i].id;
    return i != NONE;
}
