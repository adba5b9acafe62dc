/* generate with `session` (and HTTP's X-Kvd-Session) against a real kvd
 * serving a tiny random model with a disk tier: a conversation continued
 * request by request (tokens, text, none) is saved grown under its name,
 * served from its cached blocks, across a restart, with the tokens a plain
 * generate of the whole conversation gives on a daemon that never saw it;
 * streaming; sessions private to their tenant; chat completions with the
 * header; the bad requests and a daemon without a disk tier. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

#define BT 16
#define N_P 40
#define UID_B 60031
#define GID_ALL 65534

struct fixture {
    char tmp[64];
    char model[128];
    char disk[128];
    char http[128];
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    snprintf(f->tmp, sizeof f->tmp, "/tmp/kvd-sgen.XXXXXX");
    if (!mkdtemp(f->tmp))
        return -1;
    snprintf(f->model, sizeof f->model, "%s/m.gguf", f->tmp);
    snprintf(f->disk, sizeof f->disk, "%s/disk", f->tmp);
    snprintf(f->http, sizeof f->http, "%s/http.sock", f->tmp);
    const char *tools = getenv("KVD_TOOLS_DIR");
    const char *src = KVD_SOURCE_DIR;
    char cmd[1024];
    snprintf(
        cmd, sizeof cmd,
        "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
        "--vocab 4096 --ctx 4096 --seed 3 --chat-template %s/tests/text/templates/chatml.jinja "
        ">/dev/null",
        tools ? tools : ".", f->model, src);
    if (system(cmd) != 0)
        return -1;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "teardown: %s failed\n", cmd);
    free(f);
    return 0;
}

static int per_test(void **state)
{
    struct fixture *f = *state;
    char cmd[192];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->disk);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *const conf_tenants = "[admin]\nuids = 0\n[tenant:beta]\nuids = 60031\n";

/* A daemon on f's model; with_disk: a disk tier on f->disk and the HTTP
 * API on f->http. */
static void start(struct kh_proc *d, const struct fixture *f, bool with_disk)
{
    const char *const args_disk[] = {"--backend",
                                     "cpu",
                                     "--model",
                                     f->model,
                                     "--disk-dir",
                                     f->disk,
                                     "--disk-writeback-ms",
                                     "20",
                                     "--http-socket",
                                     f->http,
                                     "--socket-group",
                                     "nogroup",
                                     NULL};
    const char *const args_plain[] = {"--backend", "cpu", "--model", f->model, NULL};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_start(d, conf_tenants, with_disk ? args_disk : args_plain), 0);
}

static struct kvd_ctx *connect_to(const struct kh_proc *d)
{
    struct kvd_ctx *c = kvd_connect(d->sock);
    assert_non_null(c);
    assert_int_equal(c->err, 0);
    kvd_set_timeout(c, 120000);
    return c;
}

/* Greedy generate of max tokens, in session `session` when not NULL. */
static int gen(struct kvd_ctx *c, const uint32_t *p, size_t n, uint32_t max, const char *session,
               struct kvd_gen_result *res)
{
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = max;
    o.temperature = 0;
    o.ignore_eos = true;
    o.session = session;
    return kvd_generate(c, p, n, &o, res);
}

/* a ++ b into a fresh array (*n its length). */
static uint32_t *cat(const uint32_t *a, size_t na, const uint32_t *b, size_t nb, size_t *n)
{
    uint32_t *v = malloc(sizeof(uint32_t) * (na + nb + 1));
    assert_non_null(v);
    if (na)
        memcpy(v, a, sizeof(uint32_t) * na);
    if (nb)
        memcpy(v + na, b, sizeof(uint32_t) * nb);
    *n = na + nb;
    return v;
}

