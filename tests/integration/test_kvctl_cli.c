/* kvctl against a real kvd in store mode: runs the tool ($KVCTL_BIN) and
 * checks its output and exit codes (0 ok, 1 server error, 2 usage,
 * 3 connection): status, stats --json, seq script/demo, generate, admin. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

struct run {
    int status; /* exit code, or 128+signal */
    char out[65536], err[8192];
};

/* Reads a whole file into buf (NUL-terminated, truncated to cap-1). */
static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = 0;
    buf[0] = '\0';
    if (!f)
        return;
    n = fread(buf, 1, cap - 1, f);
    buf[n] = '\0';
    fclose(f);
}

/* Runs kvctl with args (NULL-terminated), stdin from `input` (may be NULL),
 * capturing stdout and stderr through files in the daemon's directory. */
static void kvctl(struct run *r, const struct kh_proc *d, const char *input, ...)
{
    const char *argv[32];
    char outp[192], errp[192], inp[192];
    const char *bin = getenv("KVCTL_BIN");
    va_list ap;
    int n = 0, status;
    pid_t pid;

    assert_non_null(bin);
    argv[n++] = bin;
    va_start(ap, input);
    for (const char *a; (a = va_arg(ap, const char *)) && n < 31;)
        argv[n++] = a;
    va_end(ap);
    argv[n] = NULL;
    snprintf(outp, sizeof(outp), "%s/kvctl.out", d->dir);
    snprintf(errp, sizeof(errp), "%s/kvctl.err", d->dir);
    snprintf(inp, sizeof(inp), "%s/kvctl.in", d->dir);
    if (input) {
        FILE *f = fopen(inp, "w");
        assert_non_null(f);
        fputs(input, f);
        fclose(f);
    }
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int o = open(outp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int e = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int i = open(input ? inp : "/dev/null", O_RDONLY);
        if (o < 0 || e < 0 || i < 0)
            _exit(126);
        dup2(o, 1);
        dup2(e, 2);
        dup2(i, 0);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    r->status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    slurp(outp, r->out, sizeof(r->out));
    slurp(errp, r->err, sizeof(r->err));
}

#define KVCTL(r, d, input, ...) kvctl((r), (d), (input), __VA_ARGS__, (const char *)NULL)

static void expect(const struct run *r, int status, const char *in_out, const char *in_err)
{
    if (r->status != status || (in_out && !strstr(r->out, in_out)) ||
        (in_err && !strstr(r->err, in_err)))
        fail_msg("kvctl exited %d (want %d)\nstdout: %s\nstderr: %s\nwanted stdout to hold "
                 "\"%s\", stderr \"%s\"",
                 r->status, status, r->out, r->err, in_out ? in_out : "", in_err ? in_err : "");
}

/* ---- a small JSON checker: exactly one value, well formed ------------------- */

static const char *json_ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
        p++;
    return p;
}

static const char *json_value(const char *p, int depth);

static const char *json_string(const char *p)
{
    if (*p++ != '"')
        return NULL;
    while (*p && *p != '"') {
        if ((unsigned char)*p < 0x20)
            return NULL;
        if (*p == '\\') {
            p++;
            if (*p == 'u') {
                for (int i = 1; i <= 4; i++)
                    if (!strchr("0123456789abcdefABCDEF", p[i]) || !p[i])
                        return NULL;
                p += 4;
            } else if (!*p || !strchr("\"\\/bfnrt", *p)) {
                return NULL;
            }
        }
        p++;
    }
    return *p == '"' ? p + 1 : NULL;
}

