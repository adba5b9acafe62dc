/* GBNF matching: interned pushdown stacks, interned stack sets, and
 * token masks over the sorted vocabulary (grammar.h says why).
 *
 * Semantics are llama.cpp's: a state is a set of stacks whose tops are
 * terminals (or the empty stack: the sentence may end); a code point moves
 * every stack whose top matches it to its next element and expands rule
 * references there; a token's piece is decoded as UTF-8 continuing the
 * previous token's unfinished character; the token is allowed when some
 * stack survives all of its complete code points and, when it ends inside a
 * character, some surviving top can still match a character that starts with
 * those bits. End-of-generation tokens are allowed exactly when the set holds
 * the empty stack. */
#include "grammar_impl.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "tokenizer.h"

/* ---- the vocabulary ---------------------------------------------------- */

struct grammar_vocab {
    uint32_t n_vocab;
    char *bytes;       /* every piece, one after another */
    uint32_t *off;     /* token -> offset of its piece */
    uint32_t *len;     /* token -> piece length (cut at NUL) */
    uint32_t *eog;     /* bitset of end-of-generation tokens */
    uint32_t *sorted;  /* tokens that can match text, by piece */
    uint32_t *lcp;     /* common prefix of sorted[i] with sorted[i-1] */
    uint32_t n_sorted; /* (empty pieces and end tokens are not in it) */
    uint32_t max_len;
};

/* qsort takes no context in C11: the vocabulary being sorted, per thread. */
static _Thread_local const struct grammar_vocab *cmp_vocab;

static int cmp_piece(const void *a, const void *b)
{
    const struct grammar_vocab *v = cmp_vocab;
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    uint32_t lx = v->len[x], ly = v->len[y];
    int c = memcmp(v->bytes + v->off[x], v->bytes + v->off[y], lx < ly ? lx : ly);
    if (c)
        return c;
    if (lx != ly)
        return lx < ly ? -1 : 1;
    return x < y ? -1 : (x > y);
}

static int vocab_finish(struct grammar_vocab *v)
{
    v->sorted = malloc((v->n_vocab ? v->n_vocab : 1) * sizeof *v->sorted);
    v->lcp = malloc((v->n_vocab ? v->n_vocab : 1) * sizeof *v->lcp);
    if (!v->sorted || !v->lcp)
        return KVD_ENOMEM;
    v->n_sorted = 0;
    for (uint32_t t = 0; t < v->n_vocab; t++) {
        bool is_eog = v->eog[t / 32] >> (t % 32) & 1;
        if (!is_eog && v->len[t] > 0)
            v->sorted[v->n_sorted++] = t;
        if (v->len[t] > v->max_len)
            v->max_len = v->len[t];
    }
    cmp_vocab = v;
    qsort(v->sorted, v->n_sorted, sizeof *v->sorted, cmp_piece);
    cmp_vocab = NULL;
    for (uint32_t i = 0; i < v->n_sorted; i++) {
        uint32_t l = 0;
        if (i > 0) {
            const char *a = v->bytes + v->off[v->sorted[i - 1]];
            const char *b = v->bytes + v->off[v->sorted[i]];
            uint32_t la = v->len[v->sorted[i - 1]], lb = v->len[v->sorted[i]];
            while (l < la && l < lb && a[l] == b[l])
                l++;
        }
        v->lcp[i] = l;
    }
    return 0;
}

void grammar_vocab_free(struct grammar_vocab *v)
{
    if (!v)
        return;
    free(v->bytes);
    free(v->off);
    free(v->len);
    free(v->eog);
    free(v->sorted);
    free(v->lcp);
    free(v);
}

static struct grammar_vocab *vocab_alloc(uint32_t n_vocab, size_t total)
{
    struct grammar_vocab *v = calloc(1, sizeof *v);
    if (!v)
        return NULL;
    v->n_vocab = n_vocab;
    v->bytes = malloc(total ? total : 1);
    v->off = calloc(n_vocab ? n_vocab : 1, sizeof *v->off);
    v->len = calloc(n_vocab ? n_vocab : 1, sizeof *v->len);
    v->eog = calloc((n_vocab + 31) / 32 + 1, sizeof *v->eog);
    if (!v->bytes || !v->off || !v->len || !v->eog) {
        grammar_vocab_free(v);
        return NULL;
    }
    return v;
}

/* A vocabulary source: token id's piece (in buf, of cap bytes, or the
 * source's own bytes), its length in *len, and whether it ends generation. */
typedef const char *(*piece_fn)(const void *src, uint32_t id, char *buf, size_t cap, size_t *len,
                                bool *eog);

/* The vocabulary of n tokens from a source, in one pass over the pieces
 * (each cut at a NUL byte, as llama.cpp's C-string decoding does). */
