/* Speculative decoding's policy (see spec.h): kinds, n-gram lookup, the
 * adaptive draft length and the acceptance walk. Pure functions over the
 * caller's data; no model, no lock. */
#include "spec.h"

#include <math.h>
#include <string.h>

#define SPEC_ALL_ACCEPT 0.2f /* draft while all k are accepted with at least this chance */
#define SPEC_EMA 0.15f       /* weight of one observation in the acceptance average */
#define SPEC_POOR 0.1f       /* below this acceptance a request pauses its drafting */
#define SPEC_MAX_PAUSE 64u   /* steps, the longest pause */

const char *spec_kind_name(enum spec_kind k)
{
    switch (k) {
    case SPEC_OFF:
        return "off";
    case SPEC_NGRAM:
        return "ngram";
    case SPEC_DRAFT:
        return "draft";
    default:
        return "default";
    }
}

int spec_kind_parse(const char *s, enum spec_kind *out)
{
    if (!strcmp(s, "off"))
        *out = SPEC_OFF;
    else if (!strcmp(s, "ngram"))
        *out = SPEC_NGRAM;
    else if (!strcmp(s, "draft"))
        *out = SPEC_DRAFT;
    else
        return -1;
    return 0;
}

static void state_init(struct spec_state *s)
{
    if (s->init)
        return;
    memset(s, 0, sizeof *s);
    s->init = true;
    s->accept = 0.6f; /* a first guess: drafts 3 tokens */
    s->backoff = 4;
}

uint32_t spec_draft_len(struct spec_state *s, uint32_t max_draft)
{
    state_init(s);
    if (s->skip) {
        s->skip--;
        return 0;
    }
    if (max_draft == 0)
        return 0;
    if (s->accept >= 0.999f)
        return max_draft;
    if (s->accept <= 0.0f)
        return 1;
    /* the largest k with accept^k >= SPEC_ALL_ACCEPT */
    float k = floorf(logf(SPEC_ALL_ACCEPT) / logf(s->accept));
    uint32_t n = k < 1.0f ? 1 : k > (float)max_draft ? max_draft : (uint32_t)k;
    return n;
}

void spec_update(struct spec_state *s, uint32_t drafted, uint32_t accepted)
{
    state_init(s);
    if (drafted == 0)
        return;
    s->drafted += drafted;
    s->accepted += accepted;
    for (uint32_t i = 0; i < accepted; i++)
        s->accept += SPEC_EMA * (1.0f - s->accept);
    if (accepted < drafted)
        s->accept -= SPEC_EMA * s->accept;
    if (s->accept < SPEC_POOR) {
        /* poor: pause, each pause twice the last, and start again from a
         * modest guess so one lucky step is not needed to draft again */
        s->skip = s->backoff;
        s->backoff = s->backoff * 2 > SPEC_MAX_PAUSE ? SPEC_MAX_PAUSE : s->backoff * 2;
        s->accept = 0.3f;
    } else if (s->accept > 0.5f) {
        s->backoff = 4;
    }
}

uint32_t spec_ngram(const uint32_t *toks, size_t n, uint32_t ngram_min, uint32_t ngram_max,
                    uint32_t k, uint32_t *out)
{
    if (k == 0 || ngram_min == 0)
        return 0;
    for (uint32_t len = ngram_max; len >= ngram_min; len--) {
        if (n <= len)
            continue;
        const uint32_t *suf = toks + n - len;
        /* latest earlier occurrence: start positions i < n - len, so the
         * match is followed by at least one known token */
        for (size_t i = n - len; i-- > 0;) {
            if (toks[i] != suf[0] || memcmp(toks + i, suf, (size_t)len * sizeof *toks))
                continue;
            size_t from = i + len, avail = n - from;
            uint32_t m = avail < k ? (uint32_t)avail : k;
            memcpy(out, toks + from, (size_t)m * sizeof *out);
            return m;
        }
        if (len == ngram_min)
            break;
    }
    return 0;
}

uint32_t spec_accept(const uint32_t *draft, uint32_t k, const uint32_t *picks)
{
    uint32_t m = 0;
    while (m < k && draft[m] == picks[m])
        m++;
    return m;
}
