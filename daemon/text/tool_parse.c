/* tool_parse (tool_call.h): a completion's text, fed piece by piece, split
 * into content and tool calls. One pass over the bytes with a saved state
 * (the text is kept, so a failed call can be read again as content): the
 * content mode looks for the family's opener, holding back what may still
 * become one; a call object is scanned structurally (strings, escapes,
 * nesting) to find its name and arguments as they arrive, and checked
 * with jansson once whole. */
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "tool_call_impl.h"

#define TP_MAX_DEPTH 512 /* nesting inside one call object */

/* ---- the families' openers ------------------------------------------------ */

static const struct tool_syntax syntaxes[] = {
    [TOOL_GENERIC] = {.start = {" { \"tool_calls\" : [", NULL}},
    [TOOL_HERMES] = {.anywhere = "<tool_call>"},
    [TOOL_LLAMA3] = {.start = {" { \"name\" : \"", " <|python_tag|> { \"name\" : \""}},
    [TOOL_MISTRAL] = {.anywhere = "[TOOL_CALLS]"},
};

const struct tool_syntax *tool_syntax_of(enum tool_family f)
{
    return (unsigned)f < sizeof syntaxes / sizeof syntaxes[0] ? &syntaxes[f]
                                                              : &syntaxes[TOOL_GENERIC];
}

/* ---- one call object: {"name": ..., "arguments": ...} ----------------------- */

enum cs_state {
    CS_OBJ,          /* before '{' */
    CS_KEY_OR_END,   /* after '{' */
    CS_KEY_NEXT,     /* after ',' */
    CS_KEY,          /* in a key */
    CS_COLON,        /* after a key */
    CS_VAL_START,    /* after ':' */
    CS_VAL,          /* in a member's value */
    CS_COMMA_OR_END, /* after a value */
};
enum cs_kind { K_OTHER, K_NAME, K_ARGS };
enum cs_res { CS_MORE, CS_DONE, CS_BAD };

struct cscan {
    enum cs_state st;
    size_t obj_start; /* offset of '{' */
    uint32_t depth;   /* the value's open containers */
    bool in_str, esc, scalar;
    char stack[TP_MAX_DEPTH];
    size_t key_start;
    enum cs_kind kind;
    size_t val_start;
    bool has_name, has_args, args_open;
    size_t name_s, name_e;  /* the name's string, quotes included */
    size_t args_s, args_at; /* the arguments' value: start, end so far */
};

static bool is_scalar_char(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '.' ||
           c == '+' || c == '-';
}

static enum cs_kind key_kind(const char *k, size_t n)
{
    if (n == 6 && !memcmp(k, "\"name\"", 6))
        return K_NAME;
    if ((n == 11 && !memcmp(k, "\"arguments\"", 11)) ||
        (n == 12 && !memcmp(k, "\"parameters\"", 12)))
        return K_ARGS;
    return K_OTHER;
}

/* A member's value ended at e (exclusive). */
static enum cs_res member_done(struct cscan *s, const char *buf, size_t e)
{
    if (s->kind == K_NAME) {
        if (s->has_name || buf[s->val_start] != '"')
            return CS_BAD;
        s->has_name = true;
        s->name_s = s->val_start;
        s->name_e = e;
    } else if (s->kind == K_ARGS) {
        s->has_args = true;
        s->args_open = false;
        s->args_at = e;
    }
    s->st = CS_COMMA_OR_END;
    return CS_MORE;
}

