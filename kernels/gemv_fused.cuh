// The fused GEMV's kernel and its host-side launches (gemv_fused.cu says what
// it computes), shared by gemv_fused.cu (the C entry points) and the
// gemv_fused_<group>.cu files that compile each weight type's instances.
#pragma once
#include "gemv_units.cuh"
#include "rope_kv.cuh"

#ifdef KVD_CUDA_EMULATE // the emulator's kernels take their parameters by value
#define __grid_constant__
#endif

#define GF_WARPS 4
#define GF_THREADS (GF_WARPS * 32)
#define GF_SMEM_MAX (48 << 10) // dynamic shared memory without an opt-in

enum { GF_ASRC_F32 = 0, GF_ASRC_SMEM = 1, GF_ASRC_GLOBAL = 2 };
// The int8 activation layouts (kvd_k_gemv_act_kind).
enum { GF_ACT_NONE = 0, GF_ACT_LEGACY = 1, GF_ACT_K = 2, GF_ACT_K6 = 3 };

struct gf_seg {
    const uint8_t *w;
    float *y;
    const float *b;
    int rows;
    int g0; // first row group (groups never straddle two weights)
};

struct gf_params {
    gf_seg seg[3];
    int n_seg, n_groups, in, epi, asrc;
    const float *x;
    const void *act;
    const float *norm_w;
    float eps;
    float *norm_out;
    unsigned *counter;
    const void *act_in;
    void *emit[2];
    int emit_kind[2];
    int n_emit;
    int rope;
    rkv_args rkv;
    int split, blocks1;  // two weight types (gemvf_kernel)
    const void *act_in2; // the second type's act_in
    int norm_smem;       // ADD_NORM: the launch's shared memory holds 2 x seg[0].rows floats
};

// The K-quants' per-super-block float part: the quarter groups' leaders put
// their integer sums and the weights' scales here, a lane per (row, token)
// folds them in super-block order.
template <int R, int NT> struct gf_chain {
    int sumi[8][R][NT], summ[8][R][NT];
    float d[8][R], dmin[8][R];
};

template <int WT, int NT, int R> static size_t gf_smem_bytes(int asrc, int in)
{
    using U = gunit<WT>;
    size_t b = asrc == GF_ASRC_SMEM ? act_bytes(U::KIND == GU_K, NT, in) : 0;
    if (U::KIND == GU_K)
        b = ((b + 15) & ~(size_t)15) + GF_WARPS * sizeof(gf_chain<R, NT>);
    return b;
}

// Weight s of the launch (kernel parameters indexed at run time would be
// copied to local memory).
static __device__ __forceinline__ gf_seg gf_seg_at(const gf_params &p, int s)
{
    return s == 2 ? p.seg[2] : s == 1 ? p.seg[1] : p.seg[0];
}

// The output's int8 layouts (emit) from values in registers: the lane's 8
// values 8 lane .. 8 lane + 7 of super-block b (256 values) of row t.
static __device__ __forceinline__ void gf_emit_v(const gf_params &p, int nt, int n, int t, int b,
                                                 int lane, const float v[8])
{
    for (int e = 0; e < p.n_emit; e++) {
        const int kind = p.emit_kind[e];
        int8_t *qs;
        float *d;
        int *bs;
        float4 *m;
        act_ptrs(p.emit[e], kind != GF_ACT_LEGACY, nt, n, &qs, &d, &bs, &m);
        if (kind == GF_ACT_K6)
            act_quant256_v<true>(v, n, t * (n / 256) + b, lane, qs, d, bs);
        else if (kind == GF_ACT_K)
            act_quant256_v<false>(v, n, t * (n / 256) + b, lane, qs, d, bs);
        else
            act_quant32_v8(v, n, t, b, lane, qs, m);
    }
}

