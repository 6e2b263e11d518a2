/*
 * check_cuda_ops.c - Check suite "cuda_ops": the CUDA kernels of the models' non-GEMM ops
 * (gpu/cuda/cuda_ops.cu, through tests/cudahost/ops_host.cu) against the CPU ops, in fp32,
 * fp16 and bf16, and the flash attention (gpu/cuda/cuda_attn.cu) against gpt.c's, in fp16
 * and bf16 (t_flash: within the dtype's rounding, its tolerances at check_flash; the
 * backward repeated bit for bit).
 *
 * References: the ops the CPU exports (gpu_gpt_embed_*, gpu_gpt_layernorm_*, gpu_gpt_gelu_*)
 * are called directly. The ops the CPU has only inside a larger function have a plain
 * reference here that follows the CPU code line by line: the MLP's activations, bias add,
 * bias gradient and cross-entropy (mlp.c epilogue_row, act_backward, bias_grad,
 * cross_entropy, ce_backward), the residual add (gpt.c resid_add), the GPT's cross-entropy
 * (gpt.c ce_row and the loops of gpu_gpt_head_fwd/_bwd) and the softmax part of the
 * attention (gpt.c gpu_gpt_attention_fwd/_bwd). t_references checks those references
 * against the real CPU model bit for bit where the model exposes the values: the attention
 * through its probs and dQ with an identity K (S = 2Q, dS = dQ exactly), the GPT cross-entropy
 * through the head with d_model 2 (logit = a + c exactly), the MLP cross-entropy and
 * activations through a one-input MLP. It needs no device, so it runs everywhere.
 *
 * Inputs: random values of the dtype at awkward sizes (1 x 1, C = 768 with N = 37, V = 50257
 * with 3 rows, T = 64 with 4 heads, rows > 256 for the chunked column sums, n = 1000003),
 * with zeros, subnormals, values that overflow fp16 (65504 + 65504 = inf), inf and NaN where
 * the CPU defines what happens; the attention's masked entries hold NaN and inf, which must
 * never be read.
 *
 * Tolerances, from how the kernels compute (cuda_ops.cu): they repeat the CPU's fp32
 * arithmetic operation for operation (no FMA, the CPU's exp polynomial, its 16 partial sums
 * per row, its row order in column sums up to 256 rows), so these must equal the CPU bit for
 * bit (NaN matching NaN, any payload): embedding forward and backward, layer norm (y, mean,
 * rstd, dx; dg/db up to 256 rows), GELU tanh, ReLU, bias add, residual add, the attention
 * softmax forward and backward, the GPT cross-entropy's probs and dlogits, and every
 * backward of the cross-entropy from given probs. Where the GPU's arithmetic legitimately
 * differs, a per-value bound (the slack) says by how much; a value may differ by the slack
 * plus one unit of its dtype (the final rounding), and at most 1% of the values may differ by
 * more than the slack (a rounding landing one unit away: rare unless something is
 * systematically wrong). Beyond 256 rows the column sums (dg, db, bias gradient) are summed
 * in another order: slack 1e-5 of the sum of the |terms|. The MLP's GELU uses the GPU's
 * erff/expf (glibc's on the CPU; each within 2 ulp): slack 4 fp32 ulp plus the error that
 * 1 + erf(x) amplifies (3e-7 |x| forward, 8e-7 |d| backward, from 3 ulp of erf near 1 and of
 * exp, plus the roundings). The MLP cross-entropy's probabilities
 * go through double exp and a double sum in another order: within one fp32 ulp for at most
 * 0.1% + 2 values. Summed losses (double): within 1e-12 of the sum of |z_y| + |max| +
 * |log sum| over the rows (the double log, and exp, differ by an ulp between libms). Hit
 * counts are exact. A NaN where the CPU has none, or the other way round, always fails.
 *
 * Without a device main prints "check_cuda_ops: SKIP: <why>" once, the device tests return
 * at once (the suite exits 77, SKIP), and t_nodev checks that every host wrapper reports
 * GPU_ENODEV and leaves its outputs alone.
 *
 * Threads: CK_NOFORK, as tests/check_cuda.c, so the CUDA state main's probe creates is the
 * one the tests use; every device test probes first.
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_ops.h"
#include "gpu/gpt.h"
#include "gpu/gpu_int.h"
#include "gpu/mlp.h"
#include "tests/cudahost/cudahost.h"
#include "tests/cudatest.h"

static const gpu_dtype DTS[3] = {GPU_FP32, GPU_FP16, GPU_BF16};

/* (low dtype, the dtype after it) pairs of the casts a job can make: lin/ce, mm/sm */
static const gpu_dtype PAIRS[][2] = {{GPU_FP32, GPU_FP32}, {GPU_FP16, GPU_FP32},
                                     {GPU_BF16, GPU_FP32}, {GPU_FP16, GPU_FP16},
                                     {GPU_BF16, GPU_BF16}, {GPU_FP32, GPU_FP16}};
#define NPAIRS (sizeof(PAIRS) / sizeof(PAIRS[0]))

static const float SPECIAL[] = {0.0f,    -0.0f,    1.0f,      -1.0f,    INFINITY, -INFINITY,
                                NAN,     65504.0f, -65504.0f, 3e38f,    -3e38f,   1e-40f,
                                -1e-40f, 6e-8f,    10.0f,     -10.0f,   20.0f,    -20.0f,
                                50.0f,   -50.0f,   100.0f,    -100.0f,  88.7f,    -88.7f,
                                1e4f,    -1e4f,    70000.0f,  -70000.0f};
#define NSPECIAL (sizeof(SPECIAL) / sizeof(SPECIAL[0]))

static float *fdup(const float *v, size_t n)
{
    float *p = xmalloc(n * sizeof(float));
    memcpy(p, v, n * sizeof(float));
    return p;
}

static const char *dn(gpu_dtype dt)
{
    return gpu_dtype_name(dt);
}

/* gpt.c's rnd and cast. */
static void rnd(float *v, size_t n, gpu_dtype dt)
{
    if (dt != GPU_FP32)
        gpu_round_n(v, v, n, dt);
}

static void cast(float *v, size_t n, gpu_dtype from, gpu_dtype to)
{
    if (to != GPU_FP32 && to != from)
        gpu_round_n(v, v, n, to);
}

/* n normal values times scale, rounded to dt. */
static void fill(gpu_rng *r, float *v, size_t n, float scale, gpu_dtype dt)
{
    for (size_t i = 0; i < n; i++)
        v[i] = gpu_rng_normal(r) * scale;
    rnd(v, n, dt);
}

/* The special values over the first elements of v, rounded to dt. */
static void put_specials(float *v, size_t n, gpu_dtype dt)
{
    for (size_t k = 0; k < n && k < NSPECIAL; k++)
        v[k] = gpu_round(SPECIAL[k], dt);
}

/* ---- comparison ----------------------------------------------------------------------------- */

/* The spacing of dt's values just above |x| (0 for inf and NaN). */
static float ulp_at(float x, gpu_dtype dt)
{
    float a = fabsf(x);
    if (!isfinite(a))
        return 0.0f;
    if (dt == GPU_FP16)
        return gpu_f16_to_f32((uint16_t)(gpu_f32_to_f16(a) + 1u)) - a;
    if (dt == GPU_BF16)
        return gpu_bf16_to_f32((uint16_t)(gpu_f32_to_bf16(a) + 1u)) - a;
    return nextafterf(a, INFINITY) - a;
}

static int64_t ord32(float x)
{
    uint32_t u = f2u(x);
    return (u & 0x80000000u) ? -(int64_t)(u & 0x7FFFFFFFu) : (int64_t)u;
}

static int64_t ord16(uint16_t h)
{
    return (h & 0x8000u) ? -(int64_t)(h & 0x7FFFu) : (int64_t)h;
}

/* Distance in units of dt's last place between two finite values of dt. */
static int64_t ulp_dist(float a, float b, gpu_dtype dt)
{
    int64_t d;
    if (dt == GPU_FP16)
        d = ord16(gpu_f32_to_f16(a)) - ord16(gpu_f32_to_f16(b));
    else if (dt == GPU_BF16)
        d = ord16(gpu_f32_to_bf16(a)) - ord16(gpu_f32_to_bf16(b));
    else
        d = ord32(a) - ord32(b);
    return d < 0 ? -d : d;
}

/* got against want, n values of dt: a NaN only where want has one; infinities equal; every
 * other value equal, or at most ulps units of dt's last place away, or (slack not NULL)
 * within slack[i] plus one unit of dt (the final rounding). At most max_off values may
 * differ by more than slack[i] (any difference counts without slack): the error the slack
 * explains is allowed everywhere, a rounding that lands one unit away only rarely. Fails the
 * test with the first bad value. */
static void expect_vals(const char *what, const float *got, const float *want, size_t n,
                        gpu_dtype dt, int64_t ulps, size_t max_off, const float *slack)
{
    size_t off = 0, first = n;
    for (size_t i = 0; i < n; i++) {
        float g = got[i], w = want[i];
        if (isnan(g) || isnan(w)) {
            if (!(isnan(g) && isnan(w)))
                ck_abort_msg("%s: [%zu] got %.9g, cpu %.9g (a NaN on one side only)", what, i,
                             (double)g, (double)w);
            continue;
        }
        if (dt != GPU_FP32 && gpu_round(g, dt) != g)
            ck_abort_msg("%s: [%zu] got %.9g, not a value of %s", what, i, (double)g, dn(dt));
        if (g == w)
            continue;
        if (isinf(g) || isinf(w))
            ck_abort_msg("%s: [%zu] got %.9g, cpu %.9g (an infinity on one side only)", what, i,
                         (double)g, (double)w);
        int64_t d = ulp_dist(g, w, dt);
        float diff = fabsf(g - w);
        if (d > ulps && !(slack != NULL && diff <= slack[i] + ulp_at(w, dt)))
            ck_abort_msg("%s: [%zu] got %.9g (%a), cpu %.9g (%a): %lld ulp of %s", what, i,
                         (double)g, (double)g, (double)w, (double)w, (long long)d, dn(dt));
        if (slack != NULL && diff <= slack[i])
            continue;
        if (first == n)
            first = i;
        off++;
    }
    if (off > max_off)
        ck_abort_msg("%s: %zu of %zu values differ (at most %zu allowed), the first [%zu]: got "
                     "%a, cpu %a",
                     what, off, n, max_off, first, (double)got[first], (double)want[first]);
}

static void expect_exact(const char *what, const float *got, const float *want, size_t n,
                         gpu_dtype dt)
{
    expect_vals(what, got, want, n, dt, 0, 0, NULL);
}

/* Sums over rows computed in another order: see the file comment. slack holds, per value,
 * 1e-5 of the sum of the |terms|. */
static void expect_sums(const char *what, const float *got, const float *want, size_t n,
                        gpu_dtype dt, const float *slack)
{
    expect_vals(what, got, want, n, dt, dt == GPU_FP32 ? 0 : 1, n / 100 + 1, slack);
}

/* Column sums over rows (bias and layer-norm weight gradients): the CPU's order up to 256
 * rows, partial sums beyond. */
static void expect_cols(const char *what, const float *got, const float *want, size_t n,
                        gpu_dtype dt, int rows, const float *slack)
{
    if (rows <= 256)
        expect_exact(what, got, want, n, dt);
    else
        expect_sums(what, got, want, n, dt, slack);
}

/* Summed losses (see the file comment); scale is the sum of the rows' magnitudes. */
static void expect_loss(const char *what, double got, double want, double scale)
{
    if (isnan(got) || isnan(want)) {
        if (!(isnan(got) && isnan(want)))
            ck_abort_msg("%s: loss %.17g, cpu %.17g (a NaN on one side only)", what, got, want);
        return;
    }
    if (isinf(got) || isinf(want)) {
        if (got != want)
            ck_abort_msg("%s: loss %.17g, cpu %.17g", what, got, want);
        return;
    }
    if (fabs(got - want) > 1e-12 * scale + 1e-300)
        ck_abort_msg("%s: loss %.17g, cpu %.17g (scale %.3g)", what, got, want, scale);
}

/* ---- plain CPU references (the CPU code, line by line) -------------------------------------- */

/* gpt.c's sum16. */
static float sum16(const float *v, int n)
{
    float acc[16] = {0};
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++)
            acc[k] += v[j + k];
    float s = 0.0f;
    for (; j < n; j++)
        s += v[j];
    for (int k = 0; k < 16; k++)
        s += acc[k];
    return s;
}

/* gpt.c's exp_shifted: p[j] = vexp(s[j] - mx) (gpu_gpt_exp is vexp); returns sum16(p). */
static float exp_shifted(float *p, const float *s, float mx, int n, float *tmp)
{
    for (int j = 0; j < n; j++)
        tmp[j] = s[j] - mx;
    gpu_gpt_exp(p, tmp, (size_t)n);
    return sum16(p, n);
}

/* gpt.c's softmax_row; tmp holds n floats. */
static void ref_softmax_row(const float *s, int n, float *p, float *tmp)
{
    float mx = s[0];
    for (int j = 1; j < n; j++)
        mx = s[j] > mx || s[j] != s[j] ? s[j] : mx;
    float sum = exp_shifted(p, s, mx, n, tmp);
    for (int j = 0; j < n; j++)
        p[j] = p[j] / sum;
}

