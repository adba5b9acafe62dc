/* kvd_harness: the one daemon fixture of the tests. It starts a real kvd
 * (binary from $KVD_BIN) in a fresh mkdtemp directory with its log in
 * dir/kvd.log, waits for the daemon's own READY=1 (sd_notify), kills it if
 * the test process dies (PR_SET_PDEATHSIG) and, when a test fails and
 * leaves it running, prints its log and removes it at exit; it also
 * connects, sends raw bytes or request frames, reads and parses replies
 * with the daemon's own codec, and checks their codes (kh_expect).
 * Exported names carry a kh_ prefix so a test can also link libkvd
 * (kvd_*). */
#ifndef KVD_HARNESS_H
#define KVD_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <msgpack.h>

#include "proto.h"

struct kh_proc {
    pid_t pid;      /* -1 once reaped */
    char dir[64];   /* the mkdtemp directory, removed by kh_stop */
    char sock[128]; /* dir/kvd.sock (or dir/<opts.socket>) */
    char conf[128]; /* dir/kvd.conf (written when there is conf_text) */
    char log[128];  /* dir/kvd.log: the daemon's stdout and stderr */
    int status;     /* once reaped: the exit status, or -1 (a signal) */
    bool killed;    /* kh_kill: the test killed it on purpose */
};

/* How to start it (zero-initialised: the defaults). */
struct kh_opts {
    const char *conf_text;   /* written to dir/kvd.conf, passed as --config */
    const char *const *args; /* more arguments (NULL-terminated, may be NULL) */
    const char *const *env;  /* "NAME=VALUE" for the daemon (NULL-terminated) */
    const char *socket;      /* the socket's name in dir (default kvd.sock) */
    const char *bin;         /* default $KVD_BIN */
    bool no_socket;          /* pass no --socket (default-socket and activation tests) */
    bool no_wait;            /* return at once (a NOTIFY_SOCKET in env also means that) */
    int pass_fd;             /* > 0: socket activation with this listener as fd 3 */
    bool as_user;            /* run as uid/gid (setgroups cleared; the test runs as root) */
    uid_t uid;
    gid_t gid;
    unsigned nofile; /* > 0: RLIMIT_NOFILE for the daemon */
};

/* Starts kvd with --socket <dir>/kvd.sock --log-level warning (or
 * $KVD_TEST_LOG), the options' config and args, and waits until it is
 * ready. Returns 0, or -1 (the log is printed, nothing is left behind). */
int kh_spawn(struct kh_proc *p, const struct kh_opts *o);
/* kh_spawn with just a config text (NULL: none) and args. */
int kh_start(struct kh_proc *p, const char *conf_text, const char *const *args);
/* kh_start for the benchmarks: args, then the space-separated words of the
 * environment's KVD_BENCH_ARGS (kvd arguments the bench's user adds; at most
 * 63 in all). kh_bench_args() is the argument list it started with, kept
 * until the next call, for the bench to print. */
int kh_start_bench(struct kh_proc *p, const char *conf_text, const char *const *args);
const char *const *kh_bench_args(void);
/* kh_start on the heap, for CMocka fixtures (state): NULL on failure.
 * kh_free stops it (kh_stop), frees it and returns kh_stop's status. */
struct kh_proc *kh_new(const char *conf_text, const char *const *args);
int kh_free(struct kh_proc *p);
/* Runs kvd to its end (no waiting for readiness: --help, refusals) and
 * returns its exit status, or -1 when it did not exit normally. */
int kh_run(const struct kh_opts *o);
/* Sends SIGTERM and returns kvd's exit status (or -1 when it did not exit
 * normally; the status it had when it was already reaped); prints the log
 * unless it was 0 or the test killed it; removes the directory. */
int kh_stop(struct kh_proc *p);
/* Waits for an already-signalled kvd; returns its exit status or -1. */
int kh_wait(struct kh_proc *p);
/* SIGKILL and reap (a daemon that dies). */
void kh_kill(struct kh_proc *p);
void kh_cleanup_dir(struct kh_proc *p);
/* Prints the daemon's log on stderr. */
void kh_dump_log(const struct kh_proc *p);

