/*
 * format.c - number formats: dtype helpers, the scalar reference conversions between fp32
 * and fp16/bf16, and their vectorised bulk versions, chosen from the CPU's features (cpu.c).
 *
 * Semantics (the contract of gpu.h, identical on every path and on the CUDA kernels):
 *   fp32 -> fp16/bf16: round to nearest, ties to even; subnormal results are produced, never
 *     flushed; +-inf is kept; every NaN becomes the canonical quiet NaN of the target
 *     (GPU_FP16_NAN 0x7E00, GPU_BF16_NAN 0x7FC0, sign dropped); fp16 overflows to inf at
 *     |x| >= 65520, bf16 at |x| >= 0x7F7F8000 (so FLT_MAX -> inf).
 *   fp16/bf16 -> fp32: exact. A NaN input widens the IEEE way: sign and payload kept, the
 *     quiet bit set (this is what VCVTPH2PS does, so the vector path needs no fix-up there).
 * The scalar functions use integer bit manipulation only, so MXCSR (FTZ/DAZ, rounding mode)
 * cannot change a result. The vector paths use VCVTPS2PH/VCVTPH2PS (which ignore FTZ/DAZ and
 * take an explicit rounding mode), fix NaN lanes with a compare and blend, and do bf16
 * rounding with integer arithmetic; where the CPU has AVX512_BF16, with VCVTNE2PS2BF16
 * instead, on vectors without subnormal or NaN lanes (it flushes subnormals and keeps NaN
 * payloads, so those vectors still take the integer rounding).
 *
 * Invariants: every path is bit-identical to the scalar functions for every input
 * (tests/check_format.c checks all 16-bit patterns and millions of random 32-bit ones).
 *
 * Threads: all functions are thread-safe. A bulk conversion of GPU_PAR_MIN elements or more runs
 * on the OpenMP team (omp_get_max_threads, which the engine sets), in blocks of PAR_BLOCK
 * elements, unless the caller is in an active parallel region already; each element's
 * result depends on that element alone, so it is the same with any number of threads. The
 * conversion path is one atomic pointer, chosen at first use or by gpu_cvt_force(), and
 * read once per call.
 */
#include <float.h>
#include <stdatomic.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gpu/gpu_int.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FMT_X86 1
#include <immintrin.h>
#else
#define FMT_X86 0
#endif

/* ---- dtype helpers --------------------------------------------------------------------- */

const char *gpu_dtype_name(gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP32:
        return "fp32";
    case GPU_FP16:
        return "fp16";
    case GPU_BF16:
        return "bf16";
    }
    return "unknown";
}

/* s is borrowed; *out is written only on success. */
int gpu_dtype_parse(const char *s, gpu_dtype *out)
{
    static const gpu_dtype all[] = {GPU_FP32, GPU_FP16, GPU_BF16};

    if (s == NULL || out == NULL)
        return GPU_EINVAL;
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (strcmp(s, gpu_dtype_name(all[i])) == 0) {
            *out = all[i];
            return 0;
        }
    }
    return GPU_EINVAL;
}

size_t gpu_dtype_size(gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP32:
        return 4;
    case GPU_FP16:
    case GPU_BF16:
        return 2;
    }
    return 0;
}

float gpu_dtype_max(gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP32:
        return FLT_MAX;
    case GPU_FP16:
        return GPU_FP16_MAX;
    case GPU_BF16:
        return GPU_BF16_MAX;
    }
    return 0.0f;
}

float gpu_dtype_min_subnormal(gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP32:
        return FLT_TRUE_MIN;              /* 2^-149 */
    case GPU_FP16:
        return 5.9604644775390625e-08f;   /* 2^-24 */
    case GPU_BF16:
        return 9.183549615799121e-41f;    /* 2^-133 */
    }
    return 0.0f;
}

/* ---- scalar reference conversions (integer only: gpu/format_rule.h) ---------------------- */

uint16_t gpu_f32_to_f16(float x)
{
    return gpu_fmt_f32_to_f16(gpu_fmt_f2u(x));
}

float gpu_f16_to_f32(uint16_t h)
{
    return gpu_fmt_u2f(gpu_fmt_f16_to_f32(h));
}

/* Whether a conversion to bf16 has met an fp32 subnormal (or gpu_bf16_admit() a bf16 one)
 * since the process started; never reset. */
static atomic_bool bf16_subnormal_made;

