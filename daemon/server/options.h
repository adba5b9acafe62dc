/* options: the daemon's settings from the command line and the config
 * file's [server] section. Both go through options_set() with the same key
 * names (--device-blocks on the command line is device-blocks in the file),
 * so every setting is validated in one place. */
#ifndef KVD_OPTIONS_H
#define KVD_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvd/status.h"
#include "kvmm.h"

enum options_backend { OPTIONS_BACKEND_AUTO, OPTIONS_BACKEND_CPU, OPTIONS_BACKEND_CUDA };
/* --evict-policy: how cached KV blocks are chosen for eviction (kvmm.h,
 * enum kvmm_evict_policy): LRU plus hits and tenant weights (the default),
 * or plain LRU. */
enum options_evict { OPTIONS_EVICT_HITS, OPTIONS_EVICT_LRU };
/* --speculative: the daemon's speculative decoding (exec/spec.h) for
 * requests that do not choose. */
enum options_spec { OPTIONS_SPEC_OFF, OPTIONS_SPEC_NGRAM, OPTIONS_SPEC_DRAFT };
/* --overlap: exec_conf.overlap's choices, in its order. */
enum options_overlap { OPTIONS_OVERLAP_AUTO, OPTIONS_OVERLAP_ON, OPTIONS_OVERLAP_OFF };

/* A model of the daemon by name: `--model NAME=PATH` or a [model:NAME]
 * section of the config file (docs/operations.md "Several models"). */
#define OPTIONS_MAX_MODELS 16
#define OPTIONS_MODEL_NAME 64           /* bytes of a model's name at most */
#define OPTIONS_KEEP_FOREVER UINT32_MAX /* keep-alive-s forever: never unloaded for idleness */
struct options_model {
    char name[OPTIONS_MODEL_NAME + 1];
    char path[4096];
    int kv_dtype;              /* enum kv_dtype, or -1: the daemon's kv-dtype */
    uint32_t keep_alive_s;     /* idle seconds before it unloads; UINT32_MAX - 1: the
                                  daemon's keep-alive-s; OPTIONS_KEEP_FOREVER: never */
    bool preload;              /* loaded at start, not at its first request */
    char tenants[1024];        /* the tenants that may use it, comma or space separated;
                                  "": every tenant */
    uint64_t max_device_bytes; /* its weights + KV pages on the device; 0: no cap of its own */
    /* Speculative decoding's draft: another model of the daemon by name
     * (same vocabulary); "": none. */
    char draft[OPTIONS_MODEL_NAME + 1];
    int speculative; /* enum options_spec for its requests that do not choose; -1: the daemon's */
    /* Its own KV events stream (docs/operations.md "KV events for routers"):
     * the PUB and replay endpoints ("": the [server] ones for the first
     * model, none for the others) and the topic (kv_events_topic_set
     * false: the [server] kv-events-topic, "{model}" in either replaced by
     * its name). */
    char kv_events[256], kv_events_replay[256], kv_events_topic[256];
    bool kv_events_topic_set;
};
#define OPTIONS_KEEP_DEFAULT (UINT32_MAX - 1)

