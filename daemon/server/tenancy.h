/* tenancy: who a request runs as, in one place for the msgpack socket, the
 * HTTP API and SIGHUP. A peer (SO_PEERCRED uid/gid), a bearer token (HTTP
 * over TCP) or a trusted front end's sub-tenant (msgpack `tenant` argument,
 * HTTP X-Kvd-Tenant) resolves to a config identity; registering it gives it
 * its kvmm tenant (quotas) and namespace "tenant:<name>" once, and an entry
 * in the tenant table, which counts its requests in flight for admission
 * (max-queued-per-tenant). Lookups by name and by kvmm tenant id are O(1).
 *
 * Sub-tenants ("FRONT/NAME") are bounded: a front end holds at most
 * max-sub-tenants at once; registering one more frees the least recently
 * used idle one (no request in flight, and kvmm_tenant_remove agrees: no
 * open sequence, no block outside its own namespace), and refuses with
 * KVD_EQUOTA when none is idle. Tenants of peers and tokens are never freed.
 *
 * Every function runs on the loop thread and takes the kvmm lock itself
 * where it needs it (callers must not hold it). Errors: an enum kvd_err
 * code, with `e` filled (kvd_error_set). */
#ifndef KVD_TENANCY_H
#define KVD_TENANCY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"
#include "kvmm.h"
#include "proto.h"

struct tenancy;
struct acct;

/* A registered tenant as a request uses it. */
struct tenancy_who {
    uint32_t tenant, ns; /* kvmm ids */
    char name[KVD_MAX_NAME + 1];
};

/* A peer's credentials (SO_PEERCRED). */
struct tenancy_cred {
    uid_t uid;
    gid_t gid;
    pid_t pid;
};

/* max_sub: max-sub-tenants; max_queued: max-queued-per-tenant. mm is not
 * owned. 0 or KVD_ENOMEM. */
int tenancy_new(struct kvmm *mm, uint32_t max_sub, uint32_t max_queued, struct tenancy **out);
void tenancy_free(struct tenancy *t);
/* Another model's kvmm (not owned): every tenant, registered before or
 * after, is registered there too under the id mm assigned. Before serving
 * (tenants registered earlier are not added to it). 0 or KVD_ENOMEM. */
int tenancy_add_pool(struct tenancy *t, struct kvmm *mm);
/* The accounting whose per-tenant counters are retired when a sub-tenant's
 * id is freed (NULL: none). Not owned. */
void tenancy_set_acct(struct tenancy *t, struct acct *acct);

/* ---- resolving ---------------------------------------------------------- */

/* The credentials of the peer on Unix socket fd: KVD_EPERM when the kernel
 * does not give them. */
int tenancy_peer_cred(int fd, struct tenancy_cred *cred, struct kvd_error *e);
/* The identity the config gives uid/gid: KVD_EPERM when it refuses it. */
int tenancy_resolve_peer(const struct config *cfg, uid_t uid, gid_t gid, struct config_identity *id,
                         struct kvd_error *e);
/* The identity of bearer token tok (NULL: none sent): KVD_EPERM when no
 * [http] token matches. */
int tenancy_resolve_token(const struct config *cfg, const char *tok, struct config_identity *id,
                          struct kvd_error *e);
/* The sub-tenant `sub` (len bytes) that front end uid, whose own tenant is
 * `parent`, names in `what` ("'tenant'", "X-Kvd-Tenant"): KVD_EPERM when
 * uid is not a [front-end] one, KVD_EBADREQ for a bad name. */
int tenancy_resolve_sub(const struct config *cfg, uid_t uid, const char *parent, const char *sub,
                        size_t len, const char *what, struct config_identity *id,
                        struct kvd_error *e);

/* ---- registering -------------------------------------------------------- */

/* Registers the tenant of a peer or a token (kept for the daemon's life)
 * and fills who. A tenant registered before keeps its kvmm id and limits
 * (tenancy_reload changes them). */
int tenancy_register(struct tenancy *t, const struct config_identity *id, struct tenancy_who *who,
                     struct kvd_error *e);
/* Registers a front end's sub-tenant id (from tenancy_resolve_sub; its
 * front end `parent` registered first) and fills who; marks it most
 * recently used. KVD_EQUOTA past max-sub-tenants with no idle one. */
int tenancy_register_sub(struct tenancy *t, const char *parent, const struct config_identity *id,
                         struct tenancy_who *who, struct kvd_error *e);

/* ---- admission ---------------------------------------------------------- */

/* Adds delta to the requests in flight of kvmm tenant `tenant` (no-op for
 * a tenant not registered here). */
void tenancy_pending(struct tenancy *t, uint32_t tenant, long delta);
/* Whether one more request of `tenant` may be queued: 0, or KVD_EBUSY
 * naming max-queued-per-tenant. */
int tenancy_admit(const struct tenancy *t, uint32_t tenant, uint32_t n, struct kvd_error *e);

/* ---- SIGHUP ------------------------------------------------------------- */

/* Gives every registered tenant the limits of the new config: its
 * [tenant:NAME] section's, else [limits]. Failures are logged. */
void tenancy_reload(struct tenancy *t, const struct config *cfg);

/* ---- reading ------------------------------------------------------------ */

struct tenancy_counts {
    size_t tenants;        /* registered now, sub-tenants included */
    size_t sub_tenants;    /* of those, sub-tenants */
    uint64_t subs_freed;   /* idle sub-tenants freed since start */
    uint64_t subs_refused; /* sub-tenants refused at max-sub-tenants */
};
void tenancy_counts(const struct tenancy *t, struct tenancy_counts *out);
/* Requests in flight of kvmm tenant `tenant` (0 when not registered), and
 * the sub-tenants front end `name` holds. For tests and stats. */
size_t tenancy_in_flight(const struct tenancy *t, uint32_t tenant);
size_t tenancy_sub_count(const struct tenancy *t, const char *name);
/* Whether `name` is registered; *tenant gets its kvmm id. */
bool tenancy_lookup(const struct tenancy *t, const char *name, uint32_t *tenant);

#endif
