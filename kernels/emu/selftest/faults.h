/* Kernels with the defects the emulator must find (tests/gpu/test_emu.c),
 * and a few correct ones it must pass. Emulation builds only. Each
 * launcher returns the launch's status (0 or a cudaError_t). */
#ifndef KVD_EMU_FAULTS_H
#define KVD_EMU_FAULTS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kvd_fault {
    KVD_FAULT_NONE, /* a block reduction done right: out[0] = sum of in */
    KVD_FAULT_EXIT_BEFORE_BARRIER,
    KVD_FAULT_TWO_BARRIERS, /* odd and even threads wait at different __syncthreads */
    KVD_FAULT_MASK_WITHOUT_SELF,
    KVD_FAULT_SHFL_OUTSIDE_MASK,
    KVD_FAULT_SHFL_EXITED_LANE,
    KVD_FAULT_SHARED_RAW,    /* reads a neighbour's write without a barrier */
    KVD_FAULT_SHARED_WAW,    /* every thread writes one word */
    KVD_FAULT_SHARED_WAR,    /* writes a word others read since the barrier */
    KVD_FAULT_SHARED_UNINIT, /* reads shared memory nobody wrote */
    KVD_FAULT_GLOBAL_OOB,    /* writes one float past its buffer */
    KVD_FAULT_GLOBAL_RACE,   /* every thread of every block writes out[0] */
    KVD_FAULT_ATOMIC_OK,     /* shared atomics: no race, exact count */
    KVD_FAULT_BIG_DYN_SMEM,  /* 64 KiB of dynamic shared memory without the opt-in */
    KVD_FAULT_WARP_WAR,      /* a lane writes a word its warp's neighbour read, no __syncwarp */
    KVD_FAULT_WARP_WAR_OK,   /* the same with a __syncwarp between: no race */
    /* Programmatic dependent launch: a kernel writes out, the next one (launched
     * with KVD_LAUNCH_PDL) ... */
    KVD_FAULT_PDL_EARLY_READ,    /* reads out before kvd_pdl_wait */
    KVD_FAULT_PDL_EARLY_WRITE,   /* writes before kvd_pdl_wait */
    KVD_FAULT_PDL_EARLY_TRIGGER, /* triggers its dependents before its wait */
    KVD_FAULT_PDL_OK,            /* reads `in` before its wait, out after: correct */
};

/* One launch of the fault's kernel on `n` threads (one block unless noted)
 * over device buffers in [n] and out [n + 1] floats. */
int kvd_fault_run(enum kvd_fault f, const float *in, float *out, int n, void *stream);

/* __float2half_rn / __float2bfloat16_rn of the emulator's headers, on the
 * host, for the conversion tests. */
void kvd_emu_to_f16(const float *in, uint16_t *out, size_t n);
void kvd_emu_to_bf16(const float *in, uint16_t *out, size_t n);
float kvd_emu_f16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif
#endif
