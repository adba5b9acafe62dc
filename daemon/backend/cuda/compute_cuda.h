/* compute_cuda: what tests and benchmarks may ask of a cuda compute context
 * beyond compute.h (graphs on/off, counters). The context
 * itself is private to compute_cuda*.c (compute_cuda_impl.h), so this header
 * can be included next to another backend's internals. CUDA builds only. */
#ifndef KVD_CUDA_COMPUTE_H
#define KVD_CUDA_COMPUTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "compute.h"

/* For tests and benchmarks: turn graphs on/off for this context, and read
 * how many steps were captured, replayed and run eagerly (mixed_*: the
 * captures and replays of mixed steps, those with a sequence of several
 * rows, counted in captures and replays too), how many graphs were dropped
 * because device memory was freed, and how many failed steps ended with a
 * wait for the compute stream. */
void cuda_compute_set_graphs(struct compute_ctx *cx, bool on);
/* For benchmarks: the K-quants' projections of more than 8 rows through the
 * int8 tensor-core GEMM (on, the default) or, off, as before it: 8-row GEMV
 * launches up to 32 rows, dequantized tiles + cuBLAS above. */
void cuda_compute_set_qmma(struct compute_ctx *cx, bool on);
struct cuda_compute_stats {
    uint64_t captures, replays, eager, dropped, failed_syncs;
    uint64_t mixed_captures, mixed_replays;
    uint64_t blas; /* cuBLAS GEMM calls, all steps */
    /* Quantized GEMV launches issued (eager or captured, not replays) that
     * quantized their f32 input themselves, and that read it quantized by
     * the launch that produced it (compute.h next_readers). */
    uint64_t act_quants, act_handed;
};
void cuda_compute_stats(const struct compute_ctx *cx, struct cuda_compute_stats *st);
/* For tests: the bf16 elements of one dequant tile of the quantized weights'
 * GEMM path (default CUDA_TILE_ELEMS_DEFAULT, 32 MiB), so that a small matrix
 * spans several tiles; set before the weights are uploaded. */
#define CUDA_TILE_ELEMS_DEFAULT ((size_t)16 << 20)
void cuda_compute_set_tile_elems(struct compute_ctx *cx, size_t elems);
/* For benchmarks that make weights on the device: t->data (weight_bytes(t)
 * bytes) already holds the file's rows (t->nbytes, CL_ROWS); puts them in
 * the backend's layout as weight_upload would after copying them. */
int cuda_compute_weight_prepare(struct compute_ctx *cx, struct ctensor *t);

#endif
