/* seq: the sequence table. A sequence is a block table (logical block ids,
 * one per block_tokens token slots), the token ids committed so far, its
 * tenant, namespace and owner. Handles are index + generation, so a closed
 * handle never finds the sequence that reuses its entry. This module only
 * stores; kvmm_seq.c implements the operations. Covered by the kvmm lock. */
#ifndef KVD_SEQ_H
#define KVD_SEQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct seq {
    uint64_t owner; /* connection id or executor request id */
    uint32_t gen;   /* handle generation; odd while open */
    uint32_t idx;   /* entry index in the table */
    uint32_t tenant, ns;
    size_t n_tokens;    /* token slots */
    size_t n_committed; /* leading slots whose token ids are known */
    uint32_t *blocks;   /* (cap_blocks) owned; n_blocks = ceil(n_tokens / block_tokens) */
    size_t n_blocks, cap_blocks;
    uint32_t *tokens; /* (cap_tokens) owned; committed token ids */
    size_t cap_tokens;
    /* Lent to a generate request (kvmm_seq_lend): `lender` (the connection)
     * gets busy instead of not_found; lend_tag is the request's id. */
    bool lent;
    uint64_t lender, lend_tag;
};

/* A handle: bits 0-31 the entry's index, 32-55 its generation (wrapping
 * at 2^24), 56-62 the table's tag (kvmm_config.handle_tag: which model's
 * memory manager made it), bit 63 clear. */
#define SEQ_GEN_MASK 0xffffffu
#define SEQ_TAG_SHIFT 56
#define SEQ_TAG_MASK (UINT64_C(0x7f) << SEQ_TAG_SHIFT)

struct seq_table {
    uint64_t tag;   /* already shifted: tag << SEQ_TAG_SHIFT */
    struct seq **v; /* (n) owned entries; pointers stay valid while open */
    uint32_t n;
    uint32_t *free, n_free; /* (n) stack of closed entry indexes */
    uint32_t n_open;
};

void seq_table_free(struct seq_table *st);
/* A fresh open entry (owner set, everything else zero) and its handle. */
int seq_table_add(struct seq_table *st, uint64_t owner, uint64_t *handle, struct seq **out);
/* The open sequence `handle` if `owner` owns it, else NULL. */
struct seq *seq_table_get(const struct seq_table *st, uint64_t handle, uint64_t owner);
/* The open sequence `handle` whoever owns it, else NULL. */
struct seq *seq_table_peek(const struct seq_table *st, uint64_t handle);
/* Closes the entry (its arrays are kept for reuse; blocks must be released). */
void seq_table_del(struct seq_table *st, struct seq *s);
static inline uint64_t seq_handle(const struct seq_table *st, uint32_t idx)
{
    return st->tag | ((uint64_t)st->v[idx]->gen << 32) | idx;
}

int seq_reserve_blocks(struct seq *s, size_t n);
int seq_reserve_tokens(struct seq *s, size_t n);

#endif
