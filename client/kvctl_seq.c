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

static const char seq_help[] =
    "usage: kvctl seq script FILE|- [--json]   run block-API commands on one connection\n"
    "       kvctl seq demo [--json]            run a built-in script that checks itself\n"
    "\n"
    "Script commands, one per line (lines starting with # are comments); each\n"
    "acts on the current sequence, which open and fork set:\n"
    "  open [NAMESPACE]            open a sequence (the tenant's own namespace by default)\n"
    "  match TOKENS                reuse the longest cached prefix (TOKENS: 1,2,3 or 1-40)\n"
    "  extend N                    grow by N token slots\n"
    "  write START N DATA          K/V bytes of N tokens; DATA is @FILE or fill:BYTE\n"
    "  read START N [>FILE]        read them back (size + checksum, or into FILE)\n"
    "  check START N DATA          read and compare with DATA (fails the script if different)\n"
    "  commit TOKENS               record token ids so full blocks become shareable\n"
    "  fork                        new sequence sharing every block; becomes current\n"
    "  use SEQ|#K                  make handle SEQ, or the K-th sequence opened, current\n"
    "  info                        tokens and blocks with their tier\n"
    "  offload | restore           move the blocks to host memory / back\n"
    "  close                       close the current sequence\n"
    "  expect KEY VALUE            fail unless the last reply's KEY prints as VALUE\n"
    "Bytes per token come from hello (layers*2*kv_heads*head_dim*dtype size).\n"
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

