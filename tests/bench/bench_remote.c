/* bench_remote: the remote tier's own numbers (a program that prints numbers,
 * not a test), through kvmm and a real redis-server it starts on loopback
 * (tests/support's redis_harness; nothing is persisted).
 *
 *   bench_remote restore [MIB] [64|512]
 *       For 64 KiB and 512 KiB blocks (16 tokens; f16 KV of 4 layers x 4
 *       heads x 64, and 8 x 16 x 64): a writer kvmm commits chains of 4096
 *       tokens (MIB MiB of KV in all, default 512) with remote-min-hits 0
 *       and waits until its values are in Redis; a reader kvmm then restores
 *       every chain with kvmm_remote_prefetch (pipelined GET rounds of at
 *       most 4 MiB, every value opened, authenticated, checked against the
 *       prompt and copied into the pool), from 1 and 2 threads, sealed (the
 *       fleet key) and insecure (checksums only). Side by side, round after
 *       round: the restore, a plain pipelined GET of the same keys in the
 *       same rounds (redisconn, nothing opened) and `redis-benchmark -t get`
 *       on the same server with the values' mean size (-c 1 or 2, -P 1),
 *       and one core's open rate (remote_value_open, and libsodium's own
 *       XChaCha20-Poly1305 on the same value); five rounds, each
 *       ratio taken within its round; medians and ranges printed, and the
 *       CPU seconds per GB each side spent (this process or redis-benchmark,
 *       and redis-server from /proc). KVD_BENCH_GET_PER_ROUND=N sets the plain GET's
 *       values per round (default: the restore's, 4 MiB of values).
 *   bench_remote policy [REQUESTS] [DAEMONS] [POOL]
 *       The write policy: bench_trace.h's trace (default 6000 requests)
 *       sent to DAEMONS kvmms (default 3; each request to one picked at
 *       random, as a load balancer without prefix knowledge does), each
 *       with POOL device blocks (default 2048) and no host tier, sharing one
 *       Redis; every request is prefetched from Redis, matched, extended
 *       and committed, and the daemon's writer is drained before the next
 *       one. For remote off and remote-min-hits 0, 1, 2, 3: the prefix hit
 *       rate, the blocks restored from Redis, the values and blocks
 *       written, the bytes both ways and Redis's memory at the end. Small
 *       blocks (512 B: 1 layer, 1 head of 8, f16) keep it quick; values of
 *       63 blocks, as 4 MiB values of 64 KiB blocks are, so the traffic in
 *       blocks is the same as a real model's. */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <sodium.h>

#include "backend.h"
#include "bench_trace.h"
#include "kvmm.h"
#include "redis_harness.h"
#include "redisconn.h"
#include "remote_value.h"

#define PASSES 5
#define CHAIN_TOKENS 4096

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void die(const char *what, const char *why)
{
    fprintf(stderr, "bench_remote: %s: %s\n", what, why);
    exit(1);
}

/* One kvmm on the cpu backend with tenant "bench" (remote on) and, when url
 * is set, the remote tier. */
struct node {
    struct backend *be;
    struct kvmm *mm;
    uint32_t tid, ns;
};

struct remote_opts {
    const char *url, *key_file; /* key_file NULL: insecure */
    uint32_t min_hits, timeout_ms;
    uint64_t value_bytes;
};

static void node_up(struct node *n, const struct kv_geom *g, uint32_t dev_blocks,
                    const struct remote_opts *ro)
{
    struct kvmm_config cfg = {.geom = *g, .n_device_blocks = dev_blocks};
    if (backend_cpu_new(&n->be))
        die("backend", "cpu backend");
    cfg.be = n->be;
    if (kvmm_new(&cfg, &n->mm))
        die("kvmm_new", "failed");
    struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1,
                                  .remote = true};
    snprintf(tc.name, sizeof tc.name, "bench");
    kvmm_lock(n->mm);
    if (kvmm_tenant_set(n->mm, &tc, &n->tid) || kvmm_tenant_namespace(n->mm, n->tid, &n->ns))
        die("tenant", kvmm_errmsg(n->mm));
    kvmm_unlock(n->mm);
    if (ro && ro->url) {
        struct kvmm_remote_conf rc = {.url = ro->url,
                                      .key_file = ro->key_file,
                                      .insecure = ro->key_file == NULL,
                                      .timeout_ms = ro->timeout_ms,
                                      .value_bytes = ro->value_bytes,
                                      .min_hits = ro->min_hits};
        struct kvd_error e = {0};
        if (kvmm_remote_open(n->mm, &rc, &e))
            die("kvmm_remote_open", e.message);
    }
}

