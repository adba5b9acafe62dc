// Sampling on the device, so a step downloads 4 bytes per sequence instead
// of its logits: greedy argmax, and temperature / top-k / top-p picks with
// the host-drawn uniform of each request. The pick is the cpu sampler's
// (daemon/backend/sampler_pick.c) with the same integer arithmetic: candidate weights
// round(exp(v - max) * 2^38), and every "where does the running weight
// first exceed t" question answered by radix select over a 64-bit order key,
// eight bits a pass, with a shared histogram of integer weights. Integer
// sums do not depend on the order threads add them, so the result is
// deterministic and equals the cpu's for the same logits (up to exp's last
// bit, which moves a weight by one unit in 2^38).
#include "kernel_util.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_FX_ONE 0x1p38

// The cpu sampler's rule (daemon/backend/sampler_pick.c), one for both backends: NaN
// counts as -inf, and of equal values the lower index wins. So a row of
// only NaN and -inf gives 0.
static __device__ __forceinline__ float nan_as_ninf(float v)
{
    return v != v ? -INFINITY : v;
}

// Better = larger value, or equal value at a lower index (NaN already -inf).
static __device__ __forceinline__ void argmax_merge(float &v, int &i, float ov, int oi)
{
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// The row's argmax, valid in thread 0 (rule above). Block-wide: every
// thread must call it.
static __device__ int block_argmax(const float *__restrict__ row, int vocab)
{
    KVD_SHARED(float, sv, [SAMPLE_THREADS / 32]);
    KVD_SHARED(int, si, [SAMPLE_THREADS / 32]);
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        argmax_merge(best, bi, nan_as_ninf(row[i]), i);
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_merge(best, bi, ov, oi);
    }
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = best;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        best = threadIdx.x < blockDim.x / 32 ? sv[threadIdx.x] : -INFINITY;
        bi = threadIdx.x < blockDim.x / 32 ? si[threadIdx.x] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            argmax_merge(best, bi, ov, oi);
        }
    }
    return bi < vocab ? bi : 0;
}

// One block per row; logits [rows][vocab].
__global__ void __launch_bounds__(SAMPLE_THREADS)
    argmax_kernel(int32_t *out, const float *__restrict__ logits, int vocab)
{
    int bi = block_argmax(logits + (size_t)blockIdx.x * vocab, vocab);
    if (threadIdx.x == 0)
        out[blockIdx.x] = bi;
}

extern "C" int kvd_k_argmax(int32_t *out, const float *logits, int rows, int vocab,
                            kvd_stream stream)
{
    if (rows < 0 || vocab <= 0)
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    KVD_LAUNCH(rows, SAMPLE_THREADS, 0, stream, argmax_kernel)(out, logits, vocab);
    return kvd_launch_status();
}

// ---- temperature / top-k / top-p -------------------------------------------

struct pick_state {
    const float *row;
    int vocab;
    float inv_t, mx;
    bool sorted;                     // order by (v desc, id asc); else by id
    unsigned long long min_k, min_p; // candidates need key >= both (0: no cut)
};

static __device__ __forceinline__ float scaled(const pick_state &s, int i)
{
    return nan_as_ninf(s.row[i]) * s.inv_t;
}