static const char *json_number(const char *p)
{
    const char *s = p;
    if (*p == '-')
        p++;
    if (*p < '0' || *p > '9')
        return NULL;
    while (*p >= '0' && *p <= '9')
        p++;
    if (*p == '.') {
        p++;
        if (*p < '0' || *p > '9')
            return NULL;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-')
            p++;
        if (*p < '0' || *p > '9')
            return NULL;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    return p > s ? p : NULL;
}

static const char *json_value(const char *p, int depth)
{
    if (depth > 64)
        return NULL;
    p = json_ws(p);
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        bool obj = *p == '{';
        p = json_ws(p + 1);
        if (*p == close)
            return p + 1;
        for (;;) {
            if (obj) {
                p = json_string(json_ws(p));
                if (!p)
                    return NULL;
                p = json_ws(p);
                if (*p++ != ':')
                    return NULL;
            }
            p = json_value(p, depth + 1);
            if (!p)
                return NULL;
            p = json_ws(p);
            if (*p == ',') {
                p++;
                continue;
            }
            return *p == close ? p + 1 : NULL;
        }
    }
    if (*p == '"')
        return json_string(p);
    if (!strncmp(p, "true", 4))
        return p + 4;
    if (!strncmp(p, "false", 5))
        return p + 5;
    if (!strncmp(p, "null", 4))
        return p + 4;
    return json_number(p);
}

/* True when s is one JSON object on one line (a trailing newline allowed). */
static bool one_json_object_line(const char *s)
{
    const char *end;
    const char *nl = strchr(s, '\n');
    if (nl && nl[1] != '\0')
        return false;
    if (*json_ws(s) != '{')
        return false;
    end = json_value(s, 0);
    return end && *json_ws(end) == '\0';
}

static void test_json_checker(void **state)
{
    (void)state;
    /* The checker itself must reject what it should, or the stats test
     * below could never fail. */
    assert_true(one_json_object_line("{\"a\":1,\"b\":[1,2,{\"c\":null}],\"d\":\"x\\\"y\"}\n"));
    assert_false(one_json_object_line("{\"a\":1,}"));
    assert_false(one_json_object_line("{\"a\":1}\n{\"b\":2}\n"));
    assert_false(one_json_object_line("[1,2]"));
    assert_false(one_json_object_line("{\"a\":01x}"));
    assert_false(one_json_object_line("{\"a\" 1}"));
}

/* ---- fixtures --------------------------------------------------------------- */

static int setup(void **state)
{
    static const char *const args[] = {"--backend", "cpu", NULL};
    struct kh_proc *d = kh_new(NULL, args);
    if (!d)
        return -1;
    *state = d;
    return 0;
}

static int teardown(void **state)
{
    kh_free(*state);
    return 0;
}

/* ---- commands ----------------------------------------------------------------- */

static void test_status(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    KVCTL(&r, d, NULL, "--socket", d->sock, "status");
    expect(&r, 0, "backend:  cpu", NULL);
    expect(&r, 0, "store mode", NULL);
    expect(&r, 0, "device:   ", NULL);
    expect(&r, 0, "clients:  1 connections", NULL);
    KVCTL(&r, d, NULL, "--socket", d->sock, "status", "--json");
    expect(&r, 0, "\"block_tokens\":", NULL);
    assert_true(one_json_object_line(r.out));
    /* $KVD_SOCKET instead of --socket. */
    setenv("KVD_SOCKET", d->sock, 1);
    KVCTL(&r, d, NULL, "status");
    unsetenv("KVD_SOCKET");
    expect(&r, 0, "backend:", NULL);
}

static void test_stats(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    KVCTL(&r, d, NULL, "--socket", d->sock, "stats", "--json");
    expect(&r, 0, "{", NULL);
    if (!one_json_object_line(r.out))
        fail_msg("stats --json is not one JSON object on one line:\n%s", r.out);
    KVCTL(&r, d, NULL, "--socket", d->sock, "stats");
    expect(&r, 0, NULL, NULL);
    assert_non_null(strchr(r.out, '\n'));
    assert_null(strchr(r.out, '{')); /* a table, not JSON */
}

static void test_generate_store_mode(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    KVCTL(&r, d, NULL, "--socket", d->sock, "generate", "--tokens", "1,2,3", "--max-tokens", "4");
    expect(&r, 1, NULL, "unsupported");
    assert_string_equal(r.out, "");
    KVCTL(&r, d, NULL, "--socket", d->sock, "generate", "--tokens", "1,2,3", "--max-tokens", "4",
          "--stream", "--temperature", "0.5", "--top-k", "40", "--top-p", "0.9", "--seed", "7",
          "--stop", "2,9");
    expect(&r, 1, NULL, "generate: unsupported:");
}

