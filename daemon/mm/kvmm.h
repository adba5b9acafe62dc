/* kvmm: the KV memory manager facade. It ties together the block pool
 * (pool.h), the radix prefix trees (radix.h), the host tier, sequences and
 * tenants, and is the only API the server's ops and the scheduler use.
 *
 * Lock rule: one mutex per kvmm (kvmm_lock/kvmm_unlock). Every kvmm_*
 * function below expects the caller to hold it, so a caller can make
 * several calls atomic, except kvmm_new/kvmm_free/kvmm_lock/kvmm_unlock and
 * the accessors of what never changes after kvmm_new (kvmm_geom,
 * kvmm_block_bytes, kvmm_device_arena, kvmm_host_arena). kvmm_free needs
 * the lock released. Builds with KVD_LOCK_CHECKS (Debug and sanitizer
 * builds) check it: kvmm_lock records the holding thread and every other
 * call aborts, naming itself, when the caller is not that thread. Nothing
 * here blocks on a socket; swaps and copies run through the backend
 * (synchronous from the caller's point of view).
 *
 * Errors: functions return 0 or an enum kvd_err; on error the state is
 * unchanged (no partial allocation) and kvmm_errmsg() says what happened in
 * words a person can act on. */
#ifndef KVD_KVMM_H
#define KVD_KVMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "disktier.h"
#include "kv_types.h"
#include "kvd/status.h"

#define KVMM_UNLIMITED UINT32_MAX
#define KVMM_NO_TENANT UINT32_MAX

struct kvmm_tenant_conf {
    char name[64];
    uint32_t max_device_blocks; /* KVMM_UNLIMITED for none */
    uint32_t max_host_blocks;
    uint32_t max_seqs;
    uint32_t reserved_device_blocks; /* floor others borrow only while unused: a
                                        tenant's cached blocks inside its floor are
                                        never evicted for another tenant; cached
                                        blocks of tenants above their floor are
                                        evicted first */
    uint32_t weight;                 /* scheduling weight, >= 1 */
    /* Across every pool on the page budget (every model), in whole pages
     * (pages.h); 0: none. max_*_bytes: the pages its blocks may hold;
     * reserved_device_bytes: a floor like reserved_device_blocks, in the
     * budget's pages. The block limits above apply to this pool alone. */
    uint64_t max_device_bytes, max_host_bytes, reserved_device_bytes;
    uint64_t max_disk_bytes; /* disk the tenant's sessions may pin; 0: no limit */
    uint8_t events;          /* enum kvmm_events_mode: KV events of its blocks */
    bool remote;             /* its blocks go to and come from the remote tier (default off) */
};

/* ---- KV events (block lifecycle for routers) ----------------------------
 * With a sink attached (kvmm_events_attach), kvmm reports every full block
 * of a tenant whose `events` is not OFF as it becomes cached in a medium
 * (entered the tree on the device: GPU; moved to or restored into the host
 * tier: CPU; written to the disk tier: DISK) and as it leaves one, and
 * reports "all cleared" when kvmm_clear empties the trees. Blocks are
 * named by their published hash (blockkey_pub_next). The sink is called
 * with the kvmm lock held, on whatever thread holds it: it must only
 * enqueue, never block. A remote tier reports through kvmm_events_emit. */
enum kvmm_events_mode {
    KVMM_EVENTS_OFF = 0,    /* nothing is reported for the tenant's blocks */
    KVMM_EVENTS_HASHES = 1, /* reported without token ids */
    KVMM_EVENTS_ON = 2,     /* reported with token ids */
};
enum kvmm_medium { KVMM_MEDIUM_GPU, KVMM_MEDIUM_CPU, KVMM_MEDIUM_DISK, KVMM_MEDIUM_REMOTE };
#define KVMM_N_MEDIA 4
/* "GPU", "CPU", "DISK", "REMOTE" (vLLM's medium names). */
const char *kvmm_medium_name(enum kvmm_medium m);

struct kvmm_block_event {
    bool stored; /* BlockStored; false: BlockRemoved */
    enum kvmm_medium medium;
    uint32_t tenant;        /* the block's owner */
    uint64_t hash;          /* published hash */
    bool has_parent;        /* false for a namespace's first block */
    uint64_t parent;        /* stored: the previous block's published hash */
    const uint32_t *tokens; /* stored: block_tokens ids, or NULL (withheld) */
    uint32_t n_tokens;
};
struct kvmm_events_sink {
    void *ctx;
    void (*block)(void *ctx, const struct kvmm_block_event *ev);
    void (*cleared)(void *ctx); /* AllBlocksCleared */
};