void gpu_bf16_note_subnormal(void)
{
    atomic_store(&bf16_subnormal_made, true);
}

uint16_t gpu_f32_to_bf16(float x)
{
    if (gpu_f32_subnormal(gpu_fmt_f2u(x)))
        gpu_bf16_note_subnormal();
    return gpu_fmt_f32_to_bf16(gpu_fmt_f2u(x));
}

float gpu_bf16_to_f32(uint16_t h)
{
    return gpu_fmt_u2f(gpu_fmt_bf16_to_f32(h));
}

float gpu_round(float x, gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP16:
        return gpu_fmt_u2f(gpu_fmt_f16_to_f32(gpu_fmt_f32_to_f16(gpu_fmt_f2u(x))));
    case GPU_BF16:
        return gpu_fmt_u2f(gpu_fmt_bf16_round(gpu_fmt_f2u(x)));
    case GPU_FP32:
        break;
    }
    return x;
}

/* ---- portable bulk paths ---------------------------------------------------------------- */

static void port_f32_f16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = gpu_fmt_f32_to_f16(gpu_fmt_f2u(src[i]));
}

static void port_f16_f32(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = gpu_fmt_u2f(gpu_fmt_f16_to_f32(src[i]));
}

static unsigned port_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    unsigned sub = 0;
    for (size_t i = 0; i < n; i++) {
        dst[i] = gpu_fmt_f32_to_bf16(gpu_fmt_f2u(src[i]));
        sub |= gpu_f32_subnormal(gpu_fmt_f2u(src[i]));
    }
    return sub;
}

static void port_bf16_f32(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = gpu_fmt_u2f(gpu_fmt_bf16_to_f32(src[i]));
}

static void port_round_f16(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = gpu_fmt_u2f(gpu_fmt_f16_to_f32(gpu_fmt_f32_to_f16(gpu_fmt_f2u(src[i]))));
}

static void port_round_bf16(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = gpu_fmt_u2f(gpu_fmt_bf16_round(gpu_fmt_f2u(src[i])));
}

/* ---- AVX-512 paths (F, BW, VL, DQ): 16 lanes, masked tails ------------------------------ */

#if FMT_X86
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")))
#define FROUND_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

T512 static inline __mmask16 a512_tail(size_t left)
{
    return (__mmask16)((1u << left) - 1u);
}

T512 static inline __m256i v512_f32_f16(__m512 v)
{
    __m256i h = _mm512_cvtps_ph(v, FROUND_RNE);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16((short)GPU_FP16_NAN));
}

/* bf16 rounding: the result in the high half of each 32-bit lane, low half zero */
T512 static inline __m512i v512_bf16_round(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32((int)GPU_BF16_NAN << 16));
}

T512 static inline __m512 v512_bf16_f32(__m256i h)
{
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u),
                                       _CMP_UNORD_Q);
    u = _mm512_mask_or_epi32(u, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(u);
}

T512 static inline __m512 v512_round_f16(__m512 v)
{
    __m512 r = _mm512_cvtph_ps(_mm512_cvtps_ph(v, FROUND_RNE));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(r, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

T512 static void a512_f32_f16(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i h0 = v512_f32_f16(_mm512_loadu_ps(src + i));
        __m256i h1 = v512_f32_f16(_mm512_loadu_ps(src + i + 16));
        _mm256_storeu_si256((__m256i *)(dst + i), h0);
        _mm256_storeu_si256((__m256i *)(dst + i + 16), h1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : a512_tail(n - i);
        __m256i h = v512_f32_f16(_mm512_maskz_loadu_ps(k, src + i));
        _mm256_mask_storeu_epi16(dst + i, k, h);
    }
}

T512 static void a512_f16_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 v0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i)));
        __m512 v1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i + 16)));
        _mm512_storeu_ps(dst + i, v0);
        _mm512_storeu_ps(dst + i + 16, v1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : a512_tail(n - i);
        __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + i));
        _mm512_mask_storeu_ps(dst + i, k, v);
    }
}

/* The lanes of v that are fp32 subnormals. */
T512 static inline __mmask16 v512_subnormal(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    return _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000)) &
           _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x7FFFFF));
}

