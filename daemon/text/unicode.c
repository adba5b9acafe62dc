/* UTF-8 helpers of the tokenizer (see unicode.h). */
#include "unicode.h"

#include <string.h>

uint32_t uni_decode_llama(const uint8_t *s, size_t len, size_t *off)
{
    size_t o = *off;
    uint8_t b = s[o];
    if (b < 0x80) {
        *off = o + 1;
        return b;
    }
    size_t n;
    uint32_t cp;
    if ((b & 0x40) == 0) {
        n = 0; /* stray continuation byte */
        cp = 0;
    } else if ((b & 0x20) == 0) {
        n = 2;
        cp = b & 0x1f;
    } else if ((b & 0x10) == 0) {
        n = 3;
        cp = b & 0x0f;
    } else if ((b & 0x08) == 0) {
        n = 4;
        cp = b & 0x07;
    } else {
        n = 0;
        cp = 0;
    }
    if (n == 0 || o + n > len) {
        *off = o + 1;
        return 0xFFFD;
    }
    for (size_t i = 1; i < n; i++) {
        if ((s[o + i] & 0xc0) != 0x80) {
            *off = o + 1;
            return 0xFFFD;
        }
        cp = (cp << 6) | (s[o + i] & 0x3f);
    }
    *off = o + n;
    return cp;
}

size_t uni_encode(uint32_t cp, char *out)
{
    if (cp <= 0x7f) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp <= 0x7ff) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp > 0x10ffff)
        cp = 0xFFFD;
    if (cp <= 0xffff) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

static size_t put_fffd(char *out)
{
    out[0] = (char)0xef;
    out[1] = (char)0xbf;
    out[2] = (char)0xbd;
    return 3;
}

/* The WHATWG Encoding Standard's UTF-8 decoder, byte by byte. */
size_t uni_utf8_feed(struct uni_utf8_state *st, const uint8_t *in, size_t n, char *out)
{
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = in[i];
        if (st->need == 0) {
            if (b < 0x80) {
                out[w++] = (char)b;
                continue;
            }
            st->lower = 0x80;
            st->upper = 0xbf;
            if (b >= 0xc2 && b <= 0xdf) {
                st->need = 1;
            } else if (b >= 0xe0 && b <= 0xef) {
                if (b == 0xe0)
                    st->lower = 0xa0;
                if (b == 0xed)
                    st->upper = 0x9f;
                st->need = 2;
            } else if (b >= 0xf0 && b <= 0xf4) {
                if (b == 0xf0)
                    st->lower = 0x90;
                if (b == 0xf4)
                    st->upper = 0x8f;
                st->need = 3;
            } else {
                w += put_fffd(out + w);
                continue;
            }
            st->seen = 0;
            st->buf[0] = b;
            continue;
        }
        if (b < st->lower || b > st->upper) {
            /* ill-formed: the open sequence is one U+FFFD, and this byte
             * starts over */
            st->need = 0;
            w += put_fffd(out + w);
            i--;
            continue;
        }
        st->lower = 0x80;
        st->upper = 0xbf;
        st->buf[++st->seen] = b;
        if (st->seen == st->need) {
            memcpy(out + w, st->buf, st->seen + 1);
            w += st->seen + 1;
            st->need = 0;
        }
    }
    return w;
}

size_t uni_utf8_finish(struct uni_utf8_state *st, char *out)
{
    if (st->need == 0)
        return 0;
    st->need = 0;
    return put_fffd(out);
}
