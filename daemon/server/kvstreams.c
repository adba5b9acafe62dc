/* kvstreams: one KV events stream per model (kvstreams.h). */
#include "kvstreams.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blockkey.h"
#include "kvevents.h"
#include "log.h"
#include "models.h"

struct kvstreams {
    size_t n;
    struct kvevents **ev; /* (n) model i's, or NULL */
    struct kvmm **mm;     /* (n) what each is attached to */
};

int kvstreams_topic(const char *tmpl, const char *model, char *out, size_t cap)
{
    static const char key[] = "{model}";
    size_t o = 0, kl = sizeof key - 1, ml = strlen(model);
    for (const char *p = tmpl; *p;) {
        const char *s = strncmp(p, key, kl) ? NULL : model;
        size_t l = s ? ml : 1;
        if (o + l >= cap || o + l > 255)
            return KVD_EBADREQ;
        memcpy(out + o, s ? s : p, l);
        o += l;
        p += s ? kl : 1;
    }
    out[o] = '\0';
    return 0;
}

/* One stream's settings, resolved. */
struct stream_conf {
    const char *name; /* the model's ("" in store mode) */
    const char *ep, *replay;
    char topic[256];
};

/* Stream i's settings: its model's keys, the [server] ones for the first
 * model (which may not have both), and in connect mode the [server]
 * endpoint for every model without its own (each stream connects to the
 * router's one bound SUB socket, told apart by topic). ep "" : none. */
static int resolve(const struct options *o, const struct options_model *m, size_t i,
                   struct stream_conf *sc, struct kvd_error *e)
{
    const char *name = m ? m->name : "";
    bool own = m && m->kv_events[0];
    if (m && i == 0 && own && o->kv_events[0] && !o->kv_events_connect)
        return kvd_error_set(e, KVD_EBADREQ,
                             "kv-events: [server] kv-events is the first model's (%s) stream, and "
                             "[model:%s] kv-events sets one too: keep one",
                             name, name);
    sc->name = name;
    sc->ep = own ? m->kv_events : (i == 0 || o->kv_events_connect) ? o->kv_events : "";
    sc->replay = m && m->kv_events_replay[0] ? m->kv_events_replay
                 : i == 0 && !own            ? o->kv_events_replay
                                             : "";
    if (m && !sc->ep[0] && (m->kv_events_replay[0] || m->kv_events_topic_set))
        return kvd_error_set(e, KVD_EBADREQ,
                             "[model:%s] kv-events-%s needs kv-events (the stream's endpoint)",
                             name, m->kv_events_replay[0] ? "replay" : "topic");
    const char *tmpl = m && m->kv_events_topic_set ? m->kv_events_topic : o->kv_events_topic;
    if (!m && strstr(tmpl, "{model}"))
        return kvd_error_set(e, KVD_EBADREQ,
                             "kv-events-topic '%s': {model} names the model, and store mode "
                             "serves none",
                             tmpl);
    if (kvstreams_topic(tmpl, name, sc->topic, sizeof sc->topic))
        return kvd_error_set(e, KVD_EBADREQ, "kv-events-topic of model %s: longer than 255 bytes",
                             name);
    return 0;
}

/* The [model:NAME] keys of the model named name; the plain --model has
 * none (plain: an empty set with its name). */
static const struct options_model *model_keys(const struct options *o, const char *name,
                                              struct options_model *plain)
{
    for (uint32_t i = 0; i < o->n_models; i++)
        if (!strcmp(o->models[i].name, name))
            return &o->models[i];
    memset(plain, 0, sizeof *plain);
    snprintf(plain->name, sizeof plain->name, "%s", name);
    return plain;
}

void kvstreams_stop(struct kvstreams *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n; i++) {
        if (!s->ev[i])
            continue;
        /* Nothing reports any more; what is queued still goes out. */
        kvmm_lock(s->mm[i]);
        kvmm_events_attach(s->mm[i], NULL, 0);
        kvmm_unlock(s->mm[i]);
        kvevents_stop(s->ev[i]);
    }
    free(s->ev);
    free(s->mm);
    free(s);
}

