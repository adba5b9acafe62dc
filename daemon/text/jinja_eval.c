/* Jinja interpreter: walks the syntax tree like the reference renderer
 * (scopes, for loops with loop.*, break/continue that drop the iteration's
 * partial output, set with namespaces, macros, the binary operators with
 * JavaScript semantics). Recursion depth, evaluated nodes and output are
 * bounded; errors leave through jfail. */
#include "jinja.h"

#include <math.h>
#include <string.h>

#include "kvd/status.h"

enum flow { FLOW_NEXT, FLOW_BREAK, FLOW_CONTINUE };

static enum flow render_block(struct jrt *rt, struct jnode **st, size_t n, struct jenv *env,
                              struct jbuf *out);

struct jenv *jenv_new(struct jctx *c, struct jenv *parent)
{
    struct jenv *e = jalloc(c, sizeof(*e));
    memset(e, 0, sizeof(*e));
    e->parent = parent;
    return e;
}

void jenv_set(struct jctx *c, struct jenv *e, const char *name, struct jval v)
{
    jmap_set(c, &e->vars, name, strlen(name), v);
}

static struct jval func_val(struct jrt *rt, enum jfn kind)
{
    struct jfunc *f = jalloc(rt->c, sizeof(*f));
    memset(f, 0, sizeof(*f));
    f->kind = kind;
    struct jval v = {.t = JV_FUNC, .u.fn = f};
    return v;
}

static struct jval lookup(struct jrt *rt, struct jenv *e, const char *name, size_t n)
{
    for (; e; e = e->parent) {
        struct jval *v = jmap_get(&e->vars, name, n);
        if (v)
            return *v;
        /* every scope of the reference starts with its own `namespace` */
        if (n == 9 && memcmp(name, "namespace", 9) == 0)
            return func_val(rt, JF_NAMESPACE);
    }
    return jv_undef();
}

static void step(struct jrt *rt, int line)
{
    if (++rt->steps > JINJA_MAX_STEPS)
        jfail(rt->c, KVD_ETOOLARGE, line, "rendering takes more than %u steps", JINJA_MAX_STEPS);
    if ((rt->steps & 1023) == 0)
        jdeadline(rt, line);
}

static struct jval str_from_buf(struct jbuf *b)
{
    return jv_str(b->p ? b->p : "", b->n);
}

static struct jval concat(struct jrt *rt, int line, struct jval a, struct jval b, bool undef_empty)
{
    struct jbuf buf = {0};
    if (!(undef_empty && a.t == JV_UNDEF))
        jv_raw_string(rt, line, a, &buf);
    if (!(undef_empty && b.t == JV_UNDEF))
        jv_raw_string(rt, line, b, &buf);
    return str_from_buf(&buf);
}

static bool is_num(struct jval v)
{
    return v.t == JV_INT || v.t == JV_FLOAT;
}

static bool contains(const char *h, size_t hn, const char *n, size_t nn)
{
    if (nn == 0)
        return true;
    if (nn > hn)
        return false;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == n[0] && memcmp(h + i, n, nn) == 0)
            return true;
    return false;
}

static _Noreturn void bad_op(struct jrt *rt, int line, const char *op, struct jval a, struct jval b)
{
    jfail(rt->c, KVD_EBADREQ, line, "unknown operator \"%s\" between %s and %s", op,
          jtype_name(a.t), jtype_name(b.t));
}

static const char *op_text(enum jop op)
{
    static const char *const t[] = {"",  "and", "or", "not", "in", "not in", "==", "!=",
                                    "<", ">",   "<=", ">=",  "+",  "-",      "~",  "*",
                                    "/", "//",  "%",  "**",  "-",  "+"};
    return t[op];
}

