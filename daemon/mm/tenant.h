/* tenant: the tenant table (identity, limits, usage counters) and the table
 * of namespace names. Limits are enforced by kvmm; this module only keeps the
 * numbers. Not thread-safe: the kvmm lock covers it. */
#ifndef KVD_TENANT_H
#define KVD_TENANT_H

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
};

void tenant_table_free(struct tenant_table *tt);
/* Index of the tenant / namespace with this name, or UINT32_MAX. */
uint32_t tenant_find(const struct tenant_table *tt, const char *name);
uint32_t tenant_ns_find(const struct tenant_table *tt, const char *name);
/* Appends a tenant (counters zero) / a namespace name; 0 or KVD_ENOMEM. */
int tenant_add(struct tenant_table *tt, const struct kvmm_tenant_conf *conf, uint32_t *id);
int tenant_ns_add(struct tenant_table *tt, const char *name, uint32_t *id);

#endif
