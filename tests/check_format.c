/*
 * check_format.c - Check suite "format": the number formats of gpu/format.c.
 *
 * What it pins down: every fp16 and bf16 bit pattern decodes to the value an independent
 * fp64 decoder computes from sign/exponent/mantissa and round-trips (NaN -> the canonical
 * NaN); the documented edge cases of fp32 -> fp16/bf16; round-to-nearest-even against an
 * fp64 nearest-value search on millions of random inputs; every vector path (avx512, f16c,
 * portable, each forced in turn, a SKIP line per case when the CPU lacks it) bit-identical
 * to the scalar functions for all tail lengths 0..70, misaligned buffers and a large array,
 * without writing past the end, on 1 and on several OpenMP threads; results independent of
 * MXCSR (FTZ/DAZ, rounding mode); the conversions to bf16 note an fp32 subnormal input on
 * every path, scalar and bulk, in the vector body, in the tail and on the OpenMP team, and
 * only then (gpu_bf16_subnormals_made, which lets the native bf16 GEMMs skip their scans).
 *
 * Threads: each test runs in its own forked child; the thread test starts its own threads,
 * the OpenMP test sets the OpenMP thread count of its child.
 */
#include <check.h>
#include <fenv.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gpu/gpu_int.h"
#include "tests/testutil.h"

static const char *const paths[] = {"avx512bf16", "avx512", "f16c", "portable"};
#define NPATHS (sizeof(paths) / sizeof(paths[0]))

/* Forces path for the case fn; false where this CPU lacks it, with the case's SKIP line
 * (none when fn is NULL: a case that has said so already). */
static bool use_path(const char *fn, const char *path)
{
    int rc = gpu_cvt_force(path);
    if (rc == GPU_ENODEV) {
        if (fn != NULL)
            test_skip(fn, path, "this CPU lacks %s",
                      strcmp(path, "avx512bf16") == 0 ? "AVX-512 (F, BW, VL, DQ) or AVX512_BF16"
                      : strcmp(path, "avx512") == 0   ? "AVX-512 (F, BW, VL, DQ)"
                                                      : "F16C, AVX2 or FMA");
        return false;
    }
    ck_assert_int_eq(rc, 0);
    return true;
}

