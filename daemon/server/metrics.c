/* metrics: Prometheus text exposition (format 0.0.4) of kvd's state and the
 * evhttp listener serving it at /metrics on the server's loop thread. Names
 * follow the Prometheus conventions: base units (seconds, bytes), _total
 * for counters, one metric per quantity with labels for tier/tenant/phase. */
#include "metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>

#include "log.h"
#include "server.h"

/* ---- address ------------------------------------------------------------ */

int metrics_parse_addr(const char *s, char *host, size_t host_cap, uint16_t *port,
                       bool *loopback, char *err, size_t errlen)
{
    if (s && (!strcmp(s, "unix") || !strncmp(s, "unix:", 5))) {
        /* A Unix socket: host gets the path ("" for the default). */
        const char *path = s[4] ? s + 5 : "";
        if ((path[0] && path[0] != '/') || strlen(path) >= host_cap ||
            strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
            snprintf(err, errlen, "metrics address '%s': unix:PATH needs an absolute path of "
                                  "at most 107 bytes",
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
        snprintf(err, errlen, "metrics address '%s' is not HOST:PORT (e.g. 127.0.0.1:9464)",
                 s ? s : "");
        return KVD_EBADREQ;
    }
    const char *h = s, *h_end = colon;
    if (*h == '[') {
        if (colon[-1] != ']') {
            snprintf(err, errlen, "metrics address '%s': an IPv6 host is written [::1]:PORT", s);
            return KVD_EBADREQ;
        }
        h++;
        h_end = colon - 1;
    }
    size_t hl = (size_t)(h_end - h);
    if (h == s && memchr(h, ':', hl)) {
        snprintf(err, errlen, "metrics address '%s': write an IPv6 host in brackets, [::1]:PORT", s);
        return KVD_EBADREQ;
    }
    if (hl == 0 || hl >= host_cap) {
        snprintf(err, errlen, "metrics address '%s': bad host", s);
        return KVD_EBADREQ;
    }
    memcpy(host, h, hl);
    host[hl] = 0;
    char *end = NULL;
    errno = 0;
    unsigned long p = strtoul(colon + 1, &end, 10);
    if (!colon[1] || *end || errno || p > 65535 || colon[1] == '-' || colon[1] == '+') {
        snprintf(err, errlen, "metrics address '%s': port must be a number in 0-65535", s);
        return KVD_EBADREQ;
    }
    if (!strcmp(host, "localhost"))
        snprintf(host, host_cap, "127.0.0.1");
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1) {
        *loopback = (ntohl(a4.s_addr) >> 24) == 127;
    } else if (inet_pton(AF_INET6, host, &a6) == 1) {
        *loopback = IN6_IS_ADDR_LOOPBACK(&a6) ||
                    (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
    } else {
        snprintf(err, errlen,
                 "metrics address '%s': host must be an IP address or localhost", s);
        return KVD_EBADREQ;
    }
    *port = (uint16_t)p;
    return 0;
}

/* ---- rendering ---------------------------------------------------------- */

/* Output with sticky failure: the first failed append makes every later one
 * a no-op and the render return KVD_ENOMEM. */
struct out {
    struct evbuffer *b;
    int rc;
};

__attribute__((format(printf, 2, 3))) static void put(struct out *o, const char *fmt, ...)
{
    if (o->rc)
        return;
    va_list ap;
    va_start(ap, fmt);
    if (evbuffer_add_vprintf(o->b, fmt, ap) < 0)
        o->rc = KVD_ENOMEM;
    va_end(ap);
}

static void head(struct out *o, const char *name, const char *type, const char *help)
{
    put(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value with \, " and newline escaped, as the format requires. */
static void put_label(struct out *o, const char *v)
{
    char buf[160];
    size_t j = 0;
    for (size_t i = 0; v[i] && j + 3 < sizeof(buf); i++) {
        char ch = v[i];
        if (ch == '\\' || ch == '"') {
            buf[j++] = '\\';
            buf[j++] = ch;
        } else if (ch == '\n') {
            buf[j++] = '\\';
            buf[j++] = 'n';
        } else {
            buf[j++] = ch;
        }
    }
    buf[j] = 0;
    put(o, "%s", buf);
}

/* name{tenant="T"} value */
static void tenant_line(struct out *o, const char *name, const char *extra, const char *tenant,
                        double v)
{
    put(o, "%s{%stenant=\"", name, extra ? extra : "");
    put_label(o, tenant);
    put(o, "\"} %.17g\n", v);
}

static void render_hist(struct out *o, const char *name, const char *help, struct acct *a,
                        enum acct_hist_kind k)
{
    struct acct_hist h;
    acct_hist_get(a, k, &h);
    head(o, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < ACCT_N_BUCKETS; i++) {
        cum += h.bucket[i];
        put(o, "%s_bucket{le=\"%g\"} %llu\n", name, acct_bucket_le[i], (unsigned long long)cum);
    }
    cum += h.bucket[ACCT_N_BUCKETS];
    put(o, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    put(o, "%s_sum %.17g\n%s_count %llu\n", name, h.sum, name, (unsigned long long)h.count);
}

static void render_pool(struct out *o, const struct kvmm_stats *st)
{
    head(o, "kvd_pool_blocks", "gauge", "KV blocks of the pool by tier and state.");
    const struct {
        const char *tier;
        uint32_t total, free_, cached, used;
    } t[2] = {{"device", st->device_total, st->device_free, st->device_cached, st->device_used},
              {"host", st->host_total, st->host_free, st->host_cached, st->host_used}};
    for (int i = 0; i < 2; i++) {
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"total\"} %u\n", t[i].tier, t[i].total);
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"free\"} %u\n", t[i].tier, t[i].free_);
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"cached\"} %u\n", t[i].tier, t[i].cached);
        put(o, "kvd_pool_blocks{tier=\"%s\",state=\"used\"} %u\n", t[i].tier, t[i].used);
    }
    head(o, "kvd_swap_bytes_total", "counter", "Bytes moved between tiers by swaps.");
    put(o, "kvd_swap_bytes_total{direction=\"out\"} %llu\n",
        (unsigned long long)st->swap_bytes_out);
    put(o, "kvd_swap_bytes_total{direction=\"in\"} %llu\n", (unsigned long long)st->swap_bytes_in);
    head(o, "kvd_evictions_total", "counter", "Cached device blocks evicted (to host or dropped).");
    put(o, "kvd_evictions_total %llu\n", (unsigned long long)st->evictions_device);
    head(o, "kvd_drops_total", "counter", "Cached blocks dropped from every tier.");
    put(o, "kvd_drops_total %llu\n", (unsigned long long)st->drops);
    head(o, "kvd_checksum_failures_total", "counter", "Host-tier blocks whose checksum failed.");
    put(o, "kvd_checksum_failures_total %llu\n", (unsigned long long)st->checksum_failures);
    head(o, "kvd_cow_copies_total", "counter", "Copy-on-write block copies.");
    put(o, "kvd_cow_copies_total %llu\n", (unsigned long long)st->cow_copies);
    head(o, "kvd_sequences", "gauge", "Open sequences.");
    put(o, "kvd_sequences %u\n", st->n_seqs);
}

/* Per-tenant series. Caller holds the kvmm lock. */
static void render_tenants(struct out *o, struct kvmm *mm, uint32_t n, struct acct *a)
{
    struct kvmm_tenant_stats ts;
    struct acct_tenant at;
    static const struct {
        const char *name, *type, *help;
    } fam[] = {
        {"kvd_blocks", "gauge", "KV blocks owned by a tenant, by tier."},
        {"kvd_cached_blocks", "gauge", "A tenant's blocks held by a radix tree (shareable)."},
        {"kvd_tenant_sequences", "gauge", "A tenant's open sequences."},
        {"kvd_prefix_lookup_tokens_total", "counter", "Prompt tokens looked up in the prefix cache."},
        {"kvd_prefix_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache."},
        {"kvd_swaps_total", "counter", "Blocks swapped between tiers, by direction."},
        {"kvd_requests_total", "counter", "Generate requests answered, by outcome."},
        {"kvd_tokens_total", "counter", "Tokens by kind: prompt (in), cached (prompt tokens reused), generated (out)."},
        {"kvd_preemptions_total", "counter", "Times a tenant's requests were preempted."},
        {"kvd_queue_seconds_total", "counter", "Summed time a tenant's requests waited before their first step."},
    };
    for (size_t f = 0; f < sizeof(fam) / sizeof(fam[0]); f++) {
        head(o, fam[f].name, fam[f].type, fam[f].help);
        for (uint32_t id = 0; id < n; id++) {
            if (kvmm_tenant_stats(mm, id, &ts) != 0)
                continue;
            memset(&at, 0, sizeof(at));
            if (a)
                acct_tenant_get(a, id, &at);
            const char *tn = ts.name;
            switch (f) {
            case 0:
                tenant_line(o, fam[f].name, "tier=\"device\",", tn, ts.device_blocks);
                tenant_line(o, fam[f].name, "tier=\"host\",", tn, ts.host_blocks);
                break;
            case 1: tenant_line(o, fam[f].name, NULL, tn, ts.cached_blocks); break;
            case 2: tenant_line(o, fam[f].name, NULL, tn, ts.seqs); break;
            case 3: tenant_line(o, fam[f].name, NULL, tn, (double)ts.match_tokens_asked); break;
            case 4: tenant_line(o, fam[f].name, NULL, tn, (double)ts.match_tokens_hit); break;
            case 5:
                tenant_line(o, fam[f].name, "direction=\"out\",", tn, (double)ts.swaps_out);
                tenant_line(o, fam[f].name, "direction=\"in\",", tn, (double)ts.swaps_in);
                break;
            case 6:
                tenant_line(o, fam[f].name, "outcome=\"completed\",", tn, (double)at.completed);
                tenant_line(o, fam[f].name, "outcome=\"cancelled\",", tn, (double)at.cancelled);
                tenant_line(o, fam[f].name, "outcome=\"failed\",", tn, (double)at.failed);
                break;
            case 7:
                tenant_line(o, fam[f].name, "kind=\"prompt\",", tn, (double)at.tokens_in);
                tenant_line(o, fam[f].name, "kind=\"cached\",", tn, (double)at.tokens_cached);
                tenant_line(o, fam[f].name, "kind=\"generated\",", tn, (double)at.tokens_out);
                break;
            case 8: tenant_line(o, fam[f].name, NULL, tn, (double)at.preemptions); break;
            case 9: tenant_line(o, fam[f].name, NULL, tn, at.queue_seconds); break;
            }
        }
    }
}

static void render_exec(struct out *o, struct acct *a)
{
    struct acct_sched s;
    acct_sched_get(a, &s);
    head(o, "kvd_requests", "gauge", "Generate requests in the executor's queues, by state.");
    put(o, "kvd_requests{state=\"waiting\"} %u\n", s.waiting);
    put(o, "kvd_requests{state=\"running\"} %u\n", s.running);
    put(o, "kvd_requests{state=\"swapped\"} %u\n", s.swapped);
    head(o, "kvd_steps_total", "counter", "Executor steps (forward passes).");
    put(o, "kvd_steps_total %llu\n", (unsigned long long)s.steps);
    head(o, "kvd_step_tokens_total", "counter", "Tokens computed by the executor, by kind.");
    put(o, "kvd_step_tokens_total{kind=\"prefill\"} %llu\n",
        (unsigned long long)s.prefill_tokens);
    put(o, "kvd_step_tokens_total{kind=\"decode\"} %llu\n", (unsigned long long)s.decode_tokens);
    head(o, "kvd_scheduler_preemptions_total", "counter", "Preemptions by the scheduler, by kind.");
    put(o, "kvd_scheduler_preemptions_total{kind=\"swap\"} %llu\n",
        (unsigned long long)s.preempt_swap);
    put(o, "kvd_scheduler_preemptions_total{kind=\"recompute\"} %llu\n",
        (unsigned long long)s.preempt_recompute);
    render_hist(o, "kvd_time_to_first_token_seconds",
                "Time from a request's arrival to its first generated token.", a, ACCT_TTFT);
    render_hist(o, "kvd_inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request (its mean gap, once per gap).",
                a, ACCT_ITL);
    render_hist(o, "kvd_request_duration_seconds",
                "Time from arrival to the reply of completed requests.", a, ACCT_E2E);
    render_hist(o, "kvd_queue_time_seconds", "Time from arrival to a request's first step.", a,
                ACCT_QUEUE);
}

static void render_roofline(struct out *o, struct roofline *rl)
{
    struct roofline_ceilings c;
    roofline_get_ceilings(rl, &c);
    head(o, "kvd_ceiling_flops_per_second", "gauge", "Measured GEMM ceiling of the backend (0: not measured).");
    put(o, "kvd_ceiling_flops_per_second %.6g\n", c.flops_per_s);
    head(o, "kvd_ceiling_bytes_per_second", "gauge",
         "Measured memory ceiling of the backend, bytes read plus written (0: not measured).");
    put(o, "kvd_ceiling_bytes_per_second %.6g\n", c.bytes_per_s);

    struct roofline_summary s[ROOFLINE_N_PHASES];
    uint64_t steps[ROOFLINE_N_PHASES];
    double fl[ROOFLINE_N_PHASES], by[ROOFLINE_N_PHASES], sec[ROOFLINE_N_PHASES];
    for (int p = 0; p < ROOFLINE_N_PHASES; p++) {
        roofline_summary(rl, (enum roofline_phase)p, &s[p]);
        roofline_totals(rl, (enum roofline_phase)p, &steps[p], &fl[p], &by[p], &sec[p]);
    }
#define PHASES(name, type, help, fmt, expr)                                                 \
    do {                                                                                    \
        head(o, name, type, help);                                                          \
        for (int p = 0; p < ROOFLINE_N_PHASES; p++)                                         \
            put(o, name "{phase=\"%s\"} " fmt "\n", roofline_phase_name((enum roofline_phase)p), \
                expr);                                                                      \
    } while (0)
    PHASES("kvd_phase_steps_total", "counter", "Executor steps by phase.", "%llu",
           (unsigned long long)steps[p]);
    PHASES("kvd_phase_flops_total", "counter", "Modelled FLOPs of the steps, by phase.", "%.17g", fl[p]);
    PHASES("kvd_phase_bytes_total", "counter", "Modelled bytes moved by the steps, by phase.", "%.17g", by[p]);
    PHASES("kvd_phase_seconds_total", "counter", "Forward time of the steps, by phase.", "%.17g", sec[p]);
    PHASES("kvd_roofline_intensity", "gauge", "Arithmetic intensity (FLOP/byte) over the recent window.",
           "%.6g", s[p].intensity);
    PHASES("kvd_roofline_flops_ratio", "gauge", "Achieved FLOP/s as a fraction of the ceiling (recent window).",
           "%.6g", s[p].flops_frac);
    PHASES("kvd_roofline_bytes_ratio", "gauge", "Achieved bytes/s as a fraction of the ceiling (recent window).",
           "%.6g", s[p].bytes_frac);
#undef PHASES
    head(o, "kvd_roofline_bound", "gauge", "1 for the ceiling that bounds the phase's recent steps.");
    for (int p = 0; p < ROOFLINE_N_PHASES; p++)
        if (s[p].window && strcmp(s[p].bound, "unknown"))
            put(o, "kvd_roofline_bound{phase=\"%s\",bound=\"%s\"} 1\n",
                roofline_phase_name((enum roofline_phase)p), s[p].bound);
}

int metrics_render(const struct metrics_src *src, struct evbuffer *out)
{
    struct out o = {.b = out};
    struct kvmm_stats st;

    head(&o, "kvd_info", "gauge", "Constant 1, labelled with the backend.");
    put(&o, "kvd_info{backend=\"");
    put_label(&o, src->backend ? src->backend : "?");
    put(&o, "\"} 1\n");
    if (src->n_conns) {
        head(&o, "kvd_connections", "gauge", "Open client connections.");
        put(&o, "kvd_connections %zu\n", *src->n_conns);
    }
    if (src->n_pending) {
        head(&o, "kvd_requests_in_flight", "gauge", "Requests taken and not yet answered.");
        put(&o, "kvd_requests_in_flight %zu\n", *src->n_pending);
    }
    /* One lock for every kvmm number, so they add up. */
    kvmm_lock(src->mm);
    kvmm_stats(src->mm, &st);
    render_pool(&o, &st);
    render_tenants(&o, src->mm, st.n_tenants, src->acct);
    kvmm_unlock(src->mm);
    if (src->acct)
        render_exec(&o, src->acct);
    if (src->rl)
        render_roofline(&o, src->rl);
    return o.rc;
}

/* ---- the HTTP listener -------------------------------------------------- */

/* Accepting pauses this long after accept() fails (out of descriptors),
 * doubling while it keeps failing, up to the max. */
#define METRICS_PAUSE_MIN_MS 50
#define METRICS_PAUSE_MAX_MS 2000

struct metrics {
    struct evhttp *http;
    struct server *srv;
    struct evconnlistener *listener; /* evhttp's (not owned) */
    struct event *ev_resume;
    int reserve_fd;  /* /dev/null, closed to take a connection at EMFILE */
    unsigned pause_ms;
    uint64_t accept_errors;
    char unix_path[128]; /* the unix: socket we created ("" for TCP) */
    /* Open connections, counted (evhttp 2.1 has no limit of its own): each
     * connection's bufferevent is made here (evhttp_set_bevcb) and keeps an
     * extra reference; once evhttp has freed it (its callbacks are cleared)
     * metrics_reap drops the reference, which closes the socket. */
    struct bufferevent **bevs;
    unsigned n_bevs, cap_bevs;
    bool full; /* listener disabled: metrics-max-connections open */
    struct event *ev_reap;
    char token[256];     /* "" when none is required */
};

/* Constant-time comparison of the bearer token. */
static bool token_ok(const struct metrics *m, struct evhttp_request *req)
{
    if (!m->token[0])
        return true;
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    if (!h || strncmp(h, "Bearer ", 7))
        return false;
    h += 7;
    size_t n = strlen(m->token), hn = strlen(h);
    unsigned char d = (unsigned char)(hn != n);
    for (size_t i = 0; i < n; i++)
        d |= (unsigned char)(m->token[i] ^ (i < hn ? h[i] : 0));
    return d == 0;
}

static void on_metrics(struct evhttp_request *req, void *arg)
{
    struct metrics *m = arg;
    struct server *srv = m->srv;
    if (!token_ok(m, req)) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "WWW-Authenticate",
                          "Bearer realm=\"kvd\"");
        evhttp_send_error(req, 401, "a bearer token is required (metrics-token-file)");
        return;
    }
    struct server_obs o;
    server_get_obs(srv, &o);
    struct metrics_src src = {
        .mm = o.mm,
        .rl = o.rl,
        .acct = o.acct,
        .backend = o.backend,
        .n_conns = o.n_conns,
        .n_pending = o.n_pending,
    };
    struct evbuffer *body = evbuffer_new();
    if (!body) {
        evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
        return;
    }
    if (metrics_render(&src, body) != 0) {
        evbuffer_free(body);
        evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
        return;
    }
    m->pause_ms = 0; /* serving again: the next failure starts a short pause */
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "text/plain; version=0.0.4; charset=utf-8");
    evhttp_send_reply(req, HTTP_OK, "OK", body);
    evbuffer_free(body);
}

