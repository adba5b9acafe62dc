/* text: see text.h. */
#include "text.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf.h"
#include "grammar.h"
#include "kvd/status.h"
#include "log.h"
#include "tool_call.h"

#define TEXT_MAX_TEMPLATE (1u << 20) /* a --chat-template file or the GGUF's */

struct text {
    struct gguf *g; /* the tokenizer may point into its mapping */
    struct tokenizer *tok;
    struct chat_template *tmpl;
    enum tool_family tool_family; /* the template's (tool_call.h) */
    struct grammar_vocab *gvocab; /* the pieces as grammars match them */
    char no_tok[400], no_tmpl[400];
    char *bos_text, *eos_text; /* the template's bos_token / eos_token */
    uint32_t bos, eos;
    uint32_t eog[TEXT_MAX_EOG];
    size_t n_eog;
};

static void add_eog(struct text *t, uint32_t id)
{
    if (id == TEXT_NO_TOKEN || t->n_eog == TEXT_MAX_EOG)
        return;
    size_t i = 0;
    while (i < t->n_eog && t->eog[i] < id)
        i++;
    if (i < t->n_eog && t->eog[i] == id)
        return;
    memmove(t->eog + i + 1, t->eog + i, (t->n_eog - i) * sizeof(*t->eog));
    t->eog[i] = id;
    t->n_eog++;
}

/* A token id key of the file, or TEXT_NO_TOKEN (absent or out of range). */
static uint32_t key_id(const struct gguf *g, const char *key, uint64_t n_vocab)
{
    uint32_t v;
    char err[128];
    if (gguf_get_u32(g, key, &v, err, sizeof err) != 0 || v >= n_vocab)
        return TEXT_NO_TOKEN;
    return v;
}

static char *token_text(const struct tokenizer *tok, uint32_t id)
{
    char buf[TOK_MAX_TOKEN_TEXT + 1];
    size_t n = id == TEXT_NO_TOKEN ? 0 : tokenizer_piece(tok, id, true, buf, sizeof buf - 1);
    if (n > sizeof buf - 1)
        n = 0;
    buf[n] = 0;
    return strdup(buf);
}

