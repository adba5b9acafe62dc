/* bench_hostile: hostile-client scenarios, measured against
 * a real kvd (a program that prints numbers, not a test; run as root: the
 * victim runs under another uid so it is another tenant).
 *
 *   bench_hostile pipeline N   one connection (tenant "uid:0") pipelines N
 *                              generates of 1 token; another tenant's
 *                              4-token generates are timed before (idle) and
 *                              during the flood. Prints the flood's time and
 *                              the victim's latencies.
 *   bench_hostile bigframes N M  N clients in turn send one invalid frame of
 *                              M MiB each; prints kvd's RSS after they left.
 *   bench_hostile noread K T   K streamed generates of up to T tokens on one
 *                              connection that never reads; prints kvd's RSS
 *                              before, at its peak, and after the client
 *                              leaves.
 *   bench_hostile text N BYTES [R]  tenant "uid:0" keeps N generates in
 *                              flight, each a `text` prompt of BYTES bytes
 *                              (max_tokens 1), sending one more per answer;
 *                              meanwhile another tenant sends R `hello`s one
 *                              at a time (default 20000). Prints the victim's
 *                              hello p50/p99/max idle and under the load,
 *                              the attacker's answers per second and their
 *                              codes.
 *   bench_hostile chat N MSGS [R]  the same with `messages`: MSGS messages of
 *                              3 KiB each (user and assistant in turn)
 *                              rendered by the chat template
 *                              tests/text/templates/mistral-v3.jinja (or
 *                              $KVD_BENCH_TEMPLATE), passed to kvd as
 *                              --chat-template.
 * The text and chat modes use a model of context 32768 (the others 2048).
 *
 * Environment: KVD_BIN, KVD_TOOLS_DIR (as in ctest), KVD_BENCH_ARGS (extra
 * kvd arguments, space-separated: e.g. the limits). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvd_harness.h"

static int g_go_fd;
static unsigned g_go_at;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static struct kh_proc g_kvd;
static char g_model[160];

static int start(uint32_t ctx, const char *tmpl)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char dir[] = "/tmp/kvd-bench-XXXXXX", cmd[600];
    if (!tools || !mkdtemp(dir))
        return -1;
    snprintf(g_model, sizeof(g_model), "%s/m.gguf", dir);
    snprintf(cmd, sizeof(cmd),
             "'%s/kvd-gguf-gen' -o '%s' --layers 4 --embd 256 --heads 8 --kv-heads 4 --ff 704 "
             "--vocab 4096 --ctx %u >/dev/null",
             tools, g_model, ctx);
    if (system(cmd) != 0)
        return -1;
    static const char *args[64] = {"--model",
                                   NULL,
                                   "--backend",
                                   "cpu",
                                   "--device-blocks",
                                   "4096",
                                   "--host-blocks",
                                   "0",
                                   "--no-roofline-probe",
                                   "--socket-group",
                                   "nogroup",
                                   "--threads",
                                   "1"};
    args[1] = g_model;
    int n = 13;
    if (tmpl) {
        args[n++] = "--chat-template";
        args[n++] = tmpl;
    }
    char *extra = getenv("KVD_BENCH_ARGS") ? strdup(getenv("KVD_BENCH_ARGS")) : NULL;
    for (char *t = extra ? strtok(extra, " ") : NULL; t && n < 62; t = strtok(NULL, " "))
        args[n++] = t;
    args[n] = NULL;
    return kh_start(&g_kvd, NULL, args);
}

static int gen(int fd, uint64_t id, uint32_t max_tokens, bool stream)
{
    static const uint32_t toks[4] = {1, 2, 3, 4};
    struct kh_req q;
    kh_req_begin(&q, "generate", id, 3);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 4);
    proto_pack_kv_uint(&q.pk, "max_tokens", max_tokens);
    proto_pack_kv_bool(&q.pk, "stream", stream);
    return kh_req_send(fd, &q);
}

/* The victim (another uid): `rounds` 4-token generates one after another;
 * writes each latency (ms, double) to `out`. */
struct victim {
    int out, rounds, go;
};

