/* remote_value: the remote tier's value format and its crypto. A sealed value
 * opens to exactly its blocks; flipping any byte, another fleet key, another
 * Redis key, a truncation, or a plain value where a key is set are refused;
 * an authentic value of other tokens, keys or geometry is a mismatch. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "remote_value.h"

#define BT 4u
#define BB 64u
#define NB 6u /* prompt blocks */

struct fix {
    uint32_t tokens[NB * BT];
    struct blockkey root, chain[NB];
    struct remote_fleet_key k;
};

static void fix_init(struct fix *f, uint32_t seed)
{
    for (uint32_t i = 0; i < NB * BT; i++)
        f->tokens[i] = seed * 1000 + i;
    f->root = (struct blockkey){0x1234, 0x5678};
    struct blockkey p = f->root;
    for (uint32_t b = 0; b < NB; b++)
        p = f->chain[b] = blockkey_next(p, f->tokens + b * BT, BT);
    f->k.secure = true;
    for (int i = 0; i < REMOTE_FLEET_KEY_BYTES; i++)
        f->k.k[i] = (uint8_t)(i * 7 + 1);
}

static struct remote_value_meta meta_of(const struct fix *f, uint32_t first, uint32_t end,
                                        const char *ns)
{
    struct remote_value_meta m = {.block_tokens = BT, .block_bytes = BB, .first = first};
    m.n = end - first + 1;
    m.parent = first ? f->chain[first - 1] : f->root;
    m.last = f->chain[end];
    snprintf(m.ns_name, sizeof m.ns_name, "%s", ns);
    m.ns_hash = blockkey_ns(ns);
    return m;
}

static unsigned char data_byte(uint32_t block, size_t i)
{
    return (unsigned char)(block * 31 + i);
}

/* A sealed value of blocks [first, end] of f's prompt in namespace ns. */
static unsigned char *make(const struct fix *f, const struct remote_fleet_key *k, uint32_t first,
                           uint32_t end, const char *ns, uint8_t key[REMOTE_KEY_BYTES], size_t *len)
{
    struct remote_value_meta m = meta_of(f, first, end, ns);
    *len = remote_value_size(&m);
    assert_true(*len > REMOTE_VALUE_HEAD);
    unsigned char *buf = malloc(*len);
    assert_non_null(buf);
    uint32_t *toks;
    void *data;
    remote_value_layout(&m, buf, &toks, &data);
    memcpy(toks, f->tokens + first * BT, sizeof(uint32_t) * BT * m.n);
    for (uint32_t b = 0; b < m.n; b++)
        for (size_t i = 0; i < BB; i++)
            ((unsigned char *)data)[b * BB + i] = data_byte(first + b, i);
    remote_value_key(m.ns_hash, m.last, key);
    assert_int_equal(remote_value_seal(k, key, buf, *len), 0);
    return buf;
}

static enum remote_value_status open_check(const struct fix *f, const struct remote_fleet_key *k,
                                           const uint8_t key[REMOTE_KEY_BYTES], void *buf,
                                           size_t len, uint32_t end, const char *ns,
                                           struct remote_value_view *v)
{
    enum remote_value_status st = remote_value_open(k, key, buf, len, v);
    if (st != REMOTE_VALUE_OK)
        return st;
    struct remote_value_meta want = meta_of(f, 0, end, ns);
    return remote_value_check(v, &want, end, f->tokens, f->chain, f->root);
}

static void test_roundtrip(void **state)
{
    (void)state;
    struct fix f;
    fix_init(&f, 1);
    for (int secure = 0; secure < 2; secure++) {
        struct remote_fleet_key k = f.k;
        k.secure = secure;
        uint8_t key[REMOTE_KEY_BYTES];
        size_t len;
        unsigned char *buf = make(&f, &k, 2, 4, "tenant:alice", key, &len);
        assert_memory_equal(key, "kvd1:", 5);
        if (secure) /* the K/V bytes are not in the clear */
            for (size_t i = REMOTE_VALUE_HEAD; i + 4 <= len; i++)
                assert_false(buf[i] == data_byte(2, 0) && buf[i + 1] == data_byte(2, 1) &&
                             buf[i + 2] == data_byte(2, 2) && buf[i + 3] == data_byte(2, 3));
        struct remote_value_view v;
        assert_int_equal(open_check(&f, &k, key, buf, len, 4, "tenant:alice", &v), REMOTE_VALUE_OK);
        assert_int_equal(v.m.first, 2);
        assert_int_equal(v.m.n, 3);
        assert_string_equal(v.m.ns_name, "tenant:alice");
        assert_memory_equal(v.tokens, f.tokens + 2 * BT, 3 * BT * 4);
        for (uint32_t b = 0; b < 3; b++)
            for (size_t i = 0; i < BB; i++)
                assert_int_equal(((const unsigned char *)v.data)[b * BB + i], data_byte(2 + b, i));
        free(buf);
    }
}

