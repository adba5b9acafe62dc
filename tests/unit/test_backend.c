/* The backend table's identity and memory figures: the cpu backend says
 * what it is by kind (callers branch on that, not on the name) and reports
 * the machine's physical memory, which --gpu-mem is a fraction of there. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend.h"

/* The backend in setup/teardown: freed even when an assert fails. */
static int be_setup(void **state)
{
    struct backend *be = NULL;
    int rc = backend_cpu_new(&be);
    *state = be;
    return rc ? -1 : 0;
}

static int be_teardown(void **state)
{
    backend_free(*state);
    return 0;
}

static void test_cpu_kind_and_memory(void **state)
{
    struct backend *be = *state;
    size_t free_b = 0, total_b = 0;
    assert_int_equal(be->ops->kind, BACKEND_CPU);
    assert_string_equal(be->ops->name, "cpu");
    assert_non_null(be->ops->mem_info);
    assert_int_equal(be->ops->mem_info(be, &free_b, &total_b), 0);
    size_t phys = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
    assert_true(total_b == phys && free_b == total_b && total_b > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_cpu_kind_and_memory, be_setup, be_teardown)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
