/* openai: the JSON side of the OpenAI-compatible HTTP API (docs/http.md),
 * with jansson. A /v1/completions or /v1/chat/completions body becomes the
 * msgpack arguments of kvd's own `generate` (so both paths share one
 * validation and one executor); results become OpenAI response objects,
 * stream chunks and error bodies. Pure functions over buffers: no sockets,
 * no server state, so the unit tests and the fuzz target drive them
 * directly. */
#ifndef KVD_OPENAI_H
#define KVD_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

enum openai_kind { OPENAI_COMPLETION, OPENAI_CHAT };

/* The longest model name a request may carry (bytes). */
#define OPENAI_MAX_MODEL 255
/* Stop strings a request may give (OpenAI allows 4). */
#define OPENAI_MAX_STOP 4

struct openai_req {
    enum openai_kind kind;
    bool stream;
    bool include_usage; /* stream_options.include_usage */
    /* The generate request's arguments: one msgpack map (tokens | text |
     * messages, max_tokens, temperature, top_p, seed, stop, stream,
     * ignore_eos), owned;
     * openai_req_free releases it. */
    msgpack_sbuffer args;
};

/* What went wrong with a request: the HTTP status, the OpenAI error type
 * and code, the offending parameter ("" when none) and a message. */
struct openai_err {
    int status;
    char type[32];
    char code[32];
    char param[48];
    char message[256];
};

/* Parses a request body. Unknown fields are ignored; a known field of the
 * wrong type or out of range is 400 naming it; features kvd does not do
 * (n > 1, echo, logprobs, several prompts, non-text message parts) are 400
 * with code "unsupported". n_ctx (the model's context, 0 without a model:
 * 503) bounds max_tokens and is its default for chat requests. Stop
 * strings have 1 to TEXT_OUT_MAX_STOP_LEN bytes. 0, or -1 with e filled. */
int openai_parse(enum openai_kind kind, const char *body, size_t len, uint32_t n_ctx,
                 struct openai_req *out, struct openai_err *e);
void openai_req_free(struct openai_req *r);

/* Fills e for a kvd error code (enum kvd_err) and message: bad_request 400,
 * permission_denied 403, not_found 404, too_large 413, busy and
 * quota_exceeded 429, no_memory/cancelled/unsupported 503 or 501 as
 * docs/http.md lists, internal 500. */
void openai_err_from_kvd(struct openai_err *e, int code, const char *message);
/* e with a status, type, code and printf-style message. */
void openai_err_set(struct openai_err *e, int status, const char *type, const char *code,
                    const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* {"error":{"message","type","param","code"}}: malloc'd, NUL-terminated,
 * *len its length; NULL when out of memory. */
char *openai_error_body(const struct openai_err *e, size_t *len);

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
    const char *finish; /* "stop" / "length" / NULL while streaming */
    bool role;          /* chat stream: the first chunk carries the role */
    bool usage;         /* carry usage (responses; the last stream chunk) */
    uint64_t prompt_tokens, cached_tokens, completion_tokens;
    bool no_choices; /* a usage-only stream chunk: "choices": [] */
};
/* The response object (a whole reply) or one stream chunk (chunk = true),
 * compact JSON, malloc'd and NUL-terminated; NULL when out of memory. */
char *openai_render(const struct openai_out *o, bool chunk, size_t *len);

/* GET /v1/models: the one served model. */
char *openai_models(const char *model, uint64_t created, size_t *len);

#endif
