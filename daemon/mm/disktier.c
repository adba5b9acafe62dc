/* disktier: the slab files and the index (disktier.h): opening, formatting and loading a
 * directory, lookups, session pins, stats. Reads are disktier_read.c's, writes and eviction
 * disktier_write.c's. Every integer in the files is little-endian (kvd builds for
 * little-endian hosts only: disktier_impl.h asserts it). */
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

#include "disktier_impl.h"
#include "fault.h"
#include "log.h"

uint64_t dt_round_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

static size_t hdr_bytes_for(uint32_t block_tokens)
{
    return dt_round_up(sizeof(struct slot_hdr) + 4ull * block_tokens, PAGE);
}

static size_t slot_bytes_for(size_t block_bytes, uint32_t block_tokens)
{
    return hdr_bytes_for(block_tokens) + dt_round_up(block_bytes, PAGE);
}

uint64_t dt_rec_sum(const struct disk_rec *r)
{
    return XXH3_64bits(r, offsetof(struct disk_rec, sum));
}

static uint64_t file_hdr_sum(const struct file_hdr *h)
{
    return XXH3_64bits(h, offsetof(struct file_hdr, sum));
}

static bool rec_ok(const struct disk_rec *r)
{
    return r->magic == REC_MAGIC && (r->flags & REC_VALID) && r->sum == dt_rec_sum(r);
}

/* ---- the in-memory index ------------------------------------------------ */

static uint64_t key_hash(const struct disktier *dt, uint64_t ns, struct blockkey k)
{
    uint64_t v[3] = {ns, k.lo, k.hi};
    return XXH3_64bits_withSeed(v, sizeof v, dt->seed);
}

uint64_t dt_table_find(const struct disktier *dt, uint64_t ns, struct blockkey k)
{
    uint64_t mask = dt->cap - 1;
    for (uint64_t i = key_hash(dt, ns, k) & mask;; i = (i + 1) & mask) {
        uint32_t e = dt->table[i];
        if (e == 0 || dt_rec_is(&dt->recs[e - 1], ns, k))
            return i;
    }
}

void dt_table_add(struct disktier *dt, uint32_t slot)
{
    const struct disk_rec *r = &dt->recs[slot];
    uint64_t i = dt_table_find(dt, r->ns, (struct blockkey){r->key_lo, r->key_hi});
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
    uint64_t i = dt_table_find(dt, r->ns, (struct blockkey){r->key_lo, r->key_hi});
    if (dt->table[i] == slot + 1)
        table_del_at(dt, i);
}

void dt_lru_unlink(struct disktier *dt, uint32_t s)
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

void dt_lru_push_front(struct disktier *dt, uint32_t s)
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

void dt_free_push(struct disktier *dt, uint32_t s)
{
    dt->slots[s].state = SLOT_FREE;
    dt->slots[s].prev = DISKTIER_NONE;
    dt->slots[s].next = dt->free_head;
    dt->free_head = s;
    dt->st.free_slots++;
}

/* Writes slot s's record (buffered; disktier_sync makes it durable). */
int dt_rec_write(struct disktier *dt, uint32_t s)
{
    off_t off = (off_t)PAGE + (off_t)s * (off_t)sizeof(struct disk_rec);
    ssize_t w = pwrite(dt->index_fd, &dt->recs[s], sizeof(struct disk_rec), off);
    return w == (ssize_t)sizeof(struct disk_rec) ? 0 : -1;
}

void dt_slot_drop(struct disktier *dt, uint32_t s)
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
    dt_lru_unlink(dt, s);
    if (dt->recs[s].flags & REC_VALID && dt->recs[s].expires)
        dt->st.pinned_slots--;
    memset(&dt->recs[s], 0, sizeof dt->recs[s]);
    dt_rec_write(dt, s);
    dt->st.cached_slots--;
    dt_free_push(dt, s);
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
        dt->uuid = dt_now_ns() ^ (uint64_t)getpid();
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
        uint64_t i = dt_table_find(dt, r->ns, k);
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
        dt->slots[s].weight = 1; /* unknown until written or touched again */
        if (dt->recs[s].expires)
            dt->st.pinned_slots++;
        dt_lru_push_front(dt, s);
    }
    dt->st.cached_slots = dt->st.loaded = n_order;
    for (uint64_t s = dt->n_slots; s-- > 0;)
        if (dt->slots[s].state == SLOT_FREE)
            dt_free_push(dt, (uint32_t)s);
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
    dt->lru = c->lru;
    dt->hdr_bytes = hdr_bytes_for(c->block_tokens);
    dt->slot_bytes = slot_bytes;
    dt->n_slots = n_slots;
    dt->lru_head = dt->lru_tail = dt->free_head = DISKTIER_NONE;
    dt->st.slots = n_slots;
    dt->st.slot_bytes = slot_bytes;
    dt->st.file_bytes = PAGE + n_slots * slot_bytes;
    if (getrandom(&dt->seed, sizeof dt->seed, 0) != sizeof dt->seed)
        dt->seed = dt_now_ns();
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
    dt_lock(dt);
    free(dt->drops);
    dt->drops = d;
    dt->drops_cap = cap;
    dt->drops_head = dt->drops_n = 0;
    dt_unlock(dt);
    return 0;
}

size_t disktier_take_drops(struct disktier *dt, struct disktier_drop *out, size_t max)
{
    size_t n = 0;
    dt_lock(dt);
    while (n < max && dt->drops_n) {
        out[n++] = dt->drops[dt->drops_head];
        dt->drops_head = (dt->drops_head + 1) % dt->drops_cap;
        dt->drops_n--;
    }
    dt_unlock(dt);
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
    dt_lock(dt);
    uint32_t e = dt->table[dt_table_find(dt, ns, key)];
    uint32_t s = e ? e - 1 : DISKTIER_NONE;
    if (e)
        dt->slots[s].readers++;
    dt_unlock(dt);
    return s;
}

bool disktier_has(struct disktier *dt, uint64_t ns, struct blockkey key)
{
    dt_lock(dt);
    bool has = dt->table[dt_table_find(dt, ns, key)] != 0;
    dt_unlock(dt);
    return has;
}

void disktier_unpin(struct disktier *dt, uint32_t slot)
{
    dt_lock(dt);
    if (slot < dt->n_slots && dt->slots[slot].readers)
        dt->slots[slot].readers--;
    dt_unlock(dt);
}

uint64_t dt_slot_hdr_sum(struct slot_hdr *h, uint32_t n_tokens)
{
    uint64_t saved = h->sum;
    h->sum = 0;
    uint64_t v = XXH3_64bits(h, sizeof *h + 4ull * n_tokens);
    h->sum = saved;
    return v;
}

int disktier_pin(struct disktier *dt, uint64_t ns, struct blockkey key, uint64_t expires)
{
    dt_lock(dt);
    uint32_t e = dt->table[dt_table_find(dt, ns, key)];
    if (!e) {
        dt_unlock(dt);
        return KVD_ENOTFOUND;
    }
    struct disk_rec *r = &dt->recs[e - 1];
    if (expires && r->expires > expires) /* pinned longer by another session */
        expires = r->expires;
    if (!r->expires != !expires)
        dt->st.pinned_slots += expires ? 1 : (uint64_t)-1;
    r->expires = expires;
    r->sum = dt_rec_sum(r);
    dt_rec_write(dt, e - 1);
    dt_unlock(dt);
    return 0;
}

void disktier_stats(struct disktier *dt, struct disktier_stats *st)
{
    dt_lock(dt);
    *st = dt->st;
    dt_unlock(dt);
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