/* How cached blocks are chosen for eviction (docs/architecture.md, "Eviction
 * order"). HITS, the default (0): each block's priority is its lru stamp
 * plus 8 * n_device_blocks * log2(1 + hits) clock ticks, and across tenants the
 * victim is the one whose age behind that priority, divided by its tenant's
 * weight, is largest. LRU: the least recently used, weights ignored. */
enum kvmm_evict_policy { KVMM_EVICT_HITS = 0, KVMM_EVICT_LRU = 1 };

struct kvpages;

struct kvmm_config {
    struct kv_geom geom;
    /* The page budget the pool takes its pages from (pages.h; shared by
     * every kvmm of the daemon, not owned), and how much of it this pool
     * may hold per tier (0: all of it). NULL: a budget of its own of
     * n_device_blocks and n_host_blocks blocks, one block per page. */
    struct kvpages *pages;
    uint64_t max_device_bytes, max_host_bytes;
    /* With pages: the pool takes no host page at all (evicted blocks are
     * dropped), where max_host_bytes 0 would let it take the whole host
     * budget. */
    bool no_host;
    /* With pages: the pool stays out of the budget's even share
     * (kvpages_share), so the pools of the models keep theirs, and it
     * evicts its own cache before it asks the others for theirs (a
     * model's draft). */
    bool unshared;
    uint32_t n_device_blocks;
    uint32_t n_host_blocks; /* 0: no host tier (evicted blocks are dropped) */
    struct backend *be;     /* not owned */
    /* The model's fingerprint (model_hparams.fingerprint; zeros in store
     * mode): the root of every block key (blockkey.h). */
    uint8_t fingerprint[16];
    enum kvmm_evict_policy evict_policy;
    /* The pool takes no device page until kvmm_device_attach (a model
     * that is not loaded keeps its trees and host tier meanwhile). */
    bool device_detached;
    /* Put into every sequence handle (bits 56-62, 0-126): the daemon's
     * models each have a kvmm, and a handle names its own. 0 leaves the
     * handles as they always were. */
    uint8_t handle_tag;
};

struct kvmm;

int kvmm_new(const struct kvmm_config *cfg, struct kvmm **out);
void kvmm_free(struct kvmm *mm);
void kvmm_lock(struct kvmm *mm);
void kvmm_unlock(struct kvmm *mm);
/* Whether this build checks the lock rule (KVD_LOCK_CHECKS). */
bool kvmm_lock_checked(void);
const char *kvmm_errmsg(const struct kvmm *mm); /* message of the last failure */
const struct kv_geom *kvmm_geom(const struct kvmm *mm);
size_t kvmm_block_bytes(const struct kvmm *mm);

/* ---- the device pages (kvmm_device.c) ------------------------------------
 * A model that is unloaded gives its device pages back to the page budget
 * and keeps the rest (trees, host tier, disk tier, tenants), so it reloads
 * warm. */
/* Moves every cached device block to the host tier (dropping, as eviction
 * does, what the host tier or its owner's host quota cannot take: the disk
 * tier copies a block it has not written yet first), then gives every
 * device page back; the pool takes none until kvmm_device_attach.
 * KVD_EBUSY while a sequence is open or a page is exported (nothing is
 * moved then). *moved and *dropped (may be NULL) count the blocks. */
int kvmm_device_detach(struct kvmm *mm, size_t *moved, size_t *dropped);
/* The pool may take device pages again (as blocks need them): 0. */
int kvmm_device_attach(struct kvmm *mm);
bool kvmm_device_attached(const struct kvmm *mm);
/* Bytes of the device pages the pool holds now (its spares included). */
uint64_t kvmm_device_bytes(const struct kvmm *mm);
/* Slot indices of the device arena (kvmm_device_arena): every slot a block
 * table holds is below it. More than kvmm_stats' device_total where blocks
 * do not tile the pages (a slot across two pages is never used). */
