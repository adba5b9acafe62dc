/* KV events, below the sockets: the published block hash against
 * known answers computed outside kvd (Python's hashlib over a CBOR
 * encoding written separately, docs/protocol.md), the batch encoder's
 * bytes decoded with msgpack-c's unpacker, and what kvmm reports through
 * its sink as blocks enter the tree, move between tiers, leave it and are
 * cleared, per tenant mode (on, hashes, off). */
#include "mm_fixture.h"

#include <msgpack.h>

#include "blockkey.h"
#include "kvevents.h"

/* ---- the published hash ------------------------------------------------- */

static void test_hash_kat(void **state)
{
    (void)state;
    uint32_t t0[16], t1[16], big[16];
    for (uint32_t i = 0; i < 16; i++) {
        t0[i] = i;
        t1[i] = 16 + i;
        big[i] = 100000 + i * 70000;
    }
    uint64_t root = blockkey_pub_root("");
    assert_true(root == UINT64_C(0x0ad38662763f13d3));
    assert_true(blockkey_pub_root(NULL) == root);
    assert_true(blockkey_pub_root("kvd") == UINT64_C(0xd313b43ced0e5997));
    uint64_t h0 = blockkey_pub_next(root, t0, 16);
    assert_true(h0 == UINT64_C(0x9d58b66ac86a175a));
    assert_true(blockkey_pub_next(h0, t1, 16) == UINT64_C(0x2f8ff526c0002e96));
    /* Tokens past 65535 take 5-byte CBOR heads. */
    assert_true(blockkey_pub_next(root, big, 16) == UINT64_C(0x8cbc9f821e8ed0aa));
}

/* ---- the encoder -------------------------------------------------------- */

static const msgpack_object *arr(const msgpack_object *o, uint32_t n)
{
    assert_int_equal(o->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(o->via.array.size, n);
    return o->via.array.ptr;
}

static void is_str(const msgpack_object *o, const char *s)
{
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    assert_int_equal(o->via.str.size, strlen(s));
    assert_memory_equal(o->via.str.ptr, s, strlen(s));
}

static void is_u64(const msgpack_object *o, uint64_t v)
{
    assert_int_equal(o->type, MSGPACK_OBJECT_POSITIVE_INTEGER);
    assert_true(o->via.u64 == v);
}

static void test_encode(void **state)
{
    (void)state;
    uint32_t ta[4] = {1, 2, 3, 4}, tb[4] = {5, 6, 7, 8}, tc[4] = {9, 10, 11, 12};
    const uint64_t H = UINT64_C(0xfedcba9876543210); /* above INT64_MAX: a uint64 */
    struct kvevents_item it[] = {
        {.kind = KVEVENTS_CLEARED},
        {.kind = KVEVENTS_STORED,
         .medium = KVMM_MEDIUM_GPU,
         .hash = H,
         .tokens = ta,
         .n_tokens = 4},
        {.kind = KVEVENTS_STORED,
         .medium = KVMM_MEDIUM_GPU,
         .hash = 2,
         .has_parent = true,
         .parent = H,
         .tokens = tb,
         .n_tokens = 4},
        /* not a child of 2: a new event */
        {.kind = KVEVENTS_STORED,
         .medium = KVMM_MEDIUM_GPU,
         .hash = 3,
         .has_parent = true,
         .parent = 7,
         .tokens = tc,
         .n_tokens = 4},
        /* tokens withheld */
        {.kind = KVEVENTS_STORED,
         .medium = KVMM_MEDIUM_CPU,
         .hash = 4,
         .has_parent = true,
         .parent = 3},
        {.kind = KVEVENTS_REMOVED, .medium = KVMM_MEDIUM_GPU, .hash = H},
        {.kind = KVEVENTS_REMOVED, .medium = KVMM_MEDIUM_GPU, .hash = 2},
        {.kind = KVEVENTS_REMOVED, .medium = KVMM_MEDIUM_DISK, .hash = 3},
    };
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    size_t ne = 0;
    assert_int_equal(kvevents_encode(it, sizeof it / sizeof it[0], 1234.5, 4, &sb, &ne), 0);
    assert_int_equal(ne, 6);

    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&u, sb.data, sb.size, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, sb.size);
    const msgpack_object *b = arr(&u.data, 3);
    assert_int_equal(b[0].type, MSGPACK_OBJECT_FLOAT64);
    assert_true(b[0].via.f64 == 1234.5);
    is_u64(&b[2], 0);
    const msgpack_object *ev = arr(&b[1], 6);

    is_str(&arr(&ev[0], 1)[0], "AllBlocksCleared");

    const msgpack_object *s = arr(&ev[1], 7);
    is_str(&s[0], "BlockStored");
    const msgpack_object *hs = arr(&s[1], 2);
    is_u64(&hs[0], H);
    is_u64(&hs[1], 2);
    assert_int_equal(s[2].type, MSGPACK_OBJECT_NIL);
    const msgpack_object *tk = arr(&s[3], 8);
    for (int i = 0; i < 8; i++)
        is_u64(&tk[i], (uint64_t)i + 1);
    is_u64(&s[4], 4);
    assert_int_equal(s[5].type, MSGPACK_OBJECT_NIL);
    is_str(&s[6], "GPU");

    s = arr(&ev[2], 7);
    is_u64(&arr(&s[1], 1)[0], 3);
    is_u64(&s[2], 7);
    arr(&s[3], 4);
    is_str(&s[6], "GPU");

    s = arr(&ev[3], 7);
    is_u64(&arr(&s[1], 1)[0], 4);
    is_u64(&s[2], 3);
    arr(&s[3], 0);
    is_str(&s[6], "CPU");

    s = arr(&ev[4], 3);
    is_str(&s[0], "BlockRemoved");
    hs = arr(&s[1], 2);
    is_u64(&hs[0], H);
    is_u64(&hs[1], 2);
    is_str(&s[2], "GPU");

    s = arr(&ev[5], 3);
    is_u64(&arr(&s[1], 1)[0], 3);
    is_str(&s[2], "DISK");

    msgpack_unpacked_destroy(&u);
    msgpack_sbuffer_destroy(&sb);
}

