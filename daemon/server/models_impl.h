/* models internals: the registry's structs, shared by models.c (the loop
 * thread's side: decisions, waits, the keep-alive timer) and models_load.c
 * (what runs off the loop: making each model's kvmm at start, loading and
 * unloading on the loader thread). */
#ifndef KVD_MODELS_IMPL_H
#define KVD_MODELS_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include <event2/event.h>

#include "kvd/protocol.h"
#include "models.h"

struct models_wait {
    struct models_wait *next;
    uint64_t owner;
    uint64_t t0_ns; /* when it began (queue-timeout) */
    models_ready_fn fn;
    void *ud;
};

enum mjob_kind { MJOB_LOAD, MJOB_UNLOAD };

/* One job of the loader thread, and its outcome. */
struct mjob {
    struct mjob *next;
    enum mjob_kind kind;
    struct models_entry *e;
    int rc;
    struct kvd_error err;
    struct model *model; /* load: what it made */
    struct exec *ex;
    size_t moved, dropped; /* unload: device blocks */
    uint32_t need;         /* load: the device pages it needed (mload_fits) */
    double ms;             /* how long it took */
};

struct models_entry {
    struct models *ms;
    uint32_t idx;
    struct options_model conf;         /* keep_alive_s resolved (never OPTIONS_KEEP_DEFAULT) */
    char (*allowed)[KVD_MAX_NAME + 1]; /* (n_allowed) owned: conf.tenants parsed */
    size_t n_allowed;
    struct model_hparams probe; /* from the header (model_probe) */
    struct model_hparams hp;    /* the loaded model's, once it has loaded */
    bool loaded_once;
    struct text *text;      /* owned */
    struct kvmm *mm;        /* owned */
    uint64_t weight_device; /* device bytes of its weights: the header's, then the load's */

    /* Speculative decoding (fixed at start, models_new): its draft, another
     * model of the daemon ([model:NAME] draft = OTHER; its weights shared
     * with it) or a file of its own (--draft-model, the daemon's one
     * model); the cap on its draft's KV pool (pages of the budget, taken as
     * needed: mload_budget); its requests' default kind (enum
     * options_spec). */
    struct models_entry *draft; /* NULL: none, or --draft-model */
    const char *draft_path;     /* the draft's GGUF; NULL: no draft */
    struct model_hparams draft_probe;
    char draft_name[OPTIONS_MODEL_NAME + 1]; /* what hello shows: the model's name, or
                                              * --draft-model's general.name / file name */
    uint64_t draft_weight_device;            /* the draft's weights on the device (its header's) */
    uint64_t draft_kv_bytes;                 /* the most device bytes of pages its KV takes */
    int draft_dtype;                         /* enum kv_dtype of the draft's KV */
    int spec_kind;

    /* The loader's (models_load.c; also models_start's preloads and
     * models_stop, before and after the loader thread runs): its weights,
     * loaded once for whoever needs them (its own executor, and those of
     * the models it drafts for), with the count of those; whether its
     * loaded executor holds a reference on its draft's weights. */
    struct model *w;
    uint32_t w_refs;
    bool holds_draft;
    /* Device pages of the budget charged for what is not KV: its weights
     * (while e->w is loaded), and while its executor lives its forward
     * scratch and its draft's scratch (and the draft's weights when they
     * are a file of its own). Its draft's KV is a pool on the budget, as
     * its own KV is, so it is not charged here. */
    uint32_t w_pages, x_pages;
    uint64_t scratch_bytes; /* its executor's forward scratch (and its draft's): estimated,
                             * then as allocated once it loaded (loader thread) */

    /* the loop thread's (the loader's own while a job of it runs) */
    enum models_state state;
    struct model *model; /* owned while loaded */
    struct exec *ex;     /* owned while loaded */
    bool want_load;      /* requests wait for it: load it once memory allows */
    bool retried;        /* its last load failed for memory and is tried again */
    /* Its load found too little of the budget while the other models were
     * in use: it waits until one is idle or mem_need pages are free. */
    bool mem_wait;
    uint32_t mem_need;
    uint64_t last_used_ns, idle_since_ns;
    struct models_wait *waits, *waits_tail;
    uint32_t n_waits;

