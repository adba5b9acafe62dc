/* bench_kvevents: what KV events cost and carry. Commits chains of full
 * blocks through kvmm (cpu backend, 16-token blocks, a tenant with
 * events = on) in three modes: no events attached, events with no
 * subscriber, events with one subscriber (a SUB socket on its own thread,
 * over ipc), and prints per mode the commit rate the kvmm lock holder sees
 * and the end-to-end rate: blocks reported and sent on the socket per
 * second of wall time (the producer waits while the publisher's queue is
 * more than half full, so this is the publisher's sustained rate).
 * Usage: bench_kvevents [total_blocks] (default 262144). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "backend.h"
#include "blockkey.h"
#include "kvevents.h"
#include "kvmm.h"

#define BT 16
#define CHAIN 64   /* blocks per committed sequence */
#define POOL 16384 /* device blocks; the trees are cleared when full */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

struct sub_state {
    void *ctx;
    const char *ep;
    atomic_bool stop;
    atomic_uint_fast64_t batches, bytes, last_seq;
};

static void *sub_main(void *arg)
{
    struct sub_state *s = arg;
    void *sub = zmq_socket(s->ctx, ZMQ_SUB);
    int zero = 0;
    zmq_setsockopt(sub, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0);
    zmq_connect(sub, s->ep);
    while (!atomic_load(&s->stop)) {
        zmq_pollitem_t it = {sub, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 50) <= 0)
            continue;
        zmq_msg_t m;
        int part = 0, more = 1;
        while (more) {
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, sub, 0) < 0)
                break;
            more = zmq_msg_more(&m);
            if (part == 1 && zmq_msg_size(&m) == 8) {
                const unsigned char *d = zmq_msg_data(&m);
                uint64_t q = 0;
                for (int i = 0; i < 8; i++)
                    q = q << 8 | d[i];
                atomic_store(&s->last_seq, q);
            }
            atomic_fetch_add(&s->bytes, zmq_msg_size(&m));
            zmq_msg_close(&m);
            part++;
        }
        atomic_fetch_add(&s->batches, 1);
    }
    zmq_close(sub);
    return NULL;
}

static void run(const char *mode, size_t total, int with_events, int with_sub)
{
    struct backend *be;
    struct kvmm *mm;
    struct kvmm_config cfg = {
        .geom = {.layers = 1, .kv_heads = 1, .head_dim = 32, .dtype = KV_F16, .block_tokens = BT},
        .n_device_blocks = POOL,
        .n_host_blocks = 0};
    if (backend_cpu_new(&be) || (cfg.be = be, kvmm_new(&cfg, &mm))) {
        fprintf(stderr, "bench_kvevents: cannot make a kvmm\n");
        exit(1);
    }
    struct kvevents *ev = NULL;
    char ep[128];
    snprintf(ep, sizeof ep, "ipc:///tmp/bench-kvev-%d.sock", (int)getpid());
    struct sub_state ss = {0};
    pthread_t th;
    void *zctx = NULL;
    if (with_events) {
        struct kvevents_conf ec = {.endpoint = ep, .block_tokens = BT};
        struct kvd_error e = {0};
        if (kvevents_start(&ec, &ev, &e)) {
            fprintf(stderr, "bench_kvevents: %s\n", e.message);
            exit(1);
        }
    }
    if (with_sub) {
        zctx = zmq_ctx_new();
        ss.ctx = zctx;
        ss.ep = ep;
        pthread_create(&th, NULL, sub_main, &ss);
        struct kvevents_stats st;
        do {
            usleep(1000);
            kvevents_stats(ev, &st);
        } while (st.subscribers == 0);
    }
    kvmm_lock(mm);
    struct kvmm_tenant_conf tc = {.name = "bench",
                                  .max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1,
                                  .events = KVMM_EVENTS_ON};
    uint32_t t, ns;
    kvmm_tenant_set(mm, &tc, &t);
    kvmm_tenant_namespace(mm, t, &ns);
    if (ev)
        kvmm_events_attach(mm, kvevents_sink(ev), blockkey_pub_root(""));
    kvmm_unlock(mm);

    uint32_t *tok = malloc(sizeof(uint32_t) * CHAIN * BT);
    double t_commit = 0, t0 = now_s();
    size_t done = 0, in_tree = 0;
    uint32_t salt = 1;
    while (done < total) {
        if (ev) { /* back-pressure: keep the queue under half full */
            struct kvevents_stats st;
            for (;;) {
                kvevents_stats(ev, &st);
                if (st.queued < 16384)
                    break;
                usleep(200);
            }
        }
        for (size_t i = 0; i < CHAIN * BT; i++)
            tok[i] = (uint32_t)(i * 2654435761u) ^ (salt * 40503u);
        salt++;
        kvmm_lock(mm);
        if (in_tree + CHAIN > POOL) {
            kvmm_clear(mm, NULL);
            in_tree = 0;
        }
        kvmm_seq_t s;
        size_t shared;
        double a = now_s();
        kvmm_seq_open(mm, 1, t, ns, &s);
        kvmm_seq_extend(mm, 1, s, CHAIN * BT);
        kvmm_seq_commit(mm, 1, s, tok, CHAIN * BT, &shared);
        kvmm_seq_close(mm, 1, s);
        t_commit += now_s() - a;
        kvmm_unlock(mm);
        in_tree += CHAIN;
        done += CHAIN;
    }
    struct kvevents_stats st = {0};
    if (ev) {
        do {
            kvevents_stats(ev, &st);
            if (st.queued)
                usleep(100);
        } while (st.queued);
        usleep(20000); /* the last flush */
        kvevents_stats(ev, &st);
    }
    double wall = now_s() - t0;
    if (with_sub) {
        for (int i = 0; i < 200 && atomic_load(&ss.last_seq) + 1 < st.next_seq; i++)
            usleep(10000);
    }
    printf("%-16s commit %7.2f M blocks/s (%.0f ns/block under the lock)", mode,
           (double)done / t_commit / 1e6, t_commit / (double)done * 1e9);
    if (ev)
        printf("; sent %7.2f M blocks/s, %llu batches, %llu events, dropped %llu, hwm %llu",
               (double)st.blocks / wall / 1e6, (unsigned long long)st.batches,
               (unsigned long long)st.events, (unsigned long long)st.dropped,
               (unsigned long long)st.hwm_drops);
    if (with_sub)
        printf("; subscriber got %llu batches, %.1f MB",
               (unsigned long long)atomic_load(&ss.batches), (double)atomic_load(&ss.bytes) / 1e6);
    printf("\n");
    kvmm_lock(mm);
    kvmm_events_attach(mm, NULL, 0);
    kvmm_unlock(mm);
    if (with_sub) {
        atomic_store(&ss.stop, true);
        pthread_join(th, NULL);
        zmq_ctx_term(zctx);
    }
    kvevents_stop(ev);
    kvmm_free(mm);
    backend_free(be);
    free(tok);
}

int main(int argc, char **argv)
{
    size_t total = argc > 1 ? strtoull(argv[1], NULL, 10) : 262144;
    run("no events", total, 0, 0);
    run("no subscriber", total, 1, 0);
    run("one subscriber", total, 1, 1);
    return 0;
}
