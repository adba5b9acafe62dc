/* remote_fixture: what the remote tier's integration tests share: a tiny
 * random model, two fleet keys and a 2000-token prompt made once per file,
 * a fresh redis-server per test (tests/support's redis_harness), kvd daemons
 * started on it with --remote, generate calls and the `stats` `remote`
 * numbers they are judged by. */
#ifndef KVD_REMOTE_FIXTURE_H
#define KVD_REMOTE_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "kvd/client.h"
#include "kvd_harness.h"
#include "redis_harness.h"

#define N_PROMPT 2000
#define BT 16
#define UID_A 60021
#define UID_B 60022
#define UID_C 60023
#define GID_ALL 65534

struct fixture {
    char tmp[64];
    char model[128];
    char key1[128], key2[128];
    uint32_t prompt[N_PROMPT];
    struct redis_srv redis;
};

/* Whole blocks of an N_PROMPT prompt a restore can bring (the last token
 * is always computed). */
#define FULL_BLOCKS ((uint64_t)(N_PROMPT - 1) / BT)

extern const char *const conf_on;      /* [limits] remote = on */
extern const char *const conf_tenants; /* alpha, beta, gamma (UID_A..C), remote on */
/* The URL the next start_ex uses instead of f's single node (NULL: f's). */
extern const char *redis_url;

/* CMocka group setup/teardown (the model, keys, prompt; skips without
 * redis-server) and per-test ones (a fresh Redis with DEBUG enabled). */
int remote_setup(void **state);
int remote_teardown(void **state);
int remote_per_test(void **state);
int remote_per_test_end(void **state);

int write_key(const char *path, const char *hex);

/* A daemon on f's Redis (or redis_url) with fleet key `key` (NULL: none,
 * insecure), --remote-min-hits 0, --remote-timeout-ms 200, and `extra`. */
void start_ex(struct kh_proc *d, const struct fixture *f, const char *conf, const char *key,
              const char *const *extra);
void start(struct kh_proc *d, const struct fixture *f, const char *conf, const char *key);

/* Greedy, 8 tokens, of n prompt tokens: 0 or -1. */
int generate(const char *sock, const uint32_t *p, size_t n, struct kvd_gen_result *res);
void gen_ok(const struct kh_proc *d, const uint32_t *p, struct kvd_gen_result *res);
/* A reference answer from a daemon without the remote tier. */
void reference(const struct fixture *f, const uint32_t *p, struct kvd_gen_result *res);
void expect_same(const struct kvd_gen_result *a, const struct kvd_gen_result *b);

uint64_t remote_stat(const struct kh_proc *d, const char *key);
/* The tier's state in d's stats: "up" or "backoff" (into st). */
void remote_state(const struct kh_proc *d, char *st, size_t cap);
/* Polls d's stats until the tier is "up" again; fails after 10 s. */
void wait_up(const struct kh_proc *d);
/* Waits until d has written at least n values and has nothing queued. */
void wait_written(const struct kh_proc *d, uint64_t n);
/* admin_evict of d's cached blocks of `tier` ("device", "host", "all"). */
void admin_evict(const struct kh_proc *d, const char *tier);

long long dbsize(const struct fixture *f);
double now_s(void);

#endif
