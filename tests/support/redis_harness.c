/* redis_harness: real redis-server processes for tests (redis_harness.h). */
#include "redis_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#define START_DEADLINE_MS 10000
#define CLUSTER_DEADLINE_MS 30000
#define MAX_ARGS 64

/* Every server this process started and has not reaped (killed at exit), and every
 * directory not yet removed (removed at exit): what a failed test leaves behind. */
struct live_ent {
    pid_t pid;
    char dir[64];
};
static struct live_ent live[64];
static bool atexit_set;

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *f)
{
    (void)sb;
    (void)flag;
    (void)f;
    remove(p);
    return 0;
}

static void kill_live(void)
{
    for (size_t i = 0; i < sizeof(live) / sizeof(live[0]); i++) {
        if (live[i].pid > 0) {
            kill(live[i].pid, SIGKILL);
            waitpid(live[i].pid, NULL, 0);
        }
        if (live[i].dir[0])
            nftw(live[i].dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
        live[i].pid = 0;
        live[i].dir[0] = '\0';
    }
}

static struct live_ent *live_find(const char *dir)
{
    for (size_t i = 0; i < sizeof(live) / sizeof(live[0]); i++)
        if (live[i].dir[0] && strcmp(live[i].dir, dir) == 0)
            return &live[i];
    return NULL;
}

static void live_dir_add(const char *dir)
{
    if (!atexit_set) {
        atexit(kill_live);
        atexit_set = true;
    }
    for (size_t i = 0; i < sizeof(live) / sizeof(live[0]); i++)
        if (!live[i].dir[0]) {
            snprintf(live[i].dir, sizeof(live[i].dir), "%s", dir);
            live[i].pid = 0;
            return;
        }
}

static void live_pid(const char *dir, pid_t p)
{
    struct live_ent *l = live_find(dir);
    if (l)
        l->pid = p;
}

static void live_dir_del(const char *dir)
{
    struct live_ent *l = live_find(dir);
    if (l) {
        l->pid = 0;
        l->dir[0] = '\0';
    }
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static const char *server_bin(void)
{
    const char *b = getenv("REDIS_SERVER");
    return b && *b ? b : "redis-server";
}

static bool in_path(const char *name)
{
    if (strchr(name, '/'))
        return access(name, X_OK) == 0;
    const char *path = getenv("PATH");
    if (!path)
        path = "/usr/bin:/bin";
    char buf[4096];
    for (const char *p = path; *p;) {
        const char *c = strchr(p, ':');
        size_t l = c ? (size_t)(c - p) : strlen(p);
        snprintf(buf, sizeof(buf), "%.*s/%s", (int)l, p, name);
        if (access(buf, X_OK) == 0)
            return true;
        if (!c)
            break;
        p = c + 1;
    }
    return false;
}

bool redis_available(void)
{
    return in_path(server_bin()) && in_path("redis-cli");
}

/* A loopback port nobody listens on now (bound to port 0 and released). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof(a);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &al) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

/* Splits s into argv (spaces separate; "..." keeps spaces, "" is an empty argument). */
static int split_args(char *s, char **argv, int cap)
{
    int n = 0;
    char *p = s;
    while (*p) {
        while (*p == ' ')
            p++;
        if (!*p)
            break;
        if (n == cap)
            return -1;
        char *out = p;
        argv[n++] = out;
        while (*p && *p != ' ') {
            if (*p == '"') {
                p++;
                while (*p && *p != '"')
                    *out++ = *p++;
                if (*p == '"')
                    p++;
            } else {
                *out++ = *p++;
            }
        }
        if (*p)
            p++;
        *out = '\0';
    }
    return n;
}

static pid_t spawn(char **argv, const char *log_path)
{
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
    }
    int nul = open("/dev/null", O_RDONLY);
    if (nul >= 0) {
        dup2(nul, 0);
        close(nul);
    }
    execvp(argv[0], argv);
    fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

void *redis_cmd_at(const char *host, int port, const char *fmt, ...)
{
    struct timeval tv = {.tv_sec = 5};
    redisContext *c = redisConnectWithTimeout(host, port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    va_list ap;
    va_start(ap, fmt);
    void *r = redisvCommand(c, fmt, ap);
    va_end(ap);
    if (!r)
        fprintf(stderr, "redis_harness: %s:%d: %s\n", host, port, c->errstr);
    redisFree(c);
    return r;
}

static void *vcmd(const struct redis_srv *s, const char *fmt, va_list ap)
{
    struct timeval tv = {.tv_sec = 5};
    redisContext *c = redisConnectWithTimeout(s->host, s->port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    void *r = redisvCommand(c, fmt, ap);
    if (!r)
        fprintf(stderr, "redis_harness: %s: %s\n", s->addr, c->errstr);
    redisFree(c);
    return r;
}

void *redis_srv_cmd(const struct redis_srv *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    void *r = vcmd(s, fmt, ap);
    va_end(ap);
    return r;
}

bool redis_srv_cmd_ok(const struct redis_srv *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = vcmd(s, fmt, ap);
    va_end(ap);
    bool ok = r && r->type == REDIS_REPLY_STATUS && strcmp(r->str, "OK") == 0;
    if (!ok)
        fprintf(stderr, "redis_harness: %s: '%s' answered %s\n", s->addr, fmt,
                r ? (r->str ? r->str : "(no text)") : "(no reply)");
    if (r)
        freeReplyObject(r);
    return ok;
}

void *redis_srv_cmd_start(const struct redis_srv *s, const char *cmd)
{
    struct timeval tv = {.tv_sec = 10};
    redisContext *c = redisConnectWithTimeout(s->host, s->port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    int done = 0;
    if (redisAppendCommand(c, cmd) != REDIS_OK) {
        redisFree(c);
        return NULL;
    }
    while (!done)
        if (redisBufferWrite(c, &done) != REDIS_OK) {
            redisFree(c);
            return NULL;
        }
    return c;
}

void redis_cmd_finish(void *h)
{
    redisContext *c = h;
    if (!c)
        return;
    void *r = NULL;
    if (redisGetReply(c, &r) == REDIS_OK && r)
        freeReplyObject(r);
    redisFree(c);
}

static bool pings(const struct redis_srv *s)
{
    struct timeval tv = {.tv_usec = 200000};
    redisContext *c = redisConnectWithTimeout(s->host, s->port, tv);
    bool ok = false;
    if (c && !c->err) {
        redisSetTimeout(c, tv);
        redisReply *r = redisCommand(c, "PING");
        /* a server with requirepass answers NOAUTH: it is up all the same */
        ok = r && (r->type == REDIS_REPLY_STATUS ||
                   (r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOAUTH", 6) == 0));
        if (r)
            freeReplyObject(r);
    }
    if (c)
        redisFree(c);
    return ok;
}

/* Runs redis-server for s (port, dir, extra set); 0 when it answers PING, 1 when it exited
 * (the port was taken: the caller may try another), -1 otherwise. */
static int launch(struct redis_srv *s)
{
    char port[16], bus[16], logf[128], extra[sizeof(s->extra)];
    snprintf(port, sizeof(port), "%d", s->port);
    snprintf(bus, sizeof(bus), "%d", s->bus_port);
    snprintf(logf, sizeof(logf), "%s/redis.log", s->dir);
    snprintf(extra, sizeof(extra), "%s", s->extra);
    char *argv[MAX_ARGS + 24];
    int n = 0;
    argv[n++] = (char *)server_bin();
    argv[n++] = "--port";
    argv[n++] = port;
    argv[n++] = "--bind";
    argv[n++] = "127.0.0.1";
    argv[n++] = "--save";
    argv[n++] = "";
    argv[n++] = "--appendonly";
    argv[n++] = "no";
    argv[n++] = "--daemonize";
    argv[n++] = "no";
    argv[n++] = "--dir";
    argv[n++] = s->dir;
    if (s->bus_port) {
        argv[n++] = "--cluster-port";
        argv[n++] = bus;
    }
    int ne = split_args(extra, argv + n, MAX_ARGS);
    if (ne < 0) {
        fprintf(stderr, "redis_harness: too many arguments\n");
        return -1;
    }
    n += ne;
    argv[n] = NULL;
    s->pid = spawn(argv, logf);
    if (s->pid < 0) {
        fprintf(stderr, "redis_harness: fork: %s\n", strerror(errno));
        return -1;
    }
    live_pid(s->dir, s->pid);
    uint64_t deadline = now_ms() + START_DEADLINE_MS;
    while (now_ms() < deadline) {
        int st;
        if (waitpid(s->pid, &st, WNOHANG) == s->pid) {
            live_pid(s->dir, 0);
            s->pid = -1;
            return 1;
        }
        if (pings(s))
            return 0;
        sleep_ms(10);
    }
    fprintf(stderr, "redis_harness: %s did not answer PING in %d ms (log %s)\n", s->addr,
            START_DEADLINE_MS, logf);
    redis_kill(s);
    return -1;
}

static void set_addr(struct redis_srv *s)
{
    snprintf(s->host, sizeof(s->host), "127.0.0.1");
    snprintf(s->addr, sizeof(s->addr), "127.0.0.1:%d", s->port);
    snprintf(s->url, sizeof(s->url), "redis://127.0.0.1:%d", s->port);
}

static int start_node(struct redis_srv *s, const char *extra_args, bool cluster)
{
    memset(s, 0, sizeof(*s));
    s->pid = -1;
    if (!in_path(server_bin()))
        return REDIS_HARNESS_SKIP;
    snprintf(s->extra, sizeof(s->extra), "%s", extra_args ? extra_args : "");
    const char *tmp = getenv("TMPDIR");
    snprintf(s->dir, sizeof(s->dir), "%s/kvd-redis.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(s->dir)) {
        fprintf(stderr, "redis_harness: mkdtemp %s: %s\n", s->dir, strerror(errno));
        s->dir[0] = '\0';
        return -1;
    }
    live_dir_add(s->dir);
    for (int attempt = 0; attempt < 8; attempt++) {
        s->port = free_port();
        s->bus_port = cluster ? free_port() : 0;
        if (s->port <= 0 || (cluster && (s->bus_port <= 0 || s->bus_port == s->port)))
            continue;
        set_addr(s);
        int r = launch(s);
        if (r == 0)
            return 0;
        if (r < 0)
            break;
    }
    fprintf(stderr, "redis_harness: redis-server did not start (log %s/redis.log)\n", s->dir);
    redis_stop(s);
    return -1;
}

int redis_start(struct redis_srv *s, const char *extra_args)
{
    return start_node(s, extra_args, false);
}

void redis_kill(struct redis_srv *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        live_pid(s->dir, 0);
    }
    s->pid = -1;
}

int redis_restart(struct redis_srv *s)
{
    redis_kill(s);
    /* The port was ours a moment ago; another process taking it meanwhile is not expected,
     * but say so when it happens. */
    uint64_t deadline = now_ms() + START_DEADLINE_MS;
    for (;;) {
        int r = launch(s);
        if (r == 0)
            return 0;
        if (r < 0 || now_ms() > deadline) {
            fprintf(stderr, "redis_harness: restart on %s failed (log %s/redis.log)\n", s->addr,
                    s->dir);
            return -1;
        }
        sleep_ms(50); /* exited at once: the port is still in TIME_WAIT-like use; retry */
    }
}

void redis_stop(struct redis_srv *s)
{
    redis_kill(s);
    if (s->dir[0]) {
        nftw(s->dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
        live_dir_del(s->dir);
        s->dir[0] = '\0';
    }
}

/* ---- clusters ---- */

static bool cluster_ok(const struct redis_srv *s)
{
    redisReply *r = redis_srv_cmd(s, "CLUSTER INFO");
    bool ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok") &&
              strstr(r->str, "cluster_slots_assigned:16384") &&
              strstr(r->str, "cluster_slots_ok:16384");
    if (r)
        freeReplyObject(r);
    return ok;
}

int redis_cluster_start(struct redis_cluster *c, int n)
{
    memset(c, 0, sizeof(*c));
    for (int i = 0; i < REDIS_CLUSTER_MAX; i++)
        c->node[i].pid = -1;
    if (n < 3 || n > REDIS_CLUSTER_MAX) {
        fprintf(stderr, "redis_harness: a cluster has 3..%d nodes\n", REDIS_CLUSTER_MAX);
        return -1;
    }
    if (!redis_available())
        return REDIS_HARNESS_SKIP;
    c->n = n;
    for (int i = 0; i < n; i++) {
        int r = start_node(&c->node[i],
                           "--cluster-enabled yes --cluster-config-file nodes.conf "
                           "--cluster-node-timeout 5000 --enable-debug-command yes",
                           true);
        if (r) {
            redis_cluster_stop(c);
            return r;
        }
    }
    char *argv[REDIS_CLUSTER_MAX + 8];
    int k = 0;
    argv[k++] = "redis-cli";
    argv[k++] = "--cluster";
    argv[k++] = "create";
    for (int i = 0; i < n; i++)
        argv[k++] = c->node[i].addr;
    argv[k++] = "--cluster-replicas";
    argv[k++] = "0";
    argv[k++] = "--cluster-yes";
    argv[k] = NULL;
    char logf[128];
    snprintf(logf, sizeof(logf), "%s/cluster-create.log", c->node[0].dir);
    pid_t p = spawn(argv, logf);
    if (p < 0) {
        redis_cluster_stop(c);
        return -1;
    }
    uint64_t deadline = now_ms() + CLUSTER_DEADLINE_MS;
    int st = 0;
    bool exited = false;
    while (now_ms() < deadline) {
        if (waitpid(p, &st, WNOHANG) == p) {
            exited = true;
            break;
        }
        sleep_ms(20);
    }
    if (!exited) {
        kill(p, SIGKILL);
        waitpid(p, NULL, 0);
    }
    if (!exited || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "redis_harness: redis-cli --cluster create failed (log %s)\n", logf);
        redis_cluster_stop(c);
        return -1;
    }
    for (int i = 0; i < n; i++)
        while (!cluster_ok(&c->node[i])) {
            if (now_ms() > deadline) {
                fprintf(stderr, "redis_harness: %s: cluster_state not ok in %d ms\n",
                        c->node[i].addr, CLUSTER_DEADLINE_MS);
                redis_cluster_stop(c);
                return -1;
            }
            sleep_ms(20);
        }
    size_t off = (size_t)snprintf(c->url, sizeof(c->url), "redis-cluster://");
    for (int i = 0; i < n; i++)
        off += (size_t)snprintf(c->url + off, sizeof(c->url) - off, "%s%s", i ? "," : "",
                                c->node[i].addr);
    return 0;
}

void redis_cluster_stop(struct redis_cluster *c)
{
    for (int i = 0; i < REDIS_CLUSTER_MAX; i++)
        if (c->node[i].pid > 0 || c->node[i].dir[0])
            redis_stop(&c->node[i]);
}
