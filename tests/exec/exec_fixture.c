/* The in-process executor fixture (see exec_fixture.h). */
#include "exec_fixture.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "compute.h"
#include "model.h"
#include "proto.h"

static pthread_mutex_t fx_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fx_cv = PTHREAD_COND_INITIALIZER;
static struct fx_result fx_res[FX_MAX_REQ];
static uint32_t fx_order;
/* fx_pause_at: the request (0: none) and event count that freeze the sink. */
static uint64_t fx_pause_id;
static size_t fx_pause_events;
static bool fx_paused;

struct fx_model fx_small;

int fx_small_setup(void **state)
{
    (void)state;
    return fx_model_make(&fx_small, 2, 64, 4, 2, 128, 256, 256);
}

int fx_small_teardown(void **state)
{
    (void)state;
    fx_model_remove(&fx_small);
    return 0;
}

int fx_model_make(struct fx_model *fm, uint32_t layers, uint32_t embd, uint32_t heads,
                  uint32_t kv_heads, uint32_t ff, uint32_t vocab, uint32_t ctx)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    snprintf(fm->dir, sizeof(fm->dir), "/tmp/kvd-exec-XXXXXX");
    if (!tools || !mkdtemp(fm->dir))
        return -1;
    snprintf(fm->path, sizeof(fm->path), "%s/model.gguf", fm->dir);
    snprintf(cmd, sizeof(cmd),
             "'%s/kvd-gguf-gen' -o '%s' --layers %u --embd %u --heads %u --kv-heads %u --ff %u "
             "--vocab %u --ctx %u --type f32 --seed 7 >/dev/null",
             tools, fm->path, layers, embd, heads, kv_heads, ff, vocab, ctx);
    fm->vocab = vocab;
    fm->ctx = ctx;
    return system(cmd) == 0 ? 0 : -1;
}

int fx_model_make_args(struct fx_model *fm, uint32_t vocab, uint32_t ctx, const char *args)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    snprintf(fm->dir, sizeof(fm->dir), "/tmp/kvd-exec-XXXXXX");
    if (!tools || !mkdtemp(fm->dir))
        return -1;
    snprintf(fm->path, sizeof(fm->path), "%s/model.gguf", fm->dir);
    snprintf(cmd, sizeof(cmd), "'%s/kvd-gguf-gen' -o '%s' --vocab %u --ctx %u %s >/dev/null", tools,
             fm->path, vocab, ctx, args);
    fm->vocab = vocab;
    fm->ctx = ctx;
    return system(cmd) == 0 ? 0 : -1;
}

void fx_model_remove(struct fx_model *fm)
{
    unlink(fm->path);
    rmdir(fm->dir);
}

static void sink_tokens(void *ud, const struct sched_req *r, const uint32_t *toks, size_t n)
{
    (void)ud;
    if (r->id >= FX_MAX_REQ)
        return;
    pthread_mutex_lock(&fx_mu);
    struct fx_result *x = &fx_res[r->id];
    for (size_t i = 0; i < n && x->n_streamed < FX_MAX_TOK; i++)
        x->streamed[x->n_streamed++] = toks[i];
    x->n_events++;
    if (r->id == fx_pause_id && x->n_events >= fx_pause_events) {
        /* Freeze the executor thread between two steps (fx_pause_at). */
        fx_paused = true;
        pthread_cond_broadcast(&fx_cv);
        while (fx_pause_id == r->id)
            pthread_cond_wait(&fx_cv, &fx_mu);
    }
    pthread_mutex_unlock(&fx_mu);
}

void fx_pause_at(uint64_t id, size_t n_events)
{
    pthread_mutex_lock(&fx_mu);
    fx_paused = false;
    fx_pause_events = n_events;
    fx_pause_id = id;
    pthread_cond_broadcast(&fx_cv); /* releases a pause on another request */
    pthread_mutex_unlock(&fx_mu);
}

void fx_wait_paused(void)
{
    pthread_mutex_lock(&fx_mu);
    while (!fx_paused)
        pthread_cond_wait(&fx_cv, &fx_mu);
    pthread_mutex_unlock(&fx_mu);
}

void fx_resume(void)
{
    pthread_mutex_lock(&fx_mu);
    fx_pause_id = 0;
    fx_paused = false;
    pthread_cond_broadcast(&fx_cv);
    pthread_mutex_unlock(&fx_mu);
}

