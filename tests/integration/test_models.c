/* One daemon serving several models by name, against a real kvd: two
 * models of different shapes, vocabularies and KV dtypes at once, each
 * giving llama.cpp's greedy tokens for its own file (node-llama-cpp, as
 * test_llamacpp; that case skips without it), interleaved, streamed, over
 * msgpack and HTTP; a device budget that holds one model at a time, where
 * alternating requests unload and reload the models, none fails or is cut,
 * and a reloaded model's prefix is still cached (moved to the host tier);
 * a sequence keeping its model loaded; keep-alive; tenants across models
 * (one in-flight count, per-model pools, the models a tenant may use);
 * unknown and forbidden models over both wires; hello and /v1/models. */
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
#include <jansson.h>

#include "kvd_harness.h"
#include "two_models.h"
#include "model.h"
#include "model/model_ref.h"

#define N_GEN 16
#define NEAR_TIE 0.01f

static char g_dir[64], g_a[128], g_b[128];
static uint64_t g_id;
static const uint32_t prompt8[] = {5, 77, 123, 9, 300, 41, 7, 260};

/* Two models unlike each other: llama f32 weights, 2 layers, vocabulary
 * 500; qwen2 f16 weights, 3 layers, vocabulary 700, other head counts. */
static int setup(void **state)
{
    (void)state;
    return two_models_make("/tmp/kvd-models.XXXXXX", g_dir, g_a, g_b);
}

static int teardown(void **state)
{
    (void)state;
    two_models_remove(g_dir, g_a, g_b);
    return 0;
}

/* ---- requests ------------------------------------------------------------ */

struct gen {
    uint32_t toks[256];
    size_t n;
    uint64_t cached;
    char finish[32];
    char text[4096];
    unsigned events;
    uint32_t streamed[256]; /* the events' tokens */
    size_t ns;
    int code;
    char message[256];
};

/* Sends a generate for `model` (NULL: none named) of prompt, max tokens. */
static uint64_t gen_send(int fd, const char *model, const uint32_t *prompt, size_t n, uint32_t max,
                         bool stream)
{
    struct kh_req q;
    kh_req_begin(&q, "generate", ++g_id, 3 + (model != NULL) + stream);
    if (model)
        proto_pack_kv_str(&q.pk, "model", model);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, n);
    proto_pack_kv_uint(&q.pk, "max_tokens", max);
    proto_pack_kv_double(&q.pk, "temperature", 0.0);
    if (stream)
        proto_pack_kv_bool(&q.pk, "stream", true);
    assert_int_equal(kh_req_send(fd, &q), 0);
    return g_id;
}

/* Reads the events and reply of request id: streamed tokens must add up to
 * the reply's. Stops after the first event when first_only. */
static void gen_recv(int fd, uint64_t id, struct gen *g, bool first_only)
{
    if (!first_only && !g->events) /* (a call after first_only keeps its events) */
        memset(g, 0, sizeof *g);
    for (;;) {
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.id != id)
            fail_msg("reply to %llu (code %d: %s) while waiting for %llu", (unsigned long long)r.id,
                     r.code, r.message, (unsigned long long)id);
        if (proto_map_find(r.root, "event")) {
            const msgpack_object *t = kh_obj(r.root, "tokens");
            for (uint32_t i = 0; i < t->via.array.size && g->ns < 256; i++)
                g->streamed[g->ns++] = (uint32_t)t->via.array.ptr[i].via.u64;
            g->events++;
            kh_reply_free(&r);
            if (first_only)
                return;
            continue;
        }
        g->code = r.code;
        snprintf(g->message, sizeof g->message, "%s", r.message);
        if (r.code == 0) {
            const msgpack_object *t = kh_obj(r.root, "tokens");
            for (uint32_t i = 0; i < t->via.array.size && i < 256; i++)
                g->toks[g->n++] = (uint32_t)t->via.array.ptr[i].via.u64;
            g->cached = kh_u64(kh_obj(r.root, "usage"), "cached");
            const msgpack_object *tx = proto_map_find(r.root, "text");
            if (tx && tx->type == MSGPACK_OBJECT_STR)
                snprintf(g->text, sizeof g->text, "%.*s", (int)tx->via.str.size, tx->via.str.ptr);
            const msgpack_object *f = kh_obj(r.root, "finish_reason");
            snprintf(g->finish, sizeof g->finish, "%.*s", (int)f->via.str.size, f->via.str.ptr);
            if (g->events) {
                assert_int_equal(g->ns, g->n);
                assert_memory_equal(g->streamed, g->toks, g->ns * sizeof *g->toks);
            }
        }
        kh_reply_free(&r);
        return;
    }
}

static void generate(int fd, const char *model, const uint32_t *prompt, size_t n, uint32_t max,
                     bool stream, struct gen *g)
{
    g->events = 0;
    gen_recv(fd, gen_send(fd, model, prompt, n, max, stream), g, false);
}

/* A reply's code for a one-string-arg op (model = name). */
static int call_model(int fd, const char *op, const char *model, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, op, ++g_id, 1);
    proto_pack_kv_str(&q.pk, "model", model);
    if (kh_req_send(fd, &q) != 0 || kh_recv(fd, r) != 0)
        return -1;
    return r->code;
}

