/* redis_cluster: the pure parts of Redis Cluster routing, used by redisconn.c: a key's hash
 * slot (CRC16/XMODEM of the key or of its {hash tag}, mod 16384), the MOVED and ASK error
 * replies, and the CLUSTER SLOTS reply. No I/O here. */
#ifndef KVD_REDIS_CLUSTER_H
#define KVD_REDIS_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define REDIS_CLUSTER_SLOTS 16384u
#define REDIS_HOST_MAX 256 /* a host name, NUL included */

struct redisReply;

/* CRC16/XMODEM (poly 0x1021, init 0), as Redis Cluster uses it: "123456789" gives 0x31c3. */
uint16_t redis_crc16(const void *p, size_t n);

/* The hash slot of a key: when the key holds a '{' followed later by a '}' with at least one
 * byte between them, only the bytes between the first '{' and the first '}' after it are
 * hashed (a hash tag); otherwise the whole key. */
uint16_t redis_key_slot(const void *key, size_t n);

/* A redirect in an error reply: "MOVED <slot> <host>:<port>" or "ASK <slot> <host>:<port>"
 * (host may be an IPv6 address: the port follows the last ':'; an empty host means the node
 * that answered). */
struct redis_redirect {
    bool ask; /* ASK (once, with ASKING first) rather than MOVED (the slot has moved) */
    uint16_t slot;
    char host[REDIS_HOST_MAX];
    int port;
};
/* Returns true and fills r when err (len bytes, not NUL-terminated) is a well-formed redirect;
 * false for any other error or a malformed one. */
bool redis_parse_redirect(const char *err, size_t len, struct redis_redirect *r);

/* One master's slot range from CLUSTER SLOTS. */
struct redis_slot_range {
    uint16_t start, end; /* inclusive */
    char host[REDIS_HOST_MAX];
    int port;
};
/* Parses a CLUSTER SLOTS reply into at most cap ranges; an empty or "?" host becomes
 * asked_host (the node that answered). Returns the number of ranges, or -1 (msg set) when the
 * reply is not a well-formed CLUSTER SLOTS answer (wrong types, slot out of range, bad port,
 * more than cap ranges). */
int redis_parse_cluster_slots(const struct redisReply *r, const char *asked_host,
                              struct redis_slot_range *out, size_t cap, char *msg, size_t msg_cap);

#endif
