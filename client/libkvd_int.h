/* libkvd internals shared by its source files: the private connection state,
 * decoded replies (one frame + the value tree built over it) and the value
 * tree converter. Nothing here is part of the public API (kvd/client.h). */
#ifndef KVD_LIBKVD_INT_H
#define KVD_LIBKVD_INT_H

#include <msgpack.h>
#include <stdarg.h>

#include "kvd/client.h"
#include "proto.h"

/* A reply as the library keeps it: one allocation holding this struct, the
 * kvd_value nodes (one per msgpack object) and then the frame's payload (STR
 * and BIN values point into it, so kv_read data is not copied twice). */
struct kvd_reply_impl {
    struct kvd_reply pub; /* first: a kvd_reply * is a kvd_reply_impl * */
    char *frame;          /* payload: frame_len bytes + a spare NUL, after the nodes */
    size_t frame_len;
    bool is_event; /* {"id", "event", ...} rather than a reply */
    int *fds;      /* (n_fds) descriptors that came with it (kv_export) */
    size_t n_fds;
    struct kvd_reply_impl *prev, *next; /* kept-replies FIFO, oldest first */
};

/* Decodes one frame payload (copied) into a reply or event. Returns 0,
 * KVD_ENOMEM, or KVD_EBADREQ with a message in errbuf when the bytes are
 * not one msgpack map with an integer "id". */
int kvd_reply_decode(const char *src, size_t len, struct kvd_reply_impl **out, char *errbuf,
                     size_t errlen);

/* Sets ctx->err / ctx->errstr; returns err. */
int kvd_set_err(struct kvd_ctx *ctx, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Clears ctx->err unless the connection is dead (KVD_EIO stays). */
void kvd_clear_err(struct kvd_ctx *ctx);
/* Copies a failed reply's code and message into ctx and returns its error. */
int kvd_err_from_reply(struct kvd_ctx *ctx, const struct kvd_reply *r);

/* Reply fields a typed helper needs; each sets a bad-reply error in ctx
 * (KVD_EINTERNAL: the daemon broke the protocol) when missing or mistyped. */
int kvd_reply_u64(struct kvd_ctx *ctx, const struct kvd_reply *r, const char *key, uint64_t *out);
int kvd_reply_blocks(struct kvd_ctx *ctx, const struct kvd_value *arr, struct kvd_blocks *out);

#endif
