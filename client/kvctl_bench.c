/* kvctl bench: a load generator over the protocol. N connections run
 * generate requests (closed loop, or chats arriving at a Poisson rate) with
 * prompt/output lengths drawn from ranges, an optional system prompt shared
 * by every request and multi-turn chats that extend their own history, as
 * one or several tenants (root forks a worker per uid). Reports tokens/s,
 * TTFT, inter-token and end-to-end latency percentiles, the prefix hit
 * rate, swaps and the daemon's roofline; --verify checks every output
 * against a first pass that ran the same requests one at a time. */
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvctl.h"
#include "kvctl_bench.h"

static const char bench_help[] =
    "usage: kvctl bench [-c CONNS] [-r REQUESTS] [--rate R] [--prompt-len N|LO-HI]\n"
    "                   [--output-len N|LO-HI] [--shared-prefix FRAC] [--turns T]\n"
    "                   [--tenants UID,UID...] [--temperature T] [--seed S]\n"
    "                   [--verify] [--json] [--no-progress]\n"
    "Runs REQUESTS generate requests (default 32) over CONNS connections (default 4).\n"
    "  --rate R            chats arrive at R per second (Poisson); default closed loop\n"
    "  --prompt-len        prompt tokens, fixed or uniform in LO-HI (default 128)\n"
    "  --output-len        generated tokens per request (default 32)\n"
    "  --shared-prefix F   the first F (0-1) of every first-turn prompt is one system\n"
    "                      prompt shared by all requests (default 0)\n"
    "  --turns T           chats of T turns: each turn sends the chat's whole history\n"
    "                      (prompts and answers) plus new user tokens (default 1)\n"
    "  --tenants UIDS      (root) fork one worker per uid, connections split among them\n"
    "  --verify            first run every request alone, then check the loaded run\n"
    "                      produced the same tokens (use greedy: temperature 0)\n"
    "  --json              one JSON object on stdout instead of the report\n"
    "Exit status 1 when a request failed or an output differed.\n";

struct run {
    const struct bench_conf *bc;
    const char *socket;
    struct shared *sh;
    double t0;              /* CLOCK_MONOTONIC seconds at start */
    const double *arrival;  /* [n_chats] seconds after t0, or NULL (closed loop) */
    const uint32_t *system; /* the shared system prompt */
    uint32_t n_system;
    uint32_t **ref; /* --verify pass 2: [chat*turns+turn] pass-1 outputs, else NULL */
    uint32_t *n_ref;
    uint32_t **save; /* pass 1: where outputs are stored, else NULL */
    uint32_t *n_save;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t mix(uint64_t z) /* splitmix64 finaliser */
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t draw(uint64_t *st, struct dist d)
{
    *st = mix(*st);
    return d.lo + (uint32_t)(*st % ((uint64_t)d.hi - d.lo + 1));
}

static uint32_t token(uint64_t *st, uint32_t vocab)
{
    *st = mix(*st);
    return vocab > 4 ? 3 + (uint32_t)(*st % (vocab - 3)) : (uint32_t)(*st % vocab);
}

/* ---- one connection ------------------------------------------------------ */

struct track {
    double t_send, t_first, t_last;
    float *gaps;
    uint32_t n_gaps, cap;
};

/* Streamed tokens: the first event is the TTFT; a later event of k tokens
 * after gap g counts as k gaps of g/k. Events that reach this process in one
 * read show gaps near 0, so the report adds TPOT (per request: (e2e - ttft)
 * / (tokens - 1)), which batching on the client side cannot distort. */
static int on_tokens(void *user, const uint32_t *t, size_t n)
{
    struct track *tr = user;
    double now = now_s();
    if (tr->t_first == 0) {
        tr->t_first = now;
        if (n > 1)
            n--; /* the rest of the first event arrived with it */
        else
            n = 0;
    }
    double g = n ? (now - tr->t_last) / (double)n : 0;
    for (size_t i = 0; i < n && tr->n_gaps < tr->cap; i++)
        tr->gaps[tr->n_gaps++] = (float)g;
    tr->t_last = now;
    return 0;
}

/* Appends n tokens to a growing array; false when out of memory. */
static bool push(uint32_t **v, size_t *n, size_t *cap, const uint32_t *t, size_t k)
{
    if (k == 0)
        return true;
    if (*n + k > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *n + k)
            c *= 2;
        uint32_t *p = realloc(*v, c * sizeof(*p));
        if (!p)
            return false;
        *v = p;
        *cap = c;
    }
    memcpy(*v + *n, t, k * sizeof(*t));
    *n += k;
    return true;
}

