/* The cuda backend's elastic KV arenas under load: two kvmm pools of
 * different block sizes on one page budget (device pages from the
 * virtual-memory API, host pages pinned memfds), driven by a random
 * workload of tenants opening, growing, writing, committing, matching,
 * offloading, restoring and closing sequences, so pages are mapped,
 * unmapped and mapped again at the same places while copies run. Every
 * read is compared with what was written, kvmm_check runs after every
 * step, and on the emulator every driver rule is checked (an unmap while
 * a copy that used the page may still run is reported). Exits 77 without
 * a device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVD_CUDA_EMULATE
#include <cuda.h>
#endif

#include "backend.h"
#include "gpu/gpu_fixture.h"
#include "kvd/status.h"
#include "kvmm.h"
#include "pages.h"

#define MAXSEQ 12
#define PLAN 96 /* tokens a sequence may hold at most */
#define N_TENANTS 3

static struct backend *be;

struct mseq {
    bool open;
    kvmm_seq_t h;
    uint32_t tenant;
    size_t n_tokens, n_committed;
    uint32_t base; /* token ids: base + i; the bytes of token i come from (base, i) */
};

struct pool_w {
    struct kvmm *mm;
    size_t tb;
    uint32_t tenants[N_TENANTS], ns[N_TENANTS];
    struct mseq s[MAXSEQ];
};

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

/* Byte j of token i of a sequence whose ids start at base, in row r. */
static unsigned char byte_of(uint32_t base, size_t i, size_t r, size_t j)
{
    uint64_t x = ((uint64_t)(base + i) * 0x9E3779B97F4A7C15ull) ^ (r * 131 + j);
    return (unsigned char)(x >> 29 | 1);
}

/* n tokens from token `from` in the kv layout [rows][token][row bytes]. */
static void fill(const struct pool_w *w, const struct mseq *m, size_t from, size_t n,
                 unsigned char *buf)
{
    const struct kv_geom *g = kvmm_geom(w->mm);
    size_t rows = (size_t)g->layers * 2 * g->kv_heads, rb = w->tb / rows;
    for (size_t r = 0; r < rows; r++)
        for (size_t t = 0; t < n; t++)
            for (size_t j = 0; j < rb; j++)
                buf[(r * n + t) * rb + j] = byte_of(m->base, from + t, r, j);
}

static void check(struct pool_w *w)
{
    if (kvmm_check(w->mm))
        fail_msg("kvmm_check: %s", kvmm_errmsg(w->mm));
}

static bool refused(int rc)
{
    return rc == KVD_ENOMEM || rc == KVD_EQUOTA;
}

static void verify(struct pool_w *w, struct mseq *m)
{
    size_t n = m->n_committed;
    if (!n)
        return;
    unsigned char *got = malloc(n * w->tb), *want = malloc(n * w->tb);
    assert_non_null(got);
    assert_non_null(want);
    int rc = kvmm_seq_read(w->mm, 1, m->h, 0, n, got, n * w->tb);
    if (rc == 0) {
        fill(w, m, 0, n, want);
        if (memcmp(got, want, n * w->tb))
            fail_msg("sequence of tenant %u: %zu tokens read back wrong", m->tenant, n);
    } else if (!refused(rc)) {
        fail_msg("read: %s", kvmm_errmsg(w->mm));
    }
    free(got);
    free(want);
}

static void step(struct pool_w *w)
{
    struct mseq *m = &w->s[rnd(MAXSEQ)];
    uint32_t op = rnd(100);
    int rc;
    if (!m->open) {
        uint32_t t = rnd(N_TENANTS);
        assert_int_equal(kvmm_seq_open(w->mm, 1, w->tenants[t], w->ns[t], &m->h), 0);
        *m = (struct mseq){.open = true, .h = m->h, .tenant = t, .base = 1000 * rnd(6)};
        /* A shared start: the cache may already hold it. */
        uint32_t toks[PLAN];
        for (uint32_t i = 0; i < PLAN; i++)
            toks[i] = m->base + i;
        size_t matched = 0;
        rc = kvmm_seq_match(w->mm, 1, m->h, toks, PLAN / 2, &matched);
        if (rc && !refused(rc))
            fail_msg("match: %s", kvmm_errmsg(w->mm));
        m->n_tokens = m->n_committed = rc ? 0 : matched;
    } else if (op < 45) {
        /* Grow and fill: new blocks are written through copies. */
        size_t n = 1 + rnd(24);
        if (m->n_tokens + n > PLAN)
            n = PLAN - m->n_tokens;
        if (n == 0)
            return;
        rc = kvmm_seq_extend(w->mm, 1, m->h, n);
        if (refused(rc))
            return;
        assert_int_equal(rc, 0);
        size_t from = m->n_committed, k = m->n_tokens + n - from;
        unsigned char *buf = malloc(k * w->tb);
        fill(w, m, from, k, buf);
        rc = kvmm_seq_write(w->mm, 1, m->h, from, k, buf, k * w->tb);
        free(buf);
        if (refused(rc))
            return;
        assert_int_equal(rc, 0);
        m->n_tokens += n;
        uint32_t toks[PLAN];
        for (size_t i = 0; i < m->n_tokens; i++)
            toks[i] = m->base + (uint32_t)i;
        size_t shared;
        rc = kvmm_seq_commit(w->mm, 1, m->h, toks + m->n_committed, m->n_tokens - m->n_committed,
                             &shared);
        if (refused(rc))
            return;
        assert_int_equal(rc, 0);
        m->n_committed = m->n_tokens;
    } else if (op < 60) {
        verify(w, m);
    } else if (op < 68) {
        rc = kvmm_seq_offload(w->mm, 1, m->h);
        if (!refused(rc))
            assert_int_equal(rc, 0);
    } else if (op < 76) {
        rc = kvmm_seq_restore(w->mm, 1, m->h);
        if (!refused(rc))
            assert_int_equal(rc, 0);
    } else if (op < 82) {
        size_t ev;
        assert_int_equal(kvmm_evict(w->mm, rnd(2) ? KVD_TIER_DEVICE : KVD_TIER_HOST, rnd(40), &ev),
                         0);
    } else {
        verify(w, m);
        assert_int_equal(kvmm_seq_close(w->mm, 1, m->h), 0);
        m->open = false;
    }
}

