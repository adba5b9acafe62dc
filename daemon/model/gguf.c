/* GGUF reader: parses the header, metadata and tensor infos of a mapped file
 * with a bounds-checked cursor; every size read from the file is checked
 * against the bytes that remain before it is trusted. Also holds the table of
 * ggml weight types (ctype_row_bytes) shared by the model and the backends. */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "compute.h"
#include "kvd/status.h"

#define GGUF_MAX_KEY 65535u /* longer keys are treated as corruption */

const char *gguf_vtype_name(enum gguf_vtype t)
{
    static const char *const names[GGUF_VTYPE_COUNT] = {
        "u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
        "bool", "string", "array", "u64", "i64", "f64",
    };
    return (unsigned)t < GGUF_VTYPE_COUNT ? names[t] : "?";
}

/* A bounds-checked cursor over the file. */
struct rd {
    const uint8_t *p;
    size_t size, off;
    struct kvd_error *err;
};

/* KVD_EBADREQ with "gguf: " and the message in r->err. */
__attribute__((format(printf, 2, 3))) static int rd_fail(struct rd *r, const char *fmt, ...)
{
    char msg[KVD_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvd_error_set(r->err, KVD_EBADREQ, "gguf: %s", msg);
}

static int rd_nomem(struct rd *r)
{
    return kvd_error_set(r->err, KVD_ENOMEM, "gguf: out of memory");
}

static int rd_bytes(struct rd *r, void *out, size_t n, const char *what)
{
    if (r->size - r->off < n)
        return rd_fail(r, "file truncated reading %s at byte %zu (needs %zu bytes, %zu left)", what,
                       r->off, n, r->size - r->off);
    memcpy(out, r->p + r->off, n);
    r->off += n;
    return 0;
}

static int rd_u32(struct rd *r, uint32_t *v, const char *what)
{
    return rd_bytes(r, v, 4, what); /* GGUF is little-endian, as is every target */
}

static int rd_u64(struct rd *r, uint64_t *v, const char *what)
{
    return rd_bytes(r, v, 8, what);
}

/* A length-prefixed string: *s points into the file. */
static int rd_str(struct rd *r, const char **s, uint64_t *len, uint64_t max, const char *what)
{
    size_t at = r->off;
    int rc = rd_u64(r, len, what);
    if (rc)
        return rc;
    if (*len > max)
        return rd_fail(r, "%s at byte %zu has absurd length %" PRIu64 " (limit %" PRIu64 ")", what,
                       at, *len, max);
    if (*len > r->size - r->off)
        return rd_fail(r, "file truncated in %s at byte %zu (length %" PRIu64 ", %zu bytes left)",
                       what, at, *len, r->size - r->off);
    *s = (const char *)r->p + r->off;
    r->off += (size_t)*len;
    return 0;
}

static size_t vtype_size(enum gguf_vtype t)
{
    switch (t) {
    case GGUF_U8:
    case GGUF_I8:
    case GGUF_BOOL:
        return 1;
    case GGUF_U16:
    case GGUF_I16:
        return 2;
    case GGUF_U32:
    case GGUF_I32:
    case GGUF_F32:
        return 4;
    case GGUF_U64:
    case GGUF_I64:
    case GGUF_F64:
        return 8;
    default:
        return 0;
    }
}

/* Reads one scalar of type t into kv->v. */
static int rd_scalar(struct rd *r, enum gguf_vtype t, struct gguf_kv *kv)
{
    uint8_t b[8];
    int rc = rd_bytes(r, b, vtype_size(t), kv->key);
    if (rc)
        return rc;
    switch (t) {
    case GGUF_U8:
        kv->v.u = b[0];
        break;
    case GGUF_BOOL:
        kv->v.u = b[0] != 0;
        break;
    case GGUF_I8:
        kv->v.i = (int8_t)b[0];
        break;
    case GGUF_U16: {
        uint16_t x;
        memcpy(&x, b, 2);
        kv->v.u = x;
        break;
    }
    case GGUF_I16: {
        int16_t x;
        memcpy(&x, b, 2);
        kv->v.i = x;
        break;
    }
    case GGUF_U32: {
        uint32_t x;
        memcpy(&x, b, 4);
        kv->v.u = x;
        break;
    }
    case GGUF_I32: {
        int32_t x;
        memcpy(&x, b, 4);
        kv->v.i = x;
        break;
    }
    case GGUF_F32: {
        float x;
        memcpy(&x, b, 4);
        kv->v.f = x;
        break;
    }
    case GGUF_U64:
        memcpy(&kv->v.u, b, 8);
        break;
    case GGUF_I64:
        memcpy(&kv->v.i, b, 8);
        break;
    case GGUF_F64:
        memcpy(&kv->v.f, b, 8);
        break;
    default:
        return rd_fail(r, "internal: scalar type %d", (int)t);
    }
    return 0;
}

static int rd_kv(struct rd *r, struct gguf_kv *kv, uint64_t idx)
{
    const char *key = NULL; /* init: gcc -O3 maybe-uninitialized false positive */
    uint64_t klen = 0;
    uint32_t t = 0;
    char what[96];
    snprintf(what, sizeof what, "key of metadata entry %" PRIu64, idx);
    int rc = rd_str(r, &key, &klen, GGUF_MAX_KEY, what);
    if (rc)
        return rc;
    if (memchr(key, 0, (size_t)klen))
        return rd_fail(r, "metadata entry %" PRIu64 " has a key containing a NUL byte", idx);
    kv->key = malloc((size_t)klen + 1);
    if (!kv->key)
        return rd_nomem(r);
    memcpy(kv->key, key, (size_t)klen);
    kv->key[klen] = 0;
    size_t at = r->off;
    if ((rc = rd_u32(r, &t, kv->key)))
        return rc;
    if (t >= GGUF_VTYPE_COUNT)
        return rd_fail(r, "metadata '%s' has unknown value type %u at byte %zu", kv->key, t, at);
    kv->type = (enum gguf_vtype)t;
    if (t == GGUF_STRING)
        return rd_str(r, &kv->str, &kv->str_len, r->size, kv->key);
    if (t != GGUF_ARRAY)
        return rd_scalar(r, kv->type, kv);

    uint32_t et = 0;
    at = r->off;
    if ((rc = rd_u32(r, &et, kv->key)) || (rc = rd_u64(r, &kv->arr_count, kv->key)))
        return rc;
    if (et >= GGUF_VTYPE_COUNT || et == GGUF_ARRAY)
        return rd_fail(r, "metadata array '%s' has %s element type %u at byte %zu", kv->key,
                       et == GGUF_ARRAY ? "unsupported (nested array)" : "unknown", et, at);
    kv->arr_type = (enum gguf_vtype)et;
    kv->arr_data = r->p + r->off;
    size_t left = r->size - r->off;
    if (et == GGUF_STRING) {
        /* each string takes at least its 8-byte length */
        if (kv->arr_count > left / 8)
            return rd_fail(r,
                           "metadata array '%s' has absurd count %" PRIu64
                           " (only %zu bytes left in the file)",
                           kv->key, kv->arr_count, left);
        for (uint64_t i = 0; i < kv->arr_count; i++) {
            const char *s;
            uint64_t n;
            if ((rc = rd_str(r, &s, &n, r->size, kv->key)))
                return rc;
        }
    } else {
        size_t es = vtype_size(kv->arr_type);
        if (kv->arr_count > left / es)
            return rd_fail(r,
                           "metadata array '%s' has absurd count %" PRIu64
                           " of %s (only %zu bytes left in the file)",
                           kv->key, kv->arr_count, gguf_vtype_name(kv->arr_type), left);
        r->off += (size_t)kv->arr_count * es;
    }
    kv->arr_bytes = (uint64_t)(r->p + r->off - kv->arr_data);
    return 0;
}

static int rd_tensor(struct rd *r, struct gguf_tensor *t, uint64_t idx)
{
    const char *name;
    uint64_t nlen;
    char what[64];
    snprintf(what, sizeof what, "name of tensor %" PRIu64, idx);
    int rc = rd_str(r, &name, &nlen, UINT64_MAX, what);
    if (rc)
        return rc;
    if (nlen >= GGUF_MAX_NAME)
        return rd_fail(r, "tensor %" PRIu64 " has a name of %" PRIu64 " bytes (limit %d)", idx,
                       nlen, GGUF_MAX_NAME - 1);
    if (nlen == 0 || memchr(name, 0, (size_t)nlen))
        return rd_fail(r, "tensor %" PRIu64 " has an empty name or one containing a NUL byte", idx);
    memcpy(t->name, name, (size_t)nlen);
    t->name[nlen] = 0;
    size_t at = r->off;
    if ((rc = rd_u32(r, &t->n_dims, t->name)))
        return rc;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return rd_fail(r, "tensor '%s' has %u dimensions at byte %zu (must be 1..%d)", t->name,
                       t->n_dims, at, GGUF_MAX_DIMS);
    uint64_t nel = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= t->n_dims)
            continue;
        if ((rc = rd_u64(r, &t->ne[d], t->name)))
            return rc;
        if (t->ne[d] == 0 || t->ne[d] > (UINT64_C(1) << 40))
            return rd_fail(r, "tensor '%s' has invalid dimension ne[%u] = %" PRIu64, t->name, d,
                           t->ne[d]);
        if (nel > (UINT64_C(1) << 48) / t->ne[d])
            return rd_fail(r, "tensor '%s' element count overflows (dims too large)", t->name);
        nel *= t->ne[d];
    }
    at = r->off;
    if ((rc = rd_u32(r, &t->type, t->name)) || (rc = rd_u64(r, &t->offset, t->name)))
        return rc;
    size_t row = ctype_row_bytes((enum ctype)t->type, t->ne[0]);
    if (ctype_block_elems((enum ctype)t->type) == 0)
        return rd_fail(
            r,
            "tensor '%s' has unsupported or unknown type %u at byte %zu "
            "(supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k)",
            t->name, t->type, at);
    if (row == 0)
        return rd_fail(
            r, "tensor '%s': ne[0] = %" PRIu64 " is not a multiple of the %s block size (%u)",
            t->name, t->ne[0], ctype_name((enum ctype)t->type),
            ctype_block_elems((enum ctype)t->type));
    t->nbytes = (uint64_t)row * (nel / t->ne[0]);
    return 0;
}