/* Runs chat `c` (all its turns) on ctx. */
static void run_chat(struct run *rn, struct kvd_ctx *ctx, uint32_t c)
{
    const struct bench_conf *bc = rn->bc;
    struct shared *sh = rn->sh;
    uint32_t *hist = NULL;
    size_t n_hist = 0, cap_hist = 0;
    uint32_t user[4096];
    for (uint32_t turn = 0; turn < bc->turns; turn++) {
        uint32_t idx = c * bc->turns + turn;
        struct rec *r = &sh->recs[idx];
        uint64_t st = mix(bc->seed ^ mix((uint64_t)c * 1000003u + turn));
        uint32_t plen = draw(&st, bc->prompt), olen = draw(&st, bc->output);
        uint32_t n_user = plen;
        bool ok = true;
        if (turn == 0) {
            uint32_t n_sys = (uint32_t)lround(bc->shared * plen);
            if (n_sys > rn->n_system)
                n_sys = rn->n_system;
            ok = push(&hist, &n_hist, &cap_hist, rn->system, n_sys);
            n_user = plen - n_sys;
        } else {
            n_user = (uint32_t)lround((1 - bc->shared) * plen);
            if (n_user == 0)
                n_user = 1;
        }
        if (n_user > sizeof(user) / sizeof(user[0]))
            n_user = sizeof(user) / sizeof(user[0]);
        if (n_hist + n_user + olen > bc->n_ctx) {
            /* The chat outgrew the context: its remaining turns do not run. */
            for (uint32_t t2 = turn; t2 < bc->turns; t2++)
                atomic_fetch_add(&sh->done, 1);
            break;
        }
        for (uint32_t i = 0; i < n_user; i++)
            user[i] = token(&st, bc->vocab);
        if (!ok || !push(&hist, &n_hist, &cap_hist, user, n_user)) {
            r->err = KVD_ENOMEM;
            atomic_fetch_add(&sh->done, 1);
            break;
        }

        struct track tr = {.gaps = sh->gaps + (size_t)idx * sh->gap_cap, .cap = sh->gap_cap};
        struct kvd_gen_opts go;
        kvd_gen_opts_init(&go);
        go.max_tokens = olen;
        go.temperature = bc->temperature;
        go.seed = mix(st);
        go.has_seed = true;
        go.on_tokens = on_tokens;
        go.user = &tr;
        struct kvd_gen_result res = {0};
        uint64_t id = 0;
        tr.t_send = tr.t_last = now_s();
        int err = kvd_generate_send(ctx, hist, n_hist, &go, &id);
        if (!err)
            err = kvd_generate_wait(ctx, id, &res);
        double t_end = now_s();
        r->err = err;
        r->t_send = tr.t_send - rn->t0;
        r->e2e = t_end - tr.t_send;
        r->ttft = (tr.t_first ? tr.t_first : t_end) - tr.t_send;
        r->n_gaps = tr.n_gaps;
        if (!err) {
            r->prompt = res.prompt_tokens;
            r->cached = res.cached_tokens;
            r->completion = (uint32_t)res.n_tokens;
            if (rn->ref)
                r->mismatch = res.n_tokens != rn->n_ref[idx] ||
                              (res.n_tokens &&
                               memcmp(res.tokens, rn->ref[idx], res.n_tokens * sizeof(uint32_t)));
            if (rn->save) {
                rn->save[idx] = malloc((res.n_tokens + 1) * sizeof(uint32_t));
                if (rn->save[idx]) {
                    memcpy(rn->save[idx], res.tokens, res.n_tokens * sizeof(uint32_t));
                    rn->n_save[idx] = (uint32_t)res.n_tokens;
                }
            }
            ok = push(&hist, &n_hist, &cap_hist, res.tokens, res.n_tokens);
        }
        kvd_gen_result_free(&res);
        atomic_fetch_add(&sh->done, 1);
        if (err || !ok) {
            for (uint32_t t2 = turn + 1; t2 < bc->turns; t2++)
                atomic_fetch_add(&sh->done, 1);
            break;
        }
    }
    free(hist);
}

