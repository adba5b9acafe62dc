/* ops_info: hello (who the server is, the KV geometry, the caller's tenant)
 * and stats: for an admin the pool occupancy, hit/swap counters, queues,
 * roofline and a page of the tenants' usage; for anyone else the pool's
 * size and its own tenant only. Both render one stats_snap. */
#include <string.h>

#include "acct_stats.h"
#include "kvevents.h"
#include "kvd/protocol.h"
#include "kvd/version.h"
#include "models.h"
#include "ops.h"
#include "server.h"
#include "stats_snap.h"
#include "tenancy.h"
#include "text.h"
#include "workpool.h"

/* hello's model.{tokenizer, bos, eos, eog, chat_template} (docs/protocol.md). */
static int pack_text(msgpack_packer *pk, const struct text *tx)
{
    const struct tokenizer *tok = text_tokenizer(tx);
    if (tok)
        PROTO_PK(proto_pack_kv_str(pk, "tokenizer", tokenizer_model_name(tok)));
    else
        PROTO_PK(proto_pack_kv_nil(pk, "tokenizer"));
    uint32_t ids[2] = {text_bos(tx), text_eos(tx)};
    for (int i = 0; i < 2; i++) {
        const char *key = i ? "eos" : "bos";
        if (ids[i] == TEXT_NO_TOKEN)
            PROTO_PK(proto_pack_kv_nil(pk, key));
        else
            PROTO_PK(proto_pack_kv_uint(pk, key, ids[i]));
    }
    const uint32_t *eog;
    size_t n_eog = text_eog(tx, &eog);
    PROTO_PK(proto_pack_kv_u32_array(pk, "eog", eog, n_eog));
    return proto_pack_kv_bool(pk, "chat_template", text_chat_template(tx) != NULL);
}

/* A model's map: today's hello fields (name, vocab, context, weights,
 * fingerprint: nil until it has loaded once, the text side), then with
 * `list` what a list of models says of each: its state, KV geometry and
 * device pages, keep-alive, and whether the caller may use it. */
static int pack_model(msgpack_packer *pk, struct models_entry *e, const char *tenant, bool list)
{
    struct models_info mi;
    models_info(e, &mi);
    const struct model_hparams *hp = models_hparams(e);
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_str(pk, "name", mi.name));
    PROTO_PK(proto_pack_kv_uint(pk, "vocab", hp->n_vocab));
    PROTO_PK(proto_pack_kv_uint(pk, "context", hp->n_ctx));
    PROTO_PK(proto_pack_kv_uint(pk, "weight_bytes", mi.weight_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "weight_device_bytes", mi.weight_device_bytes));
    if (mi.loaded_once) {
        char fp[33];
        for (int i = 0; i < 16; i++)
            snprintf(fp + 2 * i, 3, "%02x", hp->fingerprint[i]);
        PROTO_PK(proto_pack_kv_str(pk, "fingerprint", fp));
    } else {
        PROTO_PK(proto_pack_kv_nil(pk, "fingerprint"));
    }
    PROTO_PK(pack_text(pk, models_text(e)));
    if (list) {
        const struct kv_geom *g = kvmm_geom(models_kvmm(e));
        PROTO_PK(proto_pack_kv_str(pk, "state", models_state_name(mi.state)));
        PROTO_PK(proto_pack_kv_str(pk, "arch", hp->arch));
        PROTO_PK(proto_pack_str(pk, "kv"));
        size_t kv = proto_map_begin(pk);
        PROTO_PK(proto_pack_kv_uint(pk, "layers", g->layers));
        PROTO_PK(proto_pack_kv_uint(pk, "kv_heads", g->kv_heads));
        PROTO_PK(proto_pack_kv_uint(pk, "head_dim", g->head_dim));
        PROTO_PK(proto_pack_kv_str(pk, "dtype", kv_dtype_name(g->dtype)));
        PROTO_PK(proto_pack_kv_uint(pk, "block_bytes", kv_block_bytes(g)));
        PROTO_PK(proto_pack_kv_uint(pk, "token_bytes", kv_token_bytes(g)));
        PROTO_PK(proto_map_end(pk, kv));
        PROTO_PK(proto_pack_kv_uint(pk, "kv_device_bytes", mi.kv_device_bytes));
        PROTO_PK(proto_pack_kv_uint(pk, "kv_device_blocks", mi.kv_device_blocks));
        if (mi.keep_alive_s == OPTIONS_KEEP_FOREVER)
            PROTO_PK(proto_pack_kv_nil(pk, "keep_alive_s"));
        else
            PROTO_PK(proto_pack_kv_uint(pk, "keep_alive_s", mi.keep_alive_s));
        PROTO_PK(proto_pack_kv_bool(pk, "allowed", models_allows(e, tenant)));
        if (mi.draft)
            PROTO_PK(proto_pack_kv_str(pk, "draft", mi.draft));
        else
            PROTO_PK(proto_pack_kv_nil(pk, "draft"));
        PROTO_PK(proto_pack_kv_str(pk, "speculative", mi.spec_mode));
    }
    return proto_map_end(pk, map);
}