/* Every single-byte flip, secure and insecure, is refused. */
static void test_tamper_every_byte(void **state)
{
    (void)state;
    struct fix f;
    fix_init(&f, 2);
    for (int secure = 0; secure < 2; secure++) {
        struct remote_fleet_key k = f.k;
        k.secure = secure;
        uint8_t key[REMOTE_KEY_BYTES];
        size_t len;
        unsigned char *orig = make(&f, &k, 0, 1, "tenant:bob", key, &len);
        unsigned char *buf = malloc(len);
        for (size_t i = 0; i < len; i++) {
            memcpy(buf, orig, len);
            buf[i] ^= (unsigned char)(1u << (i % 8));
            struct remote_value_view v;
            enum remote_value_status st = open_check(&f, &k, key, buf, len, 1, "tenant:bob", &v);
            if (st == REMOTE_VALUE_OK)
                fail_msg("flipping byte %zu of %zu (secure %d) went unnoticed", i, len, secure);
        }
        /* A flip in the Redis key (the associated data) too. */
        for (size_t i = 0; i < REMOTE_KEY_BYTES; i++) {
            memcpy(buf, orig, len);
            uint8_t k2[REMOTE_KEY_BYTES];
            memcpy(k2, key, sizeof k2);
            k2[i] ^= 0x40;
            struct remote_value_view v;
            assert_int_equal(remote_value_open(&k, k2, buf, len, &v), REMOTE_VALUE_AUTH);
        }
        free(buf);
        free(orig);
    }
}

static void test_other_fleet_key(void **state)
{
    (void)state;
    struct fix f;
    fix_init(&f, 3);
    uint8_t key[REMOTE_KEY_BYTES];
    size_t len;
    unsigned char *buf = make(&f, &f.k, 0, 2, "tenant:a", key, &len);
    struct remote_fleet_key other = f.k;
    other.k[31] ^= 1;
    struct remote_value_view v;
    assert_int_equal(remote_value_open(&other, key, buf, len, &v), REMOTE_VALUE_AUTH);
    /* A daemon without a key (insecure) cannot read it, and a keyed one
     * refuses a plain value (it could be anyone's). */
    struct remote_fleet_key plain = {.secure = false};
    assert_int_equal(remote_value_open(&plain, key, buf, len, &v), REMOTE_VALUE_AUTH);
    free(buf);
    buf = make(&f, &plain, 0, 2, "tenant:a", key, &len);
    assert_int_equal(remote_value_open(&f.k, key, buf, len, &v), REMOTE_VALUE_AUTH);
    free(buf);
}

static void test_truncated(void **state)
{
    (void)state;
    struct fix f;
    fix_init(&f, 4);
    uint8_t key[REMOTE_KEY_BYTES];
    size_t len;
    unsigned char *orig = make(&f, &f.k, 1, 3, "tenant:a", key, &len);
    unsigned char *buf = malloc(len + 8);
    for (size_t n = 0; n < len; n++) {
        memcpy(buf, orig, len);
        struct remote_value_view v;
        assert_int_not_equal(remote_value_open(&f.k, key, buf, n, &v), REMOTE_VALUE_OK);
    }
    memcpy(buf, orig, len); /* and longer: trailing bytes */
    memset(buf + len, 0, 8);
    struct remote_value_view v;
    assert_int_not_equal(remote_value_open(&f.k, key, buf, len + 8, &v), REMOTE_VALUE_OK);
    free(buf);
    free(orig);
}

/* A value stored under another block's key (swapped keys): its AD differs. */
static void test_swapped_keys(void **state)
{
    (void)state;
    struct fix f;
    fix_init(&f, 5);
    uint8_t k3[REMOTE_KEY_BYTES], k5[REMOTE_KEY_BYTES];
    size_t l3, l5;
    unsigned char *v3 = make(&f, &f.k, 0, 3, "tenant:a", k3, &l3);
    unsigned char *v5 = make(&f, &f.k, 4, 5, "tenant:a", k5, &l5);
    struct remote_value_view v;
    assert_int_equal(remote_value_open(&f.k, k5, v3, l3, &v), REMOTE_VALUE_AUTH);
    assert_int_equal(remote_value_open(&f.k, k3, v5, l5, &v), REMOTE_VALUE_AUTH);
    free(v3);
    free(v5);
}