/* The state of model `name` in hello's `models`. */
static void model_state(int fd, const char *name, char *out, size_t cap)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", ++g_id, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    out[0] = '\0';
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i];
        const msgpack_object *nm = kh_obj(e, "name");
        if (nm->via.str.size == strlen(name) && !memcmp(nm->via.str.ptr, name, nm->via.str.size)) {
            const msgpack_object *st = kh_obj(e, "state");
            snprintf(out, cap, "%.*s", (int)st->via.str.size, st->via.str.ptr);
        }
    }
    kh_reply_free(&r);
}

/* stats models[i][key] of model `name` (an admin's stats). */
static uint64_t model_stat(int fd, const char *name, const char *key)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i];
        const msgpack_object *nm = kh_obj(e, "name");
        if (nm->via.str.size == strlen(name) && !memcmp(nm->via.str.ptr, name, nm->via.str.size))
            v = kh_u64(e, key);
    }
    kh_reply_free(&r);
    return v;
}

/* Waits (polling hello, 20 s at most) for model `name` to reach `state`. */
static void wait_state(int fd, const char *name, const char *state)
{
    char st[32];
    for (int i = 0; i < 400; i++) {
        model_state(fd, name, st, sizeof st);
        if (!strcmp(st, state))
            return;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fail_msg("model %s is %s, not %s, after 20 s", name, st, state);
}

/* ---- llama.cpp ----------------------------------------------------------- */

static const char *llcpp_dir(void)
{
    static char dir[1024];
    const char *home = getenv("HOME");
    const char *cands[2] = {getenv("KVD_NODE_LLAMA_CPP_DIR"), NULL};
    char def[512];
    snprintf(def, sizeof def, "%s/.cache/kvd/node-llama-cpp", home ? home : "/nonexistent");
    cands[1] = def;
    for (int i = 0; i < 2; i++) {
        if (!cands[i])
            continue;
        char pj[1100];
        snprintf(pj, sizeof pj, "%s/node_modules/node-llama-cpp/package.json", cands[i]);
        if (access(pj, R_OK) == 0) {
            snprintf(dir, sizeof dir, "%s", cands[i]);
            return dir;
        }
    }
    return NULL;
}

/* llama.cpp's greedy tokens for path. */
static void llcpp_greedy(const char *dir, const char *path, uint32_t *out)
{
    char cmd[2048], line[4096];
    int n = snprintf(cmd, sizeof cmd, "timeout 300 node %s/model/llamacpp_greedy.mjs %s %s %d",
                     KVD_TESTS_SRC, dir, path, N_GEN);
    for (size_t i = 0; i < 8; i++)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " %u", prompt8[i]);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    if (!fgets(line, sizeof line, p))
        line[0] = '\0';
    assert_int_equal(pclose(p), 0);
    char *s = line;
    for (int i = 0; i < N_GEN; i++) {
        char *end;
        out[i] = (uint32_t)strtoul(s, &end, 10);
        assert_true(end != s);
        s = end;
    }
}

/* kvd's own greedy run of path in one process (the prompt in one chunk,
 * then one token a step, as the daemon runs a lone request), for each
 * token's top-1 minus top-2 margin: where llama.cpp may round the other way. */
static void ref_margins(const char *path, enum kv_dtype dt, uint32_t *toks, float *margin)
{
    struct kvd_error err = {0};
    struct model *m;
    if (model_load(path, ref_cpu_backend(), &m, &err))
        fail_msg("%s", err.message);
    const struct model_hparams *hp = model_hparams(m);
    struct kv_geom g;
    model_kv_geom(m, 16, dt, &g);
    void *arena = calloc(4, kv_block_bytes(&g));
    float *lg = malloc(hp->n_vocab * sizeof *lg);
    struct fwd_ctx *fc;
    assert_non_null(arena);
    assert_non_null(lg);
    assert_int_equal(fwd_ctx_new(m, 64, 1, &fc), 0);
    uint32_t slots[4] = {0, 1, 2, 3}, tok;
    struct fwd_seq s = {.tokens = prompt8, .n_tokens = 8, .pos0 = 0, .slots = slots, .n_slots = 4};
    struct fwd_batch b = {
        .seqs = &s, .n_seqs = 1, .kv_arena = arena, .geom = &g, .n_arena_slots = 4, .logits = lg};
    for (int i = 0; i < N_GEN; i++) {
        assert_int_equal(model_forward(m, fc, &b), 0);
        tok = 0;
        for (uint32_t j = 1; j < hp->n_vocab; j++)
            tok = lg[j] > lg[tok] ? j : tok;
        float second = -1e30f;
        for (uint32_t j = 0; j < hp->n_vocab; j++)
            if (j != tok && lg[j] > second)
                second = lg[j];
        toks[i] = tok;
        margin[i] = lg[tok] - second;
        s.pos0 += s.n_tokens, s.tokens = &tok, s.n_tokens = 1;
    }
    fwd_ctx_free(fc);
    free(lg);
    free(arena);
    model_free(m);
}

/* ours == llama.cpp's token for token until a near-tie kvd's reference
 * could round either way; at least 5 tokens. */
