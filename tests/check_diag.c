/*
 * check_diag.c - per-layer AMP diagnostics (gpu/diag.c and its use by mlp.c and train.c):
 *   - the counters against a brute-force computation on random arrays rich in edge values
 *     (max-abs over finite values only, outputs that overflow when rounded to fp16/bf16,
 *     non-zero values flushed to 0 at a loss scale, the unscaled flush threshold of half the
 *     smallest subnormal, inf/NaN), across block and chunk boundaries;
 *   - the first layer to produce inf/NaN and its direction, the statistics and the
 *     recommendations (exact sentences, once per job, again after a factor-of-2 change);
 *   - collecting diagnostics changes no number of the training;
 *   - the seed's three failure stories with the diagnostics naming cause and layer:
 *     (1) fp16 activations beyond 65504 first produced by fc2 in the forward pass, bf16
 *     recommended, the bf16 job clean; (2) fp16 without loss scaling loses nearly all early
 *     gradients to underflow, which dynamic scaling keeps (and still reports what would be
 *     lost without it); (3) fp16 weights without master weights lose most updates.
 */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/diag.h"
#include "gpu/gpu_int.h"
#include "gpu/mlp.h"
#include "tests/testutil.h"

static float bits_f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Values that probe every threshold: random magnitudes from 2^-160 to 2^20 (zeros and fp32
 * subnormals included), both signs, inf, NaN, and the neighbours of each dtype's overflow
 * and flush thresholds and of the scaled flush thresholds for the given scales. */
static void fill(float *x, size_t n, uint64_t seed, const float *scales, int nscales)
{
    gpu_rng r;
    float edges[64];
    int ne = 0;
    const float base[] = {0.0f,      -0.0f,        INFINITY, -INFINITY,
                          NAN,       65504.0f,     65520.0f, bits_f(0x7F7F8000u),
                          FLT_MAX,   FLT_TRUE_MIN, 0x1p-25f, 0x1p-24f,
                          0x1p-134f, 0x1p-133f,    1.0f};
    for (size_t i = 0; i < sizeof(base) / sizeof(base[0]); i++) {
        edges[ne++] = base[i];
        if (isfinite(base[i]) && base[i] != 0.0f) {
            edges[ne++] = nextafterf(base[i], 0.0f);
            edges[ne++] = nextafterf(base[i], INFINITY);
        }
    }
    for (int s = 0; s < nscales && ne + 6 <= 64; s++) {
        float t16 = (float)(0x1p-25 * scales[s]), tb = (float)(0x1p-134 * scales[s]);
        edges[ne++] = t16;
        edges[ne++] = nextafterf(t16, 0.0f);
        edges[ne++] = nextafterf(t16, INFINITY);
        edges[ne++] = tb;
        edges[ne++] = nextafterf(tb, 0.0f);
        edges[ne++] = nextafterf(tb, INFINITY);
    }
    gpu_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++) {
        uint32_t k = gpu_rng_below(&r, 8);
        float v;
        if (k == 0)
            v = edges[gpu_rng_below(&r, (uint32_t)ne)];
        else
            v = ldexpf(1.0f + gpu_rng_uniform(&r), (int)gpu_rng_below(&r, 181) - 160);
        x[i] = gpu_rng_below(&r, 2) ? -v : v;
    }
}

typedef struct {
    double amax;
    int64_t nonzero, flushed, flushed_unscaled, nonfinite;
} brute;

static void brute_force(const float *x, size_t n, gpu_dtype dt, float scale, brute *b)
{
    double h = dt == GPU_FP32 ? 0.0 : 0.5 * (double)gpu_dtype_min_subnormal(dt);
    memset(b, 0, sizeof(*b));
    for (size_t i = 0; i < n; i++) {
        float r = gpu_round(x[i], dt);
        if (isfinite(x[i]) && fabs((double)x[i]) > b->amax)
            b->amax = fabs((double)x[i]);
        b->nonzero += x[i] != 0.0f;
        b->flushed += x[i] != 0.0f && r == 0.0f;
        b->flushed_unscaled += x[i] != 0.0f && fabs((double)x[i]) / (double)scale <= h;
        b->nonfinite += !isfinite(r);
    }
}

static gpu_diag *diag_new(void)
{
    gpu_diag *d = calloc(1, sizeof(*d));
    ck_assert_ptr_nonnull(d);
    return d;
}

