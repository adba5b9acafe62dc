// Occupancy in the emulation build (C++ only, used through
// kernels/occupancy.cuh): the blocks of a kernel instance that fit on one
// multiprocessor of the emulated device, computed as the CUDA runtime's
// cudaOccupancyMaxActiveBlocksPerMultiprocessor does, from the registers and
// static shared memory ptxas gives that instance for sm_90
// (kernels/emu/ptxas_sm90.inc, made by tests/gpu/ptxas_report.sh --table).
#ifndef KVD_EMU_OCCUPANCY_H
#define KVD_EMU_OCCUPANCY_H

#include <stddef.h>

#include "cuda_runtime.h"

// *blocks for `instance` (the kernel's name with its template arguments, as
// c++filt prints it: "attn_decode_kernel<128, 1, 8>") launched with
// `threads` threads and `dyn_smem` bytes of dynamic shared memory. An
// instance missing from the table is reported (cudaErrorInvalidValue): the
// table is stale.
cudaError_t kvd_emu_occupancy(int *blocks, const char *instance, int threads, size_t dyn_smem);
// The table's registers per thread and static shared memory for
// `instance`; false if it has none.
bool kvd_emu_ptxas_info(const char *instance, int *regs, size_t *static_smem);

#endif