T512 static unsigned a512_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    /* word indices of the high halves of 32 lanes taken from two vectors */
    const __m512i hi = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39,
                                        37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13,
                                        11, 9, 7, 5, 3, 1);
    __mmask16 sub = 0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 v0 = _mm512_loadu_ps(src + i), v1 = _mm512_loadu_ps(src + i + 16);
        sub |= v512_subnormal(v0) | v512_subnormal(v1);
        __m512i r0 = v512_bf16_round(v0), r1 = v512_bf16_round(v1);
        _mm512_storeu_si512((void *)(dst + i), _mm512_permutex2var_epi16(r0, hi, r1));
    }
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : a512_tail(n - i);
        __m512 v = _mm512_maskz_loadu_ps(k, src + i);
        sub |= v512_subnormal(v);
        __m512i r = v512_bf16_round(v);
        _mm256_mask_storeu_epi16(dst + i, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
    return sub;
}

T512 static void a512_bf16_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 v0 = v512_bf16_f32(_mm256_loadu_si256((const __m256i *)(src + i)));
        __m512 v1 = v512_bf16_f32(_mm256_loadu_si256((const __m256i *)(src + i + 16)));
        _mm512_storeu_ps(dst + i, v0);
        _mm512_storeu_ps(dst + i + 16, v1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : a512_tail(n - i);
        __m512 v = v512_bf16_f32(_mm256_maskz_loadu_epi16(k, src + i));
        _mm512_mask_storeu_ps(dst + i, k, v);
    }
}

T512 static void a512_round_f16(float *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 v0 = v512_round_f16(_mm512_loadu_ps(src + i));
        __m512 v1 = v512_round_f16(_mm512_loadu_ps(src + i + 16));
        _mm512_storeu_ps(dst + i, v0);
        _mm512_storeu_ps(dst + i + 16, v1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : a512_tail(n - i);
        __m512 v = v512_round_f16(_mm512_maskz_loadu_ps(k, src + i));
        _mm512_mask_storeu_ps(dst + i, k, v);
    }
}

T512 static void a512_round_bf16(float *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i r0 = v512_bf16_round(_mm512_loadu_ps(src + i));
        __m512i r1 = v512_bf16_round(_mm512_loadu_ps(src + i + 16));
        _mm512_storeu_si512((void *)(dst + i), r0);
        _mm512_storeu_si512((void *)(dst + i + 16), r1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : a512_tail(n - i);
        __m512i r = v512_bf16_round(_mm512_maskz_loadu_ps(k, src + i));
        _mm512_mask_storeu_epi32(dst + i, k, r);
    }
}

/* ---- AVX512_BF16: the same with the bf16 rounding of VCVTNE(2)PS2BF16 -------------------- */

#define TBF16                                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma,avx512bf16")))

/* The lanes of v the instruction would not round as the contract does: subnormal or NaN. */
TBF16 static inline __mmask16 vbf_odd(__m512 v)
{
    return v512_subnormal(v) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
}

TBF16 static unsigned abf_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    unsigned sub = 0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 v0 = _mm512_loadu_ps(src + i), v1 = _mm512_loadu_ps(src + i + 16);
        if (vbf_odd(v0) | vbf_odd(v1))
            sub |= a512_f32_bf16(dst + i, src + i, 32);
        else
            _mm512_storeu_si512((void *)(dst + i), (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
    return sub | a512_f32_bf16(dst + i, src + i, n - i);
}

TBF16 static void abf_round_bf16(float *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(src + i);
        if (vbf_odd(v)) {
            a512_round_bf16(dst + i, src + i, 16);
            continue;
        }
        __m512i w = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
        _mm512_storeu_si512((void *)(dst + i), _mm512_slli_epi32(w, 16));
    }
    a512_round_bf16(dst + i, src + i, n - i);
}

/* ---- F16C + AVX2 paths: 8 lanes, tails through a small stack buffer --------------------- */

#define T256 __attribute__((target("avx2,f16c,fma")))

T256 static inline __m128i v256_f32_f16(__m256 v)
{
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan),
                                    _mm256_extracti128_si256(nan, 1));
    return _mm_blendv_epi8(h, _mm_set1_epi16((short)GPU_FP16_NAN), nan16);
}

T256 static inline __m256i v256_bf16_round(__m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32((int)GPU_BF16_NAN << 16), nan);
}

T256 static inline __m256 v256_bf16_f32(__m128i h)
{
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    __m256 f = _mm256_castsi256_ps(u);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    u = _mm256_or_si256(u, _mm256_and_si256(nan, _mm256_set1_epi32(0x00400000)));
    return _mm256_castsi256_ps(u);
}

