/* The disk tier against a real kvd serving a tiny random model: a restart
 * (SIGTERM, and kill -9 after the write-behind) answers from the prefix it
 * had, byte-identical; flipped bytes, a truncated or garbage directory and
 * another model's file never serve a wrong token (recomputed, counted);
 * a second daemon cannot take the directory; tenants never match each
 * other's disk blocks across a restart; a restore on SCHED_IDLE prefetch
 * workers completes while the executor is busy decoding. */
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

#define N_PROMPT 2000
#define BT 16
#define UID_A 60011
#define UID_B 60012
#define GID_ALL 65534 /* nogroup: the socket's group */

struct fixture {
    char tmp[64];
    char model_a[128], model_b[128];
    char disk[128];
    uint32_t prompt[N_PROMPT];
};

static int gen_model(const char *path, int seed)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 4096 --seed %d >/dev/null",
             tools ? tools : ".", path, seed);
    return system(cmd) == 0 ? 0 : -1;
}

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    snprintf(f->tmp, sizeof f->tmp, "/tmp/kvd-disk.XXXXXX");
    if (!mkdtemp(f->tmp))
        return -1;
    snprintf(f->model_a, sizeof f->model_a, "%s/a.gguf", f->tmp);
    snprintf(f->model_b, sizeof f->model_b, "%s/b.gguf", f->tmp);
    snprintf(f->disk, sizeof f->disk, "%s/disk", f->tmp);
    if (gen_model(f->model_a, 1) || gen_model(f->model_b, 2))
        return -1;
    for (int i = 0; i < N_PROMPT; i++)
        f->prompt[i] = (uint32_t)(i * 37 + 11) % 256;
    *state = f;
    return 0;
}

static void rm_disk(const struct fixture *f)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->disk);
    if (system(cmd) != 0)
        fprintf(stderr, "rm_disk: %s failed\n", cmd);
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "teardown: %s failed\n", cmd);
    free(f);
    return 0;
}

/* Each test starts from an empty disk directory. */
static int per_test(void **state)
{
    rm_disk(*state);
    return 0;
}

static const char *const conf_tenants = "[admin]\nuids = 0\n"
                                        "[tenant:alpha]\nuids = 60011\n"
                                        "[tenant:beta]\nuids = 60012\n";

/* A daemon on f's directory writing back every writeback_ms, its log at
 * info level when info (the write-back at SIGTERM is an info line). */
static void start_ex(struct kh_proc *d, const struct fixture *f, const char *model,
                     const char *conf, const char *faults, const char *writeback_ms, bool info)
{
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                model,
                                "--disk-dir",
                                f->disk,
                                "--disk-max-bytes",
                                "64M",
                                "--disk-writeback-ms",
                                writeback_ms,
                                "--socket-group",
                                "nogroup",
                                "--step-tokens",
                                "2048",
                                info ? "--log-level" : NULL,
                                "info",
                                NULL};
    char env0[128];
    snprintf(env0, sizeof env0, "KVD_FAULTS=%s", faults ? faults : "");
    const char *const env[] = {env0, NULL};
    struct kh_opts o = {.conf_text = conf, .args = args, .env = env};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
}

static void start_env(struct kh_proc *d, const struct fixture *f, const char *model,
                      const char *conf, const char *faults)
{
    start_ex(d, f, model, conf, faults, "20", false);
}

static void start(struct kh_proc *d, const struct fixture *f, const char *model, const char *conf)
{
    start_env(d, f, model, conf, NULL);
}

static int generate(const char *sock, const uint32_t *p, size_t n, struct kvd_gen_result *res)
{
    struct kvd_ctx *c = kvd_connect(sock);
    if (!c || c->err)
        return -1;
    kvd_set_timeout(c, 120000);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 8;
    o.temperature = 0;
    int rc = kvd_generate(c, p, n, &o, res);
    kvd_close(c);
    return rc;
}

static void gen_ok(const struct kh_proc *d, const struct fixture *f, struct kvd_gen_result *res)
{
    if (generate(d->sock, f->prompt, N_PROMPT, res) != 0)
        fail_msg("generate failed");
    assert_int_equal(res->n_tokens, 8);
}

/* A number of the admin's stats "disk" map. */
static uint64_t disk_stat(const struct kh_proc *d, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    uint64_t v = kh_stat(fd, "disk", key);
    close(fd);
    assert_true(v != UINT64_MAX);
    return v;
}

/* Waits until the writer has nothing queued (it runs every 20 ms here). */
static void wait_drained(const struct kh_proc *d)
{
    for (int i = 0; i < 12000 && disk_stat(d, "queued") != 0; i++)
        usleep(10000);
    assert_int_equal(disk_stat(d, "queued"), 0);
}

