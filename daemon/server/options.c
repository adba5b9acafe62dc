/* options: command line and [server] settings (see options.h), all from
 * one table. Numbers are parsed strictly (whole string, range checked);
 * sizes take K/M/G/T suffixes (powers of 1024). */
#include "options.h"
#include "httpd.h"
#include "metrics.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "kvd/protocol.h"
#include "kvd/status.h"
#include "log.h"

_Static_assert(OPTIONS_BACKEND_AUTO == 0 && OPTIONS_BACKEND_CPU == 1 && OPTIONS_BACKEND_CUDA == 2,
               "backend choices are in enum order");
_Static_assert(KV_F16 == 0 && KV_BF16 == 1 && KV_F32 == 2 && KV_Q8_0 == 3 && KV_FP8 == 4,
               "kv-dtype choices are in enum order");
_Static_assert(OPTIONS_EVICT_HITS == 0 && OPTIONS_EVICT_LRU == 1,
               "evict-policy choices are in enum order");
_Static_assert(OPTIONS_SPEC_OFF == 0 && OPTIONS_SPEC_NGRAM == 1 && OPTIONS_SPEC_DRAFT == 2,
               "speculative choices are in enum order");
_Static_assert(OPTIONS_OVERLAP_AUTO == 0 && OPTIONS_OVERLAP_ON == 1 && OPTIONS_OVERLAP_OFF == 2,
               "overlap choices are in enum order");
_Static_assert(sizeof(enum options_backend) == sizeof(int) &&
                   sizeof(enum kv_dtype) == sizeof(int) &&
                   sizeof(enum options_evict) == sizeof(int) &&
                   sizeof(enum options_spec) == sizeof(int) &&
                   sizeof(enum options_overlap) == sizeof(int),
               "choices are stored as int");

#define STR_(x) #x
#define STR(x) STR_(x)
#define F(field) offsetof(struct options, field), sizeof(((struct options *)0)->field)

