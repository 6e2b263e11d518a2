/*
 * check_optim.c - optimizers, the learning-rate schedule and the autocast table.
 *
 * AdamW and SGD with momentum are checked bit for bit against what torch.optim produced
 * (tests/data/torch_optim.txt, 200 steps on fixed gradients, on every kernel path the CPU
 * has; one it lacks: a SKIP line per case), and against double-precision reference
 * implementations written here from PyTorch's formulas;
 * the fused working copy against the scalar conversions of format.c; the lost-update count of
 * the low-precision path against cases whose outcome is known; the schedule against its
 * closed forms; the update on 1, 2 and 3 OpenMP threads against itself, bit for bit.
 *
 * Threads: Check forks one child per test; nothing is shared. The thread-count test sets the
 * OpenMP thread count of its child.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gpu/gpu_int.h"
#include "tests/testutil.h"
#include "tests/torchref.h"

static const char *const impls[] = {"portable", "avx512"};

/* Forces the optimizer kernel path impl for the case fn; false, with the case's SKIP line,
 * when the CPU lacks it. */
static bool use_impl(const char *fn, const char *impl)
{
    int rc = gpu_optim_force(impl);
    if (rc == GPU_ENODEV) {
        test_skip(fn, impl, "this CPU lacks AVX-512F");
        return false;
    }
    ck_assert_int_eq(rc, 0);
    ck_assert_str_eq(gpu_optim_impl(), impl);
    return true;
}

static uint32_t fbits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static double rel_err(double got, double want)
{
    return fabs(got - want) / fabs(want);
}

/* ---- double-precision references ------------------------------------------------------ */

/* pa and ma follow the magnitudes the values are built from (the same recurrences on |terms|):
 * rounding error is relative to them, so an element whose moment cancels to near zero is
 * judged against the size of what cancelled. */
typedef struct {
    double *p, *m, *v, *pa, *ma;
} ref_state;

static void ref_alloc(ref_state *r, const float *p, size_t n)
{
    r->p = malloc(n * sizeof(double));
    r->m = calloc(n, sizeof(double));
    r->v = calloc(n, sizeof(double));
    r->pa = malloc(n * sizeof(double));
    r->ma = calloc(n, sizeof(double));
    ck_assert(r->p && r->m && r->v && r->pa && r->ma);
    for (size_t i = 0; i < n; i++) {
        r->p[i] = p[i];
        r->pa[i] = fabs(p[i]);
    }
}

static void ref_free(ref_state *r)
{
    free(r->p);
    free(r->m);
    free(r->v);
    free(r->pa);
    free(r->ma);
}

/* AdamW as in the paper / torch.optim.AdamW: decoupled decay, bias-corrected moments. */
static void ref_adamw(const gpu_optim_config *c, double lr, long t, double gmul, ref_state *r,
                      const float *g, size_t n)
{
    double b1 = c->beta1, b2 = c->beta2, eps = c->eps, wd = c->weight_decay;
    for (size_t i = 0; i < n; i++) {
        double gi = (double)g[i] * gmul;
        r->p[i] -= lr * wd * r->p[i];
        r->m[i] = b1 * r->m[i] + (1.0 - b1) * gi;
        r->v[i] = b2 * r->v[i] + (1.0 - b2) * gi * gi;
        double mhat = r->m[i] / (1.0 - pow(b1, (double)t));
        double vhat = r->v[i] / (1.0 - pow(b2, (double)t));
        double step = lr * mhat / (sqrt(vhat) + eps);
        r->p[i] -= step;
        r->ma[i] = b1 * r->ma[i] + (1.0 - b1) * fabs(gi);
        r->pa[i] = r->pa[i] * (1.0 - lr * wd) + fabs(step);
    }
}

/* torch.optim.SGD: L2 decay into the gradient, buffer = gradient on the first step. */
static void ref_sgd(const gpu_optim_config *c, double lr, long t, double gmul, ref_state *r,
                    const float *g, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double d = (double)g[i] * gmul + (double)c->weight_decay * r->p[i];
        double da = fabs((double)g[i] * gmul) + (double)c->weight_decay * r->pa[i];
        if (c->momentum != 0.0f) {
            r->m[i] = t == 1 ? d : (double)c->momentum * r->m[i] + d;
            r->ma[i] = t == 1 ? da : (double)c->momentum * r->ma[i] + da;
            d = r->m[i];
            da = r->ma[i];
        }
        r->p[i] -= lr * d;
        r->pa[i] += lr * da;
    }
}

static void fill_params(float *p, size_t n, gpu_rng *r)
{
    for (size_t i = 0; i < n; i++) {
        float a = 0.5f + gpu_rng_uniform(r);
        p[i] = gpu_rng_uniform(r) < 0.5f ? -a : a;
    }
}

/* ---- AdamW and SGD against the references ------------------------------------------- */

enum { N = 2600 }; /* crosses the 1024-element chunks with a ragged tail */

