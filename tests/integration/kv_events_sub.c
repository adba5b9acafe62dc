/* kv_events_sub: the tests' KV events subscriber (kv_events_sub.h). */
#include "kv_events_sub.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <msgpack.h>
#include <sodium.h>
#include <zmq.h>

#include "kv_events_fixture.h"

uint64_t kvs_ev_stat(const struct kh_proc *d, const char *model, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "stats", 1, model ? 1 : 0);
    if (model)
        assert_int_equal(proto_pack_kv_str(&q.pk, "model", model), 0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *ke = proto_map_find(r.root, "kv_events");
    if (!ke)
        fail_msg("stats has no kv_events for model %s", model ? model : "(first)");
    uint64_t v = kh_u64(ke, key);
    kh_reply_free(&r);
    close(fd);
    assert_true(v != UINT64_MAX);
    return v;
}

/* ---- the hash, computed here -------------------------------------------- */

static size_t cbor_uint(unsigned char *p, unsigned major, uint64_t v)
{
    unsigned char m = (unsigned char)(major << 5);
    if (v < 24) {
        p[0] = m | (unsigned char)v;
        return 1;
    }
    size_t n = v < 0x100 ? 1 : v < 0x10000 ? 2 : v < 0x100000000ull ? 4 : 8;
    p[0] = m | (unsigned char)(n == 1 ? 24 : n == 2 ? 25 : n == 4 ? 26 : 27);
    for (size_t i = 0; i < n; i++)
        p[1 + i] = (unsigned char)(v >> (8 * (n - 1 - i)));
    return 1 + n;
}

static uint64_t digest_low64(const unsigned char *b, size_t n)
{
    unsigned char d[32];
    crypto_hash_sha256(d, b, n);
    uint64_t v = 0;
    for (int i = 24; i < 32; i++)
        v = v << 8 | d[i];
    return v;
}

uint64_t kvs_root_hash(void)
{
    unsigned char b[1] = {0x60}; /* CBOR "" */
    return digest_low64(b, 1);
}

uint64_t kvs_block_hash(uint64_t parent, const uint32_t *t)
{
    unsigned char b[16 + 9 * KVS_BT];
    size_t n = cbor_uint(b, 4, 3);
    n += cbor_uint(b + n, 0, parent);
    n += cbor_uint(b + n, 4, KVS_BT);
    for (int i = 0; i < KVS_BT; i++)
        n += cbor_uint(b + n, 0, t[i]);
    b[n++] = 0xf6;
    return digest_low64(b, n);
}

/* ---- the subscriber ------------------------------------------------------ */

static int medium_of(const msgpack_object *o)
{
    static const char *const names[4] = {"GPU", "CPU", "DISK", "REMOTE"};
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    for (int i = 0; i < 4; i++)
        if (o->via.str.size == strlen(names[i]) &&
            !memcmp(o->via.str.ptr, names[i], o->via.str.size))
            return i;
    fail_msg("unknown medium %.*s", (int)o->via.str.size, o->via.str.ptr);
    return -1;
}

static bool tag_is(const msgpack_object *o, const char *s)
{
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           !memcmp(o->via.str.ptr, s, o->via.str.size);
}

/* A stored block: in medium m's set, and among the hashes seen with token
 * ids, or bare (without). */
static void view_add(struct kvs_view *v, int m, uint64_t h, bool bare)
{
    uint64_t *seen = bare ? v->bare : v->seen;
    size_t *n_seen = bare ? &v->n_bare : &v->n_seen;
    for (size_t i = 0; i < v->n[m]; i++)
        if (v->h[m][i] == h)
            return;
    assert_true(v->n[m] < KVS_MAX_BLOCKS);
    v->h[m][v->n[m]++] = h;
    assert_true(*n_seen < KVS_MAX_BLOCKS * 4); /* a check never skipped for room */
    seen[(*n_seen)++] = h;
}

static void view_del(struct kvs_view *v, int m, uint64_t h)
{
    for (size_t i = 0; i < v->n[m]; i++)
        if (v->h[m][i] == h) {
            v->h[m][i] = v->h[m][--v->n[m]];
            return;
        }
    fail_msg("BlockRemoved of a block the events never stored in medium %d", m);
}