const struct options_def options_defs[] = {
    {"socket", "PATH", OPTIONS_PATH, F(socket_path), 0, 0, NULL, NULL, NULL, 0,
     "listen here (default " KVD_DEFAULT_SOCKET ";\n"
     "non-root without access: $XDG_RUNTIME_DIR/kvd.sock\n"
     "or /tmp/kvd-UID/kvd.sock); ignored under socket activation"},
    {"socket-group", "NAME", OPTIONS_STR, F(socket_group), 0, 0, NULL, NULL, NULL, 0,
     "group owning the socket (mode 0660)"},
    {"config", "FILE", OPTIONS_STR, F(config_path), 0, 0, NULL, NULL, NULL, OPTIONS_CLI_ONLY,
     "INI file: [server] settings, [limits], [admin], [tenant:NAME]"},
    {"backend", "auto|cpu|cuda", OPTIONS_CHOICE, F(backend), 0, 0, "auto|cpu|cuda", "auto", NULL, 0,
     "where the KV arena and the model live"},
    {"model", "[NAME=]FILE", OPTIONS_MODEL, F(model_path), 0, 0, NULL, NULL, NULL, 0,
     "GGUF model to serve (omit for store mode); NAME=FILE\n"
     "names one of several (repeatable; also [model:NAME])"},
    {"device-bytes", "BYTES", OPTIONS_SIZE, F(device_bytes), 0, UINT64_MAX, NULL, NULL, NULL, 0,
     "the one device budget (e.g. 20G): the loaded models'\n"
     "weights and drafts' KV, and every model's KV pages;\n"
     "a model that does not fit takes cached KV pages, then\n"
     "unloads idle models, least recently used first\n"
     "(default: the weights + the KV of the two below)"},
    {"keep-alive-s", "SECONDS|forever", OPTIONS_SECONDS, F(keep_alive_s), 0, UINT32_MAX - 2, NULL,
     "300", NULL, 0, "idle seconds before a model unloads\n(a model's own keep-alive-s wins)"},
    {"chat-template", "FILE", OPTIONS_STR, F(chat_template_path), 0, 0, NULL, NULL, NULL, 0,
     "Jinja chat template for 'messages', instead of the\nmodel file's own"},
    {"device-blocks", "N", OPTIONS_U32, F(device_blocks), 1, UINT32_MAX - 1, NULL, NULL,
     STR(OPTIONS_DEFAULT_DEVICE_BLOCKS), 0,
     "without device-bytes: this many KV blocks of device\nmemory"},
    {"gpu-mem", "FRACTION", OPTIONS_FRACTION, F(gpu_mem), 0, 0, NULL, NULL, NULL, 0,
     "or: this fraction of device memory for KV blocks"},
    {"host-blocks", "N", OPTIONS_U32, F(host_blocks), 0, UINT32_MAX - 1, NULL, NULL,
     STR(OPTIONS_DEFAULT_HOST_BLOCKS), 0, "blocks in the host tier (0 = none)"},
    {"host-mem", "BYTES", OPTIONS_SIZE, F(host_mem), 0, UINT64_MAX, NULL, NULL, NULL, 0,
     "or: this many bytes of host tier (e.g. 8G)"},
    {"page-bytes", "BYTES", OPTIONS_SIZE, F(page_bytes), 0, (uint64_t)1 << 40, NULL, NULL, NULL, 0,
     "the page KV memory is cut into (default 2M, less for\na budget under 64 pages; rounded up "
     "to the\nbackend's granularity)"},
    {"evict-policy", "hits|lru", OPTIONS_CHOICE, F(evict_policy), 0, 0, "hits|lru", "hits", NULL, 0,
     "which cached KV blocks go first: least recently\nused with a bonus for hits and tenant "
     "weight,\n"
     "or plain lru"},
    {"block-tokens", "N", OPTIONS_U32, F(geom.block_tokens), 1, 4096, NULL, "16", NULL, 0,
     "tokens per block"},
    {"kv-layers", "L", OPTIONS_U32, F(geom.layers), 1, 1024, NULL, "4", NULL, 0,
     "store-mode KV geometry: layers"},
    {"kv-heads", "H", OPTIONS_U32, F(geom.kv_heads), 1, 1024, NULL, "4", NULL, 0,
     "store-mode KV heads"},
    {"head-dim", "D", OPTIONS_U32, F(geom.head_dim), 1, 4096, NULL, "64", NULL, 0,
     "store-mode head size"},
    {"kv-dtype", "f16|bf16|f32|q8_0|fp8", OPTIONS_CHOICE, F(geom.dtype), 0, 0,
     "f16|bf16|f32|q8_0|fp8", "f16", NULL, 0,
     "KV element type (q8_0, fp8: quantized, head_dim a multiple of 32)"},
    {"max-frame", "BYTES", OPTIONS_SIZE32, F(max_frame), KVD_MAX_FRAME_MIN, KVD_MAX_FRAME_LIMIT,
     NULL, "64M", NULL, 0, "largest frame accepted"},
    {"max-connections", "N", OPTIONS_U32, F(max_conns), 1, 1000000, NULL, "1024", NULL, 0,
     "concurrent client connections"},
    {"max-connections-per-uid", "N", OPTIONS_U32, F(max_conns_per_uid), 1, 1000000, NULL, "64",
     NULL, 0, "connections one uid may hold (admins are exempt)"},
    {"admin-reserved-connections", "N", OPTIONS_U32, F(admin_reserved_conns), 0, 1000000, NULL, "8",
     NULL, 0, "of --max-connections, slots only admins may take"},
    {"max-queued-per-connection", "N", OPTIONS_U32, F(max_queued_per_conn), 1, 10000000, NULL,
     "1024", NULL, 0, "generates in flight per connection before 'busy'"},
    {"max-queued-per-tenant", "N", OPTIONS_U32, F(max_queued_per_tenant), 1, 10000000, NULL, "4096",
     NULL, 0, "generates in flight per tenant before 'busy'"},
    {"max-sub-tenants", "N", OPTIONS_U32, F(max_sub_tenants), 1, 10000000, NULL, "1024", NULL, 0,
     "sub-tenants one front end may have registered\nat once (idle ones are freed, oldest first)"},
    {"max-unread-output", "BYTES", OPTIONS_SIZE, F(max_unread_output), 64 << 10, (uint64_t)1 << 50,
     NULL, "16M", NULL, 0,
     "a connection's unread output above which its\ngenerates end with 'busy'"},
    {"max-buffered", "BYTES", OPTIONS_SIZE, F(max_buffered), 1 << 20, (uint64_t)1 << 50, NULL, "1G",
     NULL, 0,
     "daemon-wide buffered input + output above which the\nconnection holding most is dropped"},
    {"step-tokens", "N", OPTIONS_U32, F(step_tokens), 1, 1u << 20, NULL, "512", NULL, 0,
     "executor token budget per step"},
    {"step-seqs", "N", OPTIONS_U32, F(step_seqs), 1, 4096, NULL, "64", NULL, 0,
     "executor sequences per step"},
    {"queue-timeout", "MS", OPTIONS_U32, F(queue_timeout_ms), 0, 86400000, NULL, "60000", NULL, 0,
     "a generate not started by then is answered busy\n(0 = wait as long as it takes)"},
    {"text-workers", "N", OPTIONS_U32, F(text_workers), 1, 64, NULL, "2", NULL, 0,
     "workers that render chat templates and tokenize\n(never the event loop)"},
    {"text-jobs-per-tenant", "N", OPTIONS_U32, F(text_jobs_per_tenant), 1, 100000, NULL, "16", NULL,
     0, "texts one tenant may have waiting for the text\nworkers or in work before 'busy'"},
    {"max-text-bytes", "BYTES", OPTIONS_SIZE, F(max_text_bytes), 1024, (uint64_t)1 << 40, NULL,
     "4M", NULL, 0, "largest text a request may carry (prompt,\nmessages, tokenize)"},
    {"disk-dir", "DIR", OPTIONS_PATH, F(disk_dir), 0, 0, NULL, NULL, NULL, 0,
     "keep cached KV blocks on disk in DIR too: they\nsurvive restarts (off by default)"},
    {"disk-max-bytes", "BYTES", OPTIONS_SIZE, F(disk_max_bytes), 1 << 20, (uint64_t)1 << 56, NULL,
     "8G", NULL, 0, "size of the disk tier's block file (preallocated)"},
    {"disk-writeback-ms", "MS", OPTIONS_U32, F(disk_writeback_ms), 1, 3600000, NULL, "1000", NULL,
     0, "new cached blocks reach the disk within this\n(what a crash can lose)"},
    {"disk-flush-s", "S", OPTIONS_U32, F(disk_flush_s), 0, 3600, NULL, "10", NULL, 0,
     "at shutdown, time to write back what is not\non disk yet"},
    {"disk-workers", "N", OPTIONS_U32, F(disk_workers), 1, 64, NULL, "2", NULL, 0,
     "workers that read cached blocks back from disk\nbefore a request is scheduled"},
    {"prefetch-nice", "N", OPTIONS_U32, F(prefetch_nice), 0, 19, NULL, "10", NULL, 0,
     "the prefetch workers (disk and remote restores)\nrun N nice levels below kvd: a restore "
     "takes\nthe CPU the decode leaves"},
    {"prefetch-idle-ms", "MS", OPTIONS_U32, F(prefetch_idle_ms), 0, 60000, NULL, "100", NULL, 0,
     "the prefetch workers run SCHED_IDLE (only on\ncores nothing else wants); a restore "
     "running\nthis long goes back to prefetch-nice (0: off)"},
    {"warm-bytes", "BYTES", OPTIONS_SIZE, F(warm_bytes), 0, (uint64_t)1 << 40, NULL, "16M", NULL, 0,
     "spare KV pages per tier written once ahead by an\nidle thread, so a restore's copy skips "
     "the first\ntouch of fresh memory (cpu backend, with a\ndisk or remote tier; 0 = off)"},
    {"kv-events", "ENDPOINT", OPTIONS_STR, F(kv_events), 0, 0, NULL, NULL, NULL, 0,
     "publish KV cache events (vLLM's format) on this\nZeroMQ endpoint, tcp://HOST:PORT or "
     "ipc://PATH\n(bound; off by default): the first model's stream"},
    {"kv-events-replay", "ENDPOINT", OPTIONS_STR, F(kv_events_replay), 0, 0, NULL, NULL, NULL, 0,
     "answer replay requests for missed event batches\non this ZeroMQ ROUTER endpoint"},
    {"kv-events-buffer", "N", OPTIONS_U32, F(kv_events_buffer), 1, 10000000, NULL, "10000", NULL, 0,
     "event batches kept for replay"},
    {"kv-events-topic", "TOPIC", OPTIONS_STR, F(kv_events_topic), 0, 0, NULL, NULL, NULL, 0,
     "first frame of every event message; {model} is\nthe model's name (default empty)"},
    {"kv-events-connect", NULL, OPTIONS_BOOL, F(kv_events_connect), 0, 0, NULL, NULL, NULL, 0,
     "connect the events sockets to the router's bound\nSUB endpoint instead of binding them "
     "(every\nmodel's stream to --kv-events unless it has its own)"},
    {"kv-events-hwm", "N", OPTIONS_U32, F(kv_events_hwm), 1, 100000000, NULL, "100000", NULL, 0,
     "event batches queued per subscriber before it\nmisses some (ZeroMQ high-water mark)"},
    {"kv-events-sndbuf", "BYTES", OPTIONS_SIZE32, F(kv_events_sndbuf), 0, 1u << 30, NULL, "0", NULL,
     0, "kernel send buffer per subscriber connection over\ntcp:// (0 = the system's default)"},
    {"kv-events-hash-seed", "TEXT", OPTIONS_STR, F(kv_events_hash_seed), 0, 0, NULL, NULL, NULL, 0,
     "seed of the published block hashes (llm-d's\nHashSeed, vLLM's PYTHONHASHSEED; default "
     "empty)"},
    {"remote", "URL", OPTIONS_STR, F(remote), 0, 0, NULL, NULL, NULL, 0,
     "share cached KV blocks of tenants with 'remote = on'\n"
     "through Redis: redis://[user:password@]host:port[/db]\n"
     "or redis-cluster://host:port[,host:port...] (off by default)"},
    {"remote-key-file", "FILE", OPTIONS_STR, F(remote_key_file), 0, 0, NULL, NULL, NULL, 0,
     "the fleet key (64 hex digits, mode 0600) that seals\nevery value in Redis"},
    {"remote-insecure", NULL, OPTIONS_BOOL, F(remote_insecure), 0, 0, NULL, NULL, NULL, 0,
     "allow --remote without a key file: values are\nchecksummed only, Redis sees and can forge "
     "KV"},
    {"remote-timeout-ms", "MS", OPTIONS_U32, F(remote_timeout_ms), 1, 60000, NULL, "100", NULL, 0,
     "the most one Redis round may cost a request"},
    {"remote-value-bytes", "BYTES", OPTIONS_SIZE, F(remote_value_bytes), 4096, (uint64_t)512 << 20,
     NULL, "4M", NULL, 0, "bundle consecutive blocks into values of this size"},
    {"remote-ttl-s", "S", OPTIONS_U32, F(remote_ttl_s), 0, UINT32_MAX - 1, NULL, "86400", NULL, 0,
     "expiry of a value in Redis (0 = none)"},
    {"remote-min-hits", "N", OPTIONS_U32, F(remote_min_hits), 0, 1000000, NULL, "1", NULL, 0,
     "reuses a block needs before it is written to Redis"},
    {"remote-workers", "N", OPTIONS_U32, F(remote_workers), 1, 64, NULL, "2", NULL, 0,
     "workers that fetch cached blocks from Redis before\na request is scheduled"},
    {"speculative", "off|ngram|draft", OPTIONS_CHOICE, F(speculative), 0, 0, "off|ngram|draft",
     "off", NULL, 0,
     "speculative decoding for requests that do not\nchoose: n-gram prompt lookup, or the draft\n"
     "model (--draft-model; [model:NAME] draft), where\nthe model has one"},
    {"spec-max-batch", "N", OPTIONS_U32, F(spec_max_batch), 1, 64, NULL, "4", NULL, 0,
     "speculate only while at most this many requests\nrun (above it plain batches are faster)"},
    {"spec-max-draft", "N", OPTIONS_U32, F(spec_max_draft), 1, 16, NULL, "8", NULL, 0,
     "draft tokens one request verifies per step, at\nmost (fewer while drafts are rejected)"},
    {"spec-ngram-min", "N", OPTIONS_U32, F(spec_ngram_min), 1, 16, NULL, "1", NULL, 0,
     "n-gram lookup: the shortest suffix matched"},
    {"spec-ngram-max", "N", OPTIONS_U32, F(spec_ngram_max), 1, 16, NULL, "3", NULL, 0,
     "n-gram lookup: the longest suffix matched\n(tried first)"},
    {"draft-model", "FILE", OPTIONS_STR, F(draft_model_path), 0, 0, NULL, NULL, NULL, 0,
     "a small GGUF with the served model's vocabulary,\nthe draft of speculative decoding (a "
     "daemon "
     "of\none model; with several: [model:NAME] draft)"},
    {"draft-kv-share", "FRACTION", OPTIONS_FRACTION, F(draft_kv_share), 0, 0, NULL, "0.1", NULL, 0,
     "of the KV a model may hold, the most its draft\nmodel's KV may take (pages of the "
     "budget, taken\nas needed and given back)"},
    {"overlap", "auto|on|off", OPTIONS_CHOICE, F(overlap), 0, 0, "auto|on|off", "auto", NULL, 0,
     "plan the next decode step while the device runs\nthis one (auto: on the cuda backend)"},
    {"threads", "N", OPTIONS_U32, F(threads), 0, 256, NULL, "0", NULL, 0,
     "cpu backend: compute threads (0 = one per CPU)"},
    {"log-level", "LEVEL", OPTIONS_LOG_LEVEL, F(log_level), 0, 0, NULL, "info", NULL, 0,
     "error, warning, notice, info or debug"},
    {"metrics", "ADDR", OPTIONS_METRICS, F(metrics_addr), 0, 0, NULL, NULL, NULL, 0,
     "serve Prometheus metrics: unix[:PATH] (default PATH:\n"
     "metrics.sock beside --socket; mode 0600, or 0660 for\n"
     "--metrics-group), or HOST:PORT over TCP (loopback only,\n"
     "e.g. 127.0.0.1:9464); off by default"},
    {"metrics-group", "NAME", OPTIONS_STR, F(metrics_group), 0, 0, NULL, NULL, NULL, 0,
     "group that may read a unix: metrics socket (admins)"},
    {"metrics-token-file", "FILE", OPTIONS_STR, F(metrics_token_file), 0, 0, NULL, NULL, NULL, 0,
     "require 'Authorization: Bearer <token in FILE>'"},
    {"metrics-max-connections", "N", OPTIONS_U32, F(metrics_max_conns), 1, 100000, NULL, "16", NULL,
     0, "open metrics connections at most"},
    {"metrics-force", NULL, OPTIONS_BOOL, F(metrics_force), 0, 0, NULL, NULL, NULL, 0,
     "allow a non-loopback --metrics address"},
    {"http-socket", "PATH", OPTIONS_PATH, F(http_socket), 0, 0, NULL, NULL, NULL, 0,
     "serve the OpenAI-compatible HTTP API on this Unix\n"
     "socket (the peer's uid picks the tenant; mode 0660,\n"
     "group --socket-group); off by default"},
    {"http", "HOST:PORT", OPTIONS_TCP_ADDR, F(http_addr), 0, 0, NULL, NULL, NULL, 0,
     "serve the HTTP API over TCP (loopback only; [http]\n"
     "bearer tokens pick the tenant); off by default"},
    {"http-force", NULL, OPTIONS_BOOL, F(http_force), 0, 0, NULL, NULL, NULL, 0,
     "allow a non-loopback --http address"},
    {"http-max-connections", "N", OPTIONS_U32, F(http_max_conns), 1, 1000000, NULL, "256", NULL, 0,
     "open HTTP API connections at most (per listener)"},
    {"http-max-connections-per-uid", "N", OPTIONS_U32, F(http_max_conns_per_uid), 1, 1000000, NULL,
     "32", NULL, 0,
     "HTTP API connections one uid may hold on the Unix\nsocket (admins are exempt)"},
    {"http-max-connections-per-peer", "N", OPTIONS_U32, F(http_max_conns_per_peer), 1, 1000000,
     NULL, "32", NULL, 0, "HTTP API connections one address may hold over TCP"},
    {"http-admin-reserved-connections", "N", OPTIONS_U32, F(http_admin_reserved_conns), 0, 1000000,
     NULL, "8", NULL, 0, "of --http-max-connections, Unix-socket slots only\nadmins may take"},
    {"http-max-body", "BYTES", OPTIONS_SIZE, F(http_max_body), 1024, (uint64_t)1 << 30, NULL, "8M",
     NULL, 0, "largest HTTP request body (413 beyond)"},
    {"http-timeout", "S", OPTIONS_U32, F(http_timeout_s), 1, 86400, NULL, "60", NULL, 0,
     "seconds an HTTP connection may idle or take to\nsend a request's headers and body"},
    {"roofline-probe", "yes|no", OPTIONS_BOOL, F(roofline_probe), 0, 0, NULL, "yes", NULL,
     OPTIONS_FILE_ONLY,
     "measure the backend's FLOP/s and bytes/s ceilings at start\n(about 0.3 s)"},
    {"no-roofline-probe", NULL, OPTIONS_OFF_FLAG, F(roofline_probe), 0, 0, NULL, NULL, NULL,
     OPTIONS_CLI_ONLY,
     "skip the startup measurement of the backend's\nFLOP/s and bytes/s ceilings"},
    {"help", NULL, OPTIONS_BOOL, F(help), 0, 0, NULL, NULL, NULL, OPTIONS_CLI_ONLY, "this text"},
    {"version", NULL, OPTIONS_BOOL, F(version), 0, 0, NULL, NULL, NULL, OPTIONS_CLI_ONLY,
     "the version"},
};
const size_t options_n_defs = sizeof(options_defs) / sizeof(options_defs[0]);

