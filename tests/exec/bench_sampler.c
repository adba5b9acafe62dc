/* bench_sampler: the cost of one sampler_pick (what the cpu backend's sample
 * op runs per sequence per step) at the vocabularies of the benchmark model
 * (32000) and Llama 3 (128256), for greedy, temperature alone, top-k 50,
 * top-p 0.95 and both, on logits shaped like a model's (a normal spread
 * with a few strong candidates). Median of 50 picks after 5 warm-ups.
 * Usage: bench_sampler [VOCAB...] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "sampler.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rs = 88172645463325252ull;
static double unif(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (double)(rs >> 11) * (1.0 / 9007199254740992.0);
}

int main(int argc, char **argv)
{
    uint32_t vocabs[8] = {32000, 128256};
    int nv = 2;
    if (argc > 1) {
        nv = 0;
        for (int i = 1; i < argc && nv < 8; i++)
            vocabs[nv++] = (uint32_t)strtoul(argv[i], NULL, 10);
    }
    static const struct {
        const char *name;
        struct sample_row row;
    } modes[] = {
        {"greedy", {.top_p = 1.0f}},
        {"T 0.8", {.temperature = 0.8f, .top_p = 1.0f}},
        {"T 0.8, top-k 50", {.temperature = 0.8f, .top_k = 50, .top_p = 1.0f}},
        {"T 0.8, top-p 0.95", {.temperature = 0.8f, .top_p = 0.95f}},
        {"T 0.8, top-k 50, top-p 0.95", {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f}},
    };
    struct sampler_scratch sc = {0};
    printf("%-30s %8s %12s\n", "mode", "vocab", "us per pick");
    for (int v = 0; v < nv; v++) {
        uint32_t n = vocabs[v];
        float *l = malloc((size_t)n * sizeof *l);
        if (!l || n == 0)
            return 1;
        for (uint32_t i = 0; i < n; i++) /* Box-Muller normal, sd 2, plus a few leaders */
            l[i] = (float)(2.0 * sqrt(-2.0 * log(1.0 - unif())) * cos(6.283185307179586 * unif()));
        for (int k = 0; k < 8; k++)
            l[(uint32_t)(unif() * n)] = 12.0f + (float)k;
        for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
            double t[50];
            uint32_t tok = 0;
            for (int i = 0; i < 55; i++) {
                struct sample_row row = modes[m].row;
                row.u = unif();
                double t0 = now_s();
                if (sampler_pick(&row, &sc, l, n, &tok))
                    return 1;
                if (i >= 5)
                    t[i - 5] = now_s() - t0;
            }
            qsort(t, 50, sizeof t[0], cmp_d);
            printf("%-30s %8u %12.1f\n", modes[m].name, n, t[25] * 1e6);
        }
        free(l);
    }
    sampler_scratch_free(&sc);
    return 0;
}
