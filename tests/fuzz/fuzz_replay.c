/* fuzz_replay: runs a fuzz target's entry function over its seed corpus and
 * its regression inputs (every crash the fuzzer ever found) without
 * libFuzzer, so they run in the ordinary ctest suite under gcc, ASan and
 * the fault build too. FUZZ_DIRS is a ':'-separated list of directories. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays every regular file of dir (sorted, for a repeatable order);
 * returns how many. A missing directory counts zero. */
static size_t replay_dir(const char *dir)
{
    DIR *d = opendir(dir);
    char **names = NULL;
    size_t n = 0, cap = 0, done = 0;
    struct dirent *de;
    if (!d)
        return 0;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = realloc(names, cap * sizeof(*names));
            assert_non_null(names);
        }
        names[n] = strdup(de->d_name);
        assert_non_null(names[n]);
        n++;
    }
    closedir(d);
    if (n > 1)
        qsort(names, n, sizeof(*names), cmp_str);
    for (size_t i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        assert_true(len >= 0);
        uint8_t *buf = malloc((size_t)len + 1);
        assert_non_null(buf);
        assert_int_equal(fread(buf, 1, (size_t)len, f), (size_t)len);
        fclose(f);
        if (getenv("FUZZ_REPLAY_VERBOSE"))
            fprintf(stderr, "replay %s (%ld bytes)\n", path, len);
        LLVMFuzzerTestOneInput(buf, (size_t)len); /* aborts on a broken oracle */
        free(buf);
        free(names[i]);
        done++;
    }
    free(names);
    return done;
}

static void test_replay(void **state)
{
    char dirs[] = FUZZ_DIRS;
    size_t total = 0, corpus = 0;
    int first = 1;
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        size_t k = replay_dir(d);
        printf("%s: %zu inputs from %s\n", FUZZ_TARGET, k, d);
        if (first)
            corpus = k;
        first = 0;
        total += k;
    }
    /* The seed corpus is checked in: an empty one means a broken path, and
     * a test that replays nothing cannot fail. */
    assert_true(corpus > 0);
    assert_true(total >= corpus);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_replay)};
    return cmocka_run_group_tests_name(FUZZ_TARGET, tests, NULL, NULL);
}
