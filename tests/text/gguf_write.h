/* A metadata-only GGUF (v3) writer for the tokenizer's tests and tools:
 * key/value pairs into a memory buffer, no tensors. kvd-gguf-gen
 * --tokenizer FILE copies the tokenizer.* entries of such a file into a
 * loadable model. */
#ifndef KVD_TESTS_GGUF_WRITE_H
#define KVD_TESTS_GGUF_WRITE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct gw {
    uint8_t *p; /* the key/value section */
    size_t n, cap;
    uint64_t n_kv;
};

static inline void gw_put(struct gw *w, const void *s, size_t n)
{
    if (w->n + n > w->cap) {
        size_t cap = w->cap ? w->cap : 4096;
        while (cap < w->n + n)
            cap *= 2;
        uint8_t *p = realloc(w->p, cap);
        if (!p) {
            fprintf(stderr, "gguf_write: out of memory\n");
            exit(1);
        }
        w->p = p;
        w->cap = cap;
    }
    memcpy(w->p + w->n, s, n);
    w->n += n;
}

static inline void gw_u32(struct gw *w, uint32_t v)
{
    gw_put(w, &v, 4);
}

static inline void gw_u64(struct gw *w, uint64_t v)
{
    gw_put(w, &v, 8);
}

static inline void gw_strn(struct gw *w, const char *s, size_t n)
{
    gw_u64(w, n);
    gw_put(w, s, n);
}

static inline void gw_key(struct gw *w, const char *k, uint32_t type)
{
    gw_strn(w, k, strlen(k));
    gw_u32(w, type);
    w->n_kv++;
}

static inline void gw_kv_str(struct gw *w, const char *k, const char *v)
{
    gw_key(w, k, 8);
    gw_strn(w, v, strlen(v));
}

static inline void gw_kv_u32(struct gw *w, const char *k, uint32_t v)
{
    gw_key(w, k, 4);
    gw_u32(w, v);
}

static inline void gw_kv_bool(struct gw *w, const char *k, bool v)
{
    uint8_t b = v;
    gw_key(w, k, 7);
    gw_put(w, &b, 1);
}

/* Array header: element type and count; the caller writes the elements. */
static inline void gw_kv_arr(struct gw *w, const char *k, uint32_t elem_type, uint64_t n)
{
    gw_key(w, k, 9);
    gw_u32(w, elem_type);
    gw_u64(w, n);
}

/* The whole file: header, then the key/value section. *len set. */
static inline uint8_t *gw_finish(const struct gw *w, size_t *len)
{
    size_t n = 4 + 4 + 8 + 8 + w->n;
    uint8_t *p = malloc(n + 32);
    *len = 0; /* also on failure */
    if (!p)
        return NULL;
    uint32_t ver = 3;
    uint64_t nt = 0;
    memcpy(p, "GGUF", 4);
    memcpy(p + 4, &ver, 4);
    memcpy(p + 8, &nt, 8);
    memcpy(p + 16, &w->n_kv, 8);
    if (w->n)
        memcpy(p + 24, w->p, w->n);
    /* pad to the default alignment: the (empty) data section starts there */
    while (n % 32)
        p[n++] = 0;
    *len = n;
    return p;
}

static inline void gw_free(struct gw *w)
{
    free(w->p);
    memset(w, 0, sizeof(*w));
}

#endif