/* gpt.c's softmax_row_bwd. */
static void ref_softmax_row_bwd(const float *p, float *d, int n)
{
    float acc[16] = {0}, dot = 0.0f;
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++)
            acc[k] += p[j + k] * d[j + k];
    for (; j < n; j++)
        dot += p[j] * d[j];
    for (int k = 0; k < 16; k++)
        dot += acc[k];
    for (j = 0; j < n; j++)
        d[j] = p[j] * (d[j] - dot);
}

static float attn_scale(int hd)
{
    return (float)(1.0 / sqrt((double)hd));
}

/* The softmax of gpu_gpt_attention_fwd on S = Q K^T [BH x T x T] (raw GEMM output). */
static void ref_attn_fwd(const float *S, int BH, int T, int hd, gpu_dtype mm, gpu_dtype sm,
                         float *P)
{
    size_t TT = (size_t)T * T;
    float scale = attn_scale(hd), *s = xmalloc(TT * 4), *tmp = xmalloc((size_t)T * 4);
    for (int bh = 0; bh < BH; bh++) {
        float *p = P + (size_t)bh * TT;
        memcpy(s, S + (size_t)bh * TT, TT * 4);
        rnd(s, TT, mm);
        for (size_t k = 0; k < TT; k++)
            s[k] *= scale;
        rnd(s, TT, mm);
        cast(s, TT, mm, sm);
        for (int i = 0; i < T; i++) {
            ref_softmax_row(s + (size_t)i * T, i + 1, p + (size_t)i * T, tmp);
            memset(p + (size_t)i * T + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
        }
        rnd(p, TT, sm);
    }
    free(s);
    free(tmp);
}

/* The softmax backward of gpu_gpt_attention_bwd, from P and dP = dY V^T (raw). */
static void ref_attn_bwd(const float *P, const float *dP, int BH, int T, int hd, gpu_dtype mm,
                         gpu_dtype sm, float *dS)
{
    size_t TT = (size_t)T * T;
    float scale = attn_scale(hd);
    for (int bh = 0; bh < BH; bh++) {
        float *d = dS + (size_t)bh * TT;
        const float *p = P + (size_t)bh * TT;
        memcpy(d, dP + (size_t)bh * TT, TT * 4);
        rnd(d, TT, mm);
        cast(d, TT, mm, sm);
        for (int i = 0; i < T; i++) {
            ref_softmax_row_bwd(p + (size_t)i * T, d + (size_t)i * T, i + 1);
            memset(d + (size_t)i * T + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
        }
        rnd(d, TT, sm);
        cast(d, TT, sm, mm);
        for (size_t k = 0; k < TT; k++)
            d[k] *= scale;
        rnd(d, TT, mm);
    }
}

/* gpt.c's ce_row; tmp holds V floats. */
static double ce_row(const float *z, int V, int target, float *p, int *arg, float *tmp)
{
    float mx = z[0];
    int a = 0;
    for (int j = 1; j < V; j++)
        if (z[j] > mx || z[j] != z[j]) {
            mx = z[j];
            a = j;
        }
    float sum = exp_shifted(p, z, mx, V, tmp);
    for (int j = 0; j < V; j++)
        p[j] = p[j] / sum;
    *arg = a;
    return -((double)z[target] - (double)mx - log((double)sum));
}

/* The cross-entropy of gpu_gpt_head_fwd on raw logits; *scale receives the sum of the rows'
 * magnitudes for expect_loss. */
static void ref_ce_gpt(const float *logits, const int *y, int N, int V, gpu_dtype lin,
                       gpu_dtype ce, float *probs, double *loss_sum, int *correct, double *scale)
{
    float *z = xmalloc((size_t)V * 4), *tmp = xmalloc((size_t)V * 4);
    double total = 0.0, mag = 0.0;
    int hits = 0;
    for (int i = 0; i < N; i++) {
        float *p = probs + (size_t)i * V;
        int arg;
        memcpy(z, logits + (size_t)i * V, (size_t)V * 4);
        rnd(z, (size_t)V, lin);
        cast(z, (size_t)V, lin, ce);
        double l = ce_row(z, V, y[i], p, &arg, tmp);
        total += l;
        hits += arg == y[i];
        rnd(p, (size_t)V, ce);
        mag += fabs((double)z[y[i]]) + fabs((double)z[arg]) + fabs(l) + 1.0;
    }
    *loss_sum = total;
    *correct = hits;
    *scale = mag;
    free(z);
    free(tmp);
}

/* mlp.c's cross_entropy on logits rounded to lin (the output of the last linear). */
static void ref_ce_mlp(const float *logits, const int *y, int N, int V, gpu_dtype lin,
                       gpu_dtype ce, float *probs, double *loss_sum, int *correct, double *scale)
{
    float *z = xmalloc((size_t)V * 4);
    double total = 0.0, mag = 0.0;
    *correct = 0;
    for (int i = 0; i < N; i++) {
        float *p = probs + (size_t)i * V;
        memcpy(z, logits + (size_t)i * V, (size_t)V * 4);
        rnd(z, (size_t)V, lin);
        float mx = z[0];
        int arg = 0;
        for (int j = 1; j < V; j++)
            if (z[j] > mx || isnan(z[j])) {
                mx = z[j];
                arg = j;
            }
        double sum = 0.0;
        for (int j = 0; j < V; j++)
            sum += exp((double)z[j] - mx);
        for (int j = 0; j < V; j++)
            p[j] = (float)(exp((double)z[j] - mx) / sum);
        double l = -((double)z[y[i]] - mx - log(sum));
        total += l;
        if (arg == y[i])
            (*correct)++;
        mag += fabs((double)z[y[i]]) + fabs((double)mx) + fabs(log(sum)) + 1.0;
    }
    gpu_round_n(probs, probs, (size_t)N * V, ce);
    *loss_sum = total;
    *scale = mag;
    free(z);
}

/* gpu_gpt_head_bwd's dlogits (GPT) or mlp.c's ce_backward (MLP), g = seed / count. */
static void ref_ce_bwd(gpu_cuda_ce_style style, const float *probs, const int *y, int N, int V,
                       gpu_dtype ce, gpu_dtype lin, float seed, int count, float *dl)
{
    float g = seed / (float)count;
    size_t n = (size_t)N * V;
    for (int i = 0; i < N; i++) {
        float *d = dl + (size_t)i * V;
        const float *p = probs + (size_t)i * V;
        if (style == GPU_CUDA_CE_GPT) {
            for (int j = 0; j < V; j++)
                d[j] = p[j] * g;
            d[y[i]] -= g;
        } else {
            for (int j = 0; j < V; j++)
                d[j] = (p[j] - (j == y[i] ? 1.0f : 0.0f)) * g;
        }
    }
    if (style == GPU_CUDA_CE_GPT) {
        rnd(dl, n, ce);
        cast(dl, n, ce, lin);
    } else {
        gpu_round_n(dl, dl, n, ce);
        gpu_round_n(dl, dl, n, lin);
    }
}

/* mlp.c's gelu and gelu_grad. */
static float ref_gelu_erf(float x)
{
    return 0.5f * x * (1.0f + erff(x * 0.70710678f));
}

static float ref_gelu_erf_grad(float x)
{
    return 0.5f * (1.0f + erff(x * 0.70710678f)) + x * expf(-0.5f * x * x) * 0.39894228f;
}

/* mlp.c's epilogue_row from the rounded linear output: activate, round to the act dtype. */
static void ref_act_fwd(gpu_activation act, float *dst, const float *z, size_t n, gpu_dtype dt)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = act == GPU_ACT_RELU ? (z[i] > 0.0f ? z[i] : 0.0f) : ref_gelu_erf(z[i]);
    gpu_round_n(dst, dst, n, dt);
}

/* mlp.c's act_backward for one row: saved is the ReLU's output or the GELU's input. */
static void ref_act_bwd(gpu_activation act, float *d, const float *saved, size_t n, gpu_dtype dt)
{
    gpu_round_n(d, d, n, dt);
    if (act == GPU_ACT_RELU) {
        for (size_t j = 0; j < n; j++)
            d[j] = saved[j] > 0.0f ? d[j] : 0.0f;
    } else {
        for (size_t j = 0; j < n; j++)
            d[j] *= ref_gelu_erf_grad(saved[j]);
        gpu_round_n(d, d, n, dt);
    }
}

/* The linear epilogue's bias add (gpt.c linear_fwd, mlp.c epilogue_row). */
static void ref_bias_add(float *out, const float *in, const float *bias, int rows, int n,
                         gpu_dtype dt)
{
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < n; j++)
            out[(size_t)i * n + j] = in[(size_t)i * n + j] + bias[j];
    rnd(out, (size_t)rows * n, dt);
}

/* mlp.c's bias_grad; slack (may be NULL) receives 1e-5 of each column's sum of |terms|. */
static void ref_bias_grad(float *db, const float *dz, int rows, int n, gpu_dtype dt,
                          float *slack)
{
    memset(db, 0, sizeof(float) * (size_t)n);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < n; j++)
            db[j] += dz[(size_t)i * n + j];
    rnd(db, (size_t)n, dt);
    for (int j = 0; slack != NULL && j < n; j++) {
        double s = 0.0;
        for (int i = 0; i < rows; i++)
            s += fabs((double)dz[(size_t)i * n + j]);
        slack[j] = (float)(1e-5 * s) + 1e-30f;
    }
}

/* gpt.c's resid_add. */
static void ref_resid_add(float *dst, const float *a, const float *b, size_t n, gpu_dtype dt)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = a[i] + b[i];
    rnd(dst, n, dt);
}

/* ---- without a device ----------------------------------------------------------------------- */

START_TEST(t_nodev)
{
    if (have_device())
        return;
    float in[16], out[16], keep[16];
    int x[4] = {0, 1, 0, 1};
    double loss = -1.0;
    int correct = -7;
    size_t bytes = 5;
    for (int i = 0; i < 16; i++)
        in[i] = out[i] = keep[i] = (float)i;
#define UNTOUCHED() ck_assert_mem_eq(out, keep, sizeof(out))
    ck_assert_int_eq(gpu_cuda_embed_fwd(x, 1, 2, 2, 2, in, in, GPU_FP32, GPU_FP32, out),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_embed_bwd(x, 1, 2, 2, 2, in, GPU_FP32, out, out), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_embed_bwd_workspace(2, &bytes), GPU_ENODEV);
    ck_assert_int_eq(gpu_cuda_layernorm_fwd(in, in, in, 2, 4, GPU_FP16, out, out, out),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_layernorm_bwd(in, in, in, in, in, 2, 4, GPU_BF16, out, out, out),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_gelu_tanh_fwd(out, in, 16, GPU_FP32), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_gelu_tanh_bwd(out, in, 16, GPU_FP16), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_act_fwd(GPU_ACT_GELU, out, in, 16, GPU_FP32), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_act_bwd(GPU_ACT_RELU, out, in, 16, GPU_FP32), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_bias_add(out, in, in, GPU_FP32, 4, 4, GPU_FP16), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_bias_grad(out, in, 4, 4, GPU_FP32), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_ce_fwd(GPU_CUDA_CE_GPT, in, GPU_FP32, x, 4, 4, GPU_FP32, GPU_FP32,
                                     out, &loss, &correct),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_ce_fused(GPU_CUDA_CE_MLP, out, GPU_FP32, x, 4, 4, GPU_FP16,
                                       GPU_FP32, 1.0f, 4, &loss, &correct),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert(loss == -1.0 && correct == -7);
    ck_assert_int_eq(gpu_cuda_ce_bwd(GPU_CUDA_CE_GPT, in, x, 4, 4, GPU_FP32, GPU_FP32, 1.0f, 4,
                                     out),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_attn_softmax_fwd(in, GPU_FP32, 1, 4, 4, GPU_FP16, GPU_FP32, out,
                                               out),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_attn_softmax_bwd(in, in, GPU_FP32, 1, 4, 4, GPU_FP16, GPU_FP32,
                                               out),
                     GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_flash_fwd(in, 1, 1, 16, 1, GPU_FP16, out, out), GPU_ENODEV);
    UNTOUCHED();
    ck_assert_int_eq(gpu_cuda_flash_bwd(in, in, in, in, 1, 1, 16, 1, GPU_FP16, out), GPU_ENODEV);
    UNTOUCHED();
#undef UNTOUCHED
}
END_TEST

/* ---- the references against the CPU model (no device needed) -------------------------------- */

/* Attention with hd >= T and K (and V) = k * identity per head: Q K^T = k Q exactly, and with
 * k = 1, dQ = dS K = dS exactly, so the model's probs and dQ expose the softmax. */
static void refs_attention(gpu_dtype mm, gpu_dtype sm)
{
    const int B = 2, H = 2, T = 37, hd = 40, C = H * hd, N = B * T, ld = 3 * C;
    size_t TT = (size_t)T * T, nS = (size_t)B * H * TT;
    float *qkv = xmalloc((size_t)N * ld * 4), *probs = xmalloc(nS * 4), *S = xmalloc(nS * 4);
    float *P = xmalloc(nS * 4), *y = xmalloc((size_t)N * C * 4), *dy = xmalloc((size_t)N * C * 4);
    float *dqkv = xmalloc((size_t)N * ld * 4), *dP = xmalloc(nS * 4), *dS = xmalloc(nS * 4);
    float *scratch = xmalloc(gpu_gpt_attention_scratch_floats(T, C / H, GPU_BF16, 1) * 4);
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 11);
    for (int pass = 0; pass < 2; pass++) {
        float k = pass == 0 ? 2.0f : 1.0f; /* pass 0: forward (2Q overflows fp16) */
        fill(&r, qkv, (size_t)N * ld, 3.0f, mm);
        for (int i = 0; i < N; i++)
            for (int c = 0; c < C; c++) {
                float *row = qkv + (size_t)i * ld;
                int t = i % T, j = c % hd;
                row[C + c] = j == t ? k : 0.0f;     /* K: row t of each head is k e_t */
                row[2 * C + c] = j == t ? 1.0f : 0.0f;
                if (pass == 0 && (i * 7 + c) % 23 == 0)
                    row[c] = gpu_round(40000.0f, mm);
            }
        ck_assert_int_eq(gpu_gpt_attention_fwd(qkv, B, T, C, H, mm, sm, probs, y, scratch, 1, NULL,
                                               -1),
                         0);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < T; i++)
                    for (int j = 0; j < T; j++)
                        S[(((size_t)b * H + h) * T + i) * T + j] =
                            k * qkv[((size_t)b * T + i) * ld + (size_t)h * hd + j];
        ref_attn_fwd(S, B * H, T, hd, mm, sm, P);
        snprintf(what, sizeof(what), "ref attention fwd mm %s sm %s", dn(mm), dn(sm));
        expect_exact(what, P, probs, nS, GPU_FP32);
        if (pass == 0)
            continue;
        fill(&r, dy, (size_t)N * C, 2.0f, mm);
        ck_assert_int_eq(gpu_gpt_attention_bwd(dy, qkv, probs, B, T, C, H, mm, sm, dqkv, scratch, 1,
                                               NULL, -1),
                         0);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < T; i++)
                    for (int j = 0; j < T; j++) {
                        size_t s = (((size_t)b * H + h) * T + i) * T + j;
                        size_t q = ((size_t)b * T + i) * ld + (size_t)h * hd + j;
                        dP[s] = dy[((size_t)b * T + i) * C + (size_t)h * hd + j];
                        S[s] = dqkv[q]; /* the model's dS */
                    }
        ref_attn_bwd(probs, dP, B * H, T, hd, mm, sm, dS);
        snprintf(what, sizeof(what), "ref attention bwd mm %s sm %s", dn(mm), dn(sm));
        expect_exact(what, dS, S, nS, GPU_FP32);
    }
    free(qkv);
    free(probs);
    free(S);
    free(P);
    free(y);
    free(dy);
    free(dqkv);
    free(dP);
    free(dS);
    free(scratch);
}

