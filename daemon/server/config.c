/* config: INI parsing of access rules and quotas (see config.h). Section
 * names: [server] (options), [limits] (per-uid tenant quotas and whether
 * unlisted uids may connect), [admin] (admin uids), [tenant:NAME] (a tenant
 * grouping uids/gids, with its quotas and shared namespaces). */
#include "config.h"

#include <errno.h>
#include <grp.h>
#include <ini.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvd/status.h"

static void tenant_conf_unlimited(struct kvmm_tenant_conf *c)
{
    memset(c, 0, sizeof(*c));
    c->max_device_blocks = KVMM_UNLIMITED;
    c->max_host_blocks = KVMM_UNLIMITED;
    c->max_seqs = KVMM_UNLIMITED;
    c->reserved_device_blocks = 0;
    c->weight = 1;
}

int config_defaults(struct config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    tenant_conf_unlimited(&cfg->defaults);
    cfg->admin_uids = calloc(2, sizeof(uid_t));
    if (!cfg->admin_uids)
        return KVD_ENOMEM;
    cfg->admin_uids[0] = 0;
    cfg->n_admin = 1;
    if (geteuid() != 0)
        cfg->admin_uids[cfg->n_admin++] = geteuid();
    return 0;
}

void config_free(struct config *cfg)
{
    for (size_t i = 0; i < cfg->n_tenants; i++) {
        free(cfg->tenants[i].uids);
        free(cfg->tenants[i].gids);
    }
    free(cfg->tenants);
    free(cfg->admin_uids);
    if (cfg->tokens) /* secrets: not left in freed memory */
        explicit_bzero(cfg->tokens, cfg->n_tokens * sizeof(*cfg->tokens));
    free(cfg->tokens);
    free(cfg->frontend_uids);
    memset(cfg, 0, sizeof(*cfg));
}

struct load_ctx {
    struct config *cfg;
    struct options *opts;
    char err[256];
    bool admin_seen;
    /* Real section names: libinih keeps at most 49 bytes of a section
     * name, so every "[name]" is handed to it as "[@k]" and ini_cb maps k
     * back (a tenant name is never cut). */
    char **sections; /* (n_sections) owned strings */
    size_t n_sections;
    struct options *scratch; /* reload: where [model:NAME] keys are checked (owned) */
};

static int parse_u32v(const char *v, uint32_t *out, bool allow_unlimited)
{
    char *end;
    if (allow_unlimited && (!strcmp(v, "unlimited") || !strcmp(v, "none"))) {
        *out = KVMM_UNLIMITED;
        return 0;
    }
    if (!*v || *v == '-' || *v == '+')
        return -1;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || *end || x >= UINT32_MAX)
        return -1;
    *out = (uint32_t)x;
    return 0;
}

/* Bytes with an optional K/M/G/T suffix (powers of 1024); "unlimited" or
 * "none" is 0, which means no limit. */
static int parse_bytes(const char *v, uint64_t *out)
{
    char *end;
    if (!strcmp(v, "unlimited") || !strcmp(v, "none")) {
        *out = 0;
        return 0;
    }
    if (!*v || *v == '-' || *v == '+')
        return -1;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    unsigned shift = 0;
    if (*end == 'K' || *end == 'k')
        shift = 10;
    else if (*end == 'M' || *end == 'm')
        shift = 20;
    else if (*end == 'G' || *end == 'g')
        shift = 30;
    else if (*end == 'T' || *end == 't')
        shift = 40;
    if (shift)
        end++;
    if (errno || *end || x > (UINT64_MAX >> shift))
        return -1;
    *out = (uint64_t)x << shift;
    return 0;
}

static int parse_bool(const char *v, bool *out)
{
    if (!strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "1") || !strcmp(v, "on"))
        *out = true;
    else if (!strcmp(v, "false") || !strcmp(v, "no") || !strcmp(v, "0") || !strcmp(v, "off"))
        *out = false;
    else
        return -1;
    return 0;
}

/* Calls fn on each comma/space separated item of v; stops at a failure. */
static int each_item(const char *v, int (*fn)(void *ctx, const char *item), void *ctx)
{
    char item[256];
    while (*v) {
        while (*v == ',' || *v == ' ' || *v == '\t')
            v++;
        size_t n = strcspn(v, ", \t");
        if (n == 0)
            break;
        if (n >= sizeof(item))
            return -1;
        memcpy(item, v, n);
        item[n] = '\0';
        if (fn(ctx, item))
            return -1;
        v += n;
    }
    return 0;
}

