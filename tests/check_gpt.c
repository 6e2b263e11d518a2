/*
 * check_gpt.c - the GPT against an independent fp64 model written here.
 *
 * Every op on its own (token + position embedding, layer norm, causal multi-head attention,
 * GELU, tied head + cross-entropy) and the whole model (2 layers, d_model 16, 2 heads, T 5,
 * vocab 11, batch 2): the fp32 forward matches the fp64 reference, and every analytic
 * gradient (every parameter of the model, the tied wte included) matches central finite
 * differences of the fp64 reference. Then causality, the low-precision contract (fp16/bf16
 * weight gradients are values of the dtype and track the fp32 ones), masking that stays
 * finite in fp16 with large scores, fp16 overflow under a large init scale (NaN loss,
 * attributed to the attention scores) while bf16 stays finite, the layout and dtype plan,
 * results bit-identical whatever the number of threads, and a few hundred training steps
 * that drive the loss down in fp32, fp16 and bf16. The native bf16 plans run on oneDNN's
 * kernels where the CPU has them (elsewhere: a SKIP line per case) and on their emulation
 * everywhere: the heads against the public attention, and a backward whose gradients are
 * bf16 subnormals (the GEMMs give way to the widened plan) within the scratch the model
 * planned, on guarded blocks.
 *
 * Tolerances (GPT_VERBOSE=1 prints the measured values): fp32 gradients within 1e-4 of the
 * finite difference plus 2e-5 of the tensor's largest (worst seen: 1.1e-6 of the largest);
 * fp16 / bf16 gradients (run with a loss scale of 1024, unscaled) within 0.5% / 3% of the
 * fp32 ones in relative L2 norm per tensor (seen: at most 0.17% / 1.0%), losses within
 * 1e-3 / 1e-2 (seen: 5e-5 / 1e-3).
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/diag.h"
#include "gpu/gpt.h"
#include "gpu/gpu_int.h"
#include "testutil.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define RN 64 /* max rows in the reference */
#define RC 16 /* max d_model */
#define RV 16 /* max vocab */
#define RT 8  /* max seq_len */

/* ---- the fp64 reference ------------------------------------------------------------------ */

static void ref_ln(const double *x, const double *g, const double *b, int N, int C, double *y)
{
    for (int i = 0; i < N; i++) {
        const double *r = x + i * C;
        double mean = 0, var = 0;
        for (int j = 0; j < C; j++)
            mean += r[j];
        mean /= C;
        for (int j = 0; j < C; j++)
            var += (r[j] - mean) * (r[j] - mean);
        var /= C;
        double rs = 1.0 / sqrt(var + 1e-5);
        for (int j = 0; j < C; j++)
            y[i * C + j] = (r[j] - mean) * rs * g[j] + b[j];
    }
}

/* y[N x O] = x[N x K] W^T + bias (bias may be NULL). */
static void ref_linear(const double *x, const double *W, const double *bias, int N, int K, int O,
                       double *y)
{
    for (int i = 0; i < N; i++)
        for (int o = 0; o < O; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int k = 0; k < K; k++)
                s += x[i * K + k] * W[o * K + k];
            y[i * O + o] = s;
        }
}

static void ref_attn(const double *qkv, int B, int T, int C, int H, double *y)
{
    int hd = C / H;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const double *q = qkv + (b * T + i) * 3 * C + h * hd;
                double s[RT], mx = -INFINITY, sum = 0;
                for (int j = 0; j <= i; j++) {
                    const double *k = qkv + (b * T + j) * 3 * C + C + h * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++)
                        d += q[e] * k[e];
                    s[j] = d / sqrt((double)hd);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int j = 0; j <= i; j++) {
                    s[j] = exp(s[j] - mx);
                    sum += s[j];
                }
                for (int e = 0; e < hd; e++) {
                    double acc = 0;
                    for (int j = 0; j <= i; j++)
                        acc += s[j] / sum * qkv[(b * T + j) * 3 * C + 2 * C + h * hd + e];
                    y[(b * T + i) * C + h * hd + e] = acc;
                }
            }
}

/* 0.5 u (1 + tanh z), with 1 + tanh z = 2 e^2z / (1 + e^2z) for z < 0 (no cancellation). */
static double ref_gelu(double u)
{
    double z = sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u);
    return 0.5 * u * (z >= 0 ? 1.0 + tanh(z) : 2.0 * exp(2 * z) / (1.0 + exp(2 * z)));
}

/* Summed cross-entropy of N rows of V logits. */
static double ref_ce(const double *z, int N, int V, const int *y)
{
    double total = 0;
    for (int i = 0; i < N; i++) {
        double mx = z[i * V], s = 0;
        for (int j = 1; j < V; j++)
            mx = z[i * V + j] > mx ? z[i * V + j] : mx;
        for (int j = 0; j < V; j++)
            s += exp(z[i * V + j] - mx);
        total += mx + log(s) - z[i * V + y[i]];
    }
    return total;
}

static size_t off_of(const gpu_gpt *m, const char *name)
{
    for (int i = 0; i < m->ntensors; i++)
        if (strcmp(m->tensor[i].name, name) == 0)
            return m->tensor[i].off;
    ck_abort_msg("no tensor %s", name);
    return 0;
}

static const double *par(const gpu_gpt *m, const double *p, int l, const char *what)
{
    char name[64];
    if (l < 0)
        snprintf(name, sizeof name, "%s", what);
    else
        snprintf(name, sizeof name, "blocks.%d.%s", l, what);
    return p + off_of(m, name);
}

/* The whole model's mean loss in fp64, parameters found by name in the tensor table. */
static double ref_model(const gpu_gpt *m, const double *p, const int *x, const int *y, int B)
{
    int C = m->d_model, T = m->seq_len, V = m->vocab, N = B * T;
    static double h[RN * RC], a[RN * RC], qkv[RN * 3 * RC], at[RN * RC], o[RN * RC];
    static double u[RN * 4 * RC], z[RN * RV];
    const double *wte = par(m, p, -1, "wte"), *wpe = par(m, p, -1, "wpe");
    for (int i = 0; i < N; i++)
        for (int c = 0; c < C; c++)
            h[i * C + c] = wte[x[i] * C + c] + wpe[(i % T) * C + c];
    for (int l = 0; l < m->n_layer; l++) {
        ref_ln(h, par(m, p, l, "ln1.weight"), par(m, p, l, "ln1.bias"), N, C, a);
        ref_linear(a, par(m, p, l, "attn.qkv.weight"), par(m, p, l, "attn.qkv.bias"), N, C, 3 * C,
                   qkv);
        ref_attn(qkv, B, T, C, m->n_head, at);
        ref_linear(at, par(m, p, l, "attn.proj.weight"), par(m, p, l, "attn.proj.bias"), N, C, C,
                   o);
        for (int i = 0; i < N * C; i++)
            h[i] += o[i];
        ref_ln(h, par(m, p, l, "ln2.weight"), par(m, p, l, "ln2.bias"), N, C, a);
        ref_linear(a, par(m, p, l, "mlp.fc.weight"), par(m, p, l, "mlp.fc.bias"), N, C, 4 * C, u);
        for (int i = 0; i < N * 4 * C; i++)
            u[i] = ref_gelu(u[i]);
        ref_linear(u, par(m, p, l, "mlp.proj.weight"), par(m, p, l, "mlp.proj.bias"), N, 4 * C, C,
                   o);
        for (int i = 0; i < N * C; i++)
            h[i] += o[i];
    }
    ref_ln(h, par(m, p, -1, "ln_f.weight"), par(m, p, -1, "ln_f.bias"), N, C, a);
    ref_linear(a, wte, NULL, N, C, V, z);
    return ref_ce(z, N, V, y) / N;
}

/* ---- finite differences ------------------------------------------------------------------ */

typedef double (*objective)(void *ctx, const double *v);

/* Central differences of f at v (n values, restored on return) against grad: each element
 * within rtol of |fd| plus atol of the largest |fd|. Returns the worst error as a fraction
 * of the largest |fd|. */
static double check_fd(const char *what, objective f, void *ctx, double *v, size_t n,
                       const float *grad, double rtol, double atol)
{
    double *fd = malloc(sizeof(double) * n), big = 0, worst = 0;
    ck_assert_ptr_nonnull(fd);
    for (size_t i = 0; i < n; i++) {
        double save = v[i], h = 1e-5;
        v[i] = save + h;
        double lp = f(ctx, v);
        v[i] = save - h;
        double lm = f(ctx, v);
        v[i] = save;
        fd[i] = (lp - lm) / (2 * h);
        big = fabs(fd[i]) > big ? fabs(fd[i]) : big;
    }
    ck_assert_msg(big > 0, "%s: all gradients are zero", what);
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)grad[i] - fd[i]);
        worst = err / big > worst ? err / big : worst;
        ck_assert_msg(err <= rtol * fabs(fd[i]) + atol * big,
                      "%s[%zu]: analytic %.9g, finite difference %.9g", what, i, grad[i], fd[i]);
    }
    free(fd);
    return worst;
}

static void randn(gpu_rng *r, float *v, size_t n, float s)
{
    for (size_t i = 0; i < n; i++)
        v[i] = gpu_rng_normal(r) * s;
}

static void widen(double *d, const float *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
}

/* ---- exp ---------------------------------------------------------------------------------- */

static int64_t ulps(float a, float b)
{
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    return ia > ib ? (int64_t)ia - ib : (int64_t)ib - ia;
}

START_TEST(test_exp)
{
    enum { n = 400001 };
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    int64_t worst = 0;
    ck_assert_ptr_nonnull(x);
    ck_assert_ptr_nonnull(y);
    for (int i = 0; i < n; i++)
        x[i] = -110.0f + 200.0f * (float)i / (n - 1);
    gpu_gpt_exp(y, x, n);
    for (int i = 0; i < n; i++) {
        float want = (float)exp((double)x[i]);
        int64_t u = ulps(y[i], want);
        worst = u > worst ? u : worst;
        ck_assert_msg(u <= 2, "exp(%.9g) = %.9g, want %.9g", x[i], y[i], want);
    }
    float sp[5] = {INFINITY, -INFINITY, NAN, 0.0f, 88.72283f}, out[5];
    gpu_gpt_exp(out, sp, 5);
    ck_assert(isinf(out[0]) && out[0] > 0);
    ck_assert(out[1] == 0.0f);
    ck_assert(isnan(out[2]));
    ck_assert(out[3] == 1.0f);
    ck_assert(isfinite(out[4]));
    free(x);
    free(y);
}
END_TEST

