/* kvmm_session: named sessions over the disk tier (kvmm.h "named
 * sessions"). A session is a tenant-scoped name for a token sequence; its
 * whole blocks are pinned on disk until it expires, and its tokens live in
 * memory and in DIR/sessions/<hash>.kvs:
 *
 *   header  magic "KVDSESS1", version, the model's chain(-1) (so another
 *           model's session is never loaded), expires, n_tokens, namespace
 *           and session names, XXH3-64 of the header (sum 0) and the tokens
 *   tokens  n_tokens little-endian uint32
 *
 * written to a temporary file, fsync'd and renamed over the old one, so a
 * crash leaves the old session or the new, never half of one. The table is
 * guarded by its own mutex (taken after the kvmm lock when both are held);
 * file I/O runs with neither held. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "disktier.h"
#include "kvmm_impl.h"
#include "log.h"
#include "workpool.h"

#define SESS_MAGIC "KVDSESS1"
#define SESS_VERSION 1u
#define SESS_MAX_TOKENS (1u << 24)

struct sess_hdr {
    char magic[8];
    uint32_t version, pad_;
    uint64_t root_lo, root_hi;
    uint64_t expires, n_tokens;
    char ns[DISKTIER_NS_NAME];
    char name[KVMM_SESSION_NAME + 8];
    uint64_t sum;
};

struct session {
    char ns[DISKTIER_NS_NAME];
    char name[KVMM_SESSION_NAME + 1];
    uint32_t *tokens;
    size_t n, blocks;
    uint64_t expires, bytes;
};

struct kvmm_sessions {
    pthread_mutex_t mu;
    char dir[4200]; /* DIR/sessions */
    struct session *v;
    size_t n, cap;
};

bool kvmm_session_name_ok(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    if (n == 0 || n > KVMM_SESSION_NAME)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              strchr("-_.:@/", c)))
            return false;
    }
    return true;
}

static uint64_t now_s(void)
{
    return (uint64_t)time(NULL);
}

static void file_of(const struct kvmm_sessions *ss, const char *ns, const char *name, char *path,
                    size_t cap)
{
    char key[DISKTIER_NS_NAME + KVMM_SESSION_NAME + 2];
    size_t a = strlen(ns), b = strlen(name);
    memcpy(key, ns, a);
    key[a] = '\0';
    memcpy(key + a + 1, name, b);
    XXH128_hash_t h = XXH3_128bits(key, a + 1 + b);
    snprintf(path, cap, "%s/%016" PRIx64 "%016" PRIx64 ".kvs", ss->dir, h.high64, h.low64);
}

static uint64_t sess_sum(struct sess_hdr *h, const uint32_t *tokens, size_t n)
{
    uint64_t saved = h->sum;
    XXH3_state_t *st = XXH3_createState();
    uint64_t v = 0;
    h->sum = 0;
    if (st) {
        XXH3_64bits_reset(st);
        XXH3_64bits_update(st, h, sizeof *h);
        XXH3_64bits_update(st, tokens, sizeof(uint32_t) * n);
        v = XXH3_64bits_digest(st);
        XXH3_freeState(st);
    }
    h->sum = saved;
    return v;
}

/* Under ss->mu. */
static struct session *find(struct kvmm_sessions *ss, const char *ns, const char *name)
{
    for (size_t i = 0; i < ss->n; i++)
        if (!strcmp(ss->v[i].ns, ns) && !strcmp(ss->v[i].name, name))
            return &ss->v[i];
    return NULL;
}

/* Under ss->mu: removes entry i (its tokens freed). */
static void remove_at(struct kvmm_sessions *ss, size_t i)
{
    free(ss->v[i].tokens);
    ss->v[i] = ss->v[--ss->n];
}

/* Under ss->mu: takes s (tokens owned) into the table, replacing one of the
 * same name. */
static int insert(struct kvmm_sessions *ss, struct session *s)
{
    struct session *old = find(ss, s->ns, s->name);
    if (old) {
        free(old->tokens);
        *old = *s;
        return 0;
    }
    if (ss->n == ss->cap) {
        size_t cap = ss->cap ? 2 * ss->cap : 16;
        struct session *v = realloc(ss->v, sizeof *v * cap);
        if (!v)
            return KVD_ENOMEM;
        ss->v = v;
        ss->cap = cap;
    }
    ss->v[ss->n++] = *s;
    return 0;
}

/* Reads one session file; 0 and *s filled (tokens malloc'd), or -1 with
 * *why saying what is wrong with it. */
