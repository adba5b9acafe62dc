/* The sampler chain's request fields against a real kvd (cpu backend, a
 * small random model), over msgpack and the HTTP API (curl): logit_bias
 * (map and array forms; +100 forces a token, -100 bans one), the host pick
 * (any host-only stage) gives the same tokens as the backend's sample op
 * for the same seed, a penalized request batched with a plain one leaves
 * the plain one's tokens alone, strong penalties stop a greedy loop, the
 * HTTP fields equal msgpack's, and every bad value is refused naming its
 * field (msgpack: in the message; HTTP: 400 with `param`). Skipped (77)
 * without curl (the HTTP part). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "http_post.h"
#include "kvd_harness.h"

#define N_GEN 24
#define VOCAB 512

static char g_dir[64], g_model[128];
static struct kh_proc *g_d;
static uint64_t g_id;
static const uint32_t g_prompt[] = {11, 12, 13, 14, 15, 16};

/* One extra generate argument. */
enum gkind { G_DOUBLE, G_INT, G_STR, G_BIAS_MAP, G_BIAS_ARRAY };
struct gopt {
    const char *key;
    enum gkind kind;
    double d;
    int64_t i;
    const char *s;
    size_t n_bias;
    uint32_t ids[4];
    double bias[4];
};

static void pack_opt(msgpack_packer *pk, const struct gopt *o)
{
    proto_pack_str(pk, o->key);
    switch (o->kind) {
    case G_DOUBLE:
        msgpack_pack_double(pk, o->d);
        break;
    case G_INT:
        msgpack_pack_int64(pk, o->i);
        break;
    case G_STR:
        proto_pack_str(pk, o->s);
        break;
    case G_BIAS_MAP:
        proto_pack_map(pk, o->n_bias);
        for (size_t k = 0; k < o->n_bias; k++) {
            msgpack_pack_uint32(pk, o->ids[k]);
            msgpack_pack_double(pk, o->bias[k]);
        }
        break;
    case G_BIAS_ARRAY:
        proto_pack_array(pk, o->n_bias);
        for (size_t k = 0; k < o->n_bias; k++) {
            proto_pack_array(pk, 2);
            msgpack_pack_uint32(pk, o->ids[k]);
            msgpack_pack_double(pk, o->bias[k]);
        }
        break;
    }
}

struct gen_out {
    uint32_t toks[N_GEN];
    size_t n;
    int code;
    char message[256];
};

static void send_gen(int fd, uint64_t id, double temperature, uint64_t seed, const struct gopt *o,
                     size_t n_o)
{
    struct kh_req q;
    kh_req_begin(&q, "generate", id, 6 + n_o);
    proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, sizeof g_prompt / sizeof g_prompt[0]);
    proto_pack_kv_uint(&q.pk, "max_tokens", N_GEN);
    proto_pack_kv_double(&q.pk, "temperature", temperature);
    proto_pack_kv_uint(&q.pk, "seed", seed);
    proto_pack_kv_uint(&q.pk, "top_k", 50);
    proto_pack_kv_bool(&q.pk, "ignore_eos", true);
    for (size_t i = 0; i < n_o; i++)
        pack_opt(&q.pk, &o[i]);
    assert_int_equal(kh_req_send(fd, &q), 0);
}

static void read_gen(const struct kh_reply *r, struct gen_out *out)
{
    out->code = r->code;
    snprintf(out->message, sizeof out->message, "%s", r->message);
    out->n = 0;
    if (r->code)
        return;
    const msgpack_object *t = kh_obj(r->root, "tokens");
    out->n = t->via.array.size;
    assert_true(out->n <= N_GEN);
    for (size_t i = 0; i < out->n; i++)
        out->toks[i] = (uint32_t)t->via.array.ptr[i].via.u64;
}

static void gen(double temperature, uint64_t seed, const struct gopt *o, size_t n_o,
                struct gen_out *out)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    send_gen(fd, ++g_id, temperature, seed, o, n_o);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    read_gen(&r, out);
    kh_reply_free(&r);
    close(fd);
}

static void gen_ok(double temperature, uint64_t seed, const struct gopt *o, size_t n_o,
                   struct gen_out *out)
{
    gen(temperature, seed, o, n_o, out);
    if (out->code)
        fail_msg("generate failed (%d): %s", out->code, out->message);
    assert_int_equal(out->n, N_GEN);
}

