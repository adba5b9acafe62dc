/* chaos: the bounded chaos load test. Starts kvd with a small random model
 * (kvd-gguf-gen from $KVD_TOOLS_DIR) and a small pool so eviction and
 * swapping happen, computes each greedy prompt's solo reference, then for
 * KVD_CHAOS_SECONDS (default 30) runs KVD_CHAOS_CLIENTS (default 64) client
 * processes under two tenants (forked children that setuid; root needed,
 * else skipped) doing generate (streaming and not, greedy and sampled),
 * block API ops with forks, cancels, pipelining and malformed frames, while
 * the parent kill -9s random clients mid-request and starts new ones.
 * Checks: every request of a client that was not killed got exactly one
 * reply; every greedy generate equals its reference; block accounting is
 * back to baseline; admin_check passes; kvd's RSS grew less than a bound.
 * Then SIGTERM under load: every in-flight request is answered, exit 0.
 * The figures are printed (docs/reliability.md records a run). */
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/protocol.h"
#include "kvd_harness.h"

#define UID_RED 60021
#define UID_BLUE 60022
#define GID_SOCK 65534
#define MAX_CLIENTS 256
#define N_PROMPTS 8
#define PROMPT_MAX 64
#define GEN 12             /* greedy completion length */
#define RSS_BOUND_KB 65536 /* kvd may grow at most 64 MiB over the run */
/* Under AddressSanitizer freed memory sits in a quarantine (256 MiB by
 * default) before reuse, so RSS grows by up to that much without a leak,
 * plus the quarantine's shadow (1/8) and the allocator's own metadata: a
 * run that fills the quarantine (30 s of today's request rate does: 69k
 * requests, RSS +313 MiB under ASan, +4.4 MiB without) needs that room. */
#define RSS_ASAN_QUARANTINE_KB ((256 + 96) * 1024)

/* One client slot's counters, in memory shared with the parent. Counters
 * move only when an action completes, so a killed client leaves the counts
 * of its finished actions. */
struct slot {
    _Atomic uint64_t requests, replies, events, greedy, greedy_ok, streams, sampled, cancels,
        cancelled, block_ops, malformed, gen_errors;
    _Atomic uint64_t errors[KVD_ERR_COUNT];
    _Atomic uint64_t violations;
    char why[160];
};
struct shared {
    struct slot s[MAX_CLIENTS];
    _Atomic int drain_ready;
};

static struct kh_proc kvd;
static struct shared *sh;
static uint32_t prompts[N_PROMPTS][PROMPT_MAX];
static size_t prompt_len[N_PROMPTS];
static uint32_t ref[N_PROMPTS][GEN];
static size_t token_bytes;
static double deadline;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t rng(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void violation(struct slot *sl, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (atomic_fetch_add(&sl->violations, 1) == 0)
        vsnprintf(sl->why, sizeof(sl->why), fmt, ap);
    va_end(ap);
}

static bool tokens_equal(const msgpack_object *o, const uint32_t *t, size_t n)
{
    if (!o || o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size != n)
        return false;
    for (size_t i = 0; i < n; i++)
        if (o->via.array.ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            o->via.array.ptr[i].via.u64 != t[i])
            return false;
    return true;
}

static void send_generate(int fd, uint64_t id, int p, bool stream, double temp, uint64_t seed,
                          uint32_t max_tokens)
{
    struct kh_req q;
    kh_req_begin(&q, "generate", id, 5);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompts[p], prompt_len[p]);
    proto_pack_kv_uint(&q.pk, "max_tokens", max_tokens);
    proto_pack_kv_double(&q.pk, "temperature", temp);
    proto_pack_kv_uint(&q.pk, "seed", seed);
    proto_pack_kv_bool(&q.pk, "stream", stream);
    kh_req_send(fd, &q);
}

/* ---- client actions ---------------------------------------------------- */

/* Reads until every id in ids[0..n) has its reply; greedy prompt p[i]
 * (or -1) is checked against the reference, streamed events concatenated.
 * Returns false on a protocol violation or I/O failure. */