static void same_as_llamacpp(const char *what, const uint32_t *ours, const uint32_t *ref,
                             const float *margin)
{
    int checked = 0;
    for (int i = 0; i < N_GEN; i++) {
        if (ours[i] != ref[i] && margin[i] >= NEAR_TIE)
            fail_msg("%s: token %d is %u, llama.cpp's %u (margin %.4f)", what, i, ours[i], ref[i],
                     (double)margin[i]);
        if (ours[i] != ref[i])
            break;
        checked++;
    }
    print_message("  %s: %d tokens as llama.cpp's\n", what, checked);
    assert_true(checked >= 5);
}

/* HTTP completions of the prompt by model `model` on the daemon's Unix
 * socket (curl), streamed or not: the completion's text (a stream's
 * pieces joined) into out. */
static void http_text(const char *sock, const char *model, bool stream, char *out, size_t cap,
                      int *status)
{
    char body[512], cmd[1024], path[160];
    snprintf(path, sizeof path, "%s/body.json", g_dir);
    snprintf(body, sizeof body,
             "{\"model\":\"%s\",\"prompt\":[5,77,123,9,300,41,7,260],\"max_tokens\":%d,"
             "\"temperature\":0,\"stream\":%s}",
             model, N_GEN, stream ? "true" : "false");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(body, f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "curl -sS -N -w '\\n%%{http_code}' -H 'Content-Type: application/json' "
             "--data-binary @%s --unix-socket %s http://localhost/v1/completions",
             path, sock);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    static char buf[1 << 18];
    size_t len = fread(buf, 1, sizeof buf - 1, p);
    pclose(p);
    buf[len] = '\0';
    char *nl = strrchr(buf, '\n');
    assert_non_null(nl);
    *status = atoi(nl + 1);
    *nl = '\0';
    out[0] = '\0';
    if (*status != 200)
        return;
    char *line = buf;
    while (line && *line) {
        char *next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        const char *js = !strncmp(line, "data: ", 6) ? line + 6 : line;
        json_error_t je;
        json_t *j = strncmp(js, "[DONE]", 6) && *js ? json_loads(js, 0, &je) : NULL;
        json_t *ch = j ? json_array_get(json_object_get(j, "choices"), 0) : NULL;
        const char *t = ch ? json_string_value(json_object_get(ch, "text")) : NULL;
        if (t)
            snprintf(out + strlen(out), cap - strlen(out), "%s", t);
        json_decref(j);
        line = next;
    }
}

static void t_two_models_llamacpp(void **state)
{
    (void)state;
    const char *dir = llcpp_dir();
    if (!dir || system("node --version >/dev/null 2>&1") != 0 ||
        system("curl --version >/dev/null 2>&1") != 0) {
        print_message("skipped: node-llama-cpp or curl not found (KVD_NODE_LLAMA_CPP_DIR)\n");
        skip();
    }
    uint32_t ref_a[N_GEN], ref_b[N_GEN], own_a[N_GEN], own_b[N_GEN];
    float mar_a[N_GEN], mar_b[N_GEN];
    llcpp_greedy(dir, g_a, ref_a);
    llcpp_greedy(dir, g_b, ref_b);
    ref_margins(g_a, KV_F16, own_a, mar_a);
    ref_margins(g_b, KV_F32, own_b, mar_b);
    char conf[1024], sock[160];
    snprintf(conf, sizeof conf,
             "[model:alpha]\npath = %s\nkv-dtype = f16\n[model:beta]\npath = %s\n"
             "kv-dtype = f32\n",
             g_a, g_b);
    snprintf(sock, sizeof sock, "%s/http.sock", g_dir);
    const char *args[] = {"--backend", "cpu", "--http-socket", sock, NULL};
    struct kh_proc *p = kh_new(conf, args);
    assert_non_null(p);
    int fa = kh_connect(p->sock), fb = kh_connect(p->sock);
    assert_true(fa >= 0 && fb >= 0);
    /* interleaved and streamed: both in flight at once, on two connections */
    for (int round = 0; round < 2; round++) {
        struct gen ga = {0}, gb = {0};
        uint64_t ia = gen_send(fa, "alpha", prompt8, 8, N_GEN, true);
        uint64_t ib = gen_send(fb, "beta", prompt8, 8, N_GEN, true);
        gen_recv(fa, ia, &ga, false);
        gen_recv(fb, ib, &gb, false);
        assert_int_equal(ga.code, 0);
        assert_int_equal(gb.code, 0);
        assert_int_equal(ga.n, N_GEN);
        assert_int_equal(gb.n, N_GEN);
        assert_true(ga.events >= 1 && gb.events >= 1);
        same_as_llamacpp("alpha (msgpack, streamed)", ga.toks, ref_a, mar_a);
        same_as_llamacpp("beta (msgpack, streamed)", gb.toks, ref_b, mar_b);
        /* not streamed: the same tokens */
        struct gen na, nb;
        generate(fa, "alpha", prompt8, 8, N_GEN, false, &na);
        generate(fb, "beta", prompt8, 8, N_GEN, false, &nb);
        assert_memory_equal(na.toks, ga.toks, N_GEN * sizeof(uint32_t));
        assert_memory_equal(nb.toks, gb.toks, N_GEN * sizeof(uint32_t));
        /* over HTTP, streamed and not: the same completions */
        for (int st = 0; st < 2; st++) {
            static char ht[4096];
            int status;
            http_text(sock, "alpha", st, ht, sizeof ht, &status);
            assert_int_equal(status, 200);
            assert_string_equal(ht, ga.text);
            http_text(sock, "beta", st, ht, sizeof ht, &status);
            assert_int_equal(status, 200);
            assert_string_equal(ht, gb.text);
        }
    }
    close(fa);
    close(fb);
    assert_int_equal(kh_free(p), 0);
}

