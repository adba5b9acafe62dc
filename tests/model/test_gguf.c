/* The GGUF loader against valid files of every type and a corpus of
 * corrupted ones: truncation at every byte of the header/metadata/tensor
 * infos and at points in the data, huge counts/lengths/dims/offsets,
 * unknown types, misaligned offsets, duplicate names, bad magic/version and
 * random byte flips. Each bad file must give an error naming the problem and
 * never crash; buffers are exact-size copies so ASan sees any over-read. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "kvd/status.h"
#include "model.h"
#include "model/model_ref.h"

struct blob {
    uint8_t *p;
    size_t n;
};

static struct blob read_file(const char *path)
{
    struct blob b = {0};
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    b.n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    b.p = malloc(b.n);
    assert_int_equal(fread(b.p, 1, b.n, f), b.n);
    fclose(f);
    return b;
}

static struct blob gen(const char *args)
{
    char *path = ref_gen_model(args);
    assert_non_null(path);
    struct blob b = read_file(path);
    unlink(path);
    free(path);
    return b;
}

/* Each test's buffers, generated file, and open gguf/model, in CMocka
 * setup/teardown: whatever is left is freed, also after a failed assert. */
#define T_MAX_BUF 8
struct tstate {
    void *buf[T_MAX_BUF];
    unsigned n_buf;
    char *path; /* a generated model file: unlinked and freed */
    struct gguf *g;
    struct model *m;
};

static int t_setup(void **state)
{
    *state = calloc(1, sizeof(struct tstate));
    return *state ? 0 : -1;
}

/* Frees the test's buffers and file, closes its gguf and model. */
static void tfree(void **state)
{
    struct tstate *t = *state;
    for (unsigned i = 0; i < t->n_buf; i++)
        free(t->buf[i]);
    t->n_buf = 0;
    if (t->path) {
        unlink(t->path);
        free(t->path);
        t->path = NULL;
    }
    gguf_close(t->g);
    t->g = NULL;
    model_free(t->m);
    t->m = NULL;
}

static int t_teardown(void **state)
{
    if (*state) {
        tfree(state);
        free(*state);
    }
    return 0;
}

/* p, freed by tfree or the teardown. */
static void *tkeep(void **state, void *p)
{
    struct tstate *t = *state;
    assert_non_null(p);
    assert_true(t->n_buf < T_MAX_BUF);
    t->buf[t->n_buf++] = p;
    return p;
}

static void *talloc(void **state, size_t bytes)
{
    return tkeep(state, malloc(bytes ? bytes : 1));
}

static struct blob tgen(void **state, const char *args)
{
    struct blob b = gen(args);
    tkeep(state, b.p);
    return b;
}

/* Parses an exact-size copy of the first n bytes of b; returns rc, err set
 * to the message (gguf_parse's error carries rc as its code). */
static int parse_copy(const uint8_t *p, size_t n, char *err, size_t errlen)
{
    uint8_t *c = malloc(n ? n : 1);
    memcpy(c, p, n);
    struct gguf *g = NULL;
    struct kvd_error e = {0};
    int rc = gguf_parse(c, n, &g, &e);
    snprintf(err, errlen, "%s", e.message);
    if (rc == 0) {
        assert_non_null(g);
        gguf_close(g);
    } else {
        assert_null(g);
        assert_int_equal(e.code, rc);
        assert_true(strncmp(err, "gguf: ", 6) == 0 && strlen(err) > 12); /* a message, always */
    }
    free(c);
    return rc;
}

