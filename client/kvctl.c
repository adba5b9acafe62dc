/* kvctl: the command-line tool for kvd. This file holds the entry point,
 * the global options and the shared helpers, plus the small commands
 * (status, stats, admin, call); seq and generate have their own files. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvctl.h"

static const char usage_text[] =
    "usage: kvctl [--socket PATH] [--timeout MS] <command> [args]\n"
    "\n"
    "commands:\n"
    "  status [--json]           who the daemon is: version, backend, KV geometry, model\n"
    "  stats [--json]            block pool, cache and queue counters\n"
    "  seq script FILE|-         run block-API commands on one connection\n"
    "  seq demo                  open, extend, write, commit, fork, offload, ... and check\n"
    "  generate --tokens 1,2,3 --max-tokens N [...]   generate token ids\n"
    "  generate --text TEXT [...]                     generate text\n"
    "  chat [--system TEXT]      interactive chat through the model's chat template\n"
    "  tokenize --text TEXT      token ids of a text (the model's tokenizer)\n"
    "  detokenize --tokens 1,2   text of token ids\n"
    "  admin evict [N]|check|shutdown                 admin ops\n"
    "  call OP [KEY=VALUE ...]   send any request, print the reply as JSON\n"
    "  top [-n COUNT] [-d SEC]   live view: pool, queues, tokens/s, roofline, tenants\n"
    "  bench [-c N] [-r N] [...] load generator: tokens/s, TTFT/ITL/e2e percentiles\n"
    "\n"
    "options:\n"
    "  --socket PATH   daemon socket (default $KVD_SOCKET, else " KVD_DEFAULT_SOCKET ")\n"
    "  --timeout MS    give up waiting for the daemon after MS milliseconds\n"
    "  -h, --help      this help; `kvctl COMMAND --help` for a command's\n"
    "\n"
    "exit codes: 0 ok, 1 the daemon answered with an error, 2 usage,\n"
    "            3 cannot connect or the connection broke\n";

/* ---- shared helpers ---------------------------------------------------- */

int kvctl_usage_err(const char *fmt, ...)
{
    va_list ap;
    fputs("kvctl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return KVCTL_EUSAGE;
}

int kvctl_connect(struct kvctl *k)
{
    char path[256];
    const char *p = k->socket;
    if (!p) {
        int rc = kvd_default_socket(path, sizeof(path));
        if (rc && rc != KVD_EPERM)
            return kvctl_usage_err("$%s is too long for a socket path", KVD_SOCKET_ENV);
        p = rc ? NULL : path; /* refused: kvd_connect says why */
    }
    k->ctx = kvd_connect(p);
    if (!k->ctx) {
        fprintf(stderr, "kvctl: out of memory\n");
        return KVCTL_ECONN;
    }
    if (k->ctx->err) {
        fprintf(stderr, "kvctl: %s (is kvd running? try --socket)\n", k->ctx->errstr);
        return KVCTL_ECONN;
    }
    if (k->timeout_ms)
        kvd_set_timeout(k->ctx, k->timeout_ms);
    return KVCTL_OK;
}

int kvctl_fail(struct kvctl *k, const char *what)
{
    int err = k->ctx->err;
    fprintf(stderr, "kvctl: %s: %s: %s\n", what, kvd_err_code(err), k->ctx->errstr);
    return err == KVD_EIO ? KVCTL_ECONN : KVCTL_ESERVER;
}

bool kvctl_parse_u64(const char *s, uint64_t *out)
{
    char *end;
    unsigned long long v;
    if (!s || !*s || *s == '-' || *s == '+')
        return false;
    errno = 0;
    v = strtoull(s, &end, 0);
    if (errno || *end)
        return false;
    *out = v;
    return true;
}

int kvctl_parse_tokens(const char *s, uint32_t **out, size_t *n, char *err, size_t errlen)
{
    size_t cap = 16, len = 0;
    uint32_t *v = malloc(cap * sizeof(*v));
    const char *p = s;

    *out = NULL;
    *n = 0;
    if (!v) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    while (*p) {
        char *end;
        unsigned long long a, b;
        errno = 0;
        if (*p < '0' || *p > '9')
            goto bad;
        a = strtoull(p, &end, 10);
        b = a;
        if (*end == '-') {
            if (end[1] < '0' || end[1] > '9')
                goto bad;
            b = strtoull(end + 1, &end, 10);
        }
        if (errno || a > UINT32_MAX || b > UINT32_MAX || b < a || b - a > KVD_MAX_ARRAY)
            goto bad;
        for (unsigned long long t = a; t <= b; t++) {
            if (len == cap) {
                uint32_t *nv = realloc(v, cap * 2 * sizeof(*v));
                if (!nv) {
                    free(v);
                    snprintf(err, errlen, "out of memory");
                    return -1;
                }
                v = nv;
                cap *= 2;
            }
            v[len++] = (uint32_t)t;
        }
        if (*end == ',')
            end++;
        else if (*end)
            goto bad;
        p = end;
    }
    *out = v;
    *n = len;
    return 0;
bad:
    free(v);
    snprintf(err, errlen, "bad token list \"%s\" (want ids like 1,2,3 or ranges like 5-9)", s);
    return -1;
}

void kvctl_print_tokens(FILE *f, const uint32_t *t, size_t n, bool leading_comma)
{
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%s%" PRIu32, (i || leading_comma) ? "," : "", t[i]);
}

/* A flag-only command line: accepts --json and --help. */
static int parse_json_flag(int argc, char **argv, const char *help, bool *json)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            *json = true;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return -1;
        } else {
            kvctl_usage_err("%s: unexpected argument \"%s\" (try kvctl %s --help)", argv[0],
                            argv[i], argv[0]);
            return KVCTL_EUSAGE;
        }
    }
    return 0;
}