static int victim_main(void *arg)
{
    struct victim *v = arg;
    int fd = kh_connect(g_kvd.sock);
    if (fd < 0)
        return 10;
    char c;
    if (read(v->go, &c, 1) != 1)
        return 11;
    for (int i = 0; i < v->rounds; i++) {
        struct kh_reply r;
        double t0 = now_s();
        if (gen(fd, 1 + (uint64_t)i, 4, false) || kh_recv(fd, &r))
            return 12;
        double ms = (now_s() - t0) * 1e3;
        int code = r.code;
        kh_reply_free(&r);
        if (code)
            return 13;
        if (write(v->out, &ms, sizeof(ms)) != sizeof(ms))
            return 14;
    }
    return 0;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Runs the victim for `rounds` and prints p50/max, optionally while `flood`
 * returns the flood's elapsed time (run in this thread meanwhile). */
static void victim_run(const char *label, int rounds, double (*flood)(unsigned), unsigned n)
{
    int lat[2], go[2];
    if (pipe(lat) || pipe(go))
        exit(1);
    struct victim v = {lat[1], rounds, go[0]};
    pid_t pid = kh_run_as(60002, 65534, victim_main, &v);
    double t_flood = 0;
    if (flood) {
        /* the victim starts once a tenth of the flood is answered, so it
         * runs while the flood's queue is deep */
        g_go_fd = go[1];
        g_go_at = n / 10;
        t_flood = flood(n);
    } else if (write(go[1], "x", 1) != 1) {
        exit(1);
    }
    double *ms = calloc((size_t)rounds, sizeof(double));
    int got = 0;
    while (got < rounds && read(lat[0], &ms[got], sizeof(double)) == sizeof(double))
        got++;
    int st = kh_child_status(pid);
    qsort(ms, (size_t)got, sizeof(double), cmp_d);
    printf("%s: victim (uid 60002) %d generates of 4 tokens: p50 %.2f ms, max %.2f ms "
           "(child status %d)",
           label, got, got ? ms[got / 2] : 0, got ? ms[got - 1] : 0, st);
    if (flood)
        printf("; flood of %u pipelined generates took %.2f s (%.1f us each)", n, t_flood,
               t_flood / n * 1e6);
    printf("\n");
    free(ms);
    close(lat[0]);
    close(lat[1]);
    close(go[0]);
    close(go[1]);
}

struct writer {
    int fd;
    unsigned n;
};

static void *writer_main(void *arg)
{
    struct writer *w = arg;
    msgpack_sbuffer all;
    msgpack_sbuffer_init(&all);
    for (unsigned i = 0; i < w->n; i++) {
        static const uint32_t toks[2] = {5, 6};
        struct kh_req q;
        kh_req_begin(&q, "generate", 1 + (uint64_t)i, 2);
        proto_pack_kv_u32_array(&q.pk, "tokens", toks, 2);
        proto_pack_kv_uint(&q.pk, "max_tokens", 1);
        proto_frame_end(&q.sb, q.at);
        msgpack_sbuffer_write(&all, q.sb.data, q.sb.size);
        msgpack_sbuffer_destroy(&q.sb);
    }
    kh_send_raw(w->fd, all.data, all.size);
    msgpack_sbuffer_destroy(&all);
    return NULL;
}

static unsigned g_busy, g_ok;

/* One connection pipelines n 1-token generates and reads every reply. */
static double flood(unsigned n)
{
    int fd = kh_connect(g_kvd.sock);
    pthread_t th;
    struct writer w = {fd, n};
    double t0 = now_s();
    pthread_create(&th, NULL, writer_main, &w);
    g_busy = g_ok = 0;
    for (unsigned i = 0; i < n; i++) {
        struct kh_reply r;
        if (kh_recv(fd, &r))
            break;
        if (g_go_fd >= 0 && i == g_go_at) {
            if (write(g_go_fd, "x", 1) != 1)
                exit(1);
            g_go_fd = -1;
        }
        if (r.code == 0)
            g_ok++;
        else if (r.code == KVD_EBUSY)
            g_busy++;
        kh_reply_free(&r);
    }
    double t = now_s() - t0;
    pthread_join(th, NULL);
    close(fd);
    return t;
}

static long rss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f && fgets(line, sizeof(line), f))
        if (!strncmp(line, "VmRSS:", 6))
            kb = atol(line + 6);
    if (f)
        fclose(f);
    return kb;
}

