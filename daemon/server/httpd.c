/* httpd: the evhttp listener shared by metrics.c and http.c (see httpd.h).
 * Everything runs on the server's loop thread. */
#include "httpd.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>

#include "kvd/status.h"
#include "log.h"

/* Accepting pauses this long after accept() fails (out of descriptors),
 * doubling while it keeps failing, up to the max. */
#define HTTPD_PAUSE_MIN_MS 50
#define HTTPD_PAUSE_MAX_MS 2000
/* Listeners one daemon runs at once (metrics, the API's socket and TCP). */
#define HTTPD_MAX_ACTIVE 8

struct httpd {
    struct event_base *base;
    struct evhttp *http;
    char what[16];
    char addr[128];
    char default_path[108];
    bool force;
    char force_hint[160];
    char group[64];
    unsigned mode, max_conns;
    bool is_unix;
    struct evconnlistener *listener; /* evhttp's (not owned) */
    struct event *ev_resume;
    int reserve_fd; /* /dev/null, closed to take a connection at EMFILE */
    unsigned pause_ms;
    uint64_t accept_errors;
    char unix_path[108]; /* the socket we created ("" for TCP) */
    /* Open connections, counted (evhttp 2.1 has no limit of its own): each
     * connection's bufferevent is made here (evhttp_set_bevcb) and keeps an
     * extra reference; once evhttp has freed it (its callbacks are cleared)
     * httpd_reap drops the reference, which closes the socket. */
    struct bufferevent **bevs;
    uint64_t *since; /* (per bev) when its wait for a whole request began; UINT64_MAX: shut */
    bool *answering; /* (per bev) a request of it is being answered: no deadline */
    unsigned n_bevs, cap_bevs;
    uint64_t timeout_ns, n_deadline, n_capped;
    unsigned max_per_peer, admin_reserve;
    bool (*is_admin)(void *ud, unsigned uid);
    void *is_admin_ud;
    struct httpd_peer *peers; /* (per bev) who it is, once classified */
    struct event *ev_classify;
    void (*cb)(struct evhttp_request *, void *); /* the user's handler */
    void *cb_arg;
    bool full; /* listener disabled: max_conns open */
    struct event *ev_reap;
};

/* evhttp owns the listener's callback argument, so the accept-error
 * callback finds its httpd here. */
static struct httpd *httpd_active[HTTPD_MAX_ACTIVE];

int httpd_parse_addr(const char *what, const char *s, char *host, size_t host_cap, uint16_t *port,
                     bool *loopback, char *err, size_t errlen)
{
    if (s && (!strcmp(s, "unix") || !strncmp(s, "unix:", 5))) {
        const char *path = s[4] ? s + 5 : "";
        if ((path[0] && path[0] != '/') || strlen(path) >= host_cap ||
            strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
            snprintf(err, errlen,
                     "%s address '%s': unix:PATH needs an absolute path of at most 107 bytes", what,
                     s);
            return KVD_EBADREQ;
        }
        snprintf(host, host_cap, "%s", path);
        *port = 0;
        *loopback = true;
        return 0;
    }
    const char *colon = s ? strrchr(s, ':') : NULL;
    if (!colon || colon == s) {
        snprintf(err, errlen, "%s address '%s' is not HOST:PORT (e.g. 127.0.0.1:9464)", what,
                 s ? s : "");
        return KVD_EBADREQ;
    }
    const char *h = s, *h_end = colon;
    if (*h == '[') {
        if (colon[-1] != ']') {
            snprintf(err, errlen, "%s address '%s': an IPv6 host is written [::1]:PORT", what, s);
            return KVD_EBADREQ;
        }
        h++;
        h_end = colon - 1;
    }
    size_t hl = (size_t)(h_end - h);
    if (h == s && memchr(h, ':', hl)) {
        snprintf(err, errlen, "%s address '%s': write an IPv6 host in brackets, [::1]:PORT", what,
                 s);
        return KVD_EBADREQ;
    }
    if (hl == 0 || hl >= host_cap) {
        snprintf(err, errlen, "%s address '%s': bad host", what, s);
        return KVD_EBADREQ;
    }
    memcpy(host, h, hl);
    host[hl] = 0;
    char *end = NULL;
    errno = 0;
    unsigned long p = strtoul(colon + 1, &end, 10);
    if (!colon[1] || *end || errno || p > 65535 || colon[1] == '-' || colon[1] == '+') {
        snprintf(err, errlen, "%s address '%s': port must be a number in 0-65535", what, s);
        return KVD_EBADREQ;
    }
    if (!strcmp(host, "localhost"))
        snprintf(host, host_cap, "127.0.0.1");
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1) {
        *loopback = (ntohl(a4.s_addr) >> 24) == 127;
    } else if (inet_pton(AF_INET6, host, &a6) == 1) {
        *loopback =
            IN6_IS_ADDR_LOOPBACK(&a6) || (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
    } else {
        snprintf(err, errlen, "%s address '%s': host must be an IP address or localhost", what, s);
        return KVD_EBADREQ;
    }
    *port = (uint16_t)p;
    return 0;
}

