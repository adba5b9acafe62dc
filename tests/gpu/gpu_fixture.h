/* Shared helpers of the gpu tests: open the cuda backend or skip (exit 77,
 * saying why), a cpu compute context as the reference, a test program's
 * one fixture with its cmocka setup and teardown, device buffers from host
 * data, KV arenas on both backends, NaN-poisoned outputs, random data, and
 * error measures. */
#ifndef KVD_TESTS_GPU_FIXTURE_H
#define KVD_TESTS_GPU_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "compute.h"
#include "kv_types.h"

#define GPU_SKIP 77 /* ctest SKIP_RETURN_CODE */

struct gpu_fx {
    struct backend *cuda, *cpu;
    const struct compute_ops *gops, *cops;
    struct compute_ctx *gcx, *ccx;
};

/* Opens both backends and their compute contexts; without a usable device
 * prints "SKIP: <reason>" and exits with GPU_SKIP. */
void gpu_fx_open(struct gpu_fx *f);
void gpu_fx_close(struct gpu_fx *f);
/* A test program's one fixture, gpu_F (a test names it F: #define F
 * gpu_F), opened by gpu_fx_setup and closed by gpu_fx_teardown, cmocka's
 * group setup and teardown. */
extern struct gpu_fx gpu_F;
int gpu_fx_setup(void **state);
int gpu_fx_teardown(void **state);

/* Device copy of host bytes (freed with gpu_free). */
void *gpu_dup(struct gpu_fx *f, const void *host, size_t bytes);
/* Device buffer of n floats, every one NaN (so unwritten outputs fail). */
float *gpu_nan(struct gpu_fx *f, size_t n);
void gpu_get(struct gpu_fx *f, void *host, const void *dev, size_t bytes);
void gpu_free(struct gpu_fx *f, void *dev);

/* A KV arena of nb blocks of the geometry, random rows written with the
 * cpu codec (cpu_kv_store_row) in host memory and copied to gpu_F's
 * device: the same bytes on both sides. */
struct kvfx {
    struct kv_geom g;
    size_t bb, nb;   /* block bytes, blocks */
    uint8_t *harena; /* cpu arena */
    void *darena;    /* cuda arena, same initial bytes */
};
void kvfx_init(struct kvfx *k, enum kv_dtype dt, uint32_t layers, uint32_t kv_heads, uint32_t hd,
               uint32_t bt, size_t nb);
void kvfx_free(struct kvfx *k);

/* A weight [out][in] of type t, values uniform in [-1, 1) (rnd_*): the
 * file's bytes, the cpu backend's copy (h) and the cuda backend's (d),
 * loaded as the model loads weights (weight_upload: planes, bf16 copies).
 * Exits on failure. */
struct gpu_wt {
    struct ctensor h, d;
    void *bytes;
};
void gpu_wt_make(struct gpu_fx *f, struct gpu_wt *w, enum ctype t, uint32_t in, uint32_t out);
void gpu_wt_free(struct gpu_fx *f, struct gpu_wt *w);

/* The kernel launches the device ran so far (the emulator counts them; a
 * real device reports 0). */
unsigned long long gpu_launches(void);
/* The bytes kernels loaded before their programmatic-launch wait so far
 * (the emulator counts them; a real device reports 0). */
unsigned long long gpu_prewait_load_bytes(void);
/* The bytes kernels loaded from global memory so far (the instrumented
 * emulator counts them; else 0). */
unsigned long long gpu_load_bytes(void);

/* Deterministic random numbers (seeded per test, fresh per call). */
void rnd_seed(uint64_t s);
uint32_t rnd_u32(uint32_t n);
float rnd_f(float lo, float hi);
void rnd_fill(float *x, size_t n, float lo, float hi);
float *rnd_new(size_t n, float lo, float hi); /* malloc'd */

/* max|a-b| / max|b| over n elements; +inf if any a is NaN or inf. */
double rel_err(const float *a, const float *b, size_t n);

/* The CPU emulation build (KVD_CUDA=EMULATE, docs/emulation.md) reports
 * kernel faults, races, order dependence and API misuse that a GPU would
 * not. gpu_emu_clean is a cmocka teardown that fails the test when the
 * emulator reported anything since the last call (printing the latest
 * report); gpu_emu_reports counts the reports since the last call, for
 * tests that expect some. On a real device both find nothing. */
int gpu_emu_clean(void **state);
unsigned long gpu_emu_reports(void);
#define GPU_TEST(f) cmocka_unit_test_teardown(f, gpu_emu_clean)
/* Turns the emulator's thread-order check (KVD_EMU_CHECK=order) off (0) or
 * back to what the environment asked (1); nothing elsewhere. */
void gpu_emu_order_check(int on);

#endif