/* Feeds buf[i]. */
static enum cs_res cs_feed(struct cscan *s, const char *buf, size_t i)
{
    char c = buf[i];
    switch (s->st) {
    case CS_OBJ:
        if (tool_is_ws(c))
            return CS_MORE;
        if (c != '{')
            return CS_BAD;
        s->obj_start = i;
        s->st = CS_KEY_OR_END;
        return CS_MORE;
    case CS_KEY_OR_END:
    case CS_KEY_NEXT:
        if (tool_is_ws(c))
            return CS_MORE;
        if (c == '}' && s->st == CS_KEY_OR_END)
            return CS_DONE;
        if (c != '"')
            return CS_BAD;
        s->key_start = i;
        s->st = CS_KEY;
        s->esc = false;
        return CS_MORE;
    case CS_KEY:
        if ((unsigned char)c < 0x20)
            return CS_BAD;
        if (s->esc)
            s->esc = false;
        else if (c == '\\')
            s->esc = true;
        else if (c == '"') {
            s->kind = key_kind(buf + s->key_start, i + 1 - s->key_start);
            s->st = CS_COLON;
        }
        return CS_MORE;
    case CS_COLON:
        if (tool_is_ws(c))
            return CS_MORE;
        if (c != ':')
            return CS_BAD;
        s->st = CS_VAL_START;
        return CS_MORE;
    case CS_VAL_START:
        if (tool_is_ws(c))
            return CS_MORE;
        s->val_start = i;
        s->depth = 0;
        s->in_str = s->esc = s->scalar = false;
        if (c == '{' || c == '[')
            s->stack[s->depth++] = c;
        else if (c == '"')
            s->in_str = true;
        else if (c == '-' || (c >= '0' && c <= '9') || c == 't' || c == 'f' || c == 'n')
            s->scalar = true;
        else
            return CS_BAD;
        s->st = CS_VAL;
        if (s->kind == K_ARGS) {
            if (s->has_args)
                return CS_BAD;
            s->args_open = true;
            s->args_s = i;
            s->args_at = i + 1;
        }
        return CS_MORE;
    case CS_VAL:
        if (s->scalar) {
            if (is_scalar_char(c)) {
                if (s->kind == K_ARGS)
                    s->args_at = i + 1;
                return CS_MORE;
            }
            enum cs_res r = member_done(s, buf, i);
            return r == CS_BAD ? r : cs_feed(s, buf, i); /* c belongs to what follows */
        }
        if (s->kind == K_ARGS)
            s->args_at = i + 1;
        if (s->in_str) {
            if ((unsigned char)c < 0x20)
                return CS_BAD;
            if (s->esc)
                s->esc = false;
            else if (c == '\\')
                s->esc = true;
            else if (c == '"') {
                s->in_str = false;
                if (s->depth == 0)
                    return member_done(s, buf, i + 1);
            }
            return CS_MORE;
        }
        if (c == '"') {
            s->in_str = true;
        } else if (c == '{' || c == '[') {
            if (s->depth == TP_MAX_DEPTH)
                return CS_BAD;
            s->stack[s->depth++] = c;
        } else if (c == '}' || c == ']') {
            if (s->stack[s->depth - 1] != (c == '}' ? '{' : '['))
                return CS_BAD;
            if (--s->depth == 0)
                return member_done(s, buf, i + 1);
        }
        return CS_MORE;
    case CS_COMMA_OR_END:
        if (tool_is_ws(c))
            return CS_MORE;
        if (c == ',') {
            s->st = CS_KEY_NEXT;
            return CS_MORE;
        }
        return c == '}' ? CS_DONE : CS_BAD;
    }
    return CS_BAD;
}

/* ---- the parser ------------------------------------------------------------ */

enum tp_mode {
    TP_START, /* start families: the reply's start may still be the opener */
    TP_TEXT,  /* content */
    TP_PRE,   /* after an opener (or a list's comma), before a call object */
    TP_CALL,  /* in a call object */
    TP_CLOSE, /* Hermes: after a call, its closing tag */
    TP_SEP,   /* Mistral, generic: after a call in the list */
    TP_END,   /* generic: after the list, the closing brace */
};

#define TP_NONE SIZE_MAX