static void run_vs_reference(gpu_opt_type type, float wd, float gmul, float momentum)
{
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.type = type;
    c.weight_decay = wd;
    c.momentum = momentum;
    c.lr = type == GPU_OPT_SGD ? 0.01f : 1e-3f;
    ck_assert_int_eq(gpu_optim_validate(&c, NULL), 0);

    gpu_rng r;
    gpu_rng_seed(&r, 11);
    float *p = malloc(N * sizeof(float)), *g = malloc(N * sizeof(float));
    float *m = calloc(N, sizeof(float)), *v = calloc(N, sizeof(float));
    ck_assert(p && g && m && v);
    fill_params(p, N, &r);
    ref_state ref;
    ref_alloc(&ref, p, N);
    float *p0 = malloc(N * sizeof(float));
    ck_assert_ptr_nonnull(p0);
    memcpy(p0, p, N * sizeof(float));
    float *mbuf = type == GPU_OPT_SGD && momentum == 0.0f ? NULL : m;

    for (long t = 1; t <= 20; t++) {
        for (size_t i = 0; i < N; i++)
            g[i] = gpu_rng_normal(&r) * (i % 3 == 0 ? 1e-3f : 1.0f);
        float lr = c.lr * (1.0f + 0.1f * (float)t); /* a changing lr, as a schedule gives */
        gpu_optim_update(&c, lr, t, gmul, p, g, mbuf, type == GPU_OPT_SGD ? NULL : v, N, NULL,
                         GPU_FP32);
        if (type == GPU_OPT_SGD)
            ref_sgd(&c, lr, t, gmul, &ref, g, N);
        else
            ref_adamw(&c, lr, t, gmul, &ref, g, N);
    }
    double worst_p = 0, worst_m = 0, worst_v = 0;
    for (size_t i = 0; i < N; i++) {
        worst_p = fmax(worst_p, fabs(p[i] - ref.p[i]) / ref.pa[i]);
        if (momentum != 0.0f || type == GPU_OPT_ADAMW)
            worst_m = fmax(worst_m, fabs(m[i] - ref.m[i]) / ref.ma[i]);
        if (type == GPU_OPT_ADAMW)
            worst_v = fmax(worst_v, rel_err(v[i], ref.v[i]));
    }
    ck_assert_msg(worst_p < 1e-5, "params: worst relative error %g", worst_p);
    ck_assert_msg(worst_m < 1e-5, "first moment: worst relative error %g", worst_m);
    ck_assert_msg(worst_v < 1e-5, "second moment: worst relative error %g", worst_v);
    /* and the parameters moved far beyond that tolerance */
    double moved = 0;
    for (size_t i = 0; i < N; i++)
        moved = fmax(moved, rel_err(p[i], p0[i]));
    ck_assert_msg(moved > 1e-2, "parameters moved only %g", moved);
    ref_free(&ref);
    free(p0);
    free(p);
    free(g);
    free(m);
    free(v);
}

START_TEST(test_adamw_reference)
{
    if (!use_impl(__func__, impls[_i]))
        return;
    run_vs_reference(GPU_OPT_ADAMW, 0.0f, 1.0f, 0.0f);
    run_vs_reference(GPU_OPT_ADAMW, 0.1f, 0.5f, 0.0f);
}
END_TEST

START_TEST(test_sgd_reference)
{
    if (!use_impl(__func__, impls[_i]))
        return;
    run_vs_reference(GPU_OPT_SGD, 0.0f, 1.0f, 0.9f);
    run_vs_reference(GPU_OPT_SGD, 1e-2f, 0.25f, 0.9f);
    run_vs_reference(GPU_OPT_SGD, 1e-2f, 2.0f, 0.0f); /* plain SGD: no buffer, m NULL */
}
END_TEST

START_TEST(test_adamw_first_step)
{
    /* At t = 1 the bias corrections make mhat = g and vhat = g^2 exactly, so the step is
     * lr * g / (|g| + eps): about lr in size whatever the gradient's scale. */
    if (!use_impl(__func__, impls[_i]))
        return;
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    enum { M = 40 };
    float p[M], g[M], m[M] = {0}, v[M] = {0};
    for (int i = 0; i < M; i++) {
        p[i] = 1.0f;
        g[i] = ldexpf(i % 2 ? -1.5f : 1.25f, i - 20);
    }
    gpu_optim_update(&c, c.lr, 1, 1.0f, p, g, m, v, M, NULL, GPU_FP32);
    for (int i = 0; i < M; i++) {
        double gi = g[i];
        double want = 1.0 - 1e-3 * gi / (fabs(gi) + 1e-8);
        ck_assert_msg(rel_err(p[i], want) < 2e-7, "i %d: %.9g vs %.9g", i, (double)p[i],
                      want);
        ck_assert(m[i] == (float)(1.0 - 0.9) * g[i]);
    }
    /* a large gradient gives a step of lr to within float rounding */
    ck_assert(fabsf(p[30] - (1.0f - 1e-3f)) <= 2e-7f);
}
END_TEST

/* ---- the fused working copy ------------------------------------------------------------ */

START_TEST(test_working_copy)
{
    if (!use_impl(__func__, impls[_i]))
        return;
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    gpu_rng r;
    gpu_rng_seed(&r, 3);
    enum { M = 3000 };
    static float p[M], g[M], m[M], v[M], w32[M];
    static uint16_t w16[M];
    for (int dt = 0; dt < 3; dt++) {
        fill_params(p, M, &r);
        p[0] = 70000.0f; /* beyond fp16 range: the copy says inf, as RNE does */
        p[1] = 1e-6f;    /* an fp16 subnormal */
        memset(m, 0, sizeof(m));
        memset(v, 0, sizeof(v));
        for (int t = 1; t <= 3; t++) {
            for (int i = 0; i < M; i++)
                g[i] = gpu_rng_normal(&r);
            void *work = dt == GPU_FP32 ? (void *)w32 : (void *)w16;
            gpu_optim_update(&c, c.lr, t, 1.0f, p, g, m, v, M, work, (gpu_dtype)dt);
            int bad = 0;
            for (int i = 0; i < M; i++) {
                if (dt == GPU_FP16)
                    bad += w16[i] != gpu_f32_to_f16(p[i]);
                else if (dt == GPU_BF16)
                    bad += w16[i] != gpu_f32_to_bf16(p[i]);
                else
                    bad += fbits(w32[i]) != fbits(p[i]);
            }
            ck_assert_msg(bad == 0, "%s step %d: %d working-copy elements differ",
                          gpu_dtype_name((gpu_dtype)dt), t, bad);
        }
    }
}
END_TEST