static int cmp_name(const void *a, const void *b)
{
    const struct gguf_tensor *x = *(const struct gguf_tensor *const *)a;
    const struct gguf_tensor *y = *(const struct gguf_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static int cmp_offset(const void *a, const void *b)
{
    const struct gguf_tensor *x = *(const struct gguf_tensor *const *)a;
    const struct gguf_tensor *y = *(const struct gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int check_tensors(struct rd *r, struct gguf *g)
{
    int rc = 0;
    uint64_t data_size = g->size - g->data_offset;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment)
            return rd_fail(r,
                           "tensor '%s' data offset %" PRIu64 " is not a multiple of the "
                           "alignment %u",
                           t->name, t->offset, g->alignment);
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return rd_fail(r,
                           "tensor '%s' data [%" PRIu64 ", +%" PRIu64 ") runs past the end of "
                           "the file (data section has %" PRIu64 " bytes)",
                           t->name, t->offset, t->nbytes, data_size);
        t->data = g->map + g->data_offset + t->offset;
    }
    if (g->n_tensors < 2)
        return 0;
    const struct gguf_tensor **v = malloc(g->n_tensors * sizeof *v);
    if (!v)
        return rd_nomem(r);
    for (uint64_t i = 0; i < g->n_tensors; i++)
        v[i] = &g->tensors[i];
    qsort(v, g->n_tensors, sizeof *v, cmp_name);
    for (uint64_t i = 1; i < g->n_tensors; i++)
        if (strcmp(v[i - 1]->name, v[i]->name) == 0) {
            rc = rd_fail(r, "duplicate tensor name '%s'", v[i]->name);
            break;
        }
    if (rc == 0) {
        /* No tensor's bytes inside another's: a type or shape edited to a
         * larger one would otherwise read the next tensor's weights. */
        qsort(v, g->n_tensors, sizeof *v, cmp_offset);
        for (uint64_t i = 1; i < g->n_tensors && rc == 0; i++)
            if (v[i - 1]->offset + v[i - 1]->nbytes > v[i]->offset)
                rc = rd_fail(r,
                             "tensor '%s' data [%" PRIu64 ", +%" PRIu64 ") overlaps tensor '%s' "
                             "at %" PRIu64 " (a type or shape that does not match its data)",
                             v[i - 1]->name, v[i - 1]->offset, v[i - 1]->nbytes, v[i]->name,
                             v[i]->offset);
    }
    free(v);
    return rc;
}

static int cmp_key(const void *a, const void *b)
{
    const struct gguf_kv *x = *(const struct gguf_kv *const *)a;
    const struct gguf_kv *y = *(const struct gguf_kv *const *)b;
    return strcmp(x->key, y->key);
}

/* No key twice. Sorted, as check_tensors does for names: comparing each key
 * with all earlier ones was O(n^2) strcmp, 2^31 of them for the 65536 keys a
 * file may declare. */
static int check_keys(struct rd *r, const struct gguf *g)
{
    int rc = 0;
    if (g->n_kv < 2)
        return 0;
    const struct gguf_kv **v = malloc(g->n_kv * sizeof *v);
    if (!v)
        return rd_nomem(r);
    for (uint64_t i = 0; i < g->n_kv; i++)
        v[i] = &g->kv[i];
    qsort(v, g->n_kv, sizeof *v, cmp_key);
    for (uint64_t i = 1; i < g->n_kv; i++)
        if (strcmp(v[i - 1]->key, v[i]->key) == 0) {
            rc = rd_fail(r, "duplicate metadata key '%s'", v[i]->key);
            break;
        }
    free(v);
    return rc;
}

int gguf_parse(const void *data, size_t size, struct gguf **out, struct kvd_error *err)
{
    struct rd r = {.p = data, .size = size, .err = err};
    struct gguf *g = calloc(1, sizeof *g);
    int rc;
    uint8_t magic[4];
    *out = NULL;
    if (!g)
        return rd_nomem(&r);
    g->map = data;
    g->size = size;
    if ((rc = rd_bytes(&r, magic, 4, "magic")))
        goto fail;
    if (memcmp(magic, "GGUF", 4)) {
        rc = rd_fail(&r, "bad magic %02x %02x %02x %02x (not a GGUF file)", magic[0], magic[1],
                     magic[2], magic[3]);
        goto fail;
    }
    if ((rc = rd_u32(&r, &g->version, "version")))
        goto fail;
    if (g->version != 2 && g->version != 3) {
        rc = rd_fail(&r, "unsupported version %u (supported: 2, 3)", g->version);
        goto fail;
    }
    if ((rc = rd_u64(&r, &g->n_tensors, "tensor count")) ||
        (rc = rd_u64(&r, &g->n_kv, "metadata count")))
        goto fail;
    /* a tensor info takes at least 8+1+4+8+4+8 bytes, a kv at least 8+1+4+1 */
    if (g->n_tensors > (size - r.off) / 33) {
        rc = rd_fail(&r, "absurd tensor count %" PRIu64 " for a file of %zu bytes", g->n_tensors,
                     size);
        goto fail;
    }
    if (g->n_kv > (size - r.off) / 14 || g->n_kv > 65536) {
        rc =
            rd_fail(&r, "absurd metadata count %" PRIu64 " for a file of %zu bytes", g->n_kv, size);
        goto fail;
    }
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) {
        rc = rd_nomem(&r);
        goto fail;
    }
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        if ((rc = rd_kv(&r, &g->kv[i], i)))
            goto fail;
        if (strcmp(g->kv[i].key, "general.alignment") == 0) {
            const struct gguf_kv *kv = &g->kv[i];
            if (kv->type != GGUF_U32 || kv->v.u == 0 || (kv->v.u & (kv->v.u - 1)) ||
                kv->v.u > 65536) {
                rc = rd_fail(&r, "general.alignment must be a u32 power of two <= 65536");
                goto fail;
            }
            g->alignment = (uint32_t)kv->v.u;
        }
    }
    if ((rc = check_keys(&r, g)))
        goto fail;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((rc = rd_tensor(&r, &g->tensors[i], i)))
            goto fail;
    g->data_offset = (r.off + g->alignment - 1) / g->alignment * g->alignment;
    if (g->data_offset > size) {
        if (g->n_tensors) {
            rc = rd_fail(&r, "file truncated: the data section (byte %" PRIu64 ") is missing",
                         g->data_offset);
            goto fail;
        }
        g->data_offset = size;
    }
    if ((rc = check_tensors(&r, g)))
        goto fail;
    *out = g;
    return 0;
fail:
    gguf_close(g);
    return rc;
}

