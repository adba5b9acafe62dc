/* Unit tests of the page budget (pages.h) under several kvmm pools of
 * different block sizes (cpu backend, memfd pages): pools share the pages
 * and give back what they empty, a page holds one tenant's blocks, byte
 * quotas and floors hold across pools (a tenant at its quota evicts its
 * own cache in another pool), eviction frees a whole page for another
 * tenant (in the same pool, or asked of another pool, first where the
 * asking pool holds less than its even share), the
 * checker catches a page holding two tenants' blocks, the default page
 * sizes, a pool without a host tier out of the even share, and a new page
 * prefaulted once. kvmm_check runs after every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <cmocka.h>

#include "kvmm_impl.h"
#include "pages.h"

#define OWNER 1
#define PAGE (32u << 10) /* the budget's page: 8 blocks of A, 4 of B */
#define N_PAGES 8

struct pfx {
    struct backend *be;
    struct kvpages *pg;
    struct kvmm *a, *b; /* block_tokens 4 (4 KiB blocks) and 8 (8 KiB blocks) */
};

static struct kv_geom geom(uint32_t bt)
{
    /* f16, 2 layers x 2 kv heads x 64: 512 bytes a token. */
    return (struct kv_geom){
        .layers = 2, .kv_heads = 2, .head_dim = 64, .dtype = KV_F16, .block_tokens = bt};
}

static struct kvmm *pool_on(struct pfx *f, uint32_t bt)
{
    struct kvmm_config c = {.geom = geom(bt), .pages = f->pg, .be = f->be};
    struct kvmm *mm = NULL;
    assert_int_equal(kvmm_new(&c, &mm), 0);
    return mm;
}

/* Budgets of n_dev and n_host pages of PAGE bytes, pools A and B on them. */
static void open_pools(struct pfx *f, uint32_t n_dev, uint32_t n_host)
{
    struct kvpages_conf pc = {.bytes = {(uint64_t)n_dev * PAGE, (uint64_t)n_host * PAGE},
                              .page_bytes = {PAGE, PAGE}};
    assert_int_equal(backend_cpu_new(&f->be), 0);
    assert_int_equal(kvpages_new(f->be, &pc, &f->pg, NULL), 0);
    f->a = pool_on(f, 4);
    f->b = pool_on(f, 8);
}

static int setup(void **state)
{
    *state = calloc(1, sizeof(struct pfx));
    return *state ? 0 : -1;
}

static int teardown(void **state)
{
    struct pfx *f = *state;
    kvmm_free(f->a);
    kvmm_free(f->b);
    kvpages_free(f->pg);
    if (f->be)
        backend_free(f->be);
    free(f);
    return 0;
}

static void check(struct kvmm *mm)
{
    kvmm_lock(mm);
    int rc = kvmm_check(mm);
    if (rc)
        fail_msg("kvmm_check: %s", kvmm_errmsg(mm));
    kvmm_unlock(mm);
}

static struct kvmm_tenant_conf tconf(const char *name)
{
    struct kvmm_tenant_conf c;
    memset(&c, 0, sizeof c);
    snprintf(c.name, sizeof c.name, "%s", name);
    c.max_device_blocks = c.max_host_blocks = c.max_seqs = KVMM_UNLIMITED;
    c.weight = 1;
    return c;
}

static uint32_t tenant(struct kvmm *mm, struct kvmm_tenant_conf c)
{
    uint32_t id;
    kvmm_lock(mm);
    assert_int_equal(kvmm_tenant_set(mm, &c, &id), 0);
    kvmm_unlock(mm);
    return id;
}

/* A sequence of t in its own namespace, n tokens long; rc of the extend. */
static int seq_of(struct kvmm *mm, uint32_t t, size_t n, kvmm_seq_t *s)
{
    uint32_t ns;
    kvmm_lock(mm);
    assert_int_equal(kvmm_tenant_namespace(mm, t, &ns), 0);
    assert_int_equal(kvmm_seq_open(mm, OWNER, t, ns, s), 0);
    int rc = n ? kvmm_seq_extend(mm, OWNER, *s, n) : 0;
    kvmm_unlock(mm);
    check(mm);
    return rc;
}

static int extend(struct kvmm *mm, kvmm_seq_t s, size_t n)
{
    kvmm_lock(mm);
    int rc = kvmm_seq_extend(mm, OWNER, s, n);
    kvmm_unlock(mm);
    check(mm);
    return rc;
}