struct tool_parse {
    struct tool_parse_conf conf;
    const struct tool_syntax *syn;
    char *buf; /* everything pushed, NUL-terminated */
    size_t len, cap;
    size_t pos; /* bytes the state machine has read */
    enum tp_mode mode;
    /* content mode: buf[hold, ...) is not emitted yet; buf[hold, decided)
     * holds no opener (only its trailing whitespace, from ws_from, is
     * held); kmp bytes of the opener are matched at the end */
    bool plain;      /* no opener can come any more (start families past the start) */
    bool after_call; /* whitespace right after a call is dropped */
    size_t hold, decided, ws_from, kmp;
    size_t pat[2]; /* TP_START: each start pattern's position (TP_NONE: failed) */
    size_t brace;  /* TP_START: where the reply's first '{' is */
    /* the current block, from its opener (its whitespace before, block_ws) */
    size_t block_ws, block_start, opener_end;
    size_t block_calls;       /* calls committed in it */
    bool in_list;             /* its calls are a JSON list */
    size_t lit_start, lit_at; /* TP_CLOSE: the closing tag's start and progress */
    struct cscan cs;
    bool cs_committed; /* the call being scanned is committed (the last one) */
    char *content;
    size_t clen, ccap;
    struct tool_call_out *calls;
    size_t n_calls, cap_calls;
    bool finished;
};

static int grow(char **p, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    char *n = realloc(*p, c);
    if (!n)
        return KVD_ENOMEM;
    *p = n;
    *cap = c;
    return 0;
}

static int emit(struct tool_parse *p, size_t from, size_t to)
{
    if (to <= from)
        return 0;
    if (grow(&p->content, &p->ccap, p->clen + (to - from) + 1))
        return KVD_ENOMEM;
    memcpy(p->content + p->clen, p->buf + from, to - from);
    p->clen += to - from;
    p->content[p->clen] = 0;
    return 0;
}

/* Content mode from `at` on (read again from there). */
static void to_text(struct tool_parse *p, size_t at, bool after_call)
{
    p->mode = TP_TEXT;
    p->hold = p->decided = at;
    p->ws_from = TP_NONE;
    p->kmp = 0;
    p->after_call = after_call;
}

int tool_parse_new(const struct tool_parse_conf *c, struct tool_parse **out)
{
    struct tool_parse *p = calloc(1, sizeof *p);
    if (!p || grow(&p->content, &p->ccap, 1) || grow(&p->buf, &p->cap, 1)) {
        tool_parse_free(p);
        return KVD_ENOMEM;
    }
    p->content[0] = p->buf[0] = 0;
    p->conf = *c;
    p->syn = tool_syntax_of(c->family);
    to_text(p, 0, false);
    if (!p->syn->anywhere) {
        p->mode = TP_START;
        p->pat[1] = p->syn->start[1] ? 0 : TP_NONE;
        p->brace = TP_NONE;
    }
    *out = p;
    return 0;
}

void tool_parse_free(struct tool_parse *p)
{
    if (!p)
        return;
    for (size_t i = 0; i < p->n_calls; i++) {
        free(p->calls[i].id);
        free(p->calls[i].name);
        free(p->calls[i].args);
    }
    free(p->calls);
    free(p->content);
    free(p->buf);
    free(p);
}

/* A call id: "call_" and 24 letters and digits; Mistral's template wants 9
 * of them and nothing else. */
static void make_id(enum tool_family f, char *id)
{
    static const char al[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    unsigned char r[24];
    size_t n = f == TOOL_MISTRAL ? 9 : 24, k = 0;
    if (getrandom(r, n, GRND_NONBLOCK) != (ssize_t)n) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t x = ((uint64_t)ts.tv_nsec + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)id;
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            r[i] = (unsigned char)(x >> 24);
        }
    }
    if (f != TOOL_MISTRAL) {
        memcpy(id, "call_", 5);
        k = 5;
    }
    for (size_t i = 0; i < n; i++)
        id[k++] = al[r[i] % 62];
    id[k] = 0;
}

/* The JSON string text s[0, n) decoded (malloc'd), or NULL. */
static char *json_str_dup(const char *s, size_t n, size_t *len)
{
    json_t *v = json_loadb(s, n, JSON_DECODE_ANY, NULL);
    char *out = NULL;
    if (json_is_string(v) && (out = malloc(json_string_length(v) + 1))) {
        memcpy(out, json_string_value(v), json_string_length(v) + 1);
        if (len)
            *len = json_string_length(v);
    }
    json_decref(v);
    return out;
}

/* A new call with the scanned name: 0, -1 (the name is no valid string),
 * KVD_ENOMEM. */
