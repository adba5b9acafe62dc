/* kvctl seq: the block API from the command line. Sequences die with their
 * connection, so `seq script` runs a whole list of block-API commands on one
 * connection, and `seq demo` runs a built-in script that checks itself. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvctl.h"

static const char seq_help_head[] =
    "usage: kvctl seq script FILE|- [--json]   run block-API commands on one connection\n"
    "       kvctl seq demo [--json]            run a built-in script that checks itself\n"
    "\n"
    "Script commands, one per line (lines starting with # are comments); each\n"
    "acts on the current sequence, which open and fork set:\n";
static const char seq_help_tail[] =
    "Bytes per token come from hello (layers*2*kv_heads*head_dim*dtype size).\n"
    "With --json each command prints one JSON object: {\"line\", \"cmd\", then\n"
    "\"reply\", or \"ok\" for check, or \"bytes\" and \"fnv1a\" for read}.\n"
    "Exit 1 at the first command the daemon refuses, 2 at a malformed line.\n";

#define SEQ_MAX_HANDLES 256

struct script {
    struct kvctl *k;
    struct kvd_hello_info hello;
    const char *name; /* file name for messages */
    unsigned line;
    bool json;
    uint64_t cur;
    bool have_cur;
    uint64_t handles[SEQ_MAX_HANDLES]; /* opened/forked, in order (for use #K) */
    size_t n_handles;
    struct kvd_reply *last; /* the last reply, for expect */
};

