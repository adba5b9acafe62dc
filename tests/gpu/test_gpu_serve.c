/* The whole daemon on the cuda backend: `kvd --backend cuda` (on a GPU, or
 * on the CPU in the emulation build) serves generate requests with the cpu
 * backend's greedy tokens. Two daemons on one random model, the default
 * start-up (the cuda one without the roofline probe, which the emulator
 * runs for longer than the harness waits on a loaded machine), CUDA graphs
 * on: cold prompts, prompts that hit the prefix cache, and prompts long
 * enough for the cuBLAS path on f32 weights; f16 weights with prompts of at
 * most 8 tokens (both backends then do f32 math); f32 weights over a q8_0 KV cache (both backends
 * store the same quantized rows). And the sampler chain: seeded requests with every stage on
 * (logit_bias, the penalties, min_p, typical_p, temperature, top_k, top_p; picked on the host from
 * the downloaded logits) and with the sample op's stages only (temperature, top_k, top_p;
 * kernels/sample.cu against the cpu's sampler_pick) pick the cpu's tokens on the f32 model, whose
 * logits agree to rounding, and their logprobs agree within 1e-4. The overlap (the next decode
 * step planned while the device runs one, on by default on cuda): a batch of greedy and seeded
 * requests ending at different steps (max_tokens, a stop token) gives the same tokens with it on
 * and off, and the steps planned ahead are counted. Skips (77) without a usable CUDA device. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend.h"
#include "gpu/gpu_fixture.h"
#include "kvd_harness.h"

#define NGEN 24

static char g_dir[64];

static void gen_model(const char *path, const char *type)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "'%s/kvd-gguf-gen' -o '%s' --layers 2 --embd 128 --heads 4 --kv-heads 2 --ff 256 "
             "--vocab 512 --ctx 512 --type %s --seed 21 >/dev/null",
             getenv("KVD_TOOLS_DIR"), path, type);
    assert_int_equal(system(cmd), 0);
}

/* overlap: NULL (the default), or --overlap's value */
static void start_ov(struct kh_proc *p, const char *model, const char *backend,
                     const char *kv_dtype, const char *overlap)
{
    /* the cuda daemon without the roofline probe: on the emulator it can
     * outlast the harness's 30 s wait for READY on a loaded machine */
    const char *args[14] = {"--model",       model, "--backend",  backend, "--device-blocks", "128",
                            "--host-blocks", "32",  "--kv-dtype", kv_dtype};
    int n = 10;
    if (strcmp(backend, "cuda") == 0)
        args[n++] = "--no-roofline-probe";
    if (overlap) {
        args[n++] = "--overlap";
        args[n++] = overlap;
    }
    assert_int_equal(kh_start(p, NULL, args), 0);
}

static void start(struct kh_proc *p, const char *model, const char *backend, const char *kv_dtype)
{
    start_ov(p, model, backend, kv_dtype, NULL);
}

/* Greedy completion of prompt p (n tokens) on the daemon at sock. */
static void complete(const char *sock, const uint32_t *p, size_t n, uint32_t *out)
{
    int fd = kh_connect(sock);
    assert_true(fd >= 0);
    struct kh_req r;
    kh_req_begin(&r, "generate", 1, 2);
    proto_pack_kv_u32_array(&r.pk, "tokens", p, n);
    proto_pack_kv_uint(&r.pk, "max_tokens", NGEN);
    assert_int_equal(kh_req_send(fd, &r), 0);
    struct kh_reply rep;
    assert_int_equal(kh_recv(fd, &rep), 0);
    if (rep.code != 0)
        fail_msg("generate on %s: error %d: %s", sock, rep.code, rep.message);
    const msgpack_object *a = kh_obj(rep.root, "tokens");
    assert_non_null(a);
    assert_int_equal(a->via.array.size, NGEN);
    for (uint32_t i = 0; i < NGEN; i++)
        out[i] = (uint32_t)a->via.array.ptr[i].via.u64;
    kh_reply_free(&rep);
    close(fd);
}

/* A seeded sampled request: the sample op's stages, and with `chain`
 * every host-only stage too. */
struct chain_req {
    double temperature, top_p, min_p, typical_p, repeat_penalty, presence, frequency;
    uint32_t top_k, repeat_last_n;
    bool chain;
};

#define N_LP 5

/* Sampled completion of p with seed, its tokens and, per token, its
 * logprob then the N_LP top logprobs (most likely first). */
