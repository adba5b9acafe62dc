/* ops: the request handlers, one per op, in a table the server dispatches
 * from. The block API, hello/stats and the admin ops are built in
 * (ops_block.c, ops_info.c, ops_admin.c); generate/cancel start as store-mode
 * answers and are replaced by the executor with server_op_register(). */
#ifndef KVD_OPS_H
#define KVD_OPS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <msgpack.h>

#include "kvmm.h"
#include "proto.h"

struct server;
struct conn;
struct config;
struct server_obs;
struct models;
struct models_entry;

/* What the handlers read of the server that runs them: plain data and a
 * callback, so no handler sees the server's insides (server_impl.h is
 * server.c's and conn.c's alone). The server fills one when it is created;
 * the fuzz targets fill their own, without a server. Loop thread only. */
struct ops_host {
    struct server *srv; /* for ops that hand work to other threads (server_post,
                           server_queue_admit); NULL without a server */
    struct kvmm *mm;
    const char *backend;          /* the backend's name (hello, stats) */
    uint32_t max_frame;           /* every reply must fit in one frame */
    const struct config *cfg;     /* the access rules (shared namespaces); SIGHUP
                                     replaces its contents, not the pointer */
    struct models *models;        /* the daemon's models (models.h); NULL in store mode */
    const struct server_obs *obs; /* stats: connections, requests, tenants, roofline,
                                     accounting (server.h) */
    /* admin_shutdown: starts the same drain as SIGTERM once the loop runs
     * again, so the reply goes first. NULL: admin_shutdown is unsupported. */
    void (*shutdown)(void *ctx);
    void *ctx; /* shutdown's */
};

/* Everything a handler needs. Runs on the loop thread; the handler takes
 * kvmm_lock itself around its kvmm calls. */
struct ops_ctx {
    const struct ops_host *host;
    struct server *srv; /* host->srv */
    struct conn *conn;
    struct kvmm *mm; /* host->mm; the block ops set their sequence's model's (ops_pick_pool) */
    void *op_ctx;    /* the ctx given at registration */
    const struct ops_entry *ent; /* this op's */
    bool resumed;                /* run again after its model loaded (ops_defer) */

    /* the request */
    uint64_t conn_id;          /* the kvmm owner of this connection's sequences */
    uint64_t id;               /* the client's request id */
    const msgpack_object *req; /* the request map */

    /* the peer, as the config resolved it */
    uid_t uid;
    gid_t gid;
    pid_t pid;
    uint32_t tenant;         /* kvmm tenant id */
    uint32_t ns;             /* the tenant's own namespace */
    const char *tenant_name; /* "uid:1000" or the [tenant:NAME] name */
    bool admin;

    /* the reply: on success the handler packs one whole reply map with pk
     * (proto_reply_begin + its pairs); the server frames it. On failure it
     * returns the code with err filled and whatever it packed is discarded. */
    msgpack_sbuffer *out;
    msgpack_packer *pk;
    /* OPS_PENDING: how much the request counts against its tenant's
     * max-queued-per-tenant (a generate's choices; 0 counts 1) */
    uint32_t pending_units;
    struct kvd_error err;
};

/* Returns 0 (reply packed), an enum kvd_err (err filled), or OPS_PENDING:
 * the request was taken by another thread, which answers later with a
 * FINAL server_post; until then it counts as in flight on the connection. */
#define OPS_PENDING 1000
typedef int (*ops_fn)(struct ops_ctx *c);

/* Registration flags. */
#define OPS_ADMIN 1u /* permission_denied unless the peer is an admin */
/* Before the handler runs, c->mm and c->ns become those of the request's
 * model: its `seq` handle's, else the one its `model` names (the first
 * model when none). With OPS_LOADED the model must be loaded: a request for
 * one that is not waits for its load (ops_defer). No-op in store mode. */
#define OPS_POOL 2u
#define OPS_LOADED 4u

struct ops_entry {
    char name[32];
    size_t len; /* strlen(name), so lookups compare lengths first */
    ops_fn fn;
    void *ctx;
    unsigned flags;
};

struct ops_table {
    struct ops_entry *v; /* (n) owned */
    size_t n;
};

int ops_table_set(struct ops_table *t, const char *name, ops_fn fn, void *ctx, unsigned flags);
const struct ops_entry *ops_table_find(const struct ops_table *t, const char *name, size_t len);

