/* compute_cuda: the cuda compute context (compute.h): device buffers,
 * uploads through pinned staging, downloads, scratch growth, and the CUDA
 * graphs that capture a step (decode-only or mixed) once and replay it. The operations
 * themselves are in compute_cuda_ops.c. */
#include "compute_cuda_impl.h"

#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"
#include "log.h"

#define STG_BYTES (8u << 20)      /* pinned staging ring for small uploads */
#define STG_MAX_UPLOAD (1u << 20) /* larger uploads go straight from the source */

_Static_assert((int)CT_F32 == (int)KVD_KW_F32 && (int)CT_F16 == (int)KVD_KW_F16 &&
                   (int)CT_BF16 == (int)KVD_KW_BF16 && (int)CT_Q8_0 == (int)KVD_KW_Q8_0 &&
                   (int)CT_Q4_0 == (int)KVD_KW_Q4_0 && (int)CT_Q4_1 == (int)KVD_KW_Q4_1 &&
                   (int)CT_Q5_0 == (int)KVD_KW_Q5_0 && (int)CT_Q5_1 == (int)KVD_KW_Q5_1 &&
                   (int)CT_Q4_K == (int)KVD_KW_Q4_K && (int)CT_Q5_K == (int)KVD_KW_Q5_K &&
                   (int)CT_Q6_K == (int)KVD_KW_Q6_K,
               "weight type numbers of kv_types.h and kernels.h differ");
_Static_assert((int)KV_F16 == (int)KVD_K_F16 && (int)KV_BF16 == (int)KVD_K_BF16 &&
                   (int)KV_F32 == (int)KVD_K_F32 && (int)KV_Q8_0 == (int)KVD_K_Q8_0 &&
                   (int)KV_FP8 == (int)KVD_K_FP8,
               "KV dtype numbers of kv_types.h and kernels.h differ");
_Static_assert((int)ROPE_NORM == (int)KVD_K_ROPE_NORM && (int)ROPE_NEOX == (int)KVD_K_ROPE_NEOX,
               "rope mode numbers of compute.h and kernels.h differ");

int cuda_kstatus(int kernel_rc, const char *what)
{
    if (kernel_rc == 0)
        return 0;
    return cuda_fail(kernel_rc, what);
}

static void graph_drop(struct cuda_graph_entry *g)
{
    if (g->exec)
        cudaGraphExecDestroy(g->exec);
    memset(g, 0, sizeof *g);
}

/* Graphs hold raw device addresses: any buffer freed or moved may be one
 * of them, so every graph is forgotten (and re-captured when its key comes
 * back). Frees are rare: teardown, block-table growth, scratch growth, a
 * KV pool or arena freed. */
static void graphs_drop_all(struct compute_ctx *cx)
{
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++) {
        cx->n_dropped += cx->graph[i].exec != NULL;
        graph_drop(&cx->graph[i]);
    }
}

void cuda_cx_free(struct compute_ctx *cx, void *p)
{
    if (!p)
        return;
    cuda_dev_note_free(cx->dev);
    cudaError_t e = cudaFree(p); /* implicitly waits for work using it */
    if (e != cudaSuccess)
        cuda_fail(e, "cudaFree");
}

/* Drops every graph when device memory was freed since they were checked
 * (by this context or anyone else on the device: an arena, another
 * context's buffer). */
static void graphs_check_frees(struct compute_ctx *cx)
{
    uint64_t f = atomic_load(&cx->dev->frees);
    if (f != cx->graph_frees) {
        graphs_drop_all(cx);
        cx->graph_frees = f;
    }
}

static void cuda_ctx_free(struct compute_ctx *cx)
{
    if (!cx)
        return;
    if (cuda_dev_enter(cx->dev) == 0) {
        cudaStreamSynchronize(cx->stream);
        graphs_drop_all(cx);
        cuda_cx_free(cx, cx->xb);
        cuda_cx_free(cx, cx->part);
        cuda_cx_free(cx, cx->done);
        cuda_cx_free(cx, cx->wt);
        cuda_cx_free(cx, cx->act);
        cuda_cx_free(cx, cx->counter);
        for (int s = 0; s < 2; s++)
            for (int i = 0; i < 2; i++)
                cuda_cx_free(cx, cx->pq[s].buf[i]);
        cudaFreeHost(cx->stg);
    }
    pthread_mutex_destroy(&cx->live_mu);
    free(cx->live);
    free(cx);
}

