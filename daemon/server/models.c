/* models: the registry on the loop thread (see models.h): which model
 * loads or unloads when, the requests waiting for a load, the keep-alive
 * timer. The loader thread (models_load.c) does the work and hands each
 * finished job back through an event. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "acct.h"
#include "arbiter.h"
#include "exec.h"
#include "log.h"
#include "models_impl.h"
#include "pages.h"
#include "server.h"
#include "text.h"

_Static_assert(OPTIONS_MAX_MODELS <= ACCT_SCHED_SLOTS, "an accounting slot per model");
_Static_assert(OPTIONS_MAX_MODELS <= 127, "a model's index fits a handle's tag");

#define TICK_MS 500 /* the keep-alive timer's period */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

const char *models_state_name(enum models_state s)
{
    switch (s) {
    case MODELS_LOADING:
        return "loading";
    case MODELS_LOADED:
        return "loaded";
    case MODELS_UNLOADING:
        return "unloading";
    default:
        return "unloaded";
    }
}

/* ---- making the registry ------------------------------------------------ */

/* conf.tenants into e->allowed. */
static int parse_allowed(struct models_entry *e, struct kvd_error *err)
{
    const char *v = e->conf.tenants;
    while (*v) {
        v += strspn(v, ", \t");
        size_t n = strcspn(v, ", \t");
        if (!n)
            break;
        if (n > KVD_MAX_NAME)
            return kvd_error_set(err, KVD_EBADREQ, "[model:%s] tenants: a name of %zu bytes",
                                 e->conf.name, n);
        char(*a)[KVD_MAX_NAME + 1] = realloc(e->allowed, (e->n_allowed + 1) * sizeof(*a));
        if (!a)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        e->allowed = a;
        memcpy(a[e->n_allowed], v, n);
        a[e->n_allowed++][n] = '\0';
        v += n;
    }
    return 0;
}

int models_new(const struct models_conf *c, struct models **out, struct kvd_error *err)
{
    struct models *ms = calloc(1, sizeof(*ms));
    if (!ms)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    ms->conf = *c;
    ms->opts = *c->opts;
    pthread_mutex_init(&ms->mu, NULL);
    pthread_cond_init(&ms->cv, NULL);
    const struct options *o = &ms->opts;
    size_t n = (o->model_path[0] ? 1 : 0) + o->n_models;
    ms->v = calloc(n ? n : 1, sizeof(*ms->v));
    int rc = ms->v ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    if (!rc && (rc = arbiter_new(&ms->arb)))
        kvd_error_set(err, rc, "out of memory");
    if (rc)
        goto fail;
    ms->n = n;
    for (size_t i = 0; i < n; i++) {
        struct models_entry *e = &ms->v[i];
        e->ms = ms;
        e->idx = (uint32_t)i;
        if (o->model_path[0] && i == 0) {
            /* --model PATH: named after the file (general.name, else its
             * file name), loaded at start, as kvd always did */
            struct kvd_error le;
            struct model_hparams hp;
            e->conf.kv_dtype = -1;
            e->conf.keep_alive_s = OPTIONS_KEEP_DEFAULT;
            e->conf.preload = true;
            snprintf(e->conf.path, sizeof e->conf.path, "%s", o->model_path);
            const char *base = strrchr(o->model_path, '/');
            const char *name = base ? base + 1 : o->model_path;
            if (model_probe(o->model_path, &hp, &le) == 0 && hp.name[0])
                name = hp.name;
            snprintf(e->conf.name, sizeof e->conf.name, "%.*s", OPTIONS_MODEL_NAME, name);
        } else {
            e->conf = o->models[i - (o->model_path[0] ? 1 : 0)];
            if (!e->conf.path[0]) {
                rc = kvd_error_set(err, KVD_EBADREQ, "[model:%s] has no path", e->conf.name);
                goto fail;
            }
        }
        if (e->conf.keep_alive_s == OPTIONS_KEEP_DEFAULT)
            e->conf.keep_alive_s = o->keep_alive_s;
        for (size_t k = 0; k < i; k++)
            if (!strcmp(ms->v[k].conf.name, e->conf.name)) {
                rc = kvd_error_set(err, KVD_EBADREQ,
                                   "two models are named '%s' (name them: --model NAME=PATH)",
                                   e->conf.name);
                goto fail;
            }
    }
    /* the drafts first: a model's KV gives its draft's a share; then the
     * page budget every model's memory comes from */
    if ((rc = mload_drafts(ms, err)) || (rc = mload_budget(ms, err)))
        goto fail;
    for (size_t i = 0; i < n; i++)
        if ((rc = parse_allowed(&ms->v[i], err)) || (rc = mload_prepare(ms, &ms->v[i], err)))
            goto fail;
    if (c->acct && n)
        acct_sched_serving(c->acct,
                           o->speculative == OPTIONS_SPEC_DRAFT   ? "draft"
                           : o->speculative == OPTIONS_SPEC_NGRAM ? "ngram"
                                                                  : "off",
                           o->spec_max_batch);
    *out = ms;
    return 0;
fail:
    models_free(ms);
    return rc;
}

