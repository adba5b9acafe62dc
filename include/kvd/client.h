/* libkvd: the client library of the kvd KV-cache daemon. Connects to kvd's
 * Unix socket, sends msgpack requests (protocol v1, docs/protocol.md), waits for replies by
 * id, streams events, and offers one typed helper per op.
 *
 * Model: hiredis. A context carries `err` (0 or an enum kvd_err) and `errstr`
 * (a message a person can act on) describing the last call. Server errors
 * (not_found, bad_request, ...) leave the connection usable; KVD_EIO means
 * the connection is gone and every later call fails with KVD_EIO too.
 * Every object the library allocates for the caller has an explicit free.
 *
 * Threads: thread-compatible. A context belongs to one thread at a time; use
 * one context per thread. No global state, no signals (SIGPIPE is avoided).
 *
 * Pipelining: kvd_send_*() queue requests and return their ids; kvd_flush()
 * writes them; kvd_wait() returns the reply of one id, keeping replies of
 * other ids that arrive first until they are asked for. Events of a request
 * (generate's "tokens") go to the callback given when it was sent. */
#ifndef KVD_CLIENT_H
#define KVD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd/protocol.h"
#include "kvd/status.h"
#include "kvd/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVD_ERRSTR_LEN 256

/* The library exports only what this header declares. */
#if defined(__GNUC__)
#define KVD_API __attribute__((visibility("default")))
#else
#define KVD_API
#endif

struct kvd_conn; /* private: socket buffers and the table of requests in flight */

struct kvd_ctx {
    int err;                     /* status of the last call: 0 or enum kvd_err */
    char errstr[KVD_ERRSTR_LEN]; /* its message; "" when err == 0 */
    int fd;                      /* the socket; -1 when not connected */
    struct kvd_conn *conn;       /* private */
};

/* The library's version as KVD_VERSION_NUMBER (kvd/version.h) of the
 * libkvd that is loaded, to compare with the header a program was built
 * with. */
KVD_API unsigned kvd_version(void);

/* ---- connection ---------------------------------------------------------- */

/* Writes the socket path used when none is given into buf: $KVD_SOCKET;
 * else KVD_DEFAULT_SOCKET when it exists; else the non-root daemon's
 * fallback ($XDG_RUNTIME_DIR/kvd.sock, /tmp/kvd-<uid>/kvd.sock) when that
 * exists; else KVD_DEFAULT_SOCKET. A fallback socket is used only when its
 * directory is the caller's own (owned by its uid, writable by nobody
 * else) and every directory above is root's or its own and not writable
 * by others unless sticky: otherwise KVD_EPERM (kvd_connect(NULL) says
 * why). Returns 0, KVD_EPERM, or KVD_ETOOLARGE when the path does not fit
 * in cap bytes. */
KVD_API int kvd_default_socket(char *buf, size_t cap);

/* Connects to the daemon at `path` (NULL: kvd_default_socket()). Returns a
 * context, NULL only when out of memory; check ctx->err (KVD_EIO with e.g.
 * "cannot connect to /run/kvd/kvd.sock: No such file or directory"). The
 * context must be freed with kvd_close() in either case. */
KVD_API struct kvd_ctx *kvd_connect(const char *path);
/* Closes the socket (the daemon then drops this connection's sequences and
 * running requests) and frees everything the context owns, including
 * replies that were never asked for. */
KVD_API void kvd_close(struct kvd_ctx *ctx);

/* Timeout of each blocking read and write, in milliseconds (0: none, the
 * default). A timeout is KVD_EIO and closes the connection, since the
 * stream position is then unknown. */
KVD_API int kvd_set_timeout(struct kvd_ctx *ctx, unsigned ms);
/* Largest reply frame accepted, in bytes (default KVD_MAX_FRAME_LIMIT, the
 * largest --max-frame a daemon accepts). */
KVD_API void kvd_set_max_frame(struct kvd_ctx *ctx, size_t bytes);

/* Frees memory the library returned (JSON strings, kv_read buffers). */
KVD_API void kvd_free(void *p);

/* ---- values: a decoded msgpack tree, read-only for the caller ------------- */

