/* Text through libkvd and kvctl against a real kvd: hello's text
 * fields, tokenize/detokenize, generate with `text` (the reply's text is
 * the tokens' text, the streamed pieces add up to it), stop strings,
 * stopping at the model's end-of-generation token (eos and eot), chat
 * messages through the chat template with the conversation kept in one
 * sequence (later turns reuse it and give the same tokens as a fresh
 * request), the errors, and kvctl generate --text / chat / tokenize.
 *
 * The models come from kvd-gguf-gen: a SentencePiece vocabulary of byte
 * tokens and "▁t<N>" pieces, so any text tokenizes (mostly to bytes) and
 * completions read " t12 t7...". Two files share the weights (same seed) and
 * differ in metadata only: one with a ChatML chat template, one whose eos
 * (or eot) is a token greedy decoding produces, found at run time. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

static const char chatml[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

struct fixture {
    char dir[64];
    char model[128]; /* with the chat template */
    struct kh_proc *d;
};

static int gen_model(const char *path, const char *extra)
{
    char cmd[768];
    snprintf(cmd, sizeof(cmd),
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 300 --ctx 2048 --seed 7 %s >/dev/null",
             getenv("KVD_TOOLS_DIR"), path, extra);
    return system(cmd);
}

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof(*f));
    char tmpl[128], extra[192];
    if (!f)
        return -1;
    snprintf(f->dir, sizeof(f->dir), "/tmp/kvd-text.XXXXXX");
    if (!mkdtemp(f->dir))
        return -1;
    snprintf(tmpl, sizeof(tmpl), "%s/chatml.jinja", f->dir);
    FILE *t = fopen(tmpl, "w");
    if (!t || fputs(chatml, t) < 0 || fclose(t))
        return -1;
    snprintf(f->model, sizeof(f->model), "%s/chat.gguf", f->dir);
    snprintf(extra, sizeof(extra), "--chat-template %s", tmpl);
    if (gen_model(f->model, extra))
        return -1;
    const char *const args[] = {"--backend", "cpu", "--threads", "1", "--model", f->model, NULL};
    f->d = kh_new(NULL, args);
    if (!f->d)
        return -1;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[128];
    kh_free(f->d);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
    int rc = system(cmd);
    free(f);
    return rc == 0 ? 0 : -1;
}

static struct kvd_ctx *connect_to(const char *sock)
{
    struct kvd_ctx *c = kvd_connect(sock);
    assert_non_null(c);
    if (c->err)
        fail_msg("connect: %s", c->errstr);
    kvd_set_timeout(c, 60000);
    return c;
}

static void greedy_opts(struct kvd_gen_opts *o, uint32_t n)
{
    kvd_gen_opts_init(o);
    o->max_tokens = n;
    o->temperature = 0;
}

/* The streamed pieces, concatenated. */
struct pieces {
    char buf[4096];
    size_t len, events, tokens;
};

static int on_text(void *user, const uint32_t *t, size_t n, const char *text, size_t len)
{
    struct pieces *p = user;
    (void)t;
    assert_true(p->len + len < sizeof(p->buf));
    assert_int_equal(strlen(text), len); /* NUL-terminated, no NUL inside */
    memcpy(p->buf + p->len, text, len);
    p->len += len;
    p->buf[p->len] = 0;
    p->events++;
    p->tokens += n;
    return 0;
}

static void test_hello_text(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    struct kvd_hello_info h;
    assert_int_equal(kvd_hello(c, &h), 0);
    assert_string_equal(h.tokenizer, "llama");
    assert_true(h.has_bos && h.has_eos);
    assert_int_equal(h.bos, 1);
    assert_int_equal(h.eos, 2);
    assert_int_equal(h.n_eog, 1);
    assert_int_equal(h.eog[0], 2);
    assert_true(h.has_chat_template);
    kvd_close(c);
}

/* The text as this vocabulary gives it back: SentencePiece writes spaces
 * as U+2581 (and one before the text); with no piece for it here, it goes
 * out as byte tokens, which detokenize to the raw bytes (llama.cpp does the
 * same: only normal pieces get their U+2581 turned back into spaces). */
