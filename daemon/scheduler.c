/* The scheduler (see scheduler.h): queues, admission, preemption and fairness for
 * the executor's continuous batching. Everything here runs on the executor
 * thread with the kvmm lock held; it never waits on anything. */
#include "scheduler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A doubly-linked queue of requests; a request is in at most one. */
struct rq {
    struct sched_req *head, *tail;
    uint32_t n;
};

/* Per-tenant fairness state: virtual time = tokens computed / weight. The
 * tenant with the smallest virtual time gets the next admission. */
struct tenant_fair {
    uint32_t tenant;
    uint32_t weight;
    uint32_t n_reqs; /* requests queued anywhere */
    double vtime;
    bool blocked; /* its next request could not be admitted this step */
};

struct sched {
    struct sched_conf conf;
    struct rq waiting, running, swapped;
    struct tenant_fair *tf;
    size_t n_tf, cap_tf;
    struct sched_counters ctr;
    struct sched_req **snap; /* plan_running's snapshot of the running queue */
    uint32_t cap_snap;
};

const char *sched_finish_name(enum sched_finish f)
{
    switch (f) {
    case SCHED_FINISH_LENGTH:
        return "length";
    case SCHED_FINISH_STOP:
        return "stop";
    case SCHED_FINISH_CANCELLED:
        return "cancelled";
    default:
        return "error";
    }
}

/* ---- queues ------------------------------------------------------------- */

static void rq_remove(struct rq *q, struct sched_req *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        q->head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        q->tail = r->prev;
    r->prev = r->next = NULL;
    q->n--;
}

/* Inserts before the first element that `before` says r precedes. */
static void rq_insert(struct rq *q, struct sched_req *r,
                      bool (*before)(const struct sched_req *, const struct sched_req *))
{
    struct sched_req *at = q->head;
    while (at && !before(r, at))
        at = at->next;
    r->next = at;
    r->prev = at ? at->prev : q->tail;
    if (r->prev)
        r->prev->next = r;
    else
        q->head = r;
    if (at)
        at->prev = r;
    else
        q->tail = r;
    q->n++;
}

/* Running order: priority, then arrival. Later entries are preempted first. */
static bool run_before(const struct sched_req *a, const struct sched_req *b)
{
    if (a->priority != b->priority)
        return a->priority > b->priority;
    return a->serial < b->serial;
}

/* Swapped and waiting: arrival order (fairness is applied when picking). */
static bool fifo_before(const struct sched_req *a, const struct sched_req *b)
{
    return a->serial < b->serial;
}

static struct rq *queue_of(struct sched *s, const struct sched_req *r)
{
    switch (r->state) {
    case SCHED_WAITING:
        return &s->waiting;
    case SCHED_RUNNING:
        return &s->running;
    case SCHED_SWAPPED:
        return &s->swapped;
    default:
        return NULL;
    }
}

static void move_to(struct sched *s, struct sched_req *r, enum sched_state st)
{
    struct rq *q = queue_of(s, r);
    if (q)
        rq_remove(q, r);
    r->state = st;
    q = queue_of(s, r);
    if (q)
        rq_insert(q, r, st == SCHED_RUNNING ? run_before : fifo_before);
}

/* ---- tenants ------------------------------------------------------------ */

static struct tenant_fair *tenant_get(struct sched *s, struct kvmm *mm, uint32_t tenant)
{
    for (size_t i = 0; i < s->n_tf; i++)
        if (s->tf[i].tenant == tenant)
            return &s->tf[i];
    if (s->n_tf == s->cap_tf) {
        size_t cap = s->cap_tf ? s->cap_tf * 2 : 8;
        struct tenant_fair *tf = realloc(s->tf, cap * sizeof(*tf));
        if (!tf)
            return NULL;
        s->tf = tf;
        s->cap_tf = cap;
    }
    struct tenant_fair *t = &s->tf[s->n_tf++];
    memset(t, 0, sizeof(*t));
    t->tenant = tenant;
    t->weight = 1;
    struct kvmm_tenant_stats st;
    if (mm && kvmm_tenant_stats(mm, tenant, &st) == 0 && st.conf.weight >= 1)
        t->weight = st.conf.weight;
    return t;
}

