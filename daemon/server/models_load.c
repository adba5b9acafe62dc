/* models_load: what the model registry does off the loop (models_impl.h):
 * at start, each model's header, text, memory manager and draft; then, on
 * the loader thread, loading (weights, device arena, the draft's state,
 * executor) and unloading (the same in reverse, the cached device blocks
 * moved to the host tier).
 *
 * The memory: until one elastic page budget lands, each model's kvmm has
 * fixed arenas cut from the daemon's budget here (mload_arenas, the draft's
 * KV arena too), the one place that decides how much a model may take. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "draft.h"
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

/* Device bytes of a file's weights from its header: the tensors, and the
 * cuda backend's bf16 copy of f16 and q8_0 matrices. */
static uint64_t weight_device_of(const struct models *ms, const struct model_hparams *hp)
{
    uint64_t b = hp->weight_bytes;
    if (ms->conf.be->ops->kind == BACKEND_CUDA && (hp->wtype == CT_F16 || hp->wtype == CT_Q8_0))
        b += 2 * hp->n_params;
    return b;
}

uint64_t mload_footprint(const struct models *ms, uint32_t set)
{
    uint64_t b = 0;
    for (size_t i = 0; i < ms->n; i++) {
        const struct models_entry *e = &ms->v[i];
        bool in = set & (1u << i);
        if (in) {
            b += kvmm_device_bytes(e->mm) + e->draft_kv_bytes;
            if (e->draft_path && !e->draft)
                b += e->draft_weight_device; /* --draft-model's own */
        }
        bool weights = in;
        for (size_t k = 0; k < ms->n && !weights; k++)
            weights = (set & (1u << k)) && ms->v[k].draft == e;
        if (weights)
            b += e->weight_device;
    }
    return b;
}

/* ---- weights, shared -------------------------------------------------------
 * A model's weights load once, whoever needs them: its own executor, and
 * the executors of the models it drafts for ([model:T] draft = it). Every
 * forward on them takes the arbiter's turn, so two executors never run
 * them at once. Counted references, touched only where loads and unloads
 * run (the loader thread; the preloads and models_stop before and after it
 * runs). */

static int weights_get(struct models *ms, struct models_entry *e, struct model **out,
                       struct kvd_error *err)
{
    if (!e->w) {
        struct model_opts mo = {.n_threads = ms->opts.threads};
        struct kvd_error le = {0};
        int rc = model_load_opts(e->conf.path, ms->conf.be, &mo, &e->w, &le);
        if (rc)
            return kvd_error_set(err, rc, "model %s: %s", e->conf.name, le.message);
    }
    e->w_refs++;
    *out = e->w;
    return 0;
}

static void weights_put(struct models_entry *e)
{
    if (e->w_refs && --e->w_refs == 0) {
        model_free(e->w);
        e->w = NULL;
    }
}

void mload_discard(struct models *ms, struct models_entry *e, struct exec *ex)
{
    (void)ms;
    exec_free(ex); /* the draft's state with it */
    if (e->holds_draft) {
        e->holds_draft = false;
        weights_put(e->draft);
    }
    weights_put(e);
}

/* ---- drafts ----------------------------------------------------------------- */

/* What errors and the log call e's draft. */
static void draft_label(const struct models_entry *e, char *out, size_t cap)
{
    if (e->draft)
        snprintf(out, cap, "model %s's draft %s", e->conf.name, e->draft->conf.name);
    else
        snprintf(out, cap, "--draft-model %s", e->draft_path);
}