/* ---- the ops ------------------------------------------------------------------------------- */

enum { EB = 2, ET = 3, EC = 5, EV = 7 };
static const int emb_x[EB * ET] = {3, 1, 3, 6, 3, 0};

typedef struct {
    const double *r; /* the loss weights */
} emb_ctx;

/* sum r * (wte[x] + wpe[t]); v = wte then wpe */
static double emb_obj(void *c, const double *v)
{
    const emb_ctx *e = c;
    double s = 0;
    for (int i = 0; i < EB * ET; i++)
        for (int j = 0; j < EC; j++)
            s += e->r[i * EC + j] * (v[emb_x[i] * EC + j] + v[EV * EC + (i % ET) * EC + j]);
    return s;
}

START_TEST(test_op_embedding)
{
    gpu_rng r;
    float w[(EV + ET) * EC], out[EB * ET * EC], rr[EB * ET * EC], g[(EV + ET) * EC], tmp[EC];
    uint16_t w16[(EV + ET) * EC];
    double v[(EV + ET) * EC], r64[EB * ET * EC];
    gpu_rng_seed(&r, 11);
    randn(&r, w, (EV + ET) * EC, 1.0f);
    randn(&r, rr, EB * ET * EC, 1.0f);
    gpu_gpt_embed_fwd(emb_x, EB, ET, EC, w, w + EV * EC, GPU_FP32, GPU_FP32, out, tmp);
    for (int i = 0; i < EB * ET; i++)
        for (int j = 0; j < EC; j++)
            ck_assert_float_eq(out[i * EC + j],
                               w[emb_x[i] * EC + j] + w[EV * EC + (i % ET) * EC + j]);
    /* 16-bit weights are read as their values; the output rounded to out_dt */
    gpu_cvt_f32_bf16(w16, w, (EV + ET) * EC);
    gpu_gpt_embed_fwd(emb_x, EB, ET, EC, w16, w16 + EV * EC, GPU_BF16, GPU_BF16, out, tmp);
    for (int i = 0; i < EB * ET; i++)
        for (int j = 0; j < EC; j++) {
            float want = gpu_bf16_to_f32(w16[emb_x[i] * EC + j]) +
                         gpu_bf16_to_f32(w16[EV * EC + (i % ET) * EC + j]);
            ck_assert_float_eq(out[i * EC + j], gpu_round(want, GPU_BF16));
        }
    memset(g, 0, sizeof g);
    gpu_gpt_embed_bwd(emb_x, EB, ET, EC, rr, g, g + EV * EC);
    widen(v, w, (EV + ET) * EC);
    widen(r64, rr, EB * ET * EC);
    emb_ctx c = {r64};
    check_fd("embedding", emb_obj, &c, v, (EV + ET) * EC, g, 1e-6, 1e-6);
}
END_TEST

enum { LN_N = 3, LN_C = 37 };

typedef struct {
    const double *r;
} ln_ctx;

/* sum r * LN(x; g, b); v = x, g, b */
static double ln_obj(void *c, const double *v)
{
    const ln_ctx *e = c;
    double y[LN_N * LN_C], s = 0;
    ref_ln(v, v + LN_N * LN_C, v + LN_N * LN_C + LN_C, LN_N, LN_C, y);
    for (int i = 0; i < LN_N * LN_C; i++)
        s += e->r[i] * y[i];
    return s;
}

START_TEST(test_op_layernorm)
{
    enum { NX = LN_N * LN_C, NV = NX + 2 * LN_C };
    gpu_rng r;
    float v32[NV], y[NX], rr[NX], mean[LN_N], rstd[LN_N], g[NV];
    double v[NV], y64[NX], r64[NX];
    gpu_rng_seed(&r, 12);
    randn(&r, v32, NV, 1.0f);
    for (int i = 0; i < NX; i++)
        v32[i] = v32[i] * 3.0f + 1.5f;
    for (int j = 0; j < LN_C; j++)
        v32[NX + j] += 1.0f;
    randn(&r, rr, NX, 1.0f);
    gpu_gpt_layernorm_fwd(v32, v32 + NX, v32 + NX + LN_C, LN_N, LN_C, GPU_FP32, y, mean, rstd);
    widen(v, v32, NV);
    ref_ln(v, v + NX, v + NX + LN_C, LN_N, LN_C, y64);
    for (int i = 0; i < NX; i++)
        ck_assert_msg(fabs(y[i] - y64[i]) <= 2e-6 * (1 + fabs(y64[i])), "y[%d] %.9g vs %.9g", i,
                      y[i], y64[i]);
    gpu_gpt_layernorm_bwd(rr, v32, mean, rstd, v32 + NX, LN_N, LN_C, GPU_FP32, g, g + NX,
                          g + NX + LN_C);
    widen(r64, rr, NX);
    ln_ctx c = {r64};
    check_fd("layernorm", ln_obj, &c, v, NV, g, 1e-4, 1e-5);
    /* in a low dtype every output and gradient is a value of it */
    gpu_round_n(v32, v32, NV, GPU_BF16);
    gpu_round_n(rr, rr, NX, GPU_BF16);
    gpu_gpt_layernorm_fwd(v32, v32 + NX, v32 + NX + LN_C, LN_N, LN_C, GPU_BF16, y, mean, rstd);
    gpu_gpt_layernorm_bwd(rr, v32, mean, rstd, v32 + NX, LN_N, LN_C, GPU_BF16, g, g + NX,
                          g + NX + LN_C);
    for (int i = 0; i < NX; i++)
        ck_assert_float_eq(y[i], gpu_round(y[i], GPU_BF16));
    for (int i = 0; i < NV; i++)
        ck_assert_float_eq(g[i], gpu_round(g[i], GPU_BF16));
}
END_TEST

enum { AB = 2, AT = 5, AC = 8, AH = 2, AN = AB * AT };

typedef struct {
    const double *r;
} attn_ctx;

static double attn_obj(void *c, const double *v)
{
    const attn_ctx *e = c;
    double y[AN * AC], s = 0;
    ref_attn(v, AB, AT, AC, AH, y);
    for (int i = 0; i < AN * AC; i++)
        s += e->r[i] * y[i];
    return s;
}

START_TEST(test_op_attention)
{
    gpu_rng r;
    float qkv[AN * 3 * AC], y[AN * AC], rr[AN * AC], dqkv[AN * 3 * AC];
    float probs[AB * AH * AT * AT], *scratch;
    double v[AN * 3 * AC], y64[AN * AC], r64[AN * AC];
    scratch = calloc(gpu_gpt_attention_scratch_floats(AT, AC / AH, GPU_BF16, 1), 4);
    ck_assert_ptr_nonnull(scratch);
    gpu_rng_seed(&r, 13);
    randn(&r, qkv, AN * 3 * AC, 1.5f);
    randn(&r, rr, AN * AC, 1.0f);
    ck_assert_int_eq(
        gpu_gpt_attention_fwd(qkv, AB, AT, AC, AH, GPU_FP32, GPU_FP32, probs, y, scratch, 1, NULL,
                              -1),
        0);
    widen(v, qkv, AN * 3 * AC);
    ref_attn(v, AB, AT, AC, AH, y64);
    for (int i = 0; i < AN * AC; i++)
        ck_assert_msg(fabs(y[i] - y64[i]) <= 1e-5 * (1 + fabs(y64[i])), "y[%d]", i);
    for (int bh = 0; bh < AB * AH; bh++)
        for (int i = 0; i < AT; i++) {
            double s = 0;
            for (int j = 0; j < AT; j++) {
                float p = probs[(bh * AT + i) * AT + j];
                if (j > i)
                    ck_assert_float_eq(p, 0.0f); /* masked: exactly zero */
                s += p;
            }
            ck_assert_double_eq_tol(s, 1.0, 1e-6);
        }
    ck_assert_int_eq(gpu_gpt_attention_bwd(rr, qkv, probs, AB, AT, AC, AH, GPU_FP32, GPU_FP32, dqkv,
                                           scratch, 1, NULL, -1),
                     0);
    widen(r64, rr, AN * AC);
    attn_ctx c = {r64};
    check_fd("attention", attn_obj, &c, v, AN * 3 * AC, dqkv, 1e-3, 1e-5);
    free(scratch);
}
END_TEST

START_TEST(test_op_gelu)
{
    enum { n = 201 };
    float u[n], y[n], d[n];
    for (int i = 0; i < n; i++)
        u[i] = -10.0f + 20.0f * (float)i / (n - 1);
    gpu_gpt_gelu_fwd(y, u, n, GPU_FP32);
    for (int i = 0; i < n; i++) {
        /* fp32's rounding of z = sqrt(2/pi)(u + 0.044715 u^3) is amplified by |2z| in the
         * negative tail (e^-2z), as in any fp32 evaluation of the formula */
        double want = ref_gelu(u[i]), z = 0.7978845608 * (u[i] + 0.044715 * pow(u[i], 3));
        ck_assert_msg(fabs(y[i] - want) <= 2.5e-7 * (2 + 2 * fabs(z)) * fabs(want),
                      "gelu(%g) = %.9g, want %.9g", u[i], y[i], want);
        d[i] = 1.0f;
    }
    gpu_gpt_gelu_bwd(d, u, n, GPU_FP32);
    for (int i = 0; i < n; i++) {
        double h = 1e-5, fd = (ref_gelu(u[i] + h) - ref_gelu(u[i] - h)) / (2 * h);
        ck_assert_msg(fabs(d[i] - fd) <= 1e-5 * (1 + fabs(fd)), "gelu'(%g) = %.9g, want %.9g", u[i],
                      d[i], fd);
    }
    /* in place, and in a low dtype: outputs are values of the dtype, within its rounding */
    memcpy(y, u, sizeof u);
    gpu_gpt_gelu_fwd(y, y, n, GPU_FP16);
    for (int i = 0; i < n; i++) {
        double want = ref_gelu(u[i]);
        ck_assert_float_eq(y[i], gpu_round(y[i], GPU_FP16));
        ck_assert_msg(fabs(y[i] - want) <= fabs(want) / 1024 + 3e-8, "fp16 gelu(%g)", u[i]);
    }
}
END_TEST

/* A linear's bias gradient (the column sums of dY, in row order) on a shape with a partial
 * block of columns: the same sums bit for bit from the fp32 values and from the same values
 * stored in bf16 or fp16 (the copy the native GEMMs read), close to the fp64 sums. */
