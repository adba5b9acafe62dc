/* No single request may stall the event loop: against a real kvd, one
 * client sends what used to hold the loop for seconds (a 60 MiB tokenize,
 * a detokenize whose text is over max-frame, 7 MiB chat bodies over HTTP,
 * 32k-token text prompts), while a second connection times `hello`s. The
 * loop is shared by every tenant, so the second connection's round trips
 * are what any other tenant sees; each must stay under a generous bound
 * (VICTIM_MAX_MS: the failing case was seconds, 19 s for the tokenize),
 * counted without the time the loop and the victim merely waited for a CPU
 * (kh_rtt), so a machine loaded by others cannot fail it.
 * Each hostile request must also get its own clear refusal. */
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/protocol.h"
#include "kvd_harness.h"

/* The failing cases took seconds (19 s for the tokenize, 794 ms per chat
 * body). A sanitizer build runs the daemon several times slower, and its
 * allocator recycles the workers' large freed buffers in whichever thread
 * frees next, the loop's included (a 577 ms spike seen once): its bound is
 * wider, and the plain build's 250 ms is the check that counts. The test
 * runs alone (RUN_SERIAL) so the machine's other tests do not add to it. */
#if defined(__SANITIZE_ADDRESS__)
#define VICTIM_MAX_MS 1000.0
#else
#define VICTIM_MAX_MS 250.0
#endif

static char g_dir[64], g_model[128];

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int group_setup(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[768];
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvd-stall-XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof(g_model), "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof(cmd),
             "'%s/kvd-gguf-gen' -o '%s' --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 4096 --ctx 32768 --type f32 --chat-template "
             "'%s/tests/text/templates/chatml.jinja' >/dev/null",
             tools, g_model, KVD_SOURCE_DIR);
    return system(cmd) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    unlink(g_model);
    rmdir(g_dir);
    return 0;
}

static void start(struct kh_proc *p, const char *const *extra)
{
    const char *args[40] = {
        "--model",         g_model, "--backend",     "cpu", "--threads", "1", "--no-roofline-probe",
        "--device-blocks", "64",    "--host-blocks", "16"};
    int n = 11;
    for (int i = 0; extra && extra[i] && n < 39; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(kh_start(p, NULL, args), 0);
}

/* The attacker: runs fn(arg) on its own thread while the caller times the
 * victim's hellos; returns the slowest hello (ms, less the time the loop
 * and the victim only waited for a CPU: kh_rtt) and how many ran. */
struct attack {
    void (*fn)(void *arg);
    void *arg;
    atomic_bool done;
};

static void *attack_main(void *p)
{
    struct attack *a = p;
    a->fn(a->arg);
    atomic_store(&a->done, true);
    return NULL;
}

static double victim_while(const struct kh_proc *p, void (*fn)(void *), void *arg,
                           unsigned *n_hellos)
{
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    struct attack a = {.fn = fn, .arg = arg};
    atomic_init(&a.done, false);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, attack_main, &a), 0);
    double worst = 0, worst_wall = 0;
    unsigned n = 0;
    uint64_t id = 1;
    /* At least a few hellos even when the attack is over at once. */
    while (!atomic_load(&a.done) || n < 5) {
        struct kh_reply r;
        struct kh_rtt rtt;
        double stall;
        kh_rtt_begin(&rtt, p->pid);
        assert_int_equal(kh_call0(fd, "hello", id++, &r), 0);
        double wall = kh_rtt_end(&rtt, &stall);
        kh_reply_free(&r);
        worst = stall > worst ? stall : worst;
        worst_wall = wall > worst_wall ? wall : worst_wall;
        n++;
    }
    pthread_join(t, NULL);
    close(fd);
    print_message("  (slowest hello %.1f ms of wall time; the machine's load taken out: %.1f ms)\n",
                  worst_wall, worst);
    *n_hellos = n;
    return worst;
}

/* ---- tokenize of 60 MiB --------------------------------------------------- */

/* One client sending `rounds` requests of op with a text of `bytes`
 * bytes ("tokenize", or "generate" with max_tokens 1), one at a time. */
struct tok_attack {
    const char *sock;
    const char *op;
    size_t bytes;
    int rounds;
    int codes[8];
    char message[256];
};