static int script_usage(struct script *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int script_usage(struct script *s, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "kvctl: %s:%u: ", s->name, s->line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return KVCTL_EUSAGE;
}

static int script_fail(struct script *s, const char *cmd)
{
    struct kvd_ctx *ctx = s->k->ctx;
    fprintf(stderr, "kvctl: %s:%u: %s: %s: %s\n", s->name, s->line, cmd, kvd_err_code(ctx->err),
            ctx->errstr);
    return ctx->err == KVD_EIO ? KVCTL_ECONN : KVCTL_ESERVER;
}

/* 64-bit FNV-1a: a short fingerprint of read data for people to compare. */
static uint64_t fnv1a(const unsigned char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* The bytes of DATA (@FILE or fill:BYTE) for n tokens; malloc'd into *out. */
static int load_data(struct script *s, const char *spec, size_t bytes, unsigned char **out)
{
    unsigned char *buf = malloc(bytes ? bytes : 1);
    uint64_t b;
    *out = NULL;
    if (!buf)
        return script_usage(s, "out of memory for %zu bytes", bytes);
    if (!strncmp(spec, "fill:", 5)) {
        if (!kvctl_parse_u64(spec + 5, &b) || b > 255) {
            free(buf);
            return script_usage(s, "\"%s\": fill wants a byte value 0..255", spec);
        }
        memset(buf, (int)b, bytes);
    } else if (spec[0] == '@') {
        FILE *f = fopen(spec + 1, "rb");
        size_t got;
        int extra;
        if (!f) {
            free(buf);
            return script_usage(s, "cannot open %s: %s", spec + 1, strerror(errno));
        }
        got = fread(buf, 1, bytes, f);
        extra = fgetc(f);
        fclose(f);
        if (got != bytes || extra != EOF) {
            free(buf);
            return script_usage(
                s, "%s must hold exactly %zu bytes (N tokens x %" PRIu64 " bytes/token)", spec + 1,
                bytes, s->hello.token_bytes);
        }
    } else {
        free(buf);
        return script_usage(s, "\"%s\": data is @FILE or fill:BYTE", spec);
    }
    *out = buf;
    return 0;
}

/* Starts a --json line: {"line":N,"cmd":"<the command, escaped>" (the
 * caller adds the rest and the closing brace). */
static void json_begin(const struct script *s, const char *cmd)
{
    printf("{\"line\":%u,\"cmd\":\"", s->line);
    for (const unsigned char *c = (const unsigned char *)cmd; *c; c++) {
        if (*c == '"' || *c == '\\')
            printf("\\%c", *c);
        else if (*c < 0x20 || *c == 0x7f)
            printf("\\u%04x", *c);
        else
            putchar(*c);
    }
    putchar('"');
}

/* Prints the last reply: its JSON (minus id and ok) after the command. */
static void show(struct script *s, const char *cmd, const char *extra)
{
    char *j = NULL;
    if (s->last)
        j = kvd_value_json(s->last->body);
    if (s->json) {
        json_begin(s, cmd);
        printf(",\"reply\":%s}\n", j ? j : "null");
    } else {
        /* Drop the leading {"id":N,"ok":true, so people see the result. */
        const char *body = j ? strstr(j, "\"ok\":true") : NULL;
        if (body) {
            body += strlen("\"ok\":true");
            body += *body == ',';
        }
        printf("%-24s %s%s%s%s\n", cmd, body && *body != '}' ? "{" : "",
               body && *body != '}' ? body : "ok", extra && *extra ? "  " : "", extra ? extra : "");
    }
    kvd_free(j);
}

static int need_seq(struct script *s, const char *cmd)
{
    if (!s->have_cur)
        return script_usage(s, "%s: no current sequence (open one first)", cmd);
    return 0;
}

static int remember(struct script *s, uint64_t h)
{
    if (s->n_handles == SEQ_MAX_HANDLES)
        return script_usage(s, "more than %d sequences in one script", SEQ_MAX_HANDLES);
    s->handles[s->n_handles++] = h;
    s->cur = h;
    s->have_cur = true;
    return 0;
}

/* Sends op with args, keeping the reply as s->last. */
static int do_call(struct script *s, const char *op, const struct kvd_arg *args, size_t n)
{
    kvd_reply_free(s->last);
    s->last = NULL;
    if (kvd_call(s->k->ctx, op, args, n, &s->last))
        return script_fail(s, op);
    return 0;
}

static int parse_range(struct script *s, char **w, int nw, uint64_t *start, uint64_t *n)
{
    if (nw < 3 || !kvctl_parse_u64(w[1], start) || !kvctl_parse_u64(w[2], n))
        return script_usage(s, "%s: want START N (token positions)", w[0]);
    if (s->hello.token_bytes && *n > SIZE_MAX / s->hello.token_bytes)
        return script_usage(s, "%s: %" PRIu64 " tokens is too many", w[0], *n);
    return 0;
}

/* ---- the script commands: one table, one function each ---------------- */

struct script_cmd;
typedef int (*script_fn)(struct script *s, const struct script_cmd *c, char **w, int nw,
                         const char *text);
struct script_cmd {
    const char *name, *args, *help; /* the help text's line */
    int min_args, max_args;         /* words after the command */
    bool needs_seq;                 /* acts on the current sequence */
    const char *op;                 /* the protocol op it sends, if one */
    script_fn run;                  /* called once the words are counted */
};

/* open and fork: a new handle that becomes current. */
static int run_new_seq(struct script *s, const struct script_cmd *c, char **w, int nw,
                       const char *text)
{
    struct kvd_arg a = c->needs_seq ? (struct kvd_arg)KVD_ARG_U("seq", s->cur)
                                    : (struct kvd_arg)KVD_ARG_S("namespace", nw > 1 ? w[1] : NULL);
    uint64_t h;
    int rc;
    if ((rc = do_call(s, c->op, &a, c->needs_seq || nw > 1 ? 1 : 0)))
        return rc;
    if (kvd_value_u64(kvd_value_get(s->last->body, "seq"), &h))
        return script_usage(s, "%s: the reply has no \"seq\"", c->name);
    if ((rc = remember(s, h)))
        return rc;
    show(s, text, c->needs_seq ? "(now current)" : NULL);
    return 0;
}

static int run_use(struct script *s, const struct script_cmd *c, char **w, int nw, const char *text)
{
    uint64_t h;
    if (w[1][0] == '#') {
        if (!kvctl_parse_u64(w[1] + 1, &h) || h < 1 || h > s->n_handles)
            return script_usage(s, "use: %s: only %zu sequences were opened", w[1], s->n_handles);
        h = s->handles[h - 1];
    } else if (!kvctl_parse_u64(w[1], &h)) {
        return script_usage(s, "use: \"%s\" is not a handle", w[1]);
    }
    s->cur = h;
    s->have_cur = true;
    if (!s->json)
        printf("%-24s seq %" PRIu64 "\n", text, h);
    return 0;
}

/* match and commit: the current sequence and a token list. */
static int run_tokens(struct script *s, const struct script_cmd *c, char **w, int nw,
                      const char *text)
{
    uint32_t *t = NULL;
    size_t nt;
    char err[256];
    if (kvctl_parse_tokens(w[1], &t, &nt, err, sizeof(err)))
        return script_usage(s, "%s: %s", c->name, err);
    struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U32S("tokens", t, nt)};
    int rc = do_call(s, c->op, a, 2);
    free(t);
    if (!rc)
        show(s, text, NULL);
    return rc;
}

static int run_extend(struct script *s, const struct script_cmd *c, char **w, int nw,
                      const char *text)
{
    uint64_t n;
    int rc;
    if (!kvctl_parse_u64(w[1], &n))
        return script_usage(s, "extend: want N (token slots)");
    struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U("n", n)};
    if ((rc = do_call(s, c->op, a, 2)))
        return rc;
    show(s, text, NULL);
    return 0;
}

