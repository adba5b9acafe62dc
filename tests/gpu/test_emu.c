/* The CUDA emulator's own checks (KVD_CUDA=EMULATE builds only,
 * docs/emulation.md): kernels with a known defect (kernels/emu/selftest)
 * must each be reported, correct ones must pass in every thread order, the
 * runtime must enforce the capture rules and the reference cuBLAS must
 * follow cuBLAS's column-major rules, and the f16/bf16 conversions must be
 * bit-exact with the cpu backend's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute_cpu_impl.h"
#include "faults.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"

#define N 128

static float *d_in, *d_out;
static cudaStream_t st;

static int setup(void **state)
{
    float h[N];
    for (int i = 0; i < N; i++)
        h[i] = (float)(i % 7) - 3.0f;
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) ||
        cudaMalloc((void **)&d_in, N * sizeof(float)) ||
        cudaMalloc((void **)&d_out, (N + 1) * sizeof(float)) ||
        cudaMemcpy(d_in, h, sizeof h, cudaMemcpyHostToDevice))
        return -1;
    gpu_emu_reports();
    return 0;
}

static int teardown(void **state)
{
    cudaFree(d_in);
    cudaFree(d_out);
    cudaStreamDestroy(st);
    return 0;
}

/* Runs fault f and requires at least one report containing `what`. */
static void expect_report(enum kvd_fault f, int n, const char *what)
{
    (void)cudaGetLastError();
    int rc = kvd_fault_run(f, d_in, d_out, n, st);
    unsigned long r = gpu_emu_reports();
    if (r == 0)
        fail_msg("fault %d: no report (launch status %d)", (int)f, rc);
    if (!strstr(kvd_emu_last_report(), what))
        fail_msg("fault %d: the report '%s' does not say '%s'", (int)f, kvd_emu_last_report(),
                 what);
    assert_int_not_equal(rc, 0); /* the launch reports a failure too */
}

static void test_barrier_faults(void **state)
{
    expect_report(KVD_FAULT_EXIT_BEFORE_BARRIER, N, "divergent barrier");
    expect_report(KVD_FAULT_TWO_BARRIERS, N, "different barriers");
}

static void test_warp_faults(void **state)
{
    expect_report(KVD_FAULT_MASK_WITHOUT_SELF, 32, "leaves out the calling lane");
    expect_report(KVD_FAULT_SHFL_OUTSIDE_MASK, 32, "outside the mask");
    expect_report(KVD_FAULT_SHFL_EXITED_LANE, 32, "exited without joining");
}

static void test_memory_faults(void **state)
{
#ifdef KVD_EMU_MEMCHECK
    /* forward order: read before the other warp wrote; other orders: a race */
    expect_report(KVD_FAULT_SHARED_RAW, N, "shared");
    expect_report(KVD_FAULT_SHARED_WAW, N, "shared-memory race");
    expect_report(KVD_FAULT_SHARED_WAR, N, "shared-memory race");
    expect_report(KVD_FAULT_WARP_WAR, 32, "shared-memory race");
    /* a __syncwarp orders a lane's write after its warp's earlier reads */
    assert_int_equal(kvd_fault_run(KVD_FAULT_WARP_WAR_OK, d_in, d_out, 32, st), 0);
    assert_int_equal(gpu_emu_reports(), 0);
    expect_report(KVD_FAULT_SHARED_UNINIT, N, "that no thread of its block wrote");
    expect_report(KVD_FAULT_GLOBAL_OOB, N, "invalid global write");
#else
    skip(); /* needs the instrumented (clang) build; a GCC ASan build checks bounds itself */
#endif
}

/* Programmatic dependent launch: before its wait a kernel may read what
 * the kernel before it does not write, and nothing more. */
static void test_pdl(void **state)
{
#ifdef KVD_EMU_MEMCHECK
    assert_true(kvd_k_pdl_on()); /* sm_90, the emulator's default */
    expect_report(KVD_FAULT_PDL_EARLY_READ, N, "premature read");
    expect_report(KVD_FAULT_PDL_EARLY_WRITE, N, "before cudaGridDependencySynchronize");
    expect_report(KVD_FAULT_PDL_EARLY_TRIGGER, N, "triggers its dependents");
    assert_int_equal(kvd_fault_run(KVD_FAULT_PDL_OK, d_in, d_out, N, st), 0);
    assert_int_equal(gpu_emu_reports(), 0);
    /* an sm_86 device launches without the attribute: nothing to check */
    kvd_emu_set_cc(8, 6);
    kvd_k_set_pdl(1);
    assert_int_equal(kvd_fault_run(KVD_FAULT_PDL_EARLY_READ, d_in, d_out, N, st), 0);
    assert_int_equal(gpu_emu_reports(), 0);
    kvd_emu_set_cc(9, 0);
#else
    skip();
#endif
}

static void test_order_check(void **state)
{
#ifdef KVD_EMU_MEMCHECK
    kvd_emu_set_order_check(1);
    expect_report(KVD_FAULT_GLOBAL_RACE, N, "thread order");
    /* a correct reduction passes in every order, with the exact sum */
    assert_int_equal(kvd_fault_run(KVD_FAULT_NONE, d_in, d_out, N, st), 0);
    assert_int_equal(gpu_emu_reports(), 0);
    kvd_emu_set_order_check(0);
#else
    skip();
#endif
}

