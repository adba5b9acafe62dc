/* blockkey: XXH3-128 chains over little-endian bytes (blockkey.h). */
#include "blockkey.h"

#include <sodium.h>
#include <string.h>
#include <xxhash.h>

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static struct blockkey from_xxh(XXH128_hash_t h)
{
    return (struct blockkey){h.low64, h.high64};
}

struct blockkey blockkey_root(const uint8_t fp[16], const struct kv_geom *g)
{
    unsigned char b[9 + 4 + 16 + 5 * 4];
    memcpy(b, "kvd-block", 9);
    put32(b + 9, BLOCKKEY_VERSION);
    memcpy(b + 13, fp, 16);
    put32(b + 29, (uint32_t)g->dtype);
    put32(b + 33, g->layers);
    put32(b + 37, g->kv_heads);
    put32(b + 41, g->head_dim);
    put32(b + 45, g->block_tokens);
    return from_xxh(XXH3_128bits(b, sizeof b));
}

struct blockkey blockkey_next(struct blockkey parent, const uint32_t *tokens, size_t n)
{
    unsigned char b[16 + 4 * 4096];
    if (n > 4096) /* block_tokens is at most 4096 (kvmm_new) */
        n = 4096;
    put64(b, parent.lo);
    put64(b + 8, parent.hi);
    for (size_t i = 0; i < n; i++)
        put32(b + 16 + 4 * i, tokens[i]);
    return from_xxh(XXH3_128bits(b, 16 + 4 * n));
}

uint64_t blockkey_ns(const char *name)
{
    return XXH3_64bits(name, strlen(name));
}

/* A CBOR head (major type, argument) in its shortest form. */
static size_t cbor_head(unsigned char *p, unsigned major, uint64_t v)
{
    unsigned char m = (unsigned char)(major << 5);
    if (v < 24) {
        p[0] = (unsigned char)(m | v);
        return 1;
    }
    int n = v <= 0xff ? 1 : v <= 0xffff ? 2 : v <= 0xffffffffu ? 4 : 8;
    p[0] = (unsigned char)(m | (n == 1 ? 24 : n == 2 ? 25 : n == 4 ? 26 : 27));
    for (int i = 0; i < n; i++)
        p[1 + i] = (unsigned char)(v >> (8 * (n - 1 - i)));
    return 1 + (size_t)n;
}

static uint64_t low64_sha256(const unsigned char *b, size_t n)
{
    unsigned char d[crypto_hash_sha256_BYTES];
    uint64_t v = 0;
    crypto_hash_sha256(d, b, n);
    for (int i = 24; i < 32; i++)
        v = (v << 8) | d[i];
    return v;
}

uint64_t blockkey_pub_root(const char *seed)
{
    size_t n = seed ? strlen(seed) : 0;
    unsigned char head[9];
    size_t h = cbor_head(head, 3, n);
    crypto_hash_sha256_state st;
    unsigned char d[crypto_hash_sha256_BYTES];
    uint64_t v = 0;

    crypto_hash_sha256_init(&st);
    crypto_hash_sha256_update(&st, head, h);
    if (n)
        crypto_hash_sha256_update(&st, (const unsigned char *)seed, n);
    crypto_hash_sha256_final(&st, d);
    for (int i = 24; i < 32; i++)
        v = (v << 8) | d[i];
    return v;
}

uint64_t blockkey_pub_next(uint64_t parent, const uint32_t *tokens, size_t n)
{
    /* [parent, [tokens...], null]: 1 + 9 + 9 + 5 per token + 1 bytes at most. */
    unsigned char b[1 + 9 + 9 + 5 * 4096 + 1];
    size_t at = 0;
    if (n > 4096) /* block_tokens is at most 4096 (kvmm_new) */
        n = 4096;
    at += cbor_head(b + at, 4, 3);
    at += cbor_head(b + at, 0, parent);
    at += cbor_head(b + at, 4, n);
    for (size_t i = 0; i < n; i++)
        at += cbor_head(b + at, 0, tokens[i]);
    b[at++] = 0xf6; /* null: no extra keys */
    return low64_sha256(b, at);
}
