/* prep (see prep.h): lending a connection's sequence to a request, setting
 * its prompt tokens, and rendering/tokenizing a text or chat prompt. */
#include "prep.h"

#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "json_schema.h"

struct sched_constraint *sched_constraint_new(enum sched_constraint_kind kind, const char *param,
                                              const char *text, size_t len, json_t *schema)
{
    struct sched_constraint *c = fault_malloc(sizeof(*c) + len + 1);
    if (!c) {
        json_decref(schema);
        return NULL;
    }
    memset(c, 0, sizeof(*c));
    c->kind = kind;
    snprintf(c->param, sizeof c->param, "%s", param);
    c->schema = schema;
    c->len = len;
    if (len)
        memcpy(c->text, text, len);
    c->text[len] = '\0';
    return c;
}

void sched_constraint_free(struct sched_constraint *c)
{
    if (!c)
        return;
    json_decref(c->schema);
    free(c);
}

int sched_constraint_compile(const struct sched_constraint *c, struct grammar **out,
                             struct kvd_error *e)
{
    *out = NULL;
    switch (c->kind) {
    case SCHED_GBNF:
        return grammar_compile(c->text, c->len, out, e);
    case SCHED_JSON_OBJECT:
        return json_object_grammar(out, e);
    case SCHED_SCHEMA:
        return json_schema_grammar(c->schema, c->param, out, e);
    case SCHED_SCHEMA_TEXT:
        break;
    }
    json_error_t je;
    json_t *s = json_loadb(c->text, c->len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
    if (!s) {
        kvd_error_set(e, KVD_EBADREQ, "'%s' is not valid JSON: %s (at byte %d)", c->param, je.text,
                      je.position);
        return kvd_error_param(e, c->param);
    }
    int rc = json_schema_grammar(s, c->param, out, e);
    json_decref(s);
    return rc;
}

int sched_req_set_grammar(const struct text *tx, struct sched_req *r, struct grammar *g,
                          struct kvd_error *e)
{
    const struct grammar_vocab *gv = text_grammar_vocab(tx);
    if (!gv) {
        grammar_free(g);
        kvd_error_set(e, KVD_EUNSUPPORTED, "grammars need the model's tokenizer: %s",
                      text_no_tokenizer(tx));
        return kvd_error_param(e, "grammar");
    }
    grammar_free(r->grammar);
    r->grammar = g; /* the leader's: its followers' matchers share it */
    uint32_t n = r->group ? r->group->n : 1;
    for (uint32_t i = 0; i < n; i++) {
        struct sched_req *c = r->group ? r->group->reqs[i] : r;
        grammar_matcher_free(c->gm);
        c->gm = NULL;
        int rc = grammar_matcher_new(g, gv, &c->gm, e);
        if (rc)
            return rc;
    }
    return 0;
}

struct sched_prompt *sched_prompt_text(const char *param, const char *s, size_t len, int add_bos)
{
    struct sched_prompt *p = fault_malloc(sizeof(*p) + len + 1);
    if (!p)
        return NULL;
    memset(p, 0, sizeof(*p));
    char *t = (char *)(p + 1);
    if (len)
        memcpy(t, s, len);
    t[len] = '\0';
    p->text = t;
    p->len = len;
    p->add_bos = add_bos;
    snprintf(p->param, sizeof(p->param), "%s", param);
    return p;
}

struct sched_prompt *sched_prompt_chat(const char *param, const struct chat_msg *msgs, size_t n,
                                       bool replace)
{
    size_t bytes = sizeof(struct sched_prompt) + n * sizeof(struct chat_msg);
    for (size_t i = 0; i < n; i++)
        bytes += strlen(msgs[i].role) + strlen(msgs[i].content) + 2;
    struct sched_prompt *p = fault_malloc(bytes);
    if (!p)
        return NULL;
    memset(p, 0, sizeof(*p));
    p->chat = true;
    p->replace = replace;
    p->msgs = (struct chat_msg *)(p + 1);
    p->n_msgs = n;
    char *at = (char *)(p->msgs + n);
    for (size_t i = 0; i < n; i++) {
        size_t lr = strlen(msgs[i].role) + 1, lc = strlen(msgs[i].content) + 1;
        memcpy(at, msgs[i].role, lr);
        p->msgs[i].role = at;
        at += lr;
        memcpy(at, msgs[i].content, lc);
        p->msgs[i].content = at;
        at += lc;
    }
    snprintf(p->param, sizeof(p->param), "%s", param);
    return p;
}

int sched_req_lend_seq(struct kvmm *mm, struct sched_req *r, uint64_t seq, size_t *n_tokens,
                       struct kvd_error *e)
{
    struct kvmm_seq_info info;
    int rc = kvmm_seq_info(mm, r->conn, seq, &info);
    if (rc == KVD_EBUSY) /* another generate of this connection has it */
        rc = kvd_error_set(e, KVD_EBUSY, "'seq': %s", kvmm_errmsg(mm));
    else if (rc != 0) /* not_found, like every other op given an unknown handle */
        rc = kvd_error_set(e, rc, "'seq': no sequence %llu on this connection",
                           (unsigned long long)seq);
    else if (info.n_committed != info.n_tokens)
        rc = kvd_error_set(e, KVD_EBADREQ,
                           "'seq': %zu of its %zu positions have no token ids; commit them first",
                           info.n_tokens - info.n_committed, info.n_tokens);
    else if ((rc = kvmm_seq_lend(mm, r->conn, seq, sched_req_owner(r), r->id)) != 0)
        rc = kvd_error_set(e, rc, "'seq': %s", kvmm_errmsg(mm));
    if (rc)
        return kvd_error_param(e, "seq");
    r->seq = seq;
    r->have_seq = true;
    r->conn_seq = true;
    r->ns = info.ns;
    *n_tokens = info.n_tokens;
    return 0;
}

/* The prompt after a lent sequence's tokens (see prep.h). */
static int set_after_seq(struct kvmm *mm, struct sched_req *r, const uint32_t *prompt,
                         size_t n_prompt, bool replace, const char *param, struct kvd_error *e)
{
    uint64_t owner = sched_req_owner(r);
    size_t n = 0;
    const uint32_t *toks = kvmm_seq_tokens(mm, owner, r->seq, &n);
    if (n && !toks)
        return kvd_error_set(e, KVD_EINTERNAL, "'seq': cannot read its tokens");
    size_t keep = n, skip = 0; /* the sequence's tokens that stay; prompt tokens it has */
    if (replace) {
        keep = 0;
        while (keep < n && keep < n_prompt && toks[keep] == prompt[keep])
            keep++;
        skip = keep;
    }
    size_t n_append = n_prompt - skip;
    if (keep + n_append == 0)
        return kvd_error_set(e, KVD_EBADREQ, "the prompt is empty, and 'seq' holds no tokens");
    if (keep + n_append >= r->n_ctx) {
        kvd_error_set(e, KVD_EBADREQ,
                      "the prompt's %zu tokens with the sequence's %zu exceed the model's "
                      "context (%u, at most %u)",
                      n_append, keep, r->n_ctx, r->n_ctx - 1);
        return kvd_error_param(e, param);
    }
    size_t cap = keep + n_append + 64;
    uint32_t *buf = fault_malloc(cap * sizeof(uint32_t));
    if (!buf)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    if (keep)
        memcpy(buf, toks, keep * sizeof(uint32_t));
    if (keep < n) { /* toks points into the sequence: copied first */
        int rc = kvmm_seq_truncate(mm, owner, r->seq, n - keep);
        if (rc) {
            free(buf);
            return kvd_error_set(e, rc, "'seq': %s", kvmm_errmsg(mm));
        }
        n = keep;
    }
    size_t n_kv = n;
    /* With nothing to append, the last position is recomputed for logits. */
    if (n_append == 0) {
        int rc = kvmm_seq_truncate(mm, owner, r->seq, 1);
        if (rc) {
            free(buf);
            return kvd_error_set(e, rc, "'seq': %s", kvmm_errmsg(mm));
        }
        n_kv = n - 1;
    }
    if (n_append)
        memcpy(buf + n, prompt + skip, n_append * sizeof(uint32_t));
    free(r->toks);
    r->toks = buf;
    r->cap_toks = cap;
    r->n_toks = n + n_append;
    r->n_kv = n_kv;
    r->n_cached = n_kv;
    r->n_orig = n; /* the sequence goes back with at least these (scheduler.h) */
    r->n_prompt = r->n_toks;
    return 0;
}

int sched_req_set_prompt(struct kvmm *mm, struct sched_req *r, const uint32_t *toks, size_t n,
                         bool replace, const char *param, struct kvd_error *e)
{
    if (r->have_seq)
        return set_after_seq(mm, r, toks, n, replace, param, e);
    if (n == 0) {
        kvd_error_set(e, KVD_EBADREQ, "'%s' is empty: the prompt needs at least one token", param);
        return kvd_error_param(e, param);
    }
    if (n >= r->n_ctx) {
        kvd_error_set(e, KVD_EBADREQ,
                      "'%s': %zu tokens exceed the model's context (%u, at most %u)", param, n,
                      r->n_ctx, r->n_ctx - 1);
        return kvd_error_param(e, param);
    }
    size_t cap = n + 64;
    uint32_t *buf = fault_malloc(cap * sizeof(uint32_t));
    if (!buf)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    memcpy(buf, toks, n * sizeof(uint32_t));
    free(r->toks);
    r->toks = buf;
    r->cap_toks = cap;
    r->n_toks = n;
    r->n_prompt = n;
    return 0;
}

int sched_req_prepare(struct kvmm *mm, const struct text *tx, struct sched_req *r,
                      struct kvd_error *e)
{
    if (r->constraint) {
        struct grammar *g = NULL;
        int rc = sched_constraint_compile(r->constraint, &g, e);
        if (rc == 0)
            rc = sched_req_set_grammar(tx, r, g, e);
        if (rc)
            return rc;
        sched_constraint_free(r->constraint);
        r->constraint = NULL;
    }
    struct sched_prompt *p = r->prompt;
    if (!p)
        return 0;
    uint32_t *toks = NULL;
    size_t n = 0;
    char terr[200];
    int rc =
        p->chat ? text_tokenize_chat(tx, p->msgs, p->n_msgs, r->n_ctx, &toks, &n, terr, sizeof terr)
                : text_tokenize(tx, p->text, p->len, p->add_bos, false, r->n_ctx, &toks, &n, terr,
                                sizeof terr);
    if (rc) {
        kvd_error_set(e, rc, "'%s': %s", p->param, terr);
        return kvd_error_param(e, p->param);
    }
    if (!r->have_seq && !p->chat && r->n_toks) {
        /* a session's conversation, then this text's tokens (gen_request.c) */
        uint32_t *all = n <= SIZE_MAX / sizeof(uint32_t) - r->n_toks
                            ? fault_malloc(sizeof(uint32_t) * (r->n_toks + n))
                            : NULL;
        if (!all) {
            free(toks);
            return kvd_error_set(e, KVD_ENOMEM, "out of memory");
        }
        memcpy(all, r->toks, sizeof(uint32_t) * r->n_toks);
        if (n)
            memcpy(all + r->n_toks, toks, sizeof(uint32_t) * n);
        n += r->n_toks;
        free(toks);
        toks = all;
    }
    if (r->have_seq)
        kvmm_lock(mm);
    rc = sched_req_set_prompt(mm, r, toks, n, p->replace, p->param, e);
    if (r->have_seq)
        kvmm_unlock(mm);
    free(toks);
    if (rc == 0) {
        free(r->prompt);
        r->prompt = NULL;
    }
    return rc;
}