struct id_list {
    uint32_t **v;
    size_t *n;
    bool group;
};

static int id_list_add(void *ctx, const char *item)
{
    struct id_list *l = ctx;
    uint32_t id;
    if (parse_u32v(item, &id, false)) {
        /* A name: resolved now, so a typo fails the load instead of silently
         * refusing someone later. */
        if (l->group) {
            struct group *gr = getgrnam(item);
            if (!gr)
                return -1;
            id = (uint32_t)gr->gr_gid;
        } else {
            struct passwd *pw = getpwnam(item);
            if (!pw)
                return -1;
            id = (uint32_t)pw->pw_uid;
        }
    }
    uint32_t *nv = realloc(*l->v, (*l->n + 1) * sizeof(uint32_t));
    if (!nv)
        return -1;
    nv[(*l->n)++] = id;
    *l->v = nv;
    return 0;
}

static bool name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > KVD_MAX_NAME)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.'))
            return false;
    }
    return true;
}

static int ns_add(void *ctx, const char *item)
{
    struct config_tenant *t = ctx;
    if (t->n_ns >= CONFIG_MAX_NS || !name_ok(item))
        return -1;
    strcpy(t->ns[t->n_ns++], item);
    return 0;
}

/* Quota keys shared by [limits] and [tenant:NAME]: 1 handled, 0 unknown key,
 * -1 bad value. */
static int quota_key(struct kvmm_tenant_conf *c, const char *name, const char *v)
{
    uint32_t x;
    uint32_t *dst = NULL;
    bool unl = true;
    if (!strcmp(name, "max-device-blocks"))
        dst = &c->max_device_blocks;
    else if (!strcmp(name, "max-host-blocks"))
        dst = &c->max_host_blocks;
    else if (!strcmp(name, "max-seqs"))
        dst = &c->max_seqs;
    else if (!strcmp(name, "reserved-device-blocks"))
        dst = &c->reserved_device_blocks, unl = false;
    else if (!strcmp(name, "weight"))
        dst = &c->weight, unl = false;
    else if (!strcmp(name, "max-disk-bytes"))
        return parse_bytes(v, &c->max_disk_bytes) ? -1 : 1;
    else if (!strcmp(name, "events")) {
        /* KV events of the tenant's blocks: on (with token ids), hashes
         * (without them) or off (none, the default). */
        if (!strcmp(v, "on") || !strcmp(v, "yes") || !strcmp(v, "true"))
            c->events = KVMM_EVENTS_ON;
        else if (!strcmp(v, "hashes"))
            c->events = KVMM_EVENTS_HASHES;
        else if (!strcmp(v, "off") || !strcmp(v, "no") || !strcmp(v, "false"))
            c->events = KVMM_EVENTS_OFF;
        else
            return -1;
        return 1;
    } else if (!strcmp(name, "remote"))
        return parse_bool(v, &c->remote) ? -1 : 1;
    else
        return 0;
    if (parse_u32v(v, &x, unl))
        return -1;
    if (dst == &c->weight && (x < 1 || x > 1000))
        return -1;
    *dst = x;
    return 1;
}

static struct config_tenant *tenant_get(struct config *cfg, const char *name)
{
    for (size_t i = 0; i < cfg->n_tenants; i++)
        if (!strcmp(cfg->tenants[i].conf.name, name))
            return &cfg->tenants[i];
    struct config_tenant *nv = realloc(cfg->tenants, (cfg->n_tenants + 1) * sizeof(*nv));
    if (!nv)
        return NULL;
    cfg->tenants = nv;
    struct config_tenant *t = &nv[cfg->n_tenants++];
    memset(t, 0, sizeof(*t));
    tenant_conf_unlimited(&t->conf);
    strcpy(t->conf.name, name);
    return t;
}

