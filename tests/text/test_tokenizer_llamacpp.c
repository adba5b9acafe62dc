/* test_tokenizer_llamacpp: kvd's tokenizer against llama.cpp's (npm
 * node-llama-cpp: the model's own tokenize and detokenize) on vocabularies
 * learned from this machine's text (tok_learn.h), one per model type and
 * pre-tokenizer, and thousands of texts: corpus segments in many scripts
 * and generated mixtures of emoji, combining marks, whitespace runs, digits,
 * code, apostrophes and special-token text; then random id sequences for the
 * detokenizer. Token ids must be identical (special-token parsing off and
 * on), and detokenized text equal. Skips (77) without node or
 * node-llama-cpp (KVD_NODE_LLAMA_CPP_DIR, ~/.cache/kvd/node-llama-cpp). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "tokenizer.h"
#include "unicode.h"
#include "text/tok_learn.h"
#include "text/tok_texts.h"

#ifndef KVD_TESTS_SRC
#define KVD_TESTS_SRC "tests"
#endif

static const char *module_dir;
static char tmpdir[256];

struct cfg {
    const char *model; /* "llama" or "gpt2" */
    const char *pre;
};

static const struct cfg cfgs[] = {
    {"llama", NULL},          {"gpt2", "default"},   {"gpt2", "gpt-2"},
    {"gpt2", "llama-bpe"},    {"gpt2", "dbrx"},      {"gpt2", "qwen2"},
    {"gpt2", "stablelm2"},    {"gpt2", "smollm"},    {"gpt2", "refact"},
    {"gpt2", "tekken"},       {"gpt2", "falcon"},    {"gpt2", "deepseek-coder"},
    {"gpt2", "deepseek-llm"}, {"gpt2", "command-r"},
};
#define NCFG (sizeof cfgs / sizeof cfgs[0])

/* ---- a little JSON ------------------------------------------------------------ */

static void json_str(FILE *f, const char *s, size_t n)
{
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

struct jp {
    const char *p;
};

static void jp_ws(struct jp *j)
{
    while (*j->p == ' ' || *j->p == ',' || *j->p == '\n')
        j->p++;
}

static unsigned hex4(const char *p)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v = v * 16 + (unsigned)(c <= '9' ? c - '0' : (c | 32) - 'a' + 10);
    }
    return v;
}

/* A JSON string into a malloc'd buffer. */
static char *jp_str(struct jp *j, size_t *len)
{
    jp_ws(j);
    assert_int_equal(*j->p, '"');
    j->p++;
    size_t cap = 64, n = 0;
    char *o = malloc(cap);
    while (*j->p != '"') {
        if (n + 8 > cap)
            o = realloc(o, cap *= 2);
        if (*j->p != '\\') {
            o[n++] = *j->p++;
            continue;
        }
        j->p++;
        char e = *j->p++;
        switch (e) {
        case 'n':
            o[n++] = '\n';
            break;
        case 't':
            o[n++] = '\t';
            break;
        case 'r':
            o[n++] = '\r';
            break;
        case 'b':
            o[n++] = '\b';
            break;
        case 'f':
            o[n++] = '\f';
            break;
        case 'u': {
            unsigned cp = hex4(j->p);
            j->p += 4;
            if (cp >= 0xd800 && cp < 0xdc00 && j->p[0] == '\\' && j->p[1] == 'u') {
                unsigned lo = hex4(j->p + 2);
                if (lo >= 0xdc00 && lo < 0xe000) {
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    j->p += 6;
                }
            }
            n += uni_encode(cp, o + n);
            break;
        }
        default:
            o[n++] = e;
            break;
        }
    }
    j->p++;
    o[n] = 0;
    *len = n;
    return o;
}

