/* bench_disk_ttft: time to first token of a 4096-token prompt whose first
 * 90 % was computed before a restart (restored from the disk tier), next to
 * the same prompt cold and with its prefix still in memory (a program that
 * prints numbers, not a test).
 *
 *   bench_disk_ttft [GROUPS] [DIR]
 *
 * A random model (kvd-gguf-gen --layers 8 --embd 512 --heads 8 --kv-heads 8
 * --ff 1024 --vocab 1000 --ctx 8192: 256 KiB KV blocks of 16 tokens) is
 * served on the cpu backend with --disk-dir DIR/disk (DIR: default a fresh
 * mkdtemp under /var/tmp). GROUPS (default 8) groups of prompts, each its
 * own 4096 random tokens:
 *   run 1  per group: the group's prompt, cold (nothing cached), then a
 *          prompt sharing its first 3686 tokens (90 %) with a new tail:
 *          the shared part is still in memory;
 *          then SIGTERM (the daemon writes back what is not on disk yet);
 *   run 2  a new kvd on the same directory (page cache dropped before it
 *          starts, when we may): per group one more prompt sharing the
 *          first 3686 tokens, with another new tail: its shared part comes
 *          from disk.
 * Each sample is the first touch of its group's prefix in its run, so
 * every "restart" sample reads its prefix from disk. Prints per kind the
 * median (and min/max) of the daemon's ttft_ms and the cached tokens, and
 * cold / restart and cold / memory.
 *
 * Environment: KVD_BIN, KVD_TOOLS_DIR (as in ctest), KVD_BENCH_ARGS (extra
 * kvd arguments, space-separated). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvd/client.h"
#include "kvd_harness.h"

#define N_PROMPT 4096
#define N_SHARED 3686 /* 90 % of 4096 */
#define VOCAB 1000
#define MAX_GROUPS 64

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Group g's prompt number k: k = 0 is the base; k > 0 shares its first
 * N_SHARED tokens and has a tail of its own. */
static void prompt(uint32_t *p, unsigned g, unsigned k)
{
    for (size_t i = 0; i < N_PROMPT; i++) {
        uint64_t src = i < N_SHARED ? (uint64_t)g << 40 : ((uint64_t)g << 40) | ((uint64_t)k << 32);
        p[i] = (uint32_t)(mix(src | i) % VOCAB);
    }
}

struct sample {
    double ttft_ms, wall_ms;
    uint32_t cached;
};

static int gen(const char *sock, const uint32_t *p, struct sample *s)
{
    struct kvd_ctx *c = kvd_connect(sock);
    if (!c || c->err) {
        fprintf(stderr, "bench_disk_ttft: cannot connect to %s\n", sock);
        return -1;
    }
    kvd_set_timeout(c, 600000);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 1;
    o.temperature = 0;
    struct kvd_gen_result r;
    double t0 = now_s();
    int rc = kvd_generate(c, p, N_PROMPT, &o, &r);
    double t1 = now_s();
    if (rc != 0) {
        fprintf(stderr, "bench_disk_ttft: generate failed: %d\n", rc);
        kvd_close(c);
        return -1;
    }
    s->ttft_ms = r.ttft_ms;
    s->wall_ms = (t1 - t0) * 1e3;
    s->cached = r.cached_tokens;
    kvd_gen_result_free(&r);
    kvd_close(c);
    return 0;
}

static uint64_t disk_stat(const struct kh_proc *d, const char *key)
{
    int fd = kh_connect(d->sock);
    if (fd < 0)
        return 0;
    uint64_t v = kh_stat(fd, "disk", key);
    close(fd);
    return v;
}