static void spm_bytes_form(const char *s, char *out, size_t cap)
{
    size_t o = 0;
    assert_true(cap > 3);
    memcpy(out, "\xe2\x96\x81", 3), o = 3;
    for (const char *p = s; *p; p++) {
        const char *add = *p == ' ' ? "\xe2\x96\x81" : p;
        size_t n = *p == ' ' ? 3 : 1;
        assert_true(o + n < cap);
        memcpy(out + o, add, n);
        o += n;
    }
    out[o] = 0;
}

static void test_tokenize_roundtrip(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    static const char *const texts[] = {"Hello world", "two  spaces\tand a tab\n",
                                        "\xc3\xbcn\xc3\xaf c\xc3\xb6"
                                        "d\xc3\xa9 \xe2\x9c\x93 "
                                        "\xf0\x9f\x99\x82",
                                        "x"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        uint32_t *ids = NULL;
        size_t n = 0;
        char *back = NULL;
        assert_int_equal(kvd_tokenize(c, texts[i], false, -1, &ids, &n), 0);
        assert_true(n >= 2);
        assert_int_equal(ids[0], 1); /* the model's BOS rule (SentencePiece: add BOS) */
        assert_int_equal(kvd_detokenize(c, ids + 1, n - 1, false, &back), 0);
        char want[256];
        spm_bytes_form(texts[i], want, sizeof(want));
        assert_string_equal(back, want);
        kvd_free(back);
        kvd_free(ids);
        assert_int_equal(kvd_tokenize(c, texts[i], false, 0, &ids, &n), 0);
        assert_true(n >= 1 && ids[0] != 1);
        kvd_free(ids);
    }
    /* Special-token text is text unless asked: "</s>" is eos (2) only with special. */
    uint32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(kvd_tokenize(c, "</s>", true, 0, &ids, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 2);
    kvd_free(ids);
    assert_int_equal(kvd_tokenize(c, "</s>", false, 0, &ids, &n), 0);
    assert_true(n > 1);
    kvd_free(ids);
    /* Out-of-vocabulary ids are refused. */
    uint32_t bad[1] = {300};
    char *s = NULL;
    assert_int_equal(kvd_detokenize(c, bad, 1, false, &s), KVD_EBADREQ);
    kvd_close(c);
}

/* The reply's text is the completion's tokens as text (the first piece's
 * SentencePiece space kept: the completion continues the prompt), and the
 * streamed pieces add up to it. */
static void test_generate_text(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    struct kvd_gen_opts o;
    struct kvd_gen_result a, b;
    struct pieces p = {0};
    greedy_opts(&o, 24);
    o.ignore_eos = true;
    assert_int_equal(kvd_generate_text(c, "Once upon a time", &o, &a), 0);
    assert_int_equal(a.n_tokens, 24);
    assert_non_null(a.text);
    assert_int_equal(strlen(a.text), a.text_len);
    char *whole = NULL;
    assert_int_equal(kvd_detokenize(c, a.tokens, a.n_tokens, false, &whole), 0);
    const char *t = a.text[0] == ' ' ? a.text + 1 : a.text;
    assert_string_equal(t, whole);
    kvd_free(whole);

    o.on_text = on_text;
    o.user = &p;
    assert_int_equal(kvd_generate_text(c, "Once upon a time", &o, &b), 0);
    assert_int_equal(b.n_tokens, 24);
    assert_memory_equal(a.tokens, b.tokens, 24 * sizeof(uint32_t));
    assert_string_equal(p.buf, b.text);
    assert_string_equal(b.text, a.text);
    assert_int_equal(p.tokens, 24);
    kvd_gen_result_free(&a);
    kvd_gen_result_free(&b);
    kvd_close(c);
}

/* A stop string ends the text just before its first occurrence, and the
 * stream never shows any of it. */
static void test_stop_string(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    struct kvd_gen_opts o;
    struct kvd_gen_result a, b;
    greedy_opts(&o, 32);
    o.ignore_eos = true;
    assert_int_equal(kvd_generate_text(c, "The", &o, &a), 0);
    /* The stop string: the third " t<N>" piece of the text (ASCII). */
    const char *p = a.text;
    for (int k = 0; k < 3 && p; k++)
        p = strstr(p + (k > 0), " t");
    if (!p)
        fail_msg("no third ' t' piece in '%s'", a.text);
    char stop[16] = " t";
    size_t sl = 2;
    while (sl < sizeof(stop) - 1 && p[sl] >= '0' && p[sl] <= '9')
        stop[sl] = p[sl], sl++;
    stop[sl] = 0;
    size_t at = (size_t)(strstr(a.text, stop) - a.text);

    struct pieces s = {0};
    const char *stops[1] = {stop};
    o.stop_strs = stops;
    o.n_stop_strs = 1;
    o.on_text = on_text;
    o.user = &s;
    assert_int_equal(kvd_generate_text(c, "The", &o, &b), 0);
    assert_string_equal(b.finish_reason, "stop");
    assert_int_equal(b.text_len, at);
    assert_memory_equal(b.text, a.text, at);
    assert_string_equal(s.buf, b.text);
    assert_true(b.n_tokens < a.n_tokens);
    assert_memory_equal(b.tokens, a.tokens, b.n_tokens * sizeof(uint32_t));
    kvd_gen_result_free(&a);
    kvd_gen_result_free(&b);

    /* Token ids and strings mix; an overlong or empty string is refused. */
    char big[300];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = 0;
    stops[0] = big;
    o.on_text = NULL;
    assert_int_equal(kvd_generate_text(c, "The", &o, &b), KVD_EBADREQ);
    stops[0] = "";
    assert_int_equal(kvd_generate_text(c, "The", &o, &b), KVD_EBADREQ);
    kvd_close(c);
}

/* A model whose end-of-generation token (eos, or eot) is one that greedy
 * decoding produces stops there: finish_reason stop, the token is the last
 * one, its text is not in the reply; ignore_eos goes on. */
static void test_stops_at_end_of_generation(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    struct kvd_gen_opts o;
    struct kvd_gen_result ref, r;
    greedy_opts(&o, 16);
    o.ignore_eos = true;
    assert_int_equal(kvd_generate_text(c, "Hi", &o, &ref), 0);
    kvd_close(c);
    /* The first token that did not appear before it, past the first two. */
    size_t k = 2;
    for (; k < ref.n_tokens; k++) {
        bool seen = false;
        for (size_t j = 0; j < k; j++)
            seen |= ref.tokens[j] == ref.tokens[k];
        if (!seen && ref.tokens[k] > 2)
            break;
    }
    assert_true(k < ref.n_tokens);
    for (int eot = 0; eot < 2; eot++) {
        char path[160], extra[64];
        snprintf(path, sizeof(path), "%s/eog%d.gguf", f->dir, eot);
        snprintf(extra, sizeof(extra), "--%s %u", eot ? "eot" : "eos", ref.tokens[k]);
        assert_int_equal(gen_model(path, extra), 0);
        const char *const args[] = {"--backend", "cpu", "--threads", "1", "--model", path, NULL};
        struct kh_proc *d = kh_new(NULL, args);
        assert_non_null(d);
        c = connect_to(d->sock);
        struct kvd_hello_info h;
        assert_int_equal(kvd_hello(c, &h), 0);
        assert_false(h.has_chat_template);
        bool listed = false;
        for (size_t i = 0; i < h.n_eog; i++)
            listed |= h.eog[i] == ref.tokens[k];
        assert_true(listed);

        o.ignore_eos = false;
        assert_int_equal(kvd_generate_text(c, "Hi", &o, &r), 0);
        assert_string_equal(r.finish_reason, "stop");
        assert_int_equal(r.n_tokens, k + 1);
        assert_memory_equal(r.tokens, ref.tokens, (k + 1) * sizeof(uint32_t));
        char *before = NULL;
        assert_int_equal(kvd_detokenize(c, r.tokens, k, false, &before), 0);
        const char *t = r.text[0] == ' ' ? r.text + 1 : r.text;
        assert_string_equal(t, before);
        kvd_free(before);
        kvd_gen_result_free(&r);

        o.ignore_eos = true;
        assert_int_equal(kvd_generate_text(c, "Hi", &o, &r), 0);
        assert_string_equal(r.finish_reason, "length");
        assert_int_equal(r.n_tokens, 16);
        kvd_gen_result_free(&r);

        /* No chat template here: messages are refused, saying so. */
        struct kvd_chat_msg m = {"user", "hello"};
        assert_int_equal(kvd_chat(c, &m, 1, &o, &r), KVD_EUNSUPPORTED);
        assert_non_null(strstr(c->errstr, "chat template"));
        kvd_close(c);
        assert_int_equal(kh_free(d), 0);
        unlink(path);
    }
    kvd_gen_result_free(&ref);
}

/* Chat: the template's rendering tokenized with special tokens parsed; a
 * conversation kept in one sequence reuses its tokens on the next turn and
 * gives what a fresh request for the whole conversation gives. */
static void test_chat_in_one_sequence(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    struct kvd_gen_opts o;
    struct kvd_gen_result r1, r2, fresh;
    uint64_t seq;
    greedy_opts(&o, 8);
    o.ignore_eos = true;

    struct kvd_chat_msg m[3] = {{"user", "hi there"}, {"assistant", NULL}, {"user", "and then?"}};
    /* The prompt is the ChatML rendering, BOS first, specials parsed. */
    uint32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(kvd_tokenize(c,
                                  "<|im_start|>user\nhi there<|im_end|>\n"
                                  "<|im_start|>assistant\n",
                                  true, -1, &ids, &n),
                     0);
    assert_int_equal(kvd_chat(c, m, 1, &o, &r1), 0);
    assert_int_equal(r1.prompt_tokens, n);
    kvd_free(ids);
    kvd_gen_result_free(&r1);

    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    o.use_seq = true;
    o.seq = seq;
    assert_int_equal(kvd_chat(c, m, 1, &o, &r1), 0);
    assert_int_equal(r1.cached_tokens, 0);
    m[1].content = r1.text;
    assert_int_equal(kvd_chat(c, m, 3, &o, &r2), 0);
    /* The first turn's prompt and answer are in the sequence already. */
    assert_true(r2.cached_tokens >= r1.prompt_tokens);
    o.use_seq = false;
    assert_int_equal(kvd_chat(c, m, 3, &o, &fresh), 0);
    assert_int_equal(fresh.n_tokens, r2.n_tokens);
    assert_memory_equal(fresh.tokens, r2.tokens, r2.n_tokens * sizeof(uint32_t));
    assert_string_equal(fresh.text, r2.text);
    assert_int_equal(fresh.prompt_tokens, r2.prompt_tokens);

    /* The template's error for a bad conversation is the daemon's answer. */
    struct kvd_chat_msg none[1] = {{"user", "x"}};
    struct kvd_gen_result bad;
    assert_int_equal(kvd_chat(c, none, 0, &o, &bad), KVD_EBADREQ);
    kvd_gen_result_free(&r1);
    kvd_gen_result_free(&r2);
    kvd_gen_result_free(&fresh);
    kvd_seq_close(c, seq);
    kvd_close(c);
}

static void test_prompt_errors(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    struct kvd_reply *r = NULL;
    uint32_t t[2] = {1, 5};
    struct kvd_arg both[2] = {KVD_ARG_U32S("tokens", t, 2), KVD_ARG_S("text", "x")};
    assert_int_equal(kvd_call(c, "generate", both, 2, &r), KVD_EBADREQ);
    assert_non_null(strstr(c->errstr, "one of"));
    kvd_reply_free(r);
    struct kvd_arg msgs[1] = {KVD_ARG_S("messages", "not an array")};
    assert_int_equal(kvd_call(c, "generate", msgs, 1, &r), KVD_EBADREQ);
    kvd_reply_free(r);
    struct kvd_arg stop[2] = {KVD_ARG_S("text", "x"), KVD_ARG_S("stop", "x")};
    assert_int_equal(kvd_call(c, "generate", stop, 2, &r), KVD_EBADREQ);
    kvd_reply_free(r);
    /* A text that cannot fit the context is refused before it is tokenized. */
    char *big = malloc(200000);
    assert_non_null(big);
    memset(big, 'x', 199999);
    big[199999] = 0;
    struct kvd_gen_opts o;
    struct kvd_gen_result res;
    greedy_opts(&o, 1);
    assert_int_equal(kvd_generate_text(c, big, &o, &res), KVD_ETOOLARGE);
    assert_non_null(strstr(c->errstr, "more than 2048 tokens"));
    free(big);
    struct kvd_arg tok[1] = {KVD_ARG_U("text", 5)};
    assert_int_equal(kvd_call(c, "tokenize", tok, 1, &r), KVD_EBADREQ);
    kvd_reply_free(r);
    kvd_close(c);
}

/* Runs kvctl with stdin from `in`, returns its stdout. */
static int run_kvctl(const struct fixture *f, const char *const *args, const char *in, char *out,
                     size_t cap)
{
    const char *argv[24];
    char opath[160], ipath[160];
    int n = 0, st;
    argv[n++] = getenv("KVCTL_BIN");
    argv[n++] = "--socket";
    argv[n++] = f->d->sock;
    for (int i = 0; args[i]; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    snprintf(opath, sizeof(opath), "%s/kvctl.out", f->dir);
    snprintf(ipath, sizeof(ipath), "%s/kvctl.in", f->dir);
    FILE *fi = fopen(ipath, "w");
    assert_non_null(fi);
    fputs(in, fi);
    fclose(fi);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(opath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fdi = open(ipath, O_RDONLY);
        if (fd < 0 || fdi < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fdi, 0);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    assert_int_equal(waitpid(pid, &st, 0), pid);
    FILE *fp = fopen(opath, "r");
    assert_non_null(fp);
    size_t len = fread(out, 1, cap - 1, fp);
    out[len] = '\0';
    fclose(fp);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void test_kvctl_text(void **state)
{
    struct fixture *f = *state;
    struct kvd_ctx *c = connect_to(f->d->sock);
    struct kvd_gen_opts o;
    struct kvd_gen_result r;
    char out[8192], want[4096];
    greedy_opts(&o, 6);
    o.ignore_eos = true;
    assert_int_equal(kvd_generate_text(c, "Hello", &o, &r), 0);
    snprintf(want, sizeof(want), "%s\n", r.text);
    kvd_gen_result_free(&r);

    const char *const gen[] = {"generate", "--text",       "Hello", "--max-tokens",
                               "6",        "--ignore-eos", NULL};
    assert_int_equal(run_kvctl(f, gen, "", out, sizeof(out)), 0);
    assert_string_equal(out, want);
    const char *const gens[] = {"generate", "--text",       "Hello",    "--max-tokens",
                                "6",        "--ignore-eos", "--stream", NULL};
    assert_int_equal(run_kvctl(f, gens, "", out, sizeof(out)), 0);
    assert_string_equal(out, want);

    const char *const tok[] = {"tokenize", "--text", "</s>", "--special", "--no-bos", NULL};
    assert_int_equal(run_kvctl(f, tok, "", out, sizeof(out)), 0);
    assert_string_equal(out, "2\n");

    /* chat: two turns, a reset, one more; each answer is what kvd_chat gives
     * for the same conversation. */
    struct kvd_chat_msg m[3] = {{"user", "hello"}, {"assistant", NULL}, {"user", "again"}};
    struct kvd_gen_result a1, a2, a3;
    greedy_opts(&o, 5);
    assert_int_equal(kvd_chat(c, m, 1, &o, &a1), 0);
    m[1].content = a1.text;
    assert_int_equal(kvd_chat(c, m, 3, &o, &a2), 0);
    assert_int_equal(kvd_chat(c, m + 2, 1, &o, &a3), 0);
    snprintf(want, sizeof(want), "%s\n%s\n%s\n", a1.text, a2.text, a3.text);
    const char *const chat[] = {"chat", "--max-tokens", "5", "--temperature", "0", NULL};
    assert_int_equal(run_kvctl(f, chat, "hello\nagain\n/reset\nagain\n", out, sizeof(out)), 0);
    assert_string_equal(out, want);
    kvd_gen_result_free(&a1);
    kvd_gen_result_free(&a2);
    kvd_gen_result_free(&a3);
    kvd_close(c);
}

int main(void)
{
    if (!getenv("KVD_BIN") || !getenv("KVD_TOOLS_DIR") || !getenv("KVCTL_BIN")) {
        fprintf(stderr, "test_client_text: KVD_BIN/KVD_TOOLS_DIR/KVCTL_BIN not set (ctest)\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_text),
        cmocka_unit_test(test_tokenize_roundtrip),
        cmocka_unit_test(test_generate_text),
        cmocka_unit_test(test_stop_string),
        cmocka_unit_test(test_stops_at_end_of_generation),
        cmocka_unit_test(test_chat_in_one_sequence),
        cmocka_unit_test(test_prompt_errors),
        cmocka_unit_test(test_kvctl_text),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
