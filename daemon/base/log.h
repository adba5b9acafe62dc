/* log: leveled logging to stderr for a daemon run in the foreground. Under
 * systemd (JOURNAL_STREAM set) lines carry sd-daemon "<N>" priority prefixes
 * so journald keeps the level; otherwise a timestamp and a level word. */
#ifndef KVD_LOG_H
#define KVD_LOG_H

/* syslog priorities: lower is more severe. */
enum log_level {
    LOG_LVL_ERR = 3,
    LOG_LVL_WARN = 4,
    LOG_LVL_NOTICE = 5,
    LOG_LVL_INFO = 6,
    LOG_LVL_DEBUG = 7,
};

/* Sets the most verbose level printed and detects journald. */
void log_init(int level);
void log_set_level(int level);
int log_get_level(void);
/* "error", "warning", "notice", "info", "debug" (or 3..7) → level; -1 if unknown. */
int log_level_parse(const char *s);

/* Thread-safe: each call writes one whole line. Lines above debug are
 * rate-limited per call site (its format string): 10 per 10 s, then one
 * line saying how many were suppressed. */
void log_msg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Lines suppressed by the rate limit since start. */
unsigned long log_suppressed(void);

#define log_err(...) log_msg(LOG_LVL_ERR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_LVL_WARN, __VA_ARGS__)
#define log_notice(...) log_msg(LOG_LVL_NOTICE, __VA_ARGS__)
#define log_info(...) log_msg(LOG_LVL_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_LVL_DEBUG, __VA_ARGS__)

#endif
