/* Helpers of the gpu tests (see gpu_fixture.h). */
#include "gpu/gpu_fixture.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute_cpu_kv.h"
#include "kvd/status.h"
#include "quant.h"

#ifdef KVD_CUDA_EMULATE
#include <cuda_runtime.h>
#endif

static void die(const char *what, int rc)
{
    fprintf(stderr, "gpu fixture: %s failed (%d: %s)\n", what, rc, kvd_err_code(rc));
    exit(1);
}

void gpu_wt_make(struct gpu_fx *f, struct gpu_wt *w, enum ctype t, uint32_t in, uint32_t out)
{
    size_t rb = ctype_row_bytes(t, in);
    int rc;
    w->bytes = malloc(rb * out);
    float *row = malloc(in * sizeof(float));
    if (!w->bytes || !row)
        die("gpu_wt_make malloc", KVD_ENOMEM);
    for (uint32_t r = 0; r < out; r++) {
        rnd_fill(row, in, -1, 1);
        uint8_t *o = (uint8_t *)w->bytes + r * rb;
        if (t == CT_F32)
            memcpy(o, row, in * 4);
        else if (t == CT_F16)
            for (uint32_t i = 0; i < in; i++)
                ((uint16_t *)o)[i] = float_to_half(row[i]);
        else if (t == CT_BF16)
            for (uint32_t i = 0; i < in; i++)
                ((uint16_t *)o)[i] = float_to_bf16(row[i]);
        else if ((rc = quant_quantize_row(t, row, o, in)))
            die("quant_quantize_row", rc);
    }
    free(row);
    w->h = (struct ctensor){.type = t, .ne0 = in, .ne1 = out, .nbytes = rb * out, .data = w->bytes};
    /* the cpu backend's own layout */
    struct ctensor c = w->h;
    if (f->cops->weight_bytes) {
        if ((rc = f->cops->buf_alloc(f->ccx, f->cops->weight_bytes(&c), &c.data)) ||
            (rc = f->cops->weight_upload(f->ccx, &c, w->bytes)))
            die("cpu weight upload", rc);
        w->h = c;
    }
    w->d = (struct ctensor){.type = t, .ne0 = in, .ne1 = out, .nbytes = rb * out};
    if ((rc = f->gops->buf_alloc(f->gcx, f->gops->weight_bytes(&w->d), &w->d.data)) ||
        (rc = f->gops->weight_upload(f->gcx, &w->d, w->bytes)))
        die("cuda weight upload", rc);
}

void gpu_wt_free(struct gpu_fx *f, struct gpu_wt *w)
{
    if (f->cops->weight_bytes)
        f->cops->buf_free(f->ccx, w->h.data);
    f->gops->buf_free(f->gcx, w->d.data);
    free(w->bytes);
}

unsigned long long gpu_launches(void)
{
#ifdef KVD_CUDA_EMULATE
    struct kvd_emu_counts c;
    kvd_emu_get_counts(&c);
    return c.launches;
#else
    return 0;
#endif
}

unsigned long long gpu_prewait_load_bytes(void)
{
#ifdef KVD_CUDA_EMULATE
    struct kvd_emu_counts c;
    kvd_emu_get_counts(&c);
    return c.prewait_load_bytes;
#else
    return 0;
#endif
}

unsigned long long gpu_load_bytes(void)
{
#ifdef KVD_CUDA_EMULATE
    struct kvd_emu_counts c;
    kvd_emu_get_counts(&c);
    return c.load_bytes;
#else
    return 0;
#endif
}

void gpu_fx_open(struct gpu_fx *f)
{
    struct kvd_error err = {0};
    struct compute_conf conf = {.n_threads = 2};
    int rc;

    memset(f, 0, sizeof *f);
    rc = backend_cuda_new(0, &f->cuda, &err);
    if (rc) {
        printf("SKIP: no usable CUDA device: %s\n", err.message);
        exit(GPU_SKIP);
    }
    if ((rc = backend_cpu_new(&f->cpu)))
        die("backend_cpu_new", rc);
    f->gops = f->cuda->compute;
    f->cops = f->cpu->compute ? f->cpu->compute : compute_cpu_ops();
    if (!f->gops)
        die("cuda backend without compute ops", KVD_EINTERNAL);
    if ((rc = f->gops->ctx_new(f->cuda, &conf, &f->gcx)))
        die("cuda ctx_new", rc);
    if ((rc = f->cops->ctx_new(f->cpu, &conf, &f->ccx)))
        die("cpu ctx_new", rc);
}

void gpu_fx_close(struct gpu_fx *f)
{
    if (f->gcx)
        f->gops->ctx_free(f->gcx);
    if (f->ccx)
        f->cops->ctx_free(f->ccx);
    backend_free(f->cuda);
    backend_free(f->cpu);
    memset(f, 0, sizeof *f);
}

