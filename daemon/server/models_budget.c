/* models_budget: the one device page budget (pages.h) the daemon's models
 * share. Every model's KV pool takes its pages from it as blocks need them
 * and gives them back as they empty; a model's weights, its executor's
 * forward scratch and its draft's scratch and weights are charged to it
 * in whole pages while loaded (models_load.c); a draft's KV is a pool of
 * its own on the budget, its pages taken and given back as the models'
 * are. Here: the budget's size, each model's cap and its draft's KV cap,
 * and the charges. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "draft.h"
#include "log.h"
#include "models_impl.h"
#include "pages.h"

/* Device bytes of a file's weights from its header: the tensors, and the
 * cuda backend's bf16 copy of f16 and q8_0 matrices. */
static uint64_t weight_device_of(const struct models *ms, const struct model_hparams *hp)
{
    uint64_t b = hp->weight_bytes;
    if (ms->conf.be->ops->kind == BACKEND_CUDA && (hp->wtype == CT_F16 || hp->wtype == CT_Q8_0))
        b += 2 * hp->n_params;
    return b;
}

/* Bytes --gpu-mem is a fraction of: the GPU's free memory on cuda,
 * physical memory on cpu. 0 when unknown. */
static size_t device_free(struct backend *be)
{
    size_t free_b = 0, total_b = 0;
    if (!be->ops->mem_info || be->ops->mem_info(be, &free_b, &total_b) != 0)
        return 0;
    return free_b;
}

static size_t block_bytes_of(const struct models *ms, const struct models_entry *e)
{
    const struct options *o = &ms->opts;
    struct kv_geom g = {.layers = e->probe.n_layer,
                        .kv_heads = e->probe.n_head_kv,
                        .head_dim = e->probe.head_dim,
                        .dtype =
                            e->conf.kv_dtype >= 0 ? (enum kv_dtype)e->conf.kv_dtype : o->geom.dtype,
                        .block_tokens = o->geom.block_tokens};
    return kv_geom_check(&g, NULL) == 0 ? kv_block_bytes(&g) : 0;
}

/* The forward scratch of e's executor and of its draft (as exec_new and
 * draft_open size them). */
static uint64_t scratch_of(const struct models *ms, const struct models_entry *e)
{
    const struct options *o = &ms->opts;
    uint32_t out = o->step_seqs;
    if (e->spec_kind != OPTIONS_SPEC_OFF)
        out += o->spec_max_batch * o->spec_max_draft;
    if (out > o->step_tokens)
        out = o->step_tokens;
    uint64_t b = fwd_ctx_bytes(&e->probe, o->step_tokens, o->step_seqs, out);
    if (e->draft_path)
        b += fwd_ctx_bytes(&e->draft_probe, o->step_tokens, o->spec_max_batch, o->spec_max_batch);
    return b;
}

uint64_t mload_extra_bytes(const struct models_entry *e)
{
    uint64_t b = e->scratch_bytes; /* its draft's KV takes pages as a pool does */
    if (e->draft_path && !e->draft)
        b += e->draft_weight_device; /* --draft-model's own file */
    return b;
}

uint64_t mload_fixed_bytes(const struct models *ms, const struct models_entry *e)
{
    (void)ms;
    return e->weight_device + (e->draft ? e->draft_weight_device : 0) + mload_extra_bytes(e);
}

static uint64_t round_up(uint64_t b, uint64_t page)
{
    return (b + page - 1) / page * page;
}

/* The largest divisor of n that is at most m (at least 1). */
static uint64_t divisor_under(uint64_t n, uint64_t m)
{
    for (uint64_t d = m < n ? m : n; d > 1; d--)
        if (n % d == 0)
            return d;
    return 1;
}

/* Without --device-bytes, the KV bytes of e: --device-blocks (or the
 * default) of its blocks, or its share of --gpu-mem. */
static int kv_default(struct models *ms, size_t bb, uint64_t *out, struct kvd_error *err)
{
    const struct options *o = &ms->opts;
    if (!o->device_blocks && o->gpu_mem > 0) {
        size_t mem = device_free(ms->conf.be);
        if (mem == 0)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "--gpu-mem: cannot tell how much device memory there is; use "
                                 "--device-bytes or --device-blocks");
        double b = (double)mem * o->gpu_mem / (double)ms->n;
        if (b < (double)bb)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "--gpu-mem %.3f of %zu bytes is less than one %zu-byte block",
                                 o->gpu_mem, mem, bb);
        *out = (uint64_t)b;
        return 0;
    }
    *out = (uint64_t)(o->device_blocks ? o->device_blocks : OPTIONS_DEFAULT_DEVICE_BLOCKS) * bb;
    return 0;
}