struct options {
    char socket_path[108]; /* empty: the default rule (KVD_DEFAULT_SOCKET or fallback) */
    char socket_group[64]; /* empty: the daemon's own group */
    char config_path[4096];
    char model_path[4096]; /* --model PATH (named after its file); empty: none */
    /* --model NAME=PATH and [model:NAME] sections, in the order given; with
     * model_path, it is served first. None of either: store mode. */
    struct options_model models[OPTIONS_MAX_MODELS];
    uint32_t n_models;
    uint64_t device_bytes;         /* the device page budget: the loaded models' weights and
                                      every model's KV pages; 0: from the block options */
    uint32_t keep_alive_s;         /* a model's idle seconds before it unloads, unless it says */
    char chat_template_path[4096]; /* empty: the model's own (tokenizer.chat_template) */
    enum options_backend backend;
    uint32_t device_blocks; /* 0: derived from gpu_mem, else the default */
    double gpu_mem;         /* fraction of device memory in (0, 1]; 0: unset */
    uint32_t host_blocks;   /* UINT32_MAX: derived from host_mem, else the default */
    uint64_t host_mem;      /* bytes; 0: unset */
    uint64_t page_bytes;    /* the budget's page; 0: the default (pages.h) */
    enum options_evict evict_policy;
    struct kv_geom geom; /* store-mode geometry and block_tokens */
    uint32_t max_frame;  /* bytes */
    uint32_t max_conns;
    /* Against hostile clients: connections per uid, connection slots only
     * admins may take, and generates queued (taken, not yet answered) per
     * connection and per tenant before `busy`. */
    uint32_t max_conns_per_uid, admin_reserved_conns;
    uint32_t max_queued_per_conn, max_queued_per_tenant;
    /* Sub-tenants ("front/sub") one front end may hold registered at once;
     * past it the least recently used idle one is freed, else refused. */
    uint32_t max_sub_tenants;
    /* Unread output above which a connection's generates are ended with
     * `busy`, and the daemon-wide budget of buffered input + output above
     * which the connection buffering most is dropped (bytes). */
    uint64_t max_unread_output, max_buffered;
    /* Executor (serve mode): token budget and sequences per step, and how
     * long a generate may wait for its first step (ms; 0 = no limit). */
    uint32_t step_tokens, step_seqs, queue_timeout_ms;
    /* Text work off the loop (chat templates, tokenizing): worker threads,
     * and the texts a tenant may have waiting for them or in work. */
    uint32_t text_workers, text_jobs_per_tenant;
    uint64_t max_text_bytes; /* a request's text (prompt, messages, tokenize) */
    /* The disk tier (off while disk_dir is empty): its directory and size,
     * the write-behind period (ms), how long SIGTERM may spend writing
     * back (s), and the workers that prefetch from it. */
    char disk_dir[4096];
    uint64_t disk_max_bytes;
    uint32_t disk_writeback_ms, disk_flush_s, disk_workers;
    uint32_t prefetch_nice;    /* the prefetch workers' nice levels below kvd's */
    uint32_t prefetch_idle_ms; /* 0: off; else SCHED_IDLE, raised after this long */
    uint64_t warm_bytes;       /* the warm reserve per tier and model (kvmm_config); 0: off */
    /* KV events (kvevents.h): the PUB and replay endpoints ("": off),
     * batches kept for replay, the topic, the per-subscriber high-water
     * mark and the seed of the published block hashes. */
    char kv_events[256], kv_events_replay[256];
    uint32_t kv_events_buffer, kv_events_hwm, kv_events_sndbuf;
    char kv_events_topic[256], kv_events_hash_seed[256];
    bool kv_events_connect; /* the PUB sockets connect (to a router's bound SUB) */
    /* The remote tier on Redis (off while remote is empty): its URL, the
     * fleet key's file (or insecure: checksums only), the bound on one
     * round (ms), a value's size, its TTL (s; 0: none), the hits a block
     * needs before it is written, and the workers that prefetch from it. */
    char remote[1024];
    char remote_key_file[4096];
    bool remote_insecure;
    uint32_t remote_timeout_ms;
    uint64_t remote_value_bytes;
    uint32_t remote_ttl_s, remote_min_hits, remote_workers;
    /* Speculative decoding (exec/spec.h): the daemon's kind, the largest
     * batch it runs at, draft tokens per step, the n-gram lengths tried; the
     * draft model of the daemon's one model (empty: none; [model:NAME]
     * draft names one per model) and, for each model with a draft, the
     * most of the KV it may hold that its draft's KV may take (a cap on
     * pages of the budget, not a reservation). */
    enum options_spec speculative;
    enum options_overlap overlap;
    uint32_t spec_max_batch, spec_max_draft, spec_ngram_min, spec_ngram_max;
    char draft_model_path[4096];
    double draft_kv_share;
    /* cpu backend: compute threads for the model (0 = one per online CPU). */
    uint32_t threads;
    int log_level;
    char metrics_addr[80];         /* "HOST:PORT" for the Prometheus exporter; empty: off */
    bool metrics_force;            /* allow a non-loopback metrics address */
    char metrics_group[64];        /* group of a unix: metrics socket (mode 0660); "": 0600 */
    char metrics_token_file[4096]; /* bearer token required by the metrics endpoint; "": none */
    uint32_t metrics_max_conns;    /* open metrics connections at most */
    /* The OpenAI-compatible HTTP API (http.c): a Unix socket and/or a TCP
     * address (loopback unless http_force), its open connections, the
     * largest request body (bytes) and the idle/header timeout (s). */
    char http_socket[108];
    char http_addr[80];
    bool http_force;
    uint32_t http_max_conns;
    /* of them: per uid (Unix socket), per address (TCP), and the last ones
     * only admins (Unix socket) may take */
    uint32_t http_max_conns_per_uid, http_max_conns_per_peer, http_admin_reserved_conns;
    uint64_t http_max_body;
    uint32_t http_timeout_s;
    bool roofline_probe; /* measure the backend's ceilings at start (default on) */
    bool help, version;
};

