/* kvd: the daemon's entry point. Reads the config file and the command
 * line, picks the backend, makes the models (serve mode: their memory
 * managers now, their weights and executors when they load) or one memory
 * manager of the options' geometry (store mode), and runs the server until
 * SIGTERM.
 * Runs in the foreground; logs to stderr. */
#include <inttypes.h>
#include <stdio.h>
#include <time.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "kvd/protocol.h"
#include "kvd/status.h"
#include "kvd/version.h"
#include "kvmm.h"
#include "kvstreams.h"
#include "pages.h"
#include "acct.h"
#include "log.h"
#include "http.h"
#include "metrics.h"
#include "model.h"
#include "models.h"
#include "ops_generate.h"
#include "ops_session.h"
#include "ops_text.h"
#include "workpool.h"
#include "options.h"
#include "roofline.h"
#include "server.h"

static int pick_backend(const struct options *o, struct backend **be)
{
    struct kvd_error err = {0};
    int rc;
#ifdef KVD_CUDA_EMULATE
    /* This build's cuda backend is the CPU emulator (docs/emulation.md): a
     * test of the GPU path, never a faster choice, so auto takes the cpu. */
    if (o->backend == OPTIONS_BACKEND_AUTO)
        log_info("backend: cpu (the cuda backend of this build is the CPU emulator: "
                 "--backend cuda to run it)");
    if (o->backend == OPTIONS_BACKEND_CUDA) {
#else
    if (o->backend != OPTIONS_BACKEND_CPU) {
#endif
        rc = backend_cuda_new(0, be, &err);
        if (rc == 0)
            return 0;
        if (o->backend == OPTIONS_BACKEND_CUDA) {
            log_err("--backend cuda: %s", err.message[0] ? err.message : "no CUDA device");
            return rc;
        }
        log_info("backend: cuda not available (%s); using cpu",
                 err.message[0] ? err.message : "no device");
    }
    rc = backend_cpu_new(be);
    if (rc)
        log_err("backend cpu: out of memory");
    return rc;
}

/* Store mode's KV in blocks: --device-blocks, or --gpu-mem of the device's
 * free memory, or the default; --host-blocks or --host-mem. (The models'
 * budget is sized in models_budget.c.) */
static int size_arenas(const struct options *o, struct backend *be, size_t block_bytes,
                       uint32_t *dev, uint32_t *host)
{
    *dev = OPTIONS_DEFAULT_DEVICE_BLOCKS;
    if (o->device_blocks) {
        *dev = o->device_blocks;
    } else if (o->gpu_mem > 0) {
        size_t mem = 0, total = 0;
        if (be->ops->mem_info)
            be->ops->mem_info(be, &mem, &total);
        if (mem == 0) {
            log_err("--gpu-mem: cannot tell how much device memory there is; use --device-blocks");
            return KVD_EBADREQ;
        }
        double n = (double)mem * o->gpu_mem / (double)block_bytes;
        if (n < 1) {
            log_err("--gpu-mem %.3f of %zu bytes is less than one %zu-byte block", o->gpu_mem, mem,
                    block_bytes);
            return KVD_EBADREQ;
        }
        *dev = n >= (double)(UINT32_MAX - 1) ? UINT32_MAX - 1 : (uint32_t)n;
    }
    *host = OPTIONS_DEFAULT_HOST_BLOCKS;
    if (o->host_blocks != UINT32_MAX) {
        *host = o->host_blocks;
    } else if (o->host_mem) {
        uint64_t n = o->host_mem / block_bytes;
        *host = n >= UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)n;
    }
    return 0;
}

/* Descriptors: the soft limit is raised to the hard one (the loop uses
 * epoll, not select), so a flood of idle connections on the metrics port
 * cannot take the descriptors tenants need; a limit below what
 * max-connections needs is logged. */
static void raise_fd_limit(const struct options *o)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    if (rl.rlim_cur < rl.rlim_max) {
        rlim_t was = rl.rlim_cur;
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
            log_info("descriptors: soft limit raised from %llu to %llu", (unsigned long long)was,
                     (unsigned long long)rl.rlim_cur);
    }
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (rlim_t)o->max_conns + 64)
        log_warn("descriptors: the limit (%llu) is below max-connections (%u) + 64; "
                 "connections will wait for free descriptors",
                 (unsigned long long)rl.rlim_cur, o->max_conns);
}

