/* tool_prompt (tool_call.h): which tool-call family a chat template is, and
 * the conversation in the form that family's template reads: arguments as
 * objects, Mistral's 9-character ids, or for templates without tool
 * support the tools described in a system message and the calls and their
 * results written as text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template.h"
#include "tool_call.h"

static bool has(const char *s, size_t n, const char *what)
{
    return memmem(s, n, what, strlen(what)) != NULL;
}

enum tool_family tool_family_of(const char *src, size_t len)
{
    if (!src)
        return TOOL_GENERIC;
    if (has(src, len, "<tool_call>"))
        return TOOL_HERMES;
    if (has(src, len, "[TOOL_CALLS]"))
        return TOOL_MISTRAL;
    if (has(src, len, "<|start_header_id|>") && has(src, len, "tools") &&
        has(src, len, "\"parameters\""))
        return TOOL_LLAMA3;
    return TOOL_GENERIC;
}

const char *tool_family_name(enum tool_family f)
{
    switch (f) {
    case TOOL_HERMES:
        return "hermes";
    case TOOL_LLAMA3:
        return "llama3";
    case TOOL_MISTRAL:
        return "mistral";
    case TOOL_GENERIC:
        break;
    }
    return "generic";
}

static bool role_is(const json_t *m, const char *role)
{
    const char *r = json_string_value(json_object_get(m, "role"));
    return r && !strcmp(r, role);
}

/* A call's arguments as a value: the object its JSON text holds, else the
 * text itself (a new reference; NULL without memory). */
static json_t *args_value(const json_t *args)
{
    if (json_is_string(args)) {
        json_t *o = json_loadb(json_string_value(args), json_string_length(args),
                               JSON_REJECT_DUPLICATES, NULL);
        if (json_is_object(o))
            return o;
        json_decref(o);
    }
    return args ? json_incref((json_t *)args) : json_object();
}

/* Mistral's template takes ids of exactly 9 characters: the last 9 (as
 * vLLM cuts them). */
static int cut_id(json_t *o, const char *key)
{
    json_t *id = json_object_get(o, key);
    size_t n = json_string_length(id);
    if (!json_is_string(id) || n <= 9)
        return 0;
    return json_object_set_new(o, key, json_stringn(json_string_value(id) + n - 9, 9)) ? -1 : 0;
}

/* Templates with tool support: the messages with arguments as objects
 * (and Mistral's ids). */
static json_t *prepare_native(enum tool_family f, const json_t *messages)
{
    json_t *out = json_deep_copy(messages);
    if (!out)
        return NULL;
    size_t i;
    json_t *m;
    json_array_foreach(out, i, m)
    {
        json_t *calls = json_object_get(m, "tool_calls");
        size_t k;
        json_t *call;
        json_array_foreach(calls, k, call)
        {
            json_t *fn = json_object_get(call, "function");
            if (json_is_object(fn) &&
                json_object_set_new(fn, "arguments", args_value(json_object_get(fn, "arguments"))))
                goto fail;
            if (f == TOOL_MISTRAL && cut_id(call, "id"))
                goto fail;
        }
        if (f == TOOL_MISTRAL && cut_id(m, "tool_call_id"))
            goto fail;
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* ---- the generic family -------------------------------------------------------- */

/* The system text that describes the tools and the answer format. */
static char *generic_system(const json_t *tools)
{
    char *list = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&list, &len);
    if (!f)
        return NULL;
    fputs("You can call these tools (each with the JSON Schema of its arguments):\n", f);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        json_t *fn = json_object_get(t, "function");
        json_t *one = json_object();
        if (!one)
            break;
        json_object_set(one, "name", json_object_get(fn, "name"));
        if (json_object_get(fn, "description"))
            json_object_set(one, "description", json_object_get(fn, "description"));
        json_t *params = json_object_get(fn, "parameters");
        json_object_set_new(one, "parameters", params ? json_incref(params) : json_object());
        char *s = json_dumps(one, 0);
        json_decref(one);
        if (s)
            fprintf(f, "%s\n", s);
        free(s);
    }
    fputs("\nTo call tools, answer with this JSON only, and nothing else:\n"
          "{\"tool_calls\": [{\"name\": \"<the tool's name>\", \"arguments\": {<its "
          "arguments>}}]}\n"
          "Otherwise, answer the user as usual.",
          f);
    if (fclose(f)) {
        free(list);
        return NULL;
    }
    return list;
}

/* An assistant message's calls as its content's text. */
static int generic_calls(json_t *m)
{
    json_t *calls = json_object_get(m, "tool_calls");
    json_t *list = json_array(), *wrap = json_pack("{s:o}", "tool_calls", list);
    if (!wrap)
        return -1;
    size_t k;
    json_t *call;
    json_array_foreach(calls, k, call)
    {
        json_t *fn = json_object_get(call, "function");
        json_t *c = json_pack("{s:O?, s:o}", "name", json_object_get(fn, "name"), "arguments",
                              args_value(json_object_get(fn, "arguments")));
        if (!c || json_array_append_new(list, c)) {
            json_decref(wrap);
            return -1;
        }
    }
    char *s = json_dumps(wrap, 0);
    json_decref(wrap);
    if (!s)
        return -1;
    const char *text = json_string_value(json_object_get(m, "content"));
    char *all = NULL;
    int rc = -1;
    if (text && text[0] ? asprintf(&all, "%s\n%s", text, s) >= 0 : (all = strdup(s)) != NULL)
        rc = json_object_set_new(m, "content", json_string(all));
    free(all);
    free(s);
    json_object_del(m, "tool_calls");
    return rc;
}

