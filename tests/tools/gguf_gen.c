/* kvd-gguf-gen: writes a random-weight llama or qwen2 GGUF (v3) of any shape
 * and seed, with a small "llama" (SentencePiece-style) vocabulary so
 * llama.cpp loads it too. Weights are N(0, 1/fan_in) from a deterministic
 * PRNG, norms near 1, so activations stay well-conditioned and greedy
 * decoding does not collapse. Used by the tests, benchmarks and the demo. */
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute_cpu_impl.h" /* f16/bf16 conversions, enum ctype */
#include "gguf.h"
#include "quant.h"

enum init { INIT_MATRIX, INIT_EMBD, INIT_NORM, INIT_BIAS, INIT_ROPE_FREQS };

struct tdesc {
    char name[64];
    uint32_t ne0, ne1; /* ne1 = 0: 1-D */
    enum ctype type;
    enum init init;
    bool skip; /* drawn from the generator (the stream stays aligned) but not written */
    uint64_t offset, nbytes;
};

struct opts {
    const char *arch, *out, *name, *tokenizer;
    uint32_t layers, embd, heads, kv_heads, ff, vocab, ctx;
    uint32_t keep_layers; /* 0: all; else only the first K layers are written */
    enum ctype type;
    int mix; /* 0, or 4 / 5: the Q4_K_M / Q5_K_M mix (type is then Q4_K / Q5_K) */
    int tied, rope_freqs;
    float rope_base, eps;
    uint64_t seed;
};

static uint64_t rng_state;

