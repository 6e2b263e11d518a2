/*
 * check_gemm.c - Check suite "gemm": gpu_gemm and gpu_gemm_ex against the fp64 reference
 * gpu_gemm_ref on every path this machine has (OpenBLAS; fp32 on oneDNN with 16-bit operands
 * widened; native bf16 on oneDNN; the native plans with the kernels emulated, on every CPU),
 * the bounded scratch of the blockwise conversion and its length check (GPU_ESCRATCH), and
 * the kernel choice gpu_blas_init makes. A path this machine lacks: a SKIP line per case and
 * path. After the tests it prints the paths it ran.
 *
 * Operands are stored in buffers of exactly their footprint ((rows-1)*ld + cols elements)
 * so that AddressSanitizer catches any read past the last row, and the padding between rows
 * (and beside C) holds NaN so that any use of it shows in the result or the check.
 *
 * Tolerance. The reference sums in double and rounds once, so it is within u|c| of the
 * exact c (u = 2^-24). An fp32 GEMM of any summation order, blocking or FMA use computes
 * each element as a sum of K products plus beta*c: K+1 terms, so its error is at most
 * gamma_{K+1} * S with S = sum_k |a_ik||b_kj| + |beta c_ij| and gamma_n = n u / (1 - n u)
 * (Higham, Accuracy and Stability, 3.1). Since |c| <= S, the two differ by at most
 * (K+2) u S / (1 - (K+1) u), and we allow 1% over that plus a few subnormal units for
 * underflow. Widening a 16-bit operand is exact, so operands pre-rounded to fp16/bf16 give
 * the same bound against the reference of the rounded values; a lossy widening (or a
 * wrong ld, transposition or dtype) breaks it by orders of magnitude.
 *
 * Results need not be bit-identical for 1 and 2 BLAS threads (blocking changes the
 * summation order), so nothing here compares them.
 *
 * Threads: each test runs in its own process (Check's fork mode) or in sequence; the
 * kernel-choice tests re-execute this binary (--blas-info) for a fresh process.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu/gpu_int.h"
#include "tests/testutil.h"

#ifndef AMPD_OPENBLAS_PATH
#define AMPD_OPENBLAS_PATH "libopenblas.so.0" /* as gpu/blas.c */
#endif

extern char **environ;

static const int sizes[] = {1, 3, 17, 31, 65, 127, 255};
#define NSIZES ((int)(sizeof sizes / sizeof sizes[0]))

/* One operand: the fp32 values the reference sees and the stored form gpu_gemm reads. */
typedef struct {
    int rows, cols, ld;
    gpu_dtype dt;
    float *ref;   /* rows x cols at ld, fp32; padding NaN */
    void *store;  /* the same in dt (aliases ref for fp32) */
    size_t n;     /* footprint in elements */
} operand;

static const char *dtname(gpu_dtype dt)
{
    return dt == GPU_FP16 ? "fp16" : dt == GPU_BF16 ? "bf16" : "fp32";
}

static size_t footprint(int rows, int cols, int ld)
{
    return rows > 0 && cols > 0 ? (size_t)(rows - 1) * (size_t)ld + (size_t)cols : 0;
}

/* Random values in [-1, 1), rounded to dt. */
static void operand_make(operand *o, int rows, int cols, int ld, gpu_dtype dt, gpu_rng *rng)
{
    o->rows = rows;
    o->cols = cols;
    o->ld = ld;
    o->dt = dt;
    o->n = footprint(rows, cols, ld);
    o->ref = malloc((o->n > 0 ? o->n : 1) * sizeof(float));
    ck_assert_ptr_nonnull(o->ref);
    for (size_t i = 0; i < o->n; i++) {
        bool pad = (int)(i % (size_t)ld) >= cols;
        o->ref[i] = pad ? NAN : gpu_round(2.0f * gpu_rng_uniform(rng) - 1.0f, dt);
    }
    if (dt == GPU_FP32) {
        o->store = o->ref;
        return;
    }
    uint16_t *s = malloc((o->n > 0 ? o->n : 1) * sizeof(uint16_t));
    ck_assert_ptr_nonnull(s);
    for (size_t i = 0; i < o->n; i++)
        s[i] = dt == GPU_FP16 ? gpu_f32_to_f16(o->ref[i]) : gpu_f32_to_bf16(o->ref[i]);
    o->store = s;
}

static void operand_free(operand *o)
{
    if (o->store != o->ref)
        free(o->store);
    free(o->ref);
}

/* Set element (r, c) of an operand in both forms. */
static void operand_set(operand *o, int r, int c, float v)
{
    size_t i = (size_t)r * (size_t)o->ld + (size_t)c;
    o->ref[i] = v;
    if (o->dt == GPU_FP16)
        ((uint16_t *)o->store)[i] = gpu_f32_to_f16(v);
    else if (o->dt == GPU_BF16)
        ((uint16_t *)o->store)[i] = gpu_f32_to_bf16(v);
}

/* Compare C (from gpu_gemm) with the reference R elementwise under the bound above. C0 is
 * C's content before the call. Padding of C must be untouched (still NaN). */
static void check_result(bool ta, bool tb, int M, int N, int K, const operand *a,
                         const operand *b, float beta, const float *C0, const float *C,
                         const float *R, int ldc, const char *what)
{
    const double u = ldexp(1.0, -24);
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            size_t at = (size_t)i * (size_t)ldc + (size_t)j;
            double s = beta != 0.0f ? fabs((double)beta * C0[at]) : 0.0;
            for (int k = 0; k < K; k++) {
                double x = ta ? a->ref[(size_t)k * a->ld + i] : a->ref[(size_t)i * a->ld + k];
                double y = tb ? b->ref[(size_t)j * b->ld + k] : b->ref[(size_t)k * b->ld + j];
                s += fabs(x * y);
            }
            double tol = 1.01 * (K + 2) * u * s / (1.0 - (K + 1) * u) +
                         (K + 2) * (double)FLT_TRUE_MIN;
            double err = fabs((double)C[at] - (double)R[at]);
            ck_assert_msg(err <= tol,
                          "%s: ta=%d tb=%d M=%d N=%d K=%d beta=%g: C[%d,%d]=%.9g ref %.9g "
                          "err %.3g > tol %.3g",
                          what, ta, tb, M, N, K, beta, i, j, C[at], R[at], err, tol);
        }
        for (int j = N; j < ldc && i + 1 < M; j++)
            ck_assert_msg(isnan(C[(size_t)i * ldc + j]), "%s: C padding written", what);
    }
}

/* For a product in dt: an fp32 operand's values rounded to dt, for the reference only when
 * gpu_gemm_ex is to round them (keep), else in the stored operand too. */