static int setup(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-smp.XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof g_model, "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 128 --heads 4 --kv-heads 2 --ff 256 "
             "--vocab %d --ctx 1024 --seed 7 --chat-template %s/tests/text/templates/chatml.jinja"
             " >/dev/null",
             tools, g_model, VOCAB, KVD_SOURCE_DIR);
    if (system(cmd) != 0)
        return -1;
    char sock[128];
    snprintf(sock, sizeof sock, "%s/http.sock", g_dir);
    const char *const args[] = {
        "--backend", "cpu", "--model", g_model, "--http-socket", sock, "--no-roofline-probe", NULL};
    g_d = kh_new(NULL, args);
    return g_d ? 0 : -1;
}

static int teardown(void **state)
{
    int st = kh_free(g_d);
    unlink(g_model);
    char body[128];
    snprintf(body, sizeof body, "%s/body.json", g_dir);
    unlink(body);
    rmdir(g_dir);
    return st == 0 ? 0 : -1;
}

/* A bias of 0 changes no logit but takes the step to the host pick: the
 * same tokens as the backend's sample op, greedy and seeded. */
static void test_host_pick_equals_backend(void **state)
{
    struct gopt zero = {.key = "logit_bias", .kind = G_BIAS_MAP, .n_bias = 1, .ids = {0}};
    struct gopt typ1 = {.key = "typical_p", .kind = G_DOUBLE, .d = 1.0};
    for (int k = 0; k < 3; k++) {
        double temp = k == 0 ? 0 : k == 1 ? 0.8 : 1.5;
        struct gen_out a, b, c;
        gen_ok(temp, 42 + k, NULL, 0, &a);
        gen_ok(temp, 42 + k, &zero, 1, &b);
        gen_ok(temp, 42 + k, &typ1, 1, &c); /* 1: off, on the backend */
        assert_memory_equal(a.toks, b.toks, sizeof a.toks);
        assert_memory_equal(a.toks, c.toks, sizeof a.toks);
    }
}

static void test_logit_bias(void **state)
{
    struct gen_out ref, o;
    gen_ok(0, 1, NULL, 0, &ref);
    /* +100 forces the token, in both forms */
    struct gopt force = {
        .key = "logit_bias", .kind = G_BIAS_MAP, .n_bias = 1, .ids = {7}, .bias = {100}};
    gen_ok(0, 1, &force, 1, &o);
    for (size_t i = 0; i < o.n; i++)
        assert_int_equal(o.toks[i], 7);
    force.kind = G_BIAS_ARRAY;
    gen_ok(1.0, 1, &force, 1, &o);
    for (size_t i = 0; i < o.n; i++)
        assert_int_equal(o.toks[i], 7);
    /* -100 bans: plain greedy's first two tokens never appear */
    struct gopt ban = {.key = "logit_bias",
                       .kind = G_BIAS_ARRAY,
                       .n_bias = 2,
                       .ids = {ref.toks[0], ref.toks[1]},
                       .bias = {-100, -100}};
    gen_ok(0, 1, &ban, 1, &o);
    for (size_t i = 0; i < o.n; i++)
        assert_true(o.toks[i] != ref.toks[0] && o.toks[i] != ref.toks[1]);
    /* sampling too */
    gen_ok(2.0, 3, &ban, 1, &o);
    for (size_t i = 0; i < o.n; i++)
        assert_true(o.toks[i] != ref.toks[0] && o.toks[i] != ref.toks[1]);
}

static size_t distinct(const struct gen_out *o)
{
    size_t d = 0;
    for (size_t i = 0; i < o->n; i++) {
        size_t j = 0;
        while (j < i && o->toks[j] != o->toks[i])
            j++;
        d += j == i;
    }
    return d;
}

/* A bias of +3 on token 7 makes greedy repeat it; strong penalties over
 * the whole context then make every generated token new; a window of 0
 * turns them off. */