static bool collect(struct slot *sl, int fd, const uint64_t *ids, const int *p, size_t n,
                    const char *what)
{
    bool done[8] = {false};
    uint32_t streamed[8][GEN];
    size_t n_streamed[8] = {0};
    size_t left = n;
    while (left) {
        struct kh_reply r;
        if (kh_recv(fd, &r)) {
            violation(sl, "%s: no reply (EOF or 30 s timeout) with %zu of %zu outstanding", what,
                      left, n);
            return false;
        }
        size_t i = 0;
        while (i < n && ids[i] != r.id)
            i++;
        if (i == n || done[i]) {
            violation(sl, "reply or event for id %llu that is not outstanding",
                      (unsigned long long)r.id);
            kh_reply_free(&r);
            return false;
        }
        const msgpack_object *ev = kh_obj(r.root, "event");
        if (ev) {
            const msgpack_object *t = kh_obj(r.root, "tokens");
            atomic_fetch_add(&sl->events, 1);
            for (uint32_t k = 0; t && t->type == MSGPACK_OBJECT_ARRAY && k < t->via.array.size; k++)
                if (n_streamed[i] < GEN)
                    streamed[i][n_streamed[i]++] = (uint32_t)t->via.array.ptr[k].via.u64;
            kh_reply_free(&r);
            continue;
        }
        done[i] = true;
        left--;
        atomic_fetch_add(&sl->replies, 1);
        atomic_fetch_add(&sl->errors[r.code], 1);
        if (r.code == KVD_EINTERNAL)
            violation(sl, "internal error: %s", r.message);
        const msgpack_object *fr = kh_obj(r.root, "finish_reason");
        if (fr && fr->type == MSGPACK_OBJECT_STR && fr->via.str.size == 9 &&
            !memcmp(fr->via.str.ptr, "cancelled", 9))
            atomic_fetch_add(&sl->cancelled, 1);
        if (p[i] >= 0) {
            atomic_fetch_add(&sl->greedy, 1);
            if (r.code == 0) {
                const msgpack_object *t = kh_obj(r.root, "tokens");
                if (!tokens_equal(t, ref[p[i]], GEN))
                    violation(sl, "greedy prompt %d differs from its solo reference", p[i]);
                else if (n_streamed[i] &&
                         (n_streamed[i] != GEN || memcmp(streamed[i], ref[p[i]], sizeof(ref[0]))))
                    violation(sl, "streamed tokens of prompt %d differ from the reply", p[i]);
                else
                    atomic_fetch_add(&sl->greedy_ok, 1);
            } else {
                atomic_fetch_add(&sl->gen_errors, 1);
            }
        }
        kh_reply_free(&r);
    }
    return true;
}

static bool act_generate(struct slot *sl, int fd, uint64_t *id, uint64_t *rs)
{
    size_t n = 1 + rng(rs) % 3; /* 1-3 pipelined */
    uint64_t ids[3];
    int p[3];
    bool stream = rng(rs) & 1;
    for (size_t i = 0; i < n; i++) {
        ids[i] = ++*id;
        p[i] = (int)(rng(rs) % N_PROMPTS);
        send_generate(fd, ids[i], p[i], stream, 0.0, 0, GEN);
    }
    atomic_fetch_add(&sl->requests, n);
    if (stream)
        atomic_fetch_add(&sl->streams, n);
    return collect(sl, fd, ids, p, n, stream ? "streamed greedy generate" : "greedy generate");
}

static bool act_sampled(struct slot *sl, int fd, uint64_t *id, uint64_t *rs)
{
    uint64_t ids[1] = {++*id};
    int p[1] = {-1};
    send_generate(fd, ids[0], (int)(rng(rs) % N_PROMPTS), false, 0.9, rng(rs), 8);
    atomic_fetch_add(&sl->requests, 1);
    atomic_fetch_add(&sl->sampled, 1);
    return collect(sl, fd, ids, p, 1, "sampled generate");
}

