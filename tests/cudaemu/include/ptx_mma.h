/*
 * ptx_mma.h (emulator) - the tensor-core instruction that kernels write as inline PTX,
 * mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 with D = C, as a function
 * for kernels built as host C++ under tests/cudaemu (host C++ cannot run PTX): where CUDA
 * code has the asm, the emulated kernel calls emu_mma_m16n8k16<T>(d, a, b), d += A B.
 *
 * What it models: the warp-collective instruction with PTX's documented fragment layouts
 * (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), lane = 4 g + t:
 *   A (16 x 16, row-major), four registers of two 16-bit values (the lower column in the
 *     low half): a[0] = A(g, 2t..2t+1), a[1] = A(g+8, 2t..), a[2] = A(g, 2t+8..),
 *     a[3] = A(g+8, 2t+8..);
 *   B (16 x 8, "col": a register holds two consecutive k of one column):
 *     b[0] = B(2t..2t+1, g), b[1] = B(2t+8..2t+9, g);
 *   C and D (16 x 8, fp32): d[0..1] = D(g, 2t..2t+1), d[2..3] = D(g+8, 2t..2t+1).
 * Each element of D is C's plus A(i, k) B(k, j) for k = 0..15 in that order with fmaf on
 * the widened values: the products are exact, so a tensor core differs only in how its sums
 * round.
 *
 * The call begins with a barrier of the whole warp (the instruction is .sync.aligned: the
 * 32 lanes execute it together); each lane then leaves its fragments in the warp's scratch
 * (emu_warp_shared), passes a second barrier, and computes its own D from the others'. A
 * warp of fewer than 32 threads, and lanes that do not all execute the call together (some
 * at another barrier of the whole warp, or gone), are reported ("cudaemu:
 * mma.sync.m16n8k16 in block ...") and abort, as the emulator's other device faults do.
 *
 * Threads: called by the emulated threads of a kernel (emu.cc runs one at a time).
 */
#ifndef AMPD_CUDAEMU_PTX_MMA_H
#define AMPD_CUDAEMU_PTX_MMA_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"
#include "tests/cudaemu/emu.h"

/* What the warp's lanes share during one call: the barrier it began with, the lanes that
 * have left their fragments, and every lane's fragments. */
struct emu_mma_shared {
    unsigned long long gen;   /* the call's first barrier; never 0 once filled */
    unsigned lanes;           /* bit l: lane l has left its fragments */
    uint32_t a[32][4], b[32][2];
    float c[32][4];
};
static_assert(sizeof(emu_mma_shared) <= EMU_WARP_SHARED, "the warp's scratch is too small");

static inline void emu_mma_fault(const char *problem)
{
    emu_report("mma.sync.m16n8k16 in block (%u,%u,%u), thread (%u,%u,%u): %s", blockIdx.x,
               blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, problem);
    abort();
}

/* The warp's scratch after a full-warp barrier; faults when the barrier was a partial one. */
static inline emu_mma_shared *emu_mma_scratch(unsigned long long *gen)
{
    emu_mma_shared *s = (emu_mma_shared *)emu_warp_shared(gen);
    if (*gen == 0)
        emu_mma_fault("its warp's lanes did not all reach it together (lanes waiting at "
                      "barriers of other masks)");
    return s;
}

/* The 16-bit value at bit offset `half` (0 or 16) of register r, widened. */
template <typename T>
static inline float emu_mma_value(uint32_t r, int half)
{
    uint16_t bits = (uint16_t)(r >> half);
    T v;
    memcpy((void *)&v, &bits, sizeof(v));
    if constexpr (std::is_same<T, __half>::value)
        return __half2float(v);
    else
        return __bfloat162float(v);
}

template <typename T>
static inline void emu_mma_m16n8k16(float *d, const uint32_t *a, const uint32_t *b)
{
    static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value,
                  "mma.sync.m16n8k16 takes __half or __nv_bfloat16 operands here");
    unsigned nthreads = blockDim.x * blockDim.y * blockDim.z;
    unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    if (nthreads - (tid & ~31u) < 32)
        emu_mma_fault("its warp has fewer than 32 threads: the instruction needs 32");
    emu_syncwarp(0xFFFFFFFFu);
    unsigned long long gen;
    emu_mma_shared *s = emu_mma_scratch(&gen);
    int lane = emu_lane();
    if (s->gen != gen) {
        s->gen = gen;
        s->lanes = 0;
    }
    s->lanes |= 1u << lane;
    memcpy(s->a[lane], a, sizeof(s->a[lane]));
    memcpy(s->b[lane], b, sizeof(s->b[lane]));
    memcpy(s->c[lane], d, sizeof(s->c[lane]));
    emu_syncwarp(0xFFFFFFFFu);
    s = emu_mma_scratch(&gen);
    if (s->lanes != 0xFFFFFFFFu) {
        char what[160];
        snprintf(what, sizeof(what), "only lanes 0x%08x of its warp execute it (the 32 lanes "
                 "must execute it together)", s->lanes);
        emu_mma_fault(what);
    }
    int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; e++) {
        int i = g + (e >= 2) * 8, j = 2 * t + (e & 1);
        float acc = s->c[lane][e];
        for (int k = 0; k < 16; k++) {
            /* A(i, k): lane 4 (i % 8) + (k % 8) / 2, register (i >= 8) + 2 (k >= 8);
             * B(k, j): lane 4 j + (k % 8) / 2, register k >= 8; half k % 2 for both */
            uint32_t ra = s->a[4 * (i % 8) + (k % 8) / 2][(i >= 8) + 2 * (k >= 8)];
            uint32_t rb = s->b[4 * j + (k % 8) / 2][k >= 8];
            acc = fmaf(emu_mma_value<T>(ra, 16 * (k % 2)), emu_mma_value<T>(rb, 16 * (k % 2)),
                       acc);
        }
        d[e] = acc;
    }
}

#endif /* AMPD_CUDAEMU_PTX_MMA_H */