static uint32_t *jp_ids(struct jp *j, size_t *n)
{
    jp_ws(j);
    assert_int_equal(*j->p, '[');
    j->p++;
    size_t cap = 16;
    uint32_t *v = malloc(cap * sizeof(uint32_t));
    *n = 0;
    for (;;) {
        jp_ws(j);
        if (*j->p == ']') {
            j->p++;
            return v;
        }
        if (*n == cap)
            v = realloc(v, (cap *= 2) * sizeof(uint32_t));
        char *end;
        v[(*n)++] = (uint32_t)strtoul(j->p, &end, 10);
        j->p = end;
    }
}

/* ---- helpers ---------------------------------------------------------------- */

/* Ids from `from` on (at most 40). */
static void print_ids_at(const char *what, const uint32_t *v, size_t n, size_t from)
{
    fprintf(stderr, "    %s:%s", what, from ? " ..." : "");
    for (size_t i = from; i < n && i < from + 40; i++)
        fprintf(stderr, " %u", v[i]);
    fprintf(stderr, n > from + 40 ? " ...\n" : "\n");
}

static void print_ids(const char *what, const uint32_t *v, size_t n)
{
    print_ids_at(what, v, n, 0);
}

/* Both lists from a little before their first difference. */
static void print_diff(const uint32_t *a, size_t na, const uint32_t *b, size_t nb)
{
    size_t i = 0;
    while (i < na && i < nb && a[i] == b[i])
        i++;
    size_t from = i > 8 ? i - 8 : 0;
    fprintf(stderr, "    first difference at id %zu of %zu / %zu\n", i, na, nb);
    print_ids_at("llama.cpp", a, na, from);
    print_ids_at("kvd      ", b, nb, from);
}

static void print_text(const char *what, const char *s, size_t n)
{
    fprintf(stderr, "    %s: ", what);
    json_str(stderr, s, n < 2000 ? n : 2000);
    fputc('\n', stderr);
}

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static char *slurp(const char *path)
{
    size_t n;
    char *d = tl_read_file(path, &n);
    assert_non_null(d);
    return d;
}

/* ---- the test ----------------------------------------------------------------- */