/* Waits until the writer has written at least n blocks and nothing is
 * queued (the write-behind runs every 20 ms here). */
static void wait_written(const struct kh_proc *d, uint64_t n)
{
    for (int i = 0; i < 12000; i++) {
        if (disk_stat(d, "writes") >= n && disk_stat(d, "queued") == 0)
            return;
        usleep(10000);
    }
    fail_msg("the disk tier wrote %llu blocks, not %llu",
             (unsigned long long)disk_stat(d, "writes"), (unsigned long long)n);
}

/* hello's "warm": whether the pools keep a warm reserve. */
static bool hello_warm(const char *sock)
{
    int fd = kh_connect(sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    const msgpack_object *w = kh_obj(r.root, "warm");
    assert_non_null(w);
    assert_int_equal(w->type, MSGPACK_OBJECT_BOOLEAN);
    bool on = w->via.boolean;
    kh_reply_free(&r);
    close(fd);
    return on;
}

/* The whole blocks a match can reuse: every prompt token but the last. */
static const uint64_t full_blocks = (N_PROMPT - 1) / BT;

static void expect_same(const struct kvd_gen_result *a, const struct kvd_gen_result *b)
{
    assert_int_equal(a->n_tokens, b->n_tokens);
    assert_memory_equal(a->tokens, b->tokens, a->n_tokens * sizeof(uint32_t));
}

static void test_restart_after_sigterm(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result cold, warm;
    start(&d, f, f->model_a, NULL);
    /* with a disk tier the cpu pools keep a warm reserve by default (for
     * the restores), without one none */
    assert_true(hello_warm(d.sock));
    struct kh_proc plain;
    const char *const plain_args[] = {"--backend", "cpu", "--model", f->model_a, NULL};
    assert_int_equal(kh_start(&plain, NULL, plain_args), 0);
    assert_false(hello_warm(plain.sock));
    assert_int_equal(kh_stop(&plain), 0);
    gen_ok(&d, f, &cold);
    assert_int_equal(cold.cached_tokens, 0);
    /* No waiting for the writer: SIGTERM writes back what is left. */
    assert_int_equal(kh_stop(&d), 0);

    start(&d, f, f->model_a, NULL);
    assert_true(disk_stat(&d, "loaded") >= full_blocks);
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_int_equal(warm.cached_tokens, full_blocks * BT);
    assert_true(disk_stat(&d, "restored") >= full_blocks);
    assert_int_equal(disk_stat(&d, "checksum_failures"), 0);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

/* The writer never wakes before SIGTERM (disk-writeback-ms an hour): every
 * block reaches the disk in the write-back at shutdown, which the log
 * reports with its count, and the next start serves them. */
static void test_sigterm_writes_back_and_logs(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result cold, warm;
    start_ex(&d, f, f->model_a, NULL, NULL, "3600000", true);
    gen_ok(&d, f, &cold);
    assert_int_equal(disk_stat(&d, "writes"), 0);
    assert_true(disk_stat(&d, "queued") >= full_blocks);
    assert_int_equal(kill(d.pid, SIGTERM), 0);
    assert_int_equal(kh_wait(&d), 0);
    FILE *fp = fopen(d.log, "r");
    assert_non_null(fp);
    char line[1024];
    unsigned long long n = 0;
    bool found = false;
    while (fgets(line, sizeof line, fp)) {
        /* "disk tier (model NAME): wrote back N blocks in T ms" */
        const char *at = strstr(line, "disk tier");
        at = at ? strstr(at, "): wrote back ") : NULL;
        if (at && !strstr(at, "not written") && sscanf(at, "): wrote back %llu blocks in", &n) == 1)
            found = true;
    }
    fclose(fp);
    kh_cleanup_dir(&d);
    if (!found)
        fail_msg("no \"disk tier (model ...): wrote back N blocks\" line in the log");
    assert_true(n >= full_blocks);

    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_int_equal(warm.cached_tokens, full_blocks * BT);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

static void test_restart_after_kill9(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result cold, warm;
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &cold);
    wait_written(&d, full_blocks);
    kh_kill(&d);
    kh_cleanup_dir(&d);

    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_int_equal(warm.cached_tokens, full_blocks * BT);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

/* Flips one byte in the data of every eighth slot and in a few index
 * records while kvd is stopped. */
static void flip_bytes(const struct fixture *f, uint64_t slot_bytes, uint64_t n_slots)
{
    char path[192];
    snprintf(path, sizeof path, "%s/blocks.kvd", f->disk);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    for (uint64_t s = 3; s < n_slots; s += 8) {
        off_t off = (off_t)(4096 + s * slot_bytes + 4096 + 100);
        unsigned char b;
        assert_int_equal(pread(fd, &b, 1, off), 1);
        b ^= 0x5a;
        assert_int_equal(pwrite(fd, &b, 1, off), 1);
    }
    close(fd);
    snprintf(path, sizeof path, "%s/index.kvd", f->disk);
    fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    for (uint64_t s = 5; s < n_slots; s += 16) {
        off_t off = (off_t)(4096 + s * 64 + 20);
        unsigned char b;
        assert_int_equal(pread(fd, &b, 1, off), 1);
        b ^= 0x01;
        assert_int_equal(pwrite(fd, &b, 1, off), 1);
    }
    close(fd);
}

static void test_flipped_bytes_are_recomputed(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result cold, warm;
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &cold);
    wait_written(&d, full_blocks);
    uint64_t slot_bytes = disk_stat(&d, "slot_bytes"), n = disk_stat(&d, "writes");
    assert_int_equal(kh_stop(&d), 0);
    flip_bytes(f, slot_bytes, n);

    start(&d, f, f->model_a, NULL);
    assert_true(disk_stat(&d, "refused_at_load") >= 1);
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_true(warm.cached_tokens < full_blocks * BT);
    assert_true(disk_stat(&d, "checksum_failures") >= 1);
    /* The recomputed blocks are written again (the ones after the first bad
     * one were never read: they wait for a later match to be checked), so
     * the next run reaches further. */
    size_t second = warm.cached_tokens;
    wait_written(&d, 1);
    kvd_gen_result_free(&warm);
    assert_int_equal(kh_stop(&d), 0);
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_true(warm.cached_tokens > second);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

static void write_garbage(const char *path, size_t n, unsigned seed)
{
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    srand(seed);
    for (size_t i = 0; i < n; i++)
        fputc(rand() & 0xff, fp);
    fclose(fp);
}

static void test_truncated_or_garbage_directory(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result cold, warm;
    char path[192];
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &cold);
    assert_int_equal(kh_stop(&d), 0);

    /* A block file cut in half: formatted anew, nothing served from it. */
    snprintf(path, sizeof path, "%s/blocks.kvd", f->disk);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(truncate(path, sb.st_size / 2), 0);
    start(&d, f, f->model_a, NULL);
    assert_int_equal(disk_stat(&d, "loaded"), 0);
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_int_equal(warm.cached_tokens, 0);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&warm);

    /* Garbage in both files. */
    write_garbage(path, 1 << 20, 1);
    snprintf(path, sizeof path, "%s/index.kvd", f->disk);
    write_garbage(path, 1 << 16, 2);
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_int_equal(warm.cached_tokens, 0);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

static void test_other_model_never_matches(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result a, b;
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &a);
    assert_int_equal(kh_stop(&d), 0);

    /* Same shapes, other weights: its fingerprint, so its keys, differ. */
    start(&d, f, f->model_b, NULL);
    assert_true(disk_stat(&d, "loaded") >= full_blocks);
    gen_ok(&d, f, &b);
    assert_int_equal(b.cached_tokens, 0);
    assert_int_equal(disk_stat(&d, "restored"), 0);
    assert_int_equal(disk_stat(&d, "checksum_failures"), 0);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&a);
    kvd_gen_result_free(&b);
}