/* Offsets of the fields of a valid file (test-side walker). */
enum fkind {
    F_KEYLEN,
    F_VTYPE,
    F_STRLEN,
    F_ARRTYPE,
    F_ARRCOUNT,
    F_TNAMELEN,
    F_NDIMS,
    F_NE,
    F_TTYPE,
    F_TOFF
};
struct field {
    enum fkind kind;
    size_t at;
};
struct layout {
    struct field f[4096];
    size_t n, infos_end, data_offset, last_tensor_end;
    size_t toff_at[512], tname_at[512];
    size_t n_tensors;
};

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static uint32_t rd32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void walk(const struct blob *b, struct layout *L)
{
    static const size_t vsz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    size_t o = 24;
    uint64_t nt = rd64(b->p + 8), nkv = rd64(b->p + 16);
    memset(L, 0, sizeof *L);
#define ADDF(k, a) (L->f[L->n++] = (struct field){k, a})
    for (uint64_t i = 0; i < nkv; i++) {
        ADDF(F_KEYLEN, o);
        o += 8 + rd64(b->p + o);
        ADDF(F_VTYPE, o);
        uint32_t t = rd32(b->p + o);
        o += 4;
        if (t == 8) {
            ADDF(F_STRLEN, o);
            o += 8 + rd64(b->p + o);
        } else if (t == 9) {
            uint32_t et = rd32(b->p + o);
            ADDF(F_ARRTYPE, o);
            ADDF(F_ARRCOUNT, o + 4);
            uint64_t cnt = rd64(b->p + o + 4);
            o += 12;
            for (uint64_t k = 0; k < cnt; k++) {
                if (et == 8) {
                    if (k < 4)
                        ADDF(F_STRLEN, o);
                    o += 8 + rd64(b->p + o);
                } else {
                    o += vsz[et];
                }
            }
        } else {
            o += vsz[t];
        }
    }
    L->n_tensors = nt;
    uint64_t max_end = 0;
    for (uint64_t i = 0; i < nt; i++) {
        ADDF(F_TNAMELEN, o);
        L->tname_at[i] = o;
        o += 8 + rd64(b->p + o);
        ADDF(F_NDIMS, o);
        uint32_t nd = rd32(b->p + o);
        o += 4;
        uint64_t nel = 1, ne0 = rd64(b->p + o);
        for (uint32_t d = 0; d < nd; d++) {
            ADDF(F_NE, o);
            nel *= rd64(b->p + o);
            o += 8;
        }
        ADDF(F_TTYPE, o);
        uint32_t ty = rd32(b->p + o);
        o += 4;
        ADDF(F_TOFF, o);
        L->toff_at[i] = o;
        uint64_t bytes = ty == 0 ? nel * 4 : ty == 8 ? nel / 32 * 34 : nel * 2;
        (void)ne0;
        if (rd64(b->p + o) + bytes > max_end)
            max_end = rd64(b->p + o) + bytes;
        o += 8;
    }
#undef ADDF
    L->infos_end = o;
    L->data_offset = (o + 31) / 32 * 32;
    L->last_tensor_end = L->data_offset + max_end;
}

#define SMALL "--embd 64 --heads 4 --kv-heads 2 --ff 64 --vocab 40 --layers 1 --ctx 128"

static void t_valid_types(void **s)
{
    static const char *const args[] = {
        SMALL " --type f32",
        SMALL " --type f16",
        SMALL " --type bf16 --tied --rope-freqs",
        SMALL " --type q8_0",
        "--arch qwen2 " SMALL " --type q8_0 --tied",
        "--arch qwen2 " SMALL " --type bf16",
        SMALL " --type q4_0",
        "--arch qwen2 " SMALL " --type q5_1",
        SMALL " --type q4_1 --tied",
        SMALL " --type q5_0",
        /* K-quants: rows of 256 (head_dim 16 and 2 kv heads, as the checks below want) */
        "--embd 256 --heads 16 --kv-heads 2 --ff 256 --vocab 40 --layers 1 --ctx 128 --type q4_k_m",
        "--arch qwen2 --embd 256 --heads 16 --kv-heads 2 --ff 512 --vocab 40 --layers 2 --ctx 128 "
        "--type q5_k_m",
        "--embd 256 --heads 16 --kv-heads 2 --ff 256 --vocab 40 --layers 1 --ctx 128 --type q6_k "
        "--tied",
    };
    for (size_t i = 0; i < sizeof args / sizeof args[0]; i++) {
        struct tstate *t = *s;
        char err[256] = "", *path = t->path = ref_gen_model(args[i]);
        assert_non_null(path);
        assert_int_equal(gguf_open(path, &t->g, err, sizeof err), 0);
        assert_int_equal(t->g->version, 3);
        assert_non_null(gguf_find_tensor(t->g, "blk.0.ffn_down.weight"));
        assert_int_equal(gguf_arr_count(t->g, "tokenizer.ggml.tokens"), 40);
        gguf_close(t->g);
        t->g = NULL;
        struct kvd_error merr = {0};
        int rc = model_load(path, ref_cpu_backend(), &t->m, &merr);
        if (rc)
            fail_msg("%s: %s", args[i], merr.message);
        const struct model_hparams *hp = model_hparams(t->m);
        assert_int_equal(hp->n_vocab, 40);
        assert_int_equal(hp->n_head_kv, 2);
        assert_int_equal(hp->head_dim, 16);
        model_free(t->m);
        t->m = NULL;
        /* the same file as GGUF version 2 */
        struct blob b = read_file(path);
        tkeep(s, b.p);
        b.p[4] = 2;
        assert_int_equal(parse_copy(b.p, b.n, err, sizeof err), 0);
        tfree(s); /* the blob and the file */
    }
}

