// One warp through the tensor-core building blocks of mma.cuh, for the
// fragment-layout tests (tests/gpu/test_gpu_attn.c): on a device they show
// the hardware's layouts equal the ones the kernels (and the emulator,
// kernels/emu/mma.cc) assume; on the emulator, that it computes them.
#include "mma.cuh"

#define MC_LD 16 // shared row stride of the check's matrices, 16-bit elements (32 bytes)

template <bool BF16>
__global__ void mma_check_kernel(float *d, uint32_t *ldsm, const uint16_t *__restrict__ a,
                                 const uint16_t *__restrict__ b, const float *__restrict__ c,
                                 const uint16_t *__restrict__ mats)
{
    // A [16][16] and B^T [8][16] (rows of B's columns) and B [16][8] and the
    // four 8x8 matrices, each row 16-byte aligned.
    KVD_SHARED(uint4, sa_raw, [16 * MC_LD / 8]);
    KVD_SHARED(uint4, sbt_raw, [8 * MC_LD / 8]);
    KVD_SHARED(uint4, sb_raw, [16 * MC_LD / 8]);
    KVD_SHARED(uint4, sm_raw, [4 * 8 * MC_LD / 8]);
    uint16_t *sa = (uint16_t *)sa_raw, *sbt = (uint16_t *)sbt_raw, *sb = (uint16_t *)sb_raw;
    uint16_t *sm = (uint16_t *)sm_raw;
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;

    // Stored two elements (one 32-bit word) at a time: the racecheck works
    // on words.
    for (int i = 2 * lane; i < 16 * 16; i += 64)
        *(uint32_t *)(sa + (i / 16) * MC_LD + i % 16) = a[i] | (uint32_t)a[i + 1] << 16;
    for (int i = 2 * lane; i < 16 * 8; i += 64) {
        const int k = i / 8, n = i % 8, kt = (i / 2) % 8 * 2, nt = (i / 2) / 8;
        *(uint32_t *)(sb + k * MC_LD + n) = b[i] | (uint32_t)b[i + 1] << 16;
        *(uint32_t *)(sbt + nt * MC_LD + kt) = b[kt * 8 + nt] | (uint32_t)b[(kt + 1) * 8 + nt]
                                                                    << 16;
    }
    for (int i = 2 * lane; i < 4 * 8 * 8; i += 64)
        *(uint32_t *)(sm + (i / 8) * MC_LD + i % 8) = mats[i] | (uint32_t)mats[i + 1] << 16;
    __syncwarp(0xffffffffu);

    // 0: fragments built from the matrices by the PTX layout, element by
    // element.
    uint32_t fa[4], fb[2];
    float fc[4], fd[4];
    for (int r = 0; r < 4; r++) {
        const int row = g + (r & 1) * 8, col = 2 * t + (r >> 1) * 8;
        fa[r] = (uint32_t)a[row * 16 + col] | (uint32_t)a[row * 16 + col + 1] << 16;
    }
    for (int r = 0; r < 2; r++) {
        const int k = 2 * t + r * 8;
        fb[r] = (uint32_t)b[k * 8 + g] | (uint32_t)b[(k + 1) * 8 + g] << 16;
    }
    for (int i = 0; i < 4; i++)
        fc[i] = c[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)];
    kvd_mma16816<BF16>(fd, fa, fb, fc);
    for (int i = 0; i < 4; i++)
        d[lane * 4 + i] = fd[i];

    // 1: A by ldmatrix.x4 (rows 0-7 / 8-15 x columns 0-7 / 8-15), B from
    // B^T's rows by ldmatrix.x2 (as attention's K tile is read).
    uint32_t la[4], lb[2];
    kvd_ldsm<4, false>(la, sa + (lane & 15) * MC_LD + (lane >> 4) * 8);
    kvd_ldsm<2, false>(lb, sbt + (lane & 7) * MC_LD + ((lane >> 3) & 1) * 8);
    kvd_mma16816<BF16>(fd, la, lb, fc);
    for (int i = 0; i < 4; i++)
        d[128 + lane * 4 + i] = fd[i];

    // 2: B from B's rows by ldmatrix.x2.trans (as attention's V tile is read).
    kvd_ldsm<2, true>(lb, sb + (lane & 15) * MC_LD);
    kvd_mma16816<BF16>(fd, la, lb, fc);
    for (int i = 0; i < 4; i++)
        d[256 + lane * 4 + i] = fd[i];

    // ldmatrix alone: lane 8m + i addresses row i of matrix m.
    const uint16_t *row = sm + lane * MC_LD;
    uint32_t r[4] = {0, 0, 0, 0};
    kvd_ldsm<1, false>(r, row);
    ldsm[(0 * 32 + lane) * 4] = r[0];
    kvd_ldsm<2, false>(r, row);
    for (int m = 0; m < 2; m++)
        ldsm[(1 * 32 + lane) * 4 + m] = r[m];
    kvd_ldsm<4, false>(r, row);
    for (int m = 0; m < 4; m++)
        ldsm[(2 * 32 + lane) * 4 + m] = r[m];
    kvd_ldsm<1, true>(r, row);
    ldsm[(3 * 32 + lane) * 4] = r[0];
    kvd_ldsm<2, true>(r, row);
    for (int m = 0; m < 2; m++)
        ldsm[(4 * 32 + lane) * 4 + m] = r[m];
    kvd_ldsm<4, true>(r, row);
    for (int m = 0; m < 4; m++)
        ldsm[(5 * 32 + lane) * 4 + m] = r[m];
}