static uint32_t f2u(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static float u2f(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* ---- independent fp64 decoders --------------------------------------------------------- */

/* Value of a binary16/bfloat16 pattern with ebits exponent and mbits mantissa bits. NaN for
 * NaN patterns, +-inf for infinities. */
static double decode16(uint16_t h, int ebits, int mbits)
{
    int bias = (1 << (ebits - 1)) - 1;
    int emax = (1 << ebits) - 1;
    int sign = h >> 15;
    int e = (h >> mbits) & emax;
    int m = h & ((1 << mbits) - 1);
    double v;

    if (e == emax)
        v = m == 0 ? INFINITY : NAN;
    else if (e == 0)
        v = ldexp((double)m, 1 - bias - mbits);
    else
        v = ldexp((double)((1 << mbits) + m), e - bias - mbits);
    return sign ? -v : v;
}

static double decode_f16(uint16_t h)
{
    return decode16(h, 5, 10);
}

static double decode_bf16(uint16_t h)
{
    return decode16(h, 8, 7);
}

/* ---- fp64 reference rounding: nearest representable value, ties to the even pattern ----- */

typedef struct {
    double val[0x7F80];  /* values of the finite non-negative patterns 0..nfinite-1 */
    uint32_t nfinite;
    double ovf;          /* where the next pattern (inf) would sit with an unbounded exponent */
    uint16_t inf, nan;
} ref_format;

static ref_format ref_f16, ref_bf16;

static void ref_init(void)
{
    ref_f16.nfinite = 0x7C00;
    ref_f16.ovf = 65536.0;
    ref_f16.inf = 0x7C00;
    ref_f16.nan = 0x7E00;
    for (uint32_t i = 0; i < ref_f16.nfinite; i++)
        ref_f16.val[i] = decode_f16((uint16_t)i);
    ref_bf16.nfinite = 0x7F80;
    ref_bf16.ovf = ldexp(1.0, 128);
    ref_bf16.inf = 0x7F80;
    ref_bf16.nan = 0x7FC0;
    for (uint32_t i = 0; i < ref_bf16.nfinite; i++)
        ref_bf16.val[i] = decode_bf16((uint16_t)i);
}

static uint16_t ref_round(const ref_format *f, float x)
{
    if (isnan(x))
        return f->nan;
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs((double)x);
    if (a >= f->ovf)
        return sign | f->inf;
    /* largest i with val[i] <= a */
    uint32_t lo = 0, hi = f->nfinite - 1;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2;
        if (f->val[mid] <= a)
            lo = mid;
        else
            hi = mid - 1;
    }
    double below = f->val[lo];
    double above = lo + 1 < f->nfinite ? f->val[lo + 1] : f->ovf;
    double d1 = a - below, d2 = above - a;  /* exact: few significant bits each */
    uint32_t pick;
    if (d1 < d2)
        pick = lo;
    else if (d2 < d1)
        pick = lo + 1;
    else
        pick = (lo & 1) ? lo + 1 : lo;
    return (uint16_t)(sign | pick);
}

/* ---- helpers ---------------------------------------------------------------------------- */

static size_t first_diff32(const void *a, const void *b, size_t n)
{
    const uint32_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return i;
    return n;
}

static size_t first_diff16(const uint16_t *x, const uint16_t *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return i;
    return n;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* A random fp32 bit pattern: all 32 bits random. */
static float rand_bits(gpu_rng *r)
{
    return u2f((uint32_t)gpu_rng_next(r));
}

/* ---- dtype helpers ---------------------------------------------------------------------- */

START_TEST(t_dtype_helpers)
{
    static const gpu_dtype all[] = {GPU_FP32, GPU_FP16, GPU_BF16};
    static const char *const names[] = {"fp32", "fp16", "bf16"};
    for (int i = 0; i < 3; i++) {
        gpu_dtype dt = GPU_FP32;
        ck_assert_str_eq(gpu_dtype_name(all[i]), names[i]);
        ck_assert_int_eq(gpu_dtype_parse(names[i], &dt), 0);
        ck_assert_int_eq(dt, all[i]);
    }
    gpu_dtype dt = GPU_BF16;
    ck_assert_int_eq(gpu_dtype_parse("fp8", &dt), GPU_EINVAL);
    ck_assert_int_eq(gpu_dtype_parse("FP16x", &dt), GPU_EINVAL);
    ck_assert_int_eq(gpu_dtype_parse("", &dt), GPU_EINVAL);
    ck_assert_int_eq(gpu_dtype_parse(NULL, &dt), GPU_EINVAL);
    ck_assert_int_eq(dt, GPU_BF16);  /* untouched on failure */

    ck_assert_uint_eq(gpu_dtype_size(GPU_FP32), 4);
    ck_assert_uint_eq(gpu_dtype_size(GPU_FP16), 2);
    ck_assert_uint_eq(gpu_dtype_size(GPU_BF16), 2);

    /* largest finite / smallest positive, from the independent decoder */
    ck_assert(gpu_dtype_max(GPU_FP32) == FLT_MAX);
    ck_assert((double)gpu_dtype_max(GPU_FP16) == decode_f16(0x7BFF));
    ck_assert((double)gpu_dtype_max(GPU_BF16) == decode_bf16(0x7F7F));
    ck_assert((double)gpu_dtype_min_subnormal(GPU_FP32) == ldexp(1.0, -149));
    ck_assert((double)gpu_dtype_min_subnormal(GPU_FP16) == decode_f16(0x0001));
    ck_assert((double)gpu_dtype_min_subnormal(GPU_BF16) == decode_bf16(0x0001));
    ck_assert_uint_eq(gpu_f32_to_f16(gpu_dtype_max(GPU_FP16)), 0x7BFF);
    ck_assert_uint_eq(gpu_f32_to_bf16(gpu_dtype_max(GPU_BF16)), 0x7F7F);
}
END_TEST

/* ---- every 16-bit pattern ---------------------------------------------------------------- */

/* Decode all 65536 patterns with f and the fp64 decoder; NaNs must widen with the quiet bit
 * set and sign/payload kept; the round trip through to16 must give back h (NaN: canonical). */
static void check_all_patterns(float (*f)(uint16_t), uint16_t (*to16)(float),
                               double (*dec)(uint16_t), int mbits, uint16_t canon)
{
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float x = f(h);
        double want = dec(h);
        if (isnan(want)) {
            uint32_t m = h & ((1u << mbits) - 1);
            uint32_t bits = ((uint32_t)(h & 0x8000) << 16) | 0x7FC00000u | (m << (23 - mbits));
            ck_assert_msg(f2u(x) == bits, "0x%04x: NaN widened to 0x%08x, want 0x%08x", h,
                          f2u(x), bits);
            ck_assert_msg(to16(x) == canon, "0x%04x: NaN round trip gave 0x%04x", h, to16(x));
            continue;
        }
        if ((double)x != want || !signbit(x) != !signbit(want))
            ck_abort_msg("0x%04x decodes to %.17g, want %.17g", h, (double)x, want);
        if (to16(x) != h)
            ck_abort_msg("0x%04x round trip gave 0x%04x", h, to16(x));
    }
}

START_TEST(t_f16_all_patterns)
{
    check_all_patterns(gpu_f16_to_f32, gpu_f32_to_f16, decode_f16, 10, GPU_FP16_NAN);
}
END_TEST

START_TEST(t_bf16_all_patterns)
{
    check_all_patterns(gpu_bf16_to_f32, gpu_f32_to_bf16, decode_bf16, 7, GPU_BF16_NAN);
}
END_TEST

/* ---- edge cases -------------------------------------------------------------------------- */

typedef struct {
    uint32_t in;     /* fp32 bits */
    uint16_t out;
} edge;

/* fp32 -> fp16: the largest finite value, the rounding boundary to inf, subnormals, ties */
static const edge f16_edges[] = {
    {0x477FE000, 0x7BFF},              /* 65504 */
    {0x477FEFFF, 0x7BFF},              /* 65519.99 */
    {0x477FF000, 0x7C00},              /* 65520: tie, 0x7BFF is odd -> inf */
    {0x47800000, 0x7C00},              /* 65536 */
    {0x7F7FFFFF, 0x7C00},              /* FLT_MAX */
    {0xFF7FFFFF, 0xFC00},              /* -FLT_MAX */
    {0xC77FF000, 0xFC00},              /* -65520 */
    {0xC77FEFFF, 0xFBFF},              /* -65519.99 */
    {0x38800000, 0x0400},              /* 2^-14, smallest normal */
    {0x33800000, 0x0001},              /* 2^-24, smallest subnormal */
    {0x33000000, 0x0000},              /* 2^-25: tie -> even (0) */
    {0x33000001, 0x0001},              /* just above 2^-25 */
    {0xB3000000, 0x8000},              /* -2^-25 -> -0 */
    {0x33C00000, 0x0002},              /* 1.5 * 2^-24: tie -> even (2) */
    {0x34200000, 0x0002},              /* 2.5 * 2^-24: tie -> even (2) */
    {0x387FC000, 0x03FF},              /* largest subnormal exactly */
    {0x387FE000, 0x0400},              /* halfway between 0x03FF and 0x0400 -> even */
    {0x387FBFFF, 0x03FF},
    {0x387FFFFF, 0x0400},
    {0x3F800000, 0x3C00},              /* 1 */
    {0x3F801000, 0x3C00},              /* 1 + 2^-11: tie -> even */
    {0x3F803000, 0x3C02},              /* 1 + 3*2^-11: tie -> even (up) */
    {0x3F801001, 0x3C01},
    {0x00000000, 0x0000},              /* +0 */
    {0x80000000, 0x8000},              /* -0 */
    {0x00000001, 0x0000},              /* fp32 subnormals -> signed zero */
    {0x807FFFFF, 0x8000},
    {0x7F800000, 0x7C00},              /* +inf */
    {0xFF800000, 0xFC00},              /* -inf */
    {0x7FC00000, 0x7E00},              /* qNaN */
    {0xFFC00000, 0x7E00},              /* -qNaN: sign dropped */
    {0x7F800001, 0x7E00},              /* sNaN */
    {0xFF800001, 0x7E00},              /* -sNaN */
    {0x7FFFFFFF, 0x7E00},
    {0x7FBFE000, 0x7E00},              /* sNaN whose top payload bits are set */
};

/* fp32 -> bf16: overflow to inf, ties to even, subnormals */
static const edge bf16_edges[] = {
    {0x7F7FFFFF, 0x7F80},              /* FLT_MAX -> inf */
    {0x7F7F8000, 0x7F80},              /* tie above the largest bf16 -> inf */
    {0x7F7F7FFF, 0x7F7F},
    {0xFF7FFFFF, 0xFF80},
    {0x477FE000, 0x4780},              /* 65504 -> 65536 */
    {0x3F808000, 0x3F80},              /* 1 + 2^-8: tie -> even */
    {0x3F818000, 0x3F82},              /* tie -> even (up) */
    {0x3F808001, 0x3F81},
    {0x000AE398, 0x000B},              /* 1e-39 stays subnormal */
    {0x800AE398, 0x800B},
    {0x007FFFFF, 0x0080},              /* rounds up to the smallest normal */
    {0x00000001, 0x0000},
    {0x00008000, 0x0000},              /* tie -> even (0) */
    {0x00018000, 0x0002},              /* tie -> even (up) */
    {0x00008001, 0x0001},
    {0x00000000, 0x0000},
    {0x80000000, 0x8000},
    {0x7F800000, 0x7F80},
    {0xFF800000, 0xFF80},
    {0x7FC00000, 0x7FC0},
    {0xFFC00000, 0x7FC0},
    {0x7F800001, 0x7FC0},
    {0xFF800001, 0x7FC0},
    {0x7FFFFFFF, 0x7FC0},
    {0x7F80FFFF, 0x7FC0},              /* sNaN whose rounding would carry */
};

/* fn: the case, for its SKIP lines (NULL: said already). */
static void check_edges(const char *fn, const edge *e, size_t n, uint16_t (*to16)(float),
                        void (*bulk)(uint16_t *, const float *, size_t))
{
    const char *orig = gpu_cvt_impl();
    float in[64];
    uint16_t out[64];
    ck_assert_uint_le(n, 64);
    for (size_t i = 0; i < n; i++) {
        in[i] = u2f(e[i].in);
        ck_assert_msg(to16(in[i]) == e[i].out, "0x%08x -> 0x%04x, want 0x%04x", e[i].in,
                      to16(in[i]), e[i].out);
    }
    for (size_t p = 0; p < NPATHS; p++) {
        if (!use_path(fn, paths[p]))
            continue;
        bulk(out, in, n);
        for (size_t k = 0; k < n; k++)
            ck_assert_msg(out[k] == e[k].out, "%s: 0x%08x -> 0x%04x, want 0x%04x", paths[p],
                          e[k].in, out[k], e[k].out);
    }
    ck_assert_int_eq(gpu_cvt_force(orig), 0);
}

START_TEST(t_f16_edges)
{
    check_edges(__func__, f16_edges, sizeof(f16_edges) / sizeof(f16_edges[0]), gpu_f32_to_f16,
                gpu_cvt_f32_f16);
    /* decimal spellings from the brief */
    ck_assert_uint_eq(gpu_f32_to_f16(65519.99f), 0x7BFF);
    ck_assert_uint_eq(gpu_f32_to_f16(65520.0f), 0x7C00);
    ck_assert_uint_eq(gpu_f32_to_f16(6.0976e-05f), 0x03FF);
    /* the midpoint of 0x03FF and 0x0400 is 1023.5 * 2^-24 = 6.10054e-05, so 6.1005e-05 is
     * still below it (VCVTPS2PH agrees) and 6.1006e-05 is the first of these above it */
    ck_assert_uint_eq(gpu_f32_to_f16(6.1005e-05f), 0x03FF);
    ck_assert_uint_eq(gpu_f32_to_f16(6.1006e-05f), 0x0400);
    ck_assert_uint_eq(gpu_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);
    ck_assert_uint_eq(gpu_f32_to_f16(nextafterf(ldexpf(1.0f, -25), 1.0f)), 0x0001);
    ck_assert_uint_eq(gpu_f32_to_f16(-NAN), GPU_FP16_NAN);
    ck_assert(gpu_round(65519.99f, GPU_FP16) == 65504.0f);
    ck_assert(isinf(gpu_round(65520.0f, GPU_FP16)));
}
END_TEST

START_TEST(t_bf16_edges)
{
    check_edges(__func__, bf16_edges, sizeof(bf16_edges) / sizeof(bf16_edges[0]), gpu_f32_to_bf16,
                gpu_cvt_f32_bf16);
    ck_assert_uint_eq(gpu_f32_to_bf16(1e-39f), 0x000B);
    ck_assert_uint_eq(gpu_f32_to_bf16(-1e-39f), 0x800B);
    ck_assert_uint_eq(gpu_f32_to_bf16(FLT_MAX), 0x7F80);
    ck_assert_uint_eq(gpu_f32_to_bf16(-NAN), GPU_BF16_NAN);
    ck_assert(gpu_round(1e-39f, GPU_BF16) == (float)decode_bf16(0x000B));
}
END_TEST

START_TEST(t_round_scalar)
{
    /* gpu_round is the composition of the two scalar conversions; FP32 is the identity */
    gpu_rng r;
    gpu_rng_seed(&r, 7);
    for (int i = 0; i < 200000; i++) {
        float x = rand_bits(&r);
        uint32_t h = f2u(gpu_f16_to_f32(gpu_f32_to_f16(x)));
        uint32_t b = f2u(gpu_bf16_to_f32(gpu_f32_to_bf16(x)));
        if (f2u(gpu_round(x, GPU_FP16)) != h || f2u(gpu_round(x, GPU_BF16)) != b ||
            f2u(gpu_round(x, GPU_FP32)) != f2u(x))
            ck_abort_msg("gpu_round(0x%08x) disagrees with the conversions", f2u(x));
    }
    ck_assert_uint_eq(f2u(gpu_round(NAN, GPU_FP16)), 0x7FC00000u);
    ck_assert_uint_eq(f2u(gpu_round(-NAN, GPU_BF16)), 0x7FC00000u);
}
END_TEST

/* ---- round to nearest even against the fp64 search ---------------------------------------- */

/* A float near the format's range: random sign and mantissa, exponent field in [elo, ehi];
 * one in four is an exact midpoint of two adjacent representable values (a tie). */
static float rne_sample(gpu_rng *r, const ref_format *f, uint32_t elo, uint32_t ehi)
{
    uint64_t b = gpu_rng_next(r);
    if ((b & 3) == 0) {
        uint32_t i = gpu_rng_below(r, f->nfinite);
        double hi = i + 1 < f->nfinite ? f->val[i + 1] : f->ovf;
        float mid = (float)((f->val[i] + hi) / 2);   /* exact: needs mbits + 2 bits */
        return (b & 4) ? -mid : mid;
    }
    uint32_t e = elo + gpu_rng_below(r, ehi - elo + 1);
    uint32_t bits = (uint32_t)(b >> 32) & 0x807FFFFFu;
    return u2f(bits | (e << 23));
}

START_TEST(t_rne_random)
{
    gpu_rng r;
    gpu_rng_seed(&r, 12345);
    ref_init();
    for (int i = 0; i < 2000000; i++) {
        float x = rne_sample(&r, &ref_f16, 95, 146);
        uint16_t want = ref_round(&ref_f16, x);
        if (gpu_f32_to_f16(x) != want)
            ck_abort_msg("fp16(0x%08x) = 0x%04x, want 0x%04x", f2u(x), gpu_f32_to_f16(x), want);
    }
    for (int i = 0; i < 2000000; i++) {
        float x = (i & 1) ? rne_sample(&r, &ref_bf16, 0, 254) : rand_bits(&r);
        uint16_t want = ref_round(&ref_bf16, x);
        if (gpu_f32_to_bf16(x) != want)
            ck_abort_msg("bf16(0x%08x) = 0x%04x, want 0x%04x", f2u(x), gpu_f32_to_bf16(x),
                         want);
    }
}
END_TEST

/* ---- every vector path == scalar ---------------------------------------------------------- */

#define GUARD 40          /* canary elements after each output */
#define CANARY 0xA5A5A5A5u
#define BIG ((size_t)(1u << 21) + 13)

typedef struct {
    float *f_in, *f_out, *f_ref;
    uint16_t *h_in, *h_out, *h_ref;
} bufs;

static void bufs_alloc(bufs *b, size_t n)
{
    size_t m = n + 1 + GUARD;
    b->f_in = xmalloc(m * 4);
    b->f_out = xmalloc(m * 4);
    b->f_ref = xmalloc(m * 4);
    b->h_in = xmalloc(m * 2);
    b->h_out = xmalloc(m * 2);
    b->h_ref = xmalloc(m * 2);
}

static void bufs_free(bufs *b)
{
    free(b->f_in);
    free(b->f_out);
    free(b->f_ref);
    free(b->h_in);
    free(b->h_out);
    free(b->h_ref);
}

static void canary_fill(void *p, size_t bytes)
{
    memset(p, 0xA5, bytes);
}

static bool canary_ok(const void *p, size_t bytes)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < bytes; i++)
        if (c[i] != 0xA5)
            return false;
    return true;
}

