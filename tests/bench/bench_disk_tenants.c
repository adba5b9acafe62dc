/* bench_disk_tenants: does one tenant's restore from the disk tier slow
 * another tenant's decode? (a program that prints numbers, not a test)
 *
 *   bench_disk_tenants [PROMPTS] [TOKENS] [DIR]
 *
 * A random model (kvd-gguf-gen --layers 8 --embd 512 --heads 8 --kv-heads 8
 * --ff 1024 --vocab 1000 --ctx 8192: 256 KiB KV blocks of 16 tokens) on the
 * cpu backend, kvd with --disk-dir, two tenants (alpha uid 60011, beta uid
 * 60012; the program runs as root and its clients as those uids):
 *   fill     beta sends PROMPTS (default 48) prompts of TOKENS (default
 *            1024) random tokens each; SIGTERM writes them all to disk;
 *   restart  the page cache is dropped (when we may), kvd starts again;
 *   alone    alpha streams 256 tokens (or KVD_BENCH_ALPHA_TOKENS) (greedy) from a 64-token prompt
 * of its own; the inter-arrival times of its tokens are recorded; solo     beta sends the first
 * half of its prompts again, alone (one connection): each restores TOKENS/16 blocks from disk
 * through the disk workers, then computes one token (the prompt is TOKENS + 1 long); restore  alpha
 * streams as many again while beta (2 connections) sends the second half of its prompts the same
 * way; memory   the same again: beta's prompts are now in memory, so beta costs the executor the
 * same and the disk nothing (the control). Prints alpha's inter-token p50/p99/max in each phase
 * (over the tokens that arrived while beta was sending), beta's requests, blocks restored and
 * restore GB/s (bytes read / the restoring prefetches' time, from the daemon's stats).
 *
 * Environment: KVD_BIN, KVD_TOOLS_DIR (as in ctest), KVD_BENCH_ARGS (extra
 * kvd arguments, space-separated), KVD_BENCH_ALPHA_TOKENS (alpha's stream,
 * default 256, at most 4096: a longer phase gives its p99 more gaps), KVD_BENCH_REUSE=1 with DIR:
 * when DIR holds a model and a disk tier from an earlier run of the same PROMPTS and TOKENS, they
 * are used as they are (no fill: repeated runs save its minute). */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kvd/client.h"
#include "kvd_harness.h"

#define VOCAB 1000
#define UID_A 60011
#define UID_B 60012
#define GID_ALL 65534 /* nogroup: the socket's group */
#define A_PROMPT 64
#define A_TOKENS_MAX 4096
#define MAX_PROMPTS 512
#define BLOCK_BYTES (256u << 10)

static const char *const conf_tenants = "[admin]\nuids = 0\n"
                                        "[tenant:alpha]\nuids = 60011\n"
                                        "[tenant:beta]\nuids = 60012\n";

/* Shared with the children (MAP_SHARED). */
struct shared {
    char sock[128];
    unsigned prompts, tokens;
    unsigned a_tokens;            /* alpha streams this many tokens */
    double a_t[A_TOKENS_MAX + 1]; /* alpha: arrival time of each token */
    size_t a_n;
    atomic_int a_done;
    double b_start, b_end;     /* beta's first send, last reply */
    atomic_uint b_next;        /* the next prompt a beta connection sends */
    unsigned b_first, b_end_k; /* beta sends prompts [b_first, b_end_k) */
    unsigned b_cycle;          /* > 0: beta cycles over b_first + [0, b_cycle) */
    atomic_uint b_sent, b_failed, b_cached_blocks;
};

static struct shared *sh;

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

static void b_prompt(uint32_t *p, unsigned k, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        p[i] = (uint32_t)(mix(((uint64_t)k << 32) | i) % VOCAB);
}

static struct kvd_ctx *conn(void)
{
    struct kvd_ctx *c = kvd_connect(sh->sock);
    if (!c || c->err) {
        fprintf(stderr, "bench_disk_tenants: cannot connect to %s\n", sh->sock);
        return NULL;
    }
    kvd_set_timeout(c, 600000);
    return c;
}

/* ---- alpha: one stream of a_tokens tokens ------------------------------- */

static int on_tokens(void *user, const uint32_t *tokens, size_t n)
{
    (void)user;
    (void)tokens;
    double t = now_s();
    for (size_t i = 0; i < n && sh->a_n <= sh->a_tokens; i++)
        sh->a_t[sh->a_n++] = t;
    return 0;
}

