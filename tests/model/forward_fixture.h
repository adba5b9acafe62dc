/* forward_fixture: what the forward tests (test_forward: logits against
 * the dense reference; test_forward_steps: bad batches, greedy decoding,
 * padded steps and the sample op, bad weights) share: a random model
 * loaded by the daemon's loader and by model_ref.c, an arena of N_BLOCKS
 * KV blocks whose block tables are drawn from a random permutation, one
 * sequence's forward, the logits' check against the reference, and
 * per-test buffers freed at teardown (also after a failed assert). */
#ifndef KVD_TEST_FORWARD_FIXTURE_H
#define KVD_TEST_FORWARD_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "kvd/status.h"
#include "gguf.h"
#include "model.h"
#include "model_impl.h"
#include "model/model_ref.h"

#define TOL 1e-4
#define N_BLOCKS 96
/* the random models' common shape */
#define SHAPE "--embd 64 --heads 4 --ff 96 --vocab 300 --layers 2 --ctx 256"

struct fx {
    char *path;
    struct model *m;
    struct ref_model *ref;
    struct fwd_ctx *fc;
    struct kv_geom geom;
    void *arena;
    size_t block_bytes;
    uint32_t V;
    uint32_t perm[N_BLOCKS]; /* a random permutation: block tables draw from it */
    uint32_t next;           /* next unused entry of perm */
};

/* Each test's fixture (fx_init/fx_free may run several times in one test)
 * and buffers (talloc), in CMocka setup/teardown: whatever is left is
 * freed, also after a failed assert. */
#define T_MAX_BUF 16
struct tstate {
    struct fx f;
    void *buf[T_MAX_BUF];
    unsigned n_buf;
};

/* The tests' random numbers below n (one sequence per process, from the
 * seed fx_seed set last, 12345 at start). */
void fx_seed(uint64_t seed);
uint32_t fx_rnd(uint32_t n);
/* The model of kvd-gguf-gen args, KV of type kvt in blocks of bt tokens,
 * loaded with threads compute threads; fx_free undoes it (twice is
 * harmless). */
void fx_init(struct fx *f, const char *args, enum kv_dtype kvt, uint32_t bt, uint32_t threads);
void fx_free(struct fx *f);
/* CMocka setup and teardown of a struct tstate. */
int t_setup(void **state);
int t_teardown(void **state);
/* The test's buffers, freed. */
void tfree(void **state);
struct fx *t_fx(void **state);
/* A buffer of the test's, freed by tfree or the teardown. */
void *talloc(void **state, size_t bytes);
/* A block table of n fresh scattered slots. */
void take_slots(struct fx *f, uint32_t *slots, uint32_t n);
/* One sequence's forward: n tokens from pos0 over its block table; the
 * last position's logits. */
void forward1(struct fx *f, const uint32_t *tok, uint32_t n, uint32_t pos0, const uint32_t *slots,
              uint32_t n_slots, float *logits);
/* got within TOL (relative) of the reference's, printed as what. */
void check_close(const float *got, const double *ref, size_t n, const char *what);

#endif
