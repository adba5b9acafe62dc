/* kvmm_remote_events: the remote tier's KV events. A value this daemon wrote is announced
 * and remembered until it is known gone: its TTL passed (Redis expires keys at exactly that
 * time), a lookup found it missing or refused it, or AllBlocksCleared. Values overlap (a
 * chain's tails and its group value hold the same first blocks), so each block counts the
 * announced values holding it: REMOTE BlockStored when the first is announced, REMOTE
 * BlockRemoved when the last goes. Everything here runs with the kvmm lock held. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fault.h"
#include "kvmm_remote_impl.h"

static uint64_t ev_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static size_t ann_slot(const struct kvmm_remote *r, uint64_t ns, struct blockkey k)
{
    return (size_t)((k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull) ^ ns) & (r->ann_cap - 1));
}

/* Lock held. The announced value (ns, key), or NULL. */
static struct ann *ann_find(struct kvmm_remote *r, uint64_t ns, struct blockkey k)
{
    if (!r->ann_cap)
        return NULL;
    for (size_t i = ann_slot(r, ns, k), n = 0; n < r->ann_cap;
         i = (i + 1) & (r->ann_cap - 1), n++) {
        struct ann *a = &r->anns[i];
        if (a->state == 0)
            return NULL;
        if (a->state == 1 && a->ns == ns && blockkey_eq(a->key, k))
            return a;
    }
    return NULL;
}

/* Lock held: a free slot for (ns, k), growing the table; NULL when out of
 * memory or full. */
static struct ann *ann_new(struct kvmm_remote *r, uint64_t ns, struct blockkey k)
{
    if (r->ann_live >= ANN_MAX)
        return NULL;
    if ((r->ann_used + 1) * 2 > r->ann_cap) { /* rehash the live ones */
        size_t cap = r->ann_cap ? r->ann_cap : 256;
        while ((r->ann_live + 1) * 4 > cap)
            cap *= 2;
        struct ann *nv = calloc(cap, sizeof *nv), *old = r->anns;
        size_t old_cap = r->ann_cap;
        if (!nv)
            return NULL;
        r->anns = nv;
        r->ann_cap = cap;
        r->ann_used = r->ann_live = 0;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].state == 1) {
                size_t j = ann_slot(r, old[i].ns, old[i].key);
                while (r->anns[j].state != 0)
                    j = (j + 1) & (cap - 1);
                r->anns[j] = old[i];
                r->ann_used++;
                r->ann_live++;
            }
        free(old);
    }
    size_t i = ann_slot(r, ns, k);
    while (r->anns[i].state == 1)
        i = (i + 1) & (r->ann_cap - 1);
    if (r->anns[i].state == 0)
        r->ann_used++;
    r->ann_live++;
    r->anns[i] = (struct ann){.ns = ns, .key = k, .state = 1};
    return &r->anns[i];
}

/* ---- how many announced values hold each block ---------------------------------- */

static size_t cnt_slot(const struct kvmm_remote *r, uint64_t ns, uint64_t pub)
{
    return (size_t)((pub ^ (ns * 0x9e3779b97f4a7c15ull)) & (r->cnt_cap - 1));
}

/* Lock held: room for n more blocks without growing (so that counting a value's blocks
 * cannot fail half-way); false when out of memory. */
static bool cnt_reserve(struct kvmm_remote *r, size_t n)
{
    if ((r->cnt_used + n) * 2 <= r->cnt_cap)
        return true;
    size_t cap = r->cnt_cap ? r->cnt_cap : 256;
    while ((r->cnt_live + n) * 4 > cap)
        cap *= 2;
    struct ann_cnt *nv = fault_calloc(cap, sizeof *nv), *old = r->cnts;
    size_t old_cap = r->cnt_cap;
    if (!nv)
        return false;
    r->cnts = nv;
    r->cnt_cap = cap;
    r->cnt_used = r->cnt_live = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].state == 1) {
            size_t j = cnt_slot(r, old[i].ns, old[i].pub);
            while (r->cnts[j].state != 0)
                j = (j + 1) & (cap - 1);
            r->cnts[j] = old[i];
            r->cnt_used++;
            r->cnt_live++;
        }
    free(old);
    return true;
}

/* Lock held: the count of (ns, pub), or NULL. */
static struct ann_cnt *cnt_find(struct kvmm_remote *r, uint64_t ns, uint64_t pub)
{
    if (!r->cnt_cap)
        return NULL;
    for (size_t i = cnt_slot(r, ns, pub), n = 0; n < r->cnt_cap;
         i = (i + 1) & (r->cnt_cap - 1), n++) {
        struct ann_cnt *c = &r->cnts[i];
        if (c->state == 0)
            return NULL;
        if (c->state == 1 && c->ns == ns && c->pub == pub)
            return c;
    }
    return NULL;
}

/* Lock held, room reserved: one more value holds (ns, pub); true when it is the first. */
static bool cnt_inc(struct kvmm_remote *r, uint64_t ns, uint64_t pub, uint32_t tenant)
{
    struct ann_cnt *c = cnt_find(r, ns, pub);
    if (c) {
        c->n++;
        return false;
    }
    size_t i = cnt_slot(r, ns, pub);
    while (r->cnts[i].state == 1)
        i = (i + 1) & (r->cnt_cap - 1);
    if (r->cnts[i].state == 0)
        r->cnt_used++;
    r->cnt_live++;
    r->cnts[i] = (struct ann_cnt){.ns = ns, .pub = pub, .n = 1, .tenant = tenant, .state = 1};
    return true;
}

