/* gen_request (see gen_request.h): the wire-independent checks of a
 * generate request and the executor request they make. */
#include "gen_request.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "grammar.h"
#include "prep.h"
#include "text.h"
#include "text_out.h"

void gen_args_init(struct gen_args *a)
{
    memset(a, 0, sizeof(*a));
    a->top_p = 1.0;
    a->typical_p = 1.0;
    a->repeat_penalty = 1.0;
    a->repeat_last_n = GEN_DEFAULT_REPEAT_LAST_N;
    a->session_ttl_s = KVMM_SESSION_TTL_DEFAULT;
    a->n = 1;
}

static uint64_t random_seed(void)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof(s), GRND_NONBLOCK) != (ssize_t)sizeof(s))
        s = sched_now_ns() ^ (uint64_t)(uintptr_t)&s;
    return s;
}

__attribute__((format(printf, 4, 5))) static int bad(struct kvd_error *e, int code,
                                                     const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    e->code = code;
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    snprintf(e->param, sizeof(e->param), "%s", param);
    return code;
}

/* Sampling, stopping and scheduling arguments into r; seed: its stream's. */
static int set_args(const struct exec *ex, const struct text *tx, const struct model_hparams *hp,
                    const struct gen_args *a, uint64_t seed, struct sched_req *r,
                    struct kvd_error *e)
{
    uint64_t u = a->max_tokens;
    if (!a->has_max_tokens)
        u = GEN_DEFAULT_MAX_TOKENS < hp->n_ctx ? GEN_DEFAULT_MAX_TOKENS : hp->n_ctx;
    else if (u == GEN_MAX_TOKENS_CONTEXT)
        u = hp->n_ctx;
    if (u == 0 || u > hp->n_ctx)
        return bad(e, KVD_EBADREQ, "max_tokens",
                   "'max_tokens' must be in [1, %u] (the model's context)", hp->n_ctx);
    r->max_tokens = (uint32_t)u;

    if (!isfinite(a->temperature) || a->temperature < 0 || a->temperature > GEN_MAX_TEMPERATURE)
        return bad(e, KVD_EBADREQ, "temperature", "'temperature' must be in [0, %g]",
                   GEN_MAX_TEMPERATURE);
    if (!isfinite(a->top_p) || a->top_p <= 0 || a->top_p > 1)
        return bad(e, KVD_EBADREQ, "top_p", "'top_p' must be in (0, 1]");
    if (a->top_k > hp->n_vocab)
        return bad(e, KVD_EBADREQ, "top_k", "'top_k' must be in [0, %u] (the vocabulary)",
                   hp->n_vocab);
    if (!(a->min_p >= 0 && a->min_p <= 1))
        return bad(e, KVD_EBADREQ, "min_p", "'min_p' must be in [0, 1]");
    if (!(a->typical_p > 0 && a->typical_p <= 1))
        return bad(e, KVD_EBADREQ, "typical_p", "'typical_p' must be in (0, 1]");
    if (!(a->repeat_penalty > 0 && a->repeat_penalty <= GEN_MAX_PENALTY))
        return bad(e, KVD_EBADREQ, "repeat_penalty", "'repeat_penalty' must be in (0, %g]",
                   GEN_MAX_PENALTY);
    if (a->repeat_last_n < -1 || a->repeat_last_n > (int64_t)hp->n_ctx)
        return bad(e, KVD_EBADREQ, "repeat_last_n",
                   "'repeat_last_n' must be in [-1, %u] (-1: the model's context)", hp->n_ctx);
    if (!(a->presence_penalty >= -2 && a->presence_penalty <= 2))
        return bad(e, KVD_EBADREQ, "presence_penalty", "'presence_penalty' must be in [-2, 2]");
    if (!(a->frequency_penalty >= -2 && a->frequency_penalty <= 2))
        return bad(e, KVD_EBADREQ, "frequency_penalty", "'frequency_penalty' must be in [-2, 2]");
    if (a->n_logit_bias > hp->n_vocab)
        return bad(e, KVD_EBADREQ, "logit_bias", "'logit_bias' has %zu entries, at most %u",
                   a->n_logit_bias, hp->n_vocab);
    struct logit_bias *lb = NULL;
    if (a->n_logit_bias) {
        if (!(lb = malloc(a->n_logit_bias * sizeof *lb)))
            return kvd_error_set(e, KVD_ENOMEM, "out of memory");
        r->bias = lb;
    }
    for (size_t i = 0; i < a->n_logit_bias; i++) {
        const struct logit_bias *b = &a->logit_bias[i];
        if (b->id >= hp->n_vocab)
            return bad(e, KVD_EBADREQ, "logit_bias",
                       "'logit_bias': token %u is outside the vocabulary (%u)", b->id, hp->n_vocab);
        if (!(b->bias >= -100 && b->bias <= 100))
            return bad(e, KVD_EBADREQ, "logit_bias",
                       "'logit_bias': the bias of token %u must be in [-100, 100]", b->id);
        for (size_t j = 0; j < i; j++)
            if (lb[j].id == b->id)
                return bad(e, KVD_EBADREQ, "logit_bias", "'logit_bias': token %u is given twice",
                           b->id);
        /* -100 bans the token, as OpenAI documents. */
        lb[i] = (struct logit_bias){.id = b->id, .bias = b->bias <= -100 ? -INFINITY : b->bias};
    }
    struct sampler_params sp = {
        .temperature = (float)a->temperature,
        .top_k = (uint32_t)a->top_k,
        .top_p = (float)a->top_p,
        .seed = seed,
        .min_p = (float)a->min_p,
        .typical_p = (float)a->typical_p,
        .repeat_penalty = (float)a->repeat_penalty,
        .presence_penalty = (float)a->presence_penalty,
        .frequency_penalty = (float)a->frequency_penalty,
        .repeat_last_n = a->repeat_last_n < 0 ? hp->n_ctx : (uint32_t)a->repeat_last_n,
        .bias = lb,
        .n_bias = (uint32_t)a->n_logit_bias,
    };
    sampler_init(&r->smp, &sp);

