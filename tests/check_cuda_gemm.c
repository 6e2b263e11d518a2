/*
 * check_cuda_gemm.c - Check suite "cuda_gemm": the cuBLASLt GEMMs of gpu/cuda/cuda_blas.cu
 * (through tests/cudahost/blas_host.cu) against gpu_gemm_ref (double accumulation) and the
 * CPU's GELU.
 *
 * With a device (and libcublasLt): every product of the shapes 1x1x1, 7x13x5, 33x65x129,
 * 128x256x768 and 17x40x3000 (M x N x K) in the four transpose combinations, with tight and
 * padded leading dimensions and beta 0 (C full of NaN, which must not leak) and 1; operands
 * fp32, fp16 and bf16 (random values of the dtype) into an fp32 C and into a C of the operand
 * dtype; mixed operand dtypes through gpu_cuda_gemm_host; strided batches (3 and 12: generic
 * strides, the attention's Q K^T and P V per head with an interleaved output, an odd head
 * size whose pointers are only 2-byte aligned, a broadcast B); the bias and bias + GELU
 * epilogues, with and without the pre-GELU aux output; M, N or K = 0; bad arguments; fp16
 * overflow to inf; the device-pointer API on a stream with misaligned pointers, its padding
 * left alone and bitwise reproducible results.
 *
 * Tolerances, with S = sum_k |a_ik b_kj| + |beta c_ij| + |bias_j| (from gpu_gemm_ref on |A|,
 * |B|) and the accumulation bound E = 1e-5 S + 1e-30:
 *   - fp32 C: |c - ref| <= E. The products of fp16/bf16 operands are exact in fp32 and an
 *     fp32 FMA chain (or tensor-core fp32 accumulation, which truncates) errs by about
 *     sqrt(K) 2^-24 S with random signs (at most K 2^-24 S, 1.8e-4 S for K = 3000, only if
 *     every rounding went the same way), so 1e-5 S holds with a wide margin, while TF32
 *     (operands rounded to 11 bits: an rms error near 4e-4 S / sqrt(K) with these values)
 *     fails it on the larger shapes, and a wrong element fails it everywhere.
 *   - fp16/bf16 C: cuBLASLt rounds its fp32 result r32 (|r32 - ref| <= E) once, to nearest
 *     even, so c must lie between rd(ref - E) and rd(ref + E) (rounding is monotonic); also
 *     accepted: rd(ref) or one of its two neighbours (the brief's rule; the interval
 *     contains them whenever E reaches half an ulp).
 *   - GELU: |c - rd(gelu_cpu(ref))| <= 1.13 E + 2 ulp(c's dtype) + 2^-11 |x|, where x is the
 *     pre-activation: 1.13 bounds |gelu'| (tanh form), 2 ulp covers the two roundings, and
 *     2^-11 |x| covers an epilogue that uses the hardware tanh.approx.f32 (relative error
 *     2^-11, scaled by x/2), as CUTLASS-style epilogues do. A wrong bias axis, a missing GELU
 *     or bias, or a misread bias dtype fail it (the erf form, within 4.7e-4 of the tanh form,
 *     would not). The largest deviation in ulps is printed, to document the epilogue's real
 *     accuracy. The aux output (pre-GELU values) must pass the rule for C above.
 * Without a device (no driver, no device, no cuBLASLt) main prints
 * "check_cuda_gemm: SKIP: <why>" once, the device tests return at once (the suite exits 77,
 * SKIP), and one test checks that the entry points report GPU_ENODEV and leave their buffers
 * alone.
 * fp8 (case "fp8"): the cast kernel's codes, transposed copy and amax equal the CPU's
 * (gpu_fp8_cast) from fp32, bf16 and fp16, and its diagnostics' counts equal the CPU's stats; the
 * fp8 GEMM (TN, three format pairs, fp32 and bf16 C, K up to 3008) against the CPU's exact model
 * gpu_gemm_fp8: bit for bit on the emulator, within fp32 accumulation's bound (K 2^-23 sum|ab|) on
 * a GPU, with the largest difference printed for random operands and for adversarial ones (448 x
 * 448 then 4095 tiny products a 13-bit accumulator drops): the calibration of the accumulator
 * model; delayed and current scaling on the device equal to the CPU's bits over 40 steps; E5M2 x
 * E5M2, K not a multiple of 16 and an fp16 C refused; on a device below sm_89 (the emulator with
 * AMPD_CUDAEMU_SM=80) the product refused naming the device.
 *
 * Threads: the suite runs without fork (CK_NOFORK) so the CUDA state main's probe creates is
 * the one the tests use; every test checks for the device itself. Failures inside a test
 * are counted and the first ones printed, so one run shows every broken case.
 */
#include <check.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_blas.h"
#include "gpu/gpt.h"
#include "gpu/gpu_int.h"
#include "tests/cudahost/cudahost.h"
#include "tests/cudatest.h"

#define TINY 1e-30
#define MAX_REPORTS 12

/* ---- failure accounting -------------------------------------------------------------------- */

static int failures, reported;

static void errs_begin(void)
{
    failures = 0;
    reported = 0;
}

