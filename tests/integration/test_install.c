/* `cmake --install` into a DESTDIR: the installed kvd.service must start
 * as written, and say the project's version (`--version`, hello). Its
 * ExecStart binary and --config file exist (a default kvd.conf is
 * installed, and kept on reinstall), every Documentation= file exists, the
 * paths follow the install prefix, and the installed kvd runs with the
 * installed config. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

struct unit {
    char exec[512], config[512];
    char docs[8][512];
    int n_docs;
};

static void sh(const char *fmt, ...)
{
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    if (rc != 0)
        fail_msg("`%s` failed (%d)", cmd, rc);
}

static void install(const char *destdir, const char *prefix)
{
    sh("DESTDIR='%s' '%s' --install '%s' --prefix '%s' >'%s.log' 2>&1 || { cat '%s.log'; exit 1; }",
       destdir, KVD_CMAKE_COMMAND, KVD_BUILD_DIR, prefix, destdir, destdir);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        fail_msg("cannot open %s", path);
    static char buf[16384];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return buf;
}

static void read_unit(const char *destdir, const char *prefix, struct unit *u)
{
    char path[512];
    memset(u, 0, sizeof(*u));
    snprintf(path, sizeof(path), "%s%s/lib/systemd/system/kvd.service", destdir, prefix);
    char *text = slurp(path);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "ExecStart=", 10)) {
            char opt[32];
            if (sscanf(line + 10, "%511s %31s %511s", u->exec, opt, u->config) != 3 ||
                strcmp(opt, "--config") != 0)
                fail_msg("unexpected %s", line);
        } else if (!strncmp(line, "Documentation=", 14)) {
            char *save = NULL;
            for (char *w = strtok_r(line + 14, " ", &save); w && u->n_docs < 8;
                 w = strtok_r(NULL, " ", &save)) {
                if (strncmp(w, "file://", 7) != 0)
                    fail_msg("Documentation= %s is not a file:// URL", w);
                snprintf(u->docs[u->n_docs++], sizeof(u->docs[0]), "%s", w + 7);
            }
        }
    }
    assert_true(u->exec[0] && u->config[0]);
    assert_true(u->n_docs > 0);
}

static void assert_installed(const char *destdir, const char *path, int mode)
{
    char full[1024];
    snprintf(full, sizeof(full), "%s%s", destdir, path);
    if (access(full, mode) != 0)
        fail_msg("%s is not installed (%s)", path, full);
}

static char *mkdest(void)
{
    static char dir[64];
    snprintf(dir, sizeof(dir), "/tmp/kvd-install-XXXXXX");
    assert_non_null(mkdtemp(dir));
    return dir;
}

static void test_unit_starts_as_installed(void **state)
{
    char *dest = mkdest();
    struct unit u;
    install(dest, "/usr");
    read_unit(dest, "/usr", &u);
    assert_string_equal(u.exec, "/usr/sbin/kvd");
    assert_string_equal(u.config, "/etc/kvd/kvd.conf");
    assert_installed(dest, u.exec, X_OK);
    assert_installed(dest, u.config, R_OK);
    assert_installed(dest, "/etc/kvd/kvd.conf.example", R_OK);
    assert_installed(dest, "/usr/lib/systemd/system/kvd.socket", R_OK);
    for (int i = 0; i < u.n_docs; i++)
        assert_installed(dest, u.docs[i], R_OK);

    /* Its version is the project's (CMake's project(VERSION)). */
    char cmd[1200], line[128] = "";
    snprintf(cmd, sizeof(cmd), "'%s%s' --version", dest, u.exec);
    FILE *v = popen(cmd, "r");
    assert_non_null(v);
    assert_non_null(fgets(line, sizeof(line), v));
    assert_int_equal(pclose(v), 0);
    assert_string_equal(line, "kvd " KVD_PROJECT_VERSION " (protocol 1)\n");

    /* The installed binary with the installed config, as the unit runs it
     * (the socket is ours: kvd.socket would pass its own). */
    char bin[1024], conf[1024];
    snprintf(bin, sizeof(bin), "%s%s", dest, u.exec);
    snprintf(conf, sizeof(conf), "%s%s", dest, u.config);
    setenv("KVD_BIN", bin, 1);
    /* The installed config keeps cached blocks in /var/cache/kvd (the
     * unit's CacheDirectory): here a small one in the test's own tree. */
    char cache[1100];
    snprintf(cache, sizeof(cache), "%s/kvd-cache", dest);
    const char *args[] = {"--config",         conf, "--backend", "cpu", "--disk-dir", cache,
                          "--disk-max-bytes", "4M", NULL};
    struct kh_proc p;
    assert_int_equal(kh_start(&p, NULL, args), 0);
    int fd = kh_connect(p.sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    const msgpack_object *server = kh_obj(r.root, "server");
    assert_non_null(server);
    assert_int_equal(server->type, MSGPACK_OBJECT_STR);
    assert_int_equal(server->via.str.size, strlen("kvd " KVD_PROJECT_VERSION));
    assert_memory_equal(server->via.str.ptr, "kvd " KVD_PROJECT_VERSION, server->via.str.size);
    assert_true(kh_obj(r.root, "disk")->via.boolean);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);

    /* A reinstall keeps the administrator's kvd.conf. */
    char path[1024];
    snprintf(path, sizeof(path), "%s/etc/kvd/kvd.conf", dest);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("# edited\n[server]\nlog-level = debug\n", f);
    fclose(f);
    install(dest, "/usr");
    assert_string_equal(slurp(path), "# edited\n[server]\nlog-level = debug\n");
    sh("rm -rf '%s' '%s.log'", dest, dest);
}

static void test_paths_follow_the_prefix(void **state)
{
    char *dest = mkdest();
    struct unit u;
    install(dest, "/opt/kvd");
    read_unit(dest, "/opt/kvd", &u);
    assert_string_equal(u.exec, "/opt/kvd/sbin/kvd");
    assert_string_equal(u.config, "/opt/kvd/etc/kvd/kvd.conf");
    assert_installed(dest, u.exec, X_OK);
    assert_installed(dest, u.config, R_OK);
    for (int i = 0; i < u.n_docs; i++) {
        assert_true(!strncmp(u.docs[i], "/opt/kvd/share/doc/kvd/", 23));
        assert_installed(dest, u.docs[i], R_OK);
    }
    sh("rm -rf '%s' '%s.log'", dest, dest);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unit_starts_as_installed),
        cmocka_unit_test(test_paths_follow_the_prefix),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
