// The fused GEMV's instances for Q5_K weights, and for Q5_K with Q6_K in
// one launch. One file per group of types so that a parallel build shares
// out their compile time (gemv_fused.cuh).
#include "gemv_fused.cuh"

GF_INSTANTIATE(KVD_KW_Q5_K, KVD_KW_Q5_K)
GF_INSTANTIATE(KVD_KW_Q5_K, KVD_KW_Q6_K)