T256 static inline __m256 v256_round_f16(__m256 v)
{
    __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

/* One block of at most 8 elements through the vector code (the tail of every a256 loop). */
T256 static void a256_f32_f16_block(uint16_t *dst, const float *src, size_t n)
{
    float in[8] = {0};
    uint16_t out[8];
    memcpy(in, src, n * sizeof(*src));
    _mm_storeu_si128((__m128i *)out, v256_f32_f16(_mm256_loadu_ps(in)));
    memcpy(dst, out, n * sizeof(*dst));
}

T256 static void a256_f32_f16(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i h0 = v256_f32_f16(_mm256_loadu_ps(src + i));
        __m128i h1 = v256_f32_f16(_mm256_loadu_ps(src + i + 8));
        _mm_storeu_si128((__m128i *)(dst + i), h0);
        _mm_storeu_si128((__m128i *)(dst + i + 8), h1);
    }
    for (; i < n; i += 8)
        a256_f32_f16_block(dst + i, src + i, n - i < 8 ? n - i : 8);
}

T256 static void a256_f16_f32_block(float *dst, const uint16_t *src, size_t n)
{
    uint16_t in[8] = {0};
    float out[8];
    memcpy(in, src, n * sizeof(*src));
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)in)));
    memcpy(dst, out, n * sizeof(*dst));
}

T256 static void a256_f16_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i)));
        __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i + 8)));
        _mm256_storeu_ps(dst + i, v0);
        _mm256_storeu_ps(dst + i + 8, v1);
    }
    for (; i < n; i += 8)
        a256_f16_f32_block(dst + i, src + i, n - i < 8 ? n - i : 8);
}

/* All-ones in the lanes of v that are fp32 subnormals. */
T256 static inline __m256i v256_subnormal(__m256 v)
{
    __m256i u = _mm256_castps_si256(v), zero = _mm256_setzero_si256();
    __m256i exp0 = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)), zero);
    __m256i man0 = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFF)), zero);
    return _mm256_andnot_si256(man0, exp0);
}

T256 static __m256i a256_f32_bf16_block(uint16_t *dst, const float *src, size_t n)
{
    float in[8] = {0};
    uint16_t out[8];
    memcpy(in, src, n * sizeof(*src));
    __m256 v = _mm256_loadu_ps(in);
    __m256i r = _mm256_srli_epi32(v256_bf16_round(v), 16);
    __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)out, h);
    memcpy(dst, out, n * sizeof(*dst));
    return v256_subnormal(v);
}

T256 static unsigned a256_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    __m256i sub = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_loadu_ps(src + i), v1 = _mm256_loadu_ps(src + i + 8);
        sub = _mm256_or_si256(sub, _mm256_or_si256(v256_subnormal(v0), v256_subnormal(v1)));
        __m256i r0 = _mm256_srli_epi32(v256_bf16_round(v0), 16);
        __m256i r1 = _mm256_srli_epi32(v256_bf16_round(v1), 16);
        /* packus interleaves 128-bit halves: r0lo r1lo r0hi r1hi; reorder the quadwords */
        __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
        _mm256_storeu_si256((__m256i *)(dst + i), h);
    }
    for (; i < n; i += 8)
        sub = _mm256_or_si256(sub, a256_f32_bf16_block(dst + i, src + i, n - i < 8 ? n - i : 8));
    return (unsigned)_mm256_movemask_epi8(sub);
}

T256 static void a256_bf16_f32_block(float *dst, const uint16_t *src, size_t n)
{
    uint16_t in[8] = {0};
    float out[8];
    memcpy(in, src, n * sizeof(*src));
    _mm256_storeu_ps(out, v256_bf16_f32(_mm_loadu_si128((const __m128i *)in)));
    memcpy(dst, out, n * sizeof(*dst));
}

T256 static void a256_bf16_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = v256_bf16_f32(_mm_loadu_si128((const __m128i *)(src + i)));
        __m256 v1 = v256_bf16_f32(_mm_loadu_si128((const __m128i *)(src + i + 8)));
        _mm256_storeu_ps(dst + i, v0);
        _mm256_storeu_ps(dst + i + 8, v1);
    }
    for (; i < n; i += 8)
        a256_bf16_f32_block(dst + i, src + i, n - i < 8 ? n - i : 8);
}

T256 static void a256_round_f16_block(float *dst, const float *src, size_t n)
{
    float buf[8] = {0};
    memcpy(buf, src, n * sizeof(*src));
    _mm256_storeu_ps(buf, v256_round_f16(_mm256_loadu_ps(buf)));
    memcpy(dst, buf, n * sizeof(*dst));
}