void models_free(struct models *ms)
{
    if (!ms)
        return;
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        if (e->w) /* models_stop was not called */
            model_free(e->w);
        kvmm_free(e->mm);
        text_free(e->text);
        free(e->allowed);
    }
    kvpages_free(ms->pages); /* after every pool on it */
    free(ms->v);
    arbiter_free(ms->arb);
    pthread_cond_destroy(&ms->cv);
    pthread_mutex_destroy(&ms->mu);
    free(ms);
}

/* ---- finding a model ---------------------------------------------------- */

size_t models_count(const struct models *ms)
{
    return ms ? ms->n : 0;
}

struct models_entry *models_at(struct models *ms, size_t i)
{
    return ms && i < ms->n ? &ms->v[i] : NULL;
}

struct models_entry *models_of_handle(struct models *ms, uint64_t seq)
{
    return models_at(ms, (size_t)((seq >> 56) & 0x7f));
}

const struct text *models_text_of(struct models *ms, const char *name, size_t len)
{
    if (!ms || !ms->n)
        return NULL;
    for (size_t i = 0; name && ms->n > 1 && i < ms->n; i++)
        if (strlen(ms->v[i].conf.name) == len && !memcmp(ms->v[i].conf.name, name, len))
            return ms->v[i].text;
    return ms->v[0].text; /* none named, one model, or no such model (refused later) */
}

uint32_t models_context_of(struct models *ms, const char *name, size_t len)
{
    if (!ms || !ms->n)
        return 0;
    if (!name || ms->n == 1)
        return ms->v[0].probe.n_ctx;
    uint32_t most = 0;
    for (size_t i = 0; i < ms->n; i++) {
        if (strlen(ms->v[i].conf.name) == len && !memcmp(ms->v[i].conf.name, name, len))
            return ms->v[i].probe.n_ctx;
        if (ms->v[i].probe.n_ctx > most)
            most = ms->v[i].probe.n_ctx;
    }
    return most; /* no such model: refused by name, after the parse */
}

bool models_allows(const struct models_entry *e, const char *tenant)
{
    if (!e->n_allowed)
        return true;
    size_t front = strcspn(tenant, "/"); /* a sub-tenant's front end */
    for (size_t i = 0; i < e->n_allowed; i++)
        if (!strcmp(e->allowed[i], tenant) || (tenant[front] && strlen(e->allowed[i]) == front &&
                                               !strncmp(e->allowed[i], tenant, front)))
            return true;
    return false;
}

