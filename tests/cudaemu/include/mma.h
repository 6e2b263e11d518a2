/*
 * mma.h (emulator) - CUDA's warp matrix API (nvcuda::wmma, the tensor cores) for kernels
 * built as host C++ under tests/cudaemu, in the 16x16x16 shape: A and B fragments of
 * __half or __nv_bfloat16 (row_major or col_major), float accumulators.
 *
 * What it models:
 *  - A fragment is per thread, as on a GPU, but here every thread's holds the WHOLE 16x16
 *    tile: x[r * 16 + c] is element (r, c), num_elements is 256. On a GPU each lane holds a
 *    few elements in an unspecified arrangement, so the only portable use of x[] is the
 *    same operation on every element (scaling, fill, a function of the value alone).
 *  - mma_sync(d, a, b, c) computes, per element of d, acc = c(i,j) then
 *    acc = fmaf(a(i,k), b(k,j), acc) for k = 0..15 (the 16-bit values widened exactly);
 *    the products are exact, so it differs from a tensor core only in how the sums round.
 *    d may be c.
 *  - load_matrix_sync, store_matrix_sync and mma_sync begin with a barrier of the whole
 *    warp ("waits until all warp lanes have arrived", as CUDA documents them), then act.
 *    A load: the warp reads the whole tile once, and every lane's fragment gets it. A store:
 *    each lane writes only the elements whose row-major index r * 16 + c is its lane modulo
 *    32, and returns at once. So the store is spread over the warp as on a GPU: a lane that
 *    reads back what another lane stored must first pass __syncwarp() (or __syncthreads());
 *    without it the emulator's lanes, which run one after another, read the memory as it was
 *    before the store, and a missing barrier shows as a wrong result instead of passing. The
 *    other way round, the barrier at the start orders memory here: a plain write by any lane
 *    before a load is seen by the load, a read by any lane before a store sees the old
 *    memory. CUDA documents the wait, not an ordering of memory, so a kernel should still
 *    separate plain shared-memory writes from a load (and reads from a store over them) by
 *    __syncwarp() or __syncthreads(); the emulator cannot tell when it does not.
 *  - The work of a call is done once per warp: the calls are warp-collective, so the lanes
 *    of a warp must make the same call together with the same operands (pointer, ldm,
 *    layout; for mma_sync, fragments that hold the same tiles: here, the same bits in every
 *    lane). The first lane of the warp to run after the barrier does the work (a load reads
 *    the memory; mma_sync computes the product) and records its operands and the result in
 *    a per-warp scratch area of the emulator (emu_warp_shared, which also numbers the
 *    barrier, so that a record is used by the lanes that barrier released and by no one
 *    else); each other lane compares its operands with the record and copies the result.
 *    A load's other lanes also compare the tile's memory with what the first lane read: a
 *    change means that some thread wrote the tile after the warp had arrived at the load,
 *    with no barrier between the write and the load (a race on a GPU). A store's lanes
 *    compare their operands only (each writes its own elements from its own fragment). A
 *    lane that leaves the barrier with lanes that wait at barriers of other masks (a
 *    kernel's bug the emulator does not report) does the work alone.
 *  - What the hardware requires is checked, and a violation is reported ("cudaemu:
 *    wmma::<call> in block ..., thread ...: <problem>") and aborts, as the emulator's
 *    other device faults do: the pointer of a load or store 32-byte (256-bit) aligned;
 *    ldm (in elements) a multiple of 8 for __half and __nv_bfloat16, of 4 for float; a
 *    warp of 32 threads (a block's partial last warp cannot take part); the warp's lanes
 *    in the same call (not some in a load and others in mma_sync), with the same fragment
 *    types and layouts, the same operands and, at mma_sync, the same A, B and C; and the
 *    tile of a load unchanged while the warp loads it (above).
 *  - fill_fragment has no barrier (on a GPU it needs none).
 *
 * Not provided: other shapes (a static_assert), other element types, mma_sync's satf
 * argument, the experimental namespace. A fragment takes its tile's bytes (1 KiB for an
 * accumulator, 512 bytes for A or B) of the emulated thread's 128 KiB stack, and a call up
 * to 3 KiB more while it runs.
 *
 * Threads: called by the emulated threads of a kernel (emu.cc runs one at a time).
 */
