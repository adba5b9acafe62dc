/* kvctl bench internals shared by kvctl_bench.c (the load: plan, workers,
 * passes) and kvctl_bench_report.c (percentiles, daemon counters, the
 * human and --json reports). */
#ifndef KVD_KVCTL_BENCH_H
#define KVD_KVCTL_BENCH_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvd/client.h"

struct dist {
    uint32_t lo, hi; /* uniform in [lo, hi] */
};

struct bench_conf {
    uint32_t conns, requests, turns;
    double rate, shared;
    struct dist prompt, output;
    uid_t uids[64];
    size_t n_uids;
    float temperature;
    uint64_t seed;
    bool verify, json, progress;
    uint32_t vocab, n_ctx;
};

/* One request's outcome. Lives in memory shared with forked workers. */
struct rec {
    int32_t err;      /* 0, an enum kvd_err, or -1: never ran */
    bool mismatch;    /* --verify: tokens differ from the first pass */
    double t_send;    /* seconds since the run started */
    double ttft, e2e; /* seconds */
    uint32_t prompt, cached, completion;
    uint32_t n_gaps; /* inter-token gaps in gaps[index * gap_cap ...] */
};

/* Everything workers share (MAP_SHARED, so forked workers write it too). */
struct shared {
    atomic_uint next_chat;
    atomic_uint done;         /* requests finished */
    atomic_uint workers_left; /* connections still running */
    atomic_uint conn_failed;  /* connections that could not connect */
    uint32_t n_chats, gap_cap;
    struct rec *recs; /* [n_chats * turns] */
    float *gaps;      /* [n_chats * turns * gap_cap] seconds */
};

/* Daemon counters read before and after the run. */
struct dstats {
    double swaps_out, swaps_in, preempt_swap, preempt_recompute;
};

/* Reads the counters above from the daemon's stats; *keep (may be NULL)
 * gets the whole reply (kvd_reply_free it). 0 or the error. */
int kvctl_bench_read_stats(struct kvd_ctx *ctx, struct dstats *d, struct kvd_reply **keep);
/* Prints the report (--json: one object) of a finished pass; returns the
 * exit code (KVCTL_ESERVER when a request failed or an output differed). */
int kvctl_bench_report(const struct bench_conf *bc, const struct shared *sh,
                       const struct dstats *d0, const struct dstats *d1,
                       const struct kvd_value *final_stats, double wall);

#endif
