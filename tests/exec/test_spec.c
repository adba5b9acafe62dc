/* Speculative decoding in the executor, on the cpu backend: greedy output
 * with n-gram and draft-model drafts is plain greedy output token for
 * token on 200 prompts, and the K/V a verification leaves is plain
 * decoding's byte for byte (batch-invariant rows); seeded sampling keeps
 * its tokens too; preemption and cancel in the middle of speculative
 * requests; a draft model of another vocabulary is refused; the draft's
 * cache is a tenant's own, named after the tenant (a later tenant that
 * reuses a removed one's id matches nothing of it); the counters. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "exec_fixture.h"

#define N_PROMPTS 200
#define GEN 40
#define MAX_PROMPT 64
#define SEQ_CHECKS 12 /* prompts whose K/V is compared byte for byte */

static struct fx_model target, small_draft, other_vocab;

static int group_setup(void **state)
{
    (void)state;
    if (fx_model_make_args(&target, 256, 1024,
                           "--layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 --type f16 "
                           "--seed 7") ||
        fx_model_make_args(&small_draft, 256, 1024,
                           "--layers 1 --embd 32 --heads 2 --kv-heads 1 --ff 64 --type f32 "
                           "--seed 9") ||
        fx_model_make_args(&other_vocab, 300, 1024,
                           "--layers 1 --embd 32 --heads 2 --kv-heads 1 --ff 64 --type f32 "
                           "--seed 9"))
        return -1;
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    fx_model_remove(&target);
    fx_model_remove(&small_draft);
    fx_model_remove(&other_vocab);
    return 0;
}

/* Prompt i: a segment, other tokens, then the segment's start again, so
 * the n-gram lookup has something to copy from the first step on. */
static size_t prompt(uint32_t *p, uint32_t i)
{
    uint32_t seg[16], fill[32];
    size_t ns = 8 + i % 9, nf = 4 + (i * 7) % 24, nr = 2 + i % 5;
    fx_prompt(seg, ns, i);
    fx_prompt(fill, nf, i + 1000);
    size_t n = 0;
    memcpy(p + n, seg, ns * 4), n += ns;
    memcpy(p + n, fill, nf * 4), n += nf;
    memcpy(p + n, seg, nr * 4), n += nr;
    return n;
}

struct outs {
    uint32_t toks[N_PROMPTS][GEN];
    size_t n[N_PROMPTS];
};

/* Runs prompts [0, n) with this `speculative` (NULL: absent), `wave`
 * requests at a time, greedy unless temperature >= 0 (then seeded by the
 * prompt's index). */
static void run(struct fx *f, const char *spec, uint32_t n, uint32_t wave, double temperature,
                struct outs *o)
{
    for (uint32_t w = 0; w < n; w += wave) {
        fx_reset_results();
        uint32_t m = n - w < wave ? n - w : wave;
        uint32_t p[8][MAX_PROMPT];
        assert_true(m <= 8);
        for (uint32_t j = 0; j < m; j++) {
            uint32_t *pp = p[j];
            size_t np = prompt(pp, w + j);
            struct fx_gen g = {.toks = pp,
                               .n_toks = np,
                               .max_tokens = GEN,
                               .temperature = temperature >= 0 ? temperature : 0,
                               .has_seed = temperature > 0,
                               .seed = w + j,
                               .speculative = spec};
            struct kvd_error err = {0};
            assert_int_equal(fx_submit(f, 1 + j, &g, &err), 0);
        }
        for (uint32_t j = 0; j < m; j++) {
            struct fx_result *x = fx_wait(1 + j);
            assert_int_equal(x->finish, SCHED_FINISH_LENGTH);
            o->n[w + j] = x->n;
            memcpy(o->toks[w + j], x->toks, x->n * 4);
        }
    }
}

static void same(const struct outs *a, const struct outs *b, uint32_t n, const char *what)
{
    for (uint32_t i = 0; i < n; i++) {
        if (a->n[i] != b->n[i])
            fail_msg("%s: prompt %u: %zu tokens, plain %zu", what, i, b->n[i], a->n[i]);
        for (size_t t = 0; t < a->n[i]; t++)
            if (a->toks[i][t] != b->toks[i][t])
                fail_msg("%s: prompt %u: token %zu is %u, plain decoding's %u", what, i, t,
                         b->toks[i][t], a->toks[i][t]);
    }
}