/* ---- status ------------------------------------------------------------- */

static void human_bytes(char *buf, size_t cap, uint64_t b)
{
    if (b >= (1u << 20))
        snprintf(buf, cap, "%.1f MiB", (double)b / (1u << 20));
    else if (b >= 1024)
        snprintf(buf, cap, "%.1f KiB", (double)b / 1024);
    else
        snprintf(buf, cap, "%" PRIu64 " B", b);
}

int kvctl_cmd_status(struct kvctl *k, int argc, char **argv)
{
    static const char help[] =
        "usage: kvctl status [--json]\n"
        "Says hello to the daemon and prints who it is: server version, tenant,\n"
        "backend, KV geometry and model (none in store mode), then a short summary\n"
        "of its blocks, cache and clients. --json prints the hello reply as one\n"
        "JSON object.\n";
    struct kvd_hello_info h;
    struct kvd_stats_summary st;
    struct kvd_reply *r = NULL;
    bool json = false;
    char bb[32];
    int rc = parse_json_flag(argc, argv, help, &json);

    if (rc)
        return rc < 0 ? KVCTL_OK : rc;
    if ((rc = kvctl_connect(k)))
        return rc;
    if (json) {
        struct kvd_arg a = KVD_ARG_U("version", KVD_PROTOCOL_VERSION);
        char *s;
        if (kvd_call(k->ctx, KVD_OP_HELLO, &a, 1, &r)) {
            kvd_reply_free(r);
            return kvctl_fail(k, "hello");
        }
        s = kvd_value_json(r->body);
        kvd_reply_free(r);
        if (!s)
            return kvctl_usage_err("out of memory");
        puts(s);
        kvd_free(s);
        return KVCTL_OK;
    }
    if (kvd_hello(k->ctx, &h))
        return kvctl_fail(k, "hello");
    human_bytes(bb, sizeof(bb), h.block_bytes);
    printf("server:   %s (protocol %" PRIu32 ")\n", h.server, h.version);
    printf("tenant:   %s\n", h.tenant);
    printf("backend:  %s\n", h.backend);
    printf("kv:       %" PRIu32 " layers x %" PRIu32 " kv heads x %" PRIu32 " head dim, %s\n",
           h.layers, h.kv_heads, h.head_dim, h.dtype);
    printf("blocks:   %" PRIu32 " tokens, %s each (%" PRIu64 " bytes/token)\n", h.block_tokens, bb,
           h.token_bytes);
    if (h.has_model) {
        printf("model:    %s (vocab %" PRIu32 ", context %" PRIu32 ")\n", h.model, h.vocab,
               h.context);
        if (h.tokenizer[0]) {
            printf("text:     tokenizer %s, end of generation", h.tokenizer);
            for (size_t i = 0; i < h.n_eog; i++)
                printf("%s%" PRIu32, i ? "," : " ", h.eog[i]);
            printf("%s; chat template: %s\n", h.n_eog ? "" : " none",
                   h.has_chat_template ? "yes" : "none");
        } else {
            printf("text:     none (token ids only: the model's tokenizer is not supported)\n");
        }
    } else
        printf("model:    none (store mode: block API only)\n");
    if (kvd_stats_summary(k->ctx, &st))
        return kvctl_fail(k, "stats");
    printf("device:   %" PRIu64 " blocks: %" PRIu64 " free, %" PRIu64 " cached, %" PRIu64
           " in use\n",
           st.device_total, st.device_free, st.device_cached, st.device_used);
    printf("host:     %" PRIu64 " blocks: %" PRIu64 " free, %" PRIu64 " cached, %" PRIu64
           " in use\n",
           st.host_total, st.host_free, st.host_cached, st.host_used);
    printf("cache:    %" PRIu64 " of %" PRIu64 " matched tokens reused; %" PRIu64
           " swaps out, %" PRIu64 " in\n",
           st.match_tokens_hit, st.match_tokens_asked, st.swaps_out, st.swaps_in);
    printf("clients:  %" PRIu64 " connections, %" PRIu64 " requests in flight\n", st.connections,
           st.in_flight);
    return KVCTL_OK;
}

