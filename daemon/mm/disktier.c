/* disktier: slab files, the index, and checked block reads and writes
 * (disktier.h). Every integer in the files is little-endian (kvd builds for
 * little-endian hosts only: static assert below). */
#include "disktier.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "fault.h"
#include "log.h"

#ifdef KVD_HAVE_URING
#include <liburing.h>
#define DISKTIER_RINGS 8 /* rings kept for reuse (one per concurrent batch) */
#endif

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the disk format is little-endian");

#define PAGE 4096u
#define FILE_MAGIC "KVDDISK1"
#define FILE_VERSION 1u
#define REC_MAGIC 0x4b565252u        /* "RRVK" */
#define SLOT_MAGIC 0x4b56444c4f54ull /* "TOLDVK" */
#define REC_VALID 1u
#define CHUNK_RECS 65536u

/* Both files start with this (padded to PAGE). */
struct file_hdr {
    char magic[8];
    uint32_t version, kind; /* 0 blocks.kvd, 1 index.kvd */
    uint64_t slot_bytes, n_slots, block_bytes;
    uint32_t block_tokens, hdr_bytes;
    uint64_t uuid; /* random per format: ties the index to its block file */
    uint64_t sum;  /* XXH3-64 of the fields above */
};

struct disk_rec {
    uint32_t magic, flags;
    uint64_t ns, key_lo, key_hi;
    uint64_t data_sum;
    uint64_t stamp;   /* write order (LRU order after a restart) */
    uint64_t expires; /* session pin: never evicted before (unix s); 0 none */
    uint64_t sum;     /* XXH3-64 of the 56 bytes above */
};
_Static_assert(sizeof(struct disk_rec) == 64, "index records are 64 bytes");

struct slot_hdr {
    uint64_t magic;
    uint32_t version, block_tokens;
    uint64_t block_bytes, ns, key_lo, key_hi, data_sum, uuid;
    char ns_name[DISKTIER_NS_NAME];
    uint64_t sum; /* XXH3-64 of this header (sum = 0) and the token ids after it */
};

enum slot_state { SLOT_FREE = 0, SLOT_VALID, SLOT_WRITING };

struct slot {
    uint32_t prev, next; /* LRU list (VALID) or free list (FREE, next only) */
    uint32_t readers;    /* pins of lookups not yet read */
    uint8_t state;
};

struct disktier {
    pthread_mutex_t mu;
    int data_fd, index_fd, lock_fd;
    bool direct;
    char dir[4096];
    size_t block_bytes, hdr_bytes, slot_bytes;
    uint32_t block_tokens;
    uint64_t n_slots, uuid, seed, stamp;
    struct disk_rec *recs; /* (n_slots) what index.kvd holds */
    struct slot *slots;    /* (n_slots) */
    uint32_t *table;       /* (cap) slot + 1, 0 empty; linear probing */
    uint64_t cap;
    uint32_t lru_head, lru_tail, free_head; /* head: most recent */
    uint32_t *unsynced;                     /* slots written since the last good sync */
    size_t n_unsynced, cap_unsynced;
    struct disktier_drop *drops; /* the drop log: ring of drops_cap, drops_n from drops_head */
    size_t drops_cap, drops_head, drops_n;
    struct disktier_stats st;
#ifdef KVD_HAVE_URING
    bool uring_ok;                          /* the kernel gave a ring at open */
    struct io_uring *rings[DISKTIER_RINGS]; /* idle rings, for the next batches */
    size_t n_rings;
#endif
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t round_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

static size_t hdr_bytes_for(uint32_t block_tokens)
{
    return round_up(sizeof(struct slot_hdr) + 4ull * block_tokens, PAGE);
}

static size_t slot_bytes_for(size_t block_bytes, uint32_t block_tokens)
{
    return hdr_bytes_for(block_tokens) + round_up(block_bytes, PAGE);
}

static uint64_t rec_sum(const struct disk_rec *r)
{
    return XXH3_64bits(r, offsetof(struct disk_rec, sum));
}

static uint64_t file_hdr_sum(const struct file_hdr *h)
{
    return XXH3_64bits(h, offsetof(struct file_hdr, sum));
}

static uint64_t data_sum(const void *data, size_t n, uint64_t key_lo)
{
    return XXH3_64bits_withSeed(data, n, key_lo);
}

static bool rec_ok(const struct disk_rec *r)
{
    return r->magic == REC_MAGIC && (r->flags & REC_VALID) && r->sum == rec_sum(r);
}

/* ---- the in-memory index ------------------------------------------------ */

static uint64_t key_hash(const struct disktier *dt, uint64_t ns, struct blockkey k)
{
    uint64_t v[3] = {ns, k.lo, k.hi};
    return XXH3_64bits_withSeed(v, sizeof v, dt->seed);
}

static bool rec_is(const struct disk_rec *r, uint64_t ns, struct blockkey k)
{
    return r->ns == ns && r->key_lo == k.lo && r->key_hi == k.hi;
}

static uint64_t table_find(const struct disktier *dt, uint64_t ns, struct blockkey k)
{
    uint64_t mask = dt->cap - 1;
    for (uint64_t i = key_hash(dt, ns, k) & mask;; i = (i + 1) & mask) {
        uint32_t e = dt->table[i];
        if (e == 0 || rec_is(&dt->recs[e - 1], ns, k))
            return i;
    }
}

static void table_add(struct disktier *dt, uint32_t slot)
{
    const struct disk_rec *r = &dt->recs[slot];
    uint64_t i = table_find(dt, r->ns, (struct blockkey){r->key_lo, r->key_hi});
    dt->table[i] = slot + 1;
}

/* Deletes entry i, shifting the entries after it back (linear probing stays
 * complete without tombstones). */
static void table_del_at(struct disktier *dt, uint64_t i)
{
    uint64_t mask = dt->cap - 1, j = i;
    dt->table[i] = 0;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t e = dt->table[j];
        if (e == 0)
            return;
        const struct disk_rec *r = &dt->recs[e - 1];
        uint64_t home = key_hash(dt, r->ns, (struct blockkey){r->key_lo, r->key_hi}) & mask;
        /* e may move to the hole at i when its home is not in (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            dt->table[i] = e;
            dt->table[j] = 0;
            i = j;
        }
    }
}

static void table_del(struct disktier *dt, uint32_t slot)
{
    const struct disk_rec *r = &dt->recs[slot];
    uint64_t i = table_find(dt, r->ns, (struct blockkey){r->key_lo, r->key_hi});
    if (dt->table[i] == slot + 1)
        table_del_at(dt, i);
}

static void lru_unlink(struct disktier *dt, uint32_t s)
{
    struct slot *x = &dt->slots[s];
    if (x->prev != DISKTIER_NONE)
        dt->slots[x->prev].next = x->next;
    else
        dt->lru_head = x->next;
    if (x->next != DISKTIER_NONE)
        dt->slots[x->next].prev = x->prev;
    else
        dt->lru_tail = x->prev;
    x->prev = x->next = DISKTIER_NONE;
}

static void lru_push_front(struct disktier *dt, uint32_t s)
{
    struct slot *x = &dt->slots[s];
    x->prev = DISKTIER_NONE;
    x->next = dt->lru_head;
    if (dt->lru_head != DISKTIER_NONE)
        dt->slots[dt->lru_head].prev = s;
    else
        dt->lru_tail = s;
    dt->lru_head = s;
}

static void free_push(struct disktier *dt, uint32_t s)
{
    dt->slots[s].state = SLOT_FREE;
    dt->slots[s].prev = DISKTIER_NONE;
    dt->slots[s].next = dt->free_head;
    dt->free_head = s;
    dt->st.free_slots++;
}

/* Writes slot s's record (buffered; disktier_sync makes it durable). */
static int rec_write(struct disktier *dt, uint32_t s)
{
    off_t off = (off_t)PAGE + (off_t)s * (off_t)sizeof(struct disk_rec);
    ssize_t w = pwrite(dt->index_fd, &dt->recs[s], sizeof(struct disk_rec), off);
    return w == (ssize_t)sizeof(struct disk_rec) ? 0 : -1;
}

/* Under mu: a VALID slot leaves the index (its record is invalidated) and
 * goes to the free list. */
static void slot_drop(struct disktier *dt, uint32_t s)
{
    if (dt->drops_cap && (dt->recs[s].flags & REC_VALID)) {
        if (dt->drops_n == dt->drops_cap) {
            dt->st.drops_unlogged++;
        } else {
            dt->drops[(dt->drops_head + dt->drops_n++) % dt->drops_cap] =
                (struct disktier_drop){dt->recs[s].ns, {dt->recs[s].key_lo, dt->recs[s].key_hi}};
        }
    }
    table_del(dt, s);
    lru_unlink(dt, s);
    if (dt->recs[s].flags & REC_VALID && dt->recs[s].expires)
        dt->st.pinned_slots--;
    memset(&dt->recs[s], 0, sizeof dt->recs[s]);
    rec_write(dt, s);
    dt->st.cached_slots--;
    free_push(dt, s);
}

/* ---- opening ------------------------------------------------------------ */

static int io_fail(struct kvd_error *e, const char *what, const char *path)
{
    return kvd_error_set(e, KVD_EINTERNAL, "disk tier: %s %s: %s", what, path, strerror(errno));
}

static int open_in(struct disktier *dt, const char *name, int flags, struct kvd_error *e)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dt->dir, name);
    int fd = open(path, flags | O_CLOEXEC, 0600);
    if (fd < 0 && (flags & O_DIRECT) && errno == EINVAL)
        fd = open(path, (flags & ~O_DIRECT) | O_CLOEXEC, 0600);
    if (fd < 0)
        io_fail(e, "cannot open", path);
    return fd;
}