enum kvd_type {
    KVD_T_NIL = 0,
    KVD_T_BOOL,
    KVD_T_INT,  /* negative integers */
    KVD_T_UINT, /* non-negative integers */
    KVD_T_FLOAT,
    KVD_T_STR, /* UTF-8, NUL-terminated in memory as well */
    KVD_T_BIN,
    KVD_T_ARRAY,
    KVD_T_MAP,
};

struct kvd_pair;
struct kvd_value {
    enum kvd_type type;
    union {
        bool b;
        int64_t i;
        uint64_t u;
        double f;
        struct {
            const char *ptr;
            size_t len;
        } str;
        struct {
            const void *ptr;
            size_t len;
        } bin;
        struct {
            const struct kvd_value *items;
            size_t n;
        } array;
        struct {
            const struct kvd_pair *items;
            size_t n;
        } map;
    } v;
};
struct kvd_pair {
    struct kvd_value key;
    struct kvd_value val;
};

/* The value of `key` in a map; NULL when v is not a map or has no such key. */
KVD_API const struct kvd_value *kvd_value_get(const struct kvd_value *v, const char *key);
/* Follows a dotted path of map keys ("kv.block_bytes"). */
KVD_API const struct kvd_value *kvd_value_path(const struct kvd_value *v, const char *path);
/* Typed reads: 0 and *out set, or KVD_ENOTFOUND (no value) / KVD_EBADREQ
 * (wrong type or out of range). Integers convert between INT and UINT when
 * the value fits; kvd_value_f64 also accepts integers. */
KVD_API int kvd_value_u64(const struct kvd_value *v, uint64_t *out);
KVD_API int kvd_value_i64(const struct kvd_value *v, int64_t *out);
KVD_API int kvd_value_f64(const struct kvd_value *v, double *out);
/* The string of a STR value (NUL-terminated), or NULL. */
KVD_API const char *kvd_value_str(const struct kvd_value *v);
/* The value as one line of JSON (bin becomes a hex string); kvd_free() it.
 * NULL when out of memory. */
KVD_API char *kvd_value_json(const struct kvd_value *v);

/* ---- replies ------------------------------------------------------------- */

struct kvd_reply {
    uint64_t id;
    int err;                      /* 0 for "ok": true, else the code's enum kvd_err */
    const char *code;             /* error code string ("not_found"), NULL when ok */
    const char *message;          /* error message, NULL when ok */
    const struct kvd_value *body; /* the whole reply map (id, ok, results...) */
};
KVD_API void kvd_reply_free(struct kvd_reply *r);

/* ---- generic requests (the escape hatch) ---------------------------------- */

/* One request argument. Build them with the KVD_ARG_* macros; `key` may be
 * any string (unknown keys are ignored by the daemon), and any type may be
 * given for any key, so tests can send odd requests. */
enum kvd_arg_type {
    KVD_ARG_NIL = 0,
    KVD_ARG_BOOL,
    KVD_ARG_INT,
    KVD_ARG_UINT,
    KVD_ARG_FLOAT,
    KVD_ARG_STR,
    KVD_ARG_BIN,
    KVD_ARG_U32S, /* array of uint32 (token ids) */
    KVD_ARG_RAW,  /* v.bin: one msgpack object, already packed, sent as is */
};
struct kvd_arg {
    const char *key;
    enum kvd_arg_type type;
    union {
        bool b;
        int64_t i;
        uint64_t u;
        double f;
        const char *s;
        struct {
            const void *ptr;
            size_t len;
        } bin;
        struct {
            const uint32_t *ptr;
            size_t n;
        } u32s;
    } v;
};
#define KVD_ARG_NIL_(k) ((struct kvd_arg){.key = (k), .type = KVD_ARG_NIL})
#define KVD_ARG_B(k, x) ((struct kvd_arg){.key = (k), .type = KVD_ARG_BOOL, .v.b = (x)})
#define KVD_ARG_I(k, x) ((struct kvd_arg){.key = (k), .type = KVD_ARG_INT, .v.i = (x)})
#define KVD_ARG_U(k, x) ((struct kvd_arg){.key = (k), .type = KVD_ARG_UINT, .v.u = (x)})
#define KVD_ARG_F(k, x) ((struct kvd_arg){.key = (k), .type = KVD_ARG_FLOAT, .v.f = (x)})
#define KVD_ARG_S(k, x) ((struct kvd_arg){.key = (k), .type = KVD_ARG_STR, .v.s = (x)})
#define KVD_ARG_BIN(k, p, n)                                                                       \
    ((struct kvd_arg){.key = (k), .type = KVD_ARG_BIN, .v.bin = {(p), (n)}})
