/* fuzz_env: the socket-less dispatcher and the memory manager the fuzz
 * targets drive (see fuzz_env.h). The dispatch mirrors conn.c's so the
 * handlers see exactly what they see in the daemon. */
#include "fuzz_env.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "kvd/protocol.h"
#include "log.h"
#include "server_impl.h"

_Noreturn void fuzz_fail(const char *file, int line, const char *what)
{
    fprintf(stderr, "fuzz oracle failed at %s:%d: %s\n", file, line, what);
    abort();
}

/* The op table is built once: it is immutable. admin_shutdown would signal a
 * server loop that does not exist here, so it is left out (unknown_op). */
static struct ops_table op_table;

static const char fuzz_conf[] = "[tenant:a]\nuids = 1001\nnamespaces = pub\n"
                                "[tenant:b]\nuids = 1002\nmax-device-blocks = 12\n"
                                "max-host-blocks = 4\nmax-seqs = 4\nnamespaces = pub\n";

static int load_config(struct config *cfg)
{
    char path[] = "/tmp/kvd-fuzz-conf-XXXXXX";
    char err[256];
    int fd = mkstemp(path);
    if (fd < 0)
        return -1;
    int rc = write(fd, fuzz_conf, sizeof(fuzz_conf) - 1) == (ssize_t)(sizeof(fuzz_conf) - 1) ? 0 : -1;
    close(fd);
    if (rc == 0 && config_defaults(cfg) == 0) {
        struct config loaded;
        memset(&loaded, 0, sizeof(loaded));
        rc = config_load(path, &loaded, NULL, err, sizeof(err));
        if (rc == 0) {
            config_free(cfg);
            *cfg = loaded;
        } else {
            fprintf(stderr, "fuzz: config: %s\n", err);
        }
    }
    unlink(path);
    return rc;
}

/* A fresh memory manager with the three connections' tenants, so every
 * input starts from the same state (handles, clocks, counters). */
static int mm_setup(struct fuzz_env *e)
{
    static const uid_t uids[FUZZ_CONNS] = {1001, 1001, 1002};
    struct kvmm_config mc = {
        .geom = {.layers = 2, .kv_heads = 1, .head_dim = 4, .dtype = KV_F16, .block_tokens = 4},
        .n_device_blocks = 24,
        .n_host_blocks = 8,
        .be = e->be,
    };
    if (kvmm_new(&mc, &e->mm))
        return -1;
    e->srv->mm = e->mm;
    free(e->srv->tenants);
    e->srv->tenants = NULL;
    e->srv->n_tenants = 0;
    for (int i = 0; i < FUZZ_CONNS; i++) {
        struct config_identity ident;
        char nsname[KVD_MAX_NAME + 16];
        struct fuzz_conn *c = &e->conn[i];
        if (config_resolve(&e->srv->cfg, uids[i], uids[i], &ident))
            return -1;
        c->id = (uint64_t)i + 1;
        c->admin = i == 0; /* conn 0 may run admin_check / admin_evict */
        snprintf(c->tenant_name, sizeof(c->tenant_name), "%s", ident.conf.name);
        snprintf(nsname, sizeof(nsname), "tenant:%s", ident.conf.name);
        kvmm_lock(e->mm);
        int rc = kvmm_tenant_set(e->mm, &ident.conf, &c->tenant);
        if (!rc)
            rc = kvmm_namespace(e->mm, nsname, &c->ns);
        kvmm_unlock(e->mm);
        if (rc || server_tenant_note(e->srv, ident.conf.name, c->tenant))
            return -1;
    }
    return 0;
}

int fuzz_env_new(struct fuzz_env *e)
{
    memset(e, 0, sizeof(*e));
    msgpack_sbuffer_init(&e->out);
    log_set_level(LOG_LVL_ERR); /* admin ops log at info: noise, and slow */
    if (op_table.n == 0) {
        if (ops_register_builtin(&op_table))
            return -1;
        for (size_t i = 0; i < op_table.n; i++)
            if (!strcmp(op_table.v[i].name, KVD_OP_ADMIN_SHUTDOWN))
                op_table.v[i].name[0] = '\0';
    }
    if (backend_cpu_new(&e->be))
        goto fail;
    e->srv = calloc(1, sizeof(*e->srv));
    if (!e->srv || load_config(&e->srv->cfg))
        goto fail;
    e->srv->be = e->be;
    e->srv->ops = op_table;
    options_defaults(&e->srv->opts);
    e->srv->opts.max_frame = 1u << 16; /* so kv_read's too_large path is reachable */
    if (mm_setup(e))
        goto fail;
    return 0;
fail:
    fuzz_env_free(e);
    return -1;
}

int fuzz_env_reset(struct fuzz_env *e)
{
    if (e->mm)
        kvmm_free(e->mm);
    e->mm = NULL;
    e->out.size = 0;
    return mm_setup(e);
}

void fuzz_env_free(struct fuzz_env *e)
{
    if (e->srv) {
        config_free(&e->srv->cfg);
        free(e->srv->tenants);
        free(e->srv);
    }
    if (e->mm)
        kvmm_free(e->mm);
    if (e->be)
        backend_free(e->be);
    msgpack_sbuffer_destroy(&e->out);
    memset(e, 0, sizeof(*e));
}

/* The reply frame at out[at..]: one whole frame, a map with the id, a
 * boolean ok, and a known code on errors. Returns the code. */