int ops_hello(struct ops_ctx *c)
{
    uint64_t version = KVD_PROTOCOL_VERSION;
    char client[KVD_MAX_CLIENT_NAME + 1];
    bool have_client = false;
    struct models_entry *me = NULL;
    PROTO_PK(proto_opt_uint(c->req, "version", &version, NULL, &c->err));
    PROTO_PK(proto_opt_strz(c->req, "client", client, sizeof(client), &have_client, &c->err));
    if (version != KVD_PROTOCOL_VERSION)
        return kvd_error_set(&c->err, KVD_EUNSUPPORTED,
                             "protocol version %llu is not supported (this server speaks %d)",
                             (unsigned long long)version, KVD_PROTOCOL_VERSION);
    /* `model`: the model whose geometry and fields the reply leads with
     * (the first when none is named) */
    PROTO_PK(ops_pick_model(c, &me));
    struct kvmm *mm = me ? models_kvmm(me) : c->mm;
    const struct kv_geom *g = kvmm_geom(mm);
    msgpack_packer *pk = c->pk;
    size_t reply = proto_reply_begin_map(pk, c->id);
    PROTO_PK(proto_pack_kv_str(pk, "server", "kvd " KVD_VERSION_STRING));
    PROTO_PK(proto_pack_kv_uint(pk, "version", KVD_PROTOCOL_VERSION));
    PROTO_PK(proto_pack_kv_str(pk, "tenant", c->tenant_name));
    PROTO_PK(proto_pack_kv_bool(pk, "admin", c->admin));
    PROTO_PK(proto_pack_kv_str(pk, "backend", c->host->backend));
    PROTO_PK(proto_pack_kv_uint(pk, "block_tokens", g->block_tokens));
    PROTO_PK(proto_pack_kv_uint(pk, "max_frame", c->host->max_frame));
    PROTO_PK(proto_pack_kv_uint(pk, "conn", c->conn_id));
    PROTO_PK(proto_pack_kv_bool(pk, "disk", kvmm_disk_on(mm)));
    PROTO_PK(proto_pack_kv_bool(pk, "remote", kvmm_remote_on(mm)));
    PROTO_PK(proto_pack_str(pk, "kv"));
    size_t kv = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "layers", g->layers));
    PROTO_PK(proto_pack_kv_uint(pk, "kv_heads", g->kv_heads));
    PROTO_PK(proto_pack_kv_uint(pk, "head_dim", g->head_dim));
    PROTO_PK(proto_pack_kv_str(pk, "dtype", kv_dtype_name(g->dtype)));
    PROTO_PK(proto_pack_kv_uint(pk, "block_bytes", kv_block_bytes(g)));
    PROTO_PK(proto_pack_kv_uint(pk, "token_bytes", kv_token_bytes(g)));
    PROTO_PK(proto_map_end(pk, kv));
    if (!me) {
        PROTO_PK(proto_pack_kv_nil(pk, "model"));
    } else {
        PROTO_PK(proto_pack_str(pk, "model"));
        PROTO_PK(pack_model(pk, me, c->tenant_name, false));
    }
    /* every model, loaded or not */
    size_t n = models_count(c->host->models);
    PROTO_PK(proto_pack_str(pk, "models"));
    PROTO_MP(proto_pack_array(pk, n));
    for (size_t i = 0; i < n; i++)
        PROTO_PK(pack_model(pk, models_at(c->host->models, i), c->tenant_name, true));
    return proto_map_end(pk, reply);
}

static int pack_tier(msgpack_packer *pk, const char *key, uint32_t total, uint32_t free_,
                     uint32_t cached, uint32_t used);

static int pack_disk(msgpack_packer *pk, const struct kvmm_disk_stats *d);
static int pack_remote(msgpack_packer *pk, const struct kvmm_remote_stats *r);
static int pack_kv_events(msgpack_packer *pk, struct kvevents *ev);
static struct kvevents *stream_of(const struct ops_ctx *c, size_t i);

/* stats "models": each model's map as hello lists it, and for an admin
 * what it does: load counts and times, its executor's queues and token
 * counters, its pools' occupancy, its own disk and remote tiers (each
 * model's kvmm has its own: the top-level maps are the first model's). */
