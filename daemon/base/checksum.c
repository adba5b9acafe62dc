/* checksum: the block checksum of the host tier (see checksum.h). A 4-lane
 * multiply-rotate accumulator in the style of xxHash64, written for kvd:
 * each lane sees every fourth 8-byte word, lanes merge at the end, and a
 * final avalanche spreads every input bit over the result. */
#include "checksum.h"

#include <string.h>

#define CK_P1 0x9E3779B185EBCA87ull
#define CK_P2 0xC2B2AE3D27D4EB4Full
#define CK_P3 0x165667B19E3779F9ull
#define CK_P4 0x85EBCA77C2B2AE63ull
#define CK_P5 0x27D4EB2F165667C5ull

static inline uint64_t ck_rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

/* memcpy keeps unaligned loads defined; compilers turn it into one load. */
static inline uint64_t ck_load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint64_t ck_round(uint64_t acc, uint64_t w)
{
    acc += w * CK_P2;
    acc = ck_rotl(acc, 31);
    return acc * CK_P1;
}

static inline uint64_t ck_merge(uint64_t h, uint64_t lane)
{
    h ^= ck_round(0, lane);
    return h * CK_P1 + CK_P4;
}

uint64_t checksum64(const void *data, size_t len, uint64_t seed)
{
    const unsigned char *p = data, *end = p + len;
    uint64_t h;

    if (len >= 32) {
        uint64_t a = seed + CK_P1 + CK_P2, b = seed + CK_P2, c = seed, d = seed - CK_P1;
        const unsigned char *limit = end - 32;
        do {
            a = ck_round(a, ck_load64(p));
            b = ck_round(b, ck_load64(p + 8));
            c = ck_round(c, ck_load64(p + 16));
            d = ck_round(d, ck_load64(p + 24));
            p += 32;
        } while (p <= limit);
        h = ck_rotl(a, 1) + ck_rotl(b, 7) + ck_rotl(c, 12) + ck_rotl(d, 18);
        h = ck_merge(h, a);
        h = ck_merge(h, b);
        h = ck_merge(h, c);
        h = ck_merge(h, d);
    } else {
        h = seed + CK_P5;
    }
    h += (uint64_t)len;
    for (; p + 8 <= end; p += 8) {
        h ^= ck_round(0, ck_load64(p));
        h = ck_rotl(h, 27) * CK_P1 + CK_P4;
    }
    for (; p < end; p++) {
        h ^= (uint64_t)*p * CK_P5;
        h = ck_rotl(h, 11) * CK_P1;
    }
    h ^= h >> 33;
    h *= CK_P2;
    h ^= h >> 29;
    h *= CK_P3;
    h ^= h >> 32;
    return h;
}
