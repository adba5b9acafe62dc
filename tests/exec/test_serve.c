/* generate and cancel through a real kvd serving a small random model:
 * hello's model, cache hits, streaming, cancel, disconnect (everything
 * freed), every malformed generate → bad_request naming the field, kvctl
 * generate, SIGTERM answering every in-flight request, store mode. hello,
 * generate (cold, cached), streaming and kvctl run again over a q8_0 KV
 * cache (--kv-dtype q8_0: hello's dtype and block_bytes, the same tokens
 * from a cache hit as from the cold run). */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

static char g_dir[64], g_model[128];
static struct kh_proc g_kvd;
static const char *g_kv_dtype = "f16"; /* the daemon's --kv-dtype */

static int group_setup(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[512];
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvd-serve-XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof(g_model), "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof(cmd),
             "'%s/kvd-gguf-gen' -o '%s' --layers 2 --embd 128 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 256 --type f32 >/dev/null",
             tools, g_model);
    if (system(cmd) != 0)
        return -1;
    const char *args[] = {"--model", g_model,         "--backend", "cpu",        "--device-blocks",
                          "256",     "--host-blocks", "64",        "--kv-dtype", g_kv_dtype,
                          NULL};
    return kh_start(&g_kvd, NULL, args);
}

static int group_setup_q8_0(void **state)
{
    g_kv_dtype = "q8_0";
    return group_setup(state);
}

static int group_teardown(void **state)
{
    (void)state;
    int st = kh_stop(&g_kvd);
    unlink(g_model);
    rmdir(g_dir);
    return st == 0 ? 0 : -1;
}

/* A generate request: tokens (n > 0), max_tokens, stream; extra pairs
 * packed by `extra` (n_extra of them). */
static int send_gen(int fd, uint64_t id, const uint32_t *toks, size_t n, uint32_t max_tokens,
                    bool stream)
{
    struct kh_req r;
    kh_req_begin(&r, "generate", id, 3);
    proto_pack_kv_u32_array(&r.pk, "tokens", toks, n);
    proto_pack_kv_uint(&r.pk, "max_tokens", max_tokens);
    proto_pack_kv_bool(&r.pk, "stream", stream);
    return kh_req_send(fd, &r);
}

static size_t get_tokens(const msgpack_object *map, uint32_t *out, size_t cap)
{
    const msgpack_object *a = kh_obj(map, "tokens");
    if (!a || a->type != MSGPACK_OBJECT_ARRAY)
        return SIZE_MAX;
    size_t n = 0;
    for (uint32_t i = 0; i < a->via.array.size && n < cap; i++)
        out[n++] = (uint32_t)a->via.array.ptr[i].via.u64;
    return n;
}