int models_resolve(struct models *ms, const char *name, size_t len, bool have, bool strict,
                   const char *tenant, struct models_entry **out, struct kvd_error *e)
{
    struct models_entry *m = NULL;
    if (!ms || !ms->n)
        return kvd_error_set(e, KVD_EUNSUPPORTED,
                             "no model: kvd runs in store mode (start it with --model)");
    if (!have || (!strict && ms->n == 1)) {
        m = &ms->v[0];
    } else {
        for (size_t i = 0; i < ms->n && !m; i++)
            if (strlen(ms->v[i].conf.name) == len && !memcmp(ms->v[i].conf.name, name, len))
                m = &ms->v[i];
        if (!m) {
            char list[512] = "";
            for (size_t i = 0; i < ms->n; i++)
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "",
                         ms->v[i].conf.name);
            kvd_error_set(e, KVD_ENOTFOUND, "no model '%.*s' (this daemon serves %s)",
                          (int)(len > 128 ? 128 : len), name, list);
            snprintf(e->param, sizeof e->param, "model");
            return KVD_ENOTFOUND;
        }
    }
    if (!models_allows(m, tenant)) {
        kvd_error_set(e, KVD_EPERM, "tenant %s may not use model '%s' (its tenants)", tenant,
                      m->conf.name);
        snprintf(e->param, sizeof e->param, "model");
        return KVD_EPERM;
    }
    *out = m;
    return 0;
}

/* ---- one model ------------------------------------------------------------ */

const char *models_name(const struct models_entry *e)
{
    return e->conf.name;
}

uint32_t models_index(const struct models_entry *e)
{
    return e->idx;
}

struct kvmm *models_kvmm(struct models_entry *e)
{
    return e->mm;
}

const struct text *models_text(const struct models_entry *e)
{
    return e->text;
}

const struct model_hparams *models_hparams(const struct models_entry *e)
{
    return &e->hp;
}

enum models_state models_state(const struct models_entry *e)
{
    return e->state;
}

struct exec *models_exec(struct models_entry *e)
{
    return e->state == MODELS_LOADED ? e->ex : NULL;
}

void models_touch(struct models_entry *e)
{
    e->last_used_ns = now_ns();
    e->idle_since_ns = 0;
}

/* In use: requests waiting for it or live in its executor, or sequences
 * open in its kvmm (block API, lent or kept ones). */
static bool in_use(struct models_entry *e)
{
    if (e->n_waits)
        return true;
    if (e->ex) {
        struct exec_stats st;
        exec_stats(e->ex, &st);
        if (st.live)
            return true;
    }
    struct kvmm_stats ks;
    kvmm_lock(e->mm);
    kvmm_stats(e->mm, &ks);
    kvmm_unlock(e->mm);
    return ks.n_seqs > 0;
}

/* ---- the loader's jobs -------------------------------------------------- */

static void job_push(struct models *ms, struct models_entry *e, enum mjob_kind kind)
{
    struct mjob *j = calloc(1, sizeof(*j));
    if (!j) { /* retried at the next tick */
        log_err("models: out of memory queueing a %s of %s", kind == MJOB_LOAD ? "load" : "unload",
                e->conf.name);
        return;
    }
    j->kind = kind;
    j->e = e;
    if (kind == MJOB_UNLOAD) {
        j->model = e->model;
        j->ex = e->ex;
        e->ex = NULL; /* the loader's now: nobody else touches it */
        e->model = NULL;
        e->state = MODELS_UNLOADING;
    } else {
        e->state = MODELS_LOADING;
    }
    pthread_mutex_lock(&ms->mu);
    if (ms->jobs_tail)
        ms->jobs_tail->next = j;
    else
        ms->jobs = j;
    ms->jobs_tail = j;
    pthread_cond_signal(&ms->cv);
    pthread_mutex_unlock(&ms->mu);
}

static void unload(struct models *ms, struct models_entry *e, const char *why)
{
    log_info("model %s: unloading (%s)", e->conf.name, why);
    job_push(ms, e, MJOB_UNLOAD);
}

/* Answers every wait of e with rc (0: loaded) and err. */
static void fire_waits(struct models_entry *e, int rc, const struct kvd_error *err)
{
    struct models_wait *w = e->waits;
    e->waits = e->waits_tail = NULL;
    e->n_waits = 0;
    while (w) {
        struct models_wait *next = w->next;
        w->fn(w->ud, rc, err);
        free(w);
        w = next;
    }
}

