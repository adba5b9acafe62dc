/* The op cases every backend's op test runs, as ggml's test-backend-ops
 * does: one list of weight types and (in, out, rows) shapes, so a case
 * added for one backend runs on the other too. test_cpu_ops checks the cpu
 * backend against double-precision references of these cases (and keeps
 * its own sweeps of the cpu's group sizes); test_gpu_ops checks the cuda
 * backend against the cpu backend on the same cases. */
#ifndef KVD_TEST_OP_CASES_H
#define KVD_TEST_OP_CASES_H

#include <stddef.h>
#include <stdint.h>

#include "kv_types.h"

#define OP_CASES_N(a) (sizeof(a) / sizeof((a)[0]))

/* Weight types with a float (or q8_0) matmul: packed on the cpu, a bf16
 * copy for the cuda GEMMs. */
static const enum ctype op_float_types[] = {CT_F32, CT_F16, CT_BF16, CT_Q8_0};
/* The block-quantized types whose matmul quantizes the activations. */
static const enum ctype op_quant_types[] = {CT_Q4_0, CT_Q4_1, CT_Q5_0, CT_Q5_1,
                                            CT_Q4_K, CT_Q5_K, CT_Q6_K};

struct op_mm_case {
    uint32_t in, out, rows;
};

/* Float-type matmuls: GEMV-sized (rows <= 8) and GEMM-sized row counts,
 * `in` aligned and not (q8_0 takes only whole 32-element blocks), `out`
 * around the cpu's packed group of 16. */
static const struct op_mm_case op_matmul_cases[] = {
    {64, 48, 1},    {256, 130, 3},   {512, 96, 8}, {256, 64, 9}, {1024, 200, 33},
    {96, 20, 2},    {2048, 2048, 1}, {40, 24, 2},  {64, 16, 4},  {96, 17, 7},
    {256, 130, 16}, {40, 3, 29},     {800, 48, 5},
};

/* Quantized matmuls: `in` whole super-blocks (256) so every type takes
 * them; up to 8 rows the quantized GEMV, above the GEMM paths. */
static const struct op_mm_case op_qmatmul_cases[] = {
    {256, 40, 1},  {512, 67, 3},  {2048, 96, 8}, {768, 24, 5},
    {512, 130, 9}, {256, 70, 33}, {256, 7, 2},   {768, 17, 16},
};

/* rmsnorm: rows x n, n aligned and not. */
static const uint32_t op_rmsnorm_cases[][2] = {{1, 64}, {5, 2048}, {3, 4097}, {17, 896}};

#endif
