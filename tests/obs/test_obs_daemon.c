/* Observability against a real kvd serving a small random model (from
 * kvd-gguf-gen): the stats reply's roofline and per-tenant fields, a
 * Prometheus scrape over HTTP before and after requests, kvctl top -n 2
 * plain output, kvctl bench --json (also under memory pressure with
 * --verify), and the refusal of a non-loopback --metrics address. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

static char g_dir[64], g_model[128], g_sock[128];
static struct kh_proc g_kvd; /* the daemon (the harness's fixture); g_sock is its socket */
static bool g_running;
static uint16_t g_port;

/* ---- helpers ------------------------------------------------------------- */

static uint16_t free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof(a);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) ||
        getsockname(fd, (struct sockaddr *)&a, &l))
        return 0;
    close(fd);
    return ntohs(a.sin_port);
}

static int run_wait(char *const argv[])
{
    pid_t pid = fork();
    if (pid == 0) {
        int dn = open("/dev/null", O_WRONLY);
        if (dn >= 0)
            dup2(dn, STDOUT_FILENO);
        execv(argv[0], argv);
        _exit(127);
    }
    int st;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
        return -1;
    return WEXITSTATUS(st);
}

/* Starts kvd with the model and extra args (the harness waits until it is
 * ready). 0 or -1. */
static int start_kvd(const char *const *extra)
{
    const char *args[32] = {"--model", g_model};
    int n = 2;
    for (int i = 0; extra && extra[i] && n < 31; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    if (kh_start(&g_kvd, NULL, args) != 0)
        return -1;
    snprintf(g_sock, sizeof(g_sock), "%s", g_kvd.sock);
    g_running = true;
    return 0;
}

static int stop_kvd(void)
{
    g_running = false;
    return kh_stop(&g_kvd);
}

/* GET /metrics; returns the malloc'd body or NULL. */
static char *scrape(uint16_t port, int *status)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0)
        return NULL;
    const char req[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, req, sizeof(req) - 1) != (ssize_t)sizeof(req) - 1) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 4096 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    *status = 0;
    sscanf(buf, "HTTP/1.%*d %d", status);
    char *body = strstr(buf, "\r\n\r\n");
    char *out = body ? strdup(body + 4) : NULL;
    free(buf);
    return out;
}

/* The value of the sample line "NAME{LABELS} VALUE" (series = everything
 * before the space), or -1 when absent. Checks every line's syntax. */
static double metric(const char *text, const char *series)
{
    double v = -1;
    const char *p = text;
    size_t sl = strlen(series);
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len && p[0] != '#') {
            const char *sp = memrchr(p, ' ', len);
            assert_non_null(sp);
            char num[64];
            size_t nl = len - (size_t)(sp + 1 - p);
            assert_true(nl > 0 && nl < sizeof(num));
            memcpy(num, sp + 1, nl);
            num[nl] = 0;
            char *end;
            double d = strtod(num, &end);
            assert_true(*end == 0);
            if ((size_t)(sp - p) == sl && !memcmp(p, series, sl))
                v = d;
        }
        p += len + (e ? 1 : 0);
    }
    return v;
}

/* Runs kvctl with args; captures stdout into a malloc'd string. */
static char *kvctl(int *status, const char *fmt, ...)
{
    char args[1024], cmd[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "%s --socket %s %s", getenv("KVCTL_BIN"), g_sock, args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (n + 1 >= cap)
            buf = realloc(buf, cap *= 2);
    }
    buf[n] = 0;
    int st = pclose(f);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return buf;
}

/* A strict little JSON checker: true when s is one JSON value (and
 * whitespace). Enough to say `bench --json` output parses. */
static const char *json_value(const char *s);
static const char *json_ws(const char *s)
{
    while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r')
        s++;
    return s;
}
static const char *json_string(const char *s)
{
    if (*s++ != '"')
        return NULL;
    while (*s && *s != '"') {
        if ((unsigned char)*s < 0x20)
            return NULL;
        if (*s == '\\')
            s++;
        if (*s)
            s++;
    }
    return *s == '"' ? s + 1 : NULL;
}
static const char *json_value(const char *s)
{
    s = json_ws(s);
    if (*s == '{' || *s == '[') {
        char close = *s == '{' ? '}' : ']';
        bool obj = *s == '{';
        s = json_ws(s + 1);
        if (*s == close)
            return s + 1;
        for (;;) {
            if (obj) {
                s = json_string(json_ws(s));
                if (!s || *(s = json_ws(s)) != ':')
                    return NULL;
                s++;
            }
            if (!(s = json_value(s)))
                return NULL;
            s = json_ws(s);
            if (*s == ',') {
                s++;
                continue;
            }
            return *s == close ? s + 1 : NULL;
        }
    }
    if (*s == '"')
        return json_string(s);
    if (!strncmp(s, "true", 4) || !strncmp(s, "null", 4))
        return s + 4;
    if (!strncmp(s, "false", 5))
        return s + 5;
    char *end;
    strtod(s, &end);
    return end == s ? NULL : end;
}
static bool json_ok(const char *s)
{
    const char *e = json_value(s);
    return e && *json_ws(e) == 0;
}