/* Prints the last reply: its JSON (minus id and ok) after the command. */
static void show(struct script *s, const char *cmd, const char *extra)
{
    char *j = NULL;
    if (s->last)
        j = kvd_value_json(s->last->body);
    if (s->json) {
        printf("{\"line\":%u,\"cmd\":\"%s\",\"reply\":%s}\n", s->line, cmd, j ? j : "null");
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

/* Runs one script line split into words. */
static int run_cmd(struct script *s, char **w, int nw, const char *text)
{
    const char *c = w[0];
    uint64_t start, n;
    int rc;

    if (!strcmp(c, "open")) {
        struct kvd_arg a = KVD_ARG_S("namespace", nw > 1 ? w[1] : NULL);
        uint64_t h;
        if ((rc = do_call(s, KVD_OP_SEQ_OPEN, &a, nw > 1 ? 1 : 0)))
            return rc;
        if (kvd_value_u64(kvd_value_get(s->last->body, "seq"), &h))
            return script_usage(s, "open: the reply has no \"seq\"");
        if ((rc = remember(s, h)))
            return rc;
        show(s, text, NULL);
        return 0;
    }
    if (!strcmp(c, "fork")) {
        struct kvd_arg a = KVD_ARG_U("seq", s->cur);
        uint64_t h;
        if ((rc = need_seq(s, c)) || (rc = do_call(s, KVD_OP_SEQ_FORK, &a, 1)))
            return rc;
        if (kvd_value_u64(kvd_value_get(s->last->body, "seq"), &h))
            return script_usage(s, "fork: the reply has no \"seq\"");
        if ((rc = remember(s, h)))
            return rc;
        show(s, text, "(now current)");
        return 0;
    }
    if (!strcmp(c, "use")) {
        uint64_t h;
        if (nw != 2)
            return script_usage(s, "use: want SEQ or #K");
        if (w[1][0] == '#') {
            if (!kvctl_parse_u64(w[1] + 1, &h) || h < 1 || h > s->n_handles)
                return script_usage(s, "use: %s: only %zu sequences were opened", w[1],
                                    s->n_handles);
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
    if (!strcmp(c, "match") || !strcmp(c, "commit")) {
        uint32_t *t = NULL;
        size_t nt;
        char err[256];
        if ((rc = need_seq(s, c)))
            return rc;
        if (nw != 2)
            return script_usage(s, "%s: want one token list (1,2,3 or 1-40)", c);
        if (kvctl_parse_tokens(w[1], &t, &nt, err, sizeof(err)))
            return script_usage(s, "%s: %s", c, err);
        struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U32S("tokens", t, nt)};
        rc = do_call(s, c[0] == 'm' ? KVD_OP_SEQ_MATCH : KVD_OP_SEQ_COMMIT, a, 2);
        free(t);
        if (!rc)
            show(s, text, NULL);
        return rc;
    }
    if (!strcmp(c, "extend")) {
        if ((rc = need_seq(s, c)))
            return rc;
        if (nw != 2 || !kvctl_parse_u64(w[1], &n))
            return script_usage(s, "extend: want N (token slots)");
        struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U("n", n)};
        if ((rc = do_call(s, KVD_OP_SEQ_EXTEND, a, 2)))
            return rc;
        show(s, text, NULL);
        return 0;
    }
    if (!strcmp(c, "write")) {
        unsigned char *data;
        char extra[64];
        if ((rc = need_seq(s, c)) || (rc = parse_range(s, w, nw, &start, &n)))
            return rc;
        if (nw != 4)
            return script_usage(s, "write: want START N @FILE|fill:BYTE");
        size_t bytes = (size_t)n * s->hello.token_bytes;
        if ((rc = load_data(s, w[3], bytes, &data)))
            return rc;
        struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U("start", start),
                              KVD_ARG_U("n", n), KVD_ARG_BIN("data", data, bytes)};
        rc = do_call(s, KVD_OP_KV_WRITE, a, 4);
        free(data);
        snprintf(extra, sizeof(extra), "(%zu bytes)", bytes);
        if (!rc)
            show(s, text, extra);
        return rc;
    }
    if (!strcmp(c, "read") || !strcmp(c, "check")) {
        const struct kvd_value *d;
        char extra[128];
        bool is_check = c[0] == 'c';
        if ((rc = need_seq(s, c)) || (rc = parse_range(s, w, nw, &start, &n)))
            return rc;
        if (is_check ? nw != 4 : (nw != 3 && (nw != 4 || w[3][0] != '>')))
            return script_usage(s, is_check ? "check: want START N @FILE|fill:BYTE"
                                            : "read: want START N [>FILE]");
        struct kvd_arg a[] = {KVD_ARG_U("seq", s->cur), KVD_ARG_U("start", start),
                              KVD_ARG_U("n", n)};
        if ((rc = do_call(s, KVD_OP_KV_READ, a, 3)))
            return rc;
        d = kvd_value_get(s->last->body, "data");
        if (!d || d->type != KVD_T_BIN)
            return script_usage(s, "%s: the reply has no \"data\"", c);
        if (is_check) {
            unsigned char *want;
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
                if (((const unsigned char *)d->v.bin.ptr)[i] != want[i]) {
                    fprintf(stderr,
                            "kvctl: %s:%u: check: data differs at byte %zu (token %" PRIu64
                            "): got 0x%02x, want 0x%02x\n",
                            s->name, s->line, i, start + i / s->hello.token_bytes,
                            ((const unsigned char *)d->v.bin.ptr)[i], want[i]);
                    free(want);
                    return KVCTL_ESERVER;
                }
            }
            free(want);
            if (s->json)
                printf("{\"line\":%u,\"cmd\":\"%s\",\"ok\":true}\n", s->line, text);
            else
                printf("%-24s ok: %zu bytes match\n", text, bytes);
            return 0;
        }
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
        snprintf(extra, sizeof(extra), "%zu bytes, fnv1a %016" PRIx64 "%s%s", d->v.bin.len,
                 fnv1a(d->v.bin.ptr, d->v.bin.len), nw == 4 ? " -> " : "", nw == 4 ? w[3] + 1 : "");
        if (s->json)
            printf("{\"line\":%u,\"cmd\":\"%s\",\"bytes\":%zu,\"fnv1a\":\"%016" PRIx64 "\"}\n",
                   s->line, text, d->v.bin.len, fnv1a(d->v.bin.ptr, d->v.bin.len));
        else
            printf("%-24s %s\n", text, extra);
        return 0;
    }
    if (!strcmp(c, "info") || !strcmp(c, "offload") || !strcmp(c, "restore") ||
        !strcmp(c, "close")) {
        static const struct {
            const char *cmd, *op;
        } map[] = {{"info", KVD_OP_SEQ_INFO},
                   {"offload", KVD_OP_SEQ_OFFLOAD},
                   {"restore", KVD_OP_SEQ_RESTORE},
                   {"close", KVD_OP_SEQ_CLOSE}};
        const char *op = NULL;
        if ((rc = need_seq(s, c)))
            return rc;
        if (nw != 1)
            return script_usage(s, "%s takes no arguments", c);
        for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
            if (!strcmp(c, map[i].cmd))
                op = map[i].op;
        struct kvd_arg a = KVD_ARG_U("seq", s->cur);
        if ((rc = do_call(s, op, &a, 1)))
            return rc;
        if (!strcmp(c, "close"))
            s->have_cur = false;
        show(s, text, NULL);
        return 0;
    }
    if (!strcmp(c, "expect")) {
        const struct kvd_value *v;
        char *j;
        if (nw != 3)
            return script_usage(s, "expect: want KEY VALUE");
        if (!s->last)
            return script_usage(s, "expect: no reply yet");
        v = kvd_value_path(s->last->body, w[1]);
        j = v ? kvd_value_json(v) : NULL;
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
    return script_usage(s, "unknown command \"%s\" (see kvctl seq --help)", c);
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
        fputs(seq_help, argc < 2 ? stderr : stdout);
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
            fputs(seq_help, stdout);
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