    if (a->n_stop_ids + a->n_stop_strs > SCHED_MAX_STOP)
        return bad(e, KVD_EBADREQ, "stop", "'stop' has %zu entries, at most %u",
                   a->n_stop_ids + a->n_stop_strs, SCHED_MAX_STOP);
    for (size_t i = 0; i < a->n_stop_ids; i++) {
        if (a->stop_ids[i] >= hp->n_vocab)
            return bad(e, KVD_EBADREQ, "stop", "'stop': token %u is outside the vocabulary (%u)",
                       a->stop_ids[i], hp->n_vocab);
        r->stop[r->n_stop++] = a->stop_ids[i];
    }
    for (size_t i = 0; i < a->n_stop_strs; i++)
        if (a->stop_lens[i] == 0 || a->stop_lens[i] > TEXT_OUT_MAX_STOP_LEN)
            return bad(e, KVD_EBADREQ, "stop", "'stop': a stop string must have 1 to %u bytes",
                       TEXT_OUT_MAX_STOP_LEN);
    const struct tokenizer *tok = text_tokenizer(tx);
    if (a->n_stop_strs && !tok)
        return bad(e, KVD_EUNSUPPORTED, "stop", "stop strings need the model's tokenizer: %s",
                   text_no_tokenizer(tx));
    if (tok) {
        int rc = text_out_new(tok, a->stop_strs, a->stop_lens, a->n_stop_strs, &r->text);
        if (rc)
            return kvd_error_set(e, rc, "out of memory");
    }
    if (a->logprobs && a->top_logprobs > SAMPLER_MAX_TOP_LOGPROBS)
        return bad(e, KVD_EBADREQ, a->top_logprobs_param ? a->top_logprobs_param : "logprobs",
                   "'%s' must be in [0, %d]",
                   a->top_logprobs_param ? a->top_logprobs_param : "logprobs",
                   SAMPLER_MAX_TOP_LOGPROBS);
    r->lp_on = a->logprobs;
    r->lp_top = a->logprobs ? (uint32_t)a->top_logprobs : 0;
    r->ignore_eos = a->ignore_eos;
    r->stream = a->stream;
    if (a->priority < -GEN_MAX_PRIORITY || a->priority > GEN_MAX_PRIORITY)
        return bad(e, KVD_EBADREQ, "priority", "'priority' must be in [%d, %d]", -GEN_MAX_PRIORITY,
                   GEN_MAX_PRIORITY);
    r->priority = (int32_t)a->priority;
    r->spec_kind = SPEC_DEFAULT;
    if (a->speculative) {
        char k[16];
        size_t n = a->speculative_len < sizeof k - 1 ? a->speculative_len : sizeof k - 1;
        memcpy(k, a->speculative, n);
        k[n] = '\0';
        if (n != a->speculative_len || memchr(k, '\0', n) || spec_kind_parse(k, &r->spec_kind))
            return bad(e, KVD_EBADREQ, "speculative",
                       "'speculative' must be \"ngram\", \"draft\" or \"off\"");
        if (r->spec_kind == SPEC_DRAFT && !exec_has_draft(ex))
            return bad(e, KVD_EUNSUPPORTED, "speculative",
                       "'speculative': \"draft\" needs a draft model, and this model has "
                       "none (--draft-model, or [model:NAME] draft = OTHER)");
    }
    return 0;
}