static int parse_u64(const char *s, uint64_t lo, uint64_t hi, bool sized, uint64_t *out)
{
    char *end;
    if (!s || !*s || *s == '-' || *s == '+')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    if (sized && *end) {
        unsigned shift = 0;
        switch (*end) {
        case 'k':
        case 'K':
            shift = 10;
            break;
        case 'm':
        case 'M':
            shift = 20;
            break;
        case 'g':
        case 'G':
            shift = 30;
            break;
        case 't':
        case 'T':
            shift = 40;
            break;
        default:
            return -1;
        }
        end++;
        if (*end == 'i' || *end == 'I')
            end++;
        if (*end == 'b' || *end == 'B')
            end++;
        if (v > (UINT64_MAX >> shift))
            return -1;
        v <<= shift;
    }
    if (*end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static const struct options_def *find_def(const char *name)
{
    for (size_t i = 0; i < options_n_defs; i++)
        if (!strcmp(options_defs[i].name, name))
            return &options_defs[i];
    return NULL;
}

/* The index of v among "a|b|c", or -1. */
static int choice_index(const char *choices, const char *v)
{
    size_t vl = strlen(v);
    int i = 0;
    for (const char *c = choices; *c; i++) {
        const char *bar = strchr(c, '|');
        size_t cl = bar ? (size_t)(bar - c) : strlen(c);
        if (cl == vl && !strncmp(c, v, cl))
            return i;
        if (!bar)
            break;
        c = bar + 1;
    }
    return -1;
}

uint64_t options_warm_bytes(const struct options *o)
{
    return o->disk_dir[0] || o->remote[0] ? o->warm_bytes : 0;
}

bool options_model_name_ok(const char *s, size_t len)
{
    if (len == 0 || len > OPTIONS_MODEL_NAME)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.' || c == ':' || c == '/'))
            return false;
    }
    return true;
}

/* Seconds, or forever/never (OPTIONS_KEEP_FOREVER). */
static int parse_seconds(const char *v, uint64_t hi, uint32_t *out)
{
    uint64_t x;
    if (!strcmp(v, "forever") || !strcmp(v, "never")) {
        *out = OPTIONS_KEEP_FOREVER;
        return 0;
    }
    if (parse_u64(v, 0, hi, false, &x))
        return -1;
    *out = (uint32_t)x;
    return 0;
}

/* models[] entry of `name` (added, defaults set, when new); NULL when the
 * table is full. */
static struct options_model *model_entry(struct options *o, const char *name)
{
    for (uint32_t i = 0; i < o->n_models; i++)
        if (!strcmp(o->models[i].name, name))
            return &o->models[i];
    if (o->n_models >= OPTIONS_MAX_MODELS)
        return NULL;
    struct options_model *m = &o->models[o->n_models++];
    memset(m, 0, sizeof(*m));
    snprintf(m->name, sizeof(m->name), "%s", name);
    m->kv_dtype = -1;
    m->keep_alive_s = OPTIONS_KEEP_DEFAULT;
    m->speculative = -1;
    return m;
}

int options_model_set(struct options *o, const char *model, const char *key, const char *v,
                      struct kvd_error *err)
{
    if (!options_model_name_ok(model, strlen(model)))
        return kvd_error_set(err, KVD_EBADREQ,
                             "model name '%.80s': 1-%d letters, digits, '-', '_', '.', ':' or '/'",
                             model, OPTIONS_MODEL_NAME);
    struct options_model *m = model_entry(o, model);
    if (!m)
        return kvd_error_set(err, KVD_EBADREQ, "model '%s': more than %d models", model,
                             OPTIONS_MAX_MODELS);
    if (!v)
        return kvd_error_set(err, KVD_EBADREQ, "[model:%s] %s needs a value", model, key);
    if (!strcmp(key, "path")) {
        if (v[0] != '/' || strlen(v) >= sizeof(m->path))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] path: '%.80s' is not an absolute path of at most "
                                 "%zu bytes",
                                 model, v, sizeof(m->path) - 1);
        strcpy(m->path, v);
    } else if (!strcmp(key, "kv-dtype")) {
        int i = choice_index("f16|bf16|f32|q8_0|fp8", v);
        if (i < 0)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] kv-dtype: '%s' is not one of f16|bf16|f32|q8_0|fp8",
                                 model, v);
        m->kv_dtype = i;
    } else if (!strcmp(key, "keep-alive-s")) {
        if (parse_seconds(v, UINT32_MAX - 2, &m->keep_alive_s))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] keep-alive-s: '%s' is not a number of seconds or "
                                 "forever",
                                 model, v);
    } else if (!strcmp(key, "preload")) {
        if (!strcmp(v, "yes") || !strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "on"))
            m->preload = true;
        else if (!strcmp(v, "no") || !strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "off"))
            m->preload = false;
        else
            return kvd_error_set(err, KVD_EBADREQ, "[model:%s] preload: '%s' is not yes or no",
                                 model, v);
    } else if (!strcmp(key, "tenants")) {
        if (strlen(v) >= sizeof(m->tenants))
            return kvd_error_set(err, KVD_EBADREQ, "[model:%s] tenants: longer than %zu bytes",
                                 model, sizeof(m->tenants) - 1);
        strcpy(m->tenants, v);
    } else if (!strcmp(key, "max-device-bytes")) {
        uint64_t x;
        if (parse_u64(v, 0, UINT64_MAX, true, &x))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] max-device-bytes: '%s' is not a byte size (e.g. 8G)",
                                 model, v);
        m->max_device_bytes = x;
    } else if (!strcmp(key, "draft")) {
        if (v[0] == '/')
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] draft: '%.80s' is a path; a draft is another model "
                                 "of the daemon, by name ([model:OTHER] path = ..., then draft = "
                                 "OTHER)",
                                 model, v);
        if (!options_model_name_ok(v, strlen(v)))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] draft: '%.80s' is not a model name (another model of "
                                 "the daemon)",
                                 model, v);
        if (!strcmp(v, model))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] draft: a model cannot be its own draft", model);
        strcpy(m->draft, v);
    } else if (!strcmp(key, "speculative")) {
        int i = choice_index("off|ngram|draft", v);
        if (i < 0)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "[model:%s] speculative: '%s' is not one of off|ngram|draft",
                                 model, v);
        m->speculative = i;
    } else if (!strcmp(key, "kv-events") || !strcmp(key, "kv-events-replay") ||
               !strcmp(key, "kv-events-topic")) {
        /* endpoints are checked when the stream starts (kvevents_start) */
        char *f = key[9] == '\0'   ? m->kv_events
                  : key[10] == 'r' ? m->kv_events_replay
                                   : m->kv_events_topic;
        if (strlen(v) >= sizeof(m->kv_events))
            return kvd_error_set(err, KVD_EBADREQ, "[model:%s] %s: longer than %zu bytes", model,
                                 key, sizeof(m->kv_events) - 1);
        strcpy(f, v);
        if (f == m->kv_events_topic)
            m->kv_events_topic_set = true;
    } else {
        return kvd_error_set(err, KVD_EBADREQ,
                             "[model:%s] %s: unknown key (path, kv-dtype, keep-alive-s, preload, "
                             "tenants, max-device-bytes, draft, speculative, kv-events, "
                             "kv-events-replay, kv-events-topic)",
                             model, key);
    }
    return 0;
}

