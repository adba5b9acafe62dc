/* kv_events_fixture: the KV events tests' shared fixture and daemon calls
 * (kv_events_fixture.h). */
#include "kv_events_fixture.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <msgpack.h>

int kvf_dir(char *dir, size_t cap, const char *name)
{
    if (snprintf(dir, cap, "/tmp/%s.XXXXXX", name) >= (int)cap)
        return -1;
    return mkdtemp(dir) ? 0 : -1;
}

void kvf_rmdir(const char *dir)
{
    char cmd[192];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "teardown: %s failed\n", cmd);
}

int kvf_model(const char *path, int seed)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 4096 --seed %d >/dev/null",
             tools ? tools : ".", path, seed);
    return system(cmd) == 0 ? 0 : -1;
}

uint64_t kvf_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void kvf_make_prompt(uint32_t *p, size_t n, uint32_t salt)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint32_t)((i * 37 + salt * 101 + (i / 7) * salt) % 256);
}

uint64_t kvf_tenant_stat(const struct kh_proc *d, const char *model, const char *name,
                         const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    uint64_t v = UINT64_MAX;
    kh_req_begin(&q, "stats", 2, model ? 1 : 0);
    if (model)
        proto_pack_kv_str(&q.pk, "model", model);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *ts = kh_obj(r.root, "tenants");
    assert_non_null(ts);
    for (uint32_t i = 0; i < ts->via.array.size; i++) {
        const msgpack_object *n = kh_obj(&ts->via.array.ptr[i], "name");
        if (n && n->type == MSGPACK_OBJECT_STR && n->via.str.size == strlen(name) &&
            !memcmp(n->via.str.ptr, name, n->via.str.size))
            v = kh_u64(&ts->via.array.ptr[i], key);
    }
    kh_reply_free(&r);
    close(fd);
    if (v == UINT64_MAX)
        fail_msg("no tenant %s with %s in the stats of model %s", name, key,
                 model ? model : "(the one)");
    return v;
}

void kvf_admin_evict_all(const struct kh_proc *d, const char *model)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "admin_evict", 5, model ? 2 : 1);
    assert_int_equal(proto_pack_kv_str(&q.pk, "tier", "all"), 0);
    if (model)
        assert_int_equal(proto_pack_kv_str(&q.pk, "model", model), 0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    close(fd);
}
