/* ops: the op table (name → handler) and the store-mode generate/cancel.
 * Tables are tiny (tens of ops), so lookup is a linear scan. */
#include "ops.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/protocol.h"

/* A printable, bounded copy of client text for an error message. */
static void safe_copy(char *dst, size_t cap, const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len && n + 4 < cap; i++)
        dst[n++] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (len > n && n + 4 >= cap) {
        memcpy(dst + n, "...", 3);
        n += 3;
    }
    dst[n] = '\0';
}

int ops_resolve(const struct ops_table *t, const msgpack_object *root, bool admin, unsigned uid,
                uint64_t *id, const struct ops_entry **ent, struct kvd_error *e)
{
    const char *op;
    size_t oplen;
    int rc;
    *id = 0;
    *ent = NULL;
    const msgpack_object *ido = proto_map_find(root, "id");
    if (!ido || ido->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return kvd_error_set(e, KVD_EBADREQ, "'id' must be an unsigned integer");
    *id = ido->via.u64;
    if ((rc = proto_get_str(root, "op", &op, &oplen, e)))
        return rc;
    if (!(*ent = ops_table_find(t, op, oplen))) {
        char name[48];
        safe_copy(name, sizeof(name), op, oplen);
        return kvd_error_set(e, KVD_EUNKNOWN_OP, "unknown op '%s'", name);
    }
    if (((*ent)->flags & OPS_ADMIN) && !admin) {
        rc = kvd_error_set(e, KVD_EPERM, "%s needs an admin uid (uid %u is not one)", (*ent)->name,
                           uid);
        *ent = NULL;
        return rc;
    }
    return 0;
}

/* ops_run zeroes an ops_ctx only up to err: err must stay its last member. */
_Static_assert(sizeof(struct ops_ctx) - offsetof(struct ops_ctx, err) <
                   sizeof(struct kvd_error) + _Alignof(struct ops_ctx),
               "struct ops_ctx: err must be the last member");

int ops_run(const struct ops_host *host, const struct ops_entry *ent, const struct ops_caller *who,
            uint64_t id, const msgpack_object *req, msgpack_sbuffer *sb, uint32_t *units)
{
    size_t mark = sb->size;
    msgpack_packer pk;
    int rc;
    /* Everything before err zeroed, then err emptied without clearing its
     * message: a designated initializer would zero all of it per request
     * (a rep stos that was ~5 % of the server's time on small ops). */
    struct ops_ctx ctx;
    memset(&ctx, 0, offsetof(struct ops_ctx, err));
    ctx.host = host;
    ctx.srv = host->srv;
    ctx.conn = who->conn;
    ctx.mm = host->mm;
    ctx.op_ctx = ent->ctx;
    ctx.conn_id = who->conn_id;
    ctx.id = id;
    ctx.req = req;
    ctx.uid = who->uid;
    ctx.gid = who->gid;
    ctx.pid = who->pid;
    ctx.tenant = who->tenant;
    ctx.ns = who->ns;
    ctx.tenant_name = who->tenant_name;
    ctx.admin = who->admin;
    ctx.resumed = who->resumed;
    ctx.ent = ent;
    ctx.out = sb;
    ctx.pk = &pk;
    ctx.err.code = 0;
    ctx.err.message[0] = '\0';
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX) {
        rc = kvd_error_set(&ctx.err, KVD_ENOMEM, "out of memory for the reply");
    } else {
        rc = 0;
        if (ent->flags & OPS_POOL)
            rc = ops_select_pool(&ctx, ent->flags & OPS_LOADED);
        if (rc == 0)
            rc = ent->fn(&ctx);
        if (rc == 0)
            rc = proto_frame_end(sb, at);
        if (rc == KVD_ETOOLARGE && !ctx.err.message[0])
            kvd_error_set(&ctx.err, KVD_ETOOLARGE, "reply too large");
        if (rc != 0)
            sb->size = at; /* drop the partial reply */
    }
    if (rc == OPS_PENDING && units)
        *units = ctx.pending_units ? ctx.pending_units : 1;
    if (rc == 0 || rc == OPS_PENDING)
        return rc;
    if (!ctx.err.message[0])
        kvd_error_set(&ctx.err, rc, "%s failed", ent->name);
    if (proto_frame_error(sb, id, rc, ctx.err.message) != 0)
        sb->size = mark;
    return rc;
}

