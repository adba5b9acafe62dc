/* bench_remote_ttft: time to first token of a 4096-token prompt restored from Redis by a
 * second daemon, next to the same prompt computed cold and found in memory (a program that
 * prints numbers, not a test).
 *
 *   bench_remote_ttft [GROUPS]
 *
 * A redis-server on loopback (tests/support's redis_harness: no persistence) and two kvd,
 * A and B, on the cpu backend serving one random model (kvd-gguf-gen --layers 8 --embd 512
 * --heads 8 --kv-heads 8 --ff 1024 --vocab 1000 --ctx 8192: 256 KiB KV blocks of 16 tokens,
 * a 4096-token prompt is 64 MiB of KV), both with --remote on it, a fleet key, remote on for
 * every tenant and --remote-min-hits 0. GROUPS (default 8) prompts of 4096 random tokens
 * each: A computes it (cold), A's writer puts its values in Redis (waited for), A runs it
 * again (in memory), then B runs it: B's lookup finds every whole block in Redis, restores
 * them before the request is scheduled, and computes the last token. TTFT is the daemon's
 * ttft_ms (arrival to first token, the lookup and restore included); max_tokens 1, greedy,
 * and B's tokens must equal A's. Prints the medians (min, max), the cached tokens, B's
 * remote counters, and cold / Redis.
 *
 * Environment: KVD_BIN, KVD_TOOLS_DIR (as in ctest), KVD_BENCH_ARGS (extra kvd arguments for
 * both, space-separated). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvd/client.h"
#include "kvd_harness.h"
#include "redis_harness.h"

#define N_PROMPT 4096
#define VOCAB 1000
#define MAX_GROUPS 64

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void prompt(uint32_t *p, unsigned g)
{
    for (size_t i = 0; i < N_PROMPT; i++)
        p[i] = (uint32_t)(mix(((uint64_t)g << 40) | i) % VOCAB);
}

struct sample {
    double ttft_ms;
    uint32_t cached, token;
};

static int gen(const char *sock, const uint32_t *p, struct sample *s)
{
    struct kvd_ctx *c = kvd_connect(sock);
    if (!c || c->err) {
        fprintf(stderr, "bench_remote_ttft: cannot connect to %s\n", sock);
        kvd_close(c);
        return -1;
    }
    kvd_set_timeout(c, 600000);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 1;
    o.temperature = 0;
    struct kvd_gen_result r;
    int rc = kvd_generate(c, p, N_PROMPT, &o, &r);
    if (rc != 0 || r.n_tokens != 1) {
        fprintf(stderr, "bench_remote_ttft: generate failed: %d\n", rc);
        kvd_close(c);
        return -1;
    }
    s->ttft_ms = r.ttft_ms;
    s->cached = r.cached_tokens;
    s->token = r.tokens[0];
    kvd_gen_result_free(&r);
    kvd_close(c);
    return 0;
}

static uint64_t remote_stat(const struct kh_proc *d, const char *key)
{
    int fd = kh_connect(d->sock);
    if (fd < 0)
        return 0;
    uint64_t v = kh_stat(fd, "remote", key);
    close(fd);
    return v;
}

/* Waits until d has written at least n values and has none queued (at most 60 s). */
static int wait_written(const struct kh_proc *d, uint64_t n)
{
    for (int i = 0; i < 6000; i++) {
        if (remote_stat(d, "writes") >= n && remote_stat(d, "queued") == 0)
            return 0;
        usleep(10000);
    }
    return -1;
}