static int commit(struct tool_parse *p)
{
    struct cscan *s = &p->cs;
    if (p->n_calls == p->cap_calls) {
        size_t cap = p->cap_calls ? 2 * p->cap_calls : 4;
        struct tool_call_out *c = realloc(p->calls, cap * sizeof *c);
        if (!c)
            return KVD_ENOMEM;
        p->calls = c;
        p->cap_calls = cap;
    }
    char *name = json_str_dup(p->buf + s->name_s, s->name_e - s->name_s, NULL);
    if (!name)
        return -1;
    struct tool_call_out *c = &p->calls[p->n_calls];
    memset(c, 0, sizeof *c);
    c->name = name;
    c->id = malloc(32);
    c->args = malloc(1);
    if (!c->id || !c->args) {
        free(c->name);
        free(c->id);
        free(c->args);
        return KVD_ENOMEM;
    }
    make_id(p->conf.family, c->id);
    c->args[0] = 0;
    p->n_calls++;
    p->block_calls++;
    p->cs_committed = true;
    return 0;
}

static int args_put(struct tool_call_out *c, const char *s, size_t n, bool append)
{
    size_t at = append ? c->args_len : 0;
    char *a = realloc(c->args, at + n + 1);
    if (!a)
        return KVD_ENOMEM;
    memcpy(a + at, s, n);
    a[at + n] = 0;
    c->args = a;
    c->args_len = at + n;
    return 0;
}

/* Incremental: the committed call's arguments up to what was scanned. */
static int args_follow(struct tool_parse *p)
{
    struct cscan *s = &p->cs;
    if (!p->cs_committed || !(s->args_open || s->has_args))
        return 0;
    struct tool_call_out *c = &p->calls[p->n_calls - 1];
    size_t have = s->args_s + c->args_len;
    return s->args_at > have ? args_put(c, p->buf + have, s->args_at - have, true) : 0;
}

/* The call object ended at i (its '}'): 0, -1 (not a call: only without
 * incremental), KVD_ENOMEM. */
static int call_done(struct tool_parse *p, size_t i)
{
    struct cscan *s = &p->cs;
    int rc = 0;
    if (!p->cs_committed) { /* only a whole, valid call */
        json_t *o = json_loadb(p->buf + s->obj_start, i + 1 - s->obj_start, 0, NULL);
        bool valid = json_is_object(o) && json_is_string(json_object_get(o, "name"));
        json_decref(o);
        if (!valid || !s->has_name)
            return -1;
        if ((rc = commit(p)))
            return rc;
        struct tool_call_out *c = &p->calls[p->n_calls - 1];
        if (s->has_args && p->buf[s->args_s] == '"') {
            /* the arguments given as a string holding their JSON */
            size_t n = 0;
            char *a = json_str_dup(p->buf + s->args_s, s->args_at - s->args_s, &n);
            if (!a)
                return KVD_ENOMEM;
            free(c->args);
            c->args = a;
            c->args_len = n;
        } else if (s->has_args) {
            rc = args_put(c, p->buf + s->args_s, s->args_at - s->args_s, false);
        }
    } else {
        rc = args_follow(p);
    }
    struct tool_call_out *c = &p->calls[p->n_calls - 1];
    if (!rc && !s->has_args && c->args_len == 0)
        rc = args_put(c, "{}", 2, false);
    c->args_done = true;
    p->cs_committed = false;
    return rc;
}

/* The block failed at i (no call can be read there, or the syntax around
 * it is not the family's). Calls it committed stand and the text from i
 * on is content; without any, the whole block is content, read again past
 * its opener. Returns where to read on. */
static size_t block_fail(struct tool_parse *p, size_t i)
{
    if (p->cs_committed) { /* incremental: what streamed stands */
        p->calls[p->n_calls - 1].args_done = true;
        p->cs_committed = false;
    }
    if (!p->syn->anywhere)
        p->plain = true;
    if (p->block_calls) {
        to_text(p, i, true);
        return i;
    }
    to_text(p, p->block_ws, false);
    return p->plain ? p->block_ws : p->opener_end;
}

/* Content mode: buf[.., to) holds no opener. It is emitted but for its
 * trailing whitespace, held with what follows (dropped when a call comes
 * next, or at the end after calls). */
