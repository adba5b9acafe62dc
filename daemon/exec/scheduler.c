/* The scheduler (see scheduler.h): queues, tenants, request lifecycle,
 * memory growth and preemption, commit; step planning is scheduler_plan.c.
 * Everything runs on the executor thread with the kvmm lock held. */
#include "scheduler.h"
#include "scheduler_impl.h"

#include "prep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* Inserts r after the last element it does not precede, walking from the
 * tail: a new arrival (the newest) is appended in O(1). */
static void rq_insert(struct rq *q, struct sched_req *r,
                      bool (*before)(const struct sched_req *, const struct sched_req *))
{
    struct sched_req *at = NULL; /* r goes before `at` (NULL: at the tail) */
    for (struct sched_req *p = q->tail; p && before(r, p); p = p->prev)
        at = p;
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

/* ---- admission heaps (per tenant) --------------------------------------- */

/* Admission order inside a tenant: higher priority, then arrival. */
static bool admit_before(const struct sched_req *a, const struct sched_req *b)
{
    if (a->priority != b->priority)
        return a->priority > b->priority;
    return a->serial < b->serial;
}

static void heap_set(struct tenant_fair *t, uint32_t i, struct sched_req *r)
{
    t->heap[i] = r;
    r->hidx = i;
}

static void heap_up(struct tenant_fair *t, uint32_t i)
{
    struct sched_req *r = t->heap[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!admit_before(r, t->heap[p]))
            break;
        heap_set(t, i, t->heap[p]);
        i = p;
    }
    heap_set(t, i, r);
}

static void heap_down(struct tenant_fair *t, uint32_t i)
{
    struct sched_req *r = t->heap[i];
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= t->n_heap)
            break;
        if (c + 1 < t->n_heap && admit_before(t->heap[c + 1], t->heap[c]))
            c++;
        if (!admit_before(t->heap[c], r))
            break;
        heap_set(t, i, t->heap[c]);
        i = c;
    }
    heap_set(t, i, r);
}

static bool heap_push(struct tenant_fair *t, struct sched_req *r)
{
    if (t->n_heap == t->cap_heap) {
        uint32_t cap = t->cap_heap ? 2 * t->cap_heap : 64;
        struct sched_req **h = realloc(t->heap, cap * sizeof(*h));
        if (!h)
            return false;
        t->heap = h;
        t->cap_heap = cap;
    }
    heap_set(t, t->n_heap++, r);
    heap_up(t, t->n_heap - 1);
    return true;
}

static void heap_remove(struct tenant_fair *t, struct sched_req *r)
{
    uint32_t i = r->hidx;
    struct sched_req *last = t->heap[--t->n_heap];
    if (i == t->n_heap)
        return;
    heap_set(t, i, last);
    heap_up(t, i);
    heap_down(t, last->hidx);
}

struct sched_req *sched_tenant_next(struct tenant_fair *t)
{
    return t->n_heap ? t->heap[0] : NULL;
}

/* ---- queues ------------------------------------------------------------- */

static struct rq *queue_of(struct sched *s, const struct sched_req *r)
{
    switch (r->state) {
    case SCHED_WAITING:
        return r->pre_wait ? &s->waiting_pre : &s->waiting;
    case SCHED_RUNNING:
        return &s->running;
    case SCHED_SWAPPED:
        return &s->swapped;
    default:
        return NULL;
    }
}

/* Takes r out of its queue (and its tenant's heap). */
static void sched_leave(struct sched *s, struct sched_req *r)
{
    struct rq *q = queue_of(s, r);
    if (!q)
        return;
    rq_remove(q, r);
    if (r->state == SCHED_WAITING) {
        struct tenant_fair *t = sched_tenant_find(s, r->tenant);
        if (t) {
            t->n_wait--;
            if (!r->pre_wait)
                heap_remove(t, r);
        }
    }
}

void sched_move_to(struct sched *s, struct sched_req *r, enum sched_state st)
{
    if (st != SCHED_RUNNING)
        r->step_n = 0; /* only running requests are in a batch */
    sched_leave(s, r);
    r->state = st;
    if (st == SCHED_WAITING) {
        /* Admitted before (preempted for recompute): the queue that goes
         * first. Otherwise the tenant's heap (or, without memory for it,
         * the first queue too, so it is still picked). */
        struct tenant_fair *t = sched_tenant_find(s, r->tenant);
        bool pre = r->n_toks > r->n_prompt || r->t_sched != 0;
        r->pre_wait = pre || !t || !heap_push(t, r);
        if (t)
            t->n_wait++;
    }
    struct rq *q = queue_of(s, r);
    if (q)
        rq_insert(q, r, st == SCHED_RUNNING ? run_before : fifo_before);
}

