/* ops_export: kv_export and kv_export_release (docs/protocol.md). kv_export
 * pins the pages that hold a sequence's blocks (kvmm_seq_export), makes one
 * descriptor per page and hands them to the connection, which sends them
 * with the reply frame (SCM_RIGHTS on the frame's first byte, conn.c). */
#include <stdlib.h>
#include <unistd.h>

#include "conn.h"
#include "kvd/protocol.h"
#include "ops.h"

static int mm_err(struct ops_ctx *c, int rc)
{
    return kvd_error_set(&c->err, rc, "%s", kvmm_errmsg(c->mm));
}

int ops_kv_export(struct ops_ctx *c)
{
    uint64_t seq, from = 0, n = 0;
    bool have, writable = false;
    struct kvmm_export_info ex;
    int fds[KVD_MAX_EXPORT_FDS];
    enum backend_fd_kind kinds[KVD_MAX_EXPORT_FDS];
    size_t n_fds = 0;
    int rc = proto_get_uint(c->req, "seq", &seq, &c->err);
    if (!rc)
        rc = proto_opt_uint(c->req, "from_token", &from, &have, &c->err);
    if (!rc)
        rc = proto_opt_uint(c->req, "n_tokens", &n, &have, &c->err);
    if (!rc)
        rc = proto_opt_bool(c->req, "writable", &writable, &have, &c->err);
    if (rc)
        return rc;
    if (!c->conn)
        return kvd_error_set(&c->err, KVD_EUNSUPPORTED,
                             "kv_export sends descriptors (SCM_RIGHTS): only over the Unix socket");
    if (from > UINT32_MAX || n > UINT32_MAX)
        return kvd_error_set(&c->err, KVD_EBADREQ, "token range [%llu, +%llu) is out of range",
                             (unsigned long long)from, (unsigned long long)n);
    kvmm_lock(c->mm);
    rc = kvmm_seq_export(c->mm, c->conn_id, seq, c->tenant, c->admin, (size_t)from, (size_t)n,
                         writable, KVD_MAX_EXPORT_FDS, &ex);
    if (rc) {
        rc = mm_err(c, rc);
        kvmm_unlock(c->mm);
        return rc;
    }
    for (; n_fds < ex.n_pages; n_fds++)
        if ((rc = kvmm_export_fd(c->mm, &ex.pages[n_fds], &fds[n_fds], &kinds[n_fds]))) {
            rc = mm_err(c, rc);
            break;
        }
    if (rc)
        (void)kvmm_export_release(c->mm, c->conn_id, ex.id);
    kvmm_unlock(c->mm);
    if (!rc)
        rc = proto_reply_begin(c->pk, c->id, 5);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "export", ex.id);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "fds", ex.n_pages);
    /* What each descriptor is: a memfd to mmap, or a cuda VMM handle to
     * import (cuMemImportFromShareableHandle) and map, of `bytes`. */
    if (!rc)
        rc = proto_pack_str(c->pk, "maps");
    if (!rc)
        rc = proto_pack_array(c->pk, ex.n_pages);
    for (size_t i = 0; !rc && i < ex.n_pages; i++) {
        rc = proto_pack_map(c->pk, 3);
        if (!rc)
            rc = proto_pack_kv_str(c->pk, "kind",
                                   kinds[i] == BACKEND_FD_CUDA_VMM ? "cuda_vmm" : "memfd");
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "bytes", ex.page_bytes[ex.pages[i].tier]);
        if (!rc)
            rc = proto_pack_kv_bool(c->pk, "writable", ex.pages[i].writable);
    }
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "from_block", ex.from_block);
    if (!rc)
        rc = proto_pack_str(c->pk, "blocks");
    if (!rc)
        rc = proto_pack_array(c->pk, ex.n_blocks);
    for (size_t i = 0; !rc && i < ex.n_blocks; i++) {
        rc = proto_pack_map(c->pk, 4);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "fd", ex.blocks[i].page);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "offset", ex.blocks[i].offset);
        if (!rc)
            rc = proto_pack_kv_uint(c->pk, "bytes", kvmm_block_bytes(c->mm));
        if (!rc)
            rc = proto_pack_kv_bool(c->pk, "writable", ex.pages[ex.blocks[i].page].writable);
    }
    if (!rc && (rc = conn_reply_fds(c->conn, fds, n_fds)))
        kvd_error_set(&c->err, rc, "out of memory");
    else if (rc)
        for (size_t i = 0; i < n_fds; i++)
            close(fds[i]);
    if (rc && n_fds == ex.n_pages) {
        /* The reply failed after the export was made: undo it. */
        kvmm_lock(c->mm);
        (void)kvmm_export_release(c->mm, c->conn_id, ex.id);
        kvmm_unlock(c->mm);
    }
    kvmm_export_info_free(&ex);
    return rc;
}

int ops_kv_export_release(struct ops_ctx *c)
{
    uint64_t id = 0, seq = 0;
    bool have_id = false, have_seq = false;
    size_t n = 0;
    int rc = proto_opt_uint(c->req, "export", &id, &have_id, &c->err);
    if (!rc)
        rc = proto_opt_uint(c->req, "seq", &seq, &have_seq, &c->err);
    if (rc)
        return rc;
    if (have_id == have_seq)
        return kvd_error_set(&c->err, KVD_EBADREQ, "give one of 'export' and 'seq'");
    kvmm_lock(c->mm);
    if (have_id) {
        rc = kvmm_export_release(c->mm, c->conn_id, id);
        n = rc ? 0 : 1;
    } else {
        rc = kvmm_export_release_seq(c->mm, c->conn_id, seq, &n);
    }
    if (rc)
        rc = mm_err(c, rc);
    kvmm_unlock(c->mm);
    if (!rc)
        rc = proto_reply_begin(c->pk, c->id, 1);
    if (!rc)
        rc = proto_pack_kv_uint(c->pk, "released", n);
    return rc;
}