/* Run all four directions and gpu_round_n (out of place and in place) on n elements at
 * element offset off, with the current path; compare with the scalar functions. */
static void compare_path(const char *path, bufs *b, size_t n, size_t off, gpu_rng *r)
{
    float *fi = b->f_in + off, *fo = b->f_out + off;
    uint16_t *hi = b->h_in + off, *ho = b->h_out + off;
    size_t d;

    for (size_t i = 0; i < n; i++) {
        fi[i] = rand_bits(r);
        hi[i] = (uint16_t)gpu_rng_next(r);
    }

    /* fp32 -> fp16 / bf16 */
    for (int bf = 0; bf < 2; bf++) {
        canary_fill(ho, (n + GUARD) * 2);
        if (bf)
            gpu_cvt_f32_bf16(ho, fi, n);
        else
            gpu_cvt_f32_f16(ho, fi, n);
        for (size_t i = 0; i < n; i++)
            b->h_ref[i] = bf ? gpu_f32_to_bf16(fi[i]) : gpu_f32_to_f16(fi[i]);
        d = first_diff16(ho, b->h_ref, n);
        ck_assert_msg(d == n, "%s %s n=%zu: [%zu] 0x%08x -> 0x%04x, scalar 0x%04x", path,
                      bf ? "f32_bf16" : "f32_f16", n, d, f2u(fi[d]), ho[d], b->h_ref[d]);
        ck_assert_msg(canary_ok(ho + n, GUARD * 2), "%s n=%zu: wrote past the end", path, n);
    }

    /* fp16 / bf16 -> fp32 */
    for (int bf = 0; bf < 2; bf++) {
        canary_fill(fo, (n + GUARD) * 4);
        if (bf)
            gpu_cvt_bf16_f32(fo, hi, n);
        else
            gpu_cvt_f16_f32(fo, hi, n);
        for (size_t i = 0; i < n; i++)
            b->f_ref[i] = bf ? gpu_bf16_to_f32(hi[i]) : gpu_f16_to_f32(hi[i]);
        d = first_diff32(fo, b->f_ref, n);
        ck_assert_msg(d == n, "%s %s n=%zu: [%zu] 0x%04x -> 0x%08x, scalar 0x%08x", path,
                      bf ? "bf16_f32" : "f16_f32", n, d, hi[d], f2u(fo[d]), f2u(b->f_ref[d]));
        ck_assert_msg(canary_ok(fo + n, GUARD * 4), "%s n=%zu: wrote past the end", path, n);
    }

    /* gpu_round_n, out of place then in place */
    for (int bf = 0; bf < 2; bf++) {
        gpu_dtype dt = bf ? GPU_BF16 : GPU_FP16;
        for (size_t i = 0; i < n; i++)
            b->f_ref[i] = gpu_round(fi[i], dt);
        canary_fill(fo, (n + GUARD) * 4);
        gpu_round_n(fo, fi, n, dt);
        d = first_diff32(fo, b->f_ref, n);
        ck_assert_msg(d == n, "%s round_n %s n=%zu: [%zu] 0x%08x -> 0x%08x, scalar 0x%08x",
                      path, gpu_dtype_name(dt), n, d, f2u(fi[d]), f2u(fo[d]), f2u(b->f_ref[d]));
        ck_assert_msg(canary_ok(fo + n, GUARD * 4), "%s n=%zu: wrote past the end", path, n);
        memcpy(fo, fi, n * 4);
        gpu_round_n(fo, fo, n, dt);
        d = first_diff32(fo, b->f_ref, n);
        ck_assert_msg(d == n, "%s in-place round_n %s n=%zu: [%zu] differs", path,
                      gpu_dtype_name(dt), n, d);
    }
}

