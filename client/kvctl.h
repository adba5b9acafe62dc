/* kvctl internals shared by its source files: global options, connecting
 * with a helpful message, mapping libkvd errors to exit codes, and parsing
 * token lists. Each command lives in the kvctl_*.c named for it. */
#ifndef KVD_KVCTL_H
#define KVD_KVCTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvd/client.h"

/* Exit codes (documented in kvctl --help and docs/client.md). */
enum {
    KVCTL_OK = 0,
    KVCTL_ESERVER = 1, /* the daemon answered with an error */
    KVCTL_EUSAGE = 2,  /* bad command line or script */
    KVCTL_ECONN = 3,   /* cannot connect, or the connection broke */
};

struct kvctl {
    const char *socket; /* NULL: libkvd's default */
    unsigned timeout_ms;
    struct kvd_ctx *ctx; /* after kvctl_connect */
};

/* Connects; on failure prints "kvctl: cannot connect to PATH: ... (is kvd
 * running? try --socket)" and returns KVCTL_ECONN. */
int kvctl_connect(struct kvctl *k);
/* Prints "kvctl: WHAT: CODE: MESSAGE" for the context's error and returns
 * the exit code it maps to (KVCTL_ECONN for KVD_EIO, else KVCTL_ESERVER). */
int kvctl_fail(struct kvctl *k, const char *what);
/* Prints "kvctl: MESSAGE" (+ newline) and returns KVCTL_EUSAGE. */
int kvctl_usage_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Parses "1,2,3" (ranges "5-9" allowed) into a malloc'd array. Returns 0 or
 * -1 with a message in err. An empty string is an empty list. */
int kvctl_parse_tokens(const char *s, uint32_t **out, size_t *n, char *err, size_t errlen);
/* Parses a whole unsigned number; false when s is not one. */
bool kvctl_parse_u64(const char *s, uint64_t *out);
/* Prints n token ids comma-separated (no newline). */
void kvctl_print_tokens(FILE *f, const uint32_t *t, size_t n, bool leading_comma);

/* Commands: argv[0] is the command's name. Return an exit code. */
int kvctl_cmd_status(struct kvctl *k, int argc, char **argv);
int kvctl_cmd_stats(struct kvctl *k, int argc, char **argv);
int kvctl_cmd_admin(struct kvctl *k, int argc, char **argv);
int kvctl_cmd_call(struct kvctl *k, int argc, char **argv);
int kvctl_cmd_seq(struct kvctl *k, int argc, char **argv);
int kvctl_cmd_generate(struct kvctl *k, int argc, char **argv);
int kvctl_cmd_chat(struct kvctl *k, int argc, char **argv);       /* kvctl_text.c */
int kvctl_cmd_tokenize(struct kvctl *k, int argc, char **argv);   /* kvctl_text.c */
int kvctl_cmd_detokenize(struct kvctl *k, int argc, char **argv); /* kvctl_text.c */
int kvctl_cmd_top(struct kvctl *k, int argc, char **argv);        /* kvctl_top.c */
int kvctl_cmd_bench(struct kvctl *k, int argc, char **argv);      /* kvctl_bench.c */

#endif