static int pack_models_stats(struct ops_ctx *c)
{
    msgpack_packer *pk = c->pk;
    struct models *ms = c->host->models;
    size_t n = models_count(ms);
    uint64_t used, budget;
    models_device_use(ms, &used, &budget);
    if (c->admin) {
        PROTO_PK(proto_pack_str(pk, "model_memory"));
        size_t mm = proto_map_begin(pk);
        PROTO_PK(proto_pack_kv_uint(pk, "device_used", used));
        if (budget)
            PROTO_PK(proto_pack_kv_uint(pk, "device_budget", budget));
        else
            PROTO_PK(proto_pack_kv_nil(pk, "device_budget"));
        PROTO_PK(proto_map_end(pk, mm));
    }
    PROTO_PK(proto_pack_str(pk, "models"));
    PROTO_MP(proto_pack_array(pk, n));
    for (size_t i = 0; i < n; i++) {
        struct models_entry *e = models_at(ms, i);
        struct models_info mi;
        models_info(e, &mi);
        size_t map = proto_map_begin(pk);
        PROTO_PK(proto_pack_kv_str(pk, "name", mi.name));
        PROTO_PK(proto_pack_kv_str(pk, "state", models_state_name(mi.state)));
        PROTO_PK(proto_pack_kv_uint(pk, "weight_device_bytes", mi.weight_device_bytes));
        PROTO_PK(proto_pack_kv_uint(pk, "kv_device_bytes", mi.kv_device_bytes));
        PROTO_PK(proto_pack_kv_uint(pk, "kv_device_blocks", mi.kv_device_blocks));
        PROTO_PK(proto_pack_kv_uint(pk, "charged_device_bytes", mi.charged_device_bytes));
        PROTO_PK(proto_pack_kv_uint(pk, "block_bytes", mi.block_bytes));
        if (c->admin) {
            struct kvmm_stats ks;
            struct acct_sched as = {0};
            kvmm_lock(models_kvmm(e));
            kvmm_stats(models_kvmm(e), &ks);
            kvmm_unlock(models_kvmm(e));
            if (c->host->obs->acct)
                acct_sched_get_slot(c->host->obs->acct, models_index(e), &as);
            PROTO_PK(proto_pack_kv_str(pk, "path", mi.path));
            PROTO_PK(proto_pack_kv_double(pk, "idle_s", mi.idle_s));
            PROTO_PK(proto_pack_kv_uint(pk, "waiting", mi.waiting));
            PROTO_PK(proto_pack_kv_uint(pk, "loads", mi.loads));
            PROTO_PK(proto_pack_kv_uint(pk, "unloads", mi.unloads));
            PROTO_PK(proto_pack_kv_uint(pk, "load_failures", mi.load_failures));
            PROTO_PK(proto_pack_kv_double(pk, "load_ms", mi.load_ms_last));
            PROTO_PK(proto_pack_kv_double(pk, "unload_ms", mi.unload_ms_last));
            PROTO_PK(proto_pack_kv_uint(pk, "moved_at_unload", mi.moved_at_unload));
            PROTO_PK(proto_pack_kv_uint(pk, "dropped_at_unload", mi.dropped_at_unload));
            PROTO_PK(proto_pack_kv_str(pk, "last_error", mi.last_error));
            PROTO_PK(proto_pack_kv_uint(pk, "live", as.live));
            PROTO_PK(proto_pack_kv_uint(pk, "waiting_requests", as.waiting));
            PROTO_PK(proto_pack_kv_uint(pk, "running", as.running));
            PROTO_PK(proto_pack_kv_uint(pk, "submitted", as.submitted));
            PROTO_PK(proto_pack_kv_uint(pk, "generated", as.generated));
            PROTO_PK(proto_pack_kv_uint(pk, "steps", as.steps));
            PROTO_PK(proto_pack_kv_uint(pk, "prefill_tokens", as.prefill_tokens));
            PROTO_PK(proto_pack_kv_uint(pk, "decode_tokens", as.decode_tokens));
            PROTO_PK(proto_pack_kv_uint(pk, "draft_kv_device_bytes", mi.draft_kv_bytes));
            PROTO_PK(proto_pack_kv_uint(pk, "draft_kv_max_bytes", mi.draft_kv_max_bytes));
            /* its speculation: its own default and draft, its executors'
             * counters (kept across unloads) */
            snprintf(as.spec.mode, sizeof as.spec.mode, "%s", mi.spec_mode);
            as.spec.draft_model = mi.draft != NULL;
            as.spec.max_batch = mi.spec_max_batch;
            PROTO_PK(acct_stats_pack_spec(pk, &as.spec));
            PROTO_PK(pack_tier(pk, "device", ks.device_total, ks.device_free, ks.device_cached,
                               ks.device_used));
            PROTO_PK(
                pack_tier(pk, "host", ks.host_total, ks.host_free, ks.host_cached, ks.host_used));
            PROTO_PK(proto_pack_kv_uint(pk, "seqs", ks.n_seqs));
            struct kvmm_disk_stats ds;
            struct kvmm_remote_stats rs;
            kvmm_disk_stats(models_kvmm(e), &ds); /* each locks for itself */
            kvmm_remote_stats(models_kvmm(e), &rs);
            if (ds.on)
                PROTO_PK(pack_disk(pk, &ds));
            if (rs.on)
                PROTO_PK(pack_remote(pk, &rs));
            if (stream_of(c, i))
                PROTO_PK(pack_kv_events(pk, stream_of(c, i)));
        }
        PROTO_PK(proto_map_end(pk, map));
    }
    return 0;
}