START_TEST(test_paths_identical)
{
    ck_assert_int_eq(gpu_optim_force("nonsense"), GPU_EINVAL);
    if (!use_impl(__func__, "avx512"))
        return;
    gpu_rng r;
    gpu_rng_seed(&r, 8);
    enum { M = 2053 };
    static float p[2][M], g[M], m[2][M], v[2][M];
    static uint16_t w[2][M];
    for (int type = 0; type < 2; type++) {
        gpu_optim_config c;
        gpu_optim_defaults(&c);
        c.type = (gpu_opt_type)type;
        c.weight_decay = 0.05f;
        fill_params(p[0], M, &r);
        memcpy(p[1], p[0], sizeof(p[0]));
        memset(m, 0, sizeof(m));
        memset(v, 0, sizeof(v));
        for (int t = 1; t <= 4; t++) {
            for (int i = 0; i < M; i++)
                g[i] = gpu_rng_normal(&r) * 0.01f;
            for (int k = 0; k < 2; k++) {
                ck_assert_int_eq(gpu_optim_force(impls[k]), 0);
                gpu_optim_update(&c, 3e-3f, t, 0.7f, p[k], g, m[k], v[k], M, w[k], GPU_BF16);
            }
            ck_assert(memcmp(p[0], p[1], sizeof(p[0])) == 0);
            ck_assert(memcmp(m[0], m[1], sizeof(m[0])) == 0);
            ck_assert(memcmp(v[0], v[1], sizeof(v[0])) == 0);
            ck_assert(memcmp(w[0], w[1], sizeof(w[0])) == 0);
        }
    }
}
END_TEST

/* ---- parameters only in the low dtype -------------------------------------------------- */

START_TEST(test_lowp_lost_updates)
{
    if (!use_impl(__func__, impls[_i]))
        return;
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.type = GPU_OPT_SGD;
    c.momentum = 0.0f;
    enum { M = 1500 };
    static uint16_t w[M];
    static float g[M];
    gpu_rng r;
    gpu_rng_seed(&r, 4);
    for (int i = 0; i < M; i++)
        g[i] = 0.5f + 0.5f * gpu_rng_uniform(&r);
    int64_t lost = -1;

    /* fp16 1.0 has neighbours 1 - 2^-11 and 1 + 2^-10: a step of <= 1e-5 rounds away */
    for (int i = 0; i < M; i++)
        w[i] = gpu_f32_to_f16(1.0f);
    gpu_optim_update_lowp(&c, 1e-5f, 1, 1.0f, w, GPU_FP16, g, NULL, NULL, M, &lost);
    ck_assert_int_eq(lost, M);
    int bad = 0;
    for (int i = 0; i < M; i++)
        bad += w[i] != 0x3C00u;
    ck_assert_int_eq(bad, 0);

    /* a step of >= 5e-3 always lands on another fp16 value */
    gpu_optim_update_lowp(&c, 1e-2f, 2, 1.0f, w, GPU_FP16, g, NULL, NULL, M, &lost);
    ck_assert_int_eq(lost, 0);
    for (int i = 0; i < M; i++)
        bad += w[i] != gpu_f32_to_f16(1.0f - 1e-2f * g[i]);
    ck_assert_int_eq(bad, 0);

    /* zero gradients are no update at all, so nothing is lost */
    static float zero[M];
    gpu_optim_update_lowp(&c, 1e-2f, 3, 1.0f, w, GPU_FP16, zero, NULL, NULL, M, &lost);
    ck_assert_int_eq(lost, 0);

    /* bf16 has 8 bits of precision: lr 1e-3 is lost at 1.0, mixed with ones that are not */
    for (int i = 0; i < M; i++) {
        w[i] = gpu_f32_to_bf16(1.0f);
        g[i] = i % 2 ? 1.0f : 10.0f; /* 1e-3 (lost, half ulp 2^-9) and 1e-2 (kept) */
    }
    gpu_optim_update_lowp(&c, 1e-3f, 1, 1.0f, w, GPU_BF16, g, NULL, NULL, M, &lost);
    ck_assert_int_eq(lost, M / 2);
}
END_TEST

