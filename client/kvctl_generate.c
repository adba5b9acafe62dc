/* kvctl generate: sends a prompt (token ids, or text the daemon tokenizes)
 * to the daemon's executor and prints the generated ids as one
 * comma-separated line, or with --text the completion's text (as they
 * arrive with --stream), or the whole reply as JSON with --json. */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvctl.h"

static const char gen_help[] =
    "usage: kvctl generate (--tokens 1,2,3 | --text TEXT) [--max-tokens N]\n"
    "                      [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
    "                      [--stop 1,2] [--stop-text STR]... [--ignore-eos]\n"
    "                      [--priority P] [--session NAME [--session-ttl S]]\n"
    "                      [--stream] [--json] [-v]\n"
    "Generates from the prompt token ids and prints the generated ids as one\n"
    "comma-separated line; with --text (the prompt as text, tokenized by the\n"
    "daemon with the model's tokenizer) prints the completion's text.\n"
    "--stream prints them as they arrive. Generation stops at the model's\n"
    "end-of-generation tokens unless --ignore-eos, at --stop ids, and at a\n"
    "--stop-text string (cut from the text).\n"
    "--session continues the named session's conversation (the prompt is\n"
    "appended; without one, generates after it) and saves it grown (the daemon\n"
    "needs --disk-dir); -v says what was saved.\n"
    "--json prints the reply (tokens, finish_reason, usage, timing) as JSON.\n"
    "-v adds a summary line on stderr. Needs a daemon serving a model: a daemon\n"
    "in store mode answers `unsupported` (exit 1).\n";

struct gen_stream {
    size_t printed; /* ids printed so far: a comma goes before the next */
    size_t text;    /* text bytes printed so far */
};

static int on_text(void *user, const uint32_t *t, size_t n, const char *text, size_t len)
{
    struct gen_stream *s = user;
    (void)t;
    s->printed += n;
    fwrite(text, 1, len, stdout);
    s->text += len;
    fflush(stdout);
    return 0;
}

static int on_tokens(void *user, const uint32_t *t, size_t n)
{
    struct gen_stream *s = user;
    kvctl_print_tokens(stdout, t, n, s->printed > 0);
    s->printed += n;
    fflush(stdout);
    return 0;
}

static bool parse_float(const char *s, float *out)
{
    char *end;
    float v = strtof(s, &end);
    if (!*s || *end)
        return false;
    *out = v;
    return true;
}

