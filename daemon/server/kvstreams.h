/* kvstreams: the daemon's KV events streams, one per model (docs/operations.md
 * "KV events for routers"), as a fleet runs vLLM: one engine serves one
 * model and publishes one stream with its own sequence numbers, replay
 * socket and topic. Each model's stream is a kvevents publisher
 * (obs/kvevents.h) attached to that model's kvmm; its settings are the
 * model's `[model:NAME] kv-events*` keys, the [server] ones being the first
 * model's (and store mode's one pool's), and "{model}" in a topic is the
 * model's name (llm-d's "kv@POD@{model}"). */
#ifndef KVD_KVSTREAMS_H
#define KVD_KVSTREAMS_H

#include <stddef.h>

#include "kvd/status.h"
#include "kvmm.h"
#include "options.h"

struct models;
struct kvevents;
struct kvstreams;

/* Starts every configured stream (none configured: *out stays NULL, 0) and
 * attaches each to its model's kvmm (ms; NULL in store mode, then
 * store_mm). KVD_EBADREQ with the model and key named for a bad or
 * conflicting setting (a replay or topic without an endpoint, one endpoint
 * for two streams, {model} in store mode); what kvevents_start refuses. */
int kvstreams_start(const struct options *o, struct models *ms, struct kvmm *store_mm,
                    struct kvstreams **out, struct kvd_error *e);
/* Model i's publisher (store mode: i = 0), NULL when it has no stream;
 * *n = the slots (the models). s may be NULL (no stream). */
struct kvevents *const *kvstreams_v(const struct kvstreams *s, size_t *n);
/* Detaches every stream from its kvmm, sends what is queued and stops. */
void kvstreams_stop(struct kvstreams *s);

/* The topic of a stream: tmpl with every "{model}" replaced by model.
 * KVD_EBADREQ when the result passes 255 bytes. */
int kvstreams_topic(const char *tmpl, const char *model, char *out, size_t cap);

#endif