static bool str_is(const msgpack_object *o, const char *s)
{
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

/* What a test holds (a reply, two connections, its own daemon), in CMocka
 * setup/teardown: released also after a failed assert. */
struct tstate {
    struct kh_reply r;
    int fd[2];
    struct kh_proc *p;
};

static int t_setup(void **state)
{
    struct tstate *sv = calloc(1, sizeof *sv);
    *state = sv;
    if (!sv)
        return -1;
    sv->fd[0] = sv->fd[1] = -1;
    return 0;
}

static int t_teardown(void **state)
{
    struct tstate *sv = *state;
    if (!sv)
        return 0;
    kh_reply_free(&sv->r);
    for (int i = 0; i < 2; i++)
        if (sv->fd[i] >= 0)
            close(sv->fd[i]);
    kh_free(sv->p);
    free(sv);
    return 0;
}

static void sv_close(struct tstate *sv, int i)
{
    close(sv->fd[i]);
    sv->fd[i] = -1;
}

static void test_hello_model(void **state)
{
    struct tstate *sv = *state;
    int fd = sv->fd[0] = kh_connect(g_kvd.sock);
    struct kh_reply *r = &sv->r;
    assert_int_equal(kh_call0(fd, "hello", 1, r), 0);
    const msgpack_object *m = kh_obj(r->root, "model");
    assert_non_null(m);
    assert_int_equal(m->type, MSGPACK_OBJECT_MAP);
    assert_int_equal(kh_u64(m, "vocab"), 256);
    assert_int_equal(kh_u64(m, "context"), 256);
    assert_true(kh_u64(m, "weight_bytes") > 0);
    assert_true(kh_u64(m, "weight_device_bytes") >= kh_u64(m, "weight_bytes"));
    /* the KV: 2 layers x K|V x 2 kv heads x 16 tokens of head_dim 32 rows,
     * 64 bytes in f16, 34 (one Q8_0 block) in q8_0 */
    const msgpack_object *kv = kh_obj(r->root, "kv");
    assert_non_null(kv);
    assert_true(str_is(kh_obj(kv, "dtype"), g_kv_dtype));
    uint64_t row = strcmp(g_kv_dtype, "q8_0") ? 64 : 34;
    assert_int_equal(kh_u64(kv, "head_dim"), 32);
    assert_int_equal(kh_u64(kv, "block_bytes"), 2 * 2 * 2 * 16 * row);
    assert_int_equal(kh_u64(kv, "token_bytes"), 2 * 2 * 2 * row);
    kh_reply_free(r);
    sv_close(sv, 0);
}

/* Cold, then a prefix-cache hit: same tokens, usage and timing present. */
static void test_generate_cached(void **state)
{
    struct tstate *sv = *state;
    int fd = sv->fd[0] = kh_connect(g_kvd.sock);
    uint32_t p[37], a[16], b[16];
    for (int i = 0; i < 37; i++)
        p[i] = (uint32_t)(i * 13 + 5) % 256;
    struct kh_reply *r = &sv->r;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(send_gen(fd, 10 + k, p, 37, 16, false), 0);
        assert_int_equal(kh_recv(fd, r), 0);
        assert_int_equal(r->code, 0);
        assert_int_equal(get_tokens(r->root, k ? b : a, 16), 16);
        assert_true(str_is(kh_obj(r->root, "finish_reason"), "length"));
        const msgpack_object *u = kh_obj(r->root, "usage");
        assert_int_equal(kh_u64(u, "prompt"), 37);
        assert_int_equal(kh_u64(u, "completion"), 16);
        assert_int_equal(kh_u64(u, "cached"), k ? 32 : 0);
        const msgpack_object *t = kh_obj(r->root, "timing");
        assert_non_null(kh_obj(t, "queue_ms"));
        assert_non_null(kh_obj(t, "ttft_ms"));
        assert_non_null(kh_obj(t, "total_ms"));
        kh_reply_free(r);
    }
    assert_memory_equal(a, b, sizeof(a));
    sv_close(sv, 0);
}

/* Streamed events concatenate to the reply; a cancel ends the next one. */
static void test_stream_and_cancel(void **state)
{
    struct tstate *sv = *state;
    int fd = sv->fd[0] = kh_connect(g_kvd.sock);
    uint32_t p[5] = {1, 2, 3, 4, 5}, got[256], fin[256];
    size_t n_got = 0;
    struct kh_reply *r = &sv->r;
    assert_int_equal(send_gen(fd, 1, p, 5, 40, true), 0);
    for (;;) {
        assert_int_equal(kh_recv(fd, r), 0);
        assert_int_equal(r->id, 1);
        if (kh_obj(r->root, "event")) {
            assert_true(str_is(kh_obj(r->root, "event"), "tokens"));
            n_got += get_tokens(r->root, got + n_got, 256 - n_got);
            kh_reply_free(r);
            continue;
        }
        break;
    }
    assert_int_equal(r->code, 0);
    assert_int_equal(get_tokens(r->root, fin, 256), 40);
    kh_reply_free(r);
    assert_int_equal(n_got, 40);
    assert_memory_equal(got, fin, 40 * sizeof(uint32_t));

    /* Cancel sent in the same write as the generate: the daemon reads both
     * in one pass, so the cancel reaches the request within a step or two
     * of its start, however slowly this client runs (a cancel sent after
     * the first event raced 240 fast steps of this tiny model). */
    {
        struct kh_req g, c;
        kh_req_begin(&g, "generate", 2, 3);
        proto_pack_kv_u32_array(&g.pk, "tokens", p, 5);
        proto_pack_kv_uint(&g.pk, "max_tokens", 240);
        proto_pack_kv_bool(&g.pk, "stream", true);
        assert_int_equal(proto_frame_end(&g.sb, g.at), 0);
        kh_req_begin(&c, "cancel", 3, 1);
        proto_pack_kv_uint(&c.pk, "target", 2);
        assert_int_equal(proto_frame_end(&c.sb, c.at), 0);
        msgpack_sbuffer_write(&g.sb, c.sb.data, c.sb.size);
        assert_int_equal(kh_send_raw(fd, g.sb.data, g.sb.size), 0);
        msgpack_sbuffer_destroy(&g.sb);
        msgpack_sbuffer_destroy(&c.sb);
    }
    assert_int_equal(kh_recv(fd, r), 0);
    /* The cancel's reply and the generate's events/reply interleave. */
    bool cancel_ok = false, done = false;
    while (!cancel_ok || !done) {
        if (r->id == 3) {
            assert_int_equal(r->code, 0);
            cancel_ok = true;
        } else if (r->id == 2 && !kh_obj(r->root, "event")) {
            assert_int_equal(r->code, 0);
            assert_true(str_is(kh_obj(r->root, "finish_reason"), "cancelled"));
            assert_true(get_tokens(r->root, fin, 256) < 240);
            done = true;
        }
        kh_reply_free(r);
        if (!cancel_ok || !done)
            assert_int_equal(kh_recv(fd, r), 0);
    }
    sv_close(sv, 0);
}

