/* kv_events_sub: a KV events subscriber for the tests, written with libzmq
 * and msgpack-c's unpacker (nothing of the daemon's encoder): it receives
 * [topic, seq, payload] batches, asks the replay socket for the ones it
 * missed, decodes each payload checking every field as vLLM's format has
 * it, recomputes each block hash from its parent and token ids (SHA-256
 * over CBOR written here) and keeps the blocks the events leave stored per
 * medium. */
#ifndef KVD_TEST_KV_EVENTS_SUB_H
#define KVD_TEST_KV_EVENTS_SUB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd_harness.h"

#define KVS_BT 16 /* the daemons' block_tokens */
#define KVS_MAX_SEQ 4096
#define KVS_MAX_BLOCKS 8192

struct kvs_batch {
    uint64_t seq;
    unsigned char *buf; /* NULL: not received */
    size_t len;
};

/* What the events say is stored, per medium (GPU, CPU, DISK, REMOTE). */
struct kvs_view {
    uint64_t h[4][KVS_MAX_BLOCKS];
    size_t n[4];
    size_t cleared;                    /* AllBlocksCleared seen */
    uint64_t seen[KVS_MAX_BLOCKS * 4]; /* every hash ever stored with token ids */
    size_t n_seen;
    uint64_t bare[KVS_MAX_BLOCKS * 4]; /* every hash ever stored without (events = hashes) */
    size_t n_bare;
};

/* The published hashes with seed "" (docs/protocol.md "Block hashes"). */
uint64_t kvs_root_hash(void);
uint64_t kvs_block_hash(uint64_t parent, const uint32_t *tokens);

/* Decodes one payload, checking every field's type, and applies it. */
void kvs_apply(struct kvs_view *v, const unsigned char *buf, size_t len);
/* Receives one [topic, seq, payload] within ms (topic checked); false on
 * timeout. */
bool kvs_recv(void *sub, const char *topic, int ms, struct kvs_batch *out);
/* A replay from start on the ROUTER endpoint ep through a DEALER socket:
 * the batches into out (indexed by seq; NULL: counted only), checked in
 * order without gaps; returns how many came before the end marker. */
size_t kvs_replay(void *zctx, const char *ep, uint64_t start, struct kvs_batch *out,
                  uint64_t *first, uint64_t *last);
/* Receives live batches until every seq below until is in have[]. */
void kvs_collect(void *sub, const char *topic, struct kvs_batch *have, uint64_t until);
/* stats kv_events[key] of model (NULL: the first). */
uint64_t kvs_ev_stat(const struct kh_proc *d, const char *model, const char *key);
/* Waits until the stream of model has sent everything queued; its next_seq. */
uint64_t kvs_settle(const struct kh_proc *d, const char *model);
void kvs_free_batches(struct kvs_batch *b); /* (KVS_MAX_SEQ) */

/* A subscriber that follows one model's stream: the batches it has (live or
 * by replay), what they leave stored, and the REMOTE BlockRemoved hashes in
 * the order they came. */
struct kvs_stream {
    void *zctx, *sub;
    char ev[160], replay[160], topic[64];
    char model[64]; /* "": the daemon's first model */
    struct kvs_batch *have;
    struct kvs_view *v;
    uint64_t applied;
    uint64_t removed[KVS_MAX_BLOCKS];
    size_t n_removed;
};
/* Subscribes to s->ev (s->zctx, ev, replay, topic and model set before) and
 * waits until d's stream counts the subscriber. */
void kvs_stream_open(struct kvs_stream *s, const struct kh_proc *d);
/* Applies in order everything d's stream has sent until now, live or (what
 * came before the subscription) by replay; fails on a dropped batch. */
void kvs_stream_catch_up(struct kvs_stream *s, const struct kh_proc *d);
/* Closes the socket and frees the batches (safe on a stream never opened). */
void kvs_stream_close(struct kvs_stream *s);

#endif
