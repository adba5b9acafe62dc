/* Adversarial-tenant tests (needs root to setuid forked children, else
 * skipped with 77): a tenant guessing another tenant's sequence handles
 * (the victim's exact handles on every op, sequential and random values)
 * gets not_found and the victim's bytes stay as written; a tenant cannot
 * match another tenant's prompt unless both are configured into a shared
 * namespace, and probing a prefix learns nothing from the reported
 * matched/cached counts (never from time); the socket is mode 0660 and a
 * uid outside its group cannot connect at all. */
#include <errno.h>
#include <grp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

#define UID_V 60011    /* victim, tenant "victim" */
#define UID_A 60012    /* attacker, tenant "attacker" */
#define UID_O 60013    /* outsider: per-uid tenant, in no shared namespace */
#define UID_X 60014    /* not in the socket's group */
#define GID_SOCK 65534 /* nogroup: the socket's group */

#define N_SEQS 4
#define SEQ_TOKENS 16
#define TOKEN_BYTES (2 * 2 * 2 * 8 * 2) /* layers * (K, V) * kv_heads * head_dim * f16 */

static struct kh_proc kvd;

static const char *conf_text = "[tenant:victim]\nuids = 60011\nnamespaces = team\n"
                               "[tenant:attacker]\nuids = 60012\nnamespaces = team\n";
static const char *const kvd_args[] = {"--backend",
                                       "cpu",
                                       "--block-tokens",
                                       "4",
                                       "--kv-layers",
                                       "2",
                                       "--kv-heads",
                                       "2",
                                       "--head-dim",
                                       "8",
                                       "--kv-dtype",
                                       "f16",
                                       "--device-blocks",
                                       "256",
                                       "--host-blocks",
                                       "64",
                                       "--socket-group",
                                       "nogroup",
                                       NULL};

static int setup(void **state)
{
    if (geteuid() != 0) {
        fprintf(stderr, "not root: adversarial tenant tests need setuid children\n");
        exit(77);
    }
    return kh_start(&kvd, conf_text, kvd_args);
}

static int teardown(void **state)
{
    return kh_stop(&kvd) == 0 ? 0 : -1;
}

/* ---- small protocol helpers ---------------------------------------------- */

static int call_seq_u(int fd, const char *op, uint64_t id, uint64_t seq, const char *k, uint64_t v)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, op, id, k ? 2 : 1);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    if (k)
        proto_pack_kv_uint(&q.pk, k, v);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r))
        return -1;
    int code = r.code;
    kh_reply_free(&r);
    return code;
}

/* seq_match / seq_commit: the reply's `key` count in *out. */
static int call_tokens(int fd, const char *op, uint64_t id, uint64_t seq, const uint32_t *t,
                       size_t n, const char *key, uint64_t *out)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, op, id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_u32_array(&q.pk, "tokens", t, n);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r))
        return -1;
    int code = r.code;
    if (code == 0 && key && out)
        *out = kh_u64(r.root, key);
    kh_reply_free(&r);
    return code;
}

static void pattern(uint8_t *buf, size_t n, uint64_t salt)
{
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)(salt * 31 + i * 7 + 1);
}

static int kv_write(int fd, uint64_t id, uint64_t seq, uint64_t start, uint64_t n, const uint8_t *d)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "kv_write", id, 4);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", start);
    proto_pack_kv_uint(&q.pk, "n", n);
    proto_pack_kv_bin(&q.pk, "data", d, n * TOKEN_BYTES);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r))
        return -1;
    int code = r.code;
    kh_reply_free(&r);
    return code;
}

/* kv_read compared with want; 0 when equal. */
static int kv_check(int fd, uint64_t id, uint64_t seq, uint64_t n, const uint8_t *want)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "kv_read", id, 3);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", 0);
    proto_pack_kv_uint(&q.pk, "n", n);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r))
        return -1;
    const msgpack_object *d = kh_obj(r.root, "data");
    int rc = r.code == 0 && d && d->type == MSGPACK_OBJECT_BIN &&
                     d->via.bin.size == n * TOKEN_BYTES &&
                     !memcmp(d->via.bin.ptr, want, n * TOKEN_BYTES)
                 ? 0
                 : 1;
    kh_reply_free(&r);
    return rc;
}

static uint64_t open_ns(int fd, uint64_t id, const char *ns, int *code)
{
    struct kh_req q;
    struct kh_reply r;
    uint64_t s = 0;
    kh_req_begin(&q, "seq_open", id, ns ? 1 : 0);
    if (ns)
        proto_pack_kv_str(&q.pk, "namespace", ns);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r)) {
        *code = -1;
        return 0;
    }
    *code = r.code;
    if (r.code == 0)
        s = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    return s;
}

/* Pipelines seq_info on each of n handles; returns how many were NOT
 * answered not_found (0 is the pass). */