static void check_path(const char *fn, const char *path)
{
    const char *orig = gpu_cvt_impl();
    if (!use_path(fn, path))
        return;
    ck_assert_str_eq(gpu_cvt_impl(), path);

    gpu_rng r;
    gpu_rng_seed(&r, 99);
    bufs b;
    bufs_alloc(&b, BIG);
    for (size_t n = 0; n <= 70; n++)
        for (size_t off = 0; off < 2; off++)
            compare_path(path, &b, n, off, &r);
    compare_path(path, &b, BIG, 1, &r);

    /* every 16-bit pattern through the vector widening */
    for (uint32_t i = 0; i < 65536; i++)
        b.h_in[i] = (uint16_t)i;
    gpu_cvt_f16_f32(b.f_out, b.h_in, 65536);
    for (uint32_t i = 0; i < 65536; i++)
        ck_assert_msg(f2u(b.f_out[i]) == f2u(gpu_f16_to_f32((uint16_t)i)), "%s f16 0x%04x",
                      path, i);
    gpu_cvt_bf16_f32(b.f_out, b.h_in, 65536);
    for (uint32_t i = 0; i < 65536; i++)
        ck_assert_msg(f2u(b.f_out[i]) == f2u(gpu_bf16_to_f32((uint16_t)i)), "%s bf16 0x%04x",
                      path, i);
    bufs_free(&b);
    ck_assert_int_eq(gpu_cvt_force(orig), 0);
}

