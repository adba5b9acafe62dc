/* disktier_read: the disk tier's batched, checked reads (disktier.h "batch reads"). A batch's
 * slots are sorted and runs of adjacent ones coalesced into requests of up to
 * DISKTIER_REQ_BYTES; with io_uring up to DISKTIER_QDEPTH of them are in flight, and each
 * request's blocks are checked as soon as it completes, while the others are still being read;
 * disktier_read_begin returns with the requests in flight, so a caller can look up and start
 * the next batch before it waits for this one (kvmm_disk.c's restore windows). Without
 * io_uring the requests are read one at a time with preadv. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "disktier_impl.h"
#include "fault.h"
#include "log.h"

/* Why the block read into buf (got bytes of it) cannot be served, NULL when it can; *io says
 * whether it was the read that failed. rec is the slot's record as it was when the read
 * began. */
static const char *slot_check(const struct disktier *dt, const struct disk_rec *rec, ssize_t got,
                              int err, const char *ns_name, uint64_t ns, struct blockkey key,
                              const uint32_t *tokens, void *buf, bool *io)
{
    struct slot_hdr *h = buf;
    const uint32_t *stored = (const uint32_t *)((const char *)buf + sizeof *h);
    *io = false;
    if (got != (ssize_t)dt->slot_bytes) {
        *io = true;
        return got < 0 ? strerror(err) : "a short read";
    }
    if (!dt_rec_is(rec, ns, key))
        return "its record changed";
    if (h->magic != SLOT_MAGIC || h->version != FILE_VERSION ||
        h->block_tokens != dt->block_tokens || h->block_bytes != dt->block_bytes ||
        h->uuid != dt->uuid || h->sum != dt_slot_hdr_sum(h, dt->block_tokens))
        return "its header fails its checksum";
    if (h->ns != ns || h->key_lo != key.lo || h->key_hi != key.hi ||
        strncmp(h->ns_name, ns_name, DISKTIER_NS_NAME) != 0)
        return "it holds another block";
    if (memcmp(stored, tokens, 4ull * dt->block_tokens) != 0)
        return "its token ids differ";
    if (h->data_sum != rec->data_sum ||
        dt_data_sum(disktier_data(dt, buf), dt->block_bytes, key.lo) != rec->data_sum)
        return "its data fails its checksum";
    return NULL;
}

/* One coalesced request: blocks ord[first, first + count) of a batch, adjacent on disk, read
 * with one preadv (or io_uring readv) into their own buffers. */
struct rd_piece {
    size_t first, count;
    off_t off;
    ssize_t res;  /* bytes read, -errno, -EAGAIN: not read yet */
    bool checked; /* piece_done ran */
};

/* A batch between disktier_read_begin and disktier_read_end. Owns every array here; v and
 * the buffers it names are the caller's. */
struct disktier_batch {
    struct disktier *dt;
    char ns_name[DISKTIER_NS_NAME];
    uint64_t ns, t0;
    struct disktier_rd *v;
    size_t n;
    struct disk_rec *recs; /* (n) each slot's record when the batch began */
    size_t *ord;           /* (n) block indices by slot */
    struct iovec *iov;     /* (n) in ord's order */
    struct rd_piece *p;    /* (n_p <= n) the requests */
    const char **why;      /* (n) NULL: served; else why not */
    bool *io;              /* (n) the failure was the read's */
    size_t n_p, n_retry;
#ifdef KVD_HAVE_URING
    struct io_uring *ring; /* NULL: read with preadv */
    size_t next, inflight; /* the next request to submit; requests in flight */
    bool broken;           /* the ring failed: the rest goes through preadv */
#endif
};

/* Spreads request i's bytes over its blocks and checks each of them; a block the request did
 * not read whole (a short or failed request) is read once more on its own, as a single read
 * would be, so one bad sector costs its own block only. */