/* A tenant that was idle starts at the smallest virtual time of the busy
 * ones: idle time earns no credit to burst with later. */
static void tenant_activate(struct sched *s, struct tenant_fair *t)
{
    if (t->n_reqs++ > 0)
        return;
    bool any = false;
    double vmin = 0;
    for (size_t i = 0; i < s->n_tf; i++) {
        if (&s->tf[i] == t || s->tf[i].n_reqs == 0)
            continue;
        if (!any || s->tf[i].vtime < vmin)
            vmin = s->tf[i].vtime;
        any = true;
    }
    if (any && t->vtime < vmin)
        t->vtime = vmin;
}

static struct tenant_fair *tenant_find(struct sched *s, uint32_t tenant)
{
    for (size_t i = 0; i < s->n_tf; i++)
        if (s->tf[i].tenant == tenant)
            return &s->tf[i];
    return NULL;
}

/* ---- lifecycle ---------------------------------------------------------- */

int sched_new(const struct sched_conf *conf, struct sched **out)
{
    if (conf->max_seqs == 0 || conf->step_tokens < conf->max_seqs)
        return KVD_EBADREQ;
    struct sched *s = calloc(1, sizeof(*s));
    if (!s)
        return KVD_ENOMEM;
    s->conf = *conf;
    *out = s;
    return 0;
}

void sched_free(struct sched *s)
{
    if (!s)
        return;
    free(s->tf);
    free(s->snap);
    free(s);
}

const struct sched_conf *sched_conf(const struct sched *s)
{
    return &s->conf;
}

void sched_counters(const struct sched *s, struct sched_counters *c)
{
    *c = s->ctr;
    c->waiting = s->waiting.n;
    c->running = s->running.n;
    c->swapped = s->swapped.n;
}

bool sched_busy(const struct sched *s)
{
    return s->waiting.n + s->running.n + s->swapped.n > 0;
}

uint64_t sched_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sched_add(struct sched *s, struct kvmm *mm, struct sched_req *r)
{
    struct tenant_fair *t = tenant_get(s, mm, r->tenant);
    if (t)
        tenant_activate(s, t);
    r->state = SCHED_NEW;
    move_to(s, r, SCHED_WAITING);
}

int sched_req_push(struct sched_req *r, uint32_t tok)
{
    if (r->n_toks == r->cap_toks) {
        size_t cap = r->cap_toks ? r->cap_toks * 2 : 64;
        uint32_t *t = realloc(r->toks, cap * sizeof(*t));
        if (!t)
            return KVD_ENOMEM;
        r->toks = t;
        r->cap_toks = cap;
    }
    r->toks[r->n_toks++] = tok;
    return 0;
}

void sched_req_free(struct sched_req *r)
{
    if (!r)
        return;
    free(r->toks);
    free(r);
}

void sched_plan_free(struct sched_plan *plan)
{
    free(plan->reqs);
    free(plan->slot0);
    free(plan->slots);
    memset(plan, 0, sizeof(*plan));
}

/* Releases the request's sequence: a connection's sequence goes back to the
 * connection (unless it is gone), an executor sequence is closed. */
static void release_seq(struct kvmm *mm, struct sched_req *r)
{
    if (!r->have_seq)
        return;
    uint64_t owner = sched_req_owner(r);
    if (r->conn_seq && !atomic_load(&r->detached) &&
        kvmm_seq_set_owner(mm, owner, r->seq, r->conn) == 0) {
        r->have_seq = false;
        r->seq_returned = true;
        return;
    }
    kvmm_seq_close(mm, owner, r->seq);
    r->have_seq = false;
}

