/* bench_decode: decode throughput of the real daemon. Starts kvd ($KVD_BIN
 * or build/bin/kvd) serving MODEL, then measures
 *   1. batch 1: one greedy request, decode tokens/s after the first token;
 *   2. N concurrent streams (default 16), each on its own connection:
 *      aggregate generated tokens/s over the wall time of the whole batch.
 * Each also reports the executor's host time per plain decode step (stats
 * `requests.decode_host_ms` / `decode_host_steps`: planning, commit,
 * taking the tokens, publishing) and the device's wait for the host
 * between two of them (`decode_idle_ms`), over the phase, and the steps
 * planned ahead (`overlapped_steps`, kvd --overlap).
 * Prints one JSON line per measurement. A benchmark, not a test.
 * Usage: bench_decode MODEL [PROMPT_LEN=16] [GEN_LEN=64] [STREAMS=16] [kvd args...] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvd_harness.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Streaming, so that every step sends something: the harness's reads give
 * up after 30 s of silence, and a long greedy request on a slow cpu can be
 * silent for longer than that. */
static int send_gen(int fd, uint64_t id, const uint32_t *toks, size_t n, uint32_t max_tokens)
{
    struct kh_req r;
    kh_req_begin(&r, "generate", id, 4);
    proto_pack_kv_u32_array(&r.pk, "tokens", toks, n);
    proto_pack_kv_uint(&r.pk, "max_tokens", max_tokens);
    proto_pack_kv_double(&r.pk, "temperature", 0.0);
    proto_pack_kv_bool(&r.pk, "stream", true);
    return kh_req_send(fd, &r);
}

/* The final reply of the request on fd, skipping its events. */
static int recv_final(int fd, struct kh_reply *r)
{
    for (;;) {
        if (kh_recv(fd, r))
            return -1;
        if (!kh_obj(r->root, "event"))
            return 0;
        kh_reply_free(r);
    }
}

static double get_double(const msgpack_object *map, const char *key)
{
    const msgpack_object *o = kh_obj(map, key);
    if (!o)
        return 0;
    if (o->type == MSGPACK_OBJECT_FLOAT64 || o->type == MSGPACK_OBJECT_FLOAT32)
        return o->via.f64;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return (double)o->via.u64;
    return 0;
}

/* The executor's host-time counters (stats `requests`). */
struct host_time {
    double host_steps, host_ms, idle_steps, idle_ms, overlapped;
};

static int host_time_get(int fd, struct host_time *h)
{
    struct kh_reply r;
    memset(h, 0, sizeof *h);
    if (kh_call0(fd, "stats", 999999, &r) != 0) {
        kh_reply_free(&r);
        return -1;
    }
    const msgpack_object *q = kh_obj(r.root, "requests");
    h->host_steps = get_double(q, "decode_host_steps");
    h->host_ms = get_double(q, "decode_host_ms");
    h->idle_steps = get_double(q, "decode_idle_steps");
    h->idle_ms = get_double(q, "decode_idle_ms");
    h->overlapped = get_double(q, "overlapped_steps");
    kh_reply_free(&r);
    return 0;
}

