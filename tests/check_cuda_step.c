/*
 * check_cuda_step.c - Check suite "cuda_step": the device kernels of a training step after
 * backward (gpu/cuda/cuda_step.cu, through tests/cudahost/step_host.cu) against the CPU
 * engine.
 *
 * With a device:
 *   - AdamW and SGD (weight decay on/off, momentum on/off with and without a buffer, gmul 1
 *     and 0.37, working copy none/fp32/fp16/bf16, n = 0, 1, 1000, 2^20+3, t = 1, 2, 1000,
 *     123457) equal gpu_optim_update within 1 ulp in p, m and v (the kernels do the CPU's
 *     IEEE operations in its order, so they are expected to be identical; 1 ulp leaves room
 *     only for a bias correction b^t rounded differently than glibc's pow), and the working
 *     copy is the rounded device master bit for bit;
 *   - a step with found_inf leaves every buffer bit-identical and the applied count at t - 1;
 *   - the lowp variants equal gpu_optim_update_lowp exactly: weights, m, v and lost counts;
 *   - the device scaler follows gpu_scaler_update step by step over 3000-step random overflow
 *     sequences (bursts and calm phases) for every mode, hysteresis 1 and 3, four configs
 *     that hit the floor (with floor failures), the ceiling, subnormal scales and an
 *     overflowing growth: scale bits, every counter and the floor flag equal;
 *   - the unscale pass with the device's multiplier equals gpu_unscale bit for bit (sumsq
 *     within 1e-9 relative: another summation order), and the clip coefficient equals
 *     train.c's within 1e-6 relative (exactly when the sum of squares is exact in any order);
 *   - the diagnostics counters equal a brute-force count written here and the CPU's
 *     gpu_diag_* exactly, edge values at every threshold included, first inf/NaN layer too;
 *   - five whole step tails (unscale, clip, optimizer, scaler) run back to back on the device
 *     equal the CPU sequence of train.c (gradients chosen so that every sum of squares is
 *     exact in any order, so the comparison can be exact).
 * Without a device (no driver, no device) main prints "check_cuda_step: SKIP: <why>" once,
 * the device tests return at once (the suite exits 77, SKIP), and one test checks that every
 * host wrapper then returns GPU_ENODEV and leaves its buffers alone.
 *
 * Threads: CK_NOFORK so that the CUDA state of main's probe is the one the tests use.
 */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/diag.h"
#include "gpu/gpu_int.h"
#include "gpu/cuda/cuda_step.h"
#include "tests/cudahost/cudahost.h"
#include "tests/cudatest.h"

#define BIG ((size_t)(1u << 20) + 3)

static void *xdup(const void *src, size_t n)
{
    void *p = xmalloc(n);
    if (n > 0)
        memcpy(p, src, n);
    return p;
}

/* Distance in units in the last place between two floats (0 for equal bits, NaN vs NaN and
 * +0 vs -0); a huge number when only one is NaN. */
static int64_t ulps(float a, float b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b) ? 0 : INT64_MAX;
    uint32_t ua = f2u(a), ub = f2u(b);
    int64_t oa = (ua & 0x80000000u) ? -(int64_t)(ua & 0x7FFFFFFFu) : (int64_t)ua;
    int64_t ob = (ub & 0x80000000u) ? -(int64_t)(ub & 0x7FFFFFFFu) : (int64_t)ub;
    return oa > ob ? oa - ob : ob - oa;
}

static void check_ulps(const char *what, const float *want, const float *got, size_t n,
                       int64_t tol)
{
    for (size_t i = 0; i < n; i++)
        if (ulps(want[i], got[i]) > tol)
            ck_abort_msg("%s[%zu]: cpu %.9g (0x%08x), device %.9g (0x%08x)", what, i,
                         (double)want[i], f2u(want[i]), (double)got[i], f2u(got[i]));
}

static void check_bits(const char *what, const void *want, const void *got, size_t bytes)
{
    const uint8_t *a = want, *b = got;
    for (size_t i = 0; i < bytes; i++)
        if (a[i] != b[i])
            ck_abort_msg("%s: byte %zu differs (cpu 0x%02x, device 0x%02x)", what, i, a[i],
                         b[i]);
}

/* Magnitudes 2^[lo, hi), random sign, about 2% exact zeros. */
static float rand_mag(gpu_rng *r, double lo, double hi)
{
    uint64_t b = gpu_rng_next(r);
    if (b % 50 == 0)
        return 0.0f;
    float v = (float)ldexp(1.0 + (double)gpu_rng_uniform(r),
                           (int)floor(lo + (double)gpu_rng_uniform(r) * (hi - lo)));
    return (b & 0x100) ? -v : v;
}

static float cpu_clip(const gpu_optim_config *o, double norm) /* train.c's clip_coef */
{
    if (o->grad_clip <= 0.0f || !(norm > o->grad_clip))
        return 1.0f;
    return (float)(o->grad_clip / (norm + 1e-6));
}

/* ---- without a device ---------------------------------------------------------------------- */