static int start(struct kh_proc *d, const char *model, const char *url, const char *key)
{
    const char *base[] = {"--backend",
                          "cpu",
                          "--model",
                          model,
                          "--remote",
                          url,
                          "--remote-key-file",
                          key,
                          "--remote-min-hits",
                          "0",
                          "--device-blocks",
                          "4096",
                          "--host-blocks",
                          "1024",
                          NULL};
    return kh_start_bench(d, "[limits]\nremote = on\n", base);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double summary(const char *name, const struct sample *s, unsigned n)
{
    double v[MAX_GROUPS];
    uint32_t cmin = UINT32_MAX, cmax = 0;
    for (unsigned i = 0; i < n; i++) {
        v[i] = s[i].ttft_ms;
        cmin = s[i].cached < cmin ? s[i].cached : cmin;
        cmax = s[i].cached > cmax ? s[i].cached : cmax;
    }
    qsort(v, n, sizeof *v, cmp_double);
    double med = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    printf("  %-30s ttft_ms median %8.1f (min %8.1f, max %8.1f)   cached tokens %u..%u\n", name,
           med, v[0], v[n - 1], cmin, cmax);
    return med;
}

int main(int argc, char **argv)
{
    unsigned groups = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 8;
    const char *tools = getenv("KVD_TOOLS_DIR");
    if (!groups || groups > MAX_GROUPS || !tools || !getenv("KVD_BIN")) {
        fprintf(stderr, "usage: bench_remote_ttft [GROUPS <= %d] (KVD_BIN, KVD_TOOLS_DIR)\n",
                MAX_GROUPS);
        return 2;
    }
    if (!redis_available()) {
        fprintf(stderr, "bench_remote_ttft: redis-server is not installed\n");
        return 1;
    }
    char dir[] = "/var/tmp/kvd-bench-rttft.XXXXXX", model[128], key[128], cmd[512];
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(model, sizeof model, "%s/m.gguf", dir);
    snprintf(key, sizeof key, "%s/fleet.key", dir);
    snprintf(cmd, sizeof cmd,
             "'%s/kvd-gguf-gen' -o '%s' --layers 8 --embd 512 --heads 8 --kv-heads 8 --ff 1024 "
             "--vocab %d --ctx 8192 >/dev/null",
             tools, model, VOCAB);
    FILE *kf = fopen(key, "w");
    if (system(cmd) != 0 || !kf) {
        fprintf(stderr, "bench_remote_ttft: %s failed\n", cmd);
        return 1;
    }
    for (int i = 0; i < 32; i++)
        fprintf(kf, "%02x", (unsigned)(mix((uint64_t)i + 7) & 0xff));
    fputc('\n', kf);
    fclose(kf);
    chmod(key, 0600);
    struct redis_srv srv;
    if (redis_start(&srv, NULL) != 0)
        return 1;
    static uint32_t p[N_PROMPT];
    struct sample cold[MAX_GROUPS], mem[MAX_GROUPS], red[MAX_GROUPS];
    struct kh_proc a, b;
    int rc = 1;
    bool a_up = false, b_up = false;
    if (start(&a, model, srv.url, key) || !(a_up = true) || start(&b, model, srv.url, key))
        goto out;
    b_up = true;
    for (unsigned g = 0; g < groups; g++) {
        prompt(p, g);
        uint64_t w = remote_stat(&a, "writes");
        if (gen(a.sock, p, &cold[g]) || wait_written(&a, w + 1) || gen(a.sock, p, &mem[g]) ||
            gen(b.sock, p, &red[g]))
            goto out;
        if (red[g].token != cold[g].token) {
            fprintf(stderr, "bench_remote_ttft: group %u: B's token differs from A's\n", g);
            goto out;
        }
        fprintf(stderr, "group %u: cold %.1f ms, memory %.1f ms, from Redis %.1f ms\n", g,
                cold[g].ttft_ms, mem[g].ttft_ms, red[g].ttft_ms);
    }
    printf("TTFT of %d-token prompts, %u groups, redis-server %s; kvd args:", N_PROMPT, groups,
           srv.addr);
    for (const char *const *arg = kh_bench_args(); *arg; arg++)
        printf(" %s", strcmp(*arg, model) == 0     ? "M.gguf"
                      : strcmp(*arg, key) == 0     ? "KEY"
                      : strcmp(*arg, srv.url) == 0 ? "redis://..."
                                                   : *arg);
    printf("\n  A: %" PRIu64 " values written, %.1f MB; B: %" PRIu64 " blocks restored, %" PRIu64
           " rounds, %.1f MB in, lookup mean %" PRIu64 " us, %" PRIu64 " errors, %" PRIu64
           " timeouts, %" PRIu64 " auth failures\n",
           remote_stat(&a, "writes"), remote_stat(&a, "bytes_out") / 1e6, remote_stat(&b, "hits"),
           remote_stat(&b, "rounds"), remote_stat(&b, "bytes_in") / 1e6,
           remote_stat(&b, "latency_us_mean"), remote_stat(&b, "errors"),
           remote_stat(&b, "timeouts"), remote_stat(&b, "auth_failures"));
    double mc = summary("cold, A (nothing cached)", cold, groups);
    double mm = summary("again on A (in memory)", mem, groups);
    double mr = summary("on B, restored from Redis", red, groups);
    printf("  cold / from Redis %.2fx   cold / in memory %.2fx\n", mc / mr, mc / mm);
    rc = 0;
out:
    if (b_up && kh_stop(&b) != 0)
        rc = 1;
    if (a_up && kh_stop(&a) != 0)
        rc = 1;
    redis_stop(&srv);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "bench_remote_ttft: %s failed\n", cmd);
    return rc;
}
