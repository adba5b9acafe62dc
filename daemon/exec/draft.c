/* The draft model (see draft.h): loading with the vocabulary check, its own
 * kvmm and forward scratch, and the batched greedy drafting of each step.
 * A request's draft sequence holds the draft's K/V of a prefix of the
 * request's tokens (and of drafts it proposed); before drafting it is cut
 * back to what it shares with the request's tokens now, so K/V of rejected
 * drafts is dropped the same way the target drops its own (truncation). */
#include "draft.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "kvd/protocol.h"
#include "kvmm.h"
#include "log.h"
#include "pages.h"
#include "spec.h"

#define DRAFT_MAX_JOBS 64 /* requests drafting in one step, at most */

struct draft_seq {
    uint64_t owner;
    kvmm_seq_t seq;
    uint32_t ns;
    bool used; /* by this call of draft_propose */
};

struct draft {
    struct draft_conf conf; /* its paths not kept */
    struct model *m;        /* owned when own_m; else another model's, borrowed */
    bool own_m;
    struct kvmm *mm;            /* owned: the draft's KV */
    struct fwd_ctx *fc;         /* owned */
    uint32_t tenant;            /* the draft kvmm's one tenant */
    uint32_t n_blocks, n_slots; /* the most blocks; the arena's slot indices */
    uint32_t step_tokens, max_seqs;
    struct draft_seq *seqs; /* [n_seqs], cap_seqs */
    uint32_t n_seqs, cap_seqs;
    /* one forward's scratch, [max_seqs] each */
    struct fwd_seq *fseqs;
    struct sample_row *rows;
    uint32_t *picks;
    uint32_t *slots; /* [cap_slots] block tables of the step, concatenated */
    size_t cap_slots;
    uint32_t *job_of;      /* [max_seqs] the job of each batch entry */
    struct draft_stats st; /* under the draft kvmm's lock */
    uint32_t *at;          /* [max_seqs] where the entry's chunk starts in its job's sequence */
};

/* ---- loading -------------------------------------------------------------- */

/* A label for errors: the caller's, or "--draft-model PATH". */
static const char *label_of(const char *label, const char *path, char *buf, size_t cap)
{
    if (label)
        return label;
    snprintf(buf, cap, "--draft-model %s", path);
    return buf;
}

int draft_check_vocab(const char *target_path, uint32_t target_vocab, const char *draft_path,
                      uint32_t draft_vocab, const char *label, struct kvd_error *err)
{
    char lb[4200];
    label = label_of(label, draft_path, lb, sizeof lb);
    if (draft_vocab != target_vocab)
        return kvd_error_set(err, KVD_EBADREQ,
                             "%s: its vocabulary has %u tokens, the served model's %u: "
                             "a draft must share the served model's vocabulary",
                             label, draft_vocab, target_vocab);
    struct gguf *a = NULL, *b = NULL;
    char msg[256];
    int rc = 0;
    if (gguf_open(target_path, &a, msg, sizeof msg) || gguf_open(draft_path, &b, msg, sizeof msg)) {
        rc = kvd_error_set(err, KVD_EBADREQ, "%s: %s", label, msg);
        goto out;
    }
    const struct gguf_kv *ta = gguf_find_kv(a, "tokenizer.ggml.tokens");
    const struct gguf_kv *tb = gguf_find_kv(b, "tokenizer.ggml.tokens");
    if (!ta && !tb)
        goto out; /* token-only models: the counts matched */
    if (!ta || !tb || ta->type != GGUF_ARRAY || tb->type != GGUF_ARRAY) {
        rc = kvd_error_set(err, KVD_EBADREQ,
                           "%s: %s has tokenizer.ggml.tokens and the other does not, "
                           "so the vocabularies cannot be compared",
                           label, ta ? "the served model" : "the draft");
        goto out;
    }
    if (ta->arr_type != tb->arr_type || ta->arr_count != tb->arr_count ||
        ta->arr_bytes != tb->arr_bytes || memcmp(ta->arr_data, tb->arr_data, ta->arr_bytes)) {
        /* name the first token that differs (strings: u64 length, bytes) */
        const uint8_t *pa = ta->arr_data, *pb = tb->arr_data;
        const uint8_t *ea = pa + ta->arr_bytes, *eb = pb + tb->arr_bytes;
        uint64_t i = 0;
        for (; i < ta->arr_count && i < tb->arr_count && pa + 8 <= ea && pb + 8 <= eb; i++) {
            uint64_t la, lb_;
            memcpy(&la, pa, 8);
            memcpy(&lb_, pb, 8);
            if (la != lb_ || la > (uint64_t)(ea - pa - 8) || lb_ > (uint64_t)(eb - pb - 8) ||
                memcmp(pa + 8, pb + 8, la))
                break;
            pa += 8 + la;
            pb += 8 + lb_;
        }
        rc = kvd_error_set(err, KVD_EBADREQ,
                           "%s: its vocabulary differs from the served model's at "
                           "token %llu: a draft must share the served model's vocabulary",
                           label, (unsigned long long)i);
    }
out:
    gguf_close(a);
    gguf_close(b);
    return rc;
}

