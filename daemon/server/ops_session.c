/* The named-session ops over kvmm_session_* (kvmm.h). The loop thread
 * checks the arguments and does what is quick and in memory (the caller's
 * sequence's tokens, the list, opening the empty sequence session_open
 * fills); writing session files, writing and pinning blocks, and reading
 * blocks back run on the disk workers, which answer with a final frame
 * through server_post. */
#include "ops_session.h"

#include <stdlib.h>
#include <string.h>

#include "exec.h"
#include "kvd/protocol.h"
#include "kvmm.h"
#include "server.h"
#include "workpool.h"

#define TTL_DEFAULT KVMM_SESSION_TTL_DEFAULT
#define TTL_MAX KVMM_SESSION_TTL_MAX

struct ops_session {
    struct server *srv;
    struct kvmm *mm;
    struct workpool *pool;
};

enum job_kind { JOB_SAVE, JOB_OPEN, JOB_DELETE };

struct session_job {
    struct ops_session *os;
    struct kvmm *mm; /* the request's model's */
    enum job_kind kind;
    uint64_t conn, id;
    uint32_t tenant, ns;
    char name[KVMM_SESSION_NAME + 1];
    uint32_t *tokens; /* save: the sequence's, open: the session's (owned) */
    size_t n;
    uint64_t ttl_s;
    kvmm_seq_t seq; /* open: the empty sequence to fill */
};

static int need_tier(struct ops_ctx *c, const struct ops_session *os)
{
    if (os->pool && kvmm_disk_on(c->mm))
        return 0;
    return kvd_error_set(&c->err, KVD_EUNSUPPORTED, "sessions need a disk tier (--disk-dir)");
}

static int get_name(struct ops_ctx *c, char *name)
{
    PROTO_PK(proto_get_strz(c->req, "name", name, KVMM_SESSION_NAME + 1, &c->err));
    if (!kvmm_session_name_ok(name))
        return kvd_error_set(&c->err, KVD_EBADREQ,
                             "'name' must be 1 to %d letters, digits or -_.:@/", KVMM_SESSION_NAME);
    return 0;
}

/* One session's map: name, n_tokens, blocks, bytes, expires. */
static int pack_info(msgpack_packer *pk, const struct kvmm_session_info *in)
{
    PROTO_PK(proto_pack_kv_str(pk, "name", in->name));
    PROTO_PK(proto_pack_kv_uint(pk, "n_tokens", in->n_tokens));
    PROTO_PK(proto_pack_kv_uint(pk, "blocks", in->blocks));
    PROTO_PK(proto_pack_kv_uint(pk, "bytes", in->bytes));
    return proto_pack_kv_uint(pk, "expires", in->expires);
}

/* The job's reply into sb, or an error with e filled. */
static int job_reply(struct session_job *j, msgpack_sbuffer *sb, struct kvd_error *e)
{
    struct kvmm *mm = j->mm;
    struct kvmm_session_info info;
    size_t matched = 0;
    int rc;
    switch (j->kind) {
    case JOB_SAVE:
        rc = kvmm_session_save(mm, j->tenant, j->ns, j->name, j->tokens, j->n, j->ttl_s, &info, e);
        break;
    case JOB_OPEN:
        /* Blocks on disk come into the tree first, then the match takes them. */
        kvmm_disk_prefetch(mm, j->tenant, j->ns, j->tokens, j->n);
        kvmm_lock(mm);
        rc = kvmm_seq_match(mm, j->conn, j->seq, j->tokens, j->n, &matched);
        if (rc)
            kvd_error_set(e, rc, "%s", kvmm_errmsg(mm));
        kvmm_unlock(mm);
        break;
    default:
        rc = kvmm_session_delete(mm, j->ns, j->name, e);
        break;
    }
    if (rc)
        return rc;
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, proto_sbuf_write);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    size_t map = proto_reply_begin_map(&pk, j->id);
    if (j->kind == JOB_SAVE) {
        rc = pack_info(&pk, &info);
    } else if (j->kind == JOB_OPEN) {
        rc = proto_pack_kv_uint(&pk, "seq", j->seq);
        if (!rc)
            rc = proto_pack_kv_uint(&pk, "n_tokens", matched);
        if (!rc)
            rc = proto_pack_kv_u32_array(&pk, "tokens", j->tokens, j->n);
    }
    if (!rc)
        rc = proto_map_end(&pk, map);
    if (!rc)
        rc = proto_frame_end(sb, at);
    return rc ? kvd_error_set(e, KVD_ENOMEM, "out of memory") : 0;
}