// The lane's 8 values of super-block b of row t of y [NT][n] (L2: other
// blocks wrote them).
static __device__ __forceinline__ void gf_load8(const float *y, int n, int t, int b, int lane,
                                                float v[8])
{
    const float4 *xv = (const float4 *)(y + (size_t)t * n + 256 * b + 8 * lane);
    const float4 a = __ldcg(xv), c = __ldcg(xv + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
}

// One int8 layout (kind) of NT rows of n floats read back from src, written
// to emit: the block's warps take its groups (256 values for the K-quants'
// layouts, 32 for the legacy one) in turn.
template <int NT>
static __device__ __forceinline__ void gf_requant(const float *src, int n, int kind, void *emit,
                                                  int warp, int lane)
{
    const bool kq = kind != GF_ACT_LEGACY;
    int8_t *qs;
    float *d;
    int *bs;
    float4 *m;
    act_ptrs(emit, kq, NT, n, &qs, &d, &bs, &m);
    const int ng = NT * n / (kq ? 256 : 32);
    for (int g = warp; g < ng; g += GF_WARPS) {
        if (kind == GF_ACT_K6)
            act_quant256<true>(src, n, g, lane, qs, d, bs);
        else if (kind == GF_ACT_K)
            act_quant256<false>(src, n, g, lane, qs, d, bs);
        else
            act_quant32(src, n, g, lane, qs, m);
    }
}

// The launch's last block (found by the counter) normalizes the residual
// (n = its rows), quantizes the output for the next GEMVs, or ropes q and
// k and writes the KV. p points at the kernel's parameters.
//
// REGS and rows of a multiple of 256: the norm's scaling pass and the
// SwiGLU output's read run in the quantizers' layout (a warp per
// super-block, 8 consecutive values a lane), and the values are quantized
// for every reader from registers as they are stored: no read back of the
// output per int8 layout. Else the normed rows are stored, then read back
// once per int8 layout.
//
// norm_smem: the squares' pass keeps the row and the norm's weights (both
// loaded in that pass) in shared memory, which the GEMV's staging no longer
// needs, and the scaling pass reads them there: one L2 round trip fewer.
// RoPE's positions and KV slots are loaded while the counter's atomic is in
// flight, by every block (the last one does not know it yet).
//
// How an instance compiles it (gf_tail_mode): GF_TAIL_REGS inline, or
// GF_TAIL_CALL in a function of its own (not inlined: its code does not
// share the register allocation of the GEMV's sums), or without the
// register path, reading back in a loop over the layouts (GF_TAIL_READ)
// or with that loop unrolled for its two layouts (GF_TAIL_READ2). Same
// bytes out either way; which one is a matter of registers and spills.
enum { GF_TAIL_READ = 0, GF_TAIL_READ2 = 1, GF_TAIL_REGS = 2, GF_TAIL_CALL = 3 };
template <int NT, int MODE> static __device__ __forceinline__ void gf_tail(const gf_params *pp)
{
    constexpr bool REGS = MODE == GF_TAIL_REGS || MODE == GF_TAIL_CALL;
    const gf_params &p = *pp;
    KVD_SHARED(int, gf_last, );
    KVD_SHARED(double, gf_red, [GF_WARPS]);
    KVD_SHARED(uint32_t, gf_rpos, [2 * NT]); // RoPE: the tokens' positions, then KV slots
    KVD_DYN_SHARED(float, gf_row);           // norm_smem: the row [n], the norm's weights [n]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool norm = p.epi == KVD_K_GEMV_ADD_NORM && p.norm_w;
    // warp 1 (thread 0 fences and counts): the loads in flight with the atomic
    const int ri = (int)threadIdx.x - 32;
    uint32_t rmeta = 0;
    if (p.rope && ri >= 0 && ri < 2 * NT)
        rmeta = ri < NT ? __ldcg(p.rkv.pos + ri) : __ldcg(p.rkv.slots + ri - NT);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        gf_last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
    }
    if (p.rope && ri >= 0 && ri < 2 * NT)
        gf_rpos[ri] = rmeta;
    __syncthreads();
    if (!gf_last)
        return;
    __threadfence();
    const int n = p.seg[0].rows, nb = n / 256;
    const bool in_regs = REGS && n % 256 == 0, keep = norm && p.norm_smem;
    for (int t = 0; norm && t < NT; t++) {
        const float *xr = p.seg[0].y + (size_t)t * n;
        double ss = 0.0;
        if (keep) {
            if (t)
                __syncthreads(); // the previous token's scaling pass done with gf_row
            for (int i = threadIdx.x; i < n; i += GF_THREADS) {
                const float xv = __ldcg(xr + i);
                if (t == 0)
                    gf_row[n + i] = p.norm_w[i];
                gf_row[i] = xv;
                const float sq = xv * xv;
                ss += (double)sq;
            }
        } else {
            for (int i = threadIdx.x; i < n; i += GF_THREADS) {
                const float xv = __ldcg(xr + i);
                const float sq = xv * xv; // each square rounded to f32, summed in double (ggml)
                ss += (double)sq;
            }
        }
        for (int o = 16; o > 0; o >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        __syncthreads(); // gf_red free again
        if (lane == 0)
            gf_red[warp] = ss;
        __syncthreads();
        double tot = 0.0;
        for (int k = 0; k < GF_WARPS; k++)
            tot += gf_red[k];
        const float scale = 1.0f / sqrtf((float)(tot / n) + p.eps);
        float *o = p.norm_out + (size_t)t * n;
        if (in_regs) {
            for (int b = warp; b < nb; b += GF_WARPS) {
                float v[8];
                if (keep) { // gf_row: written by other warps before gf_red's barriers
                    const float4 *xs = (const float4 *)(gf_row + 256 * b + 8 * lane),
                                 *ws = (const float4 *)(gf_row + n + 256 * b + 8 * lane);
                    const float4 x0 = xs[0], x1 = xs[1], w0 = ws[0], w1 = ws[1];
                    v[0] = x0.x * scale * w0.x, v[1] = x0.y * scale * w0.y;
                    v[2] = x0.z * scale * w0.z, v[3] = x0.w * scale * w0.w;
                    v[4] = x1.x * scale * w1.x, v[5] = x1.y * scale * w1.y;
                    v[6] = x1.z * scale * w1.z, v[7] = x1.w * scale * w1.w;
                } else {
                    gf_load8(p.seg[0].y, n, t, b, lane, v);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        v[i] = v[i] * scale * p.norm_w[256 * b + 8 * lane + i];
                }
                float4 *ov = (float4 *)(o + 256 * b + 8 * lane);
                ov[0] = make_float4(v[0], v[1], v[2], v[3]);
                ov[1] = make_float4(v[4], v[5], v[6], v[7]);
                gf_emit_v(p, NT, n, t, b, lane, v);
            }
        } else {
            for (int i = threadIdx.x; i < n; i += GF_THREADS) // keep: this thread's own
                o[i] =
                    keep ? gf_row[i] * scale * gf_row[n + i] : __ldcg(xr + i) * scale * p.norm_w[i];
        }
    }
    if (in_regs && !norm && p.n_emit) { // SWIGLU: y read once for every layout
        for (int g = warp; g < NT * nb; g += GF_WARPS) {
            float v[8];
            gf_load8(p.seg[0].y, n, g / nb, g % nb, lane, v);
            gf_emit_v(p, NT, n, g / nb, g % nb, lane, v);
        }
    }
    if (!in_regs && p.n_emit) { // rows of a multiple of 32: read back per layout
        __syncthreads();        // the normed rows of every warp written
        const float *src = norm ? p.norm_out : p.seg[0].y;
        if constexpr (MODE == GF_TAIL_READ2) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (e >= p.n_emit)
                    break;
                gf_requant<NT>(src, n, e ? p.emit_kind[1] : p.emit_kind[0],
                               e ? p.emit[1] : p.emit[0], warp, lane);
            }
        } else {
            for (int e = 0; e < p.n_emit; e++)
                gf_requant<NT>(src, n, p.emit_kind[e], p.emit[e], warp, lane);
        }
    }
    if (p.rope)
        for (int t = 0; t < NT; t++)
            rope_kv_token_any(p.rkv, t, gf_rpos[t], gf_rpos[NT + t]);
    if (threadIdx.x == 0)
        *p.counter = 0;
}