START_TEST(t_path_avx512bf16)
{
    check_path(__func__, "avx512bf16");
}
END_TEST

START_TEST(t_path_avx512)
{
    check_path(__func__, "avx512");
}
END_TEST

START_TEST(t_path_f16c)
{
    check_path(__func__, "f16c");
}
END_TEST

START_TEST(t_path_portable)
{
    check_path(__func__, "portable");
}
END_TEST

/* ---- the bulk conversions on any number of OpenMP threads -------------------------------- */

static void set_threads(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* The fp32 copies of gpu_cvt_to_f32 / gpu_cvt_from_f32 / gpu_round_n on n elements, apart
 * and overlapping (a memmove, whatever the thread count). */
static void check_copies(bufs *b, size_t n)
{
    for (size_t i = 0; i < n + 1; i++)
        b->f_in[i] = (float)i * 0.25f - 1000.0f;
    memset(b->f_out, 0, n * 4);
    gpu_cvt_to_f32(b->f_out, b->f_in, GPU_FP32, n);
    ck_assert_uint_eq(first_diff32(b->f_out, b->f_in, n), n);
    memset(b->f_out, 0, n * 4);
    gpu_cvt_from_f32(b->f_out, GPU_FP32, b->f_in, n);
    ck_assert_uint_eq(first_diff32(b->f_out, b->f_in, n), n);
    memset(b->f_out, 0, n * 4);
    gpu_round_n(b->f_out, b->f_in, n, GPU_FP32);
    ck_assert_uint_eq(first_diff32(b->f_out, b->f_in, n), n);
    memcpy(b->f_ref, b->f_in + 1, n * 4);
    gpu_cvt_to_f32(b->f_in, b->f_in + 1, GPU_FP32, n);
    ck_assert_uint_eq(first_diff32(b->f_in, b->f_ref, n), n);
}

START_TEST(t_omp_threads)
{
    const char *orig = gpu_cvt_impl();
    bufs b;
    bufs_alloc(&b, BIG);
    for (size_t p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, paths[p]))
            continue;
        for (int threads = 1; threads <= 3; threads += 2) {
            gpu_rng r;
            gpu_rng_seed(&r, 7);
            set_threads(threads);
            compare_path(paths[p], &b, BIG, 0, &r);
            compare_path(paths[p], &b, (1u << 15) + 1, 1, &r); /* just above the threshold */
            check_copies(&b, BIG);
        }
    }
    set_threads(1);
    bufs_free(&b);
    ck_assert_int_eq(gpu_cvt_force(orig), 0);
}
END_TEST

