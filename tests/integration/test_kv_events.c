/* KV events against a real kvd serving a tiny random model, followed by a
 * subscriber written here with libzmq and msgpack-c's unpacker (nothing of
 * the daemon's encoder): every batch's framing and field types are
 * checked as vLLM's format has them, sequence numbers run without gaps, a
 * replay from an earlier number gives exactly the batches since then and
 * the end marker, each block hash is recomputed from its parent and token
 * ids (SHA-256 over CBOR written here), the blocks the events leave stored
 * per medium are the ones the daemon's stats count for the tenant, a
 * tenant with events off is never reported, AllBlocksCleared comes first
 * and after admin_evict tier "all", and a subscriber that never reads
 * costs the daemon nothing but counted misses. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <msgpack.h>
#include <sodium.h>
#include <zmq.h>

#include "kvd/client.h"
#include "kvd_harness.h"

#define BT 16
#define UID_OFF 60051
#define GID_ALL 65534
#define TOPIC "kvd-test"
#define MAX_SEQ 4096
#define MAX_BLOCKS 8192

struct fixture {
    char tmp[64];
    char model[128];
    char ev_ep[160], replay_ep[160];
    void *zctx;
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    snprintf(f->tmp, sizeof f->tmp, "/tmp/kvd-kvev.XXXXXX");
    if (!mkdtemp(f->tmp))
        return -1;
    snprintf(f->model, sizeof f->model, "%s/m.gguf", f->tmp);
    snprintf(f->ev_ep, sizeof f->ev_ep, "ipc://%s/ev.sock", f->tmp);
    snprintf(f->replay_ep, sizeof f->replay_ep, "ipc://%s/replay.sock", f->tmp);
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 4096 --seed 3 >/dev/null",
             tools ? tools : ".", f->model);
    if (system(cmd) != 0)
        return -1;
    f->zctx = zmq_ctx_new();
    if (!f->zctx || sodium_init() < 0)
        return -1;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[128];
    zmq_ctx_term(f->zctx);
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "teardown: %s failed\n", cmd);
    free(f);
    return 0;
}

static const char *const conf_text = "[admin]\nuids = 0\n"
                                     "[tenant:evon]\nuids = 0\nevents = on\n"
                                     "[tenant:evoff]\nuids = 60051\n";

static void start(struct kh_proc *d, const struct fixture *f, const char *hwm, const char *dev,
                  const char *host, const char *sndbuf)
{
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                f->model,
                                "--kv-events",
                                f->ev_ep,
                                "--kv-events-replay",
                                f->replay_ep,
                                "--kv-events-topic",
                                TOPIC,
                                "--kv-events-hwm",
                                hwm,
                                "--device-blocks",
                                dev,
                                "--host-blocks",
                                host,
                                "--socket-group",
                                "nogroup",
                                "--step-tokens",
                                "2048",
                                "--kv-events-sndbuf",
                                sndbuf,
                                NULL};
    struct kh_opts o = {.conf_text = conf_text, .args = args};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- the daemon's side ------------------------------------------------- */

static uint64_t ev_stat(const struct kh_proc *d, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    uint64_t v = kh_stat(fd, "kv_events", key);
    close(fd);
    assert_true(v != UINT64_MAX);
    return v;
}

/* A number of tenant name's entry in the admin's stats. */
static uint64_t tenant_stat(const struct kh_proc *d, const char *name, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    uint64_t v = UINT64_MAX;
    assert_int_equal(kh_call0(fd, "stats", 1, &r), 0);
    const msgpack_object *ts = kh_obj(r.root, "tenants");
    assert_non_null(ts);
    for (uint32_t i = 0; i < ts->via.array.size; i++) {
        const msgpack_object *n = kh_obj(&ts->via.array.ptr[i], "name");
        if (n && n->type == MSGPACK_OBJECT_STR && n->via.str.size == strlen(name) &&
            !memcmp(n->via.str.ptr, name, n->via.str.size))
            v = kh_u64(&ts->via.array.ptr[i], key);
    }
    kh_reply_free(&r);
    close(fd);
    if (v == UINT64_MAX)
        fail_msg("no tenant %s with %s in stats", name, key);
    return v;
}