static struct outs plain_out, spec_out;

static void open_spec(struct fx *f, enum spec_kind kind, const char *draft, uint32_t dev,
                      uint32_t host)
{
    fx_spec = (struct spec_conf){.kind = kind};
    fx_draft_path = draft;
    int rc = fx_open(f, &target, dev, host, 256, 16);
    fx_draft_path = NULL;
    fx_spec = (struct spec_conf){0};
    assert_int_equal(rc, 0);
}

/* Plain greedy output of every prompt (speculation off per request). */
static void plain_greedy(struct fx *f)
{
    open_spec(f, SPEC_NGRAM, NULL, 1024, 0);
    run(f, "off", N_PROMPTS, 8, -1, &plain_out);
    struct exec_stats st;
    exec_stats(f->ex, &st);
    assert_int_equal(st.spec.verifies, 0);
    fx_close(f);
}

static void test_ngram_greedy_identical(void **state)
{
    struct fx *f = *state;
    plain_greedy(f);
    open_spec(f, SPEC_NGRAM, NULL, 1024, 0);
    run(f, NULL, N_PROMPTS, 4, -1, &spec_out); /* the daemon's choice: ngram */
    same(&plain_out, &spec_out, N_PROMPTS, "ngram");
    struct exec_stats st;
    exec_stats(f->ex, &st);
    print_message("ngram: %llu verifications, %llu of %llu drafts kept, %llu tokens\n",
                  (unsigned long long)st.spec.verifies, (unsigned long long)st.spec.accepted,
                  (unsigned long long)st.spec.drafted, (unsigned long long)st.spec.spec_tokens);
    assert_true(st.spec.verifies > 0);
    assert_true(st.spec.accepted > 0);
    assert_true(st.spec.accepted < st.spec.drafted); /* rejections were exercised */
    assert_true(st.spec.ngram_drafts == st.spec.verifies);
    assert_true(st.spec.spec_tokens == st.spec.verifies + st.spec.accepted ||
                st.spec.spec_tokens < st.spec.verifies + st.spec.accepted); /* stops cut some */
    /* the verifications' tokens count as decode tokens */
    assert_true(st.sched.decode_tokens >= st.spec.spec_tokens);
}

static void test_draft_greedy_identical(void **state)
{
    struct fx *f = *state;
    plain_greedy(f);
    /* a small draft of the same vocabulary: mostly rejected */
    open_spec(f, SPEC_DRAFT, small_draft.path, 1024, 0);
    run(f, "draft", N_PROMPTS, 4, -1, &spec_out);
    same(&plain_out, &spec_out, N_PROMPTS, "small draft");
    struct exec_stats st;
    exec_stats(f->ex, &st);
    assert_true(st.spec.model_drafts > 0 && st.spec.model_drafts == st.spec.verifies);
    fx_close(f);
    /* the served model as its own draft: its drafts are its own picks, so
     * nearly all are kept (every path of a long acceptance) */
    open_spec(f, SPEC_DRAFT, target.path, 1024, 0);
    run(f, NULL, N_PROMPTS / 4, 4, -1, &spec_out);
    same(&plain_out, &spec_out, N_PROMPTS / 4, "self draft");
    exec_stats(f->ex, &st);
    print_message("self draft: %llu of %llu drafts kept\n", (unsigned long long)st.spec.accepted,
                  (unsigned long long)st.spec.drafted);
    assert_true(st.spec.accepted * 10 > st.spec.drafted * 9);
}

/* Sampling: the verification picks each row with the uniform plain
 * decoding would draw for that position, so a seeded request keeps its
 * tokens (the distribution is exact either way). */
static void test_sampled_same_seed(void **state)
{
    struct fx *f = *state;
    enum { N = 48 };
    open_spec(f, SPEC_NGRAM, NULL, 1024, 0);
    run(f, "off", N, 8, 0.9, &plain_out);
    run(f, "ngram", N, 4, 0.9, &spec_out);
    same(&plain_out, &spec_out, N, "ngram sampled");
    struct exec_stats st;
    exec_stats(f->ex, &st);
    assert_true(st.spec.verifies > 0);
}

