/* redis_harness: real Redis servers for tests. redis_start runs `redis-server` (from PATH, or
 * $REDIS_SERVER) on a free loopback port in a fresh mkdtemp directory (no persistence:
 * --save "" --appendonly no; its log is dir/redis.log), waits until it answers PING (bounded
 * deadline), and makes it die with the test process (PR_SET_PDEATHSIG); redis_cluster_start
 * runs n such nodes with --cluster-enabled, joins them with `redis-cli --cluster create` and
 * waits until every node says cluster_state:ok. Servers still running at exit are killed and
 * the directories not removed by redis_stop are removed (what a failed test leaves).
 * Commands for the test itself go through hiredis (redis_srv_cmd). */
#ifndef KVD_REDIS_HARNESS_H
#define KVD_REDIS_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define REDIS_HARNESS_SKIP 77 /* redis_start's answer when redis-server is not installed */
#define REDIS_CLUSTER_MAX 8

struct redis_srv {
    pid_t pid;        /* -1 when not running */
    int port;         /* the client port (127.0.0.1) */
    int bus_port;     /* the cluster bus port (cluster nodes only) */
    char host[16];    /* "127.0.0.1" */
    char addr[32];    /* "127.0.0.1:PORT" */
    char url[64];     /* "redis://127.0.0.1:PORT" */
    char dir[64];     /* the mkdtemp directory (removed by redis_stop) */
    char extra[1024]; /* the extra arguments, kept for redis_restart */
};

struct redis_cluster {
    int n;
    struct redis_srv node[REDIS_CLUSTER_MAX];
    char url[REDIS_CLUSTER_MAX * 32 + 32]; /* "redis-cluster://127.0.0.1:P1,127.0.0.1:P2,..." */
};

/* True when redis-server (and redis-cli, for clusters) can be run. */
bool redis_available(void);

/* Starts a server; extra_args (may be NULL) are more redis-server arguments, split on spaces,
 * "" for an empty one (e.g. "--requirepass secret --enable-debug-command yes"). Returns 0,
 * REDIS_HARNESS_SKIP when redis-server is missing, or -1 (the reason on stderr). */
int redis_start(struct redis_srv *s, const char *extra_args);
/* Kills it with SIGKILL and reaps it; keeps the directory and port (for redis_restart). */
void redis_kill(struct redis_srv *s);
/* Starts it again on the same port, directory and arguments (after redis_kill). */
int redis_restart(struct redis_srv *s);
/* Kills it (when running) and removes its directory. Safe to call twice. */
void redis_stop(struct redis_srv *s);

/* n (3..REDIS_CLUSTER_MAX) masters, no replicas, all 16384 slots assigned and cluster_state:ok
 * on every node. Returns 0, REDIS_HARNESS_SKIP, or -1. */
int redis_cluster_start(struct redis_cluster *c, int n);
void redis_cluster_stop(struct redis_cluster *c);

/* Runs one command on host:port through hiredis (redisCommand's format: %s, %b for binary
 * with a length) with a 5 s timeout; returns the redisReply (free it with freeReplyObject),
 * or NULL when the connection failed (reason on stderr). */
void *redis_cmd_at(const char *host, int port, const char *fmt, ...);
void *redis_srv_cmd(const struct redis_srv *s, const char *fmt, ...);
/* Like redis_srv_cmd, true when the reply is a status "OK" (the reply printed if not). */
bool redis_srv_cmd_ok(const struct redis_srv *s, const char *fmt, ...);

/* Sends a command without waiting for its reply (e.g. DEBUG SLEEP 2, which blocks the server);
 * returns a handle to pass to redis_cmd_finish, which reads the reply and closes it. */
void *redis_srv_cmd_start(const struct redis_srv *s, const char *cmd);
void redis_cmd_finish(void *h);

#endif
