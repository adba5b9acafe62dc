/* The OpenAI-compatible HTTP API against a real kvd serving a small random
 * model with the ChatML template, through curl (a client no one here
 * wrote) on the Unix socket and over TCP: answers equal the msgpack
 * generate's at temperature 0 (tokens, text, chat, streaming), usage, the
 * error mapping (400/401/403/404/405/413/429), bearer tokens, trusted front
 * ends' sub-tenants (private prefix namespaces; the msgpack `tenant` arg),
 * keep-alive and pipelining, a client closing mid-stream or while its
 * non-streamed answer is computed cancelling its generate, a streaming
 * client that does not read bounded by max-unread-output, one in-flight
 * count per tenant across the HTTP and msgpack sockets, and tenants seen
 * only over HTTP listed by `stats`. Skipped (77) without curl. */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "kvd_harness.h"

#define TOKEN "test-token-0123456789abcdef"

static char g_dir[64], g_model[128];
static struct kh_proc *g_d;
static unsigned g_port;
static uint64_t g_id;

/* Runs a shell command and returns its stdout (malloc'd). */
static char *run(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *run(const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (size_t k; (k = fread(buf + n, 1, cap - n - 1, p)) > 0;) {
        n += k;
        if (n + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
    }
    buf[n] = '\0';
    pclose(p);
    return buf;
}

/* curl on the Unix socket (or TCP when tcp): POST body to path (GET when
 * body is NULL) with extra header arguments; returns the body, *status the
 * HTTP status. */
static char *curl(bool tcp, const char *path, const char *body, const char *extra, int *status)
{
    char target[256];
    if (tcp)
        snprintf(target, sizeof(target), "http://127.0.0.1:%u%s", g_port, path);
    else
        snprintf(target, sizeof(target), "--unix-socket %s/http.sock http://localhost%s", g_dir,
                 path);
    char bodyfile[128] = "";
    if (body) {
        snprintf(bodyfile, sizeof(bodyfile), "%s/body.json", g_dir);
        FILE *f = fopen(bodyfile, "w");
        assert_non_null(f);
        fputs(body, f);
        fclose(f);
    }
    char *out =
        run("curl -sS -N -w '\\n%%{http_code}' %s %s%s %s", extra ? extra : "",
            body ? "-H 'Content-Type: application/json' --data-binary @" : "", bodyfile, target);
    char *nl = strrchr(out, '\n');
    assert_non_null(nl);
    *status = atoi(nl + 1);
    *nl = '\0';
    return out;
}

static json_t *json_ok(const char *s)
{
    json_error_t e;
    json_t *j = json_loads(s, 0, &e);
    if (!j)
        fail_msg("not JSON (%s): %s", e.text, s);
    return j;
}

/* The msgpack generate's answer for a prompt map entry packed by fn. */
struct gen_ref {
    uint32_t toks[512];
    size_t n;
    char text[4096];
    uint64_t prompt;
};

static void msgpack_generate(const char *key, const void *prompt, size_t n_prompt, uint32_t max,
                             struct gen_ref *out)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "generate", ++g_id, 3);
    if (!strcmp(key, "tokens")) {
        proto_pack_kv_u32_array(&q.pk, "tokens", prompt, n_prompt);
    } else if (!strcmp(key, "text")) {
        proto_pack_kv_str(&q.pk, "text", prompt);
    } else { /* messages: one user message */
        proto_pack_str(&q.pk, "messages");
        proto_pack_array(&q.pk, 1);
        proto_pack_map(&q.pk, 2);
        proto_pack_kv_str(&q.pk, "role", "user");
        proto_pack_kv_str(&q.pk, "content", prompt);
    }
    proto_pack_kv_uint(&q.pk, "max_tokens", max);
    proto_pack_kv_double(&q.pk, "temperature", 0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *t = kh_obj(r.root, "tokens");
    out->n = t->via.array.size;
    for (size_t i = 0; i < out->n; i++)
        out->toks[i] = (uint32_t)t->via.array.ptr[i].via.u64;
    const msgpack_object *tx = kh_obj(r.root, "text");
    snprintf(out->text, sizeof(out->text), "%.*s", (int)tx->via.str.size, tx->via.str.ptr);
    out->prompt = kh_u64(kh_obj(r.root, "usage"), "prompt");
    kh_reply_free(&r);
    close(fd);
}

static void expect_tokens(json_t *arr, const struct gen_ref *ref)
{
    assert_int_equal(json_array_size(arr), ref->n);
    for (size_t i = 0; i < ref->n; i++)
        assert_int_equal(json_integer_value(json_array_get(arr, i)), ref->toks[i]);
}

/* Polls `stats` until requests.<key> reaches at least `want` (a bounded
 * wait: a short pause between polls, 60 s at most; fails the test past
 * it). "answered", "cancelled" and "failed" are counted as each request
 * ends; "submitted" and "live" are the executor's snapshot, published at
 * the end of each of its steps (after a step's tokens went out). */
static void wait_stat(int mfd, const char *key, uint64_t want)
{
    for (int i = 0; i < 12000; i++) {
        if (kh_stat(mfd, "requests", key) >= want)
            return;
        struct timespec ts = {0, 5 * 1000000};
        nanosleep(&ts, NULL);
    }
    fail_msg("requests.%s is %llu, waited for %llu", key,
             (unsigned long long)kh_stat(mfd, "requests", key), (unsigned long long)want);
}

/* Waits until every request submitted has been answered and the
 * executor's snapshot says so (nothing live): the counters are then a
 * baseline. Returns requests.submitted. */
static uint64_t quiesce(int mfd)
{
    for (int i = 0; i < 12000; i++) {
        uint64_t sub = kh_stat(mfd, "requests", "submitted");
        if (kh_stat(mfd, "requests", "live") == 0 && kh_stat(mfd, "requests", "answered") == sub)
            return sub;
        struct timespec ts = {0, 5 * 1000000};
        nanosleep(&ts, NULL);
    }
    fail_msg("requests still live: %llu", (unsigned long long)kh_stat(mfd, "requests", "live"));
    return 0;
}

/* ---- fixture ---------------------------------------------------------------- */

static const char g_conf[] = "[http]\n"
                             "token = alpha " TOKEN "\n"
                             "[front-end]\n"
                             "uids = 0\n";

/* The TCP port a daemon bound for --http 127.0.0.1:0, from its log's
 * "(port N;" (0 when absent). */
static unsigned log_port(const struct kh_proc *d)
{
    char *log = run("cat %s", d->log);
    char *p = strstr(log, "(port ");
    unsigned port = p ? (unsigned)atoi(p + 6) : 0;
    free(log);
    return port;
}

/* A blocking TCP connection to 127.0.0.1:port. */
static int tcp_connect(unsigned port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

static int setup(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    if (system("curl --version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "curl is not installed: skipped\n");
        exit(77);
    }
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvd-http.XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof(g_model), "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof(cmd),
             "%s/kvd-gguf-gen -o %s --layers 4 --embd 256 --heads 8 --kv-heads 4 --ff 512 "
             "--vocab 512 --ctx 8192 --seed 3 --chat-template %s/tests/text/templates/chatml.jinja"
             " >/dev/null",
             tools, g_model, KVD_SOURCE_DIR);
    if (system(cmd) != 0)
        return -1;
    char sock[128];
    snprintf(sock, sizeof(sock), "%s/http.sock", g_dir);
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                g_model,
                                "--http-socket",
                                sock,
                                "--http",
                                "127.0.0.1:0",
                                "--http-max-body",
                                "4096",
                                "--max-text-bytes",
                                "2048",
                                "--metrics",
                                "unix",
                                "--max-queued-per-tenant",
                                "1",
                                "--max-unread-output",
                                "64K",
                                "--log-level",
                                "info",
                                "--no-roofline-probe",
                                NULL};
    g_d = kh_new(g_conf, args);
    if (!g_d)
        return -1;
    /* The bound TCP port, from the log's "(port N;" */
    g_port = log_port(g_d);
    return g_port ? 0 : -1;
}

static int teardown(void **state)
{
    int st = kh_free(g_d);
    unlink(g_model);
    char body[128];
    snprintf(body, sizeof(body), "%s/body.json", g_dir);
    unlink(body);
    rmdir(g_dir);
    return st == 0 ? 0 : -1;
}

/* ---- answers ---------------------------------------------------------------- */

static void test_completion_tokens_equal_msgpack(void **state)
{
    static const uint32_t prompt[] = {5, 6, 7, 8};
    struct gen_ref ref;
    msgpack_generate("tokens", prompt, 4, 12, &ref);
    int st;
    char *out = curl(false, "/v1/completions",
                     "{\"model\":\"x\",\"prompt\":[5,6,7,8],\"max_tokens\":12,\"temperature\":0,"
                     "\"unknown_field\":{\"ignored\":true}}",
                     NULL, &st);
    assert_int_equal(st, 200);
    json_t *j = json_ok(out);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    expect_tokens(json_object_get(c, "tokens"), &ref);
    assert_string_equal(json_string_value(json_object_get(c, "text")), ref.text);
    const char *fr = json_string_value(json_object_get(c, "finish_reason"));
    assert_true(!strcmp(fr, "length") || !strcmp(fr, "stop"));
    json_t *u = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 4);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), ref.n);
    json_decref(j);
    free(out);
}