START_TEST(t_nodev)
{
    if (have_device())
        return;
    gpu_optim_config oc;
    gpu_scaler_config sc;
    gpu_optim_defaults(&oc);
    gpu_scaler_defaults(&sc, GPU_FP16);
    float p[4] = {1.0f, 2.0f, 3.0f, 4.0f}, g[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    float m[4] = {0}, v[4] = {0};
    uint16_t w[4] = {1, 2, 3, 4};
    int64_t lost = -7, applied = -7;

    ck_assert_int_eq(gpu_cuda_optim_update_host(&oc, 1e-3f, 1, 1.0f, false, p, g, m, v, 4, w,
                                                GPU_FP16, &applied),
                     GPU_ENODEV);
    ck_assert(p[0] == 1.0f && p[3] == 4.0f && m[0] == 0.0f && v[0] == 0.0f && w[0] == 1);
    ck_assert_int_eq(gpu_cuda_optim_update_lowp_host(&oc, 1e-3f, 1, 1.0f, false, w, GPU_FP16, g,
                                                     m, v, 4, &lost, &applied),
                     GPU_ENODEV);
    ck_assert(w[0] == 1 && w[3] == 4 && lost == -7 && applied == -7);

    gpu_scaler_state s, s0;
    gpu_scaler_init(&s, &sc);
    s0 = s;
    bool found[2] = {true, false}, fl[2] = {true, true};
    ck_assert_int_eq(gpu_cuda_scaler_update_host(&s, &sc, found, 2, NULL, fl), GPU_ENODEV);
    ck_assert(memcmp(&s, &s0, sizeof(s)) == 0 && fl[0] && fl[1]);

    size_t off = 0, cnt = 4;
    bool fi = true;
    double ss = -1.0, norm = -1.0;
    float clip = -1.0f;
    ck_assert_int_eq(gpu_cuda_clip_host(&oc, 2.0f, p, &off, &cnt, 1, NULL, &fi, &ss, &norm,
                                        &clip),
                     GPU_ENODEV);
    ck_assert(p[0] == 1.0f && fi && ss == -1.0 && norm == -1.0 && clip == -1.0f);

    gpu_dtype dts[1] = {GPU_FP16};
    gpu_cuda_diag_call call = {0, GPU_CUDA_DIAG_FORWARD, p, 4};
    gpu_cuda_diag *out = xmalloc(sizeof(*out));
    memset(out, 0xAB, sizeof(*out));
    ck_assert_int_eq(gpu_cuda_diag_host(dts, 1, 1.0f, &call, 1, out), GPU_ENODEV);
    ck_assert_uint_eq(out->layer[0].act_n, 0xABABABABABABABABull);
    free(out);

    gpu_cuda_tail_bufs b = {4, 1, &off, &cnt, p, w, GPU_FP16, m, v};
    float lr = 1e-3f;
    ck_assert_int_eq(gpu_cuda_step_tail_host(&oc, &sc, &s, &applied, 1, &lr, g, &b, NULL, NULL,
                                             NULL),
                     GPU_ENODEV);
    ck_assert(p[0] == 1.0f && w[0] == 1 && applied == -7 && memcmp(&s, &s0, sizeof(s)) == 0);
}
END_TEST

/* ---- optimizers with master weights --------------------------------------------------------- */

static const int64_t T_CYCLE[4] = {1, 2, 1000, 123457};

typedef struct {
    float *p, *g, *m, *v;
    void *work;
} opt_bufs;

static void bufs_fill(opt_bufs *b, size_t n, gpu_dtype wdt, bool with_m, bool with_v,
                      bool with_work, uint64_t seed)
{
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    b->p = xmalloc(n * 4);
    b->g = xmalloc(n * 4);
    b->m = with_m ? xmalloc(n * 4) : NULL;
    b->v = with_v ? xmalloc(n * 4) : NULL;
    b->work = with_work ? xmalloc(n * gpu_dtype_size(wdt)) : NULL;
    for (size_t i = 0; i < n; i++) {
        b->p[i] = 0.3f * gpu_rng_normal(&r);
        b->g[i] = rand_mag(&r, -40.0, 6.0);
        if (b->m)
            b->m[i] = 0.01f * gpu_rng_normal(&r);
        if (b->v) {
            float s = 0.01f * gpu_rng_normal(&r);
            b->v[i] = s * s;
        }
    }
    if (b->work)
        memset(b->work, 0x5A, n * gpu_dtype_size(wdt));
}

static void bufs_dup(opt_bufs *dst, const opt_bufs *src, size_t n, gpu_dtype wdt)
{
    dst->p = xdup(src->p, n * 4);
    dst->g = src->g;
    dst->m = src->m ? xdup(src->m, n * 4) : NULL;
    dst->v = src->v ? xdup(src->v, n * 4) : NULL;
    dst->work = src->work ? xdup(src->work, n * gpu_dtype_size(wdt)) : NULL;
}

static void bufs_free(opt_bufs *b, bool own_g)
{
    free(b->p);
    if (own_g)
        free(b->g);
    free(b->m);
    free(b->v);
    free(b->work);
}

static void check_update(const gpu_optim_config *c, float lr, int64_t t, float gmul, size_t n,
                         gpu_dtype wdt, bool with_work, bool with_m, uint64_t seed)
{
    bool adamw = c->type == GPU_OPT_ADAMW;
    size_t wb = n * gpu_dtype_size(wdt);
    opt_bufs in, cpu, dev;
    int64_t applied = -1;

    bufs_fill(&in, n, wdt, with_m, adamw, with_work, seed);
    bufs_dup(&cpu, &in, n, wdt);
    bufs_dup(&dev, &in, n, wdt);
    gpu_optim_update(c, lr, t, gmul, cpu.p, cpu.g, cpu.m, cpu.v, n, cpu.work, wdt);
    ck_assert_int_eq(gpu_cuda_optim_update_host(c, lr, t, gmul, false, dev.p, dev.g, dev.m,
                                                dev.v, n, dev.work, wdt, &applied),
                     0);
    ck_assert_int_eq(applied, t);
    check_ulps("p", cpu.p, dev.p, n, 1);
    if (with_m)
        check_ulps("m", cpu.m, dev.m, n, 1);
    if (adamw)
        check_ulps("v", cpu.v, dev.v, n, 1);
    if (with_work) {
        void *want = xmalloc(wb);
        gpu_cvt_from_f32(want, wdt, dev.p, n);  /* the device master, rounded on the CPU */
        check_bits("work", want, dev.work, wb);
        free(want);
    }
    bufs_free(&in, true);
    bufs_free(&cpu, false);
    bufs_free(&dev, false);
}

static const size_t SIZES[4] = {0, 1, 1000, BIG};
static const gpu_dtype DTS[3] = {GPU_FP32, GPU_FP16, GPU_BF16};

START_TEST(t_adamw)
{
    if (!have_device())
        return;
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    int k = 0;
    for (int si = 0; si < 4; si++)
        for (int di = 0; di < 3; di++)
            for (int wd = 0; wd < 2; wd++)
                for (int gm = 0; gm < 2; gm++, k++) {
                    c.weight_decay = wd ? 0.05f : 0.0f;
                    /* fp32: also without a working copy (the master is the weights) */
                    bool work = DTS[di] != GPU_FP32 || (k & 1);
                    check_update(&c, 1e-3f, T_CYCLE[k % 4], gm ? 0.37f : 1.0f, SIZES[si],
                                 DTS[di], work, true, 1000u + (uint64_t)k);
                }
    /* other hyper-parameters: betas below 1/2, large eps, lr 0.1 */
    c.beta1 = 0.3f;
    c.beta2 = 0.45f;
    c.eps = 1e-3f;
    check_update(&c, 0.1f, 3, 1.0f, 1000, GPU_BF16, true, true, 77);
}
END_TEST

START_TEST(t_sgd)
{
    if (!have_device())
        return;
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.type = GPU_OPT_SGD;
    int k = 0;
    for (int si = 0; si < 4; si++)
        for (int di = 0; di < 3; di++)
            for (int wd = 0; wd < 2; wd++)
                for (int mo = 0; mo < 3; mo++, k++) {
                    /* mo 0: momentum 0.9 with a buffer, 1: momentum 0 with a buffer (left
                     * alone), 2: momentum 0.9 without one */
                    c.weight_decay = wd ? 0.01f : 0.0f;
                    c.momentum = mo == 1 ? 0.0f : 0.9f;
                    bool work = DTS[di] != GPU_FP32 || (k & 1);
                    check_update(&c, 0.05f, T_CYCLE[k % 4], (k & 2) ? 0.37f : 1.0f,
                                 SIZES[si], DTS[di], work, mo != 2, 2000u + (uint64_t)k);
                    if (mo == 0 && si == 2) /* the first step initialises the buffer */
                        check_update(&c, 0.05f, 1, 1.0f, 1000, DTS[di], true, true, 99);
                }
}
END_TEST

/* ---- a skipped step -------------------------------------------------------------------------- */

static void check_skip(const gpu_optim_config *c, gpu_dtype wdt, uint64_t seed)
{
    const size_t n = 1000;
    bool adamw = c->type == GPU_OPT_ADAMW;
    opt_bufs in, dev;
    int64_t applied = -1, lost = -1;

    bufs_fill(&in, n, wdt, true, adamw, true, seed);
    in.g[3] = NAN;                 /* what made the step overflow */
    in.g[10] = INFINITY;
    bufs_dup(&dev, &in, n, wdt);
    ck_assert_int_eq(gpu_cuda_optim_update_host(c, 1e-3f, 5, 1.0f, true, dev.p, dev.g, dev.m,
                                                dev.v, n, dev.work, wdt, &applied),
                     0);
    ck_assert_int_eq(applied, 4);
    check_bits("p", in.p, dev.p, n * 4);
    check_bits("m", in.m, dev.m, n * 4);
    if (adamw)
        check_bits("v", in.v, dev.v, n * 4);
    check_bits("work", in.work, dev.work, n * gpu_dtype_size(wdt));

    /* lowp: the 16-bit weights, m, v and the count stay */
    ck_assert_int_eq(gpu_cuda_optim_update_lowp_host(c, 1e-3f, 5, 1.0f, true, dev.work, wdt,
                                                     dev.g, dev.m, dev.v, n, &lost, &applied),
                     0);
    ck_assert_int_eq(applied, 4);
    ck_assert_int_eq(lost, 0);
    check_bits("lowp w", in.work, dev.work, n * gpu_dtype_size(wdt));
    check_bits("lowp m", in.m, dev.m, n * 4);
    if (adamw)
        check_bits("lowp v", in.v, dev.v, n * 4);
    bufs_free(&in, true);
    bufs_free(&dev, false);
}

START_TEST(t_skip)
{
    if (!have_device())
        return;
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.weight_decay = 0.1f;
    for (int di = 0; di < 3; di++)
        check_skip(&c, DTS[di], 300u + (uint64_t)di);
    c.type = GPU_OPT_SGD;
    for (int di = 0; di < 3; di++)
        check_skip(&c, DTS[di], 310u + (uint64_t)di);
}
END_TEST

/* ---- without master weights -------------------------------------------------------------- */

static void check_lowp(const gpu_optim_config *c, float lr, int64_t t, float gmul, size_t n,
                       gpu_dtype wdt, bool with_m, uint64_t seed)
{
    bool adamw = c->type == GPU_OPT_ADAMW;
    size_t wb = n * gpu_dtype_size(wdt);
    opt_bufs in, cpu, dev;
    int64_t lost_cpu = -1, lost_dev = -2, applied = -1;

    bufs_fill(&in, n, wdt, with_m, adamw, true, seed);
    for (size_t i = 0; i < n; i++)   /* weights around 1 lose many updates in 16 bits */
        in.p[i] = 1.0f + in.p[i];
    gpu_cvt_from_f32(in.work, wdt, in.p, n);
    bufs_dup(&cpu, &in, n, wdt);
    bufs_dup(&dev, &in, n, wdt);
    gpu_optim_update_lowp(c, lr, t, gmul, cpu.work, wdt, cpu.g, cpu.m, cpu.v, n, &lost_cpu);
    ck_assert_int_eq(gpu_cuda_optim_update_lowp_host(c, lr, t, gmul, false, dev.work, wdt,
                                                     dev.g, dev.m, dev.v, n, &lost_dev,
                                                     &applied),
                     0);
    ck_assert_int_eq(applied, t);
    ck_assert_int_eq(lost_dev, lost_cpu);
    check_bits("w", cpu.work, dev.work, wb);
    if (with_m)
        check_bits("m", cpu.m, dev.m, n * 4);
    if (adamw)
        check_bits("v", cpu.v, dev.v, n * 4);
    if (wdt != GPU_FP32 && n == BIG)   /* the counting is exercised both ways */
        ck_assert(lost_cpu > 0 && lost_cpu < (int64_t)n);
    bufs_free(&in, true);
    bufs_free(&cpu, false);
    bufs_free(&dev, false);
}

START_TEST(t_lowp)
{
    if (!have_device())
        return;
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    int k = 0;
    for (int si = 0; si < 4; si++)
        for (int di = 0; di < 3; di++)
            for (int kind = 0; kind < 3; kind++)
                for (int var = 0; var < 2; var++, k++) {
                    /* kind 0: AdamW; 1: SGD momentum 0.9; 2: SGD momentum 0, no buffer */
                    c.type = kind == 0 ? GPU_OPT_ADAMW : GPU_OPT_SGD;
                    c.momentum = kind == 1 ? 0.9f : 0.0f;
                    c.weight_decay = var ? 0.01f : 0.0f;
                    check_lowp(&c, kind == 0 ? 2e-3f : 0.02f, T_CYCLE[k % 4],
                               var ? 0.5f : 1.0f, SIZES[si], DTS[di], kind != 2,
                               4000u + (uint64_t)k);
                }
}
END_TEST

/* ---- the scaler ------------------------------------------------------------------------------ */

#define SC_STEPS 3000

/* Random overflow flags in phases of 50 steps, each with its own rate (calm to stuck). */
static void overflow_sequence(bool *f, int n, uint64_t seed)
{
    static const float rate[6] = {0.0f, 0.01f, 0.1f, 0.5f, 0.95f, 1.0f};
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    float p = 0.0f;
    for (int i = 0; i < n; i++) {
        if (i % 50 == 0)
            p = rate[gpu_rng_below(&r, 6)];
        f[i] = gpu_rng_uniform(&r) < p;
    }
}

static void scaler_config(gpu_scaler_config *c, int which)
{
    gpu_scaler_defaults(c, GPU_FP16);
    switch (which) {
    case 0: /* powers of two, floor and ceiling close to the start */
        c->init_scale = 1024.0f;
        c->growth_interval = 4;
        c->min_scale = 64.0f;
        c->max_scale = 8192.0f;
        c->floor_patience = 3;
        break;
    case 1: /* factors whose products round */
        c->init_scale = 3.3f;
        c->growth_factor = 1.7f;
        c->backoff_factor = 0.3f;
        c->growth_interval = 3;
        c->min_scale = 0.37f;
        c->max_scale = 50.0f;
        c->floor_patience = 5;
        break;
    case 2: /* subnormal scales */
        c->init_scale = 1e-38f;
        c->growth_factor = 10.0f;
        c->backoff_factor = 1e-3f;
        c->growth_interval = 2;
        c->min_scale = 1e-44f;
        c->max_scale = 1e-30f;
        c->floor_patience = 2;
        break;
    default: /* growth that overflows fp32 (refused), floor at 1 */
        c->init_scale = 1e37f;
        c->growth_factor = 1e3f;
        c->backoff_factor = 0.01f;
        c->growth_interval = 2;
        c->min_scale = 1.0f;
        c->max_scale = FLT_MAX;
        c->floor_patience = 10;
        break;
    }
}

static void check_scaler_run(const gpu_scaler_config *c, uint64_t seed, int *floors,
                             int *ceilings)
{
    bool *found = xmalloc(SC_STEPS), *floor = xmalloc(SC_STEPS);
    gpu_scaler_state *trace = xmalloc(SC_STEPS * sizeof(*trace));
    gpu_scaler_state cpu, dev;

    overflow_sequence(found, SC_STEPS, seed);
    gpu_scaler_init(&cpu, c);
    dev = cpu;
    ck_assert_int_eq(gpu_cuda_scaler_update_host(&dev, c, found, SC_STEPS, trace, floor), 0);
    for (int k = 0; k < SC_STEPS; k++) {
        float before = cpu.scale;
        int rc = gpu_scaler_update(&cpu, c, found[k]);
        const gpu_scaler_state *d = &trace[k];
        if (f2u(d->scale) != f2u(cpu.scale) || d->growth_tracker != cpu.growth_tracker ||
            d->hysteresis_left != cpu.hysteresis_left || d->floor_streak != cpu.floor_streak ||
            d->steps != cpu.steps || d->overflow_total != cpu.overflow_total ||
            d->skipped_total != cpu.skipped_total || d->growth_total != cpu.growth_total ||
            d->backoff_total != cpu.backoff_total || floor[k] != (rc == GPU_ESCALE_FLOOR))
            ck_abort_msg("mode %d hysteresis %d step %d (found %d): cpu scale %a tracker %d "
                         "hyst %d streak %d growths %lld backoffs %lld floor %d; device scale "
                         "%a tracker %d hyst %d streak %d growths %lld backoffs %lld floor %d",
                         (int)c->mode, c->hysteresis, k, (int)found[k], (double)cpu.scale,
                         cpu.growth_tracker, cpu.hysteresis_left, cpu.floor_streak,
                         (long long)cpu.growth_total, (long long)cpu.backoff_total,
                         rc == GPU_ESCALE_FLOOR, (double)d->scale, d->growth_tracker,
                         d->hysteresis_left, d->floor_streak, (long long)d->growth_total,
                         (long long)d->backoff_total, (int)floor[k]);
        *floors += rc == GPU_ESCALE_FLOOR;
        /* a growth attempt refused at the ceiling */
        *ceilings += !found[k] && cpu.growth_tracker == 0 && cpu.scale == before &&
                     c->mode == GPU_SCALE_DYNAMIC;
    }
    ck_assert(memcmp(&dev, &cpu, sizeof(cpu)) == 0);
    free(found);
    free(floor);
    free(trace);
}

START_TEST(t_scaler)
{
    if (!have_device())
        return;
    static const gpu_scale_mode modes[3] = {GPU_SCALE_NONE, GPU_SCALE_STATIC,
                                            GPU_SCALE_DYNAMIC};
    for (int which = 0; which < 4; which++) {
        int floors = 0, ceilings = 0;
        for (int mi = 0; mi < 3; mi++)
            for (int h = 0; h < 2; h++) {
                gpu_scaler_config c;
                scaler_config(&c, which);
                c.mode = modes[mi];
                c.hysteresis = h ? 3 : 1;
                ck_assert_int_eq(gpu_scaler_validate(&c, NULL), 0);
                check_scaler_run(&c, 500u + (uint64_t)(which * 10 + mi * 2 + h), &floors,
                                 &ceilings);
            }
        ck_assert_msg(floors > 0 && ceilings > 0, "config %d: %d floor failures, %d ceiling hits",
                      which, floors, ceilings);
    }
    /* zero steps: nothing changes */
    gpu_scaler_config c;
    gpu_scaler_state s, s0;
    gpu_scaler_defaults(&c, GPU_FP16);
    gpu_scaler_init(&s, &c);
    s0 = s;
    ck_assert_int_eq(gpu_cuda_scaler_update_host(&s, &c, NULL, 0, NULL, NULL), 0);
    ck_assert(memcmp(&s, &s0, sizeof(s)) == 0);
}
END_TEST

/* ---- unscale and clip ----------------------------------------------------------------------- */

#define NT 5

/* Scaled gradients: exact multiples of 2^-12 (every square and partial sum exact in double,
 * so any summation order gives the same bits) or values over the whole fp16 range. */
static void fill_grads(float *g, size_t n, bool exact, gpu_rng *r)
{
    for (size_t i = 0; i < n; i++)
        g[i] = exact ? (float)ldexp((double)((int)gpu_rng_below(r, 8193) - 4096), -12)
                     : rand_mag(r, -24.0, 16.0);
}

static void check_clip(float scale, float grad_clip, bool exact, bool with_inf, uint64_t seed)
{
    static const size_t counts[NT] = {0, 1, 1000, BIG, 7};
    size_t off[NT], total = 0;
    for (int t = 0; t < NT; t++) {
        off[t] = total;
        total += counts[t] + 2;           /* gaps no tensor covers */
    }
    float *g = xmalloc(total * 4), *want = xmalloc(total * 4);
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    fill_grads(g, total, exact, &r);
    if (with_inf) {
        g[off[2] + 5] = INFINITY;
        g[off[3] + 77] = NAN;
    }
    memcpy(want, g, total * 4);

    gpu_optim_config c;
    gpu_optim_defaults(&c);
    c.grad_clip = grad_clip;
    gpu_scaler_state s;
    memset(&s, 0, sizeof(s));
    s.scale = scale;
    gpu_grad_stat ws[NT], gs[NT];
    bool wfound, gfound;
    double wss, gss, gnorm;
    float gclip;
    gpu_unscale(want, off, counts, NT, gpu_scaler_inv(&s), ws, &wfound, &wss);
    ck_assert_int_eq(gpu_cuda_clip_host(&c, scale, g, off, counts, NT, gs, &gfound, &gss,
                                        &gnorm, &gclip),
                     0);
    check_bits("unscaled g", want, g, total * 4);
    ck_assert_int_eq(gfound, wfound);
    ck_assert_int_eq(gfound, with_inf);
    for (int t = 0; t < NT; t++) {
        ck_assert(f2u(gs[t].amax) == f2u(ws[t].amax));
        ck_assert(f2u(gs[t].amax_scaled) == f2u(ws[t].amax_scaled));
        ck_assert_int_eq(gs[t].nonfinite, ws[t].nonfinite);
        ck_assert_int_eq(gs[t].zeros, ws[t].zeros);
    }
    if (with_inf) {
        ck_assert(isnan(gnorm));
        ck_assert(gclip == 1.0f);
    } else {
        double wnorm = sqrt(wss);
        float wclip = cpu_clip(&c, wnorm);
        if (exact) {
            ck_assert_msg(gss == wss, "sumsq %a vs %a", gss, wss);
            ck_assert(gnorm == wnorm && f2u(gclip) == f2u(wclip));
        }
        ck_assert_msg(fabs(gss - wss) <= 1e-9 * wss, "sumsq %.17g vs %.17g", gss, wss);
        ck_assert_msg(fabs(gnorm - wnorm) <= 1e-9 * wnorm, "norm %.17g vs %.17g", gnorm,
                      wnorm);
        ck_assert_msg(fabsf(gclip - wclip) <= 1e-6f * wclip, "clip %.9g vs %.9g",
                      (double)gclip, (double)wclip);
        if (grad_clip > 0.0f && wnorm > grad_clip)
            ck_assert(wclip < 1.0f);      /* the clipping branch was exercised */
    }
    free(g);
    free(want);
}

START_TEST(t_clip)
{
    if (!have_device())
        return;
    check_clip(65536.0f, 0.0f, false, false, 1);
    check_clip(65536.0f, 1e-3f, false, false, 2);   /* clipping */
    check_clip(65536.0f, 1e6f, false, false, 3);    /* norm below the threshold */
    check_clip(65536.0f, 1e-3f, false, true, 4);    /* overflow: NaN norm, coefficient 1 */
    check_clip(3.0f, 1e-2f, false, false, 5);       /* inexact multiplier (1/3) */
    check_clip(1.0f, 0.5f, false, false, 6);        /* multiplier 1: no product */
    check_clip(1024.0f, 1e-3f, true, false, 7);     /* exact sums: identical bits */
    check_clip(1.0f, 2.0f, true, false, 8);
    check_clip(0.25f, 1e-3f, false, false, 9);      /* scale below 1 */

    /* no tensors */
    gpu_optim_config c;
    gpu_optim_defaults(&c);
    bool found = true;
    double ss = -1.0, norm = -1.0;
    float clip = -1.0f;
    ck_assert_int_eq(gpu_cuda_clip_host(&c, 2.0f, NULL, NULL, NULL, 0, NULL, &found, &ss,
                                        &norm, &clip),
                     0);
    ck_assert(!found && ss == 0.0 && norm == 0.0 && clip == 1.0f);
}
END_TEST

/* ---- diagnostics --------------------------------------------------------------------------- */

/* Counts from first principles: rounding by gpu_round, flushing by double arithmetic. */
typedef struct {
    uint32_t amax;
    int64_t n, nonzero, flushed, flushed_unscaled, nonfinite;
} brute;

static double half_subnormal(gpu_dtype dt)
{
    return dt == GPU_FP16 ? ldexp(1.0, -25) : dt == GPU_BF16 ? ldexp(1.0, -134) : 0.0;
}

static void brute_count(const float *x, size_t n, gpu_dtype dt, float scale,
                        gpu_cuda_diag_kind kind, brute *b)
{
    double h = half_subnormal(dt);
    bool scaled = scale > 0.0f && isfinite(scale) && dt != GPU_FP32;
    b->n += (int64_t)n;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(x[i]), rd = gpu_round(x[i], dt);
        if (isfinite(a) && f2u(a) > b->amax)
            b->amax = f2u(a);
        if (kind == GPU_CUDA_DIAG_BACKWARD) {
            b->nonfinite += !isfinite(x[i]);
            continue;
        }
        b->nonfinite += !isfinite(rd);
        if (kind == GPU_CUDA_DIAG_FORWARD)
            continue;
        b->nonzero += x[i] != 0.0f || isnan(x[i]);
        b->flushed += x[i] != 0.0f && rd == 0.0f;
        b->flushed_unscaled += scaled && x[i] != 0.0f && (double)a / (double)scale <= h;
    }
}

