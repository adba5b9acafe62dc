/* A test's allocations and other things to release, in CMocka
 * setup/teardown (ts_setup, ts_teardown): ts_malloc/ts_calloc allocate and
 * register, ts_defer registers any release, ts_free releases one early
 * (malloc'd or deferred), and the teardown releases whatever is left, last
 * registered first, also after a failed assert. *state is the registry. */
#ifndef KVD_TEST_SCRATCH_H
#define KVD_TEST_SCRATCH_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

struct ts_entry {
    void *p;
    void (*fn)(void *ctx, void *p);
    void *ctx;
};

struct ts_list {
    struct ts_entry *v; /* (cap) */
    size_t n, cap;
};

static inline int ts_setup(void **state)
{
    *state = calloc(1, sizeof(struct ts_list));
    return *state ? 0 : -1;
}

static inline int ts_teardown(void **state)
{
    struct ts_list *l = *state;
    if (!l)
        return 0;
    while (l->n) {
        struct ts_entry e = l->v[--l->n];
        e.fn(e.ctx, e.p);
    }
    free(l->v);
    free(l);
    return 0;
}

/* Registers fn(ctx, p) to release p; returns p. */
static inline void *ts_defer(void **state, void *p, void (*fn)(void *ctx, void *p), void *ctx)
{
    struct ts_list *l = *state;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 32;
        struct ts_entry *nv = realloc(l->v, cap * sizeof(*nv));
        if (!nv) {
            fn(ctx, p);
            fail_msg("ts_defer: out of memory");
        }
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = (struct ts_entry){p, fn, ctx};
    return p;
}

static inline void ts_free_cb(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static inline void *ts_malloc(void **state, size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    assert_non_null(p);
    return ts_defer(state, p, ts_free_cb, NULL);
}

static inline void *ts_calloc(void **state, size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    assert_non_null(p);
    return ts_defer(state, p, ts_free_cb, NULL);
}

/* Releases p now (the last registration of p); a p never registered is an
 * error of the test. */
static inline void ts_free(void **state, void *p)
{
    struct ts_list *l = *state;
    for (size_t i = l->n; i-- > 0;)
        if (l->v[i].p == p) {
            struct ts_entry e = l->v[i];
            memmove(&l->v[i], &l->v[i + 1], (l->n - i - 1) * sizeof(l->v[0]));
            l->n--;
            e.fn(e.ctx, e.p);
            return;
        }
    fail_msg("ts_free: %p was not registered", p);
}

#endif