uint32_t kvmm_device_slots(const struct kvmm *mm);
/* The model's fingerprint, known once it has loaded: the root of every
 * block key from now on. A fingerprint other than the one the blocks were
 * made under (the model's file changed while it was unloaded) first empties
 * every tree (kvmm_clear; *cleared = blocks dropped). Returns whether it
 * changed (then the sessions are reread: kvmm_sessions_reload). */
bool kvmm_set_fingerprint(struct kvmm *mm, const uint8_t fingerprint[16], size_t *cleared);

/* ---- tenants and namespaces -------------------------------------------- */
/* Adds a tenant, or updates the limits of the one with the same name (SIGHUP
 * reload: lowering a quota below current use refuses new allocations only). */
int kvmm_tenant_set(struct kvmm *mm, const struct kvmm_tenant_conf *conf, uint32_t *tenant_id);
/* The same with the tenant's id given (tenant ids of several kvmm agree:
 * the daemon's first assigns them). KVD_EBUSY when another live tenant
 * holds that id. */
int kvmm_tenant_set_at(struct kvmm *mm, const struct kvmm_tenant_conf *conf, uint32_t tenant_id);
int kvmm_tenant_find(struct kvmm *mm, const char *name, uint32_t *tenant_id);
/* The tenant's scheduling weight (1 for an id that is not a live tenant). */
uint32_t kvmm_tenant_weight(struct kvmm *mm, uint32_t tenant);
/* The tenant's name (the empty string for an id that is not a live
 * tenant); out holds 64 bytes. */
void kvmm_tenant_name(struct kvmm *mm, uint32_t tenant, char out[64]);
/* Removes an idle tenant: KVD_EBUSY while it has open sequences, or owns
 * blocks outside its own namespace; what its own namespace ("tenant:<name>")
 * caches is dropped, and that namespace goes with it. Its id and its
 * namespace's are reused by later tenants (whose counters start at zero).
 * KVD_ENOTFOUND for an id that is not a live tenant. */
int kvmm_tenant_remove(struct kvmm *mm, uint32_t tenant);
/* The tenant's own namespace ("tenant:<name>"). */
int kvmm_tenant_namespace(struct kvmm *mm, uint32_t tenant, uint32_t *ns_id);
/* The namespace (radix tree) with this name, created on first use. Each
 * tenant has its own by default ("tenant:<name>"); shared namespaces are
 * named by the config. */
int kvmm_namespace(struct kvmm *mm, const char *name, uint32_t *ns_id);

/* ---- sequences ---------------------------------------------------------- */
/* A sequence handle is opaque and never reused soon (index + generation). It
 * is owned by `owner`; every call names the owner and gets KVD_ENOTFOUND for
 * a handle it does not own. */
typedef uint64_t kvmm_seq_t;
/* An owner: a connection id (counting up from 1), or an executor request,
 * KVMM_OWNER_EXEC | its serial, which no connection id reaches. */
typedef uint64_t kvmm_owner;
#define KVMM_OWNER_EXEC (UINT64_C(1) << 63)

int kvmm_seq_open(struct kvmm *mm, kvmm_owner owner, uint32_t tenant, uint32_t ns, kvmm_seq_t *out);
int kvmm_seq_close(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq);
/* Closes every sequence of this owner (connection teardown). */
void kvmm_close_owner(struct kvmm *mm, kvmm_owner owner);

/* Longest cached prefix of `tokens` (whole blocks only) in the sequence's
 * namespace, appended to an empty sequence: takes references, swaps host-tier
 * blocks in first (a block whose checksum fails is dropped and the match ends
 * there). *matched = tokens reused. The sequence must be empty. */
int kvmm_seq_match(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, const uint32_t *tokens,
                   size_t n, size_t *matched);
/* Grows the sequence by n token slots, allocating device blocks (evicting
 * cached blocks if needed). All or nothing. */
int kvmm_seq_extend(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t n);
/* Drops the last n token slots (and any block left empty). */
int kvmm_seq_truncate(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t n_tokens);
/* K/V bytes of tokens [start, start+n), layout
 * [layer][K|V][kv_head][token n] rows of kv_row_bytes (kv_token_bytes per
 * token), in the stored dtype (docs/protocol.md section 6).
 * A write into a block shared with another sequence or the tree copies the
 * block first (copy-on-write). Host-tier blocks are swapped in first. */