/* Decodes one payload, checking every field's type, and applies it. */
void kvs_apply(struct kvs_view *v, const unsigned char *buf, size_t len)
{
    msgpack_unpacked u;
    size_t off = 0;
    msgpack_unpacked_init(&u);
    assert_int_equal(msgpack_unpack_next(&u, (const char *)buf, len, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, len);
    const msgpack_object *b = &u.data;
    assert_int_equal(b->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(b->via.array.size, 3);
    assert_int_equal(b->via.array.ptr[0].type, MSGPACK_OBJECT_FLOAT64);
    assert_true(b->via.array.ptr[0].via.f64 > 1.6e9); /* wall-clock seconds */
    assert_true(b->via.array.ptr[2].type == MSGPACK_OBJECT_NIL ||
                b->via.array.ptr[2].type == MSGPACK_OBJECT_POSITIVE_INTEGER);
    const msgpack_object *evs = &b->via.array.ptr[1];
    assert_int_equal(evs->type, MSGPACK_OBJECT_ARRAY);
    assert_true(evs->via.array.size > 0);
    for (uint32_t i = 0; i < evs->via.array.size; i++) {
        const msgpack_object *e = &evs->via.array.ptr[i];
        assert_int_equal(e->type, MSGPACK_OBJECT_ARRAY);
        assert_true(e->via.array.size >= 1);
        const msgpack_object *a = e->via.array.ptr;
        if (tag_is(&a[0], "AllBlocksCleared")) {
            assert_int_equal(e->via.array.size, 1);
            memset(v->n, 0, sizeof v->n);
            v->cleared++;
        } else if (tag_is(&a[0], "BlockRemoved")) {
            assert_int_equal(e->via.array.size, 3);
            assert_int_equal(a[1].type, MSGPACK_OBJECT_ARRAY);
            assert_true(a[1].via.array.size > 0);
            int m = medium_of(&a[2]);
            for (uint32_t k = 0; k < a[1].via.array.size; k++) {
                assert_int_equal(a[1].via.array.ptr[k].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
                view_del(v, m, a[1].via.array.ptr[k].via.u64);
            }
        } else if (tag_is(&a[0], "BlockStored")) {
            assert_int_equal(e->via.array.size, 7);
            const msgpack_object *hs = &a[1], *par = &a[2], *tk = &a[3];
            assert_int_equal(hs->type, MSGPACK_OBJECT_ARRAY);
            assert_true(hs->via.array.size > 0);
            assert_true(par->type == MSGPACK_OBJECT_NIL ||
                        par->type == MSGPACK_OBJECT_POSITIVE_INTEGER);
            assert_int_equal(tk->type, MSGPACK_OBJECT_ARRAY);
            assert_int_equal(a[4].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
            assert_int_equal(a[4].via.u64, KVS_BT);
            assert_int_equal(a[5].type, MSGPACK_OBJECT_NIL);
            int m = medium_of(&a[6]);
            /* Token ids for every block (events = on), or none at all
             * (events = hashes): then the hashes are kept as bare. */
            uint64_t parent = par->type == MSGPACK_OBJECT_NIL ? kvs_root_hash() : par->via.u64;
            if (tk->via.array.size == 0) {
                for (uint32_t k = 0; k < hs->via.array.size; k++) {
                    assert_int_equal(hs->via.array.ptr[k].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
                    view_add(v, m, hs->via.array.ptr[k].via.u64, true);
                }
                continue;
            }
            assert_int_equal(tk->via.array.size, (size_t)KVS_BT * hs->via.array.size);
            for (uint32_t k = 0; k < hs->via.array.size; k++) {
                uint32_t t[KVS_BT];
                for (int j = 0; j < KVS_BT; j++) {
                    const msgpack_object *x = &tk->via.array.ptr[k * KVS_BT + (uint32_t)j];
                    assert_int_equal(x->type, MSGPACK_OBJECT_POSITIVE_INTEGER);
                    t[j] = (uint32_t)x->via.u64;
                }
                assert_int_equal(hs->via.array.ptr[k].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
                uint64_t h = hs->via.array.ptr[k].via.u64;
                if (h != kvs_block_hash(parent, t))
                    fail_msg("block hash %016llx is not the hash of its parent and tokens",
                             (unsigned long long)h);
                view_add(v, m, h, false);
                parent = h;
            }
        } else {
            fail_msg("unknown event tag");
        }
    }
    msgpack_unpacked_destroy(&u);
}

/* Receives one [topic, seq, payload] within ms; false on timeout. */
bool kvs_recv(void *sub, const char *topic, int ms, struct kvs_batch *out)
{
    zmq_pollitem_t it = {sub, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, ms) <= 0)
        return false;
    zmq_msg_t m[3];
    int n = 0, more = 1;
    while (more) {
        assert_true(n < 3);
        zmq_msg_init(&m[n]);
        assert_true(zmq_msg_recv(&m[n], sub, 0) >= 0);
        more = zmq_msg_more(&m[n]);
        n++;
    }
    assert_int_equal(n, 3);
    assert_int_equal(zmq_msg_size(&m[0]), strlen(topic));
    assert_memory_equal(zmq_msg_data(&m[0]), topic, strlen(topic));
    assert_int_equal(zmq_msg_size(&m[1]), 8);
    const unsigned char *s = zmq_msg_data(&m[1]);
    out->seq = 0;
    for (int i = 0; i < 8; i++)
        out->seq = out->seq << 8 | s[i];
    out->len = zmq_msg_size(&m[2]);
    out->buf = malloc(out->len);
    assert_non_null(out->buf);
    memcpy(out->buf, zmq_msg_data(&m[2]), out->len);
    for (int i = 0; i < 3; i++)
        zmq_msg_close(&m[i]);
    return true;
}

/* A replay from start through a DEALER socket (REQ's envelope by hand):
 * the batches into out (indexed by seq), returns how many came before the
 * end marker. */
size_t kvs_replay(void *zctx, const char *ep, uint64_t start, struct kvs_batch *out,
                  uint64_t *first, uint64_t *last)
{
    void *dl = zmq_socket(zctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(dl, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_connect(dl, ep), 0);
    unsigned char sb[8];
    for (int i = 0; i < 8; i++)
        sb[i] = (unsigned char)(start >> (56 - 8 * i));
    assert_true(zmq_send(dl, "", 0, ZMQ_SNDMORE) == 0);
    assert_true(zmq_send(dl, sb, 8, 0) == 8);
    size_t got = 0;
    *first = UINT64_MAX;
    *last = 0;
    for (;;) {
        zmq_pollitem_t it = {dl, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 10000) <= 0)
            fail_msg("replay: no end marker within 10 s");
        zmq_msg_t m[3];
        int n = 0, more = 1;
        while (more) {
            assert_true(n < 3);
            zmq_msg_init(&m[n]);
            assert_true(zmq_msg_recv(&m[n], dl, 0) >= 0);
            more = zmq_msg_more(&m[n]);
            n++;
        }
        assert_int_equal(n, 3);
        assert_int_equal(zmq_msg_size(&m[0]), 0);
        assert_int_equal(zmq_msg_size(&m[1]), 8);
        const unsigned char *s = zmq_msg_data(&m[1]);
        uint64_t seq = 0;
        for (int i = 0; i < 8; i++)
            seq = seq << 8 | s[i];
        bool end = seq == UINT64_MAX;
        if (end) {
            assert_int_equal(zmq_msg_size(&m[2]), 0);
        } else {
            assert_true(seq < KVS_MAX_SEQ);
            assert_true(seq >= start);
            if (got)
                assert_true(seq == *last + 1); /* in order, no gap */
            if (*first == UINT64_MAX)
                *first = seq;
            *last = seq;
            if (out) {
                free(out[seq].buf);
                out[seq].seq = seq;
                out[seq].len = zmq_msg_size(&m[2]);
                out[seq].buf = malloc(out[seq].len);
                memcpy(out[seq].buf, zmq_msg_data(&m[2]), out[seq].len);
            }
            got++;
        }
        for (int i = 0; i < 3; i++)
            zmq_msg_close(&m[i]);
        if (end)
            break;
    }
    zmq_close(dl);
    return got;
}

/* Receives live batches until every sequence number below `until` is in
 * have[] (live or filled by a replay); fails after 20 s. */
void kvs_collect(void *sub, const char *topic, struct kvs_batch *have, uint64_t until)
{
    uint64_t t0 = kvf_now_ms();
    for (;;) {
        bool all = true;
        for (uint64_t s = 0; s < until; s++)
            if (!have[s].buf) {
                all = false;
                break;
            }
        if (all)
            return;
        if (kvf_now_ms() - t0 > 20000)
            fail_msg("batches below %llu did not all arrive", (unsigned long long)until);
        struct kvs_batch b;
        if (kvs_recv(sub, topic, 200, &b)) {
            assert_true(b.seq < KVS_MAX_SEQ);
            if (have[b.seq].buf) { /* the same batch twice: the same bytes */
                assert_int_equal(have[b.seq].len, b.len);
                assert_memory_equal(have[b.seq].buf, b.buf, b.len);
                free(b.buf);
            } else {
                have[b.seq] = b;
            }
        }
    }
}

/* Waits until the daemon has sent everything queued; returns next_seq. */
uint64_t kvs_settle(const struct kh_proc *d, const char *model)
{
    uint64_t t0 = kvf_now_ms();
    while (kvs_ev_stat(d, model, "queued") != 0) {
        if (kvf_now_ms() - t0 > 10000)
            fail_msg("the publisher did not drain its queue");
        usleep(2000);
    }
    /* The last flush may still be on its way to next_seq: read it twice. */
    uint64_t a, b;
    do {
        a = kvs_ev_stat(d, model, "next_seq");
        usleep(20000);
        b = kvs_ev_stat(d, model, "next_seq");
    } while (a != b && kvf_now_ms() - t0 < 10000);
    return b;
}

void kvs_free_batches(struct kvs_batch *b)
{
    for (size_t i = 0; i < KVS_MAX_SEQ; i++)
        free(b[i].buf);
    free(b);
}

/* ---- a stream followed -------------------------------------------------- */

static const char *stream_model(const struct kvs_stream *s)
{
    return s->model[0] ? s->model : NULL;
}

void kvs_stream_open(struct kvs_stream *s, const struct kh_proc *d)
{
    s->have = calloc(KVS_MAX_SEQ, sizeof *s->have);
    s->v = calloc(1, sizeof *s->v);
    assert_non_null(s->have);
    assert_non_null(s->v);
    s->applied = 0;
    s->n_removed = 0;
    s->sub = zmq_socket(s->zctx, ZMQ_SUB);
    assert_non_null(s->sub);
    int zero = 0;
    zmq_setsockopt(s->sub, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, "kv@", 3), 0);
    assert_int_equal(zmq_connect(s->sub, s->ev), 0);
    uint64_t t0 = kvf_now_ms();
    while (kvs_ev_stat(d, stream_model(s), "subscribers") < 1) {
        if (kvf_now_ms() - t0 > 10000)
            fail_msg("the stream %s never saw the subscription", s->topic);
        usleep(2000);
    }
}

/* The REMOTE BlockRemoved hashes of one payload, appended to s->removed
 * (kvs_apply checks every field; this only picks them out). */
static void note_removed(struct kvs_stream *s, const unsigned char *buf, size_t len)
{
    msgpack_unpacked u;
    size_t off = 0;
    msgpack_unpacked_init(&u);
    assert_int_equal(msgpack_unpack_next(&u, (const char *)buf, len, &off), MSGPACK_UNPACK_SUCCESS);
    const msgpack_object *evs = &u.data.via.array.ptr[1];
    for (uint32_t i = 0; i < evs->via.array.size; i++) {
        const msgpack_object *e = &evs->via.array.ptr[i], *a = e->via.array.ptr;
        if (e->via.array.size != 3 || a[0].via.str.size != 12 ||
            memcmp(a[0].via.str.ptr, "BlockRemoved", 12) || a[2].via.str.size != 6 ||
            memcmp(a[2].via.str.ptr, "REMOTE", 6))
            continue;
        for (uint32_t k = 0; k < a[1].via.array.size; k++) {
            assert_true(s->n_removed < KVS_MAX_BLOCKS);
            s->removed[s->n_removed++] = a[1].via.array.ptr[k].via.u64;
        }
    }
    msgpack_unpacked_destroy(&u);
}

void kvs_stream_catch_up(struct kvs_stream *s, const struct kh_proc *d)
{
    uint64_t n = kvs_settle(d, stream_model(s)), first, last;
    if (!s->have[0].buf)
        assert_true(kvs_replay(s->zctx, s->replay, 0, s->have, &first, &last) >= 1);
    kvs_collect(s->sub, s->topic, s->have, n);
    for (; s->applied < n; s->applied++) {
        kvs_apply(s->v, s->have[s->applied].buf, s->have[s->applied].len);
        note_removed(s, s->have[s->applied].buf, s->have[s->applied].len);
    }
    assert_int_equal(kvs_ev_stat(d, stream_model(s), "dropped"), 0);
}

void kvs_stream_close(struct kvs_stream *s)
{
    if (s->sub)
        zmq_close(s->sub);
    s->sub = NULL;
    if (s->have)
        kvs_free_batches(s->have);
    s->have = NULL;
    free(s->v);
    s->v = NULL;
}