static void text_attack(void *p)
{
    struct tok_attack *a = p;
    bool gen = !strcmp(a->op, "generate");
    char *text = malloc(a->bytes);
    assert_non_null(text);
    for (size_t i = 0; i < a->bytes; i++)
        text[i] = "abcdefgh "[i % 9];
    int fd = kh_connect(a->sock);
    assert_true(fd >= 0);
    for (int k = 0; k < a->rounds; k++) {
        struct kh_req q;
        kh_req_begin(&q, a->op, 100 + k, gen ? 2 : 1);
        proto_pack_kvn_str(&q.pk, "text", 4, text, a->bytes);
        if (gen)
            proto_pack_kv_uint(&q.pk, "max_tokens", 1);
        assert_int_equal(kh_req_send(fd, &q), 0);
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        a->codes[k] = r.code;
        snprintf(a->message, sizeof(a->message), "%s", r.message);
        kh_reply_free(&r);
    }
    close(fd);
    free(text);
}

static void test_tokenize_60mib(void **state)
{
    (void)state;
    struct kh_proc p;
    start(&p, NULL);
    struct tok_attack a = {
        .sock = p.sock, .op = "tokenize", .bytes = (size_t)60 << 20, .rounds = 3};
    unsigned n = 0;
    double worst = victim_while(&p, text_attack, &a, &n);
    for (int k = 0; k < a.rounds; k++)
        assert_int_equal(a.codes[k], KVD_ETOOLARGE);
    if (!strstr(a.message, "max-text-bytes"))
        fail_msg("the refusal does not name max-text-bytes: %s", a.message);
    if (worst > VICTIM_MAX_MS)
        fail_msg("a hello took %.1f ms (of %u) during 60 MiB tokenizes", worst, n);
    print_message("60 MiB tokenize x%d: victim's slowest hello %.2f ms (%u hellos)\n", a.rounds,
                  worst, n);
    assert_int_equal(kh_stop(&p), 0);
}

/* Texts under max-text-bytes that make more tokens than a reply may hold
 * stop being encoded at the bound (KVD_MAX_ARRAY), off the loop. */
static void test_tokenize_token_bound(void **state)
{
    (void)state;
    struct kh_proc p;
    const char *extra[] = {"--max-text-bytes", "16M", NULL};
    start(&p, extra);
    /* "abcdefgh " makes several tokens per 9 bytes with this vocabulary:
     * 8 MiB is well over KVD_MAX_ARRAY tokens. */
    struct tok_attack a = {.sock = p.sock, .op = "tokenize", .bytes = (size_t)8 << 20, .rounds = 2};
    unsigned n = 0;
    double worst = victim_while(&p, text_attack, &a, &n);
    for (int k = 0; k < a.rounds; k++)
        assert_int_equal(a.codes[k], KVD_ETOOLARGE);
    if (!strstr(a.message, "more than"))
        fail_msg("unexpected refusal: %s", a.message);
    if (worst > VICTIM_MAX_MS)
        fail_msg("a hello took %.1f ms (of %u) during 8 MiB tokenizes", worst, n);
    print_message("8 MiB tokenize over the token bound x%d: slowest hello %.2f ms\n", a.rounds,
                  worst);
    assert_int_equal(kh_stop(&p), 0);
}

/* A tenant holds at most --text-jobs-per-tenant (1) texts at the text
 * workers: a small tokenize pipelined right behind an 8 MiB one (still
 * being tokenized) is refused busy naming the key; the big one is
 * answered. */
