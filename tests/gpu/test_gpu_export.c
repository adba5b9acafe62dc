/* kv_export against a real kvd on the cuda backend: device pages come as
 * POSIX descriptors of VMM allocations (kind cuda_vmm), which this process
 * imports (cuMemImportFromShareableHandle), maps and reads: the bytes equal
 * kv_read's, and a writable export filled in place is what kv_read then
 * returns; host-tier pages still come as memfds; a page of a shared
 * namespace is refused (a VMM handle cannot be made read-only). On the
 * emulator the "device" memory is memfds shared between the processes.
 * Exits 77 without a device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_drv.h"
#include "gpu/gpu_fixture.h"
#include "kvd/client.h"
#include "kvd/protocol.h"
#include "kvd_harness.h"

/* The driver API as a client engine would use it (resolved at run time, as
 * kvd does: cuda_drv.h). */
static const struct cuda_drv *drv;

static struct kh_proc *d;

static int setup(void **state)
{
    char conf[256];
    snprintf(conf, sizeof conf, "[tenant:t]\nuids = %u\nnamespaces = shared\n", (unsigned)getuid());
    static const char *const args[] = {
        "--backend", "cuda", "--device-blocks", "64", "--host-blocks", "64", NULL};
    d = kh_new(conf, args);
    return d ? 0 : -1;
}

static int teardown(void **state)
{
    kh_free(d);
    return 0;
}

static struct kvd_ctx *connect_ok(void)
{
    struct kvd_ctx *c = kvd_connect(d->sock);
    assert_non_null(c);
    if (c->err)
        fail_msg("connect: %s", c->errstr);
    kvd_set_timeout(c, 60000);
    return c;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(seed * 131 + i * 7 + (i >> 9));
}

static uint64_t make_seq(struct kvd_ctx *c, const char *ns, size_t n, size_t tb, unsigned seed)
{
    uint64_t seq;
    unsigned char *a = malloc(n * tb);
    assert_non_null(a);
    assert_int_equal(kvd_seq_open(c, ns, &seq), 0);
    assert_int_equal(kvd_seq_extend(c, seq, n, NULL), 0);
    fill(a, n * tb, seed);
    assert_int_equal(kvd_kv_write(c, seq, 0, n, a, n * tb), 0);
    free(a);
    return seq;
}

/* The export's pages in this process: memfds as libkvd mapped them, VMM
 * handles imported and mapped here (a reservation each). */
struct view {
    size_t n;
    CUdeviceptr va[16];
    CUmemGenericAllocationHandle h[16];
    size_t len[16];
};

static void import_all(const struct kvd_export *ex, struct view *v)
{
    const CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0},
                                CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    memset(v, 0, sizeof *v);
    assert_true(ex->n_maps <= 16);
    v->n = ex->n_maps;
    for (size_t i = 0; i < ex->n_maps; i++) {
        const struct kvd_export_map *m = &ex->maps[i];
        if (m->kind != KVD_EXPORT_CUDA_VMM) {
            assert_non_null(m->addr);
            continue;
        }
        assert_null(m->addr);
        assert_int_equal(
            drv->MemImportFromShareableHandle(&v->h[i], (void *)(intptr_t)m->fd,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_SUCCESS);
        assert_int_equal(drv->MemAddressReserve(&v->va[i], m->len, 0, 0, 0), CUDA_SUCCESS);
        assert_int_equal(drv->MemMap(v->va[i], m->len, 0, v->h[i], 0), CUDA_SUCCESS);
        assert_int_equal(drv->MemSetAccess(v->va[i], m->len, &rw, 1), CUDA_SUCCESS);
        v->len[i] = m->len;
    }
}

static void release_all(struct view *v)
{
    for (size_t i = 0; i < v->n; i++)
        if (v->h[i]) {
            assert_int_equal(drv->MemUnmap(v->va[i], v->len[i]), CUDA_SUCCESS);
            assert_int_equal(drv->MemRelease(v->h[i]), CUDA_SUCCESS);
            assert_int_equal(drv->MemAddressFree(v->va[i], v->len[i]), CUDA_SUCCESS);
        }
}

/* Block i of the export, copied out whatever kind of page holds it. */
static void block_bytes(const struct kvd_export *ex, const struct view *v, size_t i, void *out)
{
    const struct kvd_export_block *b = &ex->blocks[i];
    if (ex->maps[b->fd].kind == KVD_EXPORT_MEMFD) {
        memcpy(out, b->data, b->bytes);
        return;
    }
    assert_int_equal(cudaMemcpy(out, (void *)(uintptr_t)(v->va[b->fd] + b->offset), b->bytes,
                                cudaMemcpyDeviceToHost),
                     cudaSuccess);
}

