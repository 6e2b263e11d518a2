/*
 * format_rule.h - the scalar conversions between fp32 and fp16/bf16, on bit patterns, written
 * once for the host and the device: gpu/format.c's reference conversions (gpu_f32_to_f16 and
 * the rest, which every vector path is tested against) are these functions, and the CUDA
 * kernels call them as they are (gpu/cuda/cuda_common.cuh). Internal to the gpu/ module.
 *
 * Semantics (gpu.h's contract): fp32 -> fp16/bf16 rounds to nearest, ties to even; subnormal
 * results are produced, never flushed; +-inf is kept; every NaN becomes the canonical quiet
 * NaN of the target (GPU_FP16_NAN, GPU_BF16_NAN); fp16 overflows to inf at |x| >= 65520,
 * bf16 at |x| >= 0x7F7F8000. fp16/bf16 -> fp32 is exact; a NaN widens with its sign and
 * payload kept and the quiet bit set.
 *
 * Invariants: integer arithmetic only, so no floating-point mode (FTZ/DAZ, rounding) can
 * change a result, and host and device agree bit for bit. Plain C that C, C++ and CUDA read
 * alike: GPU_FMT is `__host__ __device__ static __forceinline__` under nvcc and `static
 * inline` otherwise (the C compiler, and the CUDA emulator's host C++ of tests/cudaemu).
 * Threads: pure functions.
 */
#ifndef AMPD_GPU_FORMAT_RULE_H
#define AMPD_GPU_FORMAT_RULE_H

#include <stdint.h>
#include <string.h>

#include "gpu/gpu.h"

#ifdef __CUDACC__
#define GPU_FMT __host__ __device__ static __forceinline__
#else
#define GPU_FMT static inline
#endif

/* The bits of x, and the float of the bits u. */
GPU_FMT uint32_t gpu_fmt_f2u(float x)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
#endif
}

GPU_FMT float gpu_fmt_u2f(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
#endif
}

GPU_FMT uint16_t gpu_fmt_f32_to_f16(uint32_t u)
{
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;

    if (a > 0x7F800000u)
        return (uint16_t)GPU_FP16_NAN;
    if (a >= 0x477FF000u)                 /* 65520 and above, inf included */
        return (uint16_t)(sign | 0x7C00u);
    if (a >= 0x38800000u) {               /* 2^-14 and above: fp16 normal */
        /* rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even */
        uint32_t r = a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a < 0x33000000u)                  /* below 2^-25: rounds to zero */
        return (uint16_t)sign;
    /* fp16 subnormal: the result is round(m * 2^(e - 126)), e in [102, 112] */
    uint32_t shift = 126u - (a >> 23);    /* 14 .. 24 */
    uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
    uint32_t h = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u)))
        h++;                              /* may carry into 0x0400, the smallest normal */
    return (uint16_t)(sign | h);
}

GPU_FMT uint32_t gpu_fmt_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;

    if (e == 0x1Fu) /* inf, or NaN: payload kept, quiet bit set */
        return m == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (m << 13));
    if (e != 0)
        return sign | ((e + 112u) << 23) | (m << 13);
    if (m == 0)
        return sign;
    /* subnormal: value m * 2^-24 with the top set bit of m at position p (0..9) */
#ifdef __CUDA_ARCH__
    uint32_t p = 31u - (uint32_t)__clz(m);
#else
    uint32_t p = 31u - (uint32_t)__builtin_clz(m);
#endif
    return sign | ((p + 103u) << 23) | ((m << (23u - p)) & 0x007FFFFFu);
}

/* bf16 rounding of the fp32 bits u, returned as fp32 bits with the low half zero: the
 * conversion's rounding, which fused passes inline. */
GPU_FMT uint32_t gpu_fmt_bf16_round(uint32_t u)
{
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint32_t)GPU_BF16_NAN << 16;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

GPU_FMT uint16_t gpu_fmt_f32_to_bf16(uint32_t u)
{
    return (uint16_t)(gpu_fmt_bf16_round(u) >> 16);
}

GPU_FMT uint32_t gpu_fmt_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        u |= 0x00400000u; /* NaN: quiet bit set */
    return u;
}

#endif /* AMPD_GPU_FORMAT_RULE_H */