extern "C" int kvd_k_mma_check(float *d, uint32_t *ldsm, const uint16_t *a, const uint16_t *b,
                               const float *c, const uint16_t *mats, int bf16, kvd_stream stream)
{
    if (bf16)
        KVD_LAUNCH(1, 32, 0, stream, mma_check_kernel<true>)(d, ldsm, a, b, c, mats);
    else
        KVD_LAUNCH(1, 32, 0, stream, mma_check_kernel<false>)(d, ldsm, a, b, c, mats);
    return kvd_launch_status();
}

// The int8 mma (m16n8k32, then m16n8k16 on the first 16 columns of A and
// rows of B) with fragments built element by element from the PTX layout:
// a [16][32], b [32][8] (int8), c [16][8]; d [2][32 lanes][4].
__global__ void mma_s8_check_kernel(int *d, const int8_t *__restrict__ a,
                                    const int8_t *__restrict__ b, const int *__restrict__ c)
{
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    auto pack = [](const int8_t *p, int stride) {
        uint32_t w = 0;
        for (int i = 0; i < 4; i++)
            w |= (uint32_t)(uint8_t)p[i * stride] << (8 * i);
        return w;
    };
    uint32_t fa[4], fb[2];
    int fc[4], fd[4];
    for (int r = 0; r < 4; r++)
        fa[r] = pack(a + (g + (r & 1) * 8) * 32 + 4 * t + (r >> 1) * 16, 1);
    for (int r = 0; r < 2; r++)
        fb[r] = pack(b + (4 * t + 16 * r) * 8 + g, 8);
    for (int i = 0; i < 4; i++)
        fc[i] = c[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)];
    kvd_mma_s8<32>(fd, fa, fb, fc);
    for (int i = 0; i < 4; i++)
        d[lane * 4 + i] = fd[i];
    kvd_mma_s8<16>(fd, fa, fb, fc); // a[0], a[1]: columns 0..15; b[0]: rows 0..15
    for (int i = 0; i < 4; i++)
        d[128 + lane * 4 + i] = fd[i];
}

extern "C" int kvd_k_mma_s8_check(int *d, const int8_t *a, const int8_t *b, const int *c,
                                  kvd_stream stream)
{
    KVD_LAUNCH(1, 32, 0, stream, mma_s8_check_kernel)(d, a, b, c);
    return kvd_launch_status();
}
