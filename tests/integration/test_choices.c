/* n > 1 choices against a real kvd (cpu backend, a small random model):
 * the prompt is computed once (stats' prefill tokens grow by the prompt
 * alone) and its blocks shared by copy-on-write forks; choice i equals a
 * single run with seed + i, msgpack and HTTP, streamed (interleaved events
 * carrying the choice) and not; usage counts the prompt once; cancel and a
 * disconnect end every choice; max-queued-per-tenant counts choices; n
 * with seq or out of range is refused. HTTP parts skipped without curl. */
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
#include <jansson.h>

#include "http_post.h"
#include "kvd_harness.h"

#define N 4
#define N_GEN 16
#define N_PROMPT 70 /* several blocks */
#define SEED 100

static char g_dir[64], g_model[128];
static struct kh_proc *g_d;
static bool g_curl;
static uint32_t g_prompt[N_PROMPT];

struct choice {
    uint32_t toks[N_GEN];
    size_t n;
};

static void send_gen(int fd, uint64_t id, uint64_t n, uint64_t seed, bool stream, uint32_t max)
{
    struct kh_req q;
    kh_req_begin(&q, "generate", id, 7);
    proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, N_PROMPT);
    proto_pack_kv_uint(&q.pk, "max_tokens", max);
    proto_pack_kv_double(&q.pk, "temperature", 0.9);
    proto_pack_kv_uint(&q.pk, "seed", seed);
    proto_pack_kv_bool(&q.pk, "ignore_eos", true);
    proto_pack_kv_bool(&q.pk, "stream", stream);
    proto_pack_kv_uint(&q.pk, "n", n);
    assert_int_equal(kh_req_send(fd, &q), 0);
}

static void read_toks(const msgpack_object *t, struct choice *c)
{
    for (uint32_t i = 0; i < t->via.array.size; i++) {
        assert_true(c->n < N_GEN);
        c->toks[c->n++] = (uint32_t)t->via.array.ptr[i].via.u64;
    }
}

/* One choice alone: n = 1 with seed. */
static void single(uint64_t seed, struct choice *c)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    send_gen(fd, 1, 1, seed, false, N_GEN);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    memset(c, 0, sizeof *c);
    read_toks(kh_obj(r.root, "tokens"), c);
    assert_int_equal(c->n, N_GEN);
    kh_reply_free(&r);
    close(fd);
}

static int setup(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    g_curl = system("curl --version >/dev/null 2>&1") == 0;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-choices.XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof g_model, "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 128 --heads 4 --kv-heads 2 --ff 256 "
             "--vocab 512 --ctx 1024 --seed 21 >/dev/null",
             tools, g_model);
    if (system(cmd) != 0)
        return -1;
    for (int i = 0; i < N_PROMPT; i++)
        g_prompt[i] = 3 + (uint32_t)(i * 37 % 500);
    char sock[128];
    snprintf(sock, sizeof sock, "%s/http.sock", g_dir);
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                g_model,
                                "--http-socket",
                                sock,
                                "--no-roofline-probe",
                                "--max-queued-per-tenant",
                                "6",
                                NULL};
    g_d = kh_new(NULL, args);
    return g_d ? 0 : -1;
}

static int teardown(void **state)
{
    int st = kh_free(g_d);
    char f[128];
    snprintf(f, sizeof f, "%s/body.json", g_dir);
    unlink(f);
    unlink(g_model);
    rmdir(g_dir);
    return st == 0 ? 0 : -1;
}

static void expect_equal(const struct choice *got, const struct choice *want, int i,
                         const char *how)
{
    if (got->n != want->n || memcmp(got->toks, want->toks, want->n * sizeof(uint32_t)))
        fail_msg("%s: choice %d differs from the single run with seed %d", how, i, SEED + i);
}

/* The reference: each choice alone (computed before the n = 4 runs, so
 * the first computes the whole prompt like them; the rest find its blocks
 * cached, computing its last rows only). */
static struct choice g_ref[N];