START_TEST(test_op_bias_grad)
{
    enum { rows = 37, n = 70 };
    static float dy[rows * n], from32[n], from16[n];
    static uint16_t dy16[rows * n];
    const gpu_dtype dts[2] = {GPU_BF16, GPU_FP16};
    gpu_rng r;
    gpu_rng_seed(&r, 21);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < rows * n; i++)
            dy[i] = gpu_round(gpu_rng_normal(&r) * 3.0f, dts[k]);
        gpu_cvt_from_f32(dy16, dts[k], dy, rows * n);
        gpu_gpt_bias_grad(from32, dy, NULL, GPU_FP32, rows, n);
        gpu_gpt_bias_grad(from16, NULL, dy16, dts[k], rows, n);
        for (int j = 0; j < n; j++) {
            double want = 0.0;
            for (int i = 0; i < rows; i++)
                want += dy[i * n + j];
            ck_assert_msg(from16[j] == from32[j], "%s: column %d sums to %.9g from the copy, "
                          "%.9g from fp32", gpu_dtype_name(dts[k]), j, from16[j], from32[j]);
            ck_assert_msg(fabs(from32[j] - want) <= 1e-5 * (1.0 + fabs(want)),
                          "column %d: %.9g, want %.9g", j, from32[j], want);
        }
    }
}
END_TEST

enum { HN = 4, HC = 6, HV = 9 };
static const int head_y[HN] = {3, 0, 8, 3};

/* (summed cross-entropy of x wte^T) / HN; v = x then wte */
static double head_obj(void *c, const double *v)
{
    double z[HN * HV];
    (void)c;
    ref_linear(v, v + HN * HC, NULL, HN, HC, HV, z);
    return ref_ce(z, HN, HV, head_y) / HN;
}

START_TEST(test_op_head)
{
    gpu_rng r;
    float v32[HN * HC + HV * HC], logits[HN * HV], probs[HN * HV], grad[HN * HC + HV * HC];
    double v[HN * HC + HV * HC], z[HN * HV], loss;
    int correct, want_correct = 0;
    gpu_rng_seed(&r, 14);
    randn(&r, v32, HN * HC + HV * HC, 1.0f);
    ck_assert_int_eq(gpu_gpt_head_fwd(v32, v32 + HN * HC, GPU_FP32, head_y, HN, HC, HV, GPU_FP32,
                                      GPU_FP32, logits, probs, NULL, NULL, -1, &loss, &correct),
                     0);
    widen(v, v32, HN * HC + HV * HC);
    ref_linear(v, v + HN * HC, NULL, HN, HC, HV, z);
    ck_assert_double_eq_tol(loss, ref_ce(z, HN, HV, head_y), 1e-5);
    for (int i = 0; i < HN; i++) {
        int a = 0;
        for (int j = 1; j < HV; j++)
            a = z[i * HV + j] > z[i * HV + a] ? j : a;
        want_correct += a == head_y[i];
    }
    ck_assert_int_eq(correct, want_correct);
    ck_assert_int_eq(gpu_gpt_head_bwd(probs, head_y, v32, v32 + HN * HC, GPU_FP32, HN, HC, HV,
                                      GPU_FP32, GPU_FP32, 1.0f / HN, logits, grad, grad + HN * HC,
                                      NULL, NULL, -1),
                     0);
    check_fd("head", head_obj, NULL, v, HN * HC + HV * HC, grad, 1e-4, 1e-5);
}
END_TEST

/* ---- the tiny model ------------------------------------------------------------------------ */

#define TB 2

typedef struct {
    gpu_gpt m;
    gpu_dtype dt;
    float *params, *grads, *scratch;
    void *work;
    uint8_t *acts;
    int x[TB * RT], y[TB * RT];
} tiny;

static void tiny_sync(tiny *t)
{
    if (t->dt != GPU_FP32)
        gpu_cvt_from_f32(t->work, t->dt, t->params, t->m.nparams);
}

/* A 2-layer GPT (d 16, 2 heads, T 5, vocab 11). perturb: random layer norms and biases too,
 * so that every gradient is exercised. */
/* The attention of the tiny models a test builds; flash ones are 32 wide (head_dim 16). */
static gpu_attention tiny_attention = GPU_ATTN_MATERIALIZED;

static void tiny_init_cfg(tiny *t, gpu_dtype dt, const gpu_autocast *a, float init_scale,
                          bool perturb, uint64_t seed, int T)
{
    bool flash = tiny_attention == GPU_ATTN_FLASH;
    gpu_model_config mc = {.type = GPU_MODEL_GPT,
                           .n_layer = 2,
                           .n_head = 2,
                           .d_model = flash ? 32 : 16,
                           .seq_len = T,
                           .vocab = 11,
                           .init_scale = init_scale,
                           .attention = tiny_attention};
    char err[128];
    gpu_rng r;
    memset(t, 0, sizeof *t);
    t->dt = dt;
    ck_assert_int_eq(gpu_gpt_plan(&t->m, &mc, a, dt, TB, err, sizeof err), 0);
    t->params = malloc(sizeof(float) * t->m.nparams);
    t->grads = calloc(t->m.nparams, sizeof(float));
    t->scratch = calloc(t->m.scratch_floats, sizeof(float));
    t->acts = calloc(1, t->m.act_bytes);
    t->work = dt == GPU_FP32 ? (void *)t->params : malloc(2 * t->m.nparams);
    ck_assert(t->params && t->grads && t->scratch && t->acts && t->work);
    gpu_rng_seed(&r, seed);
    gpu_gpt_init_params(&t->m, t->params, init_scale, &r);
    if (perturb)
        for (int i = 0; i < t->m.ntensors; i++) {
            const gpu_gpt_tensor *g = &t->m.tensor[i];
            if (g->ndim == 1)
                for (size_t j = 0; j < g->count; j++)
                    t->params[g->off + j] += 0.2f * gpu_rng_normal(&r);
        }
    for (int i = 0; i < TB * T; i++) {
        t->x[i] = (int)gpu_rng_below(&r, 11);
        t->y[i] = (int)gpu_rng_below(&r, 11);
    }
    tiny_sync(t);
}

static void tiny_init(tiny *t, gpu_dtype dt, float init_scale, bool perturb, uint64_t seed)
{
    gpu_autocast a;
    gpu_autocast_defaults(&a);
    tiny_init_cfg(t, dt, &a, init_scale, perturb, seed, 5);
}

static void tiny_free(tiny *t)
{
    if (t->work != (void *)t->params)
        free(t->work);
    free(t->params);
    free(t->grads);
    free(t->scratch);
    free(t->acts);
}

static gpu_gpt_weights tiny_weights(const tiny *t)
{
    gpu_gpt_weights w = {.p = t->work, .pdt = t->dt, .master = t->params};
    return w;
}

static double tiny_fwd(tiny *t, gpu_diag *d, int *correct)
{
    gpu_gpt_weights w = tiny_weights(t);
    double loss;
    int c;
    ck_assert_int_eq(gpu_gpt_forward(&t->m, &w, t->x, t->y, TB, t->acts, t->scratch, d, &loss, &c),
                     0);
    if (correct)
        *correct = c;
    return loss;
}

static void tiny_bwd(tiny *t, float seed, gpu_diag *d)
{
    gpu_gpt_weights w = tiny_weights(t);
    ck_assert_int_eq(
        gpu_gpt_backward(&t->m, &w, t->x, t->y, TB, seed, t->acts, t->scratch, d, t->grads, NULL), 0);
}

typedef struct {
    const tiny *t;
    const double *all; /* the whole parameter block; check_fd perturbs a part of it */
} model_ctx;

static double model_obj(void *c, const double *v)
{
    const model_ctx *e = c;
    (void)v;
    return ref_model(&e->t->m, e->all, e->t->x, e->t->y, TB);
}

START_TEST(test_model_fd)
{
    tiny t;
    tiny_init(&t, GPU_FP32, 10.0f, true, 21);
    size_t P = t.m.nparams;
    double *v = malloc(sizeof(double) * P), worst = 0;
    ck_assert_ptr_nonnull(v);
    widen(v, t.params, P);
    double l32 = tiny_fwd(&t, NULL, NULL), l64 = ref_model(&t.m, v, t.x, t.y, TB);
    ck_assert_msg(fabs(l32 - l64) <= 1e-5 * fabs(l64), "loss %.9g, fp64 %.9g", l32, l64);
    ck_assert(l64 > 0.5); /* not a trivially solved problem */
    tiny_bwd(&t, 1.0f, NULL);
    model_ctx c = {&t, v};
    /* every parameter, tensor by tensor (wte gets the head's and the embedding's parts) */
    for (int i = 0; i < t.m.ntensors; i++) {
        const gpu_gpt_tensor *g = &t.m.tensor[i];
        double e =
            check_fd(g->name, model_obj, &c, v + g->off, g->count, t.grads + g->off, 1e-4, 2e-5);
        worst = e > worst ? e : worst;
    }
    if (getenv("GPT_VERBOSE"))
        printf("model fd worst %.3g\n", worst);
    ck_assert(worst < 1e-3);
    free(v);
    tiny_free(&t);
}
END_TEST

/* Changing the token at position t + 1 leaves every output at positions <= t unchanged. */
START_TEST(test_causal)
{
    tiny t;
    int T = 5, V = 11, pos = 2; /* change sequence 1, position pos + 1 */
    tiny_init(&t, GPU_FP32, 10.0f, true, 22);
    size_t row = (size_t)V * sizeof(float);
    float *before = malloc(row * TB * T);
    ck_assert_ptr_nonnull(before);
    tiny_fwd(&t, NULL, NULL);
    memcpy(before, t.acts + t.m.probs, row * TB * T);
    t.x[T + pos + 1] = (t.x[T + pos + 1] + 5) % V;
    tiny_fwd(&t, NULL, NULL);
    const float *after = (const float *)(t.acts + t.m.probs);
    for (int i = 0; i < TB * T; i++) {
        int same = memcmp(before + (size_t)i * V, after + (size_t)i * V, row) == 0;
        if (i < T + pos + 1)
            ck_assert_msg(same, "position %d changed", i);
        else if (i == T + pos + 1)
            ck_assert_msg(!same, "the changed position %d did not change", i);
    }
    free(before);
    tiny_free(&t);
}
END_TEST

static double rel_err(const float *a, float amul, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] * amul - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static bool lowp_gemm_param(const char *name)
{
    return strstr(name, ".attn.") || strstr(name, ".mlp.");
}