/* ---- the subnormal watch of the conversions to bf16 --------------------------------------- */

/* In a fresh child process (the watch is never reset): convert n values that are all normal,
 * zero, inf or NaN on path `path`, then the same with one subnormal at pos (scalar when n is
 * 1). Exit status 0, or 2 when the first conversion set the watch, 3 when the second did
 * not, 4 when the watch was set before any conversion. */
static int watch_child(const char *path, size_t n, size_t pos, float sub)
{
    pid_t pid = fork();
    if (pid != 0) {
        int status = -1;
        if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
            return -1;
        return WEXITSTATUS(status);
    }
    static const float normal[] = {1.0f, -0.0f, 0.0f, 0x1p-126f, -0x1p-126f, 3.0e38f, INFINITY,
                                   NAN, -65504.0f, 0x1.fffffep-126f};
    float *src = malloc(n * sizeof *src);
    uint16_t *dst = malloc(n * sizeof *dst);
    if (src == NULL || dst == NULL || gpu_cvt_force(path) != 0)
        _exit(1);
    if (gpu_bf16_subnormals_made())
        _exit(4);
    for (size_t i = 0; i < n; i++)
        src[i] = normal[i % (sizeof normal / sizeof normal[0])];
    if (n == 1)
        dst[0] = gpu_f32_to_bf16(src[0]);
    else
        gpu_cvt_f32_bf16(dst, src, n);
    if (gpu_bf16_subnormals_made())
        _exit(2);
    src[pos] = sub;
    if (n == 1)
        dst[0] = gpu_f32_to_bf16(src[0]);
    else
        gpu_cvt_f32_bf16(dst, src, n);
    _exit(gpu_bf16_subnormals_made() ? 0 : 3);
}

START_TEST(t_subnormal_watch)
{
    /* lengths: one vector body, a tail only, body + tail, and the OpenMP team's blocks */
    static const size_t lens[] = {32, 7, 45, (1u << 15) + 40};
    static const float subs[] = {0x1p-149f, -0x1p-130f, 0x1.fffffcp-127f /* rounds up */};
    set_threads(2);
    for (size_t p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, paths[p]))
            continue;
        for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++)
            for (size_t k = 0; k < 3; k++) {
                size_t pos = (lens[l] - 1) * k / 2; /* first, middle, last */
                int rc = watch_child(paths[p], lens[l], pos, subs[k]);
                ck_assert_msg(rc == 0, "%s, %zu values, subnormal %a at %zu: child said %d",
                              paths[p], lens[l], (double)subs[k], pos, rc);
            }
    }
    ck_assert_int_eq(watch_child("portable", 1, 0, 0x1p-140f), 0);
    /* bf16 values from elsewhere: admitted, and a subnormal among them sets the watch */
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        uint16_t v[40] = {0x3F80, 0x0080, 0x8000, 0x7F80, 0x7FC0};
        gpu_bf16_admit(v, 40);
        if (gpu_bf16_subnormals_made())
            _exit(2);
        v[37] = 0x8001;
        gpu_bf16_admit(v, 40);
        _exit(gpu_bf16_subnormals_made() ? 0 : 3);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "gpu_bf16_admit: child said %d",
                  WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}
END_TEST

/* ---- dispatch and typed helpers ----------------------------------------------------------- */

START_TEST(t_dispatch)
{
    const gpu_cpu_features *f = gpu_cpu();
    const char *impl = gpu_cvt_impl();
    ck_assert_ptr_eq(gpu_cpu(), f);
    if (f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->f16c)
        ck_assert_str_eq(impl, f->avx512bf16 ? "avx512bf16" : "avx512");
    else if (f->f16c && f->avx2)
        ck_assert_str_eq(impl, "f16c");
    else
        ck_assert_str_eq(impl, "portable");
    if (f->avx512f)
        ck_assert(f->avx2);  /* a consistent feature set */
    ck_assert_int_eq(gpu_cvt_force("sse9"), GPU_EINVAL);
    ck_assert_int_eq(gpu_cvt_force(NULL), GPU_EINVAL);
    ck_assert_str_eq(gpu_cvt_impl(), impl);
    ck_assert_int_eq(gpu_cvt_force("portable"), 0);
    ck_assert_str_eq(gpu_cvt_impl(), "portable");
    if (!f->avx512f)
        ck_assert_int_eq(gpu_cvt_force("avx512"), GPU_ENODEV);
    if (!f->avx512bf16)
        ck_assert_int_eq(gpu_cvt_force("avx512bf16"), GPU_ENODEV);
    ck_assert_int_eq(gpu_cvt_force(impl), 0);
    printf("check_format: conversion path %s\n", impl);
}
END_TEST