static void end_req(struct sched *s, struct kvmm *mm, struct sched_req *r, enum sched_finish f,
                    struct sched_req **done)
{
    struct rq *q = queue_of(s, r);
    if (q)
        rq_remove(q, r);
    struct tenant_fair *t = tenant_find(s, r->tenant);
    if (t && t->n_reqs > 0)
        t->n_reqs--;
    release_seq(mm, r);
    r->state = SCHED_DONE;
    if (r->finish == SCHED_FINISH_NONE)
        r->finish = f;
    if (done) {
        r->next = *done;
        *done = r;
    }
}

static void end_error(struct sched *s, struct kvmm *mm, struct sched_req *r, int err,
                      struct sched_req **done, const char *fmt, const char *what)
{
    r->err = err;
    snprintf(r->errmsg, sizeof(r->errmsg), fmt, what);
    r->finish = SCHED_FINISH_ERROR;
    end_req(s, mm, r, SCHED_FINISH_ERROR, done);
}

void sched_finish(struct sched *s, struct kvmm *mm, struct sched_req *r, enum sched_finish f)
{
    end_req(s, mm, r, f, NULL);
}

void sched_drain(struct sched *s, struct kvmm *mm, struct sched_req **done)
{
    struct rq *qs[3] = {&s->running, &s->swapped, &s->waiting};
    for (int i = 0; i < 3; i++)
        while (qs[i]->head)
            end_req(s, mm, qs[i]->head, SCHED_FINISH_CANCELLED, done);
}

/* ---- memory ------------------------------------------------------------- */

static size_t blocks_for(struct kvmm *mm, size_t tokens)
{
    uint32_t bt = kvmm_geom(mm)->block_tokens;
    return (tokens + bt - 1) / bt;
}

/* Makes room by preempting v: swap its blocks to the host tier; when the
 * host tier cannot take them, drop its K/V (recompute later from its
 * tokens, which are all known). Returns false if neither worked. */
static bool preempt(struct sched *s, struct kvmm *mm, struct sched_req *v)
{
    uint64_t owner = sched_req_owner(v);
    if (kvmm_seq_offload(mm, owner, v->seq) == 0) {
        s->ctr.preempt_swap++;
        v->n_preempt++;
        move_to(s, v, SCHED_SWAPPED);
        return true;
    }
    struct kvmm_seq_info info;
    if (kvmm_seq_info(mm, owner, v->seq, &info) != 0)
        return false;
    if (info.n_tokens > 0 && kvmm_seq_truncate(mm, owner, v->seq, info.n_tokens) != 0)
        return false;
    v->n_kv = 0;
    v->need_match = true;
    s->ctr.preempt_recompute++;
    v->n_preempt++;
    move_to(s, v, SCHED_WAITING);
    return true;
}

/* The running request to preempt for r: the last in running order (lowest
 * priority, newest) that is not already in this step's batch; same tenant
 * only when the limit hit is the tenant's quota. */
static struct sched_req *pick_victim(struct sched *s, const struct sched_req *r, bool same_tenant)
{
    for (struct sched_req *v = s->running.tail; v; v = v->prev) {
        if (v == r || v->step_n > 0 || !v->have_seq)
            continue;
        if (same_tenant && v->tenant != r->tenant)
            continue;
        if (run_before(v, r))
            return NULL; /* never preempt a request ahead of r */
        return v;
    }
    return NULL;
}

enum grow_result { GROW_OK, GROW_SELF, GROW_ENDED, GROW_BLOCKED };

/* Whether the device pool / the tenant's quota could ever hold `blocks`. */
static int never_fits(struct kvmm *mm, uint32_t tenant, size_t blocks)
{
    struct kvmm_stats st;
    kvmm_stats(mm, &st);
    if (blocks > st.device_total)
        return KVD_ENOMEM;
    struct kvmm_tenant_stats ts;
    if (kvmm_tenant_stats(mm, tenant, &ts) == 0 && ts.conf.max_device_blocks != KVMM_UNLIMITED &&
        blocks > ts.conf.max_device_blocks)
        return KVD_EQUOTA;
    return 0;
}

