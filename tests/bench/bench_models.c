/* bench_models: the time to switch models when the device budget holds one
 * at a time (unload the other + load + first token) next to a cold start
 * of a second daemon for the same model (start + load + first token) and
 * to the model already loaded (a program that prints numbers, not a test).
 *
 *   bench_models [ROUNDS]
 *
 * Two random models (kvd-gguf-gen --layers 4 --embd 768 --heads 12
 * --kv-heads 4 --ff 2048 --vocab 8000, f16: about 80 MB of weights each),
 * served by one kvd on the cpu backend with a page budget (device-bytes)
 * that holds one model's weights, scratch and KV pages, not both models.
 * ROUNDS (default 5) rounds of:
 *   loaded       a generate (max_tokens 1) of a new 128-token prompt to the
 *                model that is loaded;
 *   switch       the same to the other model: the daemon unloads the idle
 *                one (its cached blocks to the host tier) and loads it;
 *   switch-warm  the same with a prompt the model saw before its last
 *                unload: its prefix comes back from the host tier;
 *   cold daemon  a second kvd started for one model (--model, no roofline
 *                probe, like the first), then the same generate: from the
 *                process's start to the reply (in each round, beside the
 *                first daemon, idle meanwhile).
 * Prints each kind's median, min and max wall time (the client's, request
 * to reply), and the daemon's last load_ms / unload_ms.
 *
 * Environment: KVD_BIN, KVD_TOOLS_DIR (as in ctest). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvd_harness.h"

#define N_PROMPT 128
#define VOCAB 8000
#define MAX_ROUNDS 64

static uint64_t g_id;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next_tok(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(3 + rng % (VOCAB - 3));
}

/* One generate of max_tokens 1; the wall time (ms), or -1 on failure. */
static double gen_ms(int fd, const char *model, const uint32_t *prompt)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "generate", ++g_id, 3 + (model != NULL));
    if (model)
        proto_pack_kv_str(&q.pk, "model", model);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, N_PROMPT);
    proto_pack_kv_uint(&q.pk, "max_tokens", 1);
    proto_pack_kv_double(&q.pk, "temperature", 0.0);
    double t0 = now_ms();
    if (kh_req_send(fd, &q) != 0 || kh_recv(fd, &r) != 0)
        return -1;
    double ms = now_ms() - t0;
    int code = r.code;
    if (code)
        fprintf(stderr, "generate (%s): %s\n", model ? model : "-", r.message);
    kh_reply_free(&r);
    return code ? -1 : ms;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void report(const char *what, double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp);
    printf("%-12s median %8.1f ms  min %8.1f  max %8.1f  (%d)\n", what, v[n / 2], v[0], v[n - 1],
           n);
}

