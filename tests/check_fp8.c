/*
 * check_fp8.c - the fp8 formats (gpu/fp8.c) against NVIDIA's own host implementation
 * (tests/fp8_nv.cc: __nv_cvt_float_to_fp8 and __nv_cvt_fp8_to_halfraw of the CUDA
 * toolkit's cuda_fp8.hpp):
 *   - the 2^32 fp32 bit patterns converted to E4M3 and to E5M2, saturating and not, by the
 *     bulk conversion on every path this CPU has (portable, AVX2, AVX-512; in blocks of 2^16,
 *     and a block whose length is not a multiple of any vector's, for the tails), and
 *     every 61st by the scalar one, equal to
 *     NVIDIA's bits: all of them with AMPD_FP8_SWEEP=full (100 s on 2 cores), every 17th
 *     block by default (every 257th under AddressSanitizer), so that `make check` stays
 *     fast;
 *   - all 256 codes of each format back to fp32, exactly NVIDIA's value (every fp8 value is
 *     an fp16 one; a NaN code a NaN), by the scalar and the bulk conversion;
 *   - the formats' landmarks by hand: the largest values, the smallest subnormals, the ties
 *     at their edges, infinities and NaNs, signed zeros;
 *   - the scaling recipes replayed against a model written here from Transformer Engine's
 *     formulas (docs/fp8.md), sharing no code with gpu/fp8.c (its divisions in fp64, its
 *     window a list in time order): delayed scaling over 1000 steps of amaxes across fp32's
 *     range with 0, inf and NaN among them, from an empty (all-zero) history, for history
 *     lengths 1, 2, 16 and 1024, MAX and MOST_RECENT, margins 0 and 3, both formats: every
 *     step's scale, scale_inv and window bit for bit; current scaling likewise.
 * Exits 77 (SKIP) for the comparisons when built without the CUDA toolkit's headers.
 */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

#if defined(__SANITIZE_ADDRESS__)
#define ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ASAN 1
#endif
#endif

/* The sweep takes every stride-th block of 2^16 fp32 patterns: all of them (stride 1) with
 * AMPD_FP8_SWEEP=full, about 100 s on 2 cores; by default every 17th (6 s), and every
 * 257th under AddressSanitizer. */
static unsigned sweep_stride(void)
{
    const char *v = getenv("AMPD_FP8_SWEEP");
    if (v && strcmp(v, "full") == 0)
        return 1;
#ifdef ASAN
    return 257;
#else
    return 17;
#endif
}

#ifdef HAVE_FP8_NV
unsigned char fp8_nv_from_f32(float x, int e5m2, int saturate);
unsigned short fp8_nv_to_f16(unsigned char v, int e5m2);
#endif

static float from_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof(f));
    return f;
}

static uint32_t bits_of(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof(b));
    return b;
}