static void test_tokens_continue_across_restart(void **state)
{
    struct fixture *f = *state;
    uint32_t p[N_P], q[3] = {5, 6, 7};
    for (size_t i = 0; i < N_P; i++)
        p[i] = (uint32_t)(i * 37 + 11) % 4096;

    /* The references: plain generates of each whole conversation, on a
     * daemon with nothing cached. */
    struct kh_proc d;
    start(&d, f, false);
    struct kvd_ctx *c = connect_to(&d);
    struct kvd_gen_result g1, g2, g3, r;
    assert_int_equal(gen(c, p, N_P, 8, NULL, &g1), 0);
    size_t n12, n123;
    uint32_t *c1 = cat(p, N_P, g1.tokens, g1.n_tokens, &n12);
    uint32_t *c12 = cat(c1, n12, q, 3, &n12);
    assert_int_equal(gen(c, c12, n12, 8, NULL, &g2), 0);
    uint32_t *c123 = cat(c12, n12, g2.tokens, g2.n_tokens, &n123);
    assert_int_equal(gen(c, c123, n123, 4, NULL, &g3), 0);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);

    start(&d, f, true);
    c = connect_to(&d);
    /* A new session: the prompt alone, saved with the completion. */
    assert_int_equal(gen(c, p, N_P, 8, "chat-1", &r), 0);
    assert_int_equal(r.session_saved, 1);
    assert_int_equal(r.session_tokens, N_P + 8);
    assert_int_equal(r.prompt_tokens, N_P);
    assert_int_equal(r.n_tokens, g1.n_tokens);
    assert_memory_equal(r.tokens, g1.tokens, sizeof(uint32_t) * g1.n_tokens);
    kvd_gen_result_free(&r);
    /* Tokens continue it: the prompt is the conversation and them, its
     * whole computed blocks cached (the last sampled token has no K/V). */
    assert_int_equal(gen(c, q, 3, 8, "chat-1", &r), 0);
    assert_int_equal(r.prompt_tokens, n12);
    assert_int_equal(r.cached_tokens, (N_P + 8 - 1) / BT * BT);
    assert_int_equal(r.session_saved, 1);
    assert_int_equal(r.session_tokens, n12 + 8);
    assert_memory_equal(r.tokens, g2.tokens, sizeof(uint32_t) * g2.n_tokens);
    kvd_gen_result_free(&r);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);

    /* After a restart, no prompt: generate after the conversation, from
     * its blocks on disk. */
    start(&d, f, true);
    c = connect_to(&d);
    assert_int_equal(gen(c, NULL, 0, 4, "chat-1", &r), 0);
    assert_int_equal(r.prompt_tokens, n123);
    assert_int_equal(r.cached_tokens, (n123 - 1) / BT * BT);
    assert_int_equal(r.session_tokens, n123 + 4);
    assert_memory_equal(r.tokens, g3.tokens, sizeof(uint32_t) * g3.n_tokens);
    kvd_gen_result_free(&r);
    struct kvd_reply *rep = NULL;
    assert_int_equal(kvd_call(c, "session_list", NULL, 0, &rep), 0);
    const struct kvd_value *ss = kvd_value_get(rep->body, "sessions");
    assert_non_null(ss);
    assert_int_equal(ss->v.array.n, 1);
    uint64_t u = 0;
    assert_int_equal(kvd_value_u64(kvd_value_get(&ss->v.array.items[0], "n_tokens"), &u), 0);
    assert_int_equal(u, n123 + 4);
    kvd_reply_free(rep);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&g1);
    kvd_gen_result_free(&g2);
    kvd_gen_result_free(&g3);
    free(c1);
    free(c12);
    free(c123);
}

/* Text continues a session without a second BOS; a stream is saved too. */
static void test_text_and_stream(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    start(&d, f, true);
    struct kvd_ctx *c = connect_to(&d);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 4;
    o.temperature = 0;
    o.ignore_eos = true;
    o.session = "notes";
    struct kvd_gen_result r1, r2, ref;
    assert_int_equal(kvd_generate_text(c, "Once upon a time there was a tiny model", &o, &r1), 0);
    assert_int_equal(r1.session_saved, 1);
    uint32_t *t2 = NULL;
    size_t n2 = 0;
    assert_int_equal(kvd_tokenize(c, " and it grew", false, 0, &t2, &n2), 0);
    assert_true(n2 > 0);
    assert_int_equal(kvd_generate_text(c, " and it grew", &o, &r2), 0);
    assert_int_equal(r2.prompt_tokens, r1.session_tokens + n2);
    assert_int_equal(r2.session_tokens, r2.prompt_tokens + 4);

    /* The same conversation as tokens, outside the session, gives the same
     * completion. */
    struct kvd_reply *rep = NULL;
    struct kvd_arg a = KVD_ARG_S("name", "notes");
    kvd_gen_result_free(&r1);
    assert_int_equal(kvd_call(c, "session_open", &a, 1, &rep), 0);
    const struct kvd_value *tv = kvd_value_get(rep->body, "tokens");
    assert_non_null(tv);
    assert_int_equal(tv->v.array.n, r2.session_tokens);
    uint32_t *all = malloc(sizeof(uint32_t) * tv->v.array.n);
    for (size_t i = 0; i < tv->v.array.n; i++) {
        uint64_t u = 0;
        assert_int_equal(kvd_value_u64(&tv->v.array.items[i], &u), 0);
        all[i] = (uint32_t)u;
    }
    size_t n_before = r2.prompt_tokens;
    assert_int_equal(gen(c, all, n_before, 4, NULL, &ref), 0);
    assert_memory_equal(ref.tokens, r2.tokens, sizeof(uint32_t) * 4);
    assert_memory_equal(all + n_before, r2.tokens, sizeof(uint32_t) * 4);
    kvd_reply_free(rep);
    kvd_gen_result_free(&ref);

    /* Streamed: the final reply says it was saved, the list agrees. */
    uint64_t id;
    struct kvd_arg args[] = {KVD_ARG_S("session", "notes"), KVD_ARG_U("max_tokens", 2),
                             KVD_ARG_B("stream", true), KVD_ARG_B("ignore_eos", true),
                             KVD_ARG_F("temperature", 0)};
    assert_int_equal(kvd_send(c, KVD_OP_GENERATE, args, 5, NULL, NULL, &id), 0);
    rep = NULL;
    assert_int_equal(kvd_wait(c, id, &rep), 0);
    const struct kvd_value *sv = kvd_value_get(rep->body, "session");
    assert_non_null(sv);
    const struct kvd_value *saved = kvd_value_get(sv, "saved");
    assert_non_null(saved);
    assert_true(saved->type == KVD_T_BOOL && saved->v.b);
    uint64_t nt = 0;
    assert_int_equal(kvd_value_u64(kvd_value_get(sv, "n_tokens"), &nt), 0);
    assert_int_equal(nt, r2.session_tokens + 2);
    kvd_reply_free(rep);
    free(all);
    free(t2);
    kvd_gen_result_free(&r2);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);
}