/* The GPT head with d_model 2: x = (a_i, 1), wte = (1, c_v), so logit = fl(a_i + c_v). */
static void refs_ce_gpt(gpu_dtype lin, gpu_dtype ce, int N, int V)
{
    const int C = 2;
    size_t n = (size_t)N * V;
    float *x = xmalloc((size_t)N * C * 4), *w = xmalloc((size_t)V * C * 4);
    float *logits = xmalloc(n * 4), *raw = xmalloc(n * 4), *probs = xmalloc(n * 4);
    float *p = xmalloc(n * 4), *dl = xmalloc(n * 4), *dl_ref = xmalloc(n * 4);
    float *dx = xmalloc((size_t)N * C * 4), *dw = xmalloc((size_t)V * C * 4);
    size_t gs = gpu_gpt_head_scratch_floats(N, C, V, GPU_FP16, GPU_FP16);
    size_t gb = gpu_gpt_head_scratch_floats(N, C, V, GPU_BF16, GPU_BF16);
    float *gscratch = xmalloc((gs > gb ? gs : gb) * 4 + 4);
    uint16_t *w16 = xmalloc((size_t)V * C * 2), *x16 = xmalloc((size_t)N * C * 2);
    int *y = xmalloc((size_t)N * sizeof(int)), hits, hits_ref;
    double loss, loss_ref, scale;
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 12);
    for (int i = 0; i < N; i++) {
        x[i * C] = gpu_round(gpu_rng_normal(&r) * 4.0f, lin);
        x[i * C + 1] = 1.0f;
        y[i] = (int)gpu_rng_below(&r, (uint32_t)V);
    }
    for (int v = 0; v < V; v++) {
        w[v * C] = 1.0f;
        w[v * C + 1] = gpu_round(gpu_rng_normal(&r) * 3.0f, lin);
    }
    for (int i = 0; i < N; i++) {
        for (int v = 0; v < V; v++)
            raw[(size_t)i * V + v] = x[i * C] + w[(size_t)v * C + 1];
        if (i % 3 != 0)
            continue;
        memcpy(p, raw + (size_t)i * V, (size_t)V * 4); /* every third row hits its target */
        rnd(p, (size_t)V, lin);
        cast(p, (size_t)V, lin, ce);
        y[i] = 0;
        for (int v = 1; v < V; v++)
            y[i] = p[v] > p[y[i]] ? v : y[i];
    }
    const void *wp = w, *xs = x;
    if (lin != GPU_FP32) {
        gpu_cvt_from_f32(w16, lin, w, (size_t)V * C);
        gpu_cvt_from_f32(x16, lin, x, (size_t)N * C);
        wp = w16;
        xs = x16;
    }
    ck_assert_int_eq(gpu_gpt_head_fwd(x, wp, lin, y, N, C, V, lin, ce, logits, probs, gscratch,
                                      NULL, -1, &loss, &hits),
                     0);
    ref_ce_gpt(raw, y, N, V, lin, ce, p, &loss_ref, &hits_ref, &scale);
    snprintf(what, sizeof(what), "ref ce gpt lin %s ce %s V %d", dn(lin), dn(ce), V);
    expect_exact(what, p, probs, n, GPU_FP32);
    ck_assert_msg(loss == loss_ref, "%s: loss %.17g, cpu %.17g", what, loss_ref, loss);
    ck_assert_int_eq(hits, hits_ref);
    ck_assert_int_ge(hits, 1);
    float g = 1024.0f / (float)N;
    ck_assert_int_eq(gpu_gpt_head_bwd(probs, y, xs, wp, lin, N, C, V, lin, ce, g, dl, dx, dw,
                                      gscratch, NULL, -1),
                     0);
    ref_ce_bwd(GPU_CUDA_CE_GPT, probs, y, N, V, ce, lin, 1024.0f, N, dl_ref);
    expect_exact(what, dl_ref, dl, n, GPU_FP32);
    free(x);
    free(w);
    free(logits);
    free(raw);
    free(probs);
    free(p);
    free(dl);
    free(dl_ref);
    free(dx);
    free(dw);
    free(gscratch);
    free(w16);
    free(x16);
    free(y);
}

/* A one-input MLP [1, V]: W = 1 and bias c, so the logits are rd(fl(a_i + c_v), lin). With
 * B = 1 and a_0 = 1 the weight gradient is dz itself. */
static void refs_ce_mlp(gpu_dtype dt, int B, int V)
{
    gpu_model_config mc = {.type = GPU_MODEL_MLP, .nlayers = 2, .activation = GPU_ACT_RELU,
                           .init_scale = 1.0f};
    gpu_autocast a;
    gpu_mlp m;
    char err[128], what[96];
    mc.layers[0] = 1;
    mc.layers[1] = V;
    gpu_autocast_defaults(&a);
    ck_assert_int_eq(gpu_mlp_plan(&m, &mc, &a, dt, B, err, sizeof(err)), 0);
    float *params = xmalloc(m.nparams * 4), *grads = xmalloc(m.nparams * 4);
    float *scratch = xmalloc(m.scratch_floats * 4), *x = xmalloc((size_t)B * 4);
    uint8_t *acts = xmalloc(m.act_bytes), *work = xmalloc(m.nparams * 4);
    float *raw = xmalloc((size_t)B * V * 4), *p = xmalloc((size_t)B * V * 4);
    float *dz = xmalloc((size_t)V * 4);
    int *y = xmalloc((size_t)B * sizeof(int)), hits, hits_ref;
    double loss, loss_ref, scale;
    gpu_rng r;
    gpu_rng_seed(&r, 13);
    for (int v = 0; v < V; v++) {
        params[m.w_off[0] + v] = 1.0f;
        params[m.b_off[0] + v] = gpu_round(gpu_rng_normal(&r) * 3.0f, dt);
    }
    for (int i = 0; i < B; i++) {
        x[i] = B == 1 ? 1.0f : gpu_round(gpu_rng_normal(&r) * 4.0f, dt);
        y[i] = (int)gpu_rng_below(&r, (uint32_t)V);
        for (int v = 0; v < V; v++)
            raw[(size_t)i * V + v] = x[i] + params[m.b_off[0] + v];
    }
    gpu_cvt_from_f32(work, dt, params, m.nparams);
    gpu_mlp_weights w = {work, dt, params, NULL, NULL, NULL};
    ck_assert_int_eq(gpu_mlp_forward(&m, &w, x, y, B, acts, scratch, &loss, &hits, NULL), 0);
    ref_ce_mlp(raw, y, B, V, m.lin_dt, m.ce_dt, p, &loss_ref, &hits_ref, &scale);
    snprintf(what, sizeof(what), "ref ce mlp %s B %d V %d", dn(dt), B, V);
    expect_exact(what, p, (const float *)(acts + m.probs_off), (size_t)B * V, GPU_FP32);
    ck_assert_msg(loss == loss_ref / B, "%s: loss %.17g, cpu %.17g", what, loss_ref / B, loss);
    ck_assert_int_eq(hits, hits_ref);
    if (B == 1) {
        ck_assert_int_eq(gpu_mlp_backward(&m, &w, y, B, 4096.0f, acts, scratch, grads, NULL, NULL), 0);
        ref_ce_bwd(GPU_CUDA_CE_MLP, p, y, B, V, m.ce_dt, m.lin_dt, 4096.0f, B, dz);
        expect_exact(what, dz, grads + m.w_off[0], (size_t)V, GPU_FP32);
    }
    free(params);
    free(grads);
    free(scratch);
    free(x);
    free(acts);
    free(work);
    free(raw);
    free(p);
    free(dz);
    free(y);
}

/* A one-input MLP [1, 1, 1] with W1 = 1, b1 = 0: the second layer's saved input is
 * rd(act(u_i), dt) for inputs u_i. */
static void refs_act(gpu_activation act, gpu_dtype dt)
{
    const int B = 1000;
    gpu_model_config mc = {.type = GPU_MODEL_MLP, .nlayers = 3, .activation = act,
                           .init_scale = 1.0f};
    gpu_autocast a;
    gpu_mlp m;
    char err[128], what[96];
    mc.layers[0] = mc.layers[1] = mc.layers[2] = 1;
    gpu_autocast_defaults(&a);
    ck_assert_int_eq(gpu_mlp_plan(&m, &mc, &a, dt, B, err, sizeof(err)), 0);
    float *params = xmalloc(m.nparams * 4), *scratch = xmalloc(m.scratch_floats * 4);
    float *u = xmalloc(B * 4), *want = xmalloc(B * 4), *got = xmalloc(B * 4);
    uint8_t *acts = xmalloc(m.act_bytes), *work = xmalloc(m.nparams * 4);
    int *y = calloc(B, sizeof(int)), hits;
    double loss;
    gpu_rng r;
    gpu_rng_seed(&r, 14);
    ck_assert_ptr_nonnull(y);
    for (size_t i = 0; i < m.nparams; i++)
        params[i] = 0.0f;
    params[m.w_off[0]] = params[m.w_off[1]] = 1.0f;
    fill(&r, u, B, 3.0f, dt);
    for (int i = 0; i < 24; i++) /* the specials but the overflowing 70000 */
        u[i] = gpu_round(SPECIAL[i], dt);
    gpu_cvt_from_f32(work, dt, params, m.nparams);
    gpu_mlp_weights w = {work, dt, params, NULL, NULL, NULL};
    ck_assert_int_eq(gpu_mlp_forward(&m, &w, u, y, B, acts, scratch, &loss, &hits, NULL), 0);
    ref_act_fwd(act, want, u, B, m.act_dt);
    rnd(want, B, m.lin_dt);
    gpu_cvt_to_f32(got, acts + m.x_off[1], m.lin_dt, B);
    snprintf(what, sizeof(what), "ref act %d %s", (int)act, dn(dt));
    expect_exact(what, got, want, B, GPU_FP32);
    free(params);
    free(scratch);
    free(u);
    free(want);
    free(got);
    free(acts);
    free(work);
    free(y);
}

START_TEST(t_references)
{
    for (size_t k = 0; k < NPAIRS; k++)
        refs_attention(PAIRS[k][0], PAIRS[k][1]);
    for (size_t k = 0; k < NPAIRS; k++) {
        refs_ce_gpt(PAIRS[k][0], PAIRS[k][1], 64, 1000);
        refs_ce_gpt(PAIRS[k][0], PAIRS[k][1], 200, 10);
        refs_ce_gpt(PAIRS[k][0], PAIRS[k][1], 5, 1);
    }
    refs_ce_gpt(GPU_BF16, GPU_FP32, 3, 50257);
    for (int d = 0; d < 3; d++) {
        refs_ce_mlp(DTS[d], 7, 10);
        refs_ce_mlp(DTS[d], 5, 1000);
        refs_ce_mlp(DTS[d], 1, 37);
        refs_act(GPU_ACT_RELU, DTS[d]);
        refs_act(GPU_ACT_GELU, DTS[d]);
    }
}
END_TEST

