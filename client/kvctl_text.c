/* kvctl tokenize / detokenize / chat: text through the served model's
 * tokenizer and chat template.
 *
 * chat is interactive: each line read is a user turn; the reply streams as
 * it is generated. The whole conversation is kept in one kvd sequence, so
 * each turn computes only its new tokens (the daemon keeps the sequence's
 * longest common prefix with the newly rendered conversation). /reset
 * starts over, /exit (or end of input) quits, Ctrl-C cancels the turn. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvctl.h"

static const char tokenize_help[] =
    "usage: kvctl tokenize --text TEXT [--special] [--bos | --no-bos] [--json]\n"
    "Prints the token ids of TEXT with the served model's tokenizer as one\n"
    "comma-separated line. --special parses special-token text such as\n"
    "<|eot_id|>; the model's BOS rule applies unless --bos or --no-bos.\n";

static const char detokenize_help[] =
    "usage: kvctl detokenize --tokens 1,2,3 [--special]\n"
    "Prints the text of the token ids (--special: control tokens as their text).\n";

static const char chat_help[] =
    "usage: kvctl chat [--system TEXT] [--max-tokens N] [--temperature T] [--seed S]\n"
    "Chats with the served model through its chat template: each line you type\n"
    "is a turn; the answer streams. /reset starts over, /exit or end of input\n"
    "quits, Ctrl-C cancels the answer being generated.\n";

int kvctl_cmd_tokenize(struct kvctl *k, int argc, char **argv)
{
    static const struct option opts[] = {
        {"text", required_argument, NULL, 'x'},
        {"special", no_argument, NULL, 's'},
        {"bos", no_argument, NULL, 'b'},
        {"no-bos", no_argument, NULL, 'B'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *text = NULL;
    bool special = false, json = false;
    int add_bos = -1, c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'x':
            text = optarg;
            break;
        case 's':
            special = true;
            break;
        case 'b':
            add_bos = 1;
            break;
        case 'B':
            add_bos = 0;
            break;
        case 'j':
            json = true;
            break;
        case 'h':
            fputs(tokenize_help, stdout);
            return KVCTL_OK;
        default:
            fputs(tokenize_help, stderr);
            return KVCTL_EUSAGE;
        }
    }
    if (optind < argc)
        return kvctl_usage_err("tokenize: unexpected argument \"%s\"", argv[optind]);
    if (!text)
        return kvctl_usage_err("tokenize: --text is required");
    int rc = kvctl_connect(k);
    if (rc)
        return rc;
    uint32_t *ids = NULL;
    size_t n = 0;
    if (kvd_tokenize(k->ctx, text, special, add_bos, &ids, &n))
        return kvctl_fail(k, "tokenize");
    if (json)
        fputs("{\"tokens\":[", stdout);
    kvctl_print_tokens(stdout, ids, n, false);
    puts(json ? "]}" : "");
    kvd_free(ids);
    return KVCTL_OK;
}

int kvctl_cmd_detokenize(struct kvctl *k, int argc, char **argv)
{
    static const struct option opts[] = {
        {"tokens", required_argument, NULL, 'T'},
        {"special", no_argument, NULL, 's'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    uint32_t *ids = NULL;
    size_t n = 0;
    bool special = false, have = false;
    char err[256];
    int c, rc = KVCTL_OK;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'T':
            free(ids);
            ids = NULL;
            if (kvctl_parse_tokens(optarg, &ids, &n, err, sizeof(err))) {
                rc = kvctl_usage_err("detokenize --tokens: %s", err);
                goto out;
            }
            have = true;
            break;
        case 's':
            special = true;
            break;
        case 'h':
            fputs(detokenize_help, stdout);
            goto out;
        default:
            fputs(detokenize_help, stderr);
            rc = KVCTL_EUSAGE;
            goto out;
        }
    }
    if (optind < argc || !have) {
        rc = kvctl_usage_err("detokenize: --tokens is required (and nothing else)");
        goto out;
    }
    if ((rc = kvctl_connect(k)))
        goto out;
    char *s = NULL;
    if (kvd_detokenize(k->ctx, ids, n, special, &s)) {
        rc = kvctl_fail(k, "detokenize");
        goto out;
    }
    puts(s);
    kvd_free(s);
out:
    free(ids);
    return rc;
}

/* ---- chat ------------------------------------------------------------------ */

static volatile sig_atomic_t chat_interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    chat_interrupted = 1;
}

struct chat {
    struct kvd_chat_msg *msgs; /* contents owned (strdup), roles static */
    size_t n, cap;
    size_t n_keep; /* the system message, kept by /reset */
    uint64_t seq;
};

static int chat_add(struct chat *ch, const char *role, const char *content, size_t len)
{
    if (ch->n == ch->cap) {
        size_t cap = ch->cap ? 2 * ch->cap : 16;
        struct kvd_chat_msg *m = realloc(ch->msgs, cap * sizeof(*m));
        if (!m)
            return -1;
        ch->msgs = m;
        ch->cap = cap;
    }
    char *s = strndup(content, len);
    if (!s)
        return -1;
    ch->msgs[ch->n++] = (struct kvd_chat_msg){.role = role, .content = s};
    return 0;
}

