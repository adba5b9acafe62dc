/* kvd-fuzz-corpus-gen: writes the seed corpora of the fuzz targets under
 * DIR/<target>/: valid request streams for every op and the hand-made
 * malformed frames (fuzz_proto), op programs (fuzz_ops), and, given a valid
 * GGUF made by kvd-gguf-gen, truncated and corrupted copies of it
 * (fuzz_gguf). Usage: kvd-fuzz-corpus-gen DIR [tiny.gguf]. Deterministic. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/protocol.h"
#include "proto.h"

static const char *out_dir;

static void put(const char *target, const char *name, const void *data, size_t len)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s/%s", out_dir, target, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* ---- fuzz_proto: a connection byte, then frames ------------------------ */

static msgpack_sbuffer sb;
static msgpack_packer pk;
static size_t at;

static void stream_begin(uint8_t conn)
{
    msgpack_sbuffer_clear(&sb);
    msgpack_sbuffer_write(&sb, (const char *)&conn, 1);
}
static void req(const char *op, uint64_t id, size_t n)
{
    at = proto_frame_begin(&sb);
    proto_request_begin(&pk, op, id, n);
}
static void end(void)
{
    proto_frame_end(&sb, at);
}

static void proto_seeds(void)
{
    static const uint32_t toks[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    uint8_t kv[16 * 8];
    for (size_t i = 0; i < sizeof(kv); i++)
        kv[i] = (uint8_t)i;

    /* One op per file. */
    stream_begin(0);
    req(KVD_OP_HELLO, 1, 2);
    proto_pack_kv_uint(&pk, "version", 1);
    proto_pack_kv_str(&pk, "client", "seed");
    end();
    put("proto", "hello", sb.data, sb.size);
    stream_begin(2);
    req(KVD_OP_STATS, 7, 0);
    end();
    put("proto", "stats", sb.data, sb.size);
    stream_begin(0);
    req(KVD_OP_ADMIN_CHECK, 3, 0);
    end();
    req(KVD_OP_ADMIN_EVICT, 4, 2);
    proto_pack_kv_str(&pk, "tier", "host");
    proto_pack_kv_uint(&pk, "n", 3);
    end();
    put("proto", "admin", sb.data, sb.size);
    stream_begin(1);
    req(KVD_OP_SEQ_OPEN, 1, 1);
    proto_pack_kv_str(&pk, "namespace", "pub");
    end();
    put("proto", "open_shared", sb.data, sb.size);
    stream_begin(1);
    req(KVD_OP_GENERATE, 1, 2);
    proto_pack_kv_u32_array(&pk, "tokens", toks, 3);
    proto_pack_kv_uint(&pk, "max_tokens", 4);
    end();
    req(KVD_OP_CANCEL, 2, 1);
    proto_pack_kv_uint(&pk, "target", 1);
    end();
    put("proto", "generate_cancel", sb.data, sb.size);

    /* A whole block-API session; sequence handles of a fresh manager start
     * at a known value, so guess a few. */
    for (uint8_t conn = 0; conn < 3; conn++) {
        char name[32];
        stream_begin(conn);
        req(KVD_OP_SEQ_OPEN, 1, 0);
        end();
        for (uint64_t h = 0; h < 3; h++) {
            uint64_t seq = (h << 32) | 0; /* index 0, generation h */
            req(KVD_OP_SEQ_EXTEND, 10 + h, 2);
            proto_pack_kv_uint(&pk, "seq", seq);
            proto_pack_kv_uint(&pk, "n", 12);
            end();
            req(KVD_OP_KV_WRITE, 20 + h, 4);
            proto_pack_kv_uint(&pk, "seq", seq);
            proto_pack_kv_uint(&pk, "start", 0);
            proto_pack_kv_uint(&pk, "n", 8);
            proto_pack_kv_bin(&pk, "data", kv, sizeof(kv));
            end();
            req(KVD_OP_SEQ_COMMIT, 30 + h, 2);
            proto_pack_kv_uint(&pk, "seq", seq);
            proto_pack_kv_u32_array(&pk, "tokens", toks, 12);
            end();
            req(KVD_OP_KV_READ, 40 + h, 3);
            proto_pack_kv_uint(&pk, "seq", seq);
            proto_pack_kv_uint(&pk, "start", 2);
            proto_pack_kv_uint(&pk, "n", 4);
            end();
            req(KVD_OP_SEQ_FORK, 50 + h, 1);
            proto_pack_kv_uint(&pk, "seq", seq);
            end();
            req(KVD_OP_SEQ_INFO, 60 + h, 1);
            proto_pack_kv_uint(&pk, "seq", seq);
            end();
            req(KVD_OP_SEQ_OFFLOAD, 70 + h, 1);
            proto_pack_kv_uint(&pk, "seq", seq);
            end();
            req(KVD_OP_SEQ_RESTORE, 80 + h, 1);
            proto_pack_kv_uint(&pk, "seq", seq);
            end();
        }
        req(KVD_OP_SEQ_OPEN, 90, 0);
        end();
        req(KVD_OP_SEQ_MATCH, 91, 2);
        proto_pack_kv_uint(&pk, "seq", 1);
        proto_pack_kv_u32_array(&pk, "tokens", toks, 12);
        end();
        req(KVD_OP_SEQ_CLOSE, 92, 1);
        proto_pack_kv_uint(&pk, "seq", 0);
        end();
        snprintf(name, sizeof(name), "session_conn%u", conn);
        put("proto", name, sb.data, sb.size);
    }

    /* Hand-made hostile frames. */
    static const uint8_t zero_len[] = {0, 0, 0, 0, 0};
    put("proto", "bad_zero_length", zero_len, sizeof(zero_len));
    static const uint8_t huge_len[] = {0, 0xff, 0xff, 0xff, 0xff, 0x80};
    put("proto", "bad_len_ffffffff", huge_len, sizeof(huge_len));
    static const uint8_t not_map[] = {0, 0, 0, 0, 3, 0x93, 1, 2, 3};
    put("proto", "bad_not_map", not_map, sizeof(not_map));
    static const uint8_t trailing[] = {0, 0, 0, 0, 2, 0x80, 0xc0};
    put("proto", "bad_trailing", trailing, sizeof(trailing));
    /* {"tokens": array32 of 2^32-1} in 12 bytes: a tiny frame claiming a huge array */
    static const uint8_t huge_arr[] = {0,   0,   0,   0,   13,   0x81, 0xa6, 't',  'o',
                                       'k', 'e', 'n', 's', 0xdd, 0xff, 0xff, 0xff, 0xff};
    put("proto", "bad_huge_array", huge_arr, sizeof(huge_arr));
    uint8_t deep[5 + 40];
    memset(deep, 0x91, sizeof(deep));
    deep[0] = 0;
    deep[1] = 0;
    deep[2] = 0;
    deep[3] = 0;
    deep[4] = 40;
    deep[5] = 0x81;
    deep[6] = 0xa1;
    deep[7] = 'x';
    deep[sizeof(deep) - 1] = 0xc0;
    put("proto", "bad_deep", deep, sizeof(deep));
    /* integer edges: n huge, start+n wrapping, wrong types */
    stream_begin(0);
    req(KVD_OP_SEQ_OPEN, 1, 0);
    end();
    req(KVD_OP_SEQ_EXTEND, 2, 2);
    proto_pack_kv_uint(&pk, "seq", 0);
    proto_pack_kv_uint(&pk, "n", UINT64_MAX);
    end();
    req(KVD_OP_KV_READ, 3, 3);
    proto_pack_kv_uint(&pk, "seq", 0);
    proto_pack_kv_uint(&pk, "start", UINT64_MAX - 1);
    proto_pack_kv_uint(&pk, "n", 4);
    end();
    req(KVD_OP_KV_READ, 4, 3);
    proto_pack_kv_uint(&pk, "seq", 0);
    proto_pack_kv_uint(&pk, "start", 0xFFFFFFF0u);
    proto_pack_kv_uint(&pk, "n", 0x20);
    end();
    req(KVD_OP_KV_WRITE, 5, 4);
    proto_pack_kv_uint(&pk, "seq", 0);
    proto_pack_kv_uint(&pk, "start", 1);
    proto_pack_kv_uint(&pk, "n", 0x10000001);
    proto_pack_kv_bin(&pk, "data", kv, 16);
    end();
    req(KVD_OP_SEQ_EXTEND, 6, 2);
    proto_pack_kv_str(&pk, "seq", "zero");
    proto_pack_kv_int(&pk, "n", -1);
    end();
    put("proto", "bad_integers", sb.data, sb.size);
    /* id missing / op not a string */
    stream_begin(0);
    at = proto_frame_begin(&sb);
    msgpack_pack_map(&pk, 1);
    proto_pack_kv_str(&pk, "op", "hello");
    end();
    at = proto_frame_begin(&sb);
    msgpack_pack_map(&pk, 2);
    proto_pack_kv_uint(&pk, "op", 5);
    proto_pack_kv_uint(&pk, "id", 9);
    end();
    put("proto", "bad_id_op", sb.data, sb.size);
}

/* ---- fuzz_ops: op programs (see fuzz_ops.c for the encoding) ------------ */

static void ops_seeds(void)
{
    /* open; extend 12; write; commit 12 tokens; open; match; fork; info;
     * offload; restore; read; close; evict; check */
    static const uint8_t basic[] = {
        0x00, 0,                    /* conn0 seq_open */
        0x02, 0,    12,             /* extend h0 by 12 */
        0x03, 0,    0,  7,    0x11, /* write h0 [0,+8) */
        0x05, 0,    12, 0x1b,       /* commit 12 tokens */
        0x00, 0,                    /* open h1 */
        0x01, 1,    12, 0x1b,       /* match h1 same tokens */
        0x06, 1,                    /* fork h1 */
        0x07, 2,                    /* info */
        0x08, 0,                    /* offload h0 */
        0x09, 0,                    /* restore h0 */
        0x04, 0,    0,  8,          /* read */
        0x03, 2,    1,  2,    0x44, /* write into the fork (COW) */
        0x0a, 0,                    /* close h0 */
        0x0b, 0x00,                 /* evict device */
        0x0b, 0x03,                 /* evict host 1 */
        0x0e,                       /* admin_check */
    };
    put("ops", "basic", basic, sizeof(basic));
    /* tenant b (conn 2) guesses conn 0's handles; conn 1 (same tenant,
     * other connection) too */
    static const uint8_t guess[] = {
        0x00, 0,    0x02, 0,    8,    0x20, 0,    0x22, 0x80, 4, 0x24, 0x80, 0, 2,    0x2a,
        0x80, 0x10, 0,    0x16, 0x80, 0x17, 0xa0, 0x27, 0xff, 0, 0,    0,    0, 0,    0,
        0,    0,    0x12, 0xff, 0,    0,    0,    1,    0,    0, 0,    0,    5, 0x0e,
    };
    put("ops", "guess_handles", guess, sizeof(guess));
    /* quota pressure for tenant b: many opens and extends */
    uint8_t quota[64];
    for (size_t i = 0; i < sizeof(quota); i += 4) {
        quota[i] = 0x20;
        quota[i + 1] = 0;
        quota[i + 2] = 0x22;
        quota[i + 3] = (uint8_t)(i / 4);
    }
    put("ops", "quota_b", quota, sizeof(quota));
    /* shared namespace: a commits in "pub", b matches */
    static const uint8_t shared[] = {
        0x00, 1, 0x02, 0, 16, 0x05, 0, 16, 0x2d, 0x20, 1, 0x21, 0, 16, 0x2d, 0x27, 0, 0x0e,
    };
    put("ops", "shared_ns", shared, sizeof(shared));
    /* swap churn: fill the pool, offload, evict, match again */
    static const uint8_t churn[] = {
        0x00, 0, 0x02, 0,    23,   0x05, 0,    24,   0x33, 0x08, 0,    0x00, 0,    0x02, 1,    23,
        0x05, 1, 24,   0x77, 0x0a, 0,    0x0a, 1,    0x0b, 0x00, 0x00, 0,    0x01, 2,    24,   0x33,
        0x04, 2, 0,    12,   0x0e, 0x0f, 0,    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf0,
    };
    put("ops", "swap_churn", churn, sizeof(churn));
    /* pseudo-random programs */
    uint64_t s = 12345;
    for (int f = 0; f < 8; f++) {
        uint8_t buf[200];
        char name[32];
        for (size_t i = 0; i < sizeof(buf); i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            buf[i] = (uint8_t)(s >> 56);
        }
        snprintf(name, sizeof(name), "random_%d", f);
        put("ops", name, buf, sizeof(buf));
    }
}

/* ---- fuzz_gguf: a valid tiny model and damaged copies ------------------ */

static void gguf_seeds(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)len);
    if (!b || fread(b, 1, (size_t)len, f) != (size_t)len)
        exit(1);
    fclose(f);
    put("gguf", "valid", b, (size_t)len);
    put("gguf", "truncated_header", b, 20);
    put("gguf", "truncated_half", b, (size_t)len / 2);
    put("gguf", "truncated_last_byte", b, (size_t)len - 1);
    uint8_t *c = malloc((size_t)len);
    /* n_tensors (bytes 8..15) and n_kv (16..23) huge */
    memcpy(c, b, (size_t)len);
    memset(c + 8, 0xff, 8);
    put("gguf", "huge_n_tensors", c, (size_t)len);
    memcpy(c, b, (size_t)len);
    memset(c + 16, 0xff, 8);
    put("gguf", "huge_n_kv", c, (size_t)len);
    /* the first key's length (bytes 24..31) huge */
    memcpy(c, b, (size_t)len);
    memset(c + 24, 0xff, 8);
    put("gguf", "huge_key_len", c, (size_t)len);
    /* version 1 and 4 */
    memcpy(c, b, (size_t)len);
    c[4] = 1;
    put("gguf", "version1", c, (size_t)len);
    free(c);
    free(b);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [tiny.gguf]\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    proto_seeds();
    ops_seeds();
    if (argc > 2)
        gguf_seeds(argv[2]);
    msgpack_sbuffer_destroy(&sb);
    return 0;
}