static void operand_round(operand *o, gpu_dtype dt, bool keep)
{
    if (o->dt != GPU_FP32)
        return;
    if (!keep) {
        for (size_t i = 0; i < o->n; i++)
            o->ref[i] = gpu_round(o->ref[i], dt);
        return;
    }
    float *s = malloc((o->n > 0 ? o->n : 1) * sizeof(float));
    ck_assert_ptr_nonnull(s);
    memcpy(s, o->ref, o->n * sizeof(float));
    o->store = s;
    for (size_t i = 0; i < o->n; i++)
        o->ref[i] = gpu_round(o->ref[i], dt);
}

/* Run one GEMM through gpu_gemm (cdt < 0) or gpu_gemm_ex in cdt, rounding the fp32
 * operands named in round, and through the reference, and compare. pad: extra columns of
 * every leading dimension. */
static void run_case_ex(bool ta, bool tb, int M, int N, int K, gpu_dtype adt, gpu_dtype bdt,
                        int cdt, unsigned round, int pad, float beta, gpu_rng *rng)
{
    operand a, b;
    int a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
    operand_make(&a, a_rows, a_cols, (a_cols > 0 ? a_cols : 1) + pad, adt, rng);
    operand_make(&b, b_rows, b_cols, (b_cols > 0 ? b_cols : 1) + pad, bdt, rng);
    if (cdt >= 0) {
        operand_round(&a, (gpu_dtype)cdt, round & GPU_GEMM_ROUND_A);
        operand_round(&b, (gpu_dtype)cdt, round & GPU_GEMM_ROUND_B);
    }
    int ldc = (N > 0 ? N : 1) + pad;
    size_t nc = footprint(M, N, ldc) > 0 ? footprint(M, N, ldc) : 1; /* exact, for ASan */
    float *C0 = malloc(nc * sizeof *C0), *C = malloc(nc * sizeof *C);
    float *R = malloc(nc * sizeof *R);
    ck_assert(C0 != NULL && C != NULL && R != NULL);
    for (size_t i = 0; i < nc; i++) {
        bool pad_or_beta0 = (int)(i % (size_t)ldc) >= N || beta == 0.0f;
        /* With beta == 0, C's old content must be ignored (BLAS): make it NaN. */
        C0[i] = pad_or_beta0 ? NAN : 2.0f * gpu_rng_uniform(rng) - 1.0f;
    }
    memcpy(C, C0, nc * sizeof *C);
    memcpy(R, C0, nc * sizeof *R);

    size_t ns = cdt < 0 ? gpu_gemm_scratch_floats(ta, tb, M, N, K, adt, a.ld, bdt, b.ld)
                        : gpu_gemm_ex_scratch_floats(M, N, K, adt, bdt, (gpu_dtype)cdt, round);
    /* never more than whole converted copies and a dense copy of C (plus alignment);
     * nothing for fp32 */
    bool empty = M == 0 || N == 0 || K == 0, fp32 = adt == GPU_FP32 && bdt == GPU_FP32;
    if (empty || fp32)
        ck_assert_uint_eq(ns, 0);
    ck_assert_uint_le(ns, a.n + b.n + (size_t)M * (size_t)N + 64);
    /* exactly ns floats, so that ASan sees any write past them */
    float *scratch = ns > 0 ? malloc(ns * sizeof *scratch) : NULL;
    ck_assert(ns == 0 || scratch != NULL);

    int rc = cdt < 0 ? gpu_gemm(ta, tb, M, N, K, a.store, adt, a.ld, b.store, bdt, b.ld, beta,
                                C, ldc, scratch, ns)
                     : gpu_gemm_ex(ta, tb, M, N, K, a.store, adt, a.ld, b.store, bdt, b.ld,
                                   (gpu_dtype)cdt, round, beta, C, ldc, scratch, ns);
    ck_assert_int_eq(rc, 0);
    gpu_gemm_ref(ta, tb, M, N, K, a.ref, a.ld, b.ref, b.ld, beta, R, ldc);
    char what[64];
    snprintf(what, sizeof what, "%s x %s pad %d", dtname(adt), dtname(bdt), pad);
    check_result(ta, tb, M, N, K, &a, &b, beta, C0, C, R, ldc, what);

    free(scratch);
    free(R);
    free(C);
    free(C0);
    operand_free(&b);
    operand_free(&a);
}

static void run_case(bool ta, bool tb, int M, int N, int K, gpu_dtype adt, gpu_dtype bdt,
                     int pad, float beta, gpu_rng *rng)
{
    run_case_ex(ta, tb, M, N, K, adt, bdt, -1, 0, pad, beta, rng);
}

static void run_case_in(bool ta, bool tb, int M, int N, int K, gpu_dtype adt, gpu_dtype bdt,
                        int cdt, int pad, float beta, gpu_rng *rng)
{
    run_case_ex(ta, tb, M, N, K, adt, bdt, cdt, 0, pad, beta, rng);
}

/* ---- the paths -------------------------------------------------------------------------- */

/* emulated: the native plans with the native kernels emulated, on every CPU */
static const char *const paths[] = {"openblas", "widen", "native", "emulated"};
#define NPATHS ((int)(sizeof paths / sizeof paths[0]))

/* Force path i for the case fn (a loop test's iteration iter, -1 for a plain test); false
 * where this machine lacks the path, with the case's SKIP line: once per path and case (a
 * loop test's at its iteration 0, for every iteration). */
static bool use_path(const char *fn, int iter, int i)
{
    static const char *said[NPATHS]; /* the case that said so: one process runs them all */
    int rc = gpu_gemm_force(paths[i]);
    if (rc == GPU_ENODEV) {
        if (iter <= 0 && said[i] != fn)
            test_skip(fn, paths[i],
                      "not on this machine%s (widen and native need oneDNN's "
                      "AVX-512 kernels; oneDNN: %s)",
                      iter == 0 ? ", in every iteration" : "",
                      gpu_dnnl_info() ? gpu_dnnl_info() : "not loaded");
        said[i] = fn;
        return false;
    }
    ck_assert_int_eq(rc, 0);
    return true;
}

/* ---- the reference itself --------------------------------------------------------------- */

