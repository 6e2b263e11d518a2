/*
 * fp8.c - the two 8-bit floating-point formats of FP8 training (OCP's, NVIDIA's): E4M3
 * (bias 7, largest 448, no infinity, NaN S.1111.111) and E5M2 (bias 15, largest 57344,
 * IEEE-like infinities and NaNs), converted from and to fp32.
 *
 * Semantics (the contract of gpu.h; NVIDIA's __nv_cvt_float_to_fp8 gives the same bits:
 * tests/check_fp8.c compares them, for every fp32 input with AMPD_FP8_SWEEP=full):
 *   fp32 -> fp8: round to nearest, ties to even, on the exact value; subnormal results and
 *     signed zeros are kept (a value at or below half the smallest subnormal becomes a zero
 *     of its sign). A value whose rounding lands beyond the largest finite one (and +-inf)
 *     becomes +-max when saturating; otherwise E4M3 gives its NaN with the sign (0x7F|s) and
 *     E5M2 +-inf. Every NaN becomes the one NaN code 0x7F (sign dropped), in both formats.
 *   fp8 -> fp32: exact; E5M2's infinities are +-inf; every NaN code gives the canonical quiet
 *     NaN 0x7FC00000.
 * Integer arithmetic on the bits only, so MXCSR (FTZ/DAZ, the rounding mode) cannot change
 * a result. The bulk encoding runs the same arithmetic on 16 lanes (AVX-512F), 8 (AVX2) or one
 * at a time (portable), the widest this CPU has, chosen from CPUID; decoding reads a table of
 * the 256 codes.
 * Both run on the OpenMP team from GPU_PAR_MIN elements, in blocks: each element's result
 * depends on that element alone.
 *
 * Scaling (Transformer Engine's recipes, per tensor): current scaling from this step's amax;
 * delayed scaling from a history of amaxes, computed before the history rolls, the previous
 * scale kept for an amax of 0, inf or NaN, an infinite scale made FLT_MAX, and nothing
 * changed in a step whose amax is 0 (TE: a module that did not run). The division is fp32
 * round-to-nearest, so the scales are the bits TE computes. The rules are gpu/fp8_rule.h's,
 * written once for the host and the device.
 *
 * Threads: all functions are thread-safe (the tables are built once, under pthread_once).
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "gpu/fp8_rule.h"
#include "gpu/gpu_int.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FP8_X86 1
#include <immintrin.h>
#else
#define FP8_X86 0
#endif

typedef struct {
    int mbits, bias;
    uint32_t zero_below; /* |x| bits at or below half the smallest subnormal: a zero */
    uint32_t too_big;    /* |x| bits at 2^(emax + 1) and above: past every code */
    uint8_t max_code;    /* the largest finite value's code */
} fp8_fmt;

static const fp8_fmt fmts[2] = {
    [GPU_E4M3] = {3, 7, 0x3A800000u /* 2^-10 */, 0x44000000u /* 512 */, 0x7E},
    [GPU_E5M2] = {2, 15, 0x37000000u /* 2^-17 */, 0x47800000u /* 65536 */, 0x7B},
};

const char *gpu_fp8_format_name(gpu_fp8_format f)
{
    return f == GPU_E5M2 ? "e5m2" : "e4m3";
}

float gpu_fp8_max(gpu_fp8_format f)
{
    return f == GPU_E5M2 ? GPU_E5M2_MAX : GPU_E4M3_MAX;
}

uint8_t gpu_f32_to_fp8(float x, gpu_fp8_format f, bool saturate)
{
    return gpu_fmt_f32_to_fp8(gpu_fmt_f2u(x), f == GPU_E5M2, saturate);
}

static float decode(uint8_t v, gpu_fp8_format f)
{
    return gpu_fmt_u2f(gpu_fmt_fp8_to_f32(v, f == GPU_E5M2));
}

static float tables[2][256];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void)
{
    for (int c = 0; c < 256; c++) {
        tables[GPU_E4M3][c] = decode((uint8_t)c, GPU_E4M3);
        tables[GPU_E5M2][c] = decode((uint8_t)c, GPU_E5M2);
    }
}

