/* Every reply and event kvd sends, decoded strictly: exactly the keys
 * docs/protocol.md lists for it (none missing, none extra, none twice), each
 * of the documented type, nested maps included, and every one of those keys
 * named in the op's section of docs/protocol.md. Store mode covers the block
 * API, hello, stats (admin and, as root, a non-admin's), admin ops and error
 * replies; serve mode covers hello's model, generate (plain, streamed, with
 * a sequence, with tool calls), its token events (with the tool calls'
 * news), cancel and the executor's stats. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

enum kt {
    T_UINT,
    T_DBL,
    T_STR,
    T_BOOL,
    T_BIN,
    T_UARR,     /* array of uint */
    T_MAP,      /* map: sub */
    T_MAPS,     /* array of maps: sub */
    T_UINT_NIL, /* uint or nil */
    T_MAP_NIL,  /* map (sub) or nil */
    T_STR_NIL,  /* str or nil */
    T_DELTAS,   /* array of maps: K_DELTA_FIRST or K_DELTA_NEXT (tool calls' news) */
};

struct key {
    const char *name;
    enum kt t;
    const struct key *sub;
};

/* ---- the documented key lists (docs/protocol.md) ------------------------ */

static const struct key K_NONE[] = {{NULL, 0, NULL}};
static const struct key K_ERRMAP[] = {
    {"code", T_STR, NULL}, {"message", T_STR, NULL}, {NULL, 0, NULL}};
static const struct key K_ERROR[] = {{"error", T_MAP, K_ERRMAP}, {NULL, 0, NULL}};

static const struct key K_KV[] = {
    {"layers", T_UINT, NULL}, {"kv_heads", T_UINT, NULL},    {"head_dim", T_UINT, NULL},
    {"dtype", T_STR, NULL},   {"block_bytes", T_UINT, NULL}, {"token_bytes", T_UINT, NULL},
    {NULL, 0, NULL}};
static const struct key K_MODEL[] = {{"name", T_STR, NULL},
                                     {"vocab", T_UINT, NULL},
                                     {"context", T_UINT, NULL},
                                     {"weight_bytes", T_UINT, NULL},
                                     {"weight_device_bytes", T_UINT, NULL},
                                     {"fingerprint", T_STR_NIL, NULL},
                                     {"tokenizer", T_STR_NIL, NULL},
                                     {"bos", T_UINT_NIL, NULL},
                                     {"eos", T_UINT_NIL, NULL},
                                     {"eog", T_UARR, NULL},
                                     {"chat_template", T_BOOL, NULL},
                                     {NULL, 0, NULL}};
/* hello's `models`: each model, loaded or not */
static const struct key K_MODEL_ENTRY[] = {{"name", T_STR, NULL},
                                           {"vocab", T_UINT, NULL},
                                           {"context", T_UINT, NULL},
                                           {"weight_bytes", T_UINT, NULL},
                                           {"weight_device_bytes", T_UINT, NULL},
                                           {"fingerprint", T_STR_NIL, NULL},
                                           {"tokenizer", T_STR_NIL, NULL},
                                           {"bos", T_UINT_NIL, NULL},
                                           {"eos", T_UINT_NIL, NULL},
                                           {"eog", T_UARR, NULL},
                                           {"chat_template", T_BOOL, NULL},
                                           {"state", T_STR, NULL},
                                           {"arch", T_STR, NULL},
                                           {"kv", T_MAP, K_KV},
                                           {"kv_device_bytes", T_UINT, NULL},
                                           {"kv_device_blocks", T_UINT, NULL},
                                           {"keep_alive_s", T_UINT_NIL, NULL},
                                           {"allowed", T_BOOL, NULL},
                                           {"draft", T_STR_NIL, NULL},
                                           {"speculative", T_STR, NULL},
                                           {NULL, 0, NULL}};
static const struct key K_HELLO[] = {{"server", T_STR, NULL},
                                     {"version", T_UINT, NULL},
                                     {"tenant", T_STR, NULL},
                                     {"admin", T_BOOL, NULL},
                                     {"backend", T_STR, NULL},
                                     {"block_tokens", T_UINT, NULL},
                                     {"max_frame", T_UINT, NULL},
                                     {"conn", T_UINT, NULL},
                                     {"disk", T_BOOL, NULL},
                                     {"remote", T_BOOL, NULL},
                                     {"warm", T_BOOL, NULL},
                                     {"kv", T_MAP, K_KV},
                                     {"model", T_MAP_NIL, K_MODEL},
                                     {"models", T_MAPS, K_MODEL_ENTRY},
                                     {NULL, 0, NULL}};

static const struct key K_TIER[] = {{"total", T_UINT, NULL},
                                    {"free", T_UINT, NULL},
                                    {"cached", T_UINT, NULL},
                                    {"used", T_UINT, NULL},
                                    {NULL, 0, NULL}};
static const struct key K_TIER_TOTAL[] = {{"total", T_UINT, NULL}, {NULL, 0, NULL}};
static const struct key K_COUNTERS[] = {{"match_tokens_asked", T_UINT, NULL},
                                        {"match_tokens_hit", T_UINT, NULL},
                                        {"swaps_out", T_UINT, NULL},
                                        {"swaps_in", T_UINT, NULL},
                                        {"swap_bytes_out", T_UINT, NULL},
                                        {"swap_bytes_in", T_UINT, NULL},
                                        {"evictions", T_UINT, NULL},
                                        {"drops", T_UINT, NULL},
                                        {"checksum_failures", T_UINT, NULL},
                                        {"cow_copies", T_UINT, NULL},
                                        {"seqs", T_UINT, NULL},
                                        {NULL, 0, NULL}};
static const struct key K_QUOTA[] = {{"max_device_blocks", T_UINT_NIL, NULL},
                                     {"max_host_blocks", T_UINT_NIL, NULL},
                                     {"max_seqs", T_UINT_NIL, NULL},
                                     {"reserved_device_blocks", T_UINT, NULL},
                                     {"max_device_bytes", T_UINT_NIL, NULL},
                                     {"max_host_bytes", T_UINT_NIL, NULL},
                                     {"reserved_device_bytes", T_UINT, NULL},
                                     {"weight", T_UINT, NULL},
                                     {NULL, 0, NULL}};
