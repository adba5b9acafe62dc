/* http: the OpenAI-compatible API's listeners, routing, identity, limits
 * and replies (see http.h; the JSON is openai.c's). Everything runs on the
 * server's loop thread: evhttp calls on_request there, and the executor's
 * results arrive there through ops_generate_client's queue.
 *
 * A request's life: identity (peer uid, or bearer token over TCP; a front
 * end may name a sub-tenant with X-Kvd-Tenant), the tenant's in-flight
 * limit, the body parsed into generate arguments, submitted as a generate
 * client; a streaming reply starts at once (SSE headers) and gets a chunk
 * per batch of tokens; the done callback finishes the reply. A connection
 * that closes first drops the client: its generate is cancelled and no
 * callback runs for it again. evhttp reads nothing from a connection while
 * it answers a request, so a close is seen by a read event of our own on
 * the socket (watch_close), or by evhttp when a write fails (its close
 * callback). */
#include "http.h"
#include "models.h"

#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include "config.h"
#include "exec.h"
#include "httpd.h"
#include "log.h"
#include "openai.h"
#include "ops_generate.h"
#include "server.h"
#include "workpool.h"
#include "tenancy.h"
#include "text.h"

struct http_api;

/* One listener's view: which API, and whether it is TCP (bearer tokens). */
struct http_listener {
    struct http_api *api;
    struct httpd *httpd;
    bool tcp;
};

/* A generate request in flight. Owned by the api's list from submission to
 * its end (done callback, or the connection closing first). */
struct http_req {
    struct http_req *prev, *next;
    struct http_api *api;
    struct evhttp_request *req; /* evhttp's; NULL once the connection is gone */
    struct evhttp_connection *evcon;
    struct event *ev_close; /* watch_close's read event; NULL when not watching */
    uint64_t client;
    uint32_t tenant, ns;
    char tenant_name[KVD_MAX_NAME + 1];
    enum openai_kind kind;
    /* The body, parsed on a text worker (the JSON of an 8 MiB body is
     * ~150 ms of work): while `parsing`, a worker owns body, oq and perr,
     * and r outlives its connection (`gone`) until the parse is back. */
    bool parsing, gone;
    struct evbuffer *body;
    struct openai_req oq;
    bool have_oq;
    int parse_rc;
    struct kvd_error perr;
    bool stream, include_usage;
    struct models_entry *model; /* the model it runs on (resolved once parsed) */
    bool waiting;               /* for its model to load (models_wait) */
    bool overflow;              /* the client stopped reading: its generate was ended */
    /* each choice's stream so far (n_choices: the request's n) */
    struct http_choice {
        bool role_sent;              /* chat stream: the first chunk (with the role) went out */
        size_t text_sent, toks_sent; /* streamed so far */
        size_t lp_offset; /* completions' text_offset: piece bytes of the streamed tokens */
    } * cs;
    uint32_t n_choices;
    uint32_t units; /* what it counts against its tenant's in-flight limit (its choices) */
    size_t counted; /* its unread output as counted against max-buffered */
    uint64_t created;
    char id[48];
};

struct http_api {
    struct server *srv;
    struct kvmm *mm;
    struct gen_clients *gc; /* NULL in store mode */
    struct models *ms;      /* NULL in store mode */
    struct workpool *pool;  /* the text workers: bodies are parsed there (NULL: here) */
    uint64_t created;
    struct http_listener unix_l, tcp_l;
    struct http_req *live; /* requests in flight */
    uint64_t n_requests;   /* ids of responses */
};

/* ---- replies -------------------------------------------------------------- */

static void send_json(struct evhttp_request *req, int status, const char *json, size_t len)
{
    struct evbuffer *b = evbuffer_new();
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "application/json");
    if (b && evbuffer_add(b, json, len) == 0) {
        evhttp_send_reply(req, status, NULL, b);
    } else {
        evhttp_send_error(req, 503, "out of memory");
    }
    if (b)
        evbuffer_free(b);
}

/* An error of kvd's (the request's, the tenant's, the executor's). */
static void send_err(struct evhttp_request *req, const struct kvd_error *e)
{
    size_t len = 0;
    int status = 500;
    char *body = openai_error_body(e, &status, &len);
    if (body) {
        send_json(req, status, body, len);
        free(body);
    } else {
        evhttp_send_error(req, 503, "out of memory");
    }
}

