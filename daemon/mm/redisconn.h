/* redisconn: a blocking Redis client for one thread, to a single node or a Redis Cluster
 * (docs/remote.md "The Redis client").
 *
 * Not thread-safe: callers hold one per thread. Every call is bounded by timeout_ms (each
 * connect, and each round trip: one pipelined batch written to a node and all its replies
 * read back, measured against a deadline, not per read()). On a timeout or a broken
 * connection the call fails, the node's connection is dropped and re-made lazily on the next
 * call, at most one connect attempt per node per timeout_ms (no reconnect storm: a call in
 * between fails at once with the last attempt's error).
 *
 * Error codes (struct kvd_error's code; the message always starts with "redis"):
 *   KVD_EBADREQ    a bad URL or bad arguments (rediss://, port, empty host list, n too big)
 *   KVD_EBUSY      a timeout ("redis: timeout after N ms ...")
 *   KVD_EPERM      AUTH refused by the server (wrong user or password)
 *   KVD_EINTERNAL  everything else: connection refused or broken, a protocol error, a reply
 *                  of the wrong type, a server error (OOM, CLUSTERDOWN, too many redirects)
 *
 * Keys and values are binary (lengths, never C strings). */
#ifndef KVD_REDISCONN_H
#define KVD_REDISCONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct redisconn;

struct redisconn_conf {
    /* redis://[user:password@]host:port[/db]   (":password@" alone: the default user)
     * redis-cluster://[user:password@]host:port[,host:port...]   (seed nodes; no /db)
     * rediss:// is refused: this hiredis has no TLS. */
    const char *url;
    uint32_t timeout_ms; /* > 0 */
};

struct redisconn_buf {
    const void *p;
    size_t n;
};

/* The most keys one call takes (a bad n is KVD_EBADREQ, not an allocation). */
#define REDISCONN_MAX_KEYS 65536u

/* Parses and checks a URL only (for option validation at start-up); contacts nothing. */
int redisconn_url_check(const char *url, struct kvd_error *e);

/* Does not need the server to be up: the first call connects. */
int redisconn_open(const struct redisconn_conf *c, struct redisconn **out, struct kvd_error *e);
void redisconn_free(struct redisconn *rc); /* NULL is fine */

/* Pipelined GET of n keys (one round per node). vals[i] = the value's bytes, owned by rc and
 * valid until the next call on rc or redisconn_free (an empty value is a non-NULL p with n 0;
 * the bytes may be written to), or {NULL,0} when missing. The values of a call share one
 * buffer kept between calls (up to 64 MiB), so a restore's megabytes are not allocated and
 * page-faulted anew each call. Returns 0, or -1 with e set (then every vals[i] is {NULL,0}).
 * A reply of the wrong type counts as an error, never a crash. */
int redisconn_get(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                  struct redisconn_buf *vals, struct kvd_error *e);
/* Pipelined EXISTS per key: present[i] = true/false. Returns 0 or -1 (e set). */
int redisconn_exists(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                     bool *present, struct kvd_error *e);
/* Pipelined SET key val [EX ttl_s] (ttl_s 0: no expiry). Returns 0 or -1 (e set). */
int redisconn_set(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                  const struct redisconn_buf *vals, uint32_t ttl_s, struct kvd_error *e);
/* Pipelined DEL per key (a missing key is not an error). Returns 0 or -1 (e set). */
int redisconn_del(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                  struct kvd_error *e);

struct redisconn_stats {
    uint64_t rounds;        /* round trips (one per node per batch, redirect rounds included) */
    uint64_t errors;        /* calls that failed */
    uint64_t timeouts;      /* rounds or connects that ran past timeout_ms */
    uint64_t reconnects;    /* successful connects to a node after its first one */
    uint64_t connect_fails; /* connect attempts that failed (refused, timed out) */
    uint64_t moved;         /* MOVED replies followed (cluster) */
    uint64_t ask;           /* ASK replies followed (cluster) */
    uint64_t bytes_in;      /* bytes read from sockets */
    uint64_t bytes_out;     /* bytes written to sockets */
};
void redisconn_stats(const struct redisconn *rc, struct redisconn_stats *st);

/* Checks that the server answers (PING; a cluster: a full slot map from CLUSTER SLOTS, which
 * also loads the map). Returns 0 or -1 (e set). For start-up checks and health reports. */
int redisconn_ping(struct redisconn *rc, struct kvd_error *e);

/* True when the URL is a redis-cluster:// one. */
bool redisconn_is_cluster(const struct redisconn *rc);

#ifdef __cplusplus
}
#endif
#endif