int kvctl_cmd_generate(struct kvctl *k, int argc, char **argv)
{
    static const struct option opts[] = {
        {"tokens", required_argument, NULL, 'T'},
        {"text", required_argument, NULL, 'x'},
        {"stop-text", required_argument, NULL, 'X'},
        {"ignore-eos", no_argument, NULL, 'E'},
        {"max-tokens", required_argument, NULL, 'n'},
        {"temperature", required_argument, NULL, 't'},
        {"top-k", required_argument, NULL, 'k'},
        {"top-p", required_argument, NULL, 'p'},
        {"seed", required_argument, NULL, 'S'},
        {"stop", required_argument, NULL, 's'},
        {"priority", required_argument, NULL, 'P'},
        {"session", required_argument, NULL, 'N'},
        {"session-ttl", required_argument, NULL, 'L'},
        {"stream", no_argument, NULL, 'r'},
        {"json", no_argument, NULL, 'j'},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    struct kvd_gen_opts go;
    struct kvd_gen_result res = {0};
    struct gen_stream st = {0};
    uint32_t *prompt = NULL, *stop = NULL;
    size_t n_prompt = 0;
    bool json = false, verbose = false, stream = false, have_tokens = false;
    const char *text = NULL;
    const char *stop_strs[64];
    char err[256];
    uint64_t u;
    int c, rc = KVCTL_OK;

    kvd_gen_opts_init(&go);
    optind = 1;
    while ((c = getopt_long(argc, argv, "hv", opts, NULL)) != -1) {
        switch (c) {
        case 'T':
            free(prompt);
            if (kvctl_parse_tokens(optarg, &prompt, &n_prompt, err, sizeof(err))) {
                rc = kvctl_usage_err("generate --tokens: %s", err);
                goto out;
            }
            have_tokens = true;
            break;
        case 'x':
            text = optarg;
            break;
        case 'X':
            if (go.n_stop_strs == sizeof(stop_strs) / sizeof(stop_strs[0]) || !*optarg) {
                rc = kvctl_usage_err("generate --stop-text: at most 64 non-empty strings");
                goto out;
            }
            stop_strs[go.n_stop_strs++] = optarg;
            go.stop_strs = stop_strs;
            break;
        case 'E':
            go.ignore_eos = true;
            break;
        case 'n':
            if (!kvctl_parse_u64(optarg, &u) || u == 0 || u > UINT32_MAX) {
                rc = kvctl_usage_err("generate --max-tokens: \"%s\" is not a positive count",
                                     optarg);
                goto out;
            }
            go.max_tokens = (uint32_t)u;
            break;
        case 't':
            if (!parse_float(optarg, &go.temperature) || go.temperature < 0) {
                rc = kvctl_usage_err("generate --temperature: \"%s\" is not a number >= 0", optarg);
                goto out;
            }
            break;
        case 'k':
            if (!kvctl_parse_u64(optarg, &u) || u > INT32_MAX) {
                rc = kvctl_usage_err("generate --top-k: \"%s\" is not a count", optarg);
                goto out;
            }
            go.top_k = (int32_t)u;
            break;
        case 'p':
            if (!parse_float(optarg, &go.top_p) || go.top_p < 0 || go.top_p > 1) {
                rc = kvctl_usage_err("generate --top-p: \"%s\" is not in [0, 1]", optarg);
                goto out;
            }
            break;
        case 'S':
            if (!kvctl_parse_u64(optarg, &go.seed)) {
                rc = kvctl_usage_err("generate --seed: \"%s\" is not a number", optarg);
                goto out;
            }
            go.has_seed = true;
            break;
        case 's':
            free(stop);
            if (kvctl_parse_tokens(optarg, &stop, &go.n_stop, err, sizeof(err))) {
                rc = kvctl_usage_err("generate --stop: %s", err);
                goto out;
            }
            go.stop = stop;
            break;
        case 'P': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (!*optarg || *end || v < INT32_MIN || v > INT32_MAX) {
                rc = kvctl_usage_err("generate --priority: \"%s\" is not an integer", optarg);
                goto out;
            }
            go.priority = (int32_t)v;
            break;
        }
        case 'N':
            go.session = optarg;
            break;
        case 'L': {
            char *end;
            unsigned long long v = strtoull(optarg, &end, 10);
            if (!*optarg || *optarg == '-' || *end || v < 1 || v > UINT32_MAX) {
                rc = kvctl_usage_err("generate --session-ttl: \"%s\" is not a number of seconds",
                                     optarg);
                goto out;
            }
            go.session_ttl_s = (uint32_t)v;
            break;
        }
        case 'r':
            stream = true;
            break;
        case 'j':
            json = true;
            break;
        case 'v':
            verbose = true;
            break;
        case 'h':
            fputs(gen_help, stdout);
            goto out;
        default:
            fputs(gen_help, stderr);
            rc = KVCTL_EUSAGE;
            goto out;
        }
    }
    if (optind < argc) {
        rc = kvctl_usage_err("generate: unexpected argument \"%s\"", argv[optind]);
        goto out;
    }
    if (go.session_ttl_s && !go.session) {
        rc = kvctl_usage_err("generate: --session-ttl needs --session");
        goto out;
    }
    if ((have_tokens && text) || (!have_tokens && !text && !go.session) ||
        (have_tokens && !n_prompt)) {
        rc = kvctl_usage_err(
            "generate: --tokens is required (prompt token ids, e.g. 1,2,3), or --text "
            "(or --session alone)");
        goto out;
    }
    if ((rc = kvctl_connect(k)))
        goto out;

    if (json) {
        /* The reply as the daemon sent it: go through the generic call. */
        struct kvd_reply *r = NULL;
        uint64_t id;
        if (stream) {
            go.on_tokens = on_tokens;
            go.user = &st;
        }
        int src = text ? kvd_generate_text_send(k->ctx, text, &go, &id)
                       : kvd_generate_send(k->ctx, prompt, n_prompt, &go, &id);
        if (src || (kvd_wait(k->ctx, id, &r) && !r)) {
            rc = kvctl_fail(k, "generate");
            goto out;
        }
        if (r->err) {
            kvd_reply_free(r);
            if (st.printed)
                putchar('\n');
            rc = kvctl_fail(k, "generate");
            goto out;
        }
        if (st.printed)
            putchar('\n');
        char *s = kvd_value_json(r->body);
        puts(s ? s : "null");
        kvd_free(s);
        kvd_reply_free(r);
        goto out;
    }
    if (stream) {
        if (text)
            go.on_text = on_text;
        else
            go.on_tokens = on_tokens;
        go.user = &st;
    }
    int grc = text ? kvd_generate_text(k->ctx, text, &go, &res)
                   : kvd_generate(k->ctx, prompt, n_prompt, &go, &res);
    if (grc) {
        if (st.printed || st.text)
            putchar('\n');
        rc = kvctl_fail(k, "generate");
        goto out;
    }
    if (text) {
        /* The streamed pieces add up to the reply's text; print what the
         * stream did not. */
        if (res.text && res.text_len > st.text)
            fwrite(res.text + st.text, 1, res.text_len - st.text, stdout);
        putchar('\n');
    } else if (stream) {
        /* Events carried every token; the reply repeats them all. Print any
         * the stream did not (a daemon may send the last ones only there). */
        if (res.n_tokens > st.printed)
            kvctl_print_tokens(stdout, res.tokens + st.printed, res.n_tokens - st.printed,
                               st.printed > 0);
        putchar('\n');
    } else {
        kvctl_print_tokens(stdout, res.tokens, res.n_tokens, false);
        putchar('\n');
    }
    if (verbose)
        fprintf(stderr,
                "finish: %s; tokens: prompt %" PRIu32 " (cached %" PRIu32 "), completion %" PRIu32
                "; queue %.1f ms, first token %.1f ms, total %.1f ms\n",
                res.finish_reason, res.prompt_tokens, res.cached_tokens, res.completion_tokens,
                res.queue_ms, res.ttft_ms, res.total_ms);
    if (verbose && res.session_saved == 1)
        fprintf(stderr, "session %s: saved, %" PRIu32 " tokens, expires at %" PRIu64 "\n",
                go.session, res.session_tokens, res.session_expires);
    else if (res.session_saved == 0)
        fprintf(stderr, "kvctl: session %s was not saved: %s\n", go.session, res.session_error);
out:
    kvd_gen_result_free(&res);
    free(prompt);
    free(stop);
    return rc;
}
