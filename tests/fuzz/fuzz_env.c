/* fuzz_env: the socket-less dispatcher and the memory manager the fuzz
 * targets drive (see fuzz_env.h). The dispatch mirrors the server's so the
 * handlers see exactly what they see in the daemon. */
#include "fuzz_env.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "fault.h"
#include "kvd/protocol.h"
#include "kvd/status.h"
#include "log.h"

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
    struct kvd_error err;
    int fd = mkstemp(path);
    if (fd < 0)
        return -1;
    int rc =
        write(fd, fuzz_conf, sizeof(fuzz_conf) - 1) == (ssize_t)(sizeof(fuzz_conf) - 1) ? 0 : -1;
    close(fd);
    if (rc == 0 && config_defaults(cfg) == 0) {
        struct config loaded;
        memset(&loaded, 0, sizeof(loaded));
        rc = config_load(path, &loaded, NULL, &err);
        if (rc == 0) {
            config_free(cfg);
            *cfg = loaded;
        } else {
            fprintf(stderr, "fuzz: config: %s\n", err.message);
        }
    }
    unlink(path);
    return rc;
}

/* The cpu backend with heap arenas. The cpu backend maps each arena (mmap,
 * munmap and a page fault per input, ~10 % of fuzz_proto's time); here they
 * come from the heap instead, which is as zero-filled as the contract asks
 * and better for finding bugs: ASan's redzones sit right at the end of the
 * arena (a mapping is rounded up to a page, so an overrun inside that page
 * went unseen) and a use after kvmm_free is reported. The fault points are
 * the cpu backend's. Copies are the cpu backend's own. */
static int heap_arena_alloc(struct backend *be, enum kvd_tier tier, size_t bytes, void **out)
{
    (void)be;
    *out = NULL;
    if (bytes == 0)
        return KVD_EBADREQ;
    if (fault_should_fail(tier == KVD_TIER_DEVICE ? FAULT_DEVICE_ALLOC : FAULT_HOST_ALLOC))
        return KVD_ENOMEM;
    *out = aligned_alloc(64, (bytes + 63) / 64 * 64); /* blocks are 64 bytes: no slack */
    if (!*out)
        return KVD_ENOMEM;
    memset(*out, 0, bytes);
    return 0;
}

static void heap_arena_free(struct backend *be, enum kvd_tier tier, void *p, size_t bytes)
{
    (void)be;
    (void)tier;
    (void)bytes;
    free(p);
}

/* The connections' identities: resolved once, the config never changes. */
static int conns_setup(struct fuzz_env *e)
{
    static const uid_t uids[FUZZ_CONNS] = {1001, 1001, 1002};
    for (int i = 0; i < FUZZ_CONNS; i++) {
        struct config_identity ident;
        struct fuzz_conn *c = &e->conn[i];
        if (config_resolve(&e->cfg, uids[i], uids[i], &ident))
            return -1;
        c->id = (uint64_t)i + 1;
        c->uid = uids[i];
        c->admin = i == 0; /* conn 0 may run admin_check / admin_evict */
        c->tconf = ident.conf;
        snprintf(c->tenant_name, sizeof(c->tenant_name), "%s", ident.conf.name);
        snprintf(c->ns_name, sizeof(c->ns_name), "tenant:%s", ident.conf.name);
    }
    return 0;
}

/* Adds a tenant to the list stats reports, as the server does at accept. */
static int note_tenant(struct fuzz_env *e, const char *name, uint32_t id)
{
    for (size_t i = 0; i < e->n_tenants; i++)
        if (e->tenants[i].id == id)
            return 0;
    struct fuzz_tenant *nv = realloc(e->tenants, (e->n_tenants + 1) * sizeof(*nv));
    if (!nv)
        return -1;
    e->tenants = nv;
    memset(&nv[e->n_tenants], 0, sizeof(*nv));
    snprintf(nv[e->n_tenants].name, sizeof(nv->name), "%s", name);
    nv[e->n_tenants++].id = id;
    return 0;
}