static int start(struct kh_proc *d, const char *model, const char *disk)
{
    const char *base[] = {"--backend",
                          "cpu",
                          "--model",
                          model,
                          "--disk-dir",
                          disk,
                          "--disk-max-bytes",
                          "4G",
                          "--disk-flush-s",
                          "300",
                          "--device-blocks",
                          "4096",
                          "--host-blocks",
                          "1024",
                          NULL};
    return kh_start_bench(d, NULL, base);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void summary(const char *name, const struct sample *s, unsigned n, double *med)
{
    double v[MAX_GROUPS], w[MAX_GROUPS];
    uint32_t cmin = UINT32_MAX, cmax = 0;
    for (unsigned i = 0; i < n; i++) {
        v[i] = s[i].ttft_ms;
        w[i] = s[i].wall_ms;
        cmin = s[i].cached < cmin ? s[i].cached : cmin;
        cmax = s[i].cached > cmax ? s[i].cached : cmax;
    }
    qsort(v, n, sizeof *v, cmp_double);
    qsort(w, n, sizeof *w, cmp_double);
    *med = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    printf("  %-28s ttft_ms median %8.1f (min %8.1f, max %8.1f)   client wall median %8.1f   "
           "cached tokens %u..%u\n",
           name, *med, v[0], v[n - 1], n % 2 ? w[n / 2] : (w[n / 2 - 1] + w[n / 2]) / 2, cmin,
           cmax);
}

int main(int argc, char **argv)
{
    unsigned groups = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 8;
    const char *tools = getenv("KVD_TOOLS_DIR");
    if (!groups || groups > MAX_GROUPS || !tools || !getenv("KVD_BIN")) {
        fprintf(stderr, "usage: bench_disk_ttft [GROUPS <= %d] [DIR] (KVD_BIN, KVD_TOOLS_DIR)\n",
                MAX_GROUPS);
        return 2;
    }
    char tmp[] = "/var/tmp/kvd-bench-ttft.XXXXXX", model[4200], disk[4200], cmd[9000];
    const char *dir = argc > 2 ? argv[2] : mkdtemp(tmp);
    if (!dir) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(model, sizeof model, "%s/m.gguf", dir);
    snprintf(disk, sizeof disk, "%s/disk", dir);
    snprintf(cmd, sizeof cmd,
             "'%s/kvd-gguf-gen' -o '%s' --layers 8 --embd 512 --heads 8 --kv-heads 8 --ff 1024 "
             "--vocab %d --ctx 8192 >/dev/null",
             tools, model, VOCAB);
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_disk_ttft: %s failed\n", cmd);
        return 1;
    }
    static uint32_t p[N_PROMPT];
    struct sample cold[MAX_GROUPS], mem[MAX_GROUPS], rst[MAX_GROUPS];
    struct kh_proc d;
    int rc = 1;

    if (start(&d, model, disk))
        goto out;
    for (unsigned g = 0; g < groups; g++) {
        prompt(p, g, 0);
        if (gen(d.sock, p, &cold[g]))
            goto stop;
        prompt(p, g, 1);
        if (gen(d.sock, p, &mem[g]))
            goto stop;
        fprintf(stderr, "group %u: cold %.1f ms, memory %.1f ms\n", g, cold[g].ttft_ms,
                mem[g].ttft_ms);
    }
    uint64_t writes = disk_stat(&d, "writes"), queued = disk_stat(&d, "queued");
    double t0 = now_s();
    if (kh_stop(&d) != 0) {
        fprintf(stderr, "bench_disk_ttft: kvd did not exit cleanly\n");
        goto out;
    }
    double t_stop = now_s() - t0;
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    bool dropped = f && fputs("3\n", f) >= 0;
    if (f && fclose(f) != 0)
        dropped = false;
    t0 = now_s();
    if (start(&d, model, disk))
        goto out;
    double t_start = now_s() - t0;
    uint64_t loaded = disk_stat(&d, "loaded");
    for (unsigned g = 0; g < groups; g++) {
        prompt(p, g, 2);
        if (gen(d.sock, p, &rst[g]))
            goto stop;
        fprintf(stderr, "group %u: after restart %.1f ms\n", g, rst[g].ttft_ms);
    }
    uint64_t restored = disk_stat(&d, "restored"), ioerr = disk_stat(&d, "io_errors");
    uint64_t csum = disk_stat(&d, "checksum_failures");
    uint64_t restore_us = disk_stat(&d, "restore_us");

    printf("TTFT of %d-token prompts, %d shared (90 %%), %u groups; kvd args:", N_PROMPT, N_SHARED,
           groups);
    for (const char *const *a = kh_bench_args(); *a; a++)
        printf(" %s", strcmp(*a, model) == 0 ? "M.gguf" : strcmp(*a, disk) == 0 ? "DIR" : *a);
    printf("\n  run 1: %" PRIu64 " blocks written before SIGTERM (%" PRIu64
           " queued), SIGTERM to exit %.2f s\n",
           writes, queued, t_stop);
    printf("  run 2: page cache %s, start to ready %.2f s, %" PRIu64 " blocks loaded, %" PRIu64
           " restored, %" PRIu64 " I/O errors, %" PRIu64 " checksum failures, restore_us "
           "%" PRIu64 "\n",
           dropped ? "dropped" : "NOT dropped", t_start, loaded, restored, ioerr, csum, restore_us);
    double mc, mm, mr;
    summary("cold (nothing cached)", cold, groups, &mc);
    summary("90 % in memory", mem, groups, &mm);
    summary("90 % on disk, after restart", rst, groups, &mr);
    printf("  cold / after restart %.2fx   cold / in memory %.2fx\n", mc / mr, mc / mm);
    rc = 0;
stop:
    if (kh_stop(&d) != 0)
        rc = 1;
out:
    if (argc <= 2) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "bench_disk_ttft: %s failed\n", cmd);
    }
    return rc;
}