/* The least recently used loaded model that is not in use, other than e. */
static struct models_entry *lru_idle(struct models *ms, const struct models_entry *e)
{
    struct models_entry *best = NULL;
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *o = &ms->v[i];
        if (o == e || o->state != MODELS_LOADED || in_use(o))
            continue;
        if (!best || o->last_used_ns < best->last_used_ns)
            best = o;
    }
    return best;
}

/* Whether a model other than e is loaded, loading or unloading. */
static bool others_busy(const struct models *ms, const struct models_entry *e)
{
    for (size_t i = 0; i < ms->n; i++)
        if (&ms->v[i] != e && ms->v[i].state != MODELS_UNLOADED)
            return true;
    return false;
}

/* Starts the loads that are wanted, one at a time. A load charges the
 * model's weights and scratch to the page budget on the loader thread,
 * taking cached KV pages of the other models (to their host tiers) when
 * the budget is short; when that is not enough it fails with KVD_ENOMEM
 * and job_done unloads an idle model (least recently used first) and tries
 * again. A model that could never fit fails at once. */
static void start_loads(struct models *ms)
{
    if (ms->draining)
        return;
    uint64_t pb = kvpages_page_bytes(ms->pages, KVD_TIER_DEVICE);
    uint64_t total = (uint64_t)kvpages_total(ms->pages, KVD_TIER_DEVICE) * pb;
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        if (!e->want_load || e->state != MODELS_UNLOADED)
            continue;
        uint64_t need = mload_fixed_bytes(ms, e) + kvmm_block_bytes(e->mm);
        if (need > total) {
            struct kvd_error err;
            kvd_error_set(&err, KVD_ENOMEM,
                          "model %s needs %" PRIu64 " bytes of the device (weights, scratch "
                          "and a KV block), more than its budget (%" PRIu64 ")",
                          e->conf.name, need, total);
            snprintf(e->last_error, sizeof e->last_error, "%s", err.message);
            e->want_load = false;
            e->load_failures++;
            fire_waits(e, err.code, &err);
            continue;
        }
        /* its last try found the budget short with every other model in
         * use: again once one is idle (it may give back its cache, or
         * unload) or the pages are free */
        if (e->mem_wait) {
            if (!lru_idle(ms, e) && kvpages_free_pages(ms->pages, KVD_TIER_DEVICE) < e->mem_need)
                continue;
            e->mem_wait = false;
        }
        /* after the loads and unloads under way: what they give back or
         * take decides whether this one fits */
        bool busy = false;
        for (size_t k = 0; k < ms->n && !busy; k++)
            busy = ms->v[k].state == MODELS_LOADING || ms->v[k].state == MODELS_UNLOADING;
        if (busy)
            continue;
        log_info("model %s: loading", e->conf.name);
        e->want_load = false;
        job_push(ms, e, MJOB_LOAD);
    }
}

