/* remote_value: the remote tier's value format and its crypto. A sealed value
 * opens to exactly its blocks; flipping any byte, another fleet key, another
 * Redis key, a truncation, or a plain value where a key is set are refused;
 * an authentic value of other tokens, keys or geometry is a mismatch. The
 * seal is byte for byte libsodium's XChaCha20-Poly1305 (values in a fleet's
 * Redis written by either open with the other), also from several threads. */
#include <pthread.h>
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
#include <sodium.h>

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

/* A value of n blocks of bb bytes (tokens and K/V from seed), laid out and not sealed. */
static unsigned char *laid_out(uint64_t bb, uint32_t n, uint32_t seed, size_t *len)
{
    struct remote_value_meta m = {.block_tokens = BT, .block_bytes = bb, .first = 0, .n = n};
    m.parent = (struct blockkey){seed, 1};
    m.last = (struct blockkey){seed, 2};
    snprintf(m.ns_name, sizeof m.ns_name, "tenant:kat");
    m.ns_hash = blockkey_ns(m.ns_name);
    *len = remote_value_size(&m);
    assert_true(*len > REMOTE_VALUE_HEAD);
    unsigned char *buf = malloc(*len);
    assert_non_null(buf);
    uint32_t *toks;
    void *data;
    remote_value_layout(&m, buf, &toks, &data);
    for (uint32_t i = 0; i < n * BT; i++)
        toks[i] = seed + i;
    unsigned char *d = data;
    for (uint64_t i = 0; i < bb * n; i++)
        d[i] = (unsigned char)((i * 2654435761u + seed) >> 7);
    return buf;
}

static void ad_for(const uint8_t rkey[REMOTE_KEY_BYTES], const unsigned char *buf,
                   unsigned char ad[REMOTE_KEY_BYTES + 8])
{
    memcpy(ad, rkey, REMOTE_KEY_BYTES);
    memcpy(ad + REMOTE_KEY_BYTES, buf, 8);
}

/* Seals a laid-out value as the format defines it, with libsodium's own call (how every
 * value was sealed before the cipher moved to libcrypto): mode 1, the nonce given. */
static void sodium_seal(const struct remote_fleet_key *k, const uint8_t rkey[REMOTE_KEY_BYTES],
                        const unsigned char nonce[24], unsigned char *buf, size_t len)
{
    buf[4] = 1;
    memcpy(buf + 8, nonce, 24);
    unsigned char ad[REMOTE_KEY_BYTES + 8];
    ad_for(rkey, buf, ad);
    unsigned long long maclen = 0;
    assert_int_equal(crypto_aead_xchacha20poly1305_ietf_encrypt_detached(
                         buf + REMOTE_VALUE_HEAD, buf + 32, &maclen, buf + REMOTE_VALUE_HEAD,
                         len - REMOTE_VALUE_HEAD, ad, sizeof ad, NULL, buf + 8, k->k),
                     0);
    assert_int_equal(maclen, 16);
}

/* Opens with libsodium's own call: 0, or -1 refused. */
static int sodium_open(const struct remote_fleet_key *k, const uint8_t rkey[REMOTE_KEY_BYTES],
                       unsigned char *buf, size_t len)
{
    unsigned char ad[REMOTE_KEY_BYTES + 8];
    ad_for(rkey, buf, ad);
    return crypto_aead_xchacha20poly1305_ietf_decrypt_detached(
        buf + REMOTE_VALUE_HEAD, NULL, buf + REMOTE_VALUE_HEAD, len - REMOTE_VALUE_HEAD, buf + 32,
        ad, sizeof ad, buf + 8, k->k);
}

/* remote_value_seal's bytes are libsodium's under the same nonce; each side opens the
 * other's values to the same plaintext; a flipped tag, AD or body byte of a value libsodium
 * sealed is refused. Block sizes around ChaCha20's 64-byte blocks and the ciphers' wide
 * paths, up to a 3 MiB value. */