static int vocab_from(uint32_t n, piece_fn piece, const void *src, struct grammar_vocab **out)
{
    size_t cap = (size_t)n * 8 + 64;
    struct grammar_vocab *v = vocab_alloc(n, cap);
    if (!v)
        return KVD_ENOMEM;
    char buf[TOK_MAX_PIECE];
    size_t pos = 0;
    int rc = 0;
    for (uint32_t id = 0; id < n && !rc; id++) {
        size_t l = 0;
        bool eog = false;
        const char *p = piece(src, id, buf, sizeof buf, &l, &eog);
        const char *nul = memchr(p, '\0', l);
        if (nul)
            l = (size_t)(nul - p);
        if (pos + l > UINT32_MAX) {
            rc = KVD_ETOOLARGE;
            break;
        }
        if (pos + l > cap) {
            while (pos + l > cap)
                cap *= 2;
            char *nb = realloc(v->bytes, cap);
            if (!nb) {
                rc = KVD_ENOMEM;
                break;
            }
            v->bytes = nb;
        }
        memcpy(v->bytes + pos, p, l);
        v->off[id] = (uint32_t)pos;
        v->len[id] = (uint32_t)l;
        pos += l;
        if (eog)
            v->eog[id / 32] |= 1u << (id % 32);
    }
    if (!rc)
        rc = vocab_finish(v);
    if (rc) {
        grammar_vocab_free(v);
        return rc;
    }
    *out = v;
    return 0;
}

struct piece_arrays {
    const char *const *pieces;
    const size_t *lens;
    const bool *eog;
};

static const char *array_piece(const void *src, uint32_t id, char *buf, size_t cap, size_t *len,
                               bool *eog)
{
    const struct piece_arrays *a = src;
    (void)buf;
    (void)cap;
    *len = a->lens[id];
    *eog = a->eog && a->eog[id];
    return a->pieces[id];
}

int grammar_vocab_new(uint32_t n_vocab, const char *const *pieces, const size_t *lens,
                      const bool *eog, struct grammar_vocab **out)
{
    struct piece_arrays a = {pieces, lens, eog};
    return vocab_from(n_vocab, array_piece, &a, out);
}

static const char *tokenizer_piece_special(const void *src, uint32_t id, char *buf, size_t cap,
                                           size_t *len, bool *eog)
{
    size_t l = tokenizer_piece(src, id, true, buf, cap);
    *len = l < cap ? l : cap;
    *eog = tokenizer_is_eog(src, id);
    return buf;
}

int grammar_vocab_build(const struct tokenizer *t, struct grammar_vocab **out)
{
    return vocab_from(tokenizer_n_vocab(t), tokenizer_piece_special, t, out);
}

uint32_t grammar_vocab_n(const struct grammar_vocab *v)
{
    return v->n_vocab;
}

static bool vocab_is_eog(const struct grammar_vocab *v, uint32_t t)
{
    return v->eog[t / 32] >> (t % 32) & 1;
}

/* ---- a u64 -> u32 map (open addressing, never shrinks) ----------------- */