#ifndef AMPD_CUDAEMU_MMA_H
#define AMPD_CUDAEMU_MMA_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"
#include "tests/cudaemu/emu.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
struct fragment {
    static_assert(m == 16 && n == 16 && k == 16,
                  "the emulator's wmma has the 16x16x16 shape only");
    static_assert(std::is_same<Use, accumulator>::value
                      ? std::is_same<T, float>::value && std::is_void<Layout>::value
                      : (std::is_same<Use, matrix_a>::value ||
                         std::is_same<Use, matrix_b>::value) &&
                            (std::is_same<T, __half>::value ||
                             std::is_same<T, __nv_bfloat16>::value) &&
                            (std::is_same<Layout, row_major>::value ||
                             std::is_same<Layout, col_major>::value),
                  "the emulator's wmma fragments: matrix_a or matrix_b of __half or "
                  "__nv_bfloat16, row_major or col_major; accumulator of float, no layout");
    typedef T element_type;
    static constexpr int num_elements = 16 * 16;
    T x[num_elements];     /* element (r, c) at x[r * 16 + c], in every thread */
};

typedef fragment<accumulator, 16, 16, 16, float> emu_acc;

static inline float emu_widen(__half v) { return __half2float(v); }
static inline float emu_widen(__nv_bfloat16 v) { return __bfloat162float(v); }

static inline void emu_wmma_fault(const char *call, const char *problem)
{
    emu_report("wmma::%s in block (%u,%u,%u), thread (%u,%u,%u): %s", call, blockIdx.x,
               blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, problem);
    abort();
}

/* What every _sync call starts with: the warp is whole; then wait for all of its lanes. */
static inline void emu_wmma_arrive(const char *call)
{
    unsigned nthreads = blockDim.x * blockDim.y * blockDim.z;
    unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned lanes = nthreads - (tid & ~31u);
    if (lanes < 32) {
        char what[96];
        snprintf(what, sizeof(what), "its warp has %u threads: the warp matrix calls need 32",
                 lanes);
        emu_wmma_fault(call, what);
    }
    emu_syncwarp(0xFFFFFFFFu);
}

/* The operand checks of a load or a store: p 256-bit aligned, ldm a multiple of `multiple`
 * elements. */
static inline void emu_wmma_operand(const char *call, const void *p, unsigned ldm,
                                    unsigned multiple)
{
    char what[96];
    if ((uintptr_t)p % 32 != 0) {
        snprintf(what, sizeof(what), "pointer %p is not 32-byte (256-bit) aligned", p);
        emu_wmma_fault(call, what);
    }
    if (ldm % multiple != 0) {
        snprintf(what, sizeof(what), "ldm %u is not a multiple of %u elements", ldm, multiple);
        emu_wmma_fault(call, what);
    }
}

/* ---- the work of a collective call, shared by the warp's lanes ------------------------- */

/* What a warp's lanes share during one collective call (in emu_warp_shared's scratch): the
 * first lane to run after the call's barrier fills it; the others check their call against
 * it and take its result. */
struct emu_wmma_shared {
    unsigned long long gen;   /* the barrier the call began with; never 0 once filled */
    const char *call;         /* the call's name */
    int kind;                 /* emu_wmma_kind of its fragment (mma_sync: of A and B) */
    int lane;                 /* the lane that filled it */
    const void *p;            /* a load or a store: its operands (layout: 0 row-major) */
    unsigned ldm;
    int layout;
    alignas(32) unsigned char in[2048];   /* mma_sync: A, B, C; a load: the tile as read */
    alignas(32) float out[256];           /* a load: the fragment; mma_sync: the product */
};
static_assert(sizeof(emu_wmma_shared) <= EMU_WARP_SHARED, "the warp's scratch is too small");

/* a fragment type as a number: its use, element type and layout */
template <typename Use, typename T, typename Layout>
static constexpr int emu_wmma_kind()
{
    return (std::is_same<Use, matrix_a>::value ? 1 : std::is_same<Use, matrix_b>::value ? 2 : 3) |
           (std::is_same<T, __half>::value ? 1 : std::is_same<T, float>::value ? 2 : 3) << 2 |
           (std::is_same<Layout, row_major>::value ? 1
            : std::is_same<Layout, col_major>::value ? 2 : 3) << 4;
}

/* Right after the call's barrier: the warp's record of the call, with *first true when the
 * caller is the first lane there (it fills the record and does the work); NULL when the
 * barrier that released the caller was not a full-warp one (lanes waiting at barriers with
 * different masks): then the caller works alone. A lane that finds the warp in another call,
 * or with fragments of other types, is reported. */
static inline emu_wmma_shared *emu_wmma_join(const char *call, int kind, bool *first)
{
    unsigned long long gen;
    emu_wmma_shared *s = (emu_wmma_shared *)emu_warp_shared(&gen);
    *first = false;
    if (gen == 0)
        return NULL;
    if (s->gen != gen) {
        s->gen = gen;
        s->call = call;
        s->kind = kind;
        s->lane = emu_lane();
        *first = true;
        return s;
    }
    char what[192];
    if (s->call != call && strcmp(s->call, call) != 0) {
        snprintf(what, sizeof(what), "lane %d of its warp is in wmma::%s at the same time (a "
                 "warp's lanes must make the same warp matrix calls together)", s->lane,
                 s->call);
        emu_wmma_fault(call, what);
    }
    if (s->kind != kind) {
        snprintf(what, sizeof(what), "its fragment types or layouts differ from those of lane "
                 "%d of its warp (a warp's lanes must pass the same)", s->lane);
        emu_wmma_fault(call, what);
    }
    return s;
}

