/* A trusted front end naming 100,000 distinct sub-tenants over msgpack
 * (the `tenant` argument of hello): the daemon's memory stays bounded (idle
 * sub-tenants are freed at max-sub-tenants), a new name costs no more at
 * the end than at the start, and an admin's `stats` still answers and pages
 * through every tenant. Runs as root (the front end is uid 0). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

#define N_NAMES 100000u
#define BATCH 1000u
#define CAP 1024u

static const char conf[] = "[front-end]\n"
                           "uids = 0\n";

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The daemon's resident set (kB), from /proc. */
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

/* Names "n<from>" .. "n<from + BATCH - 1>" as sub-tenants, pipelined; each
 * reply's tenant must be "<front end>/n<i>". */
static void batch(int fd, unsigned from, uint64_t *id)
{
    for (unsigned i = 0; i < BATCH; i++) {
        struct kh_req q;
        char name[32];
        snprintf(name, sizeof(name), "n%u", from + i);
        kh_req_begin(&q, "hello", ++*id, 1);
        proto_pack_kv_str(&q.pk, "tenant", name);
        assert_int_equal(kh_req_send(fd, &q), 0);
    }
    for (unsigned i = 0; i < BATCH; i++) {
        struct kh_reply r;
        char want[32];
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.code != 0)
            fail_msg("sub-tenant n%u: %d %s", from + i, r.code, r.message);
        const msgpack_object *t = kh_obj(r.root, "tenant");
        snprintf(want, sizeof(want), "/n%u", from + i);
        assert_non_null(t);
        assert_true(t->type == MSGPACK_OBJECT_STR && t->via.str.size > strlen(want) &&
                    !memcmp(t->via.str.ptr + t->via.str.size - strlen(want), want, strlen(want)));
        kh_reply_free(&r);
    }
}

static void test_many_sub_tenants(void **state)
{
    struct kh_proc p;
    assert_int_equal(kh_start(&p, conf, NULL), 0);
    int fd = kh_connect(p.sock);
    assert_true(fd >= 0);
    uint64_t id = 0;
    double first = 0, last = 0;
    long rss_10k = 0;
    for (unsigned b = 0; b < N_NAMES / BATCH; b++) {
        double t0 = now_s();
        batch(fd, b * BATCH, &id);
        double dt = now_s() - t0;
        if (b < 10)
            first += dt;
        if (b >= N_NAMES / BATCH - 10)
            last += dt;
        if (b == 9)
            rss_10k = rss_kb(p.pid);
    }
    long rss_end = rss_kb(p.pid);
    fprintf(stderr,
            "test_sub_tenants: first 10k names %.3f s, last 10k %.3f s; RSS %ld kB at 10k, "
            "%ld kB at 100k\n",
            first, last, rss_10k, rss_end);
    /* Loose: the finding was ~2 ms per name at 100k (200 s per 10k). */
    assert_true(last < 4 * first + 2.0);
    assert_true(rss_10k > 0 && rss_end > 0);
    assert_true(rss_end - rss_10k < 32 * 1024);

    /* The admin (root) pages through every tenant. */
    struct kh_reply r;
    uint64_t from = 0, seen = 0, total = 0, pages = 0;
    for (;;) {
        struct kh_req q;
        kh_req_begin(&q, "stats", ++id, 2);
        proto_pack_kv_uint(&q.pk, "tenants_from", from);
        proto_pack_kv_uint(&q.pk, "tenants_max", 100);
        assert_int_equal(kh_req_send(fd, &q), 0);
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.code != 0)
            fail_msg("stats: %d %s", r.code, r.message);
        const msgpack_object *tn = kh_obj(r.root, "tenants");
        assert_non_null(tn);
        assert_int_equal(tn->type, MSGPACK_OBJECT_ARRAY);
        assert_true(tn->via.array.size <= 100);
        seen += tn->via.array.size;
        total = kh_u64(r.root, "tenants_total");
        const msgpack_object *ty = kh_obj(r.root, "tenancy");
        assert_non_null(ty);
        assert_true(kh_u64(ty, "sub_tenants") <= CAP);
        assert_true(kh_u64(ty, "sub_tenants_freed") >= N_NAMES - CAP);
        assert_int_equal(kh_u64(ty, "sub_tenants_refused"), 0);
        const msgpack_object *nx = kh_obj(r.root, "tenants_next");
        pages++;
        if (!nx || nx->type == MSGPACK_OBJECT_NIL) {
            kh_reply_free(&r);
            break;
        }
        assert_true(nx->via.u64 > from);
        from = nx->via.u64;
        kh_reply_free(&r);
    }
    assert_int_equal(seen, total);
    assert_true(total >= CAP && total <= CAP + 4);
    assert_true(pages >= 10);
    /* A page past the cap is refused with a clear error. */
    struct kh_req q;
    kh_req_begin(&q, "stats", ++id, 1);
    proto_pack_kv_uint(&q.pk, "tenants_max", 5000);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "tenants_max"));
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

int main(void)
{
    if (geteuid() != 0) {
        fprintf(stderr, "test_sub_tenants: needs root (the front end is uid 0); skipped\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_many_sub_tenants)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