static void test_penalties(void **state)
{
    struct gopt pen[5] = {
        {.key = "logit_bias", .kind = G_BIAS_MAP, .n_bias = 1, .ids = {7}, .bias = {3}},
        {.key = "repeat_penalty", .kind = G_DOUBLE, .d = 100},
        {.key = "presence_penalty", .kind = G_DOUBLE, .d = 2},
        {.key = "frequency_penalty", .kind = G_DOUBLE, .d = 2},
        {.key = "repeat_last_n", .kind = G_INT, .i = -1},
    };
    struct gen_out ref, o;
    gen_ok(0, 1, pen, 1, &ref);
    size_t sevens = 0;
    for (size_t i = 0; i < ref.n; i++)
        sevens += ref.toks[i] == 7;
    print_message("  greedy, bias only: %zu distinct of %d, %zu sevens\n", distinct(&ref), N_GEN,
                  sevens);
    assert_true(sevens > N_GEN / 2);
    gen_ok(0, 1, pen, 5, &o);
    assert_int_equal(distinct(&o), N_GEN);
    for (size_t i = 0; i < o.n; i++)
        for (size_t j = 0; j < sizeof g_prompt / sizeof g_prompt[0]; j++)
            assert_true(o.toks[i] != g_prompt[j]); /* the prompt is in the window */
    pen[4].i = 0;
    gen_ok(0, 1, pen, 5, &o);
    assert_memory_equal(o.toks, ref.toks, sizeof o.toks);
    gen_ok(0, 1, NULL, 0, &ref);
    /* min_p 1 keeps only the most likely: greedy at any temperature */
    struct gopt mp = {.key = "min_p", .kind = G_DOUBLE, .d = 1.0};
    gen_ok(1.5, 9, &mp, 1, &o);
    assert_memory_equal(o.toks, ref.toks, sizeof o.toks);
}

/* A penalized request and a plain one in the same steps (pipelined on one
 * connection): the plain one's tokens are its tokens alone. */
static void test_batched_with_plain(void **state)
{
    struct gopt pen[2] = {{.key = "presence_penalty", .kind = G_DOUBLE, .d = 1.5},
                          {.key = "min_p", .kind = G_DOUBLE, .d = 0.05}};
    struct gen_out plain, solo_pen, a, b;
    gen_ok(0.9, 5, NULL, 0, &plain);
    gen_ok(0.9, 6, pen, 2, &solo_pen);
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    uint64_t ida = ++g_id, idb = ++g_id;
    send_gen(fd, ida, 0.9, 5, NULL, 0);
    send_gen(fd, idb, 0.9, 6, pen, 2);
    for (int k = 0; k < 2; k++) {
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        read_gen(&r, r.id == ida ? &a : &b);
        kh_reply_free(&r);
    }
    close(fd);
    assert_int_equal(a.code, 0);
    assert_int_equal(b.code, 0);
    assert_memory_equal(a.toks, plain.toks, sizeof a.toks);
    assert_memory_equal(b.toks, solo_pen.toks, sizeof b.toks);
}

static void expect_bad(const struct gopt *o, const char *field)
{
    struct gen_out out;
    gen(0, 1, o, 1, &out);
    if (out.code != KVD_EBADREQ || !strstr(out.message, field))
        fail_msg("%s: code %d, message '%s'", field, out.code, out.message);
}

static void test_bad_values(void **state)
{
    const struct gopt bad[] = {
        {.key = "min_p", .kind = G_DOUBLE, .d = 1.5},
        {.key = "min_p", .kind = G_DOUBLE, .d = -0.1},
        {.key = "typical_p", .kind = G_DOUBLE, .d = 0},
        {.key = "typical_p", .kind = G_DOUBLE, .d = 1.01},
        {.key = "repeat_penalty", .kind = G_DOUBLE, .d = 0},
        {.key = "repeat_penalty", .kind = G_DOUBLE, .d = 101},
        {.key = "repeat_last_n", .kind = G_INT, .i = -2},
        {.key = "repeat_last_n", .kind = G_INT, .i = 1025},
        {.key = "presence_penalty", .kind = G_DOUBLE, .d = 2.5},
        {.key = "frequency_penalty", .kind = G_DOUBLE, .d = -2.5},
        {.key = "presence_penalty", .kind = G_STR, .s = "high"},
        {.key = "logit_bias", .kind = G_STR, .s = "x"},
        {.key = "logit_bias", .kind = G_BIAS_MAP, .n_bias = 1, .ids = {VOCAB}, .bias = {1}},
        {.key = "logit_bias", .kind = G_BIAS_MAP, .n_bias = 1, .ids = {5}, .bias = {100.5}},
        {.key = "logit_bias", .kind = G_BIAS_ARRAY, .n_bias = 1, .ids = {5}, .bias = {-101}},
        {.key = "logit_bias", .kind = G_BIAS_ARRAY, .n_bias = 2, .ids = {5, 5}, .bias = {1, 2}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_bad(&bad[i], bad[i].key);
    /* an array entry that is not [id, bias] */
    int fd = kh_connect(g_d->sock);
    struct kh_req q;
    kh_req_begin(&q, "generate", ++g_id, 2);
    proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, 2);
    proto_pack_str(&q.pk, "logit_bias");
    proto_pack_array(&q.pk, 1);
    proto_pack_array(&q.pk, 3);
    for (int k = 0; k < 3; k++)
        msgpack_pack_uint32(&q.pk, 1);
    assert_int_equal(kh_req_send(fd, &q), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "logit_bias"));
    kh_reply_free(&r);
    close(fd);
}

