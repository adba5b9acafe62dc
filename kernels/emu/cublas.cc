// Reference cuBLAS for the emulation build (include/cublas_v2.h): the GEMMs
// kvd calls, column-major with cuBLAS's transposition and leading-dimension
// rules, f32 accumulation. Each call checks its arguments as cuBLAS does,
// that every matrix lies inside a live device allocation, and that the
// workspace set on the handle is still one (a freed workspace is the
// classic use-after-free of a shared handle).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <string.h>

#include "emu_internal.h"

struct cublasContext {
    cudaStream_t stream;
    void *ws;
    size_t ws_bytes;
};

namespace
{

using kvd_emu::report;

float load(const void *p, cudaDataType t, size_t i)
{
    switch (t) {
    case CUDA_R_32F:
        return ((const float *)p)[i];
    case CUDA_R_16BF:
        return __bfloat162float(__ushort_as_bfloat16(((const uint16_t *)p)[i]));
    default:
        return __half2float(__ushort_as_half(((const uint16_t *)p)[i]));
    }
}

size_t elem_bytes(cudaDataType t)
{
    return t == CUDA_R_32F ? 4 : 2;
}

bool type_ok(cudaDataType t)
{
    return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F;
}

// The matrix of `rows` x `cols` (as stored, column-major with ld) inside
// one live device allocation.
bool matrix_ok(const char *api, const char *name, const void *p, cudaDataType t, int rows, int cols,
               int ld)
{
    if (rows == 0 || cols == 0)
        return true;
    size_t bytes = ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * elem_bytes(t);
    kvd_emu::alloc_info a = kvd_emu::find_alloc(p, bytes);
    if (a.kind != kvd_emu::ALLOC_DEVICE) {
        char buf[160];
        kvd_emu::describe(p, buf, sizeof buf);
        report("%s: matrix %s (%d x %d, ld %d) is not inside one device allocation (%s)", api, name,
               rows, cols, ld, buf);
        return false;
    }
    return true;
}

bool workspace_ok(const void *ws, size_t ws_bytes, const char *api)
{
    if (!ws)
        return true; // cuBLAS's own pool
    kvd_emu::alloc_info a = kvd_emu::find_alloc(ws, ws_bytes);
    if (a.kind != kvd_emu::ALLOC_DEVICE) {
        report("%s: the workspace set on the handle (%p, %zu bytes) is no longer a live device "
               "allocation (freed after cublasSetWorkspace?)",
               api, ws, ws_bytes);
        return false;
    }
    return true;
}

cublasStatus_t gemm(cublasHandle_t h, const char *api, cublasOperation_t ta, cublasOperation_t tb,
                    int m, int n, int k, float alpha, const void *A, cudaDataType at, int lda,
                    const void *B, cudaDataType bt, int ldb, float beta, void *C, cudaDataType ct,
                    int ldc)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) ||
        (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T) || !type_ok(at) || !type_ok(bt) ||
        (ct != CUDA_R_32F) || lda < (ta == CUBLAS_OP_N ? (m > 1 ? m : 1) : (k > 1 ? k : 1)) ||
        ldb < (tb == CUBLAS_OP_N ? (k > 1 ? k : 1) : (n > 1 ? n : 1)) || ldc < (m > 1 ? m : 1)) {
        report("%s: invalid arguments (m %d n %d k %d lda %d ldb %d ldc %d)", api, m, n, k, lda,
               ldb, ldc);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    // op(A) is m x k: A is m x k (N) or k x m (T) as stored.
    int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
    int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
    // The workspace in use is fixed at the call (a captured graph keeps it).
    cudaStream_t stream = h->stream;
    void *ws = h->ws;
    size_t ws_bytes = h->ws_bytes;
    cudaError_t e = kvd_emu::submit(stream, [=]() {
        kvd_emu::count_launch(); // one GEMM, one launch (the real library may make more)
        kvd_emu::note_device_op();
        if (!workspace_ok(ws, ws_bytes, api) || !matrix_ok(api, "A", A, at, ar, ac, lda) ||
            !matrix_ok(api, "B", B, bt, br, bc, ldb) || !matrix_ok(api, "C", C, ct, m, n, ldc))
            return cudaErrorIllegalAddress;
        float *c = (float *)C;
        for (int j = 0; j < n; j++) {
            for (int i = 0; i < m; i++) {
                float acc = 0.0f;
                for (int l = 0; l < k; l++) {
                    size_t ai = ta == CUBLAS_OP_N ? (size_t)i + (size_t)l * lda
                                                  : (size_t)l + (size_t)i * lda;
                    size_t bi = tb == CUBLAS_OP_N ? (size_t)l + (size_t)j * ldb
                                                  : (size_t)j + (size_t)l * ldb;
                    acc += load(A, at, ai) * load(B, bt, bi);
                }
                float *out = &c[(size_t)i + (size_t)j * ldc];
                // beta == 0: C is not read (it may hold NaN), as in cuBLAS.
                *out = beta == 0.0f ? alpha * acc : alpha * acc + beta * *out;
            }
        }
        return cudaSuccess;
    });
    return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

} // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t *handle)
{
    *handle = new cublasContext{nullptr, nullptr, 0};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle)
{
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream)
{
    if (!handle)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void *workspace, size_t bytes)
{
    if (!handle)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (workspace && kvd_emu::find_alloc(workspace, bytes).kind != kvd_emu::ALLOC_DEVICE) {
        report("cublasSetWorkspace: %p (%zu bytes) is not a device allocation", workspace, bytes);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    handle->ws = workspace;
    handle->ws_bytes = workspace ? bytes : 0;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc)
{
    return gemm(handle, "cublasSgemm", transa, transb, m, n, k, *alpha, A, CUDA_R_32F, lda, B,
                CUDA_R_32F, ldb, *beta, C, CUDA_R_32F, ldc);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo)
{
    (void)algo;
    if (computeType != CUBLAS_COMPUTE_32F) {
        report("cublasGemmEx: compute type %d not emulated", (int)computeType);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    // With CUBLAS_COMPUTE_32F, alpha and beta are floats on the host.
    return gemm(handle, "cublasGemmEx", transa, transb, m, n, k, *(const float *)alpha, A, Atype,
                lda, B, Btype, ldb, *(const float *)beta, C, Ctype, ldc);
}

} // extern "C"