static int generate(const char *sock, const uint32_t *p, size_t n)
{
    struct kvd_ctx *c = kvd_connect(sock);
    if (!c || c->err)
        return -1;
    kvd_set_timeout(c, 120000);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 4;
    o.temperature = 0;
    struct kvd_gen_result r;
    int rc = kvd_generate(c, p, n, &o, &r);
    if (rc == 0)
        kvd_gen_result_free(&r);
    kvd_close(c);
    return rc;
}

struct child_arg {
    const char *sock;
    const uint32_t *p;
    size_t n;
};

static int child_gen(void *arg)
{
    struct child_arg *a = arg;
    return generate(a->sock, a->p, a->n) == 0 ? 0 : 2;
}

static void gen_as_off(const struct kh_proc *d, const uint32_t *p, size_t n)
{
    struct child_arg a = {d->sock, p, n};
    pid_t pid = kh_run_as(UID_OFF, GID_ALL, child_gen, &a);
    assert_true(pid > 0);
    assert_int_equal(kh_child_status(pid), 0);
}

static void admin_evict_all(const struct kh_proc *d)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "admin_evict", 7, 1);
    assert_int_equal(proto_pack_kv_str(&q.pk, "tier", "all"), 0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    close(fd);
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

static uint64_t root_hash(void)
{
    unsigned char b[1] = {0x60}; /* CBOR "" */
    return digest_low64(b, 1);
}

static uint64_t block_hash(uint64_t parent, const uint32_t *t)
{
    unsigned char b[16 + 9 * BT];
    size_t n = cbor_uint(b, 4, 3);
    n += cbor_uint(b + n, 0, parent);
    n += cbor_uint(b + n, 4, BT);
    for (int i = 0; i < BT; i++)
        n += cbor_uint(b + n, 0, t[i]);
    b[n++] = 0xf6;
    return digest_low64(b, n);
}

/* ---- the subscriber ------------------------------------------------------ */

struct batch {
    uint64_t seq;
    unsigned char *buf;
    size_t len;
};

/* What the events say is stored, per medium (GPU, CPU, DISK, REMOTE). */
struct view {
    uint64_t h[4][MAX_BLOCKS];
    size_t n[4];
    size_t cleared;                /* AllBlocksCleared seen */
    uint64_t seen[MAX_BLOCKS * 4]; /* every hash ever stored */
    size_t n_seen;
};

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

static void view_add(struct view *v, int m, uint64_t h)
{
    for (size_t i = 0; i < v->n[m]; i++)
        if (v->h[m][i] == h)
            return;
    assert_true(v->n[m] < MAX_BLOCKS);
    v->h[m][v->n[m]++] = h;
    if (v->n_seen < sizeof v->seen / sizeof v->seen[0])
        v->seen[v->n_seen++] = h;
}

static void view_del(struct view *v, int m, uint64_t h)
{
    for (size_t i = 0; i < v->n[m]; i++)
        if (v->h[m][i] == h) {
            v->h[m][i] = v->h[m][--v->n[m]];
            return;
        }
    fail_msg("BlockRemoved of a block the events never stored in medium %d", m);
}

/* Decodes one payload, checking every field's type, and applies it. */
static void apply(struct view *v, const unsigned char *buf, size_t len)
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
            assert_int_equal(a[4].via.u64, BT);
            assert_int_equal(a[5].type, MSGPACK_OBJECT_NIL);
            int m = medium_of(&a[6]);
            /* The only tenant with events is on: token ids come with them. */
            assert_int_equal(tk->via.array.size, (size_t)BT * hs->via.array.size);
            uint64_t parent = par->type == MSGPACK_OBJECT_NIL ? root_hash() : par->via.u64;
            for (uint32_t k = 0; k < hs->via.array.size; k++) {
                uint32_t t[BT];
                for (int j = 0; j < BT; j++) {
                    const msgpack_object *x = &tk->via.array.ptr[k * BT + (uint32_t)j];
                    assert_int_equal(x->type, MSGPACK_OBJECT_POSITIVE_INTEGER);
                    t[j] = (uint32_t)x->via.u64;
                }
                assert_int_equal(hs->via.array.ptr[k].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
                uint64_t h = hs->via.array.ptr[k].via.u64;
                if (h != block_hash(parent, t))
                    fail_msg("block hash %016llx is not the hash of its parent and tokens",
                             (unsigned long long)h);
                view_add(v, m, h);
                parent = h;
            }
        } else {
            fail_msg("unknown event tag");
        }
    }
    msgpack_unpacked_destroy(&u);
}