static const struct key K_TENANT[] = {{"name", T_STR, NULL},
                                      {"device_blocks", T_UINT, NULL},
                                      {"host_blocks", T_UINT, NULL},
                                      {"cached_blocks", T_UINT, NULL},
                                      {"cached_device", T_UINT, NULL},
                                      {"cached_host", T_UINT, NULL},
                                      {"device_bytes", T_UINT, NULL},
                                      {"host_bytes", T_UINT, NULL},
                                      {"events", T_STR, NULL},
                                      {"seqs", T_UINT, NULL},
                                      {"match_tokens_asked", T_UINT, NULL},
                                      {"match_tokens_hit", T_UINT, NULL},
                                      {"swaps_out", T_UINT, NULL},
                                      {"swaps_in", T_UINT, NULL},
                                      {"prefix_hit_rate", T_DBL, NULL},
                                      {"evictions", T_UINT, NULL},
                                      {"requests", T_UINT, NULL},
                                      {"requests_failed", T_UINT, NULL},
                                      {"requests_cancelled", T_UINT, NULL},
                                      {"preemptions", T_UINT, NULL},
                                      {"tokens_in", T_UINT, NULL},
                                      {"tokens_cached", T_UINT, NULL},
                                      {"tokens_out", T_UINT, NULL},
                                      {"queue_ms", T_DBL, NULL},
                                      {"queue_ms_mean", T_DBL, NULL},
                                      {"ttft_ms_mean", T_DBL, NULL},
                                      {"quota", T_MAP, K_QUOTA},
                                      {NULL, 0, NULL}};
static const struct key K_SPEC[] = {{"mode", T_STR, NULL},
                                    {"draft_model", T_BOOL, NULL},
                                    {"max_batch", T_UINT, NULL},
                                    {"verify_steps", T_UINT, NULL},
                                    {"verifications", T_UINT, NULL},
                                    {"drafted", T_UINT, NULL},
                                    {"accepted", T_UINT, NULL},
                                    {"acceptance", T_DBL, NULL},
                                    {"tokens_per_verification", T_DBL, NULL},
                                    {"verify_ms_per_step", T_DBL, NULL},
                                    {"decode_ms_per_step", T_DBL, NULL},
                                    {"speedup", T_DBL, NULL},
                                    {NULL, 0, NULL}};
static const struct key K_REQUESTS[] = {{"executor", T_BOOL, NULL},
                                        {"waiting", T_UINT, NULL},
                                        {"running", T_UINT, NULL},
                                        {"swapped", T_UINT, NULL},
                                        {"live", T_UINT, NULL},
                                        {"submitted", T_UINT, NULL},
                                        {"answered", T_UINT, NULL},
                                        {"failed", T_UINT, NULL},
                                        {"cancelled", T_UINT, NULL},
                                        {"steps", T_UINT, NULL},
                                        {"prefill_tokens", T_UINT, NULL},
                                        {"decode_tokens", T_UINT, NULL},
                                        {"tokens_in", T_UINT, NULL},
                                        {"tokens_cached", T_UINT, NULL},
                                        {"tokens_out", T_UINT, NULL},
                                        {"preempt_swap", T_UINT, NULL},
                                        {"preempt_recompute", T_UINT, NULL},
                                        {"step_launches", T_UINT, NULL},
                                        {"layers", T_UINT, NULL},
                                        {"overlapped_steps", T_UINT, NULL},
                                        {"decode_host_steps", T_UINT, NULL},
                                        {"decode_host_ms", T_DBL, NULL},
                                        {"decode_idle_steps", T_UINT, NULL},
                                        {"decode_idle_ms", T_DBL, NULL},
                                        {"speculative", T_MAP, K_SPEC},
                                        {NULL, 0, NULL}};
static const struct key K_PHASE[] = {
    {"steps", T_UINT, NULL},         {"window", T_UINT, NULL},
    {"flops_per_step", T_DBL, NULL}, {"bytes_per_step", T_DBL, NULL},
    {"intensity", T_DBL, NULL},      {"flops_per_s", T_DBL, NULL},
    {"bytes_per_s", T_DBL, NULL},    {"flops_frac", T_DBL, NULL},
    {"bytes_frac", T_DBL, NULL},     {"ms_per_step", T_DBL, NULL},
    {"tokens_per_s", T_DBL, NULL},   {"attainable_frac", T_DBL, NULL},
    {"bound", T_STR, NULL},          {NULL, 0, NULL}};
static const struct key K_ROOFLINE[] = {
    {"measured", T_BOOL, NULL},        {"peak_flops_per_s", T_DBL, NULL},
    {"peak_bytes_per_s", T_DBL, NULL}, {"ridge_intensity", T_DBL, NULL},
    {"prefill", T_MAP, K_PHASE},       {"decode", T_MAP, K_PHASE},
    {"mixed", T_MAP, K_PHASE},         {NULL, 0, NULL}};
static const struct key K_TENANCY[] = {{"registered", T_UINT, NULL},
                                       {"sub_tenants", T_UINT, NULL},
                                       {"sub_tenants_freed", T_UINT, NULL},
                                       {"sub_tenants_refused", T_UINT, NULL},
                                       {NULL, 0, NULL}};
static const struct key K_EXPORTS[] = {{"exports", T_UINT, NULL},
                                       {"pages", T_UINT, NULL},
                                       {"draining", T_UINT, NULL},
                                       {"withheld", T_UINT, NULL},
                                       {NULL, 0, NULL}};
static const struct key K_PAGE_TIER[] = {
    {"page_bytes", T_UINT, NULL},  {"blocks_per_page", T_UINT, NULL},
    {"held", T_UINT, NULL},        {"spare", T_UINT, NULL},
    {"warm", T_UINT, NULL},        {"warm_blocks", T_UINT, NULL},
    {"warm_max", T_UINT, NULL},    {"warm_hits", T_UINT, NULL},
    {"warm_misses", T_UINT, NULL}, {"free", T_UINT, NULL},
    {"cached", T_UINT, NULL},      {NULL, 0, NULL}};