template <int NT, bool REGS> static __device__ __noinline__ void gf_tail_call(const gf_params *pp)
{
    gf_tail<NT, REGS ? GF_TAIL_CALL : GF_TAIL_READ>(pp);
}

// The epilogue's form in the instance of weight type wt (wt2: the second
// type of a two-type launch) for nt tokens: the one of the four that
// spills least, then takes the fewest registers on sm_90 (ptxas 13.0,
// tests/gpu/ptxas_report.sh; its allocation of the GEMV's sums moves with
// any change to the epilogue's code). Float weights (fl) keep the
// read-back path, also in their own function: their readers are float in
// a model of one type.
static __host__ __device__ constexpr int gf_tail_mode(int wt, int nt, int wt2, bool fl)
{
    if (wt != wt2)
        return GF_TAIL_REGS;
    switch (wt * 16 + nt) {
    case KVD_KW_Q5_0 * 16 + 1:
    case KVD_KW_Q5_1 * 16 + 1:
    case KVD_KW_Q8_0 * 16 + 8:
    case KVD_KW_Q4_K * 16 + 7:
    case KVD_KW_Q5_K * 16 + 5:
    case KVD_KW_Q6_K * 16 + 6:
    case KVD_KW_Q6_K * 16 + 7:
        return GF_TAIL_READ2;
    case KVD_KW_Q8_0 * 16 + 4:
    case KVD_KW_Q8_0 * 16 + 7:
    case KVD_KW_Q5_K * 16 + 4:
    case KVD_KW_Q5_K * 16 + 7:
    case KVD_KW_Q6_K * 16 + 5:
        return GF_TAIL_READ;
    case KVD_KW_F32 * 16 + 2:
    case KVD_KW_F32 * 16 + 5:
    case KVD_KW_Q5_0 * 16 + 8:
    case KVD_KW_Q8_0 * 16 + 5:
    case KVD_KW_Q4_K * 16 + 1:
    case KVD_KW_Q4_K * 16 + 6:
    case KVD_KW_Q5_K * 16 + 8:
    case KVD_KW_Q6_K * 16 + 3:
        return GF_TAIL_CALL;
    default:
        return fl ? GF_TAIL_READ : GF_TAIL_REGS;
    }
}

// Whether the instance takes its parameters __grid_constant__: those whose
// epilogue is a function (it reads them through a pointer), and those
// ptxas allocates with fewer spills or registers that way (sm_90, as
// gf_tail_mode); the others by value.
static __host__ __device__ constexpr bool gf_params_gc(int wt, int nt, int wt2, bool fl)
{
    if (wt != wt2 || gf_tail_mode(wt, nt, wt2, fl) == GF_TAIL_CALL)
        return true;
    switch (wt * 16 + nt) {
    case KVD_KW_Q4_0 * 16 + 1:
    case KVD_KW_Q4_1 * 16 + 1:
    case KVD_KW_Q8_0 * 16 + 7:
    case KVD_KW_Q4_K * 16 + 3:
    case KVD_KW_Q4_K * 16 + 5:
    case KVD_KW_Q4_K * 16 + 8:
    case KVD_KW_Q5_K * 16 + 4:
    case KVD_KW_Q5_K * 16 + 6:
    case KVD_KW_Q5_K * 16 + 7:
    case KVD_KW_Q6_K * 16 + 5:
        return true;
    default:
        return false;
    }
}