/* ---- stats -------------------------------------------------------------- */

/* One "dotted.key  value" line per leaf, so any shape of stats prints.
 * With measure non-NULL nothing is printed: *measure gets the widest key. */
static void print_flat(const char *prefix, const struct kvd_value *v, int width, int *measure)
{
    char key[256];
    if (v->type == KVD_T_MAP) {
        for (size_t i = 0; i < v->v.map.n; i++) {
            const char *name = kvd_value_str(&v->v.map.items[i].key);
            if (!*prefix && name && (!strcmp(name, "id") || !strcmp(name, "ok")))
                continue;
            snprintf(key, sizeof(key), "%s%s%s", prefix, *prefix ? "." : "", name ? name : "?");
            print_flat(key, &v->v.map.items[i].val, width, measure);
        }
    } else if (v->type == KVD_T_ARRAY && v->v.array.n && v->v.array.items[0].type == KVD_T_MAP) {
        for (size_t i = 0; i < v->v.array.n; i++) {
            /* Per-tenant rows are named by their "name" when they have one. */
            const char *name = kvd_value_str(kvd_value_get(&v->v.array.items[i], "name"));
            if (name)
                snprintf(key, sizeof(key), "%s[%s]", prefix, name);
            else
                snprintf(key, sizeof(key), "%s[%zu]", prefix, i);
            print_flat(key, &v->v.array.items[i], width, measure);
        }
    } else if (measure) {
        if ((int)strlen(prefix) > *measure)
            *measure = (int)strlen(prefix);
    } else if (v->type == KVD_T_STR) {
        printf("%-*s %s\n", width, prefix, v->v.str.ptr);
    } else {
        char *s = kvd_value_json(v);
        printf("%-*s %s\n", width, prefix, s ? s : "?");
        kvd_free(s);
    }
}

/* The reply's results as an aligned two-column table; "ok" when it has none. */
static void print_table(const struct kvd_value *body)
{
    int w = 0;
    print_flat("", body, 0, &w);
    if (!w) {
        printf("ok\n");
        return;
    }
    print_flat("", body, w + 2, NULL);
}

int kvctl_cmd_stats(struct kvctl *k, int argc, char **argv)
{
    static const char help[] =
        "usage: kvctl stats [--json]\n"
        "Prints the daemon's counters: device and host blocks (total, free, cached,\n"
        "in use), prefix-cache hits, swaps, queues and this tenant's usage (every\n"
        "tenant's for an admin, who gets them in pages: kvctl asks for each). --json\n"
        "prints one JSON object on one line per page.\n";
    struct kvd_reply *r = NULL;
    bool json = false;
    int rc = parse_json_flag(argc, argv, help, &json);

    if (rc)
        return rc < 0 ? KVCTL_OK : rc;
    if ((rc = kvctl_connect(k)))
        return rc;
    /* An admin's tenants come in pages: follow tenants_next to the last. */
    for (bool first = true;; first = false) {
        uint64_t next = 0;
        const struct kvd_value *nx = NULL;
        if (first ? kvd_stats(k->ctx, &r) : 0)
            return kvctl_fail(k, "stats");
        nx = kvd_value_get(r->body, "tenants_next");
        bool more = nx && kvd_value_u64(nx, &next) == 0;
        if (json) {
            char *s = kvd_value_json(r->body);
            if (!s) {
                kvd_reply_free(r);
                return kvctl_usage_err("out of memory");
            }
            puts(s); /* one object per page, one line each */
            kvd_free(s);
        } else if (first) {
            print_table(r->body);
        } else {
            const struct kvd_value *tn = kvd_value_get(r->body, "tenants");
            int w = 0;
            if (tn) {
                print_flat("tenants", tn, 0, &w);
                print_flat("tenants", tn, w + 2, NULL);
            }
        }
        kvd_reply_free(r);
        r = NULL;
        if (!more)
            break;
        struct kvd_arg a = KVD_ARG_U("tenants_from", next);
        if (kvd_call(k->ctx, "stats", &a, 1, &r)) {
            kvd_reply_free(r);
            return kvctl_fail(k, "stats");
        }
    }
    return KVCTL_OK;
}