static int cuda_ctx_new(struct backend *be, const struct compute_conf *conf,
                        struct compute_ctx **out)
{
    struct cuda_dev *dev = cuda_backend_dev(be);
    struct compute_ctx *cx;
    cudaError_t e;
    int rc;

    *out = NULL;
    if (!dev)
        return KVD_EUNSUPPORTED;
    if ((rc = cuda_dev_enter(dev)))
        return rc;
    cx = calloc(1, sizeof *cx);
    if (!cx)
        return KVD_ENOMEM;
    pthread_mutex_init(&cx->live_mu, NULL);
    cx->be = be;
    cx->dev = dev;
    cx->stream = dev->compute;
    cx->tile_elems = CUDA_TILE_ELEMS_DEFAULT;
    const char *g = getenv("KVD_CUDA_GRAPHS");
    cx->graphs = !(g && strcmp(g, "0") == 0);
    cx->graph_frees = atomic_load(&dev->frees);
    cx->pq_live = cx->pq_next = -1;
    if ((e = cudaHostAlloc((void **)&cx->stg, STG_BYTES, cudaHostAllocPortable)) != cudaSuccess ||
        (e = cudaMalloc((void **)&cx->counter, 256)) != cudaSuccess ||
        (e = cudaMemset(cx->counter, 0, 256)) != cudaSuccess)
        goto fail;
    cx->stg_cap = STG_BYTES;
    cx->scratch_bytes = 256; /* the counter */
    *out = cx;
    return 0;
fail:
    rc = cuda_fail(e, "compute context");
    cuda_ctx_free(cx);
    return rc == KVD_EINTERNAL ? KVD_ENOMEM : rc;
}

static int cuda_buf_alloc(struct compute_ctx *cx, size_t bytes, void **out)
{
    *out = NULL;
    if (cuda_dev_enter(cx->dev))
        return KVD_EINTERNAL;
    /* cudaMalloc returns 256-byte aligned memory; 0 bytes still gets a
     * distinct pointer so callers can tell "allocated" from "not". */
    size_t n = bytes ? bytes : 256;
    cudaError_t e = cudaMalloc(out, n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *out = NULL;
        log_warn("cuda: buffer of %zu bytes: %s", bytes, cudaGetErrorString(e));
        return KVD_ENOMEM;
    }
    /* its size kept for dev_bytes (buffers are few: weights, a forward
     * context's, block tables) */
    pthread_mutex_lock(&cx->live_mu);
    if (cx->n_live == cx->live_cap) {
        size_t cap = cx->live_cap ? cx->live_cap * 2 : 32;
        struct cuda_live_buf *v = realloc(cx->live, cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&cx->live_mu);
            cuda_cx_free(cx, *out);
            *out = NULL;
            return KVD_ENOMEM;
        }
        cx->live = v;
        cx->live_cap = cap;
    }
    cx->live[cx->n_live++] = (struct cuda_live_buf){.p = *out, .n = n};
    __atomic_add_fetch(&cx->live_bytes, n, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&cx->live_mu);
    return 0;
}

static void cuda_buf_free(struct compute_ctx *cx, void *p)
{
    if (!p || cuda_dev_enter(cx->dev))
        return;
    pthread_mutex_lock(&cx->live_mu);
    for (size_t i = 0; i < cx->n_live; i++)
        if (cx->live[i].p == p) {
            __atomic_sub_fetch(&cx->live_bytes, cx->live[i].n, __ATOMIC_RELAXED);
            cx->live[i] = cx->live[--cx->n_live];
            break;
        }
    pthread_mutex_unlock(&cx->live_mu);
    cuda_cx_free(cx, p);
}

