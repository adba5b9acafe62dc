/* kv_events_fixture: what the KV events tests (test_kv_events,
 * test_kv_events_models) share besides the subscriber (kv_events_sub.h):
 * their temporary directory and tiny random models, the clock their waits
 * read, the prompts they send, and the daemon's stats and admin_evict as
 * they use them. */
#ifndef KVD_TEST_KV_EVENTS_FIXTURE_H
#define KVD_TEST_KV_EVENTS_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "kvd_harness.h"

/* A fresh directory /tmp/NAME.XXXXXX into dir: 0, or -1. */
int kvf_dir(char *dir, size_t cap, const char *name);
/* The directory and all in it removed (teardown). */
void kvf_rmdir(const char *dir);
/* A tiny random model (2 layers, embd 64, vocab 256, context 4096) of the
 * seed written to path by kvd-gguf-gen ($KVD_TOOLS_DIR): 0, or -1. */
int kvf_model(const char *path, int seed);
uint64_t kvf_now_ms(void);
/* n tokens below 256, different for each salt. */
void kvf_make_prompt(uint32_t *p, size_t n, uint32_t salt);
/* stats tenants[name][key], of model (NULL: the daemon's one model); the
 * test fails when there is no such entry. */
uint64_t kvf_tenant_stat(const struct kh_proc *d, const char *model, const char *name,
                         const char *key);
/* admin_evict tier "all" of model (NULL: the daemon's one model). */
void kvf_admin_evict_all(const struct kh_proc *d, const char *model);

#endif
