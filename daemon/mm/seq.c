/* seq: storage of sequences and their handles (see seq.h). */
#include "seq.h"

#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "kvd/status.h"

void seq_table_free(struct seq_table *st)
{
    for (uint32_t i = 0; i < st->n; i++) {
        free(st->v[i]->blocks);
        free(st->v[i]->tokens);
        free(st->v[i]);
    }
    free(st->v);
    free(st->free);
    memset(st, 0, sizeof *st);
}

int seq_table_add(struct seq_table *st, uint64_t owner, uint64_t *handle, struct seq **out)
{
    uint32_t idx;
    struct seq *s;

    if (st->n_free) {
        idx = st->free[--st->n_free];
    } else {
        struct seq **v;
        uint32_t *f;
        if (st->n == UINT32_MAX)
            return KVD_ENOMEM;
        v = fault_realloc(st->v, sizeof *v * (st->n + 1));
        if (!v)
            return KVD_ENOMEM;
        st->v = v;
        f = fault_realloc(st->free, sizeof *f * (st->n + 1));
        if (!f)
            return KVD_ENOMEM;
        st->free = f;
        s = fault_calloc(1, sizeof *s);
        if (!s)
            return KVD_ENOMEM;
        s->gen = 0;
        st->v[st->n] = s;
        idx = st->n++;
    }
    s = st->v[idx];
    s->idx = idx;
    s->gen = (s->gen + 1) & SEQ_GEN_MASK; /* now odd: open */
    s->owner = owner;
    s->lent = false;
    s->lender = s->lend_tag = 0;
    s->tenant = s->ns = 0;
    s->n_tokens = s->n_committed = s->n_blocks = 0;
    st->n_open++;
    *handle = seq_handle(st, idx);
    *out = s;
    return 0;
}

struct seq *seq_table_get(const struct seq_table *st, uint64_t handle, uint64_t owner)
{
    uint32_t idx = (uint32_t)handle, gen = (uint32_t)(handle >> 32) & SEQ_GEN_MASK;
    struct seq *s;

    if (idx >= st->n || (handle & ~SEQ_TAG_MASK) >> 56 != 0 || (handle & SEQ_TAG_MASK) != st->tag)
        return NULL;
    s = st->v[idx];
    if (s->gen != gen || !(gen & 1) || s->owner != owner)
        return NULL;
    return s;
}

struct seq *seq_table_peek(const struct seq_table *st, uint64_t handle)
{
    uint32_t idx = (uint32_t)handle, gen = (uint32_t)(handle >> 32) & SEQ_GEN_MASK;

    if (idx >= st->n || (handle & ~SEQ_TAG_MASK) >> 56 != 0 || (handle & SEQ_TAG_MASK) != st->tag ||
        st->v[idx]->gen != gen || !(gen & 1))
        return NULL;
    return st->v[idx];
}

void seq_table_del(struct seq_table *st, struct seq *s)
{
    uint32_t idx = s->idx;

    s->gen = (s->gen + 1) & SEQ_GEN_MASK; /* even: closed; the old handle no longer matches */
    s->n_tokens = s->n_committed = s->n_blocks = 0;
    st->free[st->n_free++] = idx;
    st->n_open--;
}

static int seq_grow(void **p, size_t *cap, size_t want, size_t elem)
{
    size_t c = *cap ? *cap : 8;
    void *q;

    if (want <= *cap)
        return 0;
    while (c < want)
        c *= 2;
    q = fault_realloc(*p, c * elem);
    if (!q)
        return KVD_ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

int seq_reserve_blocks(struct seq *s, size_t n)
{
    return seq_grow((void **)&s->blocks, &s->cap_blocks, n, sizeof(uint32_t));
}

int seq_reserve_tokens(struct seq *s, size_t n)
{
    return seq_grow((void **)&s->tokens, &s->cap_tokens, n, sizeof(uint32_t));
}