/* The operands of a load or a store: recorded by the first lane, the same for the others. */
static inline void emu_wmma_same_operands(emu_wmma_shared *s, bool first, const char *call,
                                          const void *p, unsigned ldm, int layout)
{
    static const char *const name[3] = {"", ", mem_row_major", ", mem_col_major"};
    if (first) {
        s->p = p;
        s->ldm = ldm;
        s->layout = layout;
    } else if (s->p != p || s->ldm != ldm || s->layout != layout) {
        char what[256];
        snprintf(what, sizeof(what), "its operands (pointer %p, ldm %u%s) differ from those of "
                 "lane %d of its warp (pointer %p, ldm %u%s): a warp's lanes must pass the "
                 "same", p, ldm, name[layout], s->lane, s->p, s->ldm, name[s->layout]);
        emu_wmma_fault(call, what);
    }
}

/* out = A B + C on the widened values, in mma_sync's order; out is not c. */
static inline __attribute__((always_inline)) void emu_wmma_fmas_body(float *out,
                                                                     const float *a,
                                                                     const float *b,
                                                                     const float *c)
{
    for (int i = 0; i < 16; i++) {
        float acc[16];
        for (int j = 0; j < 16; j++)
            acc[j] = c[i * 16 + j];
        for (int k = 0; k < 16; k++) {
            float v = a[i * 16 + k];
            for (int j = 0; j < 16; j++)
                acc[j] = fmaf(v, b[k * 16 + j], acc[j]);
        }
        for (int j = 0; j < 16; j++)
            out[i * 16 + j] = acc[j];
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* the same with the processor's fused multiply-add instructions (the same results: fmaf is
 * the fused operation), 8 columns at a time */
__attribute__((target("avx2,fma"))) static inline void emu_wmma_fmas_x86(float *out,
                                                                         const float *a,
                                                                         const float *b,
                                                                         const float *c)
{
    emu_wmma_fmas_body(out, a, b, c);
}
#endif

template <typename T>
static inline void emu_wmma_product(float *out, const T *a, const T *b, const float *c)
{
    alignas(32) float wa[256], wb[256];
    for (int e = 0; e < 256; e++) {
        wa[e] = emu_widen(a[e]);
        wb[e] = emu_widen(b[e]);
    }
#if defined(__x86_64__) && defined(__GNUC__)
    static const bool has_fma =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (has_fma) {
        emu_wmma_fmas_x86(out, wa, wb, c);
        return;
    }
#endif
    emu_wmma_fmas_body(out, wa, wb, c);
}

/* A load after its barrier: x = the 16 x 16 tile at p, row-major (element (r, c) at
 * p[r * ldm + c]) when row, else column-major. The first lane of the warp reads the memory;
 * each other lane checks its operands and that the tile's memory still holds what was read
 * (a write to it since the warp arrived is a race with the load on a GPU), and copies. */
template <typename T>
static inline void emu_wmma_load(T *x, const T *p, unsigned ldm, bool row, int kind,
                                 int layout)
{
    const char *call = "load_matrix_sync";
    const size_t line = 16 * sizeof(T);     /* bytes of one row (or column) in memory */
    bool first;
    emu_wmma_shared *s = emu_wmma_join(call, kind, &first);
    if (s != NULL && !first) {
        emu_wmma_same_operands(s, first, call, p, ldm, layout);
        for (size_t i = 0; i < 16; i++)
            if (memcmp(s->in + i * line, p + i * ldm, line) != 0) {
                char what[256];
                snprintf(what, sizeof(what), "the tile at %p changed after lane %d of its warp "
                         "loaded it (a thread wrote it with no barrier between the write and "
                         "this load: a race on a GPU)", (const void *)p, s->lane);
                emu_wmma_fault(call, what);
            }
        memcpy((void *)x, s->out, 256 * sizeof(T));
        return;
    }
    T raw[256];     /* raw[i * 16 + j] = p[i * ldm + j] */
    for (size_t i = 0; i < 16; i++)
        memcpy((void *)(raw + i * 16), p + i * ldm, line);
    if (row) {
        memcpy((void *)x, raw, sizeof(raw));
    } else {
        for (size_t r = 0; r < 16; r++)
            for (size_t c = 0; c < 16; c++)
                x[r * 16 + c] = raw[c * 16 + r];
    }
    if (s != NULL) {
        emu_wmma_same_operands(s, first, call, p, ldm, layout);
        memcpy(s->in, raw, sizeof(raw));
        memcpy(s->out, (const void *)x, sizeof(raw));
    }
}

/* ---- the calls --------------------------------------------------------------------------- */

template <typename Use, typename T, typename Layout>
static inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout> &a, const T *p,
                                    unsigned ldm)
{
    static_assert(!std::is_same<Use, accumulator>::value,
                  "an accumulator's load_matrix_sync names its layout_t");
    emu_wmma_operand("load_matrix_sync", p, ldm, 8);
    emu_wmma_arrive("load_matrix_sync");
    emu_wmma_load<T>(a.x, p, ldm, std::is_same<Layout, row_major>::value,
                     emu_wmma_kind<Use, T, Layout>(), 0);
}

