/* Hardening against hostile local clients, each against a real
 * kvd serving a small random model: queued generates are limited per
 * connection and per tenant (`busy` naming the limit), `generate` with an
 * unknown `seq` is not_found, a non-admin's stats hold nothing about other
 * tenants, a FIFO as --model and a directory as --config are refused at
 * start. Tests that need setuid children skip without root. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

static char g_dir[64], g_model[128];

static int group_setup(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[512];
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvd-hard-XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    chmod(g_dir, 0711); /* setuid children reach sockets inside */
    snprintf(g_model, sizeof(g_model), "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof(cmd),
             "'%s/kvd-gguf-gen' -o '%s' --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 256 --type f32 >/dev/null",
             tools, g_model);
    return system(cmd) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    unlink(g_model);
    rmdir(g_dir);
    return 0;
}

/* Starts kvd on the test model with extra args (NULL-terminated). */
static void start_model(struct kh_proc *p, const char *conf, const char *const *extra)
{
    const char *args[40] = {
        "--model",       g_model, "--backend",          "cpu", "--device-blocks", "256",
        "--host-blocks", "64",    "--no-roofline-probe"};
    int n = 9;
    for (int i = 0; extra && extra[i] && n < 39; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(kh_start(p, conf, args), 0);
}

static void pack_gen(struct kh_req *q, uint64_t id, uint32_t max_tokens)
{
    static const uint32_t toks[4] = {1, 2, 3, 4};
    kh_req_begin(q, "generate", id, 2);
    proto_pack_kv_u32_array(&q->pk, "tokens", toks, 4);
    proto_pack_kv_uint(&q->pk, "max_tokens", max_tokens);
}

/* Sends n generates in ONE write (so the daemon takes them all in one read,
 * before any of them can be answered) and counts the replies: *ok answered
 * normally, *busy answered busy with `limit` in the message. */
static void pipeline(int fd, unsigned n, const char *limit, unsigned *ok, unsigned *busy)
{
    msgpack_sbuffer all;
    msgpack_sbuffer_init(&all);
    for (unsigned i = 0; i < n; i++) {
        struct kh_req q;
        pack_gen(&q, 1 + i, 2);
        assert_int_equal(proto_frame_end(&q.sb, q.at), 0);
        msgpack_sbuffer_write(&all, q.sb.data, q.sb.size);
        msgpack_sbuffer_destroy(&q.sb);
    }
    assert_int_equal(kh_send_raw(fd, all.data, all.size), 0);
    msgpack_sbuffer_destroy(&all);
    *ok = *busy = 0;
    for (unsigned i = 0; i < n; i++) {
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.code == 0)
            (*ok)++;
        else if (r.code == KVD_EBUSY && strstr(r.message, limit))
            (*busy)++;
        else
            fail_msg("reply %llu: code %d '%s'", (unsigned long long)r.id, r.code, r.message);
        kh_reply_free(&r);
    }
}

/* Defect 1: queued generates per connection and per tenant are limited. */
static void test_queue_limits(void **state)
{
    (void)state;
    struct kh_proc p;
    unsigned ok, busy;
    const char *per_conn[] = {"--max-queued-per-connection", "3", NULL};
    start_model(&p, NULL, per_conn);
    int fd = kh_connect(p.sock);
    pipeline(fd, 10, "max-queued-per-connection = 3", &ok, &busy);
    assert_int_equal(ok, 3);
    assert_int_equal(busy, 7);
    /* answered: the connection may queue again */
    pipeline(fd, 3, "max-queued-per-connection", &ok, &busy);
    assert_int_equal(ok, 3);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);

    const char *per_tenant[] = {"--max-queued-per-tenant", "4", NULL};
    start_model(&p, NULL, per_tenant);
    fd = kh_connect(p.sock);
    pipeline(fd, 10, "max-queued-per-tenant = 4", &ok, &busy);
    assert_int_equal(ok, 4);
    assert_int_equal(busy, 6);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

/* Defect 10: generate with an unknown or another connection's seq is
 * not_found, like every other op. */