static struct jval eval_binary(struct jrt *rt, const struct jnode *n, struct jenv *env)
{
    struct jval a = jinja_eval(rt, n->a, env);
    if (n->op == JO_AND)
        return jv_truthy(a) ? jinja_eval(rt, n->b, env) : a;
    if (n->op == JO_OR)
        return jv_truthy(a) ? a : jinja_eval(rt, n->b, env);
    struct jval b = jinja_eval(rt, n->b, env);
    enum jop op = n->op;
    if (op == JO_EQ)
        return jv_bool(jv_loose_eq(rt, n->line, a, b));
    if (op == JO_NE)
        return jv_bool(!jv_loose_eq(rt, n->line, a, b));
    if (is_num(a) && is_num(b) && op != JO_CONCAT && op != JO_POW) {
        double x = a.u.num, y = b.u.num, r;
        bool fl = a.t == JV_FLOAT || b.t == JV_FLOAT;
        switch (op) {
        case JO_ADD:
            r = x + y;
            return fl ? jv_float(r) : jv_int(r);
        case JO_SUB:
            r = x - y;
            return fl ? jv_float(r) : jv_int(r);
        case JO_MUL:
            r = x * y;
            return fl ? jv_float(r) : jv_int(r);
        case JO_DIV:
            return jv_float(x / y);
        case JO_FLOORDIV:
            r = floor(x / y);
            return fl ? jv_float(r) : jv_int(r);
        case JO_MOD:
            r = fmod(x, y);
            return fl ? jv_float(r) : jv_int(r);
        case JO_LT:
            return jv_bool(x < y);
        case JO_GT:
            return jv_bool(x > y);
        case JO_GE:
            return jv_bool(x >= y);
        case JO_LE:
            return jv_bool(x <= y);
        default:
            break;
        }
    } else if (a.t == JV_UNDEF || b.t == JV_UNDEF) {
        if (b.t == JV_UNDEF && (op == JO_IN || op == JO_NOT_IN))
            return jv_bool(op == JO_NOT_IN);
        if (op == JO_CONCAT && a.t != JV_NULL && b.t != JV_NULL)
            return concat(rt, n->line, a, b, true);
        jfail(rt->c, KVD_EBADREQ, n->line, "cannot perform operation %s on undefined values",
              op_text(op));
    } else if (a.t == JV_NULL || b.t == JV_NULL) {
        jfail(rt->c, KVD_EBADREQ, n->line, "cannot perform operation %s on null values",
              op_text(op));
    } else if (op == JO_CONCAT) {
        return concat(rt, n->line, a, b, false);
    } else if (op == JO_POW && (is_num(a) || a.t == JV_BOOL) && (is_num(b) || b.t == JV_BOOL)) {
        double x = a.t == JV_BOOL ? a.u.b : a.u.num, y = b.t == JV_BOOL ? b.u.b : b.u.num;
        if (x == 0 && y < 0)
            jfail(rt->c, KVD_EBADREQ, n->line, "0.0 cannot be raised to a negative power");
        double r = pow(x, y);
        if (!isfinite(r))
            jfail(rt->c, KVD_EBADREQ, n->line, "exponentiation result is not a finite number");
        return (a.t == JV_FLOAT || b.t == JV_FLOAT || y < 0) ? jv_float(r) : jv_int(r);
    } else if ((a.t == JV_ARRAY || a.t == JV_TUPLE) && (b.t == JV_ARRAY || b.t == JV_TUPLE)) {
        if (op == JO_ADD) {
            struct jlist *l = jlist_new(rt->c, a.u.arr->n + b.u.arr->n);
            for (size_t i = 0; i < a.u.arr->n; i++)
                jlist_push(rt->c, l, a.u.arr->v[i]);
            for (size_t i = 0; i < b.u.arr->n; i++)
                jlist_push(rt->c, l, b.u.arr->v[i]);
            return jv_array(l);
        }
    } else if (b.t == JV_ARRAY || b.t == JV_TUPLE) {
        if (op == JO_IN || op == JO_NOT_IN) {
            bool found = false;
            for (size_t i = 0; i < b.u.arr->n && !found; i++)
                found = jv_strict_eq(b.u.arr->v[i], a);
            return jv_bool(found == (op == JO_IN));
        }
    }
    if ((a.t == JV_STR || b.t == JV_STR) && op == JO_ADD)
        return concat(rt, n->line, a, b, false);
    if (a.t == JV_STR && b.t == JV_STR && (op == JO_IN || op == JO_NOT_IN)) {
        jwork(rt, n->line, b.u.s.n);
        return jv_bool(contains(b.u.s.p, b.u.s.n, a.u.s.p, a.u.s.n) == (op == JO_IN));
    }
    if (a.t == JV_STR && (b.t == JV_OBJECT || b.t == JV_KWARGS) && (op == JO_IN || op == JO_NOT_IN))
        return jv_bool((jmap_get(b.u.map, a.u.s.p, a.u.s.n) != NULL) == (op == JO_IN));
    bad_op(rt, n->line, op_text(op), a, b);
}