START_TEST(test_lowp_matches_master_math)
{
    /* One lowp step gives exactly the rounding of the fp32 step taken from the same values. */
    if (!use_impl(__func__, impls[_i]))
        return;
    enum { M = 2100 };
    static uint16_t w[M], w0[M];
    static float p[M], g[M], m1[M], v1[M], m2[M], v2[M];
    gpu_rng r;
    gpu_rng_seed(&r, 21);
    for (int dt = GPU_FP16; dt <= GPU_BF16; dt++) {
        for (int type = 0; type < 2; type++) {
            gpu_optim_config c;
            gpu_optim_defaults(&c);
            c.type = (gpu_opt_type)type;
            c.weight_decay = 0.01f;
            memset(m1, 0, sizeof(m1));
            memset(v1, 0, sizeof(v1));
            memset(m2, 0, sizeof(m2));
            memset(v2, 0, sizeof(v2));
            for (int t = 1; t <= 3; t++) {
                for (int i = 0; i < M; i++) {
                    w[i] = dt == GPU_FP16 ? gpu_f32_to_f16(gpu_rng_normal(&r))
                                          : gpu_f32_to_bf16(gpu_rng_normal(&r));
                    p[i] = dt == GPU_FP16 ? gpu_f16_to_f32(w[i]) : gpu_bf16_to_f32(w[i]);
                    g[i] = gpu_rng_normal(&r);
                }
                memcpy(w0, w, sizeof(w));
                int64_t lost = -1;
                gpu_optim_update_lowp(&c, 0.05f, t, 0.5f, w, (gpu_dtype)dt, g, m1,
                                      type == GPU_OPT_ADAMW ? v1 : NULL, M, &lost);
                gpu_optim_update(&c, 0.05f, t, 0.5f, p, g, m2,
                                 type == GPU_OPT_ADAMW ? v2 : NULL, M, NULL, GPU_FP32);
                ck_assert(memcmp(m1, m2, sizeof(m1)) == 0);
                ck_assert(memcmp(v1, v2, sizeof(v1)) == 0);
                int64_t want_lost = 0;
                int bad = 0;
                for (int i = 0; i < M; i++) {
                    uint16_t want = dt == GPU_FP16 ? gpu_f32_to_f16(p[i])
                                                   : gpu_f32_to_bf16(p[i]);
                    bad += w[i] != want;
                    float before = dt == GPU_FP16 ? gpu_f16_to_f32(w0[i])
                                                  : gpu_bf16_to_f32(w0[i]);
                    want_lost += p[i] != before && w[i] == w0[i];
                }
                ck_assert_int_eq(bad, 0);
                ck_assert_int_eq(lost, want_lost);
            }
        }
    }
}
END_TEST

START_TEST(test_lowp_fp32)
{
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.type = GPU_OPT_SGD;
    c.momentum = 0.0f;
    float w[20], g[20];
    for (int i = 0; i < 20; i++) {
        w[i] = 1.0f;
        g[i] = (float)i;
    }
    int64_t lost = -1;
    gpu_optim_update_lowp(&c, 0.5f, 1, 1.0f, w, GPU_FP32, g, NULL, NULL, 20, &lost);
    ck_assert_int_eq(lost, 0);
    for (int i = 0; i < 20; i++)
        ck_assert(w[i] == 1.0f - 0.5f * (float)i);
}
END_TEST

/* ---- the same bits with any number of threads ------------------------------------------ */

static void set_threads(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

enum { BIG = 2100037 }; /* a few million parameters: many chunks per thread, a ragged tail */

typedef struct {
    float *p, *m, *v;
    uint16_t *w;
    int64_t lost;
} big_state;

static void big_alloc(big_state *s)
{
    s->p = malloc(BIG * sizeof(float));
    s->m = malloc(BIG * sizeof(float));
    s->v = malloc(BIG * sizeof(float));
    s->w = malloc(BIG * sizeof(uint16_t));
    ck_assert(s->p && s->m && s->v && s->w);
}

static void big_free(big_state *s)
{
    free(s->p);
    free(s->m);
    free(s->v);
    free(s->w);
}

/* Three steps of c from the same start (seeded by seed) on `threads` threads into s: with a
 * master copy and a working copy in wdt, then, from the working copy, without master. */
static void big_run(const gpu_optim_config *c, gpu_dtype wdt, int threads, uint64_t seed,
                    float *g, big_state *s)
{
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    fill_params(s->p, BIG, &r);
    memset(s->m, 0, BIG * sizeof(float));
    memset(s->v, 0, BIG * sizeof(float));
    set_threads(threads);
    float *v = c->type == GPU_OPT_ADAMW ? s->v : NULL;
    for (int t = 1; t <= 3; t++) {
        for (size_t i = 0; i < BIG; i++)
            g[i] = gpu_rng_normal(&r) * ldexpf(1.0f, (int)(i % 11) - 8);
        gpu_optim_update(c, 1e-3, t, 0.8f, s->p, g, s->m, v, BIG, s->w, wdt);
    }
    for (int t = 4; t <= 5; t++)
        gpu_optim_update_lowp(c, 0.02, t, 0.8f, s->w, wdt, g, s->m, v, BIG, &s->lost);
    set_threads(1);
}

static void big_same(const big_state *a, const big_state *b, const char *what)
{
    ck_assert_msg(memcmp(a->p, b->p, BIG * sizeof(float)) == 0, "%s: master differs", what);
    ck_assert_msg(memcmp(a->m, b->m, BIG * sizeof(float)) == 0, "%s: m differs", what);
    ck_assert_msg(memcmp(a->v, b->v, BIG * sizeof(float)) == 0, "%s: v differs", what);
    ck_assert_msg(memcmp(a->w, b->w, BIG * sizeof(uint16_t)) == 0, "%s: work differs", what);
    ck_assert_msg(a->lost == b->lost, "%s: lost %lld vs %lld", what, (long long)a->lost,
                  (long long)b->lost);
}

START_TEST(test_threads_identical)
{
    if (!use_impl(__func__, impls[_i]))
        return;
    static const struct {
        gpu_opt_type type;
        gpu_dtype wdt;
    } cases[] = {{GPU_OPT_ADAMW, GPU_BF16}, {GPU_OPT_ADAMW, GPU_FP16}, {GPU_OPT_SGD, GPU_BF16}};
    float *g = malloc(BIG * sizeof(float));
    big_state one, many;
    ck_assert_ptr_nonnull(g);
    big_alloc(&one);
    big_alloc(&many);
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        gpu_optim_config c;
        gpu_optim_defaults(&c);
        c.type = cases[k].type;
        c.weight_decay = 0.01;
        big_run(&c, cases[k].wdt, 1, 40 + k, g, &one);
        ck_assert_int_gt(one.lost, 0); /* the lost-update count is exercised */
        for (int threads = 2; threads <= 3; threads++) {
            char what[64];
            snprintf(what, sizeof(what), "%s case %zu, %d threads", impls[_i], k, threads);
            big_run(&c, cases[k].wdt, threads, 40 + k, g, &many);
            big_same(&one, &many, what);
        }
    }
    big_free(&one);
    big_free(&many);
    free(g);
}
END_TEST