static void job_run(void *ud, bool cancelled)
{
    struct session_job *j = ud;
    struct kvd_error e;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    int rc = cancelled ? kvd_error_set(&e, KVD_ECANCELLED, "the daemon is shutting down")
                       : job_reply(j, &sb, &e);
    if (rc) {
        if (j->kind == JOB_OPEN) { /* the sequence goes back (already gone if the peer left) */
            kvmm_lock(j->mm);
            kvmm_seq_close(j->mm, j->conn, j->seq);
            kvmm_unlock(j->mm);
        }
        msgpack_sbuffer_clear(&sb);
        if (proto_frame_error(&sb, j->id, rc, e.message) != 0)
            msgpack_sbuffer_clear(&sb);
    }
    if (sb.size) {
        size_t len = sb.size;
        server_post(j->os->srv, j->conn, j->id, SERVER_POST_FINAL, msgpack_sbuffer_release(&sb),
                    len);
    }
    msgpack_sbuffer_destroy(&sb);
    free(j->tokens);
    free(j);
}

static int submit(struct ops_ctx *c, struct session_job *j)
{
    struct ops_session *os = c->op_ctx;
    j->os = os;
    j->mm = c->mm;
    j->conn = c->conn_id;
    j->id = c->id;
    j->tenant = c->tenant;
    j->ns = c->ns;
    /* a resumed request (its model loaded meanwhile) was admitted once */
    int rc = c->resumed ? 0 : server_queue_admit(c->srv, c->conn, c->tenant, &c->err);
    if (rc == 0 && (rc = workpool_submit(os->pool, c->tenant, job_run, j)) != 0)
        kvd_error_set(&c->err, rc, "%s", exec_submit_errmsg(rc));
    if (rc) {
        if (j->kind == JOB_OPEN) {
            kvmm_lock(c->mm);
            kvmm_seq_close(c->mm, c->conn_id, j->seq);
            kvmm_unlock(c->mm);
        }
        free(j->tokens);
        free(j);
        return rc;
    }
    return OPS_PENDING;
}

static struct session_job *job_new(struct ops_ctx *c, enum job_kind kind)
{
    struct session_job *j = calloc(1, sizeof *j);
    if (!j)
        kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
    else
        j->kind = kind;
    return j;
}

/* session_save {seq, name, ttl_s?}: the sequence's committed tokens. */
static int op_save(struct ops_ctx *c)
{
    struct ops_session *os = c->op_ctx;
    char name[KVMM_SESSION_NAME + 1];
    uint64_t seq, ttl = TTL_DEFAULT;
    PROTO_PK(need_tier(c, os));
    PROTO_PK(proto_get_uint(c->req, "seq", &seq, &c->err));
    PROTO_PK(get_name(c, name));
    PROTO_PK(proto_opt_uint(c->req, "ttl_s", &ttl, NULL, &c->err));
    if (ttl < 1 || ttl > TTL_MAX)
        return kvd_error_set(&c->err, KVD_EBADREQ, "'ttl_s' must be 1 to %llu seconds",
                             (unsigned long long)TTL_MAX);
    struct session_job *j = job_new(c, JOB_SAVE);
    if (!j)
        return c->err.code;
    struct kvmm_seq_info si;
    size_t n = 0;
    int rc;
    kvmm_lock(c->mm);
    rc = kvmm_seq_info(c->mm, c->conn_id, seq, &si);
    const uint32_t *t = rc ? NULL : kvmm_seq_tokens(c->mm, c->conn_id, seq, &n);
    if (rc)
        kvd_error_set(&c->err, rc, "%s", kvmm_errmsg(c->mm));
    else if (si.ns != c->ns)
        rc = kvd_error_set(&c->err, KVD_EBADREQ,
                           "sessions live in the tenant's own namespace; sequence %llu is in "
                           "a shared one",
                           (unsigned long long)seq);
    else if (!(j->tokens = malloc(sizeof(uint32_t) * (n ? n : 1))))
        rc = kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
    else if (n)
        memcpy(j->tokens, t, sizeof(uint32_t) * n);
    kvmm_unlock(c->mm);
    if (rc) {
        free(j->tokens);
        free(j);
        return rc;
    }
    j->n = n;
    j->ttl_s = ttl;
    memcpy(j->name, name, sizeof j->name);
    return submit(c, j);
}

