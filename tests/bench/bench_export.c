/* bench_export: reading a 4k-token sequence through kv_export (descriptors,
 * pages mapped, every byte summed, released) against kv_read (the bytes
 * copied into the reply and received, every byte summed), on a kvd started
 * here (cpu backend). Usage: bench_export KVD_BIN [iterations]. */
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

int main(int argc, char **argv)
{
    static const char *const args[] = {"--backend", "cpu", "--device-blocks", "1024", NULL};
    struct kh_proc d;
    int iters = argc > 2 ? atoi(argv[2]) : 50;
    if (argc > 1)
        setenv("KVD_BIN", argv[1], 1);
    if (kh_start(&d, NULL, args) != 0)
        return 1;
    struct kvd_ctx *c = kvd_connect(d.sock);
    struct kvd_hello_info h;
    uint64_t seq, s1 = 0, s2 = 0;
    size_t n = 4096, len;
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
    double t0 = now_s();
    for (int i = 0; i < iters; i++) {
        if (kvd_kv_read(c, seq, 0, n, buf, bytes, &len))
            return fprintf(stderr, "read: %s\n", c->errstr), 1;
        s1 += sum(buf, len);
    }
    double t_read = (now_s() - t0) / iters;
    t0 = now_s();
    for (int i = 0; i < iters; i++) {
        struct kvd_export *ex;
        if (kvd_kv_export(c, seq, 0, 0, false, &ex))
            return fprintf(stderr, "export: %s\n", c->errstr), 1;
        for (size_t b = 0; b < ex->n_blocks; b++)
            s2 += sum(ex->blocks[b].data, ex->blocks[b].bytes);
        kvd_kv_export_release(c, ex);
    }
    double t_exp = (now_s() - t0) / iters;
    t0 = now_s();
    for (int i = 0; i < iters; i++) {
        struct kvd_export *ex;
        if (kvd_kv_export(c, seq, 0, 0, false, &ex))
            return 1;
        kvd_kv_export_release(c, ex);
    }
    double t_exp0 = (now_s() - t0) / iters;
    printf("4096 tokens, %zu bytes (%zu-byte blocks), %d iterations\n", bytes,
           (size_t)h.block_bytes, iters);
    printf("kv_read + sum:          %8.3f ms  (%.2f GB/s)\n", t_read * 1e3, bytes / t_read / 1e9);
    printf("kv_export + sum + rel.: %8.3f ms  (%.2f GB/s)  %.1fx\n", t_exp * 1e3,
           bytes / t_exp / 1e9, t_read / t_exp);
    printf("kv_export + release:    %8.3f ms  %.1fx (mapping only, bytes not touched)\n",
           t_exp0 * 1e3, t_read / t_exp0);
    if (s1 != s2)
        fprintf(stderr, "checksums differ: %llu %llu\n", (unsigned long long)s1,
                (unsigned long long)s2);
    kvd_close(c);
    kh_stop(&d);
    return s1 == s2 ? 0 : 1;
}