static void sample(const char *sock, const uint32_t *p, size_t n, const struct chain_req *c,
                   uint64_t seed, uint32_t *out, double (*lp)[1 + N_LP])
{
    int fd = kh_connect(sock);
    assert_true(fd >= 0);
    struct kh_req r;
    kh_req_begin(&r, "generate", 1, c->chain ? 15 : 8);
    proto_pack_kv_u32_array(&r.pk, "tokens", p, n);
    proto_pack_kv_uint(&r.pk, "max_tokens", NGEN);
    proto_pack_kv_bool(&r.pk, "ignore_eos", true);
    proto_pack_kv_uint(&r.pk, "logprobs", N_LP);
    proto_pack_kv_uint(&r.pk, "seed", seed);
    proto_pack_kv_double(&r.pk, "temperature", c->temperature);
    proto_pack_kv_uint(&r.pk, "top_k", c->top_k);
    proto_pack_kv_double(&r.pk, "top_p", c->top_p);
    if (c->chain) {
        proto_pack_kv_double(&r.pk, "min_p", c->min_p);
        proto_pack_kv_double(&r.pk, "typical_p", c->typical_p);
        proto_pack_kv_double(&r.pk, "repeat_penalty", c->repeat_penalty);
        proto_pack_kv_uint(&r.pk, "repeat_last_n", c->repeat_last_n);
        proto_pack_kv_double(&r.pk, "presence_penalty", c->presence);
        proto_pack_kv_double(&r.pk, "frequency_penalty", c->frequency);
        /* a bonus for one token, another banned */
        proto_pack_str(&r.pk, "logit_bias");
        proto_pack_map(&r.pk, 2);
        msgpack_pack_uint32(&r.pk, 17);
        msgpack_pack_double(&r.pk, 2.5);
        msgpack_pack_uint32(&r.pk, p[n - 1]);
        msgpack_pack_double(&r.pk, -100);
    }
    assert_int_equal(kh_req_send(fd, &r), 0);
    struct kh_reply rep;
    assert_int_equal(kh_recv(fd, &rep), 0);
    if (rep.code != 0)
        fail_msg("generate on %s: error %d: %s", sock, rep.code, rep.message);
    const msgpack_object *a = kh_obj(rep.root, "tokens"), *l = kh_obj(rep.root, "logprobs");
    assert_int_equal(a->via.array.size, NGEN);
    assert_int_equal(l->via.array.size, NGEN);
    for (uint32_t i = 0; i < NGEN; i++) {
        out[i] = (uint32_t)a->via.array.ptr[i].via.u64;
        const msgpack_object *e = &l->via.array.ptr[i], *top = kh_obj(e, "top");
        lp[i][0] = kh_obj(e, "logprob")->via.f64;
        assert_int_equal(top->via.array.size, N_LP);
        for (uint32_t k = 0; k < N_LP; k++)
            lp[i][1 + k] = top->via.array.ptr[k].via.array.ptr[1].via.f64;
    }
    kh_reply_free(&rep);
    close(fd);
}

/* The same seeded requests on both daemons: the same tokens, and logprobs
 * within 1e-4 (compared by rank, so a near-tie may order two ids either
 * way). */
static void same_choices(const char *cpu, const char *cuda, const uint32_t *base)
{
    static const struct chain_req reqs[] = {
        {.temperature = 0.9,
         .top_k = 40,
         .top_p = 0.95,
         .min_p = 0.05,
         .typical_p = 0.9,
         .repeat_penalty = 1.3,
         .repeat_last_n = 16,
         .presence = 0.4,
         .frequency = 0.3,
         .chain = true},
        {.temperature = 1.5,
         .top_k = 0,
         .top_p = 0.8,
         .min_p = 0.1,
         .typical_p = 0.95,
         .repeat_penalty = 0.9,
         .repeat_last_n = 64,
         .presence = -0.2,
         .frequency = 0.5,
         .chain = true},
        {.temperature = 0.7, .top_k = 20, .top_p = 0.9},
        {.temperature = 1.2, .top_k = 0, .top_p = 1.0},
    };
    for (size_t q = 0; q < sizeof reqs / sizeof reqs[0]; q++)
        for (uint32_t len = 3; len <= 13; len += 10) {
            uint64_t seed = 1000 + q * 10 + len;
            uint32_t a[NGEN], b[NGEN];
            double la[NGEN][1 + N_LP], lb[NGEN][1 + N_LP];
            sample(cpu, base, len, &reqs[q], seed, a, la);
            sample(cuda, base, len, &reqs[q], seed, b, lb);
            for (int i = 0; i < NGEN; i++) {
                if (a[i] != b[i])
                    fail_msg("request %zu, prompt of %u, seed %llu: token %d: cuda %u, cpu %u", q,
                             len, (unsigned long long)seed, i, b[i], a[i]);
                for (int k = 0; k <= N_LP; k++)
                    if (!(fabs(la[i][k] - lb[i][k]) <= 1e-4))
                        fail_msg("request %zu, prompt of %u: token %d: logprob %d: cuda %.7f, cpu "
                                 "%.7f",
                                 q, len, i, k, lb[i][k], la[i][k]);
            }
        }
}