size_t jinja_eval_args(struct jrt *rt, struct jnode **args, size_t n, struct jenv *env,
                       struct jval **out)
{
    struct jval *v = jalloc(rt->c, (n + 1) * sizeof(*v));
    size_t k = 0;
    struct jmap *kw = NULL;
    for (size_t i = 0; i < n; i++)
        if (args[i]->kind != JN_KWARG)
            v[k++] = jinja_eval(rt, args[i], env);
    for (size_t i = 0; i < n; i++)
        if (args[i]->kind == JN_KWARG) {
            if (!kw)
                kw = jmap_new(rt->c);
            if (jmap_get(kw, args[i]->s, args[i]->n))
                jfail(rt->c, KVD_EBADREQ, args[i]->line,
                      "got multiple values for keyword argument '%s'", args[i]->s);
            jmap_set(rt->c, kw, args[i]->s, args[i]->n, jinja_eval(rt, args[i]->a, env));
        }
    if (kw)
        v[k++] = jv_object(kw, JV_KWARGS);
    *out = v;
    return k;
}

/* Python-style slice indices, as the reference's slice(). */
static void slice_range(long len, const struct jval *st, const struct jval *sp, long step,
                        long *start, long *stop)
{
    if (step > 0) {
        long s = st ? (long)st->u.num : 0, e = sp ? (long)sp->u.num : len;
        *start = s < 0 ? (len + s > 0 ? len + s : 0) : (s < len ? s : len);
        *stop = e < 0 ? (len + e > 0 ? len + e : 0) : (e < len ? e : len);
    } else {
        long s = st ? (long)st->u.num : len - 1, e = sp ? (long)sp->u.num : -1;
        *start = s < 0 ? (len + s > -1 ? len + s : -1) : (s < len - 1 ? s : len - 1);
        *stop = e < -1 ? (len + e > -1 ? len + e : -1) : (e < len - 1 ? e : len - 1);
    }
}

static struct jval eval_slice(struct jrt *rt, const struct jnode *sl, struct jval obj,
                              struct jenv *env)
{
    if (obj.t != JV_ARRAY && obj.t != JV_TUPLE && obj.t != JV_STR)
        jfail(rt->c, KVD_EBADREQ, sl->line, "slice object must be an array or string");
    jwork(rt, sl->line, obj.t == JV_STR ? obj.u.s.n : obj.u.arr->n);
    struct jval v[3];
    const struct jnode *parts[3] = {sl->a, sl->b, sl->c};
    for (int i = 0; i < 3; i++) {
        v[i] = parts[i] ? jinja_eval(rt, parts[i], env) : jv_undef();
        if (v[i].t != JV_INT && v[i].t != JV_UNDEF)
            jfail(rt->c, KVD_EBADREQ, sl->line, "slice indices must be integers");
        if (v[i].t == JV_INT && (fabs(v[i].u.num) > 1e15 || v[i].u.num != trunc(v[i].u.num)))
            jfail(rt->c, KVD_EUNSUPPORTED, sl->line, "a slice index this large is not supported");
    }
    long step = v[2].t == JV_INT ? (long)v[2].u.num : 1;
    if (step == 0)
        jfail(rt->c, KVD_EUNSUPPORTED, sl->line, "a slice step of 0 is not supported");
    const struct jval *st = v[0].t == JV_INT ? &v[0] : NULL, *sp = v[1].t == JV_INT ? &v[1] : NULL;
    if (obj.t == JV_STR) {
        /* by code points (Array.from) */
        size_t ncp = 0, i = 0;
        while (i < obj.u.s.n) {
            u8_next(obj.u.s.p, obj.u.s.n, &i);
            ncp++;
        }
        size_t *off = jalloc(rt->c, (ncp + 1) * sizeof(size_t));
        ncp = 0;
        i = 0;
        while (i < obj.u.s.n) {
            off[ncp++] = i;
            u8_next(obj.u.s.p, obj.u.s.n, &i);
        }
        off[ncp] = obj.u.s.n;
        long start, stop;
        slice_range((long)ncp, st, sp, step, &start, &stop);
        struct jbuf b = {0};
        for (long k = start; step > 0 ? k < stop : k > stop; k += step)
            jbuf_put(rt, &b, obj.u.s.p + off[k], off[k + 1] - off[k]);
        return str_from_buf(&b);
    }
    struct jlist *src = obj.u.arr;
    long start, stop;
    slice_range((long)src->n, st, sp, step, &start, &stop);
    struct jlist *l = jlist_new(rt->c, 0);
    for (long k = start; step > 0 ? k < stop : k > stop; k += step)
        jlist_push(rt->c, l, src->v[k]);
    return jv_array(l);
}