/* An error of the HTTP layer itself (no such endpoint, method, token). */
__attribute__((format(printf, 5, 6))) static void send_http_err(struct evhttp_request *req,
                                                                int status, const char *type,
                                                                const char *code, const char *fmt,
                                                                ...)
{
    char msg[KVD_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    struct openai_status st = {.status = status, .type = type, .code = code};
    size_t len = 0;
    char *body = openai_error_json(&st, NULL, msg, &len);
    if (status == 401)
        evhttp_add_header(evhttp_request_get_output_headers(req), "WWW-Authenticate",
                          "Bearer realm=\"kvd\"");
    if (body) {
        send_json(req, status, body, len);
        free(body);
    } else {
        evhttp_send_error(req, 503, "out of memory");
    }
}

/* ---- identity ------------------------------------------------------------- */

struct http_who {
    uint32_t tenant, ns;
    char name[KVD_MAX_NAME + 1];
};

/* identify's answer for a TCP peer without a valid token: 401, not 403. */
#define HTTP_UNAUTHENTICATED (-2)

/* Who sent req (tenancy.h): on the Unix socket the peer's uid (and, for a
 * front end, the X-Kvd-Tenant it names); over TCP the bearer token's
 * tenant; registered with kvmm and the tenant table. 0, or -1 with e
 * filled (permission_denied, bad_request, quota_exceeded), or
 * HTTP_UNAUTHENTICATED with e's message saying why. */
static int identify(struct http_listener *l, struct evhttp_request *req, struct http_who *who,
                    struct kvd_error *e)
{
    struct http_api *a = l->api;
    const struct config *cfg = server_config(a->srv);
    struct tenancy *ty = server_tenancy(a->srv);
    struct config_identity id;
    struct tenancy_who tw;
    struct kvd_error pe;
    int rc;
    const char *sub = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Kvd-Tenant");
    if (l->tcp) {
        if (tenancy_resolve_token(cfg, httpd_bearer(req), &id, e) != 0)
            return HTTP_UNAUTHENTICATED;
        if (sub) {
            kvd_error_set(e, KVD_EPERM,
                          "X-Kvd-Tenant: only trusted front ends on the Unix socket may name "
                          "a tenant");
            return -1;
        }
        rc = tenancy_register(ty, &id, &tw, &pe);
    } else {
        struct evhttp_connection *evcon = evhttp_request_get_connection(req);
        struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent(evcon) : NULL;
        struct tenancy_cred cred;
        rc = tenancy_peer_cred(bev ? bufferevent_getfd(bev) : -1, &cred, &pe);
        if (rc == 0)
            rc = tenancy_resolve_peer(cfg, cred.uid, cred.gid, &id, &pe);
        if (rc == 0)
            rc = tenancy_register(ty, &id, &tw, &pe);
        if (rc == 0 && sub) {
            struct config_identity sid;
            rc = tenancy_resolve_sub(cfg, cred.uid, tw.name, sub, strlen(sub), "X-Kvd-Tenant", &sid,
                                     &pe);
            if (rc == 0)
                rc = tenancy_register_sub(ty, id.conf.name, &sid, &tw, &pe);
        }
    }
    if (rc) {
        *e = pe;
        return -1;
    }
    who->tenant = tw.tenant;
    who->ns = tw.ns;
    snprintf(who->name, sizeof(who->name), "%s", tw.name);
    return 0;
}

/* ---- generate requests ------------------------------------------------------ */

static void hreq_unlink(struct http_req *r)
{
    struct http_api *a = r->api;
    if (r->prev)
        r->prev->next = r->next;
    else
        a->live = r->next;
    if (r->next)
        r->next->prev = r->prev;
    server_tenant_pending(a->srv, r->tenant, -(long)r->units);
}

/* Ends r's bookkeeping once its reply is sent or its connection is gone.
 * While a worker parses its body, r only becomes `gone`: the parse's
 * completion (parsed_cb) frees it. */
static void hreq_free(struct http_req *r)
{
    if (r->waiting) { /* for its model: the wait goes (model_ready sees MODELS_GONE) */
        r->waiting = false;
        models_cancel_owner(r->api->ms, r->client);
    }
    if (r->ev_close) {
        event_free(r->ev_close);
        r->ev_close = NULL;
    }
    if (r->evcon && r->req)
        evhttp_connection_set_closecb(r->evcon, NULL, NULL);
    if (r->parsing) {
        r->gone = true;
        r->req = NULL;
        return;
    }
    server_http_buffered(r->api->srv, 0, r->counted);
    hreq_unlink(r);
    if (r->have_oq)
        openai_req_free(&r->oq);
    if (r->body)
        evbuffer_free(r->body);
    free(r->cs);
    free(r);
}

/* The connection closed before the reply was done: cancel the generate.
 * evhttp keeps a request whose reply was not finished (it no longer belongs
 * to the connection) for its user to free; one still attached is freed
 * with the connection. */
static void on_conn_close(struct evhttp_connection *evcon, void *arg)
{
    struct http_req *r = arg;
    log_debug("http: request %s: the client closed the connection; its generate is cancelled",
              r->id);
    if (r->api->gc)
        ops_generate_client_drop(r->api->gc, r->client);
    if (r->req && !evhttp_request_get_connection(r->req))
        evhttp_request_free(r->req);
    r->req = NULL;
    hreq_free(r);
}

/* watch_close's event: the socket became readable while r is answered.
 * End of file (or an error) is the client gone: its generate is cancelled
 * and the connection freed at once, not when the reply is written. Bytes
 * are the client's next request (pipelining): they stay for evhttp, and
 * the watch ends (a close is then seen when the reply is written). */
static void on_readable(evutil_socket_t fd, short what, void *arg)
{
    struct http_req *r = arg;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) {
        event_free(r->ev_close);
        r->ev_close = NULL;
        return;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        event_add(r->ev_close, NULL); /* not persistent: re-armed */
        return;
    }
    struct evhttp_connection *evcon = r->evcon;
    log_debug("http: request %s: the client closed the connection (%s); its generate is "
              "cancelled",
              r->id, n == 0 ? "end of file" : strerror(errno));
    evhttp_connection_set_closecb(evcon, NULL, NULL);
    if (r->api->gc)
        ops_generate_client_drop(r->api->gc, r->client);
    r->req = NULL; /* still the connection's: freed with it */
    hreq_free(r);
    evhttp_connection_free(evcon);
}