/* fp16/bf16: the linear layers' weight gradients are values of the dtype (they leave the
 * GEMM rounded), the layer norms' are fp32; everything tracks the fp32 run. */
static void check_lowp(gpu_dtype dt, double grad_tol, double loss_tol)
{
    tiny a, b;
    float S = 1024.0f;
    tiny_init(&a, GPU_FP32, 10.0f, true, 23);
    tiny_init(&b, dt, 10.0f, true, 23);
    double l32 = tiny_fwd(&a, NULL, NULL), llp = tiny_fwd(&b, NULL, NULL);
    if (getenv("GPT_VERBOSE"))
        printf("%s loss %.6f fp32 %.6f\n", gpu_dtype_name(dt), llp, l32);
    ck_assert_msg(fabs(llp - l32) <= loss_tol, "%s loss %.6f vs fp32 %.6f", gpu_dtype_name(dt), llp,
                  l32);
    tiny_bwd(&a, 1.0f, NULL);
    tiny_bwd(&b, S, NULL);
    int ln_not_representable = 0;
    for (int i = 0; i < b.m.ntensors; i++) {
        const gpu_gpt_tensor *g = &b.m.tensor[i];
        const float *gl = b.grads + g->off;
        for (size_t j = 0; j < g->count; j++) {
            ck_assert(isfinite(gl[j]));
            if (lowp_gemm_param(g->name))
                ck_assert_msg(gl[j] == gpu_round(gl[j], dt), "%s[%zu] = %.9g is not %s", g->name, j,
                              gl[j], gpu_dtype_name(dt));
            else if (strstr(g->name, "ln") && gl[j] != gpu_round(gl[j], dt))
                ln_not_representable++;
        }
        double e = rel_err(gl, 1.0f / S, a.grads + g->off, g->count);
        if (getenv("GPT_VERBOSE"))
            printf("%s %-28s %.5f\n", gpu_dtype_name(dt), g->name, e);
        ck_assert_msg(e <= grad_tol, "%s: %s gradient off by %.4f (relative)", g->name,
                      gpu_dtype_name(dt), e);
    }
    ck_assert_int_gt(ln_not_representable, 0);
    tiny_free(&a);
    tiny_free(&b);
}

START_TEST(test_fp16_tracks_fp32)
{
    check_lowp(GPU_FP16, 0.005, 1e-3);
}
END_TEST

START_TEST(test_bf16_tracks_fp32)
{
    check_lowp(GPU_BF16, 0.03, 1e-2);
}
END_TEST

/* Flash attention's fp32 arithmetic (mm_dt fp32 makes every rounding to it a no-op): y and
 * the saved log-sum-exp against fp64, the backward against finite differences. */
START_TEST(test_op_flash)
{
    gpu_rng r;
    float qkv[AN * 3 * AC], y[AN * AC], rr[AN * AC], dqkv[AN * 3 * AC], lse[AB * AH * AT];
    double v[AN * 3 * AC], y64[AN * AC], r64[AN * AC];
    float *scratch = calloc(gpu_gpt_attention_scratch_floats(AT, AC / AH, GPU_BF16, 1), 4);
    ck_assert_ptr_nonnull(scratch);
    gpu_rng_seed(&r, 14);
    randn(&r, qkv, AN * 3 * AC, 1.5f);
    randn(&r, rr, AN * AC, 1.0f);
    ck_assert_int_eq(gpu_gpt_flash_fwd(qkv, AB, AT, AC, AH, GPU_FP32, lse, y, scratch, 1), 0);
    widen(v, qkv, AN * 3 * AC);
    ref_attn(v, AB, AT, AC, AH, y64);
    for (int i = 0; i < AN * AC; i++)
        ck_assert_msg(fabs(y[i] - y64[i]) <= 1e-5 * (1 + fabs(y64[i])), "y[%d]", i);
    int hd = AC / AH;
    for (int b = 0; b < AB; b++)
        for (int h = 0; h < AH; h++)
            for (int i = 0; i < AT; i++) {
                double sum = 0;
                for (int j = 0; j <= i; j++) {
                    double d = 0;
                    for (int e = 0; e < hd; e++)
                        d += v[(b * AT + i) * 3 * AC + h * hd + e] *
                             v[(b * AT + j) * 3 * AC + AC + h * hd + e];
                    sum += exp(d / sqrt((double)hd));
                }
                float got = lse[(b * AH + h) * AT + i];
                ck_assert_msg(fabs(got - log(sum)) <= 1e-5 * (1 + fabs(log(sum))), "lse %g vs %g",
                              got, log(sum));
            }
    ck_assert_int_eq(gpu_gpt_flash_bwd(rr, qkv, y, lse, AB, AT, AC, AH, GPU_FP32, dqkv, scratch, 1,
                                       NULL, -1),
                     0);
    widen(r64, rr, AN * AC);
    attn_ctx c = {r64};
    check_fd("flash attention", attn_obj, &c, v, AN * 3 * AC, dqkv, 1e-3, 1e-5);
    free(scratch);
}
END_TEST

/* In fp16, flash attention's outputs and gradients are fp16 values within fp16's rounding of
 * the fp32 ones; scores whose product overflows fp16 (|q.k| = 80000) make the materialised
 * attention NaN but leave the flash one finite (the scores never leave fp32). */
START_TEST(test_flash_fp16)
{
    enum { B1 = 1, T1 = 6, C1 = 8, H1 = 1, N1 = B1 * T1 };
    float qkv[N1 * 3 * C1], y[N1 * C1], y32[N1 * C1], dy[N1 * C1], lse[B1 * H1 * T1];
    float dqkv[N1 * 3 * C1], d32[N1 * 3 * C1], probs[B1 * H1 * T1 * T1];
    float *scratch = calloc(gpu_gpt_attention_scratch_floats(T1, C1 / H1, GPU_BF16, 1), 4);
    gpu_rng r;
    ck_assert_ptr_nonnull(scratch);
    gpu_rng_seed(&r, 32);
    for (int i = 0; i < N1 * 3 * C1; i++)
        qkv[i] = gpu_round(gpu_rng_normal(&r), GPU_FP16);
    for (int i = 0; i < N1 * C1; i++)
        dy[i] = gpu_round(gpu_rng_normal(&r), GPU_FP16);
    ck_assert_int_eq(gpu_gpt_flash_fwd(qkv, B1, T1, C1, H1, GPU_FP16, lse, y, scratch, 1), 0);
    ck_assert_int_eq(gpu_gpt_flash_fwd(qkv, B1, T1, C1, H1, GPU_FP32, lse, y32, scratch, 1), 0);
    for (int i = 0; i < N1 * C1; i++) {
        ck_assert_float_eq(y[i], gpu_round(y[i], GPU_FP16));
        ck_assert_msg(fabsf(y[i] - y32[i]) <= 2e-3f * (1 + fabsf(y32[i])), "y[%d] %g vs %g", i,
                      y[i], y32[i]);
    }
    ck_assert_int_eq(gpu_gpt_flash_bwd(dy, qkv, y32, lse, B1, T1, C1, H1, GPU_FP32, d32, scratch, 1,
                                       NULL, -1),
                     0);
    ck_assert_int_eq(gpu_gpt_flash_fwd(qkv, B1, T1, C1, H1, GPU_FP16, lse, y, scratch, 1), 0);
    ck_assert_int_eq(gpu_gpt_flash_bwd(dy, qkv, y, lse, B1, T1, C1, H1, GPU_FP16, dqkv, scratch, 1,
                                       NULL, -1),
                     0);
    for (int i = 0; i < N1 * 3 * C1; i++)
        ck_assert_float_eq(dqkv[i], gpu_round(dqkv[i], GPU_FP16));
    ck_assert_double_le(rel_err(dqkv, 1.0f, d32, N1 * 3 * C1), 5e-3);
    /* q = k = 100 on every channel: q.k = 80000 > 65504 */
    for (int i = 0; i < T1; i++)
        for (int c = 0; c < 2 * C1; c++)
            qkv[i * 3 * C1 + c] = 100.0f;
    ck_assert_int_eq(gpu_gpt_attention_fwd(qkv, B1, T1, C1, H1, GPU_FP16, GPU_FP32, probs, y,
                                           scratch, 1, NULL, -1),
                     0);
    ck_assert(isnan(y[0]));
    ck_assert_int_eq(gpu_gpt_flash_fwd(qkv, B1, T1, C1, H1, GPU_FP16, lse, y, scratch, 1), 0);
    for (int i = 0; i < N1 * C1; i++)
        ck_assert(isfinite(y[i]));
    ck_assert_int_eq(gpu_gpt_flash_bwd(dy, qkv, y, lse, B1, T1, C1, H1, GPU_FP16, dqkv, scratch, 1,
                                       NULL, -1),
                     0);
    for (int i = 0; i < N1 * 3 * C1; i++)
        ck_assert(isfinite(dqkv[i]));
    free(scratch);
}
END_TEST

/* A GPT with flash attention: fp16 and bf16 track fp32 (whose attention is materialised:
 * flash needs a 16-bit matmul dtype) as closely as the materialised ones do. */
START_TEST(test_flash_tracks_fp32)
{
    tiny_attention = GPU_ATTN_FLASH;
    check_lowp(GPU_FP16, 0.005, 1e-3);
    check_lowp(GPU_BF16, 0.03, 1e-2);
    tiny t;
    tiny_init(&t, GPU_BF16, 1.0f, false, 3);
    ck_assert(t.m.flash);
    ck_assert_int_eq(t.m.act[1].probs - t.m.act[0].probs, t.m.act[1].resid - t.m.act[0].resid);
    tiny_free(&t);
    tiny_init(&t, GPU_FP32, 1.0f, false, 3);
    ck_assert(!t.m.flash);
    tiny_free(&t);
    tiny_attention = GPU_ATTN_MATERIALIZED;
}
END_TEST

/* The init scale that overflows fp16's materialised scores (test_overflow_fp16_not_bf16)
 * does not overflow them with flash attention: nothing is counted for the scores' forward,
 * and the first overflow is the next rounding point's, attn.proj's output. */
