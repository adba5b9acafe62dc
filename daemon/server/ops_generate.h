/* The generate and cancel ops (ops_generate.c): request parsing and
 * validation into scheduler requests, and the frames of their streamed
 * events and final replies. The server glue is at the end of the file. */
#ifndef KVD_OPS_GENERATE_H
#define KVD_OPS_GENERATE_H

#include <stdint.h>

#include <msgpack.h>

#include "exec.h"
#include "gen_request.h"
#include "proto.h"

/* Decodes a generate request (msgpack root map) into gen_args and builds
 * the executor's request (gen_request_build: seq mode takes the caller's
 * sequence over; a failure leaves it untouched). Every invalid argument is
 * KVD_EBADREQ with a message naming the field. */
int ops_generate_build(struct exec *ex, struct kvmm *mm, const msgpack_object *root,
                       const struct gen_caller *c, const struct gen_limits *lim,
                       struct sched_req **out, struct kvd_error *err);

/* Appends one frame: {"id", "event": "tokens", "tokens": [...]}, and
 * "choice" (n > 1: the choice they belong to) when choice >= 0, "text"
 * (the completion's new text) when text is non-NULL, and "logprobs"
 * (docs/protocol.md) when lp is non-NULL: the n tokens' entries, 1 +
 * lp_top each. */
int ops_generate_encode_tokens(msgpack_sbuffer *sb, uint64_t id, int64_t choice,
                               const uint32_t *toks, size_t n, const char *text, size_t text_len,
                               const struct sampler_logprob *lp, uint32_t lp_top);
/* The final reply of a request of n > 1 choices (rs[i]: choice i):
 * "choices" [{index, tokens, logprobs, text, finish_reason, error}],
 * "usage" (the prompt once, the completions summed), "timing"; an error
 * reply when every choice failed. */
int ops_generate_encode_done_group(msgpack_sbuffer *sb, const struct sched_req *const *rs,
                                   uint32_t n);
/* Appends the final reply frame of r: tokens, text (when the model has a
 * tokenizer), finish_reason, usage, timing (and seq for seq mode), or the
 * error. */
int ops_generate_encode_done(msgpack_sbuffer *sb, const struct sched_req *r);

/* Serve mode: registers generate, cancel, a close hook (cancel the
 * connection's requests and waits), a drain hook (answer everything) and
 * an abort hook with the server, over the daemon's models (their executors
 * are the models' own, models.h). Call before server_run. */
struct server;
struct ops_generate;
struct gen_clients;
struct event_base;
struct models;
struct models_entry;
int ops_generate_start(struct server *srv, struct models *ms, struct ops_generate **out,
                       struct kvd_error *err);
/* The generate clients other than msgpack connections (below). */
struct gen_clients *ops_generate_clients(struct ops_generate *g);
/* After the executors drained and before server_free: releases what
 * ops_generate keeps on the server's loop (the generate clients' event).
 * NULL is a no-op. */
void ops_generate_release_loop(struct ops_generate *g);
/* Frees g. Call after the models' executors stopped (models_stop). */
void ops_generate_stop(struct ops_generate *g);

/* ---- generate clients other than msgpack connections --------------------
 * The HTTP API (http.c) is a generate client too, without faking a msgpack
 * connection: each of its requests gets a client id (server_new_id: from
 * the connections' counter, so it never names a connection) and callbacks
 * that run on the loop thread, in order, the done callback last. Tokens and
 * results come from the executor's thread through a queue of their own and
 * an event on the loop (ops_generate_client.c). */

/* One choice of a client's request. */
struct ops_generate_choice {
    enum sched_finish finish; /* LENGTH, STOP, CANCELLED or ERROR */
    const uint32_t *toks;     /* the generated tokens */
    size_t n_toks;
    const char *text; /* their text (NULL: a token-only model) */
    size_t text_len;
    /* logprobs (NULL: not asked): 1 + lp_top entries per token of toks */
    const struct sampler_logprob *lp;
};

/* How a client's request ended. */
struct ops_generate_result {
    /* err->code 0, or what ended it (the first failed choice's error); finish:
     * ERROR when a choice failed, else CANCELLED when one was cancelled,
     * else choice 0's */
    const struct kvd_error *err;
    enum sched_finish finish;
    uint32_t n_choices; /* 1, or the request's n */
    const struct ops_generate_choice *choices;
    uint32_t lp_top;
    uint64_t prompt, cached, completion; /* usage: the prompt once, all completions */
    const struct sched_session *session; /* a session request's save (NULL: none) */
};

struct ops_generate_client {
    void *ud;
    /* Streaming requests: new tokens of choice `choice` (0 unless n > 1)
     * and the text they completed (text NULL on a token-only model;
     * text_len may be 0 while a character or a possible stop string is
     * held back); lp (NULL: logprobs not asked) holds 1 + lp_top entries
     * per token. */
    void (*tokens)(void *ud, uint32_t choice, const uint32_t *toks, size_t n, const char *text,
                   size_t text_len, const struct sampler_logprob *lp, uint32_t lp_top);
    /* The end; nothing is called for this client after it. */
    void (*done)(void *ud, const struct ops_generate_result *res);
};

/* A fresh client id. Loop thread. */
uint64_t ops_generate_client_id(struct gen_clients *gc);
/* Builds (gen_request_build; seq mode excluded) and submits a request of
 * client `client` for tenant to model e, which must be loaded (models.h:
 * models_wait first). 0: the callbacks will run; else an enum kvd_err with
 * err filled and nothing will. Loop thread. */
int ops_generate_client_submit(struct gen_clients *gc, uint64_t client, struct models_entry *e,
                               const struct gen_args *args, uint32_t tenant,
                               const struct ops_generate_client *cb, struct kvd_error *err);
/* The client is gone (disconnect): its request is cancelled and none of its
 * callbacks runs any more. Loop thread. */
void ops_generate_client_drop(struct gen_clients *gc, uint64_t client);
/* Ends the client's request with error `code` and msg (at most one step
 * later; the done callback says so). Loop thread. */
void ops_generate_client_abort(struct gen_clients *gc, uint64_t client, int code, const char *msg);

/* For ops_generate.c: the registry and queue, and the executor-thread side. */
int gen_clients_new(struct server *srv, struct models *ms, struct gen_clients **out);
void gen_clients_free(struct gen_clients *gc);
/* Frees what lives on the server's loop (the queue's event); later results
 * are dropped. Before the event base goes (ops_generate_release_loop). */
void gen_clients_release_loop(struct gen_clients *gc);
void gen_clients_tokens(struct gen_clients *gc, const struct sched_req *r, const uint32_t *toks,
                        size_t n);
void gen_clients_done(struct gen_clients *gc, const struct sched_req *r);
void gen_clients_done_group(struct gen_clients *gc, const struct sched_req *const *rs, uint32_t n);

#endif