int mload_drafts(struct models *ms, struct kvd_error *err)
{
    const struct options *o = &ms->opts;
    if (o->draft_model_path[0]) {
        /* the daemon's one model's: the plain --model's, or the only one */
        if (!o->model_path[0] && ms->n != 1)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "--draft-model is the draft of a daemon's one model (or of the "
                                 "plain --model); give each of several models its own: "
                                 "[model:NAME] draft = OTHER");
        if (ms->v[0].conf.draft[0])
            return kvd_error_set(err, KVD_EBADREQ,
                                 "model %s has two drafts: --draft-model and [model:%s] draft",
                                 ms->v[0].conf.name, ms->v[0].conf.name);
        ms->v[0].draft_path = o->draft_model_path;
    }
    bool any = false;
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        if (e->conf.draft[0]) {
            for (size_t k = 0; k < ms->n && !e->draft; k++)
                if (k != i && !strcmp(ms->v[k].conf.name, e->conf.draft))
                    e->draft = &ms->v[k];
            if (!e->draft) {
                char list[512] = "";
                for (size_t k = 0; k < ms->n; k++)
                    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", k ? ", " : "",
                             ms->v[k].conf.name);
                return kvd_error_set(err, KVD_EBADREQ,
                                     "[model:%s] draft: no other model is named '%s' (this "
                                     "daemon serves %s)",
                                     e->conf.name, e->conf.draft, list);
            }
            e->draft_path = e->draft->conf.path;
        }
        int kind = e->conf.speculative >= 0 ? e->conf.speculative : (int)o->speculative;
        if (e->draft_path) {
            /* Both headers are known now: the vocabularies are compared
             * before anything loads (and again at each load). */
            char label[OPTIONS_MODEL_NAME * 2 + 4200];
            struct model_hparams th;
            struct kvd_error le = {0};
            int rc;
            draft_label(e, label, sizeof label);
            if ((rc = model_probe(e->draft_path, &e->draft_probe, &le)))
                return kvd_error_set(err, rc, "%s: %s", label, le.message);
            if ((rc = model_probe(e->conf.path, &th, &le)))
                return kvd_error_set(err, rc, "model %s (%s): %s", e->conf.name, e->conf.path,
                                     le.message);
            if ((rc = draft_check_vocab(e->conf.path, th.n_vocab, e->draft_path,
                                        e->draft_probe.n_vocab, label, err)))
                return rc;
            e->draft_weight_device = weight_device_of(ms, &e->draft_probe);
            const char *base = strrchr(e->draft_path, '/');
            snprintf(e->draft_name, sizeof e->draft_name, "%.*s", OPTIONS_MODEL_NAME,
                     e->draft                 ? e->draft->conf.name
                     : e->draft_probe.name[0] ? e->draft_probe.name
                     : base                   ? base + 1
                                              : e->draft_path);
            e->draft_dtype = e->draft && e->draft->conf.kv_dtype >= 0 ? e->draft->conf.kv_dtype
                                                                      : (int)o->geom.dtype;
            any = true;
        } else if (kind == OPTIONS_SPEC_DRAFT) {
            if (e->conf.speculative >= 0)
                return kvd_error_set(err, KVD_EBADREQ,
                                     "[model:%s] speculative = draft: the model has no draft "
                                     "([model:%s] draft = OTHER)",
                                     e->conf.name, e->conf.name);
            kind = OPTIONS_SPEC_OFF; /* the daemon's draft, where a model has one */
        }
        e->spec_kind = kind;
    }
    if (o->speculative == OPTIONS_SPEC_DRAFT && !any)
        return kvd_error_set(err, KVD_EBADREQ,
                             "--speculative draft needs a draft model (--draft-model, or "
                             "[model:NAME] draft = OTHER)");
    for (size_t i = 0; i < ms->n; i++)
        if (o->speculative == OPTIONS_SPEC_DRAFT && ms->v[i].conf.speculative < 0 &&
            !ms->v[i].draft_path)
            log_info("model %s: no draft model: --speculative draft leaves its requests "
                     "decoding plainly unless they ask for ngram",
                     ms->v[i].conf.name);
    return 0;
}

/* The arenas of model e, blocks of bb bytes: the one place a model's memory
 * is cut from the daemon's.
 *  - device: a cap on the model's weights + KV (its max-device-bytes, else
 *    with a device budget its share, device-bytes / models) leaves the KV
 *    arena what the weights (its draft's too) do not take; without a cap,
 *    --device-blocks, or --gpu-mem of the free memory (divided among the
 *    models), or the default 1024 blocks;
 *  - the draft's KV (a model with a draft): draft-kv-share of that arena's
 *    bytes (e->draft_kv_bytes), the model keeping the rest;
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
    uint64_t weights = e->weight_device + (e->draft_path ? e->draft_weight_device : 0);
    if (cap) {
        if (cap <= weights + bb)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "model %s: its share of the device (%" PRIu64
                                 " bytes: max-device-bytes, or device-bytes / %" PRIu64
                                 " models) does not hold its %" PRIu64
                                 " bytes of weights%s and a %zu-byte KV block",
                                 e->conf.name, cap, n_models, weights,
                                 e->draft_path ? " (its draft's included)" : "", bb);
        uint64_t n = (cap - weights) / bb;
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
    if (e->draft_path) {
        /* the draft's KV: its share of the arena's bytes, in whole blocks of
         * the draft's geometry (checked here, before anything loads) */
        struct kv_geom dg = {.layers = e->draft_probe.n_layer,
                             .kv_heads = e->draft_probe.n_head_kv,
                             .head_dim = e->draft_probe.head_dim,
                             .dtype = (enum kv_dtype)e->draft_dtype,
                             .block_tokens = o->geom.block_tokens};
        struct kvd_error le = {0};
        char label[OPTIONS_MODEL_NAME * 2 + 4200];
        draft_label(e, label, sizeof label);
        if (kv_geom_check(&dg, &le))
            return kvd_error_set(err, KVD_EBADREQ, "%s's KV: %s", label, le.message);
        double total = (double)*dev * (double)bb;
        uint64_t dbytes = (uint64_t)(total * o->draft_kv_share);
        double left = (total - (double)dbytes) / (double)bb;
        if (left < 1)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "model %s: draft-kv-share %.3f leaves it less than one KV block",
                                 e->conf.name, o->draft_kv_share);
        if (dbytes < kv_block_bytes(&dg))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "%s: its KV share (%" PRIu64 " bytes, draft-kv-share %.3f of "
                                 "model %s's arena) is less than one %zu-byte block",
                                 label, dbytes, o->draft_kv_share, e->conf.name,
                                 kv_block_bytes(&dg));
        *dev = (uint32_t)left;
        e->draft_kv_bytes = dbytes;
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
    e->weight_device = weight_device_of(ms, &e->probe);
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