/* Random bit patterns, gradient-like values, and every threshold of dt +-1 ulp. */
static float *diag_data(size_t n, gpu_dtype dt, float scale, gpu_rng *r)
{
    float *x = xmalloc(n * 4);
    uint32_t edges[] = {0u, 0x80000000u, 1u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                        0xFFC00001u, 0x7F800001u, 0x7F7FFFFFu, 0x33000000u, 0x477FF000u,
                        0x7F7F8000u, 0x00008000u, gpu_diag_flush_bits(dt, scale),
                        gpu_diag_flush_bits(GPU_FP16, scale),
                        gpu_diag_flush_bits(GPU_BF16, scale)};
    size_t ne = sizeof(edges) / sizeof(edges[0]), k = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t b = gpu_rng_next(r);
        uint32_t u;
        if (k < 3 * ne && i % 97 == 0) {   /* each edge, one below and one above */
            uint32_t e = edges[k / 3] & 0x7FFFFFFFu;
            int d = (int)(k % 3) - 1;
            u = (e == 0 && d < 0) ? 0u : e + (uint32_t)d;
            u |= (b & 1) ? 0x80000000u : 0u;
            k++;
        } else if (b % 4 == 0) {
            u = (uint32_t)(b >> 32);       /* any pattern, inf and NaN included */
        } else {
            u = f2u(rand_mag(r, -150.0, 18.0));
        }
        x[i] = u2f(u);
    }
    return x;
}

