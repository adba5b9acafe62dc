/* models: the daemon's models by name (docs/operations.md "Several
 * models"). Each model has, for the daemon's life, its memory manager (its
 * trees, host tier and disk tier, made at start from the file's header) and
 * its text side (tokenizer, chat template); while it is loaded, also its
 * weights and its executor, charged to the one page budget its KV pages
 * come from too (models_budget.c). A model loads at start
 * (preload) or at its first request, and unloads when it has been idle for
 * keep-alive-s or when another model needs its memory (least recently used
 * first, never one in use); unloading moves its cached device blocks to the
 * host tier, so it reloads warm.
 *
 * Loads and unloads run on the loader thread (models_load.c), never on the
 * loop or an executor; the loaded models keep serving meanwhile. Everything
 * else here runs on the loop thread: the decisions (what to load, what to
 * unload), the waits of requests for a model that is not loaded, the
 * keep-alive timer. */
#ifndef KVD_MODELS_H
#define KVD_MODELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd/status.h"
#include "kvmm.h"
#include "model.h"
#include "options.h"

struct backend;
struct roofline;
struct acct;
struct workpool;
struct server;
struct exec;
struct text;
struct kvevents;

enum models_state { MODELS_UNLOADED, MODELS_LOADING, MODELS_LOADED, MODELS_UNLOADING };
/* "unloaded", "loading", "loaded", "unloading" */
const char *models_state_name(enum models_state s);

struct models;
struct models_entry;

struct models_conf {
    struct backend *be;
    const struct options *opts; /* copied where needed */
    struct roofline *rl;        /* not owned: every executor records into it */
    struct acct *acct;          /* not owned */
    struct workpool *text_pool; /* not owned: the executors' prompt workers */
    struct workpool *disk_pool; /* not owned: prefetches and session saves; NULL: none */
};

/* Every model of opts (the plain --model first, then the named ones): its
 * header read, the page budget made, its text opened, its kvmm made (no
 * device page until it loads; the
 * disk and remote tiers of opts opened for it). Nothing is loaded and no
 * thread runs yet. 0, or an enum kvd_err with e naming the model. */
int models_new(const struct models_conf *c, struct models **out, struct kvd_error *e);
/* Starts the loader thread and the keep-alive timer on srv's loop, and the
 * preloads (the plain --model PATH and `preload` models), which finish
 * before it returns. 0, or the first preload's failure. */
int models_start(struct models *ms, struct server *srv, struct kvd_error *e);
/* Shutdown, on the loop: every wait is answered cancelled, and every
 * loaded executor is drained (exec_drain). */
void models_drain(struct models *ms);
/* After the loop has stopped: stops the loader thread and unloads every
 * model (executors, weights). The kvmms stay for models_free (the disk
 * tier's write-back reads them). */
void models_stop(struct models *ms);
void models_free(struct models *ms);

/* ---- finding a model ----------------------------------------------------- */

size_t models_count(const struct models *ms);
struct models_entry *models_at(struct models *ms, size_t i);
/* The model whose sequence handle this is (the handle's tag bits), or
 * NULL. */
struct models_entry *models_of_handle(struct models *ms, uint64_t seq);
/* The model a request names (name, len bytes; have false: it named none):
 * none named is the first model. strict false (the HTTP API): with one
 * model any name is that model, as OpenAI clients send whatever name they
 * were given. KVD_ENOTFOUND for a name no model has, KVD_EPERM when the
 * tenant may not use it (its `tenants`). */
int models_resolve(struct models *ms, const char *name, size_t len, bool have, bool strict,
                   const char *tenant, struct models_entry **out, struct kvd_error *e);
/* The context of the model a request names, as models_resolve (strict
 * false) would pick it, from what never changes (any thread); for a name
 * no model has, the largest (the request is refused by name later). */
uint32_t models_context_of(struct models *ms, const char *name, size_t len);
/* The text side (tokenizer, chat template, tool-call family) of the model
 * models_context_of picks, the first model's for a name no model has (NULL:
 * no models). Any thread: the texts are opened at start. */
