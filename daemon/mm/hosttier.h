/* hosttier: moving blocks between the device and host arenas through the
 * backend, with the checksum that guards host copies: written at swap-out,
 * verified before swap-in, so a corrupted host block is never served. */
#ifndef KVD_HOSTTIER_H
#define KVD_HOSTTIER_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

/* Checksum of block `id`'s bytes where it lives now (must be CPU-readable:
 * the host tier always is). Seeded with the id, so a block copied into the
 * wrong slot fails too. */
uint64_t hosttier_checksum(const struct pool *p, uint32_t id);
/* 0 when host block id still matches its checksum, else KVD_EINTERNAL. */
int hosttier_verify(const struct pool *p, uint32_t id);

/* Moves n blocks (all on the other tier) to tier `to` as one batch:
 * copy_async for each (copy when the backend has none), one copy_wait.
 * Each block's slot on `to` is taken in its owner's pages (pool_slot_take:
 * a new page when they are full; the caller made room). To the host: writes every
 * checksum. To the device: verifies every checksum first and moves nothing
 * when one fails (*bad = its index). All or nothing: 0, KVD_EINTERNAL
 * (checksum or copy failure) or KVD_ENOMEM. */
int hosttier_move(struct pool *p, const uint32_t *ids, size_t n, enum kvd_tier to, size_t *bad);

#endif
