/* kvmm_export: zero-copy export of a sequence's blocks (kvmm.h, "zero-copy
 * export"). An export is a list of pinned pages of the paged arenas, owned
 * like a sequence by an owner (a connection); it ends by id, by sequence,
 * or with the owner. Every function expects the caller to hold mm->lock. */
#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "hosttier.h"
#include "kvmm_impl.h"

struct mm_export {
    struct mm_export *next;
    uint64_t id;
    kvmm_owner owner;
    kvmm_seq_t seq;
    size_t n_pages;
    struct kvmm_export_page pages[]; /* (n_pages) */
};

int kvmm_export_fd(struct kvmm *mm, const struct kvmm_export_page *pg, int *fd,
                   enum backend_fd_kind *kind)
{
    MM_ASSERT_LOCKED(mm);
    struct backend *be = mm->be;
    *fd = -1;
    *kind = BACKEND_FD_MEMFD;
    if (!be->ops->arena_page_fd || pg->tier >= POOL_TIERS || !mm->pool.elastic[pg->tier] ||
        pg->page >= mm->pool.n_pages[pg->tier])
        return mm_fail(mm, KVD_EINTERNAL, "no such exported page");
    int rc =
        be->ops->arena_page_fd(be, mm->pool.arena[pg->tier], pg->page, pg->fd_writable, fd, kind);
    if (rc)
        return mm_fail(mm, rc, "cannot make a descriptor of page %u: %s", pg->page,
                       rc == KVD_ENOMEM ? "out of descriptors" : "the backend failed");
    return 0;
}

void kvmm_export_info_free(struct kvmm_export_info *info)
{
    free(info->pages);
    free(info->blocks);
    memset(info, 0, sizeof *info);
}

/* Page g of tier t for sequence s: the tenant's own page is its to see;
 * another tenant's (prefix blocks it made in a shared namespace) only when
 * every block in it is a tree block of s's namespace, else KVD_EPERM with
 * the message set. *pg gets writable (every block in it s's alone, asked
 * for, a device page of the tenant's own namespace) and fd_writable. */
static int page_check(struct kvmm *mm, const struct seq *s, enum kvd_tier t, uint32_t g,
                      bool want_writable, struct kvmm_export_page *pg)
{
    const struct pool *p = &mm->pool;
    uint32_t s0 = pool_page_first(p, t, g), s1 = pool_page_end(p, t, g);
    const struct pool_owner *o = &p->owners[p->pages[t][g].owner];
    bool own_ns = s->tenant < mm->tt.n && s->ns == mm->tt.v[s->tenant].ns;
    bool ro_ok = mm->be->ops->page_fd_read_only & (1u << t);

    if (o->tenant != s->tenant)
        for (uint32_t sl = s0; sl < s1; sl++) {
            uint32_t id = p->slot_block[t][sl];
            if (id != POOL_NONE && !(p->blocks[id].node && p->blocks[id].node->ns == s->ns))
                return mm_fail(mm, KVD_EPERM,
                               "page %u of the %s pool is another tenant's and holds blocks "
                               "outside the prefix tree; a page is exported whole, so it cannot "
                               "be exported to tenant %u",
                               g, t == KVD_TIER_DEVICE ? "device" : "host", s->tenant);
        }
    /* A descriptor that cannot be read-only hands out writes: only for the
     * tenant's own pages of its own namespace (it can harm its own cache,
     * nobody else's). */
    if (!ro_ok && !(o->tenant == s->tenant && o->ns == mm->tt.v[s->tenant].ns))
        return mm_fail(mm, KVD_EPERM,
                       "page %u of the %s pool holds blocks of a shared namespace, and this "
                       "backend's %s pages cannot be handed out read-only: use kv_read",
                       g, t == KVD_TIER_DEVICE ? "device" : "host", mm->be->ops->name);
    pg->writable = false;
    if (want_writable && t == KVD_TIER_DEVICE && own_ns && o->tenant == s->tenant) {
        uint32_t mine = 0;
        for (size_t i = 0; i < s->n_blocks; i++) {
            const struct pool_block *b = &p->blocks[s->blocks[i]];
            if (b->tier == t && b->slot >= s0 && b->slot < s1 && b->refcount == 1 && !b->node)
                mine++;
        }
        pg->writable = mine == p->pages[t][g].n_used;
    }
    pg->fd_writable = pg->writable || !ro_ok;
    return 0;
}

int kvmm_seq_export(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, uint32_t tenant, bool admin,
                    size_t from, size_t n, bool writable, size_t max_pages,
                    struct kvmm_export_info *out)
{
    MM_ASSERT_LOCKED(mm);
    struct pool *p = &mm->pool;
    size_t bt = mm->geom.block_tokens, b0, b1, np = 0;
    struct mm_export *ex = NULL;
    int rc;