static struct jval eval_member(struct jrt *rt, const struct jnode *n, struct jenv *env)
{
    struct jval obj = jinja_eval(rt, n->a, env);
    struct jval prop;
    if (n->flag) {
        if (n->b->kind == JN_SLICE)
            return eval_slice(rt, n->b, obj, env);
        prop = jinja_eval(rt, n->b, env);
    } else if (n->b->kind == JN_INT) {
        prop = jv_int(n->b->num);
    } else {
        prop = jv_str(n->b->s, n->b->n);
    }
    return jinja_member(rt, n->line, obj, prop);
}

static struct jval call_macro(struct jrt *rt, int line, struct jfunc *fn, struct jval *args,
                              size_t nargs)
{
    const struct jnode *m = fn->macro;
    struct jenv *scope = jenv_new(rt->c, fn->env);
    struct jmap *kw = NULL;
    if (nargs && args[nargs - 1].t == JV_KWARGS)
        kw = args[--nargs].u.map;
    if (nargs > m->nlist)
        jfail(rt->c, KVD_EBADREQ, line, "macro '%s' takes not more than %zu argument(s)", m->s,
              m->nlist);
    size_t used_kw = 0;
    for (size_t i = 0; i < m->nlist; i++) {
        const struct jnode *p = m->list[i];
        struct jval v = jv_undef();
        bool have = false;
        if (i < nargs) {
            v = args[i];
            have = true;
        } else if (kw) {
            struct jval *k = jmap_get(kw, p->s, p->n);
            if (k) {
                v = *k;
                have = true;
                used_kw++;
            }
        }
        jmap_set(rt->c, &scope->vars, p->s, p->n, v);
        (void)have;
    }
    if (kw && used_kw < kw->n)
        for (size_t j = 0; j < kw->n; j++) {
            bool found = false;
            for (size_t i = nargs; i < m->nlist && !found; i++)
                found =
                    m->list[i]->n == kw->kn[j] && memcmp(m->list[i]->s, kw->kp[j], kw->kn[j]) == 0;
            if (!found)
                jfail(rt->c, KVD_EBADREQ, line, "macro '%s' takes no keyword argument '%.*s'", m->s,
                      (int)kw->kn[j], kw->kp[j]);
        }
    /* defaults, evaluated in the macro's scope after every name is bound */
    for (size_t i = 0; i < m->nlist; i++) {
        const struct jnode *p = m->list[i];
        if (p->kind != JN_KWARG || i < nargs || (kw && jmap_get(kw, p->s, p->n)))
            continue;
        jmap_set(rt->c, &scope->vars, p->s, p->n, jinja_eval(rt, p->a, scope));
    }
    struct jbuf out = {0};
    enum flow f = render_block(rt, m->list2, m->nlist2, scope, &out);
    if (f != FLOW_NEXT)
        jfail(rt->c, KVD_EBADREQ, line, "break or continue outside a loop");
    return str_from_buf(&out);
}

static struct jval eval_call(struct jrt *rt, const struct jnode *n, struct jenv *env)
{
    struct jval *args;
    size_t nargs = jinja_eval_args(rt, n->list, n->nlist, env, &args);
    struct jval fn = jinja_eval(rt, n->a, env);
    if (fn.t != JV_FUNC) {
        if (n->a->kind == JN_IDENT && fn.t == JV_UNDEF)
            jfail(rt->c, KVD_EBADREQ, n->line, "'%s' is undefined, it cannot be called", n->a->s);
        jfail(rt->c, KVD_EBADREQ, n->line, "cannot call something that is not a function: got %s",
              jtype_name(fn.t));
    }
    if (fn.u.fn->kind == JF_MACRO)
        return call_macro(rt, n->line, fn.u.fn, args, nargs);
    return jinja_call_builtin(rt, n->line, fn.u.fn, args, nargs);
}