START_TEST(test_weight_grad_counts)
{
    static const float scales[] = {1.0f, 65536.0f, 3.0f, 0.5f, 1e-3f, 16777216.0f, 1.7e38f};
    static const gpu_dtype dts[] = {GPU_FP16, GPU_BF16, GPU_FP32};
    size_t n = 200003; /* crosses the 65536-element blocks and the rounding chunks */
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    gpu_diag *d = diag_new();
    ck_assert_ptr_nonnull(x);
    ck_assert_ptr_nonnull(y);
    fill(x, n, 42, scales, 7);
    for (int k = 0; k < 3; k++)
        for (int s = 0; s < 7; s++) {
            brute b;
            int l = gpu_diag_layer(d, "w", dts[k]);
            brute_force(x, n, dts[k], scales[s], &b);
            gpu_diag_begin(d, scales[s]);
            /* uneven pieces, as a model's chunks would be */
            for (size_t off = 0, len = 1; off < n; off += len, len = len * 3 + 7)
                gpu_diag_weight_grad(d, l, x + off, off + len > n ? n - off : len);
            const gpu_layer_diag *ld = &d->layer[l];
            ck_assert_msg(ld->grad_amax == (float)b.amax, "%s S=%g amax %g vs %g",
                          gpu_dtype_name(dts[k]), (double)scales[s], (double)ld->grad_amax, b.amax);
            ck_assert_int_eq(ld->grad_n, (int64_t)n);
            ck_assert_int_eq(ld->grad_nonzero, b.nonzero);
            ck_assert_msg(ld->grad_flushed == b.flushed, "%s S=%g flushed %lld vs %lld",
                          gpu_dtype_name(dts[k]), (double)scales[s], (long long)ld->grad_flushed,
                          (long long)b.flushed);
            ck_assert_msg(ld->grad_flushed_unscaled == b.flushed_unscaled,
                          "%s S=%g unscaled %lld vs %lld", gpu_dtype_name(dts[k]),
                          (double)scales[s], (long long)ld->grad_flushed_unscaled,
                          (long long)b.flushed_unscaled);
            ck_assert_int_eq(ld->grad_nonfinite, b.nonfinite);
            ck_assert(dts[k] == GPU_FP32 || b.flushed > 0);
            /* at scale 1 "would flush without scaling" is "flushes" */
            if (scales[s] == 1.0f)
                ck_assert_int_eq(b.flushed, b.flushed_unscaled);
            /* the input-gradient counters follow the same rules */
            gpu_diag_input_grad(d, l, x, n);
            ck_assert_int_eq(ld->in_nonzero, b.nonzero);
            ck_assert_int_eq(ld->in_flushed, b.flushed);
            ck_assert_int_eq(ld->in_flushed_unscaled, b.flushed_unscaled);
            ck_assert_int_eq(ld->in_nonfinite, b.nonfinite);
            /* round-and-account gives gpu_round_n's values and the same counts */
            memcpy(y, x, n * sizeof(float));
            gpu_diag_begin(d, scales[s]);
            gpu_diag_round_grad(d, l, true, y, n, dts[k]);
            ck_assert_int_eq(ld->grad_flushed, b.flushed);
            ck_assert_int_eq(ld->grad_nonfinite, b.nonfinite);
            for (size_t i = 0; i < n; i++) {
                float r = gpu_round(x[i], dts[k]);
                ck_assert(memcmp(&r, &y[i], 4) == 0 || (isnan(r) && isnan(y[i])));
            }
        }
    free(x);
    free(y);
    free(d);
}
END_TEST

/* The unscaled flush threshold is exactly half the smallest subnormal: that value flushes,
 * the next float above it does not. */
START_TEST(test_flush_thresholds)
{
    static const gpu_dtype dts[] = {GPU_FP16, GPU_BF16};
    gpu_diag *d = diag_new();
    for (int k = 0; k < 2; k++) {
        float h = 0.5f * gpu_dtype_min_subnormal(dts[k]);
        float v[4] = {h, -h, nextafterf(h, INFINITY), nextafterf(h, 0.0f)};
        int l = gpu_diag_layer(d, dts[k] == GPU_FP16 ? "a" : "b", dts[k]);
        ck_assert(gpu_round(h, dts[k]) == 0.0f);
        ck_assert(gpu_round(v[2], dts[k]) != 0.0f);
        gpu_diag_begin(d, 1.0f);
        gpu_diag_weight_grad(d, l, v, 4);
        ck_assert_int_eq(d->layer[l].grad_flushed, 3);
        ck_assert_int_eq(d->layer[l].grad_flushed_unscaled, 3);
        /* at scale 1024 the same values are 1024x the true gradient: none would flush
         * unscaled... */
        gpu_diag_begin(d, 1024.0f);
        gpu_diag_weight_grad(d, l, v, 4);
        ck_assert_int_eq(d->layer[l].grad_flushed, 3);
        ck_assert_int_eq(d->layer[l].grad_flushed_unscaled, 4);
        /* ...and a gradient of 1000 h at scale 1024 flushes only without the scale */
        float w = 1000.0f * h;
        gpu_diag_weight_grad(d, l, &w, 1);
        ck_assert_int_eq(d->layer[l].grad_flushed, 3);
        ck_assert_int_eq(d->layer[l].grad_flushed_unscaled, 5);
        ck_assert_uint_eq(gpu_diag_flush_bits(dts[k], 1.0f),
                          dts[k] == GPU_FP16 ? 0x33000000u : 0x00008000u);
    }
    ck_assert_uint_eq(gpu_diag_flush_bits(GPU_FP32, 1.0f), 0);
    free(d);
}
END_TEST

