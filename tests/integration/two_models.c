/* two_models: the two small models of the several-models tests and the
 * calls they make on a model (see two_models.h). */
#include "two_models.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

int two_models_make(const char *tmpl, char *dir, char *a, char *b)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    snprintf(dir, 64, "%s", tmpl);
    if (!tools || !mkdtemp(dir))
        return -1;
    snprintf(a, 128, "%s/a.gguf", dir);
    snprintf(b, 128, "%s/b.gguf", dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --arch llama --layers 2 --embd 128 --heads 4 --kv-heads 2 "
             "--ff 256 --vocab 500 --ctx 256 --type f32 --seed 3 >/dev/null && "
             "%s/kvd-gguf-gen -o %s --arch qwen2 --layers 3 --embd 192 --heads 6 --kv-heads 3 "
             "--ff 384 --vocab 700 --ctx 256 --type f16 --seed 4 >/dev/null",
             tools, a, tools, b);
    return system(cmd) == 0 ? 0 : -1;
}

void two_models_remove(const char *dir, const char *a, const char *b)
{
    unlink(a);
    unlink(b);
    rmdir(dir);
}

void tm_generate(const struct kh_proc *d, const char *model, const uint32_t *p, size_t n_p,
                 uint32_t n_gen, struct tm_gen *g)
{
    assert_true(n_gen <= TM_GEN_MAX);
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "generate", 1, 4);
    proto_pack_kv_str(&q.pk, "model", model);
    proto_pack_kv_u32_array(&q.pk, "tokens", p, (uint32_t)n_p);
    proto_pack_kv_uint(&q.pk, "max_tokens", n_gen);
    proto_pack_kv_double(&q.pk, "temperature", 0.0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    if (r.code != 0)
        fail_msg("generate on %s: %d %s", model, r.code, r.message);
    const msgpack_object *t = kh_obj(r.root, "tokens");
    memset(g, 0, sizeof *g);
    for (uint32_t i = 0; i < t->via.array.size && i < n_gen; i++)
        g->toks[g->n++] = (uint32_t)t->via.array.ptr[i].via.u64;
    g->cached = kh_u64(kh_obj(r.root, "usage"), "cached");
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(g->n, n_gen);
}

void tm_same_tokens(const struct tm_gen *x, const struct tm_gen *y)
{
    assert_int_equal(x->n, y->n);
    assert_memory_equal(x->toks, y->toks, x->n * sizeof *x->toks);
}

uint64_t tm_model_stat(const struct kh_proc *d, const char *name, const char *tier, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    uint64_t v = UINT64_MAX;
    assert_int_equal(kh_call0(fd, "stats", 2, &r), 0);
    const msgpack_object *ms = kh_obj(r.root, "models");
    assert_non_null(ms);
    for (uint32_t i = 0; i < ms->via.array.size; i++) {
        const msgpack_object *m = &ms->via.array.ptr[i], *n = kh_obj(m, "name");
        if (n && n->via.str.size == strlen(name) && !memcmp(n->via.str.ptr, name, strlen(name))) {
            const msgpack_object *t = kh_obj(m, tier);
            if (t)
                v = kh_u64(t, key);
        }
    }
    kh_reply_free(&r);
    close(fd);
    if (v == UINT64_MAX)
        fail_msg("stats: no models[%s].%s.%s", name, tier, key);
    return v;
}