/* A finished job of the loader, on the loop. */
static void job_done(struct models *ms, struct mjob *j)
{
    struct models_entry *e = j->e;
    if (j->kind == MJOB_LOAD) {
        if (j->rc == 0) {
            e->model = j->model;
            e->ex = j->ex;
            e->hp = *model_hparams(j->model);
            e->weight_device = e->hp.weight_device_bytes;
            e->loaded_once = true;
            e->state = MODELS_LOADED;
            e->retried = false;
            e->loads++;
            e->load_ms = j->ms;
            e->last_error[0] = '\0';
            models_touch(e);
            log_info("model %s: loaded in %.0f ms (%.1f MiB of weights on the device)",
                     e->conf.name, j->ms, (double)e->weight_device / (1 << 20));
            fire_waits(e, 0, NULL);
        } else {
            e->state = MODELS_UNLOADED;
            /* out of memory with an idle model loaded: that one goes (least
             * recently used first, one per try, so the tries end) */
            struct models_entry *victim = lru_idle(ms, e);
            if (j->rc == KVD_ENOMEM && victim) {
                log_info("%s; unloading %s and trying again", j->err.message, victim->conf.name);
                e->retried = true;
                e->want_load = true;
                char why[160];
                snprintf(why, sizeof why, "model %s needs its memory", e->conf.name);
                unload(ms, victim, why);
            } else if (j->rc == KVD_ENOMEM && others_busy(ms, e)) {
                /* the others are in use: it waits (its requests until
                 * queue-timeout) for one to go idle */
                log_info("%s; it waits for a model to go idle", j->err.message);
                e->retried = true;
                e->want_load = true;
                e->mem_wait = true;
                e->mem_need = j->need;
            } else {
                log_err("%s", j->err.message);
                e->load_failures++;
                e->retried = false;
                snprintf(e->last_error, sizeof e->last_error, "%s", j->err.message);
                fire_waits(e, j->rc, &j->err);
            }
        }
    } else {
        e->state = MODELS_UNLOADED;
        e->unloads++;
        e->unload_ms = j->ms;
        e->moved += j->moved;
        e->dropped += j->dropped;
        if (j->rc)
            log_err("%s", j->err.message);
        log_info("model %s: unloaded in %.0f ms (%zu cached device blocks moved to the host "
                 "tier, %zu dropped)",
                 e->conf.name, j->ms, j->moved, j->dropped);
        if (e->n_waits)
            e->want_load = true; /* requests came while it unloaded */
    }
    free(j);
}

static void on_done(evutil_socket_t fd, short what, void *arg)
{
    struct models *ms = arg;
    (void)fd, (void)what;
    pthread_mutex_lock(&ms->mu);
    struct mjob *j = ms->done, *rev = NULL;
    ms->done = NULL;
    pthread_mutex_unlock(&ms->mu);
    while (j) { /* in the order they finished */
        struct mjob *next = j->next;
        j->next = rev;
        rev = j;
        j = next;
    }
    while (rev) {
        struct mjob *next = rev->next;
        job_done(ms, rev);
        rev = next;
    }
    start_loads(ms);
}

/* Idle models past their keep-alive unload; waits past the queue timeout
 * end; loads waiting for memory look again. */
static void tick(struct models *ms)
{
    uint64_t now = now_ns();
    uint64_t qt = ms->opts.queue_timeout_ms ? (uint64_t)ms->opts.queue_timeout_ms * 1000000ull : 0;
    for (size_t i = 0; i < ms->n && !ms->draining; i++) {
        struct models_entry *e = &ms->v[i];
        if (e->state == MODELS_LOADED) {
            if (in_use(e)) {
                e->idle_since_ns = 0;
            } else {
                if (!e->idle_since_ns)
                    e->idle_since_ns = now;
                if (e->conf.keep_alive_s != OPTIONS_KEEP_FOREVER &&
                    now - e->idle_since_ns >= (uint64_t)e->conf.keep_alive_s * 1000000000ull) {
                    char why[96];
                    snprintf(why, sizeof why, "idle for %u s", e->conf.keep_alive_s);
                    e->last_used_ns = e->idle_since_ns;
                    unload(ms, e, why);
                }
            }
        }
        if (!qt)
            continue;
        for (struct models_wait **p = &e->waits; *p;) {
            struct models_wait *w = *p;
            if (now - w->t0_ns < qt) {
                p = &w->next;
                continue;
            }
            *p = w->next;
            if (e->waits_tail == w) {
                e->waits_tail = NULL;
                for (struct models_wait *t = e->waits; t; t = t->next)
                    e->waits_tail = t;
            }
            e->n_waits--;
            struct kvd_error err;
            kvd_error_set(&err, KVD_EBUSY,
                          "model %s did not load within the queue timeout (%u ms): it is %s",
                          e->conf.name, ms->opts.queue_timeout_ms, models_state_name(e->state));
            w->fn(w->ud, KVD_EBUSY, &err);
            free(w);
        }
        if (!e->n_waits && e->state == MODELS_UNLOADED)
            e->want_load = false;
    }
    start_loads(ms);
}

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    tick(arg);
}

/* ---- waiting ------------------------------------------------------------ */

