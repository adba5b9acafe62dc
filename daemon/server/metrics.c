/* metrics: Prometheus text exposition (format 0.0.4) of kvd's state and the
 * evhttp listener serving it at /metrics on the server's loop thread. Names
 * follow the Prometheus conventions: base units (seconds, bytes), _total
 * for counters, one metric per quantity with labels for tier/tenant/phase. */
#include "metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include "httpd.h"
#include "kvevents.h"
#include "log.h"
#include "models.h"
#include "server.h"
#include "stats_snap.h"

/* ---- address ------------------------------------------------------------ */

int metrics_parse_addr(const char *s, char *host, size_t host_cap, uint16_t *port, bool *loopback,
                       char *err, size_t errlen)
{
    return httpd_parse_addr("metrics", s, host, host_cap, port, loopback, err, errlen);
}

/* ---- rendering ---------------------------------------------------------- */

/* Output with sticky failure: the first failed append makes every later one
 * a no-op and the render return KVD_ENOMEM. */
struct out {
    struct evbuffer *b;
    int rc;
};

__attribute__((format(printf, 2, 3))) static void put(struct out *o, const char *fmt, ...)
{
    if (o->rc)
        return;
    va_list ap;
    va_start(ap, fmt);
    if (evbuffer_add_vprintf(o->b, fmt, ap) < 0)
        o->rc = KVD_ENOMEM;
    va_end(ap);
}

static void head(struct out *o, const char *name, const char *type, const char *help)
{
    put(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value with \, " and newline escaped, as the format requires. */
static void put_label(struct out *o, const char *v)
{
    char buf[160];
    size_t j = 0;
    for (size_t i = 0; v[i] && j + 3 < sizeof(buf); i++) {
        char ch = v[i];
        if (ch == '\\' || ch == '"') {
            buf[j++] = '\\';
            buf[j++] = ch;
        } else if (ch == '\n') {
            buf[j++] = '\\';
            buf[j++] = 'n';
        } else {
            buf[j++] = ch;
        }
    }
    buf[j] = 0;
    put(o, "%s", buf);
}

/* name{tenant="T"} value */
static void tenant_line(struct out *o, const char *name, const char *extra, const char *tenant,
                        double v)
{
    put(o, "%s{%stenant=\"", name, extra ? extra : "");
    put_label(o, tenant);
    put(o, "\"} %.17g\n", v);
}

static void render_hist(struct out *o, const char *name, const char *help, struct acct *a,
                        enum acct_hist_kind k)
{
    struct acct_hist h;
    acct_hist_get(a, k, &h);
    head(o, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < ACCT_N_BUCKETS; i++) {
        cum += h.bucket[i];
        put(o, "%s_bucket{le=\"%g\"} %llu\n", name, acct_bucket_le[i], (unsigned long long)cum);
    }
    cum += h.bucket[ACCT_N_BUCKETS];
    put(o, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    put(o, "%s_sum %.17g\n%s_count %llu\n", name, h.sum, name, (unsigned long long)h.count);
}

static void render_pool(struct out *o, const struct kvmm_stats *st)
{
    head(o, "kvd_pool_blocks", "gauge", "KV blocks of the pool by tier and state.");
    const struct {
        const char *tier;
        uint32_t total, free_, cached, used;
    } t[2] = {{"device", st->device_total, st->device_free, st->device_cached, st->device_used},
              {"host", st->host_total, st->host_free, st->host_cached, st->host_used}};
    for (int i = 0; i < 2; i++) {
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"total\"} %u\n", t[i].tier, t[i].total);
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"free\"} %u\n", t[i].tier, t[i].free_);
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"cached\"} %u\n", t[i].tier, t[i].cached);
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"used\"} %u\n", t[i].tier, t[i].used);
    }
    head(o, "kvd_swap_bytes_total", "counter", "Bytes moved between tiers by swaps.");
    put(o, "kvd_swap_bytes_total{direction=\"out\"} %llu\n",
        (unsigned long long)st->swap_bytes_out);
    put(o, "kvd_swap_bytes_total{direction=\"in\"} %llu\n", (unsigned long long)st->swap_bytes_in);
    head(o, "kvd_evictions_total", "counter", "Cached device blocks evicted (to host or dropped).");
    put(o, "kvd_evictions_total %llu\n", (unsigned long long)st->evictions_device);
    head(o, "kvd_drops_total", "counter", "Cached blocks dropped from every tier.");
    put(o, "kvd_drops_total %llu\n", (unsigned long long)st->drops);
    head(o, "kvd_checksum_failures_total", "counter", "Host-tier blocks whose checksum failed.");
    put(o, "kvd_checksum_failures_total %llu\n", (unsigned long long)st->checksum_failures);
    head(o, "kvd_cow_copies_total", "counter", "Copy-on-write block copies.");
    put(o, "kvd_cow_copies_total %llu\n", (unsigned long long)st->cow_copies);
    head(o, "kvd_sequences", "gauge", "Open sequences.");
    put(o, "kvd_sequences %u\n", st->n_seqs);
}

