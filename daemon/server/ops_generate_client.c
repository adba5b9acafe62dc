/* Generate clients other than msgpack connections (ops_generate.h): a
 * registry of live clients (loop thread only) and a queue from the
 * executor's thread to the loop. The executor's sink copies each streamed
 * piece and each final result into a queue item (the request is the
 * executor's and is freed after its done call); an event on the loop hands
 * the items to the client's callbacks, or drops them when the client has
 * gone (ops_generate_client_drop). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>

#include "grammar.h"
#include "models.h"
#include "ops_generate.h"
#include "server.h"
#include "text_out.h"

#define GC_BUCKETS 256u

struct gc_client {
    struct gc_client *next; /* hash chain */
    uint64_t id;
    struct models_entry *model; /* its request's: cancels go to its executor */
    struct ops_generate_client cb;
};

/* A choice's final result: one allocation with its tokens, logprobs and
 * text. */
struct gc_choice {
    enum sched_finish finish;
    uint32_t *toks;
    size_t n_toks;
    char *text; /* NULL: token-only */
    size_t text_len;
    struct sampler_logprob *lp; /* NULL: not asked */
    void *mem;
};

struct gc_item {
    struct gc_item *next;
    uint64_t client;
    bool done;
    /* tokens (in the item's allocation) */
    uint32_t choice;
    uint32_t *toks; /* (n_toks) */
    size_t n_toks;
    char *text; /* (text_len + 1); NULL: token-only */
    size_t text_len;
    struct sampler_logprob *lp; /* (n_toks * (1 + lp_top)); NULL: not asked */
    uint32_t lp_top;
    /* done */
    struct kvd_error err;
    enum sched_finish finish;
    uint64_t prompt, cached, completion;
    bool has_session;
    struct sched_session session; /* the outcome of a session request's save */
    uint32_t n_choices;
    struct gc_choice *choices; /* (n_choices), owned */
};

static void item_free(struct gc_item *it)
{
    for (uint32_t i = 0; it && i < it->n_choices; i++)
        free(it->choices[i].mem);
    if (it)
        free(it->choices);
    free(it);
}

struct gen_clients {
    struct server *srv;                    /* not owned: client ids */
    struct models *ms;                     /* not owned */
    struct event *ev;                      /* the loop's side of the queue */
    struct exec_sink sink;                 /* every client request's (gen_clients_tokens/done) */
    struct gc_client *buckets[GC_BUCKETS]; /* loop thread */
    pthread_mutex_t mu;
    struct gc_item *head, *tail; /* under mu */
};

static struct gc_client **find_slot(struct gen_clients *gc, uint64_t id)
{
    struct gc_client **p = &gc->buckets[(id * 0x9e3779b97f4a7c15ull) >> 56];
    while (*p && (*p)->id != id)
        p = &(*p)->next;
    return p;
}

static void gc_deliver(evutil_socket_t fd, short what, void *arg)
{
    struct gen_clients *gc = arg;
    pthread_mutex_lock(&gc->mu);
    struct gc_item *it = gc->head;
    gc->head = gc->tail = NULL;
    pthread_mutex_unlock(&gc->mu);
    while (it) {
        struct gc_item *next = it->next;
        struct gc_client **slot = find_slot(gc, it->client);
        struct gc_client *c = *slot;
        if (c && !it->done) {
            c->cb.tokens(c->cb.ud, it->choice, it->toks, it->n_toks, it->text, it->text_len, it->lp,
                         it->lp_top);
        } else if (c) {
            *slot = c->next; /* nothing runs for it after done */
            struct ops_generate_choice *ch = calloc(it->n_choices ? it->n_choices : 1, sizeof *ch);
            if (!ch && !it->err.code)
                kvd_error_set(&it->err, KVD_ENOMEM, "out of memory building the reply");
            for (uint32_t i = 0; ch && i < it->n_choices; i++)
                ch[i] = (struct ops_generate_choice){
                    .finish = it->choices[i].finish,
                    .toks = it->choices[i].toks,
                    .n_toks = it->choices[i].n_toks,
                    .text = it->choices[i].text,
                    .text_len = it->choices[i].text_len,
                    .lp = it->choices[i].lp,
                };
            struct ops_generate_result res = {
                .err = &it->err,
                .finish = it->err.code ? SCHED_FINISH_ERROR : it->finish,
                .n_choices = ch ? it->n_choices : 0,
                .choices = ch,
                .lp_top = it->lp_top,
                .prompt = it->prompt,
                .cached = it->cached,
                .completion = it->completion,
                .session = it->has_session ? &it->session : NULL,
            };
            struct ops_generate_client cb = c->cb;
            free(c);
            cb.done(cb.ud, &res);
            free(ch);
        }
        item_free(it);
        it = next;
    }
}