static int guess_batch(int fd, const uint64_t *h, size_t n, uint64_t id0)
{
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        struct kh_req q;
        kh_req_begin(&q, "seq_info", id0 + i, 1);
        proto_pack_kv_uint(&q.pk, "seq", h[i]);
        if (kh_req_send(fd, &q))
            return (int)n;
    }
    for (size_t i = 0; i < n; i++) {
        struct kh_reply r;
        if (kh_recv(fd, &r))
            return (int)n;
        if (r.code != KVD_ENOTFOUND)
            bad++;
        kh_reply_free(&r);
    }
    return bad;
}

/* ---- handle guessing ------------------------------------------------------ */

struct pipes {
    int to_parent[2], to_child[2];
    uint64_t handles[N_SEQS + 1];
};

/* The victim: N_SEQS sequences of distinct bytes plus a fork, handles sent
 * to the parent; then waits, and checks nothing changed. */
static int victim(void *arg)
{
    struct pipes *p = arg;
    uint8_t buf[SEQ_TOKENS * TOKEN_BYTES];
    int code, fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 10;
    for (int i = 0; i < N_SEQS; i++) {
        p->handles[i] = open_ns(fd, 10 + i, NULL, &code);
        if (!p->handles[i] || call_seq_u(fd, "seq_extend", 20 + i, p->handles[i], "n", SEQ_TOKENS))
            return 11;
        pattern(buf, sizeof(buf), (uint64_t)i);
        if (kv_write(fd, 30 + i, p->handles[i], 0, SEQ_TOKENS, buf))
            return 12;
    }
    struct kh_reply r;
    if (kh_call1(fd, "seq_fork", 40, "seq", p->handles[0], &r) != 0)
        return 13;
    p->handles[N_SEQS] = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    if (write(p->to_parent[1], p->handles, sizeof(p->handles)) != sizeof(p->handles))
        return 14;
    char c;
    if (read(p->to_child[0], &c, 1) != 1)
        return 15;
    for (int i = 0; i < N_SEQS; i++) {
        pattern(buf, sizeof(buf), (uint64_t)i);
        if (kv_check(fd, 50 + i, p->handles[i], SEQ_TOKENS, buf))
            return 16 + i;
        struct kh_reply ri;
        if (kh_call1(fd, "seq_info", 60 + i, "seq", p->handles[i], &ri) != 0 ||
            kh_u64(ri.root, "n_tokens") != SEQ_TOKENS)
            return 25;
        kh_reply_free(&ri);
    }
    pattern(buf, sizeof(buf), 0); /* the fork still shares sequence 0's bytes */
    if (kv_check(fd, 70, p->handles[N_SEQS], SEQ_TOKENS, buf))
        return 26;
    close(fd);
    return 0;
}

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Every op that takes a handle, on each of the victim's handles, from an
 * attacker connection: all not_found. Then sequential and random guesses. */
static int attacker(void *arg)
{
    const uint64_t *vh = arg;
    static const char *const ops[] = {"seq_info",    "seq_extend", "kv_read",  "kv_write",
                                      "seq_commit",  "seq_match",  "seq_fork", "seq_offload",
                                      "seq_restore", "seq_close"};
    uint8_t data[4 * TOKEN_BYTES] = {0xee};
    static const uint32_t toks[4] = {9, 9, 9, 9};
    int code, fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 40;
    uint64_t mine = open_ns(fd, 1, NULL, &code); /* so the table is not empty */
    if (!mine)
        return 41;
    uint64_t id = 100;
    for (int h = 0; h <= N_SEQS; h++)
        for (size_t k = 0; k < sizeof(ops) / sizeof(ops[0]); k++) {
            const char *op = ops[k];
            int rc;
            if (!strcmp(op, "seq_extend"))
                rc = call_seq_u(fd, op, id++, vh[h], "n", 4);
            else if (!strcmp(op, "kv_read")) {
                struct kh_req q;
                struct kh_reply r;
                kh_req_begin(&q, op, id++, 3);
                proto_pack_kv_uint(&q.pk, "seq", vh[h]);
                proto_pack_kv_uint(&q.pk, "start", 0);
                proto_pack_kv_uint(&q.pk, "n", 4);
                rc = kh_req_send(fd, &q) || kh_recv(fd, &r) ? -1 : r.code;
                if (rc >= 0)
                    kh_reply_free(&r);
            } else if (!strcmp(op, "kv_write"))
                rc = kv_write(fd, id++, vh[h], 0, 4, data);
            else if (!strcmp(op, "seq_commit") || !strcmp(op, "seq_match"))
                rc = call_tokens(fd, op, id++, vh[h], toks, 4, NULL, NULL);
            else
                rc = call_seq_u(fd, op, id++, vh[h], NULL, 0);
            if (rc != KVD_ENOTFOUND) {
                fprintf(stderr, "attacker: %s on victim handle %llx: code %d\n", op,
                        (unsigned long long)vh[h], rc);
                return 42;
            }
        }
    /* Sequential: every index 0..255 with the first 8 odd generations. */
    uint64_t batch[256];
    for (uint64_t gen = 1; gen < 16; gen += 2) {
        size_t n = 0;
        for (uint64_t idx = 0; idx < 256; idx++)
            if ((gen << 32 | idx) != mine)
                batch[n++] = gen << 32 | idx;
        if (guess_batch(fd, batch, n, id) != 0)
            return 43;
        id += n;
    }
    /* Random: 4096 values, and the victim's handles with a bit flipped. */
    for (int round = 0; round < 16; round++) {
        for (size_t i = 0; i < 256; i++)
            batch[i] = rng_next();
        if (guess_batch(fd, batch, 256, id) != 0)
            return 44;
        id += 256;
    }
    size_t n = 0;
    for (int h = 0; h <= N_SEQS; h++)
        for (int b = 0; b < 48; b++)
            if ((vh[h] ^ (1ull << b)) != mine)
                batch[n++ % 256] = vh[h] ^ (1ull << b);
    if (guess_batch(fd, batch, n < 256 ? n : 256, id) != 0)
        return 45;
    close(fd);
    return 0;
}