static inline void load_matrix_sync(emu_acc &a, const float *p, unsigned ldm, layout_t layout)
{
    emu_wmma_operand("load_matrix_sync", p, ldm, 4);
    emu_wmma_arrive("load_matrix_sync");
    emu_wmma_load<float>(a.x, p, ldm, layout == mem_row_major,
                         emu_wmma_kind<accumulator, float, void>(),
                         layout == mem_row_major ? 1 : 2);
}

/* Each lane writes the elements r * 16 + c = its lane (mod 32): see the top of the file. */
static inline void store_matrix_sync(float *p, const emu_acc &a, unsigned ldm, layout_t layout)
{
    emu_wmma_operand("store_matrix_sync", p, ldm, 4);
    emu_wmma_arrive("store_matrix_sync");
    bool first;
    emu_wmma_shared *s = emu_wmma_join("store_matrix_sync",
                                       emu_wmma_kind<accumulator, float, void>(), &first);
    if (s != NULL)
        emu_wmma_same_operands(s, first, "store_matrix_sync", p, ldm,
                               layout == mem_row_major ? 1 : 2);
    for (size_t e = (size_t)emu_lane(); e < 256; e += 32) {
        size_t r = e / 16, c = e % 16;
        p[layout == mem_row_major ? r * ldm + c : c * ldm + r] = a.x[e];
    }
}

/* v: the fragment's element type (float for an accumulator, __half or __nv_bfloat16 for A
 * and B: there is no conversion from float to those) */
template <typename Use, typename T, typename Layout>
static inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout> &a,
                                 const typename std::common_type<T>::type &v)
{
    for (int i = 0; i < a.num_elements; i++)
        a.x[i] = v;
}

/* The first lane of the warp computes the product; each other lane checks that its A, B and
 * C hold the same bits as that lane's and copies the result. */
template <typename T, typename LA, typename LB>
static inline void mma_sync(emu_acc &d, const fragment<matrix_a, 16, 16, 16, T, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, T, LB> &b, const emu_acc &c)
{
    emu_wmma_arrive("mma_sync");
    bool first;
    emu_wmma_shared *s = emu_wmma_join(
        "mma_sync", emu_wmma_kind<matrix_a, T, LA>() | emu_wmma_kind<matrix_b, T, LB>() << 6,
        &first);
    if (s == NULL) {
        float out[256];
        emu_wmma_product(out, a.x, b.x, c.x);
        memcpy(d.x, out, sizeof(out));
        return;
    }
    const size_t na = sizeof(a.x), nb = sizeof(b.x), nc = sizeof(c.x);
    static_assert(sizeof(a.x) + sizeof(b.x) + sizeof(c.x) <= sizeof(s->in), "A, B, C fit");
    if (first) {
        memcpy(s->in, (const void *)a.x, na);
        memcpy(s->in + na, (const void *)b.x, nb);
        memcpy(s->in + na + nb, c.x, nc);
        emu_wmma_product(s->out, a.x, b.x, c.x);
    } else {
        const char *which = memcmp(s->in, (const void *)a.x, na) != 0        ? "A"
                            : memcmp(s->in + na, (const void *)b.x, nb) != 0 ? "B"
                            : memcmp(s->in + na + nb, c.x, nc) != 0          ? "C"
                                                                             : NULL;
        if (which != NULL) {
            char what[192];
            snprintf(what, sizeof(what), "its %s fragment differs from that of lane %d of its "
                     "warp (a warp's lanes must pass fragments that hold the same tile)", which,
                     s->lane);
            emu_wmma_fault("mma_sync", what);
        }
    }
    memcpy(d.x, s->out, sizeof(d.x));
}

}  // namespace wmma
}  // namespace nvcuda

#endif /* AMPD_CUDAEMU_MMA_H */
