/* options: the one table drives the defaults, the command line, the config
 * keys and --help. Every entry is reachable where it should be and refused
 * where it should not, its range is enforced at both ends, --help names every
 * command-line option with its default, and the shipped kvd.conf.example
 * names every [server] key the table has (and no other). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvd/protocol.h"
#include "kvd/status.h"
#include "log.h"
#include "kvstreams.h"
#include "options.h"

static void test_defaults(void **state)
{
    (void)state;
    struct options o;
    options_defaults(&o);
    assert_int_equal(o.backend, OPTIONS_BACKEND_AUTO);
    assert_int_equal(o.device_blocks, 0);
    assert_int_equal(o.host_blocks, UINT32_MAX);
    assert_int_equal(o.geom.layers, 4);
    assert_int_equal(o.geom.kv_heads, 4);
    assert_int_equal(o.geom.head_dim, 64);
    assert_int_equal(o.geom.dtype, KV_F16);
    assert_int_equal(o.geom.block_tokens, 16);
    assert_int_equal(o.max_frame, KVD_MAX_FRAME_DEFAULT);
    assert_int_equal(o.max_conns, 1024);
    assert_int_equal(o.max_conns_per_uid, 64);
    assert_int_equal(o.admin_reserved_conns, 8);
    assert_int_equal(o.max_queued_per_conn, 1024);
    assert_int_equal(o.max_queued_per_tenant, 4096);
    assert_int_equal(o.max_unread_output, 16 << 20);
    assert_int_equal(o.max_buffered, 1 << 30);
    assert_int_equal(o.metrics_max_conns, 16);
    assert_int_equal(o.step_tokens, 512);
    assert_int_equal(o.step_seqs, 64);
    assert_int_equal(o.queue_timeout_ms, 60000);
    assert_int_equal(o.log_level, LOG_LVL_INFO);
    assert_true(o.roofline_probe);
    assert_false(o.metrics_force || o.help || o.version);
    assert_string_equal(o.socket_path, "");
    assert_string_equal(o.metrics_addr, "");
}

/* Every KV dtype by name, in the enum's order; an unknown one is refused. */
static void test_kv_dtypes(void **state)
{
    (void)state;
    static const char *names[] = {"f16", "bf16", "f32", "q8_0", "fp8"};
    struct kvd_error err = {0};
    for (int i = 0; i < 5; i++) {
        struct options o;
        options_defaults(&o);
        assert_int_equal(options_set(&o, "kv-dtype", names[i], &err), 0);
        assert_int_equal(o.geom.dtype, i);
        assert_string_equal(kv_dtype_name(o.geom.dtype), names[i]);
    }
    struct options o;
    options_defaults(&o);
    assert_int_equal(options_set(&o, "kv-dtype", "q4_0", &err), KVD_EBADREQ);
}

/* A valid value for d, and (when there is one) an invalid one. */
static void samples(const struct options_def *d, char *ok, char *bad_v, size_t cap)
{
    bad_v[0] = '\0';
    switch (d->kind) {
    case OPTIONS_PATH:
        snprintf(ok, cap, "/tmp/x");
        snprintf(bad_v, cap, "relative/x");
        break;
    case OPTIONS_STR:
        snprintf(ok, cap, "x");
        memset(bad_v, 'a', d->cap); /* one byte too long */
        bad_v[d->cap] = '\0';
        break;
    case OPTIONS_U32:
    case OPTIONS_SIZE:
    case OPTIONS_SIZE32:
        snprintf(ok, cap, "%llu", (unsigned long long)d->hi);
        if (d->hi < UINT64_MAX)
            snprintf(bad_v, cap, "%llu", (unsigned long long)d->hi + 1);
        break;
    case OPTIONS_FRACTION:
        snprintf(ok, cap, "0.5");
        snprintf(bad_v, cap, "1.5");
        break;
    case OPTIONS_BOOL:
        snprintf(ok, cap, "no");
        snprintf(bad_v, cap, "maybe");
        break;
    case OPTIONS_OFF_FLAG:
        ok[0] = '\0';
        break;
    case OPTIONS_CHOICE: {
        snprintf(ok, cap, "%s", strrchr(d->choices, '|') + 1); /* not the default */
        snprintf(bad_v, cap, "nonsense");
        break;
    }
    case OPTIONS_LOG_LEVEL:
        snprintf(ok, cap, "debug");
        snprintf(bad_v, cap, "loud");
        break;
    case OPTIONS_METRICS:
        snprintf(ok, cap, "127.0.0.1:9464");
        snprintf(bad_v, cap, "nowhere");
        break;
    case OPTIONS_TCP_ADDR:
        snprintf(ok, cap, "127.0.0.1:8080");
        snprintf(bad_v, cap, "unix:/tmp/x.sock");
        break;
    case OPTIONS_MODEL:
        snprintf(ok, cap, "/tmp/x.gguf");
        snprintf(bad_v, cap, "bad name=/tmp/x.gguf");
        break;
    case OPTIONS_SECONDS:
        snprintf(ok, cap, "60");
        snprintf(bad_v, cap, "soon");
        break;
    }
}