/* The remote tier's series (none without one). */
static void render_remote(struct out *o, const struct kvmm_remote_stats *r)
{
    if (!r->on)
        return;
    head(o, "kvd_remote_blocks_total", "counter",
         "Remote-tier lookups: blocks restored (hit), values missing (miss).");
    put(o, "kvd_remote_blocks_total{result=\"hit\"} %llu\n", (unsigned long long)r->hits);
    put(o, "kvd_remote_blocks_total{result=\"miss\"} %llu\n", (unsigned long long)r->misses);
    head(o, "kvd_remote_bytes_total", "counter", "Remote-tier bytes read and written.");
    put(o, "kvd_remote_bytes_total{op=\"read\"} %llu\n", (unsigned long long)r->bytes_in);
    put(o, "kvd_remote_bytes_total{op=\"write\"} %llu\n", (unsigned long long)r->bytes_out);
    head(o, "kvd_remote_writes_total", "counter", "Values written to Redis.");
    put(o, "kvd_remote_writes_total %llu\n", (unsigned long long)r->writes);
    head(o, "kvd_remote_lookup_rounds_total", "counter", "Remote-tier lookup rounds.");
    put(o, "kvd_remote_lookup_rounds_total %llu\n", (unsigned long long)r->rounds);
    head(o, "kvd_remote_lookup_seconds_total", "counter", "Time spent in lookup rounds.");
    put(o, "kvd_remote_lookup_seconds_total %.9f\n", (double)r->latency_ns_sum / 1e9);
    head(o, "kvd_remote_lookup_last_seconds", "gauge", "The last lookup round's time.");
    put(o, "kvd_remote_lookup_last_seconds %.9f\n", (double)r->latency_ns_last / 1e9);
    head(o, "kvd_remote_errors_total", "counter",
         "Remote-tier failures: failed rounds, timeouts, values refused, work skipped.");
    put(o, "kvd_remote_errors_total{kind=\"error\"} %llu\n", (unsigned long long)r->errors);
    put(o, "kvd_remote_errors_total{kind=\"timeout\"} %llu\n", (unsigned long long)r->timeouts);
    put(o, "kvd_remote_errors_total{kind=\"auth\"} %llu\n", (unsigned long long)r->auth_failures);
    put(o, "kvd_remote_errors_total{kind=\"mismatch\"} %llu\n", (unsigned long long)r->mismatches);
    put(o, "kvd_remote_errors_total{kind=\"skipped\"} %llu\n",
        (unsigned long long)(r->skipped + r->write_skips));
    head(o, "kvd_remote_queued", "gauge", "Values waiting for the remote writer.");
    put(o, "kvd_remote_queued %llu\n", (unsigned long long)r->queued);
    head(o, "kvd_remote_backoff", "gauge",
         "1 while the remote tier rests after a failure (lookups and writes skipped).");
    put(o, "kvd_remote_backoff %d\n", r->backoff ? 1 : 0);
    head(o, "kvd_remote_retry_seconds", "gauge", "Until the resting remote tier tries again.");
    put(o, "kvd_remote_retry_seconds %.3f\n", (double)r->retry_in_ms / 1e3);
    head(o, "kvd_remote_backoffs_total", "counter", "Rests started by a remote-tier failure.");
    put(o, "kvd_remote_backoffs_total %llu\n", (unsigned long long)r->backoffs);
    head(o, "kvd_remote_connects_total", "counter", "Remote-tier connects by result.");
    put(o, "kvd_remote_connects_total{result=\"failed\"} %llu\n",
        (unsigned long long)r->connect_fails);
    put(o, "kvd_remote_connects_total{result=\"reconnected\"} %llu\n",
        (unsigned long long)r->reconnects);
    head(o, "kvd_remote_redirects_total", "counter", "Redis Cluster redirects followed.");
    put(o, "kvd_remote_redirects_total{kind=\"moved\"} %llu\n", (unsigned long long)r->moved);
    put(o, "kvd_remote_redirects_total{kind=\"ask\"} %llu\n", (unsigned long long)r->ask);
}

