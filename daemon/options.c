/* options: command line and [server] settings (see options.h). Numbers are
 * parsed strictly (whole string, range checked); sizes take K/M/G suffixes
 * (powers of 1024). */
#include "options.h"
#include "metrics.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "kvd/protocol.h"
#include "kvd/status.h"
#include "log.h"

void options_defaults(struct options *o)
{
    memset(o, 0, sizeof(*o));
    o->backend = OPTIONS_BACKEND_AUTO;
    o->device_blocks = 0;
    o->host_blocks = UINT32_MAX;
    o->geom.layers = 4;
    o->geom.kv_heads = 4;
    o->geom.head_dim = 64;
    o->geom.dtype = KV_F16;
    o->geom.block_tokens = 16;
    o->max_frame = KVD_MAX_FRAME_DEFAULT;
    o->max_conns = 1024;
    o->max_conns_per_uid = 64;
    o->admin_reserved_conns = 8;
    o->max_queued_per_conn = 1024;
    o->max_queued_per_tenant = 4096;
    o->max_unread_output = (uint64_t)16 << 20;
    o->max_buffered = (uint64_t)1 << 30;
    o->metrics_max_conns = 16;
    o->step_tokens = 512;
    o->step_seqs = 64;
    o->queue_timeout_ms = 60000;
    o->log_level = LOG_LVL_INFO;
    o->roofline_probe = true;
}

/* A yes/no setting: NULL (a command-line flag) is yes. */
static int set_bool(bool *out, const char *name, const char *v, char *err, size_t errlen)
{
    if (!v || !strcmp(v, "yes") || !strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "on"))
        *out = true;
    else if (!strcmp(v, "no") || !strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "off"))
        *out = false;
    else {
        snprintf(err, errlen, "%s: '%s' is not yes or no", name, v);
        return KVD_EBADREQ;
    }
    return 0;
}

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
        case 'k': case 'K': shift = 10; break;
        case 'm': case 'M': shift = 20; break;
        case 'g': case 'G': shift = 30; break;
        case 't': case 'T': shift = 40; break;
        default: return -1;
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

static int set_u32(uint32_t *dst, const char *name, const char *v, uint64_t lo, uint64_t hi,
                   char *err, size_t errlen)
{
    uint64_t x;
    if (parse_u64(v, lo, hi, false, &x)) {
        snprintf(err, errlen, "%s: '%s' is not a whole number in [%" PRIu64 ", %" PRIu64 "]",
                 name, v ? v : "", lo, hi);
        return KVD_EBADREQ;
    }
    *dst = (uint32_t)x;
    return 0;
}

static int set_str(char *dst, size_t cap, const char *name, const char *v, char *err,
                   size_t errlen)
{
    if (!v || strlen(v) >= cap) {
        snprintf(err, errlen, "%s: missing or longer than %zu bytes", name, cap - 1);
        return KVD_EBADREQ;
    }
    strcpy(dst, v);
    return 0;
}

