/* models_load: what the model registry does off the loop (models_impl.h):
 * at start, each model's header, text, memory manager and draft; then, on
 * the loader thread, loading (weights, the draft's state, executor, each
 * charged to the page budget: models_budget.c) and unloading (the same in
 * reverse, the cached device blocks moved to the host tier and the model's
 * pages given back to the budget). */
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
#include "pages.h"
#include "text.h"

static double ms_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) * 1e3 + (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
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
        int rc = mload_charge(ms, e, e->weight_device, &e->w_pages, "its weights", err);
        if (rc)
            return rc;
        rc = model_load_opts(e->conf.path, ms->conf.be, &mo, &e->w, &le);
        if (rc) {
            mload_uncharge(ms, &e->w_pages);
            return kvd_error_set(err, rc, "model %s: %s", e->conf.name, le.message);
        }
        /* the header's estimate made exact */
        uint64_t pb = kvpages_page_bytes(ms->pages, KVD_TIER_DEVICE);
        uint64_t want = (model_hparams(e->w)->weight_device_bytes + pb - 1) / pb;
        if (want < e->w_pages) {
            kvpages_give(ms->pages, KVD_TIER_DEVICE, KVPAGES_NONE, e->w_pages - (uint32_t)want);
            e->w_pages = (uint32_t)want;
        } else if (want > e->w_pages) {
            if (kvpages_take(ms->pages, KVD_TIER_DEVICE, KVPAGES_NONE, (uint32_t)want - e->w_pages,
                             false) == 0)
                e->w_pages = (uint32_t)want;
            else
                log_warn("model %s: its weights take %" PRIu64 " pages, %u more than its header "
                         "said, and the budget has no more free",
                         e->conf.name, want, (uint32_t)want - e->w_pages);
        }
    }
    e->w_refs++;
    *out = e->w;
    return 0;
}

static void weights_put(struct models *ms, struct models_entry *e)
{
    if (e->w_refs && --e->w_refs == 0) {
        model_free(e->w);
        e->w = NULL;
        mload_uncharge(ms, &e->w_pages);
    }
}

void mload_discard(struct models *ms, struct models_entry *e, struct exec *ex)
{
    exec_free(ex); /* the draft's state with it */
    mload_uncharge(ms, &e->x_pages);
    if (e->holds_draft) {
        e->holds_draft = false;
        weights_put(ms, e->draft);
    }
    weights_put(ms, e);
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
    int rc;
    /* --chat-template is the plain --model's (a [model:NAME] has its file's) */
    const char *tmpl = e->idx == 0 && o->model_path[0] ? o->chat_template_path : NULL;
    if (text_open(e->conf.path, tmpl, &e->text, terr, sizeof terr) != 0)
        return kvd_error_set(err, KVD_EBADREQ, "model %s: %s", e->conf.name, terr);
    struct kvmm_config mc = {
        .be = ms->conf.be,
        .evict_policy = o->evict_policy == OPTIONS_EVICT_LRU ? KVMM_EVICT_LRU : KVMM_EVICT_HITS,
        .device_detached = true,
        .handle_tag = (uint8_t)e->idx,
        .pages = ms->pages,
        .max_device_bytes = mload_kv_cap(ms, e),
        .warm_bytes = options_warm_bytes(o),
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
    if ((rc = kvmm_new(&mc, &e->mm)))
        return kvd_error_set(err, rc,
                             "model %s: cannot create its KV memory manager: %s (blocks of %zu "
                             "bytes, up to %" PRIu64 " bytes of device pages)",
                             e->conf.name, kvd_err_code(rc), bb, mc.max_device_bytes);
    struct kvmm_stats ks;
    kvmm_lock(e->mm);
    kvmm_stats(e->mm, &ks);
    kvmm_unlock(e->mm);
    log_info("model %s: %s, %s, %u layers, embd %u, %u heads (%u kv), vocab %u, context %u, "
             "%.1fM parameters; %.1f MiB of weights and scratch while loaded; KV %s, %zu-byte "
             "blocks, %u per page: up to %u device (%.1f MiB of pages) + %u host",
             e->conf.name, e->conf.path, e->probe.arch, e->probe.n_layer, e->probe.n_embd,
             e->probe.n_head, e->probe.n_head_kv, e->probe.n_vocab, e->probe.n_ctx,
             (double)e->probe.n_params / 1e6, (double)mload_fixed_bytes(ms, e) / (1 << 20),
             kv_dtype_name(dt), bb, ks.blocks_per_page[KVD_TIER_DEVICE], ks.device_total,
             (double)mc.max_device_bytes / (1 << 20), ks.host_total);
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
 * loaded target, its KV pool on the page budget (up to e->draft_kv_bytes)
 * and scratch. */
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
        (rc = draft_kv_open(*out, ms->pages, (size_t)e->draft_kv_bytes, err)) == 0) {
        const struct model_hparams *dh = draft_hparams(*out);
        log_info("%s: %u layers, embd %u, %.1fM parameters%s; KV pages of the budget as "
                 "needed, up to %u blocks of %zu bytes (%.1f MiB, draft-kv-share %.3f)",
                 label, dh->n_layer, dh->n_embd, (double)dh->n_params / 1e6,
                 e->draft ? ", its weights shared" : "", draft_kv_blocks(*out),
                 draft_block_bytes(*out), (double)e->draft_kv_bytes / (1 << 20), o->draft_kv_share);
        return 0;
    }
    draft_free(*out);
    *out = NULL;
    if (e->holds_draft) {
        e->holds_draft = false;
        weights_put(ms, e->draft);
    }
    return rc;
}

