/* bench_spec: speculative vs plain decoding on the real daemon (a program
 * that prints numbers, not a test). Starts kvd ($KVD_BIN or build/bin/kvd)
 * serving TARGET with DRAFT as its draft model, then per workload and
 * per request `speculative` ("off", "ngram", "draft"), REPS interleaved runs
 * of one greedy request (batch 1): decode tokens/s after the first token,
 * and the drafts verified and kept (stats deltas). Workloads:
 *   edit: the prompt holds most of the answer: a 64-token text P, the
 *         model's own greedy continuation O of P, then P again (a rewrite);
 *   chat: a fresh 64-token prompt.
 * Then the batch sweep: B concurrent edit requests (B = 1, 2, 4, 8), n-gram
 * vs plain, aggregate tokens/s (where speculation stops paying: the
 * --spec-max-batch default). Every run's tokens are checked against the
 * plain run's (greedy: they must be equal). One JSON line per measurement.
 * Usage: bench_spec TARGET DRAFT [GEN=96] [REPS=3] [kvd args...] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvd_harness.h"

#define PLEN 64
#define MAXGEN 512
#define MAXB 8

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int send_gen(int fd, uint64_t id, const uint32_t *toks, size_t n, uint32_t max_tokens,
                    const char *spec)
{
    struct kh_req r;
    kh_req_begin(&r, "generate", id, 6);
    proto_pack_kv_u32_array(&r.pk, "tokens", toks, n);
    proto_pack_kv_uint(&r.pk, "max_tokens", max_tokens);
    proto_pack_kv_double(&r.pk, "temperature", 0.0);
    proto_pack_kv_bool(&r.pk, "stream", true); /* the harness gives up after 30 s of silence */
    proto_pack_kv_bool(&r.pk, "ignore_eos", true);
    proto_pack_kv_str(&r.pk, "speculative", spec);
    return kh_req_send(fd, &r);
}

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
    const msgpack_object *o = map ? kh_obj(map, key) : NULL;
    if (!o)
        return 0;
    if (o->type == MSGPACK_OBJECT_FLOAT64 || o->type == MSGPACK_OBJECT_FLOAT32)
        return o->via.f64;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return (double)o->via.u64;
    return 0;
}

/* requests.speculative's drafted and accepted so far. */
static void spec_counts(const char *sock, uint64_t *drafted, uint64_t *accepted)
{
    int fd = kh_connect(sock);
    struct kh_reply r;
    *drafted = *accepted = 0;
    if (fd >= 0 && kh_call0(fd, "stats", 1, &r) == 0) {
        const msgpack_object *q = kh_obj(r.root, "requests");
        const msgpack_object *s = q ? kh_obj(q, "speculative") : NULL;
        if (s) {
            *drafted = kh_u64(s, "drafted");
            *accepted = kh_u64(s, "accepted");
        }
        kh_reply_free(&r);
    }
    if (fd >= 0)
        close(fd);
}

struct run {
    double decode_tok_s;
    uint32_t toks[MAXGEN];
    size_t n;
};