static void sink_tokens(void *ud, const struct sched_req *r, const uint32_t *toks, size_t n)
{
    gen_clients_tokens(ud, r, toks, n);
}

static void sink_done(void *ud, const struct sched_req *r)
{
    gen_clients_done(ud, r);
}

static void sink_done_group(void *ud, const struct sched_req *const *rs, uint32_t n)
{
    gen_clients_done_group(ud, rs, n);
}

int gen_clients_new(struct server *srv, struct models *ms, struct gen_clients **out)
{
    struct gen_clients *gc = calloc(1, sizeof(*gc));
    if (!gc)
        return KVD_ENOMEM;
    gc->srv = srv;
    gc->sink = (struct exec_sink){
        .ud = gc, .tokens = sink_tokens, .done = sink_done, .done_group = sink_done_group};
    gc->ms = ms;
    pthread_mutex_init(&gc->mu, NULL);
    gc->ev = event_new(server_event_base(srv), -1, 0, gc_deliver, gc);
    if (!gc->ev) {
        gen_clients_free(gc);
        return KVD_ENOMEM;
    }
    *out = gc;
    return 0;
}

void gen_clients_free(struct gen_clients *gc)
{
    if (!gc)
        return;
    gen_clients_release_loop(gc);
    for (struct gc_item *it = gc->head, *next; it; it = next) {
        next = it->next;
        item_free(it);
    }
    for (unsigned b = 0; b < GC_BUCKETS; b++)
        for (struct gc_client *c = gc->buckets[b], *next; c; c = next) {
            next = c->next;
            free(c);
        }
    pthread_mutex_destroy(&gc->mu);
    free(gc);
}

/* ---- the executor's side -------------------------------------------------- */

/* One item with room for n tokens, their logprobs (lp: NULL or n * (1 +
 * lp_top) entries) and text_len bytes of text (+ NUL). */
static struct gc_item *item_new(uint64_t client, const uint32_t *toks, size_t n, const char *text,
                                size_t text_len, bool has_text, const struct sampler_logprob *lp,
                                uint32_t lp_top)
{
    size_t n_lp = lp ? n * (1 + (size_t)lp_top) : 0;
    size_t bytes = sizeof(struct gc_item) + n_lp * sizeof(*lp) + n * sizeof(uint32_t) +
                   (has_text ? text_len + 1 : 0);
    struct gc_item *it = calloc(1, bytes);
    if (!it)
        return NULL;
    it->client = client;
    if (lp) { /* first: the item's alignment suits them */
        it->lp = (struct sampler_logprob *)(it + 1);
        memcpy(it->lp, lp, n_lp * sizeof(*lp));
        it->lp_top = lp_top;
    }
    it->toks = (uint32_t *)((struct sampler_logprob *)(it + 1) + n_lp);
    if (n)
        memcpy(it->toks, toks, n * sizeof(uint32_t));
    it->n_toks = n;
    if (has_text) {
        it->text = (char *)(it->toks + n);
        if (text_len)
            memcpy(it->text, text, text_len);
        it->text[text_len] = '\0';
        it->text_len = text_len;
    }
    return it;
}