static void node_down(struct node *n)
{
    kvmm_free(n->mm);
    backend_free(n->be);
}

/* One request on n: match, extend, commit the prompt's rest and gen more
 * (answer), close. Returns the tokens matched. */
static size_t node_request(struct node *n, const uint32_t *p, size_t len, const uint32_t *answer,
                           size_t gen)
{
    kvmm_seq_t s;
    size_t matched = 0, shared;
    kvmm_lock(n->mm);
    if (kvmm_seq_open(n->mm, 1, n->tid, n->ns, &s) ||
        kvmm_seq_match(n->mm, 1, s, p, len, &matched) ||
        kvmm_seq_extend(n->mm, 1, s, len - matched + gen) ||
        kvmm_seq_commit(n->mm, 1, s, p + matched, len - matched, &shared) ||
        (gen && kvmm_seq_commit(n->mm, 1, s, answer, gen, &shared)) || kvmm_seq_close(n->mm, 1, s))
        die("request", kvmm_errmsg(n->mm));
    kvmm_unlock(n->mm);
    return matched;
}

/* ---- restore --------------------------------------------------------- */

struct restore_run {
    struct node *rd;
    uint32_t **chains;
    size_t n_chains, nb;
    atomic_size_t next, blocks;
};

static void *restore_worker(void *arg)
{
    struct restore_run *r = arg;
    for (size_t c; (c = atomic_fetch_add(&r->next, 1)) < r->n_chains;)
        atomic_fetch_add(&r->blocks, kvmm_remote_prefetch(r->rd->mm, r->rd->tid, r->rd->ns,
                                                          r->chains[c], CHAIN_TOKENS));
    return NULL;
}

/* Restores every chain into rd (cleared first) from `threads` threads: the
 * seconds it took, and the value bytes it fetched (*in). */