/* e's draft state for its executor: the draft's weights (its own file,
 * or the draft model's, shared: a reference taken), checked against the
 * loaded target, its KV arena (e->draft_kv_bytes) and scratch. */
static int open_draft(struct models *ms, struct models_entry *e, struct model *target,
                      struct draft **out, struct kvd_error *err)
{
    const struct options *o = &ms->opts;
    struct model *dw = NULL;
    char label[OPTIONS_MODEL_NAME * 2 + 4200];
    int rc;
    *out = NULL;
    draft_label(e, label, sizeof label);
    if (e->draft) {
        if ((rc = weights_get(ms, e->draft, &dw, err)))
            return rc;
        e->holds_draft = true;
    }
    struct draft_conf dc = {.path = e->draft_path,
                            .target_path = e->conf.path,
                            .label = label,
                            .target = model_hparams(target),
                            .weights = dw,
                            .be = ms->conf.be,
                            .n_threads = o->threads,
                            .block_tokens = o->geom.block_tokens,
                            .dtype = (enum kv_dtype)e->draft_dtype,
                            .max_seqs = o->spec_max_batch,
                            .step_tokens = o->step_tokens};
    if ((rc = draft_open(&dc, out, err)) == 0 &&
        (rc = draft_kv_open(*out, (size_t)e->draft_kv_bytes, err)) == 0) {
        const struct model_hparams *dh = draft_hparams(*out);
        log_info("%s: %u layers, embd %u, %.1fM parameters%s; KV %u blocks of %zu bytes "
                 "(%.1f MiB, draft-kv-share %.3f)",
                 label, dh->n_layer, dh->n_embd, (double)dh->n_params / 1e6,
                 e->draft ? ", its weights shared" : "", draft_kv_blocks(*out),
                 draft_block_bytes(*out), (double)e->draft_kv_bytes / (1 << 20), o->draft_kv_share);
        return 0;
    }
    draft_free(*out);
    *out = NULL;
    if (e->holds_draft) {
        e->holds_draft = false;
        weights_put(e->draft);
    }
    return rc;
}

static void load(struct models *ms, struct mjob *j)
{
    struct models_entry *e = j->e;
    const struct options *o = &ms->opts;
    struct kvd_error le = {0};
    struct draft *draft = NULL;
    int rc = weights_get(ms, e, &j->model, &j->err);
    if (rc) {
        j->rc = rc;
        j->model = NULL;
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
    if (e->draft_path && (rc = open_draft(ms, e, j->model, &draft, &j->err))) {
        j->rc = rc;
        kvmm_lock(e->mm);
        kvmm_device_detach(e->mm, NULL, NULL);
        kvmm_unlock(e->mm);
        goto fail;
    }
    static const enum spec_kind kinds[] = {SPEC_OFF, SPEC_NGRAM, SPEC_DRAFT};
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
        .spec = {.kind = kinds[e->spec_kind],
                 .max_batch = o->spec_max_batch,
                 .max_draft = o->spec_max_draft,
                 .ngram_min = o->spec_ngram_min,
                 .ngram_max = o->spec_ngram_max},
        .draft = draft, /* the executor's from here on */
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
    mload_discard(ms, e, NULL); /* the references taken: the draft's (exec_new freed its
                                 * state), its own */
    j->model = NULL;
}

static void unload(struct models *ms, struct mjob *j)
{
    struct models_entry *e = j->e;
    exec_free(j->ex); /* idle: no request to cancel; its draft state goes with it */
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
    /* the weights stay while a model it drafts for holds them */
    mload_discard(ms, e, NULL);
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
