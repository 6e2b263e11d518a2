/*
 * check_mlp.c - the MLP's forward and backward against an independent fp64 model:
 * the fp32 loss matches the fp64 loss, and every analytic gradient matches central finite
 * differences of the fp64 loss (ReLU and GELU). Then the low-precision contract: under
 * fp16/bf16 every gradient leaves its op rounded to the dtype, a too-large loss scale
 * overflows it to inf, and the fp16 gradients stay close to the fp32 ones.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_int.h"
#include "gpu/mlp.h"

#define B 5

typedef struct {
    gpu_mlp m;
    float *params, *grads, *scratch;
    uint8_t *acts;
    float x[B * 16];
    int y[B];
} net;

static void net_init(net *n, int nw, const int *widths, gpu_activation act, gpu_dtype dt,
                     uint64_t seed)
{
    gpu_model_config mc = {
        .type = GPU_MODEL_MLP, .nlayers = nw, .activation = act, .init_scale = 1.0f};
    gpu_autocast a;
    gpu_rng r;
    char err[128];
    memcpy(mc.layers, widths, sizeof(int) * (size_t)nw);
    gpu_autocast_defaults(&a);
    ck_assert_int_eq(gpu_mlp_plan(&n->m, &mc, &a, dt, B, err, sizeof(err)), 0);
    n->params = malloc(sizeof(float) * n->m.nparams);
    n->grads = calloc(n->m.nparams, sizeof(float));
    n->scratch = calloc(n->m.scratch_floats, sizeof(float));
    n->acts = calloc(1, n->m.act_bytes);
    gpu_rng_seed(&r, seed);
    gpu_mlp_init_params(&n->m, n->params, 1.5f, &r);
    for (int i = 0; i < B * widths[0]; i++)
        n->x[i] = gpu_rng_normal(&r);
    for (int i = 0; i < B; i++)
        n->y[i] = (int)gpu_rng_below(&r, (uint32_t)widths[nw - 1]);
}

static void net_free(net *n)
{
    free(n->params);
    free(n->grads);
    free(n->scratch);
    free(n->acts);
}

static double act64(gpu_activation a, double v)
{
    return a == GPU_ACT_RELU ? (v > 0 ? v : 0) : 0.5 * v * (1.0 + erf(v / sqrt(2.0)));
}

/* The reference: the same network in double precision, written independently. */
static double loss64(const net *n, const double *p)
{
    const gpu_mlp *m = &n->m;
    double cur[B * 16], nxt[B * 16], total = 0;
    for (int i = 0; i < B * m->width[0]; i++)
        cur[i] = n->x[i];
    for (int l = 0; l < m->nlin; l++) {
        int in = m->width[l], out = m->width[l + 1];
        for (int b = 0; b < B; b++)
            for (int o = 0; o < out; o++) {
                double s = p[m->b_off[l] + (size_t)o];
                for (int i = 0; i < in; i++)
                    s += p[m->w_off[l] + (size_t)o * in + i] * cur[b * in + i];
                nxt[b * out + o] = l == m->nlin - 1 ? s : act64(m->act, s);
            }
        memcpy(cur, nxt, sizeof(double) * (size_t)(B * out));
    }
    int C = m->width[m->nlin];
    for (int b = 0; b < B; b++) {
        double mx = cur[b * C], s = 0;
        for (int c = 1; c < C; c++)
            mx = fmax(mx, cur[b * C + c]);
        for (int c = 0; c < C; c++)
            s += exp(cur[b * C + c] - mx);
        total += -(cur[b * C + n->y[b]] - mx - log(s));
    }
    return total / B;
}

static void run_fwd_bwd(net *n, gpu_dtype pdt, const void *p, float seed, double *loss)
{
    gpu_mlp_weights w = {p, pdt, NULL, NULL, NULL, NULL};
    int correct;
    ck_assert_int_eq(
        gpu_mlp_forward(&n->m, &w, n->x, n->y, B, n->acts, n->scratch, loss, &correct, NULL), 0);
    ck_assert_int_eq(
        gpu_mlp_backward(&n->m, &w, n->y, B, seed, n->acts, n->scratch, n->grads, NULL, NULL), 0);
}

static void check_fd(gpu_activation act)
{
    const int widths[] = {7, 9, 6, 4};
    net n;
    double loss;
    net_init(&n, 4, widths, act, GPU_FP32, 42);
    run_fwd_bwd(&n, GPU_FP32, n.params, 1.0f, &loss);
    size_t P = n.m.nparams;
    double *p = calloc(P, sizeof(double));
    ck_assert_ptr_nonnull(p);
    for (size_t i = 0; i < P; i++)
        p[i] = n.params[i];
    double ref = loss64(&n, p);
    ck_assert_msg(fabs(loss - ref) <= 1e-5 * fabs(ref) + 1e-6, "loss %g vs fp64 %g", loss, ref);
    for (size_t i = 0; i < P; i++) {
        const double h = 1e-5;
        double save = p[i];
        p[i] = save + h;
        double lp = loss64(&n, p);
        p[i] = save - h;
        double lm = loss64(&n, p);
        p[i] = save;
        double fd = (lp - lm) / (2 * h);
        /* fp32 analytic vs fp64 central difference: fp32 rounding dominates (~1e-7
         * relative per op); the FD truncation error is O(h^2) ~ 1e-10. */
        ck_assert_msg(fabs(n.grads[i] - fd) <= 2e-4 * fabs(fd) + 2e-6,
                      "param %zu: analytic %.9g vs finite difference %.9g", i, (double)n.grads[i],
                      fd);
    }
    free(p);
    net_free(&n);
}

