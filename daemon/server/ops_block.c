/* ops_block: the block API ops (seq_open ... seq_close, kv_write, kv_read).
 * Each parses its arguments, then makes its kvmm calls under one kvmm_lock
 * so the reply describes one consistent state. Sequence handles are kvmm
 * handles owned by the connection id, so another connection's (or
 * tenant's) handle is simply not found. */
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "fault.h"
#include "kvd/protocol.h"
#include "ops.h"

/* kvmm's failure as the reply's error (call with the lock held). */
static int mm_fail(struct ops_ctx *c, int rc)
{
    return kvd_error_set(&c->err, rc, "%s", kvmm_errmsg(c->mm));
}

/* Packs "blocks": [ids...] for blocks [from, n) of the sequence. Lock held. */
static int pack_block_ids(struct ops_ctx *c, kvmm_seq_t seq, size_t from)
{
    struct kvmm_seq_info info;
    int rc = kvmm_seq_info(c->mm, c->conn_id, seq, &info);
    if (rc)
        return mm_fail(c, rc);
    uint32_t *ids = fault_malloc((info.n_blocks ? info.n_blocks : 1) * sizeof(*ids));
    enum kvd_tier *tiers = fault_malloc((info.n_blocks ? info.n_blocks : 1) * sizeof(*tiers));
    size_t n = 0;
    if (!ids || !tiers) {
        rc = kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    rc = kvmm_seq_blocks(c->mm, c->conn_id, seq, ids, tiers, info.n_blocks, &n);
    if (rc) {
        rc = mm_fail(c, rc);
        goto out;
    }
    if (from > n)
        from = n;
    rc = proto_pack_kv_u32_array(c->pk, "blocks", ids + from, n - from);
out:
    free(ids);
    free(tiers);
    return rc;
}

int ops_seq_open(struct ops_ctx *c)
{
    char ns[KVD_MAX_NAME + 1];
    bool have_ns = false;
    uint32_t ns_id = c->ns;
    kvmm_seq_t seq;
    int rc = proto_opt_strz(c->req, "namespace", ns, sizeof(ns), &have_ns, &c->err);
    if (rc)
        return rc;
    if (have_ns && strcmp(ns, c->tenant_name) != 0) {
        /* A shared namespace: both tenants must list it in the config. */
        if (!config_ns_allowed(c->host->cfg, c->tenant_name, ns))
            return kvd_error_set(&c->err, KVD_EPERM,
                                 "tenant %s may not use namespace '%s' (not in its config "
                                 "'namespaces')",
                                 c->tenant_name, ns);
    }
    kvmm_lock(c->mm);
    if (have_ns && strcmp(ns, c->tenant_name) != 0) {
        char full[KVD_MAX_NAME + 16];
        snprintf(full, sizeof(full), "shared:%s", ns);
        rc = kvmm_namespace(c->mm, full, &ns_id);
        if (rc) {
            rc = mm_fail(c, rc);
            goto out;
        }
    }
    rc = kvmm_seq_open(c->mm, c->conn_id, c->tenant, ns_id, &seq);
    if (rc) {
        rc = mm_fail(c, rc);
        goto out;
    }
    rc = proto_reply_begin(c->pk, c->id, 1);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "seq", seq);
out:
    kvmm_unlock(c->mm);
    return rc;
}

int ops_seq_match(struct ops_ctx *c)
{
    uint64_t seq;
    uint32_t *tokens = NULL;
    size_t n = 0, matched = 0;
    int rc = proto_get_uint(c->req, "seq", &seq, &c->err);
    if (!rc)
        rc = proto_get_u32_array(c->req, "tokens", KVD_MAX_ARRAY, &tokens, &n, &c->err);
    if (rc)
        return rc;
    kvmm_lock(c->mm);
    rc = kvmm_seq_match(c->mm, c->conn_id, seq, tokens, n, &matched);
    if (rc) {
        rc = mm_fail(c, rc);
        goto out;
    }
    rc = proto_reply_begin(c->pk, c->id, 2);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "matched", matched);
    if (!rc)
        rc = pack_block_ids(c, seq, 0);
out:
    kvmm_unlock(c->mm);
    free(tokens);
    return rc;
}