static double restore_pass(struct restore_run *r, int threads, uint64_t *in)
{
    size_t dropped;
    kvmm_lock(r->rd->mm);
    kvmm_clear(r->rd->mm, &dropped);
    kvmm_unlock(r->rd->mm);
    struct kvmm_remote_stats s0, s1;
    kvmm_remote_stats(r->rd->mm, &s0);
    atomic_store(&r->next, 0);
    atomic_store(&r->blocks, 0);
    pthread_t th[8];
    double t0 = now_s();
    for (int i = 0; i < threads; i++)
        if (pthread_create(&th[i], NULL, restore_worker, r))
            die("pthread_create", "failed");
    for (int i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
    double dt = now_s() - t0;
    kvmm_remote_stats(r->rd->mm, &s1);
    if (atomic_load(&r->blocks) != r->n_chains * r->nb) {
        fprintf(stderr,
                "bench_remote: restored %zu of %zu blocks (errors %" PRIu64 ", timeouts %" PRIu64
                ", misses %" PRIu64 ", auth %" PRIu64 ")\n",
                atomic_load(&r->blocks), r->n_chains * r->nb, s1.errors, s1.timeouts, s1.misses,
                s1.auth_failures);
        exit(1);
    }
    *in = s1.bytes_in - s0.bytes_in;
    return dt;
}

/* Every kvd value key in the server, for the plain GET rounds. */
struct keyset {
    struct redisconn_buf *k;
    size_t n;
    redisReply *reply;
};

static void keys_load(const struct redis_srv *srv, struct keyset *ks)
{
    ks->reply = redis_srv_cmd(srv, "KEYS kvd1:*");
    if (!ks->reply || ks->reply->type != REDIS_REPLY_ARRAY)
        die("KEYS", "no reply");
    ks->n = ks->reply->elements;
    ks->k = calloc(ks->n, sizeof *ks->k);
    for (size_t i = 0; i < ks->n; i++)
        ks->k[i] = (struct redisconn_buf){ks->reply->element[i]->str, ks->reply->element[i]->len};
}

struct get_run {
    const struct keyset *ks;
    size_t per_round;
    struct redisconn *rc[8]; /* one per thread, kept warm across passes */
    atomic_size_t next;
    atomic_uint_fast64_t bytes;
};

struct get_arg {
    struct get_run *g;
    int t;
};

static void *get_worker(void *arg)
{
    struct get_arg *a = arg;
    struct get_run *g = a->g;
    struct redisconn_buf *out = calloc(g->per_round, sizeof *out);
    struct kvd_error e = {0};
    for (size_t at; (at = atomic_fetch_add(&g->next, g->per_round)) < g->ks->n;) {
        size_t n = g->ks->n - at < g->per_round ? g->ks->n - at : g->per_round;
        if (redisconn_get(g->rc[a->t], n, g->ks->k + at, out, &e))
            die("redisconn_get", e.message);
        for (size_t i = 0; i < n; i++)
            atomic_fetch_add(&g->bytes, out[i].n);
    }
    free(out);
    return NULL;
}

static double get_pass(struct get_run *g, int threads)
{
    pthread_t th[8];
    struct get_arg a[8];
    atomic_store(&g->next, 0);
    atomic_store(&g->bytes, 0);
    double t0 = now_s();
    for (int i = 0; i < threads; i++) {
        a[i] = (struct get_arg){g, i};
        if (pthread_create(&th[i], NULL, get_worker, &a[i]))
            die("pthread_create", "failed");
    }
    for (int i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
    return now_s() - t0;
}

/* redis-benchmark's GET rate (requests/s) for values of d bytes, or -1. */
static double redis_benchmark_get(const struct redis_srv *srv, size_t d, int clients, int pipe,
                                  size_t requests)
{
    char cmd[512], line[512];
    snprintf(cmd, sizeof cmd,
             "redis-benchmark -h 127.0.0.1 -p %d -t set,get -d %zu -n %zu -c %d -P %d --csv "
             "2>/dev/null",
             srv->port, d, requests, clients, pipe);
    FILE *p = popen(cmd, "r");
    double rps = -1;
    if (!p)
        return -1;
    while (fgets(line, sizeof line, p))
        if (strncmp(line, "\"GET\",\"", 7) == 0)
            rps = strtod(line + 7, NULL);
    pclose(p);
    return rps;
}

static void write_key_file(const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f)
        die(path, "cannot write");
    for (int i = 0; i < 32; i++)
        fprintf(f, "%02x", (unsigned)(mix((uint64_t)i) & 0xff));
    fputc('\n', f);
    fclose(f);
    chmod(path, 0600);
}

/* One core's opening of a sealed value of about d bytes (what every sealed value costs its
 * reader), GB/s of CPU time on this thread (so other processes' load does not count): the
 * ceiling of a sealed restore on one thread. sodium: libsodium's own
 * crypto_aead_xchacha20poly1305_ietf on the same bytes (the call values were opened with
 * before libcrypto's ChaCha20-Poly1305 was), else remote_value_open. */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double aead_open_rate(size_t d, bool sodium)
{
    struct remote_value_meta m = {
        .block_tokens = 16, .block_bytes = d > 8192 ? d - 4096 : d, .n = 1};
    snprintf(m.ns_name, sizeof m.ns_name, "tenant:bench");
    size_t len = remote_value_size(&m);
    unsigned char *buf = malloc(len);
    struct remote_fleet_key k = {.secure = true, .k = {1}};
    uint8_t rkey[REMOTE_KEY_BYTES] = {0};
    if (!buf || sodium_init() < 0)
        die("aead", "out of memory");
    uint32_t *toks;
    void *data;
    remote_value_layout(&m, buf, &toks, &data);
    memset(toks, 0, 16 * 4);
    memset(data, 7, m.block_bytes);
    double spent = 0, t0 = now_s();
    int n = 0;
    while (n < 8 || now_s() - t0 < 0.5) {
        if (remote_value_seal(&k, rkey, buf, len))
            die("aead", "a value failed to seal");
        unsigned char ad[REMOTE_KEY_BYTES + 8];
        memcpy(ad, rkey, REMOTE_KEY_BYTES);
        memcpy(ad + REMOTE_KEY_BYTES, buf, 8);
        struct remote_value_view v;
        double c0 = thread_cpu_s();
        int bad = sodium ? crypto_aead_xchacha20poly1305_ietf_decrypt_detached(
                               buf + REMOTE_VALUE_HEAD, NULL, buf + REMOTE_VALUE_HEAD,
                               len - REMOTE_VALUE_HEAD, buf + 32, ad, sizeof ad, buf + 8, k.k)
                         : remote_value_open(&k, rkey, buf, len, &v) != REMOTE_VALUE_OK;
        spent += thread_cpu_s() - c0;
        if (bad)
            die("aead", "a value failed to open");
        n++;
    }
    free(buf);
    return (double)len * n / spent / 1e9;
}

/* CPU seconds so far: this process (all threads), its reaped children (redis-benchmark),
 * and the redis-server (utime + stime from /proc). */
struct cpu {
    double self, children, server;
};

static double tv_s(struct timeval t)
{
    return (double)t.tv_sec + (double)t.tv_usec / 1e6;
}

static struct cpu cpu_now(const struct redis_srv *srv)
{
    struct cpu c = {0};
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        c.self = tv_s(ru.ru_utime) + tv_s(ru.ru_stime);
    if (getrusage(RUSAGE_CHILDREN, &ru) == 0)
        c.children = tv_s(ru.ru_utime) + tv_s(ru.ru_stime);
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)srv->pid);
    FILE *f = fopen(path, "r");
    if (f && fgets(buf, sizeof buf, f)) {
        const char *p = strrchr(buf, ')'); /* fields after the command name */
        unsigned long ut = 0, st = 0;
        if (p &&
            sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) == 2)
            c.server = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
    }
    if (f)
        fclose(f);
    return c;
}