/* ---- embedding ------------------------------------------------------------------------------ */

static void check_embed(int B, int T, int C, int V, gpu_dtype wdt, gpu_dtype odt, uint64_t seed)
{
    size_t N = (size_t)B * T, nw = (size_t)V * C, np = (size_t)T * C, es = gpu_dtype_size(wdt);
    float *wte = xmalloc(nw * 4), *wpe = xmalloc(np * 4), *tmp = xmalloc((size_t)C * 4);
    float *want = xmalloc(N * C * 4), *got = xmalloc(N * C * 4), *dout = xmalloc(N * C * 4);
    float *dwte = xmalloc(nw * 4), *dwpe = xmalloc(np * 4);
    float *gwte = xmalloc(nw * 4), *gwpe = xmalloc(np * 4);
    void *wte_s = xmalloc(nw * es), *wpe_s = xmalloc(np * es);
    int *x = xmalloc(N * sizeof(int));
    char what[128];
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    fill(&r, wte, nw, 1.0f, wdt);
    fill(&r, wpe, np, 1.0f, wdt);
    for (int c = 0; c < C; c++) /* token 0 + position 0 overflows fp16 */
        wte[c] = gpu_round(60000.0f, wdt);
    wpe[0] = gpu_round(60000.0f, wdt);
    if (nw > 5)
        wte[nw - 3] = NAN;
    for (size_t i = 0; i < N; i++) /* many repeats: a third of the rows use 3 tokens */
        x[i] = (int)gpu_rng_below(&r, (uint32_t)(i % 3 == 0 && V > 3 ? 3 : V));
    x[0] = 0;
    gpu_cvt_from_f32(wte_s, wdt, wte, nw);
    gpu_cvt_from_f32(wpe_s, wdt, wpe, np);

    snprintf(what, sizeof(what), "embed fwd B %d T %d C %d V %d wdt %s out %s", B, T, C, V,
             dn(wdt), dn(odt));
    gpu_gpt_embed_fwd(x, B, T, C, wte_s, wpe_s, wdt, odt, want, tmp);
    ck_assert_int_eq(gpu_cuda_embed_fwd(x, B, T, C, V, wte_s, wpe_s, wdt, odt, got), 0);
    expect_exact(what, got, want, N * C, odt);

    /* backward: dout in odt, onto gradients that already hold values (the head's part) */
    fill(&r, dout, N * C, 0.5f, odt);
    if (N * C > 4) {
        dout[1] = gpu_round(65504.0f, odt);
        dout[N * C - 1] = NAN;
    }
    fill(&r, dwte, nw, 0.25f, GPU_FP32);
    fill(&r, dwpe, np, 0.25f, GPU_FP32);
    memcpy(gwte, dwte, nw * 4);
    memcpy(gwpe, dwpe, np * 4);
    gpu_gpt_embed_bwd(x, B, T, C, dout, dwte, dwpe);
    ck_assert_int_eq(gpu_cuda_embed_bwd(x, B, T, C, V, dout, odt, gwte, gwpe), 0);
    snprintf(what, sizeof(what), "embed bwd dwte B %d T %d C %d V %d %s", B, T, C, V, dn(odt));
    expect_exact(what, gwte, dwte, nw, GPU_FP32);
    snprintf(what, sizeof(what), "embed bwd dwpe B %d T %d C %d V %d %s", B, T, C, V, dn(odt));
    expect_exact(what, gwpe, dwpe, np, GPU_FP32);

    free(wte);
    free(wpe);
    free(tmp);
    free(want);
    free(got);
    free(dout);
    free(dwte);
    free(dwpe);
    free(gwte);
    free(gwpe);
    free(wte_s);
    free(wpe_s);
    free(x);
}

START_TEST(t_embed)
{
    if (!have_device())
        return;
    static const gpu_dtype combos[][2] = {{GPU_FP32, GPU_FP32}, {GPU_FP16, GPU_FP16},
                                          {GPU_BF16, GPU_BF16}, {GPU_FP32, GPU_FP16},
                                          {GPU_FP32, GPU_BF16}, {GPU_FP16, GPU_FP32},
                                          {GPU_BF16, GPU_FP32}};
    for (size_t k = 0; k < sizeof(combos) / sizeof(combos[0]); k++) {
        gpu_dtype w = combos[k][0], o = combos[k][1];
        check_embed(1, 1, 1, 1, w, o, 100 + k);
        check_embed(2, 5, 3, 7, w, o, 110 + k);
        check_embed(4, 64, 768, 300, w, o, 120 + k);
        check_embed(3, 17, 64, 50257, w, o, 130 + k);
    }
}
END_TEST

/* ---- layer norm ----------------------------------------------------------------------------- */

static void check_layernorm(int N, int C, gpu_dtype dt, uint64_t seed)
{
    size_t n = (size_t)N * C;
    float *x = xmalloc(n * 4), *g = xmalloc((size_t)C * 4), *b = xmalloc((size_t)C * 4);
    float *y = xmalloc(n * 4), *mean = xmalloc((size_t)N * 4), *rstd = xmalloc((size_t)N * 4);
    float *gy = xmalloc(n * 4), *gmean = xmalloc((size_t)N * 4), *grstd = xmalloc((size_t)N * 4);
    float *dy = xmalloc(n * 4), *dx = xmalloc(n * 4), *gdx = xmalloc(n * 4);
    float *dg = xmalloc((size_t)C * 4), *db = xmalloc((size_t)C * 4);
    float *gdg = xmalloc((size_t)C * 4), *gdb = xmalloc((size_t)C * 4);
    float *sg = xmalloc((size_t)C * 4), *sb = xmalloc((size_t)C * 4);
    char what[128];
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    for (int i = 0; i < N; i++) {
        float off = gpu_rng_normal(&r) * 3.0f, sc = 0.1f + 4.0f * gpu_rng_uniform(&r);
        for (int j = 0; j < C; j++)
            x[(size_t)i * C + j] = off + sc * gpu_rng_normal(&r);
    }
    for (int j = 0; j < C; j++) {
        x[j] *= 1000.0f;                   /* row 0: large values (finite in fp16) */
        if (N > 2)
            x[2 * (size_t)C + j] = 1.25f;  /* row 2: constant, variance 0 */
    }
    if (N > 3)
        x[3 * (size_t)C + C / 2] = INFINITY;
    if (N > 4)
        x[4 * (size_t)C] = NAN;
    rnd(x, n, dt);
    fill(&r, g, (size_t)C, 1.0f, GPU_FP32);
    fill(&r, b, (size_t)C, 0.5f, GPU_FP32);

    gpu_gpt_layernorm_fwd(x, g, b, N, C, dt, y, mean, rstd);
    ck_assert_int_eq(gpu_cuda_layernorm_fwd(x, g, b, N, C, dt, gy, gmean, grstd), 0);
    snprintf(what, sizeof(what), "layernorm fwd y N %d C %d %s", N, C, dn(dt));
    expect_exact(what, gy, y, n, dt);
    snprintf(what, sizeof(what), "layernorm fwd mean N %d C %d %s", N, C, dn(dt));
    expect_exact(what, gmean, mean, (size_t)N, GPU_FP32);
    snprintf(what, sizeof(what), "layernorm fwd rstd N %d C %d %s", N, C, dn(dt));
    expect_exact(what, grstd, rstd, (size_t)N, GPU_FP32);

    fill(&r, dy, n, 0.1f, dt);
    gpu_gpt_layernorm_bwd(dy, x, mean, rstd, g, N, C, dt, dx, dg, db);
    ck_assert_int_eq(gpu_cuda_layernorm_bwd(dy, x, mean, rstd, g, N, C, dt, gdx, gdg, gdb), 0);
    snprintf(what, sizeof(what), "layernorm bwd dx N %d C %d %s", N, C, dn(dt));
    expect_exact(what, gdx, dx, n, dt);
    for (int j = 0; j < C; j++) {
        double s1 = 0.0, s2 = 0.0;
        for (int i = 0; i < N; i++) {
            size_t o = (size_t)i * C + j;
            float xh = (x[o] - mean[i]) * rstd[i];
            s1 += fabs((double)dy[o] * xh);
            s2 += fabs((double)dy[o]);
        }
        sg[j] = (float)(1e-5 * s1) + 1e-30f;
        sb[j] = (float)(1e-5 * s2) + 1e-30f;
    }
    snprintf(what, sizeof(what), "layernorm bwd dg N %d C %d %s", N, C, dn(dt));
    expect_cols(what, gdg, dg, (size_t)C, dt, N, sg);
    snprintf(what, sizeof(what), "layernorm bwd db N %d C %d %s", N, C, dn(dt));
    expect_cols(what, gdb, db, (size_t)C, dt, N, sb);

    free(x);
    free(g);
    free(b);
    free(y);
    free(mean);
    free(rstd);
    free(gy);
    free(gmean);
    free(grstd);
    free(dy);
    free(dx);
    free(gdx);
    free(dg);
    free(db);
    free(gdg);
    free(gdb);
    free(sg);
    free(sb);
}

START_TEST(t_layernorm)
{
    if (!have_device())
        return;
    static const int shapes[][2] = {{1, 1},  {3, 5},    {37, 768}, {5, 17},
                                    {2, 16}, {256, 48}, {300, 48}, {4, 4100}};
    for (int d = 0; d < 3; d++)
        for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++)
            check_layernorm(shapes[k][0], shapes[k][1], DTS[d], 200 + 10 * d + k);
}
END_TEST

/* ---- GELU (tanh, GPT) ----------------------------------------------------------------------- */

START_TEST(t_gelu_tanh)
{
    if (!have_device())
        return;
    static const size_t sizes[] = {0, 1, 4099, 1000003};
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 300);
    for (int d = 0; d < 3; d++)
        for (size_t k = 0; k < 4; k++) {
            gpu_dtype dt = DTS[d];
            size_t n = sizes[k];
            float *u = xmalloc(n * 4), *want = xmalloc(n * 4), *got = xmalloc(n * 4);
            float *dw = xmalloc(n * 4), *dg = xmalloc(n * 4);
            fill(&r, u, n, 3.0f, dt);
            put_specials(u, n, dt);
            gpu_gpt_gelu_fwd(want, u, n, dt);
            ck_assert_int_eq(gpu_cuda_gelu_tanh_fwd(got, u, n, dt), 0);
            snprintf(what, sizeof(what), "gelu tanh fwd n %zu %s", n, dn(dt));
            expect_exact(what, got, want, n, dt);

            fill(&r, dw, n, 1.0f, dt);
            if (n > 40) {
                dw[30] = gpu_round(60000.0f, dt);
                dw[31] = INFINITY;
                dw[32] = NAN;
            }
            memcpy(dg, dw, n * 4);
            gpu_gpt_gelu_bwd(dw, u, n, dt);
            ck_assert_int_eq(gpu_cuda_gelu_tanh_bwd(dg, u, n, dt), 0);
            snprintf(what, sizeof(what), "gelu tanh bwd n %zu %s", n, dn(dt));
            expect_exact(what, dg, dw, n, dt);
            free(u);
            free(want);
            free(got);
            free(dw);
            free(dg);
        }
}
END_TEST

/* ---- MLP activations ------------------------------------------------------------------------ */

/* The MLP GELU's slack: scale * |v| for 1 + erf(x) and the libms' erff/expf, and 4 fp32 ulp
 * of the result (see the file comment). */
static void gelu_slack(float *slack, const float *v, const float *want, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++)
        slack[i] = scale * fabsf(v[i]) + 4.0f * ulp_at(want[i], GPU_FP32);
}

START_TEST(t_act)
{
    if (!have_device())
        return;
    static const size_t sizes[] = {1, 4099, 100003};
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 400);
    for (int a = 0; a < 2; a++)
        for (int d = 0; d < 3; d++)
            for (size_t k = 0; k < 3; k++) {
                gpu_activation act = a == 0 ? GPU_ACT_RELU : GPU_ACT_GELU;
                gpu_dtype dt = DTS[d];
                size_t n = sizes[k];
                float *z = xmalloc(n * 4), *want = xmalloc(n * 4), *got = xmalloc(n * 4);
                float *dw = xmalloc(n * 4), *dg = xmalloc(n * 4), *slack = xmalloc(n * 4);
                float *saved = xmalloc(n * 4);
                fill(&r, z, n, 2.0f, dt);
                put_specials(z, n, dt);
                ref_act_fwd(act, want, z, n, dt);
                ck_assert_int_eq(gpu_cuda_act_fwd(act, got, z, n, dt), 0);
                snprintf(what, sizeof(what), "act %s fwd n %zu %s", act ? "gelu" : "relu", n,
                         dn(dt));
                gelu_slack(slack, z, want, n, 3e-7f);
                if (act == GPU_ACT_RELU)
                    expect_exact(what, got, want, n, dt);
                else
                    expect_vals(what, got, want, n, dt, 0, n / 100 + 2, slack);

                /* backward: ReLU from its output, GELU from its input */
                if (act == GPU_ACT_RELU)
                    memcpy(saved, want, n * 4);
                else
                    memcpy(saved, z, n * 4);
                fill(&r, dw, n, 1.0f, GPU_FP32); /* rounded by the op */
                if (n > 40) {
                    dw[30] = 70000.0f;
                    dw[31] = NAN;
                }
                memcpy(dg, dw, n * 4);
                rnd(dg, n, dt); /* the wrapper stores d in dt */
                ref_act_bwd(act, dw, saved, n, dt);
                gelu_slack(slack, dg, dw, n, 8e-7f);
                ck_assert_int_eq(gpu_cuda_act_bwd(act, dg, saved, n, dt), 0);
                snprintf(what, sizeof(what), "act %s bwd n %zu %s", act ? "gelu" : "relu", n,
                         dn(dt));
                if (act == GPU_ACT_RELU)
                    expect_exact(what, dg, dw, n, dt);
                else
                    expect_vals(what, dg, dw, n, dt, 0, n / 100 + 2, slack);
                free(z);
                free(want);
                free(got);
                free(dw);
                free(dg);
                free(slack);
                free(saved);
            }
}
END_TEST