/* What the completion follows: the grammar the decoder compiled (*g, taken
 * over), or a source compiled off the loop (r->constraint, prep.h). */
static int set_constraint(const struct text *tx, const struct gen_args *a, struct grammar **g,
                          struct sched_req *r, struct kvd_error *e)
{
    const char *sp = a->json_schema_param ? a->json_schema_param : "json_schema";
    int n = (a->grammar != NULL) + (a->json_schema != NULL || a->json_schema_text != NULL) +
            a->json_object;
    if (n > 1)
        return bad(e, KVD_EBADREQ, a->grammar ? "grammar" : sp,
                   "give one of 'grammar' and '%s', not both", sp);
    if (!n && !*g)
        return 0;
    const char *param = a->grammar ? "grammar" : sp;
    if (!text_grammar_vocab(tx))
        return bad(e, KVD_EUNSUPPORTED, param, "grammars need the model's tokenizer: %s",
                   text_no_tokenizer(tx));
    if (*g) {
        struct grammar *own = *g;
        *g = NULL;
        return sched_req_set_grammar(tx, r, own, e);
    }
    json_t *schema = NULL;
    if (a->json_schema && !(schema = json_deep_copy(a->json_schema)))
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    enum sched_constraint_kind kind = a->grammar       ? SCHED_GBNF
                                      : a->json_object ? SCHED_JSON_OBJECT
                                      : a->json_schema ? SCHED_SCHEMA
                                                       : SCHED_SCHEMA_TEXT;
    const char *text = a->grammar ? a->grammar : a->json_schema_text;
    size_t len = a->grammar ? a->grammar_len : a->json_schema_len;
    if (kind == SCHED_GBNF && len > GRAMMAR_MAX_TEXT)
        return bad(e, KVD_ETOOLARGE, "grammar", "grammar: %zu bytes, kvd compiles at most %u", len,
                   GRAMMAR_MAX_TEXT);
    if (!(r->constraint = sched_constraint_new(kind, param, text, len, schema)))
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    return 0;
}

/* Choices 1..n-1 of leader r (n > 1), each with seed + i. */
static int add_choices(struct exec *ex, const struct text *tx, const struct model_hparams *hp,
                       const struct gen_args *a, uint64_t seed, struct sched_req *r,
                       struct kvd_error *e)
{
    if (a->n < 1 || a->n > GEN_MAX_CHOICES)
        return bad(e, KVD_EBADREQ, "n", "'n' must be in [1, %d]", GEN_MAX_CHOICES);
    if (a->n == 1)
        return 0;
    if (a->has_seq || a->has_session)
        return bad(e, KVD_EUNSUPPORTED, "n", "'n' > 1 with '%s' is not supported",
                   a->has_seq ? "seq" : "session");
    struct sched_group *g = sched_group_new(r, (uint32_t)a->n);
    if (!g)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    for (uint32_t i = 1; i < g->n; i++) {
        struct sched_req *f = calloc(1, sizeof(*f));
        if (!f)
            return kvd_error_set(e, KVD_ENOMEM, "out of memory");
        g->reqs[i] = f;
        f->group = g;
        f->choice = i;
        f->conn = r->conn;
        f->id = r->id;
        f->tenant = r->tenant;
        f->ns = r->ns;
        f->sink = r->sink;
        f->n_ctx = r->n_ctx;
        f->t_arrive = r->t_arrive;
        int rc = set_args(ex, tx, hp, a, seed + i, f, e);
        if (rc)
            return rc;
        f->serial = exec_next_serial(ex);
    }
    return 0;
}