/* A 2x3 times 3x2 product worked by hand, through every transposition and with beta. */
START_TEST(t_ref_known)
{
    const float a[6] = {1, 2, 3, 4, 5, 6};        /* A = [1 2 3; 4 5 6] */
    const float at[6] = {1, 4, 2, 5, 3, 6};       /* A^T stored 3x2 */
    const float b[6] = {7, 8, 9, 10, 11, 12};     /* B = [7 8; 9 10; 11 12] */
    const float bt[6] = {7, 9, 11, 8, 10, 12};    /* B^T stored 2x3 */
    const float want[4] = {58, 64, 139, 154};
    for (int t = 0; t < 4; t++) {
        bool ta = t & 1, tb = t & 2;
        float c[4] = {1, 1, 1, 1};
        gpu_gemm_ref(ta, tb, 2, 2, 3, ta ? at : a, ta ? 2 : 3, tb ? bt : b, tb ? 3 : 2, 0.5f,
                     c, 2);
        for (int i = 0; i < 4; i++)
            ck_assert_float_eq(c[i], want[i] + 0.5f);
    }
    float c0[1] = {NAN};
    gpu_gemm_ref(false, false, 1, 1, 3, a, 3, b, 2, 0.0f, c0, 1); /* beta 0 ignores NaN */
    ck_assert_float_eq(c0[0], 1 * 7 + 2 * 9 + 3 * 11);
}
END_TEST

/* ---- fp32 operands ---------------------------------------------------------------------- */

/* Random shapes from the odd sizes, one transposition per loop index, with and without
 * padding, beta 0 and 1. */
static void fp32_shapes(bool ta, bool tb, gpu_rng *rng);

START_TEST(t_fp32_shapes)
{
    gpu_rng rng;
    gpu_rng_seed(&rng, 100 + (uint64_t)_i);
    ck_assert_int_eq(gpu_blas_init(2), 0);
    for (int p = 0; p < NPATHS; p++)
        if (use_path(__func__, _i, p))
            fp32_shapes(_i & 1, _i & 2, &rng);
}
END_TEST

static void fp32_shapes(bool ta, bool tb, gpu_rng *rng)
{
    gpu_rng r = *rng; /* the same cases on every path */
    for (int c = 0; c < 14; c++) {
        int M = sizes[gpu_rng_below(&r, NSIZES)];
        int N = sizes[gpu_rng_below(&r, NSIZES)];
        int K = sizes[gpu_rng_below(&r, NSIZES)];
        if ((double)M * N * K > 1.2e6) /* keep the fp64 reference cheap under sanitizers */
            K = 17;
        run_case(ta, tb, M, N, K, GPU_FP32, GPU_FP32, c % 3 == 0 ? 0 : 1 + c % 5,
                 c % 2 ? 1.0f : 0.0f, &r);
    }
    /* Sizes large enough for the libraries' threaded paths. */
    run_case(ta, tb, 255, 127, 33, GPU_FP32, GPU_FP32, 3, 1.0f, &r);
    run_case(ta, tb, 256, 10, 255, GPU_FP32, GPU_FP32, 0, 0.0f, &r);
}

/* A beta that is neither 0 nor 1 and one BLAS thread. */
START_TEST(t_fp32_beta_threads)
{
    gpu_rng rng;
    gpu_rng_seed(&rng, 7);
    ck_assert_int_eq(gpu_blas_init(1), 0);
    run_case(false, true, 65, 31, 127, GPU_FP32, GPU_FP32, 2, -0.75f, &rng);
    run_case(true, false, 31, 65, 17, GPU_FP32, GPU_FP32, 0, 0.5f, &rng);
    ck_assert_int_eq(gpu_blas_init(2), 0);
    run_case(true, true, 127, 65, 31, GPU_FP32, GPU_FP32, 1, 2.0f, &rng);
}
END_TEST

/* K == 0 is C = beta*C (beta 0 writes zeros even over NaN); M or N == 0 touches nothing. */
START_TEST(t_empty)
{
    float c[6], junk = 1.0f;
    for (int i = 0; i < 6; i++)
        c[i] = NAN;
    ck_assert_int_eq(gpu_gemm(false, false, 2, 3, 0, NULL, GPU_FP16, 1, NULL, GPU_FP32, 3,
                              0.0f, c, 3, NULL, 0), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_float_eq(c[i], 0.0f);
    for (int i = 0; i < 6; i++)
        c[i] = (float)i + 1.0f;
    ck_assert_int_eq(gpu_gemm(true, true, 2, 3, 0, NULL, GPU_FP32, 2, NULL, GPU_BF16, 1,
                              1.0f, c, 3, NULL, 0), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_float_eq(c[i], (float)i + 1.0f);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 0, NULL, GPU_FP32, 1, NULL, GPU_FP32, 2,
                              -0.5f, c, 3, NULL, 0), 0);
    ck_assert_float_eq(c[0], -0.5f);
    ck_assert_float_eq(c[1], -1.0f);
    ck_assert_float_eq(c[2], 3.0f); /* outside N = 2: untouched */
    ck_assert_float_eq(c[3], -2.0f);
    ck_assert_float_eq(c[4], -2.5f);
    ck_assert_float_eq(c[5], 6.0f);
    ck_assert_int_eq(gpu_gemm(false, false, 0, 3, 4, NULL, GPU_FP32, 4, &junk, GPU_FP32, 3,
                              0.0f, NULL, 3, NULL, 0), 0);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 0, 4, &junk, GPU_FP32, 4, NULL, GPU_FP32, 1,
                              0.0f, c, 1, NULL, 0), 0);
    ck_assert_float_eq(c[0], -0.5f);
    ck_assert_uint_eq(gpu_gemm_scratch_floats(false, false, 2, 3, 0, GPU_FP16, 1, GPU_FP16, 3),
                      0);
    /* The generic path with K == 0 through the reference as well. */
    gpu_rng rng;
    gpu_rng_seed(&rng, 3);
    run_case(true, false, 17, 3, 0, GPU_FP16, GPU_FP32, 1, 1.0f, &rng);
    run_case(false, true, 3, 17, 0, GPU_BF16, GPU_FP16, 0, 0.0f, &rng);
}
END_TEST

/* ---- 16-bit operands -------------------------------------------------------------------- */

static const gpu_dtype lowp_pairs[][2] = {
    {GPU_FP16, GPU_FP32}, {GPU_FP32, GPU_FP16}, {GPU_FP16, GPU_FP16},
    {GPU_BF16, GPU_FP32}, {GPU_FP32, GPU_BF16}, {GPU_BF16, GPU_BF16},
    {GPU_FP16, GPU_BF16},
};

/* Each dtype pair through all four transpositions, padded and not, beta 0 and 1, on each
 * path: through gpu_gemm (exact) and through gpu_gemm_ex in the 16-bit dtype. */