static void test_completion_text_and_stream(void **state)
{
    struct gen_ref ref;
    msgpack_generate("text", "Once upon a time", 0, 16, &ref);
    int st;
    char *out =
        curl(false, "/v1/completions",
             "{\"prompt\":\"Once upon a time\",\"max_tokens\":16,\"temperature\":0}", NULL, &st);
    assert_int_equal(st, 200);
    json_t *j = json_ok(out);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), ref.text);
    expect_tokens(json_object_get(c, "tokens"), &ref);
    json_decref(j);
    free(out);

    /* Streamed: the pieces add up to the same text and tokens; usage last. */
    out = curl(false, "/v1/completions",
               "{\"prompt\":\"Once upon a time\",\"max_tokens\":16,\"temperature\":0,"
               "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
               NULL, &st);
    assert_int_equal(st, 200);
    char text[4096] = "";
    uint32_t toks[512];
    size_t n = 0;
    bool done = false, usage = false, finish = false;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        assert_false(done); /* nothing after [DONE] */
        assert_memory_equal(line, "data: ", 6);
        if (!strcmp(line + 6, "[DONE]")) {
            done = true;
            continue;
        }
        json_t *e = json_ok(line + 6);
        json_t *ch = json_array_get(json_object_get(e, "choices"), 0);
        if (ch) {
            const char *t = json_string_value(json_object_get(ch, "text"));
            strncat(text, t ? t : "", sizeof(text) - strlen(text) - 1);
            json_t *ta = json_object_get(ch, "tokens");
            for (size_t i = 0; i < json_array_size(ta); i++)
                toks[n++] = (uint32_t)json_integer_value(json_array_get(ta, i));
            finish |= json_is_string(json_object_get(ch, "finish_reason"));
        } else {
            usage = true;
            json_t *u = json_object_get(e, "usage");
            assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), ref.n);
            assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), ref.prompt);
        }
        json_decref(e);
    }
    assert_true(done && usage && finish);
    assert_string_equal(text, ref.text);
    assert_int_equal(n, ref.n);
    assert_memory_equal(toks, ref.toks, n * sizeof(uint32_t));
    free(out);
}

static void test_chat_equal_msgpack(void **state)
{
    struct gen_ref ref;
    msgpack_generate("messages", "Tell me a story.", 0, 10, &ref);
    int st;
    char *out = curl(false, "/v1/chat/completions",
                     "{\"model\":\"kvd\",\"messages\":[{\"role\":\"user\",\"content\":"
                     "[{\"type\":\"text\",\"text\":\"Tell me \"},{\"type\":\"text\",\"text\":"
                     "\"a story.\"}]}],\"max_completion_tokens\":10,\"temperature\":0,"
                     "\"seed\":-1}",
                     NULL, &st);
    assert_int_equal(st, 200);
    json_t *j = json_ok(out);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    json_t *m = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    assert_string_equal(json_string_value(json_object_get(m, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(m, "content")), ref.text);
    expect_tokens(json_object_get(m, "tokens"), &ref);
    json_decref(j);
    free(out);
}

static void test_models_and_health(void **state)
{
    int st;
    char *out = curl(false, "/v1/models", NULL, NULL, &st);
    assert_int_equal(st, 200);
    json_t *j = json_ok(out);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "list");
    assert_int_equal(json_array_size(json_object_get(j, "data")), 1);
    json_decref(j);
    free(out);
    out = curl(false, "/health", NULL, NULL, &st);
    assert_int_equal(st, 200);
    free(out);
}

/* ---- errors ----------------------------------------------------------------- */