static void test_second_daemon_refused(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    start(&d, f, f->model_a, NULL);
    const char *const args[] = {"--backend",        "cpu",        "--model",
                                f->model_a,         "--disk-dir", f->disk,
                                "--disk-max-bytes", "64M",        NULL};
    struct kh_opts o = {.args = args};
    assert_int_equal(kh_run(&o), 2);
    assert_int_equal(kh_stop(&d), 0);
}

/* A child running as uid: generates the prompt and exits with 0 when its
 * cached_tokens is `want` (1 for a mismatch, 2 for a failure). */
struct child_arg {
    const char *sock;
    const struct fixture *f;
    size_t want_cached;
    uint32_t *out; /* its tokens, through a pipe */
    int pipe_w;
};

static int child_gen(void *arg)
{
    struct child_arg *a = arg;
    struct kvd_gen_result r;
    if (generate(a->sock, a->f->prompt, N_PROMPT, &r) != 0)
        return 2;
    if (write(a->pipe_w, r.tokens, r.n_tokens * sizeof(uint32_t)) < 0)
        return 2;
    int rc = r.cached_tokens == a->want_cached ? 0 : 1;
    if (rc)
        fprintf(stderr, "child: cached %zu, wanted %zu\n", (size_t)r.cached_tokens, a->want_cached);
    kvd_gen_result_free(&r);
    return rc;
}

