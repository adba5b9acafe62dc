/* Fault injection through the daemon (built only with
 * -DKVD_FAULT_INJECTION=ON, label fault): kvd runs with KVD_FAULTS making
 * allocations and copies fail at a steady rate while clients drive the
 * block API. Every request still gets exactly one reply with a protocol
 * code, the failures are those the faults can cause, invariants hold
 * (admin_check), closing the connections gives every block back, and
 * SIGTERM exits 0 (under ASan: without leaks). And at accept, in-process
 * (a server on the test's own loop, through server.h only): noting a new
 * tenant fails, and the connection is refused with a message
 * naming the tenant (it used to get an empty one). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cmocka.h>
#include <event2/event.h>

#include "backend.h"
#include "config.h"
#include "fault.h"
#include "kvd_harness.h"
#include "kvmm.h"
#include "options.h"
#include "server.h"
#include "tenancy.h"

#define TB (2 * 2 * 1 * 8 * 2)

static const char *const kvd_args[] = {
    "--backend",       "cpu", "--block-tokens", "4",  "--kv-layers", "2",
    "--kv-heads",      "1",   "--head-dim",     "8",  "--kv-dtype",  "f16",
    "--device-blocks", "24",  "--host-blocks",  "12", NULL};

static int call(int fd, uint64_t id, struct kh_req *q, struct kh_reply *r)
{
    (void)id;
    if (kh_req_send(fd, q) || kh_recv(fd, r))
        return -1;
    return r->code;
}

/* One round of block-API ops on fd; counts replies by code. */
static void round_ops(int fd, uint64_t *id, unsigned salt, unsigned *codes)
{
    struct kh_req q;
    struct kh_reply r;
    uint32_t toks[16];
    uint8_t data[16 * TB];
    for (int i = 0; i < 16; i++)
        toks[i] = (uint32_t)((salt % 3) * 100 + (unsigned)i);
    memset(data, (int)salt, sizeof(data));
    uint64_t s = 0;
    kh_req_begin(&q, "seq_open", ++*id, 0);
    int rc = call(fd, *id, &q, &r);
    assert_true(rc >= 0);
    codes[rc]++;
    if (rc == 0)
        s = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    if (!s)
        return;
    const char *ops[] = {"seq_match",   "seq_extend",  "kv_write", "seq_commit", "seq_fork",
                         "seq_offload", "seq_restore", "kv_read",  "seq_info",   "seq_close"};
    for (size_t k = 0; k < sizeof(ops) / sizeof(ops[0]); k++) {
        kh_req_begin(&q, ops[k], ++*id,
                     !strcmp(ops[k], "kv_write")  ? 4
                     : !strcmp(ops[k], "kv_read") ? 3
                     : (!strcmp(ops[k], "seq_match") || !strcmp(ops[k], "seq_commit") ||
                        !strcmp(ops[k], "seq_extend"))
                         ? 2
                         : 1);
        proto_pack_kv_uint(&q.pk, "seq", s);
        if (!strcmp(ops[k], "seq_match") || !strcmp(ops[k], "seq_commit"))
            proto_pack_kv_u32_array(&q.pk, "tokens", toks, 16);
        if (!strcmp(ops[k], "seq_extend"))
            proto_pack_kv_uint(&q.pk, "n", 16);
        if (!strcmp(ops[k], "kv_write") || !strcmp(ops[k], "kv_read")) {
            proto_pack_kv_uint(&q.pk, "start", 0);
            proto_pack_kv_uint(&q.pk, "n", 16);
        }
        if (!strcmp(ops[k], "kv_write"))
            proto_pack_kv_bin(&q.pk, "data", data, sizeof(data));
        rc = call(fd, *id, &q, &r);
        assert_true(rc >= 0); /* a reply came */
        assert_int_equal(r.id, *id);
        codes[rc]++;
        if (rc == 0 && !strcmp(ops[k], "kv_read")) {
            /* what reads succeed is what was written, or zeros/matched
             * bytes when the write failed: never garbage of another seq */
            const msgpack_object *d = kh_obj(r.root, "data");
            assert_non_null(d);
            assert_int_equal(d->via.bin.size, sizeof(data));
        }
        kh_reply_free(&r);
    }
}

static void test_daemon_under_faults(void **state)
{
    struct kh_proc kvd;
    unsigned codes[KVD_ERR_COUNT] = {0};
    uint64_t id = 0;
    setenv("KVD_FAULTS", "alloc:every=9,copy:every=5", 1);
    assert_int_equal(kh_start(&kvd, NULL, kvd_args), 0);
    unsetenv("KVD_FAULTS");
    int fds[3];
    for (int c = 0; c < 3; c++) {
        fds[c] = kh_connect(kvd.sock);
        assert_true(fds[c] >= 0);
    }
    for (unsigned i = 0; i < 120; i++)
        round_ops(fds[i % 3], &id, i, codes);
    unsigned failed = 0;
    for (int c = 1; c < KVD_ERR_COUNT; c++) {
        if (codes[c])
            printf("  %-18s %u\n", kvd_err_code(c), codes[c]);
        failed += codes[c];
        /* what injected faults may cause, and ordinary outcomes */
        if (c != KVD_ENOMEM && c != KVD_EINTERNAL && c != KVD_EBADREQ && c != KVD_ENOTFOUND &&
            c != KVD_ETOOLARGE)
            assert_int_equal(codes[c], 0);
    }
    printf("%u replies, %u ok, %u errors\n", codes[0] + failed, codes[0], failed);
    assert_true(codes[0] > 0);
    assert_true(codes[KVD_ENOMEM] + codes[KVD_EINTERNAL] > 0); /* faults were injected */
    struct kh_reply r;
    assert_int_equal(kh_call0(fds[0], "admin_check", ++id, &r), 0);
    kh_reply_free(&r);
    for (int c = 0; c < 3; c++)
        close(fds[c]);
    int fd = kh_connect(kvd.sock);
    for (int tries = 0; tries < 100 && kh_stat(fd, "device", "used") != 0; tries++)
        usleep(20000);
    assert_int_equal(kh_stat(fd, "device", "used"), 0);
    assert_int_equal(kh_stat(fd, "host", "used"), 0);
    assert_int_equal(kh_call0(fd, "admin_check", ++id, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&kvd), 0);
}