/* A per-model tier count of stats (admin): models[].<tier>.<key>. */
static uint64_t model_tier(int fd, const char *name, const char *tier, const char *key)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i];
        const msgpack_object *nm = kh_obj(e, "name");
        if (nm->via.str.size == strlen(name) && !memcmp(nm->via.str.ptr, name, nm->via.str.size))
            v = kh_u64(kh_obj(e, tier), key);
    }
    kh_reply_free(&r);
    assert_true(v != UINT64_MAX);
    return v;
}

/* stats model_memory: the page budget's bytes taken and its size. */
static void budget_use(int fd, uint64_t *used, uint64_t *budget)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    const msgpack_object *mm = kh_obj(r.root, "model_memory");
    *used = kh_u64(mm, "device_used");
    *budget = kh_u64(mm, "device_budget");
    kh_reply_free(&r);
}

/* The connection's tenant's device bytes across the budget (stats
 * tenants[], one tenant here). */
static uint64_t tenant_device_bytes(int fd)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    const msgpack_object *t = kh_obj(r.root, "tenants");
    assert_true(t->via.array.size >= 1);
    uint64_t v = 0;
    for (uint32_t i = 0; i < t->via.array.size; i++)
        v += kh_u64(&t->via.array.ptr[i], "device_bytes");
    kh_reply_free(&r);
    return v;
}

/* ---- memory: one budget shared ---------------------------------------------- */

/* A distinct prompt of n tokens (ctx 256, vocab 500 and 700). */
static void prompt_k(uint32_t *out, size_t n, unsigned k)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (uint32_t)(2 + (k * 131 + i * 7 + (i * i) % 13) % 480);
}

/* Both models' weights and scratch fit the budget with pages to spare,
 * which the two KV pools share: alpha's cache grows into most of them;
 * beta's load takes what it needs back from it (alpha's cached blocks go
 * to its host tier, alpha stays loaded), and beta's KV grows into more of
 * alpha's pages as beta's cache grows. */