// The row groups [g_lo, g_hi) of weights of type WT, by blocks blk of nblk
// (blocks of GF_WARPS warps, each warp a row group of R rows at a time);
// act_in: their int8 activations made by the launch before, or NULL.
template <int WT, int NT, int R>
static __device__ __forceinline__ void gf_rows(const gf_params &p, int blk, int nblk, int g_lo,
                                               int g_hi, const void *act_in)
{
    using U = gunit<WT>;
    KVD_DYN_SHARED(int4, gf_smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_units = p.in / U::N, steps = (n_units + 31) / 32;
    const int gstride = nblk * GF_WARPS;
    const bool swiglu = p.epi == KVD_K_GEMV_SWIGLU;

    // Row r of group g: which weight (sel[r]) and which of its rows (local[r]).
    int sel[R], local[R];
    gw mat[R];
    auto locate = [&](int g) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (swiglu) {
                sel[r] = r % 2;
                local[r] = g * (R / 2) + r / 2;
            } else {
                int s = p.n_seg > 2 && g >= p.seg[2].g0   ? 2
                        : p.n_seg > 1 && g >= p.seg[1].g0 ? 1
                                                          : 0;
                sel[r] = s;
                local[r] = (g - p.seg[s].g0) * R + r;
            }
            const gf_seg sg = gf_seg_at(p, sel[r]);
            mat[r].base = sg.w;
            mat[r].rows = sg.rows;
            mat[r].nbk = U::KIND == GU_K                             ? p.in / 256
                         : U::KIND == GU_LEGACY || WT == KVD_KW_Q8_0 ? p.in / 32
                                                                     : p.in / 8;
        }
    };
    U w[R];
    auto load = [&](int step) {
        const int u = step * 32 + lane;
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (u < n_units && local[r] < mat[r].rows)
                w[r].load(mat[r], local[r], u);
            else
                w[r].zero();
        }
    };

    int group = g_lo + blk * GF_WARPS + warp;
    if (group < g_hi) { // the first step's weights before the wait
        locate(group);
        load(0);
    }
    kvd_pdl_wait();
    kvd_pdl_trigger(); // the next kernel may start loading its weights

    // The activations, quantized for the quantized types.
    actq a = {nullptr, nullptr, nullptr, nullptr};
    char *chain_mem = (char *)gf_smem;
    if constexpr (U::KIND != GU_FLOAT) {
        const bool kq = U::KIND == GU_K;
        int8_t *qs;
        float *d;
        int *bs;
        float4 *m;
        if (p.asrc == GF_ASRC_SMEM) {
            act_ptrs(gf_smem, kq, NT, p.in, &qs, &d, &bs, &m);
            if (act_in && kq && NT == 1) {
                // Quantized by the kernel that produced x: the quants and the
                // scales copied, the sums of each 16 quants (a fifth of the
                // bytes) made from the quants as they pass: the chunk in
                // slot k of a row is chunk c of unit k / 4 (act_pos). One
                // token only (batch-1 decode): with 2-8, the loop's
                // registers beside the first step's weights made ptxas
                // spill (sm_90, ptxas 13).
                const int4 *src = (const int4 *)act_in;
                const int per = p.in / 16, nq = NT * per;
                const int n16 = (int)(((const char *)bs - (const char *)qs) / 16);
                for (int i = threadIdx.x; i < n16; i += GF_THREADS) {
                    const int4 c = __ldcg(src + i);
                    gf_smem[i] = c;
                    if (i < nq) {
                        const int k = i % per, u = k / 4, cc = (k % 4) ^ ((u / 2) % 4);
                        int sum = kvd_dp4a(c.x, 0x01010101, 0);
                        sum = kvd_dp4a(c.y, 0x01010101, sum);
                        sum = kvd_dp4a(c.z, 0x01010101, sum);
                        bs[(i - k) + 4 * u + cc] = kvd_dp4a(c.w, 0x01010101, sum);
                    }
                }
            } else if (act_in) { // quantized by the kernel that produced x: copied
                const int4 *src = (const int4 *)act_in;
                const int n16 = (int)(act_bytes(kq, NT, p.in) / 16);
                for (int i = threadIdx.x; i < n16; i += GF_THREADS)
                    gf_smem[i] = __ldcg(src + i);
            } else {
                const int n = NT * p.in / (kq ? 256 : 32);
                for (int g = warp; g < n; g += GF_WARPS) {
                    if (kq)
                        act_quant256<WT == KVD_KW_Q6_K>(p.x, p.in, g, lane, qs, d, bs);
                    else
                        act_quant32(p.x, p.in, g, lane, qs, m);
                }
            }
            chain_mem += (act_bytes(kq, NT, p.in) + 15) & ~(size_t)15;
            __syncthreads();
        } else {
            act_ptrs((void *)p.act, kq, NT, p.in, &qs, &d, &bs, &m);
        }
        a.qs = qs;
        a.d = d;
        a.bs = bs;
        a.m = m;
    }
    gf_chain<R, NT> &ch = ((gf_chain<R, NT> *)chain_mem)[warp];

    for (bool first = true; group < g_hi; group += gstride, first = false) {
        if (!first) {
            locate(group);
            load(0);
        }
        float acc[R][NT], accm[R][NT];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < NT; t++)
                acc[r][t] = accm[r][t] = 0.0f;
        for (int s = 0; s < steps; s++) {
            if (s)
                load(s);
            const int u = s * 32 + lane;
            if constexpr (U::KIND == GU_FLOAT) {
                if (u < n_units) {
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        const float4 *xv =
                            (const float4 *)(p.x + (size_t)t * p.in + (size_t)u * U::N);
                        float xf[U::N];
#pragma unroll
                        for (int e = 0; e < U::N / 4; e++) {
                            const float4 v = __ldg(xv + e);
                            xf[4 * e] = v.x, xf[4 * e + 1] = v.y, xf[4 * e + 2] = v.z,
                                   xf[4 * e + 3] = v.w;
                        }
#pragma unroll
                        for (int r = 0; r < R; r++) {
                            float wf[U::N];
                            w[r].widen(wf);
                            float sum = 0.0f;
#pragma unroll
                            for (int e = 0; e < U::N; e++)
                                sum += wf[e] * xf[e];
                            acc[r][t] += sum;
                        }
                    }
                }
            } else if constexpr (U::KIND == GU_LEGACY) {
                if (u < n_units)
#pragma unroll
                    for (int r = 0; r < R; r++)
                        w[r].template dot<NT>(a, p.in, u, acc[r]);
            } else {
                // Exact integer sums of this lane's quarter, then of each
                // super-block (its four quarters are four adjacent lanes).
                int si[R][NT], sm[R][NT];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (u < n_units)
                        w[r].template idot<NT>(a, p.in, u, si[r], sm[r]);
                    else
#pragma unroll
                        for (int t = 0; t < NT; t++)
                            si[r][t] = sm[r][t] = 0;
#pragma unroll
                    for (int t = 0; t < NT; t++)
#pragma unroll
                        for (int o = 1; o < 4; o <<= 1) {
                            si[r][t] += __shfl_xor_sync(0xffffffffu, si[r][t], o);
                            sm[r][t] += __shfl_xor_sync(0xffffffffu, sm[r][t], o);
                        }
                }
                const int q = lane / 4; // super-block s * 8 + q of the row
                if (lane % 4 == 0) {
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        ch.d[q][r] = w[r].d();
                        ch.dmin[q][r] = w[r].dmin();
#pragma unroll
                        for (int t = 0; t < NT; t++) {
                            ch.sumi[q][r][t] = si[r][t];
                            ch.summ[q][r][t] = sm[r][t];
                        }
                    }
                }
                __syncwarp(0xffffffffu);
                if (lane < R * NT) {
                    const int r = lane / NT, t = lane % NT, nsb = p.in / 256;
                    float fa = 0.0f, fm = 0.0f;
#pragma unroll
                    for (int rr = 0; rr < R; rr++)
#pragma unroll
                        for (int tt = 0; tt < NT; tt++)
                            if (rr == r && tt == t)
                                fa = acc[rr][tt], fm = accm[rr][tt];
                    for (int qq = 0; qq < 8 && s * 8 + qq < nsb; qq++) {
                        const float da = a.d[(size_t)t * nsb + s * 8 + qq];
                        fa = fmaf((float)ch.sumi[qq][r][t], __fmul_rn(ch.d[qq][r], da), fa);
                        if (WT != KVD_KW_Q6_K)
                            fm = fmaf((float)ch.summ[qq][r][t], __fmul_rn(ch.dmin[qq][r], da), fm);
                    }
#pragma unroll
                    for (int rr = 0; rr < R; rr++)
#pragma unroll
                        for (int tt = 0; tt < NT; tt++)
                            if (rr == r && tt == t)
                                acc[rr][tt] = fa, accm[rr][tt] = fm;
                }
                __syncwarp(0xffffffffu);
            }
        }

        // This lane's (row, token): lane r * NT + t.
        float v = 0.0f;
        if constexpr (U::KIND == GU_K) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (lane == r * NT + t)
                        v = WT == KVD_KW_Q6_K ? acc[r][t] : acc[r][t] - accm[r][t];
        } else {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const float s = kvd_warp_sum(acc[r][t]);
                    if (lane == r * NT + t)
                        v = s;
                }
        }
        const int r = lane / NT, t = lane % NT;
        int my_sel = 0, my_local = 0;
