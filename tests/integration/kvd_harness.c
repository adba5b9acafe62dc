/* kvd_harness: see kvd_harness.h. A started daemon is waited for through
 * its own READY=1 (sd_notify), bounded by 30 s (never an assertion about
 * speed): a daemon that does not come up makes the test fail with its log. */
#include "kvd_harness.h"

#include "kvd/status.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HARNESS_WAIT_MS 30000

/* Daemons started and not yet stopped, by copy (a failed test's stack is
 * gone). A test that fails leaves its daemon here (its assertion jumped past
 * kh_stop); at exit each one's log is printed, the daemon killed and its
 * directory removed. Only in the process that started them. */
#define KH_MAX_LIVE 64
static struct kh_proc kh_live[KH_MAX_LIVE];
static pid_t kh_owner;

static struct kh_proc *kh_live_find(const struct kh_proc *p)
{
    for (int i = 0; i < KH_MAX_LIVE; i++)
        if (kh_live[i].dir[0] && !strcmp(kh_live[i].dir, p->dir))
            return &kh_live[i];
    return NULL;
}

static void kh_forget(const struct kh_proc *p)
{
    struct kh_proc *e = kh_live_find(p);
    if (e)
        memset(e, 0, sizeof(*e));
}

static void kh_at_exit(void)
{
    if (getpid() != kh_owner)
        return;
    for (int i = 0; i < KH_MAX_LIVE; i++) {
        struct kh_proc p = kh_live[i];
        if (!p.dir[0])
            continue;
        fprintf(stderr, "harness: kvd (pid %d) was not stopped: the test failed?\n", (int)p.pid);
        kh_dump_log(&p);
        if (p.pid > 0 && waitpid(p.pid, NULL, WNOHANG) == 0) /* still our running child */
            kh_kill(&p);
        kh_cleanup_dir(&p);
    }
}

static void kh_remember(const struct kh_proc *p)
{
    if (kh_owner != getpid()) {
        if (!kh_owner)
            atexit(kh_at_exit);              /* (a forked child inherits the registration) */
        memset(kh_live, 0, sizeof(kh_live)); /* a child's parent's daemons are not its own */
        kh_owner = getpid();
    }
    for (int i = 0; i < KH_MAX_LIVE; i++)
        if (!kh_live[i].dir[0]) {
            kh_live[i] = *p;
            return;
        }
}