static int read_file(const char *path, const struct blockkey *root, struct session *s,
                     const char **why)
{
    struct sess_hdr h;
    FILE *f = fopen(path, "rb");
    *why = "unreadable";
    if (!f)
        return -1;
    int rc = -1;
    uint32_t *toks = NULL;
    if (fread(&h, sizeof h, 1, f) != 1 || memcmp(h.magic, SESS_MAGIC, 8) ||
        h.version != SESS_VERSION || h.n_tokens > SESS_MAX_TOKENS) {
        *why = "no valid header";
        goto out;
    }
    if (h.root_lo != root->lo || h.root_hi != root->hi) {
        *why = "another model's";
        goto out;
    }
    h.ns[sizeof h.ns - 1] = '\0';
    h.name[sizeof h.name - 1] = '\0';
    toks = malloc(sizeof(uint32_t) * (h.n_tokens ? h.n_tokens : 1));
    if (!toks || fread(toks, sizeof(uint32_t), h.n_tokens, f) != h.n_tokens ||
        h.sum != sess_sum(&h, toks, h.n_tokens) || !kvmm_session_name_ok(h.name)) {
        *why = "damaged";
        goto out;
    }
    memset(s, 0, sizeof *s);
    snprintf(s->ns, sizeof s->ns, "%s", h.ns);
    memcpy(s->name, h.name, sizeof s->name - 1); /* name_ok: at most KVMM_SESSION_NAME bytes */
    s->tokens = toks;
    s->n = h.n_tokens;
    s->expires = h.expires;
    toks = NULL;
    rc = 0;
out:
    free(toks);
    fclose(f);
    return rc;
}

static int write_file(const struct kvmm_sessions *ss, const struct blockkey *root,
                      const struct session *s)
{
    char path[4300], tmp[4310];
    file_of(ss, s->ns, s->name, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    struct sess_hdr h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, SESS_MAGIC, 8);
    h.version = SESS_VERSION;
    h.root_lo = root->lo;
    h.root_hi = root->hi;
    h.expires = s->expires;
    h.n_tokens = s->n;
    snprintf(h.ns, sizeof h.ns, "%s", s->ns);
    snprintf(h.name, sizeof h.name, "%s", s->name);
    h.sum = sess_sum(&h, s->tokens, s->n);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    FILE *f = fdopen(fd, "wb");
    if (!f) {
        close(fd);
        return -1;
    }
    bool ok = fwrite(&h, sizeof h, 1, f) == 1 &&
              fwrite(s->tokens, sizeof(uint32_t), s->n, f) == s->n && fflush(f) == 0 &&
              fsync(fileno(f)) == 0;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    int dfd = open(ss->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) { /* the rename itself made durable */
        fsync(dfd);
        close(dfd);
    }
    return 0;
}

/* The keys of the whole blocks of tokens, chained from the model's root. */
static struct blockkey *keys_of(const struct kvmm *mm, const uint32_t *tokens, size_t nb)
{
    struct blockkey *k = malloc(sizeof *k * (nb ? nb : 1)), key = mm->root_key;
    uint32_t bt = mm->geom.block_tokens;
    for (size_t b = 0; k && b < nb; b++)
        k[b] = key = blockkey_next(key, tokens + b * bt, bt);
    return k;
}

/* Pins (or unpins: expires 0) the leading whole blocks of s on disk. */
static void pin(struct kvmm *mm, const struct session *s, uint64_t expires)
{
    struct disktier *dt = mm_disk_tier(mm);
    size_t nb = s->blocks;
    struct blockkey *k = keys_of(mm, s->tokens, nb);
    uint64_t ns = blockkey_ns(s->ns);
    for (size_t b = 0; k && b < nb; b++)
        disktier_pin(dt, ns, k[b], expires);
    free(k);
}

/* Under ss->mu: drops expired sessions (their files go too; their pins
 * ran out by themselves). */
static void sweep(struct kvmm_sessions *ss)
{
    uint64_t now = now_s();
    for (size_t i = 0; i < ss->n;) {
        if (ss->v[i].expires > now) {
            i++;
            continue;
        }
        char path[4300];
        file_of(ss, ss->v[i].ns, ss->v[i].name, path, sizeof path);
        unlink(path);
        remove_at(ss, i);
    }
}