static void piece_done(struct disktier_batch *b, size_t i)
{
    struct disktier *dt = b->dt;
    struct rd_piece *p = &b->p[i];
    ssize_t left = p->res;
    p->checked = true;
    for (size_t k = p->first; k < p->first + p->count; k++) {
        size_t x = b->ord[k];
        struct disktier_rd *r = &b->v[x];
        ssize_t got = (ssize_t)dt->slot_bytes;
        int err = EIO;
        if (left >= (ssize_t)dt->slot_bytes) {
            left -= (ssize_t)dt->slot_bytes;
        } else {
            left = 0;
            got = pread(dt->data_fd, r->buf, dt->slot_bytes, dt_slot_off(dt, r->slot));
            err = errno;
            b->n_retry++;
        }
        if (fault_should_fail(FAULT_DISK_READ))
            got = (ssize_t)dt->slot_bytes / 2;
        b->why[x] = slot_check(dt, &b->recs[x], got, err, b->ns_name, b->ns, r->key, r->tokens,
                               r->buf, &b->io[x]);
    }
}

static void piece_preadv(struct disktier_batch *b, size_t i)
{
    struct rd_piece *p = &b->p[i];
    ssize_t r = preadv(b->dt->data_fd, b->iov + p->first, (int)p->count, p->off);
    p->res = r < 0 ? -errno : r;
}

#ifdef KVD_HAVE_URING
static struct io_uring *ring_get(struct disktier *dt)
{
    struct io_uring *r = NULL;
    dt_lock(dt);
    if (dt->n_rings)
        r = dt->rings[--dt->n_rings];
    bool ok = dt->uring_ok;
    dt_unlock(dt);
    if (r || !ok)
        return r;
    if (!(r = malloc(sizeof *r)))
        return NULL;
    if (io_uring_queue_init(2 * DISKTIER_QDEPTH, r, 0) != 0) {
        free(r);
        return NULL;
    }
    return r;
}

static void ring_put(struct disktier *dt, struct io_uring *r)
{
    dt_lock(dt);
    if (dt->n_rings < DISKTIER_RINGS) {
        dt->rings[dt->n_rings++] = r;
        r = NULL;
    }
    dt_unlock(dt);
    if (r) {
        io_uring_queue_exit(r);
        free(r);
    }
}

/* Submits requests until DISKTIER_QDEPTH are in flight. A request the ring did not take keeps
 * res -EAGAIN, and so does every later one once the ring has failed (read with preadv at the
 * end). */
static void ring_fill(struct disktier_batch *b)
{
    size_t queued = 0;
    while (!b->broken && b->next < b->n_p && b->inflight + queued < DISKTIER_QDEPTH) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(b->ring);
        if (!sqe)
            break;
        struct rd_piece *p = &b->p[b->next];
        io_uring_prep_readv(sqe, b->dt->data_fd, b->iov + p->first, (unsigned)p->count,
                            (uint64_t)p->off);
        io_uring_sqe_set_data64(sqe, b->next);
        p->res = -EINPROGRESS;
        b->next++;
        queued++;
    }
    if (!queued)
        return;
    int rc;
    while ((rc = io_uring_submit(b->ring)) == -EINTR)
        ;
    if (rc < 0) {
        log_warn("disk tier: io_uring submit: %s; reading with preadv", strerror(-rc));
        rc = 0;
    }
    b->inflight += (size_t)rc;
    if ((size_t)rc < queued) { /* not taken: read with preadv */
        for (size_t k = b->next - (queued - (size_t)rc); k < b->next; k++)
            b->p[k].res = -EAGAIN;
        b->broken = true;
    }
}

/* Waits for the requests in flight, checking each one's blocks as it completes and keeping
 * the queue full meanwhile. Returns only when nothing is in flight, since the kernel writes
 * into the buffers until then; a ring that failed is not reused. */
