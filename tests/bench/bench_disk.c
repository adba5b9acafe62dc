/* bench_disk: the disk tier's own speed (a program that prints numbers, not
 * a test), through the disktier API directly, next to the raw file system.
 *
 *   bench_disk throughput [DIR] [MIB]
 *       For 4 KiB blocks (a tiny model's), 32 KiB (the README's demo
 *       model), 64 KiB and 512 KiB (a 1B-class model's 16-token block): MIB
 *       MiB of slots (default 1024) written with disktier_put from one
 *       thread, disktier_sync, then read back as kvd's prefetch reads a
 *       chain: disktier_lookup of a window of blocks, disktier_read_many
 *       (every read checked); then again with one disktier_read per block
 *       (one request at a time, the path before batching). In the
 *       same run, dd of the same size with bs=1M oflag=direct / iflag=direct
 *       on the same directory. Prints GB/s of slot bytes (what hits the
 *       disk: a 4 KiB header per slot included), GB/s of block data, and
 *       the tier/dd ratio; and dd with bs = the slot size (one request per
 *       block, as the tier does). Three rounds; the median is reported.
 *   bench_disk reads [DIR] [MIB] [ROUNDS]
 *       Reads only, for 64 KiB and 512 KiB blocks (KVD_BENCH_BLOCKS to
 *       choose): MIB (default 256) of slots written once and a dd file of
 *       the same size, then ROUNDS (default 9) rounds of a full read of each
 *       in turn (the order flips each round): the tier's as in throughput,
 *       dd bs=1M iflag=direct. Prints each round's ratio, their median, and
 *       the CPU each used per GB (the tier's own, dd's as a child's).
 *   bench_disk startup [DIR] [SLOTS]
 *       A tier of SLOTS slots (default 1M; 4 KiB blocks of 16 tokens: 8 KiB
 *       slots, an 8 GiB block file), filled with SLOTS puts, synced and
 *       closed; then disktier_open is timed with the page cache dropped
 *       (cold; needs root) and again with it warm.
 *
 * DIR defaults to a fresh mkdtemp under /var/tmp (not tmpfs: the tier uses
 * O_DIRECT). Everything the bench writes is removed at the end. Times are
 * wall clock (CLOCK_MONOTONIC). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "disktier.h"

#define BT 16
#define ROUNDS 3

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* CPU seconds (user + system) used so far by who (RUSAGE_SELF, RUSAGE_CHILDREN: waited-for
 * children, here the dd runs). */
static double cpu_s(int who)
{
    struct rusage ru;
    if (getrusage(who, &ru) != 0)
        return 0;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static struct blockkey key_of(uint64_t i, uint64_t salt)
{
    return (struct blockkey){mix(i ^ salt), mix(i + 0x5bd1e995ull + salt)};
}

static void tokens_of(uint64_t i, uint32_t *t)
{
    for (int k = 0; k < BT; k++)
        t[k] = (uint32_t)(mix(i * BT + (uint64_t)k) % 32000);
}

static void rm_tier(const char *dir)
{
    static const char *const names[] = {"blocks.kvd", "index.kvd", "lock"};
    char p[4200];
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
}

static int drop_caches(void)
{
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (!f)
        return -1;
    int ok = fputs("3\n", f) >= 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* Runs a dd command; its seconds from dd's own "copied, X s" line (our
 * clock around it when that line is missing). -1 on failure. */
static double run_dd(const char *cmd)
{
    char line[512], full[1024];
    double t0 = now_s(), secs = -1;
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p)
        return -1;
    while (fgets(line, sizeof line, p)) {
        const char *c = strstr(line, "copied, ");
        if (c)
            secs = strtod(c + 8, NULL);
    }
    int st = pclose(p);
    double wall = now_s() - t0;
    if (st != 0) {
        fprintf(stderr, "bench_disk: `%s` failed\n", cmd);
        return -1;
    }
    return secs > 0 ? secs : wall;
}

struct tp {
    double put_s, sync_s, read_s, dd_w_s, dd_r_s;
    double dds_w_s, dds_r_s; /* dd with bs = the slot size */
    double read1_s;          /* one disktier_read per block (the old path) */
    double put1_s;           /* one disktier_put per block + sync (the old path) */
    uint64_t wreqs;          /* I/O requests of the batched writes */
    uint64_t reqs;           /* I/O requests of the batched reads */
};

