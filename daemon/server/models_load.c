/* models_load: what the model registry does off the loop (models_impl.h):
 * at start, each model's header, text and memory manager; then, on the
 * loader thread, loading (weights, device arena, executor) and unloading
 * (the same in reverse, the cached device blocks moved to the host tier).
 *
 * The memory: until one elastic page budget lands, each model's kvmm has
 * fixed arenas cut from the daemon's budget here (mload_arenas), the one
 * place that decides how much a model may take. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "exec.h"
#include "log.h"
#include "models_impl.h"
#include "text.h"

static double ms_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) * 1e3 + (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
}

/* Bytes of device memory --gpu-mem is a fraction of: the GPU's free memory
 * on cuda, physical memory on cpu. 0 when unknown. */
static size_t device_free(struct backend *be)
{
    size_t free_b = 0, total_b = 0;
    if (!be->ops->mem_info || be->ops->mem_info(be, &free_b, &total_b) != 0)
        return 0;
    return free_b;
}

uint64_t mload_need(const struct models_entry *e)
{
    return e->weight_device + kvmm_device_bytes(e->mm);
}

/* The arenas of model e, blocks of bb bytes: the one place a model's memory
 * is cut from the daemon's.
 *  - device: a cap on the model's weights + KV (its max-device-bytes, else
 *    with a device budget its share, device-bytes / models) leaves the KV
 *    arena what the weights do not take; without a cap, --device-blocks,
 *    or --gpu-mem of the free memory (divided among the models), or the
 *    default 1024 blocks;
 *  - host: --host-blocks each, or --host-mem divided among the models.
 * The weights are the header's tensor bytes until the first load measures
 * them (the cuda backend's bf16 copies come on top). */
static int mload_arenas(struct models *ms, struct models_entry *e, size_t bb, uint32_t *dev,
                        uint32_t *host, struct kvd_error *err)
{
    const struct options *o = &ms->opts;
    uint64_t n_models = ms->n ? ms->n : 1;
    uint64_t cap = e->conf.max_device_bytes;
    if (!cap && o->device_bytes)
        cap = o->device_bytes / n_models;
    if (cap) {
        if (cap <= e->weight_device + bb)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "model %s: its share of the device (%" PRIu64
                                 " bytes: max-device-bytes, or device-bytes / %" PRIu64
                                 " models) does not hold its %" PRIu64 " bytes of weights and "
                                 "a %zu-byte KV block",
                                 e->conf.name, cap, n_models, e->weight_device, bb);
        uint64_t n = (cap - e->weight_device) / bb;
        *dev = n >= UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)n;
    } else if (o->device_blocks) {
        *dev = o->device_blocks;
    } else if (o->gpu_mem > 0) {
        size_t mem = device_free(ms->conf.be);
        if (mem == 0)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "--gpu-mem: cannot tell how much device memory there is; use "
                                 "--device-blocks");
        double n = (double)mem * o->gpu_mem / (double)n_models / (double)bb;
        if (n < 1)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "--gpu-mem %.3f of %zu bytes is less than one %zu-byte block",
                                 o->gpu_mem, mem, bb);
        *dev = n >= (double)(UINT32_MAX - 1) ? UINT32_MAX - 1 : (uint32_t)n;
    } else {
        *dev = OPTIONS_DEFAULT_DEVICE_BLOCKS;
    }
    *host = OPTIONS_DEFAULT_HOST_BLOCKS;
    if (o->host_blocks != UINT32_MAX) {
        *host = o->host_blocks;
    } else if (o->host_mem) {
        uint64_t n = o->host_mem / n_models / bb;
        *host = n >= UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)n;
    }
    return 0;
}

/* The disk tier's directory of model e: --disk-dir itself for the first
 * model (where a daemon of one model always kept it), a folder of its own
 * named after the model for the others. */
