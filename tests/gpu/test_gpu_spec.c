/* Speculative decoding's verification on the cuda backend (on a GPU, or on
 * the CPU in the emulation build) and on the cpu backend: the rows of a
 * verification, computed in one step beside a decode and a prefill chunk of
 * other sequences, give bit for bit the logits and the K/V that one-token
 * decode steps of those positions give alone (batch-invariant rows: the
 * GEMV in chunks of 8, the decode attention per row); then the whole
 * daemon on cuda: greedy output with n-gram speculation, and with a draft
 * model whose KV takes pages of the device budget, equals plain greedy
 * output. Skips (77) without a usable CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/gpu_fixture.h"
#include "kvd/status.h"
#include "kvd_harness.h"
#include "model.h"
#include "model/model_ref.h"
#include "model_impl.h"

#define BT 16
#define BPS 4  /* blocks per sequence: 64 positions */
#define NSEQ 4 /* sequences an arena holds */
#define PLEN 9 /* prompt of the verified sequence */
#define STEPS 8

static struct backend *cuda_be, *cpu_be;

struct runner {
    struct backend *be;
    struct model *m;
    struct fwd_ctx *fc;
    struct kv_geom g;
    void *arena;
    size_t arena_bytes;
    uint32_t V;
};

static void runner_open(struct runner *r, struct backend *be, const char *path, enum kv_dtype kvt)
{
    struct kvd_error err = {0};
    memset(r, 0, sizeof *r);
    r->be = be;
    if (model_load(path, be, &r->m, &err))
        fail_msg("model_load on %s: %s", be->ops->name, err.message);
    r->V = model_hparams(r->m)->n_vocab;
    model_kv_geom(r->m, BT, kvt, &r->g);
    r->arena_bytes = kv_block_bytes(&r->g) * NSEQ * BPS;
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_DEVICE, r->arena_bytes, &r->arena), 0);
    assert_int_equal(fwd_ctx_new_out(r->m, 64, NSEQ, 32, &r->fc), 0);
}

static void runner_close(struct runner *r)
{
    fwd_ctx_free(r->fc);
    r->be->ops->arena_free(r->be, KVD_TIER_DEVICE, r->arena, r->arena_bytes);
    model_free(r->m);
}

static void slots_of(uint32_t s, uint32_t *slots)
{
    for (uint32_t i = 0; i < BPS; i++) /* scattered */
        slots[i] = (uint32_t)(NSEQ * BPS - 1 - (i * NSEQ + s));
}

static void step(struct runner *r, struct fwd_seq *seqs, uint32_t n, bool inv, float *logits,
                 uint32_t *picks, struct sample_row *rows)
{
    struct fwd_batch b = {.seqs = seqs,
                          .n_seqs = n,
                          .kv_arena = r->arena,
                          .geom = &r->g,
                          .n_arena_slots = NSEQ * BPS,
                          .logits = logits,
                          .sample = rows,
                          .tokens = picks,
                          .invariant = inv};
    if (model_forward(r->m, r->fc, &b))
        fail_msg("model_forward on %s: %s", r->be->ops->name, fwd_ctx_errmsg(r->fc));
}

/* One K or V row of position p of the sequence with these slots. */
static const uint8_t *kv_row(const struct runner *r, const uint8_t *arena, const uint32_t *slots,
                             uint32_t layer, uint32_t kv, uint32_t head, uint32_t p)
{
    size_t rb = kv_row_bytes(r->g.dtype, r->g.head_dim);
    size_t off = (((size_t)layer * 2 + kv) * r->g.kv_heads + head) * BT * rb + (p % BT) * rb;
    return arena + (size_t)slots[p / BT] * kv_block_bytes(&r->g) + off;
}

static uint8_t *arena_get(struct runner *r)
{
    uint8_t *h = malloc(r->arena_bytes);
    assert_non_null(h);
    assert_int_equal(r->m->ops->download(r->m->cx, h, r->arena, r->arena_bytes), 0);
    return h;
}

static void arena_zero(struct runner *r)
{
    void *z = calloc(1, r->arena_bytes);
    assert_non_null(z);
    assert_int_equal(r->m->ops->upload(r->m->cx, r->arena, z, r->arena_bytes), 0);
    free(z);
}

/* Sequence 0 alone: its prompt, then STEPS one-token greedy decodes; every
 * step's logits and pick (the step's token) and the K/V at the end. */