int kvstreams_start(const struct options *o, struct models *ms, struct kvmm *store_mm,
                    struct kvstreams **out, struct kvd_error *e)
{
    size_t n = ms ? models_count(ms) : 1;
    struct stream_conf *sc = calloc(n, sizeof *sc);
    struct kvstreams *s = calloc(1, sizeof *s);
    int rc = 0;
    size_t on = 0;
    struct options_model plain; /* the plain --model's: no keys of its own */
    *out = NULL;
    if (s) {
        s->ev = calloc(n, sizeof *s->ev);
        s->mm = calloc(n, sizeof *s->mm);
    }
    if (!sc || !s || !s->ev || !s->mm) {
        free(sc);
        kvstreams_stop(s);
        return kvd_error_set(e, KVD_ENOMEM, "kv events: out of memory");
    }
    s->n = n;
    if (o->kv_events_replay[0] && !o->kv_events[0])
        rc = kvd_error_set(e, KVD_EBADREQ, "--kv-events-replay needs --kv-events");
    for (size_t i = 0; i < n && !rc; i++) {
        struct models_entry *me = ms ? models_at(ms, i) : NULL;
        const struct options_model *m = me ? model_keys(o, models_name(me), &plain) : NULL;
        s->mm[i] = me ? models_kvmm(me) : store_mm;
        if ((rc = resolve(o, m, i, &sc[i], e)))
            break;
        sc[i].name = me ? models_name(me) : ""; /* plain's is on the stack */
        on += sc[i].ep[0] != '\0';
        /* A bound endpoint serves one stream; a replay socket is always
         * bound. */
        for (size_t j = 0; j < i && !rc; j++) {
            const char *a[2] = {sc[i].ep, sc[i].replay}, *b[2] = {sc[j].ep, sc[j].replay};
            for (int x = 0; x < 2 && !rc; x++)
                for (int y = 0; y < 2 && !rc; y++) {
                    if (!a[x][0] || strcmp(a[x], b[y]) ||
                        (x == 0 && y == 0 && o->kv_events_connect))
                        continue;
                    rc = kvd_error_set(e, KVD_EBADREQ,
                                       "kv-events: %s is the %s endpoint of model %s's stream and "
                                       "the %s endpoint of model %s's: each stream binds its own",
                                       a[x], x ? "replay" : "events", sc[i].name,
                                       y ? "replay" : "events", sc[j].name);
                }
        }
    }
    for (size_t i = 0; i < n && !rc; i++) {
        if (!sc[i].ep[0])
            continue;
        struct kvevents_conf ec = {.endpoint = sc[i].ep,
                                   .replay = sc[i].replay,
                                   .topic = sc[i].topic,
                                   .connect = o->kv_events_connect,
                                   .block_tokens = kvmm_geom(s->mm[i])->block_tokens,
                                   .buffer = o->kv_events_buffer,
                                   .hwm = o->kv_events_hwm,
                                   .sndbuf = o->kv_events_sndbuf};
        if ((rc = kvevents_start(&ec, &s->ev[i], e))) {
            if (ms && n > 1) {
                struct kvd_error inner = *e;
                kvd_error_set(e, rc, "model %s: %s", sc[i].name, inner.message);
            }
            break;
        }
        kvmm_lock(s->mm[i]);
        kvmm_events_attach(s->mm[i], kvevents_sink(s->ev[i]),
                           blockkey_pub_root(o->kv_events_hash_seed));
        kvmm_unlock(s->mm[i]);
        log_info("kv events%s%s: %s %s%s%s, topic '%s' (replay buffer %u batches)",
                 ms ? " of model " : "", sc[i].name, o->kv_events_connect ? "connected to" : "on",
                 sc[i].ep, sc[i].replay[0] ? ", replay on " : "", sc[i].replay, sc[i].topic,
                 o->kv_events_buffer);
    }
    if (!rc && on && ms)
        for (size_t i = 0; i < n; i++)
            if (!sc[i].ep[0])
                log_warn("model %s has no KV events stream: its blocks are not published "
                         "([model:%s] kv-events = ENDPOINT gives it one)",
                         sc[i].name, sc[i].name);
    free(sc);
    if (rc || !on) {
        kvstreams_stop(s);
        return rc;
    }
    *out = s;
    return 0;
}

struct kvevents *const *kvstreams_v(const struct kvstreams *s, size_t *n)
{
    *n = s ? s->n : 0;
    return s ? s->ev : NULL;
}
