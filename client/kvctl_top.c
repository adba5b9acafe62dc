/* kvctl top: a live view of the daemon (like top/nvtop) from its `stats`:
 * pool occupancy by tier and tenant, the executor's queues, tokens/s, the
 * roofline of each phase. Redraws the terminal every interval; prints plain
 * frames one after another when stdout is not a terminal (-n for scripts). */
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvctl.h"

static const char top_help[] =
    "usage: kvctl top [-n COUNT] [-d SECONDS] [--plain]\n"
    "Shows the daemon's pool occupancy by tier and tenant, running/waiting/\n"
    "swapped requests, tokens/s, each model (state, memory, loads, tokens/s)\n"
    "and the roofline of each executor phase,\n"
    "refreshed every SECONDS (default 1). On a terminal the screen is redrawn;\n"
    "otherwise (or with --plain) each refresh prints a plain frame, separated\n"
    "by a blank line. -n COUNT stops after COUNT frames (default: until ^C).\n"
    "Admins see every tenant, others their own.\n";

/* ---- reading the stats tree ---------------------------------------------- */

static double num(const struct kvd_value *root, const char *path)
{
    double d = 0;
    if (kvd_value_f64(kvd_value_path(root, path), &d) != 0)
        return 0;
    return d;
}

static double field(const struct kvd_value *map, const char *key)
{
    double d = 0;
    if (kvd_value_f64(kvd_value_get(map, key), &d) != 0)
        return 0;
    return d;
}

static const char *str(const struct kvd_value *root, const char *path, const char *def)
{
    const char *s = kvd_value_str(kvd_value_path(root, path));
    return s ? s : def;
}

/* "12.3 G" style: value scaled by 1000s with a unit suffix. */
static void human(char *buf, size_t cap, double v, const char *unit)
{
    static const char *const pre[] = {"", "k", "M", "G", "T", "P"};
    int i = 0;
    while (fabs(v) >= 1000 && i < 5) {
        v /= 1000;
        i++;
    }
    snprintf(buf, cap, "%.*f %s%s", v < 10 ? 2 : v < 100 ? 1 : 0, v, pre[i], unit);
}

static void bar(FILE *f, double frac, int width)
{
    if (!(frac >= 0))
        frac = 0;
    if (frac > 1)
        frac = 1;
    int n = (int)lround(frac * width);
    fputc('[', f);
    for (int i = 0; i < width; i++)
        fputc(i < n ? '#' : '.', f);
    fputc(']', f);
}

/* ---- one frame ----------------------------------------------------------- */