int options_set(struct options *o, const char *name_in, const char *v, char *err, size_t errlen)
{
    char name[64];
    size_t i;
    for (i = 0; name_in[i] && i + 1 < sizeof(name); i++)
        name[i] = name_in[i] == '_' ? '-' : name_in[i];
    name[i] = '\0';

    if (!strcmp(name, "help")) {
        o->help = true;
        return 0;
    }
    if (!strcmp(name, "version")) {
        o->version = true;
        return 0;
    }
    /* Observability (metrics.h, roofline.h). */
    if (!strcmp(name, "metrics-force"))
        return set_bool(&o->metrics_force, name, v, err, errlen);
    if (!strcmp(name, "roofline-probe"))
        return set_bool(&o->roofline_probe, name, v, err, errlen);
    if (!strcmp(name, "no-roofline-probe") && !v) {
        o->roofline_probe = false;
        return 0;
    }
    if (!strcmp(name, "metrics") && v) {
        char host[64];
        uint16_t port;
        bool loopback;
        if (metrics_parse_addr(v, host, sizeof(host), &port, &loopback, err, errlen))
            return KVD_EBADREQ;
        return set_str(o->metrics_addr, sizeof(o->metrics_addr), name, v, err, errlen);
    }
    if (!v) {
        snprintf(err, errlen, "%s needs a value", name);
        return KVD_EBADREQ;
    }
    if (!strcmp(name, "socket")) {
        if (v[0] != '/') {
            snprintf(err, errlen, "socket: '%s' is not an absolute path", v);
            return KVD_EBADREQ;
        }
        return set_str(o->socket_path, sizeof(o->socket_path), name, v, err, errlen);
    }
    if (!strcmp(name, "metrics-group"))
        return set_str(o->metrics_group, sizeof(o->metrics_group), name, v, err, errlen);
    if (!strcmp(name, "metrics-max-connections"))
        return set_u32(&o->metrics_max_conns, name, v, 1, 100000, err, errlen);
    if (!strcmp(name, "metrics-token-file"))
        return set_str(o->metrics_token_file, sizeof(o->metrics_token_file), name, v, err,
                       errlen);
    if (!strcmp(name, "socket-group"))
        return set_str(o->socket_group, sizeof(o->socket_group), name, v, err, errlen);
    if (!strcmp(name, "config"))
        return set_str(o->config_path, sizeof(o->config_path), name, v, err, errlen);
    if (!strcmp(name, "model"))
        return set_str(o->model_path, sizeof(o->model_path), name, v, err, errlen);
    if (!strcmp(name, "backend")) {
        if (!strcmp(v, "auto"))
            o->backend = OPTIONS_BACKEND_AUTO;
        else if (!strcmp(v, "cpu"))
            o->backend = OPTIONS_BACKEND_CPU;
        else if (!strcmp(v, "cuda"))
            o->backend = OPTIONS_BACKEND_CUDA;
        else {
            snprintf(err, errlen, "backend: '%s' is not auto, cpu or cuda", v);
            return KVD_EBADREQ;
        }
        return 0;
    }
    if (!strcmp(name, "device-blocks"))
        return set_u32(&o->device_blocks, name, v, 1, UINT32_MAX - 1, err, errlen);
    if (!strcmp(name, "host-blocks"))
        return set_u32(&o->host_blocks, name, v, 0, UINT32_MAX - 1, err, errlen);
    if (!strcmp(name, "gpu-mem")) {
        char *end;
        errno = 0;
        double f = strtod(v, &end);
        if (errno || end == v || *end || !(f > 0.0 && f <= 1.0)) {
            snprintf(err, errlen, "gpu-mem: '%s' is not a fraction in (0, 1]", v);
            return KVD_EBADREQ;
        }
        o->gpu_mem = f;
        return 0;
    }
    if (!strcmp(name, "host-mem")) {
        if (parse_u64(v, 0, UINT64_MAX, true, &o->host_mem)) {
            snprintf(err, errlen, "host-mem: '%s' is not a byte size (e.g. 4G)", v);
            return KVD_EBADREQ;
        }
        return 0;
    }
    if (!strcmp(name, "block-tokens"))
        return set_u32(&o->geom.block_tokens, name, v, 1, 4096, err, errlen);
    if (!strcmp(name, "kv-layers"))
        return set_u32(&o->geom.layers, name, v, 1, 1024, err, errlen);
    if (!strcmp(name, "kv-heads"))
        return set_u32(&o->geom.kv_heads, name, v, 1, 1024, err, errlen);
    if (!strcmp(name, "head-dim"))
        return set_u32(&o->geom.head_dim, name, v, 1, 4096, err, errlen);
    if (!strcmp(name, "kv-dtype")) {
        if (!strcmp(v, "f16"))
            o->geom.dtype = KV_F16;
        else if (!strcmp(v, "bf16"))
            o->geom.dtype = KV_BF16;
        else if (!strcmp(v, "f32"))
            o->geom.dtype = KV_F32;
        else {
            snprintf(err, errlen, "kv-dtype: '%s' is not f16, bf16 or f32", v);
            return KVD_EBADREQ;
        }
        return 0;
    }
    if (!strcmp(name, "max-frame")) {
        uint64_t x;
        if (parse_u64(v, KVD_MAX_FRAME_MIN, KVD_MAX_FRAME_LIMIT, true, &x)) {
            snprintf(err, errlen, "max-frame: '%s' is not a size in [%u, %u] bytes", v,
                     KVD_MAX_FRAME_MIN, KVD_MAX_FRAME_LIMIT);
            return KVD_EBADREQ;
        }
        o->max_frame = (uint32_t)x;
        return 0;
    }
    if (!strcmp(name, "max-connections"))
        return set_u32(&o->max_conns, name, v, 1, 1000000, err, errlen);
    if (!strcmp(name, "max-connections-per-uid"))
        return set_u32(&o->max_conns_per_uid, name, v, 1, 1000000, err, errlen);
    if (!strcmp(name, "admin-reserved-connections"))
        return set_u32(&o->admin_reserved_conns, name, v, 0, 1000000, err, errlen);
    if (!strcmp(name, "max-queued-per-connection"))
        return set_u32(&o->max_queued_per_conn, name, v, 1, 10000000, err, errlen);
    if (!strcmp(name, "max-queued-per-tenant"))
        return set_u32(&o->max_queued_per_tenant, name, v, 1, 10000000, err, errlen);
    if (!strcmp(name, "max-unread-output") || !strcmp(name, "max-buffered")) {
        uint64_t x;
        bool unread = name[4] == 'u';
        if (parse_u64(v, unread ? 64 << 10 : 1 << 20, (uint64_t)1 << 50, true, &x)) {
            snprintf(err, errlen, "%s: '%s' is not a byte size of at least %s (e.g. 16M)", name,
                     v, unread ? "64K" : "1M");
            return KVD_EBADREQ;
        }
        *(unread ? &o->max_unread_output : &o->max_buffered) = x;
        return 0;
    }
    if (!strcmp(name, "step-tokens"))
        return set_u32(&o->step_tokens, name, v, 1, 1u << 20, err, errlen);
    if (!strcmp(name, "step-seqs"))
        return set_u32(&o->step_seqs, name, v, 1, 4096, err, errlen);
    if (!strcmp(name, "threads"))
        return set_u32(&o->threads, name, v, 0, 256, err, errlen);
    if (!strcmp(name, "queue-timeout"))
        return set_u32(&o->queue_timeout_ms, name, v, 0, 86400000, err, errlen);
    if (!strcmp(name, "log-level")) {
        int l = log_level_parse(v);
        if (l < 0) {
            snprintf(err, errlen, "log-level: '%s' is not error, warning, notice, info or debug",
                     v);
            return KVD_EBADREQ;
        }
        o->log_level = l;
        return 0;
    }
    snprintf(err, errlen, "unknown setting '%s'", name_in);
    return KVD_EBADREQ;
}