T256 static void a256_round_f16(float *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = v256_round_f16(_mm256_loadu_ps(src + i));
        __m256 v1 = v256_round_f16(_mm256_loadu_ps(src + i + 8));
        _mm256_storeu_ps(dst + i, v0);
        _mm256_storeu_ps(dst + i + 8, v1);
    }
    for (; i < n; i += 8)
        a256_round_f16_block(dst + i, src + i, n - i < 8 ? n - i : 8);
}

T256 static void a256_round_bf16_block(float *dst, const float *src, size_t n)
{
    float buf[8] = {0};
    memcpy(buf, src, n * sizeof(*src));
    _mm256_storeu_si256((__m256i *)buf, v256_bf16_round(_mm256_loadu_ps(buf)));
    memcpy(dst, buf, n * sizeof(*dst));
}

T256 static void a256_round_bf16(float *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i r0 = v256_bf16_round(_mm256_loadu_ps(src + i));
        __m256i r1 = v256_bf16_round(_mm256_loadu_ps(src + i + 8));
        _mm256_storeu_si256((__m256i *)(dst + i), r0);
        _mm256_storeu_si256((__m256i *)(dst + i + 8), r1);
    }
    for (; i < n; i += 8)
        a256_round_bf16_block(dst + i, src + i, n - i < 8 ? n - i : 8);
}
#endif /* FMT_X86 */

/* ---- dispatch --------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    void (*f32_f16)(uint16_t *, const float *, size_t);
    void (*f16_f32)(float *, const uint16_t *, size_t);
    unsigned (*f32_bf16)(uint16_t *, const float *, size_t); /* nonzero: met a subnormal */
    void (*bf16_f32)(float *, const uint16_t *, size_t);
    void (*round_f16)(float *, const float *, size_t);
    void (*round_bf16)(float *, const float *, size_t);
} cvt_impl;

static const cvt_impl impl_portable = {
    "portable", port_f32_f16, port_f16_f32, port_f32_bf16, port_bf16_f32,
    port_round_f16, port_round_bf16,
};

#if FMT_X86
static const cvt_impl impl_avx512 = {
    "avx512", a512_f32_f16, a512_f16_f32, a512_f32_bf16, a512_bf16_f32,
    a512_round_f16, a512_round_bf16,
};

static const cvt_impl impl_avx512bf16 = {
    "avx512bf16", a512_f32_f16, a512_f16_f32, abf_f32_bf16, a512_bf16_f32,
    a512_round_f16, abf_round_bf16,
};

static const cvt_impl impl_f16c = {
    "f16c", a256_f32_f16, a256_f16_f32, a256_f32_bf16, a256_bf16_f32,
    a256_round_f16, a256_round_bf16,
};
#endif

static _Atomic(const cvt_impl *) cvt_current;

/* The path named name when this CPU can run it, else NULL. */
static const cvt_impl *impl_lookup(const char *name)
{
    if (strcmp(name, "portable") == 0)
        return &impl_portable;
#if FMT_X86
    const gpu_cpu_features *f = gpu_cpu();
    bool a512 = f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->f16c && f->avx2 &&
                f->fma;
    if (strcmp(name, "avx512bf16") == 0 && a512 && f->avx512bf16)
        return &impl_avx512bf16;
    if (strcmp(name, "avx512") == 0 && a512)
        return &impl_avx512;
    if (strcmp(name, "f16c") == 0 && f->f16c && f->avx2 && f->fma)
        return &impl_f16c;
#endif
    return NULL;
}

static const cvt_impl *impl_get(void)
{
    const cvt_impl *p = atomic_load_explicit(&cvt_current, memory_order_acquire);
    if (p != NULL)
        return p;
    p = impl_lookup("avx512bf16");
    if (p == NULL)
        p = impl_lookup("avx512");
    if (p == NULL)
        p = impl_lookup("f16c");
    if (p == NULL)
        p = &impl_portable;
    /* a racing gpu_cvt_force wins; a racing first use stores the same pointer */
    const cvt_impl *expected = NULL;
    if (!atomic_compare_exchange_strong(&cvt_current, &expected, p))
        p = expected;
    return p;
}

const char *gpu_cvt_impl(void)
{
    return impl_get()->name;
}