/* Grows r by n token slots and makes them writable on the device, preempting lower requests when memory is short
 * (only when `may_preempt`). GROW_SELF: r itself was preempted;
 * GROW_ENDED: r ended (it can never get the memory); GROW_BLOCKED: no room
 * now, nothing changed. */
static enum grow_result grow(struct sched *s, struct kvmm *mm, struct sched_req *r, size_t n,
                             bool may_preempt, bool *preempted, struct sched_req **done)
{
    uint64_t owner = sched_req_owner(r);
    for (;;) {
        int rc = kvmm_seq_extend(mm, owner, r->seq, n);
        if (rc == 0) {
            /* Copy-on-write of a shared partial block (after a fork) also
             * needs a block: it fails like an extend, undone the same way. */
            rc = kvmm_seq_prepare_write(mm, owner, r->seq, r->n_kv, n);
            if (rc == 0)
                return GROW_OK;
            kvmm_seq_truncate(mm, owner, r->seq, n);
        }
        if (rc != KVD_ENOMEM && rc != KVD_EQUOTA) {
            end_error(s, mm, r, rc, done, "cannot grow the sequence: %s", kvmm_errmsg(mm));
            return GROW_ENDED;
        }
        if (never_fits(mm, r->tenant, blocks_for(mm, r->n_kv + n))) {
            /* The sequence is as long as memory (or the quota) allows:
             * what it produced so far is the answer. */
            end_req(s, mm, r, SCHED_FINISH_LENGTH, done);
            return GROW_ENDED;
        }
        if (!may_preempt)
            return GROW_BLOCKED;
        struct sched_req *v = pick_victim(s, r, rc == KVD_EQUOTA);
        if (v && preempt(s, mm, v)) {
            *preempted = true;
            continue;
        }
        /* Nobody below r to take memory from: r waits for memory itself. */
        if (preempt(s, mm, r)) {
            *preempted = true;
            return GROW_SELF;
        }
        end_error(s, mm, r, rc, done, "out of KV memory: %s", kvmm_errmsg(mm));
        return GROW_ENDED;
    }
}

/* ---- planning ----------------------------------------------------------- */

static int plan_reserve(struct sched *s, struct sched_plan *plan)
{
    if (!plan->reqs) {
        plan->reqs = calloc(s->conf.max_seqs, sizeof(*plan->reqs));
        plan->slot0 = calloc(s->conf.max_seqs + 1, sizeof(*plan->slot0));
        if (!plan->reqs || !plan->slot0)
            return KVD_ENOMEM;
    }
    return 0;
}

static void plan_add(struct sched_plan *plan, struct sched_req *r, uint32_t n)
{
    if (r->t_sched == 0)
        r->t_sched = sched_now_ns();
    r->step_n = n;
    plan->reqs[plan->n++] = r;
    plan->n_tokens += n;
}

static size_t min_sz(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* Phase 1: running requests, decode tokens first (pass 0), then prefill
 * chunks (pass 1), each in priority order, preempting the ones behind it
 * for memory. Iterates over a snapshot: preemption moves requests out of
 * the running queue while we walk it. */
static int plan_running(struct sched *s, struct kvmm *mm, struct sched_plan *plan,
                        uint32_t *budget, bool *preempted, struct sched_req **done)
{
    if (s->running.n > s->cap_snap) {
        struct sched_req **snap = realloc(s->snap, s->running.n * sizeof(*snap));
        if (!snap)
            return KVD_ENOMEM;
        s->snap = snap;
        s->cap_snap = s->running.n;
    }
    uint32_t n_snap = 0;
    for (struct sched_req *r = s->running.head; r; r = r->next)
        s->snap[n_snap++] = r;
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = 0; i < n_snap; i++) {
            struct sched_req *r = s->snap[i];
            if (plan->n >= s->conf.max_seqs || *budget == 0)
                return 0;
            if (r->state != SCHED_RUNNING || r->step_n > 0)
                continue;
            size_t left = r->n_toks - r->n_kv;
            if ((pass == 0) != (left == 1))
                continue;
            size_t n = min_sz(left, *budget);
            if (grow(s, mm, r, n, true, preempted, done) == GROW_OK) {
                plan_add(plan, r, (uint32_t)n);
                *budget -= (uint32_t)n;
            }
        }
    }
    return 0;
}