struct jval jinja_eval(struct jrt *rt, const struct jnode *n, struct jenv *env)
{
    if (!n)
        return jv_undef();
    step(rt, n->line);
    if (++rt->depth > JINJA_MAX_DEPTH)
        jfail(rt->c, KVD_ETOOLARGE, n->line, "rendering nests deeper than %d levels",
              JINJA_MAX_DEPTH);
    struct jval r;
    switch (n->kind) {
    case JN_IDENT:
        r = lookup(rt, env, n->s, n->n);
        break;
    case JN_INT:
        r = jv_int(n->num);
        break;
    case JN_FLOAT:
        r = jv_float(n->num);
        break;
    case JN_STR:
        r = jv_str(n->s, n->n);
        break;
    case JN_BINARY:
        r = eval_binary(rt, n, env);
        break;
    case JN_MEMBER:
        r = eval_member(rt, n, env);
        break;
    case JN_CALL:
        r = eval_call(rt, n, env);
        break;
    case JN_FILTER:
        r = jinja_filter(rt, n, jinja_eval(rt, n->a, env), env);
        break;
    case JN_TEST:
        r = jv_bool(jinja_test(rt, n, jinja_eval(rt, n->a, env)) != n->flag);
        break;
    case JN_TERNARY:
        r = jv_truthy(jinja_eval(rt, n->a, env)) ? jinja_eval(rt, n->b, env)
                                                 : jinja_eval(rt, n->c, env);
        break;
    case JN_SELECT:
        r = jv_truthy(jinja_eval(rt, n->b, env)) ? jinja_eval(rt, n->a, env) : jv_undef();
        break;
    case JN_UNARY: {
        struct jval a = jinja_eval(rt, n->a, env);
        if (n->op == JO_NOT) {
            r = jv_bool(!jv_truthy(a));
        } else if (is_num(a) || a.t == JV_BOOL) {
            double x = a.t == JV_BOOL ? a.u.b : a.u.num;
            double s = n->op == JO_NEG ? -x : x;
            r = a.t == JV_FLOAT ? jv_float(s) : jv_int(s);
        } else {
            jfail(rt->c, KVD_EBADREQ, n->line, "unknown operator \"%s\" for %s", op_text(n->op),
                  jtype_name(a.t));
        }
        break;
    }
    case JN_ARRAY:
    case JN_TUPLE: {
        struct jlist *l = jlist_new(rt->c, n->nlist);
        for (size_t i = 0; i < n->nlist; i++)
            jlist_push(rt->c, l, jinja_eval(rt, n->list[i], env));
        r = jv_array(l);
        r.t = n->kind == JN_TUPLE ? JV_TUPLE : JV_ARRAY;
        break;
    }
    case JN_OBJECT: {
        struct jmap *m = jmap_new(rt->c);
        for (size_t i = 0; i < n->nlist; i++) {
            struct jval k = jinja_eval(rt, n->list[i], env);
            if (k.t != JV_STR)
                jfail(rt->c, KVD_EBADREQ, n->line, "object keys must be strings: got %s",
                      jtype_name(k.t));
            jmap_set(rt->c, m, k.u.s.p, k.u.s.n, jinja_eval(rt, n->list2[i], env));
        }
        r = jv_object(m, JV_OBJECT);
        break;
    }
    case JN_IF:
    case JN_FOR:
    case JN_SET:
    case JN_MACRO:
    case JN_COMMENT:
    case JN_BREAK:
    case JN_CONTINUE: {
        /* a statement as a value: render it alone */
        struct jbuf b = {0};
        struct jnode *one = (struct jnode *)n;
        if (render_block(rt, &one, 1, env, &b) != FLOW_NEXT)
            jfail(rt->c, KVD_EBADREQ, n->line, "break or continue outside a loop");
        r = str_from_buf(&b);
        break;
    }
    default:
        jfail(rt->c, KVD_EUNSUPPORTED, n->line, "this expression is not supported here");
    }
    rt->depth--;
    return r;
}