void sched_note_cancel(struct sched *s)
{
    atomic_store(&s->cancel_note, true);
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

struct tenant_fair *sched_tenant_find(struct sched *s, uint32_t tenant)
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
    for (size_t i = 0; i < s->n_tf; i++)
        free(s->tf[i].heap);
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
    c->waiting = s->waiting.n + s->waiting_pre.n;
    c->running = s->running.n;
    c->swapped = s->swapped.n;
}

struct sched_req *sched_running(const struct sched *s)
{
    return s->running.head;
}

bool sched_busy(const struct sched *s)
{
    return s->waiting.n + s->waiting_pre.n + s->running.n + s->swapped.n > 0;
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
    sched_move_to(s, r, SCHED_WAITING);
}

void sched_add_running(struct sched *s, struct kvmm *mm, struct sched_req *r)
{
    struct tenant_fair *t = tenant_get(s, mm, r->tenant);
    if (t)
        tenant_activate(s, t);
    r->state = SCHED_NEW;
    sched_move_to(s, r, SCHED_RUNNING);
}

struct sched_group *sched_group_new(struct sched_req *leader, uint32_t n)
{
    struct sched_group *g = calloc(1, sizeof(*g) + n * sizeof(g->reqs[0]));
    if (!g)
        return NULL;
    g->n = n;
    g->reqs[0] = leader;
    leader->group = g;
    leader->choice = 0;
    return g;
}