int ops_seq_extend(struct ops_ctx *c)
{
    uint64_t seq, n;
    struct kvmm_seq_info before, after;
    int rc = proto_get_uint(c->req, "seq", &seq, &c->err);
    if (!rc)
        rc = proto_get_uint(c->req, "n", &n, &c->err);
    if (rc)
        return rc;
    if (n > (uint64_t)UINT32_MAX)
        return kvd_error_set(&c->err, KVD_EBADREQ, "'n' is out of range");
    kvmm_lock(c->mm);
    rc = kvmm_seq_info(c->mm, c->conn_id, seq, &before);
    if (!rc)
        rc = kvmm_seq_extend(c->mm, c->conn_id, seq, (size_t)n);
    if (!rc)
        rc = kvmm_seq_info(c->mm, c->conn_id, seq, &after);
    if (rc) {
        rc = mm_fail(c, rc);
        goto out;
    }
    rc = proto_reply_begin(c->pk, c->id, 2);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "n_tokens", after.n_tokens);
    if (!rc)
        rc = pack_block_ids(c, seq, before.n_blocks);
out:
    kvmm_unlock(c->mm);
    return rc;
}

/* seq/start/n of kv_write and kv_read, with the byte size of n tokens. */
static int kv_args(struct ops_ctx *c, uint64_t *seq, uint64_t *start, uint64_t *n, size_t *bytes)
{
    int rc = proto_get_uint(c->req, "seq", seq, &c->err);
    if (!rc)
        rc = proto_get_uint(c->req, "start", start, &c->err);
    if (!rc)
        rc = proto_get_uint(c->req, "n", n, &c->err);
    if (rc)
        return rc;
    size_t tb = kv_token_bytes(kvmm_geom(c->mm));
    if (*n == 0)
        return kvd_error_set(&c->err, KVD_EBADREQ, "'n' must be at least 1");
    if (*start > (uint64_t)UINT32_MAX || *n > (uint64_t)UINT32_MAX)
        return kvd_error_set(&c->err, KVD_EBADREQ, "token range [%llu, +%llu) is out of range",
                             (unsigned long long)*start, (unsigned long long)*n);
    *bytes = (size_t)*n * tb;
    return 0;
}

int ops_kv_write(struct ops_ctx *c)
{
    uint64_t seq, start, n;
    size_t bytes = 0, len; /* init: gcc -O3 maybe-uninitialized false positive */
    const void *data;
    int rc = kv_args(c, &seq, &start, &n, &bytes);
    if (!rc)
        rc = proto_get_bin(c->req, "data", &data, &len, &c->err);
    if (rc)
        return rc;
    if (len != bytes)
        return kvd_error_set(&c->err, KVD_EBADREQ,
                             "'data' is %zu bytes; %llu tokens take %zu (%zu per token)", len,
                             (unsigned long long)n, bytes, kv_token_bytes(kvmm_geom(c->mm)));
    kvmm_lock(c->mm);
    rc = kvmm_seq_write(c->mm, c->conn_id, seq, start, n, data, len);
    if (rc)
        rc = mm_fail(c, rc);
    else
        rc = proto_reply_begin(c->pk, c->id, 0);
    kvmm_unlock(c->mm);
    return rc;
}

int ops_kv_read(struct ops_ctx *c)
{
    uint64_t seq, start, n;
    size_t bytes = 0;
    int rc = kv_args(c, &seq, &start, &n, &bytes);
    if (rc)
        return rc;
    /* The reply must fit in one frame: map header, id, ok, key, bin header. */
    if (bytes > (size_t)c->host->max_frame - 64)
        return kvd_error_set(&c->err, KVD_ETOOLARGE,
                             "kv_read of %llu tokens is %zu bytes, over max_frame (%u); read "
                             "fewer tokens at a time",
                             (unsigned long long)n, bytes, c->host->max_frame);
    rc = proto_reply_begin(c->pk, c->id, 1);
    if (!rc)
        rc = proto_pack_str(c->pk, "data");
    if (!rc && msgpack_pack_bin(c->pk, bytes) != 0)
        rc = KVD_ENOMEM;
    void *dst = rc ? NULL : proto_sbuf_extend(c->out, bytes);
    if (!rc && !dst)
        rc = KVD_ENOMEM;
    if (rc)
        return kvd_error_set(&c->err, rc, "out of memory for %zu bytes of reply", bytes);
    kvmm_lock(c->mm);
    rc = kvmm_seq_read(c->mm, c->conn_id, seq, start, n, dst, bytes);
    if (rc)
        rc = mm_fail(c, rc);
    kvmm_unlock(c->mm);
    return rc;
}

int ops_seq_commit(struct ops_ctx *c)
{
    uint64_t seq;
    uint32_t *tokens = NULL;
    size_t n = 0, shared = 0;
    int rc = proto_get_uint(c->req, "seq", &seq, &c->err);
    if (!rc)
        rc = proto_get_u32_array(c->req, "tokens", KVD_MAX_ARRAY, &tokens, &n, &c->err);
    if (rc)
        return rc;
    kvmm_lock(c->mm);
    rc = kvmm_seq_commit(c->mm, c->conn_id, seq, tokens, n, &shared);
    if (rc)
        rc = mm_fail(c, rc);
    else {
        rc = proto_reply_begin(c->pk, c->id, 1);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "shared", shared);
    }
    kvmm_unlock(c->mm);
    free(tokens);
    return rc;
}