/* Every whole block equals kv_read of its tokens (full blocks only). */
static void check_equal(struct kvd_ctx *c, uint64_t seq, const struct kvd_export *ex,
                        const struct view *v, const struct kvd_hello_info *h, size_t n_tokens)
{
    size_t B = h->block_tokens, tb = h->token_bytes;
    unsigned char *buf = malloc(B * tb), *blk = malloc(h->block_bytes);
    size_t len;
    for (size_t i = 0; i < ex->n_blocks; i++) {
        size_t t0 = (ex->from_block + i) * B;
        if (t0 + B > n_tokens)
            break;
        assert_int_equal(ex->blocks[i].bytes, h->block_bytes);
        assert_int_equal(kvd_kv_read(c, seq, t0, B, buf, B * tb, &len), 0);
        block_bytes(ex, v, i, blk);
        assert_memory_equal(blk, buf, h->block_bytes);
    }
    free(buf);
    free(blk);
}

static void test_device_pages_are_vmm_handles(void **state)
{
    struct kvd_ctx *c = connect_ok();
    struct kvd_hello_info h;
    struct kvd_export *ex = NULL;
    struct view v;
    assert_int_equal(kvd_hello(c, &h), 0);
    size_t B = h.block_tokens, n = 3 * B;
    uint64_t seq = make_seq(c, NULL, n, h.token_bytes, 1);
    assert_int_equal(kvd_kv_export(c, seq, 0, 0, false, &ex), 0);
    assert_int_equal(ex->n_blocks, 3);
    for (size_t i = 0; i < ex->n_maps; i++)
        assert_int_equal(ex->maps[i].kind, KVD_EXPORT_CUDA_VMM);
    import_all(ex, &v);
    check_equal(c, seq, ex, &v, &h, n);
    release_all(&v);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);

    /* Writable: filled in place through the imported mapping. */
    assert_int_equal(kvd_kv_export(c, seq, 0, 0, true, &ex), 0);
    assert_true(ex->blocks[0].writable);
    import_all(ex, &v);
    const struct kvd_export_block *b = &ex->blocks[0];
    assert_int_equal(cudaMemset((void *)(uintptr_t)(v.va[b->fd] + b->offset), 0x5a, b->bytes),
                     cudaSuccess);
    unsigned char *buf = malloc(B * h.token_bytes);
    size_t len;
    assert_int_equal(kvd_kv_read(c, seq, 0, B, buf, B * h.token_bytes, &len), 0);
    for (size_t i = 0; i < len; i++)
        assert_int_equal(buf[i], 0x5a);
    free(buf);
    release_all(&v);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);
    kvd_close(c);
}

static void test_host_pages_are_memfds(void **state)
{
    struct kvd_ctx *c = connect_ok();
    struct kvd_hello_info h;
    struct kvd_export *ex = NULL;
    struct view v;
    assert_int_equal(kvd_hello(c, &h), 0);
    size_t n = 2 * h.block_tokens;
    uint64_t seq = make_seq(c, NULL, n, h.token_bytes, 2);
    assert_int_equal(kvd_seq_offload(c, seq), 0);
    assert_int_equal(kvd_kv_export(c, seq, 0, 0, true, &ex), 0);
    for (size_t i = 0; i < ex->n_maps; i++) {
        assert_int_equal(ex->maps[i].kind, KVD_EXPORT_MEMFD);
        assert_false(ex->maps[i].writable); /* host pages are read-only */
    }
    import_all(ex, &v);
    check_equal(c, seq, ex, &v, &h, n);
    release_all(&v);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);
    kvd_close(c);
}

static void test_shared_namespace_refused(void **state)
{
    struct kvd_ctx *c = connect_ok();
    struct kvd_hello_info h;
    struct kvd_export *ex = NULL;
    assert_int_equal(kvd_hello(c, &h), 0);
    size_t n = 2 * h.block_tokens;
    uint64_t seq = make_seq(c, "shared", n, h.token_bytes, 3);
    assert_int_equal(kvd_kv_export(c, seq, 0, 0, false, &ex), KVD_EPERM);
    assert_non_null(strstr(c->errstr, "read-only"));
    struct kvd_reply *r = NULL;
    assert_int_equal(kvd_call(c, KVD_OP_ADMIN_CHECK, NULL, 0, &r), 0);
    kvd_reply_free(r);
    kvd_close(c);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || cudaSetDevice(0) != cudaSuccess ||
        !(drv = cuda_drv(NULL, 0))) {
        printf("SKIP: no usable CUDA device\n");
        return GPU_SKIP;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_device_pages_are_vmm_handles, setup, teardown),
        cmocka_unit_test_setup_teardown(test_host_pages_are_memfds, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shared_namespace_refused, setup, teardown),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (gpu_emu_clean(NULL) != 0) /* this process's imports, mappings and copies */
        rc = 1;
    return rc;
}