void sched_group_free(struct sched_group *g)
{
    if (!g)
        return;
    /* the others first: their matchers use the leader's grammar */
    for (uint32_t i = g->n; i-- > 0;)
        sched_req_free(g->reqs[i]);
    free(g);
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

int sched_req_push_lp(struct sched_req *r, const struct sampler_logprob *e)
{
    size_t stride = 1 + (size_t)r->lp_top;
    if (r->n_lp == r->cap_lp) {
        size_t cap = r->cap_lp ? r->cap_lp * 2 : 16;
        struct sampler_logprob *l = realloc(r->lp, cap * stride * sizeof(*l));
        if (!l)
            return KVD_ENOMEM;
        r->lp = l;
        r->cap_lp = cap;
    }
    memcpy(r->lp + r->n_lp * stride, e, stride * sizeof(*e));
    r->n_lp++;
    return 0;
}

void sched_req_free(struct sched_req *r)
{
    if (!r)
        return;
    free(r->toks);
    free(r->lp);
    sched_prompt_free(r->prompt);
    free(r->session);
    free(r->bias);
    text_out_free(r->text);
    grammar_matcher_free(r->gm);
    grammar_free(r->grammar);
    sched_constraint_free(r->constraint);
    free(r->fork_lp);
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
    if (r->session && !r->conn_seq) { /* closed after the save (exec.c) */
        r->session->kept = true;
        r->session->seq = r->seq;
        r->session->owner = owner;
        r->have_seq = false;
        return;
    }
    if (r->conn_seq && !atomic_load(&r->detached) &&
        kvmm_seq_set_owner(mm, owner, r->seq, r->conn) == 0) {
        r->have_seq = false;
        r->seq_returned = true;
        return;
    }
    kvmm_seq_close(mm, owner, r->seq);
    r->have_seq = false;
}

void sched_end_req(struct sched *s, struct kvmm *mm, struct sched_req *r, enum sched_finish f,
                   struct sched_req **done)
{
    if (r->ahead) {
        /* the next step's position (sched_plan_ahead), never computed */
        r->ahead = false;
        if (r->have_seq)
            kvmm_seq_truncate(mm, sched_req_owner(r), r->seq, 1);
    }
    sched_leave(s, r);
    struct tenant_fair *t = sched_tenant_find(s, r->tenant);
    if (t && t->n_reqs > 0)
        t->n_reqs--;
    release_seq(mm, r);
    r->state = SCHED_DONE;
    if (r->finish == SCHED_FINISH_NONE)
        r->finish = r->restoring ? SCHED_FINISH_CANCELLED : f;
    if (done) {
        r->next = *done;
        *done = r;
    }
}

void sched_end_error(struct sched *s, struct kvmm *mm, struct sched_req *r, int err,
                     struct sched_req **done, const char *fmt, const char *what)
{
    kvd_error_set(&r->err, err, fmt, what);
    r->finish = SCHED_FINISH_ERROR;
    sched_end_req(s, mm, r, SCHED_FINISH_ERROR, done);
}

void sched_reject(struct kvmm *mm, struct sched_req *r, struct sched_req **done)
{
    release_seq(mm, r);
    r->state = SCHED_DONE;
    if (r->finish == SCHED_FINISH_NONE)
        r->finish = SCHED_FINISH_CANCELLED;
    r->next = *done;
    *done = r;
}

void sched_finish(struct sched *s, struct kvmm *mm, struct sched_req *r, enum sched_finish f)
{
    sched_end_req(s, mm, r, f, NULL);
}

void sched_drain(struct sched *s, struct kvmm *mm, struct sched_req **done)
{
    struct rq *qs[4] = {&s->running, &s->swapped, &s->waiting_pre, &s->waiting};
    for (int i = 0; i < 4; i++)
        while (qs[i]->head)
            sched_end_req(s, mm, qs[i]->head, SCHED_FINISH_CANCELLED, done);
}

/* ---- memory ------------------------------------------------------------- */

size_t sched_blocks_for(struct kvmm *mm, size_t tokens)
{
    uint32_t bt = kvmm_geom(mm)->block_tokens;
    return (tokens + bt - 1) / bt;
}

/* The end of what r computes: every known token, or while restoring a
 * cancelled request's lent sequence, only the sequence's own tokens. */
size_t sched_target(const struct sched_req *r)
{
    return r->restoring ? r->n_orig : r->n_toks;
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
        sched_move_to(s, v, SCHED_SWAPPED);
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
    sched_move_to(s, v, SCHED_WAITING);
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

/* Whether the device pool / the tenant's quota could ever hold `blocks`. */
int sched_never_fits(struct kvmm *mm, uint32_t tenant, size_t blocks)
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

/* Grows r by n token slots and makes them writable on the device, preempting lower requests when
 * memory is short (only when `may_preempt`). GROW_SELF: r itself was preempted; GROW_ENDED: r ended
 * (it can never get the memory); GROW_BLOCKED: no room now, nothing changed. */
enum grow_result sched_grow(struct sched *s, struct kvmm *mm, struct sched_req *r, size_t n,
                            bool may_preempt, bool *preempted, struct sched_req **done)
{
    uint64_t owner = sched_req_owner(r);
    size_t at = r->n_kv + r->step_n; /* first position of the new slots */
    for (;;) {
        int rc = kvmm_seq_extend(mm, owner, r->seq, n);
        if (rc == 0) {
            /* Copy-on-write of a shared partial block (after a fork) also
             * needs a block: it fails like an extend, undone the same way. */
            rc = kvmm_seq_prepare_write(mm, owner, r->seq, at, n);
            if (rc == 0)
                return GROW_OK;
            kvmm_seq_truncate(mm, owner, r->seq, n);
        }
        if (rc != KVD_ENOMEM && rc != KVD_EQUOTA) {
            sched_end_error(s, mm, r, rc, done, "cannot grow the sequence: %s", kvmm_errmsg(mm));
            return GROW_ENDED;
        }
        if (sched_never_fits(mm, r->tenant, sched_blocks_for(mm, at + n))) {
            /* The sequence is as long as memory (or the quota) allows:
             * what it produced so far is the answer. */
            sched_end_req(s, mm, r, SCHED_FINISH_LENGTH, done);
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
        sched_end_error(s, mm, r, rc, done, "out of KV memory: %s", kvmm_errmsg(mm));
        return GROW_ENDED;
    }
}

void sched_commit(struct sched *s, struct kvmm *mm, struct sched_plan *plan,
                  struct sched_req **done)
{
    s->ctr.steps++;
    for (uint32_t i = 0; i < plan->n; i++) {
        struct sched_req *r = plan->reqs[i];
        size_t shared = 0;
        int rc =
            kvmm_seq_commit(mm, sched_req_owner(r), r->seq, r->toks + r->n_kv, r->step_n, &shared);
        if (rc) {
            sched_end_error(s, mm, r, rc, done, "cannot commit tokens: %s", kvmm_errmsg(mm));
            continue;
        }
        if (r->verify || (r->n_kv + r->step_n == r->n_toks && r->n_toks > r->n_prompt))
            s->ctr.decode_tokens += r->step_n;
        else
            s->ctr.prefill_tokens += r->step_n;
        r->n_kv += r->step_n;
        struct tenant_fair *t = sched_tenant_find(s, r->tenant);
        if (t)
            t->vtime += (double)r->step_n / t->weight;
    }
}