static size_t cuda_dev_bytes(struct compute_ctx *cx)
{
    return __atomic_load_n(&cx->live_bytes, __ATOMIC_RELAXED) +
           __atomic_load_n(&cx->scratch_bytes, __ATOMIC_RELAXED);
}

/* Waits for the compute stream; every staged upload has then been read. */
static int cuda_sync(struct compute_ctx *cx)
{
    if (cuda_dev_enter(cx->dev))
        return KVD_EINTERNAL;
    cudaError_t e = cudaStreamSynchronize(cx->stream);
    if (e != cudaSuccess)
        return cuda_fail(e, "compute stream");
    cx->stg_off = 0;
    return 0;
}

static int cuda_upload(struct compute_ctx *cx, void *dst, const void *src, size_t bytes)
{
    cudaError_t e;
    int rc;

    if (bytes == 0)
        return 0;
    if ((rc = cuda_dev_enter(cx->dev)))
        return rc;
    if (bytes > STG_MAX_UPLOAD) {
        /* Weights at load: copied from the caller's memory, then waited for,
         * because `src` may be reused as soon as we return. */
        e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cx->stream);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(cx->stream);
        if (e != cudaSuccess)
            return cuda_fail(e, "upload");
        cx->stg_off = 0;
        return 0;
    }
    /* Step metadata: copied into pinned staging so the DMA runs
     * asynchronously and the caller's buffer is free at once. */
    if (cx->stg_off + bytes > cx->stg_cap && (rc = cuda_sync(cx)))
        return rc;
    unsigned char *p = cx->stg + cx->stg_off;
    memcpy(p, src, bytes);
    cx->stg_off += (bytes + 255) & ~(size_t)255;
    e = cudaMemcpyAsync(dst, p, bytes, cudaMemcpyHostToDevice, cx->stream);
    return e == cudaSuccess ? 0 : cuda_fail(e, "upload");
}

static int cuda_download(struct compute_ctx *cx, void *dst, const void *src, size_t bytes)
{
    if (cuda_dev_enter(cx->dev))
        return KVD_EINTERNAL;
    if (bytes) {
        cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cx->stream);
        if (e != cudaSuccess)
            return cuda_fail(e, "download");
    }
    return cuda_sync(cx);
}

/* Replaces *buf with a larger one when it is too small; old contents are not
 * kept (scratch). */
static int grow_dev(struct compute_ctx *cx, void **buf, size_t *cap, size_t need, size_t esize)
{
    if (need <= *cap)
        return 0;
    if (cx->capturing) {
        log_err("cuda: scratch growth requested inside a graph capture (internal)");
        return KVD_EINTERNAL;
    }
    size_t n = need + need / 2;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n * esize);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return KVD_ENOMEM;
    }
    cuda_cx_free(cx, *buf); /* waits for kernels still reading the old one */
    __atomic_add_fetch(&cx->scratch_bytes, (n - *cap) * esize, __ATOMIC_RELAXED);
    *buf = p;
    *cap = n;
    return 0;
}

int cuda_cx_need_xb(struct compute_ctx *cx, size_t elems)
{
    return grow_dev(cx, (void **)&cx->xb, &cx->xb_cap, elems, sizeof(uint16_t));
}

int cuda_cx_need_part(struct compute_ctx *cx, size_t floats, size_t counters)
{
    int rc = grow_dev(cx, (void **)&cx->part, &cx->part_cap, floats, sizeof(float));
    if (rc || counters <= cx->done_cap)
        return rc;
    if ((rc = grow_dev(cx, (void **)&cx->done, &cx->done_cap, counters, sizeof(unsigned))))
        return rc;
    /* the kernel counts from 0 and leaves 0 behind */
    cudaError_t e = cudaMemsetAsync(cx->done, 0, cx->done_cap * sizeof(unsigned), cx->stream);
    return e == cudaSuccess ? 0 : cuda_fail(e, "memset");
}

