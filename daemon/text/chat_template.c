/* Chat templates (chat_template.h): the entry points around the Jinja
 * engine. Each call owns one arena (the parsed template keeps its own; a
 * render allocates from a fresh one and frees it before returning) and sets
 * the jump buffer every error of the engine returns through. */
#include "chat_template.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template_impl.h"
#include "jinja.h"
#include "kvd/status.h"

struct chat_template {
    struct jctx ctx; /* owns the tokens, the tree and its strings */
    struct jprog prog;
};

/* Test hook (chat_template_impl.h): a fixed clock for strftime_now. */
time_t chat_template_fixed_now = 0;

int chat_template_parse(const char *src, size_t len, struct chat_template **out, char *err,
                        size_t errlen)
{
    *out = NULL;
    if (errlen)
        err[0] = 0;
    if (len > JINJA_MAX_SRC) {
        snprintf(err, errlen, "chat template: %zu bytes is over the %u-byte limit", len,
                 JINJA_MAX_SRC);
        return KVD_ETOOLARGE;
    }
    if (src == NULL && len)
        return KVD_EBADREQ;
    if (len && memchr(src, 0, len)) {
        snprintf(err, errlen, "chat template: holds a NUL byte");
        return KVD_EBADREQ;
    }
    struct chat_template *t = calloc(1, sizeof(*t));
    if (!t) {
        snprintf(err, errlen, "chat template: out of memory");
        return KVD_ENOMEM;
    }
    t->ctx.err = err;
    t->ctx.errlen = errlen;
    if (setjmp(t->ctx.jb)) {
        int code = t->ctx.code;
        jctx_free(&t->ctx);
        free(t);
        return code;
    }
    struct jtoken *toks;
    size_t ntok;
    jinja_lex(&t->ctx, src ? src : "", len, &toks, &ntok);
    jinja_parse(&t->ctx, toks, ntok, &t->prog);
    t->ctx.err = NULL;
    t->ctx.errlen = 0;
    *out = t;
    return 0;
}

void chat_template_free(struct chat_template *t)
{
    if (!t)
        return;
    jctx_free(&t->ctx);
    free(t);
}

static struct jval cstr(struct jctx *c, const char *s)
{
    if (!s)
        return jv_null();
    size_t n = strlen(s);
    return jv_str(jstrdup(c, s, n), n);
}

/* A JSON value as the reference sees one (its convertToRuntimeValues):
 * numbers with an integral value are integers (JavaScript has one number
 * type), objects keep their keys in the given order. Strings point into the
 * JSON, which outlives the render. */
static struct jval from_json(struct jctx *c, const json_t *v, int depth)
{
    if (depth > JINJA_MAX_DEPTH)
        jfail(c, KVD_ETOOLARGE, 0, "a message or tool nests deeper than %d levels",
              JINJA_MAX_DEPTH);
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        struct jmap *m = jmap_new(c);
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x)
        {
            jmap_append(c, m, k, strlen(k), from_json(c, x, depth + 1));
        }
        return jv_object(m, JV_OBJECT);
    }
    case JSON_ARRAY: {
        struct jlist *l = jlist_new(c, json_array_size(v));
        for (size_t i = 0; i < json_array_size(v); i++)
            jlist_push(c, l, from_json(c, json_array_get(v, i), depth + 1));
        return jv_array(l);
    }
    case JSON_STRING:
        return jv_str(json_string_value(v), json_string_length(v));
    case JSON_INTEGER:
        return jv_int((double)json_integer_value(v));
    case JSON_REAL: {
        double x = json_real_value(v);
        return isfinite(x) && x == floor(x) ? jv_int(x) : jv_float(x);
    }
    case JSON_TRUE:
        return jv_bool(true);
    case JSON_FALSE:
        return jv_bool(false);
    case JSON_NULL:
        break;
    }
    return jv_null();
}

/* The conversation: messages from msgs (role and content), or from JSON. */
struct conv {
    const struct chat_msg *msgs;
    size_t n_msgs;
    const json_t *messages, *tools;
};