/* n tokens of t, with ids from base, committed (the blocks enter the tree)
 * and the sequence closed: they stay as cached blocks. */
static void cache_of(struct kvmm *mm, uint32_t t, size_t n, uint32_t base)
{
    kvmm_seq_t s;
    uint32_t *tok = malloc(sizeof *tok * n);
    size_t shared;
    for (size_t i = 0; i < n; i++)
        tok[i] = base + (uint32_t)i;
    assert_int_equal(seq_of(mm, t, n, &s), 0);
    kvmm_lock(mm);
    assert_int_equal(kvmm_seq_commit(mm, OWNER, s, tok, n, &shared), 0);
    assert_int_equal(kvmm_seq_close(mm, OWNER, s), 0);
    kvmm_unlock(mm);
    check(mm);
    free(tok);
}

static void close_seq(struct kvmm *mm, kvmm_seq_t s)
{
    kvmm_lock(mm);
    assert_int_equal(kvmm_seq_close(mm, OWNER, s), 0);
    kvmm_unlock(mm);
    check(mm);
}

static struct kvmm_tenant_stats tstats(struct kvmm *mm, uint32_t t)
{
    struct kvmm_tenant_stats ts;
    kvmm_lock(mm);
    assert_int_equal(kvmm_tenant_stats(mm, t, &ts), 0);
    kvmm_unlock(mm);
    return ts;
}

static struct kvmm_stats mstats(struct kvmm *mm)
{
    struct kvmm_stats st;
    kvmm_lock(mm);
    kvmm_stats(mm, &st);
    kvmm_unlock(mm);
    return st;
}

static uint32_t used_pages(struct pfx *f, enum kvd_tier t)
{
    struct kvpages_stats ps;
    kvpages_stats(f->pg, &ps);
    return ps.used[t];
}

static void test_two_pools_share_the_budget(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    uint32_t ta = tenant(f->a, tconf("t")), tb = tenant(f->b, tconf("t"));
    struct kvmm_stats sa = mstats(f->a), sb = mstats(f->b);
    assert_int_equal(sa.blocks_per_page[KVD_TIER_DEVICE], 8);
    assert_int_equal(sb.blocks_per_page[KVD_TIER_DEVICE], 4);
    assert_int_equal(sa.device_total, 8 * N_PAGES);
    assert_int_equal(sb.device_total, 4 * N_PAGES);
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), 0);
    /* A grows by whole pages: 20 blocks of 4 tokens are 3 pages. */
    kvmm_seq_t s1, s2, s3;
    assert_int_equal(seq_of(f->a, ta, 80, &s1), 0);
    assert_int_equal(mstats(f->a).pages_held[KVD_TIER_DEVICE], 3);
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), 3);
    /* B takes the other 5 pages: 20 blocks of 8 tokens. */
    assert_int_equal(seq_of(f->b, tb, 160, &s2), 0);
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), N_PAGES);
    /* Nothing is left for either: uncommitted blocks are nobody's to evict. */
    assert_int_equal(seq_of(f->b, tb, 8, &s3), KVD_ENOMEM);
    assert_int_equal(extend(f->a, s1, 16), 0); /* A's third page had 4 free slots */
    assert_int_equal(extend(f->a, s1, 1), KVD_ENOMEM);
    /* A shrinks: its pages go back (one kept mapped as its spare: a small
     * budget's pools keep one), and B grows into them, the spare too. */
    close_seq(f->a, s1);
    assert_int_equal(mstats(f->a).pages_held[KVD_TIER_DEVICE], 1);
    assert_int_equal(mstats(f->a).pages_spare[KVD_TIER_DEVICE], 1);
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), 6);
    assert_int_equal(extend(f->b, s3, 96), 0);
    assert_int_equal(mstats(f->b).pages_held[KVD_TIER_DEVICE], N_PAGES);
    assert_int_equal(mstats(f->a).pages_held[KVD_TIER_DEVICE], 0);
    assert_int_equal(mstats(f->a).page_unmaps, 3);
    /* B's spare is used again before any page is mapped. */
    uint64_t maps = mstats(f->b).page_maps;
    kvmm_seq_t s4;
    assert_int_equal(seq_of(f->b, tb, 0, &s4), 0);
    close_seq(f->b, s3); /* 3 pages: one stays as B's spare */
    assert_int_equal(mstats(f->b).pages_spare[KVD_TIER_DEVICE], 1);
    assert_int_equal(extend(f->b, s4, 8), 0);
    assert_int_equal(mstats(f->b).pages_spare[KVD_TIER_DEVICE], 0);
    assert_int_equal(mstats(f->b).page_maps, maps);
    close_seq(f->b, s4);
    close_seq(f->b, s2);
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), 1); /* B's spare */
    kvmm_free(f->b);
    f->b = NULL;
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), 0);
}

