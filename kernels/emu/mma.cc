// The warp-level matrix instructions of the emulator (kvd_simt_mma.h):
// mma.m16n8k16 (f16/bf16 in, f32 accumulate) and ldmatrix.m8n8, computed for
// the whole warp at once from the 32 lanes' registers, with the fragment
// layouts of the PTX ISA. g = lane >> 2 (groupID), t = lane & 3
// (threadID_in_group); each 32-bit register holds two 16-bit elements, the
// lower-numbered one in the low half:
//   A 16x16:  a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]
//             a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B 16x8:   b[0] = B[2t, 2t+1][g]     b[1] = B[2t+8, 2t+9][g]
//   C/D 16x8: c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
//   ldmatrix: r[m] = matrix m's row g, columns 2t, 2t+1; with .trans, its
//             column g, rows 2t, 2t+1 (row i of matrix m at lane 8m + i's
//             address).
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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

} // namespace

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