static void sink_done(void *ud, const struct sched_req *r)
{
    (void)ud;
    if (r->id >= FX_MAX_REQ)
        return;
    pthread_mutex_lock(&fx_mu);
    struct fx_result *x = &fx_res[r->id];
    x->finish = r->finish;
    x->err = r->err.code;
    snprintf(x->msg, sizeof(x->msg), "%s", r->err.message);
    x->n = 0;
    for (size_t i = r->n_prompt; i < r->n_toks && x->n < FX_MAX_TOK; i++)
        x->toks[x->n++] = r->toks[i];
    x->prompt = r->n_prompt;
    x->cached = r->n_cached;
    x->completion = r->n_toks - r->n_prompt;
    x->seq_returned = r->seq_returned;
    x->seq = r->seq;
    x->order = ++fx_order;
    x->done = true;
    pthread_cond_broadcast(&fx_cv);
    pthread_mutex_unlock(&fx_mu);
}

uint32_t fx_queue_timeout_ms;
struct spec_conf fx_spec;
const char *fx_draft_path;
uint32_t fx_draft_blocks = 256;
enum exec_overlap fx_overlap;

int fx_open(struct fx *f, struct fx_model *fm, uint32_t device_blocks, uint32_t host_blocks,
            uint32_t step_tokens, uint32_t max_seqs)
{
    struct kvd_error err = {0};
    memset(f, 0, sizeof(*f));
    f->model = fm;
    if (backend_cpu_new(&f->be))
        return -1;
    if (!f->be->compute)
        f->be->compute = compute_cpu_ops();
    struct model_opts mo = {.n_threads = 2};
    if (model_load_opts(fm->path, f->be, &mo, &f->m, &err)) {
        fprintf(stderr, "model_load: %s\n", err.message);
        return -1;
    }
    struct kvmm_config kc = {
        .n_device_blocks = device_blocks, .n_host_blocks = host_blocks, .be = f->be};
    model_kv_geom(f->m, 16, KV_F16, &kc.geom);
    if (kvmm_new(&kc, &f->mm))
        return -1;
    struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1};
    snprintf(tc.name, sizeof(tc.name), "test");
    kvmm_lock(f->mm);
    int rc = kvmm_tenant_set(f->mm, &tc, &f->tenant);
    if (!rc)
        rc = kvmm_tenant_namespace(f->mm, f->tenant, &f->ns);
    kvmm_unlock(f->mm);
    if (rc)
        return -1;
    struct exec_conf ec = {.step_tokens = step_tokens,
                           .max_seqs = max_seqs,
                           .queue_timeout_ms = fx_queue_timeout_ms,
                           .spec = fx_spec,
                           .overlap = fx_overlap};
    if (fx_draft_path) {
        struct draft_conf dc = {.path = fx_draft_path,
                                .target_path = fm->path,
                                .target = model_hparams(f->m),
                                .be = f->be,
                                .n_threads = 2,
                                .block_tokens = 16,
                                .dtype = KV_F16,
                                .max_seqs = fx_spec.max_batch ? fx_spec.max_batch : 4,
                                .step_tokens = step_tokens};
        if (draft_open(&dc, &f->draft, &err) ||
            draft_kv_open(f->draft, NULL, (size_t)fx_draft_blocks * draft_block_bytes(f->draft),
                          &err)) {
            fprintf(stderr, "draft: %s\n", err.message);
            draft_free(f->draft);
            f->draft = NULL;
            return -1;
        }
        ec.draft = f->draft; /* the executor's from here on (f->draft: borrowed) */
    }
    if (exec_new(f->mm, f->m, &ec, &f->ex, &err)) {
        fprintf(stderr, "exec_new: %s\n", err.message);
        return -1;
    }
    fx_reset_results();
    return 0;
}

void fx_close(struct fx *f)
{
    exec_free(f->ex); /* and its draft */
    kvmm_free(f->mm);
    model_free(f->m);
    backend_free(f->be);
    memset(f, 0, sizeof(*f));
}

int fx_setup(void **state)
{
    *state = calloc(1, sizeof(struct fx));
    return *state ? 0 : -1;
}

int fx_teardown(void **state)
{
    struct fx *f = *state;
    if (f) {
        fx_close(f); /* every part may be NULL: a closed or half-opened fixture */
        free(f);
    }
    return 0;
}

void fx_reset_results(void)
{
    pthread_mutex_lock(&fx_mu);
    memset(fx_res, 0, sizeof(fx_res));
    fx_order = 0;
    pthread_mutex_unlock(&fx_mu);
}

struct fx_result *fx_result(uint64_t id)
{
    return &fx_res[id];
}

struct fx_result *fx_wait(uint64_t id)
{
    pthread_mutex_lock(&fx_mu);
    while (!fx_res[id].done)
        pthread_cond_wait(&fx_cv, &fx_mu);
    pthread_mutex_unlock(&fx_mu);
    return &fx_res[id];
}