static void test_correct_kernels(void **state)
{
    float h[N], out;
    assert_int_equal(cudaMemcpy(h, d_in, sizeof h, cudaMemcpyDeviceToHost), 0);
    float sum = 0;
    for (int i = 0; i < N; i++)
        sum += h[i];
    assert_int_equal(kvd_fault_run(KVD_FAULT_NONE, d_in, d_out, N, st), 0);
    assert_int_equal(cudaMemcpy(&out, d_out, 4, cudaMemcpyDeviceToHost), 0);
    assert_true(out == sum);
    assert_int_equal(kvd_fault_run(KVD_FAULT_ATOMIC_OK, d_in, d_out, N, st), 0);
    assert_int_equal(cudaMemcpy(&out, d_out, 4, cudaMemcpyDeviceToHost), 0);
    assert_true(out == (float)N);
    assert_int_equal(gpu_emu_reports(), 0);
}

static void test_launch_limits(void **state)
{
    /* over 48 KiB of dynamic shared memory needs the opt-in, as on a GPU */
    assert_int_equal(kvd_fault_run(KVD_FAULT_BIG_DYN_SMEM, d_in, d_out, 32, st),
                     cudaErrorInvalidValue);
    assert_true(gpu_emu_reports() > 0);
    assert_non_null(strstr(kvd_emu_last_report(), "cudaFuncSetAttribute"));
    assert_int_equal(cudaGetLastError(), cudaSuccess); /* read by the launcher */
    assert_int_equal(kvd_fault_run(KVD_FAULT_NONE, d_in, d_out, 2048, st),
                     cudaErrorInvalidConfiguration);
    assert_true(gpu_emu_reports() > 0);
}

/* The real runtime's capture rules: work is recorded, not run; calls that
 * may synchronize or allocate are refused on the capturing thread and
 * invalidate the capture; replays re-issue the recorded arguments. */
static void test_capture_rules(void **state)
{
    float zero[N + 1] = {0}, got[N + 1];
    assert_int_equal(cudaMemcpy(d_out, zero, sizeof zero, cudaMemcpyHostToDevice), 0);
    assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), 0);
    assert_int_equal(kvd_fault_run(KVD_FAULT_ATOMIC_OK, d_in, d_out, N, st), 0);
    assert_int_equal(cudaMemcpy(got, d_out, sizeof got, cudaMemcpyDeviceToHost),
                     cudaErrorStreamCaptureUnsupported);
    cudaGraph_t g = NULL;
    assert_int_equal(cudaStreamEndCapture(st, &g), cudaErrorStreamCaptureInvalidated);
    assert_null(g);
    assert_true(gpu_emu_reports() > 0);
    assert_int_equal(cudaGetLastError(), cudaErrorStreamCaptureInvalidated);

    assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), 0);
    assert_int_equal(kvd_fault_run(KVD_FAULT_ATOMIC_OK, d_in, d_out, N, st), 0);
    assert_int_equal(cudaStreamEndCapture(st, &g), 0);
    assert_non_null(g);
    /* nothing ran during the capture */
    assert_int_equal(cudaMemcpy(got, d_out, 4, cudaMemcpyDeviceToHost), 0);
    assert_true(got[0] == 0.0f);
    cudaGraphExec_t ex = NULL;
    assert_int_equal(cudaGraphInstantiate(&ex, g, 0), 0);
    cudaGraphDestroy(g);
    assert_int_equal(cudaGraphLaunch(ex, st), 0);
    assert_int_equal(cudaStreamSynchronize(st), 0);
    assert_int_equal(cudaMemcpy(got, d_out, 4, cudaMemcpyDeviceToHost), 0);
    assert_true(got[0] == (float)N);
    cudaGraphExecDestroy(ex);

    /* a stream pulled into a capture through an event must be joined back */
    cudaStream_t s2;
    cudaEvent_t ev;
    assert_int_equal(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), 0);
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), 0);
    assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), 0);
    assert_int_equal(cudaEventRecord(ev, st), 0);
    assert_int_equal(cudaStreamWaitEvent(s2, ev, 0), 0);
    assert_int_equal(cudaMemcpyAsync(d_out, d_in, 4, cudaMemcpyDeviceToDevice, s2), 0);
    assert_int_equal(cudaStreamEndCapture(st, &g), cudaErrorStreamCaptureUnjoined);
    assert_true(gpu_emu_reports() > 0);
    cudaEventDestroy(ev);
    cudaStreamDestroy(s2);
    (void)cudaGetLastError();
}