static int alpha(void *arg)
{
    (void)arg;
    struct kvd_ctx *c = conn();
    if (!c)
        return 2;
    uint32_t p[A_PROMPT];
    for (unsigned i = 0; i < A_PROMPT; i++)
        p[i] = (uint32_t)(mix(0xa1fa0000ull + i) % VOCAB);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = sh->a_tokens;
    o.temperature = 0;
    o.on_tokens = on_tokens;
    struct kvd_gen_result r;
    sh->a_n = 0;
    int rc = kvd_generate(c, p, A_PROMPT, &o, &r);
    atomic_store(&sh->a_done, 1);
    if (rc == 0)
        kvd_gen_result_free(&r);
    kvd_close(c);
    return rc == 0 ? 0 : 2;
}

/* ---- beta: its prompts, max_tokens 1 ------------------------------------ */

static void *beta_conn(void *arg)
{
    bool until_alpha = arg != NULL;
    struct kvd_ctx *c = conn();
    uint32_t *p = malloc(sizeof *p * (sh->tokens + 1));
    if (!c || !p) {
        free(p);
        return NULL;
    }
    for (;;) {
        if (until_alpha && atomic_load(&sh->a_done))
            break;
        unsigned k = atomic_fetch_add(&sh->b_next, 1);
        if (sh->b_cycle)
            k = sh->b_first + k % sh->b_cycle;
        else if ((k += sh->b_first) >= sh->b_end_k)
            break;
        b_prompt(p, k, sh->tokens + 1);
        struct kvd_gen_opts o;
        kvd_gen_opts_init(&o);
        o.max_tokens = 1;
        o.temperature = 0;
        struct kvd_gen_result r;
        if (kvd_generate(c, p, sh->tokens + 1, &o, &r) != 0) {
            atomic_fetch_add(&sh->b_failed, 1);
            continue;
        }
        atomic_fetch_add(&sh->b_sent, 1);
        atomic_fetch_add(&sh->b_cached_blocks, r.cached_tokens / 16);
        kvd_gen_result_free(&r);
    }
    free(p);
    kvd_close(c);
    return NULL;
}

/* arg: NULL sends every prompt once (the fill); else until alpha is done. */
static int beta(void *arg)
{
    pthread_t t[2];
    int n = arg ? 2 : 1;
    sh->b_start = now_s();
    for (int i = 0; i < n; i++)
        if (pthread_create(&t[i], NULL, beta_conn, arg) != 0)
            return 2;
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
    sh->b_end = now_s();
    return atomic_load(&sh->b_failed) ? 2 : 0;
}

/* ---- the daemon --------------------------------------------------------- */

static pid_t g_pid; /* the running kvd */

/* The daemon's minor page faults and CPU seconds (user + system) so far,
 * from /proc/PID/stat (fields 10, 14 and 15); 0 when it cannot be read. */
static void kvd_usage(uint64_t *minflt, double *cpu_s)
{
    char path[64], buf[1024];
    *minflt = 0;
    *cpu_s = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)g_pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *s = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long long v[16] = {0};
    /* After ") ": state, then fields 4.. as numbers. */
    if (!s || sscanf(s + 2, "%*c %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu",
                     &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13],
                     &v[14], &v[15]) != 12)
        return;
    long hz = sysconf(_SC_CLK_TCK);
    *minflt = v[10];
    *cpu_s = (double)(v[14] + v[15]) / (double)(hz > 0 ? hz : 100);
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
                          "--socket-group",
                          "nogroup",
                          NULL};
    if (kh_start_bench(d, conf_tenants, base) != 0)
        return -1;
    snprintf(sh->sock, sizeof sh->sock, "%s", d->sock);
    g_pid = d->pid;
    return 0;
}

static uint64_t disk_stat(const char *key)
{
    int fd = kh_connect(sh->sock);
    if (fd < 0)
        return 0;
    uint64_t v = kh_stat(fd, "disk", key);
    close(fd);
    return v;
}

/* stats pages.device.KEY + pages.host.KEY (the warm reserve's counters; 0
 * without them). */
static uint64_t warm_stat(const char *key)
{
    int fd = kh_connect(sh->sock);
    struct kh_reply r;
    uint64_t v = 0;
    if (fd < 0)
        return 0;
    if (kh_call0(fd, "stats", 999999, &r) == 0) {
        const msgpack_object *pg = kh_obj(r.root, "pages");
        for (int t = 0; pg && t < 2; t++) {
            uint64_t x = kh_u64(kh_obj(pg, t ? "host" : "device"), key);
            v += x == UINT64_MAX ? 0 : x;
        }
    }
    kh_reply_free(&r);
    close(fd);
    return v;
}

