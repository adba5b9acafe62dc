/* Token ids to text, as llama.cpp's llama_token_to_piece and
 * llama_detokenize: the per-token piece, the SentencePiece leading-space
 * rule, and the clean_up_tokenization_spaces passes; then ill-formed UTF-8
 * becomes U+FFFD (WHATWG). The streaming form runs the same stages byte by
 * byte with a few bytes held back, so its total equals the whole-sequence
 * form. */
#include "tokenizer_impl.h"

#include "unicode.h"
#include "kvd/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- pieces ------------------------------------------------------------ */

struct sbuf {
    char *p;
    size_t n, cap;
    bool oom;
};

static void sb_put(struct sbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

/* llama.cpp's token_to_byte: strtol(text.substr(3, 2), 16). */
static char byte_of(const char *text, uint32_t len)
{
    char s[3] = {0};
    for (uint32_t i = 0; i < 2 && 3 + i < len; i++)
        s[i] = text[3 + i];
    return (char)strtol(s, NULL, 16);
}

/* The byte a byte-level character stands for, or -1. */
static int byte_of_cp(uint32_t cp)
{
    if ((cp >= 0x21 && cp <= 0x7e) || (cp >= 0xa1 && cp <= 0xac) || (cp >= 0xae && cp <= 0xff))
        return (int)cp;
    if (cp < 256 || cp >= 256 + 68)
        return -1;
    uint32_t k = cp - 256;
    if (k <= 0x20)
        return (int)k;
    if (k < 33 + 34)
        return (int)(0x7f + (k - 33));
    return 0xad;
}

/* llama.cpp's llama_decode_text: byte-level characters back to bytes; a
 * character outside the map becomes "[UNK_BYTE_0x<its utf8>" + text + "]". */
static void decode_text(const char *text, size_t len, struct sbuf *b)
{
    for (size_t off = 0; off < len;) {
        uint32_t cp = uni_decode_llama((const uint8_t *)text, len, &off);
        int byte = byte_of_cp(cp);
        if (byte >= 0) {
            char c = (char)byte;
            sb_put(b, &c, 1);
            continue;
        }
        char u[4], hex[16];
        size_t ul = uni_encode(cp, u);
        sb_put(b, "[UNK_BYTE_0x", 12);
        for (size_t i = 0; i < ul; i++) {
            snprintf(hex, sizeof(hex), "%02x", (uint8_t)u[i]);
            sb_put(b, hex, 2);
        }
        sb_put(b, text, len);
        sb_put(b, "]", 1);
    }
}

int tok_build_pieces(struct tokenizer *t)
{
    struct sbuf b = {0};
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        struct tok_entry *e = &t->tok[id];
        const char *text = TOK_TEXT(t, id);
        b.n = 0;
        if (e->attr & (TOK_ATTR_UNKNOWN | TOK_ATTR_CONTROL | TOK_ATTR_USER_DEFINED)) {
            sb_put(&b, text, e->len);
        } else if (e->attr & TOK_ATTR_NORMAL) {
            if (t->kind == TOK_SPM) {
                for (uint32_t i = 0; i < e->len; i++) {
                    if (i + 2 < e->len && !memcmp(text + i, "\xe2\x96\x81", 3)) {
                        sb_put(&b, " ", 1);
                        i += 2;
                    } else {
                        sb_put(&b, text + i, 1);
                    }
                }
            } else {
                decode_text(text, e->len, &b);
            }
        } else if (e->attr & TOK_ATTR_BYTE) {
            char c = byte_of(text, e->len);
            sb_put(&b, &c, 1);
        }
        if (b.oom) {
            free(b.p);
            return KVD_ENOMEM;
        }
        if (b.n > TOK_MAX_PIECE) {
            free(b.p);
            return KVD_EUNSUPPORTED;
        }
        e->plen = (uint32_t)b.n;
        /* the pool may move: copy from b */
        e->poff = tok_pool_add(t, b.n ? b.p : "", b.n);
        if (e->poff == UINT32_MAX) {
            free(b.p);
            return KVD_ENOMEM;
        }
    }
    free(b.p);
    return 0;
}

/* The piece to output for id, or NULL (nothing). */
static const char *piece_of(const struct tokenizer *t, uint32_t id, bool special, size_t *len)
{
    if (id >= t->n_vocab)
        return NULL;
    const struct tok_entry *e = &t->tok[id];
    if (!special && (e->attr & (TOK_ATTR_UNKNOWN | TOK_ATTR_CONTROL)))
        return NULL;
    *len = e->plen;
    return TOK_PIECE(t, id);
}