static void test_msgpack(void **state)
{
    for (int i = 0; i < N; i++)
        single(SEED + (uint64_t)i, &g_ref[i]);
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    /* a prompt nobody computed yet: the prefill counter shows it once */
    g_prompt[0] ^= 1;
    uint64_t before = kh_stat(fd, "requests", "prefill_tokens");
    send_gen(fd, 7, N, SEED, false, N_GEN);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    uint64_t after = kh_stat(fd, "requests", "prefill_tokens");
    assert_int_equal(after - before, N_PROMPT);
    const msgpack_object *u = kh_obj(r.root, "usage");
    assert_int_equal(kh_u64(u, "prompt"), N_PROMPT);
    assert_int_equal(kh_u64(u, "completion"), N * N_GEN);
    const msgpack_object *cs = kh_obj(r.root, "choices");
    assert_int_equal(cs->via.array.size, N);
    kh_reply_free(&r);
    g_prompt[0] ^= 1;
    /* the same prompt as the references: each choice equals its single run */
    send_gen(fd, 8, N, SEED, false, N_GEN);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    cs = kh_obj(r.root, "choices");
    for (int i = 0; i < N; i++) {
        const msgpack_object *c = &cs->via.array.ptr[i];
        assert_int_equal(kh_u64(c, "index"), i);
        struct choice got;
        memset(&got, 0, sizeof got);
        read_toks(kh_obj(c, "tokens"), &got);
        expect_equal(&got, &g_ref[i], i, "msgpack");
        const msgpack_object *f = kh_obj(c, "finish_reason");
        assert_int_equal(f->via.str.size, 6); /* "length" */
    }
    kh_reply_free(&r);
    /* streamed: events carry their choice, interleaved */
    send_gen(fd, 9, N, SEED, true, N_GEN);
    struct choice st[N];
    memset(st, 0, sizeof st);
    for (;;) {
        assert_int_equal(kh_recv(fd, &r), 0);
        if (kh_obj(r.root, "event")) {
            uint64_t ch = kh_u64(r.root, "choice");
            assert_true(ch < N);
            read_toks(kh_obj(r.root, "tokens"), &st[ch]);
            kh_reply_free(&r);
            continue;
        }
        kh_expect(&r, 0);
        kh_reply_free(&r);
        break;
    }
    for (int i = 0; i < N; i++)
        expect_equal(&st[i], &g_ref[i], i, "msgpack stream");
    close(fd);
}

static void http_body(char *b, size_t cap, bool stream)
{
    int n = snprintf(b, cap, "{\"prompt\":[");
    for (int i = 0; i < N_PROMPT; i++)
        n += snprintf(b + n, cap - (size_t)n, "%s%u", i ? "," : "", g_prompt[i]);
    snprintf(b + n, cap - (size_t)n,
             "],\"max_tokens\":%d,\"temperature\":0.9,\"seed\":%d,\"ignore_eos\":true,\"n\":%d,"
             "\"stream\":%s,\"stream_options\":{\"include_usage\":true}}",
             N_GEN, SEED, N, stream ? "true" : "false");
}

static void add_json_toks(json_t *a, struct choice *c)
{
    for (size_t i = 0; i < json_array_size(a); i++) {
        assert_true(c->n < N_GEN);
        c->toks[c->n++] = (uint32_t)json_integer_value(json_array_get(a, i));
    }
}