static bool act_cancel(struct slot *sl, int fd, uint64_t *id, uint64_t *rs)
{
    uint64_t ids[2] = {++*id, ++*id};
    int p[2] = {-1, -1};
    send_generate(fd, ids[0], (int)(rng(rs) % N_PROMPTS), rng(rs) & 1, 0.0, 0, 200);
    if (rng(rs) & 1)
        usleep(2000);
    struct kh_req q;
    kh_req_begin(&q, "cancel", ids[1], 1);
    proto_pack_kv_uint(&q.pk, "target", ids[0]);
    kh_req_send(fd, &q);
    atomic_fetch_add(&sl->requests, 2);
    atomic_fetch_add(&sl->cancels, 1);
    return collect(sl, fd, ids, p, 2, "generate + cancel");
}

static int call(struct slot *sl, int fd, struct kh_req *q, uint64_t id, struct kh_reply *r)
{
    atomic_fetch_add(&sl->requests, 1);
    if (kh_req_send(fd, q) || kh_recv(fd, r)) {
        violation(sl, "no reply to block op %llu", (unsigned long long)id);
        return -1;
    }
    if (r->id != id) {
        violation(sl, "reply id %llu for request %llu", (unsigned long long)r->id,
                  (unsigned long long)id);
        kh_reply_free(r);
        return -1;
    }
    atomic_fetch_add(&sl->replies, 1);
    atomic_fetch_add(&sl->errors[r->code], 1);
    if (r->code == KVD_EINTERNAL)
        violation(sl, "internal error: %s", r->message);
    atomic_fetch_add(&sl->block_ops, 1);
    return r->code;
}

static int simple(struct slot *sl, int fd, uint64_t *id, const char *op, uint64_t seq,
                  const char *k, uint64_t v)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, op, ++*id, k ? 2 : 1);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    if (k)
        proto_pack_kv_uint(&q.pk, k, v);
    int rc = call(sl, fd, &q, *id, &r);
    if (rc >= 0)
        kh_reply_free(&r);
    return rc;
}

static int read_check(struct slot *sl, int fd, uint64_t *id, uint64_t seq, size_t n,
                      const uint8_t *want, const char *stage)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "kv_read", ++*id, 3);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", 0);
    proto_pack_kv_uint(&q.pk, "n", n);
    int rc = call(sl, fd, &q, *id, &r);
    if (rc < 0)
        return -1;
    if (rc == 0) {
        const msgpack_object *d = kh_obj(r.root, "data");
        if (!d || d->type != MSGPACK_OBJECT_BIN || d->via.bin.size != n * token_bytes ||
            memcmp(d->via.bin.ptr, want, n * token_bytes))
            violation(sl, "kv_read %s returned other bytes than were written", stage);
    }
    kh_reply_free(&r);
    return rc;
}

/* open, extend, write, read back, commit, fork, read the fork, offload,
 * restore, read again, match a prompt on a new sequence, close. */