static void *conn_main(void *arg)
{
    struct run *rn = arg;
    struct shared *sh = rn->sh;
    struct kvd_ctx *ctx = kvd_connect(rn->socket);
    if (ctx && !ctx->err) {
        for (;;) {
            uint32_t c = atomic_fetch_add(&sh->next_chat, 1);
            if (c >= sh->n_chats)
                break;
            if (rn->arrival) {
                double wait = rn->t0 + rn->arrival[c] - now_s();
                if (wait > 0) {
                    struct timespec ts = {(time_t)wait, (long)((wait - floor(wait)) * 1e9)};
                    nanosleep(&ts, NULL);
                }
            }
            run_chat(rn, ctx, c);
        }
    } else {
        fprintf(stderr, "kvctl bench: %s\n", ctx ? ctx->errstr : "out of memory");
        atomic_fetch_add(&sh->conn_failed, 1);
    }
    kvd_close(ctx);
    atomic_fetch_sub(&sh->workers_left, 1);
    return NULL;
}

/* Runs `n` connections as threads of this process; returns once all ended. */
static void run_threads(struct run *rn, uint32_t n)
{
    pthread_t th[256];
    uint32_t started = 0;
    for (uint32_t i = 0; i < n && i < 256; i++)
        if (pthread_create(&th[i], NULL, conn_main, rn) == 0)
            started++;
        else
            atomic_fetch_sub(&rn->sh->workers_left, 1);
    for (uint32_t i = 0; i < started; i++)
        pthread_join(th[i], NULL);
}

static void progress(const struct shared *sh, uint32_t total, bool final)
{
    unsigned d = atomic_load(&sh->done);
    int w = 40, k = total ? (int)((uint64_t)d * w / total) : w;
    fprintf(stderr, "\r[");
    for (int i = 0; i < w; i++)
        fputc(i < k ? '#' : ' ', stderr);
    fprintf(stderr, "] %u/%u requests%s", d, total, final ? "\n" : "");
    fflush(stderr);
}

/* One pass over every chat with `conns` connections (forked per uid when
 * tenants are given). */
