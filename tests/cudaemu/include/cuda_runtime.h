/*
 * cuda_runtime.h (emulator) - lets the CUDA backend's kernels compile as host C++ and run on
 * the CPU under tests/cudaemu/emu.cc: the execution-space keywords become nothing, the
 * built-in variables (threadIdx, blockIdx, blockDim, gridDim) are the emulator's, and the
 * device intrinsics ampd uses are host functions with the same results (the _rn arithmetic
 * is exact IEEE fp32/fp64 arithmetic; the objects are built with -ffp-contract=off). The
 * synchronising ones (__syncthreads, __syncwarp, the warp shuffles) suspend the calling
 * emulated thread until its block or warp has arrived. A launch `k<<<g, b, s, st>>>(args)`
 * is rewritten to `emu_launch(emu_config(g, b, s, st), "k", k, args)` by cu2cc.sh.
 *
 * In C it is only the runtime API (cuda_runtime_api.h).
 *
 * Threads: kernels run one at a time, one emulated thread at a time (emu.cc holds a lock).
 */
#ifndef AMPD_CUDAEMU_RUNTIME_H
#define AMPD_CUDAEMU_RUNTIME_H

#include "cuda_runtime_api.h"

#ifdef __cplusplus
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
static const int warpSize = 32;

struct uint3 {
    unsigned x, y, z;
};

struct alignas(8) float2 {   /* CUDA's vector type: 8-byte aligned, so one 64-bit access */
    float x, y;
};

static inline float2 make_float2(float x, float y)
{
    return float2{x, y};
}

struct alignas(16) float4 {  /* 16-byte aligned: one 128-bit access */
    float x, y, z, w;
};

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

/* the built-in variables of the emulated thread that is running */
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

/* ---- the emulator's entry points (emu.cc) ------------------------------------------------ */

struct emu_config {
    dim3 grid, block;
    size_t shared;
    cudaStream_t stream;
    emu_config(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = 0)
        : grid(g), block(b), shared(s), stream(st) {}
};

/* Run body(arg) once per thread of the grid described by c (blocks one after another, the
 * threads of a block as cooperative fibers). Records a launch error for cudaGetLastError.
 * name: the kernel's, for messages. */
void emu_run(const emu_config &c, const char *name, void (*body)(void *), void *arg);
/* Suspend the calling thread until every live thread of its block has called it. */
void emu_syncthreads(void);
/* Suspend until the live lanes of mask in the caller's warp have called it. */
void emu_syncwarp(unsigned mask);
/* Exchange a 64-bit value within the caller's warp: returns the value lane src passed. */
uint64_t emu_exchange(unsigned mask, uint64_t v, int src);
/* The caller's lane (0..31) in its warp. */
int emu_lane(void);
/* For warp-collective calls (ptx_mma.h): the caller's warp's EMU_WARP_SHARED bytes of scratch
 * (64-byte aligned, kept across launches, initially zero), and in *gen the number of the
 * full-warp barrier (__syncwarp() or a shuffle with the whole mask) that last let the caller
 * run, or 0 when that was something else (its start, __syncthreads, a barrier of a partial
 * mask). The numbers are unique in the process: the lanes that one barrier released, and
 * only they, see the same one. */
#define EMU_WARP_SHARED 4096
void *emu_warp_shared(unsigned long long *gen);

template <typename... P, typename... A>
static inline void emu_launch(const emu_config &c, const char *name, void (*k)(P...),
                              A &&...args)
{
    std::tuple<P...> params(std::forward<A>(args)...);   /* converted once, as at a launch */
    struct call {
        void (*k)(P...);
        std::tuple<P...> *params;
        static void run(void *p)
        {
            call *self = (call *)p;
            std::apply(self->k, *self->params);
        }
    } cl = {k, &params};
    emu_run(c, name, call::run, &cl);
}

/* ---- intrinsics -------------------------------------------------------------------------- */

static inline void __syncthreads(void) { emu_syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) { emu_syncwarp(mask); }