static void bind_loop_var(struct jrt *rt, const struct jnode *var, struct jval item,
                          struct jenv *scope)
{
    if (var->kind == JN_IDENT) {
        jmap_set(rt->c, &scope->vars, var->s, var->n, item);
        return;
    }
    for (size_t j = 0; j < var->nlist; j++) {
        if (var->list[j]->kind != JN_IDENT)
            jfail(rt->c, KVD_EBADREQ, var->line, "cannot unpack into a non-identifier");
        jmap_set(rt->c, &scope->vars, var->list[j]->s, var->list[j]->n, item.u.arr->v[j]);
    }
}

static void render_for(struct jrt *rt, const struct jnode *n, struct jenv *env, struct jbuf *out)
{
    struct jenv *scope = jenv_new(rt->c, env);
    const struct jnode *test = NULL;
    struct jval it;
    if (n->b->kind == JN_SELECT) {
        it = jinja_eval(rt, n->b->a, scope);
        test = n->b->b;
    } else {
        it = jinja_eval(rt, n->b, scope);
    }
    struct jlist *cand;
    if (it.t == JV_ARRAY || it.t == JV_TUPLE) {
        cand = it.u.arr;
    } else if (it.t == JV_OBJECT || it.t == JV_KWARGS) {
        cand = jlist_new(rt->c, it.u.map->n);
        for (size_t i = 0; i < it.u.map->n; i++)
            jlist_push(rt->c, cand, jv_str(it.u.map->kp[i], it.u.map->kn[i]));
    } else {
        jfail(rt->c, KVD_EBADREQ, n->line, "expected iterable or object type in for loop: got %s",
              jtype_name(it.t));
    }
    const struct jnode *var = n->a;
    struct jlist *items = jlist_new(rt->c, cand->n);
    for (size_t i = 0; i < cand->n; i++) {
        struct jval cur = cand->v[i];
        if (var->kind == JN_TUPLE) {
            if (cur.t != JV_ARRAY)
                jfail(rt->c, KVD_EBADREQ, n->line, "cannot unpack non-iterable type: %s",
                      jtype_name(cur.t));
            if (cur.u.arr->n != var->nlist)
                jfail(rt->c, KVD_EBADREQ, n->line, "too %s items to unpack",
                      var->nlist > cur.u.arr->n ? "few" : "many");
        }
        if (test) {
            struct jenv *ls = jenv_new(rt->c, scope);
            bind_loop_var(rt, var, cur, ls);
            if (!jv_truthy(jinja_eval(rt, test, ls)))
                continue;
        }
        jlist_push(rt->c, items, cur);
    }
    bool none = true;
    for (size_t i = 0; i < items->n; i++) {
        step(rt, n->line);
        struct jmap *loop = jmap_new(rt->c);
        double len = (double)items->n, k = (double)i;
        jmap_set(rt->c, loop, "index", 5, jv_int(k + 1));
        jmap_set(rt->c, loop, "index0", 6, jv_int(k));
        jmap_set(rt->c, loop, "revindex", 8, jv_int(len - k));
        jmap_set(rt->c, loop, "revindex0", 9, jv_int(len - k - 1));
        jmap_set(rt->c, loop, "first", 5, jv_bool(i == 0));
        jmap_set(rt->c, loop, "last", 4, jv_bool(i + 1 == items->n));
        jmap_set(rt->c, loop, "length", 6, jv_int(len));
        jmap_set(rt->c, loop, "previtem", 8, i > 0 ? items->v[i - 1] : jv_undef());
        jmap_set(rt->c, loop, "nextitem", 8, i + 1 < items->n ? items->v[i + 1] : jv_undef());
        jmap_set(rt->c, &scope->vars, "loop", 4, jv_object(loop, JV_OBJECT));
        bind_loop_var(rt, var, items->v[i], scope);
        size_t mark = out->n;
        enum flow f = render_block(rt, n->list, n->nlist, scope, out);
        if (f != FLOW_NEXT) {
            /* the reference loses the partial output of this iteration */
            out->n = mark;
            if (out->p)
                out->p[mark] = 0;
            if (f == FLOW_BREAK)
                break;
            continue;
        }
        none = false;
    }
    if (none && render_block(rt, n->list2, n->nlist2, scope, out) != FLOW_NEXT)
        jfail(rt->c, KVD_EBADREQ, n->line, "break or continue outside a loop");
}