static void check_layer(const gpu_layer_diag *dev, const gpu_layer_diag *cpu,
                        const brute *bf, const brute *bw, const brute *bi, const brute *bb, int l)
{
    /* the device against the CPU's gpu_diag_* */
    ck_assert_msg(f2u(dev->act_amax) == f2u(cpu->act_amax), "layer %d act_amax", l);
    ck_assert_msg(f2u(dev->grad_amax) == f2u(cpu->grad_amax), "layer %d grad_amax", l);
    ck_assert_int_eq(dev->act_n, cpu->act_n);
    ck_assert_int_eq(dev->act_overflow, cpu->act_overflow);
    ck_assert_int_eq(dev->grad_n, cpu->grad_n);
    ck_assert_int_eq(dev->grad_nonzero, cpu->grad_nonzero);
    ck_assert_int_eq(dev->grad_flushed, cpu->grad_flushed);
    ck_assert_int_eq(dev->grad_flushed_unscaled, cpu->grad_flushed_unscaled);
    ck_assert_int_eq(dev->grad_nonfinite, cpu->grad_nonfinite);
    ck_assert_int_eq(dev->in_n, cpu->in_n);
    ck_assert_int_eq(dev->in_nonzero, cpu->in_nonzero);
    ck_assert_int_eq(dev->in_flushed, cpu->in_flushed);
    ck_assert_int_eq(dev->in_flushed_unscaled, cpu->in_flushed_unscaled);
    ck_assert_int_eq(dev->in_nonfinite, cpu->in_nonfinite);
    ck_assert_int_eq(dev->out_nonfinite, cpu->out_nonfinite);
    /* and against the brute-force count */
    ck_assert_msg(f2u(dev->act_amax) == bf->amax, "layer %d act_amax vs brute", l);
    ck_assert_int_eq(dev->act_n, bf->n);
    ck_assert_int_eq(dev->act_overflow, bf->nonfinite);
    ck_assert_msg(f2u(dev->grad_amax) == bw->amax, "layer %d grad_amax vs brute", l);
    ck_assert_int_eq(dev->grad_n, bw->n);
    ck_assert_int_eq(dev->grad_nonzero, bw->nonzero);
    ck_assert_int_eq(dev->grad_flushed, bw->flushed);
    ck_assert_int_eq(dev->grad_flushed_unscaled, bw->flushed_unscaled);
    ck_assert_int_eq(dev->grad_nonfinite, bw->nonfinite);
    ck_assert_int_eq(dev->in_n, bi->n);
    ck_assert_int_eq(dev->in_nonzero, bi->nonzero);
    ck_assert_int_eq(dev->in_flushed, bi->flushed);
    ck_assert_int_eq(dev->in_flushed_unscaled, bi->flushed_unscaled);
    ck_assert_int_eq(dev->in_nonfinite, bi->nonfinite);
    ck_assert_int_eq(dev->out_nonfinite, bb->nonfinite);
}

