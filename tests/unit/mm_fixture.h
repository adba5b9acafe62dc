/* Shared set-up for the memory-manager unit tests: a cpu backend, a small
 * kvmm (f32, 2 layers, 2 kv heads, head_dim 4, 4 tokens per block: 512-byte
 * blocks; or another dtype: fx_dtype) and deterministic K/V byte patterns.
 * The test's thread holds the kvmm lock from fx_open to fx_close (the lock
 * rule, kvmm.h). */
#ifndef KVD_TEST_MM_FIXTURE_H
#define KVD_TEST_MM_FIXTURE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvmm.h"

#define FX_BT 4

struct fx {
    struct backend *be;
    struct kvmm *mm;
    size_t tb;   /* bytes per token */
    bool locked; /* this thread holds mm's lock (fx_open takes it) */
};

/* The KV dtype of fx_geom; a test may run its cases once per dtype. The
 * manager moves rows of bytes whatever they hold: f32 rows of 4 values
 * (16 bytes), q8_0 and fp8 rows of 32 (34 and 36 bytes, their smallest). */
static enum kv_dtype fx_dtype = KV_F32;

static inline struct kv_geom fx_geom(void)
{
    struct kv_geom g = {.layers = 2,
                        .kv_heads = 2,
                        .head_dim = kv_dtype_size(fx_dtype) ? 4 : 32,
                        .dtype = fx_dtype,
                        .block_tokens = FX_BT};
    return g;
}

/* fx_open with an eviction policy (fx_open: the default, KVMM_EVICT_HITS). */
static inline void fx_open_policy(struct fx *f, uint32_t n_dev, uint32_t n_host,
                                  enum kvmm_evict_policy policy)
{
    struct kvmm_config cfg = {.geom = fx_geom(),
                              .n_device_blocks = n_dev,
                              .n_host_blocks = n_host,
                              .evict_policy = policy};
    assert_int_equal(backend_cpu_new(&f->be), 0);
    cfg.be = f->be;
    assert_int_equal(kvmm_new(&cfg, &f->mm), 0);
    kvmm_lock(f->mm);
    f->locked = true;
    f->tb = kv_token_bytes(kvmm_geom(f->mm));
}

static inline void fx_open(struct fx *f, uint32_t n_dev, uint32_t n_host)
{
    fx_open_policy(f, n_dev, n_host, KVMM_EVICT_HITS);
}

/* Frees whatever fx_open made (all of it, part of it, or nothing). */
static inline void fx_close(struct fx *f)
{
    if (f->mm && f->locked)
        kvmm_unlock(f->mm);
    kvmm_free(f->mm);
    backend_free(f->be);
    memset(f, 0, sizeof *f);
}

/* CMocka setup/teardown: *state is a zeroed struct fx the test opens with
 * fx_open; the teardown closes it, also after a failed assert. */
static inline int fx_setup(void **state)
{
    *state = calloc(1, sizeof(struct fx));
    return *state ? 0 : -1;
}

static inline int fx_teardown(void **state)
{
    if (*state)
        fx_close(*state);
    free(*state);
    return 0;
}

static inline struct kvmm_tenant_conf fx_tenant(const char *name)
{
    struct kvmm_tenant_conf c;
    memset(&c, 0, sizeof c);
    snprintf(c.name, sizeof c.name, "%s", name);
    c.max_device_blocks = c.max_host_blocks = c.max_seqs = KVMM_UNLIMITED;
    c.weight = 1;
    return c;
}

static inline uint64_t fx_mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* Byte j of row r (layer, K|V, kv_head) of a token whose content key is k;
 * key 0 is all zeros (a fresh block). */
static inline unsigned char fx_byte(uint64_t k, size_t r, size_t j)
{
    return k ? (unsigned char)(fx_mix(k * 131 + r * 7919 + j) | 1) : 0;
}

/* Fills buf (n tokens in the kv_write layout) with the contents of keys[0..n). */
static inline void fx_fill(const struct fx *f, unsigned char *buf, const uint64_t *keys, size_t n)
{
    const struct kv_geom *g = kvmm_geom(f->mm);
    size_t rows = (size_t)g->layers * 2 * g->kv_heads, rb = f->tb / rows;
    for (size_t r = 0; r < rows; r++)
        for (size_t t = 0; t < n; t++)
            for (size_t j = 0; j < rb; j++)
                buf[(r * n + t) * rb + j] = fx_byte(keys[t], r, j);
}

/* Index of the first token of buf (n tokens) that differs from keys, or n. */
static inline size_t fx_diff(const struct fx *f, const unsigned char *buf, const uint64_t *keys,
                             size_t n)
{
    const struct kv_geom *g = kvmm_geom(f->mm);
    size_t rows = (size_t)g->layers * 2 * g->kv_heads, rb = f->tb / rows;
    for (size_t t = 0; t < n; t++)
        for (size_t r = 0; r < rows; r++)
            for (size_t j = 0; j < rb; j++)
                if (buf[(r * n + t) * rb + j] != fx_byte(keys[t], r, j))
                    return t;
    return n;
}

static inline void fx_check(struct fx *f)
{
    int rc = kvmm_check(f->mm);
    if (rc)
        fail_msg("kvmm_check: %s", kvmm_errmsg(f->mm));
}

#endif