/* ---- the listener --------------------------------------------------------- */

static void httpd_accept_error(struct evconnlistener *l, void *arg)
{
    (void)arg; /* evhttp's */
    struct httpd *h = NULL;
    for (int i = 0; i < HTTPD_MAX_ACTIVE; i++)
        if (httpd_active[i] && httpd_active[i]->listener == l)
            h = httpd_active[i];
    if (!h) {
        evconnlistener_disable(l); /* not ours to resume: never spin */
        return;
    }
    int e = EVUTIL_SOCKET_ERROR();
    h->accept_errors++;
    if ((e == EMFILE || e == ENFILE) && h->reserve_fd >= 0) {
        close(h->reserve_fd);
        int fd = accept(evconnlistener_get_fd(l), NULL, NULL);
        if (fd >= 0)
            close(fd);
        h->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    h->pause_ms = h->pause_ms ? h->pause_ms * 2 : HTTPD_PAUSE_MIN_MS;
    if (h->pause_ms > HTTPD_PAUSE_MAX_MS)
        h->pause_ms = HTTPD_PAUSE_MAX_MS;
    log_warn("%s: accept: %s; not accepting for %u ms (%llu failures so far)", h->what, strerror(e),
             h->pause_ms, (unsigned long long)h->accept_errors);
    evconnlistener_disable(l);
    struct timeval tv = {h->pause_ms / 1000, (h->pause_ms % 1000) * 1000};
    evtimer_add(h->ev_resume, &tv);
}

static void httpd_resume(evutil_socket_t fd, short what, void *arg)
{
    struct httpd *h = arg;
    if (!h->full && h->listener)
        evconnlistener_enable(h->listener);
}

/* A connection's peer: a uid (Unix socket) or an address (TCP). */
struct httpd_peer {
    bool known;
    bool admin;
    unsigned uid;
    char addr[64];
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Drops the connections evhttp is done with (see struct httpd). */
static void httpd_reap(struct httpd *h)
{
    unsigned k = 0;
    for (unsigned i = 0; i < h->n_bevs; i++) {
        bufferevent_data_cb rd, wr;
        bufferevent_event_cb ev;
        void *cbarg;
        bufferevent_getcb(h->bevs[i], &rd, &wr, &ev, &cbarg);
        if (!rd && !wr && !ev) {
            bufferevent_decref(h->bevs[i]);
        } else {
            h->peers[k] = h->peers[i];
            h->since[k] = h->since[i];
            h->answering[k] = h->answering[i];
            h->bevs[k++] = h->bevs[i];
        }
    }
    h->n_bevs = k;
    if (h->full && h->n_bevs < h->max_conns) {
        h->full = false;
        if (h->listener && !evtimer_pending(h->ev_resume, NULL))
            evconnlistener_enable(h->listener);
    }
}

/* The request deadline: a connection waiting for a request longer than
 * the timeout has its socket shut, which evhttp sees as the end of the
 * connection and frees it (whether headers, a body or nothing had come). */
static void httpd_deadlines(struct httpd *h)
{
    if (!h->timeout_ns)
        return;
    uint64_t now = now_ns();
    for (unsigned i = 0; i < h->n_bevs; i++) {
        evutil_socket_t fd = bufferevent_getfd(h->bevs[i]);
        if (h->answering[i] || fd < 0 || h->since[i] == UINT64_MAX ||
            now - h->since[i] < h->timeout_ns)
            continue;
        shutdown(fd, SHUT_RDWR);
        h->since[i] = UINT64_MAX;
        h->n_deadline++;
        log_notice("%s: a connection sent no whole request within %llu s (%s-timeout); closed",
                   h->what, (unsigned long long)(h->timeout_ns / 1000000000ull), h->what);
    }
}

/* Reads the peers of connections not yet classified and shuts those past
 * their peer's cap or inside the admin reserve. */
static void httpd_classify(struct httpd *h)
{
    unsigned reserve = h->admin_reserve < h->max_conns ? h->admin_reserve : h->max_conns - 1;
    for (unsigned i = 0; i < h->n_bevs; i++) {
        struct httpd_peer *p = &h->peers[i];
        evutil_socket_t fd = bufferevent_getfd(h->bevs[i]);
        if (p->known || fd < 0)
            continue;
        p->known = true;
        if (h->is_unix) {
            struct ucred cred;
            socklen_t cl = sizeof(cred);
            if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) {
                p->uid = (unsigned)cred.uid;
                p->admin = h->is_admin && h->is_admin(h->is_admin_ud, p->uid);
            }
            snprintf(p->addr, sizeof(p->addr), "uid %u", p->uid);
        } else {
            struct sockaddr_storage ss;
            socklen_t sl = sizeof(ss);
            p->addr[0] = '\0';
            if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) {
                void *a = ss.ss_family == AF_INET6
                              ? (void *)&((struct sockaddr_in6 *)&ss)->sin6_addr
                              : (void *)&((struct sockaddr_in *)&ss)->sin_addr;
                inet_ntop(ss.ss_family, a, p->addr, sizeof(p->addr));
            }
        }
        if (p->admin)
            continue;
        unsigned same = 0;
        for (unsigned j = 0; j < h->n_bevs; j++)
            same += j != i && h->peers[j].known && h->since[j] != UINT64_MAX &&
                    !strcmp(h->peers[j].addr, p->addr);
        const char *why = NULL;
        if (h->max_per_peer && same >= h->max_per_peer)
            why = h->is_unix ? "max-connections-per-uid" : "max-connections-per-peer";
        else if (reserve && h->n_bevs > h->max_conns - reserve)
            why = "admin-reserved-connections";
        if (why) {
            shutdown(fd, SHUT_RDWR);
            h->since[i] = UINT64_MAX;
            h->n_capped++;
            log_notice("%s: a connection of %s refused: %u open already, the limit (%s-%s)",
                       h->what, p->addr, same, h->what, why);
        }
    }
}

