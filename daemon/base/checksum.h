/* checksum: a fast non-cryptographic 64-bit hash over block bytes. The host
 * tier writes it when a block is swapped out and checks it before the block
 * is swapped back in, so a corrupted host copy is never served. */
#ifndef KVD_CHECKSUM_H
#define KVD_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* Hash of `len` bytes at p (any alignment). Four independent multiply-rotate
 * lanes over 32-byte stripes, so it runs near memory bandwidth; not meant to
 * resist an adversary, only to catch bit flips and torn copies. */
uint64_t checksum64(const void *p, size_t len, uint64_t seed);

#endif
