/* redis_cluster: key slots, redirects and the CLUSTER SLOTS reply (redis_cluster.h). */
#include "redis_cluster.h"

#include <stdio.h>
#include <string.h>

#include <hiredis/hiredis.h>

uint16_t redis_crc16(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)(b[i] << 8);
        for (int k = 0; k < 8; k++)
            crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

uint16_t redis_key_slot(const void *key, size_t n)
{
    const char *k = key;
    const char *open = n ? memchr(k, '{', n) : NULL;
    if (open) {
        size_t start = (size_t)(open - k) + 1;
        const char *close = start < n ? memchr(k + start, '}', n - start) : NULL;
        if (close && close > k + start)
            return redis_crc16(k + start, (size_t)(close - (k + start))) &
                   (REDIS_CLUSTER_SLOTS - 1);
    }
    return redis_crc16(k, n) & (REDIS_CLUSTER_SLOTS - 1);
}

/* "host:port" (port after the last ':'; 1..65535) into host and port. */
static bool parse_endpoint(const char *s, size_t len, char *host, int *port)
{
    const char *colon = NULL;
    for (size_t i = 0; i < len; i++)
        if (s[i] == ':')
            colon = s + i;
    if (!colon)
        return false;
    size_t hl = (size_t)(colon - s);
    if (hl >= REDIS_HOST_MAX)
        return false;
    const char *d = colon + 1, *end = s + len;
    if (d == end || end - d > 5)
        return false;
    int v = 0;
    for (; d < end; d++) {
        if (*d < '0' || *d > '9')
            return false;
        v = v * 10 + (*d - '0');
    }
    if (v < 1 || v > 65535)
        return false;
    memcpy(host, s, hl);
    host[hl] = '\0';
    *port = v;
    return true;
}

bool redis_parse_redirect(const char *err, size_t len, struct redis_redirect *r)
{
    size_t off;
    if (len > 6 && memcmp(err, "MOVED ", 6) == 0) {
        r->ask = false;
        off = 6;
    } else if (len > 4 && memcmp(err, "ASK ", 4) == 0) {
        r->ask = true;
        off = 4;
    } else {
        return false;
    }
    unsigned slot = 0;
    size_t digits = 0;
    while (off < len && err[off] >= '0' && err[off] <= '9' && digits < 6) {
        slot = slot * 10 + (unsigned)(err[off] - '0');
        off++;
        digits++;
    }
    if (digits == 0 || slot >= REDIS_CLUSTER_SLOTS || off >= len || err[off] != ' ')
        return false;
    off++;
    size_t end = off;
    while (end < len && err[end] != ' ' && err[end] != '\r' && err[end] != '\n')
        end++;
    if (end != len) /* nothing may follow the endpoint */
        return false;
    r->slot = (uint16_t)slot;
    return parse_endpoint(err + off, end - off, r->host, &r->port);
}

int redis_parse_cluster_slots(const struct redisReply *r, const char *asked_host,
                              struct redis_slot_range *out, size_t cap, char *msg, size_t msg_cap)
{
    if (!r || r->type != REDIS_REPLY_ARRAY) {
        snprintf(msg, msg_cap, "CLUSTER SLOTS: not an array (reply type %d)", r ? r->type : -1);
        return -1;
    }
    if (r->elements > cap) {
        snprintf(msg, msg_cap, "CLUSTER SLOTS: %zu ranges, more than %zu", r->elements, cap);
        return -1;
    }
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (!e || e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2) {
            snprintf(msg, msg_cap, "CLUSTER SLOTS: range %zu is malformed", i);
            return -1;
        }
        long long s = e->element[0]->integer, t = e->element[1]->integer;
        const redisReply *m = e->element[2];
        const redisReply *h = m->element[0], *p = m->element[1];
        if (s < 0 || t < s || t >= REDIS_CLUSTER_SLOTS || h->type != REDIS_REPLY_STRING ||
            p->type != REDIS_REPLY_INTEGER || p->integer < 1 || p->integer > 65535 ||
            h->len >= REDIS_HOST_MAX) {
            snprintf(msg, msg_cap, "CLUSTER SLOTS: range %zu has bad slots or endpoint", i);
            return -1;
        }
        out[i].start = (uint16_t)s;
        out[i].end = (uint16_t)t;
        if (h->len == 0 || (h->len == 1 && h->str[0] == '?')) {
            snprintf(out[i].host, sizeof(out[i].host), "%s", asked_host);
        } else {
            if (memchr(h->str, '\0', h->len)) {
                snprintf(msg, msg_cap, "CLUSTER SLOTS: range %zu: a NUL in the host", i);
                return -1;
            }
            memcpy(out[i].host, h->str, h->len);
            out[i].host[h->len] = '\0';
        }
        out[i].port = (int)p->integer;
    }
    return (int)r->elements;
}