/* The arena sizes when neither a count nor a memory size is set (main.c
 * derives them; --help shows them). */
#define OPTIONS_DEFAULT_DEVICE_BLOCKS 1024
#define OPTIONS_DEFAULT_HOST_BLOCKS 1024

/* Every setting is one entry of one table (options.c), which drives the
 * defaults, the command line, the config file's [server] keys and --help. */
enum options_kind {
    OPTIONS_STR,      /* a string into a char array of `cap` bytes */
    OPTIONS_PATH,     /* the same, an absolute path */
    OPTIONS_U32,      /* a whole number in [lo, hi] */
    OPTIONS_SIZE,     /* bytes with an optional K/M/G/T suffix, in [lo, hi] (uint64_t) */
    OPTIONS_SIZE32,   /* the same into a uint32_t */
    OPTIONS_FRACTION, /* a double in (0, 1] */
    OPTIONS_BOOL,     /* yes/no, true/false, on/off, 1/0; a command-line flag is yes */
    OPTIONS_OFF_FLAG, /* a command-line flag that sets a bool to no */
    OPTIONS_CHOICE,   /* one of `choices` ("a|b|c"): the index into an int-sized enum */
    OPTIONS_LOG_LEVEL,
    OPTIONS_METRICS,  /* unix[:PATH] or HOST:PORT (metrics_parse_addr) */
    OPTIONS_TCP_ADDR, /* HOST:PORT (httpd_parse_addr, no unix:) */
    OPTIONS_MODEL,    /* --model: PATH (model_path) or NAME=PATH (a models[] entry) */
    OPTIONS_SECONDS,  /* a whole number of seconds, or forever (OPTIONS_KEEP_FOREVER) */
};
/* Where a setting may be given (both when neither flag is set). */
#define OPTIONS_CLI_ONLY 1u  /* not a config key (--config, --help, ...) */
#define OPTIONS_FILE_ONLY 2u /* not a command-line option */
struct options_def {
    const char *name; /* long option and config key */
    const char *arg;  /* its placeholder in --help; NULL for flags */
    enum options_kind kind;
    size_t off, cap;     /* the field: offsetof(struct options, ...), its size */
    uint64_t lo, hi;     /* numbers: the range */
    const char *choices; /* OPTIONS_CHOICE: "a|b|c" */
    const char *dflt;    /* the default, parsed like a value; NULL: zero/empty */
    const char *shown;   /* the default --help shows when dflt does not say it */
    unsigned flags;
    const char *help; /* lines separated by '\n' */
};
extern const struct options_def options_defs[];
extern const size_t options_n_defs;

/* The defaults: store mode with a small geometry (4 layers, 4 kv heads,
 * head_dim 64, f16, 16 tokens per block: 64 KiB blocks), 1024 device and
 * 1024 host blocks, cpu/cuda chosen automatically; every entry's dflt. */
void options_defaults(struct options *o);

/* Applies one setting by its long name ("socket", "device-blocks", ...;
 * '_' and '-' are the same). value is NULL for flags. Returns 0, or
 * KVD_EBADREQ with a message in err. options_set_key is the config file's
 * form: the command-line-only settings are refused there. */
int options_set(struct options *o, const char *name, const char *value, struct kvd_error *err);
int options_set_key(struct options *o, const char *name, const char *value, struct kvd_error *err);

/* A [model:NAME] key (path, kv-dtype, keep-alive-s, preload, tenants,
 * max-device-bytes, draft, speculative) of model `model`, added when new. 0, or KVD_EBADREQ
 * naming the key (a bad name, value or key; more than OPTIONS_MAX_MODELS). */
int options_model_set(struct options *o, const char *model, const char *key, const char *value,
                      struct kvd_error *err);
/* Whether s is a model name: 1 to OPTIONS_MODEL_NAME letters, digits and
 * "-_.:/". */
bool options_model_name_ok(const char *s, size_t len);

/* The warm reserve each model's pool keeps: warm-bytes where a lower tier
 * (disk or remote) restores blocks into the pools, else none. The reserve
 * serves restores; without them it would only hold memory and move the
 * pools' pages while kvd is idle. */
uint64_t options_warm_bytes(const struct options *o);

/* Parses argv onto o. Returns 0, or KVD_EBADREQ with a message. */
int options_parse(struct options *o, int argc, char **argv, struct kvd_error *err);
/* The value of --config in argv (NULL if none), so the file can be read
 * before the command line overrides it. */
const char *options_find_config(int argc, char **argv);

/* The --help text. */
void options_usage(FILE *f);
#endif