int kvmm_seq_write(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t start, size_t n,
                   const void *data, size_t len);
int kvmm_seq_read(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t start, size_t n,
                  void *out, size_t len);
/* Records the token ids of the next positions (committed <= n_tokens); every
 * block that becomes full of committed tokens enters the namespace's radix
 * tree (or is replaced by an identical cached block already there).
 * *shared = number of the sequence's blocks now in the tree. */
int kvmm_seq_commit(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, const uint32_t *tokens,
                    size_t n, size_t *shared);
/* New sequence sharing every block (refcount++); the partial last block is
 * copied on the first write by either side. Counts toward max_seqs. */
int kvmm_seq_fork(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, kvmm_owner new_owner,
                  kvmm_seq_t *child);
/* Hands the sequence to new_owner (same handle, same blocks). The executor
 * takes a connection's sequence for a `generate` with `seq` and gives it
 * back when the request ends. (Added by the executor.) */
int kvmm_seq_set_owner(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, kvmm_owner new_owner);
/* set_owner for a loan: until it is handed back (set_owner), calls by the
 * lender `owner` get KVD_EBUSY "sequence N is in use by generate request
 * TAG" instead of KVD_ENOTFOUND. (Added by the executor.) */
int kvmm_seq_lend(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, kvmm_owner new_owner,
                  uint64_t tag);
/* Moves the sequence's device blocks that no other sequence is using to the
 * host tier / brings every host-tier block back. */
int kvmm_seq_offload(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq);
int kvmm_seq_restore(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq);

struct kvmm_seq_info {
    uint32_t tenant, ns;
    size_t n_tokens;    /* token slots */
    size_t n_committed; /* positions with known token ids */
    size_t n_blocks;
    size_t n_shared; /* blocks in the radix tree */
    size_t n_host;   /* blocks on the host tier */
};
int kvmm_seq_info(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, struct kvmm_seq_info *info);
/* Block ids (stable logical ids) and their tiers: the first min(cap,
 * n_blocks) entries; *n = entries written (kvmm_seq_info gives n_blocks). */
int kvmm_seq_blocks(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, uint32_t *ids,
                    enum kvd_tier *tiers, size_t cap, size_t *n);
/* Committed token ids (for the executor), up to cap. */
const uint32_t *kvmm_seq_tokens(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t *n);

/* ---- zero-copy export (kvmm_export.c) -----------------------------------
 * The blocks of tokens [from, from+n) of a sequence as the pool's pages
 * (pool.h) that one descriptor each maps: which page, where in it, and
 * whether the page may be mapped writable. A page holds the blocks of one
 * tenant in one namespace, so a tenant's own pages are its to see; a page
 * of another tenant (a shared namespace's prefix blocks it made) is
 * exported only when every block in it is a tree block of the sequence's
 * namespace (else KVD_EPERM). A page is writable when `writable` was
 * asked, it is a device page, the sequence is in its tenant's own
 * namespace, and every block in the page is this sequence's alone (no
 * other reference, not in the tree). Where the backend's descriptors of a
 * tier cannot be read-only (cuda device pages: a VMM handle), only pages
 * of the tenant's own namespace are exported (others KVD_EPERM), their
 * descriptor granting writes to its own blocks whatever `writable` says.
 * Pinned pages take no new block until released and empty (then they get
 * fresh memory). KVD_EUNSUPPORTED where the pool's arenas are not
 * elastic. At most max_pages pages (KVD_ETOOLARGE past it). The caller
 * frees *out with kvmm_export_info_free. */
struct kvmm_export_page {
    uint8_t tier;  /* enum kvd_tier */
    uint32_t page; /* of that tier's arena */
    bool writable;
    bool
        fd_writable; /* the descriptor grants writes (writable, or a tier without read-only ones) */
};
struct kvmm_export_block {
    uint32_t page;   /* index into pages */
    uint64_t offset; /* bytes from the page's start */
};
struct kvmm_export_info {
    uint64_t id;       /* names it to kvmm_export_release */
    size_t from_block; /* index of blocks[0] in the sequence */
    size_t n_pages, n_blocks;
    struct kvmm_export_page *pages;
    struct kvmm_export_block *blocks;
    size_t page_bytes[2]; /* per tier: bytes one page's descriptor maps */
};
int kvmm_seq_export(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, uint32_t tenant, bool admin,
                    size_t from, size_t n, bool writable, size_t max_pages,
                    struct kvmm_export_info *out);