#pragma unroll
        for (int rr = 0; rr < R; rr++)
            if (rr == r)
                my_sel = sel[rr], my_local = local[rr];
        const gf_seg sg = gf_seg_at(p, my_sel);
        if (swiglu) {
            const float up = __shfl_down_sync(0xffffffffu, v, NT); // row r + 1: up
            if (lane < R * NT && r % 2 == 0 && my_local < sg.rows)
                sg.y[(size_t)t * sg.rows + my_local] = v / (1.0f + kvd_silu_exp(0.0f - v)) * up;
        } else if (lane < R * NT && my_local < sg.rows) {
            float *yp = sg.y + (size_t)t * sg.rows + my_local;
            if (p.epi == KVD_K_GEMV_ADD_NORM)
                *yp = *yp + v;
            else
                *yp = sg.b ? v + sg.b[my_local] : v;
        }
    }
}

// grid: blocks of GF_WARPS warps. WT2 != WT: the weights from seg[split] on
// are of type WT2 (a Q4_K_M layer's v in Q6_K after q and k in Q4_K): the
// first blocks1 blocks take the row groups before seg[split].g0 as WT, the
// others the rest as WT2, each quantizing (or copying) the activations in
// its own type's layout; one launch, one last block for the epilogue.
template <int WT, int NT, int R, int WT2>
static __device__ __forceinline__ void gf_kernel(const gf_params &p)
{
    if constexpr (WT2 == WT) {
        gf_rows<WT, NT, R>(p, blockIdx.x, gridDim.x, 0, p.n_groups, p.act_in);
    } else {
        const int g_split = gf_seg_at(p, p.split).g0;
        if ((int)blockIdx.x < p.blocks1)
            gf_rows<WT, NT, R>(p, blockIdx.x, p.blocks1, 0, g_split, p.act_in);
        else
            gf_rows<WT2, NT, R>(p, blockIdx.x - p.blocks1, gridDim.x - p.blocks1, g_split,
                                p.n_groups, p.act_in2);
    }
    constexpr bool fl = gunit<WT>::KIND == GU_FLOAT;
    constexpr int tail = gf_tail_mode(WT, NT, WT2, fl);
    if ((p.epi == KVD_K_GEMV_ADD_NORM && p.norm_w) || p.n_emit || p.rope) {
        if constexpr (tail == GF_TAIL_CALL)
            gf_tail_call<NT, !fl>(&p);
        else
            gf_tail<NT, tail>(&p);
    }
}