static int check_reply(const struct fuzz_env *e, size_t at, uint64_t want_id)
{
    size_t n = 0;
    FUZZ_ASSERT(e->out.size > at);
    FUZZ_ASSERT(proto_frame_peek(e->out.data + at, e->out.size - at, UINT32_MAX, &n) ==
                PROTO_FRAME_READY);
    FUZZ_ASSERT(at + 4 + n == e->out.size); /* exactly one frame */
    struct proto_msg m;
    struct proto_err err = {0};
    FUZZ_ASSERT(proto_msg_parse(&m, e->out.data + at + 4, n, &err) == 0);
    const msgpack_object *id = proto_map_find(m.root, "id");
    FUZZ_ASSERT(id && id->type == MSGPACK_OBJECT_POSITIVE_INTEGER && id->via.u64 == want_id);
    int code = proto_reply_status(m.root, &err);
    FUZZ_ASSERT(code >= 0 && code < KVD_EIO);
    if (code)
        FUZZ_ASSERT(err.message[0] != '\0'); /* every error says why */
    proto_msg_free(&m);
    return code;
}

bool fuzz_dispatch(struct fuzz_env *e, int conn, const uint8_t *payload, size_t len, int *code)
{
    struct fuzz_conn *fc = &e->conn[conn];
    struct proto_msg m;
    struct proto_err pe = {0};
    msgpack_sbuffer *sb = &e->out;
    msgpack_packer pk;
    size_t start = sb->size;
    uint64_t id = 0;
    int rc;

    if (proto_msg_parse(&m, payload, len, &pe) != 0) {
        FUZZ_ASSERT(pe.code == KVD_EBADREQ || pe.code == KVD_ETOOLARGE);
        FUZZ_ASSERT(proto_frame_error(sb, 0, pe.code, pe.message) == 0);
        rc = check_reply(e, start, 0);
        if (code)
            *code = rc;
        return false;
    }
    const msgpack_object *ido = proto_map_find(m.root, "id");
    const char *op;
    size_t oplen;
    const struct ops_entry *ent = NULL;
    if (!ido || ido->type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
        rc = proto_err_set(&pe, KVD_EBADREQ, "'id' must be an unsigned integer");
    } else {
        id = ido->via.u64;
        rc = proto_get_str(m.root, "op", &op, &oplen, &pe);
        if (!rc && oplen > 0 && !(ent = ops_table_find(&e->srv->ops, op, oplen)))
            rc = proto_err_set(&pe, KVD_EUNKNOWN_OP, "unknown op");
        else if (!rc && oplen == 0)
            rc = proto_err_set(&pe, KVD_EUNKNOWN_OP, "unknown op ''");
        if (!rc && (ent->flags & OPS_ADMIN) && !fc->admin)
            rc = proto_err_set(&pe, KVD_EPERM, "needs an admin uid");
    }
    if (rc) {
        FUZZ_ASSERT(proto_frame_error(sb, id, rc, pe.message) == 0);
    } else {
        struct ops_ctx ctx = {
            .srv = e->srv, .conn = NULL, .mm = e->mm, .op_ctx = ent->ctx,
            .conn_id = fc->id, .id = id, .req = m.root,
            .uid = 0, .gid = 0, .pid = 0,
            .tenant = fc->tenant, .ns = fc->ns, .tenant_name = fc->tenant_name,
            .admin = fc->admin, .out = sb, .pk = &pk,
        };
        msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
        size_t at = proto_frame_begin(sb);
        FUZZ_ASSERT(at != SIZE_MAX);
        rc = ent->fn(&ctx);
        FUZZ_ASSERT(rc != OPS_PENDING); /* store mode: nothing leaves the loop */
        if (rc == 0)
            rc = proto_frame_end(sb, at);
        if (rc != 0) {
            FUZZ_ASSERT(rc > 0 && rc < KVD_EIO);
            sb->size = at;
            if (!ctx.err.message[0])
                proto_err_set(&ctx.err, rc, "%s failed", ent->name);
            FUZZ_ASSERT(proto_frame_error(sb, id, rc, ctx.err.message) == 0);
        }
    }
    proto_msg_free(&m);
    rc = check_reply(e, start, id);
    if (code)
        *code = rc;
    return true;
}

size_t fuzz_stream(struct fuzz_env *e, int conn, const uint8_t *data, size_t size)
{
    size_t off = 0, answered = 0;
    while (off < size) {
        size_t n = 0;
        e->out.size = 0;
        enum proto_frame_status st =
            proto_frame_peek(data + off, size - off, e->srv->opts.max_frame, &n);
        if (st == PROTO_FRAME_NEED_MORE) /* a truncated last frame: the EOF path */
            break;
        if (st == PROTO_FRAME_EMPTY || st == PROTO_FRAME_TOO_LARGE) {
            FUZZ_ASSERT(st == PROTO_FRAME_EMPTY ? n == 0 : n > e->srv->opts.max_frame);
            break; /* the server answers and closes */
        }
        FUZZ_ASSERT(n <= size - off - 4);
        bool keep = fuzz_dispatch(e, conn, data + off + 4, n, NULL);
        answered++;
        off += 4 + n;
        if (!keep)
            break;
    }
    e->out.size = 0;
    return answered;
}

void fuzz_check_mm(struct fuzz_env *e)
{
    kvmm_lock(e->mm);
    int rc = kvmm_check(e->mm);
    if (rc)
        fprintf(stderr, "kvmm_check: %s\n", kvmm_errmsg(e->mm));
    kvmm_unlock(e->mm);
    FUZZ_ASSERT(rc == 0);
}

void fuzz_close_all(struct fuzz_env *e)
{
    struct kvmm_stats st;
    kvmm_lock(e->mm);
    for (int i = 0; i < FUZZ_CONNS; i++)
        kvmm_close_owner(e->mm, e->conn[i].id);
    kvmm_stats(e->mm, &st);
    kvmm_unlock(e->mm);
    FUZZ_ASSERT(st.n_seqs == 0);
    FUZZ_ASSERT(st.device_used == 0);
    FUZZ_ASSERT(st.host_used == 0);
    fuzz_check_mm(e);
}