static void test_a_page_holds_one_tenant(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    uint32_t x = tenant(f->a, tconf("x")), y = tenant(f->a, tconf("y"));
    kvmm_seq_t sx, sy;
    assert_int_equal(seq_of(f->a, x, 0, &sx), 0);
    assert_int_equal(seq_of(f->a, y, 0, &sy), 0);
    /* Interleaved one-block extends: each tenant fills pages of its own. */
    for (int i = 0; i < 10; i++) {
        assert_int_equal(extend(f->a, sx, 4), 0);
        assert_int_equal(extend(f->a, sy, 4), 0);
    }
    struct kvmm_tenant_stats a = tstats(f->a, x), b = tstats(f->a, y);
    assert_int_equal(a.device_blocks, 10);
    assert_int_equal(a.device_pages, 2); /* 10 blocks: one full page, one partly used */
    assert_int_equal(b.device_pages, 2);
    assert_int_equal(a.device_bytes, 2 * PAGE);
    const struct pool *p = &f->a->pool;
    for (uint32_t g = 0; g < p->n_pages[KVD_TIER_DEVICE]; g++) {
        const struct pool_page *pg = &p->pages[KVD_TIER_DEVICE][g];
        if (pg->owner == POOL_NONE)
            continue;
        uint32_t t = p->owners[pg->owner].tenant;
        for (uint32_t s = g * 8; s < g * 8 + 8; s++)
            if (p->slot_block[KVD_TIER_DEVICE][s] != POOL_NONE)
                assert_int_equal(p->blocks[p->slot_block[KVD_TIER_DEVICE][s]].tenant, t);
    }
    close_seq(f->a, sx);
    close_seq(f->a, sy);
}

static void test_byte_quota_across_pools(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    struct kvmm_tenant_conf c = tconf("q");
    c.max_device_bytes = 3 * PAGE;
    uint32_t qa = tenant(f->a, c), qb = tenant(f->b, c);
    kvmm_seq_t sa, sb, sb2;
    assert_int_equal(seq_of(f->a, qa, 64, &sa), 0); /* 16 blocks: 2 pages */
    assert_int_equal(seq_of(f->b, qb, 32, &sb), 0); /* 4 blocks: the third page */
    assert_int_equal(seq_of(f->b, qb, 8, &sb2), KVD_EQUOTA);
    kvmm_lock(f->b);
    assert_non_null(strstr(kvmm_errmsg(f->b), "byte quota"));
    kvmm_unlock(f->b);
    assert_int_equal(tstats(f->b, qb).device_bytes, 3 * PAGE);
    /* Another tenant is not held back by q's quota. */
    uint32_t other = tenant(f->b, tconf("other"));
    kvmm_seq_t so;
    assert_int_equal(seq_of(f->b, other, 8, &so), 0);
    /* Pages freed in A count for B. */
    close_seq(f->a, sa);
    assert_int_equal(extend(f->b, sb2, 8), 0);
    close_seq(f->b, sb);
    close_seq(f->b, sb2);
    close_seq(f->b, so);
}

static void test_evict_whole_page_for_another_tenant(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, N_PAGES);
    uint32_t x = tenant(f->a, tconf("x")), y = tenant(f->a, tconf("y"));
    /* x's cache fills every page. */
    cache_of(f->a, x, 8 * N_PAGES * 4, 1000);
    assert_int_equal(tstats(f->a, x).device_pages, N_PAGES);
    assert_int_equal(mstats(f->a).pages_cached[KVD_TIER_DEVICE], N_PAGES);
    /* y needs one block: a whole page of x's goes (to the host tier), not
     * one block out of every page. */
    kvmm_seq_t sy;
    assert_int_equal(seq_of(f->a, y, 4, &sy), 0);
    struct kvmm_tenant_stats tx = tstats(f->a, x), ty = tstats(f->a, y);
    assert_int_equal(tx.device_pages, N_PAGES - 1);
    assert_int_equal(tx.device_blocks, 8 * (N_PAGES - 1));
    assert_int_equal(tx.host_blocks, 8);
    assert_int_equal(ty.device_pages, 1);
    assert_int_equal(mstats(f->a).evictions_device, 8);
    /* y's next seven blocks fit its page: nothing more is evicted. */
    assert_int_equal(extend(f->a, sy, 28), 0);
    assert_int_equal(mstats(f->a).evictions_device, 8);
    close_seq(f->a, sy);
}

