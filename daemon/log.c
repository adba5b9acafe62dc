/* log: see log.h. One formatted line per call, written with a single
 * fputs under stdio's stream lock so lines from the loop and the executor
 * threads never interleave. */
#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
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

void log_msg(int level, const char *fmt, ...)
{
    char line[1024];
    size_t n;
    va_list ap;

    if (level > atomic_load(&log_level_cur))
        return;
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
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - n - 1, fmt, ap);
    va_end(ap);
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
