/* Tenants' byte quotas and floors across two models on one page budget,
 * against a real kvd with tenants of their own uids (the test connects as
 * them with seteuid: needs root, else skipped with 77): a tenant's quota
 * counts its pages in both models' pools together, its own cache on one
 * model gives way to its blocks on the other, and past it a request is
 * refused with quota_exceeded, losing nothing; another tenant's floor keeps
 * its cache when a tenant fills the budget through the other model, and its
 * next request on its own model still succeeds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"
#include "two_models.h"

#define UID_A 60001
#define UID_B 60002
#define GID_ALL 65534     /* nogroup: the socket's group */
#define PAGE (256u << 10) /* the budget's page for device-bytes = 16M */

static char g_dir[64], g_a[128], g_b[128];
static uint64_t g_id;

/* alpha: llama f32, 2 layers, f16 KV of 8 KiB blocks (32 to a page);
 * beta: qwen2 f16, 3 layers, q8_0 KV of 9792-byte blocks (79 to a pool
 * page of 3 budget pages). With 16 MiB, their weights and scratch take 40
 * of the 64 pages, and 24 are left to the KV. */
static int setup(void **state)
{
    (void)state;
    return two_models_make("/tmp/kvd-mtenants.XXXXXX", g_dir, g_a, g_b);
}

static int teardown(void **state)
{
    (void)state;
    two_models_remove(g_dir, g_a, g_b);
    return 0;
}

/* A connection whose peer credentials are uid's (SO_PEERCRED takes the
 * effective ids at connect). */
static int connect_as(const char *sock, uid_t uid)
{
    if (setegid(GID_ALL) != 0 || seteuid(uid) != 0)
        return -1;
    int fd = kh_connect(sock);
    if (seteuid(0) != 0 || setegid(0) != 0)
        abort();
    return fd;
}

static struct kh_proc *start(const char *tenants)
{
    char conf[2048];
    snprintf(conf, sizeof conf,
             "[server]\ndevice-bytes = 16M\n%s"
             "[model:alpha]\npath = %s\npreload = yes\n"
             "[model:beta]\npath = %s\nkv-dtype = q8_0\npreload = yes\n",
             tenants, g_a, g_b);
    const char *args[] = {"--backend", "cpu", "--host-blocks", "1024", "--socket-group",
                          "nogroup",   NULL};
    return kh_new(conf, args);
}

/* ---- requests ------------------------------------------------------------ */

/* A distinct prompt of n tokens (ctx 256, vocab 500 and 700). */
static void prompt_k(uint32_t *out, size_t n, unsigned k)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (uint32_t)(2 + (k * 131 + i * 7 + (i * i) % 13) % 480);
}

struct gen {
    int code;
    uint64_t cached;
    char message[256];
};

/* A greedy generate of one token on model of prompt_k(240, k). */
static void generate(int fd, const char *model, unsigned k, struct gen *g)
{
    uint32_t pr[240];
    prompt_k(pr, 240, k);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "generate", ++g_id, 4);
    proto_pack_kv_str(&q.pk, "model", model);
    proto_pack_kv_u32_array(&q.pk, "tokens", pr, 240);
    proto_pack_kv_uint(&q.pk, "max_tokens", 1);
    proto_pack_kv_double(&q.pk, "temperature", 0.0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.id, g_id);
    memset(g, 0, sizeof *g);
    g->code = r.code;
    snprintf(g->message, sizeof g->message, "%s", r.message);
    if (r.code == 0)
        g->cached = kh_u64(kh_obj(r.root, "usage"), "cached");
    kh_reply_free(&r);
}

static void generate_ok(int fd, const char *model, unsigned k, struct gen *g)
{
    generate(fd, model, k, g);
    if (g->code)
        fail_msg("generate on %s, prompt %u: %d %s", model, k, g->code, g->message);
}

static uint64_t seq_open_on(int fd, const char *model)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "seq_open", ++g_id, 1);
    proto_pack_kv_str(&q.pk, "model", model);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    uint64_t s = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    return s;
}

/* seq_extend by n: its code; *len the new length on success. */
static int extend(int fd, uint64_t seq, uint64_t n, uint64_t *len, char *msg, size_t cap)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "seq_extend", ++g_id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "n", n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    int code = r.code;
    if (code == 0 && len)
        *len = kh_u64(r.root, "n_tokens");
    if (msg)
        snprintf(msg, cap, "%s", r.message);
    kh_reply_free(&r);
    return code;
}

/* kv_read of token `at`: its bytes into out (cap), their count. */
static size_t read_token(int fd, uint64_t seq, uint64_t at, unsigned char *out, size_t cap)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "kv_read", ++g_id, 3);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", at);
    proto_pack_kv_uint(&q.pk, "n", 1);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *d = kh_obj(r.root, "data");
    assert_true(d->via.bin.size <= cap);
    memcpy(out, d->via.bin.ptr, d->via.bin.size);
    size_t n = d->via.bin.size;
    kh_reply_free(&r);
    return n;
}

