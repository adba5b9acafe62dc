/* The forward's steps beyond the logits (the logits against the reference:
 * test_forward.c): batch validation (nothing written on a bad batch),
 * greedy-decode sanity, the sample op inside the step, decode and mixed
 * steps padded to a bucket (what the cuda backend does for CUDA graphs)
 * equal to unpadded ones, and non-finite weights refused at load. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "forward_fixture.h"

/* Every bad batch is refused with a clear code before anything is written. */
static void t_validation(void **s)
{
    struct fx *f = t_fx(s);
    fx_init(f, SHAPE " --type f16 --kv-heads 2 --seed 11", KV_F16, 4, 2);
    uint32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8}, slots[4] = {0, 1, 2, 3}, bad_tok[2] = {1, 300};
    float *lg = talloc(s, 2 * f->V * 4);
    void *copy = talloc(s, N_BLOCKS * f->block_bytes);
    memset(f->arena, 0x5a, N_BLOCKS * f->block_bytes);
    memcpy(copy, f->arena, N_BLOCKS * f->block_bytes);
    struct fwd_seq sq = {.tokens = tok, .n_tokens = 8, .pos0 = 0, .slots = slots, .n_slots = 2};
    struct fwd_batch b = {.seqs = &sq,
                          .n_seqs = 1,
                          .kv_arena = f->arena,
                          .geom = &f->geom,
                          .n_arena_slots = N_BLOCKS,
                          .logits = lg};
    assert_int_equal(model_forward(f->m, f->fc, &b), 0); /* baseline works */
    memcpy(copy, f->arena, N_BLOCKS * f->block_bytes);

    sq.tokens = bad_tok, sq.n_tokens = 2;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "vocabulary"));
    sq.tokens = tok, sq.n_tokens = 8, sq.n_slots = 1; /* 8 tokens need 2 blocks of 4 */
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    sq.n_slots = 2, sq.pos0 = 250; /* past n_ctx 256 */
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "context"));
    sq.pos0 = 0, sq.n_tokens = 0;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    sq.n_tokens = 8;
    uint32_t far[2] = {0, N_BLOCKS};
    sq.slots = far;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "arena"));
    uint32_t dup[2] = {3, 3};
    sq.slots = dup;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    /* two sequences writing the same block */
    struct fwd_seq two[2] = {
        {.tokens = tok, .n_tokens = 2, .pos0 = 0, .slots = slots, .n_slots = 1},
        {.tokens = tok, .n_tokens = 2, .pos0 = 0, .slots = slots, .n_slots = 1}};
    b.seqs = two, b.n_seqs = 2;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "written"));
    /* sharing a read-only prefix block is fine: both decode at pos 4..5 */
    uint32_t s0[2] = {0, 5}, s1[2] = {0, 6};
    two[0] = (struct fwd_seq){.tokens = tok, .n_tokens = 1, .pos0 = 4, .slots = s0, .n_slots = 2};
    two[1] = (struct fwd_seq){.tokens = tok, .n_tokens = 1, .pos0 = 4, .slots = s1, .n_slots = 2};
    assert_int_equal(model_forward(f->m, f->fc, &b), 0);
    memcpy(copy, f->arena, N_BLOCKS * f->block_bytes);
    /* one sequence writes block 5 (pos 4), the other reads it as a prefix */
    uint32_t s2[3] = {1, 5, 7};
    two[1] = (struct fwd_seq){.tokens = tok, .n_tokens = 1, .pos0 = 8, .slots = s2, .n_slots = 3};
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "slot 5 is written"));
    /* the reader first, the writer second: the same */
    struct fwd_seq sw = two[0];
    two[0] = two[1], two[1] = sw;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "slot 5 is written"));
    /* too many tokens / sequences for the context */
    uint32_t many[200] = {0}, ms[64];
    for (int i = 0; i < 64; i++)
        ms[i] = (uint32_t)i;
    struct fwd_seq big = {.tokens = many, .n_tokens = 200, .pos0 = 0, .slots = ms, .n_slots = 50};
    b.seqs = &big, b.n_seqs = 1;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_ETOOLARGE);
    struct fwd_seq nine[9];
    for (int i = 0; i < 9; i++)
        nine[i] = (struct fwd_seq){
            .tokens = tok, .n_tokens = 1, .pos0 = 0, .slots = ms + i, .n_slots = 1};
    b.seqs = nine, b.n_seqs = 9;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_ETOOLARGE);
    struct kv_geom bad = f->geom;
    bad.head_dim++;
    b.seqs = &sq, b.n_seqs = 1, b.geom = &bad;
    sq.slots = slots;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_memory_equal(copy, f->arena, N_BLOCKS * f->block_bytes);
    tfree(s);
    fx_free(f);
}