START_TEST(test_flash_scores_stay_finite)
{
    tiny t;
    gpu_diag *d = calloc(1, sizeof *d);
    ck_assert_ptr_nonnull(d);
    tiny_attention = GPU_ATTN_FLASH;
    tiny_init(&t, GPU_FP16, 4000.0f, false, 24);
    gpu_diag_begin(d, 1.0f);
    double l = tiny_fwd(&t, d, NULL);
    if (getenv("GPT_VERBOSE"))
        printf("flash fp16 loss %g first %d\n", l, d->first_nonfinite);
    ck_assert_int_ge(d->first_nonfinite, 0); /* the overflow moves on to the projection */
    ck_assert_str_eq(d->layer[d->first_nonfinite].name, "blocks.0.attn.proj");
    int sc = -1;
    for (int i = 0; i < d->nlayers; i++)
        if (strcmp(d->layer[i].name, "blocks.0.attn.scores") == 0)
            sc = i;
    ck_assert_int_ge(sc, 0);
    ck_assert_int_eq(d->layer[sc].act_n, 0); /* nothing rounded, nothing counted */
    tiny_attention = GPU_ATTN_MATERIALIZED;
    free(d);
    tiny_free(&t);
}
END_TEST

/* Scores near fp16's limit: the softmax stays finite (no -inf arithmetic), masked entries
 * are exactly 0, rows sum to 1, and the backward is finite. */
START_TEST(test_fp16_mask_finite)
{
    enum { B1 = 1, T1 = 6, C1 = 8, H1 = 1 };
    float qkv[B1 * T1 * 3 * C1], y[B1 * T1 * C1], dy[B1 * T1 * C1], dqkv[B1 * T1 * 3 * C1];
    float probs[B1 * H1 * T1 * T1], *scratch;
    gpu_rng r;
    scratch = calloc(gpu_gpt_attention_scratch_floats(T1, C1 / H1, GPU_BF16, 1), 4);
    ck_assert_ptr_nonnull(scratch);
    gpu_rng_seed(&r, 31);
    for (int i = 0; i < T1; i++)
        for (int c = 0; c < 3 * C1; c++) {
            float s = c < C1 ? 80.0f : c < 2 * C1 ? (i % 2 ? 80.0f : -80.0f) : 1.0f;
            qkv[i * 3 * C1 + c] = gpu_round(s * (1.0f + 0.01f * gpu_rng_normal(&r)), GPU_FP16);
        }
    ck_assert_int_eq(
        gpu_gpt_attention_fwd(qkv, B1, T1, C1, H1, GPU_FP16, GPU_FP32, probs, y, scratch, 1, NULL,
                              -1),
        0);
    float amax = 0;
    for (int i = 0; i < T1; i++) {
        double s = 0;
        for (int j = 0; j < T1; j++) {
            float p = probs[i * T1 + j];
            ck_assert(isfinite(p));
            if (j > i)
                ck_assert_float_eq(p, 0.0f);
            s += p;
        }
        ck_assert_double_eq_tol(s, 1.0, 1e-6);
    }
    for (int i = 0; i < T1 * C1; i++) {
        ck_assert(isfinite(y[i]));
        dy[i] = gpu_round(gpu_rng_normal(&r), GPU_FP16);
    }
    /* the scores really were large: |q.k| / sqrt(8) ~ 18000 */
    for (int c = 0; c < C1; c++)
        amax += qkv[c] * qkv[C1 + c];
    ck_assert(fabsf(amax) / sqrtf(8.0f) > 10000.0f);
    ck_assert_int_eq(gpu_gpt_attention_bwd(dy, qkv, probs, B1, T1, C1, H1, GPU_FP16, GPU_FP32, dqkv,
                                           scratch, 1, NULL, -1),
                     0);
    for (int i = 0; i < T1 * 3 * C1; i++) {
        ck_assert(isfinite(dqkv[i]));
        ck_assert_float_eq(dqkv[i], gpu_round(dqkv[i], GPU_FP16));
    }
    free(scratch);
}
END_TEST

/* A large init scale overflows fp16's attention scores: the loss is NaN and the diagnostics
 * name blocks.0.attn.scores, in the forward; bf16 stays finite. */
START_TEST(test_overflow_fp16_not_bf16)
{
    tiny a, b;
    gpu_diag *d = calloc(1, sizeof *d);
    ck_assert_ptr_nonnull(d);
    tiny_init(&a, GPU_FP16, 4000.0f, false, 24);
    tiny_init(&b, GPU_BF16, 4000.0f, false, 24);
    gpu_diag_begin(d, 1.0f);
    double l16 = tiny_fwd(&a, d, NULL), l16b, lbf = tiny_fwd(&b, NULL, NULL);
    ck_assert_msg(!isfinite(l16), "fp16 loss %g", l16);
    ck_assert_msg(isfinite(lbf), "bf16 loss %g", lbf);
    ck_assert_int_ge(d->first_nonfinite, 0);
    ck_assert_str_eq(d->layer[d->first_nonfinite].name, "blocks.0.attn.scores");
    ck_assert(d->first_in_forward);
    /* the same forward without diagnostics gives the same (NaN) result */
    l16b = tiny_fwd(&a, NULL, NULL);
    ck_assert(isnan(l16) && isnan(l16b));
    tiny_bwd(&b, 1.0f, NULL);
    for (size_t i = 0; i < b.m.nparams; i++)
        ck_assert(isfinite(b.grads[i]));
    free(d);
    tiny_free(&a);
    tiny_free(&b);
}
END_TEST

/* Diagnostics see every layer and change no result: the same loss and gradients, bit for
 * bit, with and without them, in fp16 and in bf16 (which runs natively where the CPU has
 * it: there the heads round and store their outputs as they copy them, except under
 * diagnostics, which must see dQ and dK before they are rounded). */
static void diag_layers(gpu_dtype dt)
{
    tiny t;
    gpu_diag *d = calloc(1, sizeof *d);
    const char *want[] = {"blocks.0.attn.qkv",
                          "blocks.0.attn.scores",
                          "blocks.0.attn.proj",
                          "blocks.0.mlp.fc",
                          "blocks.0.mlp.proj",
                          "blocks.1.attn.qkv",
                          "blocks.1.attn.scores",
                          "blocks.1.attn.proj",
                          "blocks.1.mlp.fc",
                          "blocks.1.mlp.proj",
                          "lm_head"};
    ck_assert_ptr_nonnull(d);
    tiny_init(&t, dt, 10.0f, true, 25);
    float *g0 = malloc(sizeof(float) * t.m.nparams);
    ck_assert_ptr_nonnull(g0);
    double l0 = tiny_fwd(&t, NULL, NULL);
    tiny_bwd(&t, 256.0f, NULL);
    memcpy(g0, t.grads, sizeof(float) * t.m.nparams);
    gpu_diag_begin(d, 256.0f);
    double l1 = tiny_fwd(&t, d, NULL);
    tiny_bwd(&t, 256.0f, d);
    ck_assert(l0 == l1);
    ck_assert_msg(memcmp(g0, t.grads, sizeof(float) * t.m.nparams) == 0,
                  "%s: diagnostics changed the gradients", gpu_dtype_name(dt));
    ck_assert_int_eq(d->nlayers, 11);
    for (int i = 0; i < 11; i++) {
        ck_assert_str_eq(d->layer[i].name, want[i]);
        ck_assert_int_eq(d->layer[i].dtype, dt);
        ck_assert(d->layer[i].act_n > 0);
        ck_assert(d->layer[i].act_amax > 0);
        if (!strstr(want[i], "scores"))
            ck_assert(d->layer[i].grad_n > 0);
    }
    ck_assert_int_eq(d->first_nonfinite, -1);
    free(g0);
    free(d);
    tiny_free(&t);
}

START_TEST(test_diag_layers)
{
    diag_layers(GPU_FP16);
    diag_layers(GPU_BF16);
}
END_TEST

/* Autocast overrides move ops between dtypes (every cast path of the model): each variant
 * still computes the same function, within fp16's rounding of the fp32 run, and its
 * linear-layer gradients are fp16 values exactly when linear runs in fp16. */
START_TEST(test_overrides)
{
    static const struct {
        gpu_op op;
        gpu_cast_policy p;
    } cases[] = {
        {GPU_OP_LINEAR, GPU_CAST_FP32},     {GPU_OP_MATMUL, GPU_CAST_FP32},
        {GPU_OP_LAYER_NORM, GPU_CAST_LOWP}, {GPU_OP_GELU, GPU_CAST_FP32},
        {GPU_OP_SOFTMAX, GPU_CAST_LOWP},    {GPU_OP_ADD, GPU_CAST_LOWP},
        {GPU_OP_EMBEDDING, GPU_CAST_LOWP},  {GPU_OP_CROSS_ENTROPY, GPU_CAST_LOWP},
    };
    tiny ref;
    gpu_autocast d;
    gpu_autocast_defaults(&d);
    tiny_init_cfg(&ref, GPU_FP32, &d, 10.0f, true, 32, 5);
    double l32 = tiny_fwd(&ref, NULL, NULL);
    tiny_bwd(&ref, 1.0f, NULL);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        gpu_autocast a;
        tiny t;
        gpu_autocast_defaults(&a);
        a.policy[cases[c].op] = cases[c].p;
        tiny_init_cfg(&t, GPU_FP16, &a, 10.0f, true, 32, 5);
        double l = tiny_fwd(&t, NULL, NULL);
        tiny_bwd(&t, 64.0f, NULL);
        ck_assert_msg(fabs(l - l32) < 0.01, "%s=%s: loss %g vs %g", gpu_op_name(cases[c].op),
                      gpu_cast_policy_name(cases[c].p), l, l32);
        double e = rel_err(t.grads, 1.0f / 64, ref.grads, t.m.nparams);
        ck_assert_msg(e < 0.02, "%s=%s: gradients off by %g", gpu_op_name(cases[c].op),
                      gpu_cast_policy_name(cases[c].p), e);
        const gpu_gpt_tensor *qw = &t.m.tensor[4]; /* blocks.0.attn.qkv.weight */
        int not16 = 0;
        for (size_t j = 0; j < qw->count; j++)
            not16 += t.grads[qw->off + j] != gpu_round(t.grads[qw->off + j], GPU_FP16);
        ck_assert_int_eq(not16 > 0, t.m.lin_dt == GPU_FP32);
        tiny_free(&t);
    }
    tiny_free(&ref);
}
END_TEST

/* One forward and backward of model m (dtype dt, the heads as slots says) on the team's
 * current size: the loss and every gradient. */
