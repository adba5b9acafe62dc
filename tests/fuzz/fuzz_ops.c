/* fuzz_ops: libFuzzer target that drives the memory manager through the
 * protocol: the input is a little program, each step an op byte (op number
 * and connection) plus argument bytes, turned into a real request frame by
 * the client side of the codec and run through the op handlers. Oracles
 * after every step: kvmm_check passes; a reply is one well-formed frame; a
 * handle used from another connection is not_found; bytes written read back
 * unchanged (through COW, swaps and eviction); at the end, closing every
 * connection leaves nothing in use. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_env.h"
#include "kvd/protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_HANDLES 16
#define MAX_STEPS 256

static struct fuzz_env env;
static int env_ready;
static msgpack_sbuffer req;          /* the request being built; kept between steps and inputs */
static uint64_t n_programs, n_steps; /* for FUZZ_OPS_STATS */

/* With FUZZ_OPS_STATS set, the totals at exit, so a run's ops/s can be
 * reported next to libFuzzer's exec/s (a program is up to MAX_STEPS ops). */
static void print_stats(void)
{
    fprintf(stderr, "fuzz_ops: %llu programs, %llu ops (%.1f ops per program)\n",
            (unsigned long long)n_programs, (unsigned long long)n_steps,
            n_programs ? (double)n_steps / (double)n_programs : 0.0);
}

struct prog {
    const uint8_t *p;
    size_t n, off;
    uint64_t h[FUZZ_CONNS][MAX_HANDLES]; /* handles each connection may pick (the first 16) */
    size_t nh[FUZZ_CONNS];
    uint64_t issued[FUZZ_CONNS][MAX_STEPS]; /* every handle each connection was given */
    size_t ni[FUZZ_CONNS];
    uint64_t next_id;
};

/* conn was given handle v (by seq_open or seq_fork). */
static void record_handle(struct prog *g, int conn, uint64_t v)
{
    if (g->nh[conn] < MAX_HANDLES)
        g->h[conn][g->nh[conn]++] = v;
    if (g->ni[conn] < MAX_STEPS) /* at most one handle per step */
        g->issued[conn][g->ni[conn]++] = v;
}

static uint8_t take(struct prog *g)
{
    return g->off < g->n ? g->p[g->off++] : 0;
}

/* A handle for conn: one of its own, or (high bit) another connection's,
 * or (0xff) a made-up one. *foreign says whether it is not conn's. */
static uint64_t pick_handle(struct prog *g, int conn, bool *foreign)
{
    uint8_t b = take(g);
    *foreign = false;
    if (b == 0xff) {
        uint64_t v = 0;
        for (int i = 0; i < 8; i++)
            v = v << 8 | take(g);
        /* Handles carry a generation, so one value is only ever given to
         * one connection: foreign unless conn was given it. */
        bool mine = false;
        for (size_t i = 0; i < g->ni[conn]; i++)
            mine |= g->issued[conn][i] == v;
        *foreign = !mine; /* another's, or never issued: must be not_found */
        return v;
    }
    int c = (b & 0x80) ? (conn + 1 + (b >> 5 & 1)) % FUZZ_CONNS : conn;
    if (g->nh[c] == 0)
        return 0;
    *foreign = c != conn;
    return g->h[c][(b & 0x1f) % g->nh[c]];
}

/* Tokens from a tiny alphabet so prefixes repeat and the radix tree shares. */
static uint32_t *make_tokens(struct prog *g, size_t *n)
{
    uint8_t len = take(g) % 41, seed = take(g);
    uint32_t *t = malloc((len ? len : 1) * sizeof(*t));
    FUZZ_ASSERT(t);
    for (size_t i = 0; i < len; i++)
        t[i] = (uint32_t)((seed >> (i % 4 * 2)) & 3) + (i >= 8 ? (seed & 1) : 0);
    *n = len;
    return t;
}

/* The reply's uint at key, or UINT64_MAX. */
static uint64_t reply_uint(const char *key)
{
    size_t n = 0;
    struct proto_msg m;
    uint64_t v = UINT64_MAX;
    FUZZ_ASSERT(proto_frame_peek(env.out.data, env.out.size, UINT32_MAX, &n) == PROTO_FRAME_READY);
    FUZZ_ASSERT(fuzz_parse_reply(&env, env.out.data + 4, n, &m) == 0);
    const msgpack_object *o = proto_map_find(m.root, key);
    if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        v = o->via.u64;
    proto_msg_free(&m);
    return v;
}

