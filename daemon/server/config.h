/* config: the INI file's access rules: who may connect, which tenant a peer
 * uid/gid belongs to, each tenant's quotas and shared namespaces, and who is
 * an admin. Parsed with libinih; [server] keys are handed to options_set().
 * Reloaded on SIGHUP (a new struct config replaces the old one). */
#ifndef KVD_CONFIG_H
#define KVD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "kvmm.h"
#include "kvd/protocol.h"
#include "options.h"

#define CONFIG_MAX_NS 16          /* shared namespaces per tenant */
#define CONFIG_MAX_LINE 4096      /* bytes in one line of the file (without the newline) */
#define CONFIG_MAX_FILE (1 << 20) /* bytes in the file */

struct config_tenant {
    struct kvmm_tenant_conf conf; /* conf.name is the tenant's name */
    uid_t *uids;                  /* (n_uids) owned */
    size_t n_uids;
    gid_t *gids; /* (n_gids) owned: a peer whose primary gid is listed belongs here */
    size_t n_gids;
    char ns[CONFIG_MAX_NS][KVD_MAX_NAME + 1];
    size_t n_ns;
};

/* [http] token = TENANT TOKEN: a bearer token of the HTTP API over TCP. */
#define CONFIG_MIN_TOKEN 16
#define CONFIG_MAX_TOKEN 255
struct config_token {
    char tenant[KVD_MAX_NAME + 1];
    char token[CONFIG_MAX_TOKEN + 1];
};

struct config {
    struct kvmm_tenant_conf defaults; /* [limits]: quotas of per-uid tenants */
    bool refuse_unlisted;             /* [limits] refuse-unlisted */
    uid_t *admin_uids;                /* (n_admin) owned */
    size_t n_admin;
    struct config_tenant *tenants; /* (n_tenants) owned */
    size_t n_tenants;
    struct config_token *tokens; /* (n_tokens) owned: [http] token */
    size_t n_tokens;
    uid_t *frontend_uids; /* (n_frontend) owned: [front-end] uids */
    size_t n_frontend;
};

/* Who a peer is, after the rules. */
struct config_identity {
    struct kvmm_tenant_conf conf; /* name + quotas to give kvmm_tenant_set */
    bool admin;
};

/* Defaults with no file: every uid its own unlimited tenant; admins are
 * root and the daemon's own uid. */
int config_defaults(struct config *cfg);
/* Reads path. opts (NULL on reload) receives the [server] keys. Returns 0 or
 * KVD_EBADREQ with "path:line: why" in err; cfg is untouched on error. */
int config_load(const char *path, struct config *cfg, struct options *opts, struct kvd_error *err);
void config_free(struct config *cfg);

/* The identity of a peer: the first [tenant:*] listing its uid, else one
 * listing its gid, else its own tenant "uid:<uid>" with the [limits]
 * quotas; KVD_EPERM when unlisted and refuse-unlisted is set. */
int config_resolve(const struct config *cfg, uid_t uid, gid_t gid, struct config_identity *id);
/* The identity of an HTTP client over TCP: the tenant whose [http] token
 * equals `token` (compared in constant time against every token), with
 * that [tenant:NAME]'s quotas or else the [limits] ones; never an admin.
 * KVD_EPERM when no token matches. */
int config_resolve_token(const struct config *cfg, const char *token, struct config_identity *id);
/* Whether uid is a trusted front end ([front-end] uids): it may name a
 * sub-tenant per request. */
bool config_is_frontend(const struct config *cfg, uid_t uid);
/* Whether uid is one of the [admin] uids. */
bool config_is_admin(const struct config *cfg, uid_t uid);
/* The sub-tenant `sub` (sub_len bytes) of a front end whose own tenant is
 * `parent`: "parent/sub" with the [limits] quotas, never an admin.
 * KVD_EBADREQ (err says why) for a bad name. */
int config_resolve_sub(const struct config *cfg, const char *parent, const char *sub,
                       size_t sub_len, struct config_identity *id, struct kvd_error *err);
/* Whether tenant `name` may open sequences in shared namespace ns. */
bool config_ns_allowed(const struct config *cfg, const char *tenant, const char *ns);

#endif
