/* Set-up of the pool and host-tier unit tests, in CMocka setup/teardown: a
 * cpu backend, and a pool the test sizes with pfx_init. The teardown frees
 * whatever was made, also after a failed assert. */
#ifndef KVD_TEST_POOL_FIXTURE_H
#define KVD_TEST_POOL_FIXTURE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>

#include "backend.h"
#include "pool.h"

struct pfx {
    struct backend *be;
    struct pool p;
    bool inited; /* p was initialised (pfx_init) */
};

static inline int pfx_setup(void **state)
{
    struct pfx *f = calloc(1, sizeof *f);
    *state = f;
    return f && backend_cpu_new(&f->be) == 0 ? 0 : -1;
}

static inline int pfx_teardown(void **state)
{
    struct pfx *f = *state;
    if (!f)
        return 0;
    if (f->inited)
        pool_destroy(&f->p);
    backend_free(f->be);
    free(f);
    return 0;
}

static inline struct pool *pfx_init(struct pfx *f, size_t block_bytes, uint32_t n_device,
                                    uint32_t n_host)
{
    assert_int_equal(pool_init(&f->p, f->be, block_bytes, n_device, n_host), 0);
    f->inited = true;
    return &f->p;
}

#endif
