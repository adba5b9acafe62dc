/* conn: one client connection: decoding frames from its bufferevent,
 * batching replies, flow control (reading pauses while its replies go
 * unread; the unread-output overflow flag), the ids of its requests in
 * flight, and teardown. It knows nothing of the server: its owner hands
 * every connection a struct conn_env at conn_new, whose callbacks run a
 * request, follow the counts of requests in flight and of buffered bytes,
 * and release what the connection owned when it closes. Loop thread only. */
#ifndef KVD_CONN_H
#define KVD_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <event2/bufferevent.h>
#include <event2/event.h>
#include <msgpack.h>

#include "kvd/protocol.h"

struct conn;

/* What a connection calls back into its owner. */
struct conn_cbs {
    /* Runs one request: p[0, len) is a frame without its length. Replies
     * go to conn_reply_buf(c) (or conn_send_error). false: the connection
     * must close (the message could not be parsed). */
    bool (*dispatch)(void *ctx, struct conn *c, const uint8_t *p, size_t len);
    /* c's requests in flight of `tenant` (the connection's own, or the
     * sub-tenant a trusted front end named) changed by delta, which count
     * `units` against the tenant (conn_pending_add/remove). */
    void (*pending)(void *ctx, struct conn *c, uint32_t tenant, long delta, long units);
    /* The bytes in c's input and output buffers changed. */
    void (*buffered)(void *ctx, struct conn *c, size_t added, size_t deleted);
    /* c is being freed, however it ended (still whole: its id, identity
     * and n_pending are valid): the owner stops using it and releases what
     * it owned. */
    void (*closed)(void *ctx, struct conn *c);
};

/* Shared by all of an owner's connections; it outlives them. */
struct conn_env {
    const struct conn_cbs *cbs;
    void *ctx; /* the callbacks' */
    struct event_base *base;
    uint32_t max_frame;         /* a longer frame closes the connection */
    uint64_t max_unread_output; /* overflow clears when unread output falls under half */
    size_t out_high;            /* queued replies above which reading pauses */
    bool no_read;               /* shutting down: a paused connection does not read again */
    /* Replies of the connection being processed (out_conn), sent in one
     * write when conn_process() is done with its input; empty otherwise. */
    msgpack_sbuffer out;
    struct conn *out_conn;
};

struct conn_pend {
    uint64_t id;
    uint32_t tenant; /* the tenant its requests count against */
    uint32_t count;  /* 0: empty slot */
    uint32_t units;  /* what they count against the tenant (a generate's choices) */
};

/* One client connection, from conn_new until conn_free. Owns its
 * bufferevent and pending-id table. The owner keeps it in its own list and
 * hash (prev, next, hnext) and fills in the peer's identity. */
struct conn {
    struct conn *prev, *next; /* the owner's list */
    struct conn *hnext;       /* the owner's hash chain by id */
    struct conn_env *env;
    uint64_t id; /* kvmm owner of its sequences; never has bit 63 set */
    struct bufferevent *bev;

    uid_t uid;
    gid_t gid;
    pid_t pid;
    uint32_t tenant, ns;
    char tenant_name[KVD_MAX_NAME + 1];
    bool admin;

    /* Ids of requests in flight elsewhere (a client may reuse an id): an
     * open-addressing table of (id, count), load at most 1/2, so a final
     * reply finds its id in O(1) however deep the pipeline. */
    struct conn_pend *pending; /* (cap_pending) */
    size_t n_pending;          /* requests (sum of counts) */
    size_t n_pend_ids, cap_pending;

    bool paused;     /* reading stopped: output over the high watermark */
    bool overflow;   /* unread output passed max-unread-output: generates ended */
    size_t buffered; /* bytes in its input and output buffers */
    struct evbuffer_cb_entry *in_cb, *out_cb;
    bool closing; /* no more input; freed once output is flushed */

    /* Descriptors a reply carries (kv_export, SCM_RIGHTS): the handler
     * hands them over with conn_reply_fds; after the request the owner
     * calls conn_fds_attach, which queues the reply's frame here. The head
     * frame goes out with one sendmsg once everything before it has been
     * written, the descriptors riding on its first byte; output produced
     * meanwhile waits behind it (each frame's `after`). */
    struct conn_fdframe *fdq_head, *fdq_tail;
    struct event *fd_ev; /* write readiness while the socket is full */
    int *reply_fds;      /* (n_reply_fds) given by the running handler */
    size_t n_reply_fds;

    /* A frame larger than one read, received into its own buffer as its
     * bytes arrive (conn.c big_frame_*), so no single callback copies or
     * faults in the whole of it. Its bytes count in `buffered`. */
    uint8_t *big;    /* (big_len) owned; NULL when no such frame is pending */
    size_t big_len;  /* the frame's payload bytes (from its header) */
    size_t big_have; /* payload bytes received so far */
};

/* A connection with this id on socket fd (taken over: closed on failure
 * too), its buffers watched, neither reading nor writing until conn_start
 * (or conn_close_after_flush). NULL when out of memory. */
struct conn *conn_new(struct conn_env *env, int fd, uint64_t id);
/* Starts reading requests and writing replies. */
void conn_start(struct conn *c);
/* Calls env->cbs->closed, then frees c and everything it owns. */
void conn_free(struct conn *c);
/* Where a request's replies go while conn_process runs. */
msgpack_sbuffer *conn_reply_buf(struct conn *c);
/* Appends an error frame to the connection's output. */
void conn_send_error(struct conn *c, uint64_t id, int code, const char *msg);
/* Appends raw bytes (complete frames) to the output. */
int conn_send(struct conn *c, const void *data, size_t len);
/* The reply being built carries these descriptors (taken over: closed by
 * the connection whatever happens). */
int conn_reply_fds(struct conn *c, int *fds, size_t n);
/* After a request whose reply frame starts at offset `at` of the reply
 * buffer: when descriptors were given, the frame leaves the batch and is
 * queued to go out with them (ok), or they are closed (!ok). */
void conn_fds_attach(struct conn *c, size_t at, bool ok);
/* Stops reading; the connection is freed once its output is flushed. */
void conn_close_after_flush(struct conn *c);
/* Processes complete frames already buffered (after a pause or at shutdown). */
void conn_process(struct conn *c);
/* Request req_id is in flight / answered (FINAL); remove: false when it was
 * not in flight. */
int conn_pending_add(struct conn *c, uint64_t req_id, uint32_t tenant, uint32_t units);
bool conn_pending_remove(struct conn *c, uint64_t req_id);
/* Some id in flight on c (false when none). */
bool conn_pending_any(const struct conn *c, uint64_t *req_id);

#endif