static bool act_block(struct slot *sl, int fd, uint64_t *id, uint64_t *rs)
{
    enum { N = 20 };
    uint8_t *data = malloc(N * token_bytes);
    struct kh_req q;
    struct kh_reply r;
    uint64_t s = 0, f = 0;
    bool ok = false;
    /* Token ids of its own (never a prompt's: committing made-up K/V under a
     * real prompt would poison that prompt's cache for this tenant), and
     * bytes derived from them: a commit may swap a block for an identical
     * cached one, which then holds the same bytes. */
    uint32_t toks[N], base = 1000 + (uint32_t)(rng(rs) % (1u << 30));
    for (int i = 0; i < N; i++)
        toks[i] = base + (uint32_t)i;
    for (size_t i = 0; i < N * token_bytes; i++)
        data[i] = (uint8_t)(i * 7 + base);
    kh_req_begin(&q, "seq_open", ++*id, 0);
    int rc = call(sl, fd, &q, *id, &r);
    if (rc < 0)
        goto out;
    if (rc == 0)
        s = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    if (!s) {
        ok = true;
        goto out;
    }
    if (simple(sl, fd, id, "seq_extend", s, "n", N) == 0) {
        kh_req_begin(&q, "kv_write", ++*id, 4);
        proto_pack_kv_uint(&q.pk, "seq", s);
        proto_pack_kv_uint(&q.pk, "start", 0);
        proto_pack_kv_uint(&q.pk, "n", N);
        proto_pack_kv_bin(&q.pk, "data", data, N * token_bytes);
        rc = call(sl, fd, &q, *id, &r);
        if (rc < 0)
            goto out;
        kh_reply_free(&r);
        if (rc == 0) {
            if (read_check(sl, fd, id, s, N, data, "after write") < 0)
                goto out;
            kh_req_begin(&q, "seq_commit", ++*id, 2);
            proto_pack_kv_uint(&q.pk, "seq", s);
            proto_pack_kv_u32_array(&q.pk, "tokens", toks, N);
            if ((rc = call(sl, fd, &q, *id, &r)) < 0)
                goto out;
            kh_reply_free(&r);
            kh_req_begin(&q, "seq_fork", ++*id, 1);
            proto_pack_kv_uint(&q.pk, "seq", s);
            if ((rc = call(sl, fd, &q, *id, &r)) < 0)
                goto out;
            if (rc == 0)
                f = kh_u64(r.root, "seq");
            kh_reply_free(&r);
            if (f && read_check(sl, fd, id, f, N, data, "of the fork") < 0)
                goto out;
            if (simple(sl, fd, id, "seq_offload", s, NULL, 0) < 0 ||
                simple(sl, fd, id, "seq_restore", s, NULL, 0) < 0)
                goto out;
            if (read_check(sl, fd, id, s, N, data, "after offload+restore") < 0)
                goto out;
        }
    }
    if (f && simple(sl, fd, id, "seq_close", f, NULL, 0) < 0)
        goto out;
    /* Always closed: a client that keeps blocks while it waits for a
     * generate can starve that generate (docs/reliability.md); sequences
     * left open by killed clients are released by their connection's close. */
    if (simple(sl, fd, id, "seq_close", s, NULL, 0) < 0)
        goto out;
    ok = true;
out:
    free(data);
    return ok;
}

/* A malformed frame on a connection of its own: one error reply, closed. */
static bool act_malformed(struct slot *sl, uint64_t *rs)
{
    uint8_t buf[64];
    size_t n = 4 + rng(rs) % 40;
    int fd = kh_connect(kvd.sock);
    if (fd < 0) {
        violation(sl, "connect failed");
        return false;
    }
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)rng(rs);
    switch (rng(rs) % 3) {
    case 0: /* a frame of garbage */
        buf[0] = 0, buf[1] = 0, buf[2] = 0, buf[3] = (uint8_t)(n - 4);
        if (n == 4)
            buf[3] = 0;
        break;
    case 1: /* 0xFFFFFFFF length */
        memset(buf, 0xff, 4);
        break;
    default: /* a map that is not a request: {"x": nil} */
        memcpy(buf, "\0\0\0\4\x81\xa1x\xc0", 8);
        n = 8;
    }
    kh_send_raw(fd, buf, n);
    struct kh_reply r;
    int got = kh_recv(fd, &r);
    atomic_fetch_add(&sl->malformed, 1);
    if (got == 0) {
        if (r.code == KVD_OK)
            violation(sl, "malformed frame answered ok");
        kh_reply_free(&r);
    } else if (buf[3] != 0 || memcmp(buf, "\xff\xff\xff\xff", 4) == 0) {
        violation(sl, "malformed frame got no error reply");
    }
    close(fd);
    return true;
}

