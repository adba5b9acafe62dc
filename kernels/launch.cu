// Launch bookkeeping shared by every kernels/*.cu file: the per-thread count
// of kernel launches (kernels.h kvd_k_launches), which the cuda backend reads
// around a step to report how many kernels one decode step runs.
#include "kernel_util.cuh"

thread_local unsigned long long kvd_launch_count;

extern "C" unsigned long long kvd_k_launches(void)
{
    return kvd_launch_count;
}