size_t tokenizer_piece(const struct tokenizer *t, uint32_t id, bool special, char *buf, size_t cap)
{
    size_t len;
    const char *p = piece_of(t, id, special, &len);
    if (!p)
        return 0;
    memcpy(buf, p, len < cap ? len : cap);
    return len;
}

/* ---- clean_up_tokenization_spaces, as three streaming passes -------------- */

/* llama.cpp's detokenize passes over the whole text: (1) drop a space
 * before ? ! . , (2) " ' " becomes "'" (the second space cannot start
 * another match), (3) drop a space before 's 'm 're 've. Each is a small
 * state machine holding at most three bytes. */
struct cleaner {
    uint8_t s1, s2, s3;
    char x1;
};

static void pass3(struct cleaner *c, char ch, struct sbuf *o)
{
    for (;;) {
        switch (c->s3) {
        case 0:
            if (ch == ' ')
                c->s3 = 1;
            else
                sb_put(o, &ch, 1);
            return;
        case 1: /* " " */
            if (ch == '\'') {
                c->s3 = 2;
            } else if (ch == ' ') {
                sb_put(o, " ", 1);
            } else {
                sb_put(o, " ", 1);
                sb_put(o, &ch, 1);
                c->s3 = 0;
            }
            return;
        case 2: /* " '" */
            if (ch == 's' || ch == 'm') {
                sb_put(o, "'", 1);
                sb_put(o, &ch, 1);
                c->s3 = 0;
                return;
            }
            if (ch == 'r' || ch == 'v') {
                c->x1 = ch;
                c->s3 = 3;
                return;
            }
            sb_put(o, " '", 2);
            c->s3 = 0;
            continue; /* ch again, from the start */
        default:      /* " 'r" or " 'v" */
            if (ch == 'e') {
                sb_put(o, "'", 1);
                sb_put(o, &c->x1, 1);
                sb_put(o, "e", 1);
                c->s3 = 0;
                return;
            }
            sb_put(o, " '", 2);
            sb_put(o, &c->x1, 1);
            c->s3 = 0;
            continue;
        }
    }
}

static void pass2(struct cleaner *c, char ch, struct sbuf *o)
{
    switch (c->s2) {
    case 0:
        if (ch == ' ')
            c->s2 = 1;
        else
            pass3(c, ch, o);
        return;
    case 1: /* " " */
        if (ch == '\'') {
            c->s2 = 2;
        } else if (ch == ' ') {
            pass3(c, ' ', o);
        } else {
            pass3(c, ' ', o);
            pass3(c, ch, o);
            c->s2 = 0;
        }
        return;
    default: /* " '" */
        c->s2 = 0;
        if (ch == ' ') {
            pass3(c, '\'', o); /* both spaces go */
            return;
        }
        pass3(c, ' ', o);
        pass3(c, '\'', o);
        pass3(c, ch, o); /* ch != ' ': state 0 passes it on */
        return;
    }
}

static void pass1(struct cleaner *c, char ch, struct sbuf *o)
{
    if (c->s1) {
        c->s1 = 0;
        if (!(ch == '?' || ch == '!' || ch == '.' || ch == ','))
            pass2(c, ' ', o);
    }
    if (ch == ' ')
        c->s1 = 1;
    else
        pass2(c, ch, o);
}

static void clean_finish(struct cleaner *c, struct sbuf *o)
{
    if (c->s1) {
        c->s1 = 0;
        pass2(c, ' ', o);
    }
    if (c->s2 == 1)
        pass3(c, ' ', o);
    else if (c->s2 == 2) {
        pass3(c, ' ', o);
        pass3(c, '\'', o);
    }
    c->s2 = 0;
    if (c->s3 == 1)
        sb_put(o, " ", 1);
    else if (c->s3 == 2)
        sb_put(o, " '", 2);
    else if (c->s3 == 3) {
        sb_put(o, " '", 2);
        sb_put(o, &c->x1, 1);
    }
    c->s3 = 0;
}

/* ---- the stages together --------------------------------------------------- */

struct tok_stream {
    const struct tokenizer *t;
    bool special;
    bool first; /* the SentencePiece leading space is still to strip */
    struct cleaner cl;
    struct uni_utf8_state u8;
    struct sbuf mid; /* pieces after cleaning, before UTF-8 checking */
};

static void stream_reset(struct tok_stream *s)
{
    s->first = true;
    memset(&s->cl, 0, sizeof(s->cl));
    memset(&s->u8, 0, sizeof(s->u8));
}

