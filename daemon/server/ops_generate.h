/* The generate and cancel ops (ops_generate.c): request parsing and
 * validation into scheduler requests, and the frames of their streamed
 * events and final replies. The server glue is at the end of the file. */
#ifndef KVD_OPS_GENERATE_H
#define KVD_OPS_GENERATE_H

#include <stdint.h>

#include <msgpack.h>

#include "exec.h"
#include "proto.h"

/* Who asks: the connection (its id is the kvmm owner of its sequences), the
 * request id, the connection's tenant and default namespace. */
struct ops_generate_ctx {
    uint64_t conn, id;
    uint32_t tenant, ns;
};

/* Parses a generate request (root map) into a new request for the
 * executor. Seq mode (`seq`) takes the connection's sequence over (kvmm
 * lock taken inside); a failure leaves it untouched. Every invalid argument
 * is KVD_EBADREQ with a message naming the field. */
int ops_generate_build(struct exec *ex, struct kvmm *mm, const msgpack_object *root,
                       const struct ops_generate_ctx *c, struct sched_req **out,
                       struct proto_err *err);
/* Undoes a build that was not submitted: gives a taken sequence back and
 * frees r (kvmm lock taken inside). */
void ops_generate_discard(struct kvmm *mm, struct sched_req *r);

/* Appends one frame: {"id", "event": "tokens", "tokens": [...]}, and
 * "text" (the completion's new text) when text is non-NULL. */
int ops_generate_encode_tokens(msgpack_sbuffer *sb, uint64_t id, const uint32_t *toks, size_t n,
                               const char *text, size_t text_len);
/* Appends the final reply frame of r: tokens, text (when the model has a
 * tokenizer), finish_reason, usage, timing (and seq for seq mode), or the
 * error. */
int ops_generate_encode_done(msgpack_sbuffer *sb, const struct sched_req *r);

/* Serve mode: starts the executor over the model and registers generate,
 * cancel, a close hook (cancel the connection's requests) and a drain hook
 * (answer everything) with the server. Call before server_run. */
struct server;
struct ops_generate;
int ops_generate_start(struct server *srv, struct kvmm *mm, struct model *m,
                       const struct exec_conf *conf, struct ops_generate **out, char *err,
                       size_t errlen);
struct exec *ops_generate_exec(struct ops_generate *g);
/* Answers whatever is still live (cancelled), stops the executor, frees g.
 * Call after server_run returned, before the model and kvmm are freed. */
void ops_generate_stop(struct ops_generate *g);

#endif