/* A client that disconnects mid-generate leaves nothing behind. */
static void test_disconnect_frees(void **state)
{
    struct tstate *sv = *state;
    int ctl = sv->fd[1] = kh_connect(g_kvd.sock);
    /* The previous test's connections may still be closing: settle first,
     * and treat the baseline as an upper bound (it can only shrink). */
    while (kh_stat(ctl, NULL, "in_flight") != 0 || kh_stat(ctl, "requests", "live") != 0)
        usleep(2000);
    uint64_t seqs0 = kh_stat(ctl, "counters", "seqs");
    int fd = sv->fd[0] = kh_connect(g_kvd.sock);
    uint32_t p[40];
    for (int i = 0; i < 8; i++) {
        for (int j = 0; j < 40; j++)
            p[j] = (uint32_t)(i * 31 + j * 7) % 256;
        assert_int_equal(send_gen(fd, 1 + i, p, 40, 200, i % 2 == 0), 0);
    }
    struct kh_reply *r = &sv->r;
    assert_int_equal(kh_recv(fd, r), 0); /* the first event: work is under way */
    kh_reply_free(r);
    sv_close(sv, 0);
    /* Poll (no time limit; ctest's timeout is the net) until the executor
     * has let go of everything. */
    while (kh_stat(ctl, NULL, "in_flight") != 0 || kh_stat(ctl, "counters", "seqs") > seqs0 ||
           kh_stat(ctl, "device", "used") != 0 || kh_stat(ctl, "requests", "live") != 0)
        usleep(2000);
    assert_int_equal(kh_stat(ctl, "requests", "running"), 0);
    assert_int_equal(kh_stat(ctl, "requests", "waiting"), 0);
    assert_int_equal(kh_call0(ctl, "admin_check", 2, r), 0);
    kh_reply_free(r);
    sv_close(sv, 1);
}

/* Sends generate with the pairs written by `pack` and expects bad_request
 * whose message names `field`. */
struct bad_case {
    const char *field;
    void (*pack)(msgpack_packer *pk);
    size_t n;
};