/* The disk tier's series (none without one). */
static void render_disk(struct out *o, const struct kvmm_disk_stats *d)
{
    const struct disktier_stats *t = &d->tier;
    if (!d->on)
        return;
    head(o, "kvd_disk_slots", "gauge", "Disk-tier block slots by state.");
    put(o, "kvd_disk_slots{state=\"total\"} %llu\n", (unsigned long long)t->slots);
    put(o, "kvd_disk_slots{state=\"free\"} %llu\n", (unsigned long long)t->free_slots);
    put(o, "kvd_disk_slots{state=\"cached\"} %llu\n",
        (unsigned long long)(t->cached_slots - t->pinned_slots));
    put(o, "kvd_disk_slots{state=\"used\"} %llu\n", (unsigned long long)t->pinned_slots);
    head(o, "kvd_disk_ops_total", "counter", "Disk-tier block reads and writes.");
    put(o, "kvd_disk_ops_total{op=\"read\"} %llu\n", (unsigned long long)t->reads);
    put(o, "kvd_disk_ops_total{op=\"write\"} %llu\n", (unsigned long long)t->writes);
    head(o, "kvd_disk_bytes_total", "counter", "Disk-tier bytes read and written.");
    put(o, "kvd_disk_bytes_total{op=\"read\"} %llu\n", (unsigned long long)t->read_bytes);
    put(o, "kvd_disk_bytes_total{op=\"write\"} %llu\n", (unsigned long long)t->write_bytes);
    head(o, "kvd_disk_errors_total", "counter",
         "Disk-tier blocks dropped: failed checks, I/O errors, writes skipped.");
    put(o, "kvd_disk_errors_total{kind=\"checksum\"} %llu\n",
        (unsigned long long)t->checksum_failures);
    put(o, "kvd_disk_errors_total{kind=\"io\"} %llu\n", (unsigned long long)t->io_errors);
    put(o, "kvd_disk_errors_total{kind=\"skipped\"} %llu\n",
        (unsigned long long)(t->write_skips + d->detach_skips));
    head(o, "kvd_disk_restored_blocks_total", "counter", "Blocks brought back from disk.");
    put(o, "kvd_disk_restored_blocks_total %llu\n", (unsigned long long)d->restored);
    head(o, "kvd_disk_read_seconds_total", "counter", "Time spent in disk-tier block reads.");
    put(o, "kvd_disk_read_seconds_total %.9f\n", (double)t->read_ns / 1e9);
    head(o, "kvd_disk_requests_total", "counter",
         "Disk-tier I/O requests (adjacent slots coalesced into one).");
    put(o, "kvd_disk_requests_total{op=\"read\"} %llu\n", (unsigned long long)t->read_reqs);
    put(o, "kvd_disk_requests_total{op=\"write\"} %llu\n", (unsigned long long)t->write_reqs);
    head(o, "kvd_disk_evictions_total", "counter", "Disk-tier slots evicted for new blocks.");
    put(o, "kvd_disk_evictions_total %llu\n", (unsigned long long)t->evictions);
    head(o, "kvd_disk_evict_passes_total", "counter",
         "Disk-tier blocks given another turn at eviction for their credit (hits, weight).");
    put(o, "kvd_disk_evict_passes_total %llu\n", (unsigned long long)t->evict_passes);
    head(o, "kvd_disk_loaded_blocks", "gauge",
         "Disk-tier blocks found at start, and index records refused.");
    put(o, "kvd_disk_loaded_blocks{state=\"loaded\"} %llu\n", (unsigned long long)t->loaded);
    put(o, "kvd_disk_loaded_blocks{state=\"refused\"} %llu\n",
        (unsigned long long)t->dropped_at_load);
    head(o, "kvd_disk_queued_blocks", "gauge",
         "Blocks waiting for the disk writer (queued, and copies of dropped ones).");
    put(o, "kvd_disk_queued_blocks{kind=\"queued\"} %llu\n", (unsigned long long)d->queued);
    put(o, "kvd_disk_queued_blocks{kind=\"detached\"} %llu\n", (unsigned long long)d->detached);
    head(o, "kvd_disk_restore_failures_total", "counter",
         "Prefetches stopped by a disk block that failed a check or a read (recomputed).");
    put(o, "kvd_disk_restore_failures_total %llu\n", (unsigned long long)d->restore_fails);
    head(o, "kvd_disk_restores_total", "counter", "Prefetches that restored blocks from disk.");
    put(o, "kvd_disk_restores_total %llu\n", (unsigned long long)d->restores);
    head(o, "kvd_disk_restore_seconds_total", "counter",
         "Time of those prefetches (lookups, reads, checks, into the cache).");
    put(o, "kvd_disk_restore_seconds_total %.9f\n", (double)d->restore_ns / 1e9);
    head(o, "kvd_disk_restore_last_seconds", "gauge", "The last restoring prefetch's time.");
    put(o, "kvd_disk_restore_last_seconds %.9f\n", (double)d->restore_last_ns / 1e9);
    head(o, "kvd_disk_sessions", "gauge", "Live named sessions, all tenants.");
    put(o, "kvd_disk_sessions %llu\n", (unsigned long long)d->sessions);
    head(o, "kvd_disk_bytes", "gauge", "The disk tier's slot size and block file size.");
    put(o, "kvd_disk_bytes{kind=\"slot\"} %llu\n", (unsigned long long)t->slot_bytes);
    put(o, "kvd_disk_bytes{kind=\"file\"} %llu\n", (unsigned long long)t->file_bytes);
}

