/* The Jinja engine behind chat_template.h: lexer, parser, values and
 * interpreter, written to behave like @huggingface/jinja (the renderer
 * node-llama-cpp uses) on the subset real chat templates use. Internal to
 * daemon/text; everything lives in arenas and errors leave through longjmp
 * to the one entry point that set the jump buffer (chat_template.c). */
#ifndef KVD_JINJA_H
#define KVD_JINJA_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* Limits that keep a hostile template from exhausting the daemon. */
#define JINJA_MAX_SRC (1u << 20)            /* template bytes */
#define JINJA_MAX_DEPTH 200                 /* nested expressions/statements */
#define JINJA_MAX_MEM (256u << 20)          /* arena bytes of one parse or render */
#define JINJA_MAX_OUT (64u << 20)           /* rendered bytes */
#define JINJA_MAX_STEPS (20u * 1000 * 1000) /* evaluated nodes of one render */
/* The work of one render besides its nodes: every byte a string operation
 * reads or writes (comparisons, `in`, length, slicing, filters and methods,
 * concatenation and output) counts, since those are O(length) and a step
 * budget alone let a template test a 16 MiB string's length a million
 * times. And the CPU time of one render (the rendering thread's, so a
 * machine busy with other work does not refuse a template that is fine),
 * checked every 1024 nodes and every MiB of work, whatever a template does. */
#define JINJA_MAX_WORK ((uint64_t)1 << 30) /* bytes */
#define JINJA_MAX_MS 2000u

/* ---- arena and errors ---- */

struct jchunk;
struct jctx {
    jmp_buf jb;
    int code;  /* enum kvd_err when longjmp'd */
    char *err; /* caller's message buffer */
    size_t errlen;
    struct jchunk *chunks; /* owned; freed by jctx_free */
    size_t mem;            /* bytes allocated so far */
};

