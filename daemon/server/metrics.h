/* metrics: the Prometheus exporter. Renders pool occupancy, per-tenant
 * accounting, the executor's queues, the roofline and the latency
 * histograms in the Prometheus text format (0.0.4), served by libevent's
 * evhttp on the server's loop at GET /metrics. Off unless --metrics is set;
 * loopback addresses only unless --metrics-force. */
#ifndef KVD_METRICS_H
#define KVD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acct.h"
#include "kvmm.h"
#include "roofline.h"

struct evbuffer;
struct server;

/* Parses "HOST:PORT" (HOST: an IPv4 literal, "[IPv6]" or "localhost";
 * PORT 0-65535, 0 = any free port). host gets the literal without
 * brackets; *loopback says whether it is 127.0.0.0/8 or ::1. Returns 0 or
 * KVD_EBADREQ with a message. */
int metrics_parse_addr(const char *s, char *host, size_t host_cap, uint16_t *port, bool *loopback,
                       char *err, size_t errlen);

/* What a scrape reads. mm is locked while its numbers are read; the other
 * pointers may be NULL (store mode has no roofline or executor). */
struct models;
struct metrics_src {
    struct kvmm *mm;
    struct roofline *rl;
    struct acct *acct;
    const char *backend;                /* "cpu" / "cuda" */
    const size_t *n_conns;              /* live connections, or NULL */
    const size_t *n_pending;            /* requests in flight, or NULL */
    const uint64_t *n_http_auth_failed; /* or NULL */
    struct kvevents *const *kvevents;   /* (n_kvevents) model i's stream, or NULL */
    size_t n_kvevents;
    struct models *models; /* the daemon's models, or NULL (store mode) */
};

/* Appends the whole exposition to out. 0 or KVD_ENOMEM. */
int metrics_render(const struct metrics_src *src, struct evbuffer *out);

struct metrics;
/* Binds the HTTP listener on the server's event loop at addr ("HOST:PORT").
 * A non-loopback address is refused (KVD_EPERM) unless force. Returns 0 or
 * an enum kvd_err with a message; *port_out (may be NULL) = the bound port. */
int metrics_start(struct server *srv, const char *addr, bool force, struct metrics **out,
                  uint16_t *port_out, char *err, size_t errlen);
/* Stops listening and frees; call before server_free. NULL is a no-op. */
void metrics_stop(struct metrics *m);

#endif