/* Authentic values that are not what the reader expects. */
static void test_mismatch(void **state)
{
    (void)state;
    struct fix f, g;
    fix_init(&f, 6);
    fix_init(&g, 7); /* another prompt */
    uint8_t key[REMOTE_KEY_BYTES];
    size_t len;
    struct remote_value_view v;
    unsigned char *buf = make(&f, &f.k, 0, 2, "tenant:a", key, &len);
    /* Another namespace's reader (another tenant): its name differs. */
    assert_int_equal(open_check(&f, &f.k, key, buf, len, 2, "tenant:b", &v), REMOTE_VALUE_MISMATCH);
    free(buf);
    buf = make(&f, &f.k, 0, 2, "tenant:a", key, &len);
    /* Another prompt's reader: tokens and chain differ. */
    assert_int_equal(remote_value_open(&f.k, key, buf, len, &v), REMOTE_VALUE_OK);
    struct remote_value_meta want = meta_of(&g, 0, 2, "tenant:a");
    assert_int_equal(remote_value_check(&v, &want, 2, g.tokens, g.chain, g.root),
                     REMOTE_VALUE_MISMATCH);
    /* Same chain keys but other tokens (as a forged key would give). */
    uint32_t toks[NB * BT];
    memcpy(toks, f.tokens, sizeof toks);
    toks[5] ^= 1;
    want = meta_of(&f, 0, 2, "tenant:a");
    assert_int_equal(remote_value_check(&v, &want, 2, toks, f.chain, f.root),
                     REMOTE_VALUE_MISMATCH);
    /* Another end, another geometry. */
    assert_int_equal(remote_value_check(&v, &want, 3, f.tokens, f.chain, f.root),
                     REMOTE_VALUE_MISMATCH);
    want.block_bytes = 2 * BB;
    assert_int_equal(remote_value_check(&v, &want, 2, f.tokens, f.chain, f.root),
                     REMOTE_VALUE_MISMATCH);
    want = meta_of(&f, 0, 2, "tenant:a");
    struct blockkey other_root = {1, 2};
    assert_int_equal(remote_value_check(&v, &want, 2, f.tokens, f.chain, other_root),
                     REMOTE_VALUE_MISMATCH);
    assert_int_equal(remote_value_check(&v, &want, 2, f.tokens, f.chain, f.root), REMOTE_VALUE_OK);
    free(buf);
}

static void write_file(const char *path, const char *text, mode_t mode)
{
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fputs(text, fp);
    fclose(fp);
    assert_int_equal(chmod(path, mode), 0);
}

static void test_key_file(void **state)
{
    (void)state;
    char path[] = "/tmp/kvd-remote-key-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    const char *hex = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1F";
    struct remote_fleet_key k;
    struct kvd_error e = {0};
    char text[80];

    snprintf(text, sizeof text, "%s\n", hex);
    write_file(path, text, 0600);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), 0);
    assert_true(k.secure);
    assert_int_equal(k.k[0], 0);
    assert_int_equal(k.k[31], 0x1f);
    write_file(path, hex, 0400);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), 0);

    write_file(path, text, 0640);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "0600"));
    write_file(path, text, 0604);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EBADREQ);

    const char *bad[] = {"", "00", "\n", NULL};
    for (int i = 0; bad[i]; i++) {
        write_file(path, bad[i], 0600);
        assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EBADREQ);
    }
    snprintf(text, sizeof text, "%s\n\n", hex); /* two newlines */
    write_file(path, text, 0600);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EBADREQ);
    snprintf(text, sizeof text, "%s0", hex); /* 65 digits */
    write_file(path, text, 0600);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EBADREQ);
    snprintf(text, sizeof text, "%s", hex);
    text[10] = 'g';
    write_file(path, text, 0600);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "hex"));
    unlink(path);
    assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, path));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),       cmocka_unit_test(test_tamper_every_byte),
        cmocka_unit_test(test_other_fleet_key), cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_swapped_keys),    cmocka_unit_test(test_mismatch),
        cmocka_unit_test(test_key_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