static void expect(const struct blob *b, const char *needle)
{
    char err[256];
    int rc = parse_copy(b->p, b->n, err, sizeof err);
    if (rc == 0)
        fail_msg("expected an error containing '%s', got success", needle);
    if (!strstr(err, needle))
        fail_msg("expected '%s' in: %s", needle, err);
}

static void t_truncation(void **s)
{
    struct blob b = tgen(s, SMALL " --type q8_0");
    struct layout *L = talloc(s, sizeof *L);
    walk(&b, L);
    char err[256];
    /* every length through the tensor infos and into the data */
    for (size_t n = 0; n < L->data_offset + 200; n++) {
        int rc = parse_copy(b.p, n, err, sizeof err);
        if (rc == 0)
            fail_msg("truncated to %zu bytes parsed fine", n);
        if (!strstr(err, "truncated") && !strstr(err, "past the end") && !strstr(err, "absurd"))
            fail_msg("truncated to %zu: unexpected message: %s", n, err);
    }
    /* random points in the data: always an error naming a tensor */
    uint64_t r = 7;
    for (int i = 0; i < 300; i++) {
        r = r * 6364136223846793005ull + 1;
        size_t n = L->data_offset + (size_t)((r >> 33) % (L->last_tensor_end - L->data_offset));
        assert_int_not_equal(parse_copy(b.p, n, err, sizeof err), 0);
        assert_non_null(strstr(err, "past the end"));
        assert_non_null(strstr(err, "tensor '"));
    }
    /* the last tensor's padding is not data: cutting it is fine */
    assert_int_equal(parse_copy(b.p, L->last_tensor_end, err, sizeof err), 0);
}

static void put64(struct blob *b, size_t at, uint64_t v)
{
    memcpy(b->p + at, &v, 8);
}
static void put32(struct blob *b, size_t at, uint32_t v)
{
    memcpy(b->p + at, &v, 4);
}

static void t_header(void **s)
{
    struct blob b = tgen(s, SMALL " --type f16");
    struct blob c = {talloc(s, b.n), b.n};
    memcpy(c.p, b.p, b.n);
    c.p[0] = 'X';
    expect(&c, "bad magic");
    memcpy(c.p, b.p, 8);
    put32(&c, 4, 1);
    expect(&c, "unsupported version 1");
    put32(&c, 4, 4);
    expect(&c, "unsupported version 4");
    put32(&c, 4, 3);
    put64(&c, 8, UINT64_MAX);
    expect(&c, "absurd tensor count");
    put64(&c, 8, rd64(b.p + 8));
    put64(&c, 16, 1ull << 40);
    expect(&c, "absurd metadata count");
    put64(&c, 16, rd64(b.p + 16) + 1); /* one kv too many: eats the tensor infos */
    char err[256];
    assert_int_not_equal(parse_copy(c.p, c.n, err, sizeof err), 0);
}