static const struct key K_PAGES[] = {{"device", T_MAP, K_PAGE_TIER},
                                     {"host", T_MAP, K_PAGE_TIER},
                                     {"maps", T_UINT, NULL},
                                     {"unmaps", T_UINT, NULL},
                                     {NULL, 0, NULL}};
/* stats `models`: what anyone sees of each model, and what an admin sees */
static const struct key K_MODEL_STATS_TENANT[] = {{"name", T_STR, NULL},
                                                  {"state", T_STR, NULL},
                                                  {"weight_device_bytes", T_UINT, NULL},
                                                  {"kv_device_bytes", T_UINT, NULL},
                                                  {"kv_device_blocks", T_UINT, NULL},
                                                  {"charged_device_bytes", T_UINT, NULL},
                                                  {"block_bytes", T_UINT, NULL},
                                                  {NULL, 0, NULL}};
static const struct key K_MODEL_STATS_ALL[] = {{"name", T_STR, NULL},
                                               {"state", T_STR, NULL},
                                               {"weight_device_bytes", T_UINT, NULL},
                                               {"kv_device_bytes", T_UINT, NULL},
                                               {"kv_device_blocks", T_UINT, NULL},
                                               {"charged_device_bytes", T_UINT, NULL},
                                               {"block_bytes", T_UINT, NULL},
                                               {"path", T_STR, NULL},
                                               {"idle_s", T_DBL, NULL},
                                               {"waiting", T_UINT, NULL},
                                               {"loads", T_UINT, NULL},
                                               {"unloads", T_UINT, NULL},
                                               {"load_failures", T_UINT, NULL},
                                               {"load_ms", T_DBL, NULL},
                                               {"unload_ms", T_DBL, NULL},
                                               {"moved_at_unload", T_UINT, NULL},
                                               {"dropped_at_unload", T_UINT, NULL},
                                               {"last_error", T_STR, NULL},
                                               {"live", T_UINT, NULL},
                                               {"waiting_requests", T_UINT, NULL},
                                               {"running", T_UINT, NULL},
                                               {"submitted", T_UINT, NULL},
                                               {"generated", T_UINT, NULL},
                                               {"steps", T_UINT, NULL},
                                               {"prefill_tokens", T_UINT, NULL},
                                               {"decode_tokens", T_UINT, NULL},
                                               {"draft_kv_device_bytes", T_UINT, NULL},
                                               {"draft_kv_max_bytes", T_UINT, NULL},
                                               {"speculative", T_MAP, K_SPEC},
                                               {"device", T_MAP, K_TIER},
                                               {"host", T_MAP, K_TIER},
                                               {"seqs", T_UINT, NULL},
                                               {NULL, 0, NULL}};
static const struct key K_MODEL_MEMORY[] = {
    {"device_used", T_UINT, NULL}, {"device_budget", T_UINT_NIL, NULL}, {NULL, 0, NULL}};
static const struct key K_STATS_ALL[] = {{"scope", T_STR, NULL},
                                         {"backend", T_STR, NULL},
                                         {"block_tokens", T_UINT, NULL},
                                         {"block_bytes", T_UINT, NULL},
                                         {"device", T_MAP, K_TIER},
                                         {"host", T_MAP, K_TIER},
                                         {"counters", T_MAP, K_COUNTERS},
                                         {"connections", T_UINT, NULL},
                                         {"in_flight", T_UINT, NULL},
                                         {"tenancy", T_MAP, K_TENANCY},
                                         {"tenants_total", T_UINT, NULL},
                                         {"tenants_next", T_UINT_NIL, NULL},
                                         {"tenants", T_MAPS, K_TENANT},
                                         {"requests", T_MAP, K_REQUESTS},
                                         {"roofline", T_MAP, K_ROOFLINE},
                                         {"exports", T_MAP, K_EXPORTS},
                                         {"pages", T_MAP, K_PAGES},
                                         {"model_memory", T_MAP, K_MODEL_MEMORY},
                                         {"models", T_MAPS, K_MODEL_STATS_ALL},
                                         {NULL, 0, NULL}};
static const struct key K_STATS_TENANT[] = {{"scope", T_STR, NULL},
                                            {"backend", T_STR, NULL},
                                            {"block_tokens", T_UINT, NULL},
                                            {"block_bytes", T_UINT, NULL},
                                            {"device", T_MAP, K_TIER_TOTAL},
                                            {"host", T_MAP, K_TIER_TOTAL},
                                            {"tenants", T_MAPS, K_TENANT},
                                            {"models", T_MAPS, K_MODEL_STATS_TENANT},
                                            {NULL, 0, NULL}};

static const struct key K_SEQ[] = {{"seq", T_UINT, NULL}, {NULL, 0, NULL}};
static const struct key K_EXTEND[] = {
    {"n_tokens", T_UINT, NULL}, {"blocks", T_UARR, NULL}, {NULL, 0, NULL}};
static const struct key K_MATCH[] = {
    {"matched", T_UINT, NULL}, {"blocks", T_UARR, NULL}, {NULL, 0, NULL}};
static const struct key K_READ[] = {{"data", T_BIN, NULL}, {NULL, 0, NULL}};
static const struct key K_COMMIT[] = {{"shared", T_UINT, NULL}, {NULL, 0, NULL}};
static const struct key K_BLOCK[] = {{"id", T_UINT, NULL}, {"tier", T_STR, NULL}, {NULL, 0, NULL}};
static const struct key K_INFO[] = {{"n_tokens", T_UINT, NULL},  {"n_committed", T_UINT, NULL},
                                    {"shared", T_UINT, NULL},    {"namespace", T_STR, NULL},
                                    {"blocks", T_MAPS, K_BLOCK}, {NULL, 0, NULL}};
static const struct key K_MOVE[] = {
    {"host_blocks", T_UINT, NULL}, {"device_blocks", T_UINT, NULL}, {NULL, 0, NULL}};
static const struct key K_EVICT[] = {{"evicted", T_UINT, NULL}, {NULL, 0, NULL}};
static const struct key K_CANCEL[] = {{"cancelled", T_BOOL, NULL}, {NULL, 0, NULL}};
static const struct key K_USAGE[] = {{"prompt", T_UINT, NULL},
                                     {"cached", T_UINT, NULL},
                                     {"completion", T_UINT, NULL},
                                     {NULL, 0, NULL}};