static void test_equal_to_llamacpp(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    assert_non_null(tools);

    size_t clen;
    char *corpus = tl_training_corpus(180000, 5, &clen);
    assert_true(clen > 50000);
    static const char *const train[] = {"gpt-2", "llama-bpe", "tekken", NULL};
    struct tl_bpe bpe;
    tl_learn_bpe(corpus, clen, train, 2500, &bpe);
    size_t spm_len;
    uint8_t *spm = tl_learn_spm(corpus, clen, 2500, &spm_len);
    fprintf(stderr, "learned: bpe %zu tokens, %zu merges; spm %zu bytes\n", bpe.v.n, bpe.nm,
            spm_len);

    struct tt_texts texts;
    tt_make(&texts, 20260503);
    fprintf(stderr, "%zu texts\n", texts.n);
    char path[512], cmd[8192];
    snprintf(path, sizeof path, "%s/texts.jsonl", tmpdir);
    FILE *f = fopen(path, "wb");
    for (size_t i = 0; i < texts.n; i++) {
        json_str(f, texts.s[i], texts.len[i]);
        fputc('\n', f);
    }
    fclose(f);

    struct tokenizer *tok[NCFG];
    struct gguf *gg[NCFG];
    int n = snprintf(cmd, sizeof cmd, "timeout 900 node %s/text/tokenizer_llamacpp.mjs %s compare",
                     KVD_TESTS_SRC, module_dir);
    uint64_t seed = 77;
    for (size_t c = 0; c < NCFG; c++) {
        size_t vl = 0;
        uint8_t *vg = cfgs[c].pre ? tl_bpe_gguf(&bpe, cfgs[c].pre, &vl) : spm;
        if (!cfgs[c].pre)
            vl = spm_len;
        char vpath[300], mpath[300], ipath[300], opath[300];
        snprintf(vpath, sizeof vpath, "%s/vocab%zu.gguf", tmpdir, c);
        snprintf(mpath, sizeof mpath, "%s/model%zu.gguf", tmpdir, c);
        snprintf(ipath, sizeof ipath, "%s/ids%zu.jsonl", tmpdir, c);
        snprintf(opath, sizeof opath, "%s/out%zu.jsonl", tmpdir, c);
        write_file(vpath, vg, vl);
        if (cfgs[c].pre)
            free(vg);
        char gen[1200];
        snprintf(gen, sizeof gen,
                 "%s/kvd-gguf-gen -o %s --tokenizer %s --layers 1 --embd 32 --heads 2 --ff 64 "
                 "--ctx 256 --type f32",
                 tools, mpath, vpath);
        assert_int_equal(system(gen), 0);
        char err[256];
        assert_int_equal(gguf_open(mpath, &gg[c], err, sizeof err), 0);
        int rc = tokenizer_load(gg[c], &tok[c], err, sizeof err);
        if (rc)
            fprintf(stderr, "%s/%s: %s\n", cfgs[c].model, cfgs[c].pre ? cfgs[c].pre : "-", err);
        assert_int_equal(rc, 0);
        /* random id sequences, biased to the special and byte tokens */
        f = fopen(ipath, "wb");
        uint32_t nv = tokenizer_n_vocab(tok[c]);
        for (int s = 0; s < 600; s++) {
            int len = 1 + (int)(tt_rand(&seed) % 24);
            fputc('[', f);
            for (int k = 0; k < len; k++) {
                uint64_t r = tt_rand(&seed);
                uint32_t id = (r >> 8) % 4 == 0   ? (uint32_t)((r >> 16) % 300)
                              : (r >> 8) % 4 == 1 ? nv - 1 - (uint32_t)((r >> 16) % 80)
                                                  : (uint32_t)((r >> 16) % nv);
                fprintf(f, "%s%u", k ? "," : "", id);
            }
            fputs("]\n", f);
        }
        fclose(f);
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " %s %s %s %s", mpath, path, ipath, opath);
    }
    free(spm);
    tl_bpe_free(&bpe);
    fprintf(stderr, "running llama.cpp (node-llama-cpp)...\n");
    assert_int_equal(system(cmd), 0);

    size_t total_bad = 0;
    for (size_t c = 0; c < NCFG; c++) {
        char opath[300], ipath[300];
        snprintf(opath, sizeof opath, "%s/out%zu.jsonl", tmpdir, c);
        snprintf(ipath, sizeof ipath, "%s/ids%zu.jsonl", tmpdir, c);
        char *out = slurp(opath), *idl = slurp(ipath);
        struct jp j = {out}, ji = {idl};
        size_t bad_tok = 0, bad_detok = 0, bad_stream = 0, n_ids = 0;
        for (size_t i = 0; i < texts.n; i++) {
            jp_ws(&j);
            assert_int_equal(*j.p, '[');
            j.p++;
            size_t na[2];
            uint32_t *ref[2];
            ref[0] = jp_ids(&j, &na[0]);
            ref[1] = jp_ids(&j, &na[1]);
            for (int sp = 0; sp < 2; sp++) {
                uint32_t *ids;
                size_t ni;
                assert_int_equal(
                    tokenizer_encode(tok[c], texts.s[i], texts.len[i], false, sp, &ids, &ni), 0);
                n_ids += ni;
                if (ni != na[sp] || memcmp(ids, ref[sp], ni * sizeof(uint32_t))) {
                    if (bad_tok++ < 6) {
                        fprintf(stderr, "  %s/%s text %zu special=%d differs\n", cfgs[c].model,
                                cfgs[c].pre ? cfgs[c].pre : "-", i, sp);
                        print_text("text", texts.s[i], texts.len[i]);
                        print_diff(ref[sp], na[sp], ids, ni);
                    }
                }
                free(ids);
                size_t dl;
                char *d = jp_str(&j, &dl), *mine;
                size_t ml;
                assert_int_equal(tokenizer_decode(tok[c], ref[sp], na[sp], sp, &mine, &ml), 0);
                if (ml != dl || memcmp(mine, d, dl)) {
                    if (bad_detok++ < 6) {
                        fprintf(stderr, "  %s/%s detokenize of text %zu special=%d differs\n",
                                cfgs[c].model, cfgs[c].pre ? cfgs[c].pre : "-", i, sp);
                        print_text("llama.cpp", d, dl);
                        print_text("kvd      ", mine, ml);
                    }
                }
                free(mine);
                free(d);
            }
            free(ref[0]);
            free(ref[1]);
            jp_ws(&j);
            j.p++; /* ] */
        }
        for (int s = 0; s < 600; s++) {
            size_t ni;
            uint32_t *ids = jp_ids(&ji, &ni);
            jp_ws(&j);
            j.p++;
            for (int sp = 0; sp < 2; sp++) {
                size_t dl, ml;
                char *d = jp_str(&j, &dl), *mine;
                assert_int_equal(tokenizer_decode(tok[c], ids, ni, sp, &mine, &ml), 0);
                if (ml != dl || memcmp(mine, d, dl)) {
                    if (bad_detok++ < 6) {
                        fprintf(stderr, "  %s/%s detokenize of ids line %d special=%d differs\n",
                                cfgs[c].model, cfgs[c].pre ? cfgs[c].pre : "-", s, sp);
                        print_ids("ids", ids, ni);
                        print_text("llama.cpp", d, dl);
                        print_text("kvd      ", mine, ml);
                    }
                }
                /* the streaming detokenizer gives the same text */
                struct tok_stream *st = tok_stream_new(tok[c], sp);
                char *acc = malloc(ni * TOK_STREAM_MAX_OUT + TOK_STREAM_MAX_OUT);
                size_t al = 0;
                for (size_t k = 0; k < ni; k++)
                    al += tok_stream_push(st, ids[k], acc + al, TOK_STREAM_MAX_OUT);
                al += tok_stream_flush(st, acc + al, TOK_STREAM_MAX_OUT);
                if (al != dl || memcmp(acc, d, dl))
                    bad_stream++;
                tok_stream_free(st);
                free(acc);
                free(mine);
                free(d);
            }
            jp_ws(&j);
            j.p++;
            free(ids);
        }
        fprintf(stderr,
                "%-6s %-15s %zu texts (%zu ids), 600 id sequences: %zu tokenize, %zu "
                "detokenize, %zu stream differences\n",
                cfgs[c].model, cfgs[c].pre ? cfgs[c].pre : "-", texts.n, n_ids, bad_tok, bad_detok,
                bad_stream);
        total_bad += bad_tok + bad_detok + bad_stream;
        free(out);
        free(idl);
        tokenizer_free(tok[c]);
        gguf_close(gg[c]);
    }
    tt_free(&texts);
    free(corpus);
    assert_int_equal(total_bad, 0);
}