/* "median (min-max)" of v[0..n) into out. */
static void spread(char *out, size_t cap, double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
    snprintf(out, cap, "%.3f (%.3f-%.3f)", n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2, v[0],
             v[n - 1]);
}

/* Per geometry: the chains written once sealed (then once insecure), and PASSES rounds of,
 * one right after the other, a restore of every chain, plain GET rounds of the same keys
 * (sealed only) and redis-benchmark GETs of the values' mean size, -P 1 (one request at a
 * time, its best case here), about as many bytes: each round's ratios come from the same
 * minute of this shared VM, whose load moves the absolute rates by 3x and more. */
static void restore_geom(const struct redis_srv *srv, const char *key_file, const struct kv_geom *g,
                         const char *label, uint64_t mib)
{
    size_t bb = (size_t)g->block_tokens * g->layers * g->kv_heads * g->head_dim * 2 * 2;
    size_t nb = CHAIN_TOKENS / g->block_tokens;
    size_t n_chains = (size_t)((mib << 20) / (bb * nb));
    if (n_chains < 2)
        n_chains = 2;
    uint32_t **chains = calloc(n_chains, sizeof *chains);
    for (size_t c = 0; c < n_chains; c++) {
        chains[c] = malloc(sizeof(uint32_t) * CHAIN_TOKENS);
        for (size_t i = 0; i < CHAIN_TOKENS; i++)
            chains[c][i] = (uint32_t)(mix(c * CHAIN_TOKENS + i + (uint64_t)bb) % 32000);
    }
    uint32_t pool = (uint32_t)(n_chains * nb + nb + 64);
    printf("\n%s: block %zu B, %zu chains of %u tokens (%zu blocks, %.1f MiB of KV each), "
           "%.0f MiB in all\n",
           label, bb, n_chains, CHAIN_TOKENS, nb, bb * nb / 1048576.0,
           n_chains * nb * bb / 1048576.0);
    for (int secure = 1; secure >= 0; secure--) {
        redisReply *fl = redis_srv_cmd(srv, "FLUSHALL");
        freeReplyObject(fl);
        struct remote_opts ro = {.url = srv->url,
                                 .key_file = secure ? key_file : NULL,
                                 .min_hits = 0,
                                 .timeout_ms = 60000};
        struct node w, rd;
        node_up(&w, g, pool, &ro);
        node_up(&rd, g, pool, &ro);
        for (size_t c = 0; c < n_chains; c++)
            node_request(&w, chains[c], CHAIN_TOKENS, NULL, 0);
        if (kvmm_remote_flush(w.mm, 600000))
            die("flush", "the writer did not drain");
        struct kvmm_remote_stats ws;
        kvmm_remote_stats(w.mm, &ws);
        size_t mean = ws.writes ? (size_t)(ws.bytes_out / ws.writes) : 0;
        struct restore_run run = {.rd = &rd, .chains = chains, .n_chains = n_chains, .nb = nb};
        uint64_t kv_bytes = (uint64_t)n_chains * nb * bb, in = 0;
        printf("  %s: %" PRIu64 " values written (up to %u blocks each, mean %zu B), %.2f GB\n",
               secure ? "sealed (XChaCha20-Poly1305)" : "insecure (XXH3 checksums)", ws.writes,
               ws.blocks_per_value, mean, ws.bytes_out / 1e9);
        /* Plain GETs of the same keys, in rounds as the restore's (at most 4 MiB of values). */
        struct keyset ks;
        keys_load(srv, &ks);
        size_t per = (size_t)(4u << 20) / (ws.blocks_per_value * (bb + 4 * BT));
        if (getenv("KVD_BENCH_GET_PER_ROUND"))
            per = (size_t)atoi(getenv("KVD_BENCH_GET_PER_ROUND"));
        struct get_run gr = {.ks = &ks, .per_round = per < 1 ? 1 : per};
        for (int t = 0; t < 2; t++) {
            struct redisconn_conf cf = {.url = srv->url, .timeout_ms = 60000};
            struct kvd_error e = {0};
            if (redisconn_open(&cf, &gr.rc[t], &e))
                die("redisconn_open", e.message);
        }
        size_t req = (size_t)(kv_bytes / (mean ? mean : 1));
        req = req < 64 ? 64 : req;
        restore_pass(&run, 2, &in); /* warm: connections, their buffers, the pool's pages */
        get_pass(&gr, 2);
        for (int threads = 1; threads <= 2; threads++) {
            double r[PASSES], gt[PASSES], rb[PASSES], rr[PASSES], gr_r[PASSES], op[PASSES],
                os[PASSES];
            struct kvmm_remote_stats r0, r1;
            kvmm_remote_stats(rd.mm, &r0);
            /* CPU seconds per GB of values moved: [restore, GET, redis-benchmark] x
             * [client, server], summed over the rounds. */
            double cpu[3][2] = {{0}}, gb[3] = {0};
            for (int p = 0; p < PASSES; p++) {
                op[p] = secure ? aead_open_rate(mean, false) : 0;
                os[p] = secure ? aead_open_rate(mean, true) : 0;
                struct cpu c0 = cpu_now(srv);
                r[p] = in / restore_pass(&run, threads, &in) / 1e9;
                struct cpu c1 = cpu_now(srv);
                gt[p] = atomic_load(&gr.bytes) / get_pass(&gr, threads) / 1e9;
                struct cpu c2 = cpu_now(srv);
                double rps = redis_benchmark_get(srv, mean, threads, 1, req);
                struct cpu c3 = cpu_now(srv);
                rb[p] = rps * mean / 1e9;
                rr[p] = r[p] / rb[p];
                gr_r[p] = gt[p] / rb[p];
                cpu[0][0] += c1.self - c0.self;
                cpu[0][1] += c1.server - c0.server;
                cpu[1][0] += c2.self - c1.self;
                cpu[1][1] += c2.server - c1.server;
                cpu[2][0] += c3.children - c2.children;
                cpu[2][1] += c3.server - c2.server;
                gb[0] += in / 1e9;
                gb[1] += atomic_load(&gr.bytes) / 1e9;
                gb[2] += (double)req * mean / 1e9 * 2; /* redis-benchmark SETs them first */
            }
            kvmm_remote_stats(rd.mm, &r1);
            char a1[64], a2[64], a3[64], a4[64], a5[64], a6[64], a7[64];
            spread(a1, sizeof a1, r, PASSES);
            spread(a2, sizeof a2, gt, PASSES);
            spread(a3, sizeof a3, rb, PASSES);
            spread(a4, sizeof a4, rr, PASSES);
            spread(a5, sizeof a5, gr_r, PASSES);
            spread(a6, sizeof a6, op, PASSES);
            spread(a7, sizeof a7, os, PASSES);
            printf("    %d thread%s (redis-benchmark -c %d -P 1), GB/s of values, median (min-max) "
                   "of %d rounds; %.1f GET rounds per chain\n",
                   threads, threads > 1 ? "s" : "", threads, PASSES,
                   (double)(r1.rounds - r0.rounds) / (PASSES * n_chains));
            printf("      restore %s   plain GET %s   redis-benchmark %s\n", a1, a2, a3);
            printf("      restore / redis-benchmark %s   plain GET / redis-benchmark %s\n", a4, a5);
            if (secure)
                printf(
                    "      one core opening a value, GB/s of its CPU time: remote_value_open %s   "
                    "libsodium's XChaCha20-Poly1305 %s\n",
                    a6, a7);
            printf("      CPU s per GB, client + redis-server: restore %.2f + %.2f   plain GET "
                   "%.2f + %.2f   redis-benchmark (SET and GET) %.2f + %.2f\n",
                   cpu[0][0] / gb[0], cpu[0][1] / gb[0], cpu[1][0] / gb[1], cpu[1][1] / gb[1],
                   cpu[2][0] / gb[2], cpu[2][1] / gb[2]);
        }
        for (int t = 0; t < 2; t++)
            redisconn_free(gr.rc[t]);
        freeReplyObject(ks.reply);
        free(ks.k);
        node_down(&w);
        node_down(&rd);
    }
    for (size_t c = 0; c < n_chains; c++)
        free(chains[c]);
    free(chains);
}