static void httpd_classify_cb(evutil_socket_t fd, short what, void *arg)
{
    httpd_classify(arg);
}

static void httpd_reap_cb(evutil_socket_t fd, short what, void *arg)
{
    httpd_reap(arg);
    httpd_classify(arg);
    httpd_deadlines(arg);
}

static int conn_index(struct httpd *h, struct evhttp_request *req)
{
    struct evhttp_connection *evcon = evhttp_request_get_connection(req);
    struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent(evcon) : NULL;
    for (unsigned i = 0; bev && i < h->n_bevs; i++)
        if (h->bevs[i] == bev)
            return (int)i;
    return -1;
}

/* A reply is done: the connection waits for its next request. */
static void httpd_done_cb(struct evhttp_request *req, void *arg)
{
    struct httpd *h = arg;
    int i = conn_index(h, req);
    if (i >= 0) {
        h->answering[i] = false;
        h->since[i] = now_ns();
    }
}

static void httpd_gencb(struct evhttp_request *req, void *arg)
{
    struct httpd *h = arg;
    int i = conn_index(h, req);
    if (i >= 0) {
        h->answering[i] = true;
        evhttp_request_set_on_complete_cb(req, httpd_done_cb, h);
    }
    h->cb(req, h->cb_arg);
}

void httpd_set_handler(struct httpd *h, void (*cb)(struct evhttp_request *, void *), void *arg)
{
    h->cb = cb;
    h->cb_arg = arg;
    evhttp_set_gencb(h->http, httpd_gencb, h);
}