static int expect_code(struct kvd_ctx *c, const struct kvd_arg *args, size_t n, const char *code)
{
    uint64_t id;
    struct kvd_reply *rep = NULL;
    if (kvd_send(c, KVD_OP_GENERATE, args, n, NULL, NULL, &id) != 0)
        return -1;
    int rc = kvd_wait(c, id, &rep);
    int ok = rc != 0 && rep && rep->code && !strcmp(rep->code, code);
    if (!ok)
        fprintf(stderr, "expected %s, got rc %d: %s\n", code, rc,
                rep && rep->message ? rep->message : "(no message)");
    kvd_reply_free(rep);
    return ok ? 0 : -1;
}

static void test_bad_requests(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    start(&d, f, true);
    struct kvd_ctx *c = connect_to(&d);
    uint32_t t[2] = {1, 2};
    uint64_t seq = 0;
    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    struct kvd_arg both[] = {KVD_ARG_S("session", "x"), KVD_ARG_U("seq", seq),
                             KVD_ARG_U32S("tokens", t, 2)};
    assert_int_equal(expect_code(c, both, 3, "bad_request"), 0);
    struct kvd_arg bad_name[] = {KVD_ARG_S("session", "a b"), KVD_ARG_U32S("tokens", t, 2)};
    assert_int_equal(expect_code(c, bad_name, 2, "bad_request"), 0);
    struct kvd_arg bad_ttl[] = {KVD_ARG_S("session", "x"), KVD_ARG_U("session_ttl_s", 0),
                                KVD_ARG_U32S("tokens", t, 2)};
    assert_int_equal(expect_code(c, bad_ttl, 3, "bad_request"), 0);
    struct kvd_arg no_prompt[] = {KVD_ARG_S("session", "nothing-yet")};
    assert_int_equal(expect_code(c, no_prompt, 1, "bad_request"), 0);
    struct kvd_arg not_str[] = {KVD_ARG_U("session", 7), KVD_ARG_U32S("tokens", t, 2)};
    assert_int_equal(expect_code(c, not_str, 2, "bad_request"), 0);
    /* None of them made a session. */
    struct kvd_reply *rep = NULL;
    assert_int_equal(kvd_call(c, "session_list", NULL, 0, &rep), 0);
    assert_int_equal(kvd_value_get(rep->body, "sessions")->v.array.n, 0);
    kvd_reply_free(rep);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);

    start(&d, f, false);
    c = connect_to(&d);
    struct kvd_arg ok[] = {KVD_ARG_S("session", "x"), KVD_ARG_U32S("tokens", t, 2)};
    assert_int_equal(expect_code(c, ok, 2, "unsupported"), 0);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);
}

struct child {
    const char *sock;
};