/* Totals remembered between frames for rates. */
#define TOP_MODELS 16
struct top_prev {
    bool have;
    double t, tok_in, tok_out, steps;
    double model_gen[TOP_MODELS]; /* each model's tokens sampled */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void tier_line(FILE *f, const struct kvd_value *st, const char *tier)
{
    char path[32];
    snprintf(path, sizeof(path), "%s.total", tier);
    double total = num(st, path);
    snprintf(path, sizeof(path), "%s.used", tier);
    double used = num(st, path);
    snprintf(path, sizeof(path), "%s.cached", tier);
    double cached = num(st, path);
    snprintf(path, sizeof(path), "%s.free", tier);
    double free_ = num(st, path);
    fprintf(f, "%-7s ", tier);
    bar(f, total > 0 ? (used + cached) / total : 0, 30);
    fprintf(f, " %6.0f used %6.0f cached %6.0f free / %.0f blocks (%.0f%% held)\n", used, cached,
            free_, total, total > 0 ? 100 * (used + cached) / total : 0);
}

/* "decode: 71% of HBM BW, intensity 2.1 FLOP/B, bandwidth-bound". */
static void phase_line(FILE *f, const struct kvd_value *rl, const char *phase, bool measured,
                       const char *mem_name)
{
    const struct kvd_value *p = kvd_value_get(rl, phase);
    double steps = field(p, "steps"), window = field(p, "window");
    if (!p || window == 0) {
        fprintf(f, "  %-8s no steps yet\n", phase);
        return;
    }
    const char *bound = kvd_value_str(kvd_value_get(p, "bound"));
    char fl[32], by[32];
    human(fl, sizeof(fl), field(p, "flops_per_s"), "FLOP/s");
    human(by, sizeof(by), field(p, "bytes_per_s"), "B/s");
    if (measured && bound && !strcmp(bound, "bandwidth"))
        fprintf(f, "  %-8s %3.0f%% of %s, intensity %.2g FLOP/B, bandwidth-bound", phase,
                100 * field(p, "bytes_frac"), mem_name, field(p, "intensity"));
    else if (measured && bound && !strcmp(bound, "compute"))
        fprintf(f, "  %-8s %3.0f%% of peak FLOP/s, intensity %.2g FLOP/B, compute-bound", phase,
                100 * field(p, "flops_frac"), field(p, "intensity"));
    else
        fprintf(f, "  %-8s intensity %.2g FLOP/B (ceilings not measured)", phase,
                field(p, "intensity"));
    fprintf(f, "  [%s, %s, %.2f ms/step, %.0f steps]\n", fl, by, field(p, "ms_per_step"), steps);
}

static void tenants_table(FILE *f, const struct kvd_value *st)
{
    const struct kvd_value *ts = kvd_value_get(st, "tenants");
    fprintf(f, "%-16s %6s %6s %6s %5s %5s %6s %8s %8s %7s %8s\n", "TENANT", "DEV", "HOST", "CACHED",
            "SEQS", "HIT%", "REQS", "TOK-IN", "TOK-OUT", "PREEMPT", "QUEUE-MS");
    if (!ts || ts->type != KVD_T_ARRAY)
        return;
    for (size_t i = 0; i < ts->v.array.n; i++) {
        const struct kvd_value *t = &ts->v.array.items[i];
        const char *name = kvd_value_str(kvd_value_get(t, "name"));
        fprintf(f, "%-16.16s %6.0f %6.0f %6.0f %5.0f %4.0f%% %6.0f %8.0f %8.0f %7.0f %8.1f\n",
                name ? name : "?", field(t, "device_blocks"), field(t, "host_blocks"),
                field(t, "cached_blocks"), field(t, "seqs"), 100 * field(t, "prefix_hit_rate"),
                field(t, "requests"), field(t, "tokens_in"), field(t, "tokens_out"),
                field(t, "preemptions"), field(t, "queue_ms_mean"));
    }
}

/* The daemon's models: state, memory, loads, requests and tokens/s (a
 * model's sampled tokens since the last frame). */
static void models_table(FILE *f, const struct kvd_value *st, struct top_prev *prev, double dt)
{
    const struct kvd_value *ms = kvd_value_get(st, "models");
    if (!ms || ms->type != KVD_T_ARRAY || ms->v.array.n == 0)
        return;
    const struct kvd_value *mem = kvd_value_get(st, "model_memory");
    if (mem) {
        char used[32], budget[32] = "none";
        human(used, sizeof(used), field(mem, "device_used"), "B");
        if (field(mem, "device_budget") > 0)
            human(budget, sizeof(budget), field(mem, "device_budget"), "B");
        fprintf(f, "models    device %s of budget %s\n", used, budget);
    }
    fprintf(f, "%-16s %-9s %9s %9s %5s %7s %5s %5s %9s\n", "MODEL", "STATE", "WEIGHTS", "KV",
            "LOADS", "UNLOADS", "LIVE", "WAIT", "TOK/S");
    for (size_t i = 0; i < ms->v.array.n; i++) {
        const struct kvd_value *m = &ms->v.array.items[i];
        const char *name = kvd_value_str(kvd_value_get(m, "name"));
        const char *state = kvd_value_str(kvd_value_get(m, "state"));
        char w[32], kv[32], rate[32] = "-";
        human(w, sizeof(w), field(m, "weight_device_bytes"), "B");
        human(kv, sizeof(kv), field(m, "kv_device_bytes"), "B");
        double gen = field(m, "generated");
        if (i < TOP_MODELS) {
            if (prev->have && dt > 0)
                snprintf(rate, sizeof(rate), "%.0f", (gen - prev->model_gen[i]) / dt);
            prev->model_gen[i] = gen;
        }
        fprintf(f, "%-16.16s %-9s %9s %9s %5.0f %7.0f %5.0f %5.0f %9s\n", name ? name : "?",
                state ? state : "?", w, kv, field(m, "loads"), field(m, "unloads"),
                field(m, "live"), field(m, "waiting"), rate);
    }
}

static void frame(FILE *f, const struct kvd_value *st, struct top_prev *prev)
{
    time_t wall = time(NULL);
    struct tm tmv;
    char clock[16] = "";
    if (localtime_r(&wall, &tmv))
        strftime(clock, sizeof(clock), "%H:%M:%S", &tmv);
    const char *backend = str(st, "backend", "?");
    fprintf(f, "kvd top  %s  backend %s  connections %.0f  in flight %.0f  seqs %.0f\n", clock,
            backend, num(st, "connections"), num(st, "in_flight"), num(st, "counters.seqs"));
    tier_line(f, st, "device");
    tier_line(f, st, "host");
    if (kvd_value_get(st, "disk")) { /* only with a disk tier (docs/persistence.md) */
        tier_line(f, st, "disk");
        fprintf(f,
                "        %.0f reads (%.0f us each), %.0f writes, %.0f restored, %.0f queued, "
                "%.0f checksum failures, %.0f I/O errors\n",
                num(st, "disk.reads"), num(st, "disk.restore_us"), num(st, "disk.writes"),
                num(st, "disk.restored"), num(st, "disk.queued"), num(st, "disk.checksum_failures"),
                num(st, "disk.io_errors"));
    }
    if (kvd_value_get(st, "remote")) { /* only with --remote (docs/persistence.md) */
        char bi[32], bo[32];
        human(bi, sizeof(bi), num(st, "remote.bytes_in"), "B");
        human(bo, sizeof(bo), num(st, "remote.bytes_out"), "B");
        const char *rs = str(st, "remote.state", "?");
        char retry[48] = "";
        if (!strcmp(rs, "backoff"))
            snprintf(retry, sizeof(retry), " (retry in %.0f ms)", num(st, "remote.retry_in_ms"));
        fprintf(f,
                "remote  %s%s  %.0f hits, %.0f misses, %s in, %s out, %.0f writes, %.0f queued, "
                "%.0f errors, %.0f auth failures, lookup %.0f us\n",
                rs, retry, num(st, "remote.hits"), num(st, "remote.misses"), bi, bo,
                num(st, "remote.writes"), num(st, "remote.queued"), num(st, "remote.errors"),
                num(st, "remote.auth_failures"), num(st, "remote.latency_us_mean"));
    }

    /* Live counters (per step): prompt tokens computed, tokens sampled. */
    double t = now_s(), tin = num(st, "requests.prefill_tokens"),
           tout = num(st, "requests.tokens_out");
    double steps = num(st, "requests.steps");
    bool exec = false;
    const struct kvd_value *ev = kvd_value_path(st, "requests.executor");
    if (ev && ev->type == KVD_T_BOOL)
        exec = ev->v.b;
    const char *scope = kvd_value_str(kvd_value_get(st, "scope"));
    if (scope && !strcmp(scope, "tenant")) {
        /* a non-admin: daemon-wide figures are not sent (docs/operations.md) */
        fprintf(f, "requests  (daemon-wide figures are shown to admins only)\n");
    } else if (!exec) {
        fprintf(f, "requests  (store mode: no executor)\n");
    } else {
        fprintf(f, "requests  running %.0f  waiting %.0f  swapped %.0f  | ",
                num(st, "requests.running"), num(st, "requests.waiting"),
                num(st, "requests.swapped"));
        if (prev->have && t > prev->t)
            fprintf(f, "tokens/s prefill %.0f out %.0f  steps/s %.0f\n",
                    (tin - prev->tok_in) / (t - prev->t), (tout - prev->tok_out) / (t - prev->t),
                    (steps - prev->steps) / (t - prev->t));
        else
            fprintf(f, "tokens/s prefill - out -  (next refresh)\n");
    }
    models_table(f, st, prev, prev->have ? t - prev->t : 0);
    prev->have = true;
    prev->t = t;
    prev->tok_in = tin;
    prev->tok_out = tout;
    prev->steps = steps;

    double asked = num(st, "counters.match_tokens_asked"),
           hit = num(st, "counters.match_tokens_hit");
    fprintf(f,
            "cache     prefix hits %.0f%% (%.0f of %.0f tokens)  swaps out %.0f in %.0f  "
            "evictions %.0f  preemptions swap %.0f recompute %.0f\n",
            asked > 0 ? 100 * hit / asked : 0, hit, asked, num(st, "counters.swaps_out"),
            num(st, "counters.swaps_in"), num(st, "counters.evictions"),
            num(st, "requests.preempt_swap"), num(st, "requests.preempt_recompute"));

    const struct kvd_value *rl = kvd_value_get(st, "roofline");
    if (rl && rl->type == KVD_T_MAP) {
        bool measured = false;
        const struct kvd_value *m = kvd_value_get(rl, "measured");
        if (m && m->type == KVD_T_BOOL)
            measured = m->v.b;
        char fl[32], by[32];
        human(fl, sizeof(fl), field(rl, "peak_flops_per_s"), "FLOP/s");
        human(by, sizeof(by), field(rl, "peak_bytes_per_s"), "B/s");
        if (measured)
            fprintf(f, "roofline  ceilings %s, %s (ridge %.2g FLOP/B)\n", fl, by,
                    field(rl, "ridge_intensity"));
        else
            fprintf(f, "roofline  ceilings not measured\n");
        const char *mem = !strcmp(backend, "cuda") ? "HBM BW" : "memory BW";
        phase_line(f, rl, "prefill", measured, mem);
        phase_line(f, rl, "decode", measured, mem);
        phase_line(f, rl, "mixed", measured, mem);
    }
    tenants_table(f, st);
}

int kvctl_cmd_top(struct kvctl *k, int argc, char **argv)
{
    static const struct option opts[] = {
        {"count", required_argument, NULL, 'n'},
        {"delay", required_argument, NULL, 'd'},
        {"plain", no_argument, NULL, 'p'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    uint64_t count = 0;
    double delay = 1.0;
    bool plain = !isatty(STDOUT_FILENO);
    int c, rc;

    optind = 1;
    while ((c = getopt_long(argc, argv, "n:d:h", opts, NULL)) != -1) {
        switch (c) {
        case 'n':
            if (!kvctl_parse_u64(optarg, &count) || count == 0)
                return kvctl_usage_err("top -n: \"%s\" is not a positive count", optarg);
            break;
        case 'd': {
            char *end;
            delay = strtod(optarg, &end);
            if (!*optarg || *end || !(delay >= 0.05 && delay <= 3600))
                return kvctl_usage_err("top -d: \"%s\" is not a number of seconds in [0.05, 3600]",
                                       optarg);
            break;
        }
        case 'p':
            plain = true;
            break;
        case 'h':
            fputs(top_help, stdout);
            return KVCTL_OK;
        default:
            fputs(top_help, stderr);
            return KVCTL_EUSAGE;
        }
    }
    if (optind < argc)
        return kvctl_usage_err("top: unexpected argument \"%s\"", argv[optind]);
    if ((rc = kvctl_connect(k)))
        return rc;

    struct top_prev prev = {0};
    for (uint64_t i = 0; count == 0 || i < count; i++) {
        if (i > 0) {
            struct timespec ts = {(time_t)delay, (long)((delay - (double)(time_t)delay) * 1e9)};
            nanosleep(&ts, NULL);
        }
        struct kvd_reply *r = NULL;
        if (kvd_stats(k->ctx, &r)) {
            kvd_reply_free(r);
            return kvctl_fail(k, "stats");
        }
        if (plain) {
            if (i > 0)
                fputc('\n', stdout);
        } else {
            fputs("\033[H\033[2J", stdout); /* home, clear */
        }
        frame(stdout, r->body, &prev);
        fflush(stdout);
        kvd_reply_free(r);
    }
    return KVCTL_OK;
}