/* ---- kvmm's reports ----------------------------------------------------- */

struct seen {
    struct kvmm_block_event ev[64];
    uint32_t tokens[64][FX_BT];
    bool had_tokens[64];
    size_t n, cleared;
};

static void rec_block(void *ctx, const struct kvmm_block_event *e)
{
    struct seen *s = ctx;
    assert_true(s->n < 64);
    s->ev[s->n] = *e;
    s->had_tokens[s->n] = e->tokens != NULL;
    if (e->tokens) {
        assert_int_equal(e->n_tokens, FX_BT);
        memcpy(s->tokens[s->n], e->tokens, sizeof s->tokens[0]);
    }
    s->ev[s->n].tokens = NULL;
    s->n++;
}

static void rec_cleared(void *ctx)
{
    ((struct seen *)ctx)->cleared++;
}

/* Opens a sequence of tenant t in its namespace and commits n tokens. */
static kvmm_seq_t commit(struct fx *f, uint32_t t, const uint32_t *tok, size_t n)
{
    uint32_t ns;
    kvmm_seq_t s;
    size_t shared;
    assert_int_equal(kvmm_tenant_namespace(f->mm, t, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->mm, 1, t, ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, 1, s, n), 0);
    assert_int_equal(kvmm_seq_commit(f->mm, 1, s, tok, n, &shared), 0);
    return s;
}

