/* remote_value: sealing and opening the remote tier's values (remote_value.h). */
#include "remote_value.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "remote_value stores token ids in host order, which must be little-endian"
#endif

#define MAGIC "KVR1"
#define VERSION 1u
#define FIXED 68u /* the body's fixed part, up to and with the name's length */
#define MAX_BLOCK_TOKENS 4096u
#define MAX_BLOCK_BYTES ((uint64_t)1 << 30)
#define MAX_BLOCKS (1u << 20)

_Static_assert(crypto_aead_xchacha20poly1305_ietf_NPUBBYTES == 24, "nonce size");
_Static_assert(crypto_aead_xchacha20poly1305_ietf_ABYTES == 16, "tag size");
_Static_assert(crypto_aead_xchacha20poly1305_ietf_KEYBYTES == REMOTE_FLEET_KEY_BYTES, "key size");
_Static_assert(crypto_core_hchacha20_KEYBYTES == REMOTE_FLEET_KEY_BYTES, "HChaCha20 key size");
_Static_assert(crypto_core_hchacha20_INPUTBYTES == 16, "HChaCha20 input size");

static EVP_CIPHER_CTX *aead_ctx(void);

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get32(const unsigned char *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint64_t get64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int remote_fleet_key_parse(const char *text, size_t len, struct remote_fleet_key *k,
                           struct kvd_error *e)
{
    if (len == 2 * REMOTE_FLEET_KEY_BYTES + 1 && text[len - 1] == '\n')
        len--;
    if (len != 2 * REMOTE_FLEET_KEY_BYTES)
        return kvd_error_set(e, KVD_EBADREQ,
                             "remote key: must be exactly 64 hex digits (32 bytes), optionally "
                             "followed by one newline; it has %zu bytes",
                             len);
    for (size_t i = 0; i < REMOTE_FLEET_KEY_BYTES; i++) {
        int hi = hexval(text[2 * i]), lo = hexval(text[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            sodium_memzero(k->k, sizeof k->k);
            return kvd_error_set(e, KVD_EBADREQ, "remote key: character %zu is not a hex digit",
                                 2 * i + (hi >= 0));
        }
        k->k[i] = (uint8_t)(hi << 4 | lo);
    }
    k->secure = true;
    return 0;
}

int remote_fleet_key_load(const char *path, struct remote_fleet_key *k, struct kvd_error *e)
{
    if (sodium_init() < 0)
        return kvd_error_set(e, KVD_EINTERNAL, "remote key: libsodium failed to start");
    /* Checked here, at start-up: without it every value would fail to seal and to open. */
    if (!aead_ctx())
        return kvd_error_set(e, KVD_EINTERNAL,
                             "remote-key-file %s: OpenSSL libcrypto offers no ChaCha20-Poly1305 "
                             "(a FIPS-only provider configuration?): values cannot be sealed",
                             path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvd_error_set(e, KVD_EBADREQ, "remote-key-file %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return kvd_error_set(e, KVD_EBADREQ, "remote-key-file %s: not a regular file", path);
    }
    if (st.st_mode & 077) {
        close(fd);
        return kvd_error_set(e, KVD_EBADREQ,
                             "remote-key-file %s: mode %04o lets group or others at it; it must "
                             "be 0600 or stricter (chmod 600 %s)",
                             path, (unsigned)(st.st_mode & 07777), path);
    }
    char buf[2 * REMOTE_FLEET_KEY_BYTES + 2];
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    if (n < 0)
        return kvd_error_set(e, KVD_EBADREQ, "remote-key-file %s: %s", path, strerror(errno));
    int rc = remote_fleet_key_parse(buf, (size_t)n, k, e);
    sodium_memzero(buf, sizeof buf);
    if (rc) {
        char why[KVD_ERROR_MSG_MAX];
        snprintf(why, sizeof why, "%s", e ? e->message + strlen("remote key: ") : "bad key");
        return kvd_error_set(e, KVD_EBADREQ, "remote-key-file %s: %s", path, why);
    }
    return 0;
}

void remote_value_key(uint64_t ns_hash, struct blockkey last, uint8_t out[REMOTE_KEY_BYTES])
{
    memcpy(out, "kvd1:", 5);
    put64(out + 5, ns_hash);
    put64(out + 13, last.lo);
    put64(out + 21, last.hi);
}

static size_t name_padded(size_t len)
{
    return (len + 3) & ~(size_t)3;
}

/* Bytes of the body, or 0 out of range. */
static size_t body_size(uint32_t bt, uint64_t bb, uint32_t n, size_t name_len)
{
    if (bt == 0 || bt > MAX_BLOCK_TOKENS || bb == 0 || bb > MAX_BLOCK_BYTES || n == 0 ||
        n > MAX_BLOCKS || name_len == 0 || name_len > REMOTE_NS_NAME_MAX)
        return 0;
    uint64_t per = (uint64_t)bt * 4 + bb;
    if (per > SIZE_MAX / n) /* n × per fits: per ≤ 2^30 + 2^14, n ≤ 2^20 */
        return 0;
    return FIXED + name_padded(name_len) + (size_t)(per * n);
}

size_t remote_value_size(const struct remote_value_meta *m)
{
    size_t b = body_size(m->block_tokens, m->block_bytes, m->n, strlen(m->ns_name));
    return b ? REMOTE_VALUE_HEAD + b : 0;
}

void remote_value_layout(const struct remote_value_meta *m, void *buf, uint32_t **tokens,
                         void **data)
{
    unsigned char *p = buf;
    size_t nl = strlen(m->ns_name);
    memset(p, 0, REMOTE_VALUE_HEAD);
    memcpy(p, MAGIC, 4);
    unsigned char *b = p + REMOTE_VALUE_HEAD;
    put32(b, VERSION);
    put32(b + 4, m->block_tokens);
    put64(b + 8, m->block_bytes);
    put32(b + 16, m->first);
    put32(b + 20, m->n);
    put64(b + 24, m->parent.lo);
    put64(b + 32, m->parent.hi);
    put64(b + 40, m->last.lo);
    put64(b + 48, m->last.hi);
    put64(b + 56, m->ns_hash);
    put32(b + 64, (uint32_t)nl);
    memset(b + FIXED, 0, name_padded(nl));
    memcpy(b + FIXED, m->ns_name, nl);
    unsigned char *t = b + FIXED + name_padded(nl);
    *tokens = (uint32_t *)(void *)t;
    *data = t + (size_t)m->n * m->block_tokens * 4;
}

/* The associated data: the Redis key and the value's first 8 bytes (magic,
 * mode, pad), so neither can change unnoticed. */
static void ad_of(const uint8_t key[REMOTE_KEY_BYTES], const unsigned char *head,
                  unsigned char ad[REMOTE_KEY_BYTES + 8])
{
    memcpy(ad, key, REMOTE_KEY_BYTES);
    memcpy(ad + REMOTE_KEY_BYTES, head, 8);
}

static void checksum(const unsigned char *ad, const unsigned char *body, size_t n,
                     unsigned char tag[16])
{
    XXH3_state_t *s = XXH3_createState();
    XXH128_hash_t h = {0, 0};
    if (s && XXH3_128bits_reset(s) == XXH_OK) {
        XXH3_128bits_update(s, ad, REMOTE_KEY_BYTES + 8);
        XXH3_128bits_update(s, body, n);
        h = XXH3_128bits_digest(s);
    }
    XXH3_freeState(s);
    put64(tag, h.low64);
    put64(tag + 8, h.high64);
}

/* XChaCha20-Poly1305-IETF (libsodium's crypto_aead_xchacha20poly1305_ietf, the values' format)
 * is ChaCha20-Poly1305-IETF under the subkey HChaCha20(key, nonce[0..16]) with the 12-byte
 * nonce 4 zero bytes ‖ nonce[16..24]. The subkey comes from libsodium, the AEAD from OpenSSL's
 * libcrypto, whose ChaCha20 and Poly1305 use AVX2/AVX-512 and open values ~3x as fast as
 * libsodium 1.0.18 (bench_remote): opening values on one core bounds a sealed restore. The
 * bytes are libsodium's (the unit test checks both ways), so values written by either open
 * with the other. */
static pthread_once_t aead_once = PTHREAD_ONCE_INIT;
static pthread_key_t aead_tls;  /* the thread's EVP_CIPHER_CTX */
static EVP_CIPHER *aead_cipher; /* fetched once, kept for the process */
static bool aead_ready;

static void aead_ctx_free(void *c)
{
    EVP_CIPHER_CTX_free(c);
}

static void aead_setup(void)
{
    aead_cipher = EVP_CIPHER_fetch(NULL, "ChaCha20-Poly1305", NULL);
    aead_ready =
        sodium_init() >= 0 && aead_cipher && pthread_key_create(&aead_tls, aead_ctx_free) == 0;
}

/* The calling thread's cipher context, set up for ChaCha20-Poly1305 on first use and kept
 * (freed when the thread ends): a value's seal or open then only re-keys it, no allocation.
 * NULL when libcrypto or libsodium failed. */
static EVP_CIPHER_CTX *aead_ctx(void)
{
    pthread_once(&aead_once, aead_setup);
    if (!aead_ready)
        return NULL;
    EVP_CIPHER_CTX *c = pthread_getspecific(aead_tls);
    if (c)
        return c;
    c = EVP_CIPHER_CTX_new();
    if (c && (EVP_CipherInit_ex2(c, aead_cipher, NULL, NULL, 1, NULL) != 1 ||
              pthread_setspecific(aead_tls, c) != 0)) {
        EVP_CIPHER_CTX_free(c);
        c = NULL;
    }
    return c;
}

/* Encrypts (enc 1) or decrypts (enc 0) body[0, n) in place under XChaCha20-Poly1305-IETF
 * with ad; encrypting writes the tag, decrypting checks it. 0, or -1 when the cipher fails
 * or (decrypting) the tag is wrong: the body is then garbage, and the value is dropped. */
static int xchacha_crypt(int enc, const uint8_t key[REMOTE_FLEET_KEY_BYTES],
                         const unsigned char nonce[24], const unsigned char *ad, size_t ad_len,
                         unsigned char *body, size_t n, unsigned char tag[16])
{
    EVP_CIPHER_CTX *c = aead_ctx();
    if (!c)
        return -1;
    unsigned char sub[REMOTE_FLEET_KEY_BYTES], iv[12] = {0};
    crypto_core_hchacha20(sub, nonce, key, NULL);
    memcpy(iv + 4, nonce + 16, 8);
    int ok = EVP_CipherInit_ex2(c, NULL, sub, iv, enc, NULL) == 1;
    sodium_memzero(sub, sizeof sub);
    int out = 0;
    ok = ok && EVP_CipherUpdate(c, NULL, &out, ad, (int)ad_len) == 1;
    for (size_t at = 0; ok && at < n;) { /* EVP's lengths are ints */
        size_t step = n - at < (size_t)INT_MAX / 2 ? n - at : (size_t)INT_MAX / 2;
        ok = EVP_CipherUpdate(c, body + at, &out, body + at, (int)step) == 1 && (size_t)out == step;
        at += step;
    }
    if (ok && !enc)
        ok = EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_SET_TAG, 16, tag) == 1;
    ok = ok && EVP_CipherFinal_ex(c, body + n, &out) == 1 && out == 0;
    if (ok && enc)
        ok = EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_GET_TAG, 16, tag) == 1;
    return ok ? 0 : -1;
}

int remote_value_seal(const struct remote_fleet_key *k, const uint8_t key[REMOTE_KEY_BYTES],
                      void *buf, size_t len)
{
    unsigned char *p = buf, *nonce = p + 8, *tag = p + 32, *body = p + REMOTE_VALUE_HEAD;
    if (len <= REMOTE_VALUE_HEAD)
        return -1;
    size_t n = len - REMOTE_VALUE_HEAD;
    unsigned char ad[REMOTE_KEY_BYTES + 8];
    p[4] = k->secure ? 1 : 0;
    ad_of(key, p, ad);
    if (!k->secure) {
        memset(nonce, 0, 24);
        checksum(ad, body, n, tag);
        return 0;
    }
    if (sodium_init() < 0)
        return -1;
    randombytes_buf(nonce, 24);
    return xchacha_crypt(1, k->k, nonce, ad, sizeof ad, body, n, tag);
}

enum remote_value_status remote_value_open(const struct remote_fleet_key *k,
                                           const uint8_t key[REMOTE_KEY_BYTES], void *buf,
                                           size_t len, struct remote_value_view *v)
{
    unsigned char *p = buf, *nonce = p + 8, *tag = p + 32, *b = p + REMOTE_VALUE_HEAD;
    memset(v, 0, sizeof *v);
    if (len < REMOTE_VALUE_HEAD + FIXED || memcmp(p, MAGIC, 4) != 0 || p[5] || p[6] || p[7])
        return REMOTE_VALUE_MALFORMED;
    size_t n = len - REMOTE_VALUE_HEAD;
    /* A plain value where a key is configured is a forgery, and the other
     * way round a value this daemon cannot read: both fail to authenticate. */
    if (p[4] != (k->secure ? 1 : 0))
        return p[4] > 1 ? REMOTE_VALUE_MALFORMED : REMOTE_VALUE_AUTH;
    unsigned char ad[REMOTE_KEY_BYTES + 8];
    ad_of(key, p, ad);
    if (k->secure) {
        if (xchacha_crypt(0, k->k, nonce, ad, sizeof ad, b, n, tag) != 0)
            return REMOTE_VALUE_AUTH;
    } else {
        unsigned char want[16];
        for (int i = 0; i < 24; i++) /* no nonce in a plain value */
            if (nonce[i])
                return REMOTE_VALUE_MALFORMED;
        checksum(ad, b, n, want);
        if (memcmp(want, tag, 16) != 0)
            return REMOTE_VALUE_AUTH;
    }
    struct remote_value_meta *m = &v->m;
    if (get32(b) != VERSION)
        return REMOTE_VALUE_MALFORMED;
    m->block_tokens = get32(b + 4);
    m->block_bytes = get64(b + 8);
    m->first = get32(b + 16);
    m->n = get32(b + 20);
    m->parent = (struct blockkey){get64(b + 24), get64(b + 32)};
    m->last = (struct blockkey){get64(b + 40), get64(b + 48)};
    m->ns_hash = get64(b + 56);
    uint32_t nl = get32(b + 64);
    size_t want = body_size(m->block_tokens, m->block_bytes, m->n, nl);
    if (want == 0 || want != n || (uint64_t)m->first + m->n - 1 > UINT32_MAX)
        return REMOTE_VALUE_MALFORMED;
    const unsigned char *name = b + FIXED;
    for (uint32_t i = 0; i < nl; i++)
        if (name[i] == 0)
            return REMOTE_VALUE_MALFORMED;
    for (size_t i = nl; i < name_padded(nl); i++)
        if (name[i] != 0)
            return REMOTE_VALUE_MALFORMED;
    memcpy(m->ns_name, name, nl);
    m->ns_name[nl] = 0;
    v->tokens = name + name_padded(nl);
    v->data = (const unsigned char *)v->tokens + (size_t)m->n * m->block_tokens * 4;
    return REMOTE_VALUE_OK;
}

enum remote_value_status remote_value_check(const struct remote_value_view *v,
                                            const struct remote_value_meta *want, uint32_t end,
                                            const uint32_t *tokens, const struct blockkey *chain,
                                            struct blockkey root)
{
    const struct remote_value_meta *m = &v->m;
    if (m->block_tokens != want->block_tokens || m->block_bytes != want->block_bytes ||
        m->ns_hash != want->ns_hash || strcmp(m->ns_name, want->ns_name) != 0 || m->n == 0 ||
        m->first > end || (uint64_t)m->first + m->n - 1 != end)
        return REMOTE_VALUE_MISMATCH;
    struct blockkey parent = m->first ? chain[m->first - 1] : root;
    if (!blockkey_eq(m->last, chain[end]) || !blockkey_eq(m->parent, parent))
        return REMOTE_VALUE_MISMATCH;
    size_t bt = m->block_tokens;
    if (memcmp(v->tokens, tokens + (size_t)m->first * bt, (size_t)m->n * bt * 4) != 0)
        return REMOTE_VALUE_MISMATCH;
    return REMOTE_VALUE_OK;
}
