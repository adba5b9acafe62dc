/* bench_export: reading a 4k-token sequence through kv_export (descriptors,
 * pages mapped, every byte summed, released) against kv_read (the bytes
 * copied into the reply and received, every byte summed), on a kvd started
 * here (cpu backend), in rounds of the paths side by side (medians).
 * Usage: bench_export KVD_BIN [ITERS [ROUNDS [PAGE_BYTES]]]. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvd/client.h"
#include "kvd_harness.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t sum(const unsigned char *p, size_t n)
{
    uint64_t s = 0;
    const uint64_t *q = (const uint64_t *)p;
    for (size_t i = 0; i < n / 8; i++)
        s += q[i];
    return s;
}

static double load_avg(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1)
            l = -1;
        fclose(f);
    }
    return l;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

#define MAX_ROUNDS 64

int main(int argc, char **argv)
{
    const char *page = argc > 4 ? argv[4] : NULL;
    const char *args[] = {
        "--backend", "cpu", "--device-blocks", "1024", page ? "--page-bytes" : NULL, page, NULL};
    struct kh_proc d;
    int iters = argc > 2 ? atoi(argv[2]) : 10, rounds = argc > 3 ? atoi(argv[3]) : 7;
    if (iters < 1 || rounds < 1 || rounds > MAX_ROUNDS)
        return fprintf(stderr,
                       "usage: bench_export KVD_BIN [ITERS [ROUNDS (<= %d) [PAGE_BYTES]]]\n",
                       MAX_ROUNDS),
               2;
    if (argc > 1)
        setenv("KVD_BIN", argv[1], 1);
    if (kh_start(&d, NULL, args) != 0)
        return 1;
    struct kvd_ctx *c = kvd_connect(d.sock);
    struct kvd_hello_info h;
    uint64_t seq, s1 = 0, s2 = 0;
    size_t n = 4096, len, n_maps = 0;
    if (c->err || kvd_hello(c, &h) || kvd_seq_open(c, NULL, &seq) ||
        kvd_seq_extend(c, seq, n, NULL))
        return fprintf(stderr, "setup: %s\n", c->errstr), 1;
    size_t bytes = n * h.token_bytes;
    unsigned char *buf = malloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        buf[i] = (unsigned char)(i * 31 + 7);
    /* kv_write in max_frame-sized pieces */
    for (size_t t = 0; t < n; t += 1024)
        if (kvd_kv_write(c, seq, t, 1024, buf + t * h.token_bytes, 1024 * h.token_bytes))
            return fprintf(stderr, "write: %s\n", c->errstr), 1;
    /* Rounds of the three paths side by side (iters each), so that the
     * machine's load falls on all of them alike; medians of the rounds. */
    double t_read[MAX_ROUNDS], t_exp[MAX_ROUNDS], t_exp0[MAX_ROUNDS], ratio[MAX_ROUNDS];
    double sum_read[MAX_ROUNDS] = {0}, sum_exp[MAX_ROUNDS] = {0}; /* of them: the sums */
    double load0 = load_avg();
    for (int r = 0; r < rounds; r++) {
        double t0 = now_s();
        for (int i = 0; i < iters; i++) {
            if (kvd_kv_read(c, seq, 0, n, buf, bytes, &len))
                return fprintf(stderr, "read: %s\n", c->errstr), 1;
            double ts = now_s();
            s1 += sum(buf, len);
            sum_read[r] += now_s() - ts;
        }
        t_read[r] = (now_s() - t0) / iters;
        sum_read[r] /= iters;
        t0 = now_s();
        for (int i = 0; i < iters; i++) {
            struct kvd_export *ex;
            if (kvd_kv_export(c, seq, 0, 0, false, &ex))
                return fprintf(stderr, "export: %s\n", c->errstr), 1;
            double ts = now_s();
            for (size_t b = 0; b < ex->n_blocks; b++)
                s2 += sum(ex->blocks[b].data, ex->blocks[b].bytes);
            sum_exp[r] += now_s() - ts;
            n_maps = ex->n_maps;
            kvd_kv_export_release(c, ex);
        }
        t_exp[r] = (now_s() - t0) / iters;
        sum_exp[r] /= iters;
        t0 = now_s();
        for (int i = 0; i < iters; i++) {
            struct kvd_export *ex;
            if (kvd_kv_export(c, seq, 0, 0, false, &ex))
                return 1;
            kvd_kv_export_release(c, ex);
        }
        t_exp0[r] = (now_s() - t0) / iters;
        ratio[r] = t_read[r] / t_exp[r];
        printf("round %d: kv_read + sum %.3f ms (sum %.3f), kv_export + sum + release %.3f ms "
               "(sum %.3f; %.1fx), mapping only %.3f ms\n",
               r + 1, t_read[r] * 1e3, sum_read[r] * 1e3, t_exp[r] * 1e3, sum_exp[r] * 1e3,
               ratio[r], t_exp0[r] * 1e3);
    }
    double load1 = load_avg();
    double mr = median(t_read, rounds), me = median(t_exp, rounds), m0 = median(t_exp0, rounds);
    double lo = ratio[0], hi = ratio[0];
    for (int r = 1; r < rounds; r++) {
        lo = ratio[r] < lo ? ratio[r] : lo;
        hi = ratio[r] > hi ? ratio[r] : hi;
    }
    printf("4096 tokens, %zu bytes (%zu-byte blocks, %zu descriptors), %d rounds of %d, load "
           "average %.1f -> %.1f; medians:\n",
           bytes, (size_t)h.block_bytes, n_maps, rounds, iters, load0, load1);
    printf("kv_read + sum:          %8.3f ms  (%.2f GB/s)\n", mr * 1e3, bytes / mr / 1e9);
    printf("kv_export + sum + rel.: %8.3f ms  (%.2f GB/s)  %.1fx (rounds %.1f-%.1fx, median "
           "%.1fx)\n",
           me * 1e3, bytes / me / 1e9, mr / me, lo, hi, median(ratio, rounds));
    printf("kv_export + release:    %8.3f ms  %.1fx (mapping only, bytes not touched)\n", m0 * 1e3,
           mr / m0);
    printf("the sums alone:         %8.3f ms of kv_read's buffer, %.3f ms of the mapped pages\n",
           median(sum_read, rounds) * 1e3, median(sum_exp, rounds) * 1e3);
    if (s1 != s2)
        fprintf(stderr, "checksums differ: %llu %llu\n", (unsigned long long)s1,
                (unsigned long long)s2);
    kvd_close(c);
    kh_stop(&d);
    return s1 == s2 ? 0 : 1;
}