/* The victim's own uid on a second connection: handles are per connection. */
static int same_tenant_other_conn(void *arg)
{
    const uint64_t *vh = arg;
    int fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 50;
    if (guess_batch(fd, vh, N_SEQS + 1, 1) != 0)
        return 51;
    close(fd);
    return 0;
}

static void test_handle_guessing(void **state)
{
    struct pipes p;
    assert_int_equal(pipe(p.to_parent), 0);
    assert_int_equal(pipe(p.to_child), 0);
    pid_t v = kh_run_as(UID_V, GID_SOCK, victim, &p);
    assert_true(v > 0);
    uint64_t vh[N_SEQS + 1];
    close(p.to_parent[1]); /* so a victim that fails early gives EOF, not a hang */
    if (read(p.to_parent[0], vh, sizeof(vh)) != sizeof(vh))
        fail_msg("victim failed with %d", kh_child_status(v));
    pid_t a = kh_run_as(UID_A, GID_SOCK, attacker, vh);
    assert_int_equal(kh_child_status(a), 0);
    pid_t s = kh_run_as(UID_V, GID_SOCK, same_tenant_other_conn, vh);
    assert_int_equal(kh_child_status(s), 0);
    assert_int_equal(write(p.to_child[1], "g", 1), 1);
    assert_int_equal(kh_child_status(v), 0);
    close(p.to_parent[0]);
    close(p.to_child[0]);
    close(p.to_child[1]);
    /* The daemon's invariants held through it all. */
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "admin_check", 1, &r), 0);
    kh_reply_free(&r);
    close(fd);
}

/* ---- prefix isolation ----------------------------------------------------- */

#define PLEN 32
static uint32_t secret[PLEN], team[PLEN];

/* Commits prompt t (PLEN tokens) in namespace ns (NULL: own) and keeps the
 * sequence open until the parent says so, so its blocks are live. */
struct commit_arg {
    const uint32_t *t;
    const char *ns;
    int to_parent, from_parent;
};
static int committer(void *arg)
{
    struct commit_arg *c = arg;
    int code, fd = kh_connect(kvd.sock);
    uint64_t shared = 0;
    if (fd < 0)
        return 60;
    uint64_t s = open_ns(fd, 1, c->ns, &code);
    if (!s || call_seq_u(fd, "seq_extend", 2, s, "n", PLEN))
        return 61;
    if (call_tokens(fd, "seq_commit", 3, s, c->t, PLEN, "shared", &shared) || shared != PLEN / 4)
        return 62;
    if (write(c->to_parent, "c", 1) != 1)
        return 63;
    char x;
    if (read(c->from_parent, &x, 1) != 1)
        return 64;
    close(fd);
    return 0;
}

/* What a prober learns: matched tokens for t in ns (fresh sequence), and
 * its own tenant's cached-block count from stats. */