/* The number after "key": in a JSON text (first occurrence), or -1. */
static double json_num(const char *s, const char *key)
{
    char k[64];
    snprintf(k, sizeof(k), "\"%s\":", key);
    const char *p = strstr(s, k);
    return p ? strtod(p + strlen(k), NULL) : -1;
}

static double vnum(const struct kvd_value *v, const char *path)
{
    double d = -1;
    if (kvd_value_f64(kvd_value_path(v, path), &d))
        return -1;
    return d;
}

/* ---- setup --------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    if (!getenv("KVD_BIN") || !getenv("KVCTL_BIN") || !getenv("KVD_TOOLS_DIR"))
        return -1;
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvd-obs-XXXXXX");
    if (!mkdtemp(g_dir))
        return -1;
    chmod(g_dir, 0755);
    snprintf(g_model, sizeof(g_model), "%s/m.gguf", g_dir);
    char gen[512];
    snprintf(gen, sizeof(gen), "%s/kvd-gguf-gen", getenv("KVD_TOOLS_DIR"));
    char *argv[] = {gen,       "-o",    g_model,      "--layers", "2",    "--embd", "64",
                    "--heads", "4",     "--kv-heads", "2",        "--ff", "128",    "--vocab",
                    "256",     "--ctx", "512",        "--type",   "f16",  NULL};
    if (run_wait(argv) != 0)
        return -1;
    g_port = free_port();
    char port[32];
    snprintf(port, sizeof(port), "127.0.0.1:%u", g_port);
    const char *extra[] = {"--metrics", port, "--device-blocks", "256", "--host-blocks",
                           "256",       NULL};
    return start_kvd(extra);
}

static int teardown(void **state)
{
    (void)state;
    int rc = g_running ? stop_kvd() : 0;
    unlink(g_model);
    rmdir(g_dir);
    return rc == 0 ? 0 : -1;
}

static void generate_some(int n, uint32_t first)
{
    struct kvd_ctx *c = kvd_connect(g_sock);
    assert_int_equal(c->err, 0);
    for (int i = 0; i < n; i++) {
        uint32_t prompt[40];
        for (int j = 0; j < 40; j++)
            prompt[j] = first + (uint32_t)(j < 32 ? j : j + i); /* 2 shared blocks */
        struct kvd_gen_opts o;
        kvd_gen_opts_init(&o);
        o.max_tokens = 6;
        o.temperature = 0;
        struct kvd_gen_result r = {0};
        assert_int_equal(kvd_generate(c, prompt, 40, &o, &r), 0);
        assert_int_equal(r.n_tokens, 6);
        kvd_gen_result_free(&r);
    }
    kvd_close(c);
}

/* ---- per-test state -------------------------------------------------------- */

/* What a test holds (scraped pages, kvctl outputs, a client and a reply),
 * in CMocka setup/teardown: freed also after a failed assert. */
#define T_MAX_BUF 4
struct tstate {
    char *buf[T_MAX_BUF];
    struct kvd_ctx *c;
    struct kvd_reply *r;
};

static int t_setup(void **state)
{
    *state = calloc(1, sizeof(struct tstate));
    return *state ? 0 : -1;
}

static int t_teardown(void **state)
{
    struct tstate *t = *state;
    if (!t)
        return 0;
    for (int i = 0; i < T_MAX_BUF; i++)
        free(t->buf[i]);
    kvd_reply_free(t->r);
    kvd_close(t->c);
    free(t);
    return 0;
}

/* p, kept for the teardown until tdrop. */
static char *tkeep(void **state, char *p)
{
    struct tstate *t = *state;
    for (int i = 0; i < T_MAX_BUF; i++)
        if (!t->buf[i]) {
            t->buf[i] = p;
            return p;
        }
    fail_msg("tkeep: more than %d buffers", T_MAX_BUF);
    return p;
}

static void tdrop(void **state, char *p)
{
    struct tstate *t = *state;
    for (int i = 0; i < T_MAX_BUF; i++)
        if (t->buf[i] == p)
            t->buf[i] = NULL;
    free(p);
}

/* ---- tests --------------------------------------------------------------- */