static void write_token(int fd, uint64_t seq, uint64_t at, const unsigned char *data, size_t n)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "kv_write", ++g_id, 4);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", at);
    proto_pack_kv_uint(&q.pk, "n", 1);
    proto_pack_kv_bin(&q.pk, "data", data, n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
}

/* ---- stats (root: the admin) ------------------------------------------- */

/* stats tenants[name].device_bytes: its pages in every model's pool. */
static uint64_t tenant_bytes(int fd, const char *name)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    const msgpack_object *t = kh_obj(r.root, "tenants");
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < t->via.array.size; i++) {
        const msgpack_object *nm = kh_obj(&t->via.array.ptr[i], "name");
        if (nm->via.str.size == strlen(name) && !memcmp(nm->via.str.ptr, name, nm->via.str.size))
            v = kh_u64(&t->via.array.ptr[i], "device_bytes");
    }
    kh_reply_free(&r);
    return v == UINT64_MAX ? 0 : v;
}

/* stats models[name].kv_device_bytes. */
static uint64_t model_kv(int fd, const char *name)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *nm = kh_obj(&m->via.array.ptr[i], "name");
        if (nm->via.str.size == strlen(name) && !memcmp(nm->via.str.ptr, name, nm->via.str.size))
            v = kh_u64(&m->via.array.ptr[i], "kv_device_bytes");
    }
    kh_reply_free(&r);
    assert_true(v != UINT64_MAX);
    return v;
}

static void check_daemon(int fd)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "admin_check", ++g_id, &r), 0);
    kh_reply_free(&r);
}

/* ---- quotas --------------------------------------------------------------- */

/* Tenant a may hold 6 pages. Its cache on alpha (3 pages) and a sequence on
 * beta (3) reach the quota; a new prompt on alpha evicts a's own cache
 * there; the sequence's next 3 pages take a's cache on alpha (moved to
 * alpha's host tier), and past the quota its extend and a generate on
 * alpha are quota_exceeded, the sequence unchanged and its data intact. */