/* ---- bias add, bias gradient ---------------------------------------------------------------- */

START_TEST(t_bias)
{
    if (!have_device())
        return;
    static const int add_shapes[][2] = {{1, 1}, {37, 768}, {3, 50257}, {5, 33}};
    static const int grad_shapes[][2] = {{1, 1},  {37, 768},  {256, 10},
                                         {257, 10}, {4097, 65}, {0, 7}};
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 500);
    for (int d = 0; d < 3; d++) {
        gpu_dtype dt = DTS[d];
        for (size_t k = 0; k < 4; k++)
            for (int bs = 0; bs < 2; bs++) {
                gpu_dtype bdt = bs == 0 ? GPU_FP32 : dt;
                int rows = add_shapes[k][0], n = add_shapes[k][1];
                size_t tot = (size_t)rows * n;
                float *in = xmalloc(tot * 4), *bias = xmalloc((size_t)n * 4);
                float *want = xmalloc(tot * 4), *got = xmalloc(tot * 4);
                void *bias_s = xmalloc((size_t)n * gpu_dtype_size(bdt));
                fill(&r, in, tot, 100.0f, GPU_FP32); /* raw GEMM outputs */
                put_specials(in, tot, GPU_FP32);
                fill(&r, bias, (size_t)n, 1.0f, bdt);
                bias[0] = gpu_round(65504.0f, bdt);
                gpu_cvt_from_f32(bias_s, bdt, bias, (size_t)n);
                ref_bias_add(want, in, bias, rows, n, dt);
                ck_assert_int_eq(gpu_cuda_bias_add(got, in, bias_s, bdt, rows, n, dt), 0);
                snprintf(what, sizeof(what), "bias add %d x %d %s bias %s", rows, n, dn(dt),
                         dn(bdt));
                expect_exact(what, got, want, tot, dt);
                free(in);
                free(bias);
                free(want);
                free(got);
                free(bias_s);
            }
        for (size_t k = 0; k < sizeof(grad_shapes) / sizeof(grad_shapes[0]); k++) {
            int rows = grad_shapes[k][0], n = grad_shapes[k][1];
            size_t tot = (size_t)rows * n;
            float *dz = xmalloc(tot * 4), *want = xmalloc((size_t)n * 4);
            float *got = xmalloc((size_t)n * 4), *slack = xmalloc((size_t)n * 4);
            fill(&r, dz, tot, 0.01f, dt);
            if (tot > 3) {
                dz[0] = gpu_round(60000.0f, dt);
                dz[(size_t)n] = gpu_round(60000.0f, dt); /* column 0: inf in fp16 */
                dz[tot - 1] = NAN;
            }
            ref_bias_grad(want, dz, rows, n, dt, slack);
            for (int j = 0; j < n; j++)
                got[j] = 12345.0f;
            ck_assert_int_eq(gpu_cuda_bias_grad(got, dz, rows, n, dt), 0);
            snprintf(what, sizeof(what), "bias grad %d x %d %s", rows, n, dn(dt));
            expect_cols(what, got, want, (size_t)n, dt, rows, slack);
            free(dz);
            free(want);
            free(got);
            free(slack);
        }
    }
}
END_TEST

/* ---- cross-entropy -------------------------------------------------------------------------- */

/* Logits (raw, or values of ldt) with special rows: row 0 hits its target, row 1 has huge
 * logits (inf in fp16), row 2 a NaN, row 3 ties at the maximum, row 4 very negative values. */
static void ce_inputs(gpu_rng *r, float *lg, int *y, int N, int V, gpu_dtype ldt)
{
    size_t n = (size_t)N * V;
    fill(r, lg, n, 4.0f, GPU_FP32);
    for (int i = 0; i < N; i++)
        y[i] = (int)gpu_rng_below(r, (uint32_t)V);
    lg[y[0]] = 40.0f;
    if (N > 1)
        for (int j = 0; j < V; j += 3)
            lg[(size_t)V + j] = j % 2 ? 1e5f : -1e5f;
    if (N > 2)
        lg[2 * (size_t)V + V / 2] = NAN;
    if (N > 3 && V > 2) {
        lg[3 * (size_t)V + 1] = lg[3 * (size_t)V + V - 1] = 50.0f;
        y[3] = V - 1; /* the tie goes to the first: no hit */
    }
    if (N > 4)
        for (int j = 0; j < V; j += 2)
            lg[4 * (size_t)V + j] = -1e5f;
    rnd(lg, n, ldt);
}

static void check_ce(gpu_cuda_ce_style style, gpu_dtype lin, gpu_dtype ce, gpu_dtype ldt, int N,
                     int V, uint64_t seed)
{
    size_t n = (size_t)N * V;
    float *lg = xmalloc(n * 4), *p = xmalloc(n * 4), *gp = xmalloc(n * 4);
    float *dl = xmalloc(n * 4), *gdl = xmalloc(n * 4);
    int *y = xmalloc((size_t)N * sizeof(int)), hits, ghits = -1;
    double loss, gloss = -1.0, scale;
    const float seeds[2] = {65536.0f, 1073741824.0f}; /* the second overflows fp16 dlogits */
    char what[160];
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    ce_inputs(&r, lg, y, N, V, ldt);
    if (style == GPU_CUDA_CE_GPT)
        ref_ce_gpt(lg, y, N, V, lin, ce, p, &loss, &hits, &scale);
    else
        ref_ce_mlp(lg, y, N, V, lin, ce, p, &loss, &hits, &scale);
    snprintf(what, sizeof(what), "ce %s fwd N %d V %d lin %s ce %s logits %s",
             style == GPU_CUDA_CE_GPT ? "gpt" : "mlp", N, V, dn(lin), dn(ce), dn(ldt));
    ck_assert_int_eq(gpu_cuda_ce_fwd(style, lg, ldt, y, N, V, lin, ce, gp, &gloss, &ghits), 0);
    if (style == GPU_CUDA_CE_GPT)
        expect_exact(what, gp, p, n, ce);
    else
        expect_vals(what, gp, p, n, ce, 1, n / 1000 + 2, NULL);
    expect_loss(what, gloss, loss, scale);
    ck_assert_msg(ghits == hits, "%s: %d hits, cpu %d", what, ghits, hits);
    ck_assert_int_ge(hits, 1);

    for (int s = 0; s < 2; s++) {
        /* backward from the CPU's probs: the same fp32 arithmetic in both styles */
        ref_ce_bwd(style, p, y, N, V, ce, lin, seeds[s], N, dl);
        ck_assert_int_eq(gpu_cuda_ce_bwd(style, p, y, N, V, ce, lin, seeds[s], N, gdl), 0);
        snprintf(what, sizeof(what), "ce %s bwd N %d V %d lin %s ce %s seed %g",
                 style == GPU_CUDA_CE_GPT ? "gpt" : "mlp", N, V, dn(lin), dn(ce),
                 (double)seeds[s]);
        expect_exact(what, gdl, dl, n, lin);

        /* fused: the dlogits over the logits, stored in ldt */
        memcpy(gdl, lg, n * 4);
        gloss = -1.0;
        ghits = -1;
        ck_assert_int_eq(gpu_cuda_ce_fused(style, gdl, ldt, y, N, V, lin, ce, seeds[s], N,
                                           &gloss, &ghits),
                         0);
        snprintf(what, sizeof(what), "ce %s fused N %d V %d lin %s ce %s logits %s seed %g",
                 style == GPU_CUDA_CE_GPT ? "gpt" : "mlp", N, V, dn(lin), dn(ce), dn(ldt),
                 (double)seeds[s]);
        if (style == GPU_CUDA_CE_GPT)
            expect_exact(what, gdl, dl, n, lin);
        else
            expect_vals(what, gdl, dl, n, lin, 1, n / 1000 + 2, NULL);
        expect_loss(what, gloss, loss, scale);
        ck_assert_int_eq(ghits, hits);
    }
    free(lg);
    free(p);
    free(gp);
    free(dl);
    free(gdl);
    free(y);
}

START_TEST(t_ce)
{
    if (!have_device())
        return;
    static const int shapes[][2] = {{1, 1}, {3, 50257}, {37, 10}, {64, 1000}, {6, 17}};
    for (int st = 0; st < 2; st++)
        for (size_t k = 0; k < NPAIRS; k++)
            for (int l = 0; l < 2; l++)
                for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
                    gpu_dtype lin = PAIRS[k][0], ce = PAIRS[k][1];
                    check_ce(st == 0 ? GPU_CUDA_CE_GPT : GPU_CUDA_CE_MLP, lin, ce,
                             l == 0 ? GPU_FP32 : lin, shapes[s][0], shapes[s][1],
                             700 + 100 * st + 10 * k + 5 * l + s);
                }
}
END_TEST

/* ---- attention softmax ---------------------------------------------------------------------- */

/* Scores: normal values in the causal part with special rows, garbage above the diagonal
 * (NaN, inf, huge) that must never be read. */
static void attn_inputs(gpu_rng *r, float *S, int BH, int T, float scale, gpu_dtype sdt)
{
    size_t TT = (size_t)T * T;
    fill(r, S, (size_t)BH * TT, scale, GPU_FP32);
    for (int bh = 0; bh < BH; bh++)
        for (int i = 0; i < T; i++) {
            float *row = S + (size_t)bh * TT + (size_t)i * T;
            for (int j = i + 1; j < T; j++)
                row[j] = (j % 3 == 0) ? NAN : (j % 3 == 1 ? INFINITY : -3e38f);
            if (bh != 0 || i < 3)
                continue;
            if (i == 3)
                row[1] = 1e5f;      /* inf in fp16: the row becomes NaN */
            else if (i == 4)
                row[i] = NAN;
            else if (i == 5)
                for (int j = 0; j <= i; j++)
                    row[j] = 2.5f;
            else if (i == 6)
                for (int j = 0; j <= i; j += 2)
                    row[j] = -1e5f; /* -inf in fp16: probability 0 */
            else if (i == 7)
                for (int j = 0; j <= i; j++)
                    row[j] = -1e5f; /* all -inf in fp16: NaN */
        }
    for (size_t k = 0; k < (size_t)BH * TT; k++) /* values of sdt where they are read */
        if (isfinite(S[k]))
            S[k] = gpu_round(S[k], sdt);
}

static void check_attn(int BH, int T, int hd, gpu_dtype mm, gpu_dtype sm, gpu_dtype sdt,
                       uint64_t seed)
{
    size_t n = (size_t)BH * T * T;
    float *S = xmalloc(n * 4), *P = xmalloc(n * 4), *gP = xmalloc(n * 4), *Pm = xmalloc(n * 4);
    float *gPm = xmalloc(n * 4), *dP = xmalloc(n * 4), *dS = xmalloc(n * 4);
    float *gdS = xmalloc(n * 4);
    char what[128];
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    attn_inputs(&r, S, BH, T, 8.0f, sdt);
    ref_attn_fwd(S, BH, T, hd, mm, sm, P);
    memcpy(Pm, P, n * 4);
    rnd(Pm, n, mm);
    ck_assert_int_eq(gpu_cuda_attn_softmax_fwd(S, sdt, BH, T, hd, mm, sm, gP, gPm), 0);
    snprintf(what, sizeof(what), "attn fwd BH %d T %d hd %d mm %s sm %s S %s", BH, T, hd, dn(mm),
             dn(sm), dn(sdt));
    expect_exact(what, gP, P, n, sm);
    expect_exact(what, gPm, Pm, n, mm);

    attn_inputs(&r, dP, BH, T, 2.0f, sdt);
    ref_attn_bwd(P, dP, BH, T, hd, mm, sm, dS);
    ck_assert_int_eq(gpu_cuda_attn_softmax_bwd(P, dP, sdt, BH, T, hd, mm, sm, gdS), 0);
    snprintf(what, sizeof(what), "attn bwd BH %d T %d hd %d mm %s sm %s dP %s", BH, T, hd,
             dn(mm), dn(sm), dn(sdt));
    expect_exact(what, gdS, dS, n, mm);
    free(S);
    free(P);
    free(gP);
    free(Pm);
    free(gPm);
    free(dP);
    free(dS);
    free(gdS);
}

