/* kvevents: the KV events publisher (kvevents.h). */
#include "kvevents.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "log.h"

/* One queued report; n_tokens ids follow it in the ring. */
struct rec {
    uint8_t kind, medium, has_parent, has_tokens;
    uint32_t n_tokens;
    uint64_t hash, parent;
};

struct kept {
    uint64_t seq;
    void *buf;
    size_t len;
};

struct kvevents {
    struct kvevents_conf c;
    char topic[256];
    struct kvmm_events_sink sink;
    void *zctx, *pub, *router;
    int efd;
    pthread_t thread;
    bool started;
    atomic_bool stop;

    /* The queue, under qmu: count records from head in a ring of cap. */
    pthread_mutex_t qmu;
    unsigned char *ring;
    size_t rec_size, cap, head, count;
    uint64_t dropped;

    /* The publisher thread's own: */
    struct kept *kept; /* ring of c.buffer batches: kept[(k_head + i) % buffer] */
    size_t k_head, k_n, k_bytes;
    uint64_t seq;
    struct kvevents_item *items;
    uint32_t *tokens; /* (max_batch * block_tokens) */
    int64_t subs;

    /* Counters the thread writes and stats reads. */
    atomic_uint_fast64_t batches, events, blocks, hwm_drops, subscribers, replay_requests,
        replay_batches, replay_bad, next_seq;
};

/* ---- the encoder -------------------------------------------------------- */

static int pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    return msgpack_pack_str(pk, n) || msgpack_pack_str_body(pk, s, n);
}

/* How many items from i on form one event. */
static size_t run_len(const struct kvevents_item *it, size_t n, size_t i)
{
    size_t j = i + 1;
    if (it[i].kind == KVEVENTS_CLEARED)
        return 1;
    while (j < n && it[j].kind == it[i].kind && it[j].medium == it[i].medium) {
        if (it[i].kind == KVEVENTS_STORED && (!it[j].has_parent || it[j].parent != it[j - 1].hash ||
                                              (it[j].tokens != NULL) != (it[i].tokens != NULL)))
            break;
        j++;
    }
    return j - i;
}

int kvevents_encode(const struct kvevents_item *items, size_t n, double ts, uint32_t block_size,
                    msgpack_sbuffer *out, size_t *n_events)
{
    msgpack_packer pk;
    size_t ne = 0;
    int rc = 0;

    msgpack_packer_init(&pk, out, msgpack_sbuffer_write);
    for (size_t i = 0; i < n; i += run_len(items, n, i))
        ne++;
    rc |= msgpack_pack_array(&pk, 3);
    rc |= msgpack_pack_double(&pk, ts);
    rc |= msgpack_pack_array(&pk, ne);
    for (size_t i = 0; i < n;) {
        const struct kvevents_item *a = &items[i];
        size_t k = run_len(items, n, i);
        if (a->kind == KVEVENTS_CLEARED) {
            rc |= msgpack_pack_array(&pk, 1);
            rc |= pack_str(&pk, "AllBlocksCleared");
        } else if (a->kind == KVEVENTS_REMOVED) {
            rc |= msgpack_pack_array(&pk, 3);
            rc |= pack_str(&pk, "BlockRemoved");
            rc |= msgpack_pack_array(&pk, k);
            for (size_t j = 0; j < k; j++)
                rc |= msgpack_pack_uint64(&pk, items[i + j].hash);
            rc |= pack_str(&pk, kvmm_medium_name(a->medium));
        } else {
            size_t nt = 0;
            rc |= msgpack_pack_array(&pk, 7);
            rc |= pack_str(&pk, "BlockStored");
            rc |= msgpack_pack_array(&pk, k);
            for (size_t j = 0; j < k; j++) {
                rc |= msgpack_pack_uint64(&pk, items[i + j].hash);
                nt += items[i + j].tokens ? items[i + j].n_tokens : 0;
            }
            if (a->has_parent)
                rc |= msgpack_pack_uint64(&pk, a->parent);
            else
                rc |= msgpack_pack_nil(&pk);
            rc |= msgpack_pack_array(&pk, nt);
            for (size_t j = 0; j < k; j++)
                if (items[i + j].tokens)
                    for (uint32_t t = 0; t < items[i + j].n_tokens; t++)
                        rc |= msgpack_pack_uint32(&pk, items[i + j].tokens[t]);
            rc |= msgpack_pack_uint32(&pk, block_size);
            rc |= msgpack_pack_nil(&pk); /* lora_id */
            rc |= pack_str(&pk, kvmm_medium_name(a->medium));
        }
        i += k;
    }
    rc |= msgpack_pack_uint32(&pk, 0); /* data_parallel_rank: kvd is one rank */
    if (n_events)
        *n_events = ne;
    return rc ? KVD_ENOMEM : 0;
}