static void test_memory_api(void **state)
{
    void *p = NULL;
    size_t free0, total;
    assert_int_equal(cudaMemGetInfo(&free0, &total), 0);
    assert_int_equal(cudaMalloc(&p, 1 << 20), 0);
    size_t free1;
    assert_int_equal(cudaMemGetInfo(&free1, &total), 0);
    assert_true(free0 - free1 == (1 << 20));
    assert_int_equal(cudaFree(p), 0);
    assert_int_equal(cudaFree(p), cudaErrorInvalidValue); /* double free */
    assert_true(gpu_emu_reports() > 0);
    assert_int_equal(cudaMalloc(&p, total + 1), cudaErrorMemoryAllocation);
    float h[4];
    assert_int_equal(cudaMemcpy(d_in + N - 2, h, sizeof h, cudaMemcpyHostToDevice),
                     cudaErrorInvalidValue); /* past the end of the allocation */
    assert_true(gpu_emu_reports() > 0);
    (void)cudaGetLastError();
}

/* C = alpha op(A) op(B) + beta C, column-major, against a direct loop. */
static void test_cublas_reference(void **state)
{
    cublasHandle_t h;
    assert_int_equal(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    assert_int_equal(cublasSetStream(h, st), CUBLAS_STATUS_SUCCESS);
    const int m = 5, n = 3, k = 4, lda = 7, ldb = 6, ldc = 9;
    float A[7 * 7], B[6 * 6], C[9 * 3], R[9 * 3];
    for (int i = 0; i < 49; i++)
        A[i] = (float)((i * 7) % 11) - 5.0f;
    for (int i = 0; i < 36; i++)
        B[i] = (float)((i * 5) % 13) - 6.0f;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            for (int i = 0; i < 27; i++)
                C[i] = R[i] = (float)i;
            float *dA, *dB, *dC;
            assert_int_equal(cudaMalloc((void **)&dA, sizeof A), 0);
            assert_int_equal(cudaMalloc((void **)&dB, sizeof B), 0);
            assert_int_equal(cudaMalloc((void **)&dC, sizeof C), 0);
            cudaMemcpy(dA, A, sizeof A, cudaMemcpyHostToDevice);
            cudaMemcpy(dB, B, sizeof B, cudaMemcpyHostToDevice);
            cudaMemcpy(dC, C, sizeof C, cudaMemcpyHostToDevice);
            const float alpha = 2.0f, beta = 0.5f;
            assert_int_equal(cublasSgemm(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, dA, lda,
                                         dB, ldb, &beta, dC, ldc),
                             CUBLAS_STATUS_SUCCESS);
            cudaMemcpy(C, dC, sizeof C, cudaMemcpyDeviceToHost);
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    float acc = 0;
                    for (int l = 0; l < k; l++)
                        acc += (ta ? A[l + i * lda] : A[i + l * lda]) *
                               (tb ? B[j + l * ldb] : B[l + j * ldb]);
                    R[i + j * ldc] = alpha * acc + beta * R[i + j * ldc];
                }
            assert_memory_equal(C, R, sizeof C); /* rows past m untouched too */
            /* lda below the rows of A as stored is refused */
            assert_int_equal(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, dA, m - 1,
                                         dB, ldb, &beta, dC, ldc),
                             CUBLAS_STATUS_INVALID_VALUE);
            cudaFree(dA);
            cudaFree(dB);
            cudaFree(dC);
        }
    assert_true(gpu_emu_reports() > 0);
    cublasDestroy(h);
}

/* The emulator's conversion headers against the cpu backend's (ggml's
 * rules): every f16 value, and floats around every rounding boundary. */
static void test_conversions(void **state)
{
    enum { M = 1 << 16 };
    static float in[M * 3];
    static uint16_t got[M * 3];
    size_t n = 0;
    for (uint32_t h = 0; h < M; h++) {
        float f = kvd_emu_f16_to_f32((uint16_t)h);
        if (!isnan(f) && half_to_float((uint16_t)h) != f)
            fail_msg("f16 0x%04x: emulator %a, cpu %a", h, (double)f,
                     (double)half_to_float((uint16_t)h));
        if (isnan(f))
            continue;
        in[n++] = f;
        in[n++] = nextafterf(f, INFINITY);
        in[n++] = nextafterf(f, -INFINITY);
    }
    kvd_emu_to_f16(in, got, n);
    for (size_t i = 0; i < n; i++)
        if (got[i] != float_to_half(in[i]))
            fail_msg("to f16 of %a: emulator 0x%04x, cpu 0x%04x", (double)in[i], got[i],
                     float_to_half(in[i]));
    kvd_emu_to_bf16(in, got, n);
    for (size_t i = 0; i < n; i++)
        if (got[i] != float_to_bf16(in[i]))
            fail_msg("to bf16 of %a: emulator 0x%04x, cpu 0x%04x", (double)in[i], got[i],
                     float_to_bf16(in[i]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_barrier_faults), cmocka_unit_test(test_warp_faults),
        cmocka_unit_test(test_memory_faults),  cmocka_unit_test(test_pdl),
        cmocka_unit_test(test_order_check),    cmocka_unit_test(test_correct_kernels),
        cmocka_unit_test(test_launch_limits),  cmocka_unit_test(test_capture_rules),
        cmocka_unit_test(test_memory_api),     cmocka_unit_test(test_cublas_reference),
        cmocka_unit_test(test_conversions),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