static int run_pass(struct run *rn, uint32_t conns, bool show)
{
    const struct bench_conf *bc = rn->bc;
    struct shared *sh = rn->sh;
    uint32_t total = sh->n_chats * bc->turns;
    atomic_store(&sh->next_chat, 0);
    atomic_store(&sh->done, 0);
    atomic_store(&sh->workers_left, conns);
    atomic_store(&sh->conn_failed, 0);
    for (uint32_t i = 0; i < total; i++)
        sh->recs[i] = (struct rec){.err = -1};
    rn->t0 = now_s();

    pid_t pids[64];
    size_t n_pids = 0;
    if (bc->n_uids == 0) {
        pthread_t th[256];
        uint32_t started = 0;
        for (uint32_t i = 0; i < conns && i < 256; i++)
            if (pthread_create(&th[i], NULL, conn_main, rn) == 0)
                started++;
            else
                atomic_fetch_sub(&sh->workers_left, 1);
        while (atomic_load(&sh->workers_left) > 0) {
            if (show)
                progress(sh, total, false);
            struct timespec ts = {0, 100000000};
            nanosleep(&ts, NULL);
        }
        for (uint32_t i = 0; i < started; i++)
            pthread_join(th[i], NULL);
    } else {
        for (size_t u = 0; u < bc->n_uids; u++) {
            uint32_t n = conns / (uint32_t)bc->n_uids + (u < conns % bc->n_uids);
            if (n == 0)
                continue;
            fflush(NULL);
            pid_t pid = fork();
            if (pid < 0) {
                atomic_fetch_sub(&sh->workers_left, n);
                continue;
            }
            if (pid == 0) {
                uid_t uid = bc->uids[u];
                if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
                    fprintf(stderr, "kvctl bench: cannot become uid %u: %s\n", (unsigned)uid,
                            strerror(errno));
                    atomic_fetch_sub(&sh->workers_left, n);
                    _exit(1);
                }
                run_threads(rn, n);
                _exit(0);
            }
            pids[n_pids++] = pid;
        }
        while (atomic_load(&sh->workers_left) > 0) {
            if (show)
                progress(sh, total, false);
            struct timespec ts = {0, 100000000};
            nanosleep(&ts, NULL);
            /* A worker that died without counting itself out. */
            int status;
            for (size_t i = 0; i < n_pids; i++)
                if (pids[i] > 0 && waitpid(pids[i], &status, WNOHANG) == pids[i])
                    pids[i] = -1;
            bool any = false;
            for (size_t i = 0; i < n_pids; i++)
                any |= pids[i] > 0;
            if (!any)
                break;
        }
        for (size_t i = 0; i < n_pids; i++)
            if (pids[i] > 0)
                waitpid(pids[i], NULL, 0);
    }
    if (show)
        progress(sh, total, true);
    return 0;
}

/* ---- the command ----------------------------------------------------------- */

static bool parse_dist(const char *s, struct dist *d)
{
    char *end;
    errno = 0;
    unsigned long lo = strtoul(s, &end, 10), hi = lo;
    if (end == s || errno || *s == '-')
        return false;
    if (*end == '-') {
        const char *h = end + 1;
        hi = strtoul(h, &end, 10);
        if (end == h || errno || *h == '-')
            return false;
    }
    if (*end || lo == 0 || hi < lo || hi > 1000000)
        return false;
    d->lo = (uint32_t)lo;
    d->hi = (uint32_t)hi;
    return true;
}

static bool parse_uids(const char *s, struct bench_conf *bc)
{
    uint32_t *v = NULL;
    size_t n = 0;
    char err[128];
    if (kvctl_parse_tokens(s, &v, &n, err, sizeof(err)) || n == 0 ||
        n > sizeof(bc->uids) / sizeof(bc->uids[0])) {
        free(v);
        return false;
    }
    for (size_t i = 0; i < n; i++)
        bc->uids[i] = (uid_t)v[i];
    bc->n_uids = n;
    free(v);
    return true;
}

