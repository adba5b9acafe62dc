// The fused GEMV's instances for Q4_0, Q4_1, Q5_0 and Q5_1 weights. One file per group of
// types so that a parallel build shares out their compile time
// (gemv_fused.cuh).
#include "gemv_fused.cuh"

GF_INSTANTIATE(KVD_KW_Q4_0, KVD_KW_Q4_0)
GF_INSTANTIATE(KVD_KW_Q4_1, KVD_KW_Q4_1)
GF_INSTANTIATE(KVD_KW_Q5_0, KVD_KW_Q5_0)
GF_INSTANTIATE(KVD_KW_Q5_1, KVD_KW_Q5_1)