static const struct key K_TIMING[] = {{"queue_ms", T_DBL, NULL},
                                      {"ttft_ms", T_DBL, NULL},
                                      {"total_ms", T_DBL, NULL},
                                      {NULL, 0, NULL}};
/* The test model (kvd-gguf-gen) has a tokenizer, so replies carry text. */
static const struct key K_GEN[] = {{"tokens", T_UARR, NULL},       {"text", T_STR, NULL},
                                   {"finish_reason", T_STR, NULL}, {"usage", T_MAP, K_USAGE},
                                   {"timing", T_MAP, K_TIMING},    {NULL, 0, NULL}};
static const struct key K_GEN_SEQ[] = {{"tokens", T_UARR, NULL},
                                       {"text", T_STR, NULL},
                                       {"finish_reason", T_STR, NULL},
                                       {"usage", T_MAP, K_USAGE},
                                       {"timing", T_MAP, K_TIMING},
                                       {"seq", T_UINT, NULL},
                                       {NULL, 0, NULL}};
static const struct key K_TOKENS_EVENT[] = {
    {"tokens", T_UARR, NULL}, {"text", T_STR, NULL}, {NULL, 0, NULL}};
/* n > 1: one reply with every choice; events name their choice */
static const struct key K_CHOICE[] = {{"index", T_UINT, NULL},
                                      {"tokens", T_UARR, NULL},
                                      {"text", T_STR, NULL},
                                      {"finish_reason", T_STR, NULL},
                                      {NULL, 0, NULL}};
static const struct key K_GEN_N[] = {{"choices", T_MAPS, K_CHOICE},
                                     {"usage", T_MAP, K_USAGE},
                                     {"timing", T_MAP, K_TIMING},
                                     {NULL, 0, NULL}};
static const struct key K_TOKENS_EVENT_N[] = {
    {"choice", T_UINT, NULL}, {"tokens", T_UARR, NULL}, {"text", T_STR, NULL}, {NULL, 0, NULL}};
/* tool calls: the reply's calls, an event's news of them */
static const struct key K_CALL[] = {
    {"id", T_STR, NULL}, {"name", T_STR, NULL}, {"arguments", T_STR, NULL}, {NULL, 0, NULL}};
static const struct key K_GEN_TOOLS[] = {{"tokens", T_UARR, NULL},
                                         {"text", T_STR, NULL},
                                         {"tool_calls", T_MAPS, K_CALL},
                                         {"finish_reason", T_STR, NULL},
                                         {"usage", T_MAP, K_USAGE},
                                         {"timing", T_MAP, K_TIMING},
                                         {NULL, 0, NULL}};
static const struct key K_DELTA_FIRST[] = {{"index", T_UINT, NULL},
                                           {"id", T_STR, NULL},
                                           {"name", T_STR, NULL},
                                           {"arguments", T_STR, NULL},
                                           {NULL, 0, NULL}};
static const struct key K_DELTA_NEXT[] = {
    {"index", T_UINT, NULL}, {"arguments", T_STR, NULL}, {NULL, 0, NULL}};
static const struct key K_TOKENS_EVENT_TOOLS[] = {{"tokens", T_UARR, NULL},
                                                  {"text", T_STR, NULL},
                                                  {"tool_calls", T_DELTAS, NULL},
                                                  {NULL, 0, NULL}};
static const struct key K_TOKENIZE[] = {{"tokens", T_UARR, NULL}, {NULL, 0, NULL}};
static const struct key K_DETOKENIZE[] = {{"text", T_STR, NULL}, {NULL, 0, NULL}};

/* ---- strict decoding ----------------------------------------------------- */