/* Frees pass-1 outputs. */
static void free_outputs(uint32_t **v, uint32_t n)
{
    if (!v)
        return;
    for (uint32_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

int kvctl_cmd_bench(struct kvctl *k, int argc, char **argv)
{
    static const struct option opts[] = {
        {"connections", required_argument, NULL, 'c'},
        {"requests", required_argument, NULL, 'r'},
        {"rate", required_argument, NULL, 'R'},
        {"prompt-len", required_argument, NULL, 'p'},
        {"output-len", required_argument, NULL, 'o'},
        {"shared-prefix", required_argument, NULL, 'S'},
        {"turns", required_argument, NULL, 'T'},
        {"tenants", required_argument, NULL, 'u'},
        {"temperature", required_argument, NULL, 't'},
        {"seed", required_argument, NULL, 's'},
        {"verify", no_argument, NULL, 'v'},
        {"json", no_argument, NULL, 'j'},
        {"no-progress", no_argument, NULL, 'P'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    struct bench_conf bc = {.conns = 4,
                            .requests = 32,
                            .turns = 1,
                            .prompt = {128, 128},
                            .output = {32, 32},
                            .seed = 1,
                            .progress = true};
    uint64_t u;
    char *end;
    int c, rc = KVCTL_OK;

    optind = 1;
    while ((c = getopt_long(argc, argv, "c:r:h", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            if (!kvctl_parse_u64(optarg, &u) || u == 0 || u > 256)
                return kvctl_usage_err("bench --connections: \"%s\" is not in 1-256", optarg);
            bc.conns = (uint32_t)u;
            break;
        case 'r':
            if (!kvctl_parse_u64(optarg, &u) || u == 0 || u > 1000000)
                return kvctl_usage_err("bench --requests: \"%s\" is not in 1-1000000", optarg);
            bc.requests = (uint32_t)u;
            break;
        case 'R':
            bc.rate = strtod(optarg, &end);
            if (!*optarg || *end || !(bc.rate > 0 && bc.rate <= 1e6))
                return kvctl_usage_err("bench --rate: \"%s\" is not a positive rate", optarg);
            break;
        case 'p':
            if (!parse_dist(optarg, &bc.prompt))
                return kvctl_usage_err("bench --prompt-len: \"%s\" is not N or LO-HI (N >= 1)",
                                       optarg);
            break;
        case 'o':
            if (!parse_dist(optarg, &bc.output))
                return kvctl_usage_err("bench --output-len: \"%s\" is not N or LO-HI (N >= 1)",
                                       optarg);
            break;
        case 'S':
            bc.shared = strtod(optarg, &end);
            if (!*optarg || *end || !(bc.shared >= 0 && bc.shared < 1))
                return kvctl_usage_err("bench --shared-prefix: \"%s\" is not a fraction in [0, 1)",
                                       optarg);
            break;
        case 'T':
            if (!kvctl_parse_u64(optarg, &u) || u == 0 || u > 1000)
                return kvctl_usage_err("bench --turns: \"%s\" is not in 1-1000", optarg);
            bc.turns = (uint32_t)u;
            break;
        case 'u':
            if (!parse_uids(optarg, &bc))
                return kvctl_usage_err("bench --tenants: \"%s\" is not a list of uids", optarg);
            break;
        case 't':
            bc.temperature = strtof(optarg, &end);
            if (!*optarg || *end || !(bc.temperature >= 0 && bc.temperature <= 1000))
                return kvctl_usage_err("bench --temperature: \"%s\" is not in [0, 1000]", optarg);
            break;
        case 's':
            if (!kvctl_parse_u64(optarg, &bc.seed))
                return kvctl_usage_err("bench --seed: \"%s\" is not a number", optarg);
            break;
        case 'v':
            bc.verify = true;
            break;
        case 'j':
            bc.json = true;
            break;
        case 'P':
            bc.progress = false;
            break;
        case 'h':
            fputs(bench_help, stdout);
            return KVCTL_OK;
        default:
            fputs(bench_help, stderr);
            return KVCTL_EUSAGE;
        }
    }
    if (optind < argc)
        return kvctl_usage_err("bench: unexpected argument \"%s\"", argv[optind]);
    if (bc.n_uids && geteuid() != 0)
        return kvctl_usage_err("bench --tenants: only root can run workers as other uids");
    if (bc.n_uids && bc.conns < bc.n_uids)
        return kvctl_usage_err("bench --tenants: %zu tenants need at least as many connections",
                               bc.n_uids);
    if ((rc = kvctl_connect(k)))
        return rc;
    struct kvd_hello_info hi;
    if (kvd_hello(k->ctx, &hi))
        return kvctl_fail(k, "hello");
    if (!hi.has_model)
        return kvctl_usage_err(
            "bench: the daemon serves no model (store mode): start kvd with --model");
    bc.vocab = hi.vocab;
    bc.n_ctx = hi.context;
    if ((uint64_t)bc.prompt.hi + bc.output.hi > bc.n_ctx)
        return kvctl_usage_err("bench: prompt (up to %u) + output (up to %u) tokens exceed the "
                               "model's context of %u",
                               bc.prompt.hi, bc.output.hi, bc.n_ctx);
    bc.progress = bc.progress && isatty(STDERR_FILENO);

    /* The plan: chats of `turns` requests, their arrival times, the system prompt. */
    uint32_t n_chats = (bc.requests + bc.turns - 1) / bc.turns, total = n_chats * bc.turns;
    uint32_t gap_cap = bc.output.hi;
    size_t sh_bytes = sizeof(struct shared) + (size_t)total * sizeof(struct rec) +
                      (size_t)total * gap_cap * sizeof(float);
    struct shared *sh =
        mmap(NULL, sh_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    double *arrival = NULL;
    uint32_t *system = NULL, **ref = NULL, *n_ref = NULL;
    struct kvd_reply *final = NULL;
    if (sh == MAP_FAILED)
        return kvctl_usage_err("bench: cannot map %zu bytes for results", sh_bytes);
    sh->n_chats = n_chats;
    sh->gap_cap = gap_cap;
    sh->recs = (struct rec *)(sh + 1);
    sh->gaps = (float *)(sh->recs + total);
    uint32_t n_system = (uint32_t)lround(bc.shared * bc.prompt.hi);
    system = malloc((n_system + 1) * sizeof(uint32_t));
    if (bc.rate > 0)
        arrival = malloc(n_chats * sizeof(double));
    if (!system || (bc.rate > 0 && !arrival)) {
        rc = kvctl_usage_err("bench: out of memory");
        goto out;
    }
    uint64_t st = mix(bc.seed ^ 0x5157);
    for (uint32_t i = 0; i < n_system; i++)
        system[i] = token(&st, bc.vocab);
    double t = 0;
    for (uint32_t i = 0; arrival && i < n_chats; i++) {
        arrival[i] = t;
        st = mix(st);
        t += -log(((double)(st >> 11) + 0.5) / 9007199254740992.0) / bc.rate;
    }
    struct run rn = {.bc = &bc,
                     .socket = k->socket,
                     .sh = sh,
                     .arrival = arrival,
                     .system = system,
                     .n_system = n_system};
    if (bc.verify) {
        /* Pass 1: one request at a time, closed loop, this process: the
         * unconstrained reference. Then drop the cache it left behind
         * (admins only; others start pass 2 with a warm cache). */
        ref = calloc(total, sizeof(*ref));
        n_ref = calloc(total, sizeof(*n_ref));
        if (!ref || !n_ref) {
            rc = kvctl_usage_err("bench: out of memory");
            goto out;
        }
        struct bench_conf one = bc;
        one.n_uids = 0;
        rn.bc = &one;
        rn.arrival = NULL;
        rn.save = ref;
        rn.n_save = n_ref;
        if (!bc.json)
            fprintf(stderr, "kvctl bench: pass 1 (reference, one request at a time)\n");
        run_pass(&rn, 1, bc.progress);
        for (uint32_t i = 0; i < total; i++)
            if (sh->recs[i].err > 0) {
                rc = kvctl_usage_err("bench: the reference pass failed: %s",
                                     kvd_err_code(sh->recs[i].err));
                goto out;
            }
        kvd_admin_evict(k->ctx, "device", 0, NULL);
        kvd_admin_evict(k->ctx, "host", 0, NULL);
        rn.bc = &bc;
        rn.arrival = arrival;
        rn.save = NULL;
        rn.n_save = NULL;
        rn.ref = ref;
        rn.n_ref = n_ref;
        if (!bc.json)
            fprintf(stderr, "kvctl bench: pass 2 (the load)\n");
    }
    struct dstats d0 = {0}, d1 = {0};
    if (kvctl_bench_read_stats(k->ctx, &d0, NULL)) {
        rc = kvctl_fail(k, "stats");
        goto out;
    }
    double t_start = now_s();
    run_pass(&rn, bc.conns, bc.progress);
    double wall = now_s() - t_start;
    if (kvctl_bench_read_stats(k->ctx, &d1, &final)) {
        rc = kvctl_fail(k, "stats");
        goto out;
    }
    rc = kvctl_bench_report(&bc, sh, &d0, &d1, final ? final->body : NULL, wall);
out:
    kvd_reply_free(final);
    free_outputs(ref, ref ? total : 0);
    free(n_ref);
    free(system);
    free(arrival);
    munmap(sh, sh_bytes);
    return rc;
}
