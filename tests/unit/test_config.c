/* Unit tests of config_load: identities are never cut (two
 * tenants whose names share their first 50 bytes stay two tenants, a name
 * over the documented 63 bytes is refused), a line is read whole or refused
 * naming its line (the tail of a long comment is never parsed as a
 * directive), and a path that is not a regular file is an error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "kvd/status.h"

static char path[64];

static void write_file(const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* Loads text; returns config_load's code, err gets the message (the error
 * value's code is the one returned). */
static int load(const char *text, struct config *cfg, char *err, size_t errlen)
{
    struct kvd_error e = {0};
    write_file(text);
    assert_int_equal(config_defaults(cfg), 0);
    int rc = config_load(path, cfg, NULL, &e);
    if (rc)
        assert_int_equal(e.code, rc);
    snprintf(err, errlen, "%s", e.message);
    return rc;
}

static bool is_admin(const struct config *cfg, uid_t uid)
{
    struct config_identity id;
    return config_resolve(cfg, uid, 65534, &id) == 0 && id.admin;
}

/* The config under test and a text buffer, in CMocka setup/teardown: freed
 * also after a failed assert (config_free is safe on a freed config). */
struct cfx {
    struct config cfg;
    char *text; /* (16384) */
};

static int cfx_setup(void **state)
{
    struct cfx *f = calloc(1, sizeof *f);
    *state = f;
    if (!f || !(f->text = malloc(16384)))
        return -1;
    return 0;
}

static int cfx_teardown(void **state)
{
    struct cfx *f = *state;
    if (f) {
        config_free(&f->cfg);
        free(f->text);
        free(f);
    }
    return 0;
}

static void test_long_tenant_names_stay_distinct(void **state)
{
    struct cfx *f = *state;
    char a[64], b[64], text[512], err[512];
    memset(a, 'a', 51);
    a[51] = '\0';
    memcpy(b, a, 52);
    b[50] = 'b'; /* differs only in byte 51 */
    snprintf(text, sizeof(text), "[tenant:%s]\nuids = 1001\n[tenant:%s]\nuids = 1002\n", a, b);
    assert_int_equal(load(text, &f->cfg, err, sizeof(err)), 0);
    assert_int_equal(f->cfg.n_tenants, 2);
    struct config_identity ia, ib;
    assert_int_equal(config_resolve(&f->cfg, 1001, 65534, &ia), 0);
    assert_int_equal(config_resolve(&f->cfg, 1002, 65534, &ib), 0);
    assert_string_equal(ia.conf.name, a);
    assert_string_equal(ib.conf.name, b);
    config_free(&f->cfg);

    /* the documented limit, 63 bytes, is accepted whole */
    memset(a, 'c', 63);
    a[63] = '\0';
    snprintf(text, sizeof(text), "[tenant:%s]\nuids = 1003\n", a);
    assert_int_equal(load(text, &f->cfg, err, sizeof(err)), 0);
    struct config_identity ic;
    assert_int_equal(config_resolve(&f->cfg, 1003, 65534, &ic), 0);
    assert_string_equal(ic.conf.name, a);
    config_free(&f->cfg);

    /* one byte more is an error naming the section */
    snprintf(text, sizeof(text), "[tenant:%sd]\nuids = 1003\n", a);
    assert_int_equal(load(text, &f->cfg, err, sizeof(err)), KVD_EBADREQ);
    assert_non_null(strstr(err, "1-63"));
    config_free(&f->cfg);
}