static void ring_finish(struct disktier_batch *b)
{
    int wait_errors = 0;
    while (b->inflight) {
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(b->ring, &cqe);
        if (rc < 0) {
            if (rc != -EINTR && ++wait_errors >= 1000) {
                /* Never seen; the buffers may still be written, so the ring is left as it
                 * is rather than torn down, and nothing it read is served. */
                log_err("disk tier: io_uring wait: %s; the ring is abandoned", strerror(-rc));
                for (size_t k = 0; k < b->n_p; k++)
                    if (b->p[k].res == -EINPROGRESS) {
                        b->p[k].res = -EIO;
                        piece_done(b, k);
                    }
                b->ring = NULL;
                return;
            }
            continue;
        }
        uint64_t i = io_uring_cqe_get_data64(cqe);
        ssize_t res = cqe->res == -EAGAIN ? -EIO : cqe->res;
        io_uring_cqe_seen(b->ring, cqe);
        b->inflight--;
        ring_fill(b); /* the disk keeps reading while this one is checked */
        if (i < b->n_p) {
            b->p[i].res = res;
            piece_done(b, (size_t)i);
        }
    }
    if (b->broken) {
        io_uring_queue_exit(b->ring);
        free(b->ring);
    } else {
        ring_put(b->dt, b->ring);
    }
    b->ring = NULL;
}
#endif

bool disktier_uring(const struct disktier *dt)
{
#ifdef KVD_HAVE_URING
    return dt->uring_ok;
#else
    (void)dt;
    return false;
#endif
}

static void batch_free(struct disktier_batch *b)
{
    free(b->recs);
    free(b->ord);
    free(b->iov);
    free(b->p);
    free(b->why);
    free(b->io);
    free(b);
}

/* Out of memory for a batch: every slot fails as an unreadable one would (counted, unpinned,
 * and left on disk: its bytes were never looked at). */
static void fail_all(struct disktier *dt, struct disktier_rd *v, size_t n)
{
    dt_lock(dt);
    for (size_t i = 0; i < n; i++) {
        v[i].rc = KVD_EINTERNAL;
        dt->st.io_errors++;
        if (v[i].slot < dt->n_slots && dt->slots[v[i].slot].readers)
            dt->slots[v[i].slot].readers--;
    }
    dt_unlock(dt);
    log_warn("disk tier: out of memory for a read of %zu blocks", n);
}

struct disktier_batch *disktier_read_begin(struct disktier *dt, const char *ns_name, uint64_t ns,
                                           struct disktier_rd *v, size_t n)
{
    if (n == 0)
        return NULL;
    struct disktier_batch *b = calloc(1, sizeof *b);
    if (b) {
        b->recs = malloc(sizeof *b->recs * n);
        b->ord = malloc(sizeof *b->ord * n);
        b->iov = malloc(sizeof *b->iov * n);
        b->p = malloc(sizeof *b->p * n);
        b->why = malloc(sizeof *b->why * n);
        b->io = calloc(n, sizeof *b->io);
    }
    if (!b || !b->recs || !b->ord || !b->iov || !b->p || !b->why || !b->io) {
        if (b)
            batch_free(b);
        fail_all(dt, v, n);
        return NULL;
    }
    b->dt = dt;
    snprintf(b->ns_name, sizeof b->ns_name, "%s", ns_name);
    b->ns = ns;
    b->v = v;
    b->n = n;
    b->t0 = dt_now_ns();
    size_t per_req = DISKTIER_REQ_BYTES / dt->slot_bytes;
    if (per_req == 0)
        per_req = 1;

    dt_lock(dt);
    for (size_t i = 0; i < n; i++)
        b->recs[i] = v[i].slot < dt->n_slots ? dt->recs[v[i].slot] : (struct disk_rec){0};
    dt_unlock(dt);