START_TEST(test_fd_relu)
{
    check_fd(GPU_ACT_RELU);
}
END_TEST

START_TEST(test_fd_gelu)
{
    check_fd(GPU_ACT_GELU);
}
END_TEST

/* Under a 16-bit dtype every gradient comes out of its op rounded to that dtype, and the
 * result tracks the fp32 gradient within the dtype's precision. */
static void check_lowp(gpu_dtype dt, float tol)
{
    const int widths[] = {16, 12, 12, 5};
    net n32, n16;
    double l32, l16;
    net_init(&n32, 4, widths, GPU_ACT_GELU, GPU_FP32, 7);
    net_init(&n16, 4, widths, GPU_ACT_GELU, dt, 7);
    size_t P = n16.m.nparams;
    uint16_t *w16 = malloc(P * sizeof(uint16_t));
    gpu_cvt_from_f32(w16, dt, n16.params, P);
    /* the fp32 reference runs on the same rounded weights */
    gpu_round_n(n32.params, n32.params, P, dt);
    run_fwd_bwd(&n32, GPU_FP32, n32.params, 1024.0f, &l32);
    run_fwd_bwd(&n16, dt, w16, 1024.0f, &l16);
    ck_assert_msg(fabs(l16 - l32) < tol * 4 * fabs(l32), "loss %g vs %g", l16, l32);
    double num = 0, den = 0;
    for (size_t i = 0; i < P; i++) {
        ck_assert_msg(gpu_round(n16.grads[i], dt) == n16.grads[i],
                      "grad %zu = %.9g is not a %s value", i, (double)n16.grads[i],
                      gpu_dtype_name(dt));
        num += (n16.grads[i] - n32.grads[i]) * (double)(n16.grads[i] - n32.grads[i]);
        den += (double)n32.grads[i] * n32.grads[i];
    }
    ck_assert_msg(sqrt(num / den) < tol, "relative gradient error %g", sqrt(num / den));
    free(w16);
    net_free(&n32);
    net_free(&n16);
}

START_TEST(test_fp16_rounding)
{
    check_lowp(GPU_FP16, 2e-2f);
}
END_TEST

START_TEST(test_bf16_rounding)
{
    check_lowp(GPU_BF16, 8e-2f);
}
END_TEST

/* A loss scale too large for fp16 overflows the gradients to inf, as on a GPU. */
START_TEST(test_scale_overflow)
{
    const int widths[] = {16, 12, 5};
    net n;
    double loss;
    net_init(&n, 3, widths, GPU_ACT_RELU, GPU_FP16, 9);
    size_t P = n.m.nparams;
    uint16_t *w16 = malloc(P * sizeof(uint16_t));
    gpu_cvt_from_f32(w16, GPU_FP16, n.params, P);
    run_fwd_bwd(&n, GPU_FP16, w16, 1e9f, &loss);
    int inf = 0;
    for (size_t i = 0; i < P; i++)
        inf += isinf(n.grads[i]);
    ck_assert_msg(inf > 0, "no gradient overflowed at scale 1e9");
    /* the same scale in bf16 stays finite */
    net nb;
    net_init(&nb, 3, widths, GPU_ACT_RELU, GPU_BF16, 9);
    gpu_cvt_from_f32(w16, GPU_BF16, nb.params, P);
    run_fwd_bwd(&nb, GPU_BF16, w16, 1e9f, &loss);
    for (size_t i = 0; i < P; i++)
        ck_assert(isfinite(nb.grads[i]));
    free(w16);
    net_free(&n);
    net_free(&nb);
}
END_TEST

/* fp16 activations beyond 65504 overflow in the forward pass: the loss is not finite. */
START_TEST(test_forward_overflow)
{
    const int widths[] = {16, 12, 5};
    net n;
    double loss;
    net_init(&n, 3, widths, GPU_ACT_RELU, GPU_FP16, 11);
    for (int i = 0; i < B * 16; i++)
        n.x[i] *= 30000.0f;
    size_t P = n.m.nparams;
    uint16_t *w16 = malloc(P * sizeof(uint16_t));
    for (size_t i = 0; i < P; i++)
        n.params[i] *= 20.0f;
    gpu_cvt_from_f32(w16, GPU_FP16, n.params, P);
    gpu_mlp_weights w = {w16, GPU_FP16, NULL, NULL, NULL, NULL};
    int correct;
    ck_assert_int_eq(
        gpu_mlp_forward(&n.m, &w, n.x, n.y, B, n.acts, n.scratch, &loss, &correct, NULL), 0);
    ck_assert_msg(!isfinite(loss), "loss %g should overflow in fp16", loss);
    free(w16);
    net_free(&n);
}
END_TEST

static Suite *mlp_suite(void)
{
    Suite *s = suite_create("mlp");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_fd_relu);
    tcase_add_test(tc, test_fd_gelu);
    tcase_add_test(tc, test_fp16_rounding);
    tcase_add_test(tc, test_bf16_rounding);
    tcase_add_test(tc, test_scale_overflow);
    tcase_add_test(tc, test_forward_overflow);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(mlp_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