/* ---- HTTP ---------------------------------------------------------------- */

static json_t *completion(const char *extra, int want_status)
{
    char body[1024];
    snprintf(body, sizeof body,
             "{\"prompt\":[11,12,13,14,15,16],\"max_tokens\":%d,\"temperature\":0,"
             "\"ignore_eos\":true%s}",
             N_GEN, extra);
    int st;
    char *out = http_post(g_dir, NULL, "/v1/completions", body, &st);
    json_error_t je;
    json_t *j = json_loads(out, JSON_ALLOW_NUL, &je);
    char head[512];
    snprintf(head, sizeof head, "%s", out);
    free(out);
    if (st != want_status)
        fail_msg("HTTP %d, expected %d: %s", st, want_status, head);
    if (!j)
        fail_msg("not JSON: %s", head);
    return j;
}

static void http_tokens(json_t *j, struct gen_out *o)
{
    json_t *t = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "tokens");
    o->n = json_array_size(t);
    assert_int_equal(o->n, N_GEN);
    for (size_t i = 0; i < o->n; i++)
        o->toks[i] = (uint32_t)json_integer_value(json_array_get(t, i));
}

static void test_http_fields(void **state)
{
    if (system("curl --version >/dev/null 2>&1") != 0)
        skip();
    struct gen_out m, h;
    /* the same fields give msgpack's tokens */
    struct gopt pen[4] = {
        {.key = "presence_penalty", .kind = G_DOUBLE, .d = 0.5},
        {.key = "frequency_penalty", .kind = G_DOUBLE, .d = 0.25},
        {.key = "repeat_penalty", .kind = G_DOUBLE, .d = 1.2},
        {.key = "logit_bias", .kind = G_BIAS_MAP, .n_bias = 2, .ids = {3, 9}, .bias = {2, -100}},
    };
    gen_ok(0, 1, pen, 4, &m);
    json_t *j = completion(",\"presence_penalty\":0.5,\"frequency_penalty\":0.25,"
                           "\"repeat_penalty\":1.2,\"logit_bias\":{\"3\":2,\"9\":-100}",
                           200);
    http_tokens(j, &h);
    json_decref(j);
    assert_memory_equal(m.toks, h.toks, sizeof m.toks);
    j = completion(",\"logit_bias\":{\"7\":100}", 200);
    http_tokens(j, &h);
    json_decref(j);
    for (size_t i = 0; i < h.n; i++)
        assert_int_equal(h.toks[i], 7);
    /* the chat endpoint reads them too: token 7 forced, four times */
    char body[512];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4,"
             "\"temperature\":0,\"ignore_eos\":true,\"logit_bias\":{\"7\":100}}");
    int st;
    char *out = http_post(g_dir, NULL, "/v1/chat/completions", body, &st);
    json_error_t je;
    j = json_loads(out, JSON_ALLOW_NUL, &je);
    free(out);
    assert_int_equal(st, 200);
    assert_non_null(j);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 4);
    json_decref(j);
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4,"
             "\"presence_penalty\":-3}");
    out = http_post(g_dir, NULL, "/v1/chat/completions", body, &st);
    j = json_loads(out, JSON_ALLOW_NUL, &je);
    free(out);
    assert_int_equal(st, 400);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "param")),
                        "presence_penalty");
    json_decref(j);

    static const struct {
        const char *extra, *param;
    } bad[] = {
        {",\"presence_penalty\":3", "presence_penalty"},
        {",\"frequency_penalty\":-2.5", "frequency_penalty"},
        {",\"repeat_penalty\":0", "repeat_penalty"},
        {",\"repeat_last_n\":-5", "repeat_last_n"},
        {",\"min_p\":2", "min_p"},
        {",\"typical_p\":0", "typical_p"},
        {",\"logit_bias\":[1,2]", "logit_bias"},
        {",\"logit_bias\":{\"abc\":1}", "logit_bias"},
        {",\"logit_bias\":{\"-1\":1}", "logit_bias"},
        {",\"logit_bias\":{\"5\":200}", "logit_bias"},
        {",\"logit_bias\":{\"5\":\"x\"}", "logit_bias"},
        {",\"logit_bias\":{\"100000\":1}", "logit_bias"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        j = completion(bad[i].extra, 400);
        json_t *e = json_object_get(j, "error");
        const char *p = json_string_value(json_object_get(e, "param"));
        if (!p || strcmp(p, bad[i].param))
            fail_msg("%s: param %s", bad[i].extra, p ? p : "(none)");
        json_decref(j);
    }
}

