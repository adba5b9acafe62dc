/* gen_request: a generate request as a typed value, whatever wire it came
 * by. Each wire has a decoder that fills a struct gen_args from its own
 * format, checking only types and shapes (msgpack: ops_generate.c; JSON:
 * openai.c); gen_request_build then makes the executor's request, with
 * every check that does not depend on the wire (ranges against the model,
 * the vocabulary, the context, the text bound, the sequence). Errors name
 * the field as the request's wire named it (args->prompt_param for the
 * prompt; the other fields have the same name on both wires). */
#ifndef KVD_GEN_REQUEST_H
#define KVD_GEN_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "exec.h"
#include "kvd/status.h"

/* The default completion length when a request gives none. */
#define GEN_DEFAULT_MAX_TOKENS 16u
/* max_tokens: until the context is full (the OpenAI chat default). */
#define GEN_MAX_TOKENS_CONTEXT UINT64_MAX
#define GEN_MAX_TEMPERATURE 1000.0
#define GEN_MAX_PRIORITY 1000000
#define GEN_MAX_PENALTY 100.0
/* llama.cpp's default window of the penalties */
#define GEN_DEFAULT_REPEAT_LAST_N 64
/* the most choices one request may ask (n; OpenAI's bound) */
#define GEN_MAX_CHOICES 128

enum gen_prompt_kind {
    GEN_PROMPT_NONE,     /* seq mode only: generate after the sequence's tokens */
    GEN_PROMPT_TOKENS,   /* token ids */
    GEN_PROMPT_TEXT,     /* text, tokenized with the model's BOS rule */
    GEN_PROMPT_MESSAGES, /* a conversation, rendered with the chat template */
};

/* Everything a generate request asks. Pointers are the decoder's (they must
 * live until gen_request_build returns; the request copies what it keeps). */
struct gen_args {
    /* the prompt */
    enum gen_prompt_kind prompt;
    const char *prompt_param; /* its name on the wire: "tokens", "text", "messages", "prompt" */
    const uint32_t *tokens;
    size_t n_tokens;
    const char *text;
    size_t text_len;
    const struct chat_msg *msgs; /* role and content NUL-terminated, no NUL inside */
    size_t n_msgs;

    /* sampling; gen_args_init's defaults */
    bool has_max_tokens;
    uint64_t max_tokens; /* absent: GEN_DEFAULT_MAX_TOKENS; or GEN_MAX_TOKENS_CONTEXT */
    double temperature;  /* 0: greedy */
    double top_p;        /* (0, 1] */
    uint64_t top_k;      /* 0: off */
    bool has_seed;
    uint64_t seed;
    double min_p;          /* [0, 1]; 0: off */
    double typical_p;      /* (0, 1]; 1: off */
    double repeat_penalty; /* (0, GEN_MAX_PENALTY]; 1: off */
    int64_t repeat_last_n; /* [-1, n_ctx]; -1: the whole context; 0: no penalties */
    double presence_penalty, frequency_penalty; /* [-2, 2] */
    const struct logit_bias *logit_bias;        /* [n_logit_bias]: bias in [-100, 100] */
    size_t n_logit_bias;

    /* logprobs: each generated token's log-probability under the raw model
     * distribution, and its top_logprobs (0 to SAMPLER_MAX_TOP_LOGPROBS)
     * most likely alternatives; top_logprobs_param names the field on the
     * wire (NULL: "logprobs") */
    bool logprobs;
    uint64_t top_logprobs;
    const char *top_logprobs_param;

    /* What the completion must follow (docs/grammar.md), at most one of:
     * a GBNF grammar (grammar.h); a JSON Schema (json_schema.h), parsed
     * (json_schema: copied by the build) or as JSON text
     * (json_schema_text); any JSON object (json_object). json_schema_param
     * names the schema on the wire (NULL: "json_schema"). They are
     * compiled off the loop, on the text workers. */
    const char *grammar;
    size_t grammar_len;
    const json_t *json_schema;
    const char *json_schema_text;
    size_t json_schema_len;
    const char *json_schema_param;
    bool json_object;
    /* Or the grammar already compiled off the loop by the decoder (the
     * HTTP API, on its text worker): gen_request_build takes it over
     * whatever it returns. */
    struct grammar *compiled;

    /* n: choices of the same prompt (1 to GEN_MAX_CHOICES): choice i
     * samples with seed + i (the request's seed, or a random one), on a
     * copy-on-write fork of the prompt's sequence (not with seq or
     * session) */
    uint64_t n;

    /* stopping */
    uint32_t stop_ids[SCHED_MAX_STOP];
    size_t n_stop_ids;
    const char *stop_strs[SCHED_MAX_STOP]; /* in the completion's text */
    size_t stop_lens[SCHED_MAX_STOP];
    size_t n_stop_strs;
    bool ignore_eos;

    /* delivery and scheduling */
    bool stream;
    int64_t priority;
    /* speculative decoding: "ngram", "draft" or "off" as sent (NULL:
     * absent, the daemon's choice) */
    const char *speculative;
    size_t speculative_len;

    /* seq mode (msgpack connections): the connection's sequence */
    bool has_seq;
    uint64_t seq;

    /* A named session (needs a disk tier; not with seq): tokens and text
     * continue its conversation (appended after its tokens), messages are
     * the whole conversation, as in chat completions (the session's blocks
     * are its cached prefix); either way the grown conversation is saved
     * under the same name, with session_ttl_s, when the request completes.
     * A name with no live session starts one. */
    bool has_session;
    char session[KVMM_SESSION_NAME + 1];
    uint64_t session_ttl_s; /* gen_args_init: KVMM_SESSION_TTL_DEFAULT */
};

void gen_args_init(struct gen_args *a);

/* Who asks: the requester id (a connection's: its sequences' kvmm owner;
 * or another client's, from the same counter), the request id, the tenant
 * and its namespace, and where the results go. */
struct gen_caller {
    uint64_t conn, id;
    uint32_t tenant, ns;
    const struct exec_sink *sink;
};

/* What the build checks against, besides the executor's model. */
struct gen_limits {
    size_t max_text_bytes; /* a text prompt, or all messages together; 0: no bound */
};

/* Builds the executor's request from a. Seq mode lends the caller's
 * sequence to it (kvmm lock taken inside); a failure leaves everything as
 * it was. A text or chat prompt is left in r->prompt for the executor's
 * workers (prep.h): it is not rendered or tokenized here. 0, or an enum
 * kvd_err with e filled (param set for the field at fault). */
int gen_request_build(struct exec *ex, struct kvmm *mm, const struct gen_args *a,
                      const struct gen_caller *c, const struct gen_limits *lim,
                      struct sched_req **out, struct kvd_error *e);
/* Undoes a build that was not submitted: gives a lent sequence back and
 * frees r and its other choices (kvmm lock taken inside). */
void gen_request_discard(struct kvmm *mm, struct sched_req *r);

#endif