/* A client process: actions until the deadline. */
static int client_main(int slot, uint64_t seed)
{
    struct slot *sl = &sh->s[slot];
    uint64_t rs = seed, id = 0;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 2;
    while (now_s() < deadline && !atomic_load(&sl->violations)) {
        uint64_t a = rng(&rs) % 100;
        bool ok;
        if (a < 35)
            ok = act_generate(sl, fd, &id, &rs);
        else if (a < 50)
            ok = act_sampled(sl, fd, &id, &rs);
        else if (a < 62)
            ok = act_cancel(sl, fd, &id, &rs);
        else if (a < 95)
            ok = act_block(sl, fd, &id, &rs);
        else
            ok = act_malformed(sl, &rs);
        if (!ok)
            break;
    }
    /* Nothing more may arrive: every request was answered exactly once. */
    struct pollfd pf = {fd, POLLIN, 0};
    if (!atomic_load(&sl->violations) && poll(&pf, 1, 20) == 1) {
        char c;
        if (recv(fd, &c, 1, MSG_DONTWAIT) == 1)
            violation(sl, "bytes after the last reply");
    }
    close(fd);
    return atomic_load(&sl->violations) ? 1 : 0;
}

static pid_t spawn(int slot, uint64_t seed)
{
    uid_t uid = slot % 2 ? UID_BLUE : UID_RED;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (setgroups(0, NULL) != 0 || setgid(GID_SOCK) != 0 || setuid(uid) != 0)
            _exit(120);
        _exit(client_main(slot, seed));
    }
    return pid;
}

/* ---- the test ------------------------------------------------------------ */

static long rss_kb(pid_t pid)
{
    char path[64], line[256];
    long kb = -1;
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
            break;
    fclose(f);
    return kb;
}

/* Whether the process maps the ASan runtime (a sanitized kvd). */
static bool has_asan(pid_t pid)
{
    char path[64], line[512];
    bool found = false;
    snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, "libasan") != NULL;
    fclose(f);
    return found;
}

static const char *conf_text = "[tenant:red]\nuids = 60021\n[tenant:blue]\nuids = 60022\n";

static void make_prompts(void)
{
    uint64_t s = 42;
    for (int p = 0; p < N_PROMPTS; p++) {
        prompt_len[p] = 24 + (size_t)(rng(&s) % 33);
        for (size_t i = 0; i < prompt_len[p]; i++)
            /* prompts share a 16-token prefix in pairs, so the cache hits */
            prompts[p][i] = (uint32_t)(i < 16 ? (p / 2) * 31 + i : rng(&s) % 250) + 1;
    }
}

static void references(int fd)
{
    for (int p = 0; p < N_PROMPTS; p++) {
        struct kh_reply r;
        send_generate(fd, 1000 + p, p, false, 0.0, 0, GEN);
        assert_int_equal(kh_recv(fd, &r), 0);
        assert_int_equal(r.code, 0);
        const msgpack_object *t = kh_obj(r.root, "tokens");
        assert_non_null(t);
        assert_int_equal(t->via.array.size, GEN);
        for (int i = 0; i < GEN; i++)
            ref[p][i] = (uint32_t)t->via.array.ptr[i].via.u64;
        kh_reply_free(&r);
    }
}

static int drain_client(void *arg)
{
    int slot = *(int *)arg;
    struct slot *sl = &sh->s[slot];
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 2;
    uint64_t ids[2] = {1, 2};
    int p[2] = {-1, -1};
    send_generate(fd, 1, slot % N_PROMPTS, false, 0.0, 0, 96);
    send_generate(fd, 2, (slot + 1) % N_PROMPTS, true, 0.0, 0, 96);
    atomic_fetch_add(&sl->requests, 2);
    atomic_fetch_add(&sh->drain_ready, 1);
    if (!collect(sl, fd, ids, p, 2, "drain"))
        return 3;
    if (!kh_peer_closed(fd))
        return 4;
    close(fd);
    return 0;
}

