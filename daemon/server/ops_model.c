/* ops_model: the ops' side of several models. A request names its model
 * (`model`), or its sequence does (the handle's tag); the op then runs on
 * that model's memory manager. A request for a model that is not loaded
 * waits for the load (ops_defer): its message is kept, and it runs again,
 * as it came, once the model is loaded. */
#include <stdlib.h>
#include <string.h>

#include "models.h"
#include "ops.h"
#include "server.h"

int ops_pick_model(struct ops_ctx *c, struct models_entry **out)
{
    const char *name = NULL;
    size_t len = 0;
    *out = NULL;
    const msgpack_object *o = proto_map_find(c->req, "model");
    if (o && o->type != MSGPACK_OBJECT_NIL) {
        int rc = proto_get_str(c->req, "model", &name, &len, &c->err);
        if (rc)
            return rc;
    }
    if (!c->host->models) {
        if (name)
            return kvd_error_set(&c->err, KVD_ENOTFOUND,
                                 "no model '%.*s': kvd runs in store mode (no model)",
                                 (int)(len > 128 ? 128 : len), name);
        return 0;
    }
    return models_resolve(c->host->models, name, len, name != NULL, true, c->tenant_name, out,
                          &c->err);
}

int ops_use_model(struct ops_ctx *c, struct models_entry *e)
{
    if (!e)
        return 0;
    c->mm = models_kvmm(e);
    kvmm_lock(c->mm);
    int rc = kvmm_tenant_namespace(c->mm, c->tenant, &c->ns);
    if (rc)
        kvd_error_set(&c->err, rc, "tenant %s: %s", c->tenant_name, kvmm_errmsg(c->mm));
    kvmm_unlock(c->mm);
    return rc;
}

int ops_pick_pool(struct ops_ctx *c, const char *key)
{
    if (!c->host->models)
        return 0;
    const msgpack_object *o = proto_map_find(c->req, key);
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return 0; /* the handler names the missing or bad argument */
    struct models_entry *e = models_of_handle(c->host->models, o->via.u64);
    if (!e)
        return kvd_error_set(&c->err, KVD_ENOTFOUND, "no sequence %llu",
                             (unsigned long long)o->via.u64);
    return ops_use_model(c, e);
}

int ops_select_pool(struct ops_ctx *c, bool need_loaded)
{
    struct models_entry *e = NULL;
    if (!c->host->models)
        return 0;
    const msgpack_object *o = proto_map_find(c->req, "seq");
    int rc;
    if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        e = models_of_handle(c->host->models, o->via.u64);
        if (!e)
            return kvd_error_set(&c->err, KVD_ENOTFOUND, "no sequence %llu",
                                 (unsigned long long)o->via.u64);
    } else if ((rc = ops_pick_model(c, &e))) {
        return rc;
    }
    if (need_loaded && models_state(e) != MODELS_LOADED)
        return ops_defer(c, e, false);
    if (need_loaded)
        models_touch(e);
    return ops_use_model(c, e);
}

/* ---- waiting for a load --------------------------------------------------- */

struct deferred {
    const struct ops_host *host;
    const struct ops_entry *ent;
    struct ops_caller who;
    char tenant_name[KVD_MAX_NAME + 1];
    uint64_t id;
    msgpack_sbuffer req; /* the request map, packed again */
};

static void post(struct deferred *d, msgpack_sbuffer *sb)
{
    if (!sb->size)
        return;
    size_t len = sb->size;
    server_post(d->host->srv, d->who.conn_id, d->id, SERVER_POST_FINAL, msgpack_sbuffer_release(sb),
                len);
}

static void deferred_ready(void *ud, int rc, const struct kvd_error *err)
{
    struct deferred *d = ud;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    if (rc == MODELS_GONE) {
        /* the connection closed: nobody to answer */
    } else if (rc) {
        if (proto_frame_error(&sb, d->id, rc, err ? err->message : "the model did not load") == 0)
            post(d, &sb);
    } else {
        msgpack_zone zone;
        msgpack_object obj;
        msgpack_zone_init(&zone, 2048);
        size_t off = 0;
        if (msgpack_unpack(d->req.data, d->req.size, &off, &zone, &obj) == MSGPACK_UNPACK_SUCCESS) {
            d->who.resumed = true;
            d->who.tenant_name = d->tenant_name;
            /* its units were counted when it was deferred */
            int r = ops_run(d->host, d->ent, &d->who, d->id, &obj, &sb, NULL);
            if (r != OPS_PENDING)
                post(d, &sb);
        } else if (proto_frame_error(&sb, d->id, KVD_EINTERNAL, "cannot read the request back") ==
                   0) {
            post(d, &sb);
        }
        msgpack_zone_destroy(&zone);
    }
    msgpack_sbuffer_destroy(&sb);
    msgpack_sbuffer_destroy(&d->req);
    free(d);
}

int ops_defer(struct ops_ctx *c, struct models_entry *e, bool admitted)
{
    if (!c->srv)
        return kvd_error_set(&c->err, KVD_EUNSUPPORTED, "model %s is not loaded", models_name(e));
    /* A waiting request counts as in flight (max-queued-per-tenant) */
    int rc;
    if (!admitted && (rc = server_queue_admit(c->srv, c->conn, c->tenant, &c->err)))
        return rc;
    struct deferred *d = calloc(1, sizeof(*d));
    if (!d)
        return kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
    d->host = c->host;
    d->ent = c->ent;
    d->who = (struct ops_caller){.conn = c->conn,
                                 .conn_id = c->conn_id,
                                 .uid = c->uid,
                                 .gid = c->gid,
                                 .pid = c->pid,
                                 .tenant = c->tenant,
                                 .ns = c->ns,
                                 .admin = c->admin};
    snprintf(d->tenant_name, sizeof d->tenant_name, "%s", c->tenant_name);
    d->id = c->id;
    msgpack_sbuffer_init(&d->req);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &d->req, msgpack_sbuffer_write);
    rc = msgpack_pack_object(&pk, *c->req) ? KVD_ENOMEM : 0;
    if (!rc)
        rc = models_wait(e, c->conn_id, deferred_ready, d, &c->err);
    else
        kvd_error_set(&c->err, rc, "out of memory");
    if (rc) {
        msgpack_sbuffer_destroy(&d->req);
        free(d);
        return rc;
    }
    return OPS_PENDING;
}

static bool deferred_is(void *ud, void *arg)
{
    const struct deferred *d = ud;
    return d->id == *(const uint64_t *)arg;
}

bool ops_defer_cancel(struct models *ms, uint64_t conn_id, uint64_t id)
{
    return models_cancel_waits(ms, conn_id, deferred_is, &id) > 0;
}