struct u64map {
    uint64_t *keys;
    uint32_t *vals; /* UINT32_MAX: empty slot */
    uint32_t cap, n;
};

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static bool u64map_grow(struct u64map *m)
{
    uint32_t cap = m->cap ? m->cap * 2 : 1024;
    uint64_t *k = malloc((size_t)cap * sizeof *k);
    uint32_t *v = malloc((size_t)cap * sizeof *v);
    if (!k || !v) {
        free(k);
        free(v);
        return false;
    }
    memset(v, 0xff, (size_t)cap * sizeof *v);
    for (uint32_t i = 0; i < m->cap; i++) {
        if (m->vals[i] == UINT32_MAX)
            continue;
        uint32_t j = (uint32_t)(mix64(m->keys[i]) & (cap - 1));
        while (v[j] != UINT32_MAX)
            j = (j + 1) & (cap - 1);
        k[j] = m->keys[i];
        v[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = k;
    m->vals = v;
    m->cap = cap;
    return true;
}

static uint32_t u64map_get(const struct u64map *m, uint64_t key)
{
    if (!m->cap)
        return UINT32_MAX;
    uint32_t j = (uint32_t)(mix64(key) & (m->cap - 1));
    while (m->vals[j] != UINT32_MAX) {
        if (m->keys[j] == key)
            return m->vals[j];
        j = (j + 1) & (m->cap - 1);
    }
    return UINT32_MAX;
}

static bool u64map_put(struct u64map *m, uint64_t key, uint32_t val)
{
    if ((m->n + 1) * 2 > m->cap && !u64map_grow(m))
        return false;
    uint32_t j = (uint32_t)(mix64(key) & (m->cap - 1));
    while (m->vals[j] != UINT32_MAX) {
        if (m->keys[j] == key) {
            m->vals[j] = val;
            return true;
        }
        j = (j + 1) & (m->cap - 1);
    }
    m->keys[j] = key;
    m->vals[j] = val;
    m->n++;
    return true;
}

static void u64map_free(struct u64map *m)
{
    free(m->keys);
    free(m->vals);
}

/* ---- the matcher ------------------------------------------------------- */

/* How many token masks one matcher keeps (least recently used out), and
 * at most this many bytes of them. */
#define MASK_CACHE_MAX 128
#define MASK_CACHE_BYTES (4u << 20)

struct mask_entry {
    uint64_t key;
    uint64_t used;
    size_t n_allowed;
    uint32_t *bits;
};

/* Where decoding stands at a token boundary or inside a token: the set
 * reached by the complete code points, and an unfinished character. */
struct dstate {
    uint32_t set;
    uint32_t value;
    int8_t remain; /* continuation bytes still expected */
    uint8_t len;   /* the unfinished character's length in bytes (2 to 4) */
    bool carried;  /* the unfinished character started in an earlier token */
};

struct grammar_matcher {
    const struct grammar *g;
    const struct grammar_vocab *v;

    /* Stacks: node 0 is the empty stack; node i > 0 is element elem[i]
     * on top of stack parent[i]. */
    uint32_t *node_elem, *node_parent, *node_seen;
    uint32_t n_nodes, cap_nodes, seen_stamp;
    struct u64map node_map; /* elem << 32 | parent -> node */

    /* Sets of stacks: set 0 is the empty set (no way forward); set i is
     * pool[set_off[i] .. + set_len[i]], sorted. */
    uint32_t *set_off, *set_len;
    uint32_t n_sets, cap_sets;
    uint32_t *pool;
    size_t pool_n, pool_cap;
    struct u64map set_map;  /* content hash -> first set with that hash */
    uint32_t *set_next;     /* further sets with the same hash */
    struct u64map step_map; /* set << 32 | code point -> set */

    uint32_t *work, *scratch;
    size_t work_cap, scratch_n, scratch_cap;

    struct dstate cur;
    int failed; /* a limit was passed: every call fails with it */
    struct kvd_error fail_err;

    struct mask_entry cache[MASK_CACHE_MAX];
    uint32_t n_cache, max_cache;
    uint64_t tick;
    struct dstate *walk; /* the mask walk's state per depth */
    uint64_t masks_computed, masks_cached;
};

static int matcher_fail(struct grammar_matcher *m, int code, const char *msg)
{
    if (!m->failed) {
        m->failed = code;
        kvd_error_set(&m->fail_err, code, "grammar: %s", msg);
        snprintf(m->fail_err.param, sizeof m->fail_err.param, "grammar");
    }
    return m->failed;
}

static uint32_t node_intern(struct grammar_matcher *m, uint32_t elem, uint32_t parent)
{
    uint64_t key = (uint64_t)elem << 32 | parent;
    uint32_t id = u64map_get(&m->node_map, key);
    if (id != UINT32_MAX)
        return id;
    if (m->n_nodes >= GRAMMAR_MAX_NODES) {
        matcher_fail(m, KVD_ETOOLARGE, "the grammar's state grew past 1M stack nodes");
        return UINT32_MAX;
    }
    if (m->n_nodes == m->cap_nodes) {
        uint32_t cap = m->cap_nodes * 2;
        uint32_t *e = realloc(m->node_elem, cap * sizeof *e);
        if (e)
            m->node_elem = e;
        uint32_t *p = realloc(m->node_parent, cap * sizeof *p);
        if (p)
            m->node_parent = p;
        uint32_t *s = realloc(m->node_seen, cap * sizeof *s);
        if (s) {
            memset(s + m->cap_nodes, 0, (cap - m->cap_nodes) * sizeof *s);
            m->node_seen = s;
        }
        if (!e || !p || !s) {
            matcher_fail(m, KVD_ENOMEM, "out of memory");
            return UINT32_MAX;
        }
        m->cap_nodes = cap;
    }
    id = m->n_nodes++;
    m->node_elem[id] = elem;
    m->node_parent[id] = parent;
    if (!u64map_put(&m->node_map, key, id)) {
        matcher_fail(m, KVD_ENOMEM, "out of memory");
        return UINT32_MAX;
    }
    return id;
}

static bool scratch_push(struct grammar_matcher *m, uint32_t s)
{
    if (m->scratch_n >= GRAMMAR_MAX_STACKS) {
        matcher_fail(m, KVD_ETOOLARGE,
                     "the grammar is too ambiguous: a state passed 4096 stacks at once");
        return false;
    }
    if (m->scratch_n == m->scratch_cap) {
        size_t cap = m->scratch_cap ? m->scratch_cap * 2 : 64;
        uint32_t *p = realloc(m->scratch, cap * sizeof *p);
        if (!p) {
            matcher_fail(m, KVD_ENOMEM, "out of memory");
            return false;
        }
        m->scratch = p;
        m->scratch_cap = cap;
    }
    m->scratch[m->scratch_n++] = s;
    return true;
}

/* Expands stack s until every resulting stack has a terminal on top (or is
 * empty), appending them to m->scratch; stacks already expanded during
 * this call (same seen_stamp) are skipped. */
static bool advance(struct grammar_matcher *m, uint32_t s)
{
    const struct gr_elem *E = m->g->elems;
    size_t top = 0;
    m->work[top++] = s;
    while (top > 0) {
        uint32_t cur = m->work[--top];
        if (m->node_seen[cur] == m->seen_stamp)
            continue;
        m->node_seen[cur] = m->seen_stamp;
        if (cur == 0) {
            if (!scratch_push(m, 0))
                return false;
            continue;
        }
        uint32_t pos = m->node_elem[cur];
        if (E[pos].type != GR_RULE_REF) {
            if (!scratch_push(m, cur))
                return false;
            continue;
        }
        uint32_t alt = m->g->rule_start[E[pos].value];
        while (1) {
            uint32_t base = m->node_parent[cur];
            if (!gr_is_end_of_sequence(&E[pos + 1]))
                base = node_intern(m, pos + 1, base);
            if (base != UINT32_MAX && !gr_is_end_of_sequence(&E[alt]))
                base = node_intern(m, alt, base);
            if (base == UINT32_MAX)
                return false;
            if (top == m->work_cap) {
                size_t cap = m->work_cap * 2;
                uint32_t *w = realloc(m->work, cap * sizeof *w);
                if (!w) {
                    matcher_fail(m, KVD_ENOMEM, "out of memory");
                    return false;
                }
                m->work = w;
                m->work_cap = cap;
            }
            m->work[top++] = base;
            while (!gr_is_end_of_sequence(&E[alt]))
                alt++;
            if (E[alt].type == GR_END)
                break;
            alt++;
        }
    }
    return true;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : (x > y);
}

/* The set holding m->scratch's stacks (sorted, deduplicated, interned). */
static uint32_t set_intern(struct grammar_matcher *m)
{
    size_t n = m->scratch_n;
    if (n == 0)
        return 0;
    qsort(m->scratch, n, sizeof *m->scratch, cmp_u32);
    size_t k = 1;
    for (size_t i = 1; i < n; i++)
        if (m->scratch[i] != m->scratch[k - 1])
            m->scratch[k++] = m->scratch[i];
    n = k;
    uint64_t h = XXH3_64bits(m->scratch, n * sizeof *m->scratch);
    for (uint32_t id = u64map_get(&m->set_map, h); id != UINT32_MAX; id = m->set_next[id]) {
        if (m->set_len[id] == n &&
            memcmp(m->pool + m->set_off[id], m->scratch, n * sizeof *m->scratch) == 0)
            return id;
    }
    if (m->pool_n + n > m->pool_cap) {
        size_t cap = m->pool_cap * 2;
        while (cap < m->pool_n + n)
            cap *= 2;
        if (cap > (size_t)GRAMMAR_MAX_NODES * 4) {
            matcher_fail(m, KVD_ETOOLARGE, "the grammar's state grew past 4M set entries");
            return UINT32_MAX;
        }
        uint32_t *p = realloc(m->pool, cap * sizeof *p);
        if (!p) {
            matcher_fail(m, KVD_ENOMEM, "out of memory");
            return UINT32_MAX;
        }
        m->pool = p;
        m->pool_cap = cap;
    }
    if (m->n_sets == m->cap_sets) {
        uint32_t cap = m->cap_sets * 2;
        uint32_t *o = realloc(m->set_off, cap * sizeof *o);
        if (o)
            m->set_off = o;
        uint32_t *l = realloc(m->set_len, cap * sizeof *l);
        if (l)
            m->set_len = l;
        uint32_t *x = realloc(m->set_next, cap * sizeof *x);
        if (x)
            m->set_next = x;
        if (!o || !l || !x) {
            matcher_fail(m, KVD_ENOMEM, "out of memory");
            return UINT32_MAX;
        }
        m->cap_sets = cap;
    }
    uint32_t id = m->n_sets++;
    m->set_off[id] = (uint32_t)m->pool_n;
    m->set_len[id] = (uint32_t)n;
    memcpy(m->pool + m->pool_n, m->scratch, n * sizeof *m->scratch);
    m->pool_n += n;
    m->set_next[id] = u64map_get(&m->set_map, h);
    if (!u64map_put(&m->set_map, h, id)) {
        matcher_fail(m, KVD_ENOMEM, "out of memory");
        return UINT32_MAX;
    }
    return id;
}

/* Whether code point c satisfies the character class at pos; *next is the
 * element after the class. */
static bool match_char(const struct gr_elem *E, uint32_t pos, uint32_t c, uint32_t *next)
{
    bool positive = E[pos].type == GR_CHAR || E[pos].type == GR_CHAR_ANY;
    bool found = false;
    do {
        if (E[pos + 1].type == GR_CHAR_RNG_UPPER) {
            found = found || (E[pos].value <= c && c <= E[pos + 1].value);
            pos += 2;
        } else if (E[pos].type == GR_CHAR_ANY) {
            found = true;
            pos += 1;
        } else {
            found = found || E[pos].value == c;
            pos += 1;
        }
    } while (E[pos].type == GR_CHAR_ALT);
    *next = pos;
    return found == positive;
}

/* Whether a code point in [lo, hi] satisfies the class at pos. */
static bool class_meets(const struct gr_elem *E, uint32_t pos, uint32_t low, uint32_t high)
{
    bool positive = E[pos].type == GR_CHAR || E[pos].type == GR_CHAR_ANY;
    do {
        if (E[pos + 1].type == GR_CHAR_RNG_UPPER) {
            if (E[pos].value <= high && low <= E[pos + 1].value)
                return positive;
            pos += 2;
        } else if (E[pos].type == GR_CHAR_ANY) {
            return true;
        } else {
            if (low <= E[pos].value && E[pos].value <= high)
                return positive;
            pos += 1;
        }
    } while (E[pos].type == GR_CHAR_ALT);
    return !positive;
}

/* The smallest code point a character of len bytes may encode (shorter
 * forms are overlong). */
static uint32_t utf8_min(int len)
{
    return len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
}

/* Whether a whole character of len bytes is valid UTF-8's. */
static bool utf8_valid(uint32_t c, int len)
{
    return len <= 1 || (c >= utf8_min(len) && c <= 0x10FFFF && (c < 0xD800 || c > 0xDFFF));
}

/* Whether some valid character of len bytes starting with these bits
 * (value, remain bytes to come) could satisfy the class at pos: never an
 * overlong encoding, a surrogate or a code point past U+10FFFF. */
static bool match_partial(const struct gr_elem *E, uint32_t pos, uint32_t value, int remain,
                          int len)
{
    if (remain < 0 || len < 2)
        return false;
    uint32_t low = value << (remain * 6);
    uint32_t high = low | ((1u << (remain * 6)) - 1);
    if (low < utf8_min(len))
        low = utf8_min(len);
    if (high > 0x10FFFF)
        high = 0x10FFFF;
    if (low > high)
        return false;
    if (low < 0xD800 && high >= 0xD800)
        return class_meets(E, pos, low, 0xD7FF) ||
               (high > 0xDFFF && class_meets(E, pos, 0xE000, high));
    if (low >= 0xD800 && low <= 0xDFFF) {
        if (high <= 0xDFFF)
            return false;
        low = 0xE000;
    }
    return class_meets(E, pos, low, high);
}

/* The set after code point c: cached per (set, c). UINT32_MAX on failure. */
static uint32_t step(struct grammar_matcher *m, uint32_t set, uint32_t c)
{
    if (set == 0)
        return 0;
    uint64_t key = (uint64_t)set << 32 | c;
    uint32_t got = u64map_get(&m->step_map, key);
    if (got != UINT32_MAX)
        return got;
    const struct gr_elem *E = m->g->elems;
    m->scratch_n = 0;
    m->seen_stamp++;
    /* m->pool only grows in set_intern, after this loop. */
    const uint32_t *stacks = m->pool + m->set_off[set];
    uint32_t n = m->set_len[set];
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = stacks[i];
        if (s == 0)
            continue;
        uint32_t next;
        if (!match_char(E, m->node_elem[s], c, &next))
            continue;
        uint32_t base = m->node_parent[s];
        if (!gr_is_end_of_sequence(&E[next]))
            base = node_intern(m, next, base);
        if (base == UINT32_MAX || !advance(m, base))
            return UINT32_MAX;
    }
    uint32_t out = set_intern(m);
    if (out == UINT32_MAX)
        return UINT32_MAX;
    if (!u64map_put(&m->step_map, key, out)) {
        matcher_fail(m, KVD_ENOMEM, "out of memory");
        return UINT32_MAX;
    }
    return out;
}

static bool set_has_empty(const struct grammar_matcher *m, uint32_t set)
{
    return set != 0 && m->set_len[set] > 0 && m->pool[m->set_off[set]] == 0;
}

static bool partial_ok(const struct grammar_matcher *m, uint32_t set, uint32_t value, int remain,
                       int len)
{
    const uint32_t *stacks = m->pool + m->set_off[set];
    for (uint32_t i = 0; i < m->set_len[set]; i++)
        if (stacks[i] != 0 &&
            match_partial(m->g->elems, m->node_elem[stacks[i]], value, remain, len))
            return true;
    return false;
}

/* One byte of a piece. Returns false when no stack survives (or a limit
 * was passed: m->failed says which). A decoded code point 0 is refused
 * (llama.cpp's decoder takes it for the end of the piece), and so is every
 * byte sequence that is not valid UTF-8 (an overlong encoding, a
 * surrogate, past U+10FFFF), which llama.cpp's decoder lets through: text
 * that is not UTF-8 is no sentence of a grammar of characters. */
static bool byte_step(struct grammar_matcher *m, struct dstate *d, unsigned char b)
{
    static const int8_t more[16] = {0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, 1, 1, 2, 3};
    if (d->remain > 0) {
        if ((b >> 6) != 2)
            return false; /* the character does not continue (invalid UTF-8) */
        d->value = (d->value << 6) + (b & 0x3f);
        if (--d->remain > 0)
            return true;
        d->carried = false;
    } else {
        int n = more[b >> 4];
        if (n < 0)
            return false; /* a continuation byte where a character starts */
        d->value = b & ((1u << (7 - n)) - 1);
        d->len = (uint8_t)(n + 1);
        if (n > 0) {
            d->remain = (int8_t)n;
            d->carried = false;
            return true;
        }
    }
    if (d->value == 0 || !utf8_valid(d->value, d->len))
        return false;
    uint32_t next = step(m, d->set, d->value);
    if (next == UINT32_MAX || next == 0)
        return false;
    d->set = next;
    d->value = 0;
    return true;
}

/* Whether a piece ending in state d is allowed. */
static bool end_ok(const struct grammar_matcher *m, const struct dstate *d)
{
    if (d->set == 0)
        return false;
    if (d->remain == 0)
        return true;
    return partial_ok(m, d->set, d->value, d->remain, d->len);
}

int grammar_matcher_new(const struct grammar *g, const struct grammar_vocab *v,
                        struct grammar_matcher **out, struct kvd_error *err)
{
    *out = NULL;
    struct grammar_matcher *m = calloc(1, sizeof *m);
    if (!m)
        return kvd_error_set(err, KVD_ENOMEM, "grammar: out of memory");
    m->g = g;
    m->v = v;
    m->cap_nodes = 256;
    m->node_elem = malloc(m->cap_nodes * sizeof *m->node_elem);
    m->node_parent = malloc(m->cap_nodes * sizeof *m->node_parent);
    m->node_seen = calloc(m->cap_nodes, sizeof *m->node_seen);
    m->cap_sets = 64;
    m->set_off = malloc(m->cap_sets * sizeof *m->set_off);
    m->set_len = malloc(m->cap_sets * sizeof *m->set_len);
    m->set_next = malloc(m->cap_sets * sizeof *m->set_next);
    m->pool_cap = 256;
    m->pool = malloc(m->pool_cap * sizeof *m->pool);
    m->work_cap = 64;
    m->work = malloc(m->work_cap * sizeof *m->work);
    m->walk = calloc((size_t)v->max_len + 1, sizeof *m->walk);
    size_t mask_bytes = ((size_t)v->n_vocab + 31) / 32 * 4;
    m->max_cache = (uint32_t)(MASK_CACHE_BYTES / (mask_bytes ? mask_bytes : 1));
    if (m->max_cache > MASK_CACHE_MAX)
        m->max_cache = MASK_CACHE_MAX;
    if (m->max_cache < 2)
        m->max_cache = 2;
    if (!m->node_elem || !m->node_parent || !m->node_seen || !m->set_off || !m->set_len ||
        !m->set_next || !m->pool || !m->work || !m->walk) {
        grammar_matcher_free(m);
        return kvd_error_set(err, KVD_ENOMEM, "grammar: out of memory");
    }
    m->node_elem[0] = UINT32_MAX;
    m->node_parent[0] = 0;
    m->n_nodes = 1;
    m->set_off[0] = 0;
    m->set_len[0] = 0;
    m->set_next[0] = UINT32_MAX;
    m->n_sets = 1;

    /* The start: every alternative of root, expanded. */
    const struct gr_elem *E = g->elems;
    m->scratch_n = 0;
    m->seen_stamp++;
    uint32_t alt = g->rule_start[g->root];
    while (1) {
        uint32_t s = gr_is_end_of_sequence(&E[alt]) ? 0 : node_intern(m, alt, 0);
        if (s == UINT32_MAX || !advance(m, s))
            break;
        while (!gr_is_end_of_sequence(&E[alt]))
            alt++;
        if (E[alt].type == GR_END)
            break;
        alt++;
    }
    uint32_t set = m->failed ? UINT32_MAX : set_intern(m);
    if (set == UINT32_MAX) {
        if (err)
            *err = m->fail_err;
        int rc = m->failed;
        grammar_matcher_free(m);
        return rc;
    }
    m->cur = (struct dstate){.set = set};
    *out = m;
    return 0;
}

void grammar_matcher_free(struct grammar_matcher *m)
{
    if (!m)
        return;
    free(m->node_elem);
    free(m->node_parent);
    free(m->node_seen);
    u64map_free(&m->node_map);
    free(m->set_off);
    free(m->set_len);
    free(m->set_next);
    free(m->pool);
    u64map_free(&m->set_map);
    u64map_free(&m->step_map);
    free(m->work);
    free(m->scratch);
    for (uint32_t i = 0; i < m->n_cache; i++)
        free(m->cache[i].bits);
    free(m->walk);
    free(m);
}

const struct grammar_vocab *grammar_matcher_vocab(const struct grammar_matcher *m)
{
    return m->v;
}

static uint64_t mask_key(const struct dstate *d)
{
    /* value < 2^21: the character's length goes above it */
    return (uint64_t)d->set << 32 | (uint64_t)(uint8_t)d->remain << 24 |
           (uint64_t)(d->len & 7) << 21 | (d->value & 0x1fffff);
}

/* Computes the mask of state d into bits (n_vocab bits). */
static bool compute_mask(struct grammar_matcher *m, const struct dstate *d, uint32_t *bits,
                         size_t *n_allowed)
{
    const struct grammar_vocab *v = m->v;
    size_t words = ((size_t)v->n_vocab + 31) / 32;
    memset(bits, 0, words * sizeof *bits);
    size_t allowed = 0;
    struct dstate *walk = m->walk;
    walk[0] = *d;
    walk[0].carried = d->remain > 0;
    uint32_t dead_at = UINT32_MAX; /* walk[dead_at] is dead for the last path */
    uint32_t valid = 0;            /* walk[0..valid] is the last path's */
    for (uint32_t i = 0; i < v->n_sorted; i++) {
        uint32_t t = v->sorted[i];
        uint32_t lcp = v->lcp[i];
        if (dead_at <= lcp)
            continue; /* shares a prefix that no stack survives */
        const unsigned char *p = (const unsigned char *)v->bytes + v->off[t];
        uint32_t len = v->len[t];
        uint32_t k = lcp < valid ? lcp : valid;
        dead_at = UINT32_MAX;
        bool alive = true;
        for (; k < len; k++) {
            walk[k + 1] = walk[k];
            if (!byte_step(m, &walk[k + 1], p[k])) {
                if (m->failed)
                    return false;
                dead_at = k + 1;
                alive = false;
                break;
            }
        }
        valid = alive ? len : dead_at - 1;
        if (alive && end_ok(m, &walk[len])) {
            bits[t / 32] |= 1u << (t % 32);
            allowed++;
        }
    }
    if (set_has_empty(m, d->set)) {
        for (uint32_t t = 0; t < v->n_vocab; t++) {
            if (vocab_is_eog(v, t)) {
                bits[t / 32] |= 1u << (t % 32);
                allowed++;
            }
        }
    }
    *n_allowed = allowed;
    return true;
}

const uint32_t *grammar_matcher_mask(struct grammar_matcher *m, size_t *n_allowed,
                                     struct kvd_error *err)
{
    if (m->failed) {
        if (err)
            *err = m->fail_err;
        return NULL;
    }
    uint64_t key = mask_key(&m->cur);
    m->tick++;
    for (uint32_t i = 0; i < m->n_cache; i++) {
        if (m->cache[i].key == key) {
            m->cache[i].used = m->tick;
            m->masks_cached++;
            *n_allowed = m->cache[i].n_allowed;
            return m->cache[i].bits;
        }
    }
    struct mask_entry *slot;
    if (m->n_cache < m->max_cache) {
        slot = &m->cache[m->n_cache];
        slot->bits = malloc((((size_t)m->v->n_vocab + 31) / 32 + 1) * sizeof *slot->bits);
        if (!slot->bits) {
            matcher_fail(m, KVD_ENOMEM, "out of memory");
            if (err)
                *err = m->fail_err;
            return NULL;
        }
        m->n_cache++;
    } else {
        slot = &m->cache[0];
        for (uint32_t i = 1; i < m->n_cache; i++)
            if (m->cache[i].used < slot->used)
                slot = &m->cache[i];
    }
    slot->key = UINT64_MAX; /* not valid until computed */
    if (!compute_mask(m, &m->cur, slot->bits, &slot->n_allowed)) {
        if (err)
            *err = m->fail_err;
        return NULL;
    }
    slot->key = key;
    slot->used = m->tick;
    m->masks_computed++;
    *n_allowed = slot->n_allowed;
    return slot->bits;
}

/* Runs bytes from state d; false when they are rejected. */
static bool run_bytes(struct grammar_matcher *m, struct dstate *d, const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!byte_step(m, d, p[i]))
            return false;
    return end_ok(m, d);
}