static void expect_error(bool tcp, const char *path, const char *body, const char *extra, int want,
                         const char *code)
{
    int st;
    char *out = curl(tcp, path, body, extra, &st);
    if (st != want)
        fail_msg("%s: HTTP %d, expected %d: %s", path, st, want, out);
    if (code) {
        json_t *j = json_ok(out);
        json_t *e = json_object_get(j, "error");
        assert_non_null(e);
        assert_non_null(json_string_value(json_object_get(e, "message")));
        assert_non_null(json_string_value(json_object_get(e, "type")));
        assert_string_equal(json_string_value(json_object_get(e, "code")), code);
        json_decref(j);
    }
    free(out);
}

static void test_errors(void **state)
{
    expect_error(false, "/v1/completions", "{\"prompt\":[1],\"max_tokens\":\"many\"}", NULL, 400,
                 "bad_request");
    expect_error(false, "/v1/completions", "{\"prompt\":[1], \"temperature\": 0,", NULL, 400,
                 "bad_request");
    expect_error(false, "/v1/completions", "{\"prompt\":[1],\"echo\":true}", NULL, 400,
                 "unsupported");
    expect_error(false, "/v1/completions", "{\"prompt\":[100000]}", NULL, 400, "bad_request");
    expect_error(false, "/v1/chat/completions", "{\"messages\":[]}", NULL, 400, "bad_request");
    expect_error(false, "/v1/nothing", "{}", NULL, 404, "not_found");
    expect_error(false, "/v1/completions", NULL, NULL, 405, "method_not_allowed");
    /* over --http-max-body (4096): evhttp's own 413 */
    char big[6000];
    memset(big, ' ', sizeof(big));
    memcpy(big, "{\"prompt\":[1]", 13);
    memcpy(big + sizeof(big) - 2, "}", 2);
    expect_error(false, "/v1/completions", big, NULL, 413, NULL);
    /* TCP: a token is required; a front-end header is refused there */
    expect_error(true, "/v1/models", NULL, NULL, 401, "invalid_api_key");
    expect_error(true, "/v1/models", NULL, "-H 'Authorization: Bearer wrong-token-0123456789'", 401,
                 "invalid_api_key");
    expect_error(true, "/v1/models", NULL,
                 "-H 'Authorization: Bearer " TOKEN "' -H 'X-Kvd-Tenant: bob'", 403,
                 "permission_denied");
    expect_error(false, "/v1/models", NULL, "-H 'X-Kvd-Tenant: bad/name'", 400, "bad_request");
    /* the two refused tokens are counted (and logged) */
    char *m = run("curl -s --unix-socket %s/metrics.sock http://localhost/metrics", g_d->dir);
    const char *c = strstr(m, "\nkvd_http_auth_failures_total ");
    if (!c || atoi(c + strlen("\nkvd_http_auth_failures_total ")) < 2)
        fail_msg("no kvd_http_auth_failures_total >= 2 in the metrics: %.300s", c ? c : m);
    free(m);
    int st;
    char *out = curl(true, "/v1/completions", "{\"prompt\":[1,2],\"max_tokens\":2}",
                     "-H 'Authorization: Bearer " TOKEN "'", &st);
    assert_int_equal(st, 200);
    free(out);
}

/* An error found after the JSON (the vocabulary, the context, the text
 * bound: gen_request_build, shared with msgpack) names the request's own
 * parameter, never a field of kvd's msgpack generate. */
static void expect_param(const char *path, const char *body, int want, const char *code,
                         const char *param, const char *in_message)
{
    int st;
    char *out = curl(false, path, body, NULL, &st);
    if (st != want)
        fail_msg("%s: HTTP %d, expected %d: %s", path, st, want, out);
    json_t *j = json_ok(out);
    json_t *e = json_object_get(j, "error");
    assert_non_null(e);
    assert_string_equal(json_string_value(json_object_get(e, "code")), code);
    const char *p = json_string_value(json_object_get(e, "param"));
    const char *m = json_string_value(json_object_get(e, "message"));
    if (!p || strcmp(p, param) || !m || !strstr(m, in_message) || strstr(m, "'tokens'"))
        fail_msg("param %s, message '%s'; expected param %s and '%s' in it: %s", p ? p : "null",
                 m ? m : "", param, in_message, out);
    json_decref(j);
    free(out);
}