static void lowp_cases(gpu_dtype adt, gpu_dtype bdt, int cdt, gpu_rng *rng)
{
    gpu_rng r = *rng;
    for (int c = 0; c < 8; c++) {
        int M = sizes[gpu_rng_below(&r, NSIZES)];
        int N = sizes[gpu_rng_below(&r, NSIZES)];
        int K = sizes[gpu_rng_below(&r, NSIZES)];
        if ((double)M * N * K > 1.2e6)
            M = 31;
        run_case_ex(c & 1, c & 2, M, N, K, adt, bdt, cdt, (unsigned)(c * 5 / 2) % 4,
                    c & 4 ? 3 : 0, c % 3 ? 1.0f : 0.0f, &r);
    }
    /* An MLP-like shape: X[256,k] times W^T with 16-bit operands. */
    run_case_in(false, true, 32, 255, 127, adt, bdt, cdt, 0, 0.0f, &r);
}

START_TEST(t_lowp)
{
    gpu_dtype adt = lowp_pairs[_i][0], bdt = lowp_pairs[_i][1];
    gpu_dtype low = adt != GPU_FP32 ? adt : bdt;
    gpu_rng rng;
    gpu_rng_seed(&rng, 200 + (uint64_t)_i);
    for (int p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, _i, p))
            continue;
        lowp_cases(adt, bdt, -1, &rng);
        lowp_cases(adt, bdt, low, &rng); /* fp16 x bf16 in fp16: computed exactly */
    }
}
END_TEST

/* Operands large enough to be converted in several blocks, the last one partial: A
 * streamed by rows of C, B by columns, each with the other operand in place or converted
 * whole, through gpu_gemm and gpu_gemm_ex in bf16. */
START_TEST(t_blocks)
{
    gpu_rng rng;
    gpu_rng_seed(&rng, 300);
    for (int p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, -1, p))
            continue;
        run_case_in(false, false, 700, 37, 400, GPU_FP16, GPU_FP32, -1, 1, 1.0f, &rng);
        run_case_in(true, false, 700, 37, 400, GPU_BF16, GPU_BF16, -1, 0, 0.0f, &rng);
        run_case_in(false, true, 37, 900, 300, GPU_FP32, GPU_FP16, -1, 2, 0.0f, &rng);
        run_case_in(true, false, 45, 900, 300, GPU_BF16, GPU_BF16, -1, 0, 1.0f, &rng);
        /* a weight gradient's shape: fp32 A^T read in place, B streamed along K (widened) */
        run_case_in(true, false, 40, 1000, 700, GPU_FP32, GPU_FP16, -1, 1, 1.0f, &rng);
        run_case_in(false, true, 41, 900, 300, GPU_FP32, GPU_BF16, GPU_BF16, 0, 0.0f, &rng);
        run_case_ex(true, true, 700, 37, 400, GPU_FP32, GPU_BF16, GPU_BF16, GPU_GEMM_ROUND_A, 3,
                    1.0f, &rng);
        run_case_ex(false, true, 45, 900, 300, GPU_FP16, GPU_FP32, GPU_FP16, GPU_GEMM_ROUND_B,
                    0, 0.0f, &rng);
    }
}
END_TEST

/* Subnormal bf16 values, which AVX512_BF16 reads as zero, survive on every path: stored
 * bf16 (read in place by the native kernels) and fp32 narrowed to bf16 by gpu_gemm_ex,
 * with beta 0 and 1. C = A B with B all ones sums each row of A exactly. */
static void subnormal_case(bool f32a, float beta)
{
    enum { M = 9, N = 40, K = 33 };
    float ref[M * K], ones[K * N], C[M * N], want[M * N], sc[4096];
    uint16_t a16[M * K], b16[K * N];
    for (int i = 0; i < M * K; i++) {
        ref[i] = i % 5 == 0 ? ldexpf((float)(1 + i % 7), -133) : 0.0f; /* subnormal or 0 */
        a16[i] = gpu_f32_to_bf16(ref[i]);
        ck_assert_float_eq(gpu_bf16_to_f32(a16[i]), ref[i]);
    }
    for (int i = 0; i < K * N; i++) {
        ones[i] = 1.0f;
        b16[i] = gpu_f32_to_bf16(1.0f);
    }
    for (int i = 0; i < M * N; i++)
        C[i] = want[i] = beta != 0.0f ? ldexpf(1.0f, -130) : NAN;
    gpu_gemm_ref(false, false, M, N, K, ref, K, ones, N, beta, want, N);
    ck_assert_uint_le(gpu_gemm_ex_scratch_floats(M, N, K, f32a ? GPU_FP32 : GPU_BF16, GPU_BF16,
                                                 GPU_BF16, GPU_GEMM_ROUND_A), 4096);
    size_t gave = gpu_gemm_native_gave_way();
    ck_assert_int_eq(gpu_gemm_ex(false, false, M, N, K, f32a ? (const void *)ref : a16,
                                 f32a ? GPU_FP32 : GPU_BF16, K, b16, GPU_BF16, N, GPU_BF16,
                                 GPU_GEMM_ROUND_A, beta, C, N, sc, sizeof sc / sizeof sc[0]),
                     0);
    for (int i = 0; i < M * N; i++)
        ck_assert_msg(C[i] == want[i] && want[i] != 0.0f, "%s beta %g: C[%d] = %a, want %a",
                      f32a ? "fp32" : "bf16", beta, i, C[i], want[i]);
    /* the native plans gave way to the widened one: that is how the sums stay exact */
    if (gpu_gemm_in_place(GPU_BF16))
        ck_assert_uint_gt(gpu_gemm_native_gave_way(), gave);
}

START_TEST(t_subnormal)
{
    for (int p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, -1, p))
            continue;
        for (int f = 0; f < 2; f++) {
            subnormal_case(f, 0.0f);
            subnormal_case(f, 1.0f);
        }
    }
}
END_TEST

/* Row sums of a bf16 A (M x K) holding 2^-130 at every 5th element, times B = ones, with
 * `round` (GPU_GEMM_A_CONVERTED or 0); 1 when every sum is exact, 0 when not, -1 on error. */
static int converted_sums(const uint16_t *a16, unsigned round)
{
    enum { M = 9, N = 40, K = 33 };
    float ref[M * K], ones[K * N], C[M * N], want[M * N], sc[4096];
    uint16_t b16[K * N];
    for (int i = 0; i < M * K; i++)
        ref[i] = gpu_bf16_to_f32(a16[i]);
    for (int i = 0; i < K * N; i++) {
        ones[i] = 1.0f;
        b16[i] = 0x3F80; /* 1.0 */
    }
    gpu_gemm_ref(false, false, M, N, K, ref, K, ones, N, 0.0f, want, N);
    if (gpu_gemm_ex(false, false, M, N, K, a16, GPU_BF16, K, b16, GPU_BF16, N, GPU_BF16,
                    round | GPU_GEMM_B_CONVERTED, 0.0f, C, N, sc, sizeof sc / sizeof sc[0]) != 0)
        return -1;
    for (int i = 0; i < M * N; i++)
        if (C[i] != want[i] || want[i] == 0.0f)
            return 0;
    return 1;
}