    memset(out, 0, sizeof *out);
    struct seq *s = seq_table_get(&mm->st, seq, owner);
    if (!s) {
        const struct seq *l = seq_table_peek(&mm->st, seq);
        if (l && l->lent && l->lender == owner)
            return mm_fail(mm, KVD_EBUSY, "sequence %llu is in use by generate request %llu",
                           (unsigned long long)seq, (unsigned long long)l->lend_tag);
        return mm_fail(mm, KVD_ENOTFOUND, "no open sequence %#llx for this owner",
                       (unsigned long long)seq);
    }
    if (!p->elastic[KVD_TIER_DEVICE] || !mm->be->ops->arena_page_fd)
        return mm_fail(mm, KVD_EUNSUPPORTED,
                       "kv_export needs pools in exportable pages; this %s pool's are not "
                       "(allocated whole: its pages are no multiple of the backend's "
                       "granularity, or the backend cannot map pages): use kv_read",
                       mm->be->ops->name);
    if (s->tenant != tenant && !admin)
        return mm_fail(mm, KVD_EPERM,
                       "sequence %llu belongs to another tenant; only its own tenant or an "
                       "admin may export it",
                       (unsigned long long)seq);
    if (n == 0)
        n = from < s->n_tokens ? s->n_tokens - from : 0;
    if (n == 0 || from >= s->n_tokens || n > s->n_tokens - from)
        return mm_fail(mm, KVD_EBADREQ,
                       "token range [%zu, +%zu) is not inside the sequence (%zu tokens)", from, n,
                       s->n_tokens);
    b0 = from / bt;
    b1 = (from + n + bt - 1) / bt;
    for (size_t i = b0; i < b1; i++)
        if (hosttier_verify(p, s->blocks[i]))
            return mm_fail(mm, KVD_EINTERNAL,
                           "the host copy of block %zu failed its checksum; kv_read drops it "
                           "and cuts the sequence there",
                           i);
    out->pages = fault_malloc(sizeof *out->pages * (b1 - b0));
    out->blocks = fault_malloc(sizeof *out->blocks * (b1 - b0));
    if (!out->pages || !out->blocks) {
        kvmm_export_info_free(out);
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    }
    /* Pages in order of first use; a sequence's blocks are few pages, so
     * the lookup is a scan of the pages found so far. */
    for (size_t i = b0; i < b1; i++) {
        const struct pool_block *b = &p->blocks[s->blocks[i]];
        enum kvd_tier t = (enum kvd_tier)b->tier;
        uint32_t g = pool_page_of(p, t, b->slot);
        size_t k = 0;
        while (k < np && !(out->pages[k].tier == t && out->pages[k].page == g))
            k++;
        if (k == np) {
            struct kvmm_export_page pg = {.tier = (uint8_t)t, .page = g};
            if (np == max_pages) {
                rc = mm_fail(mm, KVD_ETOOLARGE,
                             "tokens [%zu, +%zu) lie in more than %zu pages; export fewer at a "
                             "time",
                             from, n, max_pages);
                goto fail;
            }
            if (!p->elastic[t]) {
                rc = mm_fail(mm, KVD_EUNSUPPORTED,
                             "block %zu is in the %s pool, whose pages cannot be exported", i,
                             t == KVD_TIER_DEVICE ? "device" : "host");
                goto fail;
            }
            if ((rc = page_check(mm, s, t, g, writable, &pg)))
                goto fail;
            out->pages[np++] = pg;
        }
        out->blocks[i - b0].page = (uint32_t)k;
        out->blocks[i - b0].offset =
            (uint64_t)b->slot * mm->block_bytes - (uint64_t)g * p->page_bytes[t];
    }
    ex = fault_malloc(sizeof *ex + sizeof ex->pages[0] * np);
    if (!ex) {
        rc = mm_fail(mm, KVD_ENOMEM, "out of memory");
        goto fail;
    }
    ex->id = ++mm->next_export;
    ex->owner = owner;
    ex->seq = seq;
    ex->n_pages = np;
    memcpy(ex->pages, out->pages, sizeof ex->pages[0] * np);
    ex->next = mm->exports;
    mm->exports = ex;
    mm->n_exports++;
    for (size_t k = 0; k < np; k++)
        pool_pin(p, (enum kvd_tier)ex->pages[k].tier, ex->pages[k].page);
    out->id = ex->id;
    out->from_block = b0;
    out->n_pages = np;
    out->n_blocks = b1 - b0;
    for (int t = 0; t < POOL_TIERS; t++)
        out->page_bytes[t] = p->page_bytes[t];
    return 0;
fail:
    kvmm_export_info_free(out);
    return rc;
}

static void export_end(struct kvmm *mm, struct mm_export **link)
{
    struct mm_export *ex = *link;
    *link = ex->next;
    for (size_t k = 0; k < ex->n_pages; k++)
        pool_unpin(&mm->pool, (enum kvd_tier)ex->pages[k].tier, ex->pages[k].page);
    mm->n_exports--;
    free(ex);
}

int kvmm_export_release(struct kvmm *mm, kvmm_owner owner, uint64_t id)
{
    MM_ASSERT_LOCKED(mm);
    for (struct mm_export **pp = &mm->exports; *pp; pp = &(*pp)->next)
        if ((*pp)->id == id && (*pp)->owner == owner) {
            export_end(mm, pp);
            return 0;
        }
    return mm_fail(mm, KVD_ENOTFOUND, "no export %llu of this connection", (unsigned long long)id);
}

int kvmm_export_release_seq(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t *n)
{
    MM_ASSERT_LOCKED(mm);
    struct mm_export **pp = &mm->exports;
    *n = 0;
    while (*pp)
        if ((*pp)->owner == owner && (*pp)->seq == seq) {
            export_end(mm, pp);
            (*n)++;
        } else {
            pp = &(*pp)->next;
        }
    return 0;
}

void mm_exports_close_owner(struct kvmm *mm, kvmm_owner owner)
{
    struct mm_export **pp = &mm->exports;
    while (*pp)
        if ((*pp)->owner == owner)
            export_end(mm, pp);
        else
            pp = &(*pp)->next;
}

void mm_exports_free(struct kvmm *mm)
{
    while (mm->exports) {
        struct mm_export *ex = mm->exports;
        mm->exports = ex->next;
        free(ex);
    }
    mm->n_exports = 0;
}
