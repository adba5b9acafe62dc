/* stats_snap: the stats reading (see stats_snap.h). */
#include "stats_snap.h"

#include <stdlib.h>
#include <string.h>

#include "fault.h"

int stats_snap_fill(struct stats_snap *s, struct kvmm *mm, struct acct *acct, const uint32_t *only,
                    uint32_t from, size_t max)
{
    int rc = 0;
    memset(s, 0, sizeof(*s));
    kvmm_lock(mm);
    kvmm_stats(mm, &s->st);
    uint32_t n_ids = s->st.n_tenants; /* slots: removed tenants' ids among them */
    size_t cap = only ? 1 : (max < n_ids ? max : n_ids);
    if (cap && !(s->t = fault_calloc(cap, sizeof(*s->t)))) {
        rc = KVD_ENOMEM;
        goto out;
    }
    struct kvmm_tenant_stats ts;
    if (only) {
        if ((rc = kvmm_tenant_stats(mm, *only, &ts)) != 0)
            goto out;
        s->t[0].id = *only;
        s->t[0].ts = ts;
        s->n = 1;
    }
    for (uint32_t id = 0; id < n_ids; id++) {
        uint32_t ns;
        /* O(1): whether the slot holds a live tenant (not a removed one). */
        if (kvmm_tenant_namespace(mm, id, &ns) != 0)
            continue;
        s->n_live++;
        if (only || id < from)
            continue;
        if (s->n == cap) {
            if (!s->more) {
                s->more = true;
                s->next = id;
            }
            continue;
        }
        if ((rc = kvmm_tenant_stats(mm, id, &ts)) != 0)
            goto out;
        s->t[s->n].id = id;
        s->t[s->n].ts = ts;
        s->n++;
    }
    if (acct) /* acct's mutex under kvmm's lock, as stats always took it */
        for (size_t i = 0; i < s->n; i++)
            acct_tenant_get(acct, s->t[i].id, &s->t[i].at);
out:
    kvmm_unlock(mm);
    kvmm_disk_stats(mm, &s->disk); /* locks for itself: its own, consistent reading */
    kvmm_remote_stats(mm, &s->remote);
    if (rc)
        stats_snap_free(s);
    return rc;
}

void stats_snap_free(struct stats_snap *s)
{
    free(s->t);
    s->t = NULL;
    s->n = 0;
}
