/* fuzz_env: what the fuzz targets share: a store-mode memory manager on the
 * cpu backend with two tenants, the server's real op table, and a
 * dispatcher that runs one request payload the way conn.c does, without a
 * socket (a fake connection id and a server struct holding only what the
 * handlers read). Every reply it produces is checked to be one well-formed
 * frame; a broken oracle aborts (libFuzzer reports it as a crash). */
#ifndef KVD_FUZZ_ENV_H
#define KVD_FUZZ_ENV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "kvmm.h"
#include "ops.h"
#include "proto.h"

/* Aborts with the condition and place when an oracle fails. */
#define FUZZ_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond))                                                                               \
            fuzz_fail(__FILE__, __LINE__, #cond);                                                  \
    } while (0)
_Noreturn void fuzz_fail(const char *file, int line, const char *what);

#define FUZZ_CONNS 3 /* conn 0, 1: tenant a (one uid, two sockets); conn 2: tenant b */

struct fuzz_conn {
    uint64_t id; /* kvmm owner */
    uint32_t tenant, ns;
    char tenant_name[64];
    bool admin;
};

struct fuzz_env {
    struct backend *be;
    struct kvmm *mm;
    struct server *srv; /* zeroed except cfg, opts, be, tenants */
    struct fuzz_conn conn[FUZZ_CONNS];
    msgpack_sbuffer out; /* replies of the last dispatch */
};

/* Geometry: 2 layers, 1 kv head, head_dim 4, f16, 4 tokens per block (16
 * bytes a token, 64 a block); 24 device and 8 host blocks so eviction and
 * swapping happen within a few ops. Tenant b has quotas (12 device, 4 host
 * blocks, 4 sequences). Shared namespace "pub" is configured for both. */
int fuzz_env_new(struct fuzz_env *e);
void fuzz_env_free(struct fuzz_env *e);
/* A fresh memory manager (same tenants), so each input starts alike. */
int fuzz_env_reset(struct fuzz_env *e);

/* Runs one request payload (the bytes after the 4-byte length) on
 * connection `conn` like the server: parse, id, op lookup, admin check,
 * handler. Returns false when the server would close the connection (the
 * payload did not parse). The reply frame is appended to e->out and
 * checked: exactly one frame, a map whose id is the request's (0 when it had
 * none), ok true or a known error code. *code (if non-NULL) = the reply's
 * code. */
bool fuzz_dispatch(struct fuzz_env *e, int conn, const uint8_t *payload, size_t len, int *code);

/* Runs a byte stream the way a connection reads it: frames one after the
 * other until the stream ends or a frame makes the server close the
 * connection. Returns the number of requests answered. */
size_t fuzz_stream(struct fuzz_env *e, int conn, const uint8_t *data, size_t size);

/* kvmm_check must pass; aborts with its message otherwise. */
void fuzz_check_mm(struct fuzz_env *e);

/* Closes every connection (kvmm_close_owner) and checks that the pool is
 * back to "nothing in use": no sequences, every device/host block free or
 * held only by a radix tree. */
void fuzz_close_all(struct fuzz_env *e);

#endif
