// The plane layout of a quantized weight matrix on the cuda backend
// (CL_PLANES, internal, CUDA C++ only). The file's blocks interleave fields
// of 2, 4, 12, 16 and 128 bytes in blocks of 18 to 210 bytes, so a lane's
// loads of one block are only 2-byte aligned (Q4_0, Q5_0, Q8_0, Q6_K); at
// load the matrix is rewritten, same bytes in all, with each field of every
// block in a run of its own (a "plane"), so every unit a GEMV lane reads is
// one or two 16-byte loads at consecutive addresses across lanes:
//
//   type  planes (bytes per block, in order)       file block (quant.cuh)
//   Q4_0  qs 16, d 2                                d qs
//   Q4_1  qs 16, dm 4 (d, m)                        d m qs
//   Q5_0  qs 16, qh 4, d 2                          d qh qs
//   Q5_1  qs 16, qh 4, dm 4                         d m qh qs
//   Q8_0  qs 32, d 2                                d qs
//   Q4_K  head 16 (d, dmin, scales), qs 128         head qs
//   Q5_K  head 16, qh 32, qs 128                    head qh qs
//   Q6_K  ql 128, qh 64, sc 16, d 2                 ql qh sc d
//
// A plane holds [rows][blocks of a row][bytes] and starts where the one
// before ends (16-byte multiples first, so every plane is aligned to its
// entry). Q6_K's ql and sc are stored quarter by quarter: quarter v of a
// super-block (h = v / 2, l0 = 16 (v % 2); the 64 values 128h + 32k + l0 +
// l, k < 4, l < 16) has its 32 ql bytes ql[64h + l0 ..+16], ql[64h + 32 +
// l0 ..+16] at 32v, and its four scales sc[8h + l0/16 + 2k] at 4v; its 16 qh
// bytes qh[32h + l0 ..+16] are already at 16v.
#ifndef KVD_PLANES_CUH
#define KVD_PLANES_CUH

#include "quant.cuh"

// Bytes per block of plane f of type WT (0 past the last plane).
static __host__ __device__ constexpr int kvd_pl_size(int wt, int f)
{
    return wt == KVD_KW_Q4_0   ? (f == 0   ? 16
                                  : f == 1 ? 2
                                           : 0)
           : wt == KVD_KW_Q4_1 ? (f == 0   ? 16
                                  : f == 1 ? 4
                                           : 0)
           : wt == KVD_KW_Q5_0 ? (f == 0   ? 16
                                  : f == 1 ? 4
                                  : f == 2 ? 2
                                           : 0)
           : wt == KVD_KW_Q5_1 ? (f == 0   ? 16
                                  : f == 1 ? 4
                                  : f == 2 ? 4
                                           : 0)
           : wt == KVD_KW_Q8_0 ? (f == 0   ? 32
                                  : f == 1 ? 2
                                           : 0)
           : wt == KVD_KW_Q4_K ? (f == 0   ? 16
                                  : f == 1 ? 128
                                           : 0)
           : wt == KVD_KW_Q5_K ? (f == 0   ? 16
                                  : f == 1 ? 32
                                  : f == 2 ? 128
                                           : 0)
           : wt == KVD_KW_Q6_K ? (f == 0   ? 128
                                  : f == 1 ? 64
                                  : f == 2 ? 16
                                  : f == 3 ? 2
                                           : 0)
                               : 0;
}

// Bytes per block of the planes before plane f.
static __host__ __device__ constexpr int kvd_pl_before(int wt, int f)
{
    return f <= 0 ? 0 : kvd_pl_before(wt, f - 1) + kvd_pl_size(wt, f - 1);
}

// Entry of block `blk` (row * nbk + block) in plane F of a [rows][nbk
// blocks] matrix at base.
template <int WT, int F>
static __device__ __forceinline__ const uint8_t *kvd_pl_entry(const uint8_t *base, size_t rows,
                                                              size_t nbk, size_t blk)
{
    return base + rows * nbk * (size_t)kvd_pl_before(WT, F) + blk * (size_t)kvd_pl_size(WT, F);
}

// Where byte j of a file block goes: plane *f, offset *o in its entry.
template <int WT> static __host__ __device__ __forceinline__ void kvd_pl_map(int j, int *f, int *o)
{
    switch (WT) {
    case KVD_KW_Q4_0: // d qs
        *f = j < 2 ? 1 : 0, *o = j < 2 ? j : j - 2;
        break;
    case KVD_KW_Q4_1: // dm qs
        *f = j < 4 ? 1 : 0, *o = j < 4 ? j : j - 4;
        break;
    case KVD_KW_Q5_0: // d qh qs
        *f = j < 2 ? 2 : j < 6 ? 1 : 0, *o = j < 2 ? j : j < 6 ? j - 2 : j - 6;
        break;
    case KVD_KW_Q5_1: // dm qh qs
        *f = j < 4 ? 2 : j < 8 ? 1 : 0, *o = j < 4 ? j : j < 8 ? j - 4 : j - 8;
        break;
    case KVD_KW_Q8_0: // d qs
        *f = j < 2 ? 1 : 0, *o = j < 2 ? j : j - 2;
        break;
    case KVD_KW_Q4_K: // head qs
        *f = j < 16 ? 0 : 1, *o = j < 16 ? j : j - 16;
        break;
    case KVD_KW_Q5_K: // head qh qs
        *f = j < 16 ? 0 : j < 48 ? 1 : 2, *o = j < 16 ? j : j < 48 ? j - 16 : j - 48;
        break;
    default:           // Q6_K: ql qh sc d
        if (j < 128) { // ql[j]: h = j / 64, within: jj = j % 64 (< 32: k even, else odd)
            const int h = j / 64, jj = j % 64, hi = jj >= 32, l = jj % 32;
            const int v = 2 * h + l / 16; // the quarter holding it
            *f = 0, *o = 32 * v + 16 * hi + l % 16;
        } else if (j < 192) {
            *f = 1, *o = j - 128;
        } else if (j < 208) { // sc[s]: s = 8h + l0/16 + 2k
            const int s = j - 192, h = s / 8, r = s % 8, k = r / 2, half = r % 2;
            *f = 2, *o = 4 * (2 * h + half) + k;
        } else {
            *f = 3, *o = j - 208;
        }
    }
}

// The planes of a [rows][nb blocks] matrix of type WT at base.
template <int WT> struct kvd_planes {
    const uint8_t *p[4];
    __host__ __device__ kvd_planes(const void *base, size_t rows, size_t nb)
    {
        const uint8_t *at = (const uint8_t *)base;
        for (int f = 0; f < 4; f++) {
            p[f] = at;
            at += rows * nb * (size_t)kvd_pl_size(WT, f);
        }
    }
    // Entry of block `blk` (row * nb + block) in plane f.
    __device__ __forceinline__ const uint8_t *at(int f, size_t blk) const
    {
        return p[f] + blk * (size_t)kvd_pl_size(WT, f);
    }
};

// Block `blk` of a plane-layout matrix rebuilt in the file's layout (byte
// loads; for get_rows and the GEMM path's dequantization, not the GEMV).
template <int WT>
static __device__ __forceinline__ void kvd_pl_block(const kvd_planes<WT> &pl, size_t blk,
                                                    uint8_t *out)
{
    constexpr int BB = kvd_wt_block_bytes(WT);
#pragma unroll 8
    for (int j = 0; j < BB; j++) {
        int f, o;
        kvd_pl_map<WT>(j, &f, &o);
        out[j] = pl.at(f, blk)[o];
    }
}

#endif
