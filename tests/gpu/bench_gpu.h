/* bench_gpu's parts (bench_gpu.c: the options, the ceilings, decode steps,
 * zero-fill and swaps, and the table; bench_gpu_kernels.c: single kernels
 * (projections, attention, the ncu set); bench_gpu_model.c: the random
 * models and the per-op profiler). */
#ifndef KVD_TESTS_BENCH_GPU_H
#define KVD_TESTS_BENCH_GPU_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"
#include "compute_cuda.h"
#include "model.h"

#define BCK(x)                                                                                     \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "bench_gpu: %s: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__,   \
                    __LINE__);                                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define BKCK(x)                                                                                    \
    do {                                                                                           \
        int r_ = (x);                                                                              \
        if (r_) {                                                                                  \
            fprintf(stderr, "bench_gpu: %s: %s (%s:%d)\n", #x,                                     \
                    cudaGetErrorString((cudaError_t)r_), __FILE__, __LINE__);                      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* --small (every shape shrunk for the CPU emulator); --only ncu. */
extern bool bench_small, bench_ncu;
/* The median of v[0..n) (sorts v). */
double bench_median(double *v, int n);
/* A row of the summary table printed last (pct < 0: none). */
void bench_row(const char *what, const char *value, const char *ceiling, double pct);
/* v formatted by f into buf (24 bytes): buf. */
char *bench_fmt(char *buf, const char *f, double v);

/* The single-kernel sections (bench_gpu_kernels.c); bw: the copy
 * bandwidth, tc_peak: the bf16 tensor-core peak (FLOP/s). */
void bench_gemv(struct backend *be, double bw);
void bench_qgemm(struct backend *be);
void bench_attn(struct backend *be, double bw);
void bench_prefill(struct backend *be, double tc_peak);
void bench_ncu_set(struct backend *be);

/* A Llama-family shape. */
struct bench_shape {
    const char *name;
    uint32_t layers, embd, heads, kv_heads, ff, vocab;
    bool tied;
};

/* A model of shape sh with random weights made on the device: bf16, or
 * llama.cpp's Q4_K_M mix (Q4_K; Q6_K for attn_v and ffn_down in the layers
 * use_more_bits picks, and for an untied output). *step_bytes: the weight
 * bytes one decode step reads (every matrix once, the head included, not
 * the embedding table). Freed with model_free. Exits on failure. */
struct model *bench_model_new(struct backend *be, const struct bench_shape *sh, bool q4km,
                              uint64_t *step_bytes);

/* The per-op profiler: install wraps m's ops (graphs must be off); begin
 * starts recording (and queues a long wait on the device, so the step is
 * issued while nothing runs and the events time the GPU, not the host);
 * end waits and sums each op's GPU time by name (projections by weight
 * type) into rows. */
struct bench_prof_row {
    char name[40];
    int calls;
    double us;      /* GPU time, all calls */
    uint64_t bytes; /* weight bytes the calls read (projections) */
};
void bench_prof_install(struct model *m, struct backend *be);
void bench_prof_remove(struct model *m);
void bench_prof_begin(void);
int bench_prof_end(struct bench_prof_row *rows, int max_rows);

#endif