static void test_usage_errors(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    KVCTL(&r, d, NULL, "--socket", d->sock, "generate", "--max-tokens", "4");
    expect(&r, 2, NULL, "--tokens is required");
    KVCTL(&r, d, NULL, "--socket", d->sock, "generate", "--tokens", "1,x");
    expect(&r, 2, NULL, "bad token list");
    KVCTL(&r, d, NULL, "--socket", d->sock, "frobnicate");
    expect(&r, 2, NULL, "unknown command");
    KVCTL(&r, d, NULL, "--socket", d->sock, "stats", "--bogus");
    expect(&r, 2, NULL, "unexpected argument");
    KVCTL(&r, d, NULL, (const char *)NULL);
    expect(&r, 2, NULL, "usage:");
    /* --help: per command, exit 0, on stdout. */
    const char *cmds[] = {"status", "stats", "seq", "generate", "admin", "call"};
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        KVCTL(&r, d, NULL, cmds[i], "--help");
        expect(&r, 0, "usage: kvctl", NULL);
    }
    KVCTL(&r, d, NULL, "--help");
    expect(&r, 0, "exit codes", NULL);
}

static void test_connect_error(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    char path[192];
    snprintf(path, sizeof(path), "%s/absent.sock", d->dir);
    KVCTL(&r, d, NULL, "--socket", path, "stats", "--json");
    expect(&r, 3, NULL, "kvctl: cannot connect to ");
    expect(&r, 3, NULL, path);
    expect(&r, 3, NULL, "No such file or directory (is kvd running? try --socket)");
}

static void test_seq_demo(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    KVCTL(&r, d, NULL, "--socket", d->sock, "seq", "demo");
    expect(&r, 0, "demo: all checks passed", NULL);
    expect(&r, 0, "expect matched", NULL);
}

static void test_seq_script(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    char script[1024], file[192];

    /* Bytes written from a fill pattern, read into a file, written back
     * from that file into a second sequence and compared. */
    snprintf(file, sizeof(file), "%s/kv.bin", d->dir);
    snprintf(script, sizeof(script),
             "# a comment\n"
             "open\n"
             "extend 20\n"
             "write 0 20 fill:42\n"
             "read 0 20 >%s\n"
             "commit 1-20\n"
             "info\n"
             "expect n_tokens 20\n"
             "expect n_committed 20\n"
             "open\n"
             "extend 20\n"
             "write 0 20 @%s\n"
             "check 0 20 fill:42\n"
             "close\n"
             "use #1\n"
             "close\n",
             file, file);
    KVCTL(&r, d, script, "--socket", d->sock, "seq", "script", "-");
    expect(&r, 0, "fnv1a", NULL);
    expect(&r, 0, "ok: ", NULL);

    /* A command the daemon refuses: exit 1 naming the line. */
    KVCTL(&r, d, "open\nextend 4\nread 2 9\n", "--socket", d->sock, "seq", "script", "-");
    expect(&r, 1, NULL, "<stdin>:3: kv_read: bad_request");
    /* A check that does not hold: exit 1. */
    KVCTL(&r, d, "open\nextend 4\nwrite 0 4 fill:1\ncheck 0 4 fill:2\n", "--socket", d->sock, "seq",
          "script", "-");
    expect(&r, 1, NULL, "data differs at byte 0");
    /* Malformed lines: exit 2. */
    KVCTL(&r, d, "info\n", "--socket", d->sock, "seq", "script", "-");
    expect(&r, 2, NULL, "no current sequence");
    KVCTL(&r, d, "open\nextend many\n", "--socket", d->sock, "seq", "script", "-");
    expect(&r, 2, NULL, "<stdin>:2: extend");
    KVCTL(&r, d, "open\nfly\n", "--socket", d->sock, "seq", "script", "-");
    expect(&r, 2, NULL, "unknown command \"fly\"");
    /* --json: one object per command. */
    KVCTL(&r, d, "open\nextend 3\n", "--socket", d->sock, "seq", "script", "-", "--json");
    expect(&r, 0, "\"cmd\":\"extend 3\"", NULL);
    /* ... whose command text is escaped: a tab, a quote, a backslash. */
    snprintf(file, sizeof(file), "%s/a\\\"b.bin", d->dir);
    snprintf(script, sizeof(script),
             "open\nextend\t4\nwrite 0 4 fill:3\nread 0 4 >%s\n"
             "check 0 4 fill:3\n",
             file);
    KVCTL(&r, d, script, "--socket", d->sock, "seq", "script", "-", "--json");
    expect(&r, 0, "\"cmd\":\"extend\\u00094\"", NULL);
    expect(&r, 0, "a\\\\\\\"b.bin\"", NULL);
    int lines = 0;
    for (char *line = strtok(r.out, "\n"); line; line = strtok(NULL, "\n"), lines++)
        if (!one_json_object_line(line))
            fail_msg("not one JSON object: %s", line);
    assert_int_equal(lines, 5);
    unlink(file);
    /* Wrong word counts, from the command table. */
    KVCTL(&r, d, "open\ninfo now\n", "--socket", d->sock, "seq", "script", "-");
    expect(&r, 2, NULL, "<stdin>:2: info takes no arguments");
    KVCTL(&r, d, "open\nwrite 0 4\n", "--socket", d->sock, "seq", "script", "-");
    expect(&r, 2, NULL, "<stdin>:2: write: want START N DATA");
    /* The help lists every command. */
    KVCTL(&r, d, NULL, "seq", "--help");
    static const char *const cmds[] = {"open [NAMESPACE]",
                                       "match TOKENS",
                                       "extend N",
                                       "write START N DATA",
                                       "read START N [>FILE]",
                                       "check START N DATA",
                                       "commit TOKENS",
                                       "fork",
                                       "use SEQ|#K",
                                       "info",
                                       "offload",
                                       "restore",
                                       "close",
                                       "expect KEY VALUE"};
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
        expect(&r, 0, cmds[i], NULL);
}

