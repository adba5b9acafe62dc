/* libkvd's generate path against a real kvd serving a tiny random model
 * (written by $KVD_TOOLS_DIR/kvd-gguf-gen): sync and async calls, streaming
 * events matched to the final reply, stop tokens, cancel (from the callback
 * and by id), pipelined generates, the prefix cache's usage numbers, and
 * kvctl generate's output. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

struct fixture {
    struct kh_proc *d;
    char model[160];
};

/* Writes the model into a fresh directory, then starts kvd serving it. */
static int setup(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    struct fixture *f = calloc(1, sizeof(*f));
    char dir[] = "/tmp/kvd-gen.XXXXXX", cmd[512];
    if (!f || !tools || !mkdtemp(dir))
        return -1;
    snprintf(f->model, sizeof(f->model), "%s/tiny.gguf", dir);
    snprintf(cmd, sizeof(cmd),
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 8192 --seed 1 >/dev/null",
             tools, f->model);
    if (system(cmd) != 0) {
        fprintf(stderr, "setup: %s failed\n", cmd);
        return -1;
    }
    const char *const args[] = {"--backend", "cpu", "--model", f->model, NULL};
    f->d = kh_new(NULL, args);
    if (!f->d)
        return -1;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char dir[160];
    kh_free(f->d);
    unlink(f->model);
    snprintf(dir, sizeof(dir), "%s", f->model);
    *strrchr(dir, '/') = '\0';
    rmdir(dir);
    free(f);
    return 0;
}

static struct kvd_ctx *connect_ok(struct fixture *f)
{
    struct kvd_ctx *c = kvd_connect(f->d->sock);
    assert_non_null(c);
    if (c->err)
        fail_msg("connect: %s", c->errstr);
    kvd_set_timeout(c, 60000);
    return c;
}

static const uint32_t prompt[] = {1, 2, 3, 4, 5};

/* Greedy generation of n tokens from prompt; the reference for the others. */
static void greedy(struct kvd_ctx *c, uint32_t n, struct kvd_gen_result *res)
{
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = n;
    o.temperature = 0;
    if (kvd_generate(c, prompt, 5, &o, res))
        fail_msg("generate: %s", c->errstr);
}

static void test_hello_serve_mode(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_hello_info h;
    assert_int_equal(kvd_hello(c, &h), 0);
    assert_true(h.has_model);
    assert_int_equal(h.vocab, 256);
    assert_int_equal(h.layers, 2);
    assert_int_equal(h.kv_heads, 2);
    kvd_close(c);
}

static void test_generate_sync(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result a, b;

    greedy(c, 12, &a);
    assert_int_equal(a.n_tokens, 12);
    assert_string_equal(a.finish_reason, "length");
    assert_int_equal(a.prompt_tokens, 5);
    assert_int_equal(a.completion_tokens, 12);
    assert_true(a.total_ms >= a.ttft_ms && a.ttft_ms >= 0);
    for (size_t i = 0; i < a.n_tokens; i++)
        assert_true(a.tokens[i] < 256);
    /* Greedy is deterministic. */
    greedy(c, 12, &b);
    assert_int_equal(b.n_tokens, 12);
    assert_memory_equal(a.tokens, b.tokens, 12 * sizeof(uint32_t));
    kvd_gen_result_free(&a);
    kvd_gen_result_free(&b);
    kvd_close(c);
}

struct stream {
    uint32_t got[4096];
    size_t n, events;
    size_t cancel_after; /* events; 0: never */
};

static int on_tokens(void *user, const uint32_t *t, size_t n)
{
    struct stream *s = user;
    for (size_t i = 0; i < n && s->n < 4096; i++)
        s->got[s->n++] = t[i];
    s->events++;
    return s->cancel_after && s->events >= s->cancel_after;
}

static void test_generate_stream(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result ref, res;
    struct kvd_gen_opts o;
    struct stream s = {0};

    greedy(c, 16, &ref);
    kvd_gen_opts_init(&o);
    o.max_tokens = 16;
    o.temperature = 0;
    o.on_tokens = on_tokens;
    o.user = &s;
    assert_int_equal(kvd_generate(c, prompt, 5, &o, &res), 0);
    assert_true(s.events >= 1);
    /* The events carry every generated token, in order: the same as the
     * reply's list and as the non-streamed run. */
    assert_int_equal(s.n, res.n_tokens);
    assert_memory_equal(s.got, res.tokens, s.n * sizeof(uint32_t));
    assert_int_equal(res.n_tokens, ref.n_tokens);
    assert_memory_equal(res.tokens, ref.tokens, ref.n_tokens * sizeof(uint32_t));
    kvd_gen_result_free(&ref);
    kvd_gen_result_free(&res);
    kvd_close(c);
}

