/* ops_admin: operator ops, registered with OPS_ADMIN so only admin uids
 * reach them: evict cached blocks, check the memory manager's invariants,
 * shut the daemon down (same drain as SIGTERM). */
#include <string.h>

#include "log.h"
#include "models.h"
#include "ops.h"

int ops_admin_evict(struct ops_ctx *c)
{
    const char *tier_s = "device";
    size_t tier_len = 6;
    uint64_t n = UINT32_MAX;
    size_t evicted = 0;
    int rc = proto_opt_str(c->req, "tier", &tier_s, &tier_len, NULL, &c->err);
    if (!rc)
        rc = proto_opt_uint(c->req, "n", &n, NULL, &c->err);
    if (rc)
        return rc;
    if (tier_len == 3 && !memcmp(tier_s, "all", 3)) {
        /* Every prefix tree emptied (running sequences keep their blocks):
         * routers following the KV events get AllBlocksCleared. */
        kvmm_lock(c->mm);
        kvmm_clear(c->mm, &evicted);
        kvmm_unlock(c->mm);
        log_info("admin uid %u: cleared the prefix cache (%zu blocks)", (unsigned)c->uid, evicted);
        rc = proto_reply_begin(c->pk, c->id, 1);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "evicted", evicted);
        return rc;
    }
    int tier = proto_tier_from_name(tier_s, tier_len);
    if (tier < 0)
        return kvd_error_set(&c->err, KVD_EBADREQ,
                             "'tier' must be \"device\", \"host\" or \"all\"");
    if (n > UINT32_MAX)
        n = UINT32_MAX;
    kvmm_lock(c->mm);
    rc = kvmm_evict(c->mm, (enum kvd_tier)tier, (size_t)n, &evicted);
    if (rc)
        rc = kvd_error_set(&c->err, rc, "%s", kvmm_errmsg(c->mm));
    kvmm_unlock(c->mm);
    if (rc)
        return rc;
    log_info("admin uid %u: evicted %zu %s blocks", (unsigned)c->uid, evicted,
             tier ? "host" : "device");
    rc = proto_reply_begin(c->pk, c->id, 1);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "evicted", evicted);
    return rc;
}

int ops_admin_check(struct ops_ctx *c)
{
    int rc = 0;
    size_t n = c->host->models ? models_count(c->host->models) : 1;
    /* every model's memory manager */
    for (size_t i = 0; i < n && !rc; i++) {
        struct kvmm *mm = c->host->models ? models_kvmm(models_at(c->host->models, i)) : c->mm;
        kvmm_lock(mm);
        rc = kvmm_check(mm);
        if (rc && n > 1)
            kvd_error_set(&c->err, rc, "invariant violated (model %s): %s",
                          models_name(models_at(c->host->models, i)), kvmm_errmsg(mm));
        else if (rc)
            kvd_error_set(&c->err, rc, "invariant violated: %s", kvmm_errmsg(mm));
        kvmm_unlock(mm);
    }
    if (rc) {
        log_err("admin_check: %s", c->err.message);
        return rc;
    }
    return proto_reply_begin(c->pk, c->id, 0);
}

int ops_admin_shutdown(struct ops_ctx *c)
{
    if (!c->host->shutdown)
        return kvd_error_set(&c->err, KVD_EUNSUPPORTED, "this server cannot be shut down");
    log_notice("admin uid %u (pid %d) asked for shutdown", (unsigned)c->uid, (int)c->pid);
    /* Deferred through the loop, so this reply is queued first. */
    c->host->shutdown(c->host->ctx);
    return proto_reply_begin(c->pk, c->id, 0);
}