static void test_generate_foreign_seq(void **state)
{
    (void)state;
    struct kh_proc p;
    start_model(&p, NULL, NULL);
    int a = kh_connect(p.sock), b = kh_connect(p.sock);
    uint64_t s = kh_seq_open(a, 1);
    assert_true(s != 0);
    uint64_t handles[2] = {s, 987654321};
    for (int i = 0; i < 2; i++) {
        struct kh_req q;
        struct kh_reply r;
        static const uint32_t toks[2] = {1, 2};
        kh_req_begin(&q, "generate", 10 + (uint64_t)i, 3);
        proto_pack_kv_u32_array(&q.pk, "tokens", toks, 2);
        proto_pack_kv_uint(&q.pk, "max_tokens", 2);
        proto_pack_kv_uint(&q.pk, "seq", handles[i]);
        assert_int_equal(kh_req_send(b, &q), 0);
        assert_int_equal(kh_recv(b, &r), 0);
        kh_expect(&r, KVD_ENOTFOUND);
        assert_non_null(strstr(r.message, "'seq'"));
        kh_reply_free(&r);
    }
    close(a);
    close(b);
    assert_int_equal(kh_stop(&p), 0);
}

/* ---- stats seen by a non-admin ------------------------------------------ */

static struct kh_proc g_stats_kvd;

/* As a non-admin: stats carries the pool's size and its own tenant only. */
static int stats_child(void *arg)
{
    (void)arg;
    struct kh_reply r;
    int fd = kh_connect(g_stats_kvd.sock);
    if (fd < 0)
        return 10;
    if (kh_call0(fd, "stats", 1, &r) != 0)
        return 11;
    static const char *const hidden[] = {"counters", "requests", "roofline", "connections",
                                         "in_flight"};
    for (size_t i = 0; i < sizeof(hidden) / sizeof(hidden[0]); i++)
        if (kh_obj(r.root, hidden[i]))
            return 20 + (int)i;
    const msgpack_object *dev = kh_obj(r.root, "device");
    if (!dev || kh_u64(dev, "total") != 256 || kh_obj(dev, "free") || kh_obj(dev, "used"))
        return 30;
    const msgpack_object *ts = kh_obj(r.root, "tenants");
    if (!ts || ts->type != MSGPACK_OBJECT_ARRAY || ts->via.array.size != 1)
        return 31;
    const msgpack_object *name = kh_obj(&ts->via.array.ptr[0], "name");
    if (!name || name->via.str.size != 9 || memcmp(name->via.str.ptr, "uid:60001", 9))
        return 32;
    kh_reply_free(&r);
    close(fd);
    return 0;
}

/* Defect 10: per-tenant and daemon-wide figures are admin-only. */
static void test_stats_non_admin(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    const char *group[] = {"--socket-group", "nogroup", NULL};
    start_model(&g_stats_kvd, NULL, group);
    /* some traffic by the admin (root) first */
    int fd = kh_connect(g_stats_kvd.sock);
    unsigned ok, busy;
    pipeline(fd, 2, "-", &ok, &busy);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", 50, &r), 0);
    assert_non_null(kh_obj(r.root, "counters"));
    assert_non_null(kh_obj(r.root, "requests"));
    kh_reply_free(&r);
    pid_t c = kh_run_as(60001, 65534, stats_child, NULL);
    assert_int_equal(kh_child_status(c), 0);
    close(fd);
    assert_int_equal(kh_stop(&g_stats_kvd), 0);
}

/* ---- connection slots ----------------------------------------------------- */

static struct kh_proc g_slots_kvd;

struct slots_ctx {
    int to_parent, from_parent;
    int n_ok;            /* connections that must be accepted */
    const char *refusal; /* text in the next one's refusal */
};

/* Opens n_ok connections (each answers hello), then one more that must be
 * refused `busy` naming the limit; reports to the parent and holds its
 * connections until told to go. */
static int slots_child(void *arg)
{
    struct slots_ctx *x = arg;
    int fds[16];
    struct kh_reply r;
    for (int i = 0; i < x->n_ok; i++) {
        fds[i] = kh_connect(g_slots_kvd.sock);
        if (fds[i] < 0 || kh_call0(fds[i], "hello", 1, &r) != 0)
            return 10 + i;
        kh_reply_free(&r);
    }
    int extra = kh_connect(g_slots_kvd.sock);
    if (extra < 0 || kh_recv(extra, &r) != 0)
        return 30;
    if (r.code != KVD_EBUSY || !strstr(r.message, x->refusal))
        return 31;
    kh_reply_free(&r);
    if (!kh_peer_closed(extra))
        return 32;
    close(extra);
    char c = 'r';
    if (write(x->to_parent, &c, 1) != 1 || read(x->from_parent, &c, 1) != 1)
        return 33;
    return 0;
}