/* The largest divisor of n that is at most m (at least 1). */
static uint64_t divisor_under(uint64_t n, uint64_t m)
{
    for (uint64_t d = m < n ? m : n; d > 1; d--)
        if (n % d == 0)
            return d;
    return 1;
}

/* Store mode's page budget: --device-bytes, else the device blocks
 * (--device-blocks, --gpu-mem or the default) in bytes; the host tier's
 * --host-mem, else its blocks in bytes. A tier given as a number of
 * blocks (and no --page-bytes) is cut into pages of whole blocks, the most
 * that divide that number up to the default page, so the pool holds
 * exactly that many blocks; a page that is then no multiple of the
 * backend's granularity makes the pool one arena allocated up front,
 * which kv_export cannot hand out. */
static int size_budget(const struct options *o, struct backend *be, size_t block_bytes,
                       struct kvpages_conf *pc)
{
    uint32_t dev = 0, host = 0;
    memset(pc, 0, sizeof *pc);
    if (!o->device_bytes && size_arenas(o, be, block_bytes, &dev, &host) != 0)
        return KVD_EBADREQ;
    if (o->device_bytes && size_arenas(o, be, block_bytes, &dev, &host) != 0)
        dev = 0; /* --gpu-mem's errors do not matter when --device-bytes is given */
    pc->bytes[KVD_TIER_DEVICE] = o->device_bytes ? o->device_bytes : (uint64_t)dev * block_bytes;
    pc->bytes[KVD_TIER_HOST] =
        o->host_blocks == UINT32_MAX && o->host_mem ? o->host_mem : (uint64_t)host * block_bytes;
    pc->page_bytes[KVD_TIER_DEVICE] = pc->page_bytes[KVD_TIER_HOST] = o->page_bytes;
    bool in_blocks[2] = {!o->device_bytes && (o->device_blocks || o->gpu_mem <= 0),
                         o->host_blocks != UINT32_MAX || !o->host_mem};
    uint32_t n[2] = {dev, host};
    for (int t = 0; t < 2 && !o->page_bytes; t++)
        if (in_blocks[t] && n[t]) {
            uint64_t most = kvpages_default_page(be, (enum kvd_tier)t, pc->bytes[t]) / block_bytes;
            pc->page_bytes[t] = divisor_under(n[t], most ? most : 1) * block_bytes;
            pc->exact[t] = true;
        }
    return 0;
}

/* Store mode: one kvmm of the options' geometry on a page budget of its
 * own, with the disk and remote tiers the options ask for. 0, or the exit
 * status. */