static void test_chaos(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    const char *secs = getenv("KVD_CHAOS_SECONDS");
    const char *ncl = getenv("KVD_CHAOS_CLIENTS");
    int seconds = secs ? atoi(secs) : 30, n_clients = ncl ? atoi(ncl) : 64;
    char model[256], cmd[1024];
    if (geteuid() != 0) {
        fprintf(stderr, "chaos: needs root (clients setuid to two tenants); skipped\n");
        exit(77);
    }
    assert_non_null(tools);
    assert_true(n_clients >= 2 && n_clients <= MAX_CLIENTS);
    snprintf(model, sizeof(model), "/tmp/kvd-chaos-%d.gguf", (int)getpid());
    snprintf(cmd, sizeof(cmd),
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 512 --seed 7 >/dev/null",
             tools, model);
    assert_int_equal(system(cmd), 0);
    const char *args[] = {"--backend",
                          "cpu",
                          "--model",
                          model,
                          "--block-tokens",
                          "16",
                          "--device-blocks",
                          "96",
                          "--host-blocks",
                          "48",
                          "--socket-group",
                          "nogroup",
                          NULL};
    assert_int_equal(kh_start(&kvd, conf_text, args), 0);
    unlink(model); /* kvd has it mapped */
    sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    assert_true(sh != MAP_FAILED);
    memset(sh, 0, sizeof(*sh));

    make_prompts();
    int fd = kh_connect(kvd.sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    const msgpack_object *kv = kh_obj(r.root, "kv");
    assert_non_null(kv);
    token_bytes = kh_u64(kv, "block_bytes") / 16;
    kh_reply_free(&r);
    references(fd);
    uint64_t base_dev = kh_stat(fd, "device", "used"), base_host = kh_stat(fd, "host", "used");
    long rss0 = rss_kb(kvd.pid);

    /* The chaos. */
    pid_t pids[MAX_CLIENTS];
    uint64_t seed = 1, kills = 0, spawned = 0;
    double t0 = now_s();
    deadline = t0 + seconds;
    for (int i = 0; i < n_clients; i++, spawned++)
        pids[i] = spawn(i, rng(&seed));
    while (now_s() < deadline - 1) {
        usleep(150000);
        int v = (int)(rng(&seed) % (uint64_t)n_clients);
        if (kill(pids[v], SIGKILL) == 0) {
            waitpid(pids[v], NULL, 0);
            kills++;
            pids[v] = spawn(v, rng(&seed));
            spawned++;
        }
    }
    int failed_clients = 0;
    for (int i = 0; i < n_clients; i++) {
        int st;
        waitpid(pids[i], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            failed_clients++;
    }
    double elapsed = now_s() - t0;

    /* The figures. */
    struct slot tot;
    memset(&tot, 0, sizeof(tot));
    for (int i = 0; i < n_clients; i++) {
        struct slot *s = &sh->s[i];
        tot.requests += s->requests;
        tot.replies += s->replies;
        tot.events += s->events;
        tot.greedy += s->greedy;
        tot.greedy_ok += s->greedy_ok;
        tot.streams += s->streams;
        tot.sampled += s->sampled;
        tot.cancels += s->cancels;
        tot.cancelled += s->cancelled;
        tot.block_ops += s->block_ops;
        tot.malformed += s->malformed;
        tot.gen_errors += s->gen_errors;
        tot.violations += s->violations;
        for (int c = 0; c < KVD_ERR_COUNT; c++)
            tot.errors[c] += s->errors[c];
        if (s->violations)
            fprintf(stderr, "chaos: client slot %d: %s\n", i, s->why);
    }
    /* The loop closes the killed clients' connections asynchronously. */
    for (int tries = 0; tries < 500 && (kh_stat(fd, "device", "used") != base_dev ||
                                        kh_stat(fd, "host", "used") != base_host);
         tries++)
        usleep(20000);
    uint64_t dev = kh_stat(fd, "device", "used"), host = kh_stat(fd, "host", "used");
    long rss1 = rss_kb(kvd.pid);
    long rss_bound = RSS_BOUND_KB + (has_asan(kvd.pid) ? RSS_ASAN_QUARANTINE_KB : 0);
    printf("chaos: %.0f s, %d clients (2 tenants), %llu processes started, %llu killed -9\n",
           elapsed, n_clients, (unsigned long long)spawned, (unsigned long long)kills);
    printf("chaos: %llu requests, %llu replies (finished actions), %llu stream events\n",
           (unsigned long long)tot.requests, (unsigned long long)tot.replies,
           (unsigned long long)tot.events);
    printf(
        "chaos: greedy %llu (%llu equal to reference, %llu errors), streamed %llu, sampled %llu, "
        "cancels %llu (%llu cancelled), block ops %llu, malformed %llu\n",
        (unsigned long long)tot.greedy, (unsigned long long)tot.greedy_ok,
        (unsigned long long)tot.gen_errors, (unsigned long long)tot.streams,
        (unsigned long long)tot.sampled, (unsigned long long)tot.cancels,
        (unsigned long long)tot.cancelled, (unsigned long long)tot.block_ops,
        (unsigned long long)tot.malformed);
    for (int c = 1; c < KVD_ERR_COUNT; c++)
        if (tot.errors[c])
            printf("chaos:   replies %-17s %llu\n", kvd_err_code(c),
                   (unsigned long long)tot.errors[c]);
    printf("chaos: swapped out %llu blocks (%llu bytes), in %llu blocks (%llu bytes), "
           "evictions %llu, checksum failures %llu\n",
           (unsigned long long)kh_stat(fd, "counters", "swaps_out"),
           (unsigned long long)kh_stat(fd, "counters", "swap_bytes_out"),
           (unsigned long long)kh_stat(fd, "counters", "swaps_in"),
           (unsigned long long)kh_stat(fd, "counters", "swap_bytes_in"),
           (unsigned long long)kh_stat(fd, "counters", "evictions"),
           (unsigned long long)kh_stat(fd, "counters", "checksum_failures"));
    printf("chaos: device used %llu (baseline %llu), host used %llu (baseline %llu); kvd RSS "
           "%ld -> %ld kB (bound +%ld kB)\n",
           (unsigned long long)dev, (unsigned long long)base_dev, (unsigned long long)host,
           (unsigned long long)base_host, rss0, rss1, rss_bound);
    assert_int_equal(tot.violations, 0);
    assert_int_equal(failed_clients, 0);
    assert_true(tot.greedy_ok > 0 && tot.block_ops > 0 && kills > 0);
    assert_int_equal(tot.errors[KVD_EINTERNAL], 0);
    assert_int_equal(dev, base_dev);
    assert_int_equal(host, base_host);
    assert_int_equal(kh_call0(fd, "admin_check", 2, &r), 0);
    kh_reply_free(&r);
    assert_true(rss1 >= 0 && rss1 - rss0 < rss_bound);

    /* SIGTERM under load: 16 clients with requests in flight. */
    memset(sh, 0, sizeof(*sh));
    int n_drain = 16, slots[16];
    for (int i = 0; i < n_drain; i++) {
        slots[i] = i;
        pids[i] = kh_run_as(i % 2 ? UID_BLUE : UID_RED, GID_SOCK, drain_client, &slots[i]);
    }
    while (atomic_load(&sh->drain_ready) < n_drain)
        usleep(10000);
    usleep(100000);
    close(fd);
    assert_int_equal(kill(kvd.pid, SIGTERM), 0);
    int code = kh_wait(&kvd);
    int drain_failed = 0;
    uint64_t answered = 0, cancelled = 0, ok = 0;
    for (int i = 0; i < n_drain; i++) {
        int st = kh_child_status(pids[i]);
        if (st != 0) {
            drain_failed++;
            fprintf(stderr, "chaos: drain client %d: status %d %s\n", i, st, sh->s[i].why);
        }
        answered += sh->s[i].replies;
        cancelled += sh->s[i].errors[KVD_ECANCELLED];
        ok += sh->s[i].errors[0];
    }
    printf("chaos: SIGTERM with %d requests in flight: %llu answered (%llu ok, %llu "
           "cancelled), kvd exit code %d\n",
           2 * n_drain, (unsigned long long)answered, (unsigned long long)ok,
           (unsigned long long)cancelled, code);
    kh_cleanup_dir(&kvd);
    assert_int_equal(drain_failed, 0);
    assert_int_equal(answered, 2 * (uint64_t)n_drain);
    assert_int_equal(code, 0);
    munmap(sh, sizeof(*sh));
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_chaos)};
    return cmocka_run_group_tests_name("chaos", tests, NULL, NULL);
}