float gpu_fp8_to_f32(uint8_t v, gpu_fp8_format f)
{
    pthread_once(&tables_once, build_tables);
    return tables[f == GPU_E5M2][v];
}

/* ---- bulk encoding: portable, AVX2, AVX-512 ------------------------------------------- */

typedef void (*encode_fn)(uint8_t *dst, const float *src, size_t n, gpu_fp8_format f, bool sat);

static void port_encode(uint8_t *dst, const float *src, size_t n, gpu_fp8_format f, bool sat)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = gpu_f32_to_fp8(src[i], f, sat);
}

#if FP8_X86
/* The vector path computes gpu_fmt_f32_to_fp8's rounding and cases on every lane, then picks
 * each lane's case: NaN, zero, overflow, or the rounded code, with the sign. Lanes whose
 * shifts run past 31 (the zeros, the overflows) are blended away. */
#define T256 __attribute__((target("avx2")))

T256 static void a256_encode(uint8_t *dst, const float *src, size_t n, gpu_fp8_format f, bool sat)
{
    const fp8_fmt *p = &fmts[f == GPU_E5M2];
    const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
    const __m256i over = _mm256_set1_epi32(sat ? p->max_code : f == GPU_E5M2 ? 0x7C : 0x7F);
    const __m256i take =
        _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
        __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
        __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(127 - p->bias));
        __m256i m = _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7FFFFF)),
                                    _mm256_set1_epi32(0x800000));
        __m256i shift = _mm256_add_epi32(_mm256_set1_epi32(23 - p->mbits),
                                         _mm256_max_epi32(_mm256_sub_epi32(one, e), zero));
        __m256i code = _mm256_add_epi32(
            _mm256_slli_epi32(_mm256_max_epi32(_mm256_sub_epi32(e, one), zero), p->mbits),
            _mm256_srlv_epi32(m, shift));
        __m256i half = _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one));
        __m256i rem = _mm256_and_si256(m, _mm256_sub_epi32(_mm256_sllv_epi32(one, shift), one));
        __m256i up =
            _mm256_or_si256(_mm256_cmpgt_epi32(rem, half),
                            _mm256_and_si256(_mm256_cmpeq_epi32(rem, half),
                                             _mm256_cmpeq_epi32(_mm256_and_si256(code, one), one)));
        code = _mm256_sub_epi32(code, up); /* up is -1 where the code rounds up */
        __m256i ovf =
            _mm256_or_si256(_mm256_cmpgt_epi32(code, _mm256_set1_epi32(p->max_code)),
                            _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)p->too_big - 1)));
        code = _mm256_blendv_epi8(code, over, ovf);
        code = _mm256_and_si256(code, _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)p->zero_below)));
        code = _mm256_or_si256(code, sign);
        code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F),
                                  _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
        __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(code, take),
                                                     _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
        _mm_storel_epi64((__m128i *)(dst + i), _mm256_castsi256_si128(packed));
    }
    port_encode(dst + i, src + i, n - i, f, sat);
}

/* The same arithmetic on 16 lanes with AVX-512F: the cases are masks, and the tail is a
 * masked load and a masked narrowing store, so no element takes the scalar path. */
#define T512 __attribute__((target("avx512f")))

