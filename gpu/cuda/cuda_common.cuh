/*
 * cuda_common.cuh - shared pieces of the CUDA backend, for CUDA sources only: the kernel
 * files gpu/cuda/cuda_*.cu and the tests' wrappers in tests/cudahost.
 *
 * Holds the error-checking macros (they log the CUDA error with file:line to stderr and
 * turn it into GPU_ECUDA; a daemon never exits on a CUDA error), the "is there a device"
 * check every host wrapper starts with, and the fp32 <-> fp16/bf16 conversions as
 * __host__ __device__ functions with exactly the semantics of gpu/format.c: round to nearest
 * even, subnormals kept, every NaN -> 0x7E00 / 0x7FC0, NaN widening keeps sign and payload
 * and sets the quiet bit. They use integer bit operations only (not __float2half, whose NaN
 * and rounding behaviour differ), so they match the CPU bit for bit whatever the FTZ mode.
 * Also the 16-byte chunk of eight 16-bit values that vectorised loads move.
 *
 * Threads: the helpers are pure; the macros touch only the calling thread's CUDA error state.
 */
#ifndef AMPD_CUDA_COMMON_CUH
#define AMPD_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu/gpu.h"

/* ---- errors ------------------------------------------------------------------------------ */

/* Log a failed CUDA call and return GPU_ECUDA. what is the call's source text. */
static inline int gpu_cuda_fail(cudaError_t e, const char *what, const char *file, int line)
{
    fprintf(stderr, "%s:%d: CUDA error %s: %s (in %s)\n", file, line, cudaGetErrorName(e),
            cudaGetErrorString(e), what);
    return GPU_ECUDA;
}

/* For functions with a `fail:` cleanup label and an `int rc`: on error set rc, jump. */
#define GPU_CUDA_TRY(call)                                                  \
    do {                                                                    \
        cudaError_t e_ = (call);                                            \
        if (e_ != cudaSuccess) {                                            \
            rc = gpu_cuda_fail(e_, #call, __FILE__, __LINE__);              \
            goto fail;                                                      \
        }                                                                   \
    } while (0)

/* For functions that hold no resources: on error return GPU_ECUDA. */
#define GPU_CUDA_CHECK(call)                                                \
    do {                                                                    \
        cudaError_t e_ = (call);                                            \
        if (e_ != cudaSuccess)                                              \
            return gpu_cuda_fail(e_, #call, __FILE__, __LINE__);            \
    } while (0)

/* 0 when at least one CUDA device is visible, else GPU_ENODEV (no driver, no device). The
 * failed query's error is cleared so that it does not surface in a later call. */
static inline int gpu_cuda_ready(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return GPU_ENODEV;
    }
    return count > 0 ? 0 : GPU_ENODEV;
}

/* Blocks for a grid-stride loop over n elements with `threads` threads per block. */
static inline unsigned gpu_cuda_blocks(size_t n, unsigned threads, unsigned cap)
{
    size_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    return b > cap ? cap : (unsigned)b;
}

/* ---- fp32 <-> fp16 / bf16 (bit patterns in, bit patterns out) ---------------------------- */

__host__ __device__ static __forceinline__ uint32_t gpu_dev_f2u(float x)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
#endif
}

__host__ __device__ static __forceinline__ float gpu_dev_u2f(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
#endif
}

__host__ __device__ static __forceinline__ uint16_t gpu_dev_f32_to_f16(uint32_t u)
{
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;

    if (a > 0x7F800000u)
        return (uint16_t)GPU_FP16_NAN;
    if (a >= 0x477FF000u)                 /* 65520 and above, inf included */
        return (uint16_t)(sign | 0x7C00u);
    if (a >= 0x38800000u) {               /* fp16 normal: rebias, round 13 bits to even */
        uint32_t r = a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a < 0x33000000u)                  /* below 2^-25 */
        return (uint16_t)sign;
    uint32_t shift = 126u - (a >> 23);    /* fp16 subnormal: 14 .. 24 */
    uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
    uint32_t h = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

__host__ __device__ static __forceinline__ uint32_t gpu_dev_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;

    if (e == 0x1Fu)
        return m == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (m << 13));
    if (e != 0)
        return sign | ((e + 112u) << 23) | (m << 13);
    if (m == 0)
        return sign;
#ifdef __CUDA_ARCH__
    uint32_t p = 31u - (uint32_t)__clz(m);
#else
    uint32_t p = 31u - (uint32_t)__builtin_clz(m);
#endif
    return sign | ((p + 103u) << 23) | ((m << (23u - p)) & 0x007FFFFFu);
}

/* bf16 rounding; the result is a float bit pattern whose low 16 bits are zero */
__host__ __device__ static __forceinline__ uint32_t gpu_dev_bf16_round(uint32_t u)
{
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint32_t)GPU_BF16_NAN << 16;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

__host__ __device__ static __forceinline__ uint16_t gpu_dev_f32_to_bf16(uint32_t u)
{
    return (uint16_t)(gpu_dev_bf16_round(u) >> 16);
}

__host__ __device__ static __forceinline__ uint32_t gpu_dev_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        u |= 0x00400000u;
    return u;
}

/* ---- 16-byte chunks of 16-bit values --------------------------------------------------- */

/* Eight 16-bit values: one 16-byte load or store. */
struct alignas(16) gpu_dev_chunk {
    uint32_t w[4];
};

/* The bit pattern of value e (< 8) of a chunk. */
__host__ __device__ static __forceinline__ uint16_t gpu_dev_chunk_bits(const gpu_dev_chunk &c,
                                                                       int e)
{
    return (uint16_t)(c.w[e / 2] >> (e % 2 * 16));
}

#endif /* AMPD_CUDA_COMMON_CUH */