/* The KV events streams' series (none when they are off): one per stream,
 * labelled with its model in serve mode. */
static void render_kv_events(struct out *o, const struct metrics_src *src)
{
    enum { BATCHES, EVENTS, BLOCKS, DROP_Q, DROP_HWM, SUBS, REPLAYS, QUEUED, N_SERIES };
    static const struct {
        const char *name, *type, *help, *extra;
    } series[N_SERIES] = {
        {"kvd_kv_events_batches_total", "counter", "KV event batches published.", NULL},
        {"kvd_kv_events_total", "counter", "KV events published (runs of blocks merged).", NULL},
        {"kvd_kv_events_blocks_total", "counter", "Block reports in published KV events.", NULL},
        {"kvd_kv_events_dropped_total", "counter",
         "KV event losses: block reports to a full queue (queue), batches a subscriber missed at "
         "its high-water mark (hwm).",
         "reason=\"queue\""},
        {"kvd_kv_events_dropped_total", NULL, NULL, "reason=\"hwm\""},
        {"kvd_kv_events_subscribers", "gauge", "Live subscriptions to the KV events socket.", NULL},
        {"kvd_kv_events_replay_requests_total", "counter", "KV event replay requests answered.",
         NULL},
        {"kvd_kv_events_queued", "gauge", "Block reports waiting for the publisher.", NULL},
    };
    for (int k = 0; k < N_SERIES; k++) {
        bool headed = false;
        for (size_t i = 0; i < src->n_kvevents; i++) {
            struct kvevents_stats s;
            if (!src->kvevents[i])
                continue;
            kvevents_stats(src->kvevents[i], &s);
            const uint64_t v[N_SERIES] = {s.batches,   s.events,      s.blocks,          s.dropped,
                                          s.hwm_drops, s.subscribers, s.replay_requests, s.queued};
            if (!headed && series[k].type)
                head(o, series[k].name, series[k].type, series[k].help);
            headed = true;
            bool model = src->models && i < models_count(src->models);
            put(o, "%s", series[k].name);
            if (model || series[k].extra) {
                put(o, "{");
                if (model) {
                    put(o, "model=\"");
                    put_label(o, models_name(models_at(src->models, i)));
                    put(o, "\"%s", series[k].extra ? "," : "");
                }
                if (series[k].extra)
                    put(o, "%s", series[k].extra);
                put(o, "}");
            }
            put(o, " %llu\n", (unsigned long long)v[k]);
        }
    }
}

/* Per-tenant series, from the snapshot. */
static void render_tenants(struct out *o, const struct stats_snap *sn)
{
    static const struct {
        const char *name, *type, *help;
    } fam[] = {
        {"kvd_blocks", "gauge", "KV blocks owned by a tenant, by tier."},
        {"kvd_cached_blocks", "gauge", "A tenant's blocks held by a radix tree (shareable)."},
        {"kvd_tenant_sequences", "gauge", "A tenant's open sequences."},
        {"kvd_prefix_lookup_tokens_total", "counter",
         "Prompt tokens looked up in the prefix cache."},
        {"kvd_prefix_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache."},
        {"kvd_swaps_total", "counter", "Blocks swapped between tiers, by direction."},
        {"kvd_requests_total", "counter", "Generate requests answered, by outcome."},
        {"kvd_tokens_total", "counter",
         "Tokens by kind: prompt (in), cached (prompt tokens reused), generated (out)."},
        {"kvd_preemptions_total", "counter", "Times a tenant's requests were preempted."},
        {"kvd_queue_seconds_total", "counter",
         "Summed time a tenant's requests waited before their first step."},
    };
    for (size_t f = 0; f < sizeof(fam) / sizeof(fam[0]); f++) {
        head(o, fam[f].name, fam[f].type, fam[f].help);
        for (size_t i = 0; i < sn->n; i++) {
            const struct kvmm_tenant_stats ts = sn->t[i].ts;
            const struct acct_tenant at = sn->t[i].at;
            const char *tn = ts.name;
            switch (f) {
            case 0:
                tenant_line(o, fam[f].name, "tier=\"device\",", tn, ts.device_blocks);
                tenant_line(o, fam[f].name, "tier=\"host\",", tn, ts.host_blocks);
                break;
            case 1:
                tenant_line(o, fam[f].name, NULL, tn, ts.cached_blocks);
                break;
            case 2:
                tenant_line(o, fam[f].name, NULL, tn, ts.seqs);
                break;
            case 3:
                tenant_line(o, fam[f].name, NULL, tn, (double)ts.match_tokens_asked);
                break;
            case 4:
                tenant_line(o, fam[f].name, NULL, tn, (double)ts.match_tokens_hit);
                break;
            case 5:
                tenant_line(o, fam[f].name, "direction=\"out\",", tn, (double)ts.swaps_out);
                tenant_line(o, fam[f].name, "direction=\"in\",", tn, (double)ts.swaps_in);
                break;
            case 6:
                tenant_line(o, fam[f].name, "outcome=\"completed\",", tn, (double)at.completed);
                tenant_line(o, fam[f].name, "outcome=\"cancelled\",", tn, (double)at.cancelled);
                tenant_line(o, fam[f].name, "outcome=\"failed\",", tn, (double)at.failed);
                break;
            case 7:
                tenant_line(o, fam[f].name, "kind=\"prompt\",", tn, (double)at.tokens_in);
                tenant_line(o, fam[f].name, "kind=\"cached\",", tn, (double)at.tokens_cached);
                tenant_line(o, fam[f].name, "kind=\"generated\",", tn, (double)at.tokens_out);
                break;
            case 8:
                tenant_line(o, fam[f].name, NULL, tn, (double)at.preemptions);
                break;
            case 9:
                tenant_line(o, fam[f].name, NULL, tn, at.queue_seconds);
                break;
            }
        }
    }
}