int ops_seq_fork(struct ops_ctx *c)
{
    uint64_t seq;
    kvmm_seq_t child;
    int rc = proto_get_uint(c->req, "seq", &seq, &c->err);
    if (rc)
        return rc;
    kvmm_lock(c->mm);
    rc = kvmm_seq_fork(c->mm, c->conn_id, seq, c->conn_id, &child);
    if (rc)
        rc = mm_fail(c, rc);
    else {
        rc = proto_reply_begin(c->pk, c->id, 1);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "seq", child);
    }
    kvmm_unlock(c->mm);
    return rc;
}

/* Blocks of a seq_info reply listed without a heap buffer (256 tokens at
 * 16 tokens a block). */
#define SEQ_INFO_STACK_BLOCKS 16

int ops_seq_info(struct ops_ctx *c)
{
    uint64_t seq;
    struct kvmm_seq_info info;
    /* Short sequences (the common small request) list their blocks from
     * the stack: no malloc/free per request. */
    uint32_t ids_stack[SEQ_INFO_STACK_BLOCKS], *ids = ids_stack;
    enum kvd_tier tiers_stack[SEQ_INFO_STACK_BLOCKS], *tiers = tiers_stack;
    size_t n = 0;
    int rc = proto_get_uint(c->req, "seq", &seq, &c->err);
    if (rc)
        return rc;
    kvmm_lock(c->mm);
    rc = kvmm_seq_info(c->mm, c->conn_id, seq, &info);
    if (rc) {
        rc = mm_fail(c, rc);
        goto out;
    }
    if (info.n_blocks > SEQ_INFO_STACK_BLOCKS) {
        ids = fault_malloc(info.n_blocks * sizeof(*ids));
        tiers = fault_malloc(info.n_blocks * sizeof(*tiers));
    }
    if (!ids || !tiers) {
        rc = kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
        goto out;
    }
    rc = kvmm_seq_blocks(c->mm, c->conn_id, seq, ids, tiers, info.n_blocks, &n);
    if (rc) {
        rc = mm_fail(c, rc);
        goto out;
    }
    rc = proto_reply_begin(c->pk, c->id, 5);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "n_tokens", info.n_tokens);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "n_committed", info.n_committed);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "shared", info.n_shared);
    if (!rc)
        rc = proto_pack_kv_str(c->pk, "namespace", info.ns == c->ns ? c->tenant_name : "shared");
    if (!rc)
        rc = proto_pack_str(c->pk, "blocks");
    if (!rc)
        rc = proto_pack_array(c->pk, n);
    for (size_t i = 0; !rc && i < n; i++) {
        rc = proto_pack_map(c->pk, 2);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "id", ids[i]);
        if (!rc)
            rc = proto_pack_kv_str(c->pk, "tier", proto_tier_name(tiers[i]));
    }
out:
    kvmm_unlock(c->mm);
    if (ids != ids_stack)
        free(ids);
    if (tiers != tiers_stack)
        free(tiers);
    return rc;
}

/* offload/restore/close: one kvmm call on a sequence. */
static int seq_simple(struct ops_ctx *c, int (*fn)(struct kvmm *, uint64_t, kvmm_seq_t),
                      bool report_host)
{
    uint64_t seq;
    struct kvmm_seq_info info;
    int rc = proto_get_uint(c->req, "seq", &seq, &c->err);
    if (rc)
        return rc;
    kvmm_lock(c->mm);
    rc = fn(c->mm, c->conn_id, seq);
    if (!rc && report_host)
        rc = kvmm_seq_info(c->mm, c->conn_id, seq, &info);
    if (rc)
        rc = mm_fail(c, rc);
    else if (report_host) {
        rc = proto_reply_begin(c->pk, c->id, 2);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "host_blocks", info.n_host);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "device_blocks", info.n_blocks - info.n_host);
    } else
        rc = proto_reply_begin(c->pk, c->id, 0);
    kvmm_unlock(c->mm);
    return rc;
}

int ops_seq_offload(struct ops_ctx *c)
{
    return seq_simple(c, kvmm_seq_offload, true);
}

int ops_seq_restore(struct ops_ctx *c)
{
    return seq_simple(c, kvmm_seq_restore, true);
}

int ops_seq_close(struct ops_ctx *c)
{
    return seq_simple(c, kvmm_seq_close, false);
}
