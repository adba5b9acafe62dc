#!/usr/bin/env python3
"""The cuda backend's analytic model: per-kernel bytes, FLOPs, launches and
occupancy -> predicted time of a batch-1 decode step and of a 2k-token
prefill of a Llama-3-8B-shaped model on an H200, for the kernels as they were
before the GPU-speed work ("before") and as they are now ("after").

No device is needed: the inputs are the device's published and once-measured
ceilings (/work/.library/device/H200.md, KINDS.md), each kernel's launch
geometry and registers (ptxas: tests/gpu/ptxas_report.sh), and the address
pattern of each kernel's weight loads, whose L1 wavefronts are counted here
by simulating one warp instruction. docs/performance.md ("GPU: analytic
model") prints its tables; the first device run (tests/gpu/device_check.sh)
replaces its assumptions (launch gap, latencies, GEMM efficiency) with
measurements.

    tests/gpu/analytic_model.py [--kernels]   (--kernels: every kernel's row)
"""
import math
import sys

# ---- the device: H200 SXM ----------------------------------------------------
BW = 4.3e12          # B/s: device-to-device copy, read + written (KINDS.md, 2026-10-28/11-04)
SMS = 132
CLK = 1.98e9         # SM clock under load (KINDS.md: 1980 MHz right after a GEMM)
REGS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
L1_BYTES_PER_WAVEFRONT = 128   # one L1 tag lookup (wavefront) per clock per SM
LAT_HBM = 0.75e-6    # s: a load that misses L2, under load (assumption, to measure)
LAT_L2 = 0.25e-6     # s: a dependent load that hits L2 (data a previous kernel just wrote)
T_LAUNCH = 1.7e-6    # s per dependent kernel in a CUDA graph: the review's figure
                     # (711 launches ~ 1.2 ms); bench_gpu's empty-kernel chain measures it
T_LAUNCH_PDL = 0.7e-6  # s: the same with programmatic dependent launch (assumption)
TC_PEAK = 989e12     # bf16 dense tensor-core FLOP/s (datasheet; 788 measured via cuBLAS)
MMA_SYNC_FRAC = 0.66  # mma.sync (no wgmma) reaches about 2/3 of the peak on Hopper
FA2_FRAC = 0.55      # of that, what a FlashAttention-2-style kernel keeps (FA2 on H100:
                     # ~350-370 TFLOP/s at D 128, i.e. ~0.36 of 989)
FP32_RATE = 67e12    # CUDA-core FMA FLOP/s
LDS_PER_CLK = 1      # shared-memory warp instructions per clock per SM (32 x 4 B)

# ---- the model: Llama-3-8B shape ----------------------------------------------
L, E, H, HKV, D, F, V = 32, 4096, 32, 8, 128, 14336, 128256
KD = HKV * D
BYTES = {"bf16": 2.0, "q4_k": 144 / 256, "q6_k": 210 / 256, "q8_0": 34 / 32}


def more_bits(l):
    """llama.cpp's Q4_K_M: Q6_K attn_v and ffn_down in these layers."""
    return l < L // 8 or l >= 7 * L // 8 or (l - L // 8) % 3 == 2