static bool str_is(const msgpack_object *o, const char *s)
{
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

static bool type_ok(const msgpack_object *v, enum kt t)
{
    switch (t) {
    case T_UINT:
        return v->type == MSGPACK_OBJECT_POSITIVE_INTEGER;
    case T_DBL:
        return v->type == MSGPACK_OBJECT_FLOAT64 || v->type == MSGPACK_OBJECT_FLOAT32;
    case T_STR:
        return v->type == MSGPACK_OBJECT_STR;
    case T_BOOL:
        return v->type == MSGPACK_OBJECT_BOOLEAN;
    case T_BIN:
        return v->type == MSGPACK_OBJECT_BIN;
    case T_UARR:
        if (v->type != MSGPACK_OBJECT_ARRAY)
            return false;
        for (uint32_t i = 0; i < v->via.array.size; i++)
            if (v->via.array.ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
                return false;
        return true;
    case T_MAP:
        return v->type == MSGPACK_OBJECT_MAP;
    case T_MAPS:
    case T_DELTAS:
        return v->type == MSGPACK_OBJECT_ARRAY;
    case T_UINT_NIL:
        return v->type == MSGPACK_OBJECT_POSITIVE_INTEGER || v->type == MSGPACK_OBJECT_NIL;
    case T_MAP_NIL:
        return v->type == MSGPACK_OBJECT_MAP || v->type == MSGPACK_OBJECT_NIL;
    case T_STR_NIL:
        return v->type == MSGPACK_OBJECT_STR || v->type == MSGPACK_OBJECT_NIL;
    }
    return false;
}

/* 0, or 1 with what is wrong in err. `base` holds keys every message of
 * this kind has (id, ok / event), checked like the others. */
static int check_map(const msgpack_object *o, const struct key *base, const struct key *spec,
                     const char *path, char *err, size_t cap)
{
    if (o->type != MSGPACK_OBJECT_MAP) {
        snprintf(err, cap, "%s is not a map", path);
        return 1;
    }
    const struct key *lists[2] = {base, spec};
    size_t n_spec = 0;
    for (int l = 0; l < 2; l++)
        for (const struct key *k = lists[l]; k && k->name; k++) {
            n_spec++;
            const msgpack_object *v = NULL;
            for (uint32_t i = 0; i < o->via.map.size; i++)
                if (str_is(&o->via.map.ptr[i].key, k->name)) {
                    if (v) {
                        snprintf(err, cap, "%s.%s appears twice", path, k->name);
                        return 1;
                    }
                    v = &o->via.map.ptr[i].val;
                }
            if (!v) {
                snprintf(err, cap, "%s.%s is missing", path, k->name);
                return 1;
            }
            if (!type_ok(v, k->t)) {
                snprintf(err, cap, "%s.%s has the wrong type (msgpack type %d)", path, k->name,
                         (int)v->type);
                return 1;
            }
            char sub[256];
            snprintf(sub, sizeof(sub), "%s.%s", path, k->name);
            if ((k->t == T_MAP || (k->t == T_MAP_NIL && v->type == MSGPACK_OBJECT_MAP)) &&
                check_map(v, NULL, k->sub, sub, err, cap))
                return 1;
            if (k->t == T_MAPS)
                for (uint32_t i = 0; i < v->via.array.size; i++) {
                    char el[300];
                    snprintf(el, sizeof(el), "%s[%u]", sub, i);
                    if (check_map(&v->via.array.ptr[i], NULL, k->sub, el, err, cap))
                        return 1;
                }
            for (uint32_t i = 0; k->t == T_DELTAS && i < v->via.array.size; i++) {
                char el[300];
                snprintf(el, sizeof(el), "%s[%u]", sub, i);
                const msgpack_object *d = &v->via.array.ptr[i];
                bool first = d->type == MSGPACK_OBJECT_MAP && proto_map_find(d, "id");
                if (check_map(d, NULL, first ? K_DELTA_FIRST : K_DELTA_NEXT, el, err, cap))
                    return 1;
            }
        }
    if (o->via.map.size != n_spec) {
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            const msgpack_object *key = &o->via.map.ptr[i].key;
            bool known = false;
            for (int l = 0; l < 2 && !known; l++)
                for (const struct key *k = lists[l]; k && k->name && !known; k++)
                    known = str_is(key, k->name);
            if (!known) {
                snprintf(err, cap, "%s has an undocumented key '%.*s'", path,
                         key->type == MSGPACK_OBJECT_STR ? (int)key->via.str.size : 1,
                         key->type == MSGPACK_OBJECT_STR ? key->via.str.ptr : "?");
                return 1;
            }
        }
        snprintf(err, cap, "%s has %u keys, %zu documented", path, o->via.map.size, n_spec);
        return 1;
    }
    return 0;
}

static const struct key K_REPLY_BASE[] = {
    {"id", T_UINT, NULL}, {"ok", T_BOOL, NULL}, {NULL, 0, NULL}};
static const struct key K_EVENT_BASE[] = {
    {"id", T_UINT, NULL}, {"event", T_STR, NULL}, {NULL, 0, NULL}};

/* ---- the documentation --------------------------------------------------- */

static char *g_doc;

/* The text of the section of docs/protocol.md whose heading (## or ###)
 * holds `word` as a whole word, up to the next heading. */
static char *doc_section(const char *word, char *out, size_t cap)
{
    for (const char *p = g_doc; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (strncmp(p, "## ", 3) != 0 && strncmp(p, "### ", 4) != 0)
            continue;
        const char *eol = strchr(p, '\n');
        size_t hl = eol ? (size_t)(eol - p) : strlen(p), wl = strlen(word);
        bool hit = false;
        for (const char *w = p; w + wl <= p + hl && !hit; w++)
            hit = strncmp(w, word, wl) == 0 && (w[-1] == ' ' || w[-1] == '/') &&
                  (w + wl == p + hl || w[wl] == ' ' || w[wl] == '/');
        if (!hit)
            continue;
        const char *end = eol ? eol + 1 : p + hl;
        while (*end && strncmp(end, "## ", 3) != 0 && strncmp(end, "### ", 4) != 0) {
            const char *n = strchr(end, '\n');
            end = n ? n + 1 : end + strlen(end);
        }
        size_t n = (size_t)(end - p) < cap - 1 ? (size_t)(end - p) : cap - 1;
        memcpy(out, p, n);
        out[n] = '\0';
        return out;
    }
    fail_msg("docs/protocol.md has no section for '%s'", word);
    return NULL;
}

/* Every key of spec (nested ones too) is named in the section, as `key` or
 * "key". */
static void doc_names(const char *section_word, const char *text, const struct key *spec)
{
    for (const struct key *k = spec; k && k->name; k++) {
        char a[80], b[80];
        snprintf(a, sizeof(a), "`%s`", k->name);
        snprintf(b, sizeof(b), "\"%s\"", k->name);
        if (!strstr(text, a) && !strstr(text, b))
            fail_msg("docs/protocol.md, section '%s', does not name the key '%s'", section_word,
                     k->name);
        if (k->sub)
            doc_names(section_word, text, k->sub);
    }
}

static void documented(const char *section_word, const struct key *spec)
{
    static char text[65536];
    doc_names(section_word, doc_section(section_word, text, sizeof(text)), spec);
}

/* ---- requests ------------------------------------------------------------ */

static uint64_t g_id;
static unsigned g_tool_events; /* events checked with tool calls' news */

/* Receives the reply to `id` (events of it are checked against ev, when
 * given, and counted); checks it against spec, or against the error form
 * with `code` when want_code is not 0. Returns the reply (caller frees). */
static void expect(int fd, uint64_t id, int want_code, const struct key *spec, const struct key *ev,
                   unsigned *n_events, struct kh_reply *r)
{
    char err[512];
    for (;;) {
        if (kh_recv(fd, r) != 0)
            fail_msg("no reply to request %llu", (unsigned long long)id);
        if (proto_map_find(r->root, "event")) {
            if (!ev)
                fail_msg("unexpected event for request %llu", (unsigned long long)r->id);
            /* an event with tool calls' news has them besides the rest */
            const struct key *e = ev == K_TOKENS_EVENT && proto_map_find(r->root, "tool_calls")
                                      ? K_TOKENS_EVENT_TOOLS
                                      : ev;
            g_tool_events += e == K_TOKENS_EVENT_TOOLS;
            if (check_map(r->root, K_EVENT_BASE, e, "event", err, sizeof(err)))
                fail_msg("%s", err);
            if (n_events)
                ++*n_events;
            kh_reply_free(r);
            continue;
        }
        break;
    }
    assert_int_equal(r->id, id);
    if (r->code != want_code)
        fail_msg("request %llu: code %d (%s), expected %d", (unsigned long long)id, r->code,
                 r->message, want_code);
    if (check_map(r->root, K_REPLY_BASE, want_code ? K_ERROR : spec, "reply", err, sizeof(err)))
        fail_msg("request %llu: %s", (unsigned long long)id, err);
}

static void call(int fd, struct kh_req *q, int want_code, const struct key *spec,
                 struct kh_reply *r)
{
    assert_int_equal(kh_req_send(fd, q), 0);
    expect(fd, g_id, want_code, spec, NULL, NULL, r);
}

static void call_seq(int fd, const char *op, uint64_t seq, const struct key *spec)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, op, ++g_id, 1);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    call(fd, &q, 0, spec, &r);
    kh_reply_free(&r);
}