/* One id into s->mid (raw, cleaned bytes). */
static void stage_piece(struct tok_stream *s, uint32_t id)
{
    const struct tokenizer *t = s->t;
    size_t len = 0;
    const char *p = piece_of(t, id, s->special, &len);
    bool strip = s->first && t->add_space_prefix;
    if (id < t->n_vocab)
        s->first = false;
    if (!p)
        return;
    if (strip && len > 0 && p[0] == ' ') {
        p++;
        len--;
    }
    if (!t->clean_spaces) {
        sb_put(&s->mid, p, len);
        return;
    }
    for (size_t i = 0; i < len; i++)
        pass1(&s->cl, p[i], &s->mid);
}

/* s->mid's bytes through the UTF-8 checker into out (cap bytes, NUL
 * included); returns bytes written. */
static size_t stage_utf8(struct tok_stream *s, char *out, size_t cap, bool finish)
{
    char tmp[3 * 64 + 8];
    size_t w = 0;
    const uint8_t *in = (const uint8_t *)s->mid.p;
    size_t n = s->mid.n;
    for (size_t i = 0; i <= n; i += 64) {
        size_t k = n - i < 64 ? n - i : 64;
        size_t m = k ? uni_utf8_feed(&s->u8, in + i, k, tmp) : 0;
        if (finish && i + k >= n)
            m += uni_utf8_finish(&s->u8, tmp + m);
        if (cap > 0) {
            size_t c = m < cap - 1 - w ? m : cap - 1 - w;
            memcpy(out + w, tmp, c);
            w += c;
        }
        if (i + k >= n)
            break;
    }
    if (cap > 0)
        out[w] = 0;
    s->mid.n = 0;
    return w;
}

struct tok_stream *tok_stream_new(const struct tokenizer *t, bool special)
{
    struct tok_stream *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->t = t;
    s->special = special;
    stream_reset(s);
    return s;
}

size_t tok_stream_push(struct tok_stream *s, uint32_t id, char *out, size_t cap)
{
    stage_piece(s, id);
    if (s->mid.oom) {
        s->mid.oom = false;
        s->mid.n = 0;
    }
    return stage_utf8(s, out, cap, false);
}

size_t tok_stream_flush(struct tok_stream *s, char *out, size_t cap)
{
    clean_finish(&s->cl, &s->mid);
    size_t w = stage_utf8(s, out, cap, true);
    stream_reset(s);
    return w;
}

void tok_stream_free(struct tok_stream *s)
{
    if (!s)
        return;
    free(s->mid.p);
    free(s);
}

int tokenizer_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, bool special,
                     char **text, size_t *len)
{
    return tokenizer_decode_max(t, ids, n, special, SIZE_MAX, text, len);
}

/* Cleaned bytes held before they go through the UTF-8 checker. */
#define DECODE_CHUNK 4096
#define DECODE_SLACK (3 * (DECODE_CHUNK + TOK_MAX_PIECE + 8) + 8)

int tokenizer_decode_max(const struct tokenizer *t, const uint32_t *ids, size_t n, bool special,
                         size_t max_bytes, char **text, size_t *len)
{
    struct tok_stream s = {.t = t, .special = special};
    struct sbuf out = {0};
    int rc = 0;
    *text = NULL;
    *len = 0;
    stream_reset(&s);
    /* the stages as the streaming form runs them, a chunk at a time, so the
     * text is measured as it is made */
    for (size_t i = 0; i <= n; i++) {
        if (i < n)
            stage_piece(&s, ids[i]);
        else
            clean_finish(&s.cl, &s.mid);
        if (s.mid.oom) {
            rc = KVD_ENOMEM;
            break;
        }
        if (i < n && s.mid.n < DECODE_CHUNK)
            continue;
        /* at most three bytes out per byte in (U+FFFD), and the NUL */
        size_t need = out.n + 3 * s.mid.n + 8;
        if (need > out.cap) {
            size_t cap = out.cap ? out.cap : 64;
            while (cap < need)
                cap *= 2;
            /* never more than the bound and one chunk's worth: out.n is
             * within max_bytes here, s.mid under DECODE_CHUNK and a piece */
            if (max_bytes < SIZE_MAX / 2 && cap > max_bytes + DECODE_SLACK)
                cap = need > max_bytes + DECODE_SLACK ? need : max_bytes + DECODE_SLACK;
            char *p = realloc(out.p, cap);
            if (!p) {
                rc = KVD_ENOMEM;
                break;
            }
            out.p = p;
            out.cap = cap;
        }
        out.n += stage_utf8(&s, out.p + out.n, out.cap - out.n, i == n);
        if (out.n > max_bytes) {
            rc = KVD_ETOOLARGE;
            break;
        }
    }
    free(s.mid.p);
    if (rc) {
        free(out.p);
        return rc;
    }
    *text = out.p;
    *len = out.n;
    return 0;
}