int mm_sessions_load(struct kvmm *mm, const char *dir, struct kvd_error *e)
{
    struct kvmm_sessions *ss = calloc(1, sizeof *ss);
    if (!ss)
        return kvd_error_set(e, KVD_ENOMEM, "sessions: out of memory");
    pthread_mutex_init(&ss->mu, NULL);
    snprintf(ss->dir, sizeof ss->dir, "%s/sessions", dir);
    if (mkdir(ss->dir, 0700) && errno != EEXIST) {
        int rc = kvd_error_set(e, KVD_EINTERNAL, "sessions: cannot create %s: %s", ss->dir,
                               strerror(errno));
        pthread_mutex_destroy(&ss->mu);
        free(ss);
        return rc;
    }
    DIR *d = opendir(ss->dir);
    struct dirent *de;
    size_t skipped = 0;
    uint64_t now = now_s();
    uint64_t slot_bytes = 0;
    struct disktier_stats ts;
    disktier_stats(mm_disk_tier(mm), &ts);
    slot_bytes = ts.slot_bytes;
    while (d && (de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name);
        if (len < 5 || strcmp(de->d_name + len - 4, ".kvs"))
            continue;
        char path[4600];
        snprintf(path, sizeof path, "%s/%s", ss->dir, de->d_name);
        struct session s;
        const char *why;
        if (read_file(path, &mm->root_key, &s, &why) != 0) {
            if (strcmp(why, "another model's") != 0) {
                log_warn("sessions: %s is %s: removed", path, why);
                unlink(path);
            }
            skipped++;
            continue;
        }
        if (s.expires <= now) {
            unlink(path);
            free(s.tokens);
            continue;
        }
        s.blocks = s.n / mm->geom.block_tokens;
        s.bytes = s.blocks * slot_bytes + sizeof(struct sess_hdr) + 4 * s.n;
        if (insert(ss, &s) != 0)
            free(s.tokens);
    }
    if (d)
        closedir(d);
    kvmm_lock(mm);
    struct kvmm_sessions *old = mm->sessions;
    mm->sessions = ss;
    kvmm_unlock(mm);
    if (old) { /* a reload's (kvmm_sessions_reload): nobody uses it any more */
        for (size_t i = 0; i < old->n; i++)
            free(old->v[i].tokens);
        free(old->v);
        pthread_mutex_destroy(&old->mu);
        free(old);
    }
    if (ss->n || skipped)
        log_info("sessions: %zu loaded from %s (%zu of another model or unreadable)", ss->n,
                 ss->dir, skipped);
    return 0;
}

int kvmm_sessions_reload(struct kvmm *mm, struct kvd_error *e)
{
    MM_ASSERT_UNLOCKED(mm);
    char dir[4200];
    kvmm_lock(mm);
    struct kvmm_sessions *ss = mm->sessions;
    if (ss)
        snprintf(dir, sizeof dir, "%s", ss->dir);
    kvmm_unlock(mm);
    if (!ss)
        return 0;
    size_t len = strlen(dir);
    if (len > 9 && !strcmp(dir + len - 9, "/sessions"))
        dir[len - 9] = '\0';
    return mm_sessions_load(mm, dir, e);
}

void mm_sessions_free(struct kvmm *mm)
{
    struct kvmm_sessions *ss = mm->sessions;
    if (!ss)
        return;
    mm->sessions = NULL;
    for (size_t i = 0; i < ss->n; i++)
        free(ss->v[i].tokens);
    free(ss->v);
    pthread_mutex_destroy(&ss->mu);
    free(ss);
}

uint64_t mm_sessions_count(struct kvmm *mm)
{
    struct kvmm_sessions *ss = mm->sessions;
    if (!ss)
        return 0;
    workpool_mutex_lock(&ss->mu);
    uint64_t n = ss->n;
    workpool_mutex_unlock(&ss->mu);
    return n;
}

static int no_tier(struct kvd_error *e)
{
    return kvd_error_set(e, KVD_EUNSUPPORTED, "sessions need a disk tier (--disk-dir)");
}

/* The namespace's name, or NULL (lock held). */
static const char *ns_name_of(struct kvmm *mm, uint32_t ns)
{
    return ns < mm->tt.n_ns && mm->tt.ns_names[ns][0] ? mm->tt.ns_names[ns] : NULL;
}

/* Writes the whole blocks of tokens the tree holds and the disk does not;
 * returns how many leading blocks are on disk afterwards. */