/* Phase 2: swapped requests come back, oldest first, when their blocks and
 * their next chunk fit without preempting anyone. */
static void plan_swapped(struct sched *s, struct kvmm *mm, struct sched_plan *plan,
                         uint32_t *budget, struct sched_req **done)
{
    while (s->swapped.head && plan->n < s->conf.max_seqs && *budget > 0) {
        struct sched_req *r = s->swapped.head;
        uint64_t owner = sched_req_owner(r);
        struct kvmm_seq_info info;
        if (kvmm_seq_info(mm, owner, r->seq, &info) != 0) {
            end_error(s, mm, r, KVD_EINTERNAL, done, "sequence lost while swapped%s", "");
            continue;
        }
        size_t n = min_sz(r->n_toks - r->n_kv, *budget);
        size_t need = info.n_host + blocks_for(mm, r->n_kv + n) - info.n_blocks;
        if (kvmm_device_available(mm, r->tenant) < need)
            return;
        if (kvmm_seq_restore(mm, owner, r->seq) != 0)
            return;
        s->ctr.resumes++;
        move_to(s, r, SCHED_RUNNING);
        bool dummy = false;
        if (grow(s, mm, r, n, false, &dummy, done) != GROW_OK)
            return;
        plan_add(plan, r, (uint32_t)n);
        *budget -= (uint32_t)n;
    }
}

/* The next waiting request to admit: requests preempted for recompute
 * first (they were admitted before), then the tenant furthest behind its
 * weighted share, then priority, then arrival. */
static struct sched_req *pick_waiting(struct sched *s)
{
    struct sched_req *best = NULL;
    double best_v = 0;
    for (struct sched_req *r = s->waiting.head; r; r = r->next) {
        struct tenant_fair *t = tenant_find(s, r->tenant);
        if (t && t->blocked)
            continue;
        double v = t ? t->vtime : 0;
        bool pre = r->n_toks > r->n_prompt || r->t_sched != 0;
        if (!best) {
            best = r;
            best_v = v;
            continue;
        }
        bool best_pre = best->n_toks > best->n_prompt || best->t_sched != 0;
        if (pre != best_pre) {
            if (pre) {
                best = r;
                best_v = v;
            }
            continue;
        }
        if (pre)
            continue; /* both preempted: arrival order (queue order) */
        if (v < best_v || (v == best_v && r->priority > best->priority)) {
            best = r;
            best_v = v;
        }
    }
    return best;
}

/* Opens (first time) and matches the cache (first time, or after a
 * recompute preemption). Returns 0, or a kvmm error that ends or blocks. */
static int admit_prepare(struct sched *s, struct kvmm *mm, struct sched_req *r)
{
    uint64_t owner = sched_req_owner(r);
    if (!r->have_seq) {
        int rc = kvmm_seq_open(mm, owner, r->tenant, r->ns, &r->seq);
        if (rc)
            return rc;
        r->have_seq = true;
        r->need_match = true;
    }
    if (r->need_match) {
        /* The last known token is always computed: its logits are needed. */
        size_t matched = 0;
        if (r->n_toks > 1 && kvmm_seq_match(mm, owner, r->seq, r->toks, r->n_toks - 1, &matched) != 0)
            matched = 0;
        r->n_kv = matched;
        if (r->t_sched == 0)
            r->n_cached = matched;
        r->need_match = false;
    }
    return 0;
}