/* Watches r's socket for the client closing while r is answered (evhttp
 * has stopped reading it). A plain read event, not EV_CLOSED: epoll reports
 * a Unix socket whose peer closed as a hang-up, which libevent 2.1 hands
 * only to read and write events. Without it (no memory) a close is seen
 * when the reply is written. */
static void watch_close(struct http_req *r)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(r->evcon);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0)
        return;
    r->ev_close = event_new(server_event_base(r->api->srv), fd, EV_READ, on_readable, r);
    if (r->ev_close && event_add(r->ev_close, NULL) != 0) {
        event_free(r->ev_close);
        r->ev_close = NULL;
    }
}

/* One "data: JSON\n\n" event. */
static void sse_send(struct http_req *r, const char *json, size_t len)
{
    struct evbuffer *b = evbuffer_new();
    if (!b)
        return;
    if (evbuffer_add(b, "data: ", 6) == 0 && evbuffer_add(b, json, len) == 0 &&
        evbuffer_add(b, "\n\n", 2) == 0)
        evhttp_send_reply_chunk(r->req, b);
    evbuffer_free(b);
}

#define HTTP_BUDGET_MIN_UNREAD ((size_t)64 << 10)

/* After a chunk: a client that does not read is bounded like a msgpack
 * connection (max-unread-output); its generate ends with busy. */
static void check_unread(struct http_req *r)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(r->evcon);
    size_t unread = bev ? evbuffer_get_length(bufferevent_get_output(bev)) : 0;
    uint64_t lim = server_options(r->api->srv)->max_unread_output;
    server_http_buffered(r->api->srv, unread > r->counted ? unread - r->counted : 0,
                         unread < r->counted ? r->counted - unread : 0);
    r->counted = unread;
    /* The daemon-wide budget: while every buffer together is over it, a
     * stream that has not read its last 64 KiB ends too. */
    if (!r->overflow && unread >= HTTP_BUDGET_MIN_UNREAD &&
        server_over_buffer_budget(r->api->srv)) {
        char msg[200];
        snprintf(msg, sizeof(msg),
                 "the client did not read its output (%zu bytes unread) while the daemon's "
                 "buffers are over max-buffered (%llu)",
                 unread, (unsigned long long)server_options(r->api->srv)->max_buffered);
        log_notice("http: request %s: %s; ending its generate", r->id, msg);
        r->overflow = true;
        ops_generate_client_abort(r->api->gc, r->client, KVD_EBUSY, msg);
        return;
    }
    if (!r->overflow && unread > lim) {
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "the client did not read its output: %zu bytes unread, over "
                 "max-unread-output (%llu)",
                 unread, (unsigned long long)lim);
        log_notice("http: request %s: %s; ending its generate", r->id, msg);
        r->overflow = true;
        ops_generate_client_abort(r->api->gc, r->client, KVD_EBUSY, msg);
    }
}

static const struct tokenizer *req_tokenizer(const struct http_req *r)
{
    return r->model ? text_tokenizer(models_text(r->model)) : NULL;
}

/* The bytes of the tokens' pieces (what a completion's text_offset counts). */
static size_t pieces_len(const struct tokenizer *tok, const uint32_t *toks, size_t n)
{
    char buf[8];
    size_t len = 0;
    for (size_t i = 0; tok && i < n; i++)
        len += tokenizer_piece(tok, toks[i], true, buf, sizeof buf);
    return len;
}

static void on_tokens(void *ud, uint32_t choice, const uint32_t *toks, size_t n, const char *text,
                      size_t text_len, const struct sampler_logprob *lp, uint32_t lp_top)
{
    struct http_req *r = ud;
    if (!r->req || r->overflow || !r->stream || choice >= r->n_choices)
        return;
    struct http_choice *cs = &r->cs[choice];
    struct openai_out o = {
        .kind = r->kind,
        .id = r->id,
        .model = models_name(r->model),
        .created = r->created,
        .text = text,
        .text_len = text_len,
        .toks = toks,
        .n_toks = n,
        .lp = lp,
        .lp_top = lp_top,
        .tok = lp ? req_tokenizer(r) : NULL,
        .text_offset = cs->lp_offset,
        .role = r->kind == OPENAI_CHAT && !cs->role_sent,
        .index = choice,
    };
    size_t len = 0;
    char *json = openai_render(&o, true, &len);
    if (!json)
        return; /* no memory: the piece is lost, the stream goes on */
    sse_send(r, json, len);
    free(json);
    cs->role_sent = true;
    cs->text_sent += text_len;
    cs->toks_sent += n;
    if (lp)
        cs->lp_offset += pieces_len(o.tok, toks, n);
    check_unread(r);
}