static int run_write(struct script *s, const struct script_cmd *c, char **w, int nw,
                     const char *text)
{
    unsigned char *data;
    char extra[64];
    uint64_t start, n;
    int rc;
    if ((rc = parse_range(s, w, nw, &start, &n)))
        return rc;
    size_t bytes = (size_t)n * s->hello.token_bytes;
    if ((rc = load_data(s, w[3], bytes, &data)))
        return rc;
    struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U("start", start), KVD_ARG_U("n", n),
                          KVD_ARG_BIN("data", data, bytes)};
    rc = do_call(s, c->op, a, 4);
    free(data);
    snprintf(extra, sizeof(extra), "(%zu bytes)", bytes);
    if (!rc)
        show(s, text, extra);
    return rc;
}

/* The data of a kv_read of START N into *d (owned by s->last). */
static int read_range(struct script *s, const struct script_cmd *c, char **w, int nw,
                      uint64_t *start, uint64_t *n, const struct kvd_value **d)
{
    int rc;
    if ((rc = parse_range(s, w, nw, start, n)))
        return rc;
    struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U("start", *start), KVD_ARG_U("n", *n)};
    if ((rc = do_call(s, c->op, a, 3)))
        return rc;
    *d = kvd_value_get(s->last->body, "data");
    if (!*d || (*d)->type != KVD_T_BIN)
        return script_usage(s, "%s: the reply has no \"data\"", c->name);
    return 0;
}

static int run_read(struct script *s, const struct script_cmd *c, char **w, int nw,
                    const char *text)
{
    const struct kvd_value *d;
    uint64_t start, n;
    int rc;
    if (nw == 4 && w[3][0] != '>')
        return script_usage(s, "read: want START N [>FILE]");
    if ((rc = read_range(s, c, w, nw, &start, &n, &d)))
        return rc;
    if (nw == 4) {
        FILE *f = fopen(w[3] + 1, "wb");
        if (!f)
            return script_usage(s, "cannot create %s: %s", w[3] + 1, strerror(errno));
        if (d->v.bin.len && fwrite(d->v.bin.ptr, 1, d->v.bin.len, f) != d->v.bin.len) {
            fclose(f);
            return script_usage(s, "cannot write %s", w[3] + 1);
        }
        if (fclose(f))
            return script_usage(s, "cannot write %s: %s", w[3] + 1, strerror(errno));
    }
    uint64_t h = fnv1a(d->v.bin.ptr, d->v.bin.len);
    if (s->json) {
        json_begin(s, text);
        printf(",\"bytes\":%zu,\"fnv1a\":\"%016" PRIx64 "\"}\n", d->v.bin.len, h);
    } else {
        printf("%-24s %zu bytes, fnv1a %016" PRIx64 "%s%s\n", text, d->v.bin.len, h,
               nw == 4 ? " -> " : "", nw == 4 ? w[3] + 1 : "");
    }
    return 0;
}

static int run_check(struct script *s, const struct script_cmd *c, char **w, int nw,
                     const char *text)
{
    const struct kvd_value *d;
    unsigned char *want;
    uint64_t start, n;
    int rc;
    if ((rc = read_range(s, c, w, nw, &start, &n, &d)))
        return rc;
    size_t bytes = (size_t)n * s->hello.token_bytes;
    if ((rc = load_data(s, w[3], bytes, &want)))
        return rc;
    if (d->v.bin.len != bytes) {
        free(want);
        fprintf(stderr, "kvctl: %s:%u: check: got %zu bytes, want %zu\n", s->name, s->line,
                d->v.bin.len, bytes);
        return KVCTL_ESERVER;
    }
    for (size_t i = 0; i < bytes; i++) {
        unsigned char got = ((const unsigned char *)d->v.bin.ptr)[i];
        if (got != want[i]) {
            fprintf(stderr,
                    "kvctl: %s:%u: check: data differs at byte %zu (token %" PRIu64
                    "): got 0x%02x, want 0x%02x\n",
                    s->name, s->line, i, start + i / s->hello.token_bytes, got, want[i]);
            free(want);
            return KVCTL_ESERVER;
        }
    }
    free(want);
    if (s->json) {
        json_begin(s, text);
        printf(",\"ok\":true}\n");
    } else {
        printf("%-24s ok: %zu bytes match\n", text, bytes);
    }
    return 0;
}

