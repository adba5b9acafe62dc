/* Test helpers for the model tests: generating a random GGUF with
 * kvd-gguf-gen, the cpu backend handle, and a plain dense reference forward
 * (one sequence, contiguous KV, double accumulation, K/V rounded to the KV
 * dtype like the paged cache) written independently of daemon/compute_cpu*. */
#ifndef KVD_TESTS_MODEL_REF_H
#define KVD_TESTS_MODEL_REF_H

#include <stddef.h>
#include <stdint.h>

#include "kvmm.h"

/* Runs kvd-gguf-gen with `args` into a fresh temp file; returns its path
 * (malloc'd) or NULL. */
char *ref_gen_model(const char *args);
/* The cpu backend (backend_cpu_new), created once; compute = compute_cpu_ops(). */
struct backend *ref_cpu_backend(void);

struct ref_model;
/* Reads every weight of the GGUF at path into doubles. NULL on failure. */
struct ref_model *ref_model_load(const char *path);
void ref_model_free(struct ref_model *r);
/* Logits [n_vocab] of the last of tokens[0..n), as double. */
void ref_forward(const struct ref_model *r, const uint32_t *tokens, uint32_t n, enum kv_dtype kvt,
                 double *logits);
uint32_t ref_n_vocab(const struct ref_model *r);

/* max|a-b| / max|ref| */
double ref_rel_err(const float *a, const double *ref, size_t n);

#endif