/* Defect 4: a uid holds at most max-connections-per-uid connections, and
 * the last admin-reserved-connections slots are for admins only. */
static void test_connection_slots(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    const char *lim[] = {"--socket-group",
                         "nogroup",
                         "--max-connections",
                         "6",
                         "--admin-reserved-connections",
                         "2",
                         "--max-connections-per-uid",
                         "3",
                         NULL};
    start_model(&g_slots_kvd, NULL, lim);
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    /* uid 60001: 3 connections, the 4th is over its per-uid limit */
    struct slots_ctx a = {up[1], down[0], 3, "max-connections-per-uid"};
    pid_t pa = kh_run_as(60001, 65534, slots_child, &a);
    char c;
    if (read(up[0], &c, 1) != 1)
        fail_msg("uid 60001 child failed at step %d", kh_child_status(pa));
    /* uid 60002: one connection (4 of 6), the next would take an admin slot */
    struct slots_ctx b = {up[1], down[0], 1, "admin-reserved-connections"};
    pid_t pb = kh_run_as(60002, 65534, slots_child, &b);
    if (read(up[0], &c, 1) != 1)
        fail_msg("uid 60002 child failed at step %d", kh_child_status(pb));
    /* the admin (root) takes the two reserved slots; a 7th is refused */
    int r1 = kh_connect(g_slots_kvd.sock), r2 = kh_connect(g_slots_kvd.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(r1, "hello", 1, &r), 0);
    kh_reply_free(&r);
    assert_int_equal(kh_call0(r2, "hello", 1, &r), 0);
    kh_reply_free(&r);
    int r3 = kh_connect(g_slots_kvd.sock);
    assert_int_equal(kh_recv(r3, &r), 0);
    kh_expect(&r, KVD_EBUSY);
    assert_non_null(strstr(r.message, "limit 6"));
    kh_reply_free(&r);
    close(r3);
    assert_int_equal(write(down[1], "gg", 2), 2);
    assert_int_equal(kh_child_status(pa), 0);
    assert_int_equal(kh_child_status(pb), 0);
    close(r1);
    close(r2);
    for (int i = 0; i < 2; i++) {
        close(up[i]);
        close(down[i]);
    }
    assert_int_equal(kh_stop(&g_slots_kvd), 0);
}

/* ---- resource limits ------------------------------------------------------ */

static void gen_stream(int fd, uint64_t id, uint32_t max_tokens)
{
    static const uint32_t toks[4] = {1, 2, 3, 4};
    struct kh_req q;
    kh_req_begin(&q, "generate", id, 3);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 4);
    proto_pack_kv_uint(&q.pk, "max_tokens", max_tokens);
    proto_pack_kv_bool(&q.pk, "stream", true);
    assert_int_equal(kh_req_send(fd, &q), 0);
}

/* Polls (stats on another connection) until no request is live. */
static void wait_idle(int ctl, uint64_t submitted)
{
    while (kh_stat(ctl, "requests", "submitted") < submitted ||
           kh_stat(ctl, "requests", "live") != 0) {
        struct timespec ts = {0, 5 * 1000000};
        nanosleep(&ts, NULL);
    }
}

/* Defect 2: a streaming client that never reads. Its 100 generates of 250
 * tokens make ~750 KB of events, far over max-unread-output (64K) plus
 * what the kernel's socket buffer holds: once its unread output passes the
 * limit, its generates end with `busy` naming the limit (the events are
 * packed in the connection's buffer, not a block each). Once it has read,
 * it is served again. */
static void test_noread_stream_bounded(void **state)
{
    (void)state;
    struct kh_proc p;
    const char *lim[] = {"--max-unread-output", "64K", NULL};
    start_model(&p, NULL, lim);
    int ctl = kh_connect(p.sock), fd = kh_connect(p.sock);
    uint64_t sub0 = kh_stat(ctl, "requests", "submitted");
    for (unsigned i = 0; i < 100; i++)
        gen_stream(fd, 1 + i, 250);
    wait_idle(ctl, sub0 + 100);
    unsigned finals = 0, busy = 0, events = 0;
    while (finals < 100) {
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.code == 0 && kh_obj(r.root, "event")) {
            events++;
        } else {
            finals++;
            if (r.code == KVD_EBUSY) {
                assert_non_null(strstr(r.message, "max-unread-output"));
                busy++;
            } else {
                kh_expect(&r, 0);
            }
        }
        kh_reply_free(&r);
    }
    print_message("non-reading client: %u events delivered, %u of 100 generates ended busy\n",
                  events, busy);
    assert_true(busy > 0);
    assert_true(events < 100 * 250);
    /* it has read everything: generates are taken again */
    unsigned ok, b2;
    pipeline(fd, 2, "-", &ok, &b2);
    assert_int_equal(ok, 2);
    close(fd);
    close(ctl);
    assert_int_equal(kh_stop(&p), 0);
}

