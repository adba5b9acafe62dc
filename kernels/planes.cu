// Quantized weight matrices in the plane layout (planes.cuh): the repacking
// at load, and the two readers besides the GEMV: rows to f32 (the embedding
// lookup of a tied head) and row tiles to bf16 (the GEMM path).
#include "planes.cuh"

// One thread per byte of the file's blocks: dst (planes) from src (rows).
template <int WT>
__global__ void planes_pack_kernel(uint8_t *dst, const uint8_t *__restrict__ src, size_t rows,
                                   size_t nb)
{
    constexpr int BB = kvd_wt_block_bytes(WT);
    const kvd_planes<WT> pl(dst, rows, nb);
    const size_t n = rows * nb * BB, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int f, o;
        kvd_pl_map<WT>((int)(i % BB), &f, &o);
        ((uint8_t *)pl.at(f, i / BB))[o] = src[i];
    }
}

// One thread per block of the rows [r0, r0 + nr): its values as bf16 (dst
// [nr][ne0]) or f32.
template <int WT, bool BF16>
__global__ void planes_deq_kernel(void *dst, const void *__restrict__ w, size_t rows, size_t nb,
                                  size_t r0, size_t nr, const uint32_t *__restrict__ ids)
{
    constexpr int QK = kvd_wt_qk(WT), BB = kvd_wt_block_bytes(WT);
    const kvd_planes<WT> pl(w, rows, nb);
    const size_t n = nr * nb, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / nb, b = i % nb;
        size_t src_row = r0 + r;
        bool ok = true;
        if (ids) { // get_rows: row ids[r]; out of range gives zeros
            src_row = ids[r];
            ok = src_row < rows;
        }
        uint8_t blk[BB];
        if (ok)
            kvd_pl_block<WT>(pl, src_row * nb + b, blk);
        for (int c = 0; c < QK / 32; c++) {
            float v[32];
            if (ok)
                kvd_deq32(blk, WT, (size_t)c, v);
            else
                for (int l = 0; l < 32; l++)
                    v[l] = 0.0f;
            const size_t at = r * nb * QK + b * QK + 32 * c;
            for (int l = 0; l < 32; l++) {
                if (BF16)
                    ((uint16_t *)dst)[at + l] = kvd_f32_to_bf16(v[l]);
                else
                    ((float *)dst)[at + l] = v[l];
            }
        }
    }
}

static unsigned grid_for(size_t n)
{
    unsigned b = kvd_blocks_for(n, 256);
    return b > 8192 ? 8192 : b;
}

template <int WT>
static int pack_one(void *dst, const void *src, size_t rows, size_t nb, cudaStream_t st)
{
    KVD_LAUNCH(grid_for(rows * nb * kvd_wt_block_bytes(WT)), 256, 0, st, planes_pack_kernel<WT>)
    ((uint8_t *)dst, (const uint8_t *)src, rows, nb);
    return kvd_launch_status();
}

template <int WT, bool BF16>
static int deq_one(void *dst, const void *w, size_t rows, size_t nb, size_t r0, size_t nr,
                   const uint32_t *ids, cudaStream_t st)
{
    KVD_LAUNCH(grid_for(nr * nb), 128, 0, st, planes_deq_kernel<WT, BF16>)
    (dst, w, rows, nb, r0, nr, ids);
    return kvd_launch_status();
}

#define KVD_PL_DISPATCH(wtype, call)                                                               \
    switch (wtype) {                                                                               \
    case KVD_KW_Q4_0:                                                                              \
        return call(KVD_KW_Q4_0);                                                                  \
    case KVD_KW_Q4_1:                                                                              \
        return call(KVD_KW_Q4_1);                                                                  \
    case KVD_KW_Q5_0:                                                                              \
        return call(KVD_KW_Q5_0);                                                                  \
    case KVD_KW_Q5_1:                                                                              \
        return call(KVD_KW_Q5_1);                                                                  \
    case KVD_KW_Q8_0:                                                                              \
        return call(KVD_KW_Q8_0);                                                                  \
    case KVD_KW_Q4_K:                                                                              \
        return call(KVD_KW_Q4_K);                                                                  \
    case KVD_KW_Q5_K:                                                                              \
        return call(KVD_KW_Q5_K);                                                                  \
    case KVD_KW_Q6_K:                                                                              \
        return call(KVD_KW_Q6_K);                                                                  \
    default:                                                                                       \
        return (int)cudaErrorInvalidValue;                                                         \
    }

static bool planes_type(int wtype, size_t ne0)
{
    return (kvd_wt_is_q(wtype) || wtype == KVD_KW_Q8_0) && ne0 % kvd_wt_qk(wtype) == 0;
}

extern "C" int kvd_k_planes_pack(void *dst, const void *src, int wtype, size_t rows, size_t ne0,
                                 kvd_stream stream)
{
    if (!planes_type(wtype, ne0) || dst == src)
        return (int)cudaErrorInvalidValue;
    const size_t nb = ne0 / kvd_wt_qk(wtype);
    if (rows == 0 || nb == 0)
        return 0;
#define PACK(WT) pack_one<WT>(dst, src, rows, nb, stream)
    KVD_PL_DISPATCH(wtype, PACK)
#undef PACK
}

extern "C" int kvd_k_planes_to_bf16(uint16_t *dst, const void *w, int wtype, size_t rows,
                                    size_t ne0, size_t r0, size_t nr, kvd_stream stream)
{
    if (!planes_type(wtype, ne0) || r0 + nr > rows)
        return (int)cudaErrorInvalidValue;
    const size_t nb = ne0 / kvd_wt_qk(wtype);
    if (nr == 0 || nb == 0)
        return 0;
#define DEQ(WT) deq_one<WT, true>(dst, w, rows, nb, r0, nr, NULL, stream)
    KVD_PL_DISPATCH(wtype, DEQ)
#undef DEQ
}

extern "C" int kvd_k_planes_get_rows(float *out, const void *w, int wtype, int ne0, int n_rows,
                                     const uint32_t *ids, int n, kvd_stream stream)
{
    if (n < 0 || ne0 < 0 || n_rows < 0 || !planes_type(wtype, (size_t)ne0))
        return (int)cudaErrorInvalidValue;
    const size_t nb = (size_t)ne0 / kvd_wt_qk(wtype);
    if (n == 0 || nb == 0)
        return 0;
#define DEQ(WT) deq_one<WT, false>(out, w, (size_t)n_rows, nb, 0, (size_t)n, ids, stream)
    KVD_PL_DISPATCH(wtype, DEQ)
#undef DEQ
}