#define KVD_ARG_U32S(k, p, n)                                                                      \
    ((struct kvd_arg){.key = (k), .type = KVD_ARG_U32S, .v.u32s = {(p), (n)}})
#define KVD_ARG_RAW(k, p, n)                                                                       \
    ((struct kvd_arg){.key = (k), .type = KVD_ARG_RAW, .v.bin = {(p), (n)}})

/* Called for each event ({"id", "event", ...}) of a request, in order, from
 * inside whichever kvd_wait()/kvd_poll() reads it. Return 0 to go on, or
 * non-zero to send a cancel for the request. The callback must not call
 * libkvd on the same context. */
typedef int (*kvd_event_fn)(struct kvd_ctx *ctx, uint64_t id, const struct kvd_value *event,
                            void *user);

/* Queues {"op": op, "id": <new id>, args...}; op NULL sends no "op" key (put
 * one in args to send a non-string op). The request is written by the next
 * kvd_flush() / kvd_wait() / kvd_call(), or earlier when the queue is big.
 * *id (may be NULL) gets the id. */
KVD_API int kvd_send(struct kvd_ctx *ctx, const char *op, const struct kvd_arg *args, size_t n_args,
                     kvd_event_fn on_event, void *user, uint64_t *id);
/* Queues one frame whose payload is `len` raw bytes (not checked: tests
 * use it to send malformed frames). */
KVD_API int kvd_send_frame(struct kvd_ctx *ctx, const void *payload, size_t len);
/* Writes everything queued. */
KVD_API int kvd_flush(struct kvd_ctx *ctx);
/* Flushes, then blocks until the reply of `id` arrives, dispatching events
 * and keeping other replies for later. *out gets the reply (free it) whether
 * the daemon said ok or not; the return value and ctx->err are the reply's
 * error (or KVD_EIO, with *out NULL). */
KVD_API int kvd_wait(struct kvd_ctx *ctx, uint64_t id, struct kvd_reply **out);
/* kvd_wait() that never waits: reads what the socket holds now (flushing
 * first; that write may block while the daemon's buffer is full) and
 * returns KVD_EBUSY, leaving ctx->err alone, when the reply has not come
 * yet. For event loops: poll ctx->fd for POLLIN, then call this. */
KVD_API int kvd_try_wait(struct kvd_ctx *ctx, uint64_t id, struct kvd_reply **out);
/* Flushes, then returns the oldest reply not yet asked for, of any id
 * (including id 0, the daemon's answer to a frame it could not read), waiting
 * for one if none is kept. Returns like kvd_wait(). */
KVD_API int kvd_poll(struct kvd_ctx *ctx, struct kvd_reply **out);
/* Number of requests sent whose reply has not been returned yet. */
KVD_API size_t kvd_pending(const struct kvd_ctx *ctx);
/* kvd_send() + kvd_wait(). */
KVD_API int kvd_call(struct kvd_ctx *ctx, const char *op, const struct kvd_arg *args, size_t n_args,
                     struct kvd_reply **out);

/* ---- typed helpers: one per op -------------------------------------------- */
/* Each returns 0 or an enum kvd_err (also in ctx->err / ctx->errstr). */

struct kvd_hello_info {
    char server[64];  /* e.g. "kvd 0.2.0" */
    uint32_t version; /* protocol version */
    char tenant[64];
    char backend[16]; /* "cuda" / "cpu" */
    uint32_t block_tokens;
    uint32_t layers, kv_heads, head_dim;
    char dtype[8]; /* "f16", "bf16", "f32" */
    uint64_t block_bytes;
    uint64_t token_bytes; /* block_bytes / block_tokens: kv_write/kv_read bytes per token */
    bool has_model;       /* false in store mode */
    char model[128];
    uint32_t vocab, context;
    /* The model's text side: tokenizer[0] == 0 when the daemon serves it in
     * token-only mode (no text, messages or stop strings). */
    char tokenizer[16];    /* "llama" (SentencePiece) or "gpt2" (byte-level BPE) */
    bool has_bos, has_eos; /* whether bos / eos are set */
    uint32_t bos, eos;
    uint32_t eog[16]; /* end-of-generation ids (generation stops there) */
    size_t n_eog;
    bool has_chat_template; /* `messages` (kvd_chat) can be used */
};
KVD_API int kvd_hello(struct kvd_ctx *ctx, struct kvd_hello_info *out);