/* The landmarks of both formats, by hand. */
START_TEST(test_landmarks)
{
    ck_assert_uint_eq(gpu_f32_to_fp8(448.0f, GPU_E4M3, false), 0x7E);
    ck_assert_uint_eq(gpu_f32_to_fp8(464.0f, GPU_E4M3, false), 0x7E); /* the tie: to even */
    ck_assert_uint_eq(gpu_f32_to_fp8(464.5f, GPU_E4M3, false), 0x7F); /* NaN */
    ck_assert_uint_eq(gpu_f32_to_fp8(464.5f, GPU_E4M3, true), 0x7E);
    ck_assert_uint_eq(gpu_f32_to_fp8(-INFINITY, GPU_E4M3, true), 0xFE);
    ck_assert_uint_eq(gpu_f32_to_fp8(-INFINITY, GPU_E4M3, false), 0xFF);
    ck_assert_uint_eq(gpu_f32_to_fp8(57344.0f, GPU_E5M2, false), 0x7B);
    ck_assert_uint_eq(gpu_f32_to_fp8(61440.0f, GPU_E5M2, false), 0x7C); /* tie to even: inf */
    ck_assert_uint_eq(gpu_f32_to_fp8(61439.0f, GPU_E5M2, false), 0x7B);
    ck_assert_uint_eq(gpu_f32_to_fp8(61440.0f, GPU_E5M2, true), 0x7B);
    ck_assert_uint_eq(gpu_f32_to_fp8(INFINITY, GPU_E5M2, false), 0x7C);
    ck_assert_uint_eq(gpu_f32_to_fp8(ldexpf(1, -9), GPU_E4M3, false), 0x01);   /* smallest */
    ck_assert_uint_eq(gpu_f32_to_fp8(ldexpf(1, -10), GPU_E4M3, false), 0x00);  /* its half */
    ck_assert_uint_eq(gpu_f32_to_fp8(ldexpf(3, -10), GPU_E4M3, false), 0x02);  /* 1.5: to even */
    ck_assert_uint_eq(gpu_f32_to_fp8(ldexpf(3, -11), GPU_E4M3, false), 0x01);  /* 0.75: up */
    ck_assert_uint_eq(gpu_f32_to_fp8(-ldexpf(1, -17), GPU_E5M2, false), 0x80); /* -0 */
    ck_assert_uint_eq(gpu_f32_to_fp8(ldexpf(1.01f, -17), GPU_E5M2, false), 0x01);
    ck_assert_uint_eq(gpu_f32_to_fp8(ldexpf(7, -9), GPU_E4M3, false), 0x07);   /* largest subn. */
    ck_assert_uint_eq(gpu_f32_to_fp8(ldexpf(15, -10), GPU_E4M3, false), 0x08); /* -> 2^-6 */
    ck_assert_uint_eq(gpu_f32_to_fp8(NAN, GPU_E4M3, true), 0x7F);
    ck_assert_uint_eq(gpu_f32_to_fp8(-NAN, GPU_E5M2, true), 0x7F); /* one NaN, no sign */
    ck_assert_uint_eq(gpu_f32_to_fp8(from_bits(0xFF800001u), GPU_E4M3, false), 0x7F);
    ck_assert_uint_eq(gpu_f32_to_fp8(-0.0f, GPU_E4M3, false), 0x80);
    ck_assert(gpu_fp8_to_f32(0x7E, GPU_E4M3) == 448.0f);
    ck_assert(gpu_fp8_to_f32(0xFB, GPU_E5M2) == -57344.0f);
    ck_assert(gpu_fp8_to_f32(0x01, GPU_E4M3) == ldexpf(1, -9));
    ck_assert(gpu_fp8_to_f32(0x01, GPU_E5M2) == ldexpf(1, -16));
    ck_assert(isinf(gpu_fp8_to_f32(0xFC, GPU_E5M2)) && gpu_fp8_to_f32(0xFC, GPU_E5M2) < 0);
    ck_assert_uint_eq(bits_of(gpu_fp8_to_f32(0xFF, GPU_E4M3)), 0x7FC00000u);
    ck_assert_uint_eq(bits_of(gpu_fp8_to_f32(0x7D, GPU_E5M2)), 0x7FC00000u);
    ck_assert_uint_eq(bits_of(gpu_fp8_to_f32(0x80, GPU_E5M2)), 0x80000000u);
    ck_assert(gpu_fp8_max(GPU_E4M3) == 448.0f && gpu_fp8_max(GPU_E5M2) == 57344.0f);
    ck_assert_str_eq(gpu_fp8_format_name(GPU_E5M2), "e5m2");
}
END_TEST

/* ---- scaling ------------------------------------------------------------------------------ */

/* The model's amax of the window: the largest, NaNs never larger than anything. */
static float model_largest(const float *w, int n, float start)
{
    float m = start;
    for (int i = 0; i < n; i++)
        if (w[i] > m)
            m = w[i];
    return m;
}

static float model_divide(float num, float den)
{
    return (float)((double)num / (double)den); /* fp64, rounded once: fp32's own quotient */
}