int mload_budget(struct models *ms, struct kvd_error *err)
{
    const struct options *o = &ms->opts;
    struct backend *be = ms->conf.be;
    struct kvd_error le = {0};
    uint64_t kv[OPTIONS_MAX_MODELS + 1] = {0}, kv_sum = 0, host = 0, fixed = 0;
    size_t bb[OPTIONS_MAX_MODELS + 1] = {0};
    int rc;
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        if ((rc = model_probe(e->conf.path, &e->probe, &le)))
            return kvd_error_set(err, rc, "model %s (%s): %s", e->conf.name, e->conf.path,
                                 le.message);
        e->hp = e->probe;
        e->weight_device = weight_device_of(ms, &e->probe);
        if (e->draft_path)
            e->draft_weight_device = weight_device_of(ms, &e->draft_probe);
        e->scratch_bytes = scratch_of(ms, e);
        if ((bb[i] = block_bytes_of(ms, e)) == 0)
            continue; /* mload_prepare names the geometry's fault */
        if (!o->device_bytes && (rc = kv_default(ms, bb[i], &kv[i], err)))
            return rc;
        kv_sum += kv[i];
        host += (uint64_t)(o->host_blocks != UINT32_MAX ? o->host_blocks
                                                        : OPTIONS_DEFAULT_HOST_BLOCKS) *
                bb[i];
    }
    if (o->host_blocks == UINT32_MAX && o->host_mem)
        host = o->host_mem;
    struct kvpages_conf pc = {.page_bytes = {o->page_bytes, o->page_bytes}};
    /* One model whose tiers are given in blocks (and no --page-bytes): pages
     * of whole blocks, so its pool holds exactly that many blocks, as a
     * daemon of one model always had. */
    bool one = ms->n == 1 && bb[0] && !o->page_bytes;
    uint32_t n_dev = o->device_blocks ? o->device_blocks : OPTIONS_DEFAULT_DEVICE_BLOCKS;
    uint32_t n_host = o->host_blocks != UINT32_MAX ? o->host_blocks : OPTIONS_DEFAULT_HOST_BLOCKS;
    if (one && !o->device_bytes && (o->device_blocks || o->gpu_mem <= 0)) {
        uint64_t most = kvpages_default_page(be, KVD_TIER_DEVICE, kv_sum) / bb[0];
        pc.page_bytes[KVD_TIER_DEVICE] = divisor_under(n_dev, most ? most : 1) * bb[0];
        pc.exact[KVD_TIER_DEVICE] = true;
    }
    if (one && n_host && (o->host_blocks != UINT32_MAX || !o->host_mem)) {
        uint64_t most = kvpages_default_page(be, KVD_TIER_HOST, host) / bb[0];
        pc.page_bytes[KVD_TIER_HOST] = divisor_under(n_host, most ? most : 1) * bb[0];
        pc.exact[KVD_TIER_HOST] = true;
    }
    /* The page is settled here, before the weights join the bytes, so
     * that they are counted in the pages they will be charged in. */
    uint64_t page = pc.page_bytes[KVD_TIER_DEVICE];
    size_t gran = be->ops->arena_granularity ? be->ops->arena_granularity(be, KVD_TIER_DEVICE) : 0;
    if (!page)
        page = kvpages_default_page(be, KVD_TIER_DEVICE,
                                    o->device_bytes ? o->device_bytes : kv_sum + 1);
    else if (!pc.exact[KVD_TIER_DEVICE] && gran)
        page = (page + gran - 1) / gran * gran;
    pc.page_bytes[KVD_TIER_DEVICE] = page;
    /* The drafts' KV caps: draft-kv-share of the KV the model could have
     * (its cap, or its KV share of the budget, less its weights and
     * scratch). Nothing is set aside for them: a draft's pages come out
     * of the budget's KV pages as its blocks need them. */
    for (size_t i = 0; i < ms->n; i++) {
        struct models_entry *e = &ms->v[i];
        if (!bb[i])
            continue;
        uint64_t base = mload_fixed_bytes(ms, e);
        uint64_t cap = e->conf.max_device_bytes ? e->conf.max_device_bytes : o->device_bytes;
        uint64_t room = 0;
        if (cap) {
            if (cap <= base + bb[i])
                return kvd_error_set(err, KVD_EBADREQ,
                                     "model %s: its share of the device (%" PRIu64
                                     " bytes: max-device-bytes, or device-bytes) does not hold "
                                     "its %" PRIu64 " bytes of weights and scratch%s and a "
                                     "%zu-byte KV block",
                                     e->conf.name, cap, base,
                                     e->draft_path ? " (its draft's included)" : "", bb[i]);
            room = cap - base;
        } else {
            room = kv[i];
        }
        if (e->draft_path) {
            struct kv_geom dg = {.layers = e->draft_probe.n_layer,
                                 .kv_heads = e->draft_probe.n_head_kv,
                                 .head_dim = e->draft_probe.head_dim,
                                 .dtype = (enum kv_dtype)e->draft_dtype,
                                 .block_tokens = o->geom.block_tokens};
            char label[OPTIONS_MODEL_NAME * 2 + 64];
            snprintf(label, sizeof label, "model %s's draft", e->conf.name);
            if (kv_geom_check(&dg, &le))
                return kvd_error_set(err, KVD_EBADREQ, "%s's KV: %s", label, le.message);
            uint64_t dbytes = (uint64_t)((double)room * o->draft_kv_share);
            if (dbytes < kv_block_bytes(&dg))
                return kvd_error_set(err, KVD_EBADREQ,
                                     "%s: its KV cap (%" PRIu64 " bytes, draft-kv-share %.3f "
                                     "of model %s's KV) is less than one %zu-byte block",
                                     label, dbytes, o->draft_kv_share, e->conf.name,
                                     kv_block_bytes(&dg));
            /* A cap on the pages the draft's pool takes from the budget
             * as its blocks need them (the model's pool takes from the
             * same pages): at least one page that holds a block. */
            uint64_t least = round_up(kv_block_bytes(&dg), page);
            e->draft_kv_bytes = dbytes > least ? dbytes : least;
            /* A budget sized here (no --device-bytes) holds the models'
             * KV and, per draft, that first page more: where the model's
             * KV is a page or two (a small budget cut into whole-block
             * pages), its pool would otherwise leave the draft none. */
            if (!o->device_bytes)
                kv_sum += least;
        }
        /* weights counted once: a named draft's are its own model's */
        fixed += round_up(e->weight_device, page) + round_up(mload_extra_bytes(e), page);
    }
    pc.bytes[KVD_TIER_DEVICE] = o->device_bytes ? o->device_bytes : kv_sum + fixed;
    pc.bytes[KVD_TIER_HOST] = host;
    if ((rc = kvpages_new(be, &pc, &ms->pages, &le)))
        return kvd_error_set(err, rc, "the page budget: %s", le.message);
    uint64_t pb = kvpages_page_bytes(ms->pages, KVD_TIER_DEVICE);
    log_info("page budget: device %u pages of %" PRIu64 " bytes (%.1f MiB%s), host %u of %" PRIu64
             " bytes: every model's weights, scratch and KV",
             kvpages_total(ms->pages, KVD_TIER_DEVICE), pb,
             (double)kvpages_total(ms->pages, KVD_TIER_DEVICE) * (double)pb / (1 << 20),
             o->device_bytes ? ", device-bytes" : ": the models' weights and scratch + their KV",
             kvpages_total(ms->pages, KVD_TIER_HOST), kvpages_page_bytes(ms->pages, KVD_TIER_HOST));
    return 0;
}

