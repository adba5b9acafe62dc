/* acct_stats: the observability parts of the `stats` reply: per-tenant
 * accounting fields next to kvmm's, the executor's queues ("requests") and
 * the per-phase roofline ("roofline"). ops_info.c calls these so every
 * number here is read under the same kvmm lock as the pool's. */
#include "acct_stats.h"

#include "proto.h"

static double ratio(double a, double b)
{
    return b > 0 ? a / b : 0;
}

int acct_stats_pack_tenant(msgpack_packer *pk, const struct acct_tenant *at,
                           const struct kvmm_tenant_stats *ts)
{
    const struct acct_tenant t = *at;
    PROTO_PK(
        proto_pack_kv_double(pk, "prefix_hit_rate",
                             ratio((double)ts->match_tokens_hit, (double)ts->match_tokens_asked)));
    PROTO_PK(proto_pack_kv_uint(pk, "evictions", ts->evictions));
    PROTO_PK(proto_pack_kv_uint(pk, "requests", t.requests));
    PROTO_PK(proto_pack_kv_uint(pk, "requests_failed", t.failed));
    PROTO_PK(proto_pack_kv_uint(pk, "requests_cancelled", t.cancelled));
    PROTO_PK(proto_pack_kv_uint(pk, "preemptions", t.preemptions));
    PROTO_PK(proto_pack_kv_uint(pk, "tokens_in", t.tokens_in));
    PROTO_PK(proto_pack_kv_uint(pk, "tokens_cached", t.tokens_cached));
    PROTO_PK(proto_pack_kv_uint(pk, "tokens_out", t.tokens_out));
    PROTO_PK(proto_pack_kv_double(pk, "queue_ms", t.queue_seconds * 1e3));
    PROTO_PK(proto_pack_kv_double(pk, "queue_ms_mean",
                                  ratio(t.queue_seconds * 1e3, (double)t.requests)));
    PROTO_PK(proto_pack_kv_double(pk, "ttft_ms_mean",
                                  ratio(t.ttft_seconds * 1e3, (double)t.ttft_count)));
    return 0;
}

/* "speculative": the counters, and what follows from them: the share of
 * draft tokens kept, the tokens one verification gave a request, and the
 * speed-up estimate: tokens per second of the verifying steps over those
 * of plain decode-only steps (0 until both kinds of step were seen; the
 * batches of the two may differ, so it is an estimate). */
int acct_stats_pack_spec(msgpack_packer *pk, const struct acct_spec *s)
{
    PROTO_PK(proto_pack_str(pk, "speculative"));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_str(pk, "mode", s->mode[0] ? s->mode : "off"));
    PROTO_PK(proto_pack_kv_bool(pk, "draft_model", s->draft_model));
    PROTO_PK(proto_pack_kv_uint(pk, "max_batch", s->max_batch));
    PROTO_PK(proto_pack_kv_uint(pk, "verify_steps", s->verify_steps));
    PROTO_PK(proto_pack_kv_uint(pk, "verifications", s->verifies));
    PROTO_PK(proto_pack_kv_uint(pk, "drafted", s->drafted));
    PROTO_PK(proto_pack_kv_uint(pk, "accepted", s->accepted));
    PROTO_PK(
        proto_pack_kv_double(pk, "acceptance", ratio((double)s->accepted, (double)s->drafted)));
    PROTO_PK(proto_pack_kv_double(pk, "tokens_per_verification",
                                  ratio((double)s->spec_tokens, (double)s->verifies)));
    PROTO_PK(proto_pack_kv_double(pk, "verify_ms_per_step",
                                  ratio((double)s->verify_ns / 1e6, (double)s->verify_steps)));
    PROTO_PK(proto_pack_kv_double(pk, "decode_ms_per_step",
                                  ratio((double)s->decode_ns / 1e6, (double)s->decode_steps)));
    double spec_rate = ratio((double)s->verify_step_tokens, (double)s->verify_ns);
    double plain_rate = ratio((double)s->decode_tokens, (double)s->decode_ns);
    PROTO_PK(proto_pack_kv_double(pk, "speedup", spec_rate > 0 ? ratio(spec_rate, plain_rate) : 0));
    return proto_map_end(pk, map);
}