START_TEST(test_forward_counts)
{
    static const gpu_dtype dts[] = {GPU_FP16, GPU_BF16, GPU_FP32};
    static const float one = 1.0f;
    size_t n = 150001;
    float *x = malloc(n * sizeof(float));
    gpu_diag *d = diag_new();
    ck_assert_ptr_nonnull(x);
    fill(x, n, 7, &one, 1);
    for (size_t i = 0; i < n; i += 3) /* more values near fp16's range */
        x[i] = ldexpf(x[i] == 0.0f ? 1.0f : copysignf(1.5f, x[i]), 14 + (int)(i % 3));
    for (int k = 0; k < 3; k++) {
        brute b;
        int l = gpu_diag_layer(d, gpu_dtype_name(dts[k]), dts[k]);
        brute_force(x, n, dts[k], 1.0f, &b);
        gpu_diag_begin(d, 1.0f);
        for (size_t off = 0; off < n; off += 1000)
            gpu_diag_forward(d, l, x + off, n - off < 1000 ? n - off : 1000);
        ck_assert(d->layer[l].act_amax == (float)b.amax);
        ck_assert_int_eq(d->layer[l].act_n, (int64_t)n);
        ck_assert_int_eq(d->layer[l].act_overflow, b.nonfinite);
        ck_assert(b.nonfinite > 0);
        ck_assert_int_eq(d->first_nonfinite, l);
        ck_assert(d->first_in_forward);
    }
    free(x);
    free(d);
}
END_TEST

START_TEST(test_first_nonfinite)
{
    gpu_diag *d = diag_new();
    float ok[3] = {1.0f, -2.0f, 3.0f}, big[2] = {1.0f, 70000.0f}, bad[2] = {NAN, 1.0f};
    int a = gpu_diag_layer(d, "fc1", GPU_FP16), b = gpu_diag_layer(d, "fc2", GPU_FP16);
    ck_assert_int_eq(a, 0);
    ck_assert_int_eq(b, 1);
    ck_assert_int_eq(gpu_diag_layer(d, "fc1", GPU_FP16), 0);
    gpu_diag_begin(d, 8.0f);
    ck_assert_int_eq(d->first_nonfinite, -1);
    gpu_diag_forward(d, a, ok, 3);
    gpu_diag_forward(d, b, big, 2); /* 70000 overflows fp16: fc2's forward is first */
    ck_assert_int_eq(d->layer[b].act_overflow, 1);
    ck_assert(d->layer[b].act_amax == 70000.0f);
    gpu_diag_backward(d, b, bad, 2);
    gpu_diag_weight_grad(d, a, bad, 2);
    ck_assert_int_eq(d->first_nonfinite, b);
    ck_assert(d->first_in_forward);
    ck_assert_int_eq(d->layer[b].out_nonfinite, 1);
    ck_assert_int_eq(d->layer[a].grad_nonfinite, 1);
    /* begin clears the counts and keeps the names */
    gpu_diag_begin(d, 8.0f);
    ck_assert_int_eq(d->nlayers, 2);
    ck_assert_str_eq(d->layer[1].name, "fc2");
    ck_assert_int_eq(d->layer[b].act_overflow, 0);
    /* a clean forward, then the backward of fc2 overflows first */
    gpu_diag_forward(d, a, ok, 3);
    gpu_diag_forward(d, b, ok, 3);
    gpu_diag_weight_grad(d, b, big, 2);
    gpu_diag_input_grad(d, a, bad, 2);
    ck_assert_int_eq(d->first_nonfinite, b);
    ck_assert(!d->first_in_forward);
    /* the table has a limit and out-of-range slots are ignored */
    for (int i = 2; i < GPU_DIAG_MAX_LAYERS; i++) {
        char name[16];
        snprintf(name, sizeof(name), "l%d", i);
        ck_assert_int_eq(gpu_diag_layer(d, name, GPU_BF16), i);
    }
    ck_assert_int_eq(gpu_diag_layer(d, "one-too-many", GPU_BF16), -1);
    gpu_diag_forward(d, -1, big, 2);
    gpu_diag_weight_grad(d, GPU_DIAG_MAX_LAYERS, big, 2);
    free(d);
}
END_TEST