static void test_reclaim_from_another_pool(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    uint32_t xa = tenant(f->a, tconf("x")), yb = tenant(f->b, tconf("y"));
    cache_of(f->a, xa, 8 * N_PAGES * 4, 1);
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), N_PAGES);
    /* B has no cache of its own: it asks A, which gives back a page. */
    kvmm_seq_t s;
    assert_int_equal(seq_of(f->b, yb, 8, &s), 0);
    assert_int_equal(mstats(f->a).pages_held[KVD_TIER_DEVICE], N_PAGES - 1);
    assert_int_equal(mstats(f->a).drops, 8); /* no host tier: dropped */
    assert_int_equal(mstats(f->b).pages_held[KVD_TIER_DEVICE], 1);
    /* A pool whose lock is held elsewhere is skipped, not waited for. */
    kvmm_lock(f->a);
    kvmm_seq_t s2;
    uint32_t ns;
    kvmm_lock(f->b);
    assert_int_equal(kvmm_tenant_namespace(f->b, yb, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->b, OWNER, yb, ns, &s2), 0);
    assert_int_equal(kvmm_seq_extend(f->b, OWNER, s2, 32), KVD_ENOMEM);
    kvmm_unlock(f->b);
    kvmm_unlock(f->a);
    assert_int_equal(extend(f->b, s2, 32), 0);
    close_seq(f->b, s);
    close_seq(f->b, s2);
}

/* A tenant at its byte quota with cache in another pool (another model's):
 * that cache gives way, not the request. */
static void test_quota_evicts_own_cache_elsewhere(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    struct kvmm_tenant_conf c = tconf("q");
    c.max_device_bytes = 3 * PAGE;
    uint32_t qa = tenant(f->a, c), qb = tenant(f->b, c);
    cache_of(f->a, qa, 3 * 8 * 4, 1); /* 24 blocks of A: three whole pages, cached */
    assert_int_equal(tstats(f->a, qa).device_pages, 3);
    kvmm_seq_t s;
    assert_int_equal(seq_of(f->b, qb, 8, &s), 0); /* one page of B */
    assert_int_equal(tstats(f->a, qa).device_pages, 2);
    assert_int_equal(mstats(f->a).drops, 8); /* no host tier: dropped */
    assert_int_equal(tstats(f->b, qb).device_bytes, 3 * PAGE);
    /* its live blocks are not cache: past the quota it is refused */
    kvmm_seq_t s2;
    assert_int_equal(seq_of(f->a, qa, 0, &s2), 0);
    assert_int_equal(extend(f->b, s, 32), 0); /* B's second page: A's cache again */
    assert_int_equal(tstats(f->a, qa).device_pages, 1);
    assert_int_equal(extend(f->a, s2, 4 * 8 * 2), KVD_EQUOTA);
    close_seq(f->a, s2);
    close_seq(f->b, s);
}

/* A pool holding less than its even share of the budget takes another
 * pool's cache before its own. */
static void test_below_share_asks_others_first(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    uint32_t xa = tenant(f->a, tconf("x")), yb = tenant(f->b, tconf("y"));
    cache_of(f->a, xa, (N_PAGES - 1) * 8 * 4, 1); /* 7 pages of A */
    cache_of(f->b, yb, 4 * 8, 5000);              /* 1 page of B: the budget is full */
    assert_int_equal(used_pages(f, KVD_TIER_DEVICE), N_PAGES);
    kvmm_seq_t s;
    assert_int_equal(seq_of(f->b, yb, 8, &s), 0);
    assert_int_equal(mstats(f->b).pages_held[KVD_TIER_DEVICE], 2); /* its cache stays */
    assert_int_equal(mstats(f->b).evictions_device, 0);
    assert_int_equal(mstats(f->a).pages_held[KVD_TIER_DEVICE], N_PAGES - 2);
    close_seq(f->b, s);
}