static void hdr_fill(const struct disktier *dt, struct file_hdr *h, uint32_t kind)
{
    memset(h, 0, sizeof *h);
    memcpy(h->magic, FILE_MAGIC, 8);
    h->version = FILE_VERSION;
    h->kind = kind;
    h->slot_bytes = dt->slot_bytes;
    h->n_slots = dt->n_slots;
    h->block_bytes = dt->block_bytes;
    h->block_tokens = dt->block_tokens;
    h->hdr_bytes = (uint32_t)dt->hdr_bytes;
    h->uuid = dt->uuid;
    h->sum = file_hdr_sum(h);
}

/* Why the file's header does not fit this daemon ("" when it does). */
static const char *hdr_mismatch(const struct disktier *dt, const struct file_hdr *h, uint32_t kind)
{
    if (memcmp(h->magic, FILE_MAGIC, 8) || h->sum != file_hdr_sum(h))
        return "no valid header";
    if (h->version != FILE_VERSION || h->kind != kind)
        return "another format version";
    if (h->block_bytes != dt->block_bytes || h->block_tokens != dt->block_tokens ||
        h->slot_bytes != dt->slot_bytes)
        return "blocks of another KV geometry";
    if (h->n_slots != dt->n_slots)
        return "another disk-max-bytes";
    return "";
}

static int write_page(int fd, const void *p, size_t n, off_t off)
{
    unsigned char *page = NULL;
    if (posix_memalign((void **)&page, PAGE, PAGE))
        return -1;
    memset(page, 0, PAGE);
    memcpy(page, p, n);
    ssize_t w = pwrite(fd, page, PAGE, off);
    free(page);
    return w == PAGE ? 0 : -1;
}

/* A fresh, empty tier: new uuid, both headers, files sized (the block file
 * preallocated, so a full disk shows now rather than mid-write). */
static int format(struct disktier *dt, struct kvd_error *e)
{
    struct file_hdr h;
    uint64_t data_size = PAGE + dt->n_slots * dt->slot_bytes;
    uint64_t index_size = PAGE + dt->n_slots * sizeof(struct disk_rec);
    if (getrandom(&dt->uuid, sizeof dt->uuid, 0) != sizeof dt->uuid)
        dt->uuid = now_ns() ^ (uint64_t)getpid();
    /* The index goes first: truncated to its header, it names no block. */
    if (ftruncate(dt->index_fd, 0) || ftruncate(dt->index_fd, (off_t)index_size))
        return io_fail(e, "cannot size", "index.kvd");
    if (ftruncate(dt->data_fd, (off_t)data_size))
        return io_fail(e, "cannot size", "blocks.kvd");
    int rc = posix_fallocate(dt->data_fd, 0, (off_t)data_size);
    if (rc && rc != EOPNOTSUPP && rc != EINVAL) {
        errno = rc;
        return io_fail(e, "cannot reserve the space of", "blocks.kvd");
    }
    hdr_fill(dt, &h, 0);
    if (write_page(dt->data_fd, &h, sizeof h, 0) || fdatasync(dt->data_fd))
        return io_fail(e, "cannot write", "blocks.kvd");
    hdr_fill(dt, &h, 1);
    if (write_page(dt->index_fd, &h, sizeof h, 0) || fdatasync(dt->index_fd))
        return io_fail(e, "cannot write", "index.kvd");
    return 0;
}