/* The whole stats reply as one line of JSON (kvd_free() it) ... */
KVD_API int kvd_stats_json(struct kvd_ctx *ctx, char **json);
/* ... or the main counters as a struct (fields the daemon does not send
 * stay 0) ... */
struct kvd_stats_summary {
    uint64_t device_total, device_free, device_cached, device_used; /* blocks */
    uint64_t host_total, host_free, host_cached, host_used;         /* blocks */
    uint64_t match_tokens_asked, match_tokens_hit;                  /* prefix-cache lookups */
    uint64_t swaps_out, swaps_in, evictions;
    uint64_t connections, in_flight;
};
KVD_API int kvd_stats_summary(struct kvd_ctx *ctx, struct kvd_stats_summary *out);
/* ... or as the reply tree, for programs (kvd_reply_free() it). */
KVD_API int kvd_stats(struct kvd_ctx *ctx, struct kvd_reply **out);

/* Block lists (kvd_blocks_free() them). tier: 0 device, 1 host, -1 unknown. */
struct kvd_blocks {
    uint32_t *ids;
    int8_t *tiers; /* NULL when the reply gives no tiers */
    size_t n;
};
KVD_API void kvd_blocks_free(struct kvd_blocks *b);

/* ns: the radix namespace to share prefixes in; NULL for the tenant's own. */
KVD_API int kvd_seq_open(struct kvd_ctx *ctx, const char *ns, uint64_t *seq);
/* *matched = tokens reused from cache; blocks (may be NULL) gets their ids. */
KVD_API int kvd_seq_match(struct kvd_ctx *ctx, uint64_t seq, const uint32_t *tokens, size_t n,
                          size_t *matched, struct kvd_blocks *blocks);
/* Grows the sequence by n token slots; blocks (may be NULL) gets the new ones. */
KVD_API int kvd_seq_extend(struct kvd_ctx *ctx, uint64_t seq, size_t n, struct kvd_blocks *blocks);
/* K/V bytes of tokens [start, start+n): len = n * token_bytes (kvd_hello). */
KVD_API int kvd_kv_write(struct kvd_ctx *ctx, uint64_t seq, size_t start, size_t n,
                         const void *data, size_t len);
/* Reads into buf (cap bytes); *len = bytes the daemon sent. KVD_ETOOLARGE
 * (connection kept) when cap is too small. */
KVD_API int kvd_kv_read(struct kvd_ctx *ctx, uint64_t seq, size_t start, size_t n, void *buf,
                        size_t cap, size_t *len);
/* Records the token ids of the next positions; *shared (may be NULL) = the
 * sequence's blocks now in the radix tree. */
KVD_API int kvd_seq_commit(struct kvd_ctx *ctx, uint64_t seq, const uint32_t *tokens, size_t n,
                           size_t *shared);
KVD_API int kvd_seq_fork(struct kvd_ctx *ctx, uint64_t seq, uint64_t *child);

/* Zero-copy export (kv_export): the blocks of tokens [from_token,
 * from_token + n_tokens) (n_tokens 0: to the end), without a copy. Each
 * page comes as a descriptor (maps[]): a memfd (kind KVD_EXPORT_MEMFD:
 * host memory, the cpu backend's pools and the cuda backend's host tier),
 * which libkvd maps into this process, so blocks[i].data is block
 * from_block + i of the sequence, block_bytes in the section-6 block
 * layout (the bytes kv_read returns for that block's tokens when it is
 * full); or the POSIX descriptor of a CUDA VMM allocation (kind
 * KVD_EXPORT_CUDA_VMM: a cuda device page), which libkvd does not touch:
 * the caller imports it (cuMemImportFromShareableHandle with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), maps its len bytes into a
 * range of its own (cuMemAddressReserve, cuMemMap, cuMemSetAccess) and
 * finds block i at blocks[i].offset there (blocks[i].data is NULL). Such a
 * handle grants writes to whoever imports it; kvd hands one out only for
 * the tenant's own pages. Writable blocks (asked with writable, the
 * caller's own uncommitted blocks only) may be filled in place and
 * committed with kvd_seq_commit. The daemon keeps the pages for this
 * process until kvd_kv_export_release (or the connection closes); the
 * views stay mapped until then. */