/* ---- the working copy kept in the gradient block --------------------------------------- */

/* Matrices of odd shapes between stretches of other parameters: rows of 3 columns (many rows
 * to a chunk), of 1500 (more than a chunk), a lone 1 x 1, gaps before, between and after;
 * enough parameters for the team to share them out. */
static const gpu_optim_matrix in_grads_mats[] = {{5, 700, 3}, {2122, 45, 1500}, {69622, 1, 1}};
enum { IN_GRADS_N = 69633 };

/* Whether element i of a matrix region (j its index in the matrix, k the matrix) holds the
 * copy of p the update promises. */
static bool copy_ok(const float *g, const float *p, gpu_dtype wdt, int k, size_t j)
{
    const gpu_optim_matrix *mt = &in_grads_mats[k];
    gpu_dtype dt;
    int ld;
    const void *at = gpu_optim_copy_at(g, mt->off, mt->cols, wdt, &dt, &ld);
    size_t r = j / (size_t)mt->cols, col = j % (size_t)mt->cols;
    float want = p[mt->off + j];
    ck_assert_int_eq(ld, mt->cols);
    if (dt == GPU_BF16)
        return ((const uint16_t *)at)[r * (size_t)ld + col] == gpu_f32_to_bf16(want);
    float got = ((const float *)at)[r * (size_t)ld + col];
    return dt == GPU_FP32 && fbits(got) == fbits(gpu_f16_to_f32(gpu_f32_to_f16(want)));
}

/* The update with the copy in the gradients gives the parameters and the state that
 * gpu_optim_update gives, bit for bit, on one thread and on several; the matrices' copies are
 * the parameters rounded to wdt, where gpu_optim_copy_at says, and every other gradient is
 * left as it was. */
START_TEST(test_in_grads)
{
    if (!use_impl(__func__, impls[_i]))
        return;
    static const struct {
        gpu_opt_type type;
        gpu_dtype wdt;
    } cases[] = {{GPU_OPT_ADAMW, GPU_FP16}, {GPU_OPT_ADAMW, GPU_BF16}, {GPU_OPT_SGD, GPU_BF16},
                 {GPU_OPT_SGD, GPU_FP16}};
    enum { NP = IN_GRADS_N, NM = sizeof(in_grads_mats) / sizeof(in_grads_mats[0]) };
    static float p[2][NP], g[2][NP], m[2][NP], v[2][NP], g0[NP];
    gpu_rng r;
    gpu_rng_seed(&r, 11);
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        for (int threads = 1; threads <= 2; threads++) {
            gpu_optim_config c;
            gpu_optim_defaults(&c);
            c.type = cases[k].type;
            c.weight_decay = 0.01;
            fill_params(p[0], NP, &r);
            memcpy(p[1], p[0], sizeof(p[0]));
            memset(m, 0, sizeof(m));
            memset(v, 0, sizeof(v));
            set_threads(threads);
            for (int t = 1; t <= 3; t++) {
                for (size_t i = 0; i < NP; i++)
                    g0[i] = gpu_rng_normal(&r) * ldexpf(1.0f, (int)(i % 7) - 3);
                memcpy(g[0], g0, sizeof(g0));
                memcpy(g[1], g0, sizeof(g0));
                gpu_optim_update(&c, 1e-3, t, 0.5f, p[0], g[0], m[0], v[0], NP, NULL, GPU_FP32);
                gpu_optim_update_in_grads(&c, 1e-3, t, 0.5f, p[1], g[1], m[1], v[1], NP,
                                          in_grads_mats, NM, cases[k].wdt);
                ck_assert(memcmp(p[0], p[1], sizeof(p[0])) == 0);
                ck_assert(memcmp(m[0], m[1], sizeof(m[0])) == 0);
                ck_assert(memcmp(v[0], v[1], sizeof(v[0])) == 0);
                int bad = 0, kept = 0;
                size_t i = 0;
                for (int mt = 0; mt <= NM; mt++) {
                    size_t end = mt < NM ? in_grads_mats[mt].off : NP;
                    for (; i < end; i++)
                        kept += fbits(g[1][i]) == fbits(g0[i]);
                    if (mt == NM)
                        break;
                    size_t cnt = (size_t)in_grads_mats[mt].rows * in_grads_mats[mt].cols;
                    for (size_t j = 0; j < cnt; j++)
                        bad += !copy_ok(g[1], p[1], cases[k].wdt, mt, j);
                    i = end + cnt;
                }
                ck_assert_msg(bad == 0, "case %zu, %d threads, step %d: %d copies wrong", k,
                              threads, t, bad);
                ck_assert_int_eq(kept, NP - 2100 - 67500 - 1);
            }
        }
    }
    set_threads(1);
}
END_TEST

/* ---- learning-rate schedule ------------------------------------------------------------ */

START_TEST(test_schedule_warmup_constant)
{
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.lr = 1e-3f;
    ck_assert(gpu_lr_at(&c, 0, 100) == 1e-3f);
    ck_assert(gpu_lr_at(&c, 99, 100) == 1e-3f);
    c.warmup_steps = 10;
    ck_assert(gpu_lr_at(&c, 0, 100) == (float)((double)1e-3f * 1.0 / 10.0));
    ck_assert(gpu_lr_at(&c, 4, 100) == (float)((double)1e-3f * 5.0 / 10.0));
    ck_assert(gpu_lr_at(&c, 9, 100) == 1e-3f);
    ck_assert(gpu_lr_at(&c, 10, 100) == 1e-3f);
    ck_assert(gpu_lr_at(&c, 500, 100) == 1e-3f);
    for (int s = 1; s < 10; s++)
        ck_assert(gpu_lr_at(&c, s, 100) > gpu_lr_at(&c, s - 1, 100));
}
END_TEST