static int cmp_stamp(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Reads index.kvd's records into dt->recs, keeping the valid ones (a second
 * record of the same key: the older goes). No block data is read. */
static int load_index(struct disktier *dt, struct kvd_error *e)
{
    uint64_t(*order)[2] = malloc(sizeof *order * (dt->n_slots ? dt->n_slots : 1));
    size_t n_order = 0;
    if (!order)
        return kvd_error_set(e, KVD_ENOMEM, "disk tier: out of memory loading the index");
    for (uint64_t s0 = 0; s0 < dt->n_slots; s0 += CHUNK_RECS) {
        uint64_t n = dt->n_slots - s0 < CHUNK_RECS ? dt->n_slots - s0 : CHUNK_RECS;
        size_t bytes = n * sizeof(struct disk_rec);
        ssize_t r = pread(dt->index_fd, dt->recs + s0, bytes,
                          (off_t)PAGE + (off_t)(s0 * sizeof(struct disk_rec)));
        if (r < 0) {
            free(order);
            return io_fail(e, "cannot read", "index.kvd");
        }
        if ((size_t)r < bytes) /* a truncated index: the rest holds nothing */
            memset((char *)(dt->recs + s0) + r, 0, bytes - (size_t)r);
    }
    for (uint64_t s = 0; s < dt->n_slots; s++) {
        struct disk_rec *r = &dt->recs[s];
        if (!rec_ok(r)) {
            if (r->magic || r->flags)
                dt->st.dropped_at_load++;
            memset(r, 0, sizeof *r);
            continue;
        }
        struct blockkey k = {r->key_lo, r->key_hi};
        uint64_t i = table_find(dt, r->ns, k);
        if (dt->table[i]) {
            uint32_t other = dt->table[i] - 1;
            dt->st.dropped_at_load++;
            if (dt->recs[other].stamp >= r->stamp) {
                memset(r, 0, sizeof *r);
                continue;
            }
            dt->table[i] = (uint32_t)s + 1;
            memset(&dt->recs[other], 0, sizeof dt->recs[other]);
        } else {
            dt->table[i] = (uint32_t)s + 1;
        }
    }
    for (uint64_t s = 0; s < dt->n_slots; s++) {
        const struct disk_rec *r = &dt->recs[s];
        if (r->magic) {
            order[n_order][0] = r->stamp;
            order[n_order++][1] = s;
            if (r->stamp >= dt->stamp)
                dt->stamp = r->stamp + 1;
        }
    }
    qsort(order, n_order, sizeof *order, cmp_stamp);
    for (size_t i = 0; i < n_order; i++) { /* oldest first: the newest ends at the head */
        uint32_t s = (uint32_t)order[i][1];
        dt->slots[s].state = SLOT_VALID;
        if (dt->recs[s].expires)
            dt->st.pinned_slots++;
        lru_push_front(dt, s);
    }
    dt->st.cached_slots = dt->st.loaded = n_order;
    for (uint64_t s = dt->n_slots; s-- > 0;)
        if (dt->slots[s].state == SLOT_FREE)
            free_push(dt, (uint32_t)s);
    free(order);
    return 0;
}

static int read_hdr(int fd, struct file_hdr *h)
{
    memset(h, 0, sizeof *h);
    unsigned char *page = NULL;
    if (posix_memalign((void **)&page, PAGE, PAGE))
        return -1;
    ssize_t r = pread(fd, page, PAGE, 0);
    if (r >= (ssize_t)sizeof *h)
        memcpy(h, page, sizeof *h);
    free(page);
    return 0;
}