/* Lock held: a value holding (ns, pub) is gone; REMOTE BlockRemoved when it was the last. */
static void cnt_dec(struct kvmm *mm, uint64_t ns, uint64_t pub)
{
    struct kvmm_remote *r = mm->remote;
    struct ann_cnt *c = cnt_find(r, ns, pub);
    if (!c || --c->n > 0)
        return;
    c->state = 2;
    r->cnt_live--;
    struct kvmm_block_event ev = {
        .stored = false, .medium = KVMM_MEDIUM_REMOTE, .tenant = c->tenant, .hash = pub};
    kvmm_events_emit(mm, &ev);
    atomic_fetch_add(&r->ev_removed, 1);
}

/* ---- announced values ------------------------------------------------------------- */

/* Lock held: the value is gone: its blocks held by no other announced value are REMOTE
 * BlockRemoved. */
static void ann_gone(struct kvmm *mm, struct ann *a)
{
    struct kvmm_remote *r = mm->remote;
    for (uint32_t i = 0; i < a->n; i++)
        cnt_dec(mm, a->ns, a->b[i].pub);
    free(a->b);
    a->b = NULL;
    a->n = 0;
    a->state = 2;
    r->ann_live--;
}

/* Lock held: a lookup found the value named (ns, key) missing or unusable. */
void mm_remote_ann_lost(struct kvmm *mm, uint64_t ns, struct blockkey key)
{
    struct ann *a = ann_find(mm->remote, ns, key);
    if (a)
        ann_gone(mm, a);
}

/* Lock held: values whose TTL has passed. */
void mm_remote_ann_expire(struct kvmm *mm)
{
    struct kvmm_remote *r = mm->remote;
    uint64_t t = ev_now_ns();
    while (r->due_head < r->due_n && r->due[r->due_head].expires <= t) {
        struct ann_due d = r->due[r->due_head++];
        struct ann *a = ann_find(r, d.ns, d.key);
        if (a && a->expires == d.expires)
            ann_gone(mm, a);
    }
    if (r->due_head == r->due_n)
        r->due_head = r->due_n = 0;
}

/* Lock held: forgets every announced value and count (AllBlocksCleared said so). */
void mm_remote_cleared(struct kvmm *mm)
{
    struct kvmm_remote *r = mm->remote;
    if (!r)
        return;
    mm_remote_ann_free(r);
    r->ann_cap = r->ann_used = r->ann_live = 0;
    r->cnt_cap = r->cnt_used = r->cnt_live = 0;
    r->due_head = r->due_n = r->due_cap = 0;
}

/* Lock held: the value just written (r->ev_*, named by key) is announced:
 * REMOTE BlockStored for its blocks no other announced value holds (in
 * chain order, each with its parent). */
void mm_remote_ann_written(struct kvmm *mm, struct blockkey key)
{
    struct kvmm_remote *r = mm->remote;
    if (!r->ev_on || !mm->events.block || r->ev_n == 0)
        return;
    struct ann *a = ann_find(r, r->ev_ns, key);
    struct ann_blk *b = malloc(sizeof *b * r->ev_n);
    if (!b)
        return;
    if (!cnt_reserve(r, r->ev_n) || (!a && !(a = ann_new(r, r->ev_ns, key)))) {
        free(b); /* not announced (an older announcement of the key, if any, stays) */
        return;
    }
    uint64_t expires = r->ttl_s ? ev_now_ns() + (uint64_t)r->ttl_s * 1000000000ull : UINT64_MAX;
    if (expires != UINT64_MAX) {
        if (r->due_head > 0 && r->due_head * 2 >= r->due_n) {
            memmove(r->due, r->due + r->due_head, sizeof *r->due * (r->due_n - r->due_head));
            r->due_n -= r->due_head;
            r->due_head = 0;
        }
        if (r->due_n == r->due_cap) {
            size_t cap = r->due_cap ? 2 * r->due_cap : 256;
            struct ann_due *v = fault_realloc(r->due, sizeof *v * cap);
            if (!v) { /* not remembered: not announced, nor the key's older announcement */
                free(b);
                ann_gone(mm, a);
                return;
            }
            r->due = v;
            r->due_cap = cap;
        }
        r->due[r->due_n++] = (struct ann_due){r->ev_ns, key, expires};
    }
    memcpy(b, r->ev_b, sizeof *b * r->ev_n);
    uint32_t bt = mm->geom.block_tokens;
    for (uint32_t i = 0; i < r->ev_n; i++) {
        if (!cnt_inc(r, r->ev_ns, b[i].pub, b[i].tenant))
            continue;
        struct kvmm_block_event ev = {.stored = true,
                                      .medium = KVMM_MEDIUM_REMOTE,
                                      .tenant = b[i].tenant,
                                      .hash = b[i].pub,
                                      .has_parent = i > 0 || r->ev_has_parent,
                                      .parent = i > 0 ? b[i - 1].pub : r->ev_parent,
                                      .tokens = r->ev_toks + (size_t)i * bt,
                                      .n_tokens = bt};
        kvmm_events_emit(mm, &ev);
        atomic_fetch_add(&r->ev_stored, 1);
    }
    /* The key written again: its older announcement's blocks (the same chain) counted
     * once less, after the new ones, so that none reaches 0 on the way. */
    for (uint32_t i = 0; i < a->n; i++)
        cnt_dec(mm, a->ns, a->b[i].pub);
    free(a->b);
    a->b = b;
    a->n = r->ev_n;
    a->expires = expires;
}

void mm_remote_ann_free(struct kvmm_remote *r)
{
    for (size_t i = 0; i < r->ann_cap; i++)
        free(r->anns[i].b);
    free(r->anns);
    free(r->due);
    free(r->cnts);
    r->anns = NULL;
    r->due = NULL;
    r->cnts = NULL;
}