struct fx_result fx_run1(struct fx *f, uint64_t id, const struct fx_gen *g)
{
    struct kvd_error err = {0};
    if (fx_submit(f, id, g, &err))
        fail_msg("submit %llu: %s", (unsigned long long)id, err.message);
    return *fx_wait(id);
}

void fx_wait_idle(struct fx *f)
{
    struct exec_stats st;
    for (;;) {
        exec_stats(f->ex, &st);
        if (st.live == 0)
            return;
        usleep(1000);
    }
}

void fx_assert_mm_clean(struct fx *f, uint32_t seqs)
{
    struct kvmm_stats st;
    kvmm_lock(f->mm);
    kvmm_stats(f->mm, &st);
    int rc = kvmm_check(f->mm);
    if (rc)
        fail_msg("kvmm_check: %s", kvmm_errmsg(f->mm));
    kvmm_unlock(f->mm);
    assert_int_equal(st.n_seqs, seqs);
    assert_int_equal(st.device_used, 0);
}

int fx_tenant(struct fx *f, const char *name, uint32_t weight, uint32_t *tenant, uint32_t *ns)
{
    struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = weight};
    snprintf(tc.name, sizeof(tc.name), "%s", name);
    kvmm_lock(f->mm);
    int rc = kvmm_tenant_set(f->mm, &tc, tenant);
    if (!rc)
        rc = kvmm_tenant_namespace(f->mm, *tenant, ns);
    kvmm_unlock(f->mm);
    return rc;
}

static const struct exec_sink fx_sink = {.tokens = sink_tokens, .done = sink_done};

static int build(struct fx *f, const struct fx_gen *g, uint64_t conn, uint64_t id, const void *map,
                 size_t len, struct sched_req **out, struct kvd_error *err)
{
    struct proto_msg m;
    int rc = proto_msg_parse(&m, map, len, err);
    if (rc)
        return rc;
    struct gen_caller c = {
        .conn = conn, .id = id, .tenant = f->tenant, .ns = f->ns, .sink = &fx_sink};
    if (g && g->has_tenant) {
        c.tenant = g->tenant;
        c.ns = g->ns;
    }
    rc = ops_generate_build(f->ex, f->mm, m.root, &c, NULL, out, err);
    proto_msg_free(&m);
    return rc;
}

int fx_submit(struct fx *f, uint64_t id, const struct fx_gen *g, struct kvd_error *err)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t n = 2 + !g->no_tokens + (g->max_tokens > 0) + (g->temperature >= 0) + (g->top_k > 0) +
               (g->top_p > 0) + g->has_seed + (g->n_stop > 0) + g->stream + (g->priority != 0) +
               g->has_seq + (g->speculative != NULL);
    msgpack_pack_map(&pk, n);
    proto_pack_kv_str(&pk, "op", "generate");
    proto_pack_kv_uint(&pk, "id", id);
    if (!g->no_tokens)
        proto_pack_kv_u32_array(&pk, "tokens", g->toks, g->n_toks);
    if (g->max_tokens > 0)
        proto_pack_kv_uint(&pk, "max_tokens", g->max_tokens);
    if (g->temperature >= 0)
        proto_pack_kv_double(&pk, "temperature", g->temperature);
    if (g->top_k > 0)
        proto_pack_kv_uint(&pk, "top_k", g->top_k);
    if (g->top_p > 0)
        proto_pack_kv_double(&pk, "top_p", g->top_p);
    if (g->has_seed)
        proto_pack_kv_uint(&pk, "seed", g->seed);
    if (g->n_stop > 0)
        proto_pack_kv_u32_array(&pk, "stop", g->stop, g->n_stop);
    if (g->stream)
        proto_pack_kv_bool(&pk, "stream", true);
    if (g->priority != 0)
        proto_pack_kv_int(&pk, "priority", g->priority);
    if (g->has_seq)
        proto_pack_kv_uint(&pk, "seq", g->seq);
    if (g->speculative)
        proto_pack_kv_str(&pk, "speculative", g->speculative);
    struct sched_req *r = NULL;
    int rc = build(f, g, g->conn ? g->conn : 1, id, sb.data, sb.size, &r, err);
    msgpack_sbuffer_destroy(&sb);
    if (rc)
        return rc;
    rc = exec_submit(f->ex, r);
    if (rc)
        gen_request_discard(f->mm, r);
    return rc;
}

int fx_build_raw(struct fx *f, const void *map, size_t len, struct kvd_error *err)
{
    struct sched_req *r = NULL;
    int rc = build(f, NULL, 1, 1, map, len, &r, err);
    if (rc == 0)
        gen_request_discard(f->mm, r);
    return rc;
}

void fx_prompt(uint32_t *p, size_t n, uint32_t salt)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint32_t)((i * 37 + salt * 101 + 11) % 256);
}