START_TEST(t_attn)
{
    if (!have_device())
        return;
    static const int shapes[][3] = {{1, 1, 1}, {8, 64, 64}, {2, 17, 20}, {1, 200, 64},
                                    {3, 33, 7}};
    for (size_t k = 0; k < NPAIRS; k++)
        for (int s = 0; s < 2; s++)
            for (size_t h = 0; h < sizeof(shapes) / sizeof(shapes[0]); h++) {
                gpu_dtype mm = PAIRS[k][0], sm = PAIRS[k][1];
                check_attn(shapes[h][0], shapes[h][1], shapes[h][2], mm, sm,
                           s == 0 ? GPU_FP32 : mm, 900 + 10 * k + 5 * s + h);
            }
}
END_TEST

/* ---- flash attention ------------------------------------------------------------------------ */

/* ||a - b|| / ||b|| over n values, and whether a holds a NaN or inf where b has none. */
static double norm_err(const float *a, const float *b, size_t n, bool *bad)
{
    double num = 0, den = 0;
    *bad = false;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) && isfinite(b[i]))
            *bad = true;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The flash kernels against gpu_gpt_flash_fwd / _bwd on random values of dt (scale: q and k
 * are N(0, scale^2)). The online softmax rounds other (unnormalised) values of P than the CPU
 * does, so outputs agree within the dtype's rounding: ||gpu - cpu|| / ||cpu|| <= 2 u for y
 * and for each of dQ, dK, dV (u = 2^-11 fp16, 2^-8 bf16), lse within 1e-5; the backward is
 * repeated and must give the same bits. */
static void check_flash(int B, int T, int H, int hd, gpu_dtype dt, float scale, uint64_t seed)
{
    bool one_hot = scale > 10.0f; /* dS ~ 0: only finiteness and the forward are compared */
    int C = H * hd;
    size_t n = (size_t)B * T * C, nl = (size_t)B * H * T;
    float *qkv = xmalloc(3 * n * 4), *y = xmalloc(n * 4), *gy = xmalloc(n * 4);
    float *dy = xmalloc(n * 4), *dq = xmalloc(3 * n * 4), *gdq = xmalloc(3 * n * 4);
    float *gdq2 = xmalloc(3 * n * 4), *lse = xmalloc(nl * 4), *glse = xmalloc(nl * 4);
    float *scratch = xmalloc(gpu_gpt_attention_scratch_floats(T, hd, GPU_BF16, 1) * 4);
    double u = dt == GPU_FP16 ? 0x1p-11 : 0x1p-8;
    char what[128];
    bool bad;
    gpu_rng r;
    gpu_rng_seed(&r, seed);
    for (size_t i = 0; i < 3 * n; i++)
        qkv[i] = gpu_round(gpu_rng_normal(&r) * (i % (3 * C) < 2 * (size_t)C ? scale : 1.0f), dt);
    for (size_t i = 0; i < n; i++)
        dy[i] = gpu_round(gpu_rng_normal(&r), dt);
    snprintf(what, sizeof(what), "flash B %d T %d H %d hd %d %s", B, T, H, hd, dn(dt));
    ck_assert_int_eq(gpu_gpt_flash_fwd(qkv, B, T, C, H, dt, lse, y, scratch, 1), 0);
    ck_assert_int_eq(gpu_cuda_flash_fwd(qkv, B, T, C, H, dt, glse, gy), 0);
    double e = norm_err(gy, y, n, &bad);
    if (getenv("FLASH_VERBOSE"))
        printf("%s: y %.3g u\n", what, e / u);
    ck_assert_msg(!bad && e <= 2 * u, "%s: y off by %.3g (relative norm)", what, e);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(gy[i] == gpu_round(gy[i], dt), "%s: y[%zu] not %s", what, i, dn(dt));
    for (size_t i = 0; i < nl; i++)
        ck_assert_msg(fabsf(glse[i] - lse[i]) <= 1e-5f * (1 + fabsf(lse[i])), "%s: lse[%zu] %g vs %g",
                      what, i, glse[i], lse[i]);
    ck_assert_int_eq(gpu_gpt_flash_bwd(dy, qkv, y, lse, B, T, C, H, dt, dq, scratch, 1, NULL, -1),
                     0);
    ck_assert_int_eq(gpu_cuda_flash_bwd(dy, qkv, y, lse, B, T, C, H, dt, gdq), 0);
    ck_assert_int_eq(gpu_cuda_flash_bwd(dy, qkv, y, lse, B, T, C, H, dt, gdq2), 0);
    ck_assert_msg(memcmp(gdq, gdq2, 3 * n * 4) == 0, "%s: the backward is not deterministic", what);
    for (int part = 0; part < 3; part++) { /* dQ, dK, dV: columns [part C, part C + C) */
        float *a = xmalloc(n * 4), *b = xmalloc(n * 4);
        for (size_t row = 0; row < (size_t)B * T; row++)
            for (int c = 0; c < C; c++) {
                a[row * C + c] = gdq[row * 3 * C + part * C + c];
                b[row * C + c] = dq[row * 3 * C + part * C + c];
            }
        e = norm_err(a, b, n, &bad);
        if (getenv("FLASH_VERBOSE"))
            printf("%s: d%c %.3g u\n", what, "qkv"[part], e / u);
        ck_assert_msg(!bad && (one_hot || e <= 2 * u), "%s: d%c off by %.3g (relative norm)", what,
                      "qkv"[part], e);
        free(a);
        free(b);
    }
    for (size_t i = 0; i < 3 * n; i++)
        ck_assert_msg(gdq[i] == gpu_round(gdq[i], dt), "%s: dqkv[%zu] not %s", what, i, dn(dt));
    free(qkv);
    free(y);
    free(gy);
    free(dy);
    free(dq);
    free(gdq);
    free(gdq2);
    free(lse);
    free(glse);
    free(scratch);
}

START_TEST(t_flash)
{
    if (!have_device())
        return;
    /* every head_dim and dtype; one and several 64-row tiles, partial tiles, H > B */
    check_flash(1, 1, 1, 16, GPU_FP16, 1.0f, 71);
    check_flash(2, 70, 2, 32, GPU_BF16, 1.0f, 72);
    check_flash(1, 130, 1, 48, GPU_FP16, 1.5f, 73);
    check_flash(1, 129, 2, 64, GPU_BF16, 1.0f, 74);
    check_flash(2, 64, 3, 64, GPU_FP16, 0.5f, 75);
    /* scores far beyond fp16's range (q.k ~ 4e5): fp32 inside, so finite; the softmax is
     * one-hot, so the gradients are rounding noise around 0 and only checked finite */
    check_flash(1, 40, 1, 16, GPU_FP16, 160.0f, 76);
    ck_assert(gpu_cuda_flash_supported(64) && !gpu_cuda_flash_supported(8) &&
              !gpu_cuda_flash_supported(80) && !gpu_cuda_flash_supported(24));
    float v[3 * 16] = {0}, lse[1], y[16];
    ck_assert_int_eq(gpu_cuda_flash_fwd(v, 1, 1, 16, 1, GPU_FP32, lse, y), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_flash_fwd(v, 1, 1, 8, 1, GPU_FP16, lse, y), GPU_EINVAL);
}
END_TEST

/* ---- launch forms with mixed storage dtypes ------------------------------------------------- */