enum kvd_export_kind { KVD_EXPORT_MEMFD = 0, KVD_EXPORT_CUDA_VMM = 1 };
struct kvd_export_block {
    void *data; /* NULL for a KVD_EXPORT_CUDA_VMM page */
    size_t bytes;
    bool writable;
    unsigned fd;     /* index into maps */
    uint64_t offset; /* bytes into that page */
};
struct kvd_export_map {
    int fd;     /* the page's descriptor (open until release): O_RDONLY unless writable */
    void *addr; /* the memfd mapped here; NULL for KVD_EXPORT_CUDA_VMM */
    size_t len; /* bytes of the page */
    bool writable;
    enum kvd_export_kind kind;
};
struct kvd_export {
    uint64_t id;
    size_t from_block;
    size_t n_blocks;
    struct kvd_export_block *blocks;
    size_t n_maps;
    struct kvd_export_map *maps;
};
KVD_API int kvd_kv_export(struct kvd_ctx *ctx, uint64_t seq, size_t from_token, size_t n_tokens,
                          bool writable, struct kvd_export **out);
/* Tells the daemon (kv_export_release), unmaps and frees ex (NULL: nothing).
 * The views are gone afterwards whether the daemon answered or not. */
KVD_API int kvd_kv_export_release(struct kvd_ctx *ctx, struct kvd_export *ex);

struct kvd_seq_info {
    uint64_t n_tokens;
    uint64_t n_committed; /* 0 when the daemon does not say */
    uint64_t n_shared;    /* blocks in the radix tree; 0 when not said */
    struct kvd_blocks blocks;
};
KVD_API int kvd_seq_info(struct kvd_ctx *ctx, uint64_t seq, struct kvd_seq_info *out);
KVD_API void kvd_seq_info_free(struct kvd_seq_info *info);
KVD_API int kvd_seq_offload(struct kvd_ctx *ctx, uint64_t seq);
KVD_API int kvd_seq_restore(struct kvd_ctx *ctx, uint64_t seq);
KVD_API int kvd_seq_close(struct kvd_ctx *ctx, uint64_t seq);

/* Streaming callback of generate: the tokens of one "tokens" event. Return
 * non-zero to cancel the request (its reply then says "cancelled"). */
typedef int (*kvd_tokens_fn)(void *user, const uint32_t *tokens, size_t n);
/* Streaming callback with text: the event's tokens (n may be 0) and the
 * completion's new text (len bytes, NUL-terminated, whole UTF-8
 * characters; the pieces add up to the reply's text). */
typedef int (*kvd_text_fn)(void *user, const uint32_t *tokens, size_t n, const char *text,
                           size_t len);

struct kvd_gen_opts {
    uint32_t max_tokens; /* 0: the daemon's default */
    float temperature;   /* < 0: the daemon's default; 0: greedy */
    int32_t top_k;       /* < 0: default; 0: off */
    float top_p;         /* < 0: default */
    uint64_t seed;       /* sent when has_seed */
    bool has_seed;
    const uint32_t *stop; /* stop token ids, n_stop of them */
    size_t n_stop;
    int32_t priority;        /* sent when non-zero; higher runs first */
    uint64_t seq;            /* generate from this open sequence when use_seq; */
    bool use_seq;            /*   tokens are then appended to it */
    kvd_tokens_fn on_tokens; /* non-NULL: stream, calling this per event */
    void *user;
    /* Text (the model's tokenizer is needed; `unsupported` otherwise): */
    const char *const *stop_strs; /* stop strings: the text ends before the first */
    size_t n_stop_strs;
    bool ignore_eos;     /* do not stop at the model's end-of-generation tokens */
    kvd_text_fn on_text; /* non-NULL: stream, calling this per event (with on_tokens: both) */
    /* A named session (the daemon needs a disk tier; not with use_seq):
     * tokens and text continue its conversation (a NULL tokens prompt:
     * generate after it), messages are the whole conversation; the grown
     * conversation is saved under the name, kept session_ttl_s (0: the
     * daemon's default, a week). The result says what was saved. */
    const char *session;
    uint32_t session_ttl_s;
};
/* Sets every option to "the daemon's default", no streaming. */
KVD_API void kvd_gen_opts_init(struct kvd_gen_opts *o);

