/* openai: the JSON side of the OpenAI-compatible HTTP API (docs/http.md),
 * with jansson. A /v1/completions or /v1/chat/completions body is decoded
 * straight into kvd's typed generate arguments (gen_request.h: the same
 * checks and executor path as msgpack `generate`, errors naming the OpenAI
 * parameter); results become OpenAI response objects, stream chunks and
 * error bodies (the one place a struct kvd_error becomes an HTTP status).
 * Pure functions over buffers: no sockets, no server state, so the unit
 * tests and the fuzz target drive them directly. */
#ifndef KVD_OPENAI_H
#define KVD_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "gen_request.h"
#include "tokenizer.h"
#include "kvd/status.h"

enum openai_kind { OPENAI_COMPLETION, OPENAI_CHAT };

/* The longest model name a request may carry (bytes). */
#define OPENAI_MAX_MODEL 255
/* Stop strings a request may give (OpenAI allows 4). */
#define OPENAI_MAX_STOP 4

struct openai_req {
    enum openai_kind kind;
    bool stream;
    bool include_usage; /* stream_options.include_usage */
    /* The generate arguments (prompt_param "prompt" or "messages"); their
     * strings point into root and the buffers below. */
    struct gen_args args;
    json_t *root;      /* the parsed body (owned) */
    const char *model; /* its `model` (in root; NULL: none), model_len bytes */
    size_t model_len;
    uint32_t *tokens;        /* a token prompt (owned) */
    struct chat_msg *msgs;   /* the messages, contents joined (owned) */
    struct logit_bias *bias; /* logit_bias (owned) */
};

/* Parses a request body. Unknown fields are ignored; a known field of the
 * wrong type or out of range is bad_request naming it (e->param); features
 * kvd does not do (echo, several prompts, non-text message parts) are
 * unsupported naming the parameter. A grammar (`grammar`, or
 * `response_format` json_object / json_schema) is compiled here into
 * args.compiled (owned by out until the build takes it): the parse runs on
 * a text worker, off the loop. n_ctx (the model's context, > 0) bounds
 * max_tokens and is its default for chat requests. Stop strings have 1 to
 * TEXT_OUT_MAX_STOP_LEN bytes. 0, or -1 with e filled. */
int openai_parse(enum openai_kind kind, const char *body, size_t len, uint32_t n_ctx,
                 struct openai_req *out, struct kvd_error *e);
/* The same where the context depends on the model the body names:
 * ctx_of(ud, model, len) gives it (model NULL: none named; 0: unknown, the
 * request is refused later by name). Called on the parsing thread. */
int openai_parse_ctx(enum openai_kind kind, const char *body, size_t len,
                     uint32_t (*ctx_of)(void *ud, const char *model, size_t len), void *ud,
                     struct openai_req *out, struct kvd_error *e);
void openai_req_free(struct openai_req *r);

/* How the HTTP API answers an error: its status, and the OpenAI error type
 * and code (the kvd code's name). bad_request 400, permission_denied 403,
 * not_found 404, too_large 413, busy and quota_exceeded 429, unsupported
 * 400 for a parameter kvd does not do (param set) and 501 for what the
 * model cannot do, no_memory and cancelled 503, internal 500. */
struct openai_status {
    int status;
    const char *type, *code;
};
void openai_status_of(const struct kvd_error *e, struct openai_status *st);
/* {"error":{"message","type","param","code"}}: malloc'd, NUL-terminated,
 * *len its length; NULL when out of memory. param NULL or "": null. */
char *openai_error_json(const struct openai_status *st, const char *param, const char *message,
                        size_t *len);
/* openai_status_of + openai_error_json; *status the HTTP status. */
char *openai_error_body(const struct kvd_error *e, int *status, size_t *len);

/* A finished (or streamed) completion. */
struct openai_out {
    enum openai_kind kind;
    const char *id;    /* "cmpl-..." / "chatcmpl-..." */
    const char *model; /* the served model's name */
    uint64_t created;  /* Unix seconds */
    const char *text;  /* the completion's text (NULL: token-only model) */
    size_t text_len;
    const uint32_t *toks; /* its token ids (kvd's extension field "tokens") */
    size_t n_toks;
    /* logprobs (NULL: not asked): 1 + lp_top entries per token of toks,
     * their texts by tok (NULL: a token-only model, every text ""); a
     * completion's text_offset starts at text_offset (the bytes of the
     * tokens streamed before). */
    const struct sampler_logprob *lp;
    uint32_t lp_top;
    const struct tokenizer *tok;
    size_t text_offset;
    const char *finish; /* "stop" / "length" / NULL while streaming */
    bool role;          /* chat stream: the first chunk carries the role */
    bool usage;         /* carry usage (responses; the last stream chunk) */
    uint64_t prompt_tokens, cached_tokens, completion_tokens;
    bool no_choices; /* a usage-only stream chunk: "choices": [] */
    uint32_t index;  /* the choice's index (n > 1) */
    /* n > 1: the choices (each its text, tokens, logprobs, finish,
     * index, role, text_offset; kind and tok too), rendered in place of
     * this object's own choice */
    const struct openai_out *choices;
    size_t n_choices;
};
/* The response object (a whole reply) or one stream chunk (chunk = true),
 * compact JSON, malloc'd and NUL-terminated; NULL when out of memory. */
char *openai_render(const struct openai_out *o, bool chunk, size_t *len);

/* GET /v1/models: the one served model. */
char *openai_models(const char *model, uint64_t created, size_t *len);
/* The same for n models, each with its state ("loaded", ...; states NULL:
 * none). */
char *openai_models_list(const char *const *names, const char *const *states, size_t n,
                         uint64_t created, size_t *len);

#endif