int ops_table_set(struct ops_table *t, const char *name, ops_fn fn, void *ctx, unsigned flags)
{
    if (strlen(name) >= sizeof(t->v[0].name))
        return KVD_EBADREQ;
    for (size_t i = 0; i < t->n; i++)
        if (!strcmp(t->v[i].name, name)) {
            t->v[i].fn = fn;
            t->v[i].ctx = ctx;
            t->v[i].flags = flags;
            return 0;
        }
    struct ops_entry *nv = realloc(t->v, (t->n + 1) * sizeof(*nv));
    if (!nv)
        return KVD_ENOMEM;
    t->v = nv;
    strcpy(nv[t->n].name, name);
    nv[t->n].len = strlen(name);
    nv[t->n].fn = fn;
    nv[t->n].ctx = ctx;
    nv[t->n].flags = flags;
    t->n++;
    return 0;
}

const struct ops_entry *ops_table_find(const struct ops_table *t, const char *name, size_t len)
{
    /* Length, then the last byte inline (most names start with "seq_"),
     * before a memcmp call: one per request showed as ~4 % of the server's
     * time on small ops. */
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i].len == len && (len == 0 || t->v[i].name[len - 1] == name[len - 1]) &&
            !memcmp(t->v[i].name, name, len))
            return &t->v[i];
    return NULL;
}

void ops_table_free(struct ops_table *t)
{
    free(t->v);
    t->v = NULL;
    t->n = 0;
}

int ops_register_builtin(struct ops_table *t)
{
    static const struct {
        const char *name;
        ops_fn fn;
        unsigned flags;
    } builtin[] = {
        {KVD_OP_HELLO, ops_hello, 0},
        {KVD_OP_STATS, ops_stats, 0},
        {KVD_OP_SEQ_OPEN, ops_seq_open, OPS_POOL | OPS_LOADED},
        {KVD_OP_SEQ_MATCH, ops_seq_match, OPS_POOL},
        {KVD_OP_SEQ_EXTEND, ops_seq_extend, OPS_POOL},
        {KVD_OP_KV_WRITE, ops_kv_write, OPS_POOL},
        {KVD_OP_KV_READ, ops_kv_read, OPS_POOL},
        {KVD_OP_SEQ_COMMIT, ops_seq_commit, OPS_POOL},
        {KVD_OP_SEQ_FORK, ops_seq_fork, OPS_POOL},
        {KVD_OP_SEQ_INFO, ops_seq_info, OPS_POOL},
        {KVD_OP_SEQ_OFFLOAD, ops_seq_offload, OPS_POOL},
        {KVD_OP_SEQ_RESTORE, ops_seq_restore, OPS_POOL},
        {KVD_OP_SEQ_CLOSE, ops_seq_close, OPS_POOL},
        {KVD_OP_KV_EXPORT, ops_kv_export, OPS_POOL},
        {KVD_OP_KV_EXPORT_RELEASE, ops_kv_export_release, OPS_POOL},
        {KVD_OP_GENERATE, ops_generate_store, 0},
        {KVD_OP_CANCEL, ops_cancel_store, 0},
        {KVD_OP_ADMIN_EVICT, ops_admin_evict, OPS_ADMIN | OPS_POOL},
        {KVD_OP_ADMIN_CHECK, ops_admin_check, OPS_ADMIN},
        {KVD_OP_ADMIN_SHUTDOWN, ops_admin_shutdown, OPS_ADMIN},
    };
    for (size_t i = 0; i < sizeof(builtin) / sizeof(builtin[0]); i++) {
        int rc = ops_table_set(t, builtin[i].name, builtin[i].fn, NULL, builtin[i].flags);
        if (rc)
            return rc;
    }
    return 0;
}

int ops_generate_store(struct ops_ctx *c)
{
    return kvd_error_set(&c->err, KVD_EUNSUPPORTED, "no model loaded (store mode)");
}

int ops_cancel_store(struct ops_ctx *c)
{
    uint64_t target;
    int rc = proto_get_uint(c->req, "target", &target, &c->err);
    if (rc)
        return rc;
    return kvd_error_set(&c->err, KVD_ENOTFOUND, "no request %llu in flight on this connection",
                         (unsigned long long)target);
}
