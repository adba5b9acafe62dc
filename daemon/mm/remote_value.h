/* remote_value: the bytes of one value of the remote tier (docs/persistence.md
 * "Remote tier"). A value holds n consecutive whole blocks of one chain, the
 * last of which names it:
 *
 *   Redis key  = "kvd1:" ‖ u64 namespace hash ‖ u64 chain.lo ‖ u64 chain.hi   (29 bytes)
 *   value      = "KVR1" ‖ u8 mode ‖ 3 zero bytes ‖ nonce[24] ‖ tag[16] ‖ body
 *   body       = u32 version=1 ‖ u32 block_tokens ‖ u64 block_bytes ‖ u32 first ‖ u32 n ‖
 *                parent chain key[16] ‖ last chain key[16] ‖ u64 ns hash ‖
 *                u32 ns name length ‖ ns name ‖ zeros to a multiple of 4 ‖
 *                token ids[n × block_tokens] ‖ K/V[n × block_bytes]
 *
 * (integers little-endian; first: the chain index of the first block; parent:
 * chain(first-1)). Mode 1 (a fleet key): body is encrypted with
 * XChaCha20-Poly1305-IETF (libsodium's crypto_aead_xchacha20poly1305_ietf,
 * computed with OpenSSL's ChaCha20-Poly1305; a random nonce per value); the associated
 * data is the Redis key and the value's first 8 bytes, so a value copied
 * under another key, changed in any byte or sealed with another fleet key
 * fails to open. Mode 0 (remote-insecure): the body is plain and tag is
 * XXH3-128 of that associated data ‖ body, a check against accidents only:
 * whoever can write Redis can forge it.
 *
 * Nothing here trusts a value: remote_value_open checks every length before
 * it reads, and remote_value_check compares what it holds with what the
 * reader expects. */
#ifndef KVD_REMOTE_VALUE_H
#define KVD_REMOTE_VALUE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blockkey.h"
#include "kvd/status.h"

#define REMOTE_KEY_BYTES 29 /* "kvd1:" + ns hash + chain key */
#define REMOTE_FLEET_KEY_BYTES 32
#define REMOTE_VALUE_HEAD 48 /* magic, mode, pad, nonce, tag */
#define REMOTE_NS_NAME_MAX 79

struct remote_fleet_key {
    bool secure; /* false: remote-insecure (checksums only) */
    uint8_t k[REMOTE_FLEET_KEY_BYTES];
};

/* What a value holds (sealing: filled by the writer; opening: read from it). */
struct remote_value_meta {
    uint32_t block_tokens;
    uint64_t block_bytes;
    uint32_t first, n;            /* chain index of the first block, blocks */
    struct blockkey parent, last; /* chain(first-1), chain(first+n-1) */
    uint64_t ns_hash;             /* blockkey_ns(ns_name) */
    char ns_name[REMOTE_NS_NAME_MAX + 1];
};

/* An opened value: its meta, and pointers into the caller's buffer. */
struct remote_value_view {
    struct remote_value_meta m;
    const void *tokens; /* n × block_tokens u32, little-endian, maybe unaligned */
    const void *data;   /* n × block_bytes */
};

enum remote_value_status {
    REMOTE_VALUE_OK = 0,
    REMOTE_VALUE_MALFORMED, /* too short, bad magic, mode, lengths, version */
    REMOTE_VALUE_AUTH,      /* failed authentication (or its checksum, insecure) */
    REMOTE_VALUE_MISMATCH,  /* authentic, but not what the reader asked for */
};

/* Reads the fleet key: exactly 64 hex digits, optionally one newline; the
 * file must be a regular file not readable or writable by group or others.
 * 0 or KVD_EBADREQ with a message naming the file. */
int remote_fleet_key_load(const char *path, struct remote_fleet_key *k, struct kvd_error *e);
/* Parses 64 hex digits (+ optional newline) of len bytes. */
int remote_fleet_key_parse(const char *text, size_t len, struct remote_fleet_key *k,
                           struct kvd_error *e);

/* The Redis key of the value whose last block has chain key `last` in the
 * namespace with hash ns_hash. */
void remote_value_key(uint64_t ns_hash, struct blockkey last, uint8_t out[REMOTE_KEY_BYTES]);

/* Bytes of a sealed value with this meta (0 when the meta is out of range). */
size_t remote_value_size(const struct remote_value_meta *m);
/* Lays out a value in buf (remote_value_size(m) bytes) and gives where the
 * writer puts the blocks' token ids and K/V bytes; then remote_value_seal
 * seals it in place. */
void remote_value_layout(const struct remote_value_meta *m, void *buf, uint32_t **tokens,
                         void **data);
/* Seals buf (laid out by remote_value_layout and filled) under the fleet
 * key with key (the Redis key) as associated data. 0, or -1 when the random
 * source or the cipher fails. */
int remote_value_seal(const struct remote_fleet_key *k, const uint8_t key[REMOTE_KEY_BYTES],
                      void *buf, size_t len);
/* Authenticates and decrypts buf (len bytes, from Redis) in place and parses
 * it into *v (pointing into buf). */
enum remote_value_status remote_value_open(const struct remote_fleet_key *k,
                                           const uint8_t key[REMOTE_KEY_BYTES], void *buf,
                                           size_t len, struct remote_value_view *v);
/* Whether an opened value is the one a reader of a prompt expects under
 * the key of the prompt's block `end`: block_tokens, block_bytes, ns_hash and
 * ns_name equal want's; it ends at block end (first + n - 1 == end); its
 * last key is chain[end] and its parent chain[first - 1] (root for first 0);
 * its token ids equal the prompt's, tokens[first × block_tokens ...]. chain
 * and tokens hold at least end + 1 blocks. MISMATCH otherwise. */
enum remote_value_status remote_value_check(const struct remote_value_view *v,
                                            const struct remote_value_meta *want, uint32_t end,
                                            const uint32_t *tokens, const struct blockkey *chain,
                                            struct blockkey root);

#endif