#define DG_LAYERS 4
#define DG_CALLS 16

/* Layers fp16, bf16, fp32, fp16; every layer gets every kind once (forwards first, then
 * weight, input and arriving gradients) over data of 0 to 2^20+3 elements; with `clean` the
 * first seven calls hold no inf/NaN, so that the first one is found in a gradient. */
static void check_diag(float scale, bool clean, uint64_t seed)
{
    static const gpu_dtype dts[DG_LAYERS] = {GPU_FP16, GPU_BF16, GPU_FP32, GPU_FP16};
    static const size_t sizes[DG_CALLS] = {1000, 65537, 0, 1, BIG, 333, 4096, 1000,
                                           77, 12345, 1, 5000, 70000, 2, 999, BIG};
    gpu_diag *cpu = calloc(1, sizeof(*cpu)), *dev = calloc(1, sizeof(*dev));
    gpu_cuda_diag *out = xmalloc(sizeof(*out));
    gpu_cuda_diag_call calls[DG_CALLS];
    brute b[DG_LAYERS][4];
    gpu_rng r;

    ck_assert_ptr_nonnull(cpu);
    ck_assert_ptr_nonnull(dev);
    gpu_rng_seed(&r, seed);
    memset(b, 0, sizeof(b));
    for (int l = 0; l < DG_LAYERS; l++) {
        char name[16];
        snprintf(name, sizeof(name), "l%d", l);
        ck_assert_int_eq(gpu_diag_layer(cpu, name, dts[l]), l);
        ck_assert_int_eq(gpu_diag_layer(dev, name, dts[l]), l);
    }
    gpu_diag_begin(cpu, scale);
    gpu_diag_begin(dev, scale);
    for (int i = 0; i < DG_CALLS; i++) {
        int l = i % DG_LAYERS;
        gpu_cuda_diag_kind kind = (gpu_cuda_diag_kind)(i / DG_LAYERS);
        float *x = diag_data(sizes[i], dts[l], scale, &r);
        if (clean && i < 7)
            for (size_t j = 0; j < sizes[i]; j++)
                if (!(fabsf(x[j]) <= 1000.0f))
                    x[j] = 0.5f;
        calls[i] = (gpu_cuda_diag_call){l, kind, x, sizes[i]};
        brute_count(x, sizes[i], dts[l], scale, kind, &b[l][kind]);
        switch (kind) {
        case GPU_CUDA_DIAG_FORWARD:
            gpu_diag_forward(cpu, l, x, sizes[i]);
            break;
        case GPU_CUDA_DIAG_WEIGHT_GRAD:
            gpu_diag_weight_grad(cpu, l, x, sizes[i]);
            break;
        case GPU_CUDA_DIAG_INPUT_GRAD:
            gpu_diag_input_grad(cpu, l, x, sizes[i]);
            break;
        default:
            gpu_diag_backward(cpu, l, x, sizes[i]);
            break;
        }
    }
    ck_assert_int_eq(gpu_cuda_diag_host(dts, DG_LAYERS, scale, calls, DG_CALLS, out), 0);
    ck_assert(out->scale == scale);
    for (int d = 0; d < 3; d++)
        ck_assert_uint_eq(out->flush_scaled[d], gpu_diag_flush_bits((gpu_dtype)d, scale));
    gpu_cuda_diag_export(out, dev);
    ck_assert(dev->scale == scale);
    ck_assert_int_eq(dev->first_nonfinite, cpu->first_nonfinite);
    ck_assert_int_eq(dev->first_in_forward, cpu->first_in_forward);
    if (clean)
        ck_assert(cpu->first_nonfinite >= 0 && !cpu->first_in_forward);
    for (int l = 0; l < DG_LAYERS; l++) {
        check_layer(&dev->layer[l], &cpu->layer[l], &b[l][GPU_CUDA_DIAG_FORWARD],
                    &b[l][GPU_CUDA_DIAG_WEIGHT_GRAD], &b[l][GPU_CUDA_DIAG_INPUT_GRAD],
                    &b[l][GPU_CUDA_DIAG_BACKWARD], l);
        ck_assert_str_eq(dev->layer[l].name, cpu->layer[l].name);
    }
    for (int i = 0; i < DG_CALLS; i++)
        free((void *)calls[i].x);
    free(out);
    free(cpu);
    free(dev);
}