static uint8_t *plain(struct runner *r, const uint32_t *prompt, float *lg, uint32_t *toks)
{
    uint32_t slots[BPS], tok, pos = 0;
    slots_of(0, slots);
    arena_zero(r);
    struct sample_row row = {.top_p = 1.0f};
    for (uint32_t s = 0; s <= STEPS; s++) {
        struct fwd_seq q = {.tokens = s ? &tok : prompt,
                            .n_tokens = s ? 1 : PLEN,
                            .pos0 = pos,
                            .slots = slots,
                            .n_slots = BPS};
        step(r, &q, 1, false, lg + (size_t)s * r->V, &toks[s], &row);
        pos += q.n_tokens;
        tok = toks[s];
    }
    return arena_get(r);
}

/* The prompt, then a verification of the plain tokens toks[0..k] (the
 * last sampled one and k "drafts") as rows of one step after n_other
 * decodes and with a prefill chunk of another sequence; every row's logits
 * and pick must be plain decoding's, and so must the K/V. With two
 * verifications (k each) the step has more than 8 decode rows. */
static void verify(struct runner *r, const uint32_t *prompt, const float *plg,
                   const uint32_t *ptoks, const uint8_t *parena, uint32_t k, int two,
                   const char *what)
{
    uint32_t slots[NSEQ][BPS];
    for (uint32_t s = 0; s < NSEQ; s++)
        slots_of(s, slots[s]);
    arena_zero(r);
    float *lg = malloc((size_t)32 * r->V * sizeof(float));
    uint32_t picks[32], other[PLEN + 6];
    struct sample_row rows[32];
    for (uint32_t i = 0; i < 32; i++)
        rows[i] = (struct sample_row){.top_p = 1.0f};
    for (uint32_t i = 0; i < PLEN + 6; i++)
        other[i] = (prompt[i % PLEN] * 7 + i) % r->V;
    /* prompts, each sequence alone as plain decoding's was: sequence 0
     * (and 1, the same, when two), and sequence 2's first part (it then
     * has a decode row beside the verification) */
    struct fwd_seq q[NSEQ];
    uint32_t n = 0;
    for (int v = 0; v <= two; v++) {
        q[0] = (struct fwd_seq){
            .tokens = prompt, .n_tokens = PLEN, .pos0 = 0, .slots = slots[v], .n_slots = BPS};
        step(r, q, 1, false, lg, picks, rows);
        assert_int_equal(picks[0], ptoks[0]);
    }
    q[0] = (struct fwd_seq){
        .tokens = other, .n_tokens = 5, .pos0 = 0, .slots = slots[2], .n_slots = BPS};
    step(r, q, 1, false, lg, picks, rows);
    /* the verification step: decodes and verifications first */
    n = 0;
    q[n++] = (struct fwd_seq){.tokens = ptoks,
                              .n_tokens = 1 + k,
                              .pos0 = PLEN,
                              .slots = slots[0],
                              .n_slots = BPS,
                              .all_rows = true};
    if (two)
        q[n++] = (struct fwd_seq){.tokens = ptoks,
                                  .n_tokens = 1 + k,
                                  .pos0 = PLEN,
                                  .slots = slots[1],
                                  .n_slots = BPS,
                                  .all_rows = true};
    q[n++] = (struct fwd_seq){
        .tokens = other + 5, .n_tokens = 1, .pos0 = 5, .slots = slots[2], .n_slots = BPS};
    q[n++] = (struct fwd_seq){
        .tokens = other, .n_tokens = 7, .pos0 = 0, .slots = slots[3], .n_slots = BPS};
    step(r, q, n, true, lg, picks, rows);
    uint8_t *a = arena_get(r);
    for (int v = 0; v <= two; v++)
        for (uint32_t j = 0; j <= k; j++) {
            const float *got = lg + ((size_t)v * (k + 1) + j) * r->V;
            const float *want = plg + (size_t)(j + 1) * r->V;
            if (memcmp(got, want, r->V * sizeof(float))) {
                uint32_t t = 0;
                while (got[t] == want[t])
                    t++;
                fail_msg("%s on %s: verification %d row %u: logit %u is %.9g, plain decoding's "
                         "%.9g",
                         what, r->be->ops->name, v, j, t, (double)got[t], (double)want[t]);
            }
            assert_int_equal(picks[v * (k + 1) + j], ptoks[j + 1]);
        }
    for (int v = 0; v <= two; v++)
        for (uint32_t p = 0; p <= PLEN + k; p++)
            for (uint32_t l = 0; l < r->g.layers; l++)
                for (uint32_t kv = 0; kv < 2; kv++)
                    for (uint32_t h = 0; h < r->g.kv_heads; h++)
                        if (memcmp(kv_row(r, a, slots[v], l, kv, h, p),
                                   kv_row(r, parena, slots[0], l, kv, h, p),
                                   kv_row_bytes(r->g.dtype, r->g.head_dim)))
                            fail_msg("%s on %s: verification %d: %s of position %u layer %u "
                                     "head %u differs from plain decoding's",
                                     what, r->be->ops->name, v, kv ? "V" : "K", p, l, h);
    free(a);
    free(lg);
}

