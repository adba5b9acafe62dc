/* kvd_harness: what the server's integration tests share: start a real kvd
 * (binary from $KVD_BIN) on a socket in a fresh mkdtemp directory, wait
 * until it accepts, connect, send raw bytes or request frames, read and
 * parse reply frames with the daemon's own codec, and stop it. Exported
 * names carry a kh_ prefix so a test can also link libkvd (kvd_*). */
#ifndef KVD_HARNESS_H
#define KVD_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <msgpack.h>

#include "proto.h"

struct kh_proc {
    pid_t pid;
    char dir[64];   /* the mkdtemp directory, removed by kh_stop */
    char sock[128]; /* dir/kvd.sock */
    char conf[128]; /* dir/kvd.conf (written by the test if it wants one) */
};

/* Starts kvd with --socket <dir>/kvd.sock --log-level warning plus args
 * (NULL-terminated, may be NULL) and waits until the socket accepts.
 * Returns 0, or -1 (the test fails). If conf_text is non-NULL it is written
 * to p->conf first and --config p->conf is passed. */
int kh_start(struct kh_proc *p, const char *conf_text, const char *const *args);
/* Sends SIGTERM and returns kvd's exit status (or -1 when it did not exit
 * normally); removes the directory. */
int kh_stop(struct kh_proc *p);
/* Waits for an already-signalled kvd; returns its exit status or -1. */
int kh_wait(struct kh_proc *p);
void kh_cleanup_dir(struct kh_proc *p);

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
    int code;          /* KVD_OK, or the error code of an error reply */
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
int kh_call1(int fd, const char *op, uint64_t id, const char *key, uint64_t v,
              struct kh_reply *r);

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

#endif