/* Defect 3: the daemon-wide budget of buffered bytes. A client sends 3 MB
 * of a 60 MB frame (incomplete input is buffered) over a 2M budget: that
 * connection is dropped; another client is served as before. */
static void test_buffer_budget(void **state)
{
    (void)state;
    struct kh_proc p;
    const char *lim[] = {"--max-buffered", "2M", "--max-frame", "64M", NULL};
    start_model(&p, NULL, lim);
    int good = kh_connect(p.sock), bad = kh_connect(p.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(good, "hello", 1, &r), 0);
    kh_reply_free(&r);
    size_t n = 3u << 20;
    uint8_t *buf = calloc(1, n);
    assert_non_null(buf);
    uint32_t len = 60u << 20;
    buf[0] = (uint8_t)(len >> 24);
    buf[1] = (uint8_t)(len >> 16);
    buf[2] = (uint8_t)(len >> 8);
    buf[3] = (uint8_t)len;
    signal(SIGPIPE, SIG_IGN);
    /* the write may fail part-way once the daemon drops the connection */
    (void)kh_send_raw(bad, buf, n);
    free(buf);
    assert_true(kh_peer_closed(bad));
    assert_int_equal(kh_call0(good, "hello", 2, &r), 0);
    kh_reply_free(&r);
    close(bad);
    close(good);
    assert_int_equal(kh_stop(&p), 0);
}

/* Defect 7 (logs): 300 connections that each send a malformed frame make
 * the daemon log at most a handful of lines about it (10 per 10 s per
 * message, then one line counting the rest), not one per frame. */
static void test_log_rate_limited(void **state)
{
    (void)state;
    struct kh_proc p;
    const char *lvl[] = {"--log-level", "info", NULL};
    start_model(&p, NULL, lvl);
    static const uint8_t junk[8] = {0, 0, 0, 4, 0xc1, 0xc1, 0xc1, 0xc1}; /* 0xc1: never valid */
    for (int i = 0; i < 300; i++) {
        int fd = kh_connect(p.sock);
        assert_true(fd >= 0);
        assert_int_equal(kh_send_raw(fd, junk, sizeof(junk)), 0);
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0); /* the error reply, then close */
        assert_int_not_equal(r.code, 0);
        kh_reply_free(&r);
        close(fd);
    }
    kill(p.pid, SIGTERM); /* then the daemon's log (the fixture's) before it is removed */
    assert_int_equal(kh_wait(&p), 0);
    FILE *f = fopen(p.log, "r");
    assert_non_null(f);
    char line[2048];
    unsigned closing = 0, lines = 0;
    while (fgets(line, sizeof(line), f)) {
        lines++;
        closing += strstr(line, "; closing") != NULL;
    }
    fclose(f);
    kh_cleanup_dir(&p);
    print_message("300 malformed frames: %u log lines about them, %u lines in all\n", closing,
                  lines);
    assert_true(closing >= 1 && closing <= 20);
}

/* ---- the fallback socket directory ---------------------------------------- */

#define VICTIM_UID 60005
#define SQUAT_UID 60006

static int victim_connect(void *arg)
{
    (void)arg;
    unsetenv("XDG_RUNTIME_DIR");
    unsetenv("KVD_SOCKET");
    struct kvd_ctx *ctx = kvd_connect(NULL);
    if (!ctx)
        return 10;
    int rc = ctx->err == KVD_EPERM && strstr(ctx->errstr, "owned by uid 60006") ? 0 : 11;
    if (rc)
        fprintf(stderr, "victim: err %d '%s'\n", ctx->err, ctx->errstr);
    kvd_close(ctx);
    return rc;
}