static void test_generate_stop(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result ref, res;
    struct kvd_gen_opts o;
    size_t first = 0;

    greedy(c, 12, &ref);
    /* Stop at the first occurrence of the third token. */
    uint32_t stop = ref.tokens[2];
    while (ref.tokens[first] != stop)
        first++;
    kvd_gen_opts_init(&o);
    o.max_tokens = 12;
    o.temperature = 0;
    o.stop = &stop;
    o.n_stop = 1;
    assert_int_equal(kvd_generate(c, prompt, 5, &o, &res), 0);
    assert_string_equal(res.finish_reason, "stop");
    assert_true(res.n_tokens == first || res.n_tokens == first + 1);
    assert_memory_equal(res.tokens, ref.tokens, res.n_tokens * sizeof(uint32_t));
    kvd_gen_result_free(&ref);
    kvd_gen_result_free(&res);
    kvd_close(c);
}

static void test_cancel_from_callback(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result res;
    struct kvd_gen_opts o;
    struct stream s = {.cancel_after = 1};
    struct kvd_hello_info h;

    /* Long enough that the cancel (sent after the first event) always lands
     * before the end, even on a loaded machine. */
    kvd_gen_opts_init(&o);
    o.max_tokens = 8000;
    o.temperature = 0;
    o.on_tokens = on_tokens;
    o.user = &s;
    assert_int_equal(kvd_generate(c, prompt, 5, &o, &res), 0);
    assert_string_equal(res.finish_reason, "cancelled");
    assert_true(res.n_tokens < 8000);
    kvd_gen_result_free(&res);
    /* The internal cancel's reply was consumed; the connection is in step. */
    assert_int_equal(kvd_pending(c), 0);
    assert_int_equal(kvd_hello(c, &h), 0);
    kvd_close(c);
}

static void test_cancel_by_id(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result res;
    struct kvd_gen_opts o;
    uint64_t id;

    kvd_gen_opts_init(&o);
    o.max_tokens = 8000;
    o.temperature = 0;
    assert_int_equal(kvd_generate_send(c, prompt, 5, &o, &id), 0);
    assert_int_equal(kvd_cancel(c, id), 0);
    assert_int_equal(kvd_generate_wait(c, id, &res), 0);
    assert_string_equal(res.finish_reason, "cancelled");
    assert_true(res.n_tokens < 8000);
    kvd_gen_result_free(&res);
    kvd_close(c);
}

static void test_generate_pipelined(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result ref, res;
    struct kvd_gen_opts o;
    uint64_t ids[6], seq;

    greedy(c, 10, &ref);
    kvd_gen_opts_init(&o);
    o.max_tokens = 10;
    o.temperature = 0;
    for (int i = 0; i < 6; i++)
        assert_int_equal(kvd_generate_send(c, prompt, 5, &o, &ids[i]), 0);
    /* A block-API call in between, answered while the generates run. */
    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    for (int i = 5; i >= 0; i--) {
        assert_int_equal(kvd_generate_wait(c, ids[i], &res), 0);
        assert_int_equal(res.n_tokens, 10);
        assert_memory_equal(res.tokens, ref.tokens, 10 * sizeof(uint32_t));
        kvd_gen_result_free(&res);
    }
    kvd_gen_result_free(&ref);
    kvd_close(c);
}

/* A prompt longer than a block: the second run finds its full blocks cached. */
static void test_prefix_cache_usage(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result a, b;
    struct kvd_gen_opts o;
    struct kvd_hello_info h;
    uint32_t longp[80];

    assert_int_equal(kvd_hello(c, &h), 0);
    for (int i = 0; i < 80; i++)
        longp[i] = (uint32_t)(7 * i + 3) % 256;
    kvd_gen_opts_init(&o);
    o.max_tokens = 4;
    o.temperature = 0;
    assert_int_equal(kvd_generate(c, longp, 80, &o, &a), 0);
    assert_int_equal(kvd_generate(c, longp, 80, &o, &b), 0);
    assert_int_equal(b.prompt_tokens, 80);
    assert_true(b.cached_tokens >= h.block_tokens);
    assert_int_equal(b.cached_tokens % h.block_tokens, 0);
    assert_memory_equal(a.tokens, b.tokens, a.n_tokens * sizeof(uint32_t));
    kvd_gen_result_free(&a);
    kvd_gen_result_free(&b);
    kvd_close(c);
}