/* --model NAME=PATH and [model:NAME] keys make models[] entries; a plain
 * path is model_path, as it always was. */
static void test_models(void **state)
{
    (void)state;
    struct kvd_error err = {0};
    struct options o;
    options_defaults(&o);
    assert_int_equal(o.keep_alive_s, 300);
    assert_int_equal(options_set(&o, "model", "/m/plain.gguf", &err), 0);
    assert_string_equal(o.model_path, "/m/plain.gguf");
    assert_int_equal(o.n_models, 0);
    assert_int_equal(options_set(&o, "model", "coder=/m/coder.gguf", &err), 0);
    assert_int_equal(options_set(&o, "model", "chat:7b=/m/chat.gguf", &err), 0);
    assert_int_equal(o.n_models, 2);
    assert_string_equal(o.models[0].name, "coder");
    assert_string_equal(o.models[0].path, "/m/coder.gguf");
    assert_int_equal(o.models[0].kv_dtype, -1);
    assert_int_equal(o.models[0].keep_alive_s, OPTIONS_KEEP_DEFAULT);
    assert_string_equal(o.models[1].name, "chat:7b");
    /* a path with '=' after a '/' is a path */
    assert_int_equal(options_set(&o, "model", "/m/a=b.gguf", &err), 0);
    assert_string_equal(o.model_path, "/m/a=b.gguf");
    assert_int_equal(o.n_models, 2);
    /* the same name again: its path changes, no new entry */
    assert_int_equal(options_set(&o, "model", "coder=/m/coder2.gguf", &err), 0);
    assert_int_equal(o.n_models, 2);
    assert_string_equal(o.models[0].path, "/m/coder2.gguf");
    assert_int_equal(options_set(&o, "model", "x=rel.gguf", &err), KVD_EBADREQ);
    assert_int_equal(options_set(&o, "model", "sp ace=/m/x.gguf", &err), KVD_EBADREQ);

    assert_int_equal(options_model_set(&o, "coder", "kv-dtype", "q8_0", &err), 0);
    assert_int_equal(o.models[0].kv_dtype, KV_Q8_0);
    assert_int_equal(options_model_set(&o, "coder", "keep-alive-s", "forever", &err), 0);
    assert_int_equal(o.models[0].keep_alive_s, OPTIONS_KEEP_FOREVER);
    assert_int_equal(options_model_set(&o, "coder", "keep-alive-s", "0", &err), 0);
    assert_int_equal(o.models[0].keep_alive_s, 0);
    assert_int_equal(options_model_set(&o, "coder", "preload", "yes", &err), 0);
    assert_true(o.models[0].preload);
    assert_int_equal(options_model_set(&o, "coder", "tenants", "alice, bob", &err), 0);
    assert_string_equal(o.models[0].tenants, "alice, bob");
    assert_int_equal(options_model_set(&o, "coder", "max-device-bytes", "2G", &err), 0);
    assert_int_equal(o.models[0].max_device_bytes, 2ull << 30);
    /* speculative decoding: its draft (another model, by name) and its kind */
    assert_int_equal(o.models[0].draft[0], '\0');
    assert_int_equal(o.models[0].speculative, -1);
    assert_int_equal(options_model_set(&o, "coder", "draft", "coder-small", &err), 0);
    assert_string_equal(o.models[0].draft, "coder-small");
    assert_int_equal(options_model_set(&o, "coder", "speculative", "draft", &err), 0);
    assert_int_equal(o.models[0].speculative, OPTIONS_SPEC_DRAFT);
    assert_int_equal(options_model_set(&o, "coder", "draft", "coder", &err), KVD_EBADREQ);
    assert_non_null(strstr(err.message, "its own draft"));
    assert_int_equal(options_model_set(&o, "coder", "draft", "/m/x.gguf", &err), KVD_EBADREQ);
    assert_non_null(strstr(err.message, "draft"));
    assert_int_equal(options_model_set(&o, "coder", "speculative", "maybe", &err), KVD_EBADREQ);
    assert_non_null(strstr(err.message, "speculative"));
    /* its own KV events stream; an empty topic set is a topic of its own */
    assert_false(o.models[0].kv_events_topic_set);
    assert_int_equal(options_model_set(&o, "coder", "kv-events", "tcp://10.0.0.5:5559", &err), 0);
    assert_string_equal(o.models[0].kv_events, "tcp://10.0.0.5:5559");
    assert_int_equal(
        options_model_set(&o, "coder", "kv-events-replay", "ipc:///run/kvd/r.sock", &err), 0);
    assert_string_equal(o.models[0].kv_events_replay, "ipc:///run/kvd/r.sock");
    assert_int_equal(options_model_set(&o, "coder", "kv-events-topic", "", &err), 0);
    assert_true(o.models[0].kv_events_topic_set);
    assert_string_equal(o.models[0].kv_events_topic, "");
    char longv[300];
    memset(longv, 'x', sizeof longv - 1);
    longv[sizeof longv - 1] = '\0';
    assert_int_equal(options_model_set(&o, "coder", "kv-events-topic", longv, &err), KVD_EBADREQ);
    assert_non_null(strstr(err.message, "kv-events-topic"));
    /* {model} in a topic: the model's name, every time; 255 bytes at most */
    char t[256];
    assert_int_equal(kvstreams_topic("kv@node-a@{model}", "coder", t, sizeof t), 0);
    assert_string_equal(t, "kv@node-a@coder");
    assert_int_equal(kvstreams_topic("{model}/{model}{mod", "m", t, sizeof t), 0);
    assert_string_equal(t, "m/m{mod");
    assert_int_equal(kvstreams_topic("", "m", t, sizeof t), 0);
    assert_string_equal(t, "");
    longv[250] = '\0';
    assert_int_equal(kvstreams_topic(longv, "m", t, sizeof t), 0);
    strcpy(longv + 250, "{model}"); /* 250 + 5 bytes fit, 252 + 5 do not */
    assert_int_equal(kvstreams_topic(longv, "coder", t, sizeof t), 0);
    assert_int_equal(strlen(t), 255);
    strcpy(longv + 252, "{model}");
    assert_int_equal(kvstreams_topic(longv, "coder", t, sizeof t), KVD_EBADREQ);
    assert_int_equal(options_model_set(&o, "new", "path", "/m/new.gguf", &err), 0);
    assert_int_equal(o.n_models, 3);
    /* each bad value names its key */
    assert_int_equal(options_model_set(&o, "coder", "kv-dtype", "q4", &err), KVD_EBADREQ);
    assert_non_null(strstr(err.message, "kv-dtype"));
    assert_int_equal(options_model_set(&o, "coder", "keep-alive-s", "-1", &err), KVD_EBADREQ);
    assert_int_equal(options_model_set(&o, "coder", "preload", "maybe", &err), KVD_EBADREQ);
    assert_int_equal(options_model_set(&o, "coder", "path", "rel", &err), KVD_EBADREQ);
    assert_int_equal(options_model_set(&o, "coder", "colour", "red", &err), KVD_EBADREQ);
    assert_non_null(strstr(err.message, "unknown key"));
    assert_int_equal(options_model_set(&o, "b@d", "path", "/m/x", &err), KVD_EBADREQ);
    for (int i = (int)o.n_models; i < OPTIONS_MAX_MODELS; i++) {
        char name[16];
        snprintf(name, sizeof name, "m%d", i);
        assert_int_equal(options_model_set(&o, name, "path", "/m/x", &err), 0);
    }
    assert_int_equal(options_model_set(&o, "one-too-many", "path", "/m/x", &err), KVD_EBADREQ);
}