/* info, offload, restore, close: the op on the current sequence. */
static int run_seq_op(struct script *s, const struct script_cmd *c, char **w, int nw,
                      const char *text)
{
    struct kvd_arg a = KVD_ARG_U("seq", s->cur);
    int rc;
    if ((rc = do_call(s, c->op, &a, 1)))
        return rc;
    if (!strcmp(c->op, KVD_OP_SEQ_CLOSE))
        s->have_cur = false;
    show(s, text, NULL);
    return 0;
}

static int run_expect(struct script *s, const struct script_cmd *c, char **w, int nw,
                      const char *text)
{
    if (!s->last)
        return script_usage(s, "expect: no reply yet");
    const struct kvd_value *v = kvd_value_path(s->last->body, w[1]);
    char *j = v ? kvd_value_json(v) : NULL;
    if (!j || strcmp(j, w[2])) {
        fprintf(stderr, "kvctl: %s:%u: expect: %s is %s, want %s\n", s->name, s->line, w[1],
                j ? j : "absent", w[2]);
        kvd_free(j);
        return KVCTL_ESERVER;
    }
    kvd_free(j);
    if (!s->json)
        printf("%-24s ok\n", text);
    return 0;
}

static const struct script_cmd script_cmds[] = {
    {"open", "[NAMESPACE]", "open a sequence (the tenant's own namespace by default)", 0, 1, false,
     KVD_OP_SEQ_OPEN, run_new_seq},
    {"match", "TOKENS", "reuse the longest cached prefix (TOKENS: 1,2,3 or 1-40)", 1, 1, true,
     KVD_OP_SEQ_MATCH, run_tokens},
    {"extend", "N", "grow by N token slots", 1, 1, true, KVD_OP_SEQ_EXTEND, run_extend},
    {"write", "START N DATA", "K/V bytes of N tokens; DATA is @FILE or fill:BYTE", 3, 3, true,
     KVD_OP_KV_WRITE, run_write},
    {"read", "START N [>FILE]", "read them back (size + checksum, or into FILE)", 2, 3, true,
     KVD_OP_KV_READ, run_read},
    {"check", "START N DATA", "read and compare with DATA (fails the script if different)", 3, 3,
     true, KVD_OP_KV_READ, run_check},
    {"commit", "TOKENS", "record token ids so full blocks become shareable", 1, 1, true,
     KVD_OP_SEQ_COMMIT, run_tokens},
    {"fork", "", "new sequence sharing every block; becomes current", 0, 0, true, KVD_OP_SEQ_FORK,
     run_new_seq},
    {"use", "SEQ|#K", "make handle SEQ, or the K-th sequence opened, current", 1, 1, false, NULL,
     run_use},
    {"info", "", "tokens and blocks with their tier", 0, 0, true, KVD_OP_SEQ_INFO, run_seq_op},
    {"offload", "", "move the blocks to host memory", 0, 0, true, KVD_OP_SEQ_OFFLOAD, run_seq_op},
    {"restore", "", "bring them back to the device", 0, 0, true, KVD_OP_SEQ_RESTORE, run_seq_op},
    {"close", "", "close the current sequence", 0, 0, true, KVD_OP_SEQ_CLOSE, run_seq_op},
    {"expect", "KEY VALUE", "fail unless the last reply's KEY prints as VALUE", 2, 2, false, NULL,
     run_expect},
};

static void seq_help(FILE *f)
{
    fputs(seq_help_head, f);
    for (size_t i = 0; i < sizeof(script_cmds) / sizeof(script_cmds[0]); i++) {
        const struct script_cmd *c = &script_cmds[i];
        char head[64];
        snprintf(head, sizeof(head), "%s%s%s", c->name, c->args[0] ? " " : "", c->args);
        fprintf(f, "  %-27s %s\n", head, c->help);
    }
    fputs(seq_help_tail, f);
}

/* Runs one script line split into words. */
static int run_cmd(struct script *s, char **w, int nw, const char *text)
{
    for (size_t i = 0; i < sizeof(script_cmds) / sizeof(script_cmds[0]); i++) {
        const struct script_cmd *c = &script_cmds[i];
        if (strcmp(w[0], c->name) != 0)
            continue;
        if (nw - 1 < c->min_args || nw - 1 > c->max_args)
            return c->max_args ? script_usage(s, "%s: want %s", c->name, c->args)
                               : script_usage(s, "%s takes no arguments", c->name);
        int rc = c->needs_seq ? need_seq(s, c->name) : 0;
        return rc ? rc : c->run(s, c, w, nw, text);
    }
    return script_usage(s, "unknown command \"%s\" (see kvctl seq --help)", w[0]);
}

