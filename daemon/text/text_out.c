/* text_out: see text_out.h. */
#include "text_out.h"

#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

struct text_out {
    const struct tokenizer *tok;
    struct tok_stream *ts;
    bool first; /* no token pushed yet */
    char **stops;
    size_t *stop_lens, n_stops;
    char *buf; /* the text, NUL-terminated */
    size_t len, cap;
    size_t ready; /* bytes that may be handed out */
    size_t taken; /* bytes handed out */
    bool stopped, finished;
};

void text_out_free(struct text_out *o)
{
    if (!o)
        return;
    tok_stream_free(o->ts);
    for (size_t i = 0; i < o->n_stops; i++)
        free(o->stops[i]);
    free(o->stops);
    free(o->stop_lens);
    free(o->buf);
    free(o);
}

int text_out_new(const struct tokenizer *tok, const char *const *stops, const size_t *stop_lens,
                 size_t n_stops, struct text_out **out)
{
    *out = NULL;
    struct text_out *o = calloc(1, sizeof(*o));
    if (!o)
        return KVD_ENOMEM;
    o->tok = tok;
    o->first = true;
    o->ts = tok_stream_new(tok, false);
    o->cap = 256;
    o->buf = malloc(o->cap);
    if (n_stops) {
        o->stops = calloc(n_stops, sizeof(*o->stops));
        o->stop_lens = calloc(n_stops, sizeof(*o->stop_lens));
    }
    if (!o->ts || !o->buf || (n_stops && (!o->stops || !o->stop_lens))) {
        text_out_free(o);
        return KVD_ENOMEM;
    }
    o->buf[0] = 0;
    for (size_t i = 0; i < n_stops; i++) {
        if (stop_lens[i] == 0 || stop_lens[i] > TEXT_OUT_MAX_STOP_LEN) {
            text_out_free(o);
            return KVD_EBADREQ;
        }
        o->stops[i] = malloc(stop_lens[i]);
        if (!o->stops[i]) {
            text_out_free(o);
            return KVD_ENOMEM;
        }
        memcpy(o->stops[i], stops[i], stop_lens[i]);
        o->stop_lens[i] = stop_lens[i];
        o->n_stops++;
    }
    *out = o;
    return 0;
}

static int append(struct text_out *o, const char *s, size_t n)
{
    if (o->len + n + 1 > o->cap) {
        size_t cap = o->cap;
        while (o->len + n + 1 > cap)
            cap *= 2;
        char *b = realloc(o->buf, cap);
        if (!b)
            return KVD_ENOMEM;
        o->buf = b;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    o->buf[o->len] = 0;
    return 0;
}

/* The earliest stop string that ends after `from` (bytes before it were
 * searched already); sets *at to its start. */
static bool find_stop(const struct text_out *o, size_t from, size_t *at)
{
    bool found = false;
    for (size_t i = 0; i < o->n_stops; i++) {
        size_t sl = o->stop_lens[i];
        if (sl > o->len)
            continue;
        size_t start = from + 1 > sl ? from + 1 - sl : 0;
        for (size_t p = start; p + sl <= o->len && (!found || p < *at); p++)
            if (o->buf[p] == o->stops[i][0] && memcmp(o->buf + p, o->stops[i], sl) == 0) {
                *at = p;
                found = true;
                break;
            }
    }
    return found;
}

/* Bytes at the end that begin some stop string (held back). */
static size_t held_back(const struct text_out *o)
{
    size_t keep = 0;
    for (size_t i = 0; i < o->n_stops; i++) {
        size_t sl = o->stop_lens[i];
        for (size_t k = sl - 1 < o->len ? sl - 1 : o->len; k > keep; k--)
            if (memcmp(o->buf + o->len - k, o->stops[i], k) == 0) {
                keep = k;
                break;
            }
    }
    return keep;
}

static int take_text(struct text_out *o, const char *s, size_t n)
{
    if (n == 0)
        return 0;
    size_t from = o->len;
    if (append(o, s, n))
        return -KVD_ENOMEM;
    size_t at = 0;
    if (o->n_stops && find_stop(o, from, &at)) {
        o->len = at;
        o->buf[at] = 0;
        o->ready = at;
        o->stopped = true;
        return 1;
    }
    o->ready = o->len - held_back(o);
    return 0;
}

int text_out_push(struct text_out *o, uint32_t tok)
{
    if (o->stopped || o->finished)
        return o->stopped ? 1 : 0;
    char piece[TOK_STREAM_MAX_OUT + 1];
    size_t n = tok_stream_push(o->ts, tok, piece + 1, sizeof piece - 1);
    char *p = piece + 1;
    if (o->first) {
        /* The stream decodes like llama_detokenize, which drops the
         * SentencePiece space of a text's first token; a completion
         * continues its prompt, so it keeps it (as llama.cpp's server's
         * token-by-token pieces do). */
        o->first = false;
        char raw[8];
        size_t rl = tokenizer_piece(o->tok, tok, false, raw, sizeof raw);
        if (rl > 0 && raw[0] == ' ' && (n == 0 || p[0] != ' ')) {
            *--p = ' ';
            n++;
        }
    }
    return take_text(o, p, n);
}

int text_out_finish(struct text_out *o)
{
    if (o->finished)
        return 0;
    o->finished = true;
    if (o->stopped)
        return 0;
    char piece[TOK_STREAM_MAX_OUT];
    size_t n = tok_stream_flush(o->ts, piece, sizeof piece);
    int rc = take_text(o, piece, n);
    if (rc < 0)
        return rc;
    o->ready = o->len;
    return 0;
}

size_t text_out_take(struct text_out *o, const char **p)
{
    *p = o->buf + o->taken;
    size_t n = o->ready > o->taken ? o->ready - o->taken : 0;
    o->taken += n;
    return n;
}

const char *text_out_str(const struct text_out *o, size_t *len)
{
    *len = o->len;
    return o->buf;
}

bool text_out_stopped(const struct text_out *o)
{
    return o->stopped;
}

bool text_out_pending(const struct text_out *o)
{
    return o->ready > o->taken;
}