uint64_t mload_kv_cap(const struct models *ms, const struct models_entry *e)
{
    uint64_t pb = kvpages_page_bytes(ms->pages, KVD_TIER_DEVICE);
    uint64_t total = (uint64_t)kvpages_total(ms->pages, KVD_TIER_DEVICE) * pb;
    uint64_t cap = e->conf.max_device_bytes ? e->conf.max_device_bytes : total;
    if (cap > total)
        cap = total;
    uint64_t fixed = round_up(mload_fixed_bytes(ms, e), pb);
    return cap > fixed ? cap - fixed : 0;
}

/* ---- charges ------------------------------------------------------------ */

int mload_charge(struct models *ms, const struct models_entry *e, uint64_t bytes, uint32_t *pages,
                 const char *what, struct kvd_error *err)
{
    struct kvpages *pg = ms->pages;
    uint64_t pb = kvpages_page_bytes(pg, KVD_TIER_DEVICE);
    uint64_t n = (bytes + pb - 1) / pb;
    uint32_t total = kvpages_total(pg, KVD_TIER_DEVICE);
    *pages = 0;
    if (n == 0)
        return 0;
    if (n > total)
        return kvd_error_set(err, KVD_ENOMEM,
                             "model %s: %s need %" PRIu64 " bytes, more than the device budget "
                             "(%u pages of %" PRIu64 " bytes)",
                             e->conf.name, what, bytes, total, pb);
    if (kvpages_take(pg, KVD_TIER_DEVICE, KVPAGES_NONE, (uint32_t)n, false) != 0) {
        /* the models' KV pools give back pages of cache (to the host tier) */
        uint32_t free_now = kvpages_free_pages(pg, KVD_TIER_DEVICE);
        if (free_now < n)
            kvpages_reclaim(pg, NULL, KVD_TIER_DEVICE, KVPAGES_NONE, (uint32_t)n - free_now);
        if (kvpages_take(pg, KVD_TIER_DEVICE, KVPAGES_NONE, (uint32_t)n, false) != 0)
            return kvd_error_set(err, KVD_ENOMEM,
                                 "model %s: %s need %" PRIu64 " pages of %" PRIu64
                                 " bytes of the device budget; %u are free once the models "
                                 "gave back their cached KV",
                                 e->conf.name, what, n, pb,
                                 kvpages_free_pages(pg, KVD_TIER_DEVICE));
    }
    *pages = (uint32_t)n;
    return 0;
}

