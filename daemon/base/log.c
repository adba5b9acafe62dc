/* log: see log.h. One formatted line per call, written with a single
 * fputs under stdio's stream lock so lines from the loop and the executor
 * threads never interleave. */
#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static atomic_int log_level_cur = LOG_LVL_INFO;
static atomic_bool log_journal;

void log_init(int level)
{
    const char *js = getenv("JOURNAL_STREAM");
    atomic_store(&log_journal, js && js[0]);
    log_set_level(level);
}

void log_set_level(int level)
{
    if (level < LOG_LVL_ERR)
        level = LOG_LVL_ERR;
    if (level > LOG_LVL_DEBUG)
        level = LOG_LVL_DEBUG;
    atomic_store(&log_level_cur, level);
}

int log_get_level(void)
{
    return atomic_load(&log_level_cur);
}

static const char *const log_names[] = {"error", "warning", "notice", "info", "debug"};

int log_level_parse(const char *s)
{
    if (s[0] >= '3' && s[0] <= '7' && s[1] == '\0')
        return s[0] - '0';
    for (int i = 0; i < 5; i++)
        if (strcasecmp(s, log_names[i]) == 0)
            return LOG_LVL_ERR + i;
    if (strcasecmp(s, "err") == 0)
        return LOG_LVL_ERR;
    if (strcasecmp(s, "warn") == 0)
        return LOG_LVL_WARN;
    return -1;
}

/* Rate limiting (a client can make the daemon log on every frame or
 * accept): each call site, known by its format string, may write
 * LOG_RL_BURST lines per LOG_RL_WINDOW_S seconds; the rest are counted and
 * reported in one line when its next window opens. Debug lines are not
 * limited (they are asked for). */
#define LOG_RL_BURST 10
#define LOG_RL_WINDOW_S 10
#define LOG_RL_SITES 128

struct log_site {
    const char *fmt;
    time_t window;
    unsigned n;
    unsigned long suppressed;
};

static pthread_mutex_t log_rl_mu = PTHREAD_MUTEX_INITIALIZER;
static struct log_site log_sites[LOG_RL_SITES];
static atomic_ulong log_suppressed_total;

unsigned long log_suppressed(void)
{
    return atomic_load(&log_suppressed_total);
}

/* Whether this line may be written; *before: lines of this site suppressed
 * in its previous window (to report now). */
static bool log_rl_allow(const char *fmt, unsigned long *before)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    time_t w = ts.tv_sec / LOG_RL_WINDOW_S;
    size_t h = ((size_t)(uintptr_t)fmt >> 3) % LOG_RL_SITES;
    bool ok;
    *before = 0;
    pthread_mutex_lock(&log_rl_mu);
    /* The site's own slot among 4 probed, else the one idle longest. */
    struct log_site *s = &log_sites[h];
    for (size_t i = 0; i < 4; i++) {
        struct log_site *c = &log_sites[(h + i) % LOG_RL_SITES];
        if (c->fmt == fmt) {
            s = c;
            break;
        }
        if (c->window < s->window)
            s = c;
    }
    if (s->fmt != fmt || s->window != w) {
        if (s->fmt == fmt)
            *before = s->suppressed;
        s->fmt = fmt;
        s->window = w;
        s->n = 0;
        s->suppressed = 0;
    }
    ok = s->n < LOG_RL_BURST;
    if (ok)
        s->n++;
    else
        s->suppressed++;
    pthread_mutex_unlock(&log_rl_mu);
    if (!ok)
        atomic_fetch_add(&log_suppressed_total, 1);
    return ok;
}

static void log_write(int level, const char *fmt, va_list ap);

static void log_write_f(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log_write_f(int level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_write(level, fmt, ap);
    va_end(ap);
}

void log_msg(int level, const char *fmt, ...)
{
    va_list ap;
    unsigned long before = 0;

    if (level > atomic_load(&log_level_cur))
        return;
    if (level < LOG_LVL_DEBUG && !log_rl_allow(fmt, &before))
        return;
    if (before)
        log_write_f(level, "(%lu more lines like the next one were suppressed in the last %d s)",
                    before, LOG_RL_WINDOW_S);
    va_start(ap, fmt);
    log_write(level, fmt, ap);
    va_end(ap);
}

static void log_write(int level, const char *fmt, va_list ap)
{
    char line[1024];
    size_t n;

    if (level < LOG_LVL_ERR)
        level = LOG_LVL_ERR;
    if (level > LOG_LVL_DEBUG)
        level = LOG_LVL_DEBUG;
    if (atomic_load(&log_journal)) {
        n = (size_t)snprintf(line, sizeof(line), "<%d>", level);
    } else {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        localtime_r(&ts.tv_sec, &tm);
        n = strftime(line, sizeof(line), "%Y-%m-%dT%H:%M:%S", &tm);
        n += (size_t)snprintf(line + n, sizeof(line) - n, ".%03ld kvd %s: ", ts.tv_nsec / 1000000,
                              log_names[level - LOG_LVL_ERR]);
    }
    int m = vsnprintf(line + n, sizeof(line) - n - 1, fmt, ap);
    if (m < 0)
        m = 0;
    n += (size_t)m;
    if (n > sizeof(line) - 2)
        n = sizeof(line) - 2;
    /* One line per call: control characters from client-supplied text would
     * split or forge lines, so they become '?'. */
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)line[i] < 0x20 && line[i] != '\t')
            line[i] = '?';
    line[n++] = '\n';
    line[n] = '\0';
    fputs(line, stderr);
}