static void test_text_jobs_per_tenant_busy(void **state)
{
    (void)state;
    struct kh_proc p;
    const char *extra[] = {
        "--text-workers", "1", "--text-jobs-per-tenant", "1", "--max-text-bytes", "16M", NULL};
    start(&p, extra);
    size_t big = (size_t)8 << 20;
    char *text = malloc(big);
    assert_non_null(text);
    for (size_t i = 0; i < big; i++)
        text[i] = "abcdefgh "[i % 9];
    int fd = kh_connect(p.sock);
    struct kh_req q;
    kh_req_begin(&q, "tokenize", 1, 1);
    proto_pack_kvn_str(&q.pk, "text", 4, text, big);
    assert_int_equal(kh_req_send(fd, &q), 0);
    kh_req_begin(&q, "tokenize", 2, 1);
    proto_pack_kv_str(&q.pk, "text", "hi");
    assert_int_equal(kh_req_send(fd, &q), 0);
    free(text);
    bool got[3] = {false};
    for (int k = 0; k < 2; k++) {
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        assert_true(r.id == 1 || r.id == 2);
        got[r.id] = true;
        if (r.id == 2 && (r.code != KVD_EBUSY || !strstr(r.message, "text-jobs-per-tenant")))
            fail_msg("the second tokenize: code %d, %s", r.code, r.message);
        if (r.id == 1)
            assert_int_not_equal(r.code, KVD_EBUSY);
        kh_reply_free(&r);
    }
    assert_true(got[1] && got[2]);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

/* ---- detokenize past max-frame --------------------------------------------- */

struct detok_attack {
    const char *sock;
    size_t n;
    int code;
    char message[256];
};

static void detokenize_attack(void *p)
{
    struct detok_attack *a = p;
    int fd = kh_connect(a->sock);
    assert_true(fd >= 0);
    uint32_t *ids = malloc(a->n * sizeof(uint32_t));
    assert_non_null(ids);
    for (size_t i = 0; i < a->n; i++)
        ids[i] = 4000; /* "\u2581t4000": " t4000", 6 bytes of text each */
    struct kh_req q;
    kh_req_begin(&q, "detokenize", 7, 1);
    proto_pack_kv_u32_array(&q.pk, "tokens", ids, a->n);
    free(ids);
    assert_int_equal(kh_req_send(fd, &q), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    a->code = r.code;
    snprintf(a->message, sizeof(a->message), "%s", r.message);
    kh_reply_free(&r);
    close(fd);
}

static void test_detokenize_over_max_frame(void **state)
{
    (void)state;
    struct kh_proc p;
    const char *extra[] = {"--max-frame", "1M", NULL};
    start(&p, extra);
    /* 300k ids of 3 bytes each fit a 1 MiB request; their 1.8 MB of text
     * does not fit the reply. */
    struct detok_attack a = {.sock = p.sock, .n = 300000};
    unsigned n = 0;
    double worst = victim_while(&p, detokenize_attack, &a, &n);
    assert_int_equal(a.code, KVD_ETOOLARGE);
    if (!strstr(a.message, "max-frame"))
        fail_msg("the refusal does not name max-frame: %s", a.message);
    if (worst > VICTIM_MAX_MS)
        fail_msg("a hello took %.1f ms during the detokenize", worst);
    print_message("detokenize of 300k ids past max-frame: slowest hello %.2f ms (%u hellos)\n",
                  worst, n);
    /* One that fits is answered. */
    int fd = kh_connect(p.sock);
    uint32_t ids[3] = {4000, 4001, 4002};
    struct kh_req q;
    kh_req_begin(&q, "detokenize", 8, 1);
    proto_pack_kv_u32_array(&q.pk, "tokens", ids, 3);
    assert_int_equal(kh_req_send(fd, &q), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

/* ---- generate with 32k-token texts ------------------------------------------ */

static void test_generate_long_texts(void **state)
{
    (void)state;
    struct kh_proc p;
    start(&p, NULL);
    /* 256 KiB: tens of thousands of tokens, more than the context: each is
     * tokenized in full (on a worker) and refused. */
    struct tok_attack a = {
        .sock = p.sock, .op = "generate", .bytes = (size_t)256 << 10, .rounds = 4};
    unsigned n = 0;
    double worst = victim_while(&p, text_attack, &a, &n);
    for (int k = 0; k < a.rounds; k++)
        assert_true(a.codes[k] == KVD_EBADREQ || a.codes[k] == KVD_ETOOLARGE);
    if (!strstr(a.message, "'text'"))
        fail_msg("the refusal does not name 'text': %s", a.message);
    if (worst > VICTIM_MAX_MS)
        fail_msg("a hello took %.1f ms (of %u) during long text prompts", worst, n);
    print_message("256 KiB text prompts x%d: slowest hello %.2f ms\n", a.rounds, worst);
    assert_int_equal(kh_stop(&p), 0);
}

/* ---- 7 MiB chat bodies over HTTP -------------------------------------------- */

struct http_attack {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    int rounds;
    int status[8];
    char body[4096];
};

static int http_connect(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    return fd;
}

static void chat_attack(void *p)
{
    struct http_attack *a = p;
    size_t content = (size_t)7 << 20;
    size_t cap = content + 256;
    char *json = malloc(cap);
    assert_non_null(json);
    size_t len = (size_t)snprintf(json, cap, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    memset(json + len, 'a', content);
    len += content;
    len += (size_t)snprintf(json + len, cap - len, "\"}]}");
    for (int k = 0; k < a->rounds; k++) {
        int fd = http_connect(a->path);
        assert_true(fd >= 0);
        char head[256];
        int hl = snprintf(head, sizeof(head),
                          "POST /v1/chat/completions HTTP/1.1\r\nHost: kvd\r\n"
                          "Content-Type: application/json\r\nContent-Length: %zu\r\n"
                          "Connection: close\r\n\r\n",
                          len);
        assert_int_equal(kh_send_raw(fd, head, (size_t)hl), 0);
        assert_int_equal(kh_send_raw(fd, json, len), 0);
        char resp[4096];
        size_t got = 0;
        ssize_t r;
        while (got < sizeof(resp) - 1 && (r = read(fd, resp + got, sizeof(resp) - 1 - got)) > 0)
            got += (size_t)r;
        resp[got] = '\0';
        close(fd);
        a->status[k] = 0;
        sscanf(resp, "HTTP/1.1 %d", &a->status[k]);
        const char *b = strstr(resp, "\r\n\r\n");
        snprintf(a->body, sizeof(a->body), "%s", b ? b + 4 : resp);
    }
    free(json);
}

static void test_chat_bodies_7mib(void **state)
{
    (void)state;
    struct kh_proc p;
    char hs[64];
    snprintf(hs, sizeof(hs), "/tmp/kvd-stall-http-%d.sock", (int)getpid());
    const char *extra[] = {"--http-socket", hs, NULL};
    start(&p, extra);
    struct http_attack a = {.rounds = 5};
    snprintf(a.path, sizeof(a.path), "%s", hs);
    unsigned n = 0;
    double worst = victim_while(&p, chat_attack, &a, &n);
    for (int k = 0; k < a.rounds; k++)
        if (a.status[k] != 413)
            fail_msg("body %d: status %d, expected 413: %s", k, a.status[k], a.body);
    if (!strstr(a.body, "\"param\":\"messages\"") || !strstr(a.body, "max-text-bytes"))
        fail_msg("the 413 does not name messages and max-text-bytes: %s", a.body);
    if (worst > VICTIM_MAX_MS)
        fail_msg("a hello took %.1f ms (of %u) during 7 MiB chat bodies", worst, n);
    print_message("7 MiB chat bodies x%d: slowest hello %.2f ms (%u hellos)\n", a.rounds, worst, n);
    assert_int_equal(kh_stop(&p), 0);
    unlink(hs);
}

/* ---- chat templates ------------------------------------------------------ */

/* Doubles a string to 16 MiB and tests its length a million times: inside
 * the step, memory and output bounds, over an hour of work before. */
static const char hostile_tmpl[] =
    "{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{% for i in range(1000000) %}{% if ns.s|length > 0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}";
/* Harmless but for one message content ("boom"): passes the load-time test
 * render, and is hostile for the requests that send that content. */
static const char trap_tmpl[] =
    "{% for m in messages %}{% if m.content == 'boom' %}{% set ns = namespace(s='x') %}"
    "{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{% for i in range(1000000) %}{% if ns.s|length > 0 %}{% endif %}{% endfor %}"
    "{% endif %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>";

static void write_file(const char *path, const char *s)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(s, f) >= 0, 1);
    fclose(f);
}

/* The model's own template (tokenizer.chat_template) is test-rendered at
 * load: the hostile one is refused, the daemon serves tokens, and a
 * `messages` request says why. A --chat-template file like it is a
 * start-up error. */
static void test_hostile_template_refused_at_load(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    char tp[128], mp[128], cmd[768];
    snprintf(tp, sizeof(tp), "%s/hostile.jinja", g_dir);
    snprintf(mp, sizeof(mp), "%s/hostile.gguf", g_dir);
    write_file(tp, hostile_tmpl);
    snprintf(cmd, sizeof(cmd),
             "'%s/kvd-gguf-gen' -o '%s' --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 4096 --ctx 2048 --type f32 --chat-template '%s' >/dev/null",
             tools, mp, tp);
    assert_int_equal(system(cmd), 0);
    struct kh_proc p;
    const char *args[] = {"--model",   mp,  "--backend",           "cpu",
                          "--threads", "1", "--no-roofline-probe", NULL};
    assert_int_equal(kh_start(&p, NULL, args), 0);
    int fd = kh_connect(p.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    const msgpack_object *model = kh_obj(r.root, "model");
    const msgpack_object *ct = model ? kh_obj(model, "chat_template") : NULL;
    assert_non_null(ct);
    assert_int_equal(ct->type, MSGPACK_OBJECT_BOOLEAN);
    assert_false(ct->via.boolean);
    kh_reply_free(&r);
    /* tokens still work */
    uint32_t toks[3] = {5, 6, 7};
    struct kh_req q;
    kh_req_begin(&q, "generate", 2, 2);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 3);
    proto_pack_kv_uint(&q.pk, "max_tokens", 2);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    /* messages: unsupported, saying the template was refused and why */
    kh_req_begin(&q, "generate", 3, 2);
    proto_pack_str(&q.pk, "messages");
    proto_pack_array(&q.pk, 1);
    proto_pack_map(&q.pk, 2);
    proto_pack_kv_str(&q.pk, "role", "user");
    proto_pack_kv_str(&q.pk, "content", "hi");
    proto_pack_kv_uint(&q.pk, "max_tokens", 2);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EUNSUPPORTED);
    if (!strstr(r.message, "refused") ||
        (!strstr(r.message, "MiB of work") && !strstr(r.message, "more than 2000 ms")))
        fail_msg("unexpected refusal: %s", r.message);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
    /* the same template given by the operator: kvd does not start */
    const char *args2[] = {"--model",         g_model, "--backend",           "cpu",
                           "--chat-template", tp,      "--no-roofline-probe", NULL};
    struct kh_opts o = {.args = args2};
    assert_int_not_equal(kh_run(&o), 0);
    unlink(mp);
    unlink(tp);
}

/* A generate of one user message "boom" (what trap_tmpl explodes on). */
static void pack_boom(struct kh_req *q, uint64_t id)
{
    kh_req_begin(q, "generate", id, 2);
    proto_pack_str(&q->pk, "messages");
    proto_pack_array(&q->pk, 1);
    proto_pack_map(&q->pk, 2);
    proto_pack_kv_str(&q->pk, "role", "user");
    proto_pack_kv_str(&q->pk, "content", "boom");
    proto_pack_kv_uint(&q->pk, "max_tokens", 1);
}

struct chat_attack {
    const char *sock;
    int rounds;
    int codes[8];
    char message[256];
};

static void trap_attack(void *p)
{
    struct chat_attack *a = p;
    int fd = kh_connect(a->sock);
    assert_true(fd >= 0);
    for (int k = 0; k < a->rounds; k++) {
        struct kh_req q;
        pack_boom(&q, 300 + k);
        assert_int_equal(kh_req_send(fd, &q), 0);
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        a->codes[k] = r.code;
        snprintf(a->message, sizeof(a->message), "%s", r.message);
        kh_reply_free(&r);
    }
    close(fd);
}

/* A template hostile only for some contents reaches request time: its
 * renders run on the text workers (the loop stays fast), each ends at the
 * work budget with the reason, and SIGTERM ends the daemon promptly while
 * such renders are running. */
static void test_hostile_render_at_request_time(void **state)
{
    (void)state;
    char tp[128];
    snprintf(tp, sizeof(tp), "%s/trap.jinja", g_dir);
    write_file(tp, trap_tmpl);
    struct kh_proc p;
    const char *extra[] = {"--chat-template", tp, NULL};
    start(&p, extra);
    struct chat_attack a = {.sock = p.sock, .rounds = 2};
    unsigned n = 0;
    double worst = victim_while(&p, trap_attack, &a, &n);
    for (int k = 0; k < a.rounds; k++)
        assert_int_equal(a.codes[k], KVD_ETOOLARGE);
    /* the work budget, or on a loaded machine the time bound first */
    if (!strstr(a.message, "'messages'") ||
        (!strstr(a.message, "MiB of work") && !strstr(a.message, "more than 2000 ms")))
        fail_msg("unexpected refusal: %s", a.message);
    if (worst > VICTIM_MAX_MS)
        fail_msg("a hello took %.1f ms (of %u) during hostile renders", worst, n);
    print_message("hostile renders x%d: slowest hello %.2f ms (%u hellos)\n", a.rounds, worst, n);
    /* SIGTERM while renders of it are queued and running */
    int fd = kh_connect(p.sock);
    for (int k = 0; k < 4; k++) {
        struct kh_req q;
        pack_boom(&q, 400 + k);
        assert_int_equal(kh_req_send(fd, &q), 0);
    }
    double t0 = now_ms();
    assert_int_equal(kh_stop(&p), 0);
    double dt = now_ms() - t0;
    close(fd);
    /* each running render ends within its time bound (2 s) */
    if (dt > 15000)
        fail_msg("SIGTERM took %.0f ms with hostile renders running", dt);
    print_message("SIGTERM with hostile renders queued: %.0f ms\n", dt);
    unlink(tp);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenize_60mib),
        cmocka_unit_test(test_tokenize_token_bound),
        cmocka_unit_test(test_text_jobs_per_tenant_busy),
        cmocka_unit_test(test_detokenize_over_max_frame),
        cmocka_unit_test(test_generate_long_texts),
        cmocka_unit_test(test_chat_bodies_7mib),
        cmocka_unit_test(test_hostile_template_refused_at_load),
        cmocka_unit_test(test_hostile_render_at_request_time),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