int cuda_cx_need_act(struct compute_ctx *cx, size_t bytes)
{
    return grow_dev(cx, &cx->act, &cx->act_cap, bytes, 1);
}

int cuda_cx_need_pq(struct compute_ctx *cx, int s, int i, size_t bytes)
{
    return grow_dev(cx, &cx->pq[s].buf[i], &cx->pq[s].cap[i], bytes, 1);
}

void cuda_pq_end_op(struct compute_ctx *cx)
{
    cx->pq_live = cx->pq_next;
    cx->pq_next = -1;
    cx->readers.y = NULL;
}

/* max_kv rounded up to a power of two (at least 256). */
static uint32_t kv_bucket(uint32_t max_kv)
{
    uint32_t b = 256;
    while (b < max_kv && b < (1u << 30))
        b <<= 1;
    return b;
}

uint32_t cuda_cx_splits(const struct compute_ctx *cx, uint32_t n_seqs, uint32_t n_head,
                        const struct kvd_k_kv *kv, uint32_t max_kv)
{
    return (uint32_t)kvd_k_attn_decode_splits((int)n_seqs, (int)n_head, kv, (int)kv_bucket(max_kv),
                                              cx->dev->n_sms);
}

/* ---- CUDA graphs --------------------------------------------------------- */

/* Same fixed buffers, shapes and context bucket (so the same split count
 * is baked into the attention launches): every count a launch's geometry
 * or an op's choice of kernels depends on. max_q (already bucketed by
 * model_forward) sizes the prefill attention's grid; the one-row prefix of
 * a batch-invariant step splits the projections and the attention. */
static bool key_eq(const struct compute_step *a, const struct compute_step *b)
{
    return a->owner == b->owner && a->arena == b->arena && a->tables == b->tables &&
           a->n_tokens == b->n_tokens && a->n_seqs == b->n_seqs && a->n_out == b->n_out &&
           a->max_q == b->max_q && a->sampled == b->sampled && a->alone == b->alone &&
           a->n_one == b->n_one && a->n_dec == b->n_dec && a->s_dec == b->s_dec &&
           a->n_out_one == b->n_out_one && kv_bucket(a->max_kv) == kv_bucket(b->max_kv);
}

/* The entry for this key (and split count), or a recycled LRU one. */
static struct cuda_graph_entry *graph_slot(struct compute_ctx *cx, const struct compute_step *st)
{
    struct cuda_graph_entry *lru = &cx->graph[0];
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++) {
        struct cuda_graph_entry *g = &cx->graph[i];
        if (g->seen && key_eq(&g->key, st))
            return g;
        if (g->last_use < lru->last_use)
            lru = g;
    }
    graph_drop(lru);
    lru->key = *st;
    return lru;
}

/* Decode batches up to KVD_K_GEMV_MAX_TOKENS keep their size (the GEMV
 * has an instance for each token count: padding would only add work, and
 * eight graphs are cheap); larger ones are padded to powers of two and
 * 1.5x powers of two (12, 16, 24, 32, 48, 64, 96, 128, 192, 256, ...): at
 * most a third of a step's rows are padding, and a batch that grows or shrinks
 * by a few sequences replays the graph it already has. No padding when
 * graphs are off: it would only cost. */
static uint32_t cuda_step_bucket(struct compute_ctx *cx, uint32_t n)
{
    if (!cx->graphs || n <= KVD_K_GEMV_MAX_TOKENS)
        return n;
    uint32_t p = 1;
    while (p < n && p < (1u << 30))
        p <<= 1;
    if (p >= 16 && p / 4 * 3 >= n)
        return p / 4 * 3;
    return p;
}

/* A mixed step's rows, output rows and max_q: up to KVD_K_GEMV_MAX_TOKENS
 * as they are (the GEMV has an instance per row count), then rounded up to
 * a multiple of an eighth of the next power of two: four buckets per
 * doubling (10, 12, 14, 16, 20, 24, 28, 32, 40, ..., 320, 384, 448, 512,
 * 640, ...), so under a fifth of a step's rows are padding while a prefill
 * chunk that varies by a few tokens replays the graph it already has.
 * Nothing padded when graphs are off. */