static size_t ensure_on_disk(struct kvmm *mm, uint32_t ns, const char *ns_name,
                             const uint32_t *tokens, const struct blockkey *keys, size_t nb)
{
    struct disktier *dt = mm_disk_tier(mm);
    uint64_t nsh = blockkey_ns(ns_name);
    uint32_t bt = mm->geom.block_tokens;
    struct radix_node **path = malloc(sizeof *path * (nb ? nb : 1));
    void *buf = disktier_buf_new(dt);
    size_t b = 0;
    if (!path || !buf)
        goto out;
    for (; b < nb; b++) {
        if (disktier_has(dt, nsh, keys[b]))
            continue;
        bool copied = false;
        kvmm_lock(mm);
        if (ns_name_of(mm, ns) && !strcmp(ns_name_of(mm, ns), ns_name)) {
            size_t m = radix_match(&mm->radix, ns, tokens, (b + 1) * bt, path, b + 1);
            if (m == b + 1) {
                uint32_t id = path[b]->block;
                struct pool_block *pb = pool_block(&mm->pool, id);
                copied = blockkey_eq(pb->key, keys[b]) &&
                         mm_disk_copy_out(mm, id, disktier_data(dt, buf));
                if (copied)
                    pb->disk = POOL_DISK_CLEAN;
            }
        }
        kvmm_unlock(mm);
        MM_ASSERT_UNLOCKED(mm);
        if (!copied || disktier_put(dt, ns_name, nsh, keys[b], tokens + b * bt, buf) != 0)
            break;
    }
    if (b)
        disktier_sync(dt);
out:
    free(path);
    free(buf);
    return b;
}

int kvmm_session_save(struct kvmm *mm, uint32_t tenant, uint32_t ns, const char *name,
                      const uint32_t *tokens, size_t n, uint64_t ttl_s,
                      struct kvmm_session_info *info, struct kvd_error *e)
{
    struct kvmm_sessions *ss = mm->sessions;
    if (!ss)
        return no_tier(e);
    if (!kvmm_session_name_ok(name))
        return kvd_error_set(e, KVD_EBADREQ, "a session name is 1 to %d letters, digits or -_.:@/",
                             KVMM_SESSION_NAME);
    if (n > SESS_MAX_TOKENS)
        return kvd_error_set(e, KVD_ETOOLARGE, "a session holds at most %u tokens",
                             SESS_MAX_TOKENS);
    struct session s = {.n = n, .expires = now_s() + ttl_s};
    uint64_t quota;
    kvmm_lock(mm);
    const char *nsn = ns_name_of(mm, ns);
    if (nsn)
        snprintf(s.ns, sizeof s.ns, "%s", nsn);
    quota = tenant_live(&mm->tt, tenant) ? mm->tt.v[tenant].conf.max_disk_bytes : 0;
    kvmm_unlock(mm);
    if (!nsn)
        return kvd_error_set(e, KVD_ENOTFOUND, "no namespace %u", ns);
    snprintf(s.name, sizeof s.name, "%s", name);
    size_t nb = n / mm->geom.block_tokens;
    struct disktier_stats ts;
    disktier_stats(mm_disk_tier(mm), &ts);
    uint64_t bytes = nb * ts.slot_bytes + sizeof(struct sess_hdr) + 4 * n;
    workpool_mutex_lock(&ss->mu);
    sweep(ss);
    uint64_t used = 0;
    for (size_t i = 0; i < ss->n; i++)
        if (!strcmp(ss->v[i].ns, s.ns) && strcmp(ss->v[i].name, name))
            used += ss->v[i].bytes;
    workpool_mutex_unlock(&ss->mu);
    if (quota && used + bytes > quota)
        return kvd_error_set(e, KVD_EQUOTA,
                             "the tenant's sessions would take %" PRIu64
                             " bytes of disk, over its max-disk-bytes (%" PRIu64 ")",
                             used + bytes, quota);
    s.tokens = malloc(sizeof(uint32_t) * (n ? n : 1));
    struct blockkey *keys = keys_of(mm, tokens, nb);
    if (!s.tokens || !keys) {
        free(s.tokens);
        free(keys);
        return kvd_error_set(e, KVD_ENOMEM, "sessions: out of memory");
    }
    memcpy(s.tokens, tokens, sizeof(uint32_t) * n);
    s.blocks = ensure_on_disk(mm, ns, s.ns, tokens, keys, nb);
    free(keys);
    s.bytes = bytes;
    pin(mm, &s, s.expires);
    if (write_file(ss, &mm->root_key, &s) != 0) {
        int rc = kvd_error_set(e, KVD_EINTERNAL, "sessions: cannot write the session file: %s",
                               strerror(errno));
        pin(mm, &s, 0);
        free(s.tokens);
        return rc;
    }
    if (info)
        *info = (struct kvmm_session_info){
            .n_tokens = n, .bytes = bytes, .expires = s.expires, .blocks = s.blocks};
    if (info)
        snprintf(info->name, sizeof info->name, "%s", name);
    workpool_mutex_lock(&ss->mu);
    int rc = insert(ss, &s);
    workpool_mutex_unlock(&ss->mu);
    if (rc) {
        free(s.tokens);
        return kvd_error_set(e, rc, "sessions: out of memory");
    }
    return 0;
}