static void push(struct gen_clients *gc, struct gc_item *it)
{
    pthread_mutex_lock(&gc->mu);
    if (!gc->ev) { /* the loop is gone (gen_clients_release_loop) */
        pthread_mutex_unlock(&gc->mu);
        item_free(it);
        return;
    }
    if (gc->tail)
        gc->tail->next = it;
    else
        gc->head = it;
    gc->tail = it;
    event_active(gc->ev, EV_READ, 0);
    pthread_mutex_unlock(&gc->mu);
}

void gen_clients_release_loop(struct gen_clients *gc)
{
    if (!gc)
        return;
    pthread_mutex_lock(&gc->mu);
    struct event *ev = gc->ev;
    gc->ev = NULL;
    pthread_mutex_unlock(&gc->mu);
    if (ev)
        event_free(ev);
}

void gen_clients_tokens(struct gen_clients *gc, const struct sched_req *r, const uint32_t *toks,
                        size_t n)
{
    const char *text = NULL;
    size_t text_len = 0;
    if (r->text)
        text_len = text_out_take(r->text, &text); /* the executor's thread: it owns r */
    size_t from = (size_t)(toks - (r->toks + r->n_prompt));
    const struct sampler_logprob *lp = NULL;
    if (r->lp_on && from + n <= r->n_lp)
        lp = r->lp + from * (1 + (size_t)r->lp_top);
    struct gc_item *it = item_new(r->conn, toks, n, text, text_len, r->text != NULL, lp, r->lp_top);
    if (it) { /* without memory a piece is lost; the final result still carries all */
        it->choice = r->choice;
        push(gc, it);
    }
}

/* Choice r's result into ch (its own allocation). False without memory. */
static bool choice_fill(struct gc_choice *ch, const struct sched_req *r)
{
    size_t n_gen = r->n_toks > r->n_prompt ? r->n_toks - r->n_prompt : 0;
    const char *text = NULL;
    size_t text_len = 0;
    if (r->text && r->finish != SCHED_FINISH_ERROR)
        text = text_out_str(r->text, &text_len);
    bool lp = r->lp_on && r->n_lp == n_gen;
    size_t n_lp = lp ? n_gen * (1 + (size_t)r->lp_top) : 0;
    size_t bytes = n_lp * sizeof(struct sampler_logprob) + n_gen * sizeof(uint32_t) +
                   (text ? text_len + 1 : 0) + 1;
    char *mem = malloc(bytes);
    if (!mem)
        return false;
    ch->mem = mem;
    ch->finish = r->finish;
    ch->lp = lp ? (struct sampler_logprob *)mem : NULL; /* first: malloc's alignment */
    if (n_lp)
        memcpy(ch->lp, r->lp, n_lp * sizeof *ch->lp);
    ch->toks = (uint32_t *)(mem + n_lp * sizeof(struct sampler_logprob));
    if (n_gen)
        memcpy(ch->toks, r->toks + r->n_prompt, n_gen * sizeof(uint32_t));
    ch->n_toks = n_gen;
    if (text) {
        ch->text = (char *)(ch->toks + n_gen);
        if (text_len)
            memcpy(ch->text, text, text_len);
        ch->text[text_len] = '\0';
        ch->text_len = text_len;
    }
    return true;
}

