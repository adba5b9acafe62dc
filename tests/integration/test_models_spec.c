/* Speculative decoding in a daemon of several models, against a real kvd
 * (cpu backend): two served models, each with its own draft (another
 * model of the daemon, [model:NAME] draft), speculating at once and giving
 * plain greedy decoding's tokens; a draft's weights shared with its model
 * served by name (counted once in the device memory); the draft model
 * unloaded and reloaded under its target, and the target unloaded (its
 * draft state with it) and reloaded; n > 1 choices speculating, each equal
 * to its single plain run; the refusals (a draft of another vocabulary, an
 * unknown draft, --draft-model with several models, a request's "draft"
 * where the model has none); the draft's KV in pages of the daemon's
 * budget, taken as it drafts and given back when the model needs them. */
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

#define N_GEN 24
#define N_PROMPT 40

static char g_dir[64], g_a[128], g_as[128], g_b[128], g_bs[128];
static uint64_t g_id;
static uint32_t g_pa[N_PROMPT], g_pb[N_PROMPT];

/* Two targets unlike each other (llama, vocabulary 500; qwen2, 700), each
 * with a draft made of its own first layer (kvd-gguf-gen --keep-layers:
 * the same embeddings and output, so most drafts are kept). */
static int setup(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[2048];
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-mspec.XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_a, sizeof g_a, "%s/a.gguf", g_dir);
    snprintf(g_as, sizeof g_as, "%s/a-small.gguf", g_dir);
    snprintf(g_b, sizeof g_b, "%s/b.gguf", g_dir);
    snprintf(g_bs, sizeof g_bs, "%s/b-small.gguf", g_dir);
    const char *a = "--arch llama --layers 3 --embd 128 --heads 4 --kv-heads 2 --ff 256 "
                    "--vocab 500 --ctx 512 --type f32 --seed 3";
    const char *b = "--arch qwen2 --layers 3 --embd 192 --heads 6 --kv-heads 3 --ff 384 "
                    "--vocab 700 --ctx 512 --type f16 --seed 4";
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s %s >/dev/null && %s/kvd-gguf-gen -o %s %s --keep-layers 1 "
             ">/dev/null && %s/kvd-gguf-gen -o %s %s >/dev/null && %s/kvd-gguf-gen -o %s %s "
             "--keep-layers 1 >/dev/null",
             tools, g_a, a, tools, g_as, a, tools, g_b, b, tools, g_bs, b);
    /* prompts that repeat themselves (the n-gram lookup finds something) */
    for (int i = 0; i < N_PROMPT; i++) {
        g_pa[i] = (uint32_t)(3 + (i % 13) * 31) % 500;
        g_pb[i] = (uint32_t)(5 + (i % 11) * 47) % 700;
    }
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    unlink(g_a);
    unlink(g_as);
    unlink(g_b);
    unlink(g_bs);
    rmdir(g_dir);
    return 0;
}

/* ---- requests ------------------------------------------------------------ */

struct gen {
    uint32_t toks[N_GEN];
    size_t n;
    int code;
    char message[256];
};

struct ask {
    const char *model;       /* NULL: none named */
    const uint32_t *prompt;  /* n_prompt tokens */
    size_t n_prompt;         /* 0: N_PROMPT */
    const char *speculative; /* NULL: absent (the model's default) */
    double temperature;
    uint64_t seed;
    uint32_t n; /* choices; 0: absent */
};

