/* tenant: the tenant table (identity, limits, usage counters) and the table
 * of namespace names. Limits are enforced by kvmm; this module only keeps the
 * numbers. Not thread-safe: the kvmm lock covers it. */
#ifndef KVD_TENANT_H
#define KVD_TENANT_H

#include <stdbool.h>
#include <stdint.h>

#include "kvmm.h"

struct tenant {
    struct kvmm_tenant_conf conf;
    uint32_t ns;                      /* default namespace "tenant:<name>" */
    uint32_t dev_blocks, host_blocks; /* blocks owned, by tier */
    uint32_t seqs;                    /* open sequences */
    uint64_t match_asked, match_hit, swaps_out, swaps_in, evictions;
};

struct tenant_table {
    struct tenant *v; /* (n) owned */
    uint32_t n;
    char (*ns_names)[80]; /* (n_ns) owned, index = namespace id */
    uint32_t n_ns;
    /* Slots of removed tenants / namespaces (name ""), reused first so the
     * tables stay as large as the most ever live at once. */
    uint32_t *free_t, n_free_t, cap_free_t;
    uint32_t *free_ns, n_free_ns, cap_free_ns;
};

void tenant_table_free(struct tenant_table *tt);
/* Index of the tenant / namespace with this name, or UINT32_MAX. */
uint32_t tenant_find(const struct tenant_table *tt, const char *name);
uint32_t tenant_ns_find(const struct tenant_table *tt, const char *name);
/* Adds a tenant (counters zero) / a namespace name, in a removed one's slot
 * when there is one; 0 or KVD_ENOMEM. *reused tells whether the slot was a
 * removed one (NULL: not asked). */
int tenant_add(struct tenant_table *tt, const struct kvmm_tenant_conf *conf, uint32_t *id);
/* The same at slot id, which must be free (removed, or past the table:
 * the slots between become removed ones). 0, KVD_EBUSY (a live tenant
 * is there) or KVD_ENOMEM. */
int tenant_add_at(struct tenant_table *tt, const struct kvmm_tenant_conf *conf, uint32_t id);
int tenant_ns_add(struct tenant_table *tt, const char *name, uint32_t *id, bool *reused);
/* Empties slot id (its name becomes "") and keeps it for reuse; 0 or
 * KVD_ENOMEM (the slot then stays as it was). */
int tenant_remove(struct tenant_table *tt, uint32_t id);
int tenant_ns_remove(struct tenant_table *tt, uint32_t id);
/* Whether tenant id is a live one (not past the table, not removed). */
static inline bool tenant_live(const struct tenant_table *tt, uint32_t id)
{
    return id < tt->n && tt->v[id].conf.name[0] != '\0';
}

#endif
