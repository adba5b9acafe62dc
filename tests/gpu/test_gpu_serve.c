/* The whole daemon on the cuda backend: `kvd --backend cuda` (on a GPU, or
 * on the CPU in the emulation build) serves generate requests with the cpu
 * backend's greedy tokens. Two daemons on one random model, the default
 * start-up (roofline probe included), CUDA graphs on: cold prompts, prompts
 * that hit the prefix cache, and prompts long enough for the cuBLAS path on
 * f32 weights; f16 weights with prompts of at most 8 tokens (both backends
 * then do f32 math); f32 weights over a q8_0 KV cache (both backends store
 * the same quantized rows). Skips (77) without a usable CUDA device. */
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

static void start(struct kh_proc *p, const char *model, const char *backend, const char *kv_dtype)
{
    const char *args[] = {"--model", model,           "--backend", backend,      "--device-blocks",
                          "128",     "--host-blocks", "32",        "--kv-dtype", kv_dtype,
                          NULL};
    assert_int_equal(kh_start(p, NULL, args), 0);
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
 * most 8 per layer with the fused ops, plus the embedding, the final norm,
 * the head and the sampler), the cpu daemon none; both give the model's
 * layers. */
static void step_launches_reported(const char *cuda_sock, const char *cpu_sock)
{
    int fd = kh_connect(cuda_sock);
    uint64_t launches = kh_stat(fd, "requests", "step_launches");
    assert_int_equal(kh_stat(fd, "requests", "layers"), 2);
    close(fd);
    printf("# cuda: %llu kernel launches in the last decode step (2 layers)\n",
           (unsigned long long)launches);
    if (launches == 0 || launches > 8 * 2 + 8)
        fail_msg("cuda: %llu kernel launches in the last decode step of a 2-layer model",
                 (unsigned long long)launches);
    fd = kh_connect(cpu_sock);
    assert_int_equal(kh_stat(fd, "requests", "step_launches"), 0);
    assert_int_equal(kh_stat(fd, "requests", "layers"), 2);
    close(fd);
}

static void same_tokens(const char *type, uint32_t max_prompt, const char *kv_dtype)
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
    assert_int_equal(kh_stop(&cuda), 0);
    assert_int_equal(kh_stop(&cpu), 0);
    unlink(model);
}

static void test_f32_model(void **state)
{
    same_tokens("f32", 21, "f16");
}

static void test_f16_model(void **state)
{
    same_tokens("f16", 8, "f16");
}

static void test_f32_model_q8_0_kv(void **state)
{
    same_tokens("f32", 21, "q8_0");
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
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    rmdir(g_dir);
    return rc;
}