void kvmm_export_info_free(struct kvmm_export_info *info);
/* Ends export `id` of owner (KVD_ENOTFOUND if none), or every export of
 * sequence seq (*n ended, 0 is not an error). kvmm_close_owner ends all of
 * the owner's. */
int kvmm_export_release(struct kvmm *mm, kvmm_owner owner, uint64_t id);
int kvmm_export_release_seq(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t *n);
/* A new descriptor of an exported page (the caller's to close) and what it
 * is (a memfd, or a cuda VMM handle): the backend's arena_page_fd. 0,
 * KVD_ENOMEM, KVD_EINTERNAL. */
int kvmm_export_fd(struct kvmm *mm, const struct kvmm_export_page *pg, int *fd,
                   enum backend_fd_kind *kind);

/* ---- for the executor --------------------------------------------------- */
/* Makes tokens [start, start+n) writable on the device: restores host blocks,
 * copies shared blocks (COW). After it, kvmm_seq_device_slots gives the
 * device slot of every block; slot s lives at kvmm_device_arena(mm) +
 * s*block_bytes. A block that is on the host tier gets slot UINT32_MAX:
 * restore the sequence first.
 *
 * Slot rule (what lets the executor use slots with the lock released): a
 * device block referenced by a sequence keeps its slot and is never freed or
 * written by anyone but that sequence's owner. Eviction takes only blocks no
 * sequence references; offload, restore, truncate, close and writes act on
 * one sequence and need its owner; copy-on-write copies for the writer, the
 * other holders keep the original slot. So a sequence's device slots stay
 * valid, whatever other owners do, until its own owner moves or rewrites
 * its blocks (offload, truncate, close, prepare_write/write). */
int kvmm_seq_prepare_write(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t start,
                           size_t n);
int kvmm_seq_device_slots(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, uint32_t *slots,
                          size_t cap, size_t *n);
void *kvmm_device_arena(struct kvmm *mm);
/* The host arena (slot s at + s*block_bytes; NULL without a host tier) and
 * where a logical block lives now: for tools and tests (e.g. corrupting a
 * host copy on purpose). */
void *kvmm_host_arena(struct kvmm *mm);
int kvmm_block_where(struct kvmm *mm, uint32_t id, enum kvd_tier *tier, uint32_t *slot);
/* Device blocks that an allocation of n could get now (free + evictable,
 * not counting other tenants' cache inside their floors), capped by this
 * tenant's quota. */
size_t kvmm_device_available(struct kvmm *mm, uint32_t tenant);
/* The device blocks an allocation of n could get in this pool, as
 * kvmm_device_available but without the tenant's quotas. */
size_t kvmm_device_room(struct kvmm *mm, uint32_t tenant);
/* kvmm_device_available after asking the budget's other pools (the other
 * models') for what an allocation of n blocks lacks here: the tenant's own
 * cache there when it has a byte quota (across every pool), and with
 * `others` the cache the floor rule lets them give (moved to their host
 * tiers). Returns the blocks available then. */
size_t kvmm_device_ask(struct kvmm *mm, uint32_t tenant, size_t n, bool others);

/* ---- the disk tier (kvmm_disk.c, disktier.h) ----------------------------
 * Below the host tier: every block that enters the tree is written behind
 * (within writeback_ms) by a writer thread of its own; a tree block dropped
 * before it was written is copied out first (up to detach_max_bytes of such
 * copies wait for the writer); and a request's prompt is prefetched from
 * disk into the tree (through the host tier) before it is scheduled. These
 * calls take the kvmm lock themselves: call them WITHOUT holding it. */
struct kvmm_disk_conf {
    const char *dir;
    uint64_t max_bytes;
    uint32_t writeback_ms;     /* default 1000 */
    uint64_t detach_max_bytes; /* default 64 MiB */
    /* The disk tier's eviction policy is the memory tiers' (evict-policy) unless own_policy
     * (benchmarks compare the two on the disk alone). */
    bool own_policy;
    enum kvmm_evict_policy policy;
};
/* Opens the tier and starts its writer (before serving). Errors as
 * disktier_open. */