/* A session request's outcome, as response headers (non-streaming replies;
 * a stream's headers are gone before it ends). */
static void session_reply_headers(struct evhttp_request *req, const struct sched_session *s)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    char v[KVD_ERROR_MSG_MAX + 32];
    evhttp_add_header(h, "X-Kvd-Session-Saved", s->saved ? "true" : "false");
    if (s->saved) {
        snprintf(v, sizeof v, "%zu", s->info.n_tokens);
        evhttp_add_header(h, "X-Kvd-Session-Tokens", v);
        snprintf(v, sizeof v, "%llu", (unsigned long long)s->info.expires);
        evhttp_add_header(h, "X-Kvd-Session-Expires", v);
    } else {
        snprintf(v, sizeof v, "%s: %s", kvd_err_code(s->err.code), s->err.message);
        for (char *c = v; *c; c++)
            if (*c == '\r' || *c == '\n')
                *c = ' ';
        evhttp_add_header(h, "X-Kvd-Session-Error", v);
    }
}

/* X-Kvd-Session: NAME (and X-Kvd-Session-Ttl: seconds) make a completion a
 * session request (gen_request.h): the conversation is continued from the
 * session's cached blocks and saved back under the name. */
static int session_headers(struct evhttp_request *req, struct gen_args *a, struct kvd_error *e)
{
    struct evkeyvalq *h = evhttp_request_get_input_headers(req);
    const char *name = evhttp_find_header(h, "X-Kvd-Session");
    const char *ttl = evhttp_find_header(h, "X-Kvd-Session-Ttl");
    if (!name)
        return ttl ? kvd_error_set(e, KVD_EBADREQ, "X-Kvd-Session-Ttl needs X-Kvd-Session") : 0;
    if (strlen(name) > KVMM_SESSION_NAME || !kvmm_session_name_ok(name))
        return kvd_error_set(e, KVD_EBADREQ,
                             "X-Kvd-Session must be 1 to %d letters, digits or -_.:@/",
                             KVMM_SESSION_NAME);
    a->has_session = true;
    snprintf(a->session, sizeof a->session, "%s", name);
    if (ttl) {
        char *end = NULL;
        errno = 0;
        unsigned long long v = strtoull(ttl, &end, 10);
        if (ttl[0] < '0' || ttl[0] > '9' || *end || errno || v < 1 || v > KVMM_SESSION_TTL_MAX)
            return kvd_error_set(e, KVD_EBADREQ, "X-Kvd-Session-Ttl must be 1 to %llu seconds",
                                 (unsigned long long)KVMM_SESSION_TTL_MAX);
        a->session_ttl_s = v;
    }
    return 0;
}

