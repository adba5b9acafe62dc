/* kvevents: KV cache events over ZeroMQ in vLLM's wire format, so a
 * prefix-aware router (llm-d's KV-cache indexer, Dynamo's ZMQ relay)
 * follows kvd unchanged (docs/protocol.md "KV events").
 *
 * kvmm reports block lifecycle through the sink (kvmm.h "KV events"),
 * under its lock, on whatever thread: the sink copies each event into a
 * bounded queue (full: dropped and counted) and wakes the publisher
 * thread, which owns every socket. The thread batches what is queued
 * (a batch goes out when it holds max_batch events or flush_ms after its
 * first event), encodes it, sends it on an XPUB socket as
 * [topic, 8-byte big-endian sequence number, msgpack payload] and keeps
 * the last `buffer` batches for the replay ROUTER socket, which answers
 * [8-byte start sequence number] with every kept batch from it on, then
 * [-1, ""] (vLLM's ZmqEventPublisher replay). */
#ifndef KVD_KVEVENTS_H
#define KVD_KVEVENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "kvd/status.h"
#include "kvmm.h"

struct kvevents_conf {
    const char *endpoint; /* tcp://HOST:PORT or ipc://PATH: the PUB side (bound, or connect) */
    const char *replay;   /* the same forms, or NULL/"": no replay socket */
    const char *topic;    /* the first frame of every message; NULL: "" */
    bool connect;         /* the PUB side connects to endpoint (a router's bound SUB) */
    uint32_t block_tokens;
    uint32_t buffer;    /* batches kept for replay; 0: 10000 */
    uint32_t hwm;       /* ZMQ send high-water mark per subscriber; 0: 100000 */
    uint32_t sndbuf;    /* kernel send buffer per subscriber (ZMQ_SNDBUF); 0: the system's */
    uint32_t queue;     /* events the queue holds before dropping; 0: 65536 */
    uint32_t flush_ms;  /* most a queued event waits; 0: 5 */
    uint32_t max_batch; /* events per batch at most; 0: 1024 */
};

struct kvevents_stats {
    bool on;
    uint64_t batches;         /* sent (sequence numbers used) */
    uint64_t events;          /* events in them, after merging runs of blocks */
    uint64_t blocks;          /* block reports in them */
    uint64_t dropped;         /* block reports lost to a full queue */
    uint64_t hwm_drops;       /* batches some subscriber missed at its high-water mark */
    uint64_t subscribers;     /* live subscriptions on the PUB socket */
    uint64_t replay_requests; /* answered */
    uint64_t replay_batches;  /* batches sent by replays */
    uint64_t replay_bad;      /* malformed requests ignored */
    uint64_t queued;          /* block reports waiting now */
    uint64_t next_seq;        /* the next batch's sequence number */
};

struct kvevents;

/* Binds (or connects) the PUB socket, binds the replay socket and starts
 * the publisher thread; the first batch (sequence 0) is AllBlocksCleared.
 * KVD_EBADREQ for a bad endpoint (the message says which and why),
 * KVD_EINTERNAL when ZeroMQ cannot bind or connect. */
int kvevents_start(const struct kvevents_conf *c, struct kvevents **out, struct kvd_error *e);
/* Sends what is queued (waiting at most ~1 s for the thread), stops the
 * thread and closes the sockets. Detach the sink from kvmm first. */
void kvevents_stop(struct kvevents *ev);
/* The sink to attach to kvmm (kvmm_events_attach); valid until stop. */
const struct kvmm_events_sink *kvevents_sink(struct kvevents *ev);
void kvevents_stats(struct kvevents *ev, struct kvevents_stats *st);

/* The encoder, for the tests. One queued report: */
enum kvevents_kind { KVEVENTS_STORED, KVEVENTS_REMOVED, KVEVENTS_CLEARED };
struct kvevents_item {
    enum kvevents_kind kind;
    enum kvmm_medium medium;
    bool has_parent;
    uint64_t hash, parent;
    const uint32_t *tokens; /* stored: n_tokens ids; NULL: withheld (empty list) */
    uint32_t n_tokens;
};
/* Packs [ts, [event, ...], 0] into out: consecutive stored blocks of one
 * medium where each one's parent is the one before (and all with or all
 * without tokens) become one BlockStored, consecutive removals of one
 * medium one BlockRemoved. *n_events = events written. */
int kvevents_encode(const struct kvevents_item *items, size_t n, double ts, uint32_t block_size,
                    msgpack_sbuffer *out, size_t *n_events);

#endif