/* One request; its tokens and decode rate. */
static int one(const char *sock, const uint32_t *p, size_t n, uint32_t gen, const char *spec,
               struct run *out)
{
    int fd = kh_connect(sock);
    struct kh_reply r;
    if (fd < 0 || send_gen(fd, 1, p, n, gen, spec) || recv_final(fd, &r)) {
        fprintf(stderr, "bench_spec: generate failed\n");
        return -1;
    }
    if (r.code) {
        fprintf(stderr, "bench_spec: generate: %s\n", r.message);
        kh_reply_free(&r);
        return -1;
    }
    const msgpack_object *t = kh_obj(r.root, "timing");
    double ttft = get_double(t, "ttft_ms"), total = get_double(t, "total_ms");
    const msgpack_object *a = kh_obj(r.root, "tokens");
    out->n = a && a->via.array.size < MAXGEN ? a->via.array.size : 0;
    for (size_t i = 0; i < out->n; i++)
        out->toks[i] = (uint32_t)a->via.array.ptr[i].via.u64;
    out->decode_tok_s = out->n > 1 ? (double)(out->n - 1) / ((total - ttft) / 1e3) : 0;
    kh_reply_free(&r);
    close(fd);
    return 0;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_spec TARGET DRAFT [GEN] [REPS] [kvd args...]\n");
        return 2;
    }
    uint32_t gen = argc > 3 ? (uint32_t)atoi(argv[3]) : 96;
    uint32_t reps = argc > 4 ? (uint32_t)atoi(argv[4]) : 3;
    if (gen < 2 || gen >= MAXGEN || reps == 0 || reps > 16) {
        fprintf(stderr, "bench_spec: bad sizes\n");
        return 2;
    }
    if (!getenv("KVD_BIN"))
        setenv("KVD_BIN", "build/bin/kvd", 0);
    const char *args[40] = {"--model",         argv[1], "--draft-model", argv[2],
                            "--device-blocks", "2048",  "--host-blocks", "0"};
    int na = 8;
    for (int i = 5; i < argc && na < 38; i++)
        args[na++] = argv[i];
    args[na] = NULL;
    struct kh_proc p;
    if (kh_start(&p, NULL, args) != 0) {
        fprintf(stderr, "bench_spec: kvd did not start\n");
        return 1;
    }
    static const char *const modes[] = {"off", "ngram", "draft"};
    int rc = 1;
    static uint32_t edit[MAXB][PLEN * 2 + MAXGEN], chat[PLEN];
    size_t elen[MAXB];
    struct run plain, r;
    /* the edit prompts: P, the model's own continuation of P, then P */
    for (uint32_t b = 0; b < MAXB; b++) {
        uint32_t *e = edit[b];
        for (uint32_t i = 0; i < PLEN; i++)
            e[i] = 3 + (i * 7919 + b * 104729) % 997;
        if (one(p.sock, e, PLEN, gen, "off", &plain))
            goto out;
        memcpy(e + PLEN, plain.toks, plain.n * 4);
        memcpy(e + PLEN + plain.n, e, PLEN * 4);
        elen[b] = PLEN * 2 + plain.n;
    }
    for (uint32_t i = 0; i < PLEN; i++)
        chat[i] = 3 + (i * 6007 + 17) % 991;
    /* BENCH_SPEC_PROMPTS=DIR: the two prompts as JSON arrays (edit.json,
     * chat.json), for llama.cpp's run on the same tokens */
    const char *pdir = getenv("BENCH_SPEC_PROMPTS");
    for (int w = 0; pdir && w < 2; w++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s.json", pdir, w ? "chat" : "edit");
        FILE *f = fopen(path, "w");
        if (!f)
            goto out;
        size_t n = w ? PLEN : elen[0];
        for (size_t i = 0; i < n; i++)
            fprintf(f, "%s%u", i ? "," : "[", w ? chat[i] : edit[0][i]);
        fprintf(f, "]\n");
        fclose(f);
    }
    for (int w = 0; w < 2; w++) {
        const uint32_t *prompt = w ? chat : edit[0];
        size_t plen = w ? PLEN : elen[0];
        double rate[3][16];
        uint64_t drafted[3] = {0}, accepted[3] = {0};
        if (one(p.sock, prompt, plen, gen, "off", &plain)) /* warm-up, and the reference */
            goto out;
        for (uint32_t k = 0; k < reps; k++)
            for (int m = 0; m < 3; m++) {
                uint64_t d0, a0, d1, a1;
                spec_counts(p.sock, &d0, &a0);
                if (one(p.sock, prompt, plen, gen, modes[m], &r))
                    goto out;
                spec_counts(p.sock, &d1, &a1);
                drafted[m] += d1 - d0;
                accepted[m] += a1 - a0;
                rate[m][k] = r.decode_tok_s;
                if (r.n != plain.n || memcmp(r.toks, plain.toks, r.n * 4)) {
                    fprintf(stderr, "bench_spec: %s output differs from plain decoding's\n",
                            modes[m]);
                    goto out;
                }
            }
        for (int m = 0; m < 3; m++) {
            qsort(rate[m], reps, sizeof(double), cmp_d);
            printf("{\"bench\":\"spec_batch1\",\"workload\":\"%s\",\"speculative\":\"%s\","
                   "\"gen\":%u,\"decode_tok_s_median\":%.2f,\"decode_tok_s_min\":%.2f,"
                   "\"decode_tok_s_max\":%.2f,\"drafted\":%llu,\"accepted\":%llu,"
                   "\"acceptance\":%.3f}\n",
                   w ? "chat" : "edit", modes[m], gen, rate[m][reps / 2], rate[m][0],
                   rate[m][reps - 1], (unsigned long long)drafted[m],
                   (unsigned long long)accepted[m],
                   drafted[m] ? (double)accepted[m] / (double)drafted[m] : 0.0);
        }
    }
    /* the batch sweep: B concurrent edit requests, aggregate tokens/s */
    for (uint32_t B = 1; B <= MAXB; B *= 2)
        for (int m = 0; m < 2; m++) {
            int fds[MAXB];
            double t0 = now_s();
            uint64_t toks = 0, d0, a0, d1, a1;
            spec_counts(p.sock, &d0, &a0);
            for (uint32_t b = 0; b < B; b++) {
                fds[b] = kh_connect(p.sock);
                if (fds[b] < 0 || send_gen(fds[b], 1, edit[b], elen[b], gen, modes[m]))
                    goto out;
            }
            for (uint32_t b = 0; b < B; b++) {
                struct kh_reply rep;
                if (recv_final(fds[b], &rep) || rep.code)
                    goto out;
                toks += kh_u64(kh_obj(rep.root, "usage"), "completion");
                kh_reply_free(&rep);
                close(fds[b]);
            }
            double wall = now_s() - t0;
            spec_counts(p.sock, &d1, &a1);
            printf("{\"bench\":\"spec_batch\",\"batch\":%u,\"speculative\":\"%s\",\"gen\":%u,"
                   "\"aggregate_tok_s\":%.2f,\"drafted\":%llu,\"accepted\":%llu}\n",
                   B, modes[m], gen, (double)toks / wall, (unsigned long long)(d1 - d0),
                   (unsigned long long)(a1 - a0));
        }
    rc = 0;
out:
    kh_stop(&p);
    return rc;
}