static int disk_dir(struct models *ms, struct models_entry *e, char *out, size_t cap)
{
    if (e->idx == 0)
        return snprintf(out, cap, "%s", ms->opts.disk_dir) < (int)cap ? 0 : -1;
    char name[OPTIONS_MODEL_NAME + 1];
    snprintf(name, sizeof name, "%s", e->conf.name);
    for (char *c = name; *c; c++)
        if (*c == '/' || *c == ':')
            *c = '_';
    return snprintf(out, cap, "%s/model-%s", ms->opts.disk_dir, name) < (int)cap ? 0 : -1;
}

int mload_prepare(struct models *ms, struct models_entry *e, struct kvd_error *err)
{
    const struct options *o = &ms->opts;
    char terr[512];
    struct kvd_error le = {0};
    int rc = model_probe(e->conf.path, &e->probe, &le);
    if (rc)
        return kvd_error_set(err, rc, "model %s (%s): %s", e->conf.name, e->conf.path, le.message);
    e->hp = e->probe;
    /* the cuda backend keeps a bf16 copy of f16 and q8_0 matrices */
    e->weight_device = e->probe.weight_bytes;
    if (ms->conf.be->ops->kind == BACKEND_CUDA &&
        (e->probe.wtype == CT_F16 || e->probe.wtype == CT_Q8_0))
        e->weight_device += 2 * e->probe.n_params;
    /* --chat-template is the plain --model's (a [model:NAME] has its file's) */
    const char *tmpl = e->idx == 0 && o->model_path[0] ? o->chat_template_path : NULL;
    if (text_open(e->conf.path, tmpl, &e->text, terr, sizeof terr) != 0)
        return kvd_error_set(err, KVD_EBADREQ, "model %s: %s", e->conf.name, terr);
    struct kvmm_config mc = {
        .be = ms->conf.be,
        .evict_policy = o->evict_policy == OPTIONS_EVICT_LRU ? KVMM_EVICT_LRU : KVMM_EVICT_HITS,
        .device_detached = true,
        .handle_tag = (uint8_t)e->idx,
    };
    enum kv_dtype dt = e->conf.kv_dtype >= 0 ? (enum kv_dtype)e->conf.kv_dtype : o->geom.dtype;
    mc.geom = (struct kv_geom){.layers = e->probe.n_layer,
                               .kv_heads = e->probe.n_head_kv,
                               .head_dim = e->probe.head_dim,
                               .dtype = dt,
                               .block_tokens = o->geom.block_tokens};
    if ((rc = kv_geom_check(&mc.geom, &le)))
        return kvd_error_set(err, rc, "model %s's KV: %s", e->conf.name, le.message);
    size_t bb = kv_block_bytes(&mc.geom);
    if ((rc = mload_arenas(ms, e, bb, &mc.n_device_blocks, &mc.n_host_blocks, err)))
        return rc;
    if ((rc = kvmm_new(&mc, &e->mm)))
        return kvd_error_set(err, rc,
                             "model %s: cannot create its KV memory manager: %s (%u device + %u "
                             "host blocks of %zu bytes)",
                             e->conf.name, kvd_err_code(rc), mc.n_device_blocks, mc.n_host_blocks,
                             bb);
    log_info("model %s: %s, %s, %u layers, embd %u, %u heads (%u kv), vocab %u, context %u, "
             "%.1fM parameters; KV %s, %zu-byte blocks: %u device (%.1f MiB, while loaded) + "
             "%u host",
             e->conf.name, e->conf.path, e->probe.arch, e->probe.n_layer, e->probe.n_embd,
             e->probe.n_head, e->probe.n_head_kv, e->probe.n_vocab, e->probe.n_ctx,
             (double)e->probe.n_params / 1e6, kv_dtype_name(dt), bb, mc.n_device_blocks,
             (double)kvmm_device_bytes(e->mm) / (1 << 20), mc.n_host_blocks);
    if (text_tokenizer(e->text))
        log_info("model %s: tokenizer %s (pre-tokenizer %s), %u tokens; chat template: %s",
                 e->conf.name, tokenizer_model_name(text_tokenizer(e->text)),
                 tokenizer_pre_name(text_tokenizer(e->text)),
                 tokenizer_n_vocab(text_tokenizer(e->text)),
                 text_chat_template(e->text) ? "yes" : "none");
    if (o->disk_dir[0]) {
        char dir[4096 + 96];
        if (disk_dir(ms, e, dir, sizeof dir))
            return kvd_error_set(err, KVD_EBADREQ, "model %s: --disk-dir is too long",
                                 e->conf.name);
        /* each model's own directory, and its share of the disk */
        uint64_t bytes = o->disk_max_bytes / (ms->n ? ms->n : 1);
        if (bytes < (1u << 20))
            bytes = 1u << 20;
        struct kvmm_disk_conf dc = {
            .dir = dir, .max_bytes = bytes, .writeback_ms = o->disk_writeback_ms};
        struct kvmm_disk_stats ds;
        if (e->idx && mkdir(dir, 0700) != 0 && errno != EEXIST)
            return kvd_error_set(err, KVD_EBADREQ, "model %s: --disk-dir: cannot create %s: %s",
                                 e->conf.name, dir, strerror(errno));
        if ((rc = kvmm_disk_open(e->mm, &dc, &le)))
            return kvd_error_set(err, rc, "model %s: --disk-dir %s: %s", e->conf.name, dir,
                                 le.message);
        kvmm_disk_stats(e->mm, &ds);
        log_info("model %s: disk tier %s: %" PRIu64 " slots of %" PRIu64 " bytes (%.1f GiB), "
                 "%" PRIu64 " cached blocks found (%" PRIu64 " records refused)",
                 e->conf.name, dir, ds.tier.slots, ds.tier.slot_bytes,
                 (double)ds.tier.file_bytes / (1 << 30), ds.tier.loaded, ds.tier.dropped_at_load);
    }
    if (o->remote[0]) {
        struct kvmm_remote_conf rc_ = {.url = o->remote,
                                       .key_file = o->remote_key_file,
                                       .insecure = o->remote_insecure,
                                       .timeout_ms = o->remote_timeout_ms,
                                       .value_bytes = o->remote_value_bytes,
                                       .ttl_s = o->remote_ttl_s,
                                       .min_hits = o->remote_min_hits};
        if ((rc = kvmm_remote_open(e->mm, &rc_, &le)))
            return kvd_error_set(err, rc, "model %s: --remote: %s", e->conf.name, le.message);
    }
    return 0;
}