static void test_kvmm_reports(void **state)
{
    struct fx *f = *state;
    struct seen seen;
    memset(&seen, 0, sizeof seen);
    fx_open(f, 8, 8);
    struct kvmm_tenant_conf ca = fx_tenant("on"), cb = fx_tenant("off"), cc = fx_tenant("hashes");
    ca.events = KVMM_EVENTS_ON;
    cc.events = KVMM_EVENTS_HASHES;
    uint32_t ta, tb, tc;
    assert_int_equal(kvmm_tenant_set(f->mm, &ca, &ta), 0);
    assert_int_equal(kvmm_tenant_set(f->mm, &cb, &tb), 0);
    assert_int_equal(kvmm_tenant_set(f->mm, &cc, &tc), 0);
    struct kvmm_events_sink sink = {.ctx = &seen, .block = rec_block, .cleared = rec_cleared};
    uint64_t root = blockkey_pub_root("");
    kvmm_events_attach(f->mm, &sink, root);

    uint32_t tok[2 * FX_BT + 1];
    for (uint32_t i = 0; i < 2 * FX_BT + 1; i++)
        tok[i] = 100 + i;
    /* Two full blocks (and one token more, not a full block). */
    kvmm_seq_t sa = commit(f, ta, tok, 2 * FX_BT + 1);
    assert_int_equal(seen.n, 2);
    uint64_t h0 = blockkey_pub_next(root, tok, FX_BT),
             h1 = blockkey_pub_next(h0, tok + FX_BT, FX_BT);
    assert_true(seen.ev[0].stored && seen.ev[0].medium == KVMM_MEDIUM_GPU);
    assert_true(seen.ev[0].hash == h0 && !seen.ev[0].has_parent && seen.ev[0].tenant == ta);
    assert_true(seen.had_tokens[0]);
    assert_memory_equal(seen.tokens[0], tok, sizeof seen.tokens[0]);
    assert_true(seen.ev[1].stored && seen.ev[1].hash == h1 && seen.ev[1].has_parent &&
                seen.ev[1].parent == h0);

    /* The off tenant: nothing; the hashes tenant: the same hashes (the
     * hash is of the tokens alone), no tokens. */
    kvmm_seq_t sb = commit(f, tb, tok, 2 * FX_BT);
    assert_int_equal(seen.n, 2);
    kvmm_seq_t sc = commit(f, tc, tok, FX_BT);
    assert_int_equal(seen.n, 3);
    assert_true(seen.ev[2].stored && seen.ev[2].hash == h0 && !seen.had_tokens[2]);

    /* Released, then evicted to the host: GPU removed, CPU stored (with the
     * parent link), leaf first. */
    assert_int_equal(kvmm_seq_close(f->mm, 1, sa), 0);
    size_t ev_n;
    seen.n = 0;
    struct kvmm_tenant_stats ts;
    while (seen.n < 4) {
        assert_int_equal(kvmm_evict(f->mm, KVD_TIER_DEVICE, 1, &ev_n), 0);
        assert_int_equal(ev_n, 1);
        assert_int_equal(kvmm_tenant_stats(f->mm, ta, &ts), 0);
        if (ts.cached_host == 2)
            break;
    }
    assert_int_equal(seen.n, 4);
    assert_true(!seen.ev[0].stored && seen.ev[0].medium == KVMM_MEDIUM_GPU &&
                seen.ev[0].hash == h1);
    assert_true(seen.ev[1].stored && seen.ev[1].medium == KVMM_MEDIUM_CPU &&
                seen.ev[1].hash == h1 && seen.ev[1].parent == h0 && seen.had_tokens[1]);
    assert_true(!seen.ev[2].stored && seen.ev[2].medium == KVMM_MEDIUM_GPU &&
                seen.ev[2].hash == h0);
    assert_true(seen.ev[3].stored && seen.ev[3].medium == KVMM_MEDIUM_CPU && seen.ev[3].hash == h0);
    assert_int_equal(ts.cached_device, 0);

    /* A match brings them back: CPU removed, GPU stored. */
    uint32_t ns;
    kvmm_seq_t sm;
    size_t matched;
    seen.n = 0;
    assert_int_equal(kvmm_tenant_namespace(f->mm, ta, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->mm, 1, ta, ns, &sm), 0);
    assert_int_equal(kvmm_seq_match(f->mm, 1, sm, tok, 2 * FX_BT, &matched), 0);
    assert_int_equal(matched, 2 * FX_BT);
    assert_int_equal(seen.n, 4);
    for (size_t i = 0; i < 4; i++)
        assert_true(seen.ev[i].medium == (i % 2 ? KVMM_MEDIUM_GPU : KVMM_MEDIUM_CPU) &&
                    seen.ev[i].stored == (i % 2 == 1));

    /* Clear: one AllBlocksCleared, no per-block reports; the trees are
     * empty and sequences keep their blocks. */
    seen.n = 0;
    size_t dropped;
    kvmm_clear(f->mm, &dropped);
    assert_int_equal(seen.n, 0);
    assert_int_equal(seen.cleared, 1);
    assert_int_equal(dropped, 2 + 2 + 1);
    assert_int_equal(kvmm_tenant_stats(f->mm, ta, &ts), 0);
    assert_int_equal(ts.cached_blocks, 0);
    assert_int_equal(kvmm_check(f->mm), 0);

    /* After it, a new commit is reported again from the root. */
    kvmm_seq_t sd = commit(f, ta, tok, FX_BT);
    assert_int_equal(seen.n, 1);
    assert_true(seen.ev[0].hash == h0 && !seen.ev[0].has_parent);

    /* A dropped host block is reported as removed from the CPU. */
    assert_int_equal(kvmm_seq_close(f->mm, 1, sd), 0);
    assert_int_equal(kvmm_evict(f->mm, KVD_TIER_DEVICE, 1, &ev_n), 0);
    seen.n = 0;
    assert_int_equal(kvmm_evict(f->mm, KVD_TIER_HOST, 8, &ev_n), 0);
    assert_int_equal(ev_n, 1);
    assert_int_equal(seen.n, 1);
    assert_true(!seen.ev[0].stored && seen.ev[0].medium == KVMM_MEDIUM_CPU &&
                seen.ev[0].hash == h0);

    /* Detached: nothing more. */
    kvmm_events_attach(f->mm, NULL, 0);
    seen.n = 0;
    kvmm_seq_t se = commit(f, ta, tok, FX_BT);
    assert_int_equal(seen.n, 0);
    kvmm_seq_close(f->mm, 1, sb);
    kvmm_seq_close(f->mm, 1, sc);
    kvmm_seq_close(f->mm, 1, sm);
    kvmm_seq_close(f->mm, 1, se);
    assert_int_equal(kvmm_check(f->mm), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hash_kat),
        cmocka_unit_test(test_encode),
        cmocka_unit_test_setup_teardown(test_kvmm_reports, fx_setup, fx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