static void exec_set(struct jrt *rt, const struct jnode *n, struct jenv *env)
{
    struct jval rhs;
    if (n->b) {
        rhs = jinja_eval(rt, n->b, env);
    } else {
        struct jbuf b = {0};
        if (render_block(rt, n->list, n->nlist, env, &b) != FLOW_NEXT)
            jfail(rt->c, KVD_EBADREQ, n->line, "break or continue inside a set block");
        rhs = str_from_buf(&b);
    }
    const struct jnode *a = n->a;
    if (a->kind == JN_IDENT) {
        jmap_set(rt->c, &env->vars, a->s, a->n, rhs);
    } else if (a->kind == JN_TUPLE) {
        if (rhs.t != JV_ARRAY && rhs.t != JV_TUPLE)
            jfail(rt->c, KVD_EBADREQ, n->line, "cannot unpack non-iterable type in set: %s",
                  jtype_name(rhs.t));
        if (rhs.u.arr->n != a->nlist)
            jfail(rt->c, KVD_EBADREQ, n->line, "too %s items to unpack in set",
                  a->nlist > rhs.u.arr->n ? "few" : "many");
        for (size_t i = 0; i < a->nlist; i++) {
            if (a->list[i]->kind != JN_IDENT)
                jfail(rt->c, KVD_EBADREQ, n->line, "cannot unpack to a non-identifier in set");
            jmap_set(rt->c, &env->vars, a->list[i]->s, a->list[i]->n, rhs.u.arr->v[i]);
        }
    } else if (a->kind == JN_MEMBER) {
        struct jval obj = jinja_eval(rt, a->a, env);
        if (obj.t != JV_NS)
            jfail(rt->c, KVD_EBADREQ, n->line, "cannot assign attribute on non-namespace object");
        if (a->flag || a->b->kind != JN_IDENT)
            jfail(rt->c, KVD_EBADREQ, n->line,
                  "cannot assign to member with non-identifier property");
        jmap_set(rt->c, obj.u.map, a->b->s, a->b->n, rhs);
    } else {
        jfail(rt->c, KVD_EBADREQ, n->line, "invalid left-hand side of an assignment");
    }
}

static enum flow render_block(struct jrt *rt, struct jnode **st, size_t n, struct jenv *env,
                              struct jbuf *out)
{
    if (++rt->depth > JINJA_MAX_DEPTH)
        jfail(rt->c, KVD_ETOOLARGE, n ? st[0]->line : 0, "rendering nests deeper than %d levels",
              JINJA_MAX_DEPTH);
    enum flow f = FLOW_NEXT;
    for (size_t i = 0; i < n && f == FLOW_NEXT; i++) {
        const struct jnode *s = st[i];
        step(rt, s->line);
        switch (s->kind) {
        case JN_STR:
            jbuf_put(rt, out, s->s, s->n);
            break;
        case JN_IF:
            if (jv_truthy(jinja_eval(rt, s->a, env)))
                f = render_block(rt, s->list, s->nlist, env, out);
            else
                f = render_block(rt, s->list2, s->nlist2, env, out);
            break;
        case JN_FOR:
            render_for(rt, s, env, out);
            break;
        case JN_SET:
            exec_set(rt, s, env);
            break;
        case JN_COMMENT:
            break;
        case JN_BREAK:
            f = FLOW_BREAK;
            break;
        case JN_CONTINUE:
            f = FLOW_CONTINUE;
            break;
        case JN_MACRO: {
            struct jval fn = func_val(rt, JF_MACRO);
            fn.u.fn->macro = s;
            fn.u.fn->env = env;
            jmap_set(rt->c, &env->vars, s->s, s->n, fn);
            break;
        }
        default: {
            struct jval v = jinja_eval(rt, s, env);
            if (v.t != JV_NULL && v.t != JV_UNDEF)
                jv_to_string(rt, s->line, v, out);
        }
        }
    }
    rt->depth--;
    return f;
}

void jinja_render(struct jrt *rt, const struct jprog *prog, struct jenv *env, struct jbuf *out)
{
    if (render_block(rt, prog->body, prog->n, env, out) != FLOW_NEXT)
        jfail(rt->c, KVD_EBADREQ, 0, "break or continue outside a loop");
}