    /* counters (loop thread) */
    uint64_t loads, unloads, load_failures, moved, dropped;
    double load_ms, unload_ms;
    char last_error[KVD_ERROR_MSG_MAX];
};

struct models {
    struct models_conf conf;
    struct options opts;    /* a copy: the settings every model's executor uses */
    struct models_entry *v; /* (n) owned */
    size_t n;
    struct server *srv; /* not owned; from models_start */
    /* The one device (and host) page budget: every model's weights,
     * scratch and KV pages (owned; freed after the kvmms). */
    struct kvpages *pages;
    struct exec_arbiter *arb;

    /* the loader thread */
    pthread_t th;
    bool th_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct mjob *jobs, *jobs_tail; /* waiting for the loader (under mu) */
    struct mjob *done;             /* finished, for the loop (under mu) */
    bool stop;                     /* under mu */
    bool draining;                 /* loop thread: no new loads */

    struct event *ev_done, *ev_kick, *ev_tick;
};

/* models_load.c. At start, after mload_drafts: every model's header, and
 * the page budget they share (ms->pages): --device-bytes, else the weights
 * and scratch of every model with the KV of the block options. */
int mload_budget(struct models *ms, struct kvd_error *err);
/* Then the kvmm and text of entry e, with the disk and remote tiers of the
 * options. */
int mload_prepare(struct models *ms, struct models_entry *e, struct kvd_error *err);
/* The loader's work, on whatever thread calls it (the loader thread; the
 * caller's for the preloads): loads j->e into j->model and j->ex, or
 * unloads it (its model and executor given in j). Fills j->rc, j->err,
 * j->ms and the counts. */
void mload_run(struct models *ms, struct mjob *j);
/* The loader thread's body. */
void *mload_main(void *arg);
/* The executors' idle callback (exec_conf.on_idle): wakes the loop. */
void mload_kick(void *ud);
/* Device bytes model e needs besides its KV pages (and its draft's): its
 * weights, its executor's scratch, its draft's scratch and weights (a named
 * draft's weights too: they are loaded with it when not loaded yet). */
uint64_t mload_fixed_bytes(const struct models *ms, const struct models_entry *e);
/* What of it is charged with its executor (mload_fixed_bytes less the
 * weights, its own and a named draft's). */
uint64_t mload_extra_bytes(const struct models_entry *e);
/* The most KV e's pool may hold: its max-device-bytes (else the budget)
 * less its fixed bytes in whole pages. */
uint64_t mload_kv_cap(const struct models *ms, const struct models_entry *e);
/* Takes bytes (in whole pages, *pages set) of the device budget for model
 * e's `what`, the models' KV pools first asked to give back cached pages
 * when the budget is short: 0, or KVD_ENOMEM with the reason in err. */
int mload_charge(struct models *ms, const struct models_entry *e, uint64_t bytes, uint32_t *pages,
                 const char *what, struct kvd_error *err);
void mload_uncharge(struct models *ms, uint32_t *pages);
/* Whether the budget has (or the other models' pools give back, moving
 * cached blocks to their host tiers) the pages e's load takes: its weights
 * and its draft's not loaded yet, its scratch and draft, and a step's KV.
 * *need: those pages. 0 or KVD_ENOMEM. */
int mload_fits(struct models *ms, const struct models_entry *e, uint32_t *need,
               struct kvd_error *err);
uint32_t mload_pages_of(const struct models *ms, uint64_t bytes);
/* A loaded model's executor (its draft state with it) and its references
 * on weights: its own, its draft's (loader thread, or where mload_run
 * runs). */
void mload_discard(struct models *ms, struct models_entry *e, struct exec *ex);
/* models_new: each model's draft (--draft-model, [model:NAME] draft) found
 * and checked (the same vocabulary, from the files' headers), and each
 * model's default kind of speculation. 0, or KVD_EBADREQ with the
 * reason. */
int mload_drafts(struct models *ms, struct kvd_error *err);

#endif