/* ---- at accept, in-process ---------------------------------------------- */

struct env {
    char dir[64];
    struct backend *be;
    struct kvmm *mm;
    struct server *srv;
};

static int env_setup(void **state)
{
    struct env *e = calloc(1, sizeof(*e));
    struct options o;
    struct config cfg;
    struct kvmm_config mc = {
        .geom = {.layers = 1, .kv_heads = 1, .head_dim = 4, .dtype = KV_F16, .block_tokens = 4},
        .n_device_blocks = 8,
        .n_host_blocks = 4,
    };
    assert_non_null(e);
    snprintf(e->dir, sizeof(e->dir), "/tmp/kvd-fault-conn-XXXXXX");
    assert_non_null(mkdtemp(e->dir));
    options_defaults(&o);
    snprintf(o.socket_path, sizeof(o.socket_path), "%s/kvd.sock", e->dir);
    o.roofline_probe = false;
    assert_int_equal(config_defaults(&cfg), 0);
    assert_int_equal(backend_cpu_new(&e->be), 0);
    mc.be = e->be;
    assert_int_equal(kvmm_new(&mc, &e->mm), 0);
    assert_int_equal(server_new(&o, &cfg, NULL, e->mm, e->be, &e->srv), 0);
    *state = e;
    return 0;
}

static int env_teardown(void **state)
{
    struct env *e = *state;
    char path[128];
    fault_reset();
    if (e->srv)
        server_free(e->srv);
    if (e->mm)
        kvmm_free(e->mm);
    if (e->be)
        backend_free(e->be);
    snprintf(path, sizeof(path), "%s/kvd.sock", e->dir);
    unlink(path);
    rmdir(e->dir);
    free(e);
    return 0;
}

/* Runs the loop until fd has something to read (or EOF); false after 10 s. */
static bool loop_until_readable(struct server *srv, int fd)
{
    for (int i = 0; i < 1000; i++) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        event_base_loop(server_event_base(srv), EVLOOP_NONBLOCK);
        if (poll(&p, 1, 10) > 0)
            return true;
    }
    return false;
}

/* A client connected to the server's socket (accepted when the loop runs). */
static int connect_client(struct server *srv)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", server_socket_path(srv));
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

static size_t n_conns(struct server *srv)
{
    struct server_obs o;
    server_get_obs(srv, &o);
    return *o.n_conns;
}

static size_t n_tenants(struct server *srv)
{
    struct tenancy_counts tc;
    tenancy_counts(server_tenancy(srv), &tc);
    return tc.tenants;
}

static void test_tenant_note_failure_is_reported(void **state)
{
    struct env *e = *state;
    struct kh_reply r;

    fault_set(FAULT_ALLOC, FAULT_AFTER, 0); /* every FAULT_ALLOC call fails */
    int fd = connect_client(e->srv);
    assert_true(loop_until_readable(e->srv, fd)); /* accepted, refused, answered */
    uint64_t injected = fault_injected(FAULT_ALLOC);
    fault_reset();
    assert_true(injected >= 1);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.id, 0);
    kh_expect(&r, KVD_ENOMEM);
    char want[96];
    snprintf(want, sizeof(want), "tenant 'uid:%u'", (unsigned)getuid());
    if (!strstr(r.message, want) || !strstr(r.message, "out of memory"))
        fail_msg("message \"%s\" does not name the tenant and the cause", r.message);
    kh_reply_free(&r);
    assert_true(loop_until_readable(e->srv, fd));
    char b;
    assert_int_equal(read(fd, &b, 1), 0); /* closed after the reply */
    close(fd);
    event_base_loop(server_event_base(e->srv), EVLOOP_NONBLOCK);
    assert_int_equal(n_conns(e->srv), 0);
    assert_int_equal(n_tenants(e->srv), 0);

    /* Without faults the same tenant is served. */
    fd = connect_client(e->srv);
    struct kh_req q;
    kh_req_begin(&q, "hello", 1, 1);
    proto_pack_kv_uint(&q.pk, "version", 1);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_true(loop_until_readable(e->srv, fd));
    assert_int_equal(kh_recv(fd, &r), 0);
    if (r.code != 0)
        fail_msg("hello after the fault: code %d: %s", r.code, r.message);
    assert_int_equal(r.id, 1);
    kh_reply_free(&r);
    assert_int_equal(n_tenants(e->srv), 1);
    close(fd);
    for (int i = 0; i < 100 && n_conns(e->srv); i++)
        event_base_loop(server_event_base(e->srv), EVLOOP_ONCE);
    assert_int_equal(n_conns(e->srv), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_daemon_under_faults),
        cmocka_unit_test_setup_teardown(test_tenant_note_failure_is_reported, env_setup,
                                        env_teardown),
    };
    return cmocka_run_group_tests_name("fault_daemon", tests, NULL, NULL);
}