/* The prefetch workers' escalations from SCHED_IDLE so far (stats
 * prefetch.escalations; 0 without the map). */
static uint64_t escalations(void)
{
    int fd = kh_connect(sh->sock);
    if (fd < 0)
        return 0;
    uint64_t v = kh_stat(fd, "prefetch", "escalations");
    close(fd);
    return v == UINT64_MAX ? 0 : v;
}

static const char *const cpu_keys[5] = {"restore_cpu_read_us", "restore_cpu_take_us",
                                        "restore_cpu_prefault_us", "restore_cpu_copy_us",
                                        "restore_cpu_enter_us"};

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct phase {
    double p50, p99, max, mean;
    size_t gaps, tokens;
    unsigned b_sent, b_cached;
    uint64_t restored, read_bytes, read_reqs, restores, restore_us_total;
    double b_wall;
    uint64_t cpu_us[5];              /* the restores' CPU by step (stats disk.restore_cpu_*_us) */
    uint64_t escalations;            /* prefetch jobs raised from SCHED_IDLE in the phase */
    uint64_t minflt;                 /* the daemon's minor page faults in the phase */
    uint64_t warm_hits, warm_misses; /* pages the pools took warm and cold */
    double cpu_s;                    /* and its CPU seconds */
};

/* Alpha's inter-token gaps (ms) of the tokens that arrived within [t0, t1]
 * (the whole stream when t1 < t0). */
