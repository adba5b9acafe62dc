/* kvd_harness: see kvd_harness.h. Waits are bounded polls for readiness
 * (never assertions about speed): a daemon that does not come up within
 * 30 s makes the test fail. */
#include "kvd_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HARNESS_WAIT_MS 30000

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int kh_connect(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path))
        return -1;
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int kh_start(struct kh_proc *p, const char *conf_text, const char *const *args)
{
    const char *bin = getenv("KVD_BIN");
    const char *argv[64];
    int n = 0;

    memset(p, 0, sizeof(*p));
    p->pid = -1;
    if (!bin) {
        fprintf(stderr, "harness: KVD_BIN is not set\n");
        return -1;
    }
    snprintf(p->dir, sizeof(p->dir), "/tmp/kvdtest.XXXXXX");
    if (!mkdtemp(p->dir))
        return -1;
    /* Other uids (tenant tests) must reach the socket inside. */
    chmod(p->dir, 0711);
    snprintf(p->sock, sizeof(p->sock), "%s/kvd.sock", p->dir);
    snprintf(p->conf, sizeof(p->conf), "%s/kvd.conf", p->dir);
    argv[n++] = bin;
    argv[n++] = "--socket";
    argv[n++] = p->sock;
    argv[n++] = "--log-level";
    argv[n++] = getenv("KVD_TEST_LOG") ? getenv("KVD_TEST_LOG") : "warning";
    if (conf_text) {
        FILE *f = fopen(p->conf, "w");
        if (!f)
            return -1;
        fputs(conf_text, f);
        fclose(f);
        argv[n++] = "--config";
        argv[n++] = p->conf;
    }
    for (int i = 0; args && args[i] && n < 62; i++)
        argv[n++] = args[i];
    argv[n] = NULL;

    p->pid = fork();
    if (p->pid < 0)
        return -1;
    if (p->pid == 0) {
        /* A test that fails half-way must not leave a daemon behind. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    for (int waited = 0; waited < HARNESS_WAIT_MS; waited += 10) {
        int fd = kh_connect(p->sock);
        if (fd >= 0) {
            close(fd);
            return 0;
        }
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            fprintf(stderr, "harness: kvd exited before accepting (status %d)\n", st);
            p->pid = -1;
            return -1;
        }
        sleep_ms(10);
    }
    fprintf(stderr, "harness: kvd did not accept on %s\n", p->sock);
    return -1;
}

void kh_cleanup_dir(struct kh_proc *p)
{
    unlink(p->sock);
    unlink(p->conf);
    rmdir(p->dir);
}

int kh_wait(struct kh_proc *p)
{
    int st;
    if (p->pid <= 0)
        return -1;
    while (waitpid(p->pid, &st, 0) < 0)
        if (errno != EINTR)
            return -1;
    p->pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int kh_stop(struct kh_proc *p)
{
    int rc = -1;
    if (p->pid > 0) {
        kill(p->pid, SIGTERM);
        rc = kh_wait(p);
    }
    kh_cleanup_dir(p);
    return rc;
}

int kh_send_raw(int fd, const void *buf, size_t len)
{
    const char *b = buf;
    while (len) {
        ssize_t w = send(fd, b, len, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        b += w;
        len -= (size_t)w;
    }
    return 0;
}

void kh_req_begin(struct kh_req *r, const char *op, uint64_t id, size_t n_args)
{
    msgpack_sbuffer_init(&r->sb);
    msgpack_packer_init(&r->pk, &r->sb, msgpack_sbuffer_write);
    r->at = proto_frame_begin(&r->sb);
    proto_request_begin(&r->pk, op, id, n_args);
}

int kh_req_send(int fd, struct kh_req *r)
{
    int rc = proto_frame_end(&r->sb, r->at) == 0 ? kh_send_raw(fd, r->sb.data, r->sb.size) : -1;
    msgpack_sbuffer_destroy(&r->sb);
    return rc;
}

/* Reads exactly len bytes, polling up to the harness wait. */
static int read_full(int fd, void *buf, size_t len)
{
    char *b = buf;
    while (len) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int pr = poll(&pfd, 1, HARNESS_WAIT_MS);
        if (pr <= 0)
            return -1;
        ssize_t r = read(fd, b, len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        b += r;
        len -= (size_t)r;
    }
    return 0;
}

int kh_recv(int fd, struct kh_reply *r)
{
    uint8_t hdr[4];
    size_t n;
    struct proto_err e = {0};

    memset(r, 0, sizeof(*r));
    if (read_full(fd, hdr, 4) != 0)
        return -1;
    if (proto_frame_peek(hdr, 4, UINT32_MAX, &n) != PROTO_FRAME_NEED_MORE && n == 0)
        return -1;
    r->buf = malloc(n);
    if (!r->buf || read_full(fd, r->buf, n) != 0 || proto_msg_parse(&r->msg, r->buf, n, &e)) {
        free(r->buf);
        r->buf = NULL;
        return -1;
    }
    r->root = r->msg.root;
    r->id = proto_msg_id(&r->msg);
    if (proto_map_find(r->root, "event")) {
        r->code = KVD_OK;
        return 0;
    }
    r->code = proto_reply_status(r->root, &e);
    if (r->code)
        snprintf(r->message, sizeof(r->message), "%s", e.message);
    return 0;
}

void kh_reply_free(struct kh_reply *r)
{
    if (r->buf) {
        proto_msg_free(&r->msg);
        free(r->buf);
    }
    memset(r, 0, sizeof(*r));
}

bool kh_peer_closed(int fd)
{
    char c;
    struct pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, HARNESS_WAIT_MS) <= 0)
        return false;
    ssize_t r = read(fd, &c, 1);
    return r == 0 || (r < 0 && errno == ECONNRESET);
}

int kh_call0(int fd, const char *op, uint64_t id, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, op, id, 0);
    if (kh_req_send(fd, &q) || kh_recv(fd, r))
        return -1;
    return r->code;
}

int kh_call1(int fd, const char *op, uint64_t id, const char *key, uint64_t v, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, op, id, 1);
    proto_pack_kv_uint(&q.pk, key, v);
    if (kh_req_send(fd, &q) || kh_recv(fd, r))
        return -1;
    return r->code;
}

const msgpack_object *kh_obj(const msgpack_object *map, const char *key)
{
    return proto_map_find(map, key);
}

uint64_t kh_u64(const msgpack_object *map, const char *key)
{
    const msgpack_object *o = proto_map_find(map, key);
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return UINT64_MAX;
    return o->via.u64;
}

uint64_t kh_seq_open(int fd, uint64_t id)
{
    struct kh_reply r;
    uint64_t s = 0;
    if (kh_call0(fd, "seq_open", id, &r) == 0)
        s = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    return s == UINT64_MAX ? 0 : s;
}

uint64_t kh_stat(int fd, const char *section, const char *key)
{
    struct kh_reply r;
    uint64_t v = UINT64_MAX;
    if (kh_call0(fd, "stats", 999999, &r) == 0) {
        const msgpack_object *m = section ? kh_obj(r.root, section) : r.root;
        v = kh_u64(m, key);
    }
    kh_reply_free(&r);
    return v;
}

pid_t kh_run_as(uid_t uid, gid_t gid, int (*fn)(void *arg), void *arg)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
        _exit(120);
    _exit(fn(arg));
}

int kh_child_status(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