static void test_metrics_scrape(void **state)
{
    int status = 0;
    char *a = tkeep(state, scrape(g_port, &status));
    assert_non_null(a);
    assert_int_equal(status, 200);
    char tenant[64];
    snprintf(tenant, sizeof(tenant), "uid:%u", (unsigned)getuid());
    char s_req[160], s_gen[160], s_blk[160];
    snprintf(s_req, sizeof(s_req), "kvd_requests_total{outcome=\"completed\",tenant=\"%s\"}",
             tenant);
    snprintf(s_gen, sizeof(s_gen), "kvd_tokens_total{kind=\"generated\",tenant=\"%s\"}", tenant);
    snprintf(s_blk, sizeof(s_blk), "kvd_blocks{tier=\"device\",tenant=\"%s\"}", tenant);
    double req0 = metric(a, s_req), ttft0 = metric(a, "kvd_time_to_first_token_seconds_count");
    double steps0 = metric(a, "kvd_phase_steps_total{phase=\"decode\"}");
    assert_true(metric(a, "kvd_pool_blocks{tier=\"device\",state=\"total\"}") == 256);
    assert_true(metric(a, "kvd_ceiling_flops_per_second") > 0);
    assert_true(ttft0 >= 0);
    tdrop(state, a);

    generate_some(3, 10);

    char *b = tkeep(state, scrape(g_port, &status));
    assert_non_null(b);
    assert_int_equal(status, 200);
    assert_true(metric(b, s_req) == (req0 < 0 ? 0 : req0) + 3);
    assert_true(metric(b, s_gen) >= 18);
    assert_true(metric(b, s_blk) >= 0);
    assert_true(metric(b, "kvd_time_to_first_token_seconds_count") == ttft0 + 3);
    assert_true(metric(b, "kvd_time_to_first_token_seconds_bucket{le=\"+Inf\"}") == ttft0 + 3);
    assert_true(metric(b, "kvd_inter_token_latency_seconds_count") >= 15);
    assert_true(metric(b, "kvd_phase_steps_total{phase=\"decode\"}") > steps0);
    assert_true(metric(b, "kvd_roofline_intensity{phase=\"decode\"}") > 0);
    /* Histogram buckets are cumulative. */
    double prev = 0;
    for (const char *le = strstr(b, "kvd_request_duration_seconds_bucket{"); le;
         le = strstr(le + 1, "kvd_request_duration_seconds_bucket{")) {
        const char *sp = strchr(le, ' ');
        double v = strtod(sp + 1, NULL);
        assert_true(v >= prev);
        prev = v;
    }
    tdrop(state, b);
}