static void noread(unsigned k, unsigned t)
{
    int ctl = kh_connect(g_kvd.sock);
    long before = rss_kb(g_kvd.pid), peak = before;
    int fd = kh_connect(g_kvd.sock);
    for (unsigned i = 0; i < k; i++)
        gen(fd, 1 + i, t, true);
    /* never read fd: watch RSS until the daemon is done with them */
    double t0 = now_s();
    uint64_t sub0 = kh_stat(ctl, "requests", "submitted");
    for (;;) {
        long kb = rss_kb(g_kvd.pid);
        if (kb > peak)
            peak = kb;
        uint64_t live = kh_stat(ctl, "requests", "live");
        uint64_t sub = kh_stat(ctl, "requests", "submitted");
        if ((live == 0 && sub >= sub0 + k) || now_s() - t0 > 120)
            break;
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
    long held = rss_kb(g_kvd.pid);
    close(fd);
    struct timespec ts = {0, 500 * 1000000};
    nanosleep(&ts, NULL);
    long after = rss_kb(g_kvd.pid);
    printf("noread: %u streamed generates of %u tokens, never read: kvd RSS %ld MB before, "
           "%ld MB peak, %ld MB while the client stays, %ld MB after it leaves\n",
           k, t, before / 1024, peak / 1024, held / 1024, after / 1024);
    close(ctl);
}

/* n clients in turn each send one whole frame of mb MiB that is not a
 * valid message (kvd buffers it, rejects it, closes); RSS after they left. */
static void bigframes(unsigned n, unsigned mb)
{
    int ctl = kh_connect(g_kvd.sock);
    long before = rss_kb(g_kvd.pid), peak = before;
    size_t len = (size_t)mb << 20;
    uint8_t *buf = calloc(1, len + 4);
    buf[0] = (uint8_t)(len >> 24);
    buf[1] = (uint8_t)(len >> 16);
    buf[2] = (uint8_t)(len >> 8);
    buf[3] = (uint8_t)len;
    memset(buf + 4, 0xc1, len); /* 0xc1 is never valid msgpack */
    for (unsigned i = 0; i < n; i++) {
        int fd = kh_connect(g_kvd.sock);
        kh_send_raw(fd, buf, len + 4);
        struct kh_reply r;
        if (kh_recv(fd, &r) == 0)
            kh_reply_free(&r);
        kh_peer_closed(fd);
        close(fd);
        long kb = rss_kb(g_kvd.pid);
        if (kb > peak)
            peak = kb;
    }
    while (kh_stat(ctl, NULL, "connections") > 1) {
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
    struct timespec ts = {0, 500 * 1000000};
    nanosleep(&ts, NULL); /* the trim runs 200 ms after the release */
    long after = rss_kb(g_kvd.pid);
    printf("bigframes: %u clients sent a %u MiB invalid frame each: kvd RSS %ld MB before, "
           "%ld MB peak, %ld MB after they left\n",
           n, mb, before / 1024, peak / 1024, after / 1024);
    free(buf);
    close(ctl);
}

/* --- text and chat: another tenant's hello while one tenant sends texts --- */

static char *g_text; /* text mode: the prompt */
static size_t g_text_len;
static char **g_msg; /* chat mode: the messages' contents */
static unsigned g_n_msgs;

/* Deterministic words of 2-9 lowercase letters separated by spaces, len
 * bytes: the built-in vocabulary has no piece for them, so each byte is a
 * byte token (a space three: U+2581's UTF-8 bytes) and the tokenizer tries
 * every pair. */
static char *make_text(size_t len, uint64_t seed)
{
    char *t = malloc(len + 1);
    if (!t)
        exit(1);
    uint64_t x = seed;
    size_t i = 0;
    while (i < len) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        unsigned w = 2 + (unsigned)(x >> 60) % 8;
        for (unsigned k = 0; k < w && i < len; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            t[i++] = (char)('a' + (x >> 59) % 26);
        }
        if (i < len)
            t[i++] = ' ';
    }
    t[len] = '\0';
    return t;
}

static int hostile_send(int fd, uint64_t id)
{
    struct kh_req q;
    kh_req_begin(&q, "generate", id, 2);
    if (g_text)
        proto_pack_kvn_str(&q.pk, "text", 4, g_text, g_text_len);
    else {
        msgpack_pack_str(&q.pk, 8);
        msgpack_pack_str_body(&q.pk, "messages", 8);
        proto_pack_array(&q.pk, g_n_msgs);
        for (unsigned i = 0; i < g_n_msgs; i++) {
            /* mistral-v3 wants user, assistant, user, ... */
            bool user = i % 2 == 0;
            proto_pack_map(&q.pk, 2);
            proto_pack_kv_str(&q.pk, "role", user ? "user" : "assistant");
            proto_pack_kv_str(&q.pk, "content", g_msg[i]);
        }
    }
    proto_pack_kv_uint(&q.pk, "max_tokens", 1);
    return kh_req_send(fd, &q);
}

struct attacker {
    unsigned n;        /* in flight */
    volatile int stop; /* set by the main thread: refill no more */
    int go;            /* written once the first n answers are in */
    unsigned answered, ok, bad, large, busy, other;
    double t_start, t_end;   /* from the first answer after `go` to the stop */
    unsigned answered_at_go; /* answers before go (warm-up) */
    char first_msg[256];     /* the first answer's error message */
};

static void *attacker_main(void *arg)
{
    struct attacker *a = arg;
    int fd = kh_connect(g_kvd.sock);
    if (fd < 0)
        exit(1);
    uint64_t id = 0;
    unsigned live = 0;
    for (; live < a->n; live++)
        if (hostile_send(fd, ++id))
            exit(1);
    bool went = false;
    while (live > 0) {
        struct kh_reply r;
        if (kh_recv(fd, &r)) {
            fprintf(stderr, "attacker: no answer\n");
            exit(1);
        }
        live--;
        if (a->answered == 0)
            snprintf(a->first_msg, sizeof(a->first_msg), "%s", r.message);
        a->answered++;
        if (r.code == 0)
            a->ok++;
        else if (r.code == KVD_EBADREQ)
            a->bad++;
        else if (r.code == KVD_ETOOLARGE)
            a->large++;
        else if (r.code == KVD_EBUSY)
            a->busy++;
        else
            a->other++;
        kh_reply_free(&r);
        if (!went && a->answered >= a->n) { /* steady state: the victim starts */
            went = true;
            a->answered_at_go = a->answered;
            a->t_start = now_s();
            if (write(a->go, "x", 1) != 1)
                exit(1);
        }
        if (!a->stop) {
            if (hostile_send(fd, ++id))
                exit(1);
            live++;
        } else if (a->t_end == 0) {
            a->t_end = now_s();
        }
    }
    close(fd);
    return NULL;
}

/* The victim of the text modes: `rounds` hellos one at a time. */
static int hello_main(void *arg)
{
    struct victim *v = arg;
    int fd = kh_connect(g_kvd.sock);
    if (fd < 0)
        return 10;
    char c;
    if (read(v->go, &c, 1) != 1)
        return 11;
    for (int i = 0; i < v->rounds; i++) {
        struct kh_reply r;
        double t0 = now_s();
        int code = kh_call0(fd, "hello", 1 + (uint64_t)i, &r);
        double ms = (now_s() - t0) * 1e3;
        kh_reply_free(&r);
        if (code)
            return 13;
        if (write(v->out, &ms, sizeof(ms)) != sizeof(ms))
            return 14;
    }
    return 0;
}

/* Runs the hello victim for `rounds`, under the attacker when n > 0. */
static void hello_run(const char *label, int rounds, unsigned n)
{
    int lat[2], go[2];
    if (pipe(lat) || pipe(go))
        exit(1);
    struct victim v = {lat[1], rounds, go[0]};
    pid_t pid = kh_run_as(60002, 65534, hello_main, &v);
    struct attacker a = {.n = n, .go = go[1]};
    pthread_t th;
    if (n)
        pthread_create(&th, NULL, attacker_main, &a);
    else if (write(go[1], "x", 1) != 1)
        exit(1);
    double *ms = calloc((size_t)rounds, sizeof(double));
    int got = 0;
    while (got < rounds && read(lat[0], &ms[got], sizeof(double)) == sizeof(double))
        got++;
    if (n) {
        a.stop = 1;
        pthread_join(th, NULL);
    }
    int st = kh_child_status(pid);
    qsort(ms, (size_t)got, sizeof(double), cmp_d);
    printf("%s: victim (uid 60002) %d hellos: p50 %.3f ms, p99 %.3f ms, max %.3f ms "
           "(child status %d)\n",
           label, got, got ? ms[got / 2] : 0, got ? ms[(size_t)got * 99 / 100] : 0,
           got ? ms[got - 1] : 0, st);
    if (n) {
        unsigned during = a.answered - a.answered_at_go;
        double t = a.t_end - a.t_start;
        printf("%s: attacker (uid 0) %u in flight: %u answers in %.2f s while the victim ran "
               "(%.1f/s, %.2f ms each); all %u answers: %u ok, %u bad_request, %u too_large, "
               "%u busy, %u other\n",
               label, n, during, t, t > 0 ? during / t : 0, during ? t / during * 1e3 : 0,
               a.answered, a.ok, a.bad, a.large, a.busy, a.other);
        printf("%s: first answer: %s\n", label, a.first_msg[0] ? a.first_msg : "ok");
    }
    free(ms);
    close(lat[0]);
    close(lat[1]);
    close(go[0]);
    close(go[1]);
}

static int count_tokens(void)
{
    int fd = kh_connect(g_kvd.sock);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "tokenize", 1, 1);
    proto_pack_kvn_str(&q.pk, "text", 4, g_text, g_text_len);
    int n = -1;
    if (kh_req_send(fd, &q) == 0 && kh_recv(fd, &r) == 0) {
        const msgpack_object *t = r.code ? NULL : kh_obj(r.root, "tokens");
        if (t && t->type == MSGPACK_OBJECT_ARRAY)
            n = (int)t->via.array.size;
        kh_reply_free(&r);
    }
    close(fd);
    return n;
}