/* [http] token = TENANT TOKEN. The token never appears in a message. */
static int http_token_add(struct load_ctx *L, const char *v)
{
    const char *sp = v + strcspn(v, " \t");
    size_t nl = (size_t)(sp - v);
    const char *tok = sp + strspn(sp, " \t");
    size_t tl = strcspn(tok, " \t");
    char name[KVD_MAX_NAME + 1];
    if (nl == 0 || nl > KVD_MAX_NAME) {
        snprintf(L->err, sizeof(L->err),
                 "[http] token: write TENANT TOKEN (a tenant name of 1-%u "
                 "bytes, then the token)",
                 KVD_MAX_NAME);
        return 0;
    }
    memcpy(name, v, nl);
    name[nl] = '\0';
    if (!name_ok(name)) {
        snprintf(L->err, sizeof(L->err),
                 "[http] token: tenant '%s': a name is letters, digits, '-', '_' or '.'", name);
        return 0;
    }
    if (tl < CONFIG_MIN_TOKEN || tl > CONFIG_MAX_TOKEN || tok[tl]) {
        snprintf(L->err, sizeof(L->err),
                 "[http] token for tenant '%s': the token must be one word of %d-%d bytes", name,
                 CONFIG_MIN_TOKEN, CONFIG_MAX_TOKEN);
        return 0;
    }
    for (size_t i = 0; i < L->cfg->n_tokens; i++)
        if (!strncmp(L->cfg->tokens[i].token, tok, tl) && !L->cfg->tokens[i].token[tl]) {
            snprintf(L->err, sizeof(L->err),
                     "[http] token for tenant '%s': the same token is given twice", name);
            return 0;
        }
    struct config_token *nv = realloc(L->cfg->tokens, (L->cfg->n_tokens + 1) * sizeof(*nv));
    if (!nv) {
        snprintf(L->err, sizeof(L->err), "out of memory");
        return 0;
    }
    L->cfg->tokens = nv;
    struct config_token *t = &nv[L->cfg->n_tokens++];
    memset(t, 0, sizeof(*t));
    memcpy(t->tenant, name, nl + 1);
    memcpy(t->token, tok, tl);
    return 1;
}

