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

/* Pairs packed into maps whose sizes are counted when they end
 * (proto_map_begin/end, so the packer must be a direct one): the
 * accounting pairs of a tenant's map (its counters as acct_tenant_get
 * read them, and its kvmm numbers), and the
 * reply's "requests" and "roofline" (nil when rl is NULL). Return 0,
 * KVD_ENOMEM, or KVD_EINTERNAL (a malformed map). */
int acct_stats_pack_tenant(msgpack_packer *pk, const struct acct_tenant *at,
                           const struct kvmm_tenant_stats *ts);
int acct_stats_pack_top(msgpack_packer *pk, struct acct *a, struct roofline *rl);
/* The "speculative" key and its map (the reply's requests', or one
 * model's in stats "models"). */
int acct_stats_pack_spec(msgpack_packer *pk, const struct acct_spec *s);

#endif