static void run_child(uid_t uid, struct child_arg *a, uint32_t toks[8])
{
    int p[2];
    assert_int_equal(pipe(p), 0);
    a->pipe_w = p[1];
    pid_t pid = kh_run_as(uid, GID_ALL, child_gen, a);
    assert_true(pid > 0);
    close(p[1]);
    assert_int_equal(kh_child_status(pid), 0);
    assert_int_equal(read(p[0], toks, 8 * sizeof(uint32_t)), 8 * sizeof(uint32_t));
    close(p[0]);
}

static void test_tenants_isolated_across_restart(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    uint32_t a1[8], b1[8], a2[8];
    if (geteuid() != 0)
        skip();
    start(&d, f, f->model_a, conf_tenants);
    struct child_arg ca = {d.sock, f, 0, NULL, -1};
    run_child(UID_A, &ca, a1);
    assert_int_equal(kh_stop(&d), 0);

    start(&d, f, f->model_a, conf_tenants);
    struct child_arg cb = {d.sock, f, 0, NULL, -1};
    run_child(UID_B, &cb, b1); /* beta finds none of alpha's blocks */
    assert_memory_equal(a1, b1, sizeof a1);
    assert_int_equal(disk_stat(&d, "restored"), 0);
    struct child_arg ca2 = {d.sock, f, full_blocks * BT, NULL, -1};
    run_child(UID_A, &ca2, a2); /* alpha finds all of its own */
    assert_memory_equal(a1, a2, sizeof a1);
    assert_int_equal(kh_stop(&d), 0);
}

/* A stream that keeps the executor busy: max_tokens greedy tokens of a
 * prompt of its own; started says its first tokens arrived. */
struct busy_stream {
    const char *sock;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool started;
    size_t n_tokens;
    int rc;
};

static int busy_on_tokens(void *user, const uint32_t *tokens, size_t n)
{
    (void)tokens;
    struct busy_stream *b = user;
    pthread_mutex_lock(&b->mu);
    b->n_tokens += n;
    b->started = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return 0;
}

static void *busy_run(void *arg)
{
    struct busy_stream *b = arg;
    uint32_t p[64];
    for (int i = 0; i < 64; i++)
        p[i] = (uint32_t)(i * 101 + 7) % 256;
    struct kvd_ctx *c = kvd_connect(b->sock);
    b->rc = -1;
    if (c && !c->err) {
        kvd_set_timeout(c, 120000);
        struct kvd_gen_opts o;
        kvd_gen_opts_init(&o);
        o.max_tokens = 1500;
        o.temperature = 0;
        o.on_tokens = busy_on_tokens;
        o.user = b;
        struct kvd_gen_result r;
        b->rc = kvd_generate(c, p, 64, &o, &r);
        if (b->rc == 0)
            kvd_gen_result_free(&r);
    }
    if (c)
        kvd_close(c);
    pthread_mutex_lock(&b->mu);
    b->started = true; /* also when it failed: nobody waits forever */
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* The prefetch workers at SCHED_IDLE (prefetch-idle-ms 1: raised back to
 * prefetch-nice after a millisecond of a restore) restore a whole prompt
 * after a restart while another request keeps the executor decoding: the
 * restore completes, every whole block from disk, the tokens the cold
 * run's. Going back from SCHED_IDLE needs root or RLIMIT_NICE. */
static void test_restore_while_executor_busy(void **state)
{
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result cold, warm;
    if (geteuid() != 0)
        skip();
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &cold);
    assert_int_equal(kh_stop(&d), 0);

    const char *const args[] = {
        "--backend",        "cpu",  "--model",   f->model_a, "--disk-dir",         f->disk,
        "--disk-max-bytes", "64M",  "--threads", "2",        "--prefetch-idle-ms", "1",
        "--step-tokens",    "2048", NULL};
    struct kh_opts o = {.args = args};
    memset(&d, 0, sizeof d);
    assert_int_equal(kh_spawn(&d, &o), 0);
    int fd = kh_connect(d.sock);
    assert_true(fd >= 0);
    assert_int_equal(kh_stat(fd, "prefetch", "idle_after_ms"), 1);
    close(fd);

    struct busy_stream b = {.sock = d.sock};
    pthread_mutex_init(&b.mu, NULL);
    pthread_cond_init(&b.cv, NULL);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, busy_run, &b), 0);
    pthread_mutex_lock(&b.mu);
    while (!b.started)
        pthread_cond_wait(&b.cv, &b.mu);
    pthread_mutex_unlock(&b.mu);

    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_int_equal(warm.cached_tokens, full_blocks * BT);
    assert_true(disk_stat(&d, "restored") >= full_blocks);
    pthread_join(t, NULL);
    assert_int_equal(b.rc, 0);
    assert_int_equal(b.n_tokens, 1500);
    fd = kh_connect(d.sock);
    assert_true(fd >= 0);
    assert_true(kh_stat(fd, "prefetch", "done") >= 1);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
    pthread_mutex_destroy(&b.mu);
    pthread_cond_destroy(&b.cv);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