static void on_done(void *ud, const struct ops_generate_result *res)
{
    struct http_req *r = ud;
    if (!r->req) {
        hreq_free(r);
        return;
    }
    struct kvd_error e;
    bool failed = res->finish == SCHED_FINISH_ERROR || res->finish == SCHED_FINISH_CANCELLED ||
                  res->n_choices != r->n_choices;
    if (res->finish == SCHED_FINISH_ERROR)
        e = *res->err;
    else if (res->n_choices != r->n_choices)
        kvd_error_set(&e, KVD_ENOMEM, "out of memory building the reply");
    else if (failed)
        kvd_error_set(&e, KVD_ECANCELLED, "cancelled: the daemon is shutting down");
    struct openai_out o = {
        .kind = r->kind,
        .id = r->id,
        .model = models_name(r->model),
        .created = r->created,
        .prompt_tokens = res->prompt,
        .cached_tokens = res->cached,
        .completion_tokens = res->completion,
        .lp_top = res->lp_top,
    };
    /* each choice: what it has not streamed yet (everything when not
     * streaming) and its finish reason */
    struct openai_out *ch = failed ? NULL : calloc(res->n_choices ? res->n_choices : 1, sizeof *ch);
    if (!failed && !ch) {
        failed = true;
        kvd_error_set(&e, KVD_ENOMEM, "out of memory building the reply");
    }
    for (uint32_t i = 0; !failed && i < res->n_choices; i++) {
        const struct ops_generate_choice *c = &res->choices[i];
        const struct http_choice *cs = &r->cs[i];
        size_t ts = r->stream ? cs->text_sent : 0, ks = r->stream ? cs->toks_sent : 0;
        ch[i] = (struct openai_out){
            .kind = r->kind,
            .index = i,
            .finish = sched_finish_name(c->finish),
            .lp_top = res->lp_top,
            .tok = c->lp ? req_tokenizer(r) : NULL,
            .text_offset = r->stream ? cs->lp_offset : 0,
            .role = r->kind == OPENAI_CHAT && !(r->stream && cs->role_sent),
        };
        if (c->text && c->text_len > ts) {
            ch[i].text = c->text + ts;
            ch[i].text_len = c->text_len - ts;
        }
        if (c->n_toks > ks) {
            ch[i].toks = c->toks + ks;
            ch[i].n_toks = c->n_toks - ks;
            if (c->lp)
                ch[i].lp = c->lp + ks * (1 + (size_t)res->lp_top);
        }
    }
    size_t len = 0;
    char *json = NULL;
    if (!r->stream) {
        if (failed) {
            send_err(r->req, &e);
        } else {
            o.choices = ch;
            o.n_choices = res->n_choices;
            o.usage = true;
            json = openai_render(&o, false, &len);
            if (json) {
                if (res->session)
                    session_reply_headers(r->req, res->session);
                send_json(r->req, 200, json, len);
            } else {
                kvd_error_set(&e, KVD_ENOMEM, "out of memory building the reply");
                send_err(r->req, &e);
            }
        }
    } else {
        if (failed) {
            int status;
            json = openai_error_body(&e, &status, &len);
            if (json)
                sse_send(r, json, len);
        } else {
            /* The rest of each choice: text held back for a possible stop
             * string, tokens not streamed yet, and the finish reason. */
            for (uint32_t i = 0; i < res->n_choices; i++) {
                struct openai_out one = o;
                one.choices = &ch[i];
                one.n_choices = 1;
                json = openai_render(&one, true, &len);
                if (json)
                    sse_send(r, json, len);
                free(json);
                json = NULL;
            }
            if (r->include_usage) {
                struct openai_out u = o;
                u.no_choices = true;
                u.usage = true;
                json = openai_render(&u, true, &len);
                if (json)
                    sse_send(r, json, len);
            }
        }
        free(json);
        json = NULL;
        struct evbuffer *b = evbuffer_new();
        if (b && evbuffer_add(b, "data: [DONE]\n\n", 14) == 0)
            evhttp_send_reply_chunk(r->req, b);
        if (b)
            evbuffer_free(b);
        evhttp_send_reply_end(r->req);
    }
    free(ch);
    free(json);
    hreq_free(r);
}

static void submit_parsed(struct http_req *r);

/* models_wait's answer for r: its model loaded (submit it now), or not. */
static void model_ready(void *ud, int rc, const struct kvd_error *err)
{
    struct http_req *r = ud;
    if (rc == MODELS_GONE)
        return; /* its connection closed: the close path frees r */
    r->waiting = false;
    if (rc) {
        send_err(r->req, err);
        hreq_free(r);
        return;
    }
    submit_parsed(r);
}

/* The parsed body of r: its model resolved (and loaded first when it is
 * not), then submitted; or refused. Loop thread. */
static void generate_parsed(struct http_req *r)
{
    struct http_api *a = r->api;
    struct evhttp_request *req = r->req;
    if (r->parse_rc != 0) {
        send_err(req, &r->perr);
        hreq_free(r);
        return;
    }
    struct kvd_error e;
    r->stream = r->oq.stream;
    r->include_usage = r->oq.include_usage;
    r->client = ops_generate_client_id(a->gc);
    /* n choices: n in flight for the tenant (one was counted with the body) */
    uint32_t n = (uint32_t)r->oq.args.n;
    if (n > 1 && server_queue_admit_n(a->srv, NULL, r->tenant, n - 1, &e) != 0) {
        send_err(req, &e);
        hreq_free(r);
        return;
    }
    if (n > 1) {
        server_tenant_pending(a->srv, r->tenant, (long)n - 1);
        r->units = n;
    }
    if (!(r->cs = calloc(n, sizeof *r->cs))) {
        kvd_error_set(&e, KVD_ENOMEM, "out of memory");
        send_err(req, &e);
        hreq_free(r);
        return;
    }
    r->n_choices = n;
    if (models_resolve(a->ms, r->oq.model, r->oq.model_len, r->oq.model != NULL, false,
                       r->tenant_name, &r->model, &e) ||
        session_headers(req, &r->oq.args, &e)) {
        send_err(req, &e);
        hreq_free(r);
        return;
    }
    if (!models_exec(r->model)) {
        r->waiting = true;
        if (models_wait(r->model, r->client, model_ready, r, &e) != 0) {
            r->waiting = false;
            send_err(req, &e);
            hreq_free(r);
        }
        return;
    }
    submit_parsed(r);
}

/* The parsed body of r, its model loaded: submitted as a generate client,
 * or refused. Loop thread. */