/* ---- write policy ---------------------------------------------------- */

struct policy_res {
    double hit_rate;
    uint64_t restored, values, bytes_out, bytes_in, rounds, misses;
    long long redis_mem, redis_keys;
};

static long long redis_info_int(const struct redis_srv *srv, const char *section, const char *key)
{
    redisReply *r = redis_srv_cmd(srv, "INFO %s", section);
    long long v = -1;
    if (r && r->type == REDIS_REPLY_STRING) {
        const char *p = strstr(r->str, key);
        if (p)
            v = strtoll(p + strlen(key) + 1, NULL, 10);
    }
    freeReplyObject(r);
    return v;
}

static struct policy_res policy_run(const struct redis_srv *srv, const struct trace *tr,
                                    int n_nodes, uint32_t pool, int min_hits)
{
    const struct kv_geom g = {
        .layers = 1, .kv_heads = 1, .head_dim = 8, .dtype = KV_F16, .block_tokens = BT};
    size_t bb = (size_t)BT * 8 * 2 * 2;
    struct remote_opts ro = {.url = min_hits >= 0 ? srv->url : NULL,
                             .min_hits = (uint32_t)(min_hits < 0 ? 0 : min_hits),
                             .timeout_ms = 10000,
                             .value_bytes = 63 * (bb + 4 * BT)};
    struct node nodes[8];
    redisReply *fl = redis_srv_cmd(srv, "FLUSHALL");
    freeReplyObject(fl);
    for (int i = 0; i < n_nodes; i++)
        node_up(&nodes[i], &g, pool, &ro);
    uint64_t pick = 0x2545F4914F6CDD1Dull;
    uint32_t scratch[256];
    for (size_t i = 0; i < tr->n; i++) {
        const struct req *q = &tr->r[i];
        pick ^= pick << 13;
        pick ^= pick >> 7;
        pick ^= pick << 17;
        struct node *n = &nodes[pick % (uint64_t)n_nodes];
        if (ro.url)
            kvmm_remote_prefetch(n->mm, n->tid, n->ns, q->prompt.v, q->prompt.n);
        node_request(n, q->prompt.v, q->prompt.n, bench_trace_answer(tr, i, scratch), q->gen);
        if (ro.url && kvmm_remote_flush(n->mm, 60000))
            die("flush", "the writer did not drain");
    }
    struct policy_res res = {0};
    uint64_t asked = 0, hit = 0;
    for (int i = 0; i < n_nodes; i++) {
        struct kvmm_stats st;
        struct kvmm_remote_stats rs;
        kvmm_lock(nodes[i].mm);
        kvmm_stats(nodes[i].mm, &st);
        kvmm_unlock(nodes[i].mm);
        kvmm_remote_stats(nodes[i].mm, &rs);
        asked += st.match_tokens_asked;
        hit += st.match_tokens_hit;
        res.restored += rs.hits;
        res.values += rs.writes;
        res.bytes_out += rs.bytes_out;
        res.bytes_in += rs.bytes_in;
        res.rounds += rs.rounds;
        res.misses += rs.misses;
        if (rs.errors || rs.timeouts || rs.auth_failures || rs.mismatches)
            fprintf(stderr, "bench_remote: node %d: %" PRIu64 " errors, %" PRIu64 " timeouts\n", i,
                    rs.errors, rs.timeouts);
    }
    res.hit_rate = (double)hit / (double)asked;
    res.redis_mem = redis_info_int(srv, "memory", "used_memory");
    res.redis_keys = 0;
    redisReply *r = redis_srv_cmd(srv, "DBSIZE");
    if (r && r->type == REDIS_REPLY_INTEGER)
        res.redis_keys = r->integer;
    freeReplyObject(r);
    for (int i = 0; i < n_nodes; i++)
        node_down(&nodes[i]);
    return res;
}