/* A quota: nil when unlimited. */
static int pack_quota(msgpack_packer *pk, const char *key, uint32_t v)
{
    if (v == KVMM_UNLIMITED)
        return proto_pack_kv_nil(pk, key);
    return proto_pack_kv_uint(pk, key, v);
}

/* A byte quota: nil when there is none (0). */
static int pack_bytes_quota(msgpack_packer *pk, const char *key, uint64_t v)
{
    if (v == 0)
        return proto_pack_kv_nil(pk, key);
    return proto_pack_kv_uint(pk, key, v);
}

static int pack_tenant(msgpack_packer *pk, const struct stats_snap_tenant *st)
{
    const struct kvmm_tenant_stats *t = &st->ts;
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_str(pk, "name", t->name));
    PROTO_PK(proto_pack_kv_uint(pk, "device_blocks", t->device_blocks));
    PROTO_PK(proto_pack_kv_uint(pk, "host_blocks", t->host_blocks));
    PROTO_PK(proto_pack_kv_uint(pk, "cached_blocks", t->cached_blocks));
    PROTO_PK(proto_pack_kv_uint(pk, "cached_device", t->cached_device));
    PROTO_PK(proto_pack_kv_uint(pk, "cached_host", t->cached_host));
    PROTO_PK(proto_pack_kv_uint(pk, "device_bytes", t->device_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "host_bytes", t->host_bytes));
    PROTO_PK(proto_pack_kv_str(pk, "events",
                               t->conf.events == KVMM_EVENTS_ON       ? "on"
                               : t->conf.events == KVMM_EVENTS_HASHES ? "hashes"
                                                                      : "off"));
    PROTO_PK(proto_pack_kv_uint(pk, "seqs", t->seqs));
    PROTO_PK(proto_pack_kv_uint(pk, "match_tokens_asked", t->match_tokens_asked));
    PROTO_PK(proto_pack_kv_uint(pk, "match_tokens_hit", t->match_tokens_hit));
    PROTO_PK(proto_pack_kv_uint(pk, "swaps_out", t->swaps_out));
    PROTO_PK(proto_pack_kv_uint(pk, "swaps_in", t->swaps_in));
    PROTO_PK(acct_stats_pack_tenant(pk, &st->at, t));
    PROTO_PK(proto_pack_str(pk, "quota"));
    size_t quota = proto_map_begin(pk);
    PROTO_PK(pack_quota(pk, "max_device_blocks", t->conf.max_device_blocks));
    PROTO_PK(pack_quota(pk, "max_host_blocks", t->conf.max_host_blocks));
    PROTO_PK(pack_quota(pk, "max_seqs", t->conf.max_seqs));
    PROTO_PK(proto_pack_kv_uint(pk, "reserved_device_blocks", t->conf.reserved_device_blocks));
    PROTO_PK(pack_bytes_quota(pk, "max_device_bytes", t->conf.max_device_bytes));
    PROTO_PK(pack_bytes_quota(pk, "max_host_bytes", t->conf.max_host_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "reserved_device_bytes", t->conf.reserved_device_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "weight", t->conf.weight));
    PROTO_PK(proto_map_end(pk, quota));
    return proto_map_end(pk, map);
}

static int pack_tier(msgpack_packer *pk, const char *key, uint32_t total, uint32_t free_,
                     uint32_t cached, uint32_t used)
{
    PROTO_PK(proto_pack_str(pk, key));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "total", total));
    PROTO_PK(proto_pack_kv_uint(pk, "free", free_));
    PROTO_PK(proto_pack_kv_uint(pk, "cached", cached));
    PROTO_PK(proto_pack_kv_uint(pk, "used", used));
    return proto_map_end(pk, map);
}