/* ---- the sink (any thread, under the kvmm lock) ------------------------- */

static void wake(struct kvevents *ev)
{
    uint64_t one = 1;
    /* An eventfd counter does not overflow here: the thread reads it. */
    if (write(ev->efd, &one, sizeof one) < 0 && errno != EAGAIN)
        return;
}

static void push(struct kvevents *ev, const struct rec *r, const uint32_t *tokens)
{
    bool was_empty;
    pthread_mutex_lock(&ev->qmu);
    if (ev->count == ev->cap) {
        ev->dropped++;
        pthread_mutex_unlock(&ev->qmu);
        return;
    }
    unsigned char *slot = ev->ring + ((ev->head + ev->count) % ev->cap) * ev->rec_size;
    memcpy(slot, r, sizeof *r);
    if (r->has_tokens && tokens != NULL && r->n_tokens > 0)
        memcpy(slot + sizeof *r, tokens, sizeof(uint32_t) * r->n_tokens);
    was_empty = ev->count++ == 0;
    pthread_mutex_unlock(&ev->qmu);
    if (was_empty)
        wake(ev);
}

static void sink_block(void *ctx, const struct kvmm_block_event *e)
{
    struct kvevents *ev = ctx;
    struct rec r = {.kind = e->stored ? KVEVENTS_STORED : KVEVENTS_REMOVED,
                    .medium = (uint8_t)e->medium,
                    .has_parent = e->stored && e->has_parent,
                    .has_tokens = e->stored && e->tokens != NULL,
                    .hash = e->hash,
                    .parent = e->parent};
    r.n_tokens = r.has_tokens ? e->n_tokens : 0;
    if (r.n_tokens > ev->c.block_tokens)
        r.n_tokens = ev->c.block_tokens;
    push(ev, &r, e->tokens);
}

static void sink_cleared(void *ctx)
{
    struct rec r = {.kind = KVEVENTS_CLEARED};
    push(ctx, &r, NULL);
}

/* ---- the publisher thread ----------------------------------------------- */

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void put_be64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (56 - 8 * i));
}

/* Sends [topic, seq, payload] to every subscriber with room. When one is
 * at its high-water mark the socket refuses the whole message (XPUB_NODROP);
 * then it goes to the others and the miss is counted. */