/* How many blocks one batched read takes: a restore window of kvd's
 * prefetch (kvmm_disk.c: 8 MiB of slots, at most 256 blocks; a
 * 4096-token prompt of 16-token blocks is 256). */
static size_t window_of(size_t slot)
{
    size_t w = (8u << 20) / slot;
    return w < 1 ? 1 : w > 256 ? 256 : w;
}

/* A window of read_back: its batch, its first block and size, where its rd entries are. */
struct rb_win {
    struct disktier_batch *b;
    uint64_t at;
    size_t k;
    struct disktier_rd *rd;
};

/* Looks up blocks [at, at + win) (up to n) into rd, tokens and bufs, and starts reading
 * them. k = 0 when at >= n; -1 in *rc when a block is not there. */
static struct rb_win rb_start(struct disktier *dt, uint64_t at, uint64_t n, size_t win,
                              uint64_t salt, struct disktier_rd *rd, uint32_t (*toks)[BT],
                              unsigned char *bufs, size_t slot, int *rc)
{
    uint64_t ns = blockkey_ns("bench");
    struct rb_win w = {.at = at, .rd = rd};
    for (; at + w.k < n && w.k < win; w.k++) {
        struct blockkey key = key_of(at + w.k, salt);
        tokens_of(at + w.k, toks[w.k]);
        rd[w.k] = (struct disktier_rd){.slot = disktier_lookup(dt, ns, key),
                                       .key = key,
                                       .tokens = toks[w.k],
                                       .buf = bufs + w.k * slot};
        if (rd[w.k].slot == DISKTIER_NONE)
            *rc = -1;
    }
    if (w.k && *rc == 0)
        w.b = disktier_read_begin(dt, "bench", ns, rd, w.k);
    return w;
}

/* 0 when every block of the finished window holds its own bytes. */
static int rb_check(struct disktier *dt, const struct rb_win *w)
{
    for (size_t j = 0; j < w->k; j++) {
        uint64_t got;
        memcpy(&got, disktier_data(dt, w->rd[j].buf), sizeof got);
        if (w->rd[j].rc || got != w->at + j)
            return -1;
    }
    return 0;
}

/* Reads back blocks [0, n) of the round: in windows of win blocks, two in turn as kvd's
 * prefetch reads them (the next window's reads in flight while this one is waited for and
 * checked; bufs holds 2 * win slots), or one disktier_read each (win = 1). 0, or -1 when a
 * block is missing, fails or holds another block's bytes. */
static int read_back(struct disktier *dt, uint64_t n, uint64_t salt, size_t win,
                     unsigned char *bufs, size_t slot)
{
    uint64_t ns = blockkey_ns("bench");
    uint32_t(*toks)[BT] = malloc(sizeof *toks * 2 * win);
    struct disktier_rd *rd = calloc(2 * win, sizeof *rd);
    int rc = toks && rd ? 0 : -1;
    if (win == 1) {
        for (uint64_t i = 0; i < n && rc == 0; i++) {
            struct blockkey key = key_of(i, salt);
            tokens_of(i, toks[0]);
            uint32_t s = disktier_lookup(dt, ns, key);
            struct rb_win w = {.at = i, .k = 1, .rd = rd};
            rd[0] = (struct disktier_rd){.slot = s, .key = key, .tokens = toks[0], .buf = bufs};
            rd[0].rc =
                s == DISKTIER_NONE ? -1 : disktier_read(dt, s, "bench", ns, key, toks[0], bufs);
            rc = rb_check(dt, &w);
        }
    } else if (rc == 0) {
        int half = 0;
        struct rb_win cur = rb_start(dt, 0, n, win, salt, rd, toks, bufs, slot, &rc);
        while (cur.k && rc == 0) {
            half ^= 1;
            struct rb_win nxt = rb_start(dt, cur.at + cur.k, n, win, salt, rd + half * win,
                                         toks + half * win, bufs + half * win * slot, slot, &rc);
            disktier_read_end(cur.b);
            if (rb_check(dt, &cur))
                rc = -1;
            cur = nxt;
        }
        disktier_read_end(cur.b);
    }
    free(toks);
    free(rd);
    return rc;
}

/* One round for one block size: the tier's puts and reads, then dd. */
static bool g_no_uring; /* KVD_BENCH_NO_URING=1: the preadv path */