/* The disk tier's map (stats "disk"): slots by state, I/O and failures. */
static int pack_disk(msgpack_packer *pk, const struct kvmm_disk_stats *d)
{
    const struct disktier_stats *t = &d->tier;
    PROTO_PK(proto_pack_str(pk, "disk"));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "total", t->slots));
    PROTO_PK(proto_pack_kv_uint(pk, "free", t->free_slots));
    PROTO_PK(proto_pack_kv_uint(pk, "cached", t->cached_slots - t->pinned_slots));
    PROTO_PK(proto_pack_kv_uint(pk, "used", t->pinned_slots));
    PROTO_PK(proto_pack_kv_uint(pk, "slot_bytes", t->slot_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "file_bytes", t->file_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "reads", t->reads));
    PROTO_PK(proto_pack_kv_uint(pk, "read_bytes", t->read_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "writes", t->writes));
    PROTO_PK(proto_pack_kv_uint(pk, "write_bytes", t->write_bytes));
    PROTO_PK(proto_pack_kv_uint(pk, "write_skips", t->write_skips + d->detach_skips));
    PROTO_PK(proto_pack_kv_uint(pk, "evictions", t->evictions));
    PROTO_PK(proto_pack_kv_uint(pk, "evict_passes", t->evict_passes));
    PROTO_PK(proto_pack_kv_uint(pk, "checksum_failures", t->checksum_failures));
    PROTO_PK(proto_pack_kv_uint(pk, "io_errors", t->io_errors));
    PROTO_PK(proto_pack_kv_uint(pk, "loaded", t->loaded));
    PROTO_PK(proto_pack_kv_uint(pk, "refused_at_load", t->dropped_at_load));
    PROTO_PK(proto_pack_kv_uint(pk, "queued", d->queued + d->detached));
    PROTO_PK(proto_pack_kv_uint(pk, "restored", d->restored));
    PROTO_PK(proto_pack_kv_uint(pk, "restore_us", t->reads ? t->read_ns / t->reads / 1000 : 0));
    PROTO_PK(proto_pack_kv_uint(pk, "detached", d->detached));
    PROTO_PK(proto_pack_kv_uint(pk, "read_requests", t->read_reqs));
    PROTO_PK(proto_pack_kv_uint(pk, "write_requests", t->write_reqs));
    PROTO_PK(proto_pack_kv_uint(pk, "restore_fails", d->restore_fails));
    PROTO_PK(proto_pack_kv_uint(pk, "restores", d->restores));
    PROTO_PK(proto_pack_kv_uint(pk, "restore_mean_us",
                                d->restores ? d->restore_ns / d->restores / 1000 : 0));
    PROTO_PK(proto_pack_kv_uint(pk, "restore_last_us", d->restore_last_ns / 1000));
    static const char *const cpu_names[KVMM_RESTORE_CPU_N] = {
        "restore_cpu_read_us", "restore_cpu_take_us", "restore_cpu_prefault_us",
        "restore_cpu_copy_us", "restore_cpu_enter_us"};
    for (size_t i = 0; i < KVMM_RESTORE_CPU_N; i++)
        PROTO_PK(proto_pack_kv_uint(pk, cpu_names[i], d->restore_cpu_ns[i] / 1000));
    PROTO_PK(proto_pack_kv_uint(pk, "sessions", d->sessions));
    return proto_map_end(pk, map);
}

/* Model i's KV events stream (store mode: i = 0), or NULL. */
static struct kvevents *stream_of(const struct ops_ctx *c, size_t i)
{
    const struct server_obs *obs = c->host->obs;
    return i < obs->n_kvevents ? obs->kvevents[i] : NULL;
}

/* The index of the model whose pool c->mm is (0 in store mode). */
static size_t model_index_of(const struct ops_ctx *c)
{
    struct models *ms = c->host->models;
    for (size_t i = 0; ms && i < models_count(ms); i++)
        if (models_kvmm(models_at(ms, i)) == c->mm)
            return i;
    return 0;
}

/* A KV events stream's map (stats "kv_events"). */
static int pack_kv_events(msgpack_packer *pk, struct kvevents *ev)
{
    struct kvevents_stats s;
    kvevents_stats(ev, &s);
    PROTO_PK(proto_pack_str(pk, "kv_events"));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "batches", s.batches));
    PROTO_PK(proto_pack_kv_uint(pk, "events", s.events));
    PROTO_PK(proto_pack_kv_uint(pk, "blocks", s.blocks));
    PROTO_PK(proto_pack_kv_uint(pk, "dropped", s.dropped));
    PROTO_PK(proto_pack_kv_uint(pk, "hwm_drops", s.hwm_drops));
    PROTO_PK(proto_pack_kv_uint(pk, "subscribers", s.subscribers));
    PROTO_PK(proto_pack_kv_uint(pk, "replay_requests", s.replay_requests));
    PROTO_PK(proto_pack_kv_uint(pk, "replay_batches", s.replay_batches));
    PROTO_PK(proto_pack_kv_uint(pk, "replay_bad", s.replay_bad));
    PROTO_PK(proto_pack_kv_uint(pk, "queued", s.queued));
    PROTO_PK(proto_pack_kv_uint(pk, "next_seq", s.next_seq));
    return proto_map_end(pk, map);
}