/* Parses v by d's kind into the field at f. */
static int apply(const struct options_def *d, void *f, const char *v, struct kvd_error *err)
{
    const char *n = d->name;
    uint64_t x;
    switch (d->kind) {
    case OPTIONS_OFF_FLAG:
        if (v)
            return kvd_error_set(err, KVD_EBADREQ, "%s takes no value", n);
        *(bool *)f = false;
        return 0;
    case OPTIONS_BOOL:
        if (!v || !strcmp(v, "yes") || !strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "on"))
            *(bool *)f = true;
        else if (!strcmp(v, "no") || !strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "off"))
            *(bool *)f = false;
        else
            return kvd_error_set(err, KVD_EBADREQ, "%s: '%s' is not yes or no", n, v);
        return 0;
    default:
        break;
    }
    if (!v)
        return kvd_error_set(err, KVD_EBADREQ, "%s needs a value", n);
    switch (d->kind) {
    case OPTIONS_PATH:
        if (v[0] != '/')
            return kvd_error_set(err, KVD_EBADREQ, "%s: '%s' is not an absolute path", n, v);
        /* fall through */
    case OPTIONS_STR:
        if (strlen(v) >= d->cap)
            return kvd_error_set(err, KVD_EBADREQ, "%s: longer than %zu bytes", n, d->cap - 1);
        strcpy(f, v);
        return 0;
    case OPTIONS_MODEL: {
        /* NAME=PATH when the part before the first '=' holds no '/' */
        const char *eq = strchr(v, '=');
        size_t nl = eq ? (size_t)(eq - v) : 0;
        if (!eq || memchr(v, '/', nl)) {
            if (strlen(v) >= d->cap)
                return kvd_error_set(err, KVD_EBADREQ, "%s: longer than %zu bytes", n, d->cap - 1);
            strcpy(f, v);
            return 0;
        }
        char name[OPTIONS_MODEL_NAME + 1];
        if (!options_model_name_ok(v, nl))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "%s: '%.*s' is not a model name (1-%d letters, digits, '-', "
                                 "'_', '.' or ':')",
                                 n, (int)(nl > 80 ? 80 : nl), v, OPTIONS_MODEL_NAME);
        memcpy(name, v, nl);
        name[nl] = '\0';
        struct options *o = (struct options *)((char *)f - d->off);
        if (eq[1] != '/')
            return kvd_error_set(err, KVD_EBADREQ, "%s %s: '%s' is not an absolute path", n, name,
                                 eq + 1);
        return options_model_set(o, name, "path", eq + 1, err);
    }
    case OPTIONS_SECONDS: {
        uint32_t sec;
        if (parse_seconds(v, d->hi, &sec))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "%s: '%s' is not a whole number of seconds or forever", n, v);
        *(uint32_t *)f = sec;
        return 0;
    }
    case OPTIONS_U32:
        if (parse_u64(v, d->lo, d->hi, false, &x))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "%s: '%s' is not a whole number in [%" PRIu64 ", %" PRIu64 "]", n,
                                 v, d->lo, d->hi);
        *(uint32_t *)f = (uint32_t)x;
        return 0;
    case OPTIONS_SIZE:
    case OPTIONS_SIZE32:
        if (parse_u64(v, d->lo, d->hi, true, &x))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "%s: '%s' is not a byte size in [%" PRIu64 ", %" PRIu64
                                 "] (e.g. 16M)",
                                 n, v, d->lo, d->hi);
        if (d->kind == OPTIONS_SIZE32)
            *(uint32_t *)f = (uint32_t)x;
        else
            *(uint64_t *)f = x;
        return 0;
    case OPTIONS_FRACTION: {
        char *end;
        errno = 0;
        double fr = strtod(v, &end);
        if (errno || end == v || *end || !(fr > 0.0 && fr <= 1.0))
            return kvd_error_set(err, KVD_EBADREQ, "%s: '%s' is not a fraction in (0, 1]", n, v);
        *(double *)f = fr;
        return 0;
    }
    case OPTIONS_CHOICE: {
        int i = choice_index(d->choices, v);
        if (i < 0)
            return kvd_error_set(err, KVD_EBADREQ, "%s: '%s' is not one of %s", n, v, d->choices);
        *(int *)f = i;
        return 0;
    }
    case OPTIONS_LOG_LEVEL: {
        int l = log_level_parse(v);
        if (l < 0)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "%s: '%s' is not error, warning, notice, info or debug", n, v);
        *(int *)f = l;
        return 0;
    }
    case OPTIONS_METRICS: {
        char host[64];
        uint16_t port;
        bool loopback;
        char aerr[KVD_ERROR_MSG_MAX]; /* metrics.c reports into a buffer */
        if (metrics_parse_addr(v, host, sizeof(host), &port, &loopback, aerr, sizeof(aerr)))
            return kvd_error_set(err, KVD_EBADREQ, "%s", aerr);
        if (strlen(v) >= d->cap)
            return kvd_error_set(err, KVD_EBADREQ, "%s: longer than %zu bytes", n, d->cap - 1);
        strcpy(f, v);
        return 0;
    }
    case OPTIONS_TCP_ADDR: {
        char host[64];
        uint16_t port;
        bool loopback;
        if (!strncmp(v, "unix", 4))
            return kvd_error_set(err, KVD_EBADREQ,
                                 "%s: '%s': give HOST:PORT (a Unix socket is --%s-socket)", n, v,
                                 n);
        char aerr[KVD_ERROR_MSG_MAX]; /* httpd.c reports into a buffer */
        if (httpd_parse_addr(n, v, host, sizeof(host), &port, &loopback, aerr, sizeof(aerr)))
            return kvd_error_set(err, KVD_EBADREQ, "%s", aerr);
        if (strlen(v) >= d->cap)
            return kvd_error_set(err, KVD_EBADREQ, "%s: longer than %zu bytes", n, d->cap - 1);
        strcpy(f, v);
        return 0;
    }
    default:
        return kvd_error_set(err, KVD_EBADREQ, "%s: bad table entry", n);
    }
}