/* stats models[model][key] as a double */
static double model_stat(int fd, const char *model, const char *key)
{
    struct kh_reply r;
    double v = -1;
    if (kh_call0(fd, "stats", ++g_id, &r) != 0)
        return v;
    const msgpack_object *m = kh_obj(r.root, "models");
    for (uint32_t i = 0; m && i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i];
        const msgpack_object *nm = kh_obj(e, "name");
        if (nm->via.str.size != strlen(model) || memcmp(nm->via.str.ptr, model, nm->via.str.size))
            continue;
        const msgpack_object *x = kh_obj(e, key);
        v = x->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (double)x->via.u64 : x->via.f64;
    }
    kh_reply_free(&r);
    return v;
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

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 5;
    const char *tools = getenv("KVD_TOOLS_DIR");
    if (!tools || !getenv("KVD_BIN") || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: KVD_BIN=... KVD_TOOLS_DIR=... bench_models [ROUNDS 1-%d]\n",
                MAX_ROUNDS);
        return 2;
    }
    char dir[] = "/var/tmp/kvd-bench-models.XXXXXX", a[128], b[128], cmd[1024], conf[1024];
    if (!mkdtemp(dir))
        return 1;
    snprintf(a, sizeof a, "%s/a.gguf", dir);
    snprintf(b, sizeof b, "%s/b.gguf", dir);
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 "%s/kvd-gguf-gen -o %s --layers 4 --embd 768 --heads 12 --kv-heads 4 --ff 2048 "
                 "--vocab %d --ctx 2048 --type f16 --seed %d >/dev/null",
                 tools, i ? b : a, VOCAB, 11 + i);
        if (system(cmd) != 0)
            return 1;
    }
    /* one model: about 75 MB of weights and 18 MB of forward scratch
     * (512-token steps), the rest of a 150 MB budget its KV pages (64 KiB
     * blocks: 4 layers x K,V x 4 heads x 16 tokens x 64 dims x 2 bytes);
     * two need 186 MB before any KV */
    snprintf(conf, sizeof conf,
             "[server]\ndevice-bytes = 150M\nqueue-timeout = 600000\n"
             "[model:a]\npath = %s\nkeep-alive-s = forever\n"
             "[model:b]\npath = %s\nkeep-alive-s = forever\n",
             a, b);
    const char *args[] = {"--backend", "cpu", "--no-roofline-probe", "--host-blocks", "1024", NULL};
    struct kh_proc d;
    if (kh_start(&d, conf, args) != 0)
        return 1;
    int fd = kh_connect(d.sock);
    if (fd < 0)
        return 1;
    static uint32_t seen[2][N_PROMPT];
    uint32_t p[N_PROMPT];
    double loaded[MAX_ROUNDS], sw[MAX_ROUNDS], warm[MAX_ROUNDS], cold[MAX_ROUNDS];
    /* a first load of each, with the prompts the warm switches repeat */
    for (int m = 0; m < 2; m++) {
        for (int i = 0; i < N_PROMPT; i++)
            seen[m][i] = next_tok();
        if (gen_ms(fd, m ? "b" : "a", seen[m]) < 0)
            return 1;
    }
    int ok = 1;
    double load0 = load_avg();
    /* a second daemon, cold, for one model: started in each round beside
     * the first (idle meanwhile), so that the machine's load falls on
     * every kind alike */
    const char *cargs[] = {"--backend", "cpu", "--no-roofline-probe", "--model", b, NULL};
    for (int r = 0; r < rounds && ok; r++) {
        /* b is loaded (the last used): a request to it */
        for (int i = 0; i < N_PROMPT; i++)
            p[i] = next_tok();
        ok &= (loaded[r] = gen_ms(fd, "b", p)) >= 0;
        /* switch to a with a new prompt, then back to b with one it saw */
        for (int i = 0; i < N_PROMPT; i++)
            p[i] = next_tok();
        ok &= (sw[r] = gen_ms(fd, "a", p)) >= 0;
        ok &= (warm[r] = gen_ms(fd, "b", seen[1])) >= 0;
        struct kh_proc c;
        double t0 = now_ms();
        if (kh_start(&c, NULL, cargs) != 0)
            return 1;
        int cf = kh_connect(c.sock);
        for (int i = 0; i < N_PROMPT; i++)
            p[i] = next_tok();
        double g = cf >= 0 ? gen_ms(cf, NULL, p) : -1;
        cold[r] = now_ms() - t0;
        ok &= g >= 0;
        if (cf >= 0)
            close(cf);
        kh_stop(&c);
    }
    double load1 = load_avg();
    double load_ms = model_stat(fd, "b", "load_ms"), unload_ms = model_stat(fd, "a", "unload_ms");
    double moved = model_stat(fd, "b", "moved_at_unload");
    close(fd);
    kh_stop(&d);
    unlink(a);
    unlink(b);
    rmdir(dir);
    if (!ok)
        return 1;
    printf("bench_models: %d rounds, 2 models of ~80 MB f16 weights, %d-token prompts, "
           "max_tokens 1, cpu backend, load average %.1f -> %.1f\n",
           rounds, N_PROMPT, load0, load1);
    report("loaded", loaded, rounds);
    report("switch", sw, rounds);
    report("switch-warm", warm, rounds);
    report("cold daemon", cold, rounds);
    printf("daemon: last load %.1f ms, last unload %.1f ms, %.0f blocks of b moved to the host "
           "tier at its unloads\n",
           load_ms, unload_ms, moved);
    return 0;
}