/* The phase's share (after - before) as JSON fields. */
static void host_time_print(const struct host_time *a, const struct host_time *b)
{
    double hs = b->host_steps - a->host_steps, is = b->idle_steps - a->idle_steps;
    printf(",\"host_ms_per_step\":%.4f,\"idle_ms_per_step\":%.4f,\"overlapped_steps\":%.0f",
           hs > 0 ? (b->host_ms - a->host_ms) / hs : 0.0,
           is > 0 ? (b->idle_ms - a->idle_ms) / is : 0.0, b->overlapped - a->overlapped);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr,
                "usage: bench_decode MODEL [PROMPT_LEN] [GEN_LEN] [STREAMS] [kvd args...]\n");
        return 2;
    }
    const char *model = argv[1];
    uint32_t plen = argc > 2 ? (uint32_t)atoi(argv[2]) : 16;
    uint32_t glen = argc > 3 ? (uint32_t)atoi(argv[3]) : 64;
    uint32_t streams = argc > 4 ? (uint32_t)atoi(argv[4]) : 16;
    if (plen == 0 || plen > 4096 || glen == 0 || streams == 0 || streams > 256) {
        fprintf(stderr, "bench_decode: bad sizes\n");
        return 2;
    }
    if (!getenv("KVD_BIN"))
        setenv("KVD_BIN", "build/bin/kvd", 0);
    const char *args[32] = {"--model", model};
    int na = 2;
    for (int i = 5; i < argc && na < 30; i++)
        args[na++] = argv[i];
    args[na] = NULL;
    struct kh_proc p;
    if (kh_start(&p, NULL, args) != 0) {
        fprintf(stderr, "bench_decode: kvd did not start\n");
        return 1;
    }
    int rc = 1, sfd = -1;
    uint32_t *prompt = malloc(plen * sizeof(uint32_t));
    int *fds = calloc(streams, sizeof(int));
    if (!prompt || !fds)
        goto out;
    for (uint32_t i = 0; i < plen; i++)
        prompt[i] = 1 + (i * 7919) % 1000; /* same prompt as tests/bench/llamacpp_decode.mjs */

    /* 1. batch 1 (a warm-up request first: page in the weights). */
    int fd = kh_connect(p.sock);
    sfd = kh_connect(p.sock);
    struct kh_reply r;
    struct host_time h0 = {0}, h1 = {0};
    if (sfd < 0)
        goto out;
    for (int round = 0; round < 2; round++) {
        if (round && host_time_get(sfd, &h0))
            goto out;
        prompt[0] = 1 + (uint32_t)round; /* a different first token: no cache hit */
        if (send_gen(fd, 1 + round, prompt, plen, round ? glen : 4) || recv_final(fd, &r) ||
            r.code) {
            fprintf(stderr, "bench_decode: generate failed: %s\n", r.message);
            goto out;
        }
        if (round) {
            const msgpack_object *t = kh_obj(r.root, "timing");
            double ttft = get_double(t, "ttft_ms"), total = get_double(t, "total_ms");
            const msgpack_object *u = kh_obj(r.root, "usage");
            uint64_t n = kh_u64(u, "completion");
            printf("{\"bench\":\"decode_batch1\",\"prompt\":%u,\"gen\":%llu,\"prefill_tok_s\":%.1f,"
                   "\"decode_tok_s\":%.2f,\"ttft_ms\":%.1f",
                   plen, (unsigned long long)n, plen / (ttft / 1e3),
                   n > 1 ? (double)(n - 1) / ((total - ttft) / 1e3) : 0.0, ttft);
            if (host_time_get(sfd, &h1) == 0)
                host_time_print(&h0, &h1);
            printf("}\n");
        }
        kh_reply_free(&r);
    }
    close(fd);
    fd = -1;

    /* 2. concurrent streams, one connection each, different prompts. */
    for (uint32_t s = 0; s < streams; s++) {
        fds[s] = kh_connect(p.sock);
        if (fds[s] < 0)
            goto out;
    }
    if (host_time_get(sfd, &h0))
        goto out;
    double t0 = now_s();
    for (uint32_t s = 0; s < streams; s++) {
        prompt[0] = 100 + s;
        if (send_gen(fds[s], 1, prompt, plen, glen))
            goto out;
    }
    uint64_t total_gen = 0;
    double sum_ttft = 0;
    for (uint32_t s = 0; s < streams; s++) {
        if (recv_final(fds[s], &r) || r.code) {
            fprintf(stderr, "bench_decode: stream %u failed: %s\n", s, r.message);
            goto out;
        }
        total_gen += kh_u64(kh_obj(r.root, "usage"), "completion");
        sum_ttft += get_double(kh_obj(r.root, "timing"), "ttft_ms");
        kh_reply_free(&r);
    }
    double wall = now_s() - t0;
    printf("{\"bench\":\"decode_concurrent\",\"streams\":%u,\"prompt\":%u,\"gen\":%u,"
           "\"tokens\":%llu,\"wall_s\":%.2f,\"aggregate_tok_s\":%.2f,\"mean_ttft_ms\":%.1f",
           streams, plen, glen, (unsigned long long)total_gen, wall, (double)total_gen / wall,
           sum_ttft / streams);
    if (host_time_get(sfd, &h1) == 0)
        host_time_print(&h0, &h1);
    printf("}\n");
    rc = 0;
out:
    for (uint32_t s = 0; fds && s < streams; s++)
        if (fds[s] > 0)
            close(fds[s]);
    free(fds);
    free(prompt);
    if (sfd >= 0)
        close(sfd);
    kh_stop(&p);
    return rc;
}