/* A trace of amaxes: magnitudes from 2^-140 to 2^120, with 0, inf and NaN among them and a
 * run of zeros first (the history starts empty and nothing happens). */
static float trace_amax(int step, uint64_t *rng)
{
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t r = (uint32_t)(*rng >> 33);
    if (step < 3 || r % 41 == 0)
        return 0.0f;
    if (r % 53 == 1)
        return INFINITY;
    if (r % 59 == 2)
        return NAN;
    return ldexpf(1.0f + (float)(r & 0xFFFF) / 65536.0f, (int)(r >> 16) % 261 - 140);
}

START_TEST(test_delayed_scaling)
{
    static const int lens[] = {1, 2, 16, 1024};
    for (int c = 0; c < 4 * 2 * 2 * 2; c++) {
        int len = lens[c % 4], margin = (c / 4) % 2 ? 3 : 0;
        gpu_fp8_amax_algo algo = (c / 8) % 2 ? GPU_FP8_AMAX_MOST_RECENT : GPU_FP8_AMAX_MAX;
        gpu_fp8_format f = (c / 16) % 2 ? GPU_E5M2 : GPU_E4M3;
        float *hist = calloc((size_t)len, sizeof(float));
        float *past = calloc((size_t)len, sizeof(float)); /* the model: oldest first */
        float scale = 1.0f, scale_inv = 1.0f, mscale = 1.0f, minv = 1.0f;
        float smax = (float)((f == GPU_E5M2 ? 57344.0 : 448.0) * pow(2.0, -margin));
        uint64_t rng = (uint64_t)c + 1;
        ck_assert(hist && past);
        ck_assert(gpu_fp8_scaled_max(f, margin) == smax);
        for (int step = 0; step < 1000; step++) {
            float a = trace_amax(step, &rng);
            hist[0] = a;
            gpu_fp8_delayed_update(hist, len, algo, gpu_fp8_scaled_max(f, margin), &scale,
                                   &scale_inv);
            if (a != 0.0f) {
                float amax = algo == GPU_FP8_AMAX_MAX
                                 ? model_largest(past + 1, len - 1, a > 0.0f ? a : 0.0f)
                                 : a;
                if (amax > 0.0f && amax < INFINITY) {
                    mscale = model_divide(smax, amax);
                    if (mscale > FLT_MAX)
                        mscale = FLT_MAX;
                }
                minv = model_divide(1.0f, mscale);
                for (int i = 1; i < len; i++) /* the oldest leaves, the new one comes last */
                    past[i - 1] = past[i];
                past[len - 1] = a;
            }
            ck_assert_msg(bits_of(scale) == bits_of(mscale) && bits_of(scale_inv) == bits_of(minv),
                          "len %d %s margin %d %s, step %d (amax %a): scale %a / %a, model %a / %a",
                          len, algo ? "most_recent" : "max", margin, gpu_fp8_format_name(f), step,
                          (double)a, (double)scale, (double)scale_inv, (double)mscale,
                          (double)minv);
            int differ = hist[0] == 0.0f ? 0 : -1; /* each ck_assert costs a write: one */
            for (int i = 1; i < len && differ == 0; i++)
                differ = bits_of(hist[i]) == bits_of(past[i]) ? 0 : i;
            ck_assert_msg(differ == 0, "step %d: window[%d] differs", step, differ);
        }
        free(hist);
        free(past);
    }
}
END_TEST

START_TEST(test_current_scaling)
{
    uint64_t rng = 7;
    for (int step = 0; step < 1000; step++) {
        for (int f = 0; f < 2; f++) {
            float amax = trace_amax(step, &rng), eps = step % 3 == 0 ? ldexpf(1, -20) : 0.0f;
            float smax = gpu_fp8_scaled_max((gpu_fp8_format)f, step % 2);
            float got = gpu_fp8_current_scale(amax, smax, eps), a = amax < eps ? eps : amax;
            float want = a > 0.0f && a < INFINITY ? model_divide(smax, a) : 1.0f;
            if (want > FLT_MAX)
                want = FLT_MAX;
            ck_assert_msg(bits_of(got) == bits_of(want), "amax %a eps %a: %a, model %a",
                          (double)amax, (double)eps, (double)got, (double)want);
        }
    }
    ck_assert(gpu_fp8_current_scale(ldexpf(1, -140), 448.0f, 0.0f) == FLT_MAX);
    ck_assert(gpu_fp8_current_scale(NAN, 448.0f, 1e-12f) == 1.0f);
    ck_assert(gpu_fp8_current_scale(2.0f, 448.0f, 0.0f) == 224.0f);
}
END_TEST

