// Occupancy of a kernel instance (internal, CUDA C++ only): the blocks that
// fit on one multiprocessor, for launch heuristics. nvcc: the runtime's
// cudaOccupancyMaxActiveBlocksPerMultiprocessor. Emulation build: computed
// by kernels/emu/occupancy.cc from ptxas's register and shared-memory counts
// for the instance (kernels/emu/ptxas_sm90.inc), which `instance` names as
// c++filt prints it ("attn_decode_kernel<128, 1, 8>").
#ifndef KVD_OCCUPANCY_CUH
#define KVD_OCCUPANCY_CUH

#include "kernel_util.cuh"

#ifdef KVD_CUDA_EMULATE
#include "kvd_emu_occupancy.h"
#endif

template <class K>
static inline int kvd_occupancy(int *blocks, K *kernel, const char *instance, int threads,
                                size_t dyn_smem)
{
#ifdef KVD_CUDA_EMULATE
    (void)kernel;
    return (int)kvd_emu_occupancy(blocks, instance, threads, dyn_smem);
#else
    (void)instance;
    return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, dyn_smem);
#endif
}

#endif