/* A device copy of n fp32 values stored in dt. */
static void *dput(const float *h, size_t n, gpu_dtype dt)
{
    size_t bytes = n * gpu_dtype_size(dt);
    void *d = NULL, *tmp = xmalloc(bytes);
    gpu_cvt_from_f32(tmp, dt, h, n);
    ck_assert_int_eq(cudaMalloc(&d, bytes ? bytes : 1), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(d, tmp, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    free(tmp);
    return d;
}

/* n values of a device tensor stored in dt, as fp32. */
static void dget(float *h, const void *d, size_t n, gpu_dtype dt)
{
    size_t bytes = n * gpu_dtype_size(dt);
    void *tmp = xmalloc(bytes);
    ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(tmp, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    gpu_cvt_to_f32(h, tmp, dt, n);
    free(tmp);
}

/* The casts of gpt.c's ln_fwd/ln_bwd, gelu_*_chunked and embedding: inputs stored
 * wider than the op's dtype (rounded on load), outputs stored in another dtype. */
START_TEST(t_mixed)
{
    if (!have_device())
        return;
    enum { N = 37, C = 96, V = 50, T = 37 };
    size_t n = (size_t)N * C;
    float *x = xmalloc(n * 4), *xr = xmalloc(n * 4), *g = xmalloc(C * 4), *b = xmalloc(C * 4);
    float *want = xmalloc(n * 4), *got = xmalloc(n * 4), *mean = xmalloc(N * 4);
    float *rstd = xmalloc(N * 4), *dy = xmalloc(n * 4), *dg = xmalloc(C * 4);
    float *db = xmalloc(C * 4), *wte = xmalloc((size_t)V * C * 4), *wpe = xmalloc(n * 4);
    float *tmp = xmalloc(C * 4);
    int *tok = xmalloc(N * sizeof(int));
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 1000);
    fill(&r, x, n, 3.0f, GPU_FP32); /* the fp32 stream: not values of the low dtypes */
    fill(&r, g, C, 1.0f, GPU_FP32);
    fill(&r, b, C, 1.0f, GPU_FP32);
    void *d_g = dput(g, C, GPU_FP32), *d_b = dput(b, C, GPU_FP32);
    float *d_mean, *d_rstd, *d_dg, *d_db;
    ck_assert_int_eq(cudaMalloc((void **)&d_mean, N * 4), cudaSuccess);
    ck_assert_int_eq(cudaMalloc((void **)&d_rstd, N * 4), cudaSuccess);
    ck_assert_int_eq(cudaMalloc((void **)&d_dg, C * 4), cudaSuccess);
    ck_assert_int_eq(cudaMalloc((void **)&d_db, C * 4), cudaSuccess);

    for (int d = 1; d < 3; d++) {
        gpu_dtype low = DTS[d];
        /* layer norm in low on the fp32 stream, output kept in fp32 storage */
        void *d_x = dput(x, n, GPU_FP32), *d_y = dput(x, n, GPU_FP32);
        memcpy(xr, x, n * 4);
        rnd(xr, n, low);
        gpu_gpt_layernorm_fwd(xr, g, b, N, C, low, want, mean, rstd);
        ck_assert_int_eq(gpu_cuda_layernorm_fwd_launch(d_x, GPU_FP32, d_g, d_b, GPU_FP32, N, C,
                                                       low, d_y, GPU_FP32, d_mean, d_rstd, 0),
                         0);
        dget(got, d_y, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed layernorm fwd %s on fp32", dn(low));
        expect_exact(what, got, want, n, low);
        /* its backward in low: dy stored low, x the fp32 stream, dx back in fp32 storage */
        fill(&r, dy, n, 0.1f, low);
        void *d_dy = dput(dy, n, low);
        gpu_gpt_layernorm_bwd(dy, xr, mean, rstd, g, N, C, low, want, dg, db);
        ck_assert_int_eq(gpu_cuda_layernorm_bwd_launch(d_dy, low, d_x, GPU_FP32, d_mean, d_rstd,
                                                       d_g, GPU_FP32, N, C, low, d_y, GPU_FP32,
                                                       d_dg, d_db, NULL, 0),
                         0);
        dget(got, d_y, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed layernorm bwd %s on fp32", dn(low));
        expect_exact(what, got, want, n, low);
        dget(got, d_dg, C, GPU_FP32);
        expect_exact(what, got, dg, C, low);
        dget(got, d_db, C, GPU_FP32);
        expect_exact(what, got, db, C, low);
        /* layer norm in fp32, output cast to low (ln_fwd's cast to lin_dt) */
        void *d_y16 = dput(x, n, low);
        gpu_gpt_layernorm_fwd(x, g, b, N, C, GPU_FP32, want, mean, rstd);
        rnd(want, n, low);
        ck_assert_int_eq(gpu_cuda_layernorm_fwd_launch(d_x, GPU_FP32, d_g, d_b, GPU_FP32, N, C,
                                                       GPU_FP32, d_y16, low, d_mean, d_rstd, 0),
                         0);
        dget(got, d_y16, n, low);
        snprintf(what, sizeof(what), "mixed layernorm fwd fp32 to %s", dn(low));
        expect_exact(what, got, want, n, low);
        /* its backward: dy in low (lin_dt), x fp32, dx fp32 (ln_bwd with ln_dt fp32) */
        gpu_gpt_layernorm_bwd(dy, x, mean, rstd, g, N, C, GPU_FP32, want, dg, db);
        ck_assert_int_eq(gpu_cuda_layernorm_bwd_launch(d_dy, low, d_x, GPU_FP32, d_mean, d_rstd,
                                                       d_g, GPU_FP32, N, C, GPU_FP32, d_y,
                                                       GPU_FP32, d_dg, d_db, NULL, 0),
                         0);
        dget(got, d_y, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed layernorm bwd dy %s", dn(low));
        expect_exact(what, got, want, n, GPU_FP32);
        dget(got, d_dg, C, GPU_FP32);
        expect_exact(what, got, dg, C, GPU_FP32);
        dget(got, d_db, C, GPU_FP32);
        expect_exact(what, got, db, C, GPU_FP32);

        /* GELU in fp32 on a low input, output cast to low; GELU in low on an fp32 input */
        void *d_u16 = dput(xr, n, low), *d_o16 = dput(xr, n, low);
        gpu_gpt_gelu_fwd(want, xr, n, GPU_FP32);
        rnd(want, n, low);
        ck_assert_int_eq(gpu_cuda_gelu_tanh_fwd_launch(d_u16, low, d_o16, low, n, GPU_FP32, 0),
                         0);
        dget(got, d_o16, n, low);
        snprintf(what, sizeof(what), "mixed gelu fwd fp32 on %s", dn(low));
        expect_exact(what, got, want, n, low);
        gpu_gpt_gelu_fwd(want, xr, n, low);
        ck_assert_int_eq(gpu_cuda_gelu_tanh_fwd_launch(d_x, GPU_FP32, d_y, GPU_FP32, n, low, 0),
                         0);
        dget(got, d_y, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed gelu fwd %s on fp32", dn(low));
        expect_exact(what, got, want, n, low);
        /* its backward in fp32: d (low storage) through the fp32 GELU of a low input */
        memcpy(want, dy, n * 4);
        gpu_gpt_gelu_bwd(want, xr, n, GPU_FP32);
        rnd(want, n, low);
        ck_assert_int_eq(gpu_cuda_gelu_tanh_bwd_launch(d_dy, d_dy, low, d_u16, low, n, GPU_FP32,
                                                       0),
                         0);
        dget(got, d_dy, n, low);
        snprintf(what, sizeof(what), "mixed gelu bwd fp32 on %s", dn(low));
        expect_exact(what, got, want, n, low);

        /* bias add: fp32 GEMM output, bias stored low, output in low kept in fp32 storage */
        float *bl = fdup(b, C);
        rnd(bl, C, low);
        void *d_bl = dput(bl, C, low);
        ref_bias_add(want, x, bl, N, C, low);
        ck_assert_int_eq(gpu_cuda_bias_add_launch(d_x, GPU_FP32, d_bl, low, N, C, low, d_y,
                                                  GPU_FP32, 0),
                         0);
        dget(got, d_y, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed bias add %s", dn(low));
        expect_exact(what, got, want, n, low);

        /* embedding: fp32 weights, a low stream kept in fp32 storage */
        fill(&r, wte, (size_t)V * C, 1.0f, GPU_FP32);
        fill(&r, wpe, (size_t)T * C, 1.0f, GPU_FP32);
        for (int i = 0; i < N; i++)
            tok[i] = (int)gpu_rng_below(&r, V);
        void *d_wte = dput(wte, (size_t)V * C, GPU_FP32), *d_wpe = dput(wpe, n, GPU_FP32);
        int *d_tok;
        ck_assert_int_eq(cudaMalloc((void **)&d_tok, N * sizeof(int)), cudaSuccess);
        ck_assert_int_eq(cudaMemcpy(d_tok, tok, N * sizeof(int), cudaMemcpyHostToDevice),
                         cudaSuccess);
        gpu_gpt_embed_fwd(tok, 1, T, C, wte, wpe, GPU_FP32, low, want, tmp);
        ck_assert_int_eq(gpu_cuda_embed_fwd_launch(d_tok, 1, T, C, V, d_wte, d_wpe, GPU_FP32,
                                                   low, d_y, GPU_FP32, 0),
                         0);
        dget(got, d_y, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed embed fwd %s in fp32", dn(low));
        expect_exact(what, got, want, n, low);

        /* embedding backward: the fp32 stream's gradient cast to low on load */
        size_t wbytes = 0;
        void *d_work_e;
        ck_assert_int_eq(gpu_cuda_embed_bwd_workspace(N, &wbytes), 0);
        ck_assert_int_eq(cudaMalloc(&d_work_e, wbytes), cudaSuccess);
        float *dwte = xmalloc((size_t)V * C * 4), *dwpe = xmalloc(n * 4);
        memset(dwte, 0, (size_t)V * C * 4);
        memset(dwpe, 0, n * 4);
        void *d_dwte = dput(dwte, (size_t)V * C, GPU_FP32), *d_dwpe = dput(dwpe, n, GPU_FP32);
        ck_assert_int_eq(gpu_cuda_embed_bwd_launch(d_tok, 1, T, C, V, d_x, GPU_FP32, low,
                                                   (float *)d_dwte, (float *)d_dwpe, d_work_e,
                                                   wbytes, 0),
                         0);
        gpu_gpt_embed_bwd(tok, 1, T, C, xr, dwte, dwpe);
        dget(got, d_dwpe, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed embed bwd fp32 as %s", dn(low));
        expect_exact(what, got, dwpe, n, GPU_FP32);
        float *gw = xmalloc((size_t)V * C * 4);
        dget(gw, d_dwte, (size_t)V * C, GPU_FP32);
        expect_exact(what, gw, dwte, (size_t)V * C, GPU_FP32);

        /* MLP GELU in low on an fp32 linear output: the input is not rounded */
        float *sl = xmalloc(n * 4), *d32 = xmalloc(n * 4);
        ref_act_fwd(GPU_ACT_GELU, want, x, n, low);
        gelu_slack(sl, x, want, n, 3e-7f);
        ck_assert_int_eq(gpu_cuda_act_fwd_launch(GPU_ACT_GELU, d_x, GPU_FP32, d_y16, low, n, low,
                                                 0),
                         0);
        dget(got, d_y16, n, low);
        snprintf(what, sizeof(what), "mixed gelu erf fwd %s on fp32", dn(low));
        expect_vals(what, got, want, n, low, 0, n / 100 + 2, sl);
        /* and its backward: d fp32 rounded to low, the saved input fp32, dx stored low */
        fill(&r, d32, n, 1.0f, GPU_FP32);
        void *d_d32 = dput(d32, n, GPU_FP32);
        memcpy(want, d32, n * 4);
        ref_act_bwd(GPU_ACT_GELU, want, x, n, low);
        memcpy(got, d32, n * 4);
        rnd(got, n, low);
        gelu_slack(sl, got, want, n, 8e-7f);
        ck_assert_int_eq(gpu_cuda_act_bwd_launch(GPU_ACT_GELU, d_d32, d_d32, GPU_FP32, d_x,
                                                 GPU_FP32, n, low, 0),
                         0);
        dget(got, d_d32, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed gelu erf bwd %s on fp32", dn(low));
        expect_vals(what, got, want, n, low, 0, n / 100 + 2, sl);

        /* attention softmax in place (P over S, fp32), and the loss alone (no probs) */
        float *S = xmalloc((size_t)N * N * 4), *P = xmalloc((size_t)N * N * 4);
        attn_inputs(&r, S, 1, N, 4.0f, GPU_FP32);
        ref_attn_fwd(S, 1, N, 16, low, GPU_FP32, P);
        void *d_S = dput(S, (size_t)N * N, GPU_FP32);
        ck_assert_int_eq(gpu_cuda_attn_softmax_fwd_launch(d_S, GPU_FP32, 1, N, 16, low, GPU_FP32,
                                                          d_S, GPU_FP32, NULL, low, 0),
                         0);
        float *gS = xmalloc((size_t)N * N * 4);
        dget(gS, d_S, (size_t)N * N, GPU_FP32);
        snprintf(what, sizeof(what), "mixed attn fwd in place mm %s", dn(low));
        expect_exact(what, gS, P, (size_t)N * N, GPU_FP32);

        int *y = xmalloc(N * sizeof(int)), hits, ghits, *d_yv, *d_hits;
        double loss, scale, gloss, *d_loss;
        ce_inputs(&r, x, y, N, C, GPU_FP32);
        ref_ce_gpt(x, y, N, C, low, GPU_FP32, want, &loss, &hits, &scale);
        void *d_lg = dput(x, n, GPU_FP32), *d_work;
        ck_assert_int_eq(cudaMalloc((void **)&d_yv, N * sizeof(int)), cudaSuccess);
        ck_assert_int_eq(cudaMemcpy(d_yv, y, N * sizeof(int), cudaMemcpyHostToDevice),
                         cudaSuccess);
        ck_assert_int_eq(cudaMalloc((void **)&d_loss, sizeof(double)), cudaSuccess);
        ck_assert_int_eq(cudaMalloc((void **)&d_hits, sizeof(int)), cudaSuccess);
        ck_assert_int_eq(cudaMalloc(&d_work, gpu_cuda_ce_workspace(N)), cudaSuccess);
        ck_assert_int_eq(gpu_cuda_ce_fwd_launch(GPU_CUDA_CE_GPT, d_lg, GPU_FP32, d_yv, N, C, low,
                                                GPU_FP32, NULL, GPU_FP32, d_loss, d_hits, d_work,
                                                0),
                         0);
        ck_assert_int_eq(cudaMemcpy(&gloss, d_loss, sizeof(double), cudaMemcpyDeviceToHost),
                         cudaSuccess);
        ck_assert_int_eq(cudaMemcpy(&ghits, d_hits, sizeof(int), cudaMemcpyDeviceToHost),
                         cudaSuccess);
        snprintf(what, sizeof(what), "mixed ce loss only %s", dn(low));
        expect_loss(what, gloss, loss, scale);
        ck_assert_int_eq(ghits, hits);
        /* fused with the seed from the host (the wrapper takes it from the device) */
        ref_ce_bwd(GPU_CUDA_CE_GPT, want, y, N, C, GPU_FP32, low, 512.0f, N, xr);
        ck_assert_int_eq(gpu_cuda_ce_fused_launch(GPU_CUDA_CE_GPT, d_lg, GPU_FP32, d_yv, N, C,
                                                  low, GPU_FP32, 512.0f, NULL, N, d_loss, d_hits,
                                                  d_work, 0),
                         0);
        dget(got, d_lg, n, GPU_FP32);
        snprintf(what, sizeof(what), "mixed ce fused host seed %s", dn(low));
        expect_exact(what, got, xr, n, low);

        cudaFree(d_x);
        cudaFree(d_y);
        cudaFree(d_y16);
        cudaFree(d_dy);
        cudaFree(d_u16);
        cudaFree(d_o16);
        cudaFree(d_bl);
        cudaFree(d_wte);
        cudaFree(d_wpe);
        cudaFree(d_tok);
        cudaFree(d_S);
        cudaFree(d_lg);
        cudaFree(d_yv);
        cudaFree(d_loss);
        cudaFree(d_hits);
        cudaFree(d_work);
        cudaFree(d_work_e);
        cudaFree(d_dwte);
        cudaFree(d_dwpe);
        cudaFree(d_d32);
        free(dwte);
        free(dwpe);
        free(gw);
        free(sl);
        free(d32);
        free(bl);
        free(S);
        free(P);
        free(gS);
        free(y);
    }
    cudaFree(d_g);
    cudaFree(d_b);
    cudaFree(d_mean);
    cudaFree(d_rstd);
    cudaFree(d_dg);
    cudaFree(d_db);
    free(x);
    free(xr);
    free(g);
    free(b);
    free(want);
    free(got);
    free(mean);
    free(rstd);
    free(dy);
    free(dg);
    free(db);
    free(wte);
    free(wpe);
    free(tmp);
    free(tok);
}
END_TEST

/* The residual stream's fusions (cuda_gpt.c): the add that ends a block fused into the next
 * layer norm, and the layer norm's backward adding into the stream's gradient and leaving its
 * lin_dt copy over dy. Each against gpt.c's separate steps: bit-exact. Two plans per 16-bit
 * dtype: autocast's (an fp32 stream and layer norm, linears in low) and a pure low one; C
 * 100 has a 4-column tail after its 16-lane part; in the pure fp16 plan rows 1 and 2 hold an
 * add that overflows and an infinity. */
START_TEST(t_resid_ln)
{
    if (!have_device())
        return;
    enum { N = 37, C = 100 };
    size_t n = (size_t)N * C;
    float *a = xmalloc(n * 4), *lo = xmalloc(n * 4), *x = xmalloc(n * 4), *y = xmalloc(n * 4);
    float *got = xmalloc(n * 4), *dy = xmalloc(n * 4), *dx = xmalloc(n * 4);
    float *dres = xmalloc(n * 4), *g = xmalloc(C * 4), *b = xmalloc(C * 4), *dg = xmalloc(C * 4);
    float *db = xmalloc(C * 4), *mean = xmalloc(N * 4), *rstd = xmalloc(N * 4);
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 1100);
    fill(&r, g, C, 1.0f, GPU_FP32);
    fill(&r, b, C, 1.0f, GPU_FP32);
    void *d_g = dput(g, C, GPU_FP32), *d_b = dput(b, C, GPU_FP32), *d_mean, *d_rstd, *d_dg, *d_db;
    ck_assert_int_eq(cudaMalloc(&d_mean, N * 4), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&d_rstd, N * 4), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&d_dg, C * 4), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&d_db, C * 4), cudaSuccess);

    for (int k = 0; k < 4; k++) {
        gpu_dtype low = DTS[1 + k % 2], sdt = k < 2 ? GPU_FP32 : low; /* stream and its LN */
        bool acc = k != 1;
        fill(&r, a, n, 3.0f, sdt);
        fill(&r, lo, n, 1.0f, low);
        if (k == 2) { /* the pure fp16 plan (the other plans keep finite column sums) */
            a[C + 5] = lo[C + 5] = gpu_round(40000.0f, low); /* 80000: inf in fp16 */
            lo[2 * C + 7] = -INFINITY;                        /* a row of NaN */
        }
        ref_resid_add(x, a, lo, n, sdt);
        gpu_gpt_layernorm_fwd(x, g, b, N, C, sdt, y, mean, rstd);
        rnd(y, n, low);
        void *d_a = dput(a, n, sdt), *d_lo = dput(lo, n, low), *d_x = dput(a, n, sdt);
        void *d_y = dput(y, n, low);
        ck_assert_int_eq(gpu_cuda_add_layernorm_fwd_launch(d_a, d_lo, low, d_x, sdt, d_g, d_b,
                                                           GPU_FP32, N, C, sdt, d_y, low,
                                                           (float *)d_mean, (float *)d_rstd, 0),
                         0);
        snprintf(what, sizeof(what), "add + layernorm fwd, stream %s, linears %s", dn(sdt),
                 dn(low));
        dget(got, d_x, n, sdt);
        expect_exact(what, got, x, n, sdt);
        dget(got, d_y, n, low);
        expect_exact(what, got, y, n, low);
        dget(got, d_rstd, N, GPU_FP32);
        expect_exact(what, got, rstd, N, GPU_FP32);

        /* backward: dx into dres (added, or written when !acc), then dres's low copy over dy
         * when the stream is wider */
        fill(&r, dy, n, 0.1f, low);
        fill(&r, dres, n, 0.1f, sdt);
        void *d_dy = dput(dy, n, low), *d_dres = dput(dres, n, sdt);
        gpu_gpt_layernorm_bwd(dy, x, mean, rstd, g, N, C, sdt, dx, dg, db);
        if (acc)
            ref_resid_add(dres, dres, dx, n, sdt);
        else
            memcpy(dres, dx, n * 4);
        gpu_cuda_dres out = {d_dres, sdt, acc, sdt != low ? d_dy : NULL, low};
        ck_assert_int_eq(gpu_cuda_layernorm_bwd_resid_launch(d_dy, low, d_x, sdt, d_mean, d_rstd,
                                                             d_g, GPU_FP32, N, C, sdt, &out,
                                                             d_dg, d_db, NULL, 0),
                         0);
        snprintf(what, sizeof(what), "layernorm bwd %s into the %s stream", acc ? "added" : "written",
                 dn(sdt));
        dget(got, d_dres, n, sdt);
        expect_exact(what, got, dres, n, sdt);
        dget(got, d_dg, C, GPU_FP32); /* taken from dy before it was overwritten */
        expect_exact(what, got, dg, C, sdt);
        dget(got, d_db, C, GPU_FP32);
        expect_exact(what, got, db, C, sdt);
        if (sdt != low) {
            rnd(dres, n, low);
            dget(got, d_dy, n, low);
            expect_exact(what, got, dres, n, low);
        }
        cudaFree(d_a);
        cudaFree(d_lo);
        cudaFree(d_x);
        cudaFree(d_y);
        cudaFree(d_dy);
        cudaFree(d_dres);
    }
    /* a lin copy over dy of another storage size is refused */
    gpu_cuda_dres bad = {d_mean, GPU_FP32, true, d_dg, GPU_BF16};
    ck_assert_int_eq(gpu_cuda_layernorm_bwd_resid_launch(d_dg, GPU_FP32, d_db, GPU_FP32, d_mean,
                                                         d_rstd, d_g, GPU_FP32, 1, C, GPU_FP32,
                                                         &bad, d_dg, d_db, NULL, 0),
                     GPU_EINVAL);
    cudaFree(d_g);
    cudaFree(d_b);
    cudaFree(d_mean);
    cudaFree(d_rstd);
    cudaFree(d_dg);
    cudaFree(d_db);
    free(a);
    free(lo);
    free(x);
    free(y);
    free(got);
    free(dy);
    free(dx);
    free(dres);
    free(g);
    free(b);
    free(dg);
    free(db);
    free(mean);
    free(rstd);
}
END_TEST

/* The GELU backward fused with mlp.fc's bias gradient (cuda_gpt.c's gelu_bwd): dx as the
 * plain kernel gives it, db as the bias-gradient kernel gives it from that dx: equal to the
 * CPU's sums up to 256 rows, to the chunked kernel's bits beyond. In place, as the GPT runs
 * it; 72 columns leave part of a block idle. */
START_TEST(t_gelu_bias)
{
    if (!have_device())
        return;
    static const int row_counts[] = {37, 300};
    enum { NC = 72 };
    char what[96];
    gpu_rng r;
    gpu_rng_seed(&r, 1200);
    for (int k = 0; k < 6; k++) {
        gpu_dtype low = DTS[k % 3], dt = k % 2 ? GPU_FP32 : low; /* storage, GELU's dtype */
        int rows = row_counts[k / 3];
        size_t n = (size_t)rows * NC;
        float *u = xmalloc(n * 4), *dx = xmalloc(n * 4), *got = xmalloc(n * 4);
        float *db = xmalloc(NC * 4), *gdb = xmalloc(NC * 4), *sl = xmalloc(NC * 4);
        fill(&r, u, n, 3.0f, low);
        fill(&r, dx, n, 1.0f, low);
        void *d_u = dput(u, n, low), *d_d = dput(dx, n, low), *d_db, *d_db2, *d_work = NULL;
        size_t wb = gpu_cuda_bias_grad_workspace(rows, NC);
        ck_assert_int_eq(cudaMalloc(&d_db, NC * 4), cudaSuccess);
        ck_assert_int_eq(cudaMalloc(&d_db2, NC * 4), cudaSuccess);
        if (wb > 0)
            ck_assert_int_eq(cudaMalloc(&d_work, wb), cudaSuccess);
        gpu_gpt_gelu_bwd(dx, u, n, dt);
        rnd(dx, n, low);
        ck_assert_int_eq(gpu_cuda_gelu_tanh_bwd_bias_launch(d_d, d_d, low, d_u, low, rows, NC, dt,
                                                            low, d_db, d_work, 0),
                         0);
        snprintf(what, sizeof(what), "gelu bwd + bias grad, %d rows, %s in %s", rows, dn(low),
                 dn(dt));
        dget(got, d_d, n, low);
        expect_exact(what, got, dx, n, low);
        ref_bias_grad(db, dx, rows, NC, low, sl);
        dget(gdb, d_db, NC, GPU_FP32);
        expect_cols(what, gdb, db, NC, low, rows, sl);
        /* the bias-gradient kernel on the dx just written: the same bits */
        ck_assert_int_eq(gpu_cuda_bias_grad_launch(d_d, low, rows, NC, low, d_db2, d_work, 0), 0);
        dget(db, d_db2, NC, GPU_FP32);
        expect_exact(what, gdb, db, NC, GPU_FP32);
        cudaFree(d_u);
        cudaFree(d_d);
        cudaFree(d_db);
        cudaFree(d_db2);
        cudaFree(d_work);
        free(u);
        free(dx);
        free(got);
        free(db);
        free(gdb);
        free(sl);
    }
}
END_TEST

/* ---- determinism, empty sizes, bad arguments ------------------------------------------------ */

/* The chunked column sums and the loss sum repeat bit for bit. */
START_TEST(t_repeat)
{
    if (!have_device())
        return;
    enum { N = 1000, C = 96, V = 513 };
    size_t n = (size_t)N * C;
    float *x = xmalloc(n * 4), *g = xmalloc(C * 4), *dy = xmalloc(n * 4), *y = xmalloc(n * 4);
    float *mean = xmalloc(N * 4), *rstd = xmalloc(N * 4), *dx = xmalloc(n * 4);
    float *dg[2], *db[2], *bg[2], *lg = xmalloc((size_t)N * V * 4);
    int *t = xmalloc(N * sizeof(int)), hits[2];
    double loss[2];
    gpu_rng r;
    gpu_rng_seed(&r, 1100);
    fill(&r, x, n, 1.0f, GPU_FP32);
    fill(&r, g, C, 1.0f, GPU_FP32);
    fill(&r, dy, n, 1.0f, GPU_FP32);
    gpu_gpt_layernorm_fwd(x, g, g, N, C, GPU_FP32, y, mean, rstd);
    ce_inputs(&r, lg, t, N, V, GPU_FP32);
    for (int k = 0; k < 2; k++) {
        dg[k] = xmalloc(C * 4);
        db[k] = xmalloc(C * 4);
        bg[k] = xmalloc(C * 4);
        ck_assert_int_eq(gpu_cuda_layernorm_bwd(dy, x, mean, rstd, g, N, C, GPU_FP32, dx, dg[k],
                                                db[k]),
                         0);
        ck_assert_int_eq(gpu_cuda_bias_grad(bg[k], dy, N, C, GPU_FP32), 0);
        ck_assert_int_eq(gpu_cuda_ce_fwd(GPU_CUDA_CE_MLP, lg, GPU_FP32, t, N, V, GPU_FP32,
                                         GPU_FP32, NULL, &loss[k], &hits[k]),
                         0);
    }
    ck_assert_mem_eq(dg[0], dg[1], C * 4);
    ck_assert_mem_eq(db[0], db[1], C * 4);
    ck_assert_mem_eq(bg[0], bg[1], C * 4);
    ck_assert_mem_eq(&loss[0], &loss[1], sizeof(double));
    ck_assert_int_eq(hits[0], hits[1]);
    for (int k = 0; k < 2; k++) {
        free(dg[k]);
        free(db[k]);
        free(bg[k]);
    }
    free(x);
    free(g);
    free(dy);
    free(y);
    free(mean);
    free(rstd);
    free(dx);
    free(lg);
    free(t);
}
END_TEST

START_TEST(t_edges)
{
    if (!have_device())
        return;
    float v[8] = {1, 2, 3, 4, 5, 6, 7, 8}, out[8];
    int y[2] = {0, 0};
    double loss = -1.0;
    int hits = -1;
    /* empty sizes: nothing to do, but sums over no rows are zeros */
    ck_assert_int_eq(gpu_cuda_gelu_tanh_fwd(out, v, 0, GPU_FP16), 0);
    ck_assert_int_eq(gpu_cuda_embed_fwd(y, 0, 3, 4, 5, v, v, GPU_FP32, GPU_FP32, out), 0);
    ck_assert_int_eq(gpu_cuda_attn_softmax_fwd(v, GPU_FP32, 0, 2, 2, GPU_FP32, GPU_FP32, out,
                                               NULL),
                     0);
    for (int j = 0; j < 8; j++)
        out[j] = 9.0f;
    ck_assert_int_eq(gpu_cuda_bias_grad(out, NULL, 0, 8, GPU_BF16), 0);
    for (int j = 0; j < 8; j++)
        ck_assert(out[j] == 0.0f);
    float dg[4] = {9, 9, 9, 9}, db[4] = {9, 9, 9, 9};
    ck_assert_int_eq(gpu_cuda_layernorm_bwd(NULL, NULL, NULL, NULL, NULL, 0, 4, GPU_FP32, NULL,
                                            dg, db),
                     0);
    ck_assert(dg[0] == 0.0f && dg[3] == 0.0f && db[0] == 0.0f && db[3] == 0.0f);
    ck_assert_int_eq(gpu_cuda_ce_fwd(GPU_CUDA_CE_GPT, NULL, GPU_FP32, NULL, 0, 5, GPU_FP32,
                                     GPU_FP32, NULL, &loss, &hits),
                     0);
    ck_assert(loss == 0.0 && hits == 0);
    /* bad arguments */
    ck_assert_int_eq(gpu_cuda_layernorm_fwd(v, v, v, -1, 4, GPU_FP32, out, out, out),
                     GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_layernorm_fwd(v, v, v, 1, 0, GPU_FP32, out, out, out),
                     GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gelu_tanh_fwd(out, v, 8, (gpu_dtype)7), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_act_fwd((gpu_activation)5, out, v, 8, GPU_FP32), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_ce_fwd((gpu_cuda_ce_style)3, v, GPU_FP32, y, 2, 4, GPU_FP32,
                                     GPU_FP32, out, &loss, &hits),
                     GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_ce_bwd(GPU_CUDA_CE_GPT, v, y, 2, 4, GPU_FP32, GPU_FP32, 1.0f, 0,
                                     out),
                     GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_attn_softmax_fwd(v, GPU_FP32, 1, 0, 2, GPU_FP32, GPU_FP32, out,
                                               NULL),
                     GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_embed_fwd_launch(NULL, 1, 1, 1, 1, NULL, NULL, GPU_FP32, GPU_FP32,
                                               NULL, GPU_FP32, 0),
                     GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_embed_bwd_launch(y, 1, 2, 1, 1, v, GPU_FP32, GPU_FP32, out, out,
                                               out, 0, 0),
                     GPU_EINVAL); /* a workspace too small */
}
END_TEST

static Suite *cuda_ops_suite(void)
{
    Suite *s = suite_create("cuda_ops");
    TCase *tc = tcase_create("cuda_ops");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, t_nodev);
    tcase_add_test(tc, t_references);
    tcase_add_test(tc, t_embed);
    tcase_add_test(tc, t_layernorm);
    tcase_add_test(tc, t_gelu_tanh);
    tcase_add_test(tc, t_act);
    tcase_add_test(tc, t_bias);
    tcase_add_test(tc, t_ce);
    tcase_add_test(tc, t_attn);
    tcase_add_test(tc, t_flash);
    tcase_add_test(tc, t_mixed);
    tcase_add_test(tc, t_resid_ln);
    tcase_add_test(tc, t_gelu_bias);
    tcase_add_test(tc, t_repeat);
    tcase_add_test(tc, t_edges);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return cudatest_main("check_cuda_ops", cuda_ops_suite());
}
