/* tool_args: the tool-call fields of a generate request (docs/http.md,
 * "Tool calls"; docs/protocol.md, generate) read from JSON, the HTTP body's
 * or a msgpack request's converted: checked and put in tool_call.h's
 * common form, errors naming the field. For openai.c and ops_generate.c. */
#ifndef KVD_TOOL_ARGS_H
#define KVD_TOOL_ARGS_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "kvd/status.h"
#include "tool_call.h"

/* `tools`: [{type: "function", function: {name, description, parameters,
 * strict}}] (absent, null or empty: none, *out NULL) into a new list of
 * {type, function: {name, description, parameters}}. Names are 1 to
 * TOOL_MAX_NAME of [a-zA-Z0-9_-], once each; parameters an object (its
 * schema is checked when its grammar is made). Other types of tool are
 * unsupported. 0 or an error (param "tools"). */
int tool_args_tools(const json_t *tools, json_t **out, struct kvd_error *e);
/* `tool_choice`: "none", "auto", "required" or {type: "function",
 * function: {name}} (absent or null: auto), checked against the tools
 * (the common form, or NULL); *name points into choice. 0 or an error
 * (param "tool_choice"). */
int tool_args_choice(const json_t *choice, const json_t *tools, enum tool_choice *c,
                     const char **name, struct kvd_error *e);
/* Message i's tool fields: tool_calls [{id, type: "function", function:
 * {name, arguments: a JSON text, or an object}}], tool_call_id, name, into
 * its common form c (which has role and content). *has is set when it
 * carries calls or a result. 0 or an error (param "messages"). */
int tool_args_message(const json_t *msg, size_t i, json_t *c, bool *has, struct kvd_error *e);

#endif
