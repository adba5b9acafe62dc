// The fused GEMV's instances for F32, F16, BF16 and Q8_0 weights. One file per group of
// types so that a parallel build shares out their compile time
// (gemv_fused.cuh).
#include "gemv_fused.cuh"

GF_INSTANTIATE(KVD_KW_F32, KVD_KW_F32)
GF_INSTANTIATE(KVD_KW_F16, KVD_KW_F16)
GF_INSTANTIATE(KVD_KW_BF16, KVD_KW_BF16)
GF_INSTANTIATE(KVD_KW_Q8_0, KVD_KW_Q8_0)
