/* Shared helpers of the gpu tests: open the cuda backend or skip (exit 77,
 * saying why), a cpu compute context as the reference, device buffers from
 * host data, NaN-poisoned outputs, random data, and error measures. */
#ifndef KVD_TESTS_GPU_FIXTURE_H
#define KVD_TESTS_GPU_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "compute.h"

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

/* Device copy of host bytes (freed with gpu_free). */
void *gpu_dup(struct gpu_fx *f, const void *host, size_t bytes);
/* Device buffer of n floats, every one NaN (so unwritten outputs fail). */
float *gpu_nan(struct gpu_fx *f, size_t n);
void gpu_get(struct gpu_fx *f, void *host, const void *dev, size_t bytes);
void gpu_free(struct gpu_fx *f, void *dev);

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
