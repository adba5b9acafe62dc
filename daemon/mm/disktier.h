/* disktier: the tier under the host tier, in one directory (--disk-dir).
 *
 * Layout (docs/persistence.md has the bytes):
 *   blocks.kvd  a 4 KiB header, then n_slots preallocated slots of
 *               slot_bytes: a slot header (magic, key, namespace name, the
 *               block's token ids, checksums) padded to 4 KiB, then the
 *               block's bytes padded to 4 KiB. Read and written with
 *               O_DIRECT where the file system allows it.
 *   index.kvd   a 4 KiB header, then one 64-byte record per slot: its key,
 *               the checksum of its data, a stamp (write order) and the
 *               session pin. Fixed size: no journal grows.
 *   lock        flock'd while a daemon uses the directory.
 * n_slots comes from --disk-max-bytes, so the tier never grows past it.
 *
 * In memory: the records, an open-addressing table from (namespace, key) to
 * slot (O(1) lookup, hashed under a per-process seed), a use list (LRU with
 * credits for hits and tenant weights: disktier_touch) and a
 * free list. Start-up reads the index only, never block data.
 *
 * Nothing here trusts the files: a record is used only when its own checksum
 * holds, and a read is served only when the slot's header checksum, its
 * namespace, key and token ids, and the data checksum recorded in the index
 * all agree. Any mismatch drops the slot and is counted; the caller
 * recomputes the block. So a torn write, a flipped byte, a foreign or
 * truncated directory costs a recomputation, never a wrong byte.
 *
 * Thread-safe: one mutex guards the in-memory index; reads and writes run
 * on the caller's thread (the writer thread, the prefetch workers) with the
 * mutex released, never on the event loop or inside an executor step. */
#ifndef KVD_DISKTIER_H
#define KVD_DISKTIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blockkey.h"
#include "kvd/status.h"

#define DISKTIER_NONE UINT32_MAX
#define DISKTIER_NS_NAME 80 /* bytes of a namespace name, NUL included */

struct disktier_conf {
    const char *dir;
    uint64_t max_bytes; /* of blocks.kvd: n_slots = (max_bytes - 4096) / slot_bytes */
    size_t block_bytes;
    uint32_t block_tokens;
    bool no_uring; /* batched reads use preadv even where io_uring is there */
    bool lru;      /* plain LRU eviction (evict-policy = lru); else hits and weights count */
};

struct disktier_stats {
    uint64_t slots, free_slots, cached_slots, pinned_slots;
    uint64_t slot_bytes, file_bytes;
    uint64_t reads, read_bytes, writes, write_bytes, write_skips;
    uint64_t checksum_failures, io_errors, evictions;
    uint64_t loaded, dropped_at_load; /* records found valid / refused at start */
    uint64_t read_ns;                 /* total time in reads (restore latency / reads) */
    uint64_t read_reqs;               /* I/O requests the reads took (coalesced runs of slots) */
    uint64_t write_reqs;              /* I/O requests the writes took */
    uint64_t drops_unlogged;          /* drops the full drop log could not take */
    uint64_t evict_passes;            /* slots given another turn for their credit */
};

struct disktier;

/* Opens (creating or formatting as needed) the tier in c->dir and loads its
 * index. A directory of another layout (slot size, block geometry) or
 * whose index does not belong to its block file is formatted anew, and
 * said so in the log. Errors (KVD_EBADREQ, KVD_EBUSY: another daemon holds
 * the directory, KVD_ENOMEM, KVD_EINTERNAL for I/O) say which path and
 * why in e. */
int disktier_open(const struct disktier_conf *c, struct disktier **out, struct kvd_error *e);
void disktier_close(struct disktier *dt);

/* A buffer for one slot (aligned for O_DIRECT), for disktier_put and
 * disktier_read; free() releases it. disktier_data is where the block's
 * bytes go in it. */
void *disktier_buf_new(const struct disktier *dt);
void *disktier_data(const struct disktier *dt, void *buf);

/* The slot holding (ns, key), pinned against eviction until disktier_read
 * or disktier_unpin; DISKTIER_NONE when there is none. */
uint32_t disktier_lookup(struct disktier *dt, uint64_t ns, struct blockkey key);
bool disktier_has(struct disktier *dt, uint64_t ns, struct blockkey key);
void disktier_unpin(struct disktier *dt, uint32_t slot);

/* Reads pinned slot into buf and checks it against what the caller expects
 * (namespace name and hash, key, block_tokens token ids); unpins it. 0, or
 * KVD_EINTERNAL when the slot is corrupt or unreadable (dropped, counted). */
int disktier_read(struct disktier *dt, uint32_t slot, const char *ns_name, uint64_t ns,
                  struct blockkey key, const uint32_t *tokens, void *buf);

/* One block of a batch read (disktier_read_many): a slot pinned by
 * disktier_lookup, what it must hold, and the buffer (disktier_buf_new, or
 * any 4 KiB-aligned slot_bytes of memory) it is read into. */
struct disktier_rd {
    uint32_t slot;
    struct blockkey key;
    const uint32_t *tokens; /* block_tokens ids */
    void *buf;
    int rc; /* out: 0, or KVD_EINTERNAL (dropped and counted as disktier_read) */
};

