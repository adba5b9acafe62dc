/* arbiter: one device shared by several executors (one per loaded model).
 * An executor holds the device for each step's forward; when several want
 * it, the one whose step serves the tenants furthest behind goes first.
 * Each tenant has a virtual time across all models: the device time its
 * tokens took (a step's forward time, split by the step's tokens) divided by
 * its weight, so a tenant of weight w gets w times the device time of a
 * tenant of weight 1, whichever models their requests run on, and a model
 * whose steps cost more is charged more. A tenant that was idle starts at
 * the virtual time of the last turn given (idling earns no credit).
 * Thread-safe: one mutex and one condition variable. */
#ifndef KVD_ARBITER_H
#define KVD_ARBITER_H

#include <stddef.h>
#include <stdint.h>

/* One tenant's part of a step: the tokens it computes and its weight. */
struct arbiter_share {
    uint32_t tenant;
    uint32_t tokens;
    uint32_t weight; /* >= 1 */
};

struct exec_arbiter;

int arbiter_new(struct exec_arbiter **out);
void arbiter_free(struct exec_arbiter *a);

/* Waits until the device is free and no executor waiting for it has a
 * smaller key (ties: the one that asked first). The key is the smallest
 * virtual time among the step's tenants (s[0..n), each raised to the
 * clock first). Every acquire is followed by one release. */
void arbiter_acquire(struct exec_arbiter *a, const struct arbiter_share *s, size_t n);
/* The step's forward took ns: each tenant's virtual time grows by
 * ns * tokens / (the step's tokens) / weight. Frees the device. */
void arbiter_release(struct exec_arbiter *a, const struct arbiter_share *s, size_t n, uint64_t ns);

/* A tenant's virtual time (device ns / weight; 0 for one never served)
 * and the turns given so far (stats, tests). */
double arbiter_vtime(struct exec_arbiter *a, uint32_t tenant);
uint64_t arbiter_turns(struct exec_arbiter *a);
/* Executors waiting for the device now. */
unsigned arbiter_waiting(struct exec_arbiter *a);

#endif