static int pack_requests(msgpack_packer *pk, struct acct *a)
{
    struct acct_sched s = {0};
    struct acct_tenant tot = {0};
    if (a) {
        acct_sched_get(a, &s);
        acct_total(a, &tot);
    }
    PROTO_PK(proto_pack_str(pk, "requests"));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_bool(pk, "executor", s.have_executor));
    PROTO_PK(proto_pack_kv_uint(pk, "waiting", s.waiting));
    PROTO_PK(proto_pack_kv_uint(pk, "running", s.running));
    PROTO_PK(proto_pack_kv_uint(pk, "swapped", s.swapped));
    PROTO_PK(proto_pack_kv_uint(pk, "live", s.live));
    PROTO_PK(proto_pack_kv_uint(pk, "submitted", s.submitted));
    PROTO_PK(proto_pack_kv_uint(pk, "answered", tot.requests));
    PROTO_PK(proto_pack_kv_uint(pk, "failed", tot.failed));
    PROTO_PK(proto_pack_kv_uint(pk, "cancelled", tot.cancelled));
    PROTO_PK(proto_pack_kv_uint(pk, "steps", s.steps));
    PROTO_PK(proto_pack_kv_uint(pk, "prefill_tokens",
                                s.prefill_tokens)); /* computed, cache hits excluded */
    PROTO_PK(proto_pack_kv_uint(pk, "decode_tokens", s.decode_tokens));
    PROTO_PK(proto_pack_kv_uint(pk, "tokens_in", tot.tokens_in));
    PROTO_PK(proto_pack_kv_uint(pk, "tokens_cached", tot.tokens_cached));
    PROTO_PK(proto_pack_kv_uint(pk, "tokens_out", s.generated));
    PROTO_PK(proto_pack_kv_uint(pk, "preempt_swap", s.preempt_swap));
    PROTO_PK(proto_pack_kv_uint(pk, "preempt_recompute", s.preempt_recompute));
    PROTO_PK(proto_pack_kv_uint(pk, "step_launches", s.step_launches));
    PROTO_PK(proto_pack_kv_uint(pk, "layers", s.layers));
    PROTO_PK(proto_pack_kv_uint(pk, "overlapped_steps", s.overlapped_steps));
    PROTO_PK(proto_pack_kv_uint(pk, "decode_host_steps", s.host_steps));
    PROTO_PK(proto_pack_kv_double(pk, "decode_host_ms", (double)s.host_ns / 1e6));
    PROTO_PK(proto_pack_kv_uint(pk, "decode_idle_steps", s.idle_steps));
    PROTO_PK(proto_pack_kv_double(pk, "decode_idle_ms", (double)s.idle_ns / 1e6));
    PROTO_PK(acct_stats_pack_spec(pk, &s.spec));
    return proto_map_end(pk, map);
}

static int pack_phase(msgpack_packer *pk, struct roofline *rl, enum roofline_phase p)
{
    struct roofline_summary s;
    roofline_summary(rl, p, &s);
    PROTO_PK(proto_pack_str(pk, roofline_phase_name(p)));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "steps", s.steps_total));
    PROTO_PK(proto_pack_kv_uint(pk, "window", s.window));
    PROTO_PK(proto_pack_kv_double(pk, "flops_per_step", s.flops_per_step));
    PROTO_PK(proto_pack_kv_double(pk, "bytes_per_step", s.bytes_per_step));
    PROTO_PK(proto_pack_kv_double(pk, "intensity", s.intensity));
    PROTO_PK(proto_pack_kv_double(pk, "flops_per_s", s.flops_per_s));
    PROTO_PK(proto_pack_kv_double(pk, "bytes_per_s", s.bytes_per_s));
    PROTO_PK(proto_pack_kv_double(pk, "flops_frac", s.flops_frac));
    PROTO_PK(proto_pack_kv_double(pk, "bytes_frac", s.bytes_frac));
    PROTO_PK(proto_pack_kv_double(pk, "ms_per_step", s.ms_per_step));
    PROTO_PK(proto_pack_kv_double(pk, "tokens_per_s", s.tokens_per_s));
    PROTO_PK(proto_pack_kv_str(pk, "bound", s.bound));
    PROTO_PK(proto_pack_kv_double(pk, "attainable_frac",
                                  s.bound[0] == 'c' ? s.flops_frac : s.bytes_frac));
    return proto_map_end(pk, map);
}

static int pack_roofline(msgpack_packer *pk, struct roofline *rl)
{
    PROTO_PK(proto_pack_str(pk, "roofline"));
    if (!rl) {
        PROTO_MP(msgpack_pack_nil(pk));
        return 0;
    }
    struct roofline_ceilings c;
    roofline_get_ceilings(rl, &c);
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_bool(pk, "measured", c.measured));
    PROTO_PK(proto_pack_kv_double(pk, "peak_flops_per_s", c.flops_per_s));
    PROTO_PK(proto_pack_kv_double(pk, "peak_bytes_per_s", c.bytes_per_s));
    PROTO_PK(proto_pack_kv_double(pk, "ridge_intensity", ratio(c.flops_per_s, c.bytes_per_s)));
    for (int p = 0; p < ROOFLINE_N_PHASES; p++)
        PROTO_PK(pack_phase(pk, rl, (enum roofline_phase)p));
    return proto_map_end(pk, map);
}

int acct_stats_pack_top(msgpack_packer *pk, struct acct *a, struct roofline *rl)
{
    PROTO_PK(pack_requests(pk, a));
    PROTO_PK(pack_roofline(pk, rl));
    return 0;
}