static const struct option long_opts[] = {
    {"socket", required_argument, 0, 0},      {"socket-group", required_argument, 0, 0},
    {"config", required_argument, 0, 0},      {"model", required_argument, 0, 0},
    {"backend", required_argument, 0, 0},     {"device-blocks", required_argument, 0, 0},
    {"gpu-mem", required_argument, 0, 0},     {"host-blocks", required_argument, 0, 0},
    {"host-mem", required_argument, 0, 0},    {"block-tokens", required_argument, 0, 0},
    {"kv-layers", required_argument, 0, 0},   {"kv-heads", required_argument, 0, 0},
    {"head-dim", required_argument, 0, 0},    {"kv-dtype", required_argument, 0, 0},
    {"max-frame", required_argument, 0, 0},   {"max-connections", required_argument, 0, 0},
    {"log-level", required_argument, 0, 0},   {"metrics", required_argument, 0, 0},
    {"metrics-force", no_argument, 0, 0},     {"no-roofline-probe", no_argument, 0, 0},
    {"metrics-group", required_argument, 0, 0},
    {"metrics-token-file", required_argument, 0, 0},
    {"metrics-max-connections", required_argument, 0, 0},
    {"step-tokens", required_argument, 0, 0}, {"step-seqs", required_argument, 0, 0},
    {"queue-timeout", required_argument, 0, 0}, {"threads", required_argument, 0, 0},
    {"max-connections-per-uid", required_argument, 0, 0},
    {"admin-reserved-connections", required_argument, 0, 0},
    {"max-queued-per-connection", required_argument, 0, 0},
    {"max-queued-per-tenant", required_argument, 0, 0},
    {"max-unread-output", required_argument, 0, 0},
    {"max-buffered", required_argument, 0, 0},
    {"help", no_argument, 0, 'h'},
    {"version", no_argument, 0, 'V'},         {0, 0, 0, 0},
};