/* The K/V left in a lent sequence after a speculative generate equals
 * plain decoding's byte for byte, token ids too (rejected drafts' slots
 * gone). */
static void seq_kv(struct fx *f, uint32_t i, const char *spec, uint8_t **kv, size_t *len,
                   uint32_t **ids, size_t *n_ids)
{
    uint32_t p[MAX_PROMPT];
    size_t np = prompt(p, i);
    kvmm_seq_t seq;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, 1, f->tenant, f->ns, &seq), 0);
    kvmm_unlock(f->mm);
    fx_reset_results();
    struct fx_gen g = {.toks = p,
                       .n_toks = np,
                       .max_tokens = GEN,
                       .temperature = 0,
                       .has_seq = true,
                       .seq = seq,
                       .speculative = spec};
    struct kvd_error err = {0};
    assert_int_equal(fx_submit(f, 1, &g, &err), 0);
    struct fx_result *x = fx_wait(1);
    assert_int_equal(x->finish, SCHED_FINISH_LENGTH);
    assert_true(x->seq_returned);
    kvmm_lock(f->mm);
    struct kvmm_seq_info info;
    assert_int_equal(kvmm_seq_info(f->mm, 1, seq, &info), 0);
    /* every generated token but the last is in K/V */
    assert_int_equal(info.n_tokens, np + GEN - 1);
    assert_int_equal(info.n_committed, info.n_tokens);
    *len = info.n_tokens * kv_token_bytes(kvmm_geom(f->mm));
    *kv = malloc(*len);
    assert_non_null(*kv);
    assert_int_equal(kvmm_seq_read(f->mm, 1, seq, 0, info.n_tokens, *kv, *len), 0);
    const uint32_t *t = kvmm_seq_tokens(f->mm, 1, seq, n_ids);
    *ids = malloc(*n_ids * 4);
    assert_non_null(*ids);
    memcpy(*ids, t, *n_ids * 4);
    assert_int_equal(kvmm_seq_close(f->mm, 1, seq), 0);
    kvmm_unlock(f->mm);
}

static void test_kv_byte_identical(void **state)
{
    struct fx *f = *state;
    open_spec(f, SPEC_NGRAM, NULL, 1024, 0);
    uint64_t verified = 0;
    for (uint32_t i = 0; i < SEQ_CHECKS; i++) {
        uint8_t *a, *b;
        uint32_t *ia, *ib;
        size_t la, lb, na, nb;
        seq_kv(f, i, "off", &a, &la, &ia, &na);
        struct exec_stats st;
        exec_stats(f->ex, &st);
        uint64_t before = st.spec.accepted;
        seq_kv(f, i, "ngram", &b, &lb, &ib, &nb);
        exec_stats(f->ex, &st);
        verified += st.spec.accepted - before;
        assert_int_equal(na, nb);
        assert_memory_equal(ia, ib, na * 4);
        assert_int_equal(la, lb);
        if (memcmp(a, b, la))
            fail_msg("prompt %u: the K/V after speculative decoding differs from plain "
                     "decoding's",
                     i);
        free(a), free(b), free(ia), free(ib);
    }
    assert_true(verified > 0); /* accepted drafts' K/V was among what was compared */
}

/* A pool too small for four speculative requests at once: they are
 * preempted (recomputed: no host tier) in the middle and still give
 * plain decoding's tokens. */
static void test_preempt_mid_spec(void **state)
{
    struct fx *f = *state;
    enum { N = 8 };
    open_spec(f, SPEC_NGRAM, NULL, 1024, 0);
    run(f, "off", N, 4, -1, &plain_out);
    fx_close(f);
    /* each of these requests holds 4 to 6 blocks (54 to 81 tokens) */
    open_spec(f, SPEC_NGRAM, NULL, 12, 0);
    run(f, "ngram", N, 4, -1, &spec_out);
    same(&plain_out, &spec_out, N, "preempted");
    struct exec_stats st;
    exec_stats(f->ex, &st);
    assert_true(st.sched.preempt_recompute > 0);
    assert_true(st.spec.verifies > 0);
}

/* Cancelled in the middle: answered `cancelled` with a prefix of plain
 * decoding's tokens, its draft sequence released. */