uint64_t httpd_deadline_closes(const struct httpd *h)
{
    return h->n_deadline;
}

static struct bufferevent *httpd_bevcb(struct event_base *base, void *arg)
{
    struct httpd *h = arg;
    httpd_reap(h);
    if (h->n_bevs == h->cap_bevs) {
        unsigned cap = h->cap_bevs ? 2 * h->cap_bevs : 16;
        struct bufferevent **nv = realloc(h->bevs, cap * sizeof(*nv));
        if (nv)
            h->bevs = nv;
        uint64_t *ns = nv ? realloc(h->since, cap * sizeof(*ns)) : NULL;
        if (ns)
            h->since = ns;
        bool *na = ns ? realloc(h->answering, cap * sizeof(*na)) : NULL;
        if (na)
            h->answering = na;
        struct httpd_peer *np = na ? realloc(h->peers, cap * sizeof(*np)) : NULL;
        if (!np)
            return NULL; /* evhttp makes its own: served, not counted */
        h->peers = np;
        h->cap_bevs = cap;
    }
    struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    if (!bev)
        return NULL;
    bufferevent_incref(bev);
    h->since[h->n_bevs] = now_ns();
    h->answering[h->n_bevs] = false;
    h->peers[h->n_bevs] = (struct httpd_peer){0};
    h->bevs[h->n_bevs++] = bev;
    /* evhttp gives the bufferevent its socket after this returns: the
     * peer is read on the next loop turn */
    if (h->ev_classify && (h->max_per_peer || h->admin_reserve))
        event_active(h->ev_classify, EV_TIMEOUT, 0);
    if (h->n_bevs >= h->max_conns && h->listener && !h->full) {
        h->full = true;
        evconnlistener_disable(h->listener);
        log_warn("%s: %u connections open (%s-max-connections); not accepting more until one "
                 "closes",
                 h->what, h->n_bevs, h->what);
    }
    return bev;
}

/* The Unix socket: mode h->mode (0660 with a group), a stale file replaced
 * only when it is a socket nobody answers on. Returns the listening fd or
 * -1. */
static int unix_listen(struct httpd *h, const char *path, char *err, size_t errlen)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat st;
    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, errlen, "%s socket path '%s' is too long", h->what, path);
        return -1;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    if (lstat(path, &st) == 0) {
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        bool live = S_ISSOCK(st.st_mode) && probe >= 0 &&
                    connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        if (probe >= 0)
            close(probe);
        if (!S_ISSOCK(st.st_mode) || live) {
            snprintf(err, errlen, "'%s' exists and is %s", path,
                     live ? "served by another process" : "not a socket");
            return -1;
        }
        unlink(path);
    }
    gid_t gid = (gid_t)-1;
    if (h->group[0]) {
        struct group *gr = getgrnam(h->group);
        if (!gr) {
            snprintf(err, errlen, "%s: group '%s' does not exist", h->what, h->group);
            return -1;
        }
        gid = gr->gr_gid;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return -1;
    }
    unsigned mode = gid != (gid_t)-1 ? 0660 : h->mode;
    /* The umask makes the file no wider than its mode from the start. */
    mode_t old = umask((mode_t)(0777 & ~mode));
    int brc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (brc != 0 || (gid != (gid_t)-1 && chown(path, (uid_t)-1, gid)) ||
        chmod(path, (mode_t)mode) || listen(fd, 128) != 0) {
        snprintf(err, errlen, "cannot listen on %s: %s", path, strerror(errno));
        if (brc == 0)
            unlink(path);
        close(fd);
        return -1;
    }
    return fd;
}

