/* fuzz_disk: libFuzzer target for the disk tier's start-up reader (the
 * index) and its checked reads. Once, a real tier of 16 slots is made with
 * 8 known blocks and its two files are kept. Each input then becomes the
 * index's records after the genuine header page (first byte even), or the
 * whole index file (odd: headers fuzzed too); the block file is the genuine
 * one. disktier_open must succeed or fail with a message; every known block
 * must then read back with exactly its bytes or be refused (never a wrong
 * byte), and a put must still work. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "blockkey.h"
#include "disktier.h"
#include "fuzz_env.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define BB 4096u
#define BT 16u
#define N_SLOTS 16u
#define N_KNOWN 8u

static char dir[64];
static unsigned char *blocks_file, *index_hdr;
static size_t blocks_len, index_len;

static struct disktier_conf conf(void)
{
    return (struct disktier_conf){.dir = dir,
                                  .block_bytes = BB,
                                  .block_tokens = BT,
                                  .max_bytes = 4096 + N_SLOTS * (4096 + BB)};
}

static void tokens_of(uint32_t i, uint32_t *t)
{
    for (uint32_t k = 0; k < BT; k++)
        t[k] = i * 131 + k;
}

static struct blockkey key_of(uint32_t i)
{
    uint32_t t[BT];
    tokens_of(i, t);
    return blockkey_next((struct blockkey){i, 7}, t, BT);
}

static unsigned char *slurp(const char *name, size_t *len)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    FUZZ_ASSERT(f != NULL);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*len ? *len : 1);
    FUZZ_ASSERT(b && fread(b, 1, *len, f) == *len);
    fclose(f);
    return b;
}

static void spill(const char *name, const void *a, size_t na, const void *b, size_t nb)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    FUZZ_ASSERT(f != NULL);
    FUZZ_ASSERT(fwrite(a, 1, na, f) == na && (nb == 0 || fwrite(b, 1, nb, f) == nb));
    fclose(f);
}

static void cleanup(void)
{
    char path[128];
    snprintf(path, sizeof path, "%s/blocks.kvd", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/index.kvd", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/lock", dir);
    unlink(path);
    rmdir(dir);
}

static void init(void)
{
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof dir, "%s/kvd-fuzz-disk.XXXXXX", base);
    FUZZ_ASSERT(mkdtemp(dir) != NULL);
    atexit(cleanup);
    struct disktier_conf c = conf();
    struct disktier *dt = NULL;
    struct kvd_error e = {0};
    FUZZ_ASSERT(disktier_open(&c, &dt, &e) == 0);
    void *buf = disktier_buf_new(dt);
    FUZZ_ASSERT(buf != NULL);
    for (uint32_t i = 0; i < N_KNOWN; i++) {
        uint32_t t[BT];
        tokens_of(i, t);
        memset(disktier_data(dt, buf), (int)i + 1, BB);
        FUZZ_ASSERT(disktier_put(dt, "ns", blockkey_ns("ns"), key_of(i), t, buf) == 0);
    }
    free(buf);
    disktier_close(dt);
    size_t n;
    blocks_file = slurp("blocks.kvd", &blocks_len);
    index_hdr = slurp("index.kvd", &n);
    FUZZ_ASSERT(n >= 4096);
    index_len = n;
}

#ifdef FUZZ_DISK_SEED_MAIN
/* Writes the seed corpus entry: a 0 byte, then the genuine records. */
int main(int argc, char **argv)
{
    init();
    FILE *f = argc > 1 ? fopen(argv[1], "wb") : NULL;
    if (!f)
        return 1;
    fputc(0, f);
    fwrite(index_hdr + 4096, 1, index_len - 4096, f);
    return fclose(f) != 0;
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!blocks_file)
        init();
    spill("blocks.kvd", blocks_file, blocks_len, NULL, 0);
    if (size && (data[0] & 1))
        spill("index.kvd", data, size, NULL, 0);
    else
        spill("index.kvd", index_hdr, 4096, size ? data + 1 : data, size ? size - 1 : 0);
    struct disktier_conf c = conf();
    struct disktier *dt = NULL;
    struct kvd_error e = {0};
    if (disktier_open(&c, &dt, &e) != 0) {
        FUZZ_ASSERT(e.message[0] != '\0');
        return 0;
    }
    void *buf = disktier_buf_new(dt);
    FUZZ_ASSERT(buf != NULL);
    for (uint32_t i = 0; i < N_KNOWN; i++) {
        uint32_t t[BT];
        tokens_of(i, t);
        uint32_t s = disktier_lookup(dt, blockkey_ns("ns"), key_of(i));
        if (s == DISKTIER_NONE)
            continue;
        if (disktier_read(dt, s, "ns", blockkey_ns("ns"), key_of(i), t, buf) == 0) {
            const unsigned char *d = disktier_data(dt, buf);
            for (size_t k = 0; k < BB; k++)
                FUZZ_ASSERT(d[k] == i + 1);
        }
    }
    uint32_t t[BT];
    tokens_of(99, t);
    int rc = disktier_put(dt, "ns", blockkey_ns("ns"), key_of(99), t, buf);
    FUZZ_ASSERT(rc == 0 || rc == KVD_ENOMEM);
    struct disktier_stats st;
    disktier_stats(dt, &st);
    FUZZ_ASSERT(st.free_slots + st.cached_slots <= st.slots);
    free(buf);
    disktier_close(dt);
    return 0;
}