static double threads_run(gpu_gpt *m, gpu_dtype dt, int slots, const float *params, float *grads)
{
    int B = m->max_batch, N = B * m->seq_len, c;
    int *x = malloc(sizeof(int) * N), *y = malloc(sizeof(int) * N);
    float *scratch = calloc(m->scratch_floats, sizeof(float));
    uint8_t *acts = calloc(1, m->act_bytes);
    void *work = malloc(4 * m->nparams);
    double loss;
    ck_assert(x && y && scratch && acts && work);
    for (int i = 0; i < N; i++) {
        x[i] = (i * 7 + i / 5) % m->vocab;
        y[i] = (i * 13 + 3) % m->vocab;
    }
    gpu_cvt_from_f32(work, dt, params, m->nparams);
    gpu_gpt_weights w = {.p = dt == GPU_FP32 ? (void *)params : work, .pdt = dt, .master = params};
    m->attn_slots = slots;
    ck_assert_int_eq(gpu_gpt_forward(m, &w, x, y, B, acts, scratch, NULL, &loss, &c), 0);
    ck_assert_int_eq(
        gpu_gpt_backward(m, &w, x, y, B, 256.0f, acts, scratch, NULL, grads, NULL), 0);
    free(x);
    free(y);
    free(scratch);
    free(acts);
    free(work);
    return loss;
}