int httpd_new(struct event_base *base, const struct httpd_conf *conf, struct httpd **out)
{
    struct httpd *h = calloc(1, sizeof(*h));
    if (!h)
        return KVD_ENOMEM;
    h->base = base;
    h->reserve_fd = -1;
    snprintf(h->what, sizeof(h->what), "%s", conf->what);
    snprintf(h->addr, sizeof(h->addr), "%s", conf->addr);
    snprintf(h->default_path, sizeof(h->default_path), "%s",
             conf->default_path ? conf->default_path : "");
    snprintf(h->force_hint, sizeof(h->force_hint), "%s", conf->force_hint ? conf->force_hint : "");
    snprintf(h->group, sizeof(h->group), "%s", conf->group ? conf->group : "");
    h->force = conf->force;
    h->mode = conf->mode ? conf->mode : 0600;
    h->max_conns = conf->max_conns ? conf->max_conns : 16;
    h->timeout_ns = (uint64_t)conf->request_timeout_s * 1000000000ull;
    h->max_per_peer = conf->max_per_peer;
    h->admin_reserve = conf->admin_reserve;
    h->is_admin = conf->is_admin;
    h->is_admin_ud = conf->is_admin_ud;
    h->ev_classify = event_new(base, -1, 0, httpd_classify_cb, h);
    h->http = evhttp_new(base);
    h->ev_resume = evtimer_new(base, httpd_resume, h);
    h->ev_reap = event_new(base, -1, EV_PERSIST, httpd_reap_cb, h);
    if (!h->http || !h->ev_resume || !h->ev_reap) {
        httpd_free(h);
        return KVD_ENOMEM;
    }
    evhttp_set_bevcb(h->http, httpd_bevcb, h);
    struct timeval reap_tv = {0, 200 * 1000};
    event_add(h->ev_reap, &reap_tv);
    *out = h;
    return 0;
}

struct evhttp *httpd_evhttp(struct httpd *h)
{
    return h->http;
}

bool httpd_is_unix(const struct httpd *h)
{
    return h->is_unix;
}

const char *httpd_path(const struct httpd *h)
{
    return h->unix_path;
}

void httpd_served(struct httpd *h)
{
    h->pause_ms = 0;
}