static void subnormal_a16(uint16_t *a16, int n, bool convert)
{
    float v[9 * 33];
    for (int i = 0; i < n; i++)
        v[i] = i % 5 == 0 ? 0x1p-130f : 0.0f;
    if (convert)
        gpu_cvt_f32_bf16(a16, v, (size_t)n);
    else
        for (int i = 0; i < n; i++)
            a16[i] = i % 5 == 0 ? 0x0008 : 0x0000; /* 2^-130 written as bits */
}

/* An operand named GPU_GEMM_A_CONVERTED skips the subnormal scan only while no conversion
 * has met a subnormal: one converted from values with subnormals gives exact sums on every
 * path. On the native plans (native, emulated), in a process where no conversion has met one
 * yet, a vouched
 * operand is indeed read unscanned (hand-made subnormal bits become zero: wrong sums, which
 * is why only the conversions' output may be vouched for), while the same operand without
 * the flag is scanned and exact. */
START_TEST(t_converted_operands)
{
    uint16_t a16[9 * 33];
    for (int p = 2; p < NPATHS; p++) { /* native, emulated */
        if (!use_path(__func__, -1, p) || !gpu_gemm_in_place(GPU_BF16))
            continue;
        pid_t pid = fork(); /* before any conversion here has met a subnormal */
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            subnormal_a16(a16, 9 * 33, false);
            _exit(gpu_bf16_subnormals_made() ? 2 : converted_sums(a16, 0) != 1 ? 3
                  : converted_sums(a16, GPU_GEMM_A_CONVERTED) != 0 ? 4 : 0);
        }
        int status;
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child said %d",
                      WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    }
    for (int p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, -1, p))
            continue;
        subnormal_a16(a16, 9 * 33, true);
        ck_assert(gpu_bf16_subnormals_made());
        ck_assert_int_eq(converted_sums(a16, GPU_GEMM_A_CONVERTED), 1);
    }
}
END_TEST

/* The scratch: nothing for fp32, whole converted operands when small, and for large ones
 * at most the smaller operand plus one block of the larger (2^18 elements), well under a
 * widened copy of both. */
START_TEST(t_scratch_size)
{
    for (int p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, -1, p))
            continue;
        ck_assert_uint_eq(gpu_gemm_scratch_floats(false, false, 3, 4, 5, GPU_FP32, 5, GPU_FP32,
                                                  4), 0);
        /* fp16 x bf16 is computed exactly: both widened, 15 + 20 floats and alignment */
        size_t n = gpu_gemm_scratch_floats(false, true, 3, 4, 5, GPU_FP16, 7, GPU_BF16, 6);
        ck_assert_uint_ge(n, 15 + 20);
        ck_assert_uint_le(n, 15 + 20 + 48);
        /* an MLP's dX = dY W in fp16 from the fp32 master: W (1024 x 1024) by blocks of
         * 256 columns, each product into a dense 256 x 256 block of C; dY holds fp16
         * values, in place unless the library takes bf16 */
        n = gpu_gemm_ex_scratch_floats(256, 1024, 1024, GPU_FP32, GPU_FP32, GPU_FP16,
                                       GPU_GEMM_ROUND_B);
        ck_assert_uint_le(n, ((size_t)1 << 18) + 256 * 256 + 64);
        /* its forward, X (fp16, 256 x 1024) whole and the master by blocks */
        n = gpu_gemm_ex_scratch_floats(256, 1024, 1024, GPU_FP16, GPU_FP32, GPU_FP16,
                                       GPU_GEMM_ROUND_B);
        ck_assert_uint_le(n, 2 * ((size_t)1 << 18) + 256 * 256 + 64);
        ck_assert_uint_lt(n, (256 + 1024) * (size_t)1024 / 2);
        /* a GPT's fc projection: X (2048 x 1024) and W (1024 x 256), both fp16 */
        n = gpu_gemm_scratch_floats(false, true, 2048, 256, 1024, GPU_FP16, 1024, GPU_FP16,
                                    1024);
        ck_assert_uint_le(n, 2 * ((size_t)1 << 18) + 48);
        ck_assert_uint_lt(n, (2048 + 256) * (size_t)1024 / 4);
    }
}
END_TEST

/* Which path each dtype takes is named, and follows the forced path. */
START_TEST(t_path_info)
{
    bool native = gpu_gemm_force("native") == 0;
    ck_assert_int_eq(gpu_gemm_force("auto"), 0);
    ck_assert_int_eq(gpu_gemm_force("nonsense"), GPU_EINVAL);
    const char *bf16 = gpu_gemm_info(GPU_BF16), *fp16 = gpu_gemm_info(GPU_FP16);
    ck_assert_msg((strstr(bf16, "native bf16") != NULL) == native, "bf16: %s", bf16);
    ck_assert_msg(strstr(fp16, "widened") != NULL, "fp16: %s", fp16);
    if (gpu_gemm_force("widen") == 0) {
        ck_assert_msg(strstr(gpu_gemm_info(GPU_FP32), "oneDNN") != NULL, "%s",
                      gpu_gemm_info(GPU_FP32));
        ck_assert_msg(strstr(gpu_gemm_info(GPU_BF16), "widened") != NULL, "%s",
                      gpu_gemm_info(GPU_BF16));
    }
    ck_assert_int_eq(gpu_gemm_force("emulated"), 0); /* on every CPU */
    ck_assert(gpu_gemm_in_place(GPU_BF16));
    ck_assert_msg(strstr(gpu_gemm_info(GPU_BF16), "native bf16 emulated") != NULL, "%s",
                  gpu_gemm_info(GPU_BF16));
    ck_assert_msg(strstr(gpu_gemm_info(GPU_FP16), "widened") != NULL, "%s",
                  gpu_gemm_info(GPU_FP16));
    ck_assert_int_eq(gpu_gemm_force("openblas"), 0);
    ck_assert_msg(strstr(gpu_gemm_info(GPU_FP32), "OpenBLAS") != NULL, "%s",
                  gpu_gemm_info(GPU_FP32));
    ck_assert_msg(strstr(gpu_gemm_info(GPU_BF16), "widened") != NULL, "%s",
                  gpu_gemm_info(GPU_BF16));
    fprintf(stderr, "check_gemm: auto: fp32 %s | fp16 %s | bf16 %s\n",
            (gpu_gemm_force("auto"), gpu_gemm_info(GPU_FP32)), fp16, bf16);
}
END_TEST