static int ini_cb(void *user, const char *section, const char *name_in, const char *v)
{
    struct load_ctx *L = user;
    char name[64];
    size_t i;
    if (section[0] == '@') {
        size_t k = strtoul(section + 1, NULL, 10);
        if (k < L->n_sections)
            section = L->sections[k];
    }
    if (strlen(name_in) >= sizeof(name)) {
        snprintf(L->err, sizeof(L->err), "[%.80s] key '%.40s...' is too long", section, name_in);
        return 0;
    }
    for (i = 0; name_in[i] && i + 1 < sizeof(name); i++)
        name[i] = name_in[i] == '_' ? '-' : name_in[i];
    name[i] = '\0';

    if (!strcmp(section, "server")) {
        struct kvd_error e;
        struct options scratch;
        /* On reload the [server] keys are still validated, then ignored:
         * the socket and arenas cannot change under running clients. */
        struct options *o = L->opts;
        if (!o) {
            options_defaults(&scratch);
            o = &scratch;
        }
        if (options_set_key(o, name, v, &e)) {
            snprintf(L->err, sizeof(L->err), "%s", e.message);
            return 0;
        }
        return 1;
    }
    if (!strcmp(section, "limits")) {
        int q = quota_key(&L->cfg->defaults, name, v);
        if (q == 1)
            return 1;
        if (q == 0 && !strcmp(name, "refuse-unlisted") && !parse_bool(v, &L->cfg->refuse_unlisted))
            return 1;
        snprintf(L->err, sizeof(L->err), "[limits] %s: %s", name,
                 q == 0 && strcmp(name, "refuse-unlisted") ? "unknown key" : "bad value");
        return 0;
    }
    if (!strcmp(section, "admin")) {
        if (!strcmp(name, "uids")) {
            if (!L->admin_seen) {
                /* The first uids= line replaces the built-in admins. */
                L->cfg->n_admin = 0;
                L->admin_seen = true;
            }
            struct id_list l = {(uint32_t **)&L->cfg->admin_uids, &L->cfg->n_admin, false};
            if (each_item(v, id_list_add, &l) == 0)
                return 1;
            snprintf(L->err, sizeof(L->err), "[admin] uids: unknown user in '%s'", v);
            return 0;
        }
        snprintf(L->err, sizeof(L->err), "[admin] %s: unknown key", name);
        return 0;
    }
    if (!strncmp(section, "tenant:", 7)) {
        const char *tname = section + 7;
        if (!name_ok(tname)) {
            snprintf(L->err, sizeof(L->err),
                     "[%s]: a tenant name is 1-%u letters, digits, '-', '_' or '.'", section,
                     KVD_MAX_NAME);
            return 0;
        }
        struct config_tenant *t = tenant_get(L->cfg, tname);
        if (!t) {
            snprintf(L->err, sizeof(L->err), "out of memory");
            return 0;
        }
        int q = quota_key(&t->conf, name, v);
        if (q == 1)
            return 1;
        if (q == 0 && (!strcmp(name, "uids") || !strcmp(name, "gids"))) {
            bool g = name[0] == 'g';
            struct id_list l = {g ? (uint32_t **)&t->gids : (uint32_t **)&t->uids,
                                g ? &t->n_gids : &t->n_uids, g};
            if (each_item(v, id_list_add, &l) == 0)
                return 1;
            snprintf(L->err, sizeof(L->err), "[%s] %s: unknown %s in '%s'", section, name,
                     g ? "group" : "user", v);
            return 0;
        }
        if (q == 0 && !strcmp(name, "namespaces")) {
            if (each_item(v, ns_add, t) == 0)
                return 1;
            snprintf(L->err, sizeof(L->err),
                     "[%s] namespaces: at most %d names of letters, digits, '-', '_', '.'", section,
                     CONFIG_MAX_NS);
            return 0;
        }
        snprintf(L->err, sizeof(L->err), "[%s] %s: %s", section, name,
                 q == 0 ? "unknown key" : "bad value");
        return 0;
    }
    if (!strncmp(section, "model:", 6)) {
        /* On reload the models are validated, then ignored like [server]:
         * a model cannot change under the requests it serves. */
        struct kvd_error e;
        struct options *o = L->opts;
        if (!o) {
            if (!L->scratch && !(L->scratch = malloc(sizeof(*L->scratch)))) {
                snprintf(L->err, sizeof(L->err), "out of memory");
                return 0;
            }
            options_defaults(L->scratch);
            o = L->scratch;
        }
        if (options_model_set(o, section + 6, name, v, &e)) {
            snprintf(L->err, sizeof(L->err), "%s", e.message);
            return 0;
        }
        return 1;
    }
    if (!strcmp(section, "http")) {
        if (!strcmp(name, "token"))
            return http_token_add(L, v);
        snprintf(L->err, sizeof(L->err), "[http] %s: unknown key", name);
        return 0;
    }
    if (!strcmp(section, "front-end")) {
        if (!strcmp(name, "uids")) {
            struct id_list l = {(uint32_t **)&L->cfg->frontend_uids, &L->cfg->n_frontend, false};
            if (each_item(v, id_list_add, &l) == 0)
                return 1;
            snprintf(L->err, sizeof(L->err), "[front-end] uids: unknown user in '%s'", v);
            return 0;
        }
        snprintf(L->err, sizeof(L->err), "[front-end] %s: unknown key", name);
        return 0;
    }
    snprintf(L->err, sizeof(L->err), "unknown section [%s]", section);
    return 0;
}

static void sections_free(struct load_ctx *L)
{
    free(L->scratch);
    L->scratch = NULL;
    for (size_t i = 0; i < L->n_sections; i++)
        free(L->sections[i]);
    free(L->sections);
}

/* Reads the whole file (a regular file of at most CONFIG_MAX_FILE bytes),
 * checks that every line fits CONFIG_MAX_LINE and rewrites section headers
 * to "[@k]" (see struct load_ctx). Returns the text to parse (owned) or NULL
 * with err set. */
