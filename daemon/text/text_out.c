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
    /* tool calls (NULL: none): the parser is fed buf[0, fed) */
    struct tool_parse *tp;
    size_t fed;
    uint32_t marks[4];
    size_t n_marks;
    size_t *sent;            /* each call's arguments handed out (cap_sent entries) */
    size_t cap_sent, n_sent; /* calls handed out */
    struct tool_delta *deltas;
    size_t cap_deltas;
};

void text_out_free(struct text_out *o)
{
    if (!o)
        return;
    tok_stream_free(o->ts);
    tool_parse_free(o->tp);
    free(o->sent);
    free(o->deltas);
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

/* The tool-call parser reads what is ready. */
static int feed(struct text_out *o)
{
    if (!o->tp || o->ready <= o->fed)
        return 0;
    int rc = tool_parse_push(o->tp, o->buf + o->fed, o->ready - o->fed);
    o->fed = o->ready;
    return rc ? -KVD_ENOMEM : 0;
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
        return feed(o) ? -KVD_ENOMEM : 1;
    }
    o->ready = o->len - held_back(o);
    return feed(o);
}

int text_out_push(struct text_out *o, uint32_t tok)
{
    if (o->stopped || o->finished)
        return o->stopped ? 1 : 0;
    char piece[TOK_STREAM_MAX_OUT + 1];
    for (size_t i = 0; i < o->n_marks; i++)
        if (o->marks[i] == tok) {
            /* a special token of the tool-call syntax: its text, after
             * what the stream held */
            size_t n = tok_stream_flush(o->ts, piece, sizeof piece);
            n += tokenizer_piece(o->tok, tok, true, piece + n, sizeof piece - n);
            o->first = false;
            return take_text(o, piece, n < sizeof piece ? n : sizeof piece);
        }
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
    if (feed(o) || (o->tp && tool_parse_finish(o->tp)))
        return -KVD_ENOMEM;
    return 0;
}

/* What may be handed out: the content (tools) or the text. */
static const char *out_text(const struct text_out *o, size_t *ready)
{
    if (o->tp)
        return tool_parse_content(o->tp, ready);
    *ready = o->ready;
    return o->buf;
}

size_t text_out_take(struct text_out *o, const char **p)
{
    size_t ready;
    const char *t = out_text(o, &ready);
    *p = t + o->taken;
    size_t n = ready > o->taken ? ready - o->taken : 0;
    o->taken += n;
    return n;
}

const char *text_out_str(const struct text_out *o, size_t *len)
{
    if (o->tp)
        return tool_parse_content(o->tp, len);
    *len = o->len;
    return o->buf;
}

bool text_out_stopped(const struct text_out *o)
{
    return o->stopped;
}

/* Whether a call has news since the last take. */
static bool calls_pending(const struct text_out *o)
{
    size_t n = o->tp ? tool_parse_n_calls(o->tp) : 0;
    if (n > o->n_sent)
        return true;
    for (size_t i = 0; i < n; i++)
        if (tool_parse_call(o->tp, i)->args_len > o->sent[i])
            return true;
    return false;
}

bool text_out_pending(const struct text_out *o)
{
    size_t ready;
    out_text(o, &ready);
    return ready > o->taken || calls_pending(o);
}

int text_out_set_tools(struct text_out *o, const struct tool_parse_conf *conf,
                       const uint32_t *marks, size_t n_marks)
{
    struct tool_parse *tp;
    if (tool_parse_new(conf, &tp))
        return KVD_ENOMEM;
    tool_parse_free(o->tp);
    o->tp = tp;
    o->fed = 0;
    o->n_marks = 0;
    for (size_t i = 0; i < n_marks && o->n_marks < sizeof o->marks / sizeof o->marks[0]; i++)
        o->marks[o->n_marks++] = marks[i];
    return feed(o) ? KVD_ENOMEM : 0;
}

bool text_out_has_tools(const struct text_out *o)
{
    return o->tp != NULL;
}

size_t text_out_n_calls(const struct text_out *o)
{
    return o->tp ? tool_parse_n_calls(o->tp) : 0;
}

const struct tool_call_out *text_out_call(const struct text_out *o, size_t i)
{
    return o->tp ? tool_parse_call(o->tp, i) : NULL;
}

size_t text_out_take_calls(struct text_out *o, const struct tool_delta **d)
{
    *d = NULL;
    size_t n = o->tp ? tool_parse_n_calls(o->tp) : 0, k = 0;
    if (n == 0)
        return 0;
    if (n > o->cap_sent || n > o->cap_deltas) {
        size_t cap = 2 * n;
        size_t *s = realloc(o->sent, cap * sizeof *s);
        if (s)
            o->sent = s;
        struct tool_delta *dl = s ? realloc(o->deltas, cap * sizeof *dl) : NULL;
        if (!s || !dl)
            return 0; /* no memory: the news wait for the next take */
        o->deltas = dl;
        for (size_t i = o->cap_sent; i < cap; i++)
            o->sent[i] = 0;
        o->cap_sent = o->cap_deltas = cap;
    }
    for (size_t i = 0; i < n; i++) {
        const struct tool_call_out *c = tool_parse_call(o->tp, i);
        bool first = i >= o->n_sent;
        if (!first && c->args_len == o->sent[i])
            continue;
        o->deltas[k++] = (struct tool_delta){
            .index = (uint32_t)i,
            .id = first ? c->id : NULL,
            .name = first ? c->name : NULL,
            .args = c->args + o->sent[i],
            .args_len = c->args_len - o->sent[i],
        };
        o->sent[i] = c->args_len;
    }
    o->n_sent = n;
    *d = o->deltas;
    return k;
}