static void test_byte_floor(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    struct kvmm_tenant_conf rc = tconf("r"), greedy = tconf("greedy");
    rc.reserved_device_bytes = 2 * PAGE;
    greedy.reserved_device_bytes = 7 * PAGE; /* 2 + 7 > 8 pages */
    uint32_t r = tenant(f->a, rc), o = tenant(f->a, tconf("o")), id;
    kvmm_lock(f->a);
    assert_int_equal(kvmm_tenant_set(f->a, &greedy, &id), KVD_EBADREQ);
    assert_non_null(strstr(kvmm_errmsg(f->a), "floors"));
    kvmm_unlock(f->a);
    /* o borrows everything; r gets its floor back from o's cache. */
    cache_of(f->a, o, 8 * N_PAGES * 4, 1);
    cache_of(f->a, r, 16 * 4, 5000);
    assert_int_equal(tstats(f->a, r).device_pages, 2);
    assert_int_equal(tstats(f->a, o).device_pages, N_PAGES - 2);
    /* r's cache inside its floor stays when o asks for more. */
    kvmm_seq_t so;
    assert_int_equal(seq_of(f->a, o, 8 * (N_PAGES - 2) * 4, &so), 0);
    assert_int_equal(extend(f->a, so, 4), KVD_ENOMEM);
    assert_int_equal(tstats(f->a, r).device_pages, 2);
    assert_int_equal(tstats(f->a, r).cached_device, 16);
    close_seq(f->a, so);
}

static void test_checker_catches_a_shared_page(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    uint32_t x = tenant(f->a, tconf("x"));
    (void)tenant(f->a, tconf("y"));
    kvmm_seq_t s;
    assert_int_equal(seq_of(f->a, x, 8, &s), 0);
    kvmm_lock(f->a);
    struct pool *p = &f->a->pool;
    uint32_t id = f->a->st.v[0]->blocks[1], good = p->blocks[id].owner;
    uint32_t other = mm_owner(f->a, 1, f->a->tt.v[1].ns);
    p->blocks[id].owner = other; /* as if y's block sat in x's page */
    p->blocks[id].tenant = 1;
    assert_int_equal(kvmm_check(f->a), KVD_EINTERNAL);
    assert_non_null(strstr(kvmm_errmsg(f->a), "holds block"));
    p->blocks[id].owner = good;
    p->blocks[id].tenant = x;
    assert_int_equal(kvmm_check(f->a), 0);
    assert_int_equal(kvmm_seq_close(f->a, OWNER, s), 0);
    kvmm_unlock(f->a);
}

static void test_default_pages(void **state)
{
    struct pfx *f = *state;
    struct kvpages *pg;
    struct kvd_error e;
    assert_int_equal(backend_cpu_new(&f->be), 0);
    struct kvpages_conf big = {.bytes = {(uint64_t)1 << 30, 0}};
    assert_int_equal(kvpages_new(f->be, &big, &pg, NULL), 0);
    assert_int_equal(kvpages_page_bytes(pg, KVD_TIER_DEVICE), 2u << 20);
    assert_int_equal(kvpages_total(pg, KVD_TIER_DEVICE), 512);
    assert_int_equal(kvpages_total(pg, KVD_TIER_HOST), 0);
    kvpages_free(pg);
    /* A small budget is still cut into 64 pages. */
    struct kvpages_conf small = {.bytes = {64u << 20, 4u << 20}};
    assert_int_equal(kvpages_new(f->be, &small, &pg, NULL), 0);
    assert_int_equal(kvpages_page_bytes(pg, KVD_TIER_DEVICE), 1u << 20);
    assert_int_equal(kvpages_total(pg, KVD_TIER_DEVICE), 64);
    assert_int_equal(kvpages_page_bytes(pg, KVD_TIER_HOST), 64u << 10);
    kvpages_free(pg);
    /* Asked pages are rounded up to the granularity (the OS page here). */
    struct kvpages_conf odd = {.bytes = {1u << 20, 0}, .page_bytes = {5000, 0}};
    assert_int_equal(kvpages_new(f->be, &odd, &pg, NULL), 0);
    assert_int_equal(kvpages_page_bytes(pg, KVD_TIER_DEVICE), 8192);
    kvpages_free(pg);
    struct kvpages_conf none = {.bytes = {0, 1u << 20}};
    assert_int_equal(kvpages_new(f->be, &none, &pg, &e), KVD_EBADREQ);
    /* A budget is rounded up to whole pages; exact pages are taken as given. */
    struct kvpages_conf tiny = {.bytes = {1000, 0}, .page_bytes = {4096, 0}};
    assert_int_equal(kvpages_new(f->be, &tiny, &pg, &e), 0);
    assert_int_equal(kvpages_total(pg, KVD_TIER_DEVICE), 1);
    kvpages_free(pg);
    tiny.exact[KVD_TIER_DEVICE] = true;
    tiny.page_bytes[KVD_TIER_DEVICE] = 300;
    assert_int_equal(kvpages_new(f->be, &tiny, &pg, &e), 0);
    assert_int_equal(kvpages_page_bytes(pg, KVD_TIER_DEVICE), 300);
    assert_int_equal(kvpages_total(pg, KVD_TIER_DEVICE), 4);
    kvpages_free(pg);
    struct kvpages_conf huge = {.bytes = {1ull << 50, 0}, .page_bytes = {4096, 0}};
    assert_int_equal(kvpages_new(f->be, &huge, &pg, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "pages"));
    /* A block larger than the budget's page takes pages of several. */
    struct kvpages_conf c = {.bytes = {1u << 20, 0}, .page_bytes = {4096, 0}};
    assert_int_equal(kvpages_new(f->be, &c, &f->pg, NULL), 0);
    f->a = pool_on(f, 8); /* 8 KiB blocks: pages of two budget pages */
    assert_int_equal(mstats(f->a).page_bytes[KVD_TIER_DEVICE], 8192);
    assert_int_equal(mstats(f->a).device_total, 128);
}

