// The warp-level matrix instructions of the emulator (kvd_simt_mma.h):
// mma.m16n8k16 (f16/bf16 in, f32 accumulate), mma.m16n8k32 and m16n8k16
// (s8 in, s32 accumulate) and ldmatrix.m8n8, computed for
// the whole warp at once from the 32 lanes' registers, with the fragment
// layouts of the PTX ISA. g = lane >> 2 (groupID), t = lane & 3
// (threadID_in_group); each 32-bit register holds two 16-bit elements, the
// lower-numbered one in the low half:
//   A 16x16:  a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]
//             a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B 16x8:   b[0] = B[2t, 2t+1][g]     b[1] = B[2t+8, 2t+9][g]
//   C/D 16x8: c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
//   s8, k = 32 (each register four 8-bit elements, the lowest-numbered in
//   the low byte):
//             a[0] = A[g][4t .. 4t+3]        a[1] = A[g+8][4t .. 4t+3]
//             a[2] = A[g][16+4t .. 16+4t+3]  a[3] = A[g+8][16+4t .. 16+4t+3]
//             b[0] = B[4t .. 4t+3][g]        b[1] = B[16+4t .. 16+4t+3][g]
//   s8, k = 16: a[0] = A[g][4t .. 4t+3]  a[1] = A[g+8][4t .. 4t+3]
//             b[0] = B[4t .. 4t+3][g]
//   s32 C/D as f32's.
//   ldmatrix: r[m] = matrix m's row g, columns 2t, 2t+1; with .trans, its
//             column g, rows 2t, 2t+1 (row i of matrix m at lane 8m + i's
//             address).
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "emu_internal.h"
#include "kvd_simt_mma.h"

namespace
{

float half_lo(uint32_t w, bool bf16)
{
    uint16_t h = (uint16_t)(w & 0xffffu);
    return bf16 ? __bfloat162float(__ushort_as_bfloat16(h)) : __half2float(__ushort_as_half(h));
}

float half_hi(uint32_t w, bool bf16)
{
    return half_lo(w >> 16, bf16);
}

void mma(kvd_emu_collective *const *lanes, bool bf16)
{
    kvd_emu::count_mma_f16();
    float A[16][16], B[16][8], C[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const kvd_emu_mma_lane *l = static_cast<const kvd_emu_mma_lane *>(lanes[lane]);
        const int g = lane >> 2, t = lane & 3;
        for (int r = 0; r < 4; r++) {
            const int row = g + (r & 1) * 8, col = 2 * t + (r >> 1) * 8;
            A[row][col] = half_lo(l->a[r], bf16);
            A[row][col + 1] = half_hi(l->a[r], bf16);
        }
        for (int r = 0; r < 2; r++) {
            B[2 * t + r * 8][g] = half_lo(l->b[r], bf16);
            B[2 * t + r * 8 + 1][g] = half_hi(l->b[r], bf16);
        }
        for (int i = 0; i < 4; i++)
            C[g + (i >> 1) * 8][2 * t + (i & 1)] = l->c[i];
    }
    for (int lane = 0; lane < 32; lane++) {
        kvd_emu_mma_lane *l = static_cast<kvd_emu_mma_lane *>(lanes[lane]);
        const int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; i++) {
            const int row = g + (i >> 1) * 8, col = 2 * t + (i & 1);
            // Products of 16-bit floats are exact in double; the sum of
            // seventeen terms rounds at most in double's last bits.
            double s = C[row][col];
            for (int k = 0; k < 16; k++)
                s += (double)A[row][k] * (double)B[k][col];
            l->d[i] = (float)s;
        }
    }
}

int8_t s8_at(uint32_t w, int i)
{
    return (int8_t)(uint8_t)(w >> (8 * i));
}

void mma_s8(kvd_emu_collective *const *lanes, int K)
{
    int A[16][32], B[32][8], C[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const kvd_emu_mma_s8_lane *l = static_cast<const kvd_emu_mma_s8_lane *>(lanes[lane]);
        const int g = lane >> 2, t = lane & 3;
        for (int r = 0; r < K / 8; r++) { // 4 A registers at k = 32, 2 at k = 16
            const int row = g + (r & 1) * 8, col = 4 * t + (r >> 1) * 16;
            for (int i = 0; i < 4; i++)
                A[row][col + i] = s8_at(l->a[r], i);
        }
        for (int r = 0; r < K / 16; r++)
            for (int i = 0; i < 4; i++)
                B[4 * t + 16 * r + i][g] = s8_at(l->b[r], i);
        for (int i = 0; i < 4; i++)
            C[g + (i >> 1) * 8][2 * t + (i & 1)] = l->c[i];
    }
    for (int lane = 0; lane < 32; lane++) {
        kvd_emu_mma_s8_lane *l = static_cast<kvd_emu_mma_s8_lane *>(lanes[lane]);
        const int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; i++) {
            const int row = g + (i >> 1) * 8, col = 2 * t + (i & 1);
            // wrapping s32 arithmetic, as the hardware's without .satfinite
            uint32_t s = (uint32_t)C[row][col];
            for (int k = 0; k < K; k++)
                s += (uint32_t)(A[row][k] * B[k][col]);
            l->d[i] = (int32_t)s;
        }
    }
}

} // namespace

void kvd_emu_mma_s8_k32(kvd_emu_collective *const *lanes)
{
    mma_s8(lanes, 32);
}

void kvd_emu_mma_s8_k16(kvd_emu_collective *const *lanes)
{
    mma_s8(lanes, 16);
}

void kvd_emu_mma_f16(kvd_emu_collective *const *lanes)
{
    mma(lanes, false);
}

void kvd_emu_mma_bf16(kvd_emu_collective *const *lanes)
{
    mma(lanes, true);
}

void kvd_emu_ldsm(kvd_emu_collective *const *lanes)
{
    const kvd_emu_ldsm_lane *l0 = static_cast<const kvd_emu_ldsm_lane *>(lanes[0]);
    const int count = l0->count;
    const bool trans = l0->trans;
    // The matrices as 16-bit elements: M[m][row][col].
    uint16_t M[4][8][8];
    for (int m = 0; m < count; m++)
        for (int i = 0; i < 8; i++) {
            const kvd_emu_ldsm_lane *src = static_cast<const kvd_emu_ldsm_lane *>(lanes[8 * m + i]);
            for (int w = 0; w < 4; w++) {
                M[m][i][2 * w] = (uint16_t)(src->row[w] & 0xffffu);
                M[m][i][2 * w + 1] = (uint16_t)(src->row[w] >> 16);
            }
        }
    for (int lane = 0; lane < 32; lane++) {
        kvd_emu_ldsm_lane *l = static_cast<kvd_emu_ldsm_lane *>(lanes[lane]);
        const int g = lane >> 2, t = lane & 3;
        for (int m = 0; m < count; m++) {
            uint16_t lo, hi;
            if (trans) {
                lo = M[m][2 * t][g];
                hi = M[m][2 * t + 1][g];
            } else {
                lo = M[m][g][2 * t];
                hi = M[m][g][2 * t + 1];
            }
            l->r[m] = (uint32_t)lo | (uint32_t)hi << 16;
        }
    }
}