static char *config_read(const char *path, struct load_ctx *L, struct kvd_error *err)
{
    FILE *f = fopen(path, "r");
    struct stat st;
    if (!f) {
        kvd_error_set(err, KVD_EBADREQ, "%s: cannot read the file: %s", path, strerror(errno));
        return NULL;
    }
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        kvd_error_set(err, KVD_EBADREQ, "%s: not a regular file", path);
        fclose(f);
        return NULL;
    }
    if (st.st_size > CONFIG_MAX_FILE) {
        kvd_error_set(err, KVD_EBADREQ, "%s: %lld bytes; a config file is at most %d bytes", path,
                      (long long)st.st_size, CONFIG_MAX_FILE);
        fclose(f);
        return NULL;
    }
    /* Room for the text, and for every header growing to "[@k]". */
    size_t cap = (size_t)st.st_size * 2 + 64;
    char *raw = malloc((size_t)st.st_size + 1), *out = malloc(cap);
    size_t n = raw ? fread(raw, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (!raw || !out) {
        kvd_error_set(err, KVD_EBADREQ, "%s: out of memory", path);
        goto fail;
    }
    raw[n] = '\0';
    if (memchr(raw, '\0', n)) {
        kvd_error_set(err, KVD_EBADREQ, "%s: contains a NUL byte", path);
        goto fail;
    }
    size_t o = 0;
    unsigned line = 0;
    for (char *p = raw; *p;) {
        char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p) : strlen(p);
        line++;
        if (len > 0 && p[len - 1] == '\r')
            len--;
        if (len > CONFIG_MAX_LINE) {
            kvd_error_set(err, KVD_EBADREQ, "%s:%u: line of %zu bytes; a line is at most %d bytes",
                          path, line, len, CONFIG_MAX_LINE);
            goto fail;
        }
        size_t lead = strspn(p, " \t");
        /* libinih (Debian's build has INI_ALLOW_MULTILINE on) takes an
         * indented line after a `key = value` line as a continuation of the
         * value: under [admin], "uids = 0" then "  1000" would make uid 1000
         * an admin. Its handler never sees the line, so an indented line
         * holding anything but a comment is refused here, by number. */
        if (lead > 0 && lead < len && p[lead] != ';' && p[lead] != '#') {
            kvd_error_set(err, KVD_EBADREQ,
                          "%s:%u: an indented line (\"%.*s\"): kvd reads no continuation lines; "
                          "remove the indentation, and put a list on one line (uids = 0, 1000)",
                          path, line, (int)(len - lead > 60 ? 60 : len - lead), p + lead);
            goto fail;
        }
        char *close = lead < len && p[lead] == '[' ? memchr(p + lead, ']', len - lead) : NULL;
        if (close) {
            char **ns = realloc(L->sections, (L->n_sections + 1) * sizeof(*ns));
            if (ns)
                L->sections = ns;
            char *name = ns ? strndup(p + lead + 1, (size_t)(close - (p + lead + 1))) : NULL;
            if (!name) {
                kvd_error_set(err, KVD_EBADREQ, "%s: out of memory", path);
                goto fail;
            }
            ns[L->n_sections] = name;
            o += (size_t)snprintf(out + o, cap - o, "[@%zu]", L->n_sections++);
            size_t rest = len - (size_t)(close + 1 - p);
            memcpy(out + o, close + 1, rest);
            o += rest;
        } else {
            memcpy(out + o, p, len);
            o += len;
        }
        out[o++] = '\n';
        p = eol ? eol + 1 : p + strlen(p);
    }
    out[o] = '\0';
    free(raw);
    return out;
fail:
    free(raw);
    free(out);
    return NULL;
}

int config_load(const char *path, struct config *cfg, struct options *opts, struct kvd_error *err)
{
    struct config nc;
    struct load_ctx L;
    int rc = config_defaults(&nc);
    if (rc)
        return kvd_error_set(err, rc, "%s: out of memory", path);
    memset(&L, 0, sizeof(L));
    L.cfg = &nc;
    L.opts = opts;
    char *text = config_read(path, &L, err);
    if (!text) {
        sections_free(&L);
        config_free(&nc);
        return KVD_EBADREQ;
    }
    /* Whole lines (libinih's default buffer is 200 bytes and it hands the
     * rest of a longer line to the parser as a line of its own). */
    ini_use_stack = false;
    ini_allow_realloc = true;
    ini_max_line = CONFIG_MAX_LINE + 3;
    ini_stop_on_first_error = true;
    int line = ini_parse_string(text, ini_cb, &L);
    free(text);
    sections_free(&L);
    if (line != 0) {
        if (line < 0)
            kvd_error_set(err, KVD_EBADREQ, "%s: cannot parse the file%s", path,
                          line == -2 ? " (out of memory)" : "");
        else
            kvd_error_set(err, KVD_EBADREQ, "%s:%d: %s", path, line,
                          L.err[0] ? L.err : "syntax error");
        config_free(&nc);
        return KVD_EBADREQ;
    }
    config_free(cfg);
    *cfg = nc;
    return 0;
}