/* The prefetch workers' map (stats "prefetch"): their jobs, and how many
 * were raised from SCHED_IDLE after prefetch-idle-ms. */
static int pack_prefetch(msgpack_packer *pk, struct workpool *wp)
{
    struct workpool_stats ws;
    workpool_stats(wp, &ws);
    const struct workpool_conf *wc = workpool_conf(wp);
    PROTO_PK(proto_pack_str(pk, "prefetch"));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "workers", wc->threads));
    PROTO_PK(proto_pack_kv_uint(pk, "nice", wc->nice));
    PROTO_PK(proto_pack_kv_uint(pk, "idle_after_ms", wc->idle_after_ms));
    PROTO_PK(proto_pack_kv_uint(pk, "queued", ws.queued));
    PROTO_PK(proto_pack_kv_uint(pk, "running", ws.running));
    PROTO_PK(proto_pack_kv_uint(pk, "done", ws.done));
    PROTO_PK(proto_pack_kv_uint(pk, "escalations", ws.escalations));
    return proto_map_end(pk, map);
}

/* The remote tier's map (stats "remote"): lookups, writes and failures. */
static int pack_remote(msgpack_packer *pk, const struct kvmm_remote_stats *r)
{
    PROTO_PK(proto_pack_str(pk, "remote"));
    size_t map = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "blocks_per_value", r->blocks_per_value));
    PROTO_PK(proto_pack_kv_uint(pk, "hits", r->hits));
    PROTO_PK(proto_pack_kv_uint(pk, "misses", r->misses));
    PROTO_PK(proto_pack_kv_uint(pk, "bytes_in", r->bytes_in));
    PROTO_PK(proto_pack_kv_uint(pk, "bytes_out", r->bytes_out));
    PROTO_PK(proto_pack_kv_uint(pk, "rounds", r->rounds));
    PROTO_PK(proto_pack_kv_uint(pk, "latency_us_mean",
                                r->rounds ? r->latency_ns_sum / r->rounds / 1000 : 0));
    PROTO_PK(proto_pack_kv_uint(pk, "latency_us_last", r->latency_ns_last / 1000));
    PROTO_PK(proto_pack_kv_uint(pk, "errors", r->errors));
    PROTO_PK(proto_pack_kv_uint(pk, "timeouts", r->timeouts));
    PROTO_PK(proto_pack_kv_uint(pk, "skipped", r->skipped));
    PROTO_PK(proto_pack_kv_uint(pk, "auth_failures", r->auth_failures));
    PROTO_PK(proto_pack_kv_uint(pk, "mismatches", r->mismatches));
    PROTO_PK(proto_pack_kv_uint(pk, "writes", r->writes));
    PROTO_PK(proto_pack_kv_uint(pk, "write_skips", r->write_skips));
    PROTO_PK(proto_pack_kv_uint(pk, "queued", r->queued));
    PROTO_PK(proto_pack_kv_str(pk, "state", r->backoff ? "backoff" : "up"));
    PROTO_PK(proto_pack_kv_uint(pk, "retry_in_ms", r->retry_in_ms));
    PROTO_PK(proto_pack_kv_uint(pk, "backoffs", r->backoffs));
    PROTO_PK(proto_pack_kv_uint(pk, "connect_fails", r->connect_fails));
    PROTO_PK(proto_pack_kv_uint(pk, "reconnects", r->reconnects));
    PROTO_PK(proto_pack_kv_uint(pk, "moved", r->moved));
    PROTO_PK(proto_pack_kv_uint(pk, "ask", r->ask));
    PROTO_PK(proto_pack_kv_uint(pk, "announced", r->announced));
    PROTO_PK(proto_pack_kv_uint(pk, "events_stored", r->events_stored));
    PROTO_PK(proto_pack_kv_uint(pk, "events_removed", r->events_removed));
    return proto_map_end(pk, map);
}

/* A non-admin's stats: the pool's size, its own tenant and
 * nothing from which another tenant's requests, tokens or blocks could be
 * inferred (no daemon-wide counters, occupancy, queues or step rates, which
 * minus its own figures would give the others'). */