static void t_shared_budget(void **state)
{
    (void)state;
    char conf[1024];
    snprintf(conf, sizeof conf,
             "[server]\ndevice-bytes = 12M\n"
             "[model:alpha]\npath = %s\n[model:beta]\npath = %s\nkv-dtype = q8_0\n",
             g_a, g_b);
    const char *args[] = {"--backend", "cpu", "--host-blocks", "1024", NULL};
    struct kh_proc *p = kh_new(conf, args);
    assert_non_null(p);
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    uint32_t pr[240];
    struct gen g, first;
    uint64_t used, budget;
    /* alpha alone: its cache takes most of the budget's KV pages */
    for (unsigned k = 0; k < 40; k++) {
        prompt_k(pr, 240, k);
        generate(fd, "alpha", pr, 240, 1, false, &g);
        if (g.code)
            fail_msg("alpha, prompt %u: %s", k, g.message);
        if (k == 0)
            first = g;
    }
    budget_use(fd, &used, &budget);
    uint64_t a_fixed = model_stat(fd, "alpha", "charged_device_bytes");
    uint64_t a_kv1 = model_stat(fd, "alpha", "kv_device_bytes");
    assert_int_equal(used, a_fixed + a_kv1);
    assert_true(budget - used < 6u << 20); /* beta's weights and scratch do not fit beside */
    /* beta loads: alpha gives back pages of cache, and stays loaded */
    prompt_k(pr, 240, 100);
    generate(fd, "beta", pr, 240, 1, false, &g);
    if (g.code)
        fail_msg("beta: %s", g.message);
    char st[32];
    model_state(fd, "alpha", st, sizeof st);
    assert_string_equal(st, "loaded");
    assert_int_equal(model_stat(fd, "alpha", "unloads"), 0);
    uint64_t a_kv2 = model_stat(fd, "alpha", "kv_device_bytes");
    uint64_t b_fixed = model_stat(fd, "beta", "charged_device_bytes");
    uint64_t b_kv2 = model_stat(fd, "beta", "kv_device_bytes");
    assert_true(a_kv2 < a_kv1);
    budget_use(fd, &used, &budget);
    assert_int_equal(used, a_fixed + a_kv2 + b_fixed + b_kv2);
    assert_true(used <= budget);
    assert_true(model_tier(fd, "alpha", "host", "cached") > 0); /* moved, not dropped */
    uint64_t free2 = budget - used;
    /* beta's cache grows past the pages that were free: alpha's give */
    for (unsigned k = 101; k < 125; k++) {
        prompt_k(pr, 240, k);
        generate(fd, "beta", pr, 240, 1, false, &g);
        if (g.code)
            fail_msg("beta, prompt %u: %s", k, g.message);
    }
    uint64_t a_kv3 = model_stat(fd, "alpha", "kv_device_bytes");
    uint64_t b_kv3 = model_stat(fd, "beta", "kv_device_bytes");
    assert_true(b_kv3 > b_kv2 + free2);
    assert_true(a_kv3 < a_kv2);
    budget_use(fd, &used, &budget);
    assert_true(used <= budget);
    assert_int_equal(model_stat(fd, "alpha", "unloads"), 0);
    /* alpha's first prompt still matches: its blocks came back from the host */
    prompt_k(pr, 240, 0);
    generate(fd, "alpha", pr, 240, 1, false, &g);
    assert_int_equal(g.code, 0);
    assert_true(g.cached >= 224);
    assert_int_equal(g.toks[0], first.toks[0]);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "admin_check", ++g_id, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* A tenant's max-device-bytes holds across both models' pools: its cache
 * on one model gives way to its requests on the other, and what it holds
 * in all never passes the quota. */
static void t_tenant_bytes_across_models(void **state)
{
    (void)state;
    char conf[1024];
    snprintf(conf, sizeof conf,
             "[server]\ndevice-bytes = 32M\n[limits]\nmax-device-bytes = 1M\n"
             "[model:alpha]\npath = %s\n[model:beta]\npath = %s\nkv-dtype = q8_0\n",
             g_a, g_b);
    const char *args[] = {"--backend", "cpu", "--host-blocks", "1024", NULL};
    struct kh_proc *p = kh_new(conf, args);
    assert_non_null(p);
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    uint32_t pr[240];
    struct gen g;
    uint64_t most = 0;
    for (unsigned k = 0; k < 16; k++) {
        prompt_k(pr, 240, k);
        generate(fd, k % 2 ? "beta" : "alpha", pr, 240, 1, false, &g);
        if (g.code)
            fail_msg("prompt %u: %s", k, g.message);
        uint64_t b = tenant_device_bytes(fd);
        assert_true(b <= 1u << 20);
        if (b > most)
            most = b;
    }
    /* both models hold some of it, and together up to the quota */
    assert_true(model_stat(fd, "alpha", "kv_device_bytes") > 0);
    assert_true(model_stat(fd, "beta", "kv_device_bytes") > 0);
    assert_true(most > 512u << 10);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "admin_check", ++g_id, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* ---- memory: one model at a time ------------------------------------------ */

/* A page budget that holds one model's weights and scratch and some KV
 * pages, not both models: every switch unloads the other model (its cached
 * blocks to the host tier: given back for the load, or moved at the
 * unload) and loads this one. */
static const char *budget_conf(char *buf, size_t cap, const char *extra)
{
    snprintf(buf, cap,
             "[server]\ndevice-bytes = 8M\nqueue-timeout = 20000\n%s"
             "[model:alpha]\npath = %s\nmax-device-bytes = 5M\n"
             "[model:beta]\npath = %s\nmax-device-bytes = 7500K\nkv-dtype = q8_0\n",
             extra, g_a, g_b);
    return buf;
}

static void t_unload_reload_warm(void **state)
{
    (void)state;
    char conf[1024];
    const char *args[] = {"--backend", "cpu", "--host-blocks", "64", NULL};
    struct kh_proc *p = kh_new(budget_conf(conf, sizeof conf, ""), args);
    assert_non_null(p);
    int fd = kh_connect(p->sock), f2 = kh_connect(p->sock);
    assert_true(fd >= 0 && f2 >= 0);
    uint32_t pa[40], pb[40];
    for (int i = 0; i < 40; i++) {
        pa[i] = (uint32_t)(3 + 7 * i) % 500;
        pb[i] = (uint32_t)(11 + 13 * i) % 700;
    }
    struct gen first_a, first_b, g;
    generate(fd, "alpha", pa, 40, 4, false, &first_a);
    assert_int_equal(first_a.code, 0);
    for (int round = 0; round < 3; round++) {
        generate(fd, "beta", pb, 40, 4, false, &g);
        if (g.code)
            fail_msg("beta, round %d: %s", round, g.message);
        if (round == 0)
            first_b = g;
        else /* reloaded: its prefix came back from the host tier */
            assert_true(g.cached >= 32);
        assert_memory_equal(g.toks, first_b.toks, 4 * sizeof(uint32_t));
        generate(fd, "alpha", pa, 40, 4, false, &g);
        assert_int_equal(g.code, 0);
        assert_true(g.cached >= 32);
        assert_memory_equal(g.toks, first_a.toks, 4 * sizeof(uint32_t));
    }
    assert_true(model_stat(fd, "alpha", "unloads") >= 3);
    assert_true(model_stat(fd, "beta", "unloads") >= 2);
    /* beta, unloaded: its prefix waits in the host tier, it holds no page */
    assert_true(model_tier(fd, "beta", "host", "cached") >= 2);
    assert_int_equal(model_tier(fd, "beta", "device", "used"), 0);
    assert_int_equal(model_stat(fd, "beta", "kv_device_bytes"), 0);
    assert_int_equal(model_stat(fd, "beta", "charged_device_bytes"), 0);
    assert_int_equal(model_stat(fd, "beta", "load_failures"), 0);

    /* A long streamed request on alpha; beta asked meanwhile waits until
     * alpha is idle (a model in use is never unloaded): alpha's request
     * runs to its end, then beta's. */
    struct gen ga = {0}, gb = {0};
    uint64_t ia = gen_send(fd, "alpha", pa, 8, 120, true);
    gen_recv(fd, ia, &ga, true); /* alpha is running */
    uint64_t ib = gen_send(f2, "beta", pb, 8, 4, false);
    gen_recv(fd, ia, &ga, false);
    assert_int_equal(ga.code, 0);
    assert_string_equal(ga.finish, "length");
    assert_int_equal(ga.n, 120);
    gen_recv(f2, ib, &gb, false);
    assert_int_equal(gb.code, 0);
    assert_int_equal(gb.n, 4);

    /* A block-API sequence keeps its model loaded: with one open on beta,
     * alpha cannot load and its request ends busy at the queue timeout
     * (set low for this daemon below); closed, alpha loads. */
    close(fd);
    close(f2);
    assert_int_equal(kh_free(p), 0);
    p = kh_new(budget_conf(conf, sizeof conf, "queue-timeout = 1500\n"), args);
    assert_non_null(p);
    fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(call_model(fd, "seq_open", "beta", &r), 0);
    uint64_t seq = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    assert_true(seq >> 56 == 1); /* the handle names beta's pool */
    struct kh_req q;
    kh_req_begin(&q, "seq_extend", ++g_id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "n", 20);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    generate(fd, "alpha", pa, 8, 2, false, &g);
    assert_int_equal(g.code, KVD_EBUSY);
    assert_non_null(strstr(g.message, "queue timeout"));
    char st[32];
    model_state(fd, "beta", st, sizeof st);
    assert_string_equal(st, "loaded");
    /* a cancel finds a request waiting for its model: answered cancelled */
    uint64_t iw = gen_send(fd, "alpha", pa, 8, 2, false);
    kh_req_begin(&q, "cancel", ++g_id, 1);
    proto_pack_kv_uint(&q.pk, "target", iw);
    assert_int_equal(kh_req_send(fd, &q), 0);
    for (int k = 0; k < 2; k++) { /* the cancel's reply and the request's, in either order */
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.id == iw) {
            kh_expect(&r, KVD_ECANCELLED);
        } else {
            assert_int_equal(r.id, g_id);
            kh_expect(&r, 0);
            assert_true(kh_obj(r.root, "cancelled")->via.boolean);
        }
        kh_reply_free(&r);
    }
    assert_int_equal(model_stat(fd, "alpha", "waiting"), 0);
    assert_int_equal(kh_call1(fd, "seq_close", ++g_id, "seq", seq, &r), 0);
    kh_reply_free(&r);
    generate(fd, "alpha", pa, 8, 2, false, &g);
    assert_int_equal(g.code, 0);
    model_state(fd, "beta", st, sizeof st);
    assert_string_equal(st, "unloaded");
    assert_int_equal(kh_call0(fd, "admin_check", ++g_id, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* keep-alive-s: an idle model unloads by itself, and reloads warm. */
static void t_keep_alive(void **state)
{
    (void)state;
    char conf[1024];
    snprintf(conf, sizeof conf,
             "[model:alpha]\npath = %s\nkeep-alive-s = forever\n"
             "[model:beta]\npath = %s\nkeep-alive-s = 1\n",
             g_a, g_b);
    char msock[160], metrics_arg[200];
    snprintf(msock, sizeof msock, "%s/metrics.sock", g_dir);
    snprintf(metrics_arg, sizeof metrics_arg, "unix:%s", msock);
    const char *args[] = {"--backend", "cpu", "--metrics", metrics_arg, NULL};
    struct kh_proc *p = kh_new(conf, args);
    assert_non_null(p);
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    char st[32];
    model_state(fd, "beta", st, sizeof st);
    assert_string_equal(st, "unloaded"); /* not preloaded */
    uint32_t pb[40];
    for (int i = 0; i < 40; i++)
        pb[i] = (uint32_t)(11 + 13 * i) % 700;
    struct gen g1, g2, ga;
    generate(fd, "beta", pb, 40, 3, false, &g1);
    assert_int_equal(g1.code, 0);
    generate(fd, "alpha", prompt8, 8, 3, false, &ga);
    assert_int_equal(ga.code, 0);
    wait_state(fd, "beta", "unloaded");
    generate(fd, "beta", pb, 40, 3, false, &g2);
    assert_int_equal(g2.code, 0);
    assert_true(g2.cached >= 32);
    assert_memory_equal(g1.toks, g2.toks, 3 * sizeof(uint32_t));
    model_state(fd, "alpha", st, sizeof st);
    assert_string_equal(st, "loaded"); /* forever */
    /* the metrics show each model */
    if (system("curl --version >/dev/null 2>&1") == 0) {
        char cmd[512];
        static char out[1 << 17];
        snprintf(cmd, sizeof cmd, "curl -sS --unix-socket %s http://localhost/metrics", msock);
        FILE *pp = popen(cmd, "r");
        assert_non_null(pp);
        size_t n = fread(out, 1, sizeof out - 1, pp);
        pclose(pp);
        out[n] = '\0';
        /* beta may have idled past its 1 s keep-alive again since g2 on a
         * loaded machine: then it is unloading or has unloaded a second
         * time (the count rises when the unload ends), and says so */
        const char *u = strstr(out, "kvd_model_unloads_total{model=\"beta\"} ");
        assert_non_null(u);
        int unloads = atoi(u + strlen("kvd_model_unloads_total{model=\"beta\"} "));
        assert_true(unloads == 1 || unloads == 2);
        if (unloads == 2)
            assert_non_null(strstr(out, "kvd_model_state{state=\"unloaded\",model=\"beta\"} 1"));
        else
            assert_true(strstr(out, "kvd_model_state{state=\"loaded\",model=\"beta\"} 1") ||
                        strstr(out, "kvd_model_state{state=\"unloading\",model=\"beta\"} 1"));
        assert_non_null(strstr(out, "kvd_model_loads_total{outcome=\"ok\",model=\"beta\"} 2"));
        assert_non_null(strstr(out, "kvd_model_unloads_total{model=\"alpha\"} 0"));
        assert_non_null(strstr(out, "kvd_model_tokens_total{kind=\"generated\",model=\"beta\"} 6"));
    }
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* A load that fails answers its waiting requests with the reason, counts
 * in stats, and leaves the other models serving; the next request tries
 * again. */
static void t_load_failure(void **state)
{
    (void)state;
    char c[160], conf[1024], cmd[512];
    snprintf(c, sizeof c, "%s/c.gguf", g_dir);
    snprintf(cmd, sizeof cmd, "cp %s %s", g_a, c);
    assert_int_equal(system(cmd), 0);
    snprintf(conf, sizeof conf, "[model:alpha]\npath = %s\n[model:broken]\npath = %s\n", g_a, c);
    const char *args[] = {"--backend", "cpu", NULL};
    struct kh_proc *p = kh_new(conf, args);
    assert_non_null(p);
    /* the file loses its weights after the daemon read its header */
    assert_int_equal(truncate(c, 4096), 0);
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    struct gen g;
    generate(fd, "broken", prompt8, 8, 2, false, &g);
    assert_int_not_equal(g.code, 0);
    assert_non_null(strstr(g.message, "broken"));
    assert_int_equal(model_stat(fd, "broken", "load_failures"), 1);
    char st[32];
    model_state(fd, "broken", st, sizeof st);
    assert_string_equal(st, "unloaded");
    generate(fd, "alpha", prompt8, 8, 2, false, &g);
    assert_int_equal(g.code, 0);
    generate(fd, "broken", prompt8, 8, 2, false, &g);
    assert_int_not_equal(g.code, 0);
    assert_int_equal(model_stat(fd, "broken", "load_failures"), 2);
    close(fd);
    assert_int_equal(kh_free(p), 0);
    unlink(c);
}

/* ---- tenants, names, listings ------------------------------------------- */

static void t_tenants_and_names(void **state)
{
    (void)state;
    char conf[1024], sock[160];
    /* root's tenant is uid:0 ([limits]): alpha is for it, beta is not */
    snprintf(conf, sizeof conf,
             "[server]\nmax-queued-per-tenant = 1\ndevice-bytes = 8M\n"
             "[limits]\nmax-device-blocks = 2\n"
             "[model:alpha]\npath = %s\nmax-device-bytes = 5M\n"
             "[model:beta]\npath = %s\ntenants = someone, uid:0\nmax-device-bytes = 7500K\n"
             "[model:gamma]\npath = %s\ntenants = someone\nmax-device-bytes = 5M\n",
             g_a, g_b, g_a);
    snprintf(sock, sizeof sock, "%s/http2.sock", g_dir);
    /* info: the log a failure prints has every load's decision and time */
    const char *args[] = {"--backend", "cpu", "--http-socket", sock, "--log-level", "info", NULL};
    struct kh_proc *p = kh_new(conf, args);
    assert_non_null(p);
    int fd = kh_connect(p->sock), f2 = kh_connect(p->sock);
    assert_true(fd >= 0 && f2 >= 0);
    struct kh_reply r;

    /* hello lists every model, loaded or not, and whether it is allowed */
    assert_int_equal(kh_call0(fd, "hello", ++g_id, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    assert_int_equal(m->via.array.size, 3);
    assert_true(kh_obj(&m->via.array.ptr[1], "allowed")->via.boolean);
    assert_false(kh_obj(&m->via.array.ptr[2], "allowed")->via.boolean);
    assert_int_equal(kh_u64(&m->via.array.ptr[1], "vocab"), 700);
    assert_int_equal(kh_u64(kh_obj(&m->via.array.ptr[1], "kv"), "layers"), 3);
    kh_reply_free(&r);

    /* unknown and forbidden models, on every op that names one */
    const char *ops[] = {"generate", "tokenize", "detokenize", "seq_open", "hello"};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        struct kh_req q;
        bool gen = !strcmp(ops[i], "generate"), tok = !strcmp(ops[i], "tokenize"),
             det = !strcmp(ops[i], "detokenize");
        for (int k = 0; k < 2; k++) {
            kh_req_begin(&q, ops[i], ++g_id, 1 + (gen || tok || det));
            proto_pack_kv_str(&q.pk, "model", k ? "gamma" : "nosuch");
            if (gen || det)
                proto_pack_kv_u32_array(&q.pk, "tokens", prompt8, 4);
            if (tok)
                proto_pack_kv_str(&q.pk, "text", "hello");
            assert_int_equal(kh_req_send(fd, &q), 0);
            assert_int_equal(kh_recv(fd, &r), 0);
            kh_expect(&r, k ? KVD_EPERM : KVD_ENOTFOUND);
            kh_reply_free(&r);
        }
    }
    /* each model's own vocabulary */
    uint32_t big[1] = {650};
    struct kh_req q;
    kh_req_begin(&q, "detokenize", ++g_id, 2);
    proto_pack_kv_str(&q.pk, "model", "beta");
    proto_pack_kv_u32_array(&q.pk, "tokens", big, 1);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    kh_req_begin(&q, "detokenize", ++g_id, 2);
    proto_pack_kv_str(&q.pk, "model", "alpha");
    proto_pack_kv_u32_array(&q.pk, "tokens", big, 1);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_EBADREQ);
    kh_reply_free(&r);

    /* the quota holds in each model's pool, in its blocks: 40 tokens need
     * 3 blocks, the tenant may hold 2 */
    uint32_t p40[40];
    for (int i = 0; i < 40; i++)
        p40[i] = (uint32_t)(1 + i);
    struct gen g;
    generate(fd, "alpha", p40, 40, 2, false, &g);
    assert_int_equal(g.code, KVD_EQUOTA);
    generate(fd, "beta", p40, 40, 2, false, &g);
    assert_int_equal(g.code, KVD_EQUOTA);
    /* one in-flight count across the models: with a sequence open on beta
     * (beta stays loaded, and the budget holds one model), a request for
     * alpha waits for its load and holds the tenant's one slot; beta's own
     * request is busy meanwhile; the sequence closed, alpha loads and
     * answers, and beta answers again */
    assert_int_equal(call_model(fd, "seq_open", "beta", &r), 0);
    uint64_t seq = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    uint64_t ia = gen_send(f2, "alpha", prompt8, 8, 4, false);
    char st[32] = "";
    for (int i = 0; i < 400; i++) { /* until alpha's request is waiting, its load
                                     * tried and found the budget short */
        st[0] = '\0';
        /* The state is read once the request is seen waiting: f2's request
         * and fd's reads are on two connections, and a state read before
         * the daemon took the request ("unloaded", nothing tried yet)
         * would end the wait while the load is still being tried. */
        if (model_stat(fd, "alpha", "waiting") == 1) {
            model_state(fd, "alpha", st, sizeof st);
            if (!strcmp(st, "unloaded"))
                break;
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    /* refused for memory (beta is in use), and waiting: not loading for
     * as long as the sequence is open */
    assert_string_equal(st, "unloaded");
    assert_int_equal(model_stat(fd, "alpha", "waiting"), 1);
    model_state(fd, "alpha", st, sizeof st);
    assert_string_equal(st, "unloaded");
    generate(fd, "beta", prompt8, 8, 2, false, &g);
    assert_int_equal(g.code, KVD_EBUSY);
    assert_non_null(strstr(g.message, "max-queued-per-tenant"));
    assert_int_equal(kh_call1(fd, "seq_close", ++g_id, "seq", seq, &r), 0);
    kh_reply_free(&r);
    g.events = 0;
    gen_recv(f2, ia, &g, false);
    assert_int_equal(g.code, 0);
    generate(fd, "beta", prompt8, 8, 2, false, &g);
    assert_int_equal(g.code, 0);

    /* HTTP: 404 and 403 by name, /v1/models lists what the tenant may use */
    if (system("curl --version >/dev/null 2>&1") == 0) {
        char cmd[1024], out[8192];
        const char *names[3] = {"nosuch", "gamma", "beta"};
        const char *want[3] = {"404", "403", "200"};
        for (int k = 0; k < 3; k++) {
            snprintf(cmd, sizeof cmd,
                     "curl -sS -o /dev/null -w '%%{http_code}' -H 'Content-Type: "
                     "application/json' -d '{\"model\":\"%s\",\"prompt\":[5,6,7],"
                     "\"max_tokens\":2}' --unix-socket %s http://localhost/v1/completions",
                     names[k], sock);
            FILE *pp = popen(cmd, "r");
            assert_non_null(pp);
            size_t n = fread(out, 1, sizeof out - 1, pp);
            pclose(pp);
            out[n] = '\0';
            assert_string_equal(out, want[k]);
        }
        snprintf(cmd, sizeof cmd, "curl -sS --unix-socket %s http://localhost/v1/models", sock);
        FILE *pp = popen(cmd, "r");
        assert_non_null(pp);
        size_t n = fread(out, 1, sizeof out - 1, pp);
        pclose(pp);
        out[n] = '\0';
        json_error_t je;
        json_t *j = json_loads(out, 0, &je);
        assert_non_null(j);
        json_t *data = json_object_get(j, "data");
        assert_int_equal(json_array_size(data), 2);
        assert_string_equal(json_string_value(json_object_get(json_array_get(data, 0), "id")),
                            "alpha");
        assert_string_equal(json_string_value(json_object_get(json_array_get(data, 1), "id")),
                            "beta");
        json_decref(j);
    }
    close(fd);
    close(f2);
    assert_int_equal(kh_free(p), 0);
}

int main(void)
{
    if (!getenv("KVD_BIN") || !getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "test_models: KVD_BIN/KVD_TOOLS_DIR not set (run through ctest)\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_two_models_llamacpp),
        cmocka_unit_test(t_unload_reload_warm),
        cmocka_unit_test(t_keep_alive),
        cmocka_unit_test(t_load_failure),
        cmocka_unit_test(t_tenants_and_names),
        cmocka_unit_test(t_shared_budget),
        cmocka_unit_test(t_tenant_bytes_across_models),
    };
    if (getenv("KVD_TEST_FILTER")) /* e.g. KVD_TEST_FILTER=t_keep_alive */
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests(tests, setup, teardown);
}