/* ---- admin -------------------------------------------------------------- */

int kvctl_cmd_admin(struct kvctl *k, int argc, char **argv)
{
    static const char help[] =
        "usage: kvctl admin evict [N] [--host|--all] [--json]\n"
        "                                        evict N cached unused blocks (all without N)\n"
        "                                        from device memory (--host: host memory;\n"
        "                                        --all: empty the prefix cache of both)\n"
        "       kvctl admin check [--json]       check the memory manager's invariants\n"
        "       kvctl admin shutdown             ask the daemon to exit cleanly\n"
        "Admin ops need an admin tenant (permission_denied otherwise).\n";
    struct kvd_reply *r = NULL;
    const char *sub;
    uint64_t n = 0;
    bool json = false, host = false, all = false;
    int rc, i = 2;

    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(help, argc < 2 ? stderr : stdout);
        return argc < 2 ? KVCTL_EUSAGE : KVCTL_OK;
    }
    sub = argv[1];
    if (strcmp(sub, "evict") && strcmp(sub, "check") && strcmp(sub, "shutdown"))
        return kvctl_usage_err("admin: unknown command \"%s\" (evict, check, shutdown)", sub);
    if (!strcmp(sub, "evict") && i < argc && argv[i][0] != '-') {
        if (!kvctl_parse_u64(argv[i], &n))
            return kvctl_usage_err("admin evict: \"%s\" is not a block count", argv[i]);
        i++;
    }
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = true;
        else if (!strcmp(argv[i], "--host") && !strcmp(sub, "evict"))
            host = true;
        else if (!strcmp(argv[i], "--all") && !strcmp(sub, "evict"))
            all = true;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return KVCTL_OK;
        } else
            return kvctl_usage_err("admin %s: unexpected argument \"%s\"", sub, argv[i]);
    }
    if ((rc = kvctl_connect(k)))
        return rc;
    if (!strcmp(sub, "shutdown")) {
        if (kvd_admin_shutdown(k->ctx))
            return kvctl_fail(k, "admin shutdown");
        printf("kvd is shutting down\n");
        return KVCTL_OK;
    }
    if (host && all)
        return kvctl_usage_err("admin evict: --host and --all exclude each other");
    rc = !strcmp(sub, "evict") ? kvd_admin_evict(k->ctx,
                                                 all    ? "all"
                                                 : host ? "host"
                                                        : NULL,
                                                 n, &r)
                               : kvd_admin_check(k->ctx, &r);
    if (r && (json || !rc)) {
        if (json) {
            char *s = kvd_value_json(r->body);
            puts(s ? s : "null");
            kvd_free(s);
        } else {
            print_table(r->body);
        }
    }
    kvd_reply_free(r);
    if (rc)
        return kvctl_fail(k, !strcmp(sub, "evict") ? "admin evict" : "admin check");
    return KVCTL_OK;
}

/* ---- call: any request --------------------------------------------------- */

