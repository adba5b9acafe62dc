/* roofline: the FLOP/byte model of one executor step (from the model's
 * shape and the batch), the backend's two ceilings measured at startup
 * (bytes/s of a large device copy, FLOP/s of a large GEMM), and a rolling
 * window per phase (prefill, decode, mixed) of what steps achieved. */
#ifndef KVD_ROOFLINE_H
#define KVD_ROOFLINE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* The shape numbers the cost model needs. Dimensions are element counts;
 * byte sizes are what one step really reads from memory. */
struct roofline_shape {
    uint32_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab;
    /* Weight bytes every step reads in full: all layers' matrices and norms,
     * the final norm and the output matrix (the embedding table when tied).
     * An untied embedding table is not in here: a step reads only the rows
     * of its tokens (embd_row_bytes each). */
    uint64_t step_weight_bytes;
    uint64_t embd_row_bytes;
    uint64_t kv_token_bytes; /* K+V of one position, all layers (kv_token_bytes(geom)) */
    uint32_t act_bytes;      /* bytes of one activation element (4: f32) */
};

/* One sequence of a step: n new tokens at positions [pos0, pos0 + n). */
struct roofline_seq {
    uint32_t n_tokens, pos0;
};

enum roofline_phase { ROOFLINE_PREFILL = 0, ROOFLINE_DECODE = 1, ROOFLINE_MIXED = 2 };
#define ROOFLINE_N_PHASES 3
const char *roofline_phase_name(enum roofline_phase p); /* "prefill", "decode", "mixed" */

/* FLOPs (2 per multiply-add) and bytes of one step, by part. Elementwise
 * work (norms, RoPE, softmax, SiLU, residual adds) is left out: it is a few
 * FLOPs per activation element, under 1% of the matmuls for real shapes. */
struct roofline_cost {
    double flops_proj; /* Q, K, V and output projections */
    double flops_attn; /* QK^T and AV over each row's causal context */
    double flops_mlp;  /* gate, up, down */
    double flops_head; /* LM head, one row per sequence (its last position) */
    double bytes_weights, bytes_kv_read, bytes_kv_write, bytes_act;
    double flops, bytes; /* totals */
    uint32_t n_tokens, n_seqs;
    enum roofline_phase phase;
};

/* The cost of a step over seqs[0..n). Phase: decode when every sequence
 * has one new token, prefill when none has exactly one, mixed otherwise. */
void roofline_step_cost(const struct roofline_shape *s, const struct roofline_seq *seqs, uint32_t n,
                        struct roofline_cost *out);

/* The backend's ceilings. bytes_per_s counts bytes read plus bytes written
 * (a copy of N bytes moves 2N), the unit the step model's bytes use. */
struct roofline_ceilings {
    double bytes_per_s, flops_per_s;
    double measure_ms; /* how long the measurement took */
    double copy_ms;    /* of which the copy probe */
    bool measured;     /* false: skipped or failed (fractions are then 0) */
    char how[96];      /* e.g. "cpu: memcpy 32 MiB, matmul f16 512x1024x1024" */
};

/* Measures both ceilings on be (its copy() device→device, and its
 * compute->matmul on an f16 weight), in well under half a second: each
 * probe repeats until ~120 ms have passed and keeps the best run.
 * Returns 0, or an enum kvd_err when memory or the compute table is
 * missing (c->measured stays false). */
int roofline_measure(struct backend *be, uint32_t n_threads, struct roofline_ceilings *c);

/* A rolling window: the last ROOFLINE_WINDOW steps of each phase. */
#define ROOFLINE_WINDOW 128

struct roofline_sample {
    double flops, bytes;
    uint64_t ns; /* wall time of the step's forward */
    uint32_t n_tokens;
};

struct roofline_summary {
    enum roofline_phase phase;
    uint64_t steps_total;                             /* steps of this phase since start */
    uint32_t window;                                  /* steps in the window now */
    double flops_per_step, bytes_per_step, intensity; /* intensity: FLOP/byte */
    double flops_per_s, bytes_per_s;                  /* achieved over the window */
    double flops_frac, bytes_frac;                    /* of the ceilings; 0 when not measured */
    double ms_per_step, tokens_per_s;
    const char *bound; /* "compute", "bandwidth", or "unknown" without ceilings */
};

struct roofline_window {
    struct roofline_sample ring[ROOFLINE_WINDOW];
    uint32_t head, n; /* next slot, samples held */
    uint64_t total;   /* steps since start */
    double flops_total, bytes_total, seconds_total;
};

/* Shared by the executor (writer) and the stats/metrics readers: its own
 * mutex, held for a few dozen instructions. */
struct roofline {
    pthread_mutex_t mu;
    struct roofline_shape shape;
    bool have_shape;
    struct roofline_ceilings ceil;
    struct roofline_window ph[ROOFLINE_N_PHASES];
};

struct model_hparams;
struct kv_geom;
/* The shape of a loaded model with KV geometry g (act_bytes 4). */
void roofline_shape_from_model(const struct model_hparams *hp, const struct kv_geom *g,
                               struct roofline_shape *s);

void roofline_init(struct roofline *rl);
void roofline_destroy(struct roofline *rl);
void roofline_set_shape(struct roofline *rl, const struct roofline_shape *s);
void roofline_set_ceilings(struct roofline *rl, const struct roofline_ceilings *c);
void roofline_get_ceilings(struct roofline *rl, struct roofline_ceilings *c);
/* The executor, after each forward: costs the step with the shape set
 * before and records it with its wall time. A no-op without a shape. */
void roofline_record(struct roofline *rl, const struct roofline_seq *seqs, uint32_t n, uint64_t ns);
/* The same from the executor's own batch description (model.h). */
struct fwd_seq;
void roofline_record_fwd(struct roofline *rl, const struct fwd_seq *seqs, uint32_t n, uint64_t ns);
/* The same with the step's own model shape (several models share one
 * window: each step is costed by its model). */
void roofline_record_fwd_shape(struct roofline *rl, const struct roofline_shape *shape,
                               const struct fwd_seq *seqs, uint32_t n, uint64_t ns);
/* Records an already-costed step (tests). */
void roofline_record_cost(struct roofline *rl, const struct roofline_cost *c, uint64_t ns);
void roofline_summary(struct roofline *rl, enum roofline_phase p, struct roofline_summary *out);
/* Cumulative totals of a phase (for counters): steps, FLOPs, bytes, seconds. */
void roofline_totals(struct roofline *rl, enum roofline_phase p, uint64_t *steps, double *flops,
                     double *bytes, double *seconds);

#endif