// The kernel, its parameters by value or __grid_constant__ (gf_params_gc:
// an epilogue that is a function of its own reads them through a pointer,
// not from a copy in local memory).
template <int WT, int NT, int R, int WT2>
__global__ void __launch_bounds__(GF_THREADS) gemvf_kernel(const gf_params p)
{
    gf_kernel<WT, NT, R, WT2>(p);
}
template <int WT, int NT, int R, int WT2>
__global__ void __launch_bounds__(GF_THREADS) gemvf_kernel_gc(const __grid_constant__ gf_params p)
{
    gf_kernel<WT, NT, R, WT2>(p);
}

template <int WT, int NT, int R, int WT2>
static int gf_start(unsigned blocks, size_t smem, cudaStream_t st, const gf_params &p)
{
    if constexpr (gf_params_gc(WT, NT, WT2, gunit<WT>::KIND == GU_FLOAT)) {
        KVD_LAUNCH_PDL(blocks, GF_THREADS, smem, st, gemvf_kernel_gc<WT, NT, R, WT2>)(p);
    } else {
        KVD_LAUNCH_PDL(blocks, GF_THREADS, smem, st, gemvf_kernel<WT, NT, R, WT2>)(p);
    }
    return kvd_launch_status();
}

// Quantizes x [NT][in] into the layout act_quant.cuh describes at act (the
// GEMV reads it there when it does not fit in shared memory).
template <bool KQ, bool Q6>
__global__ void act_quant_kernel(const float *__restrict__ x, void *act, int nt, int in)
{
    const int lane = threadIdx.x & 31;
    const int g = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int n = nt * in / (KQ ? 256 : 32);
    kvd_pdl_wait();
    kvd_pdl_trigger();
    if (g >= n)
        return; // whole warp
    int8_t *qs;
    float *d;
    int *bs;
    float4 *m;
    act_ptrs(act, KQ, nt, in, &qs, &d, &bs, &m);
    if (KQ)
        act_quant256<Q6>(x, in, g, lane, qs, d, bs);
    else
        act_quant32(x, in, g, lane, qs, m);
}

// ---- host side -------------------------------------------------------------------

static inline int gf_kind(int wtype)
{
    switch (wtype) {
    case KVD_KW_Q4_K:
    case KVD_KW_Q5_K:
    case KVD_KW_Q6_K:
        return GU_K;
    case KVD_KW_Q4_0:
    case KVD_KW_Q4_1:
    case KVD_KW_Q5_0:
    case KVD_KW_Q5_1:
        return GU_LEGACY;
    case KVD_KW_F32:
    case KVD_KW_F16:
    case KVD_KW_BF16:
    case KVD_KW_Q8_0:
        return GU_FLOAT;
    default:
        return -1;
    }
}