T512 static inline __attribute__((always_inline)) __m512i a512_codes(__m512i b, const fp8_fmt *p,
                                                                     __m512i over)
{
    const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
    __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(a, 23), _mm512_set1_epi32(127 - p->bias));
    __m512i m = _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF)),
                                _mm512_set1_epi32(0x800000));
    __m512i shift = _mm512_add_epi32(_mm512_set1_epi32(23 - p->mbits),
                                     _mm512_max_epi32(_mm512_sub_epi32(one, e), zero));
    __m512i code = _mm512_add_epi32(
        _mm512_slli_epi32(_mm512_max_epi32(_mm512_sub_epi32(e, one), zero), p->mbits),
        _mm512_srlv_epi32(m, shift));
    __m512i half = _mm512_sllv_epi32(one, _mm512_sub_epi32(shift, one));
    __m512i rem = _mm512_and_si512(m, _mm512_sub_epi32(_mm512_sllv_epi32(one, shift), one));
    __mmask16 up = _mm512_cmpgt_epi32_mask(rem, half) |
                   (_mm512_cmpeq_epi32_mask(rem, half) & _mm512_test_epi32_mask(code, one));
    code = _mm512_mask_add_epi32(code, up, code, one);
    __mmask16 ovf = _mm512_cmpgt_epi32_mask(code, _mm512_set1_epi32(p->max_code)) |
                    _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32((int)p->too_big - 1));
    code = _mm512_mask_blend_epi32(ovf, code, over);
    code = _mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32((int)p->zero_below)),
                                  code);
    code = _mm512_or_si512(code, sign);
    return _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), code,
                                   _mm512_set1_epi32(0x7F));
}

T512 static void a512_encode(uint8_t *dst, const float *src, size_t n, gpu_fp8_format f, bool sat)
{
    const fp8_fmt *p = &fmts[f == GPU_E5M2];
    const __m512i over = _mm512_set1_epi32(sat ? p->max_code : f == GPU_E5M2 ? 0x7C : 0x7F);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i code = a512_codes(_mm512_loadu_si512(src + i), p, over);
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtepi32_epi8(code));
    }
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512i code = a512_codes(_mm512_maskz_loadu_epi32(k, src + i), p, over);
        _mm512_mask_cvtepi32_storeu_epi8(dst + i, k, code);
    }
}
#endif

/* The encoder of path name when this CPU can run it, else NULL. */
static encode_fn encoder(const char *name)
{
    if (strcmp(name, "portable") == 0)
        return port_encode;
#if FP8_X86
    if (strcmp(name, "avx2") == 0 && gpu_cpu()->avx2)
        return a256_encode;
    if (strcmp(name, "avx512") == 0 && gpu_cpu()->avx512f)
        return a512_encode;
#endif
    return NULL;
}

static const char *best_path(void)
{
    return encoder("avx512") ? "avx512" : encoder("avx2") ? "avx2" : "portable";
}

const char *gpu_fp8_impl(void)
{
    return best_path();
}

/* A bulk conversion on path fn, shared out to the OpenMP team in blocks. */
static void encode_on(encode_fn fn, uint8_t *dst, const float *src, size_t n, gpu_fp8_format f,
                      bool sat)
{
    const size_t block = 1 << 14;
    size_t nblocks = (n + block - 1) / block;
#pragma omp parallel for if (gpu_par_worth(n)) schedule(static)
    for (size_t k = 0; k < nblocks; k++) {
        size_t at = k * block, len = n - at < block ? n - at : block;
        fn(dst + at, src + at, len, f, sat);
    }
}

int gpu_cvt_f32_fp8_on(const char *impl, uint8_t *dst, const float *src, size_t n, gpu_fp8_format f,
                       bool saturate)
{
    encode_fn fn = impl ? encoder(impl) : NULL;
    if (!fn)
        return impl && (strcmp(impl, "avx2") == 0 || strcmp(impl, "avx512") == 0) ? GPU_ENODEV
                                                                                  : GPU_EINVAL;
    encode_on(fn, dst, src, n, f, saturate);
    return 0;
}

static encode_fn best_encoder(void)
{
    static encode_fn best; /* chosen once; a race stores the same pointer */
    encode_fn fn = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (!fn) {
        fn = encoder(best_path());
        __atomic_store_n(&best, fn, __ATOMIC_RELAXED);
    }
    return fn;
}

void gpu_cvt_f32_fp8(uint8_t *dst, const float *src, size_t n, gpu_fp8_format f, bool saturate)
{
    encode_on(best_encoder(), dst, src, n, f, saturate);
}

void gpu_cvt_fp8_f32(float *dst, const uint8_t *src, size_t n, gpu_fp8_format f)
{
    pthread_once(&tables_once, build_tables);
    const float *t = tables[f == GPU_E5M2];
#pragma omp parallel for if (gpu_par_worth(n)) schedule(static)
    for (size_t i = 0; i < n; i++)
        dst[i] = t[src[i]];
}