static void bt_tokens_str(msgpack_packer *pk)
{
    proto_pack_kv_str(pk, "tokens", "hello");
}
static void bt_tokens_neg(msgpack_packer *pk)
{
    proto_pack_str(pk, "tokens");
    msgpack_pack_array(pk, 2);
    msgpack_pack_int(pk, 1);
    msgpack_pack_int(pk, -3);
}
static void bt_tokens_vocab(msgpack_packer *pk)
{
    uint32_t t[3] = {1, 256, 2};
    proto_pack_kv_u32_array(pk, "tokens", t, 3);
}
static void bt_tokens_empty(msgpack_packer *pk)
{
    proto_pack_kv_u32_array(pk, "tokens", NULL, 0);
}
static void bt_tokens_huge(msgpack_packer *pk)
{
    static uint32_t t[300];
    proto_pack_kv_u32_array(pk, "tokens", t, 300);
}
static void bt_tokens_missing(msgpack_packer *pk)
{
    proto_pack_kv_uint(pk, "max_tokens", 4);
}
static const uint32_t ok_toks[2] = {1, 2};
#define OKT proto_pack_kv_u32_array(pk, "tokens", ok_toks, 2)
static void bt_max0(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_uint(pk, "max_tokens", 0);
}
static void bt_max_huge(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_uint(pk, "max_tokens", 1u << 30);
}
static void bt_max_neg(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_int(pk, "max_tokens", -1);
}
static void bt_temp_neg(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_double(pk, "temperature", -0.5);
}
static void bt_temp_str(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_str(pk, "temperature", "hot");
}
static void bt_top_p0(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_double(pk, "top_p", 0.0);
}
static void bt_top_p_big(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_double(pk, "top_p", 1.5);
}
static void bt_top_k_neg(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_int(pk, "top_k", -2);
}
static void bt_top_k_big(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_uint(pk, "top_k", 100000);
}
static void bt_seed_neg(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_int(pk, "seed", -7);
}
static void bt_stop_big(msgpack_packer *pk)
{
    static uint32_t s[65];
    OKT;
    proto_pack_kv_u32_array(pk, "stop", s, 65);
}
static void bt_stop_vocab(msgpack_packer *pk)
{
    uint32_t s[1] = {999};
    OKT;
    proto_pack_kv_u32_array(pk, "stop", s, 1);
}
static void bt_stream_int(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_uint(pk, "stream", 1);
}
static void bt_prio_str(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_str(pk, "priority", "high");
}
static void bt_prio_huge(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_int(pk, "priority", 1ll << 40);
}
static void bt_seq_unknown(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_uint(pk, "seq", 123456789);
}
static void bt_seq_str(msgpack_packer *pk)
{
    OKT;
    proto_pack_kv_str(pk, "seq", "x");
}

static void test_malformed(void **state)
{
    struct tstate *sv = *state;
    const struct bad_case cases[] = {
        {"tokens", bt_tokens_str, 1},    {"tokens", bt_tokens_neg, 1},
        {"tokens", bt_tokens_vocab, 1},  {"tokens", bt_tokens_empty, 1},
        {"tokens", bt_tokens_huge, 1},   {"tokens", bt_tokens_missing, 1},
        {"max_tokens", bt_max0, 2},      {"max_tokens", bt_max_huge, 2},
        {"max_tokens", bt_max_neg, 2},   {"temperature", bt_temp_neg, 2},
        {"temperature", bt_temp_str, 2}, {"top_p", bt_top_p0, 2},
        {"top_p", bt_top_p_big, 2},      {"top_k", bt_top_k_neg, 2},
        {"top_k", bt_top_k_big, 2},      {"seed", bt_seed_neg, 2},
        {"stop", bt_stop_big, 2},        {"stop", bt_stop_vocab, 2},
        {"stream", bt_stream_int, 2},    {"priority", bt_prio_str, 2},
        {"priority", bt_prio_huge, 2},   {"seq", bt_seq_unknown, 2},
        {"seq", bt_seq_str, 2},
    };
    int fd = sv->fd[0] = kh_connect(g_kvd.sock);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kh_req q;
        struct kh_reply *r = &sv->r;
        kh_req_begin(&q, "generate", 100 + i, cases[i].n);
        cases[i].pack(&q.pk);
        assert_int_equal(kh_req_send(fd, &q), 0);
        assert_int_equal(kh_recv(fd, r), 0);
        /* an unknown handle is not_found, as in every other op */
        int want = cases[i].pack == bt_seq_unknown ? KVD_ENOTFOUND : KVD_EBADREQ;
        if (r->code != want || !strstr(r->message, cases[i].field))
            fail_msg("case %zu (%s): code %d message '%s'", i, cases[i].field, r->code, r->message);
        kh_reply_free(r);
    }
    /* The connection is still usable. */
    struct kh_reply *r = &sv->r;
    assert_int_equal(send_gen(fd, 999, ok_toks, 2, 3, false), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    assert_int_equal(r->code, 0);
    kh_reply_free(r);
    sv_close(sv, 0);
}