void kh_dump_log(const struct kh_proc *p)
{
    char line[1024];
    FILE *f = p->log[0] ? fopen(p->log, "r") : NULL;
    if (!f)
        return;
    fprintf(stderr, "---- kvd log (%s) ----\n", p->log);
    while (fgets(line, sizeof(line), f))
        fputs(line, stderr);
    fprintf(stderr, "---- end of kvd log ----\n");
    fclose(f);
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

/* Waits for READY=1 on the notify socket (kvd sends it once it serves),
 * while watching the child. 0, or -1 when it exited or did not get ready
 * within the harness wait. */
static int wait_ready(struct kh_proc *p, int nfd)
{
    char msg[512];
    for (int waited = 0; waited < HARNESS_WAIT_MS; waited += 100) {
        struct pollfd pfd = {nfd, POLLIN, 0};
        if (poll(&pfd, 1, 100) > 0) {
            ssize_t n = recv(nfd, msg, sizeof(msg) - 1, 0);
            if (n > 0) {
                msg[n] = '\0';
                if (strstr(msg, "READY=1"))
                    return 0;
            }
        }
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            fprintf(stderr, "harness: kvd exited before it was ready (%s %d)\n",
                    WIFEXITED(st) ? "status" : "signal",
                    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            struct kh_proc *e = kh_live_find(p);
            if (e)
                e->pid = -1;
            p->pid = -1;
            return -1;
        }
    }
    fprintf(stderr, "harness: kvd did not say READY=1 within %d ms\n", HARNESS_WAIT_MS);
    return -1;
}

int kh_spawn(struct kh_proc *p, const struct kh_opts *o)
{
    const char *bin = o->bin ? o->bin : getenv("KVD_BIN");
    const char *argv[80];
    char nsock[96] = "";
    int n = 0, nfd = -1;

    memset(p, 0, sizeof(*p));
    p->pid = -1;
    p->status = -1;
    if (!bin) {
        fprintf(stderr, "harness: KVD_BIN is not set\n");
        return -1;
    }
    snprintf(p->dir, sizeof(p->dir), "/tmp/kvdtest.XXXXXX");
    if (!mkdtemp(p->dir))
        return -1;
    /* Other uids (tenant tests) must reach the socket inside. */
    chmod(p->dir, 0711);
    snprintf(p->sock, sizeof(p->sock), "%s/%s", p->dir, o->socket ? o->socket : "kvd.sock");
    snprintf(p->conf, sizeof(p->conf), "%s/kvd.conf", p->dir);
    snprintf(p->log, sizeof(p->log), "%s/kvd.log", p->dir);
    argv[n++] = bin;
    if (!o->no_socket) {
        argv[n++] = "--socket";
        argv[n++] = p->sock;
    }
    argv[n++] = "--log-level";
    argv[n++] = getenv("KVD_TEST_LOG") ? getenv("KVD_TEST_LOG") : "warning";
    if (o->conf_text) {
        FILE *f = fopen(p->conf, "w");
        if (!f)
            return -1;
        fputs(o->conf_text, f);
        fclose(f);
        argv[n++] = "--config";
        argv[n++] = p->conf;
    }
    for (int i = 0; o->args && o->args[i] && n < 78; i++)
        argv[n++] = o->args[i];
    argv[n] = NULL;

    bool ready_event = !o->no_wait;
    for (int i = 0; o->env && o->env[i]; i++)
        if (!strncmp(o->env[i], "NOTIFY_SOCKET=", 14))
            ready_event = false; /* the test listens itself */
    if (ready_event) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(nsock, sizeof(nsock), "%s/notify.sock", p->dir);
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", nsock);
        nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (nfd < 0 || bind(nfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
            chmod(nsock, 0666) != 0) { /* a daemon run as another uid sends too */
            if (nfd >= 0)
                close(nfd);
            return -1;
        }
    }

    fflush(NULL);
    p->pid = fork();
    if (p->pid < 0) {
        if (nfd >= 0)
            close(nfd);
        return -1;
    }
    if (p->pid == 0) {
        /* A test that fails half-way must not leave a daemon behind. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int lfd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (lfd >= 0) {
            dup2(lfd, 1);
            dup2(lfd, 2);
        }
        if (ready_event)
            setenv("NOTIFY_SOCKET", nsock, 1);
        else if (o->no_wait)
            unsetenv("NOTIFY_SOCKET");
        for (int i = 0; o->env && o->env[i]; i++)
            putenv((char *)o->env[i]);
        if (o->nofile) {
            struct rlimit rl = {o->nofile, o->nofile};
            if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
                _exit(125);
        }
        if (o->as_user && (setgroups(0, NULL) || setgid(o->gid) || setuid(o->uid)))
            _exit(120);
        if (o->pass_fd > 0) { /* socket activation: the listener as fd 3 */
            if (o->pass_fd != 3 && dup2(o->pass_fd, 3) != 3)
                _exit(126);
            if (o->pass_fd == 3)
                fcntl(3, F_SETFD, 0); /* kept across exec */
            char pid[32];
            snprintf(pid, sizeof(pid), "%d", (int)getpid());
            setenv("LISTEN_PID", pid, 1);
            setenv("LISTEN_FDS", "1", 1);
        }
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    kh_remember(p);
    if (!ready_event)
        return 0;
    int rc = wait_ready(p, nfd);
    close(nfd);
    unlink(nsock);
    if (rc != 0) {
        kh_dump_log(p);
        kh_kill(p);
        kh_cleanup_dir(p);
        kh_forget(p);
    }
    return rc;
}

int kh_start(struct kh_proc *p, const char *conf_text, const char *const *args)
{
    struct kh_opts o = {.conf_text = conf_text, .args = args};
    return kh_spawn(p, &o);
}

static const char *bench_args[64];
static char *bench_extra;

int kh_start_bench(struct kh_proc *p, const char *conf_text, const char *const *args)
{
    size_t n = 0, cap = sizeof bench_args / sizeof *bench_args - 1;
    for (size_t i = 0; args[i] && n < cap; i++)
        bench_args[n++] = args[i];
    free(bench_extra);
    const char *env = getenv("KVD_BENCH_ARGS");
    bench_extra = env ? strdup(env) : NULL;
    for (char *sv = NULL, *t = bench_extra ? strtok_r(bench_extra, " ", &sv) : NULL; t && n < cap;
         t = strtok_r(NULL, " ", &sv))
        bench_args[n++] = t;
    bench_args[n] = NULL;
    memset(p, 0, sizeof *p);
    return kh_start(p, conf_text, bench_args);
}

const char *const *kh_bench_args(void)
{
    return bench_args;
}

int kh_run(const struct kh_opts *o)
{
    struct kh_opts ro = *o;
    struct kh_proc p;
    ro.no_wait = true;
    if (kh_spawn(&p, &ro) != 0)
        return -1;
    int rc = kh_wait(&p);
    kh_cleanup_dir(&p);
    return rc;
}

void kh_cleanup_dir(struct kh_proc *p)
{
    kh_forget(p);
    if (!p->dir[0])
        return;
    unlink(p->sock);
    unlink(p->conf);
    unlink(p->log);
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
    struct kh_proc *e = kh_live_find(p);
    if (e)
        e->pid = -1; /* reaped: never signalled again */
    p->pid = -1;
    p->status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return p->status;
}

void kh_kill(struct kh_proc *p)
{
    if (p->pid <= 0)
        return;
    kill(p->pid, SIGKILL);
    kh_wait(p);
    p->killed = true;
}

int kh_stop(struct kh_proc *p)
{
    int rc = p->status;
    if (p->pid > 0) {
        kill(p->pid, SIGCONT); /* in case a test stopped it */
        kill(p->pid, SIGTERM);
        rc = kh_wait(p);
    }
    if (rc != 0 && !p->killed) /* a clean drain exits 0: show why not */
        kh_dump_log(p);
    kh_cleanup_dir(p);
    return rc;
}

struct kh_proc *kh_new(const char *conf_text, const char *const *args)
{
    struct kh_proc *p = calloc(1, sizeof(*p));
    if (p && kh_start(p, conf_text, args) != 0) {
        free(p);
        return NULL;
    }
    return p;
}

int kh_free(struct kh_proc *p)
{
    int rc = p ? kh_stop(p) : 0;
    free(p);
    return rc;
}

int kh_expect_code(const struct kh_reply *r, int want, char *msg, size_t cap)
{
    if (r->code == want)
        return 0;
    if (r->code < 0)
        snprintf(msg, cap, "request %llu: no reply (I/O error), want %s", (unsigned long long)r->id,
                 want ? kvd_err_code(want) : "ok");
    else if (r->code == 0)
        snprintf(msg, cap, "request %llu: ok, want %s", (unsigned long long)r->id,
                 kvd_err_code(want));
    else
        snprintf(msg, cap, "request %llu: %s \"%s\", want %s", (unsigned long long)r->id,
                 kvd_err_code(r->code), r->message, want ? kvd_err_code(want) : "ok");
    return -1;
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
    struct kvd_error e = {0};

    memset(r, 0, sizeof(*r));
    r->code = -1; /* until a reply is read */
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

/* The second field of a schedstat file: ns spent runnable, waiting for a
 * CPU (0 when the kernel has no schedstats: then nothing is taken out). */
static uint64_t runqueue_wait_ns(const char *path)
{
    FILE *f = fopen(path, "r");
    unsigned long long run = 0, wait = 0;
    if (!f)
        return 0;
    if (fscanf(f, "%llu %llu", &run, &wait) != 2)
        wait = 0;
    fclose(f);
    return wait;
}

static void rtt_waits(pid_t kvd, uint64_t w[2])
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task/%d/schedstat", (int)kvd, (int)kvd);
    w[0] = runqueue_wait_ns(path);
    w[1] = runqueue_wait_ns("/proc/thread-self/schedstat");
}

static double mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

void kh_rtt_begin(struct kh_rtt *r, pid_t kvd)
{
    r->kvd = kvd;
    rtt_waits(kvd, r->wait0);
    r->t0_ms = mono_ms();
}

double kh_rtt_end(const struct kh_rtt *r, double *stall_ms)
{
    double wall = mono_ms() - r->t0_ms;
    uint64_t w[2];
    rtt_waits(r->kvd, w);
    double waited = (double)(w[0] - r->wait0[0] + w[1] - r->wait0[1]) / 1e6;
    *stall_ms = wall > waited ? wall - waited : 0;
    return wall;
}