int main(int argc, char **argv)
{
    g_go_fd = -1;
    if (argc < 3 || !getenv("KVD_BIN")) {
        fprintf(stderr, "usage: bench_hostile pipeline N | bigframes N M | noread K T | "
                        "text N BYTES [R] | chat N MSGS [R] (KVD_BIN, KVD_TOOLS_DIR)\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    bool text = !strcmp(argv[1], "text") && argc > 3, chat = !strcmp(argv[1], "chat") && argc > 3;
    char tmpl[600] = "";
    if (chat) {
        const char *e = getenv("KVD_BENCH_TEMPLATE");
        snprintf(tmpl, sizeof(tmpl), "%s",
                 e ? e : KVD_TESTS_SRC "/text/templates/mistral-v3.jinja");
    }
    if (start(text || chat ? 32768 : 2048, chat ? tmpl : NULL) != 0) {
        fprintf(stderr, "cannot start kvd\n");
        return 1;
    }
    if (!strcmp(argv[1], "pipeline")) {
        unsigned n = (unsigned)atoi(argv[2]);
        victim_run("idle", 50, NULL, 0);
        victim_run("flood", 50, flood, n);
        printf("flood replies: %u ok, %u busy\n", g_ok, g_busy);
    } else if (!strcmp(argv[1], "bigframes") && argc > 3) {
        bigframes((unsigned)atoi(argv[2]), (unsigned)atoi(argv[3]));
    } else if (!strcmp(argv[1], "noread") && argc > 3) {
        noread((unsigned)atoi(argv[2]), (unsigned)atoi(argv[3]));
    } else if (text || chat) {
        unsigned n = (unsigned)atoi(argv[2]), k = (unsigned)atoi(argv[3]);
        int rounds = argc > 4 ? atoi(argv[4]) : 20000;
        if (text) {
            g_text_len = k;
            g_text = make_text(k, 1);
            printf("text: %u bytes make %d tokens (the model's context: 32768)\n", k,
                   count_tokens());
        } else {
            g_n_msgs = k;
            g_msg = calloc(k, sizeof(char *));
            for (unsigned i = 0; i < k; i++)
                g_msg[i] = make_text(3072, 1 + i);
            printf("chat: %u messages of 3072 bytes, template %s\n", k, tmpl);
        }
        hello_run("idle", rounds, 0);
        hello_run(text ? "text" : "chat", rounds, n);
        free(g_text);
        for (unsigned i = 0; i < g_n_msgs; i++)
            free(g_msg[i]);
        free(g_msg);
    }
    kh_stop(&g_kvd);
    unlink(g_model);
    return 0;
}