int options_parse(struct options *o, int argc, char **argv, char *err, size_t errlen)
{
    int idx = 0, c;
    optind = 0; /* GNU: full reinitialisation, so parsing twice is safe */
    opterr = 0;
    while ((c = getopt_long(argc, argv, "hV", long_opts, &idx)) != -1) {
        int rc;
        if (c == 'h')
            rc = options_set(o, "help", NULL, err, errlen);
        else if (c == 'V')
            rc = options_set(o, "version", NULL, err, errlen);
        else if (c == 0)
            rc = options_set(o, long_opts[idx].name, optarg, err, errlen);
        else {
            snprintf(err, errlen, "unknown or incomplete option '%s' (see --help)",
                     argv[optind - 1]);
            return KVD_EBADREQ;
        }
        if (rc)
            return rc;
    }
    if (optind < argc) {
        snprintf(err, errlen, "unexpected argument '%s' (see --help)", argv[optind]);
        return KVD_EBADREQ;
    }
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
    fprintf(f,
            "usage: kvd [options]\n"
            "kvd owns one GPU's KV cache and serves it to local clients over a Unix socket.\n"
            "\n"
            "  --socket PATH          listen here (default " KVD_DEFAULT_SOCKET ";\n"
            "                         non-root without access: $XDG_RUNTIME_DIR/kvd.sock\n"
            "                         or /tmp/kvd-UID/kvd.sock); ignored under socket activation\n"
            "  --socket-group NAME    group owning the socket (mode 0660)\n"
            "  --config FILE          INI file: [server] settings, [limits], [admin], [tenant:NAME]\n"
            "  --backend auto|cpu|cuda  where the KV arena lives (default auto)\n"
            "  --model FILE           GGUF model to serve (omit for store mode)\n"
            "  --device-blocks N      KV blocks in the device arena (default 1024)\n"
            "  --gpu-mem FRACTION     or: this fraction of device memory for KV blocks\n"
            "  --host-blocks N        blocks in the host tier (default 1024; 0 = none)\n"
            "  --host-mem BYTES       or: this many bytes of host tier (e.g. 8G)\n"
            "  --block-tokens N       tokens per block (default 16)\n"
            "  --kv-layers L --kv-heads H --head-dim D --kv-dtype f16|bf16|f32\n"
            "                         store-mode KV geometry (default 4, 4, 64, f16)\n"
            "  --max-frame BYTES      largest frame accepted (default 64M)\n"
            "  --max-connections N    concurrent client connections (default 1024)\n"
            "  --max-connections-per-uid N  connections one uid may hold (default 64;\n"
            "                         admins are exempt)\n"
            "  --admin-reserved-connections N  of --max-connections, slots only admins\n"
            "                         may take (default 8)\n"
            "  --max-queued-per-connection N  generates in flight per connection before\n"
            "                         'busy' (default 1024)\n"
            "  --max-queued-per-tenant N  generates in flight per tenant before 'busy'\n"
            "                         (default 4096)\n"
            "  --max-unread-output BYTES  a connection's unread output above which its\n"
            "                         generates end with 'busy' (default 16M)\n"
            "  --max-buffered BYTES   daemon-wide buffered input + output above which the\n"
            "                         connection holding most is dropped (default 1G)\n"
            "  --step-tokens N        executor token budget per step (default 512)\n"
            "  --step-seqs N          executor sequences per step (default 64)\n"
            "  --queue-timeout MS     a generate not started by then is answered busy\n"
            "                         (default 60000; 0 = wait as long as it takes)\n"
            "  --threads N            cpu backend: compute threads (default 0 = one per CPU)\n"
            "  --log-level LEVEL      error, warning, notice, info (default) or debug\n"
            "  --metrics unix[:PATH]  serve Prometheus metrics on a Unix socket (default PATH:\n"
            "                         metrics.sock beside --socket; mode 0600, or 0660 for\n"
            "                         --metrics-group); off by default\n"
            "  --metrics HOST:PORT    or over TCP (loopback only, e.g. 127.0.0.1:9464)\n"
            "  --metrics-group NAME   group that may read a unix: metrics socket (admins)\n"
            "  --metrics-token-file F require 'Authorization: Bearer <token in F>'\n"
            "  --metrics-max-connections N  open metrics connections at most (default 16)\n"
            "  --metrics-force        allow a non-loopback --metrics address\n"
            "  --no-roofline-probe    skip the startup measurement of the backend's\n"
            "                         FLOP/s and bytes/s ceilings (about 0.3 s)\n"
            "  -h, --help             this text\n"
            "  -V, --version          the version\n"
            "\n"
            "Signals: SIGTERM/SIGINT drain and exit 0, SIGHUP reloads tenants and limits.\n");
}