START_TEST(t_typed)
{
    enum { N = 1000 };
    float src[N], out[N], ref[N];
    uint16_t h[N], href[N];
    gpu_rng r;
    gpu_rng_seed(&r, 3);
    for (int i = 0; i < N; i++)
        src[i] = gpu_rng_normal(&r) * 1000.0f;

    gpu_cvt_from_f32(h, GPU_FP16, src, N);
    gpu_cvt_f32_f16(href, src, N);
    ck_assert_uint_eq(first_diff16(h, href, N), N);
    gpu_cvt_to_f32(out, h, GPU_FP16, N);
    gpu_round_n(ref, src, N, GPU_FP16);
    ck_assert_uint_eq(first_diff32(out, ref, N), N);

    gpu_cvt_from_f32(h, GPU_BF16, src, N);
    gpu_cvt_f32_bf16(href, src, N);
    ck_assert_uint_eq(first_diff16(h, href, N), N);
    gpu_cvt_to_f32(out, h, GPU_BF16, N);
    gpu_round_n(ref, src, N, GPU_BF16);
    ck_assert_uint_eq(first_diff32(out, ref, N), N);

    /* same dtype: a copy, in place allowed */
    gpu_cvt_to_f32(out, src, GPU_FP32, N);
    ck_assert_uint_eq(first_diff32(out, src, N), N);
    memset(out, 0, sizeof(out));
    gpu_cvt_from_f32(out, GPU_FP32, src, N);
    ck_assert_uint_eq(first_diff32(out, src, N), N);
    gpu_round_n(out, out, N, GPU_FP32);
    ck_assert_uint_eq(first_diff32(out, src, N), N);
    memset(out, 0, sizeof(out));
    gpu_round_n(out, src, N, GPU_FP32);
    ck_assert_uint_eq(first_diff32(out, src, N), N);
}
END_TEST

enum { ROWS = 7, COLS = 37, LDS = 50, LDD = 41 };

/* rows x COLS floats at ld 32-bit words apart in a equal to those of b (ld LDD), the words
 * after each row up to ld untouched (still 0xA5 bytes). */
static void rows_equal(const float *a, size_t ld, const float *b, const char *what)
{
    for (int i = 0; i < ROWS; i++) {
        ck_assert_msg(first_diff32(a + i * ld, b + i * LDD, COLS) == COLS, "%s, row %d", what, i);
        for (size_t j = COLS; i + 1 < ROWS && j < ld; j++)
            ck_assert_msg(f2u(a[i * ld + j]) == 0xA5A5A5A5u, "%s: gap after row %d", what, i);
    }
}

/* gpu_cvt_rows_to_f32 and gpu_round_rows on path `path` (forced): the values of a call per
 * row, out of place and (rounding) in place, from 16-bit rows src rounded to each dtype. */
static void rows_back(const char *path, const float *src)
{
    const gpu_dtype dts[2] = {GPU_FP16, GPU_BF16};
    uint16_t h[ROWS * LDS];
    float got[ROWS * LDS], want[ROWS * LDD];
    char what[64];
    for (int k = 0; k < 2; k++) {
        snprintf(what, sizeof what, "%s, %s", path, gpu_dtype_name(dts[k]));
        gpu_cvt_from_f32(h, dts[k], src, ROWS * LDS);
        for (int i = 0; i < ROWS; i++)
            gpu_cvt_to_f32(want + i * LDD, h + i * LDS, dts[k], COLS);
        memset(got, 0xA5, sizeof got);
        gpu_cvt_rows_to_f32(got, LDD, h, dts[k], LDS, ROWS, COLS);
        rows_equal(got, LDD, want, what);
        for (int i = 0; i < ROWS; i++)
            gpu_round_n(want + i * LDD, src + i * LDS, COLS, dts[k]);
        memset(got, 0xA5, sizeof got);
        gpu_round_rows(got, LDD, src, LDS, ROWS, COLS, dts[k]);
        rows_equal(got, LDD, want, what);
        memset(got, 0xA5, sizeof got);
        for (int i = 0; i < ROWS; i++)
            memcpy(got + i * LDS, src + i * LDS, COLS * sizeof(float));
        gpu_round_rows(got, LDS, got, LDS, ROWS, COLS, dts[k]);
        rows_equal(got, LDS, want, what);
    }
}

/* Strided rows (a head's output block inside wider rows, as the GPT stores it): the same
 * values as a conversion per row, on every path, the gaps between rows untouched; the same
 * for widening such rows and for rounding them. */