static void test_long_lines_read_whole(void **state)
{
    struct cfx *f = *state;
    char *text = f->text, err[512];
    assert_non_null(text);

    /* a 300-byte comment ending in a directive stays a comment */
    int n = snprintf(text, 16384, "[admin]\nuids = 0\n# ");
    memset(text + n, 'x', 300);
    n += 300;
    snprintf(text + n, 16384 - (size_t)n, " uids = 1001\n");
    assert_int_equal(load(text, &f->cfg, err, sizeof(err)), 0);
    assert_false(is_admin(&f->cfg, 1001));
    assert_true(is_admin(&f->cfg, 0));
    config_free(&f->cfg);

    /* a legitimate 600-byte uids list is read whole */
    n = snprintf(text, 16384, "[admin]\nuids = 0");
    for (unsigned u = 2000; u < 2120; u++)
        n += snprintf(text + n, 16384 - (size_t)n, ", %u", u);
    snprintf(text + n, 16384 - (size_t)n, "\n");
    assert_true(n > 600);
    assert_int_equal(load(text, &f->cfg, err, sizeof(err)), 0);
    assert_int_equal(f->cfg.n_admin, 121);
    assert_true(is_admin(&f->cfg, 2119));
    config_free(&f->cfg);

    /* over CONFIG_MAX_LINE: an error naming the line, nothing parsed */
    n = snprintf(text, 16384, "[admin]\nuids = 0\n# ");
    memset(text + n, 'y', CONFIG_MAX_LINE);
    n += CONFIG_MAX_LINE;
    snprintf(text + n, 16384 - (size_t)n, " uids = 1001\n");
    assert_int_equal(load(text, &f->cfg, err, sizeof(err)), KVD_EBADREQ);
    assert_non_null(strstr(err, ":3: line of"));
    config_free(&f->cfg);
}

static void test_not_a_regular_file(void **state)
{
    struct cfx *f = *state;
    struct kvd_error err = {0};
    assert_int_equal(config_defaults(&f->cfg), 0);
    assert_int_equal(config_load("/tmp", &f->cfg, NULL, &err), KVD_EBADREQ);
    assert_int_equal(err.code, KVD_EBADREQ);
    assert_non_null(strstr(err.message, "not a regular file"));
    assert_int_equal(config_load("/nonexistent/kvd.conf", &f->cfg, NULL, &err), KVD_EBADREQ);
    assert_non_null(strstr(err.message, "cannot read the file"));
    config_free(&f->cfg);
}

/* The first error is the one reported (the line and its reason agree). */
static void test_first_error_reported(void **state)
{
    struct cfx *f = *state;
    char err[512];
    assert_int_equal(load("[limits]\nmax-seqs = lots\n[bogus]\nx = 1\n", &f->cfg, err, sizeof(err)),
                     KVD_EBADREQ);
    assert_non_null(strstr(err, ":2: [limits] max-seqs"));
    config_free(&f->cfg);
}

/* An indented line after `uids = 0` under [admin] would be, to libinih
 * (INI_ALLOW_MULTILINE), a continuation making uid 1000 an admin: it is a
 * start-up error naming the line; indented comments and blank lines are
 * fine, and without the indentation the file loads. */
static void test_indented_continuation_refused(void **state)
{
    struct cfx *f = *state;
    char err[512];
    assert_int_equal(load("[admin]\nuids = 0\n  1000\n", &f->cfg, err, sizeof(err)), KVD_EBADREQ);
    assert_non_null(strstr(err, ":3: an indented line (\"1000\")"));
    config_free(&f->cfg);
    assert_int_equal(load("[admin]\nuids = 0\n\t[limits]\n", &f->cfg, err, sizeof(err)),
                     KVD_EBADREQ);
    assert_non_null(strstr(err, ":3: an indented line"));
    config_free(&f->cfg);
    assert_int_equal(load("[admin]\nuids = 0\n  ; a comment\n   \n", &f->cfg, err, sizeof(err)), 0);
    assert_int_equal(f->cfg.n_admin, 1);
    assert_int_equal(f->cfg.admin_uids[0], 0);
    config_free(&f->cfg);
    assert_int_equal(load("[admin]\nuids = 0, 1000\n", &f->cfg, err, sizeof(err)), 0);
    assert_int_equal(f->cfg.n_admin, 2);
    config_free(&f->cfg);
}

/* [tenant:NAME] events = on | hashes | off (off when unset; [limits]
 * gives the default of unlisted uids); anything else is refused. */
/* [model:NAME] sections become the options' models; a reload (no
 * options) checks them the same; a bad key names its section and line. */