static int render(const struct chat_template *t, const struct conv *cv, bool add_generation_prompt,
                  const char *bos_token, const char *eos_token, char **out, size_t *out_len,
                  char *err, size_t errlen)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if (errlen)
        err[0] = 0;
    struct jctx c = {.err = err, .errlen = errlen};
    struct jrt rt = {.c = &c,
                     .now = chat_template_fixed_now ? chat_template_fixed_now : time(NULL),
                     .deadline_ns = jdeadline_from_now()};
    if (setjmp(c.jb)) {
        int code = c.code;
        jctx_free(&c);
        return code;
    }
    struct jenv *g = jenv_new(&c, NULL);
    struct jval messages;
    if (cv->messages) {
        messages = from_json(&c, cv->messages, 0);
    } else {
        struct jlist *ml = jlist_new(&c, cv->n_msgs);
        for (size_t i = 0; i < cv->n_msgs; i++) {
            struct jmap *m = jmap_new(&c);
            jmap_set(&c, m, "role", 4, cstr(&c, cv->msgs[i].role));
            jmap_set(&c, m, "content", 7, cstr(&c, cv->msgs[i].content));
            jlist_push(&c, ml, jv_object(m, JV_OBJECT));
        }
        messages = jv_array(ml);
    }
    struct jfunc *fns = jalloc(&c, 3 * sizeof(*fns));
    memset(fns, 0, 3 * sizeof(*fns));
    fns[0].kind = JF_RAISE;
    fns[1].kind = JF_RANGE;
    fns[2].kind = JF_STRFTIME;
    jenv_set(&c, g, "false", jv_bool(false));
    jenv_set(&c, g, "true", jv_bool(true));
    jenv_set(&c, g, "none", jv_null());
    jenv_set(&c, g, "raise_exception", (struct jval){.t = JV_FUNC, .u.fn = &fns[0]});
    jenv_set(&c, g, "range", (struct jval){.t = JV_FUNC, .u.fn = &fns[1]});
    jenv_set(&c, g, "strftime_now", (struct jval){.t = JV_FUNC, .u.fn = &fns[2]});
    jenv_set(&c, g, "True", jv_bool(true));
    jenv_set(&c, g, "False", jv_bool(false));
    jenv_set(&c, g, "None", jv_null());
    jenv_set(&c, g, "messages", messages);
    if (cv->tools)
        jenv_set(&c, g, "tools", from_json(&c, cv->tools, 0));
    jenv_set(&c, g, "add_generation_prompt", jv_bool(add_generation_prompt));
    jenv_set(&c, g, "bos_token", cstr(&c, bos_token ? bos_token : ""));
    jenv_set(&c, g, "eos_token", cstr(&c, eos_token ? eos_token : ""));

    struct jbuf b = {0};
    jinja_render(&rt, &t->prog, g, &b);
    char *res = malloc(b.n + 1);
    if (!res)
        jfail(&c, KVD_ENOMEM, 0, "out of memory");
    if (b.n)
        memcpy(res, b.p, b.n);
    res[b.n] = 0;
    *out = res;
    if (out_len)
        *out_len = b.n;
    jctx_free(&c);
    return 0;
}

int chat_template_render(const struct chat_template *t, const struct chat_msg *msgs, size_t n_msgs,
                         bool add_generation_prompt, const char *bos_token, const char *eos_token,
                         char **out, size_t *out_len, char *err, size_t errlen)
{
    struct conv cv = {.msgs = msgs, .n_msgs = n_msgs};
    return render(t, &cv, add_generation_prompt, bos_token, eos_token, out, out_len, err, errlen);
}

int chat_template_render_json(const struct chat_template *t, const json_t *messages,
                              const json_t *tools, bool add_generation_prompt,
                              const char *bos_token, const char *eos_token, char **out,
                              size_t *out_len, char *err, size_t errlen)
{
    struct conv cv = {.messages = messages, .tools = tools};
    if (!json_is_array(messages)) {
        *out = NULL;
        snprintf(err, errlen, "chat template: the messages must be an array");
        return KVD_EBADREQ;
    }
    return render(t, &cv, add_generation_prompt, bos_token, eos_token, out, out_len, err, errlen);
}