// f32 bits mapped so that unsigned order is float order (-inf lowest).
static __device__ __forceinline__ unsigned ord_float(float f)
{
    unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Bigger key = earlier in the walk; the low 32 bits make every key unique.
static __device__ __forceinline__ unsigned long long order_key(const pick_state &s, int i, float v)
{
    unsigned long long low = 0xffffffffu - (unsigned)i;
    return s.sorted ? ((unsigned long long)ord_float(v) << 32 | low) : low;
}

static __device__ __forceinline__ unsigned long long weight(const pick_state &s, float v)
{
    return (unsigned long long)(exp((double)v - (double)s.mx) * SAMPLE_FX_ONE + 0.5);
}

// The largest scaled logit of the row (block-wide; every thread gets it).
static __device__ float block_max_scaled(const pick_state &s)
{
    KVD_SHARED(float, red, [SAMPLE_THREADS / 32]);
    float m = -INFINITY;
    for (int i = threadIdx.x; i < s.vocab; i += blockDim.x)
        m = fmaxf(m, scaled(s, i));
    m = kvd_warp_max(m);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = -INFINITY;
    for (unsigned w = 0; w < blockDim.x / 32; w++)
        m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

// The total weight of the candidates that survive the cuts (every thread).
static __device__ unsigned long long block_total(const pick_state &s)
{
    KVD_SHARED(unsigned long long, sum, );
    if (threadIdx.x == 0)
        sum = 0;
    __syncthreads();
    unsigned long long acc = 0;
    for (int i = threadIdx.x; i < s.vocab; i += blockDim.x) {
        float v = scaled(s, i);
        unsigned long long k = order_key(s, i, v);
        if (k >= s.min_k && k >= s.min_p)
            acc += weight(s, v);
    }
    if (acc)
        atomicAdd(&sum, acc);
    __syncthreads();
    unsigned long long t = sum;
    __syncthreads();
    return t;
}

// Walking the surviving candidates by descending key, the key of the one at
// which the running mass (1 each when by_count, else the weight) first
// exceeds t; t must be below the total. Passes from bit first_shift down
// (the id-order keys have nothing above bit 31). Every thread gets it.
static __device__ unsigned long long block_select(const pick_state &s, bool by_count,
                                                  unsigned long long t, int first_shift)
{
    KVD_SHARED(unsigned long long, hist, [256]);
    KVD_SHARED(unsigned long long, t_left, );
    KVD_SHARED(int, digit, );
    unsigned long long prefix = 0, mask = 0;
    for (int shift = first_shift; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < 256; j += blockDim.x)
            hist[j] = 0;
        __syncthreads();
        // Runs of one digit add up locally first: the top digits are shared
        // by most of the row, and one shared atomic per element would
        // serialize on them.
        int run_d = -1;
        unsigned long long run = 0;
        for (int i = threadIdx.x; i < s.vocab; i += blockDim.x) {
            float v = scaled(s, i);
            unsigned long long k = order_key(s, i, v);
            if (k < s.min_k || k < s.min_p || (k & mask) != prefix)
                continue;
            unsigned long long m = by_count ? 1ull : weight(s, v);
            int d = (int)(k >> shift & 255);
            if (d != run_d) {
                if (run)
                    atomicAdd(&hist[run_d], run);
                run_d = d;
                run = 0;
            }
            run += m;
        }
        if (run)
            atomicAdd(&hist[run_d], run);
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            for (; d > 0 && t >= hist[d]; d--)
                t -= hist[d];
            digit = d;
            t_left = t;
        }
        __syncthreads();
        t = t_left;
        prefix |= (unsigned long long)digit << shift;
        mask |= 255ull << shift;
        __syncthreads(); // digit and hist are rewritten by the next pass
    }
    return prefix;
}

// One block per row.
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_kernel(uint32_t *out, const float *__restrict__ logits,
                  const kvd_k_sample_row *__restrict__ rows, int vocab)
{
    const kvd_k_sample_row p = rows[blockIdx.x];
    const float *row = logits + (size_t)blockIdx.x * vocab;
    if (p.skip) {
        if (threadIdx.x == 0)
            out[blockIdx.x] = 0;
        return;
    }
    pick_state s = {row, vocab, 0.0f, 0.0f, false, 0, 0};
    bool greedy = !(p.temperature > 0.0f);
    if (!greedy) {
        s.inv_t = 1.0f / p.temperature;
        s.mx = block_max_scaled(s);
    }
    if (greedy || s.mx == -INFINITY) {
        int bi = block_argmax(row, vocab);
        if (threadIdx.x == 0)
            out[blockIdx.x] = (uint32_t)bi;
        return;
    }
    bool top_k = p.top_k > 0 && p.top_k < (uint32_t)vocab, top_p = p.top_p < 1.0f;
    s.sorted = top_k || top_p;
    if (top_k)
        s.min_k = block_select(s, true, p.top_k - 1, 56);
    unsigned long long total = block_total(s);
    if (top_p) {
        // total >= 2^38: the largest v has exactly that weight.
        unsigned long long need = (unsigned long long)ceil((double)p.top_p * (double)total);
        need = need < 1 ? 1 : need > total ? total : need;
        s.min_p = block_select(s, false, need - 1, 56);
        total = block_total(s);
    }
    unsigned long long t = (unsigned long long)(p.u * (double)total);
    t = t >= total ? total - 1 : t;
    unsigned long long key = block_select(s, false, t, s.sorted ? 56 : 24);
    if (threadIdx.x == 0)
        out[blockIdx.x] = 0xffffffffu - (uint32_t)key;
}

extern "C" int kvd_k_sample(uint32_t *out, const float *logits, const struct kvd_k_sample_row *rows,
                            int n_rows, int vocab, kvd_stream stream)
{
    if (n_rows < 0 || vocab <= 0)
        return (int)cudaErrorInvalidValue;
    if (n_rows == 0)
        return 0;
    KVD_LAUNCH(n_rows, SAMPLE_THREADS, 0, stream, sample_kernel)(out, logits, rows, vocab);
    return kvd_launch_status();
}
