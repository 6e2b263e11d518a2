/*
 * cuda_bf16.h (emulator) - CUDA's bfloat16 type for kernels built as host C++ under
 * tests/cudaemu: __nv_bfloat16 is 2 bytes holding the bfloat16 bits (the top half of a
 * float's), so that device memory of uint16_t can be read as
 * `reinterpret_cast<const __nv_bfloat16 *>(p)` and __nv_bfloat16 arrays can be __shared__,
 * as on a GPU. It has no arithmetic and no implicit conversions (the real type has them):
 * kernels convert with the functions below, which compute what CUDA's do (round to
 * nearest even; a NaN becomes the canonical 0x7FFF).
 *
 * Invariants: __nv_bfloat16 is trivially copyable and trivially default-constructible, with
 * the size and alignment of unsigned short; its bits are reached only through the functions
 * here (memcpy).
 *
 * Threads: pure functions, any thread.
 */
#ifndef AMPD_CUDAEMU_BF16_H
#define AMPD_CUDAEMU_BF16_H

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    __nv_bfloat16() = default;

  private:
    unsigned short emu_bits;    /* sign, 8 exponent bits, 7 mantissa bits */
};

static_assert(sizeof(__nv_bfloat16) == 2 && alignof(__nv_bfloat16) == 2,
              "__nv_bfloat16 is two bytes");

static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h)
{
    unsigned short u;
    memcpy(&u, &h, sizeof(u));
    return u;
}

static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u)
{
    __nv_bfloat16 h;
    memcpy((void *)&h, &u, sizeof(h));    /* the bits are all there is to it */
    return h;
}

/* exact: the bits are a float's top half */
static inline float __bfloat162float(__nv_bfloat16 h)
{
    uint32_t u = (uint32_t)__bfloat16_as_ushort(h) << 16;
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

static inline __nv_bfloat16 __float2bfloat16_rn(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return __ushort_as_bfloat16(0x7FFFu);
    u += 0x7FFFu + (u >> 16 & 1u);      /* ties to even; a carry rounds up to infinity */
    return __ushort_as_bfloat16((unsigned short)(u >> 16));
}

static inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }

#endif /* AMPD_CUDAEMU_BF16_H */
