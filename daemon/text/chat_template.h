/* Chat templates: a Jinja subset, enough for the chat templates real models
 * ship in their GGUF (`tokenizer.chat_template`) or tokenizer_config.json,
 * rendering byte-equal to the reference renderer @huggingface/jinja (what
 * node-llama-cpp uses). A template that uses anything outside the subset is
 * refused at parse (or, for a method or filter reached only at render time,
 * at render) with an error naming the construct: never a silently wrong
 * render. Pure functions over caller memory; no global state, thread-safe
 * for distinct templates and for concurrent renders of one parsed template. */
#ifndef KVD_CHAT_TEMPLATE_H
#define KVD_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

struct chat_template;

/* One message of a conversation; both strings NUL-terminated UTF-8. */
struct chat_msg {
    const char *role;
    const char *content;
};

/* Parses a Jinja chat template of `len` bytes (NUL bytes are refused).
 * Unsupported construct -> KVD_EUNSUPPORTED with err naming the construct and
 * line (e.g. "chat template line 3: filter 'xmlattr' is not supported");
 * syntax error -> KVD_EBADREQ ("chat template line 7: ..."); KVD_ENOMEM.
 * On success *out owns the parsed template (free with chat_template_free). */
int chat_template_parse(const char *src, size_t len, struct chat_template **out, char *err,
                        size_t errlen);

void chat_template_free(struct chat_template *t);

/* Renders `msgs` with the variables messages, add_generation_prompt,
 * bos_token and eos_token (bos/eos are the token texts; NULL means ""). A
 * template's raise_exception(msg) -> KVD_EBADREQ with err = the template's
 * message; a type error or an unsupported method/filter met at render time
 * -> KVD_EBADREQ / KVD_EUNSUPPORTED naming it and its line; a render past the
 * output, recursion or step limits -> KVD_ETOOLARGE. On success *out is a
 * malloc'd NUL-terminated string of *out_len bytes owned by the caller. */
int chat_template_render(const struct chat_template *t, const struct chat_msg *msgs, size_t n_msgs,
                         bool add_generation_prompt, const char *bos_token, const char *eos_token,
                         char **out, size_t *out_len, char *err, size_t errlen);

/* The same for a conversation given as JSON, as OpenAI requests carry it:
 * messages is an array of objects handed to the template as they are
 * (role, content, tool_calls, tool_call_id, ...), tools (NULL: the
 * variable is not defined) the tool list. Values are what the reference
 * makes of the same JSON: a number with an integral value is an integer;
 * object keys keep their order (the reference, a JavaScript object, would
 * put integer-like keys first: the one difference). The JSON must outlive
 * the call. */
int chat_template_render_json(const struct chat_template *t, const json_t *messages,
                              const json_t *tools, bool add_generation_prompt,
                              const char *bos_token, const char *eos_token, char **out,
                              size_t *out_len, char *err, size_t errlen);

#endif