static int reject(struct grammar_matcher *m, struct kvd_error *err, const char *what)
{
    if (m->failed) {
        if (err)
            *err = m->fail_err;
        return m->failed;
    }
    kvd_error_set(err, KVD_EBADREQ, "grammar: %s", what);
    if (err)
        snprintf(err->param, sizeof err->param, "grammar");
    return KVD_EBADREQ;
}

int grammar_matcher_accept(struct grammar_matcher *m, uint32_t token, struct kvd_error *err)
{
    if (m->failed)
        return reject(m, err, "");
    if (token >= m->v->n_vocab)
        return reject(m, err, "token out of range");
    if (vocab_is_eog(m->v, token)) {
        if (set_has_empty(m, m->cur.set))
            return 0;
        return reject(m, err, "the end comes before the grammar is complete");
    }
    if (m->v->len[token] == 0)
        return reject(m, err, "the token has no text");
    struct dstate d = m->cur;
    d.carried = d.remain > 0;
    if (!run_bytes(m, &d, (const unsigned char *)m->v->bytes + m->v->off[token], m->v->len[token]))
        return reject(m, err, "the token does not fit the grammar here");
    m->cur = d;
    return 0;
}

int grammar_matcher_accept_text(struct grammar_matcher *m, const char *s, size_t n,
                                struct kvd_error *err)
{
    if (m->failed)
        return reject(m, err, "");
    struct dstate d = m->cur;
    d.carried = d.remain > 0;
    if (!run_bytes(m, &d, (const unsigned char *)s, n))
        return reject(m, err, "the text does not fit the grammar");
    m->cur = d;
    return 0;
}