/* A memory manager with the three connections' tenants, built the same way
 * for every input, so every input starts from the same state (handles,
 * clocks, counters, free lists). The server's tenant list (names for stats)
 * lives as long as the env, as it does in the daemon; the ids it holds are
 * checked to come out the same every time. */
static int mm_setup(struct fuzz_env *e)
{
    struct kvmm_config mc = {
        .geom = {.layers = 2, .kv_heads = 1, .head_dim = 4, .dtype = KV_F16, .block_tokens = 4},
        .n_device_blocks = 24,
        .n_host_blocks = 8,
        .be = e->be,
    };
    if (kvmm_new(&mc, &e->mm))
        return -1;
    e->host.mm = e->obs.mm = e->mm;
    for (int i = 0; i < FUZZ_CONNS; i++) {
        struct fuzz_conn *c = &e->conn[i];
        uint32_t tenant = 0, ns = 0;
        kvmm_lock(e->mm);
        int rc = kvmm_tenant_set(e->mm, &c->tconf, &tenant);
        if (!rc)
            rc = kvmm_namespace(e->mm, c->ns_name, &ns);
        kvmm_unlock(e->mm);
        if (rc)
            return -1;
        if (!e->tenants_noted) {
            c->tenant = tenant;
            c->ns = ns;
            if (note_tenant(e, c->tenant_name, tenant))
                return -1;
        }
        FUZZ_ASSERT(tenant == c->tenant && ns == c->ns);
    }
    e->tenants_noted = true;
    return 0;
}

static void mm_teardown(struct fuzz_env *e)
{
    if (e->mm)
        kvmm_free(e->mm);
    e->mm = e->host.mm = e->obs.mm = NULL;
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
    if (backend_cpu_new(&e->cpu))
        goto fail;
    e->arena_ops = *e->cpu->ops;
    e->arena_ops.arena_alloc = heap_arena_alloc;
    e->arena_ops.arena_free = heap_arena_free;
    /* Heap arenas cannot be handed out by descriptor: kv_export answers
     * unsupported here, as on a backend without exportable pages. */
    e->arena_ops.arena_alloc_paged = NULL;
    e->arena_ops.arena_page_fd = NULL;
    e->arena_ops.arena_page_renew = NULL;
    e->arena_be = *e->cpu;
    e->arena_be.ops = &e->arena_ops;
    e->be = &e->arena_be;
    /* The zones live as long as the env, as the server's does: a request's
     * objects are cleared after it, the first chunk is kept. */
    e->zone = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE);
    e->reply_zone = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE);
    if (!e->zone || !e->reply_zone || load_config(&e->cfg) || conns_setup(e))
        goto fail;
    e->obs = (struct server_obs){
        .backend = e->be->ops->name, .n_conns = &e->n_conns, .n_pending = &e->n_pending};
    e->host =
        (struct ops_host){.backend = e->be->ops->name,
                          .max_frame = 1u << 16, /* so kv_read's too_large path is reachable */
                          .cfg = &e->cfg,
                          .obs = &e->obs};
    return 0;
fail:
    fuzz_env_free(e);
    return -1;
}

void fuzz_env_begin(struct fuzz_env *e)
{
    mm_teardown(e);
    e->out.size = 0;
}

struct kvmm *fuzz_env_mm(struct fuzz_env *e)
{
    if (!e->mm && mm_setup(e)) {
        fprintf(stderr, "fuzz: cannot build the memory manager\n");
        abort();
    }
    return e->mm;
}

void fuzz_env_end(struct fuzz_env *e)
{
    mm_teardown(e);
    e->out.size = 0;
}

void fuzz_env_free(struct fuzz_env *e)
{
    mm_teardown(e);
    config_free(&e->cfg);
    free(e->tenants);
    if (e->zone)
        msgpack_zone_free(e->zone);
    if (e->reply_zone)
        msgpack_zone_free(e->reply_zone);
    if (e->cpu)
        backend_free(e->cpu);
    msgpack_sbuffer_destroy(&e->out);
    memset(e, 0, sizeof(*e));
}