START_TEST(test_stats)
{
    gpu_diag *d = diag_new();
    gpu_layer_stat st[2];
    int a = gpu_diag_layer(d, "fc1", GPU_FP16), b = gpu_diag_layer(d, "fc2", GPU_BF16);
    gpu_diag_begin(d, 1024.0f);
    gpu_layer_diag *la = &d->layer[a];
    la->act_amax = 1000.0f;
    la->act_overflow = 2;
    la->grad_amax = 512.0f;
    la->grad_nonzero = 60;
    la->grad_flushed = 6;
    la->grad_flushed_unscaled = 30;
    la->grad_starved = 40;
    la->grad_starved_unscaled = 10;
    la->grad_nonfinite = 3;
    gpu_diag_stats(d, st);
    ck_assert_str_eq(st[0].name, "fc1");
    ck_assert_int_eq(st[0].dtype, GPU_FP16);
    ck_assert_double_eq_tol(st[0].act_headroom, 65.504, 1e-9);
    ck_assert_int_eq(st[0].act_overflow, 2);
    ck_assert_double_eq(st[0].grad_amax, 0.5);
    ck_assert_double_eq_tol(st[0].grad_underflow, (6.0 + 40.0) / 100.0, 1e-12);
    ck_assert_double_eq_tol(st[0].grad_underflow_unscaled, (30.0 + 40.0 + 10.0) / 100.0, 1e-12);
    ck_assert_int_eq(st[0].grad_nonfinite, 3);
    ck_assert_str_eq(st[1].name, "fc2");
    ck_assert(isinf(st[1].act_headroom) && st[1].act_headroom > 0);
    ck_assert_double_eq(st[1].grad_underflow, 0.0);
    ck_assert_double_eq(st[1].lost_updates, 0.0);
    (void)b;
    free(d);
}
END_TEST

static int find_rec(const gpu_diag_advisor *a, const char *kind, const char *layer)
{
    for (int i = 0; i < a->nnew; i++)
        if (strcmp(a->rec[i].kind, kind) == 0 &&
            (layer ? a->rec[i].layer && strcmp(a->rec[i].layer, layer) == 0 : !a->rec[i].layer))
            return i;
    return -1;
}

START_TEST(test_advisor)
{
    gpu_diag *d = diag_new();
    gpu_diag_advisor *adv = calloc(1, sizeof(*adv));
    gpu_layer_stat st[3];
    gpu_diag_context c = {.dtype = GPU_FP16,
                          .master_weights = false,
                          .mode = GPU_SCALE_NONE,
                          .scale = 1.0f,
                          .next_scale = 1.0f,
                          .min_scale = 1.0f,
                          .max_scale = 16777216.0f,
                          .floor_patience = 50};
    int k;
    ck_assert_ptr_nonnull(adv);
    gpu_diag_layer(d, "fc1", GPU_FP16);
    gpu_diag_layer(d, "fc2", GPU_FP16);
    gpu_diag_layer(d, "fc3", GPU_FP32);
    gpu_diag_begin(d, 1.0f);
    gpu_diag_stats(d, st);
    st[0].grad_underflow = 0.38;
    st[0].lost_updates = 0.91;
    st[1].act_amax = 1.2e5;
    st[1].act_overflow = 4;
    st[2].grad_underflow = 1.0; /* an fp32 layer: never a recommendation */
    st[2].act_overflow = 1;
    st[2].act_amax = 1e39;
    gpu_diag_advise(adv, d, st, &c);
    ck_assert_int_eq(adv->nnew, 3);
    k = find_rec(adv, "underflow", "fc1");
    ck_assert_int_ge(k, 0);
    ck_assert_str_eq(adv->rec[k].message, "38% of fc1's gradients flush to zero without loss "
                                          "scaling: enable dynamic loss scaling");
    k = find_rec(adv, "lost_updates", "fc1");
    ck_assert_int_ge(k, 0);
    ck_assert_str_eq(adv->rec[k].message,
                     "fc1 loses 91% of its weight updates to fp16 rounding: enable master weights");
    k = find_rec(adv, "act_overflow", "fc2");
    ck_assert_int_ge(k, 0);
    ck_assert_str_eq(adv->rec[k].message,
                     "activations of fc2 exceed fp16's 65504 (max 1.2e+05): use bf16");
    /* the same numbers again: nothing new; within a factor of 2: nothing new */
    gpu_diag_advise(adv, d, st, &c);
    ck_assert_int_eq(adv->nnew, 0);
    st[0].grad_underflow = 0.7;
    st[1].act_amax = 2.0e5;
    gpu_diag_advise(adv, d, st, &c);
    ck_assert_int_eq(adv->nnew, 0);
    /* twice the first number: given again, with the new number */
    st[0].grad_underflow = 0.8;
    gpu_diag_advise(adv, d, st, &c);
    ck_assert_int_eq(adv->nnew, 1);
    ck_assert_str_eq(adv->rec[0].layer, "fc1");
    ck_assert_ptr_nonnull(strstr(adv->rec[0].message, "80% of fc1's"));
    /* with master weights there is no lost-update advice; under dynamic scaling the
     * underflow advice points at the scale; headroom under 2 warns */
    memset(adv, 0, sizeof(*adv));
    c.master_weights = true;
    c.mode = GPU_SCALE_DYNAMIC;
    c.scale = 2.0f;
    st[1].act_amax = 40000.0;
    st[1].act_overflow = 0;
    st[1].act_headroom = 65504.0 / 40000.0;
    gpu_diag_advise(adv, d, st, &c);
    ck_assert_int_eq(find_rec(adv, "lost_updates", "fc1"), -1);
    k = find_rec(adv, "underflow", "fc1");
    ck_assert_int_ge(k, 0);
    ck_assert_str_eq(adv->rec[k].message,
                     "80% of fc1's gradients flush to zero even at loss scale 2: use bf16");
    k = find_rec(adv, "act_headroom", "fc2");
    ck_assert_int_ge(k, 0);
    ck_assert_ptr_nonnull(strstr(adv->rec[k].message, "fc2"));
    /* the scaler's state alone (a step without collection): the floor after 50 steps,
     * again after 100; the scale below 1 once */
    memset(adv, 0, sizeof(*adv));
    c.floor_streak = 49;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 0);
    c.floor_streak = 50;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 1);
    ck_assert_ptr_null(adv->rec[0].layer);
    ck_assert_str_eq(adv->rec[0].kind, "scale_floor");
    ck_assert_ptr_nonnull(
        strstr(adv->rec[0].message, "loss scale stuck at its floor 1 for 50 steps"));
    ck_assert_ptr_nonnull(strstr(adv->rec[0].message, "use bf16"));
    c.floor_streak = 99;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 0);
    c.floor_streak = 100;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 1);
    c.floor_streak = 0;
    c.next_scale = 0.5f;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 1);
    ck_assert_str_eq(
        adv->rec[0].message,
        "the loss scale fell below 1 (0.5): gradients overflow even unscaled; use bf16");
    c.next_scale = 0.25f;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 0);
    free(adv);
    free(d);
}
END_TEST

