/* Integration test of the daemon's life: command line, socket file (mode
 * 0660, stale socket replaced, other files left alone), SIGTERM exits 0,
 * admin_shutdown, a client killed with -9 mid-request gives back exactly
 * what it held, and startup through systemd-socket-activate. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

static const char *const small_args[] = {
    "--backend", "cpu", "--block-tokens", "4", "--device-blocks", "32", "--host-blocks", "8", NULL};

static void nap_ms(int ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* Runs kvd with args (no socket) to its end and returns its exit status. */
static int run_kvd(const char *const *args)
{
    return kh_run(&(struct kh_opts){.args = args, .no_socket = true});
}

static void test_command_line(void **state)
{
    const char *help[] = {"--help", NULL}, *ver[] = {"--version", NULL},
               *bogus[] = {"--bogus", NULL}, *badnum[] = {"--device-blocks", "many", NULL},
               *badfrac[] = {"--gpu-mem", "1.5", NULL}, *extra[] = {"stray", NULL},
               *noconf[] = {"--config", "/nonexistent/kvd.conf", NULL},
               *badstep[] = {"--step-tokens", "0", NULL},
               *badqueue[] = {"--queue-timeout", "-5", NULL},
               *badthreads[] = {"--threads", "many", NULL},
               *okexec[] = {"--step-tokens", "256", "--step-seqs", "8", "--queue-timeout", "0",
                            "--threads",     "1",   "--help",      NULL};
    assert_int_equal(run_kvd(help), 0);
    assert_int_equal(run_kvd(ver), 0);
    assert_int_equal(run_kvd(bogus), 2);
    assert_int_equal(run_kvd(badnum), 2);
    assert_int_equal(run_kvd(badfrac), 2);
    assert_int_equal(run_kvd(extra), 2);
    assert_int_equal(run_kvd(noconf), 2);
    assert_int_equal(run_kvd(badstep), 2);
    assert_int_equal(run_kvd(badqueue), 2);
    assert_int_equal(run_kvd(badthreads), 2);
    assert_int_equal(run_kvd(okexec), 0);
}

static void test_bad_config_file(void **state)
{
    struct kh_proc p;
    /* kh_start fails because kvd exits with an error naming the line */
    assert_int_equal(kh_start(&p, "[limits]\nmax-seqs = lots\n", small_args), -1);
    kh_cleanup_dir(&p);
    assert_int_equal(kh_start(&p, "[nonsense]\nx = 1\n", small_args), -1);
    kh_cleanup_dir(&p);
    assert_int_equal(kh_start(&p, "[tenant:a b]\nuids = 1\n", small_args), -1);
    kh_cleanup_dir(&p);
}

/* The shipped example configuration loads (with small arenas from the
 * command line, which wins over its [server] section). */
