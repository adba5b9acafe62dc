/* blockkey: XXH3-128 chains over little-endian bytes (blockkey.h). */
#include "blockkey.h"

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