/* Bad arguments are refused with GPU_EINVAL and leave C alone. */
START_TEST(t_invalid)
{
    float a[12] = {0}, b[12] = {0}, c[12], s[64];
    uint16_t h[12] = {0};
    for (int i = 0; i < 12; i++)
        c[i] = 42.0f;
    ck_assert_int_eq(gpu_gemm(false, false, -1, 2, 2, a, GPU_FP32, 2, b, GPU_FP32, 2, 0.0f, c,
                              2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, -3, a, GPU_FP32, 2, b, GPU_FP32, 2, 0.0f, c,
                              2, NULL, 0), GPU_EINVAL);
    /* lda < K, lda < M when transposed, ldb < N, ldb < K when transposed, ldc < N. */
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 3, a, GPU_FP32, 2, b, GPU_FP32, 2, 0.0f, c,
                              2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(true, false, 3, 2, 2, a, GPU_FP32, 2, b, GPU_FP32, 2, 0.0f, c,
                              2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 3, 2, a, GPU_FP32, 2, b, GPU_FP32, 2, 0.0f, c,
                              3, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, true, 2, 2, 3, a, GPU_FP32, 3, b, GPU_FP32, 2, 0.0f, c,
                              2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 3, 2, a, GPU_FP32, 2, b, GPU_FP32, 3, 0.0f, c,
                              2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, false, 1, 1, 1, a, GPU_FP32, 0, b, GPU_FP32, 1, 0.0f, c,
                              1, NULL, 0), GPU_EINVAL);
    /* Unknown dtype, missing C, missing operand, missing scratch. */
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 2, a, (gpu_dtype)7, 2, b, GPU_FP32, 2, 0.0f,
                              c, 2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 2, a, GPU_FP32, 2, b, GPU_FP32, 2, 0.0f,
                              NULL, 2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 2, NULL, GPU_FP32, 2, b, GPU_FP32, 2, 0.0f,
                              c, 2, NULL, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 2, h, GPU_FP16, 2, b, GPU_FP32, 2, 0.0f, c,
                              2, NULL, 0), GPU_ESCRATCH);
    /* Scratch shorter than the plan: refused before anything is written. */
    size_t need = gpu_gemm_scratch_floats(false, false, 2, 2, 2, GPU_FP16, 2, GPU_FP32, 2);
    ck_assert_uint_gt(need, 0);
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 2, h, GPU_FP16, 2, b, GPU_FP32, 2, 0.0f, c,
                              2, s, need - 1), GPU_ESCRATCH);
    for (int i = 0; i < 12; i++)
        ck_assert_float_eq(c[i], 42.0f);
    /* The same call with scratch works. */
    ck_assert_int_eq(gpu_gemm(false, false, 2, 2, 2, h, GPU_FP16, 2, b, GPU_FP32, 2, 0.0f, c,
                              2, s, 64), 0);
    for (int i = 0; i < 4; i++)
        ck_assert_float_eq(c[i], 0.0f);
}
END_TEST

/* ---- overflow reaches the output -------------------------------------------------------- */

/* An inf (or NaN) in a 16-bit operand makes every output it feeds non-finite and leaves
 * the others finite: the loss scaler must see the overflow. */
static void inf_case(gpu_dtype dt, bool in_b, bool ta, bool tb, float bad, bool ex)
{
    const int M = 17, N = 31, K = 65, r = 5, k0 = 40;
    gpu_rng rng;
    gpu_rng_seed(&rng, 11);
    operand a, b;
    operand_make(&a, ta ? K : M, ta ? M : K, (ta ? M : K) + 1, in_b ? GPU_FP32 : dt, &rng);
    operand_make(&b, tb ? N : K, tb ? K : N, tb ? K : N, in_b ? dt : GPU_FP32, &rng);
    if (in_b) /* column r of op(B) */
        operand_set(&b, tb ? r : k0, tb ? k0 : r, bad);
    else      /* row r of op(A) */
        operand_set(&a, ta ? k0 : r, ta ? r : k0, bad);
    /* One exact zero beside the inf: inf * 0 = NaN must not be lost either. */
    if (in_b)
        operand_set(&a, ta ? k0 : 3, ta ? 3 : k0, 0.0f);
    else
        operand_set(&b, tb ? 3 : k0, tb ? k0 : 3, 0.0f);
    float C[17 * 31], scratch[17 * 66 + 65 * 31 + 64];
    size_t ns = sizeof scratch / sizeof scratch[0];
    ck_assert_uint_le(gpu_gemm_scratch_floats(ta, tb, M, N, K, a.dt, a.ld, b.dt, b.ld), ns);
    unsigned round = GPU_GEMM_ROUND_A | GPU_GEMM_ROUND_B;
    ck_assert_uint_le(gpu_gemm_ex_scratch_floats(M, N, K, a.dt, b.dt, dt, round), ns);
    if (ex) /* the fp32 operand rounded to dt */
        ck_assert_int_eq(gpu_gemm_ex(ta, tb, M, N, K, a.store, a.dt, a.ld, b.store, b.dt, b.ld,
                                     dt, round, 0.0f, C, N, scratch, ns), 0);
    else
        ck_assert_int_eq(gpu_gemm(ta, tb, M, N, K, a.store, a.dt, a.ld, b.store, b.dt, b.ld,
                                  0.0f, C, N, scratch, ns), 0);
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            bool hit = in_b ? j == r : i == r;
            ck_assert_msg(hit != (bool)isfinite(C[i * N + j]),
                          "%s %s in %s (ta=%d tb=%d): C[%d,%d] = %g", dtname(dt),
                          isnan(bad) ? "NaN" : "inf", in_b ? "B" : "A", ta, tb, i, j,
                          C[i * N + j]);
        }
    }
    if (!isnan(bad))
        ck_assert(isnan(C[in_b ? 3 * N + r : r * N + 3]));
    operand_free(&b);
    operand_free(&a);
}

START_TEST(t_inf_propagates)
{
    bool ta = _i & 1, tb = _i & 2;
    for (int p = 0; p < NPATHS; p++) {
        if (!use_path(__func__, _i, p))
            continue;
        for (int ex = 0; ex < 2; ex++) {
            inf_case(GPU_FP16, false, ta, tb, INFINITY, ex);
            inf_case(GPU_FP16, true, ta, tb, -INFINITY, ex);
            inf_case(GPU_BF16, false, ta, tb, -INFINITY, ex);
            inf_case(GPU_BF16, true, ta, tb, INFINITY, ex);
            inf_case(GPU_BF16, true, ta, tb, NAN, ex);
            inf_case(GPU_FP16, false, ta, tb, NAN, ex);
            /* 65520 is past fp16's range: storing it gives inf, as a too-large scale would */
            inf_case(GPU_FP16, true, ta, tb, 65520.0f, ex);
        }
    }
}
END_TEST