/* ---- logprobs ------------------------------------------------------------ */

/* One token's entry: the chosen token's logprob and n tops, most likely
 * first, exp of the tops summing to <= 1, the chosen one no likelier than
 * the first and, when at least the last's, among them with the same value;
 * greedy: the chosen token is the first. */
static void check_lp(uint32_t tok, uint32_t id, double lp, const uint32_t *tid, const double *tlp,
                     size_t n, size_t want_n, bool greedy)
{
    assert_int_equal(id, tok);
    assert_int_equal(n, want_n);
    assert_true(lp <= 0);
    double sum = 0;
    bool found = false;
    for (size_t k = 0; k < n; k++) {
        sum += exp(tlp[k]);
        if (k)
            assert_true(tlp[k] <= tlp[k - 1]);
        if (tid[k] == tok) {
            found = true;
            assert_true(fabs(tlp[k] - lp) < 1e-9);
        }
    }
    assert_true(sum <= 1.0 + 1e-6);
    if (n) {
        assert_true(lp <= tlp[0] + 1e-9);
        assert_true(found || lp < tlp[n - 1] + 1e-9);
    }
    if (greedy && n)
        assert_int_equal(tid[0], tok);
}

/* A msgpack "logprobs" array against tokens. */
static void check_mp_lp(const msgpack_object *lps, const uint32_t *toks, size_t n, size_t top,
                        bool greedy)
{
    assert_non_null(lps);
    assert_int_equal(lps->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(lps->via.array.size, n);
    for (size_t i = 0; i < n; i++) {
        const msgpack_object *e = &lps->via.array.ptr[i];
        const msgpack_object *t = kh_obj(e, "top");
        uint32_t tid[20];
        double tlp[20];
        assert_true(t->via.array.size <= 20);
        for (size_t k = 0; k < t->via.array.size; k++) {
            tid[k] = (uint32_t)t->via.array.ptr[k].via.array.ptr[0].via.u64;
            tlp[k] = t->via.array.ptr[k].via.array.ptr[1].via.f64;
        }
        check_lp(toks[i], (uint32_t)kh_obj(e, "id")->via.u64, kh_obj(e, "logprob")->via.f64, tid,
                 tlp, t->via.array.size, top, greedy);
    }
}

/* msgpack: greedy and sampled, plain and with a host-only stage, streamed
 * (the events' entries are the reply's) and not; the tokens are those of
 * the same request without logprobs; a bad count is refused. */
static void test_logprobs_msgpack(void **state)
{
    struct gopt lp20 = {.key = "logprobs", .kind = G_INT, .i = 20};
    struct gopt host[2] = {{.key = "logprobs", .kind = G_INT, .i = 5},
                           {.key = "repeat_penalty", .kind = G_DOUBLE, .d = 1.3}};
    for (int k = 0; k < 4; k++) {
        double temp = k & 1 ? 1.0 : 0;
        const struct gopt *o = k < 2 ? &lp20 : host;
        size_t n_o = k < 2 ? 1 : 2, top = k < 2 ? 20 : 5;
        struct gen_out ref, got;
        gen_ok(temp, 5 + k, o + 1, n_o - 1, &ref); /* the same without logprobs */
        int fd = kh_connect(g_d->sock);
        assert_true(fd >= 0);
        struct kh_req q;
        kh_req_begin(&q, "generate", ++g_id, 7 + n_o);
        proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, sizeof g_prompt / sizeof g_prompt[0]);
        proto_pack_kv_uint(&q.pk, "max_tokens", N_GEN);
        proto_pack_kv_double(&q.pk, "temperature", temp);
        proto_pack_kv_uint(&q.pk, "seed", 5 + k);
        proto_pack_kv_uint(&q.pk, "top_k", 50);
        proto_pack_kv_bool(&q.pk, "ignore_eos", true);
        proto_pack_kv_bool(&q.pk, "stream", k >= 2);
        for (size_t i = 0; i < n_o; i++)
            pack_opt(&q.pk, &o[i]);
        assert_int_equal(kh_req_send(fd, &q), 0);
        size_t streamed = 0;
        uint32_t st_toks[N_GEN];
        struct kh_reply r;
        for (;;) {
            assert_int_equal(kh_recv(fd, &r), 0);
            const msgpack_object *ev = kh_obj(r.root, "event");
            if (!ev)
                break;
            const msgpack_object *t = kh_obj(r.root, "tokens");
            for (size_t i = 0; i < t->via.array.size; i++)
                st_toks[streamed + i] = (uint32_t)t->via.array.ptr[i].via.u64;
            check_mp_lp(kh_obj(r.root, "logprobs"), st_toks + streamed, t->via.array.size, top,
                        temp == 0);
            streamed += t->via.array.size;
            kh_reply_free(&r);
        }
        read_gen(&r, &got);
        if (got.code)
            fail_msg("generate failed: %s", got.message);
        assert_memory_equal(got.toks, ref.toks, sizeof got.toks);
        check_mp_lp(kh_obj(r.root, "logprobs"), got.toks, got.n, top, temp == 0);
        if (k >= 2) {
            assert_int_equal(streamed, N_GEN);
            assert_memory_equal(st_toks, got.toks, sizeof st_toks);
        }
        kh_reply_free(&r);
        close(fd);
    }
    struct gen_out o;
    struct gopt bad = {.key = "logprobs", .kind = G_INT, .i = 21};
    gen(0, 1, &bad, 1, &o);
    assert_int_not_equal(o.code, 0);
    assert_non_null(strstr(o.message, "logprobs"));
    bad.kind = G_STR, bad.s = "yes";
    gen(0, 1, &bad, 1, &o);
    assert_int_not_equal(o.code, 0);
}