int main(void)
{
    static char dir[512];
    const char *home = getenv("HOME");
    char hd[400];
    snprintf(hd, sizeof hd, "%s/.cache/kvd/node-llama-cpp", home ? home : "/nonexistent");
    const char *cands[] = {getenv("KVD_NODE_LLAMA_CPP_DIR"), hd, "/tmp/llcpp"};
    for (size_t i = 0; i < sizeof cands / sizeof cands[0] && !module_dir; i++) {
        if (!cands[i])
            continue;
        snprintf(dir, sizeof dir, "%s/node_modules/node-llama-cpp/package.json", cands[i]);
        if (access(dir, R_OK) == 0) {
            snprintf(dir, sizeof dir, "%s", cands[i]);
            module_dir = dir;
        }
    }
    if (!module_dir || system("node --version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "skipped: node or node-llama-cpp not found (set KVD_NODE_LLAMA_CPP_DIR)\n");
        return 77;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvd-tok-llamacpp-XXXXXX");
    if (!mkdtemp(tmpdir))
        return 1;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_equal_to_llamacpp)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char rm[400];
    snprintf(rm, sizeof rm, "rm -rf %s", tmpdir);
    if (getenv("KVD_TOK_KEEP")) /* the vocabularies, models and outputs, to look at */
        fprintf(stderr, "kept %s\n", tmpdir);
    else if (system(rm) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return rc;
}