START_TEST(t_rows)
{
    float src[ROWS * LDS], f32[ROWS * LDD];
    uint16_t h[ROWS * LDD], want[ROWS * LDD];
    const gpu_dtype dts[2] = {GPU_FP16, GPU_BF16};
    const char *orig = gpu_cvt_impl();
    gpu_rng r;
    gpu_rng_seed(&r, 5);
    for (int i = 0; i < ROWS * LDS; i++)
        src[i] = gpu_rng_normal(&r) * (i % 3 == 0 ? 1e-40f : 1e3f); /* subnormals too */
    src[LDS + 3] = NAN;
    for (size_t p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, paths[p]))
            continue;
        for (int k = 0; k < 2; k++) {
            memset(h, 0xA5, sizeof h);
            memset(want, 0xA5, sizeof want);
            for (int i = 0; i < ROWS; i++)
                gpu_cvt_from_f32(want + i * LDD, dts[k], src + i * LDS, COLS);
            gpu_cvt_rows_from_f32(h, dts[k], LDD, src, LDS, ROWS, COLS);
            ck_assert_msg(first_diff16(h, want, ROWS * LDD) == ROWS * LDD, "%s, %s", paths[p],
                          gpu_dtype_name(dts[k]));
        }
        memset(f32, 0, sizeof f32);
        gpu_cvt_rows_from_f32(f32, GPU_FP32, LDD, src, LDS, ROWS, COLS);
        for (int i = 0; i < ROWS; i++)
            ck_assert_uint_eq(first_diff32(f32 + i * LDD, src + i * LDS, COLS), COLS);
        rows_back(paths[p], src);
    }
    ck_assert_int_eq(gpu_cvt_force(orig), 0);
}
END_TEST

/* ---- independence from the floating-point environment ------------------------------------- */

START_TEST(t_fp_environment)
{
    size_t nf = sizeof(f16_edges) / sizeof(f16_edges[0]);
    size_t nb = sizeof(bf16_edges) / sizeof(bf16_edges[0]);
    const char *orig = gpu_cvt_impl();
    fenv_t env;
    ck_assert_int_eq(fegetenv(&env), 0);
    ck_assert_int_eq(fesetround(FE_UPWARD), 0);
#if defined(__x86_64__)
    /* flush-to-zero and denormals-are-zero on: results must not change */
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
#endif
    for (size_t p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, paths[p]))
            continue;
        check_edges(NULL, f16_edges, nf, gpu_f32_to_f16, gpu_cvt_f32_f16);
        check_edges(NULL, bf16_edges, nb, gpu_f32_to_bf16, gpu_cvt_f32_bf16);
        ck_assert_int_eq(gpu_cvt_force(paths[p]), 0); /* check_edges left the default path */
        uint16_t sub[3] = {0x0001, 0x03FF, 0x8001};
        float out[3];
        gpu_cvt_f16_f32(out, sub, 3);
        for (int i = 0; i < 3; i++)
            ck_assert_msg(f2u(out[i]) == f2u(gpu_f16_to_f32(sub[i])) &&
                              (double)gpu_f16_to_f32(sub[i]) == decode_f16(sub[i]),
                          "%s: fp16 subnormal 0x%04x under FTZ/DAZ", paths[p], sub[i]);
        uint16_t bsub[2] = {0x000B, 0x807F};
        gpu_cvt_bf16_f32(out, bsub, 2);
        for (int i = 0; i < 2; i++)
            ck_assert_msg(f2u(out[i]) == (uint32_t)bsub[i] << 16, "%s: bf16 subnormal",
                          paths[p]);
        float tiny[2] = {u2f(0x000AE398), u2f(0x387FC000)};
        gpu_round_n(tiny, tiny, 1, GPU_BF16);
        ck_assert_uint_eq(f2u(tiny[0]), 0x000B0000u);
        gpu_round_n(tiny + 1, tiny + 1, 1, GPU_FP16);
        ck_assert_uint_eq(f2u(tiny[1]), 0x387FC000u);
    }
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
    ck_assert_int_eq(fesetenv(&env), 0);
    ck_assert_int_eq(gpu_cvt_force(orig), 0);
}
END_TEST

/* ---- first use from several threads at once ------------------------------------------------ */

static void *thread_convert(void *arg)
{
    uint16_t *out = arg;
    float in[100];
    for (int i = 0; i < 100; i++)
        in[i] = (float)i * 0.37f - 11.0f;
    gpu_cvt_f32_f16(out, in, 100);
    return (void *)gpu_cvt_impl();
}

START_TEST(t_threads)
{
    enum { T = 4 };
    pthread_t th[T];
    uint16_t out[T][100];
    void *name[T];
    for (int i = 0; i < T; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, thread_convert, out[i]), 0);
    for (int i = 0; i < T; i++)
        ck_assert_int_eq(pthread_join(th[i], &name[i]), 0);
    for (int i = 0; i < T; i++) {
        ck_assert_str_eq(name[i], gpu_cvt_impl());
        for (int k = 0; k < 100; k++)
            ck_assert_uint_eq(out[i][k], gpu_f32_to_f16((float)k * 0.37f - 11.0f));
    }
}
END_TEST

static Suite *format_suite(void)
{
    Suite *s = suite_create("format");
    TCase *tc = tcase_create("scalar");
    tcase_add_test(tc, t_dtype_helpers);
    tcase_add_test(tc, t_f16_all_patterns);
    tcase_add_test(tc, t_bf16_all_patterns);
    tcase_add_test(tc, t_f16_edges);
    tcase_add_test(tc, t_bf16_edges);
    tcase_add_test(tc, t_round_scalar);
    tcase_add_test(tc, t_dispatch);
    tcase_add_test(tc, t_rows);
    tcase_add_test(tc, t_typed);
    tcase_add_test(tc, t_fp_environment);
    tcase_add_test(tc, t_threads);
    tcase_add_test(tc, t_subnormal_watch);
    suite_add_tcase(s, tc);

    TCase *slow = tcase_create("bulk");
    tcase_set_timeout(slow, 30);
    tcase_add_test(slow, t_rne_random);
    tcase_add_test(slow, t_path_avx512bf16);
    tcase_add_test(slow, t_path_avx512);
    tcase_add_test(slow, t_path_f16c);
    tcase_add_test(slow, t_path_portable);
    tcase_add_test(slow, t_omp_threads);
    suite_add_tcase(s, slow);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(format_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