static void test_example_config_loads(void **state)
{
    struct kh_proc p;
    const char *args[] = {"--config",
                          KVD_SOURCE_DIR "/systemd/kvd.conf.example",
                          "--backend",
                          "cpu",
                          "--device-blocks",
                          "8",
                          "--host-blocks",
                          "8",
                          "--kv-layers",
                          "2",
                          NULL};
    assert_int_equal(kh_start(&p, NULL, args), 0);
    int fd = kh_connect(p.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    const msgpack_object *kv = kh_obj(r.root, "kv");
    assert_int_equal(kh_u64(kv, "layers"), 2);     /* command line */
    assert_int_equal(kh_u64(kv, "head_dim"), 128); /* the file */
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

static void test_socket_mode_and_sigterm(void **state)
{
    struct kh_proc p;
    struct stat st;
    assert_int_equal(kh_start(&p, NULL, small_args), 0);
    assert_int_equal(lstat(p.sock, &st), 0);
    assert_true(S_ISSOCK(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0660);
    /* a second daemon on the same path refuses to steal it */
    struct kh_proc q;
    memset(&q, 0, sizeof(q));
    const char *argv[] = {"--socket", p.sock, NULL};
    assert_int_not_equal(run_kvd(argv), 0);
    /* a connected client with a sequence; SIGTERM still exits 0 */
    int fd = kh_connect(p.sock);
    assert_true(kh_seq_open(fd, 1) != 0);
    kill(p.pid, SIGTERM);
    assert_int_equal(kh_wait(&p), 0);
    assert_true(kh_peer_closed(fd));
    close(fd);
    assert_int_not_equal(lstat(p.sock, &st), 0); /* removed at exit */
    kh_cleanup_dir(&p);
}

static void test_sigterm_with_requests_in_pipe(void **state)
{
    struct kh_proc p;
    assert_int_equal(kh_start(&p, NULL, small_args), 0);
    int fd = kh_connect(p.sock);
    msgpack_sbuffer all;
    msgpack_sbuffer_init(&all);
    for (int i = 0; i < 200; i++) {
        struct kh_req q;
        kh_req_begin(&q, "stats", (uint64_t)i + 1, 0);
        proto_frame_end(&q.sb, q.at);
        msgpack_sbuffer_write(&all, q.sb.data, q.sb.size);
        msgpack_sbuffer_destroy(&q.sb);
    }
    assert_int_equal(kh_send_raw(fd, all.data, all.size), 0);
    msgpack_sbuffer_destroy(&all);
    kill(p.pid, SIGTERM);
    /* Every reply that arrives is whole, in order, and then the connection
     * closes; the daemon exits 0. */
    struct kh_reply r;
    uint64_t next = 1;
    while (kh_recv(fd, &r) == 0) {
        assert_int_equal(r.id, next);
        assert_true(r.code == KVD_OK || r.code == KVD_ECANCELLED);
        next++;
        kh_reply_free(&r);
    }
    assert_int_equal(kh_wait(&p), 0);
    close(fd);
    kh_cleanup_dir(&p);
}

static void test_stale_socket(void **state)
{
    char dir[] = "/tmp/kvdstale.XXXXXX", path[128];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/kvd.sock", dir);
    /* a socket file nobody listens on */
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, path);
    assert_int_equal(bind(s, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(s);
    const char *args[] = {"--socket", path, "--backend", "cpu", NULL};
    struct kh_proc p;
    assert_int_equal(kh_spawn(&p, &(struct kh_opts){.args = args, .no_socket = true}), 0);
    int fd = kh_connect(path);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);

    /* a regular file is never removed */
    FILE *f = fopen(path, "w");
    fputs("precious", f);
    fclose(f);
    const char *args2[] = {"--socket", path, NULL};
    assert_int_not_equal(run_kvd(args2), 0);
    struct stat st;
    assert_int_equal(lstat(path, &st), 0);
    assert_true(S_ISREG(st.st_mode));
    unlink(path);
    rmdir(dir);
}

static void test_admin_shutdown(void **state)
{
    struct kh_proc p;
    assert_int_equal(kh_start(&p, NULL, small_args), 0);
    int fd = kh_connect(p.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "admin_shutdown", 1, &r), 0);
    kh_reply_free(&r);
    assert_true(kh_peer_closed(fd));
    close(fd);
    assert_int_equal(kh_wait(&p), 0);
    kh_cleanup_dir(&p);
}

struct victim {
    const char *sock;
    int ready; /* pipe write end */
};

/* Holds sequences (private, forked, committed, offloaded) and is killed in
 * the middle of sending a kv_write frame. */
static int victim_main(void *arg)
{
    struct victim *v = arg;
    struct kh_reply r;
    struct kh_req q;
    int fd = kh_connect(v->sock);
    uint32_t toks[8] = {9, 8, 7, 6, 5, 4, 3, 2};
    uint64_t s = kh_seq_open(fd, 1), s2 = kh_seq_open(fd, 2);
    if (!s || !s2)
        return 1;
    kh_req_begin(&q, "seq_extend", 3, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "n", 10);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r) || r.code)
        return 2;
    kh_reply_free(&r);
    kh_req_begin(&q, "seq_commit", 4, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 8);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r) || r.code)
        return 3;
    kh_reply_free(&r);
    if (kh_call1(fd, "seq_fork", 5, "seq", s, &r) != 0)
        return 4;
    kh_reply_free(&r);
    kh_req_begin(&q, "seq_extend", 6, 2);
    proto_pack_kv_uint(&q.pk, "seq", s2);
    proto_pack_kv_uint(&q.pk, "n", 8);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r) || r.code)
        return 5;
    kh_reply_free(&r);
    if (kh_call1(fd, "seq_offload", 7, "seq", s2, &r) != 0)
        return 6;
    kh_reply_free(&r);
    /* half of a kv_write frame */
    static uint8_t data[8 * 4096];
    kh_req_begin(&q, "kv_write", 8, 4);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "start", 0);
    proto_pack_kv_uint(&q.pk, "n", 8);
    proto_pack_kv_bin(&q.pk, "data", data, sizeof(data));
    proto_frame_end(&q.sb, q.at);
    if (kh_send_raw(fd, q.sb.data, q.sb.size / 2))
        return 7;
    if (write(v->ready, "r", 1) != 1)
        return 8;
    for (;;)
        pause();
}