static int victim_daemon(void *arg)
{
    (void)arg;
    unsetenv("XDG_RUNTIME_DIR");
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 2);
    alarm(20); /* a daemon that starts serving there is killed: the test fails */
    execl(getenv("KVD_BIN"), "kvd", "--backend", "cpu", "--device-blocks", "8", "--host-blocks",
          "0", "--no-roofline-probe", (char *)NULL);
    return 127;
}

/* Defect 8: another user pre-creates /tmp/kvd-<victim uid> with a socket
 * of its own. The victim's client refuses it (saying who owns it) and
 * connects nowhere; the victim's daemon refuses to start there. */
static void test_fallback_dir_squatted(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    char dir[64], sock[96];
    snprintf(dir, sizeof(dir), "/tmp/kvd-%u", VICTIM_UID);
    snprintf(sock, sizeof(sock), "%s/kvd.sock", dir);
    unlink(sock);
    rmdir(dir);
    assert_int_equal(mkdir(dir, 0777), 0);
    assert_int_equal(chmod(dir, 0777), 0);
    assert_int_equal(chown(dir, SQUAT_UID, 65534), 0);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 8), 0);
    assert_int_equal(chmod(sock, 0777), 0);
    assert_int_equal(chown(sock, SQUAT_UID, 65534), 0);

    pid_t c = kh_run_as(VICTIM_UID, 65534, victim_connect, NULL);
    assert_int_equal(kh_child_status(c), 0);
    /* nothing reached the squatter */
    assert_int_equal(accept(lfd, NULL, NULL), -1);
    assert_true(errno == EAGAIN || errno == EWOULDBLOCK);

    /* the daemon: with the squatter's socket gone (the directory still
     * theirs), it must refuse rather than serve there */
    close(lfd);
    unlink(sock);
    pid_t d = kh_run_as(VICTIM_UID, 65534, victim_daemon, NULL);
    assert_int_equal(kh_child_status(d), 1); /* refused, with the reason on stderr */
    unlink(sock);
    rmdir(dir);
}

/* ---- metrics ---------------------------------------------------------------- */

/* GET /metrics on a unix socket (path) or TCP port; the HTTP status, or -1
 * when the connection fails. auth: an Authorization header value or NULL. */
static int scrape(const char *path, uint16_t port, const char *auth)
{
    int fd;
    if (path) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        fd = socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
            if (fd >= 0)
                close(fd);
            return -1;
        }
    } else {
        struct sockaddr_in a = {.sin_family = AF_INET,
                                .sin_port = htons(port),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
            if (fd >= 0)
                close(fd);
            return -1;
        }
    }
    char req[512];
    int n = snprintf(req, sizeof(req), "GET /metrics HTTP/1.0\r\nHost: localhost\r\n%s%s%s\r\n",
                     auth ? "Authorization: " : "", auth ? auth : "", auth ? "\r\n" : "");
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    char buf[256];
    ssize_t r = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (r <= 0)
        return -1;
    buf[r] = 0;
    int status = -1;
    sscanf(buf, "HTTP/1.%*d %d", &status);
    return status;
}

static char g_msock[100];

/* kvd creates its metrics socket just after its main socket listens (which
 * is what kh_start waits for): wait for the file. */
static void wait_msock(void)
{
    struct stat st;
    for (int i = 0; i < 3000 && stat(g_msock, &st) != 0; i++) {
        struct timespec ts = {0, 2 * 1000000};
        nanosleep(&ts, NULL);
    }
}

static int metrics_child(void *arg)
{
    int want_ok = *(int *)arg;
    int st = scrape(g_msock, 0, NULL);
    return want_ok ? (st == 200 ? 0 : 10) : (st == -1 ? 0 : 11);
}

static uint16_t free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof(a);
    bind(fd, (struct sockaddr *)&a, sizeof(a));
    getsockname(fd, (struct sockaddr *)&a, &l);
    close(fd);
    return ntohs(a.sin_port);
}

/* Defect 9: metrics on a unix socket only the daemon's user (mode 0600) or
 * the metrics group (0660) can open; over TCP, a bearer token when
 * configured. */