static uint32_t cuda_row_bucket(struct compute_ctx *cx, uint32_t n)
{
    if (!cx->graphs || n <= KVD_K_GEMV_MAX_TOKENS)
        return n;
    uint32_t p = 1;
    while (p < n && p < (1u << 30))
        p <<= 1;
    uint32_t q = p / 8;
    return (n + q - 1) / q * q;
}

/* The kernel launches of the step issued since step_begin. */
static uint32_t step_launches_now(const struct compute_ctx *cx)
{
    return (uint32_t)(kvd_k_launches() - cx->step_launch0) + cx->step_blas;
}

static int cuda_step_begin(struct compute_ctx *cx, const struct compute_step *st, int *replayed)
{
    *replayed = 0;
    cx->cur = NULL;
    cx->pq_live = cx->pq_next = -1; /* nothing quantized is left from another step */
    cx->readers.y = NULL;
    cx->step_launch0 = kvd_k_launches();
    cx->step_blas = 0;
    cx->step_decode = st->max_q == 1;
    if (cuda_dev_enter(cx->dev))
        return KVD_EINTERNAL;
    /* Copies queued by other threads (swaps, copy-on-write) finish before
     * this step's work starts. A captured step waits in step_end instead. */
    cudaError_t we = (cudaError_t)cuda_dev_wait_copies(cx->dev);
    if (we != cudaSuccess)
        return cuda_fail(we, "wait for copies");
    graphs_check_frees(cx);
    if (!cx->graphs) {
        cx->n_eager++;
        return 0;
    }
    struct cuda_graph_entry *g = graph_slot(cx, st);
    g->last_use = ++cx->clock;
    if (g->exec) {
        cudaError_t e = cudaGraphLaunch(g->exec, cx->stream);
        if (e != cudaSuccess)
            return cuda_fail(e, "graph replay");
        cx->n_replays++;
        if (cx->step_decode)
            cx->last_decode_launches = g->launches;
        else
            cx->n_mixed_replays++;
        *replayed = 1;
        return 0;
    }
    /* The first run of a key is eager: it grows scratch and converts
     * weights outside any capture. The second is captured. */
    if (g->failed || g->seen++ == 0) {
        cx->n_eager++;
        return 0;
    }
    cudaError_t e = (cudaError_t)cuda_dev_capture_begin(cx->dev);
    if (e != cudaSuccess) {
        g->failed = true;
        (void)cudaGetLastError();
        log_warn("cuda: graph capture unavailable (%s); steps run eagerly", cudaGetErrorString(e));
        cx->n_eager++;
        return 0;
    }
    cx->capturing = true;
    cx->cur = g;
    return 0;
}

/* After a failed step: waits for whatever of it (and of its uploads) was
 * issued, so nothing still runs on buffers the caller may reuse or free,
 * and the staging ring starts over. The step's own error is what the
 * caller reports; a sticky error found here is logged. */
static void step_failed_sync(struct compute_ctx *cx)
{
    cx->n_failed_syncs++;
    cudaError_t e = cudaStreamSynchronize(cx->stream);
    if (e != cudaSuccess)
        cuda_fail(e, "compute stream after a failed step");
    (void)cudaGetLastError();
    cx->stg_off = 0;
}

