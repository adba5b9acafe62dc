/* Fault injection at accept (built only with -DKVD_FAULT_INJECTION=ON,
 * label fault): an in-process server accepts one end of a socketpair while
 * every FAULT_ALLOC site fails. Registering the tenant in the memory manager
 * needs no FAULT_ALLOC allocation, noting it for stats does
 * (server_tenant_note), so the connection must be refused with one error
 * reply that carries a code and a message naming the tenant, and closed;
 * with the faults off the next connection is served. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>
#include <event2/event.h>

#include "backend.h"
#include "config.h"
#include "fault.h"
#include "kvd_harness.h"
#include "kvmm.h"
#include "options.h"
#include "server_impl.h"

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
        event_base_loop(srv->base, EVLOOP_NONBLOCK);
        if (poll(&p, 1, 10) > 0)
            return true;
    }
    return false;
}

/* A connection accepted in-process; returns the client's end. */
static int accept_pair(struct server *srv)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    assert_int_equal(conn_accept(srv, sv[0]), 0); /* takes sv[0] */
    return sv[1];
}

static void test_tenant_note_failure_is_reported(void **state)
{
    struct env *e = *state;
    struct kh_reply r;

    fault_set(FAULT_ALLOC, FAULT_AFTER, 0); /* every FAULT_ALLOC call fails */
    int fd = accept_pair(e->srv);
    uint64_t injected = fault_injected(FAULT_ALLOC);
    fault_reset();
    assert_true(injected >= 1);
    assert_true(loop_until_readable(e->srv, fd));
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
    event_base_loop(e->srv->base, EVLOOP_NONBLOCK);
    assert_int_equal(e->srv->n_conns, 0);
    assert_int_equal(e->srv->n_tenants, 0);

    /* Without faults the same tenant is served. */
    fd = accept_pair(e->srv);
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
    assert_int_equal(e->srv->n_tenants, 1);
    close(fd);
    for (int i = 0; i < 100 && e->srv->n_conns; i++)
        event_base_loop(e->srv->base, EVLOOP_ONCE);
    assert_int_equal(e->srv->n_conns, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test_setup_teardown(
        test_tenant_note_failure_is_reported, env_setup, env_teardown)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