static const struct {
    const char *args;
    enum kv_dtype kvt;
} cases[] = {
    {"--arch llama --layers 2 --embd 128 --heads 4 --kv-heads 2 --ff 256 --vocab 300 "
     "--type f16 --seed 41",
     KV_F16},
    {"--arch llama --layers 2 --embd 256 --heads 4 --kv-heads 2 --ff 256 --vocab 260 "
     "--type q4_k_m --seed 43",
     KV_Q8_0},
};

static void test_verify_rows_are_decode_rows(void **state)
{
    (void)state;
    gpu_emu_order_check(0); /* whole models in three orders: minutes (test_gpu_ops checks) */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char *path = ref_gen_model(cases[c].args);
        assert_non_null(path);
        struct backend *bes[2] = {cpu_be, cuda_be};
        for (int b = 0; b < 2; b++) {
            struct runner r;
            runner_open(&r, bes[b], path, cases[c].kvt);
            uint32_t prompt[PLEN], toks[STEPS + 1];
            rnd_seed(50 + c);
            for (uint32_t i = 0; i < PLEN; i++)
                prompt[i] = rnd_u32(r.V);
            float *lg = malloc((size_t)(STEPS + 1) * r.V * sizeof(float));
            assert_non_null(lg);
            uint8_t *pa = plain(&r, prompt, lg, toks);
            verify(&r, prompt, lg, toks, pa, 4, 0, cases[c].args);
            verify(&r, prompt, lg, toks, pa, 5, 1, cases[c].args); /* 12 + 1 decode rows */
            free(pa);
            free(lg);
            runner_close(&r);
        }
        unlink(path);
        free(path);
    }
    gpu_emu_order_check(1);
}

/* The daemon on cuda: speculation's greedy output (mode "ngram", or
 * "draft" with a draft model made of the model's first layer) is plain's.
 * With a draft, its KV is a pool on the device page budget (the backend's
 * virtual-memory pages): its pages counted in the budget's use beside the
 * model's pool and charges. */
