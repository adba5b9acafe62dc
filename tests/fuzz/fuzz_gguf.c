/* fuzz_gguf: libFuzzer target for the GGUF reader and the model loader's
 * validation. The input is a whole file: gguf_parse reads it from memory
 * and every metadata entry and tensor is then looked up through the typed
 * getters; a file that parses is also loaded as a model on the cpu backend
 * (from a memfd, through the same path-based model_load the daemon uses).
 * Oracles: no crash or sanitizer report, and every failure has a message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"
#include "chat_template.h"
#include "fuzz_env.h"
#include "gguf.h"
#include "kvd/status.h"
#include "model.h"
#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct backend *cpu;

static void walk(const struct gguf *g)
{
    char err[256], buf[64];
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct gguf_kv *kv = &g->kv[i];
        uint32_t u;
        float f;
        FUZZ_ASSERT(kv->key != NULL);
        FUZZ_ASSERT(gguf_find_kv(g, kv->key) != NULL);
        (void)gguf_get_u32(g, kv->key, &u, err, sizeof(err));
        struct kvd_error ferr = {0};
        if (gguf_get_f32(g, kv->key, &f, &ferr) != 0)
            FUZZ_ASSERT(ferr.code != 0 && ferr.message[0] != '\0');
        (void)gguf_get_str(g, kv->key, buf, sizeof(buf), err, sizeof(err));
        (void)gguf_arr_count(g, kv->key);
        (void)gguf_vtype_name(kv->type);
        if (kv->type == GGUF_STRING) /* the bytes must lie inside the file */
            FUZZ_ASSERT(kv->str_len <= g->size && (const uint8_t *)kv->str >= g->map &&
                        (const uint8_t *)kv->str + kv->str_len <= g->map + g->size);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct gguf_tensor *t = &g->tensors[i];
        FUZZ_ASSERT(memchr(t->name, 0, sizeof(t->name)) != NULL);
        FUZZ_ASSERT(gguf_find_tensor(g, t->name) != NULL);
        FUZZ_ASSERT(t->nbytes <= g->size && (const uint8_t *)t->data >= g->map &&
                    (const uint8_t *)t->data + t->nbytes <= g->map + g->size);
    }
}

/* model_load takes a path: hand it the bytes through a memfd. One memfd for
 * the whole run, rewritten per input (truncate + pwrite), rather than a new
 * one each time: two syscalls fewer per loaded input. model_load opens and
 * maps it through /proc/self/fd as it would a model file. */
static int memfd = -1;

static void load_model(const uint8_t *data, size_t size)
{
    char path[64];
    struct kvd_error err = {0};
    struct model *m = NULL;
    if (memfd < 0 && (memfd = memfd_create("kvd-fuzz-gguf", MFD_CLOEXEC)) < 0)
        abort();
    if (ftruncate(memfd, 0) != 0 || pwrite(memfd, data, size, 0) != (ssize_t)size)
        abort();
    snprintf(path, sizeof(path), "/proc/self/fd/%d", memfd);
    struct model_opts mo = {.n_threads = 1};
    int rc = model_load_opts(path, cpu, &mo, &m, &err);
    if (rc == 0) {
        const struct model_hparams *hp = model_hparams(m);
        FUZZ_ASSERT(hp->n_layer > 0 && hp->n_vocab > 0 && hp->head_dim > 0);
        model_free(m);
    } else {
        FUZZ_ASSERT(err.code == rc && err.message[0] != '\0');
    }
}

/* The file's text side, as text_open reads it: the tokenizer (then a short
 * text through it) and the chat template (then one render). */
static void load_text(const struct gguf *g)
{
    char err[256] = "";
    struct tokenizer *t = NULL;
    int rc = tokenizer_load(g, &t, err, sizeof(err));
    if (rc) {
        FUZZ_ASSERT(t == NULL && err[0] != '\0');
    } else {
        static const char s[] = "Hello, world! <s> 123 \xc3\xa9\xf0\x9f\x99\x82";
        uint32_t *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(t, s, sizeof(s) - 1, true, true, &ids, &n) == 0) {
            char *text = NULL;
            size_t len = 0;
            for (size_t i = 0; i < n; i++)
                FUZZ_ASSERT(ids[i] < tokenizer_n_vocab(t));
            if (tokenizer_decode(t, ids, n, false, &text, &len) == 0)
                free(text);
            free(ids);
        }
        tokenizer_free(t);
    }
    const struct gguf_kv *kv = gguf_find_kv(g, "tokenizer.chat_template");
    if (!kv || kv->type != GGUF_STRING || kv->str_len > (1u << 20))
        return;
    struct chat_template *ct = NULL;
    err[0] = 0;
    if (chat_template_parse(kv->str, (size_t)kv->str_len, &ct, err, sizeof(err)) != 0) {
        FUZZ_ASSERT(ct == NULL && err[0] != '\0');
        return;
    }
    static const struct chat_msg m[] = {{"user", "hi"}, {"assistant", "hello"}};
    char *out = NULL;
    size_t len = 0;
    if (chat_template_render(ct, m, 2, true, "<s>", "</s>", &out, &len, err, sizeof(err)) == 0)
        free(out);
    chat_template_free(ct);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvd_error err = {0};
    struct gguf *g = NULL;
    if (!cpu && backend_cpu_new(&cpu) != 0)
        abort();
    int rc = gguf_parse(data, size, &g, &err);
    if (rc != 0) {
        FUZZ_ASSERT(g == NULL);
        FUZZ_ASSERT(err.code == rc && err.message[0] != '\0');
        return 0;
    }
    walk(g);
    load_text(g);
    gguf_close(g);
    load_model(data, size);
    return 0;
}