void mload_uncharge(struct models *ms, uint32_t *pages)
{
    if (*pages)
        kvpages_give(ms->pages, KVD_TIER_DEVICE, KVPAGES_NONE, *pages);
    *pages = 0;
}

uint32_t mload_pages_of(const struct models *ms, uint64_t bytes)
{
    uint64_t pb = kvpages_page_bytes(ms->pages, KVD_TIER_DEVICE);
    uint64_t n = (bytes + pb - 1) / pb;
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

int mload_fits(struct models *ms, const struct models_entry *e, uint32_t *need,
               struct kvd_error *err)
{
    const struct options *o = &ms->opts;
    struct kvpages *pg = ms->pages;
    /* a step's KV, within what its pool may hold */
    uint64_t blocks = (o->step_tokens + o->geom.block_tokens - 1) / o->geom.block_tokens;
    uint64_t kv = blocks * kvmm_block_bytes(e->mm), cap = mload_kv_cap(ms, e);
    uint64_t n = (uint64_t)mload_pages_of(ms, kv < cap ? kv : cap) +
                 mload_pages_of(ms, mload_extra_bytes(e));
    if (!e->w)
        n += mload_pages_of(ms, e->weight_device);
    if (e->draft && !e->draft->w)
        n += mload_pages_of(ms, e->draft->weight_device);
    *need = n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
    uint32_t free_now = kvpages_free_pages(pg, KVD_TIER_DEVICE);
    if (free_now < *need) /* cached KV of the other models goes to their host tiers */
        free_now = kvpages_reclaim(pg, NULL, KVD_TIER_DEVICE, KVPAGES_NONE, *need - free_now);
    if (free_now < *need)
        return kvd_error_set(err, KVD_ENOMEM,
                             "model %s needs %u pages of %" PRIu64 " bytes of the device budget "
                             "(weights, scratch and a step's KV); %u are free once the loaded "
                             "models gave back their cached KV",
                             e->conf.name, *need, kvpages_page_bytes(pg, KVD_TIER_DEVICE),
                             free_now);
    return 0;
}

/* ---- reading ------------------------------------------------------------ */

void models_device_use(struct models *ms, uint64_t *used, uint64_t *budget)
{
    *used = *budget = 0;
    if (!ms || !ms->pages)
        return;
    struct kvpages_stats st;
    kvpages_stats(ms->pages, &st);
    *budget = (uint64_t)st.pages[KVD_TIER_DEVICE] * st.page_bytes[KVD_TIER_DEVICE];
    *used = (uint64_t)st.used[KVD_TIER_DEVICE] * st.page_bytes[KVD_TIER_DEVICE];
}

struct kvpages *models_pages(struct models *ms)
{
    return ms ? ms->pages : NULL;
}
