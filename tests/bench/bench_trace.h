/* bench_trace: the replayed request trace the cache benchmarks share
 * (bench_evict, bench_remote, bench_disk_evict). From a fixed seed, so
 * every policy sees the same requests, it mixes
 *   - prompts on shared system prompts: one of 48 (Zipf, s = 1.1, 256..1024
 *     tokens each) plus a 32..160-token question of its own,
 *   - multi-turn conversations: 64 live ones (Zipf, s = 0.8); a turn is a
 *     system prompt (its first), the whole history and a new 32..128-token
 *     message, and its 64..192-token answer joins the history; after 4..12
 *     turns a conversation is replaced by a new one,
 *   - one-off prompts: 256..2048 tokens seen once (a scan),
 * 45 / 35 / 20 percent. Token ids are fresh numbers from 1 up (< 2^30). */
#ifndef KVD_BENCH_TRACE_H
#define KVD_BENCH_TRACE_H

#include <stddef.h>
#include <stdint.h>

#define BT 16 /* tokens per block in every trace benchmark */

struct tokv {
    uint32_t *v;
    size_t n, cap;
};

/* One request of the trace: the prompt and how many tokens are generated
 * (which, for a conversation, the caller appends to its history). */
struct req {
    uint32_t tenant; /* 0 or 1: which half of the two-tenant run */
    struct tokv prompt;
    uint32_t gen;
    int conv; /* conversation index, or -1 */
};

struct trace {
    struct req *r;
    size_t n;
};

/* n requests from seed (tr->r owned: free each prompt.v, then tr->r). */
void bench_trace_make(struct trace *tr, size_t n, uint64_t seed);
/* The answer tokens of request i (q->gen of them): for a conversation,
 * exactly what the next turn's prompt repeats; otherwise fresh ids (in
 * scratch, at least q->gen long). */
const uint32_t *bench_trace_answer(const struct trace *tr, size_t i, uint32_t *scratch);
/* Frees what bench_trace_make allocated. */
void bench_trace_free(struct trace *tr);

#endif