static void test_libsodium_both_ways(void **state)
{
    (void)state;
    assert_true(sodium_init() >= 0);
    struct fix f;
    fix_init(&f, 8);
    const uint64_t sizes[] = {1, 15, 63, 64, 65, 255, 1000, 4109, 65536, (1u << 20) + 7};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t len;
        unsigned char *plain = laid_out(sizes[si], 3, (uint32_t)si, &len);
        unsigned char *ours = malloc(len), *theirs = malloc(len);
        assert_non_null(ours);
        assert_non_null(theirs);
        uint8_t rkey[REMOTE_KEY_BYTES];
        remote_value_key(blockkey_ns("tenant:kat"), (struct blockkey){si, 2}, rkey);

        /* Ours, then libsodium's with our nonce: the same bytes. */
        memcpy(ours, plain, len);
        assert_int_equal(remote_value_seal(&f.k, rkey, ours, len), 0);
        memcpy(theirs, plain, len);
        sodium_seal(&f.k, rkey, ours + 8, theirs, len);
        if (memcmp(ours, theirs, len) != 0)
            fail_msg("block bytes %llu: the seal differs from libsodium's",
                     (unsigned long long)sizes[si]);
        assert_memory_not_equal(ours + REMOTE_VALUE_HEAD, plain + REMOTE_VALUE_HEAD,
                                len - REMOTE_VALUE_HEAD);

        /* libsodium opens ours. */
        assert_int_equal(sodium_open(&f.k, rkey, ours, len), 0);
        assert_memory_equal(ours + REMOTE_VALUE_HEAD, plain + REMOTE_VALUE_HEAD,
                            len - REMOTE_VALUE_HEAD);

        /* We open libsodium's (a fresh random nonce). */
        unsigned char nonce[24];
        randombytes_buf(nonce, sizeof nonce);
        memcpy(theirs, plain, len);
        sodium_seal(&f.k, rkey, nonce, theirs, len);
        unsigned char *sealed = malloc(len);
        assert_non_null(sealed);
        memcpy(sealed, theirs, len);
        struct remote_value_view v;
        assert_int_equal(remote_value_open(&f.k, rkey, theirs, len, &v), REMOTE_VALUE_OK);
        assert_int_equal(v.m.n, 3);
        assert_int_equal(v.m.block_bytes, sizes[si]);
        assert_memory_equal(theirs + REMOTE_VALUE_HEAD, plain + REMOTE_VALUE_HEAD,
                            len - REMOTE_VALUE_HEAD);

        /* Tampered: a tag byte, the Redis key (AD), the value's head (AD), the body's first,
         * middle and last bytes. */
        const size_t flips[] = {32,     47, 0, 4, REMOTE_VALUE_HEAD, (REMOTE_VALUE_HEAD + len) / 2,
                                len - 1};
        for (size_t fi = 0; fi < sizeof flips / sizeof flips[0]; fi++) {
            memcpy(theirs, sealed, len);
            uint8_t rk[REMOTE_KEY_BYTES];
            memcpy(rk, rkey, sizeof rk);
            if (fi == 2)
                rk[REMOTE_KEY_BYTES - 1] ^= 0x80;
            else
                theirs[flips[fi]] ^= 0x01;
            enum remote_value_status st = remote_value_open(&f.k, rk, theirs, len, &v);
            if (st == REMOTE_VALUE_OK)
                fail_msg("block bytes %llu, flip %zu: opened", (unsigned long long)sizes[si], fi);
        }
        free(sealed);
        free(plain);
        free(ours);
        free(theirs);
    }
}

/* Several threads sealing and opening at once (each has its own cipher context). */
struct thr_arg {
    const struct fix *f;
    int failures;
};

static void *thr_main(void *a)
{
    struct thr_arg *t = a;
    for (uint32_t i = 0; i < 40; i++) {
        size_t len;
        unsigned char *buf = laid_out(4096 + i, 2, i, &len);
        unsigned char *want = malloc(len);
        uint8_t rkey[REMOTE_KEY_BYTES];
        remote_value_key(i, (struct blockkey){i, 3}, rkey);
        struct remote_value_view v;
        if (!want || remote_value_seal(&t->f->k, rkey, buf, len) != 0) {
            t->failures++;
        } else {
            memcpy(want, buf, len);
            if (sodium_open(&t->f->k, rkey, want, len) != 0 ||
                remote_value_open(&t->f->k, rkey, buf, len, &v) != REMOTE_VALUE_OK ||
                memcmp(want, buf, len) != 0)
                t->failures++;
        }
        free(want);
        free(buf);
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    struct fix f;
    fix_init(&f, 9);
    pthread_t th[4];
    struct thr_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (struct thr_arg){&f, 0};
        assert_int_equal(pthread_create(&th[i], NULL, thr_main, &args[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(args[i].failures, 0);
    }
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

/* Run alone (KVD_TEST_NO_CIPHER), with OPENSSL_CONF naming a configuration whose only provider
 * is OpenSSL's null one: loading the fleet key fails at once with the reason, a value cannot
 * be sealed, and a value libsodium sealed is refused (dropped and counted as a failed
 * authentication), never served. */
static void test_no_cipher(void **state)
{
    (void)state;
    assert_true(sodium_init() >= 0);
    char path[] = "/tmp/kvd-remote-key-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    write_file(path, "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n", 0600);
    struct remote_fleet_key k;
    struct kvd_error e = {0};
    assert_int_equal(remote_fleet_key_load(path, &k, &e), KVD_EINTERNAL);
    assert_non_null(strstr(e.message, "ChaCha20-Poly1305"));
    unlink(path);

    struct fix f;
    fix_init(&f, 10);
    size_t len;
    unsigned char *buf = laid_out(100, 2, 1, &len);
    uint8_t rkey[REMOTE_KEY_BYTES];
    remote_value_key(1, (struct blockkey){1, 2}, rkey);
    assert_int_equal(remote_value_seal(&f.k, rkey, buf, len), -1);
    unsigned char nonce[24] = {3};
    sodium_seal(&f.k, rkey, nonce, buf, len);
    struct remote_value_view v;
    assert_int_equal(remote_value_open(&f.k, rkey, buf, len, &v), REMOTE_VALUE_AUTH);
    free(buf);
}

int main(void)
{
    if (getenv("KVD_TEST_NO_CIPHER")) {
        const struct CMUnitTest alone[] = {cmocka_unit_test(test_no_cipher)};
        return cmocka_run_group_tests(alone, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),       cmocka_unit_test(test_tamper_every_byte),
        cmocka_unit_test(test_other_fleet_key), cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_swapped_keys),    cmocka_unit_test(test_mismatch),
        cmocka_unit_test(test_key_file),        cmocka_unit_test(test_libsodium_both_ways),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
