/* The scheduler's step planning (see scheduler.h): decodes, fair-shared
 * prefill chunks, swap-ins, admissions and leftovers; no_memory for requests
 * nothing can ever make room for, busy after the queue timeout. */
#include "scheduler_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- fair share of the prefill budget ---------------------------------- */

static size_t min_sz(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* Splits what is left of the step's budget after the decodes among the
 * tenants with prefill work (running prefills, swapped or waiting requests)
 * by weight: a tenant flooding long prompts cannot take every step from
 * another tenant's waiting request. Unused shares go to running prefills
 * at the end of the step (plan_fill), so one tenant alone gets everything. */
static void share_budget(struct sched *s, uint32_t budget)
{
    for (size_t i = 0; i < s->n_tf; i++) {
        s->tf[i].prefills = false;
        s->tf[i].share = 0;
    }
    struct rq *qs[2] = {&s->running, &s->swapped};
    for (int i = 0; i < 2; i++)
        for (struct sched_req *r = qs[i]->head; r; r = r->next) {
            if (i == 0 && (r->step_n > 0 || sched_target(r) <= r->n_kv))
                continue; /* decoding this step, or nothing left to compute */
            struct tenant_fair *t = sched_tenant_find(s, r->tenant);
            if (t)
                t->prefills = true;
        }
    for (size_t i = 0; i < s->n_tf; i++)
        if (s->tf[i].n_wait > 0)
            s->tf[i].prefills = true;
    uint64_t wsum = 0;
    for (size_t i = 0; i < s->n_tf; i++)
        wsum += s->tf[i].prefills ? s->tf[i].weight : 0;
    for (size_t i = 0; i < s->n_tf; i++) {
        struct tenant_fair *t = &s->tf[i];
        if (!t->prefills)
            continue;
        uint64_t sh = (uint64_t)budget * t->weight / wsum;
        t->share = sh ? (uint32_t)sh : 1;
    }
}

/* The prefill tokens r may take now: its tenant's share and the budget. */
static size_t share_of(struct sched *s, const struct sched_req *r, size_t left, uint32_t budget)
{
    struct tenant_fair *t = sched_tenant_find(s, r->tenant);
    size_t n = min_sz(left, budget);
    return t ? min_sz(n, t->share) : n;
}

static void share_take(struct sched *s, const struct sched_req *r, uint32_t n)
{
    struct tenant_fair *t = sched_tenant_find(s, r->tenant);
    if (t)
        t->share = t->share > n ? t->share - n : 0;
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

/* Phase 1: running requests, decode tokens first (pass 0), then prefill
 * chunks within each tenant's fair share (pass 1), each in priority order,
 * preempting the ones behind it for memory. Iterates over a snapshot:
 * preemption moves requests out of the running queue while we walk it. */
static int plan_running(struct sched *s, struct kvmm *mm, struct sched_plan *plan, uint32_t *budget,
                        bool *preempted, struct sched_req **done)
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
        if (pass == 1)
            share_budget(s, *budget);
        for (uint32_t i = 0; i < n_snap; i++) {
            struct sched_req *r = s->snap[i];
            if (plan->n >= s->conf.max_seqs || *budget == 0)
                return 0;
            if (r->state != SCHED_RUNNING || r->step_n > 0 || sched_target(r) <= r->n_kv)
                continue;
            size_t left = sched_target(r) - r->n_kv;
            bool decode = left == 1 && !r->restoring;
            if ((pass == 0) != decode)
                continue;
            size_t n = pass == 0 ? 1 : share_of(s, r, left, *budget);
            if (n == 0)
                continue;
            if (pass == 0 && r->n_draft) {
                /* A verification: the drafts too, if the budget and free
                 * memory take them now (drafts never preempt anyone). */
                size_t nd = r->n_draft < *budget ? r->n_draft : *budget - 1;
                bool dummy = false;
                enum grow_result g = GROW_BLOCKED;
                if (nd && !sched_never_fits(mm, r->tenant, sched_blocks_for(mm, r->n_kv + 1 + nd)))
                    g = sched_grow(s, mm, r, 1 + nd, false, &dummy, done);
                if (g == GROW_ENDED)
                    continue;
                if (g == GROW_OK) {
                    r->n_draft = (uint32_t)nd;
                    r->verify = true;
                    plan_add(plan, r, (uint32_t)(1 + nd));
                    *budget -= (uint32_t)(1 + nd);
                    continue;
                }
                r->n_draft = 0;
            }
            if (sched_grow(s, mm, r, n, true, preempted, done) == GROW_OK) {
                plan_add(plan, r, (uint32_t)n);
                *budget -= (uint32_t)n;
                if (pass == 1)
                    share_take(s, r, (uint32_t)n);
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
    while (s->swapped.head && plan->n<s->conf.max_seqs && * budget> 0) {
        struct sched_req *r = s->swapped.head;
        uint64_t owner = sched_req_owner(r);
        struct kvmm_seq_info info;
        if (kvmm_seq_info(mm, owner, r->seq, &info) != 0) {
            sched_end_error(s, mm, r, KVD_EINTERNAL, done, "sequence lost while swapped%s", "");
            continue;
        }
        size_t left = sched_target(r) - r->n_kv;
        size_t n = left == 1 ? 1 : share_of(s, r, left, *budget);
        if (n == 0)
            return; /* its tenant had its share: oldest first, so wait */
        size_t need = info.n_host + sched_blocks_for(mm, r->n_kv + n) - info.n_blocks;
        if (kvmm_device_available(mm, r->tenant) < need)
            return;
        if (kvmm_seq_restore(mm, owner, r->seq) != 0)
            return;
        s->ctr.resumes++;
        sched_move_to(s, r, SCHED_RUNNING);
        bool dummy = false;
        if (sched_grow(s, mm, r, n, false, &dummy, done) != GROW_OK)
            return;
        plan_add(plan, r, (uint32_t)n);
        *budget -= (uint32_t)n;
        if (left > 1)
            share_take(s, r, (uint32_t)n);
    }
}

/* Phase 5: what the fair shares left unused goes to running prefills (in
 * priority order, chunks may grow), without preempting anyone. */
static void plan_fill(struct sched *s, struct kvmm *mm, struct sched_plan *plan, uint32_t *budget,
                      struct sched_req **done)
{
    struct sched_req *next;
    for (struct sched_req *r = s->running.head; r && *budget > 0; r = next) {
        next = r->next;
        size_t end = r->n_kv + r->step_n;
        if (end >= sched_target(r) || (r->step_n == 0 && plan->n >= s->conf.max_seqs))
            continue;
        size_t n = min_sz(sched_target(r) - end, *budget);
        bool dummy = false;
        if (sched_grow(s, mm, r, n, false, &dummy, done) != GROW_OK)
            continue;
        if (r->step_n == 0) {
            plan_add(plan, r, (uint32_t)n);
        } else {
            r->step_n += (uint32_t)n;
            plan->n_tokens += (uint32_t)n;
        }
        *budget -= (uint32_t)n;
    }
}

/* The next waiting request to admit: requests preempted for recompute
 * first (they were admitted before), then the tenant furthest behind its
 * weighted share, then priority, then arrival. */
static struct sched_req *pick_waiting(struct sched *s)
{
    /* Admitted before: arrival order, skipping blocked tenants (these are
     * few: each was running, so memory bounds them). */
    for (struct sched_req *r = s->waiting_pre.head; r; r = r->next) {
        struct tenant_fair *t = sched_tenant_find(s, r->tenant);
        if (!t || !t->blocked)
            return r;
    }
    /* Then each tenant's best (its heap's top): smallest virtual time,
     * then priority, then arrival. */
    struct sched_req *best = NULL;
    double best_v = 0;
    for (size_t i = 0; i < s->n_tf; i++) {
        struct tenant_fair *t = &s->tf[i];
        struct sched_req *r = t->blocked ? NULL : sched_tenant_next(t);
        if (!r)
            continue;
        if (!best || t->vtime < best_v ||
            (t->vtime == best_v && (r->priority > best->priority ||
                                    (r->priority == best->priority && r->serial < best->serial)))) {
            best = r;
            best_v = t->vtime;
        }
    }
    return best;
}

/* Opens (first time) and matches the cache (first time, or after a
 * recompute preemption). Returns 0, or a kvmm error that ends or blocks. */
static int admit_prepare(struct sched *s, struct kvmm *mm, struct sched_req *r)
{
    (void)s;
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
        size_t matched = 0, end = sched_target(r);
        if (end > 1 && kvmm_seq_match(mm, owner, r->seq, r->toks, end - 1, &matched) != 0)
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

/* r cannot be admitted. While any request runs or is swapped, memory will
 * come back: r waits (unadmit). With none, only block-API sequences (other
 * connections', or its own connection's) hold what r needs and nothing the
 * executor does will free it: r is answered no_memory now, saying what holds
 * the pool, instead of waiting forever. */
static void admit_failed(struct sched *s, struct kvmm *mm, struct sched_req *r,
                         struct tenant_fair *t, size_t need, struct sched_req **done)
{
    if (s->running.n + s->swapped.n > 0) {
        unadmit(mm, r, t);
        return;
    }
    struct kvmm_stats st;
    struct kvmm_tenant_stats ts;
    kvmm_stats(mm, &st);
    size_t avail = kvmm_device_available(mm, r->tenant);
    s->ctr.no_memory++;
    int ok = kvmm_tenant_stats(mm, r->tenant, &ts);
    if (ok == 0 && ts.conf.max_device_blocks != KVMM_UNLIMITED &&
        avail < st.device_free + st.device_cached) {
        kvd_error_set(&r->err, KVD_EQUOTA,
                      "tenant device quota: %zu of %u blocks available, %u held by its open "
                      "sequences; need %zu",
                      avail, ts.conf.max_device_blocks, ts.device_blocks - ts.cached_blocks, need);
    } else if (ok == 0 && ts.conf.max_device_bytes && avail < kvmm_device_room(mm, r->tenant)) {
        kvd_error_set(&r->err, KVD_EQUOTA,
                      "tenant '%s': device byte quota %llu reached (%llu bytes of pages held in "
                      "every model's pool, %u blocks here by its open sequences); %zu blocks "
                      "available, need %zu",
                      ts.name, (unsigned long long)ts.conf.max_device_bytes,
                      (unsigned long long)ts.device_bytes, ts.device_blocks - ts.cached_blocks,
                      avail, need);
    } else {
        kvd_error_set(&r->err, KVD_ENOMEM,
                      "device pool: %zu of %u blocks free, %u held by open sequences; need %zu",
                      avail, st.device_total, st.device_used, need);
    }
    r->finish = SCHED_FINISH_ERROR;
    sched_end_req(s, mm, r, SCHED_FINISH_ERROR, done);
}

/* Phase 3: admit waiting requests while the budget, the batch and the
 * memory allow. A request is admitted only when blocks for its whole
 * remaining prompt (plus its first generated token) are available, so an
 * admitted prefill does not stall half way for memory. Its first chunk is
 * within its tenant's fair share. */
static void plan_waiting(struct sched *s, struct kvmm *mm, struct sched_plan *plan,
                         uint32_t *budget, struct sched_req **done)
{
    for (size_t i = 0; i < s->n_tf; i++)
        s->tf[i].blocked = false;
    while (plan->n<s->conf.max_seqs && * budget> 0) {
        struct sched_req *r = pick_waiting(s);
        if (!r)
            return;
        struct tenant_fair *t = sched_tenant_find(s, r->tenant);
        if (t && t->share == 0) {
            t->blocked = true; /* its share is spent: the next tenant's turn */
            continue;
        }
        size_t want = sched_blocks_for(mm, sched_target(r) + (r->restoring ? 0 : 1));
        /* What the whole request will hold: K/V for every token but the
         * last one it samples. Fails now rather than after the work. */
        size_t most = sched_target(r);
        if (!r->restoring) {
            size_t end = r->n_prompt + r->max_tokens;
            most = (end < r->n_ctx ? end : r->n_ctx) - 1;
            if (most < r->n_toks + 1)
                most = r->n_toks + 1;
        }
        size_t most_blocks = sched_blocks_for(mm, most);
        int never = sched_never_fits(mm, r->tenant, most_blocks);
        if (never) {
            struct kvmm_stats st;
            struct kvmm_tenant_stats nts;
            kvmm_stats(mm, &st);
            uint32_t cap = st.device_total;
            if (never == KVD_EQUOTA && kvmm_tenant_stats(mm, r->tenant, &nts) == 0)
                cap = nts.conf.max_device_blocks;
            char what[160];
            snprintf(what, sizeof(what),
                     "%zu prompt tokens + max_tokens %u need %zu KV blocks, more than the %s "
                     "(%u blocks)",
                     r->n_prompt, r->max_tokens, most_blocks,
                     never == KVD_EQUOTA ? "tenant's device quota" : "device pool", cap);
            sched_end_error(s, mm, r, never, done, "%s", what);
            continue;
        }
        struct kvmm_tenant_stats ts;
        if (!r->have_seq && kvmm_tenant_stats(mm, r->tenant, &ts) == 0 && ts.conf.max_seqs == 0) {
            sched_end_error(s, mm, r, KVD_EQUOTA, done, "%s", "the tenant's sequence quota is 0");
            continue;
        }
        int rc = admit_prepare(s, mm, r);
        if ((rc == KVD_EQUOTA || rc == KVD_ENOMEM) && s->running.n + s->swapped.n == 0) {
            /* e.g. the tenant's max_seqs, all held by open sequences */
            s->ctr.no_memory++;
            sched_end_error(s, mm, r, rc, done,
                            "cannot open a sequence, and no request is running "
                            "to free one: %s",
                            kvmm_errmsg(mm));
            continue;
        }
        if (rc == KVD_EQUOTA || rc == KVD_ENOMEM) {
            if (t)
                t->blocked = true; /* e.g. the tenant's max_seqs: wait */
            continue;
        }
        if (rc) {
            sched_end_error(s, mm, r, rc, done, "cannot open a sequence: %s", kvmm_errmsg(mm));
            continue;
        }
        struct kvmm_seq_info info;
        if (kvmm_seq_info(mm, sched_req_owner(r), r->seq, &info) != 0) {
            sched_end_error(s, mm, r, KVD_EINTERNAL, done, "sequence lost%s", "");
            continue;
        }
        size_t need = info.n_host + (want > info.n_blocks ? want - info.n_blocks : 0);
        /* Short here: the other models' pools give the tenant's own cache
         * (its byte quota spans them) and, when nothing runs here to give
         * memory back, the cache others may lose. */
        if (kvmm_device_ask(mm, r->tenant, need, s->running.n + s->swapped.n == 0) < need ||
            (info.n_host && kvmm_seq_restore(mm, sched_req_owner(r), r->seq) != 0)) {
            admit_failed(s, mm, r, t, need, done);
            continue;
        }
        size_t n = share_of(s, r, sched_target(r) - r->n_kv, *budget);
        bool dummy = false;
        enum grow_result g = sched_grow(s, mm, r, n, false, &dummy, done);
        if (g == GROW_BLOCKED) {
            admit_failed(s, mm, r, t, need, done);
            continue;
        }
        if (g != GROW_OK)
            continue;
        sched_move_to(s, r, SCHED_RUNNING);
        plan_add(plan, r, (uint32_t)n);
        *budget -= (uint32_t)n;
        share_take(s, r, (uint32_t)n);
    }
}

/* Ends cancelled requests wherever they are. A seq-mode request whose
 * sequence lacks some of the tokens it was lent with first recomputes them
 * (restoring, see scheduler.h); a request never scheduled within the queue
 * timeout is answered busy. */
static void reap_one(struct sched *s, struct kvmm *mm, struct sched_req *r, uint64_t now,
                     struct sched_req **done)
{
    if (atomic_load(&r->cancel) && !r->restoring) {
        if (r->conn_seq && r->have_seq && !atomic_load(&r->detached) && r->n_kv < r->n_orig)
            r->restoring = true;
        else
            sched_end_req(s, mm, r, SCHED_FINISH_CANCELLED, done);
    } else if (now && r->state == SCHED_WAITING && r->t_sched == 0 && !r->restoring &&
               now - r->t_arrive > s->conf.queue_timeout_ns) {
        s->ctr.queue_timeouts++;
        kvd_error_set(&r->err, KVD_EBUSY,
                      "waited %.3f s in the queue without being scheduled (queue timeout); "
                      "the executor is saturated",
                      (double)(now - r->t_arrive) / 1e9);
        r->finish = SCHED_FINISH_ERROR;
        sched_end_req(s, mm, r, SCHED_FINISH_ERROR, done);
    }
}

static void reap_cancelled(struct sched *s, struct kvmm *mm, struct sched_req **done)
{
    uint64_t now = s->conf.queue_timeout_ns ? sched_now_ns() : 0;
    /* The waiting queues are walked whole only after a cancel. */
    bool all = atomic_exchange(&s->cancel_note, false);
    struct rq *qs[4] = {&s->running, &s->swapped, &s->waiting_pre, &s->waiting};
    for (int i = 0; i < 4; i++) {
        struct sched_req *r = qs[i]->head;
        while (r) {
            struct sched_req *next = r->next;
            if (i == 3 && !all) {
                /* Arrival order: past the first one that has not timed
                 * out, none has. */
                if (!now || now - r->t_arrive <= s->conf.queue_timeout_ns)
                    break;
            }
            reap_one(s, mm, r, now, done);
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
        total += sched_blocks_for(mm, plan->reqs[i]->n_kv + plan->reqs[i]->step_n);
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
        size_t n = 0, want = sched_blocks_for(mm, r->n_kv + r->step_n);
        int rc = kvmm_seq_device_slots(mm, owner, r->seq, plan->slots + at, want, &n);
        if (rc == 0 && n != want)
            rc = KVD_EINTERNAL;
        if (rc) {
            r->step_n = 0;
            sched_end_error(s, mm, r, rc, done, "cannot place the sequence on the device: %s",
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

bool sched_plan_ahead(struct sched *s, struct kvmm *mm, const struct sched_plan *cur,
                      struct sched_plan *next)
{
    if (plan_reserve(s, next))
        return false;
    next->n = 0;
    next->n_tokens = 0;
    if (s->waiting.n || s->waiting_pre.n || s->swapped.n || s->running.n != cur->n)
        return false;
    for (uint32_t i = 0; i < cur->n; i++) {
        struct sched_req *r = cur->reqs[i];
        uint64_t owner = sched_req_owner(r);
        if (r->state != SCHED_RUNNING || r->step_n != 1 || r->verify || r->restoring ||
            r->n_kv + 1 != r->n_toks || r->ahead)
            goto undo;
        /* the position after this step's: the token this step samples */
        if (kvmm_seq_extend(mm, owner, r->seq, 1) != 0)
            goto undo;
        if (kvmm_seq_prepare_write(mm, owner, r->seq, r->n_kv + 1, 1) != 0) {
            kvmm_seq_truncate(mm, owner, r->seq, 1);
            goto undo;
        }
        r->ahead = true;
        next->reqs[next->n++] = r;
    }
    return true;
undo:
    for (uint32_t i = 0; i < next->n; i++) {
        struct sched_req *r = next->reqs[i];
        kvmm_seq_truncate(mm, sched_req_owner(r), r->seq, 1);
        r->ahead = false;
    }
    next->n = 0;
    return false;
}

int sched_plan_ahead_slots(struct sched *s, struct kvmm *mm, struct sched_plan *next,
                           struct sched_req **done)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < next->n; i++) {
        struct sched_req *r = next->reqs[i];
        if (!r->ahead || r->state != SCHED_RUNNING)
            continue; /* ended: its position went back with it */
        r->ahead = false;
        r->step_n = 1;
        r->verify = false;
        next->reqs[k++] = r;
    }
    next->n = k;
    return plan_slots(mm, next, done, s);
}

int sched_plan(struct sched *s, struct kvmm *mm, struct sched_plan *plan, struct sched_req **done)
{
    int rc = plan_reserve(s, plan);
    if (rc)
        return rc;
    plan->n = 0;
    plan->n_tokens = 0;
    for (struct sched_req *r = s->running.head; r; r = r->next) {
        r->step_n = 0;
        r->verify = false;
    }
    for (size_t i = 0; i < s->n_tf; i++)
        s->tf[i].share = 0; /* set by plan_running once the decodes are planned */
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
    plan_fill(s, mm, plan, &budget, done);
    return plan_slots(mm, plan, done, s);
}