static void test_generate_errors(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result res;
    struct kvd_gen_opts o;
    uint32_t bad[] = {1, 999};
    uint32_t stop = 4096;

    kvd_gen_opts_init(&o);
    o.max_tokens = 4;
    assert_int_equal(kvd_generate(c, bad, 2, &o, &res), KVD_EBADREQ);
    assert_non_null(strstr(c->errstr, "tokens"));
    o.stop = &stop;
    o.n_stop = 1;
    assert_int_equal(kvd_generate(c, prompt, 5, &o, &res), KVD_EBADREQ);
    assert_non_null(strstr(c->errstr, "stop"));
    /* Wrong types through the generic call. */
    struct kvd_arg args[] = {KVD_ARG_U32S("tokens", prompt, 5), KVD_ARG_S("temperature", "hot")};
    struct kvd_reply *r = NULL;
    assert_int_equal(kvd_call(c, KVD_OP_GENERATE, args, 2, &r), KVD_EBADREQ);
    assert_non_null(strstr(r->message, "temperature"));
    kvd_reply_free(r);
    /* Still fine afterwards. */
    kvd_gen_opts_init(&o);
    o.max_tokens = 2;
    assert_int_equal(kvd_generate(c, prompt, 5, &o, &res), 0);
    assert_int_equal(res.n_tokens, 2);
    kvd_gen_result_free(&res);
    kvd_close(c);
}

/* kvctl generate prints the ids as one comma-separated line; --stream
 * prints the same line as the tokens arrive. */
static void run_kvctl(const struct fixture *f, const char *const *args, char *out, size_t cap,
                      int *status)
{
    const char *argv[24];
    char path[192];
    int n = 0, st;
    argv[n++] = getenv("KVCTL_BIN");
    argv[n++] = "--socket";
    argv[n++] = f->d->sock;
    for (int i = 0; args[i]; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    snprintf(path, sizeof(path), "%s/kvctl.out", f->d->dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0)
            _exit(126);
        dup2(fd, 1);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    assert_int_equal(waitpid(pid, &st, 0), pid);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    FILE *fp = fopen(path, "r");
    assert_non_null(fp);
    size_t len = fread(out, 1, cap - 1, fp);
    out[len] = '\0';
    fclose(fp);
}

static void test_kvctl_generate(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_ok(f);
    struct kvd_gen_result ref;
    char want[1024] = "", out[1024];
    int status;

    greedy(c, 8, &ref);
    for (size_t i = 0; i < ref.n_tokens; i++)
        snprintf(want + strlen(want), sizeof(want) - strlen(want), "%s%u", i ? "," : "",
                 ref.tokens[i]);
    strcat(want, "\n");
    const char *plain[] = {"generate", "--tokens",      "1-5", "--max-tokens",
                           "8",        "--temperature", "0",   NULL};
    run_kvctl(f, plain, out, sizeof(out), &status);
    assert_int_equal(status, 0);
    assert_string_equal(out, want);
    const char *stream[] = {"generate", "--tokens",      "1,2,3,4,5", "--max-tokens",
                            "8",        "--temperature", "0",         "--stream",
                            NULL};
    run_kvctl(f, stream, out, sizeof(out), &status);
    assert_int_equal(status, 0);
    assert_string_equal(out, want);
    const char *json[] = {"generate", "--tokens", "1-5", "--max-tokens", "8", "--temperature",
                          "0",        "--json",   NULL};
    run_kvctl(f, json, out, sizeof(out), &status);
    assert_int_equal(status, 0);
    assert_non_null(strstr(out, "\"finish_reason\":\"length\""));
    kvd_gen_result_free(&ref);
    kvd_close(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_serve_mode),     cmocka_unit_test(test_generate_sync),
        cmocka_unit_test(test_generate_stream),      cmocka_unit_test(test_generate_stop),
        cmocka_unit_test(test_cancel_from_callback), cmocka_unit_test(test_cancel_by_id),
        cmocka_unit_test(test_generate_pipelined),   cmocka_unit_test(test_prefix_cache_usage),
        cmocka_unit_test(test_generate_errors),      cmocka_unit_test(test_kvctl_generate),
    };
    if (!getenv("KVD_BIN") || !getenv("KVCTL_BIN") || !getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "test_client_generate: KVD_BIN/KVCTL_BIN/KVD_TOOLS_DIR not set (run "
                        "through ctest)\n");
        return 77;
    }
    /* One daemon for the group: every test uses its own connection. */
    return cmocka_run_group_tests(tests, setup, teardown);
}