/* The reply frame at out[at..]: one whole frame, a map with the id, a
 * boolean ok, and a known code on errors. Returns the code. */
static int check_reply(struct fuzz_env *e, size_t at, uint64_t want_id)
{
    size_t n = 0;
    FUZZ_ASSERT(e->out.size > at);
    FUZZ_ASSERT(proto_frame_peek(e->out.data + at, e->out.size - at, UINT32_MAX, &n) ==
                PROTO_FRAME_READY);
    FUZZ_ASSERT(at + 4 + n == e->out.size); /* exactly one frame */
    struct proto_msg m;
    struct kvd_error err = {0};
    FUZZ_ASSERT(fuzz_parse_reply(e, e->out.data + at + 4, n, &m) == 0);
    const msgpack_object *id = proto_map_find(m.root, "id");
    FUZZ_ASSERT(id && id->type == MSGPACK_OBJECT_POSITIVE_INTEGER && id->via.u64 == want_id);
    int code = proto_reply_status(m.root, &err);
    FUZZ_ASSERT(code >= 0 && code < KVD_EIO);
    if (code)
        FUZZ_ASSERT(err.message[0] != '\0'); /* every error says why */
    proto_msg_free(&m);
    return code;
}

int fuzz_parse_reply(struct fuzz_env *e, const void *payload, size_t len, struct proto_msg *m)
{
    return proto_msg_parse_in(m, payload, len, e->reply_zone, NULL);
}

/* The server's dispatch step by step: the request decoded into the server's
 * zone (cleared after it), the reply packed in place by a proto packer. */
bool fuzz_dispatch(struct fuzz_env *e, int conn, const uint8_t *payload, size_t len, int *code)
{
    struct fuzz_conn *fc = &e->conn[conn];
    struct proto_msg m;
    struct kvd_error pe = {0};
    msgpack_sbuffer *sb = &e->out;
    size_t start = sb->size;
    uint64_t id = 0;
    int rc;

    if (proto_msg_parse_in(&m, payload, len, e->zone, &pe) != 0) {
        FUZZ_ASSERT(pe.code == KVD_EBADREQ || pe.code == KVD_ETOOLARGE);
        FUZZ_ASSERT(proto_frame_error(sb, 0, pe.code, pe.message) == 0);
        rc = check_reply(e, start, 0);
        if (code)
            *code = rc;
        return false;
    }
    const struct ops_entry *ent;
    rc = ops_resolve(&op_table, m.root, fc->admin, (unsigned)fc->uid, &id, &ent, &pe);
    if (rc) {
        FUZZ_ASSERT(proto_frame_error(sb, id, rc, pe.message) == 0);
    } else {
        struct ops_caller who = {.conn_id = fc->id,
                                 .uid = fc->uid,
                                 .gid = fc->uid,
                                 .tenant = fc->tenant,
                                 .ns = fc->ns,
                                 .tenant_name = fc->tenant_name,
                                 .admin = fc->admin};
        /* the kvmm is built here at the first handler, as if at the start */
        fuzz_env_mm(e); /* sets host.mm */
        rc = ops_run(&e->host, ent, &who, id, m.root, sb, NULL);
        FUZZ_ASSERT(rc != OPS_PENDING); /* store mode: nothing leaves the loop */
        FUZZ_ASSERT(rc == 0 || (rc > 0 && rc < KVD_EIO));
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
            proto_frame_peek(data + off, size - off, e->host.max_frame, &n);
        if (st == PROTO_FRAME_NEED_MORE) /* a truncated last frame: the EOF path */
            break;
        if (st == PROTO_FRAME_EMPTY || st == PROTO_FRAME_TOO_LARGE) {
            FUZZ_ASSERT(st == PROTO_FRAME_EMPTY ? n == 0 : n > e->host.max_frame);
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
