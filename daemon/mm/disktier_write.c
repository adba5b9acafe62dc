/* disktier_write: where blocks go on disk: batched, checked writes (disktier_put_many), the
 * fdatasync that makes them durable, and eviction (GCLOCK over the use list: a block's hits
 * and its tenant's weight buy it more turns; disktier.h "eviction order"). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "disktier_impl.h"
#include "fault.h"
#include "log.h"

/* ---- eviction ----------------------------------------------------------- */

/* A block's credit (struct slot): weight - 1, plus weight for each doubling of its hits
 * (log2(1 + hits), at most CREDIT_DOUBLINGS), at most 255. As in the memory tiers' `hits`
 * policy (docs/architecture.md "Which block first"), each doubling of the hits is worth the
 * same extra lifetime, here one more turn through the whole tier, and a tenant of weight w
 * keeps its blocks about w times as long. */
#define CREDIT_DOUBLINGS 16u
#define EVICT_SCAN 64u /* slots one eviction passes over at most */

static uint8_t credit_for(uint32_t hits, uint32_t weight)
{
    uint32_t d = 0;
    for (uint64_t x = (uint64_t)hits + 1; x > 1 && d < CREDIT_DOUBLINGS; x >>= 1)
        d++;
    uint32_t c = (weight - 1) + weight * d;
    return (uint8_t)(c > 255 ? 255 : c);
}

static uint8_t weight_of(uint32_t w)
{
    return (uint8_t)(w == 0 ? 1 : w > 255 ? 255 : w);
}

void dt_slot_read_hit(struct disktier *dt, uint32_t s)
{
    struct slot *x = &dt->slots[s];
    x->hits += x->hits != UINT32_MAX;
    x->credit = credit_for(x->hits, x->weight);
    dt_lru_unlink(dt, s);
    dt_lru_push_front(dt, s);
}

bool disktier_touch(struct disktier *dt, uint64_t ns, struct blockkey key, uint32_t hits,
                    uint32_t weight)
{
    dt_lock(dt);
    uint32_t e = dt->table[dt_table_find(dt, ns, key)];
    bool found = e != 0 && dt->slots[e - 1].state == SLOT_VALID;
    if (found) {
        struct slot *x = &dt->slots[e - 1];
        if (hits > x->hits)
            x->hits = hits;
        x->weight = weight_of(weight);
        x->credit = credit_for(x->hits, x->weight);
        dt_lru_unlink(dt, e - 1);
        dt_lru_push_front(dt, e - 1);
    }
    dt_unlock(dt);
    return found;
}

/* Under mu: the slot a full tier evicts, DISKTIER_NONE when every one is pinned or being read.
 * From the least recently used end: a slot pinned by a session (until it expires) is passed
 * over to the front; one with credit (the hits policy) spends one and goes to the front for
 * another turn (GCLOCK); the first with none is the victim. Each eviction passes over at most
 * EVICT_SCAN slots: past that, the least credited one seen goes (so an eviction's time under
 * the lock is bounded however much credit the tier holds). With `lru` credit is ignored. */
static uint32_t evict_victim(struct disktier *dt)
{
    uint64_t now = (uint64_t)time(NULL);
    uint32_t best = DISKTIER_NONE, scanned = 0;
    uint64_t seen = 0;
    for (uint32_t s = dt->lru_tail; s != DISKTIER_NONE && seen <= dt->n_slots; seen++) {
        struct slot *x = &dt->slots[s];
        uint32_t prev = x->prev;
        if (x->readers) { /* being read: left where it is, for now */
            s = prev;
            continue;
        }
        if (dt->recs[s].expires > now) {
            dt_lru_unlink(dt, s);
            dt_lru_push_front(dt, s);
            s = prev;
            continue;
        }
        if (dt->lru || x->credit == 0)
            return s;
        if (best == DISKTIER_NONE || x->credit < dt->slots[best].credit)
            best = s;
        if (++scanned > EVICT_SCAN)
            return best;
        x->credit--;
        dt->st.evict_passes++;
        dt_lru_unlink(dt, s);
        dt_lru_push_front(dt, s);
        s = prev;
    }
    return best;
}

/* Under mu: a slot to write into, taken from the free list or evicted (evict_victim: never
 * one being read or pinned by a session until later). */
static uint32_t slot_take(struct disktier *dt)
{
    uint32_t s = dt->free_head;
    if (s != DISKTIER_NONE) {
        dt->free_head = dt->slots[s].next;
        dt->st.free_slots--;
    } else {
        if ((s = evict_victim(dt)) == DISKTIER_NONE)
            return s;
        dt_slot_drop(dt, s);
        dt->st.evictions++;
        dt->free_head = dt->slots[s].next;
        dt->st.free_slots--;
    }
    dt->slots[s].state = SLOT_WRITING;
    dt->slots[s].next = dt->slots[s].prev = DISKTIER_NONE;
    return s;
}