int disktier_open(const struct disktier_conf *c, struct disktier **out, struct kvd_error *e)
{
    *out = NULL;
    if (!c->dir || !c->dir[0] || strlen(c->dir) >= sizeof((struct disktier *)0)->dir)
        return kvd_error_set(e, KVD_EBADREQ, "disk tier: a directory is needed");
    if (c->block_tokens == 0 || c->block_bytes == 0)
        return kvd_error_set(e, KVD_EBADREQ, "disk tier: no block geometry");
    size_t slot_bytes = slot_bytes_for(c->block_bytes, c->block_tokens);
    if (c->max_bytes < PAGE + slot_bytes)
        return kvd_error_set(e, KVD_EBADREQ,
                             "disk-max-bytes %" PRIu64
                             " holds no block: one takes %zu bytes on disk (with its header)",
                             c->max_bytes, slot_bytes);
    uint64_t n_slots = (c->max_bytes - PAGE) / slot_bytes;
    if (n_slots >= UINT32_MAX - 1)
        n_slots = UINT32_MAX - 2;
    if (mkdir(c->dir, 0700) && errno != EEXIST)
        return io_fail(e, "cannot create", c->dir);
    struct disktier *dt = calloc(1, sizeof *dt);
    if (!dt)
        return kvd_error_set(e, KVD_ENOMEM, "disk tier: out of memory");
    pthread_mutex_init(&dt->mu, NULL);
    dt->data_fd = dt->index_fd = dt->lock_fd = -1;
    snprintf(dt->dir, sizeof dt->dir, "%s", c->dir);
    dt->block_bytes = c->block_bytes;
    dt->block_tokens = c->block_tokens;
    dt->hdr_bytes = hdr_bytes_for(c->block_tokens);
    dt->slot_bytes = slot_bytes;
    dt->n_slots = n_slots;
    dt->lru_head = dt->lru_tail = dt->free_head = DISKTIER_NONE;
    dt->st.slots = n_slots;
    dt->st.slot_bytes = slot_bytes;
    dt->st.file_bytes = PAGE + n_slots * slot_bytes;
    if (getrandom(&dt->seed, sizeof dt->seed, 0) != sizeof dt->seed)
        dt->seed = now_ns();
    int rc = 0;
    dt->cap = 16;
    while (dt->cap < 2 * n_slots)
        dt->cap <<= 1;
    dt->recs = calloc(n_slots, sizeof *dt->recs);
    dt->slots = calloc(n_slots, sizeof *dt->slots);
    dt->table = calloc(dt->cap, sizeof *dt->table);
    if (!dt->recs || !dt->slots || !dt->table) {
        rc =
            kvd_error_set(e, KVD_ENOMEM, "disk tier: out of memory for %" PRIu64 " slots", n_slots);
        goto fail;
    }
    for (uint64_t s = 0; s < n_slots; s++)
        dt->slots[s].prev = dt->slots[s].next = DISKTIER_NONE;
    if ((dt->lock_fd = open_in(dt, "lock", O_RDWR | O_CREAT, e)) < 0) {
        rc = KVD_EINTERNAL;
        goto fail;
    }
    if (flock(dt->lock_fd, LOCK_EX | LOCK_NB)) {
        rc = kvd_error_set(e, KVD_EBUSY, "disk tier: %s is in use by another kvd", c->dir);
        goto fail;
    }
    if ((dt->data_fd = open_in(dt, "blocks.kvd", O_RDWR | O_CREAT | O_DIRECT, e)) < 0 ||
        (dt->index_fd = open_in(dt, "index.kvd", O_RDWR | O_CREAT, e)) < 0) {
        rc = KVD_EINTERNAL;
        goto fail;
    }
    dt->direct = (fcntl(dt->data_fd, F_GETFL) & O_DIRECT) != 0;
    struct file_hdr dh, ih;
    struct stat sb;
    read_hdr(dt->data_fd, &dh);
    read_hdr(dt->index_fd, &ih);
    const char *why = hdr_mismatch(dt, &dh, 0);
    if (!why[0])
        why = hdr_mismatch(dt, &ih, 1);
    if (!why[0] && dh.uuid != ih.uuid)
        why = "an index of another block file";
    if (!why[0] && (fstat(dt->data_fd, &sb) || (uint64_t)sb.st_size < dt->st.file_bytes))
        why = "a truncated block file";
    if (why[0]) {
        if (memcmp(dh.magic, FILE_MAGIC, 8) == 0 || memcmp(ih.magic, FILE_MAGIC, 8) == 0)
            log_notice("disk tier %s: formatting anew (it holds %s)", c->dir, why);
        if ((rc = format(dt, e)))
            goto fail;
    } else {
        dt->uuid = dh.uuid;
    }
    if ((rc = load_index(dt, e)))
        goto fail;
#ifdef KVD_HAVE_URING
    /* One ring now tells whether the kernel allows io_uring (a seccomp
     * filter or kernel.io_uring_disabled may not): without, reads use
     * preadv. */
    struct io_uring *ring = c->no_uring ? NULL : malloc(sizeof *ring);
    int urc = c->no_uring ? -ENOSYS
              : ring      ? io_uring_queue_init(2 * DISKTIER_QDEPTH, ring, 0)
                          : -ENOMEM;
    if (c->no_uring) {
        /* asked for preadv */
    } else if (urc == 0) {
        dt->uring_ok = true;
        dt->rings[dt->n_rings++] = ring;
    } else {
        free(ring);
        log_notice("disk tier %s: no io_uring (%s); reads use preadv", c->dir, strerror(-urc));
    }
#endif
    *out = dt;
    return 0;
fail:
    disktier_close(dt);
    return rc;
}

void disktier_close(struct disktier *dt)
{
    if (!dt)
        return;
    if (dt->data_fd >= 0)
        close(dt->data_fd);
    if (dt->index_fd >= 0)
        close(dt->index_fd);
    if (dt->lock_fd >= 0)
        close(dt->lock_fd); /* releases the flock */
#ifdef KVD_HAVE_URING
    for (size_t i = 0; i < dt->n_rings; i++) {
        io_uring_queue_exit(dt->rings[i]);
        free(dt->rings[i]);
    }
#endif
    pthread_mutex_destroy(&dt->mu);
    free(dt->recs);
    free(dt->slots);
    free(dt->table);
    free(dt->unsynced);
    free(dt->drops);
    free(dt);
}

int disktier_watch_drops(struct disktier *dt, size_t cap)
{
    struct disktier_drop *d = calloc(cap ? cap : 1, sizeof *d);
    if (!d)
        return KVD_ENOMEM;
    pthread_mutex_lock(&dt->mu);
    free(dt->drops);
    dt->drops = d;
    dt->drops_cap = cap;
    dt->drops_head = dt->drops_n = 0;
    pthread_mutex_unlock(&dt->mu);
    return 0;
}

size_t disktier_take_drops(struct disktier *dt, struct disktier_drop *out, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&dt->mu);
    while (n < max && dt->drops_n) {
        out[n++] = dt->drops[dt->drops_head];
        dt->drops_head = (dt->drops_head + 1) % dt->drops_cap;
        dt->drops_n--;
    }
    pthread_mutex_unlock(&dt->mu);
    return n;
}

void *disktier_buf_new(const struct disktier *dt)
{
    void *p = NULL;
    if (posix_memalign(&p, PAGE, dt->slot_bytes))
        return NULL;
    memset(p, 0, dt->slot_bytes);
    return p;
}

void *disktier_data(const struct disktier *dt, void *buf)
{
    return (char *)buf + dt->hdr_bytes;
}

/* ---- lookups and reads -------------------------------------------------- */

uint32_t disktier_lookup(struct disktier *dt, uint64_t ns, struct blockkey key)
{
    pthread_mutex_lock(&dt->mu);
    uint32_t e = dt->table[table_find(dt, ns, key)];
    uint32_t s = e ? e - 1 : DISKTIER_NONE;
    if (e)
        dt->slots[s].readers++;
    pthread_mutex_unlock(&dt->mu);
    return s;
}

bool disktier_has(struct disktier *dt, uint64_t ns, struct blockkey key)
{
    pthread_mutex_lock(&dt->mu);
    bool has = dt->table[table_find(dt, ns, key)] != 0;
    pthread_mutex_unlock(&dt->mu);
    return has;
}

void disktier_unpin(struct disktier *dt, uint32_t slot)
{
    pthread_mutex_lock(&dt->mu);
    if (slot < dt->n_slots && dt->slots[slot].readers)
        dt->slots[slot].readers--;
    pthread_mutex_unlock(&dt->mu);
}

static off_t slot_off(const struct disktier *dt, uint32_t s)
{
    return (off_t)PAGE + (off_t)s * (off_t)dt->slot_bytes;
}