/* Reads n pinned slots of namespace (ns_name, ns) at once: runs of adjacent
 * slots are coalesced into one request (up to DISKTIER_REQ_BYTES each,
 * scattered into the blocks' buffers), and several requests are in flight
 * (io_uring when kvd was built with liburing and the kernel allows it,
 * else preadv one request at a time). Each request's blocks get every check
 * disktier_read makes as soon as it completes (the other requests still in
 * flight); a failed one is dropped and counted exactly as there. Unpins
 * every slot. Returns how many blocks passed (v[i].rc says which).
 * disktier_read_end(disktier_read_begin(...)). */
size_t disktier_read_many(struct disktier *dt, const char *ns_name, uint64_t ns,
                          struct disktier_rd *v, size_t n);

/* disktier_read_many in two halves, so that a caller can start the next
 * batch while this one is read: begin submits the requests (io_uring) and
 * returns with them in flight (without io_uring it reads them); end waits,
 * checks each request's blocks as it completes, unpins and frees the batch,
 * and returns how many blocks passed. v, its tokens and buffers must stay
 * as they are until end. begin returns NULL for n = 0 or when out of memory
 * (then every v[i] has failed, counted and unpinned); end(NULL) is 0. */
struct disktier_batch;
struct disktier_batch *disktier_read_begin(struct disktier *dt, const char *ns_name, uint64_t ns,
                                           struct disktier_rd *v, size_t n);
size_t disktier_read_end(struct disktier_batch *b);
#define DISKTIER_REQ_BYTES (4u << 20) /* the most one coalesced request reads */
#define DISKTIER_QDEPTH 8             /* requests in flight per batch (io_uring) */

/* Whether reads go through io_uring (false: preadv). */
bool disktier_uring(const struct disktier *dt);

/* Writes the block whose bytes are at disktier_data(dt, buf) under (ns,
 * key), evicting a slot when none is free (the least recently used one not
 * pinned, given another turn while it has credit: see disktier_touch).
 * 0 (also when the key is already there), KVD_ENOMEM (every slot pinned:
 * counted as a skip) or KVD_EINTERNAL (I/O error: counted, nothing kept). */
int disktier_put(struct disktier *dt, const char *ns_name, uint64_t ns, struct blockkey key,
                 const uint32_t *tokens, void *buf);

/* One block of a batch write (disktier_put_many). */
struct disktier_wr {
    const char *ns_name;
    uint64_t ns;
    struct blockkey key;
    const uint32_t *tokens; /* block_tokens ids */
    void *buf;              /* disktier_buf_new, the block's bytes at disktier_data */
    uint32_t hits;          /* the block's hits so far (0: none known) */
    uint32_t weight;        /* its tenant's weight (0: 1) */
    int rc;                 /* out: as disktier_put's */
};

/* disktier_put of n blocks at once: their slots are taken under one lock
 * (a free list in slot order gives adjacent ones), runs of adjacent slots
 * go out as one pwritev each (up to DISKTIER_REQ_BYTES), and each block
 * ends as disktier_put's would (v[i].rc). Returns how many are on disk (or
 * were already). */
size_t disktier_put_many(struct disktier *dt, struct disktier_wr *v, size_t n);

/* Eviction order. A full tier evicts from the least recently used end;
 * unless conf.lru, a block there with credit left is given another turn
 * (GCLOCK): its tenant's weight w gives it w - 1 turns when written, and
 * each doubling of its hits w more (log2(1 + hits), as the memory tiers'
 * `hits` policy counts them). A restore from disk is a hit and a use.
 * disktier_touch tells the tier that a block it holds was used elsewhere
 * (its memory copy is being dropped, with hits so far): it becomes the most
 * recently used, with the credit of those hits. False when (ns, key) is not
 * on disk (evicted meanwhile: the caller may write it again). */
bool disktier_touch(struct disktier *dt, uint64_t ns, struct blockkey key, uint32_t hits,
                    uint32_t weight);

/* Makes every write so far durable (fdatasync of both files). A failure
 * drops what was written since the last good sync: its pages cannot be
 * trusted. 0 or KVD_EINTERNAL. */
int disktier_sync(struct disktier *dt);

/* Session pins: a pinned slot is never evicted until `expires` (unix
 * seconds); a pin never shortens a longer one (sessions share blocks);
 * 0 unpins. KVD_ENOTFOUND when (ns, key) is not on disk. */
int disktier_pin(struct disktier *dt, uint64_t ns, struct blockkey key, uint64_t expires);

void disktier_stats(struct disktier *dt, struct disktier_stats *st);

/* The drop log (for the KV events' DISK medium): once watched, every slot
 * that leaves the index (evicted, failed a check, lost to a failed sync)
 * is logged, at most cap of them waiting (beyond, counted in
 * drops_unlogged); disktier_take_drops takes up to max of them, oldest
 * first. */
struct disktier_drop {
    uint64_t ns;
    struct blockkey key;
};
int disktier_watch_drops(struct disktier *dt, size_t cap);
size_t disktier_take_drops(struct disktier *dt, struct disktier_drop *out, size_t max);

/* Validates an index file's bytes as disktier_open would (for the fuzzer):
 * how many records would load. Never reads past len. */
size_t disktier_check_index(const void *bytes, size_t len, size_t block_bytes,
                            uint32_t block_tokens);

#endif