static int round_tp(const char *dir, size_t block_bytes, uint64_t mib, uint64_t salt, struct tp *o,
                    uint64_t *n_out, size_t *slot_out)
{
    struct disktier_conf c = {
        .dir = dir, .block_bytes = block_bytes, .block_tokens = BT, .no_uring = g_no_uring};
    struct disktier *dt;
    struct kvd_error e = {0};
    /* Sized for exactly n slots of (mib MiB) total. */
    size_t slot = 4096 + ((block_bytes + 4095) / 4096) * 4096;
    uint64_t n = (mib << 20) / slot;
    c.max_bytes = 4096 + n * slot;
    rm_tier(dir);
    if (disktier_open(&c, &dt, &e)) {
        fprintf(stderr, "bench_disk: disktier_open: %s\n", e.message);
        return -1;
    }
    struct disktier_stats st;
    disktier_stats(dt, &st);
    if (st.slot_bytes != slot || st.slots != n) {
        fprintf(stderr,
                "bench_disk: expected %" PRIu64 " slots of %zu, got %" PRIu64 " of %" PRIu64 "\n",
                n, slot, st.slots, st.slot_bytes);
        disktier_close(dt);
        return -1;
    }
    void *buf = disktier_buf_new(dt);
    uint32_t toks[BT];
    uint64_t ns = blockkey_ns("bench");
    unsigned char *data = disktier_data(dt, buf);
    for (size_t k = 0; k < block_bytes; k += 8) { /* not zeros: some KV-like entropy */
        uint64_t v = mix(k);
        memcpy(data + k, &v, block_bytes - k < 8 ? block_bytes - k : 8);
    }
    int rc = 0;
    size_t win = window_of(slot);
    unsigned char *bufs = NULL;
    uint32_t(*wtoks)[BT] = malloc(sizeof *wtoks * win);
    struct disktier_wr *wr = calloc(win, sizeof *wr);
    if (posix_memalign((void **)&bufs, 4096, 2 * win * slot) || !wtoks || !wr)
        rc = -1;
    if (rc == 0)
        memset(bufs, 0, 2 * win * slot);
    double t0 = now_s();
    /* As kvd's writer: a batch of blocks per disktier_put_many. */
    for (uint64_t i = 0; i < n && rc == 0; i += win) {
        size_t k = 0;
        for (; k < win && i + k < n; k++) {
            unsigned char *bd = disktier_data(dt, bufs + k * slot);
            memcpy(bd, data, block_bytes);
            uint64_t id = i + k;
            memcpy(bd, &id, sizeof id); /* each block differs */
            tokens_of(id, wtoks[k]);
            wr[k] = (struct disktier_wr){.ns_name = "bench",
                                         .ns = ns,
                                         .key = key_of(id, salt),
                                         .tokens = wtoks[k],
                                         .buf = bufs + k * slot};
        }
        if (disktier_put_many(dt, wr, k) != k)
            rc = -1;
    }
    double t1 = now_s();
    if (rc == 0)
        rc = disktier_sync(dt);
    double t_sync = now_s();
    disktier_stats(dt, &st);
    o->wreqs = st.write_reqs;
    free(wtoks);
    free(wr);
    if (rc == 0) /* the read path's first use (a ring, buffers) before the clock starts */
        rc = read_back(dt, n < win ? n : win, salt, win, bufs, slot);
    struct disktier_stats st0;
    disktier_stats(dt, &st0);
    double t2 = now_s();
    if (rc == 0)
        rc = read_back(dt, n, salt, win, bufs, slot);
    double t3 = now_s();
    disktier_stats(dt, &st);
    o->reqs = st.read_reqs - st0.read_reqs;
    double t4 = now_s();
    if (rc == 0)
        rc = read_back(dt, n, salt, 1, bufs, slot);
    o->read1_s = now_s() - t4;
    disktier_stats(dt, &st);
    free(bufs);
    disktier_close(dt);
    rm_tier(dir);
    /* One disktier_put per block (the writer before batching), then sync. */
    if (rc == 0 && disktier_open(&c, &dt, &e) == 0) {
        double t5 = now_s();
        for (uint64_t i = 0; i < n && rc == 0; i++) {
            memcpy(data, &i, sizeof i);
            tokens_of(i, toks);
            rc = disktier_put(dt, "bench", ns, key_of(i, salt + 1), toks, buf);
        }
        if (rc == 0)
            rc = disktier_sync(dt);
        o->put1_s = now_s() - t5;
        disktier_close(dt);
        rm_tier(dir);
    }
    free(buf);
    if (rc) {
        fprintf(stderr,
                "bench_disk: put/read failed (writes %" PRIu64 " reads %" PRIu64
                " io_errors %" PRIu64 " checksum_failures %" PRIu64 ")\n",
                st.writes, st.reads, st.io_errors, st.checksum_failures);
        return -1;
    }
    o->put_s = t1 - t0;
    o->sync_s = t_sync - t1;
    o->read_s = t3 - t2;

    char cmd[4400];
    uint64_t dd_mib = n * slot >> 20;
    snprintf(cmd, sizeof cmd, "dd if=/dev/zero of='%s/dd.tmp' bs=1M count=%" PRIu64 " oflag=direct",
             dir, dd_mib);
    o->dd_w_s = run_dd(cmd);
    snprintf(cmd, sizeof cmd, "dd if='%s/dd.tmp' of=/dev/null bs=1M iflag=direct", dir);
    o->dd_r_s = run_dd(cmd);
    snprintf(cmd, sizeof cmd,
             "dd if=/dev/zero of='%s/dd.tmp' bs=%zu count=%" PRIu64 " oflag=direct", dir, slot, n);
    o->dds_w_s = run_dd(cmd);
    snprintf(cmd, sizeof cmd, "dd if='%s/dd.tmp' of=/dev/null bs=%zu iflag=direct", dir, slot);
    o->dds_r_s = run_dd(cmd);
    snprintf(cmd, sizeof cmd, "%s/dd.tmp", dir);
    unlink(cmd);
    if (o->dd_w_s <= 0 || o->dd_r_s <= 0 || o->dds_w_s <= 0 || o->dds_r_s <= 0)
        return -1;
    /* dd moved dd_mib MiB, the tier n * slot bytes: scale dd to the same. */
    double scale = (double)(n * slot) / (double)(dd_mib << 20);
    o->dd_w_s *= scale;
    o->dd_r_s *= scale;
    *n_out = n;
    *slot_out = slot;
    return 0;
}

