/* GGUF reader (versions 2 and 3): maps a model file read-only and validates
 * every count, length, offset and size against the file before anything is
 * used, so a truncated or corrupt file is an error message, never a crash.
 * The format is described in the founders' design notes (GGUF-NOTES.md) and ggml's
 * docs/gguf.md. */
#ifndef KVD_GGUF_H
#define KVD_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd/status.h"

enum gguf_vtype {
    GGUF_U8 = 0,
    GGUF_I8 = 1,
    GGUF_U16 = 2,
    GGUF_I16 = 3,
    GGUF_U32 = 4,
    GGUF_I32 = 5,
    GGUF_F32 = 6,
    GGUF_BOOL = 7,
    GGUF_STRING = 8,
    GGUF_ARRAY = 9,
    GGUF_U64 = 10,
    GGUF_I64 = 11,
    GGUF_F64 = 12,
    GGUF_VTYPE_COUNT
};

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4
#define GGUF_MAX_NAME 64 /* tensor names are < 64 bytes, as in ggml */

/* One metadata entry. Strings and arrays point into the mapped file. */
struct gguf_kv {
    char *key; /* NUL-terminated copy, owned by the gguf */
    enum gguf_vtype type;
    union {
        uint64_t u; /* any unsigned integer type, bool */
        int64_t i;  /* any signed integer type */
        double f;   /* f32 / f64 */
    } v;
    const char *str; /* GGUF_STRING: bytes (not NUL-terminated) and length */
    uint64_t str_len;
    /* GGUF_ARRAY: element type, count, and the first element in the file
     * (strings are length-prefixed; use gguf_arr_str to walk them). */
    enum gguf_vtype arr_type;
    uint64_t arr_count;
    const uint8_t *arr_data;
    uint64_t arr_bytes;
};

struct gguf_tensor {
    char name[GGUF_MAX_NAME];
    uint32_t n_dims;
    uint64_t ne[GGUF_MAX_DIMS]; /* ne[0] innermost; unused dims are 1 */
    uint32_t type;              /* ggml type id (enum ctype in compute.h) */
    uint64_t offset;            /* from the start of the data section */
    uint64_t nbytes;
    const void *data; /* inside the mapping */
};

struct gguf {
    uint32_t version;
    uint64_t n_kv, n_tensors;
    struct gguf_kv *kv;          /* [n_kv] */
    struct gguf_tensor *tensors; /* [n_tensors] */
    uint32_t alignment;
    uint64_t data_offset; /* file offset of the data section */
    const uint8_t *map;   /* the whole file (read-only mapping or caller memory) */
    size_t size;
    bool mapped;
};

/* Opens and validates `path`. On failure returns KVD_EBADREQ (bad file),
 * KVD_EIO-like open errors as KVD_ENOTFOUND, or KVD_ENOMEM, with a message
 * in err naming what is wrong and where (byte offset). gguf_open,
 * gguf_get_u32 and gguf_get_str report into a char buffer because the text
 * layer (text.c, tokenizer.c) calls them that way. */
int gguf_open(const char *path, struct gguf **out, char *err, size_t errlen);
/* Same, over `size` bytes of caller memory that must outlive the gguf;
 * err (may be NULL) gets the code and message of every failure. */
int gguf_parse(const void *data, size_t size, struct gguf **out, struct kvd_error *err);
void gguf_close(struct gguf *g);

const struct gguf_kv *gguf_find_kv(const struct gguf *g, const char *key);
const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name);
/* Typed getters: 0, KVD_ENOTFOUND (absent), or KVD_EBADREQ (wrong type or
 * out of range; err says which key). Integer getters accept any integer
 * type whose value fits. gguf_get_f32 sets err (may be NULL) for either
 * failure, gguf_get_u32 and gguf_get_str only for KVD_EBADREQ. */
int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out, char *err, size_t errlen);
int gguf_get_f32(const struct gguf *g, const char *key, float *out, struct kvd_error *err);
/* String value copied NUL-terminated into buf (truncated to cap-1). */
int gguf_get_str(const struct gguf *g, const char *key, char *buf, size_t cap, char *err,
                 size_t errlen);
/* Number of elements of an array entry (0 if absent or not an array). */
uint64_t gguf_arr_count(const struct gguf *g, const char *key);

const char *gguf_vtype_name(enum gguf_vtype t);

#endif
