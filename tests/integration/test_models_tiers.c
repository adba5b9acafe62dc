/* The disk and remote tiers of a daemon serving several models, against a
 * real kvd and a real redis-server: two models of the same shapes and other
 * weights (their fingerprints differ, nothing else does), each with its own
 * kvmm. Disk: both models' prefixes come back after a restart from their
 * own directories, and with the files swapped between the names no block
 * matches (each model still gives its own file's tokens). Remote: a prompt
 * one daemon computed on one model is restored by a second daemon for that
 * model only, never for the other, and each model's tier counts its own. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"
#include "redis_harness.h"
#include "two_models.h"

#define BT 16
#define N_P 200
#define N_GEN 8
#define FULL_BLOCKS ((uint64_t)(N_P - 1) / BT)

static const char *const conf = "[admin]\nuids = 0\n[limits]\nremote = on\n";

struct fixture {
    char tmp[64];
    char a[128], b[128]; /* same shapes, other weights */
    char disk[128];
    uint32_t prompt[N_P];
    struct redis_srv redis;
    bool have_redis;
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    if (!f || !tools)
        return -1;
    snprintf(f->tmp, sizeof f->tmp, "/tmp/kvd-mtiers.XXXXXX");
    if (!mkdtemp(f->tmp))
        return -1;
    snprintf(f->a, sizeof f->a, "%s/a.gguf", f->tmp);
    snprintf(f->b, sizeof f->b, "%s/b.gguf", f->tmp);
    snprintf(f->disk, sizeof f->disk, "%s/disk", f->tmp);
    const char *gen = "%s/kvd-gguf-gen -o %s --arch llama --layers 2 --embd 128 --heads 4 "
                      "--kv-heads 2 --ff 256 --vocab 500 --ctx 512 --type f32 --seed %d >/dev/null";
    snprintf(cmd, sizeof cmd, gen, tools, f->a, 3);
    if (system(cmd) != 0)
        return -1;
    snprintf(cmd, sizeof cmd, gen, tools, f->b, 5);
    if (system(cmd) != 0)
        return -1;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < N_P; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        f->prompt[i] = 1 + (uint32_t)(x % 499);
    }
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->tmp);
    if (system(cmd) != 0)
        return -1;
    free(f);
    return 0;
}

static void start(struct kh_proc *d, const char *one, const char *two, const char *const *extra)
{
    char m1[160], m2[160];
    snprintf(m1, sizeof m1, "one=%s", one);
    snprintf(m2, sizeof m2, "two=%s", two);
    const char *args[24] = {"--backend", "cpu", "--model", m1, "--model", m2};
    int n = 6;
    for (int i = 0; extra && extra[i] && n < 23; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    struct kh_opts o = {.conf_text = conf, .args = args};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
}

/* Both models' prompts from disk after a restart; the files swapped between
 * the names (each directory now holds another model's blocks): no hit, and
 * each model gives its own file's tokens. */
static void t_disk_per_model(void **state)
{
    struct fixture *f = *state;
    const char *const disk[] = {"--disk-dir", f->disk, "--disk-max-bytes", "64M", NULL};
    struct kh_proc d;
    struct tm_gen a0, b0, a1, b1, x;
    assert_int_equal(mkdir(f->disk, 0700), 0);
    start(&d, f->a, f->b, disk);
    tm_generate(&d, "one", f->prompt, N_P, N_GEN, &a0);
    tm_generate(&d, "two", f->prompt, N_P, N_GEN, &b0);
    assert_int_equal(a0.cached, 0);
    assert_int_equal(b0.cached, 0);
    assert_int_equal(kh_stop(&d), 0); /* SIGTERM writes back both models' blocks */

    start(&d, f->a, f->b, disk);
    assert_int_equal(tm_model_stat(&d, "two", "disk", "cached") >= FULL_BLOCKS, true);
    tm_generate(&d, "two", f->prompt, N_P, N_GEN, &b1);
    tm_generate(&d, "one", f->prompt, N_P, N_GEN, &a1);
    assert_true(b1.cached >= FULL_BLOCKS * BT);
    assert_true(a1.cached >= FULL_BLOCKS * BT);
    tm_same_tokens(&a0, &a1);
    tm_same_tokens(&b0, &b1);
    /* the two models' tokens differ (else the swap below proves nothing) */
    assert_memory_not_equal(a0.toks, b0.toks, sizeof a0.toks);
    assert_int_equal(kh_stop(&d), 0);

    start(&d, f->b, f->a, disk); /* one=b in a's directory, two=a in b's */
    tm_generate(&d, "one", f->prompt, N_P, N_GEN, &x);
    assert_int_equal(x.cached, 0);
    tm_same_tokens(&x, &b0);
    tm_generate(&d, "two", f->prompt, N_P, N_GEN, &x);
    assert_int_equal(x.cached, 0);
    tm_same_tokens(&x, &a0);
    assert_int_equal(tm_model_stat(&d, "one", "disk", "restored"), 0);
    assert_int_equal(tm_model_stat(&d, "two", "disk", "restored"), 0);
    assert_int_equal(kh_stop(&d), 0);
}

static void wait_written(const struct kh_proc *d, const char *model)
{
    for (int i = 0; i < 3000; i++) {
        if (tm_model_stat(d, model, "remote", "writes") >= 1 &&
            tm_model_stat(d, model, "remote", "queued") == 0)
            return;
        usleep(10000);
    }
    fail_msg("model %s wrote nothing to Redis", model);
}

/* Daemon X computes the prompt on model two; daemon Y restores it for two
 * only: model one (same shapes, same prompt, same tenant) finds nothing. */
static void t_remote_per_model(void **state)
{
    struct fixture *f = *state;
    if (!redis_available())
        skip();
    assert_int_equal(redis_start(&f->redis, NULL), 0);
    const char *const remote[] = {"--remote",
                                  f->redis.url,
                                  "--remote-insecure",
                                  "--remote-min-hits",
                                  "0",
                                  "--remote-timeout-ms",
                                  "2000",
                                  NULL};
    struct kh_proc x, y, ref;
    struct tm_gen b0, a1, b1, a_ref;
    start(&x, f->a, f->b, remote);
    tm_generate(&x, "two", f->prompt, N_P, N_GEN, &b0);
    wait_written(&x, "two");
    assert_int_equal(tm_model_stat(&x, "one", "remote", "writes"), 0);
    assert_int_equal(kh_stop(&x), 0);

    start(&y, f->a, f->b, remote);
    tm_generate(&y, "one", f->prompt, N_P, N_GEN, &a1);
    assert_int_equal(a1.cached, 0);
    assert_int_equal(tm_model_stat(&y, "one", "remote", "hits"), 0);
    tm_generate(&y, "two", f->prompt, N_P, N_GEN, &b1);
    assert_true(b1.cached >= FULL_BLOCKS * BT);
    tm_same_tokens(&b0, &b1);
    assert_true(tm_model_stat(&y, "two", "remote", "hits") >= FULL_BLOCKS);
    assert_int_equal(kh_stop(&y), 0);

    start(&ref, f->a, f->b, NULL); /* model one's tokens without any tier */
    tm_generate(&ref, "one", f->prompt, N_P, N_GEN, &a_ref);
    tm_same_tokens(&a1, &a_ref);
    assert_int_equal(kh_stop(&ref), 0);
    redis_stop(&f->redis);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_disk_per_model),
        cmocka_unit_test(t_remote_per_model),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