/* A loss spike: judged once 64 clean losses are known, against the last 128; not on a step
 * whose gradients overflowed or whose loss is not finite; told at its first step only. */
START_TEST(test_loss_spike)
{
    gpu_diag_advisor *adv = calloc(1, sizeof(*adv));
    gpu_diag_context c = {
        .dtype = GPU_FP32, .mode = GPU_SCALE_NONE, .scale = 1.0f, .next_scale = 1.0f};
    int step = 0, told = 0;
    ck_assert_ptr_nonnull(adv);
    for (step = 1; step <= 200; step++) { /* a spike at step 30 comes before the window fills */
        c.loss = step == 30 ? 3.0 : 1.0 + 0.01 * sin(1.7 * step);
        gpu_diag_advise(adv, NULL, NULL, &c);
        told += adv->nnew;
    }
    ck_assert_int_eq(told, 0);
    c.loss = 100.0; /* an overflowing step's loss is the scaler's business */
    c.overflow = true;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 0);
    c.overflow = false;
    c.loss = NAN;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 0);
    c.loss = 10.0;
    gpu_diag_advise(adv, NULL, NULL, &c);
    ck_assert_int_eq(adv->nnew, 1);
    ck_assert_str_eq(adv->rec[0].kind, "loss_spike");
    ck_assert_ptr_null(adv->rec[0].layer);
    ck_assert_msg(strncmp(adv->rec[0].message, "loss spike: 10 is ", 18) == 0 &&
                      strstr(adv->rec[0].message, "standard deviations above the mean 1 of "
                                                  "the last 128 steps, with finite gradients"),
                  "%s", adv->rec[0].message);
    gpu_diag_advise(adv, NULL, NULL, &c); /* the same spike, a step later */
    ck_assert_int_eq(adv->nnew, 0);
    free(adv);
}
END_TEST

/* ---- through the MLP and the trainer ---------------------------------------------------- */

/* Collecting diagnostics computes the same forward and backward, bit for bit. */
START_TEST(test_mlp_unchanged_by_diag)
{
    static const gpu_dtype dts[] = {GPU_FP32, GPU_FP16, GPU_BF16};
    for (int k = 0; k < 3; k++) {
        gpu_model_config mc = {.type = GPU_MODEL_MLP,
                               .nlayers = 4,
                               .layers = {24, 40, 40, 5},
                               .activation = k == 2 ? GPU_ACT_GELU : GPU_ACT_RELU,
                               .init_scale = 1.0f};
        gpu_autocast a;
        gpu_mlp m;
        gpu_rng r;
        char err[128];
        int B = 7, correct[2], y[7];
        double loss[2];
        gpu_autocast_defaults(&a);
        ck_assert_int_eq(gpu_mlp_plan(&m, &mc, &a, dts[k], B, err, sizeof(err)), 0);
        float *p = malloc(m.nparams * 4), *g[2], *sc = calloc(m.scratch_floats, 4), x[7 * 24];
        uint16_t *w16 = malloc(m.nparams * 2);
        uint8_t *acts[2] = {calloc(1, m.act_bytes), calloc(1, m.act_bytes)};
        gpu_diag *d = diag_new();
        g[0] = calloc(m.nparams, 4);
        g[1] = calloc(m.nparams, 4);
        gpu_rng_seed(&r, 5 + (uint64_t)k);
        gpu_mlp_init_params(&m, p, 1.0f, &r);
        for (int i = 0; i < B * 24; i++)
            x[i] = gpu_rng_normal(&r);
        for (int i = 0; i < B; i++)
            y[i] = (int)gpu_rng_below(&r, 5);
        gpu_cvt_from_f32(w16, dts[k] == GPU_FP32 ? GPU_FP16 : dts[k], p, m.nparams);
        gpu_mlp_weights w = {dts[k] == GPU_FP32 ? (const void *)p : w16,
                             dts[k],
                             dts[k] == GPU_FP32 ? NULL : p,
                             NULL,
                             NULL,
                             NULL};
        for (int run = 0; run < 2; run++) {
            gpu_diag *dd = run ? d : NULL;
            if (dd)
                gpu_diag_begin(dd, 4096.0f);
            ck_assert_int_eq(
                gpu_mlp_forward(&m, &w, x, y, B, acts[run], sc, &loss[run], &correct[run], dd), 0);
            ck_assert_int_eq(gpu_mlp_backward(&m, &w, y, B, 4096.0f, acts[run], sc, g[run], dd, NULL), 0);
        }
        ck_assert(memcmp(&loss[0], &loss[1], sizeof(double)) == 0);
        ck_assert(memcmp(g[0], g[1], m.nparams * 4) == 0);
        ck_assert(memcmp(acts[0], acts[1], m.act_bytes) == 0);
        ck_assert_int_eq(d->nlayers, 3);
        ck_assert_str_eq(d->layer[2].name, "fc3");
        ck_assert_int_eq(d->layer[0].act_n, B * 40);
        ck_assert_int_eq(d->layer[0].grad_n, 40 * 24 + 40);
        ck_assert_int_eq(d->layer[2].in_n, B * 40);
        ck_assert(d->layer[1].act_amax > 0.0f && d->layer[1].grad_amax > 0.0f);
        free(p);
        free(w16);
        free(g[0]);
        free(g[1]);
        free(sc);
        free(acts[0]);
        free(acts[1]);
        free(d);
    }
}
END_TEST

/* What a run saw: the recommendations given (kind/layer/message) and the last stats. */
typedef struct {
    int nrecs;
    char recs[64][320];
    int rc;
    int64_t steps, diagnosed;
    gpu_step_metrics m;
    char err[512];
} story;

static void story_add_recs(gpu_trainer *t, story *s, int64_t step)
{
    const gpu_recommendation *r;
    int n;
    ck_assert_int_eq(gpu_trainer_recommendations(t, &r, &n), 0);
    for (int i = 0; i < n && s->nrecs < 64; i++)
        snprintf(s->recs[s->nrecs++], sizeof(s->recs[0]), "%lld %s %s %s", (long long)step,
                 r[i].kind, r[i].layer ? r[i].layer : "-", r[i].message);
}

static int story_count(const story *s, const char *needle1, const char *needle2)
{
    int n = 0;
    for (int i = 0; i < s->nrecs; i++)
        n += strstr(s->recs[i], needle1) && (!needle2 || strstr(s->recs[i], needle2));
    return n;
}

/* The stats of layer name at the last diagnosed step of interest. */
static gpu_layer_stat layer_of(gpu_trainer *t, const char *name)
{
    const gpu_layer_stat *ls;
    int n;
    gpu_layer_stat none;
    memset(&none, 0, sizeof(none));
    ck_assert_int_eq(gpu_trainer_diagnostics(t, &ls, &n, NULL, NULL), 0);
    for (int i = 0; i < n; i++)
        if (strcmp(ls[i].name, name) == 0)
            return ls[i];
    ck_abort_msg("no layer %s", name);
    return none;
}

START_TEST(test_story_activation_overflow)
{
    gpu_job_config c;
    gpu_trainer *t;
    gpu_step_metrics m;
    const gpu_layer_stat *ls;
    const char *first, *where;
    char err[512];
    int n;
    story s;
    memset(&s, 0, sizeof(s));
    /* init 300: fc1's outputs reach ~600, fc2's ~1e5 (beyond 65504) */
    test_narrow_job(&c, 4, 300.0f, GPU_SCALE_DYNAMIC);
    c.steps = 500;
    c.diagnostics_every = 0; /* only the overflowing steps collect */
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
    for (int i = 0; i < 500; i++) {
        int rc = gpu_trainer_step(t, &m, err, sizeof(err));
        story_add_recs(t, &s, m.step);
        ck_assert(m.overflow);
        ck_assert(m.diagnosed);
        ck_assert_int_eq(gpu_trainer_diagnostics(t, &ls, &n, &first, &where), 0);
        ck_assert_int_eq(n, 3);
        ck_assert_str_eq(first, "fc2");
        ck_assert_str_eq(where, "forward");
        gpu_layer_stat f1 = layer_of(t, "fc1"), f2 = layer_of(t, "fc2");
        ck_assert_int_eq(f1.act_overflow, 0);
        ck_assert(f1.act_amax < 65504.0 && f1.act_headroom > 1.0);
        ck_assert_int_gt(f2.act_overflow, 0);
        ck_assert(f2.act_amax > 65520.0 && f2.act_headroom < 1.0);
        ck_assert_int_eq(f2.dtype, GPU_FP16);
        if (rc) {
            ck_assert_int_eq(rc, GPU_ESCALE_FLOOR);
            break;
        }
    }
    ck_assert_int_eq(m.step, 66);
    /* the advice: fc2's activations, use bf16, given once although 66 steps overflowed */
    ck_assert_int_eq(story_count(&s, "act_overflow fc2", "use bf16"), 1);
    ck_assert_int_eq(story_count(&s, "act_overflow fc1", NULL), 0);
    ck_assert_int_eq(story_count(&s, "scale_floor", "fc2's forward activations"), 1);
    /* the failure's message reuses the diagnosis */
    ck_assert_msg(strstr(err, "fc2's forward activations reach") && strstr(err, "use bf16"), "%s",
                  err);
    gpu_trainer_free(t);

    /* the same job in bf16: collected every 10 steps, nothing overflows anywhere */
    c.dtype = GPU_BF16;
    gpu_scaler_defaults(&c.scaler, GPU_BF16);
    c.steps = 30;
    c.diagnostics_every = 10;
    memset(&s, 0, sizeof(s));
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
    for (int i = 0; i < 30; i++) {
        ck_assert_int_eq(gpu_trainer_step(t, &m, err, sizeof(err)), 0);
        story_add_recs(t, &s, m.step);
        ck_assert(!m.overflow);
        ck_assert(m.diagnosed == (m.step % 10 == 0));
        if (!m.diagnosed) {
            ck_assert_int_eq(gpu_trainer_diagnostics(t, &ls, &n, &first, &where), GPU_EINVAL);
            ck_assert_int_eq(n, 0);
            continue;
        }
        ck_assert_int_eq(gpu_trainer_diagnostics(t, &ls, &n, &first, &where), 0);
        ck_assert_ptr_null(first);
        ck_assert_ptr_null(where);
        for (int k = 0; k < n; k++) {
            ck_assert_int_eq(ls[k].dtype, GPU_BF16);
            ck_assert_int_eq(ls[k].act_overflow, 0);
            ck_assert_int_eq(ls[k].grad_nonfinite, 0);
        }
        ck_assert(layer_of(t, "fc2").act_amax > 65504.0); /* beyond fp16, fine in bf16 */
    }
    ck_assert_int_eq(story_count(&s, "act_overflow", NULL), 0);
    gpu_trainer_free(t);
}
END_TEST

START_TEST(test_story_underflow)
{
    gpu_job_config c;
    gpu_trainer *t;
    gpu_step_metrics m;
    char err[512];
    story none, dyn;
    memset(&none, 0, sizeof(none));
    memset(&dyn, 0, sizeof(dyn));
    for (int mode = 0; mode < 2; mode++) {
        story *s = mode ? &dyn : &none;
        test_narrow_job(&c, 12, 0.5f, mode ? GPU_SCALE_DYNAMIC : GPU_SCALE_NONE);
        c.steps = 100;
        c.diagnostics_every = 50;
        ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
        for (int i = 0; i < 50; i++) {
            ck_assert_int_eq(gpu_trainer_step(t, &m, err, sizeof(err)), 0);
            story_add_recs(t, s, m.step);
            ck_assert(m.diagnosed == (m.step == 50));
        }
        gpu_layer_stat f1 = layer_of(t, "fc1"), f2 = layer_of(t, "fc2"), f11 = layer_of(t, "fc11");
        if (mode == 0) {
            /* every gradient of the early layers is lost to fp16's range */
            ck_assert_msg(f1.grad_underflow > 0.95, "fc1 underflow %g", f1.grad_underflow);
            ck_assert_msg(f2.grad_underflow > 0.95, "fc2 underflow %g", f2.grad_underflow);
            ck_assert_double_eq(f1.grad_underflow_unscaled, f1.grad_underflow);
            ck_assert_double_eq(f1.grad_amax, 0.0);
            ck_assert_msg(f11.grad_underflow < 0.05, "fc11 underflow %g", f11.grad_underflow);
        } else {
            /* with the scale nothing is lost, and the diagnostics still say what would be */
            ck_assert_msg(f1.grad_underflow < 0.01, "fc1 underflow %g", f1.grad_underflow);
            ck_assert_msg(f1.grad_underflow_unscaled > 0.9, "fc1 unscaled %g",
                          f1.grad_underflow_unscaled);
            ck_assert(f1.grad_amax > 0.0 && f1.grad_amax < 1e-6);
            ck_assert_msg(f11.grad_underflow_unscaled < 0.05, "fc11 unscaled %g",
                          f11.grad_underflow_unscaled);
        }
        gpu_trainer_free(t);
    }
    ck_assert_int_eq(story_count(&none,
                                 "underflow fc1 100% of fc1's gradients flush to zero "
                                 "without loss scaling: enable dynamic loss scaling",
                                 NULL),
                     1);
    ck_assert_int_eq(story_count(&none, "underflow fc11", NULL), 0);
    ck_assert_int_eq(story_count(&dyn, "underflow", NULL), 0);

    /* fp32 has no underflow to report */
    test_narrow_job(&c, 12, 0.5f, GPU_SCALE_NONE);
    c.dtype = GPU_FP32;
    c.diagnostics_every = 5;
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(gpu_trainer_step(t, &m, err, sizeof(err)), 0);
    ck_assert_double_eq(layer_of(t, "fc1").grad_underflow, 0.0);
    ck_assert_int_eq(layer_of(t, "fc1").dtype, GPU_FP32);
    gpu_trainer_free(t);
}
END_TEST