static void test_metrics_access(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    struct kh_proc p;
    snprintf(g_msock, sizeof(g_msock), "%s/metrics.sock", g_dir);
    char addr[160];
    snprintf(addr, sizeof(addr), "unix:%s", g_msock);
    const char *a1[] = {"--metrics", addr, NULL};
    start_model(&p, NULL, a1);
    wait_msock();
    struct stat st;
    assert_int_equal(stat(g_msock, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(scrape(g_msock, 0, NULL), 200); /* root */
    int no = 0, yes = 1;
    assert_int_equal(kh_child_status(kh_run_as(60001, 65534, metrics_child, &no)), 0);
    assert_int_equal(kh_stop(&p), 0);
    assert_int_not_equal(stat(g_msock, &st), 0); /* removed at exit */

    const char *a2[] = {"--metrics", addr, "--metrics-group", "nogroup", NULL};
    start_model(&p, NULL, a2);
    wait_msock();
    assert_int_equal(stat(g_msock, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0660);
    assert_int_equal(kh_child_status(kh_run_as(60001, 65534, metrics_child, &yes)), 0);
    assert_int_equal(kh_stop(&p), 0);

    char tok[128];
    snprintf(tok, sizeof(tok), "%s/token", g_dir);
    FILE *f = fopen(tok, "w");
    fputs("0123456789abcdef0123\n", f);
    fclose(f);
    chmod(tok, 0600);
    uint16_t port = free_port();
    char tcp[64];
    snprintf(tcp, sizeof(tcp), "127.0.0.1:%u", port);
    const char *a3[] = {"--metrics", tcp, "--metrics-token-file", tok, NULL};
    start_model(&p, NULL, a3);
    int st401 = -1;
    for (int i = 0; i < 3000 && st401 == -1; i++) { /* the TCP listener comes just after */
        st401 = scrape(NULL, port, NULL);
        if (st401 == -1) {
            struct timespec ts = {0, 2 * 1000000};
            nanosleep(&ts, NULL);
        }
    }
    assert_int_equal(st401, 401);
    assert_int_equal(scrape(NULL, port, "Bearer 0123456789abcdef0124"), 401);
    assert_int_equal(scrape(NULL, port, "Bearer 0123456789abcdef0123"), 200);
    assert_int_equal(kh_stop(&p), 0);
    unlink(tok);
}

static unsigned count_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    unsigned n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    return n;
}

/* Starts kvd at a 48-descriptor limit with its stderr in logpath and
 * metrics on g_msock; returns its pid and an admin connection in *a. */
static pid_t start_flood_kvd(const char *logpath, const char *sock, const char *max_conns, int *a)
{
    char addr[160];
    snprintf(addr, sizeof(addr), "unix:%s", g_msock);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit rl = {48, 48};
        setrlimit(RLIMIT_NOFILE, &rl);
        int lf = open(logpath, O_CREAT | O_TRUNC | O_WRONLY, 0600);
        dup2(lf, 2);
        execl(getenv("KVD_BIN"), "kvd", "--socket", sock, "--backend", "cpu", "--device-blocks",
              "8", "--host-blocks", "0", "--no-roofline-probe", "--metrics", addr,
              "--metrics-max-connections", max_conns, "--log-level", "info", (char *)NULL);
        _exit(127);
    }
    *a = -1;
    for (int i = 0; i < 3000 && *a < 0; i++) {
        *a = kh_connect(sock);
        if (*a < 0) {
            struct timespec ts = {0, 10 * 1000000};
            nanosleep(&ts, NULL);
        }
    }
    return pid;
}

static void flood_open(int *flood, int n)
{
    for (int i = 0; i < n; i++) {
        flood[i] = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", g_msock);
        (void)connect(flood[i], (struct sockaddr *)&sa, sizeof(sa)); /* may wait in the backlog */
    }
}

/* Scrapes until one is served (after a pause, or once a slot frees). */
static void scrape_until_served(void)
{
    int st = -1;
    for (int i = 0; i < 3000 && st != 200; i++) {
        st = scrape(g_msock, 0, NULL);
        if (st != 200) {
            struct timespec ts = {0, 10 * 1000000};
            nanosleep(&ts, NULL);
        }
    }
    assert_int_equal(st, 200);
}

static unsigned count_lines(const char *path, const char *what)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[2048];
    unsigned n = 0;
    while (fgets(line, sizeof(line), f))
        n += strstr(line, what) != NULL;
    fclose(f);
    return n;
}

/* Defect 7: a flood of connections to the metrics socket. With the
 * default cap (metrics-max-connections 16) kvd holds at most 16 of them
 * and stops accepting; with the cap raised past its 48-descriptor limit,
 * accept fails with EMFILE and kvd pauses (doubling) instead of spinning,
 * logging a few lines, not one per failure. Either way the connection kvd
 * already had keeps being served, and metrics are served again once the
 * flood has gone. */