static void daemon_spec_equal(const char *mode)
{
    bool draft = !strcmp(mode, "draft");
    char dir[64], model[128], small[128], cmd[1024];
    snprintf(dir, sizeof dir, "/tmp/kvd-gpuspec-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(model, sizeof model, "%s/m.gguf", dir);
    snprintf(small, sizeof small, "%s/m-small.gguf", dir);
    const char *shape = "--layers 2 --embd 128 --heads 4 --kv-heads 2 --ff 256 --vocab 256 "
                        "--ctx 512 --type f16 --seed 44";
    snprintf(cmd, sizeof cmd,
             "'%s/kvd-gguf-gen' -o '%s' %s >/dev/null && '%s/kvd-gguf-gen' -o '%s' %s "
             "--keep-layers 1 >/dev/null",
             getenv("KVD_TOOLS_DIR"), model, shape, getenv("KVD_TOOLS_DIR"), small, shape);
    assert_int_equal(system(cmd), 0);
    const char *args[] = {"--model",
                          model,
                          "--backend",
                          "cuda",
                          "--device-blocks",
                          "64",
                          "--speculative",
                          mode,
                          "--host-blocks",
                          "0",
                          "--no-roofline-probe",
                          NULL,
                          NULL,
                          NULL};
    if (draft) {
        args[11] = "--draft-model";
        args[12] = small;
    }
    struct kh_proc p;
    assert_int_equal(kh_start(&p, NULL, args), 0);
    enum { N = 3, GEN = 16 };
    uint64_t accepted = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint32_t prompt[24], n = 0;
        for (uint32_t j = 0; j < 8; j++)
            prompt[n++] = (j * 29 + i * 13 + 5) % 256;
        for (uint32_t j = 0; j < 6; j++)
            prompt[n++] = (j * 31 + i * 7 + 1) % 256;
        for (uint32_t j = 0; j < 3; j++)
            prompt[n++] = prompt[j];
        uint32_t out[2][GEN];
        for (int s = 0; s < 2; s++) {
            int fd = kh_connect(p.sock);
            assert_true(fd >= 0);
            struct kh_req r;
            kh_req_begin(&r, "generate", 1, 4);
            proto_pack_kv_u32_array(&r.pk, "tokens", prompt, n);
            proto_pack_kv_bool(&r.pk, "ignore_eos", true);
            proto_pack_kv_uint(&r.pk, "max_tokens", GEN);
            proto_pack_kv_str(&r.pk, "speculative", s ? mode : "off");
            assert_int_equal(kh_req_send(fd, &r), 0);
            struct kh_reply rep;
            assert_int_equal(kh_recv(fd, &rep), 0);
            if (rep.code != 0)
                fail_msg("generate: error %d: %s", rep.code, rep.message);
            const msgpack_object *a = kh_obj(rep.root, "tokens");
            assert_non_null(a);
            assert_int_equal(a->via.array.size, GEN);
            for (uint32_t t = 0; t < GEN; t++)
                out[s][t] = (uint32_t)a->via.array.ptr[t].via.u64;
            kh_reply_free(&rep);
            close(fd);
        }
        for (uint32_t t = 0; t < GEN; t++)
            if (out[0][t] != out[1][t])
                fail_msg("prompt %u token %u: speculative %u, plain %u", i, t, out[1][t],
                         out[0][t]);
    }
    int fd = kh_connect(p.sock);
    struct kh_reply st;
    assert_int_equal(kh_call0(fd, "stats", 1, &st), 0);
    const msgpack_object *req = kh_obj(st.root, "requests");
    assert_non_null(req);
    const msgpack_object *sp = kh_obj(req, "speculative");
    assert_non_null(sp);
    const msgpack_object *acc = kh_obj(sp, "accepted");
    assert_non_null(acc);
    accepted = acc->via.u64;
    if (draft) {
        /* the budget's pages in use: the model's pool, its charges, and
         * its draft's pool, which holds pages now */
        const msgpack_object *m = &kh_obj(st.root, "models")->via.array.ptr[0];
        uint64_t used = kh_u64(kh_obj(st.root, "model_memory"), "device_used");
        uint64_t kv = kh_u64(m, "kv_device_bytes"), ch = kh_u64(m, "charged_device_bytes");
        uint64_t dk = kh_u64(m, "draft_kv_device_bytes");
        printf("cuda daemon: draft KV %llu bytes of pages (cap %llu), model KV %llu, charged "
               "%llu, used %llu\n",
               (unsigned long long)dk, (unsigned long long)kh_u64(m, "draft_kv_max_bytes"),
               (unsigned long long)kv, (unsigned long long)ch, (unsigned long long)used);
        assert_true(dk > 0);
        assert_int_equal(used, kv + ch + dk);
    }
    kh_reply_free(&st);
    close(fd);
    printf("cuda daemon, %s: %llu drafts accepted\n", mode, (unsigned long long)accepted);
    assert_true(accepted > 0);
    assert_int_equal(kh_stop(&p), 0);
    unlink(model);
    unlink(small);
    rmdir(dir);
}

static void test_daemon_ngram_equal(void **state)
{
    (void)state;
    daemon_spec_equal("ngram");
}

static void test_daemon_draft_equal(void **state)
{
    (void)state;
    daemon_spec_equal("draft");
}

int main(void)
{
    struct kvd_error err = {0};
    if (backend_cuda_new(0, &cuda_be, &err)) {
        printf("SKIP: no usable CUDA device: %s\n", err.message);
        return GPU_SKIP;
    }
    if (!getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "KVD_TOOLS_DIR not set (run through ctest)\n");
        return 1;
    }
    cpu_be = ref_cpu_backend();
    if (!cpu_be) {
        fprintf(stderr, "cpu backend failed\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_verify_rows_are_decode_rows),
        GPU_TEST(test_daemon_ngram_equal),
        GPU_TEST(test_daemon_draft_equal),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    backend_free(cuda_be);
    return rc;
}