/* The injected fault of the tests a block write takes, if any (each point
 * counted once per block, in this order). */
enum wr_fault { WR_OK = 0, WR_EIO, WR_NOSPC, WR_TORN };

static enum wr_fault wr_fault_next(void)
{
    if (fault_should_fail(FAULT_DISK_WRITE))
        return WR_EIO;
    if (fault_should_fail(FAULT_DISK_NOSPC))
        return WR_NOSPC;
    if (fault_should_fail(FAULT_DISK_TORN))
        return WR_TORN;
    return WR_OK;
}

/* pwrite of one whole slot, failing as the fault says. */
static ssize_t slot_write(struct disktier *dt, const void *buf, uint32_t s, enum wr_fault f)
{
    size_t n = dt->slot_bytes;
    switch (f) {
    case WR_EIO:
        errno = EIO;
        return -1;
    case WR_NOSPC:
        errno = ENOSPC;
        return -1;
    case WR_TORN: /* half the slot lands; success reported */
        return pwrite(dt->data_fd, buf, dt_round_up(n / 2, PAGE), dt_slot_off(dt, s)) < 0
                   ? -1
                   : (ssize_t)n;
    case WR_OK:
        break;
    }
    return pwrite(dt->data_fd, buf, n, dt_slot_off(dt, s));
}

/* The slot header of a block about to be written to buf. */
static void slot_hdr_fill(const struct disktier *dt, const struct disktier_wr *w)
{
    struct slot_hdr *h = w->buf;
    uint32_t *stored = (uint32_t *)((char *)w->buf + sizeof *h);
    memset(h, 0, sizeof *h);
    h->magic = SLOT_MAGIC;
    h->version = FILE_VERSION;
    h->block_tokens = dt->block_tokens;
    h->block_bytes = dt->block_bytes;
    h->ns = w->ns;
    h->key_lo = w->key.lo;
    h->key_hi = w->key.hi;
    h->uuid = dt->uuid;
    snprintf(h->ns_name, sizeof h->ns_name, "%s", w->ns_name);
    memcpy(stored, w->tokens, 4ull * dt->block_tokens);
    h->data_sum = dt_data_sum(disktier_data(dt, w->buf), dt->block_bytes, w->key.lo);
    h->sum = dt_slot_hdr_sum(h, dt->block_tokens);
}

/* Under mu: slot s now holds w's block (written: ok), or goes back to the
 * free list. 0 or KVD_EINTERNAL. */
static int put_finish(struct disktier *dt, uint32_t s, const struct disktier_wr *w, bool ok,
                      int err)
{
    const struct slot_hdr *h = w->buf;
    if (!ok) {
        dt->st.io_errors++;
        dt_free_push(dt, s);
        log_warn("disk tier: writing slot %u failed: %s", s, err ? strerror(err) : "a short write");
        return KVD_EINTERNAL;
    }
    struct disk_rec *r = &dt->recs[s];
    *r = (struct disk_rec){.magic = REC_MAGIC,
                           .flags = REC_VALID,
                           .ns = w->ns,
                           .key_lo = w->key.lo,
                           .key_hi = w->key.hi,
                           .data_sum = h->data_sum,
                           .stamp = dt->stamp++};
    r->sum = dt_rec_sum(r);
    int rw = dt_rec_write(dt, s);
    if (rw == 0 && dt->n_unsynced == dt->cap_unsynced) {
        size_t cap = dt->cap_unsynced ? 2 * dt->cap_unsynced : 256;
        uint32_t *v = realloc(dt->unsynced, cap * sizeof *v);
        if (v) {
            dt->unsynced = v;
            dt->cap_unsynced = cap;
        }
    }
    if (rw || dt->n_unsynced == dt->cap_unsynced) {
        memset(r, 0, sizeof *r);
        dt->st.io_errors++;
        dt_free_push(dt, s);
        return KVD_EINTERNAL;
    }
    dt->unsynced[dt->n_unsynced++] = s;
    dt->slots[s].state = SLOT_VALID;
    dt->slots[s].hits = w->hits;
    dt->slots[s].weight = weight_of(w->weight);
    dt->slots[s].credit = credit_for(w->hits, dt->slots[s].weight);
    dt_table_add(dt, s);
    dt_lru_push_front(dt, s);
    dt->st.cached_slots++;
    dt->st.writes++;
    dt->st.write_bytes += dt->slot_bytes;
    return 0;
}