void options_defaults(struct options *o)
{
    memset(o, 0, sizeof(*o));
    o->host_blocks = UINT32_MAX; /* unset: host-mem, else OPTIONS_DEFAULT_HOST_BLOCKS */
    for (size_t i = 0; i < options_n_defs; i++)
        if (options_defs[i].dflt && apply(&options_defs[i], (char *)o + options_defs[i].off,
                                          options_defs[i].dflt, NULL) != 0)
            abort(); /* a default the table cannot parse: a bug caught by any test */
}

static int set_from(struct options *o, const char *name_in, const char *v, unsigned refused,
                    struct kvd_error *err)
{
    char name[64];
    size_t i;
    for (i = 0; name_in[i] && i + 1 < sizeof(name); i++)
        name[i] = name_in[i] == '_' ? '-' : name_in[i];
    name[i] = '\0';
    const struct options_def *d = name_in[i] ? NULL : find_def(name);
    if (!d)
        return kvd_error_set(err, KVD_EBADREQ, "unknown setting '%s'", name_in);
    if (d->flags & refused)
        return kvd_error_set(err, KVD_EBADREQ, "%s: %s", name_in,
                             refused == OPTIONS_CLI_ONLY ? "only on the command line"
                                                         : "only in the config file");
    return apply(d, (char *)o + d->off, v, err);
}