// The launch's parameters from the request: its weights in row groups of
// R rows (R / 2 (gate, up) pairs for SWIGLU), the input and outputs, the
// epilogue's arguments; asrc and the two-type fields are the caller's.
template <int R> static void gf_params_fill(const kvd_k_gemv *g, gf_params &p)
{
    memset(&p, 0, sizeof p);
    const bool swiglu = g->epi == KVD_K_GEMV_SWIGLU;
    int groups = 0;
    for (int i = 0; i < g->n_seg; i++) {
        p.seg[i].w = (const uint8_t *)g->seg[i].w;
        p.seg[i].y = g->seg[i].y;
        p.seg[i].b = g->seg[i].bias;
        p.seg[i].rows = g->seg[i].rows;
        p.seg[i].g0 = groups;
        if (!swiglu)
            groups += (g->seg[i].rows + R - 1) / R;
    }
    if (swiglu) { // pairs of (gate, up) rows: R / 2 of them per group
        p.seg[1].g0 = 0;
        p.seg[1].y = g->seg[0].y;
        groups = (g->seg[0].rows + R / 2 - 1) / (R / 2);
    }
    p.n_seg = g->n_seg;
    p.n_groups = groups;
    p.in = g->in;
    p.epi = g->epi;
    p.x = g->x;
    p.act = g->act;
    p.norm_w = g->norm_w;
    p.eps = g->eps;
    p.norm_out = g->norm_out;
    p.counter = g->counter;
    p.act_in = g->act_in;
    if (g->rope) {
        const kvd_k_rope_args &r = *g->rope;
        p.rope = 1;
        p.rkv = rkv_args{r.q,     r.k,
                         r.v,     r.pos,
                         r.slots, r.n_heads,
                         r.n_rot, r.mode == KVD_K_ROPE_NEOX,
                         r.base,  r.freq_factors,
                         r.kv,    r.layer};
    }
    p.n_emit = g->n_emit;
    for (int i = 0; i < g->n_emit; i++) {
        p.emit[i] = g->emit[i];
        p.emit_kind[i] = kvd_k_gemv_act_kind(g->emit_wtype[i]);
    }
}

template <int WT, int NT, int R> static int gf_launch1(const kvd_k_gemv *g, cudaStream_t st)
{
    gf_params p;
    gf_params_fill<R>(g, p);
    const int groups = p.n_groups;
    const int kind = gf_kind(WT);
    p.asrc = kind == GU_FLOAT                                               ? GF_ASRC_F32
             : gf_smem_bytes<WT, NT, R>(GF_ASRC_SMEM, g->in) <= GF_SMEM_MAX ? GF_ASRC_SMEM
                                                                            : GF_ASRC_GLOBAL;
    if (p.asrc == GF_ASRC_GLOBAL && g->act_in) {
        p.act = g->act_in;
    } else if (p.asrc == GF_ASRC_GLOBAL) {
        const unsigned qb = (unsigned)((NT * g->in / (kind == GU_K ? 256 : 32) + 7) / 8);
        if (kind == GU_K && WT == KVD_KW_Q6_K) {
            KVD_LAUNCH_PDL(qb, 256, 0, st, act_quant_kernel<true, true>)(g->x, g->act, NT, g->in);
        } else if (kind == GU_K) {
            KVD_LAUNCH_PDL(qb, 256, 0, st, act_quant_kernel<true, false>)(g->x, g->act, NT, g->in);
        } else {
            KVD_LAUNCH_PDL(qb, 256, 0, st, act_quant_kernel<false, false>)
            (g->x, g->act, NT, g->in);
        }
        int rc = kvd_launch_status();
        if (rc)
            return rc;
    }
    unsigned blocks = (unsigned)((groups + GF_WARPS - 1) / GF_WARPS);
    // Blocks that quantize the activations in their prologue each do it
    // once: a few per multiprocessor walk all the rows.
    if (p.asrc == GF_ASRC_SMEM && g->max_blocks > 0 && blocks > (unsigned)g->max_blocks)
        blocks = (unsigned)g->max_blocks;
    size_t smem = gf_smem_bytes<WT, NT, R>(p.asrc, g->in);
    // The residual norm's last block keeps the row and the norm's weights in
    // shared memory between its two passes (gf_tail) when they fit.
    const size_t keep = 2 * (size_t)g->seg[0].rows * sizeof(float);
    if (g->epi == KVD_K_GEMV_ADD_NORM && g->norm_w && keep <= GF_SMEM_MAX) {
        p.norm_smem = 1;
        smem = smem > keep ? smem : keep;
    }
    return gf_start<WT, NT, R, WT>(blocks, smem, st, p);
}

template <int WT, int WT2 = WT> int gf_by_tokens(const kvd_k_gemv *g, cudaStream_t st);

// Weights of two types (seg[split] on of WT2), a launch per type (the
// epilogue in the second: each through its own type's instances).
template <int WT, int NT, int R, int WT2>
static int gf_per_type(const kvd_k_gemv *g, cudaStream_t st)
{
    kvd_k_gemv a = *g, b = *g;
    a.n_seg = g->split;
    a.split = 0;
    a.rope = NULL;
    b.wtype = WT2;
    b.n_seg = g->n_seg - g->split;
    b.split = 0;
    b.act_in = g->act_in2;
    for (int i = 0; i < b.n_seg; i++)
        b.seg[i] = g->seg[g->split + i];
    const int rc = gf_by_tokens<WT>(&a, st);
    return rc ? rc : gf_by_tokens<WT2>(&b, st);
}