_Noreturn void jfail(struct jctx *c, int code, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void *jalloc(struct jctx *c, size_t n);
char *jstrdup(struct jctx *c, const char *s, size_t n);
void jctx_free(struct jctx *c);

/* ---- tokens ---- */

enum jtok {
    JT_TEXT,
    JT_NUM,
    JT_STR,
    JT_IDENT,
    JT_EQUALS,
    JT_LPAREN,
    JT_RPAREN,
    JT_OPEN_STMT,
    JT_CLOSE_STMT,
    JT_OPEN_EXPR,
    JT_CLOSE_EXPR,
    JT_LBRACKET,
    JT_RBRACKET,
    JT_LBRACE,
    JT_RBRACE,
    JT_COMMA,
    JT_DOT,
    JT_COLON,
    JT_PIPE,
    JT_ADD,
    JT_MUL,
    JT_POW,
    JT_CMP,
    JT_UNARY,
    JT_COMMENT
};

struct jtoken {
    enum jtok type;
    const char *s; /* value (arena), NUL-terminated */
    size_t n;
    int line; /* 1-based line in the template as given */
};

/* Tokenizes src like the reference (lstrip_blocks and trim_blocks on, one
 * trailing newline dropped). KVD_EBADREQ through jfail on a lexical error. */
void jinja_lex(struct jctx *c, const char *src, size_t len, struct jtoken **out, size_t *n);

/* ---- syntax tree ---- */

enum jnk {
    JN_STR,
    JN_INT,
    JN_FLOAT,
    JN_IDENT,
    JN_ARRAY,
    JN_TUPLE,
    JN_OBJECT,
    JN_MEMBER,
    JN_SLICE,
    JN_CALL,
    JN_KWARG,
    JN_FILTER,
    JN_TEST,
    JN_UNARY,
    JN_BINARY,
    JN_TERNARY,
    JN_SELECT,
    JN_IF,
    JN_FOR,
    JN_SET,
    JN_MACRO,
    JN_BREAK,
    JN_CONTINUE,
    JN_COMMENT
};

enum jop {
    JO_NONE,
    JO_AND,
    JO_OR,
    JO_NOT,
    JO_IN,
    JO_NOT_IN,
    JO_EQ,
    JO_NE,
    JO_LT,
    JO_GT,
    JO_LE,
    JO_GE,
    JO_ADD,
    JO_SUB,
    JO_CONCAT,
    JO_MUL,
    JO_DIV,
    JO_FLOORDIV,
    JO_MOD,
    JO_POW,
    JO_NEG,
    JO_POS
};

struct jnode {
    enum jnk kind;
    enum jop op;
    int line;
    bool flag;     /* MEMBER: computed; TEST: negated; FILTER: called with () */
    const char *s; /* STR/IDENT/KWARG key/FILTER/TEST/MACRO name */
    size_t n;
    double num; /* INT/FLOAT */
    struct jnode *a, *b, *c;
    struct jnode **list; /* body / elements / args / object keys / params */
    size_t nlist;
    struct jnode **list2; /* alternate / else / object values / macro body */
    size_t nlist2;
};

struct jprog {
    struct jnode **body;
    size_t n;
};

/* Parses tokens into a program (KVD_EBADREQ syntax, KVD_EUNSUPPORTED for
 * statements outside the subset, both through jfail). */
void jinja_parse(struct jctx *c, const struct jtoken *t, size_t n, struct jprog *out);

/* ---- values ---- */

enum jt {
    JV_UNDEF,
    JV_NULL,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_ARRAY,
    JV_TUPLE,
    JV_OBJECT,
    JV_NS,
    JV_FUNC,
    JV_KWARGS
};

struct jlist;
struct jmap;
struct jfunc;

struct jval {
    enum jt t;
    union {
        bool b;
        double num;
        struct {
            const char *p;
            size_t n;
        } s;
        struct jlist *arr;
        struct jmap *map;
        struct jfunc *fn;
    } u;
};

struct jlist {
    size_t n, cap;
    struct jval *v;
};

struct jmap {
    size_t n, cap;
    const char **kp; /* keys (bytes, not NUL-terminated necessarily) */
    size_t *kn;
    struct jval *v;
};

struct jenv {
    struct jenv *parent;
    struct jmap vars;
};

/* Builtin functions; JF_MACRO is a template macro. */
enum jfn {
    JF_MACRO,
    JF_RAISE,
    JF_RANGE,
    JF_NAMESPACE,
    JF_STRFTIME,
    JF_S_UPPER,
    JF_S_LOWER,
    JF_S_STRIP,
    JF_S_TITLE,
    JF_S_CAPITALIZE,
    JF_S_RSTRIP,
    JF_S_LSTRIP,
    JF_S_STARTSWITH,
    JF_S_ENDSWITH,
    JF_S_SPLIT,
    JF_S_REPLACE,
    JF_O_GET,
    JF_O_ITEMS,
    JF_O_KEYS,
    JF_O_VALUES,
    JF_O_DICTSORT
};

struct jfunc {
    enum jfn kind;
    struct jval self;          /* receiver of a method */
    const struct jnode *macro; /* JF_MACRO */
    struct jenv *env;          /* JF_MACRO: defining scope */
};

/* The interpreter's state for one render. */
struct jrt {
    struct jctx *c;
    unsigned long steps;
    uint64_t work, work_checked; /* JINJA_MAX_WORK; work at the last clock check */
    uint64_t deadline_ns;        /* CLOCK_THREAD_CPUTIME_ID of the rendering thread; 0: none */
    int depth;
    size_t out_total; /* bytes appended to any buffer (bounds huge loops) */
    time_t now;       /* strftime_now's clock */
};

/* Growable byte buffer in the arena. */
struct jbuf {
    char *p;
    size_t n, cap;
};
void jbuf_put(struct jrt *rt, struct jbuf *b, const char *s, size_t n);
/* Charges n bytes of string work to the render; fails (too_large, naming
 * the limit) past JINJA_MAX_WORK or the render's deadline. */
void jwork(struct jrt *rt, int line, size_t n);
/* Fails when the render's deadline has passed. */
void jdeadline(struct jrt *rt, int line);
/* The render's deadline: JINJA_MAX_MS of this thread's CPU time from now
 * (CLOCK_THREAD_CPUTIME_ID ns; a render runs on one thread). */
uint64_t jdeadline_from_now(void);

static inline struct jval jv_undef(void)
{
    struct jval v = {.t = JV_UNDEF};
    return v;
}
static inline struct jval jv_null(void)
{
    struct jval v = {.t = JV_NULL};
    return v;
}
static inline struct jval jv_bool(bool b)
{
    struct jval v = {.t = JV_BOOL, .u.b = b};
    return v;
}
static inline struct jval jv_int(double x)
{
    struct jval v = {.t = JV_INT, .u.num = x};
    return v;
}
static inline struct jval jv_float(double x)
{
    struct jval v = {.t = JV_FLOAT, .u.num = x};
    return v;
}
static inline struct jval jv_str(const char *p, size_t n)
{
    struct jval v = {.t = JV_STR, .u.s = {p, n}};
    return v;
}

struct jlist *jlist_new(struct jctx *c, size_t cap);
void jlist_push(struct jctx *c, struct jlist *l, struct jval v);
struct jmap *jmap_new(struct jctx *c);
struct jval *jmap_get(const struct jmap *m, const char *k, size_t kn);
void jmap_set(struct jctx *c, struct jmap *m, const char *k, size_t kn, struct jval v);
struct jval jv_array(struct jlist *l);
struct jval jv_object(struct jmap *m, enum jt t);

const char *jtype_name(enum jt t); /* the reference's type names ("StringValue") */
bool jv_truthy(struct jval v);
/* JavaScript's Number#toString. */
void js_num_str(double x, char *buf, size_t len);
/* The reference's toString of a value (for output); containers as JSON. */
void jv_to_string(struct jrt *rt, int line, struct jval v, struct jbuf *out);
/* String(value.value): what `~` and `+` use (numbers in JS form, floats without ".0"). */
void jv_raw_string(struct jrt *rt, int line, struct jval v, struct jbuf *out);
/* JSON as the reference's tojson writes it. */
struct json_opts {
    int indent; /* 0: none */
    bool ensure_ascii;
    const char *item_sep, *key_sep; /* NULL: default */
    bool undef_as_null;
};
void jv_to_json(struct jrt *rt, int line, struct jval v, const struct json_opts *o, int depth,
                struct jbuf *out);
/* JavaScript loose equality (==) and strict equality (===) of values. */
bool jv_loose_eq(struct jrt *rt, int line, struct jval a, struct jval b);
bool jv_strict_eq(struct jval a, struct jval b);

/* ---- unicode helpers (JavaScript string semantics over UTF-8) ---- */

/* Decodes one code point at s[*i] (advancing *i); invalid bytes decode as
 * themselves (0x80..0xFF) one at a time. */
uint32_t u8_next(const char *s, size_t n, size_t *i);
bool js_is_space(uint32_t cp);
size_t js_utf16_len(const char *s, size_t n);
void js_trim(const char *s, size_t n, bool left, bool right, size_t *b, size_t *e);

/* ---- interpreter ---- */

/* Renders prog with the global environment env; output into *out. */
void jinja_render(struct jrt *rt, const struct jprog *prog, struct jenv *env, struct jbuf *out);
struct jenv *jenv_new(struct jctx *c, struct jenv *parent);
void jenv_set(struct jctx *c, struct jenv *e, const char *name, struct jval v);

/* Filters, tests, methods and globals (jinja_builtins.c). */
struct jval jinja_filter(struct jrt *rt, const struct jnode *f, struct jval operand,
                         struct jenv *env);
bool jinja_test(struct jrt *rt, const struct jnode *t, struct jval operand);
struct jval jinja_member(struct jrt *rt, int line, struct jval obj, struct jval prop);
struct jval jinja_call_builtin(struct jrt *rt, int line, struct jfunc *fn, struct jval *args,
                               size_t nargs);
/* Evaluation of call arguments (jinja_eval.c): positional values followed by
 * one JV_KWARGS value holding the keyword arguments, if any. */
size_t jinja_eval_args(struct jrt *rt, struct jnode **args, size_t n, struct jenv *env,
                       struct jval **out);
struct jval jinja_eval(struct jrt *rt, const struct jnode *node, struct jenv *env);

#endif
