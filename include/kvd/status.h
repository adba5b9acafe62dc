/* kvd status codes: the error codes of the wire protocol (protocol v1, docs/protocol.md),
 * shared by the daemon, libkvd and kvctl. Functions return 0 (KVD_OK) or one
 * of these; programs branch on the code, people read the message. */
#ifndef KVD_STATUS_H
#define KVD_STATUS_H

#include <stdarg.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kvd_err {
    KVD_OK = 0,
    KVD_EBADREQ,      /* "bad_request": malformed or invalid arguments */
    KVD_EUNKNOWN_OP,  /* "unknown_op" */
    KVD_ETOOLARGE,    /* "too_large": frame or array over a limit */
    KVD_ENOTFOUND,    /* "not_found": unknown handle / id */
    KVD_ENOMEM,       /* "no_memory": pool exhausted after eviction */
    KVD_EQUOTA,       /* "quota_exceeded": the tenant's quota */
    KVD_EPERM,        /* "permission_denied" */
    KVD_EBUSY,        /* "busy" */
    KVD_ECANCELLED,   /* "cancelled" */
    KVD_EUNSUPPORTED, /* "unsupported" */
    KVD_EINTERNAL,    /* "internal" */
    KVD_EIO,          /* client side only: connection or I/O failure ("io") */
    KVD_ERR_COUNT
};

/* The protocol's string for a code ("bad_request", ...); "internal" for
 * anything out of range. */
static inline const char *kvd_err_code(int err)
{
    static const char *const codes[KVD_ERR_COUNT] = {
        "ok",        "bad_request", "unknown_op",     "too_large",
        "not_found", "no_memory",   "quota_exceeded", "permission_denied",
        "busy",      "cancelled",   "unsupported",    "internal",
        "io",
    };
    if (err < 0 || err >= KVD_ERR_COUNT)
        return "internal";
    return codes[err];
}

/* The code for a protocol string; KVD_EINTERNAL for an unknown one. */
static inline int kvd_err_from_code(const char *code)
{
    for (int i = 0; i < KVD_ERR_COUNT; i++)
        if (code && __builtin_strcmp(code, kvd_err_code(i)) == 0)
            return i;
    return KVD_EINTERNAL;
}

/* One error value, from where a failure is found to the two edges that
 * turn it into bytes (the msgpack error frame, the HTTP API's error body):
 * a code, the request field it is about ("" when none: the HTTP API names
 * it as the OpenAI `param`) and a message for people. */
#define KVD_ERROR_PARAM_MAX 128 /* room for a JSON Schema keyword's path */
#define KVD_ERROR_MSG_MAX 256
struct kvd_error {
    int code; /* enum kvd_err */
    char param[KVD_ERROR_PARAM_MAX];
    char message[KVD_ERROR_MSG_MAX];
};

/* Sets e (when non-NULL: code, message, no param) and returns code. */
__attribute__((format(printf, 3, 4))) static inline int kvd_error_set(struct kvd_error *e, int code,
                                                                      const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        e->code = code;
        e->param[0] = '\0';
        vsnprintf(e->message, sizeof(e->message), fmt, ap);
        va_end(ap);
    }
    return code;
}

/* Names the request field e is about; returns e's code. */
static inline int kvd_error_param(struct kvd_error *e, const char *param)
{
    if (!e)
        return 0;
    snprintf(e->param, sizeof(e->param), "%s", param ? param : "");
    return e->code;
}

/* Empties e (no error). */
static inline void kvd_error_clear(struct kvd_error *e)
{
    e->code = 0;
    e->param[0] = '\0';
    e->message[0] = '\0';
}

#ifdef __cplusplus
}
#endif
#endif
