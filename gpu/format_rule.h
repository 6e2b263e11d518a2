/*
 * format_rule.h - the scalar conversions between fp32 and fp16/bf16/fp8, on bit patterns, written
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

/* ---- fp8 (gpu/fp8.c's semantics: gpu.h, "fp8"; NVIDIA's __nv_cvt_float_to_fp8) ---------
 * e5m2 selects E5M2 (else E4M3). fp32 bits u -> fp8: round to nearest even on the exact
 * value, subnormals and signed zeros kept; past the largest finite value (+-inf too) +-max
 * when sat, else E4M3's NaN (0x7F | sign) or E5M2's +-inf; every NaN 0x7F. */
GPU_FMT uint8_t gpu_fmt_f32_to_fp8(uint32_t u, int e5m2, int sat)
{
    int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    uint32_t zero_below = e5m2 ? 0x37000000u : 0x3A800000u; /* half the smallest subnormal */
    uint32_t too_big = e5m2 ? 0x47800000u : 0x44000000u;    /* 2^(emax + 1): past every code */
    unsigned max_code = e5m2 ? 0x7Bu : 0x7Eu;
    uint32_t a = u & 0x7FFFFFFFu;
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7F800000u) /* NaN */
        return 0x7Fu;
    if (a <= zero_below)
        return sign;
    unsigned code = 0xFFu;
    if (a < too_big) { /* round to nearest even; a carry moves into the exponent */
        int e = (int)(a >> 23) - 127 + bias;
        uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
        int shift = 23 - mbits + (e < 1 ? 1 - e : 0); /* bits rounded off (<= 24) */
        uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        code = (e >= 1 ? (unsigned)(e - 1) << mbits : 0u) + (m >> shift);
        if (rem > half || (rem == half && (code & 1u)))
            code++;
    }
    if (code > max_code)
        code = sat ? max_code : e5m2 ? 0x7Cu : 0x7Fu;
    return (uint8_t)(sign | code);
}

/* fp8 code v -> fp32 bits, exact; E5M2's infinities stay; every NaN code gives 0x7FC00000. */
GPU_FMT uint32_t gpu_fmt_fp8_to_f32(uint8_t v, int e5m2)
{
    int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    uint32_t mag = v & 0x7Fu, e = mag >> mbits, m = mag & ((1u << mbits) - 1u);
    uint32_t sign = (uint32_t)(v & 0x80u) << 24;
    if (e5m2 ? e == 0x1Fu : mag == 0x7Fu)
        return e5m2 && m == 0 ? sign | 0x7F800000u : 0x7FC00000u;
    if (e > 0)
        return sign | (e - (uint32_t)bias + 127u) << 23 | m << (23 - mbits);
    if (m == 0)
        return sign;
    /* subnormal: m x 2^(1 - bias - mbits), normalised for fp32 */
    int exp = 1 - bias - mbits;
    while (!(m & 0x8u)) { /* make m a 4-bit 1.xxx: each shift halves the exponent's part */
        m <<= 1;
        exp--;
    }
    return sign | (uint32_t)(exp + 3 + 127) << 23 | (m & 0x7u) << 20;
}

#endif /* AMPD_GPU_FORMAT_RULE_H */