/* ---- library and kernel choice ---------------------------------------------------------- */

typedef struct {
    int n, rc;
    uint16_t *a;     /* n x n fp16 */
    float *b, *c;    /* n x n */
    float scratch[48 * 48 + 64];
} gemm_job;

static void *gemm_thread(void *arg)
{
    gemm_job *j = arg;
    j->rc = gpu_gemm(false, false, j->n, j->n, j->n, j->a, GPU_FP16, j->n, j->b, GPU_FP32,
                     j->n, 0.0f, j->c, j->n, j->scratch,
                     sizeof j->scratch / sizeof j->scratch[0]);
    return NULL;
}

/* Four threads make their first gpu_gemm call at once (in fork mode the library is not
 * loaded yet, so they race through the lazy load): all succeed with correct results. */
START_TEST(t_concurrent_first_use)
{
    enum { T = 4, n = 48 };
    static gemm_job jobs[T];
    pthread_t tid[T];
    gpu_rng rng;
    gpu_rng_seed(&rng, 99);
    for (int t = 0; t < T; t++) {
        gemm_job *j = &jobs[t];
        j->n = n;
        j->a = malloc(n * n * sizeof *j->a);
        j->b = malloc(n * n * sizeof *j->b);
        j->c = malloc(n * n * sizeof *j->c);
        ck_assert(j->a != NULL && j->b != NULL && j->c != NULL);
        for (int i = 0; i < n * n; i++) {
            j->a[i] = gpu_f32_to_f16(2.0f * gpu_rng_uniform(&rng) - 1.0f);
            j->b[i] = 2.0f * gpu_rng_uniform(&rng) - 1.0f;
        }
    }
    for (int t = 0; t < T; t++)
        ck_assert_int_eq(pthread_create(&tid[t], NULL, gemm_thread, &jobs[t]), 0);
    for (int t = 0; t < T; t++)
        ck_assert_int_eq(pthread_join(tid[t], NULL), 0);
    float a32[n * n], ref[n * n];
    for (int t = 0; t < T; t++) {
        gemm_job *j = &jobs[t];
        ck_assert_int_eq(j->rc, 0);
        for (int i = 0; i < n * n; i++)
            a32[i] = gpu_f16_to_f32(j->a[i]);
        gpu_gemm_ref(false, false, n, n, n, a32, n, j->b, n, 0.0f, ref, n);
        for (int i = 0; i < n * n; i++) /* |a|,|b| < 1: sum|a||b| < n */
            ck_assert_msg(fabs(j->c[i] - ref[i]) <= 1.01 * (n + 2) * ldexp(1.0, -24) * n,
                          "thread %d C[%d] = %g, ref %g", t, i, j->c[i], ref[i]);
        free(j->a);
        free(j->b);
        free(j->c);
    }
}
END_TEST

/* Run this binary again as "--blas-info [preload]" with the variable name set to value (NULL:
 * removed) and return its output in out. */
static void child_run(const char *name, const char *value, bool preload, char *out,
                      size_t outlen)
{
    int fd[2];
    ck_assert_int_eq(pipe(fd), 0);
    size_t n = 0;
    while (environ[n] != NULL)
        n++;
    char **envp = calloc(n + 2, sizeof *envp);
    char var[256];
    size_t nl = strlen(name);
    ck_assert_ptr_nonnull(envp);
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], name, nl) != 0 || environ[i][nl] != '=')
            envp[m++] = environ[i];
    if (value != NULL) {
        snprintf(var, sizeof var, "%s=%s", name, value);
        envp[m++] = var;
    }
    char *argv[] = {"check_gemm", "--blas-info", preload ? "preload" : NULL, NULL};
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fd[1], STDOUT_FILENO);
        close(fd[0]);
        close(fd[1]);
        execve("/proc/self/exe", argv, envp);
        _exit(127);
    }
    close(fd[1]);
    size_t got = 0;
    ssize_t r;
    while (got + 1 < outlen && (r = read(fd[0], out + got, outlen - 1 - got)) > 0)
        got += (size_t)r;
    out[got] = '\0';
    close(fd[0]);
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child failed: %s", out);
    free(envp);
}

/* child_run() with OPENBLAS_CORETYPE: the line gpu_blas_info() prints. */
static void child_info(const char *coretype, bool preload, char *out, size_t outlen)
{
    child_run("OPENBLAS_CORETYPE", coretype, preload, out, outlen);
}

/* The kernel-set name in an info string: the word before " kernels". */
static void kernel_name(const char *info, char *out, size_t outlen)
{
    const char *lp = strchr(info, '('), *end = strstr(info, " kernels");
    ck_assert_msg(lp != NULL && end != NULL && end > lp, "no kernel set in \"%s\"", info);
    size_t n = (size_t)(end - lp - 1);
    ck_assert_uint_lt(n, outlen);
    memcpy(out, lp + 1, n);
    out[n] = '\0';
}

/* What the automatic choice must be on this CPU (NULL: OpenBLAS's own detection). */
static const char *expected_core(void)
{
    const gpu_cpu_features *f = gpu_cpu();
    bool avx512 = f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq;
    if (avx512 && f->avx512bf16)
        return "Cooperlake";
    if (avx512)
        return "SkylakeX";
    if (f->avx2 && f->fma)
        return "Haswell";
    return NULL;
}

START_TEST(t_info)
{
    char line[512], core[64];
    /* with oneDNN on fp32, OpenBLAS runs on one thread whatever the job's count */
    if (gpu_gemm_force("widen") == 0) {
        ck_assert_int_eq(gpu_blas_init(2), 0);
        ck_assert_msg(strstr(gpu_blas_info(), ", 1 thread)") != NULL, "\"%s\"",
                      gpu_blas_info());
    }
    /* on OpenBLAS alone, the job's count */
    ck_assert_int_eq(gpu_gemm_force("openblas"), 0);
    ck_assert_int_eq(gpu_blas_init(2), 0);
    const char *info = gpu_blas_info();
    ck_assert_ptr_nonnull(info);
    ck_assert_msg(strncmp(info, "OpenBLAS 0.", 11) == 0, "info \"%s\"", info);
    ck_assert_msg(strstr(info, ", 2 threads") != NULL, "info \"%s\"", info);
    kernel_name(info, core, sizeof core);
    ck_assert_int_eq(gpu_blas_init(1), 0);
    ck_assert_msg(strstr(gpu_blas_info(), ", 1 thread") != NULL, "\"%s\"", gpu_blas_info());
    /* The string returned earlier is still valid and unchanged. */
    ck_assert_msg(strstr(info, ", 2 threads") != NULL, "info \"%s\"", info);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    ck_assert_int_eq(gpu_blas_init(0), 0);
    snprintf(line, sizeof line, ", %ld thread%s", cpus, cpus == 1 ? "" : "s");
    ck_assert_msg(strstr(gpu_blas_info(), line) != NULL, "\"%s\"", gpu_blas_info());

    /* The automatic choice in a fresh process with no OPENBLAS_CORETYPE. */
    child_info(NULL, false, line, sizeof line);
    kernel_name(line, core, sizeof core);
    const char *want = expected_core();
    if (want != NULL)
        ck_assert_msg(strcmp(core, want) == 0, "chose \"%s\", expected %s", line, want);
    if (gpu_cpu()->avx512f)
        ck_assert_msg(strcmp(core, "Prescott") != 0, "AVX-512 CPU got \"%s\"", line);
    ck_assert_msg(strstr(line, "OPENBLAS_CORETYPE") == NULL && strchr(line, ';') == NULL,
                  "\"%s\"", line);
}
END_TEST