/* impl is borrowed. */
int gpu_cvt_force(const char *impl)
{
    if (impl == NULL)
        return GPU_EINVAL;
    if (strcmp(impl, "avx512bf16") != 0 && strcmp(impl, "avx512") != 0 &&
        strcmp(impl, "f16c") != 0 && strcmp(impl, "portable") != 0)
        return GPU_EINVAL;
    const cvt_impl *p = impl_lookup(impl);
    if (p == NULL)
        return GPU_ENODEV;
    atomic_store_explicit(&cvt_current, p, memory_order_release);
    return 0;
}

/* ---- bulk entry points (dst and src borrowed, n elements each) -------------------------- */

#define PAR_BLOCK (1 << 14)  /* elements per work item: a multiple of 64 */

typedef enum {
    OP_F32_F16, OP_F16_F32, OP_F32_BF16, OP_BF16_F32, OP_ROUND_F16, OP_ROUND_BF16,
    OP_COPY_F32 /* fp32 to fp32 (memmove: in place allowed) */
} cvt_op;

bool gpu_bf16_subnormals_made(void)
{
    return atomic_load(&bf16_subnormal_made);
}

#ifdef __clang__ /* clang 14 gives clones of static functions global resolvers, which clash */
#define SCAN_HOT
#else
#define SCAN_HOT __attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3")))
#endif

SCAN_HOT static unsigned bf16_subnormals(const uint16_t *restrict x, size_t n)
{
    unsigned any = 0;
    for (size_t i = 0; i < n; i++)
        any |= (unsigned)((x[i] & 0x7F80u) == 0) & (unsigned)((x[i] & 0x7Fu) != 0);
    return any;
}

bool gpu_bf16_has_subnormal(const uint16_t *x, size_t n)
{
    return bf16_subnormals(x, n) != 0;
}

SCAN_HOT static unsigned f32_subnormals(const uint32_t *restrict x, size_t n)
{
    unsigned any = 0;
    for (size_t i = 0; i < n; i++)
        any |= gpu_f32_subnormal(x[i]);
    return any;
}

bool gpu_f32_has_subnormal(const uint32_t *x, size_t n)
{
    return f32_subnormals(x, n) != 0;
}

void gpu_bf16_admit(const uint16_t *x, size_t n)
{
    if (bf16_subnormals(x, n))
        gpu_bf16_note_subnormal();
}

/* Elements [off, off + n) of dst and src through path p's op. */
static void cvt_block(const cvt_impl *p, cvt_op op, void *dst, const void *src, size_t off,
                      size_t n)
{
    switch (op) {
    case OP_F32_F16:
        p->f32_f16((uint16_t *)dst + off, (const float *)src + off, n);
        return;
    case OP_F16_F32:
        p->f16_f32((float *)dst + off, (const uint16_t *)src + off, n);
        return;
    case OP_F32_BF16:
        if (p->f32_bf16((uint16_t *)dst + off, (const float *)src + off, n))
            gpu_bf16_note_subnormal();
        return;
    case OP_BF16_F32:
        p->bf16_f32((float *)dst + off, (const uint16_t *)src + off, n);
        return;
    case OP_ROUND_F16:
        p->round_f16((float *)dst + off, (const float *)src + off, n);
        return;
    case OP_ROUND_BF16:
        p->round_bf16((float *)dst + off, (const float *)src + off, n);
        return;
    case OP_COPY_F32:
        memmove((float *)dst + off, (const float *)src + off, n * sizeof(float));
        return;
    }
}

/* See gpu_int.h. */
bool gpu_par_worth(size_t n)
{
#ifdef _OPENMP
    return n >= GPU_PAR_MIN && omp_get_max_threads() > 1 && !omp_in_parallel();
#else
    (void)n;
    return false;
#endif
}

/* op over n elements on the path in use, in blocks on the OpenMP team when n is large. */
static void cvt_run(cvt_op op, void *dst, const void *src, size_t n)
{
    const cvt_impl *p = impl_get();

    if (!gpu_par_worth(n)) {
        cvt_block(p, op, dst, src, 0, n);
        return;
    }
    size_t nblocks = (n + PAR_BLOCK - 1) / PAR_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nblocks; b++) {
        size_t off = b * PAR_BLOCK;
        cvt_block(p, op, dst, src, off, n - off < PAR_BLOCK ? n - off : PAR_BLOCK);
    }
}