/* The header's checksum: over the header (sum taken as 0) and the token ids
 * that follow it in the slot. */
static uint64_t slot_hdr_sum(struct slot_hdr *h, uint32_t n_tokens)
{
    uint64_t saved = h->sum;
    h->sum = 0;
    uint64_t v = XXH3_64bits(h, sizeof *h + 4ull * n_tokens);
    h->sum = saved;
    return v;
}

/* Why the block read into buf (got bytes of it) cannot be served, NULL when
 * it can; *io says whether it was the read that failed. rec is the slot's
 * record as it was when the read began. */
static const char *slot_check(const struct disktier *dt, const struct disk_rec *rec, ssize_t got,
                              int err, const char *ns_name, uint64_t ns, struct blockkey key,
                              const uint32_t *tokens, void *buf, bool *io)
{
    struct slot_hdr *h = buf;
    const uint32_t *stored = (const uint32_t *)((const char *)buf + sizeof *h);
    *io = false;
    if (got != (ssize_t)dt->slot_bytes) {
        *io = true;
        return got < 0 ? strerror(err) : "a short read";
    }
    if (!rec_is(rec, ns, key))
        return "its record changed";
    if (h->magic != SLOT_MAGIC || h->version != FILE_VERSION ||
        h->block_tokens != dt->block_tokens || h->block_bytes != dt->block_bytes ||
        h->uuid != dt->uuid || h->sum != slot_hdr_sum(h, dt->block_tokens))
        return "its header fails its checksum";
    if (h->ns != ns || h->key_lo != key.lo || h->key_hi != key.hi ||
        strncmp(h->ns_name, ns_name, DISKTIER_NS_NAME) != 0)
        return "it holds another block";
    if (memcmp(stored, tokens, 4ull * dt->block_tokens) != 0)
        return "its token ids differ";
    if (h->data_sum != rec->data_sum ||
        data_sum(disktier_data(dt, buf), dt->block_bytes, key.lo) != rec->data_sum)
        return "its data fails its checksum";
    return NULL;
}

/* One coalesced request: blocks ord[first, first + count) of a batch,
 * adjacent on disk, read with one preadv into their own buffers. */
struct rd_piece {
    size_t first, count;
    off_t off;
    ssize_t res; /* bytes read, or -errno */
};

/* The batch's requests, one at a time (the portable path). */
static void pieces_preadv(struct disktier *dt, struct rd_piece *p, size_t n_p, struct iovec *iov)
{
    for (size_t i = 0; i < n_p; i++) {
        ssize_t r = preadv(dt->data_fd, iov + p[i].first, (int)p[i].count, p[i].off);
        p[i].res = r < 0 ? -errno : r;
    }
}

#ifdef KVD_HAVE_URING
static struct io_uring *ring_get(struct disktier *dt)
{
    struct io_uring *r = NULL;
    pthread_mutex_lock(&dt->mu);
    if (dt->n_rings)
        r = dt->rings[--dt->n_rings];
    bool ok = dt->uring_ok;
    pthread_mutex_unlock(&dt->mu);
    if (r || !ok)
        return r;
    if (!(r = malloc(sizeof *r)))
        return NULL;
    if (io_uring_queue_init(2 * DISKTIER_QDEPTH, r, 0) != 0) {
        free(r);
        return NULL;
    }
    return r;
}

static void ring_put(struct disktier *dt, struct io_uring *r)
{
    pthread_mutex_lock(&dt->mu);
    if (dt->n_rings < DISKTIER_RINGS) {
        dt->rings[dt->n_rings++] = r;
        r = NULL;
    }
    pthread_mutex_unlock(&dt->mu);
    if (r) {
        io_uring_queue_exit(r);
        free(r);
    }
}

/* The batch's requests, up to DISKTIER_QDEPTH in flight; a request the
 * ring could not take keeps res -EAGAIN (the caller reads it with preadv).
 * Returns only when nothing is in flight, since the kernel writes into the
 * buffers until then. A ring that failed is not reused. */
static void pieces_uring(struct disktier *dt, struct io_uring *ring, struct rd_piece *p, size_t n_p,
                         struct iovec *iov)
{
    size_t next = 0, inflight = 0;
    bool broken = false;
    int wait_errors = 0;
    while (next < n_p || inflight) {
        size_t queued = 0;
        while (!broken && next < n_p && inflight + queued < DISKTIER_QDEPTH) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
            if (!sqe)
                break;
            io_uring_prep_readv(sqe, dt->data_fd, iov + p[next].first, (unsigned)p[next].count,
                                (uint64_t)p[next].off);
            io_uring_sqe_set_data64(sqe, next);
            p[next].res = -EINPROGRESS;
            next++;
            queued++;
        }
        if (queued) {
            int rc;
            while ((rc = io_uring_submit(ring)) == -EINTR)
                ;
            if (rc < 0) {
                log_warn("disk tier: io_uring submit: %s; reading with preadv", strerror(-rc));
                broken = true;
                rc = 0;
            }
            inflight += (size_t)rc;
            if ((size_t)rc < queued) { /* not taken: the caller reads them */
                for (size_t k = next - (queued - (size_t)rc); k < next; k++)
                    p[k].res = -EAGAIN;
                broken = true;
            }
        }
        if (broken)
            next = n_p; /* the rest keeps -EAGAIN */
        if (!inflight)
            break;
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(ring, &cqe);
        if (rc < 0) {
            if (rc != -EINTR && ++wait_errors >= 1000) {
                /* Never seen; the buffers may still be written, so the
                 * ring is left as it is rather than torn down. */
                log_err("disk tier: io_uring wait: %s; the ring is abandoned", strerror(-rc));
                for (size_t k = 0; k < n_p; k++)
                    if (p[k].res == -EINPROGRESS)
                        p[k].res = -EIO;
                return;
            }
            continue;
        }
        uint64_t i = io_uring_cqe_get_data64(cqe);
        if (i < n_p)
            p[i].res = cqe->res == -EAGAIN ? -EIO : cqe->res;
        io_uring_cqe_seen(ring, cqe);
        inflight--;
    }
    if (broken) {
        io_uring_queue_exit(ring);
        free(ring);
    } else {
        ring_put(dt, ring);
    }
}
#endif