static void on_other(struct evhttp_request *req, void *arg)
{
    evhttp_send_error(req, HTTP_NOTFOUND, "kvd serves /metrics only");
}

/* Out of descriptors (or another accept failure): stop accepting for a
 * while, doubling the pause while it lasts, so the loop never spins; with
 * the reserve descriptor, take one waiting connection and close it, so
 * clients are refused rather than left hanging. */
/* The exporter whose listener failed: evhttp owns the listener's callback
 * argument, so the error callback finds its exporter here (one per
 * daemon). */
static struct metrics *metrics_active;

static void metrics_accept_error(struct evconnlistener *l, void *arg)
{
    (void)arg; /* evhttp's */
    struct metrics *m = metrics_active;
    if (!m || m->listener != l) {
        evconnlistener_disable(l); /* not ours to resume: never spin */
        return;
    }
    int e = EVUTIL_SOCKET_ERROR();
    m->accept_errors++;
    if ((e == EMFILE || e == ENFILE) && m->reserve_fd >= 0) {
        close(m->reserve_fd);
        int fd = accept(evconnlistener_get_fd(l), NULL, NULL);
        if (fd >= 0)
            close(fd);
        m->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    m->pause_ms = m->pause_ms ? m->pause_ms * 2 : METRICS_PAUSE_MIN_MS;
    if (m->pause_ms > METRICS_PAUSE_MAX_MS)
        m->pause_ms = METRICS_PAUSE_MAX_MS;
    log_warn("metrics: accept: %s; not accepting for %u ms (%llu failures so far)",
             strerror(e), m->pause_ms, (unsigned long long)m->accept_errors);
    evconnlistener_disable(l);
    struct timeval tv = {m->pause_ms / 1000, (m->pause_ms % 1000) * 1000};
    evtimer_add(m->ev_resume, &tv);
}

static void metrics_resume(evutil_socket_t fd, short what, void *arg)
{
    struct metrics *m = arg;
    if (!m->full)
        evconnlistener_enable(m->listener);
}

/* Drops the connections evhttp is done with (see struct metrics). */
static void metrics_reap(struct metrics *m)
{
    unsigned k = 0;
    for (unsigned i = 0; i < m->n_bevs; i++) {
        bufferevent_data_cb rd, wr;
        bufferevent_event_cb ev;
        void *cbarg;
        bufferevent_getcb(m->bevs[i], &rd, &wr, &ev, &cbarg);
        if (!rd && !wr && !ev)
            bufferevent_decref(m->bevs[i]);
        else
            m->bevs[k++] = m->bevs[i];
    }
    m->n_bevs = k;
    if (m->full && m->n_bevs < server_options(m->srv)->metrics_max_conns) {
        m->full = false;
        if (m->listener && !evtimer_pending(m->ev_resume, NULL))
            evconnlistener_enable(m->listener);
    }
}

static void metrics_reap_cb(evutil_socket_t fd, short what, void *arg)
{
    metrics_reap(arg);
}

static struct bufferevent *metrics_bevcb(struct event_base *base, void *arg)
{
    struct metrics *m = arg;
    metrics_reap(m);
    if (m->n_bevs == m->cap_bevs) {
        unsigned cap = m->cap_bevs ? 2 * m->cap_bevs : 16;
        struct bufferevent **nv = realloc(m->bevs, cap * sizeof(*nv));
        if (!nv)
            return NULL; /* evhttp makes its own: served, not counted */
        m->bevs = nv;
        m->cap_bevs = cap;
    }
    struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    if (!bev)
        return NULL;
    bufferevent_incref(bev);
    m->bevs[m->n_bevs++] = bev;
    if (m->n_bevs >= server_options(m->srv)->metrics_max_conns && m->listener && !m->full) {
        m->full = true;
        evconnlistener_disable(m->listener);
        log_warn("metrics: %u connections open (metrics-max-connections); not accepting more "
                 "until one closes",
                 m->n_bevs);
    }
    return bev;
}

/* The unix: socket: mode 0600 (0660 with group), a stale file replaced only
 * when it is a socket nobody answers on. Returns the listening fd or -1. */
static int unix_listen(const char *path, const char *group, char *err, size_t errlen)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat st;
    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, errlen, "metrics socket path '%s' is too long", path);
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
    if (group && group[0]) {
        struct group *gr = getgrnam(group);
        if (!gr) {
            snprintf(err, errlen, "metrics-group '%s' does not exist", group);
            return -1;
        }
        gid = gr->gr_gid;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return -1;
    }
    mode_t old = umask(0177);
    int brc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (brc != 0 || (gid != (gid_t)-1 && (chown(path, (uid_t)-1, gid) || chmod(path, 0660))) ||
        listen(fd, 64) != 0) {
        snprintf(err, errlen, "cannot listen on %s: %s", path, strerror(errno));
        if (brc == 0)
            unlink(path);
        close(fd);
        return -1;
    }
    return fd;
}

