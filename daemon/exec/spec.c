/* Speculative decoding's policy (see spec.h): kinds, n-gram lookup, the
 * adaptive draft length and the acceptance walk. Pure functions over the
 * caller's data; no model, no lock. */
#include "spec.h"

#include <math.h>
#include <string.h>

#define SPEC_EMA 0.2f      /* weight of one observation in the acceptance average */
#define SPEC_MAX_PAUSE 64u /* steps, the longest pause */

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
    s->accept = 0.6f; /* a first guess */
    s->backoff = 4;
}

/* The best k (0: none pays) and its tokens per cost. */
static uint32_t best_len(float a, uint32_t max_draft, float cost, double *value)
{
    double aa = a < 0 ? 0 : a > 0.999f ? 0.999 : a, best = 1.0, pk = aa;
    uint32_t bk = 0;
    for (uint32_t k = 1; k <= max_draft; k++) {
        pk *= aa; /* a^(k+1) */
        double v = (1.0 - pk) / (1.0 - aa) / (1.0 + (double)cost * k);
        if (v > best * 1.001) {
            best = v;
            bk = k;
        }
    }
    *value = best;
    return bk;
}

uint32_t spec_draft_len(struct spec_state *s, uint32_t max_draft, float cost)
{
    state_init(s);
    if (s->skip) {
        s->skip--;
        return 0;
    }
    if (max_draft == 0)
        return 0;
    double v;
    uint32_t k = best_len(s->accept, max_draft, cost, &v);
    return k ? k : 1; /* not paused: at least a probe */
}

void spec_update(struct spec_state *s, uint32_t drafted, uint32_t accepted, uint32_t max_draft,
                 float cost)
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
    double v;
    if (best_len(s->accept, max_draft ? max_draft : 1, cost, &v) == 0) {
        /* drafting does not pay at this rate: pause, each pause twice the
         * last, then probe again */
        s->skip = s->backoff;
        s->backoff = s->backoff * 2 > SPEC_MAX_PAUSE ? SPEC_MAX_PAUSE : s->backoff * 2;
    } else {
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