static void err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void err(const char *fmt, ...)
{
    failures++;
    if (reported++ >= MAX_REPORTS)
        return;
    va_list ap;
    va_start(ap, fmt);
    fputs("check_cuda_gemm: FAIL: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void errs_end(void)
{
    ck_assert_msg(failures == 0, "%d failures (the first ones are on stderr)", failures);
}

/* ---- values and matrices ------------------------------------------------------------------- */

static size_t esize(gpu_dtype dt)
{
    return dt == GPU_FP32 ? 4 : 2;
}

/* Elements spanned by batch rows x cols matrices at ld, stride apart. */
static int64_t span(int rows, int cols, int ld, int batch, int64_t stride)
{
    if (rows == 0 || cols == 0 || batch == 0)
        return 0;
    return (int64_t)(batch - 1) * stride + (int64_t)(rows - 1) * ld + cols;
}

/* Uniform in [-1, 1), rounded to dt. */
static float value(gpu_rng *r, gpu_dtype dt)
{
    return gpu_round(2.0f * gpu_rng_uniform(r) - 1.0f, dt);
}

/* A span of NaN with random values of dt at the positions of the batch matrices (when
 * fill; NaN everywhere otherwise). */
static float *make_matrix(gpu_rng *r, int rows, int cols, int ld, int batch, int64_t stride,
                          gpu_dtype dt, bool fill)
{
    int64_t n = span(rows, cols, ld, batch, stride);
    float *f = xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        f[i] = NAN;
    for (int b = 0; fill && b < batch; b++)
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < cols; j++)
                f[(int64_t)b * stride + (int64_t)i * ld + j] = value(r, dt);
    return f;
}

/* f (n values of dt) in dt's storage: float or uint16_t bit patterns. */
static void *storage(const float *f, int64_t n, gpu_dtype dt)
{
    void *p = xmalloc((size_t)n * esize(dt));
    gpu_cvt_from_f32(p, dt, f, (size_t)n);
    return p;
}

static float *copy_floats(const float *f, int64_t n)
{
    float *c = xmalloc((size_t)n * sizeof(float));
    memcpy(c, f, (size_t)n * sizeof(float));
    return c;
}

static float *abs_floats(const float *f, int64_t n)
{
    float *c = xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        c[i] = fabsf(f[i]);
    return c;
}

static uint16_t to16(float x, gpu_dtype dt)
{
    return dt == GPU_FP16 ? gpu_f32_to_f16(x) : gpu_f32_to_bf16(x);
}

/* Position of a 16-bit pattern on the number line (monotonic; +0 and -0 both 0). */
static int32_t ord16(uint16_t h)
{
    return (h & 0x8000u) ? -(int32_t)(h & 0x7FFFu) : (int32_t)h;
}

/* Spacing of dt's values at |v|. */
static double ulp_of(double v, gpu_dtype dt)
{
    int p = dt == GPU_FP32 ? 23 : dt == GPU_FP16 ? 10 : 7;
    double min = ldexp(1.0, dt == GPU_FP32 ? -149 : dt == GPU_FP16 ? -24 : -133);
    int e;
    if (v == 0.0 || !isfinite(v))
        return min;
    frexp(fabs(v), &e);
    double u = ldexp(1.0, e - 1 - p);
    return u < min ? min : u;
}

/* c (a value of dt) against the exact ref with accumulation bound e (see the top). */
static bool close_to(float c, double ref, double e, gpu_dtype dt)
{
    if (isnan(c) || !isfinite(ref))
        return false;
    if (dt == GPU_FP32)
        return fabs((double)c - ref) <= e;
    int32_t oc = ord16(to16(c, dt)), orf = ord16(to16((float)ref, dt));
    if (oc - orf >= -1 && oc - orf <= 1)
        return true;
    int32_t lo = ord16(to16((float)(ref - e), dt)), hi = ord16(to16((float)(ref + e), dt));
    return lo <= oc && oc <= hi;
}

static float gelu_cpu(float x)
{
    float y;
    gpu_gpt_gelu_fwd(&y, &x, 1, GPU_FP32);
    return y;
}

/* ---- one product through the host wrappers -------------------------------------------------- */

typedef struct {
    bool ta, tb;
    int M, N, K;
    gpu_dtype adt, bdt, cdt;
    int lda, ldb, ldc;               /* 0: tight */
    float beta;
    int batch;                       /* 0: 1 */
    int64_t stride_a, stride_b, stride_c;
    gpu_cuda_epilogue epi;
    bool aux;
    bool via_gemm;                   /* gpu_cuda_gemm_host (fp32 C, batch 1, no epilogue) */
} tcase;

static void case_name(const tcase *t, char *buf, size_t len)
{
    snprintf(buf, len, "%s%s M %d N %d K %d lda %d ldb %d ldc %d %s x %s -> %s beta %g batch %d"
             " (strides %lld %lld %lld) epilogue %d%s%s", t->ta ? "ta " : "", t->tb ? "tb " : "",
             t->M, t->N, t->K, t->lda, t->ldb, t->ldc, gpu_dtype_name(t->adt),
             gpu_dtype_name(t->bdt), gpu_dtype_name(t->cdt), (double)t->beta, t->batch,
             (long long)t->stride_a, (long long)t->stride_b, (long long)t->stride_c, (int)t->epi,
             t->aux ? " aux" : "", t->via_gemm ? " (gemm_host)" : "");
}

/* Largest GELU deviation seen beyond the accumulation term, in ulps of C's dtype. */
static double gelu_dev_ulps[3];

/* Run t (its zero fields completed) and compare every output with the reference. */
static void run_case(tcase t, uint64_t seed)
{
    char name[400];
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    if (t.batch == 0)
        t.batch = 1;
    int ar = t.ta ? t.K : t.M, ac = t.ta ? t.M : t.K;
    int br = t.tb ? t.N : t.K, bc = t.tb ? t.K : t.N;
    if (t.lda == 0)
        t.lda = ac > 0 ? ac : 1;
    if (t.ldb == 0)
        t.ldb = bc > 0 ? bc : 1;
    if (t.ldc == 0)
        t.ldc = t.N > 0 ? t.N : 1;
    case_name(&t, name, sizeof(name));

    int64_t na = span(ar, ac, t.lda, t.batch, t.stride_a);
    int64_t nb = span(br, bc, t.ldb, t.batch, t.stride_b);
    int64_t nc = span(t.M, t.N, t.ldc, t.batch, t.stride_c);
    float *af = make_matrix(&r, ar, ac, t.lda, t.batch, t.stride_a, t.adt, true);
    float *bf = make_matrix(&r, br, bc, t.ldb, t.batch, t.stride_b, t.bdt, true);
    float *cold = make_matrix(&r, t.M, t.N, t.ldc, t.batch, t.stride_c, t.cdt, t.beta != 0.0f);
    float *cgpu = copy_floats(cold, nc);
    float *bias = xmalloc((size_t)(t.N > 0 ? t.N : 1) * sizeof(float));
    for (int j = 0; j < t.N; j++)
        bias[j] = t.epi != GPU_CUDA_EPI_NONE ? value(&r, t.cdt) : 0.0f;
    int aux_ld = (t.N + 7) / 8 * 8 + 8;
    int64_t nx = span(t.M, t.N, aux_ld, 1, 0);
    float *aux = xmalloc((size_t)(nx > 0 ? nx : 1) * sizeof(float));
    for (int64_t i = 0; i < nx; i++)
        aux[i] = 7777.0f;
    void *as = storage(af, na, t.adt), *bs = storage(bf, nb, t.bdt);

    int rc;
    if (t.via_gemm) {
        rc = gpu_cuda_gemm_host(t.ta, t.tb, t.M, t.N, t.K, as, t.adt, t.lda, bs, t.bdt, t.ldb,
                                t.beta, cgpu, t.ldc);
    } else {
        gpu_cuda_mm m = {
            .ta = t.ta, .tb = t.tb, .M = t.M, .N = t.N, .K = t.K,
            .A = as, .adt = t.adt, .lda = t.lda, .B = bs, .bdt = t.bdt, .ldb = t.ldb,
            .C = cgpu, .cdt = t.cdt, .ldc = t.ldc, .beta = t.beta, .batch = t.batch,
            .stride_a = t.stride_a, .stride_b = t.stride_b, .stride_c = t.stride_c,
            .epilogue = t.epi, .bias = t.epi != GPU_CUDA_EPI_NONE ? bias : NULL,
            .aux = t.aux ? aux : NULL, .aux_ld = t.aux ? aux_ld : 0,
        };
        rc = gpu_cuda_mm_host(&m);
    }
    if (rc != 0) {
        err("%s: returned %d (%s)", name, rc, gpu_strerror(rc));
        goto done;
    }

    /* the reference, batch by batch; |A| |B| gives the accumulation bound */
    float *cref = copy_floats(cold, nc), *cabs = xmalloc((size_t)(nc > 0 ? nc : 1) * 4);
    float *aabs = abs_floats(af, na), *babs = abs_floats(bf, nb);
    for (int b = 0; b < t.batch; b++) {
        gpu_gemm_ref(t.ta, t.tb, t.M, t.N, t.K, af + b * t.stride_a, t.lda,
                     bf + b * t.stride_b, t.ldb, t.beta, cref + b * t.stride_c, t.ldc);
        gpu_gemm_ref(t.ta, t.tb, t.M, t.N, t.K, aabs + b * t.stride_a, t.lda,
                     babs + b * t.stride_b, t.ldb, 0.0f, cabs + b * t.stride_c, t.ldc);
    }
    for (int b = 0; b < t.batch; b++) {
        for (int i = 0; i < t.M; i++) {
            for (int j = 0; j < t.N; j++) {
                int64_t o = b * t.stride_c + (int64_t)i * t.ldc + j;
                double pre = (double)cref[o] + (double)bias[j];
                double s = (double)cabs[o] + fabs((double)bias[j]);
                if (t.beta != 0.0f)
                    s += fabs((double)t.beta * (double)cold[o]);
                double e = 1e-5 * s + TINY;
                float c = cgpu[o];
                if (t.epi != GPU_CUDA_EPI_BIAS_GELU) {
                    if (!close_to(c, pre, e, t.cdt))
                        err("%s: batch %d C[%d][%d] = %.9g, reference %.9g (bound %.3g)",
                             name, b, i, j, (double)c, pre, e);
                    continue;
                }
                float x = (float)pre, g = gpu_round(gelu_cpu(x), t.cdt);
                double u = ulp_of(g, t.cdt), dev = fabs((double)c - (double)g);
                double tol = 1.13 * e + 2.0 * u + ldexp(fabs((double)x), -11);
                if (isnan(c) || dev > tol)
                    err("%s: gelu C[%d][%d] = %.9g, cpu %.9g (x %.9g, tolerance %.3g)",
                         name, i, j, (double)c, (double)g, (double)x, tol);
                else if ((dev - 1.13 * e) / u > gelu_dev_ulps[t.cdt])
                    gelu_dev_ulps[t.cdt] = (dev - 1.13 * e) / u;
                if (t.aux && !close_to(aux[(int64_t)i * aux_ld + j], pre, e, t.cdt))
                    err("%s: aux[%d][%d] = %.9g, reference %.9g (bound %.3g)", name, i, j,
                         (double)aux[(int64_t)i * aux_ld + j], pre, e);
            }
        }
    }
    /* nothing but the M x N elements of each batch may change: restore them, compare bits */
    for (int b = 0; b < t.batch; b++)
        for (int i = 0; i < t.M; i++)
            for (int j = 0; j < t.N; j++) {
                int64_t o = b * t.stride_c + (int64_t)i * t.ldc + j;
                cgpu[o] = cold[o];
            }
    for (int64_t i = 0; i < nc; i++)
        if (f2u(cgpu[i]) != f2u(cold[i])) {
            err("%s: C's padding element %lld changed", name, (long long)i);
            break;
        }
    for (int i = 0; t.aux && i < t.M; i++)
        for (int j = t.N; j < aux_ld && (int64_t)i * aux_ld + j < nx; j++)
            if (aux[(int64_t)i * aux_ld + j] != 7777.0f) {
                err("%s: aux padding [%d][%d] changed", name, i, j);
                i = t.M;
                break;
            }
    free(cref);
    free(cabs);
    free(aabs);
    free(babs);
done:
    free(af);
    free(bf);
    free(cold);
    free(cgpu);
    free(bias);
    free(aux);
    free(as);
    free(bs);
}

/* ---- without a device ---------------------------------------------------------------------- */

START_TEST(t_no_device)
{
    if (have_blas())
        return;
    gpu_cuda_blas *b = (gpu_cuda_blas *)&b;
    char why[256] = "";
    ck_assert_int_eq(gpu_cuda_blas_open(&b, why, sizeof(why)), GPU_ENODEV);
    ck_assert_ptr_null(b);
    ck_assert_uint_gt(strlen(why), 0);
    ck_assert_int_eq(gpu_cuda_blas_open(&b, NULL, 0), GPU_ENODEV);
    gpu_cuda_blas_free(NULL);

    float a[4] = {1, 2, 3, 4}, bb[4] = {5, 6, 7, 8}, c[4] = {9, 9, 9, 9};
    ck_assert_int_eq(gpu_cuda_gemm_host(false, false, 2, 2, 2, a, GPU_FP32, 2, bb, GPU_FP32, 2,
                                        0.0f, c, 2), GPU_ENODEV);
    ck_assert(c[0] == 9.0f && c[3] == 9.0f);
    gpu_cuda_mm m = {.M = 2, .N = 2, .K = 2, .A = a, .lda = 2, .B = bb, .ldb = 2, .C = c,
                     .ldc = 2, .batch = 1};
    ck_assert_int_eq(gpu_cuda_mm_host(&m), GPU_ENODEV);
    ck_assert(c[0] == 9.0f && c[3] == 9.0f);
}
END_TEST

/* ---- plain products ---------------------------------------------------------------------- */

static const int shapes[][3] = {
    {1, 1, 1}, {7, 13, 5}, {33, 65, 129}, {128, 256, 768}, {17, 40, 3000},
};
#define NSHAPES ((int)(sizeof(shapes) / sizeof(shapes[0])))

/* Every shape in the four transpose combinations, padding and beta varying with them (each
 * transpose pair sees beta 0 and 1 over consecutive shapes). */
static void sweep(gpu_dtype adt, gpu_dtype cdt, bool via_gemm, uint64_t seed)
{
    for (int s = 0; s < NSHAPES; s++) {
        for (int t = 0; t < 4; t++) {
            tcase c = {.ta = t & 1, .tb = (t >> 1) & 1, .M = shapes[s][0], .N = shapes[s][1],
                       .K = shapes[s][2], .adt = adt, .bdt = adt, .cdt = cdt,
                       .beta = (float)((s + t) % 2), .via_gemm = via_gemm};
            int ac = c.ta ? c.M : c.K, bc = c.tb ? c.K : c.N;
            c.lda = ac + (t == 1 || t == 2 ? 5 : 0);
            c.ldb = bc + (t >= 2 ? 3 : 0);
            c.ldc = c.N + (t % 2 ? 2 : 0);
            run_case(c, seed + (uint64_t)(s * 4 + t));
        }
    }
}

START_TEST(t_fp32)
{
    if (!have_blas())
        return;
    errs_begin();
    sweep(GPU_FP32, GPU_FP32, true, 100);
    errs_end();
}
END_TEST

START_TEST(t_lowp_operands)
{
    if (!have_blas())
        return;
    errs_begin();
    sweep(GPU_FP16, GPU_FP32, true, 200);
    sweep(GPU_BF16, GPU_FP32, false, 300);
    errs_end();
}
END_TEST

START_TEST(t_lowp_output)
{
    if (!have_blas())
        return;
    errs_begin();
    sweep(GPU_FP16, GPU_FP16, false, 400);
    sweep(GPU_BF16, GPU_BF16, false, 500);
    errs_end();
}
END_TEST

/* Operands of different dtypes: gpu_cuda_gemm_host widens them as gpu_gemm does. */
START_TEST(t_mixed)
{
    if (!have_blas())
        return;
    static const gpu_dtype pairs[][2] = {
        {GPU_FP16, GPU_BF16}, {GPU_FP32, GPU_FP16}, {GPU_BF16, GPU_FP32}, {GPU_FP16, GPU_FP32},
    };
    errs_begin();
    for (int i = 0; i < 4; i++) {
        tcase c = {.ta = i & 1, .tb = (i >> 1) & 1, .M = 33, .N = 65, .K = 129,
                   .adt = pairs[i][0], .bdt = pairs[i][1], .cdt = GPU_FP32,
                   .beta = (float)(i % 2), .via_gemm = true};
        c.lda = (c.ta ? c.M : c.K) + 1;
        run_case(c, 600 + (uint64_t)i);
    }
    errs_end();
}
END_TEST

/* ---- batches ------------------------------------------------------------------------------- */

static const gpu_dtype dts[3] = {GPU_FP32, GPU_FP16, GPU_BF16};

/* Per-head attention products on a [T x 3C] qkv-like layout (C = H hd): Q K^T into
 * [H x T x T] scores, then P V into the heads' columns of one [T x C] output (interleaved
 * batches: stride hd, ldc C). */
static void attention_cases(int T, int H, int hd, gpu_dtype dt, gpu_dtype cdt, uint64_t seed)
{
    int C = H * hd;
    tcase qk = {.tb = true, .M = T, .N = T, .K = hd, .adt = dt, .bdt = dt, .cdt = cdt,
                .lda = 3 * C, .ldb = 3 * C, .ldc = T, .batch = H, .stride_a = hd,
                .stride_b = hd, .stride_c = (int64_t)T * T};
    run_case(qk, seed);
    tcase pv = {.M = T, .N = hd, .K = T, .adt = dt, .bdt = dt, .cdt = cdt, .lda = T,
                .ldb = 3 * C, .ldc = C, .beta = 0.0f, .batch = H, .stride_a = (int64_t)T * T,
                .stride_b = hd, .stride_c = hd};
    run_case(pv, seed + 1);
    pv.beta = 1.0f;                 /* accumulate into the interleaved heads */
    pv.ta = true;                   /* P^T V: the backward's shape */
    run_case(pv, seed + 2);
}

START_TEST(t_batched)
{
    if (!have_blas())
        return;
    errs_begin();
    for (int d = 0; d < 3; d++) {
        for (int o = 0; o < (dts[d] == GPU_FP32 ? 1 : 2); o++) {
            gpu_dtype cdt = o == 0 ? GPU_FP32 : dts[d];
            uint64_t seed = 700 + 20 * (uint64_t)(d * 2 + o);
            /* generic strides with gaps between the matrices */
            for (int t = 0; t < 4; t++) {
                tcase c = {.ta = t & 1, .tb = (t >> 1) & 1, .M = 7, .N = 13, .K = 5,
                           .adt = dts[d], .bdt = dts[d], .cdt = cdt, .beta = (float)(t % 2),
                           .batch = 3};
                c.lda = (c.ta ? c.M : c.K) + 2;
                c.ldb = (c.tb ? c.K : c.N) + 1;
                c.ldc = c.N + 3;
                c.stride_a = (int64_t)(c.ta ? c.K : c.M) * c.lda + 4;
                c.stride_b = (int64_t)(c.tb ? c.N : c.K) * c.ldb + 1;
                c.stride_c = (int64_t)c.M * c.ldc + 5;
                run_case(c, seed + (uint64_t)t);
            }
            attention_cases(33, 12, 16, dts[d], cdt, seed + 4);
            attention_cases(21, 3, 13, dts[d], cdt, seed + 8);  /* 2-byte aligned heads */
            /* one B shared by every batch (stride 0) */
            tcase s0 = {.M = 9, .N = 11, .K = 24, .adt = dts[d], .bdt = dts[d], .cdt = cdt,
                        .batch = 3, .stride_a = 9 * 24, .stride_b = 0, .stride_c = 9 * 11};
            run_case(s0, seed + 12);
        }
    }
    errs_end();
}
END_TEST

/* ---- epilogues ----------------------------------------------------------------------------- */

START_TEST(t_epilogue)
{
    if (!have_blas())
        return;
    static const gpu_dtype combos[][2] = {
        {GPU_FP32, GPU_FP32}, {GPU_FP16, GPU_FP32}, {GPU_BF16, GPU_FP32},
        {GPU_FP16, GPU_FP16}, {GPU_BF16, GPU_BF16},
    };
    errs_begin();
    memset(gelu_dev_ulps, 0, sizeof(gelu_dev_ulps));
    for (int k = 0; k < 5; k++) {
        for (int e = 0; e < 3; e++) {
            for (int beta = 0; beta < 2; beta++) {
                int v = k * 6 + e * 2 + beta;
                tcase c = {.ta = v % 3 == 1, .tb = v % 2 == 1, .M = v % 2 ? 33 : 64,
                           .N = v % 2 ? 65 : 96, .K = v % 2 ? 129 : 200, .adt = combos[k][0],
                           .bdt = combos[k][0], .cdt = combos[k][1], .beta = (float)beta,
                           .epi = e == 0 ? GPU_CUDA_EPI_BIAS : GPU_CUDA_EPI_BIAS_GELU,
                           .aux = e == 2};
                c.ldc = c.N + (v % 4 == 0 ? 3 : 0);
                run_case(c, 900 + (uint64_t)v);
            }
        }
    }
    for (int d = 0; d < 3; d++)
        printf("check_cuda_gemm: gelu epilogue, %s C: largest deviation %.2f ulp beyond the "
               "accumulation term\n", gpu_dtype_name(dts[d]), gelu_dev_ulps[dts[d]]);
    fflush(stdout);
    errs_end();
}
END_TEST

/* ---- sizes 0 ------------------------------------------------------------------------------- */

START_TEST(t_zero)
{
    if (!have_blas())
        return;
    static const float betas[3] = {0.0f, 1.0f, 0.5f};
    errs_begin();
    for (int d = 0; d < 3; d++) {
        for (int bi = 0; bi < 3; bi++) {
            uint64_t seed = 1000 + 10 * (uint64_t)(d * 3 + bi);
            /* K == 0: C = beta C (zeros over NaN for beta 0) */
            tcase k0 = {.M = 5, .N = 7, .K = 0, .adt = dts[d], .bdt = dts[d], .cdt = dts[d],
                        .ldc = 9, .beta = betas[bi], .via_gemm = dts[d] == GPU_FP32};
            run_case(k0, seed);
            k0.via_gemm = false;
            k0.batch = 3;
            k0.stride_c = 5 * 9 + 2;
            run_case(k0, seed + 1);
            /* M or N == 0: nothing changes */
            tcase m0 = {.M = 0, .N = 7, .K = 4, .adt = dts[d], .bdt = dts[d], .cdt = dts[d],
                        .beta = betas[bi], .via_gemm = dts[d] == GPU_FP32};
            run_case(m0, seed + 2);
            m0.M = 6;
            m0.N = 0;
            run_case(m0, seed + 3);
        }
    }
    /* empty products need no buffers */
    ck_assert_int_eq(gpu_cuda_gemm_host(false, false, 0, 3, 3, NULL, GPU_FP32, 3, NULL,
                                        GPU_FP32, 3, 0.0f, NULL, 3), 0);
    float c[6] = {1, 2, 3, 4, 5, 6};
    ck_assert_int_eq(gpu_cuda_gemm_host(true, true, 2, 3, 0, NULL, GPU_FP16, 2, NULL, GPU_BF16,
                                        1, 0.0f, c, 3), 0);
    for (int i = 0; i < 6; i++)
        ck_assert(c[i] == 0.0f);
    errs_end();
}
END_TEST

/* ---- bad arguments ------------------------------------------------------------------------- */

static void expect_einval_gemm(bool ta, bool tb, int M, int N, int K, gpu_dtype adt, int lda,
                               gpu_dtype bdt, int ldb, float *c, int ldc, const char *what)
{
    float a[64] = {0}, b[64] = {0};
    float before[64];
    memcpy(before, c, sizeof(before));
    int rc = gpu_cuda_gemm_host(ta, tb, M, N, K, a, adt, lda, b, bdt, ldb, 0.0f, c, ldc);
    if (rc != GPU_EINVAL)
        err("gemm_host %s: returned %d, not GPU_EINVAL", what, rc);
    if (memcmp(before, c, sizeof(before)) != 0)
        err("gemm_host %s: C changed", what);
}

static void expect_einval_mm(const gpu_cuda_mm *m, const char *what)
{
    float *c = (float *)m->C;
    float before[64];
    memcpy(before, c, sizeof(before));
    int rc = gpu_cuda_mm_host(m);
    if (rc != GPU_EINVAL)
        err("mm_host %s: returned %d, not GPU_EINVAL", what, rc);
    if (memcmp(before, c, sizeof(before)) != 0)
        err("mm_host %s: C changed", what);
}

START_TEST(t_bad_args)
{
    if (!have_blas())
        return;
    float c[64];
    for (int i = 0; i < 64; i++)
        c[i] = (float)i;
    errs_begin();
    expect_einval_gemm(false, false, -1, 2, 2, GPU_FP32, 2, GPU_FP32, 2, c, 2, "M < 0");
    expect_einval_gemm(false, false, 2, -1, 2, GPU_FP32, 2, GPU_FP32, 2, c, 2, "N < 0");
    expect_einval_gemm(false, false, 2, 2, -1, GPU_FP32, 2, GPU_FP32, 2, c, 2, "K < 0");
    expect_einval_gemm(false, false, 2, 2, 3, GPU_FP32, 2, GPU_FP32, 2, c, 2, "lda < K");
    expect_einval_gemm(true, false, 3, 2, 2, GPU_FP16, 2, GPU_FP16, 2, c, 2, "lda < M (ta)");
    expect_einval_gemm(false, false, 2, 3, 2, GPU_FP32, 2, GPU_FP32, 2, c, 3, "ldb < N");
    expect_einval_gemm(false, true, 2, 2, 3, GPU_FP32, 3, GPU_FP32, 2, c, 2, "ldb < K (tb)");
    expect_einval_gemm(false, false, 2, 3, 2, GPU_FP32, 2, GPU_FP32, 3, c, 2, "ldc < N");
    expect_einval_gemm(false, false, 2, 2, 0, GPU_FP32, 0, GPU_FP32, 2, c, 2, "lda 0");
    expect_einval_gemm(false, false, 2, 2, 2, (gpu_dtype)7, 2, GPU_FP32, 2, c, 2, "dtype 7");
    if (gpu_cuda_gemm_host(false, false, 2, 2, 2, c, GPU_FP32, 2, c, GPU_FP32, 2, 0.0f, NULL,
                           2) != GPU_EINVAL)
        err("gemm_host with C NULL accepted");

    float a[64] = {0}, b[64] = {0}, bias[64] = {0}, aux[64];
    gpu_cuda_mm ok = {.M = 2, .N = 3, .K = 4, .A = a, .adt = GPU_FP16, .lda = 4, .B = b,
                      .bdt = GPU_FP16, .ldb = 3, .C = c, .cdt = GPU_FP16, .ldc = 3, .batch = 1};
    gpu_cuda_mm m = ok;
    m.bdt = GPU_BF16;
    expect_einval_mm(&m, "fp16 x bf16");
    m = ok;
    m.adt = m.bdt = GPU_FP32;
    expect_einval_mm(&m, "fp32 operands into an fp16 C");
    m = ok;
    m.cdt = GPU_BF16;
    expect_einval_mm(&m, "fp16 operands into a bf16 C");
    m = ok;
    m.batch = 0;
    expect_einval_mm(&m, "batch 0");
    m = ok;
    m.batch = 2;
    m.stride_a = 8;
    m.stride_b = 12;
    m.stride_c = 0;
    expect_einval_mm(&m, "overlapping batches");
    m.stride_c = 6;
    m.stride_a = -8;
    expect_einval_mm(&m, "negative stride");
    m = ok;
    m.batch = 2;
    m.stride_a = 8;
    m.stride_b = 12;
    m.stride_c = 6;
    m.epilogue = GPU_CUDA_EPI_BIAS;
    m.bias = bias;
    expect_einval_mm(&m, "batched epilogue");
    m = ok;
    m.epilogue = GPU_CUDA_EPI_BIAS;
    expect_einval_mm(&m, "bias epilogue without a bias");
    m.bias = bias;
    m.aux = aux;
    m.aux_ld = 8;
    expect_einval_mm(&m, "aux with the bias epilogue");
    m.epilogue = GPU_CUDA_EPI_BIAS_GELU;
    m.aux_ld = 3;
    expect_einval_mm(&m, "aux_ld not a multiple of 8");
    m.aux_ld = 0;
    expect_einval_mm(&m, "aux_ld 0");
    m = ok;
    m.epilogue = GPU_CUDA_EPI_BIAS;
    m.bias = bias;
    m.K = 0;
    expect_einval_mm(&m, "epilogue with K 0");
    m = ok;
    m.epilogue = (gpu_cuda_epilogue)9;
    expect_einval_mm(&m, "epilogue 9");
    m = ok;
    m.ldc = 2;
    expect_einval_mm(&m, "ldc < N");
    m = ok;
    m.tb = true;
    expect_einval_mm(&m, "ldb < K (tb)");
    m = ok;
    m.A = NULL;
    expect_einval_mm(&m, "A NULL");
    if (gpu_cuda_mm_host(NULL) != GPU_EINVAL)
        err("mm_host(NULL) accepted");
    errs_end();
}
END_TEST

/* ---- fp16 overflow ------------------------------------------------------------------------ */

/* Results exact in fp32 that a 16-bit C must round like gpu_f32_to_f16: 65504 stays, 65519
 * rounds down to 65504, 65520 (the tie) and beyond become inf; inf operands give inf. */
START_TEST(t_overflow)
{
    if (!have_blas())
        return;
    /* C[0][j] = 256 * b0j + 1 * b1j with the b pairs below; row 1 has an inf operand */
    static const float b0[6] = {255.875f, 255.875f, 255.875f, 255.875f, -255.875f, -255.875f};
    static const float b1[6] = {0.0f, 15.0f, 16.0f, 255.875f, -16.0f, -15.0f};
    static const float want[6] = {65504.0f, 65504.0f, INFINITY, INFINITY, -INFINITY,
                                  -65504.0f};
    float a[2][2] = {{256.0f, 1.0f}, {INFINITY, 1.0f}}, bm[2][6];
    uint16_t a16[4], b16[12];
    memcpy(bm[0], b0, sizeof(b0));
    memcpy(bm[1], b1, sizeof(b1));
    gpu_cvt_f32_f16(a16, &a[0][0], 4);
    gpu_cvt_f32_f16(b16, &bm[0][0], 12);
    errs_begin();
    for (int o = 0; o < 2; o++) {
        gpu_dtype cdt = o == 0 ? GPU_FP16 : GPU_FP32;
        float c[12];
        for (int i = 0; i < 12; i++)
            c[i] = NAN;
        gpu_cuda_mm m = {.M = 2, .N = 6, .K = 2, .A = a16, .adt = GPU_FP16, .lda = 2, .B = b16,
                         .bdt = GPU_FP16, .ldb = 6, .C = c, .cdt = cdt, .ldc = 6, .batch = 1};
        int rc = gpu_cuda_mm_host(&m);
        if (rc != 0) {
            err("overflow (%s C): returned %d", gpu_dtype_name(cdt), rc);
            continue;
        }
        for (int j = 0; j < 6; j++) {
            float w = o == 0 ? want[j] : 256.0f * b0[j] + b1[j];
            if (c[j] != w)
                err("overflow (%s C): C[0][%d] = %.9g, want %.9g", gpu_dtype_name(cdt), j,
                     (double)c[j], (double)w);
            /* inf * b0j + b1j: +-inf by b0j's sign */
            float wi = b0[j] > 0 ? INFINITY : -INFINITY;
            if (c[6 + j] != wi)
                err("overflow (%s C): C[1][%d] = %.9g, want %.9g", gpu_dtype_name(cdt), j,
                     (double)c[6 + j], (double)wi);
        }
    }
    errs_end();
}
END_TEST

/* ---- the device-pointer API ---------------------------------------------------------------- */

/* A device copy of n elements of size es at byte offset off into a fresh buffer (*base
 * receives the allocation). */
static void *dev_copy(void **base, const void *src, size_t n, size_t es, size_t off)
{
    ck_assert_int_eq(cudaMalloc(base, n * es + off + 64), cudaSuccess);
    ck_assert_int_eq(cudaMemset(*base, 0x5A, n * es + off + 64), cudaSuccess);
    char *d = (char *)*base + off;
    if (src != NULL)
        ck_assert_int_eq(cudaMemcpy(d, src, n * es, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

START_TEST(t_device_api)
{
    if (!have_blas())
        return;
    gpu_cuda_blas *h = NULL;
    char why[320];
    ck_assert_int_eq(gpu_cuda_blas_open(&h, why, sizeof(why)), 0);
    ck_assert_str_eq(why, "");
    cudaStream_t st;
    ck_assert_int_eq(cudaStreamCreate(&st), cudaSuccess);
    errs_begin();

    /* fp16 -> fp16 with every pointer 2 bytes past a 256-byte boundary, padded C rows */
    enum { M = 33, N = 29, K = 65, LDA = 67, LDB = 71, LDC = 31 };
    gpu_rng r;
    gpu_rng_seed(&r, 4242);
    float *af = make_matrix(&r, M, K, LDA, 1, 0, GPU_FP16, true);
    float *bf = make_matrix(&r, N, K, LDB, 1, 0, GPU_FP16, true);
    uint16_t *as = storage(af, span(M, K, LDA, 1, 0), GPU_FP16);
    uint16_t *bs = storage(bf, span(N, K, LDB, 1, 0), GPU_FP16);
    void *ba, *bb, *bc, *bbias;
    void *da = dev_copy(&ba, as, (size_t)span(M, K, LDA, 1, 0), 2, 2);
    void *db = dev_copy(&bb, bs, (size_t)span(N, K, LDB, 1, 0), 2, 2);
    uint16_t *dc = dev_copy(&bc, NULL, (size_t)M * LDC, 2, 2);
    gpu_cuda_mm m = {.tb = true, .M = M, .N = N, .K = K, .A = da, .adt = GPU_FP16, .lda = LDA,
                     .B = db, .bdt = GPU_FP16, .ldb = LDB, .C = dc, .cdt = GPU_FP16,
                     .ldc = LDC, .beta = 0.0f, .batch = 1};
    int rc = gpu_cuda_matmul(h, st, &m);
    if (rc != 0)
        err("misaligned fp16 product: returned %d", rc);
    ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
    size_t nraw = (size_t)M * LDC + 1 + 32;
    uint16_t *raw = xmalloc(nraw * 2);
    ck_assert_int_eq(cudaMemcpy(raw, bc, nraw * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    float *cref = xmalloc((size_t)M * LDC * sizeof(float));
    float *aabs = abs_floats(af, span(M, K, LDA, 1, 0));
    float *babs = abs_floats(bf, span(N, K, LDB, 1, 0));
    float *cabs = xmalloc((size_t)M * LDC * sizeof(float));
    gpu_gemm_ref(false, true, M, N, K, af, LDA, bf, LDB, 0.0f, cref, LDC);
    gpu_gemm_ref(false, true, M, N, K, aabs, LDA, babs, LDB, 0.0f, cabs, LDC);
    for (size_t i = 0; i < nraw; i++) {
        bool inside = i >= 1 && i < 1 + (size_t)M * LDC && (i - 1) % LDC < (size_t)N;
        if (!inside && raw[i] != 0x5A5A) {
            err("device C: element %zu outside the product changed (0x%04x)", i, raw[i]);
            break;
        }
        if (inside) {
            size_t o = i - 1;
            float c = gpu_f16_to_f32(raw[i]);
            if (rc == 0 && !close_to(c, cref[o], 1e-5 * cabs[o] + TINY, GPU_FP16))
                err("device C[%zu][%zu] = %.9g, reference %.9g", o / LDC, o % LDC, (double)c,
                     (double)cref[o]);
        }
    }

    /* misaligned bias, an A not aligned to its elements, no handle: refused */
    void *dbias = dev_copy(&bbias, NULL, 64, 2, 2);
    gpu_cuda_mm e = m;
    e.epilogue = GPU_CUDA_EPI_BIAS;
    e.bias = dbias;
    if (gpu_cuda_matmul(h, st, &e) != GPU_EINVAL)
        err("bias 2 bytes past 16-byte alignment accepted");
    e = m;
    e.A = (char *)da + 1;
    if (gpu_cuda_matmul(h, st, &e) != GPU_EINVAL)
        err("fp16 A at an odd address accepted");
    if (gpu_cuda_matmul(NULL, st, &m) != GPU_EINVAL)
        err("NULL handle accepted");

    /* reproducible: a long K (split-K territory) twice, bit for bit, fp16 and fp32 operands */
    for (int d = 0; d < 2; d++) {
        gpu_dtype dt = d == 0 ? GPU_FP16 : GPU_FP32;
        enum { RM = 64, RN = 48, RK = 3000 };
        float *x = make_matrix(&r, RM, RK, RK, 1, 0, dt, true);
        float *y = make_matrix(&r, RK, RN, RN, 1, 0, dt, true);
        void *xs = storage(x, (int64_t)RM * RK, dt), *ys = storage(y, (int64_t)RK * RN, dt);
        void *bx, *by, *bz;
        void *dx = dev_copy(&bx, xs, (size_t)RM * RK, esize(dt), 0);
        void *dy = dev_copy(&by, ys, (size_t)RK * RN, esize(dt), 0);
        float *dz = dev_copy(&bz, NULL, 2 * (size_t)RM * RN, 4, 0);
        gpu_cuda_mm p = {.M = RM, .N = RN, .K = RK, .A = dx, .adt = dt, .lda = RK, .B = dy,
                         .bdt = dt, .ldb = RN, .C = dz, .cdt = GPU_FP32, .ldc = RN,
                         .batch = 1};
        rc = gpu_cuda_matmul(h, st, &p);
        p.C = dz + RM * RN;
        if (rc == 0)
            rc = gpu_cuda_matmul(h, st, &p);
        if (rc != 0)
            err("reproducibility (%s): returned %d", gpu_dtype_name(dt), rc);
        ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
        float *z = xmalloc(2 * (size_t)RM * RN * sizeof(float));
        ck_assert_int_eq(cudaMemcpy(z, dz, 2 * (size_t)RM * RN * 4, cudaMemcpyDeviceToHost),
                         cudaSuccess);
        if (rc == 0 && memcmp(z, z + RM * RN, (size_t)RM * RN * 4) != 0)
            err("reproducibility (%s): two runs differ", gpu_dtype_name(dt));
        free(z);
        cudaFree(bx);
        cudaFree(by);
        cudaFree(bz);
        free(x);
        free(y);
        free(xs);
        free(ys);
    }

    ck_assert_int_eq(cudaStreamDestroy(st), cudaSuccess);
    gpu_cuda_blas_free(h);
    cudaFree(ba);
    cudaFree(bb);
    cudaFree(bc);
    cudaFree(bbias);
    free(af);
    free(bf);
    free(as);
    free(bs);
    free(raw);
    free(cref);
    free(aabs);
    free(babs);
    free(cabs);
    errs_end();
}
END_TEST

/* ---- fp8 ------------------------------------------------------------------------------------ */

/* Whether the device is the CUDA emulator, whose cuBLASLt is the CPU's exact model. */
static bool emulated(void)
{
    gpu_cuda_device d[1];
    int n = 0;
    return gpu_cuda_devices(d, 1, &n) == 0 && n > 0 && strstr(d[0].name, "emulator") != NULL;
}

static uint8_t finite_code(gpu_rng *r, gpu_fp8_format f)
{
    for (;;) {
        uint8_t c = (uint8_t)gpu_rng_below(r, 256);
        if (isfinite(gpu_fp8_to_f32(c, f)))
            return c;
    }
}

/* The cast: the CPU's codes (gpu_fp8_cast), the transposed copy, the amax (NaNs skipped),
 * and the diagnostics' counts equal to gpu_fp8_cast's stats. */
static void fp8_cast_case(gpu_dtype sdt, gpu_fp8_format f, uint64_t seed)
{
    enum { R = 37, C = 53 };
    float x[R * C], amax = 0.25f, want_amax;
    uint16_t x16[R * C];
    uint8_t q[R * C], qt[R * C], want[R * C];
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    for (int i = 0; i < R * C; i++)
        x[i] = gpu_rng_normal(&r) * ldexpf(1.0f, (int)gpu_rng_below(&r, 40) - 20);
    x[3] = NAN, x[4] = INFINITY, x[5] = -0.0f, x[6] = 0.0f;
    const void *src = x;
    if (sdt != GPU_FP32) {
        gpu_cvt_from_f32(x16, sdt, x, R * C);
        src = x16;
    }
    gpu_fp8_cast_stats st = {0};
    gpu_cuda_fp8_counts k;
    memset(&k, 0, sizeof(k));
    gpu_fp8_cast(want, src, sdt, R * C, f, 3.7f, &want_amax, &st);
    ck_assert_int_eq(gpu_cuda_fp8_cast_host(q, qt, src, sdt, R, C, f, 3.7f, &amax, &k), 0);
    /* the diagnostics' counts, the CPU's, and the largest |x| and the scale with them */
    ck_assert_msg(
        k.n == (unsigned long long)st.n && k.saturated == (unsigned long long)st.saturated &&
            k.underflow == (unsigned long long)st.underflow &&
            k.nonzero == (unsigned long long)st.nonzero && k.nan == (unsigned long long)st.nan,
        "counts n %llu sat %llu ufl %llu nz %llu nan %llu, the CPU's %lld %lld %lld %lld %lld", k.n,
        k.saturated, k.underflow, k.nonzero, k.nan, (long long)st.n, (long long)st.saturated,
        (long long)st.underflow, (long long)st.nonzero, (long long)st.nan);
    ck_assert(st.saturated > 0 && st.underflow > 0 && st.nan == 1); /* each one counted */
    ck_assert(k.amax == f2u(want_amax) && f2u(k.scale) == f2u(3.7f));
    ck_assert_msg(memcmp(q, want, sizeof(q)) == 0, "%s -> %s: codes differ from the CPU's",
                  gpu_dtype_name(sdt), gpu_fp8_format_name(f));
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++)
            if (qt[j * R + i] != q[i * C + j])
                ck_abort_msg("the transposed copy differs at %d, %d", i, j);
    ck_assert_msg(f2u(amax) == f2u(want_amax), "amax %a, the CPU's %a", (double)amax,
                  (double)want_amax);
    amax = 0.0f; /* the amax alone (current scaling's first pass) */
    ck_assert_int_eq(gpu_cuda_fp8_cast_host(NULL, NULL, src, sdt, R, C, f, 3.7f, &amax, NULL), 0);
    ck_assert(f2u(amax) == f2u(gpu_fp8_amax(src, sdt, R * C)));
}

/* One product against the CPU's exact model: equal on the emulator; on a GPU within fp32
 * accumulation's bound, the largest difference (in units of 2^-24 S) printed: the number
 * that calibrates the accumulator model (docs/fp8.md). */
static double fp8_gemm_case(int M, int N, int K, gpu_fp8_format af, gpu_fp8_format bf,
                            gpu_dtype cdt, bool adversarial, uint64_t seed)
{
    int lda = K + (M % 2 ? 16 : 0), ldb = K, ldc = N + 3;
    uint8_t *A = xmalloc((size_t)M * lda), *B = xmalloc((size_t)N * ldb);
    float *C = xmalloc(sizeof(float) * (size_t)M * ldc), *want = xmalloc(sizeof(float) * M * N);
    float *scr = xmalloc(sizeof(float) * gpu_gemm_fp8_scratch_floats(M, N, K));
    float sa = 0.37f, sb = 1.0f / 3.0f;
    double worst = 0.0;
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    for (size_t i = 0; i < (size_t)M * lda; i++)
        A[i] = finite_code(&r, af);
    for (size_t i = 0; i < (size_t)N * ldb; i++)
        B[i] = finite_code(&r, bf);
    if (adversarial) /* a large product first, then many that an fp22 sum would drop */
        for (int i = 0; i < M; i++)
            for (int k = 0; k < K; k++) {
                A[(size_t)i * lda + k] = k == 0 ? 0x7E : 0x01; /* 448 (E4M3/E5M2 code), tiny */
                if (i < N)
                    B[(size_t)i * ldb + k] = k == 0 ? 0x7E : 0x01;
            }
    for (size_t i = 0; i < (size_t)M * ldc; i++)
        C[i] = NAN; /* must be overwritten (beta 0) */
    ck_assert_int_eq(gpu_gemm_fp8(false, true, M, N, K, A, af, sa, lda, B, bf, sb, ldb, NULL, want,
                                  N, scr, gpu_gemm_fp8_scratch_floats(M, N, K)),
                     0);
    gpu_cuda_mm8 p = {.M = M,
                      .N = N,
                      .K = K,
                      .A = A,
                      .af = af,
                      .lda = lda,
                      .B = B,
                      .bf = bf,
                      .ldb = ldb,
                      .C = C,
                      .cdt = cdt,
                      .ldc = ldc};
    ck_assert_int_eq(gpu_cuda_mm8_host(&p, sa, sb), 0);
    bool exact = emulated();
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double mag = 0.0;
            for (int k = 0; k < K; k++)
                mag += fabs((double)gpu_fp8_to_f32(A[(size_t)i * lda + k], af) *
                            gpu_fp8_to_f32(B[(size_t)j * ldb + k], bf));
            mag *= (double)(sa * sb);
            float w = cdt == GPU_BF16 ? gpu_round(want[i * N + j], GPU_BF16) : want[i * N + j];
            float c = C[(size_t)i * ldc + j];
            double d = fabs((double)c - w) / (mag * 0x1p-24 + 1e-38);
            worst = d > worst ? d : worst;
            if (exact && f2u(c) != f2u(w))
                ck_abort_msg("fp8 %dx%dx%d [%d,%d]: %a on the emulator, the CPU's %a", M, N, K, i,
                             j, (double)c, (double)w);
            if (!exact && !(fabs((double)c - w) <=
                            K * 0x1p-23 * mag + (cdt == GPU_BF16 ? 0x1p-7 * fabs(w) : 0.0) + 1e-30))
                ck_abort_msg("fp8 %dx%dx%d [%d,%d]: %a, the CPU's exact %a (sum |ab| %g)", M, N, K,
                             i, j, (double)c, (double)w, mag);
        }
    free(A);
    free(B);
    free(C);
    free(want);
    free(scr);
    return worst;
}

/* The scaling rules on the device against the CPU's (gpu/fp8_rule.h both): delayed scaling
 * over 40 steps of amaxes from 2^-120 to 2^100 with 0, inf and NaN among them, on 6 rows of
 * a 16-entry history, max and most_recent, the bits of every row after every step; current
 * scaling of the same amaxes (epsilon 2^-60). */
static void fp8_scaling_case(void)
{
    enum { ROWS = 6, LEN = 16, COLS = 2 + LEN };
    const float top[3] = {448.0f / 8, 448.0f / 8, 57344.0f / 8}; /* margin 3 */
    gpu_rng r;
    gpu_rng_seed(&r, 88);
    for (int mr = 0; mr < 2; mr++) {
        float dev[ROWS * COLS], cpu[ROWS * COLS];
        for (int i = 0; i < ROWS * COLS; i++)
            dev[i] = cpu[i] = (i % COLS) < 2 ? 1.0f : 0.0f;
        for (int step = 0; step < 40; step++) {
            for (int k = 0; k < ROWS; k++) {
                int pick = (int)gpu_rng_below(&r, 20);
                float a = pick == 0   ? 0.0f
                          : pick == 1 ? INFINITY
                          : pick == 2 ? NAN
                                      : ldexpf(1.0f + gpu_rng_uniform(&r),
                                               (int)gpu_rng_below(&r, 220) - 120);
                dev[k * COLS + 2] = cpu[k * COLS + 2] = a;
                float c[3] = {1.0f, 1.0f, 0.0f}, d[3] = {1.0f, 1.0f, 0.0f};
                c[0] = gpu_fp8_current_scale(a, top[k % 3], 0x1p-60f);
                c[1] = 1.0f / c[0];
                c[2] = a;
                ck_assert_int_eq(gpu_cuda_fp8_current_host(d, a, top[k % 3], 0x1p-60f), 0);
                ck_assert_msg(f2u(d[0]) == f2u(c[0]) && f2u(d[1]) == f2u(c[1]) &&
                                  f2u(d[2]) == f2u(c[2]),
                              "current scale of %a: %a on the device, %a on the CPU", (double)a,
                              (double)d[0], (double)c[0]);
            }
            ck_assert_int_eq(gpu_cuda_fp8_delayed_host(dev, ROWS, LEN, mr, top), 0);
            for (int k = 0; k < ROWS; k++)
                gpu_fp8_delayed_update(cpu + k * COLS + 2, LEN,
                                       mr ? GPU_FP8_AMAX_MOST_RECENT : GPU_FP8_AMAX_MAX, top[k % 3],
                                       &cpu[k * COLS], &cpu[k * COLS + 1]);
            for (int i = 0; i < ROWS * COLS; i++)
                if (f2u(dev[i]) != f2u(cpu[i]))
                    ck_abort_msg("delayed scaling (%s), step %d, row %d entry %d: %a on the "
                                 "device, %a on the CPU",
                                 mr ? "most_recent" : "max", step, i / COLS, i % COLS,
                                 (double)dev[i], (double)cpu[i]);
        }
    }
}

START_TEST(t_fp8)
{
    char why[320];
    if (!have_blas())
        return;
    if (!gpu_cuda_has_fp8(why, sizeof(why))) { /* an A100 (or the emulator as one) */
        uint8_t a[16 * 16] = {0}, b[16 * 16] = {0};
        float c[16 * 16];
        gpu_cuda_mm8 p = {.M = 16,
                          .N = 16,
                          .K = 16,
                          .A = a,
                          .lda = 16,
                          .B = b,
                          .ldb = 16,
                          .C = c,
                          .cdt = GPU_FP32,
                          .ldc = 16};
        ck_assert_msg(strstr(why, "sm_") && strstr(why, "8.9"), "%s", why);
        printf("check_cuda_gemm: fp8 refused as it should be: %s\n", why);
        ck_assert_int_eq(gpu_cuda_mm8_host(&p, 1.0f, 1.0f), GPU_ENODEV);
        return;
    }
    static const gpu_dtype sdts[] = {GPU_FP32, GPU_BF16, GPU_FP16};
    for (int d = 0; d < 3; d++)
        for (int f = 0; f < 2; f++)
            fp8_cast_case(sdts[d], (gpu_fp8_format)f, 40 + (uint64_t)(d * 2 + f));
    static const int shapes8[][3] = {{1, 16, 16}, {33, 48, 64}, {128, 256, 768}, {7, 32, 3008}};
    static const gpu_fp8_format pairs8[][2] = {
        {GPU_E4M3, GPU_E4M3}, {GPU_E4M3, GPU_E5M2}, {GPU_E5M2, GPU_E4M3}};
    double worst = 0.0;
    for (int s = 0; s < 4; s++)
        for (int q = 0; q < 3; q++) {
            double w = fp8_gemm_case(shapes8[s][0], shapes8[s][1], shapes8[s][2], pairs8[q][0],
                                     pairs8[q][1], (s + q) % 2 ? GPU_BF16 : GPU_FP32, false,
                                     60 + (uint64_t)(s * 3 + q));
            worst = w > worst ? w : worst;
        }
    double adv = fp8_gemm_case(64, 64, 4096, GPU_E4M3, GPU_E4M3, GPU_FP32, true, 77);
    fp8_scaling_case();
    printf("check_cuda_gemm: fp8 GEMMs against the CPU's exact model: largest difference %.3g "
           "x 2^-24 sum|ab| on random operands, %.3g on the adversarial ones (%s)\n",
           worst, adv, emulated() ? "the emulator: 0 expected" : "this GPU");
    /* the refusals: E5M2 x E5M2, K not a multiple of 16, an fp16 C */
    uint8_t a[32 * 32] = {0}, b[32 * 32] = {0};
    float c[32 * 32];
    gpu_cuda_mm8 p = {.M = 16,
                      .N = 16,
                      .K = 16,
                      .A = a,
                      .af = GPU_E5M2,
                      .lda = 32,
                      .B = b,
                      .bf = GPU_E5M2,
                      .ldb = 32,
                      .C = c,
                      .cdt = GPU_FP32,
                      .ldc = 16};
    ck_assert_int_eq(gpu_cuda_mm8_host(&p, 1.0f, 1.0f), GPU_EINVAL);
    p.bf = GPU_E4M3;
    p.K = 24;
    ck_assert_int_eq(gpu_cuda_mm8_host(&p, 1.0f, 1.0f), GPU_EINVAL);
    p.K = 16;
    p.cdt = GPU_FP16;
    ck_assert_int_eq(gpu_cuda_mm8_host(&p, 1.0f, 1.0f), GPU_EINVAL);
}
END_TEST

static Suite *cuda_gemm_suite(void)
{
    Suite *s = suite_create("cuda_gemm");
    TCase *tc = tcase_create("cuda_gemm");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, t_no_device);
    tcase_add_test(tc, t_fp32);
    tcase_add_test(tc, t_lowp_operands);
    tcase_add_test(tc, t_lowp_output);
    tcase_add_test(tc, t_mixed);
    tcase_add_test(tc, t_batched);
    tcase_add_test(tc, t_epilogue);
    tcase_add_test(tc, t_zero);
    tcase_add_test(tc, t_bad_args);
    tcase_add_test(tc, t_overflow);
    tcase_add_test(tc, t_device_api);
    suite_add_tcase(s, tc);
    TCase *t8 = tcase_create("fp8"); /* alone: AMPD_CUDAEMU_SM=80 CK_RUN_CASE=fp8 */
    tcase_set_timeout(t8, 120);
    tcase_add_test(t8, t_fp8);
    suite_add_tcase(s, t8);
    return s;
}

int main(void)
{
    const char *why;
    bool have = blas_check(&why);
    return cudatest_run("check_cuda_gemm", have, why, cuda_gemm_suite());
}