static void test_model_sections(void **state)
{
    struct cfx *f = *state;
    struct kvd_error e = {0};
    static struct options o;
    char err[512];
    write_file("[server]\nkeep-alive-s = 60\ndevice-bytes = 1G\n"
               "[model:chat]\npath = /m/chat.gguf\npreload = yes\n"
               "[model:coder:7b]\npath = /m/coder.gguf\nkv-dtype = q8_0\n"
               "keep-alive-s = forever\ntenants = a, b\nmax-device-bytes = 512M\n");
    options_defaults(&o);
    assert_int_equal(config_defaults(&f->cfg), 0);
    assert_int_equal(config_load(path, &f->cfg, &o, &e), 0);
    assert_int_equal(o.keep_alive_s, 60);
    assert_int_equal(o.device_bytes, 1ull << 30);
    assert_int_equal(o.n_models, 2);
    assert_string_equal(o.models[0].name, "chat");
    assert_true(o.models[0].preload);
    assert_string_equal(o.models[1].name, "coder:7b");
    assert_int_equal(o.models[1].kv_dtype, KV_Q8_0);
    assert_int_equal(o.models[1].keep_alive_s, OPTIONS_KEEP_FOREVER);
    assert_string_equal(o.models[1].tenants, "a, b");
    assert_int_equal(o.models[1].max_device_bytes, 512ull << 20);
    /* a reload checks them too */
    config_free(&f->cfg);
    assert_int_equal(load("[model:x]\npath = /m/x.gguf\n", &f->cfg, err, sizeof err), 0);
    config_free(&f->cfg);
    assert_int_equal(load("[model:x]\npath = /m/x.gguf\ncolour = red\n", &f->cfg, err, sizeof err),
                     KVD_EBADREQ);
    assert_non_null(strstr(err, ":3:"));
    assert_non_null(strstr(err, "colour"));
    config_free(&f->cfg);
    assert_int_equal(load("[model:b@d]\npath = /m/x.gguf\n", &f->cfg, err, sizeof err),
                     KVD_EBADREQ);
    config_free(&f->cfg);
    assert_int_equal(load("[model:x]\nkv-dtype = q4\n", &f->cfg, err, sizeof err), KVD_EBADREQ);
    assert_non_null(strstr(err, "kv-dtype"));
}

static void test_events_key(void **state)
{
    struct cfx *f = *state;
    char err[512];
    struct config_identity i;
    assert_int_equal(load("[limits]\nevents = hashes\n[tenant:a]\nuids = 1001\nevents = on\n"
                          "[tenant:b]\nuids = 1002\nevents = off\n[tenant:c]\nuids = 1003\n",
                          &f->cfg, err, sizeof(err)),
                     0);
    assert_int_equal(config_resolve(&f->cfg, 1001, 65534, &i), 0);
    assert_int_equal(i.conf.events, KVMM_EVENTS_ON);
    assert_int_equal(config_resolve(&f->cfg, 1002, 65534, &i), 0);
    assert_int_equal(i.conf.events, KVMM_EVENTS_OFF);
    assert_int_equal(config_resolve(&f->cfg, 1003, 65534, &i), 0);
    assert_int_equal(i.conf.events, KVMM_EVENTS_OFF);
    assert_int_equal(config_resolve(&f->cfg, 1004, 65534, &i), 0);
    assert_int_equal(i.conf.events, KVMM_EVENTS_HASHES);
    config_free(&f->cfg);
    assert_int_equal(
        load("[tenant:a]\nuids = 1001\nevents = sometimes\n", &f->cfg, err, sizeof(err)),
        KVD_EBADREQ);
    assert_non_null(strstr(err, "events"));
    config_free(&f->cfg);
}

int main(void)
{
    snprintf(path, sizeof(path), "/tmp/kvd-test-config.%d", (int)getpid());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_long_tenant_names_stay_distinct, cfx_setup,
                                        cfx_teardown),
        cmocka_unit_test_setup_teardown(test_long_lines_read_whole, cfx_setup, cfx_teardown),
        cmocka_unit_test_setup_teardown(test_not_a_regular_file, cfx_setup, cfx_teardown),
        cmocka_unit_test_setup_teardown(test_first_error_reported, cfx_setup, cfx_teardown),
        cmocka_unit_test_setup_teardown(test_indented_continuation_refused, cfx_setup,
                                        cfx_teardown),
        cmocka_unit_test_setup_teardown(test_events_key, cfx_setup, cfx_teardown),
        cmocka_unit_test_setup_teardown(test_model_sections, cfx_setup, cfx_teardown),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    unlink(path);
    return rc;
}