static uint64_t send_ask(int fd, const struct ask *a)
{
    struct kh_req q;
    size_t n = 4 + (a->model != NULL) + (a->speculative != NULL) + (a->n > 0);
    kh_req_begin(&q, "generate", ++g_id, n);
    if (a->model)
        proto_pack_kv_str(&q.pk, "model", a->model);
    proto_pack_kv_u32_array(&q.pk, "tokens", a->prompt, a->n_prompt ? a->n_prompt : N_PROMPT);
    proto_pack_kv_uint(&q.pk, "max_tokens", N_GEN);
    proto_pack_kv_double(&q.pk, "temperature", a->temperature);
    proto_pack_kv_uint(&q.pk, "seed", a->seed);
    if (a->speculative)
        proto_pack_kv_str(&q.pk, "speculative", a->speculative);
    if (a->n)
        proto_pack_kv_uint(&q.pk, "n", a->n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    return g_id;
}

static void read_toks(const msgpack_object *t, struct gen *g)
{
    g->n = 0;
    for (uint32_t i = 0; i < t->via.array.size && g->n < N_GEN; i++)
        g->toks[g->n++] = (uint32_t)t->via.array.ptr[i].via.u64;
}

/* The reply of request id: its tokens, or with n > 1 each choice's into
 * g[0..n). */
static void recv_gen(int fd, uint64_t id, struct gen *g, uint32_t n)
{
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.id, id);
    memset(g, 0, sizeof *g * (n ? n : 1));
    g->code = r.code;
    snprintf(g->message, sizeof g->message, "%s", r.message);
    if (r.code == 0 && n > 1) {
        const msgpack_object *cs = kh_obj(r.root, "choices");
        assert_int_equal(cs->via.array.size, n);
        for (uint32_t i = 0; i < n; i++)
            read_toks(kh_obj(&cs->via.array.ptr[i], "tokens"), &g[i]);
    } else if (r.code == 0) {
        read_toks(kh_obj(r.root, "tokens"), g);
    }
    kh_reply_free(&r);
}

static void ask(int fd, const struct ask *a, struct gen *g)
{
    recv_gen(fd, send_ask(fd, a), g, a->n);
}

static void same_tokens(const struct gen *want, const struct gen *got, const char *what)
{
    if (got->code)
        fail_msg("%s: %s", what, got->message);
    if (want->n != got->n || memcmp(want->toks, got->toks, want->n * sizeof(uint32_t))) {
        size_t i = 0;
        while (i < want->n && i < got->n && want->toks[i] == got->toks[i])
            i++;
        fail_msg("%s: token %zu differs from plain decoding's (%zu and %zu tokens)", what, i,
                 got->n, want->n);
    }
}

/* stats models[name] (an admin's stats): the model's map, in r. */
static const msgpack_object *model_stats(int fd, const char *name, struct kh_reply *r)
{
    assert_int_equal(kh_call0(fd, "stats", ++g_id, r), 0);
    const msgpack_object *m = kh_obj(r->root, "models");
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i];
        const msgpack_object *nm = kh_obj(e, "name");
        if (nm->via.str.size == strlen(name) && !memcmp(nm->via.str.ptr, name, nm->via.str.size))
            return e;
    }
    fail_msg("stats: no model %s", name);
    return NULL;
}

static uint64_t model_stat(int fd, const char *name, const char *key)
{
    struct kh_reply r;
    uint64_t v = kh_u64(model_stats(fd, name, &r), key);
    kh_reply_free(&r);
    return v;
}

/* models[name].speculative[key] */
static uint64_t spec_stat(int fd, const char *name, const char *key)
{
    struct kh_reply r;
    uint64_t v = kh_u64(kh_obj(model_stats(fd, name, &r), "speculative"), key);
    kh_reply_free(&r);
    return v;
}

static uint64_t device_used(int fd)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
    uint64_t v = kh_u64(kh_obj(r.root, "model_memory"), "device_used");
    kh_reply_free(&r);
    return v;
}

/* A string field of model `name` in hello's `models` ("" for nil). */
static void hello_str(int fd, const char *name, const char *key, char *out, size_t cap)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", ++g_id, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    out[0] = '\0';
    bool found = false;
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i];
        const msgpack_object *nm = kh_obj(e, "name");
        if (nm->via.str.size != strlen(name) || memcmp(nm->via.str.ptr, name, nm->via.str.size))
            continue;
        const msgpack_object *v = kh_obj(e, key);
        assert_true(v->type == MSGPACK_OBJECT_STR || v->type == MSGPACK_OBJECT_NIL);
        if (v->type == MSGPACK_OBJECT_STR)
            snprintf(out, cap, "%.*s", (int)v->via.str.size, v->via.str.ptr);
        found = true;
    }
    kh_reply_free(&r);
    assert_true(found);
}