static void test_call(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    KVCTL(&r, d, NULL, "--socket", d->sock, "call", "hello", "version=1");
    expect(&r, 0, "\"ok\":true", NULL);
    assert_true(one_json_object_line(r.out));
    KVCTL(&r, d, NULL, "--socket", d->sock, "call", "seq_info", "seq=s:abc");
    expect(&r, 1, "\"bad_request\"", NULL);
    KVCTL(&r, d, NULL, "--socket", d->sock, "call", "nope");
    expect(&r, 1, "\"unknown_op\"", NULL);
}

static void test_admin(void **state)
{
    struct kh_proc *d = *state;
    struct run r;
    KVCTL(&r, d, NULL, "--socket", d->sock, "admin", "check");
    expect(&r, 0, NULL, NULL);
    KVCTL(&r, d, NULL, "--socket", d->sock, "admin", "evict", "--json");
    expect(&r, 0, "\"ok\":true", NULL);
    KVCTL(&r, d, NULL, "--socket", d->sock, "admin", "evict", "lots");
    expect(&r, 2, NULL, "not a block count");
    KVCTL(&r, d, NULL, "--socket", d->sock, "admin", "reboot");
    expect(&r, 2, NULL, "unknown command");
    KVCTL(&r, d, NULL, "--socket", d->sock, "admin", "shutdown");
    expect(&r, 0, "shutting down", NULL);
    assert_int_equal(kh_wait(d), 0);
    KVCTL(&r, d, NULL, "--socket", d->sock, "status");
    expect(&r, 3, NULL, "cannot connect");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_checker),
        cmocka_unit_test_setup_teardown(test_status, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_generate_store_mode, setup, teardown),
        cmocka_unit_test_setup_teardown(test_usage_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_connect_error, setup, teardown),
        cmocka_unit_test_setup_teardown(test_seq_demo, setup, teardown),
        cmocka_unit_test_setup_teardown(test_seq_script, setup, teardown),
        cmocka_unit_test_setup_teardown(test_call, setup, teardown),
        cmocka_unit_test_setup_teardown(test_admin, setup, teardown),
    };
    if (!getenv("KVD_BIN") || !getenv("KVCTL_BIN")) {
        fprintf(stderr, "test_kvctl_cli: KVD_BIN/KVCTL_BIN not set (run through ctest)\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