int kvctl_cmd_call(struct kvctl *k, int argc, char **argv)
{
    static const char help[] =
        "usage: kvctl call OP [KEY=VALUE ...]\n"
        "Sends {\"op\": OP, KEY: VALUE, ...} and prints the reply as one JSON line.\n"
        "VALUE: an integer, a float, true/false, nil, [1,2,3] (token ids), or a\n"
        "string (\"s:TEXT\" forces one). Exit 1 when the reply is an error.\n";
    struct kvd_arg *args;
    uint32_t **lists;
    struct kvd_reply *r = NULL;
    int rc, n = argc - 2;
    char err[256];

    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(help, argc < 2 ? stderr : stdout);
        return argc < 2 ? KVCTL_EUSAGE : KVCTL_OK;
    }
    args = calloc((size_t)n + 1, sizeof(*args));
    lists = calloc((size_t)n + 1, sizeof(*lists));
    if (!args || !lists) {
        free(args);
        free(lists);
        return kvctl_usage_err("out of memory");
    }
    rc = KVCTL_OK;
    for (int i = 0; i < n; i++) {
        char *kv = argv[i + 2], *eq = strchr(kv, '='), *val, *end;
        uint64_t u;
        if (!eq) {
            rc = kvctl_usage_err("call: \"%s\" is not KEY=VALUE", kv);
            goto out;
        }
        *eq = '\0';
        val = eq + 1;
        args[i].key = kv;
        if (kvctl_parse_u64(val, &u)) {
            args[i] = KVD_ARG_U(kv, u);
        } else if (val[0] == '-' && strtoll(val, &end, 10) < 0 && !*end) {
            args[i] = KVD_ARG_I(kv, strtoll(val, NULL, 10));
        } else if (strchr(val, '.') && (strtod(val, &end), !*end)) {
            args[i] = KVD_ARG_F(kv, strtod(val, NULL));
        } else if (!strcmp(val, "true") || !strcmp(val, "false")) {
            args[i] = KVD_ARG_B(kv, val[0] == 't');
        } else if (!strcmp(val, "nil")) {
            args[i] = KVD_ARG_NIL_(kv);
        } else if (val[0] == '[' && val[strlen(val) - 1] == ']') {
            size_t nt;
            val[strlen(val) - 1] = '\0';
            if (kvctl_parse_tokens(val + 1, &lists[i], &nt, err, sizeof(err))) {
                rc = kvctl_usage_err("call: %s: %s", kv, err);
                goto out;
            }
            args[i] = KVD_ARG_U32S(kv, lists[i], nt);
        } else {
            args[i] = KVD_ARG_S(kv, strncmp(val, "s:", 2) ? val : val + 2);
        }
    }
    if ((rc = kvctl_connect(k)))
        goto out;
    if (kvd_call(k->ctx, argv[1], args, (size_t)n, &r) && !r) {
        rc = kvctl_fail(k, argv[1]);
        goto out;
    }
    {
        char *s = kvd_value_json(r->body);
        puts(s ? s : "null");
        kvd_free(s);
    }
    rc = r->err ? KVCTL_ESERVER : KVCTL_OK;
out:
    kvd_reply_free(r);
    for (int i = 0; i < n; i++)
        free(lists[i]);
    free(lists);
    free(args);
    return rc;
}

/* ---- main ---------------------------------------------------------------- */

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'},
        {"timeout", required_argument, NULL, 't'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    static const struct {
        const char *name;
        int (*fn)(struct kvctl *, int, char **);
    } cmds[] = {
        {"status", kvctl_cmd_status},
        {"stats", kvctl_cmd_stats},
        {"seq", kvctl_cmd_seq},
        {"generate", kvctl_cmd_generate},
        {"admin", kvctl_cmd_admin},
        {"call", kvctl_cmd_call},
        {"chat", kvctl_cmd_chat},
        {"tokenize", kvctl_cmd_tokenize},
        {"detokenize", kvctl_cmd_detokenize},
        {"top", kvctl_cmd_top},
        {"bench", kvctl_cmd_bench},
    };
    struct kvctl k = {0};
    uint64_t t;
    int c, rc;

    /* "+": stop at the command, whose own options follow it. */
    while ((c = getopt_long(argc, argv, "+s:t:hV", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            k.socket = optarg;
            break;
        case 't':
            if (!kvctl_parse_u64(optarg, &t) || t == 0 || t > 86400000)
                return kvctl_usage_err("--timeout: \"%s\" is not a number of milliseconds", optarg);
            k.timeout_ms = (unsigned)t;
            break;
        case 'h':
            fputs(usage_text, stdout);
            return KVCTL_OK;
        case 'V':
            printf("kvctl %s (protocol %d, libkvd %u.%u.%u)\n", KVD_VERSION_STRING,
                   KVD_PROTOCOL_VERSION, kvd_version() / 10000, kvd_version() / 100 % 100,
                   kvd_version() % 100);
            return KVCTL_OK;
        default:
            fputs(usage_text, stderr);
            return KVCTL_EUSAGE;
        }
    }
    if (optind >= argc) {
        fputs(usage_text, stderr);
        return KVCTL_EUSAGE;
    }
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        if (strcmp(argv[optind], cmds[i].name))
            continue;
        rc = cmds[i].fn(&k, argc - optind, argv + optind);
        kvd_close(k.ctx);
        return rc;
    }
    return kvctl_usage_err("unknown command \"%s\" (try kvctl --help)", argv[optind]);
}
