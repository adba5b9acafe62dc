/* tool_args (see tool_args.h): the tool-call fields of a request, checked
 * and normalized. */
#include "tool_args.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/protocol.h"

static int bad(struct kvd_error *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad(struct kvd_error *e, const char *param, const char *fmt, ...)
{
    va_list ap;
    e->code = KVD_EBADREQ;
    snprintf(e->param, sizeof(e->param), "%s", param);
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return -1;
}

static int no_memory(struct kvd_error *e)
{
    kvd_error_set(e, KVD_ENOMEM, "out of memory");
    return -1;
}

/* OpenAI's function names: 1 to 64 of [a-zA-Z0-9_-]. */
static bool name_ok(const char *s, size_t n)
{
    if (n == 0 || n > TOOL_MAX_NAME)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
              (s[i] >= '0' && s[i] <= '9') || s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

static const char *fn_name(const json_t *tool)
{
    return json_string_value(json_object_get(json_object_get(tool, "function"), "name"));
}

int tool_args_tools(const json_t *t, json_t **out, struct kvd_error *e)
{
    *out = NULL;
    if (!t || json_is_null(t))
        return 0;
    if (!json_is_array(t))
        return bad(e, "tools", "'tools' must be an array of {type: \"function\", function}");
    if (json_array_size(t) > TOOL_MAX_TOOLS)
        return bad(e, "tools", "'tools' has %zu entries, at most %d", json_array_size(t),
                   TOOL_MAX_TOOLS);
    if (json_array_size(t) == 0)
        return 0;
    json_t *list = json_array();
    if (!list)
        return no_memory(e);
    size_t i;
    json_t *x;
    json_array_foreach(t, i, x)
    {
        json_t *type = json_object_get(x, "type"), *fn = json_object_get(x, "function");
        json_t *name = json_object_get(fn, "name"), *desc = json_object_get(fn, "description");
        json_t *params = json_object_get(fn, "parameters"), *strict = json_object_get(fn, "strict");
        int rc = 0;
        if (!json_is_object(x) || !json_is_string(type))
            rc = bad(e, "tools", "'tools'[%zu] must be an object {type, function}", i);
        else if (strcmp(json_string_value(type), "function")) {
            rc =
                bad(e, "tools", "not supported: tools other than functions ('tools'[%zu].type)", i);
            e->code = KVD_EUNSUPPORTED;
        } else if (!json_is_object(fn))
            rc = bad(e, "tools",
                     "'tools'[%zu].function must be an object {name, description, "
                     "parameters}",
                     i);
        else if (!json_is_string(name) ||
                 !name_ok(json_string_value(name), json_string_length(name)))
            rc = bad(e, "tools",
                     "'tools'[%zu].function.name must be 1 to %d letters, digits, '_' or '-'", i,
                     TOOL_MAX_NAME);
        else if (desc && !json_is_null(desc) && !json_is_string(desc))
            rc = bad(e, "tools", "'tools'[%zu].function.description must be a string", i);
        else if (params && !json_is_null(params) && !json_is_object(params))
            rc = bad(e, "tools",
                     "'tools'[%zu].function.parameters must be an object (a JSON Schema)", i);
        else if (strict && !json_is_null(strict) && !json_is_boolean(strict))
            rc = bad(e, "tools", "'tools'[%zu].function.strict must be true or false", i);
        for (size_t k = 0; !rc && k < i; k++)
            if (!strcmp(fn_name(json_array_get(list, k)), json_string_value(name)))
                rc = bad(e, "tools", "'tools': the function '%s' is given twice",
                         json_string_value(name));
        json_t *f = rc ? NULL : json_pack("{s:O}", "name", name);
        if (f && json_is_string(desc) && json_object_set(f, "description", desc))
            rc = no_memory(e);
        if (f && json_is_object(params) && json_object_set(f, "parameters", params))
            rc = no_memory(e);
        json_t *one = f && !rc ? json_pack("{s:s, s:O}", "type", "function", "function", f) : NULL;
        json_decref(f);
        if (!rc && (!one || json_array_append_new(list, one)))
            rc = no_memory(e);
        if (rc) {
            json_decref(list);
            return -1;
        }
    }
    *out = list;
    return 0;
}

int tool_args_choice(const json_t *tc, const json_t *tools, enum tool_choice *c, const char **name,
                     struct kvd_error *e)
{
    *c = TOOL_CHOICE_AUTO;
    *name = NULL;
    if (!tc || json_is_null(tc))
        return 0;
    const char *s = json_string_value(tc);
    json_t *fn = json_object_get(tc, "function");
    const char *type = json_string_value(json_object_get(tc, "type"));
    if (s && !strcmp(s, "none"))
        *c = TOOL_CHOICE_NONE;
    else if (s && !strcmp(s, "auto"))
        *c = TOOL_CHOICE_AUTO;
    else if (s && !strcmp(s, "required"))
        *c = TOOL_CHOICE_REQUIRED;
    else if (type && !strcmp(type, "function") && json_is_string(json_object_get(fn, "name"))) {
        *c = TOOL_CHOICE_NAMED;
        *name = json_string_value(json_object_get(fn, "name"));
    } else {
        return bad(e, "tool_choice",
                   "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}");
    }
    if (!tools && (*c == TOOL_CHOICE_REQUIRED || *c == TOOL_CHOICE_NAMED))
        return bad(e, "tool_choice", "'tool_choice' %s needs 'tools'",
                   *c == TOOL_CHOICE_NAMED ? "naming a function" : "required");
    if (*c == TOOL_CHOICE_NAMED) {
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t)
        {
            if (!strcmp(fn_name(t), *name))
                return 0;
        }
        return bad(e, "tool_choice", "'tool_choice' names '%.64s', which 'tools' does not have",
                   *name);
    }
    return 0;
}

int tool_args_message(const json_t *msg, size_t i, json_t *c, bool *has, struct kvd_error *e)
{
    json_t *calls = json_object_get(msg, "tool_calls");
    if (calls && !json_is_null(calls)) {
        if (!json_is_array(calls) || json_array_size(calls) > KVD_MAX_ARRAY)
            return bad(e, "messages", "'messages'[%zu].tool_calls must be an array of calls", i);
        json_t *list = json_array();
        if (!list || json_object_set_new(c, "tool_calls", list))
            return no_memory(e);
        size_t k;
        json_t *call;
        json_array_foreach(calls, k, call)
        {
            json_t *id = json_object_get(call, "id"), *type = json_object_get(call, "type");
            json_t *fn = json_object_get(call, "function");
            json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
            if (!json_is_object(call) || !json_is_string(id) || !json_is_object(fn) ||
                !json_is_string(name) || !json_string_length(name) ||
                (args && !json_is_null(args) && !json_is_string(args) && !json_is_object(args)) ||
                (type && !json_is_null(type) &&
                 (!json_is_string(type) || strcmp(json_string_value(type), "function"))))
                return bad(e, "messages",
                           "'messages'[%zu].tool_calls[%zu] must be {id, type: \"function\", "
                           "function: {name, arguments}} with strings",
                           i, k);
            /* arguments are JSON text, as OpenAI sends them */
            json_t *av;
            if (json_is_string(args)) {
                av = json_incref(args);
            } else {
                char *text = json_is_object(args) ? json_dumps(args, JSON_COMPACT) : NULL;
                av = json_string(text ? text : "{}");
                free(text);
            }
            json_t *one = json_pack("{s:O, s:s, s:{s:O, s:o}}", "id", id, "type", "function",
                                    "function", "name", name, "arguments", av);
            if (!one || json_array_append_new(list, one))
                return no_memory(e);
        }
        *has = true;
    }
    static const char *const keys[] = {"tool_call_id", "name"};
    for (int k = 0; k < 2; k++) {
        json_t *v = json_object_get(msg, keys[k]);
        if (!v || json_is_null(v))
            continue;
        if (!json_is_string(v))
            return bad(e, "messages", "'messages'[%zu].%s must be a string", i, keys[k]);
        if (json_object_set(c, keys[k], v))
            return no_memory(e);
        *has |= k == 0;
    }
    const char *role = json_string_value(json_object_get(msg, "role"));
    if (role && !strcmp(role, "tool"))
        *has = true;
    return 0;
}