static void test_errors_name_http_params(void **state)
{
    /* an id outside the vocabulary (512) */
    expect_param("/v1/completions", "{\"prompt\":[1,2,100000]}", 400, "bad_request", "prompt",
                 "'prompt'[2]");
    /* max_tokens past the context (8192) */
    expect_param("/v1/completions", "{\"prompt\":[1],\"max_tokens\":9000}", 400, "bad_request",
                 "max_tokens", "max_tokens");
    /* text over --max-text-bytes (2048), in both endpoints */
    char body[3600];
    int n = snprintf(body, sizeof(body), "{\"prompt\":\"");
    memset(body + n, 'a', 3000);
    snprintf(body + n + 3000, sizeof(body) - (size_t)n - 3000, "\"}");
    expect_param("/v1/completions", body, 413, "too_large", "prompt", "max-text-bytes");
    n = snprintf(body, sizeof(body), "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    memset(body + n, 'a', 3000);
    snprintf(body + n + 3000, sizeof(body) - (size_t)n - 3000, "\"}]}");
    expect_param("/v1/chat/completions", body, 413, "too_large", "messages", "max-text-bytes");
}

/* curl -N on the Unix socket sock: POSTs body (from a file in g_dir) to
 * path; returns the reply body, *status the HTTP status. */
static char *curl_at(const char *sock, const char *path, const char *body, int *status)
{
    char file[128];
    snprintf(file, sizeof(file), "%s/body-small.json", g_dir);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fputs(body, f);
    fclose(f);
    char *out = run("curl -sS -N -w '\\n%%{http_code}' -H 'Content-Type: application/json' "
                    "--data-binary @%s --unix-socket %s http://localhost%s",
                    file, sock, path);
    unlink(file);
    char *nl = strrchr(out, '\n');
    assert_non_null(nl);
    *status = atoi(nl + 1);
    *nl = '\0';
    return out;
}

/* The error object e names param, has code, and its message quotes
 * 'param' and never the msgpack prompt fields. */
static void expect_error_obj(json_t *e, const char *code, const char *param, const char *all)
{
    if (!json_is_object(e))
        fail_msg("no error object: %s", all);
    const char *c = json_string_value(json_object_get(e, "code"));
    const char *p = json_string_value(json_object_get(e, "param"));
    const char *m = json_string_value(json_object_get(e, "message"));
    char quoted[64];
    snprintf(quoted, sizeof(quoted), "'%s'", param);
    if (!c || strcmp(c, code) || !p || strcmp(p, param) || !m || !strstr(m, quoted) ||
        strstr(m, "'tokens'") || strstr(m, "'text'"))
        fail_msg("code %s param %s message '%s'; expected code %s, param %s, %s in the message: %s",
                 c ? c : "null", p ? p : "null", m ? m : "", code, param, quoted, all);
}

static void expect_param_at(const char *sock, const char *path, const char *body, int want,
                            const char *code, const char *param)
{
    int st;
    char *out = curl_at(sock, path, body, &st);
    if (st != want)
        fail_msg("%s: HTTP %d, expected %d: %s", path, st, want, out);
    json_t *j = json_ok(out);
    expect_error_obj(json_object_get(j, "error"), code, param, out);
    json_decref(j);
    free(out);
}

/* A JSON body {"<key>":"<n bytes of words>"<tail>} (chat: one user
 * message of that content); malloc'd. The words vary so that the
 * tokenizer makes many tokens of them. */
static char *text_body(bool chat, size_t n, const char *tail)
{
    char *b = malloc(n + 256);
    assert_non_null(b);
    size_t at = (size_t)sprintf(b, chat ? "{\"messages\":[{\"role\":\"user\",\"content\":\""
                                        : "{\"prompt\":\"");
    for (size_t i = 0; i < n; i++)
        b[at + i] = i % 4 == 3 ? ' ' : (char)('a' + (i * 7 + i / 4) % 26);
    at += n;
    sprintf(b + at, chat ? "\"}]%s}" : "\"%s}", tail);
    return b;
}

/* A kvd whose model has a 64-token context and --max-text-bytes 4096: the
 * errors found after the body was accepted (a token prompt filling the
 * context, a text or chat prompt that tokenizes past it on the workers,
 * streamed or not) and the text bound name the HTTP parameter; valid
 * requests around them are answered. */
static void test_errors_name_http_params_small_context(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    assert_non_null(tools);
    char model[128], sock[128];
    snprintf(model, sizeof(model), "%s/small.gguf", g_dir);
    snprintf(sock, sizeof(sock), "%s/h3.sock", g_dir);
    char *gen = run("%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
                    "--vocab 512 --ctx 64 --seed 9 --chat-template "
                    "%s/tests/text/templates/chatml.jinja >/dev/null && echo ok",
                    tools, model, KVD_SOURCE_DIR);
    assert_non_null(strstr(gen, "ok"));
    free(gen);
    const char *const args[] = {"--backend",           "cpu", "--model",          model,
                                "--http-socket",       sock,  "--max-text-bytes", "4096",
                                "--no-roofline-probe", NULL};
    struct kh_proc *d = kh_new(NULL, args);
    assert_non_null(d);

    /* valid: a token prompt, then a chat one */
    int st;
    char *out = curl_at(sock, "/v1/completions",
                        "{\"prompt\":[1,2,3],\"max_tokens\":4,\"temperature\":0}", &st);
    assert_int_equal(st, 200);
    json_t *j = json_ok(out);
    json_t *u = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 3);
    json_int_t done = json_integer_value(json_object_get(u, "completion_tokens"));
    assert_true(done >= 1 && done <= 4);
    json_decref(j);
    free(out);

    /* 64 token ids fill the context: 400 naming prompt */
    char ids[512];
    size_t at = (size_t)snprintf(ids, sizeof(ids), "{\"prompt\":[");
    for (int i = 0; i < 64; i++)
        at += (size_t)snprintf(ids + at, sizeof(ids) - at, i ? ",%d" : "%d", 1 + i % 500);
    snprintf(ids + at, sizeof(ids) - at, "]}");
    expect_param_at(sock, "/v1/completions", ids, 400, "bad_request", "prompt");
    /* an id outside the vocabulary, and max_tokens past the context */
    expect_param_at(sock, "/v1/completions", "{\"prompt\":[1,512]}", 400, "bad_request", "prompt");
    expect_param_at(sock, "/v1/completions", "{\"prompt\":[1],\"max_tokens\":65}", 400,
                    "bad_request", "max_tokens");
    snprintf(
        ids, sizeof(ids),
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":65}");
    expect_param_at(sock, "/v1/chat/completions", ids, 400, "bad_request", "max_completion_tokens");

    /* 2000 bytes of words (under max-text-bytes) tokenize past 64 tokens:
     * refused by the workers, naming the HTTP prompt field */
    char *b = text_body(false, 2000, "");
    expect_param_at(sock, "/v1/completions", b, 413, "too_large", "prompt");
    free(b);
    b = text_body(true, 2000, "");
    expect_param_at(sock, "/v1/chat/completions", b, 413, "too_large", "messages");
    free(b);
    /* streamed: the headers went out at acceptance, the error is an event */
    b = text_body(true, 2000, ",\"stream\":true");
    out = curl_at(sock, "/v1/chat/completions", b, &st);
    free(b);
    assert_int_equal(st, 200);
    char *ev = strstr(out, "data: {\"error\"");
    if (!ev || !strstr(ev, "data: [DONE]"))
        fail_msg("no error event before [DONE]: %s", out);
    char *end = strchr(ev, '\n');
    assert_non_null(end);
    *end = '\0';
    j = json_ok(ev + 6);
    expect_error_obj(json_object_get(j, "error"), "too_large", "messages", ev);
    json_decref(j);
    free(out);

    /* 8 KiB of chat content: over max-text-bytes, 413 naming messages */
    b = text_body(true, 8192, "");
    expect_param_at(sock, "/v1/chat/completions", b, 413, "too_large", "messages");
    free(b);
    b = text_body(false, 8192, "");
    expect_param_at(sock, "/v1/completions", b, 413, "too_large", "prompt");
    free(b);

    /* still answered after the refusals */
    out = curl_at(sock, "/v1/chat/completions",
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":3,"
                  "\"temperature\":0}",
                  &st);
    assert_int_equal(st, 200);
    j = json_ok(out);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    json_decref(j);
    free(out);
    assert_int_equal(kh_free(d), 0);
    unlink(model);
}

/* Raw bytes to the API's Unix socket; the whole answer until the daemon
 * closes (bounded: a 10 s poll per read). Returns the bytes read, and
 * *closed whether the daemon closed the connection. */
static size_t raw_http(const char *req, size_t len, char *out, size_t cap, bool *closed)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/http.sock", g_dir);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(kh_send_raw(fd, req, len), 0);
    size_t got = 0;
    *closed = false;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 10000) != 1)
            break; /* still open after 10 s */
        ssize_t r = read(fd, out + got, cap - 1 - got);
        if (r <= 0) {
            *closed = true;
            break;
        }
        got += (size_t)r;
        if (got == cap - 1)
            break;
    }
    out[got] = '\0';
    close(fd);
    return got;
}

