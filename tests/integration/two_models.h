/* The tests of a daemon serving several models: two small models unlike
 * each other, written by kvd-gguf-gen into a fresh temporary folder, and
 * the calls those tests make on a model (greedy generate, its stats). */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kvd_harness.h"

/* Makes the folder from tmpl (mkdtemp's "...XXXXXX") into dir (cap 64) and
 * writes a: llama, f32 weights, 2 layers, vocabulary 500; b: qwen2, f16
 * weights, 3 layers, vocabulary 700, other head counts (paths cap 128).
 * $KVD_TOOLS_DIR has kvd-gguf-gen. 0, or -1 when any step failed. */
int two_models_make(const char *tmpl, char *dir, char *a, char *b);
/* Removes both files and the folder. */
void two_models_remove(const char *dir, const char *a, const char *b);

/* A greedy generation on one model of a running daemon: its tokens and
 * usage.cached. */
#define TM_GEN_MAX 16
struct tm_gen {
    uint32_t toks[TM_GEN_MAX];
    size_t n;
    uint64_t cached;
};
/* Greedy n_gen (at most TM_GEN_MAX) tokens of the n_p-token prompt p on
 * model; the test fails on an error reply or fewer tokens. */
void tm_generate(const struct kh_proc *d, const char *model, const uint32_t *p, size_t n_p,
                 uint32_t n_gen, struct tm_gen *g);
/* The test fails unless both generations gave the same tokens. */
void tm_same_tokens(const struct tm_gen *x, const struct tm_gen *y);
/* models[name].tier.key of an admin's stats (the test fails when absent). */
uint64_t tm_model_stat(const struct kh_proc *d, const char *name, const char *tier,
                       const char *key);