/* The reply's bin at "data" copied out (malloc'd), or NULL. */
static uint8_t *reply_bin(size_t *len)
{
    size_t n = 0;
    struct proto_msg m;
    uint8_t *copy = NULL;
    FUZZ_ASSERT(proto_frame_peek(env.out.data, env.out.size, UINT32_MAX, &n) == PROTO_FRAME_READY);
    FUZZ_ASSERT(fuzz_parse_reply(&env, env.out.data + 4, n, &m) == 0);
    const msgpack_object *o = proto_map_find(m.root, "data");
    if (o && o->type == MSGPACK_OBJECT_BIN) {
        *len = o->via.bin.size;
        copy = malloc(*len ? *len : 1);
        FUZZ_ASSERT(copy);
        memcpy(copy, o->via.bin.ptr, *len);
    }
    proto_msg_free(&m);
    return copy;
}

/* Sends the request in sb (one frame) on conn; returns the reply code. */
static int run(int conn, msgpack_sbuffer *sb, size_t at)
{
    int code = -1;
    FUZZ_ASSERT(proto_frame_end(sb, at) == 0);
    env.out.size = 0;
    FUZZ_ASSERT(
        fuzz_dispatch(&env, conn, (const uint8_t *)sb->data + at + 4, sb->size - at - 4, &code));
    return code;
}