static void publish(struct kvevents *ev, uint64_t seq, const void *buf, size_t len)
{
    unsigned char sb[8];
    size_t tl = strlen(ev->topic);
    put_be64(sb, seq);
    for (int attempt = 0; attempt < 2; attempt++) {
        if (zmq_send(ev->pub, ev->topic, tl, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            if (errno == EAGAIN && attempt == 0) {
                int lossy = 0;
                zmq_setsockopt(ev->pub, ZMQ_XPUB_NODROP, &lossy, sizeof lossy);
                atomic_fetch_add(&ev->hwm_drops, 1);
                continue;
            }
            break;
        }
        zmq_send(ev->pub, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(ev->pub, buf, len, ZMQ_DONTWAIT);
        break;
    }
    int nodrop = 1;
    zmq_setsockopt(ev->pub, ZMQ_XPUB_NODROP, &nodrop, sizeof nodrop);
}

/* The replay buffer keeps the last `buffer` batches, and at most
 * KEPT_MAX_BYTES of them (the oldest go first). */
#define KEPT_MAX_BYTES ((size_t)256 << 20)

static void keep(struct kvevents *ev, uint64_t seq, void *buf, size_t len)
{
    size_t cap = ev->c.buffer;
    while (ev->k_n && (ev->k_n == cap || ev->k_bytes + len > KEPT_MAX_BYTES)) {
        ev->k_bytes -= ev->kept[ev->k_head].len;
        free(ev->kept[ev->k_head].buf);
        ev->k_head = (ev->k_head + 1) % cap;
        ev->k_n--;
    }
    ev->kept[(ev->k_head + ev->k_n) % cap] = (struct kept){seq, buf, len};
    ev->k_n++;
    ev->k_bytes += len;
}

/* Takes up to max_batch queued records, encodes and sends them as one
 * batch. false when the queue was empty. */
static bool flush_one(struct kvevents *ev)
{
    size_t n = 0, bt = ev->c.block_tokens;
    pthread_mutex_lock(&ev->qmu);
    while (n < ev->c.max_batch && ev->count) {
        const unsigned char *slot = ev->ring + ev->head * ev->rec_size;
        struct rec r;
        memcpy(&r, slot, sizeof r);
        uint32_t *tk = ev->tokens + n * bt;
        if (r.has_tokens)
            memcpy(tk, slot + sizeof r, sizeof(uint32_t) * r.n_tokens);
        ev->items[n] = (struct kvevents_item){.kind = (enum kvevents_kind)r.kind,
                                              .medium = (enum kvmm_medium)r.medium,
                                              .has_parent = r.has_parent,
                                              .hash = r.hash,
                                              .parent = r.parent,
                                              .tokens = r.has_tokens ? tk : NULL,
                                              .n_tokens = r.n_tokens};
        n++;
        ev->head = (ev->head + 1) % ev->cap;
        ev->count--;
    }
    pthread_mutex_unlock(&ev->qmu);
    if (n == 0)
        return false;
    msgpack_sbuffer sb;
    size_t ne = 0, nb = 0;
    msgpack_sbuffer_init(&sb);
    if (kvevents_encode(ev->items, n, wall_s(), ev->c.block_tokens, &sb, &ne) != 0) {
        msgpack_sbuffer_destroy(&sb);
        log_warn("kv events: out of memory encoding a batch of %zu events; dropped", n);
        return true;
    }
    for (size_t i = 0; i < n; i++)
        nb += ev->items[i].kind != KVEVENTS_CLEARED;
    uint64_t seq = ev->seq++;
    publish(ev, seq, sb.data, sb.size);
    keep(ev, seq, sb.data, sb.size); /* the buffer is the kept batch's now */
    atomic_fetch_add(&ev->batches, 1);
    atomic_fetch_add(&ev->events, ne);
    atomic_fetch_add(&ev->blocks, nb);
    atomic_store(&ev->next_seq, ev->seq);
    return true;
}

static void on_subscription(struct kvevents *ev)
{
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, ev->pub, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        const unsigned char *d = zmq_msg_data(&m);
        if (zmq_msg_size(&m) >= 1) {
            if (d[0] == 1)
                ev->subs++;
            else if (d[0] == 0 && ev->subs > 0)
                ev->subs--;
        }
        zmq_msg_close(&m);
        atomic_store(&ev->subscribers, (uint64_t)ev->subs);
    }
}

/* One request: [identity, "", start seq (8 bytes big-endian)]. Answered
 * with [identity, "", seq, payload] per kept batch from start on, then
 * [identity, "", -1, ""]. Anything else is read whole and ignored. */
static void on_replay(struct kvevents *ev)
{
    for (;;) {
        zmq_msg_t parts[3];
        int n = 0, more = 1;
        bool bad = false;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, ev->router, n == 0 ? ZMQ_DONTWAIT : 0) < 0) {
                zmq_msg_close(&m);
                for (int i = 0; i < n && i < 3; i++)
                    zmq_msg_close(&parts[i]);
                return;
            }
            more = zmq_msg_more(&m);
            if (n < 3)
                parts[n] = m;
            else {
                zmq_msg_close(&m);
                bad = true;
            }
            n++;
        }
        if (n != 3 || bad || zmq_msg_size(&parts[1]) != 0 || zmq_msg_size(&parts[2]) != 8) {
            atomic_fetch_add(&ev->replay_bad, 1);
        } else {
            const unsigned char *s = zmq_msg_data(&parts[2]);
            uint64_t start = 0;
            for (int i = 0; i < 8; i++)
                start = (start << 8) | s[i];
            const void *id = zmq_msg_data(&parts[0]);
            size_t idl = zmq_msg_size(&parts[0]);
            unsigned char sb[8];
            uint64_t sent = 0;
            for (size_t i = 0; i < ev->k_n; i++) {
                const struct kept *k = &ev->kept[(ev->k_head + i) % ev->c.buffer];
                if (k->seq < start)
                    continue;
                put_be64(sb, k->seq);
                zmq_send(ev->router, id, idl, ZMQ_SNDMORE | ZMQ_DONTWAIT);
                zmq_send(ev->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
                zmq_send(ev->router, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
                zmq_send(ev->router, k->buf, k->len, ZMQ_DONTWAIT);
                sent++;
            }
            put_be64(sb, UINT64_MAX); /* -1 */
            zmq_send(ev->router, id, idl, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(ev->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(ev->router, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(ev->router, "", 0, ZMQ_DONTWAIT);
            atomic_fetch_add(&ev->replay_requests, 1);
            atomic_fetch_add(&ev->replay_batches, sent);
        }
        for (int i = 0; i < n && i < 3; i++)
            zmq_msg_close(&parts[i]);
    }
}

static size_t queued(struct kvevents *ev)
{
    pthread_mutex_lock(&ev->qmu);
    size_t n = ev->count;
    pthread_mutex_unlock(&ev->qmu);
    return n;
}

static void *publisher_main(void *arg)
{
    struct kvevents *ev = arg;
    uint64_t first = 0; /* when the oldest unsent report was noticed; 0: none */

    for (;;) {
        zmq_pollitem_t it[3] = {{ev->pub, 0, ZMQ_POLLIN, 0},
                                {NULL, ev->efd, ZMQ_POLLIN, 0},
                                {ev->router, 0, ZMQ_POLLIN, 0}};
        long timeout = -1;
        if (first) {
            uint64_t now = now_ms(), due = first + ev->c.flush_ms;
            timeout = due > now ? (long)(due - now) : 0;
        }
        int rc = zmq_poll(it, ev->router ? 3 : 2, timeout);
        if (rc < 0 && errno != EINTR)
            break;
        bool stopping = atomic_load(&ev->stop);
        if (it[0].revents & ZMQ_POLLIN)
            on_subscription(ev);
        if (ev->router && (it[2].revents & ZMQ_POLLIN))
            on_replay(ev);
        if (it[1].revents & ZMQ_POLLIN) {
            uint64_t v;
            if (read(ev->efd, &v, sizeof v) < 0 && errno != EAGAIN)
                break;
        }
        size_t q = queued(ev);
        if (q && !first)
            first = now_ms();
        if (q && (stopping || q >= ev->c.max_batch || now_ms() >= first + ev->c.flush_ms)) {
            while (flush_one(ev) && (stopping || queued(ev) >= ev->c.max_batch))
                ;
            first = queued(ev) ? now_ms() : 0;
        }
        if (stopping && queued(ev) == 0)
            break;
    }
    return NULL;
}

/* ---- start / stop ------------------------------------------------------- */

static int check_endpoint(const char *what, const char *ep, struct kvd_error *e)
{
    if (!ep || (strncmp(ep, "tcp://", 6) != 0 && strncmp(ep, "ipc://", 6) != 0) || !ep[6])
        return kvd_error_set(e, KVD_EBADREQ,
                             "%s '%s': write tcp://HOST:PORT or ipc://PATH (a ZeroMQ endpoint)",
                             what, ep ? ep : "");
    if (strlen(ep) > 255)
        return kvd_error_set(e, KVD_EBADREQ, "%s: the endpoint is longer than 255 bytes", what);
    return 0;
}

static void free_all(struct kvevents *ev)
{
    if (ev->pub)
        zmq_close(ev->pub);
    if (ev->router)
        zmq_close(ev->router);
    if (ev->zctx)
        zmq_ctx_term(ev->zctx);
    if (ev->efd >= 0)
        close(ev->efd);
    if (ev->kept)
        for (size_t i = 0; i < ev->k_n; i++)
            free(ev->kept[(ev->k_head + i) % ev->c.buffer].buf);
    free(ev->kept);
    free(ev->items);
    free(ev->tokens);
    free(ev->ring);
    pthread_mutex_destroy(&ev->qmu);
    free(ev);
}

int kvevents_start(const struct kvevents_conf *c, struct kvevents **out, struct kvd_error *e)
{
    int rc;
    *out = NULL;
    if ((rc = check_endpoint("kv-events", c->endpoint, e)))
        return rc;
    if (c->replay && c->replay[0] && (rc = check_endpoint("kv-events-replay", c->replay, e)))
        return rc;
    if (c->block_tokens == 0 || c->block_tokens > 4096)
        return kvd_error_set(e, KVD_EBADREQ, "kv events: block_tokens %u", c->block_tokens);
    if (c->topic && strlen(c->topic) > 255)
        return kvd_error_set(e, KVD_EBADREQ, "kv-events-topic: longer than 255 bytes");
    struct kvevents *ev = calloc(1, sizeof *ev);
    if (!ev)
        return kvd_error_set(e, KVD_ENOMEM, "kv events: out of memory");
    ev->efd = -1;
    pthread_mutex_init(&ev->qmu, NULL);
    ev->c = *c;
    if (!ev->c.buffer)
        ev->c.buffer = 10000;
    if (!ev->c.hwm)
        ev->c.hwm = 100000;
    if (!ev->c.flush_ms)
        ev->c.flush_ms = 5;
    if (!ev->c.max_batch)
        ev->c.max_batch = 1024;
    ev->rec_size = (sizeof(struct rec) + sizeof(uint32_t) * c->block_tokens + 7) & ~(size_t)7;
    /* The queue: the configured count, at most 64 MiB of records. */
    size_t cap = ev->c.queue ? ev->c.queue : 65536;
    if (cap > ((size_t)64 << 20) / ev->rec_size)
        cap = ((size_t)64 << 20) / ev->rec_size;
    if (cap < 16)
        cap = 16;
    ev->cap = cap;
    snprintf(ev->topic, sizeof ev->topic, "%s", c->topic ? c->topic : "");
    ev->c.endpoint = ev->c.replay = ev->c.topic = NULL; /* the caller's strings are not kept */
    ev->ring = malloc(ev->cap * ev->rec_size);
    ev->kept = calloc(ev->c.buffer, sizeof *ev->kept);
    ev->items = calloc(ev->c.max_batch, sizeof *ev->items);
    ev->tokens = calloc((size_t)ev->c.max_batch * c->block_tokens, sizeof(uint32_t));
    ev->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ev->zctx = zmq_ctx_new();
    if (!ev->ring || !ev->kept || !ev->items || !ev->tokens || ev->efd < 0 || !ev->zctx) {
        free_all(ev);
        return kvd_error_set(e, KVD_ENOMEM, "kv events: out of memory");
    }
    int one = 1, linger = 200, hwm = (int)(ev->c.hwm > INT32_MAX ? INT32_MAX : ev->c.hwm);
    ev->pub = zmq_socket(ev->zctx, ZMQ_XPUB);
    if (!ev->pub || zmq_setsockopt(ev->pub, ZMQ_SNDHWM, &hwm, sizeof hwm) ||
        zmq_setsockopt(ev->pub, ZMQ_LINGER, &linger, sizeof linger) ||
        zmq_setsockopt(ev->pub, ZMQ_XPUB_VERBOSER, &one, sizeof one) ||
        zmq_setsockopt(ev->pub, ZMQ_XPUB_NODROP, &one, sizeof one) ||
        (c->sndbuf && zmq_setsockopt(ev->pub, ZMQ_SNDBUF, &(int){(int)c->sndbuf}, sizeof(int))) ||
        (c->connect ? zmq_connect(ev->pub, c->endpoint) : zmq_bind(ev->pub, c->endpoint)) != 0) {
        rc = kvd_error_set(e, KVD_EINTERNAL, "kv-events %s: cannot %s (%s)", c->endpoint,
                           c->connect ? "connect" : "bind", zmq_strerror(zmq_errno()));
        free_all(ev);
        return rc;
    }
    if (c->replay && c->replay[0]) {
        ev->router = zmq_socket(ev->zctx, ZMQ_ROUTER);
        if (!ev->router || zmq_setsockopt(ev->router, ZMQ_LINGER, &linger, sizeof linger) ||
            zmq_setsockopt(ev->router, ZMQ_SNDHWM, &hwm, sizeof hwm) ||
            zmq_bind(ev->router, c->replay) != 0) {
            rc = kvd_error_set(e, KVD_EINTERNAL, "kv-events-replay %s: cannot bind (%s)", c->replay,
                               zmq_strerror(zmq_errno()));
            free_all(ev);
            return rc;
        }
    }
    ev->sink = (struct kvmm_events_sink){.ctx = ev, .block = sink_block, .cleared = sink_cleared};
    sink_cleared(ev); /* sequence 0: whatever a router knew of us is gone */
    if (pthread_create(&ev->thread, NULL, publisher_main, ev) != 0) {
        free_all(ev);
        return kvd_error_set(e, KVD_EINTERNAL, "kv events: cannot start the publisher thread");
    }
    ev->started = true;
    *out = ev;
    return 0;
}

void kvevents_stop(struct kvevents *ev)
{
    if (!ev)
        return;
    atomic_store(&ev->stop, true);
    wake(ev);
    if (ev->started)
        pthread_join(ev->thread, NULL);
    free_all(ev);
}

const struct kvmm_events_sink *kvevents_sink(struct kvevents *ev)
{
    return &ev->sink;
}

void kvevents_stats(struct kvevents *ev, struct kvevents_stats *st)
{
    memset(st, 0, sizeof *st);
    if (!ev)
        return;
    st->on = true;
    st->batches = atomic_load(&ev->batches);
    st->events = atomic_load(&ev->events);
    st->blocks = atomic_load(&ev->blocks);
    st->hwm_drops = atomic_load(&ev->hwm_drops);
    st->subscribers = atomic_load(&ev->subscribers);
    st->replay_requests = atomic_load(&ev->replay_requests);
    st->replay_batches = atomic_load(&ev->replay_batches);
    st->replay_bad = atomic_load(&ev->replay_bad);
    st->next_seq = atomic_load(&ev->next_seq);
    pthread_mutex_lock(&ev->qmu);
    st->dropped = ev->dropped;
    st->queued = ev->count;
    pthread_mutex_unlock(&ev->qmu);
}