bool grammar_matcher_can_end(const struct grammar_matcher *m)
{
    return !m->failed && set_has_empty(m, m->cur.set);
}

bool grammar_matcher_must_end(const struct grammar_matcher *m)
{
    return !m->failed && m->cur.set != 0 && m->set_len[m->cur.set] == 1 &&
           m->pool[m->set_off[m->cur.set]] == 0;
}

/* llama.cpp's decoder: the piece (C string) as code points, continuing the
 * previous token's character; an invalid sequence ends it with *bad. */
static size_t decode_piece(const unsigned char *p, size_t n, uint32_t *value, int *remain,
                           int *clen, uint32_t *cps, bool *bad)
{
    static const int len_of[16] = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4};
    size_t i = 0, k = 0;
    uint32_t v = *value;
    int r = *remain, L = *clen;
    bool continuing = r > 0;
    *bad = false;
    while (i < n && r > 0) {
        if ((p[i] >> 6) != 2) {
            *bad = true;
            return k;
        }
        v = (v << 6) + (p[i] & 0x3f);
        i++;
        r--;
    }
    if (continuing && r == 0) {
        if (!utf8_valid(v, L)) {
            *bad = true;
            return k;
        }
        cps[k++] = v;
    }
    while (i < n) {
        L = len_of[p[i] >> 4];
        r = L - 1;
        if (r < 0) {
            *bad = true;
            return 0;
        }
        v = p[i] & ((1u << (7 - r)) - 1);
        i++;
        while (i < n && r > 0) {
            if ((p[i] >> 6) != 2) {
                *bad = true;
                return k;
            }
            v = (v << 6) + (p[i] & 0x3f);
            i++;
            r--;
        }
        if (r == 0) {
            if (!utf8_valid(v, L)) {
                *bad = true;
                return k;
            }
            cps[k++] = v;
        }
    }
    *value = v;
    *remain = r;
    *clen = L;
    return k;
}