/* Tenant beta names the session root saved: a new one of its own. */
static int child_beta(void *arg)
{
    struct child *ch = arg;
    struct kvd_ctx *c = kvd_connect(ch->sock);
    if (!c || c->err)
        return 2;
    kvd_set_timeout(c, 120000);
    uint32_t t[3] = {9, 8, 7};
    struct kvd_gen_result r;
    if (gen(c, t, 3, 2, "shared-name", &r) != 0)
        return 3;
    int rc = r.prompt_tokens == 3 && r.cached_tokens == 0 && r.session_saved == 1 ? 0 : 4;
    kvd_gen_result_free(&r);
    kvd_close(c);
    return rc;
}

static void test_tenants(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    struct kh_proc d;
    start(&d, f, true);
    struct kvd_ctx *c = connect_to(&d);
    uint32_t p[N_P];
    for (size_t i = 0; i < N_P; i++)
        p[i] = (uint32_t)(i * 13 + 5) % 4096;
    struct kvd_gen_result r;
    assert_int_equal(gen(c, p, N_P, 4, "shared-name", &r), 0);
    kvd_gen_result_free(&r);
    struct child ch = {d.sock};
    assert_int_equal(kh_child_status(kh_run_as(UID_B, GID_ALL, child_beta, &ch)), 0);
    /* Root's session is as it was. */
    assert_int_equal(gen(c, NULL, 0, 1, "shared-name", &r), 0);
    assert_int_equal(r.prompt_tokens, N_P + 4);
    kvd_gen_result_free(&r);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);
}

/* Runs curl on the HTTP socket: the body and the headers (malloc'd). */
static char *curl_chat(const struct fixture *f, const char *body, const char *headers)
{
    char path[192], cmd[1024];
    snprintf(path, sizeof path, "%s/body.json", f->tmp);
    FILE *b = fopen(path, "w");
    assert_non_null(b);
    fputs(body, b);
    fclose(b);
    snprintf(cmd, sizeof cmd,
             "curl -sS -D - --unix-socket %s %s -H 'Content-Type: application/json' "
             "--data-binary @%s http://localhost/v1/chat/completions",
             f->http, headers, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    for (size_t k; (k = fread(out + n, 1, cap - n - 1, p)) > 0;)
        n += k;
    out[n] = '\0';
    pclose(p);
    return out;
}

static void test_http_header(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    start(&d, f, true);
    const char *body =
        "{\"model\":\"m\",\"max_tokens\":4,\"temperature\":0,\"messages\":["
        "{\"role\":\"system\",\"content\":\"You answer in long detailed paragraphs about the "
        "history of many cities of the world and their people.\"},"
        "{\"role\":\"user\",\"content\":\"Tell me about the city of Rome and its emperors\"}]}";
    char *a = curl_chat(f, body, "-H 'X-Kvd-Session: web-1' -H 'X-Kvd-Session-Ttl: 600'");
    assert_non_null(strstr(a, "200 OK"));
    assert_non_null(strstr(a, "X-Kvd-Session-Saved: true"));
    assert_non_null(strstr(a, "\"cached_tokens\":0"));
    char *b = curl_chat(f, body, "-H 'X-Kvd-Session: web-1'");
    assert_non_null(strstr(b, "X-Kvd-Session-Saved: true"));
    assert_null(strstr(b, "\"cached_tokens\":0}"));
    /* The same completion, now from the session's blocks. */
    const char *ca = strstr(a, "\"content\":\" "), *cb = strstr(b, "\"content\":\" ");
    assert_non_null(ca);
    assert_non_null(cb);
    assert_int_equal(strncmp(ca, cb, 40), 0);
    char *e = curl_chat(f, body, "-H 'X-Kvd-Session: no spaces'");
    assert_non_null(strstr(e, "400 Bad Request"));
    char *t = curl_chat(f, body, "-H 'X-Kvd-Session: web-1' -H 'X-Kvd-Session-Ttl: 0'");
    assert_non_null(strstr(t, "400 Bad Request"));
    free(a);
    free(b);
    free(e);
    free(t);
    struct kvd_ctx *c = connect_to(&d);
    struct kvd_reply *rep = NULL;
    assert_int_equal(kvd_call(c, "session_list", NULL, 0, &rep), 0);
    const struct kvd_value *ss = kvd_value_get(rep->body, "sessions");
    assert_int_equal(ss->v.array.n, 1);
    kvd_reply_free(rep);
    kvd_close(c);
    assert_int_equal(kh_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_tokens_continue_across_restart, per_test),
        cmocka_unit_test_setup(test_text_and_stream, per_test),
        cmocka_unit_test_setup(test_bad_requests, per_test),
        cmocka_unit_test_setup(test_tenants, per_test),
        cmocka_unit_test_setup(test_http_header, per_test),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