int models_wait(struct models_entry *e, uint64_t owner, models_ready_fn fn, void *ud,
                struct kvd_error *err)
{
    struct models *ms = e->ms;
    if (ms->draining)
        return kvd_error_set(err, KVD_ECANCELLED, "the daemon is shutting down");
    struct models_wait *w = calloc(1, sizeof(*w));
    if (!w)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    w->owner = owner;
    w->fn = fn;
    w->ud = ud;
    w->t0_ns = now_ns();
    if (e->waits_tail)
        e->waits_tail->next = w;
    else
        e->waits = w;
    e->waits_tail = w;
    e->n_waits++;
    models_touch(e);
    if (e->state != MODELS_LOADING && e->state != MODELS_LOADED)
        e->want_load = true;
    start_loads(ms);
    return 0;
}

void models_cancel_owner(struct models *ms, uint64_t owner)
{
    for (size_t i = 0; ms && i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        struct models_wait **p = &e->waits;
        e->waits_tail = NULL;
        while (*p) {
            struct models_wait *w = *p;
            if (w->owner == owner) {
                *p = w->next;
                e->n_waits--;
                w->fn(w->ud, MODELS_GONE, NULL);
                free(w);
            } else {
                e->waits_tail = w;
                p = &w->next;
            }
        }
    }
}

size_t models_cancel_waits(struct models *ms, uint64_t owner, bool (*match)(void *ud, void *arg),
                           void *arg)
{
    size_t n = 0;
    struct kvd_error err;
    kvd_error_set(&err, KVD_ECANCELLED, "cancelled while its model was loading");
    for (size_t i = 0; ms && i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        struct models_wait **p = &e->waits;
        e->waits_tail = NULL;
        while (*p) {
            struct models_wait *w = *p;
            if (w->owner == owner && match(w->ud, arg)) {
                *p = w->next;
                e->n_waits--;
                w->fn(w->ud, KVD_ECANCELLED, &err);
                free(w);
                n++;
            } else {
                e->waits_tail = w;
                p = &w->next;
            }
        }
    }
    return n;
}

/* ---- start and stop ----------------------------------------------------- */

int models_start(struct models *ms, struct server *srv, struct kvd_error *err)
{
    ms->srv = srv;
    struct event_base *base = server_event_base(srv);
    ms->ev_done = event_new(base, -1, 0, on_done, ms);
    ms->ev_kick = event_new(base, -1, 0, on_tick, ms);
    ms->ev_tick = event_new(base, -1, EV_PERSIST, on_tick, ms);
    struct timeval tv = {TICK_MS / 1000, (TICK_MS % 1000) * 1000};
    if (!ms->ev_done || !ms->ev_kick || !ms->ev_tick || event_add(ms->ev_tick, &tv) != 0)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory starting the model loader");
    /* The preloads, here and now (before the daemon says it is ready). */
    uint32_t pre = 0;
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        if (!e->conf.preload)
            continue;
        struct mjob j = {.kind = MJOB_LOAD, .e = e};
        e->state = MODELS_LOADING;
        mload_run(ms, &j);
        if (j.rc == KVD_ENOMEM && pre) {
            e->state = MODELS_UNLOADED;
            log_warn("model %s: not preloaded: the models preloaded before it leave too little "
                     "of the device budget (%s); it loads at its first request",
                     e->conf.name, j.err.message);
            continue;
        }
        if (j.rc)
            return kvd_error_set(err, j.rc, "%s", j.err.message);
        struct mjob *jp = malloc(sizeof *jp);
        if (!jp) {
            mload_discard(ms, e, j.ex);
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        }
        *jp = j;
        job_done(ms, jp);
        pre |= 1u << i;
    }
    if (pthread_create(&ms->th, NULL, mload_main, ms) != 0)
        return kvd_error_set(err, KVD_EINTERNAL, "cannot start the model loader thread");
    ms->th_started = true;
    return 0;
}