static int read_file(const char *path, char **out, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "--chat-template %s: %s", path, strerror(errno));
        return KVD_ENOTFOUND;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > TEXT_MAX_TEMPLATE) {
        fclose(f);
        snprintf(err, errlen, "--chat-template %s: not a regular file of at most %u bytes", path,
                 TEXT_MAX_TEMPLATE);
        return KVD_EBADREQ;
    }
    char *buf = malloc((size_t)st.st_size + 1);
    size_t n = buf ? fread(buf, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (!buf || n != (size_t)st.st_size) {
        free(buf);
        snprintf(err, errlen, "--chat-template %s: cannot read it", path);
        return buf ? KVD_EBADREQ : KVD_ENOMEM;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

/* The chat template: the override file (an error if unusable), else the
 * GGUF's tokenizer.chat_template (absent or unusable: no template, logged). */
static int load_template(struct text *t, const char *path, char *err, size_t errlen)
{
    char *src = NULL;
    size_t len = 0;
    char perr[256] = "";
    if (path && path[0]) {
        int rc = read_file(path, &src, &len, err, errlen);
        if (rc)
            return rc;
        rc = chat_template_parse(src, len, &t->tmpl, perr, sizeof perr);
        t->tool_family = tool_family_of(src, len);
        free(src);
        if (rc) {
            snprintf(err, errlen, "--chat-template %s: %s", path, perr);
            return rc;
        }
        return 0;
    }
    const struct gguf_kv *kv = gguf_find_kv(t->g, "tokenizer.chat_template");
    if (!kv || kv->type != GGUF_STRING) {
        snprintf(t->no_tmpl, sizeof t->no_tmpl,
                 "the model file has no chat template (tokenizer.chat_template); give one with "
                 "--chat-template FILE");
        return 0;
    }
    if (kv->str_len > TEXT_MAX_TEMPLATE) {
        snprintf(t->no_tmpl, sizeof t->no_tmpl, "the model's chat template is over %u bytes",
                 TEXT_MAX_TEMPLATE);
    } else if (chat_template_parse(kv->str, (size_t)kv->str_len, &t->tmpl, perr, sizeof perr)) {
        snprintf(t->no_tmpl, sizeof t->no_tmpl, "the model's chat template cannot be used: %s",
                 perr);
    } else {
        t->tool_family = tool_family_of(kv->str, (size_t)kv->str_len);
    }
    if (!t->tmpl)
        log_warn("chat template: %s; requests with messages will be refused", t->no_tmpl);
    return 0;
}

/* The load-time test of a template: one render of a conversation shaped
 * like the largest requests (a system message, then user and assistant
 * turns, TEXT_PROBE_MSGS messages of TEXT_PROBE_BYTES each). A template
 * that passes the render's work budget or time bound there (jinja.h) is
 * refused now rather than on every request: the file's own is dropped (no
 * chat, logged), a --chat-template file is a start-up error. A template
 * that raises on this conversation (its role rules) is kept: its requests
 * get its own message. */
#define TEXT_PROBE_MSGS 64
#define TEXT_PROBE_BYTES (16u << 10)

static int probe_template(struct text *t, const char *path, char *err, size_t errlen)
{
    char *content = malloc(TEXT_PROBE_BYTES + 1);
    struct chat_msg msgs[TEXT_PROBE_MSGS];
    if (!content) {
        snprintf(err, errlen, "out of memory");
        return KVD_ENOMEM;
    }
    static const char words[] = "Hello, world! <b>tags</b> {{braces}} \"quotes\" and\nlines. ";
    for (size_t i = 0; i < TEXT_PROBE_BYTES; i++)
        content[i] = words[i % (sizeof words - 1)];
    content[TEXT_PROBE_BYTES] = '\0';
    for (size_t i = 0; i < TEXT_PROBE_MSGS; i++) {
        msgs[i].role = i == 0 ? "system" : i % 2 ? "user" : "assistant";
        msgs[i].content = content;
    }
    char *out = NULL, perr[256] = "";
    size_t n = 0;
    int rc = chat_template_render(t->tmpl, msgs, TEXT_PROBE_MSGS, true, t->bos_text, t->eos_text,
                                  &out, &n, perr, sizeof perr);
    free(content);
    free(out);
    if (rc != KVD_ETOOLARGE)
        return rc == KVD_ENOMEM ? rc : 0;
    if (path && path[0]) {
        snprintf(err, errlen,
                 "--chat-template %s: refused: on a test conversation of %u messages of %u KiB, %s",
                 path, TEXT_PROBE_MSGS, TEXT_PROBE_BYTES >> 10, perr);
        return KVD_EBADREQ;
    }
    chat_template_free(t->tmpl);
    t->tmpl = NULL;
    snprintf(t->no_tmpl, sizeof t->no_tmpl,
             "the model's chat template was refused: on a test conversation of %u messages of %u "
             "KiB, %s",
             TEXT_PROBE_MSGS, TEXT_PROBE_BYTES >> 10, perr);
    log_warn("chat template: %s; requests with messages will be refused", t->no_tmpl);
    return 0;
}

int text_open(const char *model_path, const char *template_path, struct text **out, char *err,
              size_t errlen)
{
    *out = NULL;
    struct text *t = calloc(1, sizeof(*t));
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return KVD_ENOMEM;
    }
    int rc = gguf_open(model_path, &t->g, err, errlen);
    if (rc)
        goto fail;
    uint64_t n_vocab = gguf_arr_count(t->g, "tokenizer.ggml.tokens");
    char terr[256] = "";
    int trc = tokenizer_load(t->g, &t->tok, terr, sizeof terr);
    if (trc == KVD_ENOMEM) {
        snprintf(err, errlen, "tokenizer: out of memory");
        rc = trc;
        goto fail;
    }
    if (trc) {
        t->tok = NULL;
        snprintf(t->no_tok, sizeof t->no_tok, "the model's tokenizer cannot be used: %s", terr);
        log_warn("token-only mode: %s", t->no_tok);
    }
    if (t->tok) {
        t->bos = tokenizer_bos(t->tok);
        t->eos = tokenizer_eos(t->tok);
        uint32_t ids[TEXT_MAX_EOG];
        size_t n = tokenizer_eog_ids(t->tok, ids, TEXT_MAX_EOG);
        for (size_t i = 0; i < n && i < TEXT_MAX_EOG; i++)
            add_eog(t, ids[i]);
        t->bos_text = token_text(t->tok, t->bos);
        t->eos_text = token_text(t->tok, t->eos);
        if (!t->bos_text || !t->eos_text || grammar_vocab_build(t->tok, &t->gvocab)) {
            snprintf(err, errlen, "out of memory");
            rc = KVD_ENOMEM;
            goto fail;
        }
    } else {
        t->bos = key_id(t->g, "tokenizer.ggml.bos_token_id", n_vocab);
        t->eos = key_id(t->g, "tokenizer.ggml.eos_token_id", n_vocab);
        add_eog(t, t->eos);
        add_eog(t, key_id(t->g, "tokenizer.ggml.eot_token_id", n_vocab));
        add_eog(t, key_id(t->g, "tokenizer.ggml.eom_token_id", n_vocab));
    }
    if ((rc = load_template(t, template_path, err, errlen)))
        goto fail;
    if (t->tmpl && !t->tok) {
        chat_template_free(t->tmpl);
        t->tmpl = NULL;
        snprintf(t->no_tmpl, sizeof t->no_tmpl, "%s", t->no_tok);
    }
    if (t->tmpl && (rc = probe_template(t, template_path, err, errlen)))
        goto fail;
    *out = t;
    return 0;
fail:
    text_free(t);
    return rc;
}

void text_free(struct text *t)
{
    if (!t)
        return;
    chat_template_free(t->tmpl);
    grammar_vocab_free(t->gvocab);
    tokenizer_free(t->tok);
    free(t->bos_text);
    free(t->eos_text);
    gguf_close(t->g);
    free(t);
}

const struct tokenizer *text_tokenizer(const struct text *t)
{
    return t ? t->tok : NULL;
}

const struct grammar_vocab *text_grammar_vocab(const struct text *t)
{
    return t ? t->gvocab : NULL;
}

const char *text_no_tokenizer(const struct text *t)
{
    return !t ? "no model is loaded" : t->tok ? "" : t->no_tok;
}

const struct chat_template *text_chat_template(const struct text *t)
{
    return t ? t->tmpl : NULL;
}

const char *text_no_chat_template(const struct text *t)
{
    return !t ? "no model is loaded" : t->tmpl ? "" : t->no_tmpl;
}

uint32_t text_bos(const struct text *t)
{
    return t ? t->bos : TEXT_NO_TOKEN;
}

uint32_t text_eos(const struct text *t)
{
    return t ? t->eos : TEXT_NO_TOKEN;
}

bool text_is_eog(const struct text *t, uint32_t id)
{
    if (!t)
        return false;
    for (size_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return true;
    return false;
}

size_t text_eog(const struct text *t, const uint32_t **ids)
{
    *ids = t ? t->eog : NULL;
    return t ? t->n_eog : 0;
}

/* The ids of s under the cap, or a message saying why not. what names
 * the text ("the text", "the rendered prompt"). */
static int encode(const struct text *t, const char *s, size_t len, bool bos, bool special,
                  size_t max_tokens, const char *what, uint32_t **ids, size_t *n, char *err,
                  size_t errlen)
{
    if (len > TOK_MAX_TEXT) {
        snprintf(err, errlen, "%s has %zu bytes, more than the tokenizer takes (%u)", what, len,
                 TOK_MAX_TEXT);
        return KVD_ETOOLARGE;
    }
    int rc = tokenizer_encode_max(t->tok, s, len, bos, special, max_tokens, ids, n);
    if (rc == KVD_ETOOLARGE)
        snprintf(err, errlen, "%s makes more than %zu tokens", what, max_tokens);
    else if (rc)
        snprintf(err, errlen, "%s", rc == KVD_ENOMEM ? "out of memory" : "cannot tokenize it");
    return rc;
}

int text_tokenize(const struct text *t, const char *s, size_t len, int add_bos, bool special,
                  size_t max_tokens, uint32_t **ids, size_t *n, char *err, size_t errlen)
{
    *ids = NULL;
    *n = 0;
    if (!t || !t->tok) {
        snprintf(err, errlen, "text needs the model's tokenizer: %s", text_no_tokenizer(t));
        return KVD_EUNSUPPORTED;
    }
    bool bos = add_bos < 0 ? tokenizer_add_bos_default(t->tok) : add_bos != 0;
    return encode(t, s, len, bos, special, max_tokens, "the text", ids, n, err, errlen);
}

enum tool_family text_tool_family(const struct text *t)
{
    return t ? t->tool_family : TOOL_GENERIC;
}

size_t text_tool_marks(const struct text *t, uint32_t *ids, size_t cap)
{
    static const char *const marks[][2] = {
        [TOOL_GENERIC] = {NULL, NULL},
        [TOOL_HERMES] = {"<tool_call>", "</tool_call>"},
        [TOOL_LLAMA3] = {"<|python_tag|>", NULL},
        [TOOL_MISTRAL] = {"[TOOL_CALLS]", NULL},
    };
    size_t n = 0;
    for (int i = 0; t && t->tok && i < 2 && n < cap; i++) {
        const char *m = marks[t->tool_family][i];
        uint32_t id = m ? tokenizer_find(t->tok, m, strlen(m)) : UINT32_MAX;
        if (id != UINT32_MAX && tokenizer_token_type(t->tok, id) == TOK_TYPE_CONTROL)
            ids[n++] = id;
    }
    return n;
}

/* The rendered prompt's tokens: special tokens parsed, the model's BOS
 * rule, a BOS the template wrote not doubled. Frees prompt. */
static int encode_prompt(const struct text *t, char *prompt, size_t plen, size_t max_tokens,
                         uint32_t **ids, size_t *n, char *err, size_t errlen)
{
    /* Templates that start with {{ bos_token }} would give two BOS with the
     * model's BOS rule; the rule wins and the template's copy goes (as
     * llama.cpp does). */
    bool bos = tokenizer_add_bos_default(t->tok);
    size_t skip = 0, bl = strlen(t->bos_text);
    if (bos && bl && plen >= bl && memcmp(prompt, t->bos_text, bl) == 0)
        skip = bl;
    int rc = encode(t, prompt + skip, plen - skip, bos, true, max_tokens, "the rendered prompt",
                    ids, n, err, errlen);
    free(prompt);
    return rc;
}

int text_tokenize_chat_json(const struct text *t, const json_t *messages, const json_t *tools,
                            size_t max_tokens, uint32_t **ids, size_t *n, char *err, size_t errlen)
{
    *ids = NULL;
    *n = 0;
    if (!t || !t->tok) {
        snprintf(err, errlen, "messages need the model's tokenizer: %s", text_no_tokenizer(t));
        return KVD_EUNSUPPORTED;
    }
    if (!t->tmpl) {
        snprintf(err, errlen, "messages need a chat template: %s", t->no_tmpl);
        return KVD_EUNSUPPORTED;
    }
    char *prompt = NULL;
    size_t plen = 0;
    int rc = tool_render(t->tmpl, t->tool_family, messages, tools, true, t->bos_text, t->eos_text,
                         &prompt, &plen, err, errlen);
    if (rc)
        return rc;
    return encode_prompt(t, prompt, plen, max_tokens, ids, n, err, errlen);
}

int text_tokenize_chat(const struct text *t, const struct chat_msg *msgs, size_t n_msgs,
                       size_t max_tokens, uint32_t **ids, size_t *n, char *err, size_t errlen)
{
    *ids = NULL;
    *n = 0;
    if (!t || !t->tok) {
        snprintf(err, errlen, "messages need the model's tokenizer: %s", text_no_tokenizer(t));
        return KVD_EUNSUPPORTED;
    }
    if (!t->tmpl) {
        snprintf(err, errlen, "messages need a chat template: %s", t->no_tmpl);
        return KVD_EUNSUPPORTED;
    }
    char *prompt = NULL;
    size_t plen = 0;
    int rc = chat_template_render(t->tmpl, msgs, n_msgs, true, t->bos_text, t->eos_text, &prompt,
                                  &plen, err, errlen);
    if (rc)
        return rc;
    return encode_prompt(t, prompt, plen, max_tokens, ids, n, err, errlen);
}
