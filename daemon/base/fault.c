/* fault: the fault-injection rules behind fault_should_fail() (fault.h).
 * Built only with KVD_FAULT_INJECTION; otherwise this file is empty and the
 * header's inline constant-false version is used. */
#include "fault.h"

#if FAULT_ENABLED

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

struct fault_rule {
    _Atomic int mode;          /* enum fault_mode */
    _Atomic uint64_t n;        /* the mode's parameter */
    _Atomic uint64_t calls;    /* calls seen since the rule was set */
    _Atomic uint64_t injected; /* failures returned */
};

static struct fault_rule rules[FAULT_POINT_COUNT];
static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static _Atomic uint64_t prob_state = 0x9e3779b97f4a7c15ull;

static const char *const point_names[FAULT_POINT_COUNT] = {"device",   "host",      "copy",
                                                           "alloc",    "diskwrite", "disknospc",
                                                           "disktorn", "diskfsync", "diskread"};

static int parse_spec(const char *spec);

const char *fault_point_name(enum fault_point p)
{
    return (unsigned)p < FAULT_POINT_COUNT ? point_names[p] : "?";
}

static void load_env(void)
{
    const char *seed = getenv("KVD_FAULTS_SEED");
    if (seed && *seed)
        atomic_store(&prob_state, strtoull(seed, NULL, 0) | 1);
    const char *spec = getenv("KVD_FAULTS");
    if (spec && *spec && parse_spec(spec) != 0)
        fprintf(stderr,
                "kvd: KVD_FAULTS='%s' is malformed (want point:mode=n,... with point "
                "device|host|copy|alloc|diskwrite|disknospc|disktorn|diskfsync|diskread and mode "
                "every|after|nth|prob); ignored\n",
                spec);
}

/* The rule change itself (load_env uses it from inside the once). */
static void rule_set(enum fault_point p, enum fault_mode mode, uint64_t n)
{
    if ((unsigned)p >= FAULT_POINT_COUNT)
        return;
    atomic_store(&rules[p].mode, FAULT_OFF);
    atomic_store(&rules[p].n, n);
    atomic_store(&rules[p].calls, 0);
    atomic_store(&rules[p].injected, 0);
    atomic_store(&rules[p].mode, (int)mode);
}

void fault_set(enum fault_point p, enum fault_mode mode, uint64_t n)
{
    pthread_once(&env_once, load_env); /* a later env load must not undo this */
    rule_set(p, mode, n);
}

void fault_reset(void)
{
    for (int p = 0; p < FAULT_POINT_COUNT; p++)
        fault_set((enum fault_point)p, FAULT_OFF, 0);
}

/* One "point:mode=n" item of len bytes. */
static int parse_item(const char *s, size_t len, int *point, int *mode, uint64_t *n)
{
    static const char *const modes[] = {"off", "every", "after", "nth", "prob"};
    const char *colon = memchr(s, ':', len), *eq = memchr(s, '=', len);
    *point = -1;
    *mode = -1;
    if (!colon || !eq || eq < colon)
        return -1;
    for (int p = 0; p < FAULT_POINT_COUNT; p++)
        if ((size_t)(colon - s) == strlen(point_names[p]) &&
            !memcmp(s, point_names[p], (size_t)(colon - s)))
            *point = p;
    for (int m = 0; m < (int)(sizeof(modes) / sizeof(modes[0])); m++)
        if ((size_t)(eq - colon - 1) == strlen(modes[m]) &&
            !memcmp(colon + 1, modes[m], (size_t)(eq - colon - 1)))
            *mode = m;
    if (*point < 0 || *mode < 0 || eq + 1 >= s + len)
        return -1;
    uint64_t v = 0;
    for (const char *q = eq + 1; q < s + len; q++) {
        if (*q < '0' || *q > '9' || v > UINT64_MAX / 10 - 1)
            return -1;
        v = v * 10 + (uint64_t)(*q - '0');
    }
    if ((*mode == FAULT_EVERY || *mode == FAULT_NTH) && v == 0)
        return -1;
    *n = v;
    return 0;
}

static int parse_spec(const char *spec)
{
    int point[FAULT_POINT_COUNT * 4], mode[FAULT_POINT_COUNT * 4];
    uint64_t n[FAULT_POINT_COUNT * 4];
    size_t k = 0;
    /* Validate everything first so a bad spec changes nothing. */
    for (const char *s = spec; *s;) {
        const char *end = strchr(s, ',');
        size_t len = end ? (size_t)(end - s) : strlen(s);
        if (k == sizeof(point) / sizeof(point[0]) || parse_item(s, len, &point[k], &mode[k], &n[k]))
            return -1;
        k++;
        s += len + (end ? 1 : 0);
    }
    for (size_t i = 0; i < k; i++)
        rule_set((enum fault_point)point[i], (enum fault_mode)mode[i], n[i]);
    return 0;
}

int fault_parse(const char *spec)
{
    pthread_once(&env_once, load_env);
    return parse_spec(spec);
}

/* splitmix64 over a shared atomic state: repeatable for one seed and one
 * call order. */
static uint64_t prob_next(void)
{
    uint64_t z = atomic_fetch_add(&prob_state, 0x9e3779b97f4a7c15ull) + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

bool fault_should_fail(enum fault_point p)
{
    pthread_once(&env_once, load_env);
    if ((unsigned)p >= FAULT_POINT_COUNT)
        return false;
    struct fault_rule *r = &rules[p];
    int mode = atomic_load(&r->mode);
    if (mode == FAULT_OFF)
        return false;
    uint64_t call = atomic_fetch_add(&r->calls, 1) + 1, n = atomic_load(&r->n);
    bool fail = false;
    switch (mode) {
    case FAULT_EVERY:
        fail = call % n == 0;
        break;
    case FAULT_AFTER:
        fail = call > n;
        break;
    case FAULT_NTH:
        fail = call == n;
        break;
    case FAULT_PROB:
        fail = prob_next() % 1000 < n;
        break;
    }
    if (fail)
        atomic_fetch_add(&r->injected, 1);
    return fail;
}

uint64_t fault_calls(enum fault_point p)
{
    return (unsigned)p < FAULT_POINT_COUNT ? atomic_load(&rules[p].calls) : 0;
}

uint64_t fault_injected(enum fault_point p)
{
    return (unsigned)p < FAULT_POINT_COUNT ? atomic_load(&rules[p].injected) : 0;
}

#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int fault_disabled_t;
#endif