int draft_open(const struct draft_conf *c, struct draft **out, struct kvd_error *err)
{
    static const char nomem[] = "out of memory loading the draft model";
    struct draft *d = calloc(1, sizeof *d);
    int rc;
    *out = NULL;
    if (!d)
        return kvd_error_set(err, KVD_ENOMEM, "%s", nomem);
    d->step_tokens = c->step_tokens;
    d->max_seqs = c->max_seqs ? c->max_seqs : 1;
    if (d->max_seqs > DRAFT_MAX_JOBS)
        d->max_seqs = DRAFT_MAX_JOBS;
    if (d->step_tokens < d->max_seqs)
        d->step_tokens = d->max_seqs;
    char lb[4200];
    const char *label = label_of(c->label, c->path, lb, sizeof lb);
    if (c->weights) {
        d->m = c->weights;
    } else {
        struct model_opts mo = {.n_threads = c->n_threads};
        if ((rc = model_load_opts(c->path, c->be, &mo, &d->m, err))) {
            char m[KVD_ERROR_MSG_MAX];
            snprintf(m, sizeof m, "%s", err ? err->message : "");
            kvd_error_set(err, rc, "%s: %s", label, m);
            goto fail;
        }
        d->own_m = true;
    }
    if ((rc = draft_check_vocab(c->target_path, c->target->n_vocab, c->path,
                                model_hparams(d->m)->n_vocab, label, err)))
        goto fail;
    d->conf = *c;
    d->conf.path = d->conf.target_path = d->conf.label = NULL;
    d->conf.weights = NULL;
    d->conf.target = NULL;
    struct kv_geom g;
    model_kv_geom(d->m, c->block_tokens, c->dtype, &g);
    if ((rc = kv_geom_check(&g, err)))
        goto fail;
    *out = d;
    return 0;
fail:
    draft_free(d);
    return rc;
}

size_t draft_block_bytes(const struct draft *d)
{
    struct kv_geom g;
    model_kv_geom(d->m, d->conf.block_tokens, d->conf.dtype, &g);
    return kv_block_bytes(&g);
}