static int cuda_step_end(struct compute_ctx *cx, int rc)
{
    struct cuda_graph_entry *g = cx->cur;
    cudaGraph_t graph = NULL;
    cudaError_t e;

    if (!cx->capturing) {
        if (rc)
            step_failed_sync(cx);
        else if (cx->step_decode)
            cx->last_decode_launches = step_launches_now(cx);
        return 0;
    }
    cx->capturing = false;
    cx->cur = NULL;
    e = (cudaError_t)cuda_dev_capture_end(cx->dev, &graph);
    if (rc || e != cudaSuccess || !graph) {
        /* Nothing of this step ran: the caller reports the failure. */
        if (graph)
            cudaGraphDestroy(graph);
        (void)cudaGetLastError();
        g->failed = true;
        step_failed_sync(cx);
        return rc ? rc : cuda_fail(e, "graph capture");
    }
    e = cudaGraphInstantiate(&g->exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        g->exec = NULL;
        g->failed = true;
        return cuda_fail(e, "graph instantiate");
    }
    cx->n_captures++;
    g->launches = step_launches_now(cx);
    if (cx->step_decode)
        cx->last_decode_launches = g->launches;
    else
        cx->n_mixed_captures++;
    /* Copies queued while the capture ran (from other threads: the copy
     * stream skipped its wait on compute then) finish before the graph. */
    if ((e = (cudaError_t)cuda_dev_wait_copies(cx->dev)) != cudaSuccess)
        return cuda_fail(e, "wait for copies");
    e = cudaGraphLaunch(g->exec, cx->stream);
    return e == cudaSuccess ? 0 : cuda_fail(e, "graph launch");
}

static uint32_t cuda_step_launches(struct compute_ctx *cx)
{
    return cx->last_decode_launches;
}

void cuda_compute_set_graphs(struct compute_ctx *cx, bool on)
{
    cx->graphs = on;
}

void cuda_compute_set_qmma(struct compute_ctx *cx, bool on)
{
    cx->no_qmma = !on;
}

void cuda_compute_set_tile_elems(struct compute_ctx *cx, size_t elems)
{
    cx->tile_elems = elems ? elems : 1;
}

void cuda_compute_stats(const struct compute_ctx *cx, struct cuda_compute_stats *st)
{
    st->captures = cx->n_captures;
    st->replays = cx->n_replays;
    st->mixed_captures = cx->n_mixed_captures;
    st->mixed_replays = cx->n_mixed_replays;
    st->eager = cx->n_eager;
    st->dropped = cx->n_dropped;
    st->failed_syncs = cx->n_failed_syncs;
    st->blas = cx->n_blas;
    st->act_quants = cx->n_act_quant;
    st->act_handed = cx->n_act_handed;
}

static const struct compute_ops cuda_compute_table = {
    .name = "cuda",
    .async = true,
    .ctx_new = cuda_ctx_new,
    .ctx_free = cuda_ctx_free,
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .dev_bytes = cuda_dev_bytes,
    .upload = cuda_upload,
    .download = cuda_download,
    .sync = cuda_sync,
    .weight_bytes = cuda_weight_bytes,
    .weight_upload = cuda_weight_upload,
    .weight_type_ok = cuda_weight_type_ok,
    .weight_scratch_bytes = cuda_weight_scratch_bytes,
    .get_rows = cuda_op_get_rows,
    .rmsnorm = cuda_op_rmsnorm,
    .add_rmsnorm = cuda_op_add_rmsnorm,
    .matmul = cuda_op_matmul,
    .matmul_inv = cuda_op_matmul_inv,
    .add_bias = cuda_op_add_bias,
    .rope = cuda_op_rope,
    .kv_write = cuda_op_kv_write,
    .attention = cuda_op_attention,
    .silu_mul = cuda_op_silu_mul,
    .add = cuda_op_add,
    .gather_rows = cuda_op_gather_rows,
    .sample = cuda_op_sample,
    .matmul_n = cuda_op_matmul_n,
    .matmul_swiglu = cuda_op_matmul_swiglu,
    .matmul_add_rmsnorm = cuda_op_matmul_add_rmsnorm,
    .next_readers = cuda_op_next_readers,
    .rope_kv_write = cuda_op_rope_kv_write,
    .matmul_qkv_rope_kv = cuda_op_matmul_qkv_rope_kv,
    .step_bucket = cuda_step_bucket,
    .row_bucket = cuda_row_bucket,
    .step_begin = cuda_step_begin,
    .step_end = cuda_step_end,
    .step_launches = cuda_step_launches,
};

const struct compute_ops *compute_cuda_ops(void)
{
    return &cuda_compute_table;
}