static void submit_parsed(struct http_req *r)
{
    struct http_api *a = r->api;
    struct evhttp_request *req = r->req;
    struct kvd_error e;
    struct ops_generate_client cb = {.ud = r, .tokens = on_tokens, .done = on_done};
    int rc =
        ops_generate_client_submit(a->gc, r->client, r->model, &r->oq.args, r->tenant, &cb, &e);
    r->oq.args.compiled = NULL; /* the build took it, whatever it returned */
    if (rc) {
        send_err(req, &e);
        hreq_free(r);
        return;
    }
    openai_req_free(&r->oq);
    r->have_oq = false;
    evbuffer_free(r->body);
    r->body = NULL;
    if (r->stream) {
        struct evkeyvalq *h = evhttp_request_get_output_headers(req);
        evhttp_add_header(h, "Content-Type", "text/event-stream");
        evhttp_add_header(h, "Cache-Control", "no-cache");
        evhttp_send_reply_start(req, 200, "OK");
    }
}

/* Back on the loop from the worker (event_base_once). */
static void parsed_cb(evutil_socket_t fd, short what, void *arg)
{
    struct http_req *r = arg;
    r->parsing = false;
    if (r->gone) {
        hreq_free(r);
        return;
    }
    generate_parsed(r);
}

/* The context of the model a body names (openai_parse_ctx, on a worker). */
static uint32_t ctx_of(void *ud, const char *model, size_t len)
{
    return models_context_of(ud, model, len);
}

/* The worker's job: the body's JSON into typed generate arguments. */
static void parse_job(void *ud, bool cancelled)
{
    struct http_req *r = ud;
    if (cancelled) {
        r->parse_rc = kvd_error_set(&r->perr, KVD_ECANCELLED, "the daemon is shutting down");
    } else {
        size_t len = evbuffer_get_length(r->body);
        const char *p = (const char *)evbuffer_pullup(r->body, -1);
        r->parse_rc =
            openai_parse_ctx(r->kind, p ? p : "", len, ctx_of, r->api->ms, &r->oq, &r->perr) ? -1
                                                                                             : 0;
        r->have_oq = r->parse_rc == 0;
    }
    if (!r->api->pool)
        return; /* parsed inline: the caller goes on */
    /* r belongs to the loop again once the event runs; a loop that has
     * stopped never runs it, and http_stop frees r. */
    if (event_base_once(server_event_base(r->api->srv), -1, EV_TIMEOUT, parsed_cb, r, NULL) != 0)
        log_err("http: request %s: cannot hand its parsed body back to the loop", r->id);
}

static void handle_generate(struct http_listener *l, struct evhttp_request *req,
                            enum openai_kind kind, const struct http_who *who)
{
    struct http_api *a = l->api;
    struct kvd_error e;
    if (!a->gc) {
        send_http_err(req, 503, "server_error", "unsupported",
                      "no model loaded: kvd runs in store mode (start it with --model)");
        return;
    }
    /* In flight per tenant: one count with the tenant's msgpack generates
     * (the server's tenant table), from the moment the body is taken. */
    if (server_queue_admit(a->srv, NULL, who->tenant, &e) != 0) {
        send_err(req, &e);
        return;
    }
    struct http_req *r = calloc(1, sizeof(*r));
    struct evbuffer *body = evbuffer_new();
    if (!r || !body || evbuffer_add_buffer(body, evhttp_request_get_input_buffer(req)) != 0) {
        free(r);
        if (body)
            evbuffer_free(body);
        kvd_error_set(&e, KVD_ENOMEM, "out of memory");
        send_err(req, &e);
        return;
    }
    r->api = a;
    r->req = req;
    r->evcon = evhttp_request_get_connection(req);
    r->kind = kind;
    r->tenant = who->tenant;
    r->ns = who->ns;
    snprintf(r->tenant_name, sizeof(r->tenant_name), "%s", who->name);
    r->body = body;
    r->created = (uint64_t)time(NULL);
    snprintf(r->id, sizeof(r->id), "%s-kvd%" PRIu64, kind == OPENAI_CHAT ? "chatcmpl" : "cmpl",
             ++a->n_requests);
    r->next = a->live;
    if (a->live)
        a->live->prev = r;
    a->live = r;
    server_tenant_pending(a->srv, r->tenant, 1);
    r->units = 1;
    evhttp_connection_set_closecb(r->evcon, on_conn_close, r);
    watch_close(r);
    if (!a->pool) {
        parse_job(r, false);
        generate_parsed(r);
        return;
    }
    r->parsing = true;
    int rc = workpool_submit(a->pool, r->tenant, parse_job, r);
    if (rc) {
        r->parsing = false;
        kvd_error_set(&e, rc, "%s", exec_submit_errmsg(rc)); /* the pool's refusals */
        send_err(req, &e);
        hreq_free(r);
    }
}

/* ---- routing -------------------------------------------------------------- */