/* One chat content entry / completions position: checked by check_lp
 * (chat: the token's text equals its bytes' decoding; ids by position in
 * the reply's "tokens"). */
static void check_chat_entry(json_t *e, uint32_t tok, size_t top, bool greedy, const char *tok0)
{
    json_t *tl = json_object_get(e, "top_logprobs");
    uint32_t tid[20];
    double tlp[20];
    size_t n = json_array_size(tl);
    assert_true(n <= 20);
    assert_true(json_is_array(json_object_get(e, "bytes")));
    for (size_t k = 0; k < n; k++) {
        json_t *a = json_array_get(tl, k);
        tlp[k] = json_real_value(json_object_get(a, "logprob"));
        assert_true(json_is_string(json_object_get(a, "token")));
        assert_true(json_is_array(json_object_get(a, "bytes")));
        /* an alternative with the chosen token's text and logprob is it */
        tid[k] = !strcmp(json_string_value(json_object_get(a, "token")),
                         json_string_value(json_object_get(e, "token"))) &&
                         tlp[k] == json_real_value(json_object_get(e, "logprob"))
                     ? tok
                     : UINT32_MAX;
    }
    if (greedy && n)
        assert_string_equal(json_string_value(json_object_get(json_array_get(tl, 0), "token")),
                            json_string_value(json_object_get(e, "token")));
    (void)tok0;
    check_lp(tok, tok, json_real_value(json_object_get(e, "logprob")), tid, tlp, n, top, false);
}

/* The data: lines of an SSE body as JSON chunks (NULL at [DONE]). */
static size_t sse_chunks(char *out, json_t **chunks, size_t cap)
{
    size_t n = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "data: ", 6) || !strcmp(line + 6, "[DONE]"))
            continue;
        json_error_t je;
        assert_true(n < cap);
        chunks[n] = json_loads(line + 6, JSON_ALLOW_NUL, &je);
        assert_non_null(chunks[n]);
        n++;
    }
    return n;
}