#ifdef HAVE_FP8_NV
/* All 256 codes back to fp32: NVIDIA's value (its fp16, widened exactly), NaN for NaN. */
START_TEST(test_decode_all_codes)
{
    for (int f = 0; f < 2; f++) {
        uint8_t codes[256];
        float bulk[256];
        for (int c = 0; c < 256; c++)
            codes[c] = (uint8_t)c;
        gpu_cvt_fp8_f32(bulk, codes, 256, (gpu_fp8_format)f);
        for (int c = 0; c < 256; c++) {
            float want = gpu_f16_to_f32(fp8_nv_to_f16((uint8_t)c, f));
            float got = gpu_fp8_to_f32((uint8_t)c, (gpu_fp8_format)f);
            if (isnan(want))
                ck_assert_msg(isnan(got) && isnan(bulk[c]), "%s code 0x%02x: %g, not NaN",
                              gpu_fp8_format_name(f), c, (double)got);
            else
                ck_assert_msg(bits_of(got) == bits_of(want) && bits_of(bulk[c]) == bits_of(want),
                              "%s code 0x%02x: %a (bulk %a), NVIDIA %a", gpu_fp8_format_name(f), c,
                              (double)got, (double)bulk[c], (double)want);
        }
    }
}
END_TEST

#define BLOCK (1u << 16)

/* The fp32 patterns of every stride-th block, both formats, both overflow modes, on every
 * bulk path this CPU has (and every 61st pattern by the scalar conversion). */
START_TEST(test_encode_every_f32)
{
    static const char *const paths[] = {"portable", "avx2", "avx512"};
    enum { NPATHS = sizeof(paths) / sizeof(paths[0]) };
    uint64_t checked = 0, wrong = 0;
    const unsigned stride = sweep_stride();
    char first[200] = "", have[40] = "";
    const char *best = "portable";
    int npaths = 0;
    for (int k = 0; k < NPATHS; k++) {
        uint8_t d;
        float x = 1.0f;
        if (gpu_cvt_f32_fp8_on(paths[k], &d, &x, 1, GPU_E4M3, true) == 0) {
            snprintf(have + strlen(have), sizeof(have) - strlen(have), "%s%s", npaths ? ", " : "",
                     paths[k]);
            npaths++;
            best = paths[k];
        }
    }
#pragma omp parallel reduction(+ : checked, wrong)
    {
        float *src = malloc(BLOCK * sizeof(float));
        uint8_t *dst = malloc(BLOCK), *want = malloc(BLOCK);
#pragma omp for schedule(dynamic, 16)
        for (uint64_t blk = 0; blk < ((uint64_t)1 << 32) / BLOCK; blk++) {
            uint32_t base = (uint32_t)(blk * BLOCK);
            if (!src || !dst || !want) { /* out of memory: counted as a difference */
                wrong++;
                continue;
            }
            if (blk % stride != 0)
                continue;
            for (uint32_t i = 0; i < BLOCK; i++)
                src[i] = from_bits(base + i);
            for (int mode = 0; mode < 4; mode++) { /* bit 0: E5M2, bit 1: saturating */
                int e5m2 = mode & 1, sat = mode >> 1;
                gpu_fp8_format f = e5m2 ? GPU_E5M2 : GPU_E4M3;
                for (uint32_t i = 0; i < BLOCK; i++)
                    want[i] = fp8_nv_from_f32(src[i], e5m2, sat);
                for (int k = 0; k < NPATHS; k++) {
                    if (gpu_cvt_f32_fp8_on(paths[k], dst, src, BLOCK, f, sat) != 0)
                        continue;
                    for (uint32_t i = 0; i < BLOCK; i++) {
                        bool bad = dst[i] != want[i] || (k == 0 && (base + i) % 61 == 0 &&
                                                         gpu_f32_to_fp8(src[i], f, sat) != want[i]);
                        checked++;
                        if (bad && wrong++ == 0) {
#pragma omp critical
                            snprintf(first, sizeof(first),
                                     "0x%08x to %s%s on %s: 0x%02x, NVIDIA 0x%02x", base + i,
                                     gpu_fp8_format_name(f), sat ? " saturating" : "", paths[k],
                                     dst[i], want[i]);
                        }
                    }
                }
            }
        }
        free(src);
        free(dst);
        free(want);
    }
    printf("fp8: %llu conversions (%s of the 2^32 fp32 patterns x 2 formats x 2 modes, on the "
           "paths %s) compared with NVIDIA's, %llu differ\n",
           (unsigned long long)checked, stride > 1 ? "a part" : "all", have,
           (unsigned long long)wrong);
    ck_assert_msg(wrong == 0, "%llu conversions differ from NVIDIA's; the first: %s",
                  (unsigned long long)wrong, first);
    ck_assert(stride > 1 || checked == (uint64_t)npaths << 34);
    ck_assert_str_eq(gpu_fp8_impl(), best);
}
END_TEST
#endif