static unsigned count_of(const char *h, const char *n)
{
    unsigned k = 0;
    for (const char *p = strstr(h, n); p; p = strstr(p + 1, n))
        k++;
    return k;
}

/* A second Content-Length is refused (400) and the connection closed, so
 * the bytes after the first length are never served as a request of their
 * own (request smuggling); CONNECT and other methods kvd does not serve
 * get an answer with a length, and the connection closed. */
static void test_smuggling_and_methods(void **state)
{
    char out[8192];
    bool closed;
    static const char body[] = "{\"prompt\":[1]}";
    static const char smuggled[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n"
                     "Content-Length: %zu\r\n\r\n%s%s",
                     strlen(body), strlen(body) + strlen(smuggled), body, smuggled);
    raw_http(req, (size_t)n, out, sizeof(out), &closed);
    if (strncmp(out, "HTTP/1.1 400", 12) || count_of(out, "HTTP/1.1 ") != 1 || !closed ||
        !strstr(out, "Content-Length"))
        fail_msg("duplicate Content-Length: %s%s", out, closed ? "" : " (left open)");
    static const char *const methods[] = {"CONNECT example.com:443", "PUT /v1/models",
                                          "DELETE /v1/completions", "OPTIONS /health"};
    for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++) {
        n = snprintf(req, sizeof(req), "%s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
                     methods[i]);
        size_t got = raw_http(req, (size_t)n, out, sizeof(out), &closed);
        const char *cl = strstr(out, "Content-Length: ");
        const char *bd = strstr(out, "\r\n\r\n");
        if (strncmp(out, "HTTP/1.1 405", 12) || !closed || !cl || !bd ||
            (size_t)atol(cl + 16) != got - (size_t)(bd + 4 - out))
            fail_msg("%s: %s%s", methods[i], out, closed ? "" : " (left open)");
    }
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Slow-loris: connections that send their request a byte every 200 ms are
 * closed within --http-timeout (1 s) + 1 s of their accept however they
 * dribble (evhttp's own timeout restarts on every byte), over the Unix
 * socket and TCP (a peer with no token holds no slot past it either), and
 * a whole request is served meanwhile. */
static void test_slowloris_deadline(void **state)
{
    char dir_sock[100];
    snprintf(dir_sock, sizeof(dir_sock), "%.80s/slow.sock", g_dir);
    const char *const args[] = {"--backend",       "cpu",         "--http-socket",       dir_sock,
                                "--http",          "127.0.0.1:0", "--http-timeout",      "1",
                                "--device-blocks", "16",          "--host-blocks",       "4",
                                "--log-level",     "info",        "--no-roofline-probe", NULL};
    struct kh_proc *d = kh_new(g_conf, args);
    assert_non_null(d);
    unsigned port = log_port(d);
    assert_true(port > 0);
    enum { N = 8 };
    int fds[2 * N];
    double opened[2 * N], closed_at[2 * N];
    for (int i = 0; i < 2 * N; i++) {
        if (i < N) {
            fds[i] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
            struct sockaddr_un sa = {.sun_family = AF_UNIX};
            snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", dir_sock);
            assert_int_equal(connect(fds[i], (struct sockaddr *)&sa, sizeof(sa)), 0);
        } else {
            fds[i] = tcp_connect(port);
        }
        opened[i] = mono_s();
        closed_at[i] = 0;
    }
    static const char dribble[] = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                  "100000\r\n\r\n{\"prompt\":";
    size_t at = 0;
    int open_left = 2 * N;
    bool served = false;
    double t0 = mono_s();
    while (open_left > 0 && mono_s() - t0 < 10) {
        for (int i = 0; i < 2 * N; i++) {
            if (closed_at[i])
                continue;
            char c = dribble[at % (sizeof(dribble) - 1)];
            char buf[512];
            ssize_t r = recv(fds[i], buf, sizeof(buf), MSG_DONTWAIT);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ||
                send(fds[i], &c, 1, MSG_NOSIGNAL) != 1) {
                closed_at[i] = mono_s();
                open_left--;
            }
        }
        at++;
        if (!served) { /* a whole request is answered while they dribble */
            int st;
            char *out = curl(false, "/health", NULL, NULL, &st);
            served = st == 200;
            free(out);
        }
        struct timespec ts = {0, 200 * 1000 * 1000}; /* the dribble's pace */
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < 2 * N; i++) {
        close(fds[i]);
        if (!closed_at[i] || closed_at[i] - opened[i] > 2.5)
            fail_msg("slow connection %d (%s) %s after %.2f s", i, i < N ? "unix" : "tcp",
                     closed_at[i] ? "closed" : "still open",
                     (closed_at[i] ? closed_at[i] : mono_s()) - opened[i]);
    }
    assert_true(served);
    assert_int_equal(kh_free(d), 0);
}

/* max-queued-per-tenant is 1: while a msgpack generate of the same tenant
 * runs (its first event has arrived), an HTTP request is refused 429. */
static void test_busy_429(void **state)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    static const uint32_t prompt[] = {1, 2, 3};
    uint64_t id = ++g_id;
    kh_req_begin(&q, "generate", id, 5);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 3);
    proto_pack_kv_uint(&q.pk, "max_tokens", 8000);
    proto_pack_kv_bool(&q.pk, "stream", true);
    proto_pack_kv_bool(&q.pk, "ignore_eos", true);
    proto_pack_kv_double(&q.pk, "temperature", 0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0); /* the first tokens: it runs */
    assert_non_null(kh_obj(r.root, "event"));
    kh_reply_free(&r);
    expect_error(false, "/v1/completions", "{\"prompt\":[1],\"max_tokens\":1}", NULL, 429, "busy");
    kh_req_begin(&q, "cancel", ++g_id, 1);
    proto_pack_kv_uint(&q.pk, "target", id);
    assert_int_equal(kh_req_send(fd, &q), 0);
    close(fd); /* the rest is dropped with the connection */
}

/* ---- tenants ---------------------------------------------------------------- */

static int http_connect(void);
static char *read_until(int fd, const char *needle, int count);

/* The reverse of test_busy_429: while an HTTP request of the tenant runs
 * (it streams), a msgpack generate of the same tenant is refused busy:
 * one count per tenant across both sockets. */