static void set_team(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* The passes share work out by independent outputs only, so the loss and every gradient are
 * bit-identical on 1 and 3 threads, with the heads in order or side by side, in fp32, bf16
 * and fp16 with flash attention. The model (d 64, 4 heads, T 64, vocab 64, batch 4) is big
 * enough that every pass starts a team. */
START_TEST(test_threads_bitwise)
{
    static const struct {
        gpu_dtype dt;
        gpu_attention attn;
    } cases[] = {{GPU_FP32, GPU_ATTN_MATERIALIZED},
                 {GPU_BF16, GPU_ATTN_MATERIALIZED},
                 {GPU_FP16, GPU_ATTN_FLASH}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        gpu_model_config mc = {.type = GPU_MODEL_GPT,
                               .n_layer = 2,
                               .n_head = 4,
                               .d_model = 64,
                               .seq_len = 64,
                               .vocab = 64,
                               .init_scale = 1.0f,
                               .attention = cases[k].attn};
        gpu_autocast a;
        gpu_gpt m;
        gpu_rng r;
        char err[128];
        gpu_autocast_defaults(&a);
        /* 3 threads: the plan puts the heads side by side when the GEMMs allow it */
        ck_assert_int_eq(gpu_blas_init(3), 0);
        set_team(3);
        ck_assert_int_eq(gpu_gpt_plan(&m, &mc, &a, cases[k].dt, 4, err, sizeof err), 0);
        int planned = m.attn_slots;
        if (getenv("GPT_VERBOSE"))
            printf("threads: case %zu plans %d slots\n", k, planned);
        float *p = malloc(sizeof(float) * m.nparams), *g0 = calloc(m.nparams, sizeof(float));
        float *g = calloc(m.nparams, sizeof(float));
        ck_assert(p && g0 && g);
        gpu_rng_seed(&r, 40 + k);
        gpu_gpt_init_params(&m, p, 1.0f, &r);
        for (int i = 0; i < m.ntensors; i++)
            if (m.tensor[i].ndim == 1)
                for (size_t j = 0; j < m.tensor[i].count; j++)
                    p[m.tensor[i].off + j] += 0.2f * gpu_rng_normal(&r);
        set_team(1);
        double l0 = threads_run(&m, cases[k].dt, 1, p, g0);
        for (int run = 1; run < 4; run++) {
            set_team(run & 1 ? 3 : 1);
            double l = threads_run(&m, cases[k].dt, run < 3 ? planned : 1, p, g);
            ck_assert_msg(l == l0, "case %zu run %d: loss %.17g vs %.17g", k, run, l, l0);
            ck_assert_msg(memcmp(g, g0, sizeof(float) * m.nparams) == 0,
                          "case %zu run %d: gradients differ", k, run);
        }
        free(p);
        free(g0);
        free(g);
    }
}
END_TEST

/* Relative L2 distance of a from b over n floats. */
static double rel_l2(const float *a, const float *b, size_t n)
{
    double d = 0.0, r = 0.0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return r > 0.0 ? sqrt(d / r) : sqrt(d);
}

/* A bf16 GPT forwarded on the native GEMM path, whose layer 0 attention is then recomputed
 * by the public gpu_gpt_attention_fwd from fp32 values of the qkv the model stored. */
typedef struct {
    gpu_gpt m;
    int B, N;
    float *p, *qkv, *probs, *y, *ys, *sc, *scratch;
    int *x, *yt;
    uint8_t *acts;
    void *work;
    gpu_gpt_weights w;
} native_case;

/* qkv_gain multiplies the qkv weights (the scores by its square). */
static void native_case_init(native_case *k, const gpu_model_config *mc, int B, uint64_t seed,
                             float qkv_gain)
{
    gpu_autocast a;
    gpu_rng r;
    char err[128];
    memset(k, 0, sizeof *k);
    gpu_autocast_defaults(&a);
    ck_assert_int_eq(gpu_blas_init(2), 0);
    ck_assert_int_eq(gpu_gpt_plan(&k->m, mc, &a, GPU_BF16, B, err, sizeof err), 0);
    int T = mc->seq_len, C = mc->d_model, H = mc->n_head, N = B * T;
    k->B = B;
    k->N = N;
    k->p = malloc(sizeof(float) * k->m.nparams);
    k->qkv = malloc(sizeof(float) * N * 3 * C);
    k->probs = malloc(sizeof(float) * B * H * T * T);
    k->y = malloc(sizeof(float) * N * C);
    k->ys = malloc(sizeof(float) * N * C);
    k->sc = calloc(gpu_gpt_attention_scratch_floats(T, C / H, GPU_BF16, 2), sizeof(float));
    k->x = malloc(sizeof(int) * N);
    k->yt = malloc(sizeof(int) * N);
    k->acts = calloc(1, k->m.act_bytes);
    k->scratch = calloc(k->m.scratch_floats, sizeof(float));
    k->work = malloc(2 * k->m.nparams);
    ck_assert(k->p && k->qkv && k->probs && k->y && k->ys && k->sc && k->x && k->yt &&
              k->acts && k->scratch && k->work);
    gpu_rng_seed(&r, seed);
    gpu_gpt_init_params(&k->m, k->p, 1.0f, &r);
    for (size_t i = 0; i < (size_t)3 * C * C; i++)
        k->p[k->m.blk[0].qkv_w + i] *= qkv_gain;
    for (int i = 0; i < N; i++) {
        k->x[i] = (i * 11 + i / 3) % mc->vocab;
        k->yt[i] = (i * 5 + 1) % mc->vocab;
    }
    gpu_cvt_from_f32(k->work, GPU_BF16, k->p, k->m.nparams);
    k->w = (gpu_gpt_weights){.p = k->work, .pdt = GPU_BF16, .master = k->p};
}

/* The paths that plan bf16 GEMMs natively: oneDNN's kernels where the CPU has them, and
 * their emulation on every CPU. */
static const char *const native_paths[] = {"native", "emulated"};
#define NNATIVE ((int)(sizeof native_paths / sizeof native_paths[0]))

/* Forces native path i for the case fn; false, with the case's SKIP line, where this machine
 * lacks it (the native path: oneDNN's bf16 kernels need AVX512_BF16 or AMX). */
static bool use_native_path(const char *fn, int i)
{
    int rc = gpu_gemm_force(native_paths[i]);
    if (rc == GPU_ENODEV) {
        char have[64];
        gpu_gemm_paths(have, sizeof have);
        test_skip(fn, native_paths[i],
                  "no native bf16 GEMM on this CPU (oneDNN: %s; its bf16 kernels need "
                  "AVX512_BF16 or AMX; GEMM paths here: %s)",
                  gpu_dnnl_info() ? gpu_dnnl_info() : "not loaded", have);
        return false;
    }
    ck_assert_int_eq(rc, 0);
    return true;
}

/* The forward on a native path. Layer 0's saved probabilities that are fp32 subnormals
 * (*nsub of them) were noted as such when the heads stored them in bf16 (else the P V
 * product would have read them as zero); then its probabilities and output equal the public
 * attention's bit for bit. */
static double native_forward_is_public(native_case *k, const char *path, size_t *nsub)
{
    const gpu_gpt *m = &k->m;
    int T = m->seq_len, C = m->d_model, H = m->n_head, B = k->B, N = k->N, c;
    const float *P = (const float *)(const void *)(k->acts + m->act[0].probs);
    size_t PP = (size_t)B * H * T * T;
    double loss;
    ck_assert_int_eq(gpu_gemm_force(path), 0);
    ck_assert_int_eq(gpu_gpt_forward(m, &k->w, k->x, k->yt, B, k->acts, k->scratch, NULL, &loss,
                                     &c),
                     0);
    *nsub = 0;
    for (size_t i = 0; i < PP; i++)
        *nsub += P[i] != 0.0f && fabsf(P[i]) < FLT_MIN;
    ck_assert_msg(*nsub == 0 || gpu_bf16_subnormals_made(), "%zu subnormal P unnoted", *nsub);
    gpu_cvt_to_f32(k->qkv, k->acts + m->act[0].qkv, GPU_BF16, (size_t)N * 3 * C);
    ck_assert_int_eq(gpu_gpt_attention_fwd(k->qkv, B, T, C, H, GPU_BF16, m->sm_dt, k->probs,
                                           k->y, k->sc, 2, NULL, -1),
                     0);
    ck_assert(memcmp(k->probs, P, sizeof(float) * PP) == 0);
    gpu_cvt_to_f32(k->ys, k->acts + m->act[0].atty, GPU_BF16, (size_t)N * C);
    ck_assert(memcmp(k->y, k->ys, sizeof(float) * N * C) == 0);
    return loss;
}

static void native_case_free(native_case *k)
{
    free(k->p), free(k->qkv), free(k->probs), free(k->y), free(k->ys), free(k->sc);
    free(k->x), free(k->yt), free(k->acts), free(k->scratch), free(k->work);
    ck_assert_int_eq(gpu_gemm_force("auto"), 0);
}

/* Where bf16 runs natively, the attention heads multiply the qkv the model stored in bf16 as
 * it is (copied densely), and the public attention converts fp32 values of it: the two give
 * the same bits (layer 0's saved probabilities and output). The whole model's loss and
 * every gradient on the native path stay within 1% (measured: 0.16% at most) of the
 * widened path's (fp32 accumulation in another order); a head reading wrong rows would not.
 * On each native path this machine has (_i): oneDNN's kernels, or their emulation. */
START_TEST(test_native_bf16_heads)
{
    gpu_model_config mc = {.type = GPU_MODEL_GPT, .n_layer = 2, .n_head = 4, .d_model = 64,
                           .seq_len = 40, .vocab = 64, .init_scale = 1.0f};
    native_case k;
    int c;
    double lw;
    size_t nsub;
    if (!use_native_path(__func__, _i))
        return;
    native_case_init(&k, &mc, 3, 77, 1.0f);
    float *g = calloc(k.m.nparams, sizeof(float)), *gw = calloc(k.m.nparams, sizeof(float));
    ck_assert(g && gw);
    double loss = native_forward_is_public(&k, native_paths[_i], &nsub);
    ck_assert_int_eq(gpu_gpt_backward(&k.m, &k.w, k.x, k.yt, k.B, 1.0f, k.acts, k.scratch, NULL,
                                      g, NULL),
                     0);
    if (gpu_gemm_force("widen") != 0) /* fp32 on OpenBLAS where oneDNN has no fp32 kernels */
        ck_assert_int_eq(gpu_gemm_force("openblas"), 0);
    ck_assert_int_eq(gpu_gpt_forward(&k.m, &k.w, k.x, k.yt, k.B, k.acts, k.scratch, NULL, &lw, &c),
                     0);
    ck_assert_int_eq(gpu_gpt_backward(&k.m, &k.w, k.x, k.yt, k.B, 1.0f, k.acts, k.scratch, NULL,
                                      gw, NULL),
                     0);
    ck_assert_msg(fabs(loss - lw) <= 1e-3 * fabs(lw), "loss %.9g native vs %.9g", loss, lw);
    for (int i = 0; i < k.m.ntensors; i++) {
        const gpu_gpt_tensor *t = &k.m.tensor[i];
        double e = rel_l2(g + t->off, gw + t->off, t->count);
        if (getenv("GPT_VERBOSE"))
            printf("native heads: %s %.3g\n", t->name, e);
        ck_assert_msg(e < 1e-2, "%s: native gradient %.3g from the widened one", t->name, e);
    }
    free(g), free(gw);
    native_case_free(&k);
}
END_TEST

/* Scores large enough that many probabilities are fp32 subnormals: the native heads store
 * P in bf16 by themselves, and must say so (gpu_bf16_note_subnormal), or the P V product
 * would read those values as zero. Their P and output are the public attention's, bit for
 * bit, as with ordinary scores. Needs a process where no conversion has met a subnormal yet
 * (each test runs in its own; not so with CK_FORK=no). */
START_TEST(test_native_bf16_subnormal_probs)
{
    gpu_model_config mc = {.type = GPU_MODEL_GPT, .n_layer = 1, .n_head = 2, .d_model = 32,
                           .seq_len = 24, .vocab = 32, .init_scale = 1.0f};
    native_case k;
    if (!use_native_path(__func__, _i))
        return;
    if (gpu_bf16_subnormals_made()) {
        TEST_SKIP(native_paths[_i], "a conversion in this process already met a subnormal "
                                    "(CK_FORK=no runs every case in one process)");
        return;
    }
    size_t nsub;
    native_case_init(&k, &mc, 2, 78, 60.0f); /* scores x 3600 */
    ck_assert(!gpu_bf16_subnormals_made());
    native_forward_is_public(&k, native_paths[_i], &nsub);
    ck_assert_msg(nsub > 0, "no subnormal probability: the case tests nothing");
    native_case_free(&k);
}
END_TEST

/* The loss gradient seeded so small (seed = 2^-e, the loss scale a static or falling scaler
 * could reach) that the gradients reaching the linears, stored in bf16 for their GEMMs, hold
 * bf16 subnormals: the native kernels would read those as zero, so each such GEMM gives way to
 * the widened plan, which widens operands the native plan reads in place and so needs scratch
 * of its own. The model must plan that scratch: here the scratch and the activations are
 * guarded blocks (an inaccessible page right after each), so a GEMM that writes past the
 * planned scratch faults, and gpu_gemm_ex refuses a scratch shorter than its plan
 * (GPU_ESCRATCH). Before the fix the model planned the linears' GEMMs for fp32 operands and
 * a 300-step bf16 job corrupted the heap. Every backward succeeds, writes nothing outside
 * its blocks, gives way at least once (on its last seeds), and its gradients stay within 2%
 * (relative L2 per tensor) of the widened path's wherever those reach 2^-100. */
START_TEST(test_native_subnormal_grads)
{
    gpu_model_config mc = {.type = GPU_MODEL_GPT, .n_layer = 2, .n_head = 2, .d_model = 32,
                           .seq_len = 16, .vocab = 32, .init_scale = 1.0f};
    const char *path = native_paths[_i];
    if (!use_native_path(__func__, _i))
        return;
    gpu_autocast a;
    gpu_rng r;
    char err[128];
    gpu_gpt m;
    enum { B = 3 };
    int x[B * 16], y[B * 16];
    gpu_autocast_defaults(&a);
    ck_assert_int_eq(gpu_blas_init(2), 0);
    ck_assert_int_eq(gpu_gpt_plan(&m, &mc, &a, GPU_BF16, B, err, sizeof err), 0);
    gpu_guard_set(true);
    float *scratch = gpu_block_alloc(m.scratch_floats * sizeof(float), "scratch");
    uint8_t *acts = gpu_block_alloc(m.act_bytes, "activations");
    gpu_guard_set(false);
    float *p = malloc(sizeof(float) * m.nparams), *g = malloc(sizeof(float) * m.nparams);
    float *gw = malloc(sizeof(float) * m.nparams);
    uint16_t *work = malloc(2 * m.nparams);
    ck_assert(scratch && acts && p && g && gw && work);
    gpu_rng_seed(&r, 79);
    gpu_gpt_init_params(&m, p, 1.0f, &r);
    gpu_cvt_from_f32(work, GPU_BF16, p, m.nparams);
    for (int i = 0; i < B * 16; i++) {
        x[i] = (int)gpu_rng_below(&r, 32);
        y[i] = (int)gpu_rng_below(&r, 32);
    }
    gpu_gpt_weights w = {.p = work, .pdt = GPU_BF16, .master = p};
    size_t gave = gpu_gemm_native_gave_way();
    double loss;
    int c;
    for (int e = 96; e <= 132; e += 4) {
        float seed = ldexpf(1.0f, -e);
        ck_assert_int_eq(gpu_gemm_force(path), 0);
        ck_assert_int_eq(gpu_gpt_forward(&m, &w, x, y, B, acts, scratch, NULL, &loss, &c), 0);
        ck_assert_int_eq(gpu_gpt_backward(&m, &w, x, y, B, seed, acts, scratch, NULL, g, NULL), 0);
        ck_assert_msg(gpu_block_check(scratch, err, sizeof err) == 0, "2^-%d: %s", e, err);
        ck_assert_msg(gpu_block_check(acts, err, sizeof err) == 0, "2^-%d: %s", e, err);
        ck_assert_int_eq(gpu_gemm_force("openblas"), 0);
        ck_assert_int_eq(gpu_gpt_forward(&m, &w, x, y, B, acts, scratch, NULL, &loss, &c), 0);
        ck_assert_int_eq(gpu_gpt_backward(&m, &w, x, y, B, seed, acts, scratch, NULL, gw, NULL), 0);
        for (int i = 0; i < m.ntensors; i++) {
            const gpu_gpt_tensor *t = &m.tensor[i];
            double big = 0.0;
            for (size_t j = 0; j < t->count; j++)
                big = fmax(big, fabsf(gw[t->off + j]));
            if (big < 0x1p-100) /* mostly subnormal or zero: the order of sums decides */
                continue;
            double err2 = rel_l2(g + t->off, gw + t->off, t->count);
            if (getenv("GPT_VERBOSE"))
                printf("subnormal grads 2^-%d %s: %.3g (largest %g)\n", e, t->name, err2, big);
            ck_assert_msg(err2 < 2e-2, "2^-%d %s: %.3g from the widened path", e, t->name, err2);
        }
    }
    ck_assert_msg(gpu_gemm_native_gave_way() > gave, "no GEMM gave way: the case tests nothing");
    gpu_block_free(scratch);
    gpu_block_free(acts);
    free(p), free(g), free(gw), free(work);
    ck_assert_int_eq(gpu_gemm_force("auto"), 0);
}
END_TEST

/* Without master weights every op reads the 16-bit working copy: the same as a master that
 * holds exactly the working copy's values. */
START_TEST(test_no_master)
{
    tiny t;
    tiny_init(&t, GPU_BF16, 10.0f, true, 30);
    float *g0 = malloc(sizeof(float) * t.m.nparams);
    ck_assert_ptr_nonnull(g0);
    gpu_cvt_to_f32(t.params, t.work, GPU_BF16, t.m.nparams);
    double l0 = tiny_fwd(&t, NULL, NULL), l1;
    tiny_bwd(&t, 1.0f, NULL);
    memcpy(g0, t.grads, sizeof(float) * t.m.nparams);
    gpu_gpt_weights w = {.p = t.work, .pdt = GPU_BF16, .master = NULL};
    int c;
    ck_assert_int_eq(gpu_gpt_forward(&t.m, &w, t.x, t.y, TB, t.acts, t.scratch, NULL, &l1, &c), 0);
    ck_assert_int_eq(
        gpu_gpt_backward(&t.m, &w, t.x, t.y, TB, 1.0f, t.acts, t.scratch, NULL, t.grads, NULL), 0);
    ck_assert(l0 == l1);
    ck_assert(memcmp(g0, t.grads, sizeof(float) * t.m.nparams) == 0);
    free(g0);
    tiny_free(&t);
}
END_TEST

START_TEST(test_plan)
{
    gpu_model_config mc = {.type = GPU_MODEL_GPT,
                           .n_layer = 3,
                           .n_head = 4,
                           .d_model = 32,
                           .seq_len = 16,
                           .vocab = 50,
                           .init_scale = 1.0f};
    gpu_autocast a;
    gpu_gpt *m = malloc(sizeof *m);
    char err[128];
    ck_assert_ptr_nonnull(m);
    gpu_autocast_defaults(&a);
    ck_assert_int_eq(gpu_gpt_plan(m, &mc, &a, GPU_FP16, 4, err, sizeof err), 0);
    size_t C = 32, want = 50 * C + 16 * C + 3 * (12 * C * C + 13 * C) + 2 * C, sum = 0;
    ck_assert_uint_eq(m->nparams, want);
    ck_assert_int_eq(m->ntensors, 2 + 12 * 3 + 2);
    for (int i = 0; i < m->ntensors; i++) {
        ck_assert_uint_eq(m->tensor[i].off, sum);
        sum += m->tensor[i].count;
    }
    ck_assert_uint_eq(sum, want);
    ck_assert_str_eq(m->tensor[0].name, "wte");
    ck_assert_str_eq(m->tensor[1].name, "wpe");
    ck_assert_str_eq(m->tensor[2].name, "blocks.0.ln1.weight");
    ck_assert_str_eq(m->tensor[4].name, "blocks.0.attn.qkv.weight");
    ck_assert_int_eq(m->tensor[4].shape[0], 96);
    ck_assert_int_eq(m->tensor[4].shape[1], 32);
    ck_assert_str_eq(m->tensor[13].name, "blocks.0.mlp.proj.bias");
    ck_assert_str_eq(m->tensor[12].name, "blocks.0.mlp.proj.weight");
    ck_assert_int_eq(m->tensor[12].shape[0], 32);
    ck_assert_int_eq(m->tensor[12].shape[1], 128);
    ck_assert_str_eq(m->tensor[m->ntensors - 2].name, "ln_f.weight");
    ck_assert_str_eq(m->tensor[m->ntensors - 1].name, "ln_f.bias");
    /* the autocast mapping: matmuls low, softmax / layer norm / cross-entropy fp32, GELU in
     * its input's dtype, the embedding and the residual stream fp32 */
    ck_assert_int_eq(m->lin_dt, GPU_FP16);
    ck_assert_int_eq(m->mm_dt, GPU_FP16);
    ck_assert_int_eq(m->sm_dt, GPU_FP32);
    ck_assert_int_eq(m->ln_dt, GPU_FP32);
    ck_assert_int_eq(m->gelu_dt, GPU_FP16);
    ck_assert_int_eq(m->ce_dt, GPU_FP32);
    ck_assert_int_eq(m->emb_dt, GPU_FP32);
    ck_assert_int_eq(m->resid_dt, GPU_FP32);
    /* saved 16-bit activations: qkv is N x 3C halves */
    ck_assert_uint_ge(m->act[0].probs - m->act[0].qkv, 4 * 16 * 96 * 2);
    a.policy[GPU_OP_SOFTMAX] = GPU_CAST_LOWP;
    ck_assert_int_eq(gpu_gpt_plan(m, &mc, &a, GPU_BF16, 4, err, sizeof err), 0);
    ck_assert_int_eq(m->sm_dt, GPU_BF16);
    gpu_autocast_defaults(&a);
    ck_assert_int_eq(gpu_gpt_plan(m, &mc, &a, GPU_FP32, 4, err, sizeof err), 0);
    ck_assert_int_eq(m->lin_dt, GPU_FP32);
    ck_assert_int_eq(m->gelu_dt, GPU_FP32);
    /* malformed models name the field */
    mc.n_head = 5;
    ck_assert_int_eq(gpu_gpt_plan(m, &mc, &a, GPU_FP32, 4, err, sizeof err), GPU_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "model.n_head"));
    mc.n_head = 4;
    mc.n_layer = 0;
    ck_assert_int_eq(gpu_gpt_plan(m, &mc, &a, GPU_FP32, 4, err, sizeof err), GPU_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "model.n_layer"));
    mc.n_layer = 3;
    mc.vocab = 0;
    ck_assert_int_eq(gpu_gpt_plan(m, &mc, &a, GPU_FP32, 4, err, sizeof err), GPU_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "model.vocab"));
    mc.vocab = 50;
    mc.seq_len = 16384;
    mc.d_model = 16384;
    mc.n_layer = 48;
    ck_assert_int_eq(gpu_gpt_plan(m, &mc, &a, GPU_FP32, 4096, err, sizeof err), GPU_EINVAL);
    free(m);
}
END_TEST