static void on_request(struct evhttp_request *req, void *arg)
{
    struct http_listener *l = arg;
    struct http_api *a = l->api;
    struct kvd_error e;
    const char *uri = evhttp_request_get_uri(req);
    size_t plen = strcspn(uri, "?#");
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    httpd_served(l->httpd);
    struct evkeyvalq *out_h = evhttp_request_get_output_headers(req);
    /* evhttp reads a body by the first Content-Length: with a second one
     * the rest of the bytes would be parsed as another request (request
     * smuggling). Refused, and the connection closed with the reply. */
    unsigned n_length = 0;
    for (struct evkeyval *hv = evhttp_request_get_input_headers(req)->tqh_first; hv;
         hv = hv->next.tqe_next)
        n_length += evutil_ascii_strcasecmp(hv->key, "Content-Length") == 0;
    if (n_length > 1) {
        evhttp_add_header(out_h, "Connection", "close");
        send_http_err(req, 400, "invalid_request_error", "bad_request",
                      "more than one Content-Length header");
        return;
    }
    /* Methods kvd does not serve (CONNECT, PUT, ...): answered with a
     * length and the connection closed, not left open until the timeout. */
    static const char methods_msg[] = "kvd's HTTP API serves GET, HEAD and POST";
    if (cmd == EVHTTP_REQ_CONNECT) {
        /* evhttp writes a reply to CONNECT without a length and keeps the
         * socket (a tunnel would follow): the reply goes out here, whole,
         * and the socket is shut, so evhttp's own write below fails and it
         * frees the connection. */
        struct openai_status st = {405, "invalid_request_error", "method_not_allowed"};
        size_t bl = 0;
        char *body = openai_error_json(&st, NULL, methods_msg, &bl);
        char resp[512];
        int rl = snprintf(resp, sizeof(resp),
                          "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD, POST\r\n"
                          "Content-Type: application/json\r\nConnection: close\r\n"
                          "Content-Length: %zu\r\n\r\n%s",
                          body ? bl : 0, body ? body : "");
        free(body);
        struct evhttp_connection *evcon = evhttp_request_get_connection(req);
        struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent(evcon) : NULL;
        evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
        if (fd >= 0) {
            ssize_t w = send(fd, resp, (size_t)rl, MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)w; /* a client that cannot take 250 bytes just sees the close */
            shutdown(fd, SHUT_RDWR);
        }
        evhttp_send_error(req, 405, "Method Not Allowed");
        return;
    }
    if (cmd != EVHTTP_REQ_GET && cmd != EVHTTP_REQ_HEAD && cmd != EVHTTP_REQ_POST) {
        evhttp_add_header(out_h, "Connection", "close");
        evhttp_add_header(out_h, "Allow", "GET, HEAD, POST");
        send_http_err(req, 405, "invalid_request_error", "method_not_allowed", "%s", methods_msg);
        return;
    }
#define PATH_IS(p) (plen == sizeof(p) - 1 && !strncmp(uri, p, plen))
    bool health = PATH_IS("/health"), models = PATH_IS("/v1/models"),
         compl = PATH_IS("/v1/completions"), chat = PATH_IS("/v1/chat/completions");
#undef PATH_IS
    if (!health && !models && !compl &&!chat) {
        send_http_err(req, 404, "invalid_request_error", "not_found",
                      "no such endpoint: kvd serves /v1/completions, /v1/chat/completions, "
                      "/v1/models and /health");
        return;
    }
    bool get = cmd == EVHTTP_REQ_GET || cmd == EVHTTP_REQ_HEAD;
    if ((health || models) != get || (!get && cmd != EVHTTP_REQ_POST)) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow",
                          health || models ? "GET, HEAD" : "POST");
        send_http_err(req, 405, "invalid_request_error", "method_not_allowed", "%s takes %s",
                      health   ? "/health"
                      : models ? "/v1/models"
                               : "this endpoint",
                      health || models ? "GET" : "POST");
        return;
    }
    if (health) { /* no identity: a liveness probe */
        const char *s = a->gc ? "{\"status\":\"ok\"}" : "{\"status\":\"ok\",\"model\":null}";
        send_json(req, 200, s, strlen(s));
        return;
    }
    struct http_who who;
    int rc = identify(l, req, &who, &e);
    if (rc == HTTP_UNAUTHENTICATED) {
        /* Logged (rate-limited per call site, log.c) and counted: a token
         * being guessed shows in the log and the metrics. */
        const char *host = NULL;
        ev_uint16_t port = 0;
        struct evhttp_connection *evcon = evhttp_request_get_connection(req);
        char *h = NULL;
        if (evcon)
            evhttp_connection_get_peer(evcon, &h, &port);
        host = h;
        server_count_http_auth_failure(a->srv);
        log_notice("http: a TCP request from %s:%u refused (401): %s", host ? host : "?",
                   (unsigned)port, e.message);
        send_http_err(req, 401, "authentication_error", "invalid_api_key", "%s", e.message);
        return;
    }
    if (rc != 0) {
        send_err(req, &e);
        return;
    }
    if (models) {
        /* every model, loaded or not (a tenant's forbidden ones left out) */
        size_t len = 0, n = 0, nm = models_count(a->ms);
        const char *names[OPTIONS_MAX_MODELS], *states[OPTIONS_MAX_MODELS];
        for (size_t i = 0; i < nm && n < OPTIONS_MAX_MODELS; i++) {
            struct models_entry *me = models_at(a->ms, i);
            if (!models_allows(me, who.name))
                continue;
            names[n] = models_name(me);
            states[n++] = models_state_name(models_state(me));
        }
        char *json = openai_models_list(names, states, n, a->created, &len);
        if (json) {
            send_json(req, 200, json, len);
            free(json);
        } else {
            kvd_error_set(&e, KVD_ENOMEM, "out of memory");
            send_err(req, &e);
        }
        return;
    }
    handle_generate(l, req, compl ? OPENAI_COMPLETION : OPENAI_CHAT, &who);
}