/* Greedy decoding on random models (untied and tied output) keeps
 * producing varied tokens: the generator's weight scales are sane. */
static void greedy_varied(void **state, const char *args)
{
    struct fx *f = t_fx(state);
    fx_init(f, args, KV_F16, 16, 2);
    uint32_t slots[8], tok = 1, seen[400] = {0}, distinct = 0;
    take_slots(f, slots, 8);
    float *lg = talloc(state, f->V * 4);
    for (uint32_t p = 0; p < 64; p++) {
        forward1(f, &tok, 1, p, slots, p / 16 + 1, lg);
        uint32_t best = 0;
        for (uint32_t i = 1; i < f->V; i++)
            best = lg[i] > lg[best] ? i : best;
        tok = best;
        distinct += !seen[tok]++;
    }
    print_message("  greedy: %u distinct tokens of 64\n", distinct);
    assert_true(distinct >= 8);
    tfree(state);
    fx_free(f);
}

static void t_greedy_varied(void **s)
{
    greedy_varied(
        s,
        "--embd 128 --heads 4 --kv-heads 2 --ff 256 --vocab 400 --layers 4 --type f16 --seed 12");
    greedy_varied(s, "--embd 128 --heads 4 --kv-heads 2 --ff 256 --vocab 400 --layers 4 --type "
                     "q8_0 --tied --seed 13");
}

/* ---- padded decode steps and the sample op ------------------------------ */

static const struct compute_ops *pad_base;
static uint32_t pad_max_rows, pad_calls;

static uint32_t pad_to_8(struct compute_ctx *cx, uint32_t n)
{
    (void)cx;
    pad_calls++;
    return 8;
}

/* A mixed step's rows, output rows and max_q: 13 more, at most what the
 * fwd_ctx holds (model_forward clamps). */
static uint32_t pad_rows_13(struct compute_ctx *cx, uint32_t n)
{
    (void)cx;
    return n + 13;
}

static int pad_matmul(struct compute_ctx *cx, const struct ctensor *w, const float *x,
                      uint32_t rows, float *y)
{
    pad_max_rows = rows > pad_max_rows ? rows : pad_max_rows;
    return pad_base->matmul(cx, w, x, rows, y);
}

/* Three sequences prefill together and decode six steps twice, in
 * separate blocks: once as is, once with every step padded, to 8
 * sequences through step_bucket, and the prefill (a mixed step) also to 13
 * more rows, output rows and max_q through row_bucket. Logits agree to
 * rounding (3 rows and 8 rows take different matmul kernels), the sampled
 * tokens (greedy, top-k, top-p rows) are equal, the padded run really ran
 * 8 rows (45 in the prefill), and no block outside the sequences' was
 * written. */