static void render_exec(struct out *o, struct acct *a)
{
    struct acct_sched s;
    acct_sched_get(a, &s);
    head(o, "kvd_requests", "gauge", "Generate requests in the executor's queues, by state.");
    put(o, "kvd_requests{state=\"waiting\"} %u\n", s.waiting);
    put(o, "kvd_requests{state=\"running\"} %u\n", s.running);
    put(o, "kvd_requests{state=\"swapped\"} %u\n", s.swapped);
    head(o, "kvd_steps_total", "counter", "Executor steps (forward passes).");
    put(o, "kvd_steps_total %llu\n", (unsigned long long)s.steps);
    head(o, "kvd_step_tokens_total", "counter", "Tokens computed by the executor, by kind.");
    put(o, "kvd_step_tokens_total{kind=\"prefill\"} %llu\n", (unsigned long long)s.prefill_tokens);
    put(o, "kvd_step_tokens_total{kind=\"decode\"} %llu\n", (unsigned long long)s.decode_tokens);
    head(o, "kvd_scheduler_preemptions_total", "counter", "Preemptions by the scheduler, by kind.");
    put(o, "kvd_scheduler_preemptions_total{kind=\"swap\"} %llu\n",
        (unsigned long long)s.preempt_swap);
    put(o, "kvd_scheduler_preemptions_total{kind=\"recompute\"} %llu\n",
        (unsigned long long)s.preempt_recompute);
    head(o, "kvd_speculative_draft_tokens_total", "counter",
         "Draft tokens of speculative decoding, by outcome of their verification.");
    put(o, "kvd_speculative_draft_tokens_total{outcome=\"accepted\"} %llu\n",
        (unsigned long long)s.spec.accepted);
    put(o, "kvd_speculative_draft_tokens_total{outcome=\"rejected\"} %llu\n",
        (unsigned long long)(s.spec.drafted - s.spec.accepted));
    head(o, "kvd_speculative_verifications_total", "counter",
         "Verifications (one request's drafts checked in one step).");
    put(o, "kvd_speculative_verifications_total %llu\n", (unsigned long long)s.spec.verifies);
    head(o, "kvd_speculative_tokens_total", "counter",
         "Tokens that speculative requests got from their verifications.");
    put(o, "kvd_speculative_tokens_total %llu\n", (unsigned long long)s.spec.spec_tokens);
    render_hist(o, "kvd_time_to_first_token_seconds",
                "Time from a request's arrival to its first generated token.", a, ACCT_TTFT);
    render_hist(
        o, "kvd_inter_token_latency_seconds",
        "Time between consecutive generated tokens of a request (its mean gap, once per gap).", a,
        ACCT_ITL);
    render_hist(o, "kvd_request_duration_seconds",
                "Time from arrival to the reply of completed requests.", a, ACCT_E2E);
    render_hist(o, "kvd_queue_time_seconds", "Time from arrival to a request's first step.", a,
                ACCT_QUEUE);
}

