/* Shared fixture of the in-process executor tests: a small random GGUF
 * model made by kvd-gguf-gen, the cpu backend, a kvmm sized by the test, an
 * executor whose sink records every request's events and reply, and
 * helpers that build generate requests as msgpack maps (so they go through
 * the same parsing and validation as the daemon's). */
#ifndef KVD_TEST_EXEC_FIXTURE_H
#define KVD_TEST_EXEC_FIXTURE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "ops_generate.h"

#define FX_MAX_REQ 256
#define FX_MAX_TOK 1024

/* What the sink saw of one request (index = request id). */
struct fx_result {
    bool done;
    int finish; /* enum sched_finish */
    int err;
    char msg[KVD_ERROR_MSG_MAX];
    uint32_t toks[FX_MAX_TOK];
    size_t n;
    uint32_t streamed[FX_MAX_TOK];
    size_t n_streamed, n_events;
    size_t prompt, cached, completion;
    bool seq_returned;
    uint64_t seq;
    uint32_t order; /* 1 for the first reply since fx_reset_results, 2, ... */
};

struct fx_model {
    char dir[64];
    char path[128];
    uint32_t vocab, ctx;
};

struct fx {
    struct fx_model *model;
    struct backend *be;
    struct model *m;
    struct kvmm *mm;
    struct exec *ex;
    struct draft *draft; /* fx_draft_path's model, or NULL (the executor owns it) */
    uint32_t tenant, ns;
};

/* Writes a model (layers, embd, heads, kv_heads, ff, vocab, ctx, seed) into
 * a fresh temporary directory. 0 on success. */
int fx_model_make(struct fx_model *fm, uint32_t layers, uint32_t embd, uint32_t heads,
                  uint32_t kv_heads, uint32_t ff, uint32_t vocab, uint32_t ctx);
/* The same with kvd-gguf-gen's arguments as given (shape, type, seed...);
 * vocab and ctx are recorded for the tests. */
int fx_model_make_args(struct fx_model *fm, uint32_t vocab, uint32_t ctx, const char *args);
void fx_model_remove(struct fx_model *fm);
/* The small model several exec tests share (2 layers, embd 64, 4 heads, 2
 * KV heads, ff 128, vocab 256, context 256), made by a CMocka group setup
 * and removed by its teardown. */
extern struct fx_model fx_small;
int fx_small_setup(void **state);
int fx_small_teardown(void **state);

/* Loads the model, makes a kvmm of the model's geometry (block_tokens 16)
 * with the given pools, one tenant (weight 1, unlimited) and the executor. */
/* The executor's queue timeout for the next fx_open (0: its default). */
extern uint32_t fx_queue_timeout_ms;
/* Speculative decoding for the next fx_open (zero: off), and the draft
 * model's file (NULL: none) with its KV arena's blocks. */
extern struct spec_conf fx_spec;
extern const char *fx_draft_path;
extern uint32_t fx_draft_blocks;
/* The executor's overlap for the next fx_open (zero: AUTO, off on cpu). */
extern enum exec_overlap fx_overlap;
int fx_open(struct fx *f, struct fx_model *fm, uint32_t device_blocks, uint32_t host_blocks,
            uint32_t step_tokens, uint32_t max_seqs);
void fx_close(struct fx *f);
/* CMocka setup/teardown: *state is a zeroed struct fx that the test opens
 * with fx_open (and may close and reopen); the teardown closes whatever is
 * open and frees it, also after a failed assert. */
int fx_setup(void **state);
int fx_teardown(void **state);
void fx_reset_results(void);
struct fx_result *fx_result(uint64_t id);
/* Waits until request id has its reply (no time limit: ctest's timeout is
 * the safety net; nothing here is a timed assertion). */
struct fx_result *fx_wait(uint64_t id);

struct fx_gen {
    const uint32_t *toks;
    size_t n_toks;
    bool no_tokens;
    uint32_t max_tokens; /* 0: absent */
    double temperature;  /* < 0: absent */
    uint32_t top_k;
    double top_p; /* 0: absent */
    bool has_seed;
    uint64_t seed;
    const uint32_t *stop;
    size_t n_stop;
    bool stream;
    int32_t priority;
    bool has_seq;
    uint64_t seq;
    uint64_t conn;   /* default 1 */
    bool has_tenant; /* else the fixture's tenant */
    uint32_t tenant, ns;
    const char *speculative; /* the request's `speculative`, or NULL: absent */
};
/* Adds a tenant (unlimited quotas) with this weight; its id and namespace. */
int fx_tenant(struct fx *f, const char *name, uint32_t weight, uint32_t *tenant, uint32_t *ns);

/* Freezes the executor thread inside the sink once streaming request id
 * has had n_events token events (between two steps, no lock held), until
 * fx_resume; fx_wait_paused waits for that. Makes interleavings exact. */
void fx_pause_at(uint64_t id, size_t n_events);
void fx_wait_paused(void);
void fx_resume(void);

/* Builds and submits; returns the build's status (err filled). */
int fx_submit(struct fx *f, uint64_t id, const struct fx_gen *g, struct kvd_error *err);
/* fx_submit, then fx_wait for it: its result. A refused submit fails the
 * test (CMocka). */
struct fx_result fx_run1(struct fx *f, uint64_t id, const struct fx_gen *g);
/* Waits until the executor holds no live request. */
void fx_wait_idle(struct fx *f);
/* kvmm_check passes, `seqs` sequences are open and no device block is in
 * use (CMocka asserts). */
void fx_assert_mm_clean(struct fx *f, uint32_t seqs);
/* Builds from a raw msgpack map payload (for validation tests). */
int fx_build_raw(struct fx *f, const void *map, size_t len, struct kvd_error *err);

/* A deterministic prompt of n tokens (ids < 256), different for each salt. */
void fx_prompt(uint32_t *p, size_t n, uint32_t salt);

#endif