static void test_kvctl_generate(void **state)
{
    (void)state;
    const char *kvctl = getenv("KVCTL_BIN");
    if (!kvctl)
        skip();
    char cmd[512], line[512] = "";
    snprintf(cmd, sizeof(cmd), "'%s' --socket '%s' generate --tokens 1,2,3 --max-tokens 8", kvctl,
             g_kvd.sock);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    assert_non_null(fgets(line, sizeof(line), f));
    char extra[8];
    assert_null(fgets(extra, sizeof(extra), f)); /* exactly one line */
    assert_int_equal(pclose(f), 0);
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(line, ",\n", &save); t; t = strtok_r(NULL, ",\n", &save)) {
        char *end;
        long v = strtol(t, &end, 10);
        assert_true(*end == 0 && v >= 0 && v < 256);
        n++;
    }
    assert_int_equal(n, 8);
}

/* SIGTERM with requests in flight: each gets its reply (cancelled) before
 * kvd exits 0. Uses its own daemon. */
static void test_sigterm_answers(void **state)
{
    struct tstate *sv = *state;
    const char *args[] = {"--model", g_model, "--backend", "cpu", NULL};
    struct kh_proc *p = sv->p = kh_new(NULL, args);
    assert_non_null(p);
    int fd = sv->fd[0] = kh_connect(p->sock);
    uint32_t t[20];
    for (int i = 0; i < 20; i++)
        t[i] = (uint32_t)i + 1;
    for (int i = 0; i < 6; i++)
        assert_int_equal(send_gen(fd, 1 + i, t, 20, 240, i == 0), 0);
    struct kh_reply *r = &sv->r;
    assert_int_equal(kh_recv(fd, r), 0); /* an event: generation is running */
    kh_reply_free(r);
    kill(p->pid, SIGTERM);
    int answered = 0;
    while (answered < 6) {
        assert_int_equal(kh_recv(fd, r), 0);
        if (!kh_obj(r->root, "event")) {
            if (r->code == 0)
                assert_true(str_is(kh_obj(r->root, "finish_reason"), "cancelled") ||
                            str_is(kh_obj(r->root, "finish_reason"), "length"));
            else
                assert_int_equal(r->code, KVD_ECANCELLED);
            answered++;
        }
        kh_reply_free(r);
    }
    sv_close(sv, 0);
    assert_int_equal(kh_wait(p), 0);
    kh_cleanup_dir(p);
    sv->p = NULL;
    free(p);
}

static void test_store_mode_unsupported(void **state)
{
    struct tstate *sv = *state;
    struct kh_proc *p = sv->p = kh_new(NULL, NULL);
    assert_non_null(p);
    int fd = sv->fd[0] = kh_connect(p->sock);
    struct kh_reply *r = &sv->r;
    assert_int_equal(send_gen(fd, 1, ok_toks, 2, 3, false), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    assert_int_equal(r->code, KVD_EUNSUPPORTED);
    kh_reply_free(r);
    sv_close(sv, 0);
    sv->p = NULL;
    assert_int_equal(kh_free(p), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hello_model, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_generate_cached, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_stream_and_cancel, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_disconnect_frees, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_malformed, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_kvctl_generate, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_sigterm_answers, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_store_mode_unsupported, t_setup, t_teardown),
    };
    if (!getenv("KVD_TOOLS_DIR") || !getenv("KVD_BIN")) {
        fprintf(stderr, "KVD_TOOLS_DIR / KVD_BIN not set (run through ctest)\n");
        return 77;
    }
    const struct CMUnitTest q8_0[] = {
        cmocka_unit_test_setup_teardown(test_hello_model, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_generate_cached, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_stream_and_cancel, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_kvctl_generate, t_setup, t_teardown),
    };
    int failed = cmocka_run_group_tests(tests, group_setup, group_teardown);
    return failed + cmocka_run_group_tests_name("q8_0 KV", q8_0, group_setup_q8_0, group_teardown);
}
