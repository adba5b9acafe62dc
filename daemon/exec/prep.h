/* prep: a generate request's prompt into its tokens. A request's builder
 * (daemon/server/gen_request.c, on the loop thread) does the quick part:
 * it lends a connection's sequence to the request (seq mode) and either
 * sets token prompts at once or leaves a text or chat prompt in r->prompt.
 * Rendering the chat template and tokenizing take time that grows with
 * what a client sends, so they run on the executor's worker pool
 * (exec_conf.pool, workpool.h), never on the loop: exec_submit hands such
 * a request to the pool, whose job calls sched_req_prepare and then queues
 * the request for the scheduler. */
#ifndef KVD_PREP_H
#define KVD_PREP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "kvd/status.h"
#include "kvmm.h"
#include "scheduler.h"
#include "text.h"

/* A prompt still to become tokens: a copy of the request's text or
 * messages, in one allocation (free() releases it). */
struct sched_prompt {
    bool chat;                       /* msgs, rendered with the model's chat template; else text */
    int add_bos;                     /* text: -1 the model's rule, 0 no, 1 yes */
    bool replace;                    /* seq mode: the prompt is the whole conversation */
    char param[KVD_ERROR_PARAM_MAX]; /* the request's name for it (errors) */
    const char *text;
    size_t len;
    struct chat_msg *msgs;
    size_t n_msgs;
};

/* What the completion must follow, still to be compiled into r->grammar:
 * compiling is linear in what the client sent (a JSON Schema's grammar can
 * be much larger than the schema), so it runs on the workers too. One
 * allocation with its text; the schema is owned. */
enum sched_constraint_kind {
    SCHED_GBNF,        /* text: GBNF */
    SCHED_SCHEMA_TEXT, /* text: a JSON Schema as JSON */
    SCHED_SCHEMA,      /* schema: a JSON Schema, parsed */
    SCHED_JSON_OBJECT, /* any JSON object */
};
struct sched_constraint {
    enum sched_constraint_kind kind;
    char param[KVD_ERROR_PARAM_MAX]; /* the request's name for it (errors) */
    json_t *schema;
    size_t len;
    char text[];
};
/* A constraint of kind with text (len bytes; may be NULL/0) or schema
 * (taken over, also on failure); NULL when out of memory. */
struct sched_constraint *sched_constraint_new(enum sched_constraint_kind kind, const char *param,
                                              const char *text, size_t len, json_t *schema);
void sched_constraint_free(struct sched_constraint *c);
/* The grammar of c (json_schema.h, grammar.h); 0 or an error naming
 * c->param. */
int sched_constraint_compile(const struct sched_constraint *c, struct grammar **out,
                             struct kvd_error *e);
/* r's grammar is g (taken over): a matcher for r and for each of its
 * group's other choices. 0 or an error. */
int sched_req_set_grammar(const struct text *tx, struct sched_req *r, struct grammar *g,
                          struct kvd_error *e);

/* Copies (one allocation each; NULL when out of memory). param is how the
 * request named the field ("text", "prompt", "messages"). */
struct sched_prompt *sched_prompt_text(const char *param, const char *s, size_t len, int add_bos);
struct sched_prompt *sched_prompt_chat(const char *param, const struct chat_msg *msgs, size_t n,
                                       bool replace);

/* Seq mode, first step (kvmm lock held): connection r->conn's sequence seq
 * becomes the request's (its executor owner's). Every position must have
 * its token id (committed), so the executor can recompute and commit after
 * it. *n_tokens: how many it holds. A failure leaves it untouched. */
int sched_req_lend_seq(struct kvmm *mm, struct sched_req *r, uint64_t seq, size_t *n_tokens,
                       struct kvd_error *e);

/* Puts the prompt's n tokens into r->toks: alone, or after a lent
 * sequence's tokens, or (replace) in place of them but for their longest
 * common prefix with the prompt (the tokens already there are not computed
 * again). Refuses a prompt that leaves no room in the context. kvmm lock
 * held when r has a lent sequence. param names the prompt in errors. */
int sched_req_set_prompt(struct kvmm *mm, struct sched_req *r, const uint32_t *toks, size_t n,
                         bool replace, const char *param, struct kvd_error *e);

/* Renders and tokenizes r->prompt with tx, then sched_req_set_prompt
 * (taking the kvmm lock itself); frees r->prompt. Compiles r->constraint
 * (sched_req_set_grammar) and frees it. Any thread but the loop's. */
int sched_req_prepare(struct kvmm *mm, const struct text *tx, struct sched_req *r,
                      struct kvd_error *e);

#endif