/* The estimate of e's scratch made exact: what its executor's (and its
 * draft's) forward contexts took from the backend, now that they exist;
 * the charge follows (as the weights' does), and the next load plans with
 * it. Scratch a backend grows for itself later (cuda's activation and
 * decode-partial buffers, shared by a context's users) is not in it. */
static void scratch_measured(struct models *ms, struct models_entry *e, const struct exec *ex)
{
    uint64_t real = exec_scratch_bytes(ex);
    if (real == 0)
        return; /* the backend cannot tell: the estimate stays */
    if (real != e->scratch_bytes)
        log_info("model %s: forward scratch %.2f MiB as allocated (%.2f MiB estimated)",
                 e->conf.name, (double)real / (1 << 20), (double)e->scratch_bytes / (1 << 20));
    e->scratch_bytes = real;
    uint32_t want = mload_pages_of(ms, mload_extra_bytes(e));
    if (want < e->x_pages) {
        kvpages_give(ms->pages, KVD_TIER_DEVICE, KVPAGES_NONE, e->x_pages - want);
        e->x_pages = want;
    } else if (want > e->x_pages) {
        uint32_t more = want - e->x_pages;
        /* A budget sized from the models' needs (no device-bytes) grows by
         * what the estimate missed: the KV keeps the blocks it was sized
         * for (--device-blocks N holds N blocks). A budget given in bytes
         * does not grow: the models' cached KV gives way instead. */
        if (!ms->opts.device_bytes)
            kvpages_grow(ms->pages, KVD_TIER_DEVICE, more);
        uint32_t free_now = kvpages_free_pages(ms->pages, KVD_TIER_DEVICE);
        if (free_now < more) /* the models' cached KV gives way (to the host tier) */
            kvpages_reclaim(ms->pages, NULL, KVD_TIER_DEVICE, KVPAGES_NONE, more - free_now);
        if (kvpages_take(ms->pages, KVD_TIER_DEVICE, KVPAGES_NONE, more, false) == 0)
            e->x_pages = want;
        else
            log_warn("model %s: its scratch takes %u pages, %u more than estimated, and the "
                     "budget has no more free",
                     e->conf.name, want, more);
    }
}

static void load(struct models *ms, struct mjob *j)
{
    struct models_entry *e = j->e;
    const struct options *o = &ms->opts;
    struct kvd_error le = {0};
    struct draft *draft = NULL;
    int rc = mload_fits(ms, e, &j->need, &j->err);
    if (rc) {
        j->rc = rc;
        j->model = NULL;
        return;
    }
    rc = weights_get(ms, e, &j->model, &j->err);
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
    /* its scratch, its draft's KV, scratch and own weights */
    if ((rc = mload_charge(ms, e, mload_extra_bytes(e), &e->x_pages, "its scratch and draft",
                           &j->err))) {
        j->rc = rc;
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
        .draft = draft,                           /* the executor's from here on */
        .overlap = (enum exec_overlap)o->overlap, /* the same order */
    };
    if ((rc = exec_new(e->mm, j->model, &ec, &j->ex, &le))) {
        j->rc = kvd_error_set(&j->err, rc, "model %s: cannot start its executor: %s", e->conf.name,
                              le.message);
        kvmm_lock(e->mm);
        kvmm_device_detach(e->mm, NULL, NULL);
        kvmm_unlock(e->mm);
        goto fail;
    }
    scratch_measured(ms, e, j->ex);
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