/* A waiting request that could not be admitted lets go of the blocks it
 * matched: held, they could deadlock admission (every waiting request
 * holding part of the pool, each needing one more block); released, they are
 * evictable cache that the next match usually finds again. */
static void unadmit(struct kvmm *mm, struct sched_req *r, struct tenant_fair *t)
{
    if (t)
        t->blocked = true;
    struct kvmm_seq_info info;
    uint64_t owner = sched_req_owner(r);
    if (!r->have_seq || kvmm_seq_info(mm, owner, r->seq, &info) != 0 || info.n_tokens == 0)
        return;
    if (kvmm_seq_truncate(mm, owner, r->seq, info.n_tokens) == 0) {
        r->n_kv = 0;
        r->need_match = true;
    }
}

/* Phase 3: admit waiting requests while the budget, the batch and the
 * memory allow. A request is admitted only when blocks for its whole
 * remaining prompt (plus its first generated token) are available, so an
 * admitted prefill does not stall half way for memory. */
static void plan_waiting(struct sched *s, struct kvmm *mm, struct sched_plan *plan,
                         uint32_t *budget, struct sched_req **done)
{
    for (size_t i = 0; i < s->n_tf; i++)
        s->tf[i].blocked = false;
    while (plan->n < s->conf.max_seqs && *budget > 0) {
        struct sched_req *r = pick_waiting(s);
        if (!r)
            return;
        struct tenant_fair *t = tenant_find(s, r->tenant);
        size_t want = blocks_for(mm, r->n_toks + 1);
        int never = never_fits(mm, r->tenant, want);
        if (never) {
            char what[96];
            snprintf(what, sizeof(what), "%zu tokens need %zu KV blocks, more than the %s", r->n_toks + 1,
                     want, never == KVD_EQUOTA ? "tenant's device quota" : "device pool");
            end_error(s, mm, r, never, done, "%s", what);
            continue;
        }
        struct kvmm_tenant_stats ts;
        if (!r->have_seq && kvmm_tenant_stats(mm, r->tenant, &ts) == 0 && ts.conf.max_seqs == 0) {
            end_error(s, mm, r, KVD_EQUOTA, done, "%s", "the tenant's sequence quota is 0");
            continue;
        }
        int rc = admit_prepare(s, mm, r);
        if (rc == KVD_EQUOTA || rc == KVD_ENOMEM) {
            if (t)
                t->blocked = true; /* e.g. the tenant's max_seqs: wait */
            continue;
        }
        if (rc) {
            end_error(s, mm, r, rc, done, "cannot open a sequence: %s", kvmm_errmsg(mm));
            continue;
        }
        struct kvmm_seq_info info;
        if (kvmm_seq_info(mm, sched_req_owner(r), r->seq, &info) != 0) {
            end_error(s, mm, r, KVD_EINTERNAL, done, "sequence lost%s", "");
            continue;
        }
        size_t need = info.n_host + (want > info.n_blocks ? want - info.n_blocks : 0);
        if (kvmm_device_available(mm, r->tenant) < need ||
            (info.n_host && kvmm_seq_restore(mm, sched_req_owner(r), r->seq) != 0)) {
            unadmit(mm, r, t);
            continue;
        }
        size_t n = min_sz(r->n_toks - r->n_kv, *budget);
        bool dummy = false;
        enum grow_result g = grow(s, mm, r, n, false, &dummy, done);
        if (g == GROW_BLOCKED) {
            unadmit(mm, r, t);
            continue;
        }
        if (g != GROW_OK)
            continue;
        move_to(s, r, SCHED_RUNNING);
        plan_add(plan, r, (uint32_t)n);
        *budget -= (uint32_t)n;
    }
}

