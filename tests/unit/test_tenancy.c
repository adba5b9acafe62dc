/* tenancy: registration once, admission counts, the sub-tenant cap, the
 * LRU freeing of idle sub-tenants (and kvmm_tenant_remove under it), and
 * the lookups by name and id, against a real kvmm. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "config.h"
#include "mm_fixture.h"
#include "tenancy.h"

static struct config_identity ident(const char *name)
{
    struct config_identity id;
    memset(&id, 0, sizeof(id));
    snprintf(id.conf.name, sizeof(id.conf.name), "%s", name);
    id.conf.max_device_blocks = id.conf.max_host_blocks = id.conf.max_seqs = KVMM_UNLIMITED;
    id.conf.weight = 1;
    return id;
}

static void sub(struct tenancy *t, const char *name, int want, struct tenancy_who *who)
{
    char full[KVD_MAX_NAME + 1];
    struct kvd_error e = {0};
    snprintf(full, sizeof(full), "fe/%s", name);
    struct config_identity id = ident(full);
    assert_int_equal(tenancy_register_sub(t, "fe", &id, who, &e), want);
}

static void test_register_once_and_admit(void **state)
{
    struct fx f;
    struct tenancy *t;
    struct tenancy_who a, b;
    struct kvd_error e = {0};
    fx_open(&f, 16, 16);
    kvmm_unlock(f.mm); /* tenancy takes the lock itself */
    f.locked = false;
    assert_int_equal(tenancy_new(f.mm, 4, 2, &t), 0);
    struct config_identity id = ident("alpha");
    assert_int_equal(tenancy_register(t, &id, &a, &e), 0);
    assert_int_equal(tenancy_register(t, &id, &b, &e), 0);
    assert_int_equal(a.tenant, b.tenant);
    assert_int_equal(a.ns, b.ns);
    assert_string_equal(b.name, "alpha");
    struct tenancy_counts c;
    tenancy_counts(t, &c);
    assert_int_equal(c.tenants, 1);
    uint32_t got;
    assert_true(tenancy_lookup(t, "alpha", &got));
    assert_int_equal(got, a.tenant);
    assert_false(tenancy_lookup(t, "beta", NULL));
    /* max-queued-per-tenant = 2 */
    assert_int_equal(tenancy_admit(t, a.tenant, 1, &e), 0);
    tenancy_pending(t, a.tenant, 2);
    assert_int_equal(tenancy_in_flight(t, a.tenant), 2);
    assert_int_equal(tenancy_admit(t, a.tenant, 1, &e), KVD_EBUSY);
    assert_non_null(strstr(e.message, "max-queued-per-tenant = 2"));
    tenancy_pending(t, a.tenant, -1);
    assert_int_equal(tenancy_admit(t, a.tenant, 1, &e), 0);
    /* a generate of n choices counts n */
    assert_int_equal(tenancy_admit(t, a.tenant, 2, &e), KVD_EBUSY);
    tenancy_pending(t, a.tenant, -1);
    assert_int_equal(tenancy_admit(t, a.tenant, 2, &e), 0);
    tenancy_free(t);
    fx_close(&f);
}

static void test_sub_cap_and_lru(void **state)
{
    struct fx f;
    struct tenancy *t;
    struct tenancy_who fe, w[4], x;
    struct kvd_error e = {0};
    fx_open(&f, 16, 16);
    kvmm_unlock(f.mm); /* tenancy takes the lock itself */
    f.locked = false;
    assert_int_equal(tenancy_new(f.mm, 3, 100, &t), 0);
    struct config_identity id = ident("fe");
    assert_int_equal(tenancy_register(t, &id, &fe, &e), 0);
    sub(t, "a", 0, &w[0]);
    sub(t, "b", 0, &w[1]);
    sub(t, "c", 0, &w[2]);
    assert_int_equal(tenancy_sub_count(t, "fe"), 3);
    /* a busy (a request in flight), b holds a sequence, c idle: "d" frees
     * c although a is older; then "e" finds nobody idle and is refused. */
    tenancy_pending(t, w[0].tenant, 1);
    kvmm_seq_t seq;
    kvmm_lock(f.mm);
    assert_int_equal(kvmm_seq_open(f.mm, 7, w[1].tenant, w[1].ns, &seq), 0);
    kvmm_unlock(f.mm);
    sub(t, "d", 0, &w[3]);
    assert_false(tenancy_lookup(t, "fe/c", NULL));
    assert_true(tenancy_lookup(t, "fe/a", NULL));
    assert_int_equal(w[3].tenant, w[2].tenant); /* c's kvmm id reused */
    tenancy_pending(t, w[3].tenant, 1);
    char full[] = "fe/e";
    struct config_identity ide = ident(full);
    assert_int_equal(tenancy_register_sub(t, "fe", &ide, &x, &e), KVD_EQUOTA);
    assert_non_null(strstr(e.message, "max-sub-tenants"));
    /* Once a's request ends it is the least recently used idle one. */
    tenancy_pending(t, w[0].tenant, -1);
    sub(t, "e", 0, &x);
    assert_false(tenancy_lookup(t, "fe/a", NULL));
    assert_true(tenancy_lookup(t, "fe/b", NULL));
    /* Using a name again makes it the most recent: with b's sequence
     * closed and b used again, "f" frees e (d is busy). */
    kvmm_lock(f.mm);
    assert_int_equal(kvmm_seq_close(f.mm, 7, seq), 0);
    kvmm_unlock(f.mm);
    sub(t, "b", 0, &w[1]);
    sub(t, "f", 0, &x);
    assert_false(tenancy_lookup(t, "fe/e", NULL));
    assert_true(tenancy_lookup(t, "fe/b", NULL));
    struct tenancy_counts c;
    tenancy_counts(t, &c);
    assert_int_equal(c.sub_tenants, 3);
    assert_int_equal(c.subs_freed, 3);
    assert_int_equal(c.subs_refused, 1);
    /* a freed id is not a tenant for kvmm any more */
    kvmm_lock(f.mm);
    struct kvmm_tenant_stats ts;
    uint32_t gone;
    assert_int_equal(kvmm_tenant_find(f.mm, "fe/a", &gone), KVD_ENOTFOUND);
    assert_int_equal(kvmm_tenant_stats(f.mm, x.tenant, &ts), 0);
    assert_string_equal(ts.name, "fe/f");
    kvmm_unlock(f.mm);
    tenancy_free(t);
    fx_close(&f);
}

/* Many names through a cap of 8: the kvmm tables stay at the cap. */
static void test_many_names_bounded(void **state)
{
    struct fx f;
    struct tenancy *t;
    struct tenancy_who fe, w;
    struct kvd_error e = {0};
    fx_open(&f, 16, 16);
    kvmm_unlock(f.mm); /* tenancy takes the lock itself */
    f.locked = false;
    assert_int_equal(tenancy_new(f.mm, 8, 100, &t), 0);
    struct config_identity id = ident("fe");
    assert_int_equal(tenancy_register(t, &id, &fe, &e), 0);
    for (int i = 0; i < 5000; i++) {
        char n[16];
        snprintf(n, sizeof(n), "s%d", i);
        sub(t, n, 0, &w);
    }
    struct kvmm_stats st;
    kvmm_lock(f.mm);
    kvmm_stats(f.mm, &st);
    kvmm_unlock(f.mm);
    assert_true(st.n_tenants <= 9);
    assert_int_equal(tenancy_sub_count(t, "fe"), 8);
    tenancy_free(t);
    fx_close(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_register_once_and_admit),
        cmocka_unit_test(test_sub_cap_and_lru),
        cmocka_unit_test(test_many_names_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