START_TEST(test_schedule_cosine)
{
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.lr = 2e-3f;
    c.warmup_steps = 10;
    c.schedule = GPU_SCHED_COSINE;
    c.min_lr_ratio = 0.1f;
    const int64_t total = 110;
    double lr = c.lr, r = c.min_lr_ratio;
    ck_assert(gpu_lr_at(&c, 10, total) == c.lr); /* the decay starts at lr */
    /* half way the cosine is at the mean of lr and its floor */
    ck_assert(rel_err(gpu_lr_at(&c, 60, total), lr * (r + (1 - r) * 0.5)) < 1e-6);
    /* one step before the end: 1/100 of the way short of the floor */
    double last = lr * (r + (1 - r) * 0.5 * (1 + cos(M_PI * 99.0 / 100.0)));
    ck_assert(rel_err(gpu_lr_at(&c, 109, total), last) < 1e-6);
    ck_assert(rel_err(gpu_lr_at(&c, 109, total), lr * r) < 3e-3);
    ck_assert(rel_err(gpu_lr_at(&c, 110, total), lr * r) < 1e-6);
    ck_assert(rel_err(gpu_lr_at(&c, 1000, total), lr * r) < 1e-6);
    for (int64_t s = 11; s < total; s++)
        ck_assert(gpu_lr_at(&c, s, total) < gpu_lr_at(&c, s - 1, total));
    c.min_lr_ratio = 0.0f;
    ck_assert(gpu_lr_at(&c, 109, total) > 0.0f);
    ck_assert(gpu_lr_at(&c, 109, total) < 1e-6f);
}
END_TEST

START_TEST(test_schedule_linear)
{
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.lr = 1.0f;
    c.schedule = GPU_SCHED_LINEAR;
    ck_assert(gpu_lr_at(&c, 0, 100) == 1.0f); /* no warmup: starts at lr */
    ck_assert(rel_err(gpu_lr_at(&c, 25, 100), 0.75) < 1e-7);
    ck_assert(rel_err(gpu_lr_at(&c, 99, 100), 0.01) < 1e-6);
    c.warmup_steps = 20;
    c.min_lr_ratio = 0.5f;
    ck_assert(rel_err(gpu_lr_at(&c, 9, 100), 0.5) < 1e-7);
    ck_assert(gpu_lr_at(&c, 20, 100) == 1.0f);
    ck_assert(rel_err(gpu_lr_at(&c, 60, 100), 0.75) < 1e-7);
    ck_assert(rel_err(gpu_lr_at(&c, 100, 100), 0.5) < 1e-7);
    /* total not beyond the warmup: no decay phase to divide by zero over */
    ck_assert(isfinite(gpu_lr_at(&c, 20, 10)));
}
END_TEST

/* ---- validation ------------------------------------------------------------------------ */

START_TEST(test_optim_defaults_validate)
{
    gpu_optim_config c;
    const char *field = "x";
    gpu_optim_defaults(&c);
    ck_assert_int_eq(c.type, GPU_OPT_ADAMW);
    ck_assert(c.lr == 1e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-8);
    ck_assert(c.weight_decay == 0.0 && c.momentum == 0.9 && c.grad_clip == 0.0f);
    ck_assert(c.warmup_steps == 0 && c.schedule == GPU_SCHED_CONSTANT);
    ck_assert(c.min_lr_ratio == 0.0f);
    ck_assert_int_eq(gpu_optim_validate(&c, &field), 0);
    ck_assert_ptr_null(field);

    struct {
        const char *field;
        int which;
        float value;
    } bad[] = {
        {"optimizer.lr", 0, NAN},           {"optimizer.lr", 0, 0.0f},
        {"optimizer.lr", 0, INFINITY},      {"optimizer.betas", 1, 1.0f},
        {"optimizer.betas", 2, -0.1f},      {"optimizer.betas", 2, NAN},
        {"optimizer.eps", 3, -1e-8f},       {"optimizer.eps", 3, 0.0f},
        {"optimizer.weight_decay", 4, -1},  {"optimizer.weight_decay", 4, INFINITY},
        {"optimizer.momentum", 5, 1.0f},    {"optimizer.momentum", 5, -0.5f},
        {"optimizer.grad_clip", 6, -1.0f},  {"optimizer.grad_clip", 6, NAN},
        {"optimizer.warmup_steps", 7, -1},  {"optimizer.min_lr_ratio", 8, 1.5f},
        {"optimizer.min_lr_ratio", 8, NAN},
    };
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        gpu_optim_defaults(&c);
        float x = bad[k].value;
        switch (bad[k].which) {
        case 0: c.lr = x; break;
        case 1: c.beta1 = x; break;
        case 2: c.beta2 = x; break;
        case 3: c.eps = x; break;
        case 4: c.weight_decay = x; break;
        case 5: c.momentum = x; break;
        case 6: c.grad_clip = x; break;
        case 7: c.warmup_steps = (int)x; break;
        default: c.min_lr_ratio = x; break;
        }
        field = NULL;
        ck_assert_int_eq(gpu_optim_validate(&c, &field), GPU_EINVAL);
        ck_assert_ptr_nonnull(field);
        ck_assert_str_eq(field, bad[k].field);
    }
    /* boundary values that are allowed */
    gpu_optim_defaults(&c);
    c.beta1 = 0.0f;
    c.momentum = 0.0f;
    c.min_lr_ratio = 1.0f;
    c.grad_clip = 0.0f;
    ck_assert_int_eq(gpu_optim_validate(&c, NULL), 0);
}
END_TEST