START_TEST(test_story_master_weights)
{
    gpu_job_config c;
    gpu_trainer *t;
    gpu_step_metrics m;
    char err[512];
    for (int master = 0; master < 2; master++) {
        story s;
        memset(&s, 0, sizeof(s));
        test_narrow_job(&c, 4, 2.0f, GPU_SCALE_DYNAMIC);
        c.optim.lr = 3e-5f;
        c.master_weights = master;
        c.steps = 100;
        c.diagnostics_every = 25;
        ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
        for (int i = 0; i < 100; i++) {
            ck_assert_int_eq(gpu_trainer_step(t, &m, err, sizeof(err)), 0);
            story_add_recs(t, &s, m.step);
            if (!m.diagnosed)
                continue;
            const char *names[] = {"fc1", "fc2", "fc3"};
            for (int k = 0; k < 3; k++) {
                double lost = layer_of(t, names[k]).lost_updates;
                if (master)
                    ck_assert_double_eq(lost, 0.0);
                else
                    ck_assert_msg(lost > 0.5, "%s lost %g at step %lld", names[k], lost,
                                  (long long)m.step);
            }
        }
        if (master) {
            ck_assert_int_eq(story_count(&s, "lost_updates", NULL), 0);
        } else {
            /* one per layer, not one per diagnosed step */
            ck_assert_int_eq(story_count(&s, "lost_updates", "enable master weights"), 3);
            ck_assert_int_eq(story_count(&s, "lost_updates fc1 fc1 loses", "fp16 rounding"), 1);
        }
        gpu_trainer_free(t);
    }
}
END_TEST

/* Diagnostics never change the run: every 7 steps (and on the overflowing first steps,
 * which recompute) versus none, the same losses, norms and scales bit for bit. */
START_TEST(test_training_unchanged)
{
    gpu_job_config c;
    gpu_trainer *a, *b;
    gpu_step_metrics ma, mb;
    int overflows = 0, diagnosed = 0;
    test_narrow_job(&c, 5, 1.0f, GPU_SCALE_DYNAMIC);
    c.scaler.init_scale = 16777216.0f; /* 2^24: the first backward overflows fp16 */
    ck_assert_int_eq(gpu_trainer_create(&c, &a, NULL, 0), 0);
    c.diagnostics_every = 7;
    ck_assert_int_eq(gpu_trainer_create(&c, &b, NULL, 0), 0);
    for (int i = 0; i < 40; i++) {
        ck_assert_int_eq(gpu_trainer_step(a, &ma, NULL, 0), 0);
        ck_assert_int_eq(gpu_trainer_step(b, &mb, NULL, 0), 0);
        ck_assert(!ma.diagnosed || ma.overflow);
        ck_assert(mb.diagnosed == (mb.overflow || mb.step % 7 == 0));
        ck_assert(memcmp(&ma.loss, &mb.loss, sizeof(double)) == 0);
        ck_assert(memcmp(&ma.loss_scale, &mb.loss_scale, sizeof(float)) == 0);
        ck_assert(memcmp(&ma.grad_norm, &mb.grad_norm, sizeof(double)) == 0);
        overflows += mb.overflow;
        diagnosed += mb.diagnosed;
        if (mb.overflow) {
            const char *first, *where;
            const gpu_layer_stat *ls;
            int n;
            ck_assert_int_eq(gpu_trainer_diagnostics(b, &ls, &n, &first, &where), 0);
            ck_assert_ptr_nonnull(first);
            ck_assert_str_eq(where, "backward");
        }
    }
    ck_assert_int_ge(overflows, 1);
    ck_assert_int_gt(diagnosed, overflows);
    gpu_trainer_free(a);
    gpu_trainer_free(b);
}
END_TEST

static Suite *diag_suite(void)
{
    Suite *s = suite_create("diag");
    TCase *tc = tcase_create("counters");
    tcase_add_test(tc, test_weight_grad_counts);
    tcase_add_test(tc, test_flush_thresholds);
    tcase_add_test(tc, test_forward_counts);
    tcase_add_test(tc, test_first_nonfinite);
    tcase_add_test(tc, test_stats);
    tcase_add_test(tc, test_advisor);
    tcase_add_test(tc, test_loss_spike);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    tc = tcase_create("training");
    tcase_add_test(tc, test_mlp_unchanged_by_diag);
    tcase_add_test(tc, test_story_activation_overflow);
    tcase_add_test(tc, test_story_underflow);
    tcase_add_test(tc, test_story_master_weights);
    tcase_add_test(tc, test_training_unchanged);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(diag_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