START_TEST(t_diag)
{
    if (!have_device())
        return;
    check_diag(65536.0f, false, 11);
    check_diag(65536.0f, true, 12);
    check_diag(1.0f, false, 13);
    check_diag(3.0f, false, 14);
    check_diag(0.25f, true, 15);
    check_diag(ldexpf(1.0f, 100), false, 16);   /* thresholds far from the dtype's */

    /* a layer out of the table is ignored; an empty collection is all zeros */
    gpu_dtype dt = GPU_FP16;
    float x[2] = {INFINITY, 1e-30f};
    gpu_cuda_diag_call calls[2] = {{-1, GPU_CUDA_DIAG_FORWARD, x, 2},
                                   {5, GPU_CUDA_DIAG_WEIGHT_GRAD, x, 2}};
    gpu_cuda_diag *out = xmalloc(sizeof(*out));
    ck_assert_int_eq(gpu_cuda_diag_host(&dt, 1, 2.0f, calls, 2, out), 0);
    ck_assert_int_eq(out->first, -1);
    ck_assert_uint_eq(out->layer[0].act_n, 0);
    ck_assert_uint_eq(out->layer[0].grad_n, 0);
    free(out);
}
END_TEST

/* ---- five step tails --------------------------------------------------------------------- */

#define TAIL_STEPS 5
#define TAIL_NT 4