/* ---- autocast ------------------------------------------------------------------------- */

START_TEST(test_autocast_defaults)
{
    gpu_autocast a;
    gpu_autocast_defaults(&a);
    const gpu_op lowp[] = {GPU_OP_LINEAR, GPU_OP_MATMUL};
    const gpu_op fp32[] = {GPU_OP_SOFTMAX, GPU_OP_LOG_SOFTMAX, GPU_OP_CROSS_ENTROPY,
                           GPU_OP_LAYER_NORM, GPU_OP_EXP, GPU_OP_LOG, GPU_OP_SUM,
                           GPU_OP_NORM};
    const gpu_op input[] = {GPU_OP_RELU, GPU_OP_GELU, GPU_OP_ADD, GPU_OP_EMBEDDING};
    int seen = 0;
    for (size_t i = 0; i < sizeof(lowp) / sizeof(lowp[0]); i++, seen++)
        ck_assert_int_eq(a.policy[lowp[i]], GPU_CAST_LOWP);
    for (size_t i = 0; i < sizeof(fp32) / sizeof(fp32[0]); i++, seen++)
        ck_assert_int_eq(a.policy[fp32[i]], GPU_CAST_FP32);
    for (size_t i = 0; i < sizeof(input) / sizeof(input[0]); i++, seen++)
        ck_assert_int_eq(a.policy[input[i]], GPU_CAST_INPUT);
    ck_assert_int_eq(seen, GPU_OP_COUNT); /* every op is covered */
}
END_TEST

START_TEST(test_autocast_names)
{
    static const char *const names[GPU_OP_COUNT] = {
        "linear", "matmul", "relu", "gelu", "add", "softmax", "log_softmax", "cross_entropy",
        "layer_norm", "exp", "log", "sum", "norm", "embedding"};
    for (int op = 0; op < GPU_OP_COUNT; op++) {
        ck_assert_str_eq(gpu_op_name((gpu_op)op), names[op]);
        gpu_op back = GPU_OP_COUNT;
        ck_assert_int_eq(gpu_op_parse(names[op], &back), 0);
        ck_assert_int_eq(back, op);
    }
    gpu_op o = GPU_OP_ADD;
    ck_assert_int_eq(gpu_op_parse("conv2d", &o), GPU_EINVAL);
    ck_assert_int_eq(gpu_op_parse("Linear", &o), GPU_EINVAL);
    ck_assert_int_eq(gpu_op_parse("", &o), GPU_EINVAL);
    ck_assert_int_eq(o, GPU_OP_ADD);

    static const char *const pol[] = {"lowp", "fp32", "input"};
    for (int p = 0; p < 3; p++) {
        ck_assert_str_eq(gpu_cast_policy_name((gpu_cast_policy)p), pol[p]);
        gpu_cast_policy back = GPU_CAST_INPUT;
        ck_assert_int_eq(gpu_cast_policy_parse(pol[p], &back), 0);
        ck_assert_int_eq(back, p);
    }
    gpu_cast_policy cp;
    ck_assert_int_eq(gpu_cast_policy_parse("fp16", &cp), GPU_EINVAL);
    ck_assert_int_eq(gpu_cast_policy_parse("bf16", &cp), GPU_EINVAL);
    ck_assert_int_eq(gpu_cast_policy_parse("FP32", &cp), GPU_EINVAL);
}
END_TEST

START_TEST(test_autocast_dtype)
{
    gpu_autocast a;
    gpu_autocast_defaults(&a);
    for (int dt = GPU_FP16; dt <= GPU_BF16; dt++) {
        gpu_dtype d = (gpu_dtype)dt;
        ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_LINEAR, d, GPU_FP32), d);
        ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_MATMUL, d, GPU_FP32), d);
        ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_SOFTMAX, d, d), GPU_FP32);
        ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_CROSS_ENTROPY, d, d), GPU_FP32);
        ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_RELU, d, d), d);
        ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_RELU, d, GPU_FP32), GPU_FP32);
        ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_EMBEDDING, d, d), d);
    }
    /* an fp32 job runs everything in fp32, whatever the table and the input say */
    for (int op = 0; op < GPU_OP_COUNT; op++)
        ck_assert_int_eq(gpu_autocast_dtype(&a, (gpu_op)op, GPU_FP32, GPU_BF16), GPU_FP32);
    /* overrides are honoured */
    a.policy[GPU_OP_SOFTMAX] = GPU_CAST_LOWP;
    a.policy[GPU_OP_LINEAR] = GPU_CAST_FP32;
    ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_SOFTMAX, GPU_BF16, GPU_FP32), GPU_BF16);
    ck_assert_int_eq(gpu_autocast_dtype(&a, GPU_OP_LINEAR, GPU_FP16, GPU_FP16), GPU_FP32);
}
END_TEST

/* ---- against torch.optim ---------------------------------------------------------------- */

/* Index of the first element of got (n floats) whose bits differ from want, or -1; *rel
 * receives the largest relative difference. */
static int first_diff(const float *got, const uint32_t *want, int n, double *rel)
{
    int first = -1;
    *rel = 0.0;
    for (int i = 0; i < n; i++) {
        float w = torchref_float(want[i]);
        if (fbits(got[i]) == want[i])
            continue;
        if (first < 0)
            first = i;
        double r = rel_err(got[i], w);
        *rel = r > *rel ? r : *rel;
    }
    return first;
}