int gguf_open(const char *path, struct gguf **out, char *err, size_t errlen)
{
    struct stat st;
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; anything but
     * a regular file is refused below. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    *out = NULL;
    if (fd < 0) {
        snprintf(err, errlen, "gguf: cannot open %s: %s", path, strerror(errno));
        return errno == ENOENT ? KVD_ENOTFOUND : KVD_EBADREQ;
    }
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size == 0) {
        snprintf(err, errlen, "gguf: %s is not a regular non-empty file", path);
        close(fd);
        return KVD_EBADREQ;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        snprintf(err, errlen, "gguf: cannot map %s: %s", path, strerror(errno));
        return KVD_ENOMEM;
    }
    struct kvd_error perr;
    int rc = gguf_parse(map, (size_t)st.st_size, out, &perr);
    if (rc) {
        snprintf(err, errlen, "%s", perr.message);
        munmap(map, (size_t)st.st_size);
        return rc;
    }
    (*out)->mapped = true;
    return 0;
}

void gguf_close(struct gguf *g)
{
    if (!g)
        return;
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++)
            free(g->kv[i].key);
    free(g->kv);
    free(g->tensors);
    if (g->mapped)
        munmap((void *)g->map, g->size);
    free(g);
}

const struct gguf_kv *gguf_find_kv(const struct gguf *g, const char *key)
{
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (strcmp(g->kv[i].key, key) == 0)
            return &g->kv[i];
    return NULL;
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (strcmp(g->tensors[i].name, name) == 0)
            return &g->tensors[i];
    return NULL;
}