size_t disktier_put_many(struct disktier *dt, struct disktier_wr *v, size_t n)
{
    if (n == 0)
        return 0;
    size_t per_req = DISKTIER_REQ_BYTES / dt->slot_bytes;
    if (per_req == 0)
        per_req = 1;
    uint32_t *slot = malloc(sizeof *slot * n);
    size_t *ord = malloc(sizeof *ord * n);
    ssize_t *res = malloc(sizeof *res * n);
    int *err = malloc(sizeof *err * n);
    enum wr_fault *fault = malloc(sizeof *fault * n);
    struct iovec *iov = malloc(sizeof *iov * n);
    size_t n_ok = 0, n_ord = 0, reqs = 0;
    if (!slot || !ord || !res || !err || !fault || !iov) {
        for (size_t i = 0; i < n; i++)
            v[i].rc = KVD_ENOMEM;
        goto out;
    }

    dt_lock(dt);
    for (size_t i = 0; i < n; i++) {
        slot[i] = DISKTIER_NONE;
        v[i].rc = 0;
        bool dup = dt->table[dt_table_find(dt, v[i].ns, v[i].key)] != 0;
        for (size_t j = 0; !dup && j < i; j++) /* the same block twice in a batch */
            dup = slot[j] != DISKTIER_NONE && v[j].ns == v[i].ns && blockkey_eq(v[j].key, v[i].key);
        if (dup) {
            n_ok++;
            continue;
        }
        if ((slot[i] = slot_take(dt)) == DISKTIER_NONE) {
            dt->st.write_skips++;
            v[i].rc = KVD_ENOMEM;
        }
    }
    dt_unlock(dt);

    for (size_t i = 0; i < n; i++) {
        res[i] = -1;
        err[i] = 0;
        if (slot[i] == DISKTIER_NONE)
            continue;
        slot_hdr_fill(dt, &v[i]);
        fault[i] = wr_fault_next();
        if (fault[i] != WR_OK) { /* a fault is one block's: written on its own */
            res[i] = slot_write(dt, v[i].buf, slot[i], fault[i]);
            err[i] = errno;
            reqs++;
        } else {
            ord[n_ord++] = i;
        }
    }
    /* The others by slot; runs of adjacent slots go out as one pwritev. */
    for (size_t i = 1; i < n_ord; i++) {
        size_t x = ord[i], j = i;
        while (j > 0 && slot[ord[j - 1]] > slot[x]) {
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = x;
    }
    for (size_t k = 0; k < n_ord;) {
        size_t run = 1;
        while (k + run < n_ord && run < per_req && slot[ord[k + run]] == slot[ord[k]] + run)
            run++;
        for (size_t r = 0; r < run; r++)
            iov[r] = (struct iovec){v[ord[k + r]].buf, dt->slot_bytes};
        ssize_t w = pwritev(dt->data_fd, iov, (int)run, dt_slot_off(dt, slot[ord[k]]));
        int e = errno;
        reqs++;
        if (w == (ssize_t)(run * dt->slot_bytes)) {
            for (size_t r = 0; r < run; r++)
                res[ord[k + r]] = (ssize_t)dt->slot_bytes;
        } else { /* failed or short: each block once more on its own */
            for (size_t r = 0; r < run; r++) {
                size_t i = ord[k + r];
                res[i] = run == 1 ? w : slot_write(dt, v[i].buf, slot[i], WR_OK);
                err[i] = run == 1 ? e : errno;
                reqs += run > 1;
            }
        }
        k += run;
    }

    dt_lock(dt);
    dt->st.write_reqs += reqs;
    for (size_t i = 0; i < n; i++) {
        if (slot[i] == DISKTIER_NONE)
            continue;
        bool ok = res[i] == (ssize_t)dt->slot_bytes;
        v[i].rc = put_finish(dt, slot[i], &v[i], ok, ok || res[i] >= 0 ? 0 : err[i]);
        n_ok += v[i].rc == 0;
    }
    dt_unlock(dt);
out:
    free(slot);
    free(ord);
    free(res);
    free(err);
    free(fault);
    free(iov);
    return n_ok;
}

int disktier_put(struct disktier *dt, const char *ns_name, uint64_t ns, struct blockkey key,
                 const uint32_t *tokens, void *buf)
{
    struct disktier_wr w = {.ns_name = ns_name, .ns = ns, .key = key, .tokens = tokens, .buf = buf};
    disktier_put_many(dt, &w, 1);
    return w.rc;
}

int disktier_sync(struct disktier *dt)
{
    int bad = fdatasync(dt->data_fd) != 0;
    bad |= fdatasync(dt->index_fd) != 0;
    if (fault_should_fail(FAULT_DISK_FSYNC))
        bad = 1;
    dt_lock(dt);
    size_t lost = 0;
    if (bad) {
        /* After a failed fsync the kernel may have dropped those pages:
         * nothing written since the last good sync is trusted. */
        dt->st.io_errors++;
        for (size_t i = 0; i < dt->n_unsynced; i++) {
            uint32_t s = dt->unsynced[i];
            if (dt->slots[s].state == SLOT_VALID) {
                dt_slot_drop(dt, s);
                lost++;
            }
        }
    }
    dt->n_unsynced = 0;
    dt_unlock(dt);
    if (bad)
        log_warn("disk tier %s: fdatasync failed; the %zu blocks written since the last good "
                 "sync are dropped",
                 dt->dir, lost);
    return bad ? KVD_EINTERNAL : 0;
}