static void render_roofline(struct out *o, struct roofline *rl)
{
    struct roofline_ceilings c;
    roofline_get_ceilings(rl, &c);
    head(o, "kvd_ceiling_flops_per_second", "gauge",
         "Measured GEMM ceiling of the backend (0: not measured).");
    put(o, "kvd_ceiling_flops_per_second %.6g\n", c.flops_per_s);
    head(o, "kvd_ceiling_bytes_per_second", "gauge",
         "Measured memory ceiling of the backend, bytes read plus written (0: not measured).");
    put(o, "kvd_ceiling_bytes_per_second %.6g\n", c.bytes_per_s);

    struct roofline_summary s[ROOFLINE_N_PHASES];
    uint64_t steps[ROOFLINE_N_PHASES];
    double fl[ROOFLINE_N_PHASES], by[ROOFLINE_N_PHASES], sec[ROOFLINE_N_PHASES];
    for (int p = 0; p < ROOFLINE_N_PHASES; p++) {
        roofline_summary(rl, (enum roofline_phase)p, &s[p]);
        roofline_totals(rl, (enum roofline_phase)p, &steps[p], &fl[p], &by[p], &sec[p]);
    }
#define PHASES(name, type, help, fmt, expr)                                                        \
    do {                                                                                           \
        head(o, name, type, help);                                                                 \
        for (int p = 0; p < ROOFLINE_N_PHASES; p++)                                                \
            put(o, name "{phase=\"%s\"} " fmt "\n", roofline_phase_name((enum roofline_phase)p),   \
                expr);                                                                             \
    } while (0)
    PHASES("kvd_phase_steps_total", "counter", "Executor steps by phase.", "%llu",
           (unsigned long long)steps[p]);
    PHASES("kvd_phase_flops_total", "counter", "Modelled FLOPs of the steps, by phase.", "%.17g",
           fl[p]);
    PHASES("kvd_phase_bytes_total", "counter", "Modelled bytes moved by the steps, by phase.",
           "%.17g", by[p]);
    PHASES("kvd_phase_seconds_total", "counter", "Forward time of the steps, by phase.", "%.17g",
           sec[p]);
    PHASES("kvd_roofline_intensity", "gauge",
           "Arithmetic intensity (FLOP/byte) over the recent window.", "%.6g", s[p].intensity);
    PHASES("kvd_roofline_flops_ratio", "gauge",
           "Achieved FLOP/s as a fraction of the ceiling (recent window).", "%.6g",
           s[p].flops_frac);
    PHASES("kvd_roofline_bytes_ratio", "gauge",
           "Achieved bytes/s as a fraction of the ceiling (recent window).", "%.6g",
           s[p].bytes_frac);
#undef PHASES
    head(o, "kvd_roofline_bound", "gauge",
         "1 for the ceiling that bounds the phase's recent steps.");
    for (int p = 0; p < ROOFLINE_N_PHASES; p++)
        if (s[p].window && strcmp(s[p].bound, "unknown"))
            put(o, "kvd_roofline_bound{phase=\"%s\",bound=\"%s\"} 1\n",
                roofline_phase_name((enum roofline_phase)p), s[p].bound);
}

/* name{model="M"} value */
static void model_line(struct out *o, const char *name, const char *extra, const char *model,
                       double v)
{
    put(o, "%s{%smodel=\"", name, extra ? extra : "");
    put_label(o, model);
    put(o, "\"} %.17g\n", v);
}

/* Each model: its state, memory, loads and its executor's counters (the
 * kvd_requests and kvd_step_* above are every model's together). */