int kvmm_disk_open(struct kvmm *mm, const struct kvmm_disk_conf *c, struct kvd_error *e);
bool kvmm_disk_on(const struct kvmm *mm);
/* Brings the whole blocks of tokens (n ids) that follow the namespace's
 * cached prefix in from disk, in order, while they are there and check out,
 * charging `tenant` for them: they enter the tree as host blocks (device
 * blocks without a host tier), unreferenced, so the next match takes them.
 * Runs the disk reads on the calling thread. Returns the blocks restored. */
size_t kvmm_disk_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                          size_t n);
/* Whether block b of tokens (the first the tree does not hold) is on disk:
 * a cheap test before queueing a prefetch. */
bool kvmm_disk_may_prefetch(struct kvmm *mm, uint32_t ns, const uint32_t *tokens, size_t n);
/* Writes back everything queued and syncs, waiting at most timeout_ms:
 * *written blocks went out, *left did not. 0, or KVD_EBUSY (time ran out with left > 0). */
int kvmm_disk_flush(struct kvmm *mm, uint32_t timeout_ms, size_t *written, size_t *left);

/* ---- the remote tier (kvmm_remote.c, remote_value.h; docs/persistence.md
 * "The remote tier"): whole blocks of tenants with `remote` on are written
 * through to Redis, sealed under the fleet key, once a block has been reused
 * min_hits times, by a writer thread of its own; and a request's prompt
 * past the tree (and the disk tier) is looked up there in one pipelined
 * round before it is scheduled. A value holds the blocks of one chain from a
 * multiple of K (= value_bytes / (block bytes + token ids)) up to the block
 * that names it. Like the disk-tier calls these take the lock themselves. */
struct kvmm_remote_conf {
    const char *url;      /* redis:// or redis-cluster:// (redisconn.h) */
    const char *key_file; /* the fleet key; NULL or "": insecure must be set */
    bool insecure;        /* no key: values carry checksums only */
    uint32_t timeout_ms;  /* one round at most; default 100 */
    uint64_t value_bytes; /* default 4 MiB */
    uint32_t ttl_s;       /* 0: values never expire */
    uint32_t min_hits;    /* reuses before a block is written (0: at commit) */
};
/* Checks the URL and the key, and starts the writer. Redis need not be up:
 * the tier connects when it is first used, and after a failure it rests
 * for a second (what it skips meanwhile is counted; stats `backoff`). KVD_EBADREQ for a bad
 * URL, key file or a missing key without insecure. */
int kvmm_remote_open(struct kvmm *mm, const struct kvmm_remote_conf *c, struct kvd_error *e);
bool kvmm_remote_on(const struct kvmm *mm);
/* Whether a prefetch could bring in something: the tier is on, the tenant
 * has remote on and the tree does not hold every whole block of tokens. */
bool kvmm_remote_may_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                              size_t n);
/* Brings the whole blocks of tokens past the tree's prefix in from Redis
 * (one round, at most timeout_ms), checking every value, into the tree like
 * kvmm_disk_prefetch. Runs on the calling thread. Returns the blocks
 * restored. */
size_t kvmm_remote_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                            size_t n);
/* Waits (at most timeout_ms) until the writer has nothing queued: 0 or KVD_EBUSY. */
int kvmm_remote_flush(struct kvmm *mm, uint32_t timeout_ms);
struct kvmm_remote_stats {
    bool on;
    uint32_t blocks_per_value; /* K */
    uint64_t hits;             /* blocks restored */
    uint64_t misses;           /* values asked for and not there */
    uint64_t bytes_in, bytes_out;
    uint64_t rounds;                          /* lookup rounds */
    uint64_t latency_ns_sum, latency_ns_last; /* of lookup rounds */
    uint64_t errors, timeouts; /* failed rounds (lookups and writes), of them timed out */
    uint64_t skipped;          /* lookups and writes not tried while resting after a failure */
    uint64_t auth_failures;    /* values that failed authentication or were malformed */
    uint64_t mismatches;       /* authentic values that were not the ones asked for */
    uint64_t writes;           /* values written */
    uint64_t queued;           /* values waiting for the writer */
    uint64_t write_skips;      /* dropped: queue full, or the blocks left meanwhile */
    bool backoff;              /* resting after a failure: lookups and writes are skipped */
    uint64_t retry_in_ms;      /* when backoff: until the tier tries Redis again */
    uint64_t backoffs;         /* rests started by a failure */
    uint64_t connect_fails;    /* connects to a node that failed (refused, timed out) */
    uint64_t reconnects;       /* connects made again after a lost connection */
    uint64_t moved, ask;       /* cluster redirects followed */
    uint64_t announced;        /* values written here and announced (KV events), not known gone */
    uint64_t events_stored;    /* REMOTE BlockStored reported (blocks) */
    uint64_t events_removed;   /* REMOTE BlockRemoved reported (blocks) */
};
void kvmm_remote_stats(struct kvmm *mm, struct kvmm_remote_stats *st);