/* Targeted field corruptions with the message each must give. */
static void t_fields(void **s)
{
    struct blob b = tgen(s, SMALL " --type q8_0");
    struct layout *L = talloc(s, sizeof *L);
    walk(&b, L);
    struct blob c = {talloc(s, b.n), b.n};
#define RESET() memcpy(c.p, b.p, b.n)
    for (size_t i = 0; i < L->n; i++) {
        size_t at = L->f[i].at;
        RESET();
        switch (L->f[i].kind) {
        case F_KEYLEN:
            put64(&c, at, 1ull << 50);
            expect(&c, "absurd length");
            put64(&c, at, b.n);
            expect(&c, "truncated");
            break;
        case F_VTYPE:
            put32(&c, at, 13);
            expect(&c, "unknown value type");
            put32(&c, at, 0xffffffffu);
            expect(&c, "unknown value type");
            break;
        case F_STRLEN:
            put64(&c, at, UINT64_MAX);
            expect(&c, "gguf: ");
            put64(&c, at, b.n - 8);
            expect(&c, "truncated");
            break;
        case F_ARRTYPE:
            put32(&c, at, 9);
            expect(&c, "nested array");
            put32(&c, at, 77);
            expect(&c, "unknown");
            break;
        case F_ARRCOUNT:
            put64(&c, at, UINT64_MAX / 2);
            expect(&c, "absurd count");
            break;
        case F_TNAMELEN:
            put64(&c, at, 64);
            expect(&c, "name of 64 bytes");
            put64(&c, at, 0);
            expect(&c, "empty name");
            break;
        case F_NDIMS:
            put32(&c, at, 0);
            expect(&c, "dimensions");
            put32(&c, at, 5);
            expect(&c, "dimensions");
            break;
        case F_NE:
            put64(&c, at, UINT64_MAX);
            expect(&c, "invalid dimension");
            put64(&c, at, 0);
            expect(&c, "invalid dimension");
            put64(&c, at, 1ull << 39);
            expect(&c, "gguf: tensor '");
            break;
        case F_TTYPE:
            put32(&c, at, 12); /* q4_k: rows of 64 are not whole super-blocks */
            expect(&c, "not a multiple of the q4_k block size (256)");
            put32(&c, at, 4); /* ggml's retired q4_2 */
            expect(&c, "unsupported or unknown type 4");
            put32(&c, at, 0xdeadbeef);
            expect(&c, "unsupported or unknown type");
            break;
        case F_TOFF:
            put64(&c, at, rd64(b.p + at) + 1);
            expect(&c, "not a multiple of the alignment");
            put64(&c, at, UINT64_MAX - 31);
            expect(&c, "past the end");
            put64(&c, at, (uint64_t)b.n / 32 * 32);
            expect(&c, "past the end");
            break;
        }
    }
    /* duplicate tensor name: blk.0.attn_k.weight -> blk.0.attn_q.weight */
    RESET();
    int done = 0;
    for (size_t t = 0; t < L->n_tensors; t++) {
        char *nm = (char *)c.p + L->tname_at[t] + 8;
        if (rd64(c.p + L->tname_at[t]) == strlen("blk.0.attn_k.weight") &&
            !memcmp(nm, "blk.0.attn_k.weight", 19)) {
            nm[11] = 'q';
            done = 1;
        }
    }
    assert_true(done);
    expect(&c, "duplicate tensor name 'blk.0.attn_q.weight'");
    /* two tensors over the same bytes (what a type edited to a larger one
     * amounts to): the second tensor's offset set to the first's */
    RESET();
    assert_true(L->n_tensors >= 2);
    put64(&c, L->toff_at[1], rd64(b.p + L->toff_at[0]));
    expect(&c, "overlaps tensor");
}

/* Seeded random byte flips in the header/metadata/infos: never a crash. */
static void t_random_flips(void **s)
{
    struct blob b = tgen(s, SMALL " --type bf16");
    struct layout *L = talloc(s, sizeof *L);
    walk(&b, L);
    struct blob c = {talloc(s, b.n), b.n};
    uint64_t r = 99;
    int errors = 0;
    char err[256];
    for (int i = 0; i < 3000; i++) {
        memcpy(c.p, b.p, b.n);
        for (int k = 0; k < 1 + i % 4; k++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            size_t at = (size_t)((r >> 33) % L->infos_end);
            c.p[at] ^= (uint8_t)(1u << ((r >> 20) % 8));
        }
        errors += parse_copy(c.p, c.n, err, sizeof err) != 0;
    }
    print_message("  %d of 3000 flipped files rejected\n", errors);
    assert_true(errors > 300);
}

static void t_alignment_key(void **s)
{
    struct blob b = tgen(s, SMALL " --type f32");
    const char key[] = "general.alignment";
    uint8_t *k = memmem(b.p, 4096, key, sizeof key - 1);
    assert_non_null(k);
    size_t at = (size_t)(k - b.p) + sizeof key - 1 + 4; /* past the u32 value type */
    put32(&b, at, 3);
    expect(&b, "general.alignment");
    put32(&b, at, 0);
    expect(&b, "general.alignment");
    put32(&b, at, 64); /* valid, but the data no longer starts where the offsets say */
    char err[256];
    int rc = parse_copy(b.p, b.n, err, sizeof err);
    if (rc == 0)
        fail_msg("alignment 64 on a 32-aligned file parsed");
}