static uint64_t open_seq(int fd)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "seq_open", ++g_id, 0);
    call(fd, &q, 0, K_SEQ, &r);
    uint64_t s = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    return s;
}

/* ---- store mode ---------------------------------------------------------- */

#define BT 4

static int stats_child(void *arg)
{
    const char *sock = arg;
    char err[512];
    struct kh_reply r;
    int fd = kh_connect(sock);
    if (fd < 0 || kh_call0(fd, "stats", 1, &r) != 0)
        return 10;
    if (check_map(r.root, K_REPLY_BASE, K_STATS_TENANT, "reply", err, sizeof(err))) {
        fprintf(stderr, "non-admin stats: %s\n", err);
        return 11;
    }
    kh_reply_free(&r);
    close(fd);
    return 0;
}

static void test_store_mode_replies(void **state)
{
    (void)state;
    /* As root, the socket's group lets the non-admin child (gid 65534) in. */
    const char *args[] = {"--kv-layers",
                          "2",
                          "--kv-heads",
                          "1",
                          "--head-dim",
                          "8",
                          "--kv-dtype",
                          "f16",
                          "--block-tokens",
                          "4",
                          "--device-blocks",
                          "16",
                          "--host-blocks",
                          "16",
                          geteuid() == 0 ? "--socket-group" : NULL,
                          "nogroup",
                          NULL};
    struct kh_proc p;
    struct kh_req q;
    struct kh_reply r;
    assert_int_equal(kh_start(&p, NULL, args), 0);
    int fd = kh_connect(p.sock);
    assert_true(fd >= 0);

    kh_req_begin(&q, "hello", ++g_id, 0);
    call(fd, &q, 0, K_HELLO, &r);
    assert_int_equal(kh_obj(r.root, "model")->type, MSGPACK_OBJECT_NIL);
    uint64_t tb = kh_u64(kh_obj(r.root, "kv"), "token_bytes");
    kh_reply_free(&r);
    documented("hello", K_HELLO);

    uint64_t s = open_seq(fd);
    documented("seq_open", K_SEQ);
    kh_req_begin(&q, "seq_extend", ++g_id, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "n", 2 * BT);
    call(fd, &q, 0, K_EXTEND, &r);
    kh_reply_free(&r);
    documented("seq_extend", K_EXTEND);

    uint8_t *data = calloc(2 * BT, tb);
    assert_non_null(data);
    kh_req_begin(&q, "kv_write", ++g_id, 4);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "start", 0);
    proto_pack_kv_uint(&q.pk, "n", 2 * BT);
    proto_pack_kv_bin(&q.pk, "data", data, 2 * BT * tb);
    call(fd, &q, 0, K_NONE, &r);
    kh_reply_free(&r);
    free(data);

    kh_req_begin(&q, "kv_read", ++g_id, 3);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "start", 0);
    proto_pack_kv_uint(&q.pk, "n", BT);
    call(fd, &q, 0, K_READ, &r);
    kh_reply_free(&r);
    documented("kv_read", K_READ);

    uint32_t toks[2 * BT];
    for (int i = 0; i < 2 * BT; i++)
        toks[i] = (uint32_t)(10 + i);
    kh_req_begin(&q, "seq_commit", ++g_id, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 2 * BT);
    call(fd, &q, 0, K_COMMIT, &r);
    kh_reply_free(&r);
    documented("seq_commit", K_COMMIT);

    call_seq(fd, "seq_fork", s, K_SEQ);
    documented("seq_fork", K_SEQ);
    call_seq(fd, "seq_info", s, K_INFO);
    documented("seq_info", K_INFO);
    call_seq(fd, "seq_offload", s, K_MOVE);
    documented("seq_offload", K_MOVE);
    call_seq(fd, "seq_restore", s, K_MOVE);
    documented("seq_restore", K_MOVE);

    uint64_t s2 = open_seq(fd);
    kh_req_begin(&q, "seq_match", ++g_id, 2);
    proto_pack_kv_uint(&q.pk, "seq", s2);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 2 * BT);
    call(fd, &q, 0, K_MATCH, &r);
    assert_int_equal(kh_u64(r.root, "matched"), 2 * BT);
    kh_reply_free(&r);
    documented("seq_match", K_MATCH);
    call_seq(fd, "seq_close", s2, K_NONE);

    kh_req_begin(&q, "admin_evict", ++g_id, 0);
    call(fd, &q, 0, K_EVICT, &r);
    kh_reply_free(&r);
    documented("admin_evict", K_EVICT);
    kh_req_begin(&q, "admin_check", ++g_id, 0);
    call(fd, &q, 0, K_NONE, &r);
    kh_reply_free(&r);

    kh_req_begin(&q, "stats", ++g_id, 0);
    call(fd, &q, 0, K_STATS_ALL, &r);
    kh_reply_free(&r);
    documented("stats", K_STATS_ALL);

    /* Error replies: a refused op, an unknown one, generate without a model. */
    kh_req_begin(&q, "cancel", ++g_id, 1);
    proto_pack_kv_uint(&q.pk, "target", 12345);
    call(fd, &q, KVD_ENOTFOUND, NULL, &r);
    kh_reply_free(&r);
    kh_req_begin(&q, "no_such_op", ++g_id, 0);
    call(fd, &q, KVD_EUNKNOWN_OP, NULL, &r);
    kh_reply_free(&r);
    kh_req_begin(&q, "generate", ++g_id, 1);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 2);
    call(fd, &q, KVD_EUNSUPPORTED, NULL, &r);
    kh_reply_free(&r);
    documented("3.", K_REPLY_BASE);
    documented("3.", K_ERROR);

    if (geteuid() == 0)
        assert_int_equal(kh_child_status(kh_run_as(60001, 65534, stats_child, p.sock)), 0);
    else
        fprintf(stderr, "test_reply_keys: not root, a non-admin's stats not checked\n");

    kh_req_begin(&q, "admin_shutdown", ++g_id, 0);
    call(fd, &q, 0, K_NONE, &r);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_wait(&p), 0);
    kh_cleanup_dir(&p);
}

