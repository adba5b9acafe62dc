/* bench_rtt: round trips to a running kvd through libkvd. Prints the latency
 * (p50/p99) of one op from one client, then the throughput (ops/s) of
 * 1, 16 and 64 clients that each keep a pipeline of requests in flight, like
 * `redis-benchmark -c C -P DEPTH`: each client sends DEPTH requests, waits
 * for all their replies, and sends the next DEPTH. One client thread polls
 * all the connections (--threads for more), as redis-benchmark does. The
 * op is hello (a 20-pair reply, ~300 bytes) or seq_info of a sequence the
 * client opened (--seq-tokens long, default 0: a 7-pair reply of ~60 bytes,
 * the smallest success reply of a read-only op). A program that prints
 * numbers, not a test. */
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvd/client.h"

struct bench {
    const char *socket;
    const char *op;      /* "hello" or "seq_info" */
    unsigned seq_tokens; /* length of the seq_info sequence */
    unsigned depth;      /* requests in flight per client */
    unsigned threads;    /* client threads (each polls many connections) */
    uint64_t lat_ops, tput_ops;
};

/* One benchmark thread drives many connections through poll(), like
 * redis-benchmark's event loop, so the clients cost little CPU next to the
 * daemon on a small machine. */
struct client {
    struct kvd_ctx *ctx;
    uint64_t seq;
    uint64_t *ids;          /* (depth) the batch in flight */
    unsigned n_out, n_done; /* batch size, replies collected of it */
    uint64_t left;          /* requests still to send */
};