/* A blocking connection to path, or -1. */
int kh_connect(const char *path);
int kh_send_raw(int fd, const void *buf, size_t len);

/* A request under construction: kh_req_begin(op, id, n_args), then
 * n_args key/value pairs packed with r->pk (proto_pack_kv_*), then
 * kh_req_send. */
struct kh_req {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    size_t at;
};
void kh_req_begin(struct kh_req *r, const char *op, uint64_t id, size_t n_args);
/* Sends and frees the request; 0 or -1. */
int kh_req_send(int fd, struct kh_req *r);

/* One received reply or event. */
struct kh_reply {
    uint8_t *buf; /* the payload (owned) */
    struct proto_msg msg;
    const msgpack_object *root;
    int code;          /* KVD_OK, the error code of an error reply, -1: none read */
    char message[256]; /* the error message */
    uint64_t id;
};
/* Reads one frame (blocking, up to 30 s). Returns 0, or -1 on EOF/error/
 * malformed reply. */
int kh_recv(int fd, struct kh_reply *r);
void kh_reply_free(struct kh_reply *r);
/* True when the peer has closed (read returns 0 within 30 s). */
bool kh_peer_closed(int fd);

/* Shortcuts: a request with no args / one uint arg, answered by one reply
 * (returned in r; the caller frees it). Return r->code, or -1 on I/O error. */
int kh_call0(int fd, const char *op, uint64_t id, struct kh_reply *r);
int kh_call1(int fd, const char *op, uint64_t id, const char *key, uint64_t v, struct kh_reply *r);

/* 0 when the reply's code is `want` (0: ok), else -1 with a message naming
 * both codes and the daemon's message. kh_expect(r, code) fails a CMocka
 * test with that message instead of "0x5 != 0". */
int kh_expect_code(const struct kh_reply *r, int want, char *msg, size_t cap);
#define kh_expect(r, want)                                                                         \
    do {                                                                                           \
        char kh_msg_[512];                                                                         \
        if (kh_expect_code((r), (want), kh_msg_, sizeof(kh_msg_)) != 0)                            \
            fail_msg("%s", kh_msg_);                                                               \
    } while (0)

/* Typed getters on a reply (fail the caller's assertions with 0/UINT64_MAX). */
uint64_t kh_u64(const msgpack_object *map, const char *key);
const msgpack_object *kh_obj(const msgpack_object *map, const char *key);

/* seq_open on fd: returns the handle (0 on failure). */
uint64_t kh_seq_open(int fd, uint64_t id);
/* A stats number: stats[section][key] (section NULL: top level). */
uint64_t kh_stat(int fd, const char *section, const char *key);

/* Runs fn in a child process under uid/gid (setgroups cleared). Returns the
 * child's pid, or -1. The child exits with fn's return value. */
pid_t kh_run_as(uid_t uid, gid_t gid, int (*fn)(void *arg), void *arg);
/* waitpid; the child's exit code or -1 if it did not exit normally. */
int kh_child_status(pid_t pid);

/* Round trips timed without the machine's load. A round trip to kvd is the
 * client's send, kvd's event loop (its main thread) picking the request up
 * and answering, and the client waking up; on a loaded machine both threads
 * also wait in the run queue for a CPU, which says nothing about kvd. What
 * is left after taking those waits out (Linux schedstat: time runnable but
 * not running) is the time the loop was busy with other work or blocked:
 * the stall another tenant sees, as an idle machine would show it. */
struct kh_rtt {
    pid_t kvd;         /* the daemon: its loop thread is its main thread */
    double t0_ms;      /* CLOCK_MONOTONIC at kh_rtt_begin */
    uint64_t wait0[2]; /* run-queue ns of the loop thread and of this thread */
};
void kh_rtt_begin(struct kh_rtt *r, pid_t kvd);
/* The round trip's wall time in ms, and (*stall_ms) that time less both
 * threads' run-queue waits since kh_rtt_begin (never below 0). */
double kh_rtt_end(const struct kh_rtt *r, double *stall_ms);

#endif