static void render_models(struct out *o, struct models *ms, struct acct *a)
{
    size_t n = models_count(ms);
    struct models_info mi[OPTIONS_MAX_MODELS];
    struct acct_sched as[OPTIONS_MAX_MODELS];
    for (size_t i = 0; i < n && i < OPTIONS_MAX_MODELS; i++) {
        models_info(models_at(ms, i), &mi[i]);
        memset(&as[i], 0, sizeof as[i]);
        if (a)
            acct_sched_get_slot(a, models_index(models_at(ms, i)), &as[i]);
    }
    if (n > OPTIONS_MAX_MODELS)
        n = OPTIONS_MAX_MODELS;
    static const char *const states[] = {"unloaded", "loading", "loaded", "unloading"};
    head(o, "kvd_model_state", "gauge", "1 for each model's state.");
    for (size_t i = 0; i < n; i++) {
        char extra[48];
        snprintf(extra, sizeof extra, "state=\"%s\",", states[mi[i].state]);
        model_line(o, "kvd_model_state", extra, mi[i].name, 1);
    }
    head(o, "kvd_model_weight_bytes", "gauge", "A model's weights on the device.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_weight_bytes", NULL, mi[i].name,
                   (double)mi[i].weight_device_bytes);
    head(o, "kvd_model_kv_bytes", "gauge", "The device pages a model's KV pool holds now.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_kv_bytes", NULL, mi[i].name, (double)mi[i].kv_device_bytes);
    head(o, "kvd_model_draft_kv_bytes", "gauge",
         "The device pages a model's draft's KV pool holds now.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_draft_kv_bytes", NULL, mi[i].name, (double)mi[i].draft_kv_bytes);
    head(o, "kvd_model_waiting", "gauge", "Requests waiting for a model to load.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_waiting", NULL, mi[i].name, mi[i].waiting);
    head(o, "kvd_model_loads_total", "counter", "A model's loads, by outcome.");
    for (size_t i = 0; i < n; i++) {
        model_line(o, "kvd_model_loads_total", "outcome=\"ok\",", mi[i].name, (double)mi[i].loads);
        model_line(o, "kvd_model_loads_total", "outcome=\"failed\",", mi[i].name,
                   (double)mi[i].load_failures);
    }
    head(o, "kvd_model_unloads_total", "counter", "A model's unloads.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_unloads_total", NULL, mi[i].name, (double)mi[i].unloads);
    head(o, "kvd_model_unload_blocks_total", "counter",
         "A model's cached device blocks at its unloads, by what became of them.");
    for (size_t i = 0; i < n; i++) {
        model_line(o, "kvd_model_unload_blocks_total", "to=\"host\",", mi[i].name,
                   (double)mi[i].moved_at_unload);
        model_line(o, "kvd_model_unload_blocks_total", "to=\"dropped\",", mi[i].name,
                   (double)mi[i].dropped_at_unload);
    }
    head(o, "kvd_model_load_seconds", "gauge", "A model's last load's time.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_load_seconds", NULL, mi[i].name, mi[i].load_ms_last / 1e3);
    head(o, "kvd_model_requests", "gauge", "A model's generate requests live in its executor.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_requests", NULL, mi[i].name, as[i].live);
    head(o, "kvd_model_requests_submitted_total", "counter",
         "Generate requests a model's executors took.");
    for (size_t i = 0; i < n; i++)
        model_line(o, "kvd_model_requests_submitted_total", NULL, mi[i].name,
                   (double)as[i].submitted);
    head(o, "kvd_model_tokens_total", "counter",
         "Tokens a model's executors computed (prefill, decode) and sampled (generated).");
    for (size_t i = 0; i < n; i++) {
        model_line(o, "kvd_model_tokens_total", "kind=\"prefill\",", mi[i].name,
                   (double)as[i].prefill_tokens);
        model_line(o, "kvd_model_tokens_total", "kind=\"decode\",", mi[i].name,
                   (double)as[i].decode_tokens);
        model_line(o, "kvd_model_tokens_total", "kind=\"generated\",", mi[i].name,
                   (double)as[i].generated);
    }
    uint64_t used, budget;
    models_device_use(ms, &used, &budget);
    head(o, "kvd_model_device_bytes", "gauge",
         "The page budget's bytes taken (weights, scratch, KV pages) and its size.");
    put(o, "kvd_model_device_bytes{kind=\"used\"} %llu\n", (unsigned long long)used);
    put(o, "kvd_model_device_bytes{kind=\"budget\"} %llu\n", (unsigned long long)budget);
}

int metrics_render(const struct metrics_src *src, struct evbuffer *out)
{
    struct out o = {.b = out};

    head(&o, "kvd_info", "gauge", "Constant 1, labelled with the backend.");
    put(&o, "kvd_info{backend=\"");
    put_label(&o, src->backend ? src->backend : "?");
    put(&o, "\"} 1\n");
    if (src->n_conns) {
        head(&o, "kvd_connections", "gauge", "Open client connections.");
        put(&o, "kvd_connections %zu\n", *src->n_conns);
    }
    if (src->n_pending) {
        head(&o, "kvd_requests_in_flight", "gauge", "Requests taken and not yet answered.");
        put(&o, "kvd_requests_in_flight %zu\n", *src->n_pending);
    }
    if (src->n_http_auth_failed) {
        head(&o, "kvd_http_auth_failures_total", "counter",
             "HTTP API requests over TCP refused for a missing or unknown bearer token.");
        put(&o, "kvd_http_auth_failures_total %llu\n",
            (unsigned long long)*src->n_http_auth_failed);
    }
    /* One snapshot for every kvmm number (one lock), so they add up; every
     * tenant (their number is bounded: max-sub-tenants). */
    struct stats_snap sn;
    if (stats_snap_fill(&sn, src->mm, src->acct, NULL, 0, SIZE_MAX) != 0)
        return KVD_ENOMEM;
    render_pool(&o, &sn.st);
    render_disk(&o, &sn.disk);
    render_remote(&o, &sn.remote);
    render_tenants(&o, &sn);
    stats_snap_free(&sn);
    render_kv_events(&o, src);
    if (src->acct)
        render_exec(&o, src->acct);
    if (src->rl)
        render_roofline(&o, src->rl);
    if (src->models)
        render_models(&o, src->models, src->acct);
    return o.rc;
}

/* ---- the HTTP listener -------------------------------------------------- */