static int decide(struct tool_parse *p, size_t to)
{
    for (size_t j = p->decided; j < to; j++) {
        if (tool_is_ws(p->buf[j])) {
            if (p->ws_from == TP_NONE)
                p->ws_from = j;
        } else {
            if (p->after_call)
                p->hold = j;
            p->after_call = false;
            p->ws_from = TP_NONE;
        }
    }
    if (to > p->decided)
        p->decided = to;
    if (p->after_call)
        return 0;
    size_t e = p->ws_from == TP_NONE ? p->decided : p->ws_from;
    int rc = emit(p, p->hold, e);
    p->hold = e;
    return rc;
}

/* The opener matched after c, knowing k bytes of it matched before. */
static size_t kmp_step(const char *op, size_t k, char c)
{
    while (k > 0 && op[k] != c) {
        size_t b = k - 1; /* the longest proper border of op[0, k) */
        while (b > 0 && memcmp(op, op + k - b, b) != 0)
            b--;
        k = b;
    }
    return op[k] == c ? k + 1 : 0;
}

enum pat_res { PAT_ON, PAT_DONE, PAT_FAIL };
/* A start pattern read on by c. */
static enum pat_res pat_step(const char *pat, size_t *at, char c)
{
    while (pat[*at] == ' ') {
        if (tool_is_ws(c))
            return PAT_ON;
        ++*at;
    }
    if (pat[*at] != c)
        return PAT_FAIL;
    ++*at;
    return pat[*at] ? PAT_ON : PAT_DONE;
}

static void block_begin(struct tool_parse *p, size_t ws, size_t start, size_t opener_end)
{
    p->block_ws = ws;
    p->block_start = start;
    p->opener_end = opener_end;
    p->block_calls = 0;
    p->in_list = false;
    memset(&p->cs, 0, sizeof p->cs);
    p->cs_committed = false;
}

/* Reads buf[pos, len). */
static int run(struct tool_parse *p)
{
    int rc = 0;
    for (size_t i = p->pos; i < p->len; i++) {
        char c = p->buf[i];
        switch (p->mode) {
        case TP_START: {
            bool on = false, done = false;
            for (int k = 0; k < 2; k++) {
                if (p->pat[k] == TP_NONE)
                    continue;
                enum pat_res r = pat_step(p->syn->start[k], &p->pat[k], c);
                if (r == PAT_FAIL)
                    p->pat[k] = TP_NONE;
                on |= r == PAT_ON;
                done |= r == PAT_DONE;
            }
            if (c == '{' && p->brace == TP_NONE)
                p->brace = i;
            if (done) {
                block_begin(p, p->hold, p->hold, i + 1);
                if (p->conf.family == TOOL_GENERIC) {
                    p->mode = TP_PRE;
                    p->in_list = true;
                } else { /* the opener is the call's own start: read again */
                    p->mode = TP_CALL;
                    i = p->brace - 1;
                }
            } else if (!on) {
                p->plain = true;
                to_text(p, p->hold, false);
                i--; /* read again as content */
            }
            break;
        }
        case TP_TEXT:
            if (p->plain) {
                if ((rc = decide(p, i + 1)))
                    return rc;
                break;
            }
            p->kmp = kmp_step(p->syn->anywhere, p->kmp, c);
            if (p->syn->anywhere[p->kmp] == 0) {
                size_t start = i + 1 - p->kmp;
                if ((rc = decide(p, start)))
                    return rc;
                block_begin(p, p->hold, start, i + 1);
                p->mode = p->conf.family == TOOL_MISTRAL ? TP_PRE : TP_CALL;
            } else if ((rc = decide(p, i + 1 - p->kmp))) {
                return rc;
            }
            break;
        case TP_PRE:
            if (tool_is_ws(c))
                break;
            if (c == '[' && !p->in_list && p->conf.family == TOOL_MISTRAL) {
                p->in_list = true;
                break;
            }
            if (c != '{') {
                i = block_fail(p, i) - 1;
                break;
            }
            memset(&p->cs, 0, sizeof p->cs);
            p->mode = TP_CALL;
            i--;
            break;
        case TP_CALL: {
            enum cs_res r = cs_feed(&p->cs, p->buf, i);
            if (r == CS_MORE && p->conf.incremental && !p->cs_committed && p->cs.has_name)
                rc = commit(p);
            if (rc == 0 && r == CS_MORE)
                rc = args_follow(p);
            if (rc == 0 && r == CS_DONE)
                rc = call_done(p, i);
            if (rc > 0)
                return rc;
            if (rc == -1 || r == CS_BAD) {
                rc = 0;
                i = block_fail(p, i) - 1;
                break;
            }
            if (r == CS_MORE)
                break;
            if (p->conf.family == TOOL_HERMES) {
                p->mode = TP_CLOSE;
                p->lit_start = TP_NONE;
                p->lit_at = 0;
            } else if (p->in_list) {
                p->mode = TP_SEP;
            } else {
                if (!p->syn->anywhere)
                    p->plain = true;
                to_text(p, i + 1, true);
            }
            break;
        }
        case TP_CLOSE: { /* whitespace, then </tool_call> */
            static const char tag[] = "</tool_call>";
            if (p->lit_start == TP_NONE && tool_is_ws(c))
                break;
            if (p->lit_start == TP_NONE)
                p->lit_start = i;
            if (c == tag[p->lit_at]) {
                if (tag[++p->lit_at] == 0)
                    to_text(p, i + 1, true);
                break;
            }
            /* no closing tag: the call stands, the rest is content */
            size_t at = p->lit_start;
            to_text(p, at, true);
            i = at - 1;
            break;
        }
        case TP_SEP:
            if (tool_is_ws(c))
                break;
            if (c == ',') {
                p->mode = TP_PRE;
            } else if (c == ']' && p->conf.family == TOOL_GENERIC) {
                p->mode = TP_END;
            } else {
                if (!p->syn->anywhere)
                    p->plain = true;
                to_text(p, c == ']' ? i + 1 : i, true);
                if (c != ']')
                    i--;
            }
            break;
        case TP_END:
            if (tool_is_ws(c))
                break;
            p->plain = true;
            to_text(p, c == '}' ? i + 1 : i, true);
            if (c != '}')
                i--;
            break;
        }
    }
    p->pos = p->len;
    return 0;
}