/* A pool that serves another (a model's draft): no host tier at all where
 * the budget has one (max_host_bytes 0 would be the whole host budget),
 * capped on the device, and out of the models' even share; freed, its
 * pages are the budget's again. */
static void test_unshared_pool_without_host(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, N_PAGES);
    assert_int_equal(kvpages_share(f->pg, KVD_TIER_DEVICE), N_PAGES / 2);
    struct kvmm_config c = {.geom = geom(4),
                            .pages = f->pg,
                            .be = f->be,
                            .max_device_bytes = 2 * PAGE,
                            .no_host = true,
                            .unshared = true};
    struct kvmm *d = NULL;
    assert_int_equal(kvmm_new(&c, &d), 0);
    struct kvpages_stats ps;
    kvpages_stats(f->pg, &ps);
    assert_int_equal(ps.pools, 3);
    assert_int_equal(kvpages_share(f->pg, KVD_TIER_DEVICE), N_PAGES / 2);
    struct kvmm_stats st, sa;
    kvmm_lock(d);
    kvmm_stats(d, &st);
    kvmm_unlock(d);
    kvmm_lock(f->a);
    kvmm_stats(f->a, &sa);
    kvmm_unlock(f->a);
    assert_int_equal(st.host_total, 0);
    assert_int_equal(st.device_total, 2 * 8); /* two pages of 8 blocks */
    assert_int_equal(sa.host_total, N_PAGES * 8);
    assert_true(kvmm_device_slots(d) >= st.device_total);
    /* its blocks fill its two pages and no more; evicted, they are
     * dropped (no host tier) and the pages go back */
    uint32_t t = tenant(d, tconf("<draft>"));
    kvmm_seq_t q;
    assert_int_equal(seq_of(d, t, 16 * 4, &q), 0);
    assert_int_not_equal(extend(d, q, 4), 0); /* a 17th block: past its cap */
    assert_int_equal(kvmm_device_bytes(d), 2 * PAGE);
    close_seq(d, q);
    cache_of(d, t, 16 * 4, 100);
    size_t n = 0;
    kvmm_lock(d);
    assert_int_equal(kvmm_evict(d, KVD_TIER_DEVICE, 16, &n), 0);
    kvmm_stats(d, &st);
    kvmm_unlock(d);
    assert_int_equal(n, 16);
    assert_int_equal(st.host_used + st.host_cached, 0);
    check(d);
    kvmm_free(d);
    kvpages_stats(f->pg, &ps);
    assert_int_equal(ps.pools, 2);
    assert_int_equal(ps.used[KVD_TIER_DEVICE], 0);
    assert_int_equal(ps.used[KVD_TIER_HOST], 0);
}

/* This thread's minor page faults so far. */
static long thread_minflt(void)
{
    struct rusage ru;
    assert_int_equal(getrusage(RUSAGE_THREAD, &ru), 0);
    return ru.ru_minflt;
}

