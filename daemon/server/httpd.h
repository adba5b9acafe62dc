/* httpd: an evhttp listener on the server's loop, shared by the metrics
 * exporter and the HTTP API: the address ("unix[:PATH]" or HOST:PORT, the
 * loopback rule), the Unix socket it creates (mode, group, a stale file
 * replaced only when nobody answers on it), a bounded number of open
 * connections, a growing pause when accept() fails (out of descriptors) so
 * the loop never spins, and the constant-time bearer-token check. */
#ifndef KVD_HTTPD_H
#define KVD_HTTPD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct event_base;
struct evhttp;
struct evhttp_request;

/* Parses "unix[:PATH]" (host gets PATH, "" for the default; *port 0,
 * *loopback true) or "HOST:PORT" (HOST: an IPv4 literal, "[IPv6]" or
 * "localhost"; PORT 0-65535, 0 = any free port; host gets the literal
 * without brackets, *loopback whether it is 127.0.0.0/8 or ::1). `what`
 * names the setting in messages. Returns 0 or KVD_EBADREQ with a message. */
int httpd_parse_addr(const char *what, const char *s, char *host, size_t host_cap, uint16_t *port,
                     bool *loopback, char *err, size_t errlen);

struct httpd_conf {
    const char *what;         /* "metrics", "http": names the listener in messages */
    const char *addr;         /* "unix[:PATH]" or "HOST:PORT" */
    const char *default_path; /* the Unix socket for a bare "unix" */
    bool force;               /* serve a non-loopback TCP address */
    const char *force_hint;   /* the message's reason and option, for a refused address */
    const char *group;        /* Unix socket: its group (mode 0660); NULL or "": `mode` */
    unsigned mode;            /* Unix socket without a group: 0600 or 0660 */
    unsigned max_conns;       /* open connections at most (the listener pauses beyond) */
    /* A request must arrive whole (headers and body) within this many
     * seconds of its connection's accept or of the previous reply's end,
     * however slowly it dribbles (evhttp's own timeout restarts on every
     * byte); an idle keep-alive connection gets the same. 0: none. */
    unsigned request_timeout_s;
    /* Slots of one peer: a uid on the Unix socket, an address over TCP
     * (0: no cap), and the last admin_reserve of max_conns, which only
     * admins (is_admin, a uid on the Unix socket; over TCP nobody is one
     * before its token is read) may take. A connection past them is shut
     * as soon as it is seen (at most a loop turn after its accept). */
    unsigned max_per_peer, admin_reserve;
    bool (*is_admin)(void *ud, unsigned uid);
    void *is_admin_ud;
};

struct httpd;
/* A new listener's evhttp (not yet bound): set its callbacks and limits on
 * httpd_evhttp(), then httpd_listen. 0 or KVD_ENOMEM. */
int httpd_new(struct event_base *base, const struct httpd_conf *conf, struct httpd **out);
struct evhttp *httpd_evhttp(struct httpd *h);
/* The request handler (evhttp's general callback, through httpd, which
 * knows from it which connections are being answered: the request
 * deadline runs only for those that are not). */
void httpd_set_handler(struct httpd *h, void (*cb)(struct evhttp_request *, void *), void *arg);
/* Connections closed because a request did not arrive in time. */
uint64_t httpd_deadline_closes(const struct httpd *h);
/* Binds and listens: 0, or an enum kvd_err with a message (KVD_EPERM for a
 * refused non-loopback address). *port_out (may be NULL): the bound TCP
 * port, 0 for a Unix socket. */
int httpd_listen(struct httpd *h, uint16_t *port_out, char *err, size_t errlen);
bool httpd_is_unix(const struct httpd *h);
/* The Unix socket's path ("" for TCP). */
const char *httpd_path(const struct httpd *h);
/* Call after serving a request: the next accept failure starts a short
 * pause again. */
void httpd_served(struct httpd *h);
/* Frees the evhttp (its connections), the listener and the socket file.
 * NULL is a no-op. */
void httpd_free(struct httpd *h);

/* Whether `got` equals `want` (NUL-terminated), in time independent of
 * where they differ. */
bool httpd_token_equal(const char *want, const char *got);
/* The request's "Authorization: Bearer TOKEN" token, or NULL. */
const char *httpd_bearer(struct evhttp_request *req);
/* Reads a token file's first line (16-255 bytes) from a regular file no one
 * but its owner may read. `what` names the setting. 0 or an enum kvd_err. */
int httpd_read_token_file(const char *what, const char *path, char *tok, size_t cap, char *err,
                          size_t errlen);

#endif