int tool_parse_push(struct tool_parse *p, const char *s, size_t n)
{
    if (p->finished || n == 0)
        return 0;
    if (grow(&p->buf, &p->cap, p->len + n + 1))
        return KVD_ENOMEM;
    memcpy(p->buf + p->len, s, n);
    p->len += n;
    p->buf[p->len] = 0;
    return run(p);
}

int tool_parse_finish(struct tool_parse *p)
{
    if (p->finished)
        return 0;
    for (;;) {
        switch (p->mode) {
        case TP_START:
            p->plain = true;
            to_text(p, p->hold, false);
            continue;
        case TP_TEXT:
            break;
        case TP_CLOSE:
        case TP_SEP:
        case TP_END: /* the calls stand; the rest of their syntax is missing */
            p->finished = true;
            return 0;
        case TP_PRE:
        case TP_CALL:
            if (p->cs_committed || p->block_calls) {
                /* what was committed stands, cut where the text ended */
                p->cs_committed = false;
                p->finished = true;
                return 0;
            }
            p->pos = block_fail(p, p->len);
            int rc = run(p);
            if (rc)
                return rc;
            continue;
        }
        break;
    }
    /* the held text is content, but for whitespace next to calls */
    int rc = decide(p, p->len);
    size_t b = p->hold, e = p->len;
    if (p->after_call)
        while (b < e && tool_is_ws(p->buf[b]))
            b++;
    if (p->n_calls)
        while (e > b && tool_is_ws(p->buf[e - 1]))
            e--;
    if (rc == 0)
        rc = emit(p, b, e);
    p->hold = p->len;
    p->finished = true;
    return rc;
}

const char *tool_parse_content(const struct tool_parse *p, size_t *len)
{
    *len = p->clen;
    return p->content;
}

size_t tool_parse_n_calls(const struct tool_parse *p)
{
    return p->n_calls;
}

const struct tool_call_out *tool_parse_call(const struct tool_parse *p, size_t i)
{
    return i < p->n_calls ? &p->calls[i] : NULL;
}