static void t_quota_across_models(void **state)
{
    (void)state;
    char ten[512];
    snprintf(ten, sizeof ten,
             "[tenant:a]\nuids = %d\nmax-device-bytes = %u\n[tenant:b]\nuids = %d\n", UID_A,
             6 * PAGE, UID_B);
    struct kh_proc *p = start(ten);
    assert_non_null(p);
    int fd = kh_connect(p->sock), fa = connect_as(p->sock, UID_A);
    assert_true(fd >= 0 && fa >= 0);
    struct gen g;
    const uint64_t quota = 6 * PAGE;

    /* 6 prompts of 16 blocks: 96 blocks, 3 whole pages of alpha's */
    for (unsigned k = 0; k < 6; k++) {
        generate_ok(fa, "alpha", k, &g);
        assert_true(tenant_bytes(fd, "a") <= quota);
    }
    assert_int_equal(tenant_bytes(fd, "a"), 3 * PAGE);
    uint64_t seq = seq_open_on(fa, "beta"), len = 0;
    char msg[256];
    assert_int_equal(extend(fa, seq, 1000, &len, msg, sizeof msg), 0); /* 63 blocks: 3 pages */
    assert_int_equal(tenant_bytes(fd, "a"), quota);
    unsigned char tok[4096], back[4096];
    size_t tb = read_token(fa, seq, 0, tok, sizeof tok);
    assert_true(tb > 0);
    for (size_t i = 0; i < tb; i++)
        tok[i] = (unsigned char)(i * 37 + 11);
    write_token(fa, seq, 0, tok, tb);

    /* at the quota: a new prompt on alpha takes the place of a's own cache */
    generate_ok(fa, "alpha", 6, &g);
    assert_true(tenant_bytes(fd, "a") <= quota);

    /* the sequence's next 3 pages: a's cache on alpha gives them */
    assert_int_equal(extend(fa, seq, 1000, &len, msg, sizeof msg), 0);
    assert_int_equal(len, 2000);
    assert_int_equal(tenant_bytes(fd, "a"), quota);
    assert_int_equal(model_kv(fd, "beta"), quota); /* all of it: none left on alpha */

    /* past it: refused, naming the quota, the sequence unchanged */
    assert_int_equal(extend(fa, seq, 1000, NULL, msg, sizeof msg), KVD_EQUOTA);
    assert_non_null(strstr(msg, "quota"));
    generate(fa, "alpha", 7, &g);
    if (g.code != KVD_EQUOTA)
        fail_msg("generate past the quota: %d %s", g.code, g.message);
    assert_non_null(strstr(g.message, "quota"));
    assert_int_equal(tenant_bytes(fd, "a"), quota);
    assert_int_equal(extend(fa, seq, 16, &len, msg, sizeof msg), 0); /* in its last block */
    assert_int_equal(len, 2016);
    assert_int_equal(read_token(fa, seq, 0, back, sizeof back), tb);
    assert_memory_equal(back, tok, tb);

    /* the sequence closed, a's quota full of its cache on beta */
    struct kh_reply r;
    assert_int_equal(kh_call1(fa, "seq_close", ++g_id, "seq", seq, &r), 0);
    kh_reply_free(&r);
    for (unsigned k = 200; k < 215; k++) {
        generate_ok(fa, "beta", k, &g);
        uint64_t b = tenant_bytes(fd, "a");
        if (b > quota)
            fail_msg("prompt %u on beta: tenant a holds %llu bytes (alpha %llu, beta %llu), its "
                     "quota is %llu",
                     k, (unsigned long long)b, (unsigned long long)model_kv(fd, "alpha"),
                     (unsigned long long)model_kv(fd, "beta"), (unsigned long long)quota);
    }
    assert_int_equal(tenant_bytes(fd, "a"), quota);
    assert_int_equal(model_kv(fd, "beta"), quota);

    /* a's first prompt on alpha: its pages come from a's cache on beta, and
     * it still matches (a's cache on alpha went to alpha's host tier, not
     * away) */
    generate_ok(fa, "alpha", 1, &g);
    assert_true(g.cached >= 224);
    assert_true(tenant_bytes(fd, "a") <= quota);
    assert_true(model_kv(fd, "alpha") > 0);
    generate_ok(fa, "beta", 214, &g); /* beta's latest is still there */
    assert_true(g.cached >= 224);
    check_daemon(fd);
    close(fa);
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* ---- floors --------------------------------------------------------------- */

/* Tenant b's floor is 4 pages; it caches 4 pages on alpha. Tenant a (no
 * quota) fills the rest of the budget through beta: its cache, then its
 * sequences, on beta and then on alpha, until no_memory. b's 4 pages stay
 * (its latest prompt still matches), and b's next prompt on alpha
 * succeeds in them. */
static void t_floor_across_models(void **state)
{
    (void)state;
    char ten[512];
    snprintf(ten, sizeof ten,
             "[tenant:a]\nuids = %d\n[tenant:b]\nuids = %d\nreserved-device-bytes = %u\n", UID_A,
             UID_B, 4 * PAGE);
    struct kh_proc *p = start(ten);
    assert_non_null(p);
    int fd = kh_connect(p->sock), fa = connect_as(p->sock, UID_A), fb = connect_as(p->sock, UID_B);
    assert_true(fd >= 0 && fa >= 0 && fb >= 0);
    struct gen g;
    const uint64_t floor = 4 * PAGE;

    for (unsigned k = 0; k < 8; k++) /* 128 blocks: 4 whole pages */
        generate_ok(fb, "alpha", k, &g);
    assert_int_equal(tenant_bytes(fd, "b"), floor);

    /* a's cache on beta: it grows into the free pages, never into b's */
    for (unsigned k = 100; k < 140; k++) {
        generate_ok(fa, "beta", k, &g);
        assert_int_equal(tenant_bytes(fd, "b"), floor);
    }
    assert_true(tenant_bytes(fd, "a") > 12 * PAGE);

    /* a's sequences take every page it can get: on beta a pool page (3
     * budget pages) at a time, then alpha's last ones */
    uint64_t sb = seq_open_on(fa, "beta"), sa = seq_open_on(fa, "alpha"), len;
    char msg[256];
    int rc;
    unsigned n = 0;
    while ((rc = extend(fa, sb, 16, &len, msg, sizeof msg)) == 0)
        assert_true(++n < 100000);
    assert_int_equal(rc, KVD_ENOMEM);
    while ((rc = extend(fa, sa, 16, &len, msg, sizeof msg)) == 0)
        assert_true(++n < 100000);
    assert_int_equal(rc, KVD_ENOMEM);
    assert_non_null(strstr(msg, "pool exhausted"));
    uint64_t used, budget;
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    used = kh_u64(kh_obj(r.root, "model_memory"), "device_used");
    budget = kh_u64(kh_obj(r.root, "model_memory"), "device_budget");
    kh_reply_free(&r);
    assert_true(budget - used < 3 * PAGE); /* less than one of beta's pool pages free */
    assert_int_equal(tenant_bytes(fd, "b"), floor);

    /* b's latest prompt is still cached on the device, and its next new
     * prompts run in its own pages */
    generate_ok(fb, "alpha", 7, &g);
    assert_true(g.cached >= 224);
    for (unsigned k = 8; k < 12; k++) {
        generate_ok(fb, "alpha", k, &g);
        assert_true(tenant_bytes(fd, "b") <= floor + PAGE);
    }
    check_daemon(fd);
    close(fa);
    close(fb);
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_quota_across_models),
        cmocka_unit_test(t_floor_across_models),
    };
    if (geteuid() != 0) {
        fprintf(stderr, "test_models_tenants: needs root (connects as other uids); skipped\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, setup, teardown);
}