int kvmm_session_tokens(struct kvmm *mm, uint32_t ns, const char *name, uint32_t **tokens,
                        size_t *n, struct kvd_error *e)
{
    struct kvmm_sessions *ss = mm->sessions;
    char nsn[DISKTIER_NS_NAME] = "";
    *tokens = NULL;
    *n = 0;
    if (!ss)
        return no_tier(e);
    kvmm_lock(mm);
    if (ns_name_of(mm, ns))
        snprintf(nsn, sizeof nsn, "%s", ns_name_of(mm, ns));
    kvmm_unlock(mm);
    workpool_mutex_lock(&ss->mu);
    const struct session *s = find(ss, nsn, name ? name : "");
    int rc = 0;
    if (!s || s->expires <= now_s()) {
        rc = kvd_error_set(e, KVD_ENOTFOUND, "no session '%s'", name ? name : "");
    } else if (!(*tokens = malloc(sizeof(uint32_t) * (s->n ? s->n : 1)))) {
        rc = kvd_error_set(e, KVD_ENOMEM, "sessions: out of memory");
    } else {
        memcpy(*tokens, s->tokens, sizeof(uint32_t) * s->n);
        *n = s->n;
    }
    workpool_mutex_unlock(&ss->mu);
    return rc;
}

int kvmm_session_delete(struct kvmm *mm, uint32_t ns, const char *name, struct kvd_error *e)
{
    struct kvmm_sessions *ss = mm->sessions;
    char nsn[DISKTIER_NS_NAME] = "";
    if (!ss)
        return no_tier(e);
    kvmm_lock(mm);
    if (ns_name_of(mm, ns))
        snprintf(nsn, sizeof nsn, "%s", ns_name_of(mm, ns));
    kvmm_unlock(mm);
    workpool_mutex_lock(&ss->mu);
    struct session *s = find(ss, nsn, name ? name : "");
    if (!s) {
        workpool_mutex_unlock(&ss->mu);
        return kvd_error_set(e, KVD_ENOTFOUND, "no session '%s'", name ? name : "");
    }
    char path[4300];
    file_of(ss, s->ns, s->name, path, sizeof path);
    unlink(path);
    /* Unpin its blocks, then pin again what the namespace's other sessions
     * share with it. */
    pin(mm, s, 0);
    remove_at(ss, (size_t)(s - ss->v));
    for (size_t i = 0; i < ss->n; i++)
        if (!strcmp(ss->v[i].ns, nsn))
            pin(mm, &ss->v[i], ss->v[i].expires);
    workpool_mutex_unlock(&ss->mu);
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct kvmm_session_info *)a)->name,
                  ((const struct kvmm_session_info *)b)->name);
}

int kvmm_session_list(struct kvmm *mm, uint32_t ns, struct kvmm_session_info **out, size_t *n)
{
    struct kvmm_sessions *ss = mm->sessions;
    char nsn[DISKTIER_NS_NAME] = "";
    *out = NULL;
    *n = 0;
    if (!ss)
        return KVD_EUNSUPPORTED;
    kvmm_lock(mm);
    if (ns_name_of(mm, ns))
        snprintf(nsn, sizeof nsn, "%s", ns_name_of(mm, ns));
    kvmm_unlock(mm);
    workpool_mutex_lock(&ss->mu);
    uint64_t now = now_s();
    struct kvmm_session_info *v = calloc(ss->n ? ss->n : 1, sizeof *v);
    if (!v) {
        workpool_mutex_unlock(&ss->mu);
        return KVD_ENOMEM;
    }
    size_t k = 0;
    for (size_t i = 0; i < ss->n; i++) {
        const struct session *s = &ss->v[i];
        if (strcmp(s->ns, nsn) || s->expires <= now)
            continue;
        snprintf(v[k].name, sizeof v[k].name, "%s", s->name);
        v[k].n_tokens = s->n;
        v[k].bytes = s->bytes;
        v[k].expires = s->expires;
        v[k].blocks = s->blocks;
        k++;
    }
    workpool_mutex_unlock(&ss->mu);
    qsort(v, k, sizeof *v, by_name);
    *out = v;
    *n = k;
    return 0;
}