/* ---- scaled casts ----------------------------------------------------------------------- */

#define CAST_PIECE 256

/* One piece of at most CAST_PIECE values: widened to fp32, measured, then (dst not NULL)
 * scaled and encoded. */
static void cast_piece(encode_fn fn, uint8_t *dst, const void *src, gpu_dtype sdt, size_t n,
                       gpu_fp8_format f, float scale, float *amax, gpu_fp8_cast_stats *st)
{
    float x[CAST_PIECE], y[CAST_PIECE];
    float top = gpu_fp8_max(f), a = *amax;
    gpu_cvt_to_f32(x, src, sdt, n);
    for (size_t i = 0; i < n; i++) {
        a = fmaxf(a, fabsf(x[i]));
        y[i] = x[i] * scale;
    }
    *amax = a;
    if (!dst)
        return;
    fn(dst, y, n, f, true);
    if (!st)
        return;
    for (size_t i = 0; i < n; i++) {
        st->nan += isnan(x[i]);
        st->saturated += fabsf(y[i]) > top;
        st->underflow += x[i] != 0.0f && !isnan(x[i]) && (dst[i] & 0x7Fu) == 0;
        st->nonzero += x[i] != 0.0f && isfinite(x[i]);
    }
    st->n += (int64_t)n;
}

static const void *at_elem(const void *p, gpu_dtype dt, size_t i)
{
    return (const uint8_t *)p + i * gpu_dtype_size(dt);
}

/* The pieces on the OpenMP team: max and sums do not depend on how they are shared out. */
void gpu_fp8_cast(uint8_t *dst, const void *src, gpu_dtype sdt, size_t n, gpu_fp8_format f,
                  float scale, float *amax, gpu_fp8_cast_stats *st)
{
    encode_fn fn = best_encoder();
    size_t pieces = (n + CAST_PIECE - 1) / CAST_PIECE;
    float a = 0.0f;
    int64_t nn = 0, sat = 0, ufl = 0, nz = 0, nan = 0;
#pragma omp parallel for if (gpu_par_worth(n)) schedule(static) reduction(max : a) \
    reduction(+ : nn, sat, ufl, nz, nan)
    for (size_t k = 0; k < pieces; k++) {
        size_t at = k * CAST_PIECE, len = n - at < CAST_PIECE ? n - at : CAST_PIECE;
        gpu_fp8_cast_stats one = {0};
        float pa = 0.0f;
        cast_piece(fn, dst ? dst + at : NULL, at_elem(src, sdt, at), sdt, len, f, scale, &pa,
                   st ? &one : NULL);
        a = fmaxf(a, pa);
        nn += one.n;
        sat += one.saturated;
        ufl += one.underflow;
        nz += one.nonzero;
        nan += one.nan;
    }
    if (amax)
        *amax = a;
    if (st) {
        st->n += nn;
        st->saturated += sat;
        st->underflow += ufl;
        st->nonzero += nz;
        st->nan += nan;
    }
}

float gpu_fp8_amax(const void *src, gpu_dtype sdt, size_t n)
{
    float a;
    gpu_fp8_cast(NULL, src, sdt, n, GPU_E4M3, 1.0f, &a, NULL);
    return a;
}

/* ---- scaling ---------------------------------------------------------------------------- */

float gpu_fp8_scaled_max(gpu_fp8_format f, int margin)
{
    return ldexpf(gpu_fp8_max(f), -margin); /* a power of two: exact */
}

float gpu_fp8_current_scale(float amax, float scaled_max, float epsilon)
{
    return gpu_fp8r_current_scale(amax, scaled_max, epsilon);
}

void gpu_fp8_delayed_update(float *history, int len, gpu_fp8_amax_algo algo, float scaled_max,
                            float *scale, float *scale_inv)
{
    gpu_fp8r_delayed_update(history, len, algo == GPU_FP8_AMAX_MOST_RECENT, scaled_max, scale,
                            scale_inv);
}