void models_drain(struct models *ms)
{
    if (!ms)
        return;
    ms->draining = true;
    struct kvd_error err;
    kvd_error_set(&err, KVD_ECANCELLED, "the daemon is shutting down");
    for (size_t i = 0; i < ms->n; i++) {
        fire_waits(&ms->v[i], KVD_ECANCELLED, &err);
        if (ms->v[i].state == MODELS_LOADED)
            exec_drain(ms->v[i].ex);
    }
}

void models_stop(struct models *ms)
{
    if (!ms)
        return;
    ms->draining = true;
    if (ms->th_started) {
        pthread_mutex_lock(&ms->mu);
        ms->stop = true;
        pthread_cond_signal(&ms->cv);
        pthread_mutex_unlock(&ms->mu);
        pthread_join(ms->th, NULL);
        ms->th_started = false;
    }
    pthread_mutex_lock(&ms->mu);
    struct mjob *lists[2] = {ms->jobs, ms->done};
    ms->jobs = ms->jobs_tail = ms->done = NULL;
    struct event *evs[3] = {ms->ev_done, ms->ev_kick, ms->ev_tick};
    ms->ev_done = ms->ev_kick = ms->ev_tick = NULL;
    pthread_mutex_unlock(&ms->mu);
    for (int k = 0; k < 3; k++)
        if (evs[k])
            event_free(evs[k]);
    for (int k = 0; k < 2; k++)
        for (struct mjob *j = lists[k], *next; j; j = next) {
            next = j->next;
            /* a finished load not yet taken: its model goes now */
            if (j->kind == MJOB_LOAD && j->rc == 0) {
                j->e->model = j->model;
                j->e->ex = j->ex;
                j->e->state = MODELS_LOADED;
            } else if (j->kind == MJOB_UNLOAD && j->ex) {
                mload_discard(ms, j->e, j->ex);
            }
            free(j);
        }
    /* each executor, then its references on weights (a draft's weights go
     * with the last executor that runs them) */
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        if (e->ex || e->model)
            mload_discard(ms, e, e->ex);
        e->ex = NULL;
        e->model = NULL;
        e->state = MODELS_UNLOADED;
    }
}

/* ---- reading ------------------------------------------------------------ */

void models_info(struct models_entry *e, struct models_info *out)
{
    memset(out, 0, sizeof(*out));
    out->name = e->conf.name;
    out->path = e->conf.path;
    out->state = e->state;
    out->loaded_once = e->loaded_once;
    out->weight_bytes = e->hp.weight_bytes;
    out->weight_device_bytes = e->weight_device;
    struct kvmm_stats ks;
    kvmm_lock(e->mm);
    out->kv_device_bytes = kvmm_device_bytes(e->mm);
    kvmm_stats(e->mm, &ks);
    kvmm_unlock(e->mm);
    out->block_bytes = kvmm_block_bytes(e->mm);
    out->kv_device_blocks = ks.device_total - ks.device_free;
    out->charged_device_bytes =
        (uint64_t)(e->w_pages + e->x_pages) * kvpages_page_bytes(e->ms->pages, KVD_TIER_DEVICE);
    out->keep_alive_s = e->conf.keep_alive_s;
    if (e->state == MODELS_LOADED && e->idle_since_ns)
        out->idle_s = (double)(now_ns() - e->idle_since_ns) / 1e9;
    out->loads = e->loads;
    out->unloads = e->unloads;
    out->load_failures = e->load_failures;
    out->load_ms_last = e->load_ms;
    out->unload_ms_last = e->unload_ms;
    out->moved_at_unload = e->moved;
    out->dropped_at_unload = e->dropped;
    out->waiting = e->n_waits;
    static const char *const modes[] = {"off", "ngram", "draft"};
    out->spec_mode = modes[e->spec_kind];
    out->draft = e->draft_path ? e->draft_name : NULL;
    out->draft_kv_bytes = e->state == MODELS_LOADED && e->ex ? exec_draft_kv_bytes(e->ex) : 0;
    out->draft_kv_max_bytes = e->draft_path ? e->draft_kv_bytes : 0;
    out->spec_max_batch = e->ms->opts.spec_max_batch;
    snprintf(out->last_error, sizeof out->last_error, "%s", e->last_error);
}