bool disktier_uring(const struct disktier *dt)
{
#ifdef KVD_HAVE_URING
    return dt->uring_ok;
#else
    (void)dt;
    return false;
#endif
}

/* A small insertion sort of the batch's indices by slot (a batch is one
 * restore window: tens to hundreds of blocks, mostly in order already). */
static void sort_by_slot(size_t *ord, size_t n, struct disktier_rd *v)
{
    for (size_t i = 1; i < n; i++) {
        size_t x = ord[i], j = i;
        while (j > 0 && v[ord[j - 1]].slot > v[x].slot) {
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = x;
    }
}

size_t disktier_read_many(struct disktier *dt, const char *ns_name, uint64_t ns,
                          struct disktier_rd *v, size_t n)
{
    if (n == 0)
        return 0;
    uint64_t t0 = now_ns();
    size_t per_req = DISKTIER_REQ_BYTES / dt->slot_bytes;
    if (per_req == 0)
        per_req = 1;
    struct disk_rec *recs = malloc(sizeof *recs * n);
    size_t *ord = malloc(sizeof *ord * n);
    ssize_t *got = malloc(sizeof *got * n);
    int *err = malloc(sizeof *err * n);
    struct iovec *iov = malloc(sizeof *iov * n);
    struct rd_piece *p = malloc(sizeof *p * n);
    const char **why = malloc(sizeof *why * n);
    bool *io = malloc(sizeof *io * n);
    size_t n_p = 0, n_ok = 0, n_retry = 0;
    bool mem = recs && ord && got && err && iov && p && why && io;

    pthread_mutex_lock(&dt->mu);
    for (size_t i = 0; mem && i < n; i++)
        recs[i] = v[i].slot < dt->n_slots ? dt->recs[v[i].slot] : (struct disk_rec){0};
    pthread_mutex_unlock(&dt->mu);

    if (mem) {
        for (size_t i = 0; i < n; i++) {
            ord[i] = i;
            got[i] = -1;
            err[i] = EIO;
        }
        sort_by_slot(ord, n, v);
        for (size_t k = 0; k < n; k++) {
            iov[k] = (struct iovec){v[ord[k]].buf, dt->slot_bytes};
            const struct rd_piece *last = n_p ? &p[n_p - 1] : NULL;
            if (v[ord[k]].slot >= dt->n_slots)
                continue; /* no such slot: an I/O error below */
            if (last && last->count < per_req && last->first + last->count == k &&
                v[ord[k - 1]].slot + 1 == v[ord[k]].slot) {
                p[n_p - 1].count++;
                continue;
            }
            p[n_p++] = (struct rd_piece){k, 1, slot_off(dt, v[ord[k]].slot), -EAGAIN};
        }
#ifdef KVD_HAVE_URING
        struct io_uring *ring = n_p > 1 ? ring_get(dt) : NULL; /* one request: preadv */
        if (ring)
            pieces_uring(dt, ring, p, n_p, iov);
#endif
        for (size_t i = 0; i < n_p; i++) /* what the ring did not take */
            if (p[i].res == -EAGAIN)
                pieces_preadv(dt, &p[i], 1, iov);
        /* Spread each request's bytes over its blocks; a block it did not
         * read whole (a short or failed request) is read once more on its
         * own, as a single read would be. */
        for (size_t i = 0; i < n_p; i++) {
            ssize_t left = p[i].res;
            for (size_t k = p[i].first; k < p[i].first + p[i].count; k++) {
                size_t b = ord[k];
                if (left >= (ssize_t)dt->slot_bytes) {
                    got[b] = (ssize_t)dt->slot_bytes;
                    left -= (ssize_t)dt->slot_bytes;
                    continue;
                }
                left = 0;
                got[b] = pread(dt->data_fd, v[b].buf, dt->slot_bytes, slot_off(dt, v[b].slot));
                err[b] = errno;
                n_retry++;
            }
        }
    }

    for (size_t i = 0; mem && i < n; i++) {
        if (fault_should_fail(FAULT_DISK_READ))
            got[i] = (ssize_t)dt->slot_bytes / 2;
        why[i] = slot_check(dt, &recs[i], got[i], err[i], ns_name, ns, v[i].key, v[i].tokens,
                            v[i].buf, &io[i]);
    }
    uint64_t dt_ns = now_ns() - t0;
    pthread_mutex_lock(&dt->mu);
    for (size_t i = 0; i < n; i++) {
        uint32_t slot = v[i].slot;
        const char *w = mem ? why[i] : "out of memory for the read";
        bool is_io = mem ? io[i] : true;
        v[i].rc = w ? KVD_EINTERNAL : 0;
        if (slot >= dt->n_slots)
            continue;
        if (dt->slots[slot].readers)
            dt->slots[slot].readers--;
        if (w) {
            if (is_io)
                dt->st.io_errors++;
            else
                dt->st.checksum_failures++;
            /* Dropped only when the slot still holds what was asked for: a
             * concurrent rewrite already replaced it. */
            if (mem && dt->slots[slot].state == SLOT_VALID && rec_is(&dt->recs[slot], ns, v[i].key))
                slot_drop(dt, slot);
        } else {
            n_ok++;
            dt->st.reads++;
            dt->st.read_bytes += dt->slot_bytes;
            if (dt->slots[slot].state == SLOT_VALID) {
                lru_unlink(dt, slot);
                lru_push_front(dt, slot);
            }
        }
    }
    if (n_ok)
        dt->st.read_ns += dt_ns;
    dt->st.read_reqs += n_p + n_retry;
    pthread_mutex_unlock(&dt->mu);
    for (size_t i = 0; i < n; i++)
        if (v[i].rc) {
            const char *w = mem ? why[i] : "out of memory for the read";
            log_warn("disk tier: slot %u (%016" PRIx64 "%016" PRIx64 ") dropped: %s", v[i].slot,
                     v[i].key.hi, v[i].key.lo, w);
        }
    free(recs);
    free(ord);
    free(got);
    free(err);
    free(iov);
    free(p);
    free(why);
    free(io);
    return n_ok;
}

int disktier_read(struct disktier *dt, uint32_t slot, const char *ns_name, uint64_t ns,
                  struct blockkey key, const uint32_t *tokens, void *buf)
{
    struct disktier_rd rd = {.slot = slot, .key = key, .tokens = tokens, .buf = buf};
    disktier_read_many(dt, ns_name, ns, &rd, 1);
    return rd.rc;
}

/* ---- writes ------------------------------------------------------------- */

/* Under mu: a slot to write into, taken from the free list or evicted from
 * the LRU end (never one being read or pinned by a session until later). */
static uint32_t slot_take(struct disktier *dt)
{
    uint32_t s = dt->free_head;
    if (s != DISKTIER_NONE) {
        dt->free_head = dt->slots[s].next;
        dt->st.free_slots--;
    } else {
        uint64_t now = (uint64_t)time(NULL);
        for (s = dt->lru_tail; s != DISKTIER_NONE; s = dt->slots[s].prev)
            if (dt->slots[s].readers == 0 && dt->recs[s].expires <= now)
                break;
        if (s == DISKTIER_NONE)
            return s;
        slot_drop(dt, s);
        dt->st.evictions++;
        dt->free_head = dt->slots[s].next;
        dt->st.free_slots--;
    }
    dt->slots[s].state = SLOT_WRITING;
    dt->slots[s].next = dt->slots[s].prev = DISKTIER_NONE;
    return s;
}

/* The injected fault of the tests a block write takes, if any (each point
 * counted once per block, in this order). */
enum wr_fault { WR_OK = 0, WR_EIO, WR_NOSPC, WR_TORN };

static enum wr_fault wr_fault_next(void)
{
    if (fault_should_fail(FAULT_DISK_WRITE))
        return WR_EIO;
    if (fault_should_fail(FAULT_DISK_NOSPC))
        return WR_NOSPC;
    if (fault_should_fail(FAULT_DISK_TORN))
        return WR_TORN;
    return WR_OK;
}

/* pwrite of one whole slot, failing as the fault says. */
static ssize_t slot_write(struct disktier *dt, const void *buf, uint32_t s, enum wr_fault f)
{
    size_t n = dt->slot_bytes;
    switch (f) {
    case WR_EIO:
        errno = EIO;
        return -1;
    case WR_NOSPC:
        errno = ENOSPC;
        return -1;
    case WR_TORN: /* half the slot lands; success reported */
        return pwrite(dt->data_fd, buf, round_up(n / 2, PAGE), slot_off(dt, s)) < 0 ? -1
                                                                                    : (ssize_t)n;
    case WR_OK:
        break;
    }
    return pwrite(dt->data_fd, buf, n, slot_off(dt, s));
}

/* The slot header of a block about to be written to buf. */
static void slot_hdr_fill(const struct disktier *dt, const struct disktier_wr *w)
{
    struct slot_hdr *h = w->buf;
    uint32_t *stored = (uint32_t *)((char *)w->buf + sizeof *h);
    memset(h, 0, sizeof *h);
    h->magic = SLOT_MAGIC;
    h->version = FILE_VERSION;
    h->block_tokens = dt->block_tokens;
    h->block_bytes = dt->block_bytes;
    h->ns = w->ns;
    h->key_lo = w->key.lo;
    h->key_hi = w->key.hi;
    h->uuid = dt->uuid;
    snprintf(h->ns_name, sizeof h->ns_name, "%s", w->ns_name);
    memcpy(stored, w->tokens, 4ull * dt->block_tokens);
    h->data_sum = data_sum(disktier_data(dt, w->buf), dt->block_bytes, w->key.lo);
    h->sum = slot_hdr_sum(h, dt->block_tokens);
}

/* Under mu: slot s now holds w's block (written: ok), or goes back to the
 * free list. 0 or KVD_EINTERNAL. */
static int put_finish(struct disktier *dt, uint32_t s, const struct disktier_wr *w, bool ok,
                      int err)
{
    const struct slot_hdr *h = w->buf;
    if (!ok) {
        dt->st.io_errors++;
        free_push(dt, s);
        log_warn("disk tier: writing slot %u failed: %s", s, err ? strerror(err) : "a short write");
        return KVD_EINTERNAL;
    }
    struct disk_rec *r = &dt->recs[s];
    *r = (struct disk_rec){.magic = REC_MAGIC,
                           .flags = REC_VALID,
                           .ns = w->ns,
                           .key_lo = w->key.lo,
                           .key_hi = w->key.hi,
                           .data_sum = h->data_sum,
                           .stamp = dt->stamp++};
    r->sum = rec_sum(r);
    int rw = rec_write(dt, s);
    if (rw == 0 && dt->n_unsynced == dt->cap_unsynced) {
        size_t cap = dt->cap_unsynced ? 2 * dt->cap_unsynced : 256;
        uint32_t *v = realloc(dt->unsynced, cap * sizeof *v);
        if (v) {
            dt->unsynced = v;
            dt->cap_unsynced = cap;
        }
    }
    if (rw || dt->n_unsynced == dt->cap_unsynced) {
        memset(r, 0, sizeof *r);
        dt->st.io_errors++;
        free_push(dt, s);
        return KVD_EINTERNAL;
    }
    dt->unsynced[dt->n_unsynced++] = s;
    dt->slots[s].state = SLOT_VALID;
    table_add(dt, s);
    lru_push_front(dt, s);
    dt->st.cached_slots++;
    dt->st.writes++;
    dt->st.write_bytes += dt->slot_bytes;
    return 0;
}

size_t disktier_put_many(struct disktier *dt, struct disktier_wr *v, size_t n)
{
    if (n == 0)
        return 0;
    size_t per_req = DISKTIER_REQ_BYTES / dt->slot_bytes;
    if (per_req == 0)
        per_req = 1;
    uint32_t *slot = malloc(sizeof *slot * n);
    size_t *ord = malloc(sizeof *ord * n);
    ssize_t *res = malloc(sizeof *res * n);
    int *err = malloc(sizeof *err * n);
    enum wr_fault *fault = malloc(sizeof *fault * n);
    struct iovec *iov = malloc(sizeof *iov * n);
    size_t n_ok = 0, n_ord = 0, reqs = 0;
    if (!slot || !ord || !res || !err || !fault || !iov) {
        for (size_t i = 0; i < n; i++)
            v[i].rc = KVD_ENOMEM;
        goto out;
    }

    pthread_mutex_lock(&dt->mu);
    for (size_t i = 0; i < n; i++) {
        slot[i] = DISKTIER_NONE;
        v[i].rc = 0;
        bool dup = dt->table[table_find(dt, v[i].ns, v[i].key)] != 0;
        for (size_t j = 0; !dup && j < i; j++) /* the same block twice in a batch */
            dup = slot[j] != DISKTIER_NONE && v[j].ns == v[i].ns && blockkey_eq(v[j].key, v[i].key);
        if (dup) {
            n_ok++;
            continue;
        }
        if ((slot[i] = slot_take(dt)) == DISKTIER_NONE) {
            dt->st.write_skips++;
            v[i].rc = KVD_ENOMEM;
        }
    }
    pthread_mutex_unlock(&dt->mu);

    for (size_t i = 0; i < n; i++) {
        res[i] = -1;
        err[i] = 0;
        if (slot[i] == DISKTIER_NONE)
            continue;
        slot_hdr_fill(dt, &v[i]);
        fault[i] = wr_fault_next();
        if (fault[i] != WR_OK) { /* a fault is one block's: written on its own */
            res[i] = slot_write(dt, v[i].buf, slot[i], fault[i]);
            err[i] = errno;
            reqs++;
        } else {
            ord[n_ord++] = i;
        }
    }
    /* The others by slot; runs of adjacent slots go out as one pwritev. */
    for (size_t i = 1; i < n_ord; i++) {
        size_t x = ord[i], j = i;
        while (j > 0 && slot[ord[j - 1]] > slot[x]) {
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = x;
    }
    for (size_t k = 0; k < n_ord;) {
        size_t run = 1;
        while (k + run < n_ord && run < per_req && slot[ord[k + run]] == slot[ord[k]] + run)
            run++;
        for (size_t r = 0; r < run; r++)
            iov[r] = (struct iovec){v[ord[k + r]].buf, dt->slot_bytes};
        ssize_t w = pwritev(dt->data_fd, iov, (int)run, slot_off(dt, slot[ord[k]]));
        int e = errno;
        reqs++;
        if (w == (ssize_t)(run * dt->slot_bytes)) {
            for (size_t r = 0; r < run; r++)
                res[ord[k + r]] = (ssize_t)dt->slot_bytes;
        } else { /* failed or short: each block once more on its own */
            for (size_t r = 0; r < run; r++) {
                size_t i = ord[k + r];
                res[i] = run == 1 ? w : slot_write(dt, v[i].buf, slot[i], WR_OK);
                err[i] = run == 1 ? e : errno;
                reqs += run > 1;
            }
        }
        k += run;
    }

    pthread_mutex_lock(&dt->mu);
    dt->st.write_reqs += reqs;
    for (size_t i = 0; i < n; i++) {
        if (slot[i] == DISKTIER_NONE)
            continue;
        bool ok = res[i] == (ssize_t)dt->slot_bytes;
        v[i].rc = put_finish(dt, slot[i], &v[i], ok, ok || res[i] >= 0 ? 0 : err[i]);
        n_ok += v[i].rc == 0;
    }
    pthread_mutex_unlock(&dt->mu);
out:
    free(slot);
    free(ord);
    free(res);
    free(err);
    free(fault);
    free(iov);
    return n_ok;
}

int disktier_put(struct disktier *dt, const char *ns_name, uint64_t ns, struct blockkey key,
                 const uint32_t *tokens, void *buf)
{
    struct disktier_wr w = {.ns_name = ns_name, .ns = ns, .key = key, .tokens = tokens, .buf = buf};
    disktier_put_many(dt, &w, 1);
    return w.rc;
}

int disktier_sync(struct disktier *dt)
{
    int bad = fdatasync(dt->data_fd) != 0;
    bad |= fdatasync(dt->index_fd) != 0;
    if (fault_should_fail(FAULT_DISK_FSYNC))
        bad = 1;
    pthread_mutex_lock(&dt->mu);
    size_t lost = 0;
    if (bad) {
        /* After a failed fsync the kernel may have dropped those pages:
         * nothing written since the last good sync is trusted. */
        dt->st.io_errors++;
        for (size_t i = 0; i < dt->n_unsynced; i++) {
            uint32_t s = dt->unsynced[i];
            if (dt->slots[s].state == SLOT_VALID) {
                slot_drop(dt, s);
                lost++;
            }
        }
    }
    dt->n_unsynced = 0;
    pthread_mutex_unlock(&dt->mu);
    if (bad)
        log_warn("disk tier %s: fdatasync failed; the %zu blocks written since the last good "
                 "sync are dropped",
                 dt->dir, lost);
    return bad ? KVD_EINTERNAL : 0;
}

int disktier_pin(struct disktier *dt, uint64_t ns, struct blockkey key, uint64_t expires)
{
    pthread_mutex_lock(&dt->mu);
    uint32_t e = dt->table[table_find(dt, ns, key)];
    if (!e) {
        pthread_mutex_unlock(&dt->mu);
        return KVD_ENOTFOUND;
    }
    struct disk_rec *r = &dt->recs[e - 1];
    if (expires && r->expires > expires) /* pinned longer by another session */
        expires = r->expires;
    if (!r->expires != !expires)
        dt->st.pinned_slots += expires ? 1 : (uint64_t)-1;
    r->expires = expires;
    r->sum = rec_sum(r);
    rec_write(dt, e - 1);
    pthread_mutex_unlock(&dt->mu);
    return 0;
}

void disktier_stats(struct disktier *dt, struct disktier_stats *st)
{
    pthread_mutex_lock(&dt->mu);
    *st = dt->st;
    pthread_mutex_unlock(&dt->mu);
}

size_t disktier_check_index(const void *bytes, size_t len, size_t block_bytes,
                            uint32_t block_tokens)
{
    struct file_hdr h;
    struct disktier dt = {.block_bytes = block_bytes, .block_tokens = block_tokens};
    size_t n = 0;
    if (len < sizeof h)
        return 0;
    memcpy(&h, bytes, sizeof h);
    dt.slot_bytes = slot_bytes_for(block_bytes, block_tokens);
    dt.n_slots = h.n_slots;
    if (hdr_mismatch(&dt, &h, 1)[0] || len < PAGE)
        return 0;
    const unsigned char *p = (const unsigned char *)bytes + PAGE;
    size_t avail = (len - PAGE) / sizeof(struct disk_rec);
    for (size_t i = 0; i < avail && i < h.n_slots; i++) {
        struct disk_rec r;
        memcpy(&r, p + i * sizeof r, sizeof r);
        n += rec_ok(&r);
    }
    return n;
}