int draft_kv_open(struct draft *d, struct kvpages *pages, size_t kv_bytes, struct kvd_error *err)
{
    static const char nomem[] = "out of memory for the draft model's KV";
    int rc;
    struct kvmm_config kc = {.be = d->conf.be,
                             .pages = pages,
                             .max_device_bytes = kv_bytes,
                             .no_host = true,
                             .unshared = true};
    model_kv_geom(d->m, d->conf.block_tokens, d->conf.dtype, &kc.geom);
    size_t bb = kv_block_bytes(&kc.geom);
    if (!pages) {
        uint64_t nb = kv_bytes / bb;
        if (nb < 1)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "the draft model: its KV share (%zu bytes) is less than one "
                                 "%zu-byte block",
                                 kv_bytes, bb);
        kc.n_device_blocks = nb > UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)nb;
    }
    memcpy(kc.fingerprint, model_hparams(d->m)->fingerprint, sizeof kc.fingerprint);
    if ((rc = kvmm_new(&kc, &d->mm))) {
        if (pages)
            return kvd_error_set(err, rc,
                                 "the draft model: cannot create its KV memory (%zu-byte blocks "
                                 "in pages of %" PRIu64 " bytes, up to %zu bytes of them)",
                                 bb, kvpages_page_bytes(pages, KVD_TIER_DEVICE), kv_bytes);
        return kvd_error_set(
            err, rc, "the draft model: cannot create its KV memory (%u blocks of %zu bytes)",
            kc.n_device_blocks, bb);
    }
    struct kvmm_stats ks;
    kvmm_lock(d->mm);
    kvmm_stats(d->mm, &ks);
    kvmm_unlock(d->mm);
    d->n_blocks = ks.device_total;
    d->n_slots = kvmm_device_slots(d->mm);
    struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1};
    snprintf(tc.name, sizeof tc.name, "%s", DRAFT_TENANT);
    kvmm_lock(d->mm);
    rc = kvmm_tenant_set(d->mm, &tc, &d->tenant);
    kvmm_unlock(d->mm);
    if (rc)
        return kvd_error_set(err, rc, "%s", nomem);
    if ((rc = fwd_ctx_new(d->m, d->step_tokens, d->max_seqs, &d->fc)))
        return kvd_error_set(err, rc,
                             "the draft model: cannot size its forward scratch (%u tokens)",
                             d->step_tokens);
    d->fseqs = calloc(d->max_seqs, sizeof *d->fseqs);
    d->rows = calloc(d->max_seqs, sizeof *d->rows);
    d->picks = calloc(d->max_seqs, sizeof *d->picks);
    d->job_of = calloc(d->max_seqs, sizeof *d->job_of);
    d->at = calloc(d->max_seqs, sizeof *d->at);
    if (!d->fseqs || !d->rows || !d->picks || !d->job_of || !d->at)
        return kvd_error_set(err, KVD_ENOMEM, "%s", nomem);
    return 0;
}

void draft_free(struct draft *d)
{
    if (!d)
        return;
    if (d->mm) {
        kvmm_lock(d->mm);
        for (uint32_t i = 0; i < d->n_seqs; i++)
            kvmm_seq_close(d->mm, d->seqs[i].owner, d->seqs[i].seq);
        kvmm_unlock(d->mm);
    }
    fwd_ctx_free(d->fc);
    kvmm_free(d->mm);
    if (d->own_m)
        model_free(d->m);
    free(d->seqs);
    free(d->fseqs);
    free(d->rows);
    free(d->picks);
    free(d->slots);
    free(d->job_of);
    free(d->at);
    free(d);
}

const struct model_hparams *draft_hparams(const struct draft *d)
{
    return model_hparams(d->m);
}

size_t draft_scratch_bytes(const struct draft *d)
{
    return fwd_ctx_dev_bytes(d->fc);
}

uint32_t draft_kv_blocks(const struct draft *d)
{
    return d->n_blocks;
}

uint64_t draft_kv_device_bytes(struct draft *d)
{
    if (!d->mm)
        return 0;
    kvmm_lock(d->mm);
    uint64_t b = kvmm_device_bytes(d->mm);
    kvmm_unlock(d->mm);
    return b;
}

/* ---- sequences (draft kvmm lock held) --------------------------------------- */

static struct draft_seq *seq_find(struct draft *d, uint64_t owner)
{
    for (uint32_t i = 0; i < d->n_seqs; i++)
        if (d->seqs[i].owner == owner)
            return &d->seqs[i];
    return NULL;
}

static void seq_drop(struct draft *d, struct draft_seq *s)
{
    kvmm_seq_close(d->mm, s->owner, s->seq);
    *s = d->seqs[--d->n_seqs];
}

/* The job's draft sequence, opened (and matched against the draft cache)
 * on first use. */
static struct draft_seq *seq_get(struct draft *d, const struct draft_job *j)
{
    struct draft_seq *s = seq_find(d, j->owner);
    if (s)
        return s;
    if (d->n_seqs == d->cap_seqs) {
        uint32_t cap = d->cap_seqs ? 2 * d->cap_seqs : 8;
        struct draft_seq *p = realloc(d->seqs, cap * sizeof *p);
        if (!p)
            return NULL;
        d->seqs = p;
        d->cap_seqs = cap;
    }
    /* the tenant's namespace by its name, as the target's own
     * ("tenant:<name>"): a later tenant that reuses a removed one's id has
     * another name, so it never matches what that one cached */
    char name[8 + KVD_MAX_NAME + 1];
    uint32_t ns;
    snprintf(name, sizeof name, "tenant:%s", j->tenant ? j->tenant : "");
    s = &d->seqs[d->n_seqs];
    if (!j->tenant || !j->tenant[0] || kvmm_namespace(d->mm, name, &ns) ||
        kvmm_seq_open(d->mm, j->owner, d->tenant, ns, &s->seq))
        return NULL;
    s->owner = j->owner;
    s->ns = ns;
    s->used = false;
    d->n_seqs++;
    size_t matched = 0;
    if (j->n_toks > 1 &&
        kvmm_seq_match(d->mm, s->owner, s->seq, j->toks, j->n_toks - 1, &matched) == 0)
        d->st.matched += matched;
    return s;
}