/* HTTP chat and completions, streamed and not, greedy and sampled. */
static void test_logprobs_http(void **state)
{
    if (system("curl --version >/dev/null 2>&1") != 0)
        skip();
    for (int k = 0; k < 8; k++) {
        bool chat = k & 1, stream = k & 2, greedy = !(k & 4);
        size_t top = stream ? 5 : 20;
        char body[1024];
        if (chat)
            snprintf(body, sizeof body,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":%d,"
                     "\"temperature\":%s,\"seed\":3,\"ignore_eos\":true,\"stream\":%s,"
                     "\"logprobs\":true,\"top_logprobs\":%zu}",
                     N_GEN, greedy ? "0" : "1", stream ? "true" : "false", top);
        else
            snprintf(body, sizeof body,
                     "{\"prompt\":[11,12,13,14,15,16],\"max_tokens\":%d,\"temperature\":%s,"
                     "\"seed\":3,\"ignore_eos\":true,\"stream\":%s,\"logprobs\":%zu}",
                     N_GEN, greedy ? "0" : "1", stream ? "true" : "false", top);
        int st;
        char *out =
            http_post(g_dir, NULL, chat ? "/v1/chat/completions" : "/v1/completions", body, &st);
        if (st != 200)
            fail_msg("HTTP %d: %.300s", st, out);
        json_t *chunks[64];
        size_t n_chunks;
        if (stream) {
            n_chunks = sse_chunks(out, chunks, 64);
        } else {
            json_error_t je;
            chunks[0] = json_loads(out, JSON_ALLOW_NUL, &je);
            assert_non_null(chunks[0]);
            n_chunks = 1;
        }
        free(out);
        size_t n_tok = 0, off = 0;
        for (size_t c = 0; c < n_chunks; c++) {
            json_t *ch = json_array_get(json_object_get(chunks[c], "choices"), 0);
            if (!ch)
                continue; /* a usage chunk */
            json_t *holder = chat ? json_object_get(ch, stream ? "delta" : "message") : ch;
            json_t *toks = json_object_get(holder, "tokens");
            json_t *lp = json_object_get(ch, "logprobs");
            size_t nt = json_array_size(toks);
            if (nt == 0) {
                assert_true(json_is_null(lp));
                continue;
            }
            if (chat) {
                json_t *content = json_object_get(lp, "content");
                assert_int_equal(json_array_size(content), nt);
                for (size_t i = 0; i < nt; i++)
                    check_chat_entry(json_array_get(content, i),
                                     (uint32_t)json_integer_value(json_array_get(toks, i)), top,
                                     greedy, NULL);
            } else {
                json_t *ts = json_object_get(lp, "tokens"),
                       *tl = json_object_get(lp, "token_logprobs"),
                       *tt = json_object_get(lp, "top_logprobs"),
                       *to = json_object_get(lp, "text_offset");
                assert_int_equal(json_array_size(ts), nt);
                assert_int_equal(json_array_size(tl), nt);
                assert_int_equal(json_array_size(tt), nt);
                assert_int_equal(json_array_size(to), nt);
                for (size_t i = 0; i < nt; i++) {
                    /* byte offsets of the pieces: from 0, growing, across chunks too */
                    size_t o = (size_t)json_integer_value(json_array_get(to, i));
                    assert_true(n_tok + i > 0 ? o >= off : o == 0);
                    off = o;
                    json_t *m = json_array_get(tt, i);
                    double lpv = json_real_value(json_array_get(tl, i)), best = -1e30, sum = 0;
                    const char *key;
                    json_t *v;
                    assert_true(json_object_size(m) >= 1 && json_object_size(m) <= top);
                    json_object_foreach(m, key, v)
                    {
                        sum += exp(json_real_value(v));
                        best = json_real_value(v) > best ? json_real_value(v) : best;
                    }
                    assert_true(sum <= 1.0 + 1e-6);
                    assert_true(lpv <= best + 1e-9);
                    if (greedy)
                        assert_true(fabs(lpv - best) < 1e-9);
                }
            }
            n_tok += nt;
        }
        assert_int_equal(n_tok, N_GEN);
        for (size_t c = 0; c < n_chunks; c++)
            json_decref(chunks[c]);
    }
    /* not asked: null; bad values: 400 naming the field */
    json_t *j = completion("", 200);
    assert_true(json_is_null(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs")));
    json_decref(j);
    j = completion(",\"logprobs\":21", 400);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "param")),
                        "logprobs");
    json_decref(j);
}

/* ---- grammars ------------------------------------------------------------ */

/* A greedy or seeded generate under a GBNF grammar; the reply's text and
 * finish_reason, or the error. */
struct gram_out {
    int code;
    char message[256];
    char text[512];
    char finish[16];
    size_t n;
};

static void gen_grammar(const char *grammar, double temperature, uint64_t seed,
                        struct gram_out *out)
{
    struct gopt o = {.key = "grammar", .kind = G_STR, .s = grammar};
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    send_gen(fd, ++g_id, temperature, seed, &o, 1);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    memset(out, 0, sizeof *out);
    out->code = r.code;
    snprintf(out->message, sizeof out->message, "%s", r.message);
    if (!r.code) {
        const msgpack_object *t = kh_obj(r.root, "text");
        const msgpack_object *f = kh_obj(r.root, "finish_reason");
        assert_non_null(t);
        assert_non_null(f);
        snprintf(out->text, sizeof out->text, "%.*s", (int)t->via.str.size, t->via.str.ptr);
        snprintf(out->finish, sizeof out->finish, "%.*s", (int)f->via.str.size, f->via.str.ptr);
        out->n = kh_obj(r.root, "tokens")->via.array.size;
    }
    kh_reply_free(&r);
    close(fd);
}