static void backend_name_is(const char *sock, const char *want)
{
    int fd = kh_connect(sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 1, &r), 0);
    const msgpack_object *b = kh_obj(r.root, "backend");
    assert_non_null(b);
    assert_true(b->via.str.size == strlen(want) && !memcmp(b->via.str.ptr, want, strlen(want)));
    kh_reply_free(&r);
    close(fd);
}

/* stats: the cuda daemon counts the kernels of its last decode step (at
 * most 7 per layer with the fused ops (6, one more where v's type differs
 * from q and k's), plus the embedding, the final norm, the head and the
 * sampler), the cpu daemon none; both give the model's layers. */
static void step_launches_reported(const char *cuda_sock, const char *cpu_sock)
{
    int fd = kh_connect(cuda_sock);
    uint64_t launches = kh_stat(fd, "requests", "step_launches");
    assert_int_equal(kh_stat(fd, "requests", "layers"), 2);
    close(fd);
    printf("# cuda: %llu kernel launches in the last decode step (2 layers)\n",
           (unsigned long long)launches);
    if (launches == 0 || launches > 7 * 2 + 8)
        fail_msg("cuda: %llu kernel launches in the last decode step of a 2-layer model",
                 (unsigned long long)launches);
    fd = kh_connect(cpu_sock);
    assert_int_equal(kh_stat(fd, "requests", "step_launches"), 0);
    assert_int_equal(kh_stat(fd, "requests", "layers"), 2);
    close(fd);
}

/* Greedy tokens equal on both daemons; with `chain`, then the sampler's
 * choices (same_choices). */
static void same_tokens(const char *type, uint32_t max_prompt, const char *kv_dtype, bool chain)
{
    char model[128];
    snprintf(model, sizeof model, "%s/%s.gguf", g_dir, type);
    gen_model(model, type);
    struct kh_proc cpu, cuda;
    start(&cpu, model, "cpu", kv_dtype);
    start(&cuda, model, "cuda", kv_dtype);
    backend_name_is(cuda.sock, "cuda");
    rnd_seed(31);
    uint32_t base[24];
    for (int i = 0; i < 24; i++)
        base[i] = rnd_u32(512);
    for (uint32_t len = 1; len <= max_prompt; len += max_prompt > 8 ? 5 : 2) {
        /* twice each: cold, then from the prefix cache */
        for (int k = 0; k < 2; k++) {
            uint32_t a[NGEN], b[NGEN];
            complete(cpu.sock, base, len, a);
            complete(cuda.sock, base, len, b);
            for (int i = 0; i < NGEN; i++)
                if (a[i] != b[i])
                    fail_msg("%s model, %s KV, prompt of %u (%s): token %d: cuda %u, cpu %u", type,
                             kv_dtype, len, k ? "cached" : "cold", i, b[i], a[i]);
        }
    }
    step_launches_reported(cuda.sock, cpu.sock);
    if (chain)
        same_choices(cpu.sock, cuda.sock, base);
    assert_int_equal(kh_stop(&cuda), 0);
    assert_int_equal(kh_stop(&cpu), 0);
    unlink(model);
}

static void test_f32_model(void **state)
{
    same_tokens("f32", 21, "f16", true);
}

static void test_f16_model(void **state)
{
    same_tokens("f16", 8, "f16", false);
}

static void test_f32_model_q8_0_kv(void **state)
{
    same_tokens("f32", 21, "q8_0", false);
}

#define N_OV 6

/* N_OV concurrent requests on their own connections (request q: prompt
 * base[0..3+2q), max_tokens 4 + 4q; q odd: seeded sampling with the sample
 * op's stages; request 2 stops at `stop` when not 0), their tokens. */
