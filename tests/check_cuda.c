/*
 * check_cuda.c - Check suite "cuda": the CUDA conversion and unscale kernels against the
 * CPU.
 *
 * With a device: the four conversions on millions of random bit patterns (and every 16-bit pattern)
 * equal gpu/format.c's scalar functions bit for bit; gpu_cuda_unscale on tensors of 0, 1, 1000 and
 * 2^20+3 elements (values from subnormals to 60000, some tensors holding inf/NaN, inv == 1 and inv
 * != 1) equals a plain CPU reference written here (gpu_unscale's contract: non-finite elements
 * counted and left untouched): identical gradients bit for bit, identical flags and counts, equal
 * amax, sumsq within 1e-9 relative. Without one (no driver, no device, or a build without CUDA)
 * main prints "check_cuda: SKIP: <why>" once, the device tests return at once (the suite exits 77,
 * SKIP), and one test checks that every entry point then reports GPU_ENODEV and leaves its buffers
 * alone.
 *
 * Threads: the suite runs without fork (CK_NOFORK) so that the CUDA state main's probe may
 * create is the one the tests use; every test calls the probe itself.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_int.h"
#include "tests/cudatest.h"

/* ---- without a device -------------------------------------------------------------------- */

START_TEST(t_probe_contract)
{
    char why[256] = "";
    int rc = gpu_cuda_probe(why, sizeof(why));
    ck_assert(rc == 0 || rc == GPU_ENODEV);
    ck_assert_uint_gt(strlen(why), 0);          /* a reason, or the device's description */
    ck_assert_int_eq(gpu_cuda_probe(NULL, 0), rc);
    char tiny[8];
    memset(tiny, 'x', sizeof(tiny));
    ck_assert_int_eq(gpu_cuda_probe(tiny, 4), rc);
    ck_assert_uint_le(strlen(tiny), 3);         /* truncated, terminated */
    gpu_cuda_device devs[4];
    int ndev = -1;
    ck_assert_int_eq(gpu_cuda_devices(devs, 4, &ndev), rc);
    if (rc == 0) {
        ck_assert_int_ge(ndev, 1);
        for (int i = 0; i < ndev; i++) {
            ck_assert_uint_gt(strlen(devs[i].name), 0);
            ck_assert_uint_gt(devs[i].memory_bytes, 1u << 30);
            ck_assert_int_ge(devs[i].cc_major, 8); /* built for sm_80 and sm_90 */
            ck_assert_int_gt(devs[i].multiprocessors, 0);
        }
        return;
    }
    ck_assert_int_eq(ndev, 0);

    float f[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    uint16_t h[4] = {1, 2, 3, 4};
    ck_assert_int_eq(gpu_cuda_cvt_f32_f16(h, f, 4), GPU_ENODEV);
    ck_assert_int_eq(gpu_cuda_cvt_f32_bf16(h, f, 4), GPU_ENODEV);
    ck_assert_uint_eq(h[0], 1);
    ck_assert_uint_eq(h[3], 4);
    ck_assert_int_eq(gpu_cuda_cvt_f16_f32(f, h, 4), GPU_ENODEV);
    ck_assert_int_eq(gpu_cuda_cvt_bf16_f32(f, h, 4), GPU_ENODEV);
    ck_assert(f[0] == 1.0f && f[3] == 4.0f);
    size_t off = 0, cnt = 4;
    bool found = true;
    double ss = -1.0;
    ck_assert_int_eq(gpu_cuda_unscale(f, &off, &cnt, 1, 0.5f, NULL, &found, &ss), GPU_ENODEV);
    ck_assert(f[0] == 1.0f && f[3] == 4.0f);
    ck_assert(found && ss == -1.0);
}
END_TEST

/* ---- conversions --------------------------------------------------------------------------- */

#define NCVT ((size_t)(4u << 20) + 5)

START_TEST(t_cvt_bits)
{
    if (!have_device())
        return;
    float *f = xmalloc(NCVT * 4), *fo = xmalloc(NCVT * 4);
    uint16_t *h = xmalloc(NCVT * 2), *ho = xmalloc(NCVT * 2);
    gpu_rng r;
    gpu_rng_seed(&r, 2024);
    for (size_t i = 0; i < NCVT; i++) {
        f[i] = u2f((uint32_t)gpu_rng_next(&r));
        /* every 16-bit pattern first, then random ones */
        h[i] = i < 65536 ? (uint16_t)i : (uint16_t)gpu_rng_next(&r);
    }

    ck_assert_int_eq(gpu_cuda_cvt_f32_f16(ho, f, NCVT), 0);
    for (size_t i = 0; i < NCVT; i++)
        if (ho[i] != gpu_f32_to_f16(f[i]))
            ck_abort_msg("f32_f16 0x%08x: device 0x%04x, cpu 0x%04x", f2u(f[i]), ho[i],
                         gpu_f32_to_f16(f[i]));
    ck_assert_int_eq(gpu_cuda_cvt_f32_bf16(ho, f, NCVT), 0);
    for (size_t i = 0; i < NCVT; i++)
        if (ho[i] != gpu_f32_to_bf16(f[i]))
            ck_abort_msg("f32_bf16 0x%08x: device 0x%04x, cpu 0x%04x", f2u(f[i]), ho[i],
                         gpu_f32_to_bf16(f[i]));
    ck_assert_int_eq(gpu_cuda_cvt_f16_f32(fo, h, NCVT), 0);
    for (size_t i = 0; i < NCVT; i++)
        if (f2u(fo[i]) != f2u(gpu_f16_to_f32(h[i])))
            ck_abort_msg("f16_f32 0x%04x: device 0x%08x, cpu 0x%08x", h[i], f2u(fo[i]),
                         f2u(gpu_f16_to_f32(h[i])));
    ck_assert_int_eq(gpu_cuda_cvt_bf16_f32(fo, h, NCVT), 0);
    for (size_t i = 0; i < NCVT; i++)
        if (f2u(fo[i]) != f2u(gpu_bf16_to_f32(h[i])))
            ck_abort_msg("bf16_f32 0x%04x: device 0x%08x, cpu 0x%08x", h[i], f2u(fo[i]),
                         f2u(gpu_bf16_to_f32(h[i])));

    /* short and empty arrays */
    uint16_t one = 0;
    ck_assert_int_eq(gpu_cuda_cvt_f32_f16(&one, f, 1), 0);
    ck_assert_uint_eq(one, gpu_f32_to_f16(f[0]));
    ck_assert_int_eq(gpu_cuda_cvt_f32_f16(ho, f, 0), 0);
    free(f);
    free(fo);
    free(h);
    free(ho);
}
END_TEST

/* ---- unscale ------------------------------------------------------------------------------- */

/* The CPU reference of gpu_unscale()'s contract, one plain loop. */
static void ref_unscale(float *g, const size_t *off, const size_t *cnt, int nt, float inv,
                        gpu_grad_stat *st, bool *found, double *sumsq)
{
    *found = false;
    *sumsq = 0.0;
    for (int t = 0; t < nt; t++) {
        gpu_grad_stat s = {0.0f, 0.0f, 0, 0};
        for (size_t i = off[t]; i < off[t] + cnt[t]; i++) {
            float x = g[i];
            if (!isfinite(x)) {         /* counted, left untouched */
                s.nonfinite++;
                *found = true;
                continue;
            }
            float y = inv == 1.0f ? x : x * inv;
            g[i] = y;
            if (fabsf(x) > s.amax_scaled)
                s.amax_scaled = fabsf(x);
            if (fabsf(y) > s.amax)
                s.amax = fabsf(y);
            if (y == 0.0f)
                s.zeros++;
            *sumsq += (double)y * (double)y;
        }
        st[t] = s;
    }
}

/* Magnitudes 2^[-149, log2(60000)], random sign, about 1% exact zeros. */
static float grad_value(gpu_rng *r)
{
    uint64_t b = gpu_rng_next(r);
    if (b % 100 == 0)
        return (b & 0x100) ? -0.0f : 0.0f;
    double e = -149.0 + (double)gpu_rng_uniform(r) * (149.0 + 15.87);
    float v = (float)ldexp(1.0 + (double)gpu_rng_uniform(r), (int)floor(e));
    if (v > 60000.0f)
        v = 60000.0f;
    return (b & 0x200) ? -v : v;
}

#define NT 6

static void check_unscale(float inv, bool with_nonfinite)
{
    static const size_t counts[NT] = {0, 1, 1000, (1u << 20) + 3, 7, 1000};
    size_t off[NT], total = 0;
    for (int t = 0; t < NT; t++) {
        off[t] = total;
        total += counts[t] + 3;           /* small gaps that no tensor covers */
    }
    float *g = xmalloc(total * 4), *want = xmalloc(total * 4);
    gpu_rng r;
    gpu_rng_seed(&r, 77);
    for (size_t i = 0; i < total; i++)
        g[i] = grad_value(&r);
    if (with_nonfinite) {
        g[off[2] + 17] = INFINITY;        /* tensor 2: +inf */
        g[off[3] + 5] = NAN;              /* tensor 3: NaN, -inf and a signalling NaN */
        g[off[3] + 999999] = -INFINITY;
        g[off[3] + (1u << 20) + 2] = u2f(0x7F800001u);
        g[off[1]] = -NAN;                 /* tensor 1 (one element): NaN */
    }
    memcpy(want, g, total * 4);

    gpu_grad_stat ws[NT], gs[NT];
    bool wfound, gfound = !with_nonfinite;
    double wss, gss = -1.0;
    ref_unscale(want, off, counts, NT, inv, ws, &wfound, &wss);
    ck_assert_int_eq(gpu_cuda_unscale(g, off, counts, NT, inv, gs, &gfound, &gss), 0);

    for (size_t i = 0; i < total; i++) {
        if (f2u(g[i]) != f2u(want[i]))
            ck_abort_msg("inv %g: g[%zu] = 0x%08x, cpu 0x%08x", (double)inv, i, f2u(g[i]),
                         f2u(want[i]));
    }
    ck_assert_int_eq(gfound, wfound);
    ck_assert_int_eq(gfound, with_nonfinite);
    for (int t = 0; t < NT; t++) {
        ck_assert_msg(gs[t].amax == ws[t].amax, "tensor %d amax %g vs %g", t,
                      (double)gs[t].amax, (double)ws[t].amax);
        ck_assert_msg(gs[t].amax_scaled == ws[t].amax_scaled, "tensor %d amax_scaled", t);
        ck_assert_int_eq(gs[t].nonfinite, ws[t].nonfinite);
        ck_assert_int_eq(gs[t].zeros, ws[t].zeros);
    }
    ck_assert_int_eq(ws[3].nonfinite, with_nonfinite ? 3 : 0);
    ck_assert_int_eq(ws[0].zeros, 0);
    if (!wfound)
        ck_assert_msg(fabs(gss - wss) <= 1e-9 * wss, "sumsq %.17g vs %.17g", gss, wss);
    free(g);
    free(want);
}

START_TEST(t_unscale)
{
    if (!have_device())
        return;
    check_unscale(1.0f, false);
    check_unscale(1.0f, true);
    check_unscale((float)(1.0 / 65536.0), false);
    check_unscale((float)(1.0 / 65536.0), true);
    check_unscale((float)(1.0 / 3.0), false);   /* inexact products, subnormal results */
    check_unscale(4.0f, true);
}
END_TEST

START_TEST(t_unscale_edges)
{
    if (!have_device())
        return;
    bool found = true;
    double ss = -1.0;
    ck_assert_int_eq(gpu_cuda_unscale(NULL, NULL, NULL, 0, 0.5f, NULL, &found, &ss), 0);
    ck_assert(!found && ss == 0.0);
    size_t off = 0, cnt = 2;
    float g[2] = {3.0f, -4.0f};
    ck_assert_int_eq(gpu_cuda_unscale(g, &off, &cnt, 1, 0.5f, NULL, &found, &ss), 0);
    ck_assert(!found && g[0] == 1.5f && g[1] == -2.0f && ss == 6.25);
    ck_assert_int_eq(gpu_cuda_unscale(g, &off, &cnt, 1, 0.5f, NULL, NULL, &ss), GPU_EINVAL);
}
END_TEST

static Suite *cuda_suite(void)
{
    Suite *s = suite_create("cuda");
    TCase *tc = tcase_create("cuda");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, t_probe_contract);
    tcase_add_test(tc, t_cvt_bits);
    tcase_add_test(tc, t_unscale);
    tcase_add_test(tc, t_unscale_edges);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return cudatest_main("check_cuda", cuda_suite());
}