/* Receives one [topic, seq, payload] within ms; false on timeout. */
static bool recv_batch(void *sub, int ms, struct batch *out)
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
    assert_int_equal(zmq_msg_size(&m[0]), strlen(TOPIC));
    assert_memory_equal(zmq_msg_data(&m[0]), TOPIC, strlen(TOPIC));
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
static size_t replay(const struct fixture *f, uint64_t start, struct batch *out, uint64_t *first,
                     uint64_t *last)
{
    void *dl = zmq_socket(f->zctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(dl, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_connect(dl, f->replay_ep), 0);
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
            assert_true(seq < MAX_SEQ);
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

static void *subscribe(const struct fixture *f, const struct kh_proc *d, uint64_t want_subs)
{
    void *sub = zmq_socket(f->zctx, ZMQ_SUB);
    int zero = 0;
    zmq_setsockopt(sub, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, TOPIC, strlen(TOPIC)), 0);
    assert_int_equal(zmq_connect(sub, f->ev_ep), 0);
    /* The daemon counts the subscription once it has it. */
    uint64_t t0 = now_ms();
    while (ev_stat(d, "subscribers") < want_subs) {
        if (now_ms() - t0 > 10000)
            fail_msg("the daemon never saw the subscription");
        usleep(2000);
    }
    return sub;
}

static void make_prompt(uint32_t *p, size_t n, uint32_t salt)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint32_t)((i * 37 + salt * 101 + (i / 7) * salt) % 256);
}

/* Receives live batches until every sequence number below `until` is in
 * have[] (live or filled by a replay); fails after 20 s. */
