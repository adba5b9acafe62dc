/* fuzz_remote: libFuzzer target for the remote tier's value decoder
 * (remote_value.h), which reads what Redis returns. The first input byte
 * picks the reader's mode (bit 0: with the fixed fleet key below, else
 * remote-insecure) and which prompt block the value is asked for (bits 1-3);
 * the rest is the value. remote_value_open must refuse it or give a view
 * that lies inside the input with exactly the lengths its meta says, and
 * remote_value_check may accept it only when its tokens are the prompt's.
 * The seeds are genuine values of both modes (FUZZ_REMOTE_SEED_MAIN writes
 * them). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blockkey.h"
#include "fuzz_env.h"
#include "remote_value.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define BT 4u
#define BB 32u
#define NB 8u
#define NS "tenant:fuzz"

static uint32_t tokens[NB * BT];
static struct blockkey root, chain[NB];
static struct remote_fleet_key fleet;

static void init(void)
{
    root = (struct blockkey){0xabc, 0xdef};
    struct blockkey p = root;
    for (uint32_t i = 0; i < NB * BT; i++)
        tokens[i] = i * 7 + 3;
    for (uint32_t b = 0; b < NB; b++)
        p = chain[b] = blockkey_next(p, tokens + b * BT, BT);
    fleet.secure = true;
    for (int i = 0; i < REMOTE_FLEET_KEY_BYTES; i++)
        fleet.k[i] = (uint8_t)(0xa5 ^ i);
}

static struct remote_value_meta want_of(uint32_t first, uint32_t end)
{
    struct remote_value_meta m = {.block_tokens = BT, .block_bytes = BB, .first = first};
    m.n = end - first + 1;
    m.parent = first ? chain[first - 1] : root;
    m.last = chain[end];
    snprintf(m.ns_name, sizeof m.ns_name, "%s", NS);
    m.ns_hash = blockkey_ns(NS);
    return m;
}

#ifdef FUZZ_REMOTE_SEED_MAIN
/* Writes a genuine value (blocks first..end, mode) to path, with its mode byte. */
static int seed(const char *path, int secure, uint32_t first, uint32_t end)
{
    struct remote_value_meta m = want_of(first, end);
    size_t len = remote_value_size(&m);
    unsigned char *buf = malloc(len);
    uint32_t *t;
    void *d;
    remote_value_layout(&m, buf, &t, &d);
    memcpy(t, tokens + first * BT, sizeof(uint32_t) * BT * m.n);
    memset(d, 0x5a, (size_t)BB * m.n);
    uint8_t key[REMOTE_KEY_BYTES];
    remote_value_key(m.ns_hash, m.last, key);
    struct remote_fleet_key k = fleet;
    k.secure = secure;
    if (remote_value_seal(&k, key, buf, len) != 0)
        return 1;
    FILE *f = fopen(path, "wb");
    if (!f)
        return 1;
    fputc((int)((end << 1) | (unsigned)secure), f);
    fwrite(buf, 1, len, f);
    free(buf);
    return fclose(f) != 0;
}

int main(int argc, char **argv)
{
    init();
    if (argc < 2)
        return 1;
    char p[512];
    snprintf(p, sizeof p, "%s/genuine_secure", argv[1]);
    int rc = seed(p, 1, 0, 3);
    snprintf(p, sizeof p, "%s/genuine_plain", argv[1]);
    rc |= seed(p, 0, 4, 6);
    return rc;
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!root.lo)
        init();
    if (size < 1)
        return 0;
    struct remote_fleet_key k = fleet;
    k.secure = data[0] & 1;
    uint32_t end = (data[0] >> 1) & 7;
    size_t len = size - 1;
    unsigned char *buf = malloc(len ? len : 1);
    FUZZ_ASSERT(buf != NULL);
    if (len)
        memcpy(buf, data + 1, len);
    struct remote_value_meta want = want_of(0, end);
    uint8_t key[REMOTE_KEY_BYTES];
    remote_value_key(want.ns_hash, want.last, key);
    struct remote_value_view v;
    enum remote_value_status st = remote_value_open(&k, key, buf, len, &v);
    FUZZ_ASSERT(st == REMOTE_VALUE_OK || st == REMOTE_VALUE_MALFORMED || st == REMOTE_VALUE_AUTH);
    if (st == REMOTE_VALUE_OK) {
        const unsigned char *lo = buf, *hi = buf + len;
        const unsigned char *t = v.tokens, *d = v.data;
        size_t tb = (size_t)v.m.n * v.m.block_tokens * 4, db = (size_t)v.m.n * v.m.block_bytes;
        FUZZ_ASSERT(v.m.n > 0 && t >= lo && t + tb == d && d + db == hi);
        FUZZ_ASSERT(strlen(v.m.ns_name) <= REMOTE_NS_NAME_MAX);
        st = remote_value_check(&v, &want, end, tokens, chain, root);
        FUZZ_ASSERT(st == REMOTE_VALUE_OK || st == REMOTE_VALUE_MISMATCH);
        if (st == REMOTE_VALUE_OK) {
            FUZZ_ASSERT(v.m.first <= end && v.m.first + v.m.n - 1 == end);
            FUZZ_ASSERT(memcmp(t, tokens + (size_t)v.m.first * BT, tb) == 0);
            FUZZ_ASSERT(blockkey_eq(v.m.last, chain[end]));
        }
    }
    free(buf);
    return 0;
}