static int store_kvmm(const struct options *opts, struct backend *be, struct kvmm **out,
                      struct kvpages **pages)
{
    struct kvd_error kerr;
    struct kvmm_config mc = {
        .geom = opts->geom,
        .be = be,
        .evict_policy = opts->evict_policy == OPTIONS_EVICT_LRU ? KVMM_EVICT_LRU : KVMM_EVICT_HITS,
        .warm_bytes = options_warm_bytes(opts)};
    if (kv_geom_check(&mc.geom, &kerr) != 0) {
        log_err("%s", kerr.message);
        return 2;
    }
    size_t bb = kv_block_bytes(&mc.geom);
    struct kvpages_conf pc;
    if (size_budget(opts, be, bb, &pc) != 0)
        return 2;
    if (kvpages_new(be, &pc, pages, &kerr) != 0) {
        log_err("the page budget: %s", kerr.message);
        return 2;
    }
    mc.pages = *pages;
    int rc = kvmm_new(&mc, out);
    if (rc) {
        log_err("cannot create the KV memory manager: %s (a budget of %llu device + %llu host "
                "bytes in pages of %llu, blocks of %zu bytes)",
                kvd_err_code(rc), (unsigned long long)pc.bytes[KVD_TIER_DEVICE],
                (unsigned long long)pc.bytes[KVD_TIER_HOST],
                (unsigned long long)kvpages_page_bytes(*pages, KVD_TIER_DEVICE), bb);
        return 1;
    }
    struct kvmm_stats ks;
    kvmm_lock(*out);
    kvmm_stats(*out, &ks);
    kvmm_unlock(*out);
    log_info("store mode: backend %s, %u layers x %u kv heads x %u head_dim %s, %u tokens per "
             "block (%zu bytes); pages: device %u of %llu bytes (%u blocks each), host %u of "
             "%llu bytes: up to %u device + %u host blocks",
             be->ops->name, mc.geom.layers, mc.geom.kv_heads, mc.geom.head_dim,
             kv_dtype_name(mc.geom.dtype), mc.geom.block_tokens, bb,
             kvpages_total(*pages, KVD_TIER_DEVICE),
             (unsigned long long)kvpages_page_bytes(*pages, KVD_TIER_DEVICE),
             ks.blocks_per_page[KVD_TIER_DEVICE], kvpages_total(*pages, KVD_TIER_HOST),
             (unsigned long long)kvpages_page_bytes(*pages, KVD_TIER_HOST), ks.device_total,
             ks.host_total);
    if (opts->disk_dir[0]) {
        struct kvmm_disk_conf dc = {.dir = opts->disk_dir,
                                    .max_bytes = opts->disk_max_bytes,
                                    .writeback_ms = opts->disk_writeback_ms};
        struct kvmm_disk_stats ds;
        if (kvmm_disk_open(*out, &dc, &kerr) != 0) {
            log_err("--disk-dir %s: %s", opts->disk_dir, kerr.message);
            return 2;
        }
        kvmm_disk_stats(*out, &ds);
        log_info("disk tier %s: %" PRIu64 " slots of %" PRIu64 " bytes (%.1f GiB), %" PRIu64
                 " cached blocks found (%" PRIu64 " records refused); write-behind %u ms",
                 opts->disk_dir, ds.tier.slots, ds.tier.slot_bytes,
                 (double)ds.tier.file_bytes / (1 << 30), ds.tier.loaded, ds.tier.dropped_at_load,
                 opts->disk_writeback_ms);
    }
    if (opts->remote[0]) {
        struct kvmm_remote_conf rc_ = {.url = opts->remote,
                                       .key_file = opts->remote_key_file,
                                       .insecure = opts->remote_insecure,
                                       .timeout_ms = opts->remote_timeout_ms,
                                       .value_bytes = opts->remote_value_bytes,
                                       .ttl_s = opts->remote_ttl_s,
                                       .min_hits = opts->remote_min_hits};
        if (kvmm_remote_open(*out, &rc_, &kerr) != 0) {
            log_err("--remote: %s", kerr.message);
            return 2;
        }
    }
    return 0;
}

/* Writes back what the disk tier of mm has not written yet, within
 * disk-flush-s (nothing commits any more). */
static void disk_flush(const struct options *opts, struct kvmm *mm, const char *what)
{
    if (!mm || !kvmm_disk_on(mm))
        return;
    size_t written, left;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvmm_disk_flush(mm, opts->disk_flush_s * 1000u, &written, &left);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    if (left)
        log_warn("disk tier%s: wrote back %zu blocks in %.0f ms; %zu were not written "
                 "(disk-flush-s %u)",
                 what, written, ms, left, opts->disk_flush_s);
    else
        log_info("disk tier%s: wrote back %zu blocks in %.0f ms", what, written, ms);
}