typedef struct {
    gpu_opt_type type;
    gpu_dtype wdt;
    bool master, work;
    gpu_scale_mode mode;
    int hysteresis;
    float grad_clip;
} tail_case;

/* train.c's step after backward, on the CPU: unscale, skip or clip and update, scaler. */
static void cpu_tail(const gpu_optim_config *oc, const gpu_scaler_config *sc,
                     gpu_scaler_state *s, int64_t *applied, const float *lr, const float *grads,
                     gpu_cuda_tail_bufs *b, gpu_cuda_step_state *trace, gpu_grad_stat *stats,
                     int64_t *tlost)
{
    float *g = xmalloc(b->n * 4);
    size_t es = gpu_dtype_size(b->wdt);
    for (int k = 0; k < TAIL_STEPS; k++) {
        gpu_cuda_step_state *t = &trace[k];
        bool found;
        double sumsq;
        memset(t, 0, sizeof(*t));
        memcpy(g, grads + (size_t)k * b->n, b->n * 4);
        t->scale_used = s->scale;
        gpu_unscale(g, b->offsets, b->counts, b->ntensors, gpu_scaler_inv(s),
                    stats + (size_t)k * TAIL_NT, &found, &sumsq);
        t->found_inf = found;
        t->sumsq = sumsq;
        t->grad_norm = found ? NAN : sqrt(sumsq);
        t->clip = cpu_clip(oc, t->grad_norm);
        for (int i = 0; i < TAIL_NT; i++)
            tlost[k * TAIL_NT + i] = 0;
        if (!found) {
            ++*applied;
            if (b->master) {
                gpu_optim_update(oc, lr[k], *applied, t->clip, b->master, g, b->m, b->v, b->n,
                                 b->work, b->wdt);
            } else {
                for (int i = 0; i < TAIL_NT; i++) {
                    size_t off = b->offsets[i];
                    gpu_optim_update_lowp(oc, lr[k], *applied, t->clip,
                                          (uint8_t *)b->work + off * es, b->wdt, g + off,
                                          b->m + off, b->v ? b->v + off : NULL, b->counts[i],
                                          &tlost[k * TAIL_NT + i]);
                    t->lost_step += (unsigned long long)tlost[k * TAIL_NT + i];
                }
            }
        }
        t->applied = *applied;
        t->floor_failed = gpu_scaler_update(s, sc, found) == GPU_ESCALE_FLOOR;
        t->scaler = *s;
    }
    free(g);
}