    for (size_t i = 0; i < n; i++) {
        b->ord[i] = i;
        b->why[i] = "an unreadable slot";
        b->io[i] = true;
    }
    /* A small insertion sort by slot (a batch is one restore window: tens to hundreds of
     * blocks, mostly in order already), then runs of adjacent slots become one request. */
    for (size_t i = 1; i < n; i++) {
        size_t x = b->ord[i], j = i;
        while (j > 0 && v[b->ord[j - 1]].slot > v[x].slot) {
            b->ord[j] = b->ord[j - 1];
            j--;
        }
        b->ord[j] = x;
    }
    for (size_t k = 0; k < n; k++) {
        b->iov[k] = (struct iovec){v[b->ord[k]].buf, dt->slot_bytes};
        const struct rd_piece *last = b->n_p ? &b->p[b->n_p - 1] : NULL;
        if (v[b->ord[k]].slot >= dt->n_slots)
            continue; /* no such slot: it stays unreadable */
        if (last && last->count < per_req && last->first + last->count == k &&
            v[b->ord[k - 1]].slot + 1 == v[b->ord[k]].slot) {
            b->p[b->n_p - 1].count++;
            continue;
        }
        b->p[b->n_p++] = (struct rd_piece){
            .first = k, .count = 1, .off = dt_slot_off(dt, v[b->ord[k]].slot), .res = -EAGAIN};
    }
#ifdef KVD_HAVE_URING
    if (b->n_p > 1 && (b->ring = ring_get(dt)) != NULL) {
        ring_fill(b);
        return b; /* in flight: disktier_read_end waits and checks */
    }
#endif
    for (size_t i = 0; i < b->n_p; i++)
        piece_preadv(b, i);
    return b;
}

size_t disktier_read_end(struct disktier_batch *b)
{
    if (!b)
        return 0;
    struct disktier *dt = b->dt;
    struct disktier_rd *v = b->v;
    size_t n = b->n, n_ok = 0;
#ifdef KVD_HAVE_URING
    if (b->ring)
        ring_finish(b);
#endif
    for (size_t i = 0; i < b->n_p; i++) { /* read with preadv, or what the ring did not take */
        if (b->p[i].checked)
            continue;
        if (b->p[i].res == -EAGAIN)
            piece_preadv(b, i);
        piece_done(b, i);
    }
    uint64_t took = dt_now_ns() - b->t0;
    dt_lock(dt);
    for (size_t i = 0; i < n; i++) {
        uint32_t slot = v[i].slot;
        const char *w = b->why[i];
        v[i].rc = w ? KVD_EINTERNAL : 0;
        if (slot >= dt->n_slots)
            continue;
        if (dt->slots[slot].readers)
            dt->slots[slot].readers--;
        if (w) {
            if (b->io[i])
                dt->st.io_errors++;
            else
                dt->st.checksum_failures++;
            /* Dropped only when the slot still holds what was asked for: a concurrent
             * rewrite already replaced it. */
            if (dt->slots[slot].state == SLOT_VALID && dt_rec_is(&dt->recs[slot], b->ns, v[i].key))
                dt_slot_drop(dt, slot);
        } else {
            n_ok++;
            dt->st.reads++;
            dt->st.read_bytes += dt->slot_bytes;
            if (dt->slots[slot].state == SLOT_VALID)
                dt_slot_read_hit(dt, slot);
        }
    }
    if (n_ok)
        dt->st.read_ns += took;
    dt->st.read_reqs += b->n_p + b->n_retry;
    dt_unlock(dt);
    for (size_t i = 0; i < n; i++)
        if (v[i].rc)
            log_warn("disk tier: slot %u (%016" PRIx64 "%016" PRIx64 ") dropped: %s", v[i].slot,
                     v[i].key.hi, v[i].key.lo, b->why[i]);
    batch_free(b);
    return n_ok;
}

size_t disktier_read_many(struct disktier *dt, const char *ns_name, uint64_t ns,
                          struct disktier_rd *v, size_t n)
{
    return disktier_read_end(disktier_read_begin(dt, ns_name, ns, v, n));
}

int disktier_read(struct disktier *dt, uint32_t slot, const char *ns_name, uint64_t ns,
                  struct blockkey key, const uint32_t *tokens, void *buf)
{
    struct disktier_rd rd = {.slot = slot, .key = key, .tokens = tokens, .buf = buf};
    disktier_read_many(dt, ns_name, ns, &rd, 1);
    return rd.rc;
}