static void test_cancel_mid_spec(void **state)
{
    struct fx *f = *state;
    open_spec(f, SPEC_DRAFT, target.path, 1024, 0);
    run(f, "off", 1, 1, -1, &plain_out);
    fx_reset_results();
    uint32_t p[MAX_PROMPT];
    size_t np = prompt(p, 0);
    struct fx_gen g = {.toks = p,
                       .n_toks = np,
                       .max_tokens = 400,
                       .temperature = 0,
                       .stream = true,
                       .speculative = "draft"};
    fx_pause_at(1, 3);
    struct kvd_error err = {0};
    assert_int_equal(fx_submit(f, 1, &g, &err), 0);
    fx_wait_paused();
    bool found = false;
    exec_cancel(f->ex, 1, 1, &found);
    assert_true(found);
    fx_resume();
    struct fx_result *x = fx_wait(1);
    assert_int_equal(x->finish, SCHED_FINISH_CANCELLED);
    assert_true(x->n > 0 && x->n < 400);
    for (size_t t = 0; t < x->n && t < GEN; t++)
        assert_int_equal(x->toks[t], plain_out.toks[0][t]);
    struct exec_stats st;
    exec_stats(f->ex, &st);
    assert_true(st.spec.verifies > 0);
}

static void test_other_vocab_refused(void **state)
{
    struct fx *f = *state;
    open_spec(f, SPEC_OFF, NULL, 64, 0);
    struct draft_conf dc = {.path = other_vocab.path,
                            .target_path = target.path,
                            .target = model_hparams(f->m),
                            .be = f->be,
                            .n_threads = 1,
                            .block_tokens = 16,
                            .dtype = KV_F16,
                            .max_seqs = 4,
                            .step_tokens = 64};
    struct draft *d = NULL;
    struct kvd_error err = {0};
    assert_int_equal(draft_open(&dc, &d, &err), KVD_EBADREQ);
    assert_null(d);
    assert_non_null(strstr(err.message, "vocabulary"));
    assert_non_null(strstr(err.message, "300"));
    /* a request asking for a draft model the daemon does not have */
    uint32_t p[4] = {1, 2, 3, 4};
    struct fx_gen g = {.toks = p, .n_toks = 4, .max_tokens = 4, .speculative = "draft"};
    assert_int_equal(fx_submit(f, 1, &g, &err), KVD_EUNSUPPORTED);
    assert_string_equal(err.param, "speculative");
    g.speculative = "sometimes";
    assert_int_equal(fx_submit(f, 1, &g, &err), KVD_EBADREQ);
    assert_string_equal(err.param, "speculative");
}

/* One greedy draft-speculated request of tenant t (namespace ns), to its
 * end. */
static void draft_run(struct fx *f, uint64_t id, uint32_t t, uint32_t ns, const uint32_t *p,
                      size_t n)
{
    struct fx_gen g = {.toks = p,
                       .n_toks = n,
                       .max_tokens = 6,
                       .temperature = 0,
                       .has_tenant = true,
                       .tenant = t,
                       .ns = ns,
                       .speculative = "draft"};
    struct kvd_error err = {0};
    assert_int_equal(fx_submit(f, id, &g, &err), 0);
    assert_int_equal(fx_wait(id)->finish, SCHED_FINISH_LENGTH);
}

static uint64_t draft_matched(struct fx *f)
{
    struct draft_stats ds;
    draft_stats(f->draft, &ds);
    return ds.matched;
}

/* The draft model's cache: a tenant's second request matches the draft
 * prefix its first one cached; another tenant's does not; a tenant given
 * a removed tenant's id (kvmm reuses it) matches nothing the removed one
 * cached, since the draft's namespaces are named after the tenant, not its
 * id; a tenant of the removed one's name again is that tenant, and does. */