int config_resolve(const struct config *cfg, uid_t uid, gid_t gid, struct config_identity *id)
{
    memset(id, 0, sizeof(*id));
    for (size_t i = 0; i < cfg->n_admin; i++)
        if (cfg->admin_uids[i] == uid)
            id->admin = true;
    for (size_t i = 0; i < cfg->n_tenants; i++)
        for (size_t j = 0; j < cfg->tenants[i].n_uids; j++)
            if (cfg->tenants[i].uids[j] == uid) {
                id->conf = cfg->tenants[i].conf;
                return 0;
            }
    for (size_t i = 0; i < cfg->n_tenants; i++)
        for (size_t j = 0; j < cfg->tenants[i].n_gids; j++)
            if (cfg->tenants[i].gids[j] == gid) {
                id->conf = cfg->tenants[i].conf;
                return 0;
            }
    /* Admins are always let in (as their own tenant) so a config mistake
     * cannot lock the operator out. */
    if (cfg->refuse_unlisted && !id->admin)
        return KVD_EPERM;
    id->conf = cfg->defaults;
    snprintf(id->conf.name, sizeof(id->conf.name), "uid:%u", (unsigned)uid);
    return 0;
}

bool config_ns_allowed(const struct config *cfg, const char *tenant, const char *ns)
{
    for (size_t i = 0; i < cfg->n_tenants; i++) {
        if (strcmp(cfg->tenants[i].conf.name, tenant))
            continue;
        for (size_t j = 0; j < cfg->tenants[i].n_ns; j++)
            if (!strcmp(cfg->tenants[i].ns[j], ns))
                return true;
    }
    return false;
}

/* The quotas of tenant `name`: its [tenant:NAME] section's, else [limits]. */
static void tenant_conf_of(const struct config *cfg, const char *name, struct config_identity *id)
{
    memset(id, 0, sizeof(*id));
    id->conf = cfg->defaults;
    for (size_t i = 0; i < cfg->n_tenants; i++)
        if (!strcmp(cfg->tenants[i].conf.name, name))
            id->conf = cfg->tenants[i].conf;
    snprintf(id->conf.name, sizeof(id->conf.name), "%s", name);
}

int config_resolve_token(const struct config *cfg, const char *token, struct config_identity *id)
{
    size_t hit = SIZE_MAX, tl = strlen(token);
    /* Every token is compared to the end, so the time says nothing about
     * which one (or how much of one) matched. */
    for (size_t i = 0; i < cfg->n_tokens; i++) {
        const char *want = cfg->tokens[i].token;
        size_t wl = strlen(want);
        unsigned char d = (unsigned char)(wl != tl);
        for (size_t k = 0; k < wl; k++)
            d |= (unsigned char)(want[k] ^ (k < tl ? token[k] : 0));
        if (d == 0)
            hit = i;
    }
    if (hit == SIZE_MAX)
        return KVD_EPERM;
    tenant_conf_of(cfg, cfg->tokens[hit].tenant, id);
    return 0;
}

bool config_is_admin(const struct config *cfg, uid_t uid)
{
    for (size_t i = 0; i < cfg->n_admin; i++)
        if (cfg->admin_uids[i] == uid)
            return true;
    return false;
}

bool config_is_frontend(const struct config *cfg, uid_t uid)
{
    for (size_t i = 0; i < cfg->n_frontend; i++)
        if (cfg->frontend_uids[i] == uid)
            return true;
    return false;
}

int config_resolve_sub(const struct config *cfg, const char *parent, const char *sub,
                       size_t sub_len, struct config_identity *id, struct kvd_error *err)
{
    char name[KVD_MAX_NAME + 1];
    bool ok = sub_len > 0 && sub_len <= KVD_MAX_NAME;
    for (size_t i = 0; ok && i < sub_len; i++) {
        char c = sub[i];
        ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
             c == '-' || c == '_' || c == '.';
    }
    if (!ok)
        return kvd_error_set(err, KVD_EBADREQ,
                             "a sub-tenant name is 1-%u letters, digits, '-', '_' or '.'",
                             KVD_MAX_NAME);
    if (strlen(parent) + 1 + sub_len > KVD_MAX_NAME)
        return kvd_error_set(err, KVD_EBADREQ,
                             "sub-tenant '%.*s' of '%s': the name '%s/...' would pass %u bytes",
                             (int)sub_len, sub, parent, parent, KVD_MAX_NAME);
    snprintf(name, sizeof(name), "%s/%.*s", parent, (int)sub_len, sub);
    memset(id, 0, sizeof(*id));
    id->conf = cfg->defaults;
    snprintf(id->conf.name, sizeof(id->conf.name), "%s", name);
    return 0;
}