/* Cuts the draft sequence back to the longest prefix it shares with the
 * job's tokens, and below the last token (which the draft computes to
 * propose the first draft). Returns the positions kept, or -1. */
static long seq_sync(struct draft *d, struct draft_seq *s, const struct draft_job *j)
{
    struct kvmm_seq_info info;
    size_t n_c = 0;
    if (kvmm_seq_info(d->mm, s->owner, s->seq, &info))
        return -1;
    const uint32_t *have = kvmm_seq_tokens(d->mm, s->owner, s->seq, &n_c);
    size_t keep = 0, lim = j->n_toks - 1;
    while (keep < n_c && keep < lim && have[keep] == j->toks[keep])
        keep++;
    if (info.n_tokens > keep && kvmm_seq_truncate(d->mm, s->owner, s->seq, info.n_tokens - keep))
        return -1;
    return (long)keep;
}

/* ---- drafting ---------------------------------------------------------------- */

/* Token i of job j's sequence: its tokens, then its drafts so far. */
static uint32_t job_tok(const struct draft_job *j, size_t i)
{
    return i < j->n_toks ? j->toks[i] : j->out[i - j->n_toks];
}

/* One batched forward: every unfinished job's next chunk (catch-up up to
 * its end, or its last draft), within the step budget. kv[i]: job i's
 * positions with draft K/V. Returns the entries run (0: none could). */
static uint32_t run_step(struct draft *d, struct draft_job *jobs, uint32_t n, size_t *kv,
                         uint32_t *scratch, bool *dead)
{
    uint32_t ne = 0, budget = d->step_tokens, bt = kvmm_geom(d->mm)->block_tokens;
    size_t at = 0;
    uint32_t n_ctx = model_hparams(d->m)->n_ctx;
    kvmm_lock(d->mm);
    for (uint32_t i = 0; i < n && ne < d->max_seqs && budget > 0; i++) {
        struct draft_job *j = &jobs[i];
        if (dead[i] || j->n_out >= j->k)
            continue;
        size_t end = j->n_toks + j->n_out; /* the sequence so far */
        if (end >= n_ctx) {
            dead[i] = true;
            continue;
        }
        size_t len = end - kv[i];
        if (len > budget)
            len = budget;
        struct draft_seq *s = seq_find(d, j->owner);
        size_t want = (kv[i] + len + bt - 1) / bt, got = 0;
        if (at + want > d->cap_slots) {
            size_t cap = (at + want) * 2;
            uint32_t *p = realloc(d->slots, cap * sizeof *p);
            if (!p) {
                dead[i] = true;
                continue;
            }
            d->slots = p;
            d->cap_slots = cap;
        }
        if (!s || kvmm_seq_extend(d->mm, s->owner, s->seq, len)) {
            dead[i] = true;
            continue;
        }
        if (kvmm_seq_prepare_write(d->mm, s->owner, s->seq, kv[i], len) ||
            kvmm_seq_device_slots(d->mm, s->owner, s->seq, d->slots + at, want, &got) ||
            got != want) {
            kvmm_seq_truncate(d->mm, s->owner, s->seq, len);
            dead[i] = true;
            continue;
        }
        for (size_t t = 0; t < len; t++)
            scratch[(size_t)ne * d->step_tokens + t] = job_tok(j, kv[i] + t);
        d->fseqs[ne] = (struct fwd_seq){.tokens = scratch + (size_t)ne * d->step_tokens,
                                        .n_tokens = (uint32_t)len,
                                        .pos0 = (uint32_t)kv[i],
                                        .n_slots = (uint32_t)want};
        d->at[ne] = (uint32_t)at;
        d->rows[ne] = (struct sample_row){.skip = kv[i] + len != end};
        d->job_of[ne++] = i;
        at += want;
        budget -= (uint32_t)len;
    }
    kvmm_unlock(d->mm);
    if (ne == 0)
        return 0;
    for (uint32_t e = 0; e < ne; e++)
        d->fseqs[e].slots = d->slots + d->at[e];
    struct fwd_batch b = {.seqs = d->fseqs,
                          .n_seqs = ne,
                          .kv_arena = kvmm_device_arena(d->mm),
                          .geom = kvmm_geom(d->mm),
                          .n_arena_slots = d->n_slots,
                          .sample = d->rows,
                          .tokens = d->picks};
    int rc = model_forward(d->m, d->fc, &b);
    kvmm_lock(d->mm);
    for (uint32_t e = 0; e < ne; e++) {
        uint32_t i = d->job_of[e];
        struct draft_job *j = &jobs[i];
        struct draft_seq *s = seq_find(d, j->owner);
        const struct fwd_seq *f = &d->fseqs[e];
        size_t shared;
        if (rc || !s || kvmm_seq_commit(d->mm, s->owner, s->seq, f->tokens, f->n_tokens, &shared)) {
            if (s)
                kvmm_seq_truncate(d->mm, s->owner, s->seq, f->n_tokens);
            dead[i] = true;
            continue;
        }
        kv[i] += f->n_tokens;
        j->n_fwd += f->n_tokens;
        d->st.computed += f->n_tokens;
        if (!d->rows[e].skip)
            j->out[j->n_out++] = d->picks[e];
    }
    kvmm_unlock(d->mm);
    if (rc)
        log_warn("draft model: forward failed: %s", fwd_ctx_errmsg(d->fc));
    return ne;
}