static void policy(const struct redis_srv *srv, size_t n_req, int n_nodes, uint32_t pool)
{
    struct trace tr;
    size_t asked = 0;
    bench_trace_make(&tr, n_req, 0x9E3779B97F4A7C15ull);
    for (size_t i = 0; i < tr.n; i++)
        asked += tr.r[i].prompt.n;
    size_t per_block = (size_t)BT * 8 * 2 * 2 + 4 * BT;
    printf("write policy: %zu requests (%zu prompt tokens, %zu blocks asked), %d daemons of %u "
           "device blocks, each request to one at random\n",
           tr.n, asked, asked / BT, n_nodes, pool);
    printf("%-12s %8s %10s %10s %10s %12s %12s %10s %10s\n", "policy", "hit rate", "restored",
           "values", "blocks out", "KV GB out*", "KV GB in*", "rounds", "Redis MB");
    for (int mh = -1; mh <= 3; mh++) {
        double t0 = now_s();
        struct policy_res r = policy_run(srv, &tr, n_nodes, pool, mh);
        double dt = now_s() - t0;
        char name[24];
        if (mh < 0)
            snprintf(name, sizeof name, "remote off");
        else
            snprintf(name, sizeof name, "min-hits %d", mh);
        /* blocks out: value bytes / (block + its token ids), the value
         * headers (~100 B each) left in; KV GB as if each block were 64 KiB. */
        uint64_t blocks_out = r.bytes_out / per_block, blocks_in = r.bytes_in / per_block;
        printf("%-12s %7.1f%% %10" PRIu64 " %10" PRIu64 " %10" PRIu64 " %12.2f %12.2f %10" PRIu64
               " %10.1f   (%.0f s)\n",
               name, 100 * r.hit_rate, r.restored, r.values, blocks_out, blocks_out * 65536.0 / 1e9,
               blocks_in * 65536.0 / 1e9, r.rounds, r.redis_mem / 1048576.0, dt);
        fflush(stdout);
    }
    printf("* GB as if each block were 64 KiB (a 1B-class model's f16 block of 16 tokens)\n");
    bench_trace_free(&tr);
}

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "restore") && strcmp(argv[1], "policy"))) {
        fprintf(
            stderr,
            "usage: bench_remote restore [MIB] [64|512] | policy [REQUESTS] [DAEMONS] [POOL]\n");
        return 2;
    }
    if (!redis_available())
        die("redis-server", "not installed");
    struct redis_srv srv;
    if (redis_start(&srv, NULL) != 0)
        die("redis-server", "did not start");
    char dir[] = "/tmp/kvd-bench-remote.XXXXXX", key_file[64];
    if (!mkdtemp(dir))
        die("mkdtemp", "failed");
    snprintf(key_file, sizeof key_file, "%s/fleet.key", dir);
    write_key_file(key_file);
    if (strcmp(argv[1], "restore") == 0) {
        uint64_t mib = argc > 2 ? strtoull(argv[2], NULL, 10) : 512;
        const struct kv_geom g64 = {
            .layers = 4, .kv_heads = 4, .head_dim = 64, .dtype = KV_F16, .block_tokens = BT};
        const struct kv_geom g512 = {
            .layers = 8, .kv_heads = 16, .head_dim = 64, .dtype = KV_F16, .block_tokens = BT};
        printf("remote restore vs GET on redis-server %s (loopback, no persistence)\n", srv.addr);
        const char *only = argc > 3 ? argv[3] : "";
        if (strcmp(only, "512") != 0)
            restore_geom(&srv, key_file, &g64, "64 KiB blocks", mib);
        if (strcmp(only, "64") != 0)
            restore_geom(&srv, key_file, &g512, "512 KiB blocks", mib);
    } else {
        size_t n = argc > 2 ? strtoul(argv[2], NULL, 10) : 6000;
        int nodes = argc > 3 ? atoi(argv[3]) : 3;
        uint32_t pool = argc > 4 ? (uint32_t)strtoul(argv[4], NULL, 10) : 2048;
        if (nodes < 1 || nodes > 8)
            die("DAEMONS", "1 to 8");
        policy(&srv, n, nodes, pool);
    }
    unlink(key_file);
    rmdir(dir);
    redis_stop(&srv);
    return 0;
}