static void collect(void *sub, struct batch *have, uint64_t until)
{
    uint64_t t0 = now_ms();
    for (;;) {
        bool all = true;
        for (uint64_t s = 0; s < until; s++)
            if (!have[s].buf) {
                all = false;
                break;
            }
        if (all)
            return;
        if (now_ms() - t0 > 20000)
            fail_msg("batches below %llu did not all arrive", (unsigned long long)until);
        struct batch b;
        if (recv_batch(sub, 200, &b)) {
            assert_true(b.seq < MAX_SEQ);
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
static uint64_t settle(const struct kh_proc *d)
{
    uint64_t t0 = now_ms();
    while (ev_stat(d, "queued") != 0) {
        if (now_ms() - t0 > 10000)
            fail_msg("the publisher did not drain its queue");
        usleep(2000);
    }
    /* The last flush may still be on its way to next_seq: read it twice. */
    uint64_t a, b;
    do {
        a = ev_stat(d, "next_seq");
        usleep(20000);
        b = ev_stat(d, "next_seq");
    } while (a != b && now_ms() - t0 < 10000);
    return b;
}

static void free_batches(struct batch *b)
{
    for (size_t i = 0; i < MAX_SEQ; i++)
        free(b[i].buf);
    free(b);
}

static void test_events_follow_the_cache(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    struct kh_proc d;
    start(&d, f, "100000", "48", "24", "0");
    struct batch *have = calloc(MAX_SEQ, sizeof *have);
    struct view *v = calloc(1, sizeof *v);
    assert_non_null(have);
    assert_non_null(v);
    void *sub = subscribe(f, &d, 1);

    /* What was sent before we subscribed comes by replay: batch 0, the
     * AllBlocksCleared of the start. */
    uint64_t first, last, n0 = settle(&d);
    assert_true(n0 >= 1);
    assert_int_equal(replay(f, 0, have, &first, &last), n0);
    assert_int_equal(first, 0);
    assert_int_equal(last, n0 - 1);

    /* Work for both tenants: prompts of 20 to 60 blocks on a 48-block
     * device with a 24-block host tier, so blocks are stored, moved to the
     * host and dropped. */
    uint32_t p[1000], q[1000];
    for (uint32_t k = 0; k < 6; k++) {
        size_t n = 320 + 160 * (k % 3);
        make_prompt(p, n, 1 + k);
        assert_int_equal(generate(d.sock, p, n), 0);
        make_prompt(q, 400, 50 + k);
        gen_as_off(&d, q, 400);
    }
    /* The first prompt again: a hit, swapped in from the host if it can. */
    make_prompt(p, 320, 1);
    assert_int_equal(generate(d.sock, p, 320), 0);
    uint64_t n1 = settle(&d);
    collect(sub, have, n1);

    /* A replay from the middle: exactly the batches since then, the same
     * bytes as sent live. */
    uint64_t mid = n0 + (n1 - n0) / 2;
    struct batch *again = calloc(MAX_SEQ, sizeof *again);
    assert_non_null(again);
    assert_int_equal(replay(f, mid, again, &first, &last), n1 - mid);
    assert_int_equal(first, mid);
    assert_int_equal(last, n1 - 1);
    for (uint64_t s = mid; s < n1; s++) {
        assert_int_equal(again[s].len, have[s].len);
        assert_memory_equal(again[s].buf, have[s].buf, have[s].len);
    }
    free_batches(again);

    /* Replayed in order from 0, the events give the daemon's own counts. */
    for (uint64_t s = 0; s < n1; s++)
        apply(v, have[s].buf, have[s].len);
    assert_int_equal(v->cleared, 1);
    uint64_t dev = tenant_stat(&d, "evon", "cached_device");
    uint64_t host = tenant_stat(&d, "evon", "cached_host");
    assert_true(dev > 0 && host > 0);
    assert_int_equal(v->n[0], dev);
    assert_int_equal(v->n[1], host);
    assert_int_equal(v->n[2] + v->n[3], 0);
    fprintf(stderr, "kv events: %llu batches; stored now: GPU %zu, CPU %zu\n",
            (unsigned long long)n1, v->n[0], v->n[1]);
    assert_true(tenant_stat(&d, "evoff", "cached_blocks") > 0);
    /* A router finds the first prompt's blocks from its tokens alone. */
    uint64_t h = root_hash();
    for (int b = 0; b < 320 / BT - 1; b++) {
        h = block_hash(h, p + b * BT);
        bool found = false;
        for (int m = 0; m < 2; m++)
            for (size_t i = 0; i < v->n[m]; i++)
                found |= v->h[m][i] == h;
        if (!found)
            fail_msg("block %d of the repeated prompt is not in the events' view", b);
    }
    /* Nothing of the tenant with events off was ever reported. */
    for (uint32_t k = 0; k < 6; k++) {
        make_prompt(q, 400, 50 + k);
        h = block_hash(root_hash(), q);
        for (size_t i = 0; i < v->n_seen; i++)
            assert_true(v->seen[i] != h);
    }

    /* A malformed replay request (a 3-byte sequence number) is ignored
     * and counted; the socket keeps answering good ones. */
    void *dl = zmq_socket(f->zctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(dl, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_connect(dl, f->replay_ep), 0);
    assert_true(zmq_send(dl, "", 0, ZMQ_SNDMORE) == 0);
    assert_true(zmq_send(dl, "abc", 3, 0) == 3);
    uint64_t tb = now_ms();
    while (ev_stat(&d, "replay_bad") == 0) {
        if (now_ms() - tb > 10000)
            fail_msg("the malformed replay request was not counted");
        usleep(2000);
    }
    zmq_close(dl);
    assert_int_equal(replay(f, n1 - 1, NULL, &first, &last), 1);

    /* admin_evict tier "all": AllBlocksCleared, and the daemon agrees. */
    admin_evict_all(&d);
    uint64_t n2 = settle(&d);
    assert_true(n2 > n1);
    collect(sub, have, n2);
    for (uint64_t s = n1; s < n2; s++)
        apply(v, have[s].buf, have[s].len);
    assert_int_equal(v->cleared, 2);
    assert_int_equal(v->n[0] + v->n[1], 0);
    assert_int_equal(tenant_stat(&d, "evon", "cached_blocks"), 0);
    assert_true(ev_stat(&d, "replay_requests") >= 2);
    assert_int_equal(ev_stat(&d, "dropped"), 0);

    zmq_close(sub);
    free_batches(have);
    free(v);
    assert_int_equal(kh_stop(&d), 0);
}

/* A subscriber that never reads, with a high-water mark of 8 batches and
 * a 4 KiB kernel send buffer: the
 * daemon keeps serving (every generate answers), the misses are counted,
 * and a subscriber that reads gets every batch (live, or by replay for
 * what it missed itself). */
static void test_stuck_subscriber(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    struct kh_proc d;
    /* Over TCP loopback, where the send buffer applies (not to ipc). */
    char ev_ep[160], replay_ep[160];
    int port = 20000 + (int)(getpid() % 20000);
    memcpy(ev_ep, f->ev_ep, sizeof ev_ep);
    memcpy(replay_ep, f->replay_ep, sizeof replay_ep);
    snprintf(f->ev_ep, sizeof f->ev_ep, "tcp://127.0.0.1:%d", port);
    snprintf(f->replay_ep, sizeof f->replay_ep, "tcp://127.0.0.1:%d", port + 1);
    start(&d, f, "8", "400", "0", "4096");
    void *stuck = zmq_socket(f->zctx, ZMQ_SUB);
    int one = 1, zero = 0, small = 4096;
    zmq_setsockopt(stuck, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(stuck, ZMQ_RCVHWM, &one, sizeof one);
    zmq_setsockopt(stuck, ZMQ_RCVBUF, &small, sizeof small);
    assert_int_equal(zmq_setsockopt(stuck, ZMQ_SUBSCRIBE, "", 0), 0);
    assert_int_equal(zmq_connect(stuck, f->ev_ep), 0);
    void *sub = subscribe(f, &d, 2);
    struct batch *have = calloc(MAX_SEQ, sizeof *have);
    assert_non_null(have);
    uint64_t first, last, n0 = settle(&d);
    assert_int_equal(replay(f, 0, have, &first, &last), n0);

    uint32_t p[2000];
    uint64_t t0 = now_ms(), k = 0;
    while (ev_stat(&d, "hwm_drops") == 0) {
        if (now_ms() - t0 > 120000 || k > 300)
            fail_msg("no batch was ever held back by the stuck subscriber (%llu prompts)",
                     (unsigned long long)k);
        make_prompt(p, 2000, (uint32_t)(1000 + k));
        uint64_t g0 = now_ms();
        assert_int_equal(generate(d.sock, p, 2000), 0);
        assert_true(now_ms() - g0 < 30000);
        k++;
        /* The reading subscriber drains as it goes. */
        struct batch b;
        while (recv_batch(sub, 0, &b)) {
            assert_true(b.seq < MAX_SEQ);
            free(have[b.seq].buf);
            have[b.seq] = b;
        }
    }
    uint64_t n1 = settle(&d);
    assert_true(n1 < MAX_SEQ);
    fprintf(stderr, "stuck subscriber: first miss after %llu prompts (%llu batches)\n",
            (unsigned long long)k, (unsigned long long)n1);
    uint64_t gap = n0;
    while (gap < n1 && have[gap].buf)
        gap++;
    if (gap < n1)
        assert_int_equal(replay(f, gap, have, &first, &last), n1 - gap);
    collect(sub, have, n1);
    assert_int_equal(ev_stat(&d, "dropped"), 0);
    zmq_close(stuck);
    zmq_close(sub);
    free_batches(have);
    assert_int_equal(kh_stop(&d), 0);
    memcpy(f->ev_ep, ev_ep, sizeof ev_ep);
    memcpy(f->replay_ep, replay_ep, sizeof replay_ep);
}

/* With a disk tier: blocks written behind are DISK BlockStored, slots the
 * full tier evicts are DISK BlockRemoved, and the DISK set the events
 * leave is the tier's own count of cached slots. */
static void test_disk_medium(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    char dir[160];
    snprintf(dir, sizeof dir, "%s/disk", f->tmp);
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                f->model,
                                "--kv-events",
                                f->ev_ep,
                                "--kv-events-replay",
                                f->replay_ep,
                                "--kv-events-topic",
                                TOPIC,
                                "--disk-dir",
                                dir,
                                "--disk-max-bytes",
                                "1M",
                                "--disk-writeback-ms",
                                "20",
                                "--device-blocks",
                                "64",
                                "--host-blocks",
                                "16",
                                NULL};
    struct kh_opts o = {.conf_text = conf_text, .args = args};
    struct kh_proc d;
    memset(&d, 0, sizeof d);
    assert_int_equal(kh_spawn(&d, &o), 0);
    struct batch *have = calloc(MAX_SEQ, sizeof *have);
    struct view *v = calloc(1, sizeof *v);
    assert_non_null(have);
    assert_non_null(v);
    void *sub = subscribe(f, &d, 1);
    uint64_t first, last, applied = 0, n = settle(&d);
    assert_int_equal(replay(f, 0, have, &first, &last), n);

    uint32_t p[1000];
    for (uint32_t k = 0; k < 8; k++) {
        make_prompt(p, 560, 200 + k);
        assert_int_equal(generate(d.sock, p, 560), 0);
    }
    int fd = kh_connect(d.sock);
    assert_true(fd >= 0);
    uint64_t t0 = now_ms(), cached = 0;
    for (;;) {
        /* A guard against waiting forever, not a timing bound: generous,
         * since each round settles the events of a daemon that may be
         * sharing two cores with several other tests. The daemon is
         * stopped first so that a failure cannot leave it running. */
        if (now_ms() - t0 > 120000) {
            kh_stop(&d);
            fail_msg("DISK: the events hold %zu blocks, the tier %llu", v->n[2],
                     (unsigned long long)cached);
        }
        if (kh_stat(fd, "disk", "queued") != 0) {
            usleep(5000);
            continue;
        }
        n = settle(&d);
        collect(sub, have, n);
        for (; applied < n; applied++)
            apply(v, have[applied].buf, have[applied].len);
        cached = kh_stat(fd, "disk", "cached");
        if (v->n[2] == cached && cached > 0)
            break;
        usleep(5000);
    }
    assert_true(kh_stat(fd, "disk", "evictions") > 0);
    fprintf(stderr, "disk medium: %zu blocks, %llu evictions\n", v->n[2],
            (unsigned long long)kh_stat(fd, "disk", "evictions"));
    close(fd);
    zmq_close(sub);
    free_batches(have);
    free(v);
    assert_int_equal(kh_stop(&d), 0);
}

/* Bad endpoints and a replay socket without events: exit 2 at start. */
static void test_bad_settings(void **state)
{
    struct fixture *f = *state;
    const char *const a1[] = {"--kv-events", "http://localhost:1", NULL};
    const char *const a2[] = {"--kv-events-replay", f->replay_ep, NULL};
    const char *const a3[] = {"--kv-events", f->ev_ep, "--kv-events-replay", "tcp://", NULL};
    const char *const a4[] = {"--kv-events", "tcp://192.0.2.1:1", NULL}; /* not ours */
    const char *const *args[] = {a1, a2, a3, a4};
    for (size_t i = 0; i < 4; i++) {
        struct kh_opts o = {.args = args[i]};
        assert_int_equal(kh_run(&o), 2);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_events_follow_the_cache),
        cmocka_unit_test(test_stuck_subscriber),
        cmocka_unit_test(test_disk_medium),
        cmocka_unit_test(test_bad_settings),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
