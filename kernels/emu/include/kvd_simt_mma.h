// The warp-level matrix instructions of the emulation build (C++ only, used
// through kernels/mma.cuh): mma.sync.aligned.m16n8k16 with f16 or bf16
// inputs and f32 accumulators, mma.sync.aligned.m16n8k32 and m16n8k16 with
// s8 inputs and s32 accumulators, and ldmatrix.sync.aligned.m8n8 (.x1, .x2,
// .x4, with or without .trans). Each lane hands its registers to the
// emulator in an argument block on its own stack; once all 32 lanes have
// arrived at the same instruction, kernels/emu/mma.cc computes every lane's
// result with PTX's fragment layouts (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type", "... for mma.m16n8k32" and
// "... for mma.m16n8k16 with integer type", and "ldmatrix").
#ifndef KVD_EMU_SIMT_MMA_H
#define KVD_EMU_SIMT_MMA_H

#include "kvd_simt.h"

// A warp-wide instruction (PTX's .sync.aligned): every lane of the warp
// calls kvd_emu_warp_collective with its own block, all at the same source
// line and with the same fn; the emulator then calls fn once with the 32
// blocks (lanes[i] is lane i's) and resumes the lanes. A lane that exits,
// waits elsewhere, or a warp of fewer than 32 threads is reported.
struct kvd_emu_collective {
    void (*fn)(kvd_emu_collective *const *lanes);
};
// Its kind among kvd_emu_warp_op's (kvd_emu_warp_kind).
#define KVD_EMU_COLLECTIVE 64
static inline void kvd_emu_warp_collective(kvd_emu_collective *mine, const char *file, int line)
{
    kvd_emu_warp_op(KVD_EMU_COLLECTIVE, 0xffffffffu, 0, 32, (uint64_t)(uintptr_t)mine, file, line);
}

// Reports a fault of the calling device thread (and fails its launch): for
// the checks the instruction wrappers make themselves.
void kvd_emu_device_fault(const char *what);
// Whether [p, p + n) lies in the running block's shared memory.
bool kvd_emu_in_shared(const void *p, size_t n);

// mma.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: d = a * b + c. Each
// d element is the exact sum of its 16 products and c, rounded once to f32
// (to nearest even). The hardware's internal rounding of the sum differs
// in the last bits; no kernel may depend on them.
struct kvd_emu_mma_lane : kvd_emu_collective {
    uint32_t a[4], b[2];
    float c[4], d[4];
};
void kvd_emu_mma_f16(kvd_emu_collective *const *lanes);
void kvd_emu_mma_bf16(kvd_emu_collective *const *lanes);

// mma.m16n8k{32,16}.row.col.s32.s8.s8.s32: d = a * b + c, exact (the
// products and sums of int8 values; s32 arithmetic wraps as the hardware's
// does without .satfinite, which no kvd kernel comes near). k = 32: a[0..3],
// b[0..1]; k = 16: a[0..1], b[0].
struct kvd_emu_mma_s8_lane : kvd_emu_collective {
    uint32_t a[4], b[2];
    int32_t c[4], d[4];
};
void kvd_emu_mma_s8_k32(kvd_emu_collective *const *lanes);
void kvd_emu_mma_s8_k16(kvd_emu_collective *const *lanes);

// ldmatrix.m8n8.xN{.trans}.b16: lane 8 m + i supplies the address of row i
// of matrix m (m < N) and has read its 16 bytes into `row` itself (so the
// shared-memory checks see the read as that lane's); every lane receives
// in r[m] its two elements of matrix m.
struct kvd_emu_ldsm_lane : kvd_emu_collective {
    uint32_t row[4];
    uint32_t r[4];
    int count;
    bool trans;
};
void kvd_emu_ldsm(kvd_emu_collective *const *lanes);

#endif