static void test_busy_msgpack_behind_http(void **state)
{
    int mfd = kh_connect(g_d->sock);
    assert_true(mfd >= 0);
    uint64_t sub0 = quiesce(mfd); /* test_busy_429's generate has ended */
    static const char body[] = "{\"prompt\":[1,2,3],\"max_tokens\":8000,\"temperature\":0,\"ignore_"
                               "eos\":true,\"stream\":true}";
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    int fd = http_connect();
    assert_int_equal(write(fd, req, (size_t)n), n);
    char *first = read_until(fd, "data: ", 1); /* it runs */
    assert_non_null(strstr(first, "data: "));
    free(first);

    struct kh_req q;
    struct kh_reply r;
    static const uint32_t prompt[] = {1, 2, 3};
    kh_req_begin(&q, "generate", ++g_id, 2);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 3);
    proto_pack_kv_uint(&q.pk, "max_tokens", 1);
    assert_int_equal(kh_req_send(mfd, &q), 0);
    assert_int_equal(kh_recv(mfd, &r), 0);
    kh_expect(&r, KVD_EBUSY);
    assert_non_null(strstr(r.message, "max-queued-per-tenant"));
    kh_reply_free(&r);

    close(fd); /* cancels the HTTP request: the tenant may generate again */
    wait_stat(mfd, "answered", sub0 + 1);
    struct gen_ref ref;
    msgpack_generate("tokens", prompt, 3, 1, &ref);
    assert_int_equal(ref.n, 1);
    close(mfd);
}

/* The names `stats` lists in "tenants" (admin: the test runs as root),
 * joined with '|' around each. */
static void stats_tenant_names(char *out, size_t cap)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *t = kh_obj(r.root, "tenants");
    assert_non_null(t);
    snprintf(out, cap, "|");
    for (uint32_t i = 0; i < t->via.array.size; i++) {
        const msgpack_object *name = kh_obj(&t->via.array.ptr[i], "name");
        assert_non_null(name);
        size_t len = strlen(out);
        snprintf(out + len, cap - len, "%.*s|", (int)name->via.str.size, name->via.str.ptr);
    }
    kh_reply_free(&r);
    close(fd);
}

/* Tenants seen only over HTTP (a bearer token's over TCP, a front end's
 * sub-tenant on the Unix socket) are in admin `stats`, with their request
 * counted there. */
static void test_http_tenants_in_stats(void **state)
{
    char names[4096];
    stats_tenant_names(names, sizeof(names));
    assert_null(strstr(names, "|uid:0/dora|"));
    int st;
    char *out = curl(true, "/v1/completions", "{\"prompt\":[1,2],\"max_tokens\":1}",
                     "-H 'Authorization: Bearer " TOKEN "'", &st);
    assert_int_equal(st, 200);
    free(out);
    out = curl(false, "/v1/completions", "{\"prompt\":[1,2],\"max_tokens\":1}",
               "-H 'X-Kvd-Tenant: dora'", &st);
    assert_int_equal(st, 200);
    free(out);
    stats_tenant_names(names, sizeof(names));
    if (!strstr(names, "|alpha|") || !strstr(names, "|uid:0/dora|"))
        fail_msg("stats lists the tenants %s, without alpha or uid:0/dora", names);
}

static uint64_t cached_of(const char *sub)
{
    char hdr[96];
    snprintf(hdr, sizeof(hdr), "-H 'X-Kvd-Tenant: %s'", sub);
    int st;
    /* 40 tokens: two full blocks can be shared */
    char *out = curl(false, "/v1/completions",
                     "{\"prompt\":[9,8,7,6,5,4,3,2,1,9,8,7,6,5,4,3,2,1,9,8,7,6,5,4,3,2,1,9,8,7,"
                     "6,5,4,3,2,1,9,8,7,6],\"max_tokens\":1,\"temperature\":0}",
                     hdr, &st);
    assert_int_equal(st, 200);
    json_t *j = json_ok(out);
    json_t *d = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
    uint64_t c = (uint64_t)json_integer_value(json_object_get(d, "cached_tokens"));
    json_decref(j);
    free(out);
    return c;
}

static void test_front_end_sub_tenants(void **state)
{
    /* Each sub-tenant has its own prefix namespace: alice's second request
     * reuses her first's blocks; bob's first does not see them. */
    assert_int_equal(cached_of("alice"), 0);
    assert_true(cached_of("alice") >= 32);
    assert_int_equal(cached_of("bob"), 0);

    /* The msgpack `tenant` arg: the same sub-tenant, as hello reports. */
    int fd = kh_connect(g_d->sock);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "hello", ++g_id, 1);
    proto_pack_kv_str(&q.pk, "tenant", "alice");
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *t = kh_obj(r.root, "tenant");
    assert_int_equal(t->via.str.size, strlen("uid:0/alice"));
    assert_memory_equal(t->via.str.ptr, "uid:0/alice", t->via.str.size);
    kh_reply_free(&r);
    close(fd);
}

/* A front end's msgpack generates count against the sub-tenant they name
 * (max-queued-per-tenant is 1): while carol's runs, carol is busy, but dave
 * and the front end's own tenant are not. */
static void gen_one(int fd, const char *tenant, uint32_t max, bool stream, uint64_t *id)
{
    static const uint32_t prompt[] = {1, 2, 3};
    struct kh_req q;
    *id = ++g_id;
    kh_req_begin(&q, "generate", *id, 5 + (tenant != NULL));
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 3);
    proto_pack_kv_uint(&q.pk, "max_tokens", max);
    proto_pack_kv_bool(&q.pk, "stream", stream);
    proto_pack_kv_bool(&q.pk, "ignore_eos", true);
    proto_pack_kv_double(&q.pk, "temperature", 0);
    if (tenant)
        proto_pack_kv_str(&q.pk, "tenant", tenant);
    assert_int_equal(kh_req_send(fd, &q), 0);
}

static void test_sub_tenant_counts_msgpack(void **state)
{
    int mfd = kh_connect(g_d->sock);
    assert_true(mfd >= 0);
    uint64_t sub0 = quiesce(mfd);
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    uint64_t long_id, id;
    gen_one(fd, "carol", 8000, true, &long_id);
    assert_int_equal(kh_recv(fd, &r), 0); /* carol's first tokens: it runs */
    assert_non_null(kh_obj(r.root, "event"));
    kh_reply_free(&r);
    const struct {
        const char *tenant;
        int code;
    } cases[] = {{"carol", KVD_EBUSY}, {"dave", 0}, {NULL, 0}};
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        gen_one(fd, cases[k].tenant, 1, false, &id);
        do { /* skip carol's stream events */
            assert_int_equal(kh_recv(fd, &r), 0);
            if (r.id != id)
                kh_reply_free(&r);
        } while (r.id != id);
        kh_expect(&r, cases[k].code);
        kh_reply_free(&r);
    }
    close(fd); /* cancels carol's */
    wait_stat(mfd, "answered", sub0 + 3);
    close(mfd);
}