/* A newly mapped page is fresh once: pool_take_fresh gives its range to the
 * first caller and to nobody after; a page that waited as a spare is as
 * fresh as it was. The backend's prefault of it keeps the bytes already
 * written, and (where the kernel has MADV_POPULATE_WRITE) leaves no page
 * fault to the writes that follow. */
static void test_fresh_page_prefaulted(void **state)
{
    struct pfx *f = *state;
    open_pools(f, N_PAGES, 0);
    uint32_t t = tenant(f->a, tconf("t"));
    kvmm_seq_t s;
    assert_int_equal(seq_of(f->a, t, 4, &s), 0); /* one block: one new page */
    /* Emptied before anyone prefaulted it, the page waits as the spare and
     * comes back still fresh. */
    close_seq(f->a, s);
    assert_int_equal(mstats(f->a).pages_spare[KVD_TIER_DEVICE], 1);
    uint64_t maps = mstats(f->a).page_maps;
    assert_int_equal(seq_of(f->a, t, 4, &s), 0);
    assert_int_equal(mstats(f->a).page_maps, maps);
    kvmm_lock(f->a);
    struct pool *p = &f->a->pool;
    uint32_t id;
    size_t n;
    assert_int_equal(kvmm_seq_blocks(f->a, OWNER, s, &id, NULL, 1, &n), 0);
    assert_int_equal(n, 1);
    const struct pool_block *b = pool_block(p, id);
    unsigned char *blk = pool_block_ptr(p, id);
    void *pg = NULL;
    size_t bytes = 0;
    assert_true(pool_take_fresh(p, KVD_TIER_DEVICE, b->slot, &pg, &bytes));
    assert_int_equal(bytes, PAGE);
    assert_true(blk >= (unsigned char *)pg && blk + p->block_bytes <= (unsigned char *)pg + bytes);
    assert_false(pool_take_fresh(p, KVD_TIER_DEVICE, b->slot, &pg, &bytes));
    memset(blk, 0x5a, p->block_bytes);
    f->be->ops->prefault(f->be, pg, KVD_TIER_DEVICE, bytes);
    for (size_t i = 0; i < p->block_bytes; i++)
        assert_int_equal(blk[i], 0x5a);
    /* The rest of the page (free slots: their bytes are nobody's). */
    unsigned char *rest = blk == pg ? blk + p->block_bytes : pg;
    size_t rest_bytes = bytes - p->block_bytes;
    kvmm_unlock(f->a);
    void *probe = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(probe != MAP_FAILED);
#ifdef MADV_POPULATE_WRITE
    bool populate = madvise(probe, 4096, MADV_POPULATE_WRITE) == 0;
#else
    bool populate = false;
#endif
    munmap(probe, 4096);
    long f0 = thread_minflt();
    for (size_t i = 0; i < rest_bytes; i += 4096)
        rest[i] = 1;
    long faults = thread_minflt() - f0;
    if (populate)
        assert_int_equal(faults, 0);
    else
        print_message("no MADV_POPULATE_WRITE here: %ld faults\n", faults);
    /* Prefaulted, emptied and used again, it is not fresh any more. */
    close_seq(f->a, s);
    assert_int_equal(mstats(f->a).pages_spare[KVD_TIER_DEVICE], 1);
    assert_int_equal(seq_of(f->a, t, 4, &s), 0);
    kvmm_lock(f->a);
    assert_int_equal(kvmm_seq_blocks(f->a, OWNER, s, &id, NULL, 1, &n), 0);
    assert_false(pool_take_fresh(p, KVD_TIER_DEVICE, pool_block(p, id)->slot, &pg, &bytes));
    kvmm_unlock(f->a);
    close_seq(f->a, s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_two_pools_share_the_budget, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_page_holds_one_tenant, setup, teardown),
        cmocka_unit_test_setup_teardown(test_byte_quota_across_pools, setup, teardown),
        cmocka_unit_test_setup_teardown(test_evict_whole_page_for_another_tenant, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reclaim_from_another_pool, setup, teardown),
        cmocka_unit_test_setup_teardown(test_quota_evicts_own_cache_elsewhere, setup, teardown),
        cmocka_unit_test_setup_teardown(test_below_share_asks_others_first, setup, teardown),
        cmocka_unit_test_setup_teardown(test_byte_floor, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checker_catches_a_shared_page, setup, teardown),
        cmocka_unit_test_setup_teardown(test_default_pages, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unshared_pool_without_host, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fresh_page_prefaulted, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