int options_set(struct options *o, const char *name, const char *v, struct kvd_error *err)
{
    return set_from(o, name, v, 0, err);
}

int options_set_key(struct options *o, const char *name, const char *v, struct kvd_error *err)
{
    return set_from(o, name, v, OPTIONS_CLI_ONLY, err);
}

int options_parse(struct options *o, int argc, char **argv, struct kvd_error *err)
{
    struct option lo[sizeof(options_defs) / sizeof(options_defs[0]) + 1];
    size_t n = 0;
    for (size_t i = 0; i < options_n_defs; i++) {
        const struct options_def *d = &options_defs[i];
        if (d->flags & OPTIONS_FILE_ONLY)
            continue;
        bool flag = d->kind == OPTIONS_BOOL || d->kind == OPTIONS_OFF_FLAG;
        lo[n++] = (struct option){d->name, flag ? no_argument : required_argument, NULL,
                                  !strcmp(d->name, "help")      ? 'h'
                                  : !strcmp(d->name, "version") ? 'V'
                                                                : 0};
    }
    lo[n] = (struct option){0, 0, 0, 0};
    int idx = 0, c;
    optind = 0; /* GNU: full reinitialisation, so parsing twice is safe */
    opterr = 0;
    while ((c = getopt_long(argc, argv, "hV", lo, &idx)) != -1) {
        const char *name = c == 'h' ? "help" : c == 'V' ? "version" : c == 0 ? lo[idx].name : NULL;
        if (!name)
            return kvd_error_set(err, KVD_EBADREQ, "unknown or incomplete option '%s' (see --help)",
                                 argv[optind - 1]);
        int rc = set_from(o, name, optarg, OPTIONS_FILE_ONLY, err);
        if (rc)
            return rc;
    }
    if (optind < argc)
        return kvd_error_set(err, KVD_EBADREQ, "unexpected argument '%s' (see --help)",
                             argv[optind]);
    return 0;
}