static int parse(struct options *o, const char *a0, const char *a1)
{
    struct kvd_error err = {0};
    char *argv[] = {"kvd", (char *)a0, (char *)a1, NULL};
    options_defaults(o);
    int rc = options_parse(o, a1 ? 3 : 2, argv, &err);
    if (rc) /* the error value carries the code returned, and says why */
        assert_true(err.code == rc && err.message[0] != '\0');
    return rc;
}

static void test_every_entry_where_it_belongs(void **state)
{
    (void)state;
    char ok[8192], bad_v[8192], opt[128];
    struct kvd_error err = {0};
    struct options o, d0;
    options_defaults(&d0);
    for (size_t i = 0; i < options_n_defs; i++) {
        const struct options_def *d = &options_defs[i];
        bool flag = d->kind == OPTIONS_BOOL || d->kind == OPTIONS_OFF_FLAG;
        samples(d, ok, bad_v, sizeof(ok));
        snprintf(opt, sizeof(opt), "--%s", d->name);

        /* the command line */
        int rc = parse(&o, opt, flag ? NULL : ok);
        if (d->flags & OPTIONS_FILE_ONLY) {
            assert_int_equal(rc, KVD_EBADREQ);
        } else {
            if (rc != 0)
                fail_msg("%s %s refused", opt, flag ? "" : ok);
            if (!memcmp(&o, &d0, sizeof(o)))
                fail_msg("%s changed nothing", opt);
            if (!flag && bad_v[0])
                assert_int_equal(parse(&o, opt, bad_v), KVD_EBADREQ);
            if (!flag) /* a value is required */
                assert_int_equal(parse(&o, opt, NULL), KVD_EBADREQ);
        }

        /* the config file ('_' spelling too) */
        char key[128];
        snprintf(key, sizeof(key), "%s", d->name);
        for (char *c = key; *c; c++)
            *c = *c == '-' ? '_' : *c;
        options_defaults(&o);
        const char *v = d->kind == OPTIONS_OFF_FLAG ? NULL : flag ? "yes" : ok;
        rc = options_set_key(&o, key, v, &err);
        if (d->flags & OPTIONS_CLI_ONLY) {
            assert_int_equal(rc, KVD_EBADREQ);
            assert_int_equal(err.code, KVD_EBADREQ);
            assert_non_null(strstr(err.message, "command line"));
        } else {
            if (rc != 0)
                fail_msg("config key %s = %s refused: %s", key, v ? v : "(none)", err.message);
            if (bad_v[0])
                assert_int_equal(options_set_key(&o, key, bad_v, &err), KVD_EBADREQ);
        }
    }
    assert_int_equal(options_set_key(&o, "no-such-key", "1", &err), KVD_EBADREQ);
    assert_int_equal(parse(&o, "--no-such-option", NULL), KVD_EBADREQ);
    assert_int_equal(parse(&o, "stray", NULL), KVD_EBADREQ);
}

