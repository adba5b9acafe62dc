/* Text requests are bounded before their work, against a real kvd serving
 * a model whose vocabulary has a 1024-byte token: a 60 MiB tokenize is
 * refused by max-text-bytes, a text under it that makes more than
 * KVD_MAX_ARRAY tokens by the incremental token cap, 1M copies of the long
 * token to detokenize (1 GiB of text) by max-frame without the daemon's
 * RSS growing by the text, and another tenant's hellos are answered within
 * 250 ms while one tenant sends all of these. */
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/protocol.h"
#include "kvd_harness.h"

/* The other tenant's slowest hello, less the run-queue waits of its thread
 * and of the loop (kh_rtt); a sanitizer build runs the daemon
 * several times slower (the failing case was seconds). */
#if defined(__SANITIZE_ADDRESS__)
#define VICTIM_MAX_MS 1000.0
#else
#define VICTIM_MAX_MS 250.0
#endif
#include "text/gguf_write.h"

#define LONG_ID 261u /* <unk> <s> </s>, 256 byte tokens, ▁ (259), a (260), q x 1024 */
#define LONG_LEN 1024u
#define MAX_TEXT (4u << 20)

static struct kh_proc kvd;
static char g_dir[64];

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A SentencePiece tokenizer-only GGUF: byte fallback, ▁, a, and a token of
 * 1024 q's. */
static int write_tokenizer(const char *path)
{
    struct gw w = {0};
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    const size_t n = 3 + 256 + 3;
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, n);
    gw_strn(&w, "<unk>", 5);
    gw_strn(&w, "<s>", 3);
    gw_strn(&w, "</s>", 4);
    for (int b = 0; b < 256; b++) {
        char t[8];
        snprintf(t, sizeof t, "<0x%02X>", b);
        gw_strn(&w, t, 6);
    }
    gw_strn(&w, "\xe2\x96\x81", 3);
    gw_strn(&w, "a", 1);
    char q[LONG_LEN];
    memset(q, 'q', sizeof q);
    gw_strn(&w, q, sizeof q);
    gw_kv_arr(&w, "tokenizer.ggml.scores", 6, n);
    for (size_t i = 0; i < n; i++) {
        float s = i < 259 ? 0.0f : -1.0f;
        gw_put(&w, &s, 4);
    }
    gw_kv_arr(&w, "tokenizer.ggml.token_type", 5, n);
    for (size_t i = 0; i < n; i++) {
        int32_t ty = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1;
        gw_put(&w, &ty, 4);
    }
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", 1);
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", 2);
    size_t len = 0;
    uint8_t *file = gw_finish(&w, &len);
    gw_free(&w);
    FILE *f = fopen(path, "wb");
    int rc = file && f && fwrite(file, 1, len, f) == len ? 0 : -1;
    if (f && fclose(f))
        rc = -1;
    free(file);
    return rc;
}

static int setup(void **state)
{
    (void)state;
    char tok[128], model[128], cmd[600];
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-textb.XXXXXX");
    if (!mkdtemp(g_dir))
        return -1;
    snprintf(tok, sizeof tok, "%s/tok.gguf", g_dir);
    snprintf(model, sizeof model, "%s/m.gguf", g_dir);
    if (write_tokenizer(tok))
        return -1;
    snprintf(cmd, sizeof cmd,
             "'%s/kvd-gguf-gen' -o '%s' --tokenizer '%s' --layers 1 --embd 32 --heads 2 "
             "--kv-heads 1 --ff 64 --ctx 256 >/dev/null",
             getenv("KVD_TOOLS_DIR"), model, tok);
    if (system(cmd) != 0)
        return -1;
    const char *const args[] = {"--model",
                                model,
                                "--backend",
                                "cpu",
                                "--threads",
                                "1",
                                "--no-roofline-probe",
                                "--socket-group",
                                "nogroup",
                                "--max-text-bytes",
                                "4M",
                                NULL};
    return kh_start(&kvd, NULL, args);
}

static int teardown(void **state)
{
    (void)state;
    int rc = kh_stop(&kvd);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return rc == 0 && system(cmd) == 0 ? 0 : -1;
}

static int send_tokenize(int fd, uint64_t id, const char *text, size_t len)
{
    struct kh_req q;
    kh_req_begin(&q, "tokenize", id, 1);
    proto_pack_kvn_str(&q.pk, "text", 4, text, len);
    return kh_req_send(fd, &q);
}

