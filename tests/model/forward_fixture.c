/* forward_fixture: the forward tests' fixture (forward_fixture.h): a
 * random model loaded both ways (the daemon's and the dense reference), a
 * KV arena of scattered blocks, and the buffers a test frees at teardown. */
#include "forward_fixture.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t rs = 12345;

void fx_seed(uint64_t seed)
{
    rs = seed;
}

uint32_t fx_rnd(uint32_t n)
{
    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((rs >> 33) % n);
}

static size_t geom_block_bytes(const struct kv_geom *g)
{
    size_t esz = g->dtype == KV_F32 ? 4 : 2;
    return (size_t)g->layers * 2 * g->kv_heads * g->block_tokens * g->head_dim * esz;
}

void fx_init(struct fx *f, const char *args, enum kv_dtype kvt, uint32_t bt, uint32_t threads)
{
    struct kvd_error err = {0};
    memset(f, 0, sizeof *f);
    f->path = ref_gen_model(args);
    assert_non_null(f->path);
    struct model_opts o = {.n_threads = threads};
    int rc = model_load_opts(f->path, ref_cpu_backend(), &o, &f->m, &err);
    if (rc)
        fail_msg("model_load: %s", err.message);
    f->ref = ref_model_load(f->path);
    assert_non_null(f->ref);
    f->V = model_hparams(f->m)->n_vocab;
    assert_int_equal(f->V, ref_n_vocab(f->ref));
    model_kv_geom(f->m, bt, kvt, &f->geom);
    f->block_bytes = geom_block_bytes(&f->geom);
    f->arena = calloc(N_BLOCKS, f->block_bytes);
    assert_non_null(f->arena);
    assert_int_equal(fwd_ctx_new(f->m, 128, 8, &f->fc), 0);
    for (uint32_t i = 0; i < N_BLOCKS; i++)
        f->perm[i] = i;
    for (uint32_t i = N_BLOCKS - 1; i > 0; i--) {
        uint32_t j = fx_rnd(i + 1), t = f->perm[i];
        f->perm[i] = f->perm[j];
        f->perm[j] = t;
    }
}

void fx_free(struct fx *f)
{
    fwd_ctx_free(f->fc);
    model_free(f->m);
    ref_model_free(f->ref);
    free(f->arena);
    if (f->path)
        unlink(f->path);
    free(f->path);
    memset(f, 0, sizeof *f); /* freeing twice is harmless */
}

int t_setup(void **state)
{
    *state = calloc(1, sizeof(struct tstate));
    return *state ? 0 : -1;
}

/* The test's buffers, freed. */
void tfree(void **state)
{
    struct tstate *t = *state;
    for (unsigned i = 0; i < t->n_buf; i++)
        free(t->buf[i]);
    t->n_buf = 0;
}

int t_teardown(void **state)
{
    struct tstate *t = *state;
    if (t) {
        fx_free(&t->f);
        tfree(state);
        free(t);
    }
    return 0;
}

struct fx *t_fx(void **state)
{
    return &((struct tstate *)*state)->f;
}

/* A buffer of the test's, freed by tfree or the teardown. */
void *talloc(void **state, size_t bytes)
{
    struct tstate *t = *state;
    assert_true(t->n_buf < T_MAX_BUF);
    void *p = malloc(bytes);
    assert_non_null(p);
    t->buf[t->n_buf++] = p;
    return p;
}

/* A block table of n fresh scattered slots. */
void take_slots(struct fx *f, uint32_t *slots, uint32_t n)
{
    assert_true(f->next + n <= N_BLOCKS);
    memcpy(slots, f->perm + f->next, n * 4);
    f->next += n;
}

void forward1(struct fx *f, const uint32_t *tok, uint32_t n, uint32_t pos0, const uint32_t *slots,
              uint32_t n_slots, float *logits)
{
    struct fwd_seq s = {
        .tokens = tok, .n_tokens = n, .pos0 = pos0, .slots = slots, .n_slots = n_slots};
    struct fwd_batch b = {.seqs = &s,
                          .n_seqs = 1,
                          .kv_arena = f->arena,
                          .geom = &f->geom,
                          .n_arena_slots = N_BLOCKS,
                          .logits = logits};
    int rc = model_forward(f->m, f->fc, &b);
    if (rc)
        fail_msg("model_forward: %s", fwd_ctx_errmsg(f->fc));
}

void check_close(const float *got, const double *ref, size_t n, const char *what)
{
    double e = ref_rel_err(got, ref, n);
    print_message("  %-28s rel err %.2e\n", what, e);
    if (!(e <= TOL))
        fail_msg("%s: relative error %.3e > %.0e", what, e, TOL);
}
