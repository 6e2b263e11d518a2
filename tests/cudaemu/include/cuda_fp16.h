/*
 * cuda_fp16.h (emulator) - CUDA's half-precision type for kernels built as host C++ under
 * tests/cudaemu: __half is 2 bytes holding the IEEE binary16 bits, so that device memory of
 * uint16_t can be read as `reinterpret_cast<const __half *>(p)` and __half arrays can be
 * __shared__, as on a GPU. It has no arithmetic and no implicit conversions (the real type
 * has them): kernels convert with the functions below, which compute what CUDA's do
 * (round to nearest even; a NaN becomes the canonical 0x7FFF; a float too large for
 * binary16 becomes infinity).
 *
 * Invariants: __half is trivially copyable and trivially default-constructible, with the
 * size and alignment of unsigned short; its bits are reached only through the functions
 * here (memcpy, so there is no aliasing to get wrong).
 *
 * Threads: pure functions, any thread.
 */
#ifndef AMPD_CUDAEMU_FP16_H
#define AMPD_CUDAEMU_FP16_H

#include <stdint.h>
#include <string.h>

struct __half {
    __half() = default;

  private:
    unsigned short emu_bits;    /* binary16: sign, 5 exponent bits, 10 mantissa bits */
};

static_assert(sizeof(__half) == 2 && alignof(__half) == 2, "__half is two bytes");

static inline unsigned short __half_as_ushort(__half h)
{
    unsigned short u;
    memcpy(&u, &h, sizeof(u));
    return u;
}

static inline __half __ushort_as_half(unsigned short u)
{
    __half h;
    memcpy((void *)&h, &u, sizeof(h));    /* the bits are all there is to it */
    return h;
}

/* exact: every binary16 value is a float */
static inline float __half2float(__half h)
{
    uint32_t u = __half_as_ushort(h), sign = (u & 0x8000u) << 16, e = u >> 10 & 0x1Fu,
             m = u & 0x3FFu, f;
    if (e == 0x1Fu) {
        f = sign | 0x7F800000u | m << 13;           /* infinity, NaN (payload kept) */
    } else if (e != 0) {
        f = sign | (e + 112u) << 23 | m << 13;      /* normal: rebias 15 -> 127 */
    } else if (m == 0) {
        f = sign;
    } else {                                        /* subnormal: m * 2^-24, normalised */
        int s = __builtin_clz(m) - 21;              /* shifts that bring bit 10 to m's top */
        f = sign | (uint32_t)(113 - s) << 23 | (m << s & 0x3FFu) << 13;
    }
    float x;
    memcpy(&x, &f, sizeof(x));
    return x;
}

static inline __half __float2half_rn(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    uint32_t sign = u >> 16 & 0x8000u, a = u & 0x7FFFFFFFu, r, rem, half;
    if (a > 0x7F800000u)
        return __ushort_as_half(0x7FFFu);
    if (a >= 0x477FF000u)                   /* 65520 and up round past 65504: infinity */
        return __ushort_as_half((unsigned short)(sign | 0x7C00u));
    if (a >= 0x38800000u) {                 /* normal in binary16: drop 13 mantissa bits */
        r = (a - 0x38000000u) >> 13;
        rem = a & 0x1FFFu;
        half = 0x1000u;
    } else if (a < 0x33000000u) {           /* below half the smallest subnormal: zero */
        return __ushort_as_half((unsigned short)sign);
    } else {                                /* subnormal: round x * 2^24 to an integer */
        uint32_t shift = 126u - (a >> 23), m = (a & 0x7FFFFFu) | 0x800000u;
        r = m >> shift;
        rem = m & ((1u << shift) - 1u);
        half = 1u << (shift - 1u);
    }
    if (rem > half || (rem == half && (r & 1u)))
        r++;                                /* a carry moves to the next exponent: right */
    return __ushort_as_half((unsigned short)(sign | r));
}

static inline __half __float2half(float x) { return __float2half_rn(x); }

#endif /* AMPD_CUDAEMU_FP16_H */