static void test_metrics_fd_flood(void **state)
{
    (void)state;
    char logpath[128], sock[128];
    snprintf(logpath, sizeof(logpath), "%s/flood.log", g_dir);
    snprintf(sock, sizeof(sock), "%s/f.sock", g_dir);
    snprintf(g_msock, sizeof(g_msock), "%s/fm.sock", g_dir);
    const char *caps[2] = {"16", "1000"};
    for (int round = 0; round < 2; round++) {
        int a, flood[100];
        pid_t pid = start_flood_kvd(logpath, sock, caps[round], &a);
        assert_true(a >= 0);
        wait_msock();
        struct kh_reply r;
        assert_int_equal(kh_call0(a, "hello", 1, &r), 0);
        kh_reply_free(&r);
        unsigned fds0 = count_fds(pid);
        flood_open(flood, 100);
        if (round == 0) {
            /* it takes 16, then stops */
            while (count_fds(pid) < fds0 + 16) {
                struct timespec ts = {0, 2 * 1000000};
                nanosleep(&ts, NULL);
            }
        }
        /* the connection kvd already has keeps being served */
        for (int i = 0; i < 300; i++) {
            assert_int_equal(kh_call0(a, "hello", 2 + (uint64_t)i, &r), 0);
            kh_reply_free(&r);
        }
        unsigned fds = count_fds(pid);
        if (round == 0)
            assert_true(fds <= fds0 + 16);
        for (int i = 0; i < 100; i++)
            close(flood[i]);
        scrape_until_served();
        close(a);
        kill(pid, SIGTERM);
        assert_int_equal(kh_child_status(pid), 0);
        unlink(sock);
        unsigned accept_lines = count_lines(logpath, "accept");
        unsigned cap_lines = count_lines(logpath, "metrics-max-connections");
        print_message("metrics flood, cap %s, 48 descriptors: kvd held %u descriptors "
                      "(%u before), %u log lines about accept, %u about the cap\n",
                      caps[round], fds, fds0, accept_lines, cap_lines);
        if (round == 0)
            assert_true(cap_lines >= 1 && cap_lines <= 11);
        assert_true(accept_lines <= 30);
        unlink(logpath);
    }
}

/* ---- start-up refusals ---------------------------------------------------- */

/* Runs kvd with args; returns its exit status (-1 if it did not exit by
 * itself within 20 s: a hang). */
static int run_kvd(const char *const *args)
{
    const char *argv[32];
    int n = 0;
    argv[n++] = getenv("KVD_BIN");
    for (int i = 0; args[i] && n < 31; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20); /* a hang is killed, and reported as one */
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
        return -1;
    return WEXITSTATUS(st);
}

/* Defect 10: a FIFO as --model and a directory as --config are errors. */
static void test_startup_refusals(void **state)
{
    (void)state;
    char fifo[128], sock[128];
    snprintf(fifo, sizeof(fifo), "%s/fifo.gguf", g_dir);
    snprintf(sock, sizeof(sock), "%s/s.sock", g_dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    const char *m[] = {"--model", fifo, "--socket", sock, "--backend", "cpu", "--no-roofline-probe",
                       NULL};
    assert_int_equal(run_kvd(m), 2);
    unlink(fifo);
    const char *c[] = {"--config", g_dir, "--socket", sock, "--backend", "cpu", NULL};
    assert_int_equal(run_kvd(c), 2);
    unlink(sock);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_queue_limits),          cmocka_unit_test(test_generate_foreign_seq),
        cmocka_unit_test(test_stats_non_admin),       cmocka_unit_test(test_connection_slots),
        cmocka_unit_test(test_noread_stream_bounded), cmocka_unit_test(test_buffer_budget),
        cmocka_unit_test(test_log_rate_limited),      cmocka_unit_test(test_startup_refusals),
        cmocka_unit_test(test_fallback_dir_squatted), cmocka_unit_test(test_metrics_access),
        cmocka_unit_test(test_metrics_fd_flood),
    };
    if (!getenv("KVD_TOOLS_DIR") || !getenv("KVD_BIN")) {
        fprintf(stderr, "KVD_TOOLS_DIR / KVD_BIN not set (run through ctest)\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