struct kvd_gen_result {
    uint32_t *tokens; /* every generated token */
    size_t n_tokens;
    char finish_reason[16];                                   /* "length", "stop", "cancelled" */
    uint32_t prompt_tokens, cached_tokens, completion_tokens; /* usage */
    double queue_ms, ttft_ms, total_ms;                       /* timing */
    char *text; /* the completion as text (NUL-terminated); NULL in token-only mode */
    size_t text_len;
    /* With opts->session: 1 when the conversation was saved (session_tokens
     * of it, until session_expires, unix seconds), 0 when not (the reason
     * in session_error); -1 without a session. */
    int session_saved;
    uint32_t session_tokens;
    uint64_t session_expires;
    char session_error[256];
};
KVD_API void kvd_gen_result_free(struct kvd_gen_result *r);

KVD_API int kvd_generate(struct kvd_ctx *ctx, const uint32_t *tokens, size_t n,
                         const struct kvd_gen_opts *opts, struct kvd_gen_result *out);
/* Asynchronous form: send now (opts, including its callback and user, must
 * stay valid until the wait), collect later; kvd_cancel(ctx, id) in between
 * stops it. */
KVD_API int kvd_generate_send(struct kvd_ctx *ctx, const uint32_t *tokens, size_t n,
                              const struct kvd_gen_opts *opts, uint64_t *id);
KVD_API int kvd_generate_wait(struct kvd_ctx *ctx, uint64_t id, struct kvd_gen_result *out);
/* The same with a text prompt, tokenized by the daemon with the model's
 * tokenizer and BOS rule (no BOS when it continues a non-empty opts->seq). */
KVD_API int kvd_generate_text(struct kvd_ctx *ctx, const char *text,
                              const struct kvd_gen_opts *opts, struct kvd_gen_result *out);
KVD_API int kvd_generate_text_send(struct kvd_ctx *ctx, const char *text,
                                   const struct kvd_gen_opts *opts, uint64_t *id);
/* A conversation, rendered by the daemon with the model's chat template
 * (the assistant's turn opened). With opts->use_seq the messages are the
 * whole conversation: the sequence keeps the longest common prefix of its
 * tokens and the rendered prompt's, and gets the rest, so each turn of a
 * chat computes only its new tokens. */
struct kvd_chat_msg {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
};
KVD_API int kvd_chat(struct kvd_ctx *ctx, const struct kvd_chat_msg *msgs, size_t n,
                     const struct kvd_gen_opts *opts, struct kvd_gen_result *out);
KVD_API int kvd_chat_send(struct kvd_ctx *ctx, const struct kvd_chat_msg *msgs, size_t n,
                          const struct kvd_gen_opts *opts, uint64_t *id);
/* Token ids of text (special: parse special-token text such as <|eot_id|>;
 * add_bos < 0: the model's rule). *tokens is malloc'd. */
KVD_API int kvd_tokenize(struct kvd_ctx *ctx, const char *text, bool special, int add_bos,
                         uint32_t **tokens, size_t *n);
/* The text of token ids (special: control tokens as their text). *text is
 * malloc'd, NUL-terminated. */
KVD_API int kvd_detokenize(struct kvd_ctx *ctx, const uint32_t *tokens, size_t n, bool special,
                           char **text);

/* Cancels the earlier request `target` of this connection. */
KVD_API int kvd_cancel(struct kvd_ctx *ctx, uint64_t target);

/* Admin ops (the daemon checks the caller is an admin: permission_denied
 * otherwise). When out is non-NULL it gets the reply tree, also when the
 * daemon said no (admin_check's findings); kvd_reply_free() it. */
/* Evicts up to n cached, unreferenced blocks (0: as many as there are) of
 * tier "device" or "host" (NULL: "device"); the reply says "evicted". */
KVD_API int kvd_admin_evict(struct kvd_ctx *ctx, const char *tier, uint64_t n,
                            struct kvd_reply **out);
/* Runs the daemon's consistency check of the memory manager. */
KVD_API int kvd_admin_check(struct kvd_ctx *ctx, struct kvd_reply **out);
/* Asks the daemon to exit cleanly. */
KVD_API int kvd_admin_shutdown(struct kvd_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif
