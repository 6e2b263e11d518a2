/*
 * check_scaler.c - the loss scaler: configuration checks, the per-step update against an
 * independent reference model of PyTorch's _amp_update_scale_ plus
 * DeepSpeed/Megatron hysteresis and the floor/ceiling extensions, and the fused unscale
 * pass against a long-double reference on every kernel path the CPU has (one it lacks: a
 * SKIP line per case), and against itself on 1, 2 and 3 OpenMP threads (the same bits, sum
 * of squares included).
 *
 * Threads: Check forks one child per test; nothing is shared. The thread-count test sets the
 * OpenMP thread count of its child.
 */
#include <check.h>
#include <float.h>
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

/* ---- helpers ------------------------------------------------------------------------- */

static uint32_t fbits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static float bitsf(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

static gpu_scaler_config dyn_config(float init, int interval)
{
    gpu_scaler_config c;
    gpu_scaler_defaults(&c, GPU_FP16);
    c.init_scale = init;
    c.growth_interval = interval;
    return c;
}

/*
 * Reference model, written from the rules rather than from scaler.c: the scale is kept as
 * a double holding an fp32 value; every product is formed in double and rounded to float.
 * Returns 1 when the job should fail at the floor.
 */
typedef struct {
    double scale;
    int tracker, hyst, streak;
    long steps, overflows, skips, growths, backoffs;
} ref_scaler;

static void ref_init(ref_scaler *r, const gpu_scaler_config *c)
{
    memset(r, 0, sizeof(*r));
    r->scale = c->mode == GPU_SCALE_NONE ? 1.0 : (double)c->init_scale;
    r->hyst = c->hysteresis;
}

static int ref_update(ref_scaler *r, const gpu_scaler_config *c, bool inf)
{
    r->steps++;
    r->overflows += inf;
    r->skips += inf;
    if (c->mode != GPU_SCALE_DYNAMIC)
        return 0;
    if (inf) {
        bool at_floor = r->scale <= (double)c->min_scale;
        r->streak = at_floor ? r->streak + 1 : 0;
        r->tracker = 0;
        r->hyst = r->hyst > 0 ? r->hyst - 1 : 0;
        if (r->hyst == 0) {
            double next = (double)(float)(r->scale * (double)c->backoff_factor);
            if (next < (double)c->min_scale)
                next = (double)c->min_scale;
            if (next < r->scale)
                r->backoffs++;
            r->scale = next;
        }
        return r->streak >= c->floor_patience;
    }
    r->streak = 0;
    r->tracker++;
    if (r->tracker == c->growth_interval) {
        r->tracker = 0;
        r->hyst = c->hysteresis;
        float cand = (float)(r->scale * (double)c->growth_factor);
        if (!isinf(cand) && cand <= c->max_scale) {
            r->scale = (double)cand;
            r->growths++;
        }
    }
    return 0;
}

/* Compares s with r; on a difference writes it into why and returns false. (Check's
 * assertions cost a pipe write each in fork mode, so hot loops test first and assert once.) */
static bool same_state(const gpu_scaler_state *s, const ref_scaler *r, char *why, size_t len)
{
    if (fbits(s->scale) != fbits((float)r->scale))
        snprintf(why, len, "scale %.9g vs %.9g", (double)s->scale, r->scale);
    else if (s->growth_tracker != r->tracker)
        snprintf(why, len, "tracker %d vs %d", s->growth_tracker, r->tracker);
    else if (s->hysteresis_left != r->hyst)
        snprintf(why, len, "hysteresis %d vs %d", s->hysteresis_left, r->hyst);
    else if (s->floor_streak != r->streak)
        snprintf(why, len, "floor streak %d vs %d", s->floor_streak, r->streak);
    else if (s->steps != r->steps || s->overflow_total != r->overflows ||
             s->skipped_total != r->skips || s->growth_total != r->growths ||
             s->backoff_total != r->backoffs)
        snprintf(why, len, "counters %lld/%lld/%lld/%lld/%lld vs %ld/%ld/%ld/%ld/%ld",
                 (long long)s->steps, (long long)s->overflow_total,
                 (long long)s->skipped_total, (long long)s->growth_total,
                 (long long)s->backoff_total, r->steps, r->overflows, r->skips, r->growths,
                 r->backoffs);
    else
        return true;
    return false;
}

/* ---- configuration ------------------------------------------------------------------- */

START_TEST(test_defaults)
{
    gpu_scaler_config c;
    const char *field = "x";

    gpu_scaler_defaults(&c, GPU_FP16);
    ck_assert_int_eq(c.mode, GPU_SCALE_DYNAMIC);
    ck_assert(c.init_scale == 65536.0f && c.growth_factor == 2.0f);
    ck_assert(c.backoff_factor == 0.5f && c.growth_interval == 2000);
    ck_assert(c.hysteresis == 1 && c.min_scale == 1.0f && c.max_scale == 16777216.0f);
    ck_assert_int_eq(c.floor_patience, 50);
    ck_assert_int_eq(gpu_scaler_validate(&c, &field), 0);
    ck_assert_ptr_null(field);

    gpu_scaler_defaults(&c, GPU_BF16);
    ck_assert_int_eq(c.mode, GPU_SCALE_NONE);
    ck_assert_int_eq(gpu_scaler_validate(&c, NULL), 0);
    gpu_scaler_defaults(&c, GPU_FP32);
    ck_assert_int_eq(c.mode, GPU_SCALE_NONE);
    ck_assert_int_eq(gpu_scaler_validate(&c, NULL), 0);
}
END_TEST

typedef struct {
    const char *field;
    void (*mutate)(gpu_scaler_config *c);
} bad_case;

static void bad_init_nan(gpu_scaler_config *c) { c->init_scale = NAN; }
static void bad_init_zero(gpu_scaler_config *c) { c->init_scale = 0.0f; }
static void bad_init_above(gpu_scaler_config *c) { c->init_scale = 2.0f * c->max_scale; }
static void bad_init_below(gpu_scaler_config *c) { c->init_scale = 0.5f; }
static void bad_growth_one(gpu_scaler_config *c) { c->growth_factor = 1.0f; }
static void bad_growth_inf(gpu_scaler_config *c) { c->growth_factor = INFINITY; }
static void bad_backoff_one(gpu_scaler_config *c) { c->backoff_factor = 1.0f; }
static void bad_backoff_zero(gpu_scaler_config *c) { c->backoff_factor = 0.0f; }
static void bad_backoff_nan(gpu_scaler_config *c) { c->backoff_factor = NAN; }
static void bad_interval(gpu_scaler_config *c) { c->growth_interval = 0; }
static void bad_hysteresis(gpu_scaler_config *c) { c->hysteresis = 0; }
static void bad_min_zero(gpu_scaler_config *c) { c->min_scale = 0.0f; }
static void bad_min_inf(gpu_scaler_config *c) { c->min_scale = INFINITY; }
static void bad_max_below(gpu_scaler_config *c) { c->max_scale = 0.5f; }
static void bad_max_inf(gpu_scaler_config *c) { c->max_scale = INFINITY; }
static void bad_patience(gpu_scaler_config *c) { c->floor_patience = 0; }
static void bad_mode(gpu_scaler_config *c) { c->mode = (gpu_scale_mode)7; }

static const bad_case bad_cases[] = {
    {"precision.loss_scale.init", bad_init_nan},
    {"precision.loss_scale.init", bad_init_zero},
    {"precision.loss_scale.init", bad_init_above},
    {"precision.loss_scale.init", bad_init_below},
    {"precision.loss_scale.growth_factor", bad_growth_one},
    {"precision.loss_scale.growth_factor", bad_growth_inf},
    {"precision.loss_scale.backoff_factor", bad_backoff_one},
    {"precision.loss_scale.backoff_factor", bad_backoff_zero},
    {"precision.loss_scale.backoff_factor", bad_backoff_nan},
    {"precision.loss_scale.growth_interval", bad_interval},
    {"precision.loss_scale.hysteresis", bad_hysteresis},
    {"precision.loss_scale.min_scale", bad_min_zero},
    {"precision.loss_scale.min_scale", bad_min_inf},
    {"precision.loss_scale.max_scale", bad_max_below},
    {"precision.loss_scale.max_scale", bad_max_inf},
    {"precision.loss_scale.floor_patience", bad_patience},
    {"precision.loss_scale.mode", bad_mode},
};

START_TEST(test_validate_names_field)
{
    const bad_case *bc = &bad_cases[_i];
    gpu_scaler_config c;
    const char *field = NULL;

    gpu_scaler_defaults(&c, GPU_FP16);
    bc->mutate(&c);
    ck_assert_int_eq(gpu_scaler_validate(&c, &field), GPU_EINVAL);
    ck_assert_ptr_nonnull(field);
    ck_assert_str_eq(field, bc->field);
}
END_TEST

START_TEST(test_validate_static)
{
    /* A static scale only needs to be finite and positive: it may lie outside [min, max]. */
    gpu_scaler_config c;
    const char *field = NULL;
    gpu_scaler_defaults(&c, GPU_FP16);
    c.mode = GPU_SCALE_STATIC;
    c.init_scale = 0.25f;
    ck_assert_int_eq(gpu_scaler_validate(&c, &field), 0);
    c.init_scale = -1.0f;
    ck_assert_int_eq(gpu_scaler_validate(&c, &field), GPU_EINVAL);
    ck_assert_str_eq(field, "precision.loss_scale.init");
}
END_TEST

START_TEST(test_inv)
{
    gpu_scaler_config c = dyn_config(65536.0f, 2000);
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    ck_assert(s.scale == 65536.0f);
    ck_assert_uint_eq(fbits(gpu_scaler_inv(&s)), fbits(1.0f / 65536.0f));
    ck_assert_uint_eq(fbits(gpu_scaler_inv(&s)), 0x37800000u);
    s.scale = 3.0f;
    ck_assert_uint_eq(fbits(gpu_scaler_inv(&s)), fbits((float)(1.0 / 3.0)));
    s.scale = 1.0f;
    ck_assert(gpu_scaler_inv(&s) == 1.0f);

    gpu_scaler_defaults(&c, GPU_BF16);
    c.init_scale = 1024.0f; /* ignored by mode none */
    gpu_scaler_init(&s, &c);
    ck_assert(s.scale == 1.0f && gpu_scaler_inv(&s) == 1.0f);
}
END_TEST

/* ---- trajectories -------------------------------------------------------------------- */

START_TEST(test_backoff)
{
    gpu_scaler_config c = dyn_config(65536.0f, 2000);
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(gpu_scaler_update(&s, &c, false), 0);
    ck_assert_int_eq(s.growth_tracker, 5);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), 0);
    ck_assert(s.scale == 32768.0f);
    ck_assert_int_eq(s.growth_tracker, 0);
    ck_assert_int_eq(s.overflow_total, 1);
    ck_assert_int_eq(s.skipped_total, 1);
    ck_assert_int_eq(s.backoff_total, 1);
    ck_assert_int_eq(s.steps, 6);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), 0);
    ck_assert(s.scale == 16384.0f);
    ck_assert_int_eq(s.backoff_total, 2);
}
END_TEST

START_TEST(test_growth_at_interval)
{
    gpu_scaler_config c = dyn_config(1024.0f, 3);
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    gpu_scaler_update(&s, &c, false);
    gpu_scaler_update(&s, &c, false);
    ck_assert(s.scale == 1024.0f); /* not after the 2nd clean step */
    ck_assert_int_eq(s.growth_tracker, 2);
    gpu_scaler_update(&s, &c, false);
    ck_assert(s.scale == 2048.0f); /* exactly at the 3rd */
    ck_assert_int_eq(s.growth_tracker, 0);
    ck_assert_int_eq(s.growth_total, 1);
    ck_assert_int_eq(s.skipped_total, 0);
}
END_TEST

START_TEST(test_overflow_resets_count)
{
    gpu_scaler_config c = dyn_config(1024.0f, 3);
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    gpu_scaler_update(&s, &c, false);
    gpu_scaler_update(&s, &c, false);
    gpu_scaler_update(&s, &c, true);
    ck_assert(s.scale == 512.0f);
    gpu_scaler_update(&s, &c, false);
    gpu_scaler_update(&s, &c, false);
    ck_assert(s.scale == 512.0f);
    ck_assert_int_eq(s.growth_tracker, 2);
    gpu_scaler_update(&s, &c, false);
    ck_assert(s.scale == 1024.0f);
    ck_assert_int_eq(s.growth_tracker, 0);
}
END_TEST

START_TEST(test_growth_refused)
{
    /* PyTorch #98876: a growth that would overflow fp32 is refused, the tracker resets. */
    gpu_scaler_config c = dyn_config(0x1p127f, 2);
    c.max_scale = FLT_MAX;
    ck_assert_int_eq(gpu_scaler_validate(&c, NULL), 0);
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    gpu_scaler_update(&s, &c, false);
    ck_assert_int_eq(s.growth_tracker, 1);
    gpu_scaler_update(&s, &c, false);
    ck_assert(s.scale == 0x1p127f);
    ck_assert_int_eq(s.growth_tracker, 0);
    ck_assert_int_eq(s.growth_total, 0);

    /* The ceiling: 2^23 may grow to 2^24 = max_scale, not beyond. */
    c = dyn_config(0x1p23f, 1);
    gpu_scaler_init(&s, &c);
    gpu_scaler_update(&s, &c, false);
    ck_assert(s.scale == 0x1p24f);
    gpu_scaler_update(&s, &c, false);
    ck_assert(s.scale == 0x1p24f);
    ck_assert_int_eq(s.growth_tracker, 0);
    ck_assert_int_eq(s.growth_total, 1);
}
END_TEST

START_TEST(test_hysteresis)
{
    gpu_scaler_config c = dyn_config(1024.0f, 2);
    c.hysteresis = 2;
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    ck_assert_int_eq(s.hysteresis_left, 2);
    gpu_scaler_update(&s, &c, true); /* absorbed */
    ck_assert(s.scale == 1024.0f);
    ck_assert_int_eq(s.hysteresis_left, 1);
    ck_assert_int_eq(s.skipped_total, 1);
    ck_assert_int_eq(s.growth_tracker, 0);
    gpu_scaler_update(&s, &c, true); /* backs off */
    ck_assert(s.scale == 512.0f);
    gpu_scaler_update(&s, &c, true); /* and again: not refilled by a backoff */
    ck_assert(s.scale == 256.0f);
    gpu_scaler_update(&s, &c, false);
    ck_assert_int_eq(s.hysteresis_left, 0); /* a clean step alone does not refill */
    gpu_scaler_update(&s, &c, false);       /* growth refills */
    ck_assert(s.scale == 512.0f);
    ck_assert_int_eq(s.hysteresis_left, 2);
    gpu_scaler_update(&s, &c, true); /* absorbed again */
    ck_assert(s.scale == 512.0f);
    ck_assert_int_eq(s.backoff_total, 2);
    ck_assert_int_eq(s.overflow_total, 4);
}
END_TEST

START_TEST(test_hysteresis_one_is_pytorch)
{
    /* hysteresis 1: every overflow backs off. */
    gpu_scaler_config c = dyn_config(1024.0f, 10);
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    float expect = 1024.0f;
    for (int i = 0; i < 5; i++) {
        gpu_scaler_update(&s, &c, true);
        expect *= 0.5f;
        ck_assert(s.scale == expect);
    }
}
END_TEST

START_TEST(test_floor)
{
    gpu_scaler_config c = dyn_config(4.0f, 100);
    c.floor_patience = 3;
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), 0);
    ck_assert(s.scale == 2.0f);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), 0);
    ck_assert(s.scale == 1.0f);
    ck_assert_int_eq(s.floor_streak, 0); /* that step started above the floor */
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), 0);
    ck_assert(s.scale == 1.0f);
    ck_assert_int_eq(s.floor_streak, 1);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, false), 0); /* a clean step resets */
    ck_assert_int_eq(s.floor_streak, 0);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), 0);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), 0);
    ck_assert_int_eq(gpu_scaler_update(&s, &c, true), GPU_ESCALE_FLOOR);
    ck_assert(s.scale == 1.0f);
    ck_assert_int_eq(s.floor_streak, 3);
    ck_assert_int_eq(s.backoff_total, 2); /* overflows at the floor do not lower it */
    /* The state stays usable: a clean step clears the streak. */
    ck_assert_int_eq(gpu_scaler_update(&s, &c, false), 0);
    ck_assert_int_eq(s.floor_streak, 0);

    /* A backoff that would cross the floor is clamped to it. */
    c = dyn_config(3.0f, 100);
    c.min_scale = 2.0f;
    gpu_scaler_init(&s, &c);
    gpu_scaler_update(&s, &c, true);
    ck_assert(s.scale == 2.0f);
    ck_assert_int_eq(s.backoff_total, 1);
}
END_TEST

START_TEST(test_static_and_none)
{
    gpu_scaler_config c = dyn_config(128.0f, 1);
    c.mode = GPU_SCALE_STATIC;
    gpu_scaler_state s;
    gpu_scaler_init(&s, &c);
    for (int i = 0; i < 10; i++)
        ck_assert_int_eq(gpu_scaler_update(&s, &c, i % 3 == 0), 0);
    ck_assert(s.scale == 128.0f);
    ck_assert_int_eq(s.overflow_total, 4);
    ck_assert_int_eq(s.skipped_total, 4);
    ck_assert_int_eq(s.growth_total + s.backoff_total, 0);
    ck_assert_int_eq(s.steps, 10);

    gpu_scaler_defaults(&c, GPU_FP32);
    c.floor_patience = 1;
    gpu_scaler_init(&s, &c);
    for (int i = 0; i < 10; i++)
        ck_assert_int_eq(gpu_scaler_update(&s, &c, i < 4), 0);
    ck_assert(s.scale == 1.0f && gpu_scaler_inv(&s) == 1.0f);
    ck_assert_int_eq(s.overflow_total, 4);
    ck_assert_int_eq(s.skipped_total, 4); /* a non-finite gradient still skips the step */
}
END_TEST

START_TEST(test_save_restore)
{
    gpu_scaler_config c = dyn_config(65536.0f, 7);
    c.hysteresis = 2;
    gpu_rng r;
    gpu_rng_seed(&r, 42);
    gpu_scaler_state a, b;
    gpu_scaler_init(&a, &c);
    for (int i = 0; i < 300; i++)
        gpu_scaler_update(&a, &c, gpu_rng_uniform(&r) < 0.2f);
    b = a; /* what a checkpoint stores */
    int64_t growths = a.growth_total, backoffs = a.backoff_total;
    for (int i = 0; i < 500; i++) {
        bool inf = gpu_rng_uniform(&r) < 0.2f;
        int ra = gpu_scaler_update(&a, &c, inf), rb = gpu_scaler_update(&b, &c, inf);
        if (ra != rb || memcmp(&a, &b, sizeof(a)) != 0)
            ck_abort_msg("step %d after the copy: the trajectories differ", i);
    }
    ck_assert_int_gt(a.growth_total, growths); /* the continuation did change the scale */
    ck_assert_int_gt(a.backoff_total, backoffs);
}
END_TEST

typedef struct {
    float init, min, max;
    int interval, hysteresis, patience;
    float p_inf;
} traj_case;

static const traj_case traj_cases[] = {
    {65536.0f, 1.0f, 16777216.0f, 5, 1, 50, 0.15f},
    {65536.0f, 1.0f, 16777216.0f, 3, 2, 1000000, 0.3f},
    {1024.0f, 0.25f, 65536.0f, 17, 3, 4, 0.6f},
    {0x1p100f, 1e-3f, FLT_MAX, 2, 1, 10, 0.05f},
};

START_TEST(test_random_vs_reference)
{
    const traj_case *tc = &traj_cases[_i];
    gpu_scaler_config c = dyn_config(tc->init, tc->interval);
    c.min_scale = tc->min;
    c.max_scale = tc->max;
    c.hysteresis = tc->hysteresis;
    c.floor_patience = tc->patience;
    c.backoff_factor = _i == 2 ? 0.3 : 0.5; /* a factor that needs rounding */
    ck_assert_int_eq(gpu_scaler_validate(&c, NULL), 0);

    gpu_rng r;
    gpu_rng_seed(&r, 1000 + (uint64_t)_i);
    gpu_scaler_state s;
    ref_scaler ref;
    gpu_scaler_init(&s, &c);
    ref_init(&ref, &c);
    long floors = 0;
    for (long step = 1; step <= 10000; step++) {
        bool inf = gpu_rng_uniform(&r) < tc->p_inf;
        int rc = gpu_scaler_update(&s, &c, inf);
        int want = ref_update(&ref, &c, inf);
        char why[200];
        if (rc != (want ? GPU_ESCALE_FLOOR : 0))
            ck_abort_msg("step %ld: returned %d, reference says %d", step, rc, want);
        if (!same_state(&s, &ref, why, sizeof(why)))
            ck_abort_msg("step %ld: %s", step, why);
        floors += want;
    }
    /* the cases exercise what they are meant to */
    ck_assert_int_gt(s.backoff_total, 0);
    if (_i != 2)
        ck_assert_int_gt(s.growth_total, 0);
    if (_i == 2)
        ck_assert_int_gt(floors, 0);
}
END_TEST

/* PyTorch's rule (GradScaler's _amp_update_scale_: a float scale times a double factor,
 * rounded once) written out by tests/data/torch_optim.py, with factors such as 3.0 / 0.3
 * that float factors would round (a backoff of 0.3 from 3e9 is 900000000 in PyTorch,
 * 900000064 with a float 0.3), and a growth that would overflow and is refused: ampd's
 * scaler, without floor or ceiling in the way, follows it bit for bit. */
START_TEST(test_torch_trajectory)
{
    torchref ref;
    int bad;
    if (torchref_load(&ref, &bad))
        ck_abort_msg("tests/data/torch_optim.txt: unreadable (line %d)", bad);
    ck_assert_int_ge(ref.nscaler, 3);
    for (int k = 0; k < ref.nscaler; k++) {
        const torchref_scaler *r = &ref.scaler[k];
        gpu_scaler_config c = dyn_config((float)r->init, r->interval);
        c.growth_factor = r->growth;
        c.backoff_factor = r->backoff;
        c.min_scale = FLT_MIN;
        c.max_scale = FLT_MAX;
        ck_assert_int_eq(gpu_scaler_validate(&c, NULL), 0);
        gpu_scaler_state s;
        gpu_scaler_init(&s, &c);
        for (int t = 1; t <= r->steps; t++) {
            ck_assert_int_eq(gpu_scaler_update(&s, &c, r->found_inf[t - 1]), 0);
            if (fbits(s.scale) != r->scale[t - 1] || s.growth_tracker != r->tracker[t - 1])
                ck_abort_msg("case %d step %d: scale %.9g tracker %d, PyTorch %.9g tracker %d",
                             k, t, (double)s.scale, s.growth_tracker,
                             (double)torchref_float(r->scale[t - 1]), r->tracker[t - 1]);
        }
    }
    torchref_free(&ref);
}
END_TEST

/* ---- the fused unscale pass ---------------------------------------------------------- */

static const char *const impls[] = {"portable", "avx512"};

/* Forces the unscale kernel path impl for the case fn; false, with the case's SKIP line,
 * when the CPU lacks it. */
static bool use_impl(const char *fn, const char *impl)
{
    int rc = gpu_unscale_force(impl);
    if (rc == GPU_ENODEV) {
        test_skip(fn, impl, "this CPU lacks AVX-512F");
        return false;
    }
    ck_assert_int_eq(rc, 0);
    ck_assert_str_eq(gpu_unscale_impl(), impl);
    return true;
}

static float special_value(gpu_rng *r)
{
    switch (gpu_rng_below(r, 12)) {
    case 0:
        return 0.0f;
    case 1:
        return -0.0f;
    case 2:
        return bitsf(1u + gpu_rng_below(r, 0x7FFFFF)); /* subnormal */
    case 3:
        return bitsf(0x80000000u | (1u + gpu_rng_below(r, 0x7FFFFF)));
    case 4:
        return gpu_rng_normal(r) * 3e38f;
    case 5:
        return bitsf((uint32_t)gpu_rng_next(r)); /* any pattern, NaN and inf included */
    default:
        return gpu_rng_normal(r) * ldexpf(1.0f, (int)gpu_rng_below(r, 60) - 30);
    }
}

typedef struct {
    size_t offsets[8], counts[8];
    int ntensors;
    size_t total;
} layout;

static void make_layout(layout *l, gpu_rng *r)
{
    static const size_t sizes[] = {0, 1, 15, 16, 17, 33, 1000, 4099};
    l->ntensors = 8;
    l->total = 0;
    for (int k = 0; k < 8; k++) {
        size_t n = sizes[(k + gpu_rng_below(r, 8)) % 8];
        if (k == 3)
            n = 0; /* always at least one empty tensor in the middle */
        l->offsets[k] = l->total;
        l->counts[k] = n;
        l->total += n + gpu_rng_below(r, 3); /* gaps between tensors stay untouched */
    }
}

typedef struct {
    gpu_grad_stat stats[8];
    bool found_inf;
    long double sumsq;
} ref_result;

static void ref_unscale(const float *in, float *out, const layout *l, float inv, ref_result *res)
{
    memcpy(out, in, l->total * sizeof(float));
    res->found_inf = false;
    res->sumsq = 0.0L;
    for (int k = 0; k < l->ntensors; k++) {
        gpu_grad_stat *st = &res->stats[k];
        memset(st, 0, sizeof(*st));
        for (size_t i = l->offsets[k]; i < l->offsets[k] + l->counts[k]; i++) {
            double x = in[i];
            if (isnan(x) || isinf(x)) {
                st->nonfinite++;
                res->found_inf = true;
                continue;
            }
            float y = inv == 1.0f ? in[i] : (float)(x * (double)inv);
            out[i] = y;
            if (fabs(x) > st->amax_scaled)
                st->amax_scaled = (float)fabs(x);
            if (fabsf(y) > st->amax)
                st->amax = fabsf(y);
            st->zeros += y == 0.0f;
            res->sumsq += (long double)y * y;
        }
    }
}

static void check_against_ref(const float *in, const layout *l, float inv, const char *what)
{
    float *got = malloc(l->total * sizeof(float) + 1);
    float *want = malloc(l->total * sizeof(float) + 1);
    ck_assert(got && want);
    memcpy(got, in, l->total * sizeof(float));
    ref_result ref;
    ref_unscale(in, want, l, inv, &ref);

    gpu_grad_stat stats[8];
    bool found = !ref.found_inf;
    double sumsq = -1.0;
    gpu_unscale(got, l->offsets, l->counts, l->ntensors, inv, stats, &found, &sumsq);
    for (size_t i = 0; i < l->total; i++)
        if (fbits(got[i]) != fbits(want[i]))
            ck_abort_msg("%s inv %g: element %zu: %08x vs %08x", what, (double)inv, i,
                         fbits(got[i]), fbits(want[i]));
    ck_assert_int_eq(found, ref.found_inf);
    for (int k = 0; k < l->ntensors; k++) {
        ck_assert_uint_eq(fbits(stats[k].amax), fbits(ref.stats[k].amax));
        ck_assert_uint_eq(fbits(stats[k].amax_scaled), fbits(ref.stats[k].amax_scaled));
        ck_assert_int_eq(stats[k].nonfinite, ref.stats[k].nonfinite);
        ck_assert_int_eq(stats[k].zeros, ref.stats[k].zeros);
    }
    if (!ref.found_inf && isfinite((double)ref.sumsq)) {
        double want_ss = (double)ref.sumsq;
        ck_assert_msg(fabs(sumsq - want_ss) <= 1e-12 * want_ss, "%s: sumsq %.17g vs %.17g",
                      what, sumsq, want_ss);
    }
    free(got);
    free(want);
}

START_TEST(test_unscale_random)
{
    const char *impl = impls[_i];
    if (!use_impl(__func__, impl))
        return;
    static const float invs[] = {1.0f / 65536.0f, 1.0f, 0.5f, 1.0f / 3.0f, 2.0f, 0x1p-30f};
    gpu_rng r;
    gpu_rng_seed(&r, 7);
    for (int round = 0; round < 24; round++) {
        layout l;
        make_layout(&l, &r);
        float *in = malloc(l.total * sizeof(float) + 1);
        ck_assert_ptr_nonnull(in);
        /* half the rounds are all finite, so that sumsq is checked */
        bool allow_special = round % 2 == 1;
        for (size_t i = 0; i < l.total; i++) {
            float x = allow_special ? special_value(&r)
                                    : gpu_rng_normal(&r) * ldexpf(1.0f, (int)(i % 20) - 5);
            if (!allow_special && i % 97 == 0)
                x = 0.0f;
            in[i] = x;
        }
        check_against_ref(in, &l, invs[round % 6], impl);
        free(in);
    }
}
END_TEST

START_TEST(test_unscale_edges)
{
    const char *impl = impls[_i];
    if (!use_impl(__func__, impl))
        return;
    float g[6] = {3e38f, -3e38f, 1e-45f, -1e-45f, 0.0f, 2.0f};
    size_t off[1] = {0}, cnt[1] = {6};
    gpu_grad_stat st;
    bool found = true;
    double sumsq;
    /* The check is on the scaled value: 3e38 * 0.5 is finite, nothing overflows. */
    gpu_unscale(g, off, cnt, 1, 0.5f, &st, &found, &sumsq);
    ck_assert(!found);
    ck_assert(g[0] == 1.5e38f && g[1] == -1.5e38f);
    ck_assert(st.amax_scaled == 3e38f && st.amax == 1.5e38f);
    /* 1e-45 * 0.5 rounds to 0 (ties to even): a zero, not an overflow */
    ck_assert_int_eq(st.nonfinite, 0);
    ck_assert_int_eq(st.zeros, 3);
    ck_assert(g[5] == 1.0f);

    /* A finite scaled value that becomes 0 after unscaling counts as a zero. */
    float h[2] = {1e-42f, 1.0f};
    size_t cnt2[1] = {2};
    gpu_unscale(h, off, cnt2, 1, 1.0f / 65536.0f, &st, &found, &sumsq);
    ck_assert(!found && h[0] == 0.0f && st.zeros == 1 && st.nonfinite == 0);
    ck_assert(st.amax_scaled == 1.0f && st.amax == 1.0f / 65536.0f);
    ck_assert(sumsq == 0x1p-32);
}
END_TEST

START_TEST(test_unscale_inv_one_keeps_bits)
{
    const char *impl = impls[_i];
    if (!use_impl(__func__, impl))
        return;
    gpu_rng r;
    gpu_rng_seed(&r, 99);
    enum { N = 5000 };
    static float g[N], orig[N];
    for (int i = 0; i < N; i++)
        g[i] = orig[i] = special_value(&r);
    g[10] = orig[10] = bitsf(0x7F800001u); /* a signalling NaN must not be quietened */
    g[11] = orig[11] = -0.0f;
    size_t off[2] = {0, 2000}, cnt[2] = {2000, 3000};
    gpu_grad_stat st[2];
    bool found = false;
    double sumsq;
    gpu_unscale(g, off, cnt, 2, 1.0f, st, &found, &sumsq);
    ck_assert(memcmp(g, orig, sizeof(g)) == 0);
    ck_assert(found);
    ck_assert_int_gt(st[0].nonfinite, 0);
}
END_TEST

START_TEST(test_unscale_per_tensor_flags)
{
    const char *impl = impls[_i];
    if (!use_impl(__func__, impl))
        return;
    enum { N = 300 };
    float g[N];
    for (int i = 0; i < N; i++)
        g[i] = (float)(i % 7) - 3.0f;
    uint32_t nan_bits = 0xFFC12345u; /* a NaN with a payload and the sign set */
    g[150] = bitsf(nan_bits);
    g[151] = INFINITY;
    g[299] = -INFINITY;
    size_t off[3] = {0, 100, 200}, cnt[3] = {100, 100, 100};
    gpu_grad_stat st[3];
    bool found = false;
    gpu_unscale(g, off, cnt, 3, 0.25f, st, &found, NULL);
    ck_assert(found);
    ck_assert_int_eq(st[0].nonfinite, 0);
    ck_assert_int_eq(st[1].nonfinite, 2);
    ck_assert_int_eq(st[2].nonfinite, 1);
    /* non-finite elements are left exactly as they were */
    ck_assert_uint_eq(fbits(g[150]), nan_bits);
    ck_assert(isinf(g[151]) && g[151] > 0 && isinf(g[299]) && g[299] < 0);
    ck_assert(st[0].amax == 0.75f && st[0].amax_scaled == 3.0f);
    ck_assert(g[0] == -0.75f);

    /* all finite: found_inf is cleared, not left as it was; stats may be NULL */
    float h[3] = {1.0f, 2.0f, 2.0f};
    size_t o1[1] = {0}, c1[1] = {3};
    double sumsq = 0.0;
    found = true;
    gpu_unscale(h, o1, c1, 1, 0.5f, NULL, &found, &sumsq);
    ck_assert(!found && sumsq == 2.25);
}
END_TEST

START_TEST(test_unscale_paths_identical)
{
    ck_assert_int_eq(gpu_unscale_force("bogus"), GPU_EINVAL);
    if (!use_impl(__func__, "avx512"))
        return;
    gpu_rng r;
    gpu_rng_seed(&r, 5);
    enum { N = 70001 };
    float *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float));
    ck_assert(a && b);
    for (int i = 0; i < N; i++)
        a[i] = i % 1000 == 0 ? special_value(&r) : gpu_rng_normal(&r) * 1000.0f;
    memcpy(b, a, N * sizeof(float));
    size_t off[4] = {0, 3, 40000, 40000}, cnt[4] = {3, 39990, 0, 30001};
    gpu_grad_stat sa[4], sb[4];
    bool fa, fb;
    double qa, qb;
    ck_assert_int_eq(gpu_unscale_force("avx512"), 0);
    gpu_unscale(a, off, cnt, 4, 1.0f / 1024.0f, sa, &fa, &qa);
    ck_assert_int_eq(gpu_unscale_force("portable"), 0);
    gpu_unscale(b, off, cnt, 4, 1.0f / 1024.0f, sb, &fb, &qb);
    ck_assert(memcmp(a, b, N * sizeof(float)) == 0);
    ck_assert(memcmp(sa, sb, sizeof(sa)) == 0);
    ck_assert(fa == fb);
    ck_assert(memcmp(&qa, &qb, sizeof(qa)) == 0); /* same summation order, same bits */
    free(a);
    free(b);
}
END_TEST

/* ---- the same bits with any number of threads ---------------------------------------- */

static void set_threads(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

enum { BIG_T = 10 };

/* A few million gradients in BIG_T tensors with gaps: an empty tensor, sizes around the
 * 32768-element chunks, and tensors long enough to span more than one parallel region. */
static size_t big_layout(size_t *off, size_t *cnt)
{
    static const size_t sizes[BIG_T] = {1000, 0, 32768, 32769, 1500001, 65, 17, 999999, 1,
                                        600000};
    size_t at = 0;
    for (int k = 0; k < BIG_T; k++) {
        off[k] = at;
        cnt[k] = sizes[k];
        at += sizes[k] + (size_t)(k % 3);
    }
    return at;
}

typedef struct {
    float *g;
    gpu_grad_stat stats[BIG_T];
    bool found;
    double sumsq;
} big_result;

static void big_unscale(const float *in, size_t total, const size_t *off, const size_t *cnt,
                        float inv, int threads, big_result *res)
{
    memcpy(res->g, in, total * sizeof(float));
    set_threads(threads);
    gpu_unscale(res->g, off, cnt, BIG_T, inv, res->stats, &res->found, &res->sumsq);
    set_threads(1);
}

static void big_same(const big_result *a, const big_result *b, size_t total, const char *what)
{
    ck_assert_msg(memcmp(a->g, b->g, total * sizeof(float)) == 0, "%s: gradients", what);
    ck_assert_msg(memcmp(a->stats, b->stats, sizeof(a->stats)) == 0, "%s: stats", what);
    ck_assert_msg(a->found == b->found, "%s: found_inf", what);
    ck_assert_msg(memcmp(&a->sumsq, &b->sumsq, sizeof(double)) == 0, "%s: sumsq %a vs %a",
                  what, a->sumsq, b->sumsq);
}

/* The input of round `special`: finite values over 40 binades with zeros, or with inf/NaN
 * and other special values sprinkled through every tensor. */
static void big_fill(float *in, size_t total, bool special, gpu_rng *r)
{
    for (size_t i = 0; i < total; i++) {
        float x = gpu_rng_normal(r) * ldexpf(1.0f, (int)(i % 40) - 20);
        if (i % 97 == 0)
            x = 0.0f;
        if (special && i % 4099 == 0)
            x = special_value(r);
        in[i] = x;
    }
    if (special)
        in[total - 1 - (size_t)BIG_T] = NAN; /* in the last tensor, past the first region */
}

START_TEST(test_unscale_threads_identical)
{
    const char *impl = impls[_i];
    if (!use_impl(__func__, impl))
        return;
    size_t off[BIG_T], cnt[BIG_T];
    size_t total = big_layout(off, cnt);
    float *in = malloc(total * sizeof(float));
    big_result one, many;
    one.g = malloc(total * sizeof(float));
    many.g = malloc(total * sizeof(float));
    ck_assert(in && one.g && many.g);
    gpu_rng r;
    gpu_rng_seed(&r, 123);
    static const float invs[] = {1.0f / 1024.0f, 1.0f, 3.0f};
    for (int round = 0; round < 4; round++) {
        bool special = round % 2 == 1;
        float inv = invs[round % 3];
        big_fill(in, total, special, &r);
        big_unscale(in, total, off, cnt, inv, 1, &one);
        ck_assert(one.found == special);
        if (!special) {
            long double want = 0.0L;
            for (int k = 0; k < BIG_T; k++)
                for (size_t i = off[k]; i < off[k] + cnt[k]; i++)
                    want += (long double)one.g[i] * one.g[i];
            ck_assert_msg(fabs(one.sumsq - (double)want) <= 1e-12 * (double)want,
                          "sumsq %.17g vs %.17g", one.sumsq, (double)want);
        }
        for (int threads = 2; threads <= 3; threads++) {
            char what[64];
            snprintf(what, sizeof(what), "%s round %d, %d threads", impl, round, threads);
            big_unscale(in, total, off, cnt, inv, threads, &many);
            big_same(&one, &many, total, what);
        }
    }
    free(in);
    free(one.g);
    free(many.g);
}
END_TEST

static Suite *scaler_suite(void)
{
    Suite *s = suite_create("scaler");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, test_defaults);
    tcase_add_loop_test(tc, test_validate_names_field, 0,
                        (int)(sizeof(bad_cases) / sizeof(bad_cases[0])));
    tcase_add_test(tc, test_validate_static);
    tcase_add_test(tc, test_inv);
    suite_add_tcase(s, tc);

    tc = tcase_create("update");
    tcase_add_test(tc, test_backoff);
    tcase_add_test(tc, test_growth_at_interval);
    tcase_add_test(tc, test_overflow_resets_count);
    tcase_add_test(tc, test_growth_refused);
    tcase_add_test(tc, test_hysteresis);
    tcase_add_test(tc, test_hysteresis_one_is_pytorch);
    tcase_add_test(tc, test_floor);
    tcase_add_test(tc, test_static_and_none);
    tcase_add_test(tc, test_save_restore);
    tcase_add_test(tc, test_torch_trajectory);
    tcase_add_loop_test(tc, test_random_vs_reference, 0,
                        (int)(sizeof(traj_cases) / sizeof(traj_cases[0])));
    suite_add_tcase(s, tc);

    tc = tcase_create("unscale");
    tcase_set_timeout(tc, 10);
    tcase_add_loop_test(tc, test_unscale_random, 0, 2);
    tcase_add_loop_test(tc, test_unscale_edges, 0, 2);
    tcase_add_loop_test(tc, test_unscale_inv_one_keeps_bits, 0, 2);
    tcase_add_loop_test(tc, test_unscale_per_tensor_flags, 0, 2);
    tcase_add_test(tc, test_unscale_paths_identical);
    suite_add_tcase(s, tc);

    tc = tcase_create("threads");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, test_unscale_threads_identical, 0, 2);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(scaler_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