/* The --help text, in CMocka setup/teardown: freed also when an assert
 * fails. */
static int help_setup(void **state)
{
    *state = calloc(1, sizeof(char *));
    return *state ? 0 : -1;
}

static int help_teardown(void **state)
{
    char **text = *state;
    if (text)
        free(*text);
    free(text);
    return 0;
}

static void test_help_lists_every_option(void **state)
{
    char **help = *state;
    size_t len = 0;
    FILE *f = open_memstream(help, &len);
    assert_non_null(f);
    options_usage(f);
    fclose(f);
    const char *text = *help;
    for (size_t i = 0; i < options_n_defs; i++) {
        const struct options_def *d = &options_defs[i];
        char want[160];
        snprintf(want, sizeof(want), "--%s%s%s", d->name, d->arg ? " " : "", d->arg ? d->arg : "");
        if ((d->flags & OPTIONS_FILE_ONLY) == 0 && !strstr(text, want))
            fail_msg("--help does not show '%s'", want);
        const char *dflt = d->shown ? d->shown : d->dflt;
        if ((d->flags & OPTIONS_FILE_ONLY) == 0 && dflt) {
            snprintf(want, sizeof(want), "(default %s)", dflt);
            const char *at = strstr(text, d->name);
            const char *next = at ? strstr(at, "\n  -") : NULL;
            const char *hit = at ? strstr(at, want) : NULL;
            if (!hit || (next && hit > next))
                fail_msg("--help shows no '%s' for --%s", want, d->name);
        }
    }
}

static void test_example_config_names_every_key(void **state)
{
    (void)state;
    FILE *f = fopen(KVD_SOURCE_DIR "/systemd/kvd.conf.example", "r");
    assert_non_null(f);
    static char text[65536];
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = '\0';
    char *server = strstr(text, "\n[server]\n"), *end = server ? strstr(server + 1, "\n[") : NULL;
    assert_non_null(server);
    if (end)
        *end = '\0';
    /* every [server] key of the table is there, set or in a comment */
    for (size_t i = 0; i < options_n_defs; i++) {
        const struct options_def *d = &options_defs[i];
        char want[128];
        snprintf(want, sizeof(want), "%s =", d->name);
        if (!(d->flags & OPTIONS_CLI_ONLY) && !strstr(server, want))
            fail_msg("kvd.conf.example's [server] does not mention '%s'", d->name);
    }
    /* and every key set there is a [server] key */
    struct options o;
    options_defaults(&o);
    struct kvd_error err = {0};
    for (char *line = strtok(server, "\n"); line; line = strtok(NULL, "\n")) {
        char key[64], val[512];
        if (sscanf(line, " %63[a-z_-] = %511[^\n]", key, val) == 2 &&
            options_set_key(&o, key, val, &err) != 0)
            fail_msg("kvd.conf.example: %s", err.message);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_kv_dtypes),
        cmocka_unit_test(test_every_entry_where_it_belongs),
        cmocka_unit_test(test_models),
        cmocka_unit_test_setup_teardown(test_help_lists_every_option, help_setup, help_teardown),
        cmocka_unit_test(test_example_config_names_every_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