/* The prompt's checks that need no tokenizing. */
static int check_prompt(const struct text *tx, const struct model_hparams *hp,
                        const struct gen_args *a, const struct gen_limits *lim, struct kvd_error *e)
{
    const char *p = a->prompt_param ? a->prompt_param : "prompt";
    switch (a->prompt) {
    case GEN_PROMPT_NONE:
        if (!a->has_seq && !a->has_session)
            return bad(e, KVD_EBADREQ, p, "the request has no prompt");
        return 0;
    case GEN_PROMPT_TOKENS:
        for (size_t i = 0; i < a->n_tokens; i++)
            if (a->tokens[i] >= hp->n_vocab)
                return bad(e, KVD_EBADREQ, p, "'%s'[%zu] = %u is outside the vocabulary (%u)", p, i,
                           a->tokens[i], hp->n_vocab);
        return 0;
    case GEN_PROMPT_TEXT:
    case GEN_PROMPT_MESSAGES:
        break;
    }
    if (!text_tokenizer(tx))
        return bad(e, KVD_EUNSUPPORTED, p, "'%s' needs the model's tokenizer: %s", p,
                   text_no_tokenizer(tx));
    if (a->prompt == GEN_PROMPT_MESSAGES && !text_chat_template(tx))
        return bad(e, KVD_EUNSUPPORTED, p, "'%s' needs the model's chat template: %s", p,
                   text_no_chat_template(tx));
    size_t bytes = a->text_len;
    if (a->prompt == GEN_PROMPT_MESSAGES) {
        bytes = 0;
        for (size_t i = 0; i < a->n_msgs; i++)
            bytes += strlen(a->msgs[i].role) + strlen(a->msgs[i].content);
    }
    if (lim && lim->max_text_bytes && bytes > lim->max_text_bytes)
        return bad(e, KVD_ETOOLARGE, p, "'%s' has %zu bytes of text, over max-text-bytes (%zu)", p,
                   bytes, lim->max_text_bytes);
    return 0;
}

/* generate with `session`: its checks, r's session state, and a copy of
 * the live session's tokens (*toks NULL and *n 0 when it has none yet). */
static int open_session(struct kvmm *mm, const struct gen_args *a, struct sched_req *r,
                        uint32_t **toks, size_t *n, struct kvd_error *e)
{
    *toks = NULL;
    *n = 0;
    if (a->has_seq)
        return bad(e, KVD_EBADREQ, "session", "give 'session' or 'seq', not both");
    if (!kvmm_session_name_ok(a->session))
        return bad(e, KVD_EBADREQ, "session", "'session' must be 1 to %d letters, digits or -_.:@/",
                   KVMM_SESSION_NAME);
    if (a->session_ttl_s < 1 || a->session_ttl_s > KVMM_SESSION_TTL_MAX)
        return bad(e, KVD_EBADREQ, "session_ttl_s", "'session_ttl_s' must be 1 to %llu seconds",
                   (unsigned long long)KVMM_SESSION_TTL_MAX);
    if (!kvmm_disk_on(mm))
        return bad(e, KVD_EUNSUPPORTED, "session", "sessions need a disk tier (--disk-dir)");
    if (!(r->session = calloc(1, sizeof(*r->session))))
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    snprintf(r->session->name, sizeof r->session->name, "%s", a->session);
    r->session->ttl_s = a->session_ttl_s;
    struct kvd_error le;
    int rc = kvmm_session_tokens(mm, r->ns, a->session, toks, n, &le);
    if (rc == KVD_ENOTFOUND) /* a new session */
        return 0;
    return rc ? bad(e, rc, "session", "'session': %s", le.message) : 0;
}

/* The prompt of a session request that continues the conversation (tokens,
 * text or none): the session's tokens first; a text prompt's own tokens
 * follow them once it is tokenized (prep.c). */
static int session_prompt(struct kvmm *mm, struct sched_req *r, const struct gen_args *a,
                          const uint32_t *st, size_t n_st, const char *param, struct kvd_error *e)
{
    if (a->prompt == GEN_PROMPT_NONE && n_st == 0)
        return bad(e, KVD_EBADREQ, "session",
                   "session '%s' holds no conversation yet: the request needs a prompt",
                   a->session);
    if (a->prompt != GEN_PROMPT_TOKENS)
        return n_st ? sched_req_set_prompt(mm, r, st, n_st, false, "session", e) : 0;
    if (n_st == 0)
        return sched_req_set_prompt(mm, r, a->tokens, a->n_tokens, false, param, e);
    if (a->n_tokens > SIZE_MAX / sizeof(uint32_t) - n_st)
        return bad(e, KVD_ETOOLARGE, param, "the prompt is too long");
    uint32_t *all = malloc(sizeof(uint32_t) * (n_st + a->n_tokens));
    if (!all)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    memcpy(all, st, sizeof(uint32_t) * n_st);
    if (a->n_tokens)
        memcpy(all + n_st, a->tokens, sizeof(uint32_t) * a->n_tokens);
    int rc = sched_req_set_prompt(mm, r, all, n_st + a->n_tokens, false, param, e);
    free(all);
    return rc;
}