/* Runs every line of f. */
static int run_script(struct script *s, FILE *f)
{
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = 0;

    if (kvd_hello(s->k->ctx, &s->hello))
        return kvctl_fail(s->k, "hello");
    while (!rc && (len = getline(&line, &cap, f)) >= 0) {
        char *w[8] = {0}, *p, *text;
        int nw = 0;
        s->line++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = '\0';
        text = line + strspn(line, " \t");
        if (!*text || *text == '#') /* blank or comment */
            continue;
        /* Keep the command text for output before splitting it in place. */
        char *copy = strdup(text);
        if (!copy) {
            rc = script_usage(s, "out of memory");
            break;
        }
        for (p = strtok(text, " \t"); p && nw < 8; p = strtok(NULL, " \t"))
            w[nw++] = p;
        if (p)
            rc = script_usage(s, "too many words");
        else
            rc = run_cmd(s, w, nw, copy);
        free(copy);
    }
    free(line);
    if (!rc && ferror(f))
        rc = script_usage(s, "read error: %s", strerror(errno));
    return rc;
}

/* The built-in demo, sized from the daemon's block_tokens (B): 2.5 blocks
 * written and committed, a fork whose write into the shared partial block
 * must not reach the parent, offload/restore round trip, then a fresh
 * sequence that must find the two full blocks in the prefix cache. */
static char *demo_script(uint32_t b)
{
    uint32_t n = 2 * b + b / 2, full = 2 * b, half = b / 2 ? b / 2 : 1;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return NULL;
    fprintf(f,
            "open\n"
            "extend %u\n"
            "write 0 %u fill:7\n"
            "commit 1-%u\n"
            "expect shared 2\n"
            "info\n"
            "expect n_tokens %u\n"
            "check 0 %u fill:7\n"
            "fork\n"
            "write %u %u fill:9\n"
            "check 0 %u fill:7\n"
            "check %u %u fill:9\n"
            "use #1\n"
            "check %u %u fill:7\n"
            "offload\n"
            "info\n"
            "restore\n"
            "check 0 %u fill:7\n"
            "close\n"
            "use #2\n"
            "close\n"
            "open\n"
            "match 1-%u\n"
            "expect matched %u\n"
            "check 0 %u fill:7\n"
            "info\n"
            "close\n",
            n, n, n, n, n, full, half, full, full, half, full, half, n, n, full, full);
    fclose(f);
    return buf;
}

int kvctl_cmd_seq(struct kvctl *k, int argc, char **argv)
{
    struct script s = {.k = k};
    const char *file = NULL;
    bool demo = false;
    int rc;
    FILE *f = NULL;
    char *text = NULL;

    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        seq_help(argc < 2 ? stderr : stdout);
        return argc < 2 ? KVCTL_EUSAGE : KVCTL_OK;
    }
    if (!strcmp(argv[1], "demo"))
        demo = true;
    else if (strcmp(argv[1], "script"))
        return kvctl_usage_err("seq: unknown command \"%s\" (script, demo)", argv[1]);
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            s.json = true;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            seq_help(stdout);
            return KVCTL_OK;
        } else if (!demo && !file) {
            file = argv[i];
        } else {
            return kvctl_usage_err("seq %s: unexpected argument \"%s\"", argv[1], argv[i]);
        }
    }
    if (!demo && !file)
        return kvctl_usage_err("seq script: want a FILE (or - for stdin)");
    if (!demo) {
        f = strcmp(file, "-") ? fopen(file, "r") : stdin;
        if (!f)
            return kvctl_usage_err("seq script: cannot open %s: %s", file, strerror(errno));
        s.name = strcmp(file, "-") ? file : "<stdin>";
    }
    if ((rc = kvctl_connect(k)))
        goto out;
    if (demo) {
        struct kvd_hello_info h;
        if (kvd_hello(k->ctx, &h)) {
            rc = kvctl_fail(k, "hello");
            goto out;
        }
        text = demo_script(h.block_tokens);
        if (!text || !(f = fmemopen(text, strlen(text), "r"))) {
            rc = kvctl_usage_err("out of memory");
            goto out;
        }
        s.name = "demo";
    }
    rc = run_script(&s, f);
    if (demo && !rc && !s.json)
        printf("demo: all checks passed\n");
out:
    kvd_reply_free(s.last);
    if (f && f != stdin)
        fclose(f);
    free(text);
    return rc;
}