static void gaps(struct phase *ph, double t0, double t1)
{
    double g[A_TOKENS_MAX];
    size_t n = 0;
    for (size_t i = 1; i < sh->a_n; i++)
        if (t1 < t0 || (sh->a_t[i] >= t0 && sh->a_t[i - 1] <= t1))
            g[n++] = (sh->a_t[i] - sh->a_t[i - 1]) * 1e3;
    ph->gaps = n;
    ph->tokens = sh->a_n;
    if (!n)
        return;
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += g[i];
    qsort(g, n, sizeof *g, cmp_double);
    ph->p50 = g[n / 2];
    ph->p99 = g[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
    ph->max = g[n - 1];
    ph->mean = sum / (double)n;
}

/* Alpha streams (when with_alpha), with beta sending prompts [first, end)
 * meanwhile when with_beta (until alpha is done, when it streams). */
static int run_phase(struct phase *ph, bool with_alpha, bool with_beta, unsigned first,
                     unsigned end)
{
    sh->b_first = first;
    sh->b_end_k = end;
    memset(ph, 0, sizeof *ph);
    atomic_store(&sh->a_done, 0);
    atomic_store(&sh->b_next, 0);
    atomic_store(&sh->b_sent, 0);
    atomic_store(&sh->b_cached_blocks, 0);
    uint64_t r0 = disk_stat("restored"), rb0 = disk_stat("read_bytes");
    uint64_t rq0 = disk_stat("read_requests"), rs0 = disk_stat("restores");
    uint64_t rt0 = disk_stat("restores") * disk_stat("restore_mean_us");
    uint64_t f0, cpu0[5];
    double c0;
    for (size_t i = 0; i < 5; i++)
        cpu0[i] = disk_stat(cpu_keys[i]);
    uint64_t e0 = escalations();
    uint64_t wh0 = warm_stat("warm_hits"), wm0 = warm_stat("warm_misses");
    kvd_usage(&f0, &c0);
    pid_t pb = with_beta ? kh_run_as(UID_B, GID_ALL, beta, with_alpha ? (void *)1 : NULL) : 0;
    pid_t pa = with_alpha ? kh_run_as(UID_A, GID_ALL, alpha, NULL) : 0;
    if (pa < 0 || pb < 0)
        return -1;
    int rc = with_alpha ? kh_child_status(pa) : 0;
    if (with_beta && kh_child_status(pb) != 0)
        rc = -1;
    if (rc != 0)
        return -1;
    if (!with_alpha) {
        ph->b_sent = atomic_load(&sh->b_sent);
        ph->b_wall = sh->b_end - sh->b_start;
    } else if (with_beta) {
        gaps(ph, sh->b_start, sh->b_end);
        ph->b_sent = atomic_load(&sh->b_sent);
        ph->b_wall = sh->b_end - sh->b_start;
    } else {
        gaps(ph, 1, 0);
    }
    uint64_t f1;
    double c1;
    kvd_usage(&f1, &c1);
    ph->minflt = f1 - f0;
    ph->cpu_s = c1 - c0;
    for (size_t i = 0; i < 5; i++)
        ph->cpu_us[i] = disk_stat(cpu_keys[i]) - cpu0[i];
    ph->escalations = escalations() - e0;
    ph->warm_hits = warm_stat("warm_hits") - wh0;
    ph->warm_misses = warm_stat("warm_misses") - wm0;
    ph->b_cached = atomic_load(&sh->b_cached_blocks);
    ph->restored = disk_stat("restored") - r0;
    ph->read_bytes = disk_stat("read_bytes") - rb0;
    ph->read_reqs = disk_stat("read_requests") - rq0;
    ph->restores = disk_stat("restores") - rs0;
    ph->restore_us_total = disk_stat("restores") * disk_stat("restore_mean_us") - rt0;
    return 0;
}

static void print_phase(const char *name, const struct phase *ph)
{
    if (!ph->tokens)
        printf("  %-34s (alpha idle)", name);
    else
        printf(
            "  %-34s alpha inter-token ms p50 %6.2f  p99 %7.2f  max %7.2f  mean %6.2f  (%zu gaps "
            "of %zu tokens)",
            name, ph->p50, ph->p99, ph->max, ph->mean, ph->gaps, ph->tokens);
    if (ph->b_sent)
        printf("\n  %-34s beta: %u requests in %.2f s (%u of %u blocks cached), %" PRIu64
               " blocks restored, %" PRIu64 " MB read in %" PRIu64 " requests, %" PRIu64
               " restores: %.2f GB/s",
               "", ph->b_sent, ph->b_wall, ph->b_cached, ph->b_sent * (sh->tokens / 16),
               ph->restored, ph->read_bytes / 1000000, ph->read_reqs, ph->restores,
               ph->restore_us_total ? (double)ph->read_bytes / (double)ph->restore_us_total / 1e3
                                    : 0.0);
    printf("\n  %-34s kvd: %" PRIu64 " minor faults, %.2f s CPU; pages taken warm %" PRIu64
           ", cold %" PRIu64,
           "", ph->minflt, ph->cpu_s, ph->warm_hits, ph->warm_misses);
    if (ph->restored)
        printf("; per block restored: %.0f faults, %.0f us in its prefetch",
               (double)ph->minflt / (double)ph->restored,
               (double)ph->restore_us_total / (double)ph->restored);
    if (ph->restored) {
        double per[5], sum = 0;
        for (size_t i = 0; i < 5; i++)
            sum += per[i] = (double)ph->cpu_us[i] / (double)ph->restored;
        printf("\n  %-34s restore CPU per block %.0f us: read+checks %.0f, take %.0f, prefault "
               "%.0f, copy %.0f, enter %.0f; %" PRIu64 " of %" PRIu64
               " restores raised from SCHED_IDLE",
               "", sum, per[0], per[1], per[2], per[3], per[4], ph->escalations, ph->restores);
    }
    printf("\n");
}

/* KVD_BENCH_HOOK: a shell command run (with KVD_PID set) just before the
 * phase where beta restores while alpha decodes, e.g. a profiler;
 * KVD_BENCH_HOOK_SOLO: the same before the phase where beta restores alone. */
static int hook(const struct kh_proc *d, const char *env)
{
    const char *h = getenv(env);
    char cmd[4200];
    if (!h || !h[0])
        return 0;
    snprintf(cmd, sizeof cmd, "KVD_PID=%d %s", (int)d->pid, h);
    if (system(cmd) != 0)
        fprintf(stderr, "bench_disk_tenants: KVD_BENCH_HOOK failed\n");
    return 0;
}

int main(int argc, char **argv)
{
    unsigned prompts = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 48;
    unsigned tokens = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : 1024;
    const char *tools = getenv("KVD_TOOLS_DIR");
    if (!prompts || prompts > MAX_PROMPTS || tokens < 32 || tokens > 8000 || !tools ||
        !getenv("KVD_BIN") || geteuid() != 0) {
        fprintf(stderr,
                "usage: bench_disk_tenants [PROMPTS <= %d] [TOKENS] [DIR] (as root; KVD_BIN, "
                "KVD_TOOLS_DIR)\n",
                MAX_PROMPTS);
        return 2;
    }
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED)
        return 1;
    memset(sh, 0, sizeof *sh);
    sh->prompts = prompts;
    const char *at = getenv("KVD_BENCH_ALPHA_TOKENS");
    sh->a_tokens = at ? (unsigned)strtoul(at, NULL, 10) : 256;
    if (sh->a_tokens < 2 || sh->a_tokens > A_TOKENS_MAX) {
        fprintf(stderr, "bench_disk_tenants: KVD_BENCH_ALPHA_TOKENS must be 2..%d\n", A_TOKENS_MAX);
        return 2;
    }
    sh->tokens = tokens;
    char tmp[] = "/var/tmp/kvd-bench-tenants.XXXXXX", model[4200], disk[4200], cmd[9000];
    const char *dir = argc > 3 ? argv[3] : mkdtemp(tmp);
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
    char idx[4300];
    snprintf(idx, sizeof idx, "%s/index.kvd", disk);
    const char *reuse_env = getenv("KVD_BENCH_REUSE");
    bool reuse = argc > 3 && reuse_env && strcmp(reuse_env, "1") == 0 && access(model, R_OK) == 0 &&
                 access(idx, R_OK) == 0;
    if (!reuse && system(cmd) != 0) {
        fprintf(stderr, "bench_disk_tenants: %s failed\n", cmd);
        return 1;
    }
    struct kh_proc d;
    struct phase alone, solo, rst, mem;
    int rc = 1;
    double t0 = now_s(), t_fill = 0;
    if (reuse)
        goto restart;
    if (start(&d, model, disk))
        goto out;
    sh->b_first = 0;
    sh->b_end_k = prompts;
    pid_t pb = kh_run_as(UID_B, GID_ALL, beta, NULL);
    if (pb < 0 || kh_child_status(pb) != 0) {
        fprintf(stderr, "bench_disk_tenants: filling failed\n");
        goto stop;
    }
    t_fill = now_s() - t0;
    if (kh_stop(&d) != 0) {
        fprintf(stderr, "bench_disk_tenants: kvd did not exit cleanly\n");
        goto out;
    }
restart:
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    bool dropped = f && fputs("3\n", f) >= 0;
    if (f && fclose(f) != 0)
        dropped = false;
    if (start(&d, model, disk))
        goto out;
    uint64_t loaded = disk_stat("loaded");
    /* A first stream warms the daemon (its first request pays start-up costs). */
    unsigned half = prompts / 2;
    if (run_phase(&alone, true, false, 0, 0) || run_phase(&alone, true, false, 0, 0) ||
        hook(&d, "KVD_BENCH_HOOK_SOLO") || run_phase(&solo, false, true, 0, half) ||
        hook(&d, "KVD_BENCH_HOOK") || run_phase(&rst, true, true, half, prompts)) {
        fprintf(stderr, "bench_disk_tenants: a phase failed\n");
        goto stop;
    }
    sh->b_cycle = rst.b_sent ? rst.b_sent : 1; /* only what is in memory now */
    if (run_phase(&mem, true, true, half, prompts)) {
        fprintf(stderr, "bench_disk_tenants: a phase failed\n");
        goto stop;
    }
    printf("alpha decodes %d tokens while beta's %u prompts of %u tokens (%u blocks of 256 KiB "
           "each) restore from disk; kvd args:",
           sh->a_tokens, prompts, tokens, tokens / 16);
    for (const char *const *a = kh_bench_args(); *a; a++)
        printf(" %s", strcmp(*a, model) == 0 ? "M.gguf" : strcmp(*a, disk) == 0 ? "DIR" : *a);
    if (reuse)
        printf("\n  fill: reused DIR; restart: page cache %s, %" PRIu64 " blocks loaded\n",
               dropped ? "dropped" : "NOT dropped", loaded);
    else
        printf("\n  fill: %u prompts in %.1f s; restart: page cache %s, %" PRIu64
               " blocks loaded\n",
               prompts, t_fill, dropped ? "dropped" : "NOT dropped", loaded);
    print_phase("alone", &alone);
    print_phase("beta restoring, alpha idle", &solo);
    print_phase("beta restoring from disk", &rst);
    print_phase("beta from memory (control)", &mem);
    printf("  p99 restoring / alone %.2fx, restoring / memory %.2fx; p50 %.2fx, %.2fx\n",
           rst.p99 / alone.p99, rst.p99 / mem.p99, rst.p50 / alone.p50, rst.p50 / mem.p50);
    rc = 0;
stop:
    if (kh_stop(&d) != 0)
        rc = 1;
out:
    if (argc <= 3) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "bench_disk_tenants: %s failed\n", cmd);
    }
    return rc;
}