static void pool_open(struct pool_w *w, struct kvpages *pg, uint32_t block_tokens)
{
    struct kvmm_config c = {.geom = {.layers = 4,
                                     .kv_heads = 4,
                                     .head_dim = 64,
                                     .dtype = KV_F16,
                                     .block_tokens = block_tokens},
                            .pages = pg,
                            .be = be};
    static const char *names[N_TENANTS] = {"a", "b", "c"};
    memset(w, 0, sizeof *w);
    assert_int_equal(kvmm_new(&c, &w->mm), 0);
    w->tb = kv_token_bytes(kvmm_geom(w->mm));
    kvmm_lock(w->mm);
    for (int t = 0; t < N_TENANTS; t++) {
        struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                      .max_host_blocks = KVMM_UNLIMITED,
                                      .max_seqs = KVMM_UNLIMITED,
                                      .weight = 1};
        snprintf(tc.name, sizeof tc.name, "%s", names[t]);
        if (t == 2)
            tc.max_device_bytes = (uint64_t)4 << 20; /* two pages, both pools together */
        assert_int_equal(kvmm_tenant_set(w->mm, &tc, &w->tenants[t]), 0);
        assert_int_equal(kvmm_tenant_namespace(w->mm, w->tenants[t], &w->ns[t]), 0);
    }
    kvmm_unlock(w->mm);
}

static void pool_close(struct pool_w *w)
{
    kvmm_lock(w->mm);
    for (int i = 0; i < MAXSEQ; i++)
        if (w->s[i].open) {
            verify(w, &w->s[i]);
            assert_int_equal(kvmm_seq_close(w->mm, 1, w->s[i].h), 0);
        }
    check(w);
    kvmm_unlock(w->mm);
    kvmm_free(w->mm);
}

static void test_grow_shrink_remap(void **state)
{
    /* 8 device pages of 2 MiB (the VMM granularity), 8 host pages: 64 KiB
     * and 128 KiB blocks, 32 and 16 of them a page. */
    struct kvpages_conf pc = {.bytes = {16u << 20, 16u << 20}, .page_bytes = {2u << 20, 2u << 20}};
    struct kvpages *pg;
    struct pool_w *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(kvpages_new(be, &pc, &pg, NULL), 0);
    pool_open(a, pg, 16);
    pool_open(b, pg, 32);
    uint64_t maps = 0, unmaps = 0;
    for (int i = 0; i < 4000; i++) {
        struct pool_w *w = rnd(2) ? a : b;
        kvmm_lock(w->mm);
        step(w);
        check(w);
        kvmm_unlock(w->mm);
    }
    for (int k = 0; k < 2; k++) {
        struct pool_w *w = k ? b : a;
        struct kvmm_stats st;
        kvmm_lock(w->mm);
        kvmm_stats(w->mm, &st);
        kvmm_unlock(w->mm);
        maps += st.page_maps;
        unmaps += st.page_unmaps;
    }
    printf("pages: %llu mapped, %llu unmapped\n", (unsigned long long)maps,
           (unsigned long long)unmaps);
    /* The arenas shrank and grew again: more pages mapped than the budget
     * has (16, both tiers), and many given back on the way. */
    assert_true(maps > 16);
    assert_true(unmaps >= 8);
    pool_close(a);
    pool_close(b);
    struct kvpages_stats ps;
    kvpages_stats(pg, &ps);
    assert_int_equal(ps.used[KVD_TIER_DEVICE], 0);
    assert_int_equal(ps.used[KVD_TIER_HOST], 0);
    kvpages_free(pg);
    free(a);
    free(b);
#ifdef KVD_CUDA_EMULATE
    struct kvd_emu_vmm_counts c;
    kvd_emu_vmm_get_counts(&c);
    assert_int_equal(c.mappings, 0);
    assert_int_equal(c.reservations, 0);
    assert_int_equal(c.handles, 0);
#endif
}

int main(void)
{
    struct kvd_error err = {0};
    int rc = backend_cuda_new(0, &be, &err);
    if (rc) {
        printf("SKIP: no usable CUDA device: %s\n", err.message);
        return GPU_SKIP;
    }
    gpu_emu_reports();
    const struct CMUnitTest tests[] = {GPU_TEST(test_grow_shrink_remap)};
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    backend_free(be);
    return rc;
}