struct worker {
    const struct bench *b;
    unsigned n_clients;
    uint64_t ops_per_client;
    pthread_barrier_t *start;
    int rc;
    char err[2 * KVD_ERRSTR_LEN];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A connected context, plus (for seq_info) an open sequence of
 * b->seq_tokens tokens. */
static struct kvd_ctx *open_client(const struct bench *b, uint64_t *seq, char *err, size_t cap)
{
    struct kvd_ctx *c = kvd_connect(b->socket);
    if (!c || c->err) {
        snprintf(err, cap, "%s", c ? c->errstr : "out of memory");
        kvd_close(c);
        return NULL;
    }
    *seq = 0;
    if (!strcmp(b->op, "seq_info") &&
        (kvd_seq_open(c, NULL, seq) ||
         (b->seq_tokens && kvd_seq_extend(c, *seq, b->seq_tokens, NULL)))) {
        snprintf(err, cap, "seq setup: %s", c->errstr);
        kvd_close(c);
        return NULL;
    }
    return c;
}

static int send_op(struct kvd_ctx *c, const struct bench *b, uint64_t seq, uint64_t *id)
{
    if (!strcmp(b->op, "seq_info")) {
        struct kvd_arg a = KVD_ARG_U("seq", seq);
        return kvd_send(c, KVD_OP_SEQ_INFO, &a, 1, NULL, NULL, id);
    }
    return kvd_send(c, KVD_OP_HELLO, NULL, 0, NULL, NULL, id);
}

static int send_batch(struct client *cl, const struct bench *b)
{
    unsigned n = (unsigned)(cl->left < b->depth ? cl->left : b->depth);
    for (unsigned i = 0; i < n; i++)
        if (send_op(cl->ctx, b, cl->seq, &cl->ids[i]))
            return -1;
    cl->n_out = n;
    cl->n_done = 0;
    cl->left -= n;
    return kvd_flush(cl->ctx) ? -1 : 0;
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    const struct bench *b = w->b;
    struct client *cl = calloc(w->n_clients, sizeof(*cl));
    struct pollfd *pfd = calloc(w->n_clients, sizeof(*pfd));
    struct kvd_ctx *bad = NULL;
    unsigned active = 0;

    w->rc = !cl || !pfd;
    for (unsigned i = 0; !w->rc && i < w->n_clients; i++) {
        cl[i].ids = calloc(b->depth, sizeof(*cl[i].ids));
        cl[i].ctx = cl[i].ids ? open_client(b, &cl[i].seq, w->err, sizeof(w->err)) : NULL;
        cl[i].left = w->ops_per_client;
        w->rc = !cl[i].ctx;
    }
    pthread_barrier_wait(w->start);
    for (unsigned i = 0; !w->rc && i < w->n_clients; i++) {
        if (send_batch(&cl[i], b)) {
            bad = cl[i].ctx;
            goto fail;
        }
        active++;
    }
    while (!w->rc && active) {
        for (unsigned i = 0; i < w->n_clients; i++) {
            pfd[i].fd = cl[i].n_out ? cl[i].ctx->fd : -1;
            pfd[i].events = POLLIN;
        }
        if (poll(pfd, w->n_clients, 30000) <= 0) {
            snprintf(w->err, sizeof(w->err), "no reply for 30 s");
            w->rc = 1;
            break;
        }
        for (unsigned i = 0; i < w->n_clients; i++) {
            struct client *c = &cl[i];
            if (!c->n_out || !(pfd[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            while (c->n_done < c->n_out) {
                struct kvd_reply *r;
                int rc = kvd_try_wait(c->ctx, c->ids[c->n_done], &r);
                if (rc == KVD_EBUSY)
                    break;
                if (rc) {
                    bad = c->ctx;
                    goto fail;
                }
                kvd_reply_free(r);
                c->n_done++;
            }
            if (c->n_done < c->n_out)
                continue;
            c->n_out = 0;
            if (!c->left)
                active--;
            else if (send_batch(c, b)) {
                bad = c->ctx;
                goto fail;
            }
        }
    }
    goto out;
fail:
    w->rc = 1;
    snprintf(w->err, sizeof(w->err), "%s: %s", kvd_err_code(bad->err), bad->errstr);
out:
    for (unsigned i = 0; cl && i < w->n_clients; i++) {
        kvd_close(cl[i].ctx);
        free(cl[i].ids);
    }
    free(cl);
    free(pfd);
    return NULL;
}

static int run_latency(const struct bench *b)
{
    char err[2 * KVD_ERRSTR_LEN];
    uint64_t seq;
    double *lat = malloc(b->lat_ops * sizeof(*lat)), sum = 0;
    struct kvd_ctx *c = lat ? open_client(b, &seq, err, sizeof(err)) : NULL;

    if (!c) {
        fprintf(stderr, "bench_rtt: %s\n", lat ? err : "out of memory");
        free(lat);
        return 1;
    }
    for (uint64_t i = 0; i < b->lat_ops / 10 + 1; i++) { /* warm up */
        uint64_t id;
        struct kvd_reply *r;
        if (send_op(c, b, seq, &id) || kvd_wait(c, id, &r))
            goto fail;
        kvd_reply_free(r);
    }
    for (uint64_t i = 0; i < b->lat_ops; i++) {
        uint64_t id;
        struct kvd_reply *r;
        double t0 = now_s();
        if (send_op(c, b, seq, &id) || kvd_wait(c, id, &r))
            goto fail;
        lat[i] = (now_s() - t0) * 1e6;
        sum += lat[i];
        kvd_reply_free(r);
    }
    qsort(lat, b->lat_ops, sizeof(*lat), cmp_double);
    printf("kvd %-8s latency, 1 client, no pipeline: p50 %.1f us  p99 %.1f us  mean %.1f us"
           "  (%" PRIu64 " round trips)\n",
           b->op, lat[b->lat_ops / 2], lat[b->lat_ops * 99 / 100], sum / (double)b->lat_ops,
           b->lat_ops);
    kvd_close(c);
    free(lat);
    return 0;
fail:
    fprintf(stderr, "bench_rtt: %s: %s\n", kvd_err_code(c->err), c->errstr);
    kvd_close(c);
    free(lat);
    return 1;
}

static int run_throughput(const struct bench *b, unsigned clients)
{
    unsigned nt = clients < b->threads ? clients : b->threads;
    pthread_t *th = calloc(nt, sizeof(*th));
    struct worker *w = calloc(nt, sizeof(*w));
    pthread_barrier_t start;
    uint64_t per_client = b->tput_ops / clients;
    double t0, dt;
    int rc = 0;

    if (!th || !w) {
        free(th);
        free(w);
        return 1;
    }
    pthread_barrier_init(&start, NULL, nt + 1);
    for (unsigned i = 0; i < nt; i++) {
        w[i].b = b;
        /* Clients spread evenly over the threads. */
        w[i].n_clients = clients / nt + (i < clients % nt);
        w[i].ops_per_client = per_client;
        w[i].start = &start;
        if (pthread_create(&th[i], NULL, worker_main, &w[i])) {
            fprintf(stderr, "bench_rtt: cannot start thread %u\n", i);
            exit(1); /* a half-started barrier cannot be unwound: give up */
        }
    }
    pthread_barrier_wait(&start); /* every client connected */
    t0 = now_s();
    for (unsigned i = 0; i < nt; i++)
        pthread_join(th[i], NULL);
    dt = now_s() - t0;
    for (unsigned i = 0; i < nt; i++) {
        if (w[i].rc) {
            fprintf(stderr, "bench_rtt: thread %u: %s\n", i, w[i].err);
            rc = 1;
        }
    }
    if (!rc)
        printf("kvd %-8s throughput, %2u clients, pipeline %u: %10.0f ops/s  (%" PRIu64
               " ops in %.2f s, %u threads)\n",
               b->op, clients, b->depth, (double)(per_client * clients) / dt, per_client * clients,
               dt, nt);
    pthread_barrier_destroy(&start);
    free(th);
    free(w);
    return rc;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'},  {"op", required_argument, NULL, 'o'},
        {"depth", required_argument, NULL, 'd'},   {"latency-ops", required_argument, NULL, 'l'},
        {"ops", required_argument, NULL, 'n'},     {"clients", required_argument, NULL, 'c'},
        {"threads", required_argument, NULL, 't'}, {"seq-tokens", required_argument, NULL, 'k'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0},
    };
    struct bench b = {
        .op = "hello", .depth = 16, .lat_ops = 20000, .tput_ops = 320000, .threads = 1};
    const char *clients = "1,16,64";
    char sock[256];
    int c, rc = 0;

    while ((c = getopt_long(argc, argv, "s:o:d:l:n:c:t:k:h", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            b.socket = optarg;
            break;
        case 'o':
            b.op = optarg;
            break;
        case 'd':
            b.depth = (unsigned)strtoul(optarg, NULL, 10);
            break;
        case 'l':
            b.lat_ops = strtoull(optarg, NULL, 10);
            break;
        case 'n':
            b.tput_ops = strtoull(optarg, NULL, 10);
            break;
        case 'c':
            clients = optarg;
            break;
        case 't':
            b.threads = (unsigned)strtoul(optarg, NULL, 10);
            break;
        case 'k':
            b.seq_tokens = (unsigned)strtoul(optarg, NULL, 10);
            break;
        default:
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: bench_rtt [--socket PATH] [--op hello|seq_info] [--depth 16]\n"
                    "                 [--latency-ops 20000] [--ops 320000] [--clients 1,16,64]\n"
                    "                 [--threads 1] [--seq-tokens 0]\n"
                    "--latency-ops 0 skips the latency run; --clients '' the throughput runs.\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (strcmp(b.op, "hello") && strcmp(b.op, "seq_info")) {
        fprintf(stderr, "bench_rtt: --op is hello or seq_info\n");
        return 2;
    }
    if (!b.depth || !b.tput_ops || !b.threads) {
        fprintf(stderr, "bench_rtt: --depth, --ops and --threads must be positive\n");
        return 2;
    }
    if (!b.socket) {
        if (kvd_default_socket(sock, sizeof(sock))) {
            fprintf(stderr, "bench_rtt: $KVD_SOCKET is too long\n");
            return 2;
        }
        b.socket = sock;
    }
    if (b.lat_ops) /* --latency-ops 0 skips it */
        rc |= run_latency(&b);
    for (const char *p = clients; !rc && *p;) {
        char *end;
        unsigned long n = strtoul(p, &end, 10);
        if (!n || (*end && *end != ',')) {
            fprintf(stderr, "bench_rtt: --clients is a list like 1,16,64\n");
            return 2;
        }
        rc |= run_throughput(&b, (unsigned)n);
        p = *end ? end + 1 : end;
    }
    return rc ? 1 : 0;
}