static int build(struct exec *ex, struct kvmm *mm, const struct gen_args *a,
                 const struct gen_caller *c, const struct gen_limits *lim, struct grammar **g,
                 struct sched_req **out, struct kvd_error *e)
{
    const struct model_hparams *hp = exec_hparams(ex);
    const struct text *tx = exec_text(ex);
    const char *param = a->prompt_param ? a->prompt_param : "prompt";
    int rc = check_prompt(tx, hp, a, lim, e);
    if (rc)
        return rc;
    struct sched_req *r = calloc(1, sizeof(*r));
    if (!r)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    uint64_t seed = a->has_seed ? a->seed : random_seed();
    r->conn = c->conn;
    r->id = c->id;
    r->tenant = c->tenant;
    r->ns = c->ns;
    r->sink = c->sink;
    r->n_ctx = hp->n_ctx;
    r->t_arrive = sched_now_ns();
    if ((rc = set_args(ex, tx, hp, a, seed, r, e)) ||
        (rc = add_choices(ex, tx, hp, a, seed, r, e)) || (rc = set_constraint(tx, a, g, r, e))) {
        if (r->group)
            sched_group_free(r->group);
        else
            sched_req_free(r);
        return rc;
    }
    r->serial = exec_next_serial(ex);

    uint32_t *st = NULL; /* the session's tokens */
    size_t n_st = 0;
    if (a->has_session && (rc = open_session(mm, a, r, &st, &n_st, e)) != 0) {
        sched_req_free(r);
        return rc;
    }

    size_t n_seq = 0;
    if (a->has_session && a->prompt != GEN_PROMPT_MESSAGES) {
        rc = session_prompt(mm, r, a, st, n_st, param, e);
    } else if (a->has_seq) {
        kvmm_lock(mm);
        rc = sched_req_lend_seq(mm, r, a->seq, &n_seq, e);
        if (rc == 0 && (a->prompt == GEN_PROMPT_TOKENS || a->prompt == GEN_PROMPT_NONE))
            rc = sched_req_set_prompt(mm, r, a->tokens, a->n_tokens, false, param, e);
        kvmm_unlock(mm);
    } else if (a->prompt == GEN_PROMPT_TOKENS) {
        rc = sched_req_set_prompt(mm, r, a->tokens, a->n_tokens, false, param, e);
    }
    if (rc == 0 && a->prompt == GEN_PROMPT_TEXT) {
        /* The model's BOS rule, at the start of a sequence only. */
        r->prompt = sched_prompt_text(param, a->text, a->text_len, n_seq + n_st > 0 ? 0 : -1);
        rc = r->prompt ? 0 : kvd_error_set(e, KVD_ENOMEM, "out of memory");
    } else if (rc == 0 && a->prompt == GEN_PROMPT_MESSAGES) {
        /* With seq, the conversation is the whole prompt: the sequence keeps
         * its longest common prefix with it. */
        r->prompt = sched_prompt_chat(param, a->msgs, a->n_msgs, a->has_seq);
        rc = r->prompt ? 0 : kvd_error_set(e, KVD_ENOMEM, "out of memory");
    }
    free(st);
    if (rc) {
        gen_request_discard(mm, r);
        return rc;
    }
    *out = r;
    return 0;
}

int gen_request_build(struct exec *ex, struct kvmm *mm, const struct gen_args *a,
                      const struct gen_caller *c, const struct gen_limits *lim,
                      struct sched_req **out, struct kvd_error *e)
{
    struct grammar *g = a->compiled;
    int rc = build(ex, mm, a, c, lim, &g, out, e);
    grammar_free(g); /* when the build did not take it */
    return rc;
}

void gen_request_discard(struct kvmm *mm, struct sched_req *r)
{
    if (r->have_seq) {
        kvmm_lock(mm);
        if (r->conn_seq)
            kvmm_seq_set_owner(mm, sched_req_owner(r), r->seq, r->conn);
        else
            kvmm_seq_close(mm, sched_req_owner(r), r->seq);
        kvmm_unlock(mm);
    }
    if (r->group)
        sched_group_free(r->group);
    else
        sched_req_free(r);
}