static void load(struct models *ms, struct mjob *j)
{
    struct models_entry *e = j->e;
    const struct options *o = &ms->opts;
    struct model_opts mo = {.n_threads = o->threads};
    struct kvd_error le = {0};
    int rc = model_load_opts(e->conf.path, ms->conf.be, &mo, &j->model, &le);
    if (rc) {
        j->rc = kvd_error_set(&j->err, rc, "model %s: %s", e->conf.name, le.message);
        return;
    }
    const struct model_hparams *hp = model_hparams(j->model);
    struct kv_geom want;
    model_kv_geom(j->model, o->geom.block_tokens, kvmm_geom(e->mm)->dtype, &want);
    const struct kv_geom *have = kvmm_geom(e->mm);
    if (want.layers != have->layers || want.kv_heads != have->kv_heads ||
        want.head_dim != have->head_dim) {
        j->rc = kvd_error_set(&j->err, KVD_EBADREQ,
                              "model %s: the file changed its shape since the daemon started "
                              "(KV %u x %u x %u, now %u x %u x %u): restart kvd",
                              e->conf.name, have->layers, have->kv_heads, have->head_dim,
                              want.layers, want.kv_heads, want.head_dim);
        goto fail;
    }
    size_t cleared = 0;
    kvmm_lock(e->mm);
    bool changed = kvmm_set_fingerprint(e->mm, hp->fingerprint, &cleared);
    rc = kvmm_device_attach(e->mm);
    if (rc)
        kvd_error_set(&j->err, rc, "model %s: %s", e->conf.name, kvmm_errmsg(e->mm));
    kvmm_unlock(e->mm);
    /* its sessions are the files of its fingerprint (known now) */
    if (!rc && changed && kvmm_sessions_reload(e->mm, &le) != 0)
        log_warn("model %s: %s", e->conf.name, le.message);
    if (cleared)
        log_warn("model %s: the file is not the one its cached KV was made with: %zu cached "
                 "blocks dropped",
                 e->conf.name, cleared);
    if ((j->rc = rc))
        goto fail;
    struct exec_conf ec = {
        .step_tokens = o->step_tokens,
        .max_seqs = o->step_seqs,
        .queue_timeout_ms = o->queue_timeout_ms ? o->queue_timeout_ms : UINT32_MAX,
        .roofline = ms->conf.rl,
        .acct = ms->conf.acct,
        .text = e->text,
        .pool = ms->conf.text_pool,
        .disk_pool = ms->conf.disk_pool,
        .arbiter = ms->arb,
        .acct_slot = e->idx,
        .on_idle = mload_kick,
        .on_idle_ud = ms,
    };
    if ((rc = exec_new(e->mm, j->model, &ec, &j->ex, &le))) {
        j->rc = kvd_error_set(&j->err, rc, "model %s: cannot start its executor: %s", e->conf.name,
                              le.message);
        kvmm_lock(e->mm);
        kvmm_device_detach(e->mm, NULL, NULL);
        kvmm_unlock(e->mm);
        goto fail;
    }
    return;
fail:
    model_free(j->model);
    j->model = NULL;
}