uint32_t draft_propose(struct draft *d, struct draft_job *jobs, uint32_t n)
{
    size_t kv[DRAFT_MAX_JOBS];
    bool dead[DRAFT_MAX_JOBS];
    if (!d->mm) {
        for (uint32_t i = 0; i < n; i++)
            jobs[i].n_out = jobs[i].n_fwd = 0;
        return 0;
    }
    if (n > d->max_seqs)
        n = d->max_seqs;
    uint32_t *scratch = malloc((size_t)d->max_seqs * d->step_tokens * sizeof *scratch);
    kvmm_lock(d->mm);
    for (uint32_t i = 0; i < d->n_seqs; i++)
        d->seqs[i].used = false;
    for (uint32_t i = 0; i < n; i++) {
        struct draft_job *j = &jobs[i];
        j->n_out = 0;
        j->n_fwd = 0;
        dead[i] = !scratch || j->k == 0 || j->n_toks == 0;
        if (dead[i])
            continue;
        struct draft_seq *s = seq_get(d, j);
        long keep = s ? seq_sync(d, s, j) : -1;
        dead[i] = keep < 0;
        kv[i] = keep < 0 ? 0 : (size_t)keep;
        if (s)
            s->used = true;
    }
    /* Sequences of requests that no longer draft hold memory the ones that
     * do need: dropped when the arena is more than half full. */
    struct kvmm_stats st;
    kvmm_stats(d->mm, &st);
    if (st.device_used > st.device_total / 2)
        for (uint32_t i = d->n_seqs; i-- > 0;)
            if (!d->seqs[i].used)
                seq_drop(d, &d->seqs[i]);
    kvmm_unlock(d->mm);
    /* at most (catch-up chunks) + k forwards; each makes progress */
    uint32_t proposing = 0;
    for (uint32_t guard = 0; guard < 4096; guard++) {
        uint32_t before = 0, after = 0;
        for (uint32_t i = 0; i < n; i++)
            before += jobs[i].n_out;
        if (!run_step(d, jobs, n, kv, scratch, dead))
            break;
        for (uint32_t i = 0; i < n; i++)
            after += jobs[i].n_out;
        proposing += after > before;
    }
    free(scratch);
    return proposing;
}

void draft_release(struct draft *d, uint64_t owner)
{
    kvmm_lock(d->mm);
    struct draft_seq *s = seq_find(d, owner);
    if (s)
        seq_drop(d, s);
    kvmm_unlock(d->mm);
}

void draft_stats(struct draft *d, struct draft_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!d->mm)
        return;
    kvmm_lock(d->mm);
    *out = d->st;
    kvmm_unlock(d->mm);
}