static bool is_signed(enum gguf_vtype t)
{
    return t == GGUF_I8 || t == GGUF_I16 || t == GGUF_I32 || t == GGUF_I64;
}

int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out, char *err, size_t errlen)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv)
        return KVD_ENOTFOUND;
    if (kv->type == GGUF_U8 || kv->type == GGUF_U16 || kv->type == GGUF_U32 ||
        kv->type == GGUF_U64) {
        if (kv->v.u <= UINT32_MAX) {
            *out = (uint32_t)kv->v.u;
            return 0;
        }
    } else if (is_signed(kv->type)) {
        if (kv->v.i >= 0 && kv->v.i <= (int64_t)UINT32_MAX) {
            *out = (uint32_t)kv->v.i;
            return 0;
        }
    } else {
        snprintf(err, errlen, "gguf: metadata '%s' is a %s, expected an integer", key,
                 gguf_vtype_name(kv->type));
        return KVD_EBADREQ;
    }
    snprintf(err, errlen, "gguf: metadata '%s' is out of range for a u32", key);
    return KVD_EBADREQ;
}

int gguf_get_f32(const struct gguf *g, const char *key, float *out, struct kvd_error *err)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv)
        return kvd_error_set(err, KVD_ENOTFOUND, "gguf: metadata '%s' is missing", key);
    if (kv->type == GGUF_F32 || kv->type == GGUF_F64) {
        *out = (float)kv->v.f;
        return 0;
    }
    return kvd_error_set(err, KVD_EBADREQ, "gguf: metadata '%s' is a %s, expected a float", key,
                         gguf_vtype_name(kv->type));
}

int gguf_get_str(const struct gguf *g, const char *key, char *buf, size_t cap, char *err,
                 size_t errlen)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv)
        return KVD_ENOTFOUND;
    if (kv->type != GGUF_STRING) {
        snprintf(err, errlen, "gguf: metadata '%s' is a %s, expected a string", key,
                 gguf_vtype_name(kv->type));
        return KVD_EBADREQ;
    }
    size_t n = kv->str_len < cap - 1 ? (size_t)kv->str_len : cap - 1;
    memcpy(buf, kv->str, n);
    buf[n] = 0;
    return 0;
}

uint64_t gguf_arr_count(const struct gguf *g, const char *key)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    return kv && kv->type == GGUF_ARRAY ? kv->arr_count : 0;
}