static int stats_tenant_pack(struct ops_ctx *c, const struct stats_snap *sn)
{
    const struct server_obs *obs = c->host->obs;
    msgpack_packer *pk = c->pk;
    const struct kv_geom *g = kvmm_geom(c->mm);
    size_t reply = proto_reply_begin_map(pk, c->id);
    PROTO_PK(proto_pack_kv_str(pk, "scope", "tenant"));
    PROTO_PK(proto_pack_kv_str(pk, "backend", obs->backend));
    PROTO_PK(proto_pack_kv_uint(pk, "block_tokens", g->block_tokens));
    PROTO_PK(proto_pack_kv_uint(pk, "block_bytes", kv_block_bytes(g)));
    PROTO_PK(proto_pack_str(pk, "device"));
    size_t dev = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "total", sn->st.device_total));
    PROTO_PK(proto_map_end(pk, dev));
    PROTO_PK(proto_pack_str(pk, "host"));
    size_t host = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "total", sn->st.host_total));
    PROTO_PK(proto_map_end(pk, host));
    PROTO_PK(proto_pack_str(pk, "tenants"));
    PROTO_MP(proto_pack_array(pk, 1));
    PROTO_PK(pack_tenant(pk, &sn->t[0]));
    PROTO_PK(pack_models_stats(c));
    return proto_map_end(pk, reply);
}

static int stats_tenant(struct ops_ctx *c)
{
    struct stats_snap sn;
    int rc = stats_snap_fill(&sn, c->mm, c->host->obs->acct, &c->tenant, 0, 1);
    if (rc)
        return kvd_error_set(&c->err, rc, "stats: %s",
                             rc == KVD_ENOMEM ? "out of memory" : "the tenant is not registered");
    rc = stats_tenant_pack(c, &sn);
    stats_snap_free(&sn);
    return rc;
}

/* The admin's stats: one snapshot (stats_snap.h), one page of tenants:
 * `tenants_from` (a cursor: the last reply's `tenants_next`, 0 first) and
 * `tenants_max` (default 256, at most 1024). */