static int throughput(const char *dir, uint64_t mib)
{
    /* A tiny model's block, the README's demo model's (4 layers, 4 KV
     * heads of 32, f16: 32 KiB), 64 KiB, and a 1B-class model's. */
    static size_t sizes[8] = {4096, 32768, 65536, 512 * 1024};
    size_t n_sizes = 4;
    const char *only = getenv("KVD_BENCH_BLOCKS"); /* e.g. "4096,524288" */
    if (only && only[0]) {
        n_sizes = 0;
        for (char *end = NULL; *only && n_sizes < 8; only = *end ? end + 1 : end) {
            sizes[n_sizes++] = strtoul(only, &end, 10);
            if (end == only)
                break;
        }
    }
    g_no_uring = getenv("KVD_BENCH_NO_URING") && atoi(getenv("KVD_BENCH_NO_URING"));
    printf("disk tier throughput in %s, %" PRIu64 " MiB per pass, %d rounds (median); reads %s\n",
           dir, mib, ROUNDS, g_no_uring ? "batched, preadv" : "batched, io_uring where there");
    for (size_t z = 0; z < n_sizes; z++) {
        double put[ROUNDS], rd[ROUNDS], ddw[ROUNDS], ddr[ROUNDS], syn[ROUNDS];
        double dsw[ROUNDS], dsr[ROUNDS], rd1[ROUNDS], pt1[ROUNDS];
        uint64_t n = 0, reqs = 0, wreqs = 0;
        size_t slot = 0;
        for (int r = 0; r < ROUNDS; r++) {
            struct tp o;
            if (round_tp(dir, sizes[z], mib, (uint64_t)r * 7919 + z, &o, &n, &slot))
                return 1;
            put[r] = o.put_s + o.sync_s; /* durable: the sync belongs to the write */
            syn[r] = o.sync_s;
            rd[r] = o.read_s;
            rd1[r] = o.read1_s;
            pt1[r] = o.put1_s;
            wreqs = o.wreqs;
            reqs = o.reqs;
            ddw[r] = o.dd_w_s;
            ddr[r] = o.dd_r_s;
            dsw[r] = o.dds_w_s;
            dsr[r] = o.dds_r_s;
        }
        double bytes = (double)n * (double)slot, data = (double)n * (double)sizes[z];
        double p = median(put, ROUNDS), s = median(syn, ROUNDS), rr = median(rd, ROUNDS);
        double w = median(ddw, ROUNDS), d = median(ddr, ROUNDS);
        double sw = median(dsw, ROUNDS), sr = median(dsr, ROUNDS), r1 = median(rd1, ROUNDS);
        double p1 = median(pt1, ROUNDS);
        printf("block %zu B (slot %zu B, %" PRIu64 " blocks):\n", sizes[z], slot, n);
        printf("  write: put_many+sync %.3f GB/s slots (%.3f GB/s data; sync %.3f s)   dd bs=1M "
               "oflag=direct %.3f GB/s   ratio %.2fx\n",
               bytes / p / 1e9, data / p / 1e9, s, bytes / w / 1e9, w / p);
        printf("  write one block at a time (disktier_put): %.3f GB/s slots   ratio %.2fx of dd; "
               "batched: %.1f blocks per request, %.2fx of one at a time\n",
               bytes / p1 / 1e9, w / p1, wreqs ? (double)n / (double)wreqs : 0.0, p1 / p);
        printf(
            "  read:  lookup+read_many %.3f GB/s slots (%.3f GB/s data; %.1f us/block)   dd bs=1M "
            "iflag=direct %.3f GB/s   ratio %.2fx\n",
            bytes / rr / 1e9, data / rr / 1e9, rr / (double)n * 1e6, bytes / d / 1e9, d / rr);
        printf("  read one block at a time (disktier_read): %.3f GB/s slots   ratio %.2fx of dd; "
               "batched: %zu blocks per batch, %.1f blocks per request, %.2fx of one at a time\n",
               bytes / r1 / 1e9, d / r1, window_of(slot), reqs ? (double)n / (double)reqs : 0.0,
               r1 / rr);
        printf("  same request size: dd bs=%zu oflag=direct %.3f GB/s (tier %.2fx), iflag=direct "
               "%.3f GB/s (tier %.2fx)\n",
               slot, bytes / sw / 1e9, sw / p, bytes / sr / 1e9, sr / rr);
    }
    return 0;
}

