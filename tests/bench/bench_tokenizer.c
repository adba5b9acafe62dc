/* bench_tokenizer: tokens per second of kvd's tokenizer and llama.cpp's
 * (npm node-llama-cpp, the model's own tokenize) on the same 1 MB text and
 * the same vocabularies, printed side by side. The vocabularies are the
 * tests' (tests/text/tok_learn.h: learned from this machine's licences and
 * translations); the text is 1 MB of the same sources (English licences and
 * translations in ~35 scripts). Best of --reps runs each.
 *
 *   bench_tokenizer [--reps N] [--bytes N]
 *
 * llama.cpp's column is skipped without node or node-llama-cpp
 * (KVD_NODE_LLAMA_CPP_DIR, ~/.cache/kvd/node-llama-cpp). Results:
 * docs/performance.md. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "tokenizer.h"
#include "unicode.h"
#include "text/tok_learn.h"

#ifndef KVD_TESTS_SRC
#define KVD_TESTS_SRC "tests"
#endif
#ifndef KVD_TOOLS_DIR
#define KVD_TOOLS_DIR "bin"
#endif

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *find_module_dir(void)
{
    static char dir[600];
    const char *home = getenv("HOME");
    char hd[400];
    snprintf(hd, sizeof hd, "%s/.cache/kvd/node-llama-cpp", home ? home : "/nonexistent");
    const char *cands[] = {getenv("KVD_NODE_LLAMA_CPP_DIR"), hd, "/tmp/llcpp"};
    for (size_t i = 0; i < sizeof cands / sizeof cands[0]; i++) {
        if (!cands[i])
            continue;
        snprintf(dir, sizeof dir, "%s/node_modules/node-llama-cpp/package.json", cands[i]);
        if (access(dir, R_OK) == 0) {
            snprintf(dir, sizeof dir, "%s", cands[i]);
            return system("node --version >/dev/null 2>&1") == 0 ? dir : NULL;
        }
    }
    return NULL;
}

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f)) {
        perror(path);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    int reps = 5;
    size_t bytes = 1 << 20;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--bytes"))
            bytes = (size_t)atol(argv[i + 1]);
    }
    const char *tools = getenv("KVD_TOOLS_DIR") ? getenv("KVD_TOOLS_DIR") : KVD_TOOLS_DIR;
    const char *mod = find_module_dir();
    char tmp[] = "/tmp/kvd-bench-tok-XXXXXX";
    if (!mkdtemp(tmp))
        return 1;

    size_t clen, tlen;
    char *corpus = tl_training_corpus(180000, 5, &clen);
    char *raw = tl_corpus(bytes, &tlen);
    /* well-formed UTF-8, as JavaScript reads the file (some translations
     * are in other encodings) */
    char *text = malloc(3 * tlen + 8);
    struct uni_utf8_state u8 = {0};
    size_t w = uni_utf8_feed(&u8, (const uint8_t *)raw, tlen, text);
    tlen = w + uni_utf8_finish(&u8, text + w);
    free(raw);
    char tpath[700];
    snprintf(tpath, sizeof tpath, "%s/text.txt", tmp);
    write_file(tpath, text, tlen);
    static const char *const train[] = {"gpt-2", "llama-bpe", "tekken", NULL};
    struct tl_bpe bpe;
    tl_learn_bpe(corpus, clen, train, 2500, &bpe);
    size_t spm_len = 0;
    uint8_t *spm = tl_learn_spm(corpus, clen, 2500, &spm_len);

    printf("bench_tokenizer: %zu bytes of text, best of %d; vocabularies of the tests "
           "(%zu BPE tokens, 2500 merges)\n",
           tlen, reps, bpe.v.n);
    printf("%-16s %10s %12s %12s %14s %8s\n", "vocabulary", "tokens", "kvd tok/s", "kvd MB/s",
           "llama.cpp tok/s", "ratio");
    static const char *const pres[] = {NULL, "llama-bpe", "qwen2", "gpt-2", "tekken", "default"};
    for (size_t c = 0; c < sizeof pres / sizeof pres[0]; c++) {
        size_t vl = 0;
        uint8_t *vg = pres[c] ? tl_bpe_gguf(&bpe, pres[c], &vl) : spm;
        if (!pres[c])
            vl = spm_len;
        char vpath[700], mpath[700], cmd[2600];
        snprintf(vpath, sizeof vpath, "%s/vocab.gguf", tmp);
        snprintf(mpath, sizeof mpath, "%s/model.gguf", tmp);
        write_file(vpath, vg, vl);
        if (pres[c])
            free(vg);
        snprintf(cmd, sizeof cmd,
                 "%s/kvd-gguf-gen -o %s --tokenizer %s --layers 1 --embd 32 --heads 2 --ff 64 "
                 "--type f32",
                 tools, mpath, vpath);
        if (system(cmd) != 0) {
            fprintf(stderr, "bench_tokenizer: kvd-gguf-gen failed (KVD_TOOLS_DIR?)\n");
            return 1;
        }
        struct gguf *g;
        struct tokenizer *t;
        char err[256];
        if (gguf_open(mpath, &g, err, sizeof err) || tokenizer_load(g, &t, err, sizeof err)) {
            fprintf(stderr, "bench_tokenizer: %s\n", err);
            return 1;
        }
        double best = 1e30;
        size_t n = 0;
        for (int r = 0; r < reps; r++) {
            uint32_t *ids;
            double t0 = now();
            if (tokenizer_encode(t, text, tlen, false, false, &ids, &n))
                return 1;
            double dt = now() - t0;
            free(ids);
            if (dt < best)
                best = dt;
        }
        double ref_tps = 0;
        size_t ref_n = 0;
        if (mod) {
            snprintf(cmd, sizeof cmd, "node %s/text/tokenizer_llamacpp.mjs %s bench %s %s %d",
                     KVD_TESTS_SRC, mod, mpath, tpath, reps);
            FILE *p = popen(cmd, "r");
            double sec = 0;
            if (p && fscanf(p, "%zu %lf", &ref_n, &sec) == 2 && sec > 0)
                ref_tps = (double)ref_n / sec;
            if (p)
                pclose(p);
        }
        const char *name = pres[c] ? pres[c] : "llama (spm)";
        if (ref_tps > 0)
            printf("%-16s %10zu %12.0f %12.2f %14.0f %7.2fx%s\n", name, n, (double)n / best,
                   (double)tlen / best / 1e6, ref_tps, (double)n / best / ref_tps,
                   ref_n == n ? "" : "  (token counts differ!)");
        else
            printf("%-16s %10zu %12.0f %12.2f %14s %8s\n", name, n, (double)n / best,
                   (double)tlen / best / 1e6, "-", "-");
        fflush(stdout);
        tokenizer_free(t);
        gguf_close(g);
    }
    free(spm);
    tl_bpe_free(&bpe);
    free(corpus);
    free(text);
    char rm[700];
    snprintf(rm, sizeof rm, "rm -rf %s", tmp);
    return system(rm) == 0 ? 0 : 1;
}