/* Reads the bearer token: the file's first line, 16-255 bytes, from a file
 * only its owner can read. */
static int read_token(const char *path, char *tok, size_t cap, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "metrics-token-file %s: %s", path,
                 fd < 0 ? strerror(errno) : "not a regular file");
        if (fd >= 0)
            close(fd);
        return KVD_EBADREQ;
    }
    if (st.st_mode & 077) {
        close(fd);
        snprintf(err, errlen, "metrics-token-file %s: readable by others (mode %04o); chmod 600",
                 path, (unsigned)(st.st_mode & 07777));
        return KVD_EPERM;
    }
    ssize_t n = read(fd, tok, cap - 1);
    close(fd);
    if (n < 0)
        n = 0;
    tok[n] = '\0';
    tok[strcspn(tok, "\r\n")] = '\0';
    if (strlen(tok) < 16) {
        snprintf(err, errlen, "metrics-token-file %s: the token must be 16-255 bytes", path);
        return KVD_EBADREQ;
    }
    return 0;
}

int metrics_start(struct server *srv, const char *addr, bool force, struct metrics **out,
                  uint16_t *port_out, char *err, size_t errlen)
{
    char host[128];
    uint16_t port = 0;
    bool loop = false;
    int rc = metrics_parse_addr(addr, host, sizeof(host), &port, &loop, err, errlen);
    if (rc)
        return rc;
    bool is_unix = !strncmp(addr, "unix", 4);
    if (!loop && !force) {
        snprintf(err, errlen,
                 "metrics address %s is not a loopback address: metrics show every tenant's "
                 "usage; add --metrics-force to serve them there anyway",
                 addr);
        return KVD_EPERM;
    }
    struct metrics *m = calloc(1, sizeof(*m));
    if (!m)
        return KVD_ENOMEM;
    m->srv = srv;
    m->reserve_fd = -1;
    if (server_options(srv)->metrics_token_file[0] &&
        (rc = read_token(server_options(srv)->metrics_token_file, m->token, sizeof(m->token), err,
                         errlen))) {
        free(m);
        return rc;
    }
    m->http = evhttp_new(server_event_base(srv));
    m->ev_resume = evtimer_new(server_event_base(srv), metrics_resume, m);
    m->ev_reap = event_new(server_event_base(srv), -1, EV_PERSIST, metrics_reap_cb, m);
    if (!m->http || !m->ev_resume || !m->ev_reap) {
        metrics_stop(m);
        return KVD_ENOMEM;
    }
    /* Scrapes are tiny GETs: small limits keep a stray client cheap. */
    evhttp_set_allowed_methods(m->http, EVHTTP_REQ_GET | EVHTTP_REQ_HEAD);
    evhttp_set_max_headers_size(m->http, 16384);
    evhttp_set_max_body_size(m->http, 4096);
    evhttp_set_timeout(m->http, 10);
    evhttp_set_cb(m->http, "/metrics", on_metrics, m);
    evhttp_set_gencb(m->http, on_other, m);
    evhttp_set_bevcb(m->http, metrics_bevcb, m);
    struct timeval reap_tv = {0, 200 * 1000};
    event_add(m->ev_reap, &reap_tv);
    struct evhttp_bound_socket *bs = NULL;
    if (is_unix) {
        if (!host[0]) {
            /* beside the main socket */
            const char *main_sock = server_socket_path(srv);
            const char *slash = strrchr(main_sock, '/');
            int dl = slash ? (int)(slash - main_sock) : 0;
            snprintf(host, sizeof(host), "%.*s/metrics.sock", dl, main_sock);
        }
        int fd = unix_listen(host, server_options(srv)->metrics_group, err, errlen);
        struct evconnlistener *l =
            fd < 0 ? NULL
                   : evconnlistener_new(server_event_base(srv), NULL, NULL,
                                        LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, -1, fd);
        if (fd >= 0 && !l) {
            close(fd);
            unlink(host);
        }
        if (l) {
            snprintf(m->unix_path, sizeof(m->unix_path), "%s", host);
            bs = evhttp_bind_listener(m->http, l);
        }
        if (!bs) {
            if (fd >= 0 && l)
                snprintf(err, errlen, "cannot serve metrics on %s", host);
            metrics_stop(m);
            return KVD_EBUSY;
        }
    } else {
        bs = evhttp_bind_socket_with_handle(m->http, host, port);
        if (!bs) {
            snprintf(err, errlen, "cannot listen for metrics on %s: %s", addr, strerror(errno));
            metrics_stop(m);
            return KVD_EBUSY;
        }
    }
    m->listener = evhttp_bound_socket_get_listener(bs);
    metrics_active = m;
    evconnlistener_set_error_cb(m->listener, metrics_accept_error);
    m->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    uint16_t bound = port;
    if (is_unix) {
        log_info("metrics: serving http://localhost/metrics on the unix socket %s (mode %s)",
                 host, server_options(srv)->metrics_group[0] ? "0660" : "0600");
    } else {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        if (getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl) == 0)
            bound = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                   : ((struct sockaddr_in *)&ss)->sin_port);
        log_info("metrics: serving http://%s%s%s:%u/metrics", strchr(host, ':') ? "[" : "", host,
                 strchr(host, ':') ? "]" : "", bound);
        if (!m->token[0])
            log_notice("metrics: TCP without metrics-token-file: every local user can read "
                       "every tenant's usage; prefer --metrics unix:PATH");
    }
    if (port_out)
        *port_out = bound;
    *out = m;
    return 0;
}

void metrics_stop(struct metrics *m)
{
    if (!m)
        return;
    if (metrics_active == m)
        metrics_active = NULL;
    if (m->http)
        evhttp_free(m->http); /* frees its connections (and the listener) */
    m->listener = NULL;
    m->full = false;
    metrics_reap(m);
    for (unsigned i = 0; i < m->n_bevs; i++)
        bufferevent_decref(m->bevs[i]);
    free(m->bevs);
    if (m->ev_reap)
        event_free(m->ev_reap);
    if (m->ev_resume)
        event_free(m->ev_resume);
    if (m->reserve_fd >= 0)
        close(m->reserve_fd);
    if (m->unix_path[0])
        unlink(m->unix_path);
    free(m);
}