/* ---- serve mode ---------------------------------------------------------- */

static void test_serve_mode_replies(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    char dir[] = "/tmp/kvd-keys.XXXXXX", model[128], cmd[512];
    assert_non_null(tools);
    assert_non_null(mkdtemp(dir));
    snprintf(model, sizeof(model), "%s/tiny.gguf", dir);
    snprintf(
        cmd, sizeof(cmd),
        "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
        "--vocab 512 --ctx 2048 --seed 1 --chat-template %s/tests/text/templates/qwen2.5.jinja "
        ">/dev/null",
        tools, model, KVD_SOURCE_DIR);
    assert_int_equal(system(cmd), 0);
    const char *const args[] = {"--model", model, "--backend", "cpu", "--threads", "1", NULL};
    struct kh_proc p;
    struct kh_req q;
    struct kh_reply r;
    assert_int_equal(kh_start(&p, NULL, args), 0);
    int fd = kh_connect(p.sock);
    assert_true(fd >= 0);

    kh_req_begin(&q, "hello", ++g_id, 0);
    call(fd, &q, 0, K_HELLO, &r);
    assert_int_equal(kh_obj(r.root, "model")->type, MSGPACK_OBJECT_MAP);
    kh_reply_free(&r);

    uint32_t prompt[6] = {1, 2, 3, 4, 5, 6};
    kh_req_begin(&q, "generate", ++g_id, 2);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 6);
    proto_pack_kv_uint(&q.pk, "max_tokens", 3);
    call(fd, &q, 0, K_GEN, &r);
    kh_reply_free(&r);
    documented("generate", K_GEN);

    unsigned events = 0;
    kh_req_begin(&q, "generate", ++g_id, 3);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 6);
    proto_pack_kv_uint(&q.pk, "max_tokens", 3);
    proto_pack_kv_bool(&q.pk, "stream", true);
    assert_int_equal(kh_req_send(fd, &q), 0);
    expect(fd, g_id, 0, K_GEN, K_TOKENS_EVENT, &events, &r);
    kh_reply_free(&r);
    assert_true(events >= 1);
    documented("generate", K_TOKENS_EVENT);
    documented("3.", K_EVENT_BASE);

    kh_req_begin(&q, "generate", ++g_id, 3);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 6);
    proto_pack_kv_uint(&q.pk, "max_tokens", 3);
    proto_pack_kv_uint(&q.pk, "n", 2);
    call(fd, &q, 0, K_GEN_N, &r);
    kh_reply_free(&r);
    documented("generate", K_GEN_N);
    events = 0;
    kh_req_begin(&q, "generate", ++g_id, 4);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 6);
    proto_pack_kv_uint(&q.pk, "max_tokens", 3);
    proto_pack_kv_uint(&q.pk, "n", 2);
    proto_pack_kv_bool(&q.pk, "stream", true);
    assert_int_equal(kh_req_send(fd, &q), 0);
    expect(fd, g_id, 0, K_GEN_N, K_TOKENS_EVENT_N, &events, &r);
    kh_reply_free(&r);
    assert_true(events >= 2);
    documented("generate", K_TOKENS_EVENT_N);

    /* tool calls: the reply's, and the events' news */
    for (int stream = 0; stream < 2; stream++) {
        kh_req_begin(&q, "generate", ++g_id, 6);
        proto_pack_str(&q.pk, "messages");
        proto_pack_array(&q.pk, 1);
        proto_pack_map(&q.pk, 2);
        proto_pack_kv_str(&q.pk, "role", "user");
        proto_pack_kv_str(&q.pk, "content", "x?");
        proto_pack_str(&q.pk, "tools");
        proto_pack_array(&q.pk, 1);
        proto_pack_map(&q.pk, 2);
        proto_pack_kv_str(&q.pk, "type", "function");
        proto_pack_str(&q.pk, "function");
        proto_pack_map(&q.pk, 2);
        proto_pack_kv_str(&q.pk, "name", "f");
        proto_pack_str(&q.pk, "parameters");
        proto_pack_map(&q.pk, 4);
        proto_pack_kv_str(&q.pk, "type", "object");
        proto_pack_str(&q.pk, "properties");
        proto_pack_map(&q.pk, 1);
        proto_pack_str(&q.pk, "x");
        proto_pack_map(&q.pk, 1);
        proto_pack_str(&q.pk, "enum");
        proto_pack_array(&q.pk, 1);
        proto_pack_str(&q.pk, "a");
        proto_pack_str(&q.pk, "required");
        proto_pack_array(&q.pk, 1);
        proto_pack_str(&q.pk, "x");
        proto_pack_kv_bool(&q.pk, "additionalProperties", false);
        proto_pack_kv_str(&q.pk, "tool_choice", "required");
        proto_pack_kv_uint(&q.pk, "max_tokens", 400);
        proto_pack_kv_uint(&q.pk, "seed", 3);
        proto_pack_kv_bool(&q.pk, "stream", stream);
        events = 0;
        assert_int_equal(kh_req_send(fd, &q), 0);
        expect(fd, g_id, 0, K_GEN_TOOLS, K_TOKENS_EVENT, &events, &r);
        kh_reply_free(&r);
        assert_true(stream ? events >= 1 : events == 0);
    }
    assert_true(g_tool_events >= 1);
    documented("generate", K_GEN_TOOLS);
    documented("generate", K_TOKENS_EVENT_TOOLS);
    documented("generate", K_DELTA_FIRST);

    uint64_t s = open_seq(fd);
    kh_req_begin(&q, "generate", ++g_id, 3);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 6);
    proto_pack_kv_uint(&q.pk, "max_tokens", 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    call(fd, &q, 0, K_GEN_SEQ, &r);
    kh_reply_free(&r);
    documented("generate", K_GEN_SEQ);

    kh_req_begin(&q, "tokenize", ++g_id, 1);
    proto_pack_kv_str(&q.pk, "text", "hello world");
    call(fd, &q, 0, K_TOKENIZE, &r);
    kh_reply_free(&r);
    documented("tokenize", K_TOKENIZE);

    kh_req_begin(&q, "detokenize", ++g_id, 1);
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 6);
    call(fd, &q, 0, K_DETOKENIZE, &r);
    kh_reply_free(&r);
    documented("detokenize", K_DETOKENIZE);

    kh_req_begin(&q, "generate", ++g_id, 2);
    proto_pack_kv_str(&q.pk, "text", "hello");
    proto_pack_kv_uint(&q.pk, "max_tokens", 2);
    call(fd, &q, 0, K_GEN, &r);
    kh_reply_free(&r);

    kh_req_begin(&q, "cancel", ++g_id, 1);
    proto_pack_kv_uint(&q.pk, "target", 1);
    call(fd, &q, 0, K_CANCEL, &r);
    kh_reply_free(&r);
    documented("cancel", K_CANCEL);

    kh_req_begin(&q, "stats", ++g_id, 0);
    call(fd, &q, 0, K_STATS_ALL, &r);
    assert_true(kh_obj(kh_obj(r.root, "requests"), "executor")->via.boolean);
    kh_reply_free(&r);

    close(fd);
    assert_int_equal(kh_stop(&p), 0);
    unlink(model);
    rmdir(dir);
}