/* ---- faults on the disk path (the fault-injection build: test_fault_disk) */

#ifndef KVD_DISK_FAULTS
#define KVD_DISK_FAULTS 0
#endif

/* A first run under `faults`, a restart without: the same tokens, and the
 * counter `counter` of the first run at least 1. */
static void fault_then_clean(const struct fixture *f, const char *faults, const char *counter,
                             struct kvd_gen_result *cold, struct kvd_gen_result *warm)
{
    struct kh_proc d;
    start_env(&d, f, f->model_a, NULL, faults);
    gen_ok(&d, f, cold);
    wait_drained(&d);
    if (disk_stat(&d, counter) < 1)
        fail_msg("%s: no %s counted", faults, counter);
    assert_int_equal(kh_stop(&d), 0);
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, warm);
    expect_same(cold, warm);
    assert_int_equal(kh_stop(&d), 0);
}

static void test_fault_write_errors(void **state)
{
    if (!KVD_DISK_FAULTS)
        skip(); /* a kvd without fault injection ignores KVD_FAULTS */
    struct kvd_gen_result cold, warm;
    fault_then_clean(*state, "diskwrite:every=3,disknospc:every=5", "io_errors", &cold, &warm);
    assert_true(warm.cached_tokens < full_blocks * BT); /* the chain stops at a lost block */
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

static void test_fault_torn_writes(void **state)
{
    if (!KVD_DISK_FAULTS)
        skip(); /* a kvd without fault injection ignores KVD_FAULTS */
    struct kvd_gen_result cold, warm;
    struct fixture *f = *state;
    fault_then_clean(f, "disktorn:every=4", "writes", &cold, &warm);
    assert_true(warm.cached_tokens < full_blocks * BT);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

static void test_fault_fsync_failure(void **state)
{
    if (!KVD_DISK_FAULTS)
        skip(); /* a kvd without fault injection ignores KVD_FAULTS */
    struct kvd_gen_result cold, warm;
    fault_then_clean(*state, "diskfsync:nth=1", "io_errors", &cold, &warm);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

static void test_fault_short_reads(void **state)
{
    if (!KVD_DISK_FAULTS)
        skip(); /* a kvd without fault injection ignores KVD_FAULTS */
    struct fixture *f = *state;
    struct kh_proc d;
    struct kvd_gen_result cold, warm;
    start(&d, f, f->model_a, NULL);
    gen_ok(&d, f, &cold);
    assert_int_equal(kh_stop(&d), 0);
    start_env(&d, f, f->model_a, NULL, "diskread:every=7");
    gen_ok(&d, f, &warm);
    expect_same(&cold, &warm);
    assert_true(disk_stat(&d, "io_errors") >= 1);
    assert_true(warm.cached_tokens < full_blocks * BT);
    assert_int_equal(kh_stop(&d), 0);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_restart_after_sigterm, per_test),
        cmocka_unit_test_setup(test_sigterm_writes_back_and_logs, per_test),
        cmocka_unit_test_setup(test_restart_after_kill9, per_test),
        cmocka_unit_test_setup(test_flipped_bytes_are_recomputed, per_test),
        cmocka_unit_test_setup(test_truncated_or_garbage_directory, per_test),
        cmocka_unit_test_setup(test_other_model_never_matches, per_test),
        cmocka_unit_test_setup(test_second_daemon_refused, per_test),
        cmocka_unit_test_setup(test_tenants_isolated_across_restart, per_test),
        cmocka_unit_test_setup(test_restore_while_executor_busy, per_test),
        cmocka_unit_test_setup(test_fault_write_errors, per_test),
        cmocka_unit_test_setup(test_fault_torn_writes, per_test),
        cmocka_unit_test_setup(test_fault_fsync_failure, per_test),
        cmocka_unit_test_setup(test_fault_short_reads, per_test),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