/* Ends cancelled requests wherever they are. */
static void reap_cancelled(struct sched *s, struct kvmm *mm, struct sched_req **done)
{
    struct rq *qs[3] = {&s->running, &s->swapped, &s->waiting};
    for (int i = 0; i < 3; i++) {
        struct sched_req *r = qs[i]->head;
        while (r) {
            struct sched_req *next = r->next;
            if (atomic_load(&r->cancel))
                end_req(s, mm, r, SCHED_FINISH_CANCELLED, done);
            r = next;
        }
    }
}

/* Collects the slot tables once every allocation of the step is done. */
static int plan_slots(struct kvmm *mm, struct sched_plan *plan, struct sched_req **done,
                      struct sched *s)
{
    size_t total = 0;
    for (uint32_t i = 0; i < plan->n; i++)
        total += blocks_for(mm, plan->reqs[i]->n_kv + plan->reqs[i]->step_n);
    if (total > plan->cap_slots) {
        uint32_t *sl = realloc(plan->slots, total * sizeof(*sl));
        if (!sl)
            return KVD_ENOMEM;
        plan->slots = sl;
        plan->cap_slots = total;
    }
    uint32_t k = 0, at = 0;
    for (uint32_t i = 0; i < plan->n; i++) {
        struct sched_req *r = plan->reqs[i];
        uint64_t owner = sched_req_owner(r);
        size_t n = 0, want = blocks_for(mm, r->n_kv + r->step_n);
        int rc = kvmm_seq_device_slots(mm, owner, r->seq, plan->slots + at, want, &n);
        if (rc == 0 && n != want)
            rc = KVD_EINTERNAL;
        if (rc) {
            r->step_n = 0;
            end_error(s, mm, r, rc, done, "cannot place the sequence on the device: %s",
                      kvmm_errmsg(mm));
            continue;
        }
        plan->reqs[k] = r;
        plan->slot0[k] = at;
        at += (uint32_t)n;
        k++;
    }
    plan->slot0[k] = at;
    plan->n = k;
    plan->n_tokens = 0;
    for (uint32_t i = 0; i < k; i++)
        plan->n_tokens += plan->reqs[i]->step_n;
    return 0;
}

int sched_plan(struct sched *s, struct kvmm *mm, struct sched_plan *plan, struct sched_req **done)
{
    int rc = plan_reserve(s, plan);
    if (rc)
        return rc;
    plan->n = 0;
    plan->n_tokens = 0;
    for (struct sched_req *r = s->running.head; r; r = r->next)
        r->step_n = 0;
    reap_cancelled(s, mm, done);

    uint32_t budget = s->conf.step_tokens;
    bool preempted = false;
    rc = plan_running(s, mm, plan, &budget, &preempted, done);
    if (rc)
        return rc;
    /* After a preemption memory is short: resuming or admitting now would
     * only thrash. */
    if (!preempted)
        plan_swapped(s, mm, plan, &budget, done);
    if (!preempted && s->swapped.n == 0)
        plan_waiting(s, mm, plan, &budget, done);
    return plan_slots(mm, plan, done, s);
}

void sched_commit(struct sched *s, struct kvmm *mm, struct sched_plan *plan,
                  struct sched_req **done)
{
    s->ctr.steps++;
    for (uint32_t i = 0; i < plan->n; i++) {
        struct sched_req *r = plan->reqs[i];
        size_t shared = 0;
        int rc = kvmm_seq_commit(mm, sched_req_owner(r), r->seq, r->toks + r->n_kv, r->step_n,
                                 &shared);
        if (rc) {
            end_error(s, mm, r, rc, done, "cannot commit tokens: %s", kvmm_errmsg(mm));
            continue;
        }
        if (r->n_kv + r->step_n == r->n_toks && r->n_toks > r->n_prompt)
            s->ctr.decode_tokens += r->step_n;
        else
            s->ctr.prefill_tokens += r->step_n;
        r->n_kv += r->step_n;
        struct tenant_fair *t = tenant_find(s, r->tenant);
        if (t)
            t->vtime += (double)r->step_n / t->weight;
    }
}