bool grammar_matcher_allows_slow(struct grammar_matcher *m, uint32_t token)
{
    if (m->failed || token >= m->v->n_vocab)
        return false;
    if (vocab_is_eog(m->v, token))
        return set_has_empty(m, m->cur.set);
    uint32_t len = m->v->len[token];
    if (len == 0)
        return false;
    uint32_t *cps = malloc(((size_t)len + 1) * sizeof *cps);
    if (!cps)
        return false;
    uint32_t value = m->cur.value;
    int remain = m->cur.remain, clen = m->cur.len;
    bool bad;
    size_t n = decode_piece((const unsigned char *)m->v->bytes + m->v->off[token], len, &value,
                            &remain, &clen, cps, &bad);
    bool ok = !bad;
    uint32_t set = m->cur.set;
    for (size_t i = 0; ok && i < n; i++) {
        if (cps[i] == 0) {
            ok = false;
            break;
        }
        set = step(m, set, cps[i]);
        ok = set != UINT32_MAX && set != 0;
    }
    free(cps);
    if (!ok)
        return false;
    return remain == 0 || partial_ok(m, set, value, remain, clen);
}

void grammar_matcher_get_stats(const struct grammar_matcher *m, struct grammar_matcher_stats *s)
{
    s->masks_computed = m->masks_computed;
    s->masks_cached = m->masks_cached;
    s->nodes = m->n_nodes;
    s->sets = m->n_sets;
}
