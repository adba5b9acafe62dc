/* The memory manager's lock rule, checked (KVD_LOCK_CHECKS builds: Debug and
 * sanitizer builds; other builds skip with 77): a kvmm_* call from a thread
 * that does not hold kvmm_lock aborts and names the call; so do unlocking a
 * lock this thread does not hold and freeing a locked kvmm. Each breach runs
 * in a forked child, whose death by SIGABRT and stderr the parent checks.
 * The same calls with the lock held pass. */
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mm_fixture.h"

/* Runs breach(f) in a child with its own fixture (unlocked) and stderr on a
 * pipe; returns what the child wrote, after checking it died of SIGABRT. */
static void expect_abort(void (*breach)(struct fx *f), const char *needle)
{
    int fds[2];
    char msg[512];
    size_t len = 0;
    int status;

    assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct fx f;
        close(fds[0]);
        dup2(fds[1], STDERR_FILENO);
        fx_open(&f, 8, 4);
        kvmm_unlock(f.mm); /* the fixture's lock, released: the breach is the child's */
        breach(&f);
        _exit(0); /* not reached when the rule is checked */
    }
    close(fds[1]);
    for (;;) {
        ssize_t n = read(fds[0], msg + len, sizeof(msg) - 1 - len);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    msg[len] = '\0';
    close(fds[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGABRT)
        fail_msg("the child was not aborted (status %#x); it wrote: %s", (unsigned)status, msg);
    if (!strstr(msg, needle))
        fail_msg("the abort message does not name '%s': %s", needle, msg);
}

static void call_stats_unlocked(struct fx *f)
{
    struct kvmm_stats st;
    kvmm_stats(f->mm, &st);
}

static void test_unlocked_call_aborts(void **state)
{
    expect_abort(call_stats_unlocked, "kvmm_stats called without holding kvmm_lock");
}

static void call_seq_open_unlocked(struct fx *f)
{
    struct kvmm_tenant_conf c = fx_tenant("t");
    uint32_t tenant, ns;
    kvmm_seq_t s;
    kvmm_lock(f->mm);
    if (kvmm_tenant_set(f->mm, &c, &tenant) || kvmm_tenant_namespace(f->mm, tenant, &ns))
        _exit(3);
    kvmm_unlock(f->mm);
    kvmm_seq_open(f->mm, 1, tenant, ns, &s);
}

static void test_seq_call_after_unlock_aborts(void **state)
{
    expect_abort(call_seq_open_unlocked, "kvmm_seq_open called without holding kvmm_lock");
}

static void *lock_and_keep(void *arg)
{
    kvmm_lock(arg); /* and never unlock: the lock stays with this (ended) thread */
    return NULL;
}

/* The lock is held, but by another thread. */
static void call_while_other_holds(struct fx *f)
{
    pthread_t t;
    if (pthread_create(&t, NULL, lock_and_keep, f->mm) || pthread_join(t, NULL))
        _exit(3);
    kvmm_check(f->mm);
}

static void test_other_thread_holding_aborts(void **state)
{
    expect_abort(call_while_other_holds, "kvmm_check called without holding kvmm_lock");
}

static void unlock_unheld(struct fx *f)
{
    kvmm_unlock(f->mm);
}

static void test_unlock_not_held_aborts(void **state)
{
    expect_abort(unlock_unheld, "kvmm_unlock called by a thread that does not hold kvmm_lock");
}

static void free_locked(struct fx *f)
{
    kvmm_lock(f->mm);
    kvmm_free(f->mm);
}

static void test_free_while_locked_aborts(void **state)
{
    expect_abort(free_locked, "kvmm_free called while kvmm_lock is held");
}

static void errmsg_unlocked(struct fx *f)
{
    fputs(kvmm_errmsg(f->mm), stdout);
}

static void test_errmsg_unlocked_aborts(void **state)
{
    expect_abort(errmsg_unlocked, "kvmm_errmsg called without holding kvmm_lock");
}

/* The same calls with the lock held pass, and the immutable accessors need
 * no lock. */
static void test_locked_calls_pass(void **state)
{
    struct fx *f = *state;
    struct kvmm_stats st;
    struct kvmm_tenant_conf c = fx_tenant("t");
    uint32_t tenant, ns;
    kvmm_seq_t s;

    fx_open(f, 8, 4); /* locked */
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.device_total, 8);
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &tenant), 0);
    assert_int_equal(kvmm_tenant_namespace(f->mm, tenant, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->mm, 1, tenant, ns, &s), 0);
    fx_check(f);
    f->locked = false;
    kvmm_unlock(f->mm);
    assert_int_equal(kvmm_geom(f->mm)->block_tokens, FX_BT);
    assert_true(kvmm_block_bytes(f->mm) > 0);
    assert_non_null(kvmm_device_arena(f->mm));
    kvmm_lock(f->mm);
    f->locked = true;
    assert_int_equal(kvmm_seq_close(f->mm, 1, s), 0);
}

int main(void)
{
    if (!kvmm_lock_checked()) {
        printf("this build does not check the lock rule (KVD_LOCK_CHECKS off); skipped\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unlocked_call_aborts),
        cmocka_unit_test(test_seq_call_after_unlock_aborts),
        cmocka_unit_test(test_other_thread_holding_aborts),
        cmocka_unit_test(test_unlock_not_held_aborts),
        cmocka_unit_test(test_free_while_locked_aborts),
        cmocka_unit_test(test_errmsg_unlocked_aborts),
        cmocka_unit_test_setup_teardown(test_locked_calls_pass, fx_setup, fx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
