// The fused GEMV's instances for Q6_K weights. One file per group of
// types so that a parallel build shares out their compile time
// (gemv_fused.cuh).
#include "gemv_fused.cuh"

GF_INSTANTIATE(KVD_KW_Q6_K, KVD_KW_Q6_K)