struct metrics {
    struct httpd *httpd;
    struct server *srv;
    char token[256]; /* "" when none is required */
};

static void on_metrics(struct evhttp_request *req, void *arg)
{
    struct metrics *m = arg;
    struct server *srv = m->srv;
    const char *tok = m->token[0] ? httpd_bearer(req) : NULL;
    if (m->token[0] && (!tok || !httpd_token_equal(m->token, tok))) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "WWW-Authenticate",
                          "Bearer realm=\"kvd\"");
        evhttp_send_error(req, 401, "a bearer token is required (metrics-token-file)");
        return;
    }
    struct server_obs o;
    server_get_obs(srv, &o);
    struct metrics_src src = {
        .mm = o.mm,
        .rl = o.rl,
        .acct = o.acct,
        .backend = o.backend,
        .n_conns = o.n_conns,
        .n_pending = o.n_pending,
        .n_http_auth_failed = o.n_http_auth_failed,
        .kvevents = o.kvevents,
        .n_kvevents = o.n_kvevents,
        .models = o.models,
    };
    struct evbuffer *body = evbuffer_new();
    if (!body) {
        evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
        return;
    }
    if (metrics_render(&src, body) != 0) {
        evbuffer_free(body);
        evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
        return;
    }
    httpd_served(m->httpd); /* serving again: the next failure starts a short pause */
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "text/plain; version=0.0.4; charset=utf-8");
    evhttp_send_reply(req, HTTP_OK, "OK", body);
    evbuffer_free(body);
}

static void on_other(struct evhttp_request *req, void *arg)
{
    evhttp_send_error(req, HTTP_NOTFOUND, "kvd serves /metrics only");
}

int metrics_start(struct server *srv, const char *addr, bool force, struct metrics **out,
                  uint16_t *port_out, char *err, size_t errlen)
{
    const struct options *o = server_options(srv);
    char def[108];
    /* unix without a path: metrics.sock beside the main socket */
    const char *main_sock = server_socket_path(srv);
    const char *slash = strrchr(main_sock, '/');
    int dl = slash ? (int)(slash - main_sock) : 0;
    snprintf(def, sizeof(def), "%.*s/metrics.sock", dl, main_sock);
    struct httpd_conf hc = {
        .what = "metrics",
        .addr = addr,
        .default_path = def,
        .force = force,
        .force_hint = "metrics show every tenant's usage; add --metrics-force to serve them "
                      "there anyway",
        .group = o->metrics_group,
        .mode = 0600,
        .max_conns = o->metrics_max_conns,
        .request_timeout_s = 10, /* a scrape arrives whole in well under that */
    };
    struct metrics *m = calloc(1, sizeof(*m));
    if (!m)
        return KVD_ENOMEM;
    m->srv = srv;
    int rc;
    if (o->metrics_token_file[0] &&
        (rc = httpd_read_token_file("metrics-token-file", o->metrics_token_file, m->token,
                                    sizeof(m->token), err, errlen))) {
        free(m);
        return rc;
    }
    if ((rc = httpd_new(server_event_base(srv), &hc, &m->httpd))) {
        free(m);
        return rc;
    }
    struct evhttp *http = httpd_evhttp(m->httpd);
    /* Scrapes are tiny GETs: small limits keep a stray client cheap. */
    evhttp_set_allowed_methods(http, EVHTTP_REQ_GET | EVHTTP_REQ_HEAD);
    evhttp_set_max_headers_size(http, 16384);
    evhttp_set_max_body_size(http, 4096);
    evhttp_set_timeout(http, 10);
    evhttp_set_cb(http, "/metrics", on_metrics, m);
    evhttp_set_gencb(http, on_other, m);
    uint16_t bound = 0;
    if ((rc = httpd_listen(m->httpd, &bound, err, errlen))) {
        metrics_stop(m);
        return rc;
    }
    if (httpd_is_unix(m->httpd)) {
        log_info("metrics: serving http://localhost/metrics on the unix socket %s (mode %s)",
                 httpd_path(m->httpd), o->metrics_group[0] ? "0660" : "0600");
    } else {
        char host[108];
        uint16_t p;
        bool lo;
        httpd_parse_addr("metrics", addr, host, sizeof(host), &p, &lo, err, errlen);
        log_info("metrics: serving http://%s%s%s:%u/metrics", strchr(host, ':') ? "[" : "", host,
                 strchr(host, ':') ? "]" : "", bound);
        if (!m->token[0])
            log_notice("metrics: TCP without metrics-token-file: every local user can read "
                       "every tenant's usage; prefer --metrics unix:PATH");
    }
    if (port_out)
        *port_out = bound;
    *out = m;
    return 0;
}

void metrics_stop(struct metrics *m)
{
    if (!m)
        return;
    httpd_free(m->httpd);
    free(m);
}
