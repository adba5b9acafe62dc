/* bench_constrained: decode tokens/s of generates constrained by a JSON
 * Schema against the same generates unconstrained, at batch 1 and batch
 * 16, through a real kvd (cpu backend) on a random model made by
 * kvd-gguf-gen. Each batch is B generates pipelined on one connection
 * (seeds differ, temperature 1, ignore_eos, max_tokens tokens each); the
 * schema is an array of objects of at least 200 items, so no answer ends
 * before max_tokens. Prints the best of 5 runs of each (they alternate,
 * so load on a shared machine hits both alike; BENCH_VERBOSE=1 prints
 * every run). A program that prints numbers, not a test
 * (docs/performance.md).
 *
 *   bench_constrained [MAX_TOKENS] [VOCAB]   (defaults 128, 32000) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvd_harness.h"

static const char SCHEMA[] =
    "{\"type\":\"array\",\"minItems\":200,\"items\":{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"maxLength\":24},\"n\":{\"type\":\"integer\",\"minimum\":0,"
    "\"maximum\":100000},\"tag\":{\"enum\":[\"red\",\"green\",\"blue\"]},\"ok\":{\"type\":"
    "\"boolean\"}},\"required\":[\"name\",\"n\",\"tag\"]}}";

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* B generates at once; returns generated tokens per second. */
static double run(const char *sock, int b, bool constrained, uint32_t max_tokens, int round)
{
    int fd = kh_connect(sock);
    if (fd < 0) {
        fprintf(stderr, "connect failed\n");
        exit(1);
    }
    static const uint32_t prompt[] = {11, 12, 13, 14, 15, 16, 17, 18};
    double t0 = now_s();
    for (int i = 0; i < b; i++) {
        struct kh_req q;
        kh_req_begin(&q, "generate", (uint64_t)i + 1, 6 + constrained);
        proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 8);
        proto_pack_kv_uint(&q.pk, "max_tokens", max_tokens);
        proto_pack_kv_double(&q.pk, "temperature", 1.0);
        proto_pack_kv_uint(&q.pk, "seed", (uint64_t)(round * 1000 + i));
        proto_pack_kv_bool(&q.pk, "ignore_eos", true);
        proto_pack_kv_uint(&q.pk, "priority", 0);
        if (constrained)
            proto_pack_kv_str(&q.pk, "json_schema", SCHEMA);
        if (kh_req_send(fd, &q) != 0)
            exit(1);
    }
    uint64_t toks = 0;
    for (int i = 0; i < b; i++) {
        struct kh_reply r;
        if (kh_recv(fd, &r) != 0 || r.code) {
            fprintf(stderr, "generate failed: %s\n", r.message);
            exit(1);
        }
        toks += kh_obj(r.root, "tokens")->via.array.size;
        kh_reply_free(&r);
    }
    double dt = now_s() - t0;
    close(fd);
    return (double)toks / dt;
}

int main(int argc, char **argv)
{
    uint32_t max_tokens = argc > 1 ? (uint32_t)atoi(argv[1]) : 128;
    unsigned vocab = argc > 2 ? (unsigned)atoi(argv[2]) : 32000;
    char dir[] = "/tmp/kvd-bench-cons.XXXXXX", model[128], cmd[512];
    if (!mkdtemp(dir))
        return 1;
    snprintf(model, sizeof model, "%s/m.gguf", dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 4 --embd 512 --heads 8 --kv-heads 4 --ff 1408 "
             "--vocab %u --ctx 2048 --seed 3 >/dev/null",
             KVD_TOOLS_DIR, model, vocab);
    if (system(cmd) != 0)
        return 1;
    const char *const args[] = {"--backend", "cpu", "--model", model, "--no-roofline-probe", NULL};
    struct kh_proc p;
    if (kh_start(&p, NULL, args) != 0)
        return 1;
    printf("model: 4 layers, embd 512, ff 1408, vocab %u (kvd-gguf-gen), cpu backend; "
           "%u tokens per generate\n",
           vocab, max_tokens);
    run(p.sock, 1, true, 8, 99); /* warm up: model pages, grammar vocabulary */
    static const int batches[] = {1, 16};
    for (int k = 0; k < 2; k++) {
        double best[2] = {0, 0};
        for (int round = 0; round < 5; round++)
            for (int c = 0; c < 2; c++) {
                double t = run(p.sock, batches[k], c, max_tokens, round);
                if (getenv("BENCH_VERBOSE"))
                    fprintf(stderr, "  batch %d %s: %.1f\n", batches[k], c ? "schema" : "plain", t);
                if (t > best[c])
                    best[c] = t;
            }
        printf("batch %2d: unconstrained %.1f tokens/s, json_schema %.1f tokens/s (%+.1f %%)\n",
               batches[k], best[0], best[1], 100.0 * (best[1] - best[0]) / best[0]);
    }
    kh_stop(&p);
    unlink(model);
    rmdir(dir);
    return 0;
}