/* Errors found at model level, through model_load on real files. */
static void load_expect(struct blob *b, int code, const char *needle)
{
    char path[] = "/tmp/kvd-bad-XXXXXX";
    struct kvd_error err = {0};
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b->p, b->n), (ssize_t)b->n);
    close(fd);
    struct model *m = NULL;
    int rc = model_load(path, ref_cpu_backend(), &m, &err);
    unlink(path);
    if (m)
        fail_msg("expected %d '%s', the model loaded", code, needle);
    if (rc != code || err.code != rc || !strstr(err.message, needle))
        fail_msg("expected %d '%s', got %d (%d): %s", code, needle, rc, err.code, err.message);
}

static void rename_n(struct blob *b, const char *from, const char *to, size_t n)
{
    uint8_t *k = memmem(b->p, b->n, from, n);
    assert_non_null(k);
    memcpy(k, to, n);
}

static void rename_in(struct blob *b, const char *from, const char *to)
{
    rename_n(b, from, to, strlen(from));
}

/* A quantized tensor whose type says more bytes than the file holds (its
 * blocks are Q4_K's 144 bytes, the type claims Q6_K's 210): refused, with
 * the tensor named, never read past the end. */
static void t_quant_sizes(void **s)
{
    struct blob b =
        tgen(s, "--embd 256 --heads 4 --kv-heads 2 --ff 256 --vocab 40 --layers 1 --ctx 128 "
                "--type q4_k");
    struct layout *L = talloc(s, sizeof *L);
    walk(&b, L);
    size_t last = 0;
    for (size_t t = 1; t < L->n_tensors; t++)
        if (rd64(b.p + L->toff_at[t]) > rd64(b.p + L->toff_at[last]))
            last = t;
    size_t type_at = L->toff_at[last] - 4;
    assert_int_equal(rd32(b.p + type_at), 12);
    put32(&b, type_at, 14);
    expect(&b, "past the end");
    put32(&b, type_at, 13); /* q5_k: 176 bytes a block, also too many */
    expect(&b, "past the end");
    put32(&b, type_at, 2); /* q4_0: fewer bytes, a valid file whose weights are other numbers */
    char err[256];
    assert_int_equal(parse_copy(b.p, b.n, err, sizeof err), 0);
}

static void t_model_errors(void **s)
{
    struct blob b = tgen(s, SMALL " --type f16");
    struct blob c = {talloc(s, b.n), b.n};
    memcpy(c.p, b.p, b.n);
    rename_in(&c, "output_norm.weight", "output_norX.weight");
    load_expect(&c, KVD_EBADREQ, "'output_norm.weight' is missing");
    memcpy(c.p, b.p, b.n);
    rename_in(&c, "llama.block_count", "llama.block_counx");
    load_expect(&c, KVD_EBADREQ, "'llama.block_count' is missing");
    memcpy(c.p, b.p, b.n);
    rename_n(&c, "\x05\0\0\0\0\0\0\0llama", "\x05\0\0\0\0\0\0\0gpt2x", 13);
    load_expect(&c, KVD_EUNSUPPORTED, "architecture 'gpt2x'");
    /* a weight of the wrong shape: attn_q's out dim (ne[1]) 64 -> 32 */
    memcpy(c.p, b.p, b.n);
    struct layout *L = talloc(s, sizeof *L);
    walk(&c, L);
    for (size_t t = 0; t < L->n_tensors; t++)
        if (!memcmp(c.p + L->tname_at[t] + 8, "blk.0.attn_q.weight", 19))
            put64(&c, L->tname_at[t] + 8 + 19 + 4 + 8, 32);
    load_expect(&c, KVD_EBADREQ, "'blk.0.attn_q.weight' has shape [64, 32], expected [64, 64]");
    struct kvd_error err = {0};
    struct model *m;
    assert_int_equal(model_load("/nonexistent/x.gguf", ref_cpu_backend(), &m, &err), KVD_ENOTFOUND);
    assert_int_equal(err.code, KVD_ENOTFOUND);
    assert_non_null(strstr(err.message, "cannot open"));
    assert_int_equal(model_load("/tmp", ref_cpu_backend(), &m, &err), KVD_EBADREQ);
    assert_int_equal(err.code, KVD_EBADREQ);
    struct backend nobe = {0};
    assert_int_equal(model_load("/tmp/x", &nobe, &m, &err), KVD_EUNSUPPORTED);
    assert_int_equal(err.code, KVD_EUNSUPPORTED);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(t_valid_types, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_truncation, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_header, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_fields, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_random_flips, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_alignment_key, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_model_errors, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_quant_sizes, t_setup, t_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