static void unload(struct models *ms, struct mjob *j)
{
    struct models_entry *e = j->e;
    (void)ms;
    exec_free(j->ex); /* idle: no request to cancel */
    j->ex = NULL;
    /* The cached device blocks leave in batches, the lock released between
     * them: the loop (stats, a tenant's registration) never waits for more
     * than one batch's copies. Nothing else allocates here meanwhile: the
     * model is unloading, its requests wait. */
    struct kvmm_stats before, after;
    size_t n = 0, moved = 0, dropped = 0;
    kvmm_lock(e->mm);
    kvmm_stats(e->mm, &before);
    kvmm_unlock(e->mm);
    do {
        kvmm_lock(e->mm);
        if (kvmm_evict(e->mm, KVD_TIER_DEVICE, 64, &n) != 0)
            n = 0;
        kvmm_unlock(e->mm);
    } while (n == 64);
    kvmm_lock(e->mm);
    kvmm_stats(e->mm, &after);
    j->rc = kvmm_device_detach(e->mm, &moved, &dropped);
    if (j->rc)
        kvd_error_set(&j->err, j->rc, "model %s: %s", e->conf.name, kvmm_errmsg(e->mm));
    kvmm_unlock(e->mm);
    j->moved = (size_t)(after.swaps_out - before.swaps_out) + moved;
    j->dropped = (size_t)(after.drops - before.drops) + dropped;
    model_free(j->model);
    j->model = NULL;
}

void mload_run(struct models *ms, struct mjob *j)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    j->rc = 0;
    memset(&j->err, 0, sizeof j->err);
    if (j->kind == MJOB_LOAD)
        load(ms, j);
    else
        unload(ms, j);
    j->ms = ms_since(&t0);
}

void *mload_main(void *arg)
{
    struct models *ms = arg;
    pthread_mutex_lock(&ms->mu);
    for (;;) {
        while (!ms->stop && !ms->jobs)
            pthread_cond_wait(&ms->cv, &ms->mu);
        if (ms->stop)
            break;
        struct mjob *j = ms->jobs;
        ms->jobs = j->next;
        if (!ms->jobs)
            ms->jobs_tail = NULL;
        pthread_mutex_unlock(&ms->mu);
        mload_run(ms, j);
        pthread_mutex_lock(&ms->mu);
        j->next = ms->done;
        ms->done = j;
        if (ms->ev_done)
            event_active(ms->ev_done, EV_READ, 0);
    }
    pthread_mutex_unlock(&ms->mu);
    return NULL;
}

void mload_kick(void *ud)
{
    struct models *ms = ud;
    pthread_mutex_lock(&ms->mu);
    if (ms->ev_kick)
        event_active(ms->ev_kick, EV_READ, 0);
    pthread_mutex_unlock(&ms->mu);
}