static void test_stats_fields(void **state)
{
    generate_some(2, 50);
    struct tstate *ts_ = *state;
    struct kvd_ctx *c = ts_->c = kvd_connect(g_sock);
    assert_int_equal(kvd_stats(c, &ts_->r), 0);
    struct kvd_reply *r = ts_->r;
    const struct kvd_value *b = r->body;
    const struct kvd_value *m = kvd_value_path(b, "roofline.measured");
    assert_non_null(m);
    assert_int_equal(m->type, KVD_T_BOOL);
    assert_true(m->v.b);
    assert_true(vnum(b, "roofline.peak_flops_per_s") > 0);
    assert_true(vnum(b, "roofline.peak_bytes_per_s") > 0);
    assert_true(vnum(b, "roofline.decode.steps") > 0);
    assert_true(vnum(b, "roofline.decode.intensity") > 0);
    assert_true(vnum(b, "roofline.decode.flops_per_step") > 0);
    assert_true(vnum(b, "roofline.prefill.bytes_per_step") > 0);
    const char *bound = kvd_value_str(kvd_value_path(b, "roofline.decode.bound"));
    assert_non_null(bound);
    assert_true(!strcmp(bound, "bandwidth") || !strcmp(bound, "compute"));
    assert_true(vnum(b, "roofline.mixed.window") >= 0);
    assert_true(vnum(b, "requests.running") >= 0);
    assert_true(vnum(b, "requests.tokens_out") >= 12);

    const struct kvd_value *ts = kvd_value_get(b, "tenants");
    assert_non_null(ts);
    assert_int_equal(ts->type, KVD_T_ARRAY);
    assert_true(ts->v.array.n >= 1);
    const struct kvd_value *t = &ts->v.array.items[0];
    const char *keys[] = {"device_blocks", "host_blocks", "cached_blocks", "prefix_hit_rate",
                          "swaps_in",      "swaps_out",   "preemptions",   "tokens_in",
                          "tokens_out",    "queue_ms",    "requests",      "ttft_ms_mean"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
        if (vnum(t, keys[i]) < 0)
            fail_msg("tenant field %s missing", keys[i]);
    assert_true(vnum(t, "tokens_in") >= 80);
    assert_true(vnum(t, "tokens_out") >= 12);
    /* The second request of generate_some reused the first's 32-token prefix. */
    assert_true(vnum(t, "prefix_hit_rate") > 0);
    assert_true(vnum(t, "cached_blocks") > 0);
}

static void test_top_plain(void **state)
{
    int st;
    char *out = tkeep(state, kvctl(&st, "top -n 2 -d 0.1"));
    assert_int_equal(st, 0);
    /* Two frames, plain (not a terminal): no escape sequences. */
    const char *f1 = strstr(out, "kvd top");
    assert_non_null(f1);
    assert_non_null(strstr(f1 + 1, "kvd top"));
    assert_null(strchr(out, '\033'));
    assert_non_null(strstr(out, "device  ["));
    assert_non_null(strstr(out, "host    ["));
    assert_non_null(strstr(out, "requests  running"));
    assert_non_null(strstr(out, "tokens/s prefill"));
    assert_non_null(strstr(out, "roofline  ceilings"));
    assert_non_null(strstr(out, "  decode "));
    assert_true(strstr(out, "bandwidth-bound") || strstr(out, "compute-bound"));
    assert_non_null(strstr(out, "TENANT"));
    tdrop(state, out);
    out = tkeep(state, kvctl(&st, "top -n 0"));
    assert_int_equal(st, 2);
    tdrop(state, out);
}

static void test_bench_json(void **state)
{
    int st;
    char *out = tkeep(state, kvctl(&st, "bench -c 3 -r 9 --prompt-len 16-40 --output-len 4-8 "
                                        "--shared-prefix 0.5 --turns 1 --json"));
    assert_int_equal(st, 0);
    if (!json_ok(out))
        fail_msg("bench --json is not JSON: %s", out);
    assert_true(json_num(out, "requests") == 9);
    assert_true(json_num(out, "ok") == 9);
    assert_true(json_num(out, "failed") == 0);
    assert_true(json_num(out, "output_tokens") >= 36);
    assert_true(json_num(out, "output_tokens_per_s") > 0);
    assert_true(json_num(out, "p99") >= json_num(out, "p50"));
    assert_non_null(strstr(out, "\"ttft_ms\":{"));
    assert_non_null(strstr(out, "\"itl_ms\":{"));
    assert_non_null(strstr(out, "\"e2e_ms\":{"));
    assert_non_null(strstr(out, "\"roofline\":{"));
    tdrop(state, out);

    /* Multi-turn chats at a request rate. */
    out = tkeep(
        state,
        kvctl(&st, "bench -c 2 -r 6 --turns 3 --prompt-len 8 --output-len 4 --rate 100 --json"));
    assert_int_equal(st, 0);
    assert_true(json_ok(out));
    assert_true(json_num(out, "ok") == 6);
    assert_true(json_num(out, "prefix_hit_rate") > 0); /* later turns reuse their history */
    tdrop(state, out);
    out = tkeep(state, kvctl(&st, "bench --prompt-len 0"));
    assert_int_equal(st, 2);
    tdrop(state, out);
}

/* Memory pressure: 20 device blocks (320 tokens) for 4 requests of up to
 * 120 tokens each forces preemption; every output must still equal the
 * one-at-a-time first pass. */
static void test_bench_pressure(void **state)
{
    assert_int_equal(stop_kvd(), 0);
    const char *extra[] = {"--device-blocks",     "20", "--host-blocks", "64",
                           "--no-roofline-probe", NULL};
    assert_int_equal(start_kvd(extra), 0);
    int st;
    char *out = tkeep(
        state, kvctl(&st, "bench -c 4 -r 8 --prompt-len 60-90 --output-len 24-30 --verify --json"));
    if (st != 0 || !json_ok(out))
        fail_msg("bench under pressure: exit %d: %s", st, out);
    assert_true(json_num(out, "failed") == 0);
    assert_true(json_num(out, "mismatches") == 0);
    assert_non_null(strstr(out, "\"outputs_match\":true"));
    assert_non_null(strstr(out, "\"measured\":false")); /* --no-roofline-probe */
    printf("# pressure: swaps out %.0f in %.0f, preemptions swap %.0f recompute %.0f\n",
           json_num(out, "swaps_out"), json_num(out, "swaps_in"), json_num(out, "preempt_swap"),
           json_num(out, "preempt_recompute"));
    tdrop(state, out);
}

static void test_metrics_refused(void **state)
{
    /* A non-loopback address without --metrics-force: kvd exits 2. */
    const char *args[] = {"--model",     g_model, "--metrics", "0.0.0.0:1", "--no-roofline-probe",
                          "--log-level", "error", NULL};
    assert_int_equal(stop_kvd(), 0);
    assert_int_equal(kh_run(&(struct kh_opts){.args = args}), 2);
    const char *bad[] = {"--metrics", "nohost", "--log-level", "error", NULL};
    assert_int_equal(kh_run(&(struct kh_opts){.args = bad}), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_metrics_scrape, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_stats_fields, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_top_plain, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_bench_json, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_bench_pressure, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(test_metrics_refused, t_setup, t_teardown),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