static void test_kill9_client_releases_everything(void **state)
{
    struct kh_proc p;
    assert_int_equal(kh_start(&p, NULL, small_args), 0);
    int fd = kh_connect(p.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "admin_evict", 1, &r), 0);
    kh_reply_free(&r);
    uint64_t free0 = kh_stat(fd, "device", "free"), used0 = kh_stat(fd, "device", "used");
    uint64_t hfree0 = kh_stat(fd, "host", "free"), seqs0 = kh_stat(fd, "counters", "seqs");

    int pp[2];
    assert_int_equal(pipe(pp), 0);
    struct victim v = {p.sock, pp[1]};
    fflush(NULL);
    pid_t child = fork();
    if (child == 0)
        _exit(victim_main(&v));
    char c;
    assert_int_equal(read(pp[0], &c, 1), 1);
    /* the victim holds blocks now */
    assert_true(kh_stat(fd, "device", "used") > used0);
    kill(child, SIGKILL);
    assert_int_equal(kh_child_status(child), -1);
    close(pp[0]);
    close(pp[1]);

    /* The daemon sees the close on its loop; wait for it (bounded). */
    for (int i = 0; i < 3000 && kh_stat(fd, "counters", "seqs") != seqs0; i++)
        nap_ms(10);
    assert_int_equal(kh_stat(fd, "counters", "seqs"), seqs0);
    assert_int_equal(kh_call0(fd, "admin_check", 2, &r), 0);
    kh_reply_free(&r);
    /* Committed blocks stay cached (that is the point of the cache); once
     * evicted, the pool is exactly as before. */
    struct kh_req q;
    for (int tier = 0; tier < 2; tier++) {
        kh_req_begin(&q, "admin_evict", 3, 1);
        proto_pack_kv_str(&q.pk, "tier", tier ? "host" : "device");
        assert_int_equal(kh_req_send(fd, &q), 0);
        assert_int_equal(kh_recv(fd, &r), 0);
        kh_expect(&r, 0);
        kh_reply_free(&r);
    }
    assert_int_equal(kh_stat(fd, "device", "used"), used0);
    assert_int_equal(kh_stat(fd, "device", "free"), free0);
    assert_int_equal(kh_stat(fd, "host", "free"), hfree0);
    assert_int_equal(kh_call0(fd, "admin_check", 4, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

/* 160 pipelined 1 MiB kv_reads (more than the 64 MiB of queued output at
 * which kvd stops reading a connection): a client that reads while it
 * writes gets every reply, whole and in order, as kvd pauses and resumes. */
static void test_backpressure(void **state)
{
    struct kh_proc p;
    const char *args[] = {"--backend", "cpu", "--device-blocks", "32", "--host-blocks", "0", NULL};
    enum { N = 160, TOKENS = 256, TOKEN_BYTES = 4096 };
    assert_int_equal(kh_start(&p, NULL, args), 0);
    int fd = kh_connect(p.sock);
    struct kh_reply r;
    uint64_t s = kh_seq_open(fd, 1);
    struct kh_req q;
    kh_req_begin(&q, "seq_extend", 2, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "n", TOKENS);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);

    fcntl(fd, F_SETFL, O_NONBLOCK);
    size_t cap = (size_t)2 * TOKENS * TOKEN_BYTES, have = 0;
    uint8_t *in = malloc(cap);
    msgpack_sbuffer out;
    msgpack_sbuffer_init(&out);
    size_t out_off = 0;
    unsigned sent = 0, got = 0;
    assert_non_null(in);
    while (got < N) {
        if (out_off == out.size && sent < N) {
            out.size = out_off = 0;
            struct kh_req rq;
            kh_req_begin(&rq, "kv_read", 100 + sent, 3);
            proto_pack_kv_uint(&rq.pk, "seq", s);
            proto_pack_kv_uint(&rq.pk, "start", 0);
            proto_pack_kv_uint(&rq.pk, "n", TOKENS);
            proto_frame_end(&rq.sb, rq.at);
            msgpack_sbuffer_write(&out, rq.sb.data, rq.sb.size);
            msgpack_sbuffer_destroy(&rq.sb);
            sent++;
        }
        struct pollfd pfd = {fd, POLLIN | (out_off < out.size ? POLLOUT : 0), 0};
        assert_true(poll(&pfd, 1, 30000) > 0);
        if (pfd.revents & POLLOUT) {
            ssize_t w = send(fd, out.data + out_off, out.size - out_off, MSG_NOSIGNAL);
            if (w > 0)
                out_off += (size_t)w;
        }
        if (pfd.revents & POLLIN) {
            ssize_t n = read(fd, in + have, cap - have);
            assert_true(n > 0 || (n < 0 && errno == EAGAIN));
            if (n > 0)
                have += (size_t)n;
            size_t len;
            while (proto_frame_peek(in, have, cap, &len) == PROTO_FRAME_READY) {
                struct proto_msg m;
                struct kvd_error e;
                assert_int_equal(proto_msg_parse(&m, in + 4, len, &e), 0);
                assert_int_equal(proto_msg_id(&m), 100 + got);
                const msgpack_object *d = proto_map_find(m.root, "data");
                assert_non_null(d);
                assert_int_equal(d->via.bin.size, (size_t)TOKENS * TOKEN_BYTES);
                proto_msg_free(&m);
                memmove(in, in + 4 + len, have - 4 - len);
                have -= 4 + len;
                got++;
            }
        }
    }
    free(in);
    msgpack_sbuffer_destroy(&out);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

/* Reads notify datagrams until one contains `want` (or none comes). */
static bool notify_wait(int ns, const char *want, char *all, size_t cap)
{
    for (int i = 0; i < 200; i++) {
        struct pollfd pfd = {ns, POLLIN, 0};
        if (poll(&pfd, 1, 30000) <= 0)
            return false;
        char buf[512];
        ssize_t n = recv(ns, buf, sizeof(buf) - 1, 0);
        if (n <= 0)
            return false;
        buf[n] = '\0';
        strncat(all, buf, cap - strlen(all) - 1);
        strncat(all, "|", cap - strlen(all) - 1);
        if (strstr(buf, want))
            return true;
    }
    return false;
}

/* Type=notify: READY=1 once serving, WATCHDOG=1 pings at WATCHDOG_USEC/2,
 * RELOADING=1 then READY=1 around SIGHUP, STOPPING=1 at SIGTERM. */
static void test_sd_notify(void **state)
{
    char dir[] = "/tmp/kvdnfy.XXXXXX", nsock[128], sock[128];
    assert_non_null(mkdtemp(dir));
    snprintf(nsock, sizeof(nsock), "%s/notify", dir);
    snprintf(sock, sizeof(sock), "%s/kvd.sock", dir);
    int ns = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, nsock);
    assert_int_equal(bind(ns, (struct sockaddr *)&sa, sizeof(sa)), 0);
    /* WATCHDOG_PID unset: the watchdog is the daemon's whatever its pid. */
    char notify_env[160];
    snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", nsock);
    const char *env[] = {notify_env, "WATCHDOG_USEC=100000", NULL}; /* pings every 50 ms */
    const char *args[] = {"--socket", sock, "--backend", "cpu", NULL};
    struct kh_proc p;
    assert_int_equal(kh_spawn(&p, &(struct kh_opts){.args = args, .env = env, .no_socket = true}),
                     0);
    char all[4096] = "";
    assert_true(notify_wait(ns, "READY=1", all, sizeof(all)));
    assert_true(notify_wait(ns, "WATCHDOG=1", all, sizeof(all)));
    assert_true(notify_wait(ns, "WATCHDOG=1", all, sizeof(all)));
    kill(p.pid, SIGHUP);
    assert_true(notify_wait(ns, "RELOADING=1", all, sizeof(all)));
    assert_true(notify_wait(ns, "READY=1", all, sizeof(all)));
    kill(p.pid, SIGTERM);
    assert_true(notify_wait(ns, "STOPPING=1", all, sizeof(all)));
    assert_int_equal(kh_wait(&p), 0);
    kh_cleanup_dir(&p);
    close(ns);
    unlink(nsock);
    rmdir(dir);
}

/* A non-root kvd without --socket that cannot write /run/kvd listens on
 * $XDG_RUNTIME_DIR/kvd.sock. */
static void test_default_socket_fallback(void **state)
{
    if (geteuid() != 0)
        skip(); /* the child needs setuid */
    char dir[] = "/tmp/kvdxdg.XXXXXX", sock[128];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(chown(dir, 60001, 65534), 0);
    snprintf(sock, sizeof(sock), "%s/kvd.sock", dir);
    char xdg[160];
    snprintf(xdg, sizeof(xdg), "XDG_RUNTIME_DIR=%s", dir);
    const char *env[] = {xdg, NULL};
    const char *args[] = {"--backend", "cpu", "--device-blocks", "8", "--host-blocks", "0", NULL};
    struct kh_proc p;
    assert_int_equal(kh_spawn(&p, &(struct kh_opts){.args = args,
                                                    .env = env,
                                                    .no_socket = true,
                                                    .as_user = true,
                                                    .uid = 60001,
                                                    .gid = 65534}),
                     0);
    int fd = kh_connect(sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
    rmdir(dir);
}

/* Out of file descriptors: accept fails, kvd pauses accepting instead of
 * spinning or dying, serves the connections it has, and takes the waiting
 * ones as descriptors free up. */
static void test_fd_exhaustion(void **state)
{
    enum { N = 48 };
    char dir[] = "/tmp/kvdfd.XXXXXX", sock[128];
    assert_non_null(mkdtemp(dir));
    snprintf(sock, sizeof(sock), "%s/kvd.sock", dir);
    const char *args[] = {"--socket",      sock, "--backend", "cpu", "--device-blocks", "8",
                          "--host-blocks", "0",  NULL};
    struct kh_proc p;
    assert_int_equal(kh_spawn(&p, &(struct kh_opts){.args = args, .no_socket = true, .nofile = 32}),
                     0);
    int fds[N];
    fds[0] = kh_connect(sock);
    assert_true(fds[0] >= 0);
    for (int i = 1; i < N; i++) {
        fds[i] = kh_connect(sock); /* queued in the backlog when not accepted */
        assert_true(fds[i] >= 0);
    }
    for (int i = 0; i < N; i++) {
        struct kh_req q;
        kh_req_begin(&q, "hello", (uint64_t)i + 1, 0);
        assert_int_equal(kh_req_send(fds[i], &q), 0);
    }
    struct kh_reply r;
    assert_int_equal(kh_recv(fds[0], &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    /* free descriptors: the rest are served */
    for (int i = 0; i < N / 2; i++)
        close(fds[i]);
    for (int i = N / 2; i < N; i++) {
        assert_int_equal(kh_recv(fds[i], &r), 0);
        assert_int_equal(r.id, (uint64_t)i + 1);
        kh_reply_free(&r);
        close(fds[i]);
    }
    assert_int_equal(kh_stop(&p), 0);
    rmdir(dir);
}

static void test_socket_activation(void **state)
{
    /* As systemd does: the listener as fd 3, LISTEN_PID and LISTEN_FDS=1. */
    char dir[] = "/tmp/kvdsa.XXXXXX", path[96];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/kvd.sock", dir);
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sun = {.sun_family = AF_UNIX};
    snprintf(sun.sun_path, sizeof(sun.sun_path), "%s", path);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sun, sizeof(sun)), 0);
    assert_int_equal(listen(lfd, 16), 0);
    const char *args[] = {"--backend", "cpu", NULL};
    struct kh_proc p;
    assert_int_equal(
        kh_spawn(&p, &(struct kh_opts){.args = args, .no_socket = true, .pass_fd = lfd}), 0);
    close(lfd);
    int fd = kh_connect(path);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    assert_int_equal(kh_u64(r.root, "version"), 1);
    kh_reply_free(&r);
    uint64_t s = kh_seq_open(fd, 2);
    assert_true(s != 0);
    /* a second client on the same activated socket */
    int fd2 = kh_connect(path);
    assert_int_equal(kh_call1(fd2, "seq_info", 3, "seq", s, &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    close(fd2);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_command_line),
        cmocka_unit_test(test_bad_config_file),
        cmocka_unit_test(test_example_config_loads),
        cmocka_unit_test(test_socket_mode_and_sigterm),
        cmocka_unit_test(test_sigterm_with_requests_in_pipe),
        cmocka_unit_test(test_stale_socket),
        cmocka_unit_test(test_admin_shutdown),
        cmocka_unit_test(test_kill9_client_releases_everything),
        cmocka_unit_test(test_backpressure),
        cmocka_unit_test(test_sd_notify),
        cmocka_unit_test(test_default_socket_fallback),
        cmocka_unit_test(test_fd_exhaustion),
        cmocka_unit_test(test_socket_activation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