static void test_draft_tenant_namespace(void **state)
{
    struct fx *f = *state;
    open_spec(f, SPEC_DRAFT, small_draft.path, 1024, 0);
    uint32_t p[48]; /* three whole blocks */
    fx_prompt(p, 48, 4242);
    uint32_t t1, ns1, t2, ns2, t3, ns3, t4, ns4;
    assert_int_equal(fx_tenant(f, "first", 1, &t1, &ns1), 0);
    assert_int_equal(fx_tenant(f, "second", 1, &t2, &ns2), 0);
    draft_run(f, 1, t1, ns1, p, 48);
    uint64_t m0 = draft_matched(f);
    draft_run(f, 2, t1, ns1, p, 48);
    uint64_t m1 = draft_matched(f);
    assert_true(m1 - m0 >= 32); /* its own prefix, whole blocks */
    draft_run(f, 3, t2, ns2, p, 48);
    assert_int_equal(draft_matched(f), m1); /* another tenant's cache */
    /* "first" goes; a new tenant takes its id */
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_tenant_remove(f->mm, t1), 0);
    kvmm_unlock(f->mm);
    assert_int_equal(fx_tenant(f, "third", 1, &t3, &ns3), 0);
    assert_int_equal(t3, t1); /* the id is reused: an id-named cache would match here */
    draft_run(f, 4, t3, ns3, p, 48);
    assert_int_equal(draft_matched(f), m1);
    /* the name again: the same tenant, its draft prefix still cached */
    assert_int_equal(fx_tenant(f, "first", 1, &t4, &ns4), 0);
    assert_int_not_equal(t4, t1);
    draft_run(f, 5, t4, ns4, p, 48);
    assert_true(draft_matched(f) - m1 >= 32);
}

/* The policy's pure parts: n-gram lookup (longest suffix first, latest
 * earlier occurrence, no more than what followed it), the acceptance
 * walk, and the draft length: longer at higher acceptance, none paying
 * when a draft token costs more than it wins, then a pause. */
static void test_policy(void **state)
{
    (void)state;
    uint32_t out[8];
    /* a b c d | x b c e | b c : suffix "b c" (2) occurs at 1 and 5; the
     * latest (5) is followed by e, b, c */
    const uint32_t t[] = {1, 2, 3, 4, 9, 2, 3, 5, 2, 3};
    assert_int_equal(spec_ngram(t, 10, 1, 3, 8, out), 3);
    assert_int_equal(out[0], 5);
    assert_int_equal(out[1], 2);
    assert_int_equal(out[2], 3);
    /* "x b c" (3) occurs once earlier and wins over "b c" */
    const uint32_t u[] = {9, 2, 3, 7, 7, 2, 3, 8, 9, 2, 3};
    assert_int_equal(spec_ngram(u, 11, 1, 3, 2, out), 2);
    assert_int_equal(out[0], 7);
    assert_int_equal(out[1], 7);
    assert_int_equal(spec_ngram(u, 11, 4, 4, 2, out), 0); /* no 4-gram repeats */
    const uint32_t v[] = {1, 2, 3};
    assert_int_equal(spec_ngram(v, 3, 1, 3, 4, out), 0);
    uint32_t d[4] = {5, 6, 7, 8}, p[5] = {5, 6, 9, 1, 1};
    assert_int_equal(spec_accept(d, 4, p), 2);
    p[2] = 7, p[3] = 8;
    assert_int_equal(spec_accept(d, 4, p), 4);
    struct spec_state s = {0};
    uint32_t k0 = spec_draft_len(&s, 8, 0.1f);
    for (int i = 0; i < 20; i++)
        spec_update(&s, 4, 4, 8, 0.1f);
    uint32_t k1 = spec_draft_len(&s, 8, 0.1f);
    assert_true(k0 >= 1 && k1 > k0 && k1 <= 8);
    /* always rejected at a price of half a step: a pause, then a probe */
    struct spec_state q = {0};
    uint32_t paused = 0;
    for (int i = 0; i < 40; i++) {
        uint32_t k = spec_draft_len(&q, 8, 0.5f);
        if (k == 0)
            paused++;
        else
            spec_update(&q, k, 0, 8, 0.5f);
    }
    assert_true(paused > 20);
    assert_true(q.drafted > 0 && q.accepted == 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policy),
        cmocka_unit_test_setup_teardown(test_ngram_greedy_identical, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_draft_greedy_identical, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_sampled_same_seed, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_kv_byte_identical, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_preempt_mid_spec, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_cancel_mid_spec, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_other_vocab_refused, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_draft_tenant_namespace, fx_setup, fx_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