const char *options_find_config(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--"))
            break;
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            return argv[i + 1];
        if (!strncmp(argv[i], "--config=", 9))
            return argv[i] + 9;
    }
    return NULL;
}

void options_usage(FILE *f)
{
    fprintf(f, "usage: kvd [options]\n"
               "kvd owns one GPU's KV cache and serves it to local clients over a Unix socket.\n"
               "Every option but --config, --help and --version is also a [server] key of the\n"
               "config file (--no-roofline-probe there: roofline-probe = no).\n\n");
    for (size_t i = 0; i < options_n_defs; i++) {
        const struct options_def *d = &options_defs[i];
        if (d->flags & OPTIONS_FILE_ONLY)
            continue;
        char head[64];
        int w = snprintf(head, sizeof(head), "  %s--%s%s%s",
                         !strcmp(d->name, "help")      ? "-h, "
                         : !strcmp(d->name, "version") ? "-V, "
                                                       : "",
                         d->name, d->arg ? " " : "", d->arg ? d->arg : "");
        const char *dflt = d->shown ? d->shown : d->dflt;
        fputs(head, f);
        /* the help, column 27, continuation lines indented to it */
        const char *h = d->help;
        bool first = true;
        while (*h) {
            const char *nl = strchr(h, '\n');
            int len = nl ? (int)(nl - h) : (int)strlen(h);
            if (first && w < 26)
                fprintf(f, "%*s", 27 - w, "");
            else
                fprintf(f, "\n%27s", "");
            fprintf(f, "%.*s", len, h);
            first = false;
            h += len + (nl ? 1 : 0);
        }
        if (dflt)
            fprintf(f, " (default %s)", dflt);
        fputc('\n', f);
    }
    fputs("\nSignals: SIGTERM/SIGINT drain and exit 0, SIGHUP reloads tenants and limits.\n", f);
}