int main(int argc, char **argv)
{
    struct options opts;
    struct config cfg;
    char err[512];         /* metrics and http report into a buffer */
    struct kvd_error kerr; /* everything else into one error value */
    struct backend *be = NULL;
    struct kvmm *mm = NULL;       /* store mode's; serve mode: the first model's */
    struct models *models = NULL; /* serve mode: every model (models.h) */
    struct kvpages *pages = NULL; /* store mode's page budget (the models own theirs) */
    struct server *srv = NULL;
    struct ops_generate *gen = NULL;   /* generate and cancel, serve mode */
    struct workpool *pool = NULL;      /* the text workers */
    struct workpool *disk_pool = NULL; /* the disk tier's prefetch workers */
    struct kvstreams *kvev = NULL;     /* the KV events streams (--kv-events) */
    struct ops_text *text_ops = NULL;
    struct ops_session *session_ops = NULL;
    int status = 1;
    /* Observability: shared by the executors (writers), stats and metrics. */
    struct roofline rl;
    struct acct acct;
    struct metrics *metrics = NULL;
    struct http_api *http = NULL; /* the OpenAI-compatible API (--http, --http-socket) */
    roofline_init(&rl);
    acct_init(&acct);

    options_defaults(&opts);
    log_init(opts.log_level);
    if (config_defaults(&cfg) != 0) {
        log_err("out of memory");
        return 1;
    }
    const char *cfg_path = options_find_config(argc, argv);
    if (cfg_path && config_load(cfg_path, &cfg, &opts, &kerr) != 0) {
        log_err("%s", kerr.message);
        status = 2;
        goto out_cfg;
    }
    /* The command line wins over the file's [server] section. */
    if (options_parse(&opts, argc, argv, &kerr) != 0) {
        log_err("%s", kerr.message);
        status = 2;
        goto out_cfg;
    }
    if (opts.help) {
        options_usage(stdout);
        status = 0;
        goto out_cfg;
    }
    if (opts.version) {
        printf("kvd %s (protocol %d)\n", KVD_VERSION_STRING, KVD_PROTOCOL_VERSION);
        status = 0;
        goto out_cfg;
    }
    log_set_level(opts.log_level);
    raise_fd_limit(&opts);
    if (pick_backend(&opts, &be) != 0)
        goto out_cfg;
    bool serve = opts.model_path[0] || opts.n_models;
    if (!serve && opts.draft_model_path[0]) {
        log_err("--draft-model needs --model (the draft drafts for a served model)");
        status = 2;
        goto out_be;
    }
    if (serve && opts.roofline_probe) {
        /* Before any arena takes the device's memory: the probe needs a
         * few hundred MiB for a moment on cuda. */
        struct roofline_ceilings ce;
        int prc = roofline_measure(be, opts.threads, &ce);
        if (prc == 0 && ce.measured) {
            log_info("roofline ceilings: %.1f GB/s, %.1f GFLOP/s (%s, %.0f ms)",
                     ce.bytes_per_s / 1e9, ce.flops_per_s / 1e9, ce.how, ce.measure_ms);
            roofline_set_ceilings(&rl, &ce);
        } else {
            log_warn("roofline: cannot measure the backend's ceilings (%s); fractions of peak "
                     "stay 0",
                     kvd_err_code(prc));
        }
    }
    if (serve && be->ops->kind == BACKEND_CPU)
        log_info("cpu compute threads: %ld",
                 opts.threads ? (long)opts.threads : sysconf(_SC_NPROCESSORS_ONLN));
    int rc;
    /* Text work (templates, tokenizing) runs on these, never on the loop. */
    struct workpool_conf wc = {.threads = opts.text_workers,
                               .max_per_tenant = opts.text_jobs_per_tenant};
    if ((rc = workpool_new(&wc, &pool)) != 0) {
        log_err("cannot start the text workers: %s", kvd_err_code(rc));
        goto out_be;
    }
    if (opts.disk_dir[0] || opts.remote[0]) {
        /* One pool prefetches from both tiers: disk first, then Redis. */
        struct workpool_conf dwc = {.threads = (opts.disk_dir[0] ? opts.disk_workers : 0) +
                                               (opts.remote[0] ? opts.remote_workers : 0),
                                    .max_per_tenant = opts.text_jobs_per_tenant,
                                    .nice = opts.prefetch_nice,
                                    .idle_after_ms = opts.prefetch_idle_ms};
        if ((rc = workpool_new(&dwc, &disk_pool)) != 0) {
            log_err("cannot start the prefetch workers: %s", kvd_err_code(rc));
            goto out_be;
        }
        if (opts.prefetch_idle_ms && !workpool_conf(disk_pool)->idle_after_ms)
            log_warn("prefetch-idle-ms: the prefetch workers may not return from SCHED_IDLE "
                     "(RLIMIT_NICE below %u, no CAP_SYS_NICE: systemd LimitNICE=+0); they run "
                     "at prefetch-nice %u",
                     20 - opts.prefetch_nice, opts.prefetch_nice);
    }
    if (serve) {
        /* Every model's header, text and kvmm now; weights when it loads. */
        struct models_conf mcf = {.be = be,
                                  .opts = &opts,
                                  .rl = &rl,
                                  .acct = &acct,
                                  .text_pool = pool,
                                  .disk_pool = disk_pool};
        if (models_new(&mcf, &models, &kerr) != 0) {
            log_err("%s", kerr.message);
            status = 2;
            goto out_be;
        }
        mm = models_kvmm(models_at(models, 0));
        log_info("serve mode: backend %s, %zu model%s%s", be->ops->name, models_count(models),
                 models_count(models) == 1 ? "" : "s", opts.device_bytes ? " on device-bytes" : "");
    } else if ((status = store_kvmm(&opts, be, &mm, &pages)) != 0) {
        goto out_mm;
    }
    status = 1;
    /* One KV events stream per model that has one (kvstreams.h). */
    if (kvstreams_start(&opts, models, models ? NULL : mm, &kvev, &kerr) != 0) {
        log_err("%s", kerr.message);
        status = 2;
        goto out_mm;
    }
    if (server_new(&opts, &cfg, cfg_path, mm, be, &srv) != 0)
        goto out_mm;
    {
        size_t n_ev;
        struct kvevents *const *ev = kvstreams_v(kvev, &n_ev);
        server_attach_kvevents(srv, ev, n_ev);
    }
    server_attach_obs(srv, &rl, &acct);
    server_attach_prefetch(srv, disk_pool);
    if (models && server_set_models(srv, models) != 0) {
        log_err("out of memory");
        goto out_srv;
    }
    if (ops_text_register(srv, NULL, pool, &text_ops) != 0) {
        log_err("cannot register the text ops");
        goto out_srv;
    }
    if (ops_session_register(srv, mm, disk_pool, &session_ops) != 0) {
        log_err("cannot register the session ops");
        goto out_srv;
    }
    if (opts.metrics_addr[0] && metrics_start(srv, opts.metrics_addr, opts.metrics_force, &metrics,
                                              NULL, err, sizeof(err)) != 0) {
        log_err("--metrics: %s", err);
        status = 2;
        goto out_srv;
    }
    if (models) {
        if (ops_generate_start(srv, models, &gen, &kerr) != 0) {
            log_err("cannot start the generate ops: %s", kerr.message);
            goto out_srv;
        }
        if (models_start(models, srv, &kerr) != 0) {
            log_err("%s", kerr.message);
            status = 2;
            goto out_srv;
        }
    }
    if (http_start(srv, gen, pool, &http, NULL, err, sizeof(err)) != 0) {
        log_err("--http/--http-socket: %s", err);
        status = 2;
        goto out_srv;
    }
    status = server_run(srv) == 0 ? 0 : 1;
out_srv:
    /* Answer anything still live while the server can post, close the
     * connections (their close hooks reach the executors), then stop
     * them. */
    models_drain(models);
    workpool_free(pool); /* its last jobs still answer through the server */
    pool = NULL;
    workpool_free(disk_pool);
    disk_pool = NULL;
    http_stop(http);
    ops_generate_release_loop(gen);
    metrics_stop(metrics);
    models_stop(models); /* before the loop's base goes: its events */
    server_free(srv);
    ops_text_free(text_ops);
    ops_session_free(session_ops);
    ops_generate_stop(gen);
out_mm:
    workpool_free(pool);
    pool = NULL;
    workpool_free(disk_pool);
    disk_pool = NULL;
    if (models) {
        for (size_t i = 0; i < models_count(models); i++) {
            char what[96];
            snprintf(what, sizeof what, " (model %s)", models_name(models_at(models, i)));
            disk_flush(&opts, models_kvmm(models_at(models, i)), what);
        }
    } else {
        disk_flush(&opts, mm, "");
    }
    kvstreams_stop(kvev); /* what is queued still goes out */
    if (models)
        models_free(models);
    else
        kvmm_free(mm);
    kvpages_free(pages); /* after the pool on it */
out_be:
    workpool_free(pool);
    workpool_free(disk_pool);
    backend_free(be);
out_cfg:
    config_free(&cfg);
    acct_destroy(&acct);
    roofline_destroy(&rl);
    return status;
}