int httpd_listen(struct httpd *h, uint16_t *port_out, char *err, size_t errlen)
{
    char host[108];
    uint16_t port = 0;
    bool loop = false;
    int slot = -1;
    for (int i = 0; i < HTTPD_MAX_ACTIVE && slot < 0; i++)
        if (!httpd_active[i])
            slot = i;
    int rc = httpd_parse_addr(h->what, h->addr, host, sizeof(host), &port, &loop, err, errlen);
    if (rc)
        return rc;
    if (slot < 0) {
        snprintf(err, errlen, "%s: too many HTTP listeners", h->what);
        return KVD_EBUSY;
    }
    h->is_unix = !strncmp(h->addr, "unix", 4);
    if (!loop && !h->force) {
        snprintf(err, errlen, "%s address %s is not a loopback address%s%s", h->what, h->addr,
                 h->force_hint[0] ? ": " : "", h->force_hint);
        return KVD_EPERM;
    }
    struct evhttp_bound_socket *bs = NULL;
    if (h->is_unix) {
        if (!host[0])
            snprintf(host, sizeof(host), "%s", h->default_path);
        int fd = unix_listen(h, host, err, errlen);
        if (fd < 0)
            return KVD_EBUSY;
        struct evconnlistener *l = evconnlistener_new(
            h->base, NULL, NULL, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, -1, fd);
        if (!l) {
            close(fd);
            unlink(host);
            snprintf(err, errlen, "cannot serve %s on %s", h->what, host);
            return KVD_ENOMEM;
        }
        snprintf(h->unix_path, sizeof(h->unix_path), "%s", host);
        bs = evhttp_bind_listener(h->http, l);
        if (!bs) {
            evconnlistener_free(l);
            snprintf(err, errlen, "cannot serve %s on %s", h->what, host);
            return KVD_ENOMEM;
        }
    } else {
        bs = evhttp_bind_socket_with_handle(h->http, host, port);
        if (!bs) {
            snprintf(err, errlen, "cannot listen for %s on %s: %s", h->what, h->addr,
                     strerror(errno));
            return KVD_EBUSY;
        }
    }
    h->listener = evhttp_bound_socket_get_listener(bs);
    httpd_active[slot] = h;
    evconnlistener_set_error_cb(h->listener, httpd_accept_error);
    h->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    uint16_t bound = port;
    if (!h->is_unix) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        if (getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl) == 0)
            bound = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                   : ((struct sockaddr_in *)&ss)->sin_port);
    }
    if (port_out)
        *port_out = bound;
    return 0;
}

void httpd_free(struct httpd *h)
{
    if (!h)
        return;
    for (int i = 0; i < HTTPD_MAX_ACTIVE; i++)
        if (httpd_active[i] == h)
            httpd_active[i] = NULL;
    if (h->http)
        evhttp_free(h->http); /* frees its connections (and the listener) */
    h->listener = NULL;
    h->full = false;
    httpd_reap(h);
    for (unsigned i = 0; i < h->n_bevs; i++)
        bufferevent_decref(h->bevs[i]);
    free(h->bevs);
    free(h->since);
    free(h->answering);
    free(h->peers);
    if (h->ev_classify)
        event_free(h->ev_classify);
    if (h->ev_reap)
        event_free(h->ev_reap);
    if (h->ev_resume)
        event_free(h->ev_resume);
    if (h->reserve_fd >= 0)
        close(h->reserve_fd);
    if (h->unix_path[0])
        unlink(h->unix_path);
    free(h);
}

/* ---- bearer tokens -------------------------------------------------------- */

bool httpd_token_equal(const char *want, const char *got)
{
    size_t n = strlen(want), gn = strlen(got);
    unsigned char d = (unsigned char)(gn != n);
    for (size_t i = 0; i < n; i++)
        d |= (unsigned char)(want[i] ^ (i < gn ? got[i] : 0));
    return d == 0;
}

const char *httpd_bearer(struct evhttp_request *req)
{
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7))
        return NULL;
    h += 7;
    while (*h == ' ')
        h++;
    return h;
}

int httpd_read_token_file(const char *what, const char *path, char *tok, size_t cap, char *err,
                          size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s %s: %s", what, path,
                 fd < 0 ? strerror(errno) : "not a regular file");
        if (fd >= 0)
            close(fd);
        return KVD_EBADREQ;
    }
    if (st.st_mode & 077) {
        close(fd);
        snprintf(err, errlen, "%s %s: readable by others (mode %04o); chmod 600", what, path,
                 (unsigned)(st.st_mode & 07777));
        return KVD_EPERM;
    }
    ssize_t n = read(fd, tok, cap - 1);
    close(fd);
    if (n < 0)
        n = 0;
    tok[n] = '\0';
    tok[strcspn(tok, "\r\n")] = '\0';
    if (strlen(tok) < 16) {
        snprintf(err, errlen, "%s %s: the token must be 16-255 bytes", what, path);
        return KVD_EBADREQ;
    }
    return 0;
}
