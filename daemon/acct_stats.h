/* acct_stats: packs the accounting and roofline parts of the `stats` reply
 * (docs/operations.md lists every field). Callers hold the kvmm lock only
 * for the kvmm numbers they pass in; acct and roofline lock themselves. */
#ifndef KVD_ACCT_STATS_H
#define KVD_ACCT_STATS_H

#include <stdint.h>

#include <msgpack.h>

#include "acct.h"
#include "kvmm.h"
#include "roofline.h"

/* Pairs acct_stats_pack_tenant adds to a tenant's map (acct may be NULL:
 * zeros), and pairs acct_stats_pack_top adds to the reply ("requests",
 * "roofline"; roofline nil when rl is NULL). Return 0 or KVD_ENOMEM. */
#define ACCT_STATS_TENANT_PAIRS 11
#define ACCT_STATS_TOP_PAIRS 2
int acct_stats_pack_tenant(msgpack_packer *pk, struct acct *a, uint32_t tenant,
                           const struct kvmm_tenant_stats *ts);
int acct_stats_pack_top(msgpack_packer *pk, struct acct *a, struct roofline *rl);

#endif