/* A user's OPENBLAS_CORETYPE wins and is reported; an already loaded library is noted. */
START_TEST(t_info_overrides)
{
    char line[512], core[64];
    if (gpu_cpu()->avx2 && gpu_cpu()->fma) {
        child_info("Haswell", false, line, sizeof line);
        kernel_name(line, core, sizeof core);
        ck_assert_str_eq(core, "Haswell");
        ck_assert_msg(strstr(line, "from OPENBLAS_CORETYPE") != NULL, "\"%s\"", line);
    }
    /* An empty OPENBLAS_CORETYPE counts as unset. */
    child_info("", false, line, sizeof line);
    kernel_name(line, core, sizeof core);
    if (expected_core() != NULL)
        ck_assert_msg(strcmp(core, expected_core()) == 0, "\"%s\"", line);
    ck_assert_msg(strstr(line, "OPENBLAS_CORETYPE") == NULL, "\"%s\"", line);
    child_info(NULL, true, line, sizeof line);
    ck_assert_msg(strstr(line, "already loaded") != NULL, "\"%s\"", line);
    kernel_name(line, core, sizeof core); /* still names what OpenBLAS picked */
}
END_TEST

/* A library that will not load: gpu_blas_init says GPU_EBLAS, and why reaches the log hook
 * the host installed (an error naming the path), not stderr. */
START_TEST(t_load_failure_logged)
{
    char out[1024];
    child_run("AMPD_OPENBLAS", "/nonexistent/libopenblas.so.0", false, out, sizeof out);
    ck_assert_msg(strstr(out, "log 3 load: cannot load OpenBLAS from "
                              "/nonexistent/libopenblas.so.0") != NULL, "\"%s\"", out);
    ck_assert_msg(strstr(out, "gpu_blas_init -6\n") != NULL, "\"%s\"", out);
}
END_TEST

/* The child's log hook: each message on stdout as "log <level> <func>: <message>". */
static void print_log(void *arg, int level, const char *func, const char *msg)
{
    (void)arg;
    printf("log %d %s: %s\n", level, func, msg);
}

/* The child side of child_info(): print gpu_blas_info(), after loading OpenBLAS behind the
 * engine's back when asked; when the library does not load, gpu_blas_init's code (the
 * log hook prints why). */
static int blas_info_main(bool preload)
{
    if (preload && dlopen(AMPD_OPENBLAS_PATH, RTLD_NOW) == NULL) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return EXIT_FAILURE;
    }
    gpu_set_log(print_log, NULL);
    int rc = gpu_blas_init(2);
    if (rc != 0) {
        printf("gpu_blas_init %d\n", rc);
        return EXIT_SUCCESS;
    }
    printf("%s\n", gpu_blas_info());
    return EXIT_SUCCESS;
}

static Suite *gemm_suite(void)
{
    Suite *s = suite_create("gemm");
    TCase *tc = tcase_create("reference");
    tcase_add_test(tc, t_ref_known);
    suite_add_tcase(s, tc);

    tc = tcase_create("fp32");
    tcase_set_timeout(tc, 20);
    tcase_add_loop_test(tc, t_fp32_shapes, 0, 4);
    tcase_add_test(tc, t_fp32_beta_threads);
    tcase_add_test(tc, t_empty);
    tcase_add_test(tc, t_invalid);
    suite_add_tcase(s, tc);

    tc = tcase_create("lowp");
    tcase_set_timeout(tc, 20);
    tcase_add_loop_test(tc, t_lowp, 0, (int)(sizeof lowp_pairs / sizeof lowp_pairs[0]));
    tcase_add_test(tc, t_blocks);
    tcase_add_test(tc, t_subnormal);
    tcase_add_test(tc, t_converted_operands);
    tcase_add_test(tc, t_scratch_size);
    tcase_add_test(tc, t_path_info);
    tcase_add_loop_test(tc, t_inf_propagates, 0, 4);
    suite_add_tcase(s, tc);

    tc = tcase_create("library");
    tcase_set_timeout(tc, 20);
    tcase_add_test(tc, t_concurrent_first_use);
    tcase_add_test(tc, t_info);
    tcase_add_test(tc, t_info_overrides);
    tcase_add_test(tc, t_load_failure_logged);
    suite_add_tcase(s, tc);
    return s;
}

/* One line naming the paths the suite runs here and what each multiplies with (the
 * sanitizer pass's log shows that oneDNN's ran under it), and those this machine lacks. */
static void print_paths(void)
{
    char on[1024] = "", off[128] = "";
    for (int p = 0; p < NPATHS; p++) {
        char *dst = gpu_gemm_force(paths[p]) == 0 ? on : off;
        size_t len = strlen(dst), cap = dst == on ? sizeof on : sizeof off;
        if (dst == on)
            snprintf(dst + len, cap - len, "%s%s (fp32: %s; bf16: %s)", len ? "; " : "",
                     paths[p], gpu_gemm_info(GPU_FP32), gpu_gemm_info(GPU_BF16));
        else
            snprintf(dst + len, cap - len, "%s%s", len ? ", " : "", paths[p]);
    }
    gpu_gemm_force("auto");
    printf("check_gemm: GEMM paths run: %s; not on this machine: %s; oneDNN %s\n", on,
           off[0] ? off : "none", gpu_dnnl_info() ? gpu_dnnl_info() : "not loaded");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "--blas-info") == 0)
        return blas_info_main(argc >= 3 && strcmp(argv[2], "preload") == 0);
    SRunner *sr = srunner_create(gemm_suite());
    srunner_run_all(sr, CK_ENV);
    print_paths(); /* after the tests: t_concurrent_first_use wants the library unloaded */
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
