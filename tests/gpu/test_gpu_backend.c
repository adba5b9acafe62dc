/* The cuda backend's memory half (backend.h): without a device,
 * backend_cuda_new fails cleanly with KVD_EUNSUPPORTED and a message (what
 * `--backend auto` relies on to fall back to cpu) and the test exits 77;
 * with one, arenas come zero-filled and swaps between the device arena and
 * the pinned host arena are byte-exact, synchronous and asynchronous. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "compute.h"
#include "backend_cuda.h"
#include "gpu/gpu_fixture.h"
#include "kvd/status.h"
#include "kvmm.h"

#define BLOCK (512u << 10) /* a Llama-3.2-1B block: 16 layers x 2 x 8 x 16 x 64 x bf16 */
#define NBLK 64

static struct backend *be;

static void test_zero_filled(void **state)
{
    void *d = NULL, *h = NULL;
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_DEVICE, (size_t)NBLK * BLOCK, &d), 0);
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_HOST, (size_t)NBLK * BLOCK, &h), 0);
    uint8_t *chk = malloc((size_t)NBLK * BLOCK);
    assert_non_null(chk);
    memset(chk, 0xa5, (size_t)NBLK * BLOCK);
    assert_int_equal(
        be->ops->copy(be, chk, KVD_TIER_HOST, d, KVD_TIER_DEVICE, (size_t)NBLK * BLOCK), 0);
    for (size_t i = 0; i < (size_t)NBLK * BLOCK; i++)
        if (chk[i] || ((uint8_t *)h)[i])
            fail_msg("arena byte %zu not zero", i);
    free(chk);
    be->ops->arena_free(be, KVD_TIER_DEVICE, d, (size_t)NBLK * BLOCK);
    be->ops->arena_free(be, KVD_TIER_HOST, h, (size_t)NBLK * BLOCK);
}

/* New KV blocks are zero-filled on the device (a memset on the copy
 * stream), not by a copy of a zeroed host buffer: a block a sequence wrote
 * comes back as zeros to the next sequence, and (on the emulator, which
 * counts what the device runs) allocating blocks costs memsets and no
 * host-to-device copy. */
