/* kvctl bench's report: percentiles of TTFT, inter-token gaps, TPOT and
 * end-to-end latency, tokens/s, the prefix hit rate, the daemon's swap and
 * preemption counters over the run and its roofline, as text or --json. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvctl.h"
#include "kvctl_bench.h"

/* ---- the report ------------------------------------------------------------ */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct pcts {
    double p50, p90, p99, mean;
    size_t n;
};

/* Percentiles (nearest rank) of v[0..n), sorted in place; seconds → ms. */
static struct pcts pct(double *v, size_t n)
{
    struct pcts p = {.n = n};
    if (n == 0)
        return p;
    qsort(v, n, sizeof(*v), cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    p.mean = sum / (double)n * 1e3;
    p.p50 = v[(size_t)ceil(0.50 * (double)n) - 1] * 1e3;
    p.p90 = v[(size_t)ceil(0.90 * (double)n) - 1] * 1e3;
    p.p99 = v[(size_t)ceil(0.99 * (double)n) - 1] * 1e3;
    return p;
}

int kvctl_bench_read_stats(struct kvd_ctx *ctx, struct dstats *d, struct kvd_reply **keep)
{
    struct kvd_reply *r = NULL;
    int rc = kvd_stats(ctx, &r);
    if (rc) {
        kvd_reply_free(r);
        return rc;
    }
    const struct kvd_value *b = r->body;
    double *dst[] = {&d->swaps_out, &d->swaps_in, &d->preempt_swap, &d->preempt_recompute};
    const char *paths[] = {"counters.swaps_out", "counters.swaps_in", "requests.preempt_swap",
                           "requests.preempt_recompute"};
    for (int i = 0; i < 4; i++)
        if (kvd_value_f64(kvd_value_path(b, paths[i]), dst[i]) != 0)
            *dst[i] = 0;
    if (keep)
        *keep = r;
    else
        kvd_reply_free(r);
    return 0;
}

static double f64at(const struct kvd_value *v, const char *key)
{
    double d = 0;
    return kvd_value_f64(kvd_value_get(v, key), &d) == 0 ? d : 0;
}

/* The roofline of each phase that ran, from the final stats. */
static void print_roofline(FILE *f, const struct kvd_value *body, bool json)
{
    static const char *const phases[] = {"prefill", "decode", "mixed"};
    const struct kvd_value *rl = kvd_value_get(body, "roofline");
    const struct kvd_value *m = kvd_value_get(rl, "measured");
    bool measured = m && m->type == KVD_T_BOOL && m->v.b;
    const char *backend = kvd_value_str(kvd_value_get(body, "backend"));
    const char *mem = backend && !strcmp(backend, "cuda") ? "HBM BW" : "memory BW";
    if (json)
        fprintf(f, ",\"roofline\":{\"measured\":%s", measured ? "true" : "false");
    else
        fprintf(f, "roofline (daemon, last %d steps per phase):\n", 128);
    for (int i = 0; i < 3; i++) {
        const struct kvd_value *p = kvd_value_get(rl, phases[i]);
        if (!p || f64at(p, "window") == 0)
            continue;
        const char *bound = kvd_value_str(kvd_value_get(p, "bound"));
        bool bw = bound && !strcmp(bound, "bandwidth");
        double frac = bw ? f64at(p, "bytes_frac") : f64at(p, "flops_frac");
        if (json)
            fprintf(f,
                    ",\"%s\":{\"intensity\":%.4g,\"flops_frac\":%.4g,\"bytes_frac\":%.4g,"
                    "\"bound\":\"%s\",\"ms_per_step\":%.4g,\"steps\":%.0f}",
                    phases[i], f64at(p, "intensity"), f64at(p, "flops_frac"),
                    f64at(p, "bytes_frac"), bound ? bound : "unknown", f64at(p, "ms_per_step"),
                    f64at(p, "steps"));
        else if (measured)
            fprintf(f, "  %s: %.0f%% of %s, intensity %.2g FLOP/B, %s-bound (%.2f ms/step)\n",
                    phases[i], 100 * frac, bw ? mem : "peak FLOP/s", f64at(p, "intensity"), bound,
                    f64at(p, "ms_per_step"));
        else
            fprintf(f, "  %s: intensity %.2g FLOP/B (ceilings not measured)\n", phases[i],
                    f64at(p, "intensity"));
    }
    if (json)
        fputc('}', f);
}

static void print_pcts(FILE *f, const char *name, struct pcts p, bool json)
{
    if (json)
        fprintf(f, ",\"%s_ms\":{\"p50\":%.4f,\"p90\":%.4f,\"p99\":%.4f,\"mean\":%.4f,\"n\":%zu}",
                name, p.p50, p.p90, p.p99, p.mean, p.n);
    else
        fprintf(f, "%-5s ms  p50 %9.2f  p90 %9.2f  p99 %9.2f  mean %9.2f  (n=%zu)\n", name, p.p50,
                p.p90, p.p99, p.mean, p.n);
}

int kvctl_bench_report(const struct bench_conf *bc, const struct shared *sh,
                       const struct dstats *d0, const struct dstats *d1,
                       const struct kvd_value *final_stats, double wall)
{
    uint32_t total = sh->n_chats * bc->turns;
    double *ttft = malloc((total + 1) * sizeof(double)),
           *e2e = malloc((total + 1) * sizeof(double));
    double *tpot = malloc((total + 1) * sizeof(double));
    size_t n_gaps_all = 0;
    for (uint32_t i = 0; i < total; i++)
        if (sh->recs[i].err == 0)
            n_gaps_all += sh->recs[i].n_gaps;
    double *itl = malloc((n_gaps_all + 1) * sizeof(double));
    if (!ttft || !e2e || !itl || !tpot) {
        free(tpot);
        free(ttft);
        free(e2e);
        free(itl);
        return kvctl_usage_err("bench: out of memory");
    }
    size_t n_ok = 0, n_fail = 0, n_skip = 0, n_mis = 0, ng = 0, n_tpot = 0;
    double prompt = 0, cached = 0, out = 0;
    int first_err = 0;
    for (uint32_t i = 0; i < total; i++) {
        const struct rec *r = &sh->recs[i];
        if (r->err < 0) {
            n_skip++;
            continue;
        }
        if (r->err) {
            n_fail++;
            if (!first_err)
                first_err = r->err;
            continue;
        }
        n_mis += r->mismatch;
        if (r->completion > 1) /* time per output token after the first */
            tpot[n_tpot++] = (r->e2e - r->ttft) / (double)(r->completion - 1);
        ttft[n_ok] = r->ttft;
        e2e[n_ok] = r->e2e;
        n_ok++;
        prompt += r->prompt;
        cached += r->cached;
        out += r->completion;
        for (uint32_t g = 0; g < r->n_gaps; g++)
            itl[ng++] = sh->gaps[(size_t)i * sh->gap_cap + g];
    }
    struct pcts pt = pct(ttft, n_ok), pe = pct(e2e, n_ok), pi = pct(itl, ng),
                pp = pct(tpot, n_tpot);
    double hit = prompt > 0 ? cached / prompt : 0;
    bool json = bc->json;
    FILE *f = stdout;
    if (json) {
        fprintf(f, "{\"requests\":%u,\"ok\":%zu,\"failed\":%zu,\"skipped\":%zu", total, n_ok,
                n_fail, n_skip);
        if (first_err)
            fprintf(f, ",\"first_error\":\"%s\"", kvd_err_code(first_err));
        fprintf(f, ",\"connections\":%u,\"turns\":%u,\"rate\":%.4g,\"shared_prefix\":%.4g",
                bc->conns, bc->turns, bc->rate, bc->shared);
        fprintf(f,
                ",\"wall_s\":%.4f,\"input_tokens\":%.0f,\"cached_tokens\":%.0f,"
                "\"output_tokens\":%.0f,\"input_tokens_per_s\":%.2f,\"output_tokens_per_s\":%.2f",
                wall, prompt, cached, out, wall > 0 ? prompt / wall : 0, wall > 0 ? out / wall : 0);
        fprintf(f, ",\"prefix_hit_rate\":%.4f", hit);
    } else {
        fprintf(
            f, "requests %u: %zu ok, %zu failed%s%s, %zu not run  (%u connections, %u turns, %s)\n",
            total, n_ok, n_fail, first_err ? " first error " : "",
            first_err ? kvd_err_code(first_err) : "", n_skip, bc->conns, bc->turns,
            bc->rate > 0 ? "Poisson arrivals" : "closed loop");
        fprintf(f, "wall %.2f s   input %.0f tok (%.1f tok/s)   output %.0f tok (%.1f tok/s)\n",
                wall, prompt, wall > 0 ? prompt / wall : 0, out, wall > 0 ? out / wall : 0);
        fprintf(f, "prefix hit rate %.1f%% (%.0f of %.0f prompt tokens cached)\n", 100 * hit,
                cached, prompt);
    }
    print_pcts(f, "ttft", pt, json);
    print_pcts(f, "itl", pi, json);
    print_pcts(f, "tpot", pp, json);
    print_pcts(f, "e2e", pe, json);
    double so = d1->swaps_out - d0->swaps_out, si = d1->swaps_in - d0->swaps_in;
    double ps = d1->preempt_swap - d0->preempt_swap,
           pr = d1->preempt_recompute - d0->preempt_recompute;
    if (json)
        fprintf(f,
                ",\"swaps_out\":%.0f,\"swaps_in\":%.0f,\"preempt_swap\":%.0f,"
                "\"preempt_recompute\":%.0f",
                so, si, ps, pr);
    else
        fprintf(f, "swaps out %.0f in %.0f blocks   preemptions swap %.0f recompute %.0f\n", so, si,
                ps, pr);
    if (bc->verify) {
        if (json)
            fprintf(f, ",\"verified\":%zu,\"mismatches\":%zu,\"outputs_match\":%s", n_ok, n_mis,
                    n_mis == 0 && n_fail == 0 ? "true" : "false");
        else
            fprintf(f, "verify: %zu of %zu outputs equal the one-at-a-time first pass%s\n",
                    n_ok - n_mis, n_ok, n_mis ? "  MISMATCH" : "");
    }
    if (final_stats)
        print_roofline(f, final_stats, json);
    if (json)
        fputs("}\n", f);
    free(ttft);
    free(e2e);
    free(itl);
    free(tpot);
    if (atomic_load(&((struct shared *)sh)->conn_failed) > 0)
        return KVCTL_ECONN; /* some connections never ran (the message said why) */
    return n_fail || n_mis ? KVCTL_ESERVER : KVCTL_OK;
}