const struct text *models_text_of(struct models *ms, const char *name, size_t len);
/* Whether `tenant` may use e (a sub-tenant FRONT/NAME when FRONT may). */
bool models_allows(const struct models_entry *e, const char *tenant);

/* ---- one model (loop thread unless said) --------------------------------- */

const char *models_name(const struct models_entry *e);        /* any thread */
uint32_t models_index(const struct models_entry *e);          /* any thread */
struct kvmm *models_kvmm(struct models_entry *e);             /* any thread */
const struct text *models_text(const struct models_entry *e); /* any thread */
/* Its hyperparameters: the loaded model's once it has loaded (fingerprint
 * and the backend's weight bytes), the header's before. */
const struct model_hparams *models_hparams(const struct models_entry *e);
enum models_state models_state(const struct models_entry *e);
/* Its executor while loaded, else NULL. */
struct exec *models_exec(struct models_entry *e);
/* A request for it arrived: it is the most recently used. */
void models_touch(struct models_entry *e);

/* ---- waiting for a model --------------------------------------------------
 * A request for a model that is not loaded waits: models_wait starts the
 * load (unloading idle models first when the device budget needs their
 * memory) and calls fn on the loop thread once: rc 0 when it is loaded
 * (submit now), or the load's failure, KVD_EBUSY when it waited longer
 * than the queue timeout (queue-timeout-ms), KVD_ECANCELLED at shutdown.
 * owner: the connection (or HTTP client) it belongs to; models_cancel_owner
 * ends its waits with rc MODELS_GONE (the owner is gone: answer nobody,
 * just free what ud holds). */
#define MODELS_GONE (-1)
typedef void (*models_ready_fn)(void *ud, int rc, const struct kvd_error *err);
int models_wait(struct models_entry *e, uint64_t owner, models_ready_fn fn, void *ud,
                struct kvd_error *err);
void models_cancel_owner(struct models *ms, uint64_t owner);
/* Ends the waits of owner for which match(ud, arg) is true with rc
 * KVD_ECANCELLED (a `cancel` of a request waiting for its model). Returns
 * how many. */
size_t models_cancel_waits(struct models *ms, uint64_t owner, bool (*match)(void *ud, void *arg),
                           void *arg);

/* ---- what stats and metrics show ----------------------------------------- */

struct models_info {
    const char *name, *path;
    enum models_state state;
    bool loaded_once;      /* it has loaded at least once (fingerprint known) */
    uint64_t weight_bytes; /* the tensors' bytes */
    uint64_t weight_device_bytes;
    uint64_t kv_device_bytes;      /* the device pages its KV pool holds now */
    uint32_t kv_device_blocks;     /* blocks on the device now */
    uint64_t charged_device_bytes; /* pages charged for its weights, scratch and draft */
    uint64_t block_bytes;
    uint32_t keep_alive_s; /* OPTIONS_KEEP_FOREVER: never */
    double idle_s;         /* loaded and idle for this long (0 when in use) */
    uint64_t loads, unloads, load_failures;
    double load_ms_last, unload_ms_last;
    uint64_t moved_at_unload, dropped_at_unload; /* device blocks, all unloads */
    uint32_t waiting;                            /* requests waiting for it to load */
    /* speculative decoding: its requests' default ("off", "ngram",
     * "draft"), its draft (another model's name, or --draft-model's
     * general.name or file name; NULL: none), the device pages the
     * draft's KV holds now (pages of the budget; 0 while unloaded) and the
     * most it may take (draft-kv-share) */
    const char *spec_mode;
    const char *draft;
    uint64_t draft_kv_bytes, draft_kv_max_bytes;
    uint32_t spec_max_batch;            /* --spec-max-batch */
    char last_error[KVD_ERROR_MSG_MAX]; /* the last load failure ("" none) */
};
void models_info(struct models_entry *e, struct models_info *out);
/* The device page budget's bytes taken now (weights, scratch, KV pages)
 * and its size. */
void models_device_use(struct models *ms, uint64_t *used, uint64_t *budget);
/* The page budget every model's memory comes from (models_new made it). */
struct kvpages *models_pages(struct models *ms);

#endif