/* A tool result as a line of JSON. */
static char *generic_result(const json_t *m)
{
    json_t *c = json_object_get(m, "content");
    json_t *r = json_pack("{s:{s:O?, s:O?}}", "tool_response", "id",
                          json_object_get(m, "tool_call_id"), "content", c ? c : json_null());
    char *s = r ? json_dumps(r, 0) : NULL;
    json_decref(r);
    return s;
}

static json_t *prepare_generic(const json_t *messages, const json_t *tools)
{
    json_t *out = json_array();
    char *sys = tools && json_array_size(tools) ? generic_system(tools) : NULL;
    if (!out || (tools && json_array_size(tools) && !sys))
        goto fail;
    size_t i, n = json_array_size(messages);
    for (i = 0; i < n; i++) {
        json_t *m = json_deep_copy(json_array_get(messages, i));
        if (!m || json_array_append_new(out, m))
            goto fail;
        if (i == 0 && sys && role_is(m, "system")) {
            const char *t = json_string_value(json_object_get(m, "content"));
            char *all = NULL;
            if (asprintf(&all, "%s%s%s", t ? t : "", t && t[0] ? "\n\n" : "", sys) < 0)
                goto fail;
            int rc = json_object_set_new(m, "content", json_string(all));
            free(all);
            if (rc)
                goto fail;
            free(sys);
            sys = NULL;
        }
        if (json_object_get(m, "tool_calls") && generic_calls(m))
            goto fail;
        if (role_is(m, "tool")) {
            /* results, consecutive ones in one user message */
            char *text = generic_result(m);
            if (!text)
                goto fail;
            while (i + 1 < n && role_is(json_array_get(messages, i + 1), "tool")) {
                char *more = generic_result(json_array_get(messages, ++i)), *all = NULL;
                if (!more || asprintf(&all, "%s\n%s", text, more) < 0) {
                    free(more);
                    free(text);
                    goto fail;
                }
                free(more);
                free(text);
                text = all;
            }
            json_object_clear(m);
            int rc = json_object_set_new(m, "role", json_string("user")) ||
                     json_object_set_new(m, "content", json_string(text));
            free(text);
            if (rc)
                goto fail;
        }
    }
    if (sys) {
        json_t *m = json_pack("{s:s, s:s}", "role", "system", "content", sys);
        if (!m || json_array_insert_new(out, 0, m))
            goto fail;
    }
    free(sys);
    return out;
fail:
    free(sys);
    json_decref(out);
    return NULL;
}

int tool_prompt_prepare(enum tool_family f, const json_t *messages, const json_t *tools,
                        json_t **msgs_out, json_t **tools_out)
{
    *msgs_out = NULL;
    *tools_out = NULL;
    if (f == TOOL_GENERIC) {
        *msgs_out = prepare_generic(messages, tools);
    } else {
        *msgs_out = prepare_native(f, messages);
        if (*msgs_out && tools)
            *tools_out = json_incref((json_t *)tools);
    }
    return *msgs_out ? 0 : KVD_ENOMEM;
}

json_t *tool_prompt_merge_system(const json_t *messages)
{
    json_t *first = json_array_get(messages, 0);
    if (!role_is(first, "system"))
        return NULL;
    size_t u = 1;
    while (u < json_array_size(messages) && !role_is(json_array_get(messages, u), "user"))
        u++;
    if (u == json_array_size(messages))
        return NULL;
    json_t *out = json_deep_copy(messages);
    if (!out)
        return NULL;
    json_t *user = json_array_get(out, u);
    const char *s = json_string_value(json_object_get(first, "content"));
    const char *t = json_string_value(json_object_get(user, "content"));
    char *all = NULL;
    if (asprintf(&all, "%s%s%s", s ? s : "", s && s[0] ? "\n\n" : "", t ? t : "") < 0 ||
        json_object_set_new(user, "content", json_string(all)) || json_array_remove(out, 0)) {
        free(all);
        json_decref(out);
        return NULL;
    }
    free(all);
    return out;
}

int tool_render(const struct chat_template *t, enum tool_family f, const json_t *messages,
                const json_t *tools, bool add_generation_prompt, const char *bos_token,
                const char *eos_token, char **out, size_t *out_len, char *err, size_t errlen)
{
    json_t *m = NULL, *tl = NULL;
    *out = NULL;
    if (tool_prompt_prepare(f, messages, tools, &m, &tl)) {
        snprintf(err, errlen, "out of memory");
        return KVD_ENOMEM;
    }
    int rc = chat_template_render_json(t, m, tl, add_generation_prompt, bos_token, eos_token, out,
                                       out_len, err, errlen);
    json_t *merged = NULL;
    if (rc == KVD_EBADREQ && f == TOOL_GENERIC && (merged = tool_prompt_merge_system(m))) {
        char err2[256];
        char *out2 = NULL;
        /* the template's own message stays the error when this fails too */
        if (chat_template_render_json(t, merged, tl, add_generation_prompt, bos_token, eos_token,
                                      &out2, out_len, err2, sizeof err2) == 0) {
            *out = out2;
            rc = 0;
        }
    }
    json_decref(merged);
    json_decref(m);
    json_decref(tl);
    return rc;
}
