// The fused GEMV's instances for Q4_K weights, and for Q4_K with Q6_K in
// one launch (a Q4_K_M layer's q and k, then v). One file per group of
// types so that a parallel build shares out their compile time
// (gemv_fused.cuh).
#include "gemv_fused.cuh"

GF_INSTANTIATE(KVD_KW_Q4_K, KVD_KW_Q4_K)
GF_INSTANTIATE(KVD_KW_Q4_K, KVD_KW_Q6_K)