/* Reads only, fairly: the tier's batched reads and dd iflag=direct bs=1M of a file of the
 * same size on the same file system, in short passes taken in turn (tier, dd, dd, tier, ...:
 * the order flips each round), so that both meet the same minute of a disk whose rate moves;
 * the ratio is taken per round (each pass against its neighbour), then the median. */
static int reads(const char *dir, uint64_t mib, int rounds)
{
    static size_t sizes[8] = {65536, 512 * 1024};
    size_t n_sizes = 2;
    const char *only = getenv("KVD_BENCH_BLOCKS");
    if (only && only[0]) {
        n_sizes = 0;
        for (char *end = NULL; *only && n_sizes < 8; only = *end ? end + 1 : end) {
            sizes[n_sizes++] = strtoul(only, &end, 10);
            if (end == only)
                break;
        }
    }
    if (rounds < 1 || rounds > 64)
        rounds = 9;
    g_no_uring = getenv("KVD_BENCH_NO_URING") && atoi(getenv("KVD_BENCH_NO_URING"));
    double la[3] = {0};
    (void)!getloadavg(la, 3);
    printf("disk tier reads vs dd in %s, %" PRIu64 " MiB per pass, %d rounds in turn (median); "
           "reads %s; load average %.2f %.2f %.2f\n",
           dir, mib, rounds, g_no_uring ? "preadv" : "io_uring where there", la[0], la[1], la[2]);
    for (size_t z = 0; z < n_sizes; z++) {
        size_t block_bytes = sizes[z], slot = 4096 + ((block_bytes + 4095) / 4096) * 4096;
        uint64_t n = (mib << 20) / slot;
        struct disktier_conf c = {.dir = dir,
                                  .block_bytes = block_bytes,
                                  .block_tokens = BT,
                                  .max_bytes = 4096 + n * slot,
                                  .no_uring = g_no_uring};
        struct disktier *dt;
        struct kvd_error e = {0};
        rm_tier(dir);
        if (disktier_open(&c, &dt, &e)) {
            fprintf(stderr, "bench_disk: disktier_open: %s\n", e.message);
            return 1;
        }
        size_t win = window_of(slot);
        unsigned char *bufs = NULL;
        uint32_t(*wtoks)[BT] = malloc(sizeof *wtoks * win);
        struct disktier_wr *wr = calloc(win, sizeof *wr);
        uint64_t ns = blockkey_ns("bench"), salt = 977 + z;
        int rc = posix_memalign((void **)&bufs, 4096, 2 * win * slot) || !wtoks || !wr ? -1 : 0;
        for (uint64_t i = 0; i < n && rc == 0; i += win) {
            size_t k = 0;
            for (; k < win && i + k < n; k++) {
                unsigned char *bd = disktier_data(dt, bufs + k * slot);
                for (size_t o = 0; o < block_bytes; o += 8) {
                    uint64_t v = o ? mix(o ^ (i + k)) : i + k; /* the first 8 bytes: its id */
                    memcpy(bd + o, &v, block_bytes - o < 8 ? block_bytes - o : 8);
                }
                tokens_of(i + k, wtoks[k]);
                wr[k] = (struct disktier_wr){.ns_name = "bench",
                                             .ns = ns,
                                             .key = key_of(i + k, salt),
                                             .tokens = wtoks[k],
                                             .buf = bufs + k * slot};
            }
            if (disktier_put_many(dt, wr, k) != k)
                rc = -1;
        }
        free(wtoks);
        free(wr);
        if (rc == 0)
            rc = disktier_sync(dt);
        char cmd[4400], rd_cmd[4400];
        uint64_t dd_mib = n * slot >> 20;
        snprintf(cmd, sizeof cmd,
                 "dd if=/dev/urandom of='%s/dd.tmp' bs=1M count=%" PRIu64 " oflag=direct", dir,
                 dd_mib);
        if (rc == 0 && run_dd(cmd) <= 0)
            rc = -1;
        snprintf(rd_cmd, sizeof rd_cmd, "dd if='%s/dd.tmp' of=/dev/null bs=1M iflag=direct", dir);
        if (rc == 0) /* first uses (a ring, the buffers) before any clock */
            rc = read_back(dt, n < win ? n : win, salt, win, bufs, slot);
        double tier_gbs[64], dd_gbs[64], ratio[64], tier_cpu = 0, dd_cpu = 0;
        struct disktier_stats st0, st;
        disktier_stats(dt, &st0);
        for (int r = 0; r < rounds && rc == 0; r++) {
            double t_dd = -1, t_tier = -1;
            for (int k = 0; k < 2 && rc == 0; k++) {
                if ((k == 0) == (r % 2 == 0)) {
                    double t0 = now_s(), c0 = cpu_s(RUSAGE_SELF);
                    rc = read_back(dt, n, salt, win, bufs, slot);
                    t_tier = now_s() - t0;
                    tier_cpu += cpu_s(RUSAGE_SELF) - c0;
                } else {
                    double c0 = cpu_s(RUSAGE_CHILDREN);
                    if ((t_dd = run_dd(rd_cmd)) <= 0)
                        rc = -1;
                    dd_cpu += cpu_s(RUSAGE_CHILDREN) - c0;
                }
            }
            if (rc)
                break;
            tier_gbs[r] = (double)(n * slot) / t_tier / 1e9;
            dd_gbs[r] = (double)(dd_mib << 20) / t_dd / 1e9;
            ratio[r] = tier_gbs[r] / dd_gbs[r];
            printf("  block %zu B round %d: tier %.3f GB/s, dd %.3f GB/s, %.2fx\n", block_bytes, r,
                   tier_gbs[r], dd_gbs[r], ratio[r]);
        }
        disktier_stats(dt, &st);
        free(bufs);
        disktier_close(dt);
        rm_tier(dir);
        snprintf(cmd, sizeof cmd, "%s/dd.tmp", dir);
        unlink(cmd);
        if (rc) {
            fprintf(stderr,
                    "bench_disk: reads failed (io_errors %" PRIu64 " checksum_failures %" PRIu64
                    ")\n",
                    st.io_errors, st.checksum_failures);
            return 1;
        }
        (void)!getloadavg(la, 3);
        uint64_t reqs = st.read_reqs - st0.read_reqs;
        double mt = median(tier_gbs, (size_t)rounds), md = median(dd_gbs, (size_t)rounds);
        double mr = median(ratio, (size_t)rounds); /* sorts ratio: [0] is the least */
        double gb = (double)(n * slot) * rounds / 1e9;
        printf("block %zu B (slot %zu B, %" PRIu64 " blocks, %.1f per request): tier %.3f GB/s, "
               "dd %.3f GB/s, ratio %.2fx (median of %d; least %.2fx, most %.2fx); CPU s per GB "
               "read: tier %.3f, dd %.3f; load average %.2f\n",
               block_bytes, slot, n, reqs ? (double)n * rounds / (double)reqs : 0.0, mt, md, mr,
               rounds, ratio[0], ratio[rounds - 1], tier_cpu / gb, dd_cpu / gb, la[0]);
    }
    return 0;
}