static void test_new_blocks_zeroed(void **state)
{
    struct kvmm_config cfg = {
        .geom = {.layers = 2, .kv_heads = 2, .head_dim = 64, .block_tokens = 16, .dtype = KV_F16},
        .n_device_blocks = 4,
        .be = be};
    struct kvmm *mm = NULL;
    assert_int_equal(kvmm_new(&cfg, &mm), 0);
    kvmm_lock(mm); /* every kvmm call below runs under it (kvmm.h) */
    struct kvmm_tenant_conf tc = {.name = "t",
                                  .max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = 8,
                                  .weight = 1};
    uint32_t tenant, ns;
    assert_int_equal(kvmm_tenant_set(mm, &tc, &tenant), 0);
    assert_int_equal(kvmm_tenant_namespace(mm, tenant, &ns), 0);
    const size_t tb = kv_token_bytes(&cfg.geom), n = 4 * 16;
    uint8_t *buf = malloc(n * tb), *back = malloc(n * tb);
    assert_non_null(buf);
    assert_non_null(back);
    memset(buf, 0x6b, n * tb);
    kvmm_seq_t s;
    assert_int_equal(kvmm_seq_open(mm, 1, tenant, ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(mm, 1, s, n), 0);
    assert_int_equal(kvmm_seq_write(mm, 1, s, 0, n, buf, n * tb), 0);
    assert_int_equal(kvmm_seq_close(mm, 1, s), 0); /* uncommitted: the blocks are freed */
#ifdef KVD_CUDA_EMULATE
    struct kvd_emu_counts c0, c1;
    kvd_emu_get_counts(&c0);
#endif
    assert_int_equal(kvmm_seq_open(mm, 1, tenant, ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(mm, 1, s, n), 0); /* the same 4 slots again */
#ifdef KVD_CUDA_EMULATE
    kvd_emu_get_counts(&c1);
    assert_int_equal(c1.h2d_copies, c0.h2d_copies);
    assert_int_equal(c1.memsets - c0.memsets, 4);
    assert_int_equal(c1.memset_bytes - c0.memset_bytes, 4 * kvmm_block_bytes(mm));
#endif
    memset(back, 0xee, n * tb);
    assert_int_equal(kvmm_seq_read(mm, 1, s, 0, n, back, n * tb), 0);
    for (size_t i = 0; i < n * tb; i++)
        if (back[i])
            fail_msg("byte %zu of a new block is %#x, not 0", i, back[i]);
    assert_int_equal(kvmm_seq_close(mm, 1, s), 0);
    kvmm_unlock(mm);
    kvmm_free(mm);
    free(buf);
    free(back);
}

/* Blocks out to the host tier and back in a shuffled order, through
 * copy_async + copy_wait, then compared byte for byte. */
static void test_swap_round_trip(void **state)
{
    size_t bytes = (size_t)NBLK * BLOCK;
    uint8_t *d = NULL, *h = NULL, *src = malloc(bytes), *back = malloc(bytes);
    assert_non_null(src);
    assert_non_null(back);
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_DEVICE, bytes, (void **)&d), 0);
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_HOST, bytes, (void **)&h), 0);
    rnd_seed(42);
    for (size_t i = 0; i < bytes; i++)
        src[i] = (uint8_t)rnd_u32(256);
    /* fill the device arena (synchronous copy) */
    assert_int_equal(be->ops->copy(be, d, KVD_TIER_DEVICE, src, KVD_TIER_HOST, bytes), 0);
    /* swap out: device block i -> host slot perm[i], all in flight together */
    uint32_t perm[NBLK];
    for (uint32_t i = 0; i < NBLK; i++)
        perm[i] = i;
    for (uint32_t i = NBLK - 1; i > 0; i--) {
        uint32_t j = rnd_u32(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (uint32_t i = 0; i < NBLK; i++)
        assert_int_equal(be->ops->copy_async(be, h + (size_t)perm[i] * BLOCK, KVD_TIER_HOST,
                                             d + (size_t)i * BLOCK, KVD_TIER_DEVICE, BLOCK),
                         0);
    assert_int_equal(be->ops->copy_wait(be), 0);
    for (uint32_t i = 0; i < NBLK; i++)
        assert_memory_equal(h + (size_t)perm[i] * BLOCK, src + (size_t)i * BLOCK, BLOCK);
    /* wipe the device copy, swap back in to reversed slots */
    uint8_t *zero = calloc(1, bytes);
    assert_int_equal(be->ops->copy(be, d, KVD_TIER_DEVICE, zero, KVD_TIER_HOST, bytes), 0);
    for (uint32_t i = 0; i < NBLK; i++)
        assert_int_equal(be->ops->copy_async(be, d + (size_t)(NBLK - 1 - i) * BLOCK,
                                             KVD_TIER_DEVICE, h + (size_t)perm[i] * BLOCK,
                                             KVD_TIER_HOST, BLOCK),
                         0);
    assert_int_equal(be->ops->copy_wait(be), 0);
    assert_int_equal(be->ops->copy(be, back, KVD_TIER_HOST, d, KVD_TIER_DEVICE, bytes), 0);
    for (uint32_t i = 0; i < NBLK; i++)
        assert_memory_equal(back + (size_t)(NBLK - 1 - i) * BLOCK, src + (size_t)i * BLOCK, BLOCK);
    /* device -> device (copy-on-write of a block) */
    assert_int_equal(be->ops->copy(be, d, KVD_TIER_DEVICE, d + BLOCK, KVD_TIER_DEVICE, BLOCK), 0);
    assert_int_equal(be->ops->copy(be, back, KVD_TIER_HOST, d, KVD_TIER_DEVICE, BLOCK), 0);
    assert_memory_equal(back, src + (size_t)(NBLK - 2) * BLOCK, BLOCK);
    be->ops->arena_free(be, KVD_TIER_DEVICE, d, bytes);
    be->ops->arena_free(be, KVD_TIER_HOST, h, bytes);
    free(src);
    free(back);
    free(zero);
}

/* The cuBLAS workspace used to belong to the compute context created last:
 * freeing that one (the default start-up does: the model's context, then
 * the roofline probe's) left every later GEMM of the others on freed
 * memory, and graphs captured afterwards baked it in. A 9-row F32
 * projection takes the cuBLAS path (SGEMM); the emulator checks the
 * handle's workspace is a live allocation on every call. */
static void test_blas_after_other_ctx_freed(void **state)
{
    const struct compute_ops *o = be->compute;
    struct compute_conf conf = {.n_threads = 1};
    struct compute_ctx *a = NULL, *b = NULL;
    enum { IN = 32, OUT = 16, ROWS = 9 };
    float w[OUT * IN], x[ROWS * IN], y[ROWS * OUT];
    assert_int_equal(o->ctx_new(be, &conf, &a), 0);
    assert_int_equal(o->ctx_new(be, &conf, &b), 0);
    o->ctx_free(b);
    rnd_seed(9);
    rnd_fill(w, OUT * IN, -1, 1);
    rnd_fill(x, ROWS * IN, -1, 1);
    void *dw, *dx, *dy;
    assert_int_equal(o->buf_alloc(a, sizeof w, &dw), 0);
    assert_int_equal(o->buf_alloc(a, sizeof x, &dx), 0);
    assert_int_equal(o->buf_alloc(a, sizeof y, &dy), 0);
    assert_int_equal(o->upload(a, dw, w, sizeof w), 0);
    assert_int_equal(o->upload(a, dx, x, sizeof x), 0);
    struct ctensor t = {.type = CT_F32, .ne0 = IN, .ne1 = OUT, .nbytes = sizeof w, .data = dw};
    assert_int_equal(o->matmul(a, &t, dx, ROWS, dy), 0);
    assert_int_equal(o->download(a, y, dy, sizeof y), 0);
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < OUT; j++) {
            double ref = 0;
            for (int i = 0; i < IN; i++)
                ref += (double)w[j * IN + i] * x[r * IN + i];
            assert_true(fabs(ref - y[r * OUT + j]) < 1e-4);
        }
    o->buf_free(a, dw);
    o->buf_free(a, dx);
    o->buf_free(a, dy);
    o->ctx_free(a);
}