static void check_tail(const tail_case *tc, uint64_t seed)
{
    static const size_t counts[TAIL_NT] = {1000, 1, 65541, 37};
    size_t offsets[TAIL_NT], n = 0;
    for (int i = 0; i < TAIL_NT; i++) {
        offsets[i] = n;
        n += counts[i];
    }
    gpu_optim_config oc;
    gpu_scaler_config sc;
    gpu_optim_defaults(&oc);
    oc.type = tc->type;
    oc.grad_clip = tc->grad_clip;
    oc.weight_decay = 0.01f;
    oc.warmup_steps = 2;
    oc.schedule = GPU_SCHED_COSINE;
    if (tc->type == GPU_OPT_SGD)
        oc.lr = 0.05f;
    gpu_scaler_defaults(&sc, GPU_FP16);
    sc.mode = tc->mode;
    sc.hysteresis = tc->hysteresis;
    sc.init_scale = 1024.0f;
    sc.growth_interval = 2;

    gpu_rng r;
    gpu_rng_seed(&r, seed);
    float lr[TAIL_STEPS];
    float *grads = xmalloc(TAIL_STEPS * n * 4);
    for (int k = 0; k < TAIL_STEPS; k++)
        lr[k] = gpu_lr_at(&oc, k, TAIL_STEPS);
    fill_grads(grads, TAIL_STEPS * n, true, &r);
    grads[2 * n + offsets[2] + 100] = INFINITY;   /* step 3 overflows and is skipped */

    /* initial buffers: master (or lowp weights), working copy, m, v */
    bool adamw = tc->type == GPU_OPT_ADAMW;
    size_t es = gpu_dtype_size(tc->wdt);
    float *p0 = xmalloc(n * 4), *m0 = xmalloc(n * 4), *v0 = adamw ? xmalloc(n * 4) : NULL;
    void *w0 = xmalloc(n * es);
    for (size_t i = 0; i < n; i++) {
        p0[i] = gpu_round(0.5f * gpu_rng_normal(&r), tc->wdt);
        m0[i] = 0.0f;
        if (v0)
            v0[i] = 0.0f;
    }
    gpu_cvt_from_f32(w0, tc->wdt, p0, n);
    gpu_cuda_tail_bufs cb = {n, TAIL_NT, offsets, counts, tc->master ? xdup(p0, n * 4) : NULL,
                             tc->work ? xdup(w0, n * es) : NULL, tc->wdt, xdup(m0, n * 4),
                             v0 ? xdup(v0, n * 4) : NULL};
    gpu_cuda_tail_bufs db = cb;
    db.master = cb.master ? xdup(p0, n * 4) : NULL;
    db.work = cb.work ? xdup(w0, n * es) : NULL;
    db.m = xdup(m0, n * 4);
    db.v = v0 ? xdup(v0, n * 4) : NULL;

    gpu_scaler_state cs, ds;
    gpu_scaler_init(&cs, &sc);
    ds = cs;
    int64_t capplied = 0, dapplied = 0;
    gpu_cuda_step_state ct[TAIL_STEPS], dt[TAIL_STEPS];
    gpu_grad_stat cst[TAIL_STEPS * TAIL_NT], dst[TAIL_STEPS * TAIL_NT];
    int64_t clost[TAIL_STEPS * TAIL_NT], dlost[TAIL_STEPS * TAIL_NT];

    cpu_tail(&oc, &sc, &cs, &capplied, lr, grads, &cb, ct, cst, clost);
    ck_assert_int_eq(gpu_cuda_step_tail_host(&oc, &sc, &ds, &dapplied, TAIL_STEPS, lr, grads,
                                             &db, dt, dst, dlost),
                     0);

    for (int k = 0; k < TAIL_STEPS; k++) {
        const gpu_cuda_step_state *c = &ct[k], *d = &dt[k];
        ck_assert_msg(d->found_inf == c->found_inf, "step %d found_inf", k);
        ck_assert_msg(f2u(d->scale_used) == f2u(c->scale_used), "step %d scale", k);
        ck_assert_msg(memcmp(&d->scaler, &c->scaler, sizeof(c->scaler)) == 0,
                      "step %d scaler: device %g, cpu %g", k, (double)d->scaler.scale,
                      (double)c->scaler.scale);
        ck_assert_int_eq(d->floor_failed, c->floor_failed);
        ck_assert_int_eq(d->applied, c->applied);
        if (c->found_inf) {
            ck_assert(isnan(d->grad_norm) && d->clip == 1.0f);
        } else {
            ck_assert_msg(d->sumsq == c->sumsq, "step %d sumsq %a vs %a", k, d->sumsq,
                          c->sumsq);
            ck_assert(d->grad_norm == c->grad_norm);
            ck_assert(f2u(d->clip) == f2u(c->clip));
        }
        ck_assert_uint_eq(d->lost_step, c->lost_step);
        for (int i = 0; i < TAIL_NT; i++) {
            int j = k * TAIL_NT + i;
            ck_assert(f2u(dst[j].amax) == f2u(cst[j].amax));
            ck_assert(f2u(dst[j].amax_scaled) == f2u(cst[j].amax_scaled));
            ck_assert_int_eq(dst[j].nonfinite, cst[j].nonfinite);
            ck_assert_int_eq(dst[j].zeros, cst[j].zeros);
            if (!tc->master)
                ck_assert_int_eq(dlost[j], clost[j]);
        }
    }
    ck_assert(ct[2].found_inf && !ct[1].found_inf);
    ck_assert_int_eq(capplied, TAIL_STEPS - 1);
    ck_assert_int_eq(dapplied, capplied);
    ck_assert(memcmp(&ds, &cs, sizeof(cs)) == 0);
    if (tc->grad_clip > 0.0f)
        ck_assert(ct[0].clip < 1.0f);         /* the clip coefficient mattered */
    if (tc->master) {
        check_ulps("master", cb.master, db.master, n, 1);
        if (tc->work) {
            void *want = xmalloc(n * es);
            gpu_cvt_from_f32(want, tc->wdt, db.master, n);
            check_bits("work", want, db.work, n * es);
            free(want);
        }
        check_ulps("m", cb.m, db.m, n, 1);
        if (adamw)
            check_ulps("v", cb.v, db.v, n, 1);
    } else {
        check_bits("lowp w", cb.work, db.work, n * es);
        check_bits("m", cb.m, db.m, n * 4);
        if (adamw)
            check_bits("v", cb.v, db.v, n * 4);
    }
    free(cb.master);
    free(cb.work);
    free(cb.m);
    free(cb.v);
    free(db.master);
    free(db.work);
    free(db.m);
    free(db.v);
    free(p0);
    free(m0);
    free(v0);
    free(w0);
    free(grads);
}

START_TEST(t_tail)
{
    if (!have_device())
        return;
    static const tail_case cases[] = {
        {GPU_OPT_ADAMW, GPU_FP16, true, true, GPU_SCALE_DYNAMIC, 1, 0.01f},
        {GPU_OPT_SGD, GPU_BF16, true, true, GPU_SCALE_DYNAMIC, 2, 0.0f},
        {GPU_OPT_ADAMW, GPU_FP16, false, true, GPU_SCALE_DYNAMIC, 1, 0.01f},
        {GPU_OPT_SGD, GPU_BF16, false, true, GPU_SCALE_STATIC, 1, 0.01f},
        {GPU_OPT_ADAMW, GPU_FP32, true, false, GPU_SCALE_NONE, 1, 0.0f},
        {GPU_OPT_ADAMW, GPU_BF16, true, true, GPU_SCALE_NONE, 1, 0.5f},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check_tail(&cases[i], 900u + (uint64_t)i);
}
END_TEST

static Suite *cuda_step_suite(void)
{
    Suite *s = suite_create("cuda_step");
    TCase *tc = tcase_create("cuda_step");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, t_nodev);
    tcase_add_test(tc, t_adamw);
    tcase_add_test(tc, t_sgd);
    tcase_add_test(tc, t_skip);
    tcase_add_test(tc, t_lowp);
    tcase_add_test(tc, t_scaler);
    tcase_add_test(tc, t_clip);
    tcase_add_test(tc, t_diag);
    tcase_add_test(tc, t_tail);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return cudatest_main("check_cuda_step", cuda_step_suite());
}
