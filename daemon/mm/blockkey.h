/* blockkey: the one name of a full KV block, stable across processes,
 * restarts, machines and builds (docs/protocol.md "Block keys" has the
 * bytes and known-answer vectors):
 *
 *   chain(-1) = H("kvd-block" ‖ version ‖ model fingerprint ‖ dtype ‖ layers ‖
 *                 kv_heads ‖ head_dim ‖ block_tokens)
 *   chain(b)  = H(chain(b-1) ‖ token ids of block b)
 *   key(b)    = (namespace hash, chain(b))
 *
 * H is XXH3-128 (libxxhash), every integer little-endian. The radix tree
 * stays the index in memory (with its own secret-keyed hash, which clients
 * cannot aim at); the key is how a block is found where there is no tree:
 * the disk tier's index. Two blocks with equal keys are only a hint: every
 * restore also compares the stored tokens and checksum. */
#ifndef KVD_BLOCKKEY_H
#define KVD_BLOCKKEY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_types.h"

#define BLOCKKEY_VERSION 1u

struct blockkey {
    uint64_t lo, hi;
};

/* chain(-1) of a model (fp: its 16-byte fingerprint, model_fingerprint;
 * store mode passes zeros) and KV geometry. */
struct blockkey blockkey_root(const uint8_t fp[16], const struct kv_geom *g);
/* chain(b) from chain(b-1) and the block's n token ids. */
struct blockkey blockkey_next(struct blockkey parent, const uint32_t *tokens, size_t n);
/* The namespace's part of a key: XXH3-64 of its name. */
uint64_t blockkey_ns(const char *name);

/* The published block hash (KV events, docs/protocol.md "Block hashes"):
 * the one llm-d's KV-cache indexer computes from prompt tokens (its
 * ChunkedTokenDatabase, vLLM's sha256_cbor 64-bit hash):
 *
 *   root     = low64(SHA-256(CBOR(seed)))          seed a text string
 *   hash(b)  = low64(SHA-256(CBOR([parent, [t0, .., tn-1], null])))
 *
 * with parent = hash(b-1) (root for the first block), CBOR canonical
 * (shortest integer heads) and low64 the digest's last 8 bytes read
 * big-endian. Nothing of the model, tenant or namespace enters it: a router
 * computes it from the tokens alone. */
uint64_t blockkey_pub_root(const char *seed);
uint64_t blockkey_pub_next(uint64_t parent, const uint32_t *tokens, size_t n);

static inline bool blockkey_eq(struct blockkey a, struct blockkey b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

#endif