/* A swap queued by another thread (the server's loop) while the executor
 * captures a decode step: the copy must run at once, not be pulled into
 * the capture (which would replay it every step) nor break it. The
 * emulator enforces the capture rules of the real runtime (an event
 * recorded in a capture joins any stream that waits on it; synchronizing
 * on one is refused). The stream order itself (the captured step waits for
 * copies queued during the capture) cannot be observed without a device. */
struct swap_job {
    void *dst, *src;
    size_t bytes;
    int rc;
};

static void *swap_thread(void *arg)
{
    struct swap_job *j = arg;
    j->rc = be->ops->copy(be, j->dst, KVD_TIER_DEVICE, j->src, KVD_TIER_HOST, j->bytes);
    return NULL;
}

static void test_swap_during_capture(void **state)
{
    struct cuda_dev *dev = cuda_backend_dev(be);
    const struct compute_ops *o = be->compute;
    struct compute_conf conf = {.n_threads = 1};
    struct compute_ctx *cx = NULL;
    enum { N = 4096 };
    float a[N], x[N], got[N];
    uint8_t *blk = NULL, *host = NULL, back[BLOCK / 64];
    assert_int_equal(o->ctx_new(be, &conf, &cx), 0);
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_DEVICE, BLOCK, (void **)&blk), 0);
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_HOST, BLOCK, (void **)&host), 0);
    rnd_seed(5);
    for (size_t i = 0; i < BLOCK; i++)
        host[i] = (uint8_t)rnd_u32(256);
    rnd_fill(a, N, -1, 1);
    rnd_fill(x, N, -1, 1);
    float *da, *dx;
    assert_int_equal(o->buf_alloc(cx, sizeof a, (void **)&da), 0);
    assert_int_equal(o->buf_alloc(cx, sizeof x, (void **)&dx), 0);
    assert_int_equal(o->upload(cx, da, a, sizeof a), 0);
    assert_int_equal(o->upload(cx, dx, x, sizeof x), 0);
    assert_int_equal(o->sync(cx), 0);

    assert_int_equal(cuda_dev_wait_copies(dev), 0);
    assert_int_equal(cuda_dev_capture_begin(dev), 0);
    assert_int_equal(o->add(cx, dx, da, N), 0); /* recorded, not run */
    struct swap_job j = {blk, host, BLOCK, -1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, swap_thread, &j), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(j.rc, 0);
    cudaGraph_t graph = NULL;
    assert_int_equal(cuda_dev_capture_end(dev, &graph), 0);
    assert_non_null(graph);
    /* the swap ran while the capture was open */
    assert_int_equal(be->ops->copy(be, back, KVD_TIER_HOST, blk, KVD_TIER_DEVICE, sizeof back), 0);
    assert_memory_equal(back, host, sizeof back);
    cudaGraphExec_t exec = NULL;
    assert_int_equal(cudaGraphInstantiate(&exec, graph, 0), 0);
    cudaGraphDestroy(graph);
    assert_int_equal(cuda_dev_wait_copies(dev), 0);
    for (int r = 0; r < 2; r++) /* replayed twice: x + 2a, and no second swap */
        assert_int_equal(cudaGraphLaunch(exec, dev->compute), 0);
    assert_int_equal(o->download(cx, got, dx, sizeof got), 0);
    for (int i = 0; i < N; i++)
        assert_true(fabsf(got[i] - (x[i] + a[i] + a[i])) < 1e-6f);
    cudaGraphExecDestroy(exec);
    o->buf_free(cx, da);
    o->buf_free(cx, dx);
    be->ops->arena_free(be, KVD_TIER_DEVICE, blk, BLOCK);
    be->ops->arena_free(be, KVD_TIER_HOST, host, BLOCK);
    o->ctx_free(cx);
}