/* ---- named sessions (kvmm_session.c): a tenant-scoped name for a token
 * sequence whose whole blocks are pinned on the disk tier until it expires,
 * kept in DIR/sessions/ (one small file each) so it survives restarts.
 * Like the disk-tier calls above these take the lock themselves, and
 * kvmm_session_save / kvmm_session_delete write files: call them on a
 * worker, never on the event loop. ns is the tenant's own namespace. */
#define KVMM_SESSION_NAME 128                   /* bytes of a name at most */
#define KVMM_SESSION_TTL_DEFAULT (7ull * 86400) /* a week */
#define KVMM_SESSION_TTL_MAX (3650ull * 86400)  /* ten years */
struct kvmm_session_info {
    char name[KVMM_SESSION_NAME + 1];
    size_t n_tokens;
    uint64_t bytes;   /* what it counts against max_disk_bytes */
    uint64_t expires; /* unix seconds */
    size_t blocks;    /* whole blocks pinned on disk */
};
/* Saves tokens under name (replacing a session of that name): its whole
 * blocks are written to disk now where they are not yet (from the tree),
 * pinned until now + ttl_s, and the session's file is made durable. *info
 * says what was saved (blocks: the leading whole blocks found; the rest of
 * the tokens are recomputed on use). KVD_EUNSUPPORTED without a disk tier,
 * KVD_EQUOTA past the tenant's max_disk_bytes, KVD_EBADREQ for a bad name. */
int kvmm_session_save(struct kvmm *mm, uint32_t tenant, uint32_t ns, const char *name,
                      const uint32_t *tokens, size_t n, uint64_t ttl_s,
                      struct kvmm_session_info *info, struct kvd_error *e);
/* A copy (malloc) of a live session's tokens; KVD_ENOTFOUND when there is
 * none (or it expired). */
int kvmm_session_tokens(struct kvmm *mm, uint32_t ns, const char *name, uint32_t **tokens,
                        size_t *n, struct kvd_error *e);
int kvmm_session_delete(struct kvmm *mm, uint32_t ns, const char *name, struct kvd_error *e);
/* The namespace's live sessions (malloc'd array, by name). */
int kvmm_session_list(struct kvmm *mm, uint32_t ns, struct kvmm_session_info **out, size_t *n);
/* Reads DIR/sessions again: a session file holds its model's root key, so
 * a model's sessions are known once its fingerprint is (its first load:
 * kvmm_set_fingerprint). Nothing may use the sessions meanwhile (the model
 * is loading). Takes the lock itself. */
int kvmm_sessions_reload(struct kvmm *mm, struct kvd_error *e);
/* Whether name is a valid session name (1 to 128 bytes of letters, digits
 * and "-_.:@/"). */
bool kvmm_session_name_ok(const char *name);

/* Where a disk restore's CPU time goes (the prefetching thread's own CPU
 * clock, summed over its restores): */
enum kvmm_restore_cpu {
    KVMM_RESTORE_CPU_READ,     /* key lookups, submitting and reaping reads, every check */
    KVMM_RESTORE_CPU_TAKE,     /* final blocks taken, under the kvmm lock */
    KVMM_RESTORE_CPU_PREFAULT, /* fresh pool pages populated before their first copy */
    KVMM_RESTORE_CPU_COPY,     /* the bytes copied into the pool (and a host copy's checksum) */
    KVMM_RESTORE_CPU_ENTER,    /* blocks entered into the tree, under the kvmm lock */
    KVMM_RESTORE_CPU_N
};