/* Every length from 0 to 50 on every path: the vector paths' tails give the scalar
 * conversion's codes and write nothing past the end. */
START_TEST(test_encode_tails)
{
    static const char *const paths[] = {"portable", "avx2", "avx512"};
    float src[50];
    uint8_t dst[51];
    for (int i = 0; i < 50; i++) /* both signs, normals, subnormals, ties, past the max, NaN */
        src[i] = i == 7    ? NAN
                 : i == 13 ? -INFINITY
                           : ldexpf(1.0f + (float)(i % 9) / 16, i - 25) * (i % 2 ? -1 : 1);
    for (size_t k = 0; k < sizeof(paths) / sizeof(paths[0]); k++)
        for (int mode = 0; mode < 4; mode++) {
            gpu_fp8_format f = mode & 1 ? GPU_E5M2 : GPU_E4M3;
            bool sat = mode >> 1;
            for (size_t n = 0; n <= 50; n++) {
                memset(dst, 0xA5, sizeof(dst));
                if (gpu_cvt_f32_fp8_on(paths[k], dst, src, n, f, sat) != 0)
                    break; /* this CPU lacks the path */
                for (size_t i = 0; i < n; i++)
                    ck_assert_msg(dst[i] == gpu_f32_to_fp8(src[i], f, sat),
                                  "%s, n %zu: [%zu] %a gave 0x%02x, not 0x%02x", paths[k], n, i,
                                  (double)src[i], dst[i], gpu_f32_to_fp8(src[i], f, sat));
                ck_assert_msg(dst[n] == 0xA5, "%s wrote past %zu values", paths[k], n);
            }
        }
}
END_TEST

static Suite *fp8_suite(void)
{
    Suite *s = suite_create("fp8");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 900);
    tcase_add_test(tc, test_landmarks);
    tcase_add_test(tc, test_delayed_scaling);
    tcase_add_test(tc, test_current_scaling);
    tcase_add_test(tc, test_encode_tails);
#ifdef HAVE_FP8_NV
    tcase_add_test(tc, test_decode_all_codes);
    tcase_add_test(tc, test_encode_every_f32);
#endif
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(fp8_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
#ifndef HAVE_FP8_NV
    if (failed == 0) {
        printf("SKIP: check_fp8: built without the CUDA toolkit's cuda_fp8.h, so NVIDIA's "
               "conversions are not here to compare with (the landmarks passed)\n");
        return 77;
    }
#endif
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