/* Compute capability 8.0 and newer is accepted, older refused with a
 * reason (the emulator can claim any; a real device is what it is). */
static void test_compute_capability(void **state)
{
#ifdef KVD_CUDA_EMULATE
    static const int ok[][2] = {{8, 0}, {8, 6}, {8, 9}, {9, 0}, {10, 0}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        struct backend *b2 = NULL;
        struct kvd_error err = {0};
        kvd_emu_set_cc(ok[i][0], ok[i][1]);
        assert_int_equal(backend_cuda_new(0, &b2, &err), 0);
        backend_free(b2);
    }
    struct backend *b2 = NULL;
    struct kvd_error err = {0};
    kvd_emu_set_cc(7, 5);
    assert_int_equal(backend_cuda_new(0, &b2, &err), KVD_EUNSUPPORTED);
    assert_null(b2);
    assert_non_null(strstr(err.message, "compute capability 7.5"));
    assert_non_null(strstr(err.message, "8.0 or newer"));
    kvd_emu_set_cc(9, 0);
#else
    skip();
#endif
}

static void test_bad_device(void **state)
{
    struct backend *b2 = (struct backend *)1;
    struct kvd_error err = {0};
    assert_int_equal(backend_cuda_new(1000, &b2, &err), KVD_EUNSUPPORTED);
    assert_null(b2);
    assert_int_equal(err.code, KVD_EUNSUPPORTED);
    assert_non_null(strstr(err.message, "does not exist"));
}

int main(void)
{
    struct kvd_error err = {0};
    int rc = backend_cuda_new(0, &be, &err);
    if (rc) {
        /* The no-device contract, checked here on machines without a GPU:
         * a clear error, no backend, and the cpu backend as the fallback. */
        if (rc != KVD_EUNSUPPORTED || be != NULL || strstr(err.message, "cuda") == NULL) {
            fprintf(stderr, "FAIL: backend_cuda_new without a device: rc %d, msg '%s'\n", rc,
                    err.message);
            return 1;
        }
        struct backend *cpu = NULL;
        if (backend_cpu_new(&cpu) || cpu->ops->kind != BACKEND_CPU) {
            fprintf(stderr, "FAIL: cpu fallback backend\n");
            return 1;
        }
        backend_free(cpu);
        printf("SKIP: no usable CUDA device (%s); the clean-failure path passed\n", err.message);
        return GPU_SKIP;
    }
    if (be->ops->kind != BACKEND_CUDA) {
        fprintf(stderr, "FAIL: backend_cuda_new gave a '%s' backend\n", be->ops->name);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_zero_filled),         GPU_TEST(test_new_blocks_zeroed),
        GPU_TEST(test_swap_round_trip),     GPU_TEST(test_blas_after_other_ctx_freed),
        GPU_TEST(test_swap_during_capture), GPU_TEST(test_compute_capability),
        GPU_TEST(test_bad_device),
    };
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    backend_free(be);
    return rc;
}