struct kvmm_disk_stats {
    bool on;
    struct disktier_stats tier;
    uint64_t queued;          /* blocks waiting for the writer */
    uint64_t detached;        /* copies of dropped blocks waiting for the writer */
    uint64_t detach_skips;    /* dropped before they were written, over detach_max_bytes */
    uint64_t restored;        /* blocks brought back from disk */
    uint64_t restore_fails;   /* reads that failed a check (recomputed) */
    uint64_t restores;        /* prefetches that restored at least one block */
    uint64_t restore_ns;      /* their total time (lookups, reads, checks, into the tree) */
    uint64_t restore_last_ns; /* the last one's */
    uint64_t restore_cpu_ns[KVMM_RESTORE_CPU_N]; /* their CPU time, by step */
    uint64_t sessions;                           /* live sessions, all tenants */
};
void kvmm_disk_stats(struct kvmm *mm, struct kvmm_disk_stats *st);

/* Attaches the events sink (copied; NULL detaches) with the root of the
 * published hashes (blockkey_pub_root of the seed). Blocks already cached
 * get their hashes now but are not reported. Lock held. */
void kvmm_events_attach(struct kvmm *mm, const struct kvmm_events_sink *sink, uint64_t root);
/* Reports one block event through the sink when the owner tenant's events
 * are on (with tokens only for KVMM_EVENTS_ON); for tiers outside kvmm. */
void kvmm_events_emit(struct kvmm *mm, const struct kvmm_block_event *ev);

/* ---- eviction, checks, stats ------------------------------------------- */
/* Empties every prefix tree (device and host blocks; sequences keep their
 * blocks, which are no longer shared) and reports AllBlocksCleared: the
 * admin's "evict all". *dropped = tree blocks dropped. */
void kvmm_clear(struct kvmm *mm, size_t *dropped);
/* Evicts up to n unreferenced cached blocks from `tier` (device → host when
 * the host tier has room, else dropped; host → dropped), leaf-first, in the
 * order of the evict policy. */
int kvmm_evict(struct kvmm *mm, enum kvd_tier tier, size_t n, size_t *evicted);
/* Checks every invariant; 0 or KVD_EINTERNAL with the first violation in
 * kvmm_errmsg(). */
int kvmm_check(struct kvmm *mm);

struct kvmm_tenant_stats {
    char name[64];
    uint32_t device_blocks, host_blocks; /* blocks owned, by tier */
    uint32_t device_pages, host_pages;   /* pages its blocks hold, this pool */
    uint64_t device_bytes, host_bytes;   /* bytes of pages it holds, every pool on the budget */
    uint32_t cached_blocks;              /* owned blocks held by a radix tree */
    uint32_t cached_device, cached_host; /* of them: by tier (the KV events' GPU and CPU) */
    uint32_t seqs;
    struct kvmm_tenant_conf conf;
    uint64_t match_tokens_asked, match_tokens_hit;
    uint64_t swaps_out, swaps_in, evictions;
};
struct kvmm_stats {
    uint32_t device_total, device_free, device_cached, device_used;
    uint32_t host_total, host_free, host_cached, host_used;
    uint64_t swaps_out, swaps_in, swap_bytes_out, swap_bytes_in;
    uint64_t evictions_device, drops, checksum_failures, cow_copies;
    uint64_t match_tokens_asked, match_tokens_hit;
    uint32_t n_seqs, n_tenants;
    /* kv_export: live exports, pages they pin (both tiers), pages released
     * and not yet empty (draining), free slots withheld in both (counted in
     * device_used/host_used: they are no one's to allocate). */
    uint32_t exports, export_pages, export_draining, export_withheld;
    /* Pages (pages.h): this pool's page size and blocks per page, the pages
     * it holds and could still take (free in the budget, which other pools
     * share), pages full of cache, and pages mapped / given back so far. */
    uint64_t page_bytes[2];
    uint32_t blocks_per_page[2];
    uint32_t pages_held[2], pages_free[2], pages_cached[2];
    uint32_t pages_spare[2]; /* of pages_held, empty ones kept mapped (nobody's) */
    uint64_t page_maps, page_unmaps;
};
void kvmm_stats(struct kvmm *mm, struct kvmm_stats *st);
int kvmm_tenant_stats(struct kvmm *mm, uint32_t tenant, struct kvmm_tenant_stats *st);

#endif