static int stats_all_pack(struct ops_ctx *c, const struct stats_snap *sn)
{
    const struct server_obs *obs = c->host->obs;
    msgpack_packer *pk = c->pk;
    const struct kv_geom *g = kvmm_geom(c->mm);
    const struct kvmm_stats *st = &sn->st;
    size_t reply = proto_reply_begin_map(pk, c->id);
    PROTO_PK(proto_pack_kv_str(pk, "scope", "all"));
    PROTO_PK(proto_pack_kv_str(pk, "backend", obs->backend));
    PROTO_PK(proto_pack_kv_uint(pk, "block_tokens", g->block_tokens));
    PROTO_PK(proto_pack_kv_uint(pk, "block_bytes", kv_block_bytes(g)));
    PROTO_PK(pack_tier(pk, "device", st->device_total, st->device_free, st->device_cached,
                       st->device_used));
    PROTO_PK(pack_tier(pk, "host", st->host_total, st->host_free, st->host_cached, st->host_used));
    if (sn->disk.on)
        PROTO_PK(pack_disk(pk, &sn->disk));
    if (stream_of(c, model_index_of(c)))
        PROTO_PK(pack_kv_events(pk, stream_of(c, model_index_of(c))));
    if (sn->remote.on)
        PROTO_PK(pack_remote(pk, &sn->remote));
    if (obs->prefetch)
        PROTO_PK(pack_prefetch(pk, obs->prefetch));
    PROTO_PK(proto_pack_str(pk, "counters"));
    size_t counters = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "match_tokens_asked", st->match_tokens_asked));
    PROTO_PK(proto_pack_kv_uint(pk, "match_tokens_hit", st->match_tokens_hit));
    PROTO_PK(proto_pack_kv_uint(pk, "swaps_out", st->swaps_out));
    PROTO_PK(proto_pack_kv_uint(pk, "swaps_in", st->swaps_in));
    PROTO_PK(proto_pack_kv_uint(pk, "swap_bytes_out", st->swap_bytes_out));
    PROTO_PK(proto_pack_kv_uint(pk, "swap_bytes_in", st->swap_bytes_in));
    PROTO_PK(proto_pack_kv_uint(pk, "evictions", st->evictions_device));
    PROTO_PK(proto_pack_kv_uint(pk, "drops", st->drops));
    PROTO_PK(proto_pack_kv_uint(pk, "checksum_failures", st->checksum_failures));
    PROTO_PK(proto_pack_kv_uint(pk, "cow_copies", st->cow_copies));
    PROTO_PK(proto_pack_kv_uint(pk, "seqs", st->n_seqs));
    PROTO_PK(proto_map_end(pk, counters));
    PROTO_PK(proto_pack_str(pk, "exports"));
    size_t exports = proto_map_begin(pk);
    PROTO_PK(proto_pack_kv_uint(pk, "exports", st->exports));
    PROTO_PK(proto_pack_kv_uint(pk, "pages", st->export_pages));
    PROTO_PK(proto_pack_kv_uint(pk, "draining", st->export_draining));
    PROTO_PK(proto_pack_kv_uint(pk, "withheld", st->export_withheld));
    PROTO_PK(proto_map_end(pk, exports));
    /* The pool's pages (docs/architecture.md "Pages"). */
    PROTO_PK(proto_pack_str(pk, "pages"));
    size_t pages = proto_map_begin(pk);
    for (int t = 0; t < 2; t++) {
        PROTO_PK(proto_pack_str(pk, t == KVD_TIER_DEVICE ? "device" : "host"));
        size_t tier = proto_map_begin(pk);
        PROTO_PK(proto_pack_kv_uint(pk, "page_bytes", st->page_bytes[t]));
        PROTO_PK(proto_pack_kv_uint(pk, "blocks_per_page", st->blocks_per_page[t]));
        PROTO_PK(proto_pack_kv_uint(pk, "held", st->pages_held[t]));
        PROTO_PK(proto_pack_kv_uint(pk, "spare", st->pages_spare[t]));
        PROTO_PK(proto_pack_kv_uint(pk, "free", st->pages_free[t]));
        PROTO_PK(proto_pack_kv_uint(pk, "cached", st->pages_cached[t]));
        PROTO_PK(proto_map_end(pk, tier));
    }
    PROTO_PK(proto_pack_kv_uint(pk, "maps", st->page_maps));
    PROTO_PK(proto_pack_kv_uint(pk, "unmaps", st->page_unmaps));
    PROTO_PK(proto_map_end(pk, pages));
    PROTO_PK(proto_pack_kv_uint(pk, "connections", *obs->n_conns));
    PROTO_PK(proto_pack_kv_uint(pk, "in_flight", *obs->n_pending));
    if (obs->tenancy) {
        struct tenancy_counts tc;
        tenancy_counts(obs->tenancy, &tc);
        PROTO_PK(proto_pack_str(pk, "tenancy"));
        size_t ty = proto_map_begin(pk);
        PROTO_PK(proto_pack_kv_uint(pk, "registered", tc.tenants));
        PROTO_PK(proto_pack_kv_uint(pk, "sub_tenants", tc.sub_tenants));
        PROTO_PK(proto_pack_kv_uint(pk, "sub_tenants_freed", tc.subs_freed));
        PROTO_PK(proto_pack_kv_uint(pk, "sub_tenants_refused", tc.subs_refused));
        PROTO_PK(proto_map_end(pk, ty));
    }
    PROTO_PK(proto_pack_kv_uint(pk, "tenants_total", sn->n_live));
    if (sn->more)
        PROTO_PK(proto_pack_kv_uint(pk, "tenants_next", sn->next));
    else
        PROTO_PK(proto_pack_kv_nil(pk, "tenants_next"));
    PROTO_PK(proto_pack_str(pk, "tenants"));
    PROTO_MP(proto_pack_array(pk, sn->n));
    for (size_t i = 0; i < sn->n; i++)
        PROTO_PK(pack_tenant(pk, &sn->t[i]));
    PROTO_PK(acct_stats_pack_top(pk, obs->acct, obs->rl)); /* "requests", "roofline" */
    PROTO_PK(pack_models_stats(c));
    return proto_map_end(pk, reply);
}

static int stats_all(struct ops_ctx *c)
{
    uint64_t from = 0, max = STATS_SNAP_PAGE_DEFAULT;
    struct stats_snap sn;

    PROTO_PK(proto_opt_uint(c->req, "tenants_from", &from, NULL, &c->err));
    PROTO_PK(proto_opt_uint(c->req, "tenants_max", &max, NULL, &c->err));
    if (from > UINT32_MAX)
        return kvd_error_set(&c->err, KVD_EBADREQ, "'tenants_from' %llu is not a cursor",
                             (unsigned long long)from);
    if (max < 1 || max > STATS_SNAP_PAGE_MAX)
        return kvd_error_set(&c->err, KVD_EBADREQ, "'tenants_max' must be 1 to %u",
                             STATS_SNAP_PAGE_MAX);
    int rc = stats_snap_fill(&sn, c->mm, c->host->obs->acct, NULL, (uint32_t)from, (size_t)max);
    if (rc)
        return kvd_error_set(&c->err, rc, "stats: out of memory");
    rc = stats_all_pack(c, &sn);
    stats_snap_free(&sn);
    return rc;
}

int ops_stats(struct ops_ctx *c)
{
    /* `model`: the model whose pool, tiers, tenants' blocks and KV events
     * the top-level keys show (the first when none is named) */
    struct models_entry *me = NULL;
    PROTO_PK(ops_pick_model(c, &me));
    if (me)
        c->mm = models_kvmm(me);
    return c->admin ? stats_all(c) : stats_tenant(c);
}