// Weights of two types: one launch whose blocks take their type from their
// rows, for one token (batch-1 decode) when both types' activations fit in
// shared memory; else a launch per type. (With 2-8 tokens a kernel holding
// both types' bodies spilled up to 116 B on sm_90, ptxas 13.)
template <int WT, int NT, int R, int WT2>
static int gf_mixed1(const kvd_k_gemv *g, cudaStream_t st, size_t smem);
template <int WT, int NT, int R, int WT2> static int gf_mixed(const kvd_k_gemv *g, cudaStream_t st)
{
    static_assert(gunit<WT>::KIND == GU_K && gunit<WT2>::KIND == GU_K, "K-quant pairs");
    if constexpr (NT > 1) {
        return gf_per_type<WT, NT, R, WT2>(g, st);
    } else {
        const size_t s1 = gf_smem_bytes<WT, NT, R>(GF_ASRC_SMEM, g->in),
                     s2 = gf_smem_bytes<WT2, NT, R>(GF_ASRC_SMEM, g->in);
        if (s1 > GF_SMEM_MAX || s2 > GF_SMEM_MAX)
            return gf_per_type<WT, NT, R, WT2>(g, st);
        return gf_mixed1<WT, NT, R, WT2>(g, st, s1 > s2 ? s1 : s2);
    }
}

// One launch for both types (gf_mixed checked that they fit).
template <int WT, int NT, int R, int WT2>
static int gf_mixed1(const kvd_k_gemv *g, cudaStream_t st, size_t smem)
{
    gf_params p;
    gf_params_fill<R>(g, p); // a STORE without emits (kvd_k_gemv_run checked)
    const int groups = p.n_groups;
    p.act_in2 = g->act_in2;
    p.asrc = GF_ASRC_SMEM;
    p.split = g->split;
    // The blocks of each type (each quantizes its activations once): as
    // many as its row groups need, the cap shared in proportion to them.
    const int gs = p.seg[g->split].g0;
    int b1 = (gs + GF_WARPS - 1) / GF_WARPS, b2 = (groups - gs + GF_WARPS - 1) / GF_WARPS;
    if (g->max_blocks > 0 && b1 + b2 > g->max_blocks) {
        const int c1 = (int)((long long)g->max_blocks * gs / groups);
        b1 = c1 < 1 ? 1 : c1 < b1 ? c1 : b1;
        b2 = g->max_blocks - b1 < 1 ? 1 : g->max_blocks - b1 < b2 ? g->max_blocks - b1 : b2;
    }
    p.blocks1 = b1;
    return gf_start<WT, NT, R, WT2>((unsigned)(b1 + b2), smem, st, p);
}

template <int WT, int NT, int R, int WT2> static int gf_launch(const kvd_k_gemv *g, cudaStream_t st)
{
    if constexpr (WT2 != WT)
        return gf_mixed<WT, NT, R, WT2>(g, st);
    else
        return gf_launch1<WT, NT, R>(g, st);
}

// A type's (or pair's) launches for 1..8 tokens. Each type's instances are
// compiled in one gemv_fused_*.cu (explicit instantiations), declared here
// for the others (GF_EXTERN below).
template <int WT, int WT2> int gf_by_tokens(const kvd_k_gemv *g, cudaStream_t st)
{
    switch (g->n_tokens) {
    case 1:
        return gf_launch<WT, 1, 4, WT2>(g, st);
    case 2:
        return gf_launch<WT, 2, 4, WT2>(g, st);
    case 3:
        return gf_launch<WT, 3, 4, WT2>(g, st);
    case 4:
        return gf_launch<WT, 4, 4, WT2>(g, st);
    case 5:
        return gf_launch<WT, 5, 2, WT2>(g, st);
    case 6:
        return gf_launch<WT, 6, 2, WT2>(g, st);
    case 7:
        return gf_launch<WT, 7, 2, WT2>(g, st);
    default:
        return gf_launch<WT, 8, 2, WT2>(g, st);
    }
}

// Every instance is compiled in exactly one translation unit: the weight
// types' ptxas time is most of the kernels' build, one file each lets a
// parallel build share it out. gemv_fused_<group>.cu defines GF_INSTANTIATE
// for its own; the others see them as extern.
#define GF_TYPES(X)                                                                                \
    X(KVD_KW_F32, KVD_KW_F32)                                                                      \
    X(KVD_KW_F16, KVD_KW_F16)                                                                      \
    X(KVD_KW_BF16, KVD_KW_BF16)                                                                    \
    X(KVD_KW_Q8_0, KVD_KW_Q8_0)                                                                    \
    X(KVD_KW_Q4_0, KVD_KW_Q4_0)                                                                    \
    X(KVD_KW_Q4_1, KVD_KW_Q4_1)                                                                    \
    X(KVD_KW_Q5_0, KVD_KW_Q5_0)                                                                    \
    X(KVD_KW_Q5_1, KVD_KW_Q5_1)                                                                    \
    X(KVD_KW_Q4_K, KVD_KW_Q4_K)                                                                    \
    X(KVD_KW_Q4_K, KVD_KW_Q6_K)                                                                    \
    X(KVD_KW_Q5_K, KVD_KW_Q5_K)                                                                    \
    X(KVD_KW_Q5_K, KVD_KW_Q6_K)                                                                    \
    X(KVD_KW_Q6_K, KVD_KW_Q6_K)
#define GF_EXTERN(WT, WT2)                                                                         \
    extern template int gf_by_tokens<WT, WT2>(const kvd_k_gemv *, cudaStream_t);
GF_TYPES(GF_EXTERN)
#undef GF_EXTERN
#define GF_INSTANTIATE(WT, WT2)                                                                    \
    template int gf_by_tokens<WT, WT2>(const kvd_k_gemv *, cudaStream_t);