/* ---- start / stop --------------------------------------------------------- */

/* httpd's admin test for the Unix socket's peers: the config in force. */
static bool is_admin_uid(void *ud, unsigned uid)
{
    return config_is_admin(server_config(ud), (uid_t)uid);
}

static int listener_start(struct http_api *a, struct http_listener *l, const char *addr, bool tcp,
                          uint16_t *port, char *err, size_t errlen)
{
    const struct options *o = server_options(a->srv);
    struct httpd_conf hc = {
        .what = "http",
        .addr = addr,
        .force = o->http_force,
        .force_hint = "the API serves anyone holding a token there; add --http-force to "
                      "serve it anyway",
        .group = o->socket_group,
        .mode = 0660,
        .max_conns = o->http_max_conns,
        .request_timeout_s = o->http_timeout_s,
        .max_per_peer = tcp ? o->http_max_conns_per_peer : o->http_max_conns_per_uid,
        .admin_reserve = tcp ? 0 : o->http_admin_reserved_conns,
        .is_admin = tcp ? NULL : is_admin_uid,
        .is_admin_ud = a->srv,
    };
    l->api = a;
    l->tcp = tcp;
    int rc = httpd_new(server_event_base(a->srv), &hc, &l->httpd);
    if (rc)
        return rc;
    struct evhttp *http = httpd_evhttp(l->httpd);
    /* Every method reaches on_request, which refuses the others with a
     * length and a close (evhttp's own 501 had neither). */
    evhttp_set_allowed_methods(http, EVHTTP_REQ_GET | EVHTTP_REQ_HEAD | EVHTTP_REQ_POST |
                                         EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS |
                                         EVHTTP_REQ_TRACE | EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
    evhttp_set_max_headers_size(http, 16384);
    evhttp_set_max_body_size(http, (ev_ssize_t)o->http_max_body);
    evhttp_set_timeout(http, (int)o->http_timeout_s);
    evhttp_set_default_content_type(http, "application/json");
    httpd_set_handler(l->httpd, on_request, l);
    return httpd_listen(l->httpd, port, err, errlen);
}

int http_start(struct server *srv, struct ops_generate *gen, struct workpool *pool,
               struct http_api **out, uint16_t *tcp_port, char *err, size_t errlen)
{
    const struct options *o = server_options(srv);
    *out = NULL;
    if (!o->http_socket[0] && !o->http_addr[0])
        return 0;
    struct http_api *a = calloc(1, sizeof(*a));
    if (!a)
        return KVD_ENOMEM;
    a->srv = srv;
    struct server_obs obs;
    server_get_obs(srv, &obs);
    a->mm = obs.mm;
    a->gc = gen ? ops_generate_clients(gen) : NULL;
    a->ms = gen ? obs.models : NULL;
    a->pool = pool;
    a->created = (uint64_t)time(NULL);
    int rc = 0;
    char addr[120];
    if (o->http_socket[0]) {
        snprintf(addr, sizeof(addr), "unix:%s", o->http_socket);
        if ((rc = listener_start(a, &a->unix_l, addr, false, NULL, err, errlen)))
            goto fail;
        log_info("http: serving the OpenAI API on the unix socket %s (e.g. curl --unix-socket "
                 "%s http://localhost/v1/models)",
                 o->http_socket, o->http_socket);
    }
    if (o->http_addr[0]) {
        uint16_t port = 0;
        if ((rc = listener_start(a, &a->tcp_l, o->http_addr, true, &port, err, errlen)))
            goto fail;
        if (tcp_port)
            *tcp_port = port;
        log_info("http: serving the OpenAI API on %s (port %u; bearer tokens from [http])",
                 o->http_addr, port);
        if (server_config(srv)->n_tokens == 0)
            log_notice("http: no [http] token in the configuration: every TCP request will "
                       "be refused (401)");
    }
    *out = a;
    return 0;
fail:
    http_stop(a);
    return rc;
}

void http_stop(struct http_api *a)
{
    if (!a)
        return;
    /* Requests in flight: their generates are cancelled and their callbacks
     * never run; evhttp frees the requests with their connections. */
    while (a->live) {
        struct http_req *r = a->live;
        /* The workers are gone (freed first): a parse's completion that
         * never ran leaves r to us. */
        r->parsing = false;
        if (a->gc)
            ops_generate_client_drop(a->gc, r->client);
        hreq_free(r);
    }
    httpd_free(a->unix_l.httpd);
    httpd_free(a->tcp_l.httpd);
    free(a);
}