template <typename T>
static inline T emu_shfl_bits(unsigned mask, T v, int src)
{
    static_assert(sizeof(T) <= 8, "shuffled values are at most 64 bits");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    u = emu_exchange(mask, u, src);
    T r;
    memcpy(&r, &u, sizeof(T));
    return r;
}

/* width: a power of two <= 32; lanes form groups of width (CUDA's semantics) */
template <typename T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32)
{
    int lane = emu_lane(), base = lane & ~(width - 1);
    return emu_shfl_bits(mask, v, base + (src & (width - 1)));
}

template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    int lane = emu_lane(), pos = lane & (width - 1);
    int src = pos + (int)delta < width ? lane + (int)delta : lane;
    return emu_shfl_bits(mask, v, src);
}

template <typename T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    int lane = emu_lane(), pos = lane & (width - 1);
    int src = pos >= (int)delta ? lane - (int)delta : lane;
    return emu_shfl_bits(mask, v, src);
}

template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lanemask, int width = 32)
{
    int lane = emu_lane(), src = lane ^ lanemask;
    /* a lane of a later group is out of reach: the caller keeps its own value */
    if ((src & ~(width - 1)) > (lane & ~(width - 1)))
        src = lane;
    return emu_shfl_bits(mask, v, src);
}

static inline unsigned __float_as_uint(float x)
{
    unsigned u;
    memcpy(&u, &x, sizeof(u));
    return u;
}
static inline float __uint_as_float(unsigned u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}
static inline int __float_as_int(float x) { return (int)__float_as_uint(x); }
static inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
static inline double __longlong_as_double(long long i)
{
    double x;
    memcpy(&x, &i, sizeof(x));
    return x;
}
static inline long long __double_as_longlong(double x)
{
    long long i;
    memcpy(&i, &x, sizeof(i));
    return i;
}
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline float __double2float_rn(double a) { return (float)a; }
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
/* The fast intrinsics compute the exact functions here (a GPU's are a few ulp off). glibc's
 * math.h declares __expf and __logf, which libm does not export: those names are the
 * emulator's functions. */
static inline float __fdividef(float a, float b) { return a / b; }
static inline float emu_expf(float a) { return expf(a); }
static inline float emu_logf(float a) { return logf(a); }
#define __expf emu_expf
#define __logf emu_logf
template <typename T>
static inline T __ldg(const T *p) { return *p; }

static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline unsigned long long max(unsigned long long a, unsigned long long b)
{
    return a > b ? a : b;
}
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline unsigned long long min(unsigned long long a, unsigned long long b)
{
    return a < b ? a : b;
}
static inline float min(float a, float b) { return fminf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }

/* Atomics: kernels run one emulated thread at a time, so a plain read-modify-write is
 * atomic. Each returns the old value, as CUDA's do. */
template <typename T, typename U>
static inline T atomicAdd(T *p, U v)
{
    T old = *p;
    *p = (T)(old + (T)v);
    return old;
}
template <typename T, typename U>
static inline T atomicMax(T *p, U v)
{
    T old = *p;
    if ((T)v > old)
        *p = (T)v;
    return old;
}
template <typename T, typename U>
static inline T atomicMin(T *p, U v)
{
    T old = *p;
    if ((T)v < old)
        *p = (T)v;
    return old;
}
template <typename T, typename U, typename V>
static inline T atomicCAS(T *p, U compare, V val)
{
    T old = *p;
    if (old == (T)compare)
        *p = (T)val;
    return old;
}
template <typename T, typename U>
static inline T atomicExch(T *p, U v)
{
    T old = *p;
    *p = (T)v;
    return old;
}

/* the C++ overloads of the real header */
template <typename T>
static inline cudaError_t cudaMalloc(T **p, size_t size)
{
    return cudaMalloc((void **)p, size);
}
template <typename T>
static inline cudaError_t cudaHostAlloc(T **p, size_t size, unsigned int flags)
{
    return cudaHostAlloc((void **)p, size, flags);
}

#endif /* __cplusplus */

#endif /* AMPD_CUDAEMU_RUNTIME_H */