static int send_detokenize(int fd, uint64_t id, const uint32_t *ids, size_t n)
{
    struct kh_req q;
    kh_req_begin(&q, "detokenize", id, 1);
    proto_pack_kv_u32_array(&q.pk, "tokens", ids, n);
    return kh_req_send(fd, &q);
}

/* "a a a ...": two tokens (▁, a) every two bytes. */
static char *a_text(size_t len)
{
    char *t = malloc(len + 1);
    assert_non_null(t);
    for (size_t i = 0; i < len; i++)
        t[i] = i % 2 ? ' ' : 'a';
    t[len] = 0;
    return t;
}

static uint32_t *long_ids(size_t n)
{
    uint32_t *ids = malloc(n * sizeof(uint32_t));
    assert_non_null(ids);
    for (size_t i = 0; i < n; i++)
        ids[i] = LONG_ID;
    return ids;
}

static long status_kb(const char *key)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)kvd.pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    size_t kl = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl))
            kb = atol(line + kl);
    if (f)
        fclose(f);
    return kb;
}

/* Resets the daemon's peak RSS (VmHWM) to its current RSS. */
static void reset_peak(void)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/clear_refs", (int)kvd.pid);
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "5", 1), 1);
    close(fd);
}

static void test_tokenize_small(void **state)
{
    (void)state;
    int fd = kh_connect(kvd.sock);
    assert_true(fd >= 0);
    char *t = a_text(1000);
    assert_int_equal(send_tokenize(fd, 1, t, 1000), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *toks = kh_obj(r.root, "tokens");
    assert_non_null(toks);
    assert_int_equal(toks->via.array.size, 1 + 1 + 1000); /* BOS, ▁ a x 500, ▁ */
    kh_reply_free(&r);
    free(t);
    close(fd);
}

static void test_tokenize_60mib(void **state)
{
    (void)state;
    int fd = kh_connect(kvd.sock);
    assert_true(fd >= 0);
    const size_t len = 60u << 20;
    char *t = a_text(len);
    double t0 = now_s();
    assert_int_equal(send_tokenize(fd, 2, t, len), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    double dt = now_s() - t0;
    printf("tokenize of 60 MiB: too_large in %.3f s (sent and answered): %s\n", dt, r.message);
    kh_expect(&r, KVD_ETOOLARGE);
    assert_non_null(strstr(r.message, "max-text-bytes"));
    kh_reply_free(&r);
    /* one byte over max-text-bytes: refused by the bytes too; exactly at it,
     * it reaches the tokenizer, which stops at KVD_MAX_ARRAY tokens */
    assert_int_equal(send_tokenize(fd, 3, t, MAX_TEXT + 1), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_ETOOLARGE);
    assert_non_null(strstr(r.message, "max-text-bytes"));
    kh_reply_free(&r);
    t0 = now_s();
    assert_int_equal(send_tokenize(fd, 4, t, MAX_TEXT), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    dt = now_s() - t0;
    printf("tokenize of 4 MiB (4M tokens): too_large in %.3f s: %s\n", dt, r.message);
    kh_expect(&r, KVD_ETOOLARGE);
    assert_non_null(strstr(r.message, "makes more than 1048576 tokens"));
    kh_reply_free(&r);
    free(t);
    close(fd);
}

static void test_detokenize_1m_long(void **state)
{
    (void)state;
    int fd = kh_connect(kvd.sock);
    assert_true(fd >= 0);
    /* 1000 copies: 1,024,000 bytes, answered */
    uint32_t *ids = long_ids(1u << 20);
    assert_int_equal(send_detokenize(fd, 5, ids, 1000), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *text = kh_obj(r.root, "text");
    assert_non_null(text);
    assert_int_equal(text->via.str.size, 1000 * LONG_LEN);
    kh_reply_free(&r);
    /* 1M copies: 1 GiB of text, 16 x max-frame */
    reset_peak();
    long rss0 = status_kb("VmRSS:");
    double t0 = now_s();
    assert_int_equal(send_detokenize(fd, 6, ids, 1u << 20), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    double dt = now_s() - t0;
    long peak = status_kb("VmHWM:");
    kh_expect(&r, KVD_ETOOLARGE);
    assert_non_null(strstr(r.message, "max-frame"));
    printf("detokenize of 1M x 1024-byte token: too_large in %.3f s, kvd RSS %ld MB before, "
           "peak %ld MB: %s\n",
           dt, rss0 / 1024, peak / 1024, r.message);
    kh_reply_free(&r);
    /* the text stops at max-frame (64 MiB) and the request's ids are a few
     * MiB (ASan's quarantine keeps some freed memory resident); building the
     * 1 GiB text would pass this */
    assert_true(peak - rss0 < 512 * 1024);
    free(ids);
    close(fd);
}

/* The other tenant: hellos one at a time from `go` until `stop` closes;
 * writes its count and its slowest answer (ms) to `out`. */
struct victim {
    int go, stop, out;
    int stop_w; /* the parent's end of stop: closed here, so its close is EOF */
    pid_t kvd;  /* whose loop's run-queue waits kh_rtt takes out */
};

static int victim_main(void *arg)
{
    struct victim *v = arg;
    close(v->stop_w);
    int fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 10;
    char c;
    if (read(v->go, &c, 1) != 1)
        return 11;
    double worst = 0, worst_wall = 0;
    unsigned n = 0;
    for (;;) {
        struct pollfd p = {.fd = v->stop, .events = POLLIN};
        if (poll(&p, 1, 0) != 0)
            break;
        struct kh_reply r;
        struct kh_rtt rtt;
        double stall;
        kh_rtt_begin(&rtt, v->kvd);
        int code = kh_call0(fd, "hello", 1 + (uint64_t)n, &r);
        double wall = kh_rtt_end(&rtt, &stall);
        kh_reply_free(&r);
        if (code)
            return 12;
        worst = stall > worst ? stall : worst;
        worst_wall = wall > worst_wall ? wall : worst_wall;
        n++;
    }
    double res[3] = {(double)n, worst, worst_wall};
    if (write(v->out, res, sizeof res) != sizeof res)
        return 13;
    close(fd);
    return 0;
}

static void test_hello_while_hostile(void **state)
{
    (void)state;
    int go[2], stop[2], out[2];
    assert_int_equal(pipe(go), 0);
    assert_int_equal(pipe(stop), 0);
    assert_int_equal(pipe(out), 0);
    struct victim v = {go[0], stop[0], out[1], stop[1], kvd.pid};
    pid_t pid = kh_run_as(60002, 65534, victim_main, &v);
    assert_true(pid > 0);
    int fd = kh_connect(kvd.sock);
    assert_true(fd >= 0);
    char *t = a_text(60u << 20);
    uint32_t *ids = long_ids(1u << 20);
    assert_int_equal(write(go[1], "x", 1), 1);
    double t0 = now_s();
    unsigned answered = 0;
    for (int round = 0; round < 2; round++) {
        uint64_t id = 100 + 3 * (uint64_t)round;
        assert_int_equal(send_tokenize(fd, id, t, 60u << 20), 0);
        assert_int_equal(send_tokenize(fd, id + 1, t, MAX_TEXT), 0);
        assert_int_equal(send_detokenize(fd, id + 2, ids, 1u << 20), 0);
        for (int k = 0; k < 3; k++) {
            struct kh_reply r;
            assert_int_equal(kh_recv(fd, &r), 0);
            kh_expect(&r, KVD_ETOOLARGE);
            kh_reply_free(&r);
            answered++;
        }
    }
    double dt = now_s() - t0;
    close(stop[1]);
    double res[3] = {0, 0, 0};
    assert_int_equal(read(out[0], res, sizeof res), sizeof res);
    assert_int_equal(kh_child_status(pid), 0);
    printf("while %u hostile text requests were answered (%.2f s), the other tenant's %.0f "
           "hellos: slowest %.1f ms (%.1f ms of wall time, the machine's load taken out: "
           "kh_rtt)\n",
           answered, dt, res[0], res[1], res[2]);
    assert_true(res[1] < VICTIM_MAX_MS);
    free(t);
    free(ids);
    close(fd);
    close(go[0]);
    close(go[1]);
    close(stop[0]);
    close(out[0]);
    close(out[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_detokenize_1m_long),
        cmocka_unit_test(test_tokenize_small),
        cmocka_unit_test(test_tokenize_60mib),
        cmocka_unit_test(test_hello_while_hostile),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
