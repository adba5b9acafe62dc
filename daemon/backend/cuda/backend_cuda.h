/* backend_cuda: the state the cuda backend shares between its memory/copy
 * half (backend_cuda.c) and its compute half (compute_cuda*.c): the device,
 * the compute and copy streams, the cuBLAS handle. CUDA builds only. */
#ifndef KVD_CUDA_BACKEND_H
#define KVD_CUDA_BACKEND_H

#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "compute.h"

struct cuda_dev {
    int device;               /* CUDA ordinal */
    char name[256];           /* cudaDeviceProp.name */
    int n_sms;                /* multiprocessors (launch-geometry heuristics) */
    size_t total_mem;         /* bytes of device memory */
    cudaStream_t compute;     /* every compute op, in issue order */
    cudaStream_t copy;        /* swaps and copies: overlaps compute */
    cudaEvent_t compute_mark; /* recorded on compute before a copy is queued */
    cudaEvent_t copy_done;    /* recorded on copy after each copy_async */
    cublasHandle_t blas;      /* bound to the compute stream */
    void *blas_ws;            /* its workspace: fixed, so captures never allocate */
    /* Guards `capturing` and the compute-stream event that copies wait on:
     * a copy queued from another thread (the server's loop) must not touch
     * the compute stream while the executor captures a graph on it. */
    pthread_mutex_t mu;
    bool capturing;
    /* Bumped by every free of device memory on this device (a KV arena, a
     * compute context's buffer, scratch or dequant tile): a CUDA graph holds
     * raw addresses, so a compute context whose graphs were captured at an
     * older count drops them all before its next step (compute_cuda.c). */
    _Atomic uint64_t frees;
    /* The elastic arenas (the KV pools: backend_cuda.c), found by base
     * under ranges_mu: several pools, each under its own kvmm lock, map
     * and unmap pages at once. vmm_gran: the device's allocation
     * granularity (0 before the first ask). */
    pthread_mutex_t ranges_mu;
    struct cuda_vrange *ranges;
    size_t vmm_gran;
};
/* Counts a free of device memory (above). */
void cuda_dev_note_free(struct cuda_dev *dev);
/* Graph capture on dev->compute: begin/end under dev->mu. */
int cuda_dev_capture_begin(struct cuda_dev *dev);
/* Makes the compute stream wait for every copy queued so far (before a
 * step's work is issued, never inside a capture): with copy_async waiting
 * for the compute issued before it, the two streams are ordered both ways. */
int cuda_dev_wait_copies(struct cuda_dev *dev);
int cuda_dev_capture_end(struct cuda_dev *dev, cudaGraph_t *graph);

/* The cuda state of a backend made by backend_cuda_new (NULL for others). */
struct cuda_dev *cuda_backend_dev(struct backend *be);
/* Makes dev the calling thread's current device (the executor thread is not
 * the one that created the backend). 0 or KVD_EINTERNAL. */
int cuda_dev_enter(struct cuda_dev *dev);
/* Logs a failed CUDA/cuBLAS call and returns KVD_EINTERNAL (KVD_ENOMEM for
 * cudaErrorMemoryAllocation). */
int cuda_fail(int cuda_err, const char *what);
int cublas_fail(int status, const char *what);

/* The cuda compute ops (compute_cuda.c). */
const struct compute_ops *compute_cuda_ops(void);

#endif