static void expect_bits(const char *what, int step, const float *got, const uint32_t *want,
                        int n)
{
    double rel;
    int i = first_diff(got, want, n, &rel);
    if (i >= 0)
        ck_abort_msg("%s after step %d: element %d is %.9g, torch %.9g (largest relative "
                     "difference %.3g)", what, step, i, (double)got[i],
                     (double)torchref_float(want[i]), rel);
}

/* The fixture's case as an ampd configuration. */
static gpu_optim_config torch_config(const torchref_optim *o)
{
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.type = strncmp(o->name, "sgd", 3) == 0 ? GPU_OPT_SGD : GPU_OPT_ADAMW;
    c.lr = o->lr;
    if (c.type == GPU_OPT_ADAMW) {
        c.beta1 = o->beta1;
        c.beta2 = o->beta2;
        c.eps = o->eps;
    }
    c.weight_decay = o->wd;
    c.momentum = o->momentum;
    return c;
}

/* Every case of the fixture, 200 steps of gpu_optim_update (and of the fp32 lowp entry,
 * which takes the same kernels) on one kernel path, equal to torch.optim bit for bit after
 * every reported step and in the final state. */
START_TEST(test_torch_optim)
{
    const bool lowp = _i % 2;
    if (!use_impl(lowp ? "test_torch_optim (lowp entry)" : __func__, impls[_i / 2]))
        return;
    torchref ref;
    int bad;
    if (torchref_load(&ref, &bad))
        ck_abort_msg("tests/data/torch_optim.txt: unreadable (line %d)", bad);
    for (int k = 0; k < ref.noptim; k++) {
        const torchref_optim *o = &ref.optim[k];
        gpu_optim_config c = torch_config(o);
        ck_assert_int_eq(gpu_optim_validate(&c, NULL), 0);
        float *p = malloc((size_t)o->n * sizeof(float)), *g = malloc((size_t)o->n * 4);
        float *m = calloc((size_t)o->n, 4), *v = calloc((size_t)o->n, 4);
        ck_assert(p && g && m && v);
        for (int i = 0; i < o->n; i++)
            p[i] = torchref_p0(i);
        for (int t = 1, r = 0; t <= o->steps; t++) {
            for (int i = 0; i < o->n; i++)
                g[i] = torchref_grad(i, t);
            if (lowp)
                gpu_optim_update_lowp(&c, c.lr, t, 1.0f, p, GPU_FP32, g, m, v, (size_t)o->n,
                                      NULL);
            else
                gpu_optim_update(&c, c.lr, t, 1.0f, p, g, m, v, (size_t)o->n, NULL, GPU_FP32);
            if (r < o->nreport && o->report_step[r] == t)
                expect_bits(o->name, t, p, o->p[r++], o->n);
        }
        if (o->m)
            expect_bits("exp_avg", o->steps, m, o->m, o->n);
        if (o->buf)
            expect_bits("momentum_buffer", o->steps, m, o->buf, o->n);
        if (o->v)
            expect_bits("exp_avg_sq", o->steps, v, o->v, o->n);
        ck_assert_int_eq(o->nreport, 7);
        free(p), free(g), free(m), free(v);
    }
    ck_assert_int_eq(ref.noptim, 4);
    torchref_free(&ref);
}
END_TEST

/* What the hyperparameters were rounded to before they were kept as doubles: 1 - 0.999 in
 * float is 0.00099998713, PyTorch's (float)(1 - 0.999) is 0.00100000005; with float betas the
 * second moment was 1.29e-5 relative low on every step. */
START_TEST(test_torch_constants)
{
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    float p = 1.0f, g = 1.0f, m = 0.0f, v = 0.0f;
    gpu_optim_update(&c, c.lr, 1, 1.0f, &p, &g, &m, &v, 1, NULL, GPU_FP32);
    ck_assert_uint_eq(fbits(v), fbits((float)(1.0 - 0.999)));
    ck_assert_uint_eq(fbits(m), fbits((float)(1.0 - 0.9)));
    ck_assert(c.lr == 1e-3 && c.beta2 == 0.999); /* the spec's doubles, not floats */
}
END_TEST

static Suite *optim_suite(void)
{
    Suite *s = suite_create("optim");
    TCase *tc = tcase_create("update");
    tcase_set_timeout(tc, 10);
    tcase_add_loop_test(tc, test_adamw_reference, 0, 2);
    tcase_add_loop_test(tc, test_sgd_reference, 0, 2);
    tcase_add_loop_test(tc, test_adamw_first_step, 0, 2);
    tcase_add_loop_test(tc, test_working_copy, 0, 2);
    tcase_add_test(tc, test_paths_identical);
    tcase_add_loop_test(tc, test_lowp_lost_updates, 0, 2);
    tcase_add_loop_test(tc, test_lowp_matches_master_math, 0, 2);
    tcase_add_test(tc, test_lowp_fp32);
    tcase_add_loop_test(tc, test_torch_optim, 0, 4);
    tcase_add_test(tc, test_torch_constants);
    suite_add_tcase(s, tc);

    tc = tcase_create("threads");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, test_threads_identical, 0, 2);
    tcase_add_loop_test(tc, test_in_grads, 0, 2);
    suite_add_tcase(s, tc);

    tc = tcase_create("schedule");
    tcase_add_test(tc, test_schedule_warmup_constant);
    tcase_add_test(tc, test_schedule_cosine);
    tcase_add_test(tc, test_schedule_linear);
    tcase_add_test(tc, test_optim_defaults_validate);
    suite_add_tcase(s, tc);

    tc = tcase_create("autocast");
    tcase_add_test(tc, test_autocast_defaults);
    tcase_add_test(tc, test_autocast_names);
    tcase_add_test(tc, test_autocast_dtype);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(optim_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