/* A uid that is not a front end may not name a tenant, on either socket. */
static void test_not_front_end_refused(void **state)
{
    char sock[128];
    snprintf(sock, sizeof(sock), "%s/h2.sock", g_dir);
    const char *const args[] = {"--backend",           "cpu", "--http-socket", sock,
                                "--no-roofline-probe", NULL};
    struct kh_proc *d = kh_new(NULL, args);
    assert_non_null(d);
    int st;
    char *out = run("curl -s -w '\\n%%{http_code}' -H 'X-Kvd-Tenant: bob' --unix-socket %s "
                    "http://localhost/v1/models",
                    sock);
    st = atoi(strrchr(out, '\n') + 1);
    assert_int_equal(st, 403);
    free(out);
    /* store mode: completions answer 503 */
    out = run("curl -s -w '\\n%%{http_code}' --unix-socket %s http://localhost/v1/completions "
              "-d '{\"prompt\":[1]}'",
              sock);
    assert_int_equal(atoi(strrchr(out, '\n') + 1), 503);
    free(out);
    int fd = kh_connect(d->sock);
    struct kh_reply r;
    struct kh_req q;
    kh_req_begin(&q, "seq_open", 1, 1);
    proto_pack_kv_str(&q.pk, "tenant", "bob");
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_EPERM);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_free(d), 0);
}

/* ---- connections ------------------------------------------------------------- */

static int http_connect(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/http.sock", g_dir);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    struct timeval tv = {30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

/* Reads until `count` occurrences of needle have arrived (or EOF). */
static char *read_until(int fd, const char *needle, int count)
{
    size_t cap = 1 << 20, n = 0;
    char *buf = calloc(1, cap);
    for (;;) {
        int seen = 0;
        for (char *p = buf; (p = strstr(p, needle)); p++)
            seen++;
        if (seen >= count)
            break;
        ssize_t k = read(fd, buf + n, cap - n - 1);
        if (k <= 0)
            break;
        n += (size_t)k;
    }
    return buf;
}

static void test_keepalive_pipelining(void **state)
{
    /* Three requests in one write on one connection: three answers in order. */
    static const char body[] = "{\"prompt\":[1,2,3],\"max_tokens\":2,\"temperature\":0}";
    char reqs[2048];
    int n = snprintf(reqs, sizeof(reqs),
                     "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     "application/json\r\nContent-Length: %zu\r\n\r\n%s"
                     "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
                     strlen(body), body);
    int fd = http_connect();
    assert_int_equal(write(fd, reqs, (size_t)n), n);
    char *out = read_until(fd, "HTTP/1.1 200", 3);
    char *a = strstr(out, "\"status\":\"ok\""), *b = strstr(out, "text_completion"),
         *c = strstr(out, "\"object\":\"list\"");
    assert_true(a && b && c && a < b && b < c);
    free(out);
    close(fd);
    /* curl reuses one connection for two URLs (keep-alive) */
    char *v = run("curl -sv --unix-socket %s/http.sock http://localhost/health "
                  "http://localhost/health 2>&1",
                  g_dir);
    assert_non_null(strstr(v, "Re-using existing connection"));
    free(v);
}

/* A client that closes mid-stream: its generate is cancelled (counted
 * cancelled; the executor stops producing: far fewer than max_tokens are
 * generated). */
static void test_disconnect_cancels(void **state)
{
    int mfd = kh_connect(g_d->sock);
    uint64_t sub0 = quiesce(mfd);
    uint64_t out0 = kh_stat(mfd, "requests", "tokens_out");
    uint64_t cancelled0 = kh_stat(mfd, "requests", "cancelled");
    static const char body[] = "{\"prompt\":[1,2,3],\"max_tokens\":8000,\"temperature\":0,\"ignore_"
                               "eos\":true,\"stream\":true}";
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    int fd = http_connect();
    assert_int_equal(write(fd, req, (size_t)n), n);
    char *first = read_until(fd, "data: ", 1); /* it streams */
    assert_non_null(strstr(first, "data: "));
    free(first);
    close(fd);
    /* wait (bounded) until it is answered: the cancel takes a step */
    wait_stat(mfd, "answered", sub0 + 1);
    assert_int_equal(kh_stat(mfd, "requests", "cancelled"), cancelled0 + 1);
    uint64_t produced = kh_stat(mfd, "requests", "tokens_out") - out0;
    assert_true(produced < 8000);
    close(mfd);
}

/* A non-streamed request whose client closes while the answer is computed:
 * its generate is cancelled at once (the executor's accounting counts it
 * cancelled, not completed), not run to max_tokens. */
static void test_disconnect_nonstreamed_cancels(void **state)
{
    int mfd = kh_connect(g_d->sock);
    assert_true(mfd >= 0);
    uint64_t sub0 = quiesce(mfd);
    uint64_t cancelled0 = kh_stat(mfd, "requests", "cancelled");
    uint64_t out0 = kh_stat(mfd, "requests", "tokens_out");
    static const char body[] =
        "{\"prompt\":[1,2,3],\"max_tokens\":8000,\"temperature\":0,\"ignore_eos\":true}";
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    int fd = http_connect();
    assert_int_equal(write(fd, req, (size_t)n), n);
    wait_stat(mfd, "submitted", sub0 + 1); /* the executor has it */
    close(fd);
    wait_stat(mfd, "answered", sub0 + 1);
    assert_int_equal(kh_stat(mfd, "requests", "cancelled"), cancelled0 + 1);
    assert_true(kh_stat(mfd, "requests", "tokens_out") - out0 < 8000);
    close(mfd);
}

/* A streaming client that never reads: once the output it has not read
 * passes max-unread-output (64K here) beyond what the socket holds,
 * its generate ends with busy (an error event, then [DONE]) long before
 * max_tokens; the executor counts it failed. */
static void test_slow_reader_bounded(void **state)
{
    int mfd = kh_connect(g_d->sock);
    assert_true(mfd >= 0);
    uint64_t sub0 = quiesce(mfd);
    uint64_t failed0 = kh_stat(mfd, "requests", "failed");
    static const char body[] = "{\"prompt\":[1,2,3],\"max_tokens\":8000,\"temperature\":0,\"ignore_"
                               "eos\":true,\"stream\":true}";
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    int fd = http_connect();
    assert_int_equal(write(fd, req, (size_t)n), n);
    wait_stat(mfd, "answered", sub0 + 1); /* it ended without the client reading */
    char *all = read_until(fd, "data: [DONE]", 1);
    assert_int_equal(kh_stat(mfd, "requests", "failed"), failed0 + 1);
    char *err = strstr(all, "data: {\"error\"");
    if (!err)
        fail_msg("no error event in the stream (%zu bytes)", strlen(all));
    assert_non_null(strstr(err, "\"code\":\"busy\""));
    assert_non_null(strstr(err, "max-unread-output"));
    assert_non_null(strstr(err, "data: [DONE]"));
    int events = 0;
    for (char *p = all; (p = strstr(p, "data: {\"id\"")); p++)
        events++;
    print_message("slow reader: %d chunks written before its generate ended busy\n", events);
    assert_true(events > 0 && events < 8000);
    free(all);
    close(fd);
    close(mfd);
}

/* Streams that never read count toward max-buffered with the msgpack
 * connections' buffers: with a budget of 1 MiB and no per-stream bound in
 * reach (max-unread-output 1G), four non-reading SSE streams end busy
 * naming max-buffered instead of growing the daemon without bound. */
static void test_sse_in_max_buffered(void **state)
{
    char hs[100];
    snprintf(hs, sizeof(hs), "%.80s/budget.sock", g_dir);
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                g_model,
                                "--http-socket",
                                hs,
                                "--max-buffered",
                                "1M",
                                "--max-unread-output",
                                "1G",
                                "--no-roofline-probe",
                                NULL};
    struct kh_proc *d = kh_new(g_conf, args);
    assert_non_null(d);
    int mfd = kh_connect(d->sock);
    assert_true(mfd >= 0);
    uint64_t sub0 = quiesce(mfd);
    static const char body[] = "{\"prompt\":[1,2,3],\"max_tokens\":8000,\"temperature\":0,\"ignore_"
                               "eos\":true,\"stream\":true}";
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    enum { S = 4 };
    int fds[S];
    for (int i = 0; i < S; i++) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", hs);
        fds[i] = socket(AF_UNIX, SOCK_STREAM, 0);
        assert_int_equal(connect(fds[i], (struct sockaddr *)&sa, sizeof(sa)), 0);
        struct timeval tv = {30, 0};
        setsockopt(fds[i], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        assert_int_equal(write(fds[i], req, (size_t)n), n);
    }
    wait_stat(mfd, "answered", sub0 + S); /* they ended without their clients reading */
    int budget = 0;
    for (int i = 0; i < S; i++) {
        char *all = read_until(fds[i], "data: [DONE]", 1);
        char *err = strstr(all, "data: {\"error\"");
        budget += err && strstr(err, "max-buffered") && strstr(err, "\"code\":\"busy\"");
        free(all);
        close(fds[i]);
    }
    /* those with 64 KiB unread while the total was over the budget */
    if (budget == 0)
        fail_msg("no stream ended over max-buffered");
    print_message("%d of %d non-reading streams ended over max-buffered (1M)\n", budget, S);
    close(mfd);
    assert_int_equal(kh_free(d), 0);
}