static void ov_batch(const char *sock, const uint32_t *base, uint32_t stop,
                     uint32_t out[N_OV][NGEN], uint32_t n_out[N_OV])
{
    int fds[N_OV];
    for (uint32_t q = 0; q < N_OV; q++) {
        fds[q] = kh_connect(sock);
        assert_true(fds[q] >= 0);
        struct kh_req r;
        bool sampled = q % 2, stops = q == 2 && stop;
        kh_req_begin(&r, "generate", 1 + q, 3 + (sampled ? 4 : 0) + (stops ? 1 : 0));
        proto_pack_kv_u32_array(&r.pk, "tokens", base, 3 + 2 * q);
        proto_pack_kv_uint(&r.pk, "max_tokens", 4 + 4 * q);
        proto_pack_kv_bool(&r.pk, "ignore_eos", true);
        if (sampled) {
            proto_pack_kv_uint(&r.pk, "seed", 77 + q);
            proto_pack_kv_double(&r.pk, "temperature", 1.1);
            proto_pack_kv_uint(&r.pk, "top_k", 40);
            proto_pack_kv_double(&r.pk, "top_p", 0.9);
        }
        if (stops) {
            proto_pack_str(&r.pk, "stop");
            msgpack_pack_array(&r.pk, 1);
            msgpack_pack_uint32(&r.pk, stop);
        }
        assert_int_equal(kh_req_send(fds[q], &r), 0);
    }
    for (uint32_t q = 0; q < N_OV; q++) {
        struct kh_reply rep;
        assert_int_equal(kh_recv(fds[q], &rep), 0);
        if (rep.code != 0)
            fail_msg("generate %u on %s: error %d: %s", q, sock, rep.code, rep.message);
        const msgpack_object *a = kh_obj(rep.root, "tokens");
        n_out[q] = a->via.array.size;
        assert_true(n_out[q] <= NGEN);
        for (uint32_t i = 0; i < n_out[q]; i++)
            out[q][i] = (uint32_t)a->via.array.ptr[i].via.u64;
        kh_reply_free(&rep);
        close(fds[q]);
    }
}

/* The overlap on (the cuda default) and off: the same tokens for a batch
 * whose requests end at different steps, one at a stop token mid-batch. */
static void test_overlap_same_tokens(void **state)
{
    char model[128];
    snprintf(model, sizeof model, "%s/ov.gguf", g_dir);
    gen_model(model, "f32");
    struct kh_proc on, off;
    start_ov(&on, model, "cuda", "f16", NULL);
    start_ov(&off, model, "cuda", "f16", "off");
    rnd_seed(41);
    uint32_t base[24];
    for (int i = 0; i < 24; i++)
        base[i] = rnd_u32(512);
    static uint32_t a[N_OV][NGEN], b[N_OV][NGEN];
    uint32_t na[N_OV], nb[N_OV];
    for (int pass = 0; pass < 2; pass++) {
        /* pass 1: request 2 (12 tokens) stops at its 7th token */
        uint32_t stop = pass ? a[2][6] : 0;
        ov_batch(off.sock, base, stop, a, na);
        ov_batch(on.sock, base, stop, b, nb);
        for (uint32_t q = 0; q < N_OV; q++) {
            assert_int_equal(na[q], nb[q]);
            for (uint32_t i = 0; i < na[q]; i++)
                if (a[q][i] != b[q][i])
                    fail_msg("pass %d, request %u: token %u: overlap %u, without %u", pass, q, i,
                             b[q][i], a[q][i]);
            if (!(pass && q == 2))
                assert_int_equal(na[q], 4 + 4 * q);
        }
        if (pass)
            assert_true(na[2] <= 7);
    }
    int fd = kh_connect(on.sock);
    uint64_t ov = kh_stat(fd, "requests", "overlapped_steps");
    close(fd);
    fd = kh_connect(off.sock);
    assert_int_equal(kh_stat(fd, "requests", "overlapped_steps"), 0);
    close(fd);
    printf("# cuda: %llu steps planned ahead\n", (unsigned long long)ov);
    assert_true(ov > 0 && ov != UINT64_MAX);
    assert_int_equal(kh_stop(&on), 0);
    assert_int_equal(kh_stop(&off), 0);
    unlink(model);
}

int main(void)
{
    struct backend *be = NULL;
    struct kvd_error err = {0};
    if (backend_cuda_new(0, &be, &err)) {
        printf("SKIP: no usable CUDA device: %s\n", err.message);
        return GPU_SKIP;
    }
    backend_free(be);
    if (!getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "KVD_TOOLS_DIR not set (run through ctest)\n");
        return 1;
    }
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-gpuserve-XXXXXX");
    if (!mkdtemp(g_dir))
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f32_model),
        cmocka_unit_test(test_f16_model),
        cmocka_unit_test(test_f32_model_q8_0_kv),
        cmocka_unit_test(test_overlap_same_tokens),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    rmdir(g_dir);
    return rc;
}