/* A parsed request's id and op, resolved to its handler with the checks and
 * messages every transport gives (a bad id, a bad or unknown op, an admin op
 * from a non-admin uid). 0 with *id and *ent set; else a protocol code with
 * e's message saying why, and *id the request's id when it had a valid one
 * (0 otherwise). */
int ops_resolve(const struct ops_table *t, const msgpack_object *root, bool admin, unsigned uid,
                uint64_t *id, const struct ops_entry **ent, struct kvd_error *e);
/* Who a request runs as (what ops_run puts in the ops_ctx). */
struct ops_caller {
    struct conn *conn; /* NULL outside a socket connection (the fuzz targets) */
    uint64_t conn_id;  /* the kvmm owner of the caller's sequences */
    uid_t uid;
    gid_t gid;
    pid_t pid;
    uint32_t tenant, ns;
    const char *tenant_name;
    bool admin;
    bool resumed; /* ops_defer's second run */
};

/* Runs ent's handler (ops_resolve's) for host on request req with id as
 * `who`, appending one frame to sb: the handler's reply, or an error frame
 * with its code and message ("<op> failed" when it gave none; "reply too
 * large" for a reply past the frame limit). Returns 0, OPS_PENDING (nothing
 * appended: answered later; *units, when given, what it counts against its
 * tenant's queue, at least 1), or the code of the error frame; when not
 * even that fits, sb is back at its size on entry. */
int ops_run(const struct ops_host *host, const struct ops_entry *ent, const struct ops_caller *who,
            uint64_t id, const msgpack_object *req, msgpack_sbuffer *sb, uint32_t *units);
void ops_table_free(struct ops_table *t);

/* ---- several models (ops_model.c) ---------------------------------------- */

/* The model a request names (its `model`, else the daemon's first): NULL
 * with 0 in store mode; KVD_ENOTFOUND / KVD_EPERM as models_resolve. */
int ops_pick_model(struct ops_ctx *c, struct models_entry **out);
/* For the ops on a sequence: c->mm and c->ns become those of the model its
 * handle (`seq`, key `key`) belongs to (store mode: unchanged). 0, or
 * KVD_ENOTFOUND for a handle no model made. */
int ops_pick_pool(struct ops_ctx *c, const char *key);
/* OPS_POOL's work (need_loaded: OPS_LOADED): 0, OPS_PENDING (deferred)
 * or an error. */
int ops_select_pool(struct ops_ctx *c, bool need_loaded);
/* c->mm and c->ns become model e's (NULL: unchanged). */
int ops_use_model(struct ops_ctx *c, struct models_entry *e);
/* The request waits for model e to load (models_wait), then runs again
 * (resumed) and its reply goes out then: returns OPS_PENDING, or an error.
 * A load failure, the queue timeout or shutdown answers it with an error.
 * It counts as in flight for max-queued-per-tenant: admitted false checks
 * that first (the handler has not). */
int ops_defer(struct ops_ctx *c, struct models_entry *e, bool admitted);
/* `cancel` of request id of connection conn_id while it waits for its
 * model: it is answered `cancelled` now. Whether there was one. */
bool ops_defer_cancel(struct models *ms, uint64_t conn_id, uint64_t id);
/* Registers every built-in op. */
int ops_register_builtin(struct ops_table *t);

/* Built-in handlers, by file. */
int ops_hello(struct ops_ctx *c);
int ops_stats(struct ops_ctx *c);
int ops_seq_open(struct ops_ctx *c);
int ops_seq_match(struct ops_ctx *c);
int ops_seq_extend(struct ops_ctx *c);
int ops_kv_write(struct ops_ctx *c);
int ops_kv_read(struct ops_ctx *c);
int ops_seq_commit(struct ops_ctx *c);
int ops_seq_fork(struct ops_ctx *c);
int ops_seq_info(struct ops_ctx *c);
int ops_seq_offload(struct ops_ctx *c);
int ops_seq_restore(struct ops_ctx *c);
int ops_seq_close(struct ops_ctx *c);
int ops_kv_export(struct ops_ctx *c);         /* ops_export.c */
int ops_kv_export_release(struct ops_ctx *c); /* ops_export.c */
int ops_admin_evict(struct ops_ctx *c);
int ops_admin_check(struct ops_ctx *c);
int ops_admin_shutdown(struct ops_ctx *c);
/* Store mode: generate is unsupported, cancel finds nothing. */
int ops_generate_store(struct ops_ctx *c);
int ops_cancel_store(struct ops_ctx *c);

#endif