/* One address may hold --http-max-connections-per-peer (3) TCP
 * connections: the 4th and 5th are shut as soon as the daemon sees them,
 * the first three stay, and a slot freed is taken again. */
static void test_per_peer_cap(void **state)
{
    const char *const args[] = {"--backend",
                                "cpu",
                                "--http",
                                "127.0.0.1:0",
                                "--http-max-connections-per-peer",
                                "3",
                                "--device-blocks",
                                "16",
                                "--host-blocks",
                                "4",
                                "--log-level",
                                "info",
                                "--no-roofline-probe",
                                NULL};
    struct kh_proc *d = kh_new(g_conf, args);
    assert_non_null(d);
    unsigned port = log_port(d);
    assert_true(port > 0);
    int fds[6];
    bool closed[6] = {false};
    for (int i = 0; i < 5; i++) {
        fds[i] = tcp_connect(port);
        /* one at a time: each is seen before the next arrives */
        struct pollfd p = {.fd = fds[i], .events = POLLIN};
        if (poll(&p, 1, i < 3 ? 300 : 5000) == 1) {
            char c;
            closed[i] = recv(fds[i], &c, 1, MSG_DONTWAIT) == 0;
        }
    }
    for (int i = 0; i < 5; i++)
        if (closed[i] != (i >= 3))
            fail_msg("connection %d %s", i, closed[i] ? "was shut" : "stayed open");
    close(fds[0]); /* a slot comes free: the next connection keeps its slot */
    struct timespec ts = {0, 400 * 1000 * 1000}; /* the listener reaps every 200 ms */
    nanosleep(&ts, NULL);
    fds[5] = tcp_connect(port);
    static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_int_equal(kh_send_raw(fds[5], req, sizeof(req) - 1), 0);
    char buf[256] = "";
    struct pollfd p = {.fd = fds[5], .events = POLLIN};
    assert_int_equal(poll(&p, 1, 5000), 1);
    assert_true(recv(fds[5], buf, sizeof(buf) - 1, 0) > 0);
    assert_int_equal(strncmp(buf, "HTTP/1.1 ", 9), 0); /* answered (401: no token) */
    for (int i = 1; i < 6; i++)
        close(fds[i]);
    assert_int_equal(kh_free(d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_tokens_equal_msgpack),
        cmocka_unit_test(test_completion_text_and_stream),
        cmocka_unit_test(test_chat_equal_msgpack),
        cmocka_unit_test(test_models_and_health),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_errors_name_http_params),
        cmocka_unit_test(test_smuggling_and_methods),
        cmocka_unit_test(test_slowloris_deadline),
        cmocka_unit_test(test_errors_name_http_params_small_context),
        cmocka_unit_test(test_busy_429),
        cmocka_unit_test(test_busy_msgpack_behind_http),
        cmocka_unit_test(test_front_end_sub_tenants),
        cmocka_unit_test(test_sub_tenant_counts_msgpack),
        cmocka_unit_test(test_http_tenants_in_stats),
        cmocka_unit_test(test_not_front_end_refused),
        cmocka_unit_test(test_keepalive_pipelining),
        cmocka_unit_test(test_disconnect_cancels),
        cmocka_unit_test(test_disconnect_nonstreamed_cancels),
        cmocka_unit_test(test_slow_reader_bounded),
        cmocka_unit_test(test_sse_in_max_buffered),
        cmocka_unit_test(test_per_peer_cap),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