void gen_clients_done_group(struct gen_clients *gc, const struct sched_req *const *rs, uint32_t n)
{
    const struct sched_req *r = rs[0];
    struct gc_item *it = calloc(1, sizeof *it);
    if (!it)
        return; /* nothing left: the client's request stays open until it goes */
    it->client = r->conn;
    it->done = true;
    it->finish = r->finish;
    it->lp_top = r->lp_top;
    it->prompt = r->n_prompt; /* once: the choices share it */
    it->cached = r->n_cached;
    if ((it->choices = calloc(n, sizeof *it->choices)))
        it->n_choices = n;
    else
        kvd_error_set(&it->err, KVD_ENOMEM, "out of memory building the reply");
    bool cancelled = false;
    for (uint32_t i = 0; i < n; i++) {
        const struct sched_req *c = rs[i];
        it->completion += c->n_toks > c->n_prompt ? c->n_toks - c->n_prompt : 0;
        if (c->finish == SCHED_FINISH_ERROR && !it->err.code) {
            it->err = c->err;
            if (!it->err.code)
                it->err.code = KVD_EINTERNAL;
        }
        cancelled |= c->finish == SCHED_FINISH_CANCELLED;
        if (it->choices && !choice_fill(&it->choices[i], c) && !it->err.code)
            kvd_error_set(&it->err, KVD_ENOMEM, "out of memory building the reply");
    }
    if (cancelled)
        it->finish = SCHED_FINISH_CANCELLED;
    if (r->session) {
        it->has_session = true;
        it->session = *r->session;
    }
    push(gc, it);
}

void gen_clients_done(struct gen_clients *gc, const struct sched_req *r)
{
    gen_clients_done_group(gc, &r, 1);
}

/* ---- the loop's side ------------------------------------------------------ */

uint64_t ops_generate_client_id(struct gen_clients *gc)
{
    return server_new_id(gc->srv);
}

int ops_generate_client_submit(struct gen_clients *gc, uint64_t client, struct models_entry *e,
                               const struct gen_args *args, uint32_t tenant,
                               const struct ops_generate_client *cb, struct kvd_error *err)
{
    if (args->has_seq) {
        grammar_free(args->compiled); /* taken over, as the build would */
        return kvd_error_set(err, KVD_EBADREQ, "'seq' is for msgpack connections");
    }
    struct exec *ex = models_exec(e);
    struct kvmm *mm = models_kvmm(e);
    if (!ex) {
        grammar_free(args->compiled);
        return kvd_error_set(err, KVD_EINTERNAL, "model %s is not loaded", models_name(e));
    }
    uint32_t ns;
    kvmm_lock(mm);
    int rc = kvmm_tenant_namespace(mm, tenant, &ns);
    if (rc)
        kvd_error_set(err, rc, "%s", kvmm_errmsg(mm));
    kvmm_unlock(mm);
    if (rc) {
        grammar_free(args->compiled);
        return rc;
    }
    models_touch(e);
    struct gen_caller caller = {
        .conn = client, .id = 1, .tenant = tenant, .ns = ns, .sink = &gc->sink};
    struct gen_limits lim = {.max_text_bytes = server_options(gc->srv)->max_text_bytes};
    struct sched_req *r = NULL;
    rc = gen_request_build(ex, mm, args, &caller, &lim, &r, err);
    if (rc)
        return rc;
    struct gc_client *c = calloc(1, sizeof(*c));
    if (!c) {
        gen_request_discard(mm, r);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    c->id = client;
    c->model = e;
    c->cb = *cb;
    struct gc_client **slot = find_slot(gc, client);
    c->next = *slot;
    *slot = c;
    if ((rc = exec_submit(ex, r)) != 0) {
        *find_slot(gc, client) = c->next;
        free(c);
        gen_request_discard(mm, r);
        return kvd_error_set(err, rc, "%s", exec_submit_errmsg(rc));
    }
    return 0;
}

void ops_generate_client_drop(struct gen_clients *gc, uint64_t client)
{
    models_cancel_owner(gc->ms, client);
    struct gc_client **slot = find_slot(gc, client);
    if (!*slot)
        return;
    struct gc_client *c = *slot;
    *slot = c->next;
    struct exec *ex = models_exec(c->model);
    free(c);
    if (ex)
        exec_cancel_conn(ex, client);
}

void ops_generate_client_abort(struct gen_clients *gc, uint64_t client, int code, const char *msg)
{
    struct gc_client *c = *find_slot(gc, client);
    struct exec *ex = c ? models_exec(c->model) : NULL;
    if (ex)
        exec_abort_conn(ex, client, code, msg);
}