static void step(struct prog *g)
{
    uint8_t opb = take(g);
    int op = opb % 16, conn = (opb >> 4) % FUZZ_CONNS;
    uint64_t id = ++g->next_id, seq = 0;
    bool foreign = false;
    msgpack_sbuffer *sb = &req;
    msgpack_packer pk;
    uint32_t *toks = NULL;
    uint8_t *wdata = NULL;
    size_t ntok = 0, tb = kv_token_bytes(kvmm_geom(env.mm));
    int code;

    msgpack_sbuffer_clear(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    size_t at = proto_frame_begin(sb);
    switch (op) {
    case 0: { /* seq_open, own or shared namespace */
        bool shared = take(g) & 1;
        proto_request_begin(&pk, KVD_OP_SEQ_OPEN, id, shared);
        if (shared)
            proto_pack_kv_str(&pk, "namespace", "pub");
        code = run(conn, sb, at);
        if (code == 0) {
            uint64_t h = reply_uint("seq");
            FUZZ_ASSERT(h != UINT64_MAX);
            record_handle(g, conn, h);
        }
        break;
    }
    case 1: /* seq_match */
    case 5: /* seq_commit */
        seq = pick_handle(g, conn, &foreign);
        toks = make_tokens(g, &ntok);
        proto_request_begin(&pk, op == 1 ? KVD_OP_SEQ_MATCH : KVD_OP_SEQ_COMMIT, id, 2);
        proto_pack_kv_uint(&pk, "seq", seq);
        proto_pack_kv_u32_array(&pk, "tokens", toks, ntok);
        code = run(conn, sb, at);
        if (code == 0 && op == 1)
            FUZZ_ASSERT(reply_uint("matched") <= ntok);
        break;
    case 2: /* seq_extend */
        seq = pick_handle(g, conn, &foreign);
        proto_request_begin(&pk, KVD_OP_SEQ_EXTEND, id, 2);
        proto_pack_kv_uint(&pk, "seq", seq);
        proto_pack_kv_uint(&pk, "n", take(g) % 24);
        code = run(conn, sb, at);
        break;
    case 3: { /* kv_write, then read back the same range */
        seq = pick_handle(g, conn, &foreign);
        uint64_t start = take(g) % 48, n = take(g) % 12 + 1;
        uint8_t fill = take(g);
        wdata = malloc(n * tb);
        FUZZ_ASSERT(wdata);
        for (size_t i = 0; i < n * tb; i++)
            wdata[i] = (uint8_t)(fill + i);
        proto_request_begin(&pk, KVD_OP_KV_WRITE, id, 4);
        proto_pack_kv_uint(&pk, "seq", seq);
        proto_pack_kv_uint(&pk, "start", start);
        proto_pack_kv_uint(&pk, "n", n);
        proto_pack_kv_bin(&pk, "data", wdata, n * tb);
        code = run(conn, sb, at);
        if (code == 0) {
            msgpack_sbuffer_clear(sb);
            at = proto_frame_begin(sb);
            proto_request_begin(&pk, KVD_OP_KV_READ, ++g->next_id, 3);
            proto_pack_kv_uint(&pk, "seq", seq);
            proto_pack_kv_uint(&pk, "start", start);
            proto_pack_kv_uint(&pk, "n", n);
            FUZZ_ASSERT(run(conn, sb, at) == 0);
            size_t len = 0;
            uint8_t *rd = reply_bin(&len);
            FUZZ_ASSERT(rd && len == n * tb && memcmp(rd, wdata, len) == 0);
            free(rd);
        }
        break;
    }
    case 4: /* kv_read, arbitrary range */
        seq = pick_handle(g, conn, &foreign);
        proto_request_begin(&pk, KVD_OP_KV_READ, id, 3);
        proto_pack_kv_uint(&pk, "seq", seq);
        proto_pack_kv_uint(&pk, "start", take(g) % 64);
        proto_pack_kv_uint(&pk, "n", take(g) % 16);
        code = run(conn, sb, at);
        break;
    case 6: /* seq_fork */
        seq = pick_handle(g, conn, &foreign);
        proto_request_begin(&pk, KVD_OP_SEQ_FORK, id, 1);
        proto_pack_kv_uint(&pk, "seq", seq);
        code = run(conn, sb, at);
        if (code == 0) {
            uint64_t h = reply_uint("seq");
            FUZZ_ASSERT(h != UINT64_MAX);
            record_handle(g, conn, h);
        }
        break;
    case 7: /* seq_info */
    case 8: /* seq_offload */
    case 9: /* seq_restore */
    case 10: /* seq_close */ {
        static const char *const names[] = {KVD_OP_SEQ_INFO, KVD_OP_SEQ_OFFLOAD, KVD_OP_SEQ_RESTORE,
                                            KVD_OP_SEQ_CLOSE};
        seq = pick_handle(g, conn, &foreign);
        proto_request_begin(&pk, names[op - 7], id, 1);
        proto_pack_kv_uint(&pk, "seq", seq);
        code = run(conn, sb, at);
        break;
    }
    case 11: { /* admin_evict (only conn 0 is an admin) */
        uint8_t b = take(g);
        proto_request_begin(&pk, KVD_OP_ADMIN_EVICT, id, 2);
        proto_pack_kv_str(&pk, "tier", b & 1 ? "host" : "device");
        proto_pack_kv_uint(&pk, "n", b >> 1);
        code = run(conn, sb, at);
        FUZZ_ASSERT(conn == 0 ? code == 0 : code == KVD_EPERM);
        break;
    }
    case 12: /* stats */
        proto_request_begin(&pk, KVD_OP_STATS, id, 0);
        code = run(conn, sb, at);
        FUZZ_ASSERT(code == 0);
        break;
    case 13: /* hello */
        proto_request_begin(&pk, KVD_OP_HELLO, id, 1);
        proto_pack_kv_uint(&pk, "version", KVD_PROTOCOL_VERSION);
        code = run(conn, sb, at);
        FUZZ_ASSERT(code == 0);
        break;
    case 14: /* admin_check */
        proto_request_begin(&pk, KVD_OP_ADMIN_CHECK, id, 0);
        code = run(conn, sb, at);
        FUZZ_ASSERT(conn == 0 ? code == 0 : code == KVD_EPERM);
        break;
    default: { /* seq_extend with a wild n (overflow paths) */
        uint64_t n = 0;
        seq = pick_handle(g, conn, &foreign);
        for (int i = 0; i < 8; i++)
            n = n << 8 | take(g);
        proto_request_begin(&pk, KVD_OP_SEQ_EXTEND, id, 2);
        proto_pack_kv_uint(&pk, "seq", seq);
        proto_pack_kv_uint(&pk, "n", n);
        code = run(conn, sb, at);
        break;
    }
    }
    /* Tenant isolation: a handle this connection was never given is unknown
     * to it, whatever the op. */
    if (foreign)
        FUZZ_ASSERT(code == KVD_ENOTFOUND || code == KVD_EBADREQ);
    fuzz_check_mm(&env);
    free(toks);
    free(wdata);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!env_ready) {
        if (fuzz_env_new(&env) != 0)
            abort();
        msgpack_sbuffer_init(&req);
        if (getenv("FUZZ_OPS_STATS"))
            atexit(print_stats);
        env_ready = 1;
    }
    fuzz_env_begin(&env);
    fuzz_env_mm(&env); /* step() reads its geometry */
    struct prog g = {.p = data, .n = size};
    int steps = 0;
    for (; g.off < g.n && steps < MAX_STEPS; steps++)
        step(&g);
    n_programs++;
    n_steps += (uint64_t)steps;
    fuzz_close_all(&env);
    fuzz_env_end(&env);
    return 0;
}