static void t_padded_decode(void **st)
{
    struct fx *f = t_fx(st);
    fx_init(f, SHAPE " --type f16 --kv-heads 2 --seed 21", KV_F16, 8, 2);
    enum { NS = 3, STEPS = 6, BPS = 5 };
    static const uint32_t plen[NS] = {11, 4, 17};
    uint32_t tabs[2][NS][BPS], toks[NS][32], used[N_BLOCKS] = {0};
    for (int r = 0; r < 2; r++)
        for (int s = 0; s < NS; s++) {
            take_slots(f, tabs[r][s], BPS);
            for (uint32_t i = 0; i < (plen[s] + STEPS + 7) / 8; i++) /* blocks reached */
                used[tabs[r][s][i]] = 1;
        }
    for (int s = 0; s < NS; s++)
        for (uint32_t i = 0; i < plen[s]; i++)
            toks[s][i] = fx_rnd(f->V);
    struct compute_ops padded = *f->m->ops;
    padded.step_bucket = pad_to_8;
    padded.row_bucket = pad_rows_13;
    padded.matmul = pad_matmul;
    pad_base = f->m->ops;
    float *lg[2];
    for (int r = 0; r < 2; r++) {
        lg[r] = talloc(st, (size_t)NS * f->V * 4);
    }
    struct sample_row rows[NS] = {
        {.top_p = 1.0f},
        {.temperature = 0.9f, .top_k = 20, .top_p = 1.0f},
        {.temperature = 1.3f, .top_p = 0.9f},
    };
    for (uint32_t step = 0; step <= STEPS; step++) {
        uint32_t picks[2][NS];
        for (int r = 0; r < 2; r++) {
            struct fwd_seq seqs[NS];
            for (int s = 0; s < NS; s++) {
                uint32_t pos = step ? plen[s] + step - 1 : 0;
                seqs[s] = (struct fwd_seq){.tokens = step ? &toks[s][pos] : toks[s],
                                           .n_tokens = step ? 1 : plen[s],
                                           .pos0 = pos,
                                           .slots = tabs[r][s],
                                           .n_slots = BPS};
                rows[s].u = (double)((step * 7 + (uint32_t)s * 3) % 10) / 10.0 + 0.05;
            }
            struct fwd_batch b = {.seqs = seqs,
                                  .n_seqs = NS,
                                  .kv_arena = f->arena,
                                  .geom = &f->geom,
                                  .n_arena_slots = N_BLOCKS,
                                  .logits = lg[r],
                                  .sample = rows,
                                  .tokens = picks[r]};
            pad_max_rows = 0;
            f->m->ops = r ? &padded : pad_base;
            int rc = model_forward(f->m, f->fc, &b);
            f->m->ops = pad_base;
            if (rc)
                fail_msg("model_forward (%s): %s", r ? "padded" : "as is", fwd_ctx_errmsg(f->fc));
            if (r)
                assert_int_equal(pad_max_rows, step ? 8 : 11 + 4 + 17 + 13);
        }
        for (size_t i = 0; i < (size_t)NS * f->V; i++)
            if (!(fabsf(lg[0][i] - lg[1][i]) <= 1e-4f * (1 + fabsf(lg[0][i]))))
                fail_msg("step %u logit %zu: as is %.9g, padded %.9g", step, i, (double)lg[0][i],
                         (double)lg[1][i]);
        for (int s = 0; s < NS; s++) {
            assert_int_equal(picks[0][s], picks[1][s]);
            uint32_t best = 0;
            for (uint32_t i = 1; i < f->V; i++)
                best = lg[0][(size_t)s * f->V + i] > lg[0][(size_t)s * f->V + best] ? i : best;
            if (s == 0)
                assert_int_equal(picks[0][s], best);
            toks[s][plen[s] + step] = picks[0][s];
        }
    }
    assert_int_equal(pad_calls, STEPS + 1);
    for (uint32_t blk = 0; blk < N_BLOCKS; blk++) {
        if (used[blk])
            continue;
        const uint8_t *p = (const uint8_t *)f->arena + (size_t)blk * f->block_bytes;
        for (size_t i = 0; i < f->block_bytes; i++)
            if (p[i])
                fail_msg("block %u, outside every sequence, was written", blk);
    }
    tfree(st);
    fx_free(f);
}

/* One value of a weight made non-finite in the file: the load is refused
 * naming the tensor, for a float type and for a quantized block's scale. */
static void corrupt_and_load(const char *args, size_t at_in_tensor, const void *bytes, size_t n)
{
    char *path = ref_gen_model(args);
    assert_non_null(path);
    char err[256] = "";
    struct gguf *g = NULL;
    assert_int_equal(gguf_open(path, &g, err, sizeof err), 0);
    const struct gguf_tensor *t = gguf_find_tensor(g, "blk.0.attn_q.weight");
    assert_non_null(t);
    off_t at = (off_t)(g->data_offset + t->offset + at_in_tensor);
    gguf_close(g);
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseeko(f, at, SEEK_SET), 0);
    assert_int_equal(fwrite(bytes, 1, n, f), n);
    fclose(f);
    struct model *m = NULL;
    struct kvd_error merr = {0};
    int rc = model_load(path, ref_cpu_backend(), &m, &merr);
    unlink(path);
    free(path);
    assert_int_equal(rc, KVD_EBADREQ);
    assert_int_equal(merr.code, KVD_EBADREQ);
    assert_null(m);
    if (!strstr(merr.message, "blk.0.attn_q.weight") || !strstr(merr.message, "NaN or an infinity"))
        fail_msg("unexpected error: %s", merr.message);
}

static void t_non_finite_weights(void **state)
{
    (void)state;
    const float nan_f = NAN;
    corrupt_and_load("--layers 1 --embd 64 --heads 4 --kv-heads 2 --ff 128 --vocab 64 --type f32",
                     4 * 17, &nan_f, 4);
    const uint16_t inf_h = 0x7c00;
    corrupt_and_load("--layers 1 --embd 64 --heads 4 --kv-heads 2 --ff 128 --vocab 64 --type f16",
                     2 * 5, &inf_h, 2);
    corrupt_and_load("--layers 1 --embd 64 --heads 4 --kv-heads 2 --ff 128 --vocab 64 --type q4_0",
                     18, &inf_h, 2); /* the second block's d */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(t_validation, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_greedy_varied, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_padded_decode, t_setup, t_teardown),
        cmocka_unit_test(t_non_finite_weights),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