struct gpu_fx gpu_F;

int gpu_fx_setup(void **state)
{
    (void)state;
    gpu_fx_open(&gpu_F);
    return 0;
}

int gpu_fx_teardown(void **state)
{
    (void)state;
    gpu_fx_close(&gpu_F);
    return 0;
}

void *gpu_dup(struct gpu_fx *f, const void *host, size_t bytes)
{
    void *d = NULL;
    int rc = f->gops->buf_alloc(f->gcx, bytes, &d);
    if (rc)
        die("buf_alloc", rc);
    if (bytes && (rc = f->gops->upload(f->gcx, d, host, bytes)))
        die("upload", rc);
    return d;
}

float *gpu_nan(struct gpu_fx *f, size_t n)
{
    float *h = malloc((n ? n : 1) * sizeof *h);
    if (!h)
        die("malloc", KVD_ENOMEM);
    for (size_t i = 0; i < n; i++)
        h[i] = NAN;
    float *d = gpu_dup(f, h, n * sizeof *h);
    free(h);
    return d;
}

void gpu_get(struct gpu_fx *f, void *host, const void *dev, size_t bytes)
{
    int rc = f->gops->download(f->gcx, host, dev, bytes);
    if (rc)
        die("download", rc);
}

void gpu_free(struct gpu_fx *f, void *dev)
{
    f->gops->buf_free(f->gcx, dev);
}

static uint64_t rnd_state = 0x243f6a8885a308d3ull;

void rnd_seed(uint64_t s)
{
    rnd_state = s ^ 0x9e3779b97f4a7c15ull;
}

static uint64_t rnd_next(void)
{
    uint64_t z = (rnd_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint32_t rnd_u32(uint32_t n)
{
    return n ? (uint32_t)(rnd_next() % n) : 0;
}

float rnd_f(float lo, float hi)
{
    return lo + (hi - lo) * (float)((rnd_next() >> 40) * (1.0 / 16777216.0));
}

void rnd_fill(float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = rnd_f(lo, hi);
}

float *rnd_new(size_t n, float lo, float hi)
{
    float *x = malloc((n ? n : 1) * sizeof *x);
    if (!x)
        die("malloc", KVD_ENOMEM);
    rnd_fill(x, n, lo, hi);
    return x;
}

double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            return INFINITY;
        double d = fabs((double)a[i] - b[i]);
        if (d > num)
            num = d;
        if (fabs((double)b[i]) > den)
            den = fabs((double)b[i]);
    }
    return den > 0 ? num / den : num;
}

unsigned long gpu_emu_reports(void)
{
#ifdef KVD_CUDA_EMULATE
    static unsigned long emu_seen;
    unsigned long n = kvd_emu_errors(), d = n - emu_seen;
    emu_seen = n;
    return d;
#else
    return 0;
#endif
}

int gpu_emu_clean(void **state)
{
    (void)state;
    unsigned long d = gpu_emu_reports();
    if (!d)
        return 0;
#ifdef KVD_CUDA_EMULATE
    fprintf(stderr, "FAIL: the CUDA emulator reported %lu problem(s); the latest: %s\n", d,
            kvd_emu_last_report());
#endif
    return -1;
}

void gpu_emu_order_check(int on)
{
#ifdef KVD_CUDA_EMULATE
    const char *e = getenv("KVD_EMU_CHECK");
    kvd_emu_set_order_check(on && e && strstr(e, "order") != NULL);
#else
    (void)on;
#endif
}

void kvfx_init(struct kvfx *k, enum kv_dtype dt, uint32_t layers, uint32_t kv_heads, uint32_t hd,
               uint32_t bt, size_t nb)
{
    k->g = (struct kv_geom){
        .layers = layers, .kv_heads = kv_heads, .head_dim = hd, .dtype = dt, .block_tokens = bt};
    k->bb = kv_block_bytes(&k->g);
    k->nb = nb;
    k->harena = malloc(k->bb * nb);
    float *row = malloc(hd * sizeof(float));
    if (!k->harena || !row)
        die("malloc of a KV arena", KVD_ENOMEM);
    size_t rb = kv_row_bytes(dt, hd), n = k->bb * nb / rb; /* rows of hd values */
    for (size_t r = 0; r < n; r++) {
        for (uint32_t i = 0; i < hd; i++)
            row[i] = rnd_f(-2, 2);
        cpu_kv_store_row(k->harena + r * rb, dt, row, hd, false);
    }
    free(row);
    k->darena = gpu_dup(&gpu_F, k->harena, k->bb * nb);
}

void kvfx_free(struct kvfx *k)
{
    gpu_free(&gpu_F, k->darena);
    free(k->harena);
}
