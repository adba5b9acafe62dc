/* fuzz_env: what the fuzz targets share: a store-mode memory manager on the
 * cpu backend with two tenants, the server's real op table, and a
 * dispatcher that runs one request payload the way the server does,
 * without a socket or a server (a fake connection id and the ops_host the
 * handlers read, filled here). Every reply it produces is checked to be one
 * well-formed frame; a broken oracle aborts (libFuzzer reports it as a
 * crash). */
#ifndef KVD_FUZZ_ENV_H
#define KVD_FUZZ_ENV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <msgpack.h>

#include "backend.h"
#include "config.h"
#include "kvd/protocol.h"
#include "kvmm.h"
#include "ops.h"
#include "proto.h"
#include "server.h"

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
    uid_t uid;
    uint32_t tenant, ns;
    struct kvmm_tenant_conf tconf; /* what the config gives the uid */
    char tenant_name[64];
    char ns_name[KVD_MAX_NAME + 16]; /* "tenant:<name>" */
    bool admin;
};

struct fuzz_env {
    struct backend *cpu;          /* the cpu backend (owned) */
    struct backend_ops arena_ops; /* its ops with heap arenas (fuzz_env.c) */
    struct backend arena_be;      /* cpu with arena_ops: what the kvmm uses */
    struct backend *be;           /* = &arena_be */
    struct kvmm *mm;              /* this input's, once built (fuzz_env_mm) */
    struct config cfg;            /* the tenants a and b (fuzz_env.c) */
    struct ops_host host;         /* what the handlers read, as the server gives it */
    struct server_obs obs;        /* stats' view: no sockets, so no connections */
    struct fuzz_tenant {
        char name[KVD_MAX_NAME + 1];
        uint32_t id;
    } * tenants; /* (n_tenants) the three, noted at the first mm_setup */
    size_t n_tenants, n_conns, n_pending;
    struct fuzz_conn conn[FUZZ_CONNS];
    bool tenants_noted;       /* tenants holds the three (first mm_setup) */
    msgpack_sbuffer out;      /* replies of the last dispatch */
    msgpack_zone *zone;       /* requests' objects, as the server's zone */
    msgpack_zone *reply_zone; /* the oracles' parses of replies */
};

/* Geometry: 2 layers, 1 kv head, head_dim 4, f16, 4 tokens per block (16
 * bytes a token, 64 a block); 24 device and 8 host blocks so eviction and
 * swapping happen within a few ops. Tenant b has quotas (12 device, 4 host
 * blocks, 4 sequences). Shared namespace "pub" is configured for both. */
int fuzz_env_new(struct fuzz_env *e);
void fuzz_env_free(struct fuzz_env *e);
/* Per input: fuzz_env_begin, then fuzz_env_mm (or the first request that
 * reaches an op handler) builds a fresh memory manager with the tenants, so
 * each input starts alike; fuzz_env_end frees it. Building it only when a
 * handler is about to use it changes nothing a handler sees (nothing else
 * touches it) and spares the ~40 % of fuzz_proto inputs whose every frame
 * fails before a handler (parse, id, op, admin) the cost of building,
 * checking and freeing an untouched one. Every allocation of an input is
 * freed within it, so libFuzzer's leak check (which reruns an input whose
 * mallocs outnumber its frees) stays quiet and meaningful. */
void fuzz_env_begin(struct fuzz_env *e);
struct kvmm *fuzz_env_mm(struct fuzz_env *e); /* aborts if it cannot be built */
void fuzz_env_end(struct fuzz_env *e);

/* Runs one request payload (the bytes after the 4-byte length) on
 * connection `conn` like the server: parse, id, op lookup, admin check,
 * handler. Returns false when the server would close the connection (the
 * payload did not parse). The reply frame is appended to e->out and
 * checked: exactly one frame, a map whose id is the request's (0 when it had
 * none), ok true or a known error code. *code (if non-NULL) = the reply's
 * code. */
bool fuzz_dispatch(struct fuzz_env *e, int conn, const uint8_t *payload, size_t len, int *code);

/* Parses a reply payload into e->reply_zone (proto_msg_free clears it). */
int fuzz_parse_reply(struct fuzz_env *e, const void *payload, size_t len, struct proto_msg *m);

/* Runs a byte stream the way a connection reads it: frames one after the
 * other until the stream ends or a frame makes the server close the
 * connection. Returns the number of requests answered. */
size_t fuzz_stream(struct fuzz_env *e, int conn, const uint8_t *data, size_t size);

/* kvmm_check must pass; aborts with its message otherwise. Needs e->mm. */
void fuzz_check_mm(struct fuzz_env *e);

/* Closes every connection (kvmm_close_owner) and checks that the pool is
 * back to "nothing in use": no sequences, every device/host block free or
 * held only by a radix tree. */
void fuzz_close_all(struct fuzz_env *e);

#endif