/* Copies n floats from src to dst (memmove when the ranges overlap), in blocks on the OpenMP
 * team when n is large. */
static void copy_run(float *dst, const float *src, size_t n)
{
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src, bytes = n * sizeof(float);

    if (n == 0 || dst == src)
        return;
    if (!gpu_par_worth(n) || (d < s + bytes && s < d + bytes)) {
        memmove(dst, src, bytes);
        return;
    }
    size_t nblocks = (n + PAR_BLOCK - 1) / PAR_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nblocks; b++) {
        size_t off = b * PAR_BLOCK;
        memcpy(dst + off, src + off, (n - off < PAR_BLOCK ? n - off : PAR_BLOCK) * sizeof(float));
    }
}

void gpu_cvt_f32_f16(uint16_t *dst, const float *src, size_t n)
{
    cvt_run(OP_F32_F16, dst, src, n);
}

void gpu_cvt_f16_f32(float *dst, const uint16_t *src, size_t n)
{
    cvt_run(OP_F16_F32, dst, src, n);
}

void gpu_cvt_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    cvt_run(OP_F32_BF16, dst, src, n);
}

void gpu_cvt_bf16_f32(float *dst, const uint16_t *src, size_t n)
{
    cvt_run(OP_BF16_F32, dst, src, n);
}

void gpu_round_n(float *dst, const float *src, size_t n, gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP16:
        cvt_run(OP_ROUND_F16, dst, src, n);
        return;
    case GPU_BF16:
        cvt_run(OP_ROUND_BF16, dst, src, n);
        return;
    case GPU_FP32:
        copy_run(dst, src, n);
        return;
    }
}

void gpu_cvt_to_f32(float *dst, const void *src, gpu_dtype sdt, size_t n)
{
    switch (sdt) {
    case GPU_FP16:
        gpu_cvt_f16_f32(dst, src, n);
        return;
    case GPU_BF16:
        gpu_cvt_bf16_f32(dst, src, n);
        return;
    case GPU_FP32:
        copy_run(dst, src, n);
        return;
    }
}

void gpu_cvt_from_f32(void *dst, gpu_dtype ddt, const float *src, size_t n)
{
    switch (ddt) {
    case GPU_FP16:
        gpu_cvt_f32_f16(dst, src, n);
        return;
    case GPU_BF16:
        gpu_cvt_f32_bf16(dst, src, n);
        return;
    case GPU_FP32:
        copy_run(dst, src, n);
        return;
    }
}

/* op over rows of cols elements, lds elements apart at src and ldd apart at dst, on the
 * calling thread; sdt and ddt: the dtypes of src and dst. */
static void rows_run(cvt_op op, void *dst, gpu_dtype ddt, size_t ldd, const void *src,
                     gpu_dtype sdt, size_t lds, size_t rows, size_t cols)
{
    const cvt_impl *p = impl_get();
    size_t ed = gpu_dtype_size(ddt), es = gpu_dtype_size(sdt);
    for (size_t r = 0; r < rows; r++)
        cvt_block(p, op, (char *)dst + r * ldd * ed, (const char *)src + r * lds * es, 0, cols);
}

void gpu_cvt_rows_from_f32(void *dst, gpu_dtype ddt, size_t ldd, const float *src, size_t lds,
                           size_t rows, size_t cols)
{
    cvt_op op = ddt == GPU_FP32 ? OP_COPY_F32 : ddt == GPU_FP16 ? OP_F32_F16 : OP_F32_BF16;
    rows_run(op, dst, ddt, ldd, src, GPU_FP32, lds, rows, cols);
}

void gpu_cvt_rows_to_f32(float *dst, size_t ldd, const void *src, gpu_dtype sdt, size_t lds,
                         size_t rows, size_t cols)
{
    cvt_op op = sdt == GPU_FP32 ? OP_COPY_F32 : sdt == GPU_FP16 ? OP_F16_F32 : OP_BF16_F32;
    rows_run(op, dst, GPU_FP32, ldd, src, sdt, lds, rows, cols);
}

void gpu_round_rows(float *dst, size_t ldd, const float *src, size_t lds, size_t rows,
                    size_t cols, gpu_dtype dt)
{
    cvt_op op = dt == GPU_FP32 ? OP_COPY_F32 : dt == GPU_FP16 ? OP_ROUND_F16 : OP_ROUND_BF16;
    rows_run(op, dst, GPU_FP32, ldd, src, GPU_FP32, lds, rows, cols);
}