/* session_open {name} → a new sequence holding the session's cached
 * blocks, and all its tokens. */
static int op_open(struct ops_ctx *c)
{
    struct ops_session *os = c->op_ctx;
    char name[KVMM_SESSION_NAME + 1];
    PROTO_PK(need_tier(c, os));
    PROTO_PK(get_name(c, name));
    struct session_job *j = job_new(c, JOB_OPEN);
    if (!j)
        return c->err.code;
    int rc = kvmm_session_tokens(c->mm, c->ns, name, &j->tokens, &j->n, &c->err);
    if (!rc) {
        kvmm_lock(c->mm);
        rc = kvmm_seq_open(c->mm, c->conn_id, c->tenant, c->ns, &j->seq);
        if (rc)
            kvd_error_set(&c->err, rc, "%s", kvmm_errmsg(c->mm));
        kvmm_unlock(c->mm);
    }
    if (rc) {
        free(j->tokens);
        free(j);
        return rc;
    }
    memcpy(j->name, name, sizeof j->name);
    return submit(c, j);
}

static int op_delete(struct ops_ctx *c)
{
    struct ops_session *os = c->op_ctx;
    char name[KVMM_SESSION_NAME + 1];
    PROTO_PK(need_tier(c, os));
    PROTO_PK(get_name(c, name));
    struct session_job *j = job_new(c, JOB_DELETE);
    if (!j)
        return c->err.code;
    memcpy(j->name, name, sizeof j->name);
    return submit(c, j);
}

/* session_list → sessions: the caller's, by name (in memory: on the loop). */
static int op_list(struct ops_ctx *c)
{
    struct ops_session *os = c->op_ctx;
    struct kvmm_session_info *v;
    size_t n;
    PROTO_PK(need_tier(c, os));
    int rc = kvmm_session_list(c->mm, c->ns, &v, &n);
    if (rc)
        return kvd_error_set(&c->err, rc, "out of memory");
    msgpack_packer *pk = c->pk;
    size_t reply = proto_reply_begin_map(pk, c->id);
    rc = proto_pack_str(pk, "sessions");
    if (!rc)
        rc = proto_pack_array(pk, n);
    for (size_t i = 0; !rc && i < n; i++) {
        size_t m = proto_map_begin(pk);
        rc = pack_info(pk, &v[i]);
        if (!rc)
            rc = proto_map_end(pk, m);
    }
    free(v);
    if (rc)
        return kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
    return proto_map_end(pk, reply);
}

int ops_session_register(struct server *srv, struct kvmm *mm, struct workpool *pool,
                         struct ops_session **out)
{
    struct ops_session *os = calloc(1, sizeof *os);
    if (!os)
        return KVD_ENOMEM;
    *os = (struct ops_session){.srv = srv, .mm = mm, .pool = pool};
    int rc = server_op_register(srv, KVD_OP_SESSION_SAVE, op_save, os, OPS_POOL | OPS_LOADED);
    if (!rc)
        rc = server_op_register(srv, KVD_OP_SESSION_OPEN, op_open, os, OPS_POOL | OPS_LOADED);
    if (!rc)
        rc = server_op_register(srv, KVD_OP_SESSION_LIST, op_list, os, OPS_POOL | OPS_LOADED);
    if (!rc)
        rc = server_op_register(srv, KVD_OP_SESSION_DELETE, op_delete, os, OPS_POOL | OPS_LOADED);
    if (rc) {
        free(os);
        return rc;
    }
    *out = os;
    return 0;
}

void ops_session_free(struct ops_session *os)
{
    free(os);
}