static void chat_truncate(struct chat *ch, size_t n)
{
    while (ch->n > n)
        free((char *)ch->msgs[--ch->n].content);
}

static int chat_on_text(void *user, const uint32_t *t, size_t n, const char *text, size_t len)
{
    (void)user, (void)t, (void)n;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return chat_interrupted ? 1 : 0; /* non-zero: libkvd cancels the request */
}

int kvctl_cmd_chat(struct kvctl *k, int argc, char **argv)
{
    static const struct option opts[] = {
        {"system", required_argument, NULL, 'y'},
        {"max-tokens", required_argument, NULL, 'n'},
        {"temperature", required_argument, NULL, 't'},
        {"seed", required_argument, NULL, 'S'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    struct chat ch = {0};
    struct kvd_gen_opts go;
    const char *system = NULL;
    char *line = NULL;
    size_t line_cap = 0;
    uint64_t u;
    int c, rc = KVCTL_OK;
    kvd_gen_opts_init(&go);
    go.max_tokens = 512;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'y':
            system = optarg;
            break;
        case 'n':
            if (!kvctl_parse_u64(optarg, &u) || u == 0 || u > UINT32_MAX)
                return kvctl_usage_err("chat --max-tokens: \"%s\" is not a positive count", optarg);
            go.max_tokens = (uint32_t)u;
            break;
        case 't': {
            char *end;
            go.temperature = strtof(optarg, &end);
            if (!*optarg || *end || go.temperature < 0)
                return kvctl_usage_err("chat --temperature: \"%s\" is not a number >= 0", optarg);
            break;
        }
        case 'S':
            if (!kvctl_parse_u64(optarg, &go.seed))
                return kvctl_usage_err("chat --seed: \"%s\" is not a number", optarg);
            go.has_seed = true;
            break;
        case 'h':
            fputs(chat_help, stdout);
            return KVCTL_OK;
        default:
            fputs(chat_help, stderr);
            return KVCTL_EUSAGE;
        }
    }
    if (optind < argc)
        return kvctl_usage_err("chat: unexpected argument \"%s\"", argv[optind]);
    if ((rc = kvctl_connect(k)))
        return rc;
    struct kvd_hello_info hi;
    if (kvd_hello(k->ctx, &hi))
        return kvctl_fail(k, "chat");
    if (!hi.has_model || !hi.has_chat_template) {
        fprintf(stderr, "kvctl chat: the daemon %s\n",
                !hi.has_model ? "serves no model" : "has no chat template for its model");
        return KVCTL_ESERVER;
    }
    if (system && chat_add(&ch, "system", system, strlen(system)))
        goto oom;
    ch.n_keep = ch.n;
    if (kvd_seq_open(k->ctx, NULL, &ch.seq)) {
        rc = kvctl_fail(k, "chat: seq_open");
        goto out;
    }
    struct sigaction sa = {.sa_handler = on_sigint};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    bool tty = isatty(STDIN_FILENO);
    go.use_seq = true;
    go.seq = ch.seq;
    go.on_text = chat_on_text;
    for (;;) {
        if (tty) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        chat_interrupted = 0;
        errno = 0;
        ssize_t len = getline(&line, &line_cap, stdin);
        if (len < 0) {
            if (errno == EINTR && chat_interrupted) { /* Ctrl-C at the prompt: a new line */
                clearerr(stdin);
                putchar('\n');
                continue;
            }
            break;
        }
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = 0;
        if (len == 0)
            continue;
        if (strcmp(line, "/exit") == 0 || strcmp(line, "/quit") == 0)
            break;
        if (strcmp(line, "/reset") == 0) {
            chat_truncate(&ch, ch.n_keep);
            if (kvd_seq_close(k->ctx, ch.seq) || kvd_seq_open(k->ctx, NULL, &ch.seq)) {
                rc = kvctl_fail(k, "chat: /reset");
                goto out;
            }
            go.seq = ch.seq;
            if (tty)
                puts("(conversation reset)");
            continue;
        }
        if (chat_add(&ch, "user", line, (size_t)len))
            goto oom;
        struct kvd_gen_result res;
        if (kvd_chat(k->ctx, ch.msgs, ch.n, &go, &res)) {
            putchar('\n');
            rc = kvctl_fail(k, "chat");
            goto out;
        }
        putchar('\n');
        if (strcmp(res.finish_reason, "cancelled") == 0 && tty)
            puts("(cancelled)");
        /* The answer (also a cancelled one's part) is the next turn's history. */
        int arc = chat_add(&ch, "assistant", res.text ? res.text : "", res.text_len);
        kvd_gen_result_free(&res);
        if (arc)
            goto oom;
    }
    kvd_seq_close(k->ctx, ch.seq);
    goto out;
oom:
    fprintf(stderr, "kvctl chat: out of memory\n");
    rc = KVCTL_ESERVER;
out:
    signal(SIGINT, SIG_DFL);
    chat_truncate(&ch, 0);
    free(ch.msgs);
    free(line);
    return rc;
}