/* Waits (polling hello, 20 s at most) for model `name` to reach `state`. */
static void wait_state(int fd, const char *name, const char *state)
{
    char st[32];
    for (int i = 0; i < 400; i++) {
        hello_str(fd, name, "state", st, sizeof st);
        if (!strcmp(st, state))
            return;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fail_msg("model %s is %s, not %s, after 20 s", name, st, state);
}

static const char *const g_args[] = {"--backend", "cpu", "--no-roofline-probe", NULL};

/* ---- two models, each with its own draft ------------------------------- */

static void t_two_models_own_drafts(void **state)
{
    (void)state;
    char conf[2048];
    snprintf(conf, sizeof conf,
             "[server]\nspeculative = draft\n"
             "[model:alpha]\npath = %s\ndraft = alpha-small\n"
             "[model:beta]\npath = %s\ndraft = beta-small\nkv-dtype = f32\n"
             "[model:alpha-small]\npath = %s\n"
             "[model:beta-small]\npath = %s\n",
             g_a, g_b, g_as, g_bs);
    struct kh_proc *p = kh_new(conf, g_args);
    assert_non_null(p);
    int fa = kh_connect(p->sock), fb = kh_connect(p->sock);
    assert_true(fa >= 0 && fb >= 0);
    char s[64];
    hello_str(fa, "alpha", "draft", s, sizeof s);
    assert_string_equal(s, "alpha-small");
    hello_str(fa, "beta", "draft", s, sizeof s);
    assert_string_equal(s, "beta-small");
    hello_str(fa, "alpha", "speculative", s, sizeof s);
    assert_string_equal(s, "draft");
    hello_str(fa, "alpha-small", "draft", s, sizeof s);
    assert_string_equal(s, ""); /* nil */
    /* --speculative draft: a model without a draft decodes plainly */
    hello_str(fa, "alpha-small", "speculative", s, sizeof s);
    assert_string_equal(s, "off");

    struct gen plain_a, plain_b, ga, gb;
    ask(fa, &(struct ask){.model = "alpha", .prompt = g_pa, .speculative = "off"}, &plain_a);
    ask(fb, &(struct ask){.model = "beta", .prompt = g_pb, .speculative = "off"}, &plain_b);
    assert_int_equal(plain_a.code, 0);
    assert_int_equal(plain_b.code, 0);
    assert_int_equal(spec_stat(fa, "alpha", "verifications"), 0);
    /* both at once, on two connections: each model's executor drafts with
     * its own draft, the drafts' forwards taking their turns on the device
     * beside the verifications */
    for (int round = 0; round < 3; round++) {
        uint64_t ia = send_ask(fa, &(struct ask){.model = "alpha", .prompt = g_pa});
        uint64_t ib = send_ask(fb, &(struct ask){.model = "beta", .prompt = g_pb});
        recv_gen(fa, ia, &ga, 0);
        recv_gen(fb, ib, &gb, 0);
        same_tokens(&plain_a, &ga, "alpha, its draft alpha-small");
        same_tokens(&plain_b, &gb, "beta, its draft beta-small");
    }
    uint64_t da = spec_stat(fa, "alpha", "drafted"), db = spec_stat(fa, "beta", "drafted");
    print_message("alpha: %llu of %llu drafts kept; beta: %llu of %llu\n",
                  (unsigned long long)spec_stat(fa, "alpha", "accepted"), (unsigned long long)da,
                  (unsigned long long)spec_stat(fa, "beta", "accepted"), (unsigned long long)db);
    assert_true(da > 0 && db > 0);
    assert_true(spec_stat(fa, "alpha", "accepted") > 0 && spec_stat(fa, "beta", "accepted") > 0);
    /* the daemon's sum */
    {
        struct kh_reply r;
        assert_int_equal(kh_call0(fa, "stats", ++g_id, &r), 0);
        const msgpack_object *sp = kh_obj(kh_obj(r.root, "requests"), "speculative");
        assert_int_equal(kh_u64(sp, "drafted"), da + db);
        assert_true(kh_obj(sp, "draft_model")->via.boolean);
        kh_reply_free(&r);
    }
    /* the drafts are not loaded as models: their weights are, for their
     * targets */
    hello_str(fa, "alpha-small", "state", s, sizeof s);
    assert_string_equal(s, "unloaded");
    assert_true(model_stat(fa, "alpha", "draft_kv_device_bytes") > 0);

    /* alpha-small served by name: it loads beside alpha, sharing its
     * weights with alpha's draft: the device use grows by its KV pages and
     * the pages charged for its scratch, not by a second copy of the
     * weights */
    uint64_t used0 = device_used(fa);
    uint64_t c0 = model_stat(fa, "alpha-small", "charged_device_bytes");
    struct gen gs;
    ask(fa, &(struct ask){.model = "alpha-small", .prompt = g_pa}, &gs);
    assert_int_equal(gs.code, 0);
    hello_str(fa, "alpha-small", "state", s, sizeof s);
    assert_string_equal(s, "loaded");
    uint64_t used1 = device_used(fa);
    uint64_t c1 = model_stat(fa, "alpha-small", "charged_device_bytes");
    assert_true(c0 > 0 && c1 > c0); /* its weights were charged with alpha's draft */
    assert_int_equal(used1 - used0, model_stat(fa, "alpha-small", "kv_device_bytes") + (c1 - c0));
    /* alpha still drafts with it */
    recv_gen(fa, send_ask(fa, &(struct ask){.model = "alpha", .prompt = g_pa}), &ga, 0);
    same_tokens(&plain_a, &ga, "alpha, its draft also served");
    assert_true(spec_stat(fa, "alpha", "drafted") > da);

    /* a request's own "draft" where the model has none */
    ask(fa, &(struct ask){.model = "alpha-small", .prompt = g_pa, .speculative = "draft"}, &gs);
    assert_int_equal(gs.code, KVD_EUNSUPPORTED);
    assert_non_null(strstr(gs.message, "draft"));
    /* its own n-gram speculation works: plain's tokens */
    struct gen gsp, gsn;
    ask(fa, &(struct ask){.model = "alpha-small", .prompt = g_pa, .speculative = "off"}, &gsp);
    ask(fa, &(struct ask){.model = "alpha-small", .prompt = g_pa, .speculative = "ngram"}, &gsn);
    same_tokens(&gsp, &gsn, "alpha-small, ngram");
    close(fa);
    close(fb);
    assert_int_equal(kh_free(p), 0);
}

/* ---- unloads -------------------------------------------------------------- */

static void t_draft_unload_reload(void **state)
{
    (void)state;
    char conf[2048];
    snprintf(conf, sizeof conf,
             "[model:alpha]\npath = %s\ndraft = alpha-small\nspeculative = draft\n"
             "keep-alive-s = 1\n"
             "[model:alpha-small]\npath = %s\nkeep-alive-s = 1\n",
             g_a, g_as);
    struct kh_proc *p = kh_new(conf, g_args);
    assert_non_null(p);
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    struct gen plain, g;
    ask(fd, &(struct ask){.model = "alpha", .prompt = g_pa, .speculative = "off"}, &plain);
    assert_int_equal(plain.code, 0);
    /* a sequence open on alpha keeps it loaded */
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "seq_open", ++g_id, 1);
    proto_pack_kv_str(&q.pk, "model", "alpha");
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    uint64_t seq = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    uint64_t used_alpha = device_used(fd); /* alpha, its draft's KV and weights */
    uint64_t c0 = model_stat(fd, "alpha-small", "charged_device_bytes");

    /* the draft model loads by name, then unloads (idle): alpha keeps its
     * draft (the weights stay while alpha holds them) and speculates */
    ask(fd, &(struct ask){.model = "alpha-small", .prompt = g_pa}, &g);
    assert_int_equal(g.code, 0);
    wait_state(fd, "alpha-small", "unloaded");
    assert_int_equal(model_stat(fd, "alpha-small", "unloads"), 1);
    char s[32];
    hello_str(fd, "alpha", "state", s, sizeof s);
    assert_string_equal(s, "loaded");
    /* its KV pages and scratch back to the budget, its weights still
     * charged (alpha holds them) */
    assert_int_equal(model_stat(fd, "alpha-small", "charged_device_bytes"), c0);
    assert_int_equal(device_used(fd), used_alpha);
    uint64_t d0 = spec_stat(fd, "alpha", "drafted");
    ask(fd, &(struct ask){.model = "alpha", .prompt = g_pa}, &g);
    same_tokens(&plain, &g, "alpha after its draft model unloaded");
    assert_true(spec_stat(fd, "alpha", "drafted") > d0);
    /* and reloads */
    ask(fd, &(struct ask){.model = "alpha-small", .prompt = g_pa}, &g);
    assert_int_equal(g.code, 0);
    assert_int_equal(model_stat(fd, "alpha-small", "loads"), 2);

    /* alpha unloads: its draft state goes with its executor, and the
     * draft's weights once nothing holds them: nothing is left */
    assert_int_equal(kh_call1(fd, "seq_close", ++g_id, "seq", seq, &r), 0);
    kh_reply_free(&r);
    wait_state(fd, "alpha", "unloaded");
    wait_state(fd, "alpha-small", "unloaded");
    assert_int_equal(device_used(fd), 0);
    /* reloaded, it drafts again (a fresh draft state) */
    uint64_t d1 = spec_stat(fd, "alpha", "drafted");
    ask(fd, &(struct ask){.model = "alpha", .prompt = g_pa}, &g);
    same_tokens(&plain, &g, "alpha reloaded");
    assert_true(spec_stat(fd, "alpha", "drafted") > d1);
    assert_int_equal(model_stat(fd, "alpha", "loads"), 2);
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* ---- the draft's KV: pages of the budget ---------------------------------- */

/* model_memory.device_used of the stats, and model alpha's pools and
 * charges: the budget's pages in use are exactly its KV pool's, its
 * charges' and its draft's KV pool's. */
struct mem {
    uint64_t used, kv, charged, draft, draft_max;
};

static void mem_get(int fd, const char *name, struct mem *m)
{
    struct kh_reply r;
    const msgpack_object *e = model_stats(fd, name, &r);
    m->kv = kh_u64(e, "kv_device_bytes");
    m->charged = kh_u64(e, "charged_device_bytes");
    m->draft = kh_u64(e, "draft_kv_device_bytes");
    m->draft_max = kh_u64(e, "draft_kv_max_bytes");
    m->used = kh_u64(kh_obj(r.root, "model_memory"), "device_used");
    kh_reply_free(&r);
    assert_int_equal(m->used, m->kv + m->charged + m->draft);
}

#define PAGE 65536
#define N_LONG 400

/* draft-kv-share 1 (the draft may take all of the model's KV: a share no
 * arena set aside could be, as the model would have none left), and a
 * budget of the model's weights and scratch and 6 KV pages: the draft's
 * pages are taken as it drafts, counted in the budget, given back when the
 * model's own request needs them, and taken again; every speculating
 * request gives plain decoding's tokens. */
static void t_draft_pages_of_budget(void **state)
{
    (void)state;
    char conf[512], pb[32], db[32];
    snprintf(conf, sizeof conf, "[model:a]\npath = %s\n", g_a);
    snprintf(pb, sizeof pb, "%d", PAGE);
    const char *args[] = {"--backend",
                          "cpu",
                          "--no-roofline-probe",
                          "--draft-model",
                          g_as,
                          "--speculative",
                          "draft",
                          "--draft-kv-share",
                          "1",
                          "--page-bytes",
                          pb,
                          "--step-tokens",
                          "64",
                          NULL,
                          NULL,
                          NULL};
    struct kh_proc *p = kh_new(conf, args);
    assert_non_null(p);
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    struct gen plain, g;
    struct mem m0, m1;
    ask(fd, &(struct ask){.prompt = g_pa, .speculative = "off"}, &plain);
    assert_int_equal(plain.code, 0);
    /* loaded, nothing drafted yet: the draft holds no page */
    mem_get(fd, "a", &m0);
    assert_int_equal(m0.draft, 0);
    assert_true(m0.draft_max >= PAGE);
    ask(fd, &(struct ask){.prompt = g_pa}, &g);
    same_tokens(&plain, &g, "drafting, pages of a default budget");
    assert_true(spec_stat(fd, "a", "drafted") > 0);
    mem_get(fd, "a", &m1);
    assert_true(m1.draft >= PAGE);
    uint64_t charged = m1.charged;
    close(fd);
    assert_int_equal(kh_free(p), 0);

    /* the same model in a budget of its charges and 6 KV pages */
    snprintf(db, sizeof db, "%llu", (unsigned long long)(charged + 6 * PAGE));
    args[13] = "--device-bytes";
    args[14] = db;
    p = kh_new(conf, args);
    assert_non_null(p);
    fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    ask(fd, &(struct ask){.prompt = g_pa, .speculative = "off"}, &g);
    same_tokens(&plain, &g, "plain, a tight budget");
    uint64_t d0 = spec_stat(fd, "a", "drafted");
    ask(fd, &(struct ask){.prompt = g_pa}, &g);
    same_tokens(&plain, &g, "drafting, a tight budget");
    assert_true(spec_stat(fd, "a", "drafted") > d0);
    mem_get(fd, "a", &m0);
    assert_true(m0.draft >= PAGE);
    assert_int_equal(m0.charged, charged);
    /* a long prompt of the model's own needs all 6 pages: the
     * draft's cache gives its pages back to the budget */
    uint32_t lp[N_LONG];
    for (int i = 0; i < N_LONG; i++)
        lp[i] = (uint32_t)(7 + i * 13) % 500;
    ask(fd, &(struct ask){.prompt = lp, .n_prompt = N_LONG, .speculative = "off"}, &g);
    if (g.code)
        fail_msg("the long prompt: %s", g.message);
    mem_get(fd, "a", &m1);
    print_message("draft KV: %llu bytes, then %llu once the model's long prompt ran (its KV "
                  "%llu, budget used %llu of %llu)\n",
                  (unsigned long long)m0.draft, (unsigned long long)m1.draft,
                  (unsigned long long)m1.kv, (unsigned long long)m1.used,
                  (unsigned long long)(charged + 6 * PAGE));
    assert_true(m1.draft < m0.draft);
    /* and drafts again, its pages taken back */
    d0 = spec_stat(fd, "a", "drafted");
    ask(fd, &(struct ask){.prompt = g_pa}, &g);
    same_tokens(&plain, &g, "drafting after giving its pages back");
    assert_true(spec_stat(fd, "a", "drafted") > d0);
    mem_get(fd, "a", &m1);
    assert_true(m1.draft >= PAGE);
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* ---- n > 1 -------------------------------------------------------------- */

/* Each choice of an n = 3 request speculates on its own (its own draft
 * sequence, its own stream) and equals a single plain run with seed + i;
 * greedy and sampled, with the draft model and the n-gram lookup. */
static void t_choices_speculate(void **state)
{
    (void)state;
    const char *args[] = {"--backend",     "cpu", "--no-roofline-probe", "--model", g_a,
                          "--draft-model", g_as,  "--speculative",       "draft",   NULL};
    struct kh_proc *p = kh_new(NULL, args);
    assert_non_null(p);
    int fd = kh_connect(p->sock);
    assert_true(fd >= 0);
    const char *kinds[2] = {"draft", "ngram"};
    const double temps[2] = {0.0, 0.8};
    for (int k = 0; k < 2; k++)
        for (int t = 0; t < 2; t++) {
            struct gen one[3], all[3];
            for (uint32_t i = 0; i < 3; i++)
                ask(fd,
                    &(struct ask){.prompt = g_pa,
                                  .speculative = "off",
                                  .temperature = temps[t],
                                  .seed = 50 + i},
                    &one[i]);
            struct kh_reply r;
            assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
            uint64_t before =
                kh_u64(kh_obj(kh_obj(r.root, "requests"), "speculative"), "verifications");
            kh_reply_free(&r);
            ask(fd,
                &(struct ask){.prompt = g_pa,
                              .speculative = kinds[k],
                              .temperature = temps[t],
                              .seed = 50,
                              .n = 3},
                all);
            assert_int_equal(all[0].code, 0);
            for (int i = 0; i < 3; i++) {
                char what[64];
                snprintf(what, sizeof what, "%s, T %.1f, choice %d", kinds[k], temps[t], i);
                same_tokens(&one[i], &all[i], what);
            }
            assert_int_equal(kh_call0(fd, "stats", ++g_id, &r), 0);
            uint64_t after =
                kh_u64(kh_obj(kh_obj(r.root, "requests"), "speculative"), "verifications");
            kh_reply_free(&r);
            assert_true(after > before); /* the choices did speculate */
        }
    close(fd);
    assert_int_equal(kh_free(p), 0);
}

/* ---- refusals ------------------------------------------------------------ */

/* kvd with this config (and extra args) refuses to start (status 2) with
 * a message containing `want` in its log. */
static void refused(const char *conf, const char *const *extra, const char *want)
{
    const char *args[16] = {"--backend", "cpu", "--no-roofline-probe"};
    size_t n = 3;
    for (size_t i = 0; extra && extra[i]; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    struct kh_proc p;
    assert_int_equal(
        kh_spawn(&p, &(struct kh_opts){.conf_text = conf, .args = args, .no_wait = true}), 0);
    int st = kh_wait(&p);
    static char log[1 << 16];
    FILE *f = fopen(p.log, "r");
    size_t len = f ? fread(log, 1, sizeof log - 1, f) : 0;
    if (f)
        fclose(f);
    log[len] = '\0';
    kh_cleanup_dir(&p);
    if (st != 2 || !strstr(log, want))
        fail_msg("expected a refusal naming \"%s\" (status 2), got status %d:\n%s", want, st, log);
}

static void t_refusals(void **state)
{
    (void)state;
    char conf[2048];
    /* a draft of another vocabulary (700 tokens against 500) */
    snprintf(conf, sizeof conf, "[model:alpha]\npath = %s\ndraft = beta\n[model:beta]\npath = %s\n",
             g_a, g_b);
    refused(conf, NULL, "its vocabulary has 700 tokens, the served model's 500");
    /* an unknown draft */
    snprintf(conf, sizeof conf, "[model:alpha]\npath = %s\ndraft = nosuch\n", g_a);
    refused(conf, NULL, "no other model is named 'nosuch'");
    /* a model's own "speculative = draft" without a draft */
    snprintf(conf, sizeof conf, "[model:alpha]\npath = %s\nspeculative = draft\n", g_a);
    refused(conf, NULL, "the model has no draft");
    /* --draft-model with several named models */
    snprintf(conf, sizeof conf, "[model:alpha]\npath = %s\n[model:beta]\npath = %s\n", g_a, g_b);
    const char *dm[] = {"--draft-model", g_as, NULL};
    refused(conf, dm, "--draft-model is the draft of a daemon's one model");
    /* --speculative draft with no draft anywhere */
    const char *sd[] = {"--model", g_a, "--speculative", "draft", NULL};
    refused(NULL, sd, "--speculative draft needs a draft model");
    /* --draft-model of another vocabulary for the one model */
    const char *ov[] = {"--model", g_a, "--draft-model", g_bs, NULL};
    refused(NULL, ov, "vocabulary");
}

int main(void)
{
    if (!getenv("KVD_BIN") || !getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "test_models_spec: KVD_BIN/KVD_TOOLS_DIR not set (run through ctest)\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_two_models_own_drafts),
        cmocka_unit_test(t_draft_unload_reload),
        cmocka_unit_test(t_choices_speculate),
        cmocka_unit_test(t_draft_pages_of_budget),
        cmocka_unit_test(t_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