/* Whether s is ("cat" | "dog") " " [0-9]{2} "!" */
static bool pet_text(const char *s)
{
    return strlen(s) == 7 && (!strncmp(s, "cat ", 4) || !strncmp(s, "dog ", 4)) && s[4] >= '0' &&
           s[4] <= '9' && s[5] >= '0' && s[5] <= '9' && s[6] == '!';
}

/* The model's output follows the grammar, greedy and sampled, and ends
 * (finish_reason "stop") as soon as the grammar's sentence is complete,
 * although ignore_eos is set and max_tokens is larger. */
static void test_grammar_follows(void **state)
{
    (void)state;
    const char *g = "root ::= (\"cat\" | \"dog\") \" \" [0-9]{2} \"!\"\n";
    struct gram_out o;
    gen_grammar(g, 0, 1, &o);
    if (o.code)
        fail_msg("generate failed: %s", o.message);
    if (!pet_text(o.text))
        fail_msg("greedy output '%s' does not follow the grammar", o.text);
    assert_string_equal(o.finish, "stop");
    assert_true(o.n < N_GEN);
    for (uint64_t seed = 1; seed <= 8; seed++) {
        gen_grammar(g, 1.0, seed, &o);
        assert_int_equal(o.code, 0);
        if (!pet_text(o.text))
            fail_msg("seed %llu: output '%s' does not follow the grammar", (unsigned long long)seed,
                     o.text);
        assert_string_equal(o.finish, "stop");
    }
    /* An unbounded grammar runs to max_tokens, every byte within it. */
    gen_grammar("root ::= [a-z ]+\n", 1.0, 3, &o);
    assert_int_equal(o.code, 0);
    assert_string_equal(o.finish, "length");
    assert_int_equal(o.n, N_GEN);
    for (const char *p = o.text; *p; p++)
        assert_true((*p >= 'a' && *p <= 'z') || *p == ' ');
}

/* A grammar nothing in the vocabulary can continue ends the request with
 * an error that says so; a grammar that does not compile is refused before
 * any work, naming the grammar. */
static void test_grammar_errors(void **state)
{
    (void)state;
    struct gram_out o;
    /* The byte token <0x00> has an empty piece: NUL can never follow. */
    gen_grammar("root ::= \"a\" [\\x00]\n", 0, 1, &o);
    assert_int_equal(o.code, KVD_EBADREQ);
    assert_non_null(strstr(o.message, "no token of the vocabulary can continue"));
    gen_grammar("root ::= undefined-rule\n", 0, 1, &o);
    assert_int_equal(o.code, KVD_EBADREQ);
    assert_non_null(strstr(o.message, "undefined rule 'undefined-rule'"));
    gen_grammar("root ::= root \"a\"\n", 0, 1, &o);
    assert_int_equal(o.code, KVD_EBADREQ);
    assert_non_null(strstr(o.message, "left recursion"));

    int st;
    char *out = http_post(g_dir, NULL, "/v1/completions",
                          "{\"prompt\":[11,12],\"max_tokens\":4,\"grammar\":\"root ::= (\"}", &st);
    assert_int_equal(st, 400);
    json_t *j = json_loads(out, 0, NULL);
    free(out);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "param")),
                        "grammar");
    json_decref(j);
    out = http_post(g_dir, NULL, "/v1/completions",
                    "{\"prompt\":[11,12],\"max_tokens\":4,\"grammar\":7}", &st);
    assert_int_equal(st, 400);
    free(out);
}

/* HTTP's grammar field gives msgpack's text for the same greedy request. */
static void test_grammar_http(void **state)
{
    (void)state;
    const char *g = "root ::= (\"cat\" | \"dog\") \" \" [0-9]{2} \"!\"\n";
    struct gram_out o;
    gen_grammar(g, 0, 1, &o);
    assert_int_equal(o.code, 0);
    json_t *j = completion(
        ",\"top_k\":50,\"grammar\":\"root ::= (\\\"cat\\\" | \\\"dog\\\") \\\" \\\" [0-9]{2} "
        "\\\"!\\\"\\n\"",
        200);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), o.text);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
    json_decref(j);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_pick_equals_backend),
        cmocka_unit_test(test_logit_bias),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_batched_with_plain),
        cmocka_unit_test(test_bad_values),
        cmocka_unit_test(test_http_fields),
        cmocka_unit_test(test_logprobs_msgpack),
        cmocka_unit_test(test_logprobs_http),
        cmocka_unit_test(test_grammar_follows),
        cmocka_unit_test(test_grammar_errors),
        cmocka_unit_test(test_grammar_http),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