static int startup(const char *dir, uint64_t n)
{
    struct disktier_conf c = {.dir = dir, .block_bytes = 4096, .block_tokens = BT};
    c.max_bytes = 4096 + n * 8192;
    struct disktier *dt;
    struct kvd_error e = {0};
    rm_tier(dir);
    double t0 = now_s();
    if (disktier_open(&c, &dt, &e)) {
        fprintf(stderr, "bench_disk: disktier_open: %s\n", e.message);
        return 1;
    }
    double t_fmt = now_s() - t0;
    void *buf = disktier_buf_new(dt);
    uint32_t toks[BT];
    uint64_t ns = blockkey_ns("bench");
    int rc = 0;
    t0 = now_s();
    for (uint64_t i = 0; i < n && rc == 0; i++) {
        memcpy(disktier_data(dt, buf), &i, sizeof i);
        tokens_of(i, toks);
        rc = disktier_put(dt, "bench", ns, key_of(i, 1), toks, buf);
    }
    if (rc == 0)
        rc = disktier_sync(dt);
    double t_fill = now_s() - t0;
    struct disktier_stats st;
    disktier_stats(dt, &st);
    disktier_close(dt);
    free(buf);
    if (rc) {
        fprintf(stderr, "bench_disk: filling failed after %" PRIu64 " puts\n", st.writes);
        rm_tier(dir);
        return 1;
    }
    printf("disk tier start-up in %s: %" PRIu64 " slots of %" PRIu64 " B (block file %.2f GiB)\n",
           dir, st.slots, st.slot_bytes, (double)st.file_bytes / (1 << 30));
    printf("  format (first open): %.3f s; fill: %" PRIu64 " puts + sync in %.1f s (%.0f puts/s)\n",
           t_fmt, st.writes, t_fill, (double)st.writes / t_fill);
    const char *label[] = {"cold (page cache dropped)", "warm (index in page cache)"};
    for (int k = 0; k < 2; k++) {
        if (k == 0 && drop_caches() != 0) {
            printf("  (cannot drop the page cache: %s; the first open is not cold)\n",
                   strerror(errno));
        }
        t0 = now_s();
        if (disktier_open(&c, &dt, &e)) {
            fprintf(stderr, "bench_disk: disktier_open: %s\n", e.message);
            rm_tier(dir);
            return 1;
        }
        double t = now_s() - t0;
        disktier_stats(dt, &st);
        disktier_close(dt);
        printf("  disktier_open %s: %.3f s, %" PRIu64 " blocks loaded, %" PRIu64 " refused\n",
               label[k], t, st.loaded, st.dropped_at_load);
    }
    rm_tier(dir);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 ||
        (strcmp(argv[1], "throughput") && strcmp(argv[1], "startup") && strcmp(argv[1], "reads"))) {
        fprintf(stderr, "usage: bench_disk throughput [DIR] [MIB] | reads [DIR] [MIB] [ROUNDS] | "
                        "startup [DIR] [SLOTS]\n");
        return 2;
    }
    char tmp[] = "/var/tmp/kvd-bench-disk.XXXXXX";
    const char *dir = argc > 2 && argv[2][0] ? argv[2] : NULL;
    bool made = false;
    if (!dir) {
        if (!mkdtemp(tmp)) {
            perror("mkdtemp");
            return 1;
        }
        dir = tmp;
        made = true;
    }
    int rc;
    if (strcmp(argv[1], "throughput") == 0)
        rc = throughput(dir, argc > 3 ? strtoull(argv[3], NULL, 10) : 1024);
    else if (strcmp(argv[1], "reads") == 0)
        rc = reads(dir, argc > 3 ? strtoull(argv[3], NULL, 10) : 256, argc > 4 ? atoi(argv[4]) : 9);
    else
        rc = startup(dir, argc > 3 ? strtoull(argv[3], NULL, 10) : (1u << 20));
    if (made && rmdir(dir) != 0)
        fprintf(stderr, "bench_disk: rmdir %s: %s\n", dir, strerror(errno));
    return rc;
}