# ---- L1 wavefronts of one warp load instruction ---------------------------------
def wavefronts(addrs, size):
    """Wavefronts of a warp instruction whose lanes load `size` bytes at
    `addrs`: the distinct 128-byte lines it touches, and at least the bytes it
    moves / 128."""
    lines = set()
    for a in addrs:
        for b in range(a // 128, (a + size - 1) // 128 + 1):
            lines.add(b)
    return max(len(lines), math.ceil(len(set(addrs)) * size / 128))


def l1_bytes_per_wavefront(loads, unit_bytes, lanes=32, start=0):
    """loads: [(offset_of_lane(l) -> bytes offset, size)] of one unroll step
    in which lane l handles unit start+l of a row of unit_bytes units; the
    useful bytes (the units' bytes) per wavefront spent."""
    wf = sum(wavefronts([off(start + l) for l in range(lanes)], size) for off, size in loads)
    return lanes * unit_bytes / wf


def l1_limit(bpw):
    return SMS * CLK * bpw / BW


# ---- occupancy and Little's law -------------------------------------------------
def resident_warps(regs, warps_per_block, grid, smem=0):
    by_regs = REGS_PER_SM // (regs * 32 * warps_per_block) * warps_per_block
    by_smem = (228 * 1024 // smem) * warps_per_block if smem else 10**9
    by_grid = math.ceil(grid / SMS) * warps_per_block
    return min(MAX_WARPS_PER_SM, by_regs, by_smem, MAX_BLOCKS_PER_SM * warps_per_block, by_grid)


def occupancy_limit(regs, warps_per_block, grid, inflight_per_warp):
    w = resident_warps(regs, warps_per_block, grid)
    return SMS * w * inflight_per_warp / LAT_HBM / BW


class K:
    """One kernel (or a fixed sequence of them) of a step."""

    def __init__(self, name, launches=1, hbm=0.0, eff=1.0, chain_l2=0, chain_hbm=0, flops=0.0,
                 rate=0.0, per_layer=True, note="", plain=0, overlap=False):
        self.name, self.launches, self.hbm, self.eff = name, launches, hbm, eff
        self.chain_l2, self.chain_hbm, self.flops, self.rate = chain_l2, chain_hbm, flops, rate
        self.per_layer, self.note = per_layer, note
        # plain: launches that pay the whole gap even when the step uses PDL
        # (launched without it, or after a kernel that never triggers early);
        # overlap: the latency chain is the streaming itself (max, not sum)
        self.plain, self.overlap = plain, overlap

    def time(self, t_launch):
        t_mem = self.hbm / (BW * self.eff) if self.hbm else 0.0
        t_lat = self.chain_l2 * LAT_L2 + self.chain_hbm * LAT_HBM
        t_fl = self.flops / self.rate if self.flops else 0.0
        gaps = (self.launches - self.plain) * t_launch + self.plain * max(t_launch, T_LAUNCH)
        if self.hbm and not self.overlap:  # a streaming kernel's own latency chain adds to it
            return gaps + t_mem + t_lat + t_fl
        return gaps + max(t_mem, t_lat, t_fl)


# ---- the GEMV kernels' efficiencies -------------------------------------------------
def gemv_eff_before(wt, rows):
    """kernels/gemv.cu and gemv_quant.cu before: one warp per output row, 8
    warps per block, each lane a unit (16 B of bf16; a quarter super-block of
    a K-quant), UNROLL units in flight, every lane's loads issued together."""
    grid = math.ceil(rows / 8)
    if wt == "bf16":
        bpw = l1_bytes_per_wavefront([(lambda l: 16 * l, 16)], 16)
        occ = occupancy_limit(40, 8, grid, 4 * 16 * 32)
    elif wt == "q4_k":  # head 16 B + 2 x 16 B of qs per quarter; units of 36 B
        loads = [(lambda l: 144 * (l // 4), 16), (lambda l: 144 * (l // 4) + 16 * (1 + 2 * (l % 4)), 16),
                 (lambda l: 144 * (l // 4) + 16 * (2 + 2 * (l % 4)), 16)]
        bpw = l1_bytes_per_wavefront(loads, 36)
        occ = occupancy_limit(64, 8, grid, 2 * 48 * 32)
    else:  # q6_k: 29 two-byte loads per quarter super-block (52.5 B)
        def q6(i, kind):
            def f(l):
                v, sb = l % 4, l // 4
                hf, l0 = v // 2, 16 * (v % 2)
                base = 210 * sb
                if kind == "a":
                    return base + 2 * (32 * hf + l0 // 2 + i)
                if kind == "b":
                    return base + 2 * (32 * hf + l0 // 2 + 16 + i)
                if kind == "h":
                    return base + 2 * (64 + 16 * hf + l0 // 2 + i)
                if kind == "s":
                    return base + 2 * (96 + 4 * hf + i)
                return base + 208
            return f
        loads = [(q6(i, k), 2) for k in "abh" for i in range(8)] + [(q6(i, "s"), 2) for i in range(4)]
        loads.append((q6(0, "d"), 2))
        bpw = l1_bytes_per_wavefront(loads, 52.5)
        occ = occupancy_limit(76, 8, grid, 2 * 58 * 32)
    return min(1.0, l1_limit(bpw), occ), bpw


def decode_before(mix):
    """Batch-1 decode step, context 1024, today's kernels (15 launches a
    layer in bf16, 22 in Q4_K_M: every quantized matmul quantizes its input)."""
    ks = []
    q = mix == "q4_k_m"
    for l in range(L):
        wt = "q4_k" if q else "bf16"
        vt = "q6_k" if q and more_bits(l) else wt
        mats = [("q", wt, E, E), ("k", wt, E, KD), ("v", vt, E, KD), ("o", wt, E, E),
                ("gate", wt, E, F), ("up", wt, E, F), ("down", vt, F, E)]
        for name, t, i, o in mats:
            if q:
                ks.append(K("quantize activations", chain_l2=2, note="quant256, 2 blocks"))
            eff, _ = gemv_eff_before(t, o)
            ks.append(K("gemv %s" % t, hbm=i * o * BYTES[t], eff=eff))
        ks.append(K("rope q, k", launches=2, chain_l2=32 + 8 + 4,
                    note="1 block each; one dependent round trip per head"))
        ks.append(K("kv_write", chain_l2=8, note="1 block; 8 dependent stores per thread"))
        ctx_split = 256  # splits = min(66, 1024/256) = 4 blocks of 256 tokens per KV head
        ks.append(K("attention decode + merge", launches=2, hbm=1024 * KD * 2 * 2,
                    chain_hbm=ctx_split // 16 + 1, note="16 tokens per dependent step"))
        ks.append(K("add_rmsnorm", launches=2, chain_l2=2 * 32, note="1 block, 2 passes of 16"))
        ks.append(K("silu_mul", chain_l2=2))
    return ks + decode_tail(q, before=True)


def decode_tail(q, before):
    """Embedding row, final norm, head, sampling (once per step)."""
    ot = "q6_k" if q else "bf16"
    eff = gemv_eff_before(ot, V)[0] if before else gemv_eff_after(ot, V)[0]
    ks = [K("get_rows + first rmsnorm", launches=2, chain_l2=2 + (32 if before else 4), per_layer=False),
          K("gather + final rmsnorm", launches=2, chain_l2=2 + (32 if before else 4), per_layer=False)]
    if q and before:
        ks.append(K("quantize activations", chain_l2=2, per_layer=False))
    ks.append(K("gemv %s (head)" % ot, hbm=E * V * BYTES[ot], eff=eff, per_layer=False))
    ks.append(K("sample (greedy)", chain_l2=8, per_layer=False))
    return ks


# ---- the kernels now (after) ------------------------------------------------------------
L2_BW = 8e12  # B/s the L2 serves all SMs (assumption; about twice HBM)
GF_MAX_BLOCKS = 4 * SMS  # blocks that stage the activations (gemv_fused.cu max_blocks)
GF_REGS = {"bf16": 72, "q4_k": 151, "q6_k": 128}  # ptxas sm_90, gemvf_kernel<T, 1 token, R 4>
GF_REGS_QKV2 = 168  # gemvf_kernel<Q4_K, 1 token, R 4, Q6_K>: q, k and v of two types, one launch


def gemv_eff_after(wt, rows, regs=None):
    """kernels/gemv_fused.cu: a warp computes R = 4 rows, lane j streams
    unit j (+32k) of all four: one unit per row in flight per lane, loaded
    with 16-byte loads at addresses consecutive across lanes (weights in
    the plane layout), 4 warps per block; regs: the instance's registers
    when not the type's own (the two-type QKV kernel)."""
    warps = math.ceil(rows / 4)
    grid = math.ceil(warps / 4)
    if wt == "bf16":
        bpw = l1_bytes_per_wavefront([(lambda l: 16 * l, 16)], 16)
        inflight = 4 * 16 * 32
    elif wt == "q4_k":  # planes: heads (16 B, shared by a super-block's 4 lanes), qs 32 B per lane
        loads = [(lambda l: 16 * (l // 4), 16), (lambda l: 32 * l, 16), (lambda l: 32 * l + 16, 16)]
        bpw = l1_bytes_per_wavefront(loads, 36)
        inflight = 4 * 36 * 32
    else:  # q6_k planes: ql 32 B, qh 16 B, scales 4 B per lane, d 2 B per super-block
        loads = [(lambda l: 32 * l, 16), (lambda l: 32 * l + 16, 16), (lambda l: 16 * l, 16),
                 (lambda l: 4 * l, 4), (lambda l: 2 * (l // 4), 2)]
        bpw = l1_bytes_per_wavefront(loads, 52.5)
        inflight = 4 * 52.5 * 32
    occ = occupancy_limit(regs or GF_REGS[wt], 4, grid, inflight)
    return min(1.0, l1_limit(bpw), occ), bpw


# The steps built on branch wt-q1 (2026-12-07), each a row after "now":
# quant_once: the activations quantized once, by the kernel that produces
# them (the residual norm's last block for the QKV and gate/up inputs, both
# of QKV's int8 layouts when v is Q6_K; gate/up's last block for down's),
# each GEMV block copying the int8 bytes from L2 into shared memory instead
# of reading and quantizing the f32; rope_in_qkv: RoPE + KV write by the
# last block of the QKV projection's last launch (no launch); early_kv: in a
# plain decode step the attention loads its first steps of K/V rows but the
# newest before its PDL wait.
# Built on wt-gemv (2026-12-07): qkv_one: q, k (Q4_K) and v (Q6_K) of a
# Q4_K_M layer in one launch, its blocks taking their type from their rows
# (each stages its own type's int8 layout); tail_regs: the residual norm's
# last block scales the row in the quantizers' layout (a warp per
# super-block, 8 values a lane) and quantizes the values for every reader
# from registers as it stores them: no read back of the normed rows per
# int8 layout.
# Built on wt-gemv80 (2026-12-07): norm_smem: the residual norm's last
# block keeps the row and the norm's weights, both loaded in the squares'
# pass, in shared memory for the scaling pass (the counter, one read, the
# stores: 3 L2 round trips where there were 4); rope_meta: the QKV
# launch's blocks load the tokens' positions and KV slots while the
# counter's atomic is in flight (RoPE's first round trip overlaps it);
# bs_made: the reading GEMV's blocks copy the int8 quants and scales of the
# K-quants' activations and make the sums of each 16 from the quants as
# they pass (4 bytes per 16 values fewer through L2; one token, as here).
NEXT = {"quant_once": False, "rope_in_qkv": False, "early_kv": False, "qkv_one": False,
        "tail_regs": False, "norm_smem": False, "rope_meta": False, "bs_made": False}


def act_bytes(inp):
    """The int8 activations of one token (act_quant.cuh): the quants, an f32
    scale per 256, the sums of each 16."""
    return inp + inp // 256 * 4 + inp // 16 * 4


def stage_time(wt, rows, inp, swiglu=False, copied=True):
    """The quantized types' prologue: every block reads the f32 input from
    L2 and quantizes it, or (quant_once) copies the int8 bytes its producer
    made (at most GF_MAX_BLOCKS blocks); an input not copied (the o
    projection's: the attention's f32 output, which every block of the o
    projection reads and quantizes itself) is read as f32 with or without
    quant_once; bs_made: the sums of each 16 not copied where the input is
    copied."""
    if wt == "bf16":
        return 0.0
    groups = math.ceil(rows / (2 if swiglu else 4))
    blocks = min(math.ceil(groups / 4), GF_MAX_BLOCKS)
    if not NEXT["quant_once"] or not copied:
        return blocks * inp * 4 / L2_BW
    made = inp // 16 * 4 if NEXT["bs_made"] and copied and wt in ("q4_k", "q6_k") else 0
    return blocks * (act_bytes(inp) - made) / L2_BW


# ---- split-KV decode attention (kernels/attn_decode.cu) -------------------------------
CTX = 1024           # the decode step's context
AD_WARPS, AD_SPLIT_TOKENS, AD_MAX_SPLITS = 4, 64, 128
# ptxas sm_90 (kernels/emu/ptxas_sm90.inc): attn_decode_kernel<128, bf16, GQ 4>
# on main (one step in flight) and on this branch (two, the merge folded in)
AD_REGS, AD_REGS_NEW, AD_SMEM = 150, 164, 16644
# attn_decode_mma_kernel<128, bf16, GQ 4> (query groups of 4 and 8 on tensor
# cores): registers, static shared memory; a warp walks 16-key tiles
AD_REGS_MMA, AD_SMEM_MMA, AD_MMA_TILE = 158, 9348, 16


def blocks_per_sm(regs, threads, smem):
    """The occupancy calculator's rule (kernels/emu/occupancy.cc)."""
    warps = (threads + 31) // 32
    warp_regs = (regs * 32 + 255) // 256 * 256
    n = min(MAX_BLOCKS_PER_SM, MAX_WARPS_PER_SM // warps, REGS_PER_SM // warp_regs // warps)
    if smem:
        n = min(n, 228 * 1024 // ((smem + 127) // 128 * 128 + 1024))
    return n


def kv_bucket(ctx):
    """compute_cuda.c kv_bucket: the split count is chosen for the context
    rounded up to a power of two (at least 256)."""
    b = 256
    while b < ctx:
        b *= 2
    return b


def ad_splits(n_seqs=1, group=H // HKV, ctx=CTX, regs=AD_REGS, smem=AD_SMEM):
    """kvd_k_attn_decode_splits: one wave of resident blocks over the
    (sequence, KV head, query group) items, no split under 64 tokens of the
    bucket, at most 128; a sequence takes min(that, its own 64-token pieces)."""
    per_sm = blocks_per_sm(regs, AD_WARPS * 32, smem)
    items = n_seqs * HKV * (1 if group <= 8 else (group + 7) // 8)
    s = min(per_sm * SMS // items, math.ceil(kv_bucket(ctx) / AD_SPLIT_TOKENS), AD_MAX_SPLITS)
    s = max(1, s)
    return min(s, max(1, math.ceil(ctx / AD_SPLIT_TOKENS))), per_sm


def attn_main(pdl, pf=1, fold=False, mma=False):
    """One layer's decode attention, batch 1. As on main (pdl=False, pf=1,
    fold=False): the split kernel and the merge kernel launched plainly,
    the split kernel's loads all after its launch, one step of rows in
    flight. This branch: pdl (both launched with PDL, the split kernel's
    metadata read before its wait, behind rope_kv; no K/V row: rope_kv
    writes the new token's, and a verification step's one-row decodes read
    rows drafted in the same step), pf steps of rows in flight ahead of the one in
    use (kernels/attn_decode.cu AD_PREFETCH), fold (the last split to
    finish merges: no merge launch).

    A block walks its split 2 x NSUB tokens a step (NSUB = 4 warps x 32 /
    (D / 8) lanes a row: 16 tokens at D 128). It waits on HBM once per pf
    steps: steps / pf dependent round trips. Without PDL, before the loop: the step's metadata
    (qstart, pos0, slot0), then q and the block-table entry (two L2 round
    trips). After the loop, the partial's store (one L2 trip). The merge
    kernel: the metadata, the partials (m, l and o together), the store
    (three; two under PDL, whose metadata loads before the wait). Folded:
    the counter's atomic, the partials, the store (three, no launch).

    mma (attn_decode_mma_kernel, query groups of 4 and 8): each warp walks
    16-key tiles, the block 4 x 16 = 64 tokens a step; the next tile's K is
    loaded during a tile's softmax and P V, its V during the next scores:
    one step in flight (pf 1 of 64-token steps)."""
    if mma:
        splits, per_sm = ad_splits(regs=AD_REGS_MMA, smem=AD_SMEM_MMA)
    else:
        splits, per_sm = ad_splits(regs=AD_REGS_NEW if (pf > 1 or fold) else AD_REGS)
    chunk = math.ceil(CTX / splits)
    tok_step = AD_WARPS * AD_MMA_TILE if mma else 2 * AD_WARPS * (32 // (D // 8))
    steps = math.ceil(chunk / tok_step)
    kv_bytes = CTX * KD * 2 * 2
    what = "%d splits of %d tokens (%d-token steps, %d in flight), %d blocks/SM" % (
        splits, chunk, tok_step, pf, per_sm)
    if pdl:  # the metadata before the wait; the block table (with q), the rows after it
        early = 1 if NEXT["early_kv"] else 0  # the first steps' rows load during the wait
        split = K("attention decode (split)", hbm=kv_bytes, chain_l2=1 + 1,
                  chain_hbm=math.ceil(steps / pf) - early, overlap=True,
                  note=what + "; PDL" + ("; rows before the wait" if early else ""))
    else:
        split = K("attention decode (split)", hbm=kv_bytes, chain_l2=2 + 1,
                  chain_hbm=math.ceil(steps / pf), overlap=True, plain=1, note=what)
    if splits == 1:
        return [split]
    if fold:
        split.chain_l2 += 3
        split.note += "; merged by the last split"
        return [split]
    merge = K("attention merge", chain_l2=2 if pdl else 3, plain=0 if pdl else 1,
              note="PDL" if pdl else "plain launch")
    return [split, merge]


# The decode attention's variants: as on main, and this branch's steps.
ATTN = {"main": dict(pdl=False), "pdl": dict(pdl=True), "pf2": dict(pdl=True, pf=2),
        "new": dict(pdl=True, pf=2, fold=True), "mma": dict(pdl=True, fold=True, mma=True)}


def decode_after(mix, attn="old"):
    """Batch-1 decode step with the fused kernels: one launch for the
    projections of one input (q, k, v when their types agree), gate and up
    with SiLU, RoPE with the KV write, attention (+ merge when split), and
    each residual add with the next RMSNorm folded into the projection before
    it (its last block normalizes); quantized weights quantize their input
    in the GEMV's prologue (no quantization launches)."""
    ks = []
    q = mix == "q4_k_m"
    for l in range(L):
        wt = "q4_k" if q else "bf16"
        vt = "q6_k" if q and more_bits(l) else wt
        if vt == wt:
            r = E + 2 * KD
            ks.append(K("gemv q,k,v %s" % wt, hbm=E * r * BYTES[wt], eff=gemv_eff_after(wt, r)[0],
                        chain_l2=stage_time(wt, r, E) / LAT_L2))
        elif NEXT["qkv_one"]:  # one launch; each type's bytes at its own efficiency
            b1, b2 = E * (E + KD) * BYTES[wt], E * KD * BYTES[vt]
            e1 = gemv_eff_after(wt, E + KD, GF_REGS_QKV2)[0]
            e2 = gemv_eff_after(vt, KD, GF_REGS_QKV2)[0]
            eff = (b1 + b2) / (b1 / e1 + b2 / e2)
            ks.append(K("gemv q,k %s + v %s" % (wt, vt), hbm=b1 + b2, eff=eff,
                        chain_l2=(stage_time(wt, E + KD, E) + stage_time(vt, KD, E)) / LAT_L2))
        else:
            ks.append(K("gemv q,k %s" % wt, hbm=E * (E + KD) * BYTES[wt],
                        eff=gemv_eff_after(wt, E + KD)[0], chain_l2=stage_time(wt, E + KD, E) / LAT_L2))
            ks.append(K("gemv v %s" % vt, hbm=E * KD * BYTES[vt], eff=gemv_eff_after(vt, KD)[0],
                        chain_l2=stage_time(vt, KD, E) / LAT_L2))
        if NEXT["rope_in_qkv"]:  # the last launch's last block: the counter, then as rope_kv
            ks.append(K("rope + kv_write (in qkv)", launches=0,
                        chain_l2=1 + (2 if NEXT["rope_meta"] else 3)))
        else:
            ks.append(K("rope + kv_write", chain_l2=3, note="one block per token, 8 heads' loads together"))
        if attn == "old":  # the model of 2026-12-07 (256-token splits; stale)
            ctx_split = 256
            ks.append(K("attention decode + merge", launches=2, hbm=1024 * KD * 2 * 2,
                        chain_hbm=ctx_split // 16 + 1, note="(old 256-token splits)"))
        else:
            ks += attn_main(**ATTN[attn])
        # after a merge that never triggers early, the o projection's PDL
        # launch waits for its end: the whole gap
        # quant_once: the norm's last block also reads the normed rows back
        # and stores their int8 bytes (two L2 round trips)
        # (tail_regs: the scaling pass's registers serve the quantization:
        # the counter, the squares' read, the scaling's read, the stores, as
        # without it)
        qo = 2 if NEXT["quant_once"] and wt != "bf16" and not NEXT["tail_regs"] else 0
        nr = 3 if NEXT["norm_smem"] else 4  # the norm's own round trips (the counter, reads, stores)
        ks.append(K("gemv o + add + rmsnorm %s" % wt, hbm=E * E * BYTES[wt],
                    eff=gemv_eff_after(wt, E)[0], chain_l2=nr + qo + stage_time(wt, E, E, copied=False) / LAT_L2,
                    plain=0 if attn == "old" or ATTN[attn]["pdl"] else 1,
                    note="last block: the counter, one read of the rows (kept), the stores"
                    if NEXT["norm_smem"] else "last block: the counter, 2 reads of the rows, the stores"
                    if NEXT["tail_regs"] else "last block: 2 L2 round trips more"))
        ks.append(K("gemv gate,up + silu %s" % wt, hbm=2 * E * F * BYTES[wt],
                    eff=gemv_eff_after(wt, 2 * F)[0],
                    chain_l2=stage_time(wt, 2 * F, E, swiglu=True) / LAT_L2 +
                    (3 if NEXT["quant_once"] and wt != "bf16" else 0)))  # its last block
                    # quantizing down's input: the counter, the rows, the store
        ks.append(K("gemv down + add + rmsnorm %s" % vt, hbm=F * E * BYTES[vt],
                    eff=gemv_eff_after(vt, E)[0],
                    chain_l2=nr + qo + (1 if qo and l + 1 < L and more_bits(l + 1) else 0) +
                    stage_time(vt, E, F) / LAT_L2))  # the next q/k and v layouts: 2 passes
    return ks + decode_tail(q, before=False)


def step_bytes(mix):
    q = mix == "q4_k_m"
    b = 0.0
    for l in range(L):
        wt = "q4_k" if q else "bf16"
        vt = "q6_k" if q and more_bits(l) else wt
        b += (2 * E * E + E * KD + 2 * E * F) * BYTES[wt] + (E * KD + F * E) * BYTES[vt]
    b += E * V * BYTES["q6_k" if q else "bf16"]
    b += L * 1024 * KD * 2 * 2  # KV at context 1024, bf16
    return b


def report_decode(title, ks, mix, t_launch, show):
    roof = step_bytes(mix) / BW
    t = sum(k.time(t_launch) for k in ks)
    launches = sum(k.launches for k in ks)
    per_layer = sum(k.launches for k in ks if k.per_layer) / L
    if show:
        agg = {}
        for k in ks:
            a = agg.setdefault(k.name, [0, 0.0, 0.0, k.eff, k.note])
            a[0] += k.launches
            a[1] += k.time(t_launch)
            a[2] += k.hbm
        print("\n%s (%s): kernel, launches per step, time per step, GB, efficiency vs copy" % (title, mix))
        for n, (c, tt, b, e, note) in agg.items():
            print("  %-36s %4d %8.1f us %6.2f GB  eff %.2f  %s" % (n, c, tt * 1e6, b / 1e9, e, note))
    return t, roof, launches, per_layer


# ---- the K-quants' int8 tensor-core GEMM (kernels/gemm_qmma.cu) -------------------------
I8_PEAK = 2 * TC_PEAK  # int8 dense tensor-core OP/s (datasheet, 1979 TOPS); mma.sync
                       # m16n8k32 .s8 is assumed to reach MMA_SYNC_FRAC of it, as bf16's does
INT_LANES = 64       # 32-bit integer multiply-add / add lanes per clock per SM (sm_90)
CVT_LANES = 16       # int32 -> f32 conversions per clock per SM (sm_90)
FP_LANES = 128       # f32 FMA lanes per clock per SM
ISSUE = 4            # warp instructions issued per clock per SM (4 schedulers)
L1_BPC = 128         # bytes per clock per SM from L1 (the B fragments' loads)
QMMA_LAT_FRAC = 0.85  # latency, tails and the activations' quantization launch (assumption)
QMMA_REGS = {"q4_k": 140, "q6_k": 110}  # ptxas sm_90, qmma_kernel<T, 4 n-tiles>
QMMA_WARPS = 4       # a block's warps over the same 16 rows, splitting the super-blocks


def qmma_counts(wt, nti=4):
    """Per warp, n-tile (8 tokens) and super-block (256 of k): int8 MACs and
    warp instructions by pipe, counted from the kernel's code (the per
    super-block work of the 16 weight rows shared by nti n-tiles)."""
    if wt == "q6_k":
        # 16 groups of 16: one m16n8k16 each, sc x d (an IMAD per C
        # element), the -32 sc . S term: 2 m16n8k16 + 2 IMAD per element;
        # per super-block: ql/qh nibble and bit assembly (3 LOP x 16 groups x
        # 2 rows), scale bytes (2 x 16 x 2)
        macs = 18 * 16 * 8 * 16
        n_mma = 18
        ints = 16 * 4 + 4 * 2 + (16 * 3 * 2 + 16 * 2 * 2) / nti + 4
        cvt, fp = 4, 8
        loads = 16 + 2 + 4 + (3 * 4 * 2 + 2) / nti
        l1 = 16 * 128 + 2 * 128 + 4 * 128
    else:
        # 8 sub-blocks of 32: one m16n8k32 each, sc x d (IMAD per C element);
        # mins . S: 2 m16n8k16 + an IMAD per element; per super-block: the
        # nibbles (8 LOP per quarter), scale/min unpacking and bytes (~44)
        macs = 8 * 16 * 8 * 32 + 2 * 16 * 8 * 16
        n_mma = 10
        ints = 8 * 4 + 4 + 2 + (4 * 8 + 44) / nti + 4
        cvt, fp = 8, 16
        loads = 8 + 1 + 4 + (2 + 8) / nti
        l1 = 8 * 256 + 128 + 4 * 128
    return macs, n_mma, ints, cvt, fp, loads, l1


def qmma_eff(wt, nti=4):
    """The GEMM's rate as a fraction of I8_PEAK: the slowest of its pipes
    (tensor at mma.sync's rate, integer, conversion, f32, L1, issue) per
    warp-tile, times QMMA_LAT_FRAC. Returns (eff, the bounding pipe)."""
    macs, n_mma, ints, cvt, fp, loads, l1 = qmma_counts(wt, nti)
    mac_clk = I8_PEAK / 2 / SMS / CLK  # int8 MACs per clock per SM at the dense peak
    pipes = {"tensor": macs / (mac_clk * MMA_SYNC_FRAC), "int": ints / (INT_LANES / 32),
             "cvt": cvt / (CVT_LANES / 32), "fp32": fp / (FP_LANES / 32), "L1": l1 / L1_BPC,
             "issue": (n_mma + ints + cvt + fp + loads) / ISSUE}
    bound = max(pipes, key=pipes.get)
    return macs / mac_clk / pipes[bound] * QMMA_LAT_FRAC, bound


def batch_projections(n, qmma):
    """The projections of one decode step of n sequences (8 < n <= 32) of
    the 8B shape in Q4_K_M, layers only. Before: 8-row GEMV launches, the
    weights read ceil(n / 8) times (at the GEMV's efficiency, ~1). qmma: one
    pass (a block covers 32 tokens), at the kernel's memory efficiency (L1
    wavefronts of its 8-byte loads, Little's law at its registers with each
    warp's super-block of 16 rows, 16 x 144 B, in flight) or its compute rate,
    whichever is slower, plus a launch for each input's quantization."""
    by = sum((2 * E * E + E * KD + 2 * E * F) * BYTES["q4_k"] +
             (E * KD + F * E) * BYTES["q6_k" if more_bits(l) else "q4_k"] for l in range(L))
    if not qmma:
        return math.ceil(n / 8) * by / BW + L * 7 * math.ceil(n / 8) * T_LAUNCH
    loads = [(lambda l: 128 * 16 * (l // 4) + 8 * (l % 4), 8)]  # 8 rows' qs, 32 B each
    bpw = l1_bytes_per_wavefront(loads, 8)
    grid = math.ceil(E / 16)  # blocks of 16 rows; the smallest matrix (q, o)
    eff = min(1.0, l1_limit(bpw), occupancy_limit(QMMA_REGS["q4_k"], QMMA_WARPS, grid, 16 * 144))
    flops = 2.0 * n * sum(2 * E * E + 2 * E * KD + 3 * E * F for _ in range(L))
    t_fl = flops / (I8_PEAK * qmma_eff("q4_k")[0])
    return max(by / (BW * eff), t_fl) + L * 7 * 2 * T_LAUNCH


def q4km_share():
    """The share of a Q4_K_M layer stack's projection FLOPs in Q6_K weights."""
    q6 = tot = 0.0
    for l in range(L):
        q6 += (E * KD + F * E) if more_bits(l) else 0.0
        tot += 2 * E * E + 2 * E * KD + 3 * E * F
    return q6 / tot


# ---- prefill --------------------------------------------------------------------------
def prefill(title, chunk, attn_rate, dequant, total=2048, gemm_eff=None, qmma=False):
    """A `total`-token prompt in chunks of `chunk` (the executor's step
    budget, 512 by default): the projections' GEMMs (cuBLAS bf16 at an
    efficiency that grows with the chunk; qmma: Q4_K_M's K-quants on the
    int8 tensor cores at qmma_eff, no tile), the dequantized-tile pass per
    chunk for quantized weights through cuBLAS (read Q, write and read
    bf16), and causal attention at attn_rate FLOP/s. Returns (seconds,
    FLOPs)."""
    params = L * (2 * E * E + 2 * E * KD + 3 * E * F)
    if gemm_eff is None:
        gemm_eff = {512: 0.62, 1024: 0.68, 2048: 0.72}.get(chunk, 0.72)
    t = 0.0
    fl_total = 0.0
    for c0 in range(0, total, chunk):
        fl_gemm = 2.0 * chunk * params
        fl_attn = sum(4.0 * H * D * (p + 1) for p in range(c0, c0 + chunk)) * L
        if qmma:
            s6 = q4km_share()
            t += fl_gemm * ((1 - s6) / (I8_PEAK * qmma_eff("q4_k")[0]) +
                            s6 / (I8_PEAK * qmma_eff("q6_k")[0]))
            t += L * 7 * T_LAUNCH + L * 7 * chunk * E * 4 * 2 / BW  # quantize each input
        else:
            t += fl_gemm / (TC_PEAK * gemm_eff)
        t += fl_attn / attn_rate
        if dequant:
            t += params * (BYTES["q4_k"] + 2.0) / BW  # tile written to L2/HBM once, read from L2
        t += L * 6 * T_LAUNCH + L * 8 * (chunk * E * 4 * 2) / BW  # norms, rope, kv etc.
        fl_total += fl_gemm + fl_attn
    return t, fl_total


def main():
    show = "--kernels" in sys.argv
    print("H200 analytic model: copy %.1f TB/s, %d SMs at %.2f GHz, launch gap %.1f us (PDL %.1f),"
          " HBM latency %.2f us, L2 %.2f us" % (BW / 1e12, SMS, CLK / 1e9, T_LAUNCH * 1e6,
                                                T_LAUNCH_PDL * 1e6, LAT_HBM * 1e6, LAT_L2 * 1e6))
    print("\nGEMV weight loads: L1 bytes per wavefront and efficiency bound (1 = copy bandwidth)")
    for wt in ("bf16", "q4_k", "q6_k"):
        eb, bb = gemv_eff_before(wt, F)
        ea, ba = gemv_eff_after(wt, F)
        print("  %-5s before %5.1f B/wf eff %.2f   after %5.1f B/wf eff %.2f" % (wt, bb, eb, ba, ea))
    print("\nbatch-1 decode, 8B shape, context 1024 (roofline: weights + KV bytes / copy bandwidth)")
    for name, regs, smem in (("", AD_REGS, AD_SMEM), ("", AD_REGS_NEW, AD_SMEM),
                             ("_mma", AD_REGS_MMA, AD_SMEM_MMA)):
        splits, per_sm = ad_splits(regs=regs, smem=smem)
        print("decode attention at context %d: attn_decode%s_kernel<128, bf16, GQ 4> %d registers"
              " -> %d blocks/SM, %d splits of %d tokens (bucket %d)" % (
                  CTX, name, regs, per_sm, splits, math.ceil(CTX / splits), kv_bucket(CTX)))
    print("(rows after 'before': fused GEMVs and PDL; 'main attn' is main's decode attention)")
    print("  %-32s %9s %9s %8s %8s %9s %9s" % ("", "ms/step", "roofline", "% roof", "tok/s", "launches", "per layer"))
    rows = [("before, bf16", decode_before("bf16"), "bf16", T_LAUNCH),
            ("before, Q4_K_M", decode_before("q4_k_m"), "q4_k_m", T_LAUNCH),
            ("fused + PDL, old attn, bf16", decode_after("bf16"), "bf16", T_LAUNCH_PDL),
            ("fused + PDL, old attn, Q4_K_M", decode_after("q4_k_m"), "q4_k_m", T_LAUNCH_PDL)]
    for attn, label in (("main", "main attn"), ("pdl", "+ attn PDL"), ("pf2", "+ 2 steps in flight"),
                        ("new", "+ merge folded (now)")):
        for mix in ("bf16", "q4_k_m"):
            rows.append(("%s, %s" % (label, "bf16" if mix == "bf16" else "Q4_K_M"),
                         decode_after(mix, attn=attn), mix, T_LAUNCH_PDL))
    for title, ks, mix, tl in rows:
        t, roof, n, pl = report_decode(title, ks, mix, tl, show)
        if title.startswith("+ merge folded (now)") and mix == "q4_k_m":
            now = t
        print("  %-32s %9.3f %9.3f %7.1f%% %8.0f %9d %9.1f" % (title, t * 1e3, roof * 1e3, 100 * roof / t, 1 / t, n, pl))
    print("  built on wt-q1, Q4_K_M, from the now row:")
    for knob, label in (("quant_once", "+ activations quantized once"),
                        ("rope_in_qkv", "+ RoPE/KV write in the QKV epilogue"),
                        ("early_kv", "+ K/V rows before the wait"),
                        ("qkv_one", "+ q,k,v one launch every layer"),
                        ("tail_regs", "+ quantized in the norm's pass")):
        NEXT[knob] = True
        t, roof, n, pl = report_decode(label, decode_after("q4_k_m", attn="new"), "q4_k_m",
                                       T_LAUNCH_PDL, show)
        print("  %-32s %9.3f %9.3f %7.1f%% %8.0f %9d %9.1f   (-%.0f us)" % (
            label, t * 1e3, roof * 1e3, 100 * roof / t, 1 / t, n, pl, (now - t) * 1e6))
        now = t
    t, roof, n, pl = report_decode("+ decode attention on tensor cores",
                                   decode_after("q4_k_m", attn="mma"), "q4_k_m", T_LAUNCH_PDL, show)
    print("  %-32s %9.3f %9.3f %7.1f%% %8.0f %9d %9.1f   (-%.0f us)" % (
        "+ decode attention, tensor cores", t * 1e3, roof * 1e3, 100 * roof / t, 1 / t, n, pl,
        (now - t) * 1e6))
    tq = t
    t, roof, n, pl = report_decode("all built, bf16", decode_after("bf16", attn="mma"), "bf16",
                                   T_LAUNCH_PDL, show)
    print("  %-32s %9.3f %9.3f %7.1f%% %8.0f %9d %9.1f" % ("all built, bf16", t * 1e3, roof * 1e3,
                                                          100 * roof / t, 1 / t, n, pl))
    now = tq
    print("  built on wt-gemv80, Q4_K_M, from the row above:")
    for knob, label in (("norm_smem", "+ norm's row kept in shared mem"),
                        ("rope_meta", "+ RoPE's pos/slot with the atomic"),
                        ("bs_made", "+ act sums made in the copy")):
        NEXT[knob] = True
        t, roof, n, pl = report_decode(label, decode_after("q4_k_m", attn="mma"), "q4_k_m",
                                       T_LAUNCH_PDL, show)
        print("  %-32s %9.3f %9.3f %7.1f%% %8.0f %9d %9.1f   (-%.0f us)" % (
            label, t * 1e3, roof * 1e3, 100 * roof / t, 1 / t, n, pl, (now - t) * 1e6))
        now = t
    t, roof, n, pl = report_decode("+ wt-gemv80, bf16", decode_after("bf16", attn="mma"), "bf16",
                                   T_LAUNCH_PDL, show)
    print("  %-32s %9.3f %9.3f %7.1f%% %8.0f %9d %9.1f" % ("+ wt-gemv80, bf16", t * 1e3, roof * 1e3,
                                                          100 * roof / t, 1 / t, n, pl))
    for knob in NEXT:
        NEXT[knob] = False
    print("\nprefill of a 2048-token prompt, 8B shape (%% of the %.0f TFLOP/s bf16 peak)" % (TC_PEAK / 1e12))
    smem_rate = SMS * CLK * LDS_PER_CLK / 1.5 * 32 * 2  # fp32 FMAs fed by 1.5 LDS each
    fa2_rate = TC_PEAK * MMA_SYNC_FRAC * FA2_FRAC
    for title, chunk, rate, dq, qm in (
            ("before, bf16, 512-token chunks", 512, smem_rate, False, False),
            ("before, Q4_K_M, 512-token chunks", 512, smem_rate, True, False),
            ("after, bf16, 512-token chunks", 512, fa2_rate, False, False),
            ("after, Q4_K_M (tile + cuBLAS), 512", 512, fa2_rate, True, False),
            ("after, Q4_K_M (int8 mma), 512", 512, fa2_rate, False, True),
            ("after, bf16, one 2048 chunk", 2048, fa2_rate, False, False),
            ("after, Q4_K_M (tile + cuBLAS), 2048", 2048, fa2_rate, True, False),
            ("after, Q4_K_M (int8 mma), 2048", 2048, fa2_rate, False, True)):
        t, fl = prefill(title, chunk, rate, dq, qmma=qm)
        print("  %-36s %8.1f ms  %5.1f%% of peak  (attention at %.0f TFLOP/s)" % (
            title, t * 1e3, 100 * fl / t / TC_PEAK, rate / 1e12))
    print("\nint8 tensor-core GEMM of the K-quants (gemm_qmma.cu), per warp, 8 tokens, super-block:")
    for wt in ("q4_k", "q6_k"):
        e, bound = qmma_eff(wt)
        print("  %-5s %4.0f TOPS = %.2f of the int8 peak (%.2f of bf16's), bound by %s; %d registers"
              % (wt, e * I8_PEAK / 1e12, e, 2 * e, bound, QMMA_REGS[wt]))
    print("  Q6_K's share of Q4_K_M's projection FLOPs: %.2f" % q4km_share())
    print("  projections of a Q4_K_M decode step of n sequences (layers): 8-row GEMVs -> int8 GEMM")
    for n in (9, 16, 32):
        print("    n %2d: %.2f ms -> %.2f ms" % (n, batch_projections(n, False) * 1e3,
                                               batch_projections(n, True) * 1e3))
    t32, _ = prefill("32k", 512, smem_rate, False, total=32768)
    t32a, _ = prefill("32k", 512, fa2_rate, False, total=32768)
    print("  32k-token prompt, bf16, 512-token chunks: before %.1f s, after %.1f s to the first token" % (t32, t32a))


if __name__ == "__main__":
    main()