/* GPT-2's init: weights N(0, 0.02 s), residual projections N(0, 0.02 s / sqrt(2 L)), biases
 * 0, layer norms 1 / 0. */
START_TEST(test_init)
{
    tiny t;
    tiny_init(&t, GPU_FP32, 2.0f, false, 26);
    for (int i = 0; i < t.m.ntensors; i++) {
        const gpu_gpt_tensor *g = &t.m.tensor[i];
        const float *p = t.params + g->off;
        double s2 = 0;
        for (size_t j = 0; j < g->count; j++)
            s2 += (double)p[j] * p[j];
        double sd = sqrt(s2 / g->count);
        if (strstr(g->name, ".bias"))
            ck_assert_double_eq(s2, 0.0);
        else if (strstr(g->name, "ln"))
            ck_assert_double_eq(sd, 1.0);
        else if (strstr(g->name, "proj.weight"))
            ck_assert_msg(fabs(sd - 0.04 / 2.0) < 0.2 * 0.02, "%s sd %g", g->name, sd);
        else
            ck_assert_msg(fabs(sd - 0.04) < 0.2 * 0.04, "%s sd %g", g->name, sd);
    }
    tiny_free(&t);
}
END_TEST

START_TEST(test_bad_tokens)
{
    tiny t;
    gpu_gpt_weights w;
    double loss;
    int c;
    tiny_init(&t, GPU_FP32, 1.0f, false, 27);
    w = tiny_weights(&t);
    t.x[3] = 11;
    ck_assert_int_eq(gpu_gpt_forward(&t.m, &w, t.x, t.y, TB, t.acts, t.scratch, NULL, &loss, &c),
                     GPU_EINVAL);
    t.x[3] = 0;
    t.y[4] = -1;
    ck_assert_int_eq(gpu_gpt_forward(&t.m, &w, t.x, t.y, TB, t.acts, t.scratch, NULL, &loss, &c),
                     GPU_EINVAL);
    t.y[4] = 0;
    ck_assert_int_eq(
        gpu_gpt_forward(&t.m, &w, t.x, t.y, TB + 1, t.acts, t.scratch, NULL, &loss, &c),
        GPU_EINVAL);
    tiny_free(&t);
}
END_TEST

/* A few hundred AdamW steps on a repetitive sequence (period 7 over a vocabulary of 11)
 * drive the loss from ln 11 to near 0, in every dtype (fp16 with a static loss scale), for
 * every one of TRAIN_SEEDS initialisations and data orders: a model that learns for one
 * seed only would pass a one-seed test by luck (when a small model leaves a plateau
 * depends on the seed). */
#define TRAIN_SEEDS 4
static void train(gpu_dtype dt, float scale, uint64_t seed)
{
    enum { T = 8, STEPS = 300 };
    tiny t;
    gpu_autocast a;
    gpu_optim_config oc;
    gpu_rng r;
    float *m1, *v1;
    double first = 0, last = 0;
    gpu_autocast_defaults(&a);
    tiny_init_cfg(&t, dt, &a, 1.0f, false, 28 + 2 * seed, T);
    gpu_optim_defaults(&oc);
    oc.lr = 1e-2f;
    m1 = calloc(t.m.nparams, sizeof(float));
    v1 = calloc(t.m.nparams, sizeof(float));
    ck_assert(m1 && v1);
    gpu_rng_seed(&r, 29 + 2 * seed);
    for (int s = 0; s < STEPS; s++) {
        for (int b = 0; b < TB; b++) {
            int start = (int)gpu_rng_below(&r, 1000);
            for (int i = 0; i < T; i++) {
                t.x[b * T + i] = (start + i) % 7 * 3 % 11;
                t.y[b * T + i] = (start + i + 1) % 7 * 3 % 11;
            }
        }
        double loss = tiny_fwd(&t, NULL, NULL);
        ck_assert_msg(isfinite(loss), "%s step %d: loss %g", gpu_dtype_name(dt), s, loss);
        if (s == 0)
            first = loss;
        last = loss;
        tiny_bwd(&t, scale, NULL);
        gpu_optim_update(&oc, oc.lr, s + 1, 1.0f / scale, t.params, t.grads, m1, v1, t.m.nparams,
                         dt == GPU_FP32 ? NULL : t.work, dt);
    }
    if (getenv("GPT_VERBOSE"))
        printf("train %s seed %d %.4f -> %.4f\n", gpu_dtype_name(dt), (int)seed, first, last);
    ck_assert_msg(first > 2.0 && last < 0.1, "%s, seed %d: loss %.4f -> %.4f", gpu_dtype_name(dt),
                  (int)seed, first, last);
    free(m1);
    free(v1);
    tiny_free(&t);
}

START_TEST(test_train)
{
    train(GPU_FP32, 1.0f, (uint64_t)_i);
    train(GPU_BF16, 1.0f, (uint64_t)_i);
    train(GPU_FP16, 1024.0f, (uint64_t)_i);
}
END_TEST

static Suite *gpt_suite(void)
{
    Suite *s = suite_create("gpt");
    TCase *ops = tcase_create("ops");
    TCase *model = tcase_create("model");
    tcase_add_test(ops, test_exp);
    tcase_add_test(ops, test_op_embedding);
    tcase_add_test(ops, test_op_layernorm);
    tcase_add_test(ops, test_op_attention);
    tcase_add_test(ops, test_op_flash);
    tcase_add_test(ops, test_flash_fp16);
    tcase_add_test(ops, test_flash_tracks_fp32);
    tcase_add_test(ops, test_flash_scores_stay_finite);
    tcase_add_test(ops, test_op_gelu);
    tcase_add_test(ops, test_op_bias_grad);
    tcase_add_test(ops, test_op_head);
    tcase_add_test(ops, test_fp16_mask_finite);
    tcase_add_test(model, test_plan);
    tcase_add_test(model, test_init);
    tcase_add_test(model, test_bad_tokens);
    tcase_add_test(model, test_model_fd);
    tcase_add_test(model, test_causal);
    tcase_add_test(model, test_fp16_tracks_fp32);
    tcase_add_test(model, test_bf16_tracks_fp32);
    tcase_add_test(model, test_overflow_fp16_not_bf16);
    tcase_add_test(model, test_diag_layers);
    tcase_add_test(model, test_no_master);
    tcase_add_test(model, test_threads_bitwise);
    tcase_add_loop_test(model, test_native_bf16_heads, 0, NNATIVE);
    tcase_add_loop_test(model, test_native_bf16_subnormal_probs, 0, NNATIVE);
    tcase_add_loop_test(model, test_native_subnormal_grads, 0, NNATIVE);
    tcase_add_test(model, test_overrides);
    tcase_add_loop_test(model, test_train, 0, TRAIN_SEEDS);
    tcase_set_timeout(model, 60);
    suite_add_tcase(s, ops);
    suite_add_tcase(s, model);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(gpt_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