static void test_http(void **state)
{
    if (!g_curl)
        skip();
    char body[2048];
    int st;
    http_body(body, sizeof body, false);
    char *out = http_post(g_dir, NULL, "/v1/completions", body, &st);
    assert_int_equal(st, 200);
    json_t *o = json_loads(out, 0, NULL);
    assert_non_null(o);
    json_t *cs = json_object_get(o, "choices");
    assert_int_equal(json_array_size(cs), N);
    for (int i = 0; i < N; i++) {
        json_t *c = json_array_get(cs, (size_t)i);
        assert_int_equal(json_integer_value(json_object_get(c, "index")), i);
        struct choice got;
        memset(&got, 0, sizeof got);
        add_json_toks(json_object_get(c, "tokens"), &got);
        expect_equal(&got, &g_ref[i], i, "HTTP");
    }
    json_t *u = json_object_get(o, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), N_PROMPT);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), N * N_GEN);
    json_decref(o);
    free(out);
    /* streamed: chunks of every index, one finish per choice, then usage */
    http_body(body, sizeof body, true);
    out = http_post(g_dir, NULL, "/v1/completions", body, &st);
    assert_int_equal(st, 200);
    struct choice got[N];
    memset(got, 0, sizeof got);
    int finishes = 0, usage = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "data: {", 7))
            continue;
        json_t *ch = json_loads(line + 6, 0, NULL);
        assert_non_null(ch);
        usage += json_is_object(json_object_get(ch, "usage"));
        json_t *a = json_object_get(ch, "choices");
        for (size_t k = 0; k < json_array_size(a); k++) {
            json_t *c = json_array_get(a, k);
            json_int_t idx = json_integer_value(json_object_get(c, "index"));
            assert_true(idx >= 0 && idx < N);
            add_json_toks(json_object_get(c, "tokens"), &got[idx]);
            finishes += json_is_string(json_object_get(c, "finish_reason"));
        }
        json_decref(ch);
    }
    for (int i = 0; i < N; i++)
        expect_equal(&got[i], &g_ref[i], i, "HTTP stream");
    assert_int_equal(finishes, N);
    assert_int_equal(usage, 1);
    free(out);
}

/* Cancel ends every choice (one reply); a disconnect leaves nothing live. */
static void test_cancel_and_disconnect(void **state)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    send_gen(fd, 11, N, SEED, true, 900);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0); /* the first tokens event: it runs */
    assert_non_null(kh_obj(r.root, "event"));
    kh_reply_free(&r);
    struct kh_req q;
    kh_req_begin(&q, "cancel", 12, 1);
    proto_pack_kv_uint(&q.pk, "target", 11);
    assert_int_equal(kh_req_send(fd, &q), 0);
    bool final = false, cancel_reply = false;
    while (!final || !cancel_reply) {
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.id == 12) {
            cancel_reply = true;
        } else if (!kh_obj(r.root, "event")) {
            kh_expect(&r, 0);
            const msgpack_object *cs = kh_obj(r.root, "choices");
            assert_int_equal(cs->via.array.size, N);
            for (uint32_t i = 0; i < N; i++) {
                const msgpack_object *f = kh_obj(&cs->via.array.ptr[i], "finish_reason");
                assert_int_equal(f->via.str.size, 9); /* "cancelled" */
            }
            final = true;
        }
        kh_reply_free(&r);
    }
    /* a disconnect in the middle: every choice ends, nothing stays live */
    send_gen(fd, 13, N, SEED, true, 900);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_reply_free(&r);
    close(fd);
    fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    uint64_t live = 1;
    for (int k = 0; k < 1000 && live; k++) { /* bounded: at most 10 s */
        live = kh_stat(fd, "requests", "live");
        if (live)
            usleep(10000);
    }
    assert_int_equal(live, 0);
    close(fd);
}

/* max-queued-per-tenant (6 here) counts choices; n's range and n with seq
 * are refused naming n. */
static void test_limits(void **state)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    send_gen(fd, 21, 7, SEED, false, 4);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EBUSY);
    assert_non_null(strstr(r.message, "max-queued-per-tenant"));
    kh_reply_free(&r);
    send_gen(fd, 22, 6, SEED, false, 4); /* exactly the limit */
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    send_gen(fd, 23, 0, SEED, false, 4);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "'n'"));
    kh_reply_free(&r);
    uint64_t seq = kh_seq_open(fd, 24);
    struct kh_req q;
    kh_req_begin(&q, "generate", 25, 3);
    proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, 4);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "n", 2);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EUNSUPPORTED);
    kh_reply_free(&r);
    close(fd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_msgpack),
        cmocka_unit_test(test_http),
        cmocka_unit_test(test_cancel_and_disconnect),
        cmocka_unit_test(test_limits),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