/* Two models by name: hello naming one (the other not loaded yet: its
 * fingerprint nil), its `models` list, a model's generate, stats with both
 * models, and the errors of a model no one has. */
static void test_models_replies(void **state)
{
    (void)state;
    const char *tools = getenv("KVD_TOOLS_DIR");
    char dir[] = "/tmp/kvd-keys.XXXXXX", ma[128], mb[128], cmd[512], conf[512];
    assert_non_null(mkdtemp(dir));
    snprintf(ma, sizeof(ma), "%s/a.gguf", dir);
    snprintf(mb, sizeof(mb), "%s/b.gguf", dir);
    snprintf(cmd, sizeof(cmd),
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 512 --seed 1 >/dev/null && %s/kvd-gguf-gen -o %s --arch qwen2 "
             "--layers 1 --embd 64 --heads 2 --kv-heads 1 --ff 128 --vocab 300 --ctx 256 "
             "--seed 2 >/dev/null",
             tools, ma, tools, mb);
    assert_int_equal(system(cmd), 0);
    snprintf(conf, sizeof(conf),
             "[model:alpha]\npath = %s\n[model:beta]\npath = %s\nkv-dtype = q8_0\n"
             "keep-alive-s = forever\n",
             ma, mb);
    const char *const args[] = {"--backend", "cpu", "--threads", "1", NULL};
    struct kh_proc p;
    struct kh_req q;
    struct kh_reply r;
    assert_int_equal(kh_start(&p, conf, args), 0);
    int fd = kh_connect(p.sock);
    assert_true(fd >= 0);

    kh_req_begin(&q, "hello", ++g_id, 1);
    proto_pack_kv_str(&q.pk, "model", "beta");
    call(fd, &q, 0, K_HELLO, &r);
    assert_int_equal(kh_obj(kh_obj(r.root, "model"), "fingerprint")->type, MSGPACK_OBJECT_NIL);
    assert_int_equal(kh_obj(r.root, "models")->via.array.size, 2);
    kh_reply_free(&r);
    documented("hello", K_MODEL_ENTRY);

    uint32_t prompt[4] = {1, 2, 3, 4};
    kh_req_begin(&q, "generate", ++g_id, 3);
    proto_pack_kv_str(&q.pk, "model", "beta");
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 4);
    proto_pack_kv_uint(&q.pk, "max_tokens", 2);
    call(fd, &q, 0, K_GEN, &r);
    kh_reply_free(&r);

    kh_req_begin(&q, "stats", ++g_id, 0);
    call(fd, &q, 0, K_STATS_ALL, &r);
    assert_int_equal(kh_obj(r.root, "models")->via.array.size, 2);
    kh_reply_free(&r);
    documented("stats", K_MODEL_STATS_ALL);
    documented("stats", K_MODEL_MEMORY);

    kh_req_begin(&q, "generate", ++g_id, 2);
    proto_pack_kv_str(&q.pk, "model", "gamma");
    proto_pack_kv_u32_array(&q.pk, "tokens", prompt, 4);
    call(fd, &q, KVD_ENOTFOUND, NULL, &r);
    kh_reply_free(&r);
    kh_req_begin(&q, "seq_open", ++g_id, 1);
    proto_pack_kv_str(&q.pk, "model", "gamma");
    call(fd, &q, KVD_ENOTFOUND, NULL, &r);
    kh_reply_free(&r);

    close(fd);
    assert_int_equal(kh_stop(&p), 0);
    unlink(ma);
    unlink(mb);
    rmdir(dir);
}

static int load_doc(void **state)
{
    (void)state;
    FILE *f = fopen(KVD_SOURCE_DIR "/docs/protocol.md", "r");
    if (!f)
        return -1;
    g_doc = calloc(1, 1 << 20);
    size_t n = g_doc ? fread(g_doc, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    return n > 0 ? 0 : -1;
}

static int free_doc(void **state)
{
    (void)state;
    free(g_doc);
    return 0;
}

int main(void)
{
    if (!getenv("KVD_BIN") || !getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "test_reply_keys: KVD_BIN/KVD_TOOLS_DIR not set (run through ctest)\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_store_mode_replies),
        cmocka_unit_test(test_serve_mode_replies),
        cmocka_unit_test(test_models_replies),
    };
    return cmocka_run_group_tests(tests, load_doc, free_doc);
}