static uint64_t rng_next(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(void) /* (0, 1) */
{
    return ((rng_next() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static float rng_normal(void)
{
    return (float)(sqrt(-2.0 * log(rng_uniform())) * cos(6.283185307179586 * rng_uniform()));
}

static void w_bytes(FILE *f, const void *p, size_t n)
{
    if (fwrite(p, 1, n, f) != n) {
        perror("kvd-gguf-gen: write");
        exit(1);
    }
}
static void w_u32(FILE *f, uint32_t v)
{
    w_bytes(f, &v, 4);
}
static void w_u64(FILE *f, uint64_t v)
{
    w_bytes(f, &v, 8);
}
static void w_str(FILE *f, const char *s)
{
    w_u64(f, strlen(s));
    w_bytes(f, s, strlen(s));
}
static void kv_str(FILE *f, const char *k, const char *v)
{
    w_str(f, k);
    w_u32(f, 8);
    w_str(f, v);
}
static void kv_u32(FILE *f, const char *k, uint32_t v)
{
    w_str(f, k);
    w_u32(f, 4);
    w_u32(f, v);
}
static void kv_f32(FILE *f, const char *k, float v)
{
    w_str(f, k);
    w_u32(f, 6);
    w_bytes(f, &v, 4);
}

/* Token strings: <unk> <s> </s>, then the 256 byte tokens <0xNN> when the
 * vocabulary has room (llama.cpp looks up <0x0A> for the newline), then
 * "▁t<id>" words. */
static void token_str(uint32_t id, uint32_t vocab, char *buf, size_t cap, int32_t *type)
{
    *type = 1; /* normal */
    if (id < 3) {
        static const char *const sp[3] = {"<unk>", "<s>", "</s>"};
        snprintf(buf, cap, "%s", sp[id]);
        *type = id == 0 ? 2 : 3; /* unknown, control */
    } else if (vocab >= 259 + 3 && id < 259) {
        snprintf(buf, cap, "<0x%02X>", id - 3);
        *type = 6; /* byte */
    } else if (vocab < 259 + 3 && id == 3) {
        snprintf(buf, cap, "<0x0A>");
        *type = 6;
    } else {
        snprintf(buf, cap, "\xe2\x96\x81t%u", id);
    }
}

static size_t row_bytes(enum ctype t, uint32_t n)
{
    return ctype_row_bytes(t, n);
}

static void gen_row(const struct opts *o, const struct tdesc *t, uint32_t row, float *v)
{
    uint32_t n = t->ne0;
    switch (t->init) {
    case INIT_MATRIX: {
        float sd = 1.0f / sqrtf((float)n);
        /* tied output: the projections back into the residual stream get 3x,
         * so the layers, not the current token's embedding, decide the
         * next token (measured: greedy then keeps varying) */
        if (o->tied && (strstr(t->name, "attn_output") || strstr(t->name, "ffn_down")))
            sd *= 3.0f;
        for (uint32_t i = 0; i < n; i++)
            v[i] = sd * rng_normal();
        break;
    }
    case INIT_EMBD: /* N(0,1); small when tied: a large tied embedding makes the
                     * current token dominate its own logit and greedy repeats it */
        for (uint32_t i = 0; i < n; i++)
            v[i] = (o->tied ? 0.1f : 1.0f) * rng_normal();
        break;
    case INIT_NORM:
        for (uint32_t i = 0; i < n; i++)
            v[i] = 0.8f + 0.4f * (float)rng_uniform();
        break;
    case INIT_BIAS:
        for (uint32_t i = 0; i < n; i++)
            v[i] = 0.1f * rng_normal();
        break;
    case INIT_ROPE_FREQS: /* Llama-3.1-like: 1 for fast pairs, growing to 8 for slow ones */
        for (uint32_t i = 0; i < n; i++)
            v[i] = 1.0f + 7.0f * (float)i / (float)(n > 1 ? n - 1 : 1);
        break;
    }
    (void)row;
}

static void encode_row(enum ctype t, const float *v, uint32_t n, uint8_t *out)
{
    switch (t) {
    case CT_F32:
        memcpy(out, v, (size_t)n * 4);
        break;
    case CT_F16:
        for (uint32_t i = 0; i < n; i++) {
            uint16_t h = float_to_half(v[i]);
            memcpy(out + 2 * i, &h, 2);
        }
        break;
    case CT_BF16:
        for (uint32_t i = 0; i < n; i++) {
            uint16_t h = float_to_bf16(v[i]);
            memcpy(out + 2 * i, &h, 2);
        }
        break;
    case CT_Q8_0: /* as ggml's quantize_row_q8_0_ref */
        for (uint32_t b = 0; b < n / 32; b++) {
            float amax = 0;
            for (int i = 0; i < 32; i++)
                amax = fmaxf(amax, fabsf(v[b * 32 + i]));
            float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
            uint16_t dh = float_to_half(d);
            uint8_t *blk = out + (size_t)b * 34;
            memcpy(blk, &dh, 2);
            for (int i = 0; i < 32; i++)
                blk[2 + i] = (uint8_t)(int8_t)roundf(v[b * 32 + i] * id);
        }
        break;
    default:
        (void)quant_quantize_row(t, v, out, n);
        break;
    }
}

/* The Q4_K_M / Q5_K_M rule for attn_v and ffn_down (llama.cpp's
 * use_more_bits): Q6_K in the first and last eighth of the layers and every
 * third layer between. */
static int more_bits(const struct opts *o, uint32_t layer)
{
    uint32_t n = o->layers;
    return o->mix && (layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2);
}

/* general.file_type: llama.cpp's llama_ftype of the whole file. */
static uint32_t file_type(const struct opts *o)
{
    if (o->mix)
        return o->mix == 4 ? 15 : 17; /* MOSTLY_Q4_K_M, MOSTLY_Q5_K_M */
    switch (o->type) {
    case CT_F32:
        return 0;
    case CT_F16:
        return 1;
    case CT_Q4_0:
        return 2;
    case CT_Q4_1:
        return 3;
    case CT_Q8_0:
        return 7;
    case CT_Q5_0:
        return 8;
    case CT_Q5_1:
        return 9;
    case CT_Q4_K:
        return 14; /* MOSTLY_Q4_K_S: all Q4_K */
    case CT_Q5_K:
        return 16; /* MOSTLY_Q5_K_S */
    case CT_Q6_K:
        return 18;
    case CT_BF16:
        return 32;
    }
    return 0;
}

/* Writes one metadata entry of another GGUF as it is (--tokenizer). */
static void kv_copy(FILE *f, const struct gguf_kv *kv)
{
    static const uint8_t size[GGUF_VTYPE_COUNT] = {
        [GGUF_U8] = 1,  [GGUF_I8] = 1,  [GGUF_U16] = 2, [GGUF_I16] = 2,
        [GGUF_U32] = 4, [GGUF_I32] = 4, [GGUF_F32] = 4, [GGUF_BOOL] = 1,
        [GGUF_U64] = 8, [GGUF_I64] = 8, [GGUF_F64] = 8};
    w_str(f, kv->key);
    w_u32(f, kv->type);
    if (kv->type == GGUF_STRING) {
        w_u64(f, kv->str_len);
        w_bytes(f, kv->str, kv->str_len);
    } else if (kv->type == GGUF_ARRAY) {
        w_u32(f, kv->arr_type);
        w_u64(f, kv->arr_count);
        w_bytes(f, kv->arr_data, kv->arr_bytes);
    } else if (kv->type == GGUF_F32) {
        float v = (float)kv->v.f;
        w_bytes(f, &v, 4);
    } else if (kv->type == GGUF_F64) {
        w_bytes(f, &kv->v.f, 8);
    } else {
        w_bytes(f, &kv->v.u, size[kv->type]); /* little-endian: the low bytes */
    }
}

static void usage(void)
{
    fprintf(stderr,
            "usage: kvd-gguf-gen -o FILE [--arch llama|qwen2] [--layers N] [--embd N] [--heads N]\n"
            "         [--kv-heads N] [--ff N] [--vocab N] [--ctx N] [--type TYPE]\n"
            "         [--tied] [--rope-base F] [--rope-freqs] [--eps F] [--seed N] [--name S]\n"
            "         [--eos ID] [--eot ID] [--chat-template FILE] [--type-of CLASS=TYPE]...\n"
            "         [--tokenizer GGUF]  (its tokenizer.* entries instead of the built-in\n"
            "                              vocabulary and --eos/--eot; --vocab is its size)\n"
            "         [--keep-layers K]   (the same model's first K layers, embeddings and\n"
            "                              output: a draft of the --layers model)\n"
            "  TYPE: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q4_k q5_k q6_k q4_k_m q5_k_m\n");
    exit(2);
}

/* A --type name; *mix is 4 / 5 for the Q4_K_M / Q5_K_M mixes, else 0. */
static bool parse_type(const char *s, enum ctype *t, int *mix)
{
    static const struct {
        const char *name;
        enum ctype t;
        int mix;
    } tab[] = {{"f32", CT_F32, 0},    {"f16", CT_F16, 0},   {"bf16", CT_BF16, 0},
               {"q8_0", CT_Q8_0, 0},  {"q4_0", CT_Q4_0, 0}, {"q4_1", CT_Q4_1, 0},
               {"q5_0", CT_Q5_0, 0},  {"q5_1", CT_Q5_1, 0}, {"q4_k", CT_Q4_K, 0},
               {"q5_k", CT_Q5_K, 0},  {"q6_k", CT_Q6_K, 0}, {"q4_k_m", CT_Q4_K, 4},
               {"q5_k_m", CT_Q5_K, 5}};
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (!strcmp(s, tab[i].name)) {
            *t = tab[i].t, *mix = tab[i].mix;
            return true;
        }
    return false;
}

static uint32_t arg_u32(const char *s)
{
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (*end || v == 0 || v > (1ul << 24)) {
        fprintf(stderr, "kvd-gguf-gen: bad number '%s'\n", s);
        exit(2);
    }
    return (uint32_t)v;
}

int main(int argc, char **argv)
{
    struct opts o = {.arch = "llama",
                     .name = "kvd-random",
                     .layers = 2,
                     .embd = 64,
                     .heads = 4,
                     .ff = 128,
                     .vocab = 512,
                     .ctx = 2048,
                     .type = CT_F16,
                     .rope_base = 0,
                     .eps = 1e-5f,
                     .seed = 1};
    static const struct option lo[] = {{"arch", 1, 0, 'a'},
                                       {"layers", 1, 0, 'l'},
                                       {"embd", 1, 0, 'e'},
                                       {"heads", 1, 0, 'h'},
                                       {"kv-heads", 1, 0, 'k'},
                                       {"ff", 1, 0, 'f'},
                                       {"vocab", 1, 0, 'v'},
                                       {"ctx", 1, 0, 'c'},
                                       {"type", 1, 0, 't'},
                                       {"tied", 0, 0, 'T'},
                                       {"rope-base", 1, 0, 'r'},
                                       {"rope-freqs", 0, 0, 'R'},
                                       {"seed", 1, 0, 's'},
                                       {"eps", 1, 0, 'E'},
                                       {"name", 1, 0, 'n'},
                                       {"help", 0, 0, '?'},
                                       {"eos", 1, 0, 'S'},
                                       {"eot", 1, 0, 'O'},
                                       {"chat-template", 1, 0, 'C'},
                                       {"tokenizer", 1, 0, 'K'},
                                       {"type-of", 1, 0, 'Y'},
                                       {"keep-layers", 1, 0, 'P'},
                                       {0, 0, 0, 0}};
    struct {
        char cls[32];
        enum ctype type;
    } type_of[16];
    size_t n_type_of = 0;
    uint32_t eos = 2, eot = 0;
    char *chat_template = NULL;
    int ch;
    while ((ch = getopt_long(argc, argv, "o:", lo, NULL)) != -1) {
        switch (ch) {
        case 'o':
            o.out = optarg;
            break;
        case 'P':
            o.keep_layers = arg_u32(optarg);
            break;
        case 'a':
            o.arch = optarg;
            break;
        case 'l':
            o.layers = arg_u32(optarg);
            break;
        case 'e':
            o.embd = arg_u32(optarg);
            break;
        case 'h':
            o.heads = arg_u32(optarg);
            break;
        case 'k':
            o.kv_heads = arg_u32(optarg);
            break;
        case 'f':
            o.ff = arg_u32(optarg);
            break;
        case 'v':
            o.vocab = arg_u32(optarg);
            break;
        case 'c':
            o.ctx = arg_u32(optarg);
            break;
        case 'T':
            o.tied = 1;
            break;
        case 'R':
            o.rope_freqs = 1;
            break;
        case 'r':
            o.rope_base = strtof(optarg, NULL);
            break;
        case 'E':
            o.eps = strtof(optarg, NULL);
            break;
        case 's':
            o.seed = strtoull(optarg, NULL, 10);
            break;
        case 'n':
            o.name = optarg;
            break;
        case 'K':
            o.tokenizer = optarg;
            break;
        case 'S':
            eos = arg_u32(optarg);
            break;
        case 'O':
            eot = arg_u32(optarg);
            break;
        case 'C': {
            FILE *tf = fopen(optarg, "rb");
            chat_template = calloc(1, 1 << 20);
            if (!tf || !chat_template || fread(chat_template, 1, (1 << 20) - 1, tf) == 0) {
                fprintf(stderr, "kvd-gguf-gen: cannot read %s\n", optarg);
                exit(2);
            }
            fclose(tf);
            break;
        }
        case 't':
            if (!parse_type(optarg, &o.type, &o.mix))
                usage();
            break;
        case 'Y': {
            /* --type-of CLASS=TYPE: that class of matrices (token_embd, output,
             * attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down)
             * in TYPE, whatever --type says (to find which tensor's type
             * makes a difference) */
            const char *eq = strchr(optarg, '=');
            int mix_ign;
            if (!eq || eq == optarg || (size_t)(eq - optarg) >= sizeof type_of[0].cls ||
                n_type_of == sizeof type_of / sizeof type_of[0] ||
                !parse_type(eq + 1, &type_of[n_type_of].type, &mix_ign) || mix_ign)
                usage();
            memcpy(type_of[n_type_of].cls, optarg, (size_t)(eq - optarg));
            type_of[n_type_of++].cls[eq - optarg] = 0;
            break;
        }
        default:
            usage();
        }
    }
    if (!o.out || optind != argc)
        usage();
    struct gguf *tg = NULL;
    uint64_t n_tok_kv = 0;
    if (o.tokenizer) {
        char gerr[256];
        if (gguf_open(o.tokenizer, &tg, gerr, sizeof gerr)) {
            fprintf(stderr, "kvd-gguf-gen: %s\n", gerr);
            return 1;
        }
        uint64_t nv = gguf_arr_count(tg, "tokenizer.ggml.tokens");
        if (nv == 0 || nv > (1u << 24)) {
            fprintf(stderr, "kvd-gguf-gen: %s has no tokenizer.ggml.tokens\n", o.tokenizer);
            return 1;
        }
        o.vocab = (uint32_t)nv;
        for (uint64_t i = 0; i < tg->n_kv; i++)
            n_tok_kv += !strncmp(tg->kv[i].key, "tokenizer.", 10) &&
                        !(chat_template && !strcmp(tg->kv[i].key, "tokenizer.chat_template"));
    }
    int qwen = !strcmp(o.arch, "qwen2");
    if (!qwen && strcmp(o.arch, "llama"))
        usage();
    if (!o.kv_heads)
        o.kv_heads = o.heads;
    if (o.rope_base == 0)
        o.rope_base = qwen ? 1000000.0f : 10000.0f;
    uint32_t hd = o.embd / o.heads;
    if (o.embd % o.heads || o.heads % o.kv_heads || hd % 2) {
        fprintf(stderr, "kvd-gguf-gen: embd must be a multiple of heads, heads of kv-heads, and "
                        "the head dim even\n");
        return 2;
    }
    uint32_t blk = ctype_block_elems(o.type);
    if (blk > 1 && (o.embd % blk || o.ff % blk)) {
        fprintf(stderr, "kvd-gguf-gen: %s needs embd and ff to be multiples of %u\n",
                ctype_name(o.type), blk);
        return 2;
    }

    /* tensor list, in llama.cpp's usual order */
    uint32_t nt_max = 4 + 12 * o.layers, nt = 0;
    struct tdesc *td = calloc(nt_max, sizeof *td);
    if (!td)
        return 1;
#define ADD(nm, a, b, ty, in)                                                                      \
    do {                                                                                           \
        struct tdesc *t_ = &td[nt++];                                                              \
        snprintf(t_->name, sizeof t_->name, "%s", nm);                                             \
        t_->ne0 = (a), t_->ne1 = (b), t_->type = (ty), t_->init = (in);                            \
    } while (0)
    ADD("token_embd.weight", o.embd, o.vocab, o.type, INIT_EMBD);
    if (o.rope_freqs)
        ADD("rope_freqs.weight", hd / 2, 0, CT_F32, INIT_ROPE_FREQS);
    for (uint32_t l = 0; l < o.layers; l++) {
        char n[64];
        uint32_t kd = o.kv_heads * hd;
#define L(sfx, a, b, ty, in)                                                                       \
    do {                                                                                           \
        snprintf(n, sizeof n, "blk.%u.%s", l, sfx);                                                \
        ADD(n, a, b, ty, in);                                                                      \
    } while (0)
        L("attn_norm.weight", o.embd, 0, CT_F32, INIT_NORM);
        L("attn_q.weight", o.embd, o.embd, o.type, INIT_MATRIX);
        L("attn_k.weight", o.embd, kd, o.type, INIT_MATRIX);
        L("attn_v.weight", o.embd, kd, more_bits(&o, l) ? CT_Q6_K : o.type, INIT_MATRIX);
        if (qwen) {
            L("attn_q.bias", o.embd, 0, CT_F32, INIT_BIAS);
            L("attn_k.bias", kd, 0, CT_F32, INIT_BIAS);
            L("attn_v.bias", kd, 0, CT_F32, INIT_BIAS);
        }
        L("attn_output.weight", o.embd, o.embd, o.type, INIT_MATRIX);
        L("ffn_norm.weight", o.embd, 0, CT_F32, INIT_NORM);
        L("ffn_gate.weight", o.embd, o.ff, o.type, INIT_MATRIX);
        L("ffn_up.weight", o.embd, o.ff, o.type, INIT_MATRIX);
        L("ffn_down.weight", o.ff, o.embd, more_bits(&o, l) ? CT_Q6_K : o.type, INIT_MATRIX);
#undef L
    }
    ADD("output_norm.weight", o.embd, 0, CT_F32, INIT_NORM);
    if (!o.tied)
        ADD("output.weight", o.embd, o.vocab, o.mix ? CT_Q6_K : o.type, INIT_MATRIX);
#undef ADD
    for (uint32_t i = 0; i < nt; i++) {
        const char *base = td[i].name;
        if (!strncmp(base, "blk.", 4) && strchr(base + 4, '.'))
            base = strchr(base + 4, '.') + 1;
        for (size_t j = 0; j < n_type_of && td[i].ne1; j++) {
            size_t len = strlen(type_of[j].cls);
            if (!strncmp(base, type_of[j].cls, len) && base[len] == '.')
                td[i].type = type_of[j].type;
        }
    }
    for (uint32_t i = 0; i < nt; i++) {
        uint32_t tb = ctype_block_elems(td[i].type);
        if (tb > 1 && td[i].ne0 % tb) {
            fprintf(stderr, "kvd-gguf-gen: %s: %s needs rows of a multiple of %u\n", td[i].name,
                    ctype_name(td[i].type), tb);
            return 2;
        }
    }
    if (o.keep_layers > o.layers) {
        fprintf(stderr, "kvd-gguf-gen: --keep-layers is more than --layers\n");
        return 2;
    }
    uint32_t nt_out = nt, layers_out = o.layers;
    if (o.keep_layers) {
        layers_out = o.keep_layers;
        for (uint32_t i = 0; i < nt; i++) {
            unsigned l;
            if (sscanf(td[i].name, "blk.%u.", &l) == 1 && l >= o.keep_layers) {
                td[i].skip = true;
                nt_out--;
            }
        }
    }
    uint64_t off = 0;
    for (uint32_t i = 0; i < nt; i++) {
        if (td[i].skip)
            continue;
        td[i].offset = off;
        td[i].nbytes = row_bytes(td[i].type, td[i].ne0) * (td[i].ne1 ? td[i].ne1 : 1);
        off += (td[i].nbytes + 31) / 32 * 32;
    }

    FILE *f = fopen(o.out, "wb");
    if (!f) {
        perror(o.out);
        return 1;
    }
    char key[128];
    w_bytes(f, "GGUF", 4);
    w_u32(f, 3);
    w_u64(f, nt_out);
    /* metadata entries written below */
    w_u64(f, tg ? 13 + n_tok_kv + (chat_template != NULL)
                : (uint64_t)(19 + (eot != 0) + (chat_template != NULL)));
    kv_str(f, "general.architecture", o.arch);
    kv_str(f, "general.name", o.name);
    kv_u32(f, "general.alignment", 32);
    kv_u32(f, "general.file_type", file_type(&o));
#define AK(s) (snprintf(key, sizeof key, "%s.%s", o.arch, s), key)
    kv_u32(f, AK("context_length"), o.ctx);
    kv_u32(f, AK("embedding_length"), o.embd);
    kv_u32(f, AK("block_count"), layers_out);
    kv_u32(f, AK("feed_forward_length"), o.ff);
    kv_u32(f, AK("attention.head_count"), o.heads);
    kv_u32(f, AK("attention.head_count_kv"), o.kv_heads);
    kv_f32(f, AK("attention.layer_norm_rms_epsilon"), o.eps);
    kv_f32(f, AK("rope.freq_base"), o.rope_base);
    kv_u32(f, AK("rope.dimension_count"), hd);
#undef AK
    if (tg) {
        for (uint64_t i = 0; i < tg->n_kv; i++)
            if (!strncmp(tg->kv[i].key, "tokenizer.", 10) &&
                !(chat_template && !strcmp(tg->kv[i].key, "tokenizer.chat_template")))
                kv_copy(f, &tg->kv[i]);
    } else {
        kv_str(f, "tokenizer.ggml.model", "llama");
        /* tokens, scores, token_type arrays */
        char tok[32];
        int32_t ttype;
        w_str(f, "tokenizer.ggml.tokens");
        w_u32(f, 9);
        w_u32(f, 8);
        w_u64(f, o.vocab);
        for (uint32_t i = 0; i < o.vocab; i++) {
            token_str(i, o.vocab, tok, sizeof tok, &ttype);
            w_str(f, tok);
        }
        w_str(f, "tokenizer.ggml.scores");
        w_u32(f, 9);
        w_u32(f, 6);
        w_u64(f, o.vocab);
        for (uint32_t i = 0; i < o.vocab; i++) {
            float sc = -(float)i;
            w_bytes(f, &sc, 4);
        }
        w_str(f, "tokenizer.ggml.token_type");
        w_u32(f, 9);
        w_u32(f, 5);
        w_u64(f, o.vocab);
        for (uint32_t i = 0; i < o.vocab; i++) {
            token_str(i, o.vocab, tok, sizeof tok, &ttype);
            w_bytes(f, &ttype, 4);
        }
        kv_u32(f, "tokenizer.ggml.bos_token_id", 1);
        kv_u32(f, "tokenizer.ggml.eos_token_id", eos);
        if (eot)
            kv_u32(f, "tokenizer.ggml.eot_token_id", eot);
    }
    if (chat_template)
        kv_str(f, "tokenizer.chat_template", chat_template);
    for (uint32_t i = 0; i < nt; i++) {
        if (td[i].skip)
            continue;
        w_str(f, td[i].name);
        w_u32(f, td[i].ne1 ? 2 : 1);
        w_u64(f, td[i].ne0);
        if (td[i].ne1)
            w_u64(f, td[i].ne1);
        w_u32(f, td[i].type);
        w_u64(f, td[i].offset);
    }
    static const uint8_t zeros[32];
    long pos = ftell(f);
    w_bytes(f, zeros, (size_t)((32 - pos % 32) % 32));

    uint32_t max_ne0 = 0;
    for (uint32_t i = 0; i < nt; i++)
        max_ne0 = td[i].ne0 > max_ne0 ? td[i].ne0 : max_ne0;
    float *v = malloc((size_t)max_ne0 * 4);
    uint8_t *enc = malloc((size_t)max_ne0 * 4);
    if (!v || !enc)
        return 1;
    rng_state = o.seed * 0x2545f4914f6cdd1dull + 1;
    for (uint32_t i = 0; i < nt; i++) {
        uint32_t rows = td[i].ne1 ? td[i].ne1 : 1;
        size_t rb = row_bytes(td[i].type, td[i].ne0);
        for (uint32_t r = 0; r < rows; r++) {
            gen_row(&o, &td[i], r, v);
            if (td[i].skip)
                continue;
            encode_row(td[i].type, v, td[i].ne0, enc);
            w_bytes(f, enc, rb);
        }
        if (!td[i].skip)
            w_bytes(f, zeros, (size_t)((32 - td[i].nbytes % 32) % 32));
    }
    if (fclose(f)) {
        perror(o.out);
        return 1;
    }
    free(v);
    free(enc);
    free(td);
    gguf_close(tg);
    free(chat_template);
    return 0;
}