struct probe_out {
    uint64_t matched, cached, tenants_seen;
};
struct probe_arg {
    const uint32_t *t;
    const char *ns;
    int to_parent;
    int expect_open_code;
};
static int prober(void *arg)
{
    struct probe_arg *p = arg;
    struct probe_out o = {UINT64_MAX, UINT64_MAX, UINT64_MAX};
    int code, fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 70;
    uint64_t s = open_ns(fd, 1, p->ns, &code);
    if (code != p->expect_open_code)
        return 71;
    if (code == 0 && call_tokens(fd, "seq_match", 2, s, p->t, PLEN, "matched", &o.matched))
        return 72;
    struct kh_reply r;
    if (kh_call0(fd, "stats", 3, &r) != 0)
        return 73;
    /* stats shows a non-admin only its own tenant */
    const msgpack_object *ts = kh_obj(r.root, "tenants");
    if (ts && ts->type == MSGPACK_OBJECT_ARRAY) {
        o.tenants_seen = ts->via.array.size;
        if (ts->via.array.size == 1)
            o.cached = kh_u64(&ts->via.array.ptr[0], "cached_blocks");
    } else if (ts && ts->type == MSGPACK_OBJECT_MAP) {
        o.tenants_seen = ts->via.map.size;
        if (ts->via.map.size == 1)
            o.cached = kh_u64(&ts->via.map.ptr[0].val, "cached_blocks");
    }
    kh_reply_free(&r);
    close(fd);
    if (write(p->to_parent, &o, sizeof(o)) != sizeof(o))
        return 74;
    return 0;
}

static struct probe_out probe(uid_t uid, const uint32_t *t, const char *ns, int expect_open)
{
    int pp[2];
    struct probe_out o;
    assert_int_equal(pipe(pp), 0);
    struct probe_arg a = {t, ns, pp[1], expect_open};
    pid_t pid = kh_run_as(uid, GID_SOCK, prober, &a);
    assert_int_equal(kh_child_status(pid), 0);
    assert_int_equal(read(pp[0], &o, sizeof(o)), sizeof(o));
    close(pp[0]);
    close(pp[1]);
    return o;
}

static void test_prefix_isolation(void **state)
{
    for (int i = 0; i < PLEN; i++) {
        secret[i] = 1000 + (uint32_t)i * 3;
        team[i] = 5000 + (uint32_t)i;
    }
    /* Before the victim has the prompt. */
    struct probe_out before = probe(UID_A, secret, NULL, 0);
    assert_int_equal(before.matched, 0);
    assert_int_equal(before.tenants_seen, 1);

    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    struct commit_arg ca = {secret, NULL, up[1], down[0]};
    pid_t v = kh_run_as(UID_V, GID_SOCK, committer, &ca);
    char x;
    assert_int_equal(read(up[0], &x, 1), 1);
    /* The victim holds the prompt in cache: the attacker and an outsider see
     * exactly what they saw before. */
    struct probe_out after = probe(UID_A, secret, NULL, 0);
    assert_int_equal(after.matched, before.matched);
    assert_int_equal(after.cached, before.cached);
    assert_int_equal(after.tenants_seen, 1);
    struct probe_out outsider = probe(UID_O, secret, NULL, 0);
    assert_int_equal(outsider.matched, 0);
    /* The victim's own second connection does hit: the cache works. */
    struct probe_out self = probe(UID_V, secret, NULL, 0);
    assert_int_equal(self.matched, PLEN);
    assert_int_equal(write(down[1], "g", 1), 1);
    assert_int_equal(kh_child_status(v), 0);

    /* The shared namespace: both configured tenants meet there, an
     * outsider may not even open a sequence in it. */
    struct commit_arg cb = {team, "team", up[1], down[0]};
    v = kh_run_as(UID_V, GID_SOCK, committer, &cb);
    assert_int_equal(read(up[0], &x, 1), 1);
    struct probe_out shared = probe(UID_A, team, "team", 0);
    assert_int_equal(shared.matched, PLEN);
    /* ... but not in the attacker's own namespace */
    struct probe_out own = probe(UID_A, team, NULL, 0);
    assert_int_equal(own.matched, 0);
    probe(UID_O, team, "team", KVD_EPERM);
    assert_int_equal(write(down[1], "g", 1), 1);
    assert_int_equal(kh_child_status(v), 0);
    for (int i = 0; i < 2; i++) {
        close(up[i]);
        close(down[i]);
    }
}

/* ---- socket permissions --------------------------------------------------- */

static int try_connect(void *arg)
{
    int fd = kh_connect(kvd.sock);
    if (fd >= 0) {
        close(fd);
        return 0;
    }
    return 1;
}

static void test_socket_permissions(void **state)
{
    struct stat st;
    assert_int_equal(stat(kvd.sock, &st), 0);
    assert_true(S_ISSOCK(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0660);
    assert_int_equal(st.st_gid, GID_SOCK);
    /* In the socket's group: connects. Outside it: refused by the kernel
     * before the daemon sees anything. */
    assert_int_equal(kh_child_status(kh_run_as(UID_A, GID_SOCK, try_connect, NULL)), 0);
    assert_int_equal(kh_child_status(kh_run_as(UID_X, UID_X, try_connect, NULL)), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_socket_permissions),
        cmocka_unit_test(test_handle_guessing),
        cmocka_unit_test(test_prefix_isolation),
    };
    return cmocka_run_group_tests_name("security_tenants", tests, setup, teardown);
}
